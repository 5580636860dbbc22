"""
The bench: one JSON line per measurement, each ratio beside its two times
(machine-dependent numbers).

    python bench/bench.py                         # the CPU stages (~2.5 min)
    python bench/bench.py moe kernels --rounds 9  # some stages
    python bench/bench.py --dry-run               # toy sizes, one round
    python3 bench/bench.py --gpu                  # CUDA, bf16 autocast, larger sizes

Both sides of a ratio run in turn, so they see the same machine load (docs/efficiency.md).
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

# The model and batch, the MoE's tokens, the kernels' rows, the ceilings' sizes.
SIZES = {
    "cpu": dict(batch=8, block_size=256, n_embd=256, n_layer=4, vocab_size=4096,
                moe_tokens=4096, rows=64, experts=64, mm=2048, copy_mb=64),
    "cuda": dict(batch=8, block_size=1024, n_embd=1024, n_layer=8, vocab_size=50304,
                 moe_tokens=65536, rows=16384, experts=64, mm=8192, copy_mb=1024),
    "dry": dict(batch=2, block_size=32, n_embd=64, n_layer=2, vocab_size=256,
                moe_tokens=256, rows=32, experts=4, mm=256, copy_mb=4),
}
# The MoE of the [S] 200M twin.
S95_MOE = dict(n_embd=1056, n_head=12, head_dim=88, n_expert=288, top_k=8, expert_hidden=352)
LAYOUTS = {
    "plain": {},
    "smelt_r2": dict(layout="smelt", n_passes=2),
    "layer_loop_r2": dict(layout="layer_loop", n_passes=2),
    "pcc_k2": dict(layout="pcc", n_passes=2),
    "pcc_untied_k2": dict(layout="pcc_untied", n_passes=2),
    "moe_8e_top2": dict(n_expert=8, top_k=2),
    "moe_64e_top8": dict(n_expert=64, top_k=8),
}


def emit(**row):
    print(json.dumps(row), flush=True)


def seconds(fn, device):
    # CUDA runs asynchronously: synchronise before each reading of the clock.
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


# Median seconds of each fn over `rounds` after a warm-up round, the fns in turn.
def interleaved(fns, rounds, device, desc):
    times = {name: [] for name in fns}
    for r in tqdm(range(rounds + 1), desc=desc, file=sys.stderr, leave=False, disable=None):
        for name, fn in fns.items():
            t = seconds(fn, device)
            times[name] += [t] if r else []
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}


def autocast(device):
    # bf16 autocast on CUDA, as train.py runs; plain fp32 on a CPU.
    return torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda")


# nanoGPT's GPT-2: pre-LayerNorm, biases, causal SDPA, GELU MLP 4x, learned positions, a
# tied head.
class GPT2(torch.nn.Module):
    def __init__(self, cfg):
        super().__init__()
        nn, d, V, L = torch.nn, cfg.n_embd, cfg.vocab_size, cfg.n_layer
        self.config = cfg
        self.wte, self.wpe = nn.Embedding(V, d), nn.Embedding(cfg.block_size, d)
        self.h = nn.ModuleList(nn.ModuleDict(dict(
            ln_1=nn.LayerNorm(d),
            attn=nn.Linear(d, 3 * d),
            proj=nn.Linear(d, d),
            ln_2=nn.LayerNorm(d),
            mlp=nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)),
        )) for _ in range(L))
        self.ln_f = nn.LayerNorm(d)
        # nanoGPT's init of the tied embedding: N(0, 1) gives 16x larger logits.
        nn.init.normal_(self.wte.weight, std=0.02)

    def forward(self, idx, targets):
        F, T, H = torch.nn.functional, idx.size(1), self.config.n_head
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for b in self.h:
            qkv = b.attn(b.ln_1(x)).chunk(3, dim=2)
            q, k, v = (t.unflatten(2, (H, -1)).transpose(1, 2) for t in qkv)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + b.proj(y.transpose(1, 2).flatten(2))
            x = x + b.mlp(b.ln_2(x))
        logits = F.linear(self.ln_f(x), self.wte.weight)
        return logits, F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


# match.py's count, the SwiGLU's 3 d hidden weights swapped for GPT-2's 8 d^2.
def gpt2_flops_per_token(cfg):
    mlp = 6 * cfg.n_layer * cfg.n_embd * (8 * cfg.n_embd - 3 * cfg.mlp_hidden)
    return match.flops_per_token(cfg) + mlp


# One training step of build(cfg) with AdamW, on fixed random tokens (no eot).
def train_step(cfg, size, device, build=GPT, flops_per_token=match.flops_per_token):
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
    # The step's FLOPs by the given count: GFLOP/s = flops / seconds.
    step.flops = flops_per_token(cfg) * x.numel()
    return step


def efficiency(size, device, rounds):
    shape = {k: size[k] for k in ("block_size", "n_embd", "n_layer", "vocab_size")}
    shape["n_head"] = 4
    steps = {
        name: train_step(ModelConfig(**shape, **kw), size, device)
        for name, kw in LAYOUTS.items()
    }
    steps["gpt2"] = train_step(ModelConfig(**shape), size, device, GPT2, gpt2_flops_per_token)
    median = interleaved(steps, rounds, device, "efficiency")
    # GFLOP/s by match.py's count of every executed block.
    gflops = {name: steps[name].flops / median[name] / 1e9 for name in steps}
    for name in steps:
        emit(
            stage="efficiency", model=name, ms=round(1e3 * median[name], 2),
            gflops=round(gflops[name], 2),
            **{f"vs_{ref}": round(gflops[name] / gflops[ref], 3) for ref in ("plain", "gpt2")},
            batch=f"{size['batch']}x{size['block_size']}",
            n_embd=size["n_embd"], n_layer=size["n_layer"],
        )


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
    # The dense SwiGLU has the MoE's active FLOPs.
    cfg = ModelConfig(n_embd=n_embd, n_expert=n_expert, top_k=top_k,
                      expert_hidden=expert_hidden, mlp_hidden=top_k * expert_hidden)
    torch.manual_seed(0)
    moe, dense = MoE(cfg).to(device), MLP(cfg).to(device)
    for p in [*moe.parameters(), *dense.parameters()]:
        torch.nn.init.normal_(p, std=0.02)
    # Sequences of 256 tokens.
    x = torch.randn(size["moe_tokens"] // 256, 256, n_embd, device=device)
    fns = {"moe": fwd_bwd(moe, x), "dense": fwd_bwd(dense, x)}
    median = interleaved(fns, rounds, device, "moe")
    emit(
        stage="moe", moe_ms=round(1e3 * median["moe"], 2),
        dense_ms=round(1e3 * median["dense"], 2),
        ratio=round(median["moe"] / median["dense"], 3), tokens=size["moe_tokens"],
        n_embd=n_embd, n_expert=n_expert, top_k=top_k, expert_hidden=expert_hidden,
        dense_hidden=cfg.mlp_hidden,
    )


# Bytes every op reads and writes: its tensor inputs and outputs (an in-place op's twice).
# A view moves none; new_zeros-like ops read only their input's dtype and device.
class ByteCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.by_op = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        views = any(
            r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns
        )
        if not outs or views:
            return out
        ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if func._opname.startswith("new_") or func._opname.endswith("_like"):
            ins = []
        moved = sum(map(distinct_bytes, ins)) + sum(map(distinct_bytes, outs))
        self.by_op[func.__name__] = self.by_op.get(func.__name__, 0) + moved
        return out


def distinct_bytes(t):
    # A dim of stride 0 (expanded) repeats the same elements.
    return t.element_size() * math.prod(n for n, stride in zip(t.shape, t.stride()) if stride)


# One MoE layer's forward + backward at the [S] 200M twin's widths in bf16: the bytes its
# ops move per token. Shapes only (FakeTensorMode): the CUDA path's count, anywhere.
def moe_bytes(size, device, rounds, tokens=16384):
    from torch._subclasses.fake_tensor import FakeTensorMode
    cfg = ModelConfig(**S95_MOE)
    with FakeTensorMode():
        torch.set_default_dtype(torch.bfloat16)
        moe = MoE(cfg)
        torch.set_default_dtype(torch.float32)
        x = torch.randn(tokens, cfg.n_embd, requires_grad=True)
        # The output's gradient, fp32 as the residual stream gives it.
        grad = torch.randn(tokens, cfg.n_embd)
        with ByteCounter() as counter:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out, _ = moe(x)
            out.backward(grad)
    moved = sum(counter.by_op.values()) / tokens
    # 3 GEMMs, each once forward and twice backward.
    flops = 3 * 3 * 2 * cfg.top_k * cfg.n_embd * cfg.expert_hidden
    top = sorted(counter.by_op.items(), key=lambda kv: -kv[1])[:4]
    emit(
        stage="moe_bytes", mb_per_token=round(moved / 1e6, 3),
        gemm_flop_per_byte=round(flops / moved, 1), gemm_mflop_per_token=round(flops / 1e6, 1),
        tokens=tokens, **S95_MOE,
        top_ops_kb_per_token={name: round(b / tokens / 1e3, 1) for name, b in top},
    )


# The same layer compiled by Inductor, by its own count. Two small batches: the weights'
# bytes are per call, the rest per token, and the line through the two gives `tokens`.
def moe_bytes_compiled(size, device, rounds, tokens=16384, counted_at=(64, 128)):
    from torch._inductor import metrics

    # Inductor keeps each kernel's buffer counts while this log is on (it stays silent).
    logging.getLogger("torch._inductor.compile_fx.__inductor_metrics").setLevel(logging.INFO)
    moe, counts = MoE(ModelConfig(**S95_MOE)).to(device, torch.bfloat16), []
    for n in counted_at:
        torch._dynamo.reset()
        metrics.reset()
        x = torch.randn(n, S95_MOE["n_embd"], device=device, requires_grad=True)
        # Autocast outside the compiled region, as train.py does.
        with torch.autocast(device, dtype=torch.bfloat16):
            out = torch.compile(moe, fullgraph=True, dynamic=False)(x)[0]
        out.backward(torch.randn_like(x))
        counts.append(metrics.num_bytes_accessed)
    per_token = (counts[1] - counts[0]) / (counted_at[1] - counted_at[0])
    moved = counts[0] + per_token * (tokens - counted_at[0])
    emit(stage="moe_bytes_compiled", mb_per_token=round(moved / tokens / 1e6, 3),
         tokens=tokens, **S95_MOE)


# name -> (kernel, twin, inputs); the experts n_embd / 4 wide, each row routed to 8.
def kernel_cases(size, device):
    # This import imports triton.
    from kernels import moe_kernel, newton_schulz_kernel, rmsnorm_kernel, swiglu_kernel

    rows, d, experts = size["rows"], size["n_embd"], size["experts"]
    g = torch.Generator().manual_seed(0)

    def r(*shape, fan_in=1):
        x = torch.randn(*shape, generator=g) / fan_in ** 0.5
        return x.to(device, torch.bfloat16 if device == "cuda" else torch.float32).requires_grad_()

    routed = torch.randint(0, experts, (8 * rows,), generator=g)
    counts = torch.bincount(routed, minlength=experts).to(device)
    moe = (
        r(8 * rows, d), counts, r(experts, d // 4, d, fan_in=d), r(experts, d // 4, d, fan_in=d),
        r(experts, d, d // 4, fan_in=d // 4),
    )
    norm = rmsnorm_kernel
    return {
        "rmsnorm": (kernels.rmsnorm, norm.rmsnorm_reference, (r(rows, d), r(d))),
        # alpha = 0.5
        "boundary_operator": (
            lambda *a: kernels.boundary_operator(*a[:2], 0.5, a[2]),
            lambda *a: norm.boundary_operator_reference(*a[:2], 0.5, a[2]),
            (r(rows, d), r(rows, d), r(d)),
        ),
        "swiglu": (
            kernels.swiglu, swiglu_kernel.swiglu_reference, (r(rows, 4 * d), r(rows, 4 * d))
        ),
        "moe_experts": (kernels.moe_experts, moe_kernel.moe_experts_reference, moe),
        "gram": (kernels.gram, newton_schulz_kernel.gram_reference, (r(16, d // 4, d),)),
    }


def kernel_vs_twin(size, device, rounds):
    for name, (kernel, twin, inputs) in kernel_cases(size, device).items():
        wrt = [t for t in inputs if t.is_floating_point()]
        out = {}
        for impl, fn in (("triton", kernel), ("twin", twin)):
            y = fn(*inputs)
            out[impl] = [y, *torch.autograd.grad(y.float().square().sum(), wrt)]
        # The largest difference over the largest value, of the output and every gradient.
        diff = max(
            ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
            for a, b in zip(*out.values())
        )
        row = dict(stage="kernels", kernel=name, shape="x".join(map(str, inputs[0].shape)),
                   dtype=str(y.dtype)[6:], max_rel_diff=float(f"{diff:.2g}"))
        # Times on CUDA only: the interpreter's speed says nothing.
        if device == "cuda":
            from triton.testing import do_bench

            ms = {}
            for impl, fn in (("triton", kernel), ("twin", twin)):
                ms[impl] = do_bench(
                    lambda: torch.autograd.grad(fn(*inputs).float().square().sum(), wrt),
                    return_mode="median",
                )
            row.update(triton_ms=round(ms["triton"], 4), twin_ms=round(ms["twin"], 4),
                       speedup=round(ms["twin"] / ms["triton"], 3))
        emit(**row)


# -----------------------------------------------------------------------------------------
# What a GPU run must return (bench/gpu_check.sh)

# The matmul's TFLOP/s, once measured: the profile's second MFU is against it.
CEILING = {}


# The machine's own ceilings: a large matmul and a device-to-device copy.
def ceilings(size, device, rounds):
    n, dtype = size["mm"], torch.bfloat16 if device == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    # copy_mb MiB of fp32.
    src = torch.empty(size["copy_mb"] * 2 ** 18, device=device)
    dst = torch.empty_like(src)
    fns = dict(matmul=lambda: a @ b, copy=lambda: dst.copy_(src))
    median = interleaved(fns, rounds, device, "ceilings")
    CEILING["tflops"] = 2 * n ** 3 / median["matmul"] / 1e12
    # A copy reads and writes every byte.
    emit(stage="ceilings", matmul_tflops=round(CEILING["tflops"], 1), matmul_n=size["mm"],
         copy_gb_s=round(2 * src.nbytes / median["copy"] / 1e9, 1),
         copy_mb=src.nbytes // 2 ** 20)


# (ModelConfig, TrainConfig) of a config file, as train.py reads it; dry: at a toy shape.
def run_config(path, dry, **dry_shape):
    import configurator
    import train
    settings = {**train.DEFAULTS, **configurator.read_config(path), **(dry_shape if dry else {})}
    # The GPT-2 vocabulary padded, as train.py pads it.
    if "x_d8" in path:
        settings["vocab_size"] = 256 if dry else 50304
    model_config = ModelConfig(
        **{k: settings[k] for k in train.MODEL_SETTINGS},
        vocab_size=settings.get("vocab_size", 4096),
    )
    training = {k: settings[k] for k in train.DEFAULTS if k not in train.MODEL_SETTINGS}
    return model_config, train.TrainConfig(**training)


# A micro-batch and the optimizers' step, timed apart, as train.py runs and compiles them
# (Inductor on CUDA, aot_eager on a CPU).
def timed_steps(model, config, device, rounds, desc):
    import train

    optimizers = train.build_optimizers(model, config, device == "cuda")
    shape = (config.batch_size, model.config.block_size)
    x = torch.randint(0, model.config.vocab_size - 1, shape, device=device)
    # Documents of 512 tokens, so the document mask is on.
    x[:, ::512] = model.config.eot_token
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
    # Two of each warm up, the compile included.
    warmup = seconds(lambda: [(micro_batch(), optimizer()) for _ in range(2)], device)
    median = interleaved(dict(micro_batch=micro_batch, optimizer=optimizer), rounds, device, desc)
    peak = torch.cuda.max_memory_allocated() / 2 ** 30 if device == "cuda" else None
    times = dict(warmup_s=round(warmup, 1), micro_batch_s=round(median["micro_batch"], 4),
                 optimizer_s=round(median["optimizer"], 4), peak_gb=peak and round(peak, 2))
    return times, micro_batch


# MFU of the GPU's bf16 peak (train.PEAK_FLOPS) and of the measured matmul.
def mfu(flops, seconds, device):
    import train

    peak = train.peak_flops(torch.device(device))
    of_matmul = round(flops / seconds / 1e12 / CEILING["tflops"], 3) if CEILING else None
    return dict(mfu=peak and round(flops / seconds / peak, 3), mfu_of_matmul=of_matmul)


# [X] d8 Loop-2 on one GPU as train.py steps it: a step's tokens/s and MFU, peak memory
# vs the planner's, dynamo's graphs, and the top 20 kernels of one micro-batch.
def profile_d8(size, device, rounds, compiled=True):
    import torch._dynamo.utils
    from torch.profiler import ProfilerActivity, profile

    dry = size is SIZES["dry"]
    cfg, config = run_config("config/x_d8_loop2.py", dry, n_layer=3, n_embd=32, n_head=2,
                             block_size=64, batch_size=2)
    # train.py's micro-batches per step on one GPU.
    accum = config.global_batch // config.batch_size
    tokens = config.global_batch * cfg.block_size
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    config.compile = compiled
    torch.manual_seed(0)
    times, micro_batch = timed_steps(GPT(cfg).to(device), config, device, rounds, "d8")
    # A step: its micro-batches, then one optimizer step.
    step = accum * times["micro_batch_s"] + times["optimizer_s"]
    planned = match.memory_plan(cfg, 1, config.batch_size, config.optimizer)["ddp"]["total_gb"]
    counters = torch._dynamo.utils.counters
    emit(
        stage="profile_d8", compiled=compiled, step_s=round(step, 3),
        tokens_per_s=round(tokens / step),
        **mfu(match.flops_per_token(cfg) * tokens, step, device), **times,
        planned_gb=round(planned, 2), graphs=counters["stats"]["unique_graphs"],
        graph_breaks=sum(counters["graph_break"].values()),
        micro_batches=accum, tokens_per_step=tokens,
    )
    cuda = device == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        micro_batch()
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    top = sorted(prof.key_averages(), key=lambda e: -getattr(e, attr, 0))[:20]
    top_ms = [[e.key[:90], round(getattr(e, attr, 0) / 1e3, 3)] for e in top]
    emit(stage="profile_d8_kernels", compiled=compiled, top_ms_per_micro_batch=top_ms)


# The [S] 200M twin and its baseline, built sharded in one process as train.py builds them,
# with activation checkpointing and, where the planner says it fits, without.
def sharded_s95(size, device, rounds):
    import torch.distributed as dist
    import train

    dry, cuda = size is SIZES["dry"], device == "cuda"
    backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        for name in ("s95", "base"):
            cfg, config = run_config(
                f"config/smelt_200m_{name}.py", dry, n_embd=64, n_head=2, head_dim=32,
                n_kv_head=1, n_expert=8, expert_hidden=16, block_size=128, batch_size=1,
            )
            # The dry run stays eager here: profile_d8 rehearses the compile.
            config.parallel, config.compile = "fsdp", cuda
            gpu_gb = torch.cuda.get_device_properties(0).total_memory / 2 ** 30 if cuda else 80
            for checkpointing in (True, False):
                plan = match.memory_plan(cfg, 1, config.batch_size, config.optimizer, gpu_gb,
                                         checkpointing=checkpointing)["fsdp"]
                if not plan["fits"] and not checkpointing and not dry:
                    emit(stage="s95_sharded", model=name, checkpointing=False,
                         planned_gb=plan["total_gb"])
                    continue
                torch._dynamo.reset()
                torch.manual_seed(0)
                model = train.build_model(cfg, config, cuda, torch.device(device), True)
                model.activation_checkpointing = checkpointing
                desc = f"{name} checkpointing {checkpointing}"
                times = timed_steps(model, config, device, rounds, desc)[0]
                tokens = config.batch_size * cfg.block_size
                seconds = times["micro_batch_s"]
                emit(
                    stage="s95_sharded", model=name, checkpointing=checkpointing,
                    tokens_per_s=round(tokens / seconds),
                    **mfu(match.flops_per_token(cfg) * tokens, seconds, device), **times,
                    planned_gb=round(plan["total_gb"], 2), tokens=tokens,
                )
                del model
    finally:
        dist.destroy_process_group()


STAGES = {
    "efficiency": efficiency,
    "moe": moe_vs_dense,
    "moe_bytes": moe_bytes,
    "moe_bytes_compiled": moe_bytes_compiled,
    "kernels": kernel_vs_twin,
    "ceilings": ceilings,
    "profile_d8": profile_d8,
    "s95_sharded": sharded_s95,
    "profile_d8_eager": lambda size, device, rounds: profile_d8(size, device, rounds, False),
}
# The others need a GPU.
DEFAULT_STAGES = ("efficiency", "moe", "moe_bytes", "moe_bytes_compiled", "kernels")


def main(argv=None):
    parser = argparse.ArgumentParser(prog="bench/bench.py", usage=argparse.SUPPRESS,
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("stages", nargs="*", help=(
        f"of {', '.join(STAGES)} (default: {', '.join(DEFAULT_STAGES)}; "
        "bench/gpu_check.sh names the others)"
    ))
    parser.add_argument("--gpu", action="store_true", help="on CUDA, bf16 autocast, larger sizes")
    parser.add_argument("--dry-run", action="store_true", help="toy sizes, one round")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds after a warm-up round")
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU threads (default 1: the steadiest)")
    args = parser.parse_args(argv)
    # A mistake is one line with status 2.
    unknown = sorted(set(args.stages) - set(STAGES))
    if unknown:
        parser.error(f"unknown stage {unknown[0]!r}: choose from {', '.join(STAGES)}")
    device = "cuda" if args.gpu else "cpu"
    if device == "cpu":
        torch.set_num_threads(args.threads)
        # The kernels' only CPU path, set before triton is imported.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    size = SIZES["dry" if args.dry_run else device]
    for stage in args.stages or DEFAULT_STAGES:
        STAGES[stage](size, device, 1 if args.dry_run else args.rounds)


if __name__ == "__main__":
    main()
