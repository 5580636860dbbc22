"""
The MoE experts over expert-sorted rows as grouped GEMMs: one launch for all experts.

Expert e owns the rows x_sorted[start_e : start_e + counts[e]] and is a SwiGLU:
    y_e = (silu(x_e @ W_gate[e].T) * (x_e @ W_up[e].T)) @ W_down[e].T
As in the Triton grouped-GEMM tutorial, one launch walks a list of BLOCK_M-row tiles,
each knowing its expert and rows; the list's length is the bound cdiv(n, BLOCK_M) + E.
  _gate_up_kernel     x @ W_gate[e].T and x @ W_up[e].T in one pass over x, then SwiGLU
  _grouped_mm_kernel  C = A @ B[e] (+ A2 @ B2[e]): the down projection, d act, d x
  _wgrad_kernel       C[e] = A_e.T @ B_e over each expert's rows: weight gradients
"""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.swiglu_kernel import swiglu_backward, swiglu_forward


# (expert, rows, row mask) of this program's tile. TILES (n_tiles, 3) holds each tile's
# expert, first row and end row.
@triton.jit
def _tile_rows(TILES, BLOCK_M: tl.constexpr):
    tile = TILES + 3 * tl.program_id(0)
    rows = tl.load(tile + 1) + tl.arange(0, BLOCK_M)
    return tl.load(tile), rows, rows < tl.load(tile + 2)


@triton.jit
def _dot(acc, a_ptrs, b_ptrs, a_mask, b_mask, FP32_DOT: tl.constexpr):
    a = tl.load(a_ptrs, mask=a_mask, other=0.0)
    b = tl.load(b_ptrs, mask=b_mask, other=0.0)
    # The interpreter (CPU) cannot multiply bf16. bf16 x bf16 is exact in fp32, so this is
    # still the tensor cores' arithmetic.
    if FP32_DOT:
        a, b = a.to(tl.float32), b.to(tl.float32)
    # ieee: true fp32 for fp32 operands, no TF32.
    return tl.dot(a, b, acc, input_precision="ieee")


@triton.jit
def _gate_up_kernel(
    X, WG, WU, HG, HU, ACT, TILES, n_experts, n_hidden, n_embd, stride_we,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP32_DOT: tl.constexpr,
):
    expert, rows, row_mask = _tile_rows(TILES, BLOCK_M)
    # A spare tile.
    if expert >= n_experts:
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = X + rows[:, None] * n_embd + ks[None, :]
    # A tile of W[e].T.
    w_offsets = expert * stride_we + cols[None, :] * n_embd + ks[:, None]
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, n_embd, BLOCK_K):
        x_mask = row_mask[:, None] & (ks[None, :] < n_embd - k0)
        w_mask = (ks[:, None] < n_embd - k0) & (cols[None, :] < n_hidden)
        gate = _dot(gate, x_ptrs + k0, WG + w_offsets + k0, x_mask, w_mask, FP32_DOT)
        up = _dot(up, x_ptrs + k0, WU + w_offsets + k0, x_mask, w_mask, FP32_DOT)
    offsets = rows[:, None] * n_hidden + cols[None, :]
    mask = row_mask[:, None] & (cols[None, :] < n_hidden)
    # gate and up are saved for the backward.
    tl.store(HG + offsets, gate.to(HG.dtype.element_ty), mask=mask)
    tl.store(HU + offsets, up.to(HU.dtype.element_ty), mask=mask)
    act = gate * tl.sigmoid(gate) * up
    tl.store(ACT + offsets, act.to(ACT.dtype.element_ty), mask=mask)


