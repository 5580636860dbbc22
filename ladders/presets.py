"""The ladder presets, typed: one dataclass per protocol (SmeltPreset, XPreset, RepeatPreset) and PRESETS,
every named design. `model` and `train` stay dicts: they are train.py settings (train.SETTINGS' keys)."""

import copy
from dataclasses import dataclass, field, fields, replace
from typing import ClassVar, Optional

BYTES = dict(vocab_size=257)  # gpt2-257: the 256 byte tokens + eot (the preset's tokenizer; train.py: the data's eot)
GPT2_4096 = dict(vocab_size=4096)  # data/cache/default
# [S]: MoE baselines, top-2 of fine-grained experts; 6 query heads on 3 KV heads, so that the SMELT twin
# (1.5x the executed layers) matches the KV cache exactly with 2 KV heads of the same size.
SMELT_MODEL = dict(n_head=6, n_kv_head=3, top_k=2, layout="plain", n_passes=1)
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
X_OPERATOR1 = dict(X_MODEL, layout="pcc", boundary="both", tie_core=True, boundary_alpha=1.0,
                   residual_multiplier=0.5, output_multiplier=1.0, embed_init_std=0.11313708499,
                   uniform_init_scale=0.353553390593, document_mask=False)
X_OPERATOR1_TRAIN = dict(optimizer="muon_x", grad_clip=0.0, adam_betas=[0.8, 0.98], adam_eps=1e-10,
                         warmup_steps=0, decay_fraction=0.8, decay_shape="linear")
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


@dataclass(kw_only=True)
class LRSweep:
    """One learning rate swept at the first ladder point; the best value is carried up the ladder."""
    key: str  # the train.py setting swept (matrix_lr: Muon's or AdamW's, by the optimizer)
    values: list  # 2x apart; a value beyond them runs while the best is at an edge, at most `extend` steps
    extend: int = 2
    seeds: int = 1  # seeds per value (the mean is compared)
    tied: dict = field(default_factory=dict)  # repeat: {LR setting: its ratio to the swept LR} ([X]'s global LR)
    weight_decay: Optional[float] = None  # repeat: the weight decay the sweep runs at
    # x: every (architecture, depth) runs every value (x [X16]'s factor from the first depth with lr_beta),
    # bracketed on its own; each ladder point trains at its own best value (nothing carried up).
    # smelt: every (architecture, scale) sweeps at the scale's first cell; its cells train at its best value
    at_every_depth: bool = False


@dataclass(kw_only=True)
class Preset:
    """What every ladder has: its model and train.py settings, seeds, data, sweep, and how it runs."""
    kind: ClassVar[str]
    name: str
    about: str
    model: dict  # ModelConfig fields every run shares
    train: dict  # train.py settings every run shares
    seeds: list
    seed: int = 1337  # the bootstrap's
    tokenizer: Optional[str] = None  # the embedded corpus in this tokenizer; None: train["data_dir"]
    lr_sweep: Optional[LRSweep] = None
    bootstrap: int = 0  # draws (smelt: cell bootstrap; repeat: seed bootstrap)
    threads: Optional[int] = None  # torch threads per run
    workers: int = 1  # runs trained at once
    gpus: int = 1  # the processes a step is planned for outside torchrun (--list)
    budget: Optional[str] = None  # the budget written before the run


@dataclass(kw_only=True)
class SmeltPreset(Preset):
    """[S]: (scale, sparsity) cells, each a MoE baseline and its matched SMELT twin, with decay branches."""
    kind: ClassVar[str] = "smelt"
    scales: dict  # {scale: ModelConfig fields}
    cells: list  # [(scale, experts per layer)]
    recipe: str  # match.match's recipe
    match_kwargs: dict = field(default_factory=dict)  # match.MatchSearch fields
    branch_tpp: list  # decay branches at these TPP of the baseline
    decay_share: float  # the share of a branch's tokens that decay
    budgets: Optional[list] = None  # CE Gain budgets (None: two inside the measured range)
    sweep_tpp: Optional[float] = None  # a sweep run's tokens per parameter, one WSD run (None: the first branch's)
    seed_every_arch: bool = False  # the twin runs every seed too (else the first)


