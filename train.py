"""
Train one model: Muon + AdamW, a warmup-stable-decay (WSD) schedule with decay branches [S],
growth of the passes mid-training [X], DDP or FSDP2, exact resume.

    python train.py                                     # the tiny default, minutes on a CPU
    python train.py config/x_d8_loop2.py --max_steps=5  # a config file, then --key=value
    python train.py --out_dir=out/tiny --init_from=resume                      # continue a run
    python train.py --init_from=out/tiny/ckpt_step100.pt --decay_tokens=40000  # a decay branch
    torchrun --standalone --nproc_per_node=8 train.py config/x_d8_vanilla.py   # one node (DDP)
    torchrun --nnodes=2 --node_rank=0 --nproc_per_node=8 --master_addr=HOST train.py config/NAME.py

A run writes out_dir/ckpt.pt (FSDP: ckpt.dcp/, and ckpt.pt at the end) and log.jsonl, a JSON
line per eval. `train.train({"max_steps": 100})` runs in-process and returns a summary.
"""

import contextlib
import inspect
import json
import math
import os
import shutil
import signal
import sys
import textwrap
import threading
import time
from dataclasses import dataclass, fields

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

import configurator
import grow
import match
from data.loader import BRANCH_FRACTION, load_data
from loss_eval import evaluate
from model import (
    GPT,
    MLP,
    TINY,
    BoundaryOperator,
    ModelConfig,
    MoE,
    RMSNorm,
    execution_plan,
    load_checkpoint,
)
from muon import Muon

# Settings: these, the model's, and the tiny default. --help prints the comment above each.


@dataclass
class TrainConfig:
    # The run's folder.
    out_dir: str = "out/tiny"
    # A data/prepare.py folder; "" -> the embedded corpus.
    data_dir: str = ""
    # Seeds the init, data order and random passes.
    seed: int = 1337
    # Optimizer steps in all.
    max_steps: int = 200
    # Sequences per micro-batch per process.
    batch_size: int = 16
    # Sequences per step on all processes; 0 -> batch_size x processes.
    global_batch: int = 0
    # An eval, a checkpoint and a log line every this many steps and at the end.
    eval_interval: int = 50
    # Validation tokens per eval (the same windows each time).
    eval_tokens: int = 8192
    # Extra checkpoints ckpt_step<N>.pt, for decay branches to fork from.
    save_steps: list = ()
    # muon: Muon on the hidden matrices, AdamW on the rest. muon_x: the [X] code's recipe
    # (momentum warmup, linear warm-down, no clipping). adamw: AdamW on all.
    optimizer: str = "muon"
    # LR of the hidden matrices; 0 -> 0.02 with Muon, 3e-3 with AdamW.
    matrix_lr: float = 0.0
    # AdamW LR of the token embedding.
    embedding_lr: float = 0.1
    # AdamW LR of the lm head.
    unembedding_lr: float = 0.004
    # Decoupled decay of the matrices, embedding and lm head.
    weight_decay: float = 0.0
    # Steps of linear LR warmup.
    warmup_steps: int = 20
    # The fraction of max_steps that decays at the end; 0 -> stable (branch later).
    decay_fraction: float = 0.3
    # resume continues out_dir; a ckpt.pt or ckpt_step<N> starts a new run from it.
    init_from: str = ""
    # With init_from=<checkpoint>, a decay branch [S] of so many tokens.
    decay_tokens: int = 0
    # For example [1, 2, 3]: each step draws its K (or r) from these.
    n_passes_choices: list = ()
    # [X] growth to twice the passes at this step (>= 1) or fraction of max_steps (< 1).
    grow_at: float = 0.0
    # Under torchrun: ddp or fsdp (FSDP2). fsdp_grad_op keeps each block gathered from forward
    # to backward: fewer all-gathers, more memory. hsdp and hsdp_grad_op shard within a node and
    # replicate across nodes.
    parallel: str = "ddp"
    # torch.compile each block and the loss on CUDA.
    compile: bool = True
    # The Triton kernels in the model and Muon (kernels/, opt-in).
    triton: bool = False
    # Log the evals to Weights & Biases.
    wandb_log: bool = False
    wandb_project: str = "loopstudy"
    # The wandb run's name; "" -> out_dir.
    wandb_run_name: str = ""

    def __post_init__(self):
        # (holds, setting, why): the first that fails is the error.
        parallels = ("ddp", "fsdp", "fsdp_grad_op", "hsdp", "hsdp_grad_op")
        positive = ("max_steps", "batch_size", "eval_interval", "eval_tokens")
        non_negative = (
            "global_batch", "seed", "matrix_lr", "embedding_lr", "unembedding_lr",
            "weight_decay", "warmup_steps", "decay_tokens", "grow_at",
        )
        rules = [(getattr(self, n) >= 1, n, "must be >= 1") for n in positive]
        rules += [(getattr(self, n) >= 0, n, "must be >= 0") for n in non_negative]
        rules += [
            (0 <= self.decay_fraction <= 1, "decay_fraction", "must be in [0, 1]"),
            (all(s >= 1 for s in self.save_steps), "save_steps", "each must be a step >= 1"),
            (all(k >= 1 for k in self.n_passes_choices), "n_passes_choices", "each must be >= 1"),
            (self.optimizer in MATRIX_LR, "optimizer", f"must be one of {', '.join(MATRIX_LR)}"),
            (self.parallel in parallels, "parallel", f"must be one of {', '.join(parallels)}"),
        ]
        for holds, name, why in rules:
            if not holds:
                raise ValueError(f"{name}={getattr(self, name)!r}: {why}")


