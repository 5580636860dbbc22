"""
Scaling-law fits of both papers, each by huber_fit.py: SMELT surfaces [S2]-[S5], Chinchilla Approach 3, the
[X] protocol and compute multipliers [X4]-[X7]; the cell bootstrap, quadratic vertices; read_runs, the one
runs-CSV reader. `python fit.py NAME --help` lists a fit's flags and the CSV columns it reads.

    python fit.py surface RUNS.csv --ref baseline --target smelt [--bootstrap 2000] [--json] [--plot F.png]
    python fit.py chinchilla tests/data/chinchilla_fig4_epoch.csv --drop-highest 5
    python fit.py power tests/data/power_example.csv --ref vanilla [--min-depth 8] [--json] [--plot F.png]
"""
import argparse
import csv
import json
import math
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from itertools import repeat

import numpy as np
from scipy.optimize import least_squares
from scipy.stats import linregress
from tqdm import tqdm

from huber_fit import HUBER_DELTA, exponent_grid, fit_core

HOFFMANN_INIT = dict(E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28)  # Hoffmann et al. 2022 published fit

# the starting grids of exponents (a, b, c) of each law (fit_core keeps the best few)
SURFACE_GRID = exponent_grid(np.geomspace(0.05, 2, 20), np.linspace(-0.5, 3, 15), np.geomspace(0.05, 2, 20))
CHINCHILLA_GRID = exponent_grid(np.geomspace(0.02, 2.5, 40), [0.0], np.geomspace(0.02, 2.5, 40))
POWER_GRID = exponent_grid(np.geomspace(0.005, 3.0, 400), [0.0], [0.0])


# -----------------------------------------------------------------------------
# Reading a runs CSV (the one reader: fit.py, downstream.py and the ladders use it)

def _cell(text):
    """A CSV cell as what it reads as: int, float, None (empty), bool or str."""
    text = (text or "").strip()
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"": None, "True": True, "False": False}.get(text, text)


def read_runs(path, numbers=(), text=(), rename=None):
    """The rows of a runs CSV as dicts, each cell None (empty), bool, int, float or str; the `numbers`
    columns must hold finite numbers, the `text` ones are kept as written; `rename` maps header names."""
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.DictReader(f)
        reader.fieldnames = [(rename or {}).get(n.strip(), n.strip()) for n in reader.fieldnames or []]
        twice = [n for n in dict.fromkeys(reader.fieldnames) if reader.fieldnames.count(n) > 1]
        if twice:  # csv.DictReader would keep the last of the two columns
            raise ValueError(f"{path}: column {twice[0]!r} appears more than once in its header")
        missing = [c for c in (*numbers, *text) if c not in reader.fieldnames]
        if missing:
            raise ValueError(f"{path}: no column {', '.join(missing)} in its header {reader.fieldnames}")
        rows = []
        for row in reader:
            row = {k: (v or "").strip() if k in text else _cell(v) for k, v in row.items() if k is not None}
            bad = [c for c in numbers if type(row[c]) not in (int, float) or not math.isfinite(row[c])]
            if bad:
                raise ValueError(f"{path} line {reader.line_num}: {bad[0]} {row[bad[0]]!r} is not a number")
            rows.append(row)
    return rows


def _column(rows, key, arch=None):
    return np.array([r[key] for r in rows if arch is None or r["arch"] == arch], dtype=float)


def check_points(n, n_coef, what, distinct=None):
    """n points fit n_coef coefficients when n > n_coef (and, for a law in C, n_coef distinct computes)."""
    if n <= n_coef or (distinct is not None and distinct < n_coef):
        at = "" if distinct is None else f" at {distinct} distinct computes"
        raise ValueError(f"{what}: {n} points{at} is too few to fit {n_coef} coefficients")


def _positive(**values):
    for name, v in values.items():
        if not np.all(np.isfinite(v) & (v > 0)):
            raise ValueError(f"{name} must be finite and > 0")


# -----------------------------------------------------------------------------
# SMELT surface [S2] and its closed forms [S3]-[S5]

@dataclass
class SurfaceFit:
    """[S2] L(F, S, D) = E + A (1-S)^b / F^a + K / D^c."""
    E: float
    A: float
    a: float
    b: float
    K: float
    c: float
    rmse: float = float("nan")  # nats, on the fitted points
    objective: float = float("nan")  # summed Huber on log-loss
    n_points: int = 0

    @property
    def gamma(self):
        return self.a * self.c / (self.a + self.c)  # [S4] the frontier's exponent

    def loss(self, F, S, D):
        F, S, D = (np.asarray(v, dtype=float) for v in (F, S, D))
        return self.E + self.A * (1.0 - S) ** self.b / F ** self.a + self.K / D ** self.c  # [S2]

    def to_dict(self):
        return {**{k: getattr(self, k) for k in ("E", "A", "a", "b", "K", "c", "rmse")}, "gamma": self.gamma}


