"""The ladders' own statistics, beside fit.py's laws: a grid's optimum, the seed spread a difference is
compared with, t-intervals, the seed bootstrap and its agreement, profile intervals, and the claims table
a report ends with. Every interval is 95% (LEVEL); a claim read off bootstrap draws (a best K, a switch
point) is made only when at least AGREEMENT of the draws agree."""

import math

import numpy as np
from scipy import stats as scipy_stats

import fit

LEVEL = 0.95  # the coverage of every interval a report prints
AGREEMENT = 0.90  # the share of bootstrap draws a claim read off them needs


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


def pooled_std(groups):
    """(sigma, dof) of groups of repeated values (seeds of one point): sigma^2 = sum (n_i - 1) s_i^2 / dof,
    dof = sum (n_i - 1); a group of one adds nothing. (None, 0) without a repeated group."""
    replicated = [np.asarray(v, dtype=float) for v in groups if len(v) > 1]
    dof = sum(len(v) - 1 for v in replicated)
    if not dof:
        return None, 0
    return math.sqrt(sum(np.var(v, ddof=1) * (len(v) - 1) for v in replicated) / dof), dof


def seed_spread(rows, group_keys, ref):
    """Loss spread over the reference's repeated seeds: per group (its keys) the mean, sample std and
    count, and the pooled std over groups with its degrees of freedom (the noise scale the report
    compares differences with) -> (per, pooled, dof)."""
    groups = {}
    for r in rows:
        if r["arch"] == ref and r.get("loss") is not None:
            groups.setdefault(tuple(r[k] for k in group_keys), []).append(r["loss"])
    per = {k: (float(np.mean(v)), float(np.std(v, ddof=1)) if len(v) > 1 else None, len(v)) for k, v in groups.items()}
    pooled, dof = pooled_std(groups.values())
    return per, pooled, dof


def t_quantile(dof, level=LEVEL):
    """Student's t quantile of a two-sided interval at `level` with dof degrees of freedom."""
    return float(scipy_stats.t.ppf(0.5 + level / 2, dof))


def t_interval(mean, sigma, n, dof, level=LEVEL):
    """(lo, hi) of a mean of n seeds: mean -+ t(dof) sigma / sqrt(n), sigma the seed std (its own, dof = n - 1,
    or pooled over points, dof theirs); n = 1: the interval of a single run."""
    half = t_quantile(dof, level) * sigma / math.sqrt(n)
    return mean - half, mean + half


def difference_sigma(sigma, n1=1, n2=1):
    """The seed noise of a difference of two means of n1 and n2 seeds: sigma sqrt(1/n1 + 1/n2), so sqrt(2)
    sigma for two single runs (a pair)."""
    return sigma * math.sqrt(1 / n1 + 1 / n2)


def difference(mean1, n1, mean2, n2, sigma, dof, level=LEVEL):
    """mean1 - mean2 against the pooled seed noise: the difference, its sigma (difference_sigma), the
    difference in those sigmas, its t-interval and two-sided p-value -> dict."""
    return contrast([(1, mean1, n1), (-1, mean2, n2)], sigma, dof, level)


def contrast(terms, sigma, dof, level=LEVEL):
    """sum sign x mean over terms [(sign +-1, mean of n seeds, n)], e.g. a difference of two differences,
    against the pooled seed noise sigma sqrt(sum 1/n) -> difference's dict."""
    d = sum(sign * mean for sign, mean, _ in terms)
    s = sigma * math.sqrt(sum(1 / n for _, _, n in terms))
    lo, hi = t_interval(d, s, 1, dof, level)
    return dict(diff=d, sigma=s, z=d / s, lo=lo, hi=hi, p=float(2 * scipy_stats.t.sf(abs(d / s), dof)))


def seed_draws(means, ns, sigma, dof, n_draws, seed=0):
    """The seed bootstrap (parametric): n_draws draws of every point's seed mean, each moved by
    sigma / sqrt(n) x a Student t(dof) draw (sigma, dof: the pooled seed spread; a scalar or one per point),
    so that one mean's 95% band is its t-interval, and three seeds never give a band of their min and
    max. A fixed seed keeps a report deterministic -> array (n_draws, points)."""
    means, ns = np.asarray(means, dtype=float), np.asarray(ns, dtype=float)
    sigma, dof = np.broadcast_to(sigma, means.shape), np.broadcast_to(dof, means.shape)
    rng = np.random.default_rng(seed)
    return means + sigma / np.sqrt(ns) * rng.standard_t(dof, size=(n_draws, len(means)))


def agreement(draws, estimate):
    """The share of draws (rows) equal to the estimate, per column: how often the bootstrap agrees."""
    draws = np.asarray(draws)
    return (draws == np.asarray(estimate)[None]).mean(axis=0) if len(draws) else np.full(np.shape(estimate), np.nan)


def share_verdict(share):
    """A claim that holds in `share` of the bootstrap draws: 'reproduces' at AGREEMENT or more, 'does not' at
    1 - AGREEMENT or less, otherwise 'cannot tell'."""
    return "reproduces" if share >= AGREEMENT else "does not" if share <= 1 - AGREEMENT else "cannot tell"


def interval_verdict(intervals, no_effect):
    """An effect claimed above no_effect: 'reproduces' when every (lo, hi) lies above it, 'does not' when
    one lies below it, otherwise 'cannot tell' (an interval holds it)."""
    intervals = [(lo, hi) for lo, hi in intervals if lo is not None and np.isfinite(lo)]
    if intervals and all(lo > no_effect for lo, _ in intervals):
        return "reproduces"
    return "does not" if any(hi < no_effect for _, hi in intervals) else "cannot tell"


def within_noise(lo, hi, no_difference):
    """True when the interval [lo, hi] does not exclude 'no difference' (None: no interval)."""
    if lo is None or hi is None or not (np.isfinite(lo) and np.isfinite(hi)):
        return None
    return bool(lo <= no_difference <= hi)


def profile_bound(objective, n_points, level=LEVEL):
    """How far a profiled Huber objective may rise above its minimum inside a `level` profile interval: the
    likelihood-ratio bound chi2(1)/2 x (objective / points), as for a Laplace likelihood (Huber on log-loss
    in its linear part, where these residuals lie); the points are taken as independent."""
    return float(scipy_stats.chi2.ppf(level, 1)) / 2 * objective / n_points


def profile_interval(values, objectives, bound):
    """(lo, hi, at_edge) of a profile (values ascending, the objective minimised over everything else at
    each): the values whose objective is within bound of the lowest lie inside [lo, hi], the nearest values
    tried outside them (conservative on a coarse grid); at_edge when they reach either end of the values
    tried (the data do not bound the interval there; lo or hi is then that end)."""
    values, objectives = np.asarray(values, dtype=float), np.asarray(objectives, dtype=float)
    inside = np.flatnonzero(objectives <= objectives.min() + bound)
    first, last = int(inside[0]), int(inside[-1])
    return (float(values[max(first - 1, 0)]), float(values[min(last + 1, len(values) - 1)]),
            first == 0 or last == len(values) - 1)


def claims_lines(claims):
    """The claims table a report ends with: [(the paper's claim, verdict, the number here and its 95%
    interval)], verdict 'reproduces' / 'does not' / 'cannot tell' -> report lines (a Markdown table)."""
    lines = ["claims: what the paper claims, whether it reproduces here, and the number that says so",
             "| paper claim | here | the number [95% interval] |", "| --- | --- | --- |"]
    return lines + [f"| {claim} | {verdict} | {number} |" for claim, verdict, number in claims]
