"""
Every Triton kernel in kernels/ against its PyTorch twin: forward and every input gradient, on odd
(non power-of-two) shapes. On CPU the kernels run in the Triton interpreter (conftest.py sets
TRITON_INTERPRET=1); on CUDA the same tests run compiled.

What is asserted is what is guaranteed on any machine: kernel and twin are two code paths (the twin's
matmuls go to the machine's BLAS, the interpreter's tl.dot to numpy's), so their floats are compared
within tolerances, never bit for bit. Bit-equality is asserted only where the kernel guarantees it by
construction: the mirrored off-diagonal tiles of gram (the same registers stored twice) and the exact
zero gradient of an expert with no rows (an empty loop stores its zero accumulator).

Tolerances (fp32): kernel and twin do the same fp32 arithmetic in a different summation order, so they
differ by reassociation only: ~1e-6 relative for the norms and SwiGLU, ~1e-5 for the grouped GEMMs
(sums over up to ~70 rows). We assert rtol = atol = 1e-5 (norms, SwiGLU) and 1e-4 (MoE, Gram).
Gradients come from a random linear downstream loss sum(y * g), so every output element matters.

bf16 (the CUDA default, under autocast): the interpreter cannot do bf16 arithmetic, but the kernels
convert after every load, so bf16 tensors go through the real plumbing with fp32 arithmetic, as on the
GPU. They are compared with the twin computed in fp32 on the same bf16-rounded values; the difference is
then the kernel's bf16 roundings of stored results only: see assert_bf16_close.

The twins are held to the project's own code (model.py's RMSNorm, BoundaryOperator, MLP and run_experts;
muon.orthogonalize for the Gram kernel), so kernel ~ twin ~ the code that runs without kernels.apply.
kernels.apply is tested per module here and per model family in test_model.py. kernels/ imports nothing
from the project and runs copied alone (the last tests).
"""
import ast
import copy
import inspect
import os
import shutil
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")
import kernels  # noqa: E402
import model  # noqa: E402
from kernels import moe_kernel, newton_schulz_kernel, rmsnorm_kernel  # noqa: E402  (imports triton)
from muon import Muon, orthogonalize  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

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


@pytest.mark.parametrize("counts", [[5, 0, 9], [0, 0, 0]])  # an empty expert; no rows at all
@pytest.mark.parametrize("autocast", [False, True])
def test_moe_experts_zero_token_expert_gets_zero_grad(counts, autocast):
    """An expert with no rows gets an exact zero gradient (bit-equality is right here: the weight-gradient
    kernel's loop is empty and it stores its zero accumulator; with no rows at all the twin's empty
    matmuls give zeros), never None, in the weight's dtype. Also under autocast (bf16 operands)."""
    x, counts_t, w_gate, w_up, w_down = moe_inputs(counts, n_embd=33, hidden=19)
    with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
        y = kernels.moe_experts(x, counts_t, w_gate, w_up, w_down)
    assert y.shape == (sum(counts), 33) and y.dtype == x.dtype
    y.square().sum().backward()
    assert x.grad.shape == x.shape and x.grad.dtype == x.dtype
    for w in (w_gate, w_up, w_down):
        assert w.grad is not None and w.grad.dtype == w.dtype
        for e, count in enumerate(counts):
            assert torch.all(w.grad[e] == 0) if count == 0 else w.grad[e].abs().sum() > 0


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


def assert_gram_symmetry(c, x, store_rounding=0.0):
    """What gram guarantees about symmetry, tile by tile (tiles of the size the kernel used):
    off-diagonal tiles (i != j): C[j, i] is the registers of C[i, j] stored transposed: bit-equal.
    diagonal tiles: one matmul X_i X_i^T, symmetric only up to rounding on any backend (summation order
    of a BLAS kernel or the tensor cores). Any order of a k-term fp32 sum is within k * 2^-24 * sum|terms|
    of the exact value, and sum_k |x_ik x_jk| <= sqrt(C_ii C_jj) <= max diag C: so |C_ij - C_ji| is at most
    2 * maxdiag * (k * 2^-24 + store_rounding) (store_rounding: 2^-7 for a bf16 result, 0 for fp32)."""
    block = newton_schulz_kernel._blocks(c.device.type)[0]
    m, k = x.shape[-2:]
    max_diag = c.float().diagonal(dim1=-2, dim2=-1).max().item()
    atol = 2 * max_diag * (k * 2.0 ** -24 + store_rounding)
    for i in range(0, m, block):
        for j in range(0, m, block):
            tile, mirror = c[..., i:i + block, j:j + block], c[..., j:j + block, i:i + block]
            if i != j:
                assert torch.equal(tile, mirror.mT), f"off-diagonal tile ({i}, {j}) is not an exact mirror"
            else:
                torch.testing.assert_close(tile.float(), mirror.mT.float(), rtol=0, atol=atol)


