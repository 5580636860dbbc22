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

The first cpu-mini designs (x-cpu-mini-v1, smelt-cpu-mini-v1; their runs are in docs/ladder/*-v1-*), fixed
before their runs: every run at TPP >= 10 per compute-active non-embedding parameter (N = the block matmul
parameters one token passes through, every loop visit counted, active experts only: [X10]'s N_c without
the lm head), the same at every point; byte-level tokens (gpt2-257, like nanoGPT's shakespeare_char); the
hidden matrices' LR swept at the smallest point (3 values, 2x apart) and carried up unchanged; a sweep
brackets its optimum (while the best is at an edge, the next value beyond it runs too, at most `extend`
(2) times; the micro presets: 0); growth at the step [X15] gives, never on the WSD decay start; the
reference with 3 seeds at every point; data read up to 4 times. Read against their results they could not
answer their questions (one TPP for all, LRs not transferred, repetition, one seed off the reference; a
4-layer SMELT grid whose F spans 2.3x), so the current designs, fixed before their runs:
  * x-cpu-mini: each architecture with its own [X] recipe (config/x_d8_*.py: init, residual and output
    multipliers, betas, warm-down, weight decay, Muon "x"; its step counts as fractions of the run), its
    [X] TPP per stored parameter (Table 9, the [X] code's ladder scripts: Vanilla 5.05, Operator-1 /
    Loop-2 / Untied-2 6.06, Loop-Grow 6.6, Untied-Grow 7.24), its global LR (matrix LR; embedding and
    lm head at the recipe's ratios) from a sweep at d3 with 2 seeds per value (mean-best), carried up by
    [X16] with its own beta (Vanilla -0.8, Loop-Grow -0.5, the others -0.6); width 8 x depth at depths
    3..6, so that the largest run (Untied-Grow d6, 1.78M tokens) reads under one epoch of the embedded
    corpus's 2.09M train tokens (branch_data_fraction 0: no branches here): no repetition anywhere; 3 seeds
    for every architecture at every depth; multipliers by interpolation only. Budget: 96 runs, 6.3e13
    FLOPs, about 30 min on 2 workers (at most 60).
  * smelt-cpu-mini: 3 scales varying depth and width, L2w32 / L4w56 / L8w72 (F spans 10.3x; the top scale's
    heads grow with its width, 9 query on 3 KV heads, so the twin matches the KV cache with 2) x 3
    sparsities (16 / 32 / 48 experts, top-2): 9 cells ([S]: 4 x 3); block 64 so that attention does not
    dominate F at the smallest width; branches at TPP 3 / 6 / 12 (the affordable range; every branch's
    decay on held-back data read once, the stable phase up to 1.66 epochs); baseline and SMELT LRs each
    from their own sweep at the first cell; 2 baseline seeds (the noise) and the twin's first; the cell
    bootstrap as [S]. Budget: 114 runs, 6.6e13 FLOPs, about 55 min on 2 workers (at most 90).

[S] SMELT protocol (kind "smelt"): every (scale, sparsity) cell has a MoE baseline; match.match() gives
its SMELT twin with the same per-token training FLOPs, non-embedding params and KV cache ([S] Table 10
ratios are printed). A cell trains the baseline (every seed) and the twin (first seed) with a WSD
stable phase that saves a checkpoint at each branch point, and from each one a decay branch (cosine to
0 on the held-back tail of the train split the stable phase never reads) gives one point (F, S, D,
loss) of the [S2] surface L(F, S, D). Branch points are budgets in TPP of the baseline (the twin has
the same F, so the same D costs both the same compute). fit.py fits one surface per architecture; CE
Gain [S5] with cell-bootstrap intervals and TPP = D*/(F*/6) are reported at budgets inside the measured
range, with the per-pair win counts.

[X] protocol (kind "x"): ladders of Vanilla (plain), Operator-1 (prelude-core-coda, K = 1, boundary
operator), Loop-2 (tied core, K = 2), Untied-2 (K = 2 independent cores), Loop-Grow and Untied-Grow
(K = 2 -> 4) at nominal depths d with width = width_per_depth x d; [X] Table 1 settings (no norm gains,
QK-norm, embedding norm, the "x" init, Muon). As in [X], every architecture trains at its own
budget (its TPP times its own N), so the ladders cover different compute: fit.py fits E on Vanilla
([X]'s own free fit, all seeds), shared-E power laws per architecture [X7], and compute multipliers at
Vanilla's budgets [X6], interpolated between an architecture's own points ([X]'s rule, what [X] quotes;
never extrapolated) and from the fitted laws (marked where they extrapolate), with 95% bands from a
seed bootstrap (resample Vanilla's seeds, perturb the other points by the measured seed spread, refit).
The loss table compares equal depth, not equal compute: the report prints each architecture's tokens and
FLOPs relative to Vanilla's at every depth.

[X] data-constrained protocol (kind "repeat", x-cpu-repeat; [X] Section 5 and Appendix D: 100M unique tokens x
10 epochs, Operator-1 to Loop-12, a weight-decay sweep on the same grid). Every run reads the first
unique_tokens tokens of the train split for `epochs` epochs (train.py --unique_tokens); the Operator-1
family (the [X] code's Operator-1 recipe, K = passes of its tied core) at each stored depth and each
weight decay of a grid (matrices, embedding and lm head alike, as the [X] code), first seed; then every
other seed at each depth's best weight decay for the K in seeded_passes (K = 1 and the largest: the two
ends the answer compares; the others are judged against the pooled seed spread). The global LR (matrix
LR, the embedding and lm head keeping [X]'s ratios to it) comes from a sweep at K = 1 and the first depth,
carried to every K unchanged ([X] D.3: a tied core's optima move little with K) and across depths by
[X16] with the [X] code's Operator-1 beta (-0.6: 0.0554 at d6 to 0.04 at d8). x-cpu-repeat's design,
fixed before its run: U = 100k byte tokens x 10 epochs (1.0M tokens per run) makes stored parameters
per bit of unique text (about 2.2 bits per byte token) span 0.30 (d3) .. 1.9 (d6), inside [X]'s range
(120M..1.4B parameters on 100M GPT-2 tokens of ~4.8 bits: 0.25 .. 2.9), so the largest sizes can
memorise the corpus and the smallest cannot; TPP 1.3..21 (the [X] grid: 0.7..8). Weight decays 0.4..3.2
(2x apart: [X] picked 0.4..1.6 over its sizes with ~4x our steps; the decay per step is lr x wd); a point
whose best weight decay is at an edge of what it tried also runs the next value beyond (at most wd_extend
= 2 steps), as the LR sweep does (this bracketing rule was added while the run was under way, when the
first d3 results put K = 1's best at the grid's lower edge; no finished run changed). Budget:
82 runs, 1.75e14 FLOPs, about 57 min on 2 workers at the 2.0-2.8e10 FLOP/s per worker x-cpu-mini ran at
(at most 75 min). The report: the WD grid, each K's frontier at its best WD per size, the best K per
budget with seed-bootstrap agreement, whether it grows with compute, the compute at which K >= 2 reaches
the best WD-tuned K = 1 loss ([X]: 1/2.2 of it), and a regression of log WD* on log stored parameters and
log executed layers ([X]: WD* follows stored parameters).

Presets (python ladder.py --list prints each with its runs and planned compute):
  smelt-micro / x-micro     seconds; tests/test_ladder.py runs them end to end. Numbers mean nothing.
  smelt-cpu-mini, x-cpu-mini   the miniatures above, two CPU workers (1 thread each), about an hour each;
  *-v1                      their first designs, kept to rebuild the reports of their runs.
  x-repeat-micro / x-cpu-repeat   the data-constrained ladder: seconds (tests) / about an hour.
  smelt-gpu-1node/2node,    sized for one / two 8-GPU nodes (documented, not run here); they read
  x-gpu-1node/2node         data/cache/fineweb_gpt2 (prepare it with data/prepare.py), see GPU_DATA.

Resumable: every run lives in OUT/runs/<run_id>/ (train.py's checkpoints, log.jsonl, train.out = its
printed output) and is finished when OUT/runs/<run_id>/result.json exists, written atomically after
training. A finished run is never redone (a result from different settings is an error, not a silent
mix; a setting added to model.py / train.py since, left at its default, is not a difference); an
unfinished run is restarted from scratch. So killing the ladder at any moment and running the same
command again continues where it stopped; Ctrl-C (or SIGTERM) says so in one line (exit status 130 /
143), ending the worker processes with it. OUT/runs.csv, OUT/lr_sweep.csv (every swept value; runs.csv
holds the runs carried up), OUT/report.txt and OUT/report.json (and with --plot the figures) are rebuilt
from the result files at the end of every invocation; --from-csv rebuilds the report from runs.csv and
lr_sweep.csv alone (the committed docs/ladder/ reports are made that way). Decay branches
delete their own ckpt.pt when finished unless --keep-checkpoints (stable checkpoints are kept).
"""

import argparse
import collections
import contextlib
import functools
import glob
import json
import math
import multiprocessing
import os
import shlex
import shutil
import signal
import sys
import threading
import warnings
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass, field, fields

import numpy as np
from tqdm import tqdm

import fit
import grow
import match
import train
from model import ModelConfig
from tooling import common, distributed, guards, jobs, plots, rundir, tables
from tooling.checkpoint import TrainState
from tooling.common import cli_error, write_atomic

# ----------------------------------------------------------------------------------------------------
# Presets. Shared model/training settings first, then one dict per preset.

BYTES = dict(vocab_size=257, eot_token=256)  # gpt2-257: the 256 byte tokens + eot (data: "tokenizer" key)
GPT2_4096 = dict(vocab_size=4096, eot_token=4095)  # data/cache/default
# [S]: MoE baselines, top-2 of fine-grained experts; 6 query heads on 3 KV heads, so that the SMELT twin
# (1.5x the executed layers) matches the KV cache exactly with 2 KV heads of the same size.
SMELT_MODEL = dict(n_head=6, n_kv_head=3, top_k=2, layout="plain", n_loops=1)
# match.match search for small widths: a finer grid than the paper-scale default leaves a twin in every cell
SMELT_MATCH = dict(width_multiple=(16, 8, 4), hidden_multiple=4, expert_multiple=1, head_dim_range=(4, 64),
                   head_multiple=4)
# [X] Table 1
X_MODEL = dict(norm_gain=False, qk_norm=True, embed_norm=True, init="x")
# GPU presets need far more tokens than the embedded corpus: prepare e.g. FineWeb shards with
#   python data/prepare.py --hf HuggingFaceFW/fineweb-edu --hf_config sample-10BT --tokenizer gpt2 \
#       --val_tokens 10000000 --workers 16 --out data/cache/fineweb_gpt2   (docs/data.md; the x_d8 configs' folder)
GPU_DATA = "data/cache/fineweb_gpt2"
# [X] Operator-1's recipe (the [X] code's ladder_scripts/operator_1.sh, config/x_d8_operator1.py): prelude-core-
# coda with the boundary operator before every core pass and the coda, a tied core (K passes = Loop-K)
X_OPERATOR1 = dict(X_MODEL, layout="pcc", boundary="both", inject_before_coda=True, tie_core=True, boundary_alpha=1.0,
                   residual_multiplier=0.5, output_multiplier=1.0, embed_init_std=0.11313708499,
                   uniform_init_scale=0.353553390593, document_mask=False)
X_OPERATOR1_TRAIN = dict(optimizer="muon", muon_variant="x", grad_clip=0.0, adam_betas=[0.8, 0.98], adam_eps=1e-10,
                         warmup_steps=0, decay_fraction=0.8, decay_shape="linear", min_lr_fraction=0.0)
# [X]'s global LR: the embedding and lm head LRs keep their ratio to the matrix LR (d8: 0.0362 / 0.0032 to 0.04)
X_GLR_TIED = dict(embedding_lr=0.905096679919, unembedding_lr=0.08)
X_ARCHS = ("vanilla", "operator-1", "loop-2", "untied-2", "loop-grow", "untied-grow")
SEEDS = [1337, 1338, 1339]  # the reference architecture runs all; the others the first
# each [X] architecture's own recipe: config/x_d8_*.py (the [X] code's ladder scripts, d8 rows)
X_RECIPES = {"vanilla": "x_d8_vanilla", "operator-1": "x_d8_operator1", "loop-2": "x_d8_loop2",
             "untied-2": "x_d8_untied2", "loop-grow": "x_d8_loop_grow", "untied-grow": "x_d8_untied_grow"}
# [X] Table 9, read off the [X] code's ladder scripts: tokens per stored parameter (train-token-limit / N_s) and
# the [X16] LR exponent (the d6 -> d8 ratio of their LRs over that of N_s)
X_TPP_STORED = {"vanilla": 5.05, "operator-1": 6.06, "loop-2": 6.06, "untied-2": 6.06, "loop-grow": 6.6,
                "untied-grow": 7.24}
X_LR_BETA = {"vanilla": -0.8, "operator-1": -0.6, "loop-2": -0.6, "untied-2": -0.6, "loop-grow": -0.5,
             "untied-grow": -0.6}

SMELT_GPU_1NODE = dict(
    kind="smelt", about="one 8-GPU node (documented, not run): 4 scales x 3 sparsities, 6 branches",
    model=dict(GPT2_4096 | SMELT_MODEL, head_dim=64, n_head=8, n_kv_head=4, top_k=8, block_size=1024),
    scales={"L8w512": dict(n_layer=8, n_embd=512, expert_hidden=176),
            "L10w640": dict(n_layer=10, n_embd=640, expert_hidden=208),
            "L12w768": dict(n_layer=12, n_embd=768, expert_hidden=256),
            "L16w1024": dict(n_layer=16, n_embd=1024, expert_hidden=336)},
    cells=[(s, e) for s in ("L8w512", "L10w640", "L12w768", "L16w1024") for e in (48, 96, 128)],
    recipe="smelt", match_kwargs=dict(width_multiple=(32, 16), expert_multiple=4),
    train=dict(optimizer="adamw", batch_size=16, grad_accum=1, warmup_steps=200, eval_tokens=1 << 20,
               data_dir=GPU_DATA, branch_data_fraction=0.1),
    branch_tpp=[10, 20, 40, 80], decay_share=0.1, seeds=SEEDS[:1], gpus=8, bootstrap=2000, seed=1337)

PRESETS = {
    # ---- [S] SMELT
    "smelt-micro": dict(
        kind="smelt", about="pipeline check in seconds (tests); the numbers mean nothing",
        data=dict(tokenizer="gpt2-257"),
        model=dict(BYTES | SMELT_MODEL, head_dim=8, block_size=32),
        scales={"w32": dict(n_layer=4, n_embd=32, expert_hidden=16),
                "w56": dict(n_layer=4, n_embd=56, expert_hidden=28)},
        cells=[("w32", 8), ("w32", 16), ("w56", 16)],  # (scale, experts per layer)
        recipe="smelt", match_kwargs=SMELT_MATCH,
        train=dict(optimizer="adamw", batch_size=4, warmup_steps=2, eval_tokens=512, branch_data_fraction=0.2),
        branch_tpp=[0.1, 0.2, 0.3], decay_share=0.2, seeds=SEEDS[:2], lr_sweep=dict(key="adamw_matrix_lr",
                                                                            values=[2e-3, 4e-3], extend=0),
        bootstrap=20, seed=1337, threads=1),
    "smelt-cpu-mini": dict(
        kind="smelt", about="[S] in miniature: 3 scales varying depth and width (F spans 10x) x 3 sparsities, "
                            "3 decay branches, 2 baseline seeds",
        data=dict(tokenizer="gpt2-257"),
        model=dict(BYTES | SMELT_MODEL, head_dim=8, block_size=64),
        # depth 2 -> 8 and width 32 -> 72 (the heads grow with the width at the top: 9 query heads on 3 KV heads)
        scales={"L2w32": dict(n_layer=2, n_embd=32, expert_hidden=16),
                "L4w56": dict(n_layer=4, n_embd=56, expert_hidden=28),
                "L8w72": dict(n_layer=8, n_embd=72, expert_hidden=36, n_head=9, n_kv_head=3)},
        cells=[(s, e) for s in ("L2w32", "L4w56", "L8w72") for e in (16, 32, 48)],
        recipe="smelt", match_kwargs=SMELT_MATCH,
        train=dict(optimizer="adamw", batch_size=16, warmup_steps=20, eval_tokens=1 << 15, branch_data_fraction=0.2),
        branch_tpp=[3, 6, 12], decay_share=0.2, seeds=SEEDS[:2],
        lr_sweep=dict(key="adamw_matrix_lr", values=[1.5e-3, 3e-3, 6e-3]),
        bootstrap=2000, seed=1337, threads=1, workers=2,
        budget="written before the run: 114 runs, 6.6e13 FLOPs, about 55 min on 2 workers, at most 90"),
    "smelt-cpu-mini-v1": dict(  # the first design (its run: docs/ladder/smelt-cpu-mini-v1-*), kept for its report
        kind="smelt", about="smelt-cpu-mini's first design: 3 scales x 2 sparsities, 3 decay branches, "
                            "3 baseline seeds",
        data=dict(tokenizer="gpt2-257"),
        model=dict(BYTES | SMELT_MODEL, head_dim=8, block_size=256),
        # compute-active non-embedding params 33k / 75k / 130k, F 5.5e5 / 8.4e5 / 1.2e6 FLOPs per token
        scales={"L4w32": dict(n_layer=4, n_embd=32, expert_hidden=16),
                "L4w56": dict(n_layer=4, n_embd=56, expert_hidden=28),
                "L4w80": dict(n_layer=4, n_embd=80, expert_hidden=40)},
        cells=[(s, e) for s in ("L4w32", "L4w56", "L4w80") for e in (16, 32)],  # S 0.73-0.81 and 0.85-0.90
        recipe="smelt", match_kwargs=SMELT_MATCH,
        train=dict(optimizer="adamw", batch_size=8, warmup_steps=20, eval_tokens=1 << 15, branch_data_fraction=0.2),
        branch_tpp=[10, 20, 30], decay_share=0.2, seeds=SEEDS,
        lr_sweep=dict(key="adamw_matrix_lr", values=[1.5e-3, 3e-3, 6e-3]),
        bootstrap=2000, seed=1337, threads=1, workers=2),
    "smelt-gpu-1node": SMELT_GPU_1NODE,
    "smelt-gpu-2node": dict(SMELT_GPU_1NODE, about="two 8-GPU nodes (documented, not run): the 1-node grid, "
                                                  "2x the tokens per step", gpus=16),
    # ---- [X] scaling exponents
    "x-micro": dict(
        kind="x", about="pipeline check in seconds (tests); the numbers mean nothing",
        data=dict(tokenizer="gpt2-257"),
        model=dict(BYTES, block_size=32), depths=[3, 4, 5], width_per_depth=8, head_dim=8, mlp_multiple=8,
        archs=X_ARCHS, recipes=True, tpp_stored={a: 0.05 + 0.01 * i for i, a in enumerate(X_ARCHS)}, lr_beta=X_LR_BETA,
        grow_to=4, rewarm_fraction=0.05, train=dict(batch_size=4, eval_tokens=512, branch_data_fraction=0.0),
        seeds=SEEDS[:2], seed_every_arch=True, lr_sweep=dict(key="matrix_lr", values=[0.02, 0.04], extend=0, seeds=2),
        multipliers="interpolated", seed=1337, threads=1),
    "x-cpu-mini": dict(
        kind="x", about="[X] in miniature: 6 architectures x depths 3..6 at width 8 x depth, each with its [X] "
                        "recipe, TPP and [X16] LR rule, no data repetition, 3 seeds each",
        data=dict(tokenizer="gpt2-257"),
        model=dict(BYTES, block_size=128), depths=[3, 4, 5, 6], width_per_depth=8, head_dim=8, mlp_multiple=8,
        archs=X_ARCHS, recipes=True, tpp_stored=X_TPP_STORED, lr_beta=X_LR_BETA, grow_to=4, rewarm_fraction=0.02,
        train=dict(batch_size=16, eval_tokens=1 << 15, branch_data_fraction=0.0), seeds=SEEDS, seed_every_arch=True,
        lr_sweep=dict(key="matrix_lr", values=[0.02, 0.04, 0.08], seeds=2), multipliers="interpolated", seed=1337,
        threads=1, workers=2,
        budget="written before the run: 96 runs, 6.3e13 FLOPs, about 30 min on 2 workers, at most 60"),
    "x-cpu-mini-v1": dict(  # the first design (its run: docs/ladder/x-cpu-mini-v1-*), kept to rebuild that report
        kind="x", about="x-cpu-mini's first design: 6 architectures x depths 3..6 at width 12 x depth, TPP 10 each, "
                        "3 Vanilla seeds",
        data=dict(tokenizer="gpt2-257"),
        model=dict(BYTES | X_MODEL, block_size=128), depths=[3, 4, 5, 6], width_per_depth=12, head_dim=12,
        mlp_multiple=32, archs=X_ARCHS, tpp=10, grow_to=4, rewarm_fraction=0.05,
        train=dict(optimizer="muon", batch_size=16, warmup_fraction=0.05, decay_fraction=0.3, eval_tokens=1 << 15),
        seeds=SEEDS, lr_sweep=dict(key="matrix_lr", values=[0.01, 0.02, 0.04]), seed=1337, threads=1, workers=2),
    # ---- [X] data-constrained: a few unique tokens read for many epochs (kind "repeat")
    "x-repeat-micro": dict(
        kind="repeat", about="pipeline check in seconds (tests); the numbers mean nothing",
        data=dict(tokenizer="gpt2-257"),
        model=dict(BYTES | X_OPERATOR1, block_size=32), depths=[3, 4], width_per_depth=8, head_dim=8, mlp_multiple=8,
        passes=[1, 2], unique_tokens=2000, epochs=2,
        train=dict(X_OPERATOR1_TRAIN, batch_size=4, muon_momentum_warmup=2, eval_tokens=512),
        lr_sweep=dict(key="matrix_lr", values=[0.02, 0.04], extend=0, tied=X_GLR_TIED, weight_decay=0.2),
        lr_scaling_beta=-0.6, weight_decays=[0.1, 0.4], wd_extend=1, seeds=SEEDS[:2], seeded_passes=[1, 2], seed=1337,
        bootstrap=50, threads=1),
    "x-cpu-repeat": dict(
        kind="repeat", about="[X] data-constrained in miniature: the Operator-1 family K 1..4 x depths 3..6, "
                             "100k unique tokens x 10 epochs, a WD grid at every point, 3 seeds at K 1 and 4",
        data=dict(tokenizer="gpt2-257"),
        model=dict(BYTES | X_OPERATOR1, block_size=128), depths=[3, 4, 5, 6], width_per_depth=12, head_dim=12,
        mlp_multiple=32, passes=[1, 2, 3, 4], unique_tokens=100_000, epochs=10,
        train=dict(X_OPERATOR1_TRAIN, batch_size=16, muon_momentum_warmup=75, eval_tokens=1 << 15),
        lr_sweep=dict(key="matrix_lr", values=[0.02, 0.04, 0.08], tied=X_GLR_TIED, weight_decay=0.8),
        lr_scaling_beta=-0.6, weight_decays=[0.4, 0.8, 1.6, 3.2], seeds=SEEDS, seeded_passes=[1, 4], seed=1337,
        bootstrap=400, threads=1, workers=2,
        budget="written before the run: 82 runs (plus bracketing), 1.75e14 FLOPs, about 57 min on 2 workers, "
               "at most 75"),
    "x-gpu-1node": dict(
        kind="x", about="one 8-GPU node (documented, not run): the paper's width 128 x depth, d6..d10",
        model=dict(dict(vocab_size=50304, eot_token=50256) | X_MODEL, block_size=2048), depths=[6, 7, 8, 9, 10],
        width_per_depth=128, head_dim=128, mlp_multiple=256, archs=X_ARCHS, tpp=10, grow_to=4,
        rewarm_fraction=0.02, gpus=8, seeds=SEEDS[:1],
        train=dict(optimizer="muon", batch_size=16, grad_accum=2, warmup_fraction=0.02, decay_fraction=0.3,
                   eval_tokens=1 << 21, data_dir=GPU_DATA), seed=1337),
    "x-gpu-2node": dict(
        kind="x", about="two 8-GPU nodes (documented, not run): d8..d12 at width 128 x depth",
        model=dict(dict(vocab_size=50304, eot_token=50256) | X_MODEL, block_size=2048), depths=[8, 9, 10, 11, 12],
        width_per_depth=128, head_dim=128, mlp_multiple=256, archs=X_ARCHS, tpp=10, grow_to=4,
        rewarm_fraction=0.02, gpus=16, seeds=SEEDS[:1],
        train=dict(optimizer="muon", batch_size=16, grad_accum=1, warmup_fraction=0.02, decay_fraction=0.3,
                   eval_tokens=1 << 21, data_dir=GPU_DATA), seed=1337),
}


def get_preset(name, **overrides):
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
    preset = json.loads(json.dumps(PRESETS[name]))  # deep copy (tuples become lists)
    for key, value in overrides.items():
        if value is not None:
            preset[key] = value
    preset["name"] = name
    return preset


# ----------------------------------------------------------------------------------------------------
# Data: the prepared corpus a preset trains on, and how much of it a run reads


@dataclass
class DataPlan:
    """Where a preset's data is and how big its regions are (None when it is not prepared here)."""
    data_dir: str
    train_tokens: int = None  # the train split
    stable_tokens: int = None  # what a stable run reads (the split minus the held-back tail)
    branch_tokens: int = None  # the held-back tail that decay branches read


def data_plan(preset, prepare=True):
    """The preset's data: the embedded corpus in the preset's tokenizer (prepared once, offline) or
    the train data_dir it names (GPU presets: their sizes are unknown until it is prepared)."""
    from data import prepare as prep
    tokenizer = preset.get("data", {}).get("tokenizer")
    if tokenizer:
        out = os.path.join(prep.DATA_DIR, "cache", f"default-{tokenizer}")
        data_dir = prep.prepare_default(out, tokenizer=tokenizer, verbose=False) if prepare else out
    else:
        data_dir = preset["train"].get("data_dir", "")
    try:
        n = int(prep.load_meta(data_dir or prep.DEFAULT_OUT)["splits"]["train"]["tokens"])
    except (FileNotFoundError, ValueError):
        return DataPlan(data_dir)
    held = int(n * preset["train"].get("branch_data_fraction", train.DEFAULTS["branch_data_fraction"]))
    return DataPlan(data_dir, n, n - held, held)


def compute_active(cfg):
    """N: the non-embedding parameters one token's compute runs through ([X10]'s N_c without the lm
    head): every executed block's matmul weights, once per visit, the active experts only."""
    return match.accounting(cfg)["params_compute_active"] - cfg.vocab_size * cfg.n_embd


def tokens_per_step(preset, world=None):
    t = preset["train"]
    return t["batch_size"] * t.get("grad_accum", 1) * preset["model"]["block_size"] * (world or world_size(preset))


def world_size(preset=None):
    """DDP processes (torchrun sets WORLD_SIZE): a step reads batch_size x grad_accum x world sequences.
    Outside torchrun a preset's intended `gpus` is used for planning only (--list)."""
    if "WORLD_SIZE" in os.environ or preset is None:
        return int(os.environ.get("WORLD_SIZE", "1"))
    return int(preset.get("gpus", 1))


# ----------------------------------------------------------------------------------------------------
# Runs: a RunSpec is one train.train() call; its result.json marks it finished


@dataclass
class RunSpec:
    run_id: str  # unique in the ladder; the run's folder name
    arch: str
    cell: str  # SMELT: "<scale>-e<experts>" (shared by baseline and twin); [X]: "d<depth>"
    role: str  # "stable" (branch source), "branch" (a decay branch -> one fit point), "run" ([X]), "sweep"
    settings: dict  # train.train overrides (out_dir / run_name / data_dir are filled in by run_ladder)
    meta: dict = field(default_factory=dict)  # what the report needs: F, S, N, depth, planned tokens, ...
    needs: str = ""  # run_id whose checkpoint this run starts from


def write_json_atomic(path, obj):
    path = os.path.abspath(path)
    text = json.dumps(obj, indent=1, default=_json_default)
    write_atomic(path, lambda f: f.write(text.encode()))


def _json_default(v):
    if isinstance(v, (np.floating, np.integer)):
        return v.item()
    if isinstance(v, np.ndarray):
        return v.tolist()
    raise TypeError(f"not JSON serialisable: {type(v).__name__}")


def run_dir(out_dir, run_id):
    return os.path.join(out_dir, "runs", run_id)


def load_result(out_dir, spec):
    """The finished result of `spec`, or None. A result written with other settings is an error."""
    path = os.path.join(run_dir(out_dir, spec.run_id), "result.json")
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            result = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: unreadable result file ({e}); delete it to rerun that run") from None
    if not same_settings(result.get("settings"), spec.settings):
        raise ValueError(f"{path}: this run was finished with different settings than preset asks for now; "
                         f"use another --out, or delete {os.path.dirname(path)} to rerun it")
    return result


def _canonical(obj):
    return json.loads(json.dumps(obj, sort_keys=True, default=_json_default))


def setting_default(key):
    """The value a setting has when nobody sets it: train.py's default (model fields included)."""
    return train.DEFAULTS.get(key, ...)


def same_settings(stored, now):
    """Settings equal, except keys one side lacks that are at their default on the other side (a
    setting added to model.py / train.py since the run finished does not invalidate it)."""
    stored, now = _canonical(stored or {}), _canonical(now)
    for key in set(stored) | set(now):
        if key in stored and key in now:
            if stored[key] != now[key]:
                return False
        elif _canonical({"v": (stored if key in stored else now)[key]}) != _canonical({"v": setting_default(key)}):
            return False
    return True


def _barrier():
    """All DDP ranks wait here (no-op without torch.distributed): rank 0 writes results/checkpoints."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _is_master():
    import torch.distributed as dist
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def init_path(spec, out_dir):
    """The checkpoint a run starts from. Specs say "{runs}/<stable run>/ckpt_step<N>.pt" so that the
    settings identifying a run do not depend on where its output folder is; an FSDP stable run wrote
    ckpt_step<N>.dcp instead."""
    path = spec.settings["init_from"].replace("{runs}", os.path.join(out_dir, "runs"))
    sharded = os.path.splitext(path)[0] + ".dcp"
    return sharded if not os.path.exists(path) and os.path.exists(sharded) else path


def train_in_run_dir(settings, directory, threads=None, train_fn=None):
    """train.train (or train_fn) with its printed output in directory/train.out (what a worker runs)."""
    if threads:
        import torch
        torch.set_num_threads(threads)
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "train.out"), "a") as out, contextlib.redirect_stdout(out):
        summary = (train_fn or train.train)(settings)
    return {k: summary.get(k) for k in RESULT_KEYS} | {"train_losses": summary.get("train_losses")}


def _worker_init():
    """A ladder worker process: Ctrl-C is the parent's to handle (jobs.ignore_sigint), and tqdm's lock a
    thread lock: each worker writes only its own train.out, and tqdm's default multiprocessing lock is a
    named semaphore that the resource tracker reports as leaked (a warning on stderr) once the parent
    ends the worker after Ctrl-C."""
    jobs.ignore_sigint()
    tqdm.set_lock(threading.RLock())


RESULT_KEYS = ("val_loss", "val_loss_by_source", "tokens", "flops", "step", "max_steps", "seconds", "unigram_entropy",
               "data_region", "data_read", "data_split", "ckpt_path", "log_path")


def run_ladder(specs, out_dir, train_fn=None, progress=True, keep_checkpoints=False, log=print, workers=1,
               threads=None, data_dir=""):
    """Train every spec that has no result yet (a run whose checkpoint another needs first); returns
    {run_id: result}. workers > 1: that many processes train at once, threads torch threads each.
    train_fn (tests: a counting wrapper of train.train) runs in this process, one run at a time."""
    results = {s.run_id: load_result(out_dir, s) for s in specs}
    ids = [s.run_id for s in specs]
    if len(set(ids)) != len(ids):
        raise ValueError("duplicate run ids in the ladder")
    todo = [s for s in specs if results[s.run_id] is None]
    log(f"ladder {out_dir}: {len(specs)} runs, {len(specs) - len(todo)} finished, {len(todo)} to train"
        + (f" ({workers} workers)" if workers > 1 and todo else ""))
    bar = tqdm(total=len(specs), initial=len(specs) - len(todo), desc="ladder", unit="run",
               disable=not (progress and _is_master()), position=0, dynamic_ncols=True)

    def settings_of(spec):
        directory = run_dir(out_dir, spec.run_id)
        if _is_master() and os.path.isdir(directory):  # an interrupted attempt: start it again
            shutil.rmtree(directory, ignore_errors=True)
        _barrier()
        settings = dict(spec.settings, out_dir=os.path.join(out_dir, "runs"), run_name=spec.run_id,
                        progress=progress and workers == 1, sample=False, overwrite=True)  # a run starts over
        if data_dir:
            settings["data_dir"] = data_dir
        if spec.needs:
            source = settings["init_from"] = init_path(spec, out_dir)
            if not os.path.exists(source):
                raise ValueError(f"run {spec.run_id} starts from {source}, which is missing (the finished run "
                                 f"{spec.needs} lost its checkpoints?); delete {run_dir(out_dir, spec.needs)} to retrain it")
        return settings

    def finish(spec, summary):
        result = dict(run_id=spec.run_id, arch=spec.arch, cell=spec.cell, role=spec.role, settings=spec.settings,
                      meta=spec.meta, needs=spec.needs, **{k: summary.get(k) for k in RESULT_KEYS})
        losses = summary.get("train_losses") or []
        if losses:
            result["final_train_loss"] = float(np.mean(losses[-max(1, len(losses) // 10):]))
        if _is_master():
            if spec.role == "branch" and not keep_checkpoints and os.path.exists(summary.get("ckpt_path") or ""):
                os.remove(summary["ckpt_path"])  # a branch's final weights are not needed by the ladder
                result["ckpt_path"] = None
            write_json_atomic(os.path.join(run_dir(out_dir, spec.run_id), "result.json"), result)
        _barrier()
        results[spec.run_id] = result
        bar.update(1)
        if _is_master() and result["val_loss"] is not None:
            bar.write(f"  {spec.run_id}: val loss {result['val_loss']:.4f}, {result['tokens']:,} tokens, "
                      f"{result['flops']:.3e} FLOPs, {result['seconds']:.0f} s")

    if workers <= 1 or train_fn is not None:
        for spec in todo:
            bar.set_postfix_str(spec.run_id)
            finish(spec, train_in_run_dir(settings_of(spec), run_dir(out_dir, spec.run_id), train_fn=train_fn))
    else:  # a pool of worker processes; a run starts once the run it branches from has finished
        pending, running = list(todo), {}
        context = multiprocessing.get_context("spawn")  # fresh interpreters: no forked torch thread pools
        # Ctrl-C: the workers ignore it; this process ends them (an unfinished run restarts from scratch on
        # the next invocation, so killing one mid-run loses only that run's progress)
        with ProcessPoolExecutor(workers, mp_context=context, initializer=_worker_init) as pool:
            try:
                while pending or running:
                    for spec in [s for s in pending if not s.needs or results.get(s.needs)]:
                        if len(running) >= workers:
                            break
                        pending.remove(spec)
                        running[pool.submit(train_in_run_dir, settings_of(spec), run_dir(out_dir, spec.run_id),
                                            threads)] = spec
                    if not running:
                        raise ValueError(f"runs {[s.run_id for s in pending]} wait for runs that are not in the ladder")
                    done, _ = wait(running, return_when=FIRST_COMPLETED)
                    for future in done:
                        finish(running.pop(future), future.result())
            except BrokenProcessPool:  # a worker died (killed, out of memory): its run restarts next time
                jobs.stop_workers(pool)
                raise ValueError(f"a worker process died while training {sorted(s.run_id for s in running.values())} "
                                 "(killed? out of memory?); rerun the same command to continue (finished runs are "
                                 "kept), or use fewer --workers") from None
            except BaseException:
                jobs.stop_workers(pool)
                raise
    bar.close()
    return results


# ----------------------------------------------------------------------------------------------------
# LR sweep: the first ladder point, every architecture, each value of one learning rate


def sweep_values(preset):
    sweep = preset.get("lr_sweep")
    return (sweep["key"], sweep["values"]) if sweep else (None, [None])


def best_lrs(preset, results, sweep_specs):
    """{arch: the swept value with the lowest validation loss}, or None while sweep runs are missing."""
    key, values = sweep_values(preset)
    if key is None:
        return {}
    losses = {}
    for s in sweep_specs:
        r = results.get(s.run_id)
        if r is None:
            return None
        losses.setdefault(s.arch, {}).setdefault(s.settings[key], []).append(r["val_loss"])
    return {arch: min(by, key=lambda v: np.mean(by[v])) for arch, by in losses.items()}  # the mean over its seeds


def sweep_extension(preset, data, results, sweep_specs, world=None):
    """Sweep runs one step beyond the edge of the values an architecture tried, for every architecture
    whose best value is at that edge (a sweep must bracket its optimum), at most lr_sweep["extend"] (2)
    steps beyond the preset's grid on either side. [] when every best value is inside its grid."""
    key, values = sweep_values(preset)
    if key is None or len(values) < 2:
        return []
    ratio, limit = values[1] / values[0], preset["lr_sweep"].get("extend", 2)
    seen = {}
    for s in sweep_specs:
        r = results.get(s.run_id)
        if r is not None:
            seen.setdefault(s.arch, {}).setdefault(s.settings[key], []).append(r["val_loss"])
    tried = {a: {v: float(np.mean(ls)) for v, ls in by.items()} for a, by in seen.items()}
    extra = []
    for arch, losses in tried.items():
        best, ordered = min(losses, key=losses.get), sorted(losses)
        if best == ordered[-1] and best < values[-1] * ratio ** (limit - 0.5):
            value = float(f"{best * ratio:.12g}")  # 0.012, not 0.011999999999999999
        elif best == ordered[0] and best > values[0] / ratio ** (limit - 0.5):
            value = float(f"{best / ratio:.12g}")
        else:
            continue
        specs, _ = build(dict(preset, lr_sweep=dict(preset["lr_sweep"], values=[value])), data, world=world)
        extra += [s for s in specs if s.arch == arch]
    return extra


def bracketed_sweep(preset, data, run, world=None):
    """(results, sweep specs): the preset's sweep, then its extensions until every architecture's best
    value is inside what it tried (or the extension limit). run(specs) -> {run_id: result or None}."""
    sweep_specs, _ = build(preset, data, world=world)
    results = run(sweep_specs)
    while best_lrs(preset, results, sweep_specs):  # None while runs are missing, {} without a sweep
        extra = sweep_extension(preset, data, results, sweep_specs, world)
        if not extra:
            break
        results.update(run(extra))
        if any(results.get(s.run_id) is None for s in extra):  # --fit-only: the extension was not trained
            break
        sweep_specs = sweep_specs + extra
    return results, sweep_specs


def sweep_table(preset, results, sweep_specs, chosen):
    """The sweep's report lines and {arch: {value: loss}} (sweep_lines) from its results."""
    key, _ = sweep_values(preset)
    seen = {}
    for s in sweep_specs:
        r = results.get(s.run_id)
        seen.setdefault(s.arch, {}).setdefault(s.settings[key], []).append(r["val_loss"] if r else None)
    losses = {a: {v: None if None in ls else float(np.mean(ls)) for v, ls in by.items()} for a, by in seen.items()}
    return sweep_lines(key, losses, chosen)  # a value's loss: the mean over its seeds


def sweep_lines(key, losses, chosen):
    """losses: {arch: {swept value: validation loss or None}}; chosen: {arch: the value carried up} ->
    (report lines, {arch: {str(value): loss}} for report.json)."""
    values = sorted({v for by in losses.values() for v in by})
    lines = [f"LR sweep ({key}) at the first ladder point, validation loss (* = carried up the ladder; "
             f"- = not tried: a value beyond the grid runs only while the best is at its edge)"]
    lines.append(f"  {'':>12} " + " ".join(f"{v:>10g}" for v in values))
    table = {}
    for a, by in losses.items():
        cells = []
        for v in values:
            loss = by.get(v)
            table.setdefault(a, {})[str(v)] = loss
            cells.append(f"{loss:9.4f}{'*' if chosen.get(a) == v else ' '}" if loss is not None else f"{'-':>10}")
        lines.append(f"  {a:>12} " + " ".join(cells))
    return lines, table


def sweep_rows(key, table, chosen):
    """lr_sweep.csv's rows (arch, key, value, val_loss, carried) of a sweep table (sweep_lines)."""
    return [dict(arch=a, key=key, value=float(v), val_loss=loss, carried=chosen.get(a) == float(v))
            for a, by in table.items() for v, loss in by.items() if loss is not None]


def sweep_from_rows(rows):
    """(key, {arch: {value: loss}}, {arch: carried value}) back from lr_sweep.csv's rows."""
    keys = {r["key"] for r in rows}
    if len(keys) != 1:
        raise ValueError(f"lr_sweep.csv: expected one swept key, found {sorted(keys)}")
    losses, chosen = {}, {}
    for r in rows:
        losses.setdefault(r["arch"], {})[float(r["value"])] = r["val_loss"]
        if r["carried"]:
            chosen[r["arch"]] = float(r["value"])
    return keys.pop(), losses, chosen


# ----------------------------------------------------------------------------------------------------
# [S] SMELT grid


def smelt_cells(preset):
    """[(cell name, baseline ModelConfig, SMELT twin ModelConfig, match report)] for every cell."""
    cells = []
    for scale, n_expert in preset["cells"]:
        if scale not in preset["scales"]:
            raise ValueError(f"preset {preset['name']}: cell ({scale}, {n_expert}) names an unknown scale; "
                             f"scales are {sorted(preset['scales'])}")
        baseline = ModelConfig.from_dict(dict(preset["model"], **preset["scales"][scale], n_expert=n_expert))
        try:
            twin, report = match.match(baseline, preset["recipe"], **preset.get("match_kwargs", {}))
        except ValueError as e:
            raise ValueError(f"preset {preset['name']}, cell {scale}-e{n_expert}: {e}") from None
        cells.append((f"{scale}-e{n_expert}", baseline, twin, report))
    return cells


def model_settings(cfg):
    """ModelConfig -> train.py model overrides (the resolved fields as plain ints, so the run is fully
    specified and JSON-stable)."""
    return {k: (int(v) if isinstance(v, int) and not isinstance(v, bool) else v) for k, v in asdict(cfg).items()}


def smelt_branch_plan(preset, cfg, data, world=None):
    """[(TPP, stable steps before the branch, decay tokens)] of one cell: the branch's total tokens are
    TPP x N (N of the baseline: the twin is matched to it), the last decay_share of them decay, capped
    to what the held-back data holds (a branch never rereads it)."""
    step_tokens = tokens_per_step(preset, world)
    n = compute_active(cfg)
    plan = []
    for tpp in preset["branch_tpp"]:
        total = tpp * n
        decay_steps = max(1, math.ceil(preset["decay_share"] * total / step_tokens))
        if data.branch_tokens:
            decay_steps = min(decay_steps, int(0.9 * data.branch_tokens) // step_tokens)
        stable = max(1, math.ceil(total / step_tokens) - decay_steps)  # whole steps, at least tpp x N tokens
        plan.append((tpp, stable, decay_steps * step_tokens))
    return plan


def smelt_specs(preset, cells, data, lrs=None, world=None):
    """Per cell and architecture (the baseline with every seed, the twin with the first): one stable run
    saving checkpoints at the branch points, then one decay branch per checkpoint. Baseline and twin of a
    seed share batch and data order: the same token sequence. Without lrs: the LR sweep runs only."""
    key, values = sweep_values(preset)
    common = dict(preset["train"], decay_fraction=0.0)
    step_tokens = tokens_per_step(preset, world)
    specs = []
    for cell, baseline, twin, _ in cells:
        attended = match.resolve_attended(baseline)
        plan = smelt_branch_plan(preset, baseline, data, world)
        steps = [s for _, s, _ in plan]
        for arch, cfg in (("baseline", baseline), ("smelt", twin)):
            F = train.flops_per_token(cfg)
            meta = dict(F=F, S=match.sparsity(cfg, attended, baseline=baseline)["S"], N=compute_active(baseline),
                        N_s=match.accounting(cfg)["params_stored"], n_layer=cfg.n_layer, n_embd=cfg.n_embd,
                        n_expert=cfg.n_expert, layout=cfg.layout)
            if lrs is None:  # the sweep: the first branch's budget as one WSD run, at the first cell only
                if cell != cells[0][0] or key is None:
                    continue
                tpp, stable, decay = plan[0]
                total_steps = stable + decay // step_tokens
                for value in values:
                    specs.append(RunSpec(f"sweep-{arch}-{cell}-{key}{value:g}", arch, cell, "sweep",
                                         dict(common, **model_settings(cfg), seed=SEEDS[0], max_steps=total_steps,
                                              decay_fraction=preset["decay_share"], eval_interval=total_steps,
                                              **{key: value}),
                                         dict(meta, tpp=tpp, tokens=total_steps * step_tokens)))
                continue
            lr = {key: lrs[arch]} if key else {}
            for seed in preset["seeds"] if arch == "baseline" else preset["seeds"][:1]:
                stable_id = f"{arch}-{cell}-s{seed}-stable"
                specs.append(RunSpec(stable_id, arch, cell, "stable",
                                     dict(common, **model_settings(cfg), **lr, seed=seed, max_steps=steps[-1],
                                          save_steps=steps, eval_interval=max(1, steps[-1] // 8)),
                                     dict(meta, seed=seed, tokens=steps[-1] * step_tokens,
                                          tpp=steps[-1] * step_tokens / meta["N"])))
                for tpp, step, decay in plan:
                    decay_steps = decay // step_tokens
                    specs.append(RunSpec(f"{arch}-{cell}-s{seed}-b{tpp:g}", arch, cell, "branch",
                                         dict(init_from=f"{{runs}}/{stable_id}/ckpt_step{step}.pt", decay_branch=True,
                                              decay_tokens=decay, eval_tokens=preset["train"]["eval_tokens"],
                                              eval_interval=max(1, decay_steps // 4)),
                                         dict(meta, seed=seed, branch_step=step, branch_tpp=tpp,
                                              tokens=step * step_tokens + decay,
                                              tpp=(step * step_tokens + decay) / meta["N"]),
                                         needs=stable_id))
    return specs


def smelt_rows(results):
    """One CSV row per finished decay branch: arch, cell, seed, F, S, D, C, loss (+ val loss per source)."""
    branch = [r for r in results if r and r["role"] == "branch"]
    sources = sources_of(branch)
    rows = []
    for r in branch:
        m = r["meta"]
        # F: the per-token training FLOPs train.py counted (= match.py's analytic F when the run was made)
        row = dict(arch=r["arch"], cell=r["cell"], seed=m["seed"], branch_tpp=m["branch_tpp"],
                   branch_step=m["branch_step"], F=r["flops"] / r["tokens"], S=m["S"], D=r["tokens"], C=r["flops"],
                   loss=r["val_loss"], N=m["N"], tpp=r["tokens"] / m["N"], epochs=m.get("epochs"),
                   n_layer=m["n_layer"], n_embd=m["n_embd"], n_expert=m["n_expert"], run_id=r["run_id"],
                   seconds=r["seconds"])
        for s in sources:
            row[f"loss_{s}"] = (r.get("val_loss_by_source") or {}).get(s)
        rows.append(row)
    return rows


def sources_of(results):
    names = []
    for r in results:
        for k in (r.get("val_loss_by_source") or {}):
            if k not in names:
                names.append(k)
    return names


def sources_of_rows(rows):
    return [k[len("loss_"):] for k in (rows[0] if rows else {}) if k.startswith("loss_")]


def columns_to_arrays(rows, keys=("arch", "cell", "F", "S", "D", "loss")):
    return {k: np.asarray([r[k] for r in rows], dtype=object if k in ("arch", "cell") else float) for k in keys}


def default_budgets(C):
    """Two budgets inside the measured compute range: its geometric middle and its top."""
    C = np.asarray(C, dtype=float)
    return [float(np.exp(np.mean(np.log([C.min(), C.max()])))), float(C.max())]


def surface_bootstrap(runs, ref, target, budgets, sparsities, n_draws, seed=0, full_fits=None, progress=True):
    """fit.cell_bootstrap on a small grid: with few cells some draws leave a six-coefficient surface
    underdetermined; fit.cell_bootstrap leaves those out (counted here as "skipped")."""
    out = fit.cell_bootstrap(runs, ref, target, budgets, sparsities, n_draws=n_draws, seed=seed,
                             n_workers=1 if n_draws <= 50 else None, full_fits=full_fits, progress=progress)
    out["skipped"] = out["n_failed"]
    return out


def match_table(cells, search=None):
    """[S] Table 10 style: per cell the baseline and its SMELT twin, F / N / KV ratios, sparsities.
    search: the match.MatchSearch the twins were found with, for the line saying its tolerances."""
    lines, records = [], []
    lines.append("matching ([S] Table 10 ratios: SMELT / baseline)")
    if search is not None:
        (f_lo, f_hi), n_tol, kv_tol = search.flops_tol, search.params_tol, search.kv_tol
        lines.append(f"  by construction: match.match accepts only a twin with F in [{1 - f_lo:.3f}, {1 + f_hi:.3f}] x, "
                     f"N within {100 * n_tol:.1f}% and KV within {100 * kv_tol:.1f}% of its baseline's, so these "
                     "ratios meet [S]'s by the matcher's tolerance, not as a finding")
    lines.append(f"  {'cell':<12} {'baseline H/E/kv':>16} {'SMELT H/E/kv':>14} {'F':>7} {'N':>7} {'KV':>7} {'S_base':>7} {'S_smelt':>7}")
    for name, b, t, rep in cells:
        r = rep["ratios"]
        s_b, s_t = rep["sparsity_baseline"]["S"], rep["sparsity_matched"]["S"]
        lines.append(f"  {name:<12} {f'{b.n_embd}/{b.n_expert}/{b.n_kv_head}x{b.head_dim}':>16} "
                     f"{f'{t.n_embd}/{t.n_expert}/{t.n_kv_head}x{t.head_dim}':>14} {r['flops']:7.4f} "
                     f"{r['params']:7.4f} {r['kv']:7.4f} {s_b:7.3f} {s_t:7.3f}")
        shape = lambda c, S: dict(n_embd=c.n_embd, n_expert=c.n_expert, n_head=c.n_head, n_kv_head=c.n_kv_head,
                                  head_dim=c.head_dim, S=S)
        records.append(dict(cell=name, ratios=r, baseline=shape(b, s_b), smelt=shape(t, s_t)))
    return lines, records


def win_counts(rows, ref="baseline", target="smelt", key="loss"):
    """Pairs (same cell, branch and seed) where the target's loss is lower: (wins, pairs)."""
    by = {(r["arch"], r["cell"], r["branch_tpp"], r["seed"]): r for r in rows}
    wins = pairs = 0
    for (a, cell, tpp, seed), r in by.items():
        other = by.get((target, cell, tpp, seed))
        if a != ref or other is None or r.get(key) is None or other.get(key) is None:
            continue
        pairs += 1
        wins += other[key] < r[key]
    return wins, pairs


def seed_spread(rows, group_keys, ref):
    """Loss spread over the reference's repeated seeds: per group (its keys) the mean and sample std,
    and the pooled std over groups (the noise scale the report compares differences with)."""
    groups = {}
    for r in rows:
        if r["arch"] == ref and r.get("loss") is not None:
            groups.setdefault(tuple(r[k] for k in group_keys), []).append(r["loss"])
    per = {k: (float(np.mean(v)), float(np.std(v, ddof=1)) if len(v) > 1 else None, len(v)) for k, v in groups.items()}
    replicated = [v for v in groups.values() if len(v) > 1]
    pooled = math.sqrt(sum(np.var(v, ddof=1) * (len(v) - 1) for v in replicated) /
                       sum(len(v) - 1 for v in replicated)) if replicated else None
    return per, pooled


def within_noise(lo, hi, no_difference):
    """True when the interval [lo, hi] does not exclude 'no difference' (None: no interval)."""
    if lo is None or hi is None or not (np.isfinite(lo) and np.isfinite(hi)):
        return None
    return bool(lo <= no_difference <= hi)


def smelt_report(preset, cells, rows, n_boot, seed=0, progress=True, sweep=None):
    """LR sweep (sweep_table's (lines, table)), matching, seed spread, win counts, both surfaces, CE Gain
    with cell-bootstrap intervals and TPP -> (text, dict, figure data)."""
    lines, out = [], {"preset": preset["name"], "match": [], "fits": {}, "ce_gain": [], "tpp": [], "wins": {},
                      "seed_spread": {}}
    lines.append(f"== {preset['name']}: [S] SMELT vs matched baseline ({len(cells)} cells)")
    if sweep:
        lines += sweep[0]
        out["lr_sweep"] = sweep[1]
    table, out["match"] = match_table(cells, match_search(preset))
    lines += table
    if not rows:
        lines.append("no finished decay branches yet")
        return "\n".join(lines), out, None
    lines += smelt_noise_lines(rows, out)
    runs = columns_to_arrays(rows)
    lines += grid_lines(rows, runs, out)
    fits = smelt_surfaces(runs, lines, out)
    if len(fits) < 2:
        lines.append("CE Gain and TPP need both surfaces; train more cells/branches")
        return "\n".join(lines), out, None
    measured_C = runs["F"] * runs["D"]
    budgets = preset.get("budgets") or default_budgets(measured_C)
    sparsities = sorted({round(float(s), 3) for s in runs["S"][runs["arch"].astype(str) == "baseline"]})
    boot = None
    if n_boot:
        try:
            boot = surface_bootstrap(runs, "baseline", "smelt", budgets, sparsities, n_boot, seed=seed,
                                     full_fits=fits, progress=progress)
        except ValueError as e:
            lines.append(f"cell bootstrap failed: {e}")
    lines += surface_lines(fits, boot, out)
    CC, SS = np.meshgrid(budgets, sparsities, indexing="ij")
    gain = fit.ce_gain(fits["baseline"], fits["smelt"], CC, SS)
    flat = [a for a, f in fits.items() if degenerate(f)]
    if flat:  # [S5] needs both frontiers: no gain, whatever the arithmetic gives (1 - C / inf = +1)
        gain = np.full_like(gain, np.nan)
    lines += ce_gain_lines(gain, budgets, sparsities, boot, measured_C, out,
                           why=f"the {' and '.join(flat)} surface is degenerate, see above" if flat else None)
    lines += tpp_lines(fits, CC, SS, budgets, sparsities, boot, out)
    figures = dict(fits=fits, sparsities=sparsities, budgets=budgets, gain=gain, boot=boot,
                   C_range=(float(measured_C.min()), float(measured_C.max())))
    return "\n".join(lines), out, figures


def match_search(preset):
    """The match.MatchSearch of a preset's twins (its match_kwargs over the defaults)."""
    return match.MatchSearch(**{k: tuple(v) if isinstance(v, list) else v
                                for k, v in preset.get("match_kwargs", {}).items()})


def grid_lines(rows, runs, out):
    """What the grid can resolve: the span of F, S and D the [S2] surface is fitted on -> report lines;
    a surface of six coefficients on F spanning less than a decade is not identifiable by design."""
    F, S, D = (np.asarray(runs[k], dtype=float) for k in ("F", "S", "D"))
    cells = len(set(runs["cell"].tolist()))
    layers = sorted({r["n_layer"] for r in rows if r.get("n_layer") is not None})
    span = float(F.max() / F.min())
    out["grid"] = dict(F_span=span, cells=cells, S=[float(S.min()), float(S.max())], D=[float(D.min()), float(D.max())],
                       n_layer=layers)
    line = (f"grid: F spans {span:.1f}x ({F.min():.3g}..{F.max():.3g} FLOPs per token) over {cells} cells, S "
            f"{S.min():.3f}..{S.max():.3f}, D {D.min():.3g}..{D.max():.3g} tokens"
            + (f", {layers[0]} layers in every cell" if len(layers) == 1 else ""))
    if span < 10:
        line += ("; on F spanning less than a decade the six-coefficient [S2] surface is not identifiable by "
                 "design: its coefficients, CE Gain and TPP describe these points, not [S]'s law")
    return [line]


def degenerate(f):
    """A surface whose loss does not fall with F or with D on its grid (a or c ~ 0): no compute-optimal
    frontier [S3]-[S4], so no CE Gain or TPP from it."""
    return f.a < 1e-3 or f.c < 1e-3


def smelt_noise_lines(rows, out):
    """The baseline's seed spread and the per-pair win counts (overall and per source) -> report lines;
    their numbers go into out["seed_spread"] and out["wins"]."""
    lines = []
    per, pooled = seed_spread(rows, ("cell", "branch_tpp"), "baseline")
    out["seed_spread"] = dict(pooled_std=pooled, groups=[dict(cell=k[0], branch_tpp=k[1], mean=m, std=s, n=n)
                                                         for k, (m, s, n) in per.items()])
    stds = [s for _, s, _ in per.values() if s is not None]
    if stds:
        lines.append(f"seed spread of the baseline ({max(n for *_, n in per.values())} seeds per cell and branch): "
                     f"std {min(stds):.4f}..{max(stds):.4f} nats, pooled {pooled:.4f}")
    wins, pairs = win_counts(rows)
    out["wins"]["all"] = [wins, pairs]
    lines.append(f"per-pair wins (SMELT loss < baseline loss at the same cell, branch and seed): {wins}/{pairs}")
    for s in sources_of_rows(rows):
        w, p = win_counts(rows, key=f"loss_{s}")
        out["wins"][s] = [w, p]
        lines.append(f"  on {s}: {w}/{p}")
    return lines


def smelt_surfaces(runs, lines, out):
    """{arch: fit.SurfaceFit} of the baseline and the SMELT twin [S2]; an architecture whose surface
    cannot be fitted is left out, with a report line and out["fits"][arch]["error"]."""
    fits = {}
    for arch in ("baseline", "smelt"):
        m = runs["arch"].astype(str) == arch
        try:
            fits[arch] = fit.fit_surface(runs["F"][m], runs["S"][m], runs["D"][m], runs["loss"][m])
            out["fits"][arch] = dict(fits[arch].to_dict(), n_points=fits[arch].n_points)
        except ValueError as e:
            lines.append(f"surface fit of {arch} not possible: {e}")
            out["fits"][arch] = {"error": str(e)}
    return fits


def surface_lines(fits, boot, out):
    """The [S2] table of both surfaces, with the cell-bootstrap intervals of a and c (boot: None or
    surface_bootstrap's result) and a note for a degenerate surface -> report lines."""
    interval = lambda key: ((float(boot["lo"][key]), float(boot["hi"][key])) if boot and key in boot["lo"]  # noqa
                            else (None, None))
    lines = ["[S2] surfaces L = E + A (1-S)^b / F^a + K / D^c (Huber on log-loss, fit.py)"
             + (" with 95% cell-bootstrap intervals of a and c" if boot else "")]
    lines.append(f"  {'arch':>9} {'E':>8} {'A':>10} {'a':>7} {'b':>7} {'K':>10} {'c':>7} {'gamma':>7} {'rmse':>8} {'pts':>4}")
    for arch, f in fits.items():
        role = "ref" if arch == "baseline" else "target"
        lines.append(f"  {arch:>9} {f.E:8.4f} {f.A:10.4g} {f.a:7.4f} {f.b:7.4f} {f.K:10.4g} {f.c:7.4f} "
                     f"{f.gamma:7.4f} {f.rmse:8.5f} {f.n_points:4d}")
        for coef in ("a", "c"):
            lo, hi = interval(f"{role}.{coef}")
            out["fits"][arch][f"{coef}_interval"] = [_finite(lo), _finite(hi)]
            if lo is not None:
                excludes = lo > 0
                lines.append(f"      {coef} = {getattr(f, coef):.4f} [{lo:.4f}, {hi:.4f}]"
                             + ("" if excludes else "  <- interval reaches 0: this exponent is not resolved"))
        if degenerate(f):  # [S3]-[S4] need a, c > 0: no compute-optimal frontier otherwise
            which = "F" if f.a < 1e-3 else "D"
            lines.append(f"  note: the {arch} surface is degenerate: on this grid its loss does not fall with "
                         f"{which}, so its frontier, and every CE Gain / TPP that uses it, is undefined")
            out["fits"][arch]["degenerate"] = True
    return lines


def ce_gain_lines(gain, budgets, sparsities, boot, measured_C, out, why=None):
    """[S5] CE Gain of SMELT at every budget x sparsity (gain: that grid, nan where undefined), with its
    cell-bootstrap interval and whether that interval excludes 0 -> report lines; records into
    out["ce_gain"]. An undefined gain is printed as such, with no interval; undefined everywhere, one
    line saying why."""
    note = ""
    if boot:
        note = f" ({boot['n_draws']} cell-bootstrap draws, 95%"
        note += f"; {boot['skipped']} underdetermined draws skipped)" if boot["skipped"] else ")"
    lines = [f"[S5] CE Gain of SMELT over the baseline{note}; > 0: SMELT needs less compute; '~' = the "
             f"interval does not exclude 0 (within noise). Budgets C inside the measured "
             f"{measured_C.min():.3g}..{measured_C.max():.3g} FLOPs"]
    nowhere = not np.isfinite(gain).any()
    if nowhere:
        lines.append(f"  undefined at every budget and sparsity ({why or 'no finite value'}): no gain and no interval")
    for i, C in enumerate(budgets):
        for j, S in enumerate(sparsities):
            lo = hi = None
            if nowhere:
                out["ce_gain"].append(dict(C=C, S=S, value=None, lo=None, hi=None, within_noise=None))
                continue
            if boot and "ce_gain" in boot["lo"] and _finite(gain[i, j]) is not None:
                lo, hi = float(boot["lo"]["ce_gain"][i, j]), float(boot["hi"]["ce_gain"][i, j])
            noise = within_noise(lo, hi, 0.0)
            ci = f"  [{_fmt(lo, '+.3f')}, {_fmt(hi, '+.3f')}]{' ~' if noise else ''}" if lo is not None else ""
            lines.append(f"  C={C:.3g} S={S:.3f}: {_fmt(gain[i, j], '+.4f')}{ci}")
            out["ce_gain"].append(dict(C=C, S=S, value=_finite(gain[i, j]), lo=_finite(lo), hi=_finite(hi),
                                       within_noise=noise))
    return lines


def tpp_lines(fits, CC, SS, budgets, sparsities, boot, out):
    """TPP = D*/(F*/6) of both surfaces on the budget x sparsity grid (CC, SS), with cell-bootstrap
    intervals -> report lines; records into out["tpp"]. A degenerate surface has no TPP: printed as
    undefined, with no interval."""
    lines = ["TPP = D*/(F*/6) at the same budgets"]
    for role, arch in (("ref", "baseline"), ("target", "smelt")):
        values, flat = fit.tpp(fits[arch], CC, SS), degenerate(fits[arch])
        if flat:
            lines.append(f"  {arch:>9}: undefined at every budget and sparsity (its surface is degenerate)")
        for i, C in enumerate(budgets):
            for j, S in enumerate(sparsities):
                lo = hi = None
                if flat:
                    out["tpp"].append(dict(arch=arch, C=C, S=S, value=None, lo=None, hi=None))
                    continue
                if boot and f"{role}.tpp" in boot["lo"] and _finite(values[i, j]) is not None:
                    lo, hi = float(boot["lo"][f"{role}.tpp"][i, j]), float(boot["hi"][f"{role}.tpp"][i, j])
                ci = f"  [{_fmt(lo, '.3g')}, {_fmt(hi, '.3g')}]" if lo is not None else ""
                lines.append(f"  {arch:>9} C={C:.3g} S={S:.3f}: {_fmt(values[i, j], '.4g')}{ci}")
                out["tpp"].append(dict(arch=arch, C=C, S=S, value=_finite(values[i, j]), lo=_finite(lo),
                                       hi=_finite(hi)))
    return lines


def _finite(v):
    """float, or None for a missing / non-finite value (JSON has no inf or nan)."""
    return None if v is None or not np.isfinite(float(v)) else float(v)


def _fmt(v, spec):
    return "undefined" if _finite(v) is None else format(float(v), spec)


# ----------------------------------------------------------------------------------------------------
# [X] ladders


# what a ladder point sets itself (sizes, data, the batch, the run's length and evals, the growth step); the
# recipe's other step counts become fractions of the run (RECIPE_FRACTIONS)
RECIPE_OWN = {"vocab_size", "n_logits", "eot_token", "block_size", "n_layer", "n_embd", "n_head", "head_dim",
              "n_prelude", "n_core", "n_coda", "data_dir", "run_name", "batch_size", "grad_accum", "global_batch",
              "max_steps", "eval_interval", "final_eval_tokens", "grow_at"}
RECIPE_FRACTIONS = ("warmup_steps", "muon_momentum_warmup", "grow_rewarm_steps")


@functools.lru_cache(maxsize=None)
def x_recipe(arch):
    """(model settings, train settings, {step count: fraction of the run}) of an [X] architecture's own
    recipe, read from config/X_RECIPES[arch].py as train.py reads it (once per process; callers only read)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "config", X_RECIPES[arch] + ".py")
    recipe = train.SETTINGS.parse([path])
    given = {k: v for k, v in recipe.items() if k not in RECIPE_OWN}
    fractions = {k: given.pop(k) / recipe["max_steps"] for k in RECIPE_FRACTIONS if k in given}
    model_keys = {f.name for f in fields(ModelConfig)}
    return ({k: v for k, v in given.items() if k in model_keys},
            {k: v for k, v in given.items() if k not in model_keys}, fractions)


def x_config(preset, arch, depth):
    """(ModelConfig at the start of training, grows: bool) of one ladder point."""
    width = preset["width_per_depth"] * depth
    hd = preset["head_dim"]
    if width % hd:
        raise ValueError(f"preset {preset['name']}: width {width} at depth {depth} is not a multiple of head_dim {hd}")
    mult = preset["mlp_multiple"]
    recipe = x_recipe(arch)[0] if preset.get("recipes") else {}
    base = dict(preset["model"], **recipe, n_layer=depth, n_embd=width, n_head=width // hd, head_dim=hd,
                mlp_hidden=mult * math.ceil(8 * width / 3 / mult))
    pcc = dict(layout="pcc", boundary="both")
    shapes = {
        "vanilla": dict(layout="plain"),
        "operator-1": dict(pcc, n_passes=1),
        "loop-2": dict(pcc, n_passes=2, tie_core=True),
        "untied-2": dict(pcc, n_passes=2, tie_core=False),
        "loop-grow": dict(pcc, n_passes=2, tie_core=True),
        "untied-grow": dict(pcc, n_passes=2, tie_core=False),
    }
    if arch not in shapes:
        raise ValueError(f"unknown [X] architecture {arch!r}; choose from {list(shapes)}")
    return ModelConfig.from_dict(dict(base, **shapes[arch])), arch.endswith("-grow")


def x_point(preset, arch, cfg, step_tokens):
    """(steps, train settings) of one ladder point: TPP x N (N compute-active, the cpu-mini v1 rule), or with
    tpp_stored (the [X] rule) TPP_arch x N_s (stored parameters); with recipes the architecture's [X]
    recipe, its step counts scaled to the run, its LRs carried up by [X16] from the first depth."""
    t = dict(preset["train"])
    warmup_fraction = t.pop("warmup_fraction", 0.05)
    if preset.get("tpp_stored"):
        steps = max(4, math.ceil(preset["tpp_stored"][arch] * grow.stored_params(cfg) / step_tokens))
    else:
        steps = max(4, math.ceil(preset["tpp"] * compute_active(cfg) / step_tokens))
    if not preset.get("recipes"):
        return steps, dict(t, warmup_steps=max(1, round(warmup_fraction * steps)))
    _, recipe, fractions = x_recipe(arch)
    settings = dict(recipe, **t, **{k: round(f * steps) for k, f in fractions.items()})
    if preset.get("lr_beta"):
        first, _ = x_config(preset, arch, preset["depths"][0])
        settings.update(lr_anchor_params=grow.stored_params(first), lr_scaling_beta=preset["lr_beta"][arch])
    return steps, settings


def x_lr_settings(preset, arch, key, value):
    """The swept LR and, with recipes, the embedding and lm head LRs at the recipe's ratios to it (a global LR)."""
    if not key:
        return {}
    if not preset.get("recipes"):
        return {key: value}
    _, recipe, _ = x_recipe(arch)
    return {key: value, **{k: float(f"{value * recipe[k] / recipe[key]:.12g}")
                           for k in ("embedding_lr", "unembedding_lr")}}


def growth_plan(preset, cfg, tokens, steps):
    """[X15]: the fraction rho* of tokens after growth (K0 -> grow_to) from the affine law [X9] at this
    run's TPP_K0 = D / N_s,K0 (stored parameters, [X10]) -> (grow step, rho*). The step moves one later
    if it falls on the step the WSD decay starts (a grown model would re-warm into the decay start)."""
    law = grow.AFFINE_LAW["loop_grow" if cfg.tie_core else "untied_grow"]
    e_ratio = grow.compute_active_params(cfg, preset["grow_to"]) / grow.compute_active_params(cfg)
    rho = grow.optimal_growth_fraction(tokens / grow.stored_params(cfg), *law, e_ratio)
    rho = min(max(rho, 0.05), 0.95)
    step = max(1, min(steps - 1, round((1 - rho) * steps)))
    if step == decay_start(preset, steps):
        step += 1
    return step, rho


def decay_start(preset, steps):
    return steps - round(preset["train"].get("decay_fraction", train.DEFAULTS["decay_fraction"]) * steps)


def x_flops_per_token(cfg, grow_to, grow_step, steps):
    """Mean training FLOPs per token over `steps`, growing at grow_step (None: no growth)."""
    if grow_step is None:
        return train.flops_per_token(cfg)
    grown = grow.grown_config(cfg, grow_to)
    return (grow_step * train.flops_per_token(cfg) + (steps - grow_step) * train.flops_per_token(grown)) / steps


def x_specs(preset, data, lrs=None, world=None):
    """Every architecture at every depth trains tpp x its own N tokens ([X]: each ladder at its own budget,
    [X10]). Without lrs: only the first depth, once per swept LR (the sweep); with lrs (arch -> value)
    every depth at that value; the reference runs every seed."""
    step_tokens = tokens_per_step(preset, world)
    key, values = sweep_values(preset)
    sweep_seeds = (preset.get("lr_sweep") or {}).get("seeds", 1)
    specs = []
    for depth in preset["depths"]:
        if lrs is None and depth != preset["depths"][0]:
            break
        for arch in preset["archs"]:
            cfg, grows = x_config(preset, arch, depth)
            n = compute_active(cfg)
            steps, t = x_point(preset, arch, cfg, step_tokens)
            tokens = steps * step_tokens
            settings = dict(t, **model_settings(cfg), max_steps=steps, eval_interval=steps)
            grow_step = rho = None
            if grows:
                grow_step, rho = growth_plan(preset, cfg, tokens, steps)
                rewarm = settings.get("grow_rewarm_steps") or round(preset["rewarm_fraction"] * steps)
                settings.update(grow_at=float(grow_step), grow_to=preset["grow_to"], grow_untie=False,
                                grow_rewarm_steps=max(1, rewarm))
            acc = match.accounting(cfg)
            meta = dict(depth=depth, width=cfg.n_embd, N=n, N_s=acc["params_stored"], tokens=tokens, tpp=tokens / n,
                        F=x_flops_per_token(cfg, preset["grow_to"], grow_step, steps), grow_step=grow_step, rho=rho,
                        decay_start_step=decay_start(preset, steps), executed_layers=acc["executed_layers"],
                        stored_blocks=acc["stored_blocks"])
            seeds = preset["seeds"] if arch == "vanilla" or preset.get("seed_every_arch") else preset["seeds"][:1]
            lr_values = values if lrs is None else [lrs.get(arch) if key else None]
            for value in lr_values:
                for seed in (preset["seeds"][:sweep_seeds] if lrs is None else seeds):
                    lr = x_lr_settings(preset, arch, key, value)
                    run_id = f"{arch}-d{depth}" + (f"-{key}{value:g}" if key else "") + f"-s{seed}"
                    specs.append(RunSpec(run_id, arch, f"d{depth}", "run" if lrs is not None else "sweep",
                                         dict(settings, **lr, seed=seed), dict(meta, seed=seed)))
    return specs


def x_rows(results):
    rows = []
    sources = sources_of([r for r in results if r])
    for r in results:
        if not r:
            continue
        m = r["meta"]
        row = dict(arch=r["arch"], cell=r["cell"], depth=m["depth"], width=m["width"], seed=m["seed"], C=r["flops"],
                   D=r["tokens"], F=m["F"], N=m["N"], N_s=m["N_s"], tpp=r["tokens"] / m["N"], epochs=m.get("epochs"),
                   grow_step=m.get("grow_step"), loss=r["val_loss"], run_id=r["run_id"], seconds=r["seconds"])
        for s in sources:
            row[f"loss_{s}"] = (r.get("val_loss_by_source") or {}).get(s)
        rows.append(row)
    return rows


def power_fits(runs, ref):
    """Shared-E power laws by [X]'s protocol (fit.fit_power_laws): E from the free fit of the reference
    (every seed), then (A, gamma +- its standard error) per architecture with that E fixed [X7]."""
    C0 = float(np.exp(np.mean(np.log(runs[ref][0]))))  # [X]: C0 = 1e18; here the reference's mid budget (A only)
    return fit.fit_power_laws(runs, ref, C0=C0)


def multipliers(runs, fits, ref, ref_C, ref_L):
    """[X6] per architecture at the reference's budgets ref_C (losses ref_L): (interpolated, [X]'s rule
    on the arch's own points, nan outside them; fitted, from the laws; extrapolated, True where the
    fitted one reads the arch's law outside the compute it was measured at)."""
    out = {}
    for a, (C, L) in runs.items():
        if a == ref:
            continue
        measured = fit.compute_multiplier(ref_C, ref_L, C, L)
        target = fits[ref].loss(ref_C)
        reach = fits[a].compute(target)
        fitted = fits[ref].compute(target) / reach
        out[a] = (np.asarray(measured, dtype=float), np.asarray(fitted, dtype=float),
                  (reach < np.min(C)) | (reach > np.max(C)))
    return out


def depth_means(points):
    """(C, L) of an architecture's points (C, L, depth), one mean per depth: an interpolated multiplier
    reads a seed-averaged curve (two seeds at one compute would otherwise make a crossing of their own)."""
    depths = sorted({d for *_, d in points})
    return (np.array([np.mean([c for c, _, dd in points if dd == d]) for d in depths]),
            np.array([np.mean([l for _, l, dd in points if dd == d]) for d in depths]))


def multiplier_bootstrap(points, ref, sigma, n_draws=400, seed=0):
    """95% bands of the multipliers from the measured noise: each draw resamples the reference's seeds
    at every depth (with replacement); another architecture's seeds are resampled alike where it has
    several at a depth, otherwise its loss moves by N(0, sigma^2) (sigma: the reference's pooled seed
    spread); then it refits and recomputes both multipliers (from the per-depth means) at the reference's
    mean budgets. Returns (budgets, {arch: {"measured": (lo, hi), "fitted": (lo, hi)}})."""
    rng = np.random.default_rng(seed)
    ref_by_depth = {}
    for C, L, depth in points[ref]:
        ref_by_depth.setdefault(depth, []).append((C, L))
    depths = sorted(ref_by_depth)
    ref_C = np.array([np.mean([c for c, _ in ref_by_depth[d]]) for d in depths])
    draws = {a: ([], []) for a in points if a != ref}
    for _ in range(n_draws):  # the reference: its seeds resampled with replacement at every depth
        chosen = {d: [reps[i] for i in rng.integers(len(reps), size=len(reps))] for d, reps in ref_by_depth.items()}
        runs = {ref: (np.array([c for d in depths for c, _ in chosen[d]]),
                      np.array([l for d in depths for _, l in chosen[d]]))}
        drawn = {ref: [(c, l, d) for d in depths for c, l in chosen[d]]}
        for a, pts in points.items():
            if a == ref:
                continue
            if len({d for *_, d in pts}) == len(pts):  # one seed per depth: moved by the reference's spread
                runs[a] = (np.array([c for c, _, _ in pts]), np.array([l for _, l, _ in pts]) +
                           sigma * rng.standard_normal(len(pts)))
                drawn[a] = list(zip(runs[a][0], runs[a][1], [d for *_, d in pts]))
            else:  # its own seeds resampled at every depth
                drawn[a] = [p for d in sorted({d for *_, d in pts}) for reps in [[q for q in pts if q[2] == d]]
                            for p in (reps[i] for i in rng.integers(len(reps), size=len(reps)))]
                runs[a] = (np.array([c for c, _, _ in drawn[a]]), np.array([l for _, l, _ in drawn[a]]))
        try:
            fits = power_fits(runs, ref)
        except ValueError:
            continue
        ref_L = np.array([np.mean([l for _, l in chosen[d]]) for d in depths])
        means = {a: depth_means(p) for a, p in drawn.items()}
        for a, (measured, fitted, _) in multipliers(means, fits, ref, ref_C, ref_L).items():
            draws[a][0].append(measured)
            draws[a][1].append(fitted)
    bands = {}
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an all-nan column (no interpolation possible) stays nan
        for a, (measured, fitted) in draws.items():
            bands[a] = {name: tuple(np.nanpercentile(np.array(d), [2.5, 97.5], axis=0)) if d else None
                        for name, d in (("measured", measured), ("fitted", fitted))}
    return ref_C, bands


def x_report(preset, rows, sweep=None, ref="vanilla", n_boot=400, lrs=None):
    """LR sweep, final losses at equal depth with the compute each architecture spent there, seed spread,
    shared-E power laws [X5]-[X7] and compute multipliers [X6] with seed-bootstrap bands -> (text, dict,
    figure data). lrs: {arch: the swept value carried up}, for the line on what carrying it up confounds."""
    budget = (f"TPP {preset['tpp']:g} per compute-active non-embedding parameter for every architecture"
              if not preset.get("tpp_stored") else "each architecture's [X] TPP per stored parameter ("
              + ", ".join(f"{a} {preset['tpp_stored'][a]:g}" for a in preset["archs"]) + ")")
    lines = [f"== {preset['name']}: [X] ladders at width {preset['width_per_depth']} x depth, {budget}"]
    out = {"preset": preset["name"], "fits": {}, "multipliers": {}, "seed_spread": {}, "points": rows}
    archs = list(dict.fromkeys(r["arch"] for r in rows))
    depths = sorted({r["depth"] for r in rows})
    if sweep:
        lines += sweep[0]
        out["lr_sweep"] = sweep[1]
        lines += lr_confound_lines(preset, archs, lrs or {}, ref)
    if not rows:
        lines.append("no finished runs yet")
        return "\n".join(lines), out, None
    per, pooled = seed_spread(rows, ("depth",), ref)
    out["seed_spread"] = dict(pooled_std=pooled, per_depth={str(k[0]): dict(mean=m, std=s, n=n)
                                                              for k, (m, s, n) in per.items()})
    lines.append("final validation loss (rows: architecture; columns: depth; the reference: mean over seeds)")
    lines.append(f"  {'':>12} " + " ".join(f"{f'd{d}':>9}" for d in depths))
    for a in archs:
        cells = []
        for d in depths:
            losses = [r["loss"] for r in rows if r["arch"] == a and r["depth"] == d]
            cells.append(f"{np.mean(losses):9.4f}" if losses else f"{'-':>9}")
        lines.append(f"  {a:>12} " + " ".join(cells))
    C_row = [np.mean([r["C"] for r in rows if r["arch"] == a and r["depth"] == d] or [np.nan]) for a in archs
             for d in depths]
    lines.append(f"  training FLOPs range {np.nanmin(C_row):.3g}..{np.nanmax(C_row):.3g}; epochs read "
                 f"{min(r['epochs'] or 0 for r in rows):.2f}..{max(r['epochs'] or 0 for r in rows):.2f}")
    lines += equal_depth_lines(rows, archs, depths, ref)
    if pooled is not None:
        stds = ", ".join(f"d{k[0]} {s:.4f}" for k, (_, s, _) in sorted(per.items()) if s is not None)
        lines.append(f"seed spread of {ref} ({max(n for *_, n in per.values())} seeds): std {stds}; pooled "
                     f"{pooled:.4f} nats")
    points = {a: [(r["C"], r["loss"], r["depth"]) for r in rows if r["arch"] == a] for a in archs}
    runs = {a: (np.array([c for c, _, _ in p]), np.array([l for _, l, _ in p])) for a, p in points.items()}
    if ref not in runs or len({d for *_, d in points[ref]}) < 3:
        lines.append(f"[X7] needs {ref} at 3 depths or more: nothing to fit yet")
        return "\n".join(lines), out, None
    try:
        fits = power_fits(runs, ref)
    except ValueError as e:
        lines.append(f"[X7] power laws cannot be fitted: {e}")
        return "\n".join(lines), out, None
    lines.append(f"[X7] E = {fits[ref].E:.4f} ([X]'s free fit on {ref}, every seed), C0 = {fits[ref].C0:.3g}; "
                 "L = E + A (C/C0)^-gamma per arch with E fixed, gamma +- its standard error")
    for a, f in fits.items():
        lines.append(f"  {a:>12}: A={f.A:.4f} gamma={f.gamma:.4f} +- {f.gamma_se:.4f}")
        out["fits"][a] = f.to_dict()
    ref_C, bands = multiplier_bootstrap(points, ref, pooled or 0.0, n_draws=n_boot if pooled else 0,
                                        seed=preset.get("seed", 0))
    ref_L = depth_means(points[ref])[1]
    mult = multipliers({a: depth_means(p) for a, p in points.items()}, fits, ref, ref_C, ref_L)
    lines += multiplier_lines(mult, bands, ref, ref_C, out, show_fitted=preset.get("multipliers") != "interpolated")
    figures = dict(runs=runs, fits=fits, ref_C=ref_C, mult=mult, bands=bands)
    return "\n".join(lines), out, figures


def lr_confound_lines(preset, archs, lrs, ref):
    """What carrying each architecture's swept LR up the ladder confounds -> report lines."""
    key = (preset.get("lr_sweep") or {}).get("key")
    if not key or not lrs:
        return []
    if preset.get("lr_beta"):
        first = preset["depths"][0]
        return [f"  each LR is the mean-best over {preset['lr_sweep'].get('seeds', 1)} seeds at d{first}, carried up "
                f"by [X16] LR x (N_s / N_s,d{first})^beta with each architecture's [X] beta: "
                + ", ".join(f"{a} {lrs[a]:g} (beta {preset['lr_beta'][a]:g})" for a in archs if a in lrs)]
    others = [a for a in archs if a != ref]
    return [f"  every LR is tuned at d{preset['depths'][0]} only and carried up unchanged (no [X16] rule): "
            + ", ".join(f"{a} {lrs[a]:g}" for a in archs if a in lrs)
            + f"; above d{preset['depths'][0]} a difference from {ref} includes how well that LR transfers, for all "
            f"{len(others)} other architectures"]


def equal_depth_lines(rows, archs, depths, ref):
    """The loss table compares equal depth, not equal compute: each architecture's training tokens and
    FLOPs at a depth relative to the reference's there -> report lines."""
    def mean(a, d, key):
        values = [r[key] for r in rows if r["arch"] == a and r["depth"] == d]
        return float(np.mean(values)) if values else float("nan")
    lines = [f"equal depth (the same stored blocks) is not equal compute: training tokens / FLOPs relative to {ref} "
             "at the same depth",
             f"  {'':>12} " + " ".join(f"{f'd{d}':>9}" for d in depths)]
    for a in archs:
        if a == ref:
            continue
        cells = []
        for d in depths:
            tokens, flops = mean(a, d, "D") / mean(ref, d, "D"), mean(a, d, "C") / mean(ref, d, "C")
            cells.append(f"{tokens:.2f}/{flops:.2f}" if np.isfinite(tokens) and np.isfinite(flops) else "-")
        lines.append(f"  {a:>12} " + " ".join(f"{c:>9}" for c in cells))
    return lines


def multiplier_lines(mult, bands, ref, ref_C, out, show_fitted=True):
    """[X6] interpolated (what [X] quotes) and (show_fitted) fitted multipliers with their seed-bootstrap
    bands, the fitted ones marked where extrapolated -> report lines; records into out["multipliers"]."""
    lines = [f"[X6] compute multipliers vs {ref} at its budgets (its mean loss at each depth) [95% seed-bootstrap "
             "band]; '~' = the band includes 1 (within noise)",
             "  interpolated ([X]'s rule and the numbers [X] quotes): the arch's own points, log compute linear in "
             f"loss; '-' = {ref}'s loss there is outside the arch's measured losses (never extrapolated)"]
    if show_fitted:
        lines.append("  fitted: from the shared-E laws; 'x' = extrapolated (the arch's law read outside the compute it "
                     "was measured at)")
    lines.append(f"  {'':>12} {'':>12} " + " ".join(f"{c:>19.3g}" for c in ref_C))
    for a, (measured, fitted, extrapolated) in mult.items():
        band = bands.get(a) or {}
        records = []
        for i, c in enumerate(ref_C):
            (mlo, mhi), (lo, hi) = (_band(band.get(name), i) for name in ("measured", "fitted"))
            records.append(dict(C=float(c), measured=_finite(measured[i]), fitted=_finite(fitted[i]),
                                fitted_lo=_finite(lo), fitted_hi=_finite(hi), measured_lo=_finite(mlo),
                                measured_hi=_finite(mhi), within_noise=within_noise(lo, hi, 1.0),
                                measured_within_noise=within_noise(mlo, mhi, 1.0) if _finite(measured[i]) else None,
                                extrapolated=bool(extrapolated[i])))
        kinds = (("interpolated", "measured", None), ("fitted", "fitted", extrapolated))
        for name, key, mark in kinds[:2 if show_fitted else 1]:
            cells = []
            for i, r in enumerate(records):
                value, lo, hi = r[key], r[f"{key}_lo"], r[f"{key}_hi"]
                if value is None:
                    cells.append("-")
                    continue
                noise = within_noise(lo, hi, 1.0)
                cells.append(f"{value:.3f}{'x' if mark is not None and mark[i] else ' '} "
                             f"[{_fmt(lo, '.2f')},{_fmt(hi, '.2f')}]{'~' if noise else ' '}")
            lines.append(f"  {a if name == 'interpolated' else '':>12} {name:>12} " + " ".join(f"{c:>19}" for c in cells))
        out["multipliers"][a] = records
    return lines


def _band(band, i):
    """(lo, hi) of a bootstrap band at budget i, (None, None) without one."""
    return (float(band[0][i]), float(band[1][i])) if band is not None else (None, None)


# ----------------------------------------------------------------------------------------------------
# [X] data-constrained ladders (kind "repeat"): U unique tokens read for `epochs` epochs by every run


def repeat_config(preset, passes, depth):
    """The Operator-1 family at one stored depth: Operator-1 (K = 1) or Loop-K (its core run K times, tied)."""
    cfg, _ = x_config(preset, "operator-1", depth)
    return ModelConfig.from_dict(dict(model_settings(cfg), n_passes=passes))


def repeat_spec(preset, data, passes, depth, wd, lr, seed, role, world=None):
    """One run: `epochs` x unique_tokens tokens (whole steps), weight decay wd on every matrix, the
    embedding and the lm head ([X] code); the global LR lr at the first depth, carried to the others by
    [X16] with the preset's beta (N = stored parameters, the first depth's as anchor)."""
    cfg = repeat_config(preset, passes, depth)
    step_tokens = tokens_per_step(preset, world)
    steps = max(4, math.ceil(preset["epochs"] * preset["unique_tokens"] / step_tokens))
    sweep = preset["lr_sweep"]
    anchor = grow.stored_params(repeat_config(preset, 1, preset["depths"][0]))
    settings = dict(preset["train"], **model_settings(cfg), max_steps=steps, eval_interval=steps, seed=seed,
                    unique_tokens=preset["unique_tokens"], weight_decay=wd, embedding_weight_decay=wd,
                    unembedding_weight_decay=wd, lr_anchor_params=anchor, lr_scaling_beta=preset["lr_scaling_beta"],
                    **{sweep["key"]: lr}, **{k: float(f"{lr * r:.12g}") for k, r in sweep.get("tied", {}).items()})
    acc = match.accounting(cfg)
    n_s = acc["params_stored"]
    meta = dict(depth=depth, width=cfg.n_embd, passes=passes, wd=wd, lr=lr, seed=seed, N=compute_active(cfg), N_s=n_s,
                executed_layers=acc["executed_layers"], tokens=steps * step_tokens, F=train.flops_per_token(cfg),
                lr_scaled=lr * train.lr_scaling(n_s, anchor, preset["lr_scaling_beta"]),
                epochs=steps * step_tokens / preset["unique_tokens"])
    run_id = f"k{passes}-d{depth}-wd{wd:g}-{sweep['key']}{lr:g}-s{seed}"
    return RunSpec(run_id, f"k{passes}", f"d{depth}", role, settings, meta)


def repeat_specs(preset, data, lrs=None, world=None):
    """Without lrs: the LR sweep (K = 1 at the first depth, the sweep's weight decay, each value); with
    lrs ({"k1": value}): the grid, every K x depth x weight decay, first seed."""
    seed = preset["seeds"][0]
    if lrs is None:
        key, values = sweep_values(preset)
        return [repeat_spec(preset, data, 1, preset["depths"][0], preset["lr_sweep"]["weight_decay"], v, seed, "sweep",
                            world) for v in values]
    return [repeat_spec(preset, data, k, d, wd, lrs["k1"], seed, "run", world)
            for k in preset["passes"] for d in preset["depths"] for wd in preset["weight_decays"]]


def repeat_grid(preset, data, lrs, results, world=None):
    """The grid and its weight-decay extensions: while a (K, depth)'s best first-seed weight decay is at an
    edge of the values it tried, the next value beyond that edge (the grid's ratio) runs too, at most
    wd_extend (2) steps beyond the grid on either side -> (specs, complete: every run finished and no
    extension pending)."""
    specs = repeat_specs(preset, data, lrs, world)
    wds = preset["weight_decays"]
    ratio, limit = wds[1] / wds[0], preset.get("wd_extend", 2)
    while True:
        extra, pending = [], False
        for k in preset["passes"]:
            for d in preset["depths"]:
                points = [s for s in specs if s.meta["passes"] == k and s.meta["depth"] == d]
                if any(results.get(s.run_id) is None for s in points):
                    pending = True
                    continue
                tried = sorted(s.meta["wd"] for s in points)
                best = min(points, key=lambda s: results[s.run_id]["val_loss"]).meta["wd"]
                if best == tried[0] and best > wds[0] / ratio ** (limit - 0.5):
                    value = best / ratio
                elif best == tried[-1] and best < wds[-1] * ratio ** (limit - 0.5):
                    value = best * ratio
                else:
                    continue
                extra.append(repeat_spec(preset, data, k, d, float(f"{value:.12g}"), lrs["k1"], preset["seeds"][0],
                                         "run", world))
        specs += extra
        if pending or any(results.get(s.run_id) is None for s in extra):
            return specs, False
        if not extra:
            return specs, True


def repeat_seed_specs(preset, data, lrs, results, world=None):
    """Every seed but the first, for each K in seeded_passes at every depth, at the weight decay that K's
    first-seed runs found best there (None while those runs or an extension are missing). results=None:
    the plan, at the middle weight decay (a run's budget does not depend on it)."""
    if results is None:
        grid = repeat_specs(preset, data, lrs, world)
    else:
        grid, complete = repeat_grid(preset, data, lrs, results, world)
        if not complete:
            return None
    specs = []
    for k in preset["seeded_passes"]:
        for d in preset["depths"]:
            points = [s for s in grid if s.meta["passes"] == k and s.meta["depth"] == d]
            if results is None:
                wd = preset["weight_decays"][len(preset["weight_decays"]) // 2]
            elif any(results.get(s.run_id) is None for s in points):
                return None
            else:
                wd = min(points, key=lambda s: results[s.run_id]["val_loss"]).meta["wd"]
            specs += [repeat_spec(preset, data, k, d, wd, lrs["k1"], seed, "seed", world)
                      for seed in preset["seeds"][1:]]
    return specs


def repeat_rows(results, roles):
    """runs.csv rows of a repeat ladder (roles: {run_id: the role the ladder gives it})."""
    rows = []
    for r in results:
        m = r["meta"]
        rows.append(dict(K=m["passes"], depth=m["depth"], width=m["width"], wd=m["wd"], seed=m["seed"],
                         role=roles.get(r["run_id"], r["role"]), C=r["flops"], D=r["tokens"], F=m["F"], N=m["N"],
                         N_s=m["N_s"], executed=m["executed_layers"], epochs=m["epochs"], lr=m["lr_scaled"],
                         loss=r["val_loss"], train_loss=r.get("final_train_loss"), run_id=r["run_id"],
                         seconds=r["seconds"]))
    return rows


def interpolated_optimum(xs, losses):
    """(x*, edge): the minimiser of a parabola in log x through the best grid point and its two
    neighbours (the grid point itself when it is at an edge of the grid: edge -1 / +1, else 0)."""
    order = np.argsort(xs)
    grid = np.asarray(xs, dtype=float)[order]
    x, y = np.log(grid), np.asarray(losses, dtype=float)[order]
    i = int(np.argmin(y))
    if i in (0, len(x) - 1):
        return float(grid[i]), (-1 if i == 0 else 1) if len(x) > 1 else 0
    a, b, _ = np.polyfit(x[i - 1:i + 2], y[i - 1:i + 2], 2)
    return float(np.exp(-b / (2 * a))), 0


def envelope(points, budget):
    """The best loss a family reaches with at most `budget` FLOPs: its points (C, L) (one per stored
    size), log-C linear between neighbouring sizes; inf below its smallest compute."""
    C, L = (np.array(v, dtype=float) for v in zip(*sorted(points)))
    best = np.min(L[C <= budget * (1 + 1e-9)], initial=np.inf)
    if C[0] <= budget <= C[-1] and len(C) > 1:
        best = min(best, float(np.interp(np.log(budget), np.log(C), L)))
    return best


def reach_compute(points, target):
    """The least compute at which a family's envelope reaches loss <= target: its smallest size's when that
    is already there, else [X6]'s crossing (fit.compute_multiplier: log C linear between neighbouring
    sizes, never extrapolated), nan when it never does."""
    C, L = (np.array(v, dtype=float) for v in zip(*sorted(points)))
    if L[0] <= target:
        return float(C[0])
    return float(1.0 / fit.compute_multiplier([1.0], [target], C, L)[0])


def repeat_analysis(frontier, budgets):
    """frontier: {K: [(C, L)] at the best weight decay of each stored size} -> (best K per budget,
    L* and C* of K = 1's best point, the least compute at which a K >= 2 family reaches L*)."""
    best = []
    for b in budgets:
        env = {k: envelope(p, b) for k, p in frontier.items()}
        k = min(env, key=env.get)
        best.append(k if np.isfinite(env[k]) else None)
    c_star, l_star = min(frontier[1], key=lambda p: p[1])
    reach = [reach_compute(p, l_star) for k, p in frontier.items() if k > 1]
    reach = [r for r in reach if np.isfinite(r)]
    return best, l_star, c_star, (min(reach) if reach else float("nan"))


def wd_regression(cells):
    """log WD* = a + b log N_s + c log executed layers over (N_s, executed, WD*) cells -> (b, c, their
    standard errors), None when the cells cannot separate the two (fewer than 4, or collinear)."""
    if len(cells) < 4:
        return None
    X = np.array([[1.0, np.log(n), np.log(e)] for n, e, _ in cells])
    y = np.log([w for *_, w in cells])
    coef, _, rank, _ = np.linalg.lstsq(X, y, rcond=None)
    if rank < 3:
        return None
    dof = len(y) - 3
    resid = y - X @ coef
    s2 = float(resid @ resid) / dof if dof > 0 else float("nan")
    se = np.sqrt(np.diag(s2 * np.linalg.inv(X.T @ X)))
    return float(coef[1]), float(coef[2]), float(se[1]), float(se[2])


def repeat_report(preset, rows, sweep=None, n_boot=400, seed=0):
    """The data-constrained ladder's report -> (text, dict, figure data): the weight-decay grid, each K's
    frontier at its best weight decay per stored size (seed means and spread), the best K per budget and
    whether it grows with compute, the compute at which looping reaches the best WD-tuned K = 1 loss, and
    whether the best weight decay follows stored parameters or executed depth; bands from a seed bootstrap."""
    U, epochs = preset["unique_tokens"], preset["epochs"]
    lines = [f"== {preset['name']}: [X] data-constrained: {U:,} unique tokens x {epochs} epochs per run, the "
             f"Operator-1 family (K = passes of a tied core) at width {preset['width_per_depth']} x stored depth"]
    out = {"preset": preset["name"], "points": rows}
    if sweep:
        lines += sweep[0]
        out["lr_sweep"] = sweep[1]
        lines.append(f"  the carried LR scales by [X16] with beta {preset['lr_scaling_beta']:g} (the [X] code's "
                     f"Operator-1 ladder) from d{preset['depths'][0]}; embedding / lm head LRs keep [X]'s ratios to it")
    first = [r for r in rows if r["role"] != "seed" and r["seed"] == preset["seeds"][0]]
    if not first:
        lines.append("no finished runs yet")
        return "\n".join(lines), out, None
    Ks, depths = sorted({r["K"] for r in first}), sorted({r["depth"] for r in first})
    wds = sorted({r["wd"] for r in first})
    C = [r["C"] for r in rows]
    lines.append(f"epochs read {min(r['epochs'] for r in rows):.2f}..{max(r['epochs'] for r in rows):.2f}; tokens per "
                 f"run {rows[0]['D']:,}; training FLOPs {min(C):.3g}..{max(C):.3g}")
    grid = {(r["K"], r["depth"], r["wd"]): r for r in first}
    table, best_wd, wd_star = repeat_wd_table(grid, Ks, depths, wds)
    lines += table
    pts = {}  # each K's frontier: its best weight decay at every stored size, every seed of that point
    for (k, d), w in best_wd.items():
        reps = [r for r in rows if r["K"] == k and r["depth"] == d and r["wd"] == w]
        pts[k, d] = (float(np.mean([r["C"] for r in reps])), [r["loss"] for r in reps])
    spreads = [(len(v), np.std(v, ddof=1)) for _, v in pts.values() if len(v) > 1]
    dof = sum(n - 1 for n, _ in spreads)
    sigma = float(np.sqrt(sum((n - 1) * s ** 2 for n, s in spreads) / dof)) if spreads else 0.0
    out["seed_spread"] = dict(pooled_std=sigma, points=len(spreads))
    lines.append(f"frontier: each K at its best weight decay per stored depth (mean over seeds; n = seeds); pooled "
                 f"seed std {sigma:.4f} nats over {len(spreads)} points with several seeds")
    lines.append(f"  {'K':>2} " + " ".join(f"{f'd{d} C':>9} {'loss':>6} {'n':>1}" for d in depths))
    for k in Ks:
        cells = [f"{pts[k, d][0]:9.3g} {np.mean(pts[k, d][1]):6.4f} {len(pts[k, d][1])}" if (k, d) in pts
                 else f"{'-':>18}" for d in depths]
        lines.append(f"  {k:>2} " + " ".join(cells))
    frontier = {k: [(pts[k, d][0], float(np.mean(pts[k, d][1]))) for d in depths if (k, d) in pts] for k in Ks}
    out["frontier"] = {str(k): v for k, v in frontier.items()}
    if 1 not in frontier or len(frontier) < 2:
        lines.append("the comparison needs K = 1 and another K: nothing to compare yet")
        return "\n".join(lines), out, None
    lines += repeat_budget_lines(frontier, pts, sigma, n_boot, seed, out)
    lines += repeat_wd_lines(grid, best_wd, wd_star, Ks, depths, out)
    figures = dict(frontier=frontier, pts=pts, l_star=out["L_star"], grid=grid, Ks=Ks, depths=depths, wds=wds)
    return "\n".join(lines), out, figures


def repeat_wd_table(grid, Ks, depths, wds):
    """The weight-decay grid's lines (first seed) -> (lines, {(K, depth): best WD}, {(K, depth): (WD*, edge)})."""
    lines = ["validation loss, first seed, by weight decay (* = the best at that K and stored depth; WD* = the "
             "parabola's minimum in log WD, '<' / '>' = at the edge of what it tried)",
             f"  {'K':>2} {'depth':>5} {'N_s':>8} {'exec':>4} " + " ".join(f"{f'wd {w:g}':>9}" for w in wds)
             + f" {'WD*':>8} {'train':>7} {'gap':>7}"]
    best_wd, wd_star = {}, {}
    for k in Ks:
        for d in depths:
            cells = [grid.get((k, d, w)) for w in wds]
            have = [(w, c["loss"]) for w, c in zip(wds, cells) if c]
            if not have:
                continue
            bw = best_wd[k, d] = min(have, key=lambda p: p[1])[0]
            x, edge = wd_star[k, d] = interpolated_optimum(*zip(*have))
            ref = grid[k, d, bw]
            train_loss = ref["train_loss"] if ref.get("train_loss") is not None else float("nan")
            lines.append(f"  {k:>2} {d:>5} {ref['N_s']:>8,} {ref['executed']:>4} " +
                         " ".join(f"{c['loss']:8.4f}{'*' if c['wd'] == bw else ' '}" if c else f"{'-':>9}"
                                  for c in cells)
                         + f" {('<' if edge < 0 else '>' if edge > 0 else '') + format(x, '.3g'):>8} "
                           f"{train_loss:7.4f} {ref['loss'] - train_loss:7.4f}")
    lines.append("  train = the mean training loss of the run's last tenth (on the repeated data), gap = val - train "
                 "(> 0: the run fits its unique tokens better than fresh text)")
    return lines, best_wd, wd_star


def repeat_budget_lines(frontier, pts, sigma, n_boot, seed, out):
    """The best K per budget, whether it grows, and the compute at which K >= 2 reaches K = 1's best loss,
    with a seed bootstrap (every point with several seeds resampled; the others moved by N(0, sigma^2))."""
    allC = [c for p in frontier.values() for c, _ in p]
    budgets = np.geomspace(min(allC), max(allC), 9)
    best, l_star, c_star, reach = repeat_analysis(frontier, budgets)
    rng = np.random.default_rng(seed)
    draws_best, draws_ratio, draws_frontier = [], [], []
    for _ in range(n_boot):
        f = {}
        for (k, d), (c, losses) in sorted(pts.items()):
            v = np.asarray(losses)
            mean = float(np.mean(v[rng.integers(len(v), size=len(v))])) if len(v) > 1 else \
                float(v[0] + sigma * rng.standard_normal())
            f.setdefault(k, []).append((c, mean))
        b, _, cs, re = repeat_analysis(f, budgets)
        draws_frontier.append(f)
        draws_best.append(b)
        draws_ratio.append(cs / re)
    share = [float(np.mean([db[i] == best[i] for db in draws_best])) if n_boot else float("nan")
             for i in range(len(budgets))]
    lines = ["best K per training budget (the lowest loss any size of that K reaches with at most that compute; "
             f"agree = share of {n_boot} seed-bootstrap draws with the same best K)",
             "  budget  " + " ".join(f"{b:>8.3g}" for b in budgets),
             "  best K  " + " ".join(f"{'-' if k is None else k:>8}" for k in best),
             "  agree   " + " ".join(f"{s:>8.2f}" for s in share)]
    # from the smallest budget at which two K are affordable (below it K = 1 wins by being the only one)
    start = next((i for i, b in enumerate(budgets) if sum(np.isfinite(envelope(p, b)) for p in frontier.values()) > 1),
                 len(budgets) - 1)
    grows = best[-1] > best[start]
    grow_share = float(np.mean([db[-1] > db[start] for db in draws_best])) if n_boot else float("nan")
    lines.append(f"  the best K {'grows' if grows else 'does not grow'} with compute: {best[start]} at "
                 f"{budgets[start]:.3g} (the smallest budget at which two K are affordable), {best[-1]} at the largest (it grows in "
                 f"{grow_share:.2f} of the draws)")
    lowest = {k: min(L for _, L in p) for k, p in frontier.items()}
    draws_low = {k: [min(L for _, L in draw[k]) for draw in draws_frontier]
                 for k in frontier}
    lines.append("  the lowest loss each K reaches (its best stored size) [95% band]: " + ", ".join(
        f"K={k} {v:.4f} [{_fmt(np.percentile(draws_low[k], 2.5) if n_boot else None, '.4f')}, "
        f"{_fmt(np.percentile(draws_low[k], 97.5) if n_boot else None, '.4f')}]" for k, v in lowest.items()))
    out["lowest_loss"] = {str(k): v for k, v in lowest.items()}
    ratio = c_star / reach
    lo, hi = (np.nanpercentile(draws_ratio, [2.5, 97.5]) if n_boot and np.isfinite(draws_ratio).any()
              else (float("nan"), float("nan")))
    reached = float(np.mean(np.isfinite(draws_ratio))) if n_boot else float("nan")
    first_point = any(reach == min(c for c, _ in p) for k, p in frontier.items() if k > 1)
    lines.append(f"best WD-tuned K = 1 loss L* = {l_star:.4f} at C* = {c_star:.3g}; looping (K >= 2, WD-tuned per "
                 "size) "
                 + (f"reaches it at C = {reach:.3g}{' (its smallest size: an upper bound)' if first_point else ''}: "
                    f"C* / C = {ratio:.2f} [95% band {_fmt(lo, '.2f')}, {_fmt(hi, '.2f')}; reached in {reached:.2f} of "
                    "the draws] (> 1: looping needs less compute; [X]: 2.2)"
                    if np.isfinite(reach) else "never reaches it in the measured range"))
    out.update(budgets=budgets, best_K=best, best_K_agree=share, best_K_grows=grows, best_K_grows_share=grow_share,
               L_star=l_star, C_star=c_star, loop_reach_C=reach, loop_compute_ratio=ratio, loop_ratio_band=[lo, hi])
    return lines


def repeat_wd_lines(grid, best_wd, wd_star, Ks, depths, out):
    """Does the best weight decay follow stored parameters or executed depth? The regression over the points
    whose optimum is inside what they tried, and WD* per K and depth."""
    inside = [(grid[k, d, best_wd[k, d]]["N_s"], grid[k, d, best_wd[k, d]]["executed"], wd_star[k, d][0])
              for k, d in wd_star if wd_star[k, d][1] == 0]
    reg = wd_regression(inside)
    lines = [f"best weight decay: log WD* = a + b log N_s + c log executed layers over the {len(inside)} (K, depth) "
             f"points whose optimum is inside what they tried ({len(wd_star) - len(inside)} at an edge left out)"]
    if reg is None:
        lines.append("  too few points inside the grid (or stored and executed depth not separable): undecided")
    else:
        b, c, sb, sc = reg
        lines.append(f"  b (stored) = {b:.2f} +- {sb:.2f}, c (executed) = {c:.2f} +- {sc:.2f} ([X]: WD* follows stored "
                     "parameters: b > 0, c ~ 0)")
        out["wd_regression"] = dict(b_stored=b, c_executed=c, b_se=sb, c_se=sc, points=len(inside))
    mark = lambda e: "<" if e < 0 else ">" if e > 0 else ""  # noqa: E731
    lines.append("  WD* by K (rows) and stored depth (columns): " + "; ".join(
        f"K={k}: " + " ".join(f"{mark(wd_star[k, d][1])}{wd_star[k, d][0]:.3g}" if (k, d) in wd_star else "-"
                              for d in depths) for k in Ks))
    out["wd_star"] = {f"K{k}-d{d}": dict(wd=v[0], edge=v[1]) for (k, d), v in wd_star.items()}
    return lines


# ----------------------------------------------------------------------------------------------------
# The plan, the whole ladder


def build(preset, data=None, lrs=None, world=None):
    """(specs, cells or None) of a preset. lrs: {arch: swept value} once the sweep has finished; without
    them the specs are the sweep runs only (a preset without a sweep: everything at once)."""
    data = data or data_plan(preset, prepare=False)
    if preset.get("lr_sweep") is None:
        lrs = {}
    if preset["kind"] == "smelt":
        cells = smelt_cells(preset)
        specs = smelt_specs(preset, cells, data, lrs, world)
    elif preset["kind"] in ("x", "repeat"):
        cells = None
        specs = (x_specs if preset["kind"] == "x" else repeat_specs)(preset, data, lrs, world)
    else:
        raise ValueError(f"preset {preset['name']}: unknown kind {preset['kind']!r}")
    for s in specs:  # epochs of the stable region read (a branch: by its stable part; its decay reads < 1)
        if data.stable_tokens and "epochs" not in s.meta:  # (a repeat ladder's runs: epochs of their unique tokens)
            read = s.meta["branch_step"] * tokens_per_step(preset, world) if s.role == "branch" else s.meta["tokens"]
            s.meta["epochs"] = read / data.stable_tokens
    return specs, cells


def full_plan(preset, data=None, world=None):
    """Every run of a preset, sweep included, with a placeholder value for the swept LR (the budgets,
    tokens and FLOPs do not depend on it)."""
    data = data or data_plan(preset, prepare=False)
    sweep, cells = build(preset, data, world=world)
    if preset.get("lr_sweep") is None:
        return sweep, cells
    key, values = sweep_values(preset)
    archs = {"x": preset.get("archs"), "smelt": ("baseline", "smelt")}.get(preset["kind"], ("k1",))
    lrs = {a: values[len(values) // 2] for a in archs}
    rest, _ = build(preset, data, lrs=lrs, world=world)
    if preset["kind"] == "repeat":  # the extra seeds at the middle weight decay (their budget does not depend on it)
        rest += repeat_seed_specs(preset, data, lrs, None, world)
    ids = {s.run_id for s in sweep}
    return sweep + [s for s in rest if s.run_id not in ids], cells


def plan_records(preset, specs, world=None):
    """One record per run: what --list --json prints (tpp = tokens per compute-active non-embedding
    parameter; grow_step null for runs that do not grow)."""
    step_tokens = tokens_per_step(preset, world)
    records = []
    for s in specs:
        n, tokens = s.meta.get("N"), s.meta.get("tokens")
        steps = s.settings.get("max_steps")
        if s.role == "branch":
            decay_start_step, steps = s.meta["branch_step"], None
        elif s.role == "stable":
            decay_start_step = None  # a stable phase never decays (its branches do)
        else:
            decay_start_step = steps - round(s.settings.get("decay_fraction", 0.0) * steps)
        records.append(dict(run_id=s.run_id, arch=s.arch, role=s.role, cell=s.cell, params_nonembedding=n,
                            params_stored=s.meta.get("N_s"), tokens=tokens,
                            flops=s.meta["F"] * tokens if tokens else None, tpp=tokens / n if n and tokens else None,
                            epochs=s.meta.get("epochs"), grow_step=s.meta.get("grow_step"),
                            decay_start_step=decay_start_step, steps=steps or (tokens // step_tokens if tokens else None)))
    return records


def describe_presets(as_json=False):
    presets = {}
    lines = []
    for name in PRESETS:
        preset = get_preset(name)
        world = world_size(preset)
        try:
            specs, _ = full_plan(preset, data_plan(preset, prepare=bool(preset.get("data"))), world)
            records = plan_records(preset, specs, world)
            flops = sum(r["flops"] or 0 for r in records if r["role"] != "branch") + \
                sum(s.meta["F"] * s.settings["decay_tokens"] for s in specs if s.role == "branch")
            presets[name] = dict(about=preset["about"], runs=records, flops=flops, budget=preset.get("budget"))
            tpps = [r["tpp"] for r in records if r["tpp"]]
            epochs = [r["epochs"] for r in records if r["epochs"] is not None]
            what = (f"{len(specs)} runs, {flops:.2e} FLOPs" + (f" on {world} GPUs" if world > 1 else "")
                    + (f", TPP {min(tpps):.3g}..{max(tpps):.3g}" if tpps else "")
                    + (f", epochs <= {max(epochs):.2f}" if epochs else "")
                    + (f" ({preset['budget']})" if preset.get("budget") else ""))
        except ValueError as e:
            what = f"not buildable: {e}"
            presets[name] = dict(about=preset["about"], error=str(e))
        lines.append(f"{name:>16}  {what}: {preset['about']}")
    return json.dumps({"presets": presets}, default=_json_default) if as_json else "\n".join(lines)


def ladder(preset_name, out_dir=None, bootstrap=None, train_fn=None, progress=True, fit_only=False,
           keep_checkpoints=False, plot=False, log=print, workers=None, **overrides):
    """Run (or continue) a preset end to end; returns the report dict (also OUT/report.json)."""
    preset = get_preset(preset_name, **overrides)
    out_dir = out_dir or os.path.join("out", f"ladder-{preset_name}")
    if fit_only and not any(os.path.exists(os.path.join(d, "result.json"))
                            for d in glob.glob(os.path.join(glob.escape(out_dir), "runs", "*"))):
        committed = os.path.join(os.path.dirname(os.path.abspath(__file__)), "docs", "ladder", f"{preset_name}-runs.csv")
        csvs = [c for c in (os.path.relpath(committed), os.path.join(out_dir, "runs.csv")) if os.path.exists(c)]
        raise ValueError(f"--fit-only: {out_dir} holds no finished runs (runs/*/result.json) to refit; "
                         + (f"rebuild the report from a runs.csv instead: python ladder.py --preset {preset_name} "
                            f"--from-csv {csvs[0]}{' --plot' if plot else ''}" if csvs else
                            "train them first (the same command without --fit-only)"))
    if "RANK" in os.environ:  # under torchrun: join the process group now, so only rank 0 writes
        distributed.setup(preset["train"].get("device", "auto"))
        if not _is_master():
            log = lambda *a, **k: None  # noqa: E731
    data = data_plan(preset)
    workers = workers or (preset.get("workers", 1) if "RANK" not in os.environ else 1)
    plan, cells = full_plan(preset, data)
    log(f"preset {preset_name}: {preset['about']}")
    log(f"  {len(plan)} runs, output {out_dir}, data {data.data_dir or 'the embedded corpus'}")
    if cells:
        log("\n".join(match_table(cells)[0]))
    run = lambda specs: (  # noqa: E731
        {s.run_id: load_result(out_dir, s) for s in specs} if fit_only else
        run_ladder(specs, out_dir, train_fn=train_fn, progress=progress, keep_checkpoints=keep_checkpoints,
                   log=log, workers=workers, threads=preset.get("threads"), data_dir=data.data_dir))
    results, sweep_specs = bracketed_sweep(preset, data, run)
    lrs = best_lrs(preset, results, sweep_specs) if preset.get("lr_sweep") else {}
    sweep = None
    if lrs is None:
        log("the LR sweep is not finished: rerun without --fit-only to train it")
        lrs = {}
        specs = sweep_specs
    else:
        specs, _ = build(preset, data, lrs)
        results.update(run([s for s in specs if s.run_id not in results or results[s.run_id] is None]))
        if preset["kind"] == "repeat":  # the weight-decay extensions, then the extra seeds at each best one
            while True:
                specs, complete = repeat_grid(preset, data, lrs, results)
                todo = [s for s in specs if results.get(s.run_id) is None]
                if complete or not todo:
                    break
                results.update(run(todo))
                if any(results.get(s.run_id) is None for s in todo):  # --fit-only: not trained
                    break
            seeds = repeat_seed_specs(preset, data, lrs, results) or []
            results.update(run(seeds))
            specs += seeds
        if preset.get("lr_sweep"):
            sweep = sweep_table(preset, results, sweep_specs, lrs)
    if not _is_master():
        return None
    finished = [results[s.run_id] for s in specs if results.get(s.run_id)]
    if preset["kind"] == "smelt":
        rows = smelt_rows(finished)
    elif preset["kind"] == "repeat":
        rows = repeat_rows(finished, {s.run_id: s.role for s in specs})
    else:
        rows = x_rows([r for r in finished if r["role"] in ("run", "sweep")])
    text, report, figures = report_from_rows(preset, rows, cells, sweep, lrs, bootstrap, progress)
    report.update(runs_finished=len(finished), runs_total=len(specs), lrs=lrs,
                  train_seconds=sum(r.get("seconds") or 0.0 for r in finished))
    if len(finished) < len(specs):
        text += f"\n(partial: {len(finished)}/{len(specs)} runs finished)"
    tables.write_rows_csv(os.path.join(out_dir, "runs.csv"), rows)
    if sweep:  # runs.csv holds the runs carried up the ladder; this, every sweep value (for --from-csv)
        tables.write_rows_csv(os.path.join(out_dir, "lr_sweep.csv"),
                              sweep_rows(preset["lr_sweep"]["key"], sweep[1], lrs))
    write_json_atomic(os.path.join(out_dir, "report.json"), report)
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
    n_boot = preset.get("bootstrap", 0) if bootstrap is None else bootstrap
    if preset["kind"] == "smelt":
        return smelt_report(preset, cells, rows, n_boot, seed=preset["seed"], progress=progress, sweep=sweep)
    if preset["kind"] == "repeat":
        return repeat_report(preset, rows, sweep, n_boot=n_boot, seed=preset["seed"])
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
        key, losses, lrs = sweep_from_rows(tables.read_rows_csv(sweep_csv, unique=["arch", "key", "value"]))
        sweep = sweep_lines(key, losses, lrs)
    else:
        log(f"no {sweep_csv}: the report has no LR sweep table")
    cells = smelt_cells(preset) if preset["kind"] == "smelt" else None
    try:
        text, report, figures = report_from_rows(preset, rows, cells, sweep, lrs, bootstrap, progress)
    except KeyError as e:
        raise ValueError(f"{runs_csv}: no column {e} (is it the runs.csv of a {preset['kind']} ladder?)") from None
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
    written = []
    if plots.pyplot(out_dir) is None:
        return written

    def path(name):
        return os.path.join(out_dir, prefix + name)
    if preset["kind"] == "repeat":
        return repeat_plots(preset, figures, path)
    if preset["kind"] == "x":
        f = figures
        if plots.plot_loss_vs_compute(f["runs"], f["fits"], path("loss_vs_compute.png"),
                                      title=f"[X7] {preset['name']}: loss vs training FLOPs, shared-E laws"):
            written.append(path("loss_vs_compute.png"))
        interpolated = {a: m[0] for a, m in f["mult"].items()}  # what [X] quotes; never extrapolated
        bands = {a: tuple(np.where(np.isfinite(interpolated[a]), side, np.nan) for side in b["measured"])
                 for a, b in f["bands"].items() if b.get("measured") is not None}  # no band without a value
        if plots.plot_multipliers(f["ref_C"], interpolated, path("multipliers.png"), bands=bands, ref="vanilla",
                                  title=f"[X6] {preset['name']}: interpolated compute multipliers vs Vanilla "
                                        "(95% seed bootstrap; none extrapolated)"):
            written.append(path("multipliers.png"))
        return written
    f = figures
    if plots.plot_surface_frontiers(fit.frontier_curves(f["fits"]), f["sparsities"], path("frontiers.png"),
                                    C_range=f["C_range"]):
        written.append(path("frontiers.png"))
    boot = f["boot"] or {"lo": {}, "hi": {}}
    if np.isfinite(f["gain"]).any() and plots.plot_ce_gain(  # no figure of an undefined CE Gain
            f["budgets"], f["sparsities"], f["gain"], path("ce_gain.png"), lo=boot["lo"].get("ce_gain"),
            hi=boot["hi"].get("ce_gain"), title=f"[S5] {preset['name']}: CE Gain of SMELT (95% cell bootstrap)"):
        written.append(path("ce_gain.png"))
    curves = decay_curves(specs, results)
    if curves and plots.plot_loss_curves(curves, path("decay_branches.png"),
                                         title=f"{preset['name']}: validation loss of the stable runs and their "
                                               "decay branches (first seed, largest scale)"):
        written.append(path("decay_branches.png"))
    return written


def repeat_plots(preset, f, path):
    """A repeat ladder's figures: each K's frontier (loss vs compute at its best weight decay per size) and
    the weight-decay curves at every stored depth."""
    written = []
    if plots.plot_repeat_frontier(f["frontier"], f["pts"], f["l_star"], path("frontier.png"),
                                  title=f"{preset['name']}: each K at its best weight decay per stored size"):
        written.append(path("frontier.png"))
    curves = {f"K={k}": {d: [(w, f["grid"][k, d, w]["loss"]) for w in f["wds"] if (k, d, w) in f["grid"]]
                         for d in f["depths"]} for k in f["Ks"]}
    if plots.plot_wd_curves(curves, path("weight_decay.png"),
                            title=f"{preset['name']}: validation loss vs weight decay (first seed)"):
        written.append(path("weight_decay.png"))
    return written


def decay_curves(specs, results):
    """{label: (tokens, val loss)} of the largest scale's stable runs (first seed) and their branches."""
    stable = [s for s in specs if s.role == "stable" and s.meta.get("seed") == SEEDS[0]]
    if not stable:
        return {}
    largest = max(s.meta["F"] for s in stable if s.arch == "baseline")
    curves = {}
    for s in specs:
        r = results.get(s.run_id)
        if not r or s.meta.get("seed") != SEEDS[0] or not r.get("log_path") or not os.path.exists(r["log_path"]):
            continue
        same_cell = any(t.cell == s.cell and t.meta["F"] == largest for t in stable if t.arch == "baseline")
        if not same_cell or s.role not in ("stable", "branch"):
            continue
        log = [json.loads(line) for line in open(r["log_path"])]
        label = f"{s.arch} {s.cell}" + (f" branch TPP {s.meta['branch_tpp']:g}" if s.role == "branch" else " stable")
        curves[label] = ([e["tokens"] for e in log], [e["val_loss"] for e in log])
    return curves


# ----------------------------------------------------------------------------------------------------
# --plan CONFIG: every run one config file's recipe trains, what each reads and costs, before training


def recipe_plan(config_path, gpus=8):
    """The runs a config file's recipe trains on `gpus` processes, each number derived from the file and
    train.py's defaults, read as train.py reads them (train.SETTINGS). The run itself (with its growth
    step [X13] if it grows); with decay_tokens > 0 (the [S] recipe) that run is the stable phase and
    one decay branch [S] forks from each of its save_steps and from its end, named as
    rundir.resolve_run names a branch. Per run: its train.py command (torchrun for gpus > 1), steps,
    tokens and training FLOPs as train.py counts them (plan_flops); then the train tokens the data must
    hold (data_needs). A recipe that cannot run is a ValueError naming the setting. Returns the dict
    --plan --json prints."""
    given = train.SETTINGS.parse([config_path])  # what the file sets, over train.py's defaults
    values = train.SETTINGS.resolve(given)
    config, cfg = train.SETTINGS.build(train.TrainConfig, values), train.SETTINGS.build(ModelConfig, values)
    for name in ("init_from", "resume", "decay_branch"):
        if values[name]:
            raise ValueError(f"{config_path}: {name}={values[name]!r}: --plan plans a recipe from its first step; "
                             "this config continues another run")
    guards.derive_grad_accum(config, gpus)  # global_batch: the same step on any number of processes
    seqs = config.batch_size * config.grad_accum * gpus
    step_tokens = seqs * cfg.block_size
    schedule = train.plan_schedule(config, TrainState(), step_tokens)  # max_steps, decay start, growth step
    grown = None if schedule.grow_step is None else grow.grown_config(cfg, config.grow_to, config.grow_untie)
    points = branch_points(config_path, config, schedule)
    prefix = ["python"] if gpus == 1 else ["torchrun", "--standalone", f"--nproc_per_node={gpus}"]
    stable = rundir.RunDir(os.path.join(config.out_dir, config.run_name), sharded=config.parallel == "fsdp")
    runs = [dict(run_name=config.run_name, role="stable" if points else "run", argv=[config_path],
                 steps=schedule.max_steps, tokens=schedule.max_steps * step_tokens, windows=schedule.max_steps * seqs,
                 flops=plan_flops(cfg, grown, config, 0, schedule.max_steps, schedule.grow_step, step_tokens),
                 grow_step=schedule.grow_step, grow_to=config.grow_to if grown else None, run_dir=stable.path,
                 checkpoints=[stable.step_path(s) for s in sorted(set(config.save_steps))] + [stable.resume_path])]
    for step in points:
        source = stable.step_path(step) if step < schedule.max_steps else stable.resume_path
        argv = [f"--init_from={source}", "--decay_branch=True", f"--decay_tokens={config.decay_tokens}"]
        argv += [f"--{k}={values[k]}" for k in ("out_dir", "data_dir")  # paths never come from a checkpoint
                 if k in rundir.NOT_INHERITED_FORK and values[k] != train.DEFAULTS[k]]
        branch = train.SETTINGS.build(train.TrainConfig, train.SETTINGS.resolve(  # what the branch runs with
            train.SETTINGS.parse(argv), base=values, not_inherited=rundir.NOT_INHERITED_FORK))
        # a branch keeps the stable run's sequences per step (rundir: the checkpoint's global batch)
        steps = train.plan_schedule(branch, TrainState(step=step, branch_start_step=step), step_tokens).max_steps - step
        at_fork = grown if schedule.grow_step is not None and step > schedule.grow_step else cfg
        name = rundir.branch_run_name(config.run_name, step)
        runs.append(dict(run_name=name, role="branch", argv=argv, from_step=step, init_from=source,
                         decay_tokens=config.decay_tokens, steps=steps, tokens=steps * step_tokens,
                         windows=steps * seqs, flops=plan_flops(at_fork, None, branch, step, step + steps, None,
                                                                step_tokens),
                         run_dir=os.path.join(branch.out_dir, name)))
    for r in runs:
        r["command"] = shlex.join(prefix + ["train.py"] + r["argv"])
        r["flops_per_token"] = r["flops"] / r["tokens"]
    branch_windows = max((r["windows"] for r in runs if r["role"] == "branch"), default=0)
    return dict(config=config_path, processes=gpus, sequences_per_step=seqs, grad_accum=config.grad_accum,
                block_size=cfg.block_size, tokens_per_step=step_tokens, avg_doc_len=config.avg_doc_len or None,
                model=dict(layout=cfg.layout, n_layer=cfg.n_layer, n_embd=cfg.n_embd, n_expert=cfg.n_expert,
                           passes=cfg.passes, executed_layers=cfg.executed_layers()),
                runs=runs, total=dict(runs=len(runs), tokens=sum(r["tokens"] for r in runs),
                                      flops=sum(r["flops"] for r in runs)),
                data=data_needs(config, cfg, runs[0]["windows"], branch_windows, "branch_data_fraction" in given))


def branch_points(config_path, config, schedule):
    """[S] the steps decay branches fork from: every save step and the end of the stable run ([] without
    decay_tokens). Refused: a save step after the last step (never written), branches without held-back
    data, and a branch from a step the stable run's LR already decays at (guards.check_branch_source
    refuses it at training time)."""
    late = sorted(s for s in set(config.save_steps) if s > schedule.max_steps)
    if late:
        raise ValueError(f"{config_path}: save_steps {late} are after the last step (max_steps={schedule.max_steps}): "
                         "those checkpoints are never written")
    if config.decay_tokens <= 0:
        return []
    if config.branch_data_fraction == 0:
        raise ValueError(f"{config_path}: branch_data_fraction=0.0 holds no data back, but decay_tokens="
                         f"{config.decay_tokens} plans decay branches, which read only the held-back tail")
    points = sorted(s for s in set(config.save_steps) if s < schedule.max_steps) + [schedule.max_steps]
    decayed = [s for s in points if s > schedule.decay_start]
    if decayed:
        raise ValueError(f"{config_path}: decay_fraction={config.decay_fraction}: the stable run's LR decays from step "
                         f"{schedule.decay_start}, so a branch from step {decayed[0]} would raise it again; set "
                         "decay_fraction=0.0 (the decays are the branches [S])")
    return points


def plan_flops(cfg, grown, config, first, last, grow_step, step_tokens):
    """Training FLOPs of steps [first, last) as train.py logs them: each step's tokens x the FLOPs per
    token of the model that runs it (train.flops_per_token: every block execution, the config's
    avg_doc_len), the grown model from grow_step on [X13], each step at its drawn passes when
    n_passes_choices is set (train.passes_of_step: seeded by the step)."""
    if config.n_passes_choices:
        steps = collections.Counter((grow_step is not None and step >= grow_step, train.passes_of_step(config, step))
                                    for step in range(first, last))
    else:
        cut = last if grow_step is None else min(max(first, grow_step), last)
        steps = {(False, None): cut - first, (True, None): last - cut}
    return sum(n * step_tokens * train.flops_per_token(grown if after else cfg, k, config.avg_doc_len)
               for (after, k), n in steps.items() if n)


def smallest_train_split(stable_tokens, branch_tokens, fraction):
    """The fewest train tokens n whose regions, cut at n - int(n x fraction) (data.loader.held_back_start on
    a single shard; with several, its cut moves to the nearest shard boundary), hold stable_tokens before
    the cut and branch_tokens after it."""
    def holds(n):
        held = int(n * fraction)
        return n - held >= stable_tokens and held >= branch_tokens
    n = stable_tokens + branch_tokens
    if branch_tokens:  # both regions grow with n: start just below where each first fits, then step up
        n = max(n, math.floor(branch_tokens / fraction))
    n = max(0, max(n, math.floor((stable_tokens - 1) / (1 - fraction))) - 2)
    while not holds(n):
        n += 1
    return n


def data_needs(config, cfg, stable_windows, branch_windows, fraction_set):
    """What the train split must hold for the plan to read no token twice ([S]). A run reads windows of
    block_size + 1 tokens, block_size apart (data.loader.TokenStream): W windows need W x block_size + 1
    tokens. The stable run reads the region before the cut; every decay branch reads the held-back tail
    from its start (a fork onto another region starts at its beginning), so the tail must hold one
    branch. With the prepared data_dir present here, its regions are checked as well. Returns a dict:
    the token counts, notes (lines) and problems (lines: the plan would reread data, or a branch be
    refused)."""
    T, f = cfg.block_size, config.branch_data_fraction
    stable_need = stable_windows * T + 1
    branch_need = branch_windows * T + 1 if branch_windows else 0
    plain = stable_need + branch_need
    smallest = smallest_train_split(stable_need, branch_need, f)
    out = dict(stable_tokens=stable_need, branch_tokens=branch_need, read_tokens=plain, branch_data_fraction=f,
               exact_fraction=branch_need / plain, smallest_train_split=smallest, notes=[], problems=[],
               data_dir=config.data_dir, prepared_train_tokens=None)
    if branch_need:
        out["notes"].append(f"the stable region must hold {stable_need:,} tokens ({stable_windows:,} windows of "
                            f"block_size + 1), the held-back tail {branch_need:,} (one branch's {branch_windows:,} "
                            f"windows: every branch reads the same tail from its start); {plain:,} in all")
        held = int(plain * f)  # a split of exactly what the runs read, cut at f: what the tail gains, the stable lacks
        out["holds_one_branch"] = held >= branch_need
        out["notes"].append(
            f"branch_data_fraction {f:g} " + (f"holds one branch: of exactly {plain:,} train tokens it holds back "
                                              f"{held:,}, {held - branch_need:,} more than a branch reads, which the "
                                              "stable region then lacks" if held >= branch_need else
                                              f"does not hold one branch: of exactly {plain:,} train tokens it holds "
                                              f"back {held:,}, {branch_need - held:,} fewer than a branch reads "
                                              "(train.py would refuse the branches)")
            + f"; the fraction that fits exactly is {branch_need / plain:.6f}")
    else:
        out["notes"].append(f"the run reads {stable_windows:,} windows of block_size + 1 tokens: its region must hold "
                            f"{stable_need:,} tokens")
        if f > 0:
            out["notes"].append(f"branch_data_fraction {f:g}{'' if fraction_set else ' (train.py default)'} holds "
                                f"back the last {f:.1%} of the train split, which no run of this plan reads")
    extra = smallest - plain
    out["notes"].append(f"the train split must hold at least {smallest:,} tokens at branch_data_fraction {f:g}"
                        + (f" ({extra:,} = {extra / plain:.4%} more than the runs read)" if extra else ""))
    if extra > 0.01 * plain and branch_need:
        out["problems"].append(f"branch_data_fraction {f:g} leaves {extra / plain:.1%} of the data unread; "
                               f"{branch_need / plain:.6f} fits these runs exactly")
    from data import loader, prepare as prep
    try:
        meta = prep.load_meta(config.data_dir or prep.DEFAULT_OUT)
        n = int(meta["splits"]["train"]["tokens"])
    except (FileNotFoundError, ValueError, KeyError):
        out["notes"].append(f"data_dir {config.data_dir or '(the embedded corpus)'} is not prepared here: "
                            f"prepare at least {smallest:,} train tokens (data/prepare.py; the tail's start moves "
                            "to the nearest shard boundary, by up to half a shard: prepare that much more)")
        return out
    out["prepared_train_tokens"] = n
    cut = loader.held_back_start([s["tokens"] for s in meta["shards"]["train"]], f)  # as Data.stream cuts it
    have = ((cut - 1) // T, (n - cut - 1) // T)  # windows in the stable region and in the tail
    if have[0] < stable_windows:
        out["problems"].append(f"{config.data_dir or 'the embedded corpus'} holds {n:,} train tokens: its stable region "
                               f"has {max(have[0], 0):,} windows, the stable run reads {stable_windows:,} "
                               f"({stable_windows / max(have[0], 1):.2f} epochs: data repeats)")
    if branch_windows and have[1] < branch_windows:
        out["problems"].append(f"{config.data_dir or 'the embedded corpus'} holds {n:,} train tokens: its held-back tail "
                               f"has {max(have[1], 0):,} windows, a branch reads {branch_windows:,}: train.py refuses "
                               "the branches (they would reread data)")
    return out


def plan_text(plan):
    """--plan's printout of recipe_plan(...)."""
    lines = [f"{plan['config']}: {len(plan['runs'])} run{'s' if len(plan['runs']) > 1 else ''} on "
             f"{plan['processes']} process{'es' if plan['processes'] > 1 else ''}; a step is {plan['sequences_per_step']} "
             f"sequences x {plan['block_size']} tokens = {plan['tokens_per_step']:,} tokens (grad_accum "
             f"{plan['grad_accum']}); FLOPs: train.py's count, match.flops_per_token at avg_doc_len "
             f"{plan['avg_doc_len'] or 'block_size'}"]
    for r in plan["runs"]:
        what = {"stable": "the WSD stable phase [S]", "run": "the run", "branch": f"decay branch [S] from step "
                f"{r.get('from_step')}: decay_tokens {r.get('decay_tokens', 0):,}"}[r["role"]]
        lines.append(f"  {r['run_name']} ({what}): {r['steps']:,} steps, {r['tokens']:,} tokens, {r['flops']:.4g} FLOPs "
                     f"({r['flops_per_token']:.4g} per token)")
        if r.get("grow_step") is not None:
            lines.append(f"    grows to {r['grow_to']} passes at step {r['grow_step']:,} [X13]")
        lines.append(f"    {r['command']}")
    t = plan["total"]
    if t["runs"] > 1:
        lines.append(f"  total: {t['runs']} runs, {t['tokens']:,} tokens trained, {t['flops']:.4g} FLOPs")
    d = plan["data"]
    lines.append(f"data ({d['data_dir'] or 'the embedded corpus'}):")
    lines += [f"  {n}" for n in d["notes"]] + [f"  PROBLEM: {p}" for p in d["problems"]]
    return "\n".join(lines)


# what each mode reads of the command line: a flag it would ignore is refused, not dropped in silence
MODE_FLAGS = {"list": {"json"}, "plan": {"json", "gpus"}, "from_csv": {"preset", "bootstrap", "plot", "no_progress"},
              "train": {"preset", "out", "bootstrap", "fit_only", "keep_checkpoints", "plot", "no_progress", "workers",
                        "threads"}}
INTERRUPTED = "rerun the same ladder.py command to continue (finished runs are kept)"


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler ending the job) while the ladder runs: it ends like Ctrl-C, workers included."""


def _raise_terminated(signum, frame):
    raise Terminated()


def main(argv=None):
    description, epilog = __doc__.split("\n\n", 1)  # the first paragraph once, above the flags; the rest below
    p = common.parser("ladder.py", description=description, allow_abbrev=False,
                      formatter_class=argparse.RawDescriptionHelpFormatter, epilog=epilog)
    p.add_argument("--preset", help=f"one of {', '.join(PRESETS)}")
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
    in_main = threading.current_thread() is threading.main_thread()  # only the main thread takes signals
    previous = signal.signal(signal.SIGTERM, _raise_terminated) if in_main else None
    try:
        if args.list:
            print(describe_presets(as_json=args.json))
            return 0
        if args.plan:
            plan = recipe_plan(args.plan, gpus=args.gpus or 8)
            print(json.dumps(plan) if args.json else plan_text(plan))
            return 0
        if not args.preset:
            raise ValueError("give --preset (or --list, or --plan CONFIG)")
        if args.from_csv:
            rereport(args.preset, args.from_csv, bootstrap=args.bootstrap, plot=args.plot,
                     progress=not args.no_progress)
            return 0
        ladder(args.preset, out_dir=args.out, bootstrap=args.bootstrap, progress=not args.no_progress,
               fit_only=args.fit_only, keep_checkpoints=args.keep_checkpoints, plot=args.plot, threads=args.threads,
               workers=args.workers)
    except (ValueError, OSError, train.NonFiniteLoss) as e:
        return cli_error("ladder.py", e)
    except KeyboardInterrupt as e:  # Ctrl-C, SIGTERM, train.py's TrainingInterrupted (its advice is for one run)
        sigterm = isinstance(e, Terminated) or getattr(e, "exit_status", 130) == 128 + signal.SIGTERM
        print(f"{'' if args.no_progress else chr(10)}ladder.py: {'terminated' if sigterm else 'interrupted'}: "
              f"{INTERRUPTED}", file=sys.stderr)  # (a newline first: off a tqdm bar)
        return 128 + (signal.SIGTERM if sigterm else signal.SIGINT)  # 143 / 130, as shells report them
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)
        distributed.teardown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
