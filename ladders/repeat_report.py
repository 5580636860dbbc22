"""The data-constrained ladder's report ([X] Section 5 and Appendix D.1; the runs: ladders/repeat.py): each K's
frontier at its best weight decay (and LR, where searched) per stored size, the best K per budget (claimed where
the seed bootstrap agrees), the compute at which looping reaches K = 1's best loss, whether the best weight
decay follows stored parameters and the best LR [X16], the comparison across data budgets, the claims table
and the figures."""

import math
import os

import numpy as np
from scipy import stats as scipy_stats

import fit
from fit import wd_regression
from ladders.common import REPO, fmt
from ladders.repeat import repeat_arms
from ladders.stats import (AGREEMENT, agreement, claims_lines, contrast, difference, interpolated_optimum, pooled_std,
                           seed_draws, share_verdict, t_interval, t_quantile)
from tooling import plots, tables


def envelope(points, budget):
    """The best loss a family reaches with at most `budget` FLOPs: its points (C, L) (one per stored
    size), log-C linear between neighbouring sizes; inf below its smallest compute."""
    C, L = (np.array(v, dtype=float) for v in zip(*sorted(points)))
    best = np.min(L[C <= budget * (1 + 1e-9)], initial=np.inf)
    if C[0] <= budget <= C[-1] and len(C) > 1:
        best = min(best, float(np.interp(np.log(budget), np.log(C), L)))
    return best


def reach_compute(points, target):
    """The least compute at which a family's envelope reaches loss <= target: its smallest size's when that
    is already there, else [X6]'s crossing (fit.compute_multiplier: log C linear between neighbouring
    sizes, never extrapolated), nan when it never does."""
    C, L = (np.array(v, dtype=float) for v in zip(*sorted(points)))
    if L[0] <= target:
        return float(C[0])
    return float(1.0 / fit.compute_multiplier([1.0], [target], C, L)[0])


def repeat_analysis(frontier, budgets):
    """frontier: {K: [(C, L)] at the best weight decay of each stored size} -> (best K per budget,
    L* and C* of K = 1's best point, the least compute at which a K >= 2 family reaches L*)."""
    best = []
    for b in budgets:
        env = {k: envelope(p, b) for k, p in frontier.items()}
        k = min(env, key=env.get)
        best.append(k if np.isfinite(env[k]) else None)
    c_star, l_star = min(frontier[1], key=lambda p: p[1])
    reach = [reach_compute(p, l_star) for k, p in frontier.items() if k > 1]
    reach = [r for r in reach if np.isfinite(r)]
    return best, l_star, c_star, (min(reach) if reach else float("nan"))


