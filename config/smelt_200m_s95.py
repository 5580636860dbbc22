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
# training, the [S] recipe: AdamW + WSD. A stable phase at a constant LR for 196,075 steps of 256 sequences
# x 4096 tokens (205.6B tokens, [S]'s ~1M-token batch), keeping checkpoints at 10k / 20k / 50k / 100k /
# 150k steps; from each of them and from the end a cosine decay branch over 10B tokens the stable phase
# never read (the held-back tail of the data). The baseline and its SMELT twin read identical token
# sequences (same data, seed, global batch and context); the document (segment) mask is on. [S] does not
# state AdamW's learning rates, betas or warmup: train.py's AdamW defaults and a 2000-step warmup are ours.
#   python ladder.py --plan config/smelt_200m_s95.py      # every run of the recipe, and the tokens the data must hold
optimizer = "adamw"
max_steps = 196075
warmup_steps = 2000
decay_fraction = 0.0  # stable to the end: the decays are the branches
save_steps = [10000, 20000, 50000, 100000, 150000]
decay_tokens = 10_000_000_000  # each branch's (given again on a branch's command line: the plan prints it)
decay_shape = "cosine"
branch_data_fraction = 0.0464  # the held-back tail holds one branch's 10.0B of 215.6B train tokens
data_dir = "data/cache/smelt_gpt2_4096"  # your corpus: python data/prepare.py DOCS --tokenizer gpt2-4096 --out this
# a node of 8 GPUs of 80 GB, or two: FSDP2 (replicated, the 3.9B parameters' weights, gradients and optimizer
# state alone take 43 GiB per GPU); 4 sequences per GPU, grad_accum from the world size (8 on 8 GPUs, 4 on
# 16); python -m tooling.memory config/smelt_200m_s95.py for the per-GPU memory
parallel = "fsdp"
reshard_after_forward = False  # each block gathered once per micro-batch, not per visit: 50 vs 152 GiB of all-gathers
batch_size = 4
global_batch = 256  # sequences per step on any number of GPUs (grad_accum follows)
# validation: [S] averages its loss over billions of held-out tokens from 39 sources; every eval here reads
# 256 windows spread over the split (each source in), the last one up to 2B tokens (at most the split)
eval_tokens = 1_048_576
final_eval_tokens = 2_000_000_000
