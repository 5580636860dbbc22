#!/usr/bin/env bash
# The first run on a lent CUDA machine (one H200; its image: python3 3.12, torch 2.11, triton 3.6):
#
#   bash bench/gpu_check.sh             # every stage, 7 minutes at most; $OUT/summary.jsonl, $OUT/logs.tar.gz
#   bash bench/gpu_check.sh --dry-run   # this CPU, toy sizes, train.py left out: the plumbing (tests)
#
# Each stage runs under its cap (seconds; all within DEADLINE) with its output in a log; a failed or stopped
# (rc 124) stage does not stop the next. summary.jsonl: the JSON lines the stages print (bench.py's
# measurements), then {"stage", "rc", "seconds"} per stage; the same lines go to stdout. Two files in all.
#   env      versions and the GPU                                                            cap  60
#   tests    tests/test_cuda.py and tests/test_kernels.py, the kernels compiled              cap 180
#   bench    bench.py --gpu: the layouts' GFLOP/s, MoE vs dense, the kernels vs their twins  cap 180
#   train_*  the tiny default through train.py, 30 steps: eager, --triton, --compile         cap  90 each
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-out/gpu_check}
LOGS=$(mktemp -d)
DRY=${1:-}
mkdir -p "$OUT"
: > "$OUT/summary.jsonl"
export TRITON_DEFAULT_FP_FUSION=1 PYTHONUNBUFFERED=1

DEADLINE=420  # seconds for the whole run: a stage gets at most what is left of it
stage() {  # stage NAME CAP COMMAND...
    local name=$1 cap=$2 t0=$SECONDS rc
    shift 2
    [ $((DEADLINE - SECONDS)) -lt "$cap" ] && cap=$((DEADLINE - SECONDS))
    [ "$cap" -lt 1 ] && cap=1
    timeout "$cap" "$@" > "$LOGS/$name.txt" 2>&1
    rc=$?
    grep '^{' "$LOGS/$name.txt" | tee -a "$OUT/summary.jsonl"
    echo "{\"stage\": \"$name\", \"rc\": $rc, \"seconds\": $((SECONDS - t0))}" | tee -a "$OUT/summary.jsonl"
}

stage env 60 python3 -c 'import json, sys, torch, triton; cuda = torch.cuda.is_available(); print(json.dumps(dict(
    python=sys.version.split()[0], torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda,
    gpu=torch.cuda.get_device_name() if cuda else None)))'
if [ "$DRY" = "--dry-run" ]; then  # (train.py's settings below are checked by tests/test_bench.py)
    stage tests 120 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py
    stage bench 120 python3 bench/bench.py --dry-run moe kernels
else
    stage tests 180 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_kernels.py
    stage bench 180 python3 bench/bench.py --gpu
    for run in eager:--triton=False triton:--triton=True compiled:--compile=True; do
        stage "train_${run%%:*}" 90 python3 train.py --max_steps=30 --eval_interval=30 "${run#*:}" \
            --out_dir="$LOGS/${run%%:*}"
    done
fi
find "$LOGS" -name '*.pt' -delete  # checkpoints stay behind: the logs travel
tar -czf "$OUT/logs.tar.gz" -C "$LOGS" . && rm -rf "$LOGS"
