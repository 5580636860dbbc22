"""
Downstream scores from losses, the two papers' ways (numpy, scipy):

- [S6]-[S7] calibration: a four-parameter monotone sigmoid from validation loss to a downstream score,
  fitted on the reference architecture's run endpoints; the target architecture's residuals against it
  say whether it scores better than the reference at equal validation loss.
- [X19]-[X21] prediction: compute -> each task's answer NLL (a power law per architecture and task [X19]),
  NLL -> centred accuracy (a sigmoid per task, shared by the compared architectures [X20]), the mean over
  the predicted tasks -> full CORE (one no-intercept factor r [X21]); then the CORE an architecture is
  predicted to reach at a budget, and the budget at which it reaches a CORE.

    python downstream.py calibrate RUNS.csv --ref vanilla --target loop-2 [--rises] [--json]
    python downstream.py predict TASKS.csv [--budgets 1e20,1e21] [--core 0.2,0.3] [--ref vanilla] [--json]

CSV columns: calibrate `arch,loss,score`, one row per run endpoint; predict `arch,C,task,nll,centered,core`,
one row per checkpoint and task (C its training FLOPs, nll the task's answer NLL [X18], centered its
centred accuracy [X17], core the checkpoint's full CORE, the same on each of its rows: eval_core.py's
report has all three). The tasks of the file are the predicted ones ([X] predicts the 17 of CORE-17).
Other columns are ignored. A mistake (a missing column, a bad number, a checkpoint given twice or with
tasks missing, too few points to fit) is one line naming the file (and line), exit status 2.
"""
import json
import math
import sys
from dataclasses import asdict, dataclass

import numpy as np
from scipy.optimize import brentq, least_squares
from scipy.special import expit

from fit import C_REF, fit_power_law_huber_log
from tooling import common, fit_cli, tables

PROG = "downstream.py"


