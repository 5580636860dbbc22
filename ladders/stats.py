"""The ladders' statistics beside fit.py's laws. Every interval is 95%."""

import math

import numpy as np
from scipy import stats as scipy_stats

LEVEL = 0.95


def pooled_std(groups):
    """(sigma, dof) of groups of repeated values, such as seeds."""
    # sigma^2 = sum (n_i - 1) s_i^2 / dof,
    # dof = sum (n_i - 1): one value adds nothing.
    groups = [np.asarray(v, dtype=float) for v in groups if len(v) > 1]
    dof = sum(len(v) - 1 for v in groups)
    if not dof:
        return None, 0
    return math.sqrt(sum(np.var(v, ddof=1) * (len(v) - 1) for v in groups) / dof), dof


def t_interval(mean, sigma, n, dof):
    """mean -+ t(dof) sigma / sqrt(n)."""
    half = scipy_stats.t.ppf(0.5 + LEVEL / 2, dof) * sigma / math.sqrt(n)
    return mean - half, mean + half


def paired(diffs):
    """A contrast paired by seed: {point: [value per seed]}."""
    means = {p: float(np.mean(v)) for p, v in diffs.items()}
    d, (sigma, dof) = float(np.mean(list(means.values()))), pooled_std(diffs.values())
    if not dof:
        nan = math.nan
        return dict(diff=d, sigma=nan, z=nan, lo=nan, hi=nan, p=nan, dof=0, means=means,
                    point_sigma=nan)
    # The noise: the per-seed spread, pooled.
    s = sigma * math.sqrt(sum(1 / len(v) for v in diffs.values())) / len(diffs)
    lo, hi = t_interval(d, s, 1, dof)
    # No spread at all: made-up data.
    z = d / s if s else math.copysign(math.inf, d) if d else 0.0
    p = float(2 * scipy_stats.t.sf(abs(z), dof))
    return dict(diff=d, sigma=s, z=z, lo=lo, hi=hi, p=p, dof=dof, means=means, point_sigma=sigma)


def spreads(groups):
    """A line: the seed std pooled per arm and over every arm."""
    own = {a: pooled_std(g) for a, g in groups.items()}
    own = ", ".join(f"{a} {fmt(s, '.4f')} ({k})" for a, (s, k) in own.items())
    sigma, dof = pooled_std([v for g in groups.values() for v in g])
    return f"seed std pooled over every arm {fmt(sigma, '.4f')} ({dof} dof); each arm's own: {own}"


def seed_draws(means, ns, sigma, dof, n_draws, seed=0):
    """The parametric seed bootstrap of seed means."""
    # A draw moves a mean by sigma / sqrt(n) x a t(dof)
    # draw, so one mean's band is its t-interval.
    # Seeded: a report rebuilds byte for byte.
    means, ns = np.asarray(means, dtype=float), np.asarray(ns, dtype=float)
    sigma, dof = np.broadcast_to(sigma, means.shape), np.broadcast_to(dof, means.shape)
    rng = np.random.default_rng(seed)
    return means + sigma / np.sqrt(ns) * rng.standard_t(dof, size=(n_draws, len(means)))


def profile_bound(objective, n_points):
    """How far a profiled Huber objective may rise inside the interval."""
    # The likelihood-ratio bound of a Laplace likelihood
    # (Huber in its linear part), the points independent.
    return float(scipy_stats.chi2.ppf(LEVEL, 1)) / 2 * objective / n_points


def profile_interval(values, objectives, bound):
    """(lo, hi, at_edge) of a profile over ascending values."""
    # lo and hi: the nearest values outside those within
    # bound of the lowest objective.
    values, objectives = np.asarray(values, dtype=float), np.asarray(objectives, dtype=float)
    inside = np.flatnonzero(objectives <= objectives.min() + bound)
    first, last = int(inside[0]), int(inside[-1])
    lo, hi = values[max(first - 1, 0)], values[min(last + 1, len(values) - 1)]
    return float(lo), float(hi), first == 0 or last == len(values) - 1


def fmt(v, spec):
    """A report's number, '-' where it is missing or not finite."""
    return "-" if v is None or not np.isfinite(v) else format(v, spec)
