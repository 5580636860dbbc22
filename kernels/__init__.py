"""
Small Triton kernels, each file with its launcher and its PyTorch twin, and `apply`, the one way they come
into a run (train.py --triton=True; opt-in on every device until bench/gpu_check.sh has passed on a GPU):

    rmsnorm(x, weight=None, eps)               fused RMSNorm                       rmsnorm_kernel.py
    boundary_operator(h, e, alpha, weight, eps)  [X3] RMSNorm(h) + alpha * e       rmsnorm_kernel.py
    swiglu(gate, up)                           silu(gate) * up                     swiglu_kernel.py
    moe_experts(x_sorted, counts, w_gate, w_up, w_down)  grouped-GEMM experts     moe_kernel.py
    gram(x) = x @ x.mT, half the tiles         Muon's Newton-Schulz                newton_schulz_kernel.py

Forward and backward in Triton (gram's backward is a torch matmul). On CUDA they compile; on a CPU only
the Triton interpreter runs them (TRITON_INTERPRET=1: tests). The package imports nothing of the project,
and `import kernels` does not import triton (it picks interpreter or compiler when a kernel is defined):
each kernel file is imported on first use.
"""
import importlib

NORM_EPS = 1e-6  # model.NORM_EPS (tests/test_kernels.py holds them equal)


def _file(name):
    return importlib.import_module(f"kernels.{name}_kernel")


def rmsnorm(x, weight=None, eps=NORM_EPS):
    return _file("rmsnorm").rmsnorm(x, weight, eps)


def boundary_operator(h, e, alpha, weight=None, eps=NORM_EPS):
    return _file("rmsnorm").boundary_operator(h, e, alpha, weight, eps)


def swiglu(gate, up):
    return _file("swiglu").swiglu(gate, up)


def moe_experts(x_sorted, counts, w_gate, w_up, w_down):
    return _file("moe").moe_experts(x_sorted, counts, w_gate, w_up, w_down)


def gram(x):
    return _file("newton_schulz").gram(x)


def apply(model, replacements, optimizers=()):
    """Swap the kernels into a built model in place, and Muon's Gram product; returns the model.

    replacements {model class: kernel class}, given by the caller (this package imports nothing of model.py):
        {RMSNorm: RMSNormKernel, MLP: MLPKernel, MoE: MoEKernel, BoundaryOperator: BoundaryOperatorKernel}
    Each instance of a mapped class (or subclass) gets as its class Triton<Name>(kernel class, its class):
    parameters, buffers and the state_dict stay the same objects, so checkpoints load either way, and
    copy.deepcopy keeps the kernels (grow.py copies blocks). Idempotent. Call it before torch.compile.
    Each optimizer with a `gram` attribute (muon.Muon) gets gram for its Newton-Schulz iteration."""
    for module in model.modules():
        mapped = next((cls for cls in type(module).__mro__ if cls in replacements), None)
        if mapped is not None and not isinstance(module, replacements[mapped]):
            module.__class__ = _subclass(type(module), replacements[mapped])
    for opt in optimizers:
        if hasattr(opt, "gram"):
            opt.gram = gram
    return model


_SUBCLASSES = {}  # (class, kernel class) -> their subclass: one per pair, so copies share it


def _subclass(cls, kernel):
    if (cls, kernel) not in _SUBCLASSES:
        missing = [name for name in vars(kernel) if not name.startswith("__") and not hasattr(cls, name)]
        if missing:  # a method renamed in model.py: its kernel would silently never run
            raise TypeError(f"kernels.apply: {cls.__qualname__} has no {missing[0]} for {kernel.__name__}")
        _SUBCLASSES[cls, kernel] = type(f"Triton{cls.__name__}", (kernel, cls), {"__module__": __name__})
    return _SUBCLASSES[cls, kernel]


class RMSNormKernel:
    def forward(self, x):
        return rmsnorm(x, self.weight)


class MLPKernel:
    def forward(self, x):
        return self.w_down(swiglu(self.w_gate(x), self.w_up(x))), None


class MoEKernel:
    def experts(self, x, token_of, counts, weight_of):
        """All experts in one launch over the expert-sorted copies of the tokens; each output row times its
        router weight (model.run_experts scales the hidden activation: the same, by linearity)."""
        y = moe_experts(x[token_of], counts, *self.w_gate_up.unbind(1), self.w_down)
        if weight_of is not None:
            y = y * weight_of.unsqueeze(1).to(y.dtype)
        return x.new_zeros(x.shape).scatter_add_(0, token_of.unsqueeze(1).expand_as(y), y)  # as run_experts


class BoundaryOperatorKernel:
    def forward(self, h, e, norm=True, inject=True):
        if norm and inject and self.norm is not None:  # one part alone: the module's own code
            return boundary_operator(h, e, self.alpha, self.norm.weight)
        return super().forward(h, e, norm, inject)
