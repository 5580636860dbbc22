"""ladder.py's package: both papers' experiments in miniature (docs/ladder.md). Importing it imports nothing.

    presets.py   the presets, typed (SmeltPreset, XPreset, RepeatPreset)
    common.py    what every protocol uses: data, tokens per step, N, report numbers
    smelt.py     [S] SMELT grid: matched cells, stable runs and decay branches, surfaces, CE Gain
    x.py         [X] ladders: six architectures by depth, power laws, compute multipliers
    repeat.py    [X] data-constrained ladder: K passes x depth x weight decay (x LR) on repeated data
    repeat_report.py  its report: the best K per budget, the weight decay and LR optima, the claims
    stats.py     the ladders' own statistics (grid optimum, seed spread, "within noise"); the fits: fit.py
    specs.py     every run of a preset (build, full_plan) and --list
    sweep.py     the LR sweep and its bracketing
    pipeline.py  a preset end to end, and its report rebuilt from runs.csv (--from-csv)
    recipe.py    --plan CONFIG: every run of a config file's recipe
"""
