"""
Speed of fit.py: one SMELT surface fit on 72 points (target < 10 s) and the cell bootstrap of two
surfaces on 144 points (target: 2000 draws < 60 s on 2 cores). One JSON line per measurement.

    python bench/fit_bootstrap.py                 # 2000 draws, all cores
    python bench/fit_bootstrap.py --draws 200 --workers 1

The machine may be shared: load_avg is printed with every line so noisy timings can be read.
"""
import json
import os
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import numpy as np  # noqa: E402

import fit  # noqa: E402
from tooling.tables import read_chinchilla_csv  # noqa: E402
from tooling import common  # noqa: E402
from tooling.common import number  # noqa: E402


def emit(**kw):
    kw["load_avg_1m"] = round(os.getloadavg()[0], 2)
    print(json.dumps(kw), flush=True)


def main():
    p = common.parser("bench/fit_bootstrap.py")
    p.add_argument("--draws", type=number(int, 1), default=2000)
    p.add_argument("--workers", type=number(int, 1), default=os.cpu_count())
    p.add_argument("--repeats", type=number(int, 1), default=3)
    args = p.parse_args()
    runs = fit.synthetic_surface_runs(seed=0)  # 2 archs x 72 points, 12 cells, 0.3% noise
    m = runs["arch"] == "baseline"
    F, S, D, L = (np.asarray(runs[k][m], dtype=float) for k in ("F", "S", "D", "loss"))
    times, cpu = [], []
    for _ in range(args.repeats):
        t, c = time.perf_counter(), time.process_time()
        f = fit.fit_surface(F, S, D, L)
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    emit(name="surface_fit", n_points=int(m.sum()), n_grid=len(fit.SURFACE_GRID), seconds=round(min(times), 3),
         seconds_median=round(float(np.median(times)), 3), cpu_seconds=round(min(cpu), 3), target_seconds=10,
         a=round(f.a, 4), c=round(f.c, 4))

    t = time.perf_counter()
    N, Dc, Lc = (read_chinchilla_csv(os.path.join(os.path.dirname(__file__), "..", "tests", "data",
                                                  "chinchilla_fig4_epoch.csv"))[k] for k in ("N", "D", "loss"))
    keep = np.argsort(Lc)[:-5]
    ch = fit.fit_chinchilla(N[keep], Dc[keep], Lc[keep])
    emit(name="chinchilla_fit", n_points=len(keep), seconds=round(time.perf_counter() - t, 3), E=round(ch.E, 4),
         alpha=round(ch.alpha, 4), beta=round(ch.beta, 4))

    full = {a: fit.fit_surface(*(np.asarray(runs[k][runs["arch"] == a], dtype=float) for k in ("F", "S", "D", "loss")))
            for a in ("baseline", "smelt")}
    t, c = time.perf_counter(), time.process_time()
    out = fit.cell_bootstrap(runs, "baseline", "smelt", [1e20, 1e21], [0.85, 0.95], n_draws=args.draws, seed=0,
                             n_workers=args.workers, full_fits=full, progress=sys.stderr.isatty())
    sec = time.perf_counter() - t
    cpu_sec = time.process_time() - c + resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime  # + the workers
    emit(name="cell_bootstrap", n_points=len(runs["loss"]), surfaces=2, n_draws=args.draws, n_workers=args.workers,
         seconds=round(sec, 2), cpu_seconds_all_processes=round(cpu_sec, 1), draws_per_second=round(args.draws / sec, 1), target_seconds=60 * args.draws / 2000,
         ce_gain_1e21_S095=[round(float(out[k]["ce_gain"][1, 1]), 4) for k in ("value", "lo", "hi")])


if __name__ == "__main__":
    main()
