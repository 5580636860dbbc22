# [X] Loop-2, d8: a tied core of 3 blocks applied K = 2 times (stores 8 blocks, executes 11).
# ladder_scripts/loop_2.sh, run loop_2_d08: 2355 steps x 524,288 tokens. The first core pass sees the
# prelude output e itself, as the [X] code (Algorithm 1's h0 = 0 would give it alpha e).
# Micro-batch 16: two passes keep twice the activations (python match.py config/x_d8_loop2.py --memory).
include("_x_d8.py")
out_dir = "out/x_d8_loop2"
layout = "pcc"  # prelude-core-coda [X1]-[X3], the [X] even split of 8: 2 / 3 / 3, a tied core
boundary = "both"  # BO(h, e) = RMSNorm(h) + alpha e before the second core pass and before the coda [X3]
n_passes = 2
boundary_alpha = 0.707106781187
residual_multiplier = 0.25
embed_init_std = 0.02  # wte_init_std
uniform_init_scale = 0.0441941738242  # U(-s, s), s = uniform_init_scale / sqrt(n_embd)
embedding_lr = 0.0128
unembedding_lr = 0.0045254833996
weight_decay = 0.05
decay_fraction = 1.0  # warmdown_ratio
max_steps = 2355
