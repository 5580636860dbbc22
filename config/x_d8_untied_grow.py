# [X] Untied-Grow, d8 (Algorithm 1): two untied cores, copied C1 C2 -> C1 C2 C1 C2 after 71% of the
# steps (rho = 0.29), LR re-warmed over 40 steps. The [X] code allocates all four cores from the
# start and keeps two dormant; here grow.py inserts the copies at the switch (same function).
# grow_untie stays False: the model is already untied (grow_untie=True is for a TIED model).
# ladder_scripts/untied_grow.sh, run untied_grow_d08: 3341 steps = grow.grown_run_tokens(t_ref 8, rho 0.29) /
# 524,288 ([X13]-[X14], Table 9 recipe).
include("x_d8_untied2.py")  # Untied-2's recipe, which includes the shared [X] d8 one
run_name = "x_d8_untied_grow"
max_steps = 3341
grow_at = 0.71  # crossover fraction of max_steps (untied_grow_d08 --core-repetition-crossover-fraction)
grow_to = 4
grow_rewarm_steps = 40
