"""
Scaling-law fits of both papers, all by one Huber fit: SMELT surfaces [S2]-[S5],
Chinchilla Approach 3, the [X] protocol [X4]-[X7], the cell bootstrap, quadratic
vertices; read_runs reads every runs CSV. `python fit.py NAME --help` says more.

    python fit.py power tests/data/fineweb_ladders.csv --ref vanilla --min-depth 8  # [X]'s ladders
    python fit.py chinchilla tests/data/chinchilla_fig4_epoch.csv --drop-highest 5  # Epoch's
    python fit.py surface RUNS.csv --ref baseline --target smelt  # CE Gain, TPP
"""
import argparse
import csv
import itertools
import json
import math
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from contextlib import nullcontext
from dataclasses import asdict, dataclass

import numpy as np
from scipy.optimize import least_squares, minimize
from scipy.stats import linregress
from threadpoolctl import ThreadpoolController
from tqdm import tqdm

# -----------------------------------------------------------------------------
# The one fit of every law: L = E + A e^(b u - a x) + K e^(-c y), with
# u = log(1-S), x = log F (or N, or C/C0), y = log D, all centred.
# theta = [log E, log A, a, b, log K, c]; `free` fixes what a law lacks.
# L-BFGS-B minimises summed Huber on log-loss from the grid's best points,
# each scored with its exact (E, A, K) (variable projection).

HUBER_DELTA = 1e-3  # [S2], Chinchilla

# Tiny matrices: one BLAS thread is fastest, and safe in pool workers.
_BLAS = ThreadpoolController()


def huber(r, delta=HUBER_DELTA):
    """Huber loss: r^2/2 for |r| <= delta, delta(|r| - delta/2) beyond."""
    # The clipped residual is also dHuber/dr.
    clipped = np.clip(r, -delta, delta)
    return clipped * (r - 0.5 * clipped)


def _log_law(theta, u, x, y):
    # log L-hat and the softmax weights of its three terms.
    logE, logA, a, b, logK, c = theta
    terms = np.stack(np.broadcast_arrays(logE, logA + b * u - a * x, logK - c * y))
    # Log-sum-exp: subtract the largest term, so exp cannot overflow.
    m = terms.max(axis=0)
    ex = np.exp(terms - m)
    s = ex[0] + ex[1] + ex[2]
    return m + np.log(s), ex / s


def _objective(theta, u, x, y, log_loss, weights, delta, free, fixed, scale):
    # Summed Huber on log-loss and its gradient in the free parameters.
    full = fixed.copy()
    full[free] = theta
    log_pred, w = _log_law(full, u, x, y)
    r = log_pred - log_loss
    clipped = np.clip(r, -delta, delta)
    value = float(np.dot(weights, clipped * (r - 0.5 * clipped)))
    # The chain rule: each term's share w of the law times dHuber/dr.
    dr = weights * clipped
    t1, t2 = dr * w[1], dr * w[2]
    grad = np.array([np.dot(dr, w[0]), t1.sum(), -np.dot(t1, x),
                     np.dot(t1, u), t2.sum(), -np.dot(t2, y)])
    return value * scale, grad[free] * scale


def _nnls_batched(G, target, rw):
    # Nonnegative least squares of P tiny problems (n, m <= 3): the best
    # unconstrained fit over the column subsets whose coefficients are > 0.
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
            rhs = np.einsum("pni,n->pi", Gs, tw)[..., None]
            beta = np.linalg.solve(M, rhs)[..., 0]
            fitted = np.einsum("pni,pi->pn", Gs, beta)
            res = np.sum((tw[None] - fitted) ** 2, axis=1)
            ok = np.all(beta > 0, axis=1) & (res < best_res)
            best_res[ok] = res[ok]
            full = np.zeros((P, m))
            full[:, subset] = beta
            best_beta[ok] = full[ok]
    return best_beta


def _varpro_starts(u, x, y, loss, weights, exp_grid, delta, n_keep, use_K=True):
    # The n_keep best starting thetas of the grid.
    log_loss = np.log(loss)
    a, b, c = (g[:, None] for g in exp_grid.T)
    cols = [np.ones((len(a), len(x))), np.exp(b * u[None] - a * x[None])]
    if use_K:
        cols.append(np.exp(-c * y[None]))
    G = np.stack(cols, axis=2)
    # Relative residuals are close to log-loss ones.
    rw = np.sqrt(weights) / loss
    beta = _nnls_batched(G, loss, rw)
    pred = np.einsum("pnm,pm->pn", G, beta)
    with np.errstate(divide="ignore", invalid="ignore"):
        log_pred = np.log(np.maximum(pred, 1e-300))
        score = np.sum(weights * huber(log_pred - log_loss, delta), axis=1)
    score[~np.isfinite(score)] = np.inf
    order = np.argsort(score)[:n_keep]
    # A zero coefficient starts tiny, as its log must be finite.
    coef = np.log(np.maximum(beta[order], 1e-6 * float(np.min(loss))))
    logK = coef[:, 2] if use_K else np.full(len(order), math.log(1e-300))
    exps = exp_grid[order]
    theta = [coef[:, 0], coef[:, 1], exps[:, 0], exps[:, 1], logK, exps[:, 2]]
    return list(np.column_stack(theta))


