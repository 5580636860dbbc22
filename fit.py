"""
Scaling-law fits for both papers: SMELT surfaces [S2]-[S7], Chinchilla Approach 3, the [X] power-law
protocol and compute multipliers [X4]-[X7], the cell bootstrap, downstream calibration [S6]-[S7],
the downstream prediction pipeline [X19]-[X21] and quadratic-vertex fits (numpy, scipy, threadpoolctl).

    python fit.py surface RUNS.csv --ref baseline --target smelt --budgets 1e20,1e21 \
        --sparsity 0.85,0.95 [--bootstrap 2000] [--json] [--plot out.png]
    python fit.py chinchilla tests/data/chinchilla_fig4_epoch.csv --drop-highest 5 [--json]
    python fit.py power tests/data/power_example.csv --ref vanilla [--per-arch-E] [--json] [--plot out.png]
    python fit.py power tests/data/fineweb_ladders.csv --ref vanilla --min-depth 8   # [X]'s own ladders
        [--protocol x | huber-log]

CSV columns: surface `arch,cell,F,S,D,loss`; chinchilla `N,D,loss` (or `N,C,loss`, D = C/(6N));
power `arch,C,loss`, optionally `depth` (or [X]'s names `arm,depth,compute_flops,val_loss`). Extra
columns are ignored; a UTF-8 byte-order mark is fine. A user mistake (missing file, malformed CSV, a row
given twice, a nan, a name spelled in two cases, an architecture whose loss does not fall, bad option) is
one line on stderr and exit status 2 (docs/fit.md says what counts as a duplicate row). `python fit.py
SUBCOMMAND --help` says what every flag means. This file holds the fits and, at its bottom, the command
line; reading the runs CSV files is tooling/tables.py, the figures tooling/plots.py (matplotlib optional).

How the six-coefficient fits are made reliable (the one deviation from "L-BFGS-B from a grid"):
for fixed exponents the law is linear in its coefficients (E, A, K), so every point of a large
exponent grid gets its best nonnegative coefficients from a tiny least squares problem (variable
projection). All grid points are scored with the real Huber objective in one vectorised pass and
only the best few go on to full L-BFGS-B with analytic gradients. Logs of F, D, N and 1-S are
centred on the data before fitting (A and a decorrelate), which is a reparametrisation, not a
different model: reported coefficients are in the usual uncentred form.
"""
import argparse
import itertools
import json
import math
import multiprocessing
import os
import sys
import warnings
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass

import numpy as np
from scipy.optimize import brentq, least_squares, minimize
from scipy.special import expit
from scipy.stats import linregress

from tooling import common, jobs, plots, tables
from tooling.common import cli_error

HUBER_DELTA = 1e-3  # [S2] / Chinchilla: Huber on log-loss with delta = 1e-3
HOFFMANN_INIT = dict(E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28)  # Hoffmann et al. 2022 published fit

# -----------------------------------------------------------------------------
# The shared core: L = E + A e^(b u - a x) + K e^(-c y), Huber on log-loss, log-sum-exp parametrisation
# theta = [log E, log A, a, b, log K, c] on centred coordinates u, x, y.

PARAM_NAMES = ("logE", "logA", "a", "b", "logK", "c")


def huber(r, delta=HUBER_DELTA):
    """Huber loss, elementwise: r^2/2 inside |r| <= delta, delta(|r| - delta/2) outside."""
    clipped = np.clip(r, -delta, delta)  # also dHuber/dr
    return clipped * (r - 0.5 * clipped)


def _log_law(theta, u, x, y):
    """log L-hat and the softmax weights of its three terms (log-sum-exp, stable)."""
    logE, logA, a, b, logK, c = theta
    terms = np.empty((3, len(x)))
    terms[0] = logE
    terms[1] = logA + b * u - a * x
    terms[2] = logK - c * y
    m = terms.max(axis=0)
    ex = np.exp(terms - m)
    s = ex[0] + ex[1] + ex[2]
    return m + np.log(s), ex / s


def _objective(theta, u, x, y, log_loss, weights, delta, free, fixed, scale):
    """Summed Huber on log-loss residuals and its analytic gradient w.r.t. the free parameters."""
    full = fixed.copy()
    full[free] = theta
    log_pred, w = _log_law(full, u, x, y)
    r = log_pred - log_loss
    clipped = np.clip(r, -delta, delta)  # dHuber/dr
    value = float(np.dot(weights, clipped * (r - 0.5 * clipped)))
    dr = weights * clipped
    t1, t2 = dr * w[1], dr * w[2]
    grad = np.array([np.dot(dr, w[0]), t1.sum(), -np.dot(t1, x), np.dot(t1, u), t2.sum(), -np.dot(t2, y)])
    return value * scale, grad[free] * scale


def _nnls_batched(G, target, rw):
    """Nonnegative least squares for a stack of tiny problems (n_problems, n, m<=3) by enumerating
    active sets: the NNLS optimum is the best unconstrained LS on a subset whose coefficients are all > 0."""
    P, n, m = G.shape
    Gw = G * rw[None, :, None]
    tw = target * rw
    best_res = np.full(P, np.inf)
    best_beta = np.zeros((P, m))
    for k in range(1, m + 1):
        for subset in itertools.combinations(range(m), k):
            Gs = Gw[:, :, subset]
            M = np.einsum("pni,pnj->pij", Gs, Gs)
            M += 1e-12 * np.trace(M, axis1=1, axis2=2)[:, None, None] * np.eye(k)
            beta = np.linalg.solve(M, np.einsum("pni,n->pi", Gs, tw)[..., None])[..., 0]
            res = np.sum((tw[None] - np.einsum("pni,pi->pn", Gs, beta)) ** 2, axis=1)
            ok = np.all(beta > 0, axis=1) & (res < best_res)
            best_res[ok] = res[ok]
            full = np.zeros((P, m))
            full[:, subset] = beta
            best_beta[ok] = full[ok]
    return best_beta


def _varpro_starts(u, x, y, loss, weights, exp_grid, delta, n_keep, use_K=True):
    """Score every exponent triple (a, b, c) of the grid with its NNLS coefficients (E, A, K) and the
    Huber objective; return the n_keep best starting points theta (variable projection)."""
    log_loss = np.log(loss)
    a, b, c = (g[:, None] for g in exp_grid.T)
    cols = [np.ones((len(a), len(x))), np.exp(b * u[None] - a * x[None])]
    if use_K:
        cols.append(np.exp(-c * y[None]))
    G = np.stack(cols, axis=2)
    rw = np.sqrt(weights) / loss  # relative residuals ~ log-loss residuals
    beta = _nnls_batched(G, loss, rw)
    pred = np.einsum("pnm,pm->pn", G, beta)
    with np.errstate(divide="ignore", invalid="ignore"):
        score = np.sum(weights * huber(np.log(np.maximum(pred, 1e-300)) - log_loss, delta), axis=1)
    score[~np.isfinite(score)] = np.inf
    order = np.argsort(score)[:n_keep]
    floor = 1e-6 * float(np.min(loss))  # a coefficient NNLS sets to zero starts tiny but positive
    starts = []
    for p in order:
        E, A = max(beta[p, 0], floor), max(beta[p, 1], floor)
        K = max(beta[p, 2], floor) if use_K else 1e-300
        starts.append(np.array([math.log(E), math.log(A), exp_grid[p, 0], exp_grid[p, 1], math.log(K), exp_grid[p, 2]]))
    return starts


_BOUNDS = {"logE": (-40.0, 40.0), "logA": (-200.0, 200.0), "a": (0.0, 10.0), "b": (-10.0, 10.0),
           "logK": (-200.0, 200.0), "c": (0.0, 10.0)}