def repeat_report(preset, rows, sweep=None, n_boot=400, seed=0):
    """The data-constrained ladder's report -> (text, dict, figure data): the weight-decay grid, each K's
    frontier at its best weight decay per stored size (seed means and spread), the best K per budget and
    whether it grows with compute, the compute at which looping reaches the best WD-tuned K = 1 loss, and
    whether the best weight decay follows stored parameters or executed depth; bands from a seed bootstrap.
    A preset with several data budgets (arms): this report per budget, then arms_lines compares them."""
    if preset.arms:
        return arms_report(preset, rows, sweep, n_boot, seed)
    U, epochs = preset.unique_tokens, preset.epochs
    lines = [f"== {preset.name}: [X] data-constrained: {U:,} unique tokens x {epochs} epoch{'s' * (epochs != 1)} per "
             "run, the "
             f"Operator-1 family (K = passes of a tied core) at width {preset.width_per_depth} x stored depth"]
    out = {"preset": preset.name, "points": rows}
    if sweep:
        lines += sweep[0]
        out["lr_sweep"] = sweep[1]
        lines.append(f"  the carried LR scales by [X16] with beta {preset.lr_scaling_beta:g} (the [X] code's "
                     f"Operator-1 ladder) from d{preset.depths[0]}; embedding / lm head LRs keep [X]'s ratios to it"
                     + ("; every (K, depth) searches its own LR from there" if preset.tune_every_point else ""))
    if preset.builds_on and not preset.arm:
        lines += builds_on_lines(preset, rows, sweep)
    first = [r for r in rows if r["role"] != "seed" and r["seed"] == preset.seeds[0]]
    if not first:
        lines.append("no finished runs yet")
        return "\n".join(lines), out, None
    Ks, depths = sorted({r["K"] for r in first}), sorted({r["depth"] for r in first})
    C = [r["C"] for r in rows]
    lines.append(f"epochs read {min(r['epochs'] for r in rows):.2f}..{max(r['epochs'] for r in rows):.2f}; tokens per "
                 f"run {rows[0]['D']:,}; training FLOPs {min(C):.3g}..{max(C):.3g}")
    best_lr = {}  # each (K, depth)'s LR: the one its best first-seed run has (the carried LR unless tuned)
    for r in sorted(first, key=lambda r: r["loss"], reverse=True):
        best_lr[r["K"], r["depth"]] = r["lr"]
    grid = {(r["K"], r["depth"], r["wd"]): r for r in first if r["lr"] == best_lr[r["K"], r["depth"]]}
    table, best_wd, wd_star = repeat_wd_table(grid, Ks, depths, sorted({w for _, _, w in grid}))
    lines += table
    tuned = {}
    if any(r["role"] == "tune" for r in first):
        table, tuned = repeat_lr_table(first, best_wd, Ks, depths)
        lines += table + lr_exponent_lines(tuned, preset.lr_scaling_beta, out)
        out["lr_search"] = {f"K{k}-d{d}": v for (k, d), v in tuned.items()}
    pts = {}  # each K's frontier: its best (LR,) weight decay at every stored size, every seed of that point
    for (k, d), w in best_wd.items():
        reps = [r for r in rows if r["K"] == k and r["depth"] == d and r["wd"] == w and r["lr"] == best_lr[k, d]]
        pts[k, d] = (float(np.mean([r["C"] for r in reps])), [r["loss"] for r in reps])
    sigma, dof = pooled_std([v for _, v in pts.values()])
    sigma = sigma or 0.0
    spreads = [v for _, v in pts.values() if len(v) > 1]
    out["seed_spread"] = dict(pooled_std=sigma, dof=dof, points=len(spreads))
    lines.append(f"frontier: each K at its best {'LR and ' * bool(tuned)}weight decay per stored depth (mean over "
                 "seeds; n = seeds); pooled "
                 f"seed std {sigma:.4f} nats over {len(spreads)} points with several seeds ({dof} degrees of freedom)")
    lines.append(f"  {'K':>2} " + " ".join(f"{f'd{d} C':>9} {'loss':>6} {'n':>1}" for d in depths))
    for k in Ks:
        cells = [f"{pts[k, d][0]:9.3g} {np.mean(pts[k, d][1]):6.4f} {len(pts[k, d][1])}" if (k, d) in pts
                 else f"{'-':>18}" for d in depths]
        lines.append(f"  {k:>2} " + " ".join(cells))
    frontier = {k: [(pts[k, d][0], float(np.mean(pts[k, d][1]))) for d in depths if (k, d) in pts] for k in Ks}
    out["frontier"] = {str(k): v for k, v in frontier.items()}
    if 1 not in frontier or len(frontier) < 2:
        lines.append("the comparison needs K = 1 and another K: nothing to compare yet")
        return "\n".join(lines), out, None
    lines += repeat_budget_lines(frontier, pts, (sigma, dof), n_boot, seed, out)
    lines += repeat_wd_lines(grid, best_wd, wd_star, Ks, depths, out)
    lines += repeat_claims(preset, out, pts, best_wd, tuned)
    figures = dict(frontier=frontier, pts=pts, l_star=out["L_star"], grid=grid, Ks=Ks, depths=depths,
                   wds=sorted({w for _, _, w in grid}))
    return "\n".join(lines), out, figures


def repeat_wd_table(grid, Ks, depths, wds):
    """The weight-decay grid's lines (first seed) -> (lines, {(K, depth): best WD}, {(K, depth): (WD*, edge)})."""
    lines = ["validation loss, first seed, by weight decay (* = the best at that K and stored depth; WD* = the "
             "parabola's minimum in log WD, '<' / '>' = at the edge of what it tried)",
             f"  {'K':>2} {'depth':>5} {'N_s':>8} {'exec':>4} " + " ".join(f"{f'wd {w:g}':>9}" for w in wds)
             + f" {'WD*':>8} {'train':>7} {'gap':>7}"]
    best_wd, wd_star = {}, {}
    for k in Ks:
        for d in depths:
            cells = [grid.get((k, d, w)) for w in wds]
            have = [(w, c["loss"]) for w, c in zip(wds, cells) if c]
            if not have:
                continue
            bw = best_wd[k, d] = min(have, key=lambda p: p[1])[0]
            x, edge = wd_star[k, d] = interpolated_optimum(*zip(*have))
            ref = grid[k, d, bw]
            train_loss = ref["train_loss"] if ref.get("train_loss") is not None else float("nan")
            lines.append(f"  {k:>2} {d:>5} {ref['N_s']:>8,} {ref['executed']:>4} " +
                         " ".join(f"{c['loss']:8.4f}{'*' if c['wd'] == bw else ' '}" if c else f"{'-':>9}"
                                  for c in cells)
                         + f" {('<' if edge < 0 else '>' if edge > 0 else '') + format(x, '.3g'):>8} "
                           f"{train_loss:7.4f} {ref['loss'] - train_loss:7.4f}")
    lines.append("  train = the mean training loss of the run's last tenth (on the repeated data), gap = val - train "
                 "(> 0: the run fits its unique tokens better than fresh text)")
    return lines, best_wd, wd_star


def builds_on_lines(preset, rows, sweep):
    """A ladder that builds on another's runs: how many of its runs it imported, and whether this checkout
    reproduces them: its LR sweep, retrained here, against the lr_sweep.csv beside the imported runs.csv."""
    lines = [f"builds on {preset.builds_on}: {sum(bool(r.get('imported')) for r in rows)} of these {len(rows)} runs "
             "are its runs, imported (not retrained)"]
    theirs = os.path.join(REPO, preset.builds_on[:-len("runs.csv")] + "lr_sweep.csv")
    if sweep and os.path.exists(theirs):
        pairs = [(r["val_loss"], sweep[1].get(r["arch"], {}).get(str(float(r["value"]))))
                 for r in tables.read_rows_csv(theirs, unique=["arch", "key", "value"])]
        pairs = [(a, b) for a, b in pairs if a is not None and b is not None]
        if pairs:
            lines.append(f"  its LR sweep, retrained here: {len(pairs)} values, the largest difference from its "
                         f"lr_sweep.csv {max(abs(a - b) for a, b in pairs):.2g} nats (0: this checkout trains its runs "
                         "to the same bits)")
    return lines


