"""
The bench: one JSON line per measurement, each ratio beside its two times (machine-dependent numbers).

    python bench/bench.py                          # the CPU stages below (~2.5 min, one thread)
    python bench/bench.py moe kernels --rounds 9   # some stages
    python bench/bench.py --dry-run                # toy sizes, one round (tests/test_bench.py)
    python3 bench/bench.py --gpu                   # CUDA, bf16 autocast, larger sizes (bench/gpu_check.sh)

Stages (both sides of a ratio run in turn in the same rounds, so they see the same machine load; medians):
  efficiency  a training step (forward, backward, AdamW) of each layout and of nanoGPT's GPT-2 at one shape:
              GFLOP/s by match.py's count (every executed block), vs_plain / vs_gpt2 = over plain's / GPT-2's.
  moe         the MoE layer (64 experts, top-8, sort by expert + grouped GEMM) forward + backward vs a dense
              SwiGLU of equal active FLOPs (hidden = top_k x expert_hidden): ratio = moe / dense.
  moe_bytes   the bytes one MoE layer's forward + backward moves per token at the [S] 200M twin's widths
              (bf16 autocast, bf16 weights, 16k tokens; shapes only), and its grouped GEMMs' FLOP/byte.
  moe_bytes_compiled  the same layer compiled by Inductor: the bytes its kernels move, by its own count.
  kernels     each Triton kernel vs its PyTorch twin, forward + backward: on CUDA their times (speedup =
              twin / kernel); on a CPU the interpreter's largest difference only (its speed says nothing).
"""
import argparse
import json
import logging
import math
import os
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import kernels  # noqa: E402
import match  # noqa: E402
from model import GPT, MLP, MoE, ModelConfig  # noqa: E402

SIZES = {  # the efficiency stage's model and batch, the MoE stage's tokens, the kernels' rows, the peak mm
    "cpu": dict(batch=8, block_size=256, n_embd=256, n_layer=4, vocab_size=4096, moe_tokens=4096, rows=64,
                experts=64, mm=2048, copy_mb=64),
    "cuda": dict(batch=8, block_size=1024, n_embd=1024, n_layer=8, vocab_size=50304, moe_tokens=65536,
                 rows=16384, experts=64, mm=8192, copy_mb=1024),
    "dry": dict(batch=2, block_size=32, n_embd=64, n_layer=2, vocab_size=256, moe_tokens=256, rows=32,
                experts=4, mm=256, copy_mb=4),
}
S95_MOE = dict(n_embd=1056, n_head=12, head_dim=88, n_expert=288, top_k=8, expert_hidden=352)  # [S] 200M twin
LAYOUTS = {"plain": {}, "smelt_r2": dict(layout="smelt", n_passes=2),
           "layer_loop_r2": dict(layout="layer_loop", n_passes=2), "pcc_k2": dict(layout="pcc", n_passes=2),
           "pcc_untied_k2": dict(layout="pcc_untied", n_passes=2), "moe_8e_top2": dict(n_expert=8, top_k=2),
           "moe_64e_top8": dict(n_expert=64, top_k=8)}


def emit(**row):
    print(json.dumps(row), flush=True)


def seconds(fn, device):
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def interleaved(fns, rounds, device, desc):
    """Median seconds of each fn over `rounds` after a warm-up round, the fns run in turn in each round."""
    times = {name: [] for name in fns}
    for r in tqdm(range(rounds + 1), desc=desc, file=sys.stderr, leave=False, disable=None):
        for name, fn in fns.items():
            t = seconds(fn, device)
            times[name] += [t] if r else []
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}


def autocast(device):
    return torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda")