def _lbfgsb(theta0, u, x, y, loss, weights, delta, free, reduce="sum", tol="tight", maxiter=2000):
    """One L-BFGS-B run from theta0 (full 6-vector); returns (theta, summed objective).

    reduce="sum" (the protocol) or "mean"; tol="tight" (ours: the objective divided by delta, tiny
    gtol/ftol) or "scipy" (L-BFGS-B defaults on the raw objective, the naive protocol, which stops
    early on this flat, small-valued objective)."""
    log_loss = np.log(loss)
    free_idx = np.flatnonzero(free)
    scale = 1.0 if reduce == "sum" else 1.0 / float(np.sum(weights))
    if tol == "tight":
        scale /= delta  # a constant factor: same optimum, gradients O(1) instead of O(delta)
        options = dict(maxiter=maxiter, gtol=1e-10, ftol=1e-13, maxcor=20)
    else:
        options = dict(maxiter=maxiter)
    args = (u, x, y, log_loss, weights, delta, free_idx, np.array(theta0, dtype=float), scale)
    bounds = [_BOUNDS[PARAM_NAMES[i]] for i in free_idx]
    res = minimize(_objective, np.asarray(theta0, dtype=float)[free_idx], args=args, jac=True,
                   method="L-BFGS-B", bounds=bounds, options=options)
    theta = np.array(theta0, dtype=float)
    theta[free_idx] = res.x
    value = float(np.sum(weights * huber(_log_law(theta, u, x, y)[0] - log_loss, delta)))
    return theta, value


def _fit_core(u, x, y, loss, weights, delta, free, exp_grid, n_keep, inits=(), reduce="sum", use_K=True, tol="tight"):
    """Best of L-BFGS-B runs from the n_keep best grid points (variable projection) plus `inits`."""
    with jobs.single_blas_thread():
        starts = list(inits)
        if exp_grid is not None and len(exp_grid):
            starts += _varpro_starts(u, x, y, loss, weights, exp_grid, delta, n_keep, use_K)
        best = (None, np.inf)
        for theta0 in starts:
            theta, value = _lbfgsb(theta0, u, x, y, loss, weights, delta, free, reduce, tol)
            if value < best[1]:
                best = (theta, value)
    return best[0], best[1], len(starts)


def _grid(a_values, b_values, c_values):
    return np.array(list(itertools.product(a_values, b_values, c_values)), dtype=float)


SURFACE_GRID = _grid(np.geomspace(0.05, 2.0, 20), np.linspace(-0.5, 3.0, 15), np.geomspace(0.05, 2.0, 20))
CHINCHILLA_GRID = _grid(np.geomspace(0.02, 2.5, 40), [0.0], np.geomspace(0.02, 2.5, 40))
POWER_GRID = _grid(np.geomspace(0.005, 3.0, 400), [0.0], [0.0])


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
        return frontier_gamma(self.a, self.c)

    def loss(self, F, S, D):
        F, S, D = (np.asarray(v, dtype=float) for v in (F, S, D))
        return self.E + self.A * (1.0 - S) ** self.b / F ** self.a + self.K / D ** self.c  # [S2]

    def to_dict(self):
        d = {k: getattr(self, k) for k in ("E", "A", "a", "b", "K", "c", "rmse")}
        d["gamma"] = self.gamma
        return d


@dataclass
class _Centre:
    """Centring of the logs of the inputs (fixed from the full data so warm starts stay valid)."""
    u0: float
    x0: float
    y0: float


def _surface_theta(fit, centre):
    """SurfaceFit -> theta on centred coordinates."""
    logA_c = math.log(fit.A) + fit.b * centre.u0 - fit.a * centre.x0
    logK_c = math.log(fit.K) - fit.c * centre.y0
    return np.array([math.log(fit.E), logA_c, fit.a, fit.b, logK_c, fit.c])


def _surface_from_theta(theta, centre):
    logE, logA_c, a, b, logK_c, c = theta
    return dict(E=math.exp(logE), A=math.exp(logA_c - b * centre.u0 + a * centre.x0), a=float(a), b=float(b),
                K=math.exp(logK_c + c * centre.y0), c=float(c))


def _check_points(n, n_coef, what):
    if n < n_coef + 1:
        raise ValueError(f"{what}: {n} points is too few to fit {n_coef} coefficients (need at least {n_coef + 1})")


def _surface_inputs(F, S, D, loss, weights):
    F, S, D, loss = (np.asarray(v, dtype=float).ravel() for v in (F, S, D, loss))
    if not (len(F) == len(S) == len(D) == len(loss)):
        raise ValueError(f"F, S, D, loss must have equal lengths, got {len(F)}, {len(S)}, {len(D)}, {len(loss)}")
    for name, v in (("F", F), ("D", D), ("loss", loss)):
        if np.any(~np.isfinite(v)) or np.any(v <= 0):
            raise ValueError(f"{name} must be finite and > 0 (first bad index {int(np.argmax(~(v > 0) | ~np.isfinite(v)))})")
    if np.any(~np.isfinite(S)) or np.any(S < 0) or np.any(S >= 1):
        raise ValueError("S must lie in [0, 1)")
    weights = np.ones_like(loss) if weights is None else np.asarray(weights, dtype=float).ravel()
    return F, S, D, loss, weights


def fit_surface(F, S, D, loss, weights=None, init=None, grid=SURFACE_GRID, n_keep=8, delta=HUBER_DELTA,
                centre=None, fixed_exponents=None):
    """Fit the SMELT surface [S2] by summed Huber(delta) on log-loss with L-BFGS-B.

    init: a SurfaceFit to warm-start from (bootstrap refits pass grid=None to use it alone).
    fixed_exponents: (a, b, c) to keep fixed and refit only (E, A, K) [S section 5.2].
    Returns a SurfaceFit (E, A, a, b, K, c, rmse in nats, objective, n_points)."""
    F, S, D, loss, weights = _surface_inputs(F, S, D, loss, weights)
    n_used = int(np.count_nonzero(weights))
    _check_points(n_used, 3 if fixed_exponents is not None else 6, "SMELT surface")
    u, x, y = np.log1p(-S), np.log(F), np.log(D)
    if centre is None:
        centre = _Centre(float(np.mean(u)), float(np.mean(x)), float(np.mean(y)))
    u, x, y = u - centre.u0, x - centre.x0, y - centre.y0
    free = np.ones(6, dtype=bool)
    inits = [] if init is None else [_surface_theta(init, centre)]
    if fixed_exponents is not None:
        free[[2, 3, 5]] = False
        grid = np.array([fixed_exponents], dtype=float)
    theta, value, _ = _fit_core(u, x, y, loss, weights, delta, free, grid, n_keep, inits)
    coefs = _surface_from_theta(theta, centre)
    fit = SurfaceFit(**coefs, objective=value, n_points=n_used)
    fit.rmse = float(np.sqrt(np.average((fit.loss(F, S, D) - loss) ** 2, weights=weights)))
    return fit


def frontier_gamma(a, c):
    """[S4] gamma = ac / (a + c)."""
    return a * c / (a + c)


def optimal_flops(fit, C, S):
    """[S3] F* = (a A (1-S)^b C^c / (c K))^(1/(a+c)): compute-optimal per-token FLOPs under C = F D."""
    C, S = np.asarray(C, dtype=float), np.asarray(S, dtype=float)
    return (fit.a * fit.A * (1 - S) ** fit.b * C ** fit.c / (fit.c * fit.K)) ** (1 / (fit.a + fit.c))


def frontier_prefactor(fit, S):
    """[S4] f(A, K, a, b, c, S) such that L*(C, S) = E + f C^-gamma."""
    S = np.asarray(S, dtype=float)
    A_s = fit.A * (1 - S) ** fit.b
    G = (fit.a * A_s / (fit.c * fit.K)) ** (1 / (fit.a + fit.c))  # F* = G C^(c/(a+c))
    return A_s * G ** (-fit.a) + fit.K * G ** fit.c


def frontier_loss(fit, C, S):
    """[S4] L*(C, S) = E + f(S) C^-gamma, the loss on the compute-optimal frontier."""
    return fit.E + frontier_prefactor(fit, S) * np.asarray(C, dtype=float) ** (-fit.gamma)


def frontier_curves(fits):
    """{arch: (gamma, excess)} of surface fits, excess(C, S) = L*(C, S) - E [S4]: what
    tooling.plots.plot_surface_frontiers draws."""
    return {arch: (f.gamma, lambda C, S, f=f: frontier_loss(f, C, S) - f.E) for arch, f in fits.items()}


