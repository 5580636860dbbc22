"""
Train one model: Muon + AdamW (or AdamW alone), a warmup-stable-decay (WSD) schedule with decay branches
[S], growth of the number of passes mid-training [X], gradient accumulation, DDP or FSDP2, exact resume.
nanoGPT style: the defaults below train the tiny looped MoE on the embedded Shakespeare corpus on a CPU.

    python train.py                                     # the tiny default on a CPU, a minute or two
    python train.py config/x_d8_loop2.py --max_steps=5  # a config file, then --key=value overrides
    python train.py --help                              # the settings a learner changes first, then the rest
    torchrun --standalone --nproc_per_node=8 train.py config/x_d8_vanilla.py    # one node (DDP)
    # two nodes: on each (node_rank 0 and 1), the first node's address as master_addr
    torchrun --nnodes=2 --node_rank=0 --nproc_per_node=8 --master_addr=10.0.0.1 --master_port=29500 train.py

Each run writes out/<run_name>/ckpt.pt and log.jsonl (one JSON line per eval: step, tokens, analytic
training FLOPs with every block execution counted, lr, train and val loss, ...); the checkpoint is written
before its log line. At the growth step [X] grow.grow changes the live model and the optimizers are
rebuilt with every parameter's state carried over by name. Operational code (settings, distributed,
checkpoints, the run folder, memory) is in tooling/. In-process: `train.train({"max_steps": 100})`.
"""

import contextlib
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

import grow
import kernels
import match
from data.loader import open_data, to_device, windows
from model import GPT, ModelConfig
from muon import Muon
from sample import data_tokenizer, sample_text
from tooling import checkpoint, distributed, guards, memory, rundir
from tooling.checkpoint import NonFiniteLoss, TrainState
from tooling.rundir import RunDir
from tooling.settings import Settings

# ----------------------------------------------------------------------------------------------------
# Settings: these, every ModelConfig field (model.py), the tiny default model on top. The comment beside
# each default is its --help text.


