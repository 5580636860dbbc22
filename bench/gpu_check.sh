#!/usr/bin/env bash
# The first run on a lent CUDA machine (one H200; its image: python3 3.12, torch 2.11, triton 3.6, offline):
#
#   bash bench/gpu_check.sh             # every stage, 7 minutes at most; $OUT/summary.jsonl, $OUT/logs.tar.gz
#   bash bench/gpu_check.sh --dry-run   # this CPU, toy sizes, bench.py's stages in one process (tests)
#
# Each stage runs under its cap (seconds; all within DEADLINE) with its output in a log; a failed or stopped
# stage (rc 124: SIGABRT, so Python's faulthandler logs each thread's stack) does not stop the next.
# summary.jsonl: the JSON lines the stages print (bench.py's measurements), then {"stage", "rc", "seconds"}
# per stage; the same lines go to stdout. Two files in all. Its first run: docs/efficiency.md.
#   env       versions, the GPU, and the APIs this code uses that are newer than some torch (found or not)  20
#   shapes    bench.py: the matmul and copy ceilings; MoE layer vs grouped GEMMs vs dense, FlexAttention
#             at head size 88 vs 128 vs SDPA, the loss eager vs chunked vs compiled (s95 / d8 shapes);
#             the MoE layer's bytes per token                                                          85
#   tests     tests/test_cuda.py                                                                       70
#   profile   bench.py profile_d8: [X] d8 Loop-2 stepped eager then compiled (tokens/s, MFU, peak memory
#             vs the planner, host syncs, graphs and breaks; TORCH_LOGS in the log), top 30 kernels     135
#   s95       bench.py s95_sharded: the [S] 200M twin built sharded on the GPU, forward + backward and
#             the optimizer timed apart, peak memory vs the planner                                      60
#   train     train.py itself, config/x_d8_loop2.py on the embedded corpus (GPT-2 tokens), eager, FSDP2
#             in one process (its one-rank group, Muon's gathers, a ckpt.dcp saved)                      50
# The lent H200's torch 2.11 has the newer APIs env looks for (F.grouped_mm, src_data_rank, group_dst).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-out/gpu_check}
LOGS=$(mktemp -d)
DRY=${1:-}
mkdir -p "$OUT"
: > "$OUT/summary.jsonl"
export TRITON_DEFAULT_FP_FUSION=1 PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
ulimit -c 0  # a stage stopped by SIGABRT leaves no core file (a GPU process's would be tens of GB)

DEADLINE=420  # seconds for the whole run: a stage gets at most what is left of it
stage() {  # stage NAME CAP COMMAND...
    local name=$1 cap=$2 t0=$SECONDS rc
    shift 2
    [ $((DEADLINE - SECONDS)) -lt "$cap" ] && cap=$((DEADLINE - SECONDS))
    [ "$cap" -lt 1 ] && cap=1
    timeout -s ABRT "$cap" "$@" > "$LOGS/$name.txt" 2>&1
    rc=$?
    grep '^{' "$LOGS/$name.txt" | tee -a "$OUT/summary.jsonl"
    echo "{\"stage\": \"$name\", \"rc\": $rc, \"seconds\": $((SECONDS - t0))}" | tee -a "$OUT/summary.jsonl"
}

stage env 20 python3 -c 'import inspect, json, sys, torch, triton, torch.nn.functional as F
import torch.distributed as dist
from torch.distributed.tensor import distribute_tensor
cuda = torch.cuda.is_available()
print(json.dumps(dict(python=sys.version.split()[0], torch=torch.__version__, triton=triton.__version__,
    cuda=torch.version.cuda, gpu=torch.cuda.get_device_name() if cuda else None, features=dict(
    F_grouped_mm=hasattr(F, "grouped_mm"), torch_grouped_mm=hasattr(torch, "_grouped_mm"),
    src_data_rank="src_data_rank" in inspect.signature(distribute_tensor).parameters,
    gather_group_dst="group_dst" in inspect.signature(dist.gather).parameters))))'
if [ "$DRY" = "--dry-run" ]; then  # (train.py's settings below are checked by tests/test_bench.py)
    stage bench 180 python3 bench/bench.py --dry-run ceilings shapes profile_d8 s95_sharded
    stage tests 60 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py
else  # (one-process groups' gloo on loopback: an offline machine may not resolve its own hostname)
    export GLOO_SOCKET_IFNAME=lo
    stage shapes 85 python3 bench/bench.py --gpu ceilings shapes moe_bytes
    stage tests 70 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py
    TORCH_LOGS=graph_breaks,recompiles stage profile 135 python3 bench/bench.py --gpu ceilings profile_d8
    stage s95 60 python3 bench/bench.py --gpu s95_sharded
    python3 data/prepare.py data/corpus/shakespeare.jsonl --tokenizer gpt2 --out "$LOGS/shakespeare_gpt2" \
        > "$LOGS/prepare.txt" 2>&1
    stage train 50 python3 train.py config/x_d8_loop2.py --data_dir="$LOGS/shakespeare_gpt2" \
        --global_batch=16 --max_steps=12 --eval_interval=12 --eval_tokens=65536 --out_dir="$LOGS/train" \
        --parallel=fsdp
fi
find "$LOGS" -name 'ckpt*' -prune -exec rm -rf {} +  # checkpoints (.pt, .dcp) stay behind: the logs travel
rm -rf "$LOGS/shakespeare_gpt2"
tar -czf "$OUT/logs.tar.gz" -C "$LOGS" . && rm -rf "$LOGS"
