"""
Each Triton kernel in kernels/ against its PyTorch twin (eager, and torch.compile of the twin when it
compiles), forward and forward+backward, one JSON line per measurement:

    python bench/kernels.py                    # CUDA: times; CPU: one line per kernel saying so
    python bench/kernels.py --dtype=float32 --tokens=4096
    python bench/kernels.py --moe_autocast     # as a kernels.apply model runs it: fp32 x and weights, bf16 autocast

torch.compile is not applied to the MoE twin: its python loop over experts needs counts on the host.
"newton_schulz" is Muon's iteration (muon.orthogonalize, 5 steps in its CUDA dtype bf16) with the Gram
kernel (gram=kernels.gram, as kernels.apply sets it for Muon) against the plain matmuls (gram=None).
--moe_autocast times moe_experts (and its twin) on fp32 tensors under torch.autocast("cuda", bfloat16),
so the operand casts count (dtype contract: kernels/moe_kernel.py moe_experts); its lines read
dtype "float32+autocast-bf16". The other kernels are not autocast-aware and keep --dtype.
Line fields: kernel, shape, dtype, pass ("fwd" | "fwd+bwd"), impl ("triton" | "twin" | "twin_compiled"),
ms (median of triton.testing.do_bench), ratio_vs_twin (= twin ms / impl ms: > 1 means faster than eager).
The Triton interpreter is never timed: its speed says nothing about the GPU.
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import kernels  # noqa: E402
from muon import orthogonalize  # noqa: E402
from tooling import common  # noqa: E402
from tooling.common import number  # noqa: E402


def make_cases(tokens, n_embd, hidden, n_expert, top_k, expert_hidden, dtype, device, moe_dtype=None):
    """name -> (shape description, triton fn, twin fn, inputs). Shapes are those of a ~200M model step.
    moe_dtype: the MoE's tensors' dtype (default: dtype)."""
    g = torch.Generator(device="cpu").manual_seed(0)

    def randn(*shape, scale=1.0, dtype=dtype):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype).requires_grad_()

    x, e, w = randn(tokens, n_embd), randn(tokens, n_embd), randn(n_embd)
    gate, up = randn(tokens, hidden), randn(tokens, hidden)
    rows = tokens * top_k  # every token routed to top_k experts, rows sorted by expert
    expert_of_row = torch.randint(0, n_expert, (rows,), generator=g)
    counts = torch.bincount(expert_of_row, minlength=n_expert).to(device)
    md = moe_dtype or dtype
    moe = (randn(rows, n_embd, dtype=md), counts,
           randn(n_expert, expert_hidden, n_embd, scale=n_embd ** -0.5, dtype=md),
           randn(n_expert, expert_hidden, n_embd, scale=n_embd ** -0.5, dtype=md),
           randn(n_expert, n_embd, expert_hidden, scale=expert_hidden ** -0.5, dtype=md))
    stack = randn(16, expert_hidden, n_embd).detach()  # a slice of a stacked expert update for Muon
    return {
        "rmsnorm": (f"{tokens}x{n_embd}", kernels.rmsnorm, kernels.rmsnorm_reference, (x, w)),
        "boundary_operator": (f"{tokens}x{n_embd}", lambda h, e, w: kernels.boundary_operator(h, e, 0.5, w),
                              lambda h, e, w: kernels.boundary_operator_reference(h, e, 0.5, w), (x, e, w)),
        "swiglu": (f"{tokens}x{hidden}", kernels.swiglu, kernels.swiglu_reference, (gate, up)),
        "moe_experts": (f"{rows}x{n_embd} E={n_expert} hidden={expert_hidden}", kernels.moe_experts,
                        kernels.moe_experts_reference, moe),
        # Muon runs under no_grad: forward only for these two
        "gram": (f"16x{expert_hidden}x{n_embd}", kernels.gram, kernels.gram_reference, (stack,)),
        "newton_schulz": (f"16x{expert_hidden}x{n_embd}", lambda u: orthogonalize(u, gram=kernels.gram),
                          orthogonalize, (stack,)),
    }


def under_autocast(step):
    def autocast_step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            step()
    return autocast_step


def fwd_bwd(fn, inputs):
    def step():
        y = fn(*inputs)
        y.backward(torch.ones_like(y))
    return step


def main():
    parser = common.parser("bench/kernels.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # defaults: one 4096-token sequence x 2 of config/smelt_200m_base.py (H 1280, 192 experts, top-8, 432)
    parser.add_argument("--tokens", type=number(int, 1), default=8192, help="batch x sequence rows")
    parser.add_argument("--n_embd", type=number(int, 1), default=1280)
    parser.add_argument("--hidden", type=number(int, 1), default=3456, help="dense SwiGLU hidden size")
    parser.add_argument("--n_expert", type=number(int, 1), default=192)
    parser.add_argument("--top_k", type=number(int, 1), default=8)
    parser.add_argument("--expert_hidden", type=number(int, 1), default=432)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--moe_autocast", action="store_true",
                        help="moe_experts on fp32 tensors under bf16 autocast, as a kernels.apply model runs it")
    parser.add_argument("--no_compile", action="store_true", help="skip torch.compile of the twins")
    args = parser.parse_args()
    names = ["rmsnorm", "boundary_operator", "swiglu", "moe_experts", "gram", "newton_schulz"]
    if not torch.cuda.is_available():
        for name in names:
            print(json.dumps({"kernel": name, "skipped": "timings need CUDA (the Triton interpreter is not timed);"
                              " correctness on CPU: python -m pytest tests/test_kernels.py"}))
        return
    from triton.testing import do_bench
    dtype = getattr(torch, args.dtype)
    cases = make_cases(args.tokens, args.n_embd, args.hidden, args.n_expert, args.top_k, args.expert_hidden,
                       dtype, torch.device("cuda"), torch.float32 if args.moe_autocast else None)
    for name, (shape, fn, twin, inputs) in cases.items():
        impls = {"twin": twin, "triton": fn}
        if not args.no_compile and name != "moe_experts":  # its twin's per-expert loop has a host sync
            impls["twin_compiled"] = torch.compile(twin)
        for pass_name in ("fwd",) if name in ("gram", "newton_schulz") else ("fwd", "fwd+bwd"):
            times = {}
            for impl, f in impls.items():
                step = (lambda f=f: f(*inputs)) if pass_name == "fwd" else fwd_bwd(f, inputs)
                autocast = args.moe_autocast and name == "moe_experts"
                step = under_autocast(step) if autocast else step
                record = {"kernel": name, "shape": shape, "dtype": "float32+autocast-bf16" if autocast else args.dtype,
                          "pass": pass_name, "impl": impl}
                try:
                    times[impl] = do_bench(step, warmup=25, rep=100, return_mode="median")
                except Exception as error:  # e.g. torch.compile failing on the twin's python loop
                    print(json.dumps({**record, "error": f"{type(error).__name__}: {error}"[:300]}), flush=True)
                    continue
                ratio = times["twin"] / times[impl] if "twin" in times else None
                print(json.dumps({**record, "ms": round(times[impl], 4),
                                  "ratio_vs_twin": round(ratio, 3) if ratio else None}), flush=True)
            for t in inputs:
                if isinstance(t, torch.Tensor):
                    t.grad = None


if __name__ == "__main__":
    main()
