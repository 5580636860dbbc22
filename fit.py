"""
Scaling-law fits for both papers: SMELT surfaces [S2]-[S5], Chinchilla Approach 3, the [X] power-law
protocol and compute multipliers [X4]-[X7], the cell bootstrap and quadratic-vertex fits (numpy, scipy,
threadpoolctl).

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
SUBCOMMAND --help` says what every flag means. This file holds the fits and, at its bottom, a short main();
the parser, reading the runs CSV files and printing are tooling/fit_cli.py, the figures tooling/plots.py
(matplotlib optional).

Every law is fitted the same way, summed Huber (delta 1e-3) on log-loss with L-BFGS-B from the best points
of a variable-projection grid of exponents: huber_fit.py, which says how that makes the fits reliable. Logs
of F, D, N and 1-S are centred on the data before fitting (A and a decorrelate), a reparametrisation, not a
different model: reported coefficients are in the usual uncentred form.
"""
import math
import multiprocessing
import os
import sys
import warnings
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass

import numpy as np
from scipy.optimize import least_squares
from scipy.stats import linregress

from huber_fit import HUBER_DELTA, exponent_grid, fit_core
from tooling import fit_cli, jobs, plots
from tooling.common import cli_error

HOFFMANN_INIT = dict(E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28)  # Hoffmann et al. 2022 published fit

# the starting grids of exponents (a, b, c) of each law (huber_fit.fit_core keeps the best few)
SURFACE_GRID = exponent_grid(np.geomspace(0.05, 2.0, 20), np.linspace(-0.5, 3.0, 15), np.geomspace(0.05, 2.0, 20))
CHINCHILLA_GRID = exponent_grid(np.geomspace(0.02, 2.5, 40), [0.0], np.geomspace(0.02, 2.5, 40))
POWER_GRID = exponent_grid(np.geomspace(0.005, 3.0, 400), [0.0], [0.0])


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
            bad = int(np.argmax(~(v > 0) | ~np.isfinite(v)))
            raise ValueError(f"{name} must be finite and > 0 (first bad index {bad})")
    if np.any(~np.isfinite(S)) or np.any(S < 0) or np.any(S >= 1):
        raise ValueError("S must lie in [0, 1)")
    weights = np.ones_like(loss) if weights is None else np.asarray(weights, dtype=float).ravel()
    return F, S, D, loss, weights


def fit_surface(F, S, D, loss, weights=None, init=None, grid=SURFACE_GRID, n_keep=8, delta=HUBER_DELTA,
                centre=None, fixed_exponents=None):
    """Fit the SMELT surface [S2] by summed Huber(delta) on log-loss with L-BFGS-B.

    init: a SurfaceFit to warm-start from (bootstrap refits pass grid=None to use it alone).
    fixed_exponents: (a, b, c) to keep fixed and refit only (E, A, K) [S section 5.2]; a None in it stays free
    ((a, None, None): a profile in a).
    Returns a SurfaceFit (E, A, a, b, K, c, rmse in nats, objective, n_points)."""
    F, S, D, loss, weights = _surface_inputs(F, S, D, loss, weights)
    n_used = int(np.count_nonzero(weights))
    held = np.array([v is not None for v in fixed_exponents or (None,) * 3])
    _check_points(n_used, 6 - int(held.sum()), "SMELT surface")
    u, x, y = np.log1p(-S), np.log(F), np.log(D)
    if centre is None:
        centre = _Centre(float(np.mean(u)), float(np.mean(x)), float(np.mean(y)))
    u, x, y = u - centre.u0, x - centre.x0, y - centre.y0
    free = np.ones(6, dtype=bool)
    inits = [] if init is None else [_surface_theta(init, centre)]
    if held.any():  # the held exponents at their values in every starting point, the others from the grid
        free[np.array([2, 3, 5])[held]] = False
        grid = np.unique(np.where(held, [0.0 if v is None else v for v in fixed_exponents], grid), axis=0)
    theta, value, _ = fit_core(u, x, y, loss, weights, delta, free, grid, n_keep, inits)
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
        N, D = np.asarray(N, dtype=float), np.asarray(D, dtype=float)
        return self.E + self.A / N ** self.alpha + self.B / D ** self.beta

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
    theta, value, _ = fit_core(u, x, y, loss, np.ones_like(loss), delta, free, grid, n_keep, starts, reduce, tol=tol)
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
    theta, _, _ = fit_core(zeros, x, zeros, loss, weights, delta, free, POWER_GRID, 8, use_K=False)
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
# Quadratic-vertex fits (compute-optimal TPP from log loss vs log TPP; growth fraction rho*)


