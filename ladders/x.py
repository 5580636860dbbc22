"""[X] ladders (kind "x"): each architecture with its own [X] recipe at depths d
and width width_per_depth x d. The report: shared-E laws [X7], multipliers [X6]."""

import functools
import json
import math
import os
import warnings

import numpy as np

import configurator
import fit
import grow
import match
import plots
from ladders.runs import RunSpec, run_rows, tokens_per_step
from ladders.smelt import compute_active, model_settings, vocab
from ladders.stats import fmt, pooled_std, seed_draws, spreads
from ladders.sweep import gate_line, lr_sweep, sweep_lines
from model import ModelConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COLUMNS = "arch cell depth width seed C D F N N_s tpp epochs grow_step loss run_id seconds".split()
# What a ladder point sets itself, not its recipe.
OWN = set(("block_size n_layer n_embd n_head head_dim data_dir out_dir batch_size global_batch "
           "max_steps eval_interval eval_tokens grow_at warmup_steps").split())
# Growth vs its twin, untied vs tied.
PAIRS = (("loop-grow", "loop-2"), ("untied-grow", "untied-2"), ("untied-2", "loop-2"),
         ("untied-grow", "loop-grow"))
REF = "vanilla"


@functools.lru_cache(maxsize=None)
def recipe(arch):
    """(model settings, train settings, warmup fraction) of arch's recipe."""
    import train
    name = "x_d8_" + arch.replace("-1", "1").replace("-2", "2").replace("-", "_")
    # config/x_d8_<arch>.py
    given = configurator.read_config(os.path.join(REPO, "config", name + ".py"))
    own = {k: v for k, v in given.items() if k not in OWN}
    model = {k: v for k, v in own.items() if k in train.MODEL_SETTINGS}
    rest = {k: v for k, v in own.items() if k not in model}
    return model, rest, given["warmup_steps"] / given["max_steps"]


def config(preset, arch, depth):
    """The ModelConfig of a ladder point."""
    keys = ("tokenizer", "model", "width_per_depth", "head_dim")
    return _config(json.dumps([preset[k] for k in keys]), arch, depth)


@functools.lru_cache(maxsize=None)
def _config(key, arch, depth):
    tokenizer, model, width_per_depth, hd = json.loads(key)
    width = width_per_depth * depth
    shape = dict(recipe(arch)[0], **model, n_layer=depth, n_embd=width, n_head=width // hd,
                 head_dim=hd)
    return ModelConfig(**vocab(dict(tokenizer=tokenizer)), **shape)


def settings_of(preset, arch, depth, cfg, steps, lr, beta):
    """train.py settings: the recipe's, the LR carried up."""
    # [X16]: lr x (N_s / N_s at the first depth)^beta.
    _, t, warmup = recipe(arch)
    first = config(preset, arch, preset["depths"][0])
    scale = (grow.stored_params(cfg) / grow.stored_params(first)) ** beta
    # [X]'s global LR: the embedding and
    # lm head keep their ratios to it.
    lrs = {k: float(f"{lr * t[k] / t['matrix_lr'] * scale:.12g}")
           for k in ("matrix_lr", "embedding_lr", "unembedding_lr")}
    return dict(t, **preset["train"], **model_settings(cfg), **lrs, max_steps=steps,
                eval_interval=steps, warmup_steps=round(warmup * steps))


def growth_step(cfg, tokens, steps, decay_fraction):
    """[X15]: the step to grow at (K -> 2K)."""
    # rho*, the share of tokens after growth, is the
    # affine law [X9] at this run's TPP = D / N_s.
    law = grow.AFFINE_LAW["loop_grow" if cfg.tie_core else "untied_grow"]
    e_ratio = grow.compute_active_params(cfg, 2 * cfg.n_passes) / grow.compute_active_params(cfg)
    rho = grow.optimal_growth_fraction(tokens / grow.stored_params(cfg), *law, e_ratio)
    step = max(1, min(steps - 1, round((1 - min(max(rho, 0.05), 0.95)) * steps)))
    # Not where the decay starts.
    return step + (step == steps - round(decay_fraction * steps))


