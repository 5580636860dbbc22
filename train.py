"""
Train one model: Muon + AdamW (or AdamW alone), a warmup-stable-decay (WSD) schedule with decay
branches [S], growth of the number of passes mid-training [X], DDP or FSDP2, exact resume. nanoGPT
style: the defaults train the tiny looped MoE on the embedded Shakespeare corpus on a CPU.

    python train.py                                     # the tiny default on a CPU, a minute or two
    python train.py config/x_d8_loop2.py --max_steps=5  # a config file, then --key=value overrides
    python train.py --help                              # the settings a learner changes first
    torchrun --standalone --nproc_per_node=8 train.py config/x_d8_vanilla.py    # one node (DDP)
    # two nodes: on each, --node_rank 0 or 1 and the first node's address (docs/training.md)
    torchrun --nnodes=2 --node_rank=0 --nproc_per_node=8 --master_addr=10.0.0.1 train.py

Each run writes out/<run_name>/ckpt.pt and log.jsonl (a JSON line per eval: step, tokens, FLOPs with
every block execution counted, lr, train and val loss, ...), the checkpoint before its log line.
Operational code (settings, distributed, checkpoints, the run folder, memory) is in tooling/.
In-process: `train.train({"max_steps": 100})`.
"""

import contextlib
import math
import sys
import time
from dataclasses import dataclass, field
from statistics import fmean
from typing import Optional

import numpy as np
import torch
from tqdm import tqdm

import grow
import kernels
import match
from data.loader import open_data
from loss_eval import evaluate
from model import GPT, MLP, BoundaryOperator, ModelConfig, MoE, RMSNorm
from muon import Muon
from tooling import checkpoint, distributed, guards, legacy, memory, rundir
from tooling.rundir import RunDir
from tooling.settings import Settings

# --------------------------------------------------------------------------------------------------
# Settings: these, every ModelConfig field (model.py), the tiny default model on top. The comment
# beside each default is its --help text.


