"""
Process groups, DDP and FSDP2 wrapping, and the collectives train.py makes, in one place.

Guards against: a collective handed a tensor on a device its backend cannot serve (NCCL has no CPU
backend: a CPU loss tensor all-reduced under NCCL fails at step 0 on the first multi-GPU run, a failure
gloo on CPU never shows), ranks that disagree on how many collectives they make (under FSDP every
forward is a collective), a teardown that aborts the interpreter, and ranks that decide apart: a
decision made from one rank's facts (its free memory, its files) is exchanged and made the same on every
rank (exchange, agree), and a failure on one rank ends every rank with one line naming it (see
"Ranks that decide together" below).

    rank, world, device = setup(device="auto", parallel="ddp")   # under torchrun or not
    model = shard(model, device, world, param_dtype=torch.bfloat16)   # FSDP2: blocks gather bf16 copies
    loss = all_reduce(loss)                                       # summed over ranks; a no-op alone
    readings = exchange("the memory check", free_bytes)          # every rank's value, by rank
"""

import contextlib
import ctypes
import datetime
import json
import math
import os
import platform
import re
import socket
import sys
import threading
import time

import torch
import torch.distributed as dist

from model import execution_plan
from tooling.common import error_message, first_line, resolve_device


def active():
    return dist.is_available() and dist.is_initialized()


def compute(config, device):
    """(bf16?, the autocast context, a note for the run's header) of train.py's settings: dtype "auto" is bf16
    autocast on CUDA, fp32 on CPU; on a CPU, torch's thread count is set (cpu_threads) and freed memory is kept
    for the next step (keep_freed_memory)."""
    use_bf16 = config.dtype == "bfloat16" or (config.dtype == "auto" and device.type == "cuda")
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if use_bf16 else contextlib.nullcontext()
    return use_bf16, autocast, f"{cpu_threads()}; {keep_freed_memory()}" if device.type == "cpu" else None


GLIBC_ALLOCATOR_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES")


def keep_freed_memory():
    """Have glibc keep the memory a step frees for the next step, as PyTorch's caching allocator keeps a GPU's,
    and say so. By default glibc hands blocks of 32 MiB and more back to the kernel when they are freed (mmap'd
    blocks, the heap's top trimmed) and the next step faults them in again, page by page and zeroed: an MoE
    layer's tokens x top_k x width rows are such blocks (0.02-0.03 s of its 0.16 s forward + backward in
    bench/moe_dispatch.py; the per-expert loop it replaced paid less, its blocks being small). The cost: the
    process keeps its high-water mark. Left alone when the environment sets glibc's allocator itself, or the C
    library is not glibc. Process-wide and idempotent (train.py, the benches)."""
    if any(os.environ.get(name) for name in GLIBC_ALLOCATOR_ENV):
        return "allocator: glibc's as the environment sets it"
    if platform.libc_ver()[0] != "glibc":
        return "allocator: the C library's own"
    mallopt, M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = ctypes.CDLL(None).mallopt, -1, -3
    if not (mallopt(M_MMAP_THRESHOLD, 1 << 30) and mallopt(M_TRIM_THRESHOLD, 2 ** 31 - 1)):
        return "allocator: glibc's default (it refused to keep freed memory)"
    return "allocator: glibc keeps freed memory (no page faults on reuse)"


