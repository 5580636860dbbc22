"""Each Triton kernel against its PyTorch twin (forward and input gradients, odd shapes), each twin against
model.py's and muon.py's own code, and kernels.apply. On CPU the Triton interpreter runs them. Kernel and
twin sum in other orders: fp32 within 1e-5 (1e-4 for the grouped GEMMs), bf16 within the kernel's bf16
roundings of stored results (assert_bf16_close); bit for bit only gram's mirrored tiles and zero gradients."""
import ast
import copy
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")
import kernels  # noqa: E402
import model  # noqa: E402
from kernels import moe_kernel, newton_schulz_kernel, rmsnorm_kernel, swiglu_kernel  # noqa: E402
from muon import Muon, orthogonalize  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") == "0" else "cpu"
TOL, MOE_TOL, BF16 = dict(rtol=1e-5, atol=1e-5), dict(rtol=1e-4, atol=1e-4), torch.bfloat16
KERNELS = {model.RMSNorm: kernels.RMSNormKernel, model.MLP: kernels.MLPKernel, model.MoE: kernels.MoEKernel,
           model.BoundaryOperator: kernels.BoundaryOperatorKernel}  # as train.py maps them


def randn(*shape, grad=True, scale=1.0):
    return (torch.randn(*shape, device=DEVICE) * scale).requires_grad_(grad)


def grads_of(y, g, inputs):
    return torch.autograd.grad((y * g.to(y.dtype)).sum(), [t for t in inputs if t is not None])


def assert_same(fn, twin, inputs, tol):
    """fn(*inputs) == twin(*inputs), and the gradients of sum(y * g) for every input needing one."""
    y, y_twin = fn(*inputs), twin(*inputs)
    torch.testing.assert_close(y, y_twin, **tol)
    g, wrt = torch.randn_like(y), [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    for i, (a, b) in enumerate(zip(grads_of(y, g, wrt), grads_of(y_twin, g, wrt))):
        torch.testing.assert_close(a, b, **tol, msg=lambda m: f"gradient of input {i}: {m}")


def assert_bf16_close(actual, expected, roundings):
    """Within `roundings` bf16 roundings (< 2^-7: the interpreter truncates) of the largest magnitude."""
    tol = roundings * 2.0 ** -7
    atol = tol * expected.abs().max().item()
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tol, atol=atol)


def fp32_leaves(*tensors):
    return [t.detach().float().requires_grad_() if t is not None else None for t in tensors]


@pytest.mark.parametrize("shape", [(3, 5, 37), (19, 100), (1, 1)])
@pytest.mark.parametrize("gain", [True, False])
def test_rmsnorm_and_boundary_operator_match_their_twins(shape, gain):
    torch.manual_seed(0)
    weight = randn(shape[-1]) if gain else None
    assert_same(kernels.rmsnorm, rmsnorm_kernel.rmsnorm_reference, (randn(*shape), weight), TOL)
    assert_same(lambda h, e, w: kernels.boundary_operator(h, e, -0.37, w),
                lambda h, e, w: rmsnorm_kernel.boundary_operator_reference(h, e, -0.37, w),
                (randn(*shape), randn(*shape), weight), TOL)


def test_rmsnorm_bf16_with_an_fp32_gain():
    """bf16 q/k with an fp32 gain: y and d x bf16 (one rounding), d gain fp32."""
    torch.manual_seed(2)
    x, weight = torch.randn(7, 33, device=DEVICE).to(BF16).requires_grad_(), randn(33)
    with torch.autocast(DEVICE, dtype=BF16):
        y = kernels.rmsnorm(x, weight)
    g, (xf, wf) = torch.randn_like(y), fp32_leaves(x, weight)
    yf = rmsnorm_kernel.rmsnorm_reference(xf, wf)
    (dx, dw), (dxf, dwf) = grads_of(y, g, (x, weight)), grads_of(yf, g, (xf, wf))
    assert (y.dtype, dx.dtype, dw.dtype) == (BF16, BF16, torch.float32)
    assert_bf16_close(y, yf, 1)
    assert_bf16_close(dx, dxf, 1)
    torch.testing.assert_close(dw, dwf, **TOL)


