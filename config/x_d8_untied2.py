# [X] Untied-2, d8: two untied cores (stores and executes 11 blocks): Loop-2's compute graph with
# its own weights per pass.
# Numbers: the [X] code's ladder, d8 row (its Untied-Grow base recipe): github.com/qlabs-eng/scaling-exponents,
# ladder_scripts/untied_2.sh, run untied_2_d08; the architecture is Table 1 of the [X] paper.
# 2796 steps x 524,288 tokens = TPP 6 on N_s = 244.3M.
# Data: FineWeb with the GPT-2 tokenizer; prepare it yourself (nothing is downloaded):
#   python data/prepare.py fineweb_docs/ --tokenizer gpt2 --out data/cache/fineweb_gpt2
# Global batch: 256 sequences x 2048 tokens on any number of GPUs (global_batch; the [X] code's 32 x 1 x 8):
# grad_accum follows from the world size, 16 x 2 on 8 GPUs, 16 x 16 on one. Micro-batch 16: two passes keep
# twice the activations, and at the [X] code's 32 the run needs ~76 GiB per GPU
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
tie_core = False
boundary_alpha = 1.0
residual_multiplier = 0.25
output_multiplier = 1.0
embed_init_std = 0.01  # wte_init_std
uniform_init_scale = 0.353553390593  # U(-s, s), s = uniform_init_scale / sqrt(n_embd)
# training
data_dir = "data/cache/fineweb_gpt2"
run_name = "x_d8_untied2"
optimizer = "muon"
muon_variant = "x"  # the [X] code's Muon: MuonEq-R, Polar Express, variance reduction, cautious decay
muon_momentum_warmup = 300  # momentum 0.85 -> 0.95 over the first 300 steps, as the [X] code
grad_clip = 0.0  # the [X] code never clips
matrix_lr = 0.04
embedding_lr = 0.0064
unembedding_lr = 0.0064
weight_decay = 0.0707106781187  # Muon's cautious decay of the matrices; the embedding and lm head decay alike
embedding_weight_decay = 0.0707106781187  # the [X] code's default: the matrices' weight decay
unembedding_weight_decay = 0.0707106781187
adam_betas = (0.8, 0.99)
adam_eps = 1e-08
warmup_steps = 40
decay_fraction = 1.0  # warmdown_ratio
decay_shape = "linear"  # the [X] code's warm-down: 1 at its first step, 0 at the last
min_lr_fraction = 0.0
batch_size = 16  # sequences per micro-batch per GPU
global_batch = 256  # sequences per step on all GPUs together: grad_accum = 256 / (batch_size x GPUs)
max_steps = 2796  # from the ladder script (not in the table above)
eval_interval = 250
final_eval_tokens = 10_000_000  # the last eval's validation tokens
