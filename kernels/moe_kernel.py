"""
MoE experts over expert-sorted tokens as grouped GEMMs: one launch covers every expert.

The MoE dispatch sorts the (token, expert) pairs by expert, so expert e owns the contiguous row block
x_sorted[offset_e : offset_e + counts[e]]. Each expert is a SwiGLU MLP:
    y_e = (silu(x_e @ W_gate[e].T) * (x_e @ W_up[e].T)) @ W_down[e].T
A python loop over experts launches 3 small matmuls per expert (hundreds of launches for a fine-grained
MoE, most of them tiny). Here, as in the Triton grouped-GEMM tutorial, a single launch walks a list of
BLOCK_M-row tiles; each tile knows its expert, its first row and the expert's last row. The tile list
is built on the device with cumsum + searchsorted (no host sync, so no `.item()` stall per layer);
its length is the upper bound cdiv(n, BLOCK_M) + E and the spare tiles return at once.

Kernels (all fp32 accumulation; bf16 operands feed the tensor cores directly on CUDA):
  _moe_gate_up_kernel    x @ W_gate[e].T and x @ W_up[e].T in one pass over x, SwiGLU in the epilogue;
                         stores the two pre-activations (saved for backward) and the activation.
  _grouped_mm_kernel     C = A @ B[e] (+ A2 @ B2[e]) on row-grouped A; B given by strides, so W[e]
                         and W[e].T need no copy. Used for the down projection, d act and d x.
  _grouped_wgrad_kernel  C[e] = A_e.T @ B_e, reducing over each expert's own rows: weight gradients.
                         An expert with no rows runs an empty loop and stores zeros.
Backward, all in Triton: d act = dy @ W_down[e]; SwiGLU backward (kernels/swiglu_kernel.py) gives
d gate-pre and d up-pre and recomputes act; d x = d gate @ W_gate[e] + d up @ W_up[e] (one launch);
d W_down[e] = dy_e.T @ act_e, d W_gate[e] = d gate_e.T @ x_e, d W_up[e] = d up_e.T @ x_e.

Dtypes (moe_experts' docstring has the contract): matmul operands in the autocast dtype under autocast,
else the inputs' dtype; the result in x_sorted's dtype; each gradient in its input's dtype. In the
interpreter (CPU) the FP32_DOT flag converts the operands to fp32 after the load (no bf16 arithmetic there).
"""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.swiglu_kernel import swiglu_backward, swiglu_forward


@triton.jit
def _tile_rows(TILE_EXPERT, TILE_FIRST_ROW, TILE_LAST_ROW, tile, BLOCK_M: tl.constexpr):
    expert = tl.load(TILE_EXPERT + tile).to(tl.int64)
    first = tl.load(TILE_FIRST_ROW + tile).to(tl.int64)
    last = tl.load(TILE_LAST_ROW + tile).to(tl.int64)
    rows = first + tl.arange(0, BLOCK_M)
    return expert, rows, rows < last


@triton.jit
def _moe_gate_up_kernel(X, WG, WU, HG, HU, ACT, TILE_EXPERT, TILE_FIRST_ROW, TILE_LAST_ROW,
                        n_experts, n_hidden, n_embd, stride_xm, stride_xk,
                        stride_wge, stride_wgn, stride_wgk, stride_wue, stride_wun, stride_wuk, stride_hm,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        FP32_DOT: tl.constexpr):
    tile = tl.program_id(0)
    expert, rows, row_mask = _tile_rows(TILE_EXPERT, TILE_FIRST_ROW, TILE_LAST_ROW, tile, BLOCK_M)
    if expert >= n_experts:  # spare tile past the last expert's rows
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_hidden
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = X + rows[:, None] * stride_xm + ks[None, :] * stride_xk
    wg_ptrs = WG + expert * stride_wge + ks[:, None] * stride_wgk + cols[None, :] * stride_wgn  # W_gate[e].T
    wu_ptrs = WU + expert * stride_wue + ks[:, None] * stride_wuk + cols[None, :] * stride_wun
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, n_embd, BLOCK_K):
        k_mask = ks < n_embd - k0
        x = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & col_mask[None, :]
        wg = tl.load(wg_ptrs, mask=w_mask, other=0.0)
        wu = tl.load(wu_ptrs, mask=w_mask, other=0.0)
        if FP32_DOT:  # interpreter: no bf16 arithmetic (see _fp32_dot)
            x, wg, wu = x.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
        acc_gate = tl.dot(x, wg, acc_gate, input_precision="ieee")  # ieee: true fp32 for fp32 inputs
        acc_up = tl.dot(x, wu, acc_up, input_precision="ieee")
        x_ptrs += BLOCK_K * stride_xk
        wg_ptrs += BLOCK_K * stride_wgk
        wu_ptrs += BLOCK_K * stride_wuk
    act = acc_gate * tl.sigmoid(acc_gate) * acc_up  # SwiGLU epilogue
    offsets = rows[:, None] * stride_hm + cols[None, :]
    mask = row_mask[:, None] & col_mask[None, :]
    tl.store(HG + offsets, acc_gate.to(HG.dtype.element_ty), mask=mask)
    tl.store(HU + offsets, acc_up.to(HU.dtype.element_ty), mask=mask)
    tl.store(ACT + offsets, act.to(ACT.dtype.element_ty), mask=mask)