class GPT2(torch.nn.Module):
    """nanoGPT's GPT-2: pre-LayerNorm, biases, causal SDPA, GELU MLP 4x, learned positions, a tied head."""

    def __init__(self, cfg):
        super().__init__()
        nn, d, V, L = torch.nn, cfg.n_embd, cfg.vocab_size, cfg.n_layer
        self.config, self.wte, self.wpe = cfg, nn.Embedding(V, d), nn.Embedding(cfg.block_size, d)
        self.h = nn.ModuleList(nn.ModuleDict(dict(
            ln_1=nn.LayerNorm(d), attn=nn.Linear(d, 3 * d), proj=nn.Linear(d, d), ln_2=nn.LayerNorm(d),
            mlp=nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)))) for _ in range(L))
        self.ln_f = nn.LayerNorm(d)
        # nanoGPT's init of the tied embedding: PyTorch's N(0, 1) gives 16x larger logits, a slower step
        nn.init.normal_(self.wte.weight, std=0.02)

    def forward(self, idx, targets):
        F, T, H = torch.nn.functional, idx.size(1), self.config.n_head
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for b in self.h:
            q, k, v = (t.unflatten(2, (H, -1)).transpose(1, 2) for t in b.attn(b.ln_1(x)).chunk(3, dim=2))
            x = x + b.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2))
            x = x + b.mlp(b.ln_2(x))
        logits = F.linear(self.ln_f(x), self.wte.weight)
        return logits, F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def gpt2_flops_per_token(cfg):
    """match.py's count for cfg's plain model, its SwiGLU's 3 d x hidden weights swapped for GPT-2's 8 d^2."""
    return match.flops_per_token(cfg) + 6 * cfg.n_layer * cfg.n_embd * (8 * cfg.n_embd - 3 * cfg.mlp_hidden)


def train_step(cfg, size, device, build=GPT, flops_per_token=match.flops_per_token):
    """One training step of build(cfg): forward, backward, AdamW, on fixed random tokens (no eot)."""
    torch.manual_seed(0)
    model = build(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, cfg.vocab_size - 1, (size["batch"], cfg.block_size), device=device)

    def step():
        with autocast(device):
            loss = model(x, x)[1]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    step.flops = flops_per_token(cfg) * x.numel()
    return step


def efficiency(size, device, rounds):
    shape = dict(n_head=4, **{k: size[k] for k in ("block_size", "n_embd", "n_layer", "vocab_size")})
    steps = {name: train_step(ModelConfig(**shape, **kw), size, device) for name, kw in LAYOUTS.items()}
    steps["gpt2"] = train_step(ModelConfig(**shape), size, device, GPT2, gpt2_flops_per_token)
    median = interleaved(steps, rounds, device, "efficiency")
    gflops = {name: steps[name].flops / median[name] / 1e9 for name in steps}
    for name in steps:
        emit(stage="efficiency", model=name, ms=round(1e3 * median[name], 2), gflops=round(gflops[name], 2),
             **{f"vs_{ref}": round(gflops[name] / gflops[ref], 3) for ref in ("plain", "gpt2")},
             batch=f"{size['batch']}x{size['block_size']}", **{k: size[k] for k in ("n_embd", "n_layer")})


def fwd_bwd(module, x):
    def step():
        with autocast(x.device.type):
            out = module(x)[0]
        out.float().square().mean().backward()
        module.zero_grad(set_to_none=True)
    return step


def moe_vs_dense(size, device, rounds, n_expert=64, top_k=8):
    n_embd = size["n_embd"]
    expert_hidden = n_embd // 4
    cfg = ModelConfig(n_embd=n_embd, n_expert=n_expert, top_k=top_k, expert_hidden=expert_hidden,
                      mlp_hidden=top_k * expert_hidden)
    torch.manual_seed(0)
    moe, dense = MoE(cfg).to(device), MLP(cfg).to(device)
    for p in [*moe.parameters(), *dense.parameters()]:
        torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(size["moe_tokens"] // 256, 256, n_embd, device=device)
    median = interleaved({"moe": fwd_bwd(moe, x), "dense": fwd_bwd(dense, x)}, rounds, device, "moe")
    emit(stage="moe", moe_ms=round(1e3 * median["moe"], 2), dense_ms=round(1e3 * median["dense"], 2),
         ratio=round(median["moe"] / median["dense"], 3), tokens=size["moe_tokens"], n_embd=n_embd,
         n_expert=n_expert, top_k=top_k, expert_hidden=expert_hidden, dense_hidden=cfg.mlp_hidden)


class ByteCounter(TorchDispatchMode):
    """Bytes every op reads and writes: its tensor inputs and outputs, an in-place op's tensor twice (read,
    then written), an expanded tensor's distinct elements once. A view or a query moves none, and
    new_zeros-like ops read only their input's dtype and device."""

    def __init__(self):
        super().__init__()
        self.by_op = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        views = any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)
        if not outs or views:
            return out
        ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        ins = [] if func._opname.startswith("new_") or func._opname.endswith("_like") else ins
        moved = sum(map(distinct_bytes, ins)) + sum(map(distinct_bytes, outs))
        self.by_op[func.__name__] = self.by_op.get(func.__name__, 0) + moved
        return out


