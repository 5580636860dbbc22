# The [X] d8 recipe the six config/x_d8_*.py share (each includes it, then gives its own numbers); not a run.
# Numbers: the [X] code's ladder, d8 rows: github.com/qlabs-eng/scaling-exponents, ladder_scripts/*.sh;
# the architecture is Table 1 of the [X] paper.
# Data: FineWeb with the GPT-2 tokenizer; prepare it yourself (nothing is downloaded):
#   python data/prepare.py fineweb_docs/ --tokenizer gpt2 --out data/cache/fineweb_gpt2
# Global batch: 256 sequences x 2048 tokens on any number of GPUs (global_batch; the [X] code's 32 x 1 x 8):
# grad_accum follows from the world size and the micro-batch (batch_size) of each config.
# Validation: each eval reads eval_tokens (8,192: a cheap curve), the last one the [X] code's 10M tokens
# (final_eval_tokens; data/prepare.py --val_tokens 10000000 holds them).
# model (Table 1: RoPE, SwiGLU, QK-norm, no biases, no norm gains, RMSNorm after the embedding)
vocab_size = 50304  # GPT-2 50257 padded to a multiple of 64, as the [X] code: the padded rows are cut
#   before the softmax (train.py takes the data's 50257 as n_logits, its eot 50256; [X]: logits[..., :vocab])
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
output_multiplier = 1.0
# training
data_dir = "data/cache/fineweb_gpt2"
optimizer = "muon_x"  # the [X] code's Muon: MuonEq-R, Polar Express, variance reduction, cautious decay
muon_momentum_warmup = 300  # momentum 0.85 -> 0.95 over the first 300 steps, as the [X] code
grad_clip = 0.0  # the [X] code never clips
matrix_lr = 0.04
adam_betas = (0.8, 0.95)
adam_eps = 1e-10
warmup_steps = 40
decay_shape = "linear"  # the [X] code's warm-down: 1 at its first step, 0 at the last
batch_size = 16  # sequences per micro-batch per GPU
global_batch = 256  # sequences per step on all GPUs together: grad_accum = 256 / (batch_size x GPUs)
eval_interval = 250
final_eval_tokens = 10_000_000  # the last eval's validation tokens
