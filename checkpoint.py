"""
Training checkpoints and the run directory they live in.

  ckpt.pt      one file: model, optimizer state keyed by parameter name, step, data position, settings.
               One process or DDP: rank 0 writes it at every eval. It is what eval_core.py, probe.py,
               grow.py and sample.py load (model.GPT.from_checkpoint). Under FSDP it holds the
               consolidated model (weights gathered from every rank, no optimizer state), written at
               the end of the run.
  ckpt.dcp/    FSDP2: the same contents sharded. Every rank writes only its own shards
               (torch.distributed.checkpoint), so no process ever holds the whole model or optimizer
               state; meta.pt inside holds everything that is not a tensor. It resumes onto any number
               of processes, FSDP, DDP or one process: DCP re-shards on load.

Both are written under a temporary name and renamed into place: a crash at any moment leaves the
previous checkpoint intact, and a checkpoint is never written from non-finite weights. A directory is
swapped in two renames (old -> .old, new -> final); find_resume_checkpoint recovers the moment between.
The run directory has a lock file (one training per folder), and log.jsonl is cut back to the
checkpoint a run resumes from, so the log and the checkpoint always agree.
"""

import contextlib
import errno
import json
import os
import shutil
import socket
import warnings

import torch
import torch.distributed as dist

from common import TEMP_MARK, write_atomic
from model import load_checkpoint

SHARDED_META = "meta.pt"  # inside a ckpt.dcp/ directory: the checkpoint minus its tensor shards


class NonFiniteLoss(RuntimeError):
    pass


def distributed():
    return dist.is_available() and dist.is_initialized()


def local(t):
    """The part of a tensor this process holds: an FSDP2 DTensor's shard, or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def check_finite(tensors, step, path, collective=False):
    """Refuse to write weights that are not finite (on any rank, for a sharded checkpoint)."""
    finite = torch.tensor([float(all(torch.isfinite(local(t)).all() for t in tensors if t.is_floating_point()))])
    if collective:
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)
    if not finite.item():
        raise NonFiniteLoss(f"the weights became non-finite at step {step} (after the update): {path} was not "
                            "written; the last good checkpoint is kept. Lower the learning rates.")


def disk_error(path, error):
    """An OSError naming the checkpoint and the likely cause instead of torch's serializer message."""
    free = shutil.disk_usage(os.path.dirname(os.path.abspath(path))).free
    full = (isinstance(error, OSError) and error.errno == errno.ENOSPC) or "unexpected pos" in str(error) \
        or free < 1 << 20
    why = f"the disk is full ({free / 2**20:.0f} MB free)" if full else f"{type(error).__name__}: {error}"
    return OSError(f"could not write checkpoint {path}: {why}; the previous checkpoint there is kept")


# ----------------------------------------------------------------------------------------------------
# ckpt.pt: one file


def save_file(path, ckpt):
    """Write ckpt (a dict of whole tensors and values) atomically, after checking its weights."""
    check_finite(ckpt["model"].values(), ckpt["step"], path)
    try:
        write_atomic(path, lambda f: torch.save(ckpt, f))
    except (OSError, RuntimeError) as e:
        raise disk_error(path, e) from None


# ----------------------------------------------------------------------------------------------------
# ckpt.dcp/: sharded (FSDP2)


def sharded_tensors(ckpt):
    """The tensor part of a checkpoint dict (every rank's shards) and the rest (meta.pt, rank 0)."""
    tensors = {"model": ckpt["model"], "optimizer": ckpt["optimizer"]["state"]}
    meta = {k: v for k, v in ckpt.items() if k not in ("model", "optimizer")}
    meta["optimizer"] = {"param_groups": ckpt["optimizer"]["param_groups"],
                         "state_keys": {name: sorted(s) for name, s in ckpt["optimizer"]["state"].items()}}
    meta["sharded"] = True
    return tensors, meta


def save_sharded(path, ckpt):
    """Every rank writes its shards of ckpt (model.state_dict() and optimizer state of DTensors) into a
    temp directory beside path; rank 0 adds meta.pt, then swaps the directory into place."""
    import torch.distributed.checkpoint as dcp
    check_finite(ckpt["model"].values(), ckpt["step"], path, collective=True)
    path = os.path.abspath(path)
    directory, name = os.path.split(path)
    tmp, old = os.path.join(directory, f".{name}{TEMP_MARK}{ckpt['step']}"), os.path.join(directory, f".{name}.old")
    tensors, meta = sharded_tensors(ckpt)
    try:
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        dist.barrier()
        dcp.save(tensors, checkpoint_id=tmp)
        if dist.get_rank() == 0:
            torch.save(meta, os.path.join(tmp, SHARDED_META))
            if os.path.exists(path):
                shutil.rmtree(old, ignore_errors=True)
                os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
    except (OSError, RuntimeError) as e:
        raise disk_error(path, e) from None
    finally:
        dist.barrier()


def load_sharded_meta(path):
    meta_path = os.path.join(path, SHARDED_META)
    if not os.path.exists(meta_path):
        raise ValueError(f"{path} is not a sharded loopstudy checkpoint (no {SHARDED_META})")
    meta = torch.load(meta_path, weights_only=False)
    meta["path"] = path
    return meta