@pytest.mark.parametrize("shape", [(3, 7, 45), (5, 1500)])
def test_swiglu_matches_twin_also_on_the_halves_of_a_fused_projection(shape):
    torch.manual_seed(5)
    assert_same(kernels.swiglu, swiglu_kernel.swiglu_reference, (randn(*shape), randn(*shape)), TOL)
    assert_same(lambda f: kernels.swiglu(*f.chunk(2, -1)),  # strided views
                lambda f: swiglu_kernel.swiglu_reference(*f.chunk(2, -1)), (randn(*shape[:-1], 150),), TOL)


def moe_inputs(counts, n_embd=40, hidden=24, seed=7):
    torch.manual_seed(seed)
    n = len(counts)
    return (randn(sum(counts), n_embd), torch.tensor(counts, device=DEVICE),
            randn(n, hidden, n_embd, scale=n_embd ** -.5), randn(n, hidden, n_embd, scale=n_embd ** -.5),
            randn(n, n_embd, hidden, scale=hidden ** -.5))


# an expert without rows and ragged tiles; an expert over several row tiles; no rows at all
@pytest.mark.parametrize("counts", [[7, 0, 13, 1, 16], [70, 0, 3, 0, 1], [0, 0, 0]])
def test_moe_experts_matches_twin_and_an_expert_without_rows_gets_zero_gradients(counts):
    inputs = moe_inputs(counts)
    assert_same(kernels.moe_experts, moe_kernel.moe_experts_reference, inputs, MOE_TOL)
    kernels.moe_experts(*inputs).square().sum().backward()
    for w in inputs[2:]:
        for e, count in enumerate(counts):
            assert torch.all(w.grad[e] == 0) if count == 0 else w.grad[e].abs().sum() > 0


@pytest.mark.parametrize("mode", ["bf16_tensors", "autocast"])
def test_moe_experts_bf16(mode):
    """bf16 tensors: bf16 out and gradients; fp32 under bf16 autocast: fp32 out and gradients. Against the
    fp32 twin on the bf16 values: the forward rounds 2 times, the backward 4."""
    x, counts, *weights = (t.detach() for t in moe_inputs([7, 0, 13, 1, 16]))
    leaves = [t.to(BF16 if mode == "bf16_tensors" else t.dtype).requires_grad_() for t in (x, *weights)]
    with torch.autocast(DEVICE, dtype=BF16, enabled=mode == "autocast"):
        y = kernels.moe_experts(leaves[0], counts, *leaves[1:])
    assert y.dtype == leaves[0].dtype
    g, leaves_f = torch.randn_like(y), fp32_leaves(*(t.to(BF16) for t in leaves))
    y_f = moe_kernel.moe_experts_reference(leaves_f[0], counts, *leaves_f[1:])
    assert_bf16_close(y, y_f, 2)
    for d, t, d_f in zip(grads_of(y, g, leaves), leaves, grads_of(y_f, g.to(BF16), leaves_f)):
        assert d.dtype == t.dtype
        assert_bf16_close(d, d_f, 4)


@pytest.mark.parametrize("shape,dtype", [((45, 29), torch.float32), ((3, 37, 50), torch.float32),
                                         ((2, 70, 9), BF16)])
