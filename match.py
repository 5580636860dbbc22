"""
Budget accounting, triple matching and the GPU memory planner [S §budget matching, Appendix A; S1; X10].

Arithmetic on a ModelConfig (nothing is allocated: a 54B-parameter config is instant); which blocks run how
often is read from model.execution_plan, never re-derived.

    python match.py config/smelt_200m_base.py --avg_doc_len 512   # the budget table of one config
    python match.py --preset smelt-200m-s95                        # [S] baseline and its matched SMELT twin
    python match.py config/smelt_200m_base.py --recipe smelt       # match a config to a loop recipe
    python match.py config/x_d8_loop2.py --memory --world_size 8   # bytes per GPU under DDP and FSDP2
    ... --json                                                     # one JSON object instead of a table

A config's vocabulary and mean document length come from its data_dir/meta.json when that exists, else
from --vocab_size (default 4096: the project's gpt2-4096 tokenizer) and --avg_doc_len (default block_size).

Conventions, per token. FLOPs: a multiply-add is 2, training = 3 x forward. Counted: attention projections,
QK^T and PV at `attended` keys per query ((L + 1) / 2 in a document of L tokens: causal), router, top_k
experts or the MLP, unembedding, RMSNorms ((3 + gain) x dim) and the boundary injection (2 x dim); softmax,
SwiGLU, RoPE and residual adds are not (O(dim)). Params: non-embedding = all but wte and an untied head;
active = what one token touches (both = model.num_params()); N_c [X10] = matrix params multiplied, per
execution, lm head included (6 N_c = the non-attention matmul FLOPs); N_s = every stored parameter.
KV cache: executed layers x 2 x n_kv_head x head_dim (every visit of a looped layer keeps its own).
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

import configurator  # the config file format (nanoGPT's): train.py reads the same files
from model import CE_CHUNK, GPT, TINY, ModelConfig, execution_plan

# ----------------------------------------------------------------------------------------------------
# Accounting


def resolve_attended(cfg, attended=None, avg_doc_len=None):
    """Mean keys per query: `attended` if given, else (L + 1) / 2 with L = avg_doc_len or block_size."""
    doc_len = cfg.block_size if avg_doc_len is None else avg_doc_len
    value = attended if attended is not None else (doc_len + 1) / 2
    if not (math.isfinite(value) and value > 0 and 1 <= doc_len <= cfg.block_size):
        raise ValueError(f"attended={attended}, avg_doc_len={avg_doc_len}: need attended > 0 and a document "
                         f"length in [1, block_size={cfg.block_size}]")
    return float(value)


def block_shapes(cfg):
    """Parameter counts of one Block, in the pieces the accounting needs."""
    H, q, kv = cfg.n_embd, cfg.n_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim
    attn = 2 * H * q + 2 * H * kv  # q, o and k, v projections
    gain = int(cfg.norm_gain)
    norms = 2 * H * gain + (2 * cfg.head_dim * gain if cfg.qk_norm else 0)
    router = cfg.n_expert * H
    per_expert = 3 * H * cfg.expert_hidden if cfg.n_expert else 0  # SwiGLU gate, up, down
    ffn_all = cfg.n_expert * per_expert if cfg.n_expert else 3 * H * cfg.mlp_hidden
    ffn_active = cfg.top_k * per_expert if cfg.n_expert else ffn_all
    total = attn + norms + router + ffn_all
    return dict(attn=attn, router=router, per_expert=per_expert, ffn_all=ffn_all, ffn_active=ffn_active,
                total=total, active=total - ffn_all + ffn_active, matmul_active=attn + router + ffn_active)


def norm_flops(cfg, dim):
    return (4 if cfg.norm_gain else 3) * dim  # square, sum, scale (+ the gain)


FLOP_ITEMS = ("attn_proj", "attn_scores", "router", "ffn", "norms", "unembedding")


def accounting(cfg, attended=None, n_passes=None, avg_doc_len=None, kv_bytes_per_element=2):
    """The per-token budget table of a config. n_passes overrides K or r as in model.execution_plan."""
    attended = resolve_attended(cfg, attended, avg_doc_len)
    plan = execution_plan(cfg, n_passes)
    executed = [s.block for s in plan if s.kind == "block"]
    H, V, shapes = cfg.n_embd, cfg.vocab_size, block_shapes(cfg)
    embedding = V * H * (1 if cfg.tie_embeddings else 2)
    boundary_norm = cfg.layout.startswith("pcc") and cfg.boundary in ("both", "norm")  # one, shared
    globals_ = H * cfg.norm_gain * (1 + cfg.embed_norm + boundary_norm)  # norm_f, embed_norm, boundary
    nonembedding = cfg.n_blocks * shapes["total"] + globals_
    # forward FLOPs: every block execution, every boundary [X3], the embedding and final norms, the head
    q, n_exec = cfg.n_head * cfg.head_dim, len(executed)
    forward = dict(attn_proj=2 * shapes["attn"] * n_exec, attn_scores=4 * q * attended * n_exec,
                   router=2 * shapes["router"] * n_exec, ffn=2 * shapes["ffn_active"] * n_exec,
                   norms=n_exec * (2 * norm_flops(cfg, H) + cfg.qk_norm * (cfg.n_head + cfg.n_kv_head)
                                   * norm_flops(cfg, cfg.head_dim)), unembedding=2 * H * V)
    for s in plan:
        if s.kind == "boundary":
            forward["norms"] += s.norm * norm_flops(cfg, H) + s.inject * 2 * H
    forward["norms"] += norm_flops(cfg, H) * (1 + cfg.embed_norm)
    flops = 3 * sum(forward.values())
    compute_active = n_exec * shapes["matmul_active"] + V * H  # [X10] N_c
    kv = n_exec * 2 * cfg.n_kv_head * cfg.head_dim
    active = len(set(executed)) * shapes["active"] + globals_  # every stored block it runs, once
    return dict(attended=attended, executed_layers=n_exec, stored_blocks=cfg.n_blocks,
                params_total=nonembedding + embedding, params_embedding=embedding,
                params_nonembedding=nonembedding, params_active=active,
                params_compute_active=compute_active, params_stored=nonembedding + embedding,
                **{f"flops_{k}": 3 * forward[k] for k in FLOP_ITEMS}, flops_per_token=flops,
                flops_forward=flops / 3, flops_6n=6 * compute_active,
                kv_per_token=kv, kv_bytes_per_token=kv * kv_bytes_per_element)


def flops_per_token(cfg, attended=None, n_passes=None, backward=True, avg_doc_len=None):
    """Per-token FLOPs, every block execution counted; training (backward=True) = 3 x forward."""
    a = accounting(cfg, attended, n_passes, avg_doc_len)
    return a["flops_per_token"] if backward else a["flops_forward"]


def run_flops(cfg, phases, attended=None, avg_doc_len=None):
    """FLOPs of a run whose depth changes ([X13] growth). phases: [(tokens, n_passes)], [(tokens,
    ModelConfig)] (an untied growth stores more blocks) or [(tokens, ModelConfig, n_passes)]. Returns the
    total, tokens, and the token-weighted flops_per_token, params_compute_active and mean_passes."""
    total = tokens = n_c = passes = 0.0
    for phase_tokens, what, *drawn in phases:
        phase_cfg, k = (what, drawn[0] if drawn else None) if isinstance(what, ModelConfig) else (cfg, what)
        a = accounting(phase_cfg, attended, k, avg_doc_len)
        total += phase_tokens * a["flops_per_token"]
        n_c += phase_tokens * a["params_compute_active"]
        passes += phase_tokens * (phase_cfg.n_passes if k is None else k)
        tokens += phase_tokens
    return dict(flops=total, tokens=tokens, flops_per_token=total / tokens,
                params_compute_active=n_c / tokens, mean_passes=passes / tokens)


def fully_activated(cfg):
    """[S1]'s reference at the same scale: plain (one pass) and every expert active (n_expert = top_k)."""
    return replace(cfg, layout="plain", n_passes=1, n_expert=cfg.top_k if cfg.n_expert else 0)