@pytest.mark.parametrize("shape", [(45, 29), (3, 37, 50), (2, 70, 9)])
def test_gram_matches_twin_and_is_symmetric(shape):
    torch.manual_seed(8)
    x = randn(*shape)
    assert_same_forward_and_grads(kernels.gram, kernels.gram_reference, (x,), MOE_TOL)
    assert_gram_symmetry(kernels.gram(x.detach()), x)


@pytest.mark.parametrize("shape", [(37, 50), (2, 61, 19)])
def test_newton_schulz_with_gram_kernel_matches_plain_matmuls(shape):
    """muon.orthogonalize (the project's one Newton-Schulz iteration) in fp32 with gram=kernels.gram vs its
    plain matmuls. The iteration amplifies round-off a little over 5 steps: perturbing every Gram product
    by 1e-6 relative noise (~8 fp32 ulps, more than a different BLAS or summation order does) moves these
    outputs (|x| < 0.5) by < 1e-5. Asserted: rtol = atol = 1e-4."""
    torch.manual_seed(9)
    update = torch.randn(*shape, device=DEVICE)
    expected = orthogonalize(update, dtype=torch.float32)
    for dtype in [torch.float32] + ([None] if DEVICE == "cpu" else []):  # None: fp32 on CPU, bf16 on CUDA
        y = orthogonalize(update, 5, 1e-7, dtype=dtype, gram=kernels.gram)
        assert y.dtype == torch.float32
        torch.testing.assert_close(y, expected, rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------------------------------
# bf16 plumbing: what each wrapper casts, the dtypes it returns, empty experts, gradient dtypes

BF16 = torch.bfloat16


def assert_bf16_close(actual, expected, roundings):
    """actual: a kernel result that went through `roundings` successive bf16 roundings of stored results
    or intermediates; expected: the twin in fp32 on the same bf16-rounded inputs. One rounding moves a
    value by < 2^-7 of itself (the interpreter's fp32 -> bf16 conversion truncates; the GPU rounds to
    nearest: half that). A later sum mixes rounded terms and may cancel, so the absolute part of the
    tolerance is taken against the tensor's largest magnitude."""
    assert actual.shape == expected.shape
    tol = roundings * 2.0 ** -7
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tol, atol=tol * expected.abs().max().item())


def fp32_leaves(*tensors):
    """fp32 leaf copies of exactly the values given (pass bf16-rounded tensors), for the fp32 twin."""
    return [t.detach().float().requires_grad_() if t is not None else None for t in tensors]


def grads_of(y, g, inputs):
    return torch.autograd.grad((y * g.to(y.dtype)).sum(), [t for t in inputs if t is not None])


