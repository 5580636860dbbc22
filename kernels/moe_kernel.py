"""
The MoE experts over expert-sorted rows as grouped GEMMs: one launch covers every expert.

The dispatch sorts the (token, expert) pairs by expert, so expert e owns the contiguous rows
x_sorted[start_e : start_e + counts[e]], and each expert is a SwiGLU MLP:
    y_e = (silu(x_e @ W_gate[e].T) * (x_e @ W_up[e].T)) @ W_down[e].T
A loop over experts launches 3 small matmuls per expert (hundreds of launches, most of them tiny). Here, as
in the Triton grouped-GEMM tutorial, one launch walks a list of BLOCK_M-row tiles, each knowing its expert
and rows. The list is built on the device (cumsum + searchsorted: no host read); its length is the bound
cdiv(n, BLOCK_M) + E, and the spare tiles return at once.
  _gate_up_kernel      x @ W_gate[e].T and x @ W_up[e].T in one pass over x, SwiGLU in the epilogue.
  _grouped_mm_kernel   C = A @ B[e] (+ A2 @ B2[e]), B given by strides (W[e] or W[e].T, no copy):
                       the down projection, d act = dy @ W_down[e], d x = d gate @ W_gate[e] + d up @ W_up[e].
  _wgrad_kernel        C[e] = A_e.T @ B_e over each expert's own rows: weight gradients (no rows: zeros).
Matmul operands in autocast's dtype under autocast (else the inputs'), fp32 accumulation; the result in
x_sorted's dtype, each gradient in its input's. The interpreter (CPU) cannot multiply bf16: FP32_DOT converts
the operands after the load (bf16 x bf16 is exact in fp32: still the tensor cores' arithmetic).
"""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.swiglu_kernel import swiglu_backward, swiglu_forward


@triton.jit
def _tile_rows(TILES, BLOCK_M: tl.constexpr):
    """(expert, rows, row mask) of this program's tile; TILES (n_tiles, 3): expert, first row, end row."""
    tile = TILES + 3 * tl.program_id(0)
    rows = tl.load(tile + 1) + tl.arange(0, BLOCK_M)
    return tl.load(tile), rows, rows < tl.load(tile + 2)


@triton.jit
def _dot(acc, a_ptrs, b_ptrs, a_mask, b_mask, FP32_DOT: tl.constexpr):
    a = tl.load(a_ptrs, mask=a_mask, other=0.0)
    b = tl.load(b_ptrs, mask=b_mask, other=0.0)
    if FP32_DOT:
        a, b = a.to(tl.float32), b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision="ieee")  # ieee: true fp32 for fp32 operands (no TF32)


@triton.jit
def _gate_up_kernel(X, WG, WU, HG, HU, ACT, TILES, n_experts, n_hidden, n_embd, stride_we,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    FP32_DOT: tl.constexpr):
    expert, rows, row_mask = _tile_rows(TILES, BLOCK_M)
    if expert >= n_experts:  # a spare tile
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = X + rows[:, None] * n_embd + ks[None, :]
    w_offsets = expert * stride_we + cols[None, :] * n_embd + ks[:, None]  # a tile of W[e].T
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, n_embd, BLOCK_K):
        x_mask = row_mask[:, None] & (ks[None, :] < n_embd - k0)
        w_mask = (ks[:, None] < n_embd - k0) & (cols[None, :] < n_hidden)
        gate = _dot(gate, x_ptrs + k0, WG + w_offsets + k0, x_mask, w_mask, FP32_DOT)
        up = _dot(up, x_ptrs + k0, WU + w_offsets + k0, x_mask, w_mask, FP32_DOT)
    offsets = rows[:, None] * n_hidden + cols[None, :]
    mask = row_mask[:, None] & (cols[None, :] < n_hidden)
    tl.store(HG + offsets, gate.to(HG.dtype.element_ty), mask=mask)  # saved for the backward
    tl.store(HU + offsets, up.to(HU.dtype.element_ty), mask=mask)
    tl.store(ACT + offsets, (gate * tl.sigmoid(gate) * up).to(ACT.dtype.element_ty), mask=mask)  # SwiGLU