MODEL_SETTINGS = (
    "block_size n_layer n_embd n_head n_kv_head head_dim n_expert top_k expert_hidden layout "
    "n_passes boundary boundary_alpha norms residual_multiplier output_multiplier init "
    "embed_init_std uniform_init_scale"
).split()
DEFAULTS = {
    **{k: ModelConfig.__dataclass_fields__[k].default for k in MODEL_SETTINGS},
    **{f.name: f.default for f in fields(TrainConfig)},
    **TINY,
}
DEFAULTS.update(save_steps=[], n_passes_choices=[])

ADAM_BETAS, ADAM_EPS = (0.8, 0.95), 1e-10
# What matrix_lr=0 means, by optimizer.
MATRIX_LR = {"muon": 0.02, "muon_x": 0.02, "adamw": 3e-3}
# AdamW's LRs of the MoE routers, and of norm gains and other vectors.
ROUTER_LR, SCALAR_LR = 3e-3, 0.01
MUON_MOMENTUM = 0.95
# [X] code: momentum 0.85 -> 0.95 over the first 300 of d8's 2,355 steps.
X_MOMENTUM_WARMUP = 300 / 2355
# [X] code: the LR re-warms over 40 steps after growth (of d8 Loop-Grow's 2,563).
X_REWARM = 40 / 2563
# The losses come to the host every so many steps.
LOG_INTERVAL = 10
# MFU's denominator: dense bf16 FLOP/s from the vendors' sheets.
PEAK_FLOPS = {"H100 PCIe": 756e12, "H100": 989e12, "H200": 989e12, "A100": 312e12, "B200": 2250e12}


def peak_flops(device):
    """The GPU's dense bf16 FLOP/s (PEAK_FLOPS); None on a CPU or an unknown GPU."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    return next((flops for key, flops in PEAK_FLOPS.items() if key in name), None)


def settings_help(cls, names):
    """`name: type = default  # the comment above or after it`, for each field in `names`."""
    rows, above = [], []
    for text in (line.strip() for line in inspect.getsource(cls).splitlines()):
        if text.startswith("#"):
            above.append(text[1:].strip())
        else:
            code, _, note = text.partition("  # ")
            note = " ".join(above + [note]).strip()
            if code.split(":")[0] in names:
                row = f"{code}  # {note}" if note else code
                row = textwrap.fill(row, 100, initial_indent="    ", subsequent_indent="    #   ")
                rows.append(row)
            above = []
    return rows


# Optimizers: Muon for the hidden matrices, AdamW for the rest.


def param_groups(model, config):
    """Every parameter in one group: (name, optimizer, lr, weight decay, [(name, p)])."""
    lr = config.matrix_lr or MATRIX_LR[config.optimizer]
    # AdamW takes the embedding and lm head (their rows are per-token vectors), the norm gains,
    # and the routers, whose logits' scale Muon's fixed-norm steps would push around.
    groups = {
        "matrix": (config.optimizer, lr, config.weight_decay),
        "embedding": ("adamw", config.embedding_lr, config.weight_decay),
        "unembedding": ("adamw", config.unembedding_lr, config.weight_decay),
        "router": ("adamw", ROUTER_LR, 0.0),
        "scalar": ("adamw", SCALAR_LR, 0.0),
    }
    members = {name: [] for name in groups}
    for name, p in model.named_parameters():
        if name.startswith("wte."):
            group = "embedding"
        elif name.startswith("lm_head."):
            group = "unembedding"
        elif ".router." in name:
            group = "router"
        else:
            group = "matrix" if p.dim() >= 2 else "scalar"
        members[group].append((name, p))
    return [(name, *groups[name], members[name]) for name in groups if members[name]]


def build_optimizers(model, config, bf16):
    """[AdamW, Muon (if any)]; each group keeps its base_lr and its parameters' names."""
    adamw, muon = [], []
    for name, kind, lr, wd, named in param_groups(model, config):
        group = dict(
            params=[p for _, p in named],
            param_names=[n for n, _ in named],
            name=name,
            lr=lr,
            base_lr=lr,
            weight_decay=wd,
        )
        (adamw if kind == "adamw" else muon).append(group)
    # Fused: one kernel, no fp32 copy of a whole group as foreach makes.
    optimizers = [torch.optim.AdamW(adamw, betas=ADAM_BETAS, eps=ADAM_EPS, fused=bf16)]
    if muon:
        variant = "x" if config.optimizer == "muon_x" else "original"
        ns_dtype = torch.bfloat16 if bf16 else torch.float32
        optimizers.append(Muon(muon, momentum=MUON_MOMENTUM, ns_dtype=ns_dtype, variant=variant))
    # Opt-in until bench/gpu_check.sh has passed on a GPU.
    if config.triton:
        import kernels

        kernel_of = {RMSNorm: kernels.RMSNormKernel, MLP: kernels.MLPKernel, MoE: kernels.MoEKernel}
        kernel_of[BoundaryOperator] = kernels.BoundaryOperatorKernel
        kernels.apply(model, kernel_of, optimizers)
    return optimizers