class LaunchSpy:
    """Stands in for a @triton.jit kernel: records {argument name: dtype} of the tensors of each launch,
    then launches the real kernel. Shows what a wrapper hands the kernel (the casts it did or did not do)."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append({name: a.dtype for name, a in zip(self.kernel.arg_names, args)
                                  if isinstance(a, torch.Tensor)})
            return self.kernel[grid](*args, **kwargs)
        return launch


def spy(monkeypatch, module, name):
    launcher = LaunchSpy(getattr(module, name))
    monkeypatch.setattr(module, name, launcher)
    return launcher


@pytest.mark.parametrize("weight_dtype", [torch.float32, BF16, None])
@pytest.mark.parametrize("autocast", [False, True])
def test_rmsnorm_bf16(weight_dtype, autocast, monkeypatch):
    """bf16 activations (e.g. q/k under autocast) with an fp32 or bf16 gain. The wrapper casts nothing
    (the kernel loads bf16 and converts to fp32); y and d x are bf16 (one rounding each); d weight has
    the weight's dtype: for fp32 it is summed in fp32 from the same values as the twin (fp32 tolerance).
    Autocast changes nothing."""
    torch.manual_seed(2)
    launches = spy(monkeypatch, rmsnorm_kernel, "_rmsnorm_fwd_kernel").launches
    x = torch.randn(7, 33, device=DEVICE).to(BF16).requires_grad_()
    weight = torch.randn(33, device=DEVICE).to(weight_dtype).requires_grad_() if weight_dtype else None
    with torch.autocast(DEVICE, dtype=BF16, enabled=autocast):
        y = kernels.rmsnorm(x, weight)
    assert y.dtype == BF16
    assert launches[0]["X"] == launches[0]["Y"] == BF16  # no cast before the kernel, none after
    assert weight is None or launches[0]["W"] == weight_dtype
    g = torch.randn_like(y)
    grads = grads_of(y, g, (x, weight))
    xf, wf = fp32_leaves(x, weight)
    yf = kernels.rmsnorm_reference(xf, wf)
    grads_f = grads_of(yf, g, (xf, wf))
    assert_bf16_close(y, yf, roundings=1)
    assert grads[0].dtype == BF16
    assert_bf16_close(grads[0], grads_f[0], roundings=1)
    if weight is not None:
        assert grads[1].dtype == weight_dtype
        if weight_dtype == torch.float32:
            torch.testing.assert_close(grads[1], grads_f[1], **TOL)
        else:
            assert_bf16_close(grads[1], grads_f[1], roundings=1)


def test_boundary_operator_bf16_h_with_fp32_e_and_weight_under_autocast():
    """BO(h, e) with a bf16 h and an fp32 e and gain: the result and d h in h's dtype (bf16, one rounding),
    d e and d weight in fp32 (fp32 arithmetic on the same values as the twin: fp32 tolerance)."""
    torch.manual_seed(3)
    h = torch.randn(2, 11, 96, device=DEVICE).to(BF16).requires_grad_()
    e, weight = randn(2, 11, 96), randn(96)
    with torch.autocast(DEVICE, dtype=BF16):
        y = kernels.boundary_operator(h, e, 0.37, weight)
    assert y.dtype == BF16
    g = torch.randn_like(y)
    dh, de, dw = grads_of(y, g, (h, e, weight))
    assert (dh.dtype, de.dtype, dw.dtype) == (BF16, torch.float32, torch.float32)
    hf, ef, wf = fp32_leaves(h, e, weight)
    yf = kernels.boundary_operator_reference(hf, ef, 0.37, wf)
    dhf, def_, dwf = grads_of(yf, g, (hf, ef, wf))
    assert_bf16_close(y, yf, roundings=1)
    assert_bf16_close(dh, dhf, roundings=1)
    torch.testing.assert_close(de, def_, **TOL)
    torch.testing.assert_close(dw, dwf, **TOL)


def test_swiglu_bf16_on_a_projection_made_under_autocast():
    """As the model calls it: gate and up are the two halves of one projection computed under autocast,
    hence bf16 (strided views, no copy). The result and both gradients are bf16 (one rounding each);
    the projection's fp32 weight still gets an fp32 gradient."""
    torch.manual_seed(6)
    x, w = randn(2, 9, 40, grad=False), (randn(2 * 75, 40, grad=False) / 40 ** 0.5).requires_grad_()
    with torch.autocast(DEVICE, dtype=BF16):
        fused = torch.nn.functional.linear(x, w)
        y = kernels.swiglu(*fused.chunk(2, dim=-1))
    assert fused.dtype == BF16 and y.dtype == BF16
    g = torch.randn_like(y)
    d_fused, dw = grads_of(y, g, (fused, w))
    assert d_fused.dtype == BF16 and dw.dtype == torch.float32
    (ff,) = fp32_leaves(fused)
    yf = kernels.swiglu_reference(*ff.chunk(2, dim=-1))
    (d_ff,) = grads_of(yf, g, (ff,))
    assert_bf16_close(y, yf, roundings=1)
    assert_bf16_close(d_fused, d_ff, roundings=1)


@pytest.mark.parametrize("mode", ["bf16_tensors", "autocast"])
def test_moe_experts_bf16(mode):
    """bf16_tensors: x and weights bf16, no autocast: bf16 operands, result and gradients bf16.
    autocast: fp32 x and weights (the model's residual stream and master weights) under bf16 autocast:
    operands cast to bf16 as torch.matmul would, the result in x's dtype (fp32), each gradient in its
    input's dtype (fp32), each stored straight from an fp32 accumulator.
    Against the fp32 twin on the same bf16-rounded operands: the forward rounds act (and a bf16 result):
    2 roundings; the backward rounds dy, d act, the saved pre-activations, d gate / d up and a bf16
    result: 4. Measured here: <= 0.7% (forward) and <= 1.5% (gradients) of each tensor's max magnitude."""
    x, counts, w_gate, w_up, w_down = (t.detach() if t.is_floating_point() else t
                                       for t in moe_inputs([7, 0, 13, 1, 16]))
    if mode == "bf16_tensors":
        x, w_gate, w_up, w_down = (t.to(BF16) for t in (x, w_gate, w_up, w_down))
    leaves = [t.requires_grad_() for t in (x, w_gate, w_up, w_down)]
    with torch.autocast(DEVICE, dtype=BF16, enabled=mode == "autocast"):
        y = kernels.moe_experts(x, counts, w_gate, w_up, w_down)
    assert y.dtype == x.dtype
    g = torch.randn_like(y)
    grads = grads_of(y, g, leaves)
    assert [d.dtype for d in grads] == [t.dtype for t in leaves]
    leaves_f = fp32_leaves(*(t.to(BF16) for t in leaves))
    y_f = kernels.moe_experts_reference(leaves_f[0], counts, *leaves_f[1:])
    assert_bf16_close(y, y_f, roundings=2)
    for d, d_f in zip(grads, grads_of(y_f, g.to(BF16), leaves_f)):  # the kernel's dy is bf16: so is the twin's
        assert_bf16_close(d, d_f, roundings=4)


