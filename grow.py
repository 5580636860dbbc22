"""
Model growth: more core passes mid-training, and the growth-schedule math ([X] Algorithm 1, [X8]-[X15]).

  Loop-Grow (tied core):   K0 -> Kf passes of the SAME core. No new weights: only the pass count changes.
  Untied-Grow (untied):    cores C1..CK0 are copied after themselves, C1 C2 -> C1 C2 C1 C2 (depthwise
                           stacking, Du et al. 2024); new core j copies core j % K0 as the [X] code does, so
                           Kf need not be a multiple of K0 (Algorithm 1 itself uses Kf = m K0).
  Deep-Vanilla-Grow:       the same copy schedule on plain transformer blocks. Represent a Deep Vanilla as
                           layout="pcc", tie_core=False, boundary="none" (with the boundary off the
                           prelude-core-coda model IS a plain transformer of P + K C + D blocks); a
                           layout="plain" model is converted to exactly that (K0 = 1, the [X] even split)
                           before growing, without changing its function or its parameter names.
  SMELT loop / layer-loop: n_passes is the loop count r; only n_passes changes (tied, like Loop-Grow).

Live model (train.py):
    param_map = grow.grow(model, n_passes=4, untie=False)     # model grown in place
    state = grow.copy_optimizer_state(state_by_name, param_map)
Checkpoint:
    python grow.py --ckpt out/demo/ckpt.pt --passes 4 [--untie]      # in place (holding the run's lock): then
    python train.py --run_name=demo --init_from=resume                     # continues the grown run
    python grow.py --ckpt out/demo/ckpt.pt --passes 4 --out grown.pt  # elsewhere: continue it as a new run
    python train.py --init_from=grown.pt --run_name=demo_grown        # with init_from

The parameter map {name_after: name_before} covers EVERY parameter of the grown model, in
named_parameters order. Inserting cores shifts the coda's block indices, so names change even for
parameters that are not copies: e.g. P=2, C=3, K 2 -> 4 untied: blocks.8 (first coda block) becomes
blocks.14, and the new blocks.8 is a copy of blocks.2. Originals come before their copies, so the first name claiming a
source is the original; `copied_names(param_map)` lists the rest. Tied growth gives the identity map.
"""

import copy
import os
import sys
from dataclasses import replace

import torch.nn as nn

import match
from model import MAX_PASSES, PASSES_WHY, execution_plan
from tooling import checkpoint, match_cli
from tooling.checkpoint import load_model
from tooling import common
from tooling.common import cli_error
from tooling import rundir


# ----------------------------------------------------------------------------------------------------
# Growth of a live model


def grown_config(cfg, n_passes, untie=False):
    """The ModelConfig that grow(model, n_passes, untie) leaves on a model built from cfg, so a run can
    plan the grown model (memory, FLOPs) before it builds anything. Raises ValueError for a request
    growth cannot do; grow() makes exactly this change."""
    if not isinstance(n_passes, int) or isinstance(n_passes, bool):
        raise ValueError(f"n_passes must be an int, got {n_passes!r}")
    k0 = cfg.n_passes
    if cfg.layout in ("smelt", "layer_loop"):  # the loop span runs r times: growth = a larger r
        if untie:
            raise ValueError(f"untie=True: layout {cfg.layout!r} has no untied form (use layout='pcc')")
    elif untie and (cfg.layout == "plain" or not cfg.tie_core):
        what = "a plain transformer" if cfg.layout == "plain" else f"tie_core=False, {k0} stored cores"
        raise ValueError(f"untie=True but the model is already untied ({what})")
    if n_passes < k0:
        raise ValueError(f"cannot grow to fewer passes: model has {k0} passes, asked for {n_passes}")
    if n_passes == k0 and not untie:
        raise ValueError(f"model already has {k0} passes; nothing to grow (pass untie=True to only untie)")
    if cfg.layout in ("smelt", "layer_loop"):
        return replace(cfg, n_passes=n_passes)  # NOTE: the [S8]-[S9] 1/r update scale changes with r
    cfg = as_prelude_core_coda(cfg)
    return replace(cfg, n_passes=n_passes) if cfg.tie_core and not untie else \
        replace(cfg, tie_core=False, n_passes=n_passes)


def as_prelude_core_coda(cfg):
    """A plain transformer re-read as prelude-core-coda with K = 1, untied, boundary "none" (the [X] even
    split, remainder first to core then coda): the same blocks, names and function. Other layouts as is."""
    if cfg.layout != "plain":
        return cfg
    return replace(cfg, layout="pcc", tie_core=False, n_passes=1, boundary="none")


