"""
Small Triton kernels, each file with its launcher and PyTorch twin, and `apply`, the one
way they come into a run (train.py --triton=True, opt-in until bench/gpu_check.sh passes):

    rmsnorm(x, weight, eps)              fused RMSNorm                rmsnorm_kernel.py
    boundary_operator(h, e, alpha, ...)  [X3] RMSNorm(h) + alpha e    rmsnorm_kernel.py
    swiglu(gate, up)                     silu(gate) * up              swiglu_kernel.py
    moe_experts(x_sorted, counts, ...)   grouped-GEMM experts         moe_kernel.py
    gram(x) = x @ x.mT, half the tiles   Muon's Newton-Schulz         newton_schulz_kernel.py

On a CPU the Triton interpreter runs them (TRITON_INTERPRET=1). The package imports
nothing of the project; each kernel file, and triton, is imported on first use.

    python -m pytest tests/test_kernels.py
    python bench/bench.py kernels  # vs twins
"""
import importlib

# model.NORM_EPS; tests/test_kernels.py holds them equal.
NORM_EPS = 1e-6


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
    """Swap the kernels into a built model in place, and gram into each optimizer with a
    `gram` attribute (muon.Muon); returns model. Idempotent; call it before torch.compile.
    replacements: {model class: kernel class}, e.g. {RMSNorm: RMSNormKernel, ...}."""
    # Each instance of a mapped class (or subclass) gets the class Triton<Name>(kernel
    # class, its class). Parameters, buffers and state_dict stay the same objects, so
    # checkpoints load either way, and copy.deepcopy keeps the kernels.
    for module in model.modules():
        mapped = next((cls for cls in type(module).__mro__ if cls in replacements), None)
        if mapped is not None and not isinstance(module, replacements[mapped]):
            module.__class__ = _subclass(type(module), replacements[mapped])
    for opt in optimizers:
        if hasattr(opt, "gram"):
            opt.gram = gram
    return model


# (class, kernel class) -> their subclass: one per pair, so copies share it.
_SUBCLASSES = {}


def _subclass(cls, kernel):
    if (cls, kernel) not in _SUBCLASSES:
        # A method renamed in model.py would leave its kernel silently unused.
        missing = [n for n in vars(kernel) if not n.startswith("__") and not hasattr(cls, n)]
        if missing:
            raise TypeError(
                f"kernels.apply: {cls.__qualname__} has no {missing[0]} for {kernel.__name__}"
            )
        name = f"Triton{cls.__name__}"
        _SUBCLASSES[cls, kernel] = type(name, (kernel, cls), {"__module__": __name__})
    return _SUBCLASSES[cls, kernel]


class RMSNormKernel:
    def forward(self, x):
        return rmsnorm(x, self.weight)


class MLPKernel:
    def forward(self, x):
        return self.w_down(swiglu(self.w_gate(x), self.w_up(x))), None


class MoEKernel:
    def experts(self, x, token_of, counts, weight_of):
        """All experts in one launch over the expert-sorted copies of the tokens."""
        y = moe_experts(x[token_of], counts, *self.w_gate_up.unbind(1), self.w_down)
        # Each output row times its router weight. model.run_experts scales the hidden
        # activation instead: the same, by linearity.
        if weight_of is not None:
            y = y * weight_of.unsqueeze(1).to(y.dtype)
        # Summed back per token, as run_experts does.
        return x.new_zeros(x.shape).scatter_add_(0, token_of.unsqueeze(1).expand_as(y), y)


class BoundaryOperatorKernel:
    def forward(self, h, e, norm=True, inject=True):
        # One part alone runs the module's own code.
        if norm and inject and self.norm is not None:
            return boundary_operator(h, e, self.alpha, self.norm.weight)
        return super().forward(h, e, norm, inject)