def test_moe_experts_under_autocast_casts_operands_and_returns_the_activation_dtype(monkeypatch):
    """The casts the wrapper does under autocast, seen by the kernels: bf16 operands and saved
    pre-activations; the down projection and d x stored in x's dtype, the weight gradients in fp32.
    And what model.MoE does with the result: x_sorted = flat[token_of] (fp32 residual stream), a weighted
    index_add_ into zeros_like(flat), which needs result dtype == flat dtype, then backward."""
    gate_up = spy(monkeypatch, moe_kernel, "_moe_gate_up_kernel").launches
    mm = spy(monkeypatch, moe_kernel, "_grouped_mm_kernel").launches
    wgrad = spy(monkeypatch, moe_kernel, "_grouped_wgrad_kernel").launches
    _, counts, w_gate, w_up, w_down = moe_inputs([4, 0, 3])
    flat = randn(5, 40)
    token_of = torch.tensor([0, 1, 3, 4, 1, 2, 4], device=DEVICE)  # 7 (token, expert) pairs sorted by expert
    route_weights = torch.rand(7, device=DEVICE)
    with torch.autocast(DEVICE, dtype=BF16):
        y_sorted = kernels.moe_experts(flat[token_of], counts, w_gate, w_up, w_down)
        out = torch.zeros_like(flat).index_add_(0, token_of, y_sorted * route_weights[:, None].to(y_sorted.dtype))
    assert y_sorted.dtype == out.dtype == torch.float32
    out.square().sum().backward()
    assert flat.grad.dtype == torch.float32 and all(w.grad.dtype == torch.float32 for w in (w_gate, w_up, w_down))
    assert gate_up == [dict(X=BF16, WG=BF16, WU=BF16, HG=BF16, HU=BF16, ACT=BF16, TILE_EXPERT=torch.int32,
                            TILE_FIRST_ROW=torch.int64, TILE_LAST_ROW=torch.int64)]
    operands = ("A", "B", "A2", "B2")
    # launches: down projection (forward), d act, d x
    assert [{n: l[n] for n in operands} for l in mm] == [dict.fromkeys(operands, BF16)] * 3
    assert [l["C"] for l in mm] == [torch.float32, BF16, torch.float32]
    assert [(l["A"], l["B"], l["C"]) for l in wgrad] == [(BF16, BF16, torch.float32)] * 3


def test_gram_bf16():
    """bf16 in, bf16 out (fp32 accumulation, one rounding at the store); the mirrored tiles stay exact
    copies; the gradient (a torch matmul) is bf16."""
    torch.manual_seed(8)
    x = torch.randn(2, 70, 9, device=DEVICE).to(BF16).requires_grad_()
    c = kernels.gram(x)
    assert c.dtype == BF16
    (xf,) = fp32_leaves(x)
    assert_bf16_close(c, kernels.gram_reference(xf), roundings=1)
    assert_gram_symmetry(c.detach(), x, store_rounding=2.0 ** -7)
    (dx,) = grads_of(c, torch.randn_like(c), (x,))
    assert dx.dtype == BF16


@pytest.mark.parametrize("shape", [(37, 50), (2, 61, 19)])
def test_newton_schulz_bf16_arithmetic(shape, monkeypatch):
    """dtype=bf16 (the CUDA default) runs through the Triton Gram kernel in the interpreter too: every
    Gram product is a bf16 launch, the result has update's dtype. bf16 keeps 8 significant bits and five
    iterations compound the roundings, so the bf16 result is only near the fp32 one. Measured over 30
    random inputs of these shapes (|x| <= 0.45): max |kernel bf16 - fp32| 0.033, |kernel bf16 - plain bf16|
    0.047, relative Frobenius distance to fp32 4.3%, singular values in [0.66, 1.15].
    Asserted: 0.1 absolute from both, under 8% relative, singular values in Muon's band [0.6, 1.25]."""
    torch.manual_seed(9)
    launches = spy(monkeypatch, newton_schulz_kernel, "_gram_kernel").launches
    update = torch.randn(*shape, device=DEVICE)
    y = orthogonalize(update, dtype=BF16, gram=kernels.gram)
    assert y.dtype == torch.float32
    assert len(launches) == 10 and all(l["X"] == BF16 and l["C"] == BF16 for l in launches)  # 2 per step
    y_fp32 = orthogonalize(update, dtype=torch.float32)
    for expected in (y_fp32, orthogonalize(update, dtype=BF16)):
        torch.testing.assert_close(y, expected, rtol=0, atol=0.1)
    assert (y - y_fp32).norm() < 0.08 * y_fp32.norm()
    s = torch.linalg.svdvals(y)
    assert 0.6 < s.min() and s.max() < 1.25
    assert orthogonalize(update.to(BF16), dtype=BF16, gram=kernels.gram).dtype == BF16  # keeps update's dtype