def grow(model, n_passes, untie=False):
    """Grow `model` (an unwrapped GPT: no DDP / torch.compile wrapper) in place to `n_passes` passes.

    tied pcc, untie=False:  only model.config.n_passes and model.plan change; every parameter is the same
                            tensor object with the same values.
    untied pcc:             new cores are deep copies (j % K0, [X] dep_stack_grow_init) inserted before the
                            coda; config.n_passes and plan updated.
    untie=True (tied pcc):  first turn the tied core into K0 untied copies (function unchanged), then grow.
    plain:                  read as pcc / tie_core=False / boundary="none" with K0 = 1, then grown.
    smelt / layer_loop:     n_passes is the loop count r: only config.n_passes and the plan change (the
                            function changes beyond the extra passes: updates in the span scale by 1/r).

    model.config is REPLACED by grown_config(...) (the caller's ModelConfig object is not mutated, so
    other models built from it stay valid): read model.config after growing, not a config held from
    before. Returns {name_after: name_before} for every parameter (see the module docstring)."""
    cfg, grown = model.config, grown_config(model.config, n_passes, untie)  # checks the request first
    old_names = [name for name, _ in model.named_parameters()]
    if grown.tie_core or grown.layout != "pcc":  # Loop-Grow / a longer loop: same weights, more passes
        _set_config(model, grown)
        return {name: name for name in old_names}

    # untied growth (Algorithm 1 lines 5-7): pass k of the grown model runs a copy of stored core k % K_src
    cfg = as_prelude_core_coda(cfg)
    P, C, D = cfg.n_prelude, cfg.n_core, cfg.n_coda
    blocks = list(model.blocks)
    k_src = 1 if cfg.tie_core else cfg.n_passes  # a tied model stores one core: every pass copies it
    source_index = list(range(P))  # source_index[i] = index of block i before growth
    source_index += [P + (k % k_src) * C + j for k in range(n_passes) for j in range(C)]
    source_index += [P + k_src * C + j for j in range(D)]
    seen = set()
    new_blocks = []
    for src in source_index:  # the first block claiming a source is the original, the rest are copies
        new_blocks.append(blocks[src] if src not in seen else _copy_block(blocks[src]))
        seen.add(src)
    model.blocks = nn.ModuleList(new_blocks)
    _set_config(model, grown)

    param_map = {}
    for name, _ in model.named_parameters():
        if name.startswith("blocks."):
            _, index, rest = name.split(".", 2)
            param_map[name] = f"blocks.{source_index[int(index)]}.{rest}"
        else:
            param_map[name] = name
    missing = set(param_map.values()) - set(old_names)
    assert not missing, f"internal error: parameter map points at unknown names {sorted(missing)}"
    return param_map


def _copy_block(block):
    """An independent copy of a block: same values, new tensors, no gradient."""
    new = copy.deepcopy(block)
    for p in new.parameters():
        p.grad = None
    return new


def _set_config(model, cfg):
    """model.config <- cfg (a new object: other models built from the old one stay valid), and its plan."""
    model.config = cfg
    model.plan = execution_plan(cfg)
    assert len(model.blocks) == cfg.n_blocks


def copied_names(param_map):
    """Names in a grow() map that are NEW copies (their source is claimed by an earlier name: the original)."""
    seen, copies = set(), []
    for name, source in param_map.items():
        if source in seen:
            copies.append(name)
        seen.add(source)
    return copies


def copy_optimizer_state(state_by_name, param_map, copies="fresh"):
    """Per-parameter optimizer state keyed by the names before growth -> keyed by the names after.

    Originals (also those renamed by the shifted coda) keep their own state. New copies get:
      "fresh" (default): no state; the optimizer initialises it at its next step (zero momentum, Adam
          step count 0 with bias correction). This is what the [X] code effectively does: it leaves the
          state of its dormant cores alone, and a dormant core has only ever seen zero gradients, so its
          momentum is zero. The copy sits at another depth and gets other gradients; the source's
          momentum would push it along the source's old direction for its first steps.
      "source": a deep copy of the source's state (the copy continues the source's trajectory).
    An empty param_map means the identity (tied growth)."""
    if copies not in ("fresh", "source"):
        raise ValueError(f"copies must be 'fresh' or 'source', got {copies!r}")
    if not param_map:
        return dict(state_by_name)
    copy_set = set(copied_names(param_map))
    out = {}
    for name, source in param_map.items():
        if source not in state_by_name:
            continue  # that parameter had no state yet (or is not handled by this optimizer)
        if name in copy_set:
            if copies == "source":
                out[name] = copy.deepcopy(state_by_name[source])
        else:
            out[name] = state_by_name[source]
    return out


