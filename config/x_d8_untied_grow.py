# [X] Untied-Grow, d8 (Algorithm 1): two untied cores, copied C1 C2 -> C1 C2 C1 C2 after 71% of
# the steps (rho = 0.29); the LR re-warms over 40 steps. The [X] code keeps two of four cores
# dormant until then; grow.py inserts the copies instead, the same function.
# ladder_scripts/untied_grow.sh, run untied_grow_d08: 3341 steps =
# grow.grown_run_tokens(t_ref 8, rho 0.29) / 524,288 ([X13]-[X14], the Table 9 recipe).
include("x_d8_untied2.py")
out_dir = "out/x_d8_untied_grow"
max_steps = 3341
grow_at = 0.71  # --core-repetition-crossover-fraction
