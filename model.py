"""
Every architecture of both studies in one readable file.

  [S] SMELT: an MoE transformer whose middle half is executed r times ("model-loop"), every sublayer
      update inside the loop span scaled by 1/r ([S8]-[S9]).
  [X] prelude-core-coda: P prelude blocks, a core of C blocks applied K times (tied or untied weights),
      D coda blocks, and the boundary operator BO(h, e) = RMSNorm(h) + alpha * e ([X1]-[X3]) before
      every core pass and before the coda.
  plus the layer-loop variant (each layer applied r times in place) and the plain baseline.

File order follows the data: norms -> RoPE -> attention -> dense MLP -> MoE -> Block -> depth layouts
(the execution plan) -> ModelConfig -> the model (forward, probes, generate, num_params).
One ModelConfig is the single source of truth for a model's shape; match.py reads it analytically.
"""

import math
from dataclasses import dataclass, fields
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

NORM_EPS = 1e-6  # RMSNorm epsilon
BALANCE_LOSS_COEF = 0.01  # weight of the Switch load-balancing loss
Z_LOSS_COEF = 0.001  # weight of the router z-loss (ST-MoE)
FLEX_DEVICES = ("cuda",)  # the document mask as a FlexAttention block mask here; elsewhere SDPA with a
#   boolean mask (FlexAttention has no backward on a CPU; a test adds "cpu" to compare the two)


# ----------------------------------------------------------------------------------------------------
# Norms and RoPE


class RMSNorm(nn.Module):
    """RMSNorm with an optional learnable gain ([X] Table 1 trains without norm gains)."""

    def __init__(self, dim, eps=1e-6, gain=True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if gain else None

    def forward(self, x):
        weight = self.weight
        if weight is not None and weight.dtype != x.dtype:  # bf16 q/k under autocast: keep the fused kernel
            weight = weight.to(x.dtype)
        return F.rms_norm(x, (x.size(-1),), weight, self.eps)


def rope_tables(head_dim, max_len, base=10000.0):
    """cos/sin tables (max_len, head_dim/2) for rotary position embeddings."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    """Rotate pairs (x1, x2) of the two halves of the head dimension. x: (B, H, T, D); cos/sin: (T, D/2)."""
    d = x.size(-1) // 2
    x1, x2 = x[..., :d], x[..., d:]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat([x1 * cos + x2 * sin, x2 * cos - x1 * sin], dim=-1)


# ----------------------------------------------------------------------------------------------------
# Attention: GQA with head_dim independent of the width, optional QK-norm, document mask, KV cache


def document_ids(idx, eot_token):
    """Document index of every position: each eot token starts a new document (it acts as BOS)."""
    return (idx == eot_token).cumsum(dim=1)


def attention_mask(q_docs, k_docs, q_start):
    """Boolean mask (B, 1, Tq, Tk): causal, and attention never crosses a document boundary."""
    tq, tk = q_docs.size(1), k_docs.size(1)
    q_pos = torch.arange(q_start, q_start + tq, device=q_docs.device)
    k_pos = torch.arange(tk, device=q_docs.device)
    causal = k_pos[None, :] <= q_pos[:, None]
    same_doc = q_docs[:, :, None] == k_docs[:, None, :]
    return (causal[None] & same_doc)[:, None]


_compiled_flex = None


def flex_document_attention(q, k, v, block_mask):
    """FlexAttention with a document block mask: skips fully masked blocks (fast on CUDA, compiled once)."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention
    if q.is_cuda:
        _compiled_flex = _compiled_flex or torch.compile(flex_attention, dynamic=False)
        return _compiled_flex(q, k, v, block_mask=block_mask, enable_gqa=k.size(1) != q.size(1))
    return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=k.size(1) != q.size(1))


