"""[X] data-constrained ladder (kind "repeat", [X] Section 5 and Appendix D): every run reads the same tokens
from one of the preset's data budgets (its `arms`: the train split's first U tokens for E epochs; fresh data
the control); the Operator-1 family (K passes of its tied core) at each stored depth; at every (budget, K,
depth) a weight-decay grid bracketed around its best (with `tune`, the LR and weight decay searched together
from the carried LR), the other seeds at the best pair. The report: each K's frontier, the best K per budget
with the seed bootstrap's agreement, K = 1's best loss and the compute looping needs to reach it, the weight
decay and LR optima against stored parameters, and the budgets compared."""

import math
from dataclasses import replace

import numpy as np
from scipy import stats as scipy_stats

import fit
import match
import plots
from ladders import x
from ladders.runs import RunSpec, grid_neighbours, search
from ladders.stats import agreement, contrast, fmt, interpolated_optimum, paired, pooled_std, seed_draws, spreads
from ladders.stats import t_interval
from ladders.sweep import gate_line, lr_sweep, sweep_lines

COLUMNS = ("K", "depth", "width", "wd", "seed", "role", "C", "D", "F", "N", "N_s", "executed", "epochs",
           "unique_tokens", "lr", "loss", "train_loss", "run_id", "seconds")


def arms(preset):
    """[(label, unique tokens, epochs)]: 500k x 4 -> "500kx4"."""
    return [(f"{u // 1000}kx{e:g}" if u % 1000 == 0 else f"{u}x{e:g}", u, e) for u, e in preset["arms"]]


def spec(preset, arm, k, depth, wd, lr, seed, role):
    """One run: epochs x unique tokens (whole steps) at weight decay wd (matrices, embedding and lm head, as
    the [X] code), the global LR lr at the first depth carried to the others by [X16] (x.settings_of)."""
    label, unique, epochs = arm
    cfg = replace(x.config(preset, "operator-1", depth), n_passes=k)
    steps = max(4, math.ceil(epochs * unique / ((preset["train"].get("global_batch")
                                                 or preset["train"]["batch_size"]) * cfg.block_size)))
    settings = x.settings_of(preset, "operator-1", depth, cfg, steps, lr, preset["lr_beta"])
    acc = match.accounting(cfg)
    meta = dict(K=k, depth=depth, width=cfg.n_embd, wd=wd, seed=seed, role=role, N=x.compute_active(cfg),
                N_s=acc["params_stored"], executed=acc["executed_layers"], unique_tokens=unique,
                lr=settings[preset["lr"]["key"]], F=acc["flops_per_token"], grid_lr=lr)
    return RunSpec(f"{label}-k{k}-d{depth}-wd{wd:g}-{preset['lr']['key']}{lr:g}-s{seed}",
                   dict(settings, weight_decay=wd, seed=seed), meta)


def plan(preset, results, train_tokens=None):
    """Every run the ladder needs given the results so far -> (specs, lr_sweep.csv's rows or None): each
    budget's LR sweep (K = 1, the first depth, the sweep's weight decay), then at every (budget, K, depth)
    the search on the first seed, then the other seeds of seeded_passes at its best (LR, weight decay)."""
    lr, seeds, d0, budgets = preset["lr"], preset["seeds"], preset["depths"][0], arms(preset)

    def sweep_runs(point, value):
        arm = next(a for a in budgets if f"{a[0]}-k1" == point[0])
        return [spec(preset, arm, 1, d0, lr["weight_decay"], value, s, "sweep") for s in seeds[:lr["seeds"]]]
    specs, best, rows = lr_sweep(preset, [(f"{a[0]}-k1", None) for a in budgets], sweep_runs, results)
    if best is None:
        return specs, None
    wd_next = grid_neighbours(preset["weight_decays"], preset["wd_extend"])
    lr_next = grid_neighbours(lr["values"], lr["extend"])
    for arm in budgets:
        carried = best[f"{arm[0]}-k1", None]
        for k in preset["passes"]:
            for d in preset["depths"]:
                def runs(v):
                    role = "run" if v[0] == carried else "tune"
                    return [spec(preset, arm, k, d, v[1], v[0], seeds[0], role)]
                tried, top = search([(carried, w) for w in preset["weight_decays"]],
                                    lambda v: [(v[0], w) for w in wd_next(v[1])], runs, results)
                if top and preset["tune"]:  # then the LR and the weight decay together, one step at a time
                    tried, top = search(tried, lambda v: [(n, v[1]) for n in lr_next(v[0])]
                                        + [(v[0], w) for w in wd_next(v[1])], runs, results)
                specs += [s for v in tried for s in runs(v)]
                if top and k in preset["seeded_passes"]:
                    specs += [spec(preset, arm, k, d, top[1], top[0], seed, "seed") for seed in seeds[1:]]
    return specs, rows