def quadratic_vertex(x, y, log_x=True, log_y=True):
    """Fit y' = p0 + p1 x' + p2 x'^2 (x' = log x, y' = log y by default; through 3 points exactly, least
    squares over more) and return the vertex {"x_opt", "y_opt", "curvature", "coef"}. Raises when the
    parabola opens downwards."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if len(x) < 3:
        raise ValueError(f"quadratic-vertex fit: {len(x)} points is too few for a parabola (need at least 3)")
    xt = np.log(x) if log_x else x
    yt = np.log(y) if log_y else y
    p2, p1, p0 = np.polyfit(xt, yt, 2)
    if p2 <= 0:
        raise ValueError(f"quadratic-vertex fit: curvature {p2:.3g} <= 0, no minimum inside the data")
    xv = -p1 / (2 * p2)
    yv = p0 + p1 * xv + p2 * xv * xv
    return {"x_opt": float(math.exp(xv) if log_x else xv), "y_opt": float(math.exp(yv) if log_y else yv),
            "curvature": float(p2), "coef": [float(p0), float(p1), float(p2)]}


def ols(X, y):
    """Ordinary least squares y ~ X coef -> (coef, standard errors), None when X has not full column rank."""
    X, y = np.asarray(X, dtype=float), np.asarray(y, dtype=float)
    coef, _, rank, _ = np.linalg.lstsq(X, y, rcond=None)
    if rank < X.shape[1]:
        return None
    dof = len(y) - X.shape[1]
    resid = y - X @ coef
    s2 = float(resid @ resid) / dof if dof > 0 else float("nan")
    return coef, np.sqrt(np.diag(s2 * np.linalg.inv(X.T @ X)))


def wd_regression(cells):
    """[X] the best weight decay's scaling: log WD* = a + b log N_s + c log executed layers over (N_s,
    executed, WD*) cells -> (b, c, their standard errors); None when the cells cannot separate the two
    (fewer than 4, or collinear)."""
    if len(cells) < 4:
        return None
    fitted = ols([[1.0, np.log(n), np.log(e)] for n, e, _ in cells], np.log([w for *_, w in cells]))
    if fitted is None:
        return None
    coef, se = fitted
    return float(coef[1]), float(coef[2]), float(se[1]), float(se[2])


def best_measured_tpp(tpp_values, loss):
    """The TPP at the vertex of log loss vs log TPP over runs measured at one budget ([X] Stage 2); not
    grow.optimal_tpp, the [X12] law."""
    return quadratic_vertex(tpp_values, loss)["x_opt"]


def best_measured_growth_fraction(rho, loss):
    """rho* of a growth sweep: the vertex of log loss vs rho (linear in rho) over the measured runs ([X] growth
    sweeps); not grow.optimal_growth_fraction, the [X15] closed form."""
    return quadratic_vertex(rho, loss, log_x=False)["x_opt"]


# =============================================================================
# Command line: fit.py surface | chinchilla | power. Everything above is the fits and needs nothing below;
# here each subcommand reads its runs CSV, fits it and prints the result: the parser, the reading and the
# printing are tooling/fit_cli.py, the figures (--plot) tooling/plots.py.


def run_surface(args):
    """[S2] surfaces of every architecture; CE Gain [S5] of --target over --ref and TPP on the budget grid."""
    runs, points = fit_cli.read_surface(args.csv, args.ref, args.target)
    fits = {}
    for a, (F, S, D, loss) in points.items():
        with fit_cli.naming(args.csv, f"arch '{a}'"):
            fits[a] = fit_surface(F, S, D, loss)
    pair = {a: fits[a] for a in (args.ref, args.target)}
    boot = None
    if args.bootstrap:
        with fit_cli.naming(args.csv):
            boot = cell_bootstrap(runs, args.ref, args.target, args.budgets, args.sparsity, n_draws=args.bootstrap,
                                  seed=args.seed, full_fits=pair)
    grid = np.meshgrid(args.budgets, args.sparsity, indexing="ij")
    gain = ce_gain(fits[args.ref], fits[args.target], *grid)
    fit_cli.print_surface(args, fits, gain, {a: tpp(f, *grid) for a, f in pair.items()}, boot)
    if args.plot:
        plots.plot_surface_frontiers(frontier_curves(pair), args.sparsity, args.plot)


def run_chinchilla(args):
    """Chinchilla Approach 3 on every point but the --drop-highest highest losses."""
    N, D, loss = fit_cli.read_chinchilla(args.csv, args.drop_highest)
    with fit_cli.naming(args.csv):
        fit = fit_chinchilla(N, D, loss)
    fit_cli.print_chinchilla(args, fit, len(loss))


def run_power(args):
    """The [X] protocol: shared E [X7], (A, gamma) per architecture, multipliers [X6] at --ref's budgets."""
    rows, runs = fit_cli.read_power(args.csv, args.ref)
    with fit_cli.naming(args.csv):
        fits = fit_power_laws(runs, args.ref, C0=args.C0, shared_E=not args.per_arch_E, protocol=args.protocol)
    fit_cli.refuse_rising(args.csv, fits)
    ref_C, ref_L = fit_cli.reference_budgets(args.csv, rows, args.ref, args.min_depth)
    mult = {a: compute_multiplier(ref_C, ref_L, C, loss) for a, (C, loss) in runs.items()}
    fit_cli.print_power(args, fits, ref_C, mult)
    if args.plot:
        plots.plot_power_laws(runs, fits, mult, args.ref, args.plot, budgets=ref_C)


def main(argv=None):
    """Exit status 0, or 2 for a mistake in the data (one line on stderr). A bad command line is one line
    `fit.py SUBCOMMAND: error: ...` too, and SystemExit(2) (tooling.common.CliParser)."""
    args = fit_cli.build_parser(__doc__.split("\n\n")[0], POWER_PROTOCOLS, C_REF).parse_args(argv)
    try:
        {"surface": run_surface, "chinchilla": run_chinchilla, "power": run_power}[args.cmd](args)
    except (OSError, ValueError) as e:  # missing file, malformed CSV (file, line, column), data that cannot be fitted
        return cli_error("fit.py", e)
    except KeyboardInterrupt:  # Ctrl-C (a long --bootstrap): one line, the shell's status for SIGINT
        print("fit.py: interrupted (a fit keeps nothing partial: rerun the same command)", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
