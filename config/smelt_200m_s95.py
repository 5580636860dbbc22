# [S] 200M scale, S ~ 0.95: the SMELT twin of config/smelt_200m_base.py, as found by
#   python match.py --preset smelt-200m-s95
# SMELT loops the middle half (layers 4-9, 1-based) twice, each update inside scaled by 1/r
# [S8]-[S9]: 18 executed layers. Matched to the baseline on training FLOPs/token (mean document
# length 512), non-embedding params and KV cache:
#   n_embd 1280 -> 1056 pays for the 6 extra layers (the smallest width, on a grid of 32, with
#   F >= F_base). Experts shrink with the width (expert_hidden H/3 = 352) and grow in number,
#   192 -> 288, to restore the params. 12 heads of 88 and 2 KV heads keep the KV cache:
#   18 x 2 x 2 x 88 = 6336 vs 12 x 2 x 2 x 128 = 6144.
# Ratios to the baseline ([S] Table 10): F 1.020 (paper +2.9%), N 1.004 (paper +0.4%), KV 1.031
# (paper: within 4%); S = 0.945. tests/test_match.py checks that match() gives exactly this file.

# The baseline's data, training and evaluation; its model, matched:
include("smelt_200m_base.py")
n_embd = 1056
n_head = 12
head_dim = 88
n_expert = 288
expert_hidden = 352
layout = "smelt"
n_passes = 2
out_dir = "out/smelt_200m_s95"