def rows(specs, results):
    """runs.csv: every run but the sweep's other values."""
    out = []
    for s in specs:
        r = results.get(s.run_id)
        if r and s.meta["role"] != "sweep":
            row = dict(s.meta, C=r["flops"], D=r["tokens"], F=r["flops"] / r["tokens"], loss=r["val_loss"],
                       epochs=r.get("epochs"), train_loss=r["train_loss"], run_id=s.run_id,
                       seconds=r["seconds"])
            out.append({k: row[k] for k in COLUMNS})
    return out


def envelope(points, budget, interpolate=True):
    """The best loss a family reaches with at most `budget` FLOPs: its points (C, L) (one per stored size),
    log-C linear between neighbouring sizes (interpolate=False: the sizes trained only); inf below its
    smallest compute."""
    C, L = (np.array(v, dtype=float) for v in zip(*sorted(points)))
    best = np.min(L[C <= budget * (1 + 1e-9)], initial=np.inf)
    if interpolate and C[0] <= budget <= C[-1] and len(C) > 1:
        best = min(best, float(np.interp(np.log(budget), np.log(C), L)))
    return best


def reach_compute(points, target):
    """The least compute at which a family's envelope reaches loss <= target ([X6]'s crossing, never
    extrapolated; its smallest size's when that is already there), nan when it never does."""
    C, L = (np.array(v, dtype=float) for v in zip(*sorted(points)))
    return float(C[0]) if L[0] <= target else float(1.0 / fit.compute_multiplier([1.0], [target], C, L)[0])


def analysis(frontier, budgets, interpolate=True):
    """frontier {K: [(C, L)]} -> (the best K per budget (None: none affordable), K = 1's best loss L* and
    its C*, the least compute at which a looped K reaches L*)."""
    best = []
    for b in budgets:
        env = {k: envelope(p, b, interpolate) for k, p in frontier.items()}
        k = min(env, key=env.get)
        best.append(k if np.isfinite(env[k]) else None)
    c_star, l_star = min(frontier[1], key=lambda p: p[1])
    reach = [r for r in (reach_compute(p, l_star) for k, p in frontier.items() if k > 1) if np.isfinite(r)]
    return best, l_star, c_star, min(reach, default=float("nan"))


def drawn_best(pts, budgets, sigma, dof, n_draws, seed):
    """analysis() of every seed-bootstrap draw of the points' seed means -> (the best K (draws, budgets),
    [C*/C per draw])."""
    keys = sorted(pts)
    draws = seed_draws([np.mean(pts[p][1]) for p in keys], [len(pts[p][1]) for p in keys], sigma, max(dof, 1),
                       n_draws, seed)
    best, ratio = [], []
    for means in draws:
        drawn = frontier_of({p: (pts[p][0], [m]) for p, m in zip(keys, means)})
        b, _, c_star, reach = analysis(drawn, budgets)
        best.append([np.nan if v is None else v for v in b])
        ratio.append(c_star / reach)
    return np.array(best, dtype=float).reshape(len(draws), len(budgets)), ratio