BOUNDS = [(-40.0, 40.0), (-200.0, 200.0), (0.0, 10.0), (-10.0, 10.0), (-200.0, 200.0), (0.0, 10.0)]


def _lbfgsb(theta0, u, x, y, loss, weights, delta, free, reduce="sum", tol="tight", maxiter=2000):
    # One L-BFGS-B run from theta0 -> (theta, summed objective).
    # tol="scipy" (the naive protocol) stops early on this flat objective.
    log_loss = np.log(loss)
    free_idx = np.flatnonzero(free)
    scale = 1.0 if reduce == "sum" else 1.0 / float(np.sum(weights))
    tight = dict(gtol=1e-10, ftol=1e-13, maxcor=20) if tol == "tight" else {}
    options = dict(maxiter=maxiter, **tight)
    # A constant factor: same optimum, gradients O(1).
    scale /= delta if tol == "tight" else 1.0
    theta = np.array(theta0, dtype=float)
    args = (u, x, y, log_loss, weights, delta, free_idx, theta.copy(), scale)
    bounds = [BOUNDS[i] for i in free_idx]
    res = minimize(_objective, theta[free_idx], args=args, jac=True, method="L-BFGS-B",
                   bounds=bounds, options=options)
    theta[free_idx] = res.x
    r = _log_law(theta, u, x, y)[0] - log_loss
    return theta, float(np.sum(weights * huber(r, delta)))


def fit_core(u, x, y, loss, weights, delta, free, exp_grid, n_keep, inits=(),
             reduce="sum", use_K=True, tol="tight"):
    """The best L-BFGS-B run from `inits` and the grid's n_keep best."""
    with _BLAS.limit(limits=1, user_api="blas"):
        starts = list(inits)
        if exp_grid is not None and len(exp_grid):
            starts += _varpro_starts(u, x, y, loss, weights, exp_grid, delta, n_keep, use_K)
        # The lowest objective over all starts wins.
        best = (None, np.inf)
        for theta0 in starts:
            theta, value = _lbfgsb(theta0, u, x, y, loss, weights, delta, free, reduce, tol)
            if value < best[1]:
                best = (theta, value)
    return best[0], best[1], len(starts)


def exponent_grid(a_values, b_values, c_values):
    """Every triple (a, b, c) of the three lists."""
    return np.array(list(itertools.product(a_values, b_values, c_values)), dtype=float)


HOFFMANN_INIT = dict(E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28)  # Hoffmann et al. 2022

# The exponents (a, b, c) each law starts from.
SURFACE_GRID = exponent_grid(
    np.geomspace(0.05, 2, 20), np.linspace(-0.5, 3, 15), np.geomspace(0.05, 2, 20))
CHINCHILLA_GRID = exponent_grid(
    np.geomspace(0.02, 2.5, 40), [0.0], np.geomspace(0.02, 2.5, 40))
POWER_GRID = exponent_grid(np.geomspace(0.005, 3.0, 400), [0.0], [0.0])


# -----------------------------------------------------------------------------
# Reading a runs CSV (fit.py, downstream.py and the ladders)

def _cell(text):
    # A CSV cell as int, float, None (empty), bool or str.
    text = (text or "").strip()
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"": None, "True": True, "False": False}.get(text, text)


def read_runs(path, numbers=(), text=(), rename=None):
    """The rows of a runs CSV as dicts of typed cells (see _cell)."""
    # `numbers` columns hold finite numbers; `text` ones stay as written.
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.DictReader(f)
        names = [(rename or {}).get(n.strip(), n.strip()) for n in reader.fieldnames or []]
        reader.fieldnames = names
        # DictReader would keep the last of two equal columns.
        twice = [n for n in dict.fromkeys(names) if names.count(n) > 1]
        if twice:
            raise ValueError(f"{path}: column {twice[0]!r} appears more than once in its header")
        missing = [c for c in (*numbers, *text) if c not in names]
        if missing:
            raise ValueError(f"{path}: no column {', '.join(missing)} in its header {names}")
        rows = []
        for row in reader:
            row = {k: (v or "").strip() if k in text else _cell(v)
                   for k, v in row.items() if k is not None}
            bad = [c for c in numbers
                   if type(row[c]) not in (int, float) or not math.isfinite(row[c])]
            if bad:
                raise ValueError(f"{path} line {reader.line_num}: "
                                 f"{bad[0]} {row[bad[0]]!r} is not a number")
            rows.append(row)
    return rows


def _column(rows, key, arch=None):
    return np.array([r[key] for r in rows if arch is None or r["arch"] == arch], dtype=float)


def check_points(n, n_coef, what, distinct=None):
    """Refuse n <= n_coef points (or, in C, < n_coef distinct computes)."""
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
        return self.a * self.c / (self.a + self.c)  # [S4]

    def loss(self, F, S, D):
        F, S, D = (np.asarray(v, float) for v in (F, S, D))
        return self.E + self.A * (1.0 - S) ** self.b / F ** self.a + self.K / D ** self.c

    def to_dict(self):
        keys = ("E", "A", "a", "b", "K", "c", "rmse")
        return {**{k: getattr(self, k) for k in keys}, "gamma": self.gamma}


