"""
The command line of fit.py (surface | chinchilla | power) around the fits: the argument parser and its help
texts, the numbers a flag takes, reading and checking the runs CSV of each subcommand (tooling.tables), and
the tables or the JSON object printed from the fit results fit.py hands in. Nothing here fits anything: it
imports no fit code and reads the results by their attributes (E, A, gamma, ...), so fit.py keeps the laws
and a short main() that parses, reads, fits and prints.

Guards against: a flag taken by an abbreviation (`--boot 5` is not `--bootstrap 5`), a list flag with a
non-number or an out-of-range value, an architecture named on the command line that the file lacks, a name
spelled in two cases, and a fit error that does not say which file (and architecture) it came from.
"""
import argparse
import contextlib
import json
import math

import numpy as np

from tooling import common, tables

SURFACE_COLUMNS = ["arch", "cell", "F", "S", "D", "loss"]  # the columns `surface` reads
# (power: tables.read_power_csv, arch/C/loss[/depth]; chinchilla: tables.read_chinchilla_csv)

SUBCOMMANDS = {  # name: (one line for `fit.py --help`, the input it reads for `fit.py NAME --help`)
    "surface": ("SMELT surfaces [S2], CE Gain [S5], TPP, cell bootstrap",
                "Fits L(F, S, D) = E + A (1-S)^b / F^a + K / D^c [S2] per architecture; prints each surface, the CE\n"
                "Gain [S5] of --target over --ref and TPP = D*/(F*/6) at every --budgets x --sparsity.\n\n"
                "Input: a CSV, one row per measured point, with columns arch, cell (the grid cell the point\n"
                "belongs to: the bootstrap resamples cells), F (training FLOPs per token, > 0), S (sparsity in\n"
                "[0, 1)), D (training tokens, > 0) and loss (> 0). Other columns are ignored."),
    "chinchilla": ("Chinchilla Approach 3",
                   "Fits L(N, D) = E + A / N^alpha + B / D^beta (Chinchilla Approach 3: Huber on log-loss).\n\n"
                   "Input: a CSV with columns N (parameters; or params), D (training tokens; or C or train_flops,\n"
                   "the training FLOPs, then D = C / 6N) and loss, all > 0. Other columns are ignored."),
    "power": ("[X] protocol: shared-E power laws and compute multipliers",
              "Fits L(C) = E + A (C/C0)^-gamma [X5]: E by a free fit of --ref, then every architecture (--ref\n"
              "included) with that E fixed [X7], by least squares of log(L - E) on log(C/C0) on all of its\n"
              "points; prints each gamma with its standard error, and the compute multipliers [X6] against\n"
              "--ref at its budgets.\n\n"
              "--protocol x (the default) is the [X] paper's own fit of E: a 600-point grid over E in\n"
              "[0, 0.995 min L] for the start, bounded least squares on the raw loss, then a Huber pass with\n"
              "f_scale = 1.345 MAD / 0.6745 of its residuals. --protocol huber-log is the surfaces' protocol\n"
              "(summed Huber, delta 1e-3, on log-loss). Multipliers: the arch's consecutive points whose loss\n"
              "falls and brackets --ref's loss, log compute interpolated linearly in loss, the smallest such\n"
              "compute; nan where none brackets (never extrapolated).\n\n"
              "Input: a CSV with columns arch, C (training FLOPs, > 0) and loss (> 0), optionally depth; the\n"
              "[X] paper's released ladders' names arm, compute_flops, val_loss are read as arch, C, loss\n"
              "(tests/data/fineweb_ladders.csv). Repeated seeds are rows with the same arch and C. Other\n"
              "columns are ignored.\n\n"
              "The paper's ladder figure: fit.py power tests/data/fineweb_ladders.csv --ref vanilla --min-depth 8"),
}


# -----------------------------------------------------------------------------
# the parser