def points(preset, rows):
    """A budget's first-seed runs, each (K, depth)'s best of them, and its points {(K, depth): (C, [loss per
    seed])} at that best LR and weight decay."""
    first = [r for r in rows if r["role"] != "seed" and r["seed"] == preset["seeds"][0]]
    top = {}
    for r in first:
        if (r["K"], r["depth"]) not in top or r["loss"] < top[r["K"], r["depth"]]["loss"]:
            top[r["K"], r["depth"]] = r
    pts = {}
    for p, b in top.items():
        reps = sorted((r for r in rows if (r["K"], r["depth"], r["wd"], r["lr"]) == (*p, b["wd"], b["lr"])),
                      key=lambda r: r["seed"] != preset["seeds"][0])  # the seed it was chosen on first
        pts[p] = (float(np.mean([r["C"] for r in reps])), [r["loss"] for r in reps])
    return first, top, pts


def frontier_of(pts):
    """{K: [(C, mean loss)]} in order of stored depth."""
    frontier = {}
    for (k, d), (c, v) in sorted(pts.items()):
        frontier.setdefault(k, []).append((c, float(np.mean(v))))
    return frontier


def arm_lines(preset, arm, rows):
    """One data budget's tables -> (lines, its points {(K, depth): (C, [loss per seed])})."""
    label, unique, epochs = arm
    first, top, pts = points(preset, rows)
    Ks, depths, wds = (sorted({r[key] for r in first}) for key in ("K", "depth", "wd"))
    lines = [f"== budget {label}: {unique:,} unique tokens x {epochs:g} epochs, {rows[0]['D']:,} tokens per "
             f"run; epochs read {min(r['epochs'] for r in rows):.2f}..{max(r['epochs'] for r in rows):.2f}; "
             f"training FLOPs {min(r['C'] for r in rows):.3g}..{max(r['C'] for r in rows):.3g}",
             "validation loss, first seed, by weight decay at each point's best LR (* = the best; WD* = the "
             "parabola's minimum in log WD, < / > = at an edge of those tried; train = the training loss of "
             "the last tenth, gap = val - train)", f"  {'K':>2} {'depth':>5} {'N_s':>8} {'exec':>4} "
             + " ".join(f"{f'wd {w:g}':>9}" for w in wds) + f" {'WD*':>8} {'train':>7} {'gap':>7}"]
    wd_star = {}
    for (k, d), b in sorted(top.items()):
        at = {r["wd"]: r["loss"] for r in first if (r["K"], r["depth"], r["lr"]) == (k, d, b["lr"])}
        star, edge = wd_star[k, d] = interpolated_optimum(list(at), list(at.values()))
        lines.append(f"  {k:>2} {d:>5} {b['N_s']:>8,} {b['executed']:>4} " + " ".join(
            f"{at[w]:8.4f}{'*' if w == b['wd'] else ' '}" if w in at else f"{'-':>9}" for w in wds)
            + f" {'<' * (edge < 0) + '>' * (edge > 0) + format(star, '.3g'):>8} {b['train_loss']:7.4f} "
            f"{b['loss'] - b['train_loss']:7.4f}")
    if any(r["role"] == "tune" for r in first):
        lines += lr_lines(first, top)
    sigma, dof = pooled_std([v for _, v in pts.values()])
    lines += [f"frontier: each K at its best (LR and) weight decay per stored depth, the mean over its n "
              f"seeds; pooled seed std {fmt(sigma, '.4f')} nats ({dof} dof)",
              f"  {'K':>2} " + " ".join(f"{f'd{d} C':>9} {'loss':>6} {'n':>1}" for d in depths)]
    lines += [f"  {k:>2} " + " ".join(f"{pts[k, d][0]:9.3g} {np.mean(pts[k, d][1]):6.4f} {len(pts[k, d][1])}"
                                      if (k, d) in pts else f"{'-':>18}" for d in depths) for k in Ks]
    lines.append("  " + spreads({f"K={k}": [v for (kk, _), (_, v) in sorted(pts.items()) if kk == k] for k in Ks}))
    if 1 not in Ks or len(Ks) < 2 or not dof:
        return lines, pts
    lines += budget_lines(preset, pts, sigma, dof)
    inside = [(top[p]["N_s"], top[p]["executed"], v) for p, (v, edge) in wd_star.items() if edge == 0]
    reg = fit.wd_regression(inside)
    lines.append(f"best weight decay: log WD* = a + b log N_s + c log executed layers over the {len(inside)} "
                 "points whose optimum is inside those tried")
    if reg:
        t = scipy_stats.t.ppf(0.975, len(inside) - 3)
        (b, c, sb, sc) = reg
        lines.append(f"  b (stored) {b:.2f} +- {sb:.2f} [{b - t * sb:.2f}, {b + t * sb:.2f}], c (executed) "
                     f"{c:.2f} +- {sc:.2f} [{c - t * sc:.2f}, {c + t * sc:.2f}]")
    return lines, pts


