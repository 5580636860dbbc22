# The tiny default (= train.py's defaults): a SMELT-looped MoE [S] on the embedded Shakespeare corpus,
# sized to train on 2 CPU cores in a few minutes. `python train.py` and `python train.py config/tiny.py`
# run the same thing (tests/test_train.py checks they agree).
# model: 4 layers, the middle 2 executed r=2 times with updates scaled by 1/2 [S8]-[S9]; 8 fine-grained
# SwiGLU experts, top-2 routing; vocab gpt2-4096 (data/tokenizer.py)
vocab_size = 4096
eot_token = 4095
block_size = 128
n_layer = 4
n_embd = 128
n_head = 4
n_expert = 8
top_k = 2
layout = "smelt"
n_loops = 2
# training: Muon on hidden matrices, AdamW on the rest; WSD with the last 30% decaying to 0
optimizer = "muon"
batch_size = 16
grad_accum = 1
max_steps = 200
warmup_steps = 20
decay_fraction = 0.3
eval_interval = 50
eval_tokens = 8192