def sparsity(cfg, attended=None, baseline=None, n_passes=None, avg_doc_len=None):
    """[S1] N_act^eq = (F / F0) N0, S = 1 - N_act^eq / N; F0, N0 of the fully activated reference of
    `baseline` when given (a matched twin is measured against its baseline's, [S]), else of cfg. A looped
    dense model has S < 0: it spends more FLOPs per parameter than its reference."""
    a = accounting(cfg, attended, n_passes, avg_doc_len)
    a0 = accounting(fully_activated(baseline or cfg), attended, None, avg_doc_len)
    F, F0 = a["flops_per_token"], a0["flops_per_token"]
    N, N0 = a["params_nonembedding"], a0["params_nonembedding"]
    return dict(F=F, N=N, F0=F0, N0=N0, N_act_eq=F / F0 * N0, S=1 - F / F0 * N0 / N)


# ----------------------------------------------------------------------------------------------------
# Triple budget matching [S §budget matching]: FLOPs, non-embedding params and KV cache per token

RECIPES = {
    "smelt": dict(layout="smelt", n_passes=2),  # [S] the middle half twice, 1/r residual scaling
    "smelt3": dict(layout="smelt", n_passes=3),
    "layer_loop": dict(layout="layer_loop", n_passes=2),
    "pcc2": dict(layout="pcc", n_passes=2),  # [X] Loop-2 (tied core, two passes)
    "pcc2_untied": dict(layout="pcc_untied", n_passes=2),  # [X] Untied-2
}
BUDGET_KEYS = dict(flops="flops_per_token", params="params_nonembedding", kv="kv_per_token")


def parse_recipe(recipe):
    """A dict of ModelConfig overrides, a name in RECIPES, or 'key=value,key=value'."""
    if isinstance(recipe, dict) or recipe in RECIPES:
        return dict(RECIPES.get(recipe, recipe) if isinstance(recipe, str) else recipe)
    if not all("=" in item for item in str(recipe).split(",")):
        raise ValueError(f"recipe {recipe!r}: expected a name in {sorted(RECIPES)} or key=value pairs")
    pairs = (item.split("=", 1) for item in recipe.split(","))
    return {k.strip(): json.loads(v) if v[:1].isdigit() or v in ("true", "false") else v for k, v in pairs}


