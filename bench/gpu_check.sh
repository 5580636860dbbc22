#!/usr/bin/env bash
# The first run on a lent CUDA machine (one H200: ~139 GiB, 16 cores, 64 GiB disk, a 15-minute lend with its
# start-up): every stage through train.py, one JSON line each (paste them into docs/efficiency.md), logs in
# $OUT/gpu_check/. The stages are bench/gpu_check.py's; this file holds their budget.
#
#   bash bench/gpu_check.sh all                # env correctness distributed tiny x_d8 s95: ~6.6 min, stopped at 8
#   bash bench/gpu_check.sh s95                # one stage again (each fits in a rerun: none over 4 min)
#   bash bench/gpu_check.sh s95_compile        # extra, not in all: the [S] twin compiled (~3.3 min)
#   bash bench/gpu_check.sh --dry-run all      # this CPU, toy sizes: every stage's plumbing (~1.5 min)
#
# Budget, estimated from first principles (s: estimate / cap; a stage's commands are stopped at its cap, and
# `all` starts no stage after 480 s). Per train.py process: ~6 s of Python, torch and CUDA start-up; the first
# FlexAttention compile of a shape ~25 s (then inductor's on-disk cache); inductor compiling a whole training
# step ~45-60 s for 6-11 executed blocks; H200 at 989.5 TFLOP/s dense bf16, a step at ~30-40% of it.
#   env          10 / 30   versions, GPU, disk (one Python process)
#   correctness  60 / 150  tests/test_cuda.py (grouped GEMM vs the per-expert loop, bf16, align 1 and 8: ~15 s);
#                          kernel tests compiled for the GPU (35 Triton variants x ~1 s + pytest: ~45 s)
#   distributed  45 / 120  tiny MoE, FSDP2 under torchrun on every GPU: 3 steps to a sharded checkpoint (pays
#                          the tiny FlexAttention compile, ~35 s), resumed to 6 (~10 s); DDP too on 2+ GPUs
#   tiny         60 / 150  tiny MoE, 5 + 10 steps of 16 x 128 tokens: eager (~10 s), --compile (~50 s)
#   x_d8        105 / 210  [X] d8 Loop-2, 16 x 2048 x 2 micro-batches (4.2e13 FLOPs/step, ~0.3 s): data 2 s,
#                          eager ~15 s, --compile ~65 s (11 executed blocks), --triton ~25 s (kernel JIT)
#   s95         115 / 225  [S] 200M-S95 twin, 3.9B params, FSDP2 in one process, 2 x 4096 x 2 (2.2e13
#                          FLOPs/step + AdamW over 3.9B, ~0.3 s): eager ~60 s (3.9B-param init ~25 s, its
#                          FlexAttention compile ~25 s), --triton ~45 s, the dense twin eager ~12 s
#   all         395 / 480
#   s95_compile 200 / 240  extra: the twin under --compile (inductor on 18 executed MoE layers ~150 s)
# Writes: logs (64 KiB per command) under $OUT; train.py runs into a mktemp scratch folder deleted at the end
# (the tiny's checkpoints ~50 MB; x_d8 and s95 write none: train.py --save_checkpoints=False); inductor and
# Triton keep their caches in /tmp and ~/.triton. Reads: data/corpus/ only, prepared here (1 s per tokenizer).
# STATUS: PREPARED, NOT YET RUN on a GPU; its dry run passes on CPU (tests/test_bench.py runs part). Anchor: [X]
# code reaches ~42% MFU on 8 x H100 ([X] Table 4).
set -uo pipefail
cd "$(dirname "$0")/.."
export TRITON_DEFAULT_FP_FUSION=1  # triton 3.9 warns when unset; 1 keeps its current default
exec python bench/gpu_check.py "$@"
