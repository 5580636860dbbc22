"""
The refusals a training run makes before it trains, each one line naming the setting, and the one it makes
while it trains: a non-finite loss (read_losses).

Guards against: a value out of range accepted in silence (a learning rate <= 0 that never descends, a
fraction above 1, a run name that is a path), setting combinations that cannot work (a decay branch
without its stable checkpoint, more random passes than an untied model has cores, growing to fewer
passes), and a decay branch that would reread data ([S] trains without repetition).
"""

import copy
import dataclasses
import math
import os
import re
import unicodedata

import torch

from model import MAX_PASSES, PASSES_WHY, most_passes
from tooling import distributed
from tooling.checkpoint import NonFiniteLoss

RUN_NAME = r"[A-Za-z0-9_][A-Za-z0-9._+=-]*"  # a folder name that prints as itself on any terminal


def unsafe_path(text):
    """True for a path with characters that hide what it is: control, format (e.g. right-to-left override,
    zero-width) or undecodable bytes (surrogate escapes)."""
    return any(unicodedata.category(ch) in ("Cc", "Cf", "Cs") for ch in text)


def bad(config, name, why):
    raise ValueError(f"{name}={getattr(config, name)!r}: {why}")


def check_train_config(c):
    """The ranges and combinations of train.py's TrainConfig (called by its __post_init__)."""
    choices = dict(optimizer=("muon", "muon_x", "adamw"), decay_shape=("cosine", "linear"),
                   dtype=("auto", "float32", "bfloat16"), parallel=("ddp", "fsdp", "fsdp_grad_op"))
    for name, allowed in choices.items():
        if getattr(c, name) not in allowed:
            bad(c, name, f"must be one of {', '.join(map(repr, allowed))}")
    if c.run_name and not re.fullmatch(RUN_NAME, c.run_name):
        bad(c, "run_name", "must be a plain folder name of letters, digits and . _ + = - (no path separators, "
                           "spaces or control characters); the run lives in out_dir/run_name")
    for name in ("out_dir", "data_dir", "init_from"):
        if unsafe_path(getattr(c, name)):
            bad(c, name, "holds a control, invisible or direction-changing character, or bytes that are not UTF-8")
    for name in ("eval_interval", "log_interval", "eval_tokens", "batch_size"):
        if getattr(c, name) < 1:
            bad(c, name, "must be >= 1")
    if c.max_steps < 1:
        bad(c, "max_steps", "must be >= 1")
    for name in ("final_eval_tokens", "stop_at_step", "warmup_steps", "grad_clip", "weight_decay", "decay_tokens",
                 "grow_at", "grow_to", "grow_rewarm_steps", "avg_doc_len", "muon_momentum_warmup", "global_batch",
                 "seed", "unique_tokens"):
        if getattr(c, name) < 0:
            bad(c, name, "must be >= 0")
    if c.seed >= 2 ** 63:
        bad(c, "seed", "must be below 2**63 (torch.manual_seed's range)")
    if not c.out_dir:
        bad(c, "out_dir", "must name a folder")
    if c.matrix_lr < 0:
        bad(c, "matrix_lr", "must be >= 0 (0: the optimizer's default; a learning rate < 0 does not descend)")
    for name in ("embedding_lr", "unembedding_lr", "adam_eps"):
        if not getattr(c, name) > 0:
            bad(c, name, "must be > 0 (a learning rate <= 0 does not descend)")
    if len(c.adam_betas) != 2 or not all(0 <= b < 1 for b in c.adam_betas):
        bad(c, "adam_betas", "must be two numbers in [0, 1)")
    if not 0.0 <= c.decay_fraction <= 1.0:
        bad(c, "decay_fraction", "must be in [0, 1]")
    if not 0.0 <= c.branch_data_fraction < 1.0:
        bad(c, "branch_data_fraction", "must be in [0, 1)")
    if any(not isinstance(s, int) or s < 1 for s in c.save_steps):
        bad(c, "save_steps", "must be a list of steps >= 1")
    if c.save_steps and not c.save_checkpoints:
        bad(c, "save_steps", "needs save_checkpoints=True (save_checkpoints=False writes no checkpoint)")
    if any(not isinstance(k, int) or not 1 <= k <= MAX_PASSES for k in c.n_passes_choices):
        bad(c, "n_passes_choices", f"must be a list of pass counts in [1, {MAX_PASSES}] ({PASSES_WHY})")
    if c.grow_at and c.grow_to < 1:
        bad(c, "grow_at", "needs grow_to >= 1 (passes after growth)")


