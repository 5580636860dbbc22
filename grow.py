"""
Model growth, mid-training or on a checkpoint, and the growth-schedule math ([X] Algorithm 1, [X8]-[X15]).

  Loop-Grow (layout pcc):          K0 -> Kf passes of the same core: no new weights.
  Untied-Grow (layout pcc_untied): cores C1..CK0 copied after themselves, C1 C2 -> C1 C2 C1 C2 (depthwise
                                   stacking, Du et al. 2024); new core j copies core j % K0 ([X] code).
  Deep-Vanilla-Grow (plain):       read as pcc_untied with K0 = 1 and no boundary operator (the same
                                   function and parameter names), then grown by copying.
  SMELT loop / layer-loop:         only the loop count r changes (and with it the 1/r update scale).

    python grow.py --ckpt out/demo/ckpt.pt --passes 4 [--untie] [--out grown.pt]
    python grow.py --schedule config/x_d8_loop_grow.py     # rho*, tokens and steps of [X] Table 9

grow() returns {name after: name before} for every parameter: inserting cores shifts the coda's block
indices (P=2, C=3, K 2 -> 4 untied: blocks.8, the first coda block, becomes blocks.14, and the new blocks.8
copies blocks.2). Originals come first; later names claiming the same source are the copies.
"""

import argparse
import copy
import os
from dataclasses import replace

import torch
import torch.nn as nn

import configurator
import match
from model import ModelConfig, core_split, execution_plan, load_checkpoint

# ----------------------------------------------------------------------------------------------------
# Growth of a live model


def grown_config(cfg, n_passes, untie=False):
    """The ModelConfig grow(model, n_passes, untie) leaves: a run plans the grown model with it."""
    if n_passes <= cfg.n_passes and not untie or n_passes < cfg.n_passes:
        raise ValueError(f"cannot grow {cfg.n_passes} passes to {n_passes}")
    if cfg.layout in ("smelt", "layer_loop"):  # NOTE: the [S8]-[S9] 1/r update scale changes with r
        return replace(cfg, n_passes=n_passes)
    if cfg.layout == "plain":  # a Deep Vanilla: untied cores, no boundary operator
        cfg = replace(cfg, layout="pcc_untied", n_passes=1, boundary="none")
    return replace(cfg, layout="pcc_untied" if untie else cfg.layout, n_passes=n_passes)


def grow(model, n_passes, untie=False):
    """Grow an unwrapped GPT in place to n_passes; untie: a tied core first becomes K0 untied copies.
    Returns {name after: name before} for every parameter (the identity when only K changes)."""
    cfg, grown = model.config, grown_config(model.config, n_passes, untie)
    names = [name for name, _ in model.named_parameters()]
    if grown.tie_core or cfg.layout in ("smelt", "layer_loop"):  # more passes of the same weights
        model.config, model.plan = grown, execution_plan(grown)
        return {name: name for name in names}
    # untied growth (Algorithm 1 lines 5-7): pass k runs a copy of stored core k % K_src
    P, C, D = core_split(cfg.n_layer)
    k_src = cfg.n_passes if not cfg.tie_core else 1  # a tied model (or a plain one) stores one core
    source = list(range(P)) + [P + (k % k_src) * C + j for k in range(n_passes) for j in range(C)]
    source += [P + k_src * C + j for j in range(D)]
    blocks, seen, new_blocks = list(model.blocks), set(), []
    for i in source:  # the first block claiming a source is the original, the rest are copies
        new_blocks.append(blocks[i] if i not in seen else copy.deepcopy(blocks[i]))
        for p in new_blocks[-1].parameters() if i in seen else ():
            p.grad = None  # a copy: same values, new tensors, no gradient yet
        seen.add(i)
    model.blocks = nn.ModuleList(new_blocks)
    model.config, model.plan = grown, execution_plan(grown)
    return {name: (f"blocks.{source[int(name.split('.')[1])]}.{name.split('.', 2)[2]}"
                   if name.startswith("blocks.") else name) for name, _ in model.named_parameters()}


def copied_names(param_map):
    """The names in a grow() map that are new copies."""
    seen, copies = set(), []
    for name, source in param_map.items():
        if source in seen:
            copies.append(name)
        seen.add(source)
    return copies


def copy_optimizer_state(state_by_name, param_map, copies="fresh"):
    """Optimizer state keyed by the names before growth -> by the names after. Originals keep theirs;
    copies start fresh (the [X] code: a dormant core has seen only zero gradients, so zero momentum)
    or, with copies="source", continue their source's."""
    copy_set = set(copied_names(param_map))
    return {name: copy.deepcopy(state_by_name[source]) if name in copy_set else state_by_name[source]
            for name, source in param_map.items()
            if source in state_by_name and (name not in copy_set or copies == "source")}


