"""
Train one model: Muon/AdamW, a warmup-stable-decay (WSD) schedule with decay branches, growth of the
number of passes mid-training, gradient accumulation, DDP, exact resume. nanoGPT style: the defaults
below train the tiny looped MoE (config/tiny.py) on the embedded Shakespeare corpus on a CPU.

    python train.py                                     # tiny default on CPU, a few minutes
    python train.py config/tiny.py --max_steps=100      # a config file, then --key=value overrides
    python train.py --optimizer=adamw --n_loops=1       # any setting below and any ModelConfig field

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
assignments one expert got in any MoE layer; 1/n_expert is perfect balance), n_passes, seconds.

Data order: the train split is cut into windows of block_size + 1 tokens, read in a seeded random
order per epoch; the data position (windows consumed) is in the checkpoint. The last
branch_data_fraction of the train split is held back: stable runs never read it, decay branches
read only it, so a branch always trains on data its stable phase has not seen.

Growth (grow_at, grow_to, grow_untie): at the growth step grow.grow changes the live model in place,
the optimizers are rebuilt for the new parameter list and every parameter's state is carried over by
name; grow.copy_optimizer_state decides what copies of untied cores get (fresh state by default).
The LR re-warms from 0 over grow_rewarm_steps. A checkpoint saved before the growth step resumes into it.

In-process use (the ladder): `summary = train.train({"max_steps": 100, "n_embd": 64})`.
"""

import ast
import contextlib
import json
import math
import os
import sys
import time
from dataclasses import asdict, fields

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

import match
from model import GPT, ModelConfig, execution_plan, save_checkpoint
from muon import Muon
from model import read_config_file as read_assignments

REPO_DIR = os.path.dirname(os.path.abspath(__file__))

# ----------------------------------------------------------------------------------------------------
# Settings: training defaults + every ModelConfig field (one source of truth: the dataclass), with the
# tiny default model (config/tiny.py states the same values) on top.

TRAIN_DEFAULTS = dict(
    # I/O
    out_dir="out",  # the run lives in out_dir/run_name/
    run_name="",  # "" -> "tiny", or "<source run>_decay<step>" for a decay branch
    eval_interval=50,  # eval + log + ckpt.pt every this many steps (and at the end)
    eval_tokens=8192,  # validation tokens per eval (fixed windows spread evenly over the val split)
    save_steps=[],  # extra checkpoints ckpt_step<N>.pt after N steps, to branch from later
    progress=True,  # tqdm bar
    # data
    data_dir="",  # "" -> the embedded corpus, prepared into data/cache/default when missing
    branch_data_fraction=0.1,  # tail of the train split reserved for decay branches
    seed=1337,
    # batch: global batch = batch_size * grad_accum * world_size sequences of block_size tokens
    batch_size=16,
    grad_accum=1,
    max_steps=200,
    max_tokens=0,  # > 0: max_steps = ceil(max_tokens / tokens per step)
    stop_at_step=0,  # > 0: save and stop after this step without changing the schedule (preemption)
    # optimizer
    optimizer="muon",  # "muon": Muon on hidden matrices + AdamW on the rest; "adamw": AdamW on all
    matrix_lr=0.02,  # Muon LR of hidden matrices (attention, dense MLP, experts)
    adamw_matrix_lr=3e-3,  # AdamW LR of hidden matrices when optimizer="adamw"
    embedding_lr=0.1,
    unembedding_lr=0.004,
    router_lr=3e-3,  # MoE routers always use AdamW (see param_groups)
    scalar_lr=0.01,  # norm gains and other vectors
    weight_decay=0.0,  # decoupled, on hidden matrices only
    adam_betas=(0.8, 0.95),
    adam_eps=1e-10,
    muon_momentum=0.95,
    muon_nesterov=True,
    muon_ns_steps=5,
    grad_clip=1.0,  # 0 -> off
    # [X16] LR scaling rule: every LR x (N / lr_anchor_params)^lr_scaling_beta, N = initial stored
    # non-embedding params; lr_anchor_params=0 -> off
    lr_anchor_params=0,
    lr_scaling_beta=0.0,
    # WSD schedule [S]
    warmup_steps=20,
    decay_fraction=0.3,  # last fraction of max_steps decays; 0.0 -> stable to the end (branch later)
    decay_shape="cosine",  # "cosine" or "linear"
    min_lr_fraction=0.0,  # the floor: LR at the last step = min_lr_fraction * peak LR
    # decay branches: fork from a stable checkpoint, decay over decay_tokens on held-back data
    init_from="",  # checkpoint path to start from (weights, optimizer state, step, tokens, flops)
    decay_branch=False,
    decay_tokens=0,
    resume=False,  # continue out_dir/run_name/ckpt.pt
    # number of passes
    n_passes_choices=[],  # e.g. [1, 2, 3]: each step runs K (or r) drawn uniformly, seeded by (seed, step)
    grow_at=0.0,  # growth step (>= 1) or fraction of max_steps (< 1); 0 -> no growth
    grow_to=0,  # passes after growth (K for pcc, r for smelt / layer_loop)
    grow_untie=False,  # untie the core: copies C1 C2 -> C1 C2 C1 C2 (grow.py)
    grow_rewarm_steps=0,  # LR re-warm after growth: 0 at the growth step, linear to 1 ([X] code: 40)
    avg_doc_len=0,  # mean document length for the attention term of the logged FLOPs; 0 -> block_size
    # system
    device="auto",  # "auto": cuda if available else cpu
    dtype="auto",  # "auto": bfloat16 autocast on CUDA, float32 on CPU; or "float32" / "bfloat16"
    compile=False,  # torch.compile the model
)

