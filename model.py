"""
Every architecture of both studies in one file that needs only torch: copy it alone.

  [S] SMELT: an MoE transformer whose middle half runs r times, every update inside
      the loop scaled by 1/r ([S8]-[S9]).
  [X] prelude-core-coda: P prelude blocks, a core of C blocks run K times (tied or
      untied), D coda blocks, and BO(h, e) = RMSNorm(h) + alpha * e between ([X1]-[X3]).
  Plus the layer-loop (each layer r times in place) and the plain baseline.

MoE, and the looped stack (Block, Step, execution_plan, core_split), also work copied
alone with a short config.
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
# Logits per chunk of the eager loss (512 MiB in fp32).
CE_CHUNK = 2**27
# 4 x the 16 test-time passes the papers go to.
MAX_PASSES = 64
# FlexAttention runs here, SDPA with a boolean mask elsewhere. It has no backward on a
# CPU; a test adds "cpu" to compare the two paths.
FLEX_DEVICES = ("cuda",)


# Norms and RoPE


class RMSNorm(nn.Module):
    def __init__(self, dim, gain=True):
        super().__init__()
        # [X] Table 1 trains without gains.
        self.weight = nn.Parameter(torch.ones(dim)) if gain else None

    def forward(self, x):
        weight = self.weight if self.weight is None else self.weight.to(x.dtype)
        return F.rms_norm(x, (x.size(-1),), weight, NORM_EPS)


def rope_tables(head_dim, max_len, base=10000.0):
    """cos/sin tables (max_len, head_dim / 2) for rotary position embeddings."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
    inv_freq = 1.0 / (base**exponents)
    angles = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    """x (B, H, T, D) rotated by the tables' angles."""
    # The pair (x_i, x_{i + D/2}) turns by p theta_i at position p.
    d = x.size(-1) // 2
    x1, x2 = x[..., :d], x[..., d:]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat([x1 * cos + x2 * sin, x2 * cos - x1 * sin], dim=-1)


# Attention: GQA, QK-norm, document mask, KV cache


def document_ids(idx, eot_token):
    """The document of each position: an eot token starts one, as a BOS [S]."""
    return (idx == eot_token).cumsum(dim=1)


def attention_mask(q_docs, k_docs, q_start):
    """Boolean mask (B, 1, Tq, Tk): causal, and never across a document boundary."""
    q_pos = torch.arange(q_start, q_start + q_docs.size(1), device=q_docs.device)
    k_pos = torch.arange(k_docs.size(1), device=q_docs.device)
    causal = k_pos[None, :] <= q_pos[:, None]
    same_doc = q_docs[:, :, None] == k_docs[:, None, :]
    return (causal[None] & same_doc)[:, None]


