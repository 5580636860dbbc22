"""
The memory planner: what one GPU (or this CPU) holds while training a config with DDP or FSDP2, and the
check train.py makes before it allocates anything.

Guards against: a run that dies of out-of-memory after minutes of start-up (or after training, at its
growth step), and a README command that cannot fit where it says it runs. All arithmetic on a
ModelConfig (match.py's shapes, model.execution_plan): a 54B-parameter config is planned instantly.

    python -m tooling.memory config/x_d8_loop2.py --world_size 8 --micro_batch 32
    python -m tooling.memory --preset smelt-1.6b-s97 --world_size 16 --micro_batch 1 --activation_checkpointing
    python -m tooling.memory config/smelt_200m_s95.py --json

The training setup it describes (train.py): fp32 master weights and fp32 gradients; Muon keeps one fp32
momentum buffer per hidden matrix, AdamW two fp32 buffers (exp_avg, exp_avg_sq) per parameter; bf16
autocast compute on CUDA. DDP: every GPU holds everything. FSDP2: fully_shard on every stored block and
on the whole model, every parameter sharded on dim 0 (Shard(0)). Sizes in GiB (2^30 B).
Checked in tests/test_memory.py: states == FSDP2's real per-rank shards, exactly; activations == the
bytes autograd saves (1%).
"""

import json
import math
import os
import sys

import match
from model import execution_plan
from tooling import common, distributed, match_cli
from tooling.common import cli_error

GIB = 2 ** 30
HEADROOM = 0.10  # fraction of each GPU kept free: CUDA context, NCCL buffers, fragmentation, optimizer step


def state_bytes_per_element(group, optimizer="muon"):
    """fp32 weight (4) + fp32 gradient (4) + optimizer state: one fp32 momentum for a Muon matrix (4),
    exp_avg and exp_avg_sq for an AdamW parameter (8). optimizer="adamw": AdamW on everything."""
    if optimizer not in ("muon", "muon_x", "adamw"):
        raise ValueError(f"optimizer={optimizer!r}: must be 'muon', 'muon_x' or 'adamw'")
    # muon_x's second moment is one number per row or column: next to the matrix, nothing
    return 4 + 4 + (4 if optimizer != "adamw" and group == "matrix" else 8)