# the tiny default: a SMELT-looped MoE [S] that trains on 2 CPU cores in a few minutes
TINY_MODEL = dict(
    vocab_size=4096, eot_token=4095, block_size=128,
    n_layer=4, n_embd=128, n_head=4,
    n_expert=8, top_k=2,
    layout="smelt", n_loops=2,  # the middle 2 of 4 layers run twice, updates scaled by 1/2 [S8]-[S9]
)

MODEL_DEFAULTS = {f.name: f.default for f in fields(ModelConfig)} | TINY_MODEL
DEFAULTS = TRAIN_DEFAULTS | MODEL_DEFAULTS
MODEL_KEYS = frozenset(f.name for f in fields(ModelConfig))
# per command: never carried over from the checkpoint a run forks (init_from) / continues (resume)
NOT_INHERITED_FORK = ("run_name", "init_from", "decay_branch", "decay_tokens", "resume", "stop_at_step",
                      "save_steps", "progress")
NOT_INHERITED_RESUME = ("resume", "stop_at_step", "progress")


def check_setting(key, value, where="setting"):
    """Type-check one setting against its default; returns the (normalised) value."""
    if key not in DEFAULTS:
        close = [k for k in DEFAULTS if k.split("_")[0] == key.split("_")[0]][:5]
        hint = f" (similar: {', '.join(close)})" if close else ""
        raise ValueError(f"unknown {where} {key!r}{hint}; run `python train.py --help` for the list")
    default = DEFAULTS[key]
    if default is None:  # Optional[bool] model fields (use_triton)
        ok = value is None or isinstance(value, bool)
        expected = "None or bool"
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


def read_config_file(path):
    """A nanoGPT-style config file (python assignments) -> {key: value}, every key checked."""
    values = read_assignments(path)
    return {k: check_setting(k, v, where=f"key in {path}") for k, v in values.items()}


def parse_args(argv):
    """[config/NAME.py ...] [--key=value ...] -> overrides dict. Values are python literals
    (literal_eval), anything else is a string; unknown keys and wrong types raise ValueError."""
    overrides = {}
    for arg in argv:
        if not arg.startswith("--"):
            overrides.update(read_config_file(arg))
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
    """DEFAULTS, then `base` (a checkpoint's train_config), then overrides; every key checked."""
    settings = dict(DEFAULTS)
    for key, value in (base or {}).items():
        if key in DEFAULTS and key not in not_inherited:
            settings[key] = value
    for key, value in overrides.items():
        settings[key] = check_setting(key, value)
    s = settings
    if s["optimizer"] not in ("muon", "adamw"):
        raise ValueError(f"optimizer={s['optimizer']!r}: must be 'muon' or 'adamw'")
    if s["decay_shape"] not in ("cosine", "linear"):
        raise ValueError(f"decay_shape={s['decay_shape']!r}: must be 'cosine' or 'linear'")
    if not 0.0 <= s["decay_fraction"] <= 1.0 or not 0.0 <= s["min_lr_fraction"] <= 1.0:
        raise ValueError("decay_fraction and min_lr_fraction must be in [0, 1]")
    if not 0.0 <= s["branch_data_fraction"] < 1.0:
        raise ValueError(f"branch_data_fraction={s['branch_data_fraction']}: must be in [0, 1)")
    for key in ("batch_size", "grad_accum", "eval_interval"):
        if s[key] < 1:
            raise ValueError(f"{key}={s[key]}: must be >= 1")
    if s["decay_branch"] and (not s["init_from"] or s["decay_tokens"] <= 0):
        raise ValueError("decay_branch=True needs init_from=<stable checkpoint> and decay_tokens > 0")
    if s["decay_branch"] and s["branch_data_fraction"] == 0.0:
        raise ValueError("decay_branch=True needs branch_data_fraction > 0 (the held-back data it reads)")
    if s["grow_at"] and s["grow_to"] < 1:
        raise ValueError(f"grow_at={s['grow_at']} needs grow_to >= 1 (passes after growth)")
    return settings