def test_gram_matches_twin_and_mirrors_its_tiles(shape, dtype):
    """Off-diagonal tiles are the same registers stored twice: bit-equal mirrors."""
    torch.manual_seed(8)
    x = torch.randn(*shape, device=DEVICE).to(dtype).requires_grad_()
    if dtype == torch.float32:
        assert_same(kernels.gram, newton_schulz_kernel.gram_reference, (x,), MOE_TOL)
    c = kernels.gram(x.detach())
    assert c.dtype == dtype
    assert_bf16_close(c, newton_schulz_kernel.gram_reference(x.detach().float()), 1)
    block, m = (64 if DEVICE == "cuda" else 32), shape[-2]
    for i in range(0, m, block):
        for j in range(i + block, m, block):
            assert torch.equal(c[..., i:i + block, j:j + block], c[..., j:j + block, i:i + block].mT)


@pytest.mark.parametrize("ns_dtype,atol", [(torch.float32, 1e-4), (BF16, 0.1)])
def test_muon_with_the_gram_kernel_matches_plain_muon(ns_dtype, atol):
    """kernels.apply gives Muon (not AdamW) the Gram kernel; a step on a 2-D and an (E, out, in) parameter,
    and orthogonalize itself, equal the plain ones within the Newton-Schulz tolerance (bf16: <= 0.05)."""
    torch.manual_seed(10)
    start = [torch.randn(*shape, device=DEVICE) for shape in ((24, 40), (2, 40, 24))]
    params = {flag: [torch.nn.Parameter(p.clone()) for p in start] for flag in (True, False)}
    opts = {flag: Muon(ps, lr=0.02, ns_dtype=ns_dtype) for flag, ps in params.items()}
    adamw = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))])
    kernels.apply(torch.nn.Linear(2, 2), {}, optimizers=[opts[True], adamw])
    assert opts[True].gram is kernels.gram and opts[False].gram is None and not hasattr(adamw, "gram")
    for flag, ps in params.items():
        for p in ps:
            p.grad = torch.ones_like(p) + torch.arange(p.numel(), device=DEVICE).view(p.shape).sin()
        opts[flag].step()
    for a, b in zip(params[True], params[False]):
        torch.testing.assert_close(a, b, rtol=0, atol=0.02 * 1.5 * atol)  # 1.5: the tall-matrix lr scale
    update = torch.randn(37, 50, device=DEVICE)
    expected = orthogonalize(update, dtype=ns_dtype)
    fast = orthogonalize(update, dtype=ns_dtype, gram=kernels.gram)
    torch.testing.assert_close(fast, expected, rtol=0, atol=atol)




def model_config(**kw):
    base = dict(vocab_size=64, block_size=16, n_embd=40, n_head=1, head_dim=8, mlp_hidden=45, n_expert=5,
                top_k=2, expert_hidden=24, layout="pcc", n_layer=3, n_passes=2)
    return model.ModelConfig(**{**base, **kw})


