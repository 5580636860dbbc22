"""
Every Triton kernel in kernels/ against its PyTorch twin: forward and every input gradient, on odd
(non power-of-two) shapes. On CPU the kernels run in the Triton interpreter (conftest.py sets
TRITON_INTERPRET=1); on CUDA the same tests run compiled.

Tolerances (fp32): kernel and twin do the same fp32 arithmetic in a different summation order, so they
differ by reassociation only: ~1e-6 relative for the norms and SwiGLU, ~1e-5 for the grouped GEMMs
(sums over up to ~70 rows). We assert rtol = atol = 1e-5 (norms, SwiGLU) and 1e-4 (MoE, Gram).
Gradients come from a random linear downstream loss sum(y * g), so every output element matters.
"""
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")
import kernels  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
DEVICE = "cpu" if INTERPRETED or not torch.cuda.is_available() else "cuda"
TOL = dict(rtol=1e-5, atol=1e-5)
MOE_TOL = dict(rtol=1e-4, atol=1e-4)


def assert_same_forward_and_grads(fn, twin, inputs, tol):
    """fn(*inputs) == twin(*inputs), and d/d(input) of sum(y * g) agree for every tensor needing grad."""
    y, y_twin = fn(*inputs), twin(*inputs)
    torch.testing.assert_close(y, y_twin, **tol)
    g = torch.randn_like(y)
    wrt = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    grads = torch.autograd.grad((y * g).sum(), wrt)
    grads_twin = torch.autograd.grad((y_twin * g).sum(), wrt)
    for i, (a, b) in enumerate(zip(grads, grads_twin)):
        torch.testing.assert_close(a, b, **tol, msg=lambda m: f"gradient of input {i}: {m}")


def randn(*shape, grad=True):
    return torch.randn(*shape, device=DEVICE).requires_grad_(grad)


@pytest.mark.parametrize("shape", [(3, 5, 37), (19, 100), (2, 257), (1, 1)])
@pytest.mark.parametrize("with_weight", [True, False])
def test_rmsnorm_matches_twin(shape, with_weight):
    torch.manual_seed(0)
    weight = randn(shape[-1]) if with_weight else None
    assert_same_forward_and_grads(kernels.rmsnorm, kernels.rmsnorm_reference, (randn(*shape), weight), TOL)


def test_rmsnorm_strided_input_and_eps():
    torch.manual_seed(1)
    x = randn(13, 64)[:, 5:50]  # row stride 64 != 45: handled without a copy
    weight = randn(45)
    fn = lambda x, w: kernels.rmsnorm(x, w, eps=1e-2)  # noqa: E731
    twin = lambda x, w: kernels.rmsnorm_reference(x, w, eps=1e-2)  # noqa: E731
    assert_same_forward_and_grads(fn, twin, (x, weight), TOL)


def test_rmsnorm_bf16_storage_fp32_math():
    """bf16 in, bf16 out; the kernel computes in fp32 (like the twin), so they agree to one bf16 rounding."""
    torch.manual_seed(2)
    x = torch.randn(7, 33, device=DEVICE).bfloat16()
    weight = torch.randn(33, device=DEVICE).bfloat16()
    y = kernels.rmsnorm(x, weight)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, kernels.rmsnorm_reference(x, weight), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("shape,alpha", [((3, 5, 37), 1.0), ((2, 11, 96), 0.37), ((29, 3), -2.5)])
@pytest.mark.parametrize("with_weight", [True, False])
def test_boundary_operator_matches_twin(shape, alpha, with_weight):
    torch.manual_seed(3)
    weight = randn(shape[-1]) if with_weight else None
    fn = lambda h, e, w: kernels.boundary_operator(h, e, alpha, w)  # noqa: E731
    twin = lambda h, e, w: kernels.boundary_operator_reference(h, e, alpha, w)  # noqa: E731
    assert_same_forward_and_grads(fn, twin, (randn(*shape), randn(*shape), weight), TOL)


def test_boundary_operator_at_h0_zero():
    """[X] starts the core from h0 = 0: BO(0, e) = alpha * e with a finite gradient for h."""
    torch.manual_seed(4)
    h, e, weight = torch.zeros(4, 6, 23, device=DEVICE, requires_grad=True), randn(4, 6, 23), randn(23)
    y = kernels.boundary_operator(h, e, 0.5, weight)
    torch.testing.assert_close(y, 0.5 * e, **TOL)
    fn = lambda h, e, w: kernels.boundary_operator(h, e, 0.5, w)  # noqa: E731
    twin = lambda h, e, w: kernels.boundary_operator_reference(h, e, 0.5, w)  # noqa: E731
    assert_same_forward_and_grads(fn, twin, (h, e, weight), TOL)


@pytest.mark.parametrize("shape", [(3, 7, 45), (33, 130), (5, 1500)])
def test_swiglu_matches_twin(shape):
    torch.manual_seed(5)
    assert_same_forward_and_grads(kernels.swiglu, kernels.swiglu_reference, (randn(*shape), randn(*shape)), TOL)


def test_swiglu_on_chunks_of_a_fused_projection():
    torch.manual_seed(6)
    fused = randn(2, 9, 2 * 75)
    split = lambda f, fn: fn(*f.chunk(2, dim=-1))  # noqa: E731
    assert_same_forward_and_grads(lambda f: split(f, kernels.swiglu), lambda f: split(f, kernels.swiglu_reference),
                                  (fused,), TOL)


