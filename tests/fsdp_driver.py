"""Run under torchrun by tests/test_train_fsdp.py: several FSDP training runs in one process group (one
launch instead of one per run), then the measurements the test compares against one process.

    torchrun --standalone --nproc_per_node=2 tests/fsdp_driver.py JOBS.json RESULTS.json [--compile_backend B]

JOBS.json: [{"name": ..., "settings": {train overrides}, "then": [{more overrides}, ...]}]; "then" runs
the same run again with those overrides (a resume). RESULTS.json (rank 0): per job the log records, the
per-rank state bytes and the logits of the sharded model on a fixed batch. --compile_backend: the backend
of every torch.compile the runs make (--compile=True), e.g. aot_eager (no code generation)."""
import functools
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train  # noqa: E402
from tooling import distributed, rundir  # noqa: E402


def sharded_logits(summary, settings):
    """Logits of the trained, still sharded model on a fixed batch (all ranks run the forward), and this
    rank's bytes of weights, gradients and optimizer state."""
    overrides = dict(settings, init_from="resume", max_steps=summary["step"],
                     out_dir=settings["out_dir"], run_name=settings.get("run_name", "tiny"))
    values, source, _ = rundir.resolve_run(train.SETTINGS, overrides)
    config, cfg = train.SETTINGS.build(train.TrainConfig, values), train.SETTINGS.build(train.ModelConfig, values)
    rank, world, device = distributed.setup(config.device, config.parallel)
    model, optimizers, _ = train.build_model(config, cfg, source, device, world, "stable", use_bf16=False)
    idx = torch.arange(2 * 16).reshape(2, 16) % (cfg.vocab_size - 1)
    with torch.no_grad():
        logits = model(idx)[0]
    model(idx, idx)[1].backward()  # the gradients a training step holds: weights + gradients + optimizer state
    state_bytes = torch.tensor([distributed.local_state_bytes(model, optimizers)])
    gathered = [torch.zeros_like(state_bytes) for _ in range(world)]
    dist.all_gather(gathered, state_bytes)
    return logits, [int(b) for b in gathered]


def main():
    jobs_path, results_path = sys.argv[1:3]
    if "--compile_backend" in sys.argv:
        torch.compile = functools.partial(torch.compile, backend=sys.argv[sys.argv.index("--compile_backend") + 1])
    jobs = json.load(open(jobs_path))
    results = {}
    for job in jobs:
        summaries = [train.train(job["settings"])]
        for more in job.get("then", []):
            summaries.append(train.train(dict(out_dir=job["settings"]["out_dir"], init_from="resume") | more))
        result = dict(summaries=[{k: s[k] for k in ("step", "tokens", "ckpt_path", "resume_path", "log_path",
                                                     "val_loss", "train_losses")} for s in summaries])
        if job.get("measure"):
            logits, state_bytes = sharded_logits(summaries[-1], job["settings"])
            result.update(state_bytes=state_bytes)
            if dist.get_rank() == 0:
                torch.save(logits, os.path.join(job["settings"]["out_dir"], "sharded_logits.pt"))
        results[job["name"]] = result
    if dist.get_rank() == 0:
        json.dump(results, open(results_path, "w"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    distributed.exit(0)  # gloo threads can abort a normal interpreter shutdown (tooling/distributed.py)