def lr_times(multiple):
    """An LR as a multiple of the carried one: x2, x1, x1/4."""
    return f"x{multiple:g}" if multiple >= 1 else f"x1/{1 / multiple:g}"


def repeat_lr_table(first, best_wd, Ks, depths):
    """With tune_every_point: each (K, depth)'s LR search at its best weight decay (first seed), in multiples
    of the LR the grid carried there -> (lines, {(K, depth): dict(best: the best multiple, star: LR* as a
    multiple, edge: -1 / +1 where the best is the lowest / highest LR tried, 0 inside)})."""
    carried = {(r["K"], r["depth"]): r["lr"] for r in first if r["role"] == "run"}
    step = lambda r: round(math.log2(r["lr"] / carried[r["K"], r["depth"]]))  # noqa: E731  (LR x 2^step)
    steps = sorted({step(r) for r in first})
    lines = ["LR searched with the weight decay at every (K, stored depth), first seed: validation loss by LR (x the "
             "LR carried there) at the point's best weight decay (* = the best; LR* = the parabola's minimum in log "
             "LR, '<' / '>' = at the edge of what it tried; - = not tried: a neighbour runs only next to the best)",
             f"  {'K':>2} {'depth':>5} {'wd':>6} " + " ".join(f"{lr_times(2.0 ** j):>9}" for j in steps)
             + f" {'LR*':>7}"]
    search = {}
    for k in Ks:
        for d in depths:
            if (k, d) not in best_wd:
                continue
            at = {step(r): r["loss"] for r in first if r["K"] == k and r["depth"] == d and r["wd"] == best_wd[k, d]}
            best = min(at, key=at.get)
            x, edge = interpolated_optimum([2.0 ** j for j in at], list(at.values()))
            n_s = next(r["N_s"] for r in first if r["K"] == k and r["depth"] == d)
            search[k, d] = dict(best=2.0 ** best, star=x, edge=edge, lr_star=x * carried[k, d], N_s=n_s)
            lines.append(f"  {k:>2} {d:>5} {best_wd[k, d]:>6g} "
                         + " ".join(f"{at[j]:8.4f}{'*' if j == best else ' '}" if j in at else f"{'-':>9}"
                                    for j in steps)
                         + f" {('<' if edge < 0 else '>' if edge > 0 else '') + format(x, '.3g'):>7}")
    return lines, search


def lr_exponent_lines(search, beta, out):
    """Does the best LR follow [X16] (LR* ~ N_s^beta, the beta the ladder carried its LR with)? The least-squares
    slope of log LR* on log stored parameters over the points whose best LR is inside what they tried (every K
    at a depth shares N_s: [X] D.3, a tied core's optima move little with K), with its t-interval."""
    inside = [(v["N_s"], v["lr_star"]) for v in search.values() if v["edge"] == 0]
    if len({n for n, _ in inside}) < 3:
        return ["the best LR against stored parameters: fewer than 3 sizes with a bracketed best LR, undecided"]
    fitted = scipy_stats.linregress(np.log([n for n, _ in inside]), np.log([v for _, v in inside]))
    t = t_quantile(len(inside) - 2)
    lo, hi = fitted.slope - t * fitted.stderr, fitted.slope + t * fitted.stderr
    out["lr_exponent"] = dict(slope=fitted.slope, se=fitted.stderr, interval=[lo, hi], points=len(inside), beta=beta)
    return [f"the best LR against stored parameters: LR* ~ N_s^{fitted.slope:.2f} +- {fitted.stderr:.2f} [95% "
            f"t-interval {lo:.2f}, {hi:.2f}] over the {len(inside)} points whose best LR is inside what they tried "
            f"(the carried LR: [X16] with beta {beta:g})"]


def drawn_analyses(pts, budgets, sigma, dof, n_boot, seed):
    """repeat_analysis of every seed-bootstrap draw (stats.seed_draws on each point's seed mean; none without
    seed dof): pts {(K, depth): (C, [loss per seed])} -> [(best K per budget, L*, C*, reach)]."""
    keys = sorted(pts)
    draws = seed_draws([np.mean(pts[p][1]) for p in keys], [len(pts[p][1]) for p in keys], sigma, max(dof, 1),
                       n_boot if dof else 0, seed)
    analyses = []
    for means in draws:
        frontier = {}
        for (k, d), mean in zip(keys, means):
            frontier.setdefault(k, []).append((pts[k, d][0], float(mean)))
        analyses.append(repeat_analysis(frontier, budgets))
    return analyses