def flex_block_mask(docs):
    """The document mask of attention_mask() as a FlexAttention BlockMask."""
    from torch.nn.attention.flex_attention import create_block_mask

    def causal_same_document(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (docs[b, q_idx] == docs[b, kv_idx])

    B, T = docs.shape
    return create_block_mask(causal_same_document, B, None, T, T, device=docs.device, _compile=docs.is_cuda)


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        self.q_proj = nn.Linear(cfg.n_embd, cfg.n_head * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.n_embd, cfg.n_kv_head * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.n_embd, cfg.n_kv_head * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_head * cfg.head_dim, cfg.n_embd, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, NORM_EPS, cfg.norm_gain) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, NORM_EPS, cfg.norm_gain) if cfg.qk_norm else None

    def qkv(self, x, ctx):
        """Queries (B, n_head, T, head_dim), keys and values (B, n_kv_head, T, head_dim), rotated."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:  # QK-norm before RoPE (identical to after RoPE when norms have no gain)
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, ctx.cos, ctx.sin), apply_rope(k, ctx.cos, ctx.sin), v

    def forward(self, x, ctx):
        B, T, _ = x.shape
        q, k, v = self.qkv(x, ctx)
        if ctx.cache is not None:  # one cache entry per *executed* block: each visit has its own
            k, v = ctx.cache.update(ctx.attention_calls, k, v)
            ctx.attention_calls += 1
        if ctx.block_mask is not None:
            y = flex_document_attention(q, k, v, ctx.block_mask)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=ctx.additive_mask, is_causal=ctx.mask is None,
                                               enable_gqa=self.n_kv_head != self.n_head)
        y = y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim)
        return self.o_proj(y)


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


@torch.library.custom_op(f"{__name__.replace('.', '_')}::grouped_mm", mutates_args=())  # one op per copy of this file
def grouped_mm_any_dtype(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """F.grouped_mm as an op whose output shape torch.compile is told in any dtype (torch's own shape
    function takes bf16 only): an fp32 model compiles too."""
    return F.grouped_mm(a, b, offs=offs)


@grouped_mm_any_dtype.register_fake
def _(a, b, offs):
    return a.new_empty(a.size(0), b.size(-1)) if b.dim() == 3 else a.new_empty(offs.size(0), a.size(0), b.size(1))


def _grouped_mm_backward(ctx, grad):
    """d a = grad @ b[g]^T per group; d b[g] = a_g^T @ grad_g, computed as (grad_g^T @ a_g)^T: b is the
    transposed view of a weight, and that product comes out in the weight's own layout (no copy)."""
    a, b, offs = ctx.saved_tensors
    grad = grad.contiguous()
    return grouped_mm(grad, b.transpose(-2, -1), offs), grouped_mm(grad.t(), a, offs).transpose(-2, -1), None


grouped_mm_any_dtype.register_autograd(_grouped_mm_backward,
                                       setup_context=lambda ctx, inputs, output: ctx.save_for_backward(*inputs))


def grouped_mm(a, b, offs):
    """Row group g of a (rows offs[g-1] to offs[g]) times b[g]; for a 2-D b, the products of the column
    groups of a with the row groups of b, stacked (the weight gradients). torch's dropless grouped GEMM, as
    torchtitan's MoE: one kernel on CUDA in bf16, a loop of matmuls inside on a CPU, no host read."""
    return F.grouped_mm(a, b, offs=offs) if a.dtype == torch.bfloat16 else grouped_mm_any_dtype(a, b, offs)


def padded_groups(counts, n, align):
    """Room for the experts' row groups when each starts at a multiple of `align` rows and holds at least
    `align` (torchtitan pads so for CUDA's grouped GEMM kernels; an expert without tokens multiplies zero
    rows): (the row of each of the n expert-sorted assignments, offs, the number of rows). The last group
    runs to the end of a buffer of fixed size n + align * E: no host read, and every step the same shapes."""
    ends = counts.cumsum(0)
    sizes = (counts.clamp(min=1) + align - 1) // align * align
    position = torch.arange(n, device=counts.device)
    expert = torch.searchsorted(ends, position, right=True)  # the expert of each sorted assignment
    dest = (sizes.cumsum(0) - sizes - ends + counts)[expert] + position  # its group's start + its rank in it
    n_rows = n + align * counts.numel()
    offs = sizes.cumsum(0).int()
    offs[-1] = n_rows
    return dest, offs, n_rows


def compute_dtype(device_type, dtype):
    """The dtype matmuls run in on this device: autocast's when it is on, else `dtype`."""
    on = torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)
    return torch.get_autocast_dtype(device_type) if on else dtype


def zero_pad(t, pad):
    """F.pad with zeros; t itself when nothing is padded (F.pad would copy it)."""
    return F.pad(t, pad) if any(pad) else t


