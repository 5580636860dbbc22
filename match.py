"""
Analytic budget accounting and triple budget matching [S §budget matching, Appendix A; X10-X13],
and the per-GPU memory of training a config with DDP or FSDP2.

Everything here is arithmetic on a ModelConfig (no module is built, so a 54B-parameter config is
instant); which blocks run how often is read from model.execution_plan, never re-derived.

    python match.py config/smelt_200m_base.py            # accounting table of one config
    python match.py config/smelt_200m_base.py --json     # the same as one JSON object
    python match.py --preset smelt-200m-s95              # [S] baseline and matched SMELT twin side by side
    python match.py --preset smelt-200m-s95 --json       # {"baseline": ..., "matched": ..., "ratios": ...}
    python match.py config/smelt_200m_base.py --recipe smelt   # match any baseline to a loop recipe
    python match.py --preset smelt-1.6b-s97 --memory --world_size 16 --micro_batch 1 --activation_checkpointing
                                                         # per-GPU memory under DDP and FSDP2 (memory_plan)

Conventions (all per token):
  * FLOPs: a multiply-add is 2 FLOPs. Training = 3 x forward (backward = 2 x forward). Matmuls:
    attention projections, attention scores QK^T and PV at `attended` keys per query, MoE router,
    expert / MLP matmuls (top_k experts), unembedding. Elementwise work is counted only for RMSNorms
    ((3 + gain) * dim) and the boundary injection (2 * dim); softmax, SwiGLU, RoPE, residual adds and
    the top-k combine are not counted (all O(dim), small next to the matmuls).
  * attended: mean number of keys a query attends to. With the document mask a document of length L
    gives (L + 1) / 2 (causal average); default = one document filling block_size. For packed
    documents of varying length use the token-weighted mean length E[L^2] / E[L].
  * params_nonembedding: everything but the token embedding and an untied lm head (= model.num_params).
    params_active: non-embedding params one token touches, every stored block once, top_k experts
    (= model.num_params()["active"]). N_c [X10]: matrix params multiplied per token, counted per
    execution (prelude/coda once, core K times, lm head once, no input embedding); 6 N_c is the
    leading-order training FLOPs and equals the non-attention matmul FLOPs exactly. N_s [X10]: every
    stored parameter, token embedding and lm head included (= params_total; the N of the [X] code's
    TPP step counts: d8 Vanilla 205.8M, config/x_d8_vanilla.py).
  * KV cache: executed layers x 2 x n_kv_head x head_dim elements per token (every visit of a looped
    layer keeps its own keys and values).
  * Checked in tests/test_match.py: params == GPT(cfg).num_params() == sum(p.numel()) for every family;
    active params == what a one-token backward touches; the matmul items == FlopCounterMode on a real
    forward + backward, exactly (SDPA forced onto its math path, whose full T x T bmms the counter
    sees, so attended = T there; the CPU flash kernel is invisible to the counter); the memory planner's
    states == FSDP2's real per-rank shards, exactly; its activations == the bytes autograd saves (1%).
"""

import argparse
import itertools
import json
import math
import os
import sys
import time
from dataclasses import dataclass, fields, replace
from functools import partial
from typing import NamedTuple

from common import cli_error
from model import ModelConfig, execution_plan, read_config_file

HERE = os.path.dirname(os.path.abspath(__file__))


# ----------------------------------------------------------------------------------------------------
# Attended length


def causal_attended(doc_len):
    """Mean keys per query for causal attention inside a document of doc_len tokens: (L + 1) / 2."""
    return (doc_len + 1) / 2


def resolve_attended(cfg, attended=None, avg_doc_len=None):
    """attended wins; else the causal average of avg_doc_len; else of a full block_size context."""
    if attended is not None and avg_doc_len is not None:
        raise ValueError("give either attended or avg_doc_len, not both")
    if attended is not None:
        if attended <= 0:
            raise ValueError(f"attended must be > 0, got {attended}")
        return float(attended)
    doc_len = cfg.block_size if avg_doc_len is None else avg_doc_len
    if doc_len < 1:
        raise ValueError(f"avg_doc_len must be >= 1, got {doc_len}")
    return causal_attended(doc_len)


# ----------------------------------------------------------------------------------------------------
# Per-block pieces


def _norm_params(cfg, dim):
    return dim if cfg.norm_gain else 0


def _norm_flops(cfg, dim):
    """RMSNorm as elementwise work: square, sum, scale (3 dim) and the gain multiply if any."""
    return (4 if cfg.norm_gain else 3) * dim


def block_shapes(cfg):
    """Parameter counts of one Block, split into the pieces the accounting needs."""
    H, q, kv = cfg.n_embd, cfg.n_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim
    attn = 2 * H * q + 2 * H * kv  # q, o and k, v projections
    qk_norm = 2 * _norm_params(cfg, cfg.head_dim) if cfg.qk_norm else 0
    norms = 2 * _norm_params(cfg, H)
    if cfg.n_expert:
        router = cfg.n_expert * H
        per_expert = 3 * H * cfg.expert_hidden  # SwiGLU gate, up, down
        ffn_all, ffn_active = cfg.n_expert * per_expert, cfg.top_k * per_expert
    else:
        router, per_expert = 0, 0
        ffn_all = ffn_active = 3 * H * cfg.mlp_hidden
    total = attn + qk_norm + norms + router + ffn_all
    return dict(attn=attn, qk_norm=qk_norm, norms=norms, router=router, per_expert=per_expert,
                ffn_all=ffn_all, ffn_active=ffn_active, total=total,
                active=total - ffn_all + ffn_active,
                matmul_active=attn + router + ffn_active)  # matrices one execution multiplies with


def block_forward_flops(cfg, attended):
    """Forward FLOPs of one block execution for one token, itemised."""
    H, q = cfg.n_embd, cfg.n_head * cfg.head_dim
    shapes = block_shapes(cfg)
    norms = 2 * _norm_flops(cfg, H)
    if cfg.qk_norm:
        norms += (cfg.n_head + cfg.n_kv_head) * _norm_flops(cfg, cfg.head_dim)
    return dict(
        attn_proj=2 * shapes["attn"],
        attn_scores=2 * 2 * q * attended,  # QK^T and PV, each 2 * n_head * head_dim per attended key
        router=2 * shapes["router"],
        ffn=2 * shapes["ffn_active"],  # top_k experts (or the dense MLP)
        norms=norms,
    )


# ----------------------------------------------------------------------------------------------------
# Accounting