@dataclass
class TrainConfig:
    # run
    out_dir: str = "out"  # the run lives in out_dir/run_name/
    run_name: str = ""  # "" -> the config file's name, "tiny" without one, "<source>_decay<step>"
    eval_interval: int = 50  # eval + checkpoint + log line every this many steps (and at the end)
    log_interval: int = 10  # read the loss to the host (bar, non-finite check) every this many
    eval_tokens: int = 8192  # validation tokens per eval (the same windows, spread over the split)
    final_eval_tokens: int = 0  # > 0: validation tokens of the last eval (the papers': [X] 10M)
    save_steps: list = field(default_factory=list)  # extra checkpoints ckpt_step<N>.pt at these
    save_checkpoints: bool = True  # False: write no checkpoint at all, only the log (benchmarks)
    # data
    data_dir: str = ""  # a data/prepare.py folder; "" -> the embedded corpus (prepared at first)
    branch_data_fraction: float = 0.1  # tail of the train split held back for decay branches
    unique_tokens: int = 0  # > 0: the split's first this many tokens, reread as often as needed
    #   ([X] data-constrained: 100M unique tokens x 10 epochs); 0 -> all of it
    seed: int = 1337  # model init, data order, random passes
    # batch: a step reads global_batch sequences of block_size tokens, batch_size at a time
    batch_size: int = 16  # sequences per micro-batch per process
    global_batch: int = 0  # sequences per step over all processes; 0 -> batch_size x processes
    max_steps: int = 200  # optimizer steps of the whole run
    stop_at_step: int = 0  # > 0: save and stop after this step, the schedule unchanged (preemption)
    # optimizer
    optimizer: str = "muon"  # "muon": Muon on the hidden matrices, AdamW on the rest; "muon_x": the
    #   [X] code's Muon there (muon.py); "adamw": AdamW on all
    matrix_lr: float = 0.0  # LR of the hidden matrices; 0 -> 0.02 with Muon, 3e-3 with AdamW
    embedding_lr: float = 0.1  # AdamW LR of the token embedding
    unembedding_lr: float = 0.004  # AdamW LR of the lm head
    weight_decay: float = 0.0  # decoupled decay of the matrices, embedding and lm head ([X] code)
    adam_betas: tuple = (0.8, 0.95)  # AdamW (beta1, beta2)
    adam_eps: float = 1e-10  # AdamW epsilon
    muon_momentum_warmup: int = 0  # steps of Muon's momentum rising from 0.85 ([X] code: 300)
    grad_clip: float = 1.0  # clip the global gradient norm to this; 0 -> off
    # WSD schedule [S]
    warmup_steps: int = 20  # linear LR warmup from 0
    decay_fraction: float = 0.3  # the last fraction of max_steps decays; 0 -> stable (branch later)
    decay_shape: str = "cosine"  # "cosine" or "linear"
    # forks, decay branches, resume
    init_from: str = ""  # "resume": continue out_dir/run_name/ckpt.pt; a checkpoint: a new run from
    #   it (weights, optimizer, step, tokens); an export folder (tooling.export): weights, step 0
    decay_tokens: int = 0  # > 0 with init_from=<checkpoint>: a decay branch [S] of this many
    #   tokens, on held-back data; a stable run's config: the branches it plans (ladders/recipe.py)
    # number of passes
    n_passes_choices: list = field(default_factory=list)  # e.g. [1, 2, 3]: each step's K (or r),
    #   drawn uniformly, seeded by (seed, step)
    grow_at: float = 0.0  # growth step (>= 1) or fraction of max_steps (< 1); 0 -> no growth
    grow_to: int = 0  # passes after growth (K for pcc, r for smelt / layer_loop)
    grow_untie: bool = False  # untie the core at growth: C1 C2 -> C1 C2 C1 C2 (grow.py)
    grow_rewarm_steps: int = 0  # LR re-warm after growth, from 0 at the growth step ([X] code: 40)
    avg_doc_len: int = 0  # mean document length of the logged attention FLOPs; 0 -> block_size
    # system
    device: str = "auto"  # "auto": cuda if available else cpu; or "cpu", "cuda", "cuda:1"
    dtype: str = "auto"  # "auto": bf16 autocast on CUDA, fp32 on CPU; "float32" or "bfloat16"
    compile: bool = False  # torch.compile the model
    triton: bool = False  # Triton kernels in the model and Muon (opt-in until bench/gpu_check.sh)
    parallel: str = "ddp"  # torchrun: "ddp" (replicas), "fsdp" (FSDP2: all state sharded, a
    #   block's weights gathered at each visit) or "fsdp_grad_op" (kept gathered from a block's
    #   forward to its backward: fewer all-gathers, more memory; FSDP1's SHARD_GRAD_OP)
    activation_checkpointing: bool = False  # keep each executed block's input, recompute the rest

    grad_accum = 1  # not a setting: a step's micro-batches, from global_batch (derive_grad_accum)
    decay_branch = False  # not a setting: a fork with decay_tokens, or a branch resumed (its state)

    @property
    def resume(self):  # init_from="resume": the run continues its own checkpoint
        return self.init_from == "resume"

    @property
    def sharded(self):  # FSDP2: every rank holds its shards of the weights and optimizer state
        return self.parallel != "ddp"

    def __post_init__(self):
        guards.check_train_config(self)


# the tiny default: a SMELT-looped MoE [S] (the middle 2 of 4 layers run twice, updates scaled 1/2)
TINY_MODEL = dict(vocab_size=4096, block_size=128, n_layer=4, n_embd=128, n_head=4, n_expert=8,
                  top_k=2, layout="smelt", n_passes=2)