def model_config_from(settings):
    return ModelConfig.from_dict({k: settings[k] for k in MODEL_KEYS})


# ----------------------------------------------------------------------------------------------------
# Data: seeded windows of the train split; a held-back tail for decay branches


class TokenStream:
    """Windows of seq_len + 1 tokens of tokens[start:stop], read in a seeded random order per epoch.
    Window number n (counting from 0 over the whole run) is deterministic given (seed, n), so a
    checkpoint only needs n (the data position) and every DDP rank computes the same order."""

    def __init__(self, tokens, seq_len, seed, start=0, stop=None, name="train"):
        stop = len(tokens) if stop is None else stop
        self.tokens, self.seq_len, self.seed, self.start, self.stop = tokens, seq_len, seed, start, stop
        self.n_windows = (stop - start - 1) // seq_len
        if self.n_windows < 1:
            raise ValueError(f"{name} data has {stop - start} tokens: fewer than block_size + 1 = {seq_len + 1}")
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


def load_data(data_dir):
    """(train tokens, val tokens, meta, val source id per token or None) of a data/prepare.py folder."""
    from data import prepare as prep
    if not data_dir:
        data_dir = prep.prepare_default(prep.DEFAULT_OUT)  # builds it once, offline
    meta = prep.load_meta(data_dir)  # FileNotFoundError / ValueError naming the file when missing/corrupt
    train_tokens, val_tokens = prep.load_split(data_dir, "train"), prep.load_split(data_dir, "val")
    val_sources = None
    if len(meta.get("sources", [])) > 1:
        val_sources = prep.token_source_ids(prep.load_sources(data_dir, "val"), len(val_tokens))
    return train_tokens, val_tokens, meta, val_sources, data_dir


def unigram_entropy(tokens, n_vocab):
    """Entropy (nats/token) of the token frequencies: the loss of the best context-free model."""
    counts = np.bincount(np.asarray(tokens), minlength=n_vocab).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


# ----------------------------------------------------------------------------------------------------
# Optimizers: Muon for hidden matrices, AdamW for the rest


