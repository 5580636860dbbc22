"""
Downstream scores from losses. [S6]-[S7]: a sigmoid from validation loss to a
score, fitted on the reference's endpoints; the target's residuals say if it
scores better at equal loss. [X19]-[X21]: CORE from compute, through a power
law per task (NLL), a sigmoid per task (accuracy) and a factor r (full CORE).

    python downstream.py calibrate RUNS.csv --ref vanilla --target loop-2 [--rises]
    python downstream.py predict TASKS.csv [--budgets 1e20,1e21] [--core 0.2,0.3]

A row: a run's endpoint (calibrate); a checkpoint's task, every task once per checkpoint,
nll and centered from eval_core.py (predict). [X] uses CORE-17's tasks and reports r = 0.869.
"""
import argparse
import json
import math
from dataclasses import asdict, dataclass

import numpy as np
from scipy.optimize import brentq, least_squares
from scipy.special import expit

from fit import C_REF, check_points, json_safe, fit_power_law_huber_log, floats, read_runs


# -----------------------------------------------------------------------------
# Downstream calibration [S6]-[S7]

@dataclass
class SigmoidCalibration:
    """[S6] y(l) = b + a / (1 + exp(-d alpha (l - tau))), a, alpha > 0."""
    b: float
    a: float
    alpha: float
    tau: float
    # +1 when the score rises with validation loss, -1 when it falls.
    d: int
    r2: float = float("nan")

    def predict(self, loss):
        return self.b + self.a * expit(self.d * self.alpha * (np.asarray(loss, float) - self.tau))


def fit_calibration(ref_loss, ref_score, direction=-1, name="sigmoid calibration"):
    """[S6] the sigmoid, by least squares on the reference's endpoints."""
    loss, score = np.asarray(ref_loss, float), np.asarray(ref_score, float)
    check_points(len(loss), 4, name)

    # a and alpha are fitted as logs, so they stay positive.
    def residual(p):
        b, log_a, log_alpha, tau = p
        return b + np.exp(log_a) * expit(direction * np.exp(log_alpha) * (loss - tau)) - score

    # Starts spread over tau and the slope: least squares
    # alone finds only a nearby minimum.
    span, width = max(float(np.ptp(score)), 1e-6), max(float(np.ptp(loss)), 1e-6)
    starts = [[score.min() - 0.1 * span, math.log(1.2 * span), math.log(k / width), tau]
              for tau in np.quantile(loss, [0.1, 0.3, 0.5, 0.7, 0.9])
              for k in (0.5, 2.0, 8.0)]
    fits = (least_squares(residual, p, method="lm", max_nfev=4000) for p in starts)
    best = min(fits, key=lambda r: r.cost)
    b, log_a, log_alpha, tau = best.x
    ss_tot = float(np.sum((score - score.mean()) ** 2))
    r2 = 1 - float(np.sum(best.fun ** 2)) / ss_tot if ss_tot > 0 else float("nan")
    return SigmoidCalibration(b=b, a=math.exp(log_a), alpha=math.exp(log_alpha), tau=tau,
                              d=direction, r2=r2)


def calibration_residuals(calibration, tgt_loss, tgt_score, sign=+1):
    """[S7] delta_i = s (y_i - y_hat(l_i)): > 0 where the target beats the ref."""
    # s = +1 for higher-is-better scores, -1 otherwise.
    return sign * (np.asarray(tgt_score, float) - calibration.predict(tgt_loss))


# -----------------------------------------------------------------------------
# Downstream prediction [X19]-[X21]

def fit_task_nll(C, task_nll, C0=C_REF, name="power-law fit"):
    """[X19] B(C) = E + A (C/1e18)^-alpha: a fit.PowerLawFit, gamma = alpha."""
    # The surfaces' protocol: Huber on log-loss.
    return fit_power_law_huber_log(C, task_nll, C0=C0, name=name)


def fit_task_sigmoid(task_nll, centred_accuracy, name="task sigmoid"):
    """[X20] c_hat(B) = 1 / (1 + exp(s B - b)), shared by the archs -> (s, b)."""
    B, acc = np.asarray(task_nll, float), np.asarray(centred_accuracy, float)
    check_points(len(B), 2, name)
    # Start from slope 1, centred on the mean NLL.
    start = [1.0, float(np.mean(B))]
    res = least_squares(lambda p: expit(p[1] - p[0] * B) - acc, start, method="lm")
    return float(res.x[0]), float(res.x[1])


def fit_core_scale(filtered_mean, full_core):
    """[X21] the no-intercept factor r from the tasks' mean to full CORE."""
    x, y = np.asarray(filtered_mean, float), np.asarray(full_core, float)
    # Least squares through the origin.
    return float(np.dot(x, y) / np.dot(x, x))