HELP_GROUPS = {title: keys.split() for title, keys in {  # --help shows every setting, in this order
    "the settings a learner changes": "n_layer n_embd n_head n_expert top_k layout n_passes "
    "tie_core boundary boundary_alpha block_size optimizer matrix_lr embedding_lr unembedding_lr "
    "weight_decay warmup_steps decay_fraction max_steps batch_size global_batch data_dir out_dir "
    "run_name seed",
    "model: vocabulary, attention, feed-forward, loop span": "vocab_size n_kv_head head_dim "
    "qk_norm norm_gain embed_norm tie_embeddings document_mask mlp_hidden expert_hidden loop_span",
    "model: [X]'s first pass, multipliers, init": "zero_initial_state residual_multiplier "
    "output_multiplier init embed_init_std uniform_init_scale",
    "optimizers and the decay": "adam_betas adam_eps muon_momentum_warmup grad_clip "
    "decay_shape",
    "growth, random passes, decay branches": "grow_at grow_to grow_untie grow_rewarm_steps "
    "n_passes_choices init_from decay_tokens branch_data_fraction unique_tokens",
    "evals, logs, checkpoints": "eval_interval log_interval eval_tokens final_eval_tokens "
    "avg_doc_len save_steps save_checkpoints",
    "distributed and precision": "device dtype parallel activation_checkpointing",
    "kernels and compilation": "triton compile",
    "reliability": "stop_at_step"}.items()}
FROM_DATA = ("eot_token", "n_logits")  # ModelConfig fields a new run takes from its data's meta
SETTINGS = Settings(TrainConfig, ModelConfig, defaults=TINY_MODEL, groups=HELP_GROUPS,
                    prog="train.py", went=legacy.WENT, not_settings=FROM_DATA)
DEFAULTS = SETTINGS.defaults


# --------------------------------------------------------------------------------------------------
# Optimizers: Muon (muon.py) for hidden matrices, AdamW for the rest

MATRIX_LR = {"muon": 0.02, "muon_x": 0.02, "adamw": 3e-3}  # matrix_lr=0: the optimizer's own
MUON_VARIANTS = {"muon": "original", "muon_x": "x"}  # Keller Jordan's; the [X] code's (muon.py)
ROUTER_LR = 3e-3  # AdamW LR of the MoE routers (always AdamW: see param_groups)
SCALAR_LR = 0.01  # AdamW LR of norm gains and other vectors
MUON_MOMENTUM = 0.95  # Nesterov, 5 Newton-Schulz steps, the "x" variant's beta2 0.95: muon.py


def matrix_lr(optimizer, lr):
    """The hidden matrices' LR: lr, or for 0 the optimizer's own (MATRIX_LR)."""
    return lr or MATRIX_LR[optimizer]


def param_groups(model, config):
    """Every parameter in exactly one named group: (name, optimizer kind, lr, weight decay, [(name,
    p)]). Muon takes the hidden matrices (2-D, and 3-D stacked experts). AdamW takes the token
    embedding, the lm head (their rows are per-token vectors, not operators between hidden states),
    norm gains and other vectors, and the MoE routers: a router's few rows set the routing logits'
    scale, which Muon's fixed spectral-norm steps would push around; AdamW keeps them small and
    adaptive."""
    groups = {
        "matrix": (config.optimizer, matrix_lr(config.optimizer, config.matrix_lr),
                   config.weight_decay),
        "embedding": ("adamw", config.embedding_lr, config.weight_decay),
        "unembedding": ("adamw", config.unembedding_lr, config.weight_decay),
        "router": ("adamw", ROUTER_LR, 0.0),
        "scalar": ("adamw", SCALAR_LR, 0.0),
    }
    members = {name: [] for name in groups}
    for name, p in model.named_parameters():  # named_parameters() lists a tied weight once
        if not p.requires_grad:
            continue
        group = ("embedding" if name.startswith("wte.") else
                 "unembedding" if name.startswith("lm_head.") else
                 "router" if ".router." in name else "matrix" if p.dim() >= 2 else "scalar")
        members[group].append((name, p))
    return [(name, *groups[name], members[name]) for name in groups if members[name]]


