"""
Training checkpoints: writing them so that nothing is ever half-written, and reading them back.

Guards against: a crash (or kill -9, or a full disk) at any moment destroying the previous checkpoint,
weights that became non-finite being saved over good ones, and a file that is not a loopstudy
checkpoint (or does not fit its own config) failing deep inside torch.

  ckpt.pt      one file: model, optimizer state keyed by parameter name, the run's TrainState (step,
               tokens, data position, ...), settings. One process or DDP: rank 0 writes it at every
               eval. It is what eval_core.py, probe.py, grow.py and sample.py load (load_model). Under FSDP it holds the
               consolidated model (weights gathered from every rank, no optimizer state), written at
               the end of the run.
  ckpt.dcp/    FSDP2: the same contents sharded. Every rank writes only its own shards
               (torch.distributed.checkpoint), so no process ever holds the whole model or optimizer
               state; meta.pt inside holds everything that is not a tensor. It resumes onto any number
               of processes, FSDP, DDP or one process: DCP re-shards on load.

Both are written under a temporary name and renamed into place: a crash at any moment leaves the
previous checkpoint intact, and a checkpoint is never written from non-finite weights. A directory is
swapped in two renames (old -> .old, new -> final); find_resume_checkpoint recovers the moment between.

Trust: a checkpoint holds only tensors and plain data (dicts, lists, numbers, strings) and is read with
torch.load(weights_only=True), so loading one runs no code. Every tensor of a ckpt.pt has a CRC-32
recorded when it is written and checked when it is read (a flipped byte is named with its tensor); every
file of a ckpt.dcp/ has one too. A ckpt.dcp/ is resume state for your own runs, not a format to share:
DCP itself unpickles its .metadata, which is checked first against the classes DCP writes there. An
older checkpoint (Python objects inside) is refused; python -m tooling.convert_checkpoint converts it,
reading it the unsafe way, for files you trust.
"""

import errno
import io
import os
import pickle
import shutil
import warnings
import zlib
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from model import GPT, ModelConfig
from tooling import distributed
from tooling.common import TEMP_MARK, first_line, write_atomic

SHARDED_META = "meta.pt"  # inside a ckpt.dcp/ directory: the checkpoint minus its tensor shards
FORMAT = "loopstudy-checkpoint-2"  # plain data + tensors, per-tensor CRC-32s; 1: Python objects inside


class NonFiniteLoss(RuntimeError):
    every_rank = True  # found from all-reduced values: every rank raises it alike (distributed.everywhere)


def check_finite(tensors, step, path, collective=False):
    """Refuse to write weights that are not finite (on any rank, for a sharded checkpoint)."""
    tensors = [distributed.local(t) for t in tensors if t.is_floating_point()]
    finite = torch.stack([torch.isfinite(t).all() for t in tensors]).all().float() if tensors else torch.ones(())
    if collective:  # on the weights' device: one reduction, then one host sync
        distributed.all_reduce(finite, op="min")
    if not finite.item():
        error = NonFiniteLoss(f"the weights became non-finite at step {step} (after the update): {path} was not "
                              "written; the last good checkpoint is kept. Lower the learning rates.")
        error.every_rank = collective  # else this rank's own finding
        raise error


def dcp_failure(error):
    """(rank, exception) of what caused DCP's CheckpointException, which every rank raises alike, listing
    each failed rank's exception: a collective's error (a peer died or stopped answering) first, else the
    lowest failed rank's; (None, error) when it lists none."""
    failures = [(rank, cause) for rank, (cause, _) in sorted(error.failures.items())]
    peers = [(rank, cause) for rank, cause in failures if distributed.peer_failure(cause)]
    return (peers or failures or [(None, error)])[0]