def fit_surface(F, S, D, loss, weights=None, init=None, grid=SURFACE_GRID, n_keep=8, delta=HUBER_DELTA,
                centre=None, fixed_exponents=None):
    """[S2] by summed Huber(delta) on log-loss, L-BFGS-B from the grid's best points and `init` (a
    SurfaceFit; grid=None: it alone). fixed_exponents (a, b, c), None for a free one: those held [S 5.2].
    The logs are centred (on `centre`, default their means: A and a decorrelate); results uncentred."""
    F, S, D, loss = (np.asarray(v, dtype=float).ravel() for v in (F, S, D, loss))
    _positive(F=F, D=D, loss=loss, **{"1 - S": 1 - S})
    weights = np.ones_like(loss) if weights is None else np.asarray(weights, dtype=float)
    held = np.array([v is not None for v in fixed_exponents or (None,) * 3])
    n_used = int(np.count_nonzero(weights))
    check_points(n_used, 6 - int(held.sum()), "SMELT surface")
    u, x, y = np.log1p(-S), np.log(F), np.log(D)
    u0, x0, y0 = centre or (u.mean(), x.mean(), y.mean())
    free = np.ones(6, dtype=bool)
    if held.any():  # the held exponents at their values in every start, the free ones from the grid
        free[np.array([2, 3, 5])[held]] = False
        grid = np.unique(np.where(held, [0.0 if v is None else v for v in fixed_exponents], grid), axis=0)
    inits = [] if init is None else [np.array([math.log(init.E), math.log(init.A) + init.b * u0 - init.a * x0,
                                               init.a, init.b, math.log(init.K) - init.c * y0, init.c])]
    theta, value, _ = fit_core(u - u0, x - x0, y - y0, loss, weights, delta, free, grid, n_keep, inits)
    logE, logA, a, b, logK, c = (float(t) for t in theta)
    fit = SurfaceFit(E=math.exp(logE), A=math.exp(logA - b * u0 + a * x0), a=a, b=b,
                     K=math.exp(logK + c * y0), c=c, objective=value, n_points=n_used)
    fit.rmse = float(np.sqrt(np.average((fit.loss(F, S, D) - loss) ** 2, weights=weights)))
    return fit


def optimal_flops(fit, C, S):
    """[S3] F* = (a A (1-S)^b C^c / (c K))^(1/(a+c)): compute-optimal FLOPs per token under C = F D."""
    C, S = np.asarray(C, dtype=float), np.asarray(S, dtype=float)
    return (fit.a * fit.A * (1 - S) ** fit.b * C ** fit.c / (fit.c * fit.K)) ** (1 / (fit.a + fit.c))


def frontier_prefactor(fit, S):
    """[S4] f(A, K, a, b, c, S) such that L*(C, S) = E + f C^-gamma."""
    A_s = fit.A * (1 - np.asarray(S, dtype=float)) ** fit.b
    G = (fit.a * A_s / (fit.c * fit.K)) ** (1 / (fit.a + fit.c))  # F* = G C^(c/(a+c))
    return A_s * G ** (-fit.a) + fit.K * G ** fit.c


def frontier_loss(fit, C, S):
    return fit.E + frontier_prefactor(fit, S) * np.asarray(C, dtype=float) ** (-fit.gamma)  # [S4] L*(C, S)


def frontier_curves(fits):
    """{arch: (gamma, excess(C, S) = L*(C, S) - E)} of surface fits [S4] (plots.plot_surface_frontiers)."""
    return {arch: (f.gamma, lambda C, S, f=f: frontier_loss(f, C, S) - f.E) for arch, f in fits.items()}


def frontier_compute(fit, loss, S):
    """[S4] inverted: the budget C at which the frontier reaches `loss` (inf when loss <= E)."""
    excess = np.asarray(loss, dtype=float) - fit.E
    with np.errstate(divide="ignore", invalid="ignore"):
        log_c = -np.log(excess / frontier_prefactor(fit, S)) / fit.gamma
    return np.where(excess > 0, np.exp(log_c), np.inf)


