"""Run by tests/test_parallel.py under torchrun: several training runs in one process group (one launch),
each with the resumes that follow it; rank 0 writes every run's summaries.

    torchrun --standalone --nproc_per_node=2 tests/dist_driver.py JOBS.json RESULTS.json"""
import json
import os
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train  # noqa: E402

if __name__ == "__main__":
    jobs_path, results_path = sys.argv[1:3]
    dist.init_process_group("gloo")
    results = {}
    for job in json.load(open(jobs_path)):
        summaries = [train.train(job["settings"])]
        for more in job.get("then", []):
            summaries.append(train.train(dict(out_dir=job["settings"]["out_dir"], init_from="resume") | more))
        results[job["name"]] = [{k: s[k] for k in ("step", "log_path", "ckpt_path", "train_losses", "val_loss")}
                                for s in summaries]
    if dist.get_rank() == 0:
        json.dump(results, open(results_path, "w"))
    dist.destroy_process_group()
