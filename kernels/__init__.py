"""
Small Triton kernels, each with a plain PyTorch reference twin in the same file, and `apply`, the one
way they come into a run:

    kernels.apply(model, {MoE: kernels.MoEKernel, ...}, optimizers=())
        swap the kernels into a built model (by the caller's {model class: kernel class}) and Muon, in place

    rmsnorm(x, weight=None, eps=1e-6)                     rmsnorm_reference           rmsnorm_kernel.py
    boundary_operator(h, e, alpha, weight=None, eps=1e-6) boundary_operator_reference rmsnorm_kernel.py
    swiglu(gate, up)                                      swiglu_reference            swiglu_kernel.py
    moe_experts(x_sorted, counts, w_gate, w_up, w_down)   moe_experts_reference       moe_kernel.py
    gram(x) = x @ x.mT (half the tiles)                   gram_reference              newton_schulz_kernel.py

The package imports nothing from the project (model.py, muon.py): the caller of `apply` maps model.py's
classes to their kernel classes, and Muon's Newton-Schulz iteration takes `gram` as its Gram product.
The tests hold each twin equal to the model's or Muon's own code and each kernel close to its twin.

Every kernel is a torch.autograd.Function with forward and backward in Triton (except gram's backward,
a torch matmul: it serves Muon, which runs under no_grad). On CUDA they compile;
on CPU they run only in the Triton interpreter (TRITON_INTERPRET=1, fp32 arithmetic, slow: tests only).

Dtypes (details in each wrapper's docstring): all arithmetic is fp32 (matmuls accumulate in fp32 from
bf16 operands on CUDA); every gradient has its input's dtype.
    rmsnorm, boundary_operator   -> x.dtype / h.dtype; weight and e may differ; not autocast-aware
    swiglu                       -> gate.dtype (== up.dtype); not autocast-aware
    moe_experts                  -> x_sorted.dtype; autocast-aware: under autocast the matmul operands
                                    are in the autocast dtype, the result still in x_sorted.dtype
    gram                         -> x.dtype (Muon calls it in its Newton-Schulz dtype)
The interpreter cannot do bf16 arithmetic: the kernels convert after every load (and the matmul kernels
convert their tl.dot operands when run on CPU), so bf16 tensors go through the same plumbing there;
only its fp32 -> bf16 stores truncate where the GPU rounds to nearest (1 bf16 ulp).

Importing this package does not import triton (nor does `apply`): triton decides interpreter-or-compiler
when a kernel is defined, so the kernel files are imported on first use, after the caller had the chance
to set TRITON_INTERPRET (tests/conftest.py does so on machines without CUDA).
"""
import importlib
import os
from inspect import signature