@dataclass
class TrainConfig:
    # run
    out_dir: str = "out"  # the run lives in out_dir/run_name/
    run_name: str = ""  # "" -> the config file's name, "tiny" without one, "<source>_decay<step>" for a branch
    eval_interval: int = 50  # eval + checkpoint + log line every this many steps (and at the end)
    log_interval: int = 10  # read the loss to the host (bar, non-finite check) every this many steps, and at evals
    eval_tokens: int = 8192  # validation tokens per eval (the same windows every eval, spread over the split)
    final_eval_tokens: int = 0  # > 0: validation tokens of the eval at the last step (the papers' size: [X] 10M)
    save_steps: list = field(default_factory=list)  # extra checkpoints ckpt_step<N>.pt after these steps
    save_checkpoints: bool = True  # False: write no checkpoint at all, only the log (benchmarks)
    overwrite: bool = False  # a new run into a folder that holds a run (log, checkpoints): delete them and
    #   start over; without it such a run is refused (resume=True continues it)
    progress: bool = True  # tqdm progress bar
    sample: bool = True  # print one short text sample from the final model
    # data
    data_dir: str = ""  # a data/prepare.py folder; "" -> the embedded corpus (prepared on first use)
    branch_data_fraction: float = 0.1  # tail of the train split held back for decay branches
    unique_tokens: int = 0  # > 0: train on the first this many tokens of the split only, reread for as many
    #   epochs as the run needs ([X] data-constrained: 100M unique tokens x 10 epochs); 0 -> all of it
    seed: int = 1337  # model init, data order, random passes
    # batch: one optimizer step reads batch_size * grad_accum * world_size sequences of block_size tokens
    batch_size: int = 16  # sequences per micro-batch per process
    grad_accum: int = 1  # micro-batches per optimizer step
    global_batch: int = 0  # > 0: sequences per step over all processes; grad_accum follows from the world size
    max_steps: int = 200  # optimizer steps of the whole run
    max_tokens: int = 0  # > 0: max_steps = ceil(max_tokens / tokens per step)
    stop_at_step: int = 0  # > 0: save and stop after this step without changing the schedule (preemption)
    # optimizer
    optimizer: str = "muon"  # "muon": Muon on hidden matrices + AdamW on the rest; "adamw": AdamW on all
    matrix_lr: float = 0.02  # Muon LR of the hidden matrices (attention, dense MLP, experts)
    adamw_matrix_lr: float = 3e-3  # AdamW LR of the hidden matrices when optimizer="adamw"
    embedding_lr: float = 0.1  # AdamW LR of the token embedding
    unembedding_lr: float = 0.004  # AdamW LR of the lm head
    router_lr: float = 3e-3  # AdamW LR of the MoE routers (always AdamW: see param_groups)
    scalar_lr: float = 0.01  # AdamW LR of norm gains and other vectors
    weight_decay: float = 0.0  # decoupled weight decay of the hidden matrices (Muon's "x" variant: cautious)
    embedding_weight_decay: float = 0.0  # decoupled weight decay of the token embedding ([X] code: the matrices')
    unembedding_weight_decay: float = 0.0  # decoupled weight decay of the lm head ([X] code: the matrices')
    adam_betas: tuple = (0.8, 0.95)  # AdamW (beta1, beta2)
    adam_eps: float = 1e-10  # AdamW epsilon
    muon_variant: str = "original"  # "original" (Keller Jordan's) or "x" (the [X] paper code's Muon, muon.py)
    muon_momentum: float = 0.95  # Muon momentum
    muon_momentum_warmup: int = 0  # steps over which Muon's momentum rises from 0.85 ([X] code: 300); 0 -> off
    muon_beta2: float = 0.95  # the "x" variant's variance-reduction EMA
    muon_nesterov: bool = True  # Nesterov momentum in Muon
    muon_ns_steps: int = 5  # Newton-Schulz steps per Muon update
    grad_clip: float = 1.0  # clip the global gradient norm to this; 0 -> off
    lr_anchor_params: int = 0  # [X16] every LR x (N / lr_anchor_params)^lr_scaling_beta, N = stored params
    #   at initialisation (token embedding included, as the [X] code); 0 -> off
    lr_scaling_beta: float = 0.0  # [X16] exponent of the LR scaling rule
    # WSD schedule [S]
    warmup_steps: int = 20  # linear LR warmup from 0
    decay_fraction: float = 0.3  # last fraction of max_steps decays; 0.0 -> stable to the end (branch later)
    decay_shape: str = "cosine"  # "cosine" or "linear"
    min_lr_fraction: float = 0.0  # the floor: LR at the last step = min_lr_fraction * peak LR
    # decay branches, resume: fork from a stable checkpoint, decay over decay_tokens on held-back data
    init_from: str = ""  # checkpoint to start from (weights, optimizer state, step, tokens, flops), as a new run
    decay_branch: bool = False  # this run is a decay branch of init_from [S]
    decay_tokens: int = 0  # tokens of the decay branch
    resume: bool = False  # continue out_dir/run_name/ckpt.pt
    # number of passes
    n_passes_choices: list = field(default_factory=list)  # e.g. [1, 2, 3]: each step runs K (or r) drawn
    #   uniformly, seeded by (seed, step)
    grow_at: float = 0.0  # growth step (>= 1) or fraction of max_steps (< 1); 0 -> no growth
    grow_to: int = 0  # passes after growth (K for pcc, r for smelt / layer_loop)
    grow_untie: bool = False  # untie the core at growth: copies C1 C2 -> C1 C2 C1 C2 (grow.py)
    grow_rewarm_steps: int = 0  # LR re-warm after growth: 0 at the growth step, linear to 1 ([X] code: 40)
    avg_doc_len: int = 0  # mean document length for the attention term of the logged FLOPs; 0 -> block_size
    # system
    device: str = "auto"  # "auto": cuda if available else cpu; or "cpu", "cuda", "cuda:1"
    dtype: str = "auto"  # "auto": bfloat16 autocast on CUDA, float32 on CPU; or "float32" / "bfloat16"
    cpu_threads: int = 0  # CPU: torch threads per process; 0 -> the cores the load leaves idle over this host's
    #   processes (OMP_NUM_THREADS, when set, decides instead); the header says what it picked
    compile: bool = False  # torch.compile the model
    triton: bool = False  # swap the Triton kernels into the model and Muon (kernels.apply); opt-in on every
    #   device until bench/gpu_check.sh has passed on a GPU
    collective_timeout_s: float = 600.0  # under torchrun: a collective waiting this long for a peer ends the
    #   run with one line (a stalled or dead process), instead of hanging
    parallel: str = "ddp"  # under torchrun: "ddp" (a full replica per process) or "fsdp" (FSDP2: weights,
    #   gradients and optimizer state sharded over the processes; checkpoints sharded too)
    reshard_after_forward: bool = True  # fsdp: free a block's gathered weights after every visit (ZeRO-3
    #   memory; a looped block is gathered once per visit), or keep them until its backward
    activation_checkpointing: bool = False  # keep only each executed block's input; recompute the rest in
    #   the backward (each visit of a looped block its own): far less activation memory, ~1/3 more compute

    def __post_init__(self):
        guards.check_train_config(self)


