"""
Both papers' experiments in miniature, end to end: grid -> match -> train -> fit ->
report (docs/ladder.md).

    python ladder.py --list                      # every preset: its runs, FLOPs, budget
    python ladder.py --preset smelt-micro        # the whole [S] pipeline on tiny models
    python ladder.py --preset x-cpu-mini --plot  # train or continue: out/ladder-x-cpu-mini/
    python ladder.py --preset x-cpu-mini --report_only --plot  # from docs/ladder/'s CSVs

A preset (ladders/presets.py) is run by its protocol, a module of ladders/.
After Ctrl-C rerun the same command: finished runs are kept.
"""

import argparse
import math
import os
import signal
import sys

from tqdm import tqdm

import fit
import plots
from data.loader import read_meta
from ladders import decompose, khop, recipe, smelt, testtime, x
from ladders.presets import PRESETS
from ladders.runs import data_dir, load_results, train_runs, write_csv

PROTOCOLS = {"smelt": smelt, "x": x, "decompose": decompose, "recipe": recipe,
             "testtime": testtime, "khop": khop}
DOCS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "docs", "ladder")
# The README figure's ladders.
SUMMARY = ("smelt-cpu-surface", "smelt-cpu-decompose", "smelt-cpu-recipe", "x-cpu-testtime",
           "smelt-cpu-khop")


def train_tokens(folder):
    """The train split's size, or None."""
    meta = read_meta(folder)
    return meta and meta["train_tokens"]


def read_sweep(prefix):
    path = prefix + "lr_sweep.csv"
    return fit.read_runs(path) if os.path.exists(path) else None


def resolve(preset, train, tokens=None):
    """Plan and train until nothing is missing."""
    # A plan depends on the results so far:
    # a sweep brackets.
    results = {}
    while True:
        specs, sweep = PROTOCOLS[preset["kind"]].plan(preset, results, tokens)
        # A sweep's run may be a ladder run too.
        specs = list({s.run_id: s for s in specs}.values())
        # A branch waits for its stable run.
        todo = [s for s in specs
                if s.run_id not in results and (not s.needs or s.needs[0] in results)]
        if not todo:
            return specs, sweep, results
        results.update(train(todo))


def run(preset, out, train_fn=None, workers=None, plot=False):
    """Train (or continue) a preset in OUT, then its CSVs and report."""
    import train
    protocol = PROTOCOLS[preset["kind"]]
    # A task with its own train draws its own data.
    data = "" if hasattr(protocol, "train") else data_dir(preset)
    bar = tqdm(total=0, unit="run", desc=preset["name"], disable=None)

    def train_or_load(todo):
        done = load_results(out, todo)
        bar.total += len(todo)
        bar.update(len(done))
        rest = [s for s in todo if s.run_id not in done]
        fn = train_fn or getattr(protocol, "train", train.train)
        return done | train_runs(rest, out, fn, data, workers or preset["workers"], bar)
    specs, sweep, results = resolve(preset, train_or_load, train_tokens(data))
    bar.close()
    # A task's score, from each run's checkpoint.
    if hasattr(protocol, "evaluate"):
        results = protocol.evaluate(preset, specs, results, out)
    # The CSVs, then the report from them.
    write_csv(os.path.join(out, "runs.csv"), protocol.rows(specs, results))
    if sweep:
        write_csv(os.path.join(out, "lr_sweep.csv"), sweep)
    return report(preset, os.path.join(out, ""), plot, out)


def report(preset, prefix, plot=False, out=None):
    """PREFIX report.txt from PREFIX runs.csv and lr_sweep.csv -> its text."""
    protocol = PROTOCOLS[preset["kind"]]
    rows = fit.read_runs(prefix + "runs.csv")
    text = "\n".join(protocol.report(preset, rows, read_sweep(prefix))) + "\n"
    with open(prefix + "report.txt", "w") as f:
        f.write(text)
    written = []
    if plot and hasattr(protocol, "figures"):
        written = protocol.figures(preset, rows, lambda name: prefix + name, out)
    print(text + "".join(f"wrote {p}\n" for p in [prefix + "report.txt"] + written), end="")
    return text