def remap_optimizer_checkpoint(opt, param_map, copies="fresh"):
    """ckpt["optimizer"] (state keyed by parameter name) -> the same layout keyed by the new names.
    Accepts {"state": {name: {...}}, "param_groups": [{"params" or "param_names": [names], ...}]}
    (train.py's layout), or a dict / list of several such (one per optimizer). In param_groups every
    name is replaced by the names that take it as source (original first, then its copies), so the
    copies join their source's group. Raises ValueError on other layouts."""
    if isinstance(opt, list):
        return [remap_optimizer_checkpoint(o, param_map, copies) for o in opt]
    if not isinstance(opt, dict):
        raise ValueError(f"unrecognised optimizer state layout: {type(opt).__name__}")
    if "state" not in opt:
        if opt and all(isinstance(v, (dict, list)) for v in opt.values()):  # several optimizers by name
            return {k: remap_optimizer_checkpoint(v, param_map, copies) for k, v in opt.items()}
        raise ValueError(f"unrecognised optimizer state layout (keys {sorted(opt)[:8]}; expected 'state')")
    state = opt["state"]
    if state and not all(isinstance(k, str) for k in state):
        raise ValueError("optimizer state is keyed by parameter index, not by parameter name")
    out = dict(opt)
    out["state"] = copy_optimizer_state(state, param_map, copies)
    if "param_groups" in opt and param_map:
        targets = {}
        for name, source in param_map.items():
            targets.setdefault(source, []).append(name)
        groups = []
        for group in opt["param_groups"]:
            group = dict(group)
            for key in ("params", "param_names"):  # train.py keeps the names under "param_names"
                names = group.get(key)
                if isinstance(names, list) and all(isinstance(p, str) for p in names):
                    group[key] = [new for p in names for new in targets.get(p, [])]
            groups.append(group)
        out["param_groups"] = groups
    return out


# ----------------------------------------------------------------------------------------------------
# Training-schedule helpers (train.py uses these)


def growth_step(max_steps, grow_at):
    """Optimizer step at which to grow. grow_at >= 1: a step; 0 < grow_at < 1: the [X] code's crossover
    fraction of training, step = int(grow_at * max_steps); the fraction of tokens after growth is then
    rho = 1 - grow_at [X13]."""
    if grow_at <= 0:
        raise ValueError(f"grow_at must be > 0 (a step, or a fraction in (0, 1)), got {grow_at}")
    step = int(grow_at * max_steps) if grow_at < 1 else int(grow_at)
    if step > max_steps:
        raise ValueError(f"grow_at={grow_at} is after the last step max_steps={max_steps}")
    return step


def rewarm_multiplier(step, grow_at_step, rewarm_steps=40):
    """LR multiplier after growth: 0 at the growth step, linear back to 1 over rewarm_steps ([X] code:
    min(1, (it - crossover) / 40)). 1 before growth or with rewarm_steps=0."""
    if rewarm_steps <= 0 or step < grow_at_step:
        return 1.0
    return min(1.0, (step - grow_at_step) / rewarm_steps)


# ----------------------------------------------------------------------------------------------------
# Parameter counts the schedule math needs


def shapes_of_run(cfg, config, grown=False):
    """[(when, ModelConfig)]: the model as built and each larger shape a run's settings (config: grow_at,
    grow_to, grow_untie, n_passes_choices, decay_branch) give it, to plan memory before building anything.
    grown: the model has grown already (a resumed or forked grown checkpoint): it does not grow again."""
    shapes = [("", cfg)]
    if config.grow_at and not config.decay_branch and not grown:
        grown = grown_config(cfg, config.grow_to, config.grow_untie)
        shapes.append((f" after growing to {config.grow_to} passes", grown))
    most = max(config.n_passes_choices, default=0)
    if most > cfg.n_passes:
        shapes.append((f" at {most} passes (n_passes_choices)", replace(cfg, n_passes=most or cfg.n_passes)))
    return shapes


