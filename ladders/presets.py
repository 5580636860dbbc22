"""The ladder presets: one dict per design, its kind naming its protocol.
docs/ladder.md has the designs and why."""

SEEDS = [1337, 1338, 1339]
# [S]: MoE baselines, top-2 of fine-grained experts.
# With 3 KV heads, the twin (1.5x the layers)
# matches the KV cache with 2.
SMELT_MODEL = dict(n_head=6, n_kv_head=3, head_dim=8, top_k=2, layout="plain", n_passes=1,
                   norms="pre", init="x")
# A finer search grid leaves a twin in every cell.
SMELT_MATCH = dict(width_multiple=(16, 8, 4), hidden_multiple=4, expert_multiple=1,
                   head_dim_range=(4, 64), head_multiple=4)
X_ARCHS = ("vanilla", "operator-1", "loop-2", "untied-2", "loop-grow", "untied-grow")
# [X] Table 9, from the [X] code:
# tokens per stored parameter,
# and the [X16] LR exponent (d6 -> d8).
X_TPP_STORED = {"vanilla": 5.05, "operator-1": 6.06, "loop-2": 6.06, "untied-2": 6.06,
                "loop-grow": 6.6, "untied-grow": 7.24}
X_LR_BETA = {"vanilla": -0.8, "operator-1": -0.6, "loop-2": -0.6, "untied-2": -0.6,
             "loop-grow": -0.5, "untied-grow": -0.6}

SMELT = dict(kind="smelt", tokenizer="gpt2-257", model=dict(SMELT_MODEL, block_size=64),
             match=SMELT_MATCH, decay_share=0.2, sweep_tpp=None, seed_twins=False, seeds=SEEDS[:2],
             bootstrap=2000, workers=2)
X = dict(kind="x", tokenizer="gpt2-257", model=dict(block_size=128), width_per_depth=8, head_dim=8,
         depths=[3, 4, 5, 6], archs=X_ARCHS, tpp_stored=X_TPP_STORED, lr_beta=X_LR_BETA,
         train=dict(batch_size=16, eval_tokens=1 << 15), seeds=SEEDS, bootstrap=400, workers=2)
ADAMW = dict(optimizer="adamw", batch_size=16, eval_tokens=1 << 15)
BEFORE = "written before the run: "