def frontier_compute(fit, loss, S):
    """Invert [S4]: the budget C at which the frontier reaches `loss` (inf when loss <= E)."""
    excess = np.asarray(loss, dtype=float) - fit.E
    with np.errstate(divide="ignore", invalid="ignore"):
        log_c = -np.log(excess / frontier_prefactor(fit, S)) / fit.gamma
    return np.where(excess > 0, np.exp(log_c), np.inf)


def ce_gain(ref_fit, tgt_fit, C, S):
    """[S5] CE Gain = 1 - C_tgt / C_ref, with C_ref the reference budget reaching the target's frontier
    loss L*_tgt(C, S). 0 for identical surfaces, > 0 when the target frontier is lower, 1 when the
    reference can never reach that loss."""
    C = np.asarray(C, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):  # a degenerate surface (a or c = 0) gives nan
        C_ref = frontier_compute(ref_fit, frontier_loss(tgt_fit, C, S), S)
        return 1.0 - C / C_ref


def tpp(fit, C, S):
    """Tokens per dense-equivalent parameter at the optimum: TPP = D* / (F*/6), D* = C / F*."""
    with np.errstate(divide="ignore", invalid="ignore"):  # a degenerate surface (a or c = 0) gives nan/inf
        F_opt = optimal_flops(fit, C, S)
        return (np.asarray(C, dtype=float) / F_opt) / (F_opt / 6.0)


def fit_subsets(full_fit, F, S, D, loss, subset, weights=None):
    """[S section 5.2] per-subset surfaces sharing the exponents (a, b, c) of `full_fit` and refitting
    (E_s, A_s, K_s). `subset` labels every point; returns {label: SurfaceFit}."""
    subset = np.asarray(subset)
    out = {}
    for label in dict.fromkeys(subset.tolist()):
        m = subset == label
        w = None if weights is None else np.asarray(weights)[m]
        out[label] = fit_surface(np.asarray(F)[m], np.asarray(S)[m], np.asarray(D)[m], np.asarray(loss)[m],
                                 weights=w, fixed_exponents=(full_fit.a, full_fit.b, full_fit.c))
    return out


# Published-like coefficients for synthetic data (E, a, c, K from [S]; A, b chosen for this demo)
SYNTHETIC_SURFACES = {
    "baseline": dict(E=1.4439, A=2500.0, a=0.3703, b=0.5, K=1.975e6, c=0.6594),
    "smelt": dict(E=1.4493, A=4200.0, a=0.3892, b=0.55, K=5.264e6, c=0.7011),
}


def synthetic_surface_runs(surfaces=None, noise=0.003, seed=0, scales=(2.5e8, 5e8, 1e9, 2e9),
                           sparsities=(0.75, 0.85, 0.95), n_checkpoints=6):
    """[S]-shaped synthetic runs: 4 scales x 3 sparsities = 12 cells, 6 decay checkpoints per cell
    (72 points per architecture), loss = surface x exp(noise * N(0,1)). Columns as `fit.py surface` reads
    them (tooling.tables.write_runs_csv writes them as a CSV)."""
    surfaces = surfaces or SYNTHETIC_SURFACES
    rng = np.random.default_rng(seed)
    cols = {k: [] for k in ("arch", "cell", "F", "S", "D", "loss")}
    for arch, coefs in surfaces.items():
        for i, F in enumerate(scales):
            for j, S in enumerate(sparsities):
                for D in np.geomspace(1.3e19, 2.2e21 * F / scales[-1], n_checkpoints) / F * (1 + 0.1 * j):
                    L = SurfaceFit(**coefs).loss(F, S, D) * math.exp(noise * rng.standard_normal())
                    for k, v in zip(cols, (arch, f"s{i}-S{S:g}", F, S, D, float(L))):
                        cols[k].append(v)
    return {k: np.asarray(v, dtype=object if k in ("arch", "cell") else float) for k, v in cols.items()}


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
        return self.E + self.A / np.asarray(N, dtype=float) ** self.alpha + self.B / np.asarray(D, dtype=float) ** self.beta

    def to_dict(self):
        return {k: getattr(self, k) for k in ("E", "A", "B", "alpha", "beta", "objective")}


def fit_chinchilla(N, D, loss, grid=CHINCHILLA_GRID, inits=(), reduce="sum", centre=True, n_keep=8,
                   delta=HUBER_DELTA, tol="tight"):
    """Chinchilla Approach 3 with summed Huber(delta) on log-loss, L-BFGS-B, variable-projection grid.

    inits: dicts with E, A, B, alpha, beta added as starting points. The naive protocol, for comparison,
    is grid=None, inits=[HOFFMANN_INIT], reduce="mean", centre=False, tol="scipy"."""
    N, D, loss = (np.asarray(v, dtype=float).ravel() for v in (N, D, loss))
    for name, v in (("N", N), ("D", D), ("loss", loss)):
        if np.any(~np.isfinite(v)) or np.any(v <= 0):
            raise ValueError(f"{name} must be finite and > 0")
    _check_points(len(loss), 5, "Chinchilla fit")
    x0, y0 = (float(np.mean(np.log(N))), float(np.mean(np.log(D)))) if centre else (0.0, 0.0)
    x, y, u = np.log(N) - x0, np.log(D) - y0, np.zeros_like(loss)
    starts = [np.array([math.log(p["E"]), math.log(p["A"]) - p["alpha"] * x0, p["alpha"], 0.0,
                        math.log(p["B"]) - p["beta"] * y0, p["beta"]]) for p in inits]
    free = np.array([True, True, True, False, True, True])
    theta, value, _ = _fit_core(u, x, y, loss, np.ones_like(loss), delta, free, grid, n_keep, starts, reduce, tol=tol)
    logE, logA, alpha, _, logB, beta = theta
    fit = ChinchillaFit(E=math.exp(logE), A=math.exp(logA + alpha * x0), B=math.exp(logB + beta * y0),
                        alpha=float(alpha), beta=float(beta), objective=value)
    fit.rmse = float(np.sqrt(np.mean((fit.loss(N, D) - loss) ** 2)))
    return fit


# -----------------------------------------------------------------------------
# The [X] protocol: L(C) = E + A (C/C0)^-gamma [X5], shared E [X7], compute multipliers [X6]
#
# Two ways to fit E on the reference, the rest shared:
#   "x" (the default): the [X] paper's own recipe (its public code, plotting_scripts/common.py, read for
#       the facts; this is our code): C0 = C_ref = 1e18; a start from a 600-point grid over E in
#       [0, 0.995 min L], each E giving (A, gamma) by a line through log(L - E) vs log(C/C0); bounded least
#       squares on the raw loss residuals from the best start; then one robust pass (Huber, f_scale from
#       the residuals' MAD). tests/test_fit.py reproduces the published exponents with it.
#   "huber-log": ours before, the surfaces' protocol: summed Huber (delta 1e-3) on log-loss, L-BFGS-B
#       from a variable-projection grid over gamma.
# Then every architecture, the reference included, gets (A, gamma) with E held fixed: ordinary least
# squares of log(L - E) on log(C/C0), gamma's standard error the slope's [X7].

C_REF = 1e18  # [X]: L(C) = E + A (C / 1e18)^-gamma
POWER_PROTOCOLS = ("x", "huber-log")


@dataclass
class PowerLawFit:
    """[X5] L(C) = E + A (C / C0)^-gamma; gamma_se: the standard error of gamma from the fixed-E
    regression [X7] (nan for a free fit)."""
    E: float
    A: float
    gamma: float
    C0: float = C_REF
    gamma_se: float = float("nan")

    def loss(self, C):
        return self.E + self.A * (np.asarray(C, dtype=float) / self.C0) ** (-self.gamma)

    def compute(self, loss):
        """Invert [X5]: the budget reaching `loss` (inf when loss <= E)."""
        excess = np.asarray(loss, dtype=float) - self.E
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(excess > 0, self.C0 * (excess / self.A) ** (-1 / self.gamma), np.inf)

    def to_dict(self):
        return asdict(self)