def load_sharded_tensors(meta, model, optimizers, empty_state):
    """Fill model and optimizer state from a sharded checkpoint, in place, re-sharding onto however this
    process holds the parameters (FSDP2 shards of any world size, or whole tensors). empty_state(opt, p)
    gives a parameter's optimizer state of the right shapes for DCP to load into."""
    import torch.distributed.checkpoint as dcp
    params = dict(model.named_parameters())
    state = {}
    for opt in optimizers:
        for group in opt.param_groups:
            for p, name in zip(group["params"], group["param_names"]):
                if name in meta["optimizer"]["state_keys"]:
                    state[name] = opt.state[p] = empty_state(opt, params[name])
    model_state = model.state_dict()
    with warnings.catch_warnings():  # one process resuming a sharded run is intended: DCP's warning is noise
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({"model": model_state, "optimizer": state}, checkpoint_id=meta["path"])
    model.load_state_dict(model_state)


# ----------------------------------------------------------------------------------------------------
# Reading either kind


def load_train_checkpoint(path):
    """A training checkpoint, for resume or init_from: a ckpt.pt file (the whole dict) or a ckpt.dcp/
    directory (its meta; the tensors are loaded into the built model by load_sharded_tensors)."""
    if os.path.isdir(path):
        ckpt = load_sharded_meta(path)
    else:
        ckpt = load_checkpoint(path)
    for key in ("optimizer", "step", "train_config"):
        if key not in ckpt:
            raise ValueError(f"{path} is not a train.py checkpoint (missing {key!r})")
    if ckpt["optimizer"] is None:
        raise ValueError(f"{path} holds only the consolidated weights of an FSDP run: resume from its "
                         f"sharded checkpoint ({os.path.splitext(path)[0]}.dcp)")
    return ckpt


def find_resume_checkpoint(run_dir):
    """The checkpoint a resume continues: ckpt.dcp/ (FSDP) or ckpt.pt, whichever is further along (a run
    may have switched between DDP and FSDP); a sharded checkpoint caught between its two renames is
    recovered. None when there is none."""
    sharded, single, old = (os.path.join(run_dir, n) for n in ("ckpt.dcp", "ckpt.pt", ".ckpt.dcp.old"))
    if not os.path.exists(sharded) and os.path.exists(os.path.join(old, SHARDED_META)):
        os.replace(old, sharded)
    steps = {}
    if os.path.exists(os.path.join(sharded, SHARDED_META)):
        steps[sharded] = load_sharded_meta(sharded)["step"]
    if os.path.exists(single):
        ckpt = load_checkpoint(single)
        if ckpt.get("optimizer") is not None:  # not the consolidated weights of an FSDP run
            steps[single] = ckpt["step"]
    return max(steps, key=lambda p: (steps[p], p.endswith(".dcp"))) if steps else None


# ----------------------------------------------------------------------------------------------------
# The run directory


def sync_log(log_path, ckpt):
    """Cut log.jsonl back to the checkpoint being resumed (lines of later steps were written by the
    interrupted run after it), and add the checkpoint's own eval line if the run died before writing it."""
    if not os.path.exists(log_path):
        return
    with open(log_path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    kept = [r for r in records if r["step"] <= ckpt["step"]]
    last_eval = ckpt.get("last_eval")
    if last_eval and (not kept or kept[-1]["step"] < last_eval["step"]):
        kept.append(last_eval)
    if kept != records:
        write_atomic(log_path, lambda f: f.write("".join(json.dumps(r) + "\n" for r in kept).encode()))


def remove_stale_temp_files(run_dir):
    """What a killed checkpoint write left behind in this run's folder: temp files and directories
    (.<name>.tmp-*), and a sharded checkpoint's previous copy once the new one is in place."""
    for name in os.listdir(run_dir):
        path = os.path.join(run_dir, name)
        stale_old = name.endswith(".old") and os.path.exists(os.path.join(run_dir, name[1:-len(".old")]))
        if name.startswith(".") and (TEMP_MARK in name or stale_old):
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)


@contextlib.contextmanager
def run_dir_lock(run_dir):
    """Hold run_dir/lock (host and pid) while training: a second training into the same folder stops
    with a clear message; a lock left by a process that no longer exists (on this host) is taken over."""
    path, me = os.path.join(run_dir, "lock"), f"{socket.gethostname()} {os.getpid()}"
    while True:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
            break
        except FileExistsError:
            try:
                host, pid = open(path).read().split()
            except (OSError, ValueError):  # half-written or vanished: a lock that holds nothing
                host, pid = socket.gethostname(), "0"
            if host == socket.gethostname() and not process_alive(int(pid)):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)  # stale: its process is gone
                continue
            raise ValueError(f"{run_dir} is in use by process {pid} on {host} (lock file {path}); wait for it "
                             "to finish, use another --run_name, or delete the lock file if that process is gone")
    with os.fdopen(fd, "w") as f:
        f.write(me)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            if open(path).read() == me:
                os.remove(path)


def process_alive(pid):
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def make_run_dir(run_dir):
    try:
        os.makedirs(run_dir, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise ValueError(f"cannot create the run directory {run_dir}: a file is in the way; use another "
                         "--out_dir or --run_name") from None
    except PermissionError:
        raise ValueError(f"cannot create the run directory {run_dir}: permission denied; use another --out_dir") from None
    if not os.access(run_dir, os.W_OK):
        raise ValueError(f"the run directory {run_dir} is not writable; use another --out_dir")
