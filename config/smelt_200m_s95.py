# [S] 200M scale, S ~ 0.95: the SMELT twin of config/smelt_200m_base.py, as found by
#   python match.py --preset smelt-200m-s95
# SMELT recipe: loop the middle half (layers 4-9, 1-based) twice, every sublayer update inside the
# span scaled by 1/r [S8]-[S9]; 18 executed layers. Matched to the baseline on all three budgets
# (training FLOPs/token at avg_doc_len 512, non-embedding params, KV cache per token):
#   n_embd 1280 -> 1056 pays for the 6 extra layer executions (smallest width on a multiple-of-32 grid
#   with F >= F_base); experts shrink with the width (expert_hidden 432 -> 352, i.e. H/3) and their
#   number grows 192 -> 288 to restore the params; head size 128 -> 88 with 12 query heads (query width
#   = H) and 2 KV heads keeps the KV cache: 18 x 2 x 2 x 88 = 6336 vs 12 x 2 x 2 x 128 = 6144.
# Ratios to the baseline ([S] Table 10): F 1.020 (paper +2.9%), N 1.004 (paper +0.4%), KV 1.031
# (paper: within 4%); S = 0.945 against the baseline's fully activated reference.
# tests/test_match.py checks that match() reproduces exactly this file.
vocab_size = 4096
eot_token = 4095
block_size = 4096
n_layer = 12
n_embd = 1056
n_head = 12
n_kv_head = 2
head_dim = 88
n_expert = 288
top_k = 8
expert_hidden = 352
layout = "smelt"
n_loops = 2
loop_span = 6
avg_doc_len = 512  # not a model field: match.py uses it for the attention FLOPs
# training on a node of 8 GPUs of 80 GB: FSDP2 (replicated, the 3.9B parameters' weights, gradients and
# optimizer state alone take 43 GiB per GPU), 4 sequences per GPU x 8 micro-batches x 8 GPUs = 256 x 4096
# tokens per step ([S]'s batch); python -m tooling.memory config/smelt_200m_s95.py for the per-GPU memory
parallel = "fsdp"
reshard_after_forward = False  # each block gathered once per micro-batch, not per visit: 50 vs 152 GiB of all-gathers
batch_size = 4
grad_accum = 8
