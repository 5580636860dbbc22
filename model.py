"""
Every architecture of both studies in one readable file; it needs only torch (copy it alone).

  [S] SMELT: an MoE transformer whose middle half runs r times ("model-loop"), every sublayer update
      inside the loop span scaled by 1/r ([S8]-[S9]).
  [X] prelude-core-coda: P prelude blocks, a core of C blocks applied K times (tied or untied weights),
      D coda blocks, and the boundary operator BO(h, e) = RMSNorm(h) + alpha * e ([X1]-[X3]) before
      every core pass after the first and before the coda.
  plus the layer-loop variant (each layer applied r times in place) and the plain baseline.

File order follows the data: norms -> RoPE -> attention -> dense MLP -> MoE -> Block -> depth layouts
(the execution plan) -> ModelConfig -> the model (forward, generate, num_params) -> loading a checkpoint.
"""

import json
import math
import os
from dataclasses import asdict, dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

NORM_EPS = 1e-6
BALANCE_LOSS_COEF = 0.01  # weight of the Switch load-balancing loss
Z_LOSS_COEF = 0.001  # weight of the router z-loss (ST-MoE)
CE_CHUNK = 2 ** 27  # logits per chunk of the eager loss (512 MiB in fp32; each chunk costs the host ~0.5 ms)
MAX_PASSES = 64  # 4 x the 16 test-time passes the papers go to
FLEX_DEVICES = ("cuda",)  # FlexAttention with a block mask here; elsewhere SDPA with a boolean mask
#   (FlexAttention has no backward on a CPU; a test adds "cpu" to compare the two paths)


# ----------------------------------------------------------------------------------------------------
# Norms and RoPE


class RMSNorm(nn.Module):
    def __init__(self, dim, gain=True):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim)) if gain else None  # [X] Table 1 trains without gains

    def forward(self, x):
        weight = self.weight if self.weight is None else self.weight.to(x.dtype)
        return F.rms_norm(x, (x.size(-1),), weight, NORM_EPS)


def rope_tables(head_dim, max_len, base=10000.0):
    """cos/sin tables (max_len, head_dim / 2) for rotary position embeddings."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    """Rotate the pairs (x1, x2) of the two halves of the head dimension. x: (B, H, T, D)."""
    d = x.size(-1) // 2
    x1, x2 = x[..., :d], x[..., d:]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat([x1 * cos + x2 * sin, x2 * cos - x1 * sin], dim=-1)


# ----------------------------------------------------------------------------------------------------
# Attention: GQA with head_dim independent of the width, optional QK-norm, document mask, KV cache


def document_ids(idx, eot_token):
    """The document of every position: each eot token starts a new document (it acts as BOS) [S]."""
    return (idx == eot_token).cumsum(dim=1)


def attention_mask(q_docs, k_docs, q_start):
    """Boolean mask (B, 1, Tq, Tk): causal, and never across a document boundary."""
    q_pos = torch.arange(q_start, q_start + q_docs.size(1), device=q_docs.device)
    k_pos = torch.arange(k_docs.size(1), device=q_docs.device)
    causal = k_pos[None, :] <= q_pos[:, None]
    return (causal[None] & (q_docs[:, :, None] == k_docs[:, None, :]))[:, None]


def flex_block_mask(docs):
    """The same document mask as a FlexAttention BlockMask: fully masked blocks are skipped."""
    from torch.nn.attention.flex_attention import create_block_mask

    def causal_same_document(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (docs[b, q_idx] == docs[b, kv_idx])

    B, T = docs.shape  # eager CUDA compiles the mask's construction; inside a compiled model dynamo traces
    #   it as it is (_compile=True would call warnings.warn, a graph break)
    compile_mask = docs.is_cuda and not torch.compiler.is_compiling()
    return create_block_mask(causal_same_document, B, None, T, T, device=docs.device, _compile=compile_mask)


_compiled_flex = None


def flex_attention(q, k, v, block_mask):
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention as flex
    if q.is_cuda and not torch.compiler.is_compiling():  # eager: compiled once, the fused kernel
        _compiled_flex = _compiled_flex or torch.compile(flex, dynamic=False)
        flex = _compiled_flex
    return flex(q, k, v, block_mask=block_mask, enable_gqa=k.size(1) != q.size(1))


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, int(cfg.n_kv_head), int(cfg.head_dim)
        self.q_proj = nn.Linear(cfg.n_embd, cfg.n_head * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.n_embd, cfg.n_kv_head * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.n_embd, cfg.n_kv_head * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_head * cfg.head_dim, cfg.n_embd, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_gain) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_gain) if cfg.qk_norm else None

    def qkv(self, x, ctx):
        """Queries (B, n_head, T, head_dim), keys and values (B, n_kv_head, T, head_dim), rotated."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:  # QK-norm before RoPE (the same as after it when norms have no gain);
            #   CUDA autocast runs rms_norm in fp32 (CPU's does not): q and k come back to v's dtype
            q, k = self.q_norm(q).to(v.dtype), self.k_norm(k).to(v.dtype)
        return apply_rope(q, ctx.cos, ctx.sin), apply_rope(k, ctx.cos, ctx.sin), v

    def forward(self, x, ctx):
        B, T, _ = x.shape
        q, k, v = self.qkv(x, ctx)
        if ctx.cache is not None:  # one cache entry per *executed* block: each visit has its own
            k, v = ctx.cache.update(ctx.attention_calls, k, v)
            ctx.attention_calls += 1
        y = sdpa(q, k, v, ctx.mask) if ctx.block_mask is None else flex_attention(q, k, v, ctx.block_mask)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim))