@dataclass(kw_only=True)
class DepthPreset(Preset):
    """[X] ladders: width = width_per_depth x depth at each depth."""
    depths: list
    width_per_depth: int
    head_dim: int
    mlp_multiple: int
    recipes: bool = False  # each architecture with its [X] recipe (config/x_d8_*.py)


@dataclass(kw_only=True)
class XPreset(DepthPreset):
    """[X]: every architecture at every depth, at its own budget."""
    kind: ClassVar[str] = "x"
    archs: tuple = X_ARCHS
    tpp: Optional[float] = None  # tokens per compute-active parameter (the v1 rule), or
    tpp_stored: Optional[dict] = None  # {arch: tokens per stored parameter} ([X])
    lr_beta: Optional[dict] = None  # {arch: [X16] beta}: the LR carried up by [X16]
    grow_to: int = 4
    rewarm_fraction: float
    seed_every_arch: bool = False  # every architecture runs every seed (else the reference only)
    multipliers: str = "both"  # "interpolated": only [X]'s rule is printed


@dataclass(kw_only=True)
class RepeatPreset(DepthPreset):
    """[X] data-constrained: the Operator-1 family (K passes) reading unique_tokens for `epochs` epochs."""
    kind: ClassVar[str] = "repeat"
    passes: list  # K
    unique_tokens: int
    epochs: float
    lr_scaling_beta: float  # [X16] across depths
    weight_decays: list  # the grid (2x apart), bracketed at most wd_extend steps beyond
    wd_extend: int = 2
    seeded_passes: list  # the K that run every seed at their best weight decay
    # [X] D.1: several data budgets (unique_tokens, epochs) read for the same tokens, fresh data the control;
    # None: the one budget above. `arm` labels one budget's runs (set per arm by ladders.repeat.repeat_arms).
    arms: Optional[list] = None
    arm: str = ""
    # every (K, depth) searches its first seed's LR and weight decay together, from the carried LR
    # (ladders.repeat.repeat_tuned); the other seeds run at the best pair
    tune_every_point: bool = False
    # a runs.csv (repo-relative) of a finished ladder with these settings: its runs are imported, not retrained
    builds_on: Optional[str] = None


SMELT_GPU_1NODE = SmeltPreset(
    name="smelt-gpu-1node", about="one 8-GPU node (documented, not run): 4 scales x 3 sparsities, 6 branches",
    model=dict(GPT2_4096 | SMELT_MODEL, head_dim=64, n_head=8, n_kv_head=4, top_k=8, block_size=1024),
    scales={"L8w512": dict(n_layer=8, n_embd=512, expert_hidden=176),
            "L10w640": dict(n_layer=10, n_embd=640, expert_hidden=208),
            "L12w768": dict(n_layer=12, n_embd=768, expert_hidden=256),
            "L16w1024": dict(n_layer=16, n_embd=1024, expert_hidden=336)},
    cells=[(s, e) for s in ("L8w512", "L10w640", "L12w768", "L16w1024") for e in (48, 96, 128)],
    recipe="smelt", match_kwargs=dict(width_multiple=(32, 16), expert_multiple=4),
    train=dict(optimizer="adamw", batch_size=16, warmup_steps=200, eval_tokens=1 << 20,
               data_dir=GPU_DATA, branch_data_fraction=0.1),
    branch_tpp=[10, 20, 40, 80], decay_share=0.1, seeds=SEEDS[:1], gpus=8, bootstrap=2000)

X_GPU = dict(model=dict(dict(vocab_size=50304) | X_MODEL, block_size=2048), width_per_depth=128,
             head_dim=128, mlp_multiple=256, tpp=10, rewarm_fraction=0.02, seeds=SEEDS[:1])

