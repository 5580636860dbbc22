# The [X] d8 recipe config/x_d8_*.py include; not a run. Numbers: the d8 rows of the [X] code's
# ladder (github.com/qlabs-eng/scaling-exponents, ladder_scripts/*.sh). Data: FineWeb-Edu in the
# GPT-2 tokenizer, padded to 50,304 (docs/training.md).
# Not reproduced (docs/training.md): the [X] code's attention across documents, and the AdamW
# betas of Operator-1 (0.8, 0.98) and Untied-2 (0.8, 0.99); here (0.8, 0.95).

# The model, [X] Table 1: RoPE, SwiGLU, QK-norm, no biases, no norm gains, a norm after wte.
block_size = 2048
n_layer = 8
n_embd = 1024
n_head = 8
head_dim = 128
# A dense SwiGLU (train.py's tiny default is an MoE).
n_expert = 0
norms = "x"
# Zero out-projections and lm head, a normal wte, uniform Q/K/V and MLP-in.
init = "x"

# Training: the [X] code's Muon recipe (momentum warmup, linear warm-down, no clipping).
data_dir = "data/cache/fineweb_gpt2"
optimizer = "muon_x"
matrix_lr = 0.04
warmup_steps = 40
# Per GPU; a step is 256 x 2048 tokens on any number of GPUs.
batch_size = 16
global_batch = 256
eval_interval = 250
eval_tokens = 10_000_000
