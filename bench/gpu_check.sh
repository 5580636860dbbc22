#!/usr/bin/env bash
# The first run on a lent CUDA machine, in stages: each stage is its own command (under 9 minutes; all
# four under 14), prints one JSON line, and keeps its logs (small text files only) in $OUT/gpu_check/.
#
#   bash bench/gpu_check.sh env           # torch, triton, the GPUs                               (< 1 min)
#   bash bench/gpu_check.sh correctness   # compiled Triton kernels vs their twins; 2 train.py steps of
#                                         # each family (the tiny SMELT MoE, [X] d8 Loop-Grow growing at
#                                         # step 1, the [S] 200M twin under FSDP2)                 (~5 min)
#   bash bench/gpu_check.sh distributed   # torchrun on every GPU: DDP and FSDP2 (1 GPU: FSDP2 alone) (~2 min)
#   bash bench/gpu_check.sh throughput    # [X] d8 Loop-2 (11 executed blocks) at micro-batch 32: tokens/s
#                                         # and MFU after warm-up, eager / --compile / --triton     (~5 min)
#
# Until every stage has passed on a GPU, the CUDA default stays the PyTorch path and --triton is opt-in.
# STATUS: PREPARED, NOT YET RUN (no GPU has been lent to this project yet). Anchor for the last stage: the
# [X] code reaches about 42% MFU (1.3e18 FLOPs in 6.45-6.54 min on 8 x H100, [X] Table 4).
# Checkpoints go to a scratch folder, never into $OUT. Nothing is installed or downloaded: the [X] configs
# train on the embedded corpus prepared with the GPT-2 tokenizer (offline, seconds).
set -uo pipefail
cd "$(dirname "$0")/.."
STAGE="${1:-}"
LOGS="${OUT:-out}/gpu_check/$STAGE"
SCRATCH="$(mktemp -d /tmp/gpu_check.XXXX)"
mkdir -p "$LOGS"
export TRITON_DEFAULT_FP_FUSION=1  # triton 3.9 warns when unset; 1 keeps its current default
COMMON="--max_steps=2 --eval_interval=2 --eval_tokens=8192 --progress=False --sample=False --out_dir=$SCRATCH"

# run NAME SECONDS CMD...: the command's output into $LOGS/NAME.txt; prints {"name":..., "ok":..., "seconds":...}
run() {
  local name="$1" limit="$2"; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$LOGS/$name.txt" 2>&1
  local status=$?
  echo "{\"name\": \"$name\", \"ok\": $([ $status -eq 0 ] && echo true || echo false), \"status\": $status, \"seconds\": $((SECONDS - t0))}"
}

# the stage's one JSON line from the per-command lines: {"stage": ..., "ok": all ok, "commands": [...]}
summarise() {
  python - "$STAGE" <<'PY'
import json, sys
rows = [json.loads(line) for line in sys.stdin if line.startswith("{")]
ok = bool(rows) and all(r["ok"] for r in rows)
print(json.dumps(dict(stage=sys.argv[1], ok=ok, commands=rows)))
sys.exit(0 if ok else 1)
PY
}

case "$STAGE" in
env)
  python - <<'PY' 2>&1 | tee "$LOGS/env.txt" | tail -n 1
import json, torch, triton
assert torch.cuda.is_available(), "gpu_check.sh: torch sees no CUDA device"
print(json.dumps(dict(stage="env", torch=torch.__version__, cuda=torch.version.cuda, triton=triton.__version__,
                      gpus=[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
                      capability=list(torch.cuda.get_device_capability(0)),
                      memory_gb=round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1))))
PY
  ;;
correctness)
  python data/prepare.py data/corpus/shakespeare.jsonl --tokenizer gpt2 --out "$SCRATCH/gpt2" > /dev/null
  {
    run kernels 300 python -m pytest tests/test_kernels.py tests/test_model.py -q -k "kernel or apply"
    run tiny 120 python train.py $COMMON --run_name=tiny
    run tiny_triton 180 python train.py $COMMON --run_name=tiny_triton --triton=True
    run x_d8_loop_grow 240 python train.py config/x_d8_loop_grow.py $COMMON --run_name=x_d8_loop_grow \
        --data_dir="$SCRATCH/gpt2" --batch_size=4 --grad_accum=1 --grow_at=1.0 --grow_rewarm_steps=1
    run smelt_200m_s95 240 python train.py config/smelt_200m_s95.py $COMMON --run_name=smelt_200m_s95 \
        --batch_size=1 --grad_accum=1
  } | summarise
  ;;
distributed)
  GPUS=$(python -c "import torch; print(torch.cuda.device_count())")
  {
    if [ "$GPUS" -ge 2 ]; then
      run ddp 240 torchrun --standalone --nproc_per_node="$GPUS" train.py $COMMON --run_name=ddp --max_steps=4
    fi
    run fsdp 240 torchrun --standalone --nproc_per_node="$GPUS" train.py $COMMON --run_name=fsdp --parallel=fsdp \
        --max_steps=4
    run fsdp_resume 120 torchrun --standalone --nproc_per_node="$GPUS" train.py --out_dir="$SCRATCH" \
        --run_name=fsdp --resume=True --max_steps=6 --progress=False --sample=False
  } | summarise
  ;;
throughput)
  for variant in "" "--compile" "--triton"; do
    timeout 170 python bench/train_throughput.py --config config/x_d8_loop2.py --batch_size 32 --steps 10 \
        --warmup 3 --device cuda $variant 2>> "$LOGS/throughput.txt" | tail -n 1 | tee -a "$LOGS/throughput.jsonl"
  done | python -c "
import json, sys
rows = [json.loads(l) for l in sys.stdin if l.startswith('{')]
print(json.dumps(dict(stage='throughput', ok=len(rows) == 3, runs=[{k: r[k] for k in ('compile', 'triton', 'tokens_per_s',
      'mfu', 'ms_per_step', 'warmup_seconds', 'peak_memory_gb')} for r in rows], anchor_mfu_x_code=0.42)))
sys.exit(0 if len(rows) == 3 else 1)"
  ;;
*)
  echo "usage: bash bench/gpu_check.sh env|correctness|distributed|throughput" >&2
  false
  ;;
esac
status=$?
rm -rf "$SCRATCH"
[ "$STAGE" = env ] || [ "$STAGE" = correctness ] || [ "$STAGE" = distributed ] || [ "$STAGE" = throughput ] || status=2
exit $status