def build_optimizers(model, config, ns_dtype=None):
    """[AdamW, Muon (if any)]; each group remembers base_lr and its parameters' names. ns_dtype:
    Muon's Newton-Schulz dtype (None: bf16 on CUDA, fp32 on CPU; see muon.orthogonalize)."""
    adamw, muon = [], []
    for name, kind, lr, wd, named in param_groups(model, config):
        group = dict(params=[p for _, p in named], param_names=[n for n, _ in named], name=name,
                     lr=lr, base_lr=lr, weight_decay=wd)
        (muon if kind in MUON_VARIANTS else adamw).append(group)
    optimizers = [torch.optim.AdamW(adamw, betas=tuple(config.adam_betas), eps=config.adam_eps,
                                    fused=False)]
    if muon:
        optimizers.append(Muon(muon, momentum=MUON_MOMENTUM, ns_dtype=ns_dtype,
                               variant=MUON_VARIANTS[config.optimizer]))
    return optimizers


def set_schedule(optimizers, multiplier, muon_momentum):
    """Every group's LR = its base LR x multiplier; Muon's momentum. Returns the hidden matrices' LR
    (logged)."""
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = group["base_lr"] * multiplier
            if isinstance(opt, Muon):
                group["momentum"] = muon_momentum
    return optimizers[-1].param_groups[0]["lr"]


# --------------------------------------------------------------------------------------------------
# Schedule and accounting


@dataclass
class TrainState:
    """What a checkpoint carries for an exact resume, besides weights, optimizer state, settings."""
    step: int = 0
    tokens_seen: int = 0
    flops_seen: float = 0.0
    flops_by_passes: dict = field(default_factory=dict)  # {passes: training FLOPs run at so many}
    data_region: str = "stable"  # "stable" or "branch" (the held-back tail)
    data_position: int = 0  # windows of the region consumed so far
    branch_start_step: Optional[int] = None
    grown: bool = False
    last_eval: Optional[dict] = None  # the log record of the last eval
    seqs_per_step: int = 0  # the global batch: a resume on any number of processes keeps it
    decay_start: Optional[int] = None  # the step the LR starts to decay: a branch forks before it
    data_fingerprint: Optional[str] = None  # meta.json's, of the corpus data_position counts in

    def advance(self, tokens, windows, flops, passes):
        self.step, self.tokens_seen = self.step + 1, self.tokens_seen + tokens
        self.data_position, self.seqs_per_step = self.data_position + windows, windows
        self.flops_seen += flops
        self.flops_by_passes[passes] = self.flops_by_passes.get(passes, 0.0) + flops

    def record(self, **values):
        """A log line: where the run is, then the values."""
        by_passes = {str(k): v for k, v in sorted(self.flops_by_passes.items())}
        return dict(step=self.step, tokens=self.tokens_seen, flops=self.flops_seen,
                    flops_by_passes=by_passes, **values)


def wsd_multiplier(step, warmup_steps, decay_start, decay_end, shape="cosine"):
    """Warmup-stable-decay [S]: linear warmup to 1, constant, then a decay reaching 0 exactly at the
    last step (decay_end - 1): cosine from its first step on, or linear as the [X] code's warm-down
    (1 at decay_start, 0 after decay_end - decay_start - 1 more steps)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if step < decay_start or decay_end <= decay_start:
        return 1.0
    if shape == "cosine":
        progress = min(1.0, (step - decay_start + 1) / (decay_end - decay_start))
        return 0.5 * (1 + math.cos(math.pi * progress))
    steps = decay_end - decay_start
    return 1 - (1.0 if steps == 1 else min(1.0, (step - decay_start) / (steps - 1)))


@dataclass
class Schedule:
    """The step numbers of a run and the LR multiplier of every step."""
    max_steps: int
    decay_start: int
    grow_step: Optional[int]  # None: no growth
    config: TrainConfig

    def lr_multiplier(self, step):
        """WSD x the re-warm after growth ([X] code: 0 at the growth step, then
        linear to 1)."""
        c = self.config
        multiplier = wsd_multiplier(step, c.warmup_steps, self.decay_start, self.max_steps,
                                    c.decay_shape)
        if self.grow_step is None:
            return multiplier
        return multiplier * grow.rewarm_multiplier(step, self.grow_step, c.grow_rewarm_steps)

    def muon_momentum(self, step):
        """Muon's momentum, rising linearly from 0.85 over muon_momentum_warmup steps ([X]: 300)."""
        warmup, m = self.config.muon_momentum_warmup, MUON_MOMENTUM
        return m if warmup <= 0 else 0.85 + (m - 0.85) * min(1.0, step / warmup)