def derive_grad_accum(config, world, source=None):
    """config.grad_accum, the micro-batches of a step: global_batch / (batch_size x world), which must divide
    exactly, so a run keeps its global batch on any number of processes (a resume onto fewer GPUs included);
    global_batch 0: one micro-batch per process. source: the checkpoint this run continues or forks (None:
    none); resolve_run sets global_batch to its sequences per step unless the command gives one."""
    recorded = source["state"].get("seqs_per_step", 0) if source else 0
    per_step = config.batch_size * world
    if config.global_batch <= 0:
        config.grad_accum = 1
        return
    if config.global_batch % per_step:
        kept = " (the sequences per step of the run it continues)" if recorded else ""
        raise ValueError(f"global_batch={config.global_batch}{kept} is not a multiple of batch_size x processes = "
                         f"{config.batch_size} x {world}; change batch_size or global_batch")
    config.grad_accum = config.global_batch // per_step


def check_run(cfg, config, source=None, device=None):
    """What the settings ask of this model (cfg: its ModelConfig; source: the checkpoint it starts from, or
    None) on this device, checked before anything is built: the pass counts, the document length the logged
    FLOPs assume, what the device cannot train. Returns whether the model has already grown ([X]: the
    source's state says)."""
    grown = bool(source and source["state"].get("grown"))
    if device is not None and device.type == "cpu":
        if config.triton and os.environ.get("TRITON_INTERPRET", "0").lower() not in ("1", "true", "on", "yes"):
            raise ValueError("triton=True: the Triton kernels compile for CUDA; on a CPU only Triton's interpreter "
                             "runs them (TRITON_INTERPRET=1 before the start, slow: for tests)")
    if config.avg_doc_len > cfg.block_size:
        raise ValueError(f"avg_doc_len={config.avg_doc_len}: a document seen in a window of block_size="
                         f"{cfg.block_size} tokens is at most that long")
    if config.n_passes_choices and cfg.layout == "plain":
        raise ValueError("n_passes_choices: a plain model has no passes to vary (use layout smelt, layer_loop or pcc)")
    limits = [("", most_passes(cfg))]  # an untied model runs one pass per stored core
    if config.grow_at and config.grow_untie and not config.decay_branch and not grown:
        limits.append((" after growth", config.grow_to))  # untied at growth: grow_to cores
    for when, most in limits:
        too_many = [k for k in config.n_passes_choices if k > most]
        if too_many:
            raise ValueError(f"n_passes_choices={config.n_passes_choices}:{when} the untied model has {most} "
                             f"cores, one per trained pass: it cannot run {too_many} passes")
    if config.grow_at and not config.decay_branch and not grown:
        if config.grow_to < cfg.n_passes or (config.grow_to == cfg.n_passes and not config.grow_untie):
            raise ValueError(f"grow_to={config.grow_to}: must be more than the model's {cfg.n_passes} passes")
    return grown


def check_branch_source(source, path):
    """[S] a decay branch forks a stable checkpoint, taken before its LR began to decay: branching from a
    branch, or from a run already decaying, would send the LR back up."""
    state = source["state"]
    if state.get("branch_start_step") is not None:
        raise ValueError(f"init_from={path} is itself a decay branch (forked at step {state['branch_start_step']}); "
                         "branch from a stable checkpoint")
    if state.get("decay_start") is not None and state["step"] > state["decay_start"]:
        raise ValueError(f"init_from={path} is at step {state['step']}, after its LR began to decay at step "
                         f"{state['decay_start']}: a branch from it would raise the LR again; branch from a stable "
                         "checkpoint (save_steps, or a run with decay_fraction=0)")


# what decides the LR, momentum and passes of every step: a resume that changes one of them changes the run's plan
SCHEDULE_KEYS = ("max_steps", "warmup_steps", "decay_fraction", "decay_shape",
                 "decay_tokens", "grow_at", "grow_to", "grow_untie", "grow_rewarm_steps",
                 "muon_momentum_warmup", "n_passes_choices")


