"""
Fused SwiGLU activation: y = silu(gate) * up.

Eager PyTorch writes silu(gate) to memory and reads it back for the product (and autograd keeps it);
here one pass reads gate and up and writes y. The backward recomputes sigmoid(gate) instead of
saving it and writes both gradients in one pass:
    d up = dy * silu(g)        d gate = dy * up * s * (1 + g * (1 - s)),   s = sigmoid(g)

Tensors are handled as (rows, hidden) tiles with a row stride, so gate/up may be the two halves of one
fused projection (`x_fc.chunk(2, -1)`) without a copy. Arithmetic in fp32; outputs take gate's dtype.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _gate_up_tile(G, U, n_rows, n_cols, stride_g, stride_u, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's (rows, cols, mask) and its gate and up tiles in fp32."""
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    g = tl.load(G + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + rows[:, None] * stride_u + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    return rows, cols, mask, g, u


@triton.jit
def _swiglu_fwd_kernel(G, U, Y, n_rows, n_cols, stride_g, stride_u, stride_y,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows, cols, mask, g, u = _gate_up_tile(G, U, n_rows, n_cols, stride_g, stride_u, BLOCK_M, BLOCK_N)
    y = g * tl.sigmoid(g) * u
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(G, U, DY, DG, DU, n_rows, n_cols, stride_g, stride_u, stride_dy, stride_d,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows, cols, mask, g, u = _gate_up_tile(G, U, n_rows, n_cols, stride_g, stride_u, BLOCK_M, BLOCK_N)
    dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    du = dy * g * s
    dg = dy * u * s * (1.0 + g * (1.0 - s))
    offsets = rows[:, None] * stride_d + cols[None, :]  # DG and DU are fresh contiguous buffers
    tl.store(DG + offsets, dg.to(DG.dtype.element_ty), mask=mask)
    tl.store(DU + offsets, du.to(DU.dtype.element_ty), mask=mask)


def _blocks(n_cols):
    block_n = min(triton.next_power_of_2(n_cols), 1024)
    return max(1, 4096 // block_n), block_n  # ~4K elements per program


def _rows(t):
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def swiglu_forward(gate2, up2, out=None):
    """Launch the forward kernel on 2-D (rows, hidden) tensors with unit column stride; returns y."""
    n_rows, n_cols = gate2.shape
    y = out if out is not None else torch.empty((n_rows, n_cols), dtype=gate2.dtype, device=gate2.device)
    block_m, block_n = _blocks(n_cols)
    grid = (triton.cdiv(n_rows, block_m), triton.cdiv(n_cols, block_n))
    _swiglu_fwd_kernel[grid](gate2, up2, y, n_rows, n_cols, gate2.stride(0), up2.stride(0), y.stride(0),
                             BLOCK_M=block_m, BLOCK_N=block_n)
    return y


def swiglu_backward(gate2, up2, grad_y2):
    """Launch the backward kernel on 2-D tensors; returns (d gate, d up) as fresh contiguous tensors."""
    n_rows, n_cols = gate2.shape
    d_gate = torch.empty((n_rows, n_cols), dtype=gate2.dtype, device=gate2.device)
    d_up = torch.empty((n_rows, n_cols), dtype=up2.dtype, device=up2.device)
    block_m, block_n = _blocks(n_cols)
    grid = (triton.cdiv(n_rows, block_m), triton.cdiv(n_cols, block_n))
    _swiglu_bwd_kernel[grid](gate2, up2, grad_y2, d_gate, d_up, n_rows, n_cols, gate2.stride(0),
                             up2.stride(0), grad_y2.stride(0), d_gate.stride(0),
                             BLOCK_M=block_m, BLOCK_N=block_n)
    return d_gate, d_up


class _SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        gate2, up2 = _rows(gate), _rows(up)
        ctx.save_for_backward(gate2, up2)
        ctx.shape = gate.shape
        return swiglu_forward(gate2, up2).view(gate.shape)

    @staticmethod
    def backward(ctx, grad_y):
        gate2, up2 = ctx.saved_tensors
        d_gate, d_up = swiglu_backward(gate2, up2, _rows(grad_y))
        return d_gate.view(ctx.shape), d_up.view(ctx.shape)


def swiglu(gate, up):
    """Fused silu(gate) * up (same shapes, any leading dims).

    Dtypes: gate and up share one dtype, which the result and both gradients have; arithmetic in fp32
    (converted after the load), one rounding at each store. Not autocast-aware: under autocast its inputs
    are the projections' bf16 outputs, so it returns bf16, as F.silu(gate) * up does."""
    if gate.shape != up.shape:
        raise ValueError(f"swiglu: gate shape {tuple(gate.shape)} != up shape {tuple(up.shape)}")
    if gate.dtype != up.dtype:
        raise ValueError(f"swiglu: gate dtype {gate.dtype} != up dtype {up.dtype}")
    if gate.dim() == 0 or gate.numel() == 0:
        return swiglu_reference(gate, up)
    return _SwiGLUFunction.apply(gate, up)


def swiglu_reference(gate, up):
    """PyTorch twin of swiglu."""
    return torch.nn.functional.silu(gate) * up
