"""[X] ladders (kind "x"): Vanilla, Operator-1, Loop-2, Untied-2, Loop-Grow and Untied-Grow at depths d,
width width_per_depth x d, each at its own budget; E fitted on Vanilla, shared-E power laws per architecture
[X7], and compute multipliers at Vanilla's budgets [X6] with seed-bootstrap bands; with every architecture
seeded, the pairs (growth vs its twin, untied vs tied) and the claims table."""

import functools
import math
import os
import warnings
from dataclasses import fields

import numpy as np

import fit
import grow
import match
import train
from ladders.common import (REPO, carried_lrs, compute_active, finite_or_none, fmt, model_settings, sources_of,
                            sweep_limits, sweep_point, sweep_values, tokens_per_step)
from ladders.stats import claims_lines, interval_verdict, pooled_std, seed_draws, seed_spread, within_noise
from ladders.presets import X_RECIPES
from model import ModelConfig
from tooling import plots
from tooling.jobs import RunSpec

# what a ladder point sets itself (sizes, data, the batch, the run's length and evals, the growth step); the
# recipe's other step counts become fractions of the run (RECIPE_FRACTIONS)
RECIPE_OWN = {"vocab_size", "block_size", "n_layer", "n_embd", "n_head", "head_dim",
              "data_dir", "run_name", "batch_size", "global_batch",
              "max_steps", "eval_interval", "final_eval_tokens", "grow_at"}
RECIPE_FRACTIONS = ("warmup_steps", "muon_momentum_warmup", "grow_rewarm_steps")
# [X]'s own ladders (tests/data/fineweb_ladders.csv, depths >= 8; tests/test_ladder.py recomputes them): the
# interpolated [X6] multiplier of an architecture over its reference at the reference's first and last budgets
# where it interpolates (3e18 .. 1e20 FLOPs) -> the claims table's [X] numbers
X_PAPER_MULTIPLIERS = {("operator-1", "vanilla"): (1.16, 1.25), ("loop-2", "vanilla"): (1.13, 1.26),
                       ("untied-2", "vanilla"): (1.24, 1.34), ("loop-grow", "vanilla"): (1.18, 1.36),
                       ("untied-grow", "vanilla"): (1.36, 1.55), ("loop-grow", "loop-2"): (1.04, 1.08),
                       ("untied-grow", "untied-2"): (1.08, 1.17), ("untied-2", "loop-2"): (1.09, 1.07),
                       ("untied-grow", "loop-grow"): (1.14, 1.13)}
# the pairs a claim compares directly (growth vs its twin, untied vs tied: grown or not), each at its reference's
# budgets
X_PAIRS = (("loop-grow", "loop-2"), ("untied-grow", "untied-2"), ("untied-2", "loop-2"),
           ("untied-grow", "loop-grow"))


@functools.lru_cache(maxsize=None)
def x_recipe(arch):
    """(model settings, train settings, {step count: fraction of the run}) of an [X] architecture's own
    recipe, read from config/X_RECIPES[arch].py as train.py reads it (once per process; callers only read)."""
    path = os.path.join(REPO, "config", X_RECIPES[arch] + ".py")
    recipe = train.SETTINGS.parse([path])
    given = {k: v for k, v in recipe.items() if k not in RECIPE_OWN}
    fractions = {k: given.pop(k) / recipe["max_steps"] for k in RECIPE_FRACTIONS if k in given}
    model_keys = {f.name for f in fields(ModelConfig)}
    return ({k: v for k, v in given.items() if k in model_keys},
            {k: v for k, v in given.items() if k not in model_keys}, fractions)


def x_config(preset, arch, depth):
    """(ModelConfig at the start of training, grows: bool) of one ladder point."""
    width = preset.width_per_depth * depth
    hd = preset.head_dim
    if width % hd:
        raise ValueError(f"preset {preset.name}: width {width} at depth {depth} is not a multiple of head_dim {hd}")
    mult = preset.mlp_multiple
    recipe = x_recipe(arch)[0] if preset.recipes else {}
    base = dict(preset.model, **recipe, n_layer=depth, n_embd=width, n_head=width // hd, head_dim=hd,
                mlp_hidden=mult * math.ceil(8 * width / 3 / mult))
    pcc = dict(layout="pcc", boundary="both")
    shapes = {
        "vanilla": dict(layout="plain"),
        "operator-1": dict(pcc, n_passes=1),
        "loop-2": dict(pcc, n_passes=2, tie_core=True),
        "untied-2": dict(pcc, n_passes=2, tie_core=False),
        "loop-grow": dict(pcc, n_passes=2, tie_core=True),
        "untied-grow": dict(pcc, n_passes=2, tie_core=False),
    }
    if arch not in shapes:
        raise ValueError(f"unknown [X] architecture {arch!r}; choose from {list(shapes)}")
    return ModelConfig.from_dict(dict(base, **shapes[arch])), arch.endswith("-grow")


