"""
Budget accounting, triple matching and the GPU memory planner
[S §budget matching, Appendix A; S1; X10].

Arithmetic on a ModelConfig, nothing allocated: a 54B config is instant.

    python match.py config/smelt_200m_base.py --avg_doc_len 512  # budget table
    python match.py --preset smelt-200m-s95      # [S] baseline and SMELT twin
    python match.py config/smelt_200m_base.py --recipe smelt  # match a recipe
    python match.py config/x_d8_loop2.py --memory --vocab_size 50304  # GiB/GPU
    ... --json                                  # one JSON object, not a table

Per token, a multiply-add is 2 FLOPs and training is 3 x forward; softmax,
SwiGLU, RoPE and residual adds are not counted. Active params are what one
token touches; N_c [X10] counts the matrices once per execution.
The params equal GPT(cfg).num_params() and the matmul FLOPs torch's
FlopCounterMode on a real forward and backward (tests/test_match.py).
Every [S] scale and sparsity has a preset; each twin is within [S] Table 10's
mismatches. The memory planner is 0.86-1.20x PyTorch's FSDP2 memory tracker
(1.02-1.04x on the [X] d8 configs); docs/training.md has the table.
"""

import argparse
import itertools
import json
import math
import os
import time
from dataclasses import dataclass, fields, replace
from typing import NamedTuple

import torch

# nanoGPT's config file format: train.py reads the same files.
import configurator
from model import CE_CHUNK, GPT, TINY, ModelConfig, execution_plan

# -----------------------------------------------------------------------------
# Accounting


def resolve_attended(cfg, attended=None, avg_doc_len=None):
    """Mean keys per query: `attended`, else (L + 1) / 2 with L = avg_doc_len
    or block_size."""
    doc_len = cfg.block_size if avg_doc_len is None else avg_doc_len
    value = attended if attended is not None else (doc_len + 1) / 2
    if not (
        math.isfinite(value) and value > 0 and 1 <= doc_len <= cfg.block_size
    ):
        raise ValueError(
            f"attended={attended}, avg_doc_len={avg_doc_len}: need attended > 0 "
            f"and a document length in [1, block_size={cfg.block_size}]"
        )
    return float(value)


def block_shapes(cfg):
    """Parameter counts of one Block, in the pieces the accounting needs."""
    H = cfg.n_embd
    q, kv = cfg.n_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim
    # The q and o projections, then k and v.
    attn = 2 * H * q + 2 * H * kv
    gain = int(cfg.norm_gain)
    norms = 2 * H * gain + (2 * cfg.head_dim * gain if cfg.qk_norm else 0)
    router = cfg.n_expert * H
    # Each SwiGLU has gate, up and down matrices.
    per_expert = 3 * H * cfg.expert_hidden if cfg.n_expert else 0
    if cfg.n_expert:
        ffn_all = cfg.n_expert * per_expert
        ffn_active = cfg.top_k * per_expert
    else:
        ffn_all = ffn_active = 3 * H * cfg.mlp_hidden
    total = attn + norms + router + ffn_all
    return dict(
        attn=attn,
        router=router,
        per_expert=per_expert,
        ffn_all=ffn_all,
        ffn_active=ffn_active,
        total=total,
        active=total - ffn_all + ffn_active,
        matmul_active=attn + router + ffn_active,
    )


def norm_flops(cfg, dim):
    # Square, sum and scale, plus one multiply for the gain.
    return (4 if cfg.norm_gain else 3) * dim


FLOP_ITEMS = ("attn_proj", "attn_scores", "router", "ffn", "norms", "unembedding")


def accounting(
    cfg, attended=None, n_passes=None, avg_doc_len=None, kv_bytes_per_element=2
):
    """The per-token budget table of a config. n_passes overrides K or r, as
    in model.execution_plan."""
    attended = resolve_attended(cfg, attended, avg_doc_len)
    plan = execution_plan(cfg, n_passes)
    executed = [s.block for s in plan if s.kind == "block"]
    H, V, shapes = cfg.n_embd, cfg.vocab_size, block_shapes(cfg)
    embedding = V * H * (1 if cfg.tie_embeddings else 2)
    # norm_f, embed_norm and the one boundary norm are global.
    boundary_norm = cfg.layout.startswith("pcc") and cfg.boundary in ("both", "norm")
    globals_ = H * cfg.norm_gain * (1 + cfg.embed_norm + boundary_norm)
    nonembedding = cfg.n_blocks * shapes["total"] + globals_

    # Forward FLOPs: every block execution, every boundary [X3], the embedding
    # and final norms, and the head.
    q, n_exec = cfg.n_head * cfg.head_dim, len(executed)
    qk_norms = (
        cfg.qk_norm * (cfg.n_head + cfg.n_kv_head) * norm_flops(cfg, cfg.head_dim)
    )
    forward = dict(
        attn_proj=2 * shapes["attn"] * n_exec,
        attn_scores=4 * q * attended * n_exec,
        router=2 * shapes["router"] * n_exec,
        ffn=2 * shapes["ffn_active"] * n_exec,
        norms=n_exec * (2 * norm_flops(cfg, H) + qk_norms),
        unembedding=2 * H * V,
    )
    for s in plan:
        if s.kind == "boundary":
            forward["norms"] += s.norm * norm_flops(cfg, H) + s.inject * 2 * H
    forward["norms"] += norm_flops(cfg, H) * (1 + cfg.embed_norm)
    flops = 3 * sum(forward.values())

    # N_c [X10]: the matrices one token multiplies, once per execution.
    compute_active = n_exec * shapes["matmul_active"] + V * H
    kv = n_exec * 2 * cfg.n_kv_head * cfg.head_dim
    # Active params count each stored block the plan runs once.
    active = len(set(executed)) * shapes["active"] + globals_
    return dict(
        attended=attended,
        executed_layers=n_exec,
        stored_blocks=cfg.n_blocks,
        params_total=nonembedding + embedding,
        params_embedding=embedding,
        params_nonembedding=nonembedding,
        params_active=active,
        params_compute_active=compute_active,
        params_stored=nonembedding + embedding,
        **{f"flops_{k}": 3 * forward[k] for k in FLOP_ITEMS},
        flops_per_token=flops,
        flops_forward=flops / 3,
        flops_6n=6 * compute_active,
        kv_per_token=kv,
        kv_bytes_per_token=kv * kv_bytes_per_element,
    )