FLOP_ITEMS = ("attn_proj", "attn_scores", "router", "ffn", "norms", "unembedding")


def accounting(cfg, attended=None, n_passes=None, avg_doc_len=None, kv_bytes_per_element=2):
    """The full per-token budget table of a config (see the module docstring for conventions).
    n_passes overrides K (prelude-core-coda) or r (loops) exactly as in model.execution_plan."""
    attended = resolve_attended(cfg, attended, avg_doc_len)
    plan = execution_plan(cfg, n_passes)
    executed = [s.block for s in plan if s.kind == "block"]
    H, V = cfg.n_embd, cfg.vocab_size
    shapes = block_shapes(cfg)

    # parameters: stored blocks, globals; active = stored blocks the plan uses, top_k experts each
    embedding = V * H + (0 if cfg.tie_embeddings else V * H)
    globals_ = _norm_params(cfg, H)  # norm_f
    if cfg.embed_norm:
        globals_ += _norm_params(cfg, H)
    if cfg.layout == "pcc" and cfg.boundary in ("both", "norm"):
        globals_ += _norm_params(cfg, H)  # one boundary norm shared by every boundary
    nonembedding = cfg.n_blocks * shapes["total"] + globals_
    active = len(set(executed)) * shapes["active"] + globals_
    compute_active = len(executed) * shapes["matmul_active"] + V * H  # [X10] N_c: per execution + head
    stored = nonembedding + embedding  # [X10] N_s: every stored parameter (the [X] TPP denominator)

    # forward FLOPs: every block execution, every boundary, the embedding norm, final norm, unembedding
    per_block = block_forward_flops(cfg, attended)
    forward = {k: len(executed) * v for k, v in per_block.items()}
    for s in plan:
        if s.kind == "boundary":
            forward["norms"] += (_norm_flops(cfg, H) if s.norm else 0) + (2 * H if s.inject else 0)
    forward["norms"] += _norm_flops(cfg, H) * (1 + bool(cfg.embed_norm))
    forward["unembedding"] = 2 * H * V
    training = {k: 3 * v for k, v in forward.items()}
    flops = sum(training.values())

    kv = len(executed) * 2 * cfg.n_kv_head * cfg.head_dim
    return dict(
        attended=attended,
        executed_layers=len(executed),
        stored_blocks=cfg.n_blocks,
        params_total=nonembedding + embedding,
        params_embedding=embedding,
        params_nonembedding=nonembedding,
        params_active=active,
        params_compute_active=compute_active,
        params_stored=stored,
        **{f"flops_{k}": training[k] for k in FLOP_ITEMS},
        flops_per_token=flops,
        flops_forward=flops / 3,
        flops_6n=6 * compute_active,
        kv_per_token=kv,
        kv_bytes_per_token=kv * kv_bytes_per_element,
    )


def flops_per_token(cfg, attended=None, n_passes=None, backward=True, avg_doc_len=None):
    """Per-token FLOPs with every block execution counted; training (backward=True) = 3 x forward."""
    a = accounting(cfg, attended, n_passes, avg_doc_len)
    return a["flops_per_token"] if backward else a["flops_forward"]


def run_flops(cfg, phases, attended=None, avg_doc_len=None):
    """Token-weighted training FLOPs of a run whose depth changes ([X13] growth): phases is a list of
    (tokens, n_passes) or (tokens, ModelConfig) (an untied growth changes the stored model, so pass
    the grown config). Returns total FLOPs, tokens, the token-weighted mean FLOPs per token, mean
    compute-active params N_c and mean number of passes."""
    if not phases:
        raise ValueError("phases is empty: give a list of (tokens, n_passes or ModelConfig)")
    total = tokens = n_c = passes = 0.0
    for i, (phase_tokens, what) in enumerate(phases):
        if phase_tokens < 0:
            raise ValueError(f"phases[{i}]: tokens must be >= 0, got {phase_tokens}")
        phase_cfg, k = (what, None) if isinstance(what, ModelConfig) else (cfg, what)
        a = accounting(phase_cfg, attended, k, avg_doc_len)
        total += phase_tokens * a["flops_per_token"]
        n_c += phase_tokens * a["params_compute_active"]
        default_k = phase_cfg.n_passes if phase_cfg.layout == "pcc" else phase_cfg.n_loops
        passes += phase_tokens * (default_k if k is None else k)
        tokens += phase_tokens
    if tokens == 0:
        raise ValueError("phases hold no tokens")
    return dict(flops=total, tokens=tokens, flops_per_token=total / tokens,
                params_compute_active=n_c / tokens, mean_passes=passes / tokens)


# ----------------------------------------------------------------------------------------------------
# Compute-equivalent sparsity [S1]


def fully_activated(cfg):
    """[S1] reference at the same scale: same n_layer (physical / nominal depth), width, heads, head
    size, KV heads, expert size, top_k, vocab and norms; not looped (layout "plain", one pass); every
    expert active (n_expert = top_k). A dense config stays dense (it is already fully activated)."""
    return replace(cfg, layout="plain", n_loops=1, n_passes=1, tie_core=True,
                   n_expert=cfg.top_k if cfg.n_expert else 0)


def sparsity(cfg, attended=None, baseline=None, n_passes=None, avg_doc_len=None):
    """[S1] N_act^eq = (F / F0) N0, S = 1 - N_act^eq / N, with F0, N0 the training FLOPs and
    non-embedding params of the fully activated reference. The reference is built from `baseline`
    when given (the [S] convention: a matched looped twin is measured against the *baseline's*
    reference, one reference per scale), else from cfg itself with its loop removed.
    A looped dense model comes out with S < 0: it spends more FLOPs per parameter than its reference."""
    reference = fully_activated(baseline if baseline is not None else cfg)
    a = accounting(cfg, attended, n_passes, avg_doc_len)
    a0 = accounting(reference, attended, None, avg_doc_len)
    F, F0 = a["flops_per_token"], a0["flops_per_token"]
    N, N0 = a["params_nonembedding"], a0["params_nonembedding"]
    n_act_eq = F / F0 * N0  # [S1] equivalent activated params
    return dict(F=F, N=N, F0=F0, N0=N0, N_act_eq=n_act_eq, S=1 - n_act_eq / N)


# ----------------------------------------------------------------------------------------------------
# Triple budget matching [S §budget matching]

