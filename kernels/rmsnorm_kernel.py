"""
Fused RMSNorm, and the boundary operator BO(h, e) = RMSNorm(h) + alpha * e of [X3], in one pass.

Eager PyTorch RMSNorm reads x twice (once for the mean of squares, once to scale) and writes several
temporaries; the boundary operator adds one more read/write of the normed tensor for "+ alpha*e".
Here each program loads a (BLOCK_M rows x whole row) tile once, keeps it in registers, and writes y once:
traffic is read x (+ e) and write y. The per-row 1/rms is saved for the backward.

Backward, per row (g = dy * w, r = rstd, d = row length):
    dx = r * (g - x * r^2 * mean(g * x))        de = alpha * dy        dw = sum_rows(dy * x * r)
dx and de are written by the kernel; dw is accumulated in registers by a fixed number of programs that
stride over the rows (as in the Triton layer-norm tutorial), each storing one partial row. The last step,
summing those (programs x d) partials, is a torch `.sum(0)` (a tiny tensor; not worth a second kernel).

All arithmetic is fp32 (bf16/fp16 inputs are converted after the load); outputs take the input dtype.
"""
import functools

import torch
import triton
import triton.language as tl


@triton.jit
def _rmsnorm_fwd_kernel(X, W, E, Y, RSTD, n_rows, n_cols, stride_x, stride_e, stride_y, eps, alpha,
                        HAS_WEIGHT: tl.constexpr, HAS_E: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    row_mask = rows < n_rows
    mask = row_mask[:, None] & (cols[None, :] < n_cols)
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / n_cols + eps)  # padded columns are 0: sum is exact
    y = x * rstd[:, None]
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        y = y * w[None, :]
    if HAS_E:  # [X3] BO(h, e) = Norm(h) + alpha * e
        e = tl.load(E + rows[:, None] * stride_e + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        y = y + alpha * e
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + rows, rstd, mask=row_mask)


