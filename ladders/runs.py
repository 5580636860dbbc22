"""A ladder's runs: each one call of train.train(settings) in its own folder
OUT/runs/<run_id>, finished once its result.json is written."""

import contextlib
import csv
import json
import multiprocessing
import multiprocessing.connection
import os
import shutil
from dataclasses import dataclass, field

import numpy as np

import plots


@dataclass
class RunSpec:
    # Its folder's name.
    run_id: str
    # train.py settings, less the folders.
    settings: dict
    # Its CSV row's columns known beforehand.
    meta: dict = field(default_factory=dict)
    # A decay branch forks from (run id, step).
    needs: tuple = None
    # ModelConfig fields train.py has no flag for.
    model: dict = None


def search(tried, neighbours, runs, results):
    """A bracketing search on a grid -> (the values tried, the best or None)."""
    # While the best lacks a neighbour, try those too.
    while True:
        losses = {}
        for v in tried:
            got = [results.get(s.run_id) for s in runs(v)]
            if None in got:
                return tried, None
            losses[v] = np.mean([r["val_loss"] for r in got])
        best = min(tried, key=losses.get)
        new = [n for n in neighbours(best) if n not in tried]
        if not new:
            return tried, best
        tried = tried + new


def grid_neighbours(values, extend):
    """neighbours(v) on a geometric grid, at most `extend` beyond its ends."""
    ratio = values[1] / values[0] if len(values) > 1 else 2.0
    lo, hi = values[0] / ratio ** (extend + 0.5), values[-1] * ratio ** (extend + 0.5)
    return lambda v: [float(f"{n:.12g}") for n in (v / ratio, v * ratio) if lo < n < hi]


def tokens_per_step(preset):
    t = preset["train"]
    return (t.get("global_batch") or t["batch_size"]) * preset["model"]["block_size"]


def data_dir(preset):
    """The folder a preset's runs read."""
    # Its own data_dir, or else the embedded corpus,
    # prepared once, offline.
    if preset["train"].get("data_dir"):
        return preset["train"]["data_dir"]
    from data import prepare
    return prepare.prepare_default(None, preset["tokenizer"], verbose=False)


def folder(out, run_id):
    return os.path.join(out, "runs", run_id)


def load_results(out, specs):
    """{run_id: result} of the specs finished in OUT."""
    results = {}
    for s in specs:
        path = os.path.join(folder(out, s.run_id), "result.json")
        if os.path.exists(path):
            with open(path) as f:
                results[s.run_id] = json.load(f)
            if results[s.run_id]["settings"] != json.loads(json.dumps(s.settings)):
                raise ValueError(f"{path}: trained with other settings than the preset's "
                                 "now; give another --out")
    return results


