# [X] Untied-2, d8: two untied cores (stores and executes 11 blocks), Loop-2's compute graph with
# its own weights per pass.
# ladder_scripts/untied_2.sh, run untied_2_d08 (the base of Untied-Grow): 2796 steps x 524,288
# tokens = TPP 6 on N_s = 244.3M. Micro-batch 16, as Loop-2.
include("_x_d8.py")
out_dir = "out/x_d8_untied2"
# Prelude-core-coda with K = 2 cores, each with its own weights.
layout = "pcc_untied"
boundary = "both"
n_passes = 2
boundary_alpha = 1.0
residual_multiplier = 0.25
embed_init_std = 0.01  # wte_init_std
uniform_init_scale = 0.353553390593
embedding_lr = 0.0064
unembedding_lr = 0.0064
weight_decay = 0.0707106781187
decay_fraction = 1.0  # warmdown_ratio
max_steps = 2796