@dataclass(frozen=True)
class MatchSearch:
    """What match() searches and how close it must get (tolerances: fractions of the baseline's budget).
    flops_tol = (below, above): (0, 0.05) never gives the twin less compute than the baseline, as every
    cell of [S] Table 10. A tuple of grid multiples is tried coarsest first; a finer grid only when the
    coarser one holds no match."""
    flops_tol: tuple = (0.0, 0.05)
    params_tol: float = 0.015
    kv_tol: float = 0.04
    width_multiple: tuple = (32, 16, 8)  # grid of n_embd
    expert_multiple: tuple = (8, 4, 2, 1)  # grid of n_expert, inside each width grid
    hidden_multiple: int = 16  # expert_hidden / mlp_hidden rounding
    head_multiple: int = 8  # grid of head_dim
    head_dim_range: tuple = (16, 256)

    def __post_init__(self):
        tol = self.flops_tol
        set_ = object.__setattr__  # frozen: normalise the fields once
        set_(self, "flops_tol", tuple((tol, tol) if isinstance(tol, (int, float)) else tol))
        for name in ("width_multiple", "expert_multiple"):
            value = getattr(self, name)
            set_(self, name, (value,) if isinstance(value, int) else tuple(value))
        fraction = lambda t: isinstance(t, (int, float)) and 0 <= t < 1  # noqa: E731 (nan fails too)
        grid = lambda m: isinstance(m, int) and m >= 1  # noqa: E731
        lo_hi = tuple(self.head_dim_range)
        checks = dict(flops_tol=len(self.flops_tol) == 2 and all(map(fraction, self.flops_tol)),
                      params_tol=fraction(self.params_tol), kv_tol=fraction(self.kv_tol),
                      width_multiple=bool(self.width_multiple) and all(map(grid, self.width_multiple)),
                      expert_multiple=bool(self.expert_multiple) and all(map(grid, self.expert_multiple)),
                      hidden_multiple=grid(self.hidden_multiple), head_multiple=grid(self.head_multiple),
                      head_dim_range=len(lo_hi) == 2 and all(map(grid, lo_hi)) and 2 <= lo_hi[0] <= lo_hi[1])
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"match option {bad[0]}={getattr(self, bad[0])!r} out of range: tolerances are "
                             "fractions in [0, 1), grids integers >= 1, head_dim_range (lo, hi) with "
                             "2 <= lo <= hi")


class Candidate(NamedTuple):
    """One configuration match() considered; candidates sort by the first six fields."""
    violation: float  # summed amount by which budgets fall outside their tolerance (0: a match)
    score: float  # squared deviations / tolerance, plus shape penalties (lower is better)
    n_embd: int
    head_dim: int
    n_kv_head: int
    n_head: int
    cfg: ModelConfig
    ratios: dict  # budget -> matched / baseline
    violations: dict


def match(baseline, recipe="smelt", attended=None, avg_doc_len=None, budgets=("flops", "params", "kv"),
          search=None, **options):
    """Search width H, experts per layer, head size and GQA ratio of baseline + recipe so that training
    FLOPs, non-embedding params and KV cache per token match the baseline's. Returns (matched_cfg,
    report); report["ratios"]: F/F_base, N/N_base, KV/KV_base ([S] Table 10). search: a MatchSearch;
    keyword options override its fields (match(base, "smelt", width_multiple=(16, 8))).
    Deterministic and exhaustive (< 1 s):
      H          multiples of width_multiple in [H_b / 4, 2 H_b]
      hidden     expert_hidden (or mlp_hidden) scaled with H: narrowing shrinks each expert, as in [S]
      head_dim   multiples of head_multiple in head_dim_range; n_kv_head any value meeting the KV budget
      n_head     the multiples of n_kv_head nearest the baseline's query width scaled with H
      n_expert   solved from the params budget, rounded to expert_multiple (>= top_k); dense stays dense
    A budget left out of `budgets` is reported, not matched ([X]: budgets=("flops",)). Among candidates
    within every tolerance the smallest sum of squared deviations / tolerance wins, plus penalties for a
    query width, head size or KV-head count far from the baseline's."""
    t0 = time.perf_counter()
    search = replace(search or MatchSearch(), **options)
    overrides, budgets = parse_recipe(recipe), tuple(budgets)
    if not budgets or not set(budgets) <= set(BUDGET_KEYS):
        raise ValueError(f"budgets={budgets}: give at least one of {sorted(BUDGET_KEYS)}")
    a_base = accounting(baseline, attended, avg_doc_len=avg_doc_len)
    template = replace(baseline, **overrides)
    if template.n_passes < 2 or template.executed_layers() <= baseline.executed_layers():
        raise ValueError(f"recipe {overrides}: the twin ({template.layout}, n_passes={template.n_passes}) "
                         f"executes {template.executed_layers()} blocks per token, the baseline "
                         f"({baseline.layout}) {baseline.executed_layers()}: a recipe must loop a looped "
                         "layout >= 2 times over a plain baseline")
    heads = kv_head_shapes(baseline, template.executed_layers(), a_base["kv_per_token"], budgets, search)
    closest = found_in = None
    for grid in itertools.product(search.width_multiple, search.expert_multiple):  # coarsest grids first
        candidates = match_candidates(baseline, template, budgets, a_base, heads, search, *grid)
        if candidates and (closest is None or candidates[0][:2] < closest[:2]):
            closest, found_in = candidates[0], (grid, len(candidates))
        if closest is not None and closest.violation == 0:
            break
    cfg, r = closest.cfg, closest.ratios
    if closest.violation > 0:
        (f_lo, f_hi), tol = search.flops_tol, dict(params=search.params_tol, kv=search.kv_tol)
        bounds = {b: f"1 +- {t:.3f}" for b, t in tol.items()}
        bounds["flops"] = f"[{1 - f_lo:.3f}, {1 + f_hi:.3f}]"
        misses = [f"{b} budget not met: ratio {r[b]:.4f} outside {bounds[b]} by {v * 100:.2f}%"
                  for b, v in closest.violations.items() if v > 0]
        raise ValueError(f"no configuration matches {overrides} to the baseline; the closest (n_embd="
                         f"{cfg.n_embd}, n_expert={cfg.n_expert}, head_dim={cfg.head_dim}, n_kv_head="
                         f"{cfg.n_kv_head}): " + "; ".join(misses))
    attended = a_base["attended"]
    (multiple, e_multiple), n_candidates = found_in
    return cfg, dict(recipe=overrides, attended=attended, ratios=r, score=closest.score,
                     baseline=a_base, matched=accounting(cfg, attended),
                     sparsity_baseline=sparsity(baseline, attended),
                     sparsity_matched=sparsity(cfg, attended, baseline=baseline), candidates=n_candidates,
                     width_multiple=multiple, expert_multiple=e_multiple, seconds=time.perf_counter() - t0)