def sdpa(q, k, v, mask, block=128):
    """SDPA under a document mask (None: causal), `block` queries at a time, each with the keys up to its last
    query only: SDPA skips the keys past the diagonal under is_causal alone, never under a mask (on a CPU at
    1,024 tokens the blocks take 0.6x the time of one call, docs/efficiency.md)."""
    gqa, ys = k.size(1) != q.size(1), []
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    for i in range(0, q.size(2), block):
        keys = k.size(2) - q.size(2) + i + block  # the cached keys, then those up to the block's last query
        ys.append(F.scaled_dot_product_attention(q[:, :, i:i + block], k[:, :, :keys], v[:, :, :keys],
                                                 attn_mask=mask[..., i:i + block, :keys], enable_gqa=gqa))
    return torch.cat(ys, dim=2)


# ----------------------------------------------------------------------------------------------------
# Feed-forward: dense SwiGLU, and a truly sparse MoE of fine-grained SwiGLU experts


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.w_gate = nn.Linear(cfg.n_embd, cfg.mlp_hidden, bias=False)
        self.w_up = nn.Linear(cfg.n_embd, cfg.mlp_hidden, bias=False)
        self.w_down = nn.Linear(cfg.mlp_hidden, cfg.n_embd, bias=False)

    def forward(self, x):
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x)), None  # SwiGLU


class MoE(nn.Module):
    """Top-k routed fine-grained SwiGLU experts, dropless. n_expert == top_k is [S1]'s fully activated
    reference."""

    def __init__(self, cfg):
        super().__init__()
        self.n_expert, self.top_k = cfg.n_expert, cfg.top_k
        self.router = nn.Linear(cfg.n_embd, cfg.n_expert, bias=False)
        # gate and up stacked (E, 2, hidden, n_embd): one grouped GEMM for both, and still two matrices
        # per expert to Muon (it orthogonalises each (hidden, n_embd) alone) and to the init
        self.w_gate_up = nn.Parameter(torch.empty(cfg.n_expert, 2, cfg.expert_hidden, cfg.n_embd))
        self.w_down = nn.Parameter(torch.empty(cfg.n_expert, cfg.n_embd, cfg.expert_hidden))

    def forward(self, x):
        shape = x.shape  # x cast once to the matmuls' dtype: the router and the experts read one copy,
        x = x.reshape(-1, shape[-1]).to(compute_dtype(x.device.type, x.dtype))  # and out comes in it
        # 1. route: each token picks its top_k experts; their weights renormalised to sum to 1 (Mixtral)
        logits = self.router(x).float()
        probs = logits.softmax(dim=-1)
        weights, expert_ids = probs.topk(self.top_k, dim=-1)  # (N, k)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        # 2. sort the N * k (token, expert) assignments by expert: each expert's rows are contiguous
        order = expert_ids.flatten().argsort(stable=True)
        token_of, weight_of = order // self.top_k, weights.flatten()[order]
        counts = torch.zeros(self.n_expert, dtype=torch.long, device=x.device).index_add_(
            0, expert_ids.flatten(), torch.ones_like(order))  # a bincount without a host read
        # 3. the experts as grouped GEMMs over their own rows, 4. scattered back to their tokens
        out = self.experts(x, token_of, counts, weight_of)
        # the load-balancing loss (Switch: E * sum_e f_e P_e, 1 for a uniform router) and the z-loss
        fraction = counts.float() / (x.size(0) * self.top_k)
        balance = self.n_expert * (fraction * probs.mean(dim=0)).sum()
        z_loss = torch.logsumexp(logits, dim=-1).square().mean()
        router = dict(balance=balance, z_loss=z_loss, counts=counts.detach(),
                      expert_ids=expert_ids.view(*shape[:-1], self.top_k))  # (probe.py reads the ids)
        return out.view(shape), router

    def experts(self, x, token_of, counts, weight_of):
        return run_experts(x, token_of, counts, self.w_gate_up, self.w_down, weight_of)


