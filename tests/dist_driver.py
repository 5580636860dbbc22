"""Run by tests/test_parallel.py under torchrun: several training runs in one process group (one launch),
each with the resumes that follow it, and models built sharded; rank 0 writes every run's summaries.

    torchrun --standalone --nproc_per_node=2 tests/dist_driver.py JOBS.json RESULTS.json"""
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train  # noqa: E402
from model import ModelConfig  # noqa: E402

if __name__ == "__main__":
    jobs_path, results_path = sys.argv[1:3]
    dist.init_process_group("gloo")
    results = {}
    for job in json.load(open(jobs_path)):
        if "build" in job:  # a model built sharded, its consolidated weights saved (rank 0)
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
            torch.manual_seed(0)
            config = train.TrainConfig(parallel="fsdp")
            model = train.build_model(ModelConfig(**job["build"]), config, False, torch.device("cpu"), True)
            weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            if dist.get_rank() == 0:
                torch.save(weights, job["path"])
            continue
        os.environ["LOCAL_WORLD_SIZE"] = str(job.get("per_node", os.environ["LOCAL_WORLD_SIZE"]))  # nodes of so many
        summaries = [train.train(job["settings"])]
        for more in job.get("then", []):
            summaries.append(train.train(dict(out_dir=job["settings"]["out_dir"], init_from="resume") | more))
        results[job["name"]] = [{k: s[k] for k in ("step", "log_path", "ckpt_path", "train_losses", "val_loss")}
                                for s in summaries]
    if dist.get_rank() == 0:
        json.dump(results, open(results_path, "w"))
    dist.destroy_process_group()
