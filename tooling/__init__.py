"""
The operational code a learner can skip: nothing in here is an idea of either paper.

The top-level files (model.py, train.py, muon.py, grow.py, match.py, fit.py, ...) teach the papers and
import this package; this package imports only the sources of truth below it (model.py, match.py's
accounting) and never a script. Each module says in its docstring what it guards against:

    common.py       atomic file writes, one-line CLI errors, JSON lines, devices (standard library only)
    settings.py     settings of any dataclass: config files, --key=value, type and range checks, --help
    distributed.py  process groups, DDP / FSDP2 wrapping, collectives on the right device
    checkpoint.py   checkpoint files (one file, or sharded with DCP), loading a model from one
    weights.py      weights held against their config; the export folder (safetensors) read back
    export.py       python -m tooling.export: a checkpoint as safetensors + config.json + README.md
    legacy.py       checkpoints of the release before the settings were folded, read in this one's fields
    convert_checkpoint.py  older checkpoint formats converted into the current one
    rundir.py       the run folder: its lock, stale temp files, log.jsonl, interrupts
    memory.py       the memory planner (what fits on which GPU) and the memory check before a run
    match_cli.py    match.py's command line: a model from a config file, an [S] preset or a recipe; tables
    guards.py       refusals a run makes before it trains (passes, data budget)
    tables.py       reading and writing runs CSV files with errors naming file and line
    fit_cli.py      fit.py's command line: parser, reading each runs CSV, the tables and JSON it prints
    core_bundle.py  reading and validating a DCLM CORE eval bundle (core.yaml, eval_data/, baselines)
    core_report.py  eval_core.py's command line: its parser and the tables it prints
    plots.py        figures (matplotlib optional)
    jobs.py         worker processes (one BLAS thread, Ctrl-C handled once, a pool stopped at once) and
                    the ladder's job runner: run folders, result files, resuming a ladder

Importing `tooling` imports nothing: fit.py and the data tools stay free of torch.
"""