def best_k_array(analyses, budgets):
    """The draws' best K per budget as an array (draws, budgets), nan where no K is affordable."""
    return np.array([[np.nan if k is None else k for k in a[0]] for a in analyses],
                    dtype=float).reshape(len(analyses), len(budgets))


def repeat_budget_lines(frontier, pts, noise, n_boot, seed, out):
    """The best K per budget, where a looped K is best, whether the best K grows, the lowest loss of each K,
    and the compute at which K >= 2 reaches K = 1's best loss, with the seed bootstrap (stats.seed_draws:
    every point's seed mean moved by the pooled seed std / sqrt(its seeds) x Student t). noise: (sigma, dof)."""
    sigma, dof = noise
    allC = [c for p in frontier.values() for c, _ in p]
    budgets = np.geomspace(min(allC), max(allC), 9)
    best, l_star, c_star, reach = repeat_analysis(frontier, budgets)
    draws = drawn_analyses(pts, budgets, sigma, dof, n_boot, seed)
    draws_best = best_k_array(draws, budgets)
    draws_ratio = [cs / re for _, _, cs, re in draws]
    share = agreement(draws_best, np.array([np.nan if k is None else k for k in best], dtype=float))
    looped = (draws_best > 1).mean(axis=0) if len(draws) else np.full(len(budgets), np.nan)
    lines = ["best K per training budget (the lowest loss any size of that K reaches with at most that compute); of "
             f"{len(draws)} seed-bootstrap draws, agree = the share with the same best K, K > 1 = the share in which a "
             "looped K is best",
             "  budget  " + " ".join(f"{b:>8.3g}" for b in budgets),
             "  best K  " + " ".join(f"{'-' if k is None else k:>8}" for k in best),
             "  agree   " + " ".join(f"{s:>8.3f}" for s in share),
             "  K > 1   " + " ".join(f"{s:>8.3f}" for s in looped)]
    # from the smallest budget at which two K are affordable (below it K = 1 wins by being the only one)
    start = next((i for i, b in enumerate(budgets) if sum(np.isfinite(envelope(p, b)) for p in frontier.values()) > 1),
                 len(budgets) - 1)
    switch = next((i for i in range(start, len(budgets)) if best[i] > 1), None)  # the first budget a K > 1 wins
    first_looped = [next((i for i in range(start, len(budgets)) if db[i] > 1), -1) for db in draws_best]
    switch_share = float(np.mean([f == (-1 if switch is None else switch) for f in first_looped])) if len(draws) \
        else float("nan")
    sure_k1 = [i for i in range(start, len(budgets)) if looped[i] <= 1 - AGREEMENT]
    sure_loop = [i for i in range(start, len(budgets)) if looped[i] >= AGREEMENT]
    grow_share = float(np.mean(draws_best[:, -1] > draws_best[:, start])) if len(draws) else float("nan")
    lines.append(f"  a looped K is best in >= {AGREEMENT:.2f} of the draws "
                 + (f"from {budgets[sure_loop[0]]:.3g}" if sure_loop else "at no budget") + f", K = 1 in >= "
                 f"{AGREEMENT:.2f} " + (f"up to {budgets[sure_k1[-1]]:.3g}" if sure_k1 else "at no budget")
                 + " (from the smallest budget at which two K are affordable); in between the bootstrap cannot tell")
    if switch is not None:
        lines.append(f"  the switch to a looped K at {budgets[switch]:.3g} (the point estimate): the same budget in "
                     f"{switch_share:.2f} of the draws, "
                     + ("claimed" if switch_share >= AGREEMENT else f"not claimed (below {AGREEMENT:.2f})"))
    lines.append(f"  the best K at the largest budget exceeds the best K at {budgets[start]:.3g} in {grow_share:.2f} "
                 "of the draws")
    lines += lowest_loss_lines(frontier, pts, sigma, dof, out)
    ratio = c_star / reach
    lo, hi = (np.nanpercentile(draws_ratio, [2.5, 97.5]) if len(draws) and np.isfinite(draws_ratio).any()
              else (float("nan"), float("nan")))
    reached = float(np.mean(np.isfinite(draws_ratio))) if len(draws) else float("nan")
    first_point = any(reach == min(c for c, _ in p) for k, p in frontier.items() if k > 1)
    lines.append(f"best WD-tuned K = 1 loss L* = {l_star:.4f} at C* = {c_star:.3g}; looping (K >= 2, WD-tuned per "
                 "size) "
                 + (f"reaches it at C = {reach:.3g}{' (its smallest size: an upper bound)' if first_point else ''}: "
                    f"C* / C = {ratio:.2f} [95% band {fmt(lo, '.2f')}, {fmt(hi, '.2f')}; reached in {reached:.2f} of "
                    "the draws] (> 1: looping needs less compute; [X]: 2.2)"
                    if np.isfinite(reach) else "never reaches it in the measured range"))
    out.update(budgets=budgets, best_K=best, best_K_agree=share, best_K_looped_share=looped,
               best_K_switch=None if switch is None else float(budgets[switch]), best_K_switch_share=switch_share,
               best_K_grows=bool(grow_share >= AGREEMENT), best_K_grows_share=grow_share,
               looped_sure_from=float(budgets[sure_loop[0]]) if sure_loop else None,
               k1_sure_to=float(budgets[sure_k1[-1]]) if sure_k1 else None,
               L_star=l_star, C_star=c_star, loop_reach_C=reach, loop_compute_ratio=ratio, loop_ratio_band=[lo, hi],
               loop_reach_at_smallest=bool(first_point))
    return lines


