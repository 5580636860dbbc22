"""Worker processes that behave: one BLAS thread while fitting, Ctrl-C handled once by the parent, a pool
ended at once on an error (fit.py's bootstrap); and the ladders' job runner (run_ladder): every run in its
own folder, finished once its result file is written, trained in this process or by a pool of workers.
Nothing here imports torch at import time: fit.py stays free of it."""
import contextlib
import json
import multiprocessing
import os
import shutil
import signal
import sys
import threading
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field

import numpy as np
from threadpoolctl import ThreadpoolController

from tooling.common import write_atomic

# One BLAS thread while fitting. Every problem here is tiny (6 parameters, ~100 points), yet scipy's
# L-BFGS-B calls OpenBLAS, whose spin-waiting threads made each iteration ~20-50x slower on a busy
# 2-core machine (23 s vs 1.1 s for 100 bootstrap refits). threadpoolctl sets every BLAS library that
# numpy and scipy loaded to one thread and restores the previous count on exit (process-wide while
# inside). Bootstrap workers are also started with these variables, so they never start BLAS threads.

SINGLE_THREAD_ENV = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}  # workers
_blas = None  # the ThreadpoolController, made on first use


def single_blas_thread():
    """Context manager: the loaded BLAS libraries use one thread inside it."""
    global _blas
    if _blas is None:
        _blas = ThreadpoolController()  # finds the loaded libraries once (~1 ms); each limit() is ~10 us
    return _blas.limit(limits=1, user_api="blas")


def ignore_sigint():
    """A pool worker's initializer: Ctrl-C in a terminal signals every process of the group; the parent
    alone handles it (and ends its workers with stop_workers), so no worker prints a traceback."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def stop_workers(pool):
    """End a ProcessPoolExecutor's workers now (Ctrl-C, an error): queued work is cancelled and running
    work killed, instead of waiting for it as leaving the `with` block would."""
    for process in list((getattr(pool, "_processes", None) or {}).values()):  # no public API before 3.14
        process.terminate()
    pool.shutdown(wait=True, cancel_futures=True)


def progress_bar(total, desc, enabled):
    """A tqdm bar on stderr (or one that does nothing when tqdm is missing or `enabled` is False)."""
    try:
        from tqdm import tqdm
        return tqdm(total=total, desc=desc, disable=not enabled, file=sys.stderr)
    except ImportError:  # tqdm is a listed dependency; keep working without it anyway
        class _Null:
            def update(self, n): pass
            def close(self): pass
        return _Null()


# ----------------------------------------------------------------------------------------------------
# The ladders' job runner. A RunSpec is one call of the training function; its result.json marks it finished.


@dataclass
class RunSpec:
    run_id: str  # unique in the ladder; the run's folder name
    arch: str
    cell: str  # SMELT: "<scale>-e<experts>" (shared by baseline and twin); [X]: "d<depth>"
    role: str  # "stable" (branch source), "branch" (a decay branch -> one fit point), "run" ([X]), "sweep"
    settings: dict  # training overrides (out_dir / run_name / data_dir are filled in by run_ladder)
    meta: dict = field(default_factory=dict)  # what the report needs: F, S, N, depth, planned tokens, ...
    needs: str = ""  # run_id whose checkpoint this run starts from


# what a result file keeps of the training function's summary
RESULT_KEYS = ("val_loss", "val_loss_by_source", "tokens", "flops", "step", "max_steps", "seconds", "unigram_entropy",
               "data_region", "data_read", "data_split", "ckpt_path", "log_path")


def json_default(v):
    """json.dumps' default for numpy numbers and arrays."""
    if isinstance(v, (np.floating, np.integer)):
        return v.item()
    if isinstance(v, np.ndarray):
        return v.tolist()
    raise TypeError(f"not JSON serialisable: {type(v).__name__}")


def write_json_atomic(path, obj):
    text = json.dumps(obj, indent=1, default=json_default)
    write_atomic(os.path.abspath(path), lambda f: f.write(text.encode()))


