"""
The one fitting protocol of fit.py's laws ([S2], Chinchilla Approach 3, [X]'s huber-log): the law
L = E + A e^(b u - a x) + K e^(-c y) (u = log(1-S), x = log F, N or C/C0, y = log D, centred) by summed Huber
(delta 1e-3) on log-loss, L-BFGS-B with analytic gradients on theta = [log E, log A, a, b, log K, c] (`free`
fixes what a law lacks), from the best points of an exponent grid, each scored with its exact nonnegative
(E, A, K) (the law is linear in them: variable projection).
"""
import itertools
import math

import numpy as np
from scipy.optimize import minimize
from threadpoolctl import ThreadpoolController

HUBER_DELTA = 1e-3  # [S2] / Chinchilla: Huber on log-loss with delta = 1e-3

_BLAS = ThreadpoolController()  # tiny matrices: one BLAS thread is fastest (and safe in pool workers)


def huber(r, delta=HUBER_DELTA):
    """Huber loss, elementwise: r^2/2 inside |r| <= delta, delta(|r| - delta/2) outside."""
    clipped = np.clip(r, -delta, delta)  # also dHuber/dr
    return clipped * (r - 0.5 * clipped)


def _log_law(theta, u, x, y):
    """log L-hat and the softmax weights of its three terms (log-sum-exp, stable)."""
    logE, logA, a, b, logK, c = theta
    terms = np.stack(np.broadcast_arrays(logE, logA + b * u - a * x, logK - c * y))
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
    coef = np.log(np.maximum(beta[order], 1e-6 * float(np.min(loss))))  # a zero coefficient starts tiny
    logK = coef[:, 2] if use_K else np.full(len(order), math.log(1e-300))
    return list(np.column_stack([coef[:, 0], coef[:, 1], exp_grid[order, 0], exp_grid[order, 1], logK,
                                 exp_grid[order, 2]]))


BOUNDS = [(-40.0, 40.0), (-200.0, 200.0), (0.0, 10.0), (-10.0, 10.0), (-200.0, 200.0), (0.0, 10.0)]  # theta's


def _lbfgsb(theta0, u, x, y, loss, weights, delta, free, reduce="sum", tol="tight", maxiter=2000):
    """One L-BFGS-B run from theta0 -> (theta, summed objective). reduce "sum" (the protocol) or "mean";
    tol "tight" (the objective / delta, tiny gtol, ftol) or "scipy" (its defaults: the naive protocol,
    which stops early on this flat, small-valued objective)."""
    log_loss = np.log(loss)
    free_idx = np.flatnonzero(free)
    scale = 1.0 if reduce == "sum" else 1.0 / float(np.sum(weights))
    options = dict(maxiter=maxiter, **(dict(gtol=1e-10, ftol=1e-13, maxcor=20) if tol == "tight" else {}))
    scale /= delta if tol == "tight" else 1.0  # a constant factor: same optimum, gradients O(1), not O(delta)
    args = (u, x, y, log_loss, weights, delta, free_idx, np.array(theta0, dtype=float), scale)
    bounds = [BOUNDS[i] for i in free_idx]
    res = minimize(_objective, np.asarray(theta0, dtype=float)[free_idx], args=args, jac=True,
                   method="L-BFGS-B", bounds=bounds, options=options)
    theta = np.array(theta0, dtype=float)
    theta[free_idx] = res.x
    value = float(np.sum(weights * huber(_log_law(theta, u, x, y)[0] - log_loss, delta)))
    return theta, value


def fit_core(u, x, y, loss, weights, delta, free, exp_grid, n_keep, inits=(), reduce="sum", use_K=True,
             tol="tight"):
    """Best of L-BFGS-B runs from the n_keep best grid points (variable projection) plus `inits`."""
    with _BLAS.limit(limits=1, user_api="blas"):
        starts = list(inits)
        if exp_grid is not None and len(exp_grid):
            starts += _varpro_starts(u, x, y, loss, weights, exp_grid, delta, n_keep, use_K)
        best = (None, np.inf)
        for theta0 in starts:
            theta, value = _lbfgsb(theta0, u, x, y, loss, weights, delta, free, reduce, tol)
            if value < best[1]:
                best = (theta, value)
    return best[0], best[1], len(starts)


def exponent_grid(a_values, b_values, c_values):
    """Every exponent triple (a, b, c) of the three value lists: the starting grid of fit_core."""
    return np.array(list(itertools.product(a_values, b_values, c_values)), dtype=float)