# The schedule.


def wsd_multiplier(step, warmup_steps, decay_start, decay_end, shape="cosine"):
    """Warmup-stable-decay [S]: a linear warmup, constant, then a cosine (or linear, the [X]
    code's) decay to 0 at the last step."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if step < decay_start or decay_end <= decay_start:
        return 1.0
    if shape == "cosine":
        progress = min(1.0, (step - decay_start + 1) / (decay_end - decay_start))
        return 0.5 * (1 + math.cos(math.pi * progress))
    steps = decay_end - decay_start
    return 1 - (1.0 if steps == 1 else min(1.0, (step - decay_start) / (steps - 1)))


def plan_schedule(config, tokens_per_step, branch_start=None):
    """(max_steps, decay_start, grow_step). A branch decays over decay_tokens from its fork."""
    if branch_start is not None:
        max_steps = branch_start + math.ceil(config.decay_tokens / tokens_per_step)
        return max_steps, branch_start, None
    decay_steps = round(config.decay_fraction * config.max_steps)
    decay_start = max(config.warmup_steps, config.max_steps - decay_steps)
    grow_step = grow.growth_step(config.max_steps, config.grow_at) if config.grow_at else None
    return config.max_steps, decay_start, grow_step


def lr_multiplier(config, step, max_steps, decay_start, grow_step):
    """WSD [S], times the linear re-warm after growth ([X] code)."""
    shape = "linear" if config.optimizer == "muon_x" else "cosine"
    m = wsd_multiplier(step, config.warmup_steps, decay_start, max_steps, shape)
    if grow_step is not None and step >= grow_step:
        m *= min(1.0, (step - grow_step) / max(1, round(X_REWARM * max_steps)))
    return m


def muon_momentum(config, step, max_steps):
    """0.95, or with muon_x the [X] code's warmup from 0.85."""
    warmup = round(X_MOMENTUM_WARMUP * max_steps) if config.optimizer == "muon_x" else 0
    if warmup <= 0:
        return MUON_MOMENTUM
    return 0.85 + (MUON_MOMENTUM - 0.85) * min(1.0, step / warmup)


def passes_of_step(config, step):
    """None (the model's own K or r), or one of n_passes_choices drawn seeded by (seed, step)."""
    if not config.n_passes_choices:
        return None
    return int(np.random.default_rng([config.seed, step, 1]).choice(config.n_passes_choices))


# Checkpoints: model, optimizers (keyed by parameter name), settings and state, each written to a
# temporary name, then renamed.


def save_checkpoint(path, model, optimizers, settings, state, tokenizer, sharded):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizers)
    meta = dict(
        model_config=model.config.to_dict(),
        config=settings,
        state=state,
        tokenizer=tokenizer,
        rng=torch.get_rng_state(),
    )
    master, tmp = not dist.is_initialized() or dist.get_rank() == 0, path + ".tmp"
    # Sharded: each rank writes its shards (DCP); rank 0 the rest, and renames.
    if sharded:
        import torch.distributed.checkpoint as dcp

        if master:
            shutil.rmtree(tmp, ignore_errors=True)
        dist.barrier()
        dcp.save({"model": model_sd, "optimizers": optim_sd}, checkpoint_id=tmp)
        if master:
            torch.save(meta, os.path.join(tmp, "meta.pt"))
            shutil.rmtree(path, ignore_errors=True)
            os.replace(tmp, path)
        dist.barrier()
    elif master:
        torch.save(dict(meta, model=model_sd, optimizers=optim_sd), tmp)
        os.replace(tmp, path)


def read_checkpoint(path):
    """A ckpt.dcp/'s meta, or what model.py's loader reads from a ckpt.pt or an export."""
    if os.path.isfile(os.path.join(path, "meta.pt")):
        return dict(torch.load(os.path.join(path, "meta.pt"), weights_only=True), dcp=path)
    model, info = load_checkpoint(path)
    return dict(dict(config={}, state={}), **info, model=model.state_dict())


