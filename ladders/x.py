"""[X] ladders (kind "x"): Vanilla, Operator-1, Loop-2, Untied-2, Loop-Grow and Untied-Grow, each with its
own [X] recipe (config/x_d8_*.py) at depths d and width width_per_depth x d, each at its own budget (its [X]
TPP per stored parameter); the LR swept at the first depth and carried up by [X16], or swept at every depth.
The report: E fitted on Vanilla, shared-E power laws [X7], compute multipliers [X6] interpolated at
Vanilla's budgets and between twins, with seed-bootstrap bands."""

import functools
import json
import math
import os
import warnings
from dataclasses import replace

import numpy as np

import configurator
import fit
import grow
import match
import plots
from ladders.runs import RunSpec, run_rows
from ladders.smelt import compute_active, model_settings, vocab
from ladders.stats import fmt, pooled_std, seed_draws, spreads
from ladders.sweep import gate_line, lr_sweep, sweep_lines
from model import ModelConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COLUMNS = ("arch", "cell", "depth", "width", "seed", "C", "D", "F", "N", "N_s", "tpp", "epochs", "grow_step",
           "loss", "run_id", "seconds")
# what a ladder point sets itself; the recipe's warmup becomes a fraction of the run
OWN = {"block_size", "n_layer", "n_embd", "n_head", "head_dim", "data_dir", "out_dir", "batch_size",
       "global_batch", "max_steps", "eval_interval", "eval_tokens", "grow_at", "warmup_steps"}
# the pairs compared directly: growth vs its twin, untied vs tied
PAIRS = (("loop-grow", "loop-2"), ("untied-grow", "untied-2"), ("untied-2", "loop-2"),
         ("untied-grow", "loop-grow"))
REF = "vanilla"


@functools.lru_cache(maxsize=None)
def recipe(arch):
    """(model settings, train settings, warmup as a fraction of the run) of an architecture's [X] recipe."""
    import train
    name = "x_d8_" + arch.replace("-1", "1").replace("-2", "2").replace("-", "_")
    given = configurator.read_config(os.path.join(REPO, "config", name + ".py"))
    own = {k: v for k, v in given.items() if k not in OWN}
    model = {k: v for k, v in own.items() if k in train.MODEL_SETTINGS}
    return model, {k: v for k, v in own.items() if k not in model}, given["warmup_steps"] / given["max_steps"]


def config(preset, arch, depth):
    """The ModelConfig of one ladder point: the recipe's at width width_per_depth x depth."""
    keys = ("tokenizer", "model", "width_per_depth", "head_dim")
    return _config(json.dumps([preset[k] for k in keys]), arch, depth)