RECIPES = {
    "smelt": dict(layout="smelt", n_loops=2),  # [S] loop the middle half twice, 1/r residual scaling
    "smelt3": dict(layout="smelt", n_loops=3),
    "layer_loop": dict(layout="layer_loop", n_loops=2),
    "pcc2": dict(layout="pcc", n_passes=2, tie_core=True),  # [X] Loop-2 (tied core, two passes)
    "pcc2_untied": dict(layout="pcc", n_passes=2, tie_core=False),  # [X] Untied-2
}


def _as_tuple(x):
    return (x,) if isinstance(x, int) else tuple(x)


def _round_to(x, multiple):
    return max(multiple, multiple * round(x / multiple))


def parse_recipe(recipe):
    """A recipe is a dict of ModelConfig overrides, a name in RECIPES, or 'key=value,key=value'."""
    if isinstance(recipe, dict):
        return dict(recipe)
    if recipe in RECIPES:
        return dict(RECIPES[recipe])
    out = {}
    for item in str(recipe).split(","):
        if "=" not in item:
            raise ValueError(f"recipe {recipe!r}: expected a name in {sorted(RECIPES)} or key=value pairs")
        key, value = item.split("=", 1)
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            pass  # a bare string such as layout=smelt
        out[key.strip()] = value
    return out


def _ratios(a, a_base, budgets):
    return {b: a[key] / a_base[key] for b, key in budgets.items()}


BUDGET_KEYS = dict(flops="flops_per_token", params="params_nonembedding", kv="kv_per_token")


@dataclass(frozen=True)
class MatchSearch:
    """What match() searches and how close it must get. Tolerances are fractions of the baseline.
    flops_tol = (below, above): the default (0, 0.05) never gives the looped model less compute than
    the baseline, like every cell of [S] Table 10. A tuple of multiples is tried in order (coarsest
    first); a finer grid is searched only when the coarser one holds no match."""
    flops_tol: tuple = (0.0, 0.05)
    params_tol: float = 0.015
    kv_tol: float = 0.04
    width_multiple: tuple = (32, 16, 8)  # grid of n_embd
    expert_multiple: tuple = (8, 4, 2, 1)  # grid of n_expert, tried inside each width grid
    hidden_multiple: int = 16  # expert_hidden / mlp_hidden rounding
    head_multiple: int = 8  # grid of head_dim
    head_dim_range: tuple = (16, 256)

    def __post_init__(self):  # a bare number is a symmetric tolerance / a one-grid search
        if isinstance(self.flops_tol, (int, float)):
            object.__setattr__(self, "flops_tol", (self.flops_tol, self.flops_tol))
        for name in ("width_multiple", "expert_multiple"):
            object.__setattr__(self, name, _as_tuple(getattr(self, name)))


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
    violations: dict  # budget -> amount outside its tolerance


def match(baseline, recipe="smelt", attended=None, avg_doc_len=None, budgets=("flops", "params", "kv"),
          search=None, **options):
    """Search width H, experts per layer, head size and GQA ratio of `baseline` + `recipe` so that
    training FLOPs, non-embedding params and KV cache per token match the baseline.
    Returns (matched_cfg, report) with report["ratios"] = F/F_base, N/N_base, KV/KV_base ([S] Table 10).
    search: a MatchSearch (tolerances and grids); keyword options override its fields, e.g.
    match(base, "smelt", width_multiple=(16, 8), params_tol=0.01).

    Search space (deterministic, exhaustive, < 1 s):
      H            multiples of width_multiple in [H_b / 4, 2 H_b]; a tuple (32, 16, 8) tries the grids in
                   order and takes the first one holding a match (small widths need the finer grid)
      expert size  expert_hidden (or mlp_hidden) scaled with H, rounded to hidden_multiple: narrowing
                   H also shrinks every expert's FFN, as in the [S] worked example (§budget matching)
      head_dim     multiples of head_multiple in head_dim_range; n_kv_head any value for which
                   layers x 2 x n_kv_head x head_dim is within kv_tol of the baseline's KV
      n_head       the multiples of n_kv_head nearest to the baseline's query width scaled with H
      n_expert     solved from the params budget, rounded to expert_multiple (>= top_k; a tuple is
                   tried in order like width_multiple, inside each width grid); a dense
                   baseline stays dense, so its params follow from H alone
    A budget left out of `budgets` is reported but not matched (e.g. budgets=("flops",) for the [X]
    FLOPs-only protocol). Among candidates inside every tolerance the one with the smallest sum of
    squared deviations / tolerance wins, plus penalties for a query width, head size or KV-head count
    far from the baseline's. Infeasible: ValueError naming each budget that could not be met and by
    how much."""
    t0 = time.perf_counter()
    try:
        search = replace(search or MatchSearch(), **options)
    except TypeError:
        known = [f.name for f in fields(MatchSearch)]
        raise ValueError(f"unknown match options {sorted(set(options) - set(known))}; choose from {known}") from None
    overrides = parse_recipe(recipe)
    budgets = tuple(budgets)
    unknown = sorted(set(budgets) - set(BUDGET_KEYS))
    if unknown:
        raise ValueError(f"unknown budgets {unknown}; choose from {sorted(BUDGET_KEYS)}")
    a_base = accounting(baseline, attended, avg_doc_len=avg_doc_len)
    try:
        template = replace(baseline, **overrides)
    except (TypeError, ValueError) as e:
        raise ValueError(f"recipe {overrides} does not apply to the baseline: {e}") from e
    heads = _kv_head_shapes(baseline, template.executed_layers(), a_base["kv_per_token"], budgets, search)

    closest = found_in = None
    for grid in itertools.product(search.width_multiple, search.expert_multiple):  # coarsest grids first
        candidates = _candidates(baseline, template, budgets, a_base, heads, search, *grid)
        if candidates and (closest is None or candidates[0][:2] < closest[:2]):
            closest, found_in = candidates[0], (grid, len(candidates))
        if closest is not None and closest.violation == 0:
            break  # a finer grid is searched only when nothing on the coarser ones fits
    if closest is None:
        raise ValueError("no candidate configuration could be built; widen head_dim_range or width range")
    (multiple, e_multiple), n_candidates = found_in
    cfg, r = closest.cfg, closest.ratios
    if closest.violation > 0:
        (f_lo, f_hi), parts = search.flops_tol, []
        bounds = dict(flops=f"[{1 - f_lo:.3f}, {1 + f_hi:.3f}]",
                      params=f"1 +- {search.params_tol:.3f}", kv=f"1 +- {search.kv_tol:.3f}")
        for b in budgets:
            if closest.violations[b] > 0:
                parts.append(f"{b} budget not met: ratio {r[b]:.4f} outside {bounds[b]} by "
                             f"{closest.violations[b] * 100:.2f}%")
        raise ValueError(f"no configuration matches {overrides} to the baseline; the closest one "
                         f"(n_embd={cfg.n_embd}, n_expert={cfg.n_expert}, head_dim={cfg.head_dim}, "
                         f"n_kv_head={cfg.n_kv_head}): " + "; ".join(parts))
    attended_value = a_base["attended"]
    report = dict(recipe=overrides, attended=attended_value, ratios=r, score=closest.score,
                  baseline=a_base, matched=accounting(cfg, attended_value),
                  sparsity_baseline=sparsity(baseline, attended_value),
                  sparsity_matched=sparsity(cfg, attended_value, baseline=baseline),
                  candidates=n_candidates, width_multiple=multiple, expert_multiple=e_multiple,
                  seconds=time.perf_counter() - t0)
    return cfg, report