def run_experts(x, token_of, counts, w_gate, w_up, w_down, row_weights=None, group_align=None):
    """The routed SwiGLU experts as three grouped GEMMs over expert-sorted rows, dropless: assignment rows
    [offset_e, offset_e + counts[e]) of token_of belong to expert e; each row copies its token of x
    (N, n_embd), its hidden activation is scaled by its router weight (row_weights, optional: the narrow
    expert_hidden side costs less than the n_embd output) and its output is added back to its token.
    Matmuls in the autocast dtype under autocast; returns (N, n_embd) in x's dtype. group_align: see
    padded_groups (None: 8 rows on CUDA, 1 elsewhere). With token_of = arange and no row weights this is
    the twin of kernels.moe_experts."""
    n_tokens, n_embd = x.shape
    dtype = compute_dtype(x.device.type, x.dtype)
    align = (8 if x.is_cuda else 1) if group_align is None else group_align
    if align == 1:
        offs = counts.cumsum(0).int()
    else:  # padding rows read token n_tokens, a zero row, and carry router weight 0
        dest, offs, n_rows = padded_groups(counts, token_of.numel(), align)
        token_of = token_of.new_full((n_rows,), n_tokens).index_copy(0, dest, token_of)
        if row_weights is not None:
            row_weights = row_weights.new_zeros(n_rows).index_copy(0, dest, row_weights)
    unit = 16 // dtype.itemsize  # grouped GEMM rows are 16-byte aligned: zero columns pad the rest
    pad_embd, pad_hidden = -n_embd % unit, -w_gate.size(1) % unit
    x_rows = zero_pad(x, (0, pad_embd, 0, int(align > 1))).index_select(0, token_of)
    w_gate, w_up = (zero_pad(w, (0, pad_embd, 0, pad_hidden)).to(dtype).transpose(-2, -1) for w in (w_gate, w_up))
    w_down = zero_pad(w_down, (0, pad_hidden, 0, pad_embd)).to(dtype).transpose(-2, -1)
    # one cast per matmul, as autocast casts: the two gradients of x_rows add up in fp32
    h = F.silu(grouped_mm(x_rows.to(dtype), w_gate, offs)) * grouped_mm(x_rows.to(dtype), w_up, offs)
    if row_weights is not None:  # an expert without rows gets a zero gradient
        h = h * row_weights.unsqueeze(1).to(h.dtype)
    y = grouped_mm(h, w_down, offs)[:, :n_embd].to(x.dtype)  # fp32 sums of bf16 outputs under autocast
    return x.new_zeros(n_tokens + int(align > 1), n_embd).index_add_(0, token_of, y)[:n_tokens]


class MoE(nn.Module):
    """Top-k routed mixture of fine-grained SwiGLU experts. n_expert == top_k is [S1]'s fully activated
    reference. Dispatch is sparse and dropless: assignments are sorted by expert, the experts run as grouped
    GEMMs over their own tokens only, and the weighted outputs are added back to their tokens."""

    def __init__(self, cfg):
        super().__init__()
        self.n_expert, self.top_k = cfg.n_expert, cfg.top_k
        self.router = nn.Linear(cfg.n_embd, cfg.n_expert, bias=False)
        self.w_gate = nn.Parameter(torch.empty(cfg.n_expert, cfg.expert_hidden, cfg.n_embd))
        self.w_up = nn.Parameter(torch.empty(cfg.n_expert, cfg.expert_hidden, cfg.n_embd))
        self.w_down = nn.Parameter(torch.empty(cfg.n_expert, cfg.n_embd, cfg.expert_hidden))

    def forward(self, x):
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        n_tokens = flat.size(0)
        router_logits = self.router(flat).float()
        probs = router_logits.softmax(dim=-1)
        weights, expert_ids = probs.topk(self.top_k, dim=-1)  # (N, k)
        weights = weights / weights.sum(dim=-1, keepdim=True)  # top-k weights sum to 1 (Mixtral / OLMoE)
        # sparse dispatch: group the N*k (token, expert) assignments by expert
        flat_ids = expert_ids.reshape(-1)
        order = flat_ids.argsort(stable=True)
        token_of, weight_of = order // self.top_k, weights.reshape(-1)[order]
        # tokens per expert (like bincount, but without a host sync on CUDA)
        counts = torch.zeros(self.n_expert, dtype=torch.long, device=x.device).index_add_(
            0, flat_ids, torch.ones_like(flat_ids))
        out = self.experts(flat, token_of, counts, weight_of)
        # load-balancing loss (Switch): E * sum_e f_e P_e, minimum 1 for a uniform router
        fraction = counts.float() / (n_tokens * self.top_k)
        balance = self.n_expert * (fraction * probs.mean(dim=0)).sum()
        z_loss = torch.logsumexp(router_logits, dim=-1).square().mean()  # router z-loss (ST-MoE)
        router = dict(balance=balance, z_loss=z_loss, counts=counts.detach(),
                      expert_ids=expert_ids.view(*shape[:-1], self.top_k),
                      weights=weights.detach().view(*shape[:-1], self.top_k))  # statistics for probes
        return out.view(shape), router

    def experts(self, x, token_of, counts, weight_of):
        """The routed experts' weighted outputs (N, n_embd) (kernels.apply swaps in a grouped GEMM)."""
        return run_experts(x, token_of, counts, self.w_gate, self.w_up, self.w_down, weight_of)


