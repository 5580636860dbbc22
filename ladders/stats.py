"""The ladders' own statistics, beside fit.py's laws: a grid's optimum, the seed spread a difference is
compared with, and whether an interval says "no difference"."""

import math

import numpy as np

import fit


def interpolated_optimum(xs, losses):
    """(x*, edge): the vertex of the parabola in log x through the best grid point and its two neighbours
    (fit.quadratic_vertex); the grid point itself when it is at an edge of the grid (edge -1 / +1, else 0)."""
    order = np.argsort(xs)
    grid = np.asarray(xs, dtype=float)[order]
    y = np.asarray(losses, dtype=float)[order]
    i = int(np.argmin(y))
    if i in (0, len(y) - 1):
        return float(grid[i]), (-1 if i == 0 else 1) if len(y) > 1 else 0
    return fit.quadratic_vertex(grid[i - 1:i + 2], y[i - 1:i + 2], log_y=False)["x_opt"], 0


def seed_spread(rows, group_keys, ref):
    """Loss spread over the reference's repeated seeds: per group (its keys) the mean and sample std,
    and the pooled std over groups (the noise scale the report compares differences with)."""
    groups = {}
    for r in rows:
        if r["arch"] == ref and r.get("loss") is not None:
            groups.setdefault(tuple(r[k] for k in group_keys), []).append(r["loss"])
    per = {k: (float(np.mean(v)), float(np.std(v, ddof=1)) if len(v) > 1 else None, len(v)) for k, v in groups.items()}
    replicated = [v for v in groups.values() if len(v) > 1]
    pooled = math.sqrt(sum(np.var(v, ddof=1) * (len(v) - 1) for v in replicated) /
                       sum(len(v) - 1 for v in replicated)) if replicated else None
    return per, pooled


def within_noise(lo, hi, no_difference):
    """True when the interval [lo, hi] does not exclude 'no difference' (None: no interval)."""
    if lo is None or hi is None or not (np.isfinite(lo) and np.isfinite(hi)):
        return None
    return bool(lo <= no_difference <= hi)
