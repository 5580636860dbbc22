"""[S] SMELT grid (kind "smelt"): every (scale, sparsity) cell has a MoE baseline and its SMELT twin matched
by match.match; a WSD stable run per seed, a decay branch from each of its checkpoints; one [S2] surface
per architecture and whether the grid identifies it (a profile in a), CE Gain [S5] and TPP with cell-bootstrap
intervals where it does, the per-pair wins and differences, the claims table."""

import json
import math
import os

import numpy as np

import fit
import match
import train
from ladders.common import (compute_active, finite_or_none, fmt, model_settings, sources_of, sources_of_rows,
                            sweep_point, sweep_values, tokens_per_step)
from ladders.stats import (claims_lines, difference_sigma, interval_verdict, profile_bound, profile_interval,
                           seed_spread, t_interval, within_noise)
from ladders.presets import SEEDS
from model import ModelConfig
from tooling import plots
from tooling.jobs import RunSpec

PROFILE_A = np.geomspace(0.01, 10.0, 31)  # the values of a the identifiability profile refits the surface at
F_LEVEL = 1.25  # per-token FLOPs less than 25% above the next lower value are one level of F
IDENTIFYING_F_LEVELS = 4  # more levels of F than the E, A and a of the surface's F term need
E_RESOLVED = 1e-3  # nats: a floor E below this along the profile of a is the fit's bound (E >= 0), not a measurement


def smelt_cells(preset):
    """[(cell name, baseline ModelConfig, SMELT twin ModelConfig, match report)] for every cell."""
    cells = []
    for scale, n_expert in preset.cells:
        if scale not in preset.scales:
            raise ValueError(f"preset {preset.name}: cell ({scale}, {n_expert}) names an unknown scale; "
                             f"scales are {sorted(preset.scales)}")
        baseline = ModelConfig.from_dict(dict(preset.model, **preset.scales[scale], n_expert=n_expert))
        try:
            twin, report = match.match(baseline, preset.recipe, **preset.match_kwargs)
        except ValueError as e:
            raise ValueError(f"preset {preset.name}, cell {scale}-e{n_expert}: {e}") from None
        cells.append((f"{scale}-e{n_expert}", baseline, twin, report))
    return cells


