"""
Fused RMSNorm, and the boundary operator BO(h, e) = RMSNorm(h) + alpha * e of [X3].

Eager PyTorch reads x twice and writes temporaries; here a program loads BLOCK_M whole
rows once and writes y once. With r = 1/rms per row, saved, and g = dy * w:
    dx = r * (g - x * r^2 * mean(g * x));   de = alpha * dy;   dw = sum(dy * x * r)
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _rmsnorm_fwd_kernel(
    X, W, E, Y, RSTD, n_rows, n_cols, eps, alpha,
    HAS_WEIGHT: tl.constexpr, HAS_E: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    offsets = rows[:, None] * n_cols + cols[None, :]
    x = tl.load(X + offsets, mask=mask, other=0.0).to(tl.float32)
    # Padded columns load as 0, so the sum is exact.
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / n_cols + eps)
    y = x * rstd[:, None]
    if HAS_WEIGHT:
        y = y * tl.load(W + cols, mask=cols < n_cols, other=0.0).to(tl.float32)[None, :]
    # [X3] BO(h, e) = Norm(h) + alpha * e
    if HAS_E:
        y = y + alpha * tl.load(E + offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + offsets, y.to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + rows, rstd, mask=rows < n_rows)


@triton.jit
def _rmsnorm_bwd_kernel(
    X, W, DY, DX, DE, DW_PARTIAL, RSTD, n_rows, n_cols, alpha,
    HAS_WEIGHT: tl.constexpr, HAS_E: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    w = tl.load(W + cols, mask=cols < n_cols, other=0.0).to(tl.float32) if HAS_WEIGHT else 1.0
    # A few programs stride over the rows, each summing one partial dw row (as the Triton
    # layer-norm tutorial); torch sums the partials.
    dw = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for start in range(pid * BLOCK_M, n_rows, tl.num_programs(0) * BLOCK_M):
        rows = (start + tl.arange(0, BLOCK_M)).to(tl.int64)
        mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
        offsets = rows[:, None] * n_cols + cols[None, :]
        x = tl.load(X + offsets, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + offsets, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=rows < n_rows, other=0.0)[:, None]
        g = dy * w
        if HAS_WEIGHT:
            dw += tl.sum(dy * x * rstd, axis=0)
        dx = rstd * (g - x * rstd * rstd * tl.sum(g * x, axis=1)[:, None] / n_cols)
        tl.store(DX + offsets, dx.to(DX.dtype.element_ty), mask=mask)
        if HAS_E:
            tl.store(DE + offsets, (alpha * dy).to(DE.dtype.element_ty), mask=mask)
    if HAS_WEIGHT:
        tl.store(DW_PARTIAL + pid * n_cols + cols, dw, mask=cols < n_cols)


# Whole rows per program, about 8K elements per tile.
def _blocks(n_cols):
    block_d = triton.next_power_of_2(n_cols)
    return max(1, min(64, 8192 // block_d)), block_d


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, e, alpha, eps):
        # The kernels see contiguous (rows, n_cols) tensors.
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        e2 = e.reshape(x2.shape).contiguous() if e is not None else None
        y, rstd = torch.empty_like(x2), x2.new_empty(x2.shape[0], dtype=torch.float32)
        block_m, block_d = _blocks(x2.shape[1])
        # An absent weight or e passes x2 in its place, never read.
        _rmsnorm_fwd_kernel[(triton.cdiv(x2.shape[0], block_m),)](
            x2, x2 if weight is None else weight, x2 if e is None else e2, y, rstd,
            *x2.shape, eps, alpha,
            HAS_WEIGHT=weight is not None, HAS_E=e is not None, BLOCK_M=block_m, BLOCK_D=block_d,
        )
        ctx.save_for_backward(x2, weight, rstd)
        ctx.alpha, ctx.e_dtype = alpha, e.dtype if e is not None else None
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, rstd = ctx.saved_tensors
        has_e, dx = ctx.e_dtype is not None, torch.empty_like(x2)
        de = torch.empty(x2.shape, dtype=ctx.e_dtype, device=x2.device) if has_e else dx
        block_m, block_d = _blocks(x2.shape[1])
        # A few programs per core, each with one partial dw row.
        programs = min(triton.cdiv(x2.shape[0], block_m), 4 * _cores(x2.device))
        dw_partial = torch.empty((programs, x2.shape[1]), dtype=torch.float32, device=x2.device)
        dy2 = dy.reshape(x2.shape).contiguous()
        _rmsnorm_bwd_kernel[(programs,)](
            x2, x2 if weight is None else weight, dy2, dx, de, dw_partial, rstd,
            *x2.shape, ctx.alpha,
            HAS_WEIGHT=weight is not None, HAS_E=has_e, BLOCK_M=block_m, BLOCK_D=block_d,
        )
        dw = dw_partial.sum(0).to(weight.dtype) if weight is not None else None
        return dx.view(dy.shape), dw, de.view(dy.shape) if has_e else None, None, None


def _cores(device):
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def rmsnorm(x, weight=None, eps=1e-6):
    """x * rsqrt(mean(x^2) + eps) * weight over the last dim (None: no gain), fp32 inside.
    weight may be fp32 on bf16 x; each output and gradient has its input's dtype."""
    # Nothing to launch for an empty x.
    if x.numel() == 0:
        return rmsnorm_reference(x, weight, eps)
    return _RMSNorm.apply(x, weight, None, 0.0, float(eps))


def boundary_operator(h, e, alpha, weight=None, eps=1e-6):
    """[X3] BO(h, e) = RMSNorm(h) + alpha * e in one pass (alpha a float); h's dtype out."""
    if h.numel() == 0:
        return boundary_operator_reference(h, e, alpha, weight, eps)
    return _RMSNorm.apply(h, weight, e, float(alpha), float(eps))


# The PyTorch twin: in fp32, cast back to x.dtype.
def rmsnorm_reference(x, weight=None, eps=1e-6):
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float() if weight is not None else y).to(x.dtype)


def boundary_operator_reference(h, e, alpha, weight=None, eps=1e-6):
    return (rmsnorm_reference(h.float(), weight, eps) + alpha * e.float()).to(h.dtype)