def x_point(preset, arch, cfg, step_tokens):
    """(steps, train settings) of one ladder point: TPP x N (N compute-active, the cpu-mini v1 rule), or with
    tpp_stored (the [X] rule) TPP_arch x N_s (stored parameters); with recipes the architecture's [X]
    recipe, its step counts scaled to the run, its LRs carried up by [X16] from the first depth."""
    t = dict(preset.train)
    warmup_fraction = t.pop("warmup_fraction", 0.05)
    if preset.tpp_stored:
        steps = max(4, math.ceil(preset.tpp_stored[arch] * grow.stored_params(cfg) / step_tokens))
    else:
        steps = max(4, math.ceil(preset.tpp * compute_active(cfg) / step_tokens))
    if not preset.recipes:
        return steps, dict(t, warmup_steps=max(1, round(warmup_fraction * steps)))
    _, recipe, fractions = x_recipe(arch)
    return steps, dict(recipe, **t, **{k: round(f * steps) for k, f in fractions.items()})


def x_lr_settings(preset, arch, key, value):
    """The swept LR and, with recipes, the embedding and lm head LRs at the recipe's ratios to it (a global LR)."""
    if not key:
        return {}
    if not preset.recipes:
        return {key: value}
    _, recipe, _ = x_recipe(arch)
    return {key: value, **{k: float(f"{value * recipe[k] / recipe[key]:.12g}")
                           for k in ("embedding_lr", "unembedding_lr")}}


def growth_plan(preset, cfg, tokens, steps):
    """[X15]: the fraction rho* of tokens after growth (K0 -> grow_to) from the affine law [X9] at this
    run's TPP_K0 = D / N_s,K0 (stored parameters, [X10]) -> (grow step, rho*). The step moves one later
    if it falls on the step the WSD decay starts (a grown model would re-warm into the decay start)."""
    law = grow.AFFINE_LAW["loop_grow" if cfg.tie_core else "untied_grow"]
    e_ratio = grow.compute_active_params(cfg, preset.grow_to) / grow.compute_active_params(cfg)
    rho = grow.optimal_growth_fraction(tokens / grow.stored_params(cfg), *law, e_ratio)
    rho = min(max(rho, 0.05), 0.95)
    step = max(1, min(steps - 1, round((1 - rho) * steps)))
    if step == decay_start(preset, steps):
        step += 1
    return step, rho


def decay_start(preset, steps):
    return steps - round(preset.train.get("decay_fraction", train.DEFAULTS["decay_fraction"]) * steps)


def x_flops_per_token(cfg, grow_to, grow_step, steps):
    """Mean training FLOPs per token over `steps`, growing at grow_step (None: no growth) [X13]:
    match.run_flops, each phase weighted by its steps (every step trains the same tokens)."""
    if grow_step is None:
        return match.run_flops(cfg, [(1, cfg)])["flops_per_token"]
    grown = grow.grown_config(cfg, grow_to)
    return match.run_flops(cfg, [(grow_step, cfg), (steps - grow_step, grown)])["flops_per_token"]