def flops_per_token(cfg, attended=None, n_passes=None, backward=True, avg_doc_len=None):
    """FLOPs per token over every block execution; training is 3 x forward."""
    a = accounting(cfg, attended, n_passes, avg_doc_len)
    return a["flops_per_token"] if backward else a["flops_forward"]


def run_flops(cfg, phases, attended=None, avg_doc_len=None):
    """FLOPs of a run whose depth changes ([X13] growth). phases holds
    (tokens, n_passes), (tokens, ModelConfig) or (tokens, ModelConfig,
    n_passes): an untied growth stores more blocks. Returns the totals and the
    token-weighted means."""
    total = tokens = n_c = passes = 0.0
    for phase_tokens, what, *drawn in phases:
        if isinstance(what, ModelConfig):
            phase_cfg, k = what, drawn[0] if drawn else None
        else:
            phase_cfg, k = cfg, what
        a = accounting(phase_cfg, attended, k, avg_doc_len)
        total += phase_tokens * a["flops_per_token"]
        n_c += phase_tokens * a["params_compute_active"]
        passes += phase_tokens * (phase_cfg.n_passes if k is None else k)
        tokens += phase_tokens
    return dict(
        flops=total,
        tokens=tokens,
        flops_per_token=total / tokens,
        params_compute_active=n_c / tokens,
        mean_passes=passes / tokens,
    )


def fully_activated(cfg):
    """[S1]'s reference at the same scale: one plain pass, every expert active."""
    n_expert = cfg.top_k if cfg.n_expert else 0
    return cfg.replace(layout="plain", n_passes=1, n_expert=n_expert)


def sparsity(cfg, attended=None, baseline=None, n_passes=None, avg_doc_len=None):
    """[S1]: N_act^eq = (F / F0) N0 and S = 1 - N_act^eq / N."""
    # F0 and N0 are the fully activated reference's, of `baseline` for a
    # matched twin. A looped dense model has S < 0.
    a = accounting(cfg, attended, n_passes, avg_doc_len)
    a0 = accounting(fully_activated(baseline or cfg), attended, None, avg_doc_len)
    F, F0 = a["flops_per_token"], a0["flops_per_token"]
    N, N0 = a["params_nonembedding"], a0["params_nonembedding"]
    return dict(F=F, N=N, F0=F0, N0=N0, N_act_eq=F / F0 * N0, S=1 - F / F0 * N0 / N)


# -----------------------------------------------------------------------------
# Triple budget matching [S §budget matching]: a looped twin with its
# baseline's FLOPs, non-embedding params and KV cache per token.

RECIPES = {
    # [S]: the middle half runs twice, its updates scaled by 1/r.
    "smelt": dict(layout="smelt", n_passes=2),
    "smelt3": dict(layout="smelt", n_passes=3),
    "layer_loop": dict(layout="layer_loop", n_passes=2),
    # [X] Loop-2 (one tied core, two passes) and Untied-2.
    "pcc2": dict(layout="pcc", n_passes=2),
    "pcc2_untied": dict(layout="pcc_untied", n_passes=2),
}
BUDGET_KEYS = dict(flops="flops_per_token", params="params_nonembedding", kv="kv_per_token")


def parse_recipe(recipe):
    """A dict of ModelConfig overrides, a name in RECIPES, or 'key=value,...'."""
    if isinstance(recipe, dict) or recipe in RECIPES:
        return dict(RECIPES.get(recipe, recipe) if isinstance(recipe, str) else recipe)
    if not all("=" in item for item in str(recipe).split(",")):
        raise ValueError(
            f"recipe {recipe!r}: expected a name in {sorted(RECIPES)} or key=value pairs"
        )
    pairs = (item.split("=", 1) for item in recipe.split(","))
    # Numbers and booleans are JSON; anything else stays a string.
    return {
        k.strip(): json.loads(v) if v[:1].isdigit() or v in ("true", "false") else v
        for k, v in pairs
    }


