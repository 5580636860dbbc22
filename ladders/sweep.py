"""The LR sweep every protocol runs, and its table lr_sweep.csv."""

import numpy as np

from ladders.runs import grid_neighbours, search


def lr_sweep(preset, points, runs, results, where=None):
    """Each point's bracketed sweep -> (specs, {point: best}, rows)."""
    # A point is an arch at a depth or scale; its LR
    # is the value of the lowest mean loss over seeds.
    lr = preset["lr"]
    neighbours, specs, best, rows = grid_neighbours(lr["values"], lr["extend"]), [], {}, []
    # Each point bracketed on its own.
    for point in points:
        tried, best[point] = search([*lr["values"]], neighbours, lambda v: runs(point, v), results)
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
    """The sweep's table, a block per depth or scale."""
    # sigma: the noise of a difference of two losses.
    where = next((w for w in ("depth", "scale") if w in rows[0]), None)
    excess = f"; last, the best's neighbours: excess loss / sigma {sigma:.4f}" if sigma else ""
    lines = [f"LR sweep ({rows[0]['key']}): validation loss, the mean over its seeds "
             f"(* = the value used{excess})"]
    # A block per depth or scale, a row per arch.
    for at in dict.fromkeys(r.get(where) for r in rows):
        block = [r for r in rows if r.get(where) == at]
        values = sorted({r["value"] for r in block})
        name = "" if at is None else f"d{at}" if where == "depth" else at
        lines.append(f"  {name:>12} " + " ".join(f"{v:>10g}" for v in values))
        for arch in dict.fromkeys(r["arch"] for r in block):
            mine = [r for r in block if r["arch"] == arch]
            loss = {r["value"]: r["val_loss"] for r in mine}
            used = next((r["value"] for r in mine if r["carried"]), None)
            cells = [f"{loss[v]:9.4f}{'*' if v == used else ' '}" if v in loss else f"{'-':>10}"
                     for v in values]
            # The best's neighbours: their excess loss.
            if sigma and loss:
                i = values.index(min(loss, key=loss.get))
                near = [loss[values[j]] - loss[values[i]] for j in (i - 1, i + 1)
                        if 0 <= j < len(values) and values[j] in loss]
                cells.append("  " + ", ".join(f"+{d:.3f} ({d / sigma:.1f})" for d in near))
            lines.append(f"  {arch:>12} " + " ".join(cells))
    return lines


def unbracketed(rows):
    """The points whose best value lacks a worse one on either side."""
    # A reading that rests on their LRs has no gate.
    where = next((w for w in ("depth", "scale") if rows and w in rows[0]), None)
    out = []
    for point in dict.fromkeys((r["arch"], r.get(where)) for r in rows):
        mine = [r for r in rows if (r["arch"], r.get(where)) == point]
        losses = [r["val_loss"] for r in sorted(mine, key=lambda r: r["value"])]
        if min(losses) in (losses[0], losses[-1]):
            out.append(" ".join(str(p) for p in point if p is not None))
    return out


def gate_line(rows):
    """The sweep's gate, one line."""
    loose = unbracketed(rows or [])
    return ("gate failed: no LR sweep" if not rows
            else f"gate failed: the best LR is at an edge for {loose}" if loose
            else "gate: every sweep point's best LR has a worse value on each side")
