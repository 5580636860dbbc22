"""[X] Figure 17 in miniature (kind "testtime"): Loop-2 at two sizes, trained at
K = 2 or with each step's K drawn from `choices`, then read at K = 1..test_passes."""

import math
import os

import numpy as np

import grow
import match
import plots
from ladders import x
from ladders.runs import RunSpec, data_dir, folder
from ladders.stats import paired, spreads

COLUMNS = "depth training seed passes loss C D run_id seconds".split()
# Flat: L(K_max) - L(K_trained) within +- this (nats).
MARGIN = 0.01


def plan(preset, results, train_tokens=None):
    """Per depth: fixed K and random K, every seed."""
    specs = []
    step = preset["train"]["batch_size"] * preset["model"]["block_size"]
    for depth in preset["depths"]:
        # Loop-2 at its [X] TPP of stored parameters.
        cfg = x.config(preset, "loop-2", depth)
        steps = max(4, math.ceil(preset["tpp_stored"] * grow.stored_params(cfg) / step))
        # x-cpu-mini-tuned's LR, carried from d3.
        lr = preset["lr"]["values"][0]
        settings = x.settings_of(dict(preset, depths=[3]), "loop-2", depth, cfg, steps, lr,
                                 preset["lr_beta"])
        meta = dict(depth=depth, grid_lr=lr, F=match.flops_per_token(cfg), N=x.compute_active(cfg))
        # Fixed K trains at 2; random K draws K per step.
        for training, choices in (("fixed", []), ("random", preset["choices"])):
            specs += [RunSpec(f"{training}-d{depth}-s{seed}",
                              dict(settings, seed=seed, n_passes_choices=choices),
                              dict(meta, training=training, seed=seed)) for seed in preset["seeds"]]
    return specs, None


def evaluate(preset, specs, results, out):
    """Each finished run's val loss at every K."""
    # On the windows its own evals read.
    from data.loader import load_data
    from loss_eval import evaluate as val
    from model import execution_plan, load_checkpoint
    data, t = load_data(data_dir(preset)), preset["train"]
    for s in (s for s in specs if s.run_id in results):
        model, _ = load_checkpoint(os.path.join(folder(out, s.run_id), "ckpt.pt"))
        losses = {}
        # The same checkpoint, read at every K.
        for k in range(1, preset["test_passes"] + 1):
            model.plan = execution_plan(model.config, k)
            losses[k] = val(model, data, t["eval_tokens"], t["batch_size"])["val_loss"]
        results[s.run_id]["scores"] = losses
    return results


def rows(specs, results):
    """runs.csv: a row per finished run and K."""
    out = []
    for s in specs:
        r = results.get(s.run_id)
        for k, loss in sorted((int(k), v) for k, v in ((r or {}).get("scores") or {}).items()):
            row = dict(s.meta, passes=k, loss=loss, C=r["flops"], D=r["tokens"], run_id=s.run_id,
                       seconds=r["seconds"])
            out.append({c: row[c] for c in COLUMNS})
    return out


def losses(rows):
    """({(depth, training, seed, passes): loss}, the depths, the seeds)."""
    by = {(r["depth"], r["training"], r["seed"], r["passes"]): r["loss"] for r in rows}
    return by, sorted({r["depth"] for r in rows}), sorted({r["seed"] for r in rows})


