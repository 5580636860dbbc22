"""A preset end to end (ladder: LR sweep, ladder, report, figures; rereport: the report rebuilt from a runs.csv
alone). Training goes through tooling.jobs.run_ladder; finished runs are never retrained."""

import glob
import os

import train
from ladders.common import REPO, data_plan
from ladders.presets import get_preset
from ladders.repeat import imported_results, repeat_rows, repeat_seed_specs, repeat_tuned
from ladders.repeat_report import repeat_plots, repeat_report
from ladders.smelt import match_table, smelt_cells, smelt_plots, smelt_report, smelt_rows
from ladders.specs import build, full_plan
from ladders.sweep import (best_lrs, bracketed_sweep, lrs_record, sweep_from_rows, sweep_lines, sweep_rows,
                           sweep_table)
from ladders.x import x_plots, x_report, x_rows
from tooling import distributed, jobs, plots, tables
from tooling.common import write_atomic



def check_fit_only(preset_name, out_dir, plot):
    """--fit-only refits finished runs: without any, one line naming the committed runs.csv to rebuild from."""
    if any(os.path.exists(os.path.join(d, "result.json"))
           for d in glob.glob(os.path.join(glob.escape(out_dir), "runs", "*"))):
        return
    committed = os.path.join(REPO, "docs", "ladder", f"{preset_name}-runs.csv")
    csvs = [c for c in (os.path.relpath(committed), os.path.join(out_dir, "runs.csv")) if os.path.exists(c)]
    raise ValueError(f"--fit-only: {out_dir} holds no finished runs (runs/*/result.json) to refit; "
                     + (f"rebuild the report from a runs.csv instead: python ladder.py --preset {preset_name} "
                        f"--from-csv {csvs[0]}{' --plot' if plot else ''}" if csvs else
                        "train them first (the same command without --fit-only)"))


def ladder(preset_name, out_dir=None, bootstrap=None, train_fn=None, progress=True, fit_only=False,
           keep_checkpoints=False, plot=False, log=print, workers=None, **overrides):
    """Run (or continue) a preset end to end; returns the report dict (also OUT/report.json)."""
    preset = get_preset(preset_name, **overrides)
    out_dir = out_dir or os.path.join("out", f"ladder-{preset_name}")
    if fit_only:
        check_fit_only(preset_name, out_dir, plot)
    if "RANK" in os.environ:  # under torchrun: join the process group now, so only rank 0 writes
        distributed.setup(preset.train.get("device", "auto"))
        if distributed.rank() != 0:
            log = lambda *a, **k: None  # noqa: E731
    data = data_plan(preset)
    workers = workers or (preset.workers if "RANK" not in os.environ else 1)
    plan, cells = full_plan(preset, data)
    log(f"preset {preset_name}: {preset.about}")
    log(f"  {len(plan)} runs, output {out_dir}, data {data.data_dir or 'the embedded corpus'}")
    if cells:
        log("\n".join(match_table(cells)[0]))
    run = lambda specs: (  # noqa: E731
        {s.run_id: jobs.load_result(out_dir, s, train.DEFAULTS) for s in specs} if fit_only else
        jobs.run_ladder(specs, out_dir, train_fn or train.train, train.DEFAULTS, progress=progress, log=log,
                        keep_checkpoints=keep_checkpoints, workers=1 if train_fn else workers, threads=preset.threads,
                        data_dir=data.data_dir))  # a given train_fn (tests) trains in this process
    results, sweep_specs = bracketed_sweep(preset, data, run)
    lrs = best_lrs(preset, results, sweep_specs) if preset.lr_sweep else {}
    sweep = None
    if lrs is None:
        log("the LR sweep is not finished: rerun without --fit-only to train it")
        lrs = {}
        specs = sweep_specs
    else:
        specs, _ = build(preset, data, lrs)
        if preset.kind == "repeat" and preset.builds_on:  # a finished ladder's runs: not trained again
            for run_id, result in imported_results(preset, data).items():
                results[run_id] = results.get(run_id) or result
        results.update(run([s for s in specs if s.run_id not in results or results[s.run_id] is None]))
        if preset.kind == "repeat":  # the weight-decay extensions (and searches), then the extra seeds at each best
            while True:
                specs, complete = repeat_tuned(preset, data, lrs, results)
                todo = [s for s in specs if results.get(s.run_id) is None]
                if complete or not todo:
                    break
                results.update(run(todo))
                if any(results.get(s.run_id) is None for s in todo):  # --fit-only: not trained
                    break
            seeds = repeat_seed_specs(preset, data, lrs, results) or []
            results.update(run([s for s in seeds if results.get(s.run_id) is None]))
            specs += seeds
        if preset.lr_sweep:
            sweep = sweep_table(preset, results, sweep_specs, lrs)
    if distributed.rank() != 0:
        return None
    finished = [results[s.run_id] for s in specs if results.get(s.run_id)]
    if preset.kind == "smelt":
        rows = smelt_rows(finished)
    elif preset.kind == "repeat":
        rows = repeat_rows(finished, {s.run_id: s.role for s in specs})
    else:
        rows = x_rows([r for r in finished if r["role"] in ("run", "sweep")])
    text, report, figures = report_from_rows(preset, rows, cells, sweep, lrs, bootstrap, progress)
    report.update(runs_finished=len(finished), runs_total=len(specs), lrs=lrs_record(lrs),
                  train_seconds=sum(r.get("seconds") or 0.0 for r in finished))
    if len(finished) < len(specs):
        text += f"\n(partial: {len(finished)}/{len(specs)} runs finished)"
    tables.write_rows_csv(os.path.join(out_dir, "runs.csv"), rows)
    if sweep:  # runs.csv holds the runs carried up the ladder; this, every sweep value (for --from-csv)
        tables.write_rows_csv(os.path.join(out_dir, "lr_sweep.csv"),
                              sweep_rows(preset.lr_sweep.key, sweep[1], lrs))
    jobs.write_json_atomic(os.path.join(out_dir, "report.json"), report)
    write_atomic(os.path.abspath(os.path.join(out_dir, "report.txt")), lambda f: f.write((text + "\n").encode()))
    log(text)
    if plot and figures:
        report["plots"] = make_plots(preset, out_dir, figures, specs, results)
        for path in report["plots"]:
            log(f"wrote {path}")
    log(f"wrote {os.path.join(out_dir, 'runs.csv')}, report.txt, report.json "
        f"({report['train_seconds']:.0f} s of training in the finished runs)")
    return report


