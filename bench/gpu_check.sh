#!/usr/bin/env bash
# The run on a lent CUDA machine (one H100 or H200; its image: python3 3.12, torch 2.11, triton 3.6, offline):
#
#   bash bench/gpu_check.sh             # every stage, 7.5 minutes at most: $OUT/summary.jsonl, logs.tar.gz
#   bash bench/gpu_check.sh --dry-run   # every stage on this CPU at toy sizes (tests/test_bench.py)
#
# Each stage runs under its cap (seconds; all within DEADLINE) with its output in a log; a failed or stopped
# stage (rc 124: SIGABRT, so Python's faulthandler logs each thread's stack) does not stop the next. The
# headline first, each stage with its own cap. summary.jsonl: the JSON lines the stages print, then
# {"stage", "rc", "seconds"} per stage; the same lines go to stdout. Two files in all (a lend returns 8).
#   env       versions, the GPU, and the APIs this code uses that are newer than some torch               20
#   d8        bench.py profile_d8: [X] d8 Loop-2 compiled as train.py compiles it (each block, the loss): a
#             step's tokens/s, MFU of the GPU's peak and of the measured matmul, warm-up seconds, peak
#             memory vs the planner, graphs and breaks, one compiled micro-batch's top kernels          150
#   train     train.py itself on the embedded corpus (GPT-2 tokens), d8 Loop-2 under FSDP2 in one process:
#             8 steps, and 4 steps then a resume to 8; its log's speed, and whether the resume continues
#             the straight run's log exactly                                                           110
#   s95       bench.py s95_sharded: the [S] 200M twin and its baseline built sharded as train.py builds
#             them, a step's tokens/s with activation checkpointing on and (where the planner says it
#             fits) off, peak memory vs the planner                                                      90
#   tests     tests/test_cuda.py                                                                         60
#   d8_eager  profile_d8 eager: what compiling gains                                              the rest
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-out/gpu_check}
LOGS=$(mktemp -d)
DRY=${1:-}
mkdir -p "$OUT"
: > "$OUT/summary.jsonl"
export TRITON_DEFAULT_FP_FUSION=1 PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
ulimit -c 0  # a stage stopped by SIGABRT leaves no core file (a GPU process's would be tens of GB)

DEADLINE=450  # seconds for the whole run: a stage gets at most what is left of it
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

resume_check() {  # train.py ARGS: 8 steps straight; 4, then a resume to 8; one JSON line comparing the logs
    local run="python3 train.py $* --decay_fraction=0.0 --eval_interval=4"
    $run --max_steps=8 --out_dir="$LOGS/straight" && $run --max_steps=4 --out_dir="$LOGS/resumed" &&
        python3 train.py --out_dir="$LOGS/resumed" --init_from=resume --max_steps=8 &&
        python3 - "$LOGS" <<'PY'
import json, sys
log = lambda name: [json.loads(line) for line in open(f"{sys.argv[1]}/{name}/log.jsonl")]
straight, resumed = log("straight"), log("resumed")
keys = ("step", "train_loss", "val_loss")
print(json.dumps(dict(stage="resume", exact=[[r[k] for k in keys] for r in straight] ==
                      [[r[k] for k in keys] for r in resumed],
                      max_val_loss_diff=max(abs(a["val_loss"] - b["val_loss"])
                                            for a, b in zip(straight, resumed)),
                      tokens_per_s=straight[-1]["tokens_per_s"], mfu=straight[-1]["mfu"])))
PY
}
export -f resume_check
export LOGS

stage env 20 python3 -c 'import inspect, json, sys, torch, triton, torch.nn.functional as F
import torch.distributed as dist
from torch.distributed.tensor import distribute_tensor
cuda = torch.cuda.is_available()
print(json.dumps(dict(python=sys.version.split()[0], torch=torch.__version__, triton=triton.__version__,
    cuda=torch.version.cuda, gpu=torch.cuda.get_device_name() if cuda else None, features=dict(
    F_grouped_mm=hasattr(F, "grouped_mm"), torch_grouped_mm=hasattr(torch, "_grouped_mm"),
    src_data_rank="src_data_rank" in inspect.signature(distribute_tensor).parameters,
    gather_group_dst="group_dst" in inspect.signature(dist.gather).parameters))))'
if [ "$DRY" = "--dry-run" ]; then  # the same stages at toy sizes (train.py's tiny default)
    stage d8 120 python3 bench/bench.py --dry-run ceilings profile_d8
    stage train 90 bash -c 'resume_check "$@"' _ --parallel=fsdp --batch_size=4
    stage s95 90 python3 bench/bench.py --dry-run ceilings s95_sharded
    stage tests 60 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py
    stage d8_eager 60 python3 bench/bench.py --dry-run ceilings profile_d8_eager
else  # (one-process groups' gloo on loopback: an offline machine may not resolve its own hostname)
    export GLOO_SOCKET_IFNAME=lo
    TORCH_LOGS=graph_breaks,recompiles stage d8 150 python3 bench/bench.py --gpu ceilings profile_d8
    python3 data/prepare.py data/corpus/shakespeare.jsonl --tokenizer gpt2 --out "$LOGS/shakespeare_gpt2" \
        > "$LOGS/prepare.txt" 2>&1
    stage train 110 bash -c 'resume_check "$@"' _ config/x_d8_loop2.py --data_dir="$LOGS/shakespeare_gpt2" \
        --global_batch=16 --eval_tokens=65536 --parallel=fsdp
    stage s95 90 python3 bench/bench.py --gpu ceilings s95_sharded
    stage tests 60 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py
    stage d8_eager 60 python3 bench/bench.py --gpu ceilings profile_d8_eager
fi
find "$LOGS" -name 'ckpt*' -prune -exec rm -rf {} +  # checkpoints (.pt, .dcp) stay behind: the logs travel
rm -rf "$LOGS/shakespeare_gpt2"
tar -czf "$OUT/logs.tar.gz" -C "$LOGS" . && rm -rf "$LOGS"