def x_specs(preset, data, lrs=None, world=None):
    """Every architecture at every depth trains tpp x its own N tokens ([X]: each ladder at its own budget,
    [X10]). Without lrs: only the first depth (with lr_sweep.at_every_depth every depth), once per swept LR
    (the sweep); with lrs ({arch or (arch, depth): value}, common.sweep_point) every depth at its value; the
    reference runs every seed. A value at another depth runs x [X16]'s factor from the first (with lr_beta)."""
    step_tokens = tokens_per_step(preset, world)
    key, values = sweep_values(preset)
    sweep_seeds = preset.lr_sweep.seeds if preset.lr_sweep else 1
    every_depth = bool(preset.lr_sweep and preset.lr_sweep.at_every_depth)
    specs = []
    for depth in preset.depths:
        if lrs is None and depth != preset.depths[0] and not every_depth:
            break
        for arch in preset.archs:
            cfg, grows = x_config(preset, arch, depth)
            n = compute_active(cfg)
            steps, t = x_point(preset, arch, cfg, step_tokens)
            tokens = steps * step_tokens
            settings = dict(t, **model_settings(cfg), max_steps=steps, eval_interval=steps)
            grow_step = rho = None
            if grows:
                grow_step, rho = growth_plan(preset, cfg, tokens, steps)
                rewarm = settings.get("grow_rewarm_steps") or round(preset.rewarm_fraction * steps)
                settings.update(grow_at=float(grow_step), grow_to=preset.grow_to, grow_untie=False,
                                grow_rewarm_steps=max(1, rewarm))
            acc = match.accounting(cfg)
            meta = dict(depth=depth, width=cfg.n_embd, N=n, N_s=acc["params_stored"], tokens=tokens, tpp=tokens / n,
                        F=x_flops_per_token(cfg, preset.grow_to, grow_step, steps), grow_step=grow_step, rho=rho,
                        decay_start_step=decay_start(preset, steps), executed_layers=acc["executed_layers"],
                        stored_blocks=acc["stored_blocks"])
            seeds = preset.seeds if arch == "vanilla" or preset.seed_every_arch else preset.seeds[:1]
            lr_values = values if lrs is None else [lrs.get(sweep_point(preset, arch, depth)) if key else None]
            for value in lr_values:
                lr_meta = {"lr": value} if key else {}  # the grid's value (common.swept_value)
                run_settings = dict(settings, **x_lr_settings(preset, arch, key, value))
                if preset.lr_beta:  # [X16] from the first depth's N_s
                    anchor = grow.stored_params(x_config(preset, arch, preset.depths[0])[0])
                    run_settings = carried_lrs(run_settings, cfg, anchor, preset.lr_beta[arch])
                for seed in (preset.seeds[:sweep_seeds] if lrs is None else seeds):
                    run_id = f"{arch}-d{depth}" + (f"-{key}{value:g}" if key else "") + f"-s{seed}"
                    specs.append(RunSpec(run_id, arch, f"d{depth}", "run" if lrs is not None else "sweep",
                                         dict(run_settings, seed=seed), dict(meta, seed=seed, **lr_meta)))
    return specs


def x_rows(results):
    rows = []
    sources = sources_of([r for r in results if r])
    for r in results:
        if not r:
            continue
        m = r["meta"]
        row = dict(arch=r["arch"], cell=r["cell"], depth=m["depth"], width=m["width"], seed=m["seed"], C=r["flops"],
                   D=r["tokens"], F=m["F"], N=m["N"], N_s=m["N_s"], tpp=r["tokens"] / m["N"], epochs=m.get("epochs"),
                   grow_step=m.get("grow_step"), loss=r["val_loss"], run_id=r["run_id"], seconds=r["seconds"])
        for s in sources:
            row[f"loss_{s}"] = (r.get("val_loss_by_source") or {}).get(s)
        rows.append(row)
    return rows


def power_fits(runs, ref):
    """Shared-E power laws by [X]'s protocol (fit.fit_power_laws): E from the free fit of the reference
    (every seed), then (A, gamma +- its standard error) per architecture with that E fixed [X7]."""
    C0 = float(np.exp(np.mean(np.log(runs[ref][0]))))  # [X]: C0 = 1e18; here the reference's mid budget (A only)
    return fit.fit_power_laws(runs, ref, C0=C0)


def multipliers(runs, fits, ref, ref_C, ref_L):
    """[X6] per architecture at the reference's budgets ref_C (losses ref_L): (interpolated, [X]'s rule
    on the arch's own points, nan outside them; fitted, from the laws; extrapolated, True where the
    fitted one reads the arch's law outside the compute it was measured at)."""
    out = {}
    for a, (C, L) in runs.items():
        if a == ref:
            continue
        measured = fit.compute_multiplier(ref_C, ref_L, C, L)
        target = fits[ref].loss(ref_C)
        reach = fits[a].compute(target)
        fitted = fits[ref].compute(target) / reach
        out[a] = (np.asarray(measured, dtype=float), np.asarray(fitted, dtype=float),
                  (reach < np.min(C)) | (reach > np.max(C)))
    return out


def depth_means(points):
    """(C, L) of an architecture's points (C, L, depth), one mean per depth: an interpolated multiplier
    reads a seed-averaged curve (two seeds at one compute would otherwise make a crossing of their own)."""
    depths = sorted({d for *_, d in points})
    return (np.array([np.mean([c for c, _, dd in points if dd == d]) for d in depths]),
            np.array([np.mean([l for _, l, dd in points if dd == d]) for d in depths]))


def seed_noise(points, sigma, dof):
    """{arch: (sigma, dof)}: an architecture's own seed std pooled over its depths where it has several seeds
    at a depth, else the given (sigma, dof) (the reference's)."""
    noise = {}
    for a, pts in points.items():
        own, k = pooled_std([[l for _, l, d in pts if d == depth] for depth in sorted({d for *_, d in pts})])
        noise[a] = (own, k) if k else (sigma or 0.0, max(dof or 1, 1))
    return noise


