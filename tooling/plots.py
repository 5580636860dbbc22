"""
Figures: the fits' plots (fit.py --plot, ladder.py --plot) and a run's loss curves from its log.jsonl.

Guards against: a figure that breaks a run or a fit. matplotlib is optional (not in requirements.txt:
`pip install -r requirements-plot.txt`); without it every plot_* function prints one line saying so and
returns False, and the command line below says so in one line. Figures are written atomically (a crash
never leaves half a PNG), carry no timestamps (the same data give the same bytes), and use the
non-interactive Agg backend (no display needed). A log.jsonl that is missing or malformed (not JSON, a
missing or non-numeric field) is one line naming the file and the line. This module computes no fit: a
figure of a fitted law is handed the fit's values or callables (see fit.frontier_curves).

    python -m tooling.plots out/tiny/log.jsonl --out out/tiny/curves.png          # loss vs tokens
    python -m tooling.plots out/tiny/log.jsonl --x flops                          # loss vs training FLOPs

Every plot_* function returns True when it wrote `path`, or False after one line on stderr when
matplotlib is missing. Figures are small (6x4 or 10x4 inches at 100 dpi); the format follows the
extension (PNG for the README).
"""

import math
import os
import sys
import warnings

import numpy as np

from tooling.common import cli_error, parser, read_jsonl, write_atomic

PROG = "tooling.plots"  # the name CLI errors start with

PLOT_DPI = 100
_LINESTYLES = ("-", "--", ":", "-.")
_NO_DATES = {"pdf": {"CreationDate": None}, "svg": {"Date": None}}  # PNG has no date; PDF and SVG would
NO_MATPLOTLIB = "matplotlib is not installed, so no figure was written"
HOW_TO_GET_IT = "pip install -r requirements-plot.txt"

# -----------------------------------------------------------------------------
# matplotlib, colours, axes


def pyplot(path=None):
    """matplotlib.pyplot on the non-interactive Agg backend (a session that already imported pyplot
    keeps its own backend), or None after one line on stderr when matplotlib is not installed."""
    try:
        return _import_pyplot()
    except ImportError:
        where = f"{path}: " if path else ""
        print(f"{where}{NO_MATPLOTLIB} (figures are optional: {HOW_TO_GET_IT})", file=sys.stderr)
        return None


def _import_pyplot():
    import matplotlib
    if "matplotlib.pyplot" not in sys.modules:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _colours(names):
    """A fixed colour per name in order of first appearance (matplotlib's C0..C9, repeating)."""
    return {n: f"C{i % 10}" for i, n in enumerate(dict.fromkeys(names))}


def _per_value(x, v, reduce):
    """reduce(v) over the points sharing each distinct x (sorted); nan where all of them are nan."""
    xs = np.unique(x)
    idx = np.searchsorted(xs, x)
    v = np.asarray(v, dtype=float)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # an all-nan group is nan, silently
        return xs, np.array([reduce(v[idx == k]) for k in range(len(xs))])


def _legend(ax, **kw):
    if ax.get_legend_handles_labels()[0]:  # no "no artists with labels" warning on an empty plot
        ax.legend(**kw)


