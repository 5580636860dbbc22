"""tests/test_parallel.py's jobs in one process group: runs and their resumes, models built sharded,
Muon on DDP replicas; rank 0 writes the results.

    torchrun --standalone --nproc_per_node=2 tests/dist_driver.py JOBS.json RESULTS.json"""
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train  # noqa: E402
from model import ModelConfig  # noqa: E402
from muon import Muon  # noqa: E402

# tall, square (two: one bucket of the x variant), wide, thin, stacked experts: 8 matrices
MUON_SHAPES = [(16, 8), (8, 8), (8, 8), (5, 8), (7, 3), (3, 6, 4)]


class CountingMuon(Muon):
    counted = 0  # (out, in) matrices orthogonalised

    def orthogonalize(self, update, steps):
        self.counted += update.shape[:-2].numel()
        return super().orthogonalize(update, steps)


def muon_steps(variant, steps=2):
    """Muon steps on seeded matrices, the same in every process (DDP replicas under torchrun), in bf16
    as on CUDA: (the weights, the matrices this process orthogonalised)."""
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(*shape, generator=g) for shape in MUON_SHAPES]
    opt = CountingMuon(params, lr=0.1, weight_decay=0.1, variant=variant, ns_dtype=torch.bfloat16)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return [p.tolist() for p in params], opt.counted


def count_cross_node_all_reduces(crossings):
    """Count in crossings[0] the all-reduces over a group that spans nodes (HSDP's replicas)."""
    all_reduce = dist.all_reduce

    def counted(*args, group=None, **kwargs):
        per_node = int(os.environ["LOCAL_WORLD_SIZE"])
        if group is not None and len({r // per_node for r in dist.get_process_group_ranks(group)}) > 1:
            crossings[0] += 1
        return all_reduce(*args, group=group, **kwargs)
    dist.all_reduce = counted


if __name__ == "__main__":
    dist.init_process_group("gloo")
    results, crossings = {}, [0]
    count_cross_node_all_reduces(crossings)
    for job in json.load(open(sys.argv[1])):
        if "build" in job:  # a model built sharded, its consolidated weights saved (rank 0)
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
            torch.manual_seed(0)
            model = train.build_model(ModelConfig(**job["build"]), train.TrainConfig(parallel="fsdp"), False,
                                      torch.device("cpu"), True)
            full = StateDictOptions(full_state_dict=True, cpu_offload=True)
            weights = get_model_state_dict(model, options=full)
            if dist.get_rank() == 0:
                torch.save(weights, job["path"])
            continue
        if "muon" in job:  # every rank's muon_steps, gathered
            results[job["name"]] = [None] * dist.get_world_size()
            dist.all_gather_object(results[job["name"]], muon_steps(job["muon"]))
            continue
        os.environ["LOCAL_WORLD_SIZE"] = str(job.get("per_node", os.environ["LOCAL_WORLD_SIZE"]))
        if job.get("unshared"):  # each rank its own folder, as nodes without a shared filesystem
            job["settings"]["out_dir"] += f"_{dist.get_rank()}"
        crossings[0] = 0
        try:
            summaries = [train.train(job["settings"])]
        except ValueError as e:
            results[job["name"]] = str(e)
            continue
        for more in job.get("then", []):
            summaries.append(train.train(dict(out_dir=job["settings"]["out_dir"], init_from="resume") | more))
        keys = ("step", "log_path", "ckpt_path", "train_losses", "val_loss")
        summaries = [{k: s[k] for k in keys} | dict(cross_node_all_reduces=crossings[0]) for s in summaries]
        results[job["name"]] = summaries
    if dist.get_rank() == 0:
        json.dump(results, open(sys.argv[2], "w"))
    dist.destroy_process_group()