def report_from_rows(preset, rows, cells, sweep, lrs, bootstrap=None, progress=True):
    """The report of a preset's finished runs (rows as runs.csv holds them) -> (text, dict, figure data)."""
    n_boot = preset.bootstrap if bootstrap is None else bootstrap
    if preset.kind == "smelt":
        return smelt_report(preset, cells, rows, n_boot, seed=preset.seed, progress=progress, sweep=sweep)
    if preset.kind == "repeat":
        return repeat_report(preset, rows, sweep, n_boot=n_boot, seed=preset.seed)
    return x_report(preset, rows, sweep, n_boot=min(n_boot or 400, 400), lrs=lrs)


def rereport(preset_name, runs_csv, bootstrap=None, plot=False, log=print, progress=True, **overrides):
    """`ladder.py --from-csv`: the report (and with plot the figures) of a finished ladder rebuilt from its
    runs.csv alone, without its run folders, e.g. the committed docs/ladder/x-cpu-mini-runs.csv. The LR
    sweep table comes from the lr_sweep.csv beside it when there is one. Outputs are written beside the
    CSV with its prefix: docs/ladder/x-cpu-mini-runs.csv -> docs/ladder/x-cpu-mini-report.txt (and
    x-cpu-mini-<figure>.png). The figures that need the runs' logs (decay branches) are not drawn."""
    preset = get_preset(preset_name, **overrides)
    folder, name = os.path.split(runs_csv)
    if not name.endswith("runs.csv"):
        raise ValueError(f"--from-csv {runs_csv}: expected a file named runs.csv or NAME-runs.csv (the report is "
                         "written beside it, named alike)")
    prefix = name[: -len("runs.csv")]
    rows = tables.read_rows_csv(runs_csv, unique=["run_id"])  # a run twice would be fitted twice
    sweep_csv = os.path.join(folder, prefix + "lr_sweep.csv")
    sweep, lrs = None, {}
    if os.path.exists(sweep_csv):
        key, losses, lrs = sweep_from_rows(tables.read_rows_csv(  # depth / scale: a sweep at every depth / scale
            sweep_csv, unique=["arch", "depth", "scale", "key", "value"]))
        sweep = sweep_lines(key, losses, lrs)
    else:
        log(f"no {sweep_csv}: the report has no LR sweep table")
    cells = smelt_cells(preset) if preset.kind == "smelt" else None
    try:
        text, report, figures = report_from_rows(preset, rows, cells, sweep, lrs, bootstrap, progress)
    except KeyError as e:
        raise ValueError(f"{runs_csv}: no column {e} (is it the runs.csv of a {preset.kind} ladder?)") from None
    report_path = os.path.join(folder, prefix + "report.txt")
    write_atomic(os.path.abspath(report_path), lambda f: f.write((text + "\n").encode()))
    log(text)
    written = make_plots(preset, folder, figures, [], {}, prefix=prefix) if plot and figures else []
    for path in written:
        log(f"wrote {path}")
    log(f"wrote {report_path}")
    return report


def make_plots(preset, out_dir, figures, specs, results, prefix=""):
    """The preset's figures as PNGs in out_dir, each named prefix + its name (tooling/plots.py draws
    them); one line and nothing written when matplotlib is missing."""
    if plots.pyplot(out_dir) is None:
        return []

    def path(name):
        return os.path.join(out_dir, prefix + name)
    if preset.kind == "repeat":
        return repeat_plots(preset, figures, path)
    if preset.kind == "x":
        return x_plots(preset, figures, path)
    return smelt_plots(preset, figures, path, specs, results)
