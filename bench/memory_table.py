"""
Per-GPU memory of every named config and [S] preset under DDP and FSDP2 on 8 and 16 80-GiB GPUs, as the
README table (match.py's memory planner; analytic, seconds, no GPU needed).

    python bench/memory_table.py            # the markdown table
    python bench/memory_table.py --json     # one JSON line per model

Micro-batches: the [X] d8 configs at their own batch_size (32 x 2048 tokens per GPU), activation
checkpointing off, also after growth to K = 4 for the two growth configs; the [S] models at one
4096-token sequence per GPU, activation checkpointing on at 600M and 1.6B. Muon, bf16 autocast.
"""
import argparse
import glob
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import grow  # noqa: E402
import match  # noqa: E402
import train  # noqa: E402
from tooling import guards, memory  # noqa: E402

GPUS, GPU_GB = (8, 16), 80
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def models():
    """(label, ModelConfig, micro-batch, grad_accum, activation checkpointing, optimizer) of every row: each
    named config at its own batch on 8 GPUs (the [X] growth configs also after growth), each [S] preset at
    one sequence per GPU with AdamW ([S] trains with AdamW)."""
    rows = []
    for path in sorted(glob.glob(os.path.join(REPO, "config", "*.py"))):
        values = train.SETTINGS.resolve(train.SETTINGS.parse([path]))
        config, cfg = train.SETTINGS.build(train.TrainConfig, values), train.SETTINGS.build(train.ModelConfig, values)
        guards.derive_grad_accum(config, 8)
        for when, shape in grow.shapes_of_run(cfg, config):
            rows.append((f"`{os.path.basename(path)}`{when}", shape, config.batch_size, config.grad_accum,
                         config.activation_checkpointing, config.optimizer))
    for scale, (*_, experts) in match.SCALES.items():
        for s in experts:
            base, doc_len = match.preset_baseline(f"smelt-{scale}-s{s}")
            twin, _ = match.match(base, "smelt", avg_doc_len=doc_len)
            checkpointing = scale in ("600m", "1.6b")
            rows.append((f"smelt-{scale}-s{s} baseline", base, 1, 1, checkpointing, "adamw"))
            rows.append((f"smelt-{scale}-s{s} SMELT", twin, 1, 1, checkpointing, "adamw"))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if not args.json:
        columns = " | ".join(f"{p} x{w}" for w in GPUS for p in ("DDP", "FSDP"))
        print(f"| model | params | micro-batch x accumulation | AC | {columns} | FSDP max micro-batch x"
              + " / x".join(map(str, GPUS)) + " |")
        print("| --- | ---: | --- | --- |" + " ---: |" * (2 * len(GPUS) + 1))
    for label, cfg, micro_batch, grad_accum, checkpointing, optimizer in models():
        plans = [memory.memory_plan(cfg, w, micro_batch, optimizer, activation_checkpointing=checkpointing,
                                    gpu_gb=GPU_GB, grad_accum=grad_accum) for w in GPUS]
        params = match.accounting(cfg)["params_total"]
        if args.json:
            print(json.dumps(dict(bench="memory", model=label.replace("`", ""), params=params, micro_batch=micro_batch,
                                  grad_accum=grad_accum,
                                  block_size=cfg.block_size, activation_checkpointing=checkpointing,
                                  **{f"{s}_x{p['world_size']}": p[s] for p in plans for s in ("ddp", "fsdp")})))
            continue
        cells = [f"{p[s]['total_gb_per_gpu']:.1f} {'yes' if p[s]['fits'] else '**no**'}" for p in plans
                 for s in ("ddp", "fsdp")]
        print(f"| {label} | {params / 1e9:.2f}B | {micro_batch} x {cfg.block_size} x {grad_accum} | "
              f"{'on' if checkpointing else 'off'} | "
              + " | ".join(cells) + " | " + " / ".join(str(p["fsdp"]["max_micro_batch"]) for p in plans) + " |")


if __name__ == "__main__":
    main()
