"""
The Gram product X X^T of Muon's Newton-Schulz iteration, computing only half of the tiles.

Muon's quintic iteration (muon.orthogonalize) runs, `steps` times,
    A = X X^T ;   X <- a X + (b A + c A A) X
A is symmetric, so A A = A A^T is a Gram product too: two of the three matmuls per step have symmetric
outputs. `gram` launches one program per tile pair (i <= j) of the output, computes X_i X_j^T and
stores it at (i, j) and, transposed, at (j, i): half the FLOPs and half the reads of a full matmul.
Batched over leading dims (stacked expert weights (E, out, in) are one launch).

`gram` is an autograd.Function whose forward is the kernel; its backward, dX = (dC + dC^T) X, is a torch
matmul (Muon runs under no_grad, so it exists for completeness, not speed). The iteration itself is
muon.orthogonalize, the only one in the project: Muon with opt.gram = kernels.gram (kernels.apply sets
it) runs both Gram products of every step here.
"""
import functools

import torch
import triton
import triton.language as tl


@triton.jit
def _gram_kernel(X, C, PAIRS, M, K, stride_xb, stride_xm, stride_xk, stride_cb, stride_cm, stride_cn,
                 BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, FP32_DOT: tl.constexpr):
    pair = tl.program_id(0)
    batch = tl.program_id(1).to(tl.int64)
    tile_i = tl.load(PAIRS + 2 * pair)
    tile_j = tl.load(PAIRS + 2 * pair + 1)  # tile_i <= tile_j: the upper triangle only
    rows_i = (tile_i * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rows_j = (tile_j * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    xi_ptrs = X + batch * stride_xb + rows_i[:, None] * stride_xm + ks[None, :] * stride_xk  # (BM, BK)
    xj_ptrs = X + batch * stride_xb + rows_j[None, :] * stride_xm + ks[:, None] * stride_xk  # (BK, BM) of X_j^T
    acc = tl.zeros((BLOCK_M, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = ks < K - k0
        xi = tl.load(xi_ptrs, mask=(rows_i[:, None] < M) & k_mask[None, :], other=0.0)
        xj = tl.load(xj_ptrs, mask=k_mask[:, None] & (rows_j[None, :] < M), other=0.0)
        if FP32_DOT:  # interpreter: no bf16 arithmetic (see _fp32_dot)
            xi, xj = xi.to(tl.float32), xj.to(tl.float32)
        acc = tl.dot(xi, xj, acc, input_precision="ieee")
        xi_ptrs += BLOCK_K * stride_xk
        xj_ptrs += BLOCK_K * stride_xk
    mask = (rows_i[:, None] < M) & (rows_j[None, :] < M)
    out = acc.to(C.dtype.element_ty)
    c = C + batch * stride_cb
    tl.store(c + rows_i[:, None] * stride_cm + rows_j[None, :] * stride_cn, out, mask=mask)
    # the mirror tile (j, i) = acc^T: same registers, row and column strides swapped (diagonal tiles skip it)
    if tile_i != tile_j:
        tl.store(c + rows_i[:, None] * stride_cn + rows_j[None, :] * stride_cm, out, mask=mask)


@functools.lru_cache(maxsize=64)
def _tile_pairs(n_tiles, device):
    pairs = [(i, j) for i in range(n_tiles) for j in range(i, n_tiles)]
    return torch.tensor(pairs, dtype=torch.int32, device=device)


def _blocks(device_type):
    return (64, 32, 4, 3) if device_type == "cuda" else (32, 32, 4, 1)  # BLOCK_M, BLOCK_K, warps, stages


def _fp32_dot(device_type):
    """FP32_DOT: convert the operands to fp32 after the load. Only for the interpreter (CPU), which cannot
    multiply bf16; the product of two bf16 values is exact in fp32, so this is still the tensor cores'
    arithmetic (bf16 operands, fp32 sums) up to summation order. On CUDA bf16 goes to tl.dot as is."""
    return device_type != "cuda"


class _GramFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        batch_shape, (m, k) = x.shape[:-2], x.shape[-2:]
        x3 = x.reshape(-1, m, k)
        c = torch.empty((x3.shape[0], m, m), dtype=x.dtype, device=x.device)
        block_m, block_k, num_warps, num_stages = _blocks(x.device.type)
        pairs = _tile_pairs(triton.cdiv(m, block_m), x.device)
        _gram_kernel[(pairs.shape[0], x3.shape[0])](
            x3, c, pairs, m, k, *x3.stride(), *c.stride(),
            BLOCK_M=block_m, BLOCK_K=block_k, FP32_DOT=_fp32_dot(x.device.type),
            num_warps=num_warps, num_stages=num_stages)
        ctx.save_for_backward(x)
        return c.view(*batch_shape, m, m)

    @staticmethod
    def backward(ctx, grad_c):  # torch, not Triton: d/dX of X X^T is (dC + dC^T) X
        (x,) = ctx.saved_tensors
        return (grad_c + grad_c.mT) @ x


def gram(x):
    """x @ x.mT for x (..., m, k), computing only the upper-triangle tiles.

    Dtypes: returns x.dtype (fp32 accumulation, one rounding at the store; bf16 operands go to the tensor
    cores as they are). Not autocast-aware: Muon calls it under no_grad with the Newton-Schulz dtype it chose.
    Gradient (torch matmul): x.dtype.
    Exactness: each off-diagonal tile is stored twice from the same registers, so C[i, j] == C[j, i].T
    bit for bit there; a diagonal tile is one matmul X_i X_i^T, symmetric only up to rounding (on any
    backend: the BLAS or tensor-core summation order need not be symmetric)."""
    if x.dim() < 2:
        raise ValueError(f"gram: x must have at least 2 dims (..., m, k), got shape {tuple(x.shape)}")
    if x.numel() == 0:
        return gram_reference(x)
    return _GramFunction.apply(x)


def gram_reference(x):
    """PyTorch twin of gram."""
    return x @ x.mT

