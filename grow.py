"""
Model growth, mid-training or on a checkpoint, and the growth-schedule maths
([X] Algorithm 1, [X8]-[X15]).

  Loop-Grow (pcc):           more passes of the same core, no new weights.
  Untied-Grow (pcc_untied):  the cores are copied after themselves, C1 C2 ->
                             C1 C2 C1 C2 (depthwise stacking, Du et al. 2024).
  Deep-Vanilla-Grow (plain): read as pcc_untied with K0 = 1, then copied.
  SMELT, layer-loop:         only the loop count r changes.

    python grow.py --ckpt out/demo/ckpt.pt --passes 4 --untie  # in place
    python train.py --out_dir=out/demo --init_from=resume --max_steps=120  # goes on
    python grow.py --schedule config/x_d8_loop_grow.py  # rho*, [X] Table 9

train.py --grow_at grows a run mid-way to twice its passes; grow.py grows a
checkpoint to any number. The schedule gives the [X] code's d8 step counts
(Loop-Grow 2563, Untied-Grow 3341) and rho* limits 0.217 / 0.265.
"""

import argparse
import copy
import os

import torch
import torch.nn as nn

import configurator
import match
from model import ModelConfig, core_split, execution_plan, load_checkpoint

# -----------------------------------------------------------------------------
# Growth of a live model


def grown_config(cfg, n_passes, untie=False):
    """The ModelConfig grow(model, n_passes, untie) leaves behind."""
    if n_passes <= cfg.n_passes and not untie or n_passes < cfg.n_passes:
        raise ValueError(f"cannot grow {cfg.n_passes} passes to {n_passes}")
    # NOTE: SMELT's [S8]-[S9] 1/r update scale changes with r.
    if cfg.layout in ("smelt", "layer_loop"):
        return cfg.replace(n_passes=n_passes)
    # A Deep Vanilla is untied cores without a boundary operator.
    if cfg.layout == "plain":
        cfg = cfg.replace(layout="pcc_untied", n_passes=1, boundary="none")
    layout = "pcc_untied" if untie else cfg.layout
    return cfg.replace(layout=layout, n_passes=n_passes)


def grow(model, n_passes, untie=False):
    """Grow an unwrapped GPT in place to n_passes (untie: a tied core first
    becomes untied copies). Returns {name after: name before}."""
    cfg, grown = model.config, grown_config(model.config, n_passes, untie)
    names = [name for name, _ in model.named_parameters()]
    # More passes of the same weights: only the plan changes.
    if grown.tie_core or cfg.layout in ("smelt", "layer_loop"):
        model.config, model.plan = grown, execution_plan(grown)
        return {name: name for name in names}

    # Untied growth (Algorithm 1, lines 5-7): pass k runs a copy of stored
    # core k % k_src; a tied or plain model stores one.
    P, C, D = core_split(cfg.n_layer)
    k_src = cfg.n_passes if not cfg.tie_core else 1
    core = [P + (k % k_src) * C + j for k in range(n_passes) for j in range(C)]
    source = list(range(P)) + core + [P + k_src * C + j for j in range(D)]
    blocks, seen, new_blocks = list(model.blocks), set(), []
    for i in source:
        # The first block to claim a source is the original.
        if i in seen:
            new_blocks.append(copy.deepcopy(blocks[i]))
            # A copy starts without a gradient.
            for p in new_blocks[-1].parameters():
                p.grad = None
        else:
            new_blocks.append(blocks[i])
        seen.add(i)
    model.blocks = nn.ModuleList(new_blocks)
    model.config, model.plan = grown, execution_plan(grown)

    # Inserted cores shift the coda: with P=2, C=3 and K 2 -> 4 untied, the
    # coda's blocks.8 becomes blocks.14, and the new blocks.8 copies blocks.2.
    def before(name):
        if not name.startswith("blocks."):
            return name
        _, index, rest = name.split(".", 2)
        return f"blocks.{source[int(index)]}.{rest}"

    return {name: before(name) for name, _ in model.named_parameters()}


def copied_names(param_map):
    """The names in a grow() map that are new copies."""
    seen, copies = set(), []
    for name, source in param_map.items():
        if source in seen:
            copies.append(name)
        seen.add(source)
    return copies


def copy_optimizer_state(state_by_name, param_map, copies="fresh"):
    """Optimizer state keyed by the names before growth -> by the names after."""
    # Originals keep theirs. Copies start fresh, as in the [X] code (a dormant
    # core has seen only zero gradients, so zero momentum), or with
    # copies="source" continue their source's.
    copy_set = set(copied_names(param_map))
    return {
        name: copy.deepcopy(state_by_name[source])
        if name in copy_set
        else state_by_name[source]
        for name, source in param_map.items()
        if source in state_by_name and (name not in copy_set or copies == "source")
    }