def lowest_loss_lines(frontier, pts, sigma, dof, out):
    """The lowest loss each K reaches (its best stored size) with its t-interval on the pooled seed std, and
    the best looped K's lowest loss against K = 1's (stats.difference; Welch's test on their own seeds too)."""
    lowest = {}
    for k, p in frontier.items():
        d = min((d for kk, d in pts if kk == k), key=lambda d: np.mean(pts[k, d][1]))
        v = pts[k, d][1]
        lo, hi = t_interval(float(np.mean(v)), sigma, len(v), dof) if dof else (None, None)
        largest = d == max(dd for kk, dd in pts if kk == k)  # a larger size of that K is not measured
        lowest[k] = dict(depth=d, loss=float(np.mean(v)), n=len(v), lo=lo, hi=hi, largest=largest)
    lines = ["  the lowest loss each K reaches (its best stored size; n seeds) [95% t-interval, pooled seed std]: "
             + ", ".join(f"K={k} {v['loss']:.4f} (d{v['depth']}{', the largest tried' if v['largest'] else ''}, "
                         f"n={v['n']}) [{fmt(v['lo'], '.4f')}, {fmt(v['hi'], '.4f')}]" for k, v in lowest.items())]
    out["lowest_loss"] = {str(k): v for k, v in lowest.items()}
    looped = min((k for k in lowest if k > 1), key=lambda k: lowest[k]["loss"], default=None)
    if looped is None or not dof:
        return lines
    a, b = lowest[1], lowest[looped]
    diff = difference(a["loss"], a["n"], b["loss"], b["n"], sigma, dof)
    seeds_a, seeds_b = pts[1, a["depth"]][1], pts[looped, b["depth"]][1]
    diff["welch_p"] = (float(scipy_stats.ttest_ind(seeds_a, seeds_b, equal_var=False).pvalue)
                       if min(len(seeds_a), len(seeds_b)) > 1 else None)
    diff["K"] = looped
    out["loop_vs_k1"] = diff
    lines.append(f"  K = 1 minus K = {looped}: {diff['diff']:+.4f} nats = {diff['z']:.1f} x its seed sigma "
                 f"{diff['sigma']:.4f} (pooled std x sqrt(1/{a['n']} + 1/{b['n']})) [95% t-interval "
                 f"{diff['lo']:+.4f}, {diff['hi']:+.4f}], p = {diff['p']:.3f}"
                 + (f"; Welch's test on these {a['n'] + b['n']} runs alone: p = {diff['welch_p']:.2f}"
                    if diff["welch_p"] is not None else ""))
    return lines


def repeat_wd_lines(grid, best_wd, wd_star, Ks, depths, out):
    """Does the best weight decay follow stored parameters or executed depth? The regression over the points
    whose optimum is inside what they tried, and WD* per K and depth."""
    inside = [(grid[k, d, best_wd[k, d]]["N_s"], grid[k, d, best_wd[k, d]]["executed"], wd_star[k, d][0])
              for k, d in wd_star if wd_star[k, d][1] == 0]
    reg = wd_regression(inside)
    lines = [f"best weight decay: log WD* = a + b log N_s + c log executed layers over the {len(inside)} (K, depth) "
             f"points whose optimum is inside what they tried ({len(wd_star) - len(inside)} at an edge left out)"]
    if reg is None:
        lines.append("  too few points inside the grid (or stored and executed depth not separable): undecided")
    else:
        b, c, sb, sc = reg
        t = t_quantile(len(inside) - 3)  # OLS on 3 coefficients
        lines.append(f"  b (stored) = {b:.2f} +- {sb:.2f} [95% t-interval {b - t * sb:.2f}, {b + t * sb:.2f}], c "
                     f"(executed) = {c:.2f} +- {sc:.2f} [{c - t * sc:.2f}, {c + t * sc:.2f}] ([X]: WD* follows stored "
                     "parameters: b > 0, c ~ 0)")
        out["wd_regression"] = dict(b_stored=b, c_executed=c, b_se=sb, c_se=sc, points=len(inside),
                                    b_interval=[b - t * sb, b + t * sb], c_interval=[c - t * sc, c + t * sc])
    mark = lambda e: "<" if e < 0 else ">" if e > 0 else ""  # noqa: E731
    lines.append("  WD* by K (rows) and stored depth (columns): " + "; ".join(
        f"K={k}: " + " ".join(f"{mark(wd_star[k, d][1])}{wd_star[k, d][0]:.3g}" if (k, d) in wd_star else "-"
                              for d in depths) for k in Ks))
    out["wd_star"] = {f"K{k}-d{d}": dict(wd=v[0], edge=v[1]) for (k, d), v in wd_star.items()}
    return lines