def param_groups(model, settings):
    """Every parameter in exactly one named group: (name, optimizer kind, lr, weight decay, [(name, p)]).
    Muon takes the hidden matrices (2-D, and 3-D stacked experts). AdamW takes the token embedding,
    the lm head (their rows are per-token vectors, not operators between hidden states), norm gains
    and other vectors, and the MoE routers: a router's few rows set the routing logits' scale, which
    Muon's fixed spectral-norm steps would push around; AdamW keeps them small and adaptive."""
    s = settings
    muon = s["optimizer"] == "muon"
    groups = {
        "matrix": ("muon" if muon else "adamw", s["matrix_lr"] if muon else s["adamw_matrix_lr"], s["weight_decay"]),
        "embedding": ("adamw", s["embedding_lr"], 0.0),
        "unembedding": ("adamw", s["unembedding_lr"], 0.0),
        "router": ("adamw", s["router_lr"], 0.0),
        "scalar": ("adamw", s["scalar_lr"], 0.0),
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


def build_optimizers(model, settings):
    """[AdamW, Muon (if any)]; each group remembers base_lr and its parameters' names."""
    s = settings
    adamw, muon = [], []
    for name, kind, lr, wd, named in param_groups(model, s):
        group = dict(params=[p for _, p in named], param_names=[n for n, _ in named], name=name,
                     lr=lr, base_lr=lr, weight_decay=wd)
        (muon if kind == "muon" else adamw).append(group)
    optimizers = [torch.optim.AdamW(adamw, betas=tuple(s["adam_betas"]), eps=s["adam_eps"], fused=False)]
    if muon:
        optimizers.append(Muon(muon, momentum=s["muon_momentum"], nesterov=s["muon_nesterov"],
                               ns_steps=s["muon_ns_steps"], use_triton=s["use_triton"]))
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
                    state[name] = {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in opt.state[p].items()}
    return {"state": state, "param_groups": groups}


def load_optimizer_state(optimizers, state_by_name):
    """Put saved per-parameter state back by name (parameters without saved state start fresh)."""
    for opt in optimizers:
        for group in opt.param_groups:
            for p, name in zip(group["params"], group["param_names"]):
                if name in state_by_name:
                    opt.state[p] = {k: v.to(p.device) if torch.is_tensor(v) and v.dim() > 0 else v
                                    for k, v in state_by_name[name].items()}


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


def current_passes(cfg):
    """The configured K (pcc) or r (smelt, layer_loop); 1 for plain."""
    return cfg.n_passes if cfg.layout == "pcc" else cfg.n_loops if cfg.layout != "plain" else 1


def flops_per_token(cfg, n_passes=None, avg_doc_len=0):
    """Training FLOPs per token (forward + backward) of the executed plan, every block execution
    counted (match.py): attention at the causal average of avg_doc_len keys (what the document mask
    leaves), or of a full block_size context when avg_doc_len is 0."""
    return float(match.flops_per_token(cfg, n_passes=n_passes, avg_doc_len=avg_doc_len or None))


# ----------------------------------------------------------------------------------------------------
# Distributed


def setup_distributed(device_setting):
    """(rank, world_size, device); initialises the process group under torchrun."""
    if "RANK" not in os.environ:
        device = device_setting if device_setting != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        return 0, 1, torch.device(device)
    import torch.distributed as dist
    rank, world, local_rank = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    use_cuda = device_setting.startswith("cuda") or (device_setting == "auto" and torch.cuda.is_available())
    if use_cuda:
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    return rank, world, torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")


def all_reduce_sum(tensor, world):
    if world > 1:
        import torch.distributed as dist
        dist.all_reduce(tensor)
    return tensor


# ----------------------------------------------------------------------------------------------------
# Evaluation


@torch.no_grad()
def evaluate(model, val_tokens, val_sources, source_names, seq_len, eval_tokens, batch_size, device,
             autocast, rank=0, world=1):
    """Token-weighted validation CE over eval_tokens of the val split (the same windows every eval, evenly
    spread over the split so every source is in; split across ranks), per source when sources exist,
    and router statistics for MoE."""
    raw = model
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
    was_training = raw.training
    raw.eval()
    for i in range(0, len(mine), batch_size):
        offsets = starts[mine[i:i + batch_size]]
        rows = torch.from_numpy(np.stack([np.asarray(val_tokens[o:o + seq_len + 1], dtype=np.int64) for o in offsets]))
        x, y = rows[:, :-1].to(device), rows[:, 1:].to(device)
        with autocast:
            logits, _ = raw(x, y)
        ce = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="none").double().cpu()
        loss_sum[0] += ce.sum()
        count[0] += ce.numel()
        if n_sources:
            src = torch.from_numpy(np.stack([val_sources[o + 1:o + seq_len + 1] for o in offsets])).flatten()
            loss_sum[1:] += torch.zeros(n_sources, dtype=torch.float64).index_add_(0, src, ce)
            count[1:] += torch.bincount(src, minlength=n_sources).double()
        stats = raw.last_stats
        if "balance" in stats:
            router += torch.tensor([stats["balance"].item(), stats["z_loss"].item()], dtype=torch.float64)
            n_batches += 1
            c = stats["expert_counts"].double().cpu()
            expert_counts = c if expert_counts is None else expert_counts + c
    raw.train(was_training)
    all_reduce_sum(loss_sum, world), all_reduce_sum(count, world)
    out = {"val_loss": (loss_sum[0] / count[0]).item()}
    if n_sources:
        out["val_loss_by_source"] = {name: (loss_sum[1 + j] / count[1 + j]).item()
                                     for j, name in enumerate(source_names) if count[1 + j] > 0}
    if raw.config.n_expert:
        all_reduce_sum(router, world), all_reduce_sum(n_batches, world)
        if expert_counts is None:
            expert_counts = torch.zeros(1, raw.config.n_expert, dtype=torch.float64)
        all_reduce_sum(expert_counts, world)
        fraction = expert_counts / expert_counts.sum(dim=-1, keepdim=True).clamp(min=1)
        out.update(balance=(router[0] / n_batches.clamp(min=1)).item(),
                   z_loss=(router[1] / n_batches.clamp(min=1)).item(),
                   expert_load_max=fraction.max().item(), expert_load_min=fraction.min().item())
    return out