def growth_step(max_steps, grow_at):
    """The step to grow at: grow_at itself (>= 1), or the [X] code's fraction
    of max_steps (< 1), leaving rho = 1 - grow_at of the tokens [X13]."""
    step = int(grow_at * max_steps) if grow_at < 1 else int(grow_at)
    if not 0 < step <= max_steps:
        raise ValueError(f"grow_at={grow_at} is not a step in (0, max_steps={max_steps}]")
    return step


# -----------------------------------------------------------------------------
# Parameter counts [X10] and the growth-schedule maths [X8]-[X15].
# K0 -> Kf is the paper's 2 -> 4; rho is the share of tokens after growth.

# [X9]: the affine law's (a, b), each fit with R^2 > 0.9999.
AFFINE_LAW = {"loop_grow": (0.902, 0.216), "untied_grow": (0.883, 0.103)}


def compute_active_params(cfg, n_passes=None):
    """N_c,K [X10]: prelude, coda and head matrices once, core ones K times."""
    cfg = cfg.replace(n_passes=n_passes or cfg.n_passes)
    return match.accounting(cfg)["params_compute_active"]


def stored_params(cfg, n_passes=None):
    """N_s,K [X10]: every stored parameter, embedding and lm head included."""
    # The [X] code's N in steps = round(TPP N / tokens_per_step).
    cfg = cfg.replace(n_passes=n_passes or cfg.n_passes)
    return match.accounting(cfg)["params_stored"]


# [X13]: the token-weighted mean passes K_rho, its N_c,K_rho, the training
# FLOPs C = 6 D N_c,K_rho, and C solved for the tokens D.
def mean_passes(rho, k0=2, kf=4):
    return (1 - rho) * k0 + rho * kf


def grown_compute_active_params(rho, n_c_k0, n_c_kf):
    return (1 - rho) * n_c_k0 + rho * n_c_kf


def grown_training_flops(tokens, rho, n_c_k0, n_c_kf):
    return 6 * tokens * grown_compute_active_params(rho, n_c_k0, n_c_kf)


def grown_tokens_for_budget(compute, rho, n_c_k0, n_c_kf):
    return compute / (6 * grown_compute_active_params(rho, n_c_k0, n_c_kf))


# [X10]: tokens per stored parameter TPP_K = D_K / N_s,K, the expansion E_K
# and the storage ratio S_K (1 when tied).
def tokens_per_param(tokens, n_stored):
    return tokens / n_stored


def expansion_ratio(cfg, n_passes):
    return compute_active_params(cfg, n_passes) / compute_active_params(cfg, 1)


def storage_ratio(cfg, n_passes):
    return stored_params(cfg, n_passes) / stored_params(cfg, 1)


# [X11]: TPP_K = TPP_K1 / (E_K S_K).
def tpp_at_passes(tpp_k1, e_k, s_k):
    return tpp_k1 / (e_k * s_k)


# [X8] and [X12]: the fitted optimal expansion E_K* and TPP_K*.
def optimal_expansion(tpp_k1, tied=True):
    return (0.82 if tied else 0.83) * tpp_k1**0.15


def optimal_tpp(tpp_k1, tied=True):
    return 1.19 * tpp_k1**0.85 if tied else 1.34 * tpp_k1**0.74


# [X14]: E_K_rho / E_K0 with e_ratio = E_Kf / E_K0, and TPP_K_rho at the
# compute of a fixed-K0 run.
def grown_expansion(rho, e_ratio):
    return 1 + rho * (e_ratio - 1)


def grown_tpp(tpp_k0, rho, e_ratio):
    return tpp_k0 / grown_expansion(rho, e_ratio)


# [X15]: with the affine law [X9] TPP_K_rho* = a TPP_K0 + b, the optimal
# expansion and growth fraction rho*. rho* tends to 2 (1/a - 1) when
# b << a TPP and E_4 / E_2 -> 3/2.
def optimal_grown_expansion(tpp_k0, a, b):
    return tpp_k0 / (a * tpp_k0 + b)


def optimal_growth_fraction(tpp_k0, a, b, e_ratio):
    return (optimal_grown_expansion(tpp_k0, a, b) - 1) / (e_ratio - 1)


def growth_fraction_limit(a):
    return 2 * (1 / a - 1)


def grown_run_tokens(cfg, tpp_ref, rho, kf=4):
    """[X] Table 9: the tokens a grown run affords at a fixed-K0 run's compute
    C = 6 (tpp_ref N_s,K0) N_c,K0 [X13]-[X14]."""
    n_c_k0, n_c_kf = compute_active_params(cfg), compute_active_params(cfg, kf)
    compute = 6 * tpp_ref * stored_params(cfg) * n_c_k0
    return grown_tokens_for_budget(compute, rho, n_c_k0, n_c_kf)