def cpu_threads():
    """Set torch's threads per process on a CPU and say why: OMP_NUM_THREADS when set (torchrun sets 1); else
    the cores the 1-minute load average leaves idle, shared by this host's processes, at least 1 and at most
    torch's current count. More threads than idle cores spin against the other load:
    on a busy 2-core machine 15 steps took 470 s with torch's default of 2 threads, 29 s with 1."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if os.environ.get("OMP_NUM_THREADS"):
        n, why = torch.get_num_threads(), "OMP_NUM_THREADS"
    else:
        cores, load = len(os.sched_getaffinity(0)), os.getloadavg()[0]
        n = max(1, min(torch.get_num_threads(), round(cores - load) // local))
        why = (f"{cores} cores, load {load:.1f}, {local} process{'es' if local > 1 else ''} here; "
               "OMP_NUM_THREADS=N sets it")
    torch.set_num_threads(n)
    return f"cpu: {n} torch thread{'s' if n > 1 else ''} per process ({why})"


# a collective (or the start-up rendezvous) waiting longer than this for a peer ends the run (peer_failure):
# torch's own 10 minutes; the environment variable changes it (a cluster's slow start, the tests' frozen peers)
COLLECTIVE_TIMEOUT_ENV, COLLECTIVE_TIMEOUT_S = "LOOPSTUDY_COLLECTIVE_TIMEOUT_S", 600.0


def collective_timeout_s():
    """The collective timeout in seconds: $LOOPSTUDY_COLLECTIVE_TIMEOUT_S, else 600."""
    text = os.environ.get(COLLECTIVE_TIMEOUT_ENV)
    if text is None:
        return COLLECTIVE_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 1):
        raise ValueError(f"{COLLECTIVE_TIMEOUT_ENV}={text!r}: must be a number of seconds >= 1")
    return value


def setup(device="auto", parallel="ddp", timeout_s=None):
    """(rank, world_size, device); initialises the process group under torchrun. The backend maps CPU
    tensors to gloo and CUDA tensors to nccl ("cpu:gloo,cuda:nccl"), so a collective on either device
    works. parallel="fsdp" (or "fsdp_grad_op") in one process runs as one shard in a one-process group.
    timeout_s: a collective waiting longer than this for a peer raises (None: collective_timeout_s())."""
    device = resolve_device(device)
    timeout_s = collective_timeout_s() if timeout_s is None else timeout_s
    if "RANK" not in os.environ and parallel == "ddp":
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
            try:
                dist.init_process_group(backend=backend, timeout=timeout)
            except dist.DistError as e:  # the rendezvous: a process that never came (it failed, or was not started)
                raise PeerFailure(f"not every process of the run joined within {timeout_s:g} s "
                                  f"({failure_reason(e)})") from None
        else:  # one process, one shard
            dist.init_process_group(backend=backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                                    world_size=1, timeout=timeout)
    global _team
    if world > 1 and _team is None and "gloo" in dist.get_backend():  # kept while the group lives (runs share it)
        _team = Team(dist.distributed_c10d._get_default_store(), rank, world, timeout_s)
    return rank, world, device


# what a collective (or DCP, or Muon's async gathers) raises when a peer died or stopped answering: gloo's
# "Connection closed by peer", "Connection reset by peer", "Timed out waiting 5000ms for recv operation",
# "Application timeout caused pair closure" (the ops after a timeout on that pair), NCCL's watchdog
# messages; c10d's DistError subclasses (DistBackendError, DistNetworkError, DistStoreError) by type
PEER_MARKS = ("/gloo/", "NCCL", "Connection reset", "Connection closed", "closed by peer", "reset by peer",
              "Timed out", "timed out", "Timeout", "pair closure", "Broken pipe", "Socket closed")


def peer_failure(error):
    """True for an error a collective raises when another process died (connection reset or closed) or
    stalled past the timeout (PEER_MARKS), and for PeerFailure."""
    text = str(error)
    return isinstance(error, (dist.DistError, PeerFailure)) or any(mark in text for mark in PEER_MARKS)


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
    """The end of this process's part in the run: its process group destroyed. The rank that hosts the
    c10d store (rank 0 launched without torchrun's agent) keeps it up until every other rank has ended
    (at most LINGER_S; not when a peer was lost), so that none loses it while reading an exchange or this
    rank's failure; when it failed, it shuts its gloo connections first, so that the others' pending
    collectives fail at once (close_peer_connections)."""
    global _team
    team, _team = _team, None
    if team is not None and not team.hosts_store():
        with contextlib.suppress(NoAnswer):
            team.ask(team.store.add, ENDED_KEY, 1, timeout=ASK_S)
    if active():
        dist.destroy_process_group()
    if team is not None and team.hosts_store() and not team.lost:
        if team.failed:
            close_peer_connections()
        deadline = time.monotonic() + LINGER_S
        with contextlib.suppress(NoAnswer):
            while team.ask(team.store.add, ENDED_KEY, 0, timeout=ASK_S) < team.world - 1 and \
                    time.monotonic() < deadline:
                time.sleep(0.05)


def close_peer_connections():
    """Shut down this process's established TCP connections but the c10d store's (those on MASTER_PORT):
    the gloo connections of a destroyed process group, which stay open while anything still holds the group
    (DTensor's caches keep FSDP's DeviceMesh; torch.distributed.nn.functional, which torch._dynamo imports,
    keeps it in its functions' defaults), so that the peers' collectives fail at once."""
    port, ours = int(os.environ.get("MASTER_PORT", "0")), set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in open(table).readlines()[1:]:
                fields = line.split()
                ports = {int(address.rsplit(":", 1)[1], 16) for address in fields[1:3]}
                if port not in ports and fields[3] == "01":  # established (a listener shut down aborts gloo)
                    ours.add(f"socket:[{fields[9]}]")
    with contextlib.suppress(OSError):
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError, ValueError):
                if os.readlink(f"/proc/self/fd/{fd}") in ours:
                    connection = socket.socket(fileno=int(fd))
                    with contextlib.suppress(OSError):
                        connection.shutdown(socket.SHUT_RDWR)
                    connection.detach()


def exit(status):
    """sys.exit(status) for a script run under torchrun. On CPU, gloo's worker threads can outlive
    destroy_process_group and abort the interpreter's shutdown after FSDP2 collectives ("terminate
    called without an active exception", about 1 run in 10; a torch issue without an upstream fix):
    once everything is written and flushed, such a process leaves directly."""
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


def barrier(what="a barrier"):
    """Every process waits here for the others: through the store in a run of several (exchange: a failure
    recorded by any ends all, and NCCL is not involved), else dist.barrier (a one-process group)."""
    if _team is not None:
        exchange(what)
    elif active():
        dist.barrier()


# ----------------------------------------------------------------------------------------------------
# Ranks that decide together
#
# A decision made from one rank's own facts (its free memory, the files on its node) is exchanged first
# and then made the same way on every rank (exchange, agree): ranks that decided apart would run
# different collectives, a hang. A refusal or failure on one rank ends every rank with one line naming
# it: run_cli records this rank's line ("rank 1: could not write ...") in the c10d store (record_failure),
# then tears the group down (a failed store host also shuts its gloo connections, then keeps the store up
# until the others have ended: teardown). The others' next exchange or collective then fails at once
# under gloo (a frozen peer: after collective_timeout_s), as does torchrun's SIGTERM (it stops the other
# workers when one exits non-zero), and they print the recorded line (RunDir.on_interrupt, run_cli), else
# "another process of the run died or stopped answering ...". Exchanges carry their values through the
# store and wait in a gloo all-reduce of a CPU tensor: gloo's half of "cpu:gloo,cuda:nccl" on GPUs too,
# so they fail fast there as well. Every store call runs in a thread with a deadline (a frozen store
# host never answers; c10d's own warnings are silenced).
# Under NCCL on GPUs (not testable on a CPU): exchanges and the recorded line work the same, but a rank
# inside an NCCL collective (the step, Muon, the eval, DCP) does not fail fast when a peer fails or dies:
# it waits for the NCCL timeout (collective_timeout_s) or torchrun's SIGTERM, which Python handles only
# once the blocked call returns; torchrun kills it after its grace period (30 s), and then only the failed
# rank has printed its line. Failures before the process group exists (rundir.resolve_run reads the
# checkpoint first) end only that rank; the others wait in the rendezvous until torchrun stops them or
# timeout_s passes (then one line: not every process joined).

FAILURE_KEY, ENDED_KEY = "loopstudy/failure", "loopstudy/ended"
ASK_S = 2.0  # the longest a store call waits on a failure path
LINGER_S = 10.0  # the longest the store host waits for the others to end


class PeerFailure(RuntimeError):
    """Another process of the run failed, died or stopped answering. cause: the line another rank
    recorded for its own failure ("rank 1: ..."), when one did; reason: what the collective said."""

    def __init__(self, message, cause=None, reason=None):
        super().__init__(message)
        self.cause, self.reason = cause, reason


class NoAnswer(Exception):
    """A store call that failed or did not answer in time."""


class Team:
    """The processes of this run as the c10d store sees them (made by setup when there are several)."""

    def __init__(self, store, rank, world, timeout_s):
        self.store, self.rank, self.world, self.timeout_s = store, rank, world, timeout_s
        self.count = 0  # exchanges so far: every rank makes the same ones, so their keys match
        self.failed = False  # this rank recorded a failure (record_failure)
        self.lost = False  # this rank ended because a peer died or stopped answering

    def hosts_store(self):  # under torchrun the agent hosts it; else rank 0 does
        return self.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"

    def ask(self, call, *args, timeout=None):
        """call(*args), in a thread, within timeout (default timeout_s); NoAnswer if it failed or hung."""
        out = []

        def run():
            with contextlib.suppress(Exception):
                out.append(call(*args))
        thread = threading.Thread(target=run, daemon=True)
        with quiet_stderr():  # c10d prints a C++ warning, frames included, for a lost store connection
            thread.start()
            thread.join(self.timeout_s if timeout is None else timeout)
        if not out:
            raise NoAnswer(f"the run's c10d store did not answer {getattr(call, '__name__', 'a call')}")
        return out[0]


_team = None


@contextlib.contextmanager
def quiet_stderr():
    """File descriptor 2 pointed at /dev/null inside (what C++ code writes there is dropped)."""
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def everywhere(error):
    """Mark an error every rank raises alike (a decision made together): printed without a rank, not recorded."""
    error.every_rank = True
    return error


def record_failure(line):
    """This rank's failure ends the run: its line ("rank r: ...") for the other ranks; the first one kept."""
    if _team is not None:
        _team.failed = True
        with contextlib.suppress(NoAnswer):
            _team.ask(_team.store.compare_set, FAILURE_KEY, "", line, timeout=ASK_S)


def recorded_failure():
    """The line another rank recorded for its failure, or None (none, or the store does not answer)."""
    if _team is None or _team.failed:
        return None
    try:
        if not _team.ask(_team.store.check, [FAILURE_KEY], timeout=ASK_S):
            return None
        line = _team.ask(_team.store.get, FAILURE_KEY, timeout=ASK_S).decode(errors="replace")
    except NoAnswer:
        return None
    return line


def ended_by(error):
    """The error that ends this rank's run, as every rank should say it: this rank's own failure prefixed
    with "rank r: " and recorded for the others (a run of several); another rank's, or one every rank
    raised together (everywhere), as it is."""
    if _team is not None and isinstance(error, PeerFailure) and error.cause is None:
        _team.lost = True
    if _team is None or isinstance(error, PeerFailure) or getattr(error, "every_rank", False):
        return error
    line = f"rank {_team.rank}: {error_message(error)}"
    record_failure(line)
    return ValueError(line)


def exchange(what, value=None):
    """Every rank's value (JSON data), by rank, once every rank has reached this point: the values go
    through the c10d store, the wait is an all-reduce of a CPU tensor, which "cpu:gloo,cuda:nccl" gives to
    gloo on GPUs too: it fails at once when a peer's process group is gone (a peer that failed, or died),
    and after the collective timeout when a peer is frozen. Then PeerFailure: the line the failed rank
    recorded, else one naming `what`. One process: [value]."""
    team = _team
    if team is None:
        return [value]
    key, n = f"loopstudy/{team.count}", team.count
    team.count += 1
    try:
        team.ask(team.store.set, f"{key}/{team.rank}", json.dumps(value))
        dist.all_reduce(torch.zeros(1))
        values = team.ask(team.store.multi_get, [f"{key}/{r}" for r in range(team.world)])
        if n >= 2:  # every rank is past exchange n - 1, so done reading n - 2
            team.ask(team.store.delete_key, f"loopstudy/{n - 2}/{team.rank}")
    except (NoAnswer, RuntimeError) as e:
        if not isinstance(e, NoAnswer) and not peer_failure(e):
            raise
        cause, reason = recorded_failure(), failure_reason(e)
        raise PeerFailure(cause or f"another process of the run died or stopped answering at {what} ({reason})",
                          cause, reason) from None
    return [json.loads(v) for v in values]


def agree(what, value):
    """exchange(what, value), refused (the same ValueError on every rank) unless every rank has the same
    value: a fact that must be the same on every node (its data, the checkpoint it starts from)."""
    values = exchange(what, value)
    other = next((r for r, v in enumerate(values) if v != values[0]), None)
    if other is not None:
        def said(v):  # a dict: its keys that differ, long strings cut
            return ", ".join(f"{k}={str(v[k])[:12]}" for k in v if v[k] != values[other][k] or
                             v[k] != values[0][k]) if isinstance(value, dict) else str(v)
        raise everywhere(ValueError(f"the processes of the run differ in {what}: rank 0 has {said(values[0])}; "
                                    f"rank {other} has {said(values[other])}; every node must see the same files"))


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


def wrap(model, device, world, config):
    """The module the training step calls: DDP around the model (several processes, config.parallel="ddp"),
    then torch.compile around that (config.compile), as PyTorch documents (the compiler splits the graph at
    DDP's gradient buckets, so their all-reduces overlap the backward). The unwrapped model (sharded in
    place under FSDP) stays the one to save. A step drawing passes (config.n_passes_choices) that leave a
    stored block unused (an untied core beyond them) gives DDP parameters without a gradient that step."""
    if world > 1 and config.parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        unused = leaves_blocks_unused(model.config, config.n_passes_choices)
        model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                        gradient_as_bucket_view=True,  # no second copy of the gradients
                                        find_unused_parameters=unused)
    return torch.compile(model) if config.compile else model


def leaves_blocks_unused(cfg, n_passes_choices):
    """Whether a step drawing its passes from n_passes_choices can leave a stored block out of its plan."""
    return any({s.block for s in execution_plan(cfg, k) if s.kind == "block"} != set(range(cfg.n_blocks))
               for k in n_passes_choices)


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
