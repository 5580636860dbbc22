"""[S] SMELT grid (kind "smelt"): each (scale, sparsity) cell has a MoE baseline
and its SMELT twin. A WSD stable run per seed forks a decay branch at each branch
point. The report: the pairs, an [S2] surface per arch, CE Gain [S5] and TPP."""

import functools
import json
import math
import os
from dataclasses import replace

import numpy as np

import fit
import match
import plots
from data.loader import BRANCH_FRACTION
from ladders.runs import RunSpec, run_rows, tokens_per_step
from ladders.stats import fmt, pooled_std, profile_bound, profile_interval, spreads, t_interval
from ladders.sweep import gate_line, lr_sweep, sweep_lines
from model import ModelConfig

ARCHS = ("baseline", "smelt")
COLUMNS = ("arch cell seed branch_tpp branch_step F S D C loss N tpp epochs n_layer n_embd "
           "n_expert run_id seconds").split()
# The profile of a refits the surface at these.
PROFILE_A = np.geomspace(0.01, 10.0, 31)
# F within 25% of the next lower is one level.
F_LEVEL = 1.25
# More levels of F than the F term's E, A and a.
IDENTIFYING_F_LEVELS = 4
# A floor E below this (nats) is at the bound, 0.
E_RESOLVED = 1e-3


def model_settings(cfg):
    """A ModelConfig as train.py's model settings."""
    import train
    def plain(v):
        return int(v) if isinstance(v, int) and not isinstance(v, bool) else v
    # JSON-safe: numpy ints become plain ints.
    return {k: plain(getattr(cfg, k)) for k in train.MODEL_SETTINGS}


def vocab(preset):
    """The tokenizer's vocabulary."""
    from data.loader import get_tokenizer
    tok = get_tokenizer(preset["tokenizer"])
    return dict(vocab_size=tok.n_vocab, eot_token=tok.eot_token)


def compute_active(cfg):
    """N: [X10]'s N_c without the lm head."""
    return match.accounting(cfg)["params_compute_active"] - cfg.vocab_size * cfg.n_embd


def cells(preset):
    """[(cell, scale, baseline, SMELT twin, match report)]."""
    return _cells(json.dumps([preset[k] for k in ("tokenizer", "model", "scales", "cells",
                                                  "match")]))


@functools.lru_cache(maxsize=None)
def _cells(key):
    tokenizer, model, scales, grid, options = json.loads(key)
    options = {k: tuple(v) if isinstance(v, list) else v for k, v in options.items()}
    out = []
    for scale, n_expert in grid:
        shape = dict(model, **scales[scale], n_expert=n_expert)
        # The twin is searched for once per cell.
        base = ModelConfig(**vocab(dict(tokenizer=tokenizer)), **shape)
        twin, report = match.match(base, "smelt", **options)
        out.append((f"{scale}-e{n_expert}", scale, base, twin, report))
    return out