# ----------------------------------------------------------------------------------------------------
# Checkpoints


class NonFiniteLoss(RuntimeError):
    pass


def write_checkpoint(path, model, optimizers, settings, state, data_dir, tokenizer):
    """The shared checkpoint dict (see HELPER_COMMON / model.GPT.from_checkpoint), written atomically."""
    rng = {"torch": torch.get_rng_state(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    ckpt = {
        "model_config": asdict(model.config),
        "model": model.state_dict(),
        "optimizer": optimizer_state_by_name(optimizers),
        "step": state["step"],
        "tokens_seen": state["tokens_seen"],
        "flops_seen": state["flops_seen"],
        "flops_by_passes": dict(state["flops_by_passes"]),
        "data_position": {"region": state["data_region"], "windows": state["data_position"]},
        "branch_start_step": state["branch_start_step"],
        "grown": state["grown"],
        "rng": rng,
        "train_config": {k: v for k, v in settings.items() if k not in MODEL_KEYS},
        "tokenizer": tokenizer,
        "data_dir": data_dir,
    }
    save_checkpoint(ckpt, path)  # temp file + os.replace: a crash never destroys the previous file


def load_checkpoint(path):
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint not found: {path}")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:
        raise ValueError(f"cannot read checkpoint {path}: {e}") from e
    for key in ("model_config", "model", "optimizer", "step", "train_config"):
        if key not in ckpt:
            raise ValueError(f"{path} is not a train.py checkpoint (missing {key!r})")
    return ckpt


# ----------------------------------------------------------------------------------------------------
# Training


def train(overrides=None):
    """Run one training run in this process. overrides: {setting: value} on top of DEFAULTS (and, with
    init_from / resume, on top of the checkpoint's own train_config). Returns a summary dict."""
    overrides = dict(overrides or {})
    for key, value in overrides.items():
        check_setting(key, value)
    # ---- where we start: scratch, a checkpoint to fork (init_from), or our own checkpoint (resume)
    source_ckpt, source_path = None, None
    base = DEFAULTS | overrides
    if base["resume"] and base["init_from"]:
        raise ValueError("use either resume=True (continue out_dir/run_name/ckpt.pt) or init_from, not both")
    if base["init_from"]:
        source_path = base["init_from"]
    elif base["resume"]:
        source_path = os.path.join(base["out_dir"], base["run_name"] or "tiny", "ckpt.pt")
    if source_path:
        source_ckpt = load_checkpoint(source_path)
        model_keys = sorted(k for k in overrides if k in MODEL_KEYS and
                            overrides[k] != source_ckpt["model_config"].get(k))
        if model_keys:
            raise ValueError(f"model settings {model_keys} differ from the checkpoint {source_path}; "
                             "the model comes from the checkpoint")
    S = resolve_settings(overrides, base=source_ckpt["train_config"] if source_ckpt else None,
                         not_inherited=NOT_INHERITED_RESUME if base["resume"] else NOT_INHERITED_FORK)
    if not S["run_name"]:
        if S["decay_branch"]:
            S["run_name"] = f"{source_ckpt['train_config'].get('run_name') or 'run'}_decay{source_ckpt['step']}"
        else:
            S["run_name"] = "tiny"
    grow = None
    if S["grow_at"] and not S["decay_branch"]:
        try:
            import grow
        except ImportError:
            raise RuntimeError("growth (grow_at/grow_to) needs grow.py (grow.grow, grow.copy_optimizer_state), "
                               "which is not importable in this checkout") from None

    rank, world, device = setup_distributed(S["device"])
    master = rank == 0
    torch.manual_seed(S["seed"])
    use_bf16 = S["dtype"] == "bfloat16" or (S["dtype"] == "auto" and device.type == "cuda")
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if use_bf16 else contextlib.nullcontext()

    # ---- data (the embedded corpus is prepared once, by rank 0, when missing)
    if world > 1 and not S["data_dir"]:
        import torch.distributed as dist
        if master:
            load_data("")
        dist.barrier()
    train_tokens, val_tokens, meta, val_sources, data_dir = load_data(S["data_dir"])
    # ---- model
    if source_ckpt is not None:
        cfg = ModelConfig.from_dict(source_ckpt["model_config"])
        for key in MODEL_KEYS:
            S[key] = getattr(cfg, key) if key in source_ckpt["model_config"] else S[key]
    else:
        cfg = model_config_from(S)
    if cfg.vocab_size < meta["n_vocab"] or cfg.eot_token != meta["eot_token"]:
        raise ValueError(f"model vocab_size={cfg.vocab_size}, eot_token={cfg.eot_token} do not fit the data "
                         f"({data_dir}: n_vocab={meta['n_vocab']}, eot_token={meta['eot_token']})")
    raw_model = GPT(cfg).to(device)
    if source_ckpt is not None:
        raw_model.load_state_dict(source_ckpt["model"])
    seq_len = cfg.block_size
    split = len(train_tokens) - int(len(train_tokens) * S["branch_data_fraction"])
    region = "branch" if S["decay_branch"] else "stable"
    stream = (TokenStream(train_tokens, seq_len, S["seed"], split, len(train_tokens), "held-back branch")
              if region == "branch" else TokenStream(train_tokens, seq_len, S["seed"], 0, split, "train"))

    # ---- state
    seqs_per_step = S["batch_size"] * S["grad_accum"] * world
    tokens_per_step = seqs_per_step * seq_len
    state = dict(step=0, tokens_seen=0, flops_seen=0.0, flops_by_passes={}, data_region=region,
                 data_position=0, branch_start_step=None, grown=False)
    if source_ckpt is not None:
        state.update(step=source_ckpt["step"], tokens_seen=source_ckpt.get("tokens_seen", 0),
                     flops_seen=source_ckpt.get("flops_seen", 0.0),
                     flops_by_passes=dict(source_ckpt.get("flops_by_passes", {})),
                     branch_start_step=source_ckpt.get("branch_start_step"),
                     grown=source_ckpt.get("grown", False))
        position = source_ckpt.get("data_position") or {}
        if position.get("region", "stable") == region:  # continue where it stopped reading
            state["data_position"] = position.get("windows", 0)
        if S["decay_branch"] and not S["resume"]:  # a fresh branch from a stable checkpoint
            state["branch_start_step"] = source_ckpt["step"]
        if S["resume"] and "rng" in source_ckpt:
            torch.set_rng_state(source_ckpt["rng"]["torch"])
    # ---- schedule
    if S["decay_branch"]:
        start = state["branch_start_step"]
        decay_steps = math.ceil(S["decay_tokens"] / tokens_per_step)
        max_steps, decay_start = start + decay_steps, start
    else:
        max_steps = math.ceil(S["max_tokens"] / tokens_per_step) if S["max_tokens"] > 0 else S["max_steps"]
        decay_start = max_steps - round(S["decay_fraction"] * max_steps)
    grow_step = 0
    if S["grow_at"] and not S["decay_branch"]:  # a step (>= 1) or int(fraction * max_steps)
        grow_step = grow.growth_step(max_steps, S["grow_at"])
    # [X16] N = stored non-embedding params at initialisation (kept through growth, forks and resumes)
    S["_glr_params"] = ((source_ckpt or {}).get("train_config", {}).get("_glr_params")
                        or raw_model.num_params()["non_embedding"])
    glr = lr_scaling(S["_glr_params"], S["lr_anchor_params"], S["lr_scaling_beta"])

    def wrap(m):
        if S["compile"]:
            m = torch.compile(m)
        if world > 1:
            from torch.nn.parallel import DistributedDataParallel
            m = DistributedDataParallel(m, device_ids=[device.index] if device.type == "cuda" else None)
        return m

    model = wrap(raw_model)
    optimizers = build_optimizers(raw_model, S)
    if source_ckpt is not None:
        load_optimizer_state(optimizers, source_ckpt["optimizer"]["state"])

    # ---- output
    run_dir = os.path.join(S["out_dir"], S["run_name"])
    ckpt_path, log_path = os.path.join(run_dir, "ckpt.pt"), os.path.join(run_dir, "log.jsonl")
    entropy = float(meta.get("unigram_entropy_train_nats") or unigram_entropy(train_tokens, meta["n_vocab"]))
    if master:
        os.makedirs(run_dir, exist_ok=True)
        if not S["resume"] and os.path.exists(log_path):
            os.remove(log_path)
        counts = raw_model.num_params()
        print(f"run {run_dir}: {cfg.layout} n_layer={cfg.n_layer} n_embd={cfg.n_embd} n_expert={cfg.n_expert} "
              f"passes={current_passes(cfg)}; params total {counts['total']:,} active {counts['active']:,}; "
              f"{tokens_per_step:,} tokens/step x {max_steps} steps; world_size {world}; device {device}")
        print(f"data {data_dir}: {len(train_tokens):,} train tokens ({region} region "
              f"[{stream.start:,}, {stream.stop:,})), unigram entropy of the train split {entropy:.3f} nats")

    def save(path):
        if master:
            write_checkpoint(path, raw_model, optimizers, S, state, data_dir, meta.get("tokenizer"))

    def log_eval(train_loss, passes_seen, t0):
        result = evaluate(raw_model, val_tokens, val_sources, meta.get("sources", []), seq_len, S["eval_tokens"],
                          S["batch_size"], device, autocast, rank, world)
        record = dict(step=state["step"], tokens=state["tokens_seen"], flops=state["flops_seen"],
                      flops_by_passes={str(k): v for k, v in sorted(state["flops_by_passes"].items())},
                      lr=last_lr[0], train_loss=train_loss, **result,
                      n_passes=passes_seen or current_passes(raw_model.config),
                      seconds=round(time.time() - t0, 3))
        if master:
            with open(log_path, "a") as f:
                f.write(json.dumps(record) + "\n")
        return record

    # ---- the loop
    t0 = time.time()
    last_lr = [0.0]
    train_losses, records = [], []
    window_sum, window_n, passes_seen = 0.0, 0, []
    read_lo, read_hi = None, None
    flops_cache = {}
    if not S["resume"] and source_ckpt is None:
        records.append(log_eval(None, None, t0))
    bar = tqdm(total=max_steps, initial=state["step"], disable=not (master and S["progress"]),
               desc=S["run_name"], unit="step", dynamic_ncols=True)
    while state["step"] < max_steps:
        step = state["step"]
        # growth [X]: more passes (tied) or copied cores (untied), optimizer state carried by name
        if grow_step and step == grow_step and not state["grown"]:
            saved = optimizer_state_by_name(optimizers)["state"]
            param_map = grow.grow(raw_model, S["grow_to"], S["grow_untie"])
            raw_model.plan = execution_plan(raw_model.config)
            carried = grow.copy_optimizer_state(saved, param_map)  # grow.py decides the copies' state
            optimizers = build_optimizers(raw_model, S)
            load_optimizer_state(optimizers, carried)
            model = wrap(raw_model)
            state["grown"] = True
            flops_cache.clear()
            if master:
                tqdm.write(f"step {step}: grew to {current_passes(raw_model.config)} passes"
                           f"{' (untied)' if not raw_model.config.tie_core else ''}")
        # learning rate: WSD x [X16] scaling x re-warm after growth
        multiplier = wsd_multiplier(step, S["warmup_steps"], decay_start, max_steps, S["decay_shape"],
                                    S["min_lr_fraction"]) * glr
        if grow_step:  # [X] code: 0 at the growth step, linear back to 1 over grow_rewarm_steps
            multiplier *= grow.rewarm_multiplier(step, grow_step, S["grow_rewarm_steps"])
        for opt in optimizers:
            for group in opt.param_groups:
                group["lr"] = group["base_lr"] * multiplier
        last_lr[0] = optimizers[-1].param_groups[0]["lr"]
        # passes this step: fixed, or uniform over n_passes_choices seeded by (seed, step)
        n_passes = None
        if S["n_passes_choices"]:
            n_passes = int(np.random.default_rng([S["seed"], step, 1]).choice(S["n_passes_choices"]))
        k = n_passes or current_passes(raw_model.config)
        # forward/backward over grad_accum micro-batches; rank r reads its disjoint slice of the global batch
        step_loss = torch.zeros((), dtype=torch.float64)
        for micro in range(S["grad_accum"]):
            first = state["data_position"] + (rank * S["grad_accum"] + micro) * S["batch_size"]
            x, y, offsets = stream.batch(first, S["batch_size"])
            lo, hi = int(offsets.min()), int(offsets.max()) + seq_len + 1
            read_lo = lo if read_lo is None else min(read_lo, lo)
            read_hi = hi if read_hi is None else max(read_hi, hi)
            x, y = x.to(device), y.to(device)
            sync = micro == S["grad_accum"] - 1 or world == 1
            with (contextlib.nullcontext() if sync else model.no_sync()), autocast:
                _, loss = model(x, y, n_passes=n_passes)
                (loss / S["grad_accum"]).backward()
            step_loss += raw_model.last_stats["ce"].double().cpu() / S["grad_accum"]
        all_reduce_sum(step_loss, world)
        step_loss = (step_loss / world).item()
        if not math.isfinite(step_loss) or not math.isfinite(loss.item()):
            bar.close()
            last = ckpt_path if os.path.exists(ckpt_path) else "none written yet"
            raise NonFiniteLoss(f"non-finite loss ({step_loss}) at step {step}: stopping. The last good "
                                f"checkpoint is kept: {last}. Lower the learning rates or check the data.")
        if S["grad_clip"] > 0:
            torch.nn.utils.clip_grad_norm_(raw_model.parameters(), S["grad_clip"])
        for opt in optimizers:
            opt.step()
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        # bookkeeping
        if k not in flops_cache:
            flops_cache[k] = flops_per_token(raw_model.config, n_passes, S["avg_doc_len"])
        state["step"] += 1
        state["tokens_seen"] += tokens_per_step
        state["data_position"] += seqs_per_step
        state["flops_seen"] += flops_cache[k] * tokens_per_step
        state["flops_by_passes"][k] = state["flops_by_passes"].get(k, 0.0) + flops_cache[k] * tokens_per_step
        train_losses.append(step_loss)
        window_sum, window_n = window_sum + step_loss, window_n + 1
        passes_seen.append(k)
        bar.update(1)
        bar.set_postfix(loss=f"{step_loss:.3f}", lr=f"{last_lr[0]:.2e}")
        done = state["step"] == max_steps
        stop = S["stop_at_step"] and state["step"] == S["stop_at_step"]
        if state["step"] % S["eval_interval"] == 0 or done or stop:
            mean_passes = sum(passes_seen) / len(passes_seen)
            records.append(log_eval(window_sum / window_n, mean_passes, t0))
            window_sum, window_n, passes_seen = 0.0, 0, []
            save(ckpt_path)
            bar.set_postfix(loss=f"{step_loss:.3f}", val=f"{records[-1]['val_loss']:.3f}")
        if state["step"] in S["save_steps"]:
            save(os.path.join(run_dir, f"ckpt_step{state['step']}.pt"))
        if stop:
            break
    bar.close()
    final = records[-1] if records else {}
    summary = dict(run_dir=run_dir, ckpt_path=ckpt_path, log_path=log_path, step=state["step"],
                   max_steps=max_steps, tokens=state["tokens_seen"], flops=state["flops_seen"],
                   val_loss=final.get("val_loss"), val_loss_by_source=final.get("val_loss_by_source"),
                   train_losses=train_losses, unigram_entropy=entropy, data_region=region,
                   data_read=(read_lo, read_hi), data_split=split, seconds=time.time() - t0,
                   world_size=world, rank=rank)
    if master:
        print(f"step {state['step']}: val loss {summary['val_loss']:.4f} nats vs unigram entropy {entropy:.4f} "
              f"({state['tokens_seen']:,} tokens, {state['flops_seen']:.3e} FLOPs, {summary['seconds']:.0f} s)")
        print(f"checkpoint: {ckpt_path}\nlog:        {log_path}")
    return summary


def usage():
    lines = ["usage: python train.py [config/NAME.py ...] [--key=value ...]", "", "settings (default):"]
    lines += [f"  --{k}={v!r}" for k, v in DEFAULTS.items()]
    return "\n".join(lines)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(usage())
        return 0
    try:
        overrides = parse_args(argv)
        train(overrides)
    except (ValueError, FileNotFoundError, NonFiniteLoss, RuntimeError) as e:
        print(f"train.py: error: {e}", file=sys.stderr)
        return 1
    finally:
        if "RANK" in os.environ:
            import torch.distributed as dist
            if dist.is_initialized():
                dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