# the tiny default: a SMELT-looped MoE [S] (the middle 2 of 4 layers run twice, updates scaled by 1/2)
TINY_MODEL = dict(vocab_size=4096, eot_token=4095, block_size=128, n_layer=4, n_embd=128, n_head=4,
                  n_expert=8, top_k=2, layout="smelt", n_loops=2)
HELP_GROUPS = {title: keys.split() for title, keys in {  # --help shows these first; the rest follow
    "the settings a learner changes": "n_layer n_embd n_head n_expert top_k layout n_loops n_passes tie_core boundary "
    "boundary_alpha block_size optimizer matrix_lr embedding_lr unembedding_lr weight_decay warmup_steps "
    "decay_fraction max_steps batch_size grad_accum data_dir out_dir run_name eval_interval log_interval seed",
    "growth, random passes, decay branches, LR scaling": "grow_at grow_to grow_untie grow_rewarm_steps "
    "n_passes_choices init_from decay_branch decay_tokens branch_data_fraction unique_tokens save_steps max_tokens "
    "lr_anchor_params lr_scaling_beta",
    "distributed and precision": "global_batch device dtype cpu_threads parallel reshard_after_forward "
    "activation_checkpointing collective_timeout_s",
    "kernels and compilation": "triton compile", "reliability": "resume overwrite stop_at_step"}.items()}
SETTINGS = Settings(TrainConfig, ModelConfig, defaults=TINY_MODEL, groups=HELP_GROUPS, prog="train.py")
DEFAULTS = SETTINGS.defaults


# ----------------------------------------------------------------------------------------------------
# Optimizers: Muon (muon.py) for hidden matrices, AdamW for the rest


def param_groups(model, config):
    """Every parameter in exactly one named group: (name, optimizer kind, lr, weight decay, [(name, p)]).
    Muon takes the hidden matrices (2-D, and 3-D stacked experts). AdamW takes the token embedding,
    the lm head (their rows are per-token vectors, not operators between hidden states), norm gains
    and other vectors, and the MoE routers: a router's few rows set the routing logits' scale, which
    Muon's fixed spectral-norm steps would push around; AdamW keeps them small and adaptive."""
    muon = config.optimizer == "muon"
    groups = {
        "matrix": ("muon" if muon else "adamw", config.matrix_lr if muon else config.adamw_matrix_lr,
                   config.weight_decay),
        "embedding": ("adamw", config.embedding_lr, config.embedding_weight_decay),
        "unembedding": ("adamw", config.unembedding_lr, config.unembedding_weight_decay),
        "router": ("adamw", config.router_lr, 0.0),
        "scalar": ("adamw", config.scalar_lr, 0.0),
    }
    members = {name: [] for name in groups}
    for name, p in model.named_parameters():  # named_parameters() lists a tied weight once
        if not p.requires_grad:
            continue
        group = "embedding" if name.startswith("wte.") else "unembedding" if name.startswith("lm_head.") else \
            "router" if ".router." in name else "matrix" if p.dim() >= 2 else "scalar"
        members[group].append((name, p))
    return [(name, *groups[name], members[name]) for name in groups if members[name]]


