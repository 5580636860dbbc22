"""
The Gram product X X^T of Muon's Newton-Schulz iteration, computing half of the tiles.

muon.orthogonalize runs   A = X X^T;  X <- a X + (b A + c A A) X,   and A A = A A^T.
One program per tile pair (i <= j) computes X_i X_j^T once and stores it at (i, j) and,
transposed, at (j, i): half the FLOPs and reads of a matmul.
"""
import functools

import torch
import triton
import triton.language as tl


@triton.jit
def _gram_kernel(
    X, C, PAIRS, M, K, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, FP32_DOT: tl.constexpr
):
    # This program's tile pair (i <= j) and matrix of the batch.
    tile_i = tl.load(PAIRS + 2 * tl.program_id(0))
    tile_j = tl.load(PAIRS + 2 * tl.program_id(0) + 1)
    batch = tl.program_id(1).to(tl.int64)
    rows_i = tile_i * BLOCK_M + tl.arange(0, BLOCK_M)
    rows_j = tile_j * BLOCK_M + tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    x = X + batch * M * K
    acc = tl.zeros((BLOCK_M, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = ks < K - k0
        # (BLOCK_M, BLOCK_K) of X_i, and (BLOCK_K, BLOCK_M) of X_j^T.
        xi = tl.load(x + rows_i[:, None] * K + (k0 + ks)[None, :],
                     mask=(rows_i[:, None] < M) & k_mask[None, :], other=0.0)
        xj = tl.load(x + rows_j[None, :] * K + (k0 + ks)[:, None],
                     mask=k_mask[:, None] & (rows_j[None, :] < M), other=0.0)
        # The interpreter cannot multiply bf16.
        if FP32_DOT:
            xi, xj = xi.to(tl.float32), xj.to(tl.float32)
        acc = tl.dot(xi, xj, acc, input_precision="ieee")
    out, c = acc.to(C.dtype.element_ty), C + batch * M * M
    mask = (rows_i[:, None] < M) & (rows_j[None, :] < M)
    tl.store(c + rows_i[:, None] * M + rows_j[None, :], out, mask=mask)
    # The mirror tile (j, i): the same registers, stored transposed.
    if tile_i != tile_j:
        tl.store(c + rows_j[None, :] * M + rows_i[:, None], out, mask=mask)


@functools.lru_cache(maxsize=64)
def _tile_pairs(n_tiles, device):
    pairs = [(i, j) for i in range(n_tiles) for j in range(i, n_tiles)]
    return torch.tensor(pairs, dtype=torch.int32, device=device)


class _Gram(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        (m, k), cuda = x.shape[-2:], x.device.type == "cuda"
        # Stacked experts are one launch.
        x3 = x.reshape(-1, m, k).contiguous()
        c = x3.new_empty(x3.shape[0], m, m)
        block_m, options = (64, dict(num_warps=4, num_stages=3)) if cuda else (32, {})
        pairs = _tile_pairs(triton.cdiv(m, block_m), x.device)
        _gram_kernel[(len(pairs), x3.shape[0])](
            x3, c, pairs, m, k, BLOCK_M=block_m, BLOCK_K=32, FP32_DOT=not cuda, **options
        )
        ctx.save_for_backward(x)
        return c.view(*x.shape[:-2], m, m)

    # dX = (dC + dC^T) X as a torch matmul (Muon runs under no_grad).
    @staticmethod
    def backward(ctx, dc):
        (x,) = ctx.saved_tensors
        return (dc + dc.mT) @ x


def gram(x):
    """x @ x.mT for x (..., m, k) in x's dtype, fp32 accumulation. Off-diagonal tiles are
    exact mirrors; a diagonal tile is symmetric up to rounding, as on any backend."""
    # Nothing to launch for an empty x.
    return _Gram.apply(x) if x.numel() else gram_reference(x)


# The PyTorch twin.
def gram_reference(x):
    return x @ x.mT