def _kv_head_shapes(baseline, executed, kv_base, budgets, search):
    """(head_dim, n_kv_head, KV ratio) meeting the KV budget: KV depends only on the executed layers,
    n_kv_head and head_dim. Without a KV budget: the baseline's head shape."""
    hd_b, n_kv_b = int(baseline.head_dim), int(baseline.n_kv_head)  # plain ints: kept, not re-derived
    if "kv" not in budgets:
        return [(hd_b, n_kv_b, executed * 2 * n_kv_b * hd_b / kv_base)]
    lo, hi = search.head_dim_range
    head_dims = range(lo + (-lo) % search.head_multiple, hi + 1, search.head_multiple)
    heads = []
    for hd in head_dims:
        for n_kv in range(1, 257):
            kv_ratio = executed * 2 * n_kv * hd / kv_base
            if kv_ratio > 1 + search.kv_tol:
                break
            if kv_ratio >= 1 - search.kv_tol:
                heads.append((hd, n_kv, kv_ratio))
    if not heads:
        best = min(((hd, n_kv) for hd in head_dims for n_kv in range(1, 257)),
                   key=lambda p: abs(executed * 2 * p[1] * p[0] / kv_base - 1))
        ratio = executed * 2 * best[1] * best[0] / kv_base
        raise ValueError(
            f"KV budget cannot be met: {executed} executed layers need 2 x n_kv_head x head_dim = "
            f"{kv_base / executed:.1f} elements per layer, but with head_dim a multiple of {search.head_multiple} "
            f"in {tuple(search.head_dim_range)} the nearest is n_kv_head={best[1]}, head_dim={best[0]}: KV "
            f"ratio {ratio:.4f}, off by {abs(ratio - 1) * 100:.1f}% (tolerance {search.kv_tol * 100:.1f}%)")
    return heads


def _candidates(baseline, template, budgets, a_base, heads, search, width_multiple, expert_multiple):
    """Every Candidate of match() on one (width, expert count) grid, best first."""
    attended_value = a_base["attended"]
    H_b, hd_b = baseline.n_embd, baseline.head_dim
    q_b = baseline.n_head * baseline.head_dim
    moe = baseline.n_expert > 0
    hidden_b = baseline.expert_hidden if moe else baseline.mlp_hidden
    f_lo, f_hi = search.flops_tol
    tol = dict(flops=max(f_lo + f_hi, 1e-3), params=search.params_tol, kv=search.kv_tol)
    candidates = []
    widths = range(max(width_multiple, _round_to(H_b / 4, width_multiple)), 2 * H_b + 1, width_multiple)
    for H in widths:
        hidden = _round_to(hidden_b * H / H_b, search.hidden_multiple)
        for hd, n_kv, _ in heads:
            target_heads = q_b * H / H_b / hd
            options = {max(n_kv, n_kv * math.floor(target_heads / n_kv)), n_kv * math.ceil(target_heads / n_kv)}
            for n_head in sorted(options):
                shape = dict(n_embd=H, n_head=n_head, n_kv_head=n_kv, head_dim=hd)
                shape.update(expert_hidden=hidden, mlp_hidden=0) if moe else shape.update(mlp_hidden=hidden)
                if moe:
                    shape["n_expert"] = baseline.n_expert
                try:
                    cfg = replace(template, **shape)
                except ValueError:
                    continue
                if moe and "params" in budgets:  # params are affine in n_expert: solve, then round
                    per_expert_layer = 3 * H * hidden + H  # expert matrices + its router row
                    n_now = accounting(cfg, attended_value)["params_nonembedding"]
                    fixed = n_now - cfg.n_blocks * cfg.n_expert * per_expert_layer
                    n_exp = (a_base["params_nonembedding"] - fixed) / (cfg.n_blocks * per_expert_layer)
                    n_exp = max(_round_to(n_exp, expert_multiple), cfg.top_k)
                    cfg = replace(cfg, n_expert=n_exp)
                r = _ratios(accounting(cfg, attended_value), a_base, BUDGET_KEYS)
                dev = {b: r[b] - 1 for b in BUDGET_KEYS}
                violations = dict(flops=max(0.0, -dev["flops"] - f_lo, dev["flops"] - f_hi),
                                  params=max(0.0, abs(dev["params"]) - search.params_tol),
                                  kv=max(0.0, abs(dev["kv"]) - search.kv_tol))
                violations = {b: v if b in budgets else 0.0 for b, v in violations.items()}
                score = sum((dev[b] / tol[b]) ** 2 for b in budgets)
                score += (math.log(n_head * hd / (q_b * H / H_b)) / 0.05) ** 2  # keep the query width
                score += (math.log(hd / hd_b) / 0.5) ** 2  # and, weakly, the head size
                score += (math.log(n_kv / baseline.n_kv_head) / 0.5) ** 2  # and the number of KV heads
                candidates.append(Candidate(sum(violations.values()), score, H, hd, n_kv, n_head, cfg, r,
                                            violations))
    candidates.sort(key=lambda c: c[:6])
    return candidates


# ----------------------------------------------------------------------------------------------------
# [S] presets: the four scales of the paper (L = 10/12/20/30, H = 672/1280/1792/2304)
#
# The paper's baseline family is proprietary; the unstated details are chosen so that the 200M,
# S~0.95 worked example reproduces: 1.33e9 FLOPs/token, 3.87e9 non-embedding params, 0.207B active
# (see config/smelt_200m_base.py for the reasoning). Every scale uses the same rules: head_dim 128
# (96 at H=672), query width = H, 2 KV heads (1 when n_head is odd), expert_hidden = H/3 rounded to 16,
# vocab 4096 (the project's gpt2-4096 tokenizer), 4096-token packed context, average document length
# 512. With these rules the 600M and 1.6B baselines come out at 0.663B / 1.641B active params (paper
# 0.665B / 1.632B) and the largest, 1.6B with 336 experts, at 53.89B total params with a 504-expert
# SMELT twin, both as in the paper. At 100M, H/3 would give only 0.05B active, so the 100M experts are
# wider (560) to reach the paper's 0.100B. Only smelt-200m-s95 is pinned by the paper's numbers; the
# other expert counts are chosen to hit S of about 0.85 / 0.95 / 0.97.