X_CPU_REPEAT = RepeatPreset(
    name="x-cpu-repeat", about="[X] data-constrained with its controls ([X] D.1): 0.5M tokens per run from 500k "
                               "unique x 1 (fresh), 125k x 4 or 50k x 10; K 1, 2, 4 x depths 3..6, 2 seeds",
    tokenizer="gpt2-257", model=dict(BYTES | X_OPERATOR1, block_size=128), depths=[3, 4, 5, 6], width_per_depth=8,
    head_dim=8, mlp_multiple=8, passes=[1, 2, 4], unique_tokens=500_000, epochs=1,
    arms=[(500_000, 1), (125_000, 4), (50_000, 10)],
    train=dict(X_OPERATOR1_TRAIN, batch_size=16, muon_momentum_warmup=38, eval_tokens=1 << 15),
    lr_sweep=LRSweep(key="matrix_lr", values=[0.08, 0.16, 0.32], seeds=2, tied=X_GLR_TIED, weight_decay=0.4),
    lr_scaling_beta=-0.6, weight_decays=[0.2, 0.4, 0.8], seeds=SEEDS[:2], seeded_passes=[1, 2, 4],
    bootstrap=400, threads=1, workers=2,
    budget="written before the run: 156 runs (plus bracketing), 7.6e13 FLOPs, about 40 min on 2 workers, "
           "at most 75")


