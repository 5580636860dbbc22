"""[X] data-constrained ladder (kind "repeat", [X] Section 5 and Appendix D): every run reads the same
unique_tokens for `epochs` epochs; the Operator-1 family (K passes of its tied core) at each stored depth and
weight decay (with tune_every_point, LR and weight decay searched together), the other seeds at each point's
best; a finished ladder's runs imported (builds_on). Its report: ladders/repeat_report.py."""

import math
import os
import re
from dataclasses import replace

import grow
import match
import train
from ladders.common import (REPO, carried_lrs, compute_active, grid_limits, lr_scaling, model_settings, sweep_limits,
                            sweep_values, tokens_per_step)
from ladders.x import x_config
from model import ModelConfig
from tooling import tables
from tooling.jobs import RunSpec


def repeat_config(preset, passes, depth):
    """The Operator-1 family at one stored depth: Operator-1 (K = 1) or Loop-K (its core run K times, tied)."""
    cfg, _ = x_config(preset, "operator-1", depth)
    return ModelConfig.from_dict(dict(model_settings(cfg), n_passes=passes))


def repeat_arms(preset):
    """The preset's data budgets, one RepeatPreset each (its unique_tokens, epochs and label: 250k x 4 ->
    "250kx4"); a preset without arms is its one budget (its run ids carry no label)."""
    if not preset.arms:
        return [preset]
    return [replace(preset, unique_tokens=u, epochs=e, arms=None,
                    arm=f"{u // 1000}kx{e:g}" if u % 1000 == 0 else f"{u}x{e:g}") for u, e in preset.arms]


def arm_prefix(preset):
    return f"{preset.arm}-" if preset.arm else ""


def lr_key(preset):
    """The name an arm's swept LR has in the sweep (its K = 1 runs' arch): "k1", or "250kx4-k1"."""
    return f"{arm_prefix(preset)}k1"


def lr_keys(preset):
    return [lr_key(arm) for arm in repeat_arms(preset)]


def repeat_spec(preset, data, passes, depth, wd, lr, seed, role, world=None):
    """One run: `epochs` x unique_tokens tokens (whole steps), weight decay wd on every matrix, the
    embedding and the lm head ([X] code); the global LR lr at the first depth, carried to the others by
    [X16] with the preset's beta (N = stored parameters, the first depth's as anchor)."""
    cfg = repeat_config(preset, passes, depth)
    step_tokens = tokens_per_step(preset, world)
    steps = max(4, math.ceil(preset.epochs * preset.unique_tokens / step_tokens))
    sweep = preset.lr_sweep
    anchor = grow.stored_params(repeat_config(preset, 1, preset.depths[0]))
    settings = dict(preset.train, **model_settings(cfg), max_steps=steps, eval_interval=steps, seed=seed,
                    unique_tokens=preset.unique_tokens, weight_decay=wd,
                    **{sweep.key: lr}, **{k: float(f"{lr * r:.12g}") for k, r in sweep.tied.items()})
    settings = carried_lrs(settings, cfg, anchor, preset.lr_scaling_beta)  # [X16], the first depth's N_s
    acc = match.accounting(cfg)
    n_s = acc["params_stored"]
    meta = dict(depth=depth, width=cfg.n_embd, passes=passes, wd=wd, lr=lr, seed=seed, N=compute_active(cfg), N_s=n_s,
                executed_layers=acc["executed_layers"], tokens=steps * step_tokens, F=train.flops_per_token(cfg),
                lr_scaled=lr * lr_scaling(n_s, anchor, preset.lr_scaling_beta),
                epochs=steps * step_tokens / preset.unique_tokens)
    meta.update(unique_tokens=preset.unique_tokens, arm=preset.arm)
    arm = arm_prefix(preset)
    run_id = f"{arm}k{passes}-d{depth}-wd{wd:g}-{sweep.key}{lr:g}-s{seed}"
    return RunSpec(run_id, f"{arm}k{passes}", f"d{depth}", role, settings, meta)


def repeat_specs(preset, data, lrs=None, world=None):
    """Without lrs: the LR sweep of every data budget (K = 1 at the first depth, the sweep's weight decay,
    each value, lr_sweep.seeds seeds); with lrs ({"k1": value}, an arm's "ARM-k1"): the grid, every K x
    depth x weight decay, first seed."""
    if preset.arms:
        return [s for arm in repeat_arms(preset) for s in repeat_specs(arm, data, lrs, world)]
    seed = preset.seeds[0]
    if lrs is None:
        key, values = sweep_values(preset)
        return [repeat_spec(preset, data, 1, preset.depths[0], preset.lr_sweep.weight_decay, v, s, "sweep", world)
                for v in values for s in preset.seeds[:preset.lr_sweep.seeds]]
    lr = lrs[lr_key(preset)]
    return [repeat_spec(preset, data, k, d, wd, lr, seed, "run", world)
            for k in preset.passes for d in preset.depths for wd in preset.weight_decays]


