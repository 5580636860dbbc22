"""Why SMELT's second visit earns nothing where [X]'s Loop-2 earns 0.1 nats (kind
"recipe"): five causes at an [S] level s and an [X] level x, in a half fraction."""

import functools
import itertools
import math

import numpy as np
from scipy import stats as scipy_stats

import match
import plots
from ladders import x
from ladders.runs import RunSpec, run_rows
from ladders.smelt import compute_active, model_settings, vocab
from ladders.stats import paired, pooled_std, spreads
from ladders.sweep import lr_sweep, sweep_lines, unbracketed
from model import ModelConfig

# Each cause: (what, its [S] level s, its [X] level x).
FACTORS = {"R": ("the loop's updates", "scaled by 1/r", "unscaled"),
           "M": ("the FFN", "an MoE", "dense"), "O": ("the optimizer", "AdamW", "[X]'s Muon"),
           "S": ("the loop's shape", "SMELT's", "prelude-core-coda"),
           "P": ("the model recipe", "[S]'s", "Loop-2's")}
COLUMNS = "config arm steps seed F D C loss lr run_id seconds".split()
CORNERS = ("sssss", "xxxxx")


def configs():
    """The half fraction I = RMOS: a level per cause, in the order RMOSP."""
    # Resolution IV, both corners in it.
    return ["".join(c) for c in itertools.product("sx", repeat=5) if c[:4].count("x") % 2 == 0]


def training(arch, o, lr, steps):
    """train.py settings of optimizer level o at matrix LR lr."""
    # s: AdamW as in the [S] presets.
    if o == "s":
        return dict(optimizer="adamw", matrix_lr=lr, warmup_steps=10, decay_fraction=0.3)
    # x: the [X] recipe of arch at [X]'s global LR.
    _, t, warmup = x.recipe(arch)
    ratios = {k: float(f"{lr * t[k] / t['matrix_lr']:.12g}")
              for k in ("embedding_lr", "unembedding_lr")}
    return dict(t, matrix_lr=lr, warmup_steps=round(warmup * steps), **ratios)


def model_of(preset, code, looped):
    """A configuration's ModelConfig."""
    # Looped: the middle 2 of 4 layers run twice.
    r, m, o, s, p = code
    # Level x takes Loop-2's recipe,
    # s only its alpha.
    recipe = x.recipe("loop-2")[0]
    own = {k: v for k, v in recipe.items() if k not in ("layout", "n_passes", "n_expert")}
    kept = own if p == "x" else {"boundary_alpha": recipe["boundary_alpha"]}
    layout = "pcc" if s == "x" else "smelt" if looped else "plain"
    shape = dict(preset["model"], **kept, n_expert=preset["experts"] if m == "s" else 0,
                 n_passes=1 + looped, layout=layout)
    return ModelConfig(**vocab(preset), **shape)


def spec(preset, name, cfg, settings, steps, seed, fields=None, **meta):
    lr = settings["matrix_lr"]
    run = dict(preset["train"], **settings, **model_settings(cfg), seed=seed, max_steps=steps,
               eval_interval=steps)
    meta = dict(dict(grid_lr=lr) | meta, steps=steps, seed=seed, lr=lr,
                F=match.flops_per_token(cfg), N=compute_active(cfg))
    return RunSpec(f"{name}-t{steps}-lr{lr:g}-s{seed}", run, meta, model=fields)


