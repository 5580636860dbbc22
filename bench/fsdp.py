"""
DDP against FSDP2, side by side in one run: training step time (tokens/s) and the bytes of weights +
gradients + optimizer state each process holds, on CPU processes (gloo), for the tiny default and a
wider MoE. The two run in alternating rounds on the same process group, so both see the same load.

    python bench/fsdp.py [--nproc 2] [--steps 6]

Targets (CPU, 2 processes): FSDP step time <= 1.3x DDP's at the wider config; per-process state about
1/2 of DDP's. One JSON line per measurement, then the ratios.
"""
import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train  # noqa: E402
from data.loader import TokenStream  # noqa: E402
from model import GPT  # noqa: E402
from tooling import distributed  # noqa: E402
from tooling import common  # noqa: E402
from tooling.common import number  # noqa: E402

CONFIGS = {
    "tiny_default": dict(),
    "wide_moe": dict(n_layer=4, n_embd=384, n_head=6, n_expert=16, top_k=2, batch_size=8, block_size=128),
}


def build(name, parallel, device, world):
    settings = train.SETTINGS.resolve(CONFIGS[name] | dict(parallel=parallel))
    config, cfg = train.SETTINGS.build(train.TrainConfig, settings), train.SETTINGS.build(train.ModelConfig, settings)
    torch.manual_seed(0)
    model = GPT(cfg)
    optimizers = train.shard_and_build_optimizers(model, config, device, world, use_bf16=False)  # sharded under fsdp
    tokens = np.random.default_rng(0).integers(0, cfg.eot_token, 1 << 20).astype(np.uint16)
    stream = TokenStream(tokens, cfg.block_size, config.seed)
    return config, model, distributed.wrap(model, device, world, config), optimizers, stream


def step(model, raw, optimizers, stream, position, config, rank, world):
    """One training step as train.py's loop takes it: grad_accum micro-batches, clip, optimizer step."""
    for micro in range(config.grad_accum):
        x, y = stream.batch(position + (rank * config.grad_accum + micro) * config.batch_size, config.batch_size)
        with distributed.no_sync(model, raw, skip=world > 1 and micro < config.grad_accum - 1):
            (model(x, y)[1] / config.grad_accum).backward()
    torch.nn.utils.clip_grad_norm_(raw.parameters(), config.grad_clip)
    for opt in optimizers:
        opt.step()
        opt.zero_grad(set_to_none=True)


def worker(steps):
    rank, world, device = distributed.setup("auto", "fsdp")
    torch.set_num_threads(1)
    runs = {(name, parallel): build(name, parallel, device, world) for name in CONFIGS for parallel in ("ddp", "fsdp")}
    positions = {key: 0 for key in runs}
    times = {key: [] for key in runs}
    for round_ in range(steps + 1):  # round 0 warms up
        for key, (config, raw, model, optimizers, stream) in runs.items():
            t0 = time.perf_counter()
            step(model, raw, optimizers, stream, positions[key], config, rank, world)
            if round_:
                times[key].append(time.perf_counter() - t0)
            positions[key] += config.batch_size * config.grad_accum * world
    for key, (config, raw, model, optimizers, stream) in runs.items():
        x, y = stream.batch(0, config.batch_size)
        model(x, y)[1].backward()  # the gradients a step holds: weights + gradients + optimizer state
        held = torch.tensor([distributed.local_state_bytes(raw, optimizers)], dtype=torch.float64)
        gathered = [torch.zeros_like(held) for _ in range(world)]
        torch.distributed.all_gather(gathered, held)
        if rank == 0:
            seconds = float(np.median(times[key]))
            tokens = config.batch_size * config.grad_accum * world * raw.config.block_size
            print(json.dumps(dict(bench="fsdp", config=key[0], parallel=key[1], processes=world,
                                  ms_per_step=round(1e3 * seconds, 1), tokens_per_s=round(tokens / seconds),
                                  state_bytes_per_process=[int(g.item()) for g in gathered])), flush=True)
    distributed.teardown()


def main(argv=None):
    ap = common.parser("bench/fsdp.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=number(int, 1), default=2)
    ap.add_argument("--steps", type=number(int, 1), default=6)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.steps)
        return
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
           os.path.abspath(__file__), "--worker", f"--steps={args.steps}"]
    out = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"bench/fsdp.py: the {args.nproc}-process run failed:\n{out.stderr[-3000:]}")
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    for row in rows:
        print(json.dumps(row))
    by = {(r["config"], r["parallel"]): r for r in rows}
    for name in CONFIGS:
        ddp, fsdp = by[(name, "ddp")], by[(name, "fsdp")]
        print(json.dumps(dict(bench="fsdp", config=name, step_time_fsdp_over_ddp=round(fsdp["ms_per_step"] / ddp["ms_per_step"], 3),
                              state_fsdp_over_ddp=round(max(fsdp["state_bytes_per_process"]) /
                                                        max(ddp["state_bytes_per_process"]), 3),
                              target_step_time=1.3 if name == "wide_moe" else None, target_state=0.5)))


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)  # see the end of train.py: gloo threads can abort a normal interpreter shutdown