def run_experts(x, token_of, counts, w_gate_up, w_down, row_weights=None):
    """Expert e owns the sorted rows [offs[e-1], offs[e]): each row copies its token of x, runs the
    expert's SwiGLU (its hidden activation scaled by the row's router weight) and is added back to its
    token. In autocast's dtype when it is on (x cast once, before the gather; summed back in that dtype:
    on a CPU one rounding of the result, as a dense layer's output), else in x's; the result in x's dtype."""
    dtype = compute_dtype(x.device.type, x.dtype)
    if x.is_cuda and dtype != torch.bfloat16:  # F.grouped_mm in others: a host read, a matmul per expert
        raise ValueError("an MoE on CUDA runs its experts in bf16: call the model under "
                         "torch.autocast('cuda', dtype=torch.bfloat16)")
    offs = counts.cumsum(0).int()
    n_embd, unit = x.size(1), 16 // dtype.itemsize  # grouped GEMM rows must be 16-byte aligned: zero
    e, h = -n_embd % unit, -w_down.size(2) % unit  # columns pad them (exact, and none in most shapes)
    pad = lambda t, p: F.pad(t, p) if any(p) else t  # noqa: E731 (F.pad would copy)
    rows = pad(x.to(dtype), (0, e)).index_select(0, token_of)
    gate_up = pad(w_gate_up, (0, e, 0, h)).to(dtype).flatten(1, 2).transpose(-2, -1)  # (E, n_embd, 2 hidden)
    down = pad(w_down, (0, h, 0, e)).to(dtype).transpose(-2, -1)
    gate, up = grouped_mm(rows, gate_up, offs).chunk(2, dim=1)
    h = F.silu(gate) * up
    if row_weights is not None:
        h = h * row_weights.unsqueeze(1).to(h.dtype)
    y = grouped_mm(h, down, offs)[:, :n_embd]
    # scatter_add_, as torchtitan: index_add_'s backward would keep y, the largest activation, for its shape
    rows_of = token_of.unsqueeze(1).expand_as(y)
    return x.new_zeros(x.shape, dtype=dtype).scatter_add_(0, rows_of, y).to(x.dtype)


def compute_dtype(device_type, dtype):
    """The dtype matmuls run in: autocast's when it is on, else dtype."""
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else dtype


def grouped_mm(a, b, offs):
    """Row group g of a times b[g]: one dropless grouped GEMM (torchtitan's MoE kernel on CUDA in bf16;
    a loop of matmuls inside on a CPU), never a host read. Other dtypes go through a custom op, because
    torch.compile knows F.grouped_mm's output shape only in bf16."""
    return GROUPED_MM(a, b, offs=offs) if a.dtype == torch.bfloat16 else _grouped_mm_op(a, b, offs)


GROUPED_MM = getattr(F, "grouped_mm", None) or torch._grouped_mm  # an older torch has only the private one


