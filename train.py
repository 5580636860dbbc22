"""
Train one model: Muon/AdamW, a warmup-stable-decay (WSD) schedule with decay branches, growth of the
number of passes mid-training, gradient accumulation, DDP, exact resume. nanoGPT style: the defaults
below train the tiny looped MoE (config/tiny.py) on the embedded Shakespeare corpus on a CPU.

    python train.py                                     # tiny default on CPU, a few minutes
    python train.py config/tiny.py --max_steps=100      # a config file, then --key=value overrides
    python train.py --optimizer=adamw --run_name=adamw  # any setting below and any ModelConfig field
    python train.py --help                              # every setting, its default and what it means

    # DDP, one node (gloo on CPU, nccl on CUDA); same results as one process with the same global batch
    torchrun --standalone --nproc_per_node=8 train.py config/tiny.py
    # DDP, two nodes (run on each node, node_rank 0 and 1; the first node's address as master_addr)
    torchrun --nnodes=2 --node_rank=0 --nproc_per_node=8 --master_addr=10.0.0.1 --master_port=29500 train.py
    torchrun --nnodes=2 --node_rank=1 --nproc_per_node=8 --master_addr=10.0.0.1 --master_port=29500 train.py

    # continue an interrupted run from out/<run_name>/ckpt.pt (identical loss curve on CPU)
    python train.py --run_name=stable --resume=True
    # a stable run that never decays and keeps checkpoints to branch from, then one decay branch [S]
    python train.py --run_name=stable --decay_fraction=0.0 --save_steps=[200,400]
    python train.py --init_from=out/stable/ckpt_step200.pt --decay_branch=True --decay_tokens=200000
    # growth of the number of passes at 60% of training, untied copies, LR re-warm over 40 steps [X]
    python train.py --layout=pcc --n_layer=6 --n_passes=2 --grow_at=0.6 --grow_to=4 --grow_untie=True

Every run writes out/<run_name>/ckpt.pt (+ ckpt_step<N>.pt for save_steps) and log.jsonl, one JSON
line per eval: step, tokens, flops (cumulative analytic training FLOPs, every block execution
counted), flops_by_passes (the same split by the number of passes the steps ran: the phases before
and after growth), lr, train_loss, val_loss (token-weighted CE), val_loss_by_source, router
statistics for MoE (balance, z_loss, expert_load_max/min: largest and smallest fraction of routed
assignments one expert got in any MoE layer; 1/n_expert is perfect balance), epochs (passes over the
data region read so far), n_passes, seconds. A checkpoint is written before its log line, and a
resumed run cuts the log back to its checkpoint, so the two always agree.

Data order: the train split is cut into windows of block_size + 1 tokens, read in a seeded random
order per epoch; the data position (windows consumed) is in the checkpoint. The last
branch_data_fraction of the train split is held back: stable runs never read it, decay branches
read only it, so a branch always trains on data its stable phase has not seen ([S]: no repetition;
a branch that would need more than the held-back data is refused).

Growth (grow_at, grow_to, grow_untie): at the growth step grow.grow changes the live model in place,
the optimizers are rebuilt for the new parameter list and every parameter's state is carried over by
name; grow.copy_optimizer_state decides what copies of untied cores get (fresh state by default).
The LR re-warms from 0 over grow_rewarm_steps. A checkpoint saved before the growth step resumes into it.

In-process use (the ladder): `summary = train.train({"max_steps": 100, "n_embd": 64})`.
"""

import ast
import contextlib
import inspect
import json
import math
import os
import re
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

import checkpoint
import grow
import match
from checkpoint import NonFiniteLoss
from common import cli_error, resolve_device
from data.tokenizer import get_tokenizer
from model import GPT, ModelConfig, read_config_file
from muon import Muon
from sample import sample_text

# ----------------------------------------------------------------------------------------------------
# Settings: the training settings below, plus every ModelConfig field (model.py), with the tiny default
# model on top. The comment beside each default is its --help text.