def smelt_branch_plan(preset, cfg, data, world=None):
    """[(TPP, stable steps before the branch, decay tokens)] of one cell: the branch's total tokens are
    TPP x N (N of the baseline: the twin is matched to it), the last decay_share of them decay, capped
    to what the held-back data holds (a branch never rereads it)."""
    step_tokens = tokens_per_step(preset, world)
    n = compute_active(cfg)
    plan = []
    for tpp in preset.branch_tpp:
        total = tpp * n
        decay_steps = max(1, math.ceil(preset.decay_share * total / step_tokens))
        if data.branch_tokens:
            decay_steps = min(decay_steps, int(0.9 * data.branch_tokens) // step_tokens)
        stable = max(1, math.ceil(total / step_tokens) - decay_steps)  # whole steps, at least tpp x N tokens
        plan.append((tpp, stable, decay_steps * step_tokens))
    return plan


def smelt_specs(preset, cells, data, lrs=None, world=None):
    """Per cell and architecture (the baseline with every seed, the twin with the first, or every one with
    seed_every_arch): one stable run saving checkpoints at the branch points, then one decay branch per
    checkpoint. Baseline and twin of a seed share batch and data order: the same token sequence. Without lrs:
    the LR sweep runs only (at the first cell, or with lr_sweep.at_every_depth at each scale's first cell)."""
    key, values = sweep_values(preset)
    common = dict(preset.train, decay_fraction=0.0)
    step_tokens = tokens_per_step(preset, world)
    specs, swept = [], set()
    for (cell, baseline, twin, _), (scale, _) in zip(cells, preset.cells):
        attended = match.resolve_attended(baseline)
        plan = smelt_branch_plan(preset, baseline, data, world)
        steps = [s for _, s, _ in plan]
        sweeps_here = key is not None and scale not in swept and (not swept or preset.lr_sweep.at_every_depth)
        swept.add(scale)
        for arch, cfg in (("baseline", baseline), ("smelt", twin)):
            F = train.flops_per_token(cfg)
            meta = dict(F=F, S=match.sparsity(cfg, attended, baseline=baseline)["S"], N=compute_active(baseline),
                        N_s=match.accounting(cfg)["params_stored"], n_layer=cfg.n_layer, n_embd=cfg.n_embd,
                        n_expert=cfg.n_expert, layout=cfg.layout, scale=scale)
            if lrs is None:  # the sweep: one WSD run of sweep_tpp x N tokens (the first branch's) per value
                if sweeps_here:
                    specs += smelt_sweep_specs(preset, arch, cell, cfg, meta, plan, step_tokens, common)
                continue
            lr = {key: lrs[sweep_point(preset, arch, scale)]} if key else {}
            for seed in preset.seeds if arch == "baseline" or preset.seed_every_arch else preset.seeds[:1]:
                stable_id = f"{arch}-{cell}-s{seed}-stable"
                specs.append(RunSpec(stable_id, arch, cell, "stable",
                                     dict(common, **model_settings(cfg), **lr, seed=seed, max_steps=steps[-1],
                                          save_steps=steps, eval_interval=max(1, steps[-1] // 8)),
                                     dict(meta, seed=seed, tokens=steps[-1] * step_tokens,
                                          tpp=steps[-1] * step_tokens / meta["N"])))
                for tpp, step, decay in plan:
                    decay_steps = decay // step_tokens
                    specs.append(RunSpec(f"{arch}-{cell}-s{seed}-b{tpp:g}", arch, cell, "branch",
                                         dict(init_from=f"{{runs}}/{stable_id}/ckpt_step{step}.pt",
                                              decay_tokens=decay, eval_tokens=preset.train["eval_tokens"],
                                              eval_interval=max(1, decay_steps // 4)),
                                         dict(meta, seed=seed, branch_step=step, branch_tpp=tpp,
                                              tokens=step * step_tokens + decay,
                                              tpp=(step * step_tokens + decay) / meta["N"]),
                                         needs=stable_id))
    return specs


def smelt_sweep_specs(preset, arch, cell, cfg, meta, plan, step_tokens, common):
    """One architecture's sweep runs at a cell: every value x lr_sweep.seeds seeds, each one WSD run of
    sweep_tpp x N tokens (None: the first branch's), its last decay_share decaying."""
    key, values = sweep_values(preset)
    if preset.sweep_tpp is None:
        tpp, stable, decay = plan[0]
        total_steps = stable + decay // step_tokens
    else:
        tpp, total_steps = preset.sweep_tpp, max(2, math.ceil(preset.sweep_tpp * meta["N"] / step_tokens))
    seeds = SEEDS[:preset.lr_sweep.seeds]
    return [RunSpec(f"sweep-{arch}-{cell}-{key}{value:g}" + (f"-s{seed}" if len(seeds) > 1 else ""), arch, cell,
                    "sweep", dict(common, **model_settings(cfg), seed=seed, max_steps=total_steps,
                                  decay_fraction=preset.decay_share, eval_interval=total_steps, **{key: value}),
                    dict(meta, seed=seed, tpp=tpp, tokens=total_steps * step_tokens))
            for value in values for seed in seeds]


def smelt_rows(results):
    """One CSV row per finished decay branch: arch, cell, seed, F, S, D, C, loss (+ val loss per source)."""
    branch = [r for r in results if r and r["role"] == "branch"]
    sources = sources_of(branch)
    rows = []
    for r in branch:
        m = r["meta"]
        # F: the per-token training FLOPs train.py counted (= match.py's analytic F when the run was made)
        row = dict(arch=r["arch"], cell=r["cell"], seed=m["seed"], branch_tpp=m["branch_tpp"],
                   branch_step=m["branch_step"], F=r["flops"] / r["tokens"], S=m["S"], D=r["tokens"], C=r["flops"],
                   loss=r["val_loss"], N=m["N"], tpp=r["tokens"] / m["N"], epochs=m.get("epochs"),
                   n_layer=m["n_layer"], n_embd=m["n_embd"], n_expert=m["n_expert"], run_id=r["run_id"],
                   seconds=r["seconds"])
        for s in sources:
            row[f"loss_{s}"] = (r.get("val_loss_by_source") or {}).get(s)
        rows.append(row)
    return rows


def columns_to_arrays(rows, keys=("arch", "cell", "F", "S", "D", "loss")):
    return {k: np.asarray([r[k] for r in rows], dtype=object if k in ("arch", "cell") else float) for k in keys}


def default_budgets(C):
    """Two budgets inside the measured compute range: its geometric middle and its top."""
    C = np.asarray(C, dtype=float)
    return [float(np.exp(np.mean(np.log([C.min(), C.max()])))), float(C.max())]


def surface_bootstrap(runs, ref, target, budgets, sparsities, n_draws, seed=0, full_fits=None, progress=True):
    """fit.cell_bootstrap on a small grid: with few cells some draws leave a six-coefficient surface
    underdetermined; fit.cell_bootstrap leaves those out (counted here as "skipped")."""
    out = fit.cell_bootstrap(runs, ref, target, budgets, sparsities, n_draws=n_draws, seed=seed,
                             n_workers=1 if n_draws <= 50 else None, full_fits=full_fits, progress=progress)
    out["skipped"] = out["n_failed"]
    return out


def match_search(preset):
    """The match.MatchSearch of a preset's twins (its match_kwargs over the defaults)."""
    return match.MatchSearch(**{k: tuple(v) if isinstance(v, list) else v
                                for k, v in preset.match_kwargs.items()})


def match_table(cells, search=None):
    """[S] Table 10 style: per cell the baseline and its SMELT twin, F / N / KV ratios, sparsities.
    search: the match.MatchSearch the twins were found with, for the line saying its tolerances."""
    lines, records = [], []
    lines.append("matching ([S] Table 10 ratios: SMELT / baseline)")
    if search is not None:
        (f_lo, f_hi), n_tol, kv_tol = search.flops_tol, search.params_tol, search.kv_tol
        lines.append(f"  by construction: match.match accepts only a twin with F in [{1 - f_lo:.3f}, "
                     f"{1 + f_hi:.3f}] x, "
                     f"N within {100 * n_tol:.1f}% and KV within {100 * kv_tol:.1f}% of its baseline's, so these "
                     "ratios meet [S]'s by the matcher's tolerance, not as a finding")
    lines.append(f"  {'cell':<12} {'baseline H/E/kv':>16} {'SMELT H/E/kv':>14} {'F':>7} {'N':>7} {'KV':>7} "
                 f"{'S_base':>7} {'S_smelt':>7}")
    for name, b, t, rep in cells:
        r = rep["ratios"]
        s_b, s_t = rep["sparsity_baseline"]["S"], rep["sparsity_matched"]["S"]
        lines.append(f"  {name:<12} {f'{b.n_embd}/{b.n_expert}/{b.n_kv_head}x{b.head_dim}':>16} "
                     f"{f'{t.n_embd}/{t.n_expert}/{t.n_kv_head}x{t.head_dim}':>14} {r['flops']:7.4f} "
                     f"{r['params']:7.4f} {r['kv']:7.4f} {s_b:7.3f} {s_t:7.3f}")
        shape = lambda c, S: dict(n_embd=c.n_embd, n_expert=c.n_expert, n_head=c.n_head, n_kv_head=c.n_kv_head,
                                  head_dim=c.head_dim, S=S)
        records.append(dict(cell=name, ratios=r, baseline=shape(b, s_b), smelt=shape(t, s_t)))
    return lines, records


def pair_differences(rows, ref="baseline", target="smelt", key="loss"):
    """[(cell, branch TPP, seed, target's loss - ref's)] over the pairs: the same cell, branch and seed."""
    by = {(r["arch"], r["cell"], r["branch_tpp"], r["seed"]): r for r in rows}
    diffs = []
    for (a, cell, tpp, seed), r in by.items():
        other = by.get((target, cell, tpp, seed))
        if a == ref and other is not None and r.get(key) is not None and other.get(key) is not None:
            diffs.append((cell, tpp, seed, other[key] - r[key]))
    return diffs


def win_counts(rows, ref="baseline", target="smelt", key="loss"):
    """Pairs (same cell, branch and seed) where the target's loss is lower: (wins, pairs)."""
    diffs = pair_differences(rows, ref, target, key)
    return sum(d < 0 for *_, d in diffs), len(diffs)


def smelt_report(preset, cells, rows, n_boot, seed=0, progress=True, sweep=None):
    """LR sweep (sweep_table's (lines, table)), matching, seed spread, win counts and pair differences, both
    surfaces and whether the grid identifies them, CE Gain with cell-bootstrap intervals and TPP (only where
    identified), the claims table -> (text, dict, figure data)."""
    lines, out = [], {"preset": preset.name, "match": [], "fits": {}, "ce_gain": [], "tpp": [], "wins": {},
                      "seed_spread": {}}
    lines.append(f"== {preset.name}: [S] SMELT vs matched baseline ({len(cells)} cells)")
    if sweep:
        lines += sweep[0]
        out["lr_sweep"] = sweep[1]
    table, out["match"] = match_table(cells, match_search(preset))
    lines += table
    if not rows:
        lines.append("no finished decay branches yet")
        return "\n".join(lines), out, None
    lines += smelt_noise_lines(rows, out)
    runs = columns_to_arrays(rows)
    lines += grid_lines(rows, runs, out)
    fits = smelt_surfaces(runs, lines, out)
    if len(fits) < 2:
        lines.append("CE Gain and TPP need both surfaces; train more cells/branches")
        return "\n".join(lines), out, None
    measured_C = runs["F"] * runs["D"]
    budgets = preset.budgets or default_budgets(measured_C)
    sparsities = sorted({round(float(s), 3) for s in runs["S"][runs["arch"].astype(str) == "baseline"]})
    boot = None
    if n_boot:
        try:
            boot = surface_bootstrap(runs, "baseline", "smelt", budgets, sparsities, n_boot, seed=seed,
                                     full_fits=fits, progress=progress)
        except ValueError as e:
            lines.append(f"cell bootstrap failed: {e}")
    lines += surface_lines(fits, boot, out)
    lines += identifiability_lines(runs, fits, out)
    identified = all(out["identified"].values())
    CC, SS = np.meshgrid(budgets, sparsities, indexing="ij")
    gain = np.full(CC.shape, np.nan)
    if identified:  # [S5] and [S3] only from surfaces the grid identifies, at budgets inside its range
        gain = fit.ce_gain(fits["baseline"], fits["smelt"], CC, SS)
        flat = [a for a, f in fits.items() if degenerate(f)]
        if flat:  # [S5] needs both frontiers: no gain, whatever the arithmetic gives (1 - C / inf = +1)
            gain = np.full_like(gain, np.nan)
        lines += ce_gain_lines(gain, budgets, sparsities, boot, measured_C, out,
                               why=f"the {' and '.join(flat)} surface is degenerate, see above" if flat else None)
        lines += tpp_lines(fits, CC, SS, budgets, sparsities, boot, out)
    else:
        lines.append("[S5] CE Gain and [S3] TPP: not reported: the [S2] surface of "
                     + " and ".join(a for a, ok in out["identified"].items() if not ok)
                     + " is not identified on this grid (above), so neither its frontier nor any number read off it "
                       "is a measurement")
    lines += smelt_claims(preset, rows, fits, out, sweep)
    figures = dict(fits=fits, sparsities=sparsities, budgets=budgets, gain=gain, boot=boot, identified=identified,
                   C_range=(float(measured_C.min()), float(measured_C.max())))
    return "\n".join(lines), out, figures


def f_levels(F):
    """The levels of per-token FLOPs of a grid: sorted values, a new level wherever one is more than F_LEVEL x the
    value below it -> [(lowest, highest)] per level."""
    levels = []
    for f in sorted(float(v) for v in F):
        if levels and f <= F_LEVEL * levels[-1][1]:
            levels[-1][1] = f
        else:
            levels.append([f, f])
    return [tuple(level) for level in levels]


def grid_lines(rows, runs, out):
    """What the grid can resolve: the span and the levels of each architecture's F (its surface is fitted on its
    own points), S and D -> report lines; on F at fewer than IDENTIFYING_F_LEVELS levels the six-coefficient
    surface is not identifiable by design (with more, the profile of a decides: identifiability_lines)."""
    S, D = (np.asarray(runs[k], dtype=float) for k in ("S", "D"))
    cells = len(set(runs["cell"].tolist()))
    layers = sorted({r["n_layer"] for r in rows if r.get("n_layer") is not None})
    archs = list(dict.fromkeys(runs["arch"].astype(str).tolist()))
    spans = {a: (lambda F: float(F.max() / F.min()))(np.asarray(runs["F"][runs["arch"].astype(str) == a], dtype=float))
             for a in archs}
    levels = {a: f_levels(runs["F"][runs["arch"].astype(str) == a]) for a in archs}
    span = min(spans.values())
    out["grid"] = dict(F_span=span, F_span_by_arch=spans, F_levels={a: len(v) for a, v in levels.items()}, cells=cells,
                       S=[float(S.min()), float(S.max())], D=[float(D.min()), float(D.max())], n_layer=layers)
    F = np.asarray(runs["F"], dtype=float)
    line = (f"grid: F spans {span:.1f}x within each architecture ("
            + ", ".join(f"{a} {v:.2f}x" for a, v in spans.items())
            + f"; {F.min():.3g}..{F.max():.3g} FLOPs per token over both) over {cells} cells, S {S.min():.3f}.."
            f"{S.max():.3f}, D {D.min():.3g}..{D.max():.3g} tokens"
            + (f", {layers[0]} layers in every cell" if len(layers) == 1 else ""))
    if min(len(v) for v in levels.values()) < IDENTIFYING_F_LEVELS:
        line += (f"; on F at fewer than {IDENTIFYING_F_LEVELS} levels the six-coefficient [S2] surface is not "
                 "identifiable by design: its coefficients, CE Gain and TPP describe these points, not [S]'s law")
    elif span < 10:
        line += "; F spans less than a decade: whether its levels pin the surface down is the profile's call (below)"
    moves = {a: max(hi / lo for lo, hi in v) - 1 for a, v in levels.items()}
    return [line, "  F takes " + ", ".join(f"{len(v)} levels ({a}: each moves at most {100 * moves[a]:.0f}%)"
                                         for a, v in levels.items())
            + f" (a value less than {100 * (F_LEVEL - 1):.0f}% above the next lower one: the same level)"]


def surface_profile(runs, arch, values=PROFILE_A):
    """The [S2] surface of one architecture refitted with a held at each of `values` (every other coefficient
    free): [(a, SurfaceFit)], the full fit's own a among them."""
    m = runs["arch"].astype(str) == arch
    F, S, D, loss = (runs[k][m] for k in ("F", "S", "D", "loss"))
    return [(float(a), fit.fit_surface(F, S, D, loss, fixed_exponents=(float(a), None, None))) for a in values]


def identifiability_lines(runs, fits, out):
    """Is each [S2] surface identified? Its F must take at least 4 levels (more than the E, A and a of its F
    term), its profile interval of a (stats.profile_interval, the likelihood-ratio bound) must stay inside the
    values tried, and the floor E of the fits inside that interval must not reach 0 (E >= 0 is the fit's
    bound: a floor anywhere from 0 up is not measured, and every CE Gain and TPP depends on it) -> report
    lines; out["identified"][arch] and out["profile"][arch]."""
    out["identified"], out["profile"] = {}, {}
    lines = [f"[S2] identifiability: the surface refitted with a held at each of {len(PROFILE_A)} values "
             f"{PROFILE_A[0]:g}..{PROFILE_A[-1]:g}; the 95% profile interval of a: the objective within chi2(1)/2 x "
             "objective / points of its lowest"]
    for arch, full in fits.items():
        profile = sorted(surface_profile(runs, arch) + [(full.a, full)], key=lambda p: p[0])
        a, objective = np.array([p for p, _ in profile]), np.array([f.objective for _, f in profile])
        bound = profile_bound(full.objective, full.n_points)
        lo, hi, at_edge = profile_interval(a, objective, bound)
        inside = [f for _, f in profile if f.objective <= objective.min() + bound]
        levels = out["grid"]["F_levels"][arch]
        floorless = min(f.E for f in inside) < E_RESOLVED
        why = ([f"F at {levels} levels"] if levels < IDENTIFYING_F_LEVELS else []) + (
            ["E reaches 0 along it: the floor is not resolved"] if floorless else [])
        ok = not at_edge and not why
        out["identified"][arch] = ok
        out["profile"][arch] = dict(a=[lo, hi], at_edge=at_edge, E_reaches_0=floorless, bound=bound, F_levels=levels,
                                    E=[min(f.E for f in inside), max(f.E for f in inside)],
                                    c=[min(f.c for f in inside), max(f.c for f in inside)],
                                    c_whole=[min(f.c for _, f in profile), max(f.c for _, f in profile)])
        p = out["profile"][arch]
        edge = " (reaches the end of what was tried)" if at_edge else ""
        lines.append(f"  {arch:>9}: a in [{lo:.3g}, {hi:.3g}]{edge}, along it E {p['E'][0]:.2f}..{p['E'][1]:.2f} and c "
                     f"{p['c'][0]:.3f}..{p['c'][1]:.3f} (c {p['c_whole'][0]:.3f}..{p['c_whole'][1]:.3f} over every a "
                     f"tried), the objective within {bound:.2g} of its lowest: "
                     + ("identified" if ok else "NOT identified" + (f" ({'; '.join(why)})" if why else "")))
    return lines


def degenerate(f):
    """A surface whose loss does not fall with F or with D on its grid (a or c ~ 0): no compute-optimal
    frontier [S3]-[S4], so no CE Gain or TPP from it."""
    return f.a < 1e-3 or f.c < 1e-3


def smelt_noise_lines(rows, out):
    """The baseline's seed spread and the per-pair win counts (overall and per source) -> report lines;
    their numbers go into out["seed_spread"] and out["wins"]."""
    lines = []
    per, pooled, dof = seed_spread(rows, ("cell", "branch_tpp"), "baseline")
    out["seed_spread"] = dict(pooled_std=pooled, dof=dof, groups=[dict(cell=k[0], branch_tpp=k[1], mean=m, std=s, n=n)
                                                         for k, (m, s, n) in per.items()])
    stds = [s for _, s, _ in per.values() if s is not None]
    if stds:
        lines.append(f"seed spread of the baseline ({max(n for *_, n in per.values())} seeds per cell and branch): "
                     f"std {min(stds):.4f}..{max(stds):.4f} nats, pooled {pooled:.4f}")
    wins, pairs = win_counts(rows)
    out["wins"]["all"] = [wins, pairs]
    lines.append(f"per-pair wins (SMELT loss < baseline loss at the same cell, branch and seed): {wins}/{pairs}")
    for s in sources_of_rows(rows):
        w, p = win_counts(rows, key=f"loss_{s}")
        out["wins"][s] = [w, p]
        lines.append(f"  on {s}: {w}/{p}")
    return lines + pair_difference_lines(rows, pooled, out)


def pair_difference_lines(rows, sigma, out):
    """SMELT minus baseline per pair against a pair's seed noise, sqrt(2) x the pooled std (two single runs),
    by scale, and the mean over cells with its t-interval over cells -> report lines; out["pair_difference"]."""
    diffs = pair_differences(rows)
    if not diffs or not sigma:
        return []
    s2 = difference_sigma(sigma)
    scale = lambda cell: cell.rsplit("-", 1)[0]  # noqa: E731  (L8w72-e16 -> L8w72)
    lines = [f"SMELT minus baseline per pair: a pair's seed noise is sqrt(2) x the pooled std = {s2:.4f} nats "
             "(sigma_diff)"]
    by_scale = {}
    for sc in dict.fromkeys(scale(c) for c, *_ in diffs):
        d = np.array([x for c, *_, x in diffs if scale(c) == sc])
        by_scale[sc] = dict(pairs=len(d), wins=int((d < 0).sum()), median=float(np.median(d)),
                            median_sigmas=float(np.median(d) / s2), above=int((d > 2 * s2).sum()),
                            below=int((d < -2 * s2).sum()))
        lines.append(f"  {sc}: SMELT lower in {by_scale[sc]['wins']}/{len(d)}, median {np.median(d):+.4f} "
                     f"({np.median(d) / s2:+.1f} sigma_diff), {d.min():+.4f}..{d.max():+.4f}; beyond +2 sigma_diff "
                     f"{by_scale[sc]['above']}, beyond -2 sigma_diff {by_scale[sc]['below']}")
    cells = np.array([np.mean([x for c, *_, x in diffs if c == cell]) for cell in dict.fromkeys(c for c, *_ in diffs)])
    out["pair_difference"] = dict(sigma_diff=s2, by_scale=by_scale, mean=float(cells.mean()), cells=len(cells))
    if len(cells) > 1:
        lo, hi = t_interval(float(cells.mean()), float(cells.std(ddof=1)), len(cells), len(cells) - 1)
        out["pair_difference"].update(lo=lo, hi=hi)
        lines.append(f"  the mean over the {len(cells)} cells (each its branches' mean): {cells.mean():+.4f} [95% "
                     f"t-interval over cells {lo:+.4f}, {hi:+.4f}]")
    return lines


def smelt_surfaces(runs, lines, out):
    """{arch: fit.SurfaceFit} of the baseline and the SMELT twin [S2]; an architecture whose surface
    cannot be fitted is left out, with a report line and out["fits"][arch]["error"]."""
    fits = {}
    for arch in ("baseline", "smelt"):
        m = runs["arch"].astype(str) == arch
        try:
            fits[arch] = fit.fit_surface(runs["F"][m], runs["S"][m], runs["D"][m], runs["loss"][m])
            out["fits"][arch] = dict(fits[arch].to_dict(), n_points=fits[arch].n_points)
        except ValueError as e:
            lines.append(f"surface fit of {arch} not possible: {e}")
            out["fits"][arch] = {"error": str(e)}
    return fits


SURFACE_COEFFICIENTS = ("E", "A", "a", "b", "K", "c")  # [S2] L = E + A (1-S)^b / F^a + K / D^c


def surface_lines(fits, boot, out):
    """The [S2] table of both surfaces, with the cell-bootstrap interval of every coefficient (boot: None or
    surface_bootstrap's result; an exponent whose interval reaches 0 is marked) and a note for a degenerate
    surface -> report lines."""
    interval = lambda key: ((float(boot["lo"][key]), float(boot["hi"][key])) if boot and key in boot["lo"]  # noqa
                            else (None, None))
    lines = ["[S2] surfaces L = E + A (1-S)^b / F^a + K / D^c (Huber on log-loss, fit.py)"
             + (" with the 95% cell-bootstrap interval of every coefficient" if boot else "")]
    lines.append(f"  {'arch':>9} {'E':>8} {'A':>10} {'a':>7} {'b':>7} {'K':>10} {'c':>7} {'gamma':>7} {'rmse':>8} "
                 f"{'pts':>4}")
    for arch, f in fits.items():
        role = "ref" if arch == "baseline" else "target"
        lines.append(f"  {arch:>9} {f.E:8.4f} {f.A:10.4g} {f.a:7.4f} {f.b:7.4f} {f.K:10.4g} {f.c:7.4f} "
                     f"{f.gamma:7.4f} {f.rmse:8.5f} {f.n_points:4d}")
        for coef in SURFACE_COEFFICIENTS:
            lo, hi = interval(f"{role}.{coef}")
            out["fits"][arch][f"{coef}_interval"] = [finite_or_none(lo), finite_or_none(hi)]
            if lo is not None:
                unresolved = coef in ("a", "b", "c") and lo <= 0
                lines.append(f"      {coef} = {getattr(f, coef):.4g} [{lo:.4g}, {hi:.4g}]"
                             + ("  <- interval reaches 0: this exponent is not resolved" if unresolved else ""))
        if degenerate(f):  # [S3]-[S4] need a, c > 0: no compute-optimal frontier otherwise
            which = "F" if f.a < 1e-3 else "D"
            lines.append(f"  note: the {arch} surface is degenerate: on this grid its loss does not fall with "
                         f"{which}, so its frontier, and every CE Gain / TPP that uses it, is undefined")
            out["fits"][arch]["degenerate"] = True
    return lines


def ce_gain_lines(gain, budgets, sparsities, boot, measured_C, out, why=None):
    """[S5] CE Gain of SMELT at every budget x sparsity (gain: that grid, nan where undefined), with its
    cell-bootstrap interval and whether that interval excludes 0 -> report lines; records into
    out["ce_gain"]. An undefined gain is printed as such, with no interval; undefined everywhere, one
    line saying why."""
    note = ""
    if boot:
        note = f" ({boot['n_draws']} cell-bootstrap draws, 95%"
        note += f"; {boot['skipped']} underdetermined draws skipped)" if boot["skipped"] else ")"
    lines = [f"[S5] CE Gain of SMELT over the baseline{note}; > 0: SMELT needs less compute; '~' = the "
             f"interval does not exclude 0 (within noise). Budgets C inside the measured "
             f"{measured_C.min():.3g}..{measured_C.max():.3g} FLOPs"]
    nowhere = not np.isfinite(gain).any()
    if nowhere:
        lines.append(f"  undefined at every budget and sparsity ({why or 'no finite value'}): no gain and no interval")
    return lines + budget_grid_lines(gain, boot, "ce_gain", budgets, sparsities, out["ce_gain"], ("+.4f", "+.3f"),
                              nowhere, noise_marks=True)


def budget_grid_lines(values, boot, key, budgets, sparsities, records, digits, undefined=False, prefix="",
                      noise_marks=False, **tags):
    """One line per budget x sparsity: the value, its cell-bootstrap interval (boot's `key`; digits: the
    value's and the interval's formats) and with noise_marks a '~' where the interval holds 0; each cell
    appended to records (tags first). undefined: every cell recorded as None, no line."""
    lines = []
    for i, C in enumerate(budgets):
        for j, S in enumerate(sparsities):
            noise_field = {"within_noise": None} if noise_marks else {}
            if undefined:
                records.append(dict(tags, C=C, S=S, value=None, lo=None, hi=None, **noise_field))
                continue
            lo, hi = boot_interval(boot, key, i, j, values[i, j])
            if noise_marks:
                noise_field["within_noise"] = within_noise(lo, hi, 0.0)
            mark = " ~" if noise_field.get("within_noise") else ""
            ci = f"  [{fmt(lo, digits[1])}, {fmt(hi, digits[1])}]{mark}" if lo is not None else ""
            lines.append(f"  {prefix}C={C:.3g} S={S:.3f}: {fmt(values[i, j], digits[0])}{ci}")
            records.append(dict(tags, C=C, S=S, value=finite_or_none(values[i, j]), lo=finite_or_none(lo),
                                hi=finite_or_none(hi), **noise_field))
    return lines


def tpp_lines(fits, CC, SS, budgets, sparsities, boot, out):
    """TPP = D*/(F*/6) of both surfaces on the budget x sparsity grid (CC, SS), with cell-bootstrap
    intervals -> report lines; records into out["tpp"]. A degenerate surface has no TPP: printed as
    undefined, with no interval."""
    lines = ["TPP = D*/(F*/6) at the same budgets"]
    for role, arch in (("ref", "baseline"), ("target", "smelt")):
        values, flat = fit.tpp(fits[arch], CC, SS), degenerate(fits[arch])
        if flat:
            lines.append(f"  {arch:>9}: undefined at every budget and sparsity (its surface is degenerate)")
        lines += budget_grid_lines(values, boot, f"{role}.tpp", budgets, sparsities, out["tpp"], (".4g", ".3g"),
                                   flat, prefix=f"{arch:>9} ", arch=arch)
    return lines


def boot_interval(boot, key, i, j, value):
    """(lo, hi) of a bootstrapped budget x sparsity quantity at (i, j); (None, None) without a bootstrap of
    it or a finite value."""
    if boot and key in boot["lo"] and finite_or_none(value) is not None:
        return float(boot["lo"][key][i, j]), float(boot["hi"][key][i, j])
    return None, None


def smelt_claims(preset, rows, fits, out, sweep):
    """The claims table of an [S] grid: SMELT against its baseline pair by pair, the surfaces' identifiability,
    CE Gain and TPP (reported only where identified), the D exponent, the decay branches, the matching; and
    what its LR sweep and seeds cannot tell."""
    claims = []
    diff, (wins, pairs) = out.get("pair_difference"), out["wins"]["all"]
    if diff and "lo" in diff:
        scales = "; ".join(f"{sc} median {v['median']:+.3f} ({v['median_sigmas']:+.1f} sigma_diff)"
                           for sc, v in diff["by_scale"].items())
        claims.append(("SMELT reaches a lower loss than its compute-matched baseline in every pair ([S]: 96/96)",
                       "reproduces" if diff["hi"] < 0 else "does not" if diff["lo"] > 0 else "cannot tell",
                       f"{wins}/{pairs} pairs; SMELT - baseline {diff['mean']:+.4f} [{diff['lo']:+.4f}, "
                       f"{diff['hi']:+.4f}] over cells; {scales}; sigma_diff = sqrt(2) x "
                       f"{out['seed_spread']['pooled_std']:.4f} = {diff['sigma_diff']:.4f}"))
    prof = out.get("profile", {})
    if prof:
        claims.append(("a six-coefficient [S2] surface L(F, S, D) per architecture, identified by the grid",
                       "cannot tell" if not all(out["identified"].values()) else "reproduces",
                       "; ".join(f"{a}: {'identified' if out['identified'][a] else 'NOT identified'}, F at "
                                 f"{p['F_levels']} levels, a in [{p['a'][0]:.2g}, {p['a'][1]:.2g}] (profile), E "
                                 f"{p['E'][0]:.2f}..{p['E'][1]:.2f} along it" for a, p in prof.items())))
        ok = all(out["identified"].values())
        gains = [g for g in out["ce_gain"] if g["value"] is not None]
        claims.append(("CE Gain [S5] 6.8-18% at 1e20-1e21 FLOPs, and the compute-optimal TPP [S3]",
                       interval_verdict([(g["lo"], g["hi"]) for g in gains], 0.0) if ok and gains else "cannot tell",
                       (f"CE Gain {min(g['value'] for g in gains):+.3f}..{max(g['value'] for g in gains):+.3f} inside "
                        "the measured range (intervals above)" if ok and gains else
                        "not reported: " + ("no finite value" if ok else "the surfaces are not identified"))))
        c = {a: (f.c, out["fits"][a].get("c_interval", [None, None])) for a, f in fits.items()}
        paper_c = {a: fit.SYNTHETIC_SURFACES[a]["c"] for a in c if a in fit.SYNTHETIC_SURFACES}
        inside = [i[0] is not None and i[0] <= paper_c[a] <= i[1] for a, (_, i) in c.items() if a in paper_c]
        no_interval = any(i[0] is None for _, i in c.values())
        claims.append(("the data exponent c of each surface ([S]: " + " / ".join(f"{v:.2f}" for v in paper_c.values())
                       + ")", "cannot tell" if not ok or no_interval else "reproduces" if all(inside) else "does not",
                       ", ".join(f"{a} {v:.3f} [{fmt(i[0], '.2f')}, {fmt(i[1], '.2f')}]" for a, (v, i) in c.items())
                       + " (cell bootstrap); along the profile of a c moves " + ", ".join(
                           f"{p['c_whole'][0]:.2f}..{p['c_whole'][1]:.2f} ({a})" for a, p in prof.items())))
    series = {}
    for r in rows:
        series.setdefault((r["arch"], r["cell"], r["seed"]), []).append((r["D"], r["loss"]))
    falls = sum(all(b[1] < a[1] for a, b in zip(v, v[1:])) for v in (sorted(p) for p in series.values()))
    claims.append(("the loss falls with the tokens D of each decay branch", "reproduces" if falls == len(series)
                   else "does not", f"in {falls} of {len(series)} stable runs' branches (arch, cell, seed)"))
    if out["match"]:
        ratio = lambda k: [m["ratios"][k] for m in out["match"]]  # noqa: E731
        claims.append(("the twin matches its baseline's FLOPs, parameters and KV cache ([S] Table 10)", "reproduces",
                       f"F {100 * (min(ratio('flops')) - 1):+.1f}..{100 * (max(ratio('flops')) - 1):+.1f}%, N "
                       f"{100 * (min(ratio('params')) - 1):+.1f}..{100 * (max(ratio('params')) - 1):+.1f}%, KV "
                       f"{min(ratio('kv')):.2f}..{max(ratio('kv')):.2f}x: by construction (the matcher's tolerance)"))
    return claims_lines(claims) + sweep_confound_lines(preset, rows, out, sweep)


def sweep_confound_lines(preset, rows, out, sweep):
    """What the LR sweep and the seeds cannot tell: each architecture's (or, swept at every scale, each
    (scale, architecture)'s) best swept value and its neighbours' excess in the noise of a difference of two
    swept values (means of lr_sweep.seeds runs), the widths one value serves, the twin's seeds."""
    pooled = (out.get("seed_spread") or {}).get("pooled_std")
    if not sweep or not pooled or not out.get("pair_difference"):
        return []
    seeds = preset.lr_sweep.seeds
    sigma = difference_sigma(pooled, seeds, seeds)  # sqrt(2) x pooled for one run per value: sigma_diff
    per_scale = preset.lr_sweep.at_every_depth
    blocks = sweep[1].items() if per_scale else [(None, sweep[1])]
    parts, nearest = [], []
    for scale, table in blocks:
        for arch, by in table.items():
            values = sorted((float(v), loss) for v, loss in by.items() if loss is not None)
            i = min(range(len(values)), key=lambda j: values[j][1])
            near = [values[j][1] - values[i][1] for j in (i - 1, i + 1) if 0 <= j < len(values)]
            nearest.append(min(near, default=np.inf) / sigma)
            parts.append(f"{arch}{'' if scale is None else ' ' + scale} best at {values[i][0]:g}, its neighbours "
                         f"{', '.join(f'+{d:.3f}' for d in near)} nats ({', '.join(f'{d / sigma:.1f}' for d in near)} "
                         + ("sigma_diff)" if seeds == 1 else "sigma)"))
    widths = sorted({r["n_embd"] for r in rows if r.get("n_embd") and r["arch"] == "baseline"})
    resolved = sum(n >= 2 for n in nearest)
    noise = ("" if seeds == 1 else f"sigma = sqrt(2/{seeds}) x {pooled:.4f} = {sigma:.4f}, the noise of a difference "
             f"of two {seeds}-seed means; ")
    if per_scale:
        verdict = (f"{resolved} of {len(nearest)} optima resolved (both neighbours at least 2 sigma worse), "
                   f"{len(nearest) - resolved} not")
        carried = "each scale's value used at both of its sparsities"
    else:
        verdict = "resolved" if resolved == len(nearest) else ("the optimum is not resolved (a neighbour within 2 "
                                                               "sigma_diff)")
        carried = f"each LR carried unchanged to every cell (baseline widths {widths[0]}..{widths[-1]})"
    twin = "" if preset.seed_every_arch else "; one seed of the twin"
    where = "at every scale's first cell" if per_scale else "at the first cell"
    return [f"cannot tell either: the LR sweep {where} ({noise}{'; '.join(parts)}): {verdict}; {carried}{twin}"]


def decay_curves(specs, results):
    """{label: (tokens, val loss)} of the largest scale's stable runs (first seed) and their branches."""
    stable = [s for s in specs if s.role == "stable" and s.meta.get("seed") == SEEDS[0]]
    if not stable:
        return {}
    largest = max(s.meta["F"] for s in stable if s.arch == "baseline")
    curves = {}
    for s in specs:
        r = results.get(s.run_id)
        if not r or s.meta.get("seed") != SEEDS[0] or not r.get("log_path") or not os.path.exists(r["log_path"]):
            continue
        same_cell = any(t.cell == s.cell and t.meta["F"] == largest for t in stable if t.arch == "baseline")
        if not same_cell or s.role not in ("stable", "branch"):
            continue
        log = [json.loads(line) for line in open(r["log_path"])]
        label = f"{s.arch} {s.cell}" + (f" branch TPP {s.meta['branch_tpp']:g}" if s.role == "branch" else " stable")
        curves[label] = ([e["tokens"] for e in log], [e["val_loss"] for e in log])
    return curves


def smelt_plots(preset, f, path, specs, results):
    """The surfaces' frontiers, the CE Gain (when defined) and, with the runs' logs, the decay branches."""
    written = []
    if f["identified"] and plots.plot_surface_frontiers(  # no frontier of a surface the grid does not identify
            fit.frontier_curves(f["fits"]), f["sparsities"], path("frontiers.png"), C_range=f["C_range"]):
        written.append(path("frontiers.png"))
    boot = f["boot"] or {"lo": {}, "hi": {}}
    if np.isfinite(f["gain"]).any() and plots.plot_ce_gain(  # no figure of an undefined CE Gain
            f["budgets"], f["sparsities"], f["gain"], path("ce_gain.png"), lo=boot["lo"].get("ce_gain"),
            hi=boot["hi"].get("ce_gain"), title=f"[S5] {preset.name}: CE Gain of SMELT (95% cell bootstrap)"):
        written.append(path("ce_gain.png"))
    curves = decay_curves(specs, results)
    if curves and plots.plot_loss_curves(curves, path("decay_branches.png"),
                                         title=f"{preset.name}: validation loss of the stable runs and their "
                                               "decay branches (first seed, largest scale)"):
        written.append(path("decay_branches.png"))
    return written