def fit_surface(F, S, D, loss, weights=None, init=None, grid=SURFACE_GRID, n_keep=8,
                delta=HUBER_DELTA, centre=None, fixed_exponents=None):
    """[S2] fitted from the grid's best points and `init`."""
    # init: a SurfaceFit (with grid=None, the only start). fixed_exponents:
    # (a, b, c), None where free; the others are held [S 5.2].
    F, S, D, loss = (np.asarray(v, float).ravel() for v in (F, S, D, loss))
    _positive(F=F, D=D, loss=loss, **{"1 - S": 1 - S})
    weights = np.ones_like(loss) if weights is None else np.asarray(weights, float)
    held = np.array([v is not None for v in fixed_exponents or (None,) * 3])
    n_used = int(np.count_nonzero(weights))
    check_points(n_used, 6 - int(held.sum()), "SMELT surface")
    # Centred logs decorrelate A and a; the result is uncentred.
    u, x, y = np.log1p(-S), np.log(F), np.log(D)
    u0, x0, y0 = centre or (u.mean(), x.mean(), y.mean())
    free = np.ones(6, dtype=bool)
    if held.any():
        # Every start holds the fixed exponents.
        free[np.array([2, 3, 5])[held]] = False
        values = [0.0 if v is None else v for v in fixed_exponents]
        grid = np.unique(np.where(held, values, grid), axis=0)
    inits = []
    if init is not None:
        logA, logK = math.log(init.A) + init.b * u0 - init.a * x0, math.log(init.K) - init.c * y0
        inits = [np.array([math.log(init.E), logA, init.a, init.b, logK, init.c])]
    u, x, y = u - u0, x - x0, y - y0
    theta, value, _ = fit_core(u, x, y, loss, weights, delta, free, grid, n_keep, inits)
    logE, logA, a, b, logK, c = (float(t) for t in theta)
    fit = SurfaceFit(E=math.exp(logE), A=math.exp(logA - b * u0 + a * x0), a=a, b=b,
                     K=math.exp(logK + c * y0), c=c, objective=value, n_points=n_used)
    fit.rmse = float(np.sqrt(np.average((fit.loss(F, S, D) - loss) ** 2, weights=weights)))
    return fit


def optimal_flops(fit, C, S):
    """[S3] F* = (a A (1-S)^b C^c / (c K))^(1/(a+c)), the optimum at C = F D."""
    C, S = np.asarray(C, float), np.asarray(S, float)
    base = fit.a * fit.A * (1 - S) ** fit.b * C ** fit.c / (fit.c * fit.K)
    return base ** (1 / (fit.a + fit.c))


def frontier_prefactor(fit, S):
    """[S4] f(A, K, a, b, c, S) such that L*(C, S) = E + f C^-gamma."""
    A_s = fit.A * (1 - np.asarray(S, float)) ** fit.b
    G = (fit.a * A_s / (fit.c * fit.K)) ** (1 / (fit.a + fit.c))  # F* = G C^(c/(a+c))
    return A_s * G ** (-fit.a) + fit.K * G ** fit.c


def frontier_loss(fit, C, S):
    """[S4] L*(C, S)."""
    C = np.asarray(C, float)
    return fit.E + frontier_prefactor(fit, S) * C ** (-fit.gamma)


def frontier_curves(fits):
    """{arch: (gamma, excess(C, S) = L*(C, S) - E)} for plots."""
    return {arch: (f.gamma, lambda C, S, f=f: frontier_loss(f, C, S) - f.E)
            for arch, f in fits.items()}


def frontier_compute(fit, loss, S):
    """[S4] inverted: the budget reaching `loss` (inf if loss <= E)."""
    excess = np.asarray(loss, float) - fit.E
    with np.errstate(divide="ignore", invalid="ignore"):
        log_c = -np.log(excess / frontier_prefactor(fit, S)) / fit.gamma
    return np.where(excess > 0, np.exp(log_c), np.inf)


def ce_gain(ref_fit, tgt_fit, C, S):
    """[S5] CE Gain = 1 - C / C_ref, C_ref the ref's budget reaching the target's L*."""
    # 0 for equal surfaces, > 0 when the target's frontier is lower,
    # 1 when the ref never reaches it; nan if a or c = 0.
    with np.errstate(divide="ignore", invalid="ignore"):
        C_ref = frontier_compute(ref_fit, frontier_loss(tgt_fit, C, S), S)
        return 1.0 - np.asarray(C, float) / C_ref


