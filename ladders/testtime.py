"""[X] Figure 17 in miniature (kind "testtime"): Loop-2 at two sizes, trained at its K = 2 or with random
passes (each step's K drawn from `choices`), each seed once; every run's checkpoint then read at K = 1 to
test_passes on the same validation windows. The report: the loss against the passes, each K against the
trained one paired within a model (the same documents), the gate and the reading of the rule written before
the run (docs/ladder.md)."""

import math
import os

import numpy as np

import grow
import match
import plots
from ladders import x
from ladders.runs import RunSpec, data_dir, folder
from ladders.stats import paired, spreads

COLUMNS = ("depth", "training", "seed", "passes", "loss", "C", "D", "run_id", "seconds")
MARGIN = 0.01  # nats: "flat" when the interval of L(K_max) - L(K_trained max) lies within +- this


def plan(preset, results, train_tokens=None):
    """Per depth: its [X] TPP of stored parameters, the LR x-cpu-mini-tuned found at every depth (its grid's
    value carried from d3 by [X16]), fixed K and random K, every seed."""
    specs = []
    step = preset["train"]["batch_size"] * preset["model"]["block_size"]
    for depth in preset["depths"]:
        cfg = x.config(preset, "loop-2", depth)
        steps = max(4, math.ceil(preset["tpp_stored"] * grow.stored_params(cfg) / step))
        lr = preset["lr"]["values"][0]
        settings = x.settings_of(dict(preset, depths=[3]), "loop-2", depth, cfg, steps, lr, preset["lr_beta"])
        for training, choices in (("fixed", []), ("random", preset["choices"])):
            for seed in preset["seeds"]:
                specs.append(RunSpec(f"{training}-d{depth}-s{seed}", dict(settings, seed=seed,
                                                                           n_passes_choices=choices),
                                     dict(depth=depth, training=training, seed=seed, grid_lr=lr,
                                          F=match.flops_per_token(cfg), N=x.compute_active(cfg))))
    return specs, None


def evaluate(preset, specs, results, out):
    """Each finished run's val loss at every K from 1 to test_passes, on the windows its own evals read."""
    from data.loader import load_data
    from loss_eval import evaluate as val
    from model import execution_plan, load_checkpoint
    data = load_data(data_dir(preset))
    for s in (s for s in specs if s.run_id in results):
        model, _ = load_checkpoint(os.path.join(folder(out, s.run_id), "ckpt.pt"))
        losses = {}
        for k in range(1, preset["test_passes"] + 1):
            model.plan = execution_plan(model.config, k)
            t = preset["train"]
            losses[k] = val(model, data, t["eval_tokens"], t["batch_size"])["val_loss"]
        results[s.run_id]["scores"] = losses
    return results


def rows(specs, results):
    """runs.csv: a row per finished run and K it was read at."""
    out = []
    for s in specs:
        r = results.get(s.run_id)
        for k, loss in sorted(((int(k), v) for k, v in ((r or {}).get("scores") or {}).items())):
            row = dict(s.meta, passes=k, loss=loss, C=r["flops"], D=r["tokens"], run_id=s.run_id,
                       seconds=r["seconds"])
            out.append({c: row[c] for c in COLUMNS})
    return out