def run_dir(out_dir, run_id):
    return os.path.join(out_dir, "runs", run_id)


def load_result(out_dir, spec, defaults):
    """The finished result of `spec`, or None. A result written with other settings is an error (defaults:
    {setting: the value it has when nobody sets it}, train.py's)."""
    path = os.path.join(run_dir(out_dir, spec.run_id), "result.json")
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            result = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: unreadable result file ({e}); delete it to rerun that run") from None
    if not same_settings(result.get("settings"), spec.settings, defaults):
        raise ValueError(f"{path}: this run was finished with different settings than preset asks for now; "
                         f"use another --out, or delete {os.path.dirname(path)} to rerun it")
    return result


def _canonical(obj):
    return json.loads(json.dumps(obj, sort_keys=True, default=json_default))


def same_settings(stored, now, defaults):
    """Settings equal, except keys one side lacks that are at their default on the other side (a
    setting added to model.py / train.py since the run finished does not invalidate it)."""
    stored, now = _canonical(stored or {}), _canonical(now)
    for key in set(stored) | set(now):
        if key in stored and key in now:
            if stored[key] != now[key]:
                return False
        elif _canonical({"v": (stored if key in stored else now)[key]}) != _canonical({"v": defaults.get(key, ...)}):
            return False
    return True


def init_path(spec, out_dir):
    """The checkpoint a run starts from. Specs say "{runs}/<stable run>/ckpt_step<N>.pt" so that the
    settings identifying a run do not depend on where its output folder is; an FSDP stable run wrote
    ckpt_step<N>.dcp instead."""
    path = spec.settings["init_from"].replace("{runs}", os.path.join(out_dir, "runs"))
    sharded = os.path.splitext(path)[0] + ".dcp"
    return sharded if not os.path.exists(path) and os.path.exists(sharded) else path


def train_in_run_dir(train_fn, settings, directory, threads=None):
    """train_fn(settings) with its printed output in directory/train.out (what a worker runs): stderr
    too, so the run's own bar stays off (train.py draws one on a terminal only) under the ladder's."""
    if threads:
        import torch
        torch.set_num_threads(threads)
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "train.out"), "a") as out, contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(out):
        summary = train_fn(settings)
    return {k: summary.get(k) for k in RESULT_KEYS} | {"train_losses": summary.get("train_losses")}


def _worker_init():
    """A ladder worker process: Ctrl-C is the parent's to handle (ignore_sigint), and tqdm's lock a
    thread lock: each worker writes only its own train.out, and tqdm's default multiprocessing lock is a
    named semaphore that the resource tracker reports as leaked (a warning on stderr) once the parent
    ends the worker after Ctrl-C."""
    from tqdm import tqdm
    ignore_sigint()
    tqdm.set_lock(threading.RLock())


