"""The LR sweep every protocol runs: at each sweep point (an architecture at a depth or scale) every value
of one LR, bracketed (while the best is at an edge of those tried, the next value beyond runs too, at most
`extend` beyond the grid); the best (the mean over its seeds) is the point's LR. Its table, lr_sweep.csv."""

import numpy as np

from ladders.runs import grid_neighbours, search


def lr_sweep(preset, points, runs, results, where=None):
    """Each point's bracketed sweep; runs(point, value) -> its specs (marked role "sweep") -> (specs,
    {point: best value} or None while runs are missing, lr_sweep.csv's rows: arch, [where: its depth or
    scale], key, value, val_loss (the mean over its seeds), carried (the value used))."""
    lr = preset["lr"]
    neighbours, specs, best, rows = grid_neighbours(lr["values"], lr["extend"]), [], {}, []
    for point in points:
        tried, best[point] = search(list(lr["values"]), neighbours, lambda v: runs(point, v), results)
        for v in sorted(tried):
            mine = runs(point, v)
            for s in mine:
                s.meta["role"] = "sweep"
            specs += mine
            if best[point] is not None:
                loss = float(np.mean([results[s.run_id]["val_loss"] for s in mine]))
                at = {where: point[1]} if where else {}
                rows.append(dict(arch=point[0], **at, key=lr["key"], value=v, val_loss=loss,
                                 carried=best[point] == v))
    return (specs, None, None) if None in best.values() else (specs, best, rows)


def sweep_lines(rows, sigma=None):
    """The sweep's table from lr_sweep.csv's rows, a block per depth or scale when it has that column; with
    sigma (the noise of a difference of two values' losses) the best value's neighbours' excess in it."""
    where = next((w for w in ("depth", "scale") if w in rows[0]), None)
    lines = [f"LR sweep ({rows[0]['key']}): validation loss, the mean over its seeds (* = the value used"
             + (f"; last, the best's neighbours: excess loss / sigma {sigma:.4f}" if sigma else "") + ")"]
    for at in dict.fromkeys(r.get(where) for r in rows):
        block = [r for r in rows if r.get(where) == at]
        values = sorted({r["value"] for r in block})
        lines.append(f"  {'' if at is None else f'd{at}' if where == 'depth' else at:>12} "
                     + " ".join(f"{v:>10g}" for v in values))
        for arch in dict.fromkeys(r["arch"] for r in block):
            loss = {r["value"]: r["val_loss"] for r in block if r["arch"] == arch}
            used = next((r["value"] for r in block if r["arch"] == arch and r["carried"]), None)
            cells = [f"{loss[v]:9.4f}{'*' if v == used else ' '}" if v in loss else f"{'-':>10}"
                     for v in values]
            if sigma and loss:
                i = values.index(min(loss, key=loss.get))
                near = [loss[values[j]] - loss[values[i]] for j in (i - 1, i + 1)
                        if 0 <= j < len(values) and values[j] in loss]
                cells.append("  " + ", ".join(f"+{d:.3f} ({d / sigma:.1f})" for d in near))
            lines.append(f"  {arch:>12} " + " ".join(cells))
    return lines


def unbracketed(rows):
    """The sweep points (arch, its depth or scale) whose best value lacks a worse value tried on either side:
    a reading that rests on those LRs has no gate."""
    where = next((w for w in ("depth", "scale") if rows and w in rows[0]), None)
    out = []
    for point in dict.fromkeys((r["arch"], r.get(where)) for r in rows):
        losses = [r["val_loss"] for r in sorted((r for r in rows if (r["arch"], r.get(where)) == point),
                                                 key=lambda r: r["value"])]
        out += [" ".join(str(p) for p in point if p is not None)] * (min(losses) in (losses[0], losses[-1]))
    return out


def gate_line(rows):
    """The sweep's gate, one line."""
    loose = unbracketed(rows or [])
    return ("gate: every sweep point's best LR has a worse value on each side" if rows and not loose else
            "gate failed: no LR sweep" if not rows else f"gate failed: the best LR is at an edge for {loose}")
