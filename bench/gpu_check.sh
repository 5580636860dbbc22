#!/usr/bin/env bash
# GPU check: kernel tests compiled on CUDA, the kernel benchmark, and a short bf16 training run of the
# 200M config reporting tokens/s and MFU. One short script for a machine lent for a few minutes.
#
#   bash bench/gpu_check.sh            # results under $OUT (the device tool's folder) or out/gpu_check/
#
# STATUS: PREPARED, NOT YET RUN (no GPU has been lent to this project yet). Written against torch 2.13 /
# triton 3.9; its commands run on CPU too (test: `bash bench/gpu_check.sh` stops at the CUDA check).
# The device machine has no network: nothing is installed here; it stops if torch has no CUDA.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-out/gpu_check}"
mkdir -p "$OUT_DIR"
export TRITON_DEFAULT_FP_FUSION=1  # triton 3.9 warns when unset; 1 keeps its current default

python - <<'EOF' 2>&1 | tee "$OUT_DIR/env.txt"
import torch, triton
print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)
assert torch.cuda.is_available(), "gpu_check.sh: torch sees no CUDA device"
print(torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))
EOF
[ "${PIPESTATUS[0]}" -eq 0 ] || exit 1

# 1. kernel == twin, forward and every gradient, compiled (conftest leaves TRITON_INTERPRET unset on CUDA)
timeout 240 python -m pytest tests/test_kernels.py -q 2>&1 | tail -n 20 | tee "$OUT_DIR/test_kernels.txt"

# 2. each kernel vs its eager twin (and torch.compile of it), JSON lines
timeout 240 python bench/kernels.py 2>&1 | tee "$OUT_DIR/kernels_bench.jsonl"

# 3. bf16 training steps of the [S] 200M configs (baseline and SMELT twin; the MoE beside a dense twin of
#    the same active size): tokens/s and MFU vs the 989 TFLOP/s bf16 peak, Triton kernels on (CUDA default)
for cfg in config/smelt_200m_base.py config/smelt_200m_s95.py; do
  timeout 240 python bench/train_throughput.py --config "$cfg" --batch_size 2 --steps 10 --device cuda 2>&1 \
      | tail -n 5 | tee -a "$OUT_DIR/train_throughput.jsonl"
done
echo "gpu_check.sh: done; results in $OUT_DIR"