@dataclass(frozen=True)
class MatchSearch:
    """What match() searches and how close it must get."""

    # Fractions of the baseline's budgets. The FLOPs tolerance is (below,
    # above): the twin never gets less compute, as in [S] Table 10.
    flops_tol: tuple = (0.0, 0.05)
    params_tol: float = 0.015
    kv_tol: float = 0.04
    # Grids of n_embd, then of n_expert, tried coarsest first.
    width_multiple: tuple = (32, 16, 8)
    expert_multiple: tuple = (8, 4, 2, 1)
    # expert_hidden (or mlp_hidden) is rounded to this.
    hidden_multiple: int = 16
    head_multiple: int = 8
    head_dim_range: tuple = (16, 256)

    def __post_init__(self):
        # Normalise the fields once (the dataclass is frozen).
        set_ = object.__setattr__
        tol = self.flops_tol
        set_(self, "flops_tol", tuple((tol, tol) if isinstance(tol, (int, float)) else tol))
        for name in ("width_multiple", "expert_multiple"):
            value = getattr(self, name)
            set_(self, name, (value,) if isinstance(value, int) else tuple(value))

        # NaN fails the fraction test too.
        def fraction(t):
            return isinstance(t, (int, float)) and 0 <= t < 1

        def grid(m):
            return isinstance(m, int) and m >= 1

        def grids(ms):
            return bool(ms) and all(map(grid, ms))

        lo_hi = tuple(self.head_dim_range)
        checks = dict(
            flops_tol=len(self.flops_tol) == 2 and all(map(fraction, self.flops_tol)),
            params_tol=fraction(self.params_tol),
            kv_tol=fraction(self.kv_tol),
            width_multiple=grids(self.width_multiple),
            expert_multiple=grids(self.expert_multiple),
            hidden_multiple=grid(self.hidden_multiple),
            head_multiple=grid(self.head_multiple),
            head_dim_range=len(lo_hi) == 2
            and all(map(grid, lo_hi))
            and 2 <= lo_hi[0] <= lo_hi[1],
        )
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise ValueError(
                f"match option {bad[0]}={getattr(self, bad[0])!r} out of range: "
                "tolerances are fractions in [0, 1), grids integers >= 1, "
                "head_dim_range (lo, hi) with 2 <= lo <= hi"
            )


class Candidate(NamedTuple):
    """One configuration match() considered; they sort by the first six fields."""

    # How far the budgets fall outside their tolerances, summed (0: a match).
    violation: float
    # Lower is better.
    score: float
    n_embd: int
    head_dim: int
    n_kv_head: int
    n_head: int
    cfg: ModelConfig
    # budget -> matched / baseline
    ratios: dict
    violations: dict


def match(
    baseline,
    recipe="smelt",
    attended=None,
    avg_doc_len=None,
    budgets=("flops", "params", "kv"),
    search=None,
    **options,
):
    """Match baseline + recipe to the baseline's training FLOPs, non-embedding
    params and KV cache per token. Returns (matched_cfg, report), with the
    ratios of [S] Table 10 in report["ratios"]. search is a MatchSearch;
    keyword options override its fields. A budget left out of `budgets` is
    reported, not matched."""
    t0 = time.perf_counter()
    search = replace(search or MatchSearch(), **options)
    overrides, budgets = parse_recipe(recipe), tuple(budgets)
    if not budgets or not set(budgets) <= set(BUDGET_KEYS):
        raise ValueError(f"budgets={budgets}: give at least one of {sorted(BUDGET_KEYS)}")
    a_base = accounting(baseline, attended, avg_doc_len=avg_doc_len)
    template = baseline.replace(**overrides)
    if template.n_passes < 2 or template.executed_layers() <= baseline.executed_layers():
        raise ValueError(
            f"recipe {overrides}: the twin ({template.layout}, "
            f"n_passes={template.n_passes}) executes {template.executed_layers()} "
            f"blocks per token, the baseline ({baseline.layout}) "
            f"{baseline.executed_layers()}: a recipe must loop a looped layout "
            ">= 2 times over a plain baseline"
        )
    heads = kv_head_shapes(
        baseline, template.executed_layers(), a_base["kv_per_token"], budgets, search
    )

    # Try the grids coarsest first and stop at the first one with a match.
    closest = found_in = None
    for grid in itertools.product(search.width_multiple, search.expert_multiple):
        candidates = match_candidates(
            baseline, template, budgets, a_base, heads, search, *grid
        )
        if candidates and (closest is None or candidates[0][:2] < closest[:2]):
            closest, found_in = candidates[0], (grid, len(candidates))
        if closest is not None and closest.violation == 0:
            break
    cfg, r = closest.cfg, closest.ratios
    if closest.violation > 0:
        (f_lo, f_hi), tol = search.flops_tol, dict(params=search.params_tol, kv=search.kv_tol)
        bounds = {b: f"1 +- {t:.3f}" for b, t in tol.items()}
        bounds["flops"] = f"[{1 - f_lo:.3f}, {1 + f_hi:.3f}]"
        misses = [
            f"{b} budget not met: ratio {r[b]:.4f} outside {bounds[b]} by {v * 100:.2f}%"
            for b, v in closest.violations.items()
            if v > 0
        ]
        raise ValueError(
            f"no configuration matches {overrides} to the baseline; the closest "
            f"(n_embd={cfg.n_embd}, n_expert={cfg.n_expert}, "
            f"head_dim={cfg.head_dim}, n_kv_head={cfg.n_kv_head}): " + "; ".join(misses)
        )
    attended = a_base["attended"]
    (multiple, e_multiple), n_candidates = found_in
    return cfg, dict(
        recipe=overrides,
        attended=attended,
        ratios=r,
        score=closest.score,
        baseline=a_base,
        matched=accounting(cfg, attended),
        sparsity_baseline=sparsity(baseline, attended),
        sparsity_matched=sparsity(cfg, attended, baseline=baseline),
        candidates=n_candidates,
        width_multiple=multiple,
        expert_multiple=e_multiple,
        seconds=time.perf_counter() - t0,
    )