SCALES = {  # name: (n_layer, n_embd, n_head, head_dim, expert_hidden, {target S: experts per layer})
    "100m": (10, 672, 7, 96, 560, {85: 56, 95: 176, 97: 288}),
    "200m": (12, 1280, 10, 128, 432, {85: 64, 95: 192, 97: 336}),
    "600m": (20, 1792, 14, 128, 592, {85: 64, 95: 192, 97: 336}),
    "1.6b": (30, 2304, 18, 128, 768, {85: 64, 95: 192, 97: 336}),
}
PRESET_DOC_LEN = 512


def preset_baseline(name):
    """'smelt-200m-s95' -> (baseline ModelConfig, avg_doc_len). The 200M S~0.95 baseline is read from
    config/smelt_200m_base.py; the other scales are built with the same rules."""
    names = [f"smelt-{scale}-s{s}" for scale, v in SCALES.items() for s in v[-1]]
    if name not in names:
        raise ValueError(f"unknown preset {name!r}; choose from {names}")
    if name == "smelt-200m-s95":
        cfg, settings = read_config(os.path.join(HERE, "config", "smelt_200m_base.py"))
        return cfg, settings["avg_doc_len"]
    _, scale, s = name.split("-")
    n_layer, H, n_head, hd, hidden, experts = SCALES[scale]
    cfg = ModelConfig(vocab_size=4096, eot_token=4095, block_size=4096, n_layer=n_layer, n_embd=H,
                      n_head=n_head, n_kv_head=2 if n_head % 2 == 0 else 1, head_dim=hd,
                      n_expert=experts[int(s[1:])], top_k=8, expert_hidden=hidden, layout="plain")
    return cfg, PRESET_DOC_LEN


def read_config(path):
    """A nanoGPT-style config file -> (ModelConfig, settings): the model (ModelConfig.from_file, the one
    reader of config files) and the file's other keys, of which match.py uses avg_doc_len (attention
    FLOPs; train.py passes the same setting to flops_per_token, 0 meaning block_size) and batch_size
    (the per-GPU micro-batch of the memory planner)."""
    cfg = ModelConfig.from_file(path)
    model_fields = {f.name for f in fields(ModelConfig)}
    settings = {k: v for k, v in read_config_file(path).items() if k not in model_fields}
    if not settings.get("avg_doc_len"):  # absent or 0: a full block_size document, as in train.py
        settings["avg_doc_len"] = None
    return cfg, settings


# ----------------------------------------------------------------------------------------------------
# Memory planner: what one GPU holds while training with DDP or FSDP2
#
# The training setup it describes (train.py): fp32 master weights and fp32 gradients; Muon keeps one
# fp32 momentum buffer per hidden matrix, AdamW two fp32 buffers (exp_avg, exp_avg_sq) per parameter;
# bf16 autocast compute on CUDA. DDP: every GPU holds everything. FSDP2: fully_shard on every stored
# block and on the whole model, every parameter sharded on dim 0 (Shard(0)). All sizes in GiB (2^30 B).

GIB = 2 ** 30
HEADROOM = 0.10  # fraction of each GPU kept free: CUDA context, NCCL buffers, fragmentation, optimizer step


def param_shapes(cfg):
    """Every parameter tensor GPT(cfg) stores, in model order, as (name, shape, group); a tied lm head is
    the embedding, listed once (as named_parameters does). group is the optimizer group of
    train.param_groups: "matrix" (2-D and stacked 3-D weights inside blocks, routers excepted) goes to
    Muon; "embedding", "unembedding", "router" and "vector" (norm gains) go to AdamW."""
    H, V, hd = cfg.n_embd, cfg.vocab_size, cfg.head_dim
    q, kv = cfg.n_head * hd, cfg.n_kv_head * hd
    gain = cfg.norm_gain  # RMSNorms without a gain have no parameter
    out = [("wte.weight", (V, H), "embedding")]
    if cfg.embed_norm and gain:
        out.append(("embed_norm.weight", (H,), "vector"))
    for i in range(cfg.n_blocks):
        block = [("norm1.weight", (H,), "vector")] if gain else []
        block += [("attn.q_proj.weight", (q, H), "matrix"), ("attn.k_proj.weight", (kv, H), "matrix"),
                  ("attn.v_proj.weight", (kv, H), "matrix"), ("attn.o_proj.weight", (H, q), "matrix")]
        if cfg.qk_norm and gain:
            block += [("attn.q_norm.weight", (hd,), "vector"), ("attn.k_norm.weight", (hd,), "vector")]
        if gain:
            block.append(("norm2.weight", (H,), "vector"))
        if cfg.n_expert:  # experts stacked (E, out, in)
            E, F = cfg.n_expert, cfg.expert_hidden
            block += [("ffn.router.weight", (E, H), "router"), ("ffn.w_gate", (E, F, H), "matrix"),
                      ("ffn.w_up", (E, F, H), "matrix"), ("ffn.w_down", (E, H, F), "matrix")]
        else:
            F = cfg.mlp_hidden
            block += [("ffn.w_gate.weight", (F, H), "matrix"), ("ffn.w_up.weight", (F, H), "matrix"),
                      ("ffn.w_down.weight", (H, F), "matrix")]
        out += [(f"blocks.{i}.{name}", shape, group) for name, shape, group in block]
    if cfg.layout == "pcc" and cfg.boundary in ("both", "norm") and gain:
        out.append(("boundary_norm.weight", (H,), "vector"))
    if gain:
        out.append(("norm_f.weight", (H,), "vector"))
    if not cfg.tie_embeddings:
        out.append(("lm_head.weight", (V, H), "unembedding"))
    return out


def state_bytes_per_element(group, optimizer="muon"):
    """fp32 weight (4) + fp32 gradient (4) + optimizer state: one fp32 momentum for a Muon matrix (4),
    exp_avg and exp_avg_sq for an AdamW parameter (8). optimizer="adamw": AdamW on everything."""
    if optimizer not in ("muon", "adamw"):
        raise ValueError(f"optimizer={optimizer!r}: must be 'muon' or 'adamw'")
    return 4 + 4 + (4 if optimizer == "muon" and group == "matrix" else 8)