@triton.jit
def _dot_accumulate(acc, a_ptrs, b_ptrs, a_mask, b_mask, FP32_DOT: tl.constexpr):
    """acc + A tile @ B tile (true fp32 products for fp32 inputs)."""
    a = tl.load(a_ptrs, mask=a_mask, other=0.0)
    b = tl.load(b_ptrs, mask=b_mask, other=0.0)
    if FP32_DOT:
        a, b = a.to(tl.float32), b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision="ieee")


@triton.jit
def _grouped_mm_kernel(A, B, A2, B2, C, TILE_EXPERT, TILE_FIRST_ROW, TILE_LAST_ROW, n_experts, N, K,
                       stride_am, stride_ak, stride_be, stride_bk, stride_bn,
                       stride_a2m, stride_a2k, stride_b2e, stride_b2k, stride_b2n, stride_cm, stride_cn,
                       HAS_SECOND: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       FP32_DOT: tl.constexpr):
    tile = tl.program_id(0)
    expert, rows, row_mask = _tile_rows(TILE_EXPERT, TILE_FIRST_ROW, TILE_LAST_ROW, tile, BLOCK_M)
    if expert >= n_experts:
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = A + rows[:, None] * stride_am + ks[None, :] * stride_ak
    b_ptrs = B + expert * stride_be + ks[:, None] * stride_bk + cols[None, :] * stride_bn
    if HAS_SECOND:
        a2_ptrs = A2 + rows[:, None] * stride_a2m + ks[None, :] * stride_a2k
        b2_ptrs = B2 + expert * stride_b2e + ks[:, None] * stride_b2k + cols[None, :] * stride_b2n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = ks < K - k0
        a_mask = row_mask[:, None] & k_mask[None, :]
        b_mask = k_mask[:, None] & col_mask[None, :]
        acc = _dot_accumulate(acc, a_ptrs, b_ptrs, a_mask, b_mask, FP32_DOT)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
        if HAS_SECOND:  # C = A @ B[e] + A2 @ B2[e] (d x sums the gate and up paths)
            acc = _dot_accumulate(acc, a2_ptrs, b2_ptrs, a_mask, b_mask, FP32_DOT)
            a2_ptrs += BLOCK_K * stride_a2k
            b2_ptrs += BLOCK_K * stride_b2k
    tl.store(C + rows[:, None] * stride_cm + cols[None, :] * stride_cn, acc.to(C.dtype.element_ty),
             mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _grouped_wgrad_kernel(A, B, C, ROW_START, COUNTS, M, N, stride_am, stride_ak, stride_bm, stride_bn,
                          stride_ce, stride_cm, stride_cn,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          FP32_DOT: tl.constexpr):
    expert = tl.program_id(0)
    start = tl.load(ROW_START + expert).to(tl.int64)
    count = tl.load(COUNTS + expert).to(tl.int64)
    ms = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    ns = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = ms < M, ns < N
    ks = tl.arange(0, BLOCK_K)
    rows = start + ks
    a_ptrs = A + rows[None, :] * stride_am + ms[:, None] * stride_ak  # (BLOCK_M, BLOCK_K) tiles of A_e.T
    b_ptrs = B + rows[:, None] * stride_bm + ns[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, count, BLOCK_K):  # this expert's rows only; zero rows -> zero gradient
        k_mask = ks < count - k0
        a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if FP32_DOT:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision="ieee")
        a_ptrs += BLOCK_K * stride_am
        b_ptrs += BLOCK_K * stride_bm
    tl.store(C + expert * stride_ce + ms[:, None] * stride_cm + ns[None, :] * stride_cn,
             acc.to(C.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def _blocks(device_type):
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages). One fixed config (the interpreter cannot
    autotune): 64x64x32 suits small per-expert row counts on GPU; 32^3 keeps CPU test shapes multi-tile."""
    if device_type == "cuda":
        return 64, 64, 32, 4, 3
    return 32, 32, 32, 4, 1


def _fp32_dot(device_type):
    """FP32_DOT: convert the matmul operands to fp32 after the load. Only for the interpreter (CPU), which
    cannot multiply bf16; the product of two bf16 values is exact in fp32, so this is still the tensor
    cores' arithmetic (bf16 operands, fp32 sums) up to summation order. On CUDA bf16 goes to tl.dot as is."""
    return device_type != "cuda"


def tile_map(counts, n_rows, block_m):
    """Per BLOCK_M-row tile: (expert, first row, expert's end row). Built on the device, no host sync.

    Expert e owns rows [start_e, start_e + counts[e]) and ceil(counts[e] / block_m) tiles. The list has
    the fixed length cdiv(n_rows, block_m) + E (an upper bound); tiles past the end get expert == E."""
    n_experts = counts.numel()
    counts = counts.to(torch.int64)
    row_end = torch.cumsum(counts, 0)
    row_start = row_end - counts
    n_tiles = (counts + block_m - 1) // block_m
    tile_end = torch.cumsum(n_tiles, 0)
    tiles = torch.arange(triton.cdiv(n_rows, block_m) + n_experts, device=counts.device)
    expert = torch.searchsorted(tile_end, tiles, right=True)
    e = expert.clamp(max=n_experts - 1)
    first_row = row_start[e] + (tiles - (tile_end - n_tiles)[e]) * block_m
    return expert.to(torch.int32), first_row, row_end[e], row_start


def _grouped_mm(a, b, b_strides, tiles, n_experts, n_out, second=None, out_dtype=None):
    """C (n, n_out) = a @ B[e] (+ a2 @ B2[e]) for row-grouped a; b_strides = (expert, k, n) strides of B.
    C is stored from the fp32 accumulator in out_dtype (default: a's dtype)."""
    tile_expert, first_row, last_row = tiles
    block_m, block_n, block_k, num_warps, num_stages = _blocks(a.device.type)
    c = torch.empty((a.shape[0], n_out), dtype=out_dtype or a.dtype, device=a.device)
    a2, b2, b2_strides = second if second is not None else (a, b, b_strides)
    grid = (tile_expert.numel(), triton.cdiv(n_out, block_n))
    _grouped_mm_kernel[grid](a, b, a2, b2, c, tile_expert, first_row, last_row, n_experts, n_out, a.shape[1],
                             a.stride(0), a.stride(1), *b_strides, a2.stride(0), a2.stride(1), *b2_strides,
                             c.stride(0), c.stride(1), HAS_SECOND=second is not None,
                             BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                             FP32_DOT=_fp32_dot(a.device.type), num_warps=num_warps, num_stages=num_stages)
    return c


def _grouped_wgrad(a, b, row_start, counts, dtype):
    """C[e] = a_e.T @ b_e for every expert e (a: (n, M), b: (n, N) row-grouped) -> (E, M, N) in dtype."""
    n_experts, m, n = counts.numel(), a.shape[1], b.shape[1]
    block_m, block_n, block_k, num_warps, num_stages = _blocks(a.device.type)
    c = torch.empty((n_experts, m, n), dtype=dtype, device=a.device)
    grid = (n_experts, triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _grouped_wgrad_kernel[grid](a, b, c, row_start, counts, m, n, a.stride(0), a.stride(1),
                                b.stride(0), b.stride(1), c.stride(0), c.stride(1), c.stride(2),
                                BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                                FP32_DOT=_fp32_dot(a.device.type), num_warps=num_warps, num_stages=num_stages)
    return c


class _MoEExpertsFunction(torch.autograd.Function):
    """x and the weights in any float dtypes; matmul operands in `dtype` (cast here); y in x's dtype; every
    gradient in its own input's dtype, each stored straight from an fp32 accumulator.
    The weights are saved as given (parameters stay alive anyway) and cast again in backward: a looped model
    calls each MoE several times per step, and a saved bf16 copy of every expert per call would cost more
    memory than the second cast costs time."""

    @staticmethod
    def forward(ctx, x, counts, w_gate, w_up, w_down, dtype):
        n_experts, n_hidden, n_embd = w_gate.shape
        block_m, block_n, block_k, num_warps, num_stages = _blocks(x.device.type)
        counts = counts.to(torch.int64)
        tile_expert, first_row, last_row, row_start = tile_map(counts, x.shape[0], block_m)
        tiles = (tile_expert, first_row, last_row)
        xc, wg, wu, wd = (t.to(dtype) for t in (x, w_gate, w_up, w_down))  # no-ops when already in dtype
        gate_pre = torch.empty((x.shape[0], n_hidden), dtype=dtype, device=x.device)
        up_pre, act = torch.empty_like(gate_pre), torch.empty_like(gate_pre)
        grid = (tile_expert.numel(), triton.cdiv(n_hidden, block_n))
        _moe_gate_up_kernel[grid](xc, wg, wu, gate_pre, up_pre, act, tile_expert, first_row, last_row,
                                  n_experts, n_hidden, n_embd, xc.stride(0), xc.stride(1),
                                  *wg.stride(), *wu.stride(), gate_pre.stride(0),
                                  BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                                  FP32_DOT=_fp32_dot(x.device.type), num_warps=num_warps, num_stages=num_stages)
        # y = act @ W_down[e].T: B[e] = W_down[e].T has (k, n) strides (stride(2), stride(1))
        y = _grouped_mm(act, wd, (wd.stride(0), wd.stride(2), wd.stride(1)), tiles, n_experts, n_embd,
                        out_dtype=x.dtype)
        ctx.save_for_backward(xc, counts, w_gate, w_up, w_down, gate_pre, up_pre, tile_expert, first_row,
                              last_row, row_start)
        ctx.x_dtype = x.dtype
        return y

    @staticmethod
    def backward(ctx, grad_y):
        xc, counts, w_gate, w_up, w_down, gate_pre, up_pre, *tiles, row_start = ctx.saved_tensors
        n_experts, n_hidden, n_embd = w_gate.shape
        dtype = xc.dtype  # the matmul operand dtype
        wg, wu, wd = (w.to(dtype) for w in (w_gate, w_up, w_down))
        dy = grad_y.to(dtype)
        dy = dy if dy.stride(-1) == 1 else dy.contiguous()
        # d act = dy @ W_down[e]   (W_down[e] is (n_embd, n_hidden): k stride(1), n stride(2))
        d_act = _grouped_mm(dy, wd, wd.stride(), tiles, n_experts, n_hidden)
        d_gate, d_up = swiglu_backward(gate_pre, up_pre, d_act)
        need_x, _, need_gate, need_up, need_down, _ = ctx.needs_input_grad
        dx = dw_gate = dw_up = dw_down = None
        if need_x:  # d x = d gate @ W_gate[e] + d up @ W_up[e]
            dx = _grouped_mm(d_gate, wg, wg.stride(), tiles, n_experts, n_embd,
                             second=(d_up, wu, wu.stride()), out_dtype=ctx.x_dtype)
        if need_down:
            act = swiglu_forward(gate_pre, up_pre)  # recomputed rather than saved
            dw_down = _grouped_wgrad(dy, act, row_start, counts, w_down.dtype)
        if need_gate:
            dw_gate = _grouped_wgrad(d_gate, xc, row_start, counts, w_gate.dtype)
        if need_up:
            dw_up = _grouped_wgrad(d_up, xc, row_start, counts, w_up.dtype)
        return dx, None, dw_gate, dw_up, dw_down, None


_MATMUL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check(x_sorted, counts, w_gate, w_up, w_down, autocast):
    if x_sorted.dim() != 2:
        raise ValueError(f"moe_experts: x_sorted must be (n_tokens, n_embd), got shape {tuple(x_sorted.shape)}")
    if w_gate.dim() != 3:
        raise ValueError(f"moe_experts: w_gate must be (n_expert, expert_hidden, n_embd), got {tuple(w_gate.shape)}")
    n_experts, n_hidden, n_embd = w_gate.shape
    expected = {"w_gate": (n_experts, n_hidden, n_embd), "w_up": (n_experts, n_hidden, n_embd),
                "w_down": (n_experts, n_embd, n_hidden)}
    for name, w in (("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
        if tuple(w.shape) != expected[name]:
            raise ValueError(f"moe_experts: {name} shape {tuple(w.shape)} != expected {expected[name]}")
        if w.device != x_sorted.device:
            raise ValueError(f"moe_experts: {name} is on {w.device} but x_sorted is on {x_sorted.device}")
        if w.dtype != x_sorted.dtype and not autocast:
            raise ValueError(f"moe_experts: {name} is {w.dtype} but x_sorted is {x_sorted.dtype}; outside "
                             f"autocast they must match (under autocast both are cast to the autocast dtype)")
    for name, t in (("x_sorted", x_sorted), ("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
        if t.dtype not in _MATMUL_DTYPES:
            raise ValueError(f"moe_experts: {name} is {t.dtype}; supported: float32, bfloat16, float16")
    if x_sorted.shape[1] != n_embd:
        raise ValueError(f"moe_experts: x_sorted has {x_sorted.shape[1]} features, weights expect {n_embd}")
    if tuple(counts.shape) != (n_experts,) or counts.dtype.is_floating_point or counts.dtype == torch.bool:
        raise ValueError(f"moe_experts: counts must be an integer tensor of shape ({n_experts},), "
                         f"got {counts.dtype} {tuple(counts.shape)}")
    if counts.device != x_sorted.device:
        raise ValueError(f"moe_experts: counts on {counts.device} but x_sorted on {x_sorted.device}")
    if counts.device.type == "cpu":  # on CUDA this check would cost a host sync per layer: trusted there
        if int(counts.sum()) != x_sorted.shape[0] or bool((counts < 0).any()):
            raise ValueError(f"moe_experts: counts {counts.tolist()} must be >= 0 and sum to the "
                             f"{x_sorted.shape[0]} rows of x_sorted")


def moe_experts(x_sorted, counts, w_gate, w_up, w_down):
    """Row block e of the result = (silu(x_e @ w_gate[e].T) * (x_e @ w_up[e].T)) @ w_down[e].T.

    x_sorted (n, d) rows grouped by expert; counts (E,) integer rows per expert (zeros allowed, sum n; n = 0
    allowed); w_gate, w_up (E, hidden, d); w_down (E, d, hidden); all on one device.

    Dtypes (kernels.apply's MoE.experts relies on these):
      matmul operands: under autocast (enabled for x_sorted's device) the autocast dtype, x_sorted and the
          weights cast to it as torch.matmul would cast them; outside autocast x_sorted and the weights
          must share one dtype, which is used. fp32 accumulation, SwiGLU epilogue in fp32.
      result: x_sorted.dtype, always (stored straight from the fp32 accumulator). The MoE scatter
          `torch.zeros_like(flat).index_add_(0, token_of, y)` with x_sorted = flat[token_of] then needs
          no cast, under autocast or not.
      gradients: each in its own input's dtype (d x_sorted in x_sorted.dtype, d w in w.dtype), from fp32
          accumulators; an expert with no rows gets exact zeros (also when n = 0)."""
    device_type = x_sorted.device.type
    autocast = torch.is_autocast_enabled(device_type)
    _check(x_sorted, counts, w_gate, w_up, w_down, autocast)
    if x_sorted.shape[0] == 0:  # nothing to launch; the twin keeps the graph, so every weight gets a zero grad
        return moe_experts_reference(x_sorted, counts, w_gate, w_up, w_down)
    dtype = torch.get_autocast_dtype(device_type) if autocast else x_sorted.dtype
    return _MoEExpertsFunction.apply(x_sorted, counts, w_gate, w_up, w_down, dtype)


def moe_experts_reference(x_sorted, counts, w_gate, w_up, w_down):
    """PyTorch twin of moe_experts: a loop over the experts, each a SwiGLU MLP on its own block of rows
    (under autocast the matmuls run in the autocast dtype), returned in x_sorted.dtype as moe_experts.
    tests/test_kernels.py holds it equal to model.run_experts with every row its own token."""
    blocks = torch.split(x_sorted, counts.tolist())
    y = [(F.silu(x_e @ w_gate[e].t()) * (x_e @ w_up[e].t())) @ w_down[e].t() for e, x_e in enumerate(blocks)]
    return torch.cat(y).to(x_sorted.dtype)