def multiplier_bootstrap(points, ref, sigma, n_draws=400, seed=0, dof=None, pairs=()):
    """95% bands of the multipliers from the measured noise (stats.seed_draws, a Student t per mean): each draw
    moves an architecture's seeds at a depth together by a draw of their mean's error, sigma / sqrt(n) x t(dof),
    with its own pooled seed std (seed_noise; sigma and dof, default the reference's seed dof, where it has one
    seed per depth); then it refits and recomputes both multipliers (from the per-depth means) at the
    reference's mean budgets, and each pair's (arch, its reference) interpolated multiplier at that reference's.
    Returns (budgets, {arch: {"measured": (lo, hi), "fitted": (lo, hi)}}, {pair: ((lo, hi), the share of draws in
    which it is defined: inside both ladders' losses)})."""
    noise = seed_noise(points, sigma, dof or pooled_std(
        [[l for _, l, d in points[ref] if d == depth] for depth in {d for *_, d in points[ref]}])[1])
    groups = [(a, d) for a, pts in points.items() for d in sorted({d for *_, d in pts})]
    means = [np.mean([l for _, l, dd in points[a] if dd == d]) for a, d in groups]
    ns = [sum(dd == d for *_, dd in points[a]) for a, d in groups]
    draws = seed_draws(means, ns, [noise[a][0] for a, _ in groups], [noise[a][1] for a, _ in groups], n_draws, seed)
    ref_C = depth_means(points[ref])[0]
    boot = {a: ([], []) for a in points if a != ref}
    pair_boot = {pair: [] for pair in pairs}
    for row in draws:
        shift = {g: new - old for g, new, old in zip(groups, row, means)}
        drawn = {a: [(c, l + shift[a, d], d) for c, l, d in pts] for a, pts in points.items()}
        try:
            fits = power_fits({a: (np.array([c for c, _, _ in p]), np.array([l for _, l, _ in p]))
                               for a, p in drawn.items()}, ref)
        except ValueError:
            continue
        per_depth = {a: depth_means(p) for a, p in drawn.items()}
        for a, (measured, fitted, _) in multipliers(per_depth, fits, ref, ref_C, per_depth[ref][1]).items():
            boot[a][0].append(measured)
            boot[a][1].append(fitted)
        for arm, base in pairs:
            pair_boot[arm, base].append(fit.compute_multiplier(*per_depth[base], *per_depth[arm]))
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an all-nan column (no interpolation possible) stays nan
        band = lambda d: tuple(np.nanpercentile(np.array(d), [2.5, 97.5], axis=0)) if d else None  # noqa: E731
        bands = {a: {"measured": band(m), "fitted": band(f)} for a, (m, f) in boot.items()}
        defined = lambda d: np.isfinite(np.array(d)).mean(axis=0) if d else None  # noqa: E731
        return ref_C, bands, {pair: (band(d), defined(d)) for pair, d in pair_boot.items()}