def check_plan(config, source, state, schedule, stream, seqs_per_step, plan, log):
    """The run's plan against its start: a fork with no step left to train, a warmup longer than the run, the
    data it needs (check_data_budget); a resume whose settings change the schedule says exactly what changes
    (plan: train.plan_schedule, to re-plan the run it continues)."""
    if source is not None and not config.resume and state.step >= schedule.max_steps:
        raise ValueError(f"init_from={config.init_from}: the checkpoint is at step {state.step} and this run ends at "
                         f"step {schedule.max_steps} (max_steps): nothing to train; raise max_steps")
    if not config.decay_branch and config.warmup_steps > schedule.max_steps:
        raise ValueError(f"warmup_steps={config.warmup_steps}: longer than the run ({schedule.max_steps} steps); the "
                         "LR would never reach its peak")
    if config.resume and state.step < schedule.max_steps:
        before = {k: source["train_config"].get(k, getattr(config, k)) for k in SCHEDULE_KEYS}
        changed = [f"{k} {before[k]!r} -> {getattr(config, k)!r}" for k in SCHEDULE_KEYS
                   if before[k] != getattr(config, k)]
        if changed:
            old = plan(dataclasses.replace(config, **before), copy.copy(state), seqs_per_step * stream.seq_len)
            step = state.step
            log(f"note: this resume changes the run's schedule ({', '.join(changed)}): the LR at step {step} is "
                f"{schedule.lr_multiplier(step):.4f} x its peak (was {old.lr_multiplier(step):.4f} x); the run ends "
                f"at step {schedule.max_steps} (was {old.max_steps}), its decay starts at step {schedule.decay_start} "
                f"(was {old.decay_start})")
    check_data_budget(stream, state, schedule.max_steps, seqs_per_step, log, config.resume)


def check_inert(values, given):
    """A setting the command gives (other than its default) that has no effect in this configuration is refused,
    with what it would need: otherwise the run trains without it in silence. values: every resolved setting;
    given: the names the command (config files, --key=value) sets to other than their defaults."""
    v, layout, optimizer = values, values["layout"], values["optimizer"]
    acts = [  # (settings, whether they act here, why not)
        (("grow_to", "grow_untie", "grow_rewarm_steps"), v["grow_at"] > 0,
         "does nothing without grow_at (the step the model grows at)"),
        (("decay_tokens",), v["decay_branch"] or v["decay_fraction"] == 0, "does nothing without init_from=<a stable "
         "checkpoint>: it is a decay branch's length (a stable phase, decay_fraction=0, may name its branches' for "
         "ladder.py --plan)"),
        (("n_passes",), layout != "plain", "does nothing in layout 'plain': every layer runs once (loop with "
         "layout 'smelt', 'layer_loop' or 'pcc')"),
        (("loop_span",), layout in ("smelt", "layer_loop"), f"does nothing in layout {layout!r}: it is the span "
         "layouts 'smelt' and 'layer_loop' loop"),
        (("tie_core", "boundary", "boundary_alpha", "zero_initial_state"), layout == "pcc",
         f"does nothing in layout {layout!r}: it is of layout 'pcc' (prelude-core-coda)"),
        (("expert_hidden",), v["n_expert"] > 0,
         "does nothing in a dense model: it is an MoE setting (n_expert > 0)"),
        (("muon_momentum_warmup",), optimizer != "adamw",
         "does nothing with optimizer='adamw': it is Muon's"),
    ]
    for names, active, why in acts:
        for name in names:
            if name in given and not active:
                raise ValueError(f"{name}={v[name]!r}: {why}")


def check_data_budget(stream, state, max_steps, seqs_per_step, log, resume=False):
    """The data position is a count of another corpus's windows when the data folder holds another prepare than
    the checkpoint read: a resume is refused, a run from init_from reads the new data from its start. [S]
    trains without repetition: a decay branch that would reread its held-back data is refused; a stable
    phase that wraps into a second epoch says so."""
    fingerprint = getattr(stream, "fingerprint", None)
    if state.data_fingerprint not in (None, fingerprint):
        if resume:
            raise ValueError(f"this data_dir holds another prepared corpus (fingerprint {str(fingerprint)[:12]}) "
                             f"than the one the run read ({state.data_fingerprint[:12]}): resume on that data, "
                             "or start a new run from the checkpoint with init_from")
        state.data_position = 0
        log("note: init_from read another prepared corpus; this run reads its own data from the first window")
    state.data_fingerprint = fingerprint
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


def read_losses(unread, step, world):
    """The step losses (CE, averaged over the processes) of the steps up to `step` not read yet, from each
    step's (CE, total loss) on the device, means over its micro-batches: one collective and one host read
    for all of them. Raises NonFiniteLoss naming the first step whose CE or total loss (router losses
    included) is not finite on any process: the loop reads before every eval and save, so no checkpoint is
    written after it."""
    values = (distributed.all_reduce(torch.stack(unread)) / world).tolist()
    for i, (ce, total) in enumerate(values):
        if not (math.isfinite(ce) and math.isfinite(total)):
            raise NonFiniteLoss(f"non-finite loss ({ce if not math.isfinite(ce) else total}) at step "
                                f"{step - len(values) + i}")
    return [ce for ce, _ in values]
