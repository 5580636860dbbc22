# [X] Vanilla, d8: a plain pre-norm transformer of 8 blocks, width 128 x 8 = 1024, no boundary
# operator. ladder_scripts/vanilla.sh, run vanilla_d08: 1962 steps x 524,288 tokens = TPP 5 on
# N_s = 205.8M stored params, token embedding included. Micro-batch 32: 32 x 1 on 8 GPUs,
# 32 x 8 on one.
include("_x_d8.py")
out_dir = "out/x_d8_vanilla"
layout = "plain"
residual_multiplier = 0.25
output_multiplier = 0.5
embed_init_std = 0.00707106781187  # wte_init_std
uniform_init_scale = 0.0625
embedding_lr = 0.01810193359836
unembedding_lr = 0.0045254833996
# Muon's cautious decay of the matrices; the embedding and lm head decay alike.
weight_decay = 0.0707106781187
decay_fraction = 0.6  # warmdown_ratio
batch_size = 32
max_steps = 1962