def _draw_loss_vs_compute(ax, runs, fits, colours):
    fits = {a: f for a, f in fits.items() if a in runs}
    Es = {round(f.E, 12) for f in fits.values()}
    shared = len(Es) == 1
    for arch, (C, L) in runs.items():
        C, L = np.asarray(C, dtype=float).ravel(), np.asarray(L, dtype=float).ravel()
        col, f = colours[arch], fits.get(arch)
        ax.plot(C, L, "o", ms=4, alpha=0.8, color=col, label=None if f is not None else f"{arch} (no fit)")
        if f is not None and len(C):
            grid = np.geomspace(C.min(), C.max(), 100)
            label = f"{arch}: γ={f.gamma:.3f}, A={f.A:.3g}" + ("" if shared else f", E={f.E:.3f}")
            ax.plot(grid, f.loss(grid), "-", lw=1.5, color=col, label=label)
    ax.plot([], [], "o", ms=4, color="0.4", label="measured (every seed)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    _plain_log_ticks(ax)
    ax.set_xlabel("training compute C (FLOPs)")
    ax.set_ylabel("loss (nats/token, log scale)")
    law = r"$L = E + A\,(C/C_0)^{-\gamma}$"
    ax.set_title(f"[X5] {law}" + (f", shared E = {Es.pop():.3f} [X7]" if shared else ", E per arch"), fontsize=10)
    _legend(ax, fontsize=7)


def _plain_log_ticks(ax):
    """Plain decimal labels on a log y axis of at most three decades (2.5, 3, 3.5 for a loss; 0.1, 0.2,
    0.5 for L - E), where matplotlib would label only powers of ten, sometimes none. Call after drawing."""
    from matplotlib.ticker import LogLocator, MaxNLocator, NullFormatter, StrMethodFormatter
    lo, hi = ax.get_ylim()
    if not (0 < lo < hi <= 1000 * lo):
        return
    if hi < 10 * lo:
        ax.set_yticks([t for t in MaxNLocator(6).tick_values(lo, hi) if lo <= t <= hi])
    else:
        ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(StrMethodFormatter("{x:.3g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())


def _draw_multipliers(ax, ref_C, multipliers, bands, ref, colours):
    ref_C = np.asarray(ref_C, dtype=float).ravel()
    ax.axhline(1.0, color="0.5", ls="--", lw=1, label="1 = no difference")
    any_band = False
    for arch, m in multipliers.items():
        if arch == ref:
            continue
        m = np.asarray(m, dtype=float).ravel()
        if m.shape != ref_C.shape:
            raise ValueError(f"multipliers['{arch}'] has {m.size} values for {ref_C.size} reference budgets")
        col = colours[arch]
        if bands and arch in bands:
            lo, hi = (np.asarray(b, dtype=float).ravel() for b in bands[arch])
            if lo.shape != ref_C.shape or hi.shape != ref_C.shape:
                raise ValueError(f"bands['{arch}'] must be (lo, hi), each with {ref_C.size} values")
            xs, lo = _per_value(ref_C, lo, np.nanmin)
            _, hi = _per_value(ref_C, hi, np.nanmax)
            ax.fill_between(xs, lo, hi, color=col, alpha=0.2, lw=0)
            any_band = True
        xs, mean = _per_value(ref_C, m, np.nanmean)
        if len(xs) < len(ref_C):  # repeated seeds: every point, the line through their means
            ax.plot(ref_C, m, ".", ms=4, alpha=0.6, color=col)
        ax.plot(xs, mean, "o-", ms=4, color=col, label=arch)
    if any_band:
        ax.fill_between([], [], color="0.5", alpha=0.2, lw=0, label="shaded: interval")
    ax.set_xscale("log")
    ax.set_xlabel(f"{ref} training compute C (FLOPs)")
    ax.set_ylabel(r"compute multiplier $C_{\mathrm{ref}} / C_{\mathrm{arch}}$ (×)")
    ax.set_title(f"[X6] compute multiplier vs {ref} at equal loss", fontsize=10)
    _legend(ax, fontsize=7)


# -----------------------------------------------------------------------------
# The fits' figures ([X5]-[X7] power laws and multipliers, [S4]-[S5] frontiers and CE Gain, loss curves)


def plot_loss_vs_compute(runs, fits, path, title=None):
    """[X5] loss vs training FLOPs per architecture: every measured point (repeated seeds at one C are
    all drawn) and the fitted law L = E + A (C/C0)^-gamma over that architecture's measured range, in
    the same colour. Plain loss on log-log axes (not loss - E, which a noisy point below E could not
    show); the laws bend towards E. runs: {arch: (C, loss)}; fits: {arch: a fitted law with E, A, gamma
    and loss(C)} (fit.PowerLawFit; an arch without a fit gets markers only). Returns True when written,
    False without matplotlib."""
    def draw(fig, ax):
        _draw_loss_vs_compute(ax, runs, fits, _colours(runs))
        if title:
            ax.set_title(title, fontsize=10)
    return _figure(path, draw)


def plot_multipliers(ref_C, multipliers, path, bands=None, ref="vanilla", title=None):
    """[X6] compute multiplier C_ref / C_arch at equal loss vs the reference's compute, one line per
    architecture (the reference itself is skipped if present). multipliers: {arch: array of
    len(ref_C)}, nan where undefined (a gap in the line); bands: optional {arch: (lo, hi)} of the same
    length, shaded in the arch's colour. Repeated reference budgets (seeds): all points are marked and
    the line joins their means (the band spans their extremes). A dashed line at 1 means no difference.
    Returns True when written, False without matplotlib."""
    def draw(fig, ax):
        _draw_multipliers(ax, ref_C, multipliers, bands, ref, _colours([ref, *multipliers]))
        if title:
            ax.set_title(title, fontsize=10)
    return _figure(path, draw)


def plot_power_laws(runs, fits, multipliers, ref, path, title=None, budgets=None):
    """`fit.py power --plot`: plot_loss_vs_compute (left) and plot_multipliers at the reference's
    budgets (right; default: every measured compute of the reference, runs[ref][0]) side by side, an
    architecture in one colour in both. Returns True when written, False without matplotlib."""
    budgets = runs[ref][0] if budgets is None else budgets

    def draw(fig, axes):
        colours = _colours([ref, *runs, *multipliers])
        _draw_loss_vs_compute(axes[0], runs, fits, colours)
        _draw_multipliers(axes[1], budgets, multipliers, None, ref, colours)
        if title:
            fig.suptitle(title, fontsize=11)
    return _figure(path, draw, ncols=2, figsize=(10, 4))


def plot_ce_gain(budgets, sparsities, gain, path, lo=None, hi=None, title=None):
    """[S5] CE Gain = 1 - C_target / C_ref vs the compute budget C, one line per sparsity S. gain, lo,
    hi: arrays of shape (len(budgets), len(sparsities)) as ce_gain on a meshgrid / cell_bootstrap
    give them; lo and hi (both or neither) are shaded as the 95% interval. A dashed line at 0 means no
    difference. Returns True when written, False without matplotlib."""
    budgets = np.asarray(budgets, dtype=float).ravel()
    sparsities = np.asarray(sparsities, dtype=float).ravel()
    shape = (len(budgets), len(sparsities))
    arrays = {"gain": gain, "lo": lo, "hi": hi}
    if (lo is None) != (hi is None):
        raise ValueError("plot_ce_gain: give both lo and hi, or neither")
    for name, a in arrays.items():
        if a is not None and np.shape(a) != shape:
            raise ValueError(f"plot_ce_gain: {name} has shape {np.shape(a)}, expected (budgets, sparsities) = {shape}")
    order = np.argsort(budgets)
    C = budgets[order]
    gain = np.asarray(gain, dtype=float)[order]

    def draw(fig, ax):
        ax.axhline(0.0, color="0.5", ls="--", lw=1, label="0 = no difference")
        for j, S in enumerate(sparsities):
            col = f"C{j % 10}"
            if lo is not None:
                ax.fill_between(C, np.asarray(lo, dtype=float)[order, j], np.asarray(hi, dtype=float)[order, j],
                                color=col, alpha=0.2, lw=0)
            ax.plot(C, gain[:, j], "o-", ms=4, color=col, label=f"S = {S:g}")
        ax.set_xscale("log")
        ax.set_xlabel("compute budget C (FLOPs)")
        ax.set_ylabel(r"CE Gain $= 1 - C_{\mathrm{target}} / C_{\mathrm{ref}}$")
        ax.set_title(title or r"[S5] CE Gain on the compute-optimal frontier", fontsize=10)
        _legend(ax, fontsize=7, title="sparsity" + (" (shaded: 95% interval)" if lo is not None else ""),
                title_fontsize=7)
    return _figure(path, draw)


def plot_loss_curves(curves, path, title=None, xlabel="tokens"):
    """Loss curves (e.g. of decay branches), one line per label. curves: {label: (x, loss)}. Labels
    that share everything but their last word ("baseline L4w32-e16 b10", "... b20") form a group: one
    colour per group, a line style per member, and a small legend (fontsize 6, two columns when long).
    Returns True when written, False without matplotlib."""
    groups = {label: label.rsplit(" ", 1)[0] if " " in label else label for label in curves}
    grouped = len(set(groups.values())) < len(curves)
    colours = _colours(groups.values() if grouped else curves)
    def draw(fig, ax):
        member = {}
        for label, (x, y) in curves.items():
            g = groups[label] if grouped else label
            k = member[g] = member.get(g, -1) + 1
            ax.plot(np.asarray(x, dtype=float), np.asarray(y, dtype=float), lw=1.2, color=colours[g],
                    ls=_LINESTYLES[k % len(_LINESTYLES)], label=label)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("loss (nats/token)")
        ax.set_title(title or "loss curves", fontsize=10)
        small = grouped or len(curves) > 6
        _legend(ax, fontsize=6 if small else 8, ncol=2 if len(curves) > 6 else 1)
    return _figure(path, draw)


def plot_surface_frontiers(frontiers, sparsities, path, C_range=(1e18, 1e23), title=None):
    """[S4] iso-sparsity frontiers L*(C, S) - E = f(S) C^-gamma: straight lines on log-log axes, one
    colour per architecture, a line style per sparsity. frontiers: {arch: (gamma, excess)} with
    excess(C, S) -> L*(C, S) - E on an array of budgets C (fit.frontier_curves(surface fits) gives
    them). Returns True when written, False without matplotlib."""
    lo_C, hi_C = (float(c) for c in C_range)
    if not (0 < lo_C <= hi_C and math.isfinite(hi_C)):
        raise ValueError(f"plot_surface_frontiers: C_range must be 0 < low <= high, got {C_range}")
    C = np.geomspace(lo_C, hi_C, 200)
    colours = _colours(frontiers)

    def draw(fig, ax):
        for arch, (gamma, excess) in frontiers.items():
            for k, S in enumerate(sparsities):
                ax.plot(C, excess(C, S), color=colours[arch], ls=_LINESTYLES[k % len(_LINESTYLES)],
                        label=f"{arch}, S={S:g} (γ={gamma:.3f})")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("training compute C = F·D (FLOPs)")
        ax.set_ylabel(r"$L^*(C,S) - E$ (nats/token, log scale)")
        _plain_log_ticks(ax)
        ax.set_title(title or r"[S4] iso-sparsity frontiers $L^* - E = f(S)\,C^{-\gamma}$", fontsize=10)
        _legend(ax, fontsize=7)
    return _figure(path, draw)


def plot_repeat_frontier(frontier, points, l_star, path, title=None):
    """A data-constrained ladder: loss vs training compute for each K (passes), one point per stored
    size at its best weight decay (error bar: the seed std where there are several seeds), lines
    joining the sizes, and the best K = 1 loss as a horizontal line. frontier: {K: [(C, mean loss)]};
    points: {(K, depth): (C, [loss per seed])}. Returns True when written, False without matplotlib."""
    colours = _colours(sorted(frontier))

    def draw(fig, ax):
        for k in sorted(frontier):
            C, L = (np.array(v, dtype=float) for v in zip(*sorted(frontier[k])))
            ax.plot(C, L, "-", lw=1.2, color=colours[k], label=f"K={k}")
            for (kk, _), (c, losses) in points.items():
                if kk == k:
                    err = np.std(losses, ddof=1) if len(losses) > 1 else 0.0
                    ax.errorbar([c], [np.mean(losses)], yerr=[err], fmt="o", ms=4, color=colours[k], capsize=2)
        ax.axhline(l_star, color="0.5", ls="--", lw=1, label=f"best K=1 loss {l_star:.4f}")
        ax.set_xscale("log")
        ax.set_xlabel("training compute C (FLOPs)")
        ax.set_ylabel("validation loss (nats/token)")
        ax.set_title(title or "loss vs compute per K", fontsize=10)
        _legend(ax, fontsize=7)
    return _figure(path, draw)


def plot_wd_curves(curves, path, title=None):
    """Validation loss vs weight decay, one panel per group (e.g. K), a line per member (e.g. stored
    depth). curves: {group: {member: [(wd, loss)]}}. Returns True when written, False without matplotlib."""
    groups = list(curves)

    def draw(fig, axes):
        axes = np.atleast_1d(axes)
        for ax, g in zip(axes, groups):
            colours = _colours(curves[g])
            for m, pts in curves[g].items():
                if pts:
                    w, L = (np.array(v, dtype=float) for v in zip(*sorted(pts)))
                    ax.plot(w, L, "o-", ms=3, lw=1, color=colours[m], label=f"d{m}")
            ax.set_xscale("log")
            ax.set_xlabel("weight decay")
            ax.set_title(str(g), fontsize=9)
        axes[0].set_ylabel("validation loss (nats/token)")
        _legend(axes[0], fontsize=7)
        fig.suptitle(title or "loss vs weight decay", fontsize=10)
    return _figure(path, draw, ncols=len(groups), figsize=(3 * len(groups), 3.5))


# -----------------------------------------------------------------------------
# Making and writing a figure


def _figure(path, draw, ncols=1, figsize=(6, 4)):
    """A figure of ncols axes: draw(fig, axes) fills it and it is written to path (atomically). False,
    after one line on stderr, when matplotlib is missing; a failed draw closes the figure."""
    plt = pyplot(path)
    if plt is None:
        return False
    fig, axes = plt.subplots(1, ncols, figsize=figsize)
    try:
        draw(fig, axes)
        for ax in fig.axes:  # log axes past a decade: minor labels at 2x and 5x only (all of them overlap)
            low, high = ax.get_xlim()
            if ax.get_xscale() == "log" and high > 10 * low > 0:
                ax.xaxis.set_minor_formatter(plt.FuncFormatter(_two_five_label if high < 100 * low else
                                                               lambda x, _: ""))
    except BaseException:
        plt.close(fig)
        raise
    _save(plt, fig, path)
    return True


def _two_five_label(x, _):
    exponent = math.floor(math.log10(x) + 1e-9)
    mantissa = round(x / 10**exponent)
    return rf"${mantissa}\times10^{{{exponent}}}$" if mantissa in (2, 5) else ""


def _save(plt, fig, path):
    fmt = os.path.splitext(path)[1][1:].lower() or "png"  # the format named by the extension, as savefig does
    kw = {"metadata": _NO_DATES[fmt]} if fmt in _NO_DATES else {}  # deterministic: no creation date

    def write(f):
        if fmt == "svg":  # and fixed element ids (salted with a random number by default)
            with plt.rc_context({"svg.hashsalt": "loopstudy"}):
                fig.savefig(f, format=fmt, dpi=PLOT_DPI, bbox_inches="tight", **kw)
        else:
            fig.savefig(f, format=fmt, dpi=PLOT_DPI, bbox_inches="tight", **kw)
    try:
        write_atomic(path, write)
    finally:
        plt.close(fig)


# -----------------------------------------------------------------------------
# A run's curves from its log.jsonl (train.py writes one line per eval)

LOG_X = {"tokens": "tokens trained", "flops": "training FLOPs (cumulative)"}  # --x choices -> axis label


def read_log(path):
    """A train.py log.jsonl as columns: {"step", "tokens", "flops", "train_loss", "val_loss": lists,
    "by_source": {source: list}}, one entry per eval line. train_loss is None on a line where it is
    null (step 0); a source missing from a line is None there. A missing file raises OSError; a line
    that is not a JSON object with numeric step, tokens, flops and val_loss raises ValueError naming the
    file and the line (as tooling.common.read_jsonl does for malformed JSON)."""
    cols = {k: [] for k in ("step", "tokens", "flops", "train_loss", "val_loss")}
    by_source = {}
    for n, (lineno, record) in enumerate(read_jsonl(path)):
        where = f"{path}:{lineno}"
        if not isinstance(record, dict):
            raise ValueError(f"{where}: expected a JSON object (one eval of train.py), got {type(record).__name__}")
        for key in ("step", "tokens", "flops", "val_loss", "train_loss"):
            if key not in record:
                raise ValueError(f"{where}: no {key!r} field; is this a train.py log.jsonl?")
            cols[key].append(_log_number(where, key, record[key], null_ok=key == "train_loss"))
        sources = record.get("val_loss_by_source") or {}
        if not isinstance(sources, dict):
            raise ValueError(f"{where}: 'val_loss_by_source' must be an object {{source: loss}}")
        for name, value in sources.items():
            by_source.setdefault(name, [None] * n)
            by_source[name].append(_log_number(where, f"val_loss_by_source.{name}", value, null_ok=True))
        for values in by_source.values():
            values.extend([None] * (n + 1 - len(values)))  # a source this line does not have
    if not cols["step"]:
        raise ValueError(f"{path}: no evals in the log (an empty file)")
    return dict(cols, by_source=by_source)


def _log_number(where, key, value, null_ok=False):
    if value is None and null_ok:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{where}: {key!r} must be a finite number{' or null' if null_ok else ''}, got {value!r}")
    return value


def plot_log(log, path, x="tokens", title=None):
    """Train and validation loss of one run (read_log's columns) against tokens or training FLOPs
    (x="flops"): solid lines for train and val loss, dashed lines for the val loss per source. Returns
    True when written, False without matplotlib."""
    if x not in LOG_X:
        raise ValueError(f"plot_log: x must be one of {', '.join(LOG_X)}, got {x!r}")
    xs = np.asarray(log[x], dtype=float)
    as_float = lambda values: np.array([np.nan if v is None else v for v in values], dtype=float)  # noqa: E731

    def draw(fig, ax):
        train = as_float(log["train_loss"])
        has_train = np.isfinite(train)
        if has_train.any():
            ax.plot(xs[has_train], train[has_train], "-", lw=1.2, color="C0", label="train loss")
        ax.plot(xs, as_float(log["val_loss"]), "o-", ms=3, lw=1.5, color="C1", label="val loss")
        for k, (name, values) in enumerate(log["by_source"].items()):
            ax.plot(xs, as_float(values), "--", lw=1, color=f"C{(k + 2) % 10}", label=f"val loss on {name}")
        ax.set_xlabel(LOG_X[x])
        ax.set_ylabel("loss (nats/token)")
        ax.set_title(title or "loss curves", fontsize=10)
        _legend(ax, fontsize=7)
    return _figure(path, draw)


# -----------------------------------------------------------------------------
# Command line


def main(argv=None):
    p = parser(PROG, description="Plot a run's loss curves (train "
                                "and validation loss, the validation loss per source dashed) from the "
                                "log.jsonl train.py writes. Needs matplotlib (" + HOW_TO_GET_IT + ").")
    p.add_argument("log", help="a run's log.jsonl, e.g. out/tiny/log.jsonl (one JSON line per eval: step, tokens, "
                               "flops, train_loss, val_loss, optionally val_loss_by_source)")
    p.add_argument("--out", help="the figure to write; its extension names the format (.png, .pdf, .svg) "
                                 "(default: curves.png beside the log)")
    p.add_argument("--x", choices=sorted(LOG_X), default="tokens",
                   help="the x axis: tokens trained or cumulative training FLOPs (default: tokens)")
    p.add_argument("--title", help="figure title (default: the log's path)")
    args = p.parse_args(argv)
    out = args.out or os.path.join(os.path.dirname(args.log), "curves.png")
    try:
        log = read_log(args.log)
        try:
            _import_pyplot()
        except ImportError:
            raise ValueError(f"{NO_MATPLOTLIB} ({HOW_TO_GET_IT})") from None
        plot_log(log, out, x=args.x, title=args.title or f"loss curves: {args.log}")
    except (OSError, ValueError) as e:  # missing or malformed log, no matplotlib, a figure that cannot be written
        return cli_error(PROG, e)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
