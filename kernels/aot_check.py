"""
Compile every kernel ahead of time for a CUDA target, on a machine without a GPU:

    python -m kernels.aot_check                 # sm_90 (H100/H200), bf16 and fp32 variants
    python -m kernels.aot_check --arch=80 --dtypes=bf16 --quick

The interpreter (CPU tests) runs the kernels as numpy and cannot catch what only the compiler rejects
(early returns, dtype casts, shared-memory overflow, layouts). triton.compile with an explicit
GPUTarget runs the real pipeline down to a cubin with the ptxas shipped in the triton wheel. It prints
one JSON line per compiled variant, with its shared memory, and exits non-zero on the first failure.
With bf16 it also builds the mixed-dtype variants the autocast path launches (bf16 operands with fp32
results and gradients: see the dtype contracts in kernels/__init__.py); their lines say "mixed".
Must run without TRITON_INTERPRET (it would define the kernels as interpreted functions).
"""
import argparse
import json
import os
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels import moe_kernel, newton_schulz_kernel, rmsnorm_kernel, swiglu_kernel


def compile_kernel(kernel, target, pointer_types, constexprs, mixed=None, **options):
    """Compile `kernel` with pointer args typed by pointer_types; other args are i32 (eps/alpha fp32).
    mixed: a note for a variant whose pointers mix dtypes (printed on its line)."""
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        else:
            signature[name] = pointer_types.get(name, "fp32" if name in ("eps", "alpha") else "i32")
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                              target=target, options=options)
    print(json.dumps({"kernel": kernel.__name__, "arch": target.arch, **constexprs,
                      **({"mixed": mixed} if mixed else {}), "shared_bytes": compiled.metadata.shared}), flush=True)


def compile_all(arch=90, dtypes=("bf16", "fp32"), quick=False):
    """quick: only the variant of each kernel with every optional feature on (8 compiles per dtype, and
    4 mixed-dtype ones with bf16)."""
    target = GPUTarget("cuda", arch, 32)
    for dt in dtypes:
        ptr = lambda *names: {name: "*" + dt for name in names}  # noqa: E731
        for has_weight in (True,) if quick else (True, False):
            for has_e in (True,) if quick else (True, False):
                flags = dict(HAS_WEIGHT=has_weight, HAS_E=has_e, BLOCK_M=8, BLOCK_D=1024)
                compile_kernel(rmsnorm_kernel._rmsnorm_fwd_kernel, target, {**ptr("X", "W", "E", "Y"),
                               "RSTD": "*fp32"}, flags, num_warps=8)
                compile_kernel(rmsnorm_kernel._rmsnorm_bwd_kernel, target, {**ptr("X", "W", "DY", "DX", "DE"),
                               "DW_PARTIAL": "*fp32", "RSTD": "*fp32"}, flags, num_warps=8)
        compile_kernel(swiglu_kernel._swiglu_fwd_kernel, target, ptr("G", "U", "Y"), dict(BLOCK_M=4, BLOCK_N=1024))
        compile_kernel(swiglu_kernel._swiglu_bwd_kernel, target, ptr("G", "U", "DY", "DG", "DU"),
                       dict(BLOCK_M=4, BLOCK_N=1024))
        tiles = {"TILE_EXPERT": "*i32", "TILE_FIRST_ROW": "*i64", "TILE_LAST_ROW": "*i64"}
        block_m, block_n, block_k, num_warps, num_stages = moe_kernel._blocks("cuda")
        blocks = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, FP32_DOT=False)  # True: interpreter only
        options = dict(num_warps=num_warps, num_stages=num_stages)
        compile_kernel(moe_kernel._moe_gate_up_kernel, target, {**ptr("X", "WG", "WU", "HG", "HU", "ACT"), **tiles},
                       blocks, **options)
        for has_second in (True,) if quick else (True, False):
            compile_kernel(moe_kernel._grouped_mm_kernel, target, {**ptr("A", "B", "A2", "B2", "C"), **tiles},
                           dict(HAS_SECOND=has_second, **blocks), **options)
        compile_kernel(moe_kernel._grouped_wgrad_kernel, target, {**ptr("A", "B", "C"), "ROW_START": "*i64",
                       "COUNTS": "*i64"}, blocks, **options)
        block_m, block_k, num_warps, num_stages = newton_schulz_kernel._blocks("cuda")
        compile_kernel(newton_schulz_kernel._gram_kernel, target, {**ptr("X", "C"), "PAIRS": "*i32"},
                       dict(BLOCK_M=block_m, BLOCK_K=block_k, FP32_DOT=False), num_warps=num_warps,
                       num_stages=num_stages)
        if dt == "bf16":  # what autocast launches: bf16 activations and operands next to fp32 tensors
            fp32 = lambda *names: {name: "*fp32" for name in names}  # noqa: E731
            note = "bf16 x with fp32 weight and e (q/k norm, BO of a bf16 h)"
            flags = dict(HAS_WEIGHT=True, HAS_E=True, BLOCK_M=8, BLOCK_D=1024)
            compile_kernel(rmsnorm_kernel._rmsnorm_fwd_kernel, target, {**ptr("X", "Y"), **fp32("W", "E", "RSTD")},
                           flags, mixed=note, num_warps=8)
            compile_kernel(rmsnorm_kernel._rmsnorm_bwd_kernel, target,
                           {**ptr("X", "DY", "DX"), **fp32("W", "DE", "DW_PARTIAL", "RSTD")}, flags, mixed=note,
                           num_warps=8)
            for has_second in (True,) if quick else (True, False):  # fp32 result: y and d x of moe_experts
                compile_kernel(moe_kernel._grouped_mm_kernel, target,
                               {**ptr("A", "B", "A2", "B2"), **fp32("C"), **tiles},
                               dict(HAS_SECOND=has_second, **blocks), mixed="bf16 operands, fp32 result", **options)
            compile_kernel(moe_kernel._grouped_wgrad_kernel, target, {**ptr("A", "B"), **fp32("C"),
                           "ROW_START": "*i64", "COUNTS": "*i64"}, blocks, mixed="bf16 operands, fp32 weight grad",
                           **options)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability x10 (80 = A100, 90 = H100)")
    parser.add_argument("--dtypes", default="bf16,fp32", help="comma-separated pointer dtypes: bf16, fp16, fp32")
    parser.add_argument("--quick", action="store_true", help="one variant per kernel, all options on")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes"):
        sys.exit("kernels.aot_check: unset TRITON_INTERPRET (interpreted kernels cannot be compiled)")
    compile_all(args.arch, tuple(args.dtypes.split(",")), args.quick)


if __name__ == "__main__":
    main()