@pytest.mark.parametrize("ns_dtype,atol", [(torch.float32, 1e-4), (BF16, 0.1)])
def test_muon_with_gram_kernel_matches_plain_muon(ns_dtype, atol, monkeypatch):
    """kernels.apply(model, [muon, adamw]) sets muon.gram = kernels.gram (AdamW, without the attribute, is
    left alone): one Muon step on a 2-D and a stacked (E, out, in) parameter equals the plain-matmul step
    (gram=None) within the Newton-Schulz tolerances above (times lr), and every Gram product of it is a
    launch of the kernel (2 per step and matrix)."""
    torch.manual_seed(10)
    launches = spy(monkeypatch, newton_schulz_kernel, "_gram_kernel").launches
    start = [torch.randn(*shape, device=DEVICE) for shape in ((24, 40), (2, 40, 24))]
    grads = [torch.randn_like(p) for p in start]
    params = {flag: [torch.nn.Parameter(p.clone()) for p in start] for flag in (True, False)}
    lr = 0.02
    opts = {flag: Muon(ps, lr=lr, ns_dtype=ns_dtype) for flag, ps in params.items()}
    assert opts[True].gram is None and opts[False].gram is None
    adamw = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))])
    kernels.apply(torch.nn.Linear(2, 2), {}, optimizers=[opts[True], adamw])
    assert opts[True].gram is kernels.gram and not hasattr(adamw, "gram")
    for flag, ps in params.items():
        for p, g in zip(ps, grads):
            p.grad = g.clone()
        opts[flag].step()
    assert len(launches) == 2 * 5 * 2  # only the kernel-side step launched the kernel
    for p_triton, p_plain in zip(params[True], params[False]):
        torch.testing.assert_close(p_triton, p_plain, rtol=0, atol=lr * 1.5 * atol)  # 1.5: tall-matrix lr scale


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
    (the variant with every option on, 8, and the 4 mixed bf16/fp32 variants autocast launches;
    `python -m kernels.aot_check` builds all variants)."""
    result = _run_without_interpreter(["-m", "kernels.aot_check", "--arch=90", "--dtypes=bf16", "--quick"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count('"kernel"') == 12 and result.stdout.count('"mixed"') == 4, result.stdout


# ----------------------------------------------------------------------------------------------------
# Each twin is the project's own code: what a kernel is held to above is what model.py and muon.py run
# without kernels.apply. Two PyTorch code paths (F.rms_norm vs the twin's written-out fp32 formula; the
# same matmuls gathered and scattered differently): fp32 round-off only, asserted with TOL / MOE_TOL.


def model_config(**kw):
    base = dict(vocab_size=64, eot_token=63, block_size=16, n_embd=37, n_head=1, head_dim=8, mlp_hidden=45,
                n_expert=5, top_k=2, expert_hidden=24, layout="pcc", n_layer=3, n_passes=2)
    return model.ModelConfig(**{**base, **kw})


def randomised(module, seed=11):
    """module with every parameter random (gains ~1, matrices ~1/sqrt(fan_in)), on DEVICE."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p) if p.dim() == 1 else torch.randn_like(p) / p.shape[-1] ** 0.5)
    return module.to(DEVICE)


@pytest.mark.parametrize("gain", [True, False])
def test_rmsnorm_twin_is_model_rmsnorm(gain):
    norm = randomised(model.RMSNorm(37, eps=1e-5, gain=gain))
    x = randn(3, 5, 37)
    assert_same_forward_and_grads(lambda x, w: norm(x), lambda x, w: kernels.rmsnorm_reference(x, w, norm.eps),
                                  (x, norm.weight), TOL)


def test_rmsnorm_twin_is_model_rmsnorm_bf16():
    """A bf16 x with an fp32 gain (q/k under autocast): model.RMSNorm casts the gain to bf16 and norms in
    bf16 (one rounding of the gain, one of the result); the twin computes in fp32 and rounds once. Both
    are within those 2 roundings of the fp32 value."""
    norm = randomised(model.RMSNorm(37))
    x = torch.randn(7, 37, device=DEVICE).to(BF16)
    expected = kernels.rmsnorm_reference(x.float(), norm.weight.detach())
    assert_bf16_close(norm(x), expected, roundings=2)
    assert_bf16_close(kernels.rmsnorm_reference(x, norm.weight.detach()), expected, roundings=1)


@pytest.mark.parametrize("gain", [True, False])
def test_boundary_operator_twin_is_model_boundary_operator(gain):
    bo = randomised(model.BoundaryOperator(model_config(boundary="both", boundary_alpha=0.37, norm_gain=gain)))
    assert bo.alpha == 0.37 and (bo.norm.weight is not None) == gain
    twin = lambda h, e, w: kernels.boundary_operator_reference(h, e, 0.37, w, bo.norm.eps)  # noqa: E731
    assert_same_forward_and_grads(lambda h, e, w: bo(h, e), twin, (randn(2, 11, 37), randn(2, 11, 37),
                                                                   bo.norm.weight), TOL)


