"""The LR sweep: at the first ladder point every architecture tries each value of one learning rate; the
sweep brackets its optimum (while the best is at an edge, the next value beyond it runs too), and the best
value (the mean over its seeds) is carried up the ladder."""

from dataclasses import replace

import numpy as np

from ladders.common import sweep_values
from ladders.specs import build


def best_lrs(preset, results, sweep_specs):
    """{arch: the swept value with the lowest validation loss}, or None while sweep runs are missing."""
    key, values = sweep_values(preset)
    if key is None:
        return {}
    losses = {}
    for s in sweep_specs:
        r = results.get(s.run_id)
        if r is None:
            return None
        losses.setdefault(s.arch, {}).setdefault(s.settings[key], []).append(r["val_loss"])
    return {arch: min(by, key=lambda v: np.mean(by[v])) for arch, by in losses.items()}  # the mean over its seeds


def sweep_extension(preset, data, results, sweep_specs, world=None):
    """Sweep runs one step beyond the edge of the values an architecture tried, for every architecture
    whose best value is at that edge (a sweep must bracket its optimum), at most lr_sweep.extend (2)
    steps beyond the preset's grid on either side. [] when every best value is inside its grid."""
    key, values = sweep_values(preset)
    if key is None or len(values) < 2:
        return []
    ratio, limit = values[1] / values[0], preset.lr_sweep.extend
    seen = {}
    for s in sweep_specs:
        r = results.get(s.run_id)
        if r is not None:
            seen.setdefault(s.arch, {}).setdefault(s.settings[key], []).append(r["val_loss"])
    tried = {a: {v: float(np.mean(ls)) for v, ls in by.items()} for a, by in seen.items()}
    extra = []
    for arch, losses in tried.items():
        best, ordered = min(losses, key=losses.get), sorted(losses)
        if best == ordered[-1] and best < values[-1] * ratio ** (limit - 0.5):
            value = float(f"{best * ratio:.12g}")  # 0.012, not 0.011999999999999999
        elif best == ordered[0] and best > values[0] / ratio ** (limit - 0.5):
            value = float(f"{best / ratio:.12g}")
        else:
            continue
        specs, _ = build(replace(preset, lr_sweep=replace(preset.lr_sweep, values=[value])), data, world=world)
        extra += [s for s in specs if s.arch == arch]
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
    """The sweep's report lines and {arch: {value: loss}} (sweep_lines) from its results."""
    key, _ = sweep_values(preset)
    seen = {}
    for s in sweep_specs:
        r = results.get(s.run_id)
        seen.setdefault(s.arch, {}).setdefault(s.settings[key], []).append(r["val_loss"] if r else None)
    losses = {a: {v: None if None in ls else float(np.mean(ls)) for v, ls in by.items()} for a, by in seen.items()}
    return sweep_lines(key, losses, chosen)  # a value's loss: the mean over its seeds


def sweep_lines(key, losses, chosen):
    """losses: {arch: {swept value: validation loss or None}}; chosen: {arch: the value carried up} ->
    (report lines, {arch: {str(value): loss}} for report.json)."""
    values = sorted({v for by in losses.values() for v in by})
    lines = [f"LR sweep ({key}) at the first ladder point, validation loss (* = carried up the ladder; "
             f"- = not tried: a value beyond the grid runs only while the best is at its edge)"]
    lines.append(f"  {'':>12} " + " ".join(f"{v:>10g}" for v in values))
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
    """lr_sweep.csv's rows (arch, key, value, val_loss, carried) of a sweep table (sweep_lines)."""
    return [dict(arch=a, key=key, value=float(v), val_loss=loss, carried=chosen.get(a) == float(v))
            for a, by in table.items() for v, loss in by.items() if loss is not None]


def sweep_from_rows(rows):
    """(key, {arch: {value: loss}}, {arch: carried value}) back from lr_sweep.csv's rows."""
    keys = {r["key"] for r in rows}
    if len(keys) != 1:
        raise ValueError(f"lr_sweep.csv: expected one swept key, found {sorted(keys)}")
    losses, chosen = {}, {}
    for r in rows:
        losses.setdefault(r["arch"], {})[float(r["value"])] = r["val_loss"]
        if r["carried"]:
            chosen[r["arch"]] = float(r["value"])
    return keys.pop(), losses, chosen