def summary(plot=False):
    """Every SUMMARY ladder's contrasts, from its committed CSVs."""
    panels = {"loss (nats), + where it pays": [], "k-hop error, + where it pays": []}
    # The k-hop rows go on their own panel.
    for name in SUMMARY:
        preset, prefix = dict(PRESETS[name], name=name), os.path.join(DOCS, name + "-")
        protocol = PROTOCOLS[preset["kind"]]
        rows = protocol.summary(preset, fit.read_runs(prefix + "runs.csv"), read_sweep(prefix))
        panels[list(panels)[preset["kind"] == "khop"]] += rows
    lines = [f"{label}: {v:+.4f} [{lo:+.4f}, {hi:+.4f}]"
             for rows in panels.values() for label, v, lo, hi in rows]
    title = "the ladders: where looping pays (95% intervals; green above 0, red below)"
    path = os.path.join(DOCS, "summary.png")
    if plot and plots.plot_contrasts(list(panels.items()), path, title):
        lines.append(f"wrote {path}")
    return lines


def listing():
    """Every preset's plan, the grid's middle LR taken as best."""
    lines = []
    for name, p in PRESETS.items():
        values = p.get("lr", {}).get("values", [1.0])
        lr = values[len(values) // 2]

        # A loss lowest at the middle value.
        def fake(specs):
            return {s.run_id: dict(val_loss=abs(math.log(s.meta["grid_lr"] / lr))) for s in specs}
        preset = dict(p, name=name)
        # A task draws its own sequences.
        own = hasattr(PROTOCOLS[p["kind"]], "train")
        prepared = None if p["train"].get("data_dir") or own else train_tokens(data_dir(preset))
        # The FLOPs of every run the plan holds.
        specs, _, _ = resolve(preset, fake, prepared)
        t = p["train"]
        step = (t.get("global_batch") or t["batch_size"]) * p["model"]["block_size"]
        flops = sum(s.meta["F"] * (s.settings["decay_tokens"] if s.needs
                                   else s.settings["max_steps"] * step) for s in specs)
        budget = f" ({p['budget']})" if p.get("budget") else ""
        lines.append(f"{name:>18}  {len(specs)} runs, {flops:.2e} FLOPs{budget}: {p['about']}")
    return "\n".join(lines)


def main(argv=None):
    description, epilog = __doc__.strip().split("\n\n", 1)
    parser = argparse.ArgumentParser(prog="ladder.py", usage=argparse.SUPPRESS,
                                     description=description, epilog=epilog,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--list", action="store_true", help="list the presets with their size")
    add("--summary", action="store_true",
        help="the contrasts of the committed ladders (with --plot: docs/ladder/summary.png)")
    add("--preset", choices=PRESETS, metavar="NAME", help=f"one of {', '.join(PRESETS)}")
    add("--out", help="the ladder's folder (default out/ladder-NAME); with --report_only the "
                      "folder holding its runs.csv (default: docs/ladder/NAME-runs.csv)")
    add("--workers", type=int, help="runs trained at once (default: the preset's)")
    add("--plot", action="store_true", help="the figures too (needs matplotlib)")
    add("--report_only", action="store_true", help="train nothing: the report from the CSVs")
    args = parser.parse_args(argv)
    if args.list or args.summary:
        print(listing() if args.list else "\n".join(summary(args.plot)))
        return 0
    if not args.preset:
        parser.error("give --preset NAME (or --list)")
    preset = dict(PRESETS[args.preset], name=args.preset)
    # A scheduler's SIGTERM acts as Ctrl-C.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        if args.report_only:
            prefix = os.path.join(args.out or DOCS, "" if args.out else args.preset + "-")
            report(preset, prefix, args.plot)
        else:
            out = args.out or os.path.join("out", f"ladder-{args.preset}")
            run(preset, out, None, args.workers, args.plot)
    # A missing file, or other settings.
    except (ValueError, OSError) as e:
        parser.error(str(e))
    except KeyboardInterrupt:
        print("\nladder.py: interrupted: rerun the same command to continue (finished runs are "
              "kept)", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