def compute_active_params(cfg, n_passes=None):
    """N_c,K [X8], [X10]: prelude, coda and head matrices once, core matrices K times (even when tied),
    no input-embedding lookup. Taken from match.py (the one place for params accounting)."""
    return match.accounting(replace(cfg, n_passes=n_passes or cfg.n_passes))["params_compute_active"]


def stored_params(cfg, n_passes=None):
    """N_s,K [X10]: every stored parameter, token embedding and lm head included. This is the N of the
    [X] code's steps = round(TPP * N / tokens_per_step): d8 Vanilla 205.8M at TPP 5 -> its 1962 steps,
    and [X13]-[X14] with this N reproduce the d8 Loop-Grow / Untied-Grow steps (tests/test_grow.py)."""
    return match.accounting(replace(cfg, n_passes=n_passes or cfg.n_passes))["params_stored"]


# ----------------------------------------------------------------------------------------------------
# Growth-schedule math [X8]-[X15]. K0 -> Kf defaults to the paper's 2 -> 4.

AFFINE_LAW = {"loop_grow": (0.902, 0.216), "untied_grow": (0.883, 0.103)}  # [X9] (a, b), R^2 > 0.9999


def mean_passes(rho, k0=2, kf=4):
    """[X13] token-weighted mean passes K_bar_rho = (1 - rho) K0 + rho Kf; rho = fraction of tokens after growth."""
    return (1 - rho) * k0 + rho * kf


def grown_compute_active_params(rho, n_c_k0, n_c_kf):
    """[X13] N_c,K_rho = (1 - rho) N_c,K0 + rho N_c,Kf: token-weighted compute-active parameters."""
    return (1 - rho) * n_c_k0 + rho * n_c_kf


def grown_training_flops(tokens, rho, n_c_k0, n_c_kf):
    """[X13] leading-order training compute C = 6 D_K_rho N_c,K_rho of a grown run of `tokens` tokens."""
    return 6 * tokens * grown_compute_active_params(rho, n_c_k0, n_c_kf)


def grown_tokens_for_budget(compute, rho, n_c_k0, n_c_kf):
    """[X13] solved for D: tokens a grown run affords at training compute C."""
    return compute / (6 * grown_compute_active_params(rho, n_c_k0, n_c_kf))


def tokens_per_param(tokens, n_stored):
    """[X10] TPP_K = D_K / N_s,K."""
    return tokens / n_stored


def expansion_ratio(cfg, n_passes):
    """[X10] E_K = N_c,K / N_c,1."""
    return compute_active_params(cfg, n_passes) / compute_active_params(cfg, 1)


def storage_ratio(cfg, n_passes):
    """[X10] S_K = N_s,K / N_s,1 (1 when the core is tied)."""
    return stored_params(cfg, n_passes) / stored_params(cfg, 1)


def tpp_at_passes(tpp_k1, e_k, s_k):
    """[X11] TPP_K = TPP_K1 / (E_K S_K): at equal compute, K passes cost E_K more per token and an untied
    model stores S_K more parameters. TPP_K1 = tokens K=1 affords / its stored params."""
    return tpp_k1 / (e_k * s_k)


def optimal_expansion(tpp_k1, tied=True):
    """[X8] empirical fit at the compute-optimal K: E_K* = 0.82 TPP_K1^0.15 (tied), 0.83 TPP_K1^0.15 (untied)."""
    return (0.82 if tied else 0.83) * tpp_k1 ** 0.15


def optimal_tpp(tpp_k1, tied=True):
    """[X12] empirical fit: TPP_K* = 1.19 TPP_K1^0.85 (tied), 1.34 TPP_K1^0.74 (untied)."""
    return 1.19 * tpp_k1 ** 0.85 if tied else 1.34 * tpp_k1 ** 0.74


def grown_expansion(rho, e_ratio):
    """[X14] E_K_rho / E_K0 = 1 + rho (E_Kf / E_K0 - 1); e_ratio = E_Kf / E_K0 (= N_c,Kf / N_c,K0)."""
    return 1 + rho * (e_ratio - 1)


def grown_tpp(tpp_k0, rho, e_ratio):
    """[X14] TPP_K_rho = (E_K0 / E_K_rho) TPP_K0 at the compute of a fixed-K0 run; both TPPs use the
    initial stored params N_s,K0 as denominator."""
    return tpp_k0 / grown_expansion(rho, e_ratio)