def load_state(source, model, optimizers):
    """Weights and optimizer state into a built model; DCP re-shards onto any world size."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    model_sd, optim_sd = source.get("model"), source.get("optimizers")
    if "dcp" in source:
        import torch.distributed.checkpoint as dcp

        model_sd, optim_sd = get_state_dict(model, optimizers)
        dcp.load({"model": model_sd, "optimizers": optim_sd}, checkpoint_id=source["dcp"])
    options = StateDictOptions(full_state_dict="dcp" not in source)
    # Weights only: fresh optimizers.
    if optim_sd is None:
        set_model_state_dict(model, model_sd, options=options)
    else:
        set_state_dict(
            model,
            optimizers,
            model_state_dict=model_sd,
            optim_state_dict=optim_sd,
            options=options,
        )


# The model: built whole or sharded, grown, compiled, wrapped.


def shard(model, config, bf16):
    """FSDP2 on each stored block, then the root. HSDP shards within a node, replicates across."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy()
    if bf16:
        policy = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False
        )
    mesh, shards = None, dist.get_world_size()
    if config.parallel.startswith("hsdp"):
        from torch.distributed.device_mesh import init_device_mesh

        shards = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        mesh = init_device_mesh(
            "cuda" if bf16 else "cpu",
            (dist.get_world_size() // shards, shards),
            mesh_dim_names=("replicate", "shard"),
        )
    # grad_op keeps a block gathered from forward to backward. A looped block's gradients
    # accumulate over its visits, then reduce once.
    gather_once = config.parallel.endswith("grad_op")
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=not gather_once)
    fully_shard(model, mesh=mesh)
    # Recompute each block in the backward where match.py's planner says the activations do not
    # fit this GPU. A CPU run rehearses the large-model path: it always recomputes.
    model.activation_checkpointing = True
    if torch.cuda.is_available():
        mode = "fsdp_grad_op" if gather_once else "fsdp"
        gpu = torch.cuda.get_device_properties(torch.cuda.current_device())
        plan = match.memory_plan(
            model.config,
            shards,
            config.batch_size,
            config.optimizer,
            gpu.total_memory / match.GIB,
            checkpointing=False,
        )
        model.activation_checkpointing = not plan[mode]["fits"]
    return model


def build_model(model_config, config, bf16, device, sharded):
    """The model drawn on `device`. FSDP2 builds it on the meta device, shards it, then draws
    each parameter whole and keeps this rank's shard, as torchtitan."""
    with torch.device("meta" if sharded else device):
        model = GPT(model_config)
    if sharded:
        model = shard(model, config, bf16)
        model.to_empty(device=device)
        model.reset_parameters()
    return model


def grow_model(model, optimizers, config, bf16, device, sharded):
    """[X] growth: (the model with twice the passes, its optimizers), the state kept by name.
    Sharded, each rank copies its own shards."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=not sharded, strict=False)
    saved = get_optimizer_state_dict(model, optimizers, options=options)
    if sharded:
        with torch.device("meta"):
            grown = GPT(model.config)
            param_map = grow.grow(grown, 2 * model.config.n_passes)
            grown = GPT(grown.config)
        grown = shard(grown, config, bf16)
        grown.to_empty(device=device)
        source = dict(model.named_parameters())
        with torch.no_grad():
            grown.rope_cos.copy_(model.rope_cos)
            grown.rope_sin.copy_(model.rope_sin)
            for name, p in grown.named_parameters():
                p.to_local().copy_(source[param_map[name]].to_local())
    else:
        grown = GPT(model.config)
        grown.load_state_dict(model.state_dict())
        param_map = grow.grow(grown, 2 * model.config.n_passes)
        grown = grown.to(device)
    optimizers = build_optimizers(grown, config, bf16)
    saved["state"] = grow.copy_optimizer_state(saved["state"], param_map)
    fresh = get_optimizer_state_dict(grown, optimizers, options=options)
    saved["param_groups"] = fresh["param_groups"]
    set_optimizer_state_dict(grown, optimizers, saved, options=options)
    # A copy starts fresh (reading the state dict gave it a step).
    copied = set(grow.copied_names(param_map))
    copies = [p for name, p in grown.named_parameters() if name in copied]
    for opt in optimizers:
        for p in copies:
            opt.state.pop(p, None)
    return grown, optimizers


def compile_blocks(model, backend="inductor"):
    """torch.compile each block's forward (FSDP2's hooks outside, as torchtitan) and the loss."""
    for block in model.blocks:
        block.forward = torch.compile(block.forward, fullgraph=True, backend=backend)
    model.cross_entropy = torch.compile(model.cross_entropy, fullgraph=True, backend=backend)


def wrap(model, config, world, device):
    """The module a step calls: compiled on CUDA, then DDP with several processes."""
    if config.compile and device.type == "cuda":
        compile_blocks(model)
    if world > 1 and config.parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        # Random passes may leave an untied core without a gradient: DDP is told.
        every_block = set(range(model.config.n_blocks))
        unused = any(
            {s.block for s in execution_plan(model.config, k) if s.kind == "block"} != every_block
            for k in config.n_passes_choices
        )
        device_ids = [device.index] if device.type == "cuda" else None
        model = DistributedDataParallel(model, device_ids=device_ids, find_unused_parameters=unused)
    return model


def shared_folder_or_refuse(out_dir, master, device):
    """On several nodes every rank writes the run's shards: each must see what rank 0 writes."""
    probe = os.path.join(out_dir, ".shared")
    if master:
        open(probe, "w").close()
    dist.barrier()
    missing = torch.tensor([float(not os.path.exists(probe))], device=device)
    dist.all_reduce(missing)
    if master:
        os.remove(probe)
    if missing.item():
        raise ValueError(
            f"out_dir={out_dir}: {int(missing.item())} processes do not see what rank 0 writes "
            "there; on several nodes the run folder must be one shared folder"
        )