PRESETS = {p.name: p for p in [
    # ---- [S] SMELT
    SmeltPreset(
        name="smelt-micro", about="pipeline check in seconds (tests); the numbers mean nothing", tokenizer="gpt2-257",
        model=dict(BYTES | SMELT_MODEL, head_dim=8, block_size=32),
        scales={"w32": dict(n_layer=4, n_embd=32, expert_hidden=16),
                "w56": dict(n_layer=4, n_embd=56, expert_hidden=28)},
        cells=[("w32", 8), ("w32", 16), ("w56", 16)],  # (scale, experts per layer)
        recipe="smelt", match_kwargs=SMELT_MATCH,
        train=dict(optimizer="adamw", batch_size=4, warmup_steps=2, eval_tokens=512, branch_data_fraction=0.2),
        branch_tpp=[0.1, 0.2, 0.3], decay_share=0.2, seeds=SEEDS[:2],
        lr_sweep=LRSweep(key="matrix_lr", values=[2e-3, 4e-3], extend=0), bootstrap=20, threads=1),
    SmeltPreset(
        name="smelt-cpu-mini", about="[S] in miniature: 3 scales varying depth and width (F spans 10x) x 3 "
                                     "sparsities, 3 decay branches, 2 baseline seeds", tokenizer="gpt2-257",
        model=dict(BYTES | SMELT_MODEL, head_dim=8, block_size=64),
        # depth 2 -> 8 and width 32 -> 72 (the heads grow with the width at the top: 9 query heads on 3 KV heads)
        scales={"L2w32": dict(n_layer=2, n_embd=32, expert_hidden=16),
                "L4w56": dict(n_layer=4, n_embd=56, expert_hidden=28),
                "L8w72": dict(n_layer=8, n_embd=72, expert_hidden=36, n_head=9, n_kv_head=3)},
        cells=[(s, e) for s in ("L2w32", "L4w56", "L8w72") for e in (16, 32, 48)],
        recipe="smelt", match_kwargs=SMELT_MATCH,
        train=dict(optimizer="adamw", batch_size=16, warmup_steps=20, eval_tokens=1 << 15, branch_data_fraction=0.2),
        branch_tpp=[3, 6, 12], decay_share=0.2, seeds=SEEDS[:2],
        lr_sweep=LRSweep(key="matrix_lr", values=[1.5e-3, 3e-3, 6e-3]), bootstrap=2000, threads=1, workers=2,
        budget="written before the run: 114 runs, 6.6e13 FLOPs, about 55 min on 2 workers, at most 90"),
    SmeltPreset(
        name="smelt-scale-sweep-micro", about="pipeline check in seconds (tests): the LR swept at every scale, two "
                                              "twin seeds; the numbers mean nothing", tokenizer="gpt2-257",
        model=dict(BYTES | SMELT_MODEL, head_dim=8, block_size=32),
        scales={"w32": dict(n_layer=4, n_embd=32, expert_hidden=16),
                "w56": dict(n_layer=4, n_embd=56, expert_hidden=28)},
        cells=[("w32", 8), ("w32", 16), ("w56", 16)], recipe="smelt", match_kwargs=SMELT_MATCH,
        train=dict(optimizer="adamw", batch_size=4, warmup_steps=2, eval_tokens=512, branch_data_fraction=0.2),
        branch_tpp=[0.1, 0.2], decay_share=0.2, sweep_tpp=0.15, seeds=SEEDS[:2], seed_every_arch=True,
        lr_sweep=LRSweep(key="matrix_lr", values=[2e-3, 4e-3], extend=1, seeds=2, at_every_depth=True),
        bootstrap=20, threads=1),
    SmeltPreset(
        name="smelt-cpu-surface", about="[S] designed to identify its surface: 5 scales (F 7.7x at 5 levels) x 2 "
                                        "sparsities, 3 decay branches, 2 seeds of both arms, the LR swept at every "
                                        "scale for both arms", tokenizer="gpt2-257",
        model=dict(BYTES | SMELT_MODEL, head_dim=8, block_size=64),
        # depth 2 -> 8 (even: the twin's 1.5x executed layers then meet the KV cache), F 1.9e5 -> 1.4e6 per token
        # in steps of 1.4-1.9x (each at least 1.25x above the other sparsity's F of the scale below: 5 levels); the
        # experts per scale are the ones the matcher finds a twin for (S ~0.75 / ~0.9)
        scales={"L2w32": dict(n_layer=2, n_embd=32, expert_hidden=16),
                "L4w32": dict(n_layer=4, n_embd=32, expert_hidden=16),
                "L4w48": dict(n_layer=4, n_embd=48, expert_hidden=24),
                "L6w48": dict(n_layer=6, n_embd=48, expert_hidden=24),
                "L8w64": dict(n_layer=8, n_embd=64, expert_hidden=32)},
        # L4w32: 80 experts (48 has no twin; 64's is 8 wide with 1,005 experts, which a first launch showed)
        cells=[("L2w32", 16), ("L2w32", 48), ("L4w32", 16), ("L4w32", 80), ("L4w48", 16), ("L4w48", 48),
               ("L6w48", 16), ("L6w48", 48), ("L8w64", 16), ("L8w64", 48)],
        recipe="smelt", match_kwargs=SMELT_MATCH,
        train=dict(optimizer="adamw", batch_size=16, warmup_steps=10, eval_tokens=1 << 15, branch_data_fraction=0.2),
        branch_tpp=[2, 4, 8], decay_share=0.2, sweep_tpp=4, seeds=SEEDS[:2], seed_every_arch=True,
        # each (arch, scale) at its first cell: 3 values x 2 seeds, WSD runs of the middle branch's tokens (4 N)
        lr_sweep=LRSweep(key="matrix_lr", values=[1.5e-3, 3e-3, 6e-3], seeds=2, extend=2, at_every_depth=True),
        bootstrap=2000, threads=1, workers=2,
        # smelt-cpu-mini trained 6.6e13 FLOPs in 6371 worker-seconds (1.04e10 FLOP/s per worker, mostly at its
        # top scale): 4.5e13 FLOPs here take about 4300 s, plus about 3 s per run for start-up and evals
        budget="written before the run: 220 runs (plus bracketing), 4.5e13 FLOPs, about 42 min on 2 workers, "
               "at most 75"),
    SmeltPreset(  # the first design (its run: docs/ladder/smelt-cpu-mini-v1-*), kept for its report
        name="smelt-cpu-mini-v1", about="smelt-cpu-mini's first design: 3 scales x 2 sparsities, 3 decay branches, "
                                        "3 baseline seeds", tokenizer="gpt2-257",
        model=dict(BYTES | SMELT_MODEL, head_dim=8, block_size=256),
        # compute-active non-embedding params 33k / 75k / 130k, F 5.5e5 / 8.4e5 / 1.2e6 FLOPs per token
        scales={"L4w32": dict(n_layer=4, n_embd=32, expert_hidden=16),
                "L4w56": dict(n_layer=4, n_embd=56, expert_hidden=28),
                "L4w80": dict(n_layer=4, n_embd=80, expert_hidden=40)},
        cells=[(s, e) for s in ("L4w32", "L4w56", "L4w80") for e in (16, 32)],  # S 0.73-0.81 and 0.85-0.90
        recipe="smelt", match_kwargs=SMELT_MATCH,
        train=dict(optimizer="adamw", batch_size=8, warmup_steps=20, eval_tokens=1 << 15, branch_data_fraction=0.2),
        branch_tpp=[10, 20, 30], decay_share=0.2, seeds=SEEDS,
        lr_sweep=LRSweep(key="matrix_lr", values=[1.5e-3, 3e-3, 6e-3]), bootstrap=2000, threads=1, workers=2),
    SMELT_GPU_1NODE,
    replace(SMELT_GPU_1NODE, name="smelt-gpu-2node", gpus=16,
            about="two 8-GPU nodes (documented, not run): the 1-node grid, 2x the tokens per step"),
    # ---- [X] scaling exponents
    XPreset(
        name="x-micro", about="pipeline check in seconds (tests); the numbers mean nothing", tokenizer="gpt2-257",
        model=dict(BYTES, block_size=32), depths=[3, 4, 5], width_per_depth=8, head_dim=8, mlp_multiple=8,
        recipes=True, tpp_stored={a: 0.05 + 0.01 * i for i, a in enumerate(X_ARCHS)}, lr_beta=X_LR_BETA,
        rewarm_fraction=0.05, train=dict(batch_size=4, eval_tokens=512, branch_data_fraction=0.0),
        seeds=SEEDS[:2], seed_every_arch=True,
        lr_sweep=LRSweep(key="matrix_lr", values=[0.02, 0.04], extend=0, seeds=2),
        multipliers="interpolated", threads=1),
    XPreset(
        name="x-cpu-mini", about="[X] in miniature: 6 architectures x depths 3..6 at width 8 x depth, each with its "
                                 "[X] recipe, TPP and [X16] LR rule, no data repetition, 3 seeds each",
        tokenizer="gpt2-257", model=dict(BYTES, block_size=128), depths=[3, 4, 5, 6], width_per_depth=8, head_dim=8,
        mlp_multiple=8, recipes=True, tpp_stored=X_TPP_STORED, lr_beta=X_LR_BETA, rewarm_fraction=0.02,
        train=dict(batch_size=16, eval_tokens=1 << 15, branch_data_fraction=0.0), seeds=SEEDS, seed_every_arch=True,
        lr_sweep=LRSweep(key="matrix_lr", values=[0.02, 0.04, 0.08], seeds=2), multipliers="interpolated",
        threads=1, workers=2,
        budget="written before the run: 96 runs, 6.3e13 FLOPs, about 30 min on 2 workers, at most 60"),
    XPreset(
        name="x-depth-sweep-micro", about="pipeline check in seconds (tests): the LR swept at every depth; the "
                                          "numbers mean nothing", tokenizer="gpt2-257",
        model=dict(BYTES, block_size=32), depths=[3, 4], width_per_depth=8, head_dim=8, mlp_multiple=8,
        archs=("vanilla", "operator-1", "loop-2"), recipes=True,
        tpp_stored={a: 0.05 + 0.01 * i for i, a in enumerate(X_ARCHS)}, lr_beta=X_LR_BETA, rewarm_fraction=0.05,
        train=dict(batch_size=4, eval_tokens=512, branch_data_fraction=0.0), seeds=SEEDS[:2], seed_every_arch=True,
        lr_sweep=LRSweep(key="matrix_lr", values=[0.02, 0.04], extend=1, seeds=1, at_every_depth=True),
        multipliers="interpolated", threads=1),
    XPreset(
        name="x-cpu-mini-tuned", about="x-cpu-mini with the LR tuned at every depth for every architecture: 5 "
                                       "architectures (no untied-2) x depths 3..6, 3 values x 2 seeds at each",
        tokenizer="gpt2-257", model=dict(BYTES, block_size=128), depths=[3, 4, 5, 6], width_per_depth=8, head_dim=8,
        mlp_multiple=8, recipes=True, tpp_stored=X_TPP_STORED, lr_beta=X_LR_BETA, rewarm_fraction=0.02,
        archs=("vanilla", "operator-1", "loop-2", "loop-grow", "untied-grow"),
        train=dict(batch_size=16, eval_tokens=1 << 15, branch_data_fraction=0.0), seeds=SEEDS[:2],
        seed_every_arch=True, multipliers="interpolated", threads=1, workers=2,
        # x-cpu-mini's sweep at d3 found every architecture best at 0.16 (0.08 and 0.32 worse for all)
        lr_sweep=LRSweep(key="matrix_lr", values=[0.08, 0.16, 0.32], seeds=2, extend=2, at_every_depth=True),
        # 50 min: x-cpu-mini's measured seconds per run (docs/ladder/x-cpu-mini-runs.csv) x 6 runs per point
        # (42 min on 2 workers), plus 20% for bracketing
        budget="written before the run: 120 runs (plus bracketing), 9.9e13 FLOPs, about 50 min on 2 workers, "
               "at most 75"),
    XPreset(  # the first design (its run: docs/ladder/x-cpu-mini-v1-*), kept to rebuild that report
        name="x-cpu-mini-v1", about="x-cpu-mini's first design: 6 architectures x depths 3..6 at width 12 x depth, "
                                    "TPP 10 each, 3 Vanilla seeds", tokenizer="gpt2-257",
        model=dict(BYTES | X_MODEL, block_size=128), depths=[3, 4, 5, 6], width_per_depth=12, head_dim=12,
        mlp_multiple=32, tpp=10, rewarm_fraction=0.05,
        train=dict(optimizer="muon", batch_size=16, warmup_fraction=0.05, decay_fraction=0.3, eval_tokens=1 << 15),
        seeds=SEEDS, lr_sweep=LRSweep(key="matrix_lr", values=[0.01, 0.02, 0.04]), threads=1, workers=2),
    # ---- [X] data-constrained: a few unique tokens read for many epochs
    RepeatPreset(
        name="x-repeat-micro", about="pipeline check in seconds (tests); the numbers mean nothing",
        tokenizer="gpt2-257",
        model=dict(BYTES | X_OPERATOR1, block_size=32), depths=[3, 4], width_per_depth=8, head_dim=8, mlp_multiple=8,
        passes=[1, 2], unique_tokens=2000, epochs=2,
        train=dict(X_OPERATOR1_TRAIN, batch_size=4, muon_momentum_warmup=2, eval_tokens=512),
        lr_sweep=LRSweep(key="matrix_lr", values=[0.02, 0.04], extend=0, tied=X_GLR_TIED, weight_decay=0.2),
        lr_scaling_beta=-0.6, weight_decays=[0.1, 0.4], wd_extend=1, seeds=SEEDS[:2], seeded_passes=[1, 2],
        bootstrap=50, threads=1),
    RepeatPreset(
        name="x-repeat-tuned-micro", about="pipeline check in seconds (tests): the LR and weight decay searched at "
                                           "every point; the numbers mean nothing", tokenizer="gpt2-257",
        model=dict(BYTES | X_OPERATOR1, block_size=32), depths=[3, 4], width_per_depth=8, head_dim=8, mlp_multiple=8,
        passes=[1, 2], unique_tokens=2000, epochs=2, tune_every_point=True,
        train=dict(X_OPERATOR1_TRAIN, batch_size=4, muon_momentum_warmup=2, eval_tokens=512),
        lr_sweep=LRSweep(key="matrix_lr", values=[0.02, 0.04], extend=1, tied=X_GLR_TIED, weight_decay=0.2),
        lr_scaling_beta=-0.6, weight_decays=[0.1, 0.4], wd_extend=1, seeds=SEEDS[:2], seeded_passes=[1, 2],
        bootstrap=50, threads=1),
    RepeatPreset(
        name="x-repeat-arms-micro", about="pipeline check in seconds (tests): two data budgets; the numbers mean "
                                          "nothing", tokenizer="gpt2-257",
        model=dict(BYTES | X_OPERATOR1, block_size=32), depths=[3, 4], width_per_depth=8, head_dim=8, mlp_multiple=8,
        passes=[1, 2], unique_tokens=4000, epochs=1, arms=[(4000, 1), (1000, 4)],
        train=dict(X_OPERATOR1_TRAIN, batch_size=4, muon_momentum_warmup=2, eval_tokens=512),
        lr_sweep=LRSweep(key="matrix_lr", values=[0.02, 0.04], extend=0, seeds=2, tied=X_GLR_TIED, weight_decay=0.2),
        lr_scaling_beta=-0.6, weight_decays=[0.1, 0.4], wd_extend=1, seeds=SEEDS[:2], seeded_passes=[1, 2],
        bootstrap=50, threads=1),
    X_CPU_REPEAT,
    replace(
        X_CPU_REPEAT, name="x-cpu-repeat-tuned",
        about="x-cpu-repeat with the LR tuned where it is used: at every (budget, K, depth) the LR and weight decay "
              "searched together from the carried LR; x-cpu-repeat's finished runs imported",
        tune_every_point=True, builds_on="docs/ladder/x-cpu-repeat-runs.csv",
        budget="written before the run: x-cpu-repeat's 175 finished runs imported from its runs.csv (not "
               "retrained); its 24-run LR sweep retrained (checks that this checkout reproduces its losses); at each "
               "of the 36 points the LR x1/2 and x2 at its best weight decay (72 runs, 3,070 s of training at "
               "x-cpu-repeat's measured speed), then the neighbours the search asks for; about 30 min on 2 workers, "
               "at most 75"),
    RepeatPreset(  # the first design (its run: docs/ladder/x-cpu-repeat-v1-*), kept for its report
        name="x-cpu-repeat-v1", about="x-cpu-repeat's first design: the Operator-1 family K 1..4 x depths 3..6, "
                                   "100k unique tokens x 10 epochs, a WD grid at every point, 3 seeds at K 1 and 4",
        tokenizer="gpt2-257", model=dict(BYTES | X_OPERATOR1, block_size=128), depths=[3, 4, 5, 6], width_per_depth=12,
        head_dim=12, mlp_multiple=32, passes=[1, 2, 3, 4], unique_tokens=100_000, epochs=10,
        train=dict(X_OPERATOR1_TRAIN, batch_size=16, muon_momentum_warmup=75, eval_tokens=1 << 15),
        lr_sweep=LRSweep(key="matrix_lr", values=[0.02, 0.04, 0.08], tied=X_GLR_TIED, weight_decay=0.8),
        lr_scaling_beta=-0.6, weight_decays=[0.4, 0.8, 1.6, 3.2], seeds=SEEDS, seeded_passes=[1, 4],
        bootstrap=400, threads=1, workers=2,
        budget="written before the run: 82 runs (plus bracketing), 1.75e14 FLOPs, about 57 min on 2 workers, "
               "at most 75"),
    XPreset(
        name="x-gpu-1node", about="one 8-GPU node (documented, not run): the paper's width 128 x depth, d6..d10",
        depths=[6, 7, 8, 9, 10], gpus=8, **X_GPU,
        train=dict(optimizer="muon", batch_size=16, global_batch=256, warmup_fraction=0.02, decay_fraction=0.3,
                   eval_tokens=1 << 21, data_dir=GPU_DATA)),
    XPreset(
        name="x-gpu-2node", about="two 8-GPU nodes (documented, not run): d8..d12 at width 128 x depth",
        depths=[8, 9, 10, 11, 12], gpus=16, **X_GPU,
        train=dict(optimizer="muon", batch_size=16, global_batch=256, warmup_fraction=0.02, decay_fraction=0.3,
                   eval_tokens=1 << 21, data_dir=GPU_DATA)),
]}


def get_preset(name, **overrides):
    """A copy of PRESETS[name] (the caller may change it) with the overrides that are not None."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
    preset = copy.deepcopy(PRESETS[name])
    given = {k: v for k, v in overrides.items() if v is not None}
    unknown = sorted(set(given) - {f.name for f in fields(preset)})
    if unknown:
        raise ValueError(f"preset {name}: no setting {unknown[0]!r} in a {type(preset).__name__}")
    return replace(preset, **given)