def build_optimizers(model, config, ns_dtype=None):
    """[AdamW, Muon (if any)]; each group remembers base_lr and its parameters' names.
    ns_dtype: Muon's Newton-Schulz dtype (None: bf16 on CUDA, fp32 on CPU; see muon.orthogonalize)."""
    adamw, muon = [], []
    for name, kind, lr, wd, named in param_groups(model, config):
        group = dict(params=[p for _, p in named], param_names=[n for n, _ in named], name=name,
                     lr=lr, base_lr=lr, weight_decay=wd)
        (muon if kind == "muon" else adamw).append(group)
    optimizers = [torch.optim.AdamW(adamw, betas=tuple(config.adam_betas), eps=config.adam_eps, fused=False)]
    if muon:
        optimizers.append(Muon(muon, momentum=config.muon_momentum, nesterov=config.muon_nesterov,
                               ns_steps=config.muon_ns_steps, ns_dtype=ns_dtype, variant=config.muon_variant,
                               beta2=config.muon_beta2))
    return optimizers


def set_schedule(optimizers, multiplier, muon_momentum):
    """Every group's LR = its base LR x multiplier; Muon's momentum. Returns the hidden matrices' LR (logged)."""
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = group["base_lr"] * multiplier
            if isinstance(opt, Muon):
                group["momentum"] = muon_momentum
    return optimizers[-1].param_groups[0]["lr"]


# ----------------------------------------------------------------------------------------------------
# Schedule and accounting


def wsd_multiplier(step, warmup_steps, decay_start, decay_end, shape="cosine", floor=0.0):
    """Warmup-stable-decay [S]: linear warmup to 1, constant, then a decay reaching `floor` exactly at the
    last step (decay_end - 1): cosine from its first step on, or linear as the [X] code's warm-down (1 at
    decay_start, floor after decay_end - decay_start - 1 more steps)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if step < decay_start or decay_end <= decay_start:
        return 1.0
    if shape == "cosine":
        progress = min(1.0, (step - decay_start + 1) / (decay_end - decay_start))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    steps = decay_end - decay_start
    return 1 + (floor - 1) * (1.0 if steps == 1 else min(1.0, (step - decay_start) / (steps - 1)))


def lr_scaling(n_params, anchor_params, beta):
    """[X16] GLR(N) = GLR_anchor * (N / N_anchor)^beta, as a multiplier on every LR (1 when off)."""
    return 1.0 if anchor_params <= 0 else (n_params / anchor_params) ** beta


@dataclass
class Schedule:
    """The step numbers of a run and the LR multiplier of every step."""
    max_steps: int
    decay_start: int
    grow_step: Optional[int]  # None: no growth
    lr_scale: float  # [X16]
    config: TrainConfig

    def lr_multiplier(self, step):
        """WSD x [X16] scaling x re-warm after growth ([X] code: 0 at the growth step, linear back to 1)."""
        c = self.config
        multiplier = wsd_multiplier(step, c.warmup_steps, self.decay_start, self.max_steps, c.decay_shape,
                                    c.min_lr_fraction) * self.lr_scale
        return multiplier * (1.0 if self.grow_step is None else grow.rewarm_multiplier(step, self.grow_step,
                                                                                       c.grow_rewarm_steps))

    def muon_momentum(self, step):
        """Muon's momentum, rising linearly from 0.85 over muon_momentum_warmup steps ([X] code: 300)."""
        warmup, m = self.config.muon_momentum_warmup, self.config.muon_momentum
        return m if warmup <= 0 else 0.85 + (m - 0.85) * min(1.0, step / warmup)


