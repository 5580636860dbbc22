"""
Figures: a run's loss curves from its log.jsonl, and the fits' plots (fit.py
--plot, the ladders). matplotlib is optional: without it each plot_* function
prints one line and returns False. A fitted law comes in as an object.

    python plots.py out/tiny/log.jsonl --out out/tiny/curves.png [--x flops]
"""
import argparse
import json
import os
import sys

import numpy as np

NO_MATPLOTLIB = ("matplotlib is not installed, so no figure was written "
                 "(pip install -r requirements-plot.txt)")
STYLES = ("-", "--", ":", "-.")


def read_log(path):
    """A train.py log.jsonl: a dict per eval (step, tokens, val_loss, ...)."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def pyplot(path=None):
    """matplotlib.pyplot, or None after one line on stderr."""
    try:
        import matplotlib
        # Agg needs no display; a backend chosen before stays.
        if "matplotlib.pyplot" not in sys.modules:
            matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        print(f"{path}: {NO_MATPLOTLIB}" if path else NO_MATPLOTLIB, file=sys.stderr)
        return None


def _figure(path, draw, ncols=1, figsize=(6, 4), **grid):
    # Save the figure draw(fig, axes) draws to path: True, or False.
    plt = pyplot(path)
    if plt is None:
        return False
    fig, axes = plt.subplots(grid.pop("nrows", 1), ncols, figsize=figsize, **grid)
    try:
        draw(fig, axes)
        # Each axes with a labelled line gets a legend.
        for ax in fig.axes:
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        fig.savefig(path, dpi=100, bbox_inches="tight")
    finally:
        plt.close(fig)
    return True


def _colours(names):
    return {n: f"C{i % 10}" for i, n in enumerate(dict.fromkeys(names))}


def plot_log(log, path, x="tokens", title=None):
    """A run's train and validation loss (per source: dashed) vs tokens or FLOPs."""
    # The points first: a log that is not train.py's fails here, before
    # matplotlib is imported. train_loss is null at step 0.
    losses = {key: [(r[x], r[key]) for r in log if r.get(key) is not None]
              or [(np.nan, np.nan)] for key in ("train_loss", "val_loss")}
    # The sources in the order the log first names them.
    sources = dict.fromkeys(s for r in log for s in r.get("val_loss_by_source") or {})
    by_source = {s: [(r[x], r["val_loss_by_source"][s]) for r in log
                     if (r.get("val_loss_by_source") or {}).get(s) is not None]
                 for s in sources}

    def draw(fig, ax):
        for key, fmt in (("train_loss", "-"), ("val_loss", "o-")):
            ax.plot(*zip(*losses[key]), fmt, ms=3, label=key.replace("_", " "))
        for k, (s, pts) in enumerate(by_source.items()):
            ax.plot(*zip(*pts), "--", lw=1, color=f"C{(k + 2) % 10}",
                    label=f"val loss on {s}")
        xlabel = "tokens trained" if x == "tokens" else "training FLOPs"
        ax.set(xlabel=xlabel, ylabel="loss (nats/token)", title=title or "loss curves")
    return _figure(path, draw)


# -----------------------------------------------------------------------------
# [X5]-[X7] power laws and compute multipliers

def _loss_vs_compute(ax, runs, fits, colours):
    # A shared E [X7] is said once, in the title.
    shared = len({round(f.E, 12) for f in fits.values()}) == 1
    for arch, (C, L) in runs.items():
        C, f = np.asarray(C, float), fits.get(arch)
        label = None if f else f"{arch} (no fit)"
        ax.plot(C, L, "o", ms=4, alpha=0.8, color=colours[arch], label=label)
        if f:
            grid = np.geomspace(C.min(), C.max(), 100)
            E = "" if shared else f", E={f.E:.3f}"
            ax.plot(grid, f.loss(grid), color=colours[arch],
                    label=f"{arch}: γ={f.gamma:.3f}, A={f.A:.3g}{E}")
    if shared:
        E = f", shared E = {next(iter(fits.values())).E:.3f} [X7]"
    else:
        E = ", E per arch"
    ax.set(xscale="log", xlabel="training compute C (FLOPs)", ylabel="loss (nats/token)",
           title=r"[X5] $L = E + A\,(C/C_0)^{-\gamma}$" + E)


def _per_budget(ref_C, values, reduce):
    # reduce() of the finite values at each budget, nan where none.
    ref_C, values = np.asarray(ref_C, float), np.asarray(values, float)
    # Repeated seeds give a budget several values.
    xs = np.unique(ref_C)
    groups = [values[(ref_C == x) & np.isfinite(values)] for x in xs]
    return xs, np.array([reduce(v) if len(v) else np.nan for v in groups])


def _multipliers(ax, ref_C, multipliers, bands, ref, colours):
    ax.axhline(1.0, color="0.5", ls="--", lw=1, label="1 = no difference")
    for arch, m in multipliers.items():
        # The reference is 1 everywhere: the dashed line.
        if arch == ref:
            continue
        if bands and arch in bands:
            xs, lo = _per_budget(ref_C, bands[arch][0], np.min)
            hi = _per_budget(ref_C, bands[arch][1], np.max)[1]
            ax.fill_between(xs, lo, hi, color=colours[arch], alpha=0.2)
        # A dot per seed; the line joins each budget's mean.
        ax.plot(ref_C, m, ".", ms=4, alpha=0.6, color=colours[arch])
        ax.plot(*_per_budget(ref_C, m, np.mean), "o-", ms=4, color=colours[arch], label=arch)
    ax.set(xscale="log", xlabel=f"{ref} training compute C (FLOPs)",
           ylabel="multiplier C_ref / C_arch",
           title=f"[X6] compute multiplier vs {ref} at equal loss")