def ce_gain(ref_fit, tgt_fit, C, S):
    """[S5] CE Gain = 1 - C / C_ref, C_ref the reference budget reaching the target's L*(C, S): 0 for
    equal surfaces, > 0 when the target's frontier is lower, 1 when the reference never reaches it."""
    with np.errstate(divide="ignore", invalid="ignore"):  # a degenerate surface (a or c = 0) gives nan
        return 1.0 - np.asarray(C, dtype=float) / frontier_compute(ref_fit, frontier_loss(tgt_fit, C, S), S)


def tpp(fit, C, S):
    """Tokens per dense-equivalent parameter at the optimum: TPP = D* / (F*/6), D* = C / F*."""
    with np.errstate(divide="ignore", invalid="ignore"):
        F_opt = optimal_flops(fit, C, S)
        return (np.asarray(C, dtype=float) / F_opt) / (F_opt / 6.0)


def fit_subsets(full_fit, F, S, D, loss, subset, weights=None):
    """[S 5.2] {label: SurfaceFit} per subset label, sharing full_fit's (a, b, c) and refitting (E, A, K)."""
    subset, arrays = np.asarray(subset), [np.asarray(v) for v in (F, S, D, loss)]
    return {label: fit_surface(*(v[subset == label] for v in arrays),
                               weights=None if weights is None else np.asarray(weights)[subset == label],
                               fixed_exponents=(full_fit.a, full_fit.b, full_fit.c))
            for label in dict.fromkeys(subset.tolist())}


# -----------------------------------------------------------------------------
# Chinchilla Approach 3: L(N, D) = E + A / N^alpha + B / D^beta, the same protocol

@dataclass
class ChinchillaFit:
    E: float
    A: float
    B: float
    alpha: float
    beta: float
    objective: float = float("nan")  # summed Huber on log-loss
    rmse: float = float("nan")

    def loss(self, N, D):
        N, D = np.asarray(N, dtype=float), np.asarray(D, dtype=float)
        return self.E + self.A / N ** self.alpha + self.B / D ** self.beta

    def to_dict(self):
        return {k: v for k, v in asdict(self).items() if k != "rmse"}


def fit_chinchilla(N, D, loss, grid=CHINCHILLA_GRID, inits=(), reduce="sum", centre=True, n_keep=8,
                   delta=HUBER_DELTA, tol="tight"):
    """Chinchilla Approach 3 by summed Huber on log-loss from the grid (and `inits`: dicts E, A, B, alpha,
    beta). The naive protocol: grid=None, inits=[HOFFMANN_INIT], reduce="mean", centre=False, tol="scipy"."""
    N, D, loss = (np.asarray(v, dtype=float).ravel() for v in (N, D, loss))
    _positive(N=N, D=D, loss=loss)
    check_points(len(loss), 5, "Chinchilla fit")
    x0, y0 = (float(np.mean(np.log(N))), float(np.mean(np.log(D)))) if centre else (0.0, 0.0)
    starts = [np.array([math.log(p["E"]), math.log(p["A"]) - p["alpha"] * x0, p["alpha"], 0.0,
                        math.log(p["B"]) - p["beta"] * y0, p["beta"]]) for p in inits]
    free = np.array([True, True, True, False, True, True])
    theta, value, _ = fit_core(np.zeros_like(loss), np.log(N) - x0, np.log(D) - y0, loss, np.ones_like(loss),
                               delta, free, grid, n_keep, starts, reduce, tol=tol)
    logE, logA, alpha, _, logB, beta = (float(t) for t in theta)
    fit = ChinchillaFit(E=math.exp(logE), A=math.exp(logA + alpha * x0), B=math.exp(logB + beta * y0),
                        alpha=alpha, beta=beta, objective=value)
    fit.rmse = float(np.sqrt(np.mean((fit.loss(N, D) - loss) ** 2)))
    return fit


# -----------------------------------------------------------------------------
# The [X] protocol: L(C) = E + A (C/C0)^-gamma [X5], E fitted on the reference ("x": the paper's recipe, from
# its public code's facts; "huber-log": the surfaces' protocol) and shared [X7], compute multipliers [X6]

C_REF = 1e18  # [X]: L(C) = E + A (C / 1e18)^-gamma
POWER_PROTOCOLS = ("x", "huber-log")  # fit_power_law_x, fit_power_law_huber_log


