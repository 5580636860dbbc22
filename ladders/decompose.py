"""SMELT's deficit decomposed (kind "decompose"): at every (scale, token budget),
five arms read the same tokens. D, looped, has 1.5x A's FLOPs, unmatched."""

import functools
import math

import numpy as np

import match
from ladders.runs import RunSpec, run_rows, tokens_per_step
from ladders.smelt import cells, compute_active, model_settings
from ladders.stats import paired, spreads, t_interval

ARMS = {"A": "the baseline", "B": "the twin's shape, no loop", "C": "the SMELT twin",
        "D": "the baseline looped (r = 2)", "E": "the baseline as deep as D runs"}
CONTRASTS = [("B", "A", "narrowing to the twin's shape"),
             ("C", "B", "the loop on the narrow model"), ("C", "A", "SMELT minus its baseline"),
             ("D", "A", "the loop at full width"), ("E", "A", "more depth at full width"),
             ("D", "E", "the loop against as much fresh depth")]
COLUMNS = "arm cell tpp seed F D C loss N n_layer n_embd layout lr run_id seconds".split()


def arms(base, twin):
    return dict(A=base, B=twin.replace(layout="plain", n_passes=1), C=twin,
                D=base.replace(layout="smelt", n_passes=2),
                E=base.replace(n_layer=base.n_layer + base.loop_span))


def plan(preset, results, train_tokens=None):
    """One WSD run per cell, token budget, arm and seed."""
    # A, D and E run at the baseline's LR, B and C at
    # the twin's.
    t, step = preset["train"], tokens_per_step(preset)
    specs = []
    # Every arm of a cell reads the same tokens.
    for cell, scale, base, twin, _ in cells(preset):
        for tpp in preset["budget_tpp"]:
            # The same tokens for every arm.
            steps = max(2, math.ceil(tpp * compute_active(base) / step))
            for arm, cfg in arms(base, twin).items():
                lr = preset["lr"]["arms"][scale][arm in "BC"]
                run = dict(t, **model_settings(cfg), max_steps=steps, eval_interval=steps,
                           **{preset["lr"]["key"]: lr})
                meta = dict(arm=arm, cell=cell, tpp=tpp, F=match.flops_per_token(cfg),
                            N=compute_active(base), n_layer=cfg.n_layer, n_embd=cfg.n_embd,
                            layout=cfg.layout, lr=lr, grid_lr=lr)
                specs += [RunSpec(f"{arm}-{cell}-t{tpp:g}-s{seed}", dict(run, seed=seed),
                                  dict(meta, seed=seed)) for seed in preset["seeds"]]
    return specs, None


# runs.csv: a row per finished run.
rows = functools.partial(run_rows, columns=COLUMNS)


def reading(z):
    """The decision rule written before the run."""
    if z["D-A"] < -2 or z["C-B"] < -2:
        return "the loop helps here (D - A or C - B below -2 sigma)"
    if z["E-A"] < -2 and z["D-A"] >= -2:
        return "depth helps but the loop does not: the loop's implementation is in question"
    if z["B-A"] > 2 and abs(z["C-B"]) <= 2:
        return "the deficit is the narrowing (B - A above +2 sigma, C - B within 2 sigma of 0)"
    return "no reading of the rule holds"


def contrasts(rows):
    """(losses, points, seeds, {(x, y): x - y paired by seed})."""
    by = {(r["cell"], r["tpp"], r["arm"], r["seed"]): r["loss"] for r in rows}
    # The points by budget, then cell.
    points = sorted({(c, t) for c, t, *_ in by}, key=lambda p: (p[1], p[0]))
    seeds = sorted({k[3] for k in by})
    pairs = {(x, y): paired({p: [by[(*p, x, s)] - by[(*p, y, s)] for s in seeds] for p in points})
             for x, y, _ in CONTRASTS}
    return by, points, seeds, pairs


def summary(preset, rows, sweep=None):
    """The README figure's rows: the loop's and depth's contrasts."""
    pairs = contrasts(rows)[3]
    return [(f"{preset['name']}: {what}", -c["diff"], -c["hi"], -c["lo"]) for (x, y, what), c
            in zip(CONTRASTS, pairs.values()) if x + y in ("CA", "DA", "EA", "DE")]


def report(preset, rows, sweep=None):
    by, points, seeds, pairs = contrasts(rows)
    # An arm's mean loss at a point.
    def mean(p, a):
        return float(np.mean([by[(*p, a, s)] for s in seeds]))
    lines = [f"== {preset['name']}: [S] SMELT's deficit decomposed; every arm of a point reads "
             f"the same tokens (tpp x the baseline's N), seeds {', '.join(map(str, seeds))}",
             "  " + "; ".join(f"{a} {what}" for a, what in ARMS.items()),
             spreads({a: [[by[(*p, a, s)] for s in seeds] for p in points] for a in ARMS}),
             "each contrast paired by seed (a seed fixes the data order and the draws of every "
             "arm): its noise the spread of the per-seed differences pooled over the points; 95% "
             "t-intervals",
             f"  {'point':<16} " + " ".join(f"{a:>7}" for a in ARMS) + " "
             + " ".join(f"{x + '-' + y:>22}" for x, y, _ in CONTRASTS)]
    # Per point: each arm's loss, then each contrast.
    for p in points:
        cells_ = []
        for x, y, _ in CONTRASTS:
            c = pairs[x, y]
            lo, hi = t_interval(c["means"][p], c["point_sigma"], len(seeds), c["dof"])
            cells_.append(f"{c['means'][p]:+.4f} [{lo:+.3f},{hi:+.3f}]")
        losses = " ".join(f"{mean(p, a):7.4f}" for a in ARMS)
        point = f"{p[0]} t{p[1]:g}"
        lines.append(f"  {point:<16} {losses} " + " ".join(f"{c:>22}" for c in cells_))
    lines.append(f"averaged over the {len(points)} points (each point weighs the same), paired:")
    for x, y, what in CONTRASTS:
        c = pairs[x, y]
        below = sum(v < 0 for v in c["means"].values())
        lines.append(f"  {x} - {y} ({what}): {c['diff']:+.4f} nats [{c['lo']:+.4f}, "
                     f"{c['hi']:+.4f}] = {c['z']:+.1f} sigma ({c['dof']} dof), p = "
                     f"{c['p']:.3f}; below 0 at {below} of {len(points)} points")
    # The gate: every arm learns.
    cells = sorted({c for c, _ in points})
    low, high = min(t for _, t in points), max(t for _, t in points)
    stalled = [f"{a} {c} seed {s}" for a in ARMS for c in cells for s in seeds
               if not by[(c, high, a, s)] < by[(c, low, a, s)]]
    if stalled:
        return lines + ["no reading: the instrument failed: the loss does not fall from tpp "
                        f"{low:g} to {high:g} for " + ", ".join(stalled)]
    # The rule reads the averaged contrasts' z.
    z = {f"{x}-{y}": pairs[x, y]["z"] for x, y, _ in CONTRASTS}
    return lines + [f"gate: every arm's loss falls from tpp {low:g} to {high:g} at every scale "
                    "on every seed", f"the decision rule's reading: {reading(z)}"]
