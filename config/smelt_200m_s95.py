# [S] 200M scale, S ~ 0.95: the SMELT twin of config/smelt_200m_base.py, as found by
#   python match.py --preset smelt-200m-s95
# SMELT recipe: loop the middle half (layers 4-9, 1-based) twice, every sublayer update inside the
# span scaled by 1/r [S8]-[S9]; 18 executed layers. Matched to the baseline on all three budgets
# (training FLOPs/token at a mean document length of 512, non-embedding params, KV cache per token):
#   n_embd 1280 -> 1056 pays for the 6 extra layer executions (smallest width on a multiple-of-32 grid
#   with F >= F_base); experts shrink with the width (expert_hidden 432 -> 352, i.e. H/3) and their
#   number grows 192 -> 288 to restore the params; head size 128 -> 88 with 12 query heads (query width
#   = H) and 2 KV heads keeps the KV cache: 18 x 2 x 2 x 88 = 6336 vs 12 x 2 x 2 x 128 = 6144.
# Ratios to the baseline ([S] Table 10): F 1.020 (paper +2.9%), N 1.004 (paper +0.4%), KV 1.031
# (paper: within 4%); S = 0.945 against the baseline's fully activated reference.
# tests/test_match.py checks that match() reproduces exactly this file.
include("smelt_200m_base.py")  # the baseline's data, training recipe and evaluation; its model, matched:
n_embd = 1056
n_head = 12
head_dim = 88
n_expert = 288
expert_hidden = 352
layout = "smelt"
n_passes = 2
out_dir = "out/smelt_200m_s95"