def predict_core(C, task_laws, task_sigmoids, r):
    """[X21] CORE_hat(C) = r / T sum_t c_hat_t(B_t(C)) over the T tasks."""
    pairs = zip(task_laws, task_sigmoids)
    return r * np.mean([expit(b - s * law.loss(C)) for law, (s, b) in pairs], axis=0)


def compute_for_core(target_core, task_laws, task_sigmoids, r, C_range=(1e15, 1e27)):
    """The budget at which the pipeline predicts `target_core`; nan outside C_range."""
    # The root is sought in log C.
    def f(lc):
        return float(predict_core(math.exp(lc), task_laws, task_sigmoids, r)) - target_core
    lo, hi = math.log(C_range[0]), math.log(C_range[1])
    # No sign change: the CORE is not reached within C_range.
    return math.exp(brentq(f, lo, hi, xtol=1e-10)) if f(lo) * f(hi) <= 0 else float("nan")


def read_tasks(path):
    """{(arch, C): {"core", "tasks": {task: (nll, centered)}}}, and the tasks."""
    points = {}
    # Each row repeats its checkpoint's CORE: a set checks they agree.
    for r in read_runs(path, numbers=("C", "nll", "centered", "core"), text=("arch", "task")):
        p = points.setdefault((r["arch"], float(r["C"])), {"core": set(), "tasks": {}, "rows": 0})
        p["core"].add(r["core"])
        p["rows"] += 1
        p["tasks"][r["task"]] = (r["nll"], r["centered"])
    tasks = sorted({t for p in points.values() for t in p["tasks"]})
    # A checkpoint needs a row per task and one CORE.
    for (a, C), p in points.items():
        if p["rows"] != len(tasks) or len(p["tasks"]) != len(tasks) or len(p["core"]) != 1:
            raise ValueError(f"{path}: checkpoint ({a}, C={C:g}) needs each task "
                             f"({', '.join(tasks)}) once and one core; it has "
                             f"{p['rows']} rows, tasks {sorted(p['tasks'])}")
        p["core"] = p["core"].pop()
    return points, tasks


def fit_pipeline(points, tasks):
    """[X19]-[X21] -> ({arch: (laws, sigmoids)}, r, rmse of r x mean vs CORE)."""
    # [X20] a sigmoid per task, over every checkpoint.
    sigmoids = [fit_task_sigmoid(*zip(*(p["tasks"][t] for p in points.values())),
                                 name=f"task '{t}' sigmoid") for t in tasks]
    per_arch = {}
    for a in dict.fromkeys(a for a, _ in points):
        C = sorted(c for b, c in points if b == a)
        # [X19] a law per arch and task.
        nll = {t: [points[a, c]["tasks"][t][0] for c in C] for t in tasks}
        laws = [fit_task_nll(C, nll[t], name=f"arch '{a}', task '{t}'") for t in tasks]
        per_arch[a] = laws, sigmoids
    # [X21] r from each checkpoint's mean accuracy to its full CORE.
    mean = np.array([np.mean([p["tasks"][t][1] for t in tasks]) for p in points.values()])
    full = np.array([p["core"] for p in points.values()])
    r = fit_core_scale(mean, full)
    return per_arch, r, float(np.sqrt(np.mean((r * mean - full) ** 2)))


# =============================================================================
# Command line: downstream.py calibrate | predict

def run_calibrate(args, parser):
    # [S6] on --ref's endpoints, [S7] residuals of --target's.
    rows = read_runs(args.csv, numbers=("loss", "score"), text=("arch",))
    ref, tgt = ([r for r in rows if r["arch"] == a] for a in (args.ref, args.target))
    if not ref or not tgt:
        parser.error(f"{args.csv}: no rows of arch '{args.ref if not ref else args.target}'")
    cal = fit_calibration([r["loss"] for r in ref], [r["score"] for r in ref],
                          +1 if args.rises else -1,
                          name=f"arch '{args.ref}': sigmoid calibration")
    loss, score = [r["loss"] for r in tgt], [r["score"] for r in tgt]
    # A score rising with loss is better when lower: residuals flip.
    delta = calibration_residuals(cal, loss, score, -1 if args.rises else 1)
    # A target beyond the ref's losses extrapolates the sigmoid.
    lo, hi = min(r["loss"] for r in ref), max(r["loss"] for r in ref)
    residuals = [dict(loss=r["loss"], score=r["score"], delta=d, inside=lo <= r["loss"] <= hi)
                 for r, d in zip(tgt, delta.tolist())]
    out = {"calibration": asdict(cal), "n_ref": len(ref), "ref_loss_range": [lo, hi],
           "mean_delta": delta.mean(), "residuals": residuals}
    sign = "" if cal.d < 0 else "-"
    lines = [f"[S6] {args.ref} ({len(ref)} endpoints): score = {cal.b:.4f} + {cal.a:.4f} "
             f"/ (1 + exp({sign}{cal.alpha:.4f} (loss - {cal.tau:.4f}))), R^2 = {cal.r2:.4f}",
             f"[S7] {args.target} residuals (> 0: better than {args.ref} at equal loss):"]
    outside = f"  (outside {args.ref}'s loss range [{lo:.4g}, {hi:.4g}])"
    lines += [f"  loss {r['loss']:.4f} score {r['score']:.4f} delta {r['delta']:+.4f}"
              + ("" if r["inside"] else outside) for r in residuals]
    return out, lines + [f"  mean delta {out['mean_delta']:+.4f}"]