def _check_points(n, n_coef, what):
    if n < n_coef + 1:
        raise ValueError(f"{what}: {n} points is too few to fit {n_coef} coefficients (need at least {n_coef + 1})")


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
    (fit.fit_power_law_huber_log). Returns a PowerLawFit (its `gamma` is the paper's alpha)."""
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
    f = lambda lc: float(predict_core(math.exp(lc), task_laws, task_sigmoids, r)) - target_core  # noqa: E731
    lo, hi = math.log(C_range[0]), math.log(C_range[1])
    if f(lo) * f(hi) > 0:
        return float("nan")
    return math.exp(brentq(f, lo, hi, xtol=1e-10))


# =============================================================================
# Command line: downstream.py calibrate | predict (reading: tooling/tables.py; one-line errors)


def run_calibrate(args):
    """[S6] on --ref's endpoints, [S7] residuals of --target's: printed, or one JSON object."""
    runs = tables.read_runs_csv(args.csv, ["arch", "loss", "score"], positive=["loss"], numeric=["score"])
    arch = runs["arch"].astype(str)
    tables.refuse_case_variants(args.csv, arch.tolist(), "arch")
    _require(args.csv, list(dict.fromkeys(arch.tolist())), [args.ref, args.target])
    ref, tgt = arch == args.ref, arch == args.target
    with fit_cli.naming(args.csv, f"arch '{args.ref}'"):
        cal = fit_calibration(runs["loss"][ref], runs["score"][ref], direction=+1 if args.rises else -1)
    delta = calibration_residuals(cal, runs["loss"][tgt], runs["score"][tgt], sign=-1 if args.rises else +1)
    lo, hi = float(runs["loss"][ref].min()), float(runs["loss"][ref].max())
    lines = np.asarray(tables.data_lines(args.csv))[tgt]
    out = {"calibration": asdict(cal), "n_ref": int(ref.sum()), "ref_loss_range": [lo, hi],
           "residuals": [{"line": int(n), "loss": float(x), "score": float(y), "delta": float(d),
                          "inside": bool(lo <= x <= hi)}
                         for n, x, y, d in zip(lines, runs["loss"][tgt], runs["score"][tgt], delta)],
           "mean_delta": float(np.mean(delta))}
    if args.json:
        print(json.dumps(out))
        return
    print(f"[S6] {args.ref} ({out['n_ref']} endpoints): score = {cal.b:.4f} + {cal.a:.4f} / (1 + exp("
          f"{'' if cal.d < 0 else '-'}{cal.alpha:.4f} (loss - {cal.tau:.4f}))), R^2 = {cal.r2:.4f}")
    print(f"[S7] {args.target} residuals (> 0: better than {args.ref} at equal loss):")
    for r in out["residuals"]:
        note = "" if r["inside"] else f"  (outside {args.ref}'s loss range [{lo:.4g}, {hi:.4g}])"
        print(f"  line {r['line']}: loss {r['loss']:.4f} score {r['score']:.4f} delta {r['delta']:+.4f}{note}")
    print(f"  mean delta {out['mean_delta']:+.4f}")


def _require(path, archs, names):
    for name in names:
        if name not in archs:
            raise ValueError(f"{path}: architecture '{name}' not found in column 'arch'; have {archs}")


TASK_COLUMNS = ["arch", "C", "task", "nll", "centered", "core"]


def read_tasks(path):
    """({(arch, C): {"core", "line", "tasks": {task: (nll, centered)}}}, sorted tasks); a task twice, two CORE
    values or a task missing for one checkpoint is refused, naming the lines."""
    rows = tables.read_runs_csv(path, TASK_COLUMNS, positive=["C", "nll"], numeric=["centered", "core"])
    for column in ("arch", "task"):
        tables.refuse_case_variants(path, rows[column].astype(str).tolist(), column)
    points, first = {}, {}
    for line, a, C, t, nll, cen, core in zip(tables.data_lines(path), *(rows[k] for k in TASK_COLUMNS)):
        key, here = (str(a), float(C)), f"checkpoint ({a}, C={C:g})"
        p = points.setdefault(key, {"core": float(core), "tasks": {}, "line": line})
        if (key, t) in first:
            raise ValueError(f"{path} line {line}: task '{t}' of {here} again (line {first[key, t]})")
        if core != p["core"]:
            raise ValueError(f"{path} line {line}, column 'core': {core:g}, but line {p['line']} gives "
                             f"{p['core']:g} for {here}: one full CORE per checkpoint")
        first[key, t] = line
        p["tasks"][str(t)] = (float(nll), float(cen))
    tasks = sorted({t for p in points.values() for t in p["tasks"]})
    for (a, C), p in points.items():
        if len(p["tasks"]) < len(tasks):
            raise ValueError(f"{path} line {p['line']}: checkpoint ({a}, C={C:g}) lacks task(s) "
                             f"{sorted(set(tasks) - set(p['tasks']))}: every checkpoint needs every predicted task")
    return points, tasks


def fit_pipeline(path, points, tasks):
    """[X19] a law per arch and task, [X20] a sigmoid per task over every checkpoint, [X21] r. Returns
    ({arch: (laws in task order, sigmoids in task order)}, r, rmse of r x filtered mean against full CORE)."""
    archs = list(dict.fromkeys(a for a, _ in points))
    sigmoids = []
    for t in tasks:
        with fit_cli.naming(path, f"task '{t}'"):
            sigmoids.append(fit_task_sigmoid(*zip(*(p["tasks"][t] for p in points.values()))))  # [X20]
    per_arch = {}
    for a in archs:
        computes = sorted(C for b, C in points if b == a)
        laws = []
        for t in tasks:
            with fit_cli.naming(path, f"arch '{a}', task '{t}'"):
                laws.append(fit_task_nll(computes, [points[a, C]["tasks"][t][0] for C in computes]))  # [X19]
        per_arch[a] = (laws, sigmoids)
    filtered = np.array([np.mean([p["tasks"][t][1] for t in tasks]) for p in points.values()])
    full = np.array([p["core"] for p in points.values()])
    r = fit_core_scale(filtered, full)  # [X21]
    return per_arch, r, float(np.sqrt(np.mean((r * filtered - full) ** 2)))


def run_predict(args):
    """The fitted pipeline; the CORE each arch reaches at --budgets and the compute it needs for --core."""
    points, tasks = read_tasks(args.csv)
    archs = list(dict.fromkeys(a for a, _ in points))
    _require(args.csv, archs, [args.ref] if args.ref else [])
    per_arch, r, rmse = fit_pipeline(args.csv, points, tasks)
    compute = {a: [compute_for_core(v, *per_arch[a], r) for v in args.core] for a in archs}
    out = {"tasks": tasks, "r": r, "r_rmse": rmse,
           "sigmoids": {t: {"s": s, "b": b} for t, (s, b) in zip(tasks, per_arch[archs[0]][1])},
           "laws": {a: {t: {"E": f.E, "A": f.A, "alpha": f.gamma} for t, f in zip(tasks, per_arch[a][0])}
                    for a in archs},
           "core": {a: [{"C": C, "value": float(predict_core(C, *per_arch[a], r))} for C in args.budgets]
                    for a in archs},
           "compute": {a: [{"core": v, "C": fit_cli.json_safe(C),
                            "multiplier": fit_cli.json_safe(compute[args.ref][i] / C) if args.ref else None}
                           for i, (v, C) in enumerate(zip(args.core, compute[a]))] for a in archs}}
    if args.json:
        print(json.dumps(out))
        return
    print(f"[X21] CORE = r x mean over {len(tasks)} tasks of [X20] c(B) = 1 / (1 + exp(s B - b)) at [X19] B(C) = "
          f"E + A (C/1e18)^-alpha")
    print(f"  r = {r:.5f} (rmse {rmse:.4f} on {len(points)} checkpoints)")
    for t in tasks:
        sig = out["sigmoids"][t]
        print(f"  {t}: s={sig['s']:.4f} b={sig['b']:.4f}; " + "; ".join(
            f"{a} E={law['E']:.4f} A={law['A']:.4f} alpha={law['alpha']:.4f}"
            for a, law in ((a, out["laws"][a][t]) for a in archs)))
    for a in archs:
        if args.budgets:
            print(f"  {a}: CORE at " + " ".join(f"{c['C']:.3g}:{c['value']:.4f}" for c in out["core"][a]))
        if args.core:
            print(f"  {a}: compute for CORE " + " ".join(
                f"{c['core']:g}:" + (f"{c['C']:.3g}" if c["C"] else "nan")
                + (f" (x{c['multiplier']:.3f} vs {args.ref})" if c["multiplier"] else "") for c in out["compute"][a]))


def build_parser():
    p = common.parser(PROG, description="Downstream scores from losses: [S6]-[S7] calibration, [X19]-[X21] "
                                        "prediction (python downstream.py NAME --help: its flags and columns)")
    sub = p.add_subparsers(dest="cmd", required=True, help="calibrate ([S6]-[S7]) or predict ([X19]-[X21])")
    c = sub.add_parser("calibrate", allow_abbrev=False, help="[S6] sigmoid on --ref's endpoints, [S7] --target's "
                       "residuals", description="Input: a CSV with columns arch, loss (validation loss, > 0) and "
                       "score, one row per run endpoint; other columns are ignored.")
    c.add_argument("csv", help="the endpoints CSV (columns arch, loss, score)")
    c.add_argument("--ref", required=True, help="reference architecture (column arch): the sigmoid is fitted on it")
    c.add_argument("--target", required=True, help="architecture whose residuals are reported (column arch)")
    c.add_argument("--rises", action="store_true", help="the score rises with loss and lower is better (an NLL); "
                                                        "default: it falls and higher is better (an accuracy)")
    c.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    q = sub.add_parser("predict", allow_abbrev=False, help="[X19]-[X21] CORE from compute, per architecture",
                       description="Input: a CSV with columns arch, C (training FLOPs, > 0), task, nll (> 0), "
                       "centered and core, one row per checkpoint and task; other columns are ignored.")
    q.add_argument("csv", help="the tasks CSV (columns arch, C, task, nll, centered, core)")
    q.add_argument("--budgets", type=fit_cli.budgets, default=[], metavar="C,C,...",
                   help="comma-separated budgets in FLOPs at which the predicted CORE is printed (default: none)")
    q.add_argument("--core", type=lambda text: fit_cli.numbers(text, lambda v: v < 1, "< 1"), default=[],
                   metavar="V,V,...", help="comma-separated CORE values whose compute is printed (default: none)")
    q.add_argument("--ref", help="architecture whose compute for each --core the others are compared with, "
                                 "C_ref / C_arch (default: none)")
    q.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    return p


def main(argv=None):
    """Exit status 0, or 2 with one line on stderr for a mistake in the command line or the data."""
    args = build_parser().parse_args(argv)
    try:
        {"calibrate": run_calibrate, "predict": run_predict}[args.cmd](args)
    except (OSError, ValueError) as e:
        return common.cli_error(PROG, e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
