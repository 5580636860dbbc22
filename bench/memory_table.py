"""
Per-GPU memory of every named config and [S] preset under DDP and FSDP2 on 8 and 16 80-GiB GPUs, as the
README table (match.py's memory planner; analytic, seconds, no GPU needed).

    python bench/memory_table.py            # the markdown table
    python bench/memory_table.py --json     # one JSON line per model
    python bench/memory_table.py --cpu      # train.py's CPU estimate vs the peak RSS it measures (minutes)

Micro-batches: each config at its own batch_size per GPU, its accumulation at each number of GPUs (from
global_batch), activation checkpointing off, also after growth to K = 4 for the two growth configs; the [S] models at one
4096-token sequence per GPU, activation checkpointing on at 600M and 1.6B. Muon, bf16 autocast.

--cpu runs train.py on this CPU (the tiny default at 8 x 1024, 2 x 4096 and 15 x 1024 tokens, and a dense
prelude-core-coda model at 8 x 1024; --steps steps, two evals) and prints, per run, the peak resident
memory its header estimates (tooling.memory.check_memory: the process now + states, activations, mask,
allocator retention) beside the peak RSS the run reached (ru_maxrss); the target is a ratio within 15% of 1.
"""
import copy
import glob
import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import grow  # noqa: E402
import match  # noqa: E402
import train  # noqa: E402
from tooling import common, guards, match_cli, memory  # noqa: E402

GPUS, GPU_GB = (8, 16), 80
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def batch_on(config, world):
    """(micro-batch, grad_accum) of a config on `world` GPUs: with global_batch, grad_accum = global_batch /
    (batch_size x world), and batch_size = global_batch / world where more GPUs than that would overshoot it."""
    config = copy.copy(config)
    if config.global_batch and config.batch_size * world > config.global_batch:
        config.batch_size = config.global_batch // world
    guards.derive_grad_accum(config, world)
    return config.batch_size, config.grad_accum


def models():
    """(label, ModelConfig, {GPUs: (micro-batch, grad_accum)}, activation checkpointing, optimizer) of every row:
    each named config at its own batch (the [X] growth configs also after growth), each [S] preset at one
    sequence per GPU with AdamW ([S] trains with AdamW)."""
    rows = []
    for path in sorted(glob.glob(os.path.join(REPO, "config", "[!_]*.py"))):
        values = train.SETTINGS.resolve(train.SETTINGS.parse([path]))
        config, cfg = train.SETTINGS.build(train.TrainConfig, values), train.SETTINGS.build(train.ModelConfig, values)
        batches = {w: batch_on(config, w) for w in GPUS}
        for when, shape in grow.shapes_of_run(cfg, config):
            rows.append((f"`{os.path.basename(path)}`{when}", shape, batches, config.activation_checkpointing,
                         config.optimizer))
    for scale, (*_, experts) in match_cli.SCALES.items():
        for s in experts:
            base, doc_len = match_cli.preset_baseline(f"smelt-{scale}-s{s}")
            twin, _ = match.match(base, "smelt", avg_doc_len=doc_len)
            checkpointing = scale in ("600m", "1.6b")
            rows.append((f"smelt-{scale}-s{s} baseline", base, dict.fromkeys(GPUS, (1, 1)), checkpointing, "adamw"))
            rows.append((f"smelt-{scale}-s{s} SMELT", twin, dict.fromkeys(GPUS, (1, 1)), checkpointing, "adamw"))
    return rows


DENSE = ("--layout=pcc", "--n_layer=3", "--n_passes=2", "--n_expert=0", "--n_embd=256", "--optimizer=adamw")
CPU_RUNS = (("tiny", 8, 1024, ()), ("tiny", 2, 4096, ()), ("tiny", 15, 1024, ()),  # the tiny default's MoE
            ("dense pcc K=2", 8, 1024, DENSE))