def flex_block_mask(docs):
    """The document mask as a FlexAttention BlockMask."""
    from torch.nn.attention.flex_attention import create_block_mask

    def causal_same_document(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (docs[b, q_idx] == docs[b, kv_idx])

    B, T = docs.shape
    # Eager CUDA compiles the mask builder; compiled, _compile=True would break the graph.
    compile_mask = docs.is_cuda and not torch.compiler.is_compiling()
    return create_block_mask(
        causal_same_document, B, None, T, T, device=docs.device, _compile=compile_mask
    )


_compiled_flex = None


def flex_attention(q, k, v, block_mask):
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention as flex

    # Eager CUDA compiles the fused kernel once.
    if q.is_cuda and not torch.compiler.is_compiling():
        _compiled_flex = _compiled_flex or torch.compile(flex, dynamic=False)
        flex = _compiled_flex
    gqa = k.size(1) != q.size(1)
    return flex(q, k, v, block_mask=block_mask, enable_gqa=gqa)


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_head = cfg.n_head
        self.n_kv_head, self.head_dim = int(cfg.n_kv_head), int(cfg.head_dim)
        q_dim, kv_dim = cfg.n_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim
        self.q_proj = nn.Linear(cfg.n_embd, q_dim, bias=False)
        self.k_proj = nn.Linear(cfg.n_embd, kv_dim, bias=False)
        self.v_proj = nn.Linear(cfg.n_embd, kv_dim, bias=False)
        self.o_proj = nn.Linear(q_dim, cfg.n_embd, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_gain) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_gain) if cfg.qk_norm else None

    def qkv(self, x, ctx):
        """Rotated q (B, n_head, T, head_dim), k and v (B, n_kv_head, T, head_dim)."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            # QK-norm before RoPE: the same as after it without gains.
            # CUDA autocast runs rms_norm in fp32 (CPU's does not): back to v's dtype.
            q, k = self.q_norm(q).to(v.dtype), self.k_norm(k).to(v.dtype)
        return apply_rope(q, ctx.cos, ctx.sin), apply_rope(k, ctx.cos, ctx.sin), v

    def forward(self, x, ctx):
        B, T, _ = x.shape
        q, k, v = self.qkv(x, ctx)
        if ctx.cache is not None:
            # One cache entry per executed block: each visit has its own.
            k, v = ctx.cache.update(ctx.attention_calls, k, v)
            ctx.attention_calls += 1
        if ctx.block_mask is None:
            y = sdpa(q, k, v, ctx.mask)
        else:
            y = flex_attention(q, k, v, ctx.block_mask)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim))


def sdpa(q, k, v, mask, block=128):
    """SDPA under a document mask (None: causal), `block` queries at a time.

    Each block sees the keys up to its last query: SDPA skips the keys past the diagonal
    under is_causal alone, never under a mask (docs/efficiency.md).
    """
    gqa, ys = k.size(1) != q.size(1), []
    # No mask: one causal call.
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    for i in range(0, q.size(2), block):
        # The cached keys, then those up to the block's last query.
        keys = k.size(2) - q.size(2) + i + block
        y = F.scaled_dot_product_attention(
            q[:, :, i : i + block],
            k[:, :, :keys],
            v[:, :, :keys],
            attn_mask=mask[..., i : i + block, :keys],
            enable_gqa=gqa,
        )
        ys.append(y)
    return torch.cat(ys, dim=2)


# Feed-forward: dense SwiGLU, and a sparse MoE of small SwiGLU experts


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.w_gate = nn.Linear(cfg.n_embd, cfg.mlp_hidden, bias=False)
        self.w_up = nn.Linear(cfg.n_embd, cfg.mlp_hidden, bias=False)
        self.w_down = nn.Linear(cfg.mlp_hidden, cfg.n_embd, bias=False)

    def forward(self, x):
        # SwiGLU, and no router statistics.
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x)), None


class MoE(nn.Module):
    """Top-k routed fine-grained SwiGLU experts, dropless: (out, router statistics).

    n_expert == top_k is [S1]'s fully activated reference.
    """

    # Weights of the Switch balance loss and the ST-MoE router z-loss.
    balance_coef = 0.01
    z_loss_coef = 0.001

    def __init__(self, cfg):
        super().__init__()
        E, hidden, n_embd = cfg.n_expert, cfg.expert_hidden, cfg.n_embd
        self.n_expert, self.top_k = E, cfg.top_k
        self.router = nn.Linear(n_embd, E, bias=False)
        # Gate and up stacked: one grouped GEMM for both, yet two matrices to Muon.
        self.w_gate_up = nn.Parameter(torch.empty(E, 2, hidden, n_embd))
        self.w_down = nn.Parameter(torch.empty(E, n_embd, hidden))
        self.init_bound = cfg.uniform_init_scale / math.sqrt(n_embd)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        """The [X] init, as GPT's: uniform router, gate and up; a zero w_down."""

        def uniform(w):
            return nn.init.uniform_(w, -self.init_bound, self.init_bound)

        uniform(self.router.weight)
        self.draw_gate_up(self.w_gate_up, uniform)
        nn.init.zeros_(self.w_down)

    @staticmethod
    def draw_gate_up(w, draw):
        """Fill w (E, 2, hidden, n_embd) with draw(t) of gate, then of up."""
        # Each half is drawn contiguous, as two separate weights would be.
        halves = [draw(w.new_empty(w[:, 0].shape)) for _ in range(2)]
        return w.copy_(torch.stack(halves, 1))

    @classmethod
    def add_router_loss(cls, loss, balance, z_loss):
        """loss plus the weighted router losses (GPT passes their means over layers)."""
        return loss + cls.balance_coef * balance + cls.z_loss_coef * z_loss

    def forward(self, x):
        # Cast once: the router and the experts read one copy.
        shape = x.shape
        x = x.reshape(-1, shape[-1]).to(compute_dtype(x.device.type, x.dtype))
        # 1. Each token picks its top_k experts, weights renormalised to 1 (Mixtral).
        logits = self.router(x).float()
        probs = logits.softmax(dim=-1)
        weights, expert_ids = probs.topk(self.top_k, dim=-1)  # (N, k)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        # 2. Sort the N * k assignments by expert, each expert's rows contiguous.
        # The counts are a bincount without a host read.
        order = expert_ids.flatten().argsort(stable=True)
        token_of, weight_of = order // self.top_k, weights.flatten()[order]
        counts = torch.zeros(self.n_expert, dtype=torch.long, device=x.device)
        counts = counts.index_add_(0, expert_ids.flatten(), torch.ones_like(order))
        # 3. Grouped GEMMs over each expert's rows, 4. scattered back to the tokens.
        out = self.experts(x, token_of, counts, weight_of)
        # The Switch balance loss E * sum_e f_e P_e (1 if uniform), and the z-loss.
        fraction = counts.float() / (x.size(0) * self.top_k)
        balance = self.n_expert * (fraction * probs.mean(dim=0)).sum()
        z_loss = torch.logsumexp(logits, dim=-1).square().mean()
        router = dict(
            balance=balance,
            z_loss=z_loss,
            counts=counts.detach(),
            expert_ids=expert_ids.view(*shape[:-1], self.top_k),
        )
        return out.view(shape), router

    def experts(self, x, token_of, counts, weight_of):
        return run_experts(x, token_of, counts, self.w_gate_up, self.w_down, weight_of)