@functools.lru_cache(maxsize=None)
def _config(key, arch, depth):
    tokenizer, model, width_per_depth, hd = json.loads(key)
    width = width_per_depth * depth  # the dense SwiGLU's width: model.py's derived 8/3 (rounded)
    shape = dict(recipe(arch)[0], **model, n_layer=depth, n_embd=width, n_head=width // hd, head_dim=hd)
    return ModelConfig(**vocab(dict(tokenizer=tokenizer)), **shape)


def settings_of(preset, arch, depth, cfg, steps, lr, beta):
    """train.py settings of a run of `steps`: the recipe's; the LR lr (the grid's value at the first depth;
    the embedding and lm head at the recipe's ratios to it: [X]'s global LR) x [X16]'s factor (N_s /
    N_s at the first depth)^beta."""
    _, t, warmup = recipe(arch)
    first = config(preset, arch, preset["depths"][0])
    scale = (grow.stored_params(cfg) / grow.stored_params(first)) ** beta
    lrs = {k: float(f"{lr * t[k] / t['matrix_lr'] * scale:.12g}")
           for k in ("matrix_lr", "embedding_lr", "unembedding_lr")}
    return dict(t, **preset["train"], **model_settings(cfg), **lrs, max_steps=steps,
                eval_interval=steps, warmup_steps=round(warmup * steps))


def growth_step(cfg, tokens, steps, decay_fraction):
    """[X15]: the fraction rho* of tokens after growth (K -> 2K) from the affine law [X9] at this run's
    TPP = D / N_s -> the step to grow at (one later if it falls where the decay starts)."""
    law = grow.AFFINE_LAW["loop_grow" if cfg.tie_core else "untied_grow"]
    e_ratio = grow.compute_active_params(cfg, 2 * cfg.n_passes) / grow.compute_active_params(cfg)
    rho = grow.optimal_growth_fraction(tokens / grow.stored_params(cfg), *law, e_ratio)
    step = max(1, min(steps - 1, round((1 - min(max(rho, 0.05), 0.95)) * steps)))
    return step + (step == steps - round(decay_fraction * steps))


def plan(preset, results, train_tokens=None):
    """Every run the ladder needs given the results so far -> (specs, lr_sweep.csv's rows or None): each
    point's sweep (at the first depth, or at every depth), then every architecture at every depth at its
    LR, every seed."""
    lr, t, every = preset["lr"], preset["train"], preset["lr"]["every_point"]
    step_tokens = (t.get("global_batch") or t["batch_size"]) * preset["model"]["block_size"]

    def runs(point, value, seeds=None):
        arch, depth = point
        cfg = config(preset, arch, depth)
        steps = max(4, math.ceil(preset["tpp_stored"][arch] * grow.stored_params(cfg) / step_tokens))
        settings = settings_of(preset, arch, depth, cfg, steps, value, preset["lr_beta"][arch])
        g = arch.endswith("-grow") and growth_step(cfg, steps * step_tokens, steps,
                                                   settings["decay_fraction"])
        phases = [(g or steps, cfg)] + [(steps - g, replace(cfg, n_passes=2 * cfg.n_passes))] * bool(g)
        meta = dict(arch=arch, cell=f"d{depth}", depth=depth, width=cfg.n_embd, N=compute_active(cfg),
                    N_s=grow.stored_params(cfg), F=match.run_flops(cfg, phases)["flops_per_token"],
                    grow_step=g or None, grid_lr=value)
        grows = {"grow_at": float(g)} if g else {}
        return [RunSpec(f"{arch}-d{depth}-{lr['key']}{value:g}-s{seed}", dict(settings, seed=seed, **grows),
                        dict(meta, seed=seed)) for seed in seeds or preset["seeds"][:lr["seeds"]]]

    points = [(a, d) for d in (preset["depths"] if every else preset["depths"][:1]) for a in preset["archs"]]
    specs, best, rows = lr_sweep(preset, points, runs, results, "depth" if every else None)
    if best is not None:
        d0 = preset["depths"][0]
        specs += [s for d in preset["depths"] for a in preset["archs"]
                  for s in runs((a, d), best[a, d if every else d0], preset["seeds"])]
    return specs, rows


def rows(specs, results):
    """runs.csv: the ladder's runs (not the sweep's other values), C and D as train.py counted them."""
    return run_rows(specs, results, COLUMNS, sources=True)


def depth_means(points):
    """(C, L) of an architecture's points [(C, L, depth)], one mean per depth: an interpolated multiplier
    reads a seed-averaged curve (two seeds at one compute would otherwise make a crossing of their own)."""
    depths = sorted({d for *_, d in points})
    return tuple(np.array([np.mean([p[i] for p in points if p[2] == d]) for d in depths]) for i in (0, 1))


def multiplier_bands(points, pairs, n_draws, seed):
    """The seed bootstrap of the interpolated multipliers: every (arch, depth) seed mean drawn with its
    architecture's seed std pooled over its depths (stats.seed_draws, a Student t), the multipliers at the
    reference's per-depth budgets and each pair's at its twin's -> {(arch, reference): (lo, hi, the share
    of draws in which it is defined)}."""
    noise = {a: pooled_std([[l for _, l, d in p if d == depth] for depth in sorted({d for *_, d in p})])
             for a, p in points.items()}
    groups = [(a, d) for a, p in points.items() for d in sorted({d for *_, d in p})]
    means = [np.mean([l for _, l, dd in points[a] if dd == d]) for a, d in groups]
    draws = seed_draws(means, [sum(dd == d for *_, dd in points[a]) for a, d in groups],
                       [noise[a][0] for a, _ in groups], [noise[a][1] for a, _ in groups], n_draws, seed)
    C = {a: depth_means(p)[0] for a, p in points.items()}
    drawn = {pair: [] for pair in [(a, REF) for a in points if a != REF] + list(pairs)}
    for row in draws:
        L = {a: np.array([v for (aa, _), v in zip(groups, row) if aa == a]) for a in points}
        for arm, base in drawn:
            drawn[arm, base].append(fit.compute_multiplier(C[base], L[base], C[arm], L[arm]))
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an all-nan column (no interpolation possible) stays nan
        return {pair: (*np.nanpercentile(d, [2.5, 97.5], axis=0), np.isfinite(d).mean(axis=0))
                for pair, d in ((p, np.array(v)) for p, v in drawn.items())}


def report(preset, rows, sweep):
    """The report's lines from runs.csv's rows and lr_sweep.csv's."""
    archs = list(dict.fromkeys(r["arch"] for r in rows)) or list(preset["archs"])
    depths, d0 = sorted({r["depth"] for r in rows}), preset["depths"][0]
    lines = [f"== {preset['name']}: [X] ladders at width {preset['width_per_depth']} x depth, each "
             "architecture at its [X] TPP per stored parameter ("
             + ", ".join(f"{a} {preset['tpp_stored'][a]:g}" for a in archs) + ")"]
    if sweep:
        lines += sweep_lines(sweep) + ([] if preset["lr"]["every_point"] else [
            f"  each LR carried up from d{d0} by [X16], x (N_s / N_s,d{d0})^beta: "
            + ", ".join(f"{a} {preset['lr_beta'][a]:g}" for a in archs)]) + [gate_line(sweep)]
    if not rows:
        return lines + ["no finished runs yet"]

    def mean(a, d, key):
        return np.mean([r[key] for r in rows if r["arch"] == a and r["depth"] == d] or [np.nan])
    header = f"  {'':>12} " + " ".join(f"{f'd{d}':>9}" for d in depths)
    lines += ["final validation loss, the mean over seeds", header]
    lines += [f"  {a:>12} " + " ".join(fmt(mean(a, d, "loss"), "9.4f") for d in depths) for a in archs]
    lines += [f"  training FLOPs {min(r['C'] for r in rows):.3g}..{max(r['C'] for r in rows):.3g}; epochs "
              f"read {min(r['epochs'] or 0 for r in rows):.2f}..{max(r['epochs'] or 0 for r in rows):.2f} "
              "(runs.csv: each run's tokens D and FLOPs C; equal depth is not equal compute)"]
    points = {a: [(r["C"], r["loss"], r["depth"]) for r in rows if r["arch"] == a] for a in archs}
    groups = {a: [[l for _, l, d in p if d == depth] for depth in depths] for a, p in points.items()}
    lines.append(spreads(groups) + " (each pooled over its depths)")
    if len({d for *_, d in points.get(REF, [])}) < 3 or not all(pooled_std(g)[1] for g in groups.values()):
        return lines + [f"[X7] and [X6] need {REF} at 3 depths and every architecture's seeds"]
    runs = {a: (np.array([c for c, _, _ in p]), np.array([l for _, l, _ in p])) for a, p in points.items()}
    fits = fit.fit_power_laws(runs, REF, C0=float(np.exp(np.mean(np.log(runs[REF][0])))))
    lines.append(f"[X7] E = {fits[REF].E:.4f} ([X]'s free fit on {REF}, every seed), C0 = "
                 f"{fits[REF].C0:.3g}; L = E + A (C/C0)^-gamma per architecture with E fixed, gamma +- "
                 "its standard error")
    lines += [f"  {a:>12}: A={f.A:.4f} gamma={f.gamma:.4f} +- {f.gamma_se:.4f}" for a, f in fits.items()]
    if fits[REF].E < 1e-3:  # the exponents of laws whose shared floor is not measured
        lines.append(f"  no reading of the exponents: {REF}'s free fit puts E at its bound (0)")
    pairs = [p for p in PAIRS if set(p) <= set(points)]
    bands = multiplier_bands(points, pairs, preset["bootstrap"], 1337)
    lines.append("[X6] compute multipliers, interpolated ([X]'s rule: log C linear in loss between an "
                 "architecture's own per-depth means, never extrapolated; - outside them) at the reference's "
                 f"per-depth budgets [95% seed-bootstrap band of {preset['bootstrap']} draws] (the share of "
                 "draws in which it is defined, where below 0.99)")
    for arm, base in [(a, REF) for a in archs if a != REF] + pairs:
        C, L = depth_means(points[base])
        m, (lo, hi, defined) = fit.compute_multiplier(C, L, *depth_means(points[arm])), bands[arm, base]
        cells = [f"{c:.3g}: " + (f"{v:.3f} [{fmt(a, '.2f')}, {fmt(b, '.2f')}]"
                                 + (f" ({d:.2f})" if d < 0.99 else "") if np.isfinite(v) else "-")
                 for c, v, a, b, d in zip(C, m, lo, hi, defined)]
        lines.append(f"  {f'{arm} / {base}':>24} " + " ".join(cells))
    return lines


def figures(preset, rows, path, out=None):
    """Loss vs compute with the shared-E laws, and the interpolated multipliers with their bands."""
    points = {a: [(r["C"], r["loss"], r["depth"]) for r in rows if r["arch"] == a]
              for a in dict.fromkeys(r["arch"] for r in rows)}
    if len({d for *_, d in points.get(REF, [])}) < 3:  # no laws to draw
        return []
    runs = {a: (np.array([c for c, _, _ in p]), np.array([l for _, l, _ in p])) for a, p in points.items()}
    fits = fit.fit_power_laws(runs, REF, C0=float(np.exp(np.mean(np.log(runs[REF][0])))))
    C, L = depth_means(points[REF])
    m = {a: fit.compute_multiplier(C, L, *depth_means(p)) for a, p in points.items() if a != REF}
    bands = multiplier_bands(points, (), preset["bootstrap"], 1337)
    bands = {a: tuple(np.where(np.isfinite(m[a]), side, np.nan) for side in bands[a, REF][:2]) for a in m}
    name = preset["name"]
    drawn = [plots.plot_loss_vs_compute(runs, fits, path("loss_vs_compute.png"),
                                        title=f"[X7] {name}: loss vs training FLOPs, shared-E laws"),
             plots.plot_multipliers(C, m, path("multipliers.png"), bands=bands, ref=REF,
                                    title=f"[X6] {name}: interpolated compute multipliers, 95% bands")]
    return [path(n) for n, ok in zip(("loss_vs_compute.png", "multipliers.png"), drawn) if ok]