# ----------------------------------------------------------------------------------------------------
# Block: pre-norm attention + FFN with a residual scale


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.norm1 = RMSNorm(cfg.n_embd, NORM_EPS, cfg.norm_gain)
        self.attn = Attention(cfg)
        self.norm2 = RMSNorm(cfg.n_embd, NORM_EPS, cfg.norm_gain)
        self.ffn = MoE(cfg) if cfg.n_expert > 0 else MLP(cfg)
        self.residual_multiplier = cfg.residual_multiplier  # [X] RM on attention-out and MLP-down

    def forward(self, x, scale, ctx):
        """-> (new residual stream, router statistics or None). The router's auxiliary losses leave as an
        output, not through ctx: FSDP2 then sees their gradient arrive with the block's other outputs."""
        update_scale = scale * self.residual_multiplier
        h = x + scaled(self.attn(self.norm1(x), ctx), update_scale)  # [S8] attention write scaled by 1/r
        ffn_out, router = self.ffn(self.norm2(h))  # [S9] the FFN/MoE sublayer sees the scaled attention write
        return h + scaled(ffn_out, update_scale), router  # [S9] MoE write scaled by 1/r


def scaled(x, scale):
    """scale * x, skipping the multiply (a full copy forward and backward) when scale is 1."""
    return x if scale == 1.0 else scale * x


class BoundaryOperator(nn.Module):
    """[X3] BO(h, e) = RMSNorm(h) + alpha * e, before a core pass or the coda; each boundary of the plan
    says whether it norms and whether it injects. One gain-free (or shared-gain) RMSNorm serves them all."""

    def __init__(self, cfg):
        super().__init__()
        norms = cfg.layout == "pcc" and cfg.boundary in ("both", "norm")
        self.norm = RMSNorm(cfg.n_embd, NORM_EPS, cfg.norm_gain) if norms else None
        self.alpha = cfg.boundary_alpha

    def forward(self, h, e, norm=True, inject=True):
        if norm:
            h = self.norm(h)
        if inject:
            h = h + self.alpha * e
        return h


# ----------------------------------------------------------------------------------------------------
# Depth layouts: the execution plan is the one place that says which block runs when


@dataclass(frozen=True)
class Step:
    """One step of the forward pass.
    kind "block":    run blocks[block]; `visit` counts executions of that physical block (1-based);
                     `scale` multiplies both residual updates ([S8]-[S9] 1/r inside a SMELT loop span).
    kind "anchor":   the prelude is done: remember its output e; h starts at 0 when `inject` ([X] h0 = 0).
    kind "boundary": h <- RMSNorm(h) (if norm) + alpha*e (if inject) [X3]; before a core pass or the coda."""
    kind: str
    block: int = -1
    visit: int = 0
    scale: float = 1.0
    norm: bool = False
    inject: bool = False


MAX_PASSES = 64  # passes any model runs: 4 x the 16 test-time passes the papers go to (each runs the loop again)
PASSES_WHY = "4 x the 16 test-time passes the papers go to; each pass runs the looped blocks again"


def most_passes(cfg):
    """The most passes a model of cfg can run: an untied pcc model one per stored core, others MAX_PASSES."""
    return cfg.n_passes if cfg.layout == "pcc" and not cfg.tie_core else MAX_PASSES


def execution_plan(cfg, n_passes=None):
    """The sequence of steps a forward pass executes. n_passes overrides K (prelude-core-coda) or r
    (SMELT loop / layer-loop) for this plan only: test-time passes, random passes per step, growth."""
    if cfg.layout == "plain":
        return [Step("block", i, 1) for i in range(cfg.n_layer)]
    if cfg.layout in ("smelt", "layer_loop"):
        r = cfg.n_passes if n_passes is None else n_passes
        if not 1 <= r <= MAX_PASSES:
            raise ValueError(f"n_passes must be in [1, {MAX_PASSES}] ({PASSES_WHY}), got {r}")
        start, stop = cfg.loop_start, cfg.loop_start + cfg.loop_span
        prelude = [Step("block", i, 1) for i in range(start)]
        coda = [Step("block", i, 1) for i in range(stop, cfg.n_layer)]
        span = range(start, stop)
        if cfg.layout == "smelt":  # model-loop: the whole span, then the whole span again
            loop = [Step("block", i, v, 1.0 / r) for v in range(1, r + 1) for i in span]
        else:  # layer-loop: each layer r times in place before the next
            loop = [Step("block", i, v, 1.0 / r) for i in span for v in range(1, r + 1)]
        return prelude + loop + coda
    # prelude-core-coda [X1]-[X2]
    k_passes = cfg.n_passes if n_passes is None else n_passes
    if not 1 <= k_passes <= MAX_PASSES:
        raise ValueError(f"n_passes must be in [1, {MAX_PASSES}] ({PASSES_WHY}), got {k_passes}")
    if k_passes > most_passes(cfg):
        raise ValueError(f"n_passes={k_passes}: an untied model has {cfg.n_passes} cores, one per trained pass, "
                         f"so it runs at most {cfg.n_passes} passes")
    P, C, D = cfg.n_prelude, cfg.n_core, cfg.n_coda
    norm = cfg.boundary in ("both", "norm")
    inject = cfg.boundary in ("both", "inject")
    h0_zero = inject and cfg.zero_initial_state
    plan = [Step("block", i, 1) for i in range(P)] + [Step("anchor", inject=h0_zero)]
    for k in range(k_passes):
        if k > 0 or cfg.zero_initial_state:
            plan.append(Step("boundary", norm=norm, inject=inject))  # [X3] before every core pass
        first = P if cfg.tie_core else P + k * C
        plan += [Step("block", first + j, k + 1 if cfg.tie_core else 1) for j in range(C)]
    plan.append(Step("boundary", norm=norm, inject=inject))  # [X3] before the coda too (the [X] code's)
    coda_start = P + (C if cfg.tie_core else cfg.n_passes * C)
    plan += [Step("block", coda_start + j, 1) for j in range(D)]
    return plan