def _power_inputs(C, loss):
    C, loss = np.asarray(C, dtype=float).ravel(), np.asarray(loss, dtype=float).ravel()
    if len(C) != len(loss):
        raise ValueError(f"C and loss must have equal lengths, got {len(C)} and {len(loss)}")
    if np.any(~np.isfinite(C)) or np.any(~np.isfinite(loss)) or np.any(C <= 0) or np.any(loss <= 0):
        raise ValueError("C and loss must be finite and > 0")
    _check_points(len(loss), 3, "power-law fit")
    if len(set(C.tolist())) < 3:  # repeated seeds add points, not computes
        raise ValueError(f"power-law fit: E, A and gamma need 3 distinct computes, got {len(set(C.tolist()))} "
                         "(repeated seeds count once)")
    return C, loss


def fit_power_law_x(C, loss, C0=C_REF, n_grid=600):
    """[X]'s free fit of L(C) = E + A (C/C0)^-gamma, all three coefficients:
    1. start: for each of n_grid values of E in [0, 0.995 min L], the least-squares line through
       (log(C/C0), log(L - E)) gives A = e^intercept, gamma = -slope (only falling lines, slope < 0);
       the start with the smallest sum of squared loss residuals E + A x^-gamma - L wins;
    2. least squares on those raw residuals, bounds A >= 0, gamma >= 0, 0 <= E < min L;
    3. from there a robust pass, Huber with f_scale = 1.345 MAD / 0.67449 of step 2's residuals (the
       normal-consistent MAD, floored at 1e-6): the returned fit."""
    C, loss = _power_inputs(C, loss)
    u = np.log(C / C0)
    E_grid = np.linspace(0.0, 0.995 * float(loss.min()), n_grid)
    y = np.log(loss[None, :] - E_grid[:, None])  # one row per E
    du = u - u.mean()
    slope = (y - y.mean(axis=1, keepdims=True)) @ du / float(du @ du)  # the line of each row, closed form
    intercept = y.mean(axis=1) - slope * u.mean()
    with np.errstate(over="ignore", invalid="ignore"):
        sse = np.sum((E_grid[:, None] + np.exp(intercept[:, None] + slope[:, None] * u[None, :]) - loss) ** 2, axis=1)
    sse[~(slope < 0) | ~np.isfinite(sse)] = np.inf
    if not np.isfinite(sse).any():
        raise ValueError("loss does not fall with compute for any E of the start grid; no power law to fit")
    best = int(np.argmin(sse))
    start = np.array([math.exp(intercept[best]), -slope[best], E_grid[best]])  # (A, gamma, E)
    bounds = ([0.0, 0.0, 0.0], [np.inf, np.inf, np.nextafter(float(loss.min()), 0.0)])
    residuals = lambda p: p[2] + p[0] * np.exp(-p[1] * u) - loss  # noqa: E731
    ordinary = least_squares(residuals, start, bounds=bounds)
    r = ordinary.fun
    mad = float(np.median(np.abs(r - np.median(r))))
    f_scale = max(1.345 * mad / 0.67448975, 1e-6)  # 0.67449 = the standard normal's MAD
    robust = least_squares(residuals, ordinary.x, bounds=bounds, loss="huber", f_scale=f_scale)
    A, gamma, E = (float(v) for v in robust.x)
    return PowerLawFit(E=E, A=A, gamma=gamma, C0=C0)


def fit_power_law_huber_log(C, loss, C0=C_REF, delta=HUBER_DELTA, weights=None):
    """Huber(delta) fit on log-loss of L(C) = E + A (C/C0)^-gamma, all three free (L-BFGS-B from a
    variable-projection grid over gamma): the surfaces' protocol, `fit.py power --protocol huber-log`."""
    C, loss = _power_inputs(C, loss)
    weights = np.ones_like(loss) if weights is None else np.asarray(weights, dtype=float)
    x = np.log(C / C0)
    zeros = np.zeros_like(x)
    free = np.array([True, True, True, False, False, False])
    theta, _, _ = _fit_core(zeros, x, zeros, loss, weights, delta, free, POWER_GRID, 8, use_K=False)
    return PowerLawFit(E=math.exp(theta[0]), A=math.exp(theta[1]), gamma=float(theta[2]), C0=C0)


def fit_power_law(C, loss, C0=C_REF, protocol="x"):
    """Free fit of L(C) = E + A (C/C0)^-gamma by `protocol`: "x" ([X]'s, fit_power_law_x) or
    "huber-log" (fit_power_law_huber_log)."""
    if protocol == "x":
        return fit_power_law_x(C, loss, C0=C0)
    if protocol == "huber-log":
        return fit_power_law_huber_log(C, loss, C0=C0)
    raise ValueError(f"unknown power-law protocol {protocol!r}; choose from {', '.join(POWER_PROTOCOLS)}")


def fit_power_law_fixed_E(C, loss, E, C0=C_REF, name="arch"):
    """[X7] log(L - E) = -gamma log(C/C0) + log A by ordinary least squares with E held fixed; gamma_se
    is the slope's standard error (scipy.stats.linregress)."""
    C, loss = np.asarray(C, dtype=float), np.asarray(loss, dtype=float)
    if np.any(loss <= E):
        raise ValueError(f"{name}: loss {float(loss.min()):.4g} <= shared E {E:.4g}; "
                         "use per-architecture E (shared_E=False)")
    _check_points(len(loss), 2, f"{name} affine fit")
    if len(set(C.tolist())) < 2:
        raise ValueError(f"{name}: every point at one compute ({C[0]:.4g}): gamma is not identifiable; "
                         "give it points at 2 computes or more")
    line = linregress(np.log(C / C0), np.log(loss - E))
    return PowerLawFit(E=float(E), A=float(math.exp(line.intercept)), gamma=float(-line.slope), C0=C0,
                       gamma_se=float(line.stderr))


def fit_power_laws(runs, ref, C0=C_REF, shared_E=True, protocol="x"):
    """The [X] protocol. runs: {arch: (C array, loss array)}. E from the free fit (`protocol`) of `ref`,
    then every architecture, `ref` included, by the fixed-E regression with that E [X7], on all of its
    points. shared_E=False (the sensitivity option): each architecture's own free-fit E, then the same
    regression with it. Returns {arch: PowerLawFit}."""
    if ref not in runs:
        raise ValueError(f"reference architecture '{ref}' not found; have {sorted(runs)}")

    def free_E(arch):
        try:
            return fit_power_law(*runs[arch], C0=C0, protocol=protocol).E
        except ValueError as e:
            raise ValueError(f"{arch}: {e}") from None

    E = {a: free_E(a) for a in ([ref] if shared_E else runs)}
    return {a: fit_power_law_fixed_E(C, loss, E[ref if shared_E else a], C0, a)  # its errors name the arch
            for a, (C, loss) in runs.items()}


def compute_multiplier(ref_C, ref_loss, arm_C, arm_loss):
    """[X6] pi = C_ref / C_arm(L_ref), [X]'s rule: for each reference point (budget C_ref, loss L_ref),
    the arm's points in order of compute, and every consecutive pair (lower, upper) whose loss falls
    (L_upper < L_lower) and brackets L_ref (L_upper <= L_ref <= L_lower) gives a compute by
    interpolating log C linearly in L; the smallest of them is C_arm(L_ref). NaN where no pair brackets
    L_ref: never extrapolated."""
    ref_C, ref_loss = np.atleast_1d(np.asarray(ref_C, dtype=float)), np.atleast_1d(np.asarray(ref_loss, dtype=float))
    order = np.argsort(arm_C, kind="stable")
    log_c = np.log(np.asarray(arm_C, dtype=float)[order])
    L = np.asarray(arm_loss, dtype=float)[order]
    out = np.full(len(ref_C), np.nan)
    for i, (c, target) in enumerate(zip(np.log(ref_C), ref_loss)):
        reach = []  # log compute of every bracketing falling pair
        for j in range(len(L) - 1):
            lower, upper = L[j], L[j + 1]
            if upper < lower and upper <= target <= lower:
                t = (lower - target) / (lower - upper)  # 0 at the lower-compute point, 1 at the upper
                reach.append((1 - t) * log_c[j] + t * log_c[j + 1])  # exact at both ends
        if reach:
            out[i] = math.exp(c - min(reach))
    return out