@torch.library.custom_op(f"{__name__.replace('.', '_')}::grouped_mm", mutates_args=())
def _grouped_mm_op(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return GROUPED_MM(a, b, offs=offs)


@_grouped_mm_op.register_fake
def _(a, b, offs):  # (N, h) from a 3-D b; the stacked per-group products (G, d, h) from a 2-D b
    if b.dim() == 3:
        return a.new_empty(a.size(0), b.size(-1))
    return a.new_empty(offs.size(0), a.size(0), b.size(1))


def _grouped_mm_backward(ctx, grad):
    a, b, offs = ctx.saved_tensors
    grad = grad.contiguous()  # F.grouped_mm's fp32 backward fails on an expanded (stride-0) gradient
    return grouped_mm(grad, b.transpose(-2, -1), offs), grouped_mm(grad.t(), a, offs).transpose(-2, -1), None


_grouped_mm_op.register_autograd(_grouped_mm_backward,
                                 setup_context=lambda ctx, inputs, output: ctx.save_for_backward(*inputs))


def cross_entropy(logits, targets):
    """Mean cross-entropy in fp32 over the targets that are not -1, with no fp32 copy of all the logits kept.
    Eager, past CE_CHUNK logits: chunks of tokens, each one's fp32 copy recomputed in the backward. Compiled:
    one loss, the cast fused into its reductions (Inductor compiles 98 chunks ~20x slower than one)."""
    logits, targets = logits.flatten(0, -2), targets.reshape(-1)
    rows = max(1, CE_CHUNK // logits.size(1))
    if torch.compiler.is_compiling() or logits.size(0) <= rows:
        return F.cross_entropy(logits.float(), targets, ignore_index=-1)
    chunk = lambda x, t: F.cross_entropy(x.float(), t, ignore_index=-1, reduction="sum")  # noqa: E731
    total = sum(checkpoint(chunk, x, t, use_reentrant=False)
                for x, t in zip(logits.split(rows), targets.split(rows)))
    return total / (targets != -1).sum()


# ----------------------------------------------------------------------------------------------------
# Block: pre-norm attention + FFN, both updates scaled


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.norm1 = RMSNorm(cfg.n_embd, cfg.norm_gain)
        self.attn = Attention(cfg)
        self.norm2 = RMSNorm(cfg.n_embd, cfg.norm_gain)
        self.ffn = MoE(cfg) if cfg.n_expert > 0 else MLP(cfg)
        self.residual_multiplier = cfg.residual_multiplier  # [X] RM on attention-out and MLP-down

    def forward(self, x, scale, ctx):
        """-> (the new residual stream, the router's statistics or None)."""
        scale = scale * self.residual_multiplier
        h = x + scaled(self.attn(self.norm1(x), ctx), scale)  # [S8] attention write scaled by 1/r
        ffn_out, router = self.ffn(self.norm2(h))  # [S9] the FFN sees the scaled attention write
        return h + scaled(ffn_out, scale), router  # [S9] FFN write scaled by 1/r


def scaled(x, scale):
    return x if scale == 1.0 else scale * x  # no copy when the scale is 1


class BoundaryOperator(nn.Module):
    """[X3] BO(h, e) = RMSNorm(h) + alpha * e; each boundary of the plan says what it applies."""

    def __init__(self, cfg):
        super().__init__()
        norms = cfg.layout.startswith("pcc") and cfg.boundary in ("both", "norm")
        self.norm = RMSNorm(cfg.n_embd, cfg.norm_gain) if norms else None
        self.alpha = cfg.boundary_alpha

    def forward(self, h, e, norm=True, inject=True):
        h = self.norm(h) if norm else h
        return h + self.alpha * e if inject else h


# ----------------------------------------------------------------------------------------------------
# Depth layouts: the execution plan is the one place that says which block runs when


@dataclass(frozen=True)
class Step:
    """kind "block": run blocks[block] (its `visit`-th execution), both updates scaled by `scale`;
    "anchor": the prelude is done, remember its output e; "boundary": h <- BO(h, e) [X3]."""
    kind: str
    block: int = -1
    visit: int = 0
    scale: float = 1.0
    norm: bool = False
    inject: bool = False


def execution_plan(cfg, n_passes=None):
    """The steps of one forward pass. n_passes overrides K (prelude-core-coda) or r (the loops) for this
    plan only: test-time passes, random passes per step, growth."""
    k = cfg.n_passes if n_passes is None else n_passes
    if not 1 <= k <= cfg.most_passes:
        raise ValueError(f"n_passes={k}: this model runs 1 to {cfg.most_passes} passes")
    # [S8]-[S9]: every update inside the loop scaled by 1/r (the [X] code scales none: loop_scale "auto")
    by_passes = cfg.loop_scale == "1/r" or cfg.loop_scale == "auto" and not cfg.layout.startswith("pcc")
    scale = 1.0 / k if by_passes else 1.0
    if cfg.layout == "plain":
        return [Step("block", i, 1) for i in range(cfg.n_layer)]
    if cfg.layout in ("smelt", "layer_loop"):
        start, stop = cfg.loop_start, cfg.loop_start + cfg.loop_span
        span = range(start, stop)
        if cfg.layout == "smelt":  # [S] model-loop: the whole span r times
            loop = [Step("block", i, v, scale) for v in range(1, k + 1) for i in span]
        else:  # layer-loop: each layer r times in place before the next
            loop = [Step("block", i, v, scale) for i in span for v in range(1, k + 1)]
        return ([Step("block", i, 1) for i in range(start)] + loop +
                [Step("block", i, 1) for i in range(stop, cfg.n_layer)])
    # prelude-core-coda [X1]-[X2]: the first pass sees the prelude output e (the [X] code's h0)
    P, C, D = core_split(cfg.n_layer)
    boundary = Step("boundary", norm=cfg.boundary in ("both", "norm"),
                    inject=cfg.boundary in ("both", "inject"))
    plan = [Step("block", i, 1) for i in range(P)] + [Step("anchor")]
    for p in range(k):
        first = P if cfg.tie_core else P + p * C
        plan += [boundary] if p else []  # [X3] before every later core pass
        plan += [Step("block", first + j, p + 1 if cfg.tie_core else 1, scale) for j in range(C)]
    coda = P + (C if cfg.tie_core else cfg.n_passes * C)
    return plan + [boundary] + [Step("block", coda + j, 1) for j in range(D)]  # [X3] before the coda too


def core_split(depth):
    """[X] even split of `depth` blocks into prelude/core/coda, the remainder first to core, then coda."""
    base, rest = divmod(depth, 3)
    return base, base + (rest >= 1), base + (rest >= 2)


# ----------------------------------------------------------------------------------------------------
# Config: the one source of truth of a shape (match.py reads it analytically)


class Derived(int):
    """A size derived from others (given as 0): dataclasses.replace() derives it again from the new ones.
    The model reads it as int() outside forward: torch.compile breaks on an int subclass (and int() of it)."""


def derive(given, value, unset=0):
    return Derived(value) if given == unset or isinstance(given, Derived) else given


@dataclass
class ModelConfig:
    vocab_size: int = 4096  # embedding rows: the data's vocabulary, padded ([X]: 50257 -> 50304)
    block_size: int = 256  # the context length
    eot_token: int = -1  # each eot starts a new document; -1 -> vocab_size - 1 (train.py: the data's)
    n_logits: int = 0  # logits kept before the softmax: a padded vocabulary's real size; 0 -> all
    n_layer: int = 4  # physical depth L (SMELT, layer-loop, plain) or nominal depth P+C+D (pcc)
    n_embd: int = 128  # width of the residual stream
    n_head: int = 4  # query heads
    n_kv_head: int = 0  # key/value heads (GQA); 0 -> n_head
    head_dim: int = 0  # 0 -> n_embd // n_head; independent of n_embd ([S] matches the KV cache by it)
    mlp_hidden: int = 0  # dense SwiGLU width; 0 -> 8/3 n_embd rounded up to a multiple of 256 ([X] code),
    #   of 8 below a width of 512 (a miniature keeps its 8/3)
    n_expert: int = 0  # experts per MoE layer; 0 -> a dense SwiGLU FFN
    top_k: int = 8  # experts each token is routed to
    expert_hidden: int = 0  # 0 -> mlp_hidden // top_k (fine-grained experts)
    layout: str = "plain"  # plain | smelt (middle half looped) | layer_loop | pcc (tied core) | pcc_untied
    n_passes: int = 1  # K core passes (pcc) or r runs of the loop span (smelt, layer_loop)
    boundary: str = "both"  # boundary operator [X3]: both | norm | inject | none
    boundary_alpha: float = 1.0  # alpha of BO(h, e) = RMSNorm(h) + alpha * e [X3]
    norms: str = "pre"  # pre: RMSNorm with gains | x: [X] Table 1 (no gains, QK-norm, a norm after wte)
    document_mask: bool = True  # attention never crosses an eot boundary [S]
    residual_multiplier: float = 1.0  # [X] RM on attention-out and MLP-down
    loop_scale: str = "auto"  # updates inside a loop: "1/r" [S8], "1", or auto (smelt, layer_loop 1/r; pcc 1)
    output_multiplier: float = 1.0  # [X] OM on the logits
    init: str = "x"  # x: zero out-projections and lm head, normal wte, uniform inputs; nanogpt: tied wte
    embed_init_std: float = 0.02  # std of the token embedding ('x' init)
    uniform_init_scale: float = 3 ** 0.5  # U(-s, s), s = uniform_init_scale / sqrt(n_embd) ('x' init)

    def __post_init__(self):
        self.eot_token = derive(self.eot_token, self.vocab_size - 1, unset=-1)
        self.n_kv_head = derive(self.n_kv_head, self.n_head)
        self.head_dim = derive(self.head_dim, self.n_embd // max(self.n_head, 1))
        multiple = 256 if self.n_embd >= 512 else 8  # the [X] code's 256; 8 keeps a miniature's 8/3
        self.mlp_hidden = derive(self.mlp_hidden, multiple * math.ceil(8 * self.n_embd / 3 / multiple))
        self.expert_hidden = derive(self.expert_hidden, max(1, self.mlp_hidden // max(self.top_k, 1)))
        sizes = ("vocab_size", "block_size", "n_layer", "n_embd", "n_head")
        small = [n for n in sizes if getattr(self, n) < 1]
        rules = [  # (holds, the setting, why): the first that fails is the error
            (not small, (small or ["n_layer"])[0], "must be >= 1"),
            (self.n_kv_head >= 1 and self.n_head % self.n_kv_head == 0, "n_kv_head", "must divide n_head"),
            (self.head_dim >= 2 and self.head_dim % 2 == 0, "head_dim", "must be even (RoPE rotates pairs)"),
            (self.n_expert == 0 or 1 <= self.top_k <= self.n_expert, "top_k", "must be in [1, n_expert]"),
            (self.layout in ("plain", "smelt", "layer_loop", "pcc", "pcc_untied"), "layout",
             "must be plain, smelt, layer_loop, pcc or pcc_untied"),
            (1 <= self.n_passes <= MAX_PASSES, "n_passes", f"must be in [1, {MAX_PASSES}]"),
            (self.loop_span >= 1 or self.layout not in ("smelt", "layer_loop"), "n_layer",
             "a loop needs n_layer >= 2"),
            (core_split(self.n_layer)[1] >= 1 or not self.layout.startswith("pcc"), "n_layer",
             "prelude-core-coda needs n_layer >= 1"),
            (self.boundary in ("both", "norm", "inject", "none"), "boundary",
             "must be both, norm, inject or none"),
            (self.norms in ("pre", "x"), "norms", "must be pre or x"),
            (self.init in ("x", "nanogpt"), "init", "must be x or nanogpt"),
            (self.loop_scale in ("auto", "1/r", "1"), "loop_scale", "must be auto, 1/r or 1"),
            (0 <= self.eot_token < self.vocab_size, "eot_token", "must be a token id below vocab_size"),
        ]
        for holds, name, why in rules:
            if not holds:
                raise ValueError(f"{name}={getattr(self, name)!r}: {why}")
        if self.layout == "plain":
            self.n_passes = 1

    tie_core = property(lambda self: self.layout != "pcc_untied")  # one set of core weights
    qk_norm = property(lambda self: self.norms == "x")  # [X] Table 1: RMSNorm on queries and keys
    embed_norm = property(lambda self: self.norms == "x")  # [X] Table 1: RMSNorm after the embedding
    norm_gain = property(lambda self: self.norms == "pre")  # learnable RMSNorm gains
    tie_embeddings = property(lambda self: self.init == "nanogpt")  # nanoGPT ties wte and the lm head
    loop_span = property(lambda self: self.n_layer // 2)  # [S]: the middle half, m = L / 2
    loop_start = property(lambda self: (self.n_layer - self.loop_span) // 2)  # prelude floor((L - m) / 2)

    @property
    def n_blocks(self):  # stored blocks: untied cores each have their own
        P, C, D = core_split(self.n_layer)
        return P + self.n_passes * C + D if not self.tie_core else self.n_layer

    @property
    def most_passes(self):  # an untied model has one core per trained pass
        return self.n_passes if not self.tie_core else MAX_PASSES

    def executed_layers(self, n_passes=None):
        return sum(step.kind == "block" for step in execution_plan(self, n_passes))

    def to_dict(self):  # plain ints: what a checkpoint or config.json stores
        return {k: int(v) if isinstance(v, Derived) else v for k, v in asdict(self).items()}


# the model `python train.py` trains where nothing else is said (train.py's and match.py's defaults)
TINY = dict(block_size=128, n_layer=4, n_embd=128, n_head=4, n_expert=8, top_k=2, expert_hidden=256,
            layout="smelt", n_passes=2)


# ----------------------------------------------------------------------------------------------------
# The model


@dataclass
class ForwardContext:
    """What one forward pass shares across its blocks."""
    cos: torch.Tensor
    sin: torch.Tensor
    mask: Optional[torch.Tensor]  # SDPA's additive document mask; None -> plain causal attention
    block_mask: object = None  # the same mask as a FlexAttention BlockMask (CUDA)
    cache: Optional["KVCache"] = None
    attention_calls: int = 0  # the blocks run so far, when a KV cache is filled


class KVCache:
    """Keys and values of every executed block (a looped layer has one entry per visit), and the
    document ids of the cached positions."""

    def __init__(self):
        self.keys, self.values, self.doc_ids = [], [], None

    def update(self, i, k, v):
        if i == len(self.keys):
            self.keys.append(k)
            self.values.append(v)
        else:
            self.keys[i] = torch.cat([self.keys[i], k], dim=2)
            self.values[i] = torch.cat([self.values[i], v], dim=2)
        return self.keys[i], self.values[i]


class GPT(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = cfg = config
        self.eot_token = int(cfg.eot_token)  # a plain int for forward (see Derived)
        # Built on the meta device, then drawn by reset_parameters alone on the default device: nn.Linear's
        # own init would spend random numbers that a meta-built, sharded model (train.py's FSDP2) never
        # spends. So one seed gives one set of weights whatever the parallelism.
        device = torch.get_default_device()
        with torch.device("meta"):
            self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
            self.embed_norm = RMSNorm(cfg.n_embd, cfg.norm_gain) if cfg.embed_norm else None
            self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_blocks))
            self.boundary = BoundaryOperator(cfg)  # [X3]
            self.norm_f = RMSNorm(cfg.n_embd, cfg.norm_gain)
            self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
            self.register_buffer("rope_cos", torch.empty(cfg.block_size, cfg.head_dim // 2), persistent=False)
            self.register_buffer("rope_sin", torch.empty(cfg.block_size, cfg.head_dim // 2), persistent=False)
        if device.type != "meta":
            self.to_empty(device=device)
        if cfg.tie_embeddings:  # after to_empty, which would untie them
            self.lm_head.weight = self.wte.weight
        self.plan = execution_plan(cfg)
        # an attribute, so that train.compile_blocks can swap in its compiled loss
        self.cross_entropy = cross_entropy
        self.activation_checkpointing = False  # recompute each executed block in the backward
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        """Every parameter and buffer from scratch. A sharded parameter (FSDP2's DTensor: train.py builds a
        sharded model on the meta device, then materialises it) is drawn whole, one at a time, and cut to
        this process's shard: the same weights on any number of processes."""
        cos, sin = rope_tables(self.config.head_dim, self.config.block_size)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)
        for name, p in self.named_parameters():
            if hasattr(p, "device_mesh"):  # a DTensor
                from torch.distributed.tensor import distribute_tensor
                whole = self.init_parameter(name, torch.empty(p.shape, dtype=p.dtype, device=p.device))
                p.copy_(distribute_tensor(whole, p.device_mesh, p.placements, src_data_rank=None))
            else:
                self.init_parameter(name, p)

    def init_parameter(self, name, w):
        """Draw parameter `name` into w in place (and return it)."""
        cfg = self.config
        out = name.endswith(("o_proj.weight", "w_down.weight", "w_down"))  # the writes to the residual stream
        if w.dim() < 2:  # RMSNorm gains
            return nn.init.ones_(w)
        if w.dim() == 4:  # an MoE's stacked gate and up: drawn as two (E, hidden, n_embd), gate first
            halves = [torch.empty(w[:, 0].shape, dtype=w.dtype, device=w.device) for _ in range(2)]
            return w.copy_(torch.stack([self.init_parameter(name, half) for half in halves], 1))
        if cfg.init == "nanogpt":  # normal(0.02), out-projections scaled down with the executed depth
            return nn.init.normal_(w, std=0.02 / math.sqrt(2 * cfg.executed_layers()) if out else 0.02)
        if name == "wte.weight":  # [X]: a normal embedding, zero out-projections and head, uniform inputs
            return nn.init.normal_(w, std=cfg.embed_init_std)
        if out or name == "lm_head.weight":
            return nn.init.zeros_(w)
        bound = cfg.uniform_init_scale / math.sqrt(cfg.n_embd)
        return nn.init.uniform_(w, -bound, bound)

    def forward(self, idx, targets=None, n_passes=None, cache=None, return_stats=False):
        """idx (B, T) -> (logits, loss or None) [, stats {"ce", and for an MoE "balance", "z_loss",
        "expert_counts"}]. targets -1 are ignored. n_passes overrides K or r for this call (test-time
        passes). cache: a KVCache; idx then continue the cached tokens."""
        cfg = self.config
        B, T = idx.shape
        start = 0 if cache is None or cache.doc_ids is None else cache.doc_ids.size(1)  # the cached tokens
        if start + T > cfg.block_size:
            raise ValueError(f"sequence length {start + T} exceeds block_size={cfg.block_size}")
        # the document mask [S], always built (asking whether a batch holds an eot would read the host)
        docs = document_ids(idx, self.eot_token) if cfg.document_mask else torch.zeros_like(idx)
        mask = block_mask = None
        if cache is not None:  # the new tokens' documents continue the cached ones
            docs = docs + (cache.doc_ids[:, -1:] if cache.doc_ids is not None else 0)
            cache.doc_ids = docs if cache.doc_ids is None else torch.cat([cache.doc_ids, docs], dim=1)
            mask = attention_mask(docs, cache.doc_ids, start)
        elif cfg.document_mask and idx.device.type in FLEX_DEVICES:
            block_mask = flex_block_mask(docs)
        elif cfg.document_mask:
            mask = attention_mask(docs, docs, 0)
        if mask is not None:  # additive, built once and shared by every block (SDPA would convert it in each)
            dtype = compute_dtype(idx.device.type, self.wte.weight.dtype)
            mask = torch.zeros(mask.shape, dtype=dtype, device=idx.device).masked_fill_(~mask, float("-inf"))
        rope = self.rope_cos[start:start + T], self.rope_sin[start:start + T]
        ctx = ForwardContext(*rope, mask, block_mask, cache)

        h = self.wte(idx)
        if self.embed_norm is not None:
            h = self.embed_norm(h)
        anchor, routers = None, []
        for step in self.plan if n_passes is None else execution_plan(cfg, n_passes):
            if step.kind == "block":
                block = self.blocks[step.block]
                if self.activation_checkpointing and torch.is_grad_enabled():  # keep only the block's input
                    h, router = checkpoint(block, h, step.scale, ctx, use_reentrant=False)
                else:
                    h, router = block(h, step.scale, ctx)
                routers.append(router)
            elif step.kind == "anchor":  # e: the prelude's output
                anchor = h
            else:  # [X3] BO(h, e) = RMSNorm(h) + alpha * e
                h = self.boundary(h, anchor, step.norm, step.inject)
        logits = scaled(self.lm_head(self.norm_f(h)), cfg.output_multiplier)  # [X] OM on the unembedding
        if cfg.n_logits:  # a padded vocabulary's extra rows are cut before the softmax ([X] code)
            logits = logits[..., :cfg.n_logits]
        loss, stats = None, {}
        if targets is not None:
            ce = self.cross_entropy(logits, targets)
            loss, stats = ce, {"ce": ce.detach()}
            routers = [r for r in routers if r is not None]
            if routers:
                balance = torch.stack([r["balance"] for r in routers]).mean()
                z_loss = torch.stack([r["z_loss"] for r in routers]).mean()
                loss = ce + BALANCE_LOSS_COEF * balance + Z_LOSS_COEF * z_loss
                stats.update(balance=balance.detach(), z_loss=z_loss.detach(),
                             expert_counts=torch.stack([r["counts"] for r in routers]))
        return (logits, loss, stats) if return_stats else (logits, loss)

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, n_passes=None, generator=None):
        """Sample max_new_tokens after idx (B, T) with a KV cache; temperature 0 is greedy."""
        if idx.size(1) + max_new_tokens > self.config.block_size:
            raise ValueError(f"prompt ({idx.size(1)}) + max_new_tokens ({max_new_tokens}) exceeds "
                             f"block_size={self.config.block_size}")
        cache = KVCache()
        logits, _ = self(idx, n_passes=n_passes, cache=cache)
        for _ in range(max_new_tokens):
            last = logits[:, -1, :].float()
            if temperature == 0:
                next_token = last.argmax(dim=-1, keepdim=True)
            else:
                last = last / temperature
                if top_k is not None:
                    kth = torch.topk(last, min(top_k, last.size(-1))).values[:, -1:]
                    last = last.masked_fill(last < kth, float("-inf"))
                next_token = torch.multinomial(last.softmax(dim=-1), 1, generator=generator)
            idx = torch.cat([idx, next_token], dim=1)
            logits, _ = self(next_token, n_passes=n_passes, cache=cache)
        return idx

    def num_params(self):
        """embedding (wte + an untied lm head), non_embedding, total, and active: the non-embedding
        parameters one token touches (top_k experts of each MoE, each stored block it runs, once)."""
        total = sum(p.numel() for p in self.parameters())
        head = 0 if self.config.tie_embeddings else self.lm_head.weight.numel()
        embedding = self.wte.weight.numel() + head
        used = {s.block for s in self.plan if s.kind == "block"}
        inactive = 0
        for i, block in enumerate(self.blocks):
            if i not in used:
                inactive += sum(p.numel() for p in block.parameters())
            elif isinstance(block.ffn, MoE):
                inactive += (block.ffn.n_expert - block.ffn.top_k) * 3 * block.ffn.w_down[0].numel()
        return dict(embedding=embedding, non_embedding=total - embedding, total=total,
                    active=total - embedding - inactive)


def load_checkpoint(path, device="cpu"):
    """(model, info) from a train.py ckpt.pt, read with weights_only=True (no pickled code runs), or an
    export folder (model.safetensors + config.json). info: the checkpoint without its weights."""
    import pickle
    if not os.path.exists(path):
        raise FileNotFoundError(f"no checkpoint at {path}")
    if os.path.isdir(path):
        from safetensors.torch import load_model
        with open(os.path.join(path, "config.json")) as f:
            info = json.load(f)
        model = GPT(ModelConfig(**info["model_config"]))
        load_model(model, os.path.join(path, "model.safetensors"))
        return model.to(device), info
    try:
        info = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError) as e:  # not a checkpoint, or one holding code
        reason = str(e).splitlines()[0][:80]
        raise ValueError(f"{path}: not a checkpoint of tensors and plain data ({reason})") from None
    info.setdefault("step", (info.get("state") or {}).get("step"))
    model = GPT(ModelConfig(**info["model_config"]))
    model.load_state_dict(info.pop("model"))
    return model.to(device), info