def interpreted():
    """Whether Triton runs its kernels in the interpreter (TRITON_INTERPRET set): the only way on a CPU."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _module(name, device=None):
    if device is not None and device.type == "cpu" and not interpreted():
        raise RuntimeError("kernels: Triton kernels on CPU run only in the interpreter; set TRITON_INTERPRET=1 "
                           "before triton is first imported (tests/conftest.py does), or use the *_reference "
                           "twins (a model without kernels.apply)")
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


# ----------------------------------------------------------------------------------------------------
# apply: the kernels in a built model, and Muon's Gram product


def apply(model, replacements, optimizers=()):
    """Swap the Triton kernels into an already built model, in place; returns the model. The one way the
    kernels come into a run: model.py's code is the PyTorch code, and stays what runs without this call.

    Opt-in on every device, CUDA included (train.py --triton=True), until bench/gpu_check.sh has passed
    on a GPU: until then the kernels are checked only in the Triton interpreter and compiled ahead of time.

    replacements: {model class: kernel class}, by type and given by the caller, as train.py does:
        {RMSNorm: kernels.RMSNormKernel, MLP: kernels.MLPKernel, MoE: kernels.MoEKernel,
         BoundaryOperator: kernels.BoundaryOperatorKernel}
    (The caller imports both, this package imports nothing of model.py: a class renamed there fails at the
    caller's mapping, where a lookup by class name would silently drop its kernel.) Each module that is
    an instance of a mapped class (of a subclass too: the nearest one in its MRO) gets as its class a
    subclass (kernel class, its own class), one per class, cached; the kernel class overrides:
        RMSNormKernel.forward           the fused rmsnorm
        MLPKernel.forward               the projections as before, silu(gate) * up on the swiglu kernel
        MoEKernel.experts               moe_experts (one grouped-GEMM launch over the expert-sorted rows),
                                        then each row times its router weight, index_add back to its token
        BoundaryOperatorKernel.forward  the fused boundary_operator when it both norms and injects; one
                                        part alone runs the module's own code (its norm a swapped RMSNorm)
    A method the kernel class overrides that the module's class lacks, or has with another signature,
    raises TypeError: the kernel would not run. Only the class changes: parameters, buffers, module names
    and the state_dict stay the same objects, so a checkpoint loads either way. Idempotent (a swapped
    module is left as it is); copy.deepcopy of a block keeps its kernels (grow.py copies blocks). Call it
    before torch.compile, which traces the modules as it finds them; FSDP2's fully_shard wraps blocks, not
    these modules, so before or after it (train.py: after, once the optimizers exist). Instances are not
    picklable with torch.save(model): save the state_dict.

    optimizers: each one with a `gram` attribute (muon.Muon) gets opt.gram = gram, the half-tile Gram
    kernel, for both Gram products of its Newton-Schulz iteration; others (AdamW) are left alone."""
    if not isinstance(replacements, dict):
        raise TypeError(f"kernels.apply(model, replacements, optimizers): replacements maps model classes to "
                        f"kernel classes, not {type(replacements).__name__}")
    for module in model.modules():
        if isinstance(module, tuple(replacements.values())):
            continue  # swapped already
        mapped = next((cls for cls in type(module).__mro__ if cls in replacements), None)
        if mapped is not None:
            module.__class__ = _kernel_class(type(module), replacements[mapped])
    for opt in optimizers:
        if hasattr(opt, "gram"):
            opt.gram = gram
    return model


class RMSNormKernel:
    def forward(self, x):
        return rmsnorm(x, self.weight, self.eps)


class MLPKernel:
    def forward(self, x):
        return self.w_down(swiglu(self.w_gate(x), self.w_up(x))), None


class MoEKernel:
    def experts(self, x, token_of, counts, weight_of):
        """All experts in one launch over the expert-sorted copies of the tokens; the router weight scales
        each expert output row (run_experts scales the hidden activation: the same by linearity)."""
        y_sorted = moe_experts(x[token_of], counts, self.w_gate, self.w_up, self.w_down)
        if weight_of is not None:
            y_sorted = y_sorted * weight_of.unsqueeze(1).to(y_sorted.dtype)
        return y_sorted.new_zeros(x.shape).index_add_(0, token_of, y_sorted)


class BoundaryOperatorKernel:
    def forward(self, h, e, norm=True, inject=True):
        if norm and inject and self.norm is not None:
            return boundary_operator(h, e, self.alpha, self.norm.weight, self.norm.eps)
        return super().forward(h, e, norm, inject)


_KERNEL_CLASSES = {}  # (model class, kernel class) -> their subclass: the same class on every apply and copy


def _kernel_class(cls, kernel):
    if (cls, kernel) not in _KERNEL_CLASSES:
        for attr, method in vars(kernel).items():  # each method it overrides: one of cls, the same signature
            if callable(method) and not attr.startswith("__"):
                own = getattr(cls, attr, None)
                if not (callable(own) and signature(own) == signature(method)):
                    raise TypeError(f"kernels.apply: {cls.__module__}.{cls.__qualname__} has no method "
                                    f"{attr}{signature(method)} for {kernel.__qualname__}.{attr} to replace")
        name = f"Triton{cls.__name__}"
        _KERNEL_CLASSES[cls, kernel] = type(name, (kernel, cls), {
            "__module__": __name__, "__qualname__": name,
            "__doc__": f"{cls.__module__}.{cls.__qualname__} with the Triton kernels (kernels.apply)."})
    return _KERNEL_CLASSES[cls, kernel]
