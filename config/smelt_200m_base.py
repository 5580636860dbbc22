# [S] 200M scale, S ~ 0.95: the baseline of the paper's worked example ("matching", Appendix A).
#   python match.py config/smelt_200m_base.py   -> the accounting table
#   python match.py --preset smelt-200m-s95     -> this baseline and its matched SMELT twin
#
# Given by the paper: L = 12, H = 1280, 192 experts per layer, top-8, GQA, a 4096-token packed
# context with a document mask, 1.33e9 training FLOPs/token at the average document length,
# 3.87e9 non-embedding params, 0.207B of them active.
# Chosen here (the paper does not say):
#   expert_hidden: total - active = 12 layers x (192 - 8) experts x 3 x 1280 x e = 3.87e9 -
#     0.207e9 gives e = 432.0 (H/3 rounded up to a multiple of 16). The twin's 1056/3 = 352 then
#     puts its params at +0.4%, as the paper reports.
#   Heads: 10 x 128 (query width = H) and 2 KV heads give 0.209B active params (paper 0.207B; one
#     KV head: 0.205B). KV cache: 12 x 2 x 2 x 128 = 6144 elements/token.
#   Vocabulary: 4096, the gpt2-4096 tokenizer (match.py: --vocab_size). Its unembedding's 3.1e7
#     FLOPs are counted; a 50k vocabulary alone would add 0.39e9 and overshoot 1.33e9.
#   Documents of 512 tokens on average: 256.5 keys per query, so attention adds 4.7e7 FLOPs/token.
#   Result: 1.335e9 FLOPs/token (+0.4%), 3.872e9 non-embedding params (+0.1%), S = 0.946.
block_size = 4096
n_layer = 12
n_embd = 1280
n_head = 10
n_kv_head = 2
head_dim = 128
n_expert = 192
top_k = 8
expert_hidden = 432
layout = "plain"

# Training, the [S] recipe: AdamW and WSD. A stable phase of 196,075 steps of 256 x 4096 tokens
# (205.6B tokens, [S]'s ~1M-token batch), with checkpoints at 10k to 150k steps. From each, and
# from the end, a cosine decay branch over 10B tokens the stable phase never read. The baseline
# and its twin read identical token sequences. [S] does not state AdamW's LRs, betas or warmup:
# ours are train.py's AdamW defaults and a 2000-step warmup.
optimizer = "adamw"
max_steps = 196075
warmup_steps = 2000
# Stable to the end: the decays are the branches.
decay_fraction = 0.0
save_steps = [10000, 20000, 50000, 100000, 150000]
# A branch reads the held-back last 10% of the train split, so prepare at least 230B tokens:
#   python data/prepare.py DOCS --tokenizer gpt2-4096 --out data/cache/smelt_gpt2_4096
#   python train.py --init_from=out/smelt_200m_base/ckpt_step10000.dcp --decay_tokens=1e10
data_dir = "data/cache/smelt_gpt2_4096"

# One or two nodes of 8 GPUs of 80 GB. Replicated, the weights, gradients and optimizer state
# alone would take 43 GiB per GPU, hence FSDP2. grad_op gathers each block once per micro-batch,
# not per visit: 50 vs 152 GiB. Per GPU: python match.py config/smelt_200m_base.py --memory
parallel = "fsdp_grad_op"
# The largest power of 2 whose activations fit 80 GB unrecomputed (planner: 61 GiB for s95).
batch_size = 8
global_batch = 256

# [S] averages its validation loss over billions of tokens from 39 sources. Every eval here reads
# 100M tokens spread over the split; a branch may ask for more (--eval_tokens=2e9).
eval_interval = 5000
eval_tokens = 100_000_000
out_dir = "out/smelt_200m_base"