@triton.jit
def _grouped_mm_kernel(
    A, B, A2, B2, C, TILES, n_experts, N, K, stride_be, stride_bk, stride_bn,
    HAS_SECOND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, FP32_DOT: tl.constexpr,
):
    expert, rows, row_mask = _tile_rows(TILES, BLOCK_M)
    if expert >= n_experts:
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    a_offsets = rows[:, None] * K + ks[None, :]
    # B[e] by its strides: W[e] or W[e].T without a copy.
    b_offsets = expert * stride_be + ks[:, None] * stride_bk + cols[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a_mask = row_mask[:, None] & (ks[None, :] < K - k0)
        b_mask = (ks[:, None] < K - k0) & (cols[None, :] < N)
        a_k, b_k = a_offsets + k0, b_offsets + k0 * stride_bk
        acc = _dot(acc, A + a_k, B + b_k, a_mask, b_mask, FP32_DOT)
        # d x sums the gate and the up paths.
        if HAS_SECOND:
            acc = _dot(acc, A2 + a_k, B2 + b_k, a_mask, b_mask, FP32_DOT)
    mask = row_mask[:, None] & (cols[None, :] < N)
    tl.store(C + rows[:, None] * N + cols[None, :], acc.to(C.dtype.element_ty), mask=mask)


@triton.jit
def _wgrad_kernel(
    A, B, C, ROWS, M, N,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP32_DOT: tl.constexpr,
):
    expert = tl.program_id(0).to(tl.int64)
    start, count = tl.load(ROWS + 2 * expert), tl.load(ROWS + 2 * expert + 1)
    ms = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    ns = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # Over this expert's rows only: an expert without rows stores zeros.
    for k0 in range(0, count, BLOCK_K):
        rows, k_mask = start + k0 + ks, ks < count - k0
        # (BLOCK_M, BLOCK_K) of A_e.T
        a_ptrs = A + rows[None, :] * M + ms[:, None]
        b_ptrs = B + rows[:, None] * N + ns[None, :]
        a_mask = (ms[:, None] < M) & k_mask[None, :]
        b_mask = k_mask[:, None] & (ns[None, :] < N)
        acc = _dot(acc, a_ptrs, b_ptrs, a_mask, b_mask, FP32_DOT)
    offsets = expert * M * N + ms[:, None] * N + ns[None, :]
    mask = (ms[:, None] < M) & (ns[None, :] < N)
    tl.store(C + offsets, acc.to(C.dtype.element_ty), mask=mask)


# (BLOCK_M, BLOCK_N, BLOCK_K, launch options, FP32_DOT). One config: the interpreter
# cannot autotune.
def _config(device):
    if device.type == "cuda":
        return 64, 64, 32, dict(num_warps=4, num_stages=3), False
    return 32, 32, 32, {}, True


# TILES (n_tiles, 3): per BLOCK_M-row tile its expert (E for a spare), first row and the
# expert's end row; ROWS (E, 2): each expert's first row and count. No host read.
def tile_map(counts, n_rows, block_m):
    counts = counts.long()
    end = counts.cumsum(0)
    start, n_tiles = end - counts, (counts + block_m - 1) // block_m
    tile_end = n_tiles.cumsum(0)
    tiles = torch.arange(triton.cdiv(n_rows, block_m) + len(counts), device=counts.device)
    expert = torch.searchsorted(tile_end, tiles, right=True)
    e = expert.clamp(max=len(counts) - 1)
    first = start[e] + (tiles - (tile_end - n_tiles)[e]) * block_m
    tile_rows = torch.stack([expert, first, end[e]], 1).contiguous()
    return tile_rows, torch.stack([start, counts], 1).contiguous()


# C (n, n_out) = a @ B[e] (+ a2 @ B2[e]) on row-grouped a, B given by its (expert, k, n)
# strides.
def _grouped_mm(a, b, b_strides, tiles, n_out, second=None, out_dtype=None):
    block_m, block_n, block_k, options, fp32_dot = _config(a.device)
    c = torch.empty((a.shape[0], n_out), dtype=out_dtype or a.dtype, device=a.device)
    a2, b2 = second if second is not None else (a, b)
    _grouped_mm_kernel[(len(tiles), triton.cdiv(n_out, block_n))](
        a, b, a2, b2, c, tiles, b.shape[0], n_out, a.shape[1], *b_strides,
        HAS_SECOND=second is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        FP32_DOT=fp32_dot, **options,
    )
    return c


# C[e] = a_e.T @ b_e for every expert (a (n, M), b (n, N) row-grouped) -> (E, M, N).
def _wgrad(a, b, rows, dtype):
    block_m, block_n, block_k, options, fp32_dot = _config(a.device)
    c = torch.empty((len(rows), a.shape[1], b.shape[1]), dtype=dtype, device=a.device)
    grid = (len(rows), triton.cdiv(a.shape[1], block_m), triton.cdiv(b.shape[1], block_n))
    _wgrad_kernel[grid](
        a, b, c, rows, a.shape[1], b.shape[1],
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, FP32_DOT=fp32_dot, **options,
    )
    return c


# The weights are saved as given and cast again in the backward: a looped model calls each
# MoE several times per step, and a bf16 copy per call costs more than a cast.
class _MoEExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, counts, w_gate, w_up, w_down, dtype):
        n_experts, n_hidden, n_embd = w_gate.shape
        block_m, block_n, block_k, options, fp32_dot = _config(x.device)
        # Built on the device: no host read of counts.
        tiles, rows = tile_map(counts, x.shape[0], block_m)
        # No-ops when they already are.
        xc, wd = (t.to(dtype).contiguous() for t in (x, w_down))
        wg, wu = matrices(w_gate.to(dtype), w_up.to(dtype))
        gate, up, act = (xc.new_empty(x.shape[0], n_hidden) for _ in range(3))
        _gate_up_kernel[(len(tiles), triton.cdiv(n_hidden, block_n))](
            xc, wg, wu, gate, up, act, tiles, n_experts, n_hidden, n_embd, wg.stride(0),
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, FP32_DOT=fp32_dot, **options,
        )
        # y = act @ W_down[e].T, stored in x's dtype.
        y = _grouped_mm(act, wd, (wd.stride(0), 1, n_hidden), tiles, n_embd, out_dtype=x.dtype)
        ctx.save_for_backward(xc, w_gate, w_up, w_down, gate, up, tiles, rows)
        ctx.x_dtype = x.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        xc, w_gate, w_up, w_down, gate, up, tiles, rows = ctx.saved_tensors
        n_embd, n_hidden = w_down.shape[1:]
        wg, wu = matrices(w_gate.to(xc.dtype), w_up.to(xc.dtype))
        wd = w_down.to(xc.dtype).contiguous()
        dy = dy.to(xc.dtype).contiguous()
        # d act = dy @ W_down[e]
        d_act = _grouped_mm(dy, wd, (wd.stride(0), n_hidden, 1), tiles, n_hidden)
        d_gate, d_up = swiglu_backward(gate, up, d_act)
        wg_strides = (wg.stride(0), n_embd, 1)
        dx = _grouped_mm(d_gate, wg, wg_strides, tiles, n_embd, (d_up, wu), ctx.x_dtype)
        # act is recomputed, not saved.
        dw_down = _wgrad(dy, swiglu_forward(gate, up), rows, w_down.dtype)
        dw_gate = _wgrad(d_gate, xc, rows, w_gate.dtype)
        dw_up = _wgrad(d_up, xc, rows, w_up.dtype)
        return dx, None, dw_gate, dw_up, dw_down, None