@dataclass
class PowerLawFit:
    """[X5] L(C) = E + A (C / C0)^-gamma; gamma_se from the fixed-E regression [X7] (nan for a free fit)."""
    E: float
    A: float
    gamma: float
    C0: float = C_REF
    gamma_se: float = float("nan")

    def loss(self, C):
        return self.E + self.A * (np.asarray(C, dtype=float) / self.C0) ** (-self.gamma)

    def compute(self, loss):
        """[X5] inverted: the budget reaching `loss` (inf when loss <= E)."""
        excess = np.asarray(loss, dtype=float) - self.E
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(excess > 0, self.C0 * (excess / self.A) ** (-1 / self.gamma), np.inf)

    def to_dict(self):
        return asdict(self)


def _power_inputs(C, loss, n_coef, name):
    C, loss = np.asarray(C, dtype=float).ravel(), np.asarray(loss, dtype=float).ravel()
    _positive(C=C, loss=loss)
    check_points(len(loss), n_coef, name, distinct=len(set(C.tolist())))
    return C, loss


def fit_power_law_x(C, loss, C0=C_REF, n_grid=600, name="power-law fit"):
    """[X]'s free fit of E, A, gamma: (1) for each of n_grid values of E in [0, 0.995 min L] the least-squares
    line through (log C/C0, log(L - E)), kept when it falls; the one with the smallest squared loss residuals
    starts (2) bounded least squares on the raw loss (A, gamma >= 0, 0 <= E < min L), then (3) a Huber pass
    with f_scale = 1.345 MAD / 0.67449 of (2)'s residuals (floored at 1e-6)."""
    C, loss = _power_inputs(C, loss, 3, name)
    u = np.log(C / C0)
    E_grid = np.linspace(0.0, 0.995 * float(loss.min()), n_grid)
    y = np.log(loss[None, :] - E_grid[:, None])  # one row per E
    du = u - u.mean()
    slope = (y - y.mean(axis=1, keepdims=True)) @ du / float(du @ du)  # each row's line, closed form
    intercept = y.mean(axis=1) - slope * u.mean()
    with np.errstate(over="ignore", invalid="ignore"):
        sse = np.sum((E_grid[:, None] + np.exp(intercept[:, None] + slope[:, None] * u) - loss) ** 2, axis=1)
    sse[~(slope < 0) | ~np.isfinite(sse)] = np.inf
    if not np.isfinite(sse).any():
        raise ValueError(f"{name}: loss does not fall with compute for any E of the start grid")
    best = int(np.argmin(sse))
    start = np.array([math.exp(intercept[best]), -slope[best], E_grid[best]])  # (A, gamma, E)
    bounds = ([0.0, 0.0, 0.0], [np.inf, np.inf, np.nextafter(float(loss.min()), 0.0)])
    residuals = lambda p: p[2] + p[0] * np.exp(-p[1] * u) - loss  # noqa: E731
    ordinary = least_squares(residuals, start, bounds=bounds)
    r = ordinary.fun
    f_scale = max(1.345 * float(np.median(np.abs(r - np.median(r)))) / 0.67448975, 1e-6)  # the normal's MAD
    A, gamma, E = least_squares(residuals, ordinary.x, bounds=bounds, loss="huber", f_scale=f_scale).x
    return PowerLawFit(E=float(E), A=float(A), gamma=float(gamma), C0=C0)


def fit_power_law_huber_log(C, loss, C0=C_REF, delta=HUBER_DELTA, weights=None, name="power-law fit"):
    """E, A, gamma free by summed Huber(delta) on log-loss from a grid over gamma: the surfaces' protocol."""
    C, loss = _power_inputs(C, loss, 3, name)
    weights = np.ones_like(loss) if weights is None else np.asarray(weights, dtype=float)
    x, zeros = np.log(C / C0), np.zeros_like(loss)
    free = np.array([True, True, True, False, False, False])
    theta, _, _ = fit_core(zeros, x, zeros, loss, weights, delta, free, POWER_GRID, 8, use_K=False)
    return PowerLawFit(E=math.exp(theta[0]), A=math.exp(theta[1]), gamma=float(theta[2]), C0=C0)


def fit_power_law_fixed_E(C, loss, E, C0=C_REF, name="arch"):
    """[X7] log(L - E) = log A - gamma log(C/C0) by ordinary least squares, E fixed; gamma_se the slope's."""
    C, loss = _power_inputs(C, loss, 2, f"{name} affine fit")
    if np.any(loss <= E):
        raise ValueError(f"{name}: loss {loss.min():.4g} <= shared E {E:.4g}; fit E per architecture")
    line = linregress(np.log(C / C0), np.log(loss - E))
    return PowerLawFit(E=float(E), A=math.exp(line.intercept), gamma=float(-line.slope), C0=C0,
                       gamma_se=float(line.stderr))


