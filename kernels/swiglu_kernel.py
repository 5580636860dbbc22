"""
Fused SwiGLU activation y = silu(gate) * up.

Eager PyTorch writes silu(gate) to memory, reads it back and keeps it; here one pass reads
gate and up and writes y. The backward recomputes s = sigmoid(gate):
    d up = dy * silu(g),   d gate = dy * up * s * (1 + g * (1 - s)).
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _tile(
    G, U, n_rows, n_cols, stride_g, stride_u, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
):
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    g = tl.load(G + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + rows[:, None] * stride_u + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    # The offsets are into the contiguous outputs.
    return rows[:, None] * n_cols + cols[None, :], mask, g, u


@triton.jit
def _swiglu_fwd_kernel(
    G, U, Y, n_rows, n_cols, stride_g, stride_u, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
):
    offsets, mask, g, u = _tile(G, U, n_rows, n_cols, stride_g, stride_u, BLOCK_M, BLOCK_N)
    tl.store(Y + offsets, (g * tl.sigmoid(g) * u).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(
    G, U, DY, DG, DU, n_rows, n_cols, stride_g, stride_u,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    offsets, mask, g, u = _tile(G, U, n_rows, n_cols, stride_g, stride_u, BLOCK_M, BLOCK_N)
    dy = tl.load(DY + offsets, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    d_gate = dy * u * s * (1.0 + g * (1.0 - s))
    tl.store(DG + offsets, d_gate.to(DG.dtype.element_ty), mask=mask)
    tl.store(DU + offsets, (dy * g * s).to(DU.dtype.element_ty), mask=mask)


# gate, up (rows, hidden) may be row-strided views (the halves of one fused projection):
# no copy. The outputs are contiguous.
def _launch(kernel, gate, up, *outputs):
    # About 4K elements per program.
    block_n = min(triton.next_power_of_2(gate.shape[1]), 1024)
    block_m = max(1, 4096 // block_n)
    grid = (triton.cdiv(gate.shape[0], block_m), triton.cdiv(gate.shape[1], block_n))
    kernel[grid](
        gate, up, *outputs, *gate.shape, gate.stride(0), up.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n,
    )
    return outputs


def _empty(t):
    return torch.empty(t.shape, dtype=t.dtype, device=t.device)


def swiglu_forward(gate, up):
    return _launch(_swiglu_fwd_kernel, gate, up, _empty(gate))[0]


# (d gate, d up), contiguous, for 2-D gate, up and a contiguous dy.
def swiglu_backward(gate, up, dy):
    return _launch(_swiglu_bwd_kernel, gate, up, dy, _empty(gate), _empty(up))[1:]


# A 2-D view with unit column stride, or a copy where the view has none.
def _rows(t):
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        gate2, up2 = _rows(gate), _rows(up)
        ctx.save_for_backward(gate2, up2)
        return swiglu_forward(gate2, up2).view(gate.shape)

    @staticmethod
    def backward(ctx, dy):
        gate2, up2 = ctx.saved_tensors
        d_gate, d_up = swiglu_backward(gate2, up2, dy.reshape(gate2.shape).contiguous())
        return d_gate.view(dy.shape), d_up.view(dy.shape)


def swiglu(gate, up):
    """silu(gate) * up for gate and up of one shape and dtype (the result's); fp32 inside."""
    # Nothing to launch for empty inputs.
    return _SwiGLU.apply(gate, up) if gate.numel() else swiglu_reference(gate, up)


# The PyTorch twin (model.MLP's activation).
def swiglu_reference(gate, up):
    return torch.nn.functional.silu(gate) * up