def cpu_estimates(steps):
    """One JSON line per CPU run: train.py's estimated peak resident memory vs the peak RSS it reached (the
    ru_maxrss of its own wrapper's only child)."""
    wrapper = ("import resource, subprocess, sys; code = subprocess.run(sys.argv[1:]).returncode; "
               "print('MAXRSS_KIB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(code)")
    for model, batch_size, block_size, flags in CPU_RUNS:
        with tempfile.TemporaryDirectory() as out:
            run = subprocess.run([sys.executable, "-c", wrapper, sys.executable, "train.py",
                                  f"--batch_size={batch_size}", f"--block_size={block_size}", f"--max_steps={steps}",
                                  f"--warmup_steps={min(steps, 20)}", f"--eval_interval={max(1, steps // 2)}",
                                  f"--out_dir={out}", *flags], cwd=REPO, capture_output=True, text=True)
        if run.returncode != 0:
            raise SystemExit(f"train.py failed:\n{run.stderr[-2000:]}")
        estimate = float(re.search(r"peak resident memory about ([\d.]+) GiB", run.stdout).group(1))
        measured = int(re.search(r"MAXRSS_KIB (\d+)", run.stdout).group(1)) / 2**20
        print(json.dumps(dict(bench="memory_cpu", model=model, batch_size=batch_size, block_size=block_size,
                              steps=steps,
                              estimated_peak_rss_gib=estimate, measured_peak_rss_gib=round(measured, 3),
                              ratio=round(estimate / measured, 3), target="0.85-1.15")), flush=True)


def main(argv=None):
    ap = common.parser("bench/memory_table.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--cpu", action="store_true", help="train.py's CPU estimate vs measured peak RSS")
    ap.add_argument("--steps", type=common.number(int, 1), default=20, help="--cpu: training steps per run")
    args = ap.parse_args(argv)
    if args.cpu:
        return cpu_estimates(args.steps)
    if not args.json:
        columns = " | ".join(f"{p} x{w}" for w in GPUS for p in ("DDP", "FSDP"))
        print(f"| model | params | micro-batch x accumulation | AC | {columns} | FSDP max micro-batch x"
              + " / x".join(map(str, GPUS)) + " |")
        print("| --- | ---: | --- | --- |" + " ---: |" * (2 * len(GPUS) + 1))
    for label, cfg, batches, checkpointing, optimizer in models():
        plans = [memory.memory_plan(cfg, w, batches[w][0], optimizer, activation_checkpointing=checkpointing,
                                    gpu_gb=GPU_GB, grad_accum=batches[w][1]) for w in GPUS]
        params = match.accounting(cfg)["params_total"]
        if args.json:
            print(json.dumps(dict(bench="memory", model=label.replace("`", ""), params=params,
                                  micro_batch=batches[GPUS[0]][0], grad_accum=batches[GPUS[0]][1],
                                  batch_by_gpus={w: batches[w] for w in GPUS},
                                  block_size=cfg.block_size, activation_checkpointing=checkpointing,
                                  **{f"{s}_x{p['world_size']}": p[s] for p in plans for s in ("ddp", "fsdp")})))
            continue
        cells = [f"{p[s]['total_gb_per_gpu']:.1f} {'yes' if p[s]['fits'] else '**no**'}" for p in plans
                 for s in ("ddp", "fsdp")]
        first = batches[GPUS[0]]
        batch = f"{first[0]} x {cfg.block_size} x {first[1]}"
        for w in GPUS[1:]:  # another number of GPUs that changes the batch
            if batches[w] != first:
                batch += f" (x{w}: {batches[w][0]} x {cfg.block_size} x {batches[w][1]})"
        print(f"| {label} | {params / 1e9:.2f}B | {batch} | "
              f"{'on' if checkpointing else 'off'} | "
              + " | ".join(cells) + " | " + " / ".join(str(p["fsdp"]["max_micro_batch"]) for p in plans) + " |")


if __name__ == "__main__":
    main()