def lr_lines(first, top):
    """The LR search: the loss by LR (x the LR carried there) at each point's best weight decay, LR* (the
    parabola's minimum), and LR* against stored parameters over the points whose best is inside."""
    carried = {(r["K"], r["depth"]): r["lr"] for r in first if r["role"] == "run"}
    step = lambda r: round(math.log2(r["lr"] / carried[r["K"], r["depth"]]))  # noqa: E731  (LR x 2^step)
    steps = sorted({step(r) for r in first})
    lines = ["LR searched with the weight decay, first seed: the loss by LR (x the carried LR) at the "
             "point's best weight decay (* = the best, LR* = the parabola's minimum, < / > at an edge, - = "
             "not tried)",
             f"  {'K':>2} {'depth':>5} {'wd':>6} " + " ".join(
                 f"{f'x{2.0 ** j:g}' if j >= 0 else f'x1/{2 ** -j}':>9}" for j in steps) + f" {'LR*':>7}"]
    inside = []
    for (k, d), b in sorted(top.items()):
        at = {step(r): r["loss"] for r in first if (r["K"], r["depth"], r["wd"]) == (k, d, b["wd"])}
        star, edge = interpolated_optimum([2.0 ** j for j in at], list(at.values()))
        inside += [(b["N_s"], star * carried[k, d])] * (edge == 0)
        lines.append(f"  {k:>2} {d:>5} {b['wd']:>6g} " + " ".join(
            f"{at[j]:8.4f}{'*' if j == step(b) else ' '}" if j in at else f"{'-':>9}" for j in steps)
            + f" {'<' * (edge < 0) + '>' * (edge > 0) + format(star, '.3g'):>7}")
    if len({n for n, _ in inside}) >= 3:
        line, t = scipy_stats.linregress(*np.log(inside).T), scipy_stats.t.ppf(0.975, len(inside) - 2)
        slope, se = line.slope, line.stderr
        tpp = [first[0]["D"] / n for n, _ in inside]
        lines.append(f"  LR* ~ N_s^{slope:.2f} +- {se:.2f} [{slope - t * se:.2f}, {slope + t * se:.2f}] over "
                     f"the {len(inside)} points whose best is inside, at fixed tokens: {max(tpp):.3g} down "
                     f"to {min(tpp):.3g} tokens per stored parameter ([X16]'s beta holds them fixed)")
    return lines


