# [X] Operator-1, d8: prelude-core-coda with K = 1 and the boundary operator, which is Vanilla
# plus one RMSNorm and one vector add per boundary.
# ladder_scripts/operator_1.sh, run operator_1_d08: 2355 steps x 524,288 tokens = TPP 6 on
# N_s = 205.8M. Micro-batch 32: 32 x 1 on 8 GPUs, 32 x 8 on one.
include("_x_d8.py")
out_dir = "out/x_d8_operator1"
# Prelude-core-coda [X1]-[X3], the [X] even split of 8: 2 / 3 / 3.
layout = "pcc"
# BO(h, e) = RMSNorm(h) + alpha e before the coda [X3].
boundary = "both"
n_passes = 1
boundary_alpha = 1.0
residual_multiplier = 0.5
embed_init_std = 0.11313708499  # wte_init_std
uniform_init_scale = 0.353553390593
embedding_lr = 0.03620386719676
unembedding_lr = 0.0032
weight_decay = 0.05
warmup_steps = 0
decay_fraction = 0.8  # warmdown_ratio
batch_size = 32
max_steps = 2355