def x_report(preset, rows, sweep=None, ref="vanilla", n_boot=400, lrs=None):
    """LR sweep, final losses at equal depth with the compute each architecture spent there, seed spread,
    shared-E power laws [X5]-[X7] and compute multipliers [X6] with seed-bootstrap bands -> (text, dict,
    figure data). lrs: {arch: the swept value carried up}, for the line on what carrying it up confounds (with
    lr_sweep.at_every_depth {(arch, depth): each point's own value}, the sweep one block per depth)."""
    budget = (f"TPP {preset.tpp:g} per compute-active non-embedding parameter for every architecture"
              if not preset.tpp_stored else "each architecture's [X] TPP per stored parameter ("
              + ", ".join(f"{a} {preset.tpp_stored[a]:g}" for a in preset.archs) + ")")
    lines = [f"== {preset.name}: [X] ladders at width {preset.width_per_depth} x depth, {budget}"]
    out = {"preset": preset.name, "fits": {}, "multipliers": {}, "seed_spread": {}, "points": rows}
    archs = list(dict.fromkeys(r["arch"] for r in rows))
    depths = sorted({r["depth"] for r in rows})
    if sweep:
        lines += sweep[0]
        out["lr_sweep"] = sweep[1]
        lines += lr_confound_lines(preset, archs, lrs or {}, ref)
    if not rows:
        lines.append("no finished runs yet")
        return "\n".join(lines), out, None
    per, pooled, dof = seed_spread(rows, ("depth",), ref)
    out["seed_spread"] = dict(pooled_std=pooled, dof=dof, per_depth={str(k[0]): dict(mean=m, std=s, n=n)
                                                              for k, (m, s, n) in per.items()})
    lines.append("final validation loss (rows: architecture; columns: depth; the reference: mean over seeds)")
    lines.append(f"  {'':>12} " + " ".join(f"{f'd{d}':>9}" for d in depths))
    for a in archs:
        cells = []
        for d in depths:
            losses = [r["loss"] for r in rows if r["arch"] == a and r["depth"] == d]
            cells.append(f"{np.mean(losses):9.4f}" if losses else f"{'-':>9}")
        lines.append(f"  {a:>12} " + " ".join(cells))
    C_row = [np.mean([r["C"] for r in rows if r["arch"] == a and r["depth"] == d] or [np.nan]) for a in archs
             for d in depths]
    lines.append(f"  training FLOPs range {np.nanmin(C_row):.3g}..{np.nanmax(C_row):.3g}; epochs read "
                 f"{min(r['epochs'] or 0 for r in rows):.2f}..{max(r['epochs'] or 0 for r in rows):.2f}")
    lines += equal_depth_lines(rows, archs, depths, ref)
    if pooled is not None:
        stds = ", ".join(f"d{k[0]} {s:.4f}" for k, (_, s, _) in sorted(per.items()) if s is not None)
        lines.append(f"seed spread of {ref} ({max(n for *_, n in per.values())} seeds): std {stds}; pooled "
                     f"{pooled:.4f} nats")
    points = {a: [(r["C"], r["loss"], r["depth"]) for r in rows if r["arch"] == a] for a in archs}
    runs = {a: (np.array([c for c, _, _ in p]), np.array([l for _, l, _ in p])) for a, p in points.items()}
    if ref not in runs or len({d for *_, d in points[ref]}) < 3:
        lines.append(f"[X7] needs {ref} at 3 depths or more: nothing to fit yet")
        return "\n".join(lines), out, None
    try:
        fits = power_fits(runs, ref)
    except ValueError as e:
        lines.append(f"[X7] power laws cannot be fitted: {e}")
        return "\n".join(lines), out, None
    lines.append(f"[X7] E = {fits[ref].E:.4f} ([X]'s free fit on {ref}, every seed), C0 = {fits[ref].C0:.3g}; "
                 "L = E + A (C/C0)^-gamma per arch with E fixed, gamma +- its standard error")
    for a, f in fits.items():
        lines.append(f"  {a:>12}: A={f.A:.4f} gamma={f.gamma:.4f} +- {f.gamma_se:.4f}")
        out["fits"][a] = f.to_dict()
    pairs = [p for p in X_PAIRS if set(p) <= set(points)] if preset.seed_every_arch else []
    ref_C, bands, pair_bands = multiplier_bootstrap(points, ref, pooled or 0.0, n_draws=n_boot if pooled else 0,
                                                    seed=preset.seed, dof=dof, pairs=pairs)
    ref_L = depth_means(points[ref])[1]
    mult = multipliers({a: depth_means(p) for a, p in points.items()}, fits, ref, ref_C, ref_L)
    lines += multiplier_lines(mult, bands, ref, ref_C, out, show_fitted=preset.multipliers != "interpolated")
    if preset.seed_every_arch:  # every architecture's seeds: the pairs and the claims table
        lines += pair_lines(points, pairs, pair_bands, out)
        lines += x_claims(preset, rows, fits, ref, out, lrs or {})
    figures = dict(runs=runs, fits=fits, ref_C=ref_C, mult=mult, bands=bands)
    return "\n".join(lines), out, figures


def pair_lines(points, pairs, pair_bands, out):
    """Each pair's interpolated [X6] multiplier (arch over its reference, at the reference's per-depth budgets)
    with its seed-bootstrap band, and every architecture's own pooled seed std -> report lines."""
    noise = seed_noise(points, None, None)
    lines = ["seed std of each architecture, pooled over its depths (the bootstrap's noise; 95% bands: a Student t "
             "per seed mean): " + ", ".join(f"{a} {s:.4f} ({k} dof)" for a, (s, k) in noise.items()),
             "[X6] pairs: an architecture's interpolated multiplier over its twin at the twin's per-depth budgets "
             "[95% seed-bootstrap band]"]
    out["pairs"] = {}
    for arm, base in pairs:
        C, L = depth_means(points[base])
        m = fit.compute_multiplier(C, L, *depth_means(points[arm]))
        band, defined = pair_bands.get((arm, base)) or (None, None)
        nan = np.full(len(C), np.nan)
        (lo, hi), defined = band or (nan, nan), nan if defined is None else defined
        out["pairs"][f"{arm}/{base}"] = [dict(C=float(c), value=finite_or_none(v), lo=finite_or_none(a),
                                              hi=finite_or_none(b), defined=finite_or_none(d))
                                         for c, v, a, b, d in zip(C, m, lo, hi, defined)]
        lines.append(f"  {f'{arm} / {base}':>24} " + " ".join(
            f"{c:.3g}: " + (f"{v:.3f} [{fmt(a, '.2f')}, {fmt(b, '.2f')}]" + (f" (in {d:.2f} of the draws)" if d < 0.99
                                                                             else "") if np.isfinite(v) else "-")
            for c, v, a, b, d in zip(C, m, lo, hi, defined)))
    return lines


