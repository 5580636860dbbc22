"""Checkpoints of the release before settings were folded (docs/training.md, "Settings that went"): their
model config read in this release's fields, or refused in one line where this release cannot build the
same model. Nothing else changed in their files, so they load, resume and fork as they are."""
from model import BALANCE_LOSS_COEF, NORM_EPS, Z_LOSS_COEF, core_split

# the settings that went, and what to use instead (train.py's --help says so for a command that gives one)
WENT = dict(n_loops="n_passes is the loop count of every layout", n_prelude="the split is model.core_split",
            n_core="the split is model.core_split", n_coda="the split is model.core_split",
            grad_accum="global_batch sets the step; the micro-batches follow",
            adamw_matrix_lr="matrix_lr is either optimizer's", embedding_weight_decay="weight_decay covers it",
            unembedding_weight_decay="weight_decay covers it", cpu_threads="set OMP_NUM_THREADS",
            max_tokens="give max_steps", min_lr_fraction="the LR decays to 0",
            lr_anchor_params="[X16] is the ladders' (ladders.common.carried_lrs)",
            lr_scaling_beta="[X16] is the ladders' (ladders.common.carried_lrs)",
            router_lr="train.ROUTER_LR", scalar_lr="train.SCALAR_LR", muon_momentum="train.MUON_MOMENTUM",
            muon_nesterov="always on", muon_ns_steps="5, muon.py", muon_beta2="0.95, muon.py",
            rope_base="model.py's 10000", norm_eps="model.NORM_EPS", router_renormalize="always on",
            balance_loss_coef="model.BALANCE_LOSS_COEF", z_loss_coef="model.Z_LOSS_COEF",
            inject_before_coda="always on, as the [X] code", resume="init_from=resume continues the run",
            muon_variant="optimizer='muon_x' is the [X] code's Muon", attention="FlexAttention on CUDA, SDPA "
            "elsewhere (model.FLEX_DEVICES)", progress="a bar shows on a terminal only",
            sample="python sample.py --ckpt out/RUN/ckpt.pt",
            eot_token="a new run takes its data's (meta.json)", n_logits="a new run takes its data's vocabulary "
            "when vocab_size pads it", decay_branch="init_from=<checkpoint> with decay_tokens > 0 is a decay branch",
            overwrite="delete the run folder to start a run over", collective_timeout_s="the environment "
            "variable LOOPSTUDY_COLLECTIVE_TIMEOUT_S (tooling/distributed.py)",
            reshard_after_forward="parallel='fsdp_grad_op' keeps the gathered weights to the backward")

# ModelConfig fields that are constants now (model.py), at the one value every stored model had
FIXED = dict(rope_base=10000.0, norm_eps=NORM_EPS, router_renormalize=True, balance_loss_coef=BALANCE_LOSS_COEF,
             z_loss_coef=Z_LOSS_COEF, inject_before_coda=True)  # rope_base: model.rope_tables' base


def upgraded(ckpt, path):
    """ckpt (a checkpoint dict or a ckpt.dcp/'s meta) with its model config and state in this release's
    fields: n_loops (the loop count of smelt / layer_loop) is n_passes, prelude/core/coda is the even split
    (core_split), [X16]'s N went with the LR rule to the ladders. Raises ValueError naming what differs."""
    ckpt = upgraded_settings(ckpt)
    cfg, state = ckpt.get("model_config"), ckpt.get("state")
    if not isinstance(cfg, dict) or not ({"n_loops", "n_prelude"} | set(FIXED)) & set(cfg):
        return ckpt
    cfg = dict(cfg)
    for key, value in FIXED.items():
        stored = cfg.pop(key, value)
        if stored != value:
            raise ValueError(f"{path}: its model has {key}={stored!r}; this release builds only {key}={value!r} "
                             "(a constant of model.py now)")
    loops = cfg.pop("n_loops", 1)
    if cfg.get("layout") in ("smelt", "layer_loop"):
        cfg["n_passes"] = loops
    split = tuple(cfg.pop(k, -1) for k in ("n_prelude", "n_core", "n_coda"))
    if cfg.get("layout") == "pcc" and split != core_split(cfg.get("n_layer", 0)):
        raise ValueError(f"{path}: its model splits {cfg.get('n_layer')} blocks {split[0]}/{split[1]}/{split[2]}; "
                         "this release builds the [X] even split only (model.core_split)")
    ckpt = dict(ckpt, model_config=cfg)
    if isinstance(state, dict):
        ckpt["state"] = {k: v for k, v in state.items() if k != "lr_scaling_params"}
    return ckpt


def upgraded_settings(ckpt):
    """The second and third folds: muon_variant="x" is optimizer="muon_x", reshard_after_forward=False is
    parallel="fsdp_grad_op"; the model's attention backend is the device's (model.FLEX_DEVICES); resume,
    progress, sample, overwrite, collective_timeout_s and decay_branch (a branch's state says it) went."""
    cfg, train = ckpt.get("model_config"), ckpt.get("train_config")
    if isinstance(cfg, dict) and "attention" in cfg:
        ckpt = dict(ckpt, model_config={k: v for k, v in cfg.items() if k != "attention"})
    went = ("muon_variant", "resume", "progress", "sample", "overwrite", "collective_timeout_s", "decay_branch",
            "reshard_after_forward")
    if isinstance(train, dict) and set(went) & set(train):
        kept = {k: v for k, v in train.items() if k not in went}
        if train.get("muon_variant") == "x" and kept.get("optimizer") == "muon":
            kept["optimizer"] = "muon_x"
        if train.get("reshard_after_forward") is False and kept.get("parallel") == "fsdp":
            kept["parallel"] = "fsdp_grad_op"
        ckpt = dict(ckpt, train_config=kept)
    return ckpt
