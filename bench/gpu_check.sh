#!/usr/bin/env bash
# GPU check for the first minutes on a lent CUDA machine, in the order of what they should answer:
#   1. does it run: python train.py for 20 steps (bf16 autocast, Triton kernels, FlexAttention) on the
#      default (the tiny SMELT MoE) and on one config of each family: [S] 200M SMELT twin, [X] d8
#      Loop-Grow growing at step 10, and the FSDP2 path (torchrun, --parallel=fsdp) on the [S] 200M baseline
#   2. the kernel tests compiled on CUDA, and each kernel against its eager twin
#   3. throughput of the [S] 200M configs, DDP path and FSDP path: tokens/s, MFU, peak memory
#
#   bash bench/gpu_check.sh            # results under $OUT (the device tool's folder) or out/gpu_check/
#
# STATUS: PREPARED, NOT YET RUN (no GPU has been lent to this project yet); its steps run on CPU up to
# the CUDA check. The machine has no network: nothing is installed; the [X] config trains on the
# embedded corpus prepared with the GPT-2 tokenizer (offline, seconds).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-out/gpu_check}"
RUNS="$OUT_DIR/runs"
mkdir -p "$RUNS"
export TRITON_DEFAULT_FP_FUSION=1  # triton 3.9 warns when unset; 1 keeps its current default

python - <<'PY' 2>&1 | tee "$OUT_DIR/env.txt"
import torch, triton
print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)
assert torch.cuda.is_available(), "gpu_check.sh: torch sees no CUDA device"
print(torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))
PY
[ "${PIPESTATUS[0]}" -eq 0 ] || exit 1

# 1. does it run (20 steps each; one line per run from train.py's own summary)
COMMON="--max_steps=20 --eval_interval=20 --progress=False --sample=False --out_dir=$RUNS"
python data/prepare.py --tokenizer gpt2 --out data/cache/gpt2 > /dev/null
timeout 300 python train.py $COMMON --run_name=tiny --eval_tokens=4096 2>&1 | tail -n 3 | tee "$OUT_DIR/runs.txt"
timeout 300 python train.py config/smelt_200m_s95.py $COMMON --run_name=s200m_smelt --data_dir= --batch_size=1 \
    --eval_tokens=8192 2>&1 | tail -n 3 | tee -a "$OUT_DIR/runs.txt"
timeout 300 python train.py config/x_d8_loop_grow.py $COMMON --run_name=x_d8_loop_grow --data_dir=data/cache/gpt2 \
    --batch_size=4 --grow_at=10.0 --grow_rewarm_steps=5 --eval_tokens=8192 2>&1 | tail -n 4 | tee -a "$OUT_DIR/runs.txt"
timeout 300 torchrun --standalone --nproc_per_node=1 train.py config/smelt_200m_base.py $COMMON --run_name=s200m_fsdp \
    --parallel=fsdp --data_dir= --batch_size=1 --eval_tokens=8192 2>&1 | tail -n 3 | tee -a "$OUT_DIR/runs.txt"

# 2. kernel == twin, forward and every gradient, compiled (conftest leaves TRITON_INTERPRET unset on CUDA)
timeout 240 python -m pytest tests/test_kernels.py -q 2>&1 | tail -n 20 | tee "$OUT_DIR/test_kernels.txt"
timeout 240 python bench/kernels.py 2>&1 | tee "$OUT_DIR/kernels_bench.jsonl"

# 3. throughput of the 200M configs: the DDP path (one process) and the FSDP path (the run of step 1)
for cfg in config/smelt_200m_base.py config/smelt_200m_s95.py; do
  timeout 240 python bench/train_throughput.py --config "$cfg" --batch_size 2 --steps 10 --device cuda 2>&1 \
      | tail -n 5 | tee -a "$OUT_DIR/train_throughput.jsonl"
done
python - "$RUNS" <<'PY' 2>&1 | tee "$OUT_DIR/runs_summary.jsonl"
import json, os, sys
for name in sorted(os.listdir(sys.argv[1])):  # tokens/s and MFU (989 TFLOP/s bf16 dense) from each log
    path = os.path.join(sys.argv[1], name, "log.jsonl")
    if os.path.exists(path):
        log = [json.loads(line) for line in open(path)]
        a, b = log[0], log[-1]
        seconds = max(b["seconds"] - a["seconds"], 1e-9)
        print(json.dumps(dict(run=name, steps=b["step"], val_loss=b["val_loss"], tokens_per_s=(b["tokens"] - a["tokens"]) / seconds,
                              mfu=(b["flops"] - a["flops"]) / seconds / 989e12, peak_memory_gb=b.get("peak_memory_gb"))))
PY
echo "gpu_check.sh: done; results in $OUT_DIR"
