# The [X] d8 recipe the six config/x_d8_*.py share (each includes it, then gives its own numbers); not a run.
# Numbers: the [X] code's ladder, d8 rows (github.com/qlabs-eng/scaling-exponents, ladder_scripts/*.sh);
# the architecture is [X] Table 1. Data: FineWeb-Edu with the GPT-2 tokenizer (50,257, padded to 50,304
# as the [X] code), prepared by you (docs/data.md). Global batch: 256 x 2048 tokens on any number of GPUs.
# Not reproduced here (docs/training.md): the [X] code's across-document attention (train.py keeps the
# document mask) and the Operator-1 / Untied-2 AdamW betas (0.8, 0.98) / (0.8, 0.99) (here (0.8, 0.95)).
# model ([X] Table 1: RoPE, SwiGLU, QK-norm, no biases, no norm gains, RMSNorm after the embedding)
block_size = 2048
n_layer = 8
n_embd = 1024
n_head = 8
head_dim = 128
n_expert = 0  # dense SwiGLU (train.py's tiny default is an MoE)
norms = "x"
init = "x"  # zero out-projections and lm head, normal embedding, uniform Q/K/V and MLP-in
# training: the [X] code's Muon recipe (momentum warmup, linear warm-down, no clipping), evals of 10M tokens
data_dir = "data/cache/fineweb_gpt2"
optimizer = "muon_x"
matrix_lr = 0.04
warmup_steps = 40
batch_size = 16  # sequences per micro-batch per GPU
global_batch = 256  # sequences per step on all GPUs together: grad_accum = 256 / (batch_size x GPUs)
eval_interval = 250
eval_tokens = 10_000_000