def optimal_grown_expansion(tpp_k0, a, b):
    """[X15] with the affine law [X9] TPP_K_rho* = a TPP_K0 + b: E_K_rho* / E_K0 = TPP_K0 / (a TPP_K0 + b)."""
    return tpp_k0 / (a * tpp_k0 + b)


def optimal_growth_fraction(tpp_k0, a, b, e_ratio):
    """[X15] rho* = (E_K_rho*/E_K0 - 1) / (E_Kf/E_K0 - 1): fraction of tokens trained after growth."""
    return (optimal_grown_expansion(tpp_k0, a, b) - 1) / (e_ratio - 1)


def grown_run_tokens(cfg, tpp_ref, rho, kf=4):
    """Tokens of a grown run, the [X] Table 9 recipe: the reference TPP t_ref sets the compute of a
    fixed-K0 run, C = 6 (t_ref N_s,K0) N_c,K0, and the grown run's tokens are recomputed for the chosen
    rho: D = C / (6 N_c,K_rho) [X13]-[X14]. cfg is the model before growth (K0 = cfg.n_passes).
    d8: Loop-Grow t_ref 7, rho 0.18 -> 2563 steps; Untied-Grow t_ref 8, rho 0.29 -> 3341 (524,288 tok/step)."""
    n_c_k0, n_c_kf = compute_active_params(cfg), compute_active_params(cfg, kf)
    compute = 6 * tpp_ref * stored_params(cfg) * n_c_k0
    return grown_tokens_for_budget(compute, rho, n_c_k0, n_c_kf)


def growth_fraction_limit(a):
    """[X15] limit b << a TPP and E_4/E_2 -> 3/2 (even thirds, block compute dominant): rho* -> 2 (1/a - 1).
    a = 0.902 (Loop-Grow) -> 0.217, a = 0.883 (Untied-Grow) -> 0.265."""
    return 2 * (1 / a - 1)


# ----------------------------------------------------------------------------------------------------
# CLI: grow a checkpoint


def grow_checkpoint(ckpt_path, n_passes, out_path, untie=False, copies="fresh", log=print):
    """Load a checkpoint, grow it, remap its optimizer state by name, write it atomically. Returns the
    parameter map. Everything else (step, tokens_seen, data_position, rng, ...) is kept, so train.py
    resumes from the grown checkpoint; a record is appended to ckpt["growth"]. Inside a run folder (in place,
    the usual case) its lock is held from the load to the write: a training there would overwrite it."""
    with rundir.run_folder_held(os.path.dirname(os.path.abspath(out_path)),
                                "write the grown checkpoint elsewhere with --out"):
        return _grow_checkpoint(ckpt_path, n_passes, out_path, untie, copies, log)


def _grow_checkpoint(ckpt_path, n_passes, out_path, untie, copies, log):
    model, ckpt = load_model(ckpt_path)
    layout, tied = model.config.layout, model.config.tie_core
    k0 = model.config.n_passes
    param_map = grow(model, n_passes, untie=untie)
    opt = ckpt.get("optimizer")
    if opt is None:
        log("no optimizer state in the checkpoint: nothing to remap (the optimizer starts fresh on resume)")
    else:
        try:
            ckpt["optimizer"] = remap_optimizer_checkpoint(opt, param_map, copies)
        except ValueError as e:
            log(f"dropping optimizer state ({e}); the optimizer starts fresh on resume")
            ckpt["optimizer"] = None
    ckpt["model_config"] = checkpoint.plain_config(model.config)
    ckpt["model"] = model.state_dict()
    if "state" in ckpt:  # train.py's flag: a resumed run with grow_at set does not grow a second time
        ckpt["state"]["grown"] = True
    ckpt.setdefault("growth", []).append(dict(step=ckpt.get("state", {}).get("step"), from_passes=k0,
                                              to_passes=n_passes, from_layout=layout, from_tied=tied, untie=untie,
                                              copies=copies, param_map=param_map))
    checkpoint.save_file(out_path, ckpt)
    n_copies = len(copied_names(param_map))
    log(f"grew {ckpt_path}: {layout} {'tied' if tied else 'untied'} K={k0} -> "
        f"{'tied' if model.config.tie_core else 'untied'} K={n_passes}, {len(model.blocks)} stored blocks, "
        f"{n_copies} copied parameter tensors ({copies} optimizer state) -> {out_path}")
    return param_map


