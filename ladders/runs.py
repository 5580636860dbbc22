"""A ladder's runs: each one call of train.train(settings) in its own folder OUT/runs/<run_id>, finished once
its result.json is written (never trained again); several at once in worker processes; the bracketing search
the protocols' sweeps share; the data a preset reads; its CSV files."""

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
    run_id: str  # its folder's name, unique in the ladder
    settings: dict  # train.py settings (out_dir, data_dir and init_from are added when it trains)
    meta: dict = field(default_factory=dict)  # its CSV row's columns known before it trains
    needs: tuple = None  # (stable run id, step): a decay branch forks from that run's ckpt_step<step>.pt
    model: dict = None  # ModelConfig fields train.py has no setting for (recipe's loop_scale)


def search(tried, neighbours, runs, results):
    """A bracketing search on a grid: while every run of the values tried has finished and the best (the
    mean loss over its seeds) lacks a neighbour, the missing neighbours are tried too. runs(value) -> its
    specs -> (the values tried, the best one or None while runs are missing)."""
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
    """neighbours(v) on a grid of values a constant ratio apart (an LR, a weight decay), at most `extend`
    steps beyond its ends."""
    ratio = values[1] / values[0] if len(values) > 1 else 2.0
    lo, hi = values[0] / ratio ** (extend + 0.5), values[-1] * ratio ** (extend + 0.5)
    return lambda v: [float(f"{n:.12g}") for n in (v / ratio, v * ratio) if lo < n < hi]


def data_dir(preset):
    """The folder a preset's runs read: its train data_dir, or the embedded corpus in its tokenizer (prepared
    once, offline)."""
    if preset["train"].get("data_dir"):
        return preset["train"]["data_dir"]
    from data import prepare
    return prepare.prepare_default(None, preset["tokenizer"], verbose=False)


def folder(out, run_id):
    return os.path.join(out, "runs", run_id)


def load_results(out, specs):
    """{run_id: result} of the specs finished in OUT; one trained with other settings is refused."""
    results = {}
    for s in specs:
        path = os.path.join(folder(out, s.run_id), "result.json")
        if os.path.exists(path):
            with open(path) as f:
                results[s.run_id] = json.load(f)
            if results[s.run_id]["settings"] != json.loads(json.dumps(s.settings)):
                raise ValueError(f"{path}: trained with other settings than the preset's now; give another "
                                 "--out")
    return results


def train_one(train_fn, spec, settings):
    """One run in this process: train_fn(settings) on one thread, its output in the folder's train.out ->
    its result, written to result.json last (atomically: the run is finished once it is there)."""
    import torch
    torch.set_num_threads(1)
    with open(os.path.join(settings["out_dir"], "train.out"), "a") as f, contextlib.redirect_stdout(f), \
            contextlib.redirect_stderr(f):
        summary = train_fn(settings, **({"model_fields": spec.model} if spec.model else {}))
    losses = summary.get("train_losses") or [np.nan]
    tail = losses[-max(1, len(losses) // 10):]  # the training loss of the run's last tenth
    result = dict(run_id=spec.run_id, settings=spec.settings, train_loss=float(np.mean(tail)),
                  **{k: summary.get(k) for k in ("val_loss", "val_loss_by_source", "tokens", "flops", "step",
                                                 "seconds", "scores")})
    if os.path.exists(summary.get("log_path") or ""):  # the epochs of its data region it read
        result["epochs"] = plots.read_log(summary["log_path"])[-1]["epochs"]
    if spec.needs and os.path.exists(summary.get("ckpt_path") or ""):
        os.remove(summary["ckpt_path"])  # a branch's final weights: no run forks from them
    path = os.path.join(settings["out_dir"], "result.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f, indent=1)
    os.replace(path + ".tmp", path)
    return result


def worker(conn, gpu):
    """A worker process: trains each run it is sent (with the train function sent along) until the ladder
    ends it; one thread, and its own GPU where there are any."""
    if gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu)
    import threading
    from tqdm import tqdm
    tqdm.set_lock(threading.RLock())  # not a semaphore, which a killed worker would leave behind
    try:
        while True:
            spec, settings, train_fn = conn.recv()
            try:
                train_one(train_fn, spec, settings)
                conn.send((spec.run_id, None))
            except Exception as e:  # the ladder says which run and why, and stops
                conn.send((spec.run_id, f"{type(e).__name__}: {e}"))
    except (KeyboardInterrupt, EOFError):  # Ctrl-C, or the ladder has ended
        pass


def train_runs(specs, out, train_fn, data, workers, bar):
    """Train the specs (none waiting for another) on the data folder with train_fn (train.train, or a task's
    own): one by one here, or with workers > 1 that many at once in worker processes -> {run_id: result}. A
    run that had started before starts again from scratch."""
    jobs, results = [], {}
    for s in specs:
        settings = dict(s.settings, out_dir=folder(out, s.run_id), data_dir=data)
        if s.needs:
            settings["init_from"] = os.path.join(folder(out, s.needs[0]), f"ckpt_step{s.needs[1]}.pt")
        shutil.rmtree(settings["out_dir"], ignore_errors=True)
        os.makedirs(settings["out_dir"])
        jobs.append((s, settings, train_fn))
    if workers <= 1 or len(jobs) <= 1:
        for s, settings, _ in jobs:
            results[s.run_id] = train_one(train_fn, s, settings)
            bar.update(1)
        return results
    import torch
    gpus, context, procs = torch.cuda.device_count(), multiprocessing.get_context("spawn"), []
    os.environ.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")  # inherited
    try:
        for i in range(min(workers, len(jobs))):
            conn, theirs = context.Pipe()
            procs.append((context.Process(target=worker, args=(theirs, i % gpus if gpus else None),
                                          daemon=True), conn))
            procs[-1][0].start()
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
                    raise ValueError("a worker process died (killed? out of memory?): rerun the same command "
                                     "to continue") from None
                if error:
                    raise ValueError(f"run {run_id}: {error} (its output: {folder(out, run_id)}/train.out)")
                with open(os.path.join(folder(out, run_id), "result.json")) as f:
                    results[run_id] = json.load(f)
                bar.update(1)
    finally:
        for proc, _ in procs:  # at the end, on Ctrl-C or on an error: no worker keeps training
            proc.kill()
    return results


def run_rows(specs, results, columns, sources=False):
    """runs.csv's rows: one per finished run but the LR sweeps' (role "sweep"), its meta and what train.py
    counted (tokens D, FLOPs C and F = C / D, the val loss; with sources, the loss per source too)."""
    out = []
    for s in (s for s in specs if s.run_id in results and s.meta.get("role") != "sweep"):
        r = results[s.run_id]
        row = dict(dict(tpp=r["tokens"] / s.meta["N"], epochs=r.get("epochs")) | s.meta, D=r["tokens"],
                   C=r["flops"], F=r["flops"] / r["tokens"], loss=r["val_loss"], run_id=s.run_id,
                   seconds=r["seconds"])
        by_source = {f"loss_{k}": v for k, v in (r["val_loss_by_source"] or {}).items()} if sources else {}
        out.append({k: row[k] for k in columns} | by_source)
    return out


def write_csv(path, rows):
    """rows (dicts) as a CSV file, the columns in order of appearance; None is an empty cell."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, list(dict.fromkeys(k for r in rows for k in r)))
        writer.writeheader()
        writer.writerows(rows)