# [X]-shaped synthetic ladders: one shared E [X7]; loop-2 is a constant improvement (a flat multiplier
# (1.5/1.4)^(1/0.3) = 1.2586 [X6]), untied-grow an exponent improvement (a multiplier rising with C).
SYNTHETIC_POWER_E = 2.0
SYNTHETIC_POWER_LAWS = {"vanilla": dict(A=1.5, gamma=0.30), "loop-2": dict(A=1.4, gamma=0.30),
                        "untied-grow": dict(A=1.45, gamma=0.32)}


def synthetic_power_runs(laws=None, E=SYNTHETIC_POWER_E, budgets=(1e18, 3e18, 1e19, 3e19, 1e20),
                         noise=0.001, seed=0, C0=1e18):
    """loss = (E + A (C/C0)^-gamma) x exp(noise * N(0,1)) [X5] for every arch at every budget;
    columns arch, C, loss as `fit.py power` reads them. tests/data/power_example.csv is
    tooling.tables.write_runs_csv(synthetic_power_runs(), ...)."""
    laws = laws or SYNTHETIC_POWER_LAWS
    rng = np.random.default_rng(seed)
    cols = {"arch": [], "C": [], "loss": []}
    for arch, law in laws.items():
        for C in budgets:
            cols["arch"].append(arch)
            cols["C"].append(float(C))
            cols["loss"].append(float(PowerLawFit(E=E, C0=C0, **law).loss(C)) * math.exp(noise * rng.standard_normal()))
    return {k: np.asarray(v, dtype=object if k == "arch" else float) for k, v in cols.items()}


# -----------------------------------------------------------------------------
# Cell bootstrap: resample cells with replacement, refit both surfaces (warm-started), percentiles


def _bootstrap_chunk(payload, draws):
    """Worker: refit both surfaces for the given draw indices; per-draw seeds make results independent
    of how draws are split across workers."""
    out = []
    n_cells = payload["n_cells"]
    C, S = payload["C"], payload["S"]
    for draw in draws:
        rng = np.random.default_rng([payload["seed"], draw])
        counts = np.bincount(rng.integers(0, n_cells, n_cells), minlength=n_cells).astype(float)
        fits = {}
        try:
            for arch in (payload["ref"], payload["target"]):
                F, Sp, D, loss, cell, init, centre = payload["data"][arch]
                fits[arch] = fit_surface(F, Sp, D, loss, weights=counts[cell], init=init, grid=None, centre=centre)
        except ValueError:  # a draw with too few distinct points for six coefficients: counted, left out
            out.append((draw, None))
            continue
        out.append((draw, _derived(fits[payload["ref"]], fits[payload["target"]], C, S)))
    return out


def _derived(ref_fit, tgt_fit, C, S):
    """Every bootstrapped quantity of one draw as a flat dict of arrays."""
    CC, SS = np.meshgrid(C, S, indexing="ij")
    d = {"ce_gain": ce_gain(ref_fit, tgt_fit, CC, SS)}
    for role, f in (("ref", ref_fit), ("target", tgt_fit)):
        d[f"{role}.tpp"] = tpp(f, CC, SS)
        for k in ("E", "A", "a", "b", "K", "c", "gamma"):
            d[f"{role}.{k}"] = np.array(getattr(f, k) if k != "gamma" else f.gamma)
    return d