def run_ladder(specs, out_dir, train_fn, defaults, progress=True, keep_checkpoints=False, log=print, workers=1,
               threads=None, data_dir=""):
    """Train every spec that has no result yet (a run whose checkpoint another needs first) with
    train_fn(settings) -> its summary (train.train); returns {run_id: result}. workers > 1: that many
    processes train at once (train_fn must then be picklable: a module's function), threads torch threads
    each; else one run at a time in this process. defaults: the settings' defaults (load_result)."""
    from tqdm import tqdm

    from tooling import distributed  # torch: imported here, not with fit.py's helpers above
    master = distributed.rank() == 0  # rank 0 writes results and removes checkpoints; every rank trains
    results = {s.run_id: load_result(out_dir, s, defaults) for s in specs}
    ids = [s.run_id for s in specs]
    if len(set(ids)) != len(ids):
        raise ValueError("duplicate run ids in the ladder")
    todo = [s for s in specs if results[s.run_id] is None]
    log(f"ladder {out_dir}: {len(specs)} runs, {len(specs) - len(todo)} finished, {len(todo)} to train"
        + (f" ({workers} workers)" if workers > 1 and todo else ""))
    bar = tqdm(total=len(specs), initial=len(specs) - len(todo), desc="ladder", unit="run",
               disable=not (progress and master), position=0, dynamic_ncols=True)

    def settings_of(spec):
        directory = run_dir(out_dir, spec.run_id)
        if master and os.path.isdir(directory):  # an interrupted attempt: start it again
            shutil.rmtree(directory, ignore_errors=True)
        distributed.barrier()
        settings = dict(spec.settings, out_dir=os.path.join(out_dir, "runs"), run_name=spec.run_id)
        if data_dir:
            settings["data_dir"] = data_dir
        if spec.needs:
            source = settings["init_from"] = init_path(spec, out_dir)
            if not os.path.exists(source):
                raise ValueError(f"run {spec.run_id} starts from {source}, which is missing (the finished run "
                                 f"{spec.needs} lost its checkpoints?); delete {run_dir(out_dir, spec.needs)} to "
                                 "retrain it")
        return settings

    def record_result(spec, summary):
        result = dict(run_id=spec.run_id, arch=spec.arch, cell=spec.cell, role=spec.role, settings=spec.settings,
                      meta=spec.meta, needs=spec.needs, **{k: summary.get(k) for k in RESULT_KEYS})
        losses = summary.get("train_losses") or []
        if losses:
            result["final_train_loss"] = float(np.mean(losses[-max(1, len(losses) // 10):]))
        if master:
            if spec.role == "branch" and not keep_checkpoints and os.path.exists(summary.get("ckpt_path") or ""):
                os.remove(summary["ckpt_path"])  # a branch's final weights are not needed by the ladder
                result["ckpt_path"] = None
            write_json_atomic(os.path.join(run_dir(out_dir, spec.run_id), "result.json"), result)
        distributed.barrier()
        results[spec.run_id] = result
        bar.update(1)
        if master and result["val_loss"] is not None:
            bar.write(f"  {spec.run_id}: val loss {result['val_loss']:.4f}, {result['tokens']:,} tokens, "
                      f"{result['flops']:.3e} FLOPs, {result['seconds']:.0f} s")

    if workers <= 1:
        for spec in todo:
            bar.set_postfix_str(spec.run_id)
            record_result(spec, train_in_run_dir(train_fn, settings_of(spec), run_dir(out_dir, spec.run_id)))
    else:
        _train_in_pool(todo, results, workers, train_fn, threads, settings_of, record_result, out_dir)
    bar.close()
    return results


def _train_in_pool(todo, results, workers, train_fn, threads, settings_of, record_result, out_dir):
    """run_ladder's pool of worker processes; a run starts once the run it branches from has finished."""
    pending, running = list(todo), {}
    context = multiprocessing.get_context("spawn")  # fresh interpreters: no forked torch thread pools
    # Ctrl-C: the workers ignore it; this process ends them (an unfinished run restarts from scratch on
    # the next invocation, so killing one mid-run loses only that run's progress)
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_worker_init) as pool:
        try:
            while pending or running:
                for spec in [s for s in pending if not s.needs or results.get(s.needs)]:
                    if len(running) >= workers:
                        break
                    pending.remove(spec)
                    running[pool.submit(train_in_run_dir, train_fn, settings_of(spec), run_dir(out_dir, spec.run_id),
                                        threads)] = spec
                if not running:
                    raise ValueError(f"runs {[s.run_id for s in pending]} wait for runs that are not in the ladder")
                done, _ = wait(running, return_when=FIRST_COMPLETED)
                for future in done:
                    record_result(running.pop(future), future.result())
        except BrokenProcessPool:  # a worker died (killed, out of memory): its run restarts next time
            stop_workers(pool)
            raise ValueError(f"a worker process died while training {sorted(s.run_id for s in running.values())} "
                             "(killed? out of memory?); rerun the same command to continue (finished runs are "
                             "kept), or use fewer --workers") from None
        except BaseException:
            stop_workers(pool)
            raise