def tpp(fit, C, S):
    """Tokens per dense-equivalent parameter at the optimum, D* / (F*/6)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        F_opt = optimal_flops(fit, C, S)
        return (np.asarray(C, float) / F_opt) / (F_opt / 6.0)


def fit_subsets(full_fit, F, S, D, loss, subset, weights=None):
    """[S 5.2] {label: SurfaceFit}: (E, A, K) refitted per subset, (a, b, c) kept."""
    subset, arrays = np.asarray(subset), [np.asarray(v) for v in (F, S, D, loss)]
    exponents = (full_fit.a, full_fit.b, full_fit.c)
    fits = {}
    for label in dict.fromkeys(subset.tolist()):
        m = subset == label
        w = None if weights is None else np.asarray(weights)[m]
        fits[label] = fit_surface(*(v[m] for v in arrays), weights=w, fixed_exponents=exponents)
    return fits


# -----------------------------------------------------------------------------
# Chinchilla Approach 3: L(N, D) = E + A / N^alpha + B / D^beta

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
        N, D = np.asarray(N, float), np.asarray(D, float)
        return self.E + self.A / N ** self.alpha + self.B / D ** self.beta

    def to_dict(self):
        return {k: v for k, v in asdict(self).items() if k != "rmse"}


def fit_chinchilla(N, D, loss, grid=CHINCHILLA_GRID, inits=(), reduce="sum", centre=True,
                   n_keep=8, delta=HUBER_DELTA, tol="tight"):
    """Chinchilla Approach 3 from the grid and `inits`."""
    # The naive protocol: grid=None, inits=[HOFFMANN_INIT], reduce="mean",
    # centre=False, tol="scipy".
    N, D, loss = (np.asarray(v, float).ravel() for v in (N, D, loss))
    _positive(N=N, D=D, loss=loss)
    check_points(len(loss), 5, "Chinchilla fit")
    x0, y0 = 0.0, 0.0
    if centre:
        x0, y0 = float(np.mean(np.log(N))), float(np.mean(np.log(D)))
    starts = [np.array([math.log(p["E"]), math.log(p["A"]) - p["alpha"] * x0, p["alpha"], 0.0,
                        math.log(p["B"]) - p["beta"] * y0, p["beta"]]) for p in inits]
    # No (1-S)^b term: u = 0, b fixed.
    free = np.array([True, True, True, False, True, True])
    x, y = np.log(N) - x0, np.log(D) - y0
    theta, value, _ = fit_core(np.zeros_like(loss), x, y, loss, np.ones_like(loss), delta,
                               free, grid, n_keep, starts, reduce, tol=tol)
    logE, logA, alpha, _, logB, beta = (float(t) for t in theta)
    fit = ChinchillaFit(E=math.exp(logE), A=math.exp(logA + alpha * x0),
                        B=math.exp(logB + beta * y0), alpha=alpha, beta=beta, objective=value)
    fit.rmse = float(np.sqrt(np.mean((fit.loss(N, D) - loss) ** 2)))
    return fit


# -----------------------------------------------------------------------------
# The [X] protocol: L(C) = E + A (C/C0)^-gamma [X5], E fitted on the
# reference and shared [X7]; compute multipliers [X6]. Protocol "x" is the
# paper's recipe; "huber-log" the surfaces' protocol.

C_REF = 1e18  # [X]: L(C) = E + A (C / 1e18)^-gamma
POWER_PROTOCOLS = ("x", "huber-log")


@dataclass
class PowerLawFit:
    """[X5] L(C) = E + A (C / C0)^-gamma; gamma_se from the fixed-E fit [X7]."""
    E: float
    A: float
    gamma: float
    C0: float = C_REF
    gamma_se: float = float("nan")

    def loss(self, C):
        return self.E + self.A * (np.asarray(C, float) / self.C0) ** (-self.gamma)

    def compute(self, loss):
        """[X5] inverted: the budget reaching `loss` (inf when loss <= E)."""
        excess = np.asarray(loss, float) - self.E
        with np.errstate(divide="ignore", invalid="ignore"):
            C = self.C0 * (excess / self.A) ** (-1 / self.gamma)
            return np.where(excess > 0, C, np.inf)

    def to_dict(self):
        return asdict(self)


def _power_inputs(C, loss, n_coef, name):
    # A law in C needs as many distinct computes as coefficients.
    C, loss = (np.asarray(v, float).ravel() for v in (C, loss))
    _positive(C=C, loss=loss)
    check_points(len(loss), n_coef, name, distinct=len(set(C.tolist())))
    return C, loss


def fit_power_law_x(C, loss, C0=C_REF, n_grid=600, name="power-law fit"):
    """[X]'s free fit of E, A and gamma."""
    # 1. For n_grid values of E in [0, 0.995 min L], the line through
    #    (log C/C0, log(L - E)) if it falls; the best on the loss starts
    # 2. bounded least squares (A, gamma >= 0, 0 <= E < min L), then
    # 3. a Huber pass, f_scale = 1.345 MAD / 0.67449 of 2's residuals.
    C, loss = _power_inputs(C, loss, 3, name)
    u = np.log(C / C0)
    E_grid = np.linspace(0.0, 0.995 * float(loss.min()), n_grid)
    # A row per E; each row's line in closed form.
    y = np.log(loss[None, :] - E_grid[:, None])
    du = u - u.mean()
    slope = (y - y.mean(axis=1, keepdims=True)) @ du / float(du @ du)
    intercept = y.mean(axis=1) - slope * u.mean()
    with np.errstate(over="ignore", invalid="ignore"):
        law = E_grid[:, None] + np.exp(intercept[:, None] + slope[:, None] * u)
        sse = np.sum((law - loss) ** 2, axis=1)
    sse[~(slope < 0) | ~np.isfinite(sse)] = np.inf
    if not np.isfinite(sse).any():
        raise ValueError(f"{name}: loss does not fall with compute for any E of the start grid")
    best = int(np.argmin(sse))
    start = np.array([math.exp(intercept[best]), -slope[best], E_grid[best]])  # (A, gamma, E)
    bounds = ([0.0, 0.0, 0.0], [np.inf, np.inf, np.nextafter(float(loss.min()), 0.0)])
    residuals = lambda p: p[2] + p[0] * np.exp(-p[1] * u) - loss  # noqa: E731
    ordinary = least_squares(residuals, start, bounds=bounds)
    r = ordinary.fun
    # A normal's MAD is 0.67449 standard deviations.
    mad = float(np.median(np.abs(r - np.median(r))))
    f_scale = max(1.345 * mad / 0.67448975, 1e-6)
    huber_fit = least_squares(residuals, ordinary.x, bounds=bounds, loss="huber", f_scale=f_scale)
    A, gamma, E = huber_fit.x
    return PowerLawFit(E=float(E), A=float(A), gamma=float(gamma), C0=C0)