# Training.


def resolve_settings(overrides):
    """(settings, source checkpoint or None, its path, is it a new decay branch)."""
    overrides = {k: configurator.checked(DEFAULTS, k, v) for k, v in overrides.items()}
    init_from = overrides.get("init_from", "")
    out_dir = overrides.get("out_dir", DEFAULTS["out_dir"])
    path = init_from
    if init_from == "resume":
        candidates = (f"{out_dir}/ckpt.dcp", f"{out_dir}/ckpt.pt")
        path = next((p for p in candidates if os.path.exists(p)), "")
        if not path:
            raise ValueError(f"init_from=resume: no checkpoint in {out_dir}")
    source = read_checkpoint(path) if path else None
    # A fork is a branch only if it says so.
    inherited = {}
    if source:
        inherited = dict(source["config"])
        if init_from != "resume":
            inherited["decay_tokens"] = 0
    settings = {**DEFAULTS, **inherited, "init_from": "", **overrides}
    branch = init_from not in ("", "resume") and settings["decay_tokens"] > 0
    if branch and "out_dir" not in overrides:
        run_dir = os.path.dirname(os.path.abspath(path))
        settings["out_dir"] = f"{run_dir}_decay{source['state']['step']}"
    # The model keeps the checkpoint's shape (growth may have changed it).
    if source:
        saved = source["model_config"]
        changed = [k for k in MODEL_SETTINGS if overrides.get(k, saved[k]) != saved[k]]
        if changed:
            raise ValueError(
                f"{changed[0]}: a resumed or forked model keeps its checkpoint's shape"
            )
        settings.update({k: saved[k] for k in MODEL_SETTINGS})
    return settings, source, path, branch