def kv_head_shapes(baseline, executed, kv_base, budgets, search):
    """Every (head_dim, n_kv_head) within the KV budget; without one, the
    baseline's."""
    if "kv" not in budgets:
        return [(int(baseline.head_dim), int(baseline.n_kv_head))]
    lo, hi = search.head_dim_range
    step = search.head_multiple
    pairs = [
        (hd, n_kv)
        for hd in range(lo + (-lo) % step, hi + 1, step)
        for n_kv in range(1, 257)
    ]

    def ratio(p):
        return executed * 2 * p[0] * p[1] / kv_base

    heads = [p for p in pairs if abs(ratio(p) - 1) <= search.kv_tol]
    if not heads:
        best = min(pairs, key=lambda p: abs(ratio(p) - 1))
        raise ValueError(
            f"KV budget cannot be met: {executed} executed layers need "
            f"2 x n_kv_head x head_dim = {kv_base / executed:.1f} per layer; "
            f"the nearest, n_kv_head={best[1]}, head_dim={best[0]}, is off by "
            f"{abs(ratio(best) - 1) * 100:.1f}% (kv_tol {search.kv_tol:g})"
        )
    return heads


def match_candidates(
    baseline, template, budgets, a_base, heads, search, width_multiple, expert_multiple
):
    """Every Candidate of match() on one (width, expert count) grid, best first."""
    # An exhaustive search over the widths and head shapes, with the head and
    # expert counts each implies.
    H_b, moe = baseline.n_embd, baseline.n_expert > 0
    q_b = baseline.n_head * baseline.head_dim
    hidden_b = baseline.expert_hidden if moe else baseline.mlp_hidden
    f_lo, f_hi = search.flops_tol
    tol = dict(flops=max(f_lo + f_hi, 1e-3), params=search.params_tol, kv=search.kv_tol)

    def round_to(x, m):
        return max(m, m * round(x / m))

    candidates = []
    H_first = max(width_multiple, round_to(H_b / 4, width_multiple))
    for H in range(H_first, 2 * H_b + 1, width_multiple):
        # Narrowing shrinks each expert (or the MLP) with the width.
        hidden = round_to(hidden_b * H / H_b, search.hidden_multiple)
        for hd, n_kv in heads:
            # Query heads per KV head that keep the scaled query width.
            target = q_b * H / H_b / hd / n_kv
            n_heads = {n_kv * max(1, math.floor(target)), n_kv * math.ceil(target)}
            for n_head in sorted(n_heads):
                shape = dict(n_embd=H, n_head=n_head, n_kv_head=n_kv, head_dim=hd)
                if moe:
                    shape.update(expert_hidden=hidden, mlp_hidden=0)
                else:
                    shape.update(mlp_hidden=hidden)
                try:
                    cfg = template.replace(**shape)
                except ValueError:
                    continue
                # The params are affine in n_expert: solve for it, then round.
                if moe and "params" in budgets:
                    # An expert's matrices and its router row.
                    per_expert = 3 * H * hidden + H
                    per_layer = cfg.n_blocks * per_expert
                    fixed = accounting(cfg)["params_nonembedding"] - per_layer * cfg.n_expert
                    n_exp = (a_base["params_nonembedding"] - fixed) / per_layer
                    n_exp = max(round_to(n_exp, expert_multiple), cfg.top_k)
                    cfg = cfg.replace(n_expert=n_exp)
                a = accounting(cfg, a_base["attended"])
                r = {b: a[key] / a_base[key] for b, key in BUDGET_KEYS.items()}
                violations = dict(
                    flops=max(0.0, 1 - f_lo - r["flops"], r["flops"] - 1 - f_hi),
                    params=max(0.0, abs(r["params"] - 1) - search.params_tol),
                    kv=max(0.0, abs(r["kv"] - 1) - search.kv_tol),
                )
                violations = {b: violations[b] for b in budgets}
                score = sum(((r[b] - 1) / tol[b]) ** 2 for b in budgets)
                # Penalise a query width, and weakly a head size or KV-head
                # count, far from the baseline's.
                score += (math.log(n_head * hd / (q_b * H / H_b)) / 0.05) ** 2
                score += (math.log(hd / baseline.head_dim) / 0.5) ** 2
                score += (math.log(n_kv / baseline.n_kv_head) / 0.5) ** 2
                violation = sum(violations.values())
                row = (violation, score, H, hd, n_kv, n_head, cfg, r, violations)
                candidates.append(Candidate(*row))
    return sorted(candidates, key=lambda c: c[:6])