def plan_schedule(config, state, tokens_per_step):
    """The run's Schedule; records in the state where its LR starts to decay (a decay branch forks before)."""
    if config.decay_branch:  # a branch decays over decay_tokens from the step it forked at
        max_steps = state.branch_start_step + math.ceil(config.decay_tokens / tokens_per_step)
        decay_start = state.branch_start_step
    else:
        max_steps = math.ceil(config.max_tokens / tokens_per_step) if config.max_tokens > 0 else config.max_steps
        decay_start = max(config.warmup_steps, max_steps - round(config.decay_fraction * max_steps))
    grow_step = grow.growth_step(max_steps, config.grow_at) if config.grow_at and not config.decay_branch else None
    lr_scale = lr_scaling(state.lr_scaling_params, config.lr_anchor_params, config.lr_scaling_beta)  # [X16]
    state.decay_start = decay_start
    return Schedule(max_steps, decay_start, grow_step, lr_scale, config)


def passes_of_step(config, step):
    """None (the model's own passes), or K drawn uniformly from n_passes_choices, seeded by (seed, step)."""
    if not config.n_passes_choices:
        return None
    return int(np.random.default_rng([config.seed, step, 1]).choice(config.n_passes_choices))


def flops_per_token(cfg, n_passes=None, avg_doc_len=0):
    """Training FLOPs per token of the executed plan (match.py); avg_doc_len 0: documents of block_size."""
    return float(match.flops_per_token(cfg, n_passes=n_passes, avg_doc_len=avg_doc_len or None))


# ----------------------------------------------------------------------------------------------------
# Evaluation