def plan(preset, results, train_tokens=None):
    """Every run the ladder needs, given the results so far."""
    # The LR is swept at the first depth and carried up
    # by [X16], or swept at every depth.
    lr, every, step_tokens = preset["lr"], preset["lr"]["every_point"], tokens_per_step(preset)

    def runs(point, value, seeds=None):
        arch, depth = point
        cfg = config(preset, arch, depth)
        # Each architecture trains on its own [X] TPP.
        steps = max(4, math.ceil(preset["tpp_stored"][arch] * grow.stored_params(cfg)
                                 / step_tokens))
        settings = settings_of(preset, arch, depth, cfg, steps, value, preset["lr_beta"][arch])
        # A -grow arch doubles its passes at step g.
        g = arch.endswith("-grow") and growth_step(cfg, steps * step_tokens, steps,
                                                   settings["decay_fraction"])
        phases = [(g or steps, cfg)] + bool(g) * [
            (steps - g, cfg.replace(n_passes=2 * cfg.n_passes))]
        meta = dict(arch=arch, cell=f"d{depth}", depth=depth, width=cfg.n_embd, grid_lr=value,
                    N=compute_active(cfg), N_s=grow.stored_params(cfg), grow_step=g or None,
                    F=match.run_flops(cfg, phases)["flops_per_token"])
        grows = {"grow_at": float(g)} if g else {}
        return [RunSpec(f"{arch}-d{depth}-{lr['key']}{value:g}-s{seed}",
                        dict(settings, seed=seed, **grows), dict(meta, seed=seed))
                for seed in seeds or preset["seeds"][:lr["seeds"]]]

    depths = preset["depths"] if every else preset["depths"][:1]
    points = [(a, d) for d in depths for a in preset["archs"]]
    specs, best, rows = lr_sweep(preset, points, runs, results, "depth" if every else None)
    if best is not None:
        d0 = preset["depths"][0]
        # Every seed at each point's best LR.
        specs += [s for d in preset["depths"] for a in preset["archs"]
                  for s in runs((a, d), best[a, d if every else d0], preset["seeds"])]
    return specs, rows


# runs.csv's rows.
rows = functools.partial(run_rows, columns=COLUMNS, sources=True)


def depth_means(points):
    """(C, L) of an architecture's points, one mean per depth."""
    # Two seeds at one compute would make a crossing
    # of their own in an interpolated multiplier.
    depths = sorted({d for *_, d in points})
    return tuple(np.array([np.mean([p[i] for p in points if p[2] == d]) for d in depths])
                 for i in (0, 1))


def multiplier_bands(points, pairs, n_draws, seed):
    """The multipliers' seed bootstrap bands."""
    # A seed mean is drawn with its arch's seed std,
    # pooled over its depths.
    noise = {a: pooled_std([[l for _, l, d in p if d == depth]
                            for depth in sorted({d for *_, d in p})]) for a, p in points.items()}
    groups = [(a, d) for a, p in points.items() for d in sorted({d for *_, d in p})]
    means = [np.mean([l for _, l, dd in points[a] if dd == d]) for a, d in groups]
    # Draw every (arch, depth) seed mean at once.
    draws = seed_draws(means, [sum(dd == d for *_, dd in points[a]) for a, d in groups],
                       [noise[a][0] for a, _ in groups], [noise[a][1] for a, _ in groups],
                       n_draws, seed)
    # The budgets stay the runs' own means.
    C = {a: depth_means(p)[0] for a, p in points.items()}
    drawn = {pair: [] for pair in [(a, REF) for a in points if a != REF] + list(pairs)}
    # Every draw's multipliers, at the same budgets.
    for row in draws:
        L = {a: np.array([v for (aa, _), v in zip(groups, row) if aa == a]) for a in points}
        for arm, base in drawn:
            drawn[arm, base].append(fit.compute_multiplier(C[base], L[base], C[arm], L[arm]))
    # An all-nan column (no interpolation) stays nan.
    # The 95% band of each multiplier over the draws.
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {pair: (*np.nanpercentile(d, [2.5, 97.5], axis=0), np.isfinite(d).mean(axis=0))
                for pair, d in ((p, np.array(v)) for p, v in drawn.items())}


def points_of(rows):
    """{arch: [(C, L, depth)]}, in the order the archs appear."""
    archs = dict.fromkeys(r["arch"] for r in rows)
    return {a: [(r["C"], r["loss"], r["depth"]) for r in rows if r["arch"] == a] for a in archs}


def laws(points):
    """[X7]: each arch's (C, L) and the shared-E power laws."""
    runs = {a: tuple(np.array(v) for v in list(zip(*p))[:2]) for a, p in points.items()}
    return runs, fit.fit_power_laws(runs, REF, C0=float(np.exp(np.mean(np.log(runs[REF][0])))))