# -----------------------------------------------------------------------------
# The GPU memory planner: bytes per GPU of training a config as train.py does,
# with fp32 weights and gradients and a bf16 autocast forward.
# Muon keeps one fp32 momentum per hidden matrix, AdamW two fp32 moments.
# Under DDP every GPU holds everything.
# FSDP2 ("fsdp") shards each block and the root on dim 0, gathers blocks in
# bf16 and checkpoints each executed block unless told not to.
# "fsdp_grad_op" keeps each gathered block from its forward to its backward.

GIB = 2**30
# Kept free on each GPU: CUDA context, NCCL buffers, fragmentation.
HEADROOM = 0.10
MODES = ("ddp", "fsdp", "fsdp_grad_op")


def parameters(cfg):
    """(shape, "muon" or "adamw") of each parameter of GPT(cfg), built on the
    meta device. As in train.py, Muon takes the block matrices but the routers."""
    with torch.device("meta"):
        named = list(GPT(cfg).named_parameters())

    def group(name, p):
        outside = name.startswith(("wte.", "lm_head.")) or ".router." in name
        return "muon" if p.dim() >= 2 and not outside else "adamw"

    return [(p.shape, group(name, p)) for name, p in named]


def state_bytes_per_rank(cfg, world_size=1, optimizer="muon"):
    """Weights, gradients and optimizer state on the fullest rank."""
    # Weights and gradients take 4 B, Muon 4 B and AdamW 8 B. Each parameter
    # is sharded on dim 0 like FSDP2's torch.chunk; world_size=1 is DDP.
    # muon_x's per-row second moment is left out.
    return sum(
        -(-shape[0] // world_size)
        * math.prod(shape[1:])
        * (12 if group == "muon" and optimizer != "adamw" else 16)
        for shape, group in parameters(cfg)
    )


def optimizer_step_bytes(cfg, world_size=1, optimizer="muon", sharded=False):
    """The optimizer step's temporaries on the fullest rank, as on CUDA."""
    # Muon holds each matrix's direction and orthogonalised result, 4 B each
    # per element (muon_x 4 B more). A sharded 2-D matrix adds 6 B: its bf16
    # result shard, and the gathered pieces and result on its owner.
    # Fused AdamW needs none.
    per_element = 0 if optimizer == "adamw" else 8 + 4 * (optimizer == "muon_x")

    def held(shape):
        return -(-shape[0] // world_size) * math.prod(shape[1:])

    return sum(
        held(shape) * (per_element + 6 * (sharded and len(shape) == 2))
        for shape, group in parameters(cfg)
        if group == "muon" and per_element
    )


def activation_bytes(
    cfg, micro_batch, mixed_precision=True, checkpointing=False, kernels=False, n_passes=None
):
    """Bytes autograd keeps for the backward of micro_batch x block_size tokens."""
    # Bytes per element: a for matmul operands, f for what stays fp32 (the
    # residual stream, statistics, router logits), i for int64 indices.
    a, f, i = (2 if mixed_precision else 4), 4, 8
    H, V, E, k = cfg.n_embd, cfg.vocab_size, cfg.n_expert, cfg.top_k
    q, kv = cfg.n_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim
    # The PyTorch RMSNorm keeps x * rstd for its gain; the kernels do not.
    g = int(cfg.norm_gain and not kernels)
    norm = f * H + f + g * f * H
    # Autocast keeps one cast of a norm's output per matmul that reads it.
    copies = (lambda n: n) if mixed_precision else (lambda n: 1)  # noqa: E731

    # Attention keeps the norm, its casts, q k v, the output, the softmax
    # statistics (no T x T with flash or flex) and the o_proj input.
    attention = norm + copies(3) * a * H + a * (q + 2 * kv) + a * q
    attention += f * cfg.n_head + a * q
    if cfg.qk_norm:
        attention += a * (q + kv) + f * (cfg.n_head + cfg.n_kv_head) + g * f * (q + kv)
    if E:
        # MoE keeps the norm, its cast, the router's fp32 logits and weights,
        # and per routed token its rows, indices, weight and output. The
        # PyTorch path (model.run_experts) gathers the rows once and its
        # scatter back keeps only the index.
        hidden = cfg.expert_hidden
        routed = a * (2 * H + 2 * hidden) if kernels else a * H + 5 * a * hidden
        ffn = norm + a * H + f * (2 * E + 2) + k * (routed + 3 * i + f + a)
    else:
        # A dense SwiGLU keeps 4 hidden-sized tensors, 3 with the kernel.
        ffn = norm + copies(2) * a * H + (3 if kernels else 4) * a * cfg.mlp_hidden
    plan = execution_plan(cfg, n_passes)
    executed = sum(s.kind == "block" for s in plan)
    # Each boundary [X3] with a norm keeps that norm's tensors.
    boundaries = sum(norm for s in plan if s.kind == "boundary" and s.norm)
    block, tokens = attention + ffn, micro_batch * cfg.block_size

    # The loss keeps fp32 logits, or past CE_CHUNK logits the bf16 ones
    # (model.cross_entropy recomputes a chunk's fp32 copy).
    chunked = tokens * V > CE_CHUNK
    logits = a * V if chunked else f * V
    # Outside the blocks: indices, embed norm, boundaries, then the head's
    # norm, cast, logits and targets.
    outside = i + norm * cfg.embed_norm + boundaries + norm + a * H + logits + i
    # Checkpointing keeps only each block's input and recomputes one at a time.
    saved = tokens * (outside + executed * (f * H if checkpointing else block))
    recompute = tokens * block if checkpointing else 0
    # The eager cross-entropy's backward: two fp32 logits and a cast, or past
    # CE_CHUNK the chunks' gradients and one chunk's fp32 recompute.
    if chunked:
        logits_grad = tokens * a * V + 3 * f * CE_CHUNK
    else:
        logits_grad = tokens * (2 * f + (a < f) * a) * V
    head = tokens * (norm + a * H + logits + i)
    return dict(
        saved=saved,
        recompute=recompute,
        logits_grad=logits_grad,
        head=head,
        per_block=tokens * block,
        tokens=tokens,
        total=saved + max(logits_grad, recompute - head),
    )


def weight_copy_bytes(cfg, n_passes=None):
    """The bf16 weight copies autograd keeps under DDP with autocast."""
    # A leaf weight's cast is cached once per forward, but the experts are
    # cast once per executed MoE block.
    shapes, executed = block_shapes(cfg), cfg.executed_layers(n_passes)
    experts = shapes["ffn_all"] if cfg.n_expert else 0
    per_block = shapes["attn"] + shapes["router"] + shapes["ffn_all"] - experts
    cached = cfg.n_blocks * per_block
    return 2 * (cached + cfg.vocab_size * cfg.n_embd + executed * experts)


def memory_plan(
    cfg,
    world_size,
    micro_batch,
    optimizer="muon",
    gpu_gb=80,
    mixed_precision=True,
    kernels=False,
    n_passes=None,
    headroom=HEADROOM,
    checkpointing=True,
):
    """GiB per GPU of training cfg, micro_batch sequences per GPU, on
    world_size GPUs: per parallel mode, the peak's parts and total, whether it
    fits and the largest micro-batch that does."""
    # Bytes of a gathered block parameter, and of its gradient.
    p = 2 if mixed_precision else 4
    n_params = sum(math.prod(shape) for shape, _ in parameters(cfg))
    block = block_shapes(cfg)["total"]
    root = n_params - cfg.n_blocks * block
    head_copy = (p // 2) * 2 * cfg.vocab_size * cfg.n_embd
    states = dict(ddp=state_bytes_per_rank(cfg, 1, optimizer))
    states["fsdp"] = states["fsdp_grad_op"] = state_bytes_per_rank(cfg, world_size, optimizer)
    # DDP's gradient buckets (4 B per param) and autocast's weight copies.
    ddp_extra = 4 * n_params + (weight_copy_bytes(cfg, n_passes) if mixed_precision else 0)

    def peak(mode, micro_batch):
        """(activation bytes, peak bytes) of one mode at micro_batch."""
        ddp = mode == "ddp"
        a = activation_bytes(
            cfg, micro_batch, mixed_precision, not ddp and checkpointing, kernels, n_passes
        )
        # The optimizer step over the states is the last moment of a step.
        step = states[mode] + optimizer_step_bytes(
            cfg, 1 if ddp else world_size, optimizer, sharded=not ddp
        )
        if ddp:
            forward_backward = states[mode] + a["total"] + ddp_extra
            return a["total"], max(forward_backward, step + 4 * n_params)
        # FSDP2 peaks at one of two moments of the backward, over this rank's
        # shards. The cross-entropy's backward holds every saved tensor, the
        # logits' gradient, the fp32 root (kept gathered) and two blocks.
        cross_entropy = a["saved"] + a["logits_grad"] + root * 4 + 2 * p * block
        # A block's backward holds the saved tensors but the head's, one
        # recomputed block, the root's weights and gradients, two blocks, and
        # a block's gradient in bf16 and in fp32 for the reduce-scatter.
        block_backward = (
            a["saved"] - a["head"] + a["recompute"] + root * 8 + (3 * p + 4) * block
        )
        # fsdp_grad_op keeps every other stored block gathered too.
        kept = (cfg.n_blocks - 1) * block * p if mode == "fsdp_grad_op" else 0
        backward = states[mode] + kept + head_copy + max(cross_entropy, block_backward)
        return a["total"], max(backward, step)

    usable = (1 - headroom) * gpu_gb * GIB
    plan = dict(
        world_size=world_size,
        micro_batch=micro_batch,
        tokens_per_gpu=micro_batch * cfg.block_size,
        optimizer=optimizer,
        mixed_precision=mixed_precision,
        gpu_gb=gpu_gb,
        usable_gb=usable / GIB,
    )
    gathers = dict(
        fsdp=2 * cfg.executed_layers(n_passes) * block * p,
        fsdp_grad_op=cfg.n_blocks * block * p,
    )
    for mode in MODES:
        act, total = peak(mode, micro_batch)
        # Bisect for the largest micro-batch that fits: the peak grows with it.
        lo, hi = 0, 2**20
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if peak(mode, mid)[1] <= usable else (lo, mid - 1)
        plan[mode] = dict(
            states_gb=states[mode] / GIB,
            activations_gb=act / GIB,
            transient_gb=(total - states[mode] - act) / GIB,
            total_gb=total / GIB,
            fits=total <= usable,
            activation_checkpointing=mode != "ddp" and checkpointing,
            max_micro_batch=lo,
        )
        if mode in gathers:
            plan[mode]["all_gather_gb"] = gathers[mode] * (world_size - 1) / world_size / GIB
    return plan


def memory_table(plan, label=""):
    p = plan
    precision = "bf16 autocast" if p["mixed_precision"] else "fp32"
    lines = [
        f"{label}memory per GPU (GiB): {p['world_size']} GPUs x {p['gpu_gb']:g} GiB, "
        f"fits if total <= {p['usable_gb']:.1f} ({HEADROOM:.0%} headroom)",
        f"  micro-batch {p['micro_batch']} x {p['tokens_per_gpu'] // p['micro_batch']} "
        f"tokens, {p['optimizer']}, {precision}; activation checkpointing with FSDP2",
        f"  {'parallel':<13} {'states':>7} {'activations':>11} {'transient':>9} "
        f"{'total':>7} {'fits':>4} {'max micro-batch':>15} "
        f"{'all-gathers / micro-batch':>25}",
    ]
    for mode in MODES:
        m = p[mode]
        gathers = f"{m['all_gather_gb']:.1f}" if "all_gather_gb" in m else "-"
        fits = "yes" if m["fits"] else "no"
        lines.append(
            f"  {mode:<13} {m['states_gb']:>7.1f} {m['activations_gb']:>11.1f} "
            f"{m['transient_gb']:>9.1f} {m['total_gb']:>7.1f} {fits:>4} "
            f"{m['max_micro_batch']:>15} {gathers:>25}"
        )
    return "\n".join(lines)


# -----------------------------------------------------------------------------
# The command line: a config file or an [S] preset, matched to a recipe or
# planned in memory.
#
# The [S] presets are the paper's four scales. Its baselines are not published
# in full; these rules reproduce its 200M, S~0.95 worked example.
# head_dim is 128 (96 at H=672), the query width H, with 2 KV heads (1 when
# n_head is odd).
# expert_hidden is H/3 rounded up to 16, but 560 at 100M to reach the paper's
# 0.100B active params.
# Expert counts aim at S ~ 0.85, 0.95 and 0.97.

# name: (n_layer, n_embd, n_head, head_dim, expert_hidden, {S: experts})
SCALES = {
    "100m": (10, 672, 7, 96, 560, {85: 56, 95: 176, 97: 288}),
    "200m": (12, 1280, 10, 128, 432, {85: 64, 95: 192, 97: 336}),
    "600m": (20, 1792, 14, 128, 592, {85: 64, 95: 192, 97: 336}),
    "1.6b": (30, 2304, 18, 128, 768, {85: 64, 95: 192, 97: 336}),
}
PRESETS = [f"smelt-{scale}-s{s}" for scale, v in SCALES.items() for s in v[-1]]
PRESET_DOC_LEN = 512


def preset_baseline(name):
    """'smelt-200m-s95' -> the [S] baseline ModelConfig."""
    _, scale, s = name.split("-")
    n_layer, H, n_head, hd, hidden, experts = SCALES[scale]
    return ModelConfig(
        vocab_size=4096,
        block_size=4096,
        n_layer=n_layer,
        n_embd=H,
        n_head=n_head,
        n_kv_head=2 if n_head % 2 == 0 else 1,
        head_dim=hd,
        n_expert=experts[int(s[1:])],
        top_k=8,
        expert_hidden=hidden,
    )


def read_config(path, vocab_size=4096):
    """A config file -> (ModelConfig, its other settings, where the vocabulary
    came from): the model `python train.py PATH` trains."""
    # As in train.py, the vocabulary and mean document length come from
    # data_dir/meta.json, else vocab_size.
    values = {**TINY, **configurator.read_config(path)}
    model_fields = {f.name for f in fields(ModelConfig)}
    settings = {k: v for k, v in values.items() if k not in model_fields}
    meta_path = os.path.join(settings.get("data_dir") or "", "meta.json")
    if settings.get("data_dir") and os.path.isfile(meta_path):
        with open(meta_path) as f:
            meta = json.load(f)
        n_vocab = meta["n_vocab"]
        padded = 64 * math.ceil(n_vocab / 64)
        data = dict(
            vocab_size=padded,
            eot_token=meta["eot_token"],
            n_logits=n_vocab * (padded > n_vocab),
        )
        settings["mean_doc_len"], where = meta.get("mean_doc_len"), meta_path
    else:
        data, where = dict(vocab_size=vocab_size), "--vocab_size"
    model_values = {k: v for k, v in values.items() if k in model_fields}
    cfg = ModelConfig(**data, **model_values)
    if settings.get("mean_doc_len"):
        settings["mean_doc_len"] = min(settings["mean_doc_len"], cfg.block_size)
    return cfg, settings, where


def summary(cfg, attended, baseline=None):
    """A config's column of the side-by-side table (and of --json)."""
    a = accounting(cfg, attended)
    shape = "n_layer n_embd n_head n_kv_head head_dim n_expert top_k expert_hidden"
    budgets = ("flops_per_token", "params_nonembedding", "params_active", "kv_per_token")
    return dict(
        {k: getattr(cfg, k) for k in shape.split()},
        layout=cfg.layout,
        executed_layers=a["executed_layers"],
        **{k: a[k] for k in budgets},
        sparsity_S=sparsity(cfg, attended, baseline=baseline)["S"],
        attended=attended,
    )


def short(v):
    """4 significant digits, e-notation from 1e6."""
    if isinstance(v, str) or (isinstance(v, int) or v.is_integer()) and abs(v) < 1e6:
        return str(int(v) if isinstance(v, float) else v)
    return f"{v:.4g}" if abs(v) < 1e4 else f"{v:.4e}"


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="match.py",
        usage=argparse.SUPPRESS,
        description=__doc__.split("\n\n")[0].strip(),
        allow_abbrev=False,
    )
    arg = parser.add_argument
    arg("config", nargs="?", help="config/NAME.py (nanoGPT style)")
    arg(
        "--preset",
        choices=PRESETS,
        metavar="NAME",
        help="an [S] baseline, matched to --recipe (default: smelt): "
        + ", ".join(PRESETS),
    )
    arg(
        "--recipe",
        metavar="RECIPE",
        help=f"match to a loop recipe: {sorted(RECIPES)} or key=value,...",
    )
    arg(
        "--avg_doc_len",
        type=float,
        metavar="L",
        help="mean document length (default: the data's, else block_size; "
        f"presets {PRESET_DOC_LEN})",
    )
    arg(
        "--attended",
        type=float,
        metavar="K",
        help="mean attended keys per query (overrides avg_doc_len)",
    )
    arg(
        "--vocab_size",
        type=int,
        default=4096,
        metavar="V",
        help="when the config's data_dir has no meta.json (default 4096: "
        "gpt2-4096; the [X] d8 configs' GPT-2 is 50304)",
    )
    arg("--json", action="store_true", help="print one JSON object")
    arg = parser.add_argument_group("the memory planner").add_argument
    arg("--memory", action="store_true", help="GiB per GPU under ddp, fsdp, fsdp_grad_op")
    arg("--world_size", type=int, default=8, metavar="N", help="GPUs (default 8)")
    arg(
        "--micro_batch",
        type=int,
        metavar="B",
        help="sequences per GPU (default: batch_size, else 1)",
    )
    arg("--gpu_gb", type=float, default=80, metavar="GB", help="GiB of one GPU (default 80)")
    arg(
        "--optimizer",
        choices=("muon", "muon_x", "adamw"),
        help="(default: the config's, else muon)",
    )
    arg("--fp32", action="store_true", help="no bf16 autocast")
    arg("--triton", action="store_true", help="the Triton kernels' activations")
    args = parser.parse_args(argv)

    positive = ("avg_doc_len", "attended", "vocab_size", "world_size", "micro_batch", "gpu_gb")
    for name in positive:
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and value > 0):
            parser.error(f"argument --{name}: {value}: must be a finite number > 0")
    if bool(args.config) == bool(args.preset):
        parser.error("give a config file or --preset")
    try:
        if args.preset:
            base, settings, where = preset_baseline(args.preset), {}, "the preset"
            doc_len = args.avg_doc_len or PRESET_DOC_LEN
            recipe = args.recipe or "smelt"
        else:
            base, settings, where = read_config(args.config, args.vocab_size)
            doc_len = args.avg_doc_len or settings.get("mean_doc_len")
            recipe = args.recipe
        attended = resolve_attended(base, args.attended, doc_len)
        matched, report = None, None
        if recipe:
            matched, report = match(base, recipe, attended=attended)
    except ValueError as e:
        parser.error(str(e))

    lines = [f"vocab_size {base.vocab_size} from {where}, attended {attended:g} keys per query"]
    if args.memory:
        models = dict(baseline=base, matched=matched) if matched else dict(baseline=base)
        batch = args.micro_batch or settings.get("batch_size", 1)
        optimizer = args.optimizer or settings.get("optimizer", "muon")
        kernels = args.triton or settings.get("triton", False)
        out = {
            name: memory_plan(
                cfg, args.world_size, batch, optimizer, args.gpu_gb, not args.fp32, kernels
            )
            for name, cfg in models.items()
        }
        lines += [
            memory_table(plan, f"{name}: " if matched else "") for name, plan in out.items()
        ]
    elif matched:
        # Side by side, as [S] Table 10.
        out = dict(
            baseline=summary(base, attended),
            matched=summary(matched, attended, base),
            ratios=report["ratios"],
        )
        lines.append(f"recipe {report['recipe']}, {report['candidates']} candidates searched")
        lines.append(f"  {'':<19}  {'baseline':>12}  {'matched':>12}")
        lines += [
            f"  {k:<19}  {short(v):>12}  {short(out['matched'][k]):>12}"
            for k, v in out["baseline"].items()
        ]
        ratios = ", ".join(f"{k} {v:.4f}" for k, v in report["ratios"].items())
        lines.append(f"  ratios (matched / baseline, as [S] Table 10): {ratios}")
    else:
        # The budget table of one config.
        s = sparsity(base, attended)
        out = accounting(base, attended) | {f"sparsity_{k}": v for k, v in s.items()}
        lines.append(
            f"{base.layout} L={base.n_layer} H={base.n_embd} "
            f"heads={base.n_head}/{base.n_kv_head}x{base.head_dim} "
            f"experts={base.n_expert} (top {base.top_k}, hidden {base.expert_hidden})"
        )
        lines += [f"  {k:<21}  {short(v)}" for k, v in out.items()]
    out.update(vocab_size=base.vocab_size, vocab_from=where)
    print(json.dumps(out) if args.json else "\n".join(lines))


if __name__ == "__main__":
    main()
