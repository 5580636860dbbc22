"""[S] SMELT grid (kind "smelt"): every (scale, sparsity) cell has a MoE baseline and its SMELT twin
matched by match.match; a WSD stable run per seed saving a checkpoint at each branch point, a decay branch
from each. The report: the matching, the pairs against the seed noise, one [S2] surface per architecture and
whether the grid identifies it (a profile in a), and only where it does CE Gain [S5] and TPP with
cell-bootstrap intervals."""

import functools
import json
import math
import os

import numpy as np

import fit
import match
import plots
from data.loader import BRANCH_FRACTION
from ladders.runs import RunSpec
from ladders.stats import fmt, pooled_std, profile_bound, profile_interval, spreads, t_interval
from ladders.sweep import gate_line, lr_sweep, sweep_lines
from model import ModelConfig

ARCHS = ("baseline", "smelt")
COLUMNS = ("arch", "cell", "seed", "branch_tpp", "branch_step", "F", "S", "D", "C", "loss", "N", "tpp",
           "epochs", "n_layer", "n_embd", "n_expert", "run_id", "seconds")
PROFILE_A = np.geomspace(0.01, 10.0, 31)  # the values of a the identifiability profile refits the surface at
F_LEVEL = 1.25  # per-token FLOPs less than 25% above the next lower value are one level of F
IDENTIFYING_F_LEVELS = 4  # more levels of F than the E, A and a of the surface's F term
E_RESOLVED = 1e-3  # nats: a floor E below this along the profile of a is the fit's bound (E >= 0)


def model_settings(cfg):
    """A ModelConfig as train.py's model settings, plain ints (the vocabulary comes from the data)."""
    import train
    plain = lambda v: int(v) if isinstance(v, int) and not isinstance(v, bool) else v  # noqa: E731
    return {k: plain(getattr(cfg, k)) for k in train.MODEL_SETTINGS}


def vocab(preset):
    """The vocabulary the ladder's models are accounted and matched with: the tokenizer's own (train.py pads
    the embedding to a multiple of 64 rows; the same rows in every model of a grid)."""
    from data.loader import get_tokenizer
    tok = get_tokenizer(preset["tokenizer"])
    return dict(vocab_size=tok.n_vocab, eot_token=tok.eot_token)


def compute_active(cfg):
    """N: the non-embedding parameters one token's compute runs through ([X10]'s N_c without the lm head)."""
    return match.accounting(cfg)["params_compute_active"] - cfg.vocab_size * cfg.n_embd


def cells(preset):
    """[(cell, scale, baseline ModelConfig, SMELT twin, match report)] of every (scale, experts) cell."""
    return _cells(json.dumps([preset[k] for k in ("tokenizer", "model", "scales", "cells", "match")]))


@functools.lru_cache(maxsize=None)
def _cells(key):
    tokenizer, model, scales, grid, options = json.loads(key)
    out = []
    for scale, n_expert in grid:
        shape = dict(model, **scales[scale], n_expert=n_expert)
        base = ModelConfig(**vocab(dict(tokenizer=tokenizer)), **shape)
        twin, report = match.match(base, "smelt", **{k: tuple(v) if isinstance(v, list) else v
                                                     for k, v in options.items()})
        out.append((f"{scale}-e{n_expert}", scale, base, twin, report))
    return out