@dataclass
class TrainConfig:
    # I/O
    out_dir: str = "out"  # the run lives in out_dir/run_name/
    run_name: str = ""  # "" -> the config file's name, "tiny" without one, "<source>_decay<step>" for a branch
    eval_interval: int = 50  # eval + checkpoint + log line every this many steps (and at the end)
    eval_tokens: int = 8192  # validation tokens per eval (the same windows every eval, spread over the split)
    save_steps: list = field(default_factory=list)  # extra checkpoints ckpt_step<N>.pt after these steps
    progress: bool = True  # tqdm progress bar
    sample: bool = True  # print one short text sample from the final model
    # data
    data_dir: str = ""  # a data/prepare.py folder; "" -> the embedded corpus (prepared on first use)
    branch_data_fraction: float = 0.1  # tail of the train split held back for decay branches
    seed: int = 1337  # model init, data order, random passes
    # batch: one optimizer step reads batch_size * grad_accum * world_size sequences of block_size tokens
    batch_size: int = 16  # sequences per micro-batch per process
    grad_accum: int = 1  # micro-batches per optimizer step
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
    weight_decay: float = 0.0  # decoupled weight decay of the hidden matrices
    adam_betas: tuple = (0.8, 0.95)  # AdamW (beta1, beta2)
    adam_eps: float = 1e-10  # AdamW epsilon
    muon_momentum: float = 0.95  # Muon momentum
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
    # decay branches: fork from a stable checkpoint, decay over decay_tokens on held-back data
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
    compile: bool = False  # torch.compile the model
    parallel: str = "ddp"  # under torchrun: "ddp" (a full replica per process) or "fsdp" (FSDP2: weights,
    #   gradients and optimizer state sharded over the processes; checkpoints sharded too)
    reshard_after_forward: bool = True  # fsdp: free a block's gathered weights after every visit (ZeRO-3
    #   memory; a looped block is gathered once per visit), or keep them until its backward (one gather
    #   per step, the unsharded blocks in memory)
    activation_checkpointing: bool = False  # keep only each executed block's input; recompute the rest in
    #   the backward (each visit of a looped block its own): far less activation memory, ~1/3 more compute

    def __post_init__(self):
        def bad(name, why):
            raise ValueError(f"{name}={getattr(self, name)!r}: {why}")

        choices = dict(optimizer=("muon", "adamw"), decay_shape=("cosine", "linear"),
                       dtype=("auto", "float32", "bfloat16"), parallel=("ddp", "fsdp"))
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                bad(name, f"must be one of {', '.join(map(repr, allowed))}")
        if not self.run_name == os.path.basename(self.run_name) or self.run_name in (".", ".."):
            bad("run_name", "must be a plain folder name (no path separators); the run lives in out_dir/run_name")
        for name in ("eval_interval", "eval_tokens", "batch_size", "grad_accum", "muon_ns_steps"):
            if getattr(self, name) < 1:
                bad(name, "must be >= 1")
        if self.max_steps < 1 and self.max_tokens <= 0:
            bad("max_steps", "must be >= 1 (or set max_tokens > 0)")
        for name in ("max_tokens", "stop_at_step", "warmup_steps", "grad_clip", "weight_decay", "decay_tokens",
                     "grow_at", "grow_to", "grow_rewarm_steps", "avg_doc_len", "lr_anchor_params"):
            if getattr(self, name) < 0:
                bad(name, "must be >= 0")
        for name in ("matrix_lr", "adamw_matrix_lr", "embedding_lr", "unembedding_lr", "router_lr", "scalar_lr",
                     "adam_eps"):
            if not getattr(self, name) > 0:
                bad(name, "must be > 0 (a learning rate <= 0 does not descend)")
        if len(self.adam_betas) != 2 or not all(0 <= b < 1 for b in self.adam_betas):
            bad("adam_betas", "must be two numbers in [0, 1)")
        if not 0 <= self.muon_momentum < 1:
            bad("muon_momentum", "must be in [0, 1)")
        for name in ("decay_fraction", "min_lr_fraction"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                bad(name, "must be in [0, 1]")
        if not 0.0 <= self.branch_data_fraction < 1.0:
            bad("branch_data_fraction", "must be in [0, 1)")
        if any(not isinstance(s, int) or s < 1 for s in self.save_steps):
            bad("save_steps", "must be a list of steps >= 1")
        if any(not isinstance(k, int) or k < 1 for k in self.n_passes_choices):
            bad("n_passes_choices", "must be a list of pass counts >= 1")
        if self.decay_branch and (not self.init_from or self.decay_tokens <= 0):
            bad("decay_branch", "needs init_from=<stable checkpoint> and decay_tokens > 0")
        if self.decay_branch and self.branch_data_fraction == 0.0:
            bad("decay_branch", "needs branch_data_fraction > 0 (the held-back data it reads)")
        if self.grow_at and self.grow_to < 1:
            bad("grow_at", "needs grow_to >= 1 (passes after growth)")
        if self.resume and self.init_from:
            bad("resume", "use either resume=True (continue out_dir/run_name/ckpt.pt) or init_from, not both")


# the tiny default: a SMELT-looped MoE [S] that trains on 2 CPU cores in a few minutes (= config/tiny.py)
TINY_MODEL = dict(
    vocab_size=4096, eot_token=4095, block_size=128,
    n_layer=4, n_embd=128, n_head=4,
    n_expert=8, top_k=2,
    layout="smelt", n_loops=2,  # the middle 2 of 4 layers run twice, updates scaled by 1/2 [S8]-[S9]
    use_triton=None,  # None: the Triton kernels on CUDA, the PyTorch code elsewhere
)

TRAIN_KEYS = frozenset(f.name for f in fields(TrainConfig))
MODEL_KEYS = frozenset(f.name for f in fields(ModelConfig))
DEFAULTS = asdict(TrainConfig()) | {f.name: f.default for f in fields(ModelConfig)} | TINY_MODEL
# per command: never carried over from the checkpoint a run forks (init_from) / continues (resume)
NOT_INHERITED_FORK = ("run_name", "init_from", "decay_branch", "decay_tokens", "resume", "stop_at_step",
                      "save_steps", "progress", "sample")
NOT_INHERITED_RESUME = ("resume", "stop_at_step", "progress", "sample")


def check_setting(key, value, where="setting"):
    """Type-check one setting against its default; returns the (normalised) value."""
    if key not in DEFAULTS:
        close = [k for k in DEFAULTS if k.split("_")[0] == key.split("_")[0]][:5]
        hint = f" (similar: {', '.join(close)})" if close else ""
        raise ValueError(f"unknown {where} {key!r}{hint}; run `python train.py --help` for the list")
    default = DEFAULTS[key]
    if default is None:  # use_triton: None (auto) or a bool
        ok, expected = value is None or isinstance(value, bool), "None or bool"
    elif isinstance(default, bool):
        ok, expected = isinstance(value, bool), "bool"
    elif isinstance(default, int):
        if isinstance(value, float) and value.is_integer():  # --max_tokens=1e6
            value = int(value)
        ok, expected = isinstance(value, int) and not isinstance(value, bool), "int"
    elif isinstance(default, float):
        ok, expected = isinstance(value, (int, float)) and not isinstance(value, bool), "float"
        value = float(value) if ok else value
    elif isinstance(default, (list, tuple)):
        ok, expected = isinstance(value, (list, tuple)), type(default).__name__
        value = type(default)(value) if ok else value
    else:
        ok, expected = isinstance(value, type(default)), type(default).__name__
    if not ok:
        raise ValueError(f"{where} {key}={value!r} has type {type(value).__name__}, expected {expected} "
                         f"(default {default!r})")
    return value


def parse_args(argv):
    """[config/NAME.py ...] [--key=value ...] -> overrides dict. Values are python literals
    (literal_eval), anything else is a string; unknown keys and wrong types raise ValueError.
    A config file without a run_name names the run after itself (config/x_d8_loop2.py -> x_d8_loop2)."""
    overrides = {}
    for arg in argv:
        if not arg.startswith("--"):
            values = {k: check_setting(k, v, where=f"key in {arg}") for k, v in read_config_file(arg).items()}
            overrides.update({"run_name": os.path.splitext(os.path.basename(arg))[0]} | values)
            continue
        key, eq, text = arg[2:].partition("=")
        if not eq:
            raise ValueError(f"expected --key=value, got {arg!r}")
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            value = text
        overrides[key] = check_setting(key, value, where="command-line key")
    return overrides


def resolve_settings(overrides, base=None, not_inherited=NOT_INHERITED_FORK):
    """DEFAULTS, then `base` (a checkpoint's train_config), then overrides -> one flat settings dict;
    every key checked, every value validated (ValueError naming the setting)."""
    settings = dict(DEFAULTS)
    for key, value in (base or {}).items():
        if key in DEFAULTS and key not in not_inherited:
            settings[key] = value
    for key, value in overrides.items():
        settings[key] = check_setting(key, value)
    train_config_from(settings), model_config_from(settings)  # validate both halves now
    return settings


def train_config_from(settings):
    return TrainConfig(**{k: settings[k] for k in TRAIN_KEYS})


def model_config_from(settings, device_type="cpu"):
    """A ModelConfig from settings (the model keys of a settings dict); use_triton=None -> the Triton
    kernels on CUDA only."""
    model_settings = {k: settings[k] for k in MODEL_KEYS}
    if model_settings["use_triton"] is None:
        model_settings["use_triton"] = device_type == "cuda"
    return ModelConfig.from_dict(model_settings)


def described_fields(cls):
    """{field: the comment beside its default, with the indented comment lines that continue it}."""
    descriptions, last = {}, None
    for line in inspect.getsource(cls).splitlines():
        if m := re.match(r"\s+(\w+): [^=]+= .*?  # (.*)$", line):
            descriptions[m[1]], last = m[2], m[1]
        elif (m := re.match(r"\s+#\s{2,}(.*)$", line)) and last:
            descriptions[last] += " " + m[1]
        else:
            last = None
    return descriptions


def usage():
    lines = ["usage: python train.py [config/NAME.py ...] [--key=value ...]", ""]
    for title, cls, keys in (("training settings", TrainConfig, TRAIN_KEYS), ("model settings (model.ModelConfig)",
                                                                             ModelConfig, MODEL_KEYS)):
        described = described_fields(cls)
        lines.append(f"{title}:")
        for key in (f.name for f in fields(cls)):
            lines.append(f"  --{key}={DEFAULTS[key]!r}".ljust(34) + f" {described.get(key, '')}")
        lines.append("")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------
# Data: seeded windows of the train split; a held-back tail for decay branches


class TokenStream:
    """Windows of seq_len + 1 tokens of tokens[start:stop], read in a seeded random order per epoch.
    Window number n (counting from 0 over the whole run) is deterministic given (seed, n), so a
    checkpoint only needs n (the data position) and every DDP rank computes the same order."""

    def __init__(self, tokens, seq_len, seed, start=0, stop=None, name="stable"):
        stop = len(tokens) if stop is None else stop
        self.tokens, self.seq_len, self.seed, self.start, self.stop = tokens, seq_len, seed, start, stop
        self.name = name
        self.n_windows = (stop - start - 1) // seq_len
        if self.n_windows < 1:
            raise ValueError(f"the {name} region of the data has {stop - start} tokens: fewer than block_size + 1 "
                             f"= {seq_len + 1}")
        self._perms = {}

    def permutation(self, epoch):
        if epoch not in self._perms:
            self._perms = {epoch: np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)}
        return self._perms[epoch]

    def offsets(self, first, count):
        """Token offsets of windows first .. first + count - 1."""
        index = np.arange(first, first + count)
        out = np.empty(count, dtype=np.int64)
        for epoch in np.unique(index // self.n_windows):
            sel = index // self.n_windows == epoch
            out[sel] = self.start + self.permutation(int(epoch))[index[sel] % self.n_windows] * self.seq_len
        return out

    def batch(self, first, count):
        """(x, y) int64 tensors (count, seq_len) and the token offsets read."""
        offsets = self.offsets(first, count)
        rows = np.stack([np.asarray(self.tokens[o:o + self.seq_len + 1], dtype=np.int64) for o in offsets])
        rows = torch.from_numpy(rows)
        return rows[:, :-1], rows[:, 1:], offsets


@dataclass
class Data:
    """A data/prepare.py folder, opened: token memmaps, the val split's sources, the unigram baseline."""
    data_dir: str
    meta: dict
    train_tokens: np.ndarray
    val_tokens: np.ndarray
    val_sources: Optional[np.ndarray]  # source id per val token (None without several sources)
    unigram_entropy: float  # of the train split: the loss of the best context-free model

    @property
    def source_names(self):
        return self.meta.get("sources", [])


def load_data(data_dir):
    """Open a data/prepare.py folder ("" -> the embedded corpus, prepared once, offline); clear errors
    (file named) for missing or corrupt files and out-of-range token ids."""
    from data import prepare as prep
    if not data_dir:
        data_dir = prep.prepare_default(prep.DEFAULT_OUT)
    meta = prep.load_meta(data_dir)
    train_tokens, val_tokens = prep.load_split(data_dir, "train"), prep.load_split(data_dir, "val")
    val_sources = None
    if len(meta.get("sources", [])) > 1:
        val_sources = prep.token_source_ids(prep.load_sources(data_dir, "val"), len(val_tokens))
    entropy = meta.get("unigram_entropy_train_nats") or unigram_entropy(train_tokens, meta["n_vocab"])
    return Data(data_dir, meta, train_tokens, val_tokens, val_sources, float(entropy))


def unigram_entropy(tokens, n_vocab):
    """Entropy (nats/token) of the token frequencies: the loss of the best context-free model."""
    counts = np.bincount(np.asarray(tokens), minlength=n_vocab).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


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
        "embedding": ("adamw", config.embedding_lr, 0.0),
        "unembedding": ("adamw", config.unembedding_lr, 0.0),
        "router": ("adamw", config.router_lr, 0.0),
        "scalar": ("adamw", config.scalar_lr, 0.0),
    }
    members = {name: [] for name in groups}
    for name, p in model.named_parameters():  # named_parameters() lists a tied weight once
        if not p.requires_grad:
            continue
        if name.startswith("wte."):
            members["embedding"].append((name, p))
        elif name.startswith("lm_head."):
            members["unembedding"].append((name, p))
        elif ".router." in name:
            members["router"].append((name, p))
        elif p.dim() >= 2:
            members["matrix"].append((name, p))
        else:
            members["scalar"].append((name, p))
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
                               ns_steps=config.muon_ns_steps, ns_dtype=ns_dtype,
                               use_triton=bool(model.config.use_triton)))
    return optimizers