def repeat_grid(preset, data, lrs, results, world=None):
    """The grid and its weight-decay extensions: while a (K, depth)'s best first-seed weight decay is at an
    edge of the values it tried, the next value beyond that edge (the grid's ratio) runs too, at most
    wd_extend (2) steps beyond the grid on either side -> (specs, complete: every run finished and no
    extension pending)."""
    if preset.arms:
        grids = [repeat_grid(arm, data, lrs, results, world) for arm in repeat_arms(preset)]
        return [s for specs, _ in grids for s in specs], all(complete for _, complete in grids)
    ratio, lo, hi = grid_limits(preset.weight_decays, preset.wd_extend)

    def beyond_edge(k, d, points):
        tried = sorted(s.meta["wd"] for s in points)
        best = min(points, key=lambda s: results[s.run_id]["val_loss"]).meta["wd"]
        if best == tried[0] and best > lo:
            value = best / ratio
        elif best == tried[-1] and best < hi:
            value = best * ratio
        else:
            return []
        return [repeat_spec(preset, data, k, d, float(f"{value:.12g}"), lrs[lr_key(preset)], preset.seeds[0], "run",
                            world)]
    return search_rounds(preset, repeat_specs(preset, data, lrs, world), results, beyond_edge)


def search_rounds(preset, specs, results, next_runs):
    """A search at every (K, depth), in rounds: once a point's runs have all finished, next_runs(K, depth, its
    runs) names the runs it asks for next -> (specs with them, complete: every run finished and none asked for)."""
    while True:
        extra, pending = [], False
        for k in preset.passes:
            for d in preset.depths:
                points = [s for s in specs if s.meta["passes"] == k and s.meta["depth"] == d]
                if any(results.get(s.run_id) is None for s in points):
                    pending = True
                    continue
                extra += next_runs(k, d, points)
        specs = specs + extra
        if pending or any(results.get(s.run_id) is None for s in extra):
            return specs, False
        if not extra:
            return specs, True


def repeat_tuned(preset, data, lrs, results, world=None):
    """The grid (repeat_grid), then with tune_every_point the first seed's LR and weight decay searched together
    at every (K, depth): while the best run so far lacks a neighbour on the two grids (the LR / 2 and x 2 at
    its weight decay, the weight decay / and x the grid's ratio at its LR; an LR inside the sweep's limits, a
    weight decay inside the grid's), the missing neighbours run -> (specs, complete)."""
    if preset.arms:
        tuned = [repeat_tuned(arm, data, lrs, results, world) for arm in repeat_arms(preset)]
        return [s for specs, _ in tuned for s in specs], all(complete for _, complete in tuned)
    specs, complete = repeat_grid(preset, data, lrs, results, world)
    if not complete or not preset.tune_every_point:
        return specs, complete
    lr_ratio, lr_lo, lr_hi = sweep_limits(preset)
    wd_ratio, wd_lo, wd_hi = grid_limits(preset.weight_decays, preset.wd_extend)

    def missing_neighbours(k, d, points):
        best = min(points, key=lambda s: results[s.run_id]["val_loss"]).meta
        lr, wd, tried = best["lr"], best["wd"], {(s.meta["lr"], s.meta["wd"]) for s in points}
        steps = [(lr / lr_ratio, wd)] * (lr > lr_lo) + [(lr * lr_ratio, wd)] * (lr < lr_hi) + \
            [(lr, wd / wd_ratio)] * (wd > wd_lo) + [(lr, wd * wd_ratio)] * (wd < wd_hi)
        steps = [(float(f"{v:.12g}"), float(f"{w:.12g}")) for v, w in steps]  # 0.04, not 0.04000000000000001
        return [repeat_spec(preset, data, k, d, w, v, preset.seeds[0], "tune", world) for v, w in steps
                if (v, w) not in tried]
    return search_rounds(preset, specs, results, missing_neighbours)