# Both (E, hidden, d), each expert's matrix contiguous, one stride between experts: as
# given when they are views of model.MoE's w_gate_up, else copies.
def matrices(w_gate, w_up):
    rows_contiguous = all(w.stride()[1:] == (w.size(2), 1) for w in (w_gate, w_up))
    if rows_contiguous and w_gate.stride(0) == w_up.stride(0):
        return w_gate, w_up
    return w_gate.contiguous(), w_up.contiguous()


def moe_experts(x_sorted, counts, w_gate, w_up, w_down):
    """Rows of expert e: (silu(x_e @ w_gate[e].T) * (x_e @ w_up[e].T)) @ w_down[e].T.

    x_sorted (n, d) grouped by expert, counts (E,) summing to n, w_gate and w_up
    (E, hidden, d), w_down (E, d, hidden). Returns x_sorted's dtype; matmul operands in
    autocast's dtype under autocast, else x_sorted's."""
    device = x_sorted.device.type
    dtype = x_sorted.dtype
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
    # Nothing to launch; the twin keeps every weight in the graph.
    if x_sorted.shape[0] == 0:
        return moe_experts_reference(x_sorted, counts, w_gate, w_up, w_down)
    return _MoEExperts.apply(x_sorted, counts, w_gate, w_up, w_down, dtype)


# The PyTorch twin: a loop over the experts (a host read of counts), in x_sorted's dtype.
def moe_experts_reference(x_sorted, counts, w_gate, w_up, w_down):
    blocks = torch.split(x_sorted, counts.tolist())
    y = [
        (F.silu(x_e @ w_gate[e].t()) * (x_e @ w_up[e].t())) @ w_down[e].t()
        for e, x_e in enumerate(blocks)
    ]
    return torch.cat(y).to(x_sorted.dtype)
