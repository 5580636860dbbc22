"""
Analytic budget accounting and triple budget matching [S §budget matching, Appendix A; X10-X13].

Everything here is arithmetic on a ModelConfig (no module is built, so a 54B-parameter config is
instant); which blocks run how often is read from model.execution_plan, never re-derived.

    python match.py config/smelt_200m_base.py            # accounting table of one config
    python match.py config/smelt_200m_base.py --json     # the same as one JSON object
    python match.py --preset smelt-200m-s95              # [S] baseline and matched SMELT twin side by side
    python match.py --preset smelt-200m-s95 --json       # {"baseline": ..., "matched": ..., "ratios": ...}
    python match.py config/smelt_200m_base.py --recipe smelt   # match any baseline to a loop recipe

What fits on which GPU (the memory planner) is operational: tooling/memory.py, `python -m tooling.memory`.

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
    sees, so attended = T there; the CPU flash kernel is invisible to the counter).
"""

import itertools
import json
import math
import sys
import time
from dataclasses import dataclass, fields, replace
from typing import NamedTuple

from model import ModelConfig, execution_plan


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
        if not (math.isfinite(attended) and attended > 0):  # nan passes `<= 0` and gives a table of nan
            raise ValueError(f"attended must be a finite number > 0, got {attended}")
        return float(attended)
    doc_len = cfg.block_size if avg_doc_len is None else avg_doc_len
    if not (math.isfinite(doc_len) and 1 <= doc_len <= cfg.block_size):
        raise ValueError(f"avg_doc_len must be a finite number in [1, block_size={cfg.block_size}] (a document "
                         f"seen in a window is at most that long), got {doc_len}")
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
    the grown config) or (tokens, ModelConfig, n_passes) (a grown model at drawn passes). Returns total
    FLOPs, tokens, the token-weighted mean FLOPs per token, mean compute-active params N_c and mean number
    of passes."""
    if not phases:
        raise ValueError("phases is empty: give a list of (tokens, n_passes or ModelConfig)")
    total = tokens = n_c = passes = 0.0
    for i, (phase_tokens, what, *drawn) in enumerate(phases):
        if phase_tokens < 0:
            raise ValueError(f"phases[{i}]: tokens must be >= 0, got {phase_tokens}")
        phase_cfg, k = (what, drawn[0] if drawn else None) if isinstance(what, ModelConfig) else (cfg, what)
        a = accounting(phase_cfg, attended, k, avg_doc_len)
        total += phase_tokens * a["flops_per_token"]
        n_c += phase_tokens * a["params_compute_active"]
        passes += phase_tokens * (phase_cfg.n_passes if k is None else k)
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
    return replace(cfg, layout="plain", n_passes=1, tie_core=True,
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
    "smelt": dict(layout="smelt", n_passes=2),  # [S] loop the middle half twice, 1/r residual scaling
    "smelt3": dict(layout="smelt", n_passes=3),
    "layer_loop": dict(layout="layer_loop", n_passes=2),
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
        check_search(self)


def check_search(search):
    """The ranges of a MatchSearch, each refused naming its field: tolerances are fractions of the
    baseline's budget in [0, 1) (0: exact; a negative one inverts the window, 1 or more accepts a
    twin with none of that budget), grids are integers >= 1, head_dim_range (lo, hi) with 2 <= lo <= hi."""
    def bad(name, why):
        raise ValueError(f"match option {name}={getattr(search, name)!r}: {why}")
    finite = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)  # noqa: E731
    if len(search.flops_tol) != 2 or not all(finite(t) and 0 <= t < 1 for t in search.flops_tol):
        bad("flops_tol", "must be (below, above), two fractions of the baseline's FLOPs in [0, 1)")
    for name in ("params_tol", "kv_tol"):
        if not (finite(getattr(search, name)) and 0 <= getattr(search, name) < 1):
            bad(name, "must be a fraction of the baseline's budget in [0, 1)")
    for name in ("width_multiple", "expert_multiple"):
        if not getattr(search, name) or not all(isinstance(m, int) and m >= 1 for m in getattr(search, name)):
            bad(name, "must be integers >= 1 (a grid, or a tuple of grids coarsest first)")
    for name in ("hidden_multiple", "head_multiple"):
        if not (isinstance(getattr(search, name), int) and getattr(search, name) >= 1):
            bad(name, "must be an integer >= 1")
    lo_hi = tuple(search.head_dim_range)
    if len(lo_hi) != 2 or not all(isinstance(v, int) for v in lo_hi) or not 2 <= lo_hi[0] <= lo_hi[1]:
        bad("head_dim_range", "must be (lo, hi), integers with 2 <= lo <= hi")


def check_recipe(baseline, template, overrides):
    """The recipe must make a twin that loops, or there is nothing to match: its loop span (SMELT [S8],
    layer-loop) or core ([X1]-[X2]) run >= 2 times, and more block executions than the baseline (a
    baseline that already runs the recipe has no twin to find)."""
    what = f"recipe {overrides}"  # a loop span of 0 layers: ModelConfig refuses it, or the last check names it
    if template.n_passes < 2:
        setting = {"pcc": "n_passes", "plain": "layout"}.get(template.layout, "n_passes")
        raise ValueError(f"{what}: {setting}={getattr(template, setting)!r}: the twin runs every block once; a loop "
                         "recipe needs a looped layout (smelt, layer_loop, pcc) run >= 2 times")
    if template.executed_layers() <= baseline.executed_layers():
        span = f" (loop_span={template.loop_span})" if template.layout in ("smelt", "layer_loop") else ""
        raise ValueError(f"{what}: the twin executes {template.executed_layers()} blocks per token{span}, the baseline "
                         f"{baseline.executed_layers()} (layout {baseline.layout!r}): the recipe adds no loop to it; "
                         "match a plain baseline")


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
    if not budgets:
        raise ValueError(f"budgets=(): give at least one of {sorted(BUDGET_KEYS)} to match")
    a_base = accounting(baseline, attended, avg_doc_len=avg_doc_len)
    try:
        template = replace(baseline, **overrides)
    except (TypeError, ValueError) as e:
        raise ValueError(f"recipe {overrides} does not apply to the baseline: {e}") from e
    check_recipe(baseline, template, overrides)
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
# Parameter tensors (the memory planner, tooling/memory.py, counts their bytes)


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
        out.append(("boundary.norm.weight", (H,), "vector"))
    if gain:
        out.append(("norm_f.weight", (H,), "vector"))
    if not cfg.tie_embeddings:
        out.append(("lm_head.weight", (V, H), "unembedding"))
    return out



if __name__ == "__main__":  # the command line is tooling (match_cli.py); this file only counts
    from tooling.match_cli import main
    sys.exit(main())