def budget_lines(preset, pts, sigma, dof):
    """The best K per training budget with the seed bootstrap, the lowest loss of each K and K = 1 against
    the best looped K, and C*/C: the compute at which looping reaches K = 1's best loss."""
    frontier, n = frontier_of(pts), preset["bootstrap"]
    budgets = np.geomspace(min(c for c, _ in pts.values()), max(c for c, _ in pts.values()), 9)
    best, l_star, c_star, reach = analysis(frontier, budgets)
    draws, ratios = drawn_best(pts, budgets, sigma, dof, n, 1337)
    start = next((i for i, b in enumerate(budgets)  # the smallest budget at which two K are affordable
                  if sum(np.isfinite(envelope(p, b)) for p in frontier.values()) > 1), len(budgets) - 1)
    switch = next((i for i in range(start, len(budgets)) if best[i] > 1), None)
    switches = [next((i for i in range(start, len(budgets)) if row[i] > 1), None) for row in draws]
    measured = analysis(frontier, budgets, interpolate=False)[0]
    lines = [f"best K per training budget: the lowest loss any size of it reaches with at most that compute, "
             f"log-C linear between the sizes trained (measured: those sizes only); of {n} seed-bootstrap "
             "draws (of the first rule), agree = the share with the same best K, K > 1 = the share where a "
             "looped K is best", "  budget  " + " ".join(f"{b:>8.3g}" for b in budgets),
             "  best K  " + " ".join(f"{'-' if k is None else k:>8}" for k in best),
             "  measured" + " ".join(f"{'-' if k is None else k:>8}" for k in measured),
             "  agree   " + " ".join(f"{s:>8.3f}" for s in agreement(draws, [np.nan if k is None else k
                                                                          for k in best])),
             "  K > 1   " + " ".join(f"{s:>8.3f}" for s in (draws > 1).mean(axis=0)),
             f"  the first budget a looped K is best at (from {budgets[start]:.3g}): "
             + ("none" if switch is None else f"{budgets[switch]:.3g}") + ", the same in "
             f"{np.mean([s == switch for s in switches]):.2f} of the draws; the best K at the largest budget "
             f"exceeds that at {budgets[start]:.3g} in {np.mean(draws[:, -1] > draws[:, start]):.2f} of them"]
    lowest = {k: min((d for kk, d in pts if kk == k), key=lambda d: np.mean(pts[k, d][1])) for k in frontier}
    parts = []
    for k, d in lowest.items():
        v, largest = pts[k, d][1], d == max(dd for kk, dd in pts if kk == k)
        lo, hi = t_interval(np.mean(v), sigma, len(v), dof)
        parts.append(f"K={k} {np.mean(v):.4f} (d{d}{', the largest' * largest}, n={len(v)}) [{lo:.4f}, "
                     f"{hi:.4f}]")
    lines.append("  the lowest loss of each K (its best stored size) [95% t-interval]: " + ", ".join(parts))
    loop, d, half, noise = k1_minus_loop(pts)
    lo, hi = np.nanpercentile(ratios, [2.5, 97.5]) if np.isfinite(ratios).any() else (np.nan, np.nan)
    return lines + [f"  K = 1 minus K = {loop}: {d:+.4f} nats [{d - half:+.4f}, {d + half:+.4f}], paired by seed "
                    f"(the per-seed differences' std {fmt(noise.get('point_sigma'), '.4f')} pooled over "
                    f"{len(noise['means'])} depths, {noise['dof']} dof)",
                    f"K = 1's best loss L* = {l_star:.4f} at C* = {c_star:.3g}; a looped K reaches it at C = "
                    f"{fmt(reach, '.3g')}: C*/C = {fmt(c_star / reach, '.2f')} [95% band {fmt(lo, '.2f')}, "
                    f"{fmt(hi, '.2f')}; reached in {np.mean(np.isfinite(ratios)):.2f} of the draws]"]


def k1_minus_loop(pts):
    """K = 1's lowest loss (its best stored size) minus the best looped K's, paired by seed (a seed fixes the
    data order, and at one depth the draws): the per-seed differences' spread pooled over the depths where
    both K have every seed -> (the looped K, the difference, its 95% half-width, the pooled noise)."""
    lowest = {k: min((d for kk, d in pts if kk == k), key=lambda d: np.mean(pts[k, d][1])) for k, _ in pts}
    loop = min((k for k in lowest if k > 1), key=lambda k: np.mean(pts[k, lowest[k]][1]))
    a, b = pts[1, lowest[1]][1], pts[loop, lowest[loop]][1]
    noise = paired({d: [x - y for x, y in zip(pts[1, d][1], pts[loop, d][1])] for k, d in pts
                    if k == 1 and (loop, d) in pts and len(pts[1, d][1]) == len(pts[loop, d][1]) > 1})
    d = float(np.mean(a) - np.mean(b))
    half = d - t_interval(d, noise["point_sigma"], len(a), noise["dof"])[0] if noise["dof"] else np.nan
    return loop, d, half, noise