def repeat_claims(preset, out, pts, best_wd, tuned=None):
    """The claims table of a data-constrained ladder ([X] Section 5) and what its design cannot tell (tuned:
    repeat_lr_table's search, where the LR was searched at every point)."""
    claims = []
    reg = out.get("wd_regression")
    if reg:
        (blo, bhi), (clo, chi) = reg["b_interval"], reg["c_interval"]
        claims.append(("the best weight decay follows stored parameters, not executed depth",
                       "reproduces" if blo > 0 and clo <= 0 <= chi else "does not" if bhi < 0 else "cannot tell",
                       f"log WD* slope on log N_s {reg['b_stored']:.2f} [{blo:.2f}, {bhi:.2f}], on log executed layers "
                       f"{reg['c_executed']:.2f} [{clo:.2f}, {chi:.2f}]"))
    fitted = out.get("lr_exponent")
    if fitted:
        lo, hi = fitted["interval"]
        claims.append((f"the best LR scales with stored parameters as [X16] with beta {fitted['beta']:g} (the [X] "
                       "code's Operator-1 ladder)", "reproduces" if lo <= fitted["beta"] <= hi else "does not",
                       f"LR* ~ N_s^{fitted['slope']:.2f} [{lo:.2f}, {hi:.2f}]"))
    budgets, looped = out["budgets"], out["best_K_looped_share"]
    claims.append(("the compute-optimal K grows with compute (K > 1 at the largest budget)",
                   share_verdict(looped[-1]), f"a looped K is best at {budgets[-1]:.3g} FLOPs in {looped[-1]:.3f} of "
                   f"the draws; the best K grows in {out['best_K_grows_share']:.3f}"))
    if out["best_K_switch"] is not None:
        k1, loop = out["k1_sure_to"], out["looped_sure_from"]
        claims.append(("the budget at which the best K changes", share_verdict(out["best_K_switch_share"])
                       if out["best_K_switch_share"] >= AGREEMENT else "cannot tell",
                       f"{out['best_K_switch']:.3g} FLOPs in the point estimate, the same in "
                       f"{out['best_K_switch_share']:.2f} of the draws; K = 1 is sure up to "
                       f"{fmt(k1, '.3g')}, a looped K from {fmt(loop, '.3g')}"))
    diff = out.get("loop_vs_k1")
    if diff:
        low = out["lowest_loss"]
        welch = f"; Welch on the runs alone p = {diff['welch_p']:.2f}" if diff["welch_p"] is not None else ""
        open_end = low["1"]["largest"]  # K = 1 is best at its largest size: a larger K = 1 might reach it
        claims.append((f"looping reaches a loss WD-tuned K = 1 does not (K = {diff['K']} vs K = 1, each at its best "
                       "size)",
                       "cannot tell" if open_end and diff["lo"] > 0 else
                       "reproduces" if diff["lo"] > 0 else "does not" if diff["hi"] < 0 else "cannot tell",
                       f"{low[str(diff['K'])]['loss']:.4f} vs {low['1']['loss']:.4f}: {diff['diff']:+.4f} "
                       f"[{diff['lo']:+.4f}, {diff['hi']:+.4f}] = {diff['z']:.1f} sigma_diff, p = {diff['p']:.3f}"
                       + welch + (f"; K = 1's lowest is at its largest size (d{low['1']['depth']}), so a larger K = 1 "
                                  "is not measured" if open_end else "")))
    lo, hi = out["loop_ratio_band"]
    ratio = out["loop_compute_ratio"]
    bound = out.get("loop_reach_at_smallest")  # looping's smallest size already reaches L*: C*/C is a lower bound
    claims.append(("looping reaches the best K = 1 loss with 1/2.2 of its compute (C*/C = 2.2)",
                   "cannot tell" if not np.isfinite(ratio) or not np.isfinite(hi) else
                   ("does not" if lo > 2.2 else "cannot tell") if bound else
                   "does not" if not lo <= 2.2 <= hi else "reproduces" if lo > 1 else "cannot tell",
                   f"C*/C = {ratio:.2f} [{fmt(lo, '.2f')}, {fmt(hi, '.2f')}] (seed bootstrap)"
                   + (": a lower bound, looping's smallest size already reaches that loss" if bound else "")))
    if not preset.arm:  # an arm of a controlled ladder: arms_lines compares the budgets
        claims.append(("the looped models' advantage comes from the repeated data", "cannot tell",
                       f"one data budget ({preset.unique_tokens:,} unique tokens x {preset.epochs:g} epochs), no arm "
                       "that reads fresh data"))
    sweep, first = preset.lr_sweep, min(d for _, d in pts)
    one_seed = sorted({k for (k, _), (_, v) in pts.items() if len(v) == 1})
    lines = claims_lines(claims)
    if tuned:
        moved = {k: v for k, v in tuned.items() if v["best"] != 1}
        limit = sorted(k for k, v in tuned.items() if v["edge"])
        lines.append(f"the LR was searched with the weight decay at every (K, depth): the carried LR stayed best at "
                     f"{len(tuned) - len(moved)} of {len(tuned)} points"
                     + ("; it moved at " + ", ".join(f"K={k} d{d} ({lr_times(v['best'])})"
                                                     for (k, d), v in sorted(moved.items())) if moved else "")
                     + ("; at the search's limit (not bracketed): " + ", ".join(f"K={k} d{d}" for k, d in limit)
                        if limit else "; every best LR bracketed by both neighbours")
                     + (f"; K = {', '.join(map(str, one_seed))} have one seed each" if one_seed else ""))
    elif sweep:
        lines.append(f"cannot tell either: the LR was swept once, at K = 1, d{first}, weight decay "
                     f"{sweep.weight_decay:g}, " + ("one seed" if sweep.seeds == 1 else f"{sweep.seeds} seeds")
                     + f" (d{first}'s best weight decay at K = 1 is "
                     f"{best_wd.get((1, first), float('nan')):g}), and carried to every K"
                     + (f"; K = {', '.join(map(str, one_seed))} have one seed each" if one_seed else ""))
    return lines


