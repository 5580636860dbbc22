# [X] Loop-Grow, d8: Loop-2 that grows to K = 4 passes of the same tied core (no new weights)
# after 82% of the steps (rho = 0.18 of the tokens after growth); the LR re-warms over 40 steps.
# ladder_scripts/loop_grow.sh, run loop_grow_d08: 2563 steps =
# grow.grown_run_tokens(t_ref 7, rho 0.18) / 524,288 ([X13]-[X14], the Table 9 recipe).
include("x_d8_loop2.py")
out_dir = "out/x_d8_loop_grow"
max_steps = 2563
grow_at = 0.82  # --core-repetition-crossover-fraction