def fit_power_laws(runs, ref, C0=C_REF, shared_E=True, protocol="x"):
    """The [X] protocol on runs {arch: (C, loss)}: E from the free fit of `ref` (of each arch when not
    shared_E, the sensitivity option), then every arch by the fixed-E regression [X7]. {arch: PowerLawFit}."""
    free_fit = {"x": fit_power_law_x, "huber-log": fit_power_law_huber_log}[protocol]
    E = {a: free_fit(*runs[a], C0=C0, name=f"{a}: power-law fit").E for a in ([ref] if shared_E else runs)}
    return {a: fit_power_law_fixed_E(C, L, E[ref if shared_E else a], C0, a) for a, (C, L) in runs.items()}


def compute_multiplier(ref_C, ref_loss, arm_C, arm_loss):
    """[X6] pi = C_ref / C_arm(L_ref) by [X]'s rule: the arm's points in order of compute; every consecutive
    pair whose loss falls and brackets L_ref gives a compute by interpolating log C linearly in L; the
    smallest is C_arm(L_ref). NaN where no pair brackets L_ref: never extrapolated."""
    ref_C, ref_loss = (np.atleast_1d(np.asarray(v, dtype=float)) for v in (ref_C, ref_loss))
    order = np.argsort(arm_C, kind="stable")
    log_c, L = np.log(np.asarray(arm_C, dtype=float)[order]), np.asarray(arm_loss, dtype=float)[order]
    out = np.full(len(ref_C), np.nan)
    for i, (c, target) in enumerate(zip(np.log(ref_C), ref_loss)):
        reach = [log_c[j] + (L[j] - target) / (L[j] - L[j + 1]) * (log_c[j + 1] - log_c[j])
                 for j in range(len(L) - 1) if L[j + 1] < L[j] and L[j + 1] <= target <= L[j]]
        if reach:
            out[i] = math.exp(c - min(reach))
    return out


# -----------------------------------------------------------------------------
# Cell bootstrap [S]: resample cells with replacement, refit both surfaces (warm-started), percentiles

def _derived(ref_fit, tgt_fit, C, S):
    """Every bootstrapped quantity of one draw, a flat dict of arrays."""
    CC, SS = np.meshgrid(C, S, indexing="ij")
    d = {"ce_gain": ce_gain(ref_fit, tgt_fit, CC, SS)}
    for role, f in (("ref", ref_fit), ("target", tgt_fit)):
        d[f"{role}.tpp"] = tpp(f, CC, SS)
        d.update({f"{role}.{k}": np.array(getattr(f, k)) for k in ("E", "A", "a", "b", "K", "c", "gamma")})
    return d


def _bootstrap_draws(payload, draws):
    """Refit both surfaces for these draws; a seed per draw: the same draws however they are split."""
    data, n_cells, seed, C, S = payload
    out = []
    for draw in draws:
        drawn = np.random.default_rng([seed, draw]).integers(0, n_cells, n_cells)
        counts = np.bincount(drawn, minlength=n_cells).astype(float)
        try:
            fits = [fit_surface(F, Sp, D, L, weights=counts[cell], init=init, grid=None, centre=centre)
                    for F, Sp, D, L, cell, init, centre in data]
        except ValueError:  # too few distinct points left for six coefficients: counted as failed
            fits = None
        out.append((draw, fits and _derived(*fits, C, S)))
    return out


