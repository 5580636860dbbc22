# [X] Operator-1, d8: prelude-core-coda with K = 1 and the boundary operator: Vanilla + one RMSNorm
# and one vector add per boundary.
# Numbers: the [X] code's ladder, d8 row: github.com/qlabs-eng/scaling-exponents,
# ladder_scripts/operator_1.sh, run operator_1_d08; the architecture is Table 1 of the [X] paper.
# 2355 steps x 524,288 tokens = TPP 6 on N_s = 205.8M.
# Data: FineWeb with the GPT-2 tokenizer; prepare it yourself (nothing is downloaded):
#   python data/prepare.py fineweb_docs/ --tokenizer gpt2 --out data/cache/fineweb_gpt2
# Global batch: 256 sequences x 2048 tokens on any number of GPUs (global_batch; the [X] code's 32 x 1 x 8):
# grad_accum follows from the world size, 32 x 1 on 8 GPUs, 32 x 8 on one (16 GPUs: --batch_size=16).
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
n_passes = 1
tie_core = True
boundary_alpha = 1.0
residual_multiplier = 0.5
output_multiplier = 1.0
embed_init_std = 0.11313708499  # wte_init_std
uniform_init_scale = 0.353553390593  # U(-s, s), s = uniform_init_scale / sqrt(n_embd)
# training
data_dir = "data/cache/fineweb_gpt2"
run_name = "x_d8_operator1"
optimizer = "muon"
muon_variant = "x"  # the [X] code's Muon: MuonEq-R, Polar Express, variance reduction, cautious decay
muon_momentum_warmup = 300  # momentum 0.85 -> 0.95 over the first 300 steps, as the [X] code
grad_clip = 0.0  # the [X] code never clips
matrix_lr = 0.04
embedding_lr = 0.03620386719676  # from the ladder script (not in the table above)
unembedding_lr = 0.0032  # from the ladder script (not in the table above)
weight_decay = 0.05  # Muon's cautious decay of the matrices; the embedding and lm head decay alike
embedding_weight_decay = 0.05  # the [X] code's default: the matrices' weight decay
unembedding_weight_decay = 0.05
adam_betas = (0.8, 0.98)
adam_eps = 1e-10
warmup_steps = 0
decay_fraction = 0.8  # warmdown_ratio
decay_shape = "linear"  # the [X] code's warm-down: 1 at its first step, 0 at the last
min_lr_fraction = 0.0
batch_size = 32  # sequences per micro-batch per GPU
global_batch = 256  # sequences per step on all GPUs together: grad_accum = 256 / (batch_size x GPUs)
max_steps = 2355
eval_interval = 250
final_eval_tokens = 10_000_000  # the last eval's validation tokens