def arms_report(preset, rows, sweep, n_boot, seed):
    """The report of a ladder with several data budgets ([X] D.1): the LR sweep, each budget's own report
    (repeat_report on its rows), then the comparison across budgets (arms_lines) and its claims."""
    arms = repeat_arms(preset)
    lines = [f"== {preset.name}: [X] data-constrained with its controls ([X] D.1): every run reads the same tokens "
             "from one of " + ", ".join(f"{a.unique_tokens:,} unique x {a.epochs:g}" for a in arms)
             + f"; the Operator-1 family at width {preset.width_per_depth} x stored depth"]
    out = {"preset": preset.name, "arms": {}}
    if sweep:
        lines += sweep[0] + [f"  each budget's LR (its k1 row) scales by [X16] with beta {preset.lr_scaling_beta:g} "
                             f"from d{preset.depths[0]}; embedding / lm head LRs keep [X]'s ratios to it"
                             + ("; every (K, depth) searches its own LR from there" if preset.tune_every_point
                                else "")]
        out["lr_sweep"] = sweep[1]
    if preset.builds_on:
        lines += builds_on_lines(preset, rows, sweep)
    sections = []
    for arm in arms:
        text, arm_out, figures = repeat_report(arm, [r for r in rows if r.get("unique_tokens") == arm.unique_tokens],
                                               None, n_boot, seed)
        lines += ["", text.replace(f"== {arm.name}:", f"== {arm.name}, budget {arm.arm}:", 1)]
        out["arms"][arm.arm] = arm_out
        if figures:
            sections.append((arm, figures))
    if len(sections) < 2:
        lines.append("\nthe comparison across data budgets needs two of them with K = 1 and a looped K: not yet")
        return "\n".join(lines), out, {"arms": sections} if sections else None
    lines += [""] + arms_lines(sections, n_boot, seed, out)
    return "\n".join(lines), out, {"arms": sections}


