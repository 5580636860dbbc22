"""Worker processes that behave: one BLAS thread while fitting, Ctrl-C handled once by the parent, a pool
ended at once on an error. Used by fit.py's bootstrap and ladder.py's job runner."""
import signal
import sys

from threadpoolctl import ThreadpoolController

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
