"""The LR sweep: at the first ladder point every architecture tries each value of one learning rate; the
sweep brackets its optimum (while the best is at an edge, the next value beyond it runs too), and the best
value (the mean over its seeds) is carried up the ladder. With lr_sweep.at_every_depth each [X] (architecture,
depth) point, or [S] (architecture, scale), sweeps and brackets on its own (common.sweep_point: the key of what
one sweep tunes) and trains at its own best value."""

from dataclasses import replace

import numpy as np

from ladders.common import sweep_limits, sweep_point, sweep_values, swept_value
from ladders.specs import build


def point_of(preset, spec):
    return sweep_point(preset, spec.arch, spec.meta.get("depth", spec.meta.get("scale")))  # [X] depth, [S] scale


def sweep_losses(preset, results, sweep_specs, missing=False):
    """{point: {swept value: [validation loss of each seed]}} (point: common.sweep_point); a run without a
    result adds None with missing, else nothing."""
    key, _ = sweep_values(preset)
    seen = {}
    for s in sweep_specs:
        r = results.get(s.run_id)
        if r is not None or missing:
            seen.setdefault(point_of(preset, s), {}).setdefault(swept_value(s, key), []).append(
                r["val_loss"] if r else None)
    return seen


def best_lrs(preset, results, sweep_specs):
    """{point: the swept value with the lowest validation loss} (point: an arch, or with at_every_depth an
    (arch, depth)), or None while sweep runs are missing."""
    key, values = sweep_values(preset)
    if key is None:
        return {}
    if any(results.get(s.run_id) is None for s in sweep_specs):
        return None
    losses = sweep_losses(preset, results, sweep_specs)
    return {p: min(by, key=lambda v: np.mean(by[v])) for p, by in losses.items()}  # the mean over its seeds


def sweep_extension(preset, data, results, sweep_specs, world=None):
    """Sweep runs one step beyond the edge of the values a point (an arch, or an (arch, depth)) tried, for
    every point whose best value is at that edge (a sweep must bracket its optimum), at most lr_sweep.extend
    (2) steps beyond the preset's grid on either side. [] when every best value is inside its grid."""
    key, values = sweep_values(preset)
    if key is None or len(values) < 2:
        return []
    ratio, lo, hi = sweep_limits(preset)
    tried = {p: {v: float(np.mean(ls)) for v, ls in by.items()}
             for p, by in sweep_losses(preset, results, sweep_specs).items()}
    extra = []
    for point, losses in tried.items():
        best, ordered = min(losses, key=losses.get), sorted(losses)
        if best == ordered[-1] and best < hi:
            value = float(f"{best * ratio:.12g}")  # 0.012, not 0.011999999999999999
        elif best == ordered[0] and best > lo:
            value = float(f"{best / ratio:.12g}")
        else:
            continue
        specs, _ = build(replace(preset, lr_sweep=replace(preset.lr_sweep, values=[value])), data, world=world)
        extra += [s for s in specs if point_of(preset, s) == point]
    return extra


def bracketed_sweep(preset, data, run, world=None):
    """(results, sweep specs): the preset's sweep, then its extensions until every architecture's best
    value is inside what it tried (or the extension limit). run(specs) -> {run_id: result or None}."""
    sweep_specs, _ = build(preset, data, world=world)
    results = run(sweep_specs)
    while best_lrs(preset, results, sweep_specs):  # None while runs are missing, {} without a sweep
        extra = sweep_extension(preset, data, results, sweep_specs, world)
        if not extra:
            break
        results.update(run(extra))
        if any(results.get(s.run_id) is None for s in extra):  # --fit-only: the extension was not trained
            break
        sweep_specs = sweep_specs + extra
    return results, sweep_specs


def sweep_table(preset, results, sweep_specs, chosen):
    """The sweep's report lines and its table (sweep_lines) from its results."""
    key, _ = sweep_values(preset)
    seen = sweep_losses(preset, results, sweep_specs, missing=True)
    losses = {p: {v: None if None in ls else float(np.mean(ls)) for v, ls in by.items()} for p, by in seen.items()}
    return sweep_lines(key, losses, chosen)  # a value's loss: the mean over its seeds


