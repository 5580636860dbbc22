"""Every run of a preset: the specs of each stage (build: the LR sweep, then the ladder at the swept LRs), the
whole plan with its budgets (full_plan, plan_records) and `ladder.py --list` (describe_presets)."""

import json

from ladders.common import data_plan, sweep_point, sweep_values, tokens_per_step, world_size
from ladders.presets import PRESETS, get_preset
from ladders.repeat import lr_keys, repeat_seed_specs, repeat_specs, repeat_tune_plan
from ladders.smelt import smelt_cells, smelt_specs
from ladders.x import x_specs
from tooling.jobs import json_default


def build(preset, data=None, lrs=None, world=None):
    """(specs, cells or None) of a preset. lrs: {arch: swept value} once the sweep has finished; without
    them the specs are the sweep runs only (a preset without a sweep: everything at once)."""
    data = data or data_plan(preset, prepare=False)
    if preset.lr_sweep is None:
        lrs = {}
    elif preset.lr_sweep.at_every_depth and preset.kind not in ("x", "smelt"):
        raise ValueError(f"preset {preset.name}: lr_sweep.at_every_depth is for [X] and [S] ladders (every depth, "
                         "every scale) only")
    if preset.kind == "smelt":
        cells = smelt_cells(preset)
        specs = smelt_specs(preset, cells, data, lrs, world)
    elif preset.kind in ("x", "repeat"):
        cells = None
        specs = (x_specs if preset.kind == "x" else repeat_specs)(preset, data, lrs, world)
    else:
        raise ValueError(f"preset {preset.name}: unknown kind {preset.kind!r}")
    for s in specs:  # epochs of the stable region read (a branch: by its stable part; its decay reads < 1)
        if data.stable_tokens and "epochs" not in s.meta:  # (a repeat ladder's runs: epochs of their unique tokens)
            read = s.meta["branch_step"] * tokens_per_step(preset, world) if s.role == "branch" else s.meta["tokens"]
            s.meta["epochs"] = read / data.stable_tokens
    return specs, cells


def full_plan(preset, data=None, world=None):
    """Every run of a preset, sweep included, with a placeholder value for the swept LR (the budgets,
    tokens and FLOPs do not depend on it)."""
    data = data or data_plan(preset, prepare=False)
    sweep, cells = build(preset, data, world=world)
    if preset.lr_sweep is None:
        return sweep, cells
    key, values = sweep_values(preset)
    archs = preset.archs if preset.kind == "x" else ("baseline", "smelt") if preset.kind == "smelt" else lr_keys(preset)
    depths = preset.depths if preset.kind == "x" else list(preset.scales) if preset.kind == "smelt" else [None]
    lrs = {sweep_point(preset, a, d): values[len(values) // 2] for a in archs for d in depths}
    rest, _ = build(preset, data, lrs=lrs, world=world)
    if preset.kind == "repeat":  # the extra seeds at the middle weight decay (their budget does not depend on it)
        rest += repeat_seed_specs(preset, data, lrs, None, world) + repeat_tune_plan(preset, data, lrs, world)
    ids = {s.run_id for s in sweep}
    return sweep + [s for s in rest if s.run_id not in ids], cells


def plan_records(preset, specs, world=None):
    """One record per run: what --list --json prints (tpp = tokens per compute-active non-embedding
    parameter; grow_step null for runs that do not grow)."""
    step_tokens = tokens_per_step(preset, world)
    records = []
    for s in specs:
        n, tokens = s.meta.get("N"), s.meta.get("tokens")
        steps = s.settings.get("max_steps")
        if s.role == "branch":
            decay_start_step, steps = s.meta["branch_step"], None
        elif s.role == "stable":
            decay_start_step = None  # a stable phase never decays (its branches do)
        else:
            decay_start_step = steps - round(s.settings.get("decay_fraction", 0.0) * steps)
        records.append(dict(run_id=s.run_id, arch=s.arch, role=s.role, cell=s.cell, params_nonembedding=n,
                            params_stored=s.meta.get("N_s"), tokens=tokens,
                            flops=s.meta["F"] * tokens if tokens else None, tpp=tokens / n if n and tokens else None,
                            epochs=s.meta.get("epochs"), grow_step=s.meta.get("grow_step"),
                            decay_start_step=decay_start_step,
                            steps=steps or (tokens // step_tokens if tokens else None)))
    return records


def describe_presets(as_json=False):
    presets = {}
    lines = []
    for name in PRESETS:
        preset = get_preset(name)
        world = world_size(preset)
        try:
            specs, _ = full_plan(preset, data_plan(preset, prepare=bool(preset.tokenizer)), world)
            records = plan_records(preset, specs, world)
            flops = sum(r["flops"] or 0 for r in records if r["role"] != "branch") + \
                sum(s.meta["F"] * s.settings["decay_tokens"] for s in specs if s.role == "branch")
            presets[name] = dict(about=preset.about, runs=records, flops=flops, budget=preset.budget)
            tpps = [r["tpp"] for r in records if r["tpp"]]
            epochs = [r["epochs"] for r in records if r["epochs"] is not None]
            what = (f"{len(specs)} runs, {flops:.2e} FLOPs" + (f" on {world} GPUs" if world > 1 else "")
                    + (f", TPP {min(tpps):.3g}..{max(tpps):.3g}" if tpps else "")
                    + (f", epochs <= {max(epochs):.2f}" if epochs else "")
                    + (f" ({preset.budget})" if preset.budget else ""))
        except ValueError as e:
            what = f"not buildable: {e}"
            presets[name] = dict(about=preset.about, error=str(e))
        lines.append(f"{name:>16}  {what}: {preset.about}")
    return json.dumps({"presets": presets}, default=json_default) if as_json else "\n".join(lines)