def state_bytes_per_rank(cfg, world_size=1, optimizer="muon"):
    """Exact bytes of weights, gradients and optimizer state on the fullest rank when every parameter is
    sharded on dim 0 over world_size ranks like FSDP2's Shard(0) (torch.chunk: rank r holds rows
    [r c, min(n, (r + 1) c)) with c = ceil(n / world_size)). Rank 0 holds c rows of every parameter, so
    it is the fullest for all of them at once. world_size=1: the unsharded total (DDP, one GPU)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    total = 0
    for _, shape, group in match.param_shapes(cfg):
        rows = -(-shape[0] // world_size)  # ceil
        total += rows * math.prod(shape[1:]) * state_bytes_per_element(group, optimizer)
    return total


def activation_bytes(cfg, micro_batch, mixed_precision=True, activation_checkpointing=False, kernels=True,
                     n_passes=None):
    """Bytes one GPU keeps for the backward of micro_batch sequences of block_size tokens, itemised: the
    tensors autograd saves, counted per token. Byte sizes: a = 2 for matmul operands under bf16
    autocast (4 without), f = 4 for what stays fp32 (the residual stream, because the embedding output
    is fp32 and bf16 updates promote it; norm and softmax statistics; router logits), i = 8 for int64
    indices. q = n_head x head_dim, kv = n_kv_head x head_dim. g = 1 when the unfused PyTorch RMSNorm
    keeps x * rstd for the gain's gradient (norm_gain and not kernels), else 0. c = how often a norm
    output is saved: autocast casts the fp32 output once per consuming matmul (3 for q/k/v, 2 for a
    dense FFN's gate/up), while without autocast one fp32 tensor serves all (c = 1).
      norm(d)    = f d (input) + f (rstd) + g f d
      attention  = norm(H) + c a H (q/k/v inputs) + a (q + 2 kv) (RoPE'd q, k and v, kept by the flash /
                   flex kernel, which keeps no T x T matrix) + a q + f n_head (its output, log-sum-exp)
                   + a q (o_proj input); RoPE keeps nothing (cos / sin need no gradient)
                   [QK-norm adds its input a (q + kv), f (n_head + n_kv_head) and g f (q + kv)]
      dense FFN  = norm(H) + c a H + (4 unfused, 3 with the SwiGLU kernel) a mlp_hidden
      MoE FFN    = norm(H) + a H (router input) + f (2 E + 2) (router logits, probs, logsumexp, top-k sum)
                   + top_k [routed + 3 i + f + a (expert id, sort order, token index, top-k weight, its
                   gathered copy)], where routed = c a H + 5 a expert_hidden + f H on the PyTorch path
                   (model.run_experts: the token's sorted copy, c = 2 casts under autocast; gate
                   pre-activation, its SiLU, up, the hidden and the router-weighted hidden; the fp32 expert
                   output, which index_add_ keeps) and a (3 H + 2 expert_hidden) with the grouped-GEMM
                   kernel (sorted copy, kernel-saved SwiGLU, expert output, weighted output index_add keeps)
      block      = attention + FFN, once per *executed* block (each loop visit / pass saves its own)
      embedding  = i (token ids) [+ norm(H) with embed_norm];  boundary [X3] = norm(H) where it norms
      head       = norm(H) + a H (lm_head input) + f V (log-probs of the cross-entropy) + i (targets)
    saved = embedding + executed x block + boundaries + head, and logits_grad = 2 f V (the cross-entropy's
    backward: the dense fp32 gradient of the log-probs and the log-softmax's fp32 input gradient, alive
    together with the saved tensors at the start of the backward) is added to the total.
    With activation checkpointing per executed block a block keeps only its input (f H), and one
    block's activations (recompute) are alive again while it is recomputed. Left out: per-block
    constants (RoPE tables, expert load statistics, MoE tile maps) and the backward's other gradient
    buffers; counted but smaller on the reference path: the norm of the zero state h0 [X] Algorithm 1.
    kernels=True describes the Triton kernels (RMSNorm, SwiGLU, grouped-GEMM MoE; train.py --triton=True),
    False the PyTorch path (the default everywhere; tests/test_memory.py measures it with
    saved_tensors_hooks)."""
    if micro_batch < 1:
        raise ValueError(f"micro_batch must be >= 1, got {micro_batch}")
    a, f, i = (2 if mixed_precision else 4), 4, 8
    H, V, E, k = cfg.n_embd, cfg.vocab_size, cfg.n_expert, cfg.top_k
    q, kv = cfg.n_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim
    g = int(cfg.norm_gain and not kernels)

    def norm(d, rows=1):  # input + rstd (+ x * rstd); rows: norms per token (one per head for QK-norm)
        return f * d + f * rows + g * f * d

    def copies(n):  # a norm output feeding n matmuls
        return n if mixed_precision else 1

    attention = norm(H) + copies(3) * a * H + a * (q + 2 * kv) + a * q + f * cfg.n_head + a * q
    if cfg.qk_norm:
        attention += a * (q + kv) + f * (cfg.n_head + cfg.n_kv_head) + g * f * (q + kv)
    if E:
        if kernels:  # sorted copy, kernel-saved SwiGLU, expert output, the weighted output index_add keeps
            routed = a * (3 * H + 2 * cfg.expert_hidden)
        else:  # model.run_experts: the sorted token (cast once per matmul under autocast), five hidden-wide
            routed = copies(2) * a * H + 5 * a * cfg.expert_hidden + f * H  # tensors, the fp32 expert output
        ffn = norm(H) + a * H + f * (2 * E + 2) + k * (routed + 3 * i + f + a)
    else:
        ffn = norm(H) + copies(2) * a * H + (3 if kernels else 4) * a * cfg.mlp_hidden
    block = attention + ffn
    plan = execution_plan(cfg, n_passes)
    executed = sum(s.kind == "block" for s in plan)
    boundaries = sum(norm(H) for s in plan if s.kind == "boundary" and s.norm)
    embedding = i + (norm(H) if cfg.embed_norm else 0)
    head = norm(H) + a * H + f * V + i
    tokens = micro_batch * cfg.block_size
    if activation_checkpointing:
        blocks, recompute = executed * f * H, block
    else:
        blocks, recompute = executed * block, 0
    items = dict(embedding=embedding, blocks=blocks, boundaries=boundaries, head=head)
    items = {name: tokens * v for name, v in items.items()}
    items["saved"] = sum(items.values())
    items.update(recompute=tokens * recompute, logits_grad=tokens * 2 * f * V, per_block=tokens * block,
                 executed_blocks=executed, tokens=tokens)
    items["total"] = items["saved"] + items["recompute"] + items["logits_grad"]
    return items


def weight_copy_bytes(cfg, activation_checkpointing=False, n_passes=None):
    """Bytes of the bf16 copies that autocast makes of fp32 weights and autograd keeps for the backward
    (DDP; FSDP2 computes with its own bf16 parameters): 2 B x the attention, router, dense-FFN and
    lm-head matrices once (autocast caches the cast of a leaf weight for the whole forward, so a
    looped block's second visit reuses it) + 2 B x the experts of every executed MoE block (the
    expert stack is cast per call; with activation checkpointing only the recomputed block's)."""
    shapes = match.block_shapes(cfg)
    executed = [s.block for s in execution_plan(cfg, n_passes) if s.kind == "block"]
    experts = shapes["ffn_all"] if cfg.n_expert else 0
    cached = len(set(executed)) * (shapes["attn"] + shapes["router"] + shapes["ffn_all"] - experts)
    visits = 1 if activation_checkpointing else len(executed)
    return 2 * (cached + cfg.vocab_size * cfg.n_embd + visits * experts)


def memory_plan(cfg, world_size, micro_batch, optimizer="muon", activation_checkpointing=False, gpu_gb=80,
                mixed_precision=True, headroom=HEADROOM, n_passes=None, kernels=False, grad_accum=1):
    """Per-GPU memory, in GiB, of training cfg with micro_batch sequences of block_size tokens per GPU
    on world_size GPUs of gpu_gb GiB, under DDP and under FSDP2. Returns the settings and
    {"ddp": {...}, "fsdp": {...}}, each with states_gb_per_gpu, activations_gb_per_gpu,
    transient_gb_per_gpu, total_gb_per_gpu, fits and max_micro_batch; "fsdp" also with accumulation and
    its collective traffic per step.
      states       sum over parameters of numel x (4 weight + 4 grad + 4 Muon momentum or 8 AdamW moments);
                   FSDP2: of the fullest rank's shard, ceil(dim0 / world_size) rows (state_bytes_per_rank)
      activations  activation_bytes(...)["total"]; the same under both (each GPU runs its own micro-batch)
      transient    DDP: its gradient buckets, a second fp32 copy of the gradients (4 B/param), and under
                   autocast the bf16 weight copies autograd keeps for the backward (weight_copy_bytes).
                   FSDP2 (tooling.distributed.shard: blocks gather bf16 copies, the root stays fp32): the
                   root's unsharded fp32 parameters and gradients (embedding, lm head, norms: FSDP2 does
                   not reshard the root after forward), 2 blocks' unsharded parameters and gradients (the
                   one computing, the one prefetched; bf16 with mixed precision, fp32 without), and the
                   fp32 copy of one block's gradients the reduce-scatter reads: root x 8 + block x (2 x 4
                   + 4) bytes with bf16.
      accumulation FSDP2 with grad_accum > 1: "unsharded" (the reduce-scatter waits for the last micro-batch,
                   and every block's fp32 unsharded gradients stay: 4 B/param more) when that fits, else
                   "sharded" (a reduce-scatter per micro-batch: grad_accum times the reduce traffic)
      traffic      FSDP2 bytes per GPU per step: all-gathers (bf16 blocks, every executed block once in
                   the forward and again in the backward, per micro-batch) and
                   reduce-scatters (fp32 block gradients), each (world - 1) / world of the full size
      keep_gathered  parallel="fsdp_grad_op": every stored block's bf16 copy stays from its
                   forward to its backward (2 B/param more), one all-gather per stored block per
                   micro-batch instead of two per execution; whether that still fits, and its traffic
      fits         total <= (1 - headroom) x gpu_gb; the headroom (10%) is for the CUDA context, NCCL
                   buffers, allocator fragmentation, and the optimizer step (one all-gathered Muon matrix
                   and its Newton-Schulz iterates, after the activations are freed)
      max_micro_batch  the largest micro-batch that fits (activations are linear in it; 0: none does)
    kernels: activations of the Triton kernels (train.py --triton=True) instead of the PyTorch path."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if gpu_gb <= 0:
        raise ValueError(f"gpu_gb must be > 0, got {gpu_gb}")
    if not 0 <= headroom < 1:
        raise ValueError(f"headroom must be in [0, 1), got {headroom}")
    if grad_accum < 1:
        raise ValueError(f"grad_accum must be >= 1, got {grad_accum}")
    act = activation_bytes(cfg, micro_batch, mixed_precision, activation_checkpointing, kernels, n_passes)
    per_sequence = activation_bytes(cfg, 1, mixed_precision, activation_checkpointing, kernels, n_passes)["total"]
    block = match.block_shapes(cfg)["total"]
    n_params = sum(math.prod(shape) for _, shape, _ in match.param_shapes(cfg))
    root = n_params - cfg.n_blocks * block
    weight_copies = weight_copy_bytes(cfg, activation_checkpointing, n_passes) if mixed_precision else 0
    p = 2 if mixed_precision else 4  # a gathered block parameter (and its unsharded gradient)
    transient = dict(ddp=4 * n_params + weight_copies, fsdp=root * 8 + block * (2 * 2 * p + 4))
    states = dict(ddp=state_bytes_per_rank(cfg, 1, optimizer), fsdp=state_bytes_per_rank(cfg, world_size, optimizer))
    usable = (1 - headroom) * gpu_gb * GIB
    plan = dict(world_size=world_size, micro_batch=micro_batch, grad_accum=grad_accum, tokens_per_gpu=act["tokens"],
                optimizer=optimizer, mixed_precision=mixed_precision,
                activation_checkpointing=activation_checkpointing, gpu_gb=gpu_gb, headroom=headroom,
                usable_gb=usable / GIB)
    unsharded_grads = 4 * cfg.n_blocks * block if grad_accum > 1 else 0
    defer = states["fsdp"] + act["total"] + transient["fsdp"] + unsharded_grads <= usable
    if grad_accum > 1 and defer:
        transient["fsdp"] += unsharded_grads
    for name in ("ddp", "fsdp"):
        total = states[name] + act["total"] + transient[name]
        plan[name] = dict(states_gb_per_gpu=states[name] / GIB, activations_gb_per_gpu=act["total"] / GIB,
                          transient_gb_per_gpu=transient[name] / GIB, total_gb_per_gpu=total / GIB,
                          fits=total <= usable,
                          max_micro_batch=max(0, int((usable - states[name] - transient[name]) // per_sequence)))
    share, reduces = (world_size - 1) / world_size, 1 if defer else grad_accum
    kept = p * cfg.n_blocks * block  # reshard_after_forward=False: every block's gathered copy
    plan["fsdp"].update(accumulation="unsharded" if grad_accum == 1 or defer else "sharded",
                        all_gather_gb_per_step=share * grad_accum * 2 * cfg.executed_layers(n_passes) * block * p / GIB,
                        reduce_scatter_gb_per_step=share * reduces * cfg.n_blocks * block * 4 / GIB,
                        keep_gathered_fits=plan["fsdp"]["total_gb_per_gpu"] * GIB + kept <= usable,
                        keep_gathered_all_gather_gb_per_step=share * grad_accum * kept / GIB)
    return plan


def memory_table(plan):
    """The memory plan as a small text table."""
    p = plan
    lines = [f"memory per GPU (GiB): {p['world_size']} GPUs x {p['gpu_gb']:g} GiB, fits if total <= "
             f"{p['usable_gb']:.1f} ({p['headroom']:.0%} headroom); micro-batch {p['micro_batch']} x "
             f"{p['tokens_per_gpu'] // p['micro_batch']} tokens, grad_accum {p['grad_accum']}; {p['optimizer']}, "
             f"{'bf16 autocast' if p['mixed_precision'] else 'fp32'}, activation checkpointing "
             f"{'on' if p['activation_checkpointing'] else 'off'}",
             f"  {'':<5} {'states':>8} {'activations':>12} {'transient':>10} {'total':>8} {'fits':>5} "
             f"{'max micro-batch':>16}"]
    for name in ("ddp", "fsdp"):
        m = p[name]
        lines.append(f"  {name:<5} {m['states_gb_per_gpu']:>8.1f} {m['activations_gb_per_gpu']:>12.1f} "
                     f"{m['transient_gb_per_gpu']:>10.1f} {m['total_gb_per_gpu']:>8.1f} "
                     f"{'yes' if m['fits'] else 'no':>5} {m['max_micro_batch']:>16}")
    f = p["fsdp"]
    lines.append(f"  fsdp per step: all-gathers {f['all_gather_gb_per_step']:.1f} GiB, reduce-scatters "
                 f"{f['reduce_scatter_gb_per_step']:.1f} GiB; gradient accumulation {f['accumulation']} "
                 "(unsharded: one reduce-scatter per step, sharded: one per micro-batch)")
    lines.append(f"  --parallel=fsdp_grad_op: {'fits' if f['keep_gathered_fits'] else 'does not fit'}"
                 f" (all-gathers {f['keep_gathered_all_gather_gb_per_step']:.1f} GiB per step)")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------
# The check train.py makes before it builds anything


# Where the host's memory is read; tests point these at fake files.
MEMINFO = "/proc/meminfo"
PROC_CGROUP = "/proc/self/cgroup"
CGROUP_ROOT = "/sys/fs/cgroup"
NO_LIMIT = 2 ** 60  # cgroup v1 writes "no limit" as 2^63 rounded down to a page; v2 writes "max"


def _read_number(path, key=None):
    """The integer in a cgroup / proc file (key: the value of that line of a "key value" file); None when
    the file is missing or unreadable, or says "max" (or a no-limit-sized number)."""
    try:
        with open(path) as f:
            text = f.read()
        if key is not None:
            text = next(line.split()[1] for line in text.splitlines() if line.split()[:1] == [key])
        value = int(text.strip())
    except (OSError, StopIteration, ValueError, IndexError):
        return None
    return value if value < NO_LIMIT else None


def cgroup_memory(root=None, proc_cgroup=None):
    """The memory cgroup that leaves this process the least room: {"room", "limit", "usage", "path"} in
    bytes, or None without a limit. Reads this process's cgroup and every parent up to the mount: cgroup
    v2 (root/<path>/memory.max, memory.current) and v1 (root/memory/<path>/memory.limit_in_bytes,
    memory.usage_in_bytes). usage leaves out the inactive page cache (memory.stat inactive_file, v1
    total_inactive_file), which the kernel reclaims before it kills; room = limit - usage."""
    root, proc_cgroup = root or CGROUP_ROOT, proc_cgroup or PROC_CGROUP
    try:
        with open(proc_cgroup) as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f if line.count(":") >= 2]
    except OSError:
        lines = []
    versions = []  # (mount, path, limit file, usage file, reclaimable key)
    for _, controllers, path in lines:
        if controllers == "":
            versions.append((root, path, "memory.max", "memory.current", "inactive_file"))
        elif "memory" in controllers.split(","):
            versions.append((os.path.join(root, "memory"), path, "memory.limit_in_bytes", "memory.usage_in_bytes",
                             "total_inactive_file"))
    if not versions:  # no /proc/self/cgroup: the mount's own files, if any (a container's namespaced view)
        versions = [(root, "/", "memory.max", "memory.current", "inactive_file"),
                    (os.path.join(root, "memory"), "/", "memory.limit_in_bytes", "memory.usage_in_bytes",
                     "total_inactive_file")]
    tightest = None
    for mount, path, limit_file, usage_file, reclaimable in versions:
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts), -1, -1):  # the process's own cgroup, then each parent
            folder = os.path.join(mount, *parts[:depth])
            limit = _read_number(os.path.join(folder, limit_file))
            usage = _read_number(os.path.join(folder, usage_file))
            if limit is None or usage is None:
                continue
            usage -= min(usage, _read_number(os.path.join(folder, "memory.stat"), reclaimable) or 0)
            room = max(0, limit - usage)
            if tightest is None or room < tightest["room"]:
                tightest = dict(room=room, limit=limit, usage=usage, path=folder)
    return tightest


def memory_reading(device):
    """{"available", "meminfo", "cgroup"}: bytes this process can still allocate (None when unknown), from
    free GPU memory, or on a CPU the smaller of MemAvailable and the cgroup's room (cgroup_memory),
    shared by the LOCAL_WORLD_SIZE processes of this node."""
    if device.type == "cuda":
        import torch
        return dict(available=torch.cuda.mem_get_info(device)[0], meminfo=None, cgroup=None)
    kib = _read_number(MEMINFO, "MemAvailable:")
    cgroup = cgroup_memory()
    bounds = [b for b in (kib and kib * 1024, cgroup and cgroup["room"]) if b is not None]
    share = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return dict(available=min(bounds) // share if bounds else None, meminfo=kib and kib * 1024, cgroup=cgroup)


# On a CPU everything lives in the process's resident memory: what the check adds to the live bytes' peak.
CPU_ALLOCATOR_OVERHEAD = 0.5  # glibc's heap keeps the blocks earlier steps freed (train.py asks it to keep them:
#   distributed.keep_freed_memory): after 20 steps peak RSS was 1.37-1.50 x the live bytes' peak for the tiny
#   MoE, 1.68 x for a dense looped model (bench/memory_table.py --cpu; runs vary by ~4%); 0.5 keeps the
#   estimate within 15% of both


def process_rss():
    """Bytes this process has resident now (/proc/self/statm), or None where there is no /proc."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def run_bytes(shape, config, device, use_bf16, world=1):
    """{"states", "activations", "mask", "allocator", "need"}: the bytes training `shape` adds at its peak on
    this rank: weights, gradients and optimizer state (this rank's shard under FSDP, every block's gathered
    bf16 copy without resharding), the activations autograd keeps and the cross-entropy's backward, and on
    the SDPA path the document mask: boolean (B T^2), its additive copy shared by every block (model.py
    additive_mask, 2 or 4 B T^2) and the boolean temporary while it is built. On a CPU, the
    allocator's retention on top (CPU_ALLOCATOR_OVERHEAD)."""
    mask = 0
    if shape.document_mask and not shape.uses_flex(device.type):
        mask = (1 + (2 if use_bf16 else 4) + 1) * config.batch_size * shape.block_size ** 2
    states = state_bytes_per_rank(shape, world if config.sharded else 1, config.optimizer)
    if config.parallel == "fsdp_grad_op":  # every block's gathered bf16 copy
        states += 2 * shape.n_blocks * match.block_shapes(shape)["total"]
    activations = activation_bytes(shape, config.batch_size, mixed_precision=use_bf16,
                                   activation_checkpointing=config.activation_checkpointing,
                                   kernels=config.triton)["total"]
    live = states + activations + mask
    allocator = round(CPU_ALLOCATOR_OVERHEAD * live) if device.type == "cpu" else 0
    return dict(states=states, activations=activations, mask=mask, allocator=allocator, need=live + allocator)


def check_memory(shapes, config, device, use_bf16, world=1):
    """Refuse, before allocating anything, a run whose estimated memory exceeds what is available
    (memory_reading: free GPU memory, or on a CPU MemAvailable and the cgroup's room): run_bytes of the
    model as built and of every larger shape the run gives it. shapes: [(when, ModelConfig)]
    (grow.shapes_of_run). config: the run's settings (batch_size, grad_accum, parallel, optimizer, triton,
    activation_checkpointing, document_mask). Returns (whether gradient accumulation may wait for the last
    micro-batch to reduce: DDP's no_sync; under FSDP2 that keeps every block's unsharded fp32 gradients,
    so only when they fit too; else FSDP reduce-scatters every micro-batch, and a line for the run's
    header: the estimate, on a CPU as peak resident memory, and what is available).
    Several processes (world > 1): every rank's reading is exchanged and the least one decides, so every
    rank makes the same decision and the same refusal (ranks deferring apart would run different
    collectives: a hang; a refusal on one rank alone would leave the others waiting)."""
    # the first torch.optim optimizer imports torch._dynamo (~140 MiB on a CPU: counted now), and it Triton,
    # whose nanobind extension aborts the process (C++ terminate) on a Ctrl-C raised inside it: deferred
    with common.signals_deferred():
        import torch._dynamo  # noqa: F401
    reading = memory_reading(device)
    place = f"{device}{where(reading)}"
    if world > 1:
        readings = distributed.exchange("the memory check", [reading["available"], place])
        known = [(value, r, at) for r, (value, at) in enumerate(readings) if value is not None]
        if known:
            least, r, at = min(known)
            reading, place = dict(reading, available=least), f"rank {r} ({at})"
    available, defer, gib = reading["available"], True, lambda b: f"{b / GIB:.2f} GiB"  # noqa: E731
    needs = []
    for when, shape in shapes:
        items = run_bytes(shape, config, device, use_bf16, world)
        need = items["need"]
        needs.append(need)
        if available is None:
            continue
        if config.sharded and world > 1 and config.grad_accum > 1:  # unsharded fp32 gradients
            defer = defer and need + 4 * shape.n_blocks * match.block_shapes(shape)["total"] <= available
        if need > available:
            raise distributed.everywhere(ValueError(
                f"block_size={shape.block_size}, batch_size={config.batch_size}: this run needs about "
                f"{gib(need)}{when} (weights, gradients and optimizer state {gib(items['states'])}, "
                f"activations {gib(items['activations'])}, attention mask {gib(items['mask'])}"
                + (f", allocator {gib(items['allocator'])}" if items["allocator"] else "")
                + f") but {gib(available)} is available on {place}; lower batch_size (raise grad_accum) or block_size"))
    rss = process_rss() if device.type == "cpu" else None
    peak = f"peak resident memory about {gib(rss + max(needs))} (now {gib(rss)})" if rss else \
        f"about {gib(max(needs))} at its peak"
    note = f"memory: {peak}; {gib(available) + ' available' if available is not None else 'available unknown'}"
    return defer, note + (f" on {place}" if world > 1 and available is not None else where(reading))


def where(reading):
    """Where the available memory was read, for messages: the cgroup whose limit binds, if one does."""
    cgroup = reading.get("cgroup")
    if cgroup and (reading.get("meminfo") is None or cgroup["room"] < reading["meminfo"]):
        return f" (cgroup limit {cgroup['limit'] / GIB:.2f} GiB at {cgroup['path']})"
    return ""


# ----------------------------------------------------------------------------------------------------
# Command line


def main(argv=None):
    parser = common.parser("tooling.memory", description="Per-GPU memory of training a config (or an [S] preset "
                           "and its matched twin) under DDP and FSDP2.")
    match_cli.add_model_arguments(parser)
    parser.add_argument("--world_size", type=common.number(int, 1, 2 ** 20), default=8, help="GPUs (default 8)")
    parser.add_argument("--gpu_gb", type=common.number(float, 0, 2 ** 20, open_low=True), default=80,
                        help="memory of one GPU in GiB (default 80)")
    parser.add_argument("--micro_batch", type=common.number(int, 1, 2 ** 30),
                        help="sequences per GPU (default: the config's batch_size, else 1)")
    parser.add_argument("--grad_accum", type=common.number(int, 1, 2 ** 30),
                        help="micro-batches per step (default: the config's, else 1)")
    parser.add_argument("--optimizer", choices=("muon", "muon_x", "adamw"),
                        help="muon (Muon + AdamW) or adamw (default: the config's, else muon)")
    parser.add_argument("--activation_checkpointing", action="store_true", help="checkpoint every executed block")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="compute dtype (default bfloat16 autocast)")
    parser.add_argument("--triton", action="store_true",
                        help="the Triton kernels' activations (train.py --triton=True)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    try:
        models = match_cli.models_of(args.config, args.preset, args.recipe, args.avg_doc_len, args.attended)
        micro_batch = args.micro_batch if args.micro_batch is not None else models["settings"].get("batch_size", 1)
        settings = models["settings"]
        grad_accum = args.grad_accum if args.grad_accum is not None else settings.get("grad_accum", 1)
        if args.grad_accum is None and settings.get("global_batch"):  # train.py derives it from the world size
            grad_accum = max(1, settings["global_batch"] // (micro_batch * args.world_size))
        optimizer = args.optimizer or models["settings"].get("optimizer", "muon")
        plans = {name: memory_plan(models[name], args.world_size, micro_batch, optimizer,
                                   args.activation_checkpointing, args.gpu_gb, args.dtype == "bfloat16",
                                   kernels=args.triton, grad_accum=grad_accum)
                 for name in ("baseline", "matched") if models[name] is not None}
    except (ValueError, OSError) as e:
        return cli_error("tooling.memory", e)
    if args.json:
        print(json.dumps(plans if len(plans) > 1 else plans["baseline"]))
    else:
        for name, plan in plans.items():
            print(f"{name if len(plans) > 1 else os.path.basename(args.config or '')} {memory_table(plan)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