def core_split(depth):
    """[X] even split of `depth` blocks into prelude/core/coda, remainder first to core, then coda."""
    base, rest = divmod(depth, 3)
    return base, base + (rest >= 1), base + (rest >= 2)


# ----------------------------------------------------------------------------------------------------
# Config


class Derived(int):
    """A size the config derived from other fields because it was given as 0 / -1 ("derive it"). It is
    an int everywhere; dataclasses.replace() hands it back to __init__, which derives it again from
    the new fields, so replace(cfg, n_embd=256) never keeps the old width's head_dim or mlp_hidden."""


def derive(given, sentinel, value):
    """`given` when it was set explicitly, else `value` marked as Derived."""
    return Derived(value) if given == sentinel or isinstance(given, Derived) else given


@dataclass
class ModelConfig:
    # vocabulary and context
    vocab_size: int = 4096  # rows of the embedding and the lm head: at least the data's vocabulary;
    #   above it, padding ([X]: GPT-2's 50257 padded to 50304), cut before the softmax (n_logits)
    block_size: int = 256  # the longest sequence (context length)
    eot_token: int = -1  # document separator: each eot starts a new document (document mask); -1 -> the
    #   last id, vocab_size - 1 (train.py takes the data's, from its meta.json)
    n_logits: int = 0  # logits kept before the softmax: the real vocabulary of a padded vocab_size ([X]: 50257
    #   of 50304; the padded rows never take probability); 0 -> vocab_size (train.py: the data's)
    # width and attention
    n_layer: int = 4  # physical depth L (SMELT, layer-loop, plain) or nominal depth P+C+D (prelude-core-coda)
    n_embd: int = 128  # width of the residual stream
    n_head: int = 4  # query heads
    n_kv_head: int = 0  # 0 -> n_head (no GQA)
    head_dim: int = 0  # 0 -> n_embd // n_head; independent of n_embd ([S] matches KV by head size)
    qk_norm: bool = False  # RMSNorm on queries and keys per head ([X] Table 1)
    norm_gain: bool = True  # learnable RMSNorm gains ([X]: none)
    embed_norm: bool = False  # RMSNorm right after the token embedding ([X] Table 1)
    tie_embeddings: bool = False  # the lm head shares the token embedding's weights
    document_mask: bool = True  # attention never crosses an eot (document) boundary [S]; False: causal across
    #   documents, as the [X] code trains
    # feed-forward: dense SwiGLU (n_expert == 0) or MoE
    mlp_hidden: int = 0  # 0 -> 256 * ceil(8 n_embd / 3 / 256), as the [X] code
    n_expert: int = 0  # experts per MoE layer; 0 -> a dense SwiGLU FFN
    top_k: int = 8  # experts each token is routed to
    expert_hidden: int = 0  # 0 -> mlp_hidden // top_k (fine-grained experts)
    # depth layout
    layout: str = "plain"  # "plain", "smelt" (model-loop of the middle span), "layer_loop", "pcc" (prelude-core-coda)
    n_passes: int = 1  # how often the looped part runs: K core passes (pcc), r runs of the loop span (smelt,
    #   layer_loop); 1 for plain
    loop_span: int = -1  # m, -1 -> n_layer // 2; prelude is floor((L - m) / 2)
    tie_core: bool = True  # one set of core weights (looped) or K independent cores (untied)
    boundary: str = "both"  # boundary operator [X3]: "both", "norm", "inject" or "none"
    boundary_alpha: float = 1.0  # alpha of BO(h, e) = RMSNorm(h) + alpha * e [X3]
    zero_initial_state: bool = True  # [X] Algorithm 1: h0 = 0, the first pass sees BO(0, e) = alpha*e.
    #   False: the first pass sees the prelude output e itself, as the [X] code does (same when alpha = 1)
    # multipliers and init
    residual_multiplier: float = 1.0  # [X] RM on attention-out and MLP-down
    output_multiplier: float = 1.0  # [X] OM on the logits
    init: str = "x"  # "x": zero out-projections and lm head, normal embedding, uniform Q/K/V and MLP-in;
    #                  "nanogpt": normal(0.02), out-projections scaled by 1/sqrt(2 * executed layers)
    embed_init_std: float = 0.02  # std of the normal token-embedding init ('x' init)
    uniform_init_scale: float = 3 ** 0.5  # U(-s, s) with s = uniform_init_scale / sqrt(n_embd)

    def __post_init__(self):
        def bad(name, why):
            raise ValueError(f"ModelConfig.{name}={getattr(self, name)!r}: {why}")

        for name in ("vocab_size", "block_size", "n_layer", "n_embd", "n_head"):
            if getattr(self, name) < 1:
                bad(name, "must be >= 1")
        self.eot_token = derive(self.eot_token, -1, self.vocab_size - 1)
        if not 0 <= self.eot_token < self.vocab_size:
            bad("eot_token", f"must be a token id in [0, vocab_size={self.vocab_size})")
        if self.n_logits and not self.eot_token < self.n_logits <= self.vocab_size:
            bad("n_logits", f"must be 0 or in (eot_token={self.eot_token}, vocab_size={self.vocab_size}]")
        self.n_kv_head = derive(self.n_kv_head, 0, self.n_head)
        self.head_dim = derive(self.head_dim, 0, self.n_embd // self.n_head)
        if self.n_kv_head < 1 or self.n_head % self.n_kv_head:
            bad("n_kv_head", f"n_head={self.n_head} must be divisible by n_kv_head")
        if self.head_dim < 2 or self.head_dim % 2:
            bad("head_dim", "must be even and >= 2 (RoPE rotates pairs)")
        self.mlp_hidden = derive(self.mlp_hidden, 0, 256 * math.ceil(8 * self.n_embd / 3 / 256))
        if self.n_expert < 0:
            bad("n_expert", "must be >= 0 (0 means a dense SwiGLU)")
        if self.n_expert:
            if not 1 <= self.top_k <= self.n_expert:
                bad("top_k", f"must be in [1, n_expert={self.n_expert}]")
            self.expert_hidden = derive(self.expert_hidden, 0, max(1, self.mlp_hidden // self.top_k))
        if self.layout not in ("plain", "smelt", "layer_loop", "pcc"):
            bad("layout", "must be 'plain', 'smelt', 'layer_loop' or 'pcc'")
        self.loop_span = derive(self.loop_span, -1, self.n_layer // 2)
        if not 0 <= self.loop_span <= self.n_layer:
            bad("loop_span", f"must be in [0, n_layer={self.n_layer}]")
        if self.n_passes < 1:
            bad("n_passes", "must be >= 1")
        if self.n_passes > MAX_PASSES:
            bad("n_passes", f"at most {MAX_PASSES} ({PASSES_WHY})")
        if self.layout == "plain":
            self.n_passes = 1  # no loop: every layer runs once (train.py refuses a given n_passes here)
        if self.layout in ("smelt", "layer_loop") and self.loop_span < 1:
            bad("loop_span", f"layout {self.layout!r} needs a loop span of >= 1 layer (n_layer={self.n_layer})")
        if self.layout == "pcc" and self.n_core < 1:
            bad("n_layer", f"layout 'pcc' needs a core of >= 1 block (n_layer={self.n_layer})")
        if self.boundary not in ("both", "norm", "inject", "none"):
            bad("boundary", "must be 'both', 'norm', 'inject' or 'none'")
        if self.init not in ("x", "nanogpt"):
            bad("init", "must be 'x' or 'nanogpt'")
        if self.tie_embeddings and self.init == "x":
            bad("tie_embeddings", "the 'x' init zero-initialises the lm head; use init='nanogpt' with tied embeddings")

    @property
    def loop_start(self):
        """First looped layer (0-based): prelude of floor((L - m) / 2) layers [S training protocol]."""
        return (self.n_layer - self.loop_span) // 2

    @property
    def n_blocks(self):
        """Stored blocks: untied cores each have their own weights."""
        if self.layout == "pcc" and not self.tie_core:
            return self.n_prelude + self.n_passes * self.n_core + self.n_coda
        return self.n_layer

    @property
    def n_prelude(self):  # [X] the even split of n_layer into prelude / core / coda (core_split)
        return core_split(self.n_layer)[0]

    @property
    def n_core(self):
        return core_split(self.n_layer)[1]

    @property
    def n_coda(self):
        return core_split(self.n_layer)[2]

    def executed_layers(self, n_passes=None):
        """Block executions of one forward pass (each visit of a looped block counts)."""
        return sum(step.kind == "block" for step in execution_plan(self, n_passes))

    def uses_flex(self, device_type):
        """The attention backend: FlexAttention with a block mask on FLEX_DEVICES, else SDPA with a
        boolean document mask."""
        return device_type in FLEX_DEVICES

    @classmethod
    def from_dict(cls, d):
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown ModelConfig keys: {unknown}")
        return cls(**d)


# ----------------------------------------------------------------------------------------------------
# The model


@dataclass
class ForwardContext:
    """What one forward pass shares across its blocks."""
    cos: torch.Tensor
    sin: torch.Tensor
    mask: Optional[torch.Tensor]  # None -> plain causal attention
    block_mask: object = None  # FlexAttention BlockMask of the same document mask (attention="flex")
    cache: Optional["KVCache"] = None
    additive_mask: Optional[torch.Tensor] = None  # the mask as SDPA's additive one (additive_mask())
    attention_calls: int = 0  # counts the blocks run so far when a KV cache is filled


def additive_mask(mask, dtype):
    """A boolean mask as SDPA's additive one (0 / -inf, the conversion SDPA makes itself), built once per
    forward and shared by its blocks: SDPA would convert it on every call and keep each copy for the
    backward (4 x B x T^2 bytes per executed block in fp32)."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


class KVCache:
    """Keys and values of every executed block (a looped layer has one entry per visit), and the
    document ids of the cached positions for the document mask."""

    def __init__(self):
        self.keys, self.values = [], []
        self.doc_ids = None

    @property
    def length(self):
        return 0 if self.doc_ids is None else self.doc_ids.size(1)

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
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.embed_norm = RMSNorm(cfg.n_embd, NORM_EPS, cfg.norm_gain) if cfg.embed_norm else None
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_blocks))
        self.boundary = BoundaryOperator(cfg)  # [X3] (empty unless prelude-core-coda norms at its boundaries)
        self.norm_f = RMSNorm(cfg.n_embd, NORM_EPS, cfg.norm_gain)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        cos, sin = rope_tables(cfg.head_dim, cfg.block_size)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.plan = execution_plan(cfg)
        self.reset_parameters()
        self.activation_checkpointing = False  # recompute each executed block in the backward (train.py)

    @torch.no_grad()
    def reset_parameters(self):
        cfg = self.config
        if cfg.init == "x":  # [X]: zero out-projections and lm head, normal embedding, uniform inputs
            bound = cfg.uniform_init_scale / math.sqrt(cfg.n_embd)
            nn.init.normal_(self.wte.weight, std=cfg.embed_init_std)
            nn.init.zeros_(self.lm_head.weight)
            for block in self.blocks:
                a, f = block.attn, block.ffn
                for w in (a.q_proj.weight, a.k_proj.weight, a.v_proj.weight):
                    nn.init.uniform_(w, -bound, bound)
                nn.init.zeros_(a.o_proj.weight)
                if isinstance(f, MoE):
                    for w in (f.router.weight, f.w_gate, f.w_up):
                        nn.init.uniform_(w, -bound, bound)
                    nn.init.zeros_(f.w_down)
                else:
                    nn.init.uniform_(f.w_gate.weight, -bound, bound)
                    nn.init.uniform_(f.w_up.weight, -bound, bound)
                    nn.init.zeros_(f.w_down.weight)
        else:  # nanoGPT: normal(0.02), residual out-projections scaled down with executed depth
            out_std = 0.02 / math.sqrt(2 * cfg.executed_layers())
            for name, p in self.named_parameters():
                if p.dim() < 2:
                    continue
                is_out = name.endswith(("o_proj.weight", "w_down.weight", "w_down"))
                nn.init.normal_(p, std=out_std if is_out else 0.02)
        for m in self.modules():
            if isinstance(m, RMSNorm) and m.weight is not None:
                nn.init.ones_(m.weight)

    # ---- forward

    def forward(self, idx, targets=None, n_passes=None, cache=None, return_stats=False):
        """idx (B, T) token ids -> (logits (B, T, vocab), loss or None), and with return_stats the itemised
        losses and router load as a third item ({"ce", and for an MoE "balance", "z_loss", "expert_counts"}).
        targets: (B, T), -1 is ignored. n_passes: override K (pcc) or r (loops) for this call.
        cache: a KVCache; idx are then the new tokens that follow the cached ones.
        (probe.py looks inside with forward hooks: the forward pass itself keeps no probe state.)"""
        cfg = self.config
        B, T = idx.shape
        start = cache.length if cache is not None else 0
        if start + T > cfg.block_size:
            raise ValueError(f"sequence length {start + T} exceeds block_size={cfg.block_size}")
        # the document mask [S]: causal attention that never crosses an eot boundary (document_mask=False:
        # causal across documents, as [X] trains). Always built, as a FlexAttention block mask (CUDA) or a
        # boolean one: asking first whether a sequence holds a boundary would be a host read.
        docs = document_ids(idx, cfg.eot_token) if cfg.document_mask else torch.zeros_like(idx)
        mask = block_mask = None
        if cache is not None:  # the new tokens' documents continue the cached ones
            docs = docs + (cache.doc_ids[:, -1:] if cache.doc_ids is not None else 0)
            cache.doc_ids = docs if cache.doc_ids is None else torch.cat([cache.doc_ids, docs], dim=1)
            mask = attention_mask(docs, cache.doc_ids, start)
        elif cfg.document_mask and cfg.uses_flex(idx.device.type):
            block_mask = flex_block_mask(docs)
        elif cfg.document_mask:
            mask = attention_mask(docs, docs, 0)
        ctx = ForwardContext(self.rope_cos[start:start + T], self.rope_sin[start:start + T], mask, block_mask, cache,
                             additive_mask(mask, compute_dtype(idx.device.type, self.wte.weight.dtype)))

        plan = self.plan if n_passes is None else execution_plan(cfg, n_passes)
        h = self.wte(idx)
        if self.embed_norm is not None:
            h = self.embed_norm(h)
        anchor, routers = None, []
        for step in plan:
            if step.kind == "block":
                block = self.blocks[step.block]
                if self.activation_checkpointing and torch.is_grad_enabled():
                    # keep only the block's input; each visit recomputes its own activations in the backward
                    h, router = checkpoint(block, h, step.scale, ctx, use_reentrant=False)
                else:
                    h, router = block(h, step.scale, ctx)
                routers.append(router)
            elif step.kind == "anchor":  # e = prelude output; h0 = 0 when e is injected ([X] Algorithm 1)
                anchor = h
                if step.inject:
                    h = torch.zeros_like(h)
            else:  # [X3] boundary operator BO(h, e) = RMSNorm(h) + alpha * e
                h = self.boundary(h, anchor, step.norm, step.inject)
        logits = scaled(self.lm_head(self.norm_f(h)), cfg.output_multiplier)  # [X] OM on the unembedding
        if cfg.n_logits:  # a padded vocabulary's extra rows are cut before the softmax ([X] code)
            logits = logits[..., :cfg.n_logits]
        loss, stats = None, {}
        if targets is not None:
            ce = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
            loss, stats = ce, {"ce": ce.detach()}
            routers = [r for r in routers if r is not None]
            if routers:
                balance = torch.stack([r["balance"] for r in routers]).mean()
                z_loss = torch.stack([r["z_loss"] for r in routers]).mean()
                loss = ce + BALANCE_LOSS_COEF * balance + Z_LOSS_COEF * z_loss
                stats.update(balance=balance.detach(), z_loss=z_loss.detach(),
                             expert_counts=torch.stack([r["counts"] for r in routers]))
        return (logits, loss, stats) if return_stats else (logits, loss)

    # ---- generation

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, n_passes=None, generator=None):
        """Sample max_new_tokens after idx (B, T) with a KV cache (one entry per executed block).
        temperature=0 is greedy decoding. The whole sequence must fit in block_size."""
        if idx.size(1) + max_new_tokens > self.config.block_size:
            raise ValueError(f"prompt ({idx.size(1)}) + max_new_tokens ({max_new_tokens}) exceeds "
                             f"block_size={self.config.block_size}")
        cache = KVCache()
        logits, _ = self(idx, n_passes=n_passes, cache=cache)
        out = idx
        for _ in range(max_new_tokens):
            next_logits = logits[:, -1, :].float()
            if temperature == 0:
                next_token = next_logits.argmax(dim=-1, keepdim=True)
            else:
                next_logits = next_logits / temperature
                if top_k is not None:
                    kth = torch.topk(next_logits, min(top_k, next_logits.size(-1))).values[:, -1:]
                    next_logits = next_logits.masked_fill(next_logits < kth, float("-inf"))
                next_token = torch.multinomial(next_logits.softmax(dim=-1), 1, generator=generator)
            out = torch.cat([out, next_token], dim=1)
            logits, _ = self(next_token, n_passes=n_passes, cache=cache)
        return out

    # ---- accounting

    def num_params(self):
        """Parameter counts: embedding (token embedding + untied lm head), non-embedding, total, and
        active: non-embedding parameters one token touches (top_k experts of each MoE layer, every
        stored block it runs through once, whatever the number of visits). match.py must agree."""
        total = sum(p.numel() for p in self.parameters())
        embedding = self.wte.weight.numel() + (0 if self.config.tie_embeddings else self.lm_head.weight.numel())
        inactive = 0
        used_blocks = {s.block for s in self.plan if s.kind == "block"}
        for i, block in enumerate(self.blocks):
            block_params = sum(p.numel() for p in block.parameters())
            if i not in used_blocks:
                inactive += block_params
            elif isinstance(block.ffn, MoE):
                per_expert = 3 * math.prod(block.ffn.w_gate.shape[1:])  # gate, up, down: hidden x n_embd each
                inactive += (block.ffn.n_expert - block.ffn.top_k) * per_expert
        return dict(embedding=embedding, non_embedding=total - embedding, total=total,
                    active=total - embedding - inactive)