def train_one(train_fn, spec, settings):
    """One run in this process, on one thread -> its result."""
    import torch
    torch.set_num_threads(1)
    out = settings["out_dir"]
    with open(os.path.join(out, "train.out"), "a") as f, contextlib.redirect_stdout(f), \
            contextlib.redirect_stderr(f):
        summary = train_fn(settings, **({"model_fields": spec.model} if spec.model else {}))
    losses = summary.get("train_losses") or [np.nan]
    # The train loss of the last tenth.
    tail = losses[-max(1, len(losses) // 10):]
    result = dict(run_id=spec.run_id, settings=spec.settings, train_loss=float(np.mean(tail)),
                  **{k: summary.get(k) for k in ("val_loss", "val_loss_by_source", "tokens",
                                                 "flops", "step", "seconds", "scores")})
    # The epochs of its data region read.
    if os.path.exists(summary.get("log_path") or ""):
        result["epochs"] = plots.read_log(summary["log_path"])[-1]["epochs"]
    # No run forks from a branch's final weights.
    if spec.needs and os.path.exists(summary.get("ckpt_path") or ""):
        os.remove(summary["ckpt_path"])
    # result.json comes last, atomically:
    # the run is finished once it is there.
    path = os.path.join(out, "result.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f, indent=1)
    os.replace(path + ".tmp", path)
    return result


def worker(conn, gpu):
    """A worker process: trains each run it is sent."""
    if gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu)
    import threading
    from tqdm import tqdm
    # A killed worker would leave a semaphore behind.
    tqdm.set_lock(threading.RLock())
    try:
        while True:
            spec, settings, train_fn = conn.recv()
            try:
                train_one(train_fn, spec, settings)
                conn.send((spec.run_id, None))
            # The ladder says which run failed and why, and stops.
            except Exception as e:
                conn.send((spec.run_id, f"{type(e).__name__}: {e}"))
    # Ctrl-C, or the ladder has ended.
    except (KeyboardInterrupt, EOFError):
        pass


def train_runs(specs, out, train_fn, data, workers, bar):
    """Train the specs, `workers` at once -> {run_id: result}."""
    jobs, results = [], {}
    for s in specs:
        settings = dict(s.settings, out_dir=folder(out, s.run_id), data_dir=data)
        if s.needs:
            settings["init_from"] = os.path.join(folder(out, s.needs[0]),
                                                 f"ckpt_step{s.needs[1]}.pt")
        # A run started before starts again.
        shutil.rmtree(settings["out_dir"], ignore_errors=True)
        os.makedirs(settings["out_dir"])
        jobs.append((s, settings, train_fn))
    if workers <= 1 or len(jobs) <= 1:
        for s, settings, _ in jobs:
            results[s.run_id] = train_one(train_fn, s, settings)
            bar.update(1)
        return results
    import torch
    # Spawned workers, one run each at a time.
    gpus, context, procs = torch.cuda.device_count(), multiprocessing.get_context("spawn"), []
    # The workers inherit these.
    os.environ.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    try:
        for i in range(min(workers, len(jobs))):
            conn, theirs = context.Pipe()
            args = (theirs, i % gpus if gpus else None)
            procs.append((context.Process(target=worker, args=args, daemon=True), conn))
            procs[-1][0].start()
        # Send a run to each idle worker, then wait for any.
        idle, busy = [conn for _, conn in procs], set()
        while jobs or busy:
            while jobs and idle:
                conn = idle.pop()
                conn.send(jobs.pop(0))
                busy.add(conn)
            for conn in multiprocessing.connection.wait(list(busy)):
                busy.remove(conn)
                idle.append(conn)
                try:
                    run_id, error = conn.recv()
                except EOFError:
                    raise ValueError("a worker process died (killed? out of memory?): "
                                     "rerun the same command to continue") from None
                if error:
                    where = f"{folder(out, run_id)}/train.out"
                    raise ValueError(f"run {run_id}: {error} (its output: {where})")
                with open(os.path.join(folder(out, run_id), "result.json")) as f:
                    results[run_id] = json.load(f)
                bar.update(1)
    # At the end, on Ctrl-C or on an error:
    # no worker keeps training.
    finally:
        for proc, _ in procs:
            proc.kill()
    return results


def run_rows(specs, results, columns, sources=False):
    """runs.csv's rows: meta and what train.py counted."""
    # The LR sweeps' runs are in lr_sweep.csv.
    out = []
    for s in (s for s in specs if s.run_id in results and s.meta.get("role") != "sweep"):
        r = results[s.run_id]
        row = dict(dict(tpp=r["tokens"] / s.meta["N"], epochs=r.get("epochs")) | s.meta,
                   D=r["tokens"], C=r["flops"], F=r["flops"] / r["tokens"],
                   loss=r["val_loss"], run_id=s.run_id, seconds=r["seconds"])
        by_source = r["val_loss_by_source"] or {} if sources else {}
        out.append({k: row[k] for k in columns} | {f"loss_{k}": v for k, v in by_source.items()})
    return out


def write_csv(path, rows):
    """Dicts as a CSV file; None is an empty cell."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, list(dict.fromkeys(k for r in rows for k in r)))
        writer.writeheader()
        writer.writerows(rows)