def scale(n_layer, n_embd, **more):
    return dict(n_layer=n_layer, n_embd=n_embd, expert_hidden=n_embd // 2, **more)


def sweep(*values, extend=2, seeds=1, every=False):
    return dict(key="matrix_lr", values=[*values], extend=extend, seeds=seeds, every_point=every)


PRESETS = {
    "smelt-micro": dict(
        SMELT, about="the whole [S] pipeline on tiny models, in minutes; the numbers mean nothing",
        bootstrap=20, model=dict(SMELT_MODEL, block_size=32),
        scales={"w32": scale(4, 32), "w56": scale(4, 56)},
        cells=[("w32", 8), ("w32", 16), ("w56", 16)], branch_tpp=[0.1, 0.2, 0.3],
        train=dict(ADAMW, batch_size=4, warmup_steps=2, eval_tokens=512),
        lr=sweep(2e-3, 4e-3, extend=0)),
    "smelt-cpu-mini": dict(
        SMELT, about="[S] in miniature: 3 scales varying depth and width (F spans 10x) x 3 "
                     "sparsities, 3 decay branches, 2 baseline seeds",
        # At the top, 9 query heads on 3 KV heads.
        scales={"L2w32": scale(2, 32), "L4w56": scale(4, 56),
                "L8w72": scale(8, 72, n_head=9, n_kv_head=3)},
        cells=[(s, e) for s in ("L2w32", "L4w56", "L8w72") for e in (16, 32, 48)],
        branch_tpp=[3, 6, 12], train=dict(ADAMW, warmup_steps=20), lr=sweep(1.5e-3, 3e-3, 6e-3),
        budget=BEFORE + "114 runs, 6.6e13 FLOPs, about 55 min on 2 workers, at most "
               "90"),
    "smelt-cpu-surface": dict(
        SMELT, about="[S] designed to identify its surface: 5 scales (F 7.7x at 5 levels) x 2 "
                     "sparsities, 3 decay branches, 2 seeds of both arms, the LR swept at every "
                     "scale for both arms",
        # Even depths: the twin's 1.5x layers then meet the KV cache.
        scales={"L2w32": scale(2, 32), "L4w32": scale(4, 32), "L4w48": scale(4, 48),
                "L6w48": scale(6, 48), "L8w64": scale(8, 64)},
        # The experts the matcher finds a twin for (S .75/.9).
        # L4w32: 48 has no twin, 64's has 1,005 experts.
        cells=[("L2w32", 16), ("L2w32", 48), ("L4w32", 16), ("L4w32", 80), ("L4w48", 16),
               ("L4w48", 48), ("L6w48", 16), ("L6w48", 48), ("L8w64", 16), ("L8w64", 48)],
        train=dict(ADAMW, warmup_steps=10), branch_tpp=[2, 4, 8], sweep_tpp=4,
        seed_twins=True, lr=sweep(1.5e-3, 3e-3, 6e-3, seeds=2, every=True),
        budget=BEFORE + "220 runs (plus bracketing), 4.5e13 FLOPs, about 42 min on "
               "2 workers, at most 75"),
    "smelt-cpu-decompose": dict(
        SMELT, kind="decompose",
        about="SMELT's deficit decomposed: 3 scales x 2 token budgets x 5 arms (baseline, the "
              "twin's shape unlooped, the twin, the baseline looped, a deeper baseline), 2 seeds",
        scales={"L4w32": scale(4, 32), "L4w48": scale(4, 48), "L6w48": scale(6, 48)},
        cells=[("L4w32", 16), ("L4w48", 16), ("L6w48", 16)], budget_tpp=[4, 16],
        train=dict(ADAMW, warmup_steps=10),
        # smelt-cpu-surface's best (baseline, twin) LRs.
        lr=dict(key="matrix_lr", values=[0.006],
                arms={"L4w32": (0.006, 0.012), "L4w48": (0.006, 0.006), "L6w48": (0.003, 0.006)}),
        budget=BEFORE + "60 runs, 2.31e13 FLOPs, about 25 min on 2 workers, at most "
               "40"),
    "smelt-cpu-recipe": dict(
        kind="recipe", tokenizer="gpt2-257", workers=2,
        about="why the second visit pays in [X] and not in [S]: 1/r, MoE, optimizer, loop shape "
              "and model recipe at two levels in a half fraction (16 configurations looped and "
              "unlooped), 2 budgets, 3 seeds paired, and Operator-1's own recipe",
        # x-cpu-mini's d4 shape. The MoE:
        # 16 experts, top-2.
        model=dict(block_size=128, n_layer=4, n_embd=32, n_head=4, head_dim=8, top_k=2,
                   expert_hidden=44),
        experts=16, steps=[100, 200], calibration_seed=1337, seeds=[1338, 1339, 1340],
        train=dict(batch_size=16, eval_tokens=1 << 15), base_lr={"s": 0.006, "x": 0.1},
        lr=sweep(0.5, 1.0, 2.0),
        budget=BEFORE + "210 runs (plus bracketing), 3.52e13 FLOPs, about 21 min on "
               "2 workers, at most 30"),
    "smelt-cpu-khop": dict(
        kind="khop", workers=2,
        about="a depth task tiny models learn: k-hop induction (Sanford et al. 2024), 2 layers, 4 "
              "layers, 2 stored layers run as 4 (prelude-core-coda, SMELT), the steps calibrated "
              "on seeds not reported",
        model=dict(block_size=98), lr=dict(values=[1e-3]),
        train=dict(n_embd=48, n_head=4, head_dim=12, batch_size=32, warmup_steps=100),
        calibration_seeds=[1, 2], seeds=[1338, 1339, 1340], max_steps=5000, eval_every=250,
        margin=1.25, test_passes=6,
        arm_names={"L2": "2 layers", "L4": "4 layers", "P": "prelude-core-coda, 2 run as 4",
                   "S": "SMELT's loop, 2 run as 4"},
        budget=BEFORE + "14 runs at most, 1.54e14 FLOPs (both budgets at 5,000 "
               "steps), at most 50 min on 2 workers"),
    "x-cpu-mini": dict(
        X, about="[X] in miniature: 6 architectures x depths 3..6 at width 8 x depth, each with "
                 "its [X] recipe, TPP and [X16] LR rule, no data repetition, 3 seeds each",
        lr=sweep(0.02, 0.04, 0.08, seeds=2),
        budget=BEFORE + "96 runs, 6.3e13 FLOPs, about 30 min on 2 workers, at most "
               "60"),
    "x-cpu-mini-tuned": dict(
        X, about="x-cpu-mini with the LR tuned at every depth for every architecture: 5 "
                 "architectures (no untied-2) x depths 3..6, 3 values x 2 seeds at each",
        archs=("vanilla", "operator-1", "loop-2", "loop-grow", "untied-grow"), seeds=SEEDS[:2],
        # x-cpu-mini found every arch best at 0.16 at d3.
        lr=sweep(0.08, 0.16, 0.32, seeds=2, every=True),
        # x-cpu-mini's seconds per run,
        # + 20% for bracketing.
        budget=BEFORE + "120 runs (plus bracketing), 9.9e13 FLOPs, about 50 min on "
               "2 workers, at most 75"),
    "x-cpu-testtime": dict(
        X, kind="testtime",
        about="[X] Figure 17: Loop-2 at d4 and d6 trained at K = 2 or with K drawn from 1..4, read "
              "at K = 1..8, 3 seeds held out from the LR's choice",
        depths=[4, 6], tpp_stored=X_TPP_STORED["loop-2"], lr_beta=X_LR_BETA["loop-2"],
        choices=[1, 2, 3, 4], test_passes=8, seeds=[1339, 1340, 1341],
        # x-cpu-mini-tuned:
        # Loop-2 best at 0.16 at every depth.
        lr=dict(key="matrix_lr", values=[0.16]),
        budget=BEFORE + "12 runs, 1.35e13 FLOPs, about 7 min on 2 workers, at most "
               "15"),
}