def plan(preset, results, train_tokens=None):
    """Every run the grid needs, given the results so far."""
    lr, step = preset["lr"], tokens_per_step(preset)
    # The first cell of each scale.
    grid, first, where = cells(preset), {}, "scale" if lr["every_point"] else None
    for c in grid:
        first.setdefault(c[1], c)
    # The LR is swept at the first cell or each scale's.
    points = {(a, c[1]): (c, cfg) for c in (first.values() if where else grid[:1])
              for a, cfg in zip(ARCHS, c[2:4])}
    # A stable run does not decay; its branches do.
    common = dict(preset["train"], decay_fraction=0.0)

    def meta(c, arch, cfg, seed, value, **more):
        return dict(arch=arch, cell=c[0], seed=seed, S=match.sparsity(cfg, baseline=c[2])["S"],
                    N=compute_active(c[2]),
                    n_layer=cfg.n_layer, n_embd=cfg.n_embd, n_expert=cfg.n_expert,
                    F=match.flops_per_token(cfg), grid_lr=value, **more)

    # [(TPP, stable steps, decay steps)] of TPP x N tokens.
    # A branch reads the held-back tail once at most.
    def branches(c):
        out = []
        for tpp in preset["branch_tpp"]:
            total = tpp * compute_active(c[2]) / step
            decay = max(1, math.ceil(preset["decay_share"] * total))
            if train_tokens:
                held = int(BRANCH_FRACTION * train_tokens) - 1
                decay = min(decay, held // step)
            out.append((tpp, max(1, math.ceil(total) - decay), decay))
        return out

    # One WSD run of sweep_tpp x N tokens,
    # or as long as the first branch.
    def sweep_runs(point, value):
        c, cfg = points[point]
        tpp, stable, decay = branches(c)[0]
        steps = stable + decay
        if preset["sweep_tpp"] is not None:
            steps = max(2, math.ceil(preset["sweep_tpp"] * compute_active(c[2]) / step))
        name = f"sweep-{point[0]}-{c[0]}-{lr['key']}{value:g}"
        run = dict(common, **model_settings(cfg), max_steps=steps, eval_interval=steps,
                   decay_fraction=preset["decay_share"], **{lr["key"]: value})
        return [RunSpec(name + (f"-s{seed}" if lr["seeds"] > 1 else ""), dict(run, seed=seed),
                        meta(c, point[0], cfg, seed, value))
                for seed in preset["seeds"][:lr["seeds"]]]

    specs, best, rows = lr_sweep(preset, points, sweep_runs, results, where)
    if best is None:
        return specs, None
    # The twin runs the first seed only, unless seed_twins.
    # Baseline and twin of a seed read the same tokens.
    twins = preset["seeds"] if preset["seed_twins"] else preset["seeds"][:1]
    for c in grid:
        for arch, cfg in zip(ARCHS, c[2:4]):
            value, plan_ = best[arch, c[1] if where else grid[0][1]], branches(c)
            for seed in preset["seeds"] if arch == "baseline" else twins:
                stable, last = f"{arch}-{c[0]}-s{seed}-stable", plan_[-1][1]
                run = dict(common, **model_settings(cfg), seed=seed, max_steps=last,
                           save_steps=[s for _, s, _ in plan_], **{lr["key"]: value},
                           eval_interval=max(1, last // 8))
                specs.append(RunSpec(stable, run, meta(c, arch, cfg, seed, value, role="stable")))
                for tpp, s, decay in plan_:
                    run = dict(decay_tokens=decay * step, eval_interval=max(1, decay // 4),
                               save_steps=[])
                    m = meta(c, arch, cfg, seed, value, branch_tpp=tpp, branch_step=s)
                    specs.append(RunSpec(f"{arch}-{c[0]}-s{seed}-b{tpp:g}", run, m,
                                         needs=(stable, s)))
    return specs, rows


def rows(specs, results):
    """runs.csv: a row per finished decay branch."""
    branches = []
    for s in (s for s in specs if s.needs and s.run_id in results):
        # The epochs of the stable region read by the branch point.
        stable = results[s.needs[0]]
        epochs = stable.get("epochs", 0) * s.needs[1] / stable["step"]
        branches.append(replace(s, meta=dict(s.meta, epochs=epochs)))
    return run_rows(branches, results, COLUMNS, sources=True)


def f_levels(F):
    """[(lowest, highest)] per level of per-token FLOPs."""
    levels = []
    for f in sorted(float(v) for v in F):
        if levels and f <= F_LEVEL * levels[-1][1]:
            levels[-1][1] = f
        else:
            levels.append([f, f])
    return [tuple(level) for level in levels]


def columns(rows, arch):
    keys = ("F", "S", "D", "loss")
    return [np.array([r[k] for r in rows if r["arch"] == arch], dtype=float) for k in keys]


def identified(rows, arch, full):
    """Is the [S2] surface of arch identified? -> (why not, its readings)."""
    # The profile of a: the surface refitted
    # with a held at each value.
    F, S, D, loss = columns(rows, arch)
    profile = sorted([(a, fit.fit_surface(F, S, D, loss, fixed_exponents=(a, None, None)))
                      for a in map(float, PROFILE_A)] + [(full.a, full)], key=lambda p: p[0])
    # The interval: where the objective stays within bound.
    objective = np.array([f.objective for _, f in profile])
    bound = profile_bound(full.objective, full.n_points)
    lo, hi, at_edge = profile_interval([a for a, _ in profile], objective, bound)
    inside = [f for _, f in profile if f.objective <= objective.min() + bound]
    E, c = [f.E for f in inside], [f.c for f in inside]
    n = len(f_levels(F))
    # E >= 0 is the fit's bound:
    # a floor from 0 up is not measured.
    why = ([f"F at {n} levels"] if n < IDENTIFYING_F_LEVELS else []) + \
        (["a's interval reaches an end of those tried"] if at_edge else []) + \
        (["E reaches 0 along it"] if min(E) < E_RESOLVED else [])
    return why, (lo, hi), (min(E), max(E)), (min(c), max(c)), [f.c for _, f in profile], bound


def report(preset, rows, sweep):
    grid = cells(preset)
    groups = {}
    for r in rows:
        if r["arch"] == "baseline":
            groups.setdefault((r["cell"], r["branch_tpp"]), []).append(r["loss"])
    # The baseline's seeds all ran.
    sigma, dof = pooled_std(groups.values())
    lines = [f"== {preset['name']}: [S] SMELT vs its matched baseline, {len(grid)} cells"]
    if sweep:
        # The noise of a difference of two values' losses.
        noise = sigma and sigma * math.sqrt(2 / preset["lr"]["seeds"])
        lines += sweep_lines(sweep, noise) + [gate_line(sweep)]
    # How closely each twin matches its baseline.
    lines += ["matching ([S] Table 10 ratios, SMELT / baseline; match.match accepts F in [1, 1.05] "
              "x, N within 1.5% and KV within 4%)",
              f"  {'cell':<12} {'baseline H/E/kv':>16} {'SMELT H/E/kv':>14} "
              f"{'F':>7} {'N':>7} {'KV':>7} {'S_base':>7} {'S_smelt':>7}"]
    for name, _, b, t, rep in grid:
        r = rep["ratios"]
        lines.append(f"  {name:<12} {f'{b.n_embd}/{b.n_expert}/{b.n_kv_head}x{b.head_dim}':>16} "
                     f"{f'{t.n_embd}/{t.n_expert}/{t.n_kv_head}x{t.head_dim}':>14} "
                     f"{r['flops']:7.4f} {r['params']:7.4f} {r['kv']:7.4f} "
                     f"{rep['sparsity_baseline']['S']:7.3f} {rep['sparsity_matched']['S']:7.3f}")
    if not rows:
        return lines + ["no finished decay branches yet"]
    # The losses per cell and branch.
    tpps = sorted({r["branch_tpp"] for r in rows})

    def mean(arch, cell, tpp):
        at = [r["loss"] for r in rows
              if (r["arch"], r["cell"], r["branch_tpp"]) == (arch, cell, tpp)]
        return fmt(np.mean(at or [np.nan]), ".4f")
    lines += ["final loss at each branch, the mean over seeds: baseline / SMELT",
              f"  {'cell':<12} " + " ".join(f"{f'TPP {t:g}':>15}" for t in tpps)]
    lines += [f"  {n:<12} " + " ".join(f"{mean('baseline', n, t):>7}/{mean('smelt', n, t):<7}"
                                      for t in tpps) for n, *_ in grid]
    return lines + pair_lines(rows, sigma, dof) + surface_lines(preset, rows)


def pair_lines(rows, sigma, dof):
    """SMELT minus baseline per pair, against its noise."""
    by, pairs = pairs_of(rows)
    # How many pairs SMELT wins, by a loss column.
    def wins(key):
        return f"{sum(t[key] < b[key] for _, t, b in pairs)}/{len(pairs)}"
    diffs, own = {}, {}
    for (arch, cell, tpp, _), r in by.items():
        own.setdefault(arch, {}).setdefault((cell, tpp), []).append(r["loss"])
        if arch == "smelt" and ("baseline", cell, tpp, _) in by:
            d = r["loss"] - by["baseline", cell, tpp, _]["loss"]
            diffs.setdefault((cell, tpp), []).append(d)
    # The spread of the pairs' own differences.
    paired_sd, paired_dof = pooled_std(diffs.values())
    sources = ", ".join(f"{k[5:]} {wins(k)}" for k in rows[0] if k.startswith("loss_"))
    lines = [spreads({a: list(g.values()) for a, g in own.items()})
             + f"; each pair's difference (paired by seed): {fmt(paired_sd, '.4f')} "
             f"({paired_dof} dof)",
             f"pairs (same cell, branch and seed) where SMELT's loss is lower: {wins('loss')}; "
             "by validation source: " + sources]
    if not pairs or not sigma:
        return lines
    # With one twin seed, the twin's spread is not measured.
    s2 = paired_sd if paired_dof else math.sqrt(2) * sigma
    why = ("the pairs' own spread" if paired_dof
           else "sqrt(2) x the baseline's pooled std: one twin seed")
    lines.append(f"SMELT minus baseline per pair, in sigma_diff = {s2:.4f} nats ({why})")
    # L8w72-e16 -> L8w72
    def scale(cell):
        return cell.rsplit("-", 1)[0]
    # The pairs per scale, in units of their noise.
    for sc in dict.fromkeys(scale(c) for c, *_ in pairs):
        d = np.array([t["loss"] - b["loss"] for c, t, b in pairs if scale(c) == sc])
        lines.append(f"  {sc:>8}: SMELT lower in {(d < 0).sum()}/{len(d)}, median "
                     f"{np.median(d):+.4f} ({np.median(d) / s2:+.1f} sigma_diff), "
                     f"{d.min():+.4f}..{d.max():+.4f}; beyond +2 sigma_diff "
                     f"{(d > 2 * s2).sum()}, beyond -2 {(d < -2 * s2).sum()}")
    cell, lo, hi = over_cells(pairs)
    if len(cell) > 1:
        lines.append(f"  the mean over the {len(cell)} cells (each its branches' mean): "
                     f"{cell.mean():+.4f} [95% t-interval over cells {lo:+.4f}, {hi:+.4f}]")
    # A decay branch with more tokens should end lower.
    series = {}
    for r in rows:
        series.setdefault((r["arch"], r["cell"], r["seed"]), []).append((r["D"], r["loss"]))
    falls = sum(all(b[1] < a[1] for a, b in zip(v, v[1:])) for v in map(sorted, series.values()))
    return lines + [f"the loss falls with each branch's tokens D in {falls} of {len(series)} "
                    "stable runs"]


def pairs_of(rows):
    """The pairs [(cell, twin, base)]: same cell, branch and seed."""
    by = {(r["arch"], r["cell"], r["branch_tpp"], r["seed"]): r for r in rows}
    return by, [(k[1], by[("smelt",) + k[1:]], r) for k, r in by.items()
                if k[0] == "baseline" and ("smelt",) + k[1:] in by]


def over_cells(pairs):
    """Each cell's mean of SMELT minus baseline, and their t-interval."""
    names = dict.fromkeys(c for c, *_ in pairs)
    cell = np.array([np.mean([t["loss"] - b["loss"] for c, t, b in pairs if c == name])
                     for name in names])
    if len(cell) < 2:
        return cell, np.nan, np.nan
    return (cell, *t_interval(cell.mean(), cell.std(ddof=1), len(cell), len(cell) - 1))


def summary(preset, rows, sweep=None):
    """The README figure's row: the baseline minus its SMELT twin."""
    cell, lo, hi = over_cells(pairs_of(rows)[1])
    return [(f"{preset['name']}: SMELT's twin vs its matched baseline", -cell.mean(), -hi, -lo)]


def surface_lines(preset, rows):
    """The [S2] surfaces; CE Gain [S5] and TPP [S3]."""
    # The sparsities and F levels the grid spans.
    S = sorted({round(r["S"], 3) for r in rows if r["arch"] == "baseline"})
    F = {a: columns(rows, a)[0] for a in ARCHS}
    spans = ", ".join(f"{F[a].max() / F[a].min():.2f}x at {len(f_levels(F[a]))} levels ({a})"
                      for a in ARCHS)
    lines = [f"grid: S {min(r['S'] for r in rows):.3f}..{max(r['S'] for r in rows):.3f}, D "
             f"{min(r['D'] for r in rows):.3g}..{max(r['D'] for r in rows):.3g} tokens, F spans "
             f"{spans} (values within {F_LEVEL:g}x of the next lower: one level)",
             "[S2] L = E + A (1-S)^b / F^a + K / D^c (Huber on log-loss); identified: F at >= "
             f"{IDENTIFYING_F_LEVELS} levels, a's 95% profile interval (refits at "
             f"{len(PROFILE_A)} values {PROFILE_A[0]:g}..{PROFILE_A[-1]:g}) inside them, "
             f"the floor E above {E_RESOLVED:g} along it",
             f"  {'arch':>9} {'E':>8} {'A':>10} {'a':>7} {'b':>7} {'K':>10} {'c':>7} "
             f"{'gamma':>7} {'rmse':>8} {'pts':>4}"]
    # A full fit per architecture, then its profile.
    fits, why = {}, {}
    for arch in ARCHS:
        try:
            fits[arch] = f = fit.fit_surface(*columns(rows, arch))
        # Too few points for six coefficients.
        except ValueError as e:
            return lines + [f"  {arch}: {e}"]
        why[arch], (lo, hi), E, c, c_all, bound = identified(rows, arch, f)
        verdict = f"NOT identified ({'; '.join(why[arch])})" if why[arch] else "identified"
        lines += [f"  {arch:>9} {f.E:8.4f} {f.A:10.4g} {f.a:7.4f} {f.b:7.4f} {f.K:10.4g} "
                  f"{f.c:7.4f} {f.gamma:7.4f} {f.rmse:8.5f} {f.n_points:4d}",
                  f"  {'':>9} a in [{lo:.3g}, {hi:.3g}], along it E {E[0]:.2f}..{E[1]:.2f} "
                  f"and c {c[0]:.3f}..{c[1]:.3f} (c {min(c_all):.3f}..{max(c_all):.3f} over "
                  f"every a); objective within {bound:.2g} of its lowest: {verdict}"]
    if any(why.values()):
        return lines + ["[S5] CE Gain and [S3] TPP: not reported (a surface is not identified)"]
    # Two budgets inside the measured range.
    C = np.array([r["C"] for r in rows])
    budgets = [float(np.exp(np.log([C.min(), C.max()]).mean())), float(C.max())]
    runs = {k: [r[k] for r in rows] for k in ("arch", "cell", "F", "S", "D", "loss")}
    boot = fit.cell_bootstrap(runs, "baseline", "smelt", budgets, S, n_draws=preset["bootstrap"],
                              seed=1337, full_fits=fits, progress=False)
    lines.append(f"cell bootstrap: {preset['bootstrap']} draws ({boot['n_failed']} "
                 "underdetermined, left out), 95% intervals")
    # The bootstrap's coefficients, then the readings.
    v, lo, hi = boot["value"], boot["lo"], boot["hi"]
    for k in ("E", "A", "a", "b", "K", "c", "gamma"):
        lines.append(f"  {k:>5}: " + ", ".join(
            f"{a} {v[f'{r}.{k}']:.4g} [{lo[f'{r}.{k}']:.4g}, {hi[f'{r}.{k}']:.4g}]"
            for r, a in zip(("ref", "target"), ARCHS)))
    for key, name in (("ce_gain", "[S5] CE Gain of SMELT"), ("ref.tpp", "[S3] TPP, baseline"),
                      ("target.tpp", "[S3] TPP, SMELT")):
        lines += [f"  {name} at C={c:.3g} S={s:.3f}: {v[key][i, j]:+.4f} "
                  f"[{lo[key][i, j]:+.4f}, {hi[key][i, j]:+.4f}]"
                  for i, c in enumerate(budgets) for j, s in enumerate(S)]
    return lines


def figures(preset, rows, path, out=None):
    """The largest scale's runs, from OUT's logs."""
    if out is None or not rows:
        return []
    # The largest cell, by its per-token FLOPs.
    top, curves = max(rows, key=lambda r: r["F"])["cell"], {}
    for r in sorted(rows, key=lambda r: (r["arch"], r["D"])):
        if r["cell"] == top and r["seed"] == rows[0]["seed"]:
            stable = r["run_id"].rsplit("-b", 1)[0] + "-stable"
            for name, label in ((stable, "stable"), (r["run_id"], f"TPP {r['branch_tpp']:g}")):
                log = plots.read_log(os.path.join(out, "runs", name, "log.jsonl"))
                curves[f"{r['arch']} {label}"] = ([e["tokens"] for e in log],
                                                  [e["val_loss"] for e in log])
    title = f"{preset['name']}: the stable runs and their decay branches ({top}, the first seed)"
    drawn = plots.plot_loss_curves(curves, path("decay_branches.png"), title)
    return [path("decay_branches.png")] if drawn else []
