"""train.py with a fault on one rank, for tests/test_trust.py: a process that freezes, dies or fails at a chosen
point of the run (a test's stand-in for a node that hangs, crashes or fills its disk).

    python tests/fault_driver.py RANK POINT KIND [train.py settings ...]

RANK: the rank that faults. KIND: freeze (SIGSTOP itself), kill (SIGKILL itself) or raise (an OSError: the
disk is full). POINT: where, the first time it is reached after the run's first checkpoint (write: at
the first checkpoint):
  step     a block's forward (FSDP all-gathers around it)     muon     Muon's orthogonalize_split (a gather)
  scatter  Muon's scatter back, after its gathers              eval     the evaluation (forwards, all-reduces)
  read     the all-reduce of the step losses                   finite   a sharded save's non-finite check
  barrier  a sharded save's barrier (the store) before DCP     dcp      inside DCP's save (its own collectives)
  swap     after DCP's save, while rank 0 swaps the directory  write    a shard file opened by DCP's writer
  log      the log written after a checkpoint (rank 0's)   memory   (any KIND) the free memory read: 1 MiB
"""
import errno
import os
import signal
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint import filesystem  # noqa: E402

import model  # noqa: E402
import muon  # noqa: E402
import train  # noqa: E402
from tooling import checkpoint, distributed, guards, memory, rundir  # noqa: E402

fault_rank, point, kind, *settings = sys.argv[1:]
armed = point == "write"  # the others: once a checkpoint is written
in_muon = False


def fault():
    global armed
    armed = False
    if kind == "freeze":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    else:
        raise OSError(errno.ENOSPC, "No space left on device")


def at(name, function, before=True):
    """function, faulting on this point's first call once armed (before it runs, or after: before=False)."""
    def call(*args, **kwargs):
        if armed and point == name and before:
            fault()
        result = function(*args, **kwargs)
        if armed and point == name and not before:
            fault()
        return result
    return call


def saved(function):
    def call(*args, **kwargs):
        global armed
        function(*args, **kwargs)
        armed = armed or point != "write"
    return call


def orthogonalize_split(self, split):
    global in_muon
    in_muon = True
    try:
        return real_split(self, split)
    finally:
        in_muon = False


def scatter(*args, **kwargs):
    if in_muon and armed and point == "scatter":
        fault()
    return real_scatter(*args, **kwargs)


def create_stream(self, path, mode):
    if armed and point == "write" and "w" in mode:
        fault()
    return real_create_stream(self, path, mode)


def open_log(path, mode="r", *args, **kwargs):
    if armed and point == "log" and str(path).endswith("log.jsonl") and "a" in mode:
        fault()
    return open(path, mode, *args, **kwargs)


if os.environ.get("RANK") == fault_rank:
    model.Block.forward = at("step", model.Block.forward)
    real_split, muon.Muon.orthogonalize_split = muon.Muon.orthogonalize_split, \
        at("muon", orthogonalize_split)
    real_scatter, dist.scatter = dist.scatter, scatter
    train.evaluate = at("eval", train.evaluate)
    guards.read_losses = at("read", guards.read_losses)
    checkpoint.check_finite = at("finite", checkpoint.check_finite)
    distributed.barrier = at("barrier", distributed.barrier)
    dcp.save = at("dcp", at("swap", dcp.save, before=False))
    real_create_stream, filesystem.FileSystem.create_stream = filesystem.FileSystem.create_stream, create_stream
    checkpoint.save_sharded = saved(checkpoint.save_sharded)
    checkpoint.save_file = saved(checkpoint.save_file)
    rundir.open = open_log
    if point == "memory":
        memory.memory_reading = lambda device: dict(available=1 << 20, meminfo=None, cgroup=None)

distributed.exit(train.main(settings))