@torch.no_grad()
def evaluate(model, data, config, autocast=contextlib.nullcontext(), rank=0, world=1, final=False):
    """Token-weighted validation CE over config.eval_tokens (final_eval_tokens, when set, at the last step) of
    the val split (the same windows every eval, evenly spread over the split so every source is in; split
    across ranks), per source when sources exist, bits per byte (comparable across tokenizers), and router
    statistics for MoE. Every rank runs the same number of forwards (under FSDP each is a collective); a
    rank out of windows runs one it does not count."""
    device, n_sources = next(model.parameters()).device, len(data.source_names) if data.val_sources is not None else 0
    seq_len, batch_size = model.config.block_size, config.batch_size
    total = (len(data.val_tokens) - 1) // seq_len
    tokens = config.final_eval_tokens if final and config.final_eval_tokens else config.eval_tokens
    n_windows = max(1, min(tokens // seq_len, total))
    starts = np.linspace(0, total - 1, n_windows).round().astype(np.int64) * seq_len  # spread over all sources
    sums = torch.zeros(2, 1 + n_sources, dtype=torch.float64, device=device)  # CE sums, token counts
    router = sums.new_zeros(3)  # balance, z_loss, batches
    token_bytes, text = data.token_bytes.to(device), sums.new_zeros(2)  # [X] BPB: nats of text targets, their bytes
    expert_counts = sums.new_zeros(model.config.executed_layers(), model.config.n_expert)
    mine = list(range(rank, n_windows, world))
    was_training = model.training
    model.eval()
    for i in range(0, math.ceil(math.ceil(n_windows / world) / batch_size) * batch_size, batch_size):
        offsets = starts[mine[i:i + batch_size] or [0]]
        rows = to_device(windows(data.val_tokens, offsets, seq_len), device)
        x, y = rows[:, :-1], rows[:, 1:]
        with autocast:
            logits, _ = model(x, y)
        if i >= len(mine):  # a forward the other ranks need, not counted
            continue
        ce = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="none").double()
        sums[:, 0] += torch.stack([ce.sum(), torch.tensor(ce.numel(), dtype=torch.float64, device=device)])
        n_bytes = token_bytes[y.flatten()].double()  # no masked indexing: no host sync
        text += torch.stack([(ce * (n_bytes > 0)).sum(), n_bytes.sum()])
        if n_sources:
            src = to_device(np.stack([data.val_sources[o + 1:o + seq_len + 1] for o in offsets]), device)
            sums[0, 1:] += sums.new_zeros(n_sources).index_add_(0, src.flatten(), ce)
            sums[1, 1:] += torch.bincount(src.flatten(), minlength=n_sources).double()
        if "balance" in model.last_stats:
            stats = model.last_stats
            router += torch.stack([stats["balance"].double(), stats["z_loss"].double(), router.new_ones(())])
            expert_counts += stats["expert_counts"].double()
    model.train(was_training)
    sums, router, expert_counts, text = (distributed.all_reduce(t) if t.numel() else t
                                         for t in (sums, router, expert_counts, text))
    out = {"val_loss": (sums[0, 0] / sums[1, 0]).item(), "val_bpb": (text[0] / (math.log(2) * text[1])).item()}
    if n_sources:
        out["val_loss_by_source"] = {name: (sums[0, 1 + j] / sums[1, 1 + j]).item()
                                     for j, name in enumerate(data.source_names) if sums[1, 1 + j] > 0}
    if model.config.n_expert:
        fraction = expert_counts / expert_counts.sum(dim=-1, keepdim=True).clamp(min=1)
        balance, z_loss = (router[:2] / router[2].clamp(min=1)).tolist()
        out.update(balance=balance, z_loss=z_loss, expert_load_max=fraction.max().item(),
                   expert_load_min=fraction.min().item())
    return out


# ----------------------------------------------------------------------------------------------------
# The model: built (or loaded), sharded, its optimizers; growth mid-run


def prepare(model, config, device, world, use_bf16):
    """Shard the model (FSDP), build its optimizers, swap in the Triton kernels when asked."""
    model.activation_checkpointing = config.activation_checkpointing
    if config.parallel == "fsdp":  # bf16 gathered copies of the blocks' fp32 weights on CUDA
        bf16 = torch.bfloat16 if use_bf16 and device.type == "cuda" else None
        distributed.shard(model, device, world, bf16, config.reshard_after_forward)
    optimizers = build_optimizers(model, config, ns_dtype=torch.bfloat16 if use_bf16 else torch.float32)
    if config.triton:
        kernels.apply(model, optimizers)
    return optimizers


def build_model(config, model_config, source, device, world, region, use_bf16):
    """The model, its optimizers and the training state: fresh, or from the source checkpoint (a ckpt.pt
    file: whole tensors, sharded as they load; a ckpt.dcp/ directory: loaded shard by shard)."""
    torch.manual_seed(config.seed)
    model = GPT(model_config).to(device)
    if source is not None and not source.get("sharded"):
        model.load_state_dict(source["model"])
    optimizers = prepare(model, config, device, world, use_bf16)
    if source is None:
        return model, optimizers, TrainState(data_region=region, lr_scaling_params=grow.stored_params(model_config))
    checkpoint.load_into(source, model, optimizers)
    state = TrainState(**source["state"])
    if state.data_region != region:  # a fork that reads another region starts at its beginning
        state.data_region, state.data_position = region, 0
    if config.decay_branch and not config.resume:  # a fresh branch from a stable checkpoint
        state.branch_start_step, state.last_eval = state.step, None
    if config.resume:
        torch.set_rng_state(source["rng"]["torch"])
    return model, optimizers, state


def grow_during_training(model, optimizers, config, state, device, world, use_bf16, log=print):
    """[X] growth: more passes (tied) or copied cores (untied); optimizers rebuilt with every parameter's
    state carried over by name (grow.copy_optimizer_state decides what copies get). Returns the model
    (grown in place; under FSDP a grown copy of the gathered model, sharded again), its optimizers and the
    module the step calls (distributed.wrap); the state records the growth."""
    saved = checkpoint.optimizer_state_by_name(optimizers)["state"]
    if distributed.is_sharded(model):  # grow the whole model, then shard it again
        weights = distributed.full_state(model.state_dict())
        saved = {name: distributed.full_state(s) for name, s in saved.items()}
        model = GPT(model.config).to(device)
        model.load_state_dict(weights)
    param_map = grow.grow(model, config.grow_to, config.grow_untie)
    optimizers = prepare(model, config, device, world, use_bf16)
    checkpoint.load_optimizer_state(optimizers, grow.copy_optimizer_state(saved, param_map))
    log(f"grew to {model.config.passes} passes{'' if model.config.tie_core else ' (untied)'}")
    state.grown = True
    return model, optimizers, distributed.wrap(model, device, world, config)


# ----------------------------------------------------------------------------------------------------
# Training


def train(overrides=None):
    """One run in this process: overrides {setting: value} over the defaults (or the checkpoint's) -> its summary."""
    values, source, notes = rundir.resolve_run(SETTINGS, dict(overrides or {}))
    config, model_config = SETTINGS.build(TrainConfig, values), SETTINGS.build(ModelConfig, values)
    rank, world, device = distributed.setup(config.device, config.parallel, config.collective_timeout_s)
    guards.derive_grad_accum(config, world, source)  # global_batch: the same step on any number of processes
    use_bf16, autocast, compute_note = distributed.compute(config, device)  # on a CPU: its thread count too
    grown = guards.check_run(model_config, config, source, device)
    defer_sync, memory_note = memory.check_memory(grow.shapes_of_run(model_config, config, grown), config, device,
                                                  use_bf16, world)
    run = RunDir.of(config, rank, world)
    log, state = tqdm.write if rank == 0 else (lambda *args: None), None
    with run.hold(config.resume and source, config.overwrite), run.on_interrupt(lambda: state.step if state else 0):
        data = open_data(config.data_dir, model_config, world, rank == 0)
        tokenizer = data_tokenizer(data.meta, data.data_dir, model_config)  # checked now, sampled with at the end
        stream = data.stream(model_config.block_size, config.seed, config.branch_data_fraction, config.decay_branch,
                             config.unique_tokens)
        model, optimizers, state = build_model(config, model_config, source, device, world, stream.name, use_bf16)
        distributed.agree("data, step", dict(data=data.fingerprint, tokens=len(data.train_tokens), step=state.step))
        wrapped = distributed.wrap(model, device, world, config)
        seqs_per_step = config.batch_size * config.grad_accum * world
        tokens_per_step = seqs_per_step * model_config.block_size
        schedule = plan_schedule(config, state, tokens_per_step)
        guards.check_plan(config, source, state, schedule, stream, seqs_per_step, plan_schedule, log)
        log(rundir.run_header(run, model, data, stream, state.step, tokens_per_step, schedule.max_steps, world, device,
                              use_bf16, [*notes, compute_note, memory_note]))
        t0, first_position, losses, window, passes_seen, unread = time.time(), state.data_position, [], [], [], []
        if source is None:  # the eval at step 0, logged with the first checkpoint
            state.last_eval = run.append_log(state.record(lr=0.0, train_loss=None, **evaluate(
                model, data, config, autocast, rank, world), epochs=0.0, n_passes=model.config.passes,
                seconds=round(time.time() - t0, 3), **rundir.gpu_memory(device)), wait_for_checkpoint=True)
        with tqdm(total=schedule.max_steps, initial=state.step, disable=not (rank == 0 and config.progress),
                  desc=config.run_name, unit="step", dynamic_ncols=True) as bar:
            while state.step < schedule.max_steps:
                if state.step == schedule.grow_step and not state.grown:  # [X] growth, once
                    model, optimizers, wrapped = grow_during_training(model, optimizers, config, state, device, world,
                                                                      use_bf16, log)
                lr = set_schedule(optimizers, schedule.lr_multiplier(state.step), schedule.muon_momentum(state.step))
                n_passes = passes_of_step(config, state.step)  # None: the model's own K (or r)
                unread.append(torch.zeros(2, dtype=torch.float64, device=device))  # the step's (CE, loss), read later
                for micro in range(config.grad_accum):  # rank r reads its own slice of the global batch
                    x, y = stream.batch(state.data_position + (rank * config.grad_accum + micro) * config.batch_size,
                                        config.batch_size, device)
                    last = micro == config.grad_accum - 1
                    with distributed.no_sync(wrapped, model, skip=world > 1 and not last and defer_sync), autocast:
                        loss = wrapped(x, y, n_passes=n_passes)[1]  # the logits not kept through the backward
                        (loss / config.grad_accum).backward()
                    unread[-1] += torch.stack([model.last_stats["ce"], loss.detach()]).double() / config.grad_accum
                if config.grad_clip > 0:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
                for opt in optimizers:
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                k, flops = n_passes or model.config.passes, flops_per_token(model.config, n_passes, config.avg_doc_len)
                state.advance(tokens_per_step, seqs_per_step, flops * tokens_per_step, k)
                passes_seen.append(k)
                bar.update(1)
                at_eval = state.step % config.eval_interval == 0 or state.step in (schedule.max_steps,
                                                                                   config.stop_at_step)
                if at_eval or state.step in config.save_steps or state.step % config.log_interval == 0:
                    read, unread = guards.read_losses(unread, state.step, world), []  # non-finite: refused here
                    losses, window = losses + read, window + read
                    bar.set_postfix(loss=f"{read[-1]:.3f}", lr=f"{lr:.2e}")
                if at_eval:
                    state.last_eval = state.record(
                        lr=lr, train_loss=sum(window) / len(window),
                        **evaluate(model, data, config, autocast, rank, world, final=state.step == schedule.max_steps),
                        epochs=state.data_position / stream.n_windows, n_passes=sum(passes_seen) / len(passes_seen),
                        seconds=round(time.time() - t0, 3), **rundir.gpu_memory(device))
                    run.save(checkpoint.training_checkpoint(model, optimizers, config, state, **data.provenance))
                    run.append_log(state.last_eval)  # the checkpoint first, then its log line
                    window, passes_seen = [], []
                    bar.set_postfix(loss=f"{losses[-1]:.3f}", val=f"{state.last_eval['val_loss']:.3f}")
                if state.step in config.save_steps:
                    run.save(checkpoint.training_checkpoint(model, optimizers, config, state, **data.provenance),
                             run.step_path(state.step))
                if state.step == config.stop_at_step:
                    break
        return finish(run, model, optimizers, config, state, data, stream, schedule, losses, first_position, t0, world,
                      tokenizer)


def finish(run, model, optimizers, config, state, data, stream, schedule, losses, first_position, t0, world,
           tokenizer):
    """After the loop: the summary (and an FSDP run's consolidated ckpt.pt), then a sample of the model."""
    summary, final_model = run.finish(model, optimizers, config, state, data, stream, schedule.max_steps, losses,
                                      first_position, time.time() - t0, world)
    if run.master and config.sample and run.saving and tokenizer is not None and final_model is not None:
        text = sample_text(final_model, tokenizer, max_new_tokens=64, temperature=0.8, top_k=200, seed=config.seed)
        print(f"sample (more with: python sample.py --ckpt {run.ckpt_path}):\n{text}")
    return summary


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(SETTINGS.help())
        return 0
    return rundir.run_cli("train.py", lambda: train(SETTINGS.parse(argv)))  # one line however it ends


if __name__ == "__main__":
    distributed.exit(main())