def rises(records):
    """Does an interpolated multiplier rise with budget? 'reproduces' when its last band lies above its first,
    'does not' when below, 'cannot tell' otherwise (records: [{value, lo, hi}] per budget, value None outside)."""
    got = [r for r in records if r["value"] is not None]
    if len(got) < 2 or None in (got[0]["lo"], got[0]["hi"], got[-1]["lo"], got[-1]["hi"]):
        return "cannot tell"
    first, last = got[0], got[-1]
    return "reproduces" if last["lo"] > first["hi"] else "does not" if last["hi"] < first["lo"] else "cannot tell"


def multiplier_claim(records, paper, rising=True):
    """(verdict, number) of an [X] claim that an architecture needs less compute than its reference (every
    band above 1) and, with rising, more so with budget (rises) -> the claims table's row."""
    got = [r for r in records if r["value"] is not None]
    if not got:
        return "cannot tell", "no budget inside both ladders' losses"
    parts = [interval_verdict([(r["lo"], r["hi"]) for r in got], 1.0)] + ([rises(got)] if rising else [])
    verdict = "does not" if "does not" in parts else "reproduces" if set(parts) == {"reproduces"} else "cannot tell"
    number = ", ".join(f"{r['value']:.2f} [{fmt(r['lo'], '.2f')}, {fmt(r['hi'], '.2f')}]" for r in got)
    return verdict, f"{number} at {got[0]['C']:.2g}..{got[-1]['C']:.2g} FLOPs ([X]: {paper[0]:.2f} -> {paper[1]:.2f})"


def x_claims(preset, rows, fits, ref, out, lrs):
    """The claims table of an [X] ladder with every architecture's seeds: the looped and grown architectures
    against Vanilla (ahead; rising), Operator-1 against Vanilla, growth against its non-grown twin, untied
    against tied, the fitted exponents; and what its LRs cannot tell."""
    records = {a: [dict(C=r["C"], value=r["measured"], lo=r["measured_lo"], hi=r["measured_hi"]) for r in rec]
               for a, rec in out["multipliers"].items()}
    looped = [a for a in records if a != "operator-1" and (a, ref) in X_PAPER_MULTIPLIERS]
    got = [(a, r) for a in looped for r in records[a] if r["value"] is not None]
    claims = []
    if got:
        paper = [v for a in looped for v in X_PAPER_MULTIPLIERS[a, ref]]
        (a_lo, r_lo), (a_hi, r_hi) = min(got, key=lambda p: p[1]["value"]), max(got, key=lambda p: p[1]["value"])
        above = sum(r["lo"] is not None and r["lo"] > 1 for _, r in got)
        claims.append((f"every looped or grown architecture needs less compute than {ref} (multiplier > 1)",
                       interval_verdict([(r["lo"], r["hi"]) for _, r in got], 1.0),
                       f"{above} of {len(got)} bands above 1, from {r_lo['value']:.2f} [{fmt(r_lo['lo'], '.2f')}, "
                       f"{fmt(r_lo['hi'], '.2f')}] ({a_lo}, {r_lo['C']:.2g}) to {r_hi['value']:.2f} "
                       f"[{fmt(r_hi['lo'], '.2f')}, {fmt(r_hi['hi'], '.2f')}] ({a_hi}, {r_hi['C']:.2g}) ([X]: "
                       f"{min(paper):.2f}..{max(paper):.2f})"))
        trend = {a: rises(records[a]) for a in looped}
        claims.append(("their multipliers rise with budget (the exponent gains)",
                       "reproduces" if set(trend.values()) == {"reproduces"} else "does not"
                       if "does not" in trend.values() and "reproduces" not in trend.values() else "cannot tell",
                       "; ".join(f"{a} {g[0]['value']:.2f} -> {g[-1]['value']:.2f}" for a in looped
                                 for g in [[r for r in records[a] if r["value"] is not None]] if g)
                       + f" (the last band below the first for {sum(v == 'does not' for v in trend.values())} of "
                         f"{len(trend)})"))
    if "operator-1" in records and ("operator-1", ref) in X_PAPER_MULTIPLIERS:
        claims.append((f"the boundary operator alone (Operator-1) needs less compute than {ref}, more so with budget",
                       *multiplier_claim(records["operator-1"], X_PAPER_MULTIPLIERS["operator-1", ref])))
    for key, rec in out.get("pairs", {}).items():
        arm, base = key.split("/")
        grows = arm.endswith("-grow") and not base.endswith("-grow")  # growth vs its twin; else untied vs tied
        claims.append((f"growing beats not growing ({arm} vs {base}), more so with budget" if grows else
                       f"untied beats tied ({arm} vs {base}) by a constant factor",
                       *multiplier_claim(rec, X_PAPER_MULTIPLIERS[arm, base], rising=grows)))
    if fits[ref].E < 1e-3:  # at its lower bound: the exponents are not [X]'s
        gammas = [f.gamma for f in fits.values()]
        claims.append(("the exponents of the shared-E laws [X7] order the architectures", "cannot tell",
                       f"{ref}'s free fit puts E at its bound ({fits[ref].E:.4f}): gamma {min(gammas):.3f}.."
                       f"{max(gammas):.3f}, not comparable with [X]'s"))
    lines = claims_lines(claims)
    steps = [r["D"] / tokens_per_step(preset) for r in rows if r["depth"] == preset.depths[0]]
    if lrs and preset.lr_sweep and preset.lr_sweep.at_every_depth:
        lines.append(depth_sweep_caveat(preset, lrs))
    elif lrs and preset.lr_sweep:
        same = len(set(lrs.values())) == 1
        lines.append(f"cannot tell either: every LR comes from one sweep at d{preset.depths[0]} ({min(steps):.0f}-"
                     f"{max(steps):.0f} steps; {preset.lr_sweep.seeds} seeds per value) carried up by [X16]"
                     + (f", and all {len(lrs)} architectures peaked at the same grid value "
                        f"({next(iter(lrs.values())):g}; values 2x apart), so the sweep does not tell their optima "
                        "apart" if same else ""))
    return lines