def plot_loss_vs_compute(runs, fits, path, title=None):
    """[X5] loss vs FLOPs of runs {arch: (C, loss)}, with fits {arch: law}."""
    def draw(fig, ax):
        _loss_vs_compute(ax, runs, fits, _colours(runs))
        ax.set_title(title or ax.get_title(), fontsize=9)
    return _figure(path, draw)


def plot_multipliers(ref_C, multipliers, path, bands=None, ref="vanilla", title=None):
    """[X6] multipliers {arch: array} vs ref_C; bands {arch: (lo, hi)} shaded."""
    def draw(fig, ax):
        _multipliers(ax, ref_C, multipliers, bands, ref, _colours([ref, *multipliers]))
        ax.set_title(title or ax.get_title(), fontsize=9)
    return _figure(path, draw)


def plot_power_laws(runs, fits, multipliers, ref, path, title=None, budgets=None):
    """`fit.py power --plot`: the laws left, the multipliers at `budgets` right."""
    def draw(fig, axes):
        # An arch has one colour in both panels.
        colours = _colours([ref, *runs])
        _loss_vs_compute(axes[0], runs, fits, colours)
        ref_C = runs[ref][0] if budgets is None else budgets
        _multipliers(axes[1], ref_C, multipliers, None, ref, colours)
        fig.suptitle(title or "")
    return _figure(path, draw, ncols=2, figsize=(11, 4))


# -----------------------------------------------------------------------------
# [S4] frontiers; loss curves; the ladders' contrasts

def plot_surface_frontiers(frontiers, sparsities, path, C_range=(1e18, 1e23), title=None):
    """[S4] frontiers {arch: (gamma, excess(C, S))} of fit.frontier_curves."""
    # L*(C, S) - E = f(S) C^-gamma: a colour per arch, a style per sparsity.
    C, colours = np.geomspace(*C_range, 200), _colours(frontiers)

    def draw(fig, ax):
        for arch, (gamma, excess) in frontiers.items():
            for k, S in enumerate(sparsities):
                ax.plot(C, excess(C, S), color=colours[arch], ls=STYLES[k % 4],
                        label=f"{arch}, S={S:g} (γ={gamma:.3f})")
        ax.set(xscale="log", yscale="log", xlabel="training compute C = F D (FLOPs)",
               ylabel="L*(C, S) - E")
        ax.set_title(title or "[S4] iso-sparsity frontiers", fontsize=9)
    return _figure(path, draw)


def plot_loss_curves(curves, path, title=None, xlabel="tokens", ylabel="loss (nats/token)"):
    """Loss curves {label: (x, loss)}."""
    # Labels equal but for their last word share a colour, with a style each.
    groups = {label: label.rsplit(" ", 1)[0] for label in curves}
    colours, seen = _colours(groups.values()), {}

    def draw(fig, ax):
        for label, (x, y) in curves.items():
            k = seen[groups[label]] = seen.get(groups[label], -1) + 1
            ax.plot(x, y, lw=1.2, color=colours[groups[label]], ls=STYLES[k % 4], label=label)
        ax.set(xlabel=xlabel, ylabel=ylabel)
        ax.set_title(title or "loss curves", fontsize=9)
    return _figure(path, draw)


def plot_contrasts(panels, path, title=None):
    """Panels [(x label, [(label, value, lo, hi)])] of 95% intervals, stacked."""
    # An interval above 0 is green, below 0 red, and grey where it holds 0.
    def draw(fig, axes):
        for ax, (xlabel, rows) in zip(np.atleast_1d(axes), panels):
            # The first row on top.
            y = np.arange(len(rows))[::-1]
            for yi, (_, v, lo, hi) in zip(y, rows):
                ax.errorbar(v, yi, xerr=[[v - lo], [hi - v]], fmt="o", ms=4, capsize=2,
                            color="C2" if lo > 0 else "C3" if hi < 0 else "0.4")
            ax.axvline(0.0, color="0.5", ls="--", lw=1)
            ax.set_yticks(y, [label for label, *_ in rows], fontsize=7)
            ax.set_xlabel(xlabel, fontsize=8)
        fig.suptitle(title or "contrasts", fontsize=9)
    # A panel's height follows its number of rows.

    sizes = [len(rows) for _, rows in panels]
    return _figure(path, draw, figsize=(9, 0.3 * sum(sizes) + 1.2 * len(panels)),
                   nrows=len(panels), gridspec_kw={"height_ratios": sizes})


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="plots.py", usage=argparse.SUPPRESS,
        description="A run's loss curves (train and validation loss) from its log.jsonl "
                    "(matplotlib).")
    parser.add_argument("log", help="a train.py log.jsonl, e.g. out/tiny/log.jsonl")
    parser.add_argument("--out", help="the figure, .png / .pdf / .svg "
                                      "(default: curves.png beside the log)")
    parser.add_argument("--x", choices=("tokens", "flops"), default="tokens",
                        help="the x axis")
    args = parser.parse_args(argv)
    out = args.out or os.path.join(os.path.dirname(args.log), "curves.png")
    try:
        written = plot_log(read_log(args.log), out, x=args.x, title=args.log)
    except (OSError, ValueError, KeyError, TypeError) as e:
        # No file, not JSON, or not a train.py log: one line.
        parser.error(str(e) if isinstance(e, OSError) else f"{args.log}: {type(e).__name__}: {e}")
    # Without matplotlib: one line, and status 2.
    if not written:
        return 2

    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