def growth_step(max_steps, grow_at):
    """The step to grow at: grow_at itself (>= 1), or the [X] code's crossover fraction of max_steps (< 1;
    the fraction of tokens after growth is then rho = 1 - grow_at [X13])."""
    step = int(grow_at * max_steps) if grow_at < 1 else int(grow_at)
    if not 0 < step <= max_steps:
        raise ValueError(f"grow_at={grow_at} is not a step in (0, max_steps={max_steps}]")
    return step


# ----------------------------------------------------------------------------------------------------
# Parameter counts [X10] and the growth-schedule math [X8]-[X15]; K0 -> Kf is the paper's 2 -> 4

AFFINE_LAW = {"loop_grow": (0.902, 0.216), "untied_grow": (0.883, 0.103)}  # [X9] (a, b), R^2 > 0.9999


def compute_active_params(cfg, n_passes=None):
    """N_c,K [X10]: prelude, coda and head matrices once, core matrices K times (even when tied)."""
    return match.accounting(replace(cfg, n_passes=n_passes or cfg.n_passes))["params_compute_active"]


def stored_params(cfg, n_passes=None):
    """N_s,K [X10]: every stored parameter, embedding and lm head included (the [X] code's N of
    steps = round(TPP N / tokens_per_step))."""
    return match.accounting(replace(cfg, n_passes=n_passes or cfg.n_passes))["params_stored"]


def mean_passes(rho, k0=2, kf=4):
    return (1 - rho) * k0 + rho * kf  # [X13] token-weighted K_bar_rho; rho: the tokens after growth


def grown_compute_active_params(rho, n_c_k0, n_c_kf):
    return (1 - rho) * n_c_k0 + rho * n_c_kf  # [X13] N_c,K_rho


def grown_training_flops(tokens, rho, n_c_k0, n_c_kf):
    return 6 * tokens * grown_compute_active_params(rho, n_c_k0, n_c_kf)  # [X13] C = 6 D N_c,K_rho


def grown_tokens_for_budget(compute, rho, n_c_k0, n_c_kf):
    return compute / (6 * grown_compute_active_params(rho, n_c_k0, n_c_kf))  # [X13] solved for D


def tokens_per_param(tokens, n_stored):
    return tokens / n_stored  # [X10] TPP_K = D_K / N_s,K


def expansion_ratio(cfg, n_passes):
    return compute_active_params(cfg, n_passes) / compute_active_params(cfg, 1)  # [X10] E_K


def storage_ratio(cfg, n_passes):
    return stored_params(cfg, n_passes) / stored_params(cfg, 1)  # [X10] S_K (1 when tied)


def tpp_at_passes(tpp_k1, e_k, s_k):
    return tpp_k1 / (e_k * s_k)  # [X11] TPP_K = TPP_K1 / (E_K S_K)


def optimal_expansion(tpp_k1, tied=True):
    return (0.82 if tied else 0.83) * tpp_k1 ** 0.15  # [X8] E_K* fitted


def optimal_tpp(tpp_k1, tied=True):
    return 1.19 * tpp_k1 ** 0.85 if tied else 1.34 * tpp_k1 ** 0.74  # [X12] TPP_K* fitted


def grown_expansion(rho, e_ratio):
    return 1 + rho * (e_ratio - 1)  # [X14] E_K_rho / E_K0, e_ratio = E_Kf / E_K0


def grown_tpp(tpp_k0, rho, e_ratio):
    return tpp_k0 / grown_expansion(rho, e_ratio)  # [X14] TPP_K_rho at a fixed-K0 run's compute


def optimal_grown_expansion(tpp_k0, a, b):
    return tpp_k0 / (a * tpp_k0 + b)  # [X15] with the affine law [X9] TPP_K_rho* = a TPP_K0 + b


def optimal_growth_fraction(tpp_k0, a, b, e_ratio):
    return (optimal_grown_expansion(tpp_k0, a, b) - 1) / (e_ratio - 1)  # [X15] rho*


def growth_fraction_limit(a):
    return 2 * (1 / a - 1)  # [X15] rho* -> 2 (1/a - 1) when b << a TPP and E_4/E_2 -> 3/2


def grown_run_tokens(cfg, tpp_ref, rho, kf=4):
    """[X] Table 9: t_ref sets a fixed-K0 run's compute C = 6 (t_ref N_s,K0) N_c,K0; the grown run
    affords D = C / (6 N_c,K_rho) [X13]-[X14] (d8 Loop-Grow t_ref 7, rho 0.18 -> 2,563 steps)."""
    n_c_k0, n_c_kf = compute_active_params(cfg), compute_active_params(cfg, kf)
    return grown_tokens_for_budget(6 * tpp_ref * stored_params(cfg) * n_c_k0, rho, n_c_k0, n_c_kf)


