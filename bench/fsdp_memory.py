"""
The memory planner (tooling/memory.py) against PyTorch's own FSDP2 memory tracker, on this CPU.

For each GPU run the README and the configs give, one rank of it is simulated: a fake process group of
world_size ranks, FakeTensorMode (shapes, no values, no memory), the model built on the meta device and
sharded by tooling.distributed.shard with the bf16 policy, then two real training steps (bf16 autocast
forward, backward, Muon + AdamW step) under torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker,
whose peak snapshot gives the bytes by category. One JSON line per run: the tracker's peak total and
categories beside the planner's, and their ratio.

    python bench/fsdp_memory.py                 # every README / config GPU run (about a minute)
    python bench/fsdp_memory.py --only x_d8_vanilla

What the tracker cannot see (the planner's 10% headroom is for these): the CUDA context and NCCL buffers,
the caching allocator's fragmentation, kernel workspaces (cuBLAS, FlexAttention), and the GPU attention
kernels themselves: on this CPU SDPA runs its CPU kernel (no T x T matrix either). The MoE's grouped
GEMMs have the same shapes whatever the routing, so fake tensors run them as they are.
"""
import json
import os
import sys
import time
from dataclasses import replace

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import grow  # noqa: E402
import match  # noqa: E402
import model as model_module  # noqa: E402
import train  # noqa: E402
from tooling import distributed, guards, memory  # noqa: E402
from tooling import common  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def runs():
    """(name, ModelConfig, world_size, micro_batch, grad_accum, reshard_after_forward, optimizer) of every documented
    GPU run: each config's
    own batch on 8 GPUs (a node), the [X] growth configs also after growth."""
    out = []
    for name in ("x_d8_vanilla", "x_d8_operator1", "x_d8_loop2", "x_d8_untied2", "x_d8_loop_grow",
                 "x_d8_untied_grow", "smelt_200m_base", "smelt_200m_s95"):
        values = train.SETTINGS.resolve(train.SETTINGS.parse([os.path.join(REPO, "config", f"{name}.py")]))
        config, cfg = train.SETTINGS.build(train.TrainConfig, values), train.SETTINGS.build(train.ModelConfig, values)
        for when, shape in grow.shapes_of_run(cfg, config):
            guards.derive_grad_accum(config, 8)
            out.append((name + when.replace(" ", "_"), shape, 8, config.batch_size, config.grad_accum,
                        config.parallel != "fsdp_grad_op", config.optimizer))
    return out


def tracked_peak(cfg, world, micro_batch, grad_accum=1, reshard_after_forward=True, optimizer="muon", steps=2):
    """{category: bytes} at the peak over `steps` training steps of one rank, from FSDPMemTracker (the 2nd
    step holds the optimizer state the 1st one created)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore
    cfg = replace(cfg, document_mask=False)  # the GPU's FlexAttention keeps no mask; SDPA here none either
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))  # outside FakeTensorMode
        with FakeTensorMode():
            with torch.device("meta"):
                model = model_module.GPT(cfg)
            distributed.shard(model, torch.device("cpu"), world, torch.bfloat16, reshard_after_forward, mesh=mesh)
            model.to_empty(device="cpu")
            optimizers = train.build_optimizers(model, train.TrainConfig(optimizer=optimizer), torch.bfloat16)
            tracker = FSDPMemTracker(model, optimizers[-1])
            with tracker:
                for step in range(steps):
                    for micro in range(grad_accum):
                        idx = torch.randint(0, cfg.vocab_size - 1, (micro_batch, cfg.block_size))
                        with distributed.no_sync(model, model, skip=micro < grad_accum - 1), \
                                torch.autocast("cpu", dtype=torch.bfloat16):
                            (model(idx, idx)[1] / grad_accum).backward()
                        tracker.reset_mod_stats()  # per-module statistics of one forward (the peak stays)
                    for opt in optimizers:
                        opt.step()
                        opt.zero_grad(set_to_none=True)
            snapshot = tracker.get_tracker_snapshot("peak")
    finally:
        dist.destroy_process_group()
    (device_snapshot,) = snapshot.values()
    return {getattr(k, "value", k): v for k, v in device_snapshot.items()}


def compare(name, cfg, world, micro_batch, grad_accum=1, reshard_after_forward=True, optimizer="muon"):
    grad_accum = min(grad_accum, 2)  # what accumulation keeps is the same for any number of micro-batches >= 2
    t0 = time.time()
    peak = tracked_peak(cfg, world, micro_batch, grad_accum, reshard_after_forward, optimizer)
    plan = memory.memory_plan(cfg, world, micro_batch, optimizer, grad_accum=grad_accum)["fsdp"]
    gib = 2 ** 30
    if not reshard_after_forward:  # every block's gathered bf16 copy kept from its forward to its backward
        plan["total_gb_per_gpu"] += 2 * cfg.n_blocks * match.block_shapes(cfg)["total"] / gib
    return dict(bench="fsdp_memory", run=name, world_size=world, micro_batch=micro_batch, grad_accum=grad_accum,
                reshard_after_forward=reshard_after_forward, optimizer=optimizer,
                tracker_peak_gb=round(peak["Total"] / gib, 2),
                planner_gb=round(plan["total_gb_per_gpu"], 2),
                planner_over_tracker=round(plan["total_gb_per_gpu"] * gib / peak["Total"], 3),
                tracker_gb={k: round(v / gib, 2) for k, v in peak.items() if k != "Total" and v},
                planner_parts_gb={k[:-len("_gb_per_gpu")]: round(plan[k], 2) for k in
                                  ("states_gb_per_gpu", "activations_gb_per_gpu", "transient_gb_per_gpu")},
                seconds=round(time.time() - t0, 1))


def main(argv=None):
    ap = common.parser("bench/fsdp_memory.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="comma-separated run names (default: all)")
    args = ap.parse_args(argv)
    for name, cfg, world, micro_batch, grad_accum, reshard, optimizer in runs():
        if not args.only or name in args.only.split(","):
            print(json.dumps(compare(name, cfg, world, micro_batch, grad_accum, reshard, optimizer)), flush=True)


if __name__ == "__main__":
    main()