def run_experts(x, token_of, counts, w_gate_up, w_down, row_weights=None):
    """Expert e owns the sorted rows [offs[e-1], offs[e]).

    Each row copies its token of x, runs the expert's SwiGLU (the hidden activation
    times the row's router weight) and is added back to its token.
    """
    dtype = compute_dtype(x.device.type, x.dtype)
    # Other dtypes read group sizes to the host.
    if x.is_cuda and dtype != torch.bfloat16:
        raise ValueError(
            "an MoE on CUDA runs its experts in bf16: call the model under "
            "torch.autocast('cuda', dtype=torch.bfloat16)"
        )
    # Group g ends at row offs[g].
    offs = counts.cumsum(0).int()
    # Grouped GEMM rows must be 16-byte aligned: zero columns pad them (exact).
    n_embd, unit = x.size(1), 16 // dtype.itemsize
    e, h = -n_embd % unit, -w_down.size(2) % unit
    pad = lambda t, p: F.pad(t, p) if any(p) else t  # noqa: E731
    rows = pad(x.to(dtype), (0, e)).index_select(0, token_of)
    # (E, n_embd, 2 hidden)
    gate_up = pad(w_gate_up, (0, e, 0, h)).to(dtype).flatten(1, 2).transpose(-2, -1)
    down = pad(w_down, (0, h, 0, e)).to(dtype).transpose(-2, -1)
    gate, up = grouped_mm(rows, gate_up, offs).chunk(2, dim=1)
    h = F.silu(gate) * up
    if row_weights is not None:
        h = h * row_weights.unsqueeze(1).to(h.dtype)
    y = grouped_mm(h, down, offs)[:, :n_embd]
    # scatter_add_, as torchtitan: index_add_'s backward would keep y for its shape.
    rows_of = token_of.unsqueeze(1).expand_as(y)
    out = x.new_zeros(x.shape, dtype=dtype).scatter_add_(0, rows_of, y)
    return out.to(x.dtype)


def compute_dtype(device_type, dtype):
    """The dtype matmuls run in: autocast's when it is on, else dtype."""
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return dtype


def grouped_mm(a, b, offs):
    """Row group g of a times b[g]: one grouped GEMM, never a host read.

    Other dtypes go through a custom op: torch.compile knows F.grouped_mm's shapes in
    bf16 only.
    """
    if a.dtype == torch.bfloat16:
        return GROUPED_MM(a, b, offs=offs)
    return _grouped_mm_op(a, b, offs)


# An older torch has only the private one.
GROUPED_MM = getattr(F, "grouped_mm", None) or torch._grouped_mm


