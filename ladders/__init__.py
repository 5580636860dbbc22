"""ladder.py's parts: presets.py (the designs, as data), runs.py (training and resuming the runs, the
bracketing search), sweep.py (the LR sweep), stats.py (the statistics), and one file per protocol:
smelt.py [S], x.py [X], repeat.py [X] data-constrained."""