def summary(preset, rows, sweep=None):
    """The README figure's rows: per data budget, K = 1 minus the best looped K at their best sizes (equal
    tokens; + where looping pays)."""
    out = []
    for label, unique, _ in arms(preset):
        loop, d, half, _ = k1_minus_loop(points(preset, [r for r in rows if r["unique_tokens"] == unique])[2])
        out.append((f"{preset['name']}, {label}: K = {loop} vs K = 1 at equal tokens", d, d - half, d + half))
    return out


def looping_gain(pts, chosen_on=slice(None), reported_on=slice(None)):
    """K = 1's lowest seed-mean loss (its best stored size) minus the best looped K's -> (gain, K, the losses
    of both points): the sizes and K chosen on the seeds `chosen_on`, the losses those of `reported_on`."""
    lowest = lambda ks: min((p for p in pts if p[0] in ks),  # noqa: E731
                            key=lambda p: np.mean(pts[p][1][chosen_on]))
    k1, loop = lowest({1}), lowest({k for k, _ in pts if k > 1})
    a, b = pts[k1][1][reported_on], pts[loop][1][reported_on]
    return np.mean(a) - np.mean(b), loop[0], a, b


def across_lines(preset, sections):
    """The budgets compared: the best K per training budget with one joint seed bootstrap (the seed std
    pooled over every budget), and the looping gain of the most repeated budget minus the fresh one's."""
    sigma, dof = pooled_std([v for _, pts in sections for _, v in pts.values()])
    allC = [c for _, pts in sections for c, _ in pts.values()]
    n, top = preset["bootstrap"], max(preset["passes"])
    budgets = np.geomspace(min(allC), max(allC), 9)
    lines = [f"== across the budgets: the best K per training budget (one seed bootstrap of {n} draws on the "
             f"seed std {sigma:.4f} pooled over every budget, {dof} dof; agree = the share of draws with the "
             "same best K)", "  budget           " + " ".join(f"{b:>8.3g}" for b in budgets)]
    draws = {}
    for i, (arm, pts) in enumerate(sections):
        best = np.array([np.nan if k is None else k for k in analysis(frontier_of(pts), budgets)[0]])
        measured = analysis(frontier_of(pts), budgets, interpolate=False)[0]
        drawn = draws[arm[0]] = drawn_best(pts, budgets, sigma, dof, n, 1337 + 1 + i)[0]
        low = np.mean(np.nan_to_num(drawn, nan=1).max(axis=1) <= 2)
        lines += [f"  {arm[0]:>8} best K  " + " ".join(f"{'-' if np.isnan(k) else int(k):>8}" for k in best),
                  f"  {'':>8} measured" + " ".join(f"{'-' if k is None else k:>8}" for k in measured),
                  f"  {'':>8} agree   " + " ".join(f"{s:>8.3f}" for s in agreement(drawn, best)),
                  f"  {'':>8} K <= 2 at every budget in {low:.3f} of the draws; the largest K tried "
                  f"({top}) at the largest budget in {np.mean(drawn[:, -1] == top):.3f}"]
    fresh, repeated = (f(sections, key=lambda s: s[0][2])[0][0] for f in (min, max))
    lines.append(f"  the best K at the largest budget is larger with {repeated} than with {fresh} in "
                 f"{np.mean(draws[repeated][:, -1] > draws[fresh][:, -1]):.3f} of the draws")
    gains = {arm[0]: looping_gain(pts) for arm, pts in sections}
    lines.append("  looping gain (K = 1's lowest loss minus the best looped K's, each at its best stored "
                 "size): " + ", ".join(f"{a} {g:+.4f} (K = {k})" for a, (g, k, *_) in gains.items()))
    lines += gain_differences(gains, fresh, repeated, sigma, dof)
    if preset.get("tune"):  # every choice made on the first seed: the same read on the others alone
        held = {arm[0]: looping_gain(pts, slice(0, 1), slice(1, None)) for arm, pts in sections}
        lines += [f"  held out: LR, weight decay, each K's size and the best looped K chosen on seed "
                  f"{preset['seeds'][0]}, the losses of the other seeds: looping gain "
                  + ", ".join(f"{a} {g:+.4f} (K = {k})" for a, (g, k, *_) in held.items())]
        lines += gain_differences(held, fresh, repeated, sigma, dof, "  held out: ")
    return lines


