"""
Training throughput of one config on one device: tokens/s, achieved FLOP/s and MFU, timed after warm-up.

    python bench/train_throughput.py --config config/x_d8_loop2.py --batch_size 32 --device cuda
    python bench/train_throughput.py --config config/x_d8_loop2.py --batch_size 32 --device cuda --compile
    python bench/train_throughput.py --config config/x_d8_loop2.py --batch_size 32 --device cuda --triton
    python bench/train_throughput.py                      # the tiny default, on this machine

One full training step as train.py takes it (bf16 autocast on CUDA, forward, backward, clip, Muon + AdamW
step) on the device the model is built for, with the Triton kernels only when asked (kernels.apply) and
torch.compile only when asked. The first --warmup steps are not timed: they hold compilation (the
FlexAttention kernel, torch.compile, the Triton kernels), which is reported apart as warmup_seconds. The
tokens carry an end-of-text every 512 tokens, so the document mask is the one training sees. FLOPs are the
model's analytic training FLOPs (match.py); MFU = achieved FLOP/s / --peak_tflops (989: the dense bf16
peak of an H100 / H200 SXM, as the [X] code counts it). One JSON line.
"""
import contextlib
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import kernels  # noqa: E402
import train  # noqa: E402
from model import GPT  # noqa: E402
from tooling.common import resolve_device  # noqa: E402
from tooling import common  # noqa: E402
from tooling.common import number  # noqa: E402


def measure(config, cfg, device, steps=10, warmup=3, compile_model=False, triton=False, peak_flops=None):
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    use_bf16 = device.type == "cuda"
    optimizers = train.build_optimizers(model, config, torch.bfloat16 if use_bf16 else torch.float32)
    if triton:
        kernels.apply(model, optimizers)
    step_model = torch.compile(model) if compile_model else model
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if use_bf16 else contextlib.nullcontext()
    B, T = config.batch_size, cfg.block_size
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.eot_token, (B, T + 1), generator=g)
    tokens[:, ::512] = cfg.eot_token  # a document starts every 512 tokens (masked when cfg.document_mask)
    x, y = tokens[:, :-1].to(device), tokens[:, 1:].to(device)

    def step():
        with autocast:
            loss = step_model(x, y)[1]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    for _ in range(warmup):
        step()
    sync()
    warmup_seconds = time.perf_counter() - t0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    seconds = (time.perf_counter() - t0) / steps
    flops = train.flops_per_token(cfg, avg_doc_len=512 if cfg.document_mask else 0) * B * T
    return dict(bench="train_throughput", layout=cfg.layout, n_layer=cfg.n_layer, executed_blocks=cfg.executed_layers(),
                n_embd=cfg.n_embd, n_expert=cfg.n_expert, params_total=model.num_params()["total"], device=str(device),
                compile=compile_model, triton=triton, batch_size=B, block_size=T, ms_per_step=round(seconds * 1e3, 2),
                tokens_per_s=round(B * T / seconds, 1), achieved_tflops=round(flops / seconds / 1e12, 3),
                mfu=round(flops / seconds / peak_flops, 4) if peak_flops else None, timed_steps=steps,
                warmup_seconds=round(warmup_seconds, 1),
                peak_memory_gb=round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None)


def main(argv=None):
    parser = common.parser("bench/train_throughput.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="", help="a config file (default: the tiny default)")
    parser.add_argument("--batch_size", type=number(int, 1), default=None, help="sequences per step (default: the config's)")
    parser.add_argument("--steps", type=number(int, 1), default=10, help="timed steps (default 10)")
    parser.add_argument("--warmup", type=number(int, 0), default=3, help="untimed steps first, compilation included (default 3)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.add_argument("--triton", action="store_true", help="swap in the Triton kernels (kernels.apply)")
    parser.add_argument("--peak_tflops", type=number(float, 0, open_low=True), default=989.0,
                        help="bf16 dense peak for MFU on CUDA (default 989: H100/H200 SXM, as the [X] code)")
    args = parser.parse_args(argv)
    device = resolve_device(args.device)
    overrides = train.SETTINGS.parse([args.config] if args.config else [])
    if args.batch_size is not None:
        overrides["batch_size"] = args.batch_size
    values = train.SETTINGS.resolve(overrides)
    config, cfg = train.SETTINGS.build(train.TrainConfig, values), train.SETTINGS.build(train.ModelConfig, values)
    peak = args.peak_tflops * 1e12 if device.type == "cuda" else None
    print(json.dumps(measure(config, cfg, device, args.steps, args.warmup, args.compile, args.triton, peak)), flush=True)


if __name__ == "__main__":
    main()