def plan_schedule(config, state, tokens_per_step):
    """The run's Schedule; records in the state where its LR starts to decay (a branch forks
    before)."""
    if config.decay_branch:  # a branch decays over decay_tokens from the step it forked at
        max_steps = state.branch_start_step + math.ceil(config.decay_tokens / tokens_per_step)
        decay_start = state.branch_start_step
    else:
        max_steps = config.max_steps
        decay_start = max(config.warmup_steps, max_steps - round(config.decay_fraction * max_steps))
    grows = config.grow_at and not config.decay_branch
    grow_step = grow.growth_step(max_steps, config.grow_at) if grows else None
    state.decay_start = decay_start
    return Schedule(max_steps, decay_start, grow_step, config)


def passes_of_step(config, step):
    """None (the model's own passes), or K drawn uniformly from n_passes_choices, seeded by
    (seed, step)."""
    if not config.n_passes_choices:
        return None
    return int(np.random.default_rng([config.seed, step, 1]).choice(config.n_passes_choices))


def flops_per_token(cfg, n_passes=None, avg_doc_len=0):
    """Training FLOPs per token of the executed plan (match.py); avg_doc_len 0: documents of
    block_size."""
    return float(match.flops_per_token(cfg, n_passes=n_passes, avg_doc_len=avg_doc_len or None))


# --------------------------------------------------------------------------------------------------
# The model: built (or loaded), sharded, its optimizers; growth mid-run


def shard_and_build_optimizers(model, config, device, world, use_bf16):
    """Shard the model (FSDP), build its optimizers, swap in the Triton kernels when asked."""
    model.activation_checkpointing = config.activation_checkpointing
    if config.sharded:  # bf16 gathered copies of the blocks' fp32 weights on CUDA
        bf16 = torch.bfloat16 if use_bf16 and device.type == "cuda" else None
        distributed.shard(model, device, world, bf16, config.parallel == "fsdp")
    ns_dtype = torch.bfloat16 if use_bf16 else torch.float32
    optimizers = build_optimizers(model, config, ns_dtype=ns_dtype)
    if config.triton:  # by type, not class name: a class renamed in model.py fails here
        swaps = {RMSNorm: kernels.RMSNormKernel, MLP: kernels.MLPKernel, MoE: kernels.MoEKernel,
                 BoundaryOperator: kernels.BoundaryOperatorKernel}
        kernels.apply(model, swaps, optimizers)
    return optimizers


def build_model(config, model_config, source, device, world, region, use_bf16):
    """The model, its optimizers and the training state: fresh, or from the source checkpoint (a
    ckpt.pt file: whole tensors, sharded as they load; a ckpt.dcp/ directory: shard by shard; an
    export folder: its weights, in a new run)."""
    torch.manual_seed(config.seed)
    model = GPT(model_config).to(device)
    if source is not None and not source.get("sharded"):
        model.load_state_dict(source["model"])
    optimizers = shard_and_build_optimizers(model, config, device, world, use_bf16)
    if source is None or source.get("export"):
        return model, optimizers, TrainState(data_region=region)
    checkpoint.load_into(source, model, optimizers)
    try:
        state = TrainState(**source["state"])
    except TypeError as e:  # a checkpoint whose state has other fields
        raise ValueError(f"{source['path']}: its state is not a train.py TrainState ({e})") from e
    if state.data_region != region:  # a fork that reads another region starts at its beginning
        state.data_region, state.data_position = region, 0
    if config.decay_branch and not config.resume:  # a fresh branch from a stable checkpoint
        state.branch_start_step, state.last_eval = state.step, None
    if config.resume:
        torch.set_rng_state(source["rng"]["torch"])
    return model, optimizers, state