def schedule_table(cfg, kf=4, law=None, tpps=(5, 6, 7, 8, 10, 20), tokens_per_step=524288):
    """A config's growth schedule K0 -> kf: [X10] counts, then per reference TPP rho* [X15], the mean
    passes [X13], the grown TPP [X14], tokens and steps."""
    if not cfg.layout.startswith("pcc") or kf <= cfg.n_passes:
        raise ValueError("the growth schedule is [X]'s: a pcc or pcc_untied config grown to more passes")
    a, b = AFFINE_LAW[law or ("loop_grow" if cfg.tie_core else "untied_grow")]
    n_s, n_c0, n_cf = stored_params(cfg), compute_active_params(cfg), compute_active_params(cfg, kf)
    P, C, D = core_split(cfg.n_layer)
    lines = [f"{cfg.layout} K0={cfg.n_passes} -> Kf={kf}, {P}/{C}/{D} blocks, width {cfg.n_embd}",
             f"N_s,K0 stored params [X10]: {n_s:,};  N_c,K0 / N_c,Kf compute-active: {n_c0:,} / {n_cf:,} "
             f"(E_Kf/E_K0 = {n_cf / n_c0:.4f})",
             f"[X9] affine law: a = {a}, b = {b};  rho* limit 2(1/a - 1) = {growth_fraction_limit(a):.4f}",
             f"{'TPP_K0':>7} {'rho*':>7} {'K_bar':>6} {'TPP_Krho':>9} {'tokens':>15} {'steps':>8}"]
    for tpp in tpps:
        rho = optimal_growth_fraction(tpp, a, b, n_cf / n_c0)
        tokens = grown_run_tokens(cfg, tpp, rho, kf)
        lines.append(f"{tpp:>7g} {rho:>7.4f} {mean_passes(rho, cfg.n_passes, kf):>6.3f} "
                     f"{grown_tpp(tpp, rho, n_cf / n_c0):>9.3f} {tokens:>15,.0f} "
                     f"{tokens / tokens_per_step:>8.0f}")
    return lines


# ----------------------------------------------------------------------------------------------------
# A checkpoint, grown


def grow_checkpoint(ckpt_path, n_passes, out_path, untie=False, copies="fresh"):
    """Grow a train.py checkpoint; its optimizer state follows by name; train.py resumes it."""
    model, ckpt = load_checkpoint(ckpt_path)
    param_map = grow(model, n_passes, untie)
    if ckpt.get("optimizers"):
        opt, targets = ckpt["optimizers"], {}
        for name, source in param_map.items():
            targets.setdefault(source, []).append(name)
        opt["state"] = copy_optimizer_state(opt["state"], param_map, copies)
        for group in opt["param_groups"]:  # the copies join their source's group
            for key in ("params", "param_names"):
                group[key] = [new for name in group.get(key, []) for new in targets.get(name, [])]
    ckpt.update(model=model.state_dict(), model_config=model.config.to_dict())
    ckpt.get("config", {}).update(n_passes=model.config.n_passes, layout=model.config.layout)
    ckpt.get("state", {}).update(grown=True)  # a resumed run does not grow again
    torch.save(ckpt, out_path + ".tmp")
    os.replace(out_path + ".tmp", out_path)
    print(f"grew {ckpt_path} to {model.config.layout} K={n_passes}: {len(model.blocks)} stored blocks, "
          f"{len(copied_names(param_map))} copied tensors ({copies} optimizer state) -> {out_path}")
    return param_map


def main(argv=None):
    parser = argparse.ArgumentParser(prog="grow.py", usage=argparse.SUPPRESS, description="Grow a checkpoint "
                                     "to more passes ([X] Algorithm 1), or print a config's growth schedule.")
    parser.add_argument("--ckpt", help="the checkpoint to grow")
    parser.add_argument("--passes", type=int, default=4, help="passes after growth (default: %(default)s)")
    parser.add_argument("--untie", action="store_true", help="untie a tied core into copies first")
    parser.add_argument("--copies", choices=("fresh", "source"), default="fresh",
                        help="optimizer state of the copies (default: %(default)s, as the [X] code)")
    parser.add_argument("--out", help="where to write it (default: --ckpt, in place)")
    parser.add_argument("--schedule", metavar="CONFIG", help="print the growth schedule of a config file")
    parser.add_argument("--law", choices=sorted(AFFINE_LAW), help="the [X9] law (default: by the layout)")
    args = parser.parse_args(argv)
    try:
        if args.schedule:
            given = configurator.read_config(args.schedule)
            model_keys = {k: v for k, v in given.items() if k in ModelConfig.__dataclass_fields__}
            cfg = ModelConfig(**{"vocab_size": 50304, **model_keys})  # [X]: GPT-2's vocabulary, padded
            print("\n".join(schedule_table(cfg, args.passes, args.law)))
        elif args.ckpt:
            grow_checkpoint(args.ckpt, args.passes, args.out or args.ckpt, args.untie, args.copies)
        else:
            parser.error("give --ckpt (or --schedule CONFIG)")
    except (ValueError, OSError) as e:
        parser.error(str(e))


if __name__ == "__main__":
    main()