def kv_head_shapes(baseline, executed, kv_base, budgets, search):
    """(head_dim, n_kv_head) within the KV budget (KV depends only on them and the executed layers);
    without a KV budget, the baseline's head shape."""
    if "kv" not in budgets:
        return [(int(baseline.head_dim), int(baseline.n_kv_head))]
    lo, hi = search.head_dim_range
    pairs = [(hd, n_kv) for hd in range(lo + (-lo) % search.head_multiple, hi + 1, search.head_multiple)
             for n_kv in range(1, 257)]
    ratio = lambda p: executed * 2 * p[0] * p[1] / kv_base  # noqa: E731
    heads = [p for p in pairs if abs(ratio(p) - 1) <= search.kv_tol]
    if not heads:
        best = min(pairs, key=lambda p: abs(ratio(p) - 1))
        raise ValueError(f"KV budget cannot be met: {executed} executed layers need 2 x n_kv_head x "
                         f"head_dim = {kv_base / executed:.1f} per layer; the nearest, n_kv_head={best[1]}, "
                         f"head_dim={best[0]}, is off by {abs(ratio(best) - 1) * 100:.1f}% "
                         f"(kv_tol {search.kv_tol:g})")
    return heads


def match_candidates(baseline, template, budgets, a_base, heads, search, width_multiple, expert_multiple):
    """Every Candidate of match() on one (width, expert count) grid, best first."""
    H_b, moe = baseline.n_embd, baseline.n_expert > 0
    q_b = baseline.n_head * baseline.head_dim
    hidden_b = baseline.expert_hidden if moe else baseline.mlp_hidden
    f_lo, f_hi = search.flops_tol
    tol = dict(flops=max(f_lo + f_hi, 1e-3), params=search.params_tol, kv=search.kv_tol)
    round_to = lambda x, m: max(m, m * round(x / m))  # noqa: E731
    candidates = []
    for H in range(max(width_multiple, round_to(H_b / 4, width_multiple)), 2 * H_b + 1, width_multiple):
        hidden = round_to(hidden_b * H / H_b, search.hidden_multiple)
        for hd, n_kv in heads:
            target = q_b * H / H_b / hd / n_kv  # query heads per KV head
            for n_head in sorted({n_kv * max(1, math.floor(target)), n_kv * math.ceil(target)}):
                shape = dict(n_embd=H, n_head=n_head, n_kv_head=n_kv, head_dim=hd)
                shape.update(expert_hidden=hidden, mlp_hidden=0) if moe else shape.update(mlp_hidden=hidden)
                try:
                    cfg = replace(template, **shape)
                except ValueError:
                    continue
                if moe and "params" in budgets:  # params are affine in n_expert: solve, then round
                    per_expert = 3 * H * hidden + H  # its matrices and its router row
                    fixed = accounting(cfg)["params_nonembedding"] - cfg.n_blocks * cfg.n_expert * per_expert
                    n_exp = (a_base["params_nonembedding"] - fixed) / (cfg.n_blocks * per_expert)
                    cfg = replace(cfg, n_expert=max(round_to(n_exp, expert_multiple), cfg.top_k))
                a = accounting(cfg, a_base["attended"])
                r = {b: a[key] / a_base[key] for b, key in BUDGET_KEYS.items()}
                violations = dict(flops=max(0.0, 1 - f_lo - r["flops"], r["flops"] - 1 - f_hi),
                                  params=max(0.0, abs(r["params"] - 1) - search.params_tol),
                                  kv=max(0.0, abs(r["kv"] - 1) - search.kv_tol))
                violations = {b: violations[b] for b in budgets}
                score = sum(((r[b] - 1) / tol[b]) ** 2 for b in budgets)
                score += (math.log(n_head * hd / (q_b * H / H_b)) / 0.05) ** 2  # keep the query width,
                score += (math.log(hd / baseline.head_dim) / 0.5) ** 2  # weakly the head size
                score += (math.log(n_kv / baseline.n_kv_head) / 0.5) ** 2  # and the number of KV heads
                candidates.append(Candidate(sum(violations.values()), score, H, hd, n_kv, n_head, cfg, r,
                                            violations))
    return sorted(candidates, key=lambda c: c[:6])


# ----------------------------------------------------------------------------------------------------
# The GPU memory planner: bytes per GPU of training a config as train.py does. fp32 master weights and
# gradients, bf16 autocast; Muon keeps one fp32 momentum per hidden matrix, AdamW two fp32 moments.
# DDP: every GPU holds everything, no activation checkpointing. FSDP2 (parallel="fsdp"): fully_shard per
# stored block and on the root, every parameter sharded on dim 0, bf16 gathered blocks, activation
# checkpointing per executed block unless told not to (train.py checkpoints where a plan without it does not
# fit); "fsdp_grad_op" keeps each gathered block from its forward to its backward.

