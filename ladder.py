"""
Both papers' experiments in miniature, end to end: grid -> match -> train -> fit -> report (docs/ladder.md).

    python ladder.py --list                          # every preset: its runs, FLOPs, budget
    python ladder.py --preset smelt-micro            # the whole [S] pipeline on tiny models, minutes
    python ladder.py --preset x-cpu-mini --plot      # train (or continue): out/ladder-x-cpu-mini/report.txt
    python ladder.py --preset x-cpu-mini --report_only --plot   # docs/ladder/x-cpu-mini-report.txt from CSVs

A preset (ladders/presets.py) is run by its protocol: ladders/smelt.py [S], ladders/x.py [X],
ladders/decompose.py SMELT's deficit in arms, ladders/recipe.py why the loop pays in [X] and not in [S],
ladders/testtime.py [X]'s test-time passes, ladders/khop.py a depth task.
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

PROTOCOLS = {"smelt": smelt, "x": x, "decompose": decompose, "recipe": recipe, "testtime": testtime,
             "khop": khop}
DOCS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "docs", "ladder")
# the README's figure: where looping pays and where it does not, across the committed ladders
SUMMARY = ("smelt-cpu-surface", "smelt-cpu-decompose", "smelt-cpu-recipe", "x-cpu-testtime", "smelt-cpu-khop")


def train_tokens(folder):
    """The train split's size of a prepared folder, or None (not prepared here)."""
    meta = read_meta(folder)
    return meta and meta["train_tokens"]


def resolve(preset, train, tokens=None):
    """Plan, train what the plan needs now, plan again, until nothing is missing: a protocol's plan is a
    function of the results so far (a sweep's bracketing, a search's next step). train(specs) -> their
    results -> (specs, lr_sweep.csv's rows, results)."""
    results = {}
    while True:
        specs, sweep = PROTOCOLS[preset["kind"]].plan(preset, results, tokens)
        specs = list({s.run_id: s for s in specs}.values())  # a sweep's run may be a ladder run too
        todo = [s for s in specs if s.run_id not in results and (not s.needs or s.needs[0] in results)]
        if not todo:
            return specs, sweep, results
        results.update(train(todo))


def run(preset, out, train_fn=None, workers=None, plot=False):
    """Train (or continue) a preset in OUT, then OUT/runs.csv, lr_sweep.csv, report.txt (and figures)."""
    import train
    protocol = PROTOCOLS[preset["kind"]]
    data = "" if hasattr(protocol, "train") else data_dir(preset)  # a task draws its own sequences
    bar = tqdm(total=0, unit="run", desc=preset["name"], disable=None)

    def train_or_load(todo):
        done = load_results(out, todo)
        bar.total += len(todo)
        bar.update(len(done))
        rest = [s for s in todo if s.run_id not in done]
        fn = train_fn or getattr(protocol, "train", train.train)  # a task's own loop, or train.py's
        return done | train_runs(rest, out, fn, data, workers or preset["workers"], bar)
    specs, sweep, results = resolve(preset, train_or_load, train_tokens(data))
    bar.close()
    if hasattr(protocol, "evaluate"):  # a task's score, from each run's checkpoint
        results = protocol.evaluate(preset, specs, results, out)
    write_csv(os.path.join(out, "runs.csv"), protocol.rows(specs, results))
    if sweep:
        write_csv(os.path.join(out, "lr_sweep.csv"), sweep)
    return report(preset, os.path.join(out, ""), plot, out)


def report(preset, prefix, plot=False, out=None):
    """PREFIX report.txt (with plot the figures) from PREFIX runs.csv and lr_sweep.csv -> its text."""
    protocol = PROTOCOLS[preset["kind"]]
    rows = fit.read_runs(prefix + "runs.csv")
    sweep = fit.read_runs(prefix + "lr_sweep.csv") if os.path.exists(prefix + "lr_sweep.csv") else None
    text = "\n".join(protocol.report(preset, rows, sweep)) + "\n"
    with open(prefix + "report.txt", "w") as f:
        f.write(text)
    written = protocol.figures(preset, rows, lambda name: prefix + name, out) \
        if plot and hasattr(protocol, "figures") else []
    print(text + "".join(f"wrote {p}\n" for p in [prefix + "report.txt"] + written), end="")
    return text