def report(preset, rows, sweep=None):
    """The loss at each K per depth and training (the mean over seeds), the contrasts paired within each
    model, the gate and the rule's reading."""
    by = {(r["depth"], r["training"], r["seed"], r["passes"]): r["loss"] for r in rows}
    depths, seeds = sorted({r["depth"] for r in rows}), sorted({r["seed"] for r in rows})
    passes, top = sorted({r["passes"] for r in rows}), max(preset["choices"])
    lines = [f"== {preset['name']}: [X] Figure 17, Loop-2 trained at K = 2 (fixed) or with K drawn from "
             f"{preset['choices']} each step (random), then read at K = {passes[0]}..{passes[-1]}; seeds "
             f"{', '.join(map(str, seeds))}", "val loss, the mean over seeds",
             f"  {'':>10} " + " ".join(f"{f'K={k}':>7}" for k in passes)]
    for d in depths:
        for t in ("fixed", "random"):
            lines.append(f"  {f'd{d} {t}':>10} " + " ".join(
                f"{np.mean([by[d, t, s, k] for s in seeds]):7.4f}" for k in passes))
    lines.append(spreads({f"d{d} {t}": [[by[d, t, s, k] for s in seeds] for k in passes]
                          for d in depths for t in ("fixed", "random")}))
    diff = lambda t, k, ref: paired({d: [by[d, t, s, k] - by[d, t, s, ref] for s in seeds]  # noqa: E731
                                     for d in depths})
    lines.append(f"each K minus the trained K (fixed: 2; random: its largest, {top}), paired within "
                 "each model (the same windows), over both depths; 95% t-intervals:")
    contrasts = {}
    for t, ref in (("fixed", 2), ("random", top)):
        for k in passes:
            if k != ref:
                c = contrasts[t, k] = diff(t, k, ref)
                lines.append(f"  {t:>6} K={k} - K={ref}: {c['diff']:+.4f} [{c['lo']:+.4f}, {c['hi']:+.4f}] ("
                             + ", ".join(f"d{d} {m:+.4f}" for d, m in c["means"].items()) + ")")
    if not contrasts["fixed", 1]["lo"] > 0:
        return lines + ["no reading: the instrument failed: the fixed-K model does not lose at K = 1 beyond "
                        "noise (its passes are not in use)"]
    last = passes[-1]
    fixed_best = all(contrasts["fixed", k]["diff"] > 0 for k in passes if k != 2)
    flat = -MARGIN <= contrasts["random", last]["lo"] and contrasts["random", last]["hi"] <= MARGIN
    gain = [k for k in passes if k > top and contrasts["random", k]["hi"] < 0]
    return lines + [
        "gate: the fixed-K model loses at K = 1 beyond noise (its passes are in use)",
        "the decision rule's reading:",
        f"  fixed K: {'' if fixed_best else 'not '}best at its trained K = 2; at K = {last} "
        + ("it loses beyond noise" if contrasts["fixed", last]["lo"] > 0 else "no loss beyond noise")
        + f" ({contrasts['fixed', last]['diff']:+.4f}; [X]: +0.008..+0.042)",
        f"  random K: " + (f"flat (K = {last} within +-{MARGIN} of K = {top})" if flat else
                            f"not shown flat within +-{MARGIN}")
        + ("; a test-time gain at K = " + ", ".join(map(str, gain)) if gain else "; no test-time gain")]


def summary(preset, rows, sweep=None):
    """The README figure's rows (+ where more passes at test time pay): K = 8 against the trained K."""
    by = {(r["depth"], r["training"], r["seed"], r["passes"]): r["loss"] for r in rows}
    depths, seeds, last = sorted({r["depth"] for r in rows}), sorted({r["seed"] for r in rows}), \
        max(r["passes"] for r in rows)
    out = []
    for training, ref in (("fixed", 2), ("random", max(preset["choices"]))):
        c = paired({d: [by[d, training, s, ref] - by[d, training, s, last] for s in seeds] for d in depths})
        label = f"{preset['name']}: {training} K, read at K = {last} vs K = {ref}"
        out.append((label, c["diff"], c["lo"], c["hi"]))
    return out


def figures(preset, rows, path, out=None):
    """The loss against the test-time passes, per depth and training (the mean over seeds)."""
    losses, curves = {}, {}
    for r in rows:
        losses.setdefault((f"d{r['depth']} {r['training']}", r["passes"]), []).append(r["loss"])
    for (label, k), v in sorted(losses.items()):
        curves.setdefault(label, ([], []))[0].append(k)
        curves[label][1].append(np.mean(v))
    title = f"{preset['name']}: Loop-2 read at K passes, trained at K = 2 (fixed) or random K"
    return [path("passes.png")] if plots.plot_loss_curves(curves, path("passes.png"), title,
                                                          xlabel="test-time passes K") else []