def sweep_lines(key, losses, chosen):
    """losses: {point: {swept value: validation loss or None}}; chosen: {point: its ladder value} -> (report
    lines, the table for report.json: {arch: {str(value): loss}}, or with (arch, depth) points (at_every_depth)
    {depth: {arch: {str(value): loss}}}, one block per depth)."""
    if not any(isinstance(p, tuple) for p in losses):
        lines = [f"LR sweep ({key}) at the first ladder point, validation loss (* = carried up the ladder; "
                 f"- = not tried: a value beyond the grid runs only while the best is at its edge)"]
        block, table = sweep_block("", losses, chosen)
        return lines + block, table
    where = list(dict.fromkeys(d for _, d in losses))  # [S] scales in the grid's order, [X] depths sorted
    if all(isinstance(d, int) for d in where):
        where, label = sorted(where), "d{}".format
        lines = [f"LR sweep ({key}) at every depth: every architecture runs each value at each depth, full-length "
                 "ladder runs (the ladder point's tokens); validation loss, the mean over its seeds (* = the ladder "
                 "point's value; - = not tried: a value beyond the grid runs only while the best is at its edge)"]
    else:
        label = str
        lines = [f"LR sweep ({key}) at every scale: every architecture runs each value at the scale's first cell "
                 "(one WSD run per seed, its length below); validation loss, the mean over its seeds (* = the value "
                 "the scale's cells train at; - = not tried: a value beyond the grid runs only while the best is at "
                 "its edge)"]
    table = {}
    for d in where:
        block, table[d] = sweep_block(label(d), {a: by for (a, dd), by in losses.items() if dd == d},
                                      {a: v for (a, dd), v in chosen.items() if dd == d})
        lines += block
    return lines, table


def sweep_block(label, losses, chosen):
    """One table of a sweep (rows: arch; columns: the values tried; label above the arch names)."""
    values = sorted({v for by in losses.values() for v in by})
    lines = [f"  {label:>12} " + " ".join(f"{v:>10g}" for v in values)]
    table = {}
    for a, by in losses.items():
        cells = []
        for v in values:
            loss = by.get(v)
            table.setdefault(a, {})[str(v)] = loss
            cells.append(f"{loss:9.4f}{'*' if chosen.get(a) == v else ' '}" if loss is not None else f"{'-':>10}")
        lines.append(f"  {a:>12} " + " ".join(cells))
    return lines, table


def sweep_rows(key, table, chosen):
    """lr_sweep.csv's rows (arch, key, value, val_loss, carried) of a sweep table (sweep_lines); a per-depth
    or per-scale table's (at_every_depth) have a depth or scale column after arch, and carried marks each
    point's value."""
    per_point = any(isinstance(p, tuple) for p in chosen) or (table and all(isinstance(d, int) for d in table))
    blocks = table.items() if per_point else [(None, table)]
    column = "depth" if all(isinstance(d, int) for d in table) else "scale"
    return [dict(arch=a, **({column: d} if per_point else {}), key=key, value=float(v), val_loss=loss,
                 carried=chosen.get(a if d is None else (a, d)) == float(v))
            for d, block in blocks for a, by in block.items() for v, loss in by.items() if loss is not None]


def sweep_from_rows(rows):
    """(key, {point: {value: loss}}, {point: carried value}) back from lr_sweep.csv's rows; point: the arch, or
    (arch, depth) / (arch, scale) where the file has a depth / scale column (a sweep at every depth / scale)."""
    keys = {r["key"] for r in rows}
    if len(keys) != 1:
        raise ValueError(f"lr_sweep.csv: expected one swept key, found {sorted(keys)}")
    losses, chosen = {}, {}
    for r in rows:
        point = ((r["arch"], int(r["depth"])) if r.get("depth") is not None else
                 (r["arch"], str(r["scale"])) if r.get("scale") is not None else r["arch"])
        losses.setdefault(point, {})[float(r["value"])] = r["val_loss"]
        if r["carried"]:
            chosen[point] = float(r["value"])
    return keys.pop(), losses, chosen


def lrs_record(lrs):
    """best_lrs for report.json: an (arch, depth) point as "arch-dDEPTH" (its run ids' prefix), an (arch,
    scale) point as "arch-SCALE"."""
    return {(f"{p[0]}-d{p[1]}" if isinstance(p[1], int) else f"{p[0]}-{p[1]}") if isinstance(p, tuple) else p: v
            for p, v in lrs.items()}
