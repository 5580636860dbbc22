"""
How close each layout's training step comes to the matmul peak it could reach, measured side by side.

One full training step (forward, backward, clip, optimizer step) of each model at one shape (default:
1 thread, fp32, batch 8 x 256 tokens, width 256, 4 layers, vocab 4096), in interleaved rounds so every
model sees the same machine load; the practical peak is a 2048 x 2048 x 2048 fp32 torch.mm on the same
thread, timed in the same rounds. FLOPs are the model's analytic training FLOPs (match.py: equal to
torch's FlopCounterMode, with causal attention counted as half the square), not the optimizer's.

    python bench/efficiency.py                      # JSON lines, then a table
    python bench/efficiency.py --rounds 9 --threads 2

Models: plain dense; SMELT r=2 (middle 2 of 4 layers twice); prelude-core-coda tied K=2 (1/2/1 blocks,
boundary operator); plain with MoE of 8 experts top-2 and of 64 experts top-8 (the same active size as
the dense SwiGLU); each with AdamW and with Muon; and the tiny default (train.py's defaults) with both
optimizers, for the Muon overhead. Targets: plain >= 0.80 of peak; SMELT and pcc >= 0.97x plain; MoE 8e
top-2 >= 0.9x plain; Muon adds <= 15% to the tiny default's step.
"""
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import match  # noqa: E402
import train  # noqa: E402
from model import GPT, ModelConfig  # noqa: E402
from tooling import common  # noqa: E402
from tooling.common import number  # noqa: E402
from tooling.distributed import keep_freed_memory  # noqa: E402

SHAPE = dict(vocab_size=4096, eot_token=4095, n_layer=4, n_embd=256, n_head=4)
MODELS = {
    "plain": dict(layout="plain"),
    "smelt_r2": dict(layout="smelt", n_passes=2),
    "pcc_tied_k2": dict(layout="pcc", n_passes=2),
    "moe_8e_top2": dict(layout="plain", n_expert=8, top_k=2),
    "moe_64e_top8": dict(layout="plain", n_expert=64, top_k=8),
}


class Step:
    """One model + optimizer + batch; call() runs one full training step."""

    def __init__(self, cfg, optimizer, batch_size):
        torch.manual_seed(0)
        self.model = GPT(cfg)
        self.config = train.TrainConfig(optimizer=optimizer)
        self.optimizers = train.build_optimizers(self.model, self.config)
        g = torch.Generator().manual_seed(0)
        self.x = torch.randint(0, cfg.eot_token, (batch_size, cfg.block_size), generator=g)
        self.y = torch.randint(0, cfg.eot_token, (batch_size, cfg.block_size), generator=g)
        self.flops = match.flops_per_token(cfg) * self.x.numel()

    def __call__(self):
        loss = self.model(self.x, self.y)[1]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip)
        for opt in self.optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)


def matmul_peak(n=2048):
    a, b = torch.randn(n, n), torch.randn(n, n)

    def run():
        torch.mm(a, b)
    run.flops = 2 * n ** 3
    return run


def timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv=None):
    ap = common.parser("bench/efficiency.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=number(int, 1), default=7, help="timed rounds (after one warm-up round)")
    ap.add_argument("--threads", type=number(int, 1), default=1)
    ap.add_argument("--batch_size", type=number(int, 1), default=8)
    ap.add_argument("--block_size", type=number(int, 1), default=256)
    ap.add_argument("--only", default="", help="comma-separated model names (default: all)")
    ap.add_argument("--glibc_default", action="store_true", help="leave glibc's allocator as it is (train.py keeps "
                                                                 "freed memory on a CPU)")
    args = ap.parse_args(argv)
    allocator = "glibc default" if args.glibc_default else keep_freed_memory().removeprefix("allocator: ")
    torch.set_num_threads(args.threads)
    names = [n for n in MODELS if not args.only or n in args.only.split(",")]
    steps = {"peak": matmul_peak()}
    for name in names:
        cfg = ModelConfig(**SHAPE, block_size=args.block_size, **MODELS[name])
        for optimizer in ("adamw", "muon"):
            steps[f"{name}/{optimizer}"] = Step(cfg, optimizer, args.batch_size)
    tiny = train.SETTINGS.build(train.ModelConfig, train.DEFAULTS)
    for optimizer in ("adamw", "muon", "muon_x"):  # muon_x: the [X] paper code's Muon (muon.py variant="x")
        steps[f"tiny_default/{optimizer}"] = Step(tiny, optimizer, train.DEFAULTS["batch_size"])
    times = {key: [] for key in steps}
    for r in range(args.rounds + 1):
        for key, fn in steps.items():
            t = timed(fn)
            if r:  # round 0 warms up
                times[key].append(t)
    median = {key: sorted(t)[len(t) // 2] for key, t in times.items()}
    peak = steps["peak"].flops / median["peak"]
    rows = []
    for key, fn in steps.items():
        if key == "peak":
            continue
        name, optimizer = key.split("/")
        gflops = fn.flops / median[key] / 1e9
        row = dict(bench="efficiency", model=name, optimizer=optimizer, ms_per_step=round(1e3 * median[key], 2),
                   gflops=round(gflops, 2), fraction_of_peak=round(gflops * 1e9 / peak, 3),
                   vs_plain=round(median[f"plain/{optimizer}"] / median[key] * fn.flops
                                  / steps[f"plain/{optimizer}"].flops, 3) if f"plain/{optimizer}" in median else None,
                   threads=args.threads, batch=f"{fn.x.size(0)}x{fn.x.size(1)}", allocator=allocator)
        rows.append(row)
        print(json.dumps(row), flush=True)
    muon_overhead = median["tiny_default/muon"] / median["tiny_default/adamw"] - 1
    print(json.dumps(dict(bench="efficiency", measurement="practical_peak", gflops=round(peak / 1e9, 2),
                          matmul="2048^3 fp32 torch.mm", threads=args.threads)))
    print(json.dumps(dict(bench="efficiency", measurement="muon_overhead_tiny_default",
                          ratio=round(1 + muon_overhead, 3), target=1.15)))
    muon_x_overhead = median["tiny_default/muon_x"] / median["tiny_default/adamw"] - 1
    print(json.dumps(dict(bench="efficiency", measurement="muon_x_overhead_tiny_default",
                          ratio=round(1 + muon_x_overhead, 3), vs_original_muon=round(
                              median["tiny_default/muon_x"] / median["tiny_default/muon"], 3))))
    print(f"\npractical peak {peak / 1e9:.1f} GFLOP/s ({args.threads} thread(s), 2048^3 fp32 mm; {allocator}); "
          f"vs_plain = achieved FLOP/s relative to plain with the same optimizer")
    print(f"{'model':<14} {'optimizer':<9} {'ms/step':>9} {'GFLOP/s':>8} {'of peak':>8} {'vs plain':>9}")
    for row in rows:
        vs = f"{row['vs_plain']:.3f}" if row["vs_plain"] is not None else "-"
        print(f"{row['model']:<14} {row['optimizer']:<9} {row['ms_per_step']:>9.1f} {row['gflops']:>8.1f} "
              f"{row['fraction_of_peak']:>8.3f} {vs:>9}")
    print(f"Muon adds {muon_overhead:+.1%} to the tiny default's step (target <= +15%); the [X] code's Muon "
          f"{muon_x_overhead:+.1%}")


if __name__ == "__main__":
    main()