def disk_error(path, error, rank=None):
    """An OSError naming the checkpoint and the likely cause instead of torch's serializer message; rank:
    the rank that failed, named (the error every rank raises for it)."""
    free = shutil.disk_usage(os.path.dirname(os.path.abspath(path))).free
    full = (isinstance(error, OSError) and error.errno == errno.ENOSPC) or "unexpected pos" in str(error) \
        or (free < 1 << 20 and rank is None)
    why = f"{type(error).__name__}: {first_line(error)}" if not full else "the disk is full" + \
        (f" ({free / 2**20:.0f} MB free)" if rank is None else "")  # another rank's disk: its free space unknown here
    who = f"rank {rank}: " if rank is not None else ""
    result = OSError(f"{who}could not write checkpoint {path}: {why}; the previous checkpoint there is kept")
    return distributed.everywhere(result) if rank is not None else result


# ----------------------------------------------------------------------------------------------------
# ckpt.pt: one file


def plain_config(config):
    """A config dataclass as plain data (derived sizes as the ints they are): what a checkpoint stores."""
    return {k: int(v) if isinstance(v, int) and not isinstance(v, bool) else v for k, v in asdict(config).items()}


def crc(t):
    """CRC-32 of a tensor's bytes."""
    t = t.detach().reshape(-1)
    return zlib.crc32(t.cpu().contiguous().view(torch.uint8).numpy()) if t.numel() else 0


def tensor_checksums(ckpt):
    """{"model.<name>" / "optimizer.<param>.<key>": CRC-32} of every tensor a checkpoint dict holds."""
    out = {f"model.{k}": crc(v) for k, v in ckpt["model"].items()}
    for name, state in ((ckpt.get("optimizer") or {}).get("state") or {}).items():
        out.update({f"optimizer.{name}.{k}": crc(v) for k, v in state.items() if torch.is_tensor(v)})
    return out


def verify_checksums(ckpt, path):
    """Refuse a checkpoint whose tensors do not have the bytes they were written with."""
    recorded, now = ckpt.get("checksums") or {}, tensor_checksums(ckpt)
    for name in sorted(set(recorded) | set(now)):
        if recorded.get(name) != now.get(name):
            what = "is missing" if name not in now else "was not recorded" if name not in recorded else \
                "does not have the bytes it was written with (the file is corrupt)"
            raise ValueError(f"{path}: tensor {name} {what}; use another checkpoint")


def refused_objects(error):
    """True when torch.load(weights_only=True) failed because the file names Python objects (its
    "Unsupported global" refusal), not because the bytes are not a torch file."""
    return isinstance(error, pickle.UnpicklingError) and "unsupported global" in str(error).lower()


def load_checkpoint(path, map_location="cpu"):
    """A checkpoint file -> its dict ({"model_config", "model", ...}), read without running code
    (weights_only=True) and with its checksums verified; one clear error when it is missing, unreadable,
    corrupt, of an older format or not a loopstudy checkpoint."""
    if os.path.isdir(path):
        hint = " (a sharded checkpoint: resume state for train.py; the shareable weights are ckpt.pt)" \
            if os.path.exists(os.path.join(path, SHARDED_META)) else ""
        raise ValueError(f"{path} is a directory, not a checkpoint file{hint}")
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint not found: {path}")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:
        if refused_objects(e):
            raise ValueError(f"{path} holds Python objects a weights-only load refuses (an older loopstudy "
                             "checkpoint, or not one: loading it could run code). Only if you trust it: python -m "
                             f"tooling.convert_checkpoint {path} NEW.pt") from None
        raise ValueError(f"cannot read checkpoint {path} (truncated, or not a torch file): "
                         f"{type(e).__name__}: {first_line(e)}") from None
    if not isinstance(ckpt, dict) or "model_config" not in ckpt or "model" not in ckpt:
        raise ValueError(f"{path} is not a loopstudy checkpoint (needs 'model_config' and 'model')")
    if ckpt.get("format") != FORMAT:
        raise ValueError(f"{path} is a loopstudy checkpoint of an older format; convert it: python -m "
                         f"tooling.convert_checkpoint {path} NEW.pt")
    verify_checksums(ckpt, path)
    return ckpt