def distinct_bytes(t):
    return t.element_size() * math.prod(n for n, stride in zip(t.shape, t.stride()) if stride)


def moe_bytes(size, device, rounds, tokens=16384):
    """One MoE layer's forward + backward at the [S] 200M twin's widths (config/smelt_200m_s95.py) on `tokens`
    tokens, bf16 autocast, bf16 weights (what FSDP2 gathers): the bytes its ops move per token and its grouped
    GEMMs' FLOP per byte. Shapes only (FakeTensorMode): the CUDA path's count, in seconds on any machine."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    cfg = ModelConfig(**S95_MOE)
    with FakeTensorMode():
        torch.set_default_dtype(torch.bfloat16)
        moe = MoE(cfg)
        torch.set_default_dtype(torch.float32)
        x = torch.randn(tokens, cfg.n_embd, requires_grad=True)
        grad = torch.randn(tokens, cfg.n_embd)  # the output's gradient, fp32 as the residual stream gives it
        with ByteCounter() as counter:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out, _ = moe(x)
            out.backward(grad)
    moved = sum(counter.by_op.values()) / tokens
    flops = 3 * 3 * 2 * cfg.top_k * cfg.n_embd * cfg.expert_hidden  # 3 GEMMs, forward + 2 in the backward
    top = sorted(counter.by_op.items(), key=lambda kv: -kv[1])[:4]
    emit(stage="moe_bytes", mb_per_token=round(moved / 1e6, 3), gemm_flop_per_byte=round(flops / moved, 1),
         gemm_mflop_per_token=round(flops / 1e6, 1), tokens=tokens, **S95_MOE,
         top_ops_kb_per_token={name: round(b / tokens / 1e3, 1) for name, b in top})


def moe_bytes_compiled(size, device, rounds, tokens=16384, counted_at=(64, 128)):
    """The same layer compiled by Inductor (SwiGLU one kernel each way, recomputed in the backward): the bytes
    its kernels read and write per token by its own count (each kernel's buffers, kept while its log is on).
    Real tensors (with --gpu, CUDA's kernels), so two small batches: the weights' bytes are per call, the
    rest per token; the line through the two gives 16k tokens (the counts at 1,000 and 8,192 fall on it)."""
    from torch._inductor import metrics
    logging.getLogger("torch._inductor.compile_fx.__inductor_metrics").setLevel(logging.INFO)  # silent
    moe, counts = MoE(ModelConfig(**S95_MOE)).to(device, torch.bfloat16), []  # no shape depends on values
    for n in counted_at:
        torch._dynamo.reset()
        metrics.reset()
        x = torch.randn(n, S95_MOE["n_embd"], device=device, requires_grad=True)
        with torch.autocast(device, dtype=torch.bfloat16):  # outside the compiled region, as train.py does
            out = torch.compile(moe, fullgraph=True, dynamic=False)(x)[0]
        out.backward(torch.randn_like(x))
        counts.append(metrics.num_bytes_accessed)
    moved = counts[0] + (counts[1] - counts[0]) / (counted_at[1] - counted_at[0]) * (tokens - counted_at[0])
    emit(stage="moe_bytes_compiled", mb_per_token=round(moved / tokens / 1e6, 3), tokens=tokens, **S95_MOE)


def kernel_cases(size, device):
    """name -> (kernel, twin, inputs): the norms over (rows, n_embd), SwiGLU 4 n_embd wide, the experts over
    the rows routed top-8 to `experts` experts of n_embd / 4, the Gram product of 16 (n_embd / 4, n_embd)."""
    from kernels import moe_kernel, newton_schulz_kernel, rmsnorm_kernel, swiglu_kernel  # imports triton
    rows, d, experts, g = size["rows"], size["n_embd"], size["experts"], torch.Generator().manual_seed(0)

    def r(*shape, fan_in=1):
        x = torch.randn(*shape, generator=g) / fan_in ** 0.5
        return x.to(device, torch.bfloat16 if device == "cuda" else torch.float32).requires_grad_()
    counts = torch.bincount(torch.randint(0, experts, (8 * rows,), generator=g), minlength=experts).to(device)
    moe = (r(8 * rows, d), counts, r(experts, d // 4, d, fan_in=d), r(experts, d // 4, d, fan_in=d),
           r(experts, d, d // 4, fan_in=d // 4))
    norm = rmsnorm_kernel
    return {"rmsnorm": (kernels.rmsnorm, norm.rmsnorm_reference, (r(rows, d), r(d))),
            "boundary_operator": (lambda *a: kernels.boundary_operator(*a[:2], 0.5, a[2]),
                                  lambda *a: norm.boundary_operator_reference(*a[:2], 0.5, a[2]),
                                  (r(rows, d), r(rows, d), r(d))),
            "swiglu": (kernels.swiglu, swiglu_kernel.swiglu_reference, (r(rows, 4 * d), r(rows, 4 * d))),
            "moe_experts": (kernels.moe_experts, moe_kernel.moe_experts_reference, moe),
            "gram": (kernels.gram, newton_schulz_kernel.gram_reference, (r(16, d // 4, d),))}


def kernel_vs_twin(size, device, rounds):
    for name, (kernel, twin, inputs) in kernel_cases(size, device).items():
        wrt = [t for t in inputs if t.is_floating_point()]
        out = {}
        for impl, fn in (("triton", kernel), ("twin", twin)):
            y = fn(*inputs)
            out[impl] = [y, *torch.autograd.grad(y.float().square().sum(), wrt)]
        # the largest difference over the largest value, of the output and of every gradient
        diff = max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
                   for a, b in zip(*out.values()))
        row = dict(stage="kernels", kernel=name, shape="x".join(map(str, inputs[0].shape)),
                   dtype=str(y.dtype)[6:], max_rel_diff=float(f"{diff:.2g}"))
        if device == "cuda":  # the interpreter's speed says nothing: times on CUDA only
            from triton.testing import do_bench
            ms = {impl: do_bench(lambda: torch.autograd.grad(fn(*inputs).float().square().sum(), wrt),
                                 return_mode="median") for impl, fn in (("triton", kernel), ("twin", twin))}
            row.update(triton_ms=round(ms["triton"], 4), twin_ms=round(ms["twin"], 4),
                       speedup=round(ms["twin"] / ms["triton"], 3))
        emit(**row)


# ----------------------------------------------------------------------------------------------------
# What a GPU run must return (bench/gpu_check.sh): the machine's ceilings, train.py's steps, their profile

CEILING = {}  # the matmul's TFLOP/s, once measured: the profile's second MFU is against it


def ceilings(size, device, rounds):
    """The machine's own ceilings: a large matmul (bf16 on CUDA) and a device-to-device copy."""
    n, dtype = size["mm"], torch.bfloat16 if device == "cuda" else torch.float32
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    src = torch.empty(size["copy_mb"] * 2 ** 18, device=device)
    dst = torch.empty_like(src)
    median = interleaved(dict(matmul=lambda: a @ b, copy=lambda: dst.copy_(src)), rounds, device, "ceilings")
    CEILING["tflops"] = 2 * n ** 3 / median["matmul"] / 1e12
    emit(stage="ceilings", matmul_tflops=round(CEILING["tflops"], 1), matmul_n=size["mm"],
         copy_gb_s=round(2 * src.nbytes / median["copy"] / 1e9, 1), copy_mb=src.nbytes // 2 ** 20)


def run_config(path, dry, **dry_shape):
    """(ModelConfig, TrainConfig) of a config file, as train.py reads it; dry: at a toy shape."""
    import configurator
    import train
    settings = {**train.DEFAULTS, **configurator.read_config(path), **(dry_shape if dry else {})}
    if "x_d8" in path:
        settings["vocab_size"] = 256 if dry else 50304  # the GPT-2 vocabulary padded, as train.py pads it
    model_config = ModelConfig(**{k: settings[k] for k in train.MODEL_SETTINGS},
                               **{"vocab_size": settings.get("vocab_size", 4096)})
    return model_config, train.TrainConfig(**{k: settings[k] for k in train.DEFAULTS
                                              if k not in train.MODEL_SETTINGS})


def timed_steps(model, config, device, rounds, desc):
    """A micro-batch (forward + backward) and every optimizer's step as train.py runs them, compiled as it
    compiles (block by block; Inductor on CUDA, aot_eager on a CPU): the warm-up's seconds (two of each, the
    compile with them), then each one's median seconds, timed apart; the peak memory from the warm-up on."""
    import train
    optimizers = train.build_optimizers(model, config, device == "cuda")
    x = torch.randint(0, model.config.vocab_size - 1, (config.batch_size, model.config.block_size),
                      device=device)
    x[:, ::512] = model.config.eot_token  # documents of 512 tokens: the document mask is on
    if config.compile:
        train.compile_blocks(model, "inductor" if device == "cuda" else "aot_eager")

    def micro_batch():
        with autocast(device):
            loss = model(x, x)[1]
        loss.backward()

    def optimizer():
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    warmup = seconds(lambda: [(micro_batch(), optimizer()) for _ in range(2)], device)
    median = interleaved(dict(micro_batch=micro_batch, optimizer=optimizer), rounds, device, desc)
    peak = torch.cuda.max_memory_allocated() / 2 ** 30 if device == "cuda" else None
    return dict(warmup_s=round(warmup, 1), micro_batch_s=round(median["micro_batch"], 4),
                optimizer_s=round(median["optimizer"], 4), peak_gb=peak and round(peak, 2)), micro_batch


def mfu(flops, seconds, device):
    """MFU of the GPU's bf16 peak (train.PEAK_FLOPS) and of this run's measured matmul (ceilings)."""
    import train
    peak = train.peak_flops(torch.device(device))
    return dict(mfu=peak and round(flops / seconds / peak, 3),
                mfu_of_matmul=round(flops / seconds / 1e12 / CEILING["tflops"], 3) if CEILING else None)


def profile_d8(size, device, rounds, compiled=True):
    """[X] d8 Loop-2 (config/x_d8_loop2.py, vocabulary 50,304, micro-batch 16 x 2048) on one GPU as train.py
    steps it, compiled (profile_d8_eager: eager): a step of 16 micro-batches and one optimizer step, its
    tokens/s and MFU; the warm-up's seconds; peak memory vs the planner's (one GPU, no checkpointing);
    dynamo's graphs and breaks; the 20 kernels with the most time in one micro-batch (torch.profiler)."""
    import torch._dynamo.utils
    from torch.profiler import ProfilerActivity, profile
    cfg, config = run_config("config/x_d8_loop2.py", size is SIZES["dry"], n_layer=3, n_embd=32, n_head=2,
                             block_size=64, batch_size=2)
    accum = config.global_batch // config.batch_size  # train.py's micro-batches per step on one GPU
    tokens = config.global_batch * cfg.block_size
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    config.compile = compiled
    torch.manual_seed(0)
    times, micro_batch = timed_steps(GPT(cfg).to(device), config, device, rounds, "d8")
    step = accum * times["micro_batch_s"] + times["optimizer_s"]
    planned = match.memory_plan(cfg, 1, config.batch_size, config.optimizer)["ddp"]["total_gb"]
    counters = torch._dynamo.utils.counters
    emit(stage="profile_d8", compiled=compiled, step_s=round(step, 3), tokens_per_s=round(tokens / step),
         **mfu(match.flops_per_token(cfg) * tokens, step, device), **times, planned_gb=round(planned, 2),
         graphs=counters["stats"]["unique_graphs"], graph_breaks=sum(counters["graph_break"].values()),
         micro_batches=accum, tokens_per_step=tokens)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        micro_batch()
    attr = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"
    top = sorted(prof.key_averages(), key=lambda e: -getattr(e, attr, 0))[:20]
    emit(stage="profile_d8_kernels", compiled=compiled,
         top_ms_per_micro_batch=[[e.key[:90], round(getattr(e, attr, 0) / 1e3, 3)] for e in top])


def sharded_s95(size, device, rounds):
    """The [S] 200M twin (config/smelt_200m_s95.py, 3.9B parameters) and its baseline (smelt_200m_base.py),
    each built sharded in one process as train.py builds it (meta device, FSDP2, each parameter drawn in
    place) and compiled, with activation checkpointing and, where the planner says it fits, without: a
    micro-batch and the optimizer step timed apart, a micro-batch's tokens/s and MFU, peak memory vs the
    planner's (FSDP2 on one GPU)."""
    import torch.distributed as dist
    import train
    dry = size is SIZES["dry"]
    dist.init_process_group("cpu:gloo,cuda:nccl" if device == "cuda" else "gloo", store=dist.HashStore(),
                            rank=0, world_size=1)
    try:
        for name in ("s95", "base"):
            cfg, config = run_config(f"config/smelt_200m_{name}.py", dry, n_embd=64, n_head=2, head_dim=32,
                                     n_kv_head=1, n_expert=8, expert_hidden=16, block_size=128, batch_size=1)
            config.parallel, gib = "fsdp", 2 ** 30
            gpu_gb = torch.cuda.get_device_properties(0).total_memory / gib if device == "cuda" else 80
            for checkpointing in (True, False):
                plan = match.memory_plan(cfg, 1, config.batch_size, config.optimizer, gpu_gb,
                                         checkpointing=checkpointing)["fsdp"]
                if not plan["fits"] and not checkpointing and not dry:
                    emit(stage="s95_sharded", model=name, checkpointing=False, planned_gb=plan["total_gb"])
                    continue
                torch._dynamo.reset()
                torch.manual_seed(0)
                model = train.build_model(cfg, config, device == "cuda", torch.device(device), True)
                model.activation_checkpointing = checkpointing
                times = timed_steps(model, config, device, rounds, f"{name} checkpointing {checkpointing}")[0]
                tokens = config.batch_size * cfg.block_size
                emit(stage="s95_sharded", model=name, checkpointing=checkpointing,
                     tokens_per_s=round(tokens / times["micro_batch_s"]),
                     **mfu(match.flops_per_token(cfg) * tokens, times["micro_batch_s"], device), **times,
                     planned_gb=round(plan["total_gb"], 2), tokens=tokens)
                del model
    finally:
        dist.destroy_process_group()


STAGES = {"efficiency": efficiency, "moe": moe_vs_dense, "moe_bytes": moe_bytes,
          "moe_bytes_compiled": moe_bytes_compiled, "kernels": kernel_vs_twin, "ceilings": ceilings,
          "profile_d8": profile_d8, "s95_sharded": sharded_s95,
          "profile_d8_eager": lambda size, device, rounds: profile_d8(size, device, rounds, compiled=False)}
DEFAULT_STAGES = ("efficiency", "moe", "moe_bytes", "moe_bytes_compiled", "kernels")  # the others need a GPU


def main(argv=None):
    parser = argparse.ArgumentParser(prog="bench/bench.py", usage=argparse.SUPPRESS,
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("stages", nargs="*", help=f"of {', '.join(STAGES)} (default: "
                        f"{', '.join(DEFAULT_STAGES)}; bench/gpu_check.sh names the others)")
    parser.add_argument("--gpu", action="store_true", help="on CUDA, bf16 autocast, larger sizes")
    parser.add_argument("--dry-run", action="store_true", help="toy sizes, one round")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds after a warm-up round")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (default 1: the steadiest)")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.stages) - set(STAGES))
    if unknown:
        parser.error(f"unknown stage {unknown[0]!r}: choose from {', '.join(STAGES)}")
    device = "cuda" if args.gpu else "cpu"
    if device == "cpu":
        torch.set_num_threads(args.threads)
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's import: the kernels' only CPU path
    size = SIZES["dry" if args.dry_run else device]
    for stage in args.stages or DEFAULT_STAGES:
        STAGES[stage](size, device, 1 if args.dry_run else args.rounds)


if __name__ == "__main__":
    main()