def run_predict(args, parser):
    # The fitted pipeline: each arch's CORE at --budgets, compute for each --core.
    points, tasks = read_tasks(args.csv)
    archs = list(dict.fromkeys(a for a, _ in points))
    ref = args.ref
    if ref and ref not in archs:
        parser.error(f"{args.csv}: no arch '{ref}' (have {', '.join(archs)})")
    per_arch, r, rmse = fit_pipeline(points, tasks)
    compute = {a: [compute_for_core(v, *per_arch[a], r) for v in args.core] for a in archs}
    # The archs share the sigmoids: any arch's copy will do.
    sigmoids = {t: {"s": s, "b": b} for t, (s, b) in zip(tasks, per_arch[archs[0]][1])}

    laws = {a: {t: dict(E=f.E, A=f.A, alpha=f.gamma) for t, f in zip(tasks, per_arch[a][0])}
            for a in archs}
    core = {a: [float(predict_core(C, *per_arch[a], r)) for C in args.budgets] for a in archs}
    multiplier = ref and {a: json_safe(np.divide(compute[ref], compute[a])) for a in archs}
    out = {"tasks": tasks, "r": r, "r_rmse": rmse, "sigmoids": sigmoids, "laws": laws,
           "core": core, "compute": {a: json_safe(compute[a]) for a in archs},
           "multiplier": multiplier}
    lines = [f"[X21] CORE = r x mean over {len(tasks)} tasks of [X20] c(B) = 1 / (1 + "
             f"exp(s B - b)) at [X19] B(C) = E + A (C/1e18)^-alpha",
             f"  r = {r:.5f} (rmse {rmse:.4f} on {len(points)} checkpoints)"]
    for t in tasks:
        fits = "; ".join(f"{a} E={laws[a][t]['E']:.4f} A={laws[a][t]['A']:.4f} "
                         f"alpha={laws[a][t]['alpha']:.4f}" for a in archs)
        lines.append(f"  {t}: s={sigmoids[t]['s']:.4f} b={sigmoids[t]['b']:.4f}; {fits}")
    for a in archs:
        if args.budgets:
            at = " ".join(f"{C:.3g}:{v:.4f}" for C, v in zip(args.budgets, core[a]))
            lines.append(f"  {a}: CORE at {at}")
        if args.core:
            # With --ref, also each compute's multiple of the ref's.
            vs = [f" (x{compute[ref][i] / C:.3f} vs {ref})" if ref else ""
                  for i, C in enumerate(compute[a])]
            at = " ".join(f"{v:g}:{C:.3g}{m}" for v, C, m in zip(args.core, compute[a], vs))
            lines.append(f"  {a}: compute for CORE {at}")
    return out, lines


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="downstream.py", usage=argparse.SUPPRESS,
        description="Downstream scores from losses: [S6]-[S7] calibration, "
                    "[X19]-[X21] prediction.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("calibrate", prog="downstream.py calibrate", usage=argparse.SUPPRESS,
                       help="[S6] sigmoid on --ref's endpoints, [S7] --target's residuals")
    c.add_argument("csv", help="the endpoints CSV: columns arch, loss (validation loss), score")
    c.add_argument("--ref", required=True,
                   help="reference architecture: the sigmoid is fitted on it")
    c.add_argument("--target", required=True, help="architecture whose residuals are reported")
    c.add_argument("--rises", action="store_true",
                   help="the score rises with loss, lower is better (an NLL)")
    q = sub.add_parser("predict", prog="downstream.py predict", usage=argparse.SUPPRESS,
                       help="[X19]-[X21] CORE from compute, per architecture")
    q.add_argument("csv", help="the tasks CSV: columns arch, C (training FLOPs), task, nll, "
                               "centered, core")
    q.add_argument("--budgets", type=floats, default=[],
                   help="budgets (FLOPs) at which CORE is predicted")
    q.add_argument("--core", type=floats, default=[],
                   help="CORE values whose compute is predicted")
    q.add_argument("--ref", help="architecture the others' compute is compared with, "
                                 "C_ref / C_arch")
    for p in (c, q):
        p.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    run = {"calibrate": run_calibrate, "predict": run_predict}[args.cmd]
    try:
        out, lines = run(args, parser)
    except (OSError, ValueError) as e:
        # A missing file, a bad row, data no law fits: one line.

        parser.error(str(e) if args.csv in str(e) else f"{args.csv}: {e}")
    print(json.dumps(out) if args.json else "\n".join(lines))
    return 0


if __name__ == "__main__":
    main()
