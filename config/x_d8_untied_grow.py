# [X] Untied-Grow, d8 (Algorithm 1): two untied cores, copied C1 C2 -> C1 C2 C1 C2 after 71% of the
# steps (rho = 0.29), the LR re-warmed over 40 steps. The [X] code allocates all four cores from the
# start and keeps two dormant; here grow.py inserts the copies at the switch (the same function).
# ladder_scripts/untied_grow.sh, run untied_grow_d08: 3341 steps = grow.grown_run_tokens(t_ref 8, rho 0.29) /
# 524,288 ([X13]-[X14], Table 9 recipe).
include("x_d8_untied2.py")
out_dir = "out/x_d8_untied_grow"
max_steps = 3341
grow_at = 0.71  # crossover fraction of max_steps (untied_grow_d08 --core-repetition-crossover-fraction)