def schedule_table(cfg, kf=4, law=None, tpps=(5, 6, 7, 8, 10, 20), tokens_per_step=524288):
    """The growth schedule of a config (K0 = cfg.n_passes -> kf) as printable lines: parameter counts
    [X10], the expansion ratio, and per reference TPP: rho* [X15], mean passes [X13], the grown run's
    TPP [X14], tokens and steps (the Table 9 recipe, grown_run_tokens)."""
    if cfg.layout != "pcc":
        raise ValueError(f"layout {cfg.layout!r}: the growth schedule is [X]'s, for prelude-core-coda models "
                         "(layout 'pcc')")
    law = law or ("loop_grow" if cfg.tie_core else "untied_grow")
    a, b = AFFINE_LAW[law]
    k0 = cfg.n_passes
    if kf <= k0:
        raise ValueError(f"--passes {kf}: growth goes to more than the config's K0={k0} core passes")
    n_s, n_c0, n_cf = stored_params(cfg), compute_active_params(cfg), compute_active_params(cfg, kf)
    e_ratio = n_cf / n_c0
    lines = [f"{cfg.layout} {'tied' if cfg.tie_core else 'untied'} K0={k0} -> Kf={kf}, "
             f"{cfg.n_prelude}/{cfg.n_core}/{cfg.n_coda} blocks, width {cfg.n_embd}",
             f"N_s,K0 stored params (token embedding included) [X10]: {n_s:,}",
             f"N_c,K0 / N_c,Kf compute-active params [X10]:       {n_c0:,} / {n_cf:,}  (E_Kf/E_K0 = {e_ratio:.4f})",
             f"[X9] affine law {law}: a = {a}, b = {b};  rho* limit 2(1/a - 1) = {growth_fraction_limit(a):.4f}",
             f"{'TPP_K0':>7} {'rho*':>7} {'K_bar':>6} {'TPP_Krho':>9} {'tokens':>15} {'steps':>8}"]
    for tpp in tpps:
        rho = optimal_growth_fraction(tpp, a, b, e_ratio)
        tokens = grown_run_tokens(cfg, tpp, rho, kf)
        lines.append(f"{tpp:>7g} {rho:>7.4f} {mean_passes(rho, k0, kf):>6.3f} {grown_tpp(tpp, rho, e_ratio):>9.3f} "
                     f"{tokens:>15,.0f} {tokens / tokens_per_step:>8.0f}")
    return lines


def main(argv=None):
    parser = common.parser(
        "grow.py", description="Grow a loopstudy checkpoint to more core passes ([X] Algorithm 1), or print the growth "
                    "schedule of a config ([X9]-[X15]).")
    parser.add_argument("--ckpt", help="input checkpoint (train.py / grow.py) (default: none, needs --schedule)")
    parser.add_argument("--passes", type=common.number(int, 1, MAX_PASSES, why=PASSES_WHY), default=4,
                        help=f"target number of core passes Kf, at most {MAX_PASSES} (default: %(default)s)")
    parser.add_argument("--untie", action="store_true",
                        help="untie a tied core into K copies first (then grow) (default: keep it tied)")
    parser.add_argument("--copies", choices=("fresh", "source"), default="fresh",
                        help="optimizer state of new copies: fresh (as the [X] code) or the source's "
                             "(default: %(default)s)")
    parser.add_argument("--out", help="output checkpoint, written atomically, holding its run folder's lock "
                                      "(default: grow --ckpt in place, so `train.py --run_name=NAME "
                                      "--init_from=resume` continues it)")
    parser.add_argument("--schedule", metavar="CONFIG",
                        help="print the growth schedule of a config file instead (default: grow --ckpt)")
    parser.add_argument("--law", choices=sorted(AFFINE_LAW), help="affine law [X9] (default: by tie_core)")
    args = parser.parse_args(argv)
    try:
        if args.schedule:
            print("\n".join(schedule_table(match_cli.read_config(args.schedule)[0], args.passes, args.law)))
            return 0
        if not args.ckpt:
            parser.error("--ckpt is required (or --schedule CONFIG)")
        if args.out and os.path.isdir(args.out):
            raise ValueError(f"--out {args.out} is a directory; give the checkpoint file to write, e.g. "
                             f"{os.path.join(args.out, 'ckpt.pt')}")
        grow_checkpoint(args.ckpt, args.passes, args.out or args.ckpt, untie=args.untie, copies=args.copies)
    except (ValueError, OSError) as e:
        return cli_error("grow.py", e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
