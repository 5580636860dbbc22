#!/usr/bin/env bash
# The run on a lent CUDA machine (one H100 or H200; python3 3.12, torch 2.11, triton 3.6,
# offline):
#
#   bash bench/gpu_check.sh            # every stage, 7.5 min at most
#   bash bench/gpu_check.sh --dry-run  # every stage on this CPU at toy sizes
#
# It writes two files to $OUT (a lend returns 8): summary.jsonl, the JSON lines the
# stages print and a {"stage", "rc", "seconds"} line per stage, also on stdout; and
# logs.tar.gz, each stage's output.
# Each stage runs under its cap in seconds, all within DEADLINE. A stopped stage gets
# SIGABRT (rc 124), so Python's faulthandler logs each thread's stack; the next stage
# still runs.
#   env       versions, the GPU, the newer torch APIs this code uses         20 s
#   d8        bench.py profile_d8: [X] d8 Loop-2 compiled as train.py does  150 s
#   train     train.py on the embedded corpus, d8 Loop-2 under FSDP2: 8 steps,
#             then 4 and a resume to 8; does the resume continue exactly?  110 s
#   s95       bench.py s95_sharded: the [S] 200M twin and its baseline       90 s
#   tests     tests/test_cuda.py                                             60 s
#   d8_eager  profile_d8 eager: what compiling gains                     the rest
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-out/gpu_check}
LOGS=$(mktemp -d)
DRY=${1:-}
mkdir -p "$OUT"
: > "$OUT/summary.jsonl"
export TRITON_DEFAULT_FP_FUSION=1 PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
# A stage stopped by SIGABRT leaves no core file (a GPU process's would be tens of GB).
ulimit -c 0

# Seconds for the whole run: a stage gets at most what is left of it.
DEADLINE=450
# stage NAME CAP COMMAND...
stage() {
    local name=$1 cap=$2 t0=$SECONDS rc
    shift 2
    [ $((DEADLINE - SECONDS)) -lt "$cap" ] && cap=$((DEADLINE - SECONDS))
    [ "$cap" -lt 1 ] && cap=1
    timeout -s ABRT "$cap" "$@" > "$LOGS/$name.txt" 2>&1
    rc=$?
    grep '^{' "$LOGS/$name.txt" | tee -a "$OUT/summary.jsonl"
    echo "{\"stage\": \"$name\", \"rc\": $rc, \"seconds\": $((SECONDS - t0))}" |
        tee -a "$OUT/summary.jsonl"
}

# resume_check TRAIN_ARGS...: 8 steps straight; 4, then a resume to 8; one JSON line
# comparing the two logs.
resume_check() {
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
print(json.dumps(dict(python=sys.version.split()[0], torch=torch.__version__,
    triton=triton.__version__, cuda=torch.version.cuda,
    gpu=torch.cuda.get_device_name() if cuda else None, features=dict(
    F_grouped_mm=hasattr(F, "grouped_mm"), torch_grouped_mm=hasattr(torch, "_grouped_mm"),
    src_data_rank="src_data_rank" in inspect.signature(distribute_tensor).parameters,
    gather_group_dst="group_dst" in inspect.signature(dist.gather).parameters))))'
# The dry run: the same stages at toy sizes (train.py's tiny default model).
if [ "$DRY" = "--dry-run" ]; then
    stage d8 120 python3 bench/bench.py --dry-run ceilings profile_d8
    stage train 90 bash -c 'resume_check "$@"' _ --parallel=fsdp --batch_size=4 \
        --block_size=64 --eval_tokens=1024
    stage s95 90 python3 bench/bench.py --dry-run ceilings s95_sharded
    stage tests 60 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py
    stage d8_eager 60 python3 bench/bench.py --dry-run ceilings profile_d8_eager
else
    # Gloo on loopback: an offline machine may not resolve its own hostname.
    export GLOO_SOCKET_IFNAME=lo
    TORCH_LOGS=graph_breaks,recompiles stage d8 150 python3 bench/bench.py --gpu ceilings profile_d8
    python3 data/prepare.py data/corpus/shakespeare.jsonl --tokenizer gpt2 \
        --out "$LOGS/shakespeare_gpt2" > "$LOGS/prepare.txt" 2>&1
    stage train 110 bash -c 'resume_check "$@"' _ config/x_d8_loop2.py \
        --data_dir="$LOGS/shakespeare_gpt2" --global_batch=16 --eval_tokens=65536 --parallel=fsdp
    stage s95 90 python3 bench/bench.py --gpu ceilings s95_sharded
    stage tests 60 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py
    stage d8_eager 60 python3 bench/bench.py --gpu ceilings profile_d8_eager
fi
# Checkpoints (.pt, .dcp) stay behind: only the logs travel.
find "$LOGS" -name 'ckpt*' -prune -exec rm -rf {} +
rm -rf "$LOGS/shakespeare_gpt2"
tar -czf "$OUT/logs.tar.gz" -C "$LOGS" . && rm -rf "$LOGS"
