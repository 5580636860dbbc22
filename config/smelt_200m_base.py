# [S] 200M scale, S ~ 0.95: the baseline of the paper's worked example (section "matching", Appendix A).
#   python match.py config/smelt_200m_base.py          -> accounting table
#   python match.py --preset smelt-200m-s95            -> this baseline and its matched SMELT twin
#
# Given by the paper: L = 12, H = 1280, 192 experts per layer, top-8 routing, GQA, 4096-token packed
# context with a document (segment) mask; 1.33e9 training FLOPs/token at the average document length,
# 3.87e9 non-embedding params, 0.207B active non-embedding params.
# Chosen here (unstated in the paper), and why:
#   expert_hidden = 432: total - active = 12 layers x (192 - 8) experts x 3 x 1280 x e = 3.87e9 - 0.207e9
#       gives e = 432.0 (= H/3 rounded up to a multiple of 16; the matched twin then gets
#       1056/3 = 352, which lands its params at +0.4% exactly as the paper reports).
#   heads: 10 x 128 (query width = H), 2 KV heads (GQA 5:1): active params 0.209B (paper 0.207B; one KV
#       head would give 0.205B). KV = 12 x 2 x 2 x 128 = 6144 elements/token.
#   vocab 4096: the project's gpt2-4096 tokenizer (train.py takes it from the data; match.py: --vocab_size).
#       The unembedding (6 x 1280 x 4096 = 3.1e7 FLOPs) is counted; with a 50k vocab it alone would add
#       0.39e9 and overshoot 1.33e9, so the paper's figure cannot include a large-vocabulary head.
#   documents of 512 tokens on average (attended (512+1)/2 = 256.5 keys per query: train.py logs FLOPs at
#       the data's mean document length): attention scores + PV add 4.7e7 FLOPs/token.
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
# training, the [S] recipe: AdamW + WSD. A stable phase at a constant LR for 196,075 steps of 256 sequences
# x 4096 tokens (205.6B tokens, [S]'s ~1M-token batch), keeping checkpoints at 10k / 20k / 50k / 100k /
# 150k steps; from each of them and from the end a cosine decay branch over 10B tokens the stable phase
# never read (the held-back tail of the data). The baseline and its SMELT twin read identical token
# sequences (same data, seed, global batch and context); the document (segment) mask is on. [S] does not
# state AdamW's learning rates, betas or warmup: train.py's AdamW defaults and a 2000-step warmup are ours.
optimizer = "adamw"
max_steps = 196075
warmup_steps = 2000
decay_fraction = 0.0  # stable to the end: the decays are the branches
save_steps = [10000, 20000, 50000, 100000, 150000]
# each branch, e.g.:
#   python train.py --init_from=out/smelt_200m_base/ckpt_step10000.dcp --decay_tokens=10_000_000_000
#   reads the held-back tail (the last 10% of the train split): prepare at least 230B train tokens.
# your corpus: python data/prepare.py DOCS --tokenizer gpt2-4096 --out data/cache/smelt_gpt2_4096
data_dir = "data/cache/smelt_gpt2_4096"
# a node of 8 GPUs of 80 GB, or two: FSDP2 (replicated, the 3.9B parameters' weights, gradients and optimizer
# state alone take 43 GiB per GPU); 8 sequences per GPU, grad_accum from the world size (4 on 8 GPUs, 2 on
# 16); python match.py config/smelt_200m_base.py --memory for the per-GPU memory
parallel = "fsdp_grad_op"  # each block gathered once per micro-batch, not per visit: 50 vs 152 GiB gathered
batch_size = 8  # the largest power of 2 whose activations fit 80 GB unrecomputed (planner: 61 GiB s95)
global_batch = 256  # sequences per step on any number of GPUs (grad_accum follows)
# validation: [S] averages its loss over billions of held-out tokens from 39 sources; every eval here reads
# 100M tokens spread over the split (each source in); a branch's command may ask for more (--eval_tokens=2e9)
eval_interval = 5000
eval_tokens = 100_000_000
out_dir = "out/smelt_200m_base"