def moe_inputs(counts, n_embd=40, hidden=24, seed=7):
    torch.manual_seed(seed)
    n_experts, n_tokens = len(counts), sum(counts)
    return (randn(n_tokens, n_embd), torch.tensor(counts, device=DEVICE),
            (randn(n_experts, hidden, n_embd, grad=False) / n_embd ** 0.5).requires_grad_(),
            (randn(n_experts, hidden, n_embd, grad=False) / n_embd ** 0.5).requires_grad_(),
            (randn(n_experts, n_embd, hidden, grad=False) / hidden ** 0.5).requires_grad_())


@pytest.mark.parametrize("counts", [
    [7, 0, 13, 1, 16],  # an expert with zero tokens, ragged tiles
    [0, 37, 0, 0, 0],   # one expert receives every token
    [70, 0, 3, 0, 1],   # an expert spanning several row tiles
])
def test_moe_experts_matches_twin(counts):
    inputs = moe_inputs(counts)
    assert_same_forward_and_grads(kernels.moe_experts, kernels.moe_experts_reference, inputs, MOE_TOL)


def test_moe_experts_zero_token_expert_gets_zero_grad():
    x, counts, w_gate, w_up, w_down = moe_inputs([5, 0, 9], n_embd=33, hidden=19)
    kernels.moe_experts(x, counts, w_gate, w_up, w_down).square().sum().backward()
    for w in (w_gate, w_up, w_down):
        assert torch.all(w.grad[1] == 0) and w.grad[0].abs().sum() > 0 and w.grad[2].abs().sum() > 0


def test_moe_experts_int32_counts_and_transposed_weights():
    x, counts, w_gate, w_up, w_down = moe_inputs([4, 11, 0, 6], n_embd=27, hidden=50)
    w_down_t = w_down.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()  # strided view
    inputs = (x, counts.int(), w_gate, w_up, w_down_t)
    assert_same_forward_and_grads(kernels.moe_experts, kernels.moe_experts_reference, inputs, MOE_TOL)


def test_moe_experts_bad_inputs_raise_clear_errors():
    x, counts, w_gate, w_up, w_down = moe_inputs([3, 4])
    with pytest.raises(ValueError, match="w_down shape"):
        kernels.moe_experts(x, counts, w_gate, w_up, w_down.transpose(1, 2))
    with pytest.raises(ValueError, match="counts"):
        kernels.moe_experts(x, counts.float(), w_gate, w_up, w_down)
    if DEVICE == "cpu":  # the sum check costs a host sync, so it runs on CPU only
        with pytest.raises(ValueError, match="sum to the 7 rows"):
            kernels.moe_experts(x, torch.tensor([3, 5]), w_gate, w_up, w_down)


@pytest.mark.parametrize("shape", [(45, 29), (3, 37, 50), (2, 70, 9)])
def test_gram_matches_twin_and_is_symmetric(shape):
    torch.manual_seed(8)
    x = randn(*shape)
    assert_same_forward_and_grads(kernels.gram, kernels.gram_reference, (x,), MOE_TOL)
    c = kernels.gram(x.detach())
    assert torch.equal(c, c.mT)  # the mirrored tiles are the same registers stored twice


@pytest.mark.parametrize("shape", [(37, 50), (2, 61, 19)])
def test_newton_schulz_matches_twin(shape):
    """Muon's iteration amplifies round-off a little over 5 steps: rtol = atol = 1e-4 on O(1) outputs."""
    torch.manual_seed(9)
    update = torch.randn(*shape, device=DEVICE)
    torch.testing.assert_close(kernels.newton_schulz(update), kernels.newton_schulz_reference(update),
                               rtol=1e-4, atol=1e-4)


def test_norm_and_swiglu_shape_errors():
    with pytest.raises(ValueError, match="weight shape"):
        kernels.rmsnorm(randn(3, 8), randn(7))
    with pytest.raises(ValueError, match="e shape"):
        kernels.boundary_operator(randn(3, 8), randn(3, 9), 1.0)
    with pytest.raises(ValueError, match="up shape"):
        kernels.swiglu(randn(3, 8), randn(3, 9))


def test_package_import_does_not_import_triton():
    """TRITON_INTERPRET is read when a kernel is defined, so `import kernels` must not define any."""
    code = "import sys, kernels; assert 'triton' not in sys.modules, 'triton imported eagerly'"
    result = _run_without_interpreter(["-c", code])
    assert result.returncode == 0, result.stderr


def _run_without_interpreter(args):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, *args], cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          env=env, capture_output=True, text=True, timeout=300)


def test_kernels_on_cpu_without_interpreter_raise_clear_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        kernels.rmsnorm(torch.ones(2, 3))


def _has_bundled_ptxas():
    import triton
    return os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas"))


@pytest.mark.skipif(DEVICE == "cuda", reason="on CUDA the kernels run compiled in the tests above")
@pytest.mark.skipif(not _has_bundled_ptxas(), reason="this triton wheel ships no ptxas")
def test_kernels_compile_for_sm90_without_a_gpu():
    """The interpreter cannot see compile-only errors: build each kernel's bf16 cubin for sm_90
    (the variant with every option on; `python -m kernels.aot_check` builds all variants)."""
    result = _run_without_interpreter(["-m", "kernels.aot_check", "--arch=90", "--dtypes=bf16", "--quick"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count('"kernel"') == 8, result.stdout