def cell_bootstrap(runs, ref, target, budgets, sparsities, n_draws=2000, seed=0, n_workers=None,
                   full_fits=None, progress=True, keep_draws=False):
    """Cell bootstrap [S]: resample the architecture-independent cells with replacement (the same draw
    for both architectures), refit both surfaces warm-started from the full-data fits, and report
    2.5 / 97.5 percentiles of CE Gain (at each budget x sparsity), gamma, a, b, c, E, A, K and TPP.

    runs: {column: array} with arch, cell, F, S, D, loss (as read_runs_csv returns).
    Returns {"value": {...}, "lo": {...}, "hi": {...}} keyed "ce_gain", "ref.gamma", "target.tpp", ...
    (arrays of shape (len(budgets), len(sparsities)) for ce_gain / tpp), plus "draws" if keep_draws."""
    arch = np.asarray(runs["arch"]).astype(str)
    cell = np.asarray(runs["cell"]).astype(str)
    for a in (ref, target):
        if a not in set(arch):
            raise ValueError(f"architecture '{a}' not in the runs; have {sorted(set(arch))}")
    cell_names = sorted(set(cell[(arch == ref) | (arch == target)]))
    cell_id = {c: i for i, c in enumerate(cell_names)}
    full_fits = dict(full_fits or {})
    data = {}
    for a in (ref, target):
        m = arch == a
        F, S, D, loss = (np.asarray(runs[k], dtype=float)[m] for k in ("F", "S", "D", "loss"))
        u, x, y = np.log1p(-S), np.log(F), np.log(D)
        centre = _Centre(float(np.mean(u)), float(np.mean(x)), float(np.mean(y)))
        if a not in full_fits:
            full_fits[a] = fit_surface(F, S, D, loss, centre=centre)
        data[a] = (F, S, D, loss, np.array([cell_id[c] for c in cell[m]]), full_fits[a], centre)
    C, S = np.asarray(budgets, dtype=float), np.asarray(sparsities, dtype=float)
    payload = dict(data=data, n_cells=len(cell_names), seed=int(seed), ref=ref,
                   target=target, C=C, S=S)
    n_workers = n_workers or min(os.cpu_count() or 1, 8)
    size = max(1, min(25, n_draws // (4 * n_workers)))
    chunks = [list(range(i, min(i + size, n_draws))) for i in range(0, n_draws, size)]
    results = {}  # draw -> derived quantities, None when the draw could not be fitted
    bar = jobs.progress_bar(n_draws, "cell bootstrap", progress)
    if n_workers > 1:
        try:
            _bootstrap_pool(payload, chunks, n_workers, results, bar)
        except BrokenProcessPool:  # e.g. a script read from stdin cannot be re-imported by spawn
            warnings.warn("cell_bootstrap: worker processes failed; running the remaining draws serially")
    for ch in chunks:
        if ch[0] not in results:
            results.update(_bootstrap_chunk(payload, ch))
            bar.update(len(ch))
    bar.close()
    point = _derived(full_fits[ref], full_fits[target], C, S)
    good = [results[i] for i in range(n_draws) if results[i] is not None]
    if not good:
        raise ValueError(f"cell bootstrap: none of the {n_draws} draws had enough distinct points to fit")
    out = {"value": point, "lo": {}, "hi": {}, "n_draws": n_draws, "n_failed": n_draws - len(good),
           "full_fits": full_fits}
    for k in point:
        stack = np.stack([r[k] for r in good])
        out["lo"][k], out["hi"][k] = np.nanpercentile(stack, [2.5, 97.5], axis=0)
        if keep_draws:
            out.setdefault("draws", {})[k] = stack
    return out


def _bootstrap_pool(payload, chunks, n_workers, results, bar):
    """Run chunks on `n_workers` spawned processes (spawn: safe when the parent has torch / OpenMP
    threads alive), each with single-threaded BLAS. Ctrl-C: the workers ignore it and are ended by
    this process (stop_workers), so an interrupt is one KeyboardInterrupt here, not one per worker."""
    saved = {k: os.environ.get(k) for k in jobs.SINGLE_THREAD_ENV}
    os.environ.update(jobs.SINGLE_THREAD_ENV)
    try:
        with ProcessPoolExecutor(n_workers, mp_context=multiprocessing.get_context("spawn"),
                                 initializer=jobs.ignore_sigint) as pool:
            try:
                futures = {pool.submit(_bootstrap_chunk, payload, ch): len(ch) for ch in chunks}
                for fut in as_completed(futures):
                    results.update(fut.result())
                    bar.update(futures[fut])
            except BaseException:
                jobs.stop_workers(pool)
                raise
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# -----------------------------------------------------------------------------
# Downstream calibration [S6]-[S7]


@dataclass
class SigmoidCalibration:
    """[S6] y(l) = b + a / (1 + exp(-d alpha (l - tau))), a, alpha > 0; d = +1 when the score rises
    with validation loss, -1 when it falls."""
    b: float
    a: float
    alpha: float
    tau: float
    d: int
    r2: float = float("nan")

    def predict(self, loss):
        return self.b + self.a * expit(self.d * self.alpha * (np.asarray(loss, dtype=float) - self.tau))


def fit_calibration(ref_loss, ref_score, direction=-1):
    """[S6] four-parameter monotone sigmoid from validation loss to score, fitted on the reference
    architecture's endpoints by least squares (a, alpha log-parametrised; a few starts on tau)."""
    loss, score = np.asarray(ref_loss, dtype=float), np.asarray(ref_score, dtype=float)
    if direction not in (-1, 1):
        raise ValueError("direction must be +1 (score rises with loss) or -1 (score falls)")
    _check_points(len(loss), 4, "sigmoid calibration")
    d = direction

    def residual(p):
        b, log_a, log_alpha, tau = p
        return b + np.exp(log_a) * expit(d * np.exp(log_alpha) * (loss - tau)) - score

    span = max(float(np.ptp(score)), 1e-6)
    width = max(float(np.ptp(loss)), 1e-6)
    best = None
    for tau0 in np.quantile(loss, [0.1, 0.3, 0.5, 0.7, 0.9]):
        for scale in (0.5, 2.0, 8.0):
            p0 = [score.min() - 0.1 * span, math.log(1.2 * span), math.log(scale / width), tau0]
            res = least_squares(residual, p0, method="lm", max_nfev=4000)
            if best is None or res.cost < best.cost:
                best = res
    b, log_a, log_alpha, tau = best.x
    ss_res = float(np.sum(best.fun ** 2))
    ss_tot = float(np.sum((score - score.mean()) ** 2))
    return SigmoidCalibration(b=b, a=math.exp(log_a), alpha=math.exp(log_alpha), tau=tau, d=d,
                              r2=1 - ss_res / ss_tot if ss_tot > 0 else float("nan"))


def calibration_residuals(calibration, tgt_loss, tgt_score, sign=+1):
    """[S7] delta_i = s (y_i - y_hat(l_i)); s = +1 for higher-is-better scores, -1 otherwise, so that
    delta > 0 always means the target beats the reference at equal validation loss."""
    return sign * (np.asarray(tgt_score, dtype=float) - calibration.predict(tgt_loss))


# -----------------------------------------------------------------------------
# Downstream prediction pipeline [X19]-[X21]


def fit_task_nll(C, task_nll, C0=C_REF):
    """[X19] B(C) = E + A (C/1e18)^-alpha per (sequence, task), Huber fit on log-loss
    (fit_power_law_huber_log). Returns PowerLawFit (its `gamma` is the paper's alpha)."""
    return fit_power_law_huber_log(C, task_nll, C0=C0)


def fit_task_sigmoid(task_nll, centred_accuracy):
    """[X20] c_hat(B) = 1 / (1 + exp(s B - b)), shared across the compared sequences; returns (s, b)."""
    B, acc = np.asarray(task_nll, dtype=float), np.asarray(centred_accuracy, dtype=float)
    _check_points(len(B), 2, "task sigmoid")
    res = least_squares(lambda p: expit(p[1] - p[0] * B) - acc, [1.0, float(np.mean(B))], method="lm")
    return float(res.x[0]), float(res.x[1])


def fit_core_scale(filtered_mean, full_core):
    """[X21] the no-intercept factor r mapping the mean of the predicted tasks to full CORE."""
    x, y = np.asarray(filtered_mean, dtype=float), np.asarray(full_core, dtype=float)
    return float(np.dot(x, y) / np.dot(x, x))


def predict_core(C, task_laws, task_sigmoids, r):
    """[X21] CORE_hat(C) = r / T sum_t c_hat_t(B_t(C)) over the T predicted tasks."""
    scores = [expit(b - s * law.loss(C)) for law, (s, b) in zip(task_laws, task_sigmoids)]  # [X20]
    return r * np.mean(scores, axis=0)


def compute_for_core(target_core, task_laws, task_sigmoids, r, C_range=(1e15, 1e27)):
    """The budget at which the [X19]-[X21] pipeline predicts `target_core` (root find in log C);
    NaN when it is not reached inside C_range."""
    f = lambda lc: float(predict_core(math.exp(lc), task_laws, task_sigmoids, r)) - target_core
    lo, hi = math.log(C_range[0]), math.log(C_range[1])
    if f(lo) * f(hi) > 0:
        return float("nan")
    return math.exp(brentq(f, lo, hi, xtol=1e-10))


# -----------------------------------------------------------------------------
# Quadratic-vertex fits (compute-optimal TPP from log loss vs log TPP; growth fraction rho*)


def quadratic_vertex(x, y, log_x=True, log_y=True):
    """Fit y' = p0 + p1 x' + p2 x'^2 (x' = log x, y' = log y by default) and return the vertex
    {"x_opt", "y_opt", "curvature", "coef"}. Raises when the parabola opens downwards."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    _check_points(len(x), 3, "quadratic-vertex fit")
    xt = np.log(x) if log_x else x
    yt = np.log(y) if log_y else y
    p2, p1, p0 = np.polyfit(xt, yt, 2)
    if p2 <= 0:
        raise ValueError(f"quadratic-vertex fit: curvature {p2:.3g} <= 0, no minimum inside the data")
    xv = -p1 / (2 * p2)
    yv = p0 + p1 * xv + p2 * xv * xv
    return {"x_opt": float(math.exp(xv) if log_x else xv), "y_opt": float(math.exp(yv) if log_y else yv),
            "curvature": float(p2), "coef": [float(p0), float(p1), float(p2)]}


def optimal_tpp(tpp_values, loss):
    """Compute-optimal TPP at one budget: vertex of log loss vs log TPP ([X] Stage 2)."""
    return quadratic_vertex(tpp_values, loss)["x_opt"]


def optimal_growth_fraction(rho, loss):
    """rho*: vertex of log loss vs rho (linear in rho) ([X] growth sweeps)."""
    return quadratic_vertex(rho, loss, log_x=False)["x_opt"]


# =============================================================================
# Command line: fit.py surface | chinchilla | power. Everything above is the fits and needs nothing below;
# here a runs CSV is read (tooling.tables), fitted, printed, and drawn with --plot (tooling.plots).

SURFACE_COLUMNS = ["arch", "cell", "F", "S", "D", "loss"]  # the columns `surface` reads
# (power: tooling.tables.read_power_csv, arch/C/loss[/depth]; chinchilla: tooling.tables.read_chinchilla_csv)


class _UsageError(Exception):
    """A bad command line, raised by _Parser instead of argparse's usage-and-exit."""

    def __init__(self, prog, message):
        super().__init__(message)
        self.prog = prog


class _Parser(argparse.ArgumentParser):
    """argparse, but a mistake goes back to main(), which reports it like every other: one line. No
    abbreviations: `--boot 5` is an error, not a silent --bootstrap 5."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message):
        raise _UsageError(self.prog, message)


def _numbers(text, ok, rule):
    """argparse type: comma-separated finite numbers, each satisfying ok(v)."""
    try:
        values = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        values = []
    if not values or not all(math.isfinite(v) and ok(v) for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers {rule}, got '{text}'")
    return values


def _budgets(text):
    return _numbers(text, lambda v: v > 0, "> 0")


def _sparsities(text):
    return _numbers(text, lambda v: 0 <= v < 1, "in [0, 1)")


def _data_lines(path):
    """The line each data row of a CSV that tables read starts on (blank rows skipped, as tables skips them)."""
    with open(path, "rb") as f:
        rows = tables._csv_lines(path, tables._decode_utf8(path, f.read()))
    return [lineno for lineno, row in rows[1:] if any(cell.strip() for cell in row)]


def _refuse_case_variants(path, names, column):
    """One name spelled two ways ('Vanilla', 'vanilla') would split its points into two architectures (or
    cells): refused, naming both lines."""
    first = {}
    for i, name in enumerate(names):
        j = first.setdefault(name.casefold(), i)
        if names[j] != name:
            lines = _data_lines(path)
            raise ValueError(f"{path} line {lines[i]}, column '{column}': '{name}' and '{names[j]}' (line {lines[j]}) "
                             "differ only in case; spell the name one way")


def _json_safe(v):
    v = float(v)
    return v if math.isfinite(v) else None


def run_surface(args):
    runs = tables.read_runs_csv(args.csv, SURFACE_COLUMNS, positive=["F", "D", "loss"], fraction=["S"])
    for column in ("arch", "cell"):
        _refuse_case_variants(args.csv, runs[column].astype(str).tolist(), column)
    budgets, sparsities = args.budgets, args.sparsity
    archs = list(dict.fromkeys(runs["arch"].astype(str).tolist()))
    for name in (args.ref, args.target):
        if name not in archs:
            raise ValueError(f"{args.csv}: architecture '{name}' not found in column 'arch'; have {archs}")
    fits = {}
    for a in archs:
        m = runs["arch"].astype(str) == a
        try:
            fits[a] = fit_surface(runs["F"][m], runs["S"][m], runs["D"][m], runs["loss"][m])
        except ValueError as e:
            raise ValueError(f"{args.csv}: arch '{a}': {e}") from None
    boot = None
    if args.bootstrap:
        try:
            boot = cell_bootstrap(runs, args.ref, args.target, budgets, sparsities, n_draws=args.bootstrap,
                                  seed=args.seed, full_fits={args.ref: fits[args.ref], args.target: fits[args.target]})
        except ValueError as e:
            raise ValueError(f"{args.csv}: {e}") from None
    gain = ce_gain(fits[args.ref], fits[args.target], *np.meshgrid(budgets, sparsities, indexing="ij"))
    out = {"fits": {a: {k: _json_safe(v) for k, v in f.to_dict().items()} for a, f in fits.items()},
           "ce_gain": [], "tpp": []}
    for i, C in enumerate(budgets):
        for j, S in enumerate(sparsities):
            lo = hi = None
            if boot:
                lo, hi = _json_safe(boot["lo"]["ce_gain"][i, j]), _json_safe(boot["hi"]["ce_gain"][i, j])
            out["ce_gain"].append({"C": C, "S": S, "value": _json_safe(gain[i, j]), "lo": lo, "hi": hi})
    for role, a in (("ref", args.ref), ("target", args.target)):
        for C in budgets:
            for j, S in enumerate(sparsities):
                lo = hi = None
                if boot:
                    i = budgets.index(C)
                    lo, hi = _json_safe(boot["lo"][f"{role}.tpp"][i, j]), _json_safe(boot["hi"][f"{role}.tpp"][i, j])
                out["tpp"].append({"arch": a, "C": C, "S": S, "value": _json_safe(tpp(fits[a], C, S)), "lo": lo, "hi": hi})
    if args.json:
        print(json.dumps(out))
    else:
        print(f"{'arch':>12} {'E':>8} {'A':>10} {'a':>7} {'b':>7} {'K':>10} {'c':>7} {'gamma':>7} {'rmse':>8}")
        for a, f in fits.items():
            print(f"{a:>12} {f.E:8.4f} {f.A:10.4g} {f.a:7.4f} {f.b:7.4f} {f.K:10.4g} {f.c:7.4f} {f.gamma:7.4f} {f.rmse:8.5f}")
        print(f"\nCE Gain of {args.target} over {args.ref} [S5]" + (f" ({args.bootstrap} cell-bootstrap draws, 95%)" if boot else ""))
        for r in out["ce_gain"]:
            ci = f"  [{r['lo']:.3f}, {r['hi']:.3f}]" if boot else ""
            print(f"  C={r['C']:.3g} S={r['S']:.3g}: {r['value']:.4f}{ci}")
        print("\nTPP = D*/(F*/6)")
        for r in out["tpp"]:
            ci = f"  [{r['lo']:.1f}, {r['hi']:.1f}]" if boot else ""
            print(f"  {r['arch']:>12} C={r['C']:.3g} S={r['S']:.3g}: {r['value']:.1f}{ci}")
    if args.plot:
        plots.plot_surface_frontiers(frontier_curves({a: fits[a] for a in (args.ref, args.target)}), sparsities,
                                     args.plot)


def run_chinchilla(args):
    runs = tables.read_chinchilla_csv(args.csv)
    N, D, loss = runs["N"], runs["D"], runs["loss"]
    if args.drop_highest >= len(loss):
        raise ValueError(f"{args.csv}: --drop-highest {args.drop_highest} leaves no points (the file has {len(loss)})")
    keep = np.argsort(loss)[: len(loss) - args.drop_highest]
    N, D, loss = N[keep], D[keep], loss[keep]
    try:
        fit = fit_chinchilla(N, D, loss)
    except ValueError as e:
        raise ValueError(f"{args.csv}: {e}") from None
    if args.json:
        print(json.dumps(fit.to_dict()))
    else:
        print(f"Chinchilla Approach 3 on {len(loss)} points: E={fit.E:.4f} A={fit.A:.2f} B={fit.B:.2f} "
              f"alpha={fit.alpha:.4f} beta={fit.beta:.4f} (Huber objective {fit.objective:.6g}, rmse {fit.rmse:.4f})")


def run_power(args):
    rows = tables.read_power_csv(args.csv)
    _refuse_case_variants(args.csv, rows["arch"].astype(str).tolist(), "arch")
    archs = list(dict.fromkeys(rows["arch"].astype(str).tolist()))
    if args.ref not in archs:
        raise ValueError(f"{args.csv}: architecture '{args.ref}' not found in column 'arch'; have {archs}")
    runs = {}
    for a in archs:
        m = rows["arch"].astype(str) == a
        runs[a] = (rows["C"][m], rows["loss"][m])
    try:
        fits = fit_power_laws(runs, args.ref, C0=args.C0, shared_E=not args.per_arch_E, protocol=args.protocol)
    except ValueError as e:
        raise ValueError(f"{args.csv}: {e}") from None
    # refused, not flagged: a gamma <= 0 printed with status 0 (or in --json) would read as a measured law;
    # dropping the arch's rows fits the others
    for a, f in fits.items():
        if not f.gamma > 0:
            raise ValueError(f"{args.csv}: {a}: loss does not fall with compute (gamma {f.gamma + 0.0:.4g} with E "
                             f"{f.E:.4g} fixed): no power law to fit; fix or drop its rows")
    budget = rows["arch"].astype(str) == args.ref  # [X6] budgets: the reference's points (or its deeper ones)
    if args.min_depth is not None:
        if "depth" not in rows:
            raise ValueError(f"{args.csv}: --min-depth needs a column 'depth'")
        budget &= rows["depth"] >= args.min_depth
        if not budget.any():
            raise ValueError(f"{args.csv}: --min-depth {args.min_depth:g} leaves none of {args.ref}'s points")
    ref_C, ref_L = rows["C"][budget], rows["loss"][budget]
    mult = {a: compute_multiplier(ref_C, ref_L, *runs[a]) for a in archs}
    out = {"protocol": args.protocol, "E": fits[args.ref].E, "C0": args.C0, "shared_E": not args.per_arch_E,
           "min_depth": args.min_depth,
           "fits": {a: {"E": f.E, "A": f.A, "gamma": f.gamma, "gamma_se": _json_safe(f.gamma_se)} for a, f in fits.items()},
           "multipliers": {a: [{"C": float(c), "value": _json_safe(v)} for c, v in zip(ref_C, mult[a])]
                           for a in archs if a != args.ref}}
    if args.json:
        print(json.dumps(out))
    else:
        how = {"x": "[X]'s free fit", "huber-log": "Huber on log-loss"}[args.protocol]
        source = f"fitted on {args.ref} ({how}) and shared" if out["shared_E"] else f"per architecture ({how})"
        print(f"[X7] E = {out['E']:.4f}, {source}; C0 = {args.C0:g}; (A, gamma +- its standard error) with E fixed")
        w = max(len(a) for a in archs)
        for a, f in fits.items():
            print(f"  {a:>{w}}: E={f.E:.4f} A={f.A:.4f} gamma={f.gamma:.5f} +- {f.gamma_se:.5f}")
        which = f"depth >= {args.min_depth:g}" if args.min_depth is not None else "every measured budget"
        print(f"[X6] compute multipliers vs {args.ref} at its budgets ({which}): interpolated, never extrapolated "
              "(nan = outside the arch's measured range)")
        for a in out["multipliers"]:
            vals = " ".join(f"{m['C']:.3g}:{m['value']:.3f}" if m["value"] is not None else f"{m['C']:.3g}:nan"
                            for m in out["multipliers"][a])
            print(f"  {a:>{w}}: {vals}")
    if args.plot:
        plots.plot_power_laws(runs, fits, mult, args.ref, args.plot, budgets=ref_C)


SUBCOMMANDS = {  # name: (one line for `fit.py --help`, the input it reads for `fit.py NAME --help`)
    "surface": ("SMELT surfaces [S2], CE Gain [S5], TPP, cell bootstrap",
                "Fits L(F, S, D) = E + A (1-S)^b / F^a + K / D^c [S2] per architecture; prints each surface, the CE\n"
                "Gain [S5] of --target over --ref and TPP = D*/(F*/6) at every --budgets x --sparsity.\n\n"
                "Input: a CSV, one row per measured point, with columns arch, cell (the grid cell the point\n"
                "belongs to: the bootstrap resamples cells), F (training FLOPs per token, > 0), S (sparsity in\n"
                "[0, 1)), D (training tokens, > 0) and loss (> 0). Other columns are ignored."),
    "chinchilla": ("Chinchilla Approach 3",
                   "Fits L(N, D) = E + A / N^alpha + B / D^beta (Chinchilla Approach 3: Huber on log-loss).\n\n"
                   "Input: a CSV with columns N (parameters; or params), D (training tokens; or C or train_flops,\n"
                   "the training FLOPs, then D = C / 6N) and loss, all > 0. Other columns are ignored."),
    "power": ("[X] protocol: shared-E power laws and compute multipliers",
              "Fits L(C) = E + A (C/C0)^-gamma [X5]: E by a free fit of --ref, then every architecture (--ref\n"
              "included) with that E fixed [X7], by least squares of log(L - E) on log(C/C0) on all of its\n"
              "points; prints each gamma with its standard error, and the compute multipliers [X6] against\n"
              "--ref at its budgets.\n\n"
              "--protocol x (the default) is the [X] paper's own fit of E: a 600-point grid over E in\n"
              "[0, 0.995 min L] for the start, bounded least squares on the raw loss, then a Huber pass with\n"
              "f_scale = 1.345 MAD / 0.6745 of its residuals. --protocol huber-log is the surfaces' protocol\n"
              "(summed Huber, delta 1e-3, on log-loss). Multipliers: the arch's consecutive points whose loss\n"
              "falls and brackets --ref's loss, log compute interpolated linearly in loss, the smallest such\n"
              "compute; nan where none brackets (never extrapolated).\n\n"
              "Input: a CSV with columns arch, C (training FLOPs, > 0) and loss (> 0), optionally depth; the\n"
              "[X] paper's released ladders' names arm, compute_flops, val_loss are read as arch, C, loss\n"
              "(tests/data/fineweb_ladders.csv). Repeated seeds are rows with the same arch and C. Other\n"
              "columns are ignored.\n\n"
              "The paper's ladder figure: fit.py power tests/data/fineweb_ladders.csv --ref vanilla --min-depth 8"),
}


def build_parser():
    p = _Parser(prog="fit.py", description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True, help="the fit to run; `fit.py NAME --help` lists its flags "
                                                         "and the CSV columns it reads")
    add = lambda name: sub.add_parser(name, help=SUBCOMMANDS[name][0], description=SUBCOMMANDS[name][1],  # noqa: E731
                                      formatter_class=argparse.RawDescriptionHelpFormatter)
    json_help = "print one JSON object instead of tables"
    s = add("surface")
    s.add_argument("csv", help="the runs CSV (columns arch, cell, F, S, D, loss)")
    s.add_argument("--ref", required=True, help="reference architecture, a value of column arch (e.g. baseline)")
    s.add_argument("--target", required=True, help="architecture compared with --ref, a value of column arch "
                                                    "(e.g. smelt); CE Gain > 0: it needs less compute")
    s.add_argument("--budgets", type=_budgets, default="1e20,1e21", metavar="C,C,...",
                   help="comma-separated compute budgets C = F x D in FLOPs at which CE Gain and TPP are reported "
                        "(default: 1e20,1e21)")
    s.add_argument("--sparsity", type=_sparsities, default="0.85,0.95", metavar="S,S,...",
                   help="comma-separated sparsities S in [0, 1) at which CE Gain and TPP are reported "
                        "(default: 0.85,0.95)")
    s.add_argument("--bootstrap", type=common.number(int, 0), default=0, metavar="N",
                   help="cell-bootstrap draws for 95%% intervals of every number (paper: 2000; default 0: no "
                        "intervals)")
    s.add_argument("--seed", type=common.number(int, 0), default=0, help="seed of the cell bootstrap: the same seed gives the same "
                                                          "intervals (default 0)")
    s.add_argument("--json", action="store_true", help=json_help)
    s.add_argument("--plot", metavar="FILE", help="also draw the [S4] iso-sparsity frontiers of --ref and --target "
                                                  "into FILE (.png, .pdf or .svg; needs matplotlib)")
    c = add("chinchilla")
    c.add_argument("csv", help="the runs CSV (columns N, D, loss; or N, C, loss; or params, train_flops, loss)")
    c.add_argument("--drop-highest", type=common.number(int, 0), default=0, metavar="K",
                   help="drop the K highest-loss points before fitting (Epoch AI's replication: 5; default 0)")
    c.add_argument("--json", action="store_true", help="print one JSON object instead of a line of text")
    w = add("power")
    w.add_argument("csv", help="the runs CSV (columns arch, C, loss, optionally depth; or arm, compute_flops, "
                               "val_loss)")
    w.add_argument("--ref", required=True, help="reference architecture, a value of column arch (e.g. vanilla): E "
                                                "is fitted on it and shared [X7], multipliers are against it [X6]")
    w.add_argument("--protocol", choices=POWER_PROTOCOLS, default="x",
                   help="how E is fitted on --ref: x = the [X] paper's fit (default), huber-log = Huber on "
                        "log-loss (the surfaces' protocol)")
    w.add_argument("--C0", type=common.number(float, 0, open_low=True), default=C_REF, help="compute scale C0 in FLOPs of L = E + A (C/C0)^-gamma "
                                                               "(default 1e18, [X]'s): it changes A, not E or gamma")
    w.add_argument("--min-depth", type=common.number(float, 0, open_low=True), metavar="D",
                   help="multiplier budgets: only --ref's points with depth >= D (needs a depth column; [X]'s "
                        "figure uses 8). Default: every point of --ref")
    w.add_argument("--per-arch-E", action="store_true", help="sensitivity option: fit E per architecture instead "
                                                             "of sharing the reference's")
    w.add_argument("--json", action="store_true", help=json_help)
    w.add_argument("--plot", metavar="FILE", help="also draw loss vs compute with the fitted laws and the compute "
                                                  "multipliers side by side into FILE (needs matplotlib)")
    return p


def main(argv=None):
    try:
        args = build_parser().parse_args(argv)
        {"surface": run_surface, "chinchilla": run_chinchilla, "power": run_power}[args.cmd](args)
    except _UsageError as e:
        return cli_error(e.prog, e)
    except (OSError, ValueError) as e:  # missing file, malformed CSV (file, line, column), data that cannot be fitted
        return cli_error("fit.py", e)
    except KeyboardInterrupt:  # Ctrl-C (a long --bootstrap): one line, the shell's status for SIGINT
        print("fit.py: interrupted (a fit keeps nothing partial: rerun the same command)", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