def plan(preset, results, train_tokens=None):
    """Every run the grid needs given the results so far -> (specs, lr_sweep.csv's rows or None): the LR
    sweep (each arch at the first cell, or with every_point at every scale's first), then per cell and arch a
    stable run per seed (the twin: the first seed, or every one with seed_twins) and its decay branches;
    baseline and twin of a seed read the same tokens. train_tokens: the train split's (a branch reads its
    held-back tail once at most)."""
    lr, t, block = preset["lr"], preset["train"], preset["model"]["block_size"]
    seqs = t.get("global_batch") or t["batch_size"]
    grid, first, where = cells(preset), {}, "scale" if lr["every_point"] else None
    for c in grid:
        first.setdefault(c[1], c)
    points = {(a, c[1]): (c, cfg) for c in (first.values() if where else grid[:1])
              for a, cfg in zip(ARCHS, c[2:4])}
    common = dict(t, decay_fraction=0.0)

    def meta(c, arch, cfg, seed, value, **more):
        return dict(arch=arch, cell=c[0], seed=seed, S=match.sparsity(cfg, baseline=c[2])["S"],
                    N=compute_active(c[2]), n_layer=cfg.n_layer, n_embd=cfg.n_embd, n_expert=cfg.n_expert,
                    F=match.flops_per_token(cfg), grid_lr=value, **more)

    def branches(c):  # [(TPP, its stable steps, its decay steps)]: TPP x N tokens, the last share decaying
        out = []
        for tpp in preset["branch_tpp"]:
            total = tpp * compute_active(c[2]) / (seqs * block)
            decay = max(1, math.ceil(preset["decay_share"] * total))
            if train_tokens:
                decay = min(decay, (int(BRANCH_FRACTION * train_tokens) - 1) // block // seqs)
            out.append((tpp, max(1, math.ceil(total) - decay), decay))
        return out

    def sweep_runs(point, value):  # one WSD run of sweep_tpp x N tokens (default: the first branch's)
        c, cfg = points[point]
        tpp, stable, decay = branches(c)[0]
        steps = stable + decay if preset["sweep_tpp"] is None else max(2, math.ceil(
            preset["sweep_tpp"] * compute_active(c[2]) / (seqs * block)))
        name = f"sweep-{point[0]}-{c[0]}-{lr['key']}{value:g}"
        return [RunSpec(name + (f"-s{seed}" if lr["seeds"] > 1 else ""),
                        dict(common, **model_settings(cfg), seed=seed, max_steps=steps, eval_interval=steps,
                             decay_fraction=preset["decay_share"], **{lr["key"]: value}),
                        meta(c, point[0], cfg, seed, value)) for seed in preset["seeds"][:lr["seeds"]]]

    specs, best, rows = lr_sweep(preset, points, sweep_runs, results, where)
    if best is None:
        return specs, None
    for c in grid:
        for arch, cfg in zip(ARCHS, c[2:4]):
            value, plan_ = best[arch, c[1] if where else grid[0][1]], branches(c)
            seeds = preset["seeds"] if arch == "baseline" or preset["seed_twins"] else preset["seeds"][:1]
            for seed in seeds:
                stable, last = f"{arch}-{c[0]}-s{seed}-stable", plan_[-1][1]
                specs.append(RunSpec(stable, dict(common, **model_settings(cfg), seed=seed, max_steps=last,
                                                  save_steps=[s for _, s, _ in plan_], **{lr["key"]: value},
                                                  eval_interval=max(1, last // 8)),
                                     meta(c, arch, cfg, seed, value, role="stable")))
                specs += [RunSpec(f"{arch}-{c[0]}-s{seed}-b{tpp:g}",
                                  dict(decay_tokens=decay * seqs * block, eval_interval=max(1, decay // 4),
                                       save_steps=[]),
                                  meta(c, arch, cfg, seed, value, branch_tpp=tpp, branch_step=s),
                                  needs=(stable, s))
                          for tpp, s, decay in plan_]
    return specs, rows


def rows(specs, results):
    """runs.csv: a row per finished decay branch (F as train.py counted it; D: its stable part + decay)."""
    out = []
    for s in specs:
        r = results.get(s.run_id)
        if s.needs and r:
            stable = results[s.needs[0]]  # the epochs of the stable region read by the branch point
            epochs = stable.get("epochs", 0) * s.needs[1] / stable["step"]
            row = dict(s.meta, F=r["flops"] / r["tokens"], D=r["tokens"], C=r["flops"], loss=r["val_loss"],
                       tpp=r["tokens"] / s.meta["N"], epochs=epochs, run_id=s.run_id, seconds=r["seconds"])
            sources = {f"loss_{k}": v for k, v in (r["val_loss_by_source"] or {}).items()}
            out.append({k: row[k] for k in COLUMNS} | sources)
    return out


def f_levels(F):
    """The levels of per-token FLOPs: sorted values, a new level wherever one is more than F_LEVEL x the one
    below -> [(lowest, highest)] per level."""
    levels = []
    for f in sorted(float(v) for v in F):
        if levels and f <= F_LEVEL * levels[-1][1]:
            levels[-1][1] = f
        else:
            levels.append([f, f])
    return [tuple(level) for level in levels]


def columns(rows, arch):
    return [np.array([r[k] for r in rows if r["arch"] == arch], dtype=float) for k in ("F", "S", "D", "loss")]


def identified(rows, arch, full):
    """Is the [S2] surface of arch identified? F at IDENTIFYING_F_LEVELS levels or more, the 95% profile
    interval of a (the surface refitted with a held at each of PROFILE_A) inside the values tried, and the
    floor E of the fits inside it above E_RESOLVED (E >= 0 is the fit's bound: a floor anywhere from 0 up is
    not measured) -> (why not: [] when identified, a's interval, E and c inside it, c over every a, bound)."""
    F, S, D, loss = columns(rows, arch)
    profile = sorted([(float(a), fit.fit_surface(F, S, D, loss, fixed_exponents=(float(a), None, None)))
                      for a in PROFILE_A] + [(full.a, full)], key=lambda p: p[0])
    objective = np.array([f.objective for _, f in profile])
    bound = profile_bound(full.objective, full.n_points)
    lo, hi, at_edge = profile_interval([a for a, _ in profile], objective, bound)
    inside = [f for _, f in profile if f.objective <= objective.min() + bound]
    E, c = [f.E for f in inside], [f.c for f in inside]
    why = ([f"F at {len(f_levels(F))} levels"] if len(f_levels(F)) < IDENTIFYING_F_LEVELS else []) + \
        (["a's interval reaches an end of those tried"] if at_edge else []) + \
        (["E reaches 0 along it"] if min(E) < E_RESOLVED else [])
    return why, (lo, hi), (min(E), max(E)), (min(c), max(c)), [f.c for _, f in profile], bound


def report(preset, rows, sweep):
    """The report's lines from runs.csv's rows and lr_sweep.csv's."""
    grid = cells(preset)
    groups = {}
    for r in rows:
        if r["arch"] == "baseline":
            groups.setdefault((r["cell"], r["branch_tpp"]), []).append(r["loss"])
    sigma, dof = pooled_std(groups.values())
    lines = [f"== {preset['name']}: [S] SMELT vs its matched baseline, {len(grid)} cells"]
    if sweep:
        noise = sigma and sigma * math.sqrt(2 / preset["lr"]["seeds"])
        lines += sweep_lines(sweep, noise) + [gate_line(sweep)]
    lines += ["matching ([S] Table 10 ratios, SMELT / baseline; match.match accepts F in [1, 1.05] x, N "
              "within 1.5% and KV within 4%)", f"  {'cell':<12} {'baseline H/E/kv':>16} {'SMELT H/E/kv':>14} "
              f"{'F':>7} {'N':>7} {'KV':>7} {'S_base':>7} {'S_smelt':>7}"]
    for name, _, b, t, rep in grid:
        r = rep["ratios"]
        lines.append(f"  {name:<12} {f'{b.n_embd}/{b.n_expert}/{b.n_kv_head}x{b.head_dim}':>16} "
                     f"{f'{t.n_embd}/{t.n_expert}/{t.n_kv_head}x{t.head_dim}':>14} {r['flops']:7.4f} "
                     f"{r['params']:7.4f} {r['kv']:7.4f} {rep['sparsity_baseline']['S']:7.3f} "
                     f"{rep['sparsity_matched']['S']:7.3f}")
    if not rows:
        return lines + ["no finished decay branches yet"]
    tpps = sorted({r["branch_tpp"] for r in rows})

    def mean(arch, cell, tpp):
        at = [r["loss"] for r in rows if (r["arch"], r["cell"], r["branch_tpp"]) == (arch, cell, tpp)]
        return fmt(np.mean(at or [np.nan]), ".4f")
    lines += ["final loss at each branch, the mean over seeds: baseline / SMELT",
              f"  {'cell':<12} " + " ".join(f"{f'TPP {t:g}':>15}" for t in tpps)]
    lines += [f"  {name:<12} " + " ".join(f"{mean('baseline', name, t):>7}/{mean('smelt', name, t):<7}"
                                         for t in tpps) for name, *_ in grid]
    return lines + pair_lines(rows, sigma, dof) + surface_lines(preset, rows)


def pair_lines(rows, sigma, dof):
    """Per pair (same cell, branch and seed: the same tokens) SMELT minus baseline against its noise, the
    pairs' own spread where the twin has several seeds, else sqrt(2) x the baseline's pooled std (the twin's
    unmeasured), per scale; the mean over cells with its t-interval over cells."""
    by = {(r["arch"], r["cell"], r["branch_tpp"], r["seed"]): r for r in rows}
    pairs = [(k[1], by[("smelt",) + k[1:]], r) for k, r in by.items() if k[0] == "baseline"
             and ("smelt",) + k[1:] in by]
    wins = lambda key: f"{sum(t[key] < b[key] for _, t, b in pairs)}/{len(pairs)}"  # noqa: E731
    diffs, own = {}, {}
    for (arch, cell, tpp, _), r in by.items():
        own.setdefault(arch, {}).setdefault((cell, tpp), []).append(r["loss"])
        if arch == "smelt" and ("baseline", cell, tpp, _) in by:
            diffs.setdefault((cell, tpp), []).append(r["loss"] - by["baseline", cell, tpp, _]["loss"])
    paired_sd, paired_dof = pooled_std(diffs.values())
    lines = [spreads({a: list(g.values()) for a, g in own.items()}) + "; each pair's difference (paired by "
             f"seed): {fmt(paired_sd, '.4f')} ({paired_dof} dof)",
             f"pairs (same cell, branch and seed) where SMELT's loss is lower: {wins('loss')}; by validation "
             "source: " + ", ".join(f"{k[5:]} {wins(k)}" for k in rows[0] if k.startswith("loss_"))]
    if not pairs or not sigma:
        return lines
    s2 = paired_sd if paired_dof else math.sqrt(2) * sigma
    why = "the pairs' own spread" if paired_dof else "sqrt(2) x the baseline's pooled std: one twin seed"
    lines.append(f"SMELT minus baseline per pair, in sigma_diff = {s2:.4f} nats ({why})")
    scale = lambda cell: cell.rsplit("-", 1)[0]  # noqa: E731  (L8w72-e16 -> L8w72)
    for sc in dict.fromkeys(scale(c) for c, *_ in pairs):
        d = np.array([t["loss"] - b["loss"] for c, t, b in pairs if scale(c) == sc])
        lines.append(f"  {sc:>8}: SMELT lower in {(d < 0).sum()}/{len(d)}, median {np.median(d):+.4f} "
                     f"({np.median(d) / s2:+.1f} sigma_diff), {d.min():+.4f}..{d.max():+.4f}; beyond +2 "
                     f"sigma_diff {(d > 2 * s2).sum()}, beyond -2 {(d < -2 * s2).sum()}")
    cell, lo, hi = over_cells(pairs)
    if len(cell) > 1:
        lines.append(f"  the mean over the {len(cell)} cells (each its branches' mean): {cell.mean():+.4f} "
                     f"[95% t-interval over cells {lo:+.4f}, {hi:+.4f}]")
    series = {}
    for r in rows:
        series.setdefault((r["arch"], r["cell"], r["seed"]), []).append((r["D"], r["loss"]))
    falls = sum(all(b[1] < a[1] for a, b in zip(v, v[1:])) for v in map(sorted, series.values()))
    return lines + [f"the loss falls with each branch's tokens D in {falls} of {len(series)} stable runs"]


def over_cells(pairs):
    """SMELT minus baseline, each cell's mean over its pairs -> (the cells' means, the 95% t-interval of their
    mean over cells)."""
    cell = np.array([np.mean([t["loss"] - b["loss"] for c, t, b in pairs if c == name])
                     for name in dict.fromkeys(c for c, *_ in pairs)])
    if len(cell) < 2:
        return cell, np.nan, np.nan
    return (cell, *t_interval(cell.mean(), cell.std(ddof=1), len(cell), len(cell) - 1))


def summary(preset, rows, sweep=None):
    """The README figure's row: the baseline minus its SMELT twin (+ where SMELT pays), over the cells."""
    by = {(r["arch"], r["cell"], r["branch_tpp"], r["seed"]): r for r in rows}
    cell, lo, hi = over_cells([(k[1], by[("smelt",) + k[1:]], r) for k, r in by.items()
                               if k[0] == "baseline" and ("smelt",) + k[1:] in by])
    return [(f"{preset['name']}: SMELT's twin vs its matched baseline", -cell.mean(), -hi, -lo)]


def surface_lines(preset, rows):
    """The [S2] surfaces, whether the grid identifies them, and where it identifies both, CE Gain [S5] and TPP
    [S3] at two budgets inside the measured range with the cell bootstrap's 95% intervals."""
    S = sorted({round(r["S"], 3) for r in rows if r["arch"] == "baseline"})
    F = {a: columns(rows, a)[0] for a in ARCHS}
    lines = [f"grid: S {min(r['S'] for r in rows):.3f}..{max(r['S'] for r in rows):.3f}, D "
             f"{min(r['D'] for r in rows):.3g}..{max(r['D'] for r in rows):.3g} tokens, F spans "
             + ", ".join(f"{F[a].max() / F[a].min():.2f}x at {len(f_levels(F[a]))} levels ({a})"
                         for a in ARCHS) + f" (values within {F_LEVEL:g}x of the next lower: one level)",
             "[S2] L = E + A (1-S)^b / F^a + K / D^c (Huber on log-loss); identified: F at >= "
             f"{IDENTIFYING_F_LEVELS} levels, a's 95% profile interval (refits at {len(PROFILE_A)} values "
             f"{PROFILE_A[0]:g}..{PROFILE_A[-1]:g}) inside them, the floor E above {E_RESOLVED:g} along it",
             f"  {'arch':>9} {'E':>8} {'A':>10} {'a':>7} {'b':>7} {'K':>10} {'c':>7} {'gamma':>7} "
             f"{'rmse':>8} {'pts':>4}"]
    fits, why = {}, {}
    for arch in ARCHS:
        try:
            fits[arch] = f = fit.fit_surface(*columns(rows, arch))
        except ValueError as e:  # too few points for its six coefficients
            return lines + [f"  {arch}: {e}"]
        why[arch], (lo, hi), E, c, c_all, bound = identified(rows, arch, f)
        verdict = f"NOT identified ({'; '.join(why[arch])})" if why[arch] else "identified"
        lines += [f"  {arch:>9} {f.E:8.4f} {f.A:10.4g} {f.a:7.4f} {f.b:7.4f} {f.K:10.4g} {f.c:7.4f} "
                  f"{f.gamma:7.4f} {f.rmse:8.5f} {f.n_points:4d}",
                  f"  {'':>9} a in [{lo:.3g}, {hi:.3g}], along it E {E[0]:.2f}..{E[1]:.2f} and c {c[0]:.3f}.."
                  f"{c[1]:.3f} (c {min(c_all):.3f}..{max(c_all):.3f} over every a); objective within "
                  f"{bound:.2g} of its lowest: {verdict}"]
    if any(why.values()):
        return lines + ["[S5] CE Gain and [S3] TPP: not reported (a surface is not identified)"]
    C = np.array([r["C"] for r in rows])
    budgets = [float(np.exp(np.log([C.min(), C.max()]).mean())), float(C.max())]
    runs = {k: [r[k] for r in rows] for k in ("arch", "cell", "F", "S", "D", "loss")}
    boot = fit.cell_bootstrap(runs, "baseline", "smelt", budgets, S, n_draws=preset["bootstrap"], seed=1337,
                              full_fits=fits, progress=False)
    lines.append(f"cell bootstrap: {preset['bootstrap']} draws ({boot['n_failed']} underdetermined, left "
                 "out), 95% intervals")
    v, lo, hi = boot["value"], boot["lo"], boot["hi"]
    for k in ("E", "A", "a", "b", "K", "c", "gamma"):
        lines.append(f"  {k:>5}: " + ", ".join(
            f"{a} {v[f'{r}.{k}']:.4g} [{lo[f'{r}.{k}']:.4g}, {hi[f'{r}.{k}']:.4g}]"
            for r, a in zip(("ref", "target"), ARCHS)))
    for key, name in (("ce_gain", "[S5] CE Gain of SMELT"), ("ref.tpp", "[S3] TPP, baseline"),
                      ("target.tpp", "[S3] TPP, SMELT")):
        lines += [f"  {name} at C={c:.3g} S={s:.3f}: {v[key][i, j]:+.4f} [{lo[key][i, j]:+.4f}, "
                  f"{hi[key][i, j]:+.4f}]" for i, c in enumerate(budgets) for j, s in enumerate(S)]
    return lines


def figures(preset, rows, path, out=None):
    """The stable runs and decay branches of the largest scale's first seed (a ladder's own OUT: the logs)."""
    if out is None or not rows:
        return []
    top, curves = max(rows, key=lambda r: r["F"])["cell"], {}
    for r in sorted(rows, key=lambda r: (r["arch"], r["D"])):
        if r["cell"] == top and r["seed"] == rows[0]["seed"]:
            stable = r["run_id"].rsplit("-b", 1)[0] + "-stable"
            for name, label in ((stable, "stable"), (r["run_id"], f"TPP {r['branch_tpp']:g}")):
                log = plots.read_log(os.path.join(out, "runs", name, "log.jsonl"))
                curves[f"{r['arch']} {label}"] = ([e["tokens"] for e in log], [e["val_loss"] for e in log])
    title = f"{preset['name']}: the stable runs and their decay branches ({top}, the first seed)"
    drawn = plots.plot_loss_curves(curves, path("decay_branches.png"), title)
    return [path("decay_branches.png")] if drawn else []
