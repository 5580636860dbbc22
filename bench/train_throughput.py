"""
Training throughput of the tiny default (a SMELT-looped MoE, train.py's defaults) beside a dense model
with the same active size (same layout and width, one SwiGLU of hidden top_k * expert_hidden instead of
the experts), one full training step each (forward, backward, Muon + AdamW step). One JSON line per
model: tokens/s (median over the timed steps), ms/step (wall) and CPU ms/step (process time summed
over threads: less sensitive to other processes on a shared machine), active params, analytic
FLOPs/token and the achieved FLOP/s.

    python bench/train_throughput.py                       # CPU, a few steps
    python bench/train_throughput.py --steps 20 --device cuda --compile
    python bench/train_throughput.py --config config/smelt_200m_base.py --batch_size 1 --device cuda  # + MFU
"""
import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train  # noqa: E402
from tooling.common import resolve_device  # noqa: E402
from tooling.settings import read_config_file  # noqa: E402
from model import GPT  # noqa: E402


def dense_twin(settings):
    """The same model with a dense SwiGLU of the MoE's active hidden size (top_k * expert_hidden)."""
    cfg = train.SETTINGS.build(train.ModelConfig, settings)
    return settings | dict(n_expert=0, mlp_hidden=cfg.top_k * cfg.expert_hidden if cfg.n_expert else cfg.mlp_hidden)


def measure(settings, steps, warmup, device, compile_model, peak_flops=None):
    cfg = train.SETTINGS.build(train.ModelConfig, settings)
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    optimizers = train.build_optimizers(model, train.SETTINGS.build(train.TrainConfig, settings))
    step_model = torch.compile(model) if compile_model else model
    use_bf16 = device.type == "cuda"
    B, T = settings["batch_size"], cfg.block_size
    x = torch.randint(0, cfg.vocab_size - 1, (B, T), device=device)
    y = torch.randint(0, cfg.vocab_size - 1, (B, T), device=device)
    times, cpu_times = [], []
    for i in range(warmup + steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0, c0 = time.perf_counter(), time.process_time()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16):
            _, loss = step_model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), settings["grad_clip"])
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
            cpu_times.append(time.process_time() - c0)
    seconds = sorted(times)[len(times) // 2]
    flops_per_token = train.flops_per_token(cfg)
    tokens = B * T
    return dict(bench="train_throughput", model="moe" if cfg.n_expert else "dense", layout=cfg.layout,
                n_expert=cfg.n_expert, top_k=cfg.top_k if cfg.n_expert else None, device=str(device),
                compile=compile_model, batch_size=B, block_size=T, params_total=model.num_params()["total"],
                params_active=model.num_params()["active"], flops_per_token=flops_per_token,
                ms_per_step=round(seconds * 1e3, 2),
                cpu_ms_per_step=round(sorted(cpu_times)[len(cpu_times) // 2] * 1e3, 2), tokens_per_s=round(tokens / seconds, 1),
                achieved_gflops=round(flops_per_token * tokens / seconds / 1e9, 2), timed_steps=steps,
                threads=torch.get_num_threads(),
                mfu=round(flops_per_token * tokens / seconds / peak_flops, 4) if peak_flops else None)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch_size", type=int, default=None, help="default: train.py's batch_size")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--config", default="", help="a config file (default: the tiny default)")
    parser.add_argument("--peak_tflops", type=float, default=989.0,
                        help="bf16 dense peak for MFU on CUDA (989: H100/H200 SXM, as the [X] code)")
    args = parser.parse_args(argv)
    device = resolve_device(args.device)
    overrides = read_config_file(args.config) if args.config else {}
    if args.batch_size is not None:
        overrides["batch_size"] = args.batch_size
    settings = train.SETTINGS.resolve(overrides)
    peak = args.peak_tflops * 1e12 if device.type == "cuda" else None
    for s in (settings, dense_twin(settings)):
        print(json.dumps(measure(s, args.steps, args.warmup, device, args.compile, peak)), flush=True)


if __name__ == "__main__":
    main()