def plan(preset, results, train_tokens=None):
    """Every run the design needs, given the results so far."""
    # The LR factor is swept per (optimizer, model
    # recipe) on the calibration seed.
    # The sweep runs at the smaller budget.
    low, base = min(preset["steps"]), preset["base_lr"]

    def sweep_runs(point, value):
        o, p = point[0]
        cfg = model_of(preset, "sx" + o + "s" + p, False)
        settings = training("loop-2", o, base[o] * value, low)
        return [spec(preset, f"sweep-{o}{p}", cfg, settings, low, preset["calibration_seed"],
                     config=f"sweep-{o}{p}", arm="sweep", grid_lr=value)]
    points = [(o + p, None) for o in "sx" for p in "sx"]
    specs, best, rows = lr_sweep(preset, points, sweep_runs, results)
    if best is None:
        return specs, None
    # Each configuration looped and not, per budget and seed.
    grid = itertools.product(configs(), (0, 1), preset["steps"], preset["seeds"])
    for code, looped, steps, seed in grid:
        o = code[2]
        settings = training("loop-2", o, base[o] * best[o + code[4], None], steps)
        scale = {"loop_scale": "1/r" if code[0] == "s" else "1"}
        arm = "loop" if looped else "base"
        specs.append(spec(preset, f"{code}-{arm}", model_of(preset, code, looped), settings,
                          steps, seed, scale, config=code, arm=arm))
    own = ModelConfig(**vocab(preset), **dict(preset["model"], **x.recipe("operator-1")[0]))
    for steps, seed in itertools.product(preset["steps"], preset["seeds"]):
        settings = training("operator-1", "x", base["x"] * best["xx", None], steps)
        specs.append(spec(preset, "operator-1", own, settings, steps, seed,
                          config="operator-1", arm="base"))
    return specs, rows


# runs.csv: a row per finished run of the report's seeds.
rows = functools.partial(run_rows, columns=COLUMNS)


def per_flop(base, loop):
    """The unlooped loss at the looped run's compute, minus its loss."""
    # Log-C linear between the two budgets, never
    # extrapolated.
    (c1, l1), (c2, l2) = sorted(base)
    if not c1 <= loop[0] <= c2:
        return math.nan
    return float(np.interp(math.log(loop[0]), [math.log(c1), math.log(c2)], [l1, l2])) - loop[1]


def gains_of(rows):
    """(the rows by key, the budgets, the seeds, the loop's gains)."""
    by = {(r["config"], r["arm"], r["steps"], r["seed"]): r for r in rows}
    steps, seeds = sorted({r["steps"] for r in rows}), sorted({r["seed"] for r in rows})
    # A gain: the unlooped loss minus the looped one.
    gains = {(c, t): [by[c, "base", t, s]["loss"] - by[c, "loop", t, s]["loss"] for s in seeds]
             for c in configs() for t in steps
             if all((c, a, t, s) in by for a in ("base", "loop") for s in seeds)}
    return by, steps, seeds, gains


