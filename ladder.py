"""
Both papers' experiments in miniature, end to end: grid -> match -> LR sweep -> train -> fit -> report.

    python ladder.py --list [--json]                 # every preset: its runs, tokens, FLOPs, TPP, epochs
    python ladder.py --preset smelt-cpu-mini [--out out/ladder-smelt-cpu-mini] [--plot]
    python ladder.py --preset x-cpu-mini [--plot]
    python ladder.py --preset smelt-micro            # seconds: the whole pipeline, numbers meaningless
    python ladder.py --preset x-cpu-mini --fit-only --plot   # refit / re-report / re-plot finished runs
    python ladder.py --preset x-cpu-mini --from-csv docs/ladder/x-cpu-mini-runs.csv --plot   # from runs.csv alone
    python ladder.py --plan config/smelt_200m_s95.py [--gpus 8] [--json]   # a config's recipe: runs, tokens, FLOPs
    # GPU presets (documented, not run here); every rank runs the same ladder, rank 0 writes results
    torchrun --standalone --nproc_per_node=8 ladder.py --preset x-gpu-1node

The command line of the ladders/ package: the presets (ladders/presets.py), one file per protocol
(ladders/smelt.py [S], ladders/x.py [X], ladders/repeat.py [X] data-constrained and its repeat_report.py), the LR sweep
(ladders/sweep.py), a preset end to end (ladders/pipeline.py) and the --plan planner (ladders/recipe.py);
the job runner is tooling/jobs.py. The designs, protocols and their reports: docs/ladder.md.
"""

import argparse
import json
import signal
import sys

from ladders import pipeline, presets, recipe, specs
from tooling import common, distributed, rundir
from tooling.checkpoint import NonFiniteLoss
from tooling.common import cli_error

# what each mode reads of the command line: a flag it would ignore is refused, not dropped in silence
MODE_FLAGS = {"list": {"json"}, "plan": {"json", "gpus"}, "from_csv": {"preset", "bootstrap", "plot", "no_progress"},
              "train": {"preset", "out", "bootstrap", "fit_only", "keep_checkpoints", "plot", "no_progress", "workers",
                        "threads"}}
INTERRUPTED = "rerun the same ladder.py command to continue (finished runs are kept)"


def main(argv=None):
    description, epilog = __doc__.split("\n\n", 1)  # the first paragraph once, above the flags; the rest below
    p = common.parser("ladder.py", description=description, allow_abbrev=False,
                      formatter_class=argparse.RawDescriptionHelpFormatter, epilog=epilog)
    p.add_argument("--preset", help=f"one of {', '.join(presets.PRESETS)}")
    p.add_argument("--out", help="output folder (default out/ladder-<preset>)")
    p.add_argument("--bootstrap", type=common.number(int, 0), help="bootstrap draws, >= 0 (SMELT cell bootstrap; "
                                                                  "preset default)")
    p.add_argument("--fit-only", action="store_true", help="train nothing; fit and report the finished runs")
    p.add_argument("--from-csv", metavar="RUNS.csv",
                   help="train nothing, read no run folders: rebuild the report (and with --plot the figures "
                        "that do not need the runs' logs) from a finished ladder's runs.csv and the lr_sweep.csv "
                        "beside it, written beside it with its prefix (e.g. docs/ladder/x-cpu-mini-runs.csv -> "
                        "docs/ladder/x-cpu-mini-report.txt)")
    p.add_argument("--keep-checkpoints", action="store_true", help="keep the decay branches' final ckpt.pt")
    p.add_argument("--plot", action="store_true", help="write the preset's figures into OUT (needs matplotlib: "
                                                       "pip install -r requirements-plot.txt)")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bars")
    p.add_argument("--workers", type=common.number(int, 1),
                   help="runs trained at once in separate processes, >= 1 (preset default)")
    p.add_argument("--threads", type=common.number(int, 1),
                   help="torch CPU threads per run, >= 1 (preset default; CPU presets use 1)")
    p.add_argument("--list", action="store_true", help="list the presets with their size")
    p.add_argument("--plan", metavar="CONFIG", help="print every run of a config file's recipe (config/*.py): its "
                                                    "train.py commands, steps, tokens and FLOPs, and the train tokens "
                                                    "the data must hold; trains nothing")
    p.add_argument("--gpus", type=common.number(int, 1), help="with --plan: processes the commands start (default 8, "
                                                             "one node; 1: python train.py)")
    p.add_argument("--json", action="store_true", help="with --list: every run's budget as JSON; with --plan: the "
                                                       "plan as JSON")
    args = p.parse_args(argv)
    given = {k for k, v in vars(args).items() if v is not None and v is not False}  # (--bootstrap 0 is given)
    mode = next((m for m in ("list", "plan", "from_csv") if m in given), "train")
    ignored = sorted(given - {mode} - MODE_FLAGS[mode])
    if ignored:
        flag = lambda k: "--" + k.replace("_", "-")  # noqa: E731
        p.error(f"{flag(ignored[0])}: not used {f'with {flag(mode)}' if mode != 'train' else 'when training a ladder'}")
    try:
        with rundir.sigterm_as_interrupt():  # SIGTERM (a scheduler) ends the ladder like Ctrl-C, workers included
            run(args)
    except (ValueError, OSError, NonFiniteLoss) as e:
        return cli_error("ladder.py", e)
    except KeyboardInterrupt as e:  # Ctrl-C, SIGTERM, train.py's TrainingInterrupted (its advice is for one run)
        sigterm = isinstance(e, rundir.Terminated) or getattr(e, "exit_status", 130) == 128 + signal.SIGTERM
        print(f"{'' if args.no_progress else chr(10)}ladder.py: {'terminated' if sigterm else 'interrupted'}: "
              f"{INTERRUPTED}", file=sys.stderr)  # (a newline first: off a tqdm bar)
        return 128 + (signal.SIGTERM if sigterm else signal.SIGINT)  # 143 / 130, as shells report them
    finally:
        distributed.teardown()
    return 0


def run(args):
    """The mode the command line chose (main has checked its flags)."""
    if args.list:
        print(specs.describe_presets(as_json=args.json))
    elif args.plan:
        plan = recipe.recipe_plan(args.plan, gpus=args.gpus or 8)
        print(json.dumps(plan) if args.json else recipe.plan_text(plan))
    elif not args.preset:
        raise ValueError("give --preset (or --list, or --plan CONFIG)")
    elif args.from_csv:
        pipeline.rereport(args.preset, args.from_csv, bootstrap=args.bootstrap, plot=args.plot,
                          progress=not args.no_progress)
    else:
        pipeline.ladder(args.preset, out_dir=args.out, bootstrap=args.bootstrap, progress=not args.no_progress,
                        fit_only=args.fit_only, keep_checkpoints=args.keep_checkpoints, plot=args.plot,
                        threads=args.threads, workers=args.workers)


if __name__ == "__main__":
    sys.exit(main())