def train(overrides=None, model_fields=None):
    """One run: {setting: value} over the defaults -> its summary. model_fields: ModelConfig
    fields no setting names (a ladder's loop_scale)."""
    # Settings. A run never writes into another run's folder.
    settings, source, source_path, branch = resolve_settings(overrides or {})
    resume = (overrides or {}).get("init_from") == "resume"
    config = TrainConfig(**{k: settings[k] for k in DEFAULTS if k not in MODEL_SETTINGS})
    ckpt_path = os.path.join(config.out_dir, "ckpt.dcp" if config.parallel != "ddp" else "ckpt.pt")
    log_path = os.path.join(config.out_dir, "log.jsonl")
    if not resume and os.path.exists(log_path):
        raise ValueError(
            f"{config.out_dir} holds a run: continue it with --init_from=resume, or give "
            "another --out_dir"
        )

    # Processes: torchrun's, or this one. A GPU if there is one, with bf16 autocast.
    world = int(os.environ.get("WORLD_SIZE", 1))
    rank, local_rank = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    sharded, master, bf16 = config.parallel != "ddp", rank == 0, device.type == "cuda"
    if bf16:
        # As match.py's planner assumes.
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        torch.cuda.set_device(device)
    # Gloo lacks gather and all-gather of CUDA tensors.
    backend = "cpu:gloo,cuda:nccl" if bf16 else "gloo"
    if not dist.is_initialized() and world > 1:
        dist.init_process_group(backend)
    elif not dist.is_initialized() and sharded:
        # FSDP2 in one process: a one-rank group.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    # Kept in the settings: a resume on any world size steps alike.
    if not config.global_batch:
        config.global_batch = settings["global_batch"] = config.batch_size * world
    grad_accum = config.global_batch // (config.batch_size * world)
    if grad_accum * config.batch_size * world != config.global_batch:
        raise ValueError(
            f"global_batch={config.global_batch} is not a multiple of batch_size x processes = "
            f"{config.batch_size * world}"
        )

    # Data. Its tokenizer sets a new model's vocabulary.
    data = load_data(config.data_dir)
    n_vocab, tokenizer = data.meta["n_vocab"], data.meta["tokenizer"]
    if source and source["tokenizer"] != tokenizer:
        raise ValueError(
            f"{config.data_dir or 'the embedded corpus'} is in tokenizer {tokenizer}, the "
            f"checkpoint's model in {source['tokenizer']}"
        )
    # [X] pads GPT-2's 50,257 to 50,304: pad where it costs < 1%.
    padded = 64 * math.ceil(n_vocab / 64)
    vocab_size = padded if padded <= 1.01 * n_vocab else n_vocab
    if source:
        model_config = ModelConfig(**source["model_config"])
    else:
        model_config = ModelConfig(
            vocab_size=vocab_size,
            eot_token=data.meta["eot_token"],
            n_logits=n_vocab * (vocab_size > n_vocab),
            **{k: settings[k] for k in MODEL_SETTINGS},
            **(model_fields or {}),
        )
    if any(k > model_config.most_passes for k in config.n_passes_choices):
        raise ValueError(
            f"n_passes_choices={config.n_passes_choices}: each must be in [1, "
            f"{model_config.most_passes}], the passes this model runs"
        )
    in_branch = branch or resume and source["state"].get("branch_start") is not None
    stream = data.stream(model_config.block_size, config.seed, branch=in_branch)
    # For the logged attention FLOPs.
    avg_doc_len = min(data.meta["mean_doc_len"], model_config.block_size)

    # The model and optimizers, fresh or a checkpoint's. The window holds the losses since the
    # last eval, and passes their K.
    torch.manual_seed(config.seed)
    model = build_model(model_config, config, bf16, device, sharded)
    optimizers = build_optimizers(model, config, bf16)
    state = dict(
        step=0,
        tokens=0,
        flops=0.0,
        flops_by_passes={},
        data_position=0,
        branch_start=None,
        grown=False,
        window=[],
        passes=[],
    )
    if source:
        load_state(source, model, optimizers)
        state.update(source["state"])
        if resume:
            torch.set_rng_state(source["rng"])
        elif branch:
            # A decay branch [S] forks a stable step and reads the held-back data from its start.
            if state["step"] > state.get("decay_start", state["step"]):
                raise ValueError(
                    f"{source_path} is at step {state['step']}, where its LR already decays: a "
                    "decay branch forks from a stable checkpoint"
                )
            state.update(data_position=0, branch_start=state["step"])
        # A fork may change the LRs and decays.
        planned = {name: (lr, wd) for name, _, lr, wd, _ in param_groups(model, config)}
        for opt in optimizers:
            for group in opt.param_groups:
                group["base_lr"], group["weight_decay"] = planned[group["name"]]
    step_model = wrap(model, config, world, device)

    # The schedule. A branch that would reread data and a run with nothing to do are refused.
    tokens_per_step = config.global_batch * model_config.block_size
    schedule = plan_schedule(config, tokens_per_step, state["branch_start"])
    max_steps, decay_start, grow_step = schedule
    state["decay_start"] = decay_start
    if branch and (max_steps - state["step"]) * config.global_batch > stream.n_windows:
        held = stream.n_windows * model_config.block_size
        raise ValueError(
            f"decay_tokens={config.decay_tokens:,} would reread the held-back data: its "
            f"{held:,} tokens ({BRANCH_FRACTION:.0%} of the train split) are what branches read"
        )
    if state["step"] >= max_steps:
        raise ValueError(
            f"{config.out_dir} is at step {state['step']} of max_steps={max_steps}: nothing to "
            "train (a larger --max_steps continues a stable run)"
        )

    # The folder, the log (cut back to the checkpoint on resume), wandb, the header.
    os.makedirs(config.out_dir, exist_ok=True)
    if world > int(os.environ.get("LOCAL_WORLD_SIZE", world)):
        shared_folder_or_refuse(config.out_dir, master, device)
    if master and resume:
        lines = [line for line in open(log_path) if json.loads(line)["step"] <= state["step"]]
        open(log_path, "w").writelines(lines)
    if master and config.wandb_log:
        import wandb

        run_name = config.wandb_run_name or config.out_dir
        wandb.init(project=config.wandb_project, name=run_name, config=settings)
    counts, c = model.num_params(), model_config
    log = tqdm.write if master else (lambda *a: None)
    log(
        f"run {config.out_dir}: {c.layout} n_layer={c.n_layer} n_embd={c.n_embd} "
        f"n_expert={c.n_expert} passes={c.n_passes}; params total {counts['total']:,} "
        f"active {counts['active']:,}; {tokens_per_step:,} tokens/step x {max_steps} steps; "
        f"world_size {world}; device {device.type}\n"
        f"data {data.data_dir}: {len(data.train):,} train tokens ({stream.name} region, "
        f"{stream.n_windows:,} windows), unigram entropy of the train split "
        f"{data.meta['unigram_entropy']:.3f} nats"
    )

    # A diverging run stops at once; each checkpoint was checked finite before saving.
    saved_step = state["step"] if resume else None

    def diverged(what):
        if saved_step is not None:
            last = f"{ckpt_path} (step {saved_step}) is the last checkpoint"
        else:
            last = "no checkpoint was saved"
        step = state["step"]
        raise FloatingPointError(f"{what} became non-finite by step {step}: stopped; {last}")

    def mean(xs, empty):
        return float(np.mean(xs)) if xs else empty

    def evaluate_and_log(lr):
        """An eval's log record: step, LR, losses, the eval's metrics."""
        metrics = evaluate(model, data, config.eval_tokens, config.batch_size, autocast)
        if not math.isfinite(metrics["val_loss"]):
            diverged("the val loss")
        by_passes = sorted(state["flops_by_passes"].items())
        record = dict(
            step=state["step"],
            tokens=state["tokens"],
            flops=state["flops"],
            flops_by_passes={str(k): v for k, v in by_passes},
            lr=lr,
            train_loss=mean(state["window"], None),
            **metrics,
            epochs=state["data_position"] / stream.n_windows,
            n_passes=mean(state["passes"], model.config.n_passes),
            **speed,
            seconds=round(time.time() - t0, 3),
        )
        if master:
            with open(log_path, "a") as f:
                f.write(json.dumps(record) + "\n")
            if config.wandb_log:
                wandb.log(record, step=state["step"])
        return record

    # Ctrl-C or SIGTERM asks the loop to save and stop after a step; a second stops at once.
    stop, handlers = [], {}

    def on_signal(signum, frame):
        if stop:
            raise KeyboardInterrupt
        stop.append(signum)

    if threading.current_thread() is threading.main_thread():
        handlers = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}

    # The speed leaves evals and saves out; clock and trained hold (seconds, tokens, FLOPs).
    t0, lr, losses, unread = time.time(), 0.0, [], []
    peak = peak_flops(device)
    clock, trained = [t0, state["tokens"], state["flops"]], [0.0, 0, 0.0]
    speed = dict(tokens_per_s=None, mfu=None)

    def speed_of(seconds, tokens, flops):
        mfu = peak and round(flops / seconds / (peak * world), 4)
        return dict(tokens_per_s=round(tokens / seconds), mfu=mfu)

    # A new run evaluates its initial weights at step 0.
    record = evaluate_and_log(lr) if state["step"] == 0 else None
    bar = tqdm(total=max_steps, initial=state["step"], unit="step", disable=not master or None)
    while state["step"] < max_steps:
        step = state["step"]
        # [X] growth, once: twice the passes (pcc_untied copies its cores).
        if step == grow_step and not state["grown"]:
            model, optimizers = grow_model(model, optimizers, config, bf16, device, sharded)
            state["grown"], step_model = True, wrap(model, config, world, device)
            settings.update({k: model.config.to_dict()[k] for k in MODEL_SETTINGS})
            log(f"step {step}: grew to {model.config.n_passes} passes")

        # The schedule: every group's LR, Muon's momentum, this step's passes (None: the model's).
        lr_scale = lr_multiplier(config, step, max_steps, decay_start, grow_step)
        for opt in optimizers:
            for group in opt.param_groups:
                group["lr"] = group["base_lr"] * lr_scale
                if isinstance(opt, Muon):
                    group["momentum"] = muon_momentum(config, step, max_steps)
        lr = optimizers[-1].param_groups[0]["lr"]
        n_passes = passes_of_step(config, step)

        # Forward and backward over the micro-batches (rank r reads its slice), then the update.
        # DDP reduces the gradients once, at the last (no_sync before). FSDP2 reduce-scatters
        # each, and HSDP's replicas (the nodes) all-reduce once, at the last.
        unread.append(torch.zeros(2, dtype=torch.float64, device=device))
        for micro in range(grad_accum):
            first = state["data_position"] + (rank * grad_accum + micro) * config.batch_size
            x, y = stream.batch(first, config.batch_size, device)
            last = micro == grad_accum - 1
            no_sync = contextlib.nullcontext()
            if hasattr(step_model, "no_sync") and not last:
                no_sync = step_model.no_sync()
            if sharded:
                model.set_requires_all_reduce(last)
            with no_sync, autocast:
                _, loss, stats = step_model(x, y, n_passes=n_passes, return_stats=True)
                (loss / grad_accum).backward()
            unread[-1] += torch.stack([stats["ce"], loss.detach()]).double() / grad_accum
        # The [X] code never clips.
        if config.optimizer != "muon_x":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)

        # Accounting: tokens, windows read, FLOPs of every block execution (match.py).
        k = n_passes or model.config.n_passes
        flops_per_token = match.flops_per_token(model.config, n_passes=k, avg_doc_len=avg_doc_len)
        flops = tokens_per_step * flops_per_token
        state.update(
            step=step + 1,
            tokens=state["tokens"] + tokens_per_step,
            flops=state["flops"] + flops,
            data_position=state["data_position"] + config.global_batch,
        )
        state["flops_by_passes"][k] = state["flops_by_passes"].get(k, 0.0) + flops
        state["passes"].append(k)
        bar.update(1)

        # Every LOG_INTERVAL steps and before a save, summed over the ranks, to the host: the
        # losses, whether a weight is non-finite (the last update may have broken one), and
        # whether a rank was asked to stop. Non-finite stops the run before a save.
        at_eval = state["step"] % config.eval_interval == 0 or state["step"] == max_steps
        at_save = state["step"] in config.save_steps
        if at_eval or at_save or state["step"] % LOG_INTERVAL == 0 or stop and world == 1:
            finite = torch.stack(
                [(p.to_local() if sharded else p).isfinite().all() for p in model.parameters()]
            )
            read = torch.stack(unread).flatten()
            flags = [(~finite.all()).double()[None], read.new_tensor([float(bool(stop))])]
            read = torch.cat([read, *flags])
            if world > 1:
                dist.all_reduce(read)
            read, unread = read.cpu(), []
            stop += [1] if read[-1] > 0 and not stop else []
            if read[-2] > 0:
                diverged("the weights")
            read = read[:-2].view(-1, 2) / world
            if not torch.isfinite(read).all():
                diverged("the loss")
            losses += read[:, 0].tolist()
            state["window"] += read[:, 0].tolist()
            # The speed since the last read (the host just waited for the device).
            interval = [
                time.time() - clock[0], state["tokens"] - clock[1], state["flops"] - clock[2]
            ]
            speed = speed_of(*interval)
            trained = [a + b for a, b in zip(trained, interval)]
            clock = [time.time(), state["tokens"], state["flops"]]
            mfu = {"mfu": speed["mfu"]} if peak else {}
            bar.set_postfix(
                loss=f"{losses[-1]:.3f}", lr=f"{lr:.2e}", tok_s=speed["tokens_per_s"], **mfu
            )

        # An eval and its checkpoint; the extra checkpoints decay branches fork from.
        if at_eval:
            record = evaluate_and_log(lr)
            state.update(window=[], passes=[])
            bar.set_postfix(loss=f"{losses[-1]:.3f}", val=f"{record['val_loss']:.3f}")
        # A stop saves too, on all ranks at one step.
        stopping = stop and (world == 1 or state["step"] % LOG_INTERVAL == 0)
        if at_eval or stopping:
            save_checkpoint(ckpt_path, model, optimizers, settings, state, tokenizer, sharded)
            saved_step = state["step"]
        if at_save:
            name = f"ckpt_step{state['step']}" + (".dcp" if sharded else ".pt")
            path = os.path.join(config.out_dir, name)
            save_checkpoint(path, model, optimizers, settings, state, tokenizer, sharded)
        if stopping:
            break
        # The next speed leaves the eval and the saves out.
        if at_eval or at_save:
            clock[0] = time.time()
    bar.close()
    if master and config.wandb_log:
        wandb.finish()
    for s, handler in handlers.items():
        signal.signal(s, handler)
    if stop:
        log(
            f"stopped at step {state['step']}: {ckpt_path} saved; resume with\n  python train.py "
            f"--out_dir={config.out_dir} --init_from=resume"
        )
        raise KeyboardInterrupt

    # The end: an FSDP run's weights in one ckpt.pt, for the tools; the summary.
    if sharded:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = StateDictOptions(full_state_dict=True, cpu_offload=True)
        weights = get_model_state_dict(model, options=full)
        if master:
            path = os.path.join(config.out_dir, "ckpt.pt")
            final = dict(
                model=weights,
                model_config=model.config.to_dict(),
                config=settings,
                state=state,
                tokenizer=tokenizer,
            )
            torch.save(final, path + ".tmp")
            os.replace(path + ".tmp", path)
    summary = dict(
        run_dir=config.out_dir,
        ckpt_path=os.path.join(config.out_dir, "ckpt.pt"),
        resume_path=ckpt_path,
        log_path=log_path,
        step=state["step"],
        max_steps=max_steps,
        tokens=state["tokens"],
        flops=state["flops"],
        val_loss=record["val_loss"],
        val_bpb=record["val_bpb"],
        val_loss_by_source=record.get("val_loss_by_source"),
        train_losses=losses,
        unigram_entropy=data.meta["unigram_entropy"],
        seconds=time.time() - t0,
        **speed_of(*trained),
    )
    mfu = f", MFU {summary['mfu']:.1%} of {world} x {peak:.3g} FLOP/s" if peak else ""
    log(
        f"step {state['step']}: val loss {record['val_loss']:.4f} nats "
        f"({record['val_bpb']:.4f} bits/byte) vs unigram entropy "
        f"{data.meta['unigram_entropy']:.4f} ({state['tokens']:,} tokens, "
        f"{state['flops']:.3e} FLOPs, {summary['seconds']:.0f} s; "
        f"{summary['tokens_per_s']:,} tokens/s{mfu})\n"
        f"checkpoint: {summary['ckpt_path']}\nlog:        {log_path}"
    )
    return summary


def main(argv):
    if "-h" in argv or "--help" in argv:
        print("usage: python train.py [config/NAME.py ...] [--key=value ...]\n")
        print("model (model.py):")
        print("\n".join(settings_help(ModelConfig, MODEL_SETTINGS)))
        print(f"    (the tiny default: {TINY})\n\ntraining:")
        print("\n".join(settings_help(TrainConfig, [f.name for f in fields(TrainConfig)])))
        return 0
    try:
        train(configurator.configure(DEFAULTS, argv))
    # A bad setting or a missing file is one line.
    except (ValueError, FileNotFoundError) as e:
        print(f"train.py: error: {e}", file=sys.stderr)
        return 2
    except FloatingPointError as e:
        print(f"train.py: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