def optimizer_state_by_name(optimizers):
    """{"state": {param name: {key: tensor}}, "param_groups": [{name, lr, ..., param_names}]}:
    keyed by parameter name so grow.py can extend it and a grown model can load it."""
    state, groups = {}, []
    for opt in optimizers:
        for group in opt.param_groups:
            groups.append({k: v for k, v in group.items() if k != "params"})
            for p, name in zip(group["params"], group["param_names"]):
                if p in opt.state:
                    state[name] = dict(opt.state[p])
    return {"state": state, "param_groups": groups}


def load_optimizer_state(optimizers, state_by_name):
    """Put saved per-parameter state back by name (parameters without saved state start fresh). Whole
    tensors of a parameter FSDP has sharded are sharded the same way (distribute_tensor)."""
    for opt in optimizers:
        for group in opt.param_groups:
            for p, name in zip(group["params"], group["param_names"]):
                if name in state_by_name:
                    opt.state[p] = {k: like_param(v, p) for k, v in state_by_name[name].items()}


def like_param(value, p):
    """A saved state tensor placed like its parameter: on its device, and sharded like it under FSDP."""
    if not torch.is_tensor(value) or value.dim() == 0:
        return value
    if hasattr(p, "device_mesh") and not hasattr(value, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor
        return distribute_tensor(value.to(p.device), p.device_mesh, p.placements)
    return value.to(p.device)


def empty_optimizer_state(opt, p):
    """A parameter's optimizer state before its first step, with the shapes (and shards) a sharded
    checkpoint loads into."""
    if isinstance(opt, Muon):
        return {"momentum_buffer": torch.zeros_like(p)}
    return {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}


def set_learning_rates(optimizers, multiplier):
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = group["base_lr"] * multiplier
    return optimizers[-1].param_groups[0]["lr"]  # the hidden matrices' LR (logged)


# ----------------------------------------------------------------------------------------------------
# Schedule and accounting


def wsd_multiplier(step, warmup_steps, decay_start, decay_end, shape="cosine", floor=0.0):
    """Warmup-stable-decay [S]: linear warmup to 1, constant, then cosine/linear decay reaching `floor`
    exactly at the last step of the decay (step decay_end - 1)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if step < decay_start or decay_end <= decay_start:
        return 1.0
    progress = min(1.0, (step - decay_start + 1) / (decay_end - decay_start))
    if shape == "cosine":
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    return 1 - (1 - floor) * progress


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
        if self.grow_step is not None:
            multiplier *= grow.rewarm_multiplier(step, self.grow_step, c.grow_rewarm_steps)
        return multiplier


def current_passes(cfg):
    """The configured K (pcc) or r (smelt, layer_loop); 1 for plain."""
    return cfg.n_passes if cfg.layout == "pcc" else cfg.n_loops if cfg.layout != "plain" else 1


def passes_of_step(config, step):
    """None (the model's own passes), or K drawn uniformly from n_passes_choices, seeded by (seed, step)."""
    if not config.n_passes_choices:
        return None
    return int(np.random.default_rng([config.seed, step, 1]).choice(config.n_passes_choices))


def flops_per_token(cfg, n_passes=None, avg_doc_len=0):
    """Training FLOPs per token (forward + backward) of the executed plan, every block execution
    counted (match.py): attention at the causal average of avg_doc_len keys (what the document mask
    leaves), or of a full block_size context when avg_doc_len is 0."""
    return float(match.flops_per_token(cfg, n_passes=n_passes, avg_doc_len=avg_doc_len or None))


# ----------------------------------------------------------------------------------------------------
# Distributed


def setup_distributed(config):
    """(rank, world_size, device); initialises the process group under torchrun (gloo on CPU, nccl on
    CUDA). parallel="fsdp" in one process runs as one shard in a one-process group."""
    device = resolve_device(config.device)
    use_cuda = device.type == "cuda"
    if "RANK" not in os.environ and config.parallel != "fsdp":
        return 0, 1, device
    import torch.distributed as dist
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if use_cuda:
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        backend = "nccl" if use_cuda else "gloo"
        if "RANK" in os.environ:
            dist.init_process_group(backend=backend)
        else:  # one process, one shard
            dist.init_process_group(backend=backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                                    world_size=1)
    return rank, world, torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def all_reduce_sum(tensor, world):
    if world > 1:
        import torch.distributed as dist
        dist.all_reduce(tensor)
    return tensor


def shard_model(model, config, device, world, use_bf16):
    """FSDP2: fully_shard every stored block, then the whole model (embedding, head, norms) on one
    DeviceMesh; every parameter becomes a DTensor holding 1/world of its rows. On CUDA the blocks compute
    in bf16 (MixedPrecisionPolicy) with fp32 master weights and fp32 gradient reduction; on CPU in fp32
    (autocast still applies with --dtype=bfloat16).
    Looped blocks: a tied core or a SMELT span runs the same sharded block several times per forward.
    Gradients accumulate over the visits and are reduce-scattered once per backward (tested equal to one
    process). With reshard_after_forward=True each visit all-gathers the block again (forward and
    backward): r or K gathers of a looped block per pass, but only one gathered block in memory at a
    time, which is what lets the 21.5B / 53.9B-parameter [S] MoEs fit. reshard_after_forward=False
    gathers every block once per step and keeps it until its backward: fewer collectives when the
    unsharded model fits (match.py --memory says whether it does)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mesh = init_device_mesh(device.type, (world,))
    mixed = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if use_bf16 and device.type == "cuda" else MixedPrecisionPolicy()
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mixed, reshard_after_forward=config.reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=mixed)
    return model


def is_sharded(model):
    return any(hasattr(p, "device_mesh") for p in model.parameters())


def wrap_model(model, config, device, world):
    """The module the training step calls: DDP around the model (several processes, parallel="ddp"),
    and / or torch.compile. The unwrapped model (sharded in place under FSDP) stays the one to save."""
    if config.compile:
        model = torch.compile(model)
    if world > 1 and config.parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                        gradient_as_bucket_view=True)  # no second copy of the gradients
    return model


@contextlib.contextmanager
def gradient_sync(model, raw_model, sync):
    """Gradient accumulation: reduce gradients across processes only on the last micro-batch."""
    if sync:
        yield
    elif hasattr(model, "no_sync"):  # DDP
        with model.no_sync():
            yield
    elif hasattr(raw_model, "set_requires_gradient_sync"):  # FSDP2
        raw_model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            raw_model.set_requires_gradient_sync(True)
    else:
        yield


def local_state_bytes(model, optimizers):
    """Bytes of weights, gradients and optimizer state this process holds (its shards under FSDP)."""
    tensors = [p for p in model.parameters()] + [p.grad for p in model.parameters() if p.grad is not None]
    tensors += [v for opt in optimizers for s in opt.state.values() for v in s.values()
                if torch.is_tensor(v) and v.dim() > 0]
    return sum(checkpoint.local(t).numel() * t.element_size() for t in tensors)


# ----------------------------------------------------------------------------------------------------
# Evaluation


@torch.no_grad()
def evaluate(model, data, seq_len, eval_tokens, batch_size, autocast, rank=0, world=1):
    """Token-weighted validation CE over eval_tokens of the val split (the same windows every eval, evenly
    spread over the split so every source is in; split across ranks), per source when sources exist,
    and router statistics for MoE."""
    device = next(model.parameters()).device
    val_tokens, val_sources, source_names = data.val_tokens, data.val_sources, data.source_names
    total = (len(val_tokens) - 1) // seq_len
    n_windows = max(1, min(eval_tokens // seq_len, total))
    starts = np.linspace(0, total - 1, n_windows).round().astype(np.int64) * seq_len  # spread over all sources
    n_sources = len(source_names) if val_sources is not None else 0
    loss_sum = torch.zeros(1 + n_sources, dtype=torch.float64)
    count = torch.zeros(1 + n_sources, dtype=torch.float64)
    router = torch.zeros(2, dtype=torch.float64)  # balance, z_loss sums over batches
    n_batches = torch.zeros(1, dtype=torch.float64)
    expert_counts = None
    mine = list(range(rank, n_windows, world))
    # the same number of forwards on every rank: under FSDP every forward is a collective
    n_batches_each = math.ceil(math.ceil(n_windows / world) / batch_size)
    was_training = model.training
    model.eval()
    for i in range(0, n_batches_each * batch_size, batch_size):
        padding = i >= len(mine)  # this rank ran out of windows: a forward the others need, not counted
        offsets = starts[mine[i:i + batch_size] if not padding else [0]]
        rows = torch.from_numpy(np.stack([np.asarray(val_tokens[o:o + seq_len + 1], dtype=np.int64) for o in offsets]))
        x, y = rows[:, :-1].to(device), rows[:, 1:].to(device)
        with autocast:
            logits, _ = model(x, y)
        if padding:
            continue
        ce = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="none").double().cpu()
        loss_sum[0] += ce.sum()
        count[0] += ce.numel()
        if n_sources:
            src = torch.from_numpy(np.stack([val_sources[o + 1:o + seq_len + 1] for o in offsets])).flatten()
            loss_sum[1:] += torch.zeros(n_sources, dtype=torch.float64).index_add_(0, src, ce)
            count[1:] += torch.bincount(src, minlength=n_sources).double()
        stats = model.last_stats
        if "balance" in stats:
            router += torch.tensor([stats["balance"].item(), stats["z_loss"].item()], dtype=torch.float64)
            n_batches += 1
            c = stats["expert_counts"].double().cpu()
            expert_counts = c if expert_counts is None else expert_counts + c
    model.train(was_training)
    all_reduce_sum(loss_sum, world), all_reduce_sum(count, world)
    out = {"val_loss": (loss_sum[0] / count[0]).item()}
    if n_sources:
        out["val_loss_by_source"] = {name: (loss_sum[1 + j] / count[1 + j]).item()
                                     for j, name in enumerate(source_names) if count[1 + j] > 0}
    if model.config.n_expert:
        all_reduce_sum(router, world), all_reduce_sum(n_batches, world)
        if expert_counts is None:  # this rank evaluated no window: zeros of the shape the others sum
            executed = sum(step.kind == "block" for step in model.plan)
            expert_counts = torch.zeros(executed, model.config.n_expert, dtype=torch.float64)
        all_reduce_sum(expert_counts, world)
        fraction = expert_counts / expert_counts.sum(dim=-1, keepdim=True).clamp(min=1)
        out.update(balance=(router[0] / n_batches.clamp(min=1)).item(),
                   z_loss=(router[1] / n_batches.clamp(min=1)).item(),
                   expert_load_max=fraction.max().item(), expert_load_min=fraction.min().item())
    return out


# ----------------------------------------------------------------------------------------------------
# Checkpoints (checkpoint.py writes and reads them)


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C during training, with where the last checkpoint is and how to resume."""


@dataclass
class TrainState:
    """What a checkpoint carries for an exact resume, besides weights, optimizer state and settings."""
    step: int = 0
    tokens_seen: int = 0
    flops_seen: float = 0.0
    flops_by_passes: dict = field(default_factory=dict)  # {passes: training FLOPs run at that many passes}
    data_region: str = "stable"  # "stable" or "branch" (the held-back tail)
    data_position: int = 0  # windows of the region consumed so far
    branch_start_step: Optional[int] = None
    grown: bool = False
    last_eval: Optional[dict] = None  # the log record of the last eval
    lr_scaling_params: int = 0  # [X16] N: stored parameters at initialisation, token embedding included
    #   (the [X] code's N), kept through growth, forks and resumes


def checkpoint_dict(model, optimizers, config, state, data):
    rng = {"torch": torch.get_rng_state(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return {
        "model_config": asdict(model.config),
        "model": model.state_dict(),
        "optimizer": optimizer_state_by_name(optimizers),
        "step": state.step,
        "tokens_seen": state.tokens_seen,
        "flops_seen": state.flops_seen,
        "flops_by_passes": dict(state.flops_by_passes),
        "data_position": {"region": state.data_region, "windows": state.data_position},
        "branch_start_step": state.branch_start_step,
        "grown": state.grown,
        "last_eval": state.last_eval,
        "lr_scaling_params": state.lr_scaling_params,
        "rng": rng,
        "train_config": asdict(config),
        "tokenizer": data.meta.get("tokenizer"),
        "data_dir": data.data_dir,
    }


def state_from_checkpoint(ckpt, region):
    position = ckpt.get("data_position") or {}
    return TrainState(step=ckpt["step"], tokens_seen=ckpt.get("tokens_seen", 0),
                      flops_seen=ckpt.get("flops_seen", 0.0), flops_by_passes=dict(ckpt.get("flops_by_passes", {})),
                      data_region=region, branch_start_step=ckpt.get("branch_start_step"),
                      grown=ckpt.get("grown", False), last_eval=ckpt.get("last_eval"),
                      lr_scaling_params=ckpt.get("lr_scaling_params") or grow.stored_params(
                          ModelConfig.from_dict(ckpt["model_config"])),
                      # continue where it stopped reading when it read the same region
                      data_position=position.get("windows", 0) if position.get("region", "stable") == region else 0)


# ----------------------------------------------------------------------------------------------------
# Training


@dataclass
class Run:
    """One training run, resolved: its settings, the model settings, the checkpoint it starts from."""
    config: TrainConfig
    model_settings: dict
    source: Optional[dict]  # the checkpoint it starts from (resume / init_from), or None
    run_dir: str

    @property
    def ckpt_path(self):
        return os.path.join(self.run_dir, "ckpt.pt")

    @property
    def sharded_path(self):  # FSDP
        return os.path.join(self.run_dir, "ckpt.dcp")

    @property
    def log_path(self):
        return os.path.join(self.run_dir, "log.jsonl")


def resolve_run(overrides):
    """Where a run starts: from scratch, from a checkpoint to fork (init_from: a new run, e.g. a decay
    branch), or from its own checkpoint (resume). Settings come from the defaults, the source
    checkpoint's settings (except the per-command ones) and the overrides; the model from the checkpoint."""
    for key, value in overrides.items():
        check_setting(key, value)
    base = DEFAULTS | overrides
    resume, source_path = base["resume"], base["init_from"]
    if resume and not source_path:
        run_dir = os.path.join(base["out_dir"], base["run_name"] or "tiny")
        source_path = checkpoint.find_resume_checkpoint(run_dir) if os.path.isdir(run_dir) else None
        if source_path is None:
            raise FileNotFoundError(f"resume=True: no checkpoint to resume in {run_dir} (ckpt.pt or ckpt.dcp)")
    source = None
    if source_path:
        source = checkpoint.load_train_checkpoint(source_path)
        differ = sorted(k for k in overrides if k in MODEL_KEYS and k != "use_triton"
                        and overrides[k] != source["model_config"].get(k))
        if differ:
            raise ValueError(f"model settings {differ} differ from the checkpoint {source_path}; "
                             "the model comes from the checkpoint")
    settings = resolve_settings(overrides, base=source["train_config"] if source else None,
                                not_inherited=NOT_INHERITED_RESUME if resume else NOT_INHERITED_FORK)
    config, model_settings = train_config_from(settings), {k: settings[k] for k in MODEL_KEYS}
    if source is not None:  # the model is the checkpoint's; use_triton stays a setting of this run
        model_settings = source["model_config"] | dict(use_triton=settings["use_triton"])
    if not config.run_name:
        config.run_name = (f"{source['train_config'].get('run_name') or 'run'}_decay{source['step']}"
                           if config.decay_branch else "tiny")
    return Run(config, model_settings, source, os.path.join(config.out_dir, config.run_name))


def check_passes(cfg, config, grown=False):
    """The pass counts this run will ask of the model, checked before anything is built."""
    if config.n_passes_choices and cfg.layout == "plain":
        raise ValueError("n_passes_choices: a plain model has no passes to vary (use layout smelt, layer_loop or pcc)")
    if config.n_passes_choices and cfg.layout == "pcc" and not cfg.tie_core:
        too_many = [k for k in config.n_passes_choices if k > cfg.n_passes]
        if too_many:
            raise ValueError(f"n_passes_choices={config.n_passes_choices}: an untied model has {cfg.n_passes} "
                             f"cores, it cannot run {too_many} passes")
    if config.grow_at and not config.decay_branch and not grown:
        k = current_passes(cfg)
        if config.grow_to < k or (config.grow_to == k and not config.grow_untie):
            raise ValueError(f"grow_to={config.grow_to}: must be more than the model's {k} passes")


def available_memory(device):
    """Bytes this process can still allocate: free GPU memory, or the host's MemAvailable shared by the
    processes of this node; None when unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None
    return kib * 1024 // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def check_memory(cfg, config, device, use_bf16, world=1):
    """Refuse, before allocating anything, a run whose estimated memory exceeds what is available:
    weights, gradients and optimizer state (this rank's shard under FSDP), the activations autograd keeps
    (match.py's planner), and on the SDPA path the boolean document mask (batch x block_size^2 bytes,
    twice while it is built); for the model as built and as it grows (grow_to) or runs its most passes."""
    available = available_memory(device)
    if available is None:
        return
    shapes = [("", cfg)]  # the model as built, and the largest it becomes during the run
    if config.grow_at and not config.decay_branch:
        shapes.append((f" after growing to {config.grow_to} passes",
                       grow.grown_config(cfg, config.grow_to, config.grow_untie)))
    if config.n_passes_choices and max(config.n_passes_choices) > current_passes(cfg):
        shapes.append((f" at {max(config.n_passes_choices)} passes (n_passes_choices)",
                       grow.with_passes(cfg, max(config.n_passes_choices))))
    flex = cfg.attention == "flex" or (cfg.attention == "auto" and device.type == "cuda")
    mask = 0 if flex else 2 * config.batch_size * cfg.block_size ** 2
    for when, shape in shapes:
        states = match.state_bytes_per_rank(shape, world if config.parallel == "fsdp" else 1, config.optimizer)
        activations = match.activation_bytes(shape, config.batch_size, mixed_precision=use_bf16,
                                             activation_checkpointing=config.activation_checkpointing,
                                             kernels=bool(shape.use_triton))["total"]
        need = states + activations + mask
        if need > available:
            gib = lambda b: f"{b / 2**30:.1f} GiB"  # noqa: E731
            raise ValueError(f"block_size={cfg.block_size}, batch_size={config.batch_size}: this run needs about "
                             f"{gib(need)}{when} (weights, gradients and optimizer state {gib(states)}, "
                             f"activations {gib(activations)}, attention mask {gib(mask)}) but {gib(available)} "
                             f"is available on {device}; lower batch_size (raise grad_accum) or block_size")


def open_data(config, model_config, world, master):
    """The data (prepared once by rank 0 when it is the embedded corpus) and the stream of training
    windows: the stable region, or the held-back tail for a decay branch."""
    if world > 1 and not config.data_dir:
        import torch.distributed as dist
        if master:
            load_data("")
        dist.barrier()
    data = load_data(config.data_dir)
    if model_config.vocab_size < data.meta["n_vocab"] or model_config.eot_token != data.meta["eot_token"]:
        raise ValueError(f"model vocab_size={model_config.vocab_size}, eot_token={model_config.eot_token} do not fit "
                         f"the data ({data.data_dir}: n_vocab={data.meta['n_vocab']}, eot_token={data.meta['eot_token']})")
    n, seq_len = len(data.train_tokens), model_config.block_size
    split = n - int(n * config.branch_data_fraction)
    if config.decay_branch:
        return data, TokenStream(data.train_tokens, seq_len, config.seed, split, n, "branch")
    return data, TokenStream(data.train_tokens, seq_len, config.seed, 0, split, "stable")


def build_model(run, model_config, device, world, region, use_bf16):
    """The model (sharded under FSDP), its optimizers and the training state: fresh, or from the source
    checkpoint (a ckpt.pt file: whole tensors, sharded as they load; a ckpt.dcp/ directory: loaded shard
    by shard onto however this run holds the parameters)."""
    config, source = run.config, run.source
    torch.manual_seed(config.seed)
    model = GPT(model_config).to(device)
    model.activation_checkpointing = config.activation_checkpointing
    if source is not None and not source.get("sharded"):
        model.load_state_dict(source["model"])
    if config.parallel == "fsdp":
        shard_model(model, config, device, world, use_bf16)
    optimizers = build_optimizers(model, config, ns_dtype(use_bf16))
    if source is None:
        return model, optimizers, TrainState(data_region=region, lr_scaling_params=grow.stored_params(model_config))
    if source.get("sharded"):
        checkpoint.load_sharded_tensors(source, model, optimizers, empty_optimizer_state)
    else:
        load_optimizer_state(optimizers, source["optimizer"]["state"])
    state = state_from_checkpoint(source, region)
    if config.decay_branch and not config.resume:  # a fresh branch from a stable checkpoint
        state.branch_start_step, state.last_eval = source["step"], None
    if config.resume and "rng" in source:
        torch.set_rng_state(source["rng"]["torch"])
    return model, optimizers, state


def plan_schedule(config, state, tokens_per_step):
    if config.decay_branch:  # a branch decays over decay_tokens from the step it forked at
        max_steps = state.branch_start_step + math.ceil(config.decay_tokens / tokens_per_step)
        decay_start = state.branch_start_step
    else:
        max_steps = math.ceil(config.max_tokens / tokens_per_step) if config.max_tokens > 0 else config.max_steps
        decay_start = max_steps - round(config.decay_fraction * max_steps)
    grow_step = grow.growth_step(max_steps, config.grow_at) if config.grow_at and not config.decay_branch else None
    lr_scale = lr_scaling(state.lr_scaling_params, config.lr_anchor_params, config.lr_scaling_beta)  # [X16]
    return Schedule(max_steps, decay_start, grow_step, lr_scale, config)


def check_data_budget(stream, state, schedule, seqs_per_step, log):
    """[S] trains without repetition: a decay branch that would reread its held-back data is refused;
    a stable phase that wraps into a second epoch says so."""
    needed = state.data_position + (schedule.max_steps - state.step) * seqs_per_step
    if needed <= stream.n_windows:
        return
    epochs = needed / stream.n_windows
    if state.data_region == "branch":
        raise ValueError(f"the decay branch needs {needed:,} windows of block_size + 1 tokens but the held-back "
                         f"data has {stream.n_windows:,} ({epochs:.2f} epochs): it would reread data. Lower "
                         "decay_tokens, or raise branch_data_fraction (for a new stable run)")
    log(f"note: this run reads {epochs:.2f} epochs of its {stream.n_windows:,} training windows: data repeats "
        "(log.jsonl has the epoch count)")


def grow_during_training(model, optimizers, config, device, world, use_bf16):
    """[X] growth: more passes (tied) or copied cores (untied); optimizers rebuilt with every parameter's
    state carried over by name (grow.copy_optimizer_state decides what copies get). Returns the model
    (grown in place; under FSDP a grown copy of the gathered model, sharded again) and its optimizers."""
    saved = optimizer_state_by_name(optimizers)["state"]
    if is_sharded(model):  # grow the whole model, then shard it again
        weights, saved = full_state(model.state_dict()), {n: full_state(s) for n, s in saved.items()}
        model = GPT(model.config).to(device)
        model.load_state_dict(weights)
        model.activation_checkpointing = config.activation_checkpointing
    param_map = grow.grow(model, config.grow_to, config.grow_untie)
    if config.parallel == "fsdp":
        shard_model(model, config, device, world, use_bf16)
    optimizers = build_optimizers(model, config, ns_dtype(use_bf16))
    load_optimizer_state(optimizers, grow.copy_optimizer_state(saved, param_map))
    return model, optimizers


def full_state(tensors):
    """{name: tensor} with every FSDP shard gathered into the whole tensor (a collective: every rank)."""
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in tensors.items()}


def ns_dtype(use_bf16):
    return torch.bfloat16 if use_bf16 else torch.float32  # Muon's Newton-Schulz arithmetic


def train_step(model, raw_model, optimizers, stream, state, config, n_passes, autocast, rank, world):
    """Forward/backward over grad_accum micro-batches (rank r reads its disjoint slice of the global batch),
    clip, step. Returns the mean training CE and the token offsets read."""
    device = next(raw_model.parameters()).device
    step_loss = torch.zeros((), dtype=torch.float64)
    offsets_read = []
    for micro in range(config.grad_accum):
        first = state.data_position + (rank * config.grad_accum + micro) * config.batch_size
        x, y, offsets = stream.batch(first, config.batch_size)
        offsets_read.append(offsets)
        last = micro == config.grad_accum - 1
        with gradient_sync(model, raw_model, sync=last or world == 1), autocast:
            _, loss = model(x.to(device), y.to(device), n_passes=n_passes)
            (loss / config.grad_accum).backward()
        step_loss += raw_model.last_stats["ce"].double().cpu() / config.grad_accum
    step_loss = all_reduce_sum(step_loss, world).item() / world
    if not math.isfinite(step_loss) or not math.isfinite(loss.item()):
        raise NonFiniteLoss(f"non-finite loss ({step_loss}) at step {state.step}")
    if config.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(raw_model.parameters(), config.grad_clip)
    for opt in optimizers:
        opt.step()
    for opt in optimizers:
        opt.zero_grad(set_to_none=True)
    return step_loss, np.concatenate(offsets_read)


def train(overrides=None):
    """Run one training run in this process. overrides: {setting: value} on top of DEFAULTS (and, with
    init_from / resume, on top of the checkpoint's own settings). Returns a summary dict."""
    run = resolve_run(dict(overrides or {}))
    rank, world, device = setup_distributed(run.config)
    model_config = model_config_from(run.model_settings, device.type)
    check_passes(model_config, run.config, grown=bool(run.source and run.source.get("grown")))
    check_memory(model_config, run.config, device, uses_bf16(run.config, device), world)
    if rank == 0:
        checkpoint.make_run_dir(run.run_dir)
    with checkpoint.run_dir_lock(run.run_dir) if rank == 0 else contextlib.nullcontext():
        return train_run(run, model_config, rank, world, device)


def uses_bf16(config, device):
    return config.dtype == "bfloat16" or (config.dtype == "auto" and device.type == "cuda")


def train_run(run, model_config, rank, world, device):
    config, master, sharded = run.config, rank == 0, run.config.parallel == "fsdp"
    log = tqdm.write if master else (lambda *args: None)
    use_bf16 = uses_bf16(config, device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if use_bf16 else contextlib.nullcontext()
    data, stream = open_data(config, model_config, world, master)
    raw_model, optimizers, state = build_model(run, model_config, device, world, stream.name, use_bf16)
    model = wrap_model(raw_model, config, device, world)
    seqs_per_step = config.batch_size * config.grad_accum * world
    tokens_per_step = seqs_per_step * model_config.block_size
    schedule = plan_schedule(config, state, tokens_per_step)
    check_data_budget(stream, state, schedule, seqs_per_step, log)
    ckpt_path = run.sharded_path if sharded else run.ckpt_path  # the checkpoint a resume continues
    if master:
        checkpoint.remove_stale_temp_files(run.run_dir)
        if config.resume:
            checkpoint.sync_log(run.log_path, run.source)
        elif os.path.exists(run.log_path):
            os.remove(run.log_path)
        counts = raw_model.num_params()
        log(f"run {run.run_dir}: {model_config.layout} n_layer={model_config.n_layer} n_embd={model_config.n_embd} "
            f"n_expert={model_config.n_expert} passes={current_passes(model_config)}; params total {counts['total']:,} "
            f"active {counts['active']:,}; {tokens_per_step:,} tokens/step x {schedule.max_steps} steps; "
            f"world_size {world}{' (FSDP)' if sharded else ''}; device {device}"
            f"{' with bf16 autocast' if use_bf16 else ''}")
        log(f"data {data.data_dir}: {len(data.train_tokens):,} train tokens ({stream.name} region "
            f"[{stream.start:,}, {stream.stop:,})), unigram entropy of the train split {data.unigram_entropy:.3f} nats")

    def evaluate_and_record(train_loss, passes_seen, lr):
        result = evaluate(raw_model, data, stream.seq_len, config.eval_tokens, config.batch_size, autocast, rank, world)
        return dict(step=state.step, tokens=state.tokens_seen, flops=state.flops_seen,
                    flops_by_passes={str(k): v for k, v in sorted(state.flops_by_passes.items())},
                    lr=lr, train_loss=train_loss, **result, epochs=state.data_position / stream.n_windows,
                    n_passes=passes_seen or current_passes(raw_model.config), seconds=round(time.time() - t0, 3),
                    **({"peak_memory_gb": torch.cuda.max_memory_allocated(device) / 2**30}
                       if device.type == "cuda" else {}))

    def save(path):  # a sharded checkpoint: every rank its shards; a file: rank 0. Never non-finite weights.
        if sharded:
            checkpoint.save_sharded(path, checkpoint_dict(raw_model, optimizers, config, state, data))
        elif master:
            checkpoint.save_file(path, checkpoint_dict(raw_model, optimizers, config, state, data))

    def append_log(record):
        if master:
            with open(run.log_path, "a") as f:
                f.write(json.dumps(record) + "\n")

    # ---- the loop
    t0 = time.time()
    lr, train_losses, window, passes_seen, offsets_read, flops_of = 0.0, [], [], [], [], {}
    saved_step = state.step if config.resume else None
    if run.source is None:
        state.last_eval = evaluate_and_record(None, None, 0.0)
        append_log(state.last_eval)
    if state.step >= schedule.max_steps:
        log(f"{run.run_dir} has already finished: step {state.step} of max_steps {schedule.max_steps}. Raise "
            "--max_steps to train further.")
    bar = tqdm(total=schedule.max_steps, initial=state.step, disable=not (master and config.progress),
               desc=config.run_name, unit="step", dynamic_ncols=True)
    try:
        while state.step < schedule.max_steps:
            if state.step == schedule.grow_step and not state.grown:  # [X] growth, once
                raw_model, optimizers = grow_during_training(raw_model, optimizers, config, device, world, use_bf16)
                model, state.grown = wrap_model(raw_model, config, device, world), True
                log(f"step {state.step}: grew to {current_passes(raw_model.config)} passes"
                    f"{' (untied)' if not raw_model.config.tie_core else ''}")
            lr = set_learning_rates(optimizers, schedule.lr_multiplier(state.step))
            n_passes = passes_of_step(config, state.step)
            loss, offsets = train_step(model, raw_model, optimizers, stream, state, config, n_passes, autocast,
                                       rank, world)
            k = n_passes or current_passes(raw_model.config)
            if k not in flops_of:
                flops_of[k] = flops_per_token(raw_model.config, n_passes, config.avg_doc_len) * tokens_per_step
            state.step, state.tokens_seen = state.step + 1, state.tokens_seen + tokens_per_step
            state.data_position += seqs_per_step
            state.flops_seen += flops_of[k]
            state.flops_by_passes[k] = state.flops_by_passes.get(k, 0.0) + flops_of[k]
            train_losses.append(loss)
            window.append(loss)
            passes_seen.append(k)
            offsets_read.append(offsets)
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}", lr=f"{lr:.2e}")
            stop = state.step == config.stop_at_step
            if state.step % config.eval_interval == 0 or state.step == schedule.max_steps or stop:
                state.last_eval = evaluate_and_record(sum(window) / len(window), sum(passes_seen) / len(passes_seen), lr)
                save(ckpt_path)  # the checkpoint first, then its log line: the log never runs ahead
                saved_step = state.step
                append_log(state.last_eval)
                window, passes_seen = [], []
                bar.set_postfix(loss=f"{loss:.3f}", val=f"{state.last_eval['val_loss']:.3f}")
            if state.step in config.save_steps:
                save(os.path.join(run.run_dir, f"ckpt_step{state.step}{'.dcp' if sharded else '.pt'}"))
            if stop:
                break
    except NonFiniteLoss as e:
        last = ckpt_path if saved_step is not None else "none written yet"
        raise NonFiniteLoss(f"{e}. Stopped; the last good checkpoint is kept: {last}. Lower the learning "
                            "rates or check the data.") from None
    except KeyboardInterrupt:
        where = (f"the last checkpoint is {ckpt_path} (step {saved_step}); continue with: python train.py "
                 f"--out_dir={config.out_dir} --run_name={config.run_name} --resume=True" if saved_step is not None
                 else "no checkpoint was written yet")
        raise TrainingInterrupted(f"interrupted at step {state.step}: {where}") from None
    finally:
        bar.close()

    sample_model = raw_model
    if sharded:  # the consolidated weights: one file that eval_core, probe, grow and sample load
        weights = full_state(raw_model.state_dict())
        sample_model = None
        if master:
            ckpt = checkpoint_dict(raw_model, optimizers, config, state, data) | dict(model=weights, optimizer=None)
            checkpoint.save_file(run.ckpt_path, ckpt)
            if raw_model.num_params()["total"] < 1e9:  # small enough to sample from in one process
                sample_model = GPT(raw_model.config)
                sample_model.load_state_dict(weights)
    final = state.last_eval or {}
    read = np.concatenate(offsets_read) if offsets_read else np.zeros(0, dtype=np.int64)
    summary = dict(run_dir=run.run_dir, ckpt_path=run.ckpt_path, resume_path=ckpt_path, log_path=run.log_path,
                   step=state.step, max_steps=schedule.max_steps, tokens=state.tokens_seen, flops=state.flops_seen,
                   val_loss=final.get("val_loss"), val_loss_by_source=final.get("val_loss_by_source"),
                   train_losses=train_losses, unigram_entropy=data.unigram_entropy, data_region=stream.name,
                   data_read=(int(read.min()), int(read.max()) + stream.seq_len + 1) if len(read) else None,
                   data_split=stream.stop if stream.name == "stable" else stream.start,
                   seconds=time.time() - t0, world_size=world, rank=rank)
    if master:
        if summary["val_loss"] is not None:
            print(f"step {state.step}: val loss {summary['val_loss']:.4f} nats vs unigram entropy "
                  f"{data.unigram_entropy:.4f} ({state.tokens_seen:,} tokens, {state.flops_seen:.3e} FLOPs, "
                  f"{summary['seconds']:.0f} s)")
        print(f"checkpoint: {run.ckpt_path}{f' (resume from {ckpt_path})' if sharded else ''}\n"
              f"log:        {run.log_path}")
        if config.sample and data.meta.get("tokenizer") and sample_model is not None:
            text = sample_text(sample_model, get_tokenizer(data.meta["tokenizer"]), max_new_tokens=64,
                               temperature=0.8, top_k=200, seed=config.seed)
            print(f"sample (more with: python sample.py --ckpt {run.ckpt_path}):\n{text}")
    return summary


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(usage())
        return 0
    try:
        train(parse_args(argv))
    except TrainingInterrupted as e:
        print(f"\ntrain.py: {e}", file=sys.stderr)
        return 130
    except (ValueError, OSError, NonFiniteLoss) as e:
        return cli_error("train.py", e)
    finally:
        end_distributed()
    return 0


def end_distributed():
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    status = main()
    if "RANK" in os.environ and not torch.cuda.is_available():
        # gloo's worker threads can outlive destroy_process_group and abort the interpreter's shutdown
        # after FSDP2 collectives ("terminate called without an active exception", about 1 run in 10 on
        # CPU; a torch issue without an upstream fix). Everything is written and flushed: leave directly.
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(status)
    sys.exit(status)