def report(preset, rows, sweep=None):
    """The loss at each K, its contrasts, the gate and the reading."""
    # A contrast is paired within a model: the same
    # windows.
    by, depths, seeds = losses(rows)
    # top: the largest K random training saw.
    passes, top = sorted({r["passes"] for r in rows}), max(preset["choices"])
    arms = [(d, t) for d in depths for t in ("fixed", "random")]
    lines = [f"== {preset['name']}: [X] Figure 17, Loop-2 trained at K = 2 (fixed) or with K "
             f"drawn from {preset['choices']} each step (random), then read at K = "
             f"{passes[0]}..{passes[-1]}; seeds {', '.join(map(str, seeds))}",
             "val loss, the mean over seeds",
             f"  {'':>10} " + " ".join(f"{f'K={k}':>7}" for k in passes)]
    for d, t in arms:
        lines.append(f"  {f'd{d} {t}':>10} " + " ".join(
            f"{np.mean([by[d, t, s, k] for s in seeds]):7.4f}" for k in passes))
    lines.append(spreads({f"d{d} {t}": [[by[d, t, s, k] for s in seeds] for k in passes]
                          for d, t in arms}))
    lines.append(f"each K minus the trained K (fixed: 2; random: its largest, {top}), paired "
                 "within each model (the same windows), over both depths; 95% t-intervals:")
    # Each K minus the trained K, per training.
    contrasts = {}
    for t, ref in (("fixed", 2), ("random", top)):
        for k in passes:
            if k != ref:
                c = contrasts[t, k] = paired({d: [by[d, t, s, k] - by[d, t, s, ref] for s in seeds]
                                              for d in depths})
                lines.append(f"  {t:>6} K={k} - K={ref}: {c['diff']:+.4f} [{c['lo']:+.4f}, "
                             f"{c['hi']:+.4f}] ("
                             + ", ".join(f"d{d} {m:+.4f}" for d, m in c["means"].items()) + ")")
    if not contrasts["fixed", 1]["lo"] > 0:
        return lines + ["no reading: the instrument failed: the fixed-K model does not lose at "
                        "K = 1 beyond noise (its passes are not in use)"]
    # The gate passed: the rule's reading.
    last = passes[-1]
    fixed, random = contrasts["fixed", last], contrasts["random", last]
    # Fixed K should be best at its own K.
    fixed_best = all(contrasts["fixed", k]["diff"] > 0 for k in passes if k != 2)
    flat = -MARGIN <= random["lo"] and random["hi"] <= MARGIN
    # A gain: beyond the trained K, below 0.
    gain = [k for k in passes if k > top and contrasts["random", k]["hi"] < 0]
    loses = "it loses beyond noise" if fixed["lo"] > 0 else "no loss beyond noise"
    return lines + [
        "gate: the fixed-K model loses at K = 1 beyond noise (its passes are in use)",
        "the decision rule's reading:",
        f"  fixed K: {'' if fixed_best else 'not '}best at its trained K = 2; at K = {last} "
        f"{loses} ({fixed['diff']:+.4f}; [X]: +0.008..+0.042)",
        "  random K: " + (f"flat (K = {last} within +-{MARGIN} of K = {top})" if flat else
                          f"not shown flat within +-{MARGIN}")
        + ("; a test-time gain at K = " + ", ".join(map(str, gain)) if gain
           else "; no test-time gain")]


def summary(preset, rows, sweep=None):
    """The README figure's rows: the last K against the trained K."""
    by, depths, seeds = losses(rows)
    last = max(r["passes"] for r in rows)
    out = []
    for t, ref in (("fixed", 2), ("random", max(preset["choices"]))):
        c = paired({d: [by[d, t, s, ref] - by[d, t, s, last] for s in seeds] for d in depths})
        out.append((f"{preset['name']}: {t} K, read at K = {last} vs K = {ref}", c["diff"],
                    c["lo"], c["hi"]))
    return out


def figures(preset, rows, path, out=None):
    """The loss against the test-time passes."""
    # The mean over seeds per (depth and training, K).
    means, curves = {}, {}
    for r in rows:
        means.setdefault((f"d{r['depth']} {r['training']}", r["passes"]), []).append(r["loss"])
    for (label, k), v in sorted(means.items()):
        curves.setdefault(label, ([], []))[0].append(k)
        curves[label][1].append(np.mean(v))
    title = f"{preset['name']}: Loop-2 read at K passes, trained at K = 2 (fixed) or random K"
    drawn = plots.plot_loss_curves(curves, path("passes.png"), title,
                                   xlabel="test-time passes K")
    return [path("passes.png")] if drawn else []
