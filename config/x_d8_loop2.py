# [X] Loop-2, d8: a tied core of 3 blocks applied K = 2 times; it stores 8 blocks and executes 11.
# ladder_scripts/loop_2.sh, run loop_2_d08: 2355 steps x 524,288 tokens. As in the [X] code, the
# first core pass sees the prelude's output e itself (Algorithm 1's h0 = 0 would give alpha e).
# Micro-batch 16: two passes keep twice the activations. See the memory with
#   python match.py config/x_d8_loop2.py --memory
include("_x_d8.py")
out_dir = "out/x_d8_loop2"
# Prelude-core-coda [X1]-[X3], the [X] even split of 8 (2 / 3 / 3), a tied core.
layout = "pcc"
# BO(h, e) = RMSNorm(h) + alpha e, before the second core pass and before the coda [X3].
boundary = "both"
n_passes = 2
boundary_alpha = 0.707106781187
residual_multiplier = 0.25
embed_init_std = 0.02  # wte_init_std
uniform_init_scale = 0.0441941738242
embedding_lr = 0.0128
unembedding_lr = 0.0045254833996
weight_decay = 0.05
decay_fraction = 1.0  # warmdown_ratio
max_steps = 2355