def test_swiglu_twin_is_model_mlp_activation():
    """model.MLP is w_down(silu(w_gate x) * w_up x): the same MLP with swiglu_reference as its activation."""
    mlp = randomised(model.MLP(model_config()))
    twin = lambda x, *w: mlp.w_down(kernels.swiglu_reference(mlp.w_gate(x), mlp.w_up(x)))  # noqa: E731
    assert_same_forward_and_grads(lambda x, *w: mlp(x)[0], twin, (randn(2, 9, 37), *mlp.parameters()), TOL)


@pytest.mark.parametrize("counts", [[7, 0, 13, 1, 16], [0, 0, 0]])
def test_moe_experts_twin_is_model_run_experts(counts):
    """model.run_experts with every row its own token (token_of = arange) and no router weights is
    moe_experts_reference: the same per-expert matmuls, scattered into zeros vs concatenated."""
    inputs = moe_inputs(counts, n_embd=33, hidden=19)
    rows = torch.arange(inputs[0].shape[0], device=DEVICE)
    assert_same_forward_and_grads(lambda x, c, *w: model.run_experts(x, rows, c, *w), kernels.moe_experts_reference,
                                  inputs, MOE_TOL)


def test_moe_experts_twin_is_model_run_experts_under_autocast():
    """Under bf16 autocast both run the same bf16 matmuls and return fp32 (x's dtype): run_experts adds
    each bf16 expert output into fp32 zeros, the twin casts the concatenated bf16 outputs. Asserted within
    one bf16 rounding, forward and every gradient."""
    x, counts, w_gate, w_up, w_down = moe_inputs([7, 0, 13, 1, 16], n_embd=33, hidden=19)
    rows = torch.arange(x.shape[0], device=DEVICE)
    with torch.autocast(DEVICE, dtype=BF16):
        y = model.run_experts(x, rows, counts, w_gate, w_up, w_down)
        y_twin = kernels.moe_experts_reference(x, counts, w_gate, w_up, w_down)
    assert y.dtype == y_twin.dtype == torch.float32
    assert_bf16_close(y_twin, y, roundings=1)
    g = torch.randn_like(y)
    for d_twin, d in zip(grads_of(y_twin, g, (x, w_gate, w_up, w_down)), grads_of(y, g, (x, w_gate, w_up, w_down))):
        assert_bf16_close(d_twin, d, roundings=1)


# ----------------------------------------------------------------------------------------------------
# kernels.apply on each kind of module: the class swapped, nothing else; the kernel runs where the
# module's own code ran, within the kernel-vs-twin tolerances above (a GPT per family: test_model.py)

KERNELS = {model.RMSNorm: kernels.RMSNormKernel, model.MLP: kernels.MLPKernel, model.MoE: kernels.MoEKernel,
           model.BoundaryOperator: kernels.BoundaryOperatorKernel}  # as train.py maps them (test_model.py too)
MODULES = {"RMSNorm": lambda: model.RMSNorm(37, eps=1e-5), "MLP": lambda: model.MLP(model_config()),
           "MoE": lambda: model.MoE(model_config()), "BoundaryOperator": lambda: model.BoundaryOperator(model_config())}


def count_kernel_calls(monkeypatch):
    """Count the calls of the package's kernels (the swapped methods call them through the package)."""
    calls = dict.fromkeys(("rmsnorm", "boundary_operator", "swiglu", "moe_experts"), 0)
    for name in calls:
        def counted(*args, _kernel=getattr(kernels, name), _name=name, **kw):
            calls[_name] += 1
            return _kernel(*args, **kw)
        monkeypatch.setattr(kernels, name, counted)
    return calls


@pytest.mark.parametrize("name", MODULES)
def test_apply_swaps_the_class_and_nothing_else(name):
    module = randomised(MODULES[name]())
    plain_class, params = type(module), dict(module.named_parameters())
    state = {k: v.clone() for k, v in module.state_dict().items()}
    assert kernels.apply(module, KERNELS) is module
    assert type(module) is not plain_class and isinstance(module, plain_class)
    assert type(module).__name__ == f"Triton{name}"
    assert dict(module.named_parameters()).keys() == params.keys()
    assert all(p is params[n] for n, p in module.named_parameters())  # the same parameter objects
    assert module.state_dict().keys() == state.keys()
    assert all(torch.equal(v, state[k]) for k, v in module.state_dict().items())
    swapped = type(module)
    assert type(kernels.apply(module, KERNELS)) is swapped  # idempotent
    assert type(kernels.apply(MODULES[name](), KERNELS)) is swapped  # one cached subclass per class
    copied = copy.deepcopy(module)
    assert type(copied) is swapped and all(type(a) is type(b) for a, b in zip(copied.modules(), module.modules()))
    module.load_state_dict(MODULES[name]().state_dict())  # a plain module's checkpoint loads


