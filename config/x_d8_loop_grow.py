# [X] Loop-Grow, d8: Loop-2 that grows to K = 4 passes of the same tied core (no new weights) after
# 82% of the steps (rho = 0.18 of the tokens after growth), LR re-warmed over 40 steps (grow.py).
# ladder_scripts/loop_grow.sh, run loop_grow_d08: 2563 steps = grow.grown_run_tokens(t_ref 7, rho 0.18) /
# 524,288 ([X13]-[X14], Table 9 recipe). Micro-batch 16 as Loop-2: ~97 GiB per GPU after growing at 32.
include("x_d8_loop2.py")  # Loop-2's recipe, which includes the shared [X] d8 one
run_name = "x_d8_loop_grow"
max_steps = 2563
grow_at = 0.82  # crossover fraction of max_steps (loop_grow_d08 --core-repetition-crossover-fraction)
grow_to = 4
grow_rewarm_steps = 40