def repeat_seed_specs(preset, data, lrs, results, world=None):
    """Every seed but the first, for each K in seeded_passes at every depth, at the (LR, weight decay) that
    K's first-seed runs found best there (None while those runs or a search step are missing). results=None:
    the plan, at the carried LR and the middle weight decay (a run's budget depends on neither)."""
    if preset.arms:
        arms = [repeat_seed_specs(arm, data, lrs, results, world) for arm in repeat_arms(preset)]
        return None if None in arms else [s for specs in arms for s in specs]
    if results is None:
        grid = repeat_specs(preset, data, lrs, world)
    else:
        grid, complete = repeat_tuned(preset, data, lrs, results, world)
        if not complete:
            return None
    specs = []
    for k in preset.seeded_passes:
        for d in preset.depths:
            points = [s for s in grid if s.meta["passes"] == k and s.meta["depth"] == d]
            if results is None:
                lr, wd = lrs[lr_key(preset)], preset.weight_decays[len(preset.weight_decays) // 2]
            elif any(results.get(s.run_id) is None for s in points):
                return None
            else:
                best = min(points, key=lambda s: results[s.run_id]["val_loss"]).meta
                lr, wd = best["lr"], best["wd"]
            specs += [repeat_spec(preset, data, k, d, wd, lr, seed, "seed", world) for seed in preset.seeds[1:]]
    return specs


def repeat_tune_plan(preset, data, lrs, world=None):
    """The plan's share of the search (tune_every_point): the LR / 2 and x 2 at every (K, depth), at the
    middle weight decay (the search's first step where the carried LR and that weight decay are best)."""
    if not preset.tune_every_point:
        return []
    if preset.arms:
        return [s for arm in repeat_arms(preset) for s in repeat_tune_plan(arm, data, lrs, world)]
    ratio, lr = sweep_limits(preset)[0], lrs[lr_key(preset)]
    wd = preset.weight_decays[len(preset.weight_decays) // 2]
    return [repeat_spec(preset, data, k, d, wd, float(f"{v:.12g}"), preset.seeds[0], "tune", world)
            for k in preset.passes for d in preset.depths for v in (lr / ratio, lr * ratio)]


def imported_results(preset, data):
    """builds_on: the runs of a finished ladder's runs.csv (relative to the checkout, or absolute) as results keyed
    by run id, so that this ladder does not train them again. Every row must be a run of this preset: the run it names
    (budget, K, depth, weight decay, LR, seed) has this preset's settings, and the row's tokens and stored
    parameters are that run's; else one line naming the file and the row."""
    path = preset.builds_on
    full = os.path.join(REPO, path)
    if not os.path.exists(full):
        raise ValueError(f"preset {preset.name}: builds_on {path}: no such file (the finished ladder it continues)")
    arms = {a.unique_tokens: a for a in repeat_arms(preset)}
    pattern = re.compile(rf"-{re.escape(preset.lr_sweep.key)}([0-9.e+-]+)-s[0-9]+$")
    imported = {}
    for line, row in enumerate(tables.read_rows_csv(full, unique=["run_id"]), start=2):
        arm, lr = arms.get(row.get("unique_tokens")), pattern.search(str(row.get("run_id")))
        try:
            spec = arm and lr and repeat_spec(arm, data, int(row["K"]), int(row["depth"]), float(row["wd"]),
                                              float(lr.group(1)), int(row["seed"]), row["role"])
        except (KeyError, TypeError, ValueError):  # a column missing or empty: not a run of a repeat ladder
            spec = None
        if not spec or spec.run_id != row["run_id"] or spec.meta["tokens"] != row["D"] \
                or spec.meta["N_s"] != row["N_s"]:
            raise ValueError(f"{path} line {line}: run {row.get('run_id')} is not a run of preset {preset.name} "
                             "(its budget, K, depth, weight decay, LR, seed, tokens or stored parameters differ)")
        imported[spec.run_id] = dict(run_id=spec.run_id, arch=spec.arch, cell=spec.cell, role=spec.role,
                                     settings=spec.settings, meta=spec.meta, needs=None, val_loss=row["loss"],
                                     flops=row["C"], tokens=row["D"], final_train_loss=row["train_loss"],
                                     seconds=row["seconds"], imported=path)
    return imported


def repeat_rows(results, roles):
    """runs.csv rows of a repeat ladder (roles: {run_id: the role the ladder gives it}; imported: the run comes
    from the runs.csv the preset builds on)."""
    rows = []
    for r in results:
        m = r["meta"]
        rows.append(dict(K=m["passes"], depth=m["depth"], width=m["width"], wd=m["wd"], seed=m["seed"],
                         role=roles.get(r["run_id"], r["role"]), C=r["flops"], D=r["tokens"], F=m["F"], N=m["N"],
                         N_s=m["N_s"], executed=m["executed_layers"], epochs=m["epochs"],
                         unique_tokens=m.get("unique_tokens"), lr=m["lr_scaled"],
                         loss=r["val_loss"], train_loss=r.get("final_train_loss"), run_id=r["run_id"],
                         seconds=r["seconds"], imported=bool(r.get("imported"))))
    return rows