@triton.jit
def _rmsnorm_bwd_kernel(X, W, DY, DX, DE, DW_PARTIAL, RSTD, n_rows, n_cols,
                        stride_x, stride_dy, stride_dx, stride_de, alpha,
                        HAS_WEIGHT: tl.constexpr, HAS_E: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    col_mask = cols < n_cols
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_D,), dtype=tl.float32)
    # programs stride over row blocks so that dw needs only (programs x d) partials
    for start in range(pid * BLOCK_M, n_rows, tl.num_programs(0) * BLOCK_M):
        rows = (start + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_mask = rows < n_rows
        mask = row_mask[:, None] & col_mask[None, :]
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
        if HAS_WEIGHT:
            g = dy * w[None, :]
            dw += tl.sum(dy * x * rstd[:, None], axis=0)
        else:
            g = dy
        mean_gx = tl.sum(g * x, axis=1) / n_cols
        dx = rstd[:, None] * (g - x * (rstd * rstd * mean_gx)[:, None])
        tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        if HAS_E:
            tl.store(DE + rows[:, None] * stride_de + cols[None, :], (alpha * dy).to(DE.dtype.element_ty),
                     mask=mask)
    if HAS_WEIGHT:
        tl.store(DW_PARTIAL + pid * n_cols + cols, dw, mask=col_mask)


def _launch_config(n_cols, device):
    """Whole rows per program; about 8K elements per tile (power-of-two blocks, masks do the rest)."""
    block_d = triton.next_power_of_2(n_cols)
    block_m = max(1, min(64, 8192 // block_d))
    num_warps = 4 if block_m * block_d <= 4096 else 8
    if device.type == "cuda":
        max_programs = 4 * _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    else:
        max_programs = 4  # interpreter: few programs, large tiles
    return block_m, block_d, num_warps, max_programs


@functools.lru_cache(maxsize=None)
def _sm_count(device_index):
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _rows(t):
    """View as (rows, d) with unit stride along d (copies only if it must)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


class _RMSNormFunction(torch.autograd.Function):
    """y = x * rstd * weight (+ alpha * e). weight and e may be None."""

    @staticmethod
    def forward(ctx, x, weight, e, alpha, eps):
        shape, n_cols = x.shape, x.shape[-1]
        x2 = _rows(x)
        e2 = _rows(e) if e is not None else None
        weight = weight.contiguous() if weight is not None else None
        n_rows = x2.shape[0]
        y = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
        rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
        block_m, block_d, num_warps, _ = _launch_config(n_cols, x.device)
        _rmsnorm_fwd_kernel[(triton.cdiv(n_rows, block_m),)](
            x2, weight if weight is not None else x2, e2 if e2 is not None else x2, y, rstd,
            n_rows, n_cols, x2.stride(0), e2.stride(0) if e2 is not None else 0, y.stride(0), eps, alpha,
            HAS_WEIGHT=weight is not None, HAS_E=e is not None,
            BLOCK_M=block_m, BLOCK_D=block_d, num_warps=num_warps)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.shape, ctx.alpha = shape, alpha
        ctx.e_dtype = e.dtype if e is not None else None
        return y.view(shape)

    @staticmethod
    def backward(ctx, grad_y):
        x2, weight, rstd = ctx.saved_tensors
        has_weight, has_e = weight is not None, ctx.e_dtype is not None
        n_rows, n_cols = x2.shape
        dy = _rows(grad_y)
        dx = torch.empty((n_rows, n_cols), dtype=x2.dtype, device=x2.device)
        de = torch.empty((n_rows, n_cols), dtype=ctx.e_dtype, device=x2.device) if has_e else dx
        block_m, block_d, num_warps, max_programs = _launch_config(n_cols, x2.device)
        n_programs = max(1, min(triton.cdiv(n_rows, block_m), max_programs))
        dw_partial = torch.empty((n_programs, n_cols), dtype=torch.float32, device=x2.device) \
            if has_weight else rstd
        _rmsnorm_bwd_kernel[(n_programs,)](
            x2, weight if has_weight else x2, dy, dx, de, dw_partial, rstd, n_rows, n_cols,
            x2.stride(0), dy.stride(0), dx.stride(0), de.stride(0), ctx.alpha,
            HAS_WEIGHT=has_weight, HAS_E=has_e, BLOCK_M=block_m, BLOCK_D=block_d, num_warps=num_warps)
        dw = dw_partial.sum(0).to(weight.dtype) if has_weight else None  # torch: final sum of partials
        return (dx.view(ctx.shape), dw, de.view(ctx.shape) if has_e else None, None, None)


def _check(x, weight, name="x"):
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"rmsnorm: {name} must have a non-empty last dimension, got shape {tuple(x.shape)}")
    if weight is not None and tuple(weight.shape) != (x.shape[-1],):
        raise ValueError(f"rmsnorm: weight shape {tuple(weight.shape)} != ({x.shape[-1]},) (last dim of {name})")


def rmsnorm(x, weight=None, eps=1e-6):
    """Fused RMSNorm over the last dim: x * rsqrt(mean(x^2) + eps) * weight; weight=None means no gain.

    Dtypes: returns x.dtype. Arithmetic in fp32 whatever the inputs (converted after the load), one rounding
    at the store. weight may have another float dtype (fp32 gain on a bf16 q/k). Not autocast-aware:
    under autocast it returns what it returns outside (as F.rms_norm on CPU autocast). Gradients: d x in
    x.dtype, d weight in weight.dtype (summed in fp32, cast once)."""
    _check(x, weight)
    if x.numel() == 0:
        return rmsnorm_reference(x, weight, eps)
    return _RMSNormFunction.apply(x, weight, None, 0.0, float(eps))


def boundary_operator(h, e, alpha, weight=None, eps=1e-6):
    """[X3] BO(h, e) = RMSNorm(h) + alpha * e in one pass (alpha a python float, not learned).

    Dtypes: returns h.dtype; e and weight may have other float dtypes; fp32 arithmetic; not autocast-aware
    (as rmsnorm). Gradients in each input's dtype (d h: h.dtype, d e: e.dtype, d weight: weight.dtype)."""
    _check(h, weight, name="h")
    if e.shape != h.shape:
        raise ValueError(f"boundary_operator: e shape {tuple(e.shape)} != h shape {tuple(h.shape)}")
    if h.numel() == 0:
        return boundary_operator_reference(h, e, alpha, weight, eps)
    return _RMSNormFunction.apply(h, weight, e, float(alpha), float(eps))


def rmsnorm_reference(x, weight=None, eps=1e-6):
    """PyTorch twin of rmsnorm: computed in fp32, cast back to x.dtype."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)


def boundary_operator_reference(h, e, alpha, weight=None, eps=1e-6):
    """PyTorch twin of boundary_operator: [X3] Norm(h) + alpha * e in fp32, cast back to h.dtype."""
    hf = h.float()
    y = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return (y + alpha * e.float()).to(h.dtype)