def numbers(text, ok, rule):
    """argparse type: comma-separated finite numbers, each satisfying ok(v)."""
    try:
        values = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        values = []
    if not values or not all(math.isfinite(v) and ok(v) for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers {rule}, got '{text}'")
    return values


def budgets(text):
    return numbers(text, lambda v: v > 0, "> 0")


def sparsities(text):
    return numbers(text, lambda v: 0 <= v < 1, "in [0, 1)")


def build_parser(description, protocols, C0):
    """fit.py's parser. description: its --help's first paragraph; protocols: the --protocol choices (the
    first is the default); C0: the default --C0."""
    p = common.CliParser(prog="fit.py", description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True, help="the fit to run; `fit.py NAME --help` lists its flags "
                                                         "and the CSV columns it reads")

    def add(name):
        return sub.add_parser(name, help=SUBCOMMANDS[name][0], description=SUBCOMMANDS[name][1],
                              formatter_class=argparse.RawDescriptionHelpFormatter)

    json_help = "print one JSON object instead of tables"
    s = add("surface")
    s.add_argument("csv", help="the runs CSV (columns arch, cell, F, S, D, loss)")
    s.add_argument("--ref", required=True, help="reference architecture, a value of column arch (e.g. baseline)")
    s.add_argument("--target", required=True, help="architecture compared with --ref, a value of column arch "
                                                    "(e.g. smelt); CE Gain > 0: it needs less compute")
    s.add_argument("--budgets", type=budgets, default="1e20,1e21", metavar="C,C,...",
                   help="comma-separated compute budgets C = F x D in FLOPs at which CE Gain and TPP are reported "
                        "(default: 1e20,1e21)")
    s.add_argument("--sparsity", type=sparsities, default="0.85,0.95", metavar="S,S,...",
                   help="comma-separated sparsities S in [0, 1) at which CE Gain and TPP are reported "
                        "(default: 0.85,0.95)")
    s.add_argument("--bootstrap", type=common.number(int, 0), default=0, metavar="N",
                   help="cell-bootstrap draws for 95%% intervals of every number (paper: 2000; default 0: no "
                        "intervals)")
    s.add_argument("--seed", type=common.number(int, 0), default=0,
                   help="seed of the cell bootstrap: the same seed gives the same intervals (default 0)")
    s.add_argument("--json", action="store_true", help=json_help)
    s.add_argument("--plot", metavar="FILE", help="also draw the [S4] iso-sparsity frontiers of --ref and --target "
                                                  "into FILE (.png, .pdf or .svg; needs matplotlib)")
    c = add("chinchilla")
    c.add_argument("csv", help="the runs CSV (columns N, D, loss; or N, C, loss; or params, train_flops, loss)")
    c.add_argument("--drop-highest", type=common.number(int, 0), default=0, metavar="K",
                   help="drop the K highest-loss points before fitting (Epoch AI's replication: 5; default 0)")
    c.add_argument("--json", action="store_true", help="print one JSON object instead of a line of text")
    w = add("power")
    w.add_argument("csv", help="the runs CSV (columns arch, C, loss, optionally depth; or arm, compute_flops, "
                               "val_loss)")
    w.add_argument("--ref", required=True, help="reference architecture, a value of column arch (e.g. vanilla): E "
                                                "is fitted on it and shared [X7], multipliers are against it [X6]")
    w.add_argument("--protocol", choices=protocols, default=protocols[0],
                   help="how E is fitted on --ref: x = the [X] paper's fit (default), huber-log = Huber on "
                        "log-loss (the surfaces' protocol)")
    w.add_argument("--C0", type=common.number(float, 0, open_low=True), default=C0,
                   help="compute scale C0 in FLOPs of L = E + A (C/C0)^-gamma (default 1e18, [X]'s): it changes "
                        "A, not E or gamma")
    w.add_argument("--min-depth", type=common.number(float, 0, open_low=True), metavar="D",
                   help="multiplier budgets: only --ref's points with depth >= D (needs a depth column; [X]'s "
                        "figure uses 8). Default: every point of --ref")
    w.add_argument("--per-arch-E", action="store_true", help="sensitivity option: fit E per architecture instead "
                                                             "of sharing the reference's")
    w.add_argument("--json", action="store_true", help=json_help)
    w.add_argument("--plot", metavar="FILE", help="also draw loss vs compute with the fitted laws and the compute "
                                                  "multipliers side by side into FILE (needs matplotlib)")
    return p


@contextlib.contextmanager
def naming(path, what=None):
    """A ValueError raised inside (a fit refusing its data) comes out naming the file, and `what` was fitted."""
    try:
        yield
    except ValueError as e:
        raise ValueError(f"{path}: " + (f"{what}: " if what else "") + str(e)) from None


def _archs(path, names, wanted):
    """The architectures of a file in first-seen order; every name in `wanted` must be one of them."""
    archs = list(dict.fromkeys(names))
    for name in wanted:
        if name not in archs:
            raise ValueError(f"{path}: architecture '{name}' not found in column 'arch'; have {archs}")
    return archs


def json_safe(v):
    """A float for JSON: nan and inf become None (null)."""
    v = float(v)
    return v if math.isfinite(v) else None


# -----------------------------------------------------------------------------
# surface

def read_surface(path, ref, target):
    """(runs {column: array}, {arch: (F, S, D, loss)}) of a surface CSV naming both architectures."""
    runs = tables.read_runs_csv(path, SURFACE_COLUMNS, positive=["F", "D", "loss"], fraction=["S"])
    for column in ("arch", "cell"):
        tables.refuse_case_variants(path, runs[column].astype(str).tolist(), column)
    arch = runs["arch"].astype(str)
    return runs, {a: tuple(runs[k][arch == a] for k in ("F", "S", "D", "loss"))
                  for a in _archs(path, arch.tolist(), (ref, target))}


def print_surface(args, fits, gain, tpps, boot):
    """The surfaces, CE Gain [S5] and TPP at every budget x sparsity (gain, tpps[arch]: arrays of shape
    (budgets, sparsities)), with 95% intervals when `boot` (cell_bootstrap's result) is given."""
    def interval(key, i, j):  # the 95% interval of one number, (None, None) without a bootstrap
        return (json_safe(boot["lo"][key][i, j]), json_safe(boot["hi"][key][i, j])) if boot else (None, None)

    out = {"fits": {a: {k: json_safe(v) for k, v in f.to_dict().items()} for a, f in fits.items()},
           "ce_gain": [], "tpp": []}
    grid = [(i, C, j, S) for i, C in enumerate(args.budgets) for j, S in enumerate(args.sparsity)]
    for i, C, j, S in grid:
        lo, hi = interval("ce_gain", i, j)
        out["ce_gain"].append({"C": C, "S": S, "value": json_safe(gain[i, j]), "lo": lo, "hi": hi})
    for role, a in (("ref", args.ref), ("target", args.target)):
        for i, C, j, S in grid:
            lo, hi = interval(f"{role}.tpp", i, j)
            out["tpp"].append({"arch": a, "C": C, "S": S, "value": json_safe(tpps[a][i, j]), "lo": lo, "hi": hi})
    if args.json:
        print(json.dumps(out))
        return
    print(f"{'arch':>12} {'E':>8} {'A':>10} {'a':>7} {'b':>7} {'K':>10} {'c':>7} {'gamma':>7} {'rmse':>8}")
    for a, f in fits.items():
        print(f"{a:>12} {f.E:8.4f} {f.A:10.4g} {f.a:7.4f} {f.b:7.4f} {f.K:10.4g} {f.c:7.4f} {f.gamma:7.4f} "
              f"{f.rmse:8.5f}")
    print(f"\nCE Gain of {args.target} over {args.ref} [S5]"
          + (f" ({args.bootstrap} cell-bootstrap draws, 95%)" if boot else ""))
    for r in out["ce_gain"]:
        ci = f"  [{r['lo']:.3f}, {r['hi']:.3f}]" if boot else ""
        print(f"  C={r['C']:.3g} S={r['S']:.3g}: {r['value']:.4f}{ci}")
    print("\nTPP = D*/(F*/6)")
    for r in out["tpp"]:
        ci = f"  [{r['lo']:.1f}, {r['hi']:.1f}]" if boot else ""
        print(f"  {r['arch']:>12} C={r['C']:.3g} S={r['S']:.3g}: {r['value']:.1f}{ci}")


# -----------------------------------------------------------------------------
# chinchilla

def read_chinchilla(path, drop_highest):
    """(N, D, loss) of a Chinchilla CSV without its drop_highest highest-loss points."""
    runs = tables.read_chinchilla_csv(path)
    N, D, loss = runs["N"], runs["D"], runs["loss"]
    if drop_highest >= len(loss):
        raise ValueError(f"{path}: --drop-highest {drop_highest} leaves no points (the file has {len(loss)})")
    keep = np.argsort(loss)[: len(loss) - drop_highest]
    return N[keep], D[keep], loss[keep]


def print_chinchilla(args, fit, n_points):
    if args.json:
        print(json.dumps(fit.to_dict()))
    else:
        print(f"Chinchilla Approach 3 on {n_points} points: E={fit.E:.4f} A={fit.A:.2f} B={fit.B:.2f} "
              f"alpha={fit.alpha:.4f} beta={fit.beta:.4f} (Huber objective {fit.objective:.6g}, rmse {fit.rmse:.4f})")


# -----------------------------------------------------------------------------
# power

def read_power(path, ref):
    """(rows {column: array}, {arch: (C, loss)} in file order) of a power CSV that has architecture `ref`."""
    rows = tables.read_power_csv(path)
    arch = rows["arch"].astype(str)
    tables.refuse_case_variants(path, arch.tolist(), "arch")
    return rows, {a: (rows["C"][arch == a], rows["loss"][arch == a]) for a in _archs(path, arch.tolist(), [ref])}


def refuse_rising(path, fits):
    """Refused, not flagged: a gamma <= 0 printed with status 0 (or in --json) would read as a measured law;
    dropping the arch's rows fits the others."""
    for a, f in fits.items():
        if not f.gamma > 0:
            raise ValueError(f"{path}: {a}: loss does not fall with compute (gamma {f.gamma + 0.0:.4g} with E "
                             f"{f.E:.4g} fixed): no power law to fit; fix or drop its rows")


def reference_budgets(path, rows, ref, min_depth):
    """(C, loss) of the reference's points that are [X6] budgets: all of them, or those with depth >= min_depth."""
    budget = rows["arch"].astype(str) == ref
    if min_depth is not None:
        if "depth" not in rows:
            raise ValueError(f"{path}: --min-depth needs a column 'depth'")
        budget &= rows["depth"] >= min_depth
        if not budget.any():
            raise ValueError(f"{path}: --min-depth {min_depth:g} leaves none of {ref}'s points")
    return rows["C"][budget], rows["loss"][budget]


def print_power(args, fits, ref_C, mult):
    """The shared E [X7], each arch's (A, gamma +- se) and the multipliers [X6] at the reference's budgets."""
    out = {"protocol": args.protocol, "E": fits[args.ref].E, "C0": args.C0, "shared_E": not args.per_arch_E,
           "min_depth": args.min_depth,
           "fits": {a: {"E": f.E, "A": f.A, "gamma": f.gamma, "gamma_se": json_safe(f.gamma_se)}
                    for a, f in fits.items()},
           "multipliers": {a: [{"C": float(c), "value": json_safe(v)} for c, v in zip(ref_C, mult[a])]
                           for a in fits if a != args.ref}}
    if args.json:
        print(json.dumps(out))
        return
    how = {"x": "[X]'s free fit", "huber-log": "Huber on log-loss"}[args.protocol]
    source = f"fitted on {args.ref} ({how}) and shared" if out["shared_E"] else f"per architecture ({how})"
    print(f"[X7] E = {out['E']:.4f}, {source}; C0 = {args.C0:g}; (A, gamma +- its standard error) with E fixed")
    w = max(len(a) for a in fits)
    for a, f in fits.items():
        print(f"  {a:>{w}}: E={f.E:.4f} A={f.A:.4f} gamma={f.gamma:.5f} +- {f.gamma_se:.5f}")
    which = f"depth >= {args.min_depth:g}" if args.min_depth is not None else "every measured budget"
    print(f"[X6] compute multipliers vs {args.ref} at its budgets ({which}): interpolated, never extrapolated "
          "(nan = outside the arch's measured range)")
    for a, values in out["multipliers"].items():
        print(f"  {a:>{w}}: " + " ".join(f"{m['C']:.3g}:{m['value']:.3f}" if m["value"] is not None
                                         else f"{m['C']:.3g}:nan" for m in values))