def cell_bootstrap(runs, ref, target, budgets, sparsities, n_draws=2000, seed=0, n_workers=None,
                   full_fits=None, progress=True, keep_draws=False):
    """[S] resample the cells with replacement (one draw for both archs), refit both surfaces warm-started
    from the full fits: 2.5/97.5 percentiles {"value", "lo", "hi": {"ce_gain", "ref.gamma", "target.tpp",
    ...}} (CE Gain and TPP: budgets x sparsities). runs: rows or columns arch, cell, F, S, D, loss."""
    if isinstance(runs, list):
        runs = {k: [r[k] for r in runs] for k in ("arch", "cell", "F", "S", "D", "loss")}
    arch, cell = np.asarray(runs["arch"]).astype(str), np.asarray(runs["cell"]).astype(str)
    cell_id = {c: i for i, c in enumerate(sorted(set(cell[(arch == ref) | (arch == target)])))}
    full_fits, data = dict(full_fits or {}), []
    for a in (ref, target):
        m = arch == a
        F, S, D, loss = (np.asarray(runs[k], dtype=float)[m] for k in ("F", "S", "D", "loss"))
        centre = (np.log1p(-S).mean(), np.log(F).mean(), np.log(D).mean())  # fixed: warm starts stay valid
        if a not in full_fits:
            full_fits[a] = fit_surface(F, S, D, loss, centre=centre)
        data.append((F, S, D, loss, np.array([cell_id[c] for c in cell[m]]), full_fits[a], centre))
    C, S = np.asarray(budgets, dtype=float), np.asarray(sparsities, dtype=float)
    payload = (data, len(cell_id), int(seed), C, S)
    n_workers = n_workers or min(os.cpu_count() or 1, 8, max(1, n_draws // 50))  # a process per 50 draws
    size = max(1, min(25, n_draws // (4 * n_workers)))
    chunks = [range(i, min(i + size, n_draws)) for i in range(0, n_draws, size)]
    results = {}
    spawn = multiprocessing.get_context("spawn")  # safe beside a parent's torch / OpenMP threads
    with (ProcessPoolExecutor(n_workers, mp_context=spawn) if n_workers > 1 else nullcontext() as pool,
          tqdm(total=n_draws, desc="cell bootstrap", disable=not progress) as bar):
        for part in (pool.map if pool else map)(_bootstrap_draws, repeat(payload), chunks):
            results.update(part)
            bar.update(len(part))
    point = _derived(full_fits[ref], full_fits[target], C, S)
    good = [results[i] for i in range(n_draws) if results[i] is not None]
    out = {"value": point, "lo": {}, "hi": {}, "n_draws": n_draws, "n_failed": n_draws - len(good),
           "full_fits": full_fits}
    for k in point:
        stack = np.stack([r[k] for r in good]) if good else np.full((1, *np.shape(point[k])), np.nan)
        out["lo"][k], out["hi"][k] = np.nanpercentile(stack, [2.5, 97.5], axis=0)
        if keep_draws:
            out.setdefault("draws", {})[k] = stack
    return out


# -----------------------------------------------------------------------------
# Quadratic vertices (compute-optimal TPP, growth fraction rho*)

def quadratic_vertex(x, y, log_x=True, log_y=True):
    """The vertex of y' = p0 + p1 x' + p2 x'^2 (x' = log x, y' = log y by default; exact through 3 points,
    least squares over more): {"x_opt", "y_opt", "curvature", "coef"}; refused when it has no minimum.
    The measured compute-optimal TPP ([X] Stage 2): loss vs TPP at one budget; the growth fraction rho* of
    a growth sweep: loss vs rho, log_x=False (grow.py has the [X12], [X15] laws)."""
    xt = np.log(x) if log_x else np.asarray(x, dtype=float)
    yt = np.log(y) if log_y else np.asarray(y, dtype=float)
    p2, p1, p0 = np.polyfit(xt, yt, 2) if len(xt) >= 3 else (np.nan,) * 3
    if not p2 > 0:
        raise ValueError(f"quadratic-vertex fit: no minimum ({len(xt)} points, curvature {p2:.3g})")
    xv = -p1 / (2 * p2)
    yv = p0 + p1 * xv + p2 * xv * xv
    return {"x_opt": float(math.exp(xv) if log_x else xv), "y_opt": float(math.exp(yv) if log_y else yv),
            "curvature": float(p2), "coef": [float(p0), float(p1), float(p2)]}


# =============================================================================
# Command line: fit.py surface | chinchilla | power

def json_safe(a):
    """Numbers and arrays for JSON: nested lists, nan and inf as null."""
    return [json_safe(v) for v in a] if np.ndim(a) else float(a) if math.isfinite(a) else None


def _archs(rows, wanted, parser, path):
    archs = list(dict.fromkeys(r["arch"] for r in rows))
    for a in set(wanted) - set(archs):
        parser.error(f"{path}: no arch '{a}' (have {', '.join(archs)})")
    return archs


def run_surface(args, parser):
    """[S2] surfaces of every architecture; CE Gain [S5] of --target over --ref and TPP on the budget grid."""
    rows = read_runs(args.csv, numbers=("F", "S", "D", "loss"), text=("arch", "cell"))
    fits = {}
    for a in _archs(rows, (args.ref, args.target), parser, args.csv):
        try:
            fits[a] = fit_surface(*(_column(rows, k, a) for k in ("F", "S", "D", "loss")))
        except ValueError as e:
            parser.error(f"{args.csv}: arch '{a}': {e}")
    pair = {a: fits[a] for a in (args.ref, args.target)}
    sides = {"value": _derived(pair[args.ref], pair[args.target], args.budgets, args.sparsity)}
    if args.bootstrap:
        boot = cell_bootstrap(rows, args.ref, args.target, args.budgets, args.sparsity, args.bootstrap,
                              args.seed, full_fits=pair)
        sides.update(lo=boot["lo"], hi=boot["hi"])
    grid = [(i, C, j, S) for i, C in enumerate(args.budgets) for j, S in enumerate(args.sparsity)]

    def text(key, i, j, digits):  # the value, then its 95% interval when bootstrapped
        v, *ci = (f"{d[key][i, j]:.{digits}f}" for d in sides.values())
        return v + (f" [{ci[0]}, {ci[1]}]" if ci else "")
    if args.plot:
        import plots
        plots.plot_surface_frontiers(frontier_curves(pair), args.sparsity, args.plot)
    lines = [" " * 9 + "arch        E          A       a       b          K       c   gamma     rmse"]
    lines += [f"{a:>12} {f.E:8.4f} {f.A:10.4g} {f.a:7.4f} {f.b:7.4f} {f.K:10.4g} {f.c:7.4f} {f.gamma:7.4f} "
              f"{f.rmse:8.5f}" for a, f in fits.items()]
    lines.append(f"[S5] CE Gain of {args.target} over {args.ref}, TPP = D*/(F*/6)"
                 + f" (95% intervals: {args.bootstrap} draws)" * (len(sides) > 1))
    lines += [f"  C={C:.3g} S={S:.3g}: CE Gain {text('ce_gain', i, j, 4)}; TPP {args.ref} "
              f"{text('ref.tpp', i, j, 1)}, {args.target} {text('target.tpp', i, j, 1)}"
              for i, C, j, S in grid]
    keys = ("ce_gain", "ref.tpp", "target.tpp")  # value, lo, hi: {key: [budget][sparsity]}
    return {"fits": {a: {k: json_safe(v) for k, v in f.to_dict().items()} for a, f in fits.items()},
            "budgets": args.budgets, "sparsity": args.sparsity,
            **{side: {k: json_safe(d[k]) for k in keys} for side, d in sides.items()}}, lines


def run_chinchilla(args, parser):
    """Chinchilla Approach 3 on every point but the --drop-highest highest losses."""
    rename = {"params": "N", "train_flops": "C"}
    key = "D" if "D" in (read_runs(args.csv, rename=rename) or [{}])[0] else "C"
    rows = read_runs(args.csv, numbers=("N", key, "loss"), rename=rename)
    N, X, loss = (_column(rows, k) for k in ("N", key, "loss"))
    keep = np.argsort(loss)[:len(loss) - args.drop_highest]
    f = fit_chinchilla(N[keep], (X if key == "D" else X / (6 * N))[keep], loss[keep])  # C = 6 N D
    return f.to_dict(), [f"Chinchilla Approach 3 on {len(keep)} points: E={f.E:.4f} A={f.A:.2f} B={f.B:.2f} "
                         f"alpha={f.alpha:.4f} beta={f.beta:.4f} (Huber objective {f.objective:.6g}, "
                         f"rmse {f.rmse:.4f})"]


def run_power(args, parser):
    """The [X] protocol: shared E [X7], (A, gamma) per architecture, multipliers [X6] at --ref's budgets."""
    depth = () if args.min_depth is None else ("depth",)
    rows = read_runs(args.csv, numbers=("C", "loss", *depth), text=("arch",),
                     rename={"arm": "arch", "compute_flops": "C", "val_loss": "loss"})
    archs = _archs(rows, [args.ref], parser, args.csv)
    runs = {a: (_column(rows, "C", a), _column(rows, "loss", a)) for a in archs}
    fits = fit_power_laws(runs, args.ref, C0=args.C0, shared_E=not args.per_arch_E, protocol=args.protocol)
    rising = [a for a, f in fits.items() if not f.gamma > 0]
    if rising:
        parser.error(f"{args.csv}: the loss of {', '.join(rising)} does not fall with compute: no power law")
    budget = [r for r in rows if r["arch"] == args.ref and (not depth or r["depth"] >= args.min_depth)]
    ref_C, ref_L = _column(budget, "C"), _column(budget, "loss")
    mult = {a: compute_multiplier(ref_C, ref_L, C, L) for a, (C, L) in runs.items() if a != args.ref}
    if args.plot:
        import plots
        plots.plot_power_laws(runs, fits, mult, args.ref, args.plot, budgets=ref_C)
    w, how = max(len(a) for a in fits), "per architecture" if args.per_arch_E else f"on {args.ref}, shared"
    lines = [f"[X7] E = {fits[args.ref].E:.4f} (fitted {how}; protocol {args.protocol}); C0 = {args.C0:g}; "
             "A, gamma +- its standard error with E fixed:"]
    lines += [f"  {a:>{w}}: E={f.E:.4f} A={f.A:.4f} gamma={f.gamma:.5f} +- {f.gamma_se:.5f}"
              for a, f in fits.items()]
    lines.append(f"[X6] compute multipliers vs {args.ref} at its budgets ("
                 + (f"depth >= {args.min_depth:g}" if depth else "every measured budget")
                 + "): interpolated, never extrapolated (nan = outside the arch's measured range)")
    lines += [f"  {a:>{w}}: " + " ".join(f"{c:.3g}:{v:.3f}" for c, v in zip(ref_C, m))
              for a, m in mult.items()]
    laws = {a: {k: json_safe(v) for k, v in asdict(f).items()} for a, f in fits.items()}
    return {"E": fits[args.ref].E, "fits": laws,
            "budgets": ref_C.tolist(), "multipliers": {a: json_safe(m) for a, m in mult.items()}}, lines


def floats(text):
    return [float(t) for t in text.split(",")]


def build_parser():
    p = argparse.ArgumentParser(prog="fit.py", usage=argparse.SUPPRESS,
                                description="Scaling-law fits of both papers.")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("surface", prog="fit.py surface", usage=argparse.SUPPRESS,
                       help="[S2] L(F, S, D) = E + A (1-S)^b / F^a + K / D^c, CE Gain [S5], TPP")
    s.add_argument("--ref", required=True, help="reference architecture (column arch)")
    s.add_argument("--target", required=True, help="compared with --ref (CE Gain > 0: it needs less compute)")
    s.add_argument("--budgets", type=floats, default=[1e20, 1e21], help="budgets C = F D, comma-separated")
    s.add_argument("--sparsity", type=floats, default=[0.85, 0.95], help="sparsities S, comma-separated")
    s.add_argument("--bootstrap", type=int, default=0, help="cell-bootstrap draws (paper: 2000)")
    s.add_argument("--seed", type=int, default=0, help="seed of the cell bootstrap")
    c = sub.add_parser("chinchilla", prog="fit.py chinchilla", usage=argparse.SUPPRESS,
                       help="Chinchilla Approach 3: L(N, D) = E + A / N^alpha + B / D^beta")
    c.add_argument("--drop-highest", type=int, default=0, help="drop the K highest-loss points (Epoch AI: 5)")
    w = sub.add_parser("power", prog="fit.py power", usage=argparse.SUPPRESS,
                       help="[X5] L(C) = E + A (C/C0)^-gamma, E shared [X7]; multipliers [X6]")
    w.add_argument("--ref", required=True, help="reference architecture: its E is shared, its budgets used")
    w.add_argument("--protocol", choices=POWER_PROTOCOLS, default="x", help="how E is fitted (x: [X]'s)")
    w.add_argument("--C0", type=float, default=C_REF, help="compute scale C0 (default 1e18; changes A)")
    w.add_argument("--min-depth", type=float, help="multipliers at --ref's points with depth >= this only")
    w.add_argument("--per-arch-E", action="store_true", help="fit E per architecture (sensitivity option)")
    for q, columns in ((s, "arch, cell, F (FLOPs/token), S (sparsity), D (tokens), loss"),
                       (c, "N, D or C = 6 N D, loss (or params, train_flops, loss)"),
                       (w, "arch, C (FLOPs), loss, optionally depth (or arm, compute_flops, val_loss)")):
        q.add_argument("csv", help=f"the runs CSV, columns {columns}")
        q.add_argument("--json", action="store_true", help="print one JSON object")
    for q in (s, w):
        q.add_argument("--plot", metavar="FILE", help="also draw the fits into FILE (needs matplotlib)")
    return p


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        run = {"surface": run_surface, "chinchilla": run_chinchilla, "power": run_power}[args.cmd]
        out, lines = run(args, parser)
    except (OSError, ValueError) as e:  # a missing file, a malformed row, data no law fits: one line
        parser.error(str(e) if args.csv in str(e) else f"{args.csv}: {e}")
    print(json.dumps(out) if args.json else "\n".join(lines))
    return 0


if __name__ == "__main__":
    main()
