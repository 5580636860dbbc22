"""
The bench: one JSON line per measurement, each ratio beside its two times (machine-dependent numbers).

    python bench/bench.py                          # every stage on this CPU (~1 min, one thread)
    python bench/bench.py moe kernels --rounds 9   # some stages
    python bench/bench.py --dry-run                # toy sizes, seconds (the tests run it)
    python3 bench/bench.py --gpu                   # CUDA, bf16 autocast, larger sizes (bench/gpu_check.sh)

Stages (both sides of a ratio run in turn in the same rounds, so they see the same machine load; medians):
  efficiency  a training step (forward, backward, AdamW) of each layout at one shape: GFLOP/s from match.py's
              analytic FLOPs (every executed block counted), vs_plain = its GFLOP/s over the plain model's,
              of_peak = over a large matmul's (fp32 2048^3 on a CPU, bf16 8192^3 on CUDA).
  moe         the MoE layer (64 experts, top-8, sort by expert + grouped GEMM) forward + backward vs a dense
              SwiGLU of equal active FLOPs (hidden = top_k x expert_hidden): ratio = moe / dense.
  moe_bytes   the bytes one MoE layer's forward + backward moves per token at the [S] 200M twin's widths
              (bf16 autocast, bf16 weights, 16k tokens; shapes only), and its grouped GEMMs' FLOP/byte.
  kernels     each Triton kernel vs its PyTorch twin, forward + backward: on CUDA their times (speedup =
              twin / kernel); on a CPU the interpreter's largest difference only (its speed says nothing).
"""
import argparse
import json
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
                experts=64, mm=2048),
    "cuda": dict(batch=8, block_size=1024, n_embd=1024, n_layer=8, vocab_size=50304, moe_tokens=65536,
                 rows=16384, experts=64, mm=8192),
    "dry": dict(batch=2, block_size=32, n_embd=64, n_layer=2, vocab_size=256, moe_tokens=256, rows=32,
                experts=4, mm=256),
}
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


def train_step(cfg, batch, device):
    """One training step on fixed random tokens (no eot: one document per row), flops = its analytic FLOPs."""
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, cfg.vocab_size - 1, (batch, cfg.block_size), device=device)

    def step():
        with autocast(device):
            loss = model(x, x)[1]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    step.flops = match.flops_per_token(cfg) * x.numel()
    return step


def matmul(n, device):
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    step = lambda: a @ b  # noqa: E731
    step.flops = 2 * n ** 3
    return step


def efficiency(size, device, rounds):
    shape = {k: size[k] for k in ("block_size", "n_embd", "n_layer", "vocab_size")}
    steps = {name: train_step(ModelConfig(**shape, n_head=4, **kw), size["batch"], device)
             for name, kw in LAYOUTS.items()}
    steps["peak"] = matmul(size["mm"], device)
    median = interleaved(steps, rounds, device, "efficiency")
    gflops = {name: steps[name].flops / median[name] / 1e9 for name in steps}
    for name in LAYOUTS:
        emit(stage="efficiency", model=name, ms=round(1e3 * median[name], 2), gflops=round(gflops[name], 2),
             vs_plain=round(gflops[name] / gflops["plain"], 3),
             of_peak=round(gflops[name] / gflops["peak"], 3),
             batch=f"{size['batch']}x{size['block_size']}", **{k: size[k] for k in ("n_embd", "n_layer")})
    emit(stage="efficiency", model="peak_matmul", ms=round(1e3 * median["peak"], 2),
         gflops=round(gflops["peak"], 2))


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
    """Bytes every op reads and writes (its tensor inputs and outputs; a view or a query moves none)."""

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
        moved = sum(t.nbytes for t in ins) + sum(t.nbytes for t in outs if all(t is not i for i in ins))
        self.by_op[func.__name__] = self.by_op.get(func.__name__, 0) + moved
        return out


def moe_bytes(size, device, rounds, tokens=16384):
    """One MoE layer's forward + backward at the [S] 200M twin's widths (config/smelt_200m_s95.py) on
    `tokens` tokens, under bf16 autocast with bf16 weights (what FSDP2 gathers): the bytes its ops move per
    token and the grouped GEMMs' FLOPs per byte. Shapes only (FakeTensorMode): the count is the CUDA path's,
    made in seconds on any machine."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    cfg = ModelConfig(n_embd=1056, n_head=12, head_dim=88, n_expert=288, top_k=8, expert_hidden=352)
    with FakeTensorMode():
        torch.set_default_dtype(torch.bfloat16)
        moe = MoE(cfg)
        torch.set_default_dtype(torch.float32)
        x = torch.randn(tokens, cfg.n_embd, requires_grad=True)
        with ByteCounter() as counter:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out, _ = moe(x)
            out.float().sum().backward()
    moved = sum(counter.by_op.values()) / tokens
    flops = 3 * 3 * 2 * cfg.top_k * cfg.n_embd * cfg.expert_hidden  # 3 GEMMs, forward + 2 in the backward
    top = sorted(counter.by_op.items(), key=lambda kv: -kv[1])[:4]
    emit(stage="moe_bytes", mb_per_token=round(moved / 1e6, 3), gemm_flop_per_byte=round(flops / moved, 1),
         gemm_mflop_per_token=round(flops / 1e6, 1), tokens=tokens, n_embd=cfg.n_embd,
         n_expert=cfg.n_expert, top_k=cfg.top_k, expert_hidden=cfg.expert_hidden,
         top_ops_kb_per_token={name: round(b / tokens / 1e3, 1) for name, b in top})


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


STAGES = {"efficiency": efficiency, "moe": moe_vs_dense, "moe_bytes": moe_bytes, "kernels": kernel_vs_twin}


def main(argv=None):
    parser = argparse.ArgumentParser(prog="bench/bench.py", usage=argparse.SUPPRESS,
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("stages", nargs="*", help=f"of {', '.join(STAGES)} (default: all)")
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
    for stage in args.stages or STAGES:
        STAGES[stage](size, device, 1 if args.dry_run else args.rounds)


if __name__ == "__main__":
    main()