def fit_power_law_huber_log(C, loss, C0=C_REF, delta=HUBER_DELTA, weights=None,
                            name="power-law fit"):

    """E, A and gamma by the surfaces' protocol."""
    C, loss = _power_inputs(C, loss, 3, name)
    weights = np.ones_like(loss) if weights is None else np.asarray(weights, float)
    x, zeros = np.log(C / C0), np.zeros_like(loss)
    # One term in C: b, log K and c stay fixed.
    free = np.array([True, True, True, False, False, False])
    theta, _, _ = fit_core(zeros, x, zeros, loss, weights, delta, free, POWER_GRID, 8, use_K=False)
    return PowerLawFit(E=math.exp(theta[0]), A=math.exp(theta[1]), gamma=float(theta[2]), C0=C0)


def fit_power_law_fixed_E(C, loss, E, C0=C_REF, name="arch"):
    """[X7] log(L - E) = log A - gamma log(C/C0) by least squares, E fixed."""
    C, loss = _power_inputs(C, loss, 2, f"{name} affine fit")
    if np.any(loss <= E):
        msg = f"loss {loss.min():.4g} <= shared E {E:.4g}; fit E per architecture"
        raise ValueError(f"{name}: {msg}")
    line = linregress(np.log(C / C0), np.log(loss - E))
    return PowerLawFit(E=float(E), A=math.exp(line.intercept), gamma=float(-line.slope),
                       C0=C0, gamma_se=float(line.stderr))


def fit_power_laws(runs, ref, C0=C_REF, shared_E=True, protocol="x"):
    """The [X] protocol on runs {arch: (C, loss)} -> {arch: PowerLawFit}."""
    # E from the free fit of `ref` (of each arch without shared_E), then
    # each arch fitted with E fixed [X7].
    free_fit = {"x": fit_power_law_x, "huber-log": fit_power_law_huber_log}[protocol]
    E = {a: free_fit(*runs[a], C0=C0, name=f"{a}: power-law fit").E
         for a in ([ref] if shared_E else runs)}
    return {a: fit_power_law_fixed_E(C, L, E[ref if shared_E else a], C0, a)
            for a, (C, L) in runs.items()}


def compute_multiplier(ref_C, ref_loss, arm_C, arm_loss):
    """[X6] pi = C_ref / C_arm(L_ref) by [X]'s rule, never extrapolated (NaN)."""
    # In order of compute, each pair of points whose loss falls and brackets
    # L_ref gives a compute, log C linear in L; the smallest is C_arm(L_ref).
    ref_C, ref_loss = (np.atleast_1d(np.asarray(v, float)) for v in (ref_C, ref_loss))
    order = np.argsort(arm_C, kind="stable")
    log_c = np.log(np.asarray(arm_C, float)[order])
    L = np.asarray(arm_loss, float)[order]
    out = np.full(len(ref_C), np.nan)
    for i, (c, target) in enumerate(zip(np.log(ref_C), ref_loss)):
        reach = [log_c[j] + (L[j] - target) / (L[j] - L[j + 1]) * (log_c[j + 1] - log_c[j])
                 for j in range(len(L) - 1) if L[j + 1] < L[j] and L[j + 1] <= target <= L[j]]

        if reach:
            out[i] = math.exp(c - min(reach))
    return out


# -----------------------------------------------------------------------------
# Cell bootstrap [S]: resample cells, refit both surfaces warm-started.

def _derived(ref_fit, tgt_fit, C, S):
    # Every bootstrapped quantity of one draw.
    CC, SS = np.meshgrid(C, S, indexing="ij")
    d = {"ce_gain": ce_gain(ref_fit, tgt_fit, CC, SS)}
    for role, f in (("ref", ref_fit), ("target", tgt_fit)):
        d[f"{role}.tpp"] = tpp(f, CC, SS)
        for k in ("E", "A", "a", "b", "K", "c", "gamma"):
            d[f"{role}.{k}"] = np.array(getattr(f, k))
    return d