@pytest.mark.parametrize("name,kwargs,expected_calls,tol", [
    ("RMSNorm", {}, dict(rmsnorm=1), TOL),
    ("MLP", {}, dict(swiglu=1), TOL),
    ("MoE", {}, dict(moe_experts=1), MOE_TOL),  # router weight on the output vs on the hidden activation
    ("BoundaryOperator", dict(norm=True, inject=True), dict(boundary_operator=1), TOL),  # fused
    ("BoundaryOperator", dict(norm=True, inject=False), dict(rmsnorm=1), TOL),  # a part: the swapped norm
    ("BoundaryOperator", dict(norm=False, inject=True), {}, TOL),  # a part: h + alpha * e, no kernel
])
def test_applied_module_matches_its_own_code(name, kwargs, expected_calls, tol, monkeypatch):
    """The same module object before and after kernels.apply (so the same parameters): forward, and the
    gradient of sum(y * g) for the inputs and every parameter (None for both where one part of the
    boundary operator leaves e or the gain unused); and which kernels ran."""
    module = randomised(MODULES[name]())
    args = (randn(2, 9, 37),) + ((randn(2, 9, 37),) if name == "BoundaryOperator" else ())
    wrt = [*args, *module.parameters()]

    def run():
        out = module(*args, **kwargs)
        y = out[0] if isinstance(out, tuple) else out
        g = torch.randn(y.shape, generator=torch.Generator().manual_seed(12)).to(DEVICE)
        return y, torch.autograd.grad((y * g).sum(), wrt, allow_unused=True)

    y_plain, grads_plain = run()
    calls = count_kernel_calls(monkeypatch)
    kernels.apply(module, KERNELS)
    y, grads = run()
    assert calls == {**dict.fromkeys(calls, 0), **expected_calls}
    torch.testing.assert_close(y, y_plain, **tol)
    assert [d is None for d in grads] == [d is None for d in grads_plain]
    assert sum(d is not None for d in grads) >= 2
    for i, (a, b) in enumerate(zip(grads, grads_plain)):
        if b is not None:
            torch.testing.assert_close(a, b, **tol, msg=lambda m: f"gradient {i} of {len(wrt)}: {m}")


def renamed_copy(cls, name, *renames):
    """A copy of one of model.py's classes under another name: its source run again (in model.py's globals)
    with `class NAME(` and each (old, new) of renames replaced."""
    source = inspect.getsource(cls).replace(f"class {cls.__name__}(", f"class {name}(", 1)
    for old, new in renames:
        source = source.replace(old, new)
    namespace = dict(vars(model))
    exec(source, namespace)
    return namespace[name]


def test_a_renamed_class_keeps_its_kernel_or_fails_loudly(monkeypatch):
    """kernels.apply goes by type, never by class name: a subclass of model.MoE under another name gets the
    MoE kernel (the nearest mapped class in its MRO), and so does a renamed copy of MoE that the caller maps.
    MoE renamed in model.py is gone from the caller's mapping (an AttributeError there), and a mapped class
    whose method the kernel replaces is renamed or has another signature raises a one-line TypeError: no
    module runs silently without its kernel."""
    class Experts(model.MoE):
        pass

    routed = renamed_copy(model.MoE, "Routed")
    calls, x = count_kernel_calls(monkeypatch), randn(2, 9, 37)
    for cls, replacements in ((Experts, KERNELS), (routed, {routed: kernels.MoEKernel})):
        module = randomised(cls(model_config()))
        expected = module(x)[0]
        kernels.apply(module, replacements)
        assert isinstance(module, cls) and isinstance(module, kernels.MoEKernel)
        assert type(module).__name__ == f"Triton{cls.__name__}"
        torch.testing.assert_close(module(x)[0], expected, **MOE_TOL)
    assert calls["moe_experts"] == 2

    class ChangedExperts(model.MoE):  # the method with another signature
        def experts(self, x, token_of, counts, weight_of, group_align=None):
            return super().experts(x, token_of, counts, weight_of)

    method_renamed = renamed_copy(model.MoE, "MoE", ("def experts(", "def routed("), ("self.experts(", "self.routed("))
    for cls, replacements in ((ChangedExperts, KERNELS), (method_renamed, {method_renamed: kernels.MoEKernel})):
        with pytest.raises(TypeError, match=r"^kernels.apply: \S*(ChangedExperts|model.MoE) has no method experts\(self, "
                                            r"x, token_of, counts, weight_of\) for MoEKernel.experts to replace$"):
            kernels.apply(torch.nn.Sequential(cls(model_config())), replacements)
    with pytest.raises(TypeError, match="replacements maps model classes to kernel classes, not list"):
        kernels.apply(torch.nn.Linear(2, 2), [])  # the call before the mapping: kernels.apply(model, optimizers)
    monkeypatch.delattr(model, "MoE")  # MoE renamed in model.py: the caller's mapping fails to build
    with pytest.raises(AttributeError, match="MoE"):
        {model.MoE: kernels.MoEKernel}


