"""
Process groups, DDP and FSDP2 wrapping, and the collectives train.py makes, in one place.

Guards against: a collective handed a tensor on a device its backend cannot serve (NCCL has no CPU
backend: a CPU loss tensor all-reduced under NCCL fails at step 0 on the first multi-GPU run, a failure
gloo on CPU never shows), ranks that disagree on how many collectives they make (under FSDP every
forward is a collective), and a teardown that aborts the interpreter.

    rank, world, device = setup(device="auto", parallel="ddp")   # under torchrun or not
    model = shard(model, device, world, param_dtype=torch.bfloat16)   # FSDP2: blocks gather bf16 copies
    loss = all_reduce(loss)                                       # summed over ranks; a no-op alone
"""

import contextlib
import datetime
import os
import re
import socket

import torch
import torch.distributed as dist

from tooling.common import first_line, resolve_device


def active():
    return dist.is_available() and dist.is_initialized()


def precision(dtype, device):
    """(bf16?, the autocast context) of train.py's dtype setting: "auto" is bf16 autocast on CUDA, fp32 on CPU."""
    use_bf16 = dtype == "bfloat16" or (dtype == "auto" and device.type == "cuda")
    return use_bf16, torch.autocast(device.type, dtype=torch.bfloat16) if use_bf16 else contextlib.nullcontext()


def setup(device="auto", parallel="ddp", timeout_s=600.0):
    """(rank, world_size, device); initialises the process group under torchrun. The backend maps CPU
    tensors to gloo and CUDA tensors to nccl ("cpu:gloo,cuda:nccl"), so a collective on either device
    works. parallel="fsdp" in one process runs as one shard in a one-process group. timeout_s: a
    collective (or the start-up rendezvous) waiting longer than this for a peer raises (peer_failure)."""
    device = resolve_device(device)
    if "RANK" not in os.environ and parallel != "fsdp":
        return 0, 1, device
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if device.type == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device(f"cuda:{local_rank}")
    if not dist.is_initialized():
        backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=timeout_s)
        if "RANK" in os.environ:
            dist.init_process_group(backend=backend, timeout=timeout)
        else:  # one process, one shard
            dist.init_process_group(backend=backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                                    world_size=1, timeout=timeout)
    return rank, world, device


def peer_failure(error):
    """True for an error a collective raises when another process died (connection reset or closed) or
    stalled past the timeout: gloo raises RuntimeErrors naming itself, NCCL DistBackendErrors."""
    text = str(error)
    return isinstance(error, dist.DistError) or any(mark in text for mark in (
        "/gloo/", "NCCL", "Connection reset", "Connection closed", "Timed out", "timed out", "Broken pipe"))


def failure_reason(error):
    """The first sentence of a collective's error, without gloo's source-location prefix."""
    line = re.sub(r"^\[[^\]]*\]\s*", "", first_line(error))
    return line.split(". ")[0][:160]


def rank():
    return dist.get_rank() if active() else 0


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def teardown():
    if active():
        dist.destroy_process_group()


def exit(status):
    """sys.exit(status) for a script run under torchrun. On CPU, gloo's worker threads can outlive
    destroy_process_group and abort the interpreter's shutdown after FSDP2 collectives ("terminate
    called without an active exception", about 1 run in 10; a torch issue without an upstream fix):
    once everything is written and flushed, such a process leaves directly."""
    import sys
    if "RANK" in os.environ and not torch.cuda.is_available():
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(status)
    sys.exit(status)


def all_reduce(tensor, op="sum"):
    """tensor summed ("sum") or reduced with "min" / "max" over every process, in place; a no-op without
    a process group of several. The one helper train.py's own collectives go through: hand it tensors on
    the model's device (tests/test_gpu_rehearsal.py holds every one to that on fake CUDA tensors)."""
    if active() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=dict(sum=dist.ReduceOp.SUM, min=dist.ReduceOp.MIN, max=dist.ReduceOp.MAX)[op])
    return tensor


def barrier():
    if active():
        dist.barrier()


def shard(model, device, world, param_dtype=None, reshard_after_forward=True, mesh=None):
    """FSDP2: fully_shard every stored block, then the whole model (embedding, head, norms) on one
    DeviceMesh; every parameter becomes a DTensor holding 1/world of its rows. param_dtype=torch.bfloat16
    (train.py: bf16 on CUDA): the blocks gather bf16 copies of their fp32 master weights and reduce
    gradients in fp32, and nothing else changes: inputs are not cast (the residual stream stays fp32, as
    under DDP, where autocast casts only the matmul operands) and the root (embedding, lm head, final
    norm) keeps fp32 parameters, so the embedding's output is fp32 too; autocast runs the matmuls in bf16
    either way. None: every parameter in its own dtype (fp32).
    Looped blocks: a tied core or a SMELT span runs the same sharded block several times per forward.
    Gradients accumulate over the visits and are reduce-scattered once per backward (tested equal to one
    process). With reshard_after_forward=True each visit all-gathers the block again (forward and
    backward): r or K gathers of a looped block per pass, but only one gathered block in memory at a
    time, which is what lets the 21.5B / 53.9B-parameter [S] MoEs fit. reshard_after_forward=False
    gathers every block once per step and keeps it until its backward: fewer collectives when the
    unsharded model fits (python -m tooling.memory says whether it does). mesh: a DeviceMesh made
    beforehand (bench/fsdp_memory.py makes it outside FakeTensorMode), else one of world ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mesh = mesh or init_device_mesh(device.type, (world,))
    blocks = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False) \
        if param_dtype is not None else MixedPrecisionPolicy()
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=blocks, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy())
    return model


def is_sharded(model):
    return any(hasattr(p, "device_mesh") for p in model.parameters())


def full_state(tensors):
    """{name: tensor} with every FSDP shard gathered into the whole tensor (a collective: every rank)."""
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in tensors.items()}


def wrap(model, device, world, parallel, compile=False):
    """The module the training step calls: DDP around the model (several processes, parallel="ddp"),
    and / or torch.compile. The unwrapped model (sharded in place under FSDP) stays the one to save."""
    if compile:
        model = torch.compile(model)
    if world > 1 and parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                        gradient_as_bucket_view=True)  # no second copy of the gradients
    return model


@contextlib.contextmanager
def no_sync(model, raw_model, skip):
    """Gradient accumulation: when `skip`, do not reduce gradients across processes for this backward
    (DDP's no_sync, FSDP2's set_requires_gradient_sync); the last micro-batch reduces them all."""
    if not skip:
        yield
    elif hasattr(model, "no_sync"):  # DDP
        with model.no_sync():
            yield
    elif hasattr(raw_model, "set_requires_gradient_sync"):  # FSDP2
        raw_model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            raw_model.set_requires_gradient_sync(True)
    else:
        yield


def local(t):
    """The part of a tensor this process holds: an FSDP2 DTensor's shard, or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def local_state_bytes(model, optimizers):
    """Bytes of weights, gradients and optimizer state this process holds (its shards under FSDP)."""
    tensors = [p for p in model.parameters()] + [p.grad for p in model.parameters() if p.grad is not None]
    tensors += [v for opt in optimizers for s in opt.state.values() for v in s.values()
                if torch.is_tensor(v) and v.dim() > 0]
    return sum(local(t).numel() * t.element_size() for t in tensors)