@torch.library.custom_op(f"{__name__.replace('.', '_')}::grouped_mm", mutates_args=())
def _grouped_mm_op(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return GROUPED_MM(a, b, offs=offs)


@_grouped_mm_op.register_fake
def _(a, b, offs):
    # (N, h) from a 3-D b; the per-group products (G, d, h) from a 2-D b.
    if b.dim() == 3:
        return a.new_empty(a.size(0), b.size(-1))
    return a.new_empty(offs.size(0), a.size(0), b.size(1))


def _grouped_mm_backward(ctx, grad):
    a, b, offs = ctx.saved_tensors
    # F.grouped_mm's fp32 backward fails on an expanded (stride-0) gradient.
    grad = grad.contiguous()
    grad_a = grouped_mm(grad, b.transpose(-2, -1), offs)
    grad_b = grouped_mm(grad.t(), a, offs).transpose(-2, -1)
    return grad_a, grad_b, None


def _grouped_mm_save(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


_grouped_mm_op.register_autograd(_grouped_mm_backward, setup_context=_grouped_mm_save)


def cross_entropy(logits, targets):
    """Mean fp32 cross-entropy over the targets that are not -1.

    Eager, past CE_CHUNK logits, it runs by chunks, each chunk's fp32 copy recomputed in
    the backward. Compiled, it is one loss: Inductor fuses the cast.
    """
    logits, targets = logits.flatten(0, -2), targets.reshape(-1)
    # Tokens per chunk.
    rows = max(1, CE_CHUNK // logits.size(1))
    if torch.compiler.is_compiling() or logits.size(0) <= rows:
        return F.cross_entropy(logits.float(), targets, ignore_index=-1)

    def chunk(x, t):
        return F.cross_entropy(x.float(), t, ignore_index=-1, reduction="sum")

    total = sum(
        checkpoint(chunk, x, t, use_reentrant=False)
        for x, t in zip(logits.split(rows), targets.split(rows))
    )
    return total / (targets != -1).sum()


# Block: pre-norm attention + FFN, both updates scaled


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.norm1 = RMSNorm(cfg.n_embd, cfg.norm_gain)
        self.attn = Attention(cfg)
        self.norm2 = RMSNorm(cfg.n_embd, cfg.norm_gain)
        self.ffn = MoE(cfg) if cfg.n_expert > 0 else MLP(cfg)
        # [X] RM on attention-out and MLP-down.
        self.residual_multiplier = cfg.residual_multiplier

    def forward(self, x, scale, ctx):
        """-> (the new residual stream, router statistics or None)."""
        # Inside a loop, scale is 1/r ([S8]-[S9]).
        scale = scale * self.residual_multiplier
        # [S8] The attention write, scaled.
        h = x + scaled(self.attn(self.norm1(x), ctx), scale)
        # [S9] The FFN sees the scaled write, and its own write is scaled too.
        ffn_out, router = self.ffn(self.norm2(h))
        return h + scaled(ffn_out, scale), router


def scaled(x, scale):
    # No copy when the scale is 1.
    return x if scale == 1.0 else scale * x


class BoundaryOperator(nn.Module):
    """[X3] BO(h, e) = RMSNorm(h) + alpha * e; each boundary step says which parts apply."""

    def __init__(self, cfg):
        super().__init__()
        norms = cfg.layout.startswith("pcc") and cfg.boundary in ("both", "norm")
        self.norm = RMSNorm(cfg.n_embd, cfg.norm_gain) if norms else None
        self.alpha = cfg.boundary_alpha

    def forward(self, h, e, norm=True, inject=True):
        h = self.norm(h) if norm else h
        return h + self.alpha * e if inject else h


# Depth layouts: the execution plan says which block runs when


@dataclass(frozen=True)
class Step:
    """"block": run blocks[block] (its `visit`-th run), updates scaled by `scale`;
    "anchor": remember the prelude's output e; "boundary": h <- BO(h, e) [X3]."""

    kind: str
    block: int = -1
    visit: int = 0
    scale: float = 1.0
    norm: bool = False
    inject: bool = False


def execution_plan(cfg, n_passes=None):
    """The steps of one forward pass; n_passes overrides K or r.

    cfg: layout, n_layer, n_passes, loop_scale, boundary, and ModelConfig's most_passes,
    tie_core, loop_start and loop_span.
    """
    k = cfg.n_passes if n_passes is None else n_passes
    if not 1 <= k <= cfg.most_passes:
        raise ValueError(f"n_passes={k}: this model runs 1 to {cfg.most_passes} passes")
    # [S8]-[S9] scale each update inside the loop by 1/r; the [X] code scales none.
    pcc = cfg.layout.startswith("pcc")
    by_passes = cfg.loop_scale == "1/r" or cfg.loop_scale == "auto" and not pcc
    scale = 1.0 / k if by_passes else 1.0
    if cfg.layout == "plain":
        return [Step("block", i, 1) for i in range(cfg.n_layer)]
    if cfg.layout in ("smelt", "layer_loop"):
        start, stop = cfg.loop_start, cfg.loop_start + cfg.loop_span
        span = range(start, stop)
        if cfg.layout == "smelt":
            # [S] model-loop: the whole span, r times.
            loop = [Step("block", i, v, scale) for v in range(1, k + 1) for i in span]
        else:
            # Layer-loop: each layer r times in place before the next.
            loop = [Step("block", i, v, scale) for i in span for v in range(1, k + 1)]
        before = [Step("block", i, 1) for i in range(start)]
        after = [Step("block", i, 1) for i in range(stop, cfg.n_layer)]
        return before + loop + after
    # Prelude-core-coda [X1]-[X3]: the first pass sees the prelude output e; a boundary
    # comes before each later pass and the coda.
    P, C, D = core_split(cfg.n_layer)
    boundary = Step(
        "boundary",
        norm=cfg.boundary in ("both", "norm"),
        inject=cfg.boundary in ("both", "inject"),
    )
    plan = [Step("block", i, 1) for i in range(P)] + [Step("anchor")]
    for p in range(k):
        first = P if cfg.tie_core else P + p * C
        visit = p + 1 if cfg.tie_core else 1
        plan += [boundary] if p else []
        plan += [Step("block", first + j, visit, scale) for j in range(C)]
    coda = P + (C if cfg.tie_core else cfg.n_passes * C)
    return plan + [boundary] + [Step("block", coda + j, 1) for j in range(D)]


def core_split(depth):
    """[X] even split of `depth` blocks into prelude/core/coda, remainder to the core first."""
    base, rest = divmod(depth, 3)
    return base, base + (rest >= 1), base + (rest >= 2)


# Config: the one source of truth of a shape


# The sizes a config may leave unset, and their unset values: each is derived from the others.
DERIVED = dict(eot_token=-1, n_kv_head=0, head_dim=0, mlp_hidden=0, expert_hidden=0)


@dataclass
class ModelConfig:
    # The data's vocabulary, padded ([X]: 50257 -> 50304).
    vocab_size: int = 4096
    block_size: int = 256  # the context length
    # Each eot starts a document; -1 -> vocab_size - 1.
    eot_token: int = -1
    # Logits kept: a padded vocabulary's real size; 0 -> all.
    n_logits: int = 0
    # Depth L, or the nominal depth P+C+D of pcc.
    n_layer: int = 4
    n_embd: int = 128  # the residual stream's width
    n_head: int = 4  # query heads
    n_kv_head: int = 0  # 0 -> n_head
    head_dim: int = 0  # 0 -> n_embd // n_head
    # 0 -> 8/3 n_embd rounded up to a multiple of 256 ([X] code), of 8 below 512.
    mlp_hidden: int = 0
    n_expert: int = 0  # 0 -> a dense SwiGLU FFN
    top_k: int = 8  # experts per token
    expert_hidden: int = 0  # 0 -> mlp_hidden // top_k
    # plain | smelt | layer_loop | pcc (tied core) | pcc_untied
    layout: str = "plain"
    # K core passes (pcc) or r runs of the loop span.
    n_passes: int = 1
    # The boundary operator [X3]: both | norm | inject | none.
    boundary: str = "both"
    boundary_alpha: float = 1.0  # alpha of BO(h, e) [X3]
    # pre: RMSNorm with gains. x: [X] Table 1, no gains, QK-norm, a norm after wte.
    norms: str = "pre"
    document_mask: bool = True  # [S]
    residual_multiplier: float = 1.0  # [X] RM
    # "1/r" [S8], "1", or auto: 1/r for the loops, 1 for pcc.
    loop_scale: str = "auto"
    output_multiplier: float = 1.0  # [X] OM
    # x: the [X] code's init. nanogpt: normal(0.02), tied wte.
    init: str = "x"
    embed_init_std: float = 0.02  # std of wte ('x' init)
    # U(-s, s), s = uniform_init_scale / sqrt(n_embd).
    uniform_init_scale: float = 3**0.5

    def __post_init__(self):
        # The unset sizes are derived here; replace() derives them again from new values.
        self.derived = [k for k, unset in DERIVED.items() if getattr(self, k) == unset]
        multiple = 256 if self.n_embd >= 512 else 8
        hidden = multiple * math.ceil(8 * self.n_embd / 3 / multiple)
        derived = dict(
            eot_token=self.vocab_size - 1,
            n_kv_head=self.n_head,
            head_dim=self.n_embd // max(self.n_head, 1),
            mlp_hidden=hidden,
        )
        for name in set(self.derived) & set(derived):
            setattr(self, name, derived[name])
        # After mlp_hidden, which it reads.
        if "expert_hidden" in self.derived:
            self.expert_hidden = max(1, self.mlp_hidden // max(self.top_k, 1))
        sizes = ("vocab_size", "block_size", "n_layer", "n_embd", "n_head")
        small = [n for n in sizes if getattr(self, n) < 1]
        loops, pcc = ("smelt", "layer_loop"), self.layout.startswith("pcc")
        layouts = ("plain", "smelt", "layer_loop", "pcc", "pcc_untied")
        # (holds, the setting, why): the first rule that fails is the error.
        rules = [
            (not small, (small or ["n_layer"])[0], "must be >= 1"),
            (
                self.n_kv_head >= 1 and self.n_head % self.n_kv_head == 0,
                "n_kv_head",
                "must divide n_head",
            ),
            (
                self.head_dim >= 2 and self.head_dim % 2 == 0,
                "head_dim",
                "must be even (RoPE rotates pairs)",
            ),
            (
                self.n_expert == 0 or 1 <= self.top_k <= self.n_expert,
                "top_k",
                "must be in [1, n_expert]",
            ),
            (
                self.layout in layouts,
                "layout",
                "must be plain, smelt, layer_loop, pcc or pcc_untied",
            ),
            (
                1 <= self.n_passes <= MAX_PASSES,
                "n_passes",
                f"must be in [1, {MAX_PASSES}]",
            ),
            (
                self.loop_span >= 1 or self.layout not in loops,
                "n_layer",
                "a loop needs n_layer >= 2",
            ),
            (
                core_split(self.n_layer)[1] >= 1 or not pcc,
                "n_layer",
                "prelude-core-coda needs n_layer >= 1",
            ),
            (
                self.boundary in ("both", "norm", "inject", "none"),
                "boundary",
                "must be both, norm, inject or none",
            ),
            (self.norms in ("pre", "x"), "norms", "must be pre or x"),
            (self.init in ("x", "nanogpt"), "init", "must be x or nanogpt"),
            (
                self.loop_scale in ("auto", "1/r", "1"),
                "loop_scale",
                "must be auto, 1/r or 1",
            ),
            (
                0 <= self.eot_token < self.vocab_size,
                "eot_token",
                "must be a token id below vocab_size",
            ),
        ]
        for holds, name, why in rules:
            if not holds:
                raise ValueError(f"{name}={getattr(self, name)!r}: {why}")
        if self.layout == "plain":
            self.n_passes = 1

    tie_core = property(lambda self: self.layout != "pcc_untied")
    # [X] Table 1: RMSNorm on queries and keys, and after the embedding.
    qk_norm = property(lambda self: self.norms == "x")
    embed_norm = property(lambda self: self.norms == "x")
    norm_gain = property(lambda self: self.norms == "pre")
    tie_embeddings = property(lambda self: self.init == "nanogpt")
    # [S] loops the middle half, m = L / 2, after floor((L - m) / 2) layers.
    loop_span = property(lambda self: self.n_layer // 2)
    loop_start = property(lambda self: (self.n_layer - self.loop_span) // 2)

    @property
    def n_blocks(self):
        P, C, D = core_split(self.n_layer)
        return P + self.n_passes * C + D if not self.tie_core else self.n_layer

    @property
    def most_passes(self):
        return self.n_passes if not self.tie_core else MAX_PASSES

    def executed_layers(self, n_passes=None):
        return sum(step.kind == "block" for step in execution_plan(self, n_passes))

    def to_dict(self):
        # What a checkpoint or config.json stores: every size, derived or given.
        return asdict(self)

    def replace(self, **changes):
        """A copy with `changes`, the sizes derived here derived again from the new values."""
        given = {**asdict(self), **{k: DERIVED[k] for k in self.derived}}
        return ModelConfig(**{**given, **changes})


# The model `python train.py` trains by default.
TINY = dict(
    block_size=128,
    n_layer=4,
    n_embd=128,
    n_head=4,
    n_expert=8,
    top_k=2,
    expert_hidden=256,
    layout="smelt",
    n_passes=2,
)


# The model


@dataclass
class ForwardContext:
    """What one forward pass shares across its blocks."""

    cos: torch.Tensor
    sin: torch.Tensor
    # SDPA's additive mask; None: causal.
    mask: Optional[torch.Tensor]
    # The mask as a FlexAttention BlockMask.
    block_mask: object = None
    cache: Optional["KVCache"] = None
    # Blocks run so far (KV cache).
    attention_calls: int = 0


class KVCache:
    """Keys and values of every executed block, and the cached document ids."""

    def __init__(self):
        self.keys, self.values, self.doc_ids = [], [], None

    def update(self, i, k, v):
        # The first visit opens entry i; later ones append along time.
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
        self.eot_token = cfg.eot_token
        # Built on the meta device and drawn by reset_parameters alone, so that a sharded
        # model draws the same numbers.
        device = torch.get_default_device()
        rope_shape = (cfg.block_size, cfg.head_dim // 2)
        with torch.device("meta"):
            self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
            self.embed_norm = RMSNorm(cfg.n_embd, cfg.norm_gain) if cfg.embed_norm else None
            self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_blocks))
            self.boundary = BoundaryOperator(cfg)  # [X3]
            self.norm_f = RMSNorm(cfg.n_embd, cfg.norm_gain)
            self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
            self.register_buffer("rope_cos", torch.empty(rope_shape), persistent=False)
            self.register_buffer("rope_sin", torch.empty(rope_shape), persistent=False)
        if device.type != "meta":
            self.to_empty(device=device)
        # Tied after to_empty, which would untie them.
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        self.plan = execution_plan(cfg)
        # An attribute, so that train.compile_blocks can swap in its compiled loss.
        self.cross_entropy = cross_entropy
        # Recompute each executed block in the backward.
        self.activation_checkpointing = False
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        """Every parameter and buffer from scratch, the same on any number of processes."""
        cos, sin = rope_tables(self.config.head_dim, self.config.block_size)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)
        for name, p in self.named_parameters():
            # A DTensor is drawn whole, then cut to this process's shard.
            if hasattr(p, "device_mesh"):
                from torch.distributed.tensor import distribute_tensor

                whole = torch.empty(p.shape, dtype=p.dtype, device=p.device)
                whole = self.init_parameter(name, whole)
                shard = distribute_tensor(whole, p.device_mesh, p.placements, src_data_rank=None)
                p.copy_(shard)
            else:
                self.init_parameter(name, p)

    def init_parameter(self, name, w):
        """Draw parameter `name` into w in place."""
        cfg = self.config
        # The writes to the residual stream.
        out = name.endswith(("o_proj.weight", "w_down.weight", "w_down"))
        if w.dim() < 2:  # RMSNorm gains
            return nn.init.ones_(w)
        if w.dim() == 4:  # an MoE's stacked gate and up
            return MoE.draw_gate_up(w, lambda half: self.init_parameter(name, half))
        if cfg.init == "nanogpt":
            # Out-projections scaled down with the executed depth.
            std = 0.02 / math.sqrt(2 * cfg.executed_layers()) if out else 0.02
            return nn.init.normal_(w, std=std)
        # [X]: a normal embedding, zero out-projections and head, uniform inputs.
        if name == "wte.weight":
            return nn.init.normal_(w, std=cfg.embed_init_std)
        if out or name == "lm_head.weight":
            return nn.init.zeros_(w)
        bound = cfg.uniform_init_scale / math.sqrt(cfg.n_embd)
        return nn.init.uniform_(w, -bound, bound)

    def forward(self, idx, targets=None, n_passes=None, cache=None, return_stats=False):
        """idx (B, T) -> (logits, loss or None) [, stats].

        stats: "ce", and for an MoE "balance", "z_loss", "expert_counts". Targets -1 are
        ignored. n_passes overrides K or r. idx continue a KVCache `cache`.
        """
        cfg = self.config
        B, T = idx.shape
        start = 0 if cache is None or cache.doc_ids is None else cache.doc_ids.size(1)
        if start + T > cfg.block_size:
            raise ValueError(f"sequence length {start + T} exceeds block_size={cfg.block_size}")
        # The document mask [S], always built: asking for an eot would read the host.
        if cfg.document_mask:
            docs = document_ids(idx, self.eot_token)
        else:
            docs = torch.zeros_like(idx)
        mask = block_mask = None
        if cache is not None:
            # The new tokens' documents continue the cached ones.
            cached = cache.doc_ids
            docs = docs + (cached[:, -1:] if cached is not None else 0)
            cache.doc_ids = docs if cached is None else torch.cat([cached, docs], dim=1)
            mask = attention_mask(docs, cache.doc_ids, start)
        elif cfg.document_mask and idx.device.type in FLEX_DEVICES:
            block_mask = flex_block_mask(docs)
        elif cfg.document_mask:
            mask = attention_mask(docs, docs, 0)
        if mask is not None:
            # Additive, built once: SDPA would convert it in every block.
            dtype = compute_dtype(idx.device.type, self.wte.weight.dtype)
            allowed = mask
            mask = torch.zeros(allowed.shape, dtype=dtype, device=idx.device)
            mask = mask.masked_fill_(~allowed, float("-inf"))
        rope = self.rope_cos[start : start + T], self.rope_sin[start : start + T]
        ctx = ForwardContext(*rope, mask, block_mask, cache)

        # The embedding, then the blocks in the plan's order.
        h = self.wte(idx)
        if self.embed_norm is not None:
            h = self.embed_norm(h)
        anchor, routers = None, []
        plan = self.plan if n_passes is None else execution_plan(cfg, n_passes)
        for step in plan:
            if step.kind == "block":
                block = self.blocks[step.block]
                if self.activation_checkpointing and torch.is_grad_enabled():
                    # Keep only the block's input.
                    h, router = checkpoint(block, h, step.scale, ctx, use_reentrant=False)
                else:
                    h, router = block(h, step.scale, ctx)
                routers.append(router)
            elif step.kind == "anchor":
                # e: the prelude's output.
                anchor = h
            else:
                # [X3] BO(h, e) = RMSNorm(h) + alpha * e
                h = self.boundary(h, anchor, step.norm, step.inject)
        # [X] OM on the unembedding.
        logits = scaled(self.lm_head(self.norm_f(h)), cfg.output_multiplier)
        # A padded vocabulary's extra rows are cut before the softmax ([X] code).
        if cfg.n_logits:
            logits = logits[..., : cfg.n_logits]
        # Cross-entropy, plus the router losses averaged over the MoE layers.
        loss, stats = None, {}
        if targets is not None:
            ce = self.cross_entropy(logits, targets)
            loss, stats = ce, {"ce": ce.detach()}
            routers = [r for r in routers if r is not None]
            if routers:
                balance = torch.stack([r["balance"] for r in routers]).mean()
                z_loss = torch.stack([r["z_loss"] for r in routers]).mean()
                loss = MoE.add_router_loss(ce, balance, z_loss)
                stats.update(
                    balance=balance.detach(),
                    z_loss=z_loss.detach(),
                    expert_counts=torch.stack([r["counts"] for r in routers]),
                )
        return (logits, loss, stats) if return_stats else (logits, loss)

    @torch.no_grad()
    def generate(
        self, idx, max_new_tokens, temperature=1.0, top_k=None, n_passes=None, generator=None
    ):
        """Sample max_new_tokens after idx (B, T) with a KV cache."""
        if idx.size(1) + max_new_tokens > self.config.block_size:
            raise ValueError(
                f"prompt ({idx.size(1)}) + max_new_tokens ({max_new_tokens}) exceeds "
                f"block_size={self.config.block_size}"
            )
        cache = KVCache()
        logits, _ = self(idx, n_passes=n_passes, cache=cache)
        for _ in range(max_new_tokens):
            last = logits[:, -1, :].float()
            # Temperature 0 is greedy; top_k keeps the k largest logits.
            if temperature == 0:
                next_token = last.argmax(dim=-1, keepdim=True)
            else:
                last = last / temperature
                if top_k is not None:
                    kth = torch.topk(last, min(top_k, last.size(-1))).values[:, -1:]
                    last = last.masked_fill(last < kth, float("-inf"))
                probs = last.softmax(dim=-1)
                next_token = torch.multinomial(probs, 1, generator=generator)
            idx = torch.cat([idx, next_token], dim=1)
            logits, _ = self(next_token, n_passes=n_passes, cache=cache)
        return idx

    def num_params(self):
        """embedding, non_embedding, total, and active: the non-embedding parameters a
        token touches (top_k experts of each MoE, each block it runs, once)."""
        total = sum(p.numel() for p in self.parameters())
        head = 0 if self.config.tie_embeddings else self.lm_head.weight.numel()
        embedding = self.wte.weight.numel() + head
        used = {s.block for s in self.plan if s.kind == "block"}
        # Blocks the plan never runs, and an MoE's unrouted experts, are inactive.
        inactive = 0
        for i, block in enumerate(self.blocks):
            if i not in used:
                inactive += sum(p.numel() for p in block.parameters())
            elif isinstance(block.ffn, MoE):
                moe = block.ffn
                inactive += (moe.n_expert - moe.top_k) * 3 * moe.w_down[0].numel()
        return dict(
            embedding=embedding,
            non_embedding=total - embedding,
            total=total,
            active=total - embedding - inactive,
        )


def load_checkpoint(path, device="cpu"):
    """(model, info) from a train.py ckpt.pt (weights_only: no pickled code runs), or a
    folder of model.safetensors and config.json. info: the checkpoint without weights."""
    import pickle

    if not os.path.exists(path):
        raise FileNotFoundError(f"no checkpoint at {path}")
    # An export folder.
    if os.path.isdir(path):
        from safetensors.torch import load_model

        with open(os.path.join(path, "config.json")) as f:
            info = json.load(f)
        model = GPT(ModelConfig(**info["model_config"]))
        load_model(model, os.path.join(path, "model.safetensors"))
        return model.to(device), info
    try:
        info = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError) as e:
        # Not a checkpoint, or one holding code.
        reason = str(e).splitlines()[0][:80]
        raise ValueError(
            f"{path}: not a checkpoint of tensors and plain data ({reason})"
        ) from None
    info.setdefault("step", (info.get("state") or {}).get("step"))
    model = GPT(ModelConfig(**info["model_config"]))
    model.load_state_dict(info.pop("model"))
    return model.to(device), info