def grow_during_training(model, optimizers, config, state, device, world, use_bf16, log=print):
    """[X] growth: more passes (tied) or copied cores (untied); optimizers rebuilt with every
    parameter's state carried over by name (grow.copy_optimizer_state decides what copies get).
    Returns the model (grown in place; under FSDP a grown copy of the gathered model, sharded
    again), its optimizers and the module the step calls (distributed.wrap); the state records
    it."""
    saved = checkpoint.optimizer_state_by_name(optimizers)["state"]
    if distributed.is_sharded(model):  # grow the whole model, then shard it again
        weights = distributed.full_state(model.state_dict())
        saved = {name: distributed.full_state(s) for name, s in saved.items()}
        model = GPT(model.config).to(device)
        model.load_state_dict(weights)
    param_map = grow.grow(model, config.grow_to, config.grow_untie)
    optimizers = shard_and_build_optimizers(model, config, device, world, use_bf16)
    checkpoint.load_optimizer_state(optimizers, grow.copy_optimizer_state(saved, param_map))
    log(f"grew to {model.config.n_passes} passes{'' if model.config.tie_core else ' (untied)'}")
    state.grown = True
    return model, optimizers, distributed.wrap(model, device, world, config)


# --------------------------------------------------------------------------------------------------
# Training


def train(overrides=None):
    """One run in this process: overrides {setting: value} over the defaults -> its summary."""
    # settings, processes, precision, memory: a run that cannot run is refused before it builds
    values, source, notes = rundir.resolve_run(SETTINGS, dict(overrides or {}))
    config, model_config = SETTINGS.build(TrainConfig, values), SETTINGS.build(ModelConfig, values)
    config.decay_branch = values["decay_branch"]  # a fork with decay_tokens, or a branch resumed
    rank, world, device = distributed.setup(config.device, config.parallel)
    guards.derive_grad_accum(config, world, source)  # one step of global_batch on any world size
    use_bf16, autocast, compute_note = distributed.compute(config, device)  # CPU: its threads
    grown = guards.check_run(model_config, config, source, device)
    shapes = grow.shapes_of_run(model_config, config, grown)  # as built, grown, at most passes
    defer_sync, memory_note = memory.check_memory(shapes, config, device, use_bf16, world)
    run = RunDir.of(config, rank, world)
    log, state = tqdm.write if rank == 0 else (lambda *args: None), None
    with run.hold(config.resume and source), contextlib.ExitStack() as closing, \
            run.on_interrupt(lambda: state.step if state else 0):
        # data and model: fresh, or from the checkpoint a resume, fork or decay branch continues
        data, model_config = open_data(config.data_dir, model_config, world, rank == 0,
                                       new_model=source is None)  # its eot_token, n_logits
        stream = data.stream(model_config.block_size, config.seed, config.branch_data_fraction,
                             config.decay_branch, config.unique_tokens)
        model, optimizers, state = build_model(config, model_config, source, device, world,
                                               stream.name, use_bf16)
        distributed.agree("data, step", dict(data=data.fingerprint, tokens=len(data.train_tokens),
                                             step=state.step))
        wrapped = distributed.wrap(model, device, world, config)

        # the schedule: tokens per step, steps, where the LR decays, the growth step
        seqs_per_step = config.batch_size * config.grad_accum * world
        tokens_per_step = seqs_per_step * model_config.block_size
        schedule = plan_schedule(config, state, tokens_per_step)
        guards.check_plan(config, source, state, schedule, stream, seqs_per_step, plan_schedule,
                          log)
        log(rundir.run_header(run, model, data, stream, state.step, tokens_per_step,
                              schedule.max_steps, world, device, use_bf16,
                              [*notes, compute_note, memory_note]))

        # losses read to the host: all, since the eval; unread: each step's (CE, loss) on the device
        t0, first_position = time.time(), state.data_position
        losses, window, passes_seen, unread = [], [], [], []
        if source is None or source.get("export"):  # a new run: its step-0 eval, logged later
            metrics = evaluate(model, data, config, autocast, rank, world)
            record = eval_record(state, metrics, t0, device, 0.0, None, 0.0, model.config.n_passes)
            state.last_eval = run.append_log(record, wait_for_checkpoint=True)
        bar = closing.enter_context(tqdm(total=schedule.max_steps, initial=state.step, unit="step",
                                         desc=config.run_name, disable=rank > 0 or None))  # None:
        #   a bar on a terminal only (not in a log file, a pipe, a ladder's worker)
        while state.step < schedule.max_steps:
            if state.step == schedule.grow_step and not state.grown:  # [X] growth, once
                model, optimizers, wrapped = grow_during_training(
                    model, optimizers, config, state, device, world, use_bf16, log)
            lr = set_schedule(optimizers, schedule.lr_multiplier(state.step),
                              schedule.muon_momentum(state.step))
            n_passes = passes_of_step(config, state.step)  # None: the model's own K (or r)

            # forward and backward over the micro-batches (rank r reads its slice), then the update
            unread.append(torch.zeros(2, dtype=torch.float64, device=device))  # (CE, loss)
            for micro in range(config.grad_accum):
                first = state.data_position + (rank * config.grad_accum + micro) * config.batch_size
                x, y = stream.batch(first, config.batch_size, device)
                sync = world == 1 or micro == config.grad_accum - 1 or not defer_sync
                with distributed.no_sync(wrapped, model, skip=not sync), autocast:
                    loss, stats = wrapped(x, y, n_passes=n_passes, return_stats=True)[1:]
                    (loss / config.grad_accum).backward()  # the logits are not kept (above)
                unread[-1] += torch.stack([stats["ce"], loss.detach()]).double() / config.grad_accum
            if config.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
            for opt in optimizers:
                opt.step()
                opt.zero_grad(set_to_none=True)

            # accounting: tokens, windows read, FLOPs with every block execution counted (match.py)
            k = n_passes or model.config.n_passes
            flops = flops_per_token(model.config, n_passes, config.avg_doc_len) * tokens_per_step
            state.advance(tokens_per_step, seqs_per_step, flops, k)
            passes_seen.append(k)
            bar.update(1)

            # the losses to the host every log_interval steps and before an eval or save: one read
            last = state.step in (schedule.max_steps, config.stop_at_step)
            at_eval = state.step % config.eval_interval == 0 or last
            extra_save = state.step in config.save_steps
            if at_eval or extra_save or state.step % config.log_interval == 0:
                read, unread = guards.read_losses(unread, state.step, world), []  # stops at a NaN
                losses, window = losses + read, window + read
                bar.set_postfix(loss=f"{read[-1]:.3f}", lr=f"{lr:.2e}")

            # eval, checkpoint, log line; extra checkpoints (branches fork from them); a stop
            if at_eval:
                final = state.step == schedule.max_steps
                metrics = evaluate(model, data, config, autocast, rank, world, final)
                epochs = state.data_position / stream.n_windows
                state.last_eval = eval_record(state, metrics, t0, device, lr, fmean(window), epochs,
                                              fmean(passes_seen))
                run.save_training(model, optimizers, config, state, data)
                run.append_log(state.last_eval)
                window, passes_seen = [], []
                bar.set_postfix(loss=f"{losses[-1]:.3f}", val=f"{state.last_eval['val_loss']:.3f}")
            if extra_save:
                run.save_training(model, optimizers, config, state, data, run.step_path(state.step))
            if state.step == config.stop_at_step:
                break
        bar.close()

        # the end: an FSDP run's weights in one ckpt.pt, the summary (python sample.py reads it)
        run.consolidate(model, optimizers, config, state, data)
        return run.summary(state, schedule.max_steps, data, stream, losses, first_position, t0)


def eval_record(state, metrics, t0, device, lr, train_loss, epochs, n_passes):
    """An eval's log line: where the run is, its LR and train loss, the eval, time and memory."""
    return state.record(lr=lr, train_loss=train_loss, **metrics, epochs=epochs, n_passes=n_passes,
                        seconds=round(time.time() - t0, 3), **rundir.gpu_memory(device))



def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(SETTINGS.help())
        return 0
    return rundir.run_cli("train.py", lambda: train(SETTINGS.parse(argv)))  # one line at any end


if __name__ == "__main__":
    distributed.exit(main())