GIB = 2 ** 30
HEADROOM = 0.10  # of each GPU kept free: CUDA context, NCCL buffers, fragmentation (expandable segments)
MODES = ("ddp", "fsdp", "fsdp_grad_op")


def parameters(cfg):
    """(shape, "muon" or "adamw") of every parameter GPT(cfg) holds (built on the meta device: no memory),
    grouped as train.py groups them: Muon takes the block matrices (2-D and stacked) but the routers."""
    with torch.device("meta"):
        named = list(GPT(cfg).named_parameters())
    outside = ("wte.", "lm_head.")
    return [(p.shape, "muon" if p.dim() >= 2 and not name.startswith(outside) and ".router." not in name
             else "adamw") for name, p in named]


def state_bytes_per_rank(cfg, world_size=1, optimizer="muon"):
    """Weights (4 B) + gradients (4 B) + optimizer state (Muon 4 B, AdamW 8 B) on the fullest rank when every
    parameter is sharded on dim 0 like FSDP2's torch.chunk: rank 0 holds ceil(rows / world) rows of each.
    world_size=1: the whole (DDP). (muon_x's second moment, one number per row, is left out.)"""
    return sum(-(-shape[0] // world_size) * math.prod(shape[1:]) *
               (12 if group == "muon" and optimizer != "adamw" else 16) for shape, group in parameters(cfg))


def optimizer_step_bytes(cfg, world_size=1, optimizer="muon", sharded=False):
    """The optimizer step's temporaries on the fullest rank, as on CUDA (Newton-Schulz in bf16). Muon holds
    every matrix's update at once: its direction and its orthogonalised result, 4 B each per element this
    rank holds (muon_x's row-normalised copy 4 B more). Sharded, a 2-D matrix's result comes back as a bf16
    shard first (2 B), and its owner holds the gathered pieces and the result, 2 B each, of one world-th of
    them. AdamW, fused on CUDA as train.py runs it: none."""
    per_element = 0 if optimizer == "adamw" else 8 + 4 * (optimizer == "muon_x")
    held = lambda shape: -(-shape[0] // world_size) * math.prod(shape[1:])  # noqa: E731
    return sum(held(shape) * (per_element + 6 * (sharded and len(shape) == 2))
               for shape, group in parameters(cfg) if group == "muon" and per_element)


def activation_bytes(cfg, micro_batch, mixed_precision=True, checkpointing=False, kernels=False,
                     n_passes=None):
    """Bytes autograd keeps for the backward of micro_batch x block_size tokens, per token: a = 2 for matmul
    operands under bf16 autocast (4 without), f = 4 for what stays fp32 (residual stream, norm and softmax
    statistics, router logits), i = 8 for int64 indices, g = 1 when the PyTorch RMSNorm keeps x * rstd for
    its gain (not with the kernels), c = the casts of a norm output under autocast (one per matmul).
      norm(d)   = f d + f + g f d
      attention = norm(H) + c a H + a (q + 2 kv) + a q + f n_head (flash / flex: no T x T) + a q (o_proj)
                  [QK-norm: + a (q + kv) + f (n_head + n_kv_head) + g f (q + kv)]
      dense FFN = norm(H) + c a H + (4, or 3 with the SwiGLU kernel) a mlp_hidden
      MoE FFN   = norm(H) + a H + f (2 E + 2) + top_k [routed + 3 i + f + a], routed = a H + 5 a hidden
                  on the PyTorch path (model.run_experts: the rows gathered once in the compute dtype; the
                  scatter back keeps only its index), a (2 H + 2 hidden) with the kernel
      saved     = i [+ norm(H) embed_norm] + executed x (attention + FFN) + norm(H) per boundary [X3]
                  + the head: norm(H) + a H + l + i, l = f V (the fp32 logits the loss keeps), or a V past
                  CE_CHUNK logits (model.cross_entropy keeps the logits; a chunk's fp32 copy is recomputed)
      logits_grad = 2 f V [+ a V: its cast], or past CE_CHUNK a V (the chunks' gradients) + 3 f CE_CHUNK
                  (one chunk's fp32 recompute) in all (eager cross-entropy's backward; compiled, less)
    Checkpointing keeps only each executed block's input (f H) and recomputes one block at a time."""
    a, f, i = (2 if mixed_precision else 4), 4, 8
    H, V, E, k = cfg.n_embd, cfg.vocab_size, cfg.n_expert, cfg.top_k
    q, kv = cfg.n_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim
    g = int(cfg.norm_gain and not kernels)
    norm = f * H + f + g * f * H
    copies = (lambda n: n) if mixed_precision else (lambda n: 1)  # noqa: E731
    attention = norm + copies(3) * a * H + a * (q + 2 * kv) + a * q + f * cfg.n_head + a * q
    if cfg.qk_norm:
        attention += a * (q + kv) + f * (cfg.n_head + cfg.n_kv_head) + g * f * (q + kv)
    if E:
        hidden = cfg.expert_hidden
        routed = a * (2 * H + 2 * hidden) if kernels else a * H + 5 * a * hidden
        ffn = norm + a * H + f * (2 * E + 2) + k * (routed + 3 * i + f + a)
    else:
        ffn = norm + copies(2) * a * H + (3 if kernels else 4) * a * cfg.mlp_hidden
    plan = execution_plan(cfg, n_passes)
    executed = sum(s.kind == "block" for s in plan)
    boundaries = sum(norm for s in plan if s.kind == "boundary" and s.norm)
    block, tokens = attention + ffn, micro_batch * cfg.block_size
    chunked = tokens * V > CE_CHUNK
    logits = a * V if chunked else f * V
    outside = i + norm * cfg.embed_norm + boundaries + norm + a * H + logits + i
    saved = tokens * (outside + executed * (f * H if checkpointing else block))
    recompute = tokens * block if checkpointing else 0
    logits_grad = tokens * a * V + 3 * f * CE_CHUNK if chunked else tokens * (2 * f + (a < f) * a) * V
    head = tokens * (norm + a * H + logits + i)  # the head's are freed first
    return dict(saved=saved, recompute=recompute, logits_grad=logits_grad, head=head,
                per_block=tokens * block, tokens=tokens, total=saved + max(logits_grad, recompute - head))


def weight_copy_bytes(cfg, n_passes=None):
    """DDP under autocast: the bf16 weight copies autograd keeps: attention, router, dense FFN and lm head
    once (autocast caches a leaf weight's cast per forward), the experts once per executed MoE block."""
    shapes, executed = block_shapes(cfg), cfg.executed_layers(n_passes)
    experts = shapes["ffn_all"] if cfg.n_expert else 0
    cached = cfg.n_blocks * (shapes["attn"] + shapes["router"] + shapes["ffn_all"] - experts)
    return 2 * (cached + cfg.vocab_size * cfg.n_embd + executed * experts)


def memory_plan(cfg, world_size, micro_batch, optimizer="muon", gpu_gb=80, mixed_precision=True,
                kernels=False, n_passes=None, headroom=HEADROOM, checkpointing=True):
    """GiB per GPU of training cfg with micro_batch sequences per GPU on world_size GPUs of gpu_gb GiB, for
    each parallel mode: states (state_bytes_per_rank), activations (activation_bytes), transient (the rest
    of the peak), total, fits (total <= (1 - headroom) gpu_gb), max_micro_batch, and for FSDP2 the GiB
    all-gathered per micro-batch. DDP's peak adds its gradient buckets (4 B/param) and autocast's weight
    copies. FSDP2's is the larger of two moments of the backward, on top of this rank's shards: the
    cross-entropy's backward (every saved tensor, the logits' gradient, the unsharded fp32 root: FSDP2 keeps
    it gathered, two gathered bf16 blocks) and a block's backward (without the head's tensors, one block
    recomputed, the root's weights and gradients, two gathered blocks, one block's bf16 gradient and its
    fp32 copy for the reduce-scatter); fsdp_grad_op keeps every other stored block gathered too. The optimizer
    step's own peak (optimizer_step_bytes over the states; DDP's gradient buckets too) is the last moment.
    checkpointing=False: FSDP2 without activation checkpointing."""
    p = 2 if mixed_precision else 4  # a gathered block parameter (and its gradient)
    n_params = sum(math.prod(shape) for shape, _ in parameters(cfg))
    block = block_shapes(cfg)["total"]
    root, head_copy = n_params - cfg.n_blocks * block, (p // 2) * 2 * cfg.vocab_size * cfg.n_embd
    states = dict(ddp=state_bytes_per_rank(cfg, 1, optimizer))
    states["fsdp"] = states["fsdp_grad_op"] = state_bytes_per_rank(cfg, world_size, optimizer)
    ddp_extra = 4 * n_params + (weight_copy_bytes(cfg, n_passes) if mixed_precision else 0)

    def peak(mode, micro_batch):  # (activations, total) in bytes
        a = activation_bytes(cfg, micro_batch, mixed_precision, mode != "ddp" and checkpointing, kernels,
                             n_passes)
        step = states[mode] + optimizer_step_bytes(cfg, 1 if mode == "ddp" else world_size, optimizer,
                                                   sharded=mode != "ddp")
        if mode == "ddp":
            return a["total"], max(states[mode] + a["total"] + ddp_extra, step + 4 * n_params)
        kept = (cfg.n_blocks - 1) * block * p if mode == "fsdp_grad_op" else 0
        cross_entropy = a["saved"] + a["logits_grad"] + root * 4 + 2 * p * block
        block_backward = a["saved"] - a["head"] + a["recompute"] + root * 8 + (3 * p + 4) * block
        return a["total"], max(states[mode] + kept + head_copy + max(cross_entropy, block_backward), step)

    usable = (1 - headroom) * gpu_gb * GIB
    plan = dict(world_size=world_size, micro_batch=micro_batch, tokens_per_gpu=micro_batch * cfg.block_size,
                optimizer=optimizer, mixed_precision=mixed_precision, gpu_gb=gpu_gb, usable_gb=usable / GIB)
    gathers = dict(fsdp=2 * cfg.executed_layers(n_passes) * block * p, fsdp_grad_op=cfg.n_blocks * block * p)
    for mode in MODES:
        act, total = peak(mode, micro_batch)
        lo, hi = 0, 2 ** 20  # the largest micro-batch that fits: the peak grows with it
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if peak(mode, mid)[1] <= usable else (lo, mid - 1)
        plan[mode] = dict(states_gb=states[mode] / GIB, activations_gb=act / GIB,
                          transient_gb=(total - states[mode] - act) / GIB, total_gb=total / GIB,
                          fits=total <= usable, activation_checkpointing=mode != "ddp" and checkpointing,
                          max_micro_batch=lo)
        if mode in gathers:
            plan[mode]["all_gather_gb"] = gathers[mode] * (world_size - 1) / world_size / GIB
    return plan


def memory_table(plan, label=""):
    p = plan
    lines = [f"{label}memory per GPU (GiB): {p['world_size']} GPUs x {p['gpu_gb']:g} GiB, fits if total <= "
             f"{p['usable_gb']:.1f} ({HEADROOM:.0%} headroom)",
             f"  micro-batch {p['micro_batch']} x {p['tokens_per_gpu'] // p['micro_batch']} tokens, "
             f"{p['optimizer']}, {'bf16 autocast' if p['mixed_precision'] else 'fp32'}; activation "
             "checkpointing with FSDP2",
             f"  {'parallel':<13} {'states':>7} {'activations':>11} {'transient':>9} {'total':>7} "
             f"{'fits':>4} {'max micro-batch':>15} {'all-gathers / micro-batch':>25}"]
    for mode in MODES:
        m = p[mode]
        gathers = f"{m['all_gather_gb']:.1f}" if "all_gather_gb" in m else "-"
        lines.append(f"  {mode:<13} {m['states_gb']:>7.1f} {m['activations_gb']:>11.1f} "
                     f"{m['transient_gb']:>9.1f} {m['total_gb']:>7.1f} {'yes' if m['fits'] else 'no':>4} "
                     f"{m['max_micro_batch']:>15} {gathers:>25}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------
# Command line: a config file or an [S] preset, optionally matched to a recipe or planned in memory
#
# [S] presets: the paper's four scales (L = 10/12/20/30, H = 672/1280/1792/2304). Its baselines are not
# published in full; our rules are chosen so that the 200M, S~0.95 worked example reproduces (1.33e9
# FLOPs/token, 3.87e9 non-embedding params, 0.207B active): head_dim 128 (96 at H=672), query width H, 2 KV
# heads (1 when n_head is odd), expert_hidden = H/3 rounded up to 16 (432 at 200M: what the paper's total
# minus active params imply), a 4096 vocabulary (a 50k head alone would overshoot 1.33e9), 4096-token
# context, mean document length 512. The 600M / 1.6B baselines then have 0.663B / 1.641B active params
# (paper 0.665B / 1.632B), and 1.6B with 336 experts 53.89B total params, as the paper. At 100M the experts
# are wider (560) to reach its 0.100B active. Expert counts aim at S ~ 0.85 / 0.95 / 0.97.
SCALES = {  # name: (n_layer, n_embd, n_head, head_dim, expert_hidden, {target S: experts per layer})
    "100m": (10, 672, 7, 96, 560, {85: 56, 95: 176, 97: 288}),
    "200m": (12, 1280, 10, 128, 432, {85: 64, 95: 192, 97: 336}),
    "600m": (20, 1792, 14, 128, 592, {85: 64, 95: 192, 97: 336}),
    "1.6b": (30, 2304, 18, 128, 768, {85: 64, 95: 192, 97: 336}),
}
PRESETS = [f"smelt-{scale}-s{s}" for scale, v in SCALES.items() for s in v[-1]]
PRESET_DOC_LEN = 512


def preset_baseline(name):
    """'smelt-200m-s95' -> the [S] baseline ModelConfig (avg_doc_len: PRESET_DOC_LEN)."""
    _, scale, s = name.split("-")
    n_layer, H, n_head, hd, hidden, experts = SCALES[scale]
    return ModelConfig(vocab_size=4096, block_size=4096, n_layer=n_layer, n_embd=H, n_head=n_head,
                       n_kv_head=2 if n_head % 2 == 0 else 1, head_dim=hd, n_expert=experts[int(s[1:])],
                       top_k=8, expert_hidden=hidden)


def read_config(path, vocab_size=4096):
    """A config file -> (ModelConfig, its other settings, where the vocabulary came from). The vocabulary
    and mean document length (settings["mean_doc_len"], capped at block_size) come from data_dir/meta.json
    as train.py takes them (n_vocab padded to a multiple of 64), else vocab_size. A model setting the file
    leaves out is train.py's default: the model is the one `python train.py PATH` trains."""
    values = {**TINY, **configurator.read_config(path)}
    model_fields = {f.name for f in fields(ModelConfig)}
    settings = {k: v for k, v in values.items() if k not in model_fields}
    meta_path = os.path.join(settings.get("data_dir") or "", "meta.json")
    if settings.get("data_dir") and os.path.isfile(meta_path):
        with open(meta_path) as f:
            meta = json.load(f)
        n_vocab, padded = meta["n_vocab"], 64 * math.ceil(meta["n_vocab"] / 64)
        data = dict(vocab_size=padded, eot_token=meta["eot_token"], n_logits=n_vocab * (padded > n_vocab))
        settings["mean_doc_len"], where = meta.get("mean_doc_len"), meta_path
    else:
        data, where = dict(vocab_size=vocab_size), "--vocab_size"
    cfg = ModelConfig(**data, **{k: v for k, v in values.items() if k in model_fields})
    if settings.get("mean_doc_len"):
        settings["mean_doc_len"] = min(settings["mean_doc_len"], cfg.block_size)
    return cfg, settings, where


def summary(cfg, attended, baseline=None):
    """A config's column of the side-by-side table (and of --json)."""
    a = accounting(cfg, attended)
    shape = ("n_layer", "n_embd", "n_head", "n_kv_head", "head_dim", "n_expert", "top_k", "expert_hidden")
    budgets = ("flops_per_token", "params_nonembedding", "params_active", "kv_per_token")
    return dict({k: getattr(cfg, k) for k in shape}, layout=cfg.layout, executed_layers=a["executed_layers"],
                **{k: a[k] for k in budgets}, sparsity_S=sparsity(cfg, attended, baseline=baseline)["S"],
                attended=attended)


def short(v):
    """4 significant digits, e-notation from 1e6."""
    if isinstance(v, str) or (isinstance(v, int) or v.is_integer()) and abs(v) < 1e6:
        return str(int(v) if isinstance(v, float) else v)
    return f"{v:.4g}" if abs(v) < 1e4 else f"{v:.4e}"


def main(argv=None):
    parser = argparse.ArgumentParser(prog="match.py", usage=argparse.SUPPRESS,
                                     description=__doc__.split("\n\n")[0].strip(), allow_abbrev=False)
    arg = parser.add_argument
    arg("config", nargs="?", help="config/NAME.py (nanoGPT style)")
    arg("--preset", choices=PRESETS, metavar="NAME",
        help=f"an [S] baseline, matched to --recipe (default: smelt): {', '.join(PRESETS)}")
    arg("--recipe", metavar="RECIPE", help=f"match to a loop recipe: {sorted(RECIPES)} or key=value,...")
    arg("--avg_doc_len", type=float, metavar="L",
        help=f"mean document length (default: the data's, else block_size; presets {PRESET_DOC_LEN})")
    arg("--attended", type=float, metavar="K", help="mean attended keys per query (overrides avg_doc_len)")
    arg("--vocab_size", type=int, default=4096, metavar="V", help="when the config's data_dir has no "
        "meta.json (default 4096: gpt2-4096; the [X] d8 configs' GPT-2 is 50304)")
    arg("--json", action="store_true", help="print one JSON object")
    arg = parser.add_argument_group("the memory planner").add_argument
    arg("--memory", action="store_true", help="GiB per GPU under ddp, fsdp, fsdp_grad_op")
    arg("--world_size", type=int, default=8, metavar="N", help="GPUs (default 8)")
    arg("--micro_batch", type=int, metavar="B", help="sequences per GPU (default: batch_size, else 1)")
    arg("--gpu_gb", type=float, default=80, metavar="GB", help="GiB of one GPU (default 80)")
    arg("--optimizer", choices=("muon", "muon_x", "adamw"), help="(default: the config's, else muon)")
    arg("--fp32", action="store_true", help="no bf16 autocast")
    arg("--triton", action="store_true", help="the Triton kernels' activations")
    args = parser.parse_args(argv)
    for name in ("avg_doc_len", "attended", "vocab_size", "world_size", "micro_batch", "gpu_gb"):
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and value > 0):
            parser.error(f"argument --{name}: {value}: must be a finite number > 0")
    if bool(args.config) == bool(args.preset):
        parser.error("give a config file or --preset")
    try:
        if args.preset:
            base, settings, where = preset_baseline(args.preset), {}, "the preset"
            doc_len, recipe = args.avg_doc_len or PRESET_DOC_LEN, args.recipe or "smelt"
        else:
            base, settings, where = read_config(args.config, args.vocab_size)
            doc_len, recipe = args.avg_doc_len or settings.get("mean_doc_len"), args.recipe
        attended = resolve_attended(base, args.attended, doc_len)
        matched, report = match(base, recipe, attended=attended) if recipe else (None, None)
    except ValueError as e:
        parser.error(str(e))
    lines = [f"vocab_size {base.vocab_size} from {where}, attended {attended:g} keys per query"]
    if args.memory:
        models = dict(baseline=base, matched=matched) if matched else dict(baseline=base)
        batch = args.micro_batch or settings.get("batch_size", 1)
        optimizer = args.optimizer or settings.get("optimizer", "muon")
        kernels = args.triton or settings.get("triton", False)
        out = {name: memory_plan(cfg, args.world_size, batch, optimizer, args.gpu_gb, not args.fp32, kernels)
               for name, cfg in models.items()}
        lines += [memory_table(plan, f"{name}: " if matched else "") for name, plan in out.items()]
    elif matched:  # side by side, as [S] Table 10
        out = dict(baseline=summary(base, attended), matched=summary(matched, attended, base),
                   ratios=report["ratios"])
        lines.append(f"recipe {report['recipe']}, {report['candidates']} candidates searched")
        lines.append(f"  {'':<19}  {'baseline':>12}  {'matched':>12}")
        lines += [f"  {k:<19}  {short(v):>12}  {short(out['matched'][k]):>12}"
                  for k, v in out["baseline"].items()]
        lines.append("  ratios (matched / baseline, as [S] Table 10): " +
                     ", ".join(f"{k} {v:.4f}" for k, v in report["ratios"].items()))
    else:  # the budget table
        out = accounting(base, attended) | {f"sparsity_{k}": v for k, v in sparsity(base, attended).items()}
        lines.append(f"{base.layout} L={base.n_layer} H={base.n_embd} heads={base.n_head}/{base.n_kv_head}x"
                     f"{base.head_dim} experts={base.n_expert} (top {base.top_k}, hidden "
                     f"{base.expert_hidden})")
        lines += [f"  {k:<21}  {short(v)}" for k, v in out.items()]
    out.update(vocab_size=base.vocab_size, vocab_from=where)
    print(json.dumps(out) if args.json else "\n".join(lines))


if __name__ == "__main__":
    main()