def report(preset, rows, sweep):
    by, steps, seeds, gains = gains_of(rows)
    codes = configs()
    levels = "; ".join(f"{k} {what}, {s} or {x_}" for k, (what, s, x_) in FACTORS.items())
    lines = [f"== {preset['name']}: why the second visit pays in [X] and not in [S]; a "
             "configuration names each cause's level, s ([S]'s) or x ([X]'s), in the order: "
             f"{levels}; seeds {', '.join(map(str, seeds))}"]
    if sweep:
        lines += sweep_lines(sweep) + [
            f"  a factor of the optimizer's base matrix LR ({preset['base_lr']}), swept on the "
            f"calibration seed {preset['calibration_seed']} only"]
    if len(gains) < len(codes) * len(steps) or not rows:
        return lines + ["not every run has finished"]
    # A run's loss by (config, arm, steps, seed).
    def loss(c, a, t, s):
        return by[c, a, t, s]["loss"]
    lines.append(spreads({a: [[loss(c, a, t, s) for s in seeds] for c in codes for t in steps]
                          for a in ("base", "loop")}))
    sigma, dof = pooled_std(gains.values())
    half = scipy_stats.t.ppf(0.975, dof) * sigma / math.sqrt(len(seeds))
    lines += ["the loop's gain: unlooped minus looped at equal tokens (+: the loop pays), paired "
              f"by seed, and per FLOP at {steps[0]} steps (the unlooped loss log-C interpolated to "
              f"the looped run's compute); each +- {half:.4f} (95%, the gains' seed std "
              f"{sigma:.4f} pooled over the configurations and budgets, {dof} dof)",
              f"  {'config':>7} " + " ".join(f"{f'unlooped {t}':>12} {f'looped {t}':>10} "
                                             f"{f'gain {t}':>8}" for t in steps)
              + f" {'per FLOP':>9}"]
    # Per configuration: both budgets, then per FLOP.
    for c in codes:
        def mean(a, t):
            return np.mean([loss(c, a, t, s) for s in seeds])
        cells = [f"{mean('base', t):12.4f} {mean('loop', t):10.4f} {np.mean(gains[c, t]):+8.4f}"
                 for t in steps]
        flop = [per_flop([(by[c, "base", t, s]["C"], loss(c, "base", t, s)) for t in steps],
                         (by[c, "loop", steps[0], s]["C"], loss(c, "loop", steps[0], s)))
                for s in seeds]
        lines.append(f"  {c:>7} " + " ".join(cells) + f" {np.mean(flop):+9.4f}")
    # The causes, then the two corners.
    z, effect_lines = effects(codes, gains, sigma, dof)
    lines += effect_lines + ["the loop's gain at each corner, over both budgets, paired:"]
    for who, c in zip(("[S]", "[X]"), CORNERS):
        g = paired({t: gains[c, t] for t in steps})
        lines.append(f"  {who}'s ({c}) {g['diff']:+.4f} [{g['lo']:+.4f}, {g['hi']:+.4f}]")
    lines.append("Operator-1 with its own [X] recipe (its init, residual multiplier 1/2, alpha "
                 "1, schedule) on the same tokens and seeds, paired, over both budgets:")
    # Operator-1 minus the [X] corner, looped and not.
    own = {other: paired({t: [loss("operator-1", "base", t, s) - loss("xxxxx", other, t, s)
                              for s in seeds] for t in steps}) for other in ("loop", "base")}
    for other, what in (("loop", "x-cpu-mini's comparison, minus the [X] corner looped (Loop-2)"),
                        ("base", "its recipe alone, minus the [X] corner unlooped")):
        c = own[other]
        lines.append(f"  {what}: {c['diff']:+.4f} nats [{c['lo']:+.4f}, {c['hi']:+.4f}] = "
                     f"{c['z']:+.1f} sigma")
    return lines + rule(preset, by, steps, seeds, sweep, z, own)


def effects(codes, gains, sigma, dof):
    """Each cause's effect on the gain -> (z, lines)."""
    # An effect: the mean gain at the x level minus at s.
    # An interaction: levels alike minus unlike.
    # The gains at either level of a cause.
    # Half the gains sit at either level of a cause.
    n = sum(len(v) for v in gains.values()) // 2
    # Either level's mean has n gains.
    s = sigma * math.sqrt(2 / n)
    half = scipy_stats.t.ppf(0.975, dof) * s
    lines = [f"each cause's effect on the gain, its x level's minus its s level's (sigma {s:.4f}: "
             f"the pooled noise x sqrt(2 / {n})); two-factor interactions, levels alike minus "
             "levels unlike (RM = OS, RO = MS, RS = MO)"]
    # I = RMOS aliases interactions in pairs.
    pairs = [t for t in itertools.combinations(FACTORS, 2) if t[0] == "R" or "P" in t]
    z = {}
    for term in [(k,) for k in FACTORS] + pairs:
        at = [list(FACTORS).index(k) for k in term]
        alike = {c: c[at[0]] == "x" if len(at) == 1 else c[at[0]] == c[at[1]] for c in codes}
        e = np.mean([v for (c, _), vs in gains.items() for v in vs if alike[c]]) - \
            np.mean([v for (c, _), vs in gains.items() for v in vs if not alike[c]])
        z["".join(term)] = e / s
        what = FACTORS[term[0]]
        name = (f"{what[2]} vs {what[1]}" if len(term) == 1
                else " x ".join(FACTORS[k][0] for k in term))
        lines.append(f"  {''.join(term):>3} {name:<44} {e:+.4f} nats [{e - half:+.4f}, "
                     f"{e + half:+.4f}] = {e / s:+.1f} sigma")
    return z, lines