@triton.jit
def _grouped_mm_kernel(A, B, A2, B2, C, TILES, n_experts, N, K, stride_be, stride_bk, stride_bn,
                       HAS_SECOND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, FP32_DOT: tl.constexpr):
    expert, rows, row_mask = _tile_rows(TILES, BLOCK_M)
    if expert >= n_experts:
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    a_offsets = rows[:, None] * K + ks[None, :]
    b_offsets = expert * stride_be + ks[:, None] * stride_bk + cols[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a_mask = row_mask[:, None] & (ks[None, :] < K - k0)
        b_mask = (ks[:, None] < K - k0) & (cols[None, :] < N)
        acc = _dot(acc, A + a_offsets + k0, B + b_offsets + k0 * stride_bk, a_mask, b_mask, FP32_DOT)
        if HAS_SECOND:  # d x sums the gate and the up paths
            acc = _dot(acc, A2 + a_offsets + k0, B2 + b_offsets + k0 * stride_bk, a_mask, b_mask, FP32_DOT)
    tl.store(C + rows[:, None] * N + cols[None, :], acc.to(C.dtype.element_ty),
             mask=row_mask[:, None] & (cols[None, :] < N))


@triton.jit
def _wgrad_kernel(A, B, C, ROWS, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  FP32_DOT: tl.constexpr):
    expert = tl.program_id(0).to(tl.int64)
    start, count = tl.load(ROWS + 2 * expert), tl.load(ROWS + 2 * expert + 1)
    ms = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    ns = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, count, BLOCK_K):  # this expert's rows only
        rows, k_mask = start + k0 + ks, ks < count - k0
        a_ptrs = A + rows[None, :] * M + ms[:, None]  # (BLOCK_M, BLOCK_K) of A_e.T
        b_ptrs = B + rows[:, None] * N + ns[None, :]
        a_mask, b_mask = (ms[:, None] < M) & k_mask[None, :], k_mask[:, None] & (ns[None, :] < N)
        acc = _dot(acc, a_ptrs, b_ptrs, a_mask, b_mask, FP32_DOT)
    tl.store(C + expert * M * N + ms[:, None] * N + ns[None, :], acc.to(C.dtype.element_ty),
             mask=(ms[:, None] < M) & (ns[None, :] < N))


def _config(device):
    """(BLOCK_M, BLOCK_N, BLOCK_K, launch options, FP32_DOT): one config (the interpreter cannot autotune)."""
    if device.type == "cuda":
        return 64, 64, 32, dict(num_warps=4, num_stages=3), False
    return 32, 32, 32, {}, True


def tile_map(counts, n_rows, block_m):
    """TILES (n_tiles, 3): per BLOCK_M-row tile its expert (E for a spare), first row and the expert's end
    row; ROWS (E, 2): each expert's first row and count. On the device, no host read."""
    counts = counts.long()
    end = counts.cumsum(0)
    start, n_tiles = end - counts, (counts + block_m - 1) // block_m
    tile_end = n_tiles.cumsum(0)
    tiles = torch.arange(triton.cdiv(n_rows, block_m) + len(counts), device=counts.device)
    expert = torch.searchsorted(tile_end, tiles, right=True)
    e = expert.clamp(max=len(counts) - 1)
    first = start[e] + (tiles - (tile_end - n_tiles)[e]) * block_m
    return torch.stack([expert, first, end[e]], 1).contiguous(), torch.stack([start, counts], 1).contiguous()


def _grouped_mm(a, b, b_strides, tiles, n_out, second=None, out_dtype=None):
    """C (n, n_out) = a @ B[e] (+ a2 @ B2[e]) on row-grouped a; b_strides: B's (expert, k, n) strides."""
    block_m, block_n, block_k, options, fp32_dot = _config(a.device)
    c = torch.empty((a.shape[0], n_out), dtype=out_dtype or a.dtype, device=a.device)
    a2, b2 = second if second is not None else (a, b)
    _grouped_mm_kernel[(len(tiles), triton.cdiv(n_out, block_n))](
        a, b, a2, b2, c, tiles, b.shape[0], n_out, a.shape[1], *b_strides, HAS_SECOND=second is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, FP32_DOT=fp32_dot, **options)
    return c


def _wgrad(a, b, rows, dtype):
    """C[e] = a_e.T @ b_e for every expert (a (n, M), b (n, N) row-grouped) -> (E, M, N)."""
    block_m, block_n, block_k, options, fp32_dot = _config(a.device)
    c = torch.empty((len(rows), a.shape[1], b.shape[1]), dtype=dtype, device=a.device)
    _wgrad_kernel[(len(rows), triton.cdiv(a.shape[1], block_m), triton.cdiv(b.shape[1], block_n))](
        a, b, c, rows, a.shape[1], b.shape[1], BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        FP32_DOT=fp32_dot, **options)
    return c