def _bootstrap_draws(payload, draws):
    # Refit both surfaces for each draw.
    data, n_cells, seed, C, S = payload
    out = []
    for draw in draws:
        # A seed per draw: the same draws however split.
        drawn = np.random.default_rng([seed, draw]).integers(0, n_cells, n_cells)
        n = np.bincount(drawn, minlength=n_cells).astype(float)
        try:
            fits = [fit_surface(F, Sp, D, L, weights=n[cell], init=init, grid=None, centre=centre)
                    for F, Sp, D, L, cell, init, centre in data]
        except ValueError:
            # Too few distinct points left.
            fits = None
        out.append((draw, fits and _derived(*fits, C, S)))
    return out


def cell_bootstrap(runs, ref, target, budgets, sparsities, n_draws=2000, seed=0,
                   n_workers=None, full_fits=None, progress=True, keep_draws=False):
    """[S] the cell bootstrap of CE Gain, TPP and the coefficients."""
    # runs: rows or columns arch, cell, F, S, D, loss. -> {"value", "lo",
    # "hi": {"ce_gain", "ref.gamma", ...}}, lo/hi: 2.5/97.5 percentiles.
    if isinstance(runs, list):
        runs = {k: [r[k] for r in runs] for k in ("arch", "cell", "F", "S", "D", "loss")}
    arch = np.asarray(runs["arch"]).astype(str)
    cell = np.asarray(runs["cell"]).astype(str)
    both = cell[(arch == ref) | (arch == target)]
    cell_id = {c: i for i, c in enumerate(sorted(set(both)))}
    full_fits, data = dict(full_fits or {}), []
    for a in (ref, target):
        m = arch == a
        F, S, D, loss = (np.asarray(runs[k], float)[m] for k in ("F", "S", "D", "loss"))
        # A fixed centre keeps the full fit a valid warm start.
        centre = (np.log1p(-S).mean(), np.log(F).mean(), np.log(D).mean())
        if a not in full_fits:
            full_fits[a] = fit_surface(F, S, D, loss, centre=centre)
        cells = np.array([cell_id[c] for c in cell[m]])
        data.append((F, S, D, loss, cells, full_fits[a], centre))
    C, S = np.asarray(budgets, float), np.asarray(sparsities, float)
    payload = (data, len(cell_id), int(seed), C, S)
    # A process per 50 draws, at most 8.
    n_workers = n_workers or min(os.cpu_count() or 1, 8, max(1, n_draws // 50))
    size = max(1, min(25, n_draws // (4 * n_workers)))
    chunks = [range(i, min(i + size, n_draws)) for i in range(0, n_draws, size)]
    results = {}
    # "spawn" is safe beside torch or OpenMP threads.
    spawn = multiprocessing.get_context("spawn")
    pool = ProcessPoolExecutor(n_workers, mp_context=spawn) if n_workers > 1 else nullcontext()
    bar = tqdm(total=n_draws, desc="cell bootstrap", disable=not progress)
    with pool as pool, bar:
        run = pool.map if pool else map
        for part in run(_bootstrap_draws, itertools.repeat(payload), chunks):
            results.update(part)
            bar.update(len(part))
    point = _derived(full_fits[ref], full_fits[target], C, S)
    good = [results[i] for i in range(n_draws) if results[i] is not None]
    out = {"value": point, "lo": {}, "hi": {}, "n_draws": n_draws,
           "n_failed": n_draws - len(good), "full_fits": full_fits}
    for k in point:
        nan = np.full((1, *np.shape(point[k])), np.nan)
        stack = np.stack([r[k] for r in good]) if good else nan
        out["lo"][k], out["hi"][k] = np.nanpercentile(stack, [2.5, 97.5], axis=0)
        if keep_draws:
            out.setdefault("draws", {})[k] = stack
    return out


# -----------------------------------------------------------------------------
# Quadratic vertices (compute-optimal TPP, growth fraction rho*)

def quadratic_vertex(x, y, log_x=True, log_y=True):
    """The vertex of y' = p0 + p1 x' + p2 x'^2 (by default x' = log x, y' = log y)."""
    # Exact through 3 points, least squares over more. Loss vs TPP at a
    # budget gives the optimal TPP ([X] Stage 2); loss vs rho (log_x=False)
    # the growth fraction rho*.
    xt = np.log(x) if log_x else np.asarray(x, float)
    yt = np.log(y) if log_y else np.asarray(y, float)
    # A parabola opening downwards (or under 3 points) has no minimum.
    p2, p1, p0 = np.polyfit(xt, yt, 2) if len(xt) >= 3 else (np.nan,) * 3
    if not p2 > 0:
        raise ValueError(f"quadratic-vertex fit: no minimum ({len(xt)} points, curvature {p2:.3g})")
    xv = -p1 / (2 * p2)
    yv = p0 + p1 * xv + p2 * xv * xv
    return {"x_opt": float(math.exp(xv) if log_x else xv),
            "y_opt": float(math.exp(yv) if log_y else yv),
            "curvature": float(p2), "coef": [float(p0), float(p1), float(p2)]}


# =============================================================================
# Command line: fit.py surface | chinchilla | power

def json_safe(a):
    """Numbers and arrays for JSON: nested lists, nan and inf as null."""
    return [json_safe(v) for v in a] if np.ndim(a) else float(a) if math.isfinite(a) else None


def _archs(rows, wanted, parser, path):
    # The file's archs, in order; each wanted one must be there.
    archs = list(dict.fromkeys(r["arch"] for r in rows))
    for a in set(wanted) - set(archs):
        parser.error(f"{path}: no arch '{a}' (have {', '.join(archs)})")
    return archs


def run_surface(args, parser):
    # [S2] surfaces of every arch; CE Gain [S5] and TPP.
    rows = read_runs(args.csv, numbers=("F", "S", "D", "loss"), text=("arch", "cell"))
    fits = {}
    for a in _archs(rows, (args.ref, args.target), parser, args.csv):
        try:
            fits[a] = fit_surface(*(_column(rows, k, a) for k in ("F", "S", "D", "loss")))
        except ValueError as e:
            parser.error(f"{args.csv}: arch '{a}': {e}")
    ref, tgt = args.ref, args.target
    pair = {a: fits[a] for a in (ref, tgt)}
    sides = {"value": _derived(pair[ref], pair[tgt], args.budgets, args.sparsity)}
    if args.bootstrap:
        boot = cell_bootstrap(rows, ref, tgt, args.budgets, args.sparsity,
                              args.bootstrap, args.seed, full_fits=pair)
        sides.update(lo=boot["lo"], hi=boot["hi"])
    grid = [(i, C, j, S) for i, C in enumerate(args.budgets) for j, S in enumerate(args.sparsity)]

    # The value, then its 95% interval when bootstrapped.
    def text(key, i, j, digits):
        v, *ci = (f"{d[key][i, j]:.{digits}f}" for d in sides.values())
        return v + (f" [{ci[0]}, {ci[1]}]" if ci else "")
    if args.plot:
        import plots
        plots.plot_surface_frontiers(frontier_curves(pair), args.sparsity, args.plot)
    head = "arch        E          A       a       b          K       c   gamma     rmse"
    lines = [" " * 9 + head]
    lines += [f"{a:>12} {f.E:8.4f} {f.A:10.4g} {f.a:7.4f} {f.b:7.4f} {f.K:10.4g} "
              f"{f.c:7.4f} {f.gamma:7.4f} {f.rmse:8.5f}" for a, f in fits.items()]
    intervals = f" (95% intervals: {args.bootstrap} draws)" * (len(sides) > 1)
    lines.append(f"[S5] CE Gain of {tgt} over {ref}, TPP = D*/(F*/6){intervals}")
    lines += [f"  C={C:.3g} S={S:.3g}: CE Gain {text('ce_gain', i, j, 4)}; "
              f"TPP {ref} {text('ref.tpp', i, j, 1)}, {tgt} {text('target.tpp', i, j, 1)}"
              for i, C, j, S in grid]
    keys = ("ce_gain", "ref.tpp", "target.tpp")  # {key: [budget][sparsity]}
    coefs = {a: {k: json_safe(v) for k, v in f.to_dict().items()} for a, f in fits.items()}
    out = {"fits": coefs, "budgets": args.budgets, "sparsity": args.sparsity}
    for side, d in sides.items():
        out[side] = {k: json_safe(d[k]) for k in keys}
    return out, lines


def run_chinchilla(args, parser):
    # Chinchilla Approach 3 without the --drop-highest highest losses.
    # Epoch AI's file names its columns params and train_flops.
    rename = {"params": "N", "train_flops": "C"}
    key = "D" if "D" in (read_runs(args.csv, rename=rename) or [{}])[0] else "C"
    rows = read_runs(args.csv, numbers=("N", key, "loss"), rename=rename)
    N, X, loss = (_column(rows, k) for k in ("N", key, "loss"))
    keep = np.argsort(loss)[:len(loss) - args.drop_highest]
    D = X if key == "D" else X / (6 * N)  # C = 6 N D
    f = fit_chinchilla(N[keep], D[keep], loss[keep])
    return f.to_dict(), [f"Chinchilla Approach 3 on {len(keep)} points: E={f.E:.4f} "
                         f"A={f.A:.2f} B={f.B:.2f} alpha={f.alpha:.4f} beta={f.beta:.4f} "
                         f"(Huber objective {f.objective:.6g}, rmse {f.rmse:.4f})"]


def run_power(args, parser):
    # The [X] protocol: E shared [X7], multipliers [X6].

    depth = () if args.min_depth is None else ("depth",)
    rows = read_runs(args.csv, numbers=("C", "loss", *depth), text=("arch",),
                     rename={"arm": "arch", "compute_flops": "C", "val_loss": "loss"})
    ref = args.ref
    archs = _archs(rows, [ref], parser, args.csv)
    runs = {a: (_column(rows, "C", a), _column(rows, "loss", a)) for a in archs}
    per_arch, protocol = args.per_arch_E, args.protocol
    fits = fit_power_laws(runs, ref, C0=args.C0, shared_E=not per_arch, protocol=protocol)
    # A loss that does not fall gives gamma <= 0: no law to compare.
    rising = [a for a, f in fits.items() if not f.gamma > 0]

    if rising:
        parser.error(f"{args.csv}: the loss of {', '.join(rising)} does not fall "
                     "with compute: no power law")
    # The multipliers at the reference's budgets (deep enough ones).
    budget = [r for r in rows if r["arch"] == ref and (not depth or r["depth"] >= args.min_depth)]
    ref_C, ref_L = _column(budget, "C"), _column(budget, "loss")
    mult = {a: compute_multiplier(ref_C, ref_L, C, L) for a, (C, L) in runs.items() if a != ref}
    if args.plot:
        import plots
        plots.plot_power_laws(runs, fits, mult, ref, args.plot, budgets=ref_C)
    w = max(len(a) for a in fits)
    how = "per architecture" if args.per_arch_E else f"on {ref}, shared"
    where = f"depth >= {args.min_depth:g}" if depth else "every measured budget"
    lines = [f"[X7] E = {fits[ref].E:.4f} (fitted {how}; protocol {args.protocol}); "
             f"C0 = {args.C0:g}; A, gamma +- its standard error with E fixed:"]
    lines += [f"  {a:>{w}}: E={f.E:.4f} A={f.A:.4f} gamma={f.gamma:.5f} +- {f.gamma_se:.5f}"
              for a, f in fits.items()]
    lines.append(f"[X6] compute multipliers vs {ref} at its budgets ({where}): "
                 "interpolated, never extrapolated (nan = outside the arch's measured range)")
    lines += [f"  {a:>{w}}: " + " ".join(f"{c:.3g}:{v:.3f}" for c, v in zip(ref_C, m))
              for a, m in mult.items()]
    laws = {a: {k: json_safe(v) for k, v in asdict(f).items()} for a, f in fits.items()}
    return {"E": fits[ref].E, "fits": laws, "budgets": ref_C.tolist(),
            "multipliers": {a: json_safe(m) for a, m in mult.items()}}, lines


def floats(text):
    return [float(t) for t in text.split(",")]


def build_parser():
    # A subcommand per law; each CSV help names the columns it reads.
    p = argparse.ArgumentParser(prog="fit.py", usage=argparse.SUPPRESS,
                                description="Scaling-law fits of both papers.")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("surface", prog="fit.py surface", usage=argparse.SUPPRESS,
                       help="[S2] L(F, S, D) = E + A (1-S)^b / F^a + K / D^c, CE Gain [S5], TPP")
    s.add_argument("--ref", required=True, help="reference architecture (column arch)")
    s.add_argument("--target", required=True,
                   help="compared with --ref (CE Gain > 0: it needs less compute)")
    s.add_argument("--budgets", type=floats, default=[1e20, 1e21],
                   help="budgets C = F D, comma-separated")
    s.add_argument("--sparsity", type=floats, default=[0.85, 0.95],
                   help="sparsities S, comma-separated")
    s.add_argument("--bootstrap", type=int, default=0, help="cell-bootstrap draws (paper: 2000)")
    s.add_argument("--seed", type=int, default=0, help="seed of the cell bootstrap")
    c = sub.add_parser("chinchilla", prog="fit.py chinchilla", usage=argparse.SUPPRESS,
                       help="Chinchilla Approach 3: L(N, D) = E + A / N^alpha + B / D^beta")
    c.add_argument("--drop-highest", type=int, default=0,
                   help="drop the K highest-loss points (Epoch AI: 5)")
    w = sub.add_parser("power", prog="fit.py power", usage=argparse.SUPPRESS,
                       help="[X5] L(C) = E + A (C/C0)^-gamma, E shared [X7]; multipliers [X6]")
    w.add_argument("--ref", required=True,
                   help="reference architecture: its E is shared, its budgets used")
    w.add_argument("--protocol", choices=POWER_PROTOCOLS, default="x",
                   help="how E is fitted (x: [X]'s)")
    w.add_argument("--C0", type=float, default=C_REF,
                   help="compute scale C0 (default 1e18; changes A)")
    w.add_argument("--min-depth", type=float,
                   help="multipliers at --ref's points with depth >= this only")
    w.add_argument("--per-arch-E", action="store_true",
                   help="fit E per architecture (sensitivity option)")
    columns = {
        s: "arch, cell, F (FLOPs/token), S (sparsity), D (tokens), loss",
        c: "N, D or C = 6 N D, loss (or params, train_flops, loss)",
        w: "arch, C (FLOPs), loss, optionally depth (or arm, compute_flops, val_loss)",
    }
    for q, cols in columns.items():
        q.add_argument("csv", help=f"the runs CSV, columns {cols}")
        q.add_argument("--json", action="store_true", help="print one JSON object")
    for q in (s, w):
        q.add_argument("--plot", metavar="FILE",
                       help="also draw the fits into FILE (needs matplotlib)")


    return p


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    run = {"surface": run_surface, "chinchilla": run_chinchilla, "power": run_power}[args.cmd]
    try:
        out, lines = run(args, parser)
    except (OSError, ValueError) as e:
        # A missing file, a bad row, data no law fits: one line.

        parser.error(str(e) if args.csv in str(e) else f"{args.csv}: {e}")
    print(json.dumps(out) if args.json else "\n".join(lines))
    return 0


if __name__ == "__main__":
    main()
