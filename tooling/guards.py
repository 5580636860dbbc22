"""
The refusals a training run makes before it trains, each one line naming the setting.

Guards against: a value out of range accepted in silence (a learning rate <= 0 that never descends, a
fraction above 1, a run name that is a path), setting combinations that cannot work (a decay branch
without its stable checkpoint, more random passes than an untied model has cores, growing to fewer
passes), and a decay branch that would reread data ([S] trains without repetition).
"""

import os


def bad(config, name, why):
    raise ValueError(f"{name}={getattr(config, name)!r}: {why}")


def check_train_config(c):
    """The ranges and combinations of train.py's TrainConfig (called by its __post_init__)."""
    choices = dict(optimizer=("muon", "adamw"), decay_shape=("cosine", "linear"), muon_variant=("original", "x"),
                   dtype=("auto", "float32", "bfloat16"), parallel=("ddp", "fsdp"))
    for name, allowed in choices.items():
        if getattr(c, name) not in allowed:
            bad(c, name, f"must be one of {', '.join(map(repr, allowed))}")
    if c.run_name != os.path.basename(c.run_name) or c.run_name in (".", ".."):
        bad(c, "run_name", "must be a plain folder name (no path separators); the run lives in out_dir/run_name")
    for name in ("eval_interval", "eval_tokens", "batch_size", "grad_accum", "muon_ns_steps"):
        if getattr(c, name) < 1:
            bad(c, name, "must be >= 1")
    if c.max_steps < 1 and c.max_tokens <= 0:
        bad(c, "max_steps", "must be >= 1 (or set max_tokens > 0)")
    for name in ("max_tokens", "stop_at_step", "warmup_steps", "grad_clip", "weight_decay", "decay_tokens",
                 "grow_at", "grow_to", "grow_rewarm_steps", "avg_doc_len", "lr_anchor_params", "embedding_weight_decay",
                 "unembedding_weight_decay", "muon_momentum_warmup", "global_batch"):
        if getattr(c, name) < 0:
            bad(c, name, "must be >= 0")
    for name in ("matrix_lr", "adamw_matrix_lr", "embedding_lr", "unembedding_lr", "router_lr", "scalar_lr",
                 "adam_eps"):
        if not getattr(c, name) > 0:
            bad(c, name, "must be > 0 (a learning rate <= 0 does not descend)")
    if len(c.adam_betas) != 2 or not all(0 <= b < 1 for b in c.adam_betas):
        bad(c, "adam_betas", "must be two numbers in [0, 1)")
    for name in ("muon_momentum", "muon_beta2"):
        if not 0 <= getattr(c, name) < 1:
            bad(c, name, "must be in [0, 1)")
    for name in ("decay_fraction", "min_lr_fraction"):
        if not 0.0 <= getattr(c, name) <= 1.0:
            bad(c, name, "must be in [0, 1]")
    if not 0.0 <= c.branch_data_fraction < 1.0:
        bad(c, "branch_data_fraction", "must be in [0, 1)")
    if any(not isinstance(s, int) or s < 1 for s in c.save_steps):
        bad(c, "save_steps", "must be a list of steps >= 1")
    if any(not isinstance(k, int) or k < 1 for k in c.n_passes_choices):
        bad(c, "n_passes_choices", "must be a list of pass counts >= 1")
    if c.decay_branch and (not c.init_from or c.decay_tokens <= 0):
        bad(c, "decay_branch", "needs init_from=<stable checkpoint> and decay_tokens > 0")
    if c.decay_branch and c.branch_data_fraction == 0.0:
        bad(c, "decay_branch", "needs branch_data_fraction > 0 (the held-back data it reads)")
    if c.grow_at and c.grow_to < 1:
        bad(c, "grow_at", "needs grow_to >= 1 (passes after growth)")
    if c.resume and c.init_from:
        bad(c, "resume", "use either resume=True (continue out_dir/run_name/ckpt.pt) or init_from, not both")


def derive_grad_accum(config, world):
    """global_batch > 0: grad_accum = global_batch / (batch_size x world), which must divide exactly, so
    a run keeps its global batch on any number of processes (a resume onto fewer GPUs included)."""
    if config.global_batch <= 0:
        return
    per_step = config.batch_size * world
    if config.global_batch % per_step:
        raise ValueError(f"global_batch={config.global_batch} is not a multiple of batch_size x processes = "
                         f"{config.batch_size} x {world}; change batch_size or global_batch")
    config.grad_accum = config.global_batch // per_step


def check_passes(cfg, config, grown=False):
    """The pass counts this run will ask of the model (cfg: its ModelConfig), checked before anything
    is built."""
    if config.n_passes_choices and cfg.layout == "plain":
        raise ValueError("n_passes_choices: a plain model has no passes to vary (use layout smelt, layer_loop or pcc)")
    if config.n_passes_choices and cfg.layout == "pcc" and not cfg.tie_core:
        too_many = [k for k in config.n_passes_choices if k > cfg.n_passes]
        if too_many:
            raise ValueError(f"n_passes_choices={config.n_passes_choices}: an untied model has {cfg.n_passes} "
                             f"cores, it cannot run {too_many} passes")
    if config.grow_at and not config.decay_branch and not grown:
        if config.grow_to < cfg.passes or (config.grow_to == cfg.passes and not config.grow_untie):
            raise ValueError(f"grow_to={config.grow_to}: must be more than the model's {cfg.passes} passes")


def check_data_budget(stream, state, max_steps, seqs_per_step, log):
    """[S] trains without repetition: a decay branch that would reread its held-back data is refused;
    a stable phase that wraps into a second epoch says so."""
    needed = state.data_position + (max_steps - state.step) * seqs_per_step
    if needed <= stream.n_windows:
        return
    epochs = needed / stream.n_windows
    if state.data_region == "branch":
        raise ValueError(f"the decay branch needs {needed:,} windows of block_size + 1 tokens but the held-back "
                         f"data has {stream.n_windows:,} ({epochs:.2f} epochs): it would reread data. Lower "
                         "decay_tokens, or raise branch_data_fraction (for a new stable run)")
    log(f"note: this run reads {epochs:.2f} epochs of its {stream.n_windows:,} training windows: data repeats "
        "(log.jsonl has the epoch count)")