def schedule_table(cfg, kf=4, law=None, tpps=(5, 6, 7, 8, 10, 20), tokens_per_step=524288):
    """A config's growth schedule K0 -> kf: the [X10] counts, then per
    reference TPP rho* [X15], K_rho [X13], TPP_K_rho [X14], tokens and steps."""
    if not cfg.layout.startswith("pcc") or kf <= cfg.n_passes:
        raise ValueError(
            "the growth schedule is [X]'s: a pcc or pcc_untied config grown to more passes"
        )
    a, b = AFFINE_LAW[law or ("loop_grow" if cfg.tie_core else "untied_grow")]
    n_s = stored_params(cfg)
    n_c0, n_cf = compute_active_params(cfg), compute_active_params(cfg, kf)
    P, C, D = core_split(cfg.n_layer)
    lines = [
        f"{cfg.layout} K0={cfg.n_passes} -> Kf={kf}, {P}/{C}/{D} blocks, width {cfg.n_embd}",
        f"N_s,K0 stored params [X10]: {n_s:,};  N_c,K0 / N_c,Kf compute-active: "
        f"{n_c0:,} / {n_cf:,} (E_Kf/E_K0 = {n_cf / n_c0:.4f})",
        f"[X9] affine law: a = {a}, b = {b};  "
        f"rho* limit 2(1/a - 1) = {growth_fraction_limit(a):.4f}",
        f"{'TPP_K0':>7} {'rho*':>7} {'K_bar':>6} {'TPP_Krho':>9} {'tokens':>15} {'steps':>8}",
    ]
    for tpp in tpps:
        rho = optimal_growth_fraction(tpp, a, b, n_cf / n_c0)
        tokens = grown_run_tokens(cfg, tpp, rho, kf)
        lines.append(
            f"{tpp:>7g} {rho:>7.4f} {mean_passes(rho, cfg.n_passes, kf):>6.3f} "
            f"{grown_tpp(tpp, rho, n_cf / n_c0):>9.3f} {tokens:>15,.0f} "
            f"{tokens / tokens_per_step:>8.0f}"
        )
    return lines


# -----------------------------------------------------------------------------
# A checkpoint, grown


def grow_checkpoint(ckpt_path, n_passes, out_path, untie=False, copies="fresh"):
    """Grow a train.py checkpoint for train.py to resume."""
    # The optimizer state follows the parameters by name.
    model, ckpt = load_checkpoint(ckpt_path)
    param_map = grow(model, n_passes, untie)
    if ckpt.get("optimizers"):
        opt, targets = ckpt["optimizers"], {}
        for name, source in param_map.items():
            targets.setdefault(source, []).append(name)
        opt["state"] = copy_optimizer_state(opt["state"], param_map, copies)
        # The copies join their source's parameter group.
        for group in opt["param_groups"]:
            for key in ("params", "param_names"):
                group[key] = [
                    new for name in group.get(key, []) for new in targets.get(name, [])
                ]
    ckpt.update(model=model.state_dict(), model_config=model.config.to_dict())
    ckpt.get("config", {}).update(n_passes=model.config.n_passes, layout=model.config.layout)
    # A resumed run must not grow again.
    ckpt.get("state", {}).update(grown=True)
    torch.save(ckpt, out_path + ".tmp")
    os.replace(out_path + ".tmp", out_path)
    print(
        f"grew {ckpt_path} to {model.config.layout} K={n_passes}: "
        f"{len(model.blocks)} stored blocks, {len(copied_names(param_map))} copied "
        f"tensors ({copies} optimizer state) -> {out_path}"
    )
    return param_map


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="grow.py",
        usage=argparse.SUPPRESS,
        description="Grow a checkpoint to more passes ([X] Algorithm 1), "
        "or print a config's growth schedule.",
    )
    arg = parser.add_argument
    arg("--ckpt", help="the checkpoint to grow")
    arg("--passes", type=int, default=4, help="passes after growth (default: %(default)s)")
    arg("--untie", action="store_true", help="untie a tied core into copies first")
    arg(
        "--copies",
        choices=("fresh", "source"),
        default="fresh",
        help="optimizer state of the copies (default: %(default)s, as the [X] code)",
    )
    arg("--out", help="where to write it (default: --ckpt, in place)")
    arg("--schedule", metavar="CONFIG", help="print the growth schedule of a config file")
    arg("--law", choices=sorted(AFFINE_LAW), help="the [X9] law (default: by the layout)")
    args = parser.parse_args(argv)
    try:
        if args.schedule:
            given = configurator.read_config(args.schedule)
            fields = ModelConfig.__dataclass_fields__
            model_keys = {k: v for k, v in given.items() if k in fields}
            # [X] uses GPT-2's vocabulary, padded.
            cfg = ModelConfig(**{"vocab_size": 50304, **model_keys})
            print("\n".join(schedule_table(cfg, args.passes, args.law)))
        elif args.ckpt:
            out = args.out or args.ckpt
            grow_checkpoint(args.ckpt, args.passes, out, args.untie, args.copies)
        else:
            parser.error("give --ckpt (or --schedule CONFIG)")
    except (ValueError, OSError) as e:
        parser.error(str(e))


if __name__ == "__main__":
    main()