def randomised(module, seed=11):
    """module with random gains ~1 and matrices ~1/sqrt(fan_in), on DEVICE."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            random = torch.randn_like(p)
            p.copy_(1 + 0.3 * random if p.dim() == 1 else random / p.shape[-1] ** 0.5)
    return module.to(DEVICE)


@pytest.mark.parametrize("norms", ["pre", "x"])  # with and without gains
def test_norm_and_swiglu_twins_are_model_code(norms):
    assert kernels.NORM_EPS == model.NORM_EPS
    norm = randomised(model.RMSNorm(37, gain=norms == "pre"))
    assert_same(lambda x, *w: norm(x), lambda x, *w: rmsnorm_kernel.rmsnorm_reference(x, norm.weight),
                (randn(3, 37), *norm.parameters()), TOL)
    bo = randomised(model.BoundaryOperator(model_config(boundary_alpha=0.37, norms=norms)))
    twin = lambda h, e, *w: rmsnorm_kernel.boundary_operator_reference(h, e, 0.37, *w[:1])  # noqa: E731
    assert_same(lambda h, e, *w: bo(h, e), twin, (randn(2, 5, 40), randn(2, 5, 40), *bo.parameters()), TOL)
    mlp = randomised(model.MLP(model_config()))
    twin = lambda x, *w: mlp.w_down(swiglu_kernel.swiglu_reference(mlp.w_gate(x), mlp.w_up(x)))  # noqa: E731
    assert_same(lambda x, *w: mlp(x)[0], twin, (randn(2, 9, 40), *mlp.parameters()), TOL)


@pytest.mark.parametrize("autocast", [False, True])
def test_moe_twin_is_model_run_experts(autocast):
    """model.run_experts, every row its own token and no router weights, is moe_experts_reference; under
    bf16 autocast within one bf16 rounding."""
    x, counts, *w = moe_inputs([7, 0, 13, 1, 16])  # F.grouped_mm: rows of 16-byte multiples
    rows = torch.arange(len(x), device=DEVICE)
    fn = lambda x, gate, up, w_down: model.run_experts(  # noqa: E731
        x, rows, counts, torch.stack([gate, up], 1), w_down)
    twin = lambda x, *w: moe_kernel.moe_experts_reference(x, counts, *w)  # noqa: E731
    if not autocast:
        return assert_same(fn, twin, (x, *w), MOE_TOL)
    with torch.autocast(DEVICE, dtype=BF16):
        y, y_twin = fn(x, *w), twin(x, *w)
    assert y.dtype == y_twin.dtype == torch.float32
    g = torch.randn_like(y)
    for a, b in zip([y, *grads_of(y, g, (x, *w))], [y_twin, *grads_of(y_twin, g, (x, *w))]):
        assert_bf16_close(b, a, 1)



MODULES = {"RMSNorm": lambda: model.RMSNorm(40), "MLP": lambda: model.MLP(model_config()),
           "MoE": lambda: model.MoE(model_config()),
           "BoundaryOperator": lambda: model.BoundaryOperator(model_config())}


def count_kernel_calls(monkeypatch):
    """Count the calls of the package's kernels (the swapped methods call them through it)."""
    calls = dict.fromkeys(("rmsnorm", "boundary_operator", "swiglu", "moe_experts"), 0)
    for name in calls:
        def counted(*args, _kernel=getattr(kernels, name), _name=name, **kw):
            calls[_name] += 1
            return _kernel(*args, **kw)
        monkeypatch.setattr(kernels, name, counted)
    return calls


@pytest.mark.parametrize("name,kwargs,expected_calls,tol", [
    ("RMSNorm", {}, dict(rmsnorm=1), TOL), ("MLP", {}, dict(swiglu=1), TOL),
    ("MoE", {}, dict(moe_experts=1), MOE_TOL),  # router weight on the output vs on the hidden activation
    ("BoundaryOperator", dict(norm=True, inject=True), dict(boundary_operator=1), TOL),  # fused
    ("BoundaryOperator", dict(norm=True, inject=False), dict(rmsnorm=1), TOL),  # a part: the swapped norm
    ("BoundaryOperator", dict(norm=False, inject=True), {}, TOL),  # a part: h + alpha * e, no kernel
])
def test_applied_module_matches_its_own_code(name, kwargs, expected_calls, tol, monkeypatch):
    """The same module, parameters, output and gradients after kernels.apply; which kernels ran;
    idempotent; a deep copy keeps the kernels; a plain module's state_dict loads."""
    module = randomised(MODULES[name]())
    args = (randn(2, 9, 40),) * (2 if name == "BoundaryOperator" else 1)
    wrt, params, plain = [*args, *module.parameters()], dict(module.named_parameters()), type(module)

    def run():
        out = module(*args, **kwargs)
        y = out[0] if isinstance(out, tuple) else out
        g = torch.randn(y.shape, generator=torch.Generator().manual_seed(12)).to(DEVICE)
        return y, torch.autograd.grad((y * g).sum(), wrt, allow_unused=True)

    y_plain, grads_plain = run()
    calls = count_kernel_calls(monkeypatch)
    assert kernels.apply(module, KERNELS) is module and isinstance(module, plain)
    assert type(module).__name__ == f"Triton{name}" and type(kernels.apply(module, KERNELS)) is type(module)
    assert all(p is params[n] for n, p in module.named_parameters()) and len(params) == len(wrt) - len(args)
    y, grads = run()
    assert calls == {**dict.fromkeys(calls, 0), **expected_calls}
    torch.testing.assert_close(y, y_plain, **tol)
    for i, (a, b) in enumerate(zip(grads, grads_plain)):
        assert (a is None) == (b is None)
        if b is not None:
            torch.testing.assert_close(a, b, **tol, msg=lambda m: f"gradient {i} of {len(wrt)}: {m}")
    assert type(copy.deepcopy(module)) is type(module) is type(kernels.apply(MODULES[name](), KERNELS))
    module.load_state_dict(MODULES[name]().state_dict())