def state_bytes_per_rank(cfg, world_size=1, optimizer="muon"):
    """Exact bytes of weights, gradients and optimizer state on the fullest rank when every parameter is
    sharded on dim 0 over world_size ranks like FSDP2's Shard(0) (torch.chunk: rank r holds rows
    [r c, min(n, (r + 1) c)) with c = ceil(n / world_size)). Rank 0 holds c rows of every parameter, so
    it is the fullest for all of them at once. world_size=1: the unsharded total (DDP, one GPU)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    total = 0
    for _, shape, group in param_shapes(cfg):
        rows = -(-shape[0] // world_size)  # ceil
        total += rows * math.prod(shape[1:]) * state_bytes_per_element(group, optimizer)
    return total


def activation_bytes(cfg, micro_batch, mixed_precision=True, activation_checkpointing=False, kernels=True,
                     n_passes=None):
    """Bytes one GPU keeps for the backward of micro_batch sequences of block_size tokens, itemised: the
    tensors autograd saves, counted per token. Byte sizes: a = 2 for matmul operands under bf16
    autocast (4 without), f = 4 for what stays fp32 (the residual stream, because the embedding output
    is fp32 and bf16 updates promote it; norm and softmax statistics; router logits), i = 8 for int64
    indices. q = n_head x head_dim, kv = n_kv_head x head_dim. g = 1 when the unfused PyTorch RMSNorm
    keeps x * rstd for the gain's gradient (norm_gain and not kernels), else 0. c = how often a norm
    output is saved: autocast casts the fp32 output once per consuming matmul (3 for q/k/v, 2 for a
    dense FFN's gate/up), while without autocast one fp32 tensor serves all (c = 1).
      norm(d)    = f d (input) + f (rstd) + g f d
      attention  = norm(H) + c a H (q/k/v inputs) + a (q + 2 kv) (RoPE'd q, k and v, kept by the flash /
                   flex kernel, which keeps no T x T matrix) + a q + f n_head (its output, log-sum-exp)
                   + a q (o_proj input); RoPE keeps nothing (cos / sin need no gradient)
                   [QK-norm adds its input a (q + kv), f (n_head + n_kv_head) and g f (q + kv)]
      dense FFN  = norm(H) + c a H + (4 unfused, 3 with the SwiGLU kernel) a mlp_hidden
      MoE FFN    = norm(H) + a H (router input) + f (2 E + 2) (router logits, probs, logsumexp, top-k sum)
                   + top_k [routed + 3 i + f + a (expert id, sort order, token index, top-k weight, its
                   gathered copy)], where routed = c a H + 5 a expert_hidden + f H on the PyTorch path
                   (model.run_experts: the token's sorted copy, c = 2 casts under autocast; gate
                   pre-activation, its SiLU, up, the hidden and the router-weighted hidden; the fp32 expert
                   output, which index_add_ keeps) and a (3 H + 2 expert_hidden) with the grouped-GEMM
                   kernel (sorted copy, kernel-saved SwiGLU, expert output, weighted output index_add keeps)
      block      = attention + FFN, once per *executed* block (each loop visit / pass saves its own)
      embedding  = i (token ids) [+ norm(H) with embed_norm];  boundary [X3] = norm(H) where it norms
      head       = norm(H) + a H (lm_head input) + f V (log-probs of the cross-entropy) + i (targets)
    saved = embedding + executed x block + boundaries + head, and logits_grad = f V (the fp32 gradient
    of the logits, alive with the saved tensors at the start of the backward) is added to the total.
    With activation checkpointing per executed block a block keeps only its input (f H), and one
    block's activations (recompute) are alive again while it is recomputed. Left out: per-block
    constants (RoPE tables, expert load statistics, MoE tile maps) and the backward's other gradient
    buffers; counted but smaller on the reference path: the norm of the zero state h0 [X] Algorithm 1.
    kernels=True describes the CUDA path (Triton RMSNorm, SwiGLU, grouped-GEMM MoE), False the PyTorch
    reference path (CPU; tests/test_match.py measures it with saved_tensors_hooks)."""
    if micro_batch < 1:
        raise ValueError(f"micro_batch must be >= 1, got {micro_batch}")
    a, f, i = (2 if mixed_precision else 4), 4, 8
    H, V, E, k = cfg.n_embd, cfg.vocab_size, cfg.n_expert, cfg.top_k
    q, kv = cfg.n_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim
    g = int(cfg.norm_gain and not kernels)

    def norm(d, rows=1):  # input + rstd (+ x * rstd); rows: norms per token (one per head for QK-norm)
        return f * d + f * rows + g * f * d

    def copies(n):  # a norm output feeding n matmuls
        return n if mixed_precision else 1

    attention = norm(H) + copies(3) * a * H + a * (q + 2 * kv) + a * q + f * cfg.n_head + a * q
    if cfg.qk_norm:
        attention += a * (q + kv) + f * (cfg.n_head + cfg.n_kv_head) + g * f * (q + kv)
    if E:
        if kernels:  # sorted copy, kernel-saved SwiGLU, expert output, the weighted output index_add keeps
            routed = a * (3 * H + 2 * cfg.expert_hidden)
        else:  # model.run_experts: the sorted token (cast once per matmul under autocast), five hidden-wide
            routed = copies(2) * a * H + 5 * a * cfg.expert_hidden + f * H  # tensors, the fp32 expert output
        ffn = norm(H) + a * H + f * (2 * E + 2) + k * (routed + 3 * i + f + a)
    else:
        ffn = norm(H) + copies(2) * a * H + (3 if kernels else 4) * a * cfg.mlp_hidden
    block = attention + ffn
    plan = execution_plan(cfg, n_passes)
    executed = sum(s.kind == "block" for s in plan)
    boundaries = sum(norm(H) for s in plan if s.kind == "boundary" and s.norm)
    embedding = i + (norm(H) if cfg.embed_norm else 0)
    head = norm(H) + a * H + f * V + i
    tokens = micro_batch * cfg.block_size
    if activation_checkpointing:
        blocks, recompute = executed * f * H, block
    else:
        blocks, recompute = executed * block, 0
    items = dict(embedding=embedding, blocks=blocks, boundaries=boundaries, head=head)
    items = {name: tokens * v for name, v in items.items()}
    items["saved"] = sum(items.values())
    items.update(recompute=tokens * recompute, logits_grad=tokens * f * V, per_block=tokens * block,
                 executed_blocks=executed, tokens=tokens)
    items["total"] = items["saved"] + items["recompute"] + items["logits_grad"]
    return items


def weight_copy_bytes(cfg, activation_checkpointing=False, n_passes=None):
    """Bytes of the bf16 copies that autocast makes of fp32 weights and autograd keeps for the backward
    (DDP; FSDP2 computes with its own bf16 parameters): 2 B x the attention, router, dense-FFN and
    lm-head matrices once (autocast caches the cast of a leaf weight for the whole forward, so a
    looped block's second visit reuses it) + 2 B x the experts of every executed MoE block (the
    expert stack is cast per call; with activation checkpointing only the recomputed block's)."""
    shapes = block_shapes(cfg)
    executed = [s.block for s in execution_plan(cfg, n_passes) if s.kind == "block"]
    experts = shapes["ffn_all"] if cfg.n_expert else 0
    cached = len(set(executed)) * (shapes["attn"] + shapes["router"] + shapes["ffn_all"] - experts)
    visits = 1 if activation_checkpointing else len(executed)
    return 2 * (cached + cfg.vocab_size * cfg.n_embd + visits * experts)


def memory_plan(cfg, world_size, micro_batch, optimizer="muon", activation_checkpointing=False, gpu_gb=80,
                mixed_precision=True, headroom=HEADROOM, n_passes=None):
    """Per-GPU memory, in GiB, of training cfg with micro_batch sequences of block_size tokens per GPU
    on world_size GPUs of gpu_gb GiB, under DDP and under FSDP2. Returns the settings and
    {"ddp": {...}, "fsdp": {...}}, each with states_gb_per_gpu, activations_gb_per_gpu,
    transient_gb_per_gpu, total_gb_per_gpu, fits and max_micro_batch.
      states       sum over parameters of numel x (4 weight + 4 grad + 4 Muon momentum or 8 AdamW moments);
                   FSDP2: of the fullest rank's shard, ceil(dim0 / world_size) rows (state_bytes_per_rank)
      activations  activation_bytes(...)["total"]; the same under both (each GPU runs its own micro-batch)
      transient    DDP: its gradient buckets, a second fp32 copy of the gradients (4 B/param; zero with
                   DistributedDataParallel(gradient_as_bucket_view=True)), and under autocast the bf16
                   weight copies autograd keeps for the backward (weight_copy_bytes).
                   FSDP2: unsharded parameters and gradients (bf16 with mixed precision, param and reduce
                   dtype; fp32 without) of the root (embedding, lm head, norms: FSDP2 does not reshard
                   the root after forward) and of 2 blocks (the one computing, the one prefetched):
                   (root + 2 x block params) x (2 + 2) bytes.
      fits         total <= (1 - headroom) x gpu_gb; the headroom (10%) is for the CUDA context, NCCL
                   buffers, allocator fragmentation, and the optimizer step (one all-gathered Muon matrix
                   and its Newton-Schulz iterates, after the activations are freed)
      max_micro_batch  the largest micro-batch that fits (activations are linear in it; 0: none does)"""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if gpu_gb <= 0:
        raise ValueError(f"gpu_gb must be > 0, got {gpu_gb}")
    if not 0 <= headroom < 1:
        raise ValueError(f"headroom must be in [0, 1), got {headroom}")
    act = activation_bytes(cfg, micro_batch, mixed_precision, activation_checkpointing, True, n_passes)
    per_sequence = activation_bytes(cfg, 1, mixed_precision, activation_checkpointing, True, n_passes)["total"]
    shapes = block_shapes(cfg)
    n_params = sum(math.prod(shape) for _, shape, _ in param_shapes(cfg))
    root = n_params - cfg.n_blocks * shapes["total"]

    weight_copies = weight_copy_bytes(cfg, activation_checkpointing, n_passes) if mixed_precision else 0
    unsharded = 2 if mixed_precision else 4
    transient = dict(ddp=4 * n_params + weight_copies,
                     fsdp=(root + 2 * shapes["total"]) * 2 * unsharded)
    states = dict(ddp=state_bytes_per_rank(cfg, 1, optimizer), fsdp=state_bytes_per_rank(cfg, world_size, optimizer))
    usable = (1 - headroom) * gpu_gb * GIB
    plan = dict(world_size=world_size, micro_batch=micro_batch, tokens_per_gpu=act["tokens"],
                optimizer=optimizer, mixed_precision=mixed_precision,
                activation_checkpointing=activation_checkpointing, gpu_gb=gpu_gb, headroom=headroom,
                usable_gb=usable / GIB)
    for name in ("ddp", "fsdp"):
        total = states[name] + act["total"] + transient[name]
        plan[name] = dict(states_gb_per_gpu=states[name] / GIB, activations_gb_per_gpu=act["total"] / GIB,
                          transient_gb_per_gpu=transient[name] / GIB, total_gb_per_gpu=total / GIB,
                          fits=total <= usable,
                          max_micro_batch=max(0, int((usable - states[name] - transient[name]) // per_sequence)))
    return plan


def memory_table(plan):
    """The memory plan as a small text table."""
    p = plan
    lines = [f"memory per GPU (GiB): {p['world_size']} GPUs x {p['gpu_gb']:g} GiB, fits if total <= "
             f"{p['usable_gb']:.1f} ({p['headroom']:.0%} headroom); micro-batch {p['micro_batch']} x "
             f"{p['tokens_per_gpu'] // p['micro_batch']} tokens; {p['optimizer']}, "
             f"{'bf16 autocast' if p['mixed_precision'] else 'fp32'}, activation checkpointing "
             f"{'on' if p['activation_checkpointing'] else 'off'}",
             f"  {'':<5} {'states':>8} {'activations':>12} {'transient':>10} {'total':>8} {'fits':>5} "
             f"{'max micro-batch':>16}"]
    for name in ("ddp", "fsdp"):
        m = p[name]
        lines.append(f"  {name:<5} {m['states_gb_per_gpu']:>8.1f} {m['activations_gb_per_gpu']:>12.1f} "
                     f"{m['transient_gb_per_gpu']:>10.1f} {m['total_gb_per_gpu']:>8.1f} "
                     f"{'yes' if m['fits'] else 'no':>5} {m['max_micro_batch']:>16}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------
# CLI


def summary(cfg, attended, baseline=None):
    """The per-config JSON record of the CLI."""
    a = accounting(cfg, attended)
    return dict(n_layer=cfg.n_layer, executed_layers=a["executed_layers"], n_embd=cfg.n_embd,
                n_head=cfg.n_head, n_kv_head=cfg.n_kv_head, head_dim=cfg.head_dim, n_expert=cfg.n_expert,
                top_k=cfg.top_k, expert_hidden=cfg.expert_hidden, layout=cfg.layout,
                flops_per_token=a["flops_per_token"], params_nonembedding=a["params_nonembedding"],
                params_active=a["params_active"], kv_per_token=a["kv_per_token"],
                sparsity_S=sparsity(cfg, attended, baseline=baseline)["S"], attended=attended)


def _fmt(v):
    if isinstance(v, float) and not v.is_integer():
        return f"{v:.4g}" if abs(v) < 1e4 else f"{v:.4e}"
    if isinstance(v, (int, float)) and abs(v) >= 1e6:
        return f"{v:.4e}"
    return str(int(v) if isinstance(v, float) else v)


def accounting_table(cfg, attended):
    a = accounting(cfg, attended)
    a.update({f"sparsity_{k}": v for k, v in sparsity(cfg, attended).items() if k in ("F0", "N0", "N_act_eq", "S")})
    width = max(map(len, a))
    lines = [f"{cfg.layout} L={cfg.n_layer} H={cfg.n_embd} heads={cfg.n_head}/{cfg.n_kv_head}x{cfg.head_dim} "
             f"experts={cfg.n_expert} (top {cfg.top_k}, hidden {cfg.expert_hidden})"]
    lines += [f"  {k:<{width}}  {_fmt(v)}" for k, v in a.items()]
    return "\n".join(lines)


def side_by_side(base, matched, ratios):
    keys = list(base)
    width = max(map(len, keys))
    lines = [f"  {'':<{width}}  {'baseline':>12}  {'matched':>12}"]
    lines += [f"  {k:<{width}}  {_fmt(base[k]):>12}  {_fmt(matched[k]):>12}" for k in keys]
    lines.append("  ratios (matched / baseline, as [S] Table 10): " +
                 ", ".join(f"{k} {v:.4f}" for k, v in ratios.items()))
    return "\n".join(lines)


PROG = "match.py"
MEMORY_OPTIONS = ("world_size", "gpu_gb", "micro_batch", "optimizer", "activation_checkpointing", "dtype")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # a usage mistake is one line on stderr and exit 2, like every other one
        sys.exit(cli_error(PROG, ValueError(message)))


def main(argv=None):
    parser = _Parser(prog=PROG, description=__doc__.split("\n\n")[0],
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", nargs="?", help="config/NAME.py (nanoGPT style)")
    parser.add_argument("--preset", help="e.g. smelt-200m-s95: [S] baseline and matched SMELT side by side")
    parser.add_argument("--recipe", help=f"match the config to a loop recipe: {sorted(RECIPES)} or key=value,...")
    parser.add_argument("--avg_doc_len", type=float,
                        help="average document length (default: config's, else block_size)")
    parser.add_argument("--attended", type=float, help="mean attended keys per query (overrides avg_doc_len)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    mem = parser.add_argument_group("memory planner (memory_plan): per-GPU memory under DDP and FSDP2")
    mem.add_argument("--memory", action="store_true", help="add the memory plan of every model")
    mem.add_argument("--world_size", type=int, help="GPUs (default 8)")
    mem.add_argument("--gpu_gb", type=float, help="memory of one GPU in GiB (default 80)")
    mem.add_argument("--micro_batch", type=int, help="sequences per GPU (default: the config's batch_size, else 1)")
    mem.add_argument("--optimizer", choices=("muon", "adamw"), help="default muon (Muon + AdamW)")
    mem.add_argument("--activation_checkpointing", action="store_true", help="checkpoint every executed block")
    mem.add_argument("--dtype", choices=("bfloat16", "float32"), help="compute dtype (default bfloat16 autocast)")
    args = parser.parse_args(argv)
    if bool(args.config) == bool(args.preset):
        return cli_error(PROG, ValueError("give exactly one of a config file or --preset"))
    stray = [f"--{name}" for name in MEMORY_OPTIONS if getattr(args, name) not in (None, False)]
    if stray and not args.memory:
        return cli_error(PROG, ValueError(f"{', '.join(stray)}: memory planner options, add --memory"))
    try:
        if args.preset:
            base, doc_len = preset_baseline(args.preset)
            settings, recipe = {}, args.recipe or "smelt"
        else:
            base, settings = read_config(args.config)
            doc_len, recipe = settings["avg_doc_len"], args.recipe
        doc_len = args.avg_doc_len if args.avg_doc_len is not None else doc_len
        attended = resolve_attended(base, args.attended, None if args.attended is not None else doc_len)
        plan_memory = None
        if args.memory:
            plan_memory = partial(memory_plan, world_size=_option(args.world_size, 8),
                                  micro_batch=_option(args.micro_batch, settings.get("batch_size", 1)),
                                  optimizer=_option(args.optimizer, "muon"),
                                  activation_checkpointing=args.activation_checkpointing,
                                  gpu_gb=_option(args.gpu_gb, 80), mixed_precision=args.dtype != "float32")
        if recipe is None:
            out = accounting(base, attended)
            out.update(sparsity(base, attended))
            if plan_memory:
                out["memory"] = plan_memory(base)
            if args.json:
                print(json.dumps(out))
            else:
                print(accounting_table(base, attended))
                if plan_memory:
                    print(memory_table(out["memory"]))
            return 0
        matched, report = match(base, recipe, attended=attended)
        b, m = summary(base, attended), summary(matched, attended, baseline=base)
        memory = dict(baseline=plan_memory(base), matched=plan_memory(matched)) if plan_memory else {}
    except (ValueError, OSError) as e:
        return cli_error(PROG, e)
    if args.json:
        if memory:
            b["memory"], m["memory"] = memory["baseline"], memory["matched"]
        print(json.dumps(dict(baseline=b, matched=m, ratios=report["ratios"])))
    else:
        print(f"recipe {report['recipe']}, attended {attended:g} keys/query, "
              f"{report['candidates']} candidates searched in {report['seconds']:.2f} s")
        print(side_by_side(b, m, report["ratios"]))
        for name, plan in memory.items():
            print(f"{name} {memory_table(plan)}")
    return 0


def _option(value, default):
    return default if value is None else value


if __name__ == "__main__":
    sys.exit(main())