def report(preset, rows, sweep):
    archs = list(dict.fromkeys(r["arch"] for r in rows)) or list(preset["archs"])
    depths, d0 = sorted({r["depth"] for r in rows}), preset["depths"][0]
    lines = [f"== {preset['name']}: [X] ladders at width {preset['width_per_depth']} x depth, "
             "each architecture at its [X] TPP per stored parameter ("
             + ", ".join(f"{a} {preset['tpp_stored'][a]:g}" for a in archs) + ")"]
    if sweep:
        betas = ", ".join(f"{a} {preset['lr_beta'][a]:g}" for a in archs)
        carried = f"  each LR carried up from d{d0} by [X16], x (N_s / N_s,d{d0})^beta: {betas}"
        lines += sweep_lines(sweep) + ([] if preset["lr"]["every_point"] else [carried])
        lines.append(gate_line(sweep))
    if not rows:
        return lines + ["no finished runs yet"]

    def mean(a, d, key):
        return np.mean([r[key] for r in rows if r["arch"] == a and r["depth"] == d] or [np.nan])
    lines += ["final validation loss, the mean over seeds",
              f"  {'':>12} " + " ".join(f"{f'd{d}':>9}" for d in depths)]
    lines += [f"  {a:>12} " + " ".join(fmt(mean(a, d, "loss"), "9.4f") for d in depths)
              for a in archs]
    # The ladder's compute and data reuse.
    C, epochs = [r["C"] for r in rows], [r["epochs"] or 0 for r in rows]
    lines += [f"  training FLOPs {min(C):.3g}..{max(C):.3g}; epochs read {min(epochs):.2f}.."
              f"{max(epochs):.2f} (runs.csv: each run's tokens D and FLOPs C; equal depth is "
              "not equal compute)"]
    points = points_of(rows)
    groups = {a: [[l for _, l, d in p if d == depth] for depth in depths]
              for a, p in points.items()}
    lines.append(spreads(groups) + " (each pooled over its depths)")
    if len({d for *_, d in points.get(REF, [])}) < 3 or \
            not all(pooled_std(g)[1] for g in groups.values()):
        return lines + [f"[X7] and [X6] need {REF} at 3 depths and every architecture's seeds"]
    runs, fits = laws(points)
    lines.append(f"[X7] E = {fits[REF].E:.4f} ([X]'s free fit on {REF}, every seed), C0 = "
                 f"{fits[REF].C0:.3g}; L = E + A (C/C0)^-gamma per architecture with E "
                 "fixed, gamma +- its standard error")
    lines += [f"  {a:>12}: A={f.A:.4f} gamma={f.gamma:.4f} +- {f.gamma_se:.4f}"
              for a, f in fits.items()]
    # A shared floor at 0 is not measured.
    if fits[REF].E < 1e-3:
        lines.append(f"  no reading of the exponents: {REF}'s free fit puts E at its bound (0)")
    # Each arch against the reference, then the pairs.
    pairs = [p for p in PAIRS if set(p) <= set(points)]
    bands = multiplier_bands(points, pairs, preset["bootstrap"], 1337)
    lines.append("[X6] compute multipliers, interpolated ([X]'s rule: log C linear in loss between "
                 "an architecture's own per-depth means, never extrapolated; - outside them) at "
                 "the reference's per-depth budgets [95% seed-bootstrap band of "
                 f"{preset['bootstrap']} draws] (the share of draws in which it is defined, where "
                 "below 0.99)")
    for arm, base in [(a, REF) for a in archs if a != REF] + pairs:
        C, L = depth_means(points[base])
        m = fit.compute_multiplier(C, L, *depth_means(points[arm]))
        cells = [f"{c:.3g}: " + (f"{v:.3f} [{fmt(a, '.2f')}, {fmt(b, '.2f')}]"
                                 + (f" ({d:.2f})" if d < 0.99 else "") if np.isfinite(v) else "-")
                 for c, v, a, b, d in zip(C, m, *bands[arm, base])]
        lines.append(f"  {f'{arm} / {base}':>24} " + " ".join(cells))
    return lines


def figures(preset, rows, path, out=None):
    """Loss vs compute with the laws, and the multipliers."""
    points = points_of(rows)
    if len({d for *_, d in points.get(REF, [])}) < 3:
        return []
    runs, fits = laws(points)
    C, L = depth_means(points[REF])
    m = {a: fit.compute_multiplier(C, L, *depth_means(p)) for a, p in points.items() if a != REF}
    bands = multiplier_bands(points, (), preset["bootstrap"], 1337)
    # No band where the multiplier is not defined.
    bands = {a: tuple(np.where(np.isfinite(m[a]), side, np.nan) for side in bands[a, REF][:2])
             for a in m}
    name = preset["name"]
    titles = (f"[X7] {name}: loss vs training FLOPs, shared-E laws",
              f"[X6] {name}: interpolated compute multipliers, 95% bands")
    drawn = [plots.plot_loss_vs_compute(runs, fits, path("loss_vs_compute.png"), title=titles[0]),
             plots.plot_multipliers(C, m, path("multipliers.png"), bands=bands, ref=REF,
                                    title=titles[1])]
    return [path(n) for n, ok in zip(("loss_vs_compute.png", "multipliers.png"), drawn) if ok]