def gate(by, steps, seeds, sweep):
    """What failed of the instrument."""
    # Each LR must be bracketed, and every arm's loss
    # fall from the smaller budget to the larger.
    # Every (config, arm) that ran.
    arms = [(c, a) for c in configs() + ["operator-1"] for a in ("base", "loop")
            if (c, a, steps[0], seeds[0]) in by]
    # An arm that does not learn with more steps.
    stalled = [f"{c} {a} seed {s}" for c, a in arms for s in seeds
               if not by[c, a, steps[-1], s]["loss"] < by[c, a, steps[0], s]["loss"]]
    loose, failed = unbracketed(sweep or []), []
    if loose or not sweep:
        failed.append(f"the LR is not bracketed for {', '.join(loose) or 'any pair (no sweep)'}")
    if stalled:
        failed.append(f"the loss does not fall from {steps[0]} to {steps[-1]} steps for "
                      f"{', '.join(stalled)}")
    return failed


def rule(preset, by, steps, seeds, sweep, z, own):
    """The gate, then the rule's reading."""
    failed = gate(by, steps, seeds, sweep)
    if failed:
        return ["no reading: the instrument failed: " + "; ".join(failed)]
    lines = [f"gate: every LR bracketed on seed {preset['calibration_seed']}; every arm's loss "
             f"falls from {steps[0]} to {steps[-1]} steps on every seed",
             "the decision rule's reading:"]
    for k, (what, s, x_) in FACTORS.items():
        more = f"the loop gains more with {x_ if z[k] >= 2 else s}"
        lines.append(f"  {what} ({k}): {more if abs(z[k]) >= 2 else 'within noise'}")
    # The causes that favour [X]'s level.
    carried = ", ".join(FACTORS[k][0] for k in FACTORS if z[k] >= 2)
    lines.append(f"  the corners' gap is carried by "
                 f"{carried or 'none of the five causes beyond noise'}")
    if own["base"]["z"] >= 2:
        lines.append(f"  Operator-1's own recipe costs {own['base']['diff']:+.4f} nats by itself: "
                     "that much of x-cpu-mini's comparison is the recipe, not the loop")
    return lines


def summary(preset, rows, sweep=None):
    """The README figure's rows: the loop's gain at the corners."""
    by, steps, seeds, _ = gains_of(rows)
    failed = " (no reading: its gate failed)" if gate(by, steps, seeds, sweep) else ""
    compared = [(f"the loop at {who}'s corner, equal tokens", c, c)
                for who, c in zip(("[S]", "[X]"), CORNERS)]
    # x-cpu-mini's comparison: Operator-1 with its own recipe minus Loop-2.
    compared.append(("Loop-2 vs Operator-1, their own recipes", "operator-1", "xxxxx"))
    out = []
    for label, base, loop in compared:
        g = paired({t: [by[base, "base", t, s]["loss"] - by[loop, "loop", t, s]["loss"]
                        for s in seeds] for t in steps})
        out.append((f"{preset['name']}: {label}{failed}", g["diff"], g["lo"], g["hi"]))
    return out


def figures(preset, rows, path, out=None):
    """The loop's gain per configuration, a panel per budget."""
    _, steps, seeds, gains = gains_of(rows)
    sigma, dof = pooled_std(gains.values())
    half = scipy_stats.t.ppf(0.975, dof) * sigma / math.sqrt(len(seeds))
    panels = []
    for t in steps:
        means = [(c, float(np.mean(gains[c, t]))) for c in configs()]
        panels.append((f"the loop's gain at {t} steps (nats, + where it pays)",
                       [(c, m, m - half, m + half) for c, m in means]))
    title = f"{preset['name']}: causes in the order R M O S P, s = [S]'s level, x = [X]'s"
    return [path("gains.png")] if plots.plot_contrasts(panels, path("gains.png"), title) else []