# ----------------------------------------------------------------------------------------------------
# kernels/ is a package of its own: it imports nothing from the project, and runs copied alone


def test_kernels_import_nothing_from_the_project():
    """No module under kernels/ imports model, muon or any other module of the project (parsed, so a
    lazy import inside a function counts too); only torch, triton, the standard library and kernels."""
    project = {name[:-3] for name in os.listdir(REPO) if name.endswith(".py")}
    project |= {name for name in os.listdir(REPO) if os.path.isfile(os.path.join(REPO, name, "__init__.py"))}
    project -= {"kernels"}
    assert {"model", "muon", "tooling"} <= project
    files = [name for name in sorted(os.listdir(os.path.join(REPO, "kernels"))) if name.endswith(".py")]
    assert "__init__.py" in files and "moe_kernel.py" in files
    for name in files:
        tree = ast.parse(open(os.path.join(REPO, "kernels", name)).read(), filename=name)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                imported = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                imported = [node.module]
            else:
                continue
            for module_name in imported:
                assert module_name.split(".")[0] not in project, f"kernels/{name}:{node.lineno} imports {module_name}"


STANDALONE = r'''
import importlib.util, sys
import torch
import kernels

assert importlib.util.find_spec("model") is None and importlib.util.find_spec("muon") is None, sys.path
torch.manual_seed(0)


def check(name, fn, twin, *inputs, tol=1e-4):
    y, y_twin = fn(*inputs), twin(*inputs)
    torch.testing.assert_close(y, y_twin, rtol=tol, atol=tol, msg=lambda m: f"{name}: {m}")
    wrt = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    g = torch.randn_like(y)
    grads = torch.autograd.grad((y * g).sum(), wrt), torch.autograd.grad((y_twin * g).sum(), wrt)
    for i, (a, b) in enumerate(zip(*grads)):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=lambda m: f"{name} gradient {i}: {m}")
    print(name, "ok", flush=True)


r = lambda *shape: torch.randn(*shape).requires_grad_()
w = lambda *shape: (torch.randn(*shape) / shape[-1] ** 0.5).requires_grad_()
check("rmsnorm", kernels.rmsnorm, kernels.rmsnorm_reference, r(5, 19), r(19))
check("rmsnorm without gain", kernels.rmsnorm, kernels.rmsnorm_reference, r(5, 19), None)
check("boundary_operator", lambda h, e, g: kernels.boundary_operator(h, e, 0.5, g),
      lambda h, e, g: kernels.boundary_operator_reference(h, e, 0.5, g), r(2, 3, 19), r(2, 3, 19), r(19))
check("swiglu", kernels.swiglu, kernels.swiglu_reference, r(6, 21), r(6, 21))
check("moe_experts", kernels.moe_experts, kernels.moe_experts_reference, r(14, 17), torch.tensor([5, 0, 9]),
      w(3, 11, 17), w(3, 11, 17), w(3, 17, 11))
check("gram", kernels.gram, kernels.gram_reference, r(2, 37, 13))


class Norm(torch.nn.Module):  # any class with RMSNorm's forward(x), weight and eps: the caller maps it
    def __init__(self):
        super().__init__()
        self.weight, self.eps = torch.nn.Parameter(torch.randn(19)), 1e-6

    def forward(self, x):
        return kernels.rmsnorm_reference(x, self.weight, self.eps)


norm, x = Norm(), torch.randn(4, 19)
expected = norm(x)
kernels.apply(torch.nn.Sequential(norm), {Norm: kernels.RMSNormKernel})
assert type(norm).__name__ == "TritonNorm"
torch.testing.assert_close(norm(x), expected, rtol=1e-5, atol=1e-5)
assert not {"model", "muon"} & set(sys.modules)
print("all ok")
'''


def test_kernels_folder_runs_copied_alone(tmp_path):
    """kernels/ copied alone into an empty folder, with nothing else on the path (PYTHONPATH that folder
    only, cwd there, the Triton interpreter): every kernel against its own twin at small fp32 shapes,
    forward and every gradient (rtol = atol = 1e-4, the looser of the two tolerances above), and apply."""
    shutil.copytree(os.path.join(REPO, "kernels"), tmp_path / "kernels", ignore=shutil.ignore_patterns("__pycache__"))
    env = dict(os.environ, PYTHONPATH=str(tmp_path), TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, "-c", STANDALONE], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip().endswith("all ok"), result.stdout + result.stderr[-3000:]