def arms_lines(sections, n_boot, seed, out):
    """Does the compute-optimal K rise as unique data shrinks? Every budget's best K per training budget with
    one joint seed bootstrap (the pooled seed std of all budgets), and the looping gain (K = 1's lowest loss
    minus the best looped K's) of the most repeated budget against the fresh one -> lines (claims included)."""
    groups = [v for _, f in sections for _, v in f["pts"].values()]
    sigma, dof = pooled_std(groups)
    sigma = sigma or 0.0
    allC = [c for _, f in sections for p in f["frontier"].values() for c, _ in p]
    budgets = np.geomspace(min(allC), max(allC), 9)
    best, draws = {}, {}
    for i, (arm, f) in enumerate(sections):
        best[arm.arm] = repeat_analysis(f["frontier"], budgets)[0]
        draws[arm.arm] = best_k_array(drawn_analyses(f["pts"], budgets, sigma, dof, n_boot, seed + 1 + i), budgets)
    lines = [f"== across the data budgets: the best K per training budget (one seed bootstrap of {n_boot} draws on the "
             f"pooled seed std {sigma:.4f} of every budget, {dof} degrees of freedom; agree = the share of draws with "
             "the same best K)", "  budget           " + " ".join(f"{b:>8.3g}" for b in budgets)]
    for arm, _ in sections:
        est = np.array([np.nan if k is None else k for k in best[arm.arm]], dtype=float)
        lines.append(f"  {arm.arm:>8} best K  " + " ".join(f"{'-' if np.isnan(k) else int(k):>8}" for k in est))
        lines.append(f"  {'':>8} agree   " + " ".join(f"{s:>8.3f}" for s in agreement(draws[arm.arm], est)))
    fresh, repeated = min(sections, key=lambda s: s[0].epochs)[0], max(sections, key=lambda s: s[0].epochs)[0]
    low = {arm.arm: np.nan_to_num(draws[arm.arm], nan=1.0).max(axis=1) <= 2 for arm, _ in sections}
    rises = (draws[repeated.arm][:, -1] > draws[fresh.arm][:, -1]) if n_boot and dof else np.array([])
    gains = {arm.arm: looping_gain(f["pts"]) for arm, f in sections}
    g, h = gains[repeated.arm], gains[fresh.arm]
    terms = [(1, g["k1"]), (-1, g["looped"]), (-1, h["k1"]), (1, h["looped"])]
    effect = contrast([(sign, float(np.mean(v)), len(v)) for sign, v in terms], sigma, dof) if dof else None
    lines.append("  looping gain (K = 1's lowest loss minus the best looped K's, each at its best stored size): "
                 + ", ".join(f"{a} {v['gain']:+.4f} (K = {v['K']})" for a, v in gains.items()))
    if effect:
        lines.append(f"  the gain with {repeated.arm} minus the gain with {fresh.arm}: {effect['diff']:+.4f} nats [95% "
                     f"t-interval {effect['lo']:+.4f}, {effect['hi']:+.4f}], p = {effect['p']:.3f} (> 0: repetition "
                     "makes looping worth more)")
    out["across"] = dict(budgets=budgets, best_K={a: v for a, v in best.items()}, pooled_std=sigma, dof=dof,
                         k_at_most_2_share={a: float(v.mean()) if len(v) else None for a, v in low.items()},
                         rises_share=float(rises.mean()) if len(rises) else None, gains=gains, gain_effect=effect)
    claims = []
    for arm, _ in sections:
        if arm.epochs <= 4 and max(arm.passes) > 2:  # (with no K above 2 tried the claim holds by design)
            share = out["across"]["k_at_most_2_share"][arm.arm]
            claims.append((f"with {arm.epochs:g} epoch{'s' if arm.epochs > 1 else ''} ({arm.arm}) the compute-optimal "
                           "K stays at 1-2 at every budget", "cannot tell" if share is None else share_verdict(share),
                           f"best K at the largest budget {fmt(best[arm.arm][-1], 'd')}; K <= 2 at every budget in "
                           f"{fmt(share, '.3f')} of the draws"))
    share, top = out["across"]["rises_share"], max(fresh.passes)
    # fresh data's best K already the largest K tried: a rise beyond it is not measured, not absent
    ceiling = float(np.mean(draws[fresh.arm][:, -1] == top)) if len(rises) else None
    out["across"]["fresh_at_largest_K_share"] = ceiling
    claims.append((f"with {repeated.epochs:g} epochs the compute-optimal K rises above fresh data's",
                   "cannot tell" if share is None or ceiling >= AGREEMENT else share_verdict(share),
                   f"best K at {budgets[-1]:.3g} FLOPs: {repeated.arm} {fmt(best[repeated.arm][-1], 'd')}, "
                   f"{fresh.arm} {fmt(best[fresh.arm][-1], 'd')}; larger with {repeated.arm} in {fmt(share, '.3f')} "
                   "of the draws" + (f"; fresh data's is the largest K tried ({top}) in {ceiling:.3f} of them, so a "
                                     "rise beyond it is not measured" if ceiling is not None and ceiling >= AGREEMENT
                                     else "")))
    open_end = [a for a in (repeated.arm, fresh.arm) if gains[a]["k1_at_largest"]]
    claims.append(("the looped models' advantage comes from the repeated data (a larger looping gain with "
                   f"{repeated.epochs:g} epochs than with fresh data)",
                   "cannot tell" if effect is None else
                   "reproduces" if effect["lo"] > 0 else "does not" if effect["hi"] < 0 else "cannot tell",
                   "no seeds" if effect is None else
                   f"{effect['diff']:+.4f} nats [{effect['lo']:+.4f}, {effect['hi']:+.4f}], p = {effect['p']:.3f}"
                   + (f"; the gains within the sizes tried: K = 1's lowest is at its largest size in "
                      f"{' and '.join(open_end)}" if open_end else "")))
    return lines + claims_lines(claims)


def looping_gain(pts):
    """K = 1's lowest seed-mean loss (its best stored size) minus that of the best looped K: the gain, the
    looped K, and both points' seed losses."""
    def lowest(ks):
        return min(((k, d) for k, d in pts if k in ks), key=lambda p: np.mean(pts[p][1]))
    k1 = lowest({1})
    looped = lowest({k for k, _ in pts if k > 1})
    return dict(gain=float(np.mean(pts[k1][1]) - np.mean(pts[looped][1])), K=looped[0], depth_k1=k1[1],
                depth_looped=looped[1], k1=pts[k1][1], looped=pts[looped][1],
                k1_at_largest=k1[1] == max(d for k, d in pts if k == 1))


def repeat_plots(preset, f, path):
    """A repeat ladder's figures: each K's frontier (loss vs compute at its best weight decay per size) and
    the weight-decay curves at every stored depth (a figure pair per data budget, ARM-frontier.png)."""
    if "arms" in f:
        return [p for arm, figures in f["arms"]
                for p in repeat_plots(arm, figures, lambda name, a=arm.arm: path(f"{a}-{name}"))]
    written = []
    if plots.plot_repeat_frontier(f["frontier"], f["pts"], f["l_star"], path("frontier.png"),
                                  title=f"{preset.name}: each K at its best {'LR and ' * preset.tune_every_point}"
                                        "weight decay per stored size"):
        written.append(path("frontier.png"))
    curves = {f"K={k}": {d: [(w, f["grid"][k, d, w]["loss"]) for w in f["wds"] if (k, d, w) in f["grid"]]
                         for d in f["depths"]} for k in f["Ks"]}
    if plots.plot_wd_curves(curves, path("weight_decay.png"),
                            title=f"{preset.name}: validation loss vs weight decay (first seed)"):
        written.append(path("weight_decay.png"))
    return written
