# [X] Loop-Grow, d8: Loop-2 that grows to K = 4 passes of the same tied core (no new weights) after
# 82% of the steps (rho = 0.18 of the tokens after growth), LR re-warmed over 40 steps (grow.py).
# Numbers: the [X] code's ladder, d8 row: github.com/qlabs-eng/scaling-exponents,
# ladder_scripts/loop_grow.sh, run loop_grow_d08; the architecture is Table 1 of the [X] paper.
# 2563 steps = grow.grown_run_tokens(t_ref 7, rho 0.18) / 524,288 ([X13]-[X14], Table 9 recipe).
# The [X] code feeds the first core pass the raw prelude output e, while the paper's Algorithm 1 has
# h0 = 0, i.e. BO(0, e) = alpha e; they differ for alpha = 0.7071, so we follow the code whose
# hyperparameters these are: zero_initial_state = False.
# Data: FineWeb with the GPT-2 tokenizer; prepare it yourself (nothing is downloaded):
#   python data/prepare.py fineweb_docs/ --tokenizer gpt2 --out data/cache/fineweb_gpt2
# Global batch: 256 sequences x 2048 tokens on any number of GPUs (global_batch; the [X] code's 32 x 1 x 8):
# grad_accum follows from the world size, 16 x 2 on 8 GPUs, 16 x 16 on one. Micro-batch 16: two passes keep
# twice the activations, and at the [X] code's 32 the run needs ~76 GiB per GPU, ~97 GiB after growing to 4 passes
# (python -m tooling.memory; PyTorch's FSDP2 memory tracker agrees within 4%, bench/fsdp_memory.py), more
# than 80 GB GPUs leave after their 10% headroom.
# Validation: each eval reads eval_tokens (8,192: a cheap curve), the last one the [X] code's 10M tokens
# (final_eval_tokens; data/prepare.py --val_tokens 10000000 holds them).
# model (Table 1: RoPE, SwiGLU, QK-norm, no biases, no norm gains, RMSNorm after the embedding)
vocab_size = 50304  # GPT-2 50257 padded to a multiple of 64, as the [X] code
n_logits = 50257  # the padded rows are cut before the softmax, as the [X] code (logits[..., :vocab])
eot_token = 50256
block_size = 2048
document_mask = False  # the [X] code trains on windows that may start inside a document, attending across them
n_layer = 8
n_embd = 1024
n_head = 8
head_dim = 128
n_expert = 0  # dense SwiGLU (say it: train.py's tiny default is an MoE)
qk_norm = True
norm_gain = False
embed_norm = True
init = "x"  # zero out-projections and lm head, normal embedding, uniform Q/K/V and MLP-in
layout = "pcc"  # prelude-core-coda [X1]-[X3], the [X] even split of 8: 2 / 3 / 3
n_prelude = 2
n_core = 3
n_coda = 3
boundary = "both"  # BO(h, e) = RMSNorm(h) + alpha e before every core pass ... [X3]
inject_before_coda = True  # ... and before the coda (the [X] code's --decoder-inject)
n_passes = 2
tie_core = True
boundary_alpha = 0.707106781187
zero_initial_state = False  # first pass sees e, as the [X] code
residual_multiplier = 0.25
output_multiplier = 1.0
embed_init_std = 0.02  # wte_init_std
uniform_init_scale = 0.0441941738242  # U(-s, s), s = uniform_init_scale / sqrt(n_embd)
# training
data_dir = "data/cache/fineweb_gpt2"
run_name = "x_d8_loop_grow"
optimizer = "muon"
muon_variant = "x"  # the [X] code's Muon: MuonEq-R, Polar Express, variance reduction, cautious decay
muon_momentum_warmup = 300  # momentum 0.85 -> 0.95 over the first 300 steps, as the [X] code
grad_clip = 0.0  # the [X] code never clips
matrix_lr = 0.04
embedding_lr = 0.0128  # from the ladder script (not in the table above)
unembedding_lr = 0.0045254833996  # from the ladder script (not in the table above)
weight_decay = 0.05  # Muon's cautious decay of the matrices; the embedding and lm head decay alike
embedding_weight_decay = 0.05  # the [X] code's default: the matrices' weight decay
unembedding_weight_decay = 0.05
adam_betas = (0.8, 0.95)
adam_eps = 1e-10
warmup_steps = 40
decay_fraction = 1.0  # warmdown_ratio
decay_shape = "linear"  # the [X] code's warm-down: 1 at its first step, 0 at the last
min_lr_fraction = 0.0
batch_size = 16  # sequences per micro-batch per GPU
global_batch = 256  # sequences per step on all GPUs together: grad_accum = 256 / (batch_size x GPUs)
max_steps = 2563
grow_at = 0.82  # crossover fraction of max_steps (loop_grow_d08 --core-repetition-crossover-fraction)
grow_to = 4
grow_untie = False
grow_rewarm_steps = 40
eval_interval = 250
final_eval_tokens = 10_000_000  # the last eval's validation tokens
