"""
Small Triton kernels, each with a plain PyTorch reference twin in the same file.

    rmsnorm(x, weight=None, eps=1e-6)                     rmsnorm_reference          rmsnorm_kernel.py
    boundary_operator(h, e, alpha, weight=None, eps=1e-6) boundary_operator_reference rmsnorm_kernel.py
    swiglu(gate, up)                                      swiglu_reference           swiglu_kernel.py
    moe_experts(x_sorted, counts, w_gate, w_up, w_down)   moe_experts_reference      moe_kernel.py
    gram(x) = x @ x.mT (half the tiles), newton_schulz    gram_reference, ...        newton_schulz_kernel.py

Every kernel is a torch.autograd.Function with forward and backward in Triton (except gram's backward,
a torch matmul: it serves Muon, which runs under no_grad). On CUDA they compile;
on CPU they run only in the Triton interpreter (TRITON_INTERPRET=1, fp32 arithmetic, slow: tests only).

Dtypes (details in each wrapper's docstring): all arithmetic is fp32 (matmuls accumulate in fp32 from
bf16 operands on CUDA); every gradient has its input's dtype.
    rmsnorm, boundary_operator   -> x.dtype / h.dtype; weight and e may differ; not autocast-aware
    swiglu                       -> gate.dtype (== up.dtype); not autocast-aware
    moe_experts                  -> x_sorted.dtype; autocast-aware: under autocast the matmul operands
                                    are in the autocast dtype, the result still in x_sorted.dtype
    gram                         -> x.dtype;  newton_schulz -> update.dtype, arithmetic in `dtype`
The interpreter cannot do bf16 arithmetic: the kernels convert after every load (and the matmul kernels
convert their tl.dot operands when run on CPU), so bf16 tensors go through the same plumbing there;
only its fp32 -> bf16 stores truncate where the GPU rounds to nearest (1 bf16 ulp).

Importing this package does not import triton: triton decides interpreter-or-compiler when a kernel is
defined, so the kernel files are imported on first use, after the caller had the chance to set
TRITON_INTERPRET (tests/conftest.py does so on machines without CUDA).
"""
import importlib
import os


def _module(name, device=None):
    if device is not None and device.type == "cpu" and \
            os.environ.get("TRITON_INTERPRET", "0").lower() not in ("1", "true", "on", "yes"):
        raise RuntimeError("kernels: Triton kernels on CPU run only in the interpreter; set TRITON_INTERPRET=1 "
                           "before triton is first imported (tests/conftest.py does), or use the *_reference "
                           "twins (use_triton=False)")
    return importlib.import_module(f"kernels.{name}")


def rmsnorm(x, weight=None, eps=1e-6):
    """Fused RMSNorm over the last dim: x * rsqrt(mean(x^2) + eps) * weight (weight=None: no gain)."""
    return _module("rmsnorm_kernel", x.device).rmsnorm(x, weight, eps)


def rmsnorm_reference(x, weight=None, eps=1e-6):
    return _module("rmsnorm_kernel").rmsnorm_reference(x, weight, eps)


def boundary_operator(h, e, alpha, weight=None, eps=1e-6):
    """[X3] BO(h, e) = RMSNorm(h) + alpha * e, fused in one pass."""
    return _module("rmsnorm_kernel", h.device).boundary_operator(h, e, alpha, weight, eps)


def boundary_operator_reference(h, e, alpha, weight=None, eps=1e-6):
    return _module("rmsnorm_kernel").boundary_operator_reference(h, e, alpha, weight, eps)


def swiglu(gate, up):
    """Fused silu(gate) * up."""
    return _module("swiglu_kernel", gate.device).swiglu(gate, up)


def swiglu_reference(gate, up):
    return _module("swiglu_kernel").swiglu_reference(gate, up)


def moe_experts(x_sorted, counts, w_gate, w_up, w_down):
    """Grouped-GEMM SwiGLU experts over expert-sorted rows (see moe_kernel.py). Returns x_sorted.dtype,
    also under autocast (where the matmul operands are in the autocast dtype)."""
    return _module("moe_kernel", x_sorted.device).moe_experts(x_sorted, counts, w_gate, w_up, w_down)


def moe_experts_reference(x_sorted, counts, w_gate, w_up, w_down):
    return _module("moe_kernel").moe_experts_reference(x_sorted, counts, w_gate, w_up, w_down)


def gram(x):
    """x @ x.mT for x (..., m, k), only the upper-triangle tiles computed (Muon's Newton-Schulz)."""
    return _module("newton_schulz_kernel", x.device).gram(x)


def gram_reference(x):
    return _module("newton_schulz_kernel").gram_reference(x)


def newton_schulz(update, steps=5, eps=1e-7, dtype=None):
    """Muon's quintic Newton-Schulz orthogonalisation (= muon.orthogonalize) with both Gram products on
    the kernel."""
    return _module("newton_schulz_kernel", update.device).newton_schulz(update, steps, eps, dtype)


def newton_schulz_reference(update, steps=5, eps=1e-7, dtype=None):
    return _module("newton_schulz_kernel").newton_schulz_reference(update, steps, eps, dtype)