class _MoEExperts(torch.autograd.Function):
    """The weights are saved as given and cast again in the backward: a looped model calls each MoE several
    times per step, and a saved bf16 copy of every expert per call costs more memory than a second cast."""

    @staticmethod
    def forward(ctx, x, counts, w_gate, w_up, w_down, dtype):
        n_experts, n_hidden, n_embd = w_gate.shape
        block_m, block_n, block_k, options, fp32_dot = _config(x.device)
        tiles, rows = tile_map(counts, x.shape[0], block_m)
        xc, wd = (t.to(dtype).contiguous() for t in (x, w_down))  # no-ops when they are
        wg, wu = matrices(w_gate.to(dtype), w_up.to(dtype))
        gate, up, act = (xc.new_empty(x.shape[0], n_hidden) for _ in range(3))
        _gate_up_kernel[(len(tiles), triton.cdiv(n_hidden, block_n))](
            xc, wg, wu, gate, up, act, tiles, n_experts, n_hidden, n_embd, wg.stride(0),
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, FP32_DOT=fp32_dot, **options)
        # y = act @ W_down[e].T, stored in x's dtype
        y = _grouped_mm(act, wd, (wd.stride(0), 1, n_hidden), tiles, n_embd, out_dtype=x.dtype)
        ctx.save_for_backward(xc, w_gate, w_up, w_down, gate, up, tiles, rows)
        ctx.x_dtype = x.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        xc, w_gate, w_up, w_down, gate, up, tiles, rows = ctx.saved_tensors
        n_embd, n_hidden = w_down.shape[1:]
        (wg, wu), wd = matrices(w_gate.to(xc.dtype), w_up.to(xc.dtype)), w_down.to(xc.dtype).contiguous()
        dy = dy.to(xc.dtype).contiguous()
        d_act = _grouped_mm(dy, wd, (wd.stride(0), n_hidden, 1), tiles, n_hidden)  # dy @ W_down[e]
        d_gate, d_up = swiglu_backward(gate, up, d_act)
        dx = _grouped_mm(d_gate, wg, (wg.stride(0), n_embd, 1), tiles, n_embd, (d_up, wu), ctx.x_dtype)
        dw_down = _wgrad(dy, swiglu_forward(gate, up), rows, w_down.dtype)  # act recomputed, not saved
        dw_gate, dw_up = _wgrad(d_gate, xc, rows, w_gate.dtype), _wgrad(d_up, xc, rows, w_up.dtype)
        return dx, None, dw_gate, dw_up, dw_down, None


def matrices(w_gate, w_up):
    """Both (E, hidden, d) with each expert's matrix contiguous and one stride between experts: as given
    when they are views of one stacked tensor (model.MoE's w_gate_up[:, 0] and [:, 1]), else copies."""
    if all(w.stride()[1:] == (w.size(2), 1) for w in (w_gate, w_up)) and w_gate.stride(0) == w_up.stride(0):
        return w_gate, w_up
    return w_gate.contiguous(), w_up.contiguous()


def moe_experts(x_sorted, counts, w_gate, w_up, w_down):
    """Rows of expert e: (silu(x_e @ w_gate[e].T) * (x_e @ w_up[e].T)) @ w_down[e].T, for x_sorted (n, d)
    grouped by expert, counts (E,) integers summing to n, w_gate, w_up (E, hidden, d), w_down (E, d, hidden).
    Returns x_sorted.dtype; matmul operands in autocast's dtype under autocast, else x_sorted's."""
    device = x_sorted.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x_sorted.dtype
    if x_sorted.shape[0] == 0:  # nothing to launch; the twin keeps every weight in the graph
        return moe_experts_reference(x_sorted, counts, w_gate, w_up, w_down)
    return _MoEExperts.apply(x_sorted, counts, w_gate, w_up, w_down, dtype)


def moe_experts_reference(x_sorted, counts, w_gate, w_up, w_down):
    """The PyTorch twin: a loop over the experts (a host read of counts), in x_sorted's dtype."""
    blocks = torch.split(x_sorted, counts.tolist())
    y = [(F.silu(x_e @ w_gate[e].t()) * (x_e @ w_up[e].t())) @ w_down[e].t() for e, x_e in enumerate(blocks)]
    return torch.cat(y).to(x_sorted.dtype)