def depth_sweep_caveat(preset, lrs):
    """What a sweep at every depth cannot tell (lrs: {(arch, depth): value}) -> the claims table's last line."""
    sweep = preset.lr_sweep
    ratio, lo, hi = sweep_limits(preset)
    edge = [f"{a} d{d} {v:g}" for (a, d), v in lrs.items() if v <= lo or v >= hi]
    same = len(set(lrs.values())) == 1
    seeds = f"{sweep.seeds} seed{'s' if sweep.seeds > 1 else ''}"
    return (f"cannot tell either: each ladder point's LR is the mean-best of its own sweep ({len(sweep.values)} values "
            f"{ratio:g}x apart, {seeds} per value, at most {sweep.extend} beyond the grid), known to a factor {ratio:g}"
            + (f"; {len(edge)} of {len(lrs)} points peaked at the bracketing limit, their optimum may lie beyond "
               f"({', '.join(edge)})" if edge else "")
            + (f"; all {len(lrs)} points peaked at the same grid value ({next(iter(lrs.values())):g}), so the "
               "sweeps do not tell their optima apart" if same else ""))


def lr_confound_lines(preset, archs, lrs, ref):
    """What carrying each architecture's swept LR up the ladder confounds (with at_every_depth: that nothing is
    carried, each point's own value) -> report lines."""
    key = preset.lr_sweep.key if preset.lr_sweep else None
    if not key or not lrs:
        return []
    if preset.lr_sweep.at_every_depth:
        first, depths = preset.depths[0], sorted({d for _, d in lrs})
        grid = (f"the grid x [X16]'s factor (N_s / N_s,d{first})^beta from d{first} with each architecture's [X] "
                "beta, centred where [X16] predicts the optimum" if preset.lr_beta else "the grid as it is")
        seeds = preset.lr_sweep.seeds
        return [f"  no LR is carried up the ladder: each point trains at the mean-best value over {seeds} "
                f"seed{'s' if seeds > 1 else ''} of its own sweep at its depth ({grid}); the grid value per depth "
                f"(d{depths[0]}..d{depths[-1]}): " + ", ".join(
                    f"{a} " + "/".join(f"{lrs[a, d]:g}" if (a, d) in lrs else "-" for d in depths) for a in archs)]
    if preset.lr_beta:
        first = preset.depths[0]
        return [f"  each LR is the mean-best over {preset.lr_sweep.seeds} seeds at d{first}, carried up "
                f"by [X16] LR x (N_s / N_s,d{first})^beta with each architecture's [X] beta: "
                + ", ".join(f"{a} {lrs[a]:g} (beta {preset.lr_beta[a]:g})" for a in archs if a in lrs)]
    others = [a for a in archs if a != ref]
    return [f"  every LR is tuned at d{preset.depths[0]} only and carried up unchanged (no [X16] rule): "
            + ", ".join(f"{a} {lrs[a]:g}" for a in archs if a in lrs)
            + f"; above d{preset.depths[0]} a difference from {ref} includes how well that LR transfers, for all "
            f"{len(others)} other architectures"]