def test_a_mapped_class_without_the_method_fails_loudly():
    class Plain(torch.nn.Module):
        pass

    with pytest.raises(TypeError, match="Plain has no experts for MoEKernel"):
        kernels.apply(torch.nn.Sequential(Plain()), {Plain: kernels.MoEKernel})


def test_kernels_import_nothing_from_the_project_and_not_triton_eagerly():
    """Parsed, so a lazy import counts too; `import kernels` leaves triton unimported."""
    project = {n[:-3] for n in os.listdir(REPO) if n.endswith(".py")} | {"data", "ladders", "tooling"}
    assert {"model", "muon"} <= project
    for name in sorted(os.listdir(os.path.join(REPO, "kernels"))):
        if name.endswith(".py"):
            for node in ast.walk(ast.parse(open(os.path.join(REPO, "kernels", name)).read())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
                assert not {n.split(".")[0] for n in names} & project, f"kernels/{name}: {names}"
    code = "import sys, kernels; assert 'triton' not in sys.modules and 'torch' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO, timeout=60).returncode == 0


AOT = r'''
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels import moe_kernel as moe, newton_schulz_kernel as ns, rmsnorm_kernel as norm
from kernels import swiglu_kernel as glu
POINTERS = {"TILES": "*i64", "ROWS": "*i64", "PAIRS": "*i32", "RSTD": "*fp32", "DW_PARTIAL": "*fp32"}
blocks = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, FP32_DOT=False)
norms = dict(HAS_WEIGHT=True, HAS_E=True, BLOCK_M=8, BLOCK_D=1024)
for kernel, constexprs in [(norm._rmsnorm_fwd_kernel, norms), (norm._rmsnorm_bwd_kernel, norms),
                           (glu._swiglu_bwd_kernel, dict(BLOCK_M=4, BLOCK_N=1024)),
                           (moe._gate_up_kernel, blocks), (moe._wgrad_kernel, blocks),
                           (moe._grouped_mm_kernel, dict(HAS_SECOND=True, **blocks)),
                           (ns._gram_kernel, dict(BLOCK_M=64, BLOCK_K=32, FP32_DOT=False))]:
    pointer = lambda n: n.isupper() and n not in "MNK"  # noqa: E731
    signature = {n: "constexpr" if n in constexprs else POINTERS.get(n, "*bf16") if pointer(n)
                 else "fp32" if n in ("eps", "alpha") else "i32" for n in kernel.arg_names}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    triton.compile(source, target=GPUTarget("cuda", 90, 32))
print("compiled")
'''


@pytest.mark.skipif(DEVICE == "cuda", reason="on CUDA the tests above run the kernels compiled")
def test_kernels_compile_for_sm90_without_a_gpu():
    """What only the compiler rejects: each kernel's bf16 variant, every option on, built to a cubin for
    sm_90 with the triton wheel's ptxas (~10 s)."""
    import triton
    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")):
        pytest.skip("this triton wheel ships no ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    result = subprocess.run([sys.executable, "-c", AOT], cwd=REPO, env=env, capture_output=True, text=True)
    assert result.stdout.strip() == "compiled", result.stderr[-3000:]