def gain_differences(gains, fresh, repeated, sigma, dof, prefix="  "):
    """Each repeated budget's looping gain minus the fresh one's, the most repeated first."""
    lines = []
    for arm in [repeated] + [a for a in gains if a not in (fresh, repeated)]:
        (_, _, r1, rk), (_, _, f1, fk) = gains[arm], gains[fresh]
        e = contrast([(s, np.mean(v), len(v)) for s, v in ((1, r1), (-1, rk), (-1, f1), (1, fk))], sigma, dof)
        lines.append(f"{prefix}the gain with {arm} minus the gain with {fresh}: {e['diff']:+.4f} nats [95% "
                     f"t-interval {e['lo']:+.4f}, {e['hi']:+.4f}], p = {e['p']:.3f}")
    return lines


def report(preset, rows, sweep):
    """The report's lines from runs.csv's rows and lr_sweep.csv's: the sweep, each budget's tables, the
    budgets compared."""
    lines = [f"== {preset['name']}: [X] data-constrained, the Operator-1 family (K passes of a tied core) at "
             f"width {preset['width_per_depth']} x stored depth; every run reads the same tokens from one of "
             + ", ".join(f"{u:,} unique x {e:g}" for _, u, e in arms(preset))]
    if sweep:
        lines += sweep_lines(sweep) + [
            f"  each budget's LR (its k1 row) carried to every K and by [X16] with beta "
            f"{preset['lr_beta']:g} from d{preset['depths'][0]}"
            + ("; every point searches its own from there" if preset["tune"] else ""), gate_line(sweep)]
    sections = []
    for arm in arms(preset):
        mine = [r for r in rows if r["unique_tokens"] == arm[1]]
        if mine:
            arm_text, pts = arm_lines(preset, arm, mine)
            lines += [""] + arm_text
            sections.append((arm, pts))
    passes = [{k for k, _ in p} for _, p in sections]
    if len(sections) > 1 and all(len(ks) > 1 and 1 in ks for ks in passes):
        lines += [""] + across_lines(preset, sections)
    return lines


def figures(preset, rows, path, out=None):
    """Per budget: each K's frontier (loss vs compute at its best weight decay per size) and the loss
    against the weight decay at every stored depth (first seed)."""
    written = []
    for label, unique, _ in arms(preset):
        first, top, pts = points(preset, [r for r in rows if r["unique_tokens"] == unique])
        frontier, name = frontier_of(pts), f"{preset['name']}, {label}"
        curves = {f"K={k}": {d: [(r["wd"], r["loss"]) for r in first if (r["K"], r["depth"], r["lr"]) == (
            k, d, top[k, d]["lr"])] for d in preset["depths"] if (k, d) in top} for k in preset["passes"]}
        if 1 in frontier and plots.plot_repeat_frontier(
                frontier, pts, min(v for _, v in frontier[1]), path(f"{label}-frontier.png"),
                title=f"{name}: each K at its best weight decay per stored size"):
            written.append(path(f"{label}-frontier.png"))
        if top and plots.plot_wd_curves(curves, path(f"{label}-weight_decay.png"),
                                        title=f"{name}: validation loss vs weight decay (first seed)"):
            written.append(path(f"{label}-weight_decay.png"))
    return written