def summary(plot=False):
    """Every SUMMARY ladder's contrasts from its committed CSVs (+ where the loop, depth or passes pay, 95%
    intervals): printed, and with plot docs/ladder/summary.png -> the lines."""
    panels = {"loss (nats), + where it pays": [], "k-hop error, + where it pays": []}
    for name in SUMMARY:
        preset, prefix = dict(PRESETS[name], name=name), os.path.join(DOCS, name + "-")
        sweep = fit.read_runs(prefix + "lr_sweep.csv") if os.path.exists(prefix + "lr_sweep.csv") else None
        rows = PROTOCOLS[preset["kind"]].summary(preset, fit.read_runs(prefix + "runs.csv"), sweep)
        panels[list(panels)[preset["kind"] == "khop"]] += rows
    lines = [f"{label}: {v:+.4f} [{lo:+.4f}, {hi:+.4f}]"
             for rows in panels.values() for label, v, lo, hi in rows]
    title = "the ladders: where looping pays (95% intervals; green above 0, red below)"
    if plot and plots.plot_contrasts(list(panels.items()), os.path.join(DOCS, "summary.png"), title):
        lines.append(f"wrote {os.path.join(DOCS, 'summary.png')}")
    return lines


def listing():
    """Every preset's plan, the grid's middle LR taken as best (so no bracketing run)."""
    lines = []
    for name, p in PRESETS.items():
        values = p.get("lr", {}).get("values", [1.0])
        lr = values[len(values) // 2]

        def fake(specs):  # a loss lowest at the middle value
            return {s.run_id: dict(val_loss=abs(math.log(s.meta["grid_lr"] / lr))) for s in specs}
        preset = dict(p, name=name)
        own = hasattr(PROTOCOLS[p["kind"]], "train")  # a task that draws its own sequences
        prepared = None if p["train"].get("data_dir") or own else train_tokens(data_dir(preset))
        specs, _, _ = resolve(preset, fake, prepared)
        step = (p["train"].get("global_batch") or p["train"]["batch_size"]) * p["model"]["block_size"]
        tokens = [(s, s.settings["decay_tokens"] if s.needs else s.settings["max_steps"] * step)
                  for s in specs]
        lines.append(f"{name:>18}  {len(specs)} runs, {sum(s.meta['F'] * t for s, t in tokens):.2e} FLOPs"
                     + (f" ({p['budget']})" if p.get("budget") else "") + f": {p['about']}")
    return "\n".join(lines)


def main(argv=None):
    description, epilog = __doc__.strip().split("\n\n", 1)
    parser = argparse.ArgumentParser(prog="ladder.py", usage=argparse.SUPPRESS, description=description,
                                     epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--list", action="store_true", help="list the presets with their size")
    parser.add_argument("--summary", action="store_true", help="the contrasts of the committed ladders (with "
                                                               "--plot: docs/ladder/summary.png)")
    parser.add_argument("--preset", choices=PRESETS, metavar="NAME", help=f"one of {', '.join(PRESETS)}")
    parser.add_argument("--out", help="the ladder's folder (default out/ladder-NAME); with --report_only the "
                                      "folder holding its runs.csv (default: docs/ladder/NAME-runs.csv)")
    parser.add_argument("--workers", type=int, help="runs trained at once (default: the preset's)")
    parser.add_argument("--plot", action="store_true", help="the figures too (needs matplotlib)")
    parser.add_argument("--report_only", action="store_true", help="train nothing: the report from the CSVs")
    args = parser.parse_args(argv)
    if args.list or args.summary:
        print(listing() if args.list else "\n".join(summary(args.plot)))
        return 0
    if not args.preset:
        parser.error("give --preset NAME (or --list)")
    preset = dict(PRESETS[args.preset], name=args.preset)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a scheduler's SIGTERM: as Ctrl-C
    try:
        if args.report_only:
            prefix = os.path.join(args.out, "") if args.out else os.path.join(DOCS, args.preset + "-")
            report(preset, prefix, args.plot)
        else:
            out = args.out or os.path.join("out", f"ladder-{args.preset}")
            run(preset, out, None, args.workers, args.plot)
    except (ValueError, OSError) as e:  # a missing file, a run trained with other settings
        parser.error(str(e))
    except KeyboardInterrupt:
        print("\nladder.py: interrupted: rerun the same command to continue (finished runs are kept)",
              file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