def equal_depth_lines(rows, archs, depths, ref):
    """The loss table compares equal depth, not equal compute: each architecture's training tokens and
    FLOPs at a depth relative to the reference's there -> report lines."""
    def mean(a, d, key):
        values = [r[key] for r in rows if r["arch"] == a and r["depth"] == d]
        return float(np.mean(values)) if values else float("nan")
    lines = [f"equal depth (the same stored blocks) is not equal compute: training tokens / FLOPs relative to {ref} "
             "at the same depth",
             f"  {'':>12} " + " ".join(f"{f'd{d}':>9}" for d in depths)]
    for a in archs:
        if a == ref:
            continue
        cells = []
        for d in depths:
            tokens, flops = mean(a, d, "D") / mean(ref, d, "D"), mean(a, d, "C") / mean(ref, d, "C")
            cells.append(f"{tokens:.2f}/{flops:.2f}" if np.isfinite(tokens) and np.isfinite(flops) else "-")
        lines.append(f"  {a:>12} " + " ".join(f"{c:>9}" for c in cells))
    return lines


def multiplier_lines(mult, bands, ref, ref_C, out, show_fitted=True):
    """[X6] interpolated (what [X] quotes) and (show_fitted) fitted multipliers with their seed-bootstrap
    bands, the fitted ones marked where extrapolated -> report lines; records into out["multipliers"]."""
    lines = [f"[X6] compute multipliers vs {ref} at its budgets (its mean loss at each depth) [95% seed-bootstrap "
             "band]; '~' = the band includes 1 (within noise)",
             "  interpolated ([X]'s rule and the numbers [X] quotes): the arch's own points, log compute linear in "
             f"loss; '-' = {ref}'s loss there is outside the arch's measured losses (never extrapolated)"]
    if show_fitted:
        lines.append("  fitted: from the shared-E laws; 'x' = extrapolated (the arch's law read outside the compute it "
                     "was measured at)")
    lines.append(f"  {'':>12} {'':>12} " + " ".join(f"{c:>19.3g}" for c in ref_C))
    for a, (measured, fitted, extrapolated) in mult.items():
        band = bands.get(a) or {}
        records = []
        for i, c in enumerate(ref_C):
            (mlo, mhi), (lo, hi) = (_band(band.get(name), i) for name in ("measured", "fitted"))
            records.append(dict(C=float(c), measured=finite_or_none(measured[i]), fitted=finite_or_none(fitted[i]),
                                fitted_lo=finite_or_none(lo), fitted_hi=finite_or_none(hi),
                                measured_lo=finite_or_none(mlo),
                                measured_hi=finite_or_none(mhi), within_noise=within_noise(lo, hi, 1.0),
                                measured_within_noise=(within_noise(mlo, mhi, 1.0) if finite_or_none(measured[i])
                                                       else None),
                                extrapolated=bool(extrapolated[i])))
        kinds = (("interpolated", "measured", None), ("fitted", "fitted", extrapolated))
        for name, key, mark in kinds[:2 if show_fitted else 1]:
            cells = []
            for i, r in enumerate(records):
                value, lo, hi = r[key], r[f"{key}_lo"], r[f"{key}_hi"]
                if value is None:
                    cells.append("-")
                    continue
                noise = within_noise(lo, hi, 1.0)
                cells.append(f"{value:.3f}{'x' if mark is not None and mark[i] else ' '} "
                             f"[{fmt(lo, '.2f')},{fmt(hi, '.2f')}]{'~' if noise else ' '}")
            lines.append(f"  {a if name == 'interpolated' else '':>12} {name:>12} "
                         + " ".join(f"{c:>19}" for c in cells))
        out["multipliers"][a] = records
    return lines


def _band(band, i):
    """(lo, hi) of a bootstrap band at budget i, (None, None) without one."""
    return (float(band[0][i]), float(band[1][i])) if band is not None else (None, None)


def x_plots(preset, f, path):
    """Loss vs compute with the shared-E laws, and the interpolated multipliers with their bands."""
    written = []
    if plots.plot_loss_vs_compute(f["runs"], f["fits"], path("loss_vs_compute.png"),
                                  title=f"[X7] {preset.name}: loss vs training FLOPs, shared-E laws"):
        written.append(path("loss_vs_compute.png"))
    interpolated = {a: m[0] for a, m in f["mult"].items()}  # what [X] quotes; never extrapolated
    bands = {a: tuple(np.where(np.isfinite(interpolated[a]), side, np.nan) for side in b["measured"])
             for a, b in f["bands"].items() if b.get("measured") is not None}  # no band without a value
    if plots.plot_multipliers(f["ref_C"], interpolated, path("multipliers.png"), bands=bands, ref="vanilla",
                              title=f"[X6] {preset.name}: interpolated compute multipliers vs Vanilla "
                                    "(95% seed bootstrap; none extrapolated)"):
        written.append(path("multipliers.png"))
    return written
