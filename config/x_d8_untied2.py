# [X] Untied-2, d8: two untied cores (stores and executes 11 blocks): Loop-2's compute graph with
# its own weights per pass.
# ladder_scripts/untied_2.sh, run untied_2_d08 (its Untied-Grow base recipe): 2796 steps x 524,288 tokens
# = TPP 6 on N_s = 244.3M. Micro-batch 16 as Loop-2.
include("_x_d8.py")  # the shared [X] d8 recipe
layout = "pcc"  # prelude-core-coda [X1]-[X3], the [X] even split of 8: 2 / 3 / 3
boundary = "both"  # BO(h, e) = RMSNorm(h) + alpha e before every core pass and before the coda [X3]
n_passes = 2
tie_core = False
boundary_alpha = 1.0
residual_multiplier = 0.25
embed_init_std = 0.01  # wte_init_std
uniform_init_scale = 0.353553390593  # U(-s, s), s = uniform_init_scale / sqrt(n_embd)
run_name = "x_d8_untied2"
embedding_lr = 0.0064
unembedding_lr = 0.0064
weight_decay = 0.0707106781187  # Muon's cautious decay of the matrices; the embedding and lm head alike
adam_betas = (0.8, 0.99)
adam_eps = 1e-08
decay_fraction = 1.0  # warmdown_ratio
max_steps = 2796  # from the ladder script (not in the table above)