def load_model(path, map_location="cpu"):
    """A model.GPT from a checkpoint written by train.py or grow.py -> (model, checkpoint dict)."""
    ckpt = load_checkpoint(path, map_location)
    model = GPT(ModelConfig.from_dict(ckpt["model_config"]))
    try:
        model.load_state_dict(ckpt["model"])
    except RuntimeError as e:  # weights that do not fit the stored config
        raise ValueError(f"{path}: the weights do not match the model config stored with them: "
                         f"{str(e).splitlines()[0]}") from None
    return model, ckpt


def save_file(path, ckpt):
    """Write ckpt (a dict of whole tensors and plain data) atomically, after checking its weights, with
    the format mark and every tensor's checksum."""
    check_finite(ckpt["model"].values(), (ckpt.get("state") or {}).get("step"), path)
    ckpt = dict(ckpt, format=FORMAT)
    ckpt["checksums"] = tensor_checksums(ckpt)
    if os.path.isdir(path):
        raise ValueError(f"cannot write checkpoint {path}: it is a directory; give a file name")
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
    temp directory beside path; rank 0 adds meta.pt, then swaps the directory into place. Rank 0's own
    steps are bracketed by distributed.barrier (a failure there ends the others with its line, without a
    barrier after it to wait in); a write that fails on any rank inside DCP fails on every rank alike,
    naming that rank. A collective's error (a peer died or stopped answering) is raised as it is, for
    RunDir.on_interrupt; rank 0 removes the temp directory of a save that failed."""
    from torch.distributed.checkpoint import CheckpointException
    import torch.distributed.checkpoint as dcp
    check_finite(ckpt["model"].values(), ckpt["state"]["step"], path, collective=True)
    path = os.path.abspath(path)
    directory, name = os.path.split(path)
    tmp = os.path.join(directory, f".{name}{TEMP_MARK}{ckpt['state']['step']}")
    old = os.path.join(directory, f".{name}.old")
    tensors, meta = sharded_tensors(ckpt)
    master = dist.get_rank() == 0
    try:
        if master:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        distributed.barrier(f"the checkpoint {path}")
        try:
            dcp.save(tensors, checkpoint_id=tmp)
        except CheckpointException as e:  # a BaseException: caught by name
            rank, cause = dcp_failure(e)
            if distributed.peer_failure(cause):
                raise cause from None
            raise disk_error(path, cause, rank if dist.get_world_size() > 1 else None) from None
        if master:  # every file DCP wrote, with its checksum; then the rest of the checkpoint
            checksums = {f: file_crc(os.path.join(tmp, f)) for f in os.listdir(tmp)}
            meta = dict(meta, format=FORMAT, file_checksums=checksums)
            torch.save(meta, os.path.join(tmp, SHARDED_META))
            if os.path.exists(path):
                shutil.rmtree(old, ignore_errors=True)
                os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
    except (OSError, RuntimeError) as e:
        if master:  # the shards written so far (a rank that is still writing has failed or hangs)
            shutil.rmtree(tmp, ignore_errors=True)
        if distributed.peer_failure(e) or getattr(e, "every_rank", False):
            raise
        raise disk_error(path, e) from None
    distributed.barrier(f"the checkpoint {path}")  # no rank goes on before it is in place


def file_crc(path):
    value = 0
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            value = zlib.crc32(block, value)
    return value


class DCPMetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's .metadata allowing only what DCP writes there (its metadata classes, torch.Size,
    dtypes, layouts, paths): a pickled call to anything else is refused, so nothing can run."""
    METADATA = "torch.distributed.checkpoint.metadata"
    ALLOWED = {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
               ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"), ("builtins", "set"),
               ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath")}

    def find_class(self, module, name):
        if "." not in name:  # no dotted names: they reach through a module to anything it imported
            if (module, name) in self.ALLOWED:
                return super().find_class(module, name)
            obj = getattr(torch, name, None) if module == "torch" else None
            if isinstance(obj, torch.dtype):
                return obj
            if module == self.METADATA:
                obj = super().find_class(module, name)
                if isinstance(obj, type) and obj.__module__ == module:  # a class DCP defines there
                    return obj
        raise pickle.UnpicklingError(f"{module}.{name}")


def load_sharded_meta(path):
    """A ckpt.dcp/ directory's meta.pt (read without running code), after checking every file's checksum
    and that DCP's own .metadata holds only DCP's classes (DCP unpickles it)."""
    meta_path = os.path.join(path, SHARDED_META)
    if not os.path.exists(meta_path):
        raise ValueError(f"{path} is not a sharded loopstudy checkpoint (no {SHARDED_META})")
    try:
        meta = torch.load(meta_path, weights_only=True)
    except Exception as e:
        if refused_objects(e):
            raise ValueError(f"{meta_path} holds Python objects a weights-only load refuses (an older loopstudy "
                             "checkpoint, or not one: loading it could run code); resume from a ckpt.pt") from None
        raise ValueError(f"cannot read {meta_path} (truncated, or not a torch file): {type(e).__name__}: "
                         f"{first_line(e)}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"{path} is a sharded checkpoint of an older format (or not one); resume from a ckpt.pt")
    for name, value in meta["file_checksums"].items():
        file = os.path.join(path, name)
        if not os.path.exists(file):
            raise ValueError(f"{path}: file {name} of the sharded checkpoint is missing")
        if file_crc(file) != value:
            raise ValueError(f"{path}: file {name} does not have the bytes it was written with (corrupt); use "
                             "another checkpoint")
    try:
        with open(os.path.join(path, ".metadata"), "rb") as f:
            DCPMetadataUnpickler(io.BytesIO(f.read())).load()
    except (pickle.UnpicklingError, OSError, EOFError) as e:
        raise ValueError(f"{path}/.metadata is not DCP metadata ({e}): refused, loading it could run code") from None
    meta["path"] = path
    return meta


def load_sharded_tensors(meta, model, optimizers):
    """Fill model and optimizer state from a sharded checkpoint, in place, re-sharding onto however this
    process holds the parameters (FSDP2 shards of any world size, or whole tensors)."""
    import torch.distributed.checkpoint as dcp
    params = dict(model.named_parameters())
    state = {}
    for opt in optimizers:
        for group in opt.param_groups:
            for p, name in zip(group["params"], group["param_names"]):
                if name in meta["optimizer"]["state_keys"]:
                    state[name] = opt.state[p] = empty_optimizer_state(opt, params[name])
    model_state = model.state_dict()
    from torch.distributed.checkpoint import CheckpointException
    with warnings.catch_warnings():  # one process resuming a sharded run is intended: DCP's warning is noise
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            dcp.load({"model": model_state, "optimizer": state}, checkpoint_id=meta["path"])
        except (Exception, CheckpointException) as e:  # DCP lists every rank's failure (a BaseException)
            rank, cause = dcp_failure(e) if isinstance(e, CheckpointException) else (None, e)
            if distributed.peer_failure(cause):
                raise cause from None
            who = f"rank {rank}: {type(cause).__name__}: " if rank is not None and distributed.active() and \
                dist.get_world_size() > 1 else ""
            error = ValueError(f"cannot load the sharded checkpoint {meta['path']}: {who}{first_line(cause)}")
            raise (distributed.everywhere(error) if isinstance(e, CheckpointException) else error) from None
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
    for key in ("optimizer", "state", "train_config"):
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
        steps[sharded] = load_sharded_meta(sharded)["state"]["step"]
    if os.path.exists(single):
        ckpt = load_checkpoint(single)
        if ckpt.get("optimizer") is not None:  # not the consolidated weights of an FSDP run
            steps[single] = ckpt["state"]["step"]
    return max(steps, key=lambda p: (steps[p], p.endswith(".dcp"))) if steps else None




# ----------------------------------------------------------------------------------------------------
# What a training checkpoint holds


@dataclass
class TrainState:
    """What a checkpoint carries for an exact resume, besides weights, optimizer state and settings."""
    step: int = 0
    tokens_seen: int = 0
    flops_seen: float = 0.0
    flops_by_passes: dict = field(default_factory=dict)  # {passes: training FLOPs run at that many passes}
    data_region: str = "stable"  # "stable" or "branch" (the held-back tail)
    data_position: int = 0  # windows of the region consumed so far
    branch_start_step: Optional[int] = None
    grown: bool = False
    last_eval: Optional[dict] = None  # the log record of the last eval
    lr_scaling_params: int = 0  # [X16] N: stored parameters at initialisation, token embedding included
    seqs_per_step: int = 0  # the global batch: a resume on any number of processes keeps it
    decay_start: Optional[int] = None  # the step the LR starts to decay: a decay branch forks before it
    data_fingerprint: Optional[str] = None  # the prepared corpus data_position counts windows of (meta.json's)

    def advance(self, tokens, windows, flops, passes):
        self.step, self.tokens_seen, self.data_position = self.step + 1, self.tokens_seen + tokens, \
            self.data_position + windows
        self.seqs_per_step = windows
        self.flops_seen += flops
        self.flops_by_passes[passes] = self.flops_by_passes.get(passes, 0.0) + flops

    def record(self, **values):
        """A log line: where the run is, then the values."""
        return dict(step=self.step, tokens=self.tokens_seen, flops=self.flops_seen,
                    flops_by_passes={str(k): v for k, v in sorted(self.flops_by_passes.items())}, **values)


def training_checkpoint(model, optimizers, config, state, **extra):
    """The dict train.py saves: the model's config and weights, optimizer state keyed by parameter name,
    the run's TrainState (serialised from its own fields), RNG state and the run's settings."""
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return dict(model_config=plain_config(model.config), model=model.state_dict(),
                optimizer=optimizer_state_by_name(optimizers), state=asdict(state), rng=rng,
                train_config=plain_config(config), **extra)


def optimizer_state_by_name(optimizers):
    """{"state": {param name: {key: tensor}}, "param_groups": [{name, lr, ..., param_names}]}:
    keyed by parameter name so grow.py can extend it and a grown model can load it."""
    state, groups = {}, []
    for opt in optimizers:
        for group in opt.param_groups:
            groups.append({k: v for k, v in group.items() if k != "params"})
            for p, name in zip(group["params"], group["param_names"]):
                if p in opt.state:
                    state[name] = dict(opt.state[p])
    return {"state": state, "param_groups": groups}


def load_optimizer_state(optimizers, state_by_name):
    """Put saved per-parameter state back by name (parameters without saved state start fresh). Whole
    tensors are placed like the optimizer's own state of that parameter: on its device, and under FSDP
    sharded (or replicated) as that state is (distribute_tensor)."""
    for opt in optimizers:
        for group in opt.param_groups:
            for p, name in zip(group["params"], group["param_names"]):
                if name in state_by_name:
                    template = empty_optimizer_state(opt, p)
                    opt.state[p] = {k: placed_like(v, template.get(k, p)) for k, v in state_by_name[name].items()}


def placed_like(value, template):
    """A saved state tensor placed like `template` (a tensor of the same role)."""
    if not torch.is_tensor(value) or value.dim() == 0:
        return value
    if hasattr(template, "device_mesh") and not hasattr(value, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor
        return distribute_tensor(value.to(template.device), template.device_mesh, template.placements)
    return value.to(template.device)


def empty_optimizer_state(opt, p):
    """A parameter's optimizer state before its first step, with the shapes (and shards) a sharded
    checkpoint loads into: AdamW's step and two moments, or what Muon says (muon.Muon.empty_state)."""
    if isinstance(opt, torch.optim.AdamW):
        return {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
    return opt.empty_state(p)


def consolidated_weights(model):
    """The whole model's weights on rank 0's CPU ({} on the other ranks), gathered one tensor at a time
    (DCP's full state dict with CPU offload), so no GPU ever holds the whole model (a collective)."""
    if not distributed.is_sharded(model):
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_into(source, model, optimizers):
    """Fill a built (possibly sharded) model and its optimizers from a training checkpoint: a ckpt.pt
    dict (whole tensors, sharded as they load) or a ckpt.dcp/ directory's meta (shard by shard)."""
    if source.get("sharded"):
        load_sharded_tensors(source, model, optimizers)
    else:
        load_optimizer_state(optimizers, source["optimizer"]["state"])
