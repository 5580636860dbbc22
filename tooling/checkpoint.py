"""
Training checkpoints: never half-written, read back without running code, checked before anything is built.

  ckpt.pt      one file: model, optimizer state keyed by parameter name, the run's TrainState, settings.
               Rank 0 writes it at every eval; eval_core.py, eval_harness.py, probe.py, grow.py, sample.py
               and tooling.export load it (load_model). Under FSDP it holds the consolidated model, written
               at the end of the run.
  ckpt.dcp/    FSDP2: the same contents sharded, every rank writing its own shards (DCP); meta.pt inside
               holds what is not a tensor. It resumes onto any number of processes: DCP re-shards on load.
  DIR/         an export (python -m tooling.export: model.safetensors, config.json): load_model reads it too,
               through tooling/weights.py, with the same checks.

Both are written under a temporary name and renamed into place (a directory in two renames, old -> .old,
new -> final; find_resume_checkpoint recovers the moment between), never from non-finite weights.

Trust: a checkpoint holds only tensors and plain data, read with torch.load(weights_only=True). Every file
torch.save writes here ends with a seal, the SHA-256 of every byte before it; every tensor of a ckpt.pt also
has a CRC-32 (to name the one that changed), and meta.pt a CRC-32 of every other file of its ckpt.dcp/. The
shapes and dtypes of the model a checkpoint configures (built on the meta device) are compared with its
weights before anything is built (tooling/weights.check_weights). No path inside a checkpoint is followed:
a ckpt.dcp/ is read only through its own listed files, with DCP's reader and planner narrowed to tensors;
its .metadata is a pickle read allowing only the classes DCP writes there (resume state for your own runs,
not a format to share). An older format is refused; python -m tooling.convert_checkpoint converts it
(format 1 the unsafe way, if trusted).
"""

import errno
import hashlib
import os
import pickle
import resource
import shutil
import stat
import warnings
import zlib
from dataclasses import asdict

import torch
import torch.distributed as dist

from model import GPT, ModelConfig
from tooling import distributed, legacy
from tooling.common import TEMP_MARK, first_line, write_atomic
from tooling.weights import check_weights, finite_flags, is_export, load_exported, non_finite

SHARDED_META = "meta.pt"  # inside a ckpt.dcp/ directory: the checkpoint minus its tensor shards
FORMAT = "loopstudy-checkpoint-3"  # 2 + every file sealed (SHA-256 at its end); 1: Python objects inside
# A format-2 checkpoint is refused, not read with a warning: its settings and state are unchecked (a flipped
# bit there changes the run silently). Converting it is safe (plain data) and checks its tensors' CRC-32s.
FORMAT_2 = "loopstudy-checkpoint-2"


class NonFiniteLoss(RuntimeError):
    every_rank = True  # found from all-reduced values: every rank raises it alike (distributed.everywhere)


def check_finite(tensors, step, path, collective=False):
    """Refuse to write weights that are not finite (on any rank, for a sharded checkpoint)."""
    tensors = [distributed.local(t) for t in tensors if t.is_floating_point()]
    finite = torch.stack([torch.isfinite(t).all() for t in tensors]).all().float() if tensors else torch.ones(())
    if collective:  # on the weights' device: one reduction of one flag, then one host sync
        distributed.all_reduce(finite, op="min")
    if not finite.item():
        error = NonFiniteLoss(f"the weights became non-finite at step {step} (after the update): {path} was not "
                              f"written; {kept(path)}")
        error.every_rank = collective  # else this rank's own finding
        error.says_kept = True  # what is kept: said here, not again by the run's interrupt line
        raise error


def kept(path):
    """What a failed write leaves: the previous checkpoint at path, if there is one."""
    return "the previous checkpoint there is kept" if os.path.exists(path) else "there was no previous checkpoint there"


def dcp_failure(error):
    """(rank, exception) of what caused DCP's CheckpointException, which every rank raises alike, listing
    each failed rank's exception: a collective's error (a peer died or stopped answering) first, else the
    lowest failed rank's; (None, error) when it lists none."""
    failures = [(rank, cause) for rank, (cause, _) in sorted(error.failures.items())]
    peers = [(rank, cause) for rank, cause in failures if distributed.peer_failure(cause)]
    return (peers or failures or [(None, error)])[0]


def disk_error(path, error, rank=None):
    """An OSError naming the checkpoint and the likely cause instead of torch's serializer message; rank:
    the rank that failed, named (the error every rank raises for it): its free space is not this rank's to
    tell, and this rank's folder may be gone by now (rank 0 removes a run folder the failure left empty)."""
    free = shutil.disk_usage(os.path.dirname(os.path.abspath(path))).free if rank is None else None
    code = error.errno if isinstance(error, OSError) else None
    short = code in (errno.ENOSPC, errno.EFBIG) or "unexpected pos" in str(error)  # torch's writer: a short write
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0] if rank is None else resource.RLIM_INFINITY
    if code == errno.EFBIG or (short and limit != resource.RLIM_INFINITY and free >= 1 << 20):
        why = "the file size limit was reached (ulimit -f" + \
            (f": {limit / 2**20:.0f} MB)" if limit != resource.RLIM_INFINITY else ")")
    elif short or (rank is None and free < 1 << 20):
        why = "the disk is full" + (f" ({free / 2**20:.0f} MB free)" if rank is None else "")  # another rank's: unknown
    else:
        why = f"{type(error).__name__}: {first_line(error)}"
    who = f"rank {rank}: " if rank is not None else ""
    result = OSError(f"{who}could not write checkpoint {path}: {why}; {kept(path)}")
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


def load_reason(error):
    """torch.load's error in one line, without its advice to load with weights_only=False."""
    lines = [line for line in str(error).split("WeightsUnpickler error:")[-1].splitlines() if line.strip()]
    return type(error).__name__ + (f": {lines[0].strip()[:300]}" if lines else "")


SEAL = b"loopstudy-sha256:"  # + 64 hex digits: the last bytes of every file torch.save writes here
SEAL_SIZE = len(SEAL) + 64


class Sealing:
    """What torch.save writes into: every byte passed on to f and hashed, except the last two (the zip's
    comment length, 0 as torch writes it), held back for seal(), which appends the seal as the comment."""

    def __init__(self, f):
        self.f, self.sha, self.held = f, hashlib.sha256(), b""

    def write(self, data):
        size, data = len(data), memoryview(data).cast("B")
        if len(data) < 2:  # a short write joins the bytes held back
            data, self.held = memoryview(self.held + data.tobytes()), b""
        for part in (self.held, data[:-2]):
            self.sha.update(part)
            self.f.write(part)
        self.held = data[-2:].tobytes()
        return size

    def flush(self):
        self.f.flush()

    def seal(self):
        if self.held != b"\0\0":
            raise RuntimeError("torch.save did not end its zip file with an empty comment: cannot seal it")
        comment = SEAL_SIZE.to_bytes(2, "little") + SEAL
        self.sha.update(comment)
        self.f.write(comment + self.sha.hexdigest().encode())


def save_sealed(obj, f):
    """torch.save(obj, f), then its seal: the SHA-256 of every byte before it, as the zip's comment (which
    torch.load ignores)."""
    sealing = Sealing(f)
    torch.save(obj, sealing)
    sealing.seal()


def seal_intact(path):
    """True when the file ends with the seal of its bytes, False when its seal does not match them (it is
    corrupt), None when it has none (an older format, or not written by loopstudy)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        f.seek(max(size - SEAL_SIZE, 0))
        tail = f.read()
        if size < SEAL_SIZE or not tail.startswith(SEAL):
            return None
        f.seek(0)
        sha, left = hashlib.sha256(), size - 64
        while left > 0:
            block = f.read(min(left, 1 << 24))
            if not block:  # shorter than it was a moment ago
                return False
            sha.update(block)
            left -= len(block)
    return sha.hexdigest().encode() == tail[len(SEAL):]


def read_sealed(path, what="", hint="", map_location="cpu"):
    """A file torch.save wrote, read without running code (weights_only=True) -> (contents, seal_intact).
    One line when it is not a zip file, cannot be read, holds Python objects (+ hint) or is corrupt (naming
    the tensor whose CRC-32 differs, when one does). what: how the messages name it ("checkpoint ")."""
    with open(path, "rb") as f:
        if f.read(4) != b"PK\x03\x04":
            raise ValueError(f"cannot read {what}{path}: it is not a loopstudy checkpoint (not a zip file as "
                             "torch.save writes them)")
    intact = seal_intact(path)
    corrupt = ValueError(f"{path} does not have the bytes it was written with (its SHA-256 seal differs: the file "
                         "is corrupt); use another checkpoint")
    try:
        contents = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:
        if intact is False:
            raise corrupt from None
        if refused_objects(e):
            raise ValueError(f"{path} holds Python objects a weights-only load refuses (an older loopstudy "
                             f"checkpoint, or not one: loading it could run code){hint}") from None
        raise ValueError(f"cannot read {what}{path} (truncated, or not a torch file): {load_reason(e)}") from None
    if intact is False:
        if isinstance(contents, dict) and isinstance(contents.get("model"), dict):
            try:
                verify_checksums(contents, path)  # names the tensor that changed, if one did
            except (AttributeError, TypeError, RuntimeError):
                pass
        raise corrupt
    return contents, intact


def unsealed(path):
    return ValueError(f"{path} lacks the SHA-256 seal its format ends with (corrupt, or not written by loopstudy); "
                      "use another checkpoint")


def load_checkpoint(path, map_location="cpu"):
    """A checkpoint file -> its dict ({"model_config", "model", ...}), read without running code
    (weights_only=True), its seal and its weights checked (check_weights); one clear error when it is
    missing, unreadable, corrupt, of an older format, not a loopstudy checkpoint or not fitting its config."""
    if os.path.isdir(path):
        hint = " (a sharded checkpoint: resume state for train.py; the shareable weights are ckpt.pt)" \
            if os.path.exists(os.path.join(path, SHARDED_META)) else " (nor an export folder: no model.safetensors)"
        raise ValueError(f"{path} is a directory, not a checkpoint file{hint}")
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint not found: {path}")
    if not os.path.isfile(path):
        raise ValueError(f"cannot read checkpoint {path}: it is not a regular file")
    ckpt, intact = read_sealed(path, "checkpoint ", ". Only if you trust it: python -m tooling.convert_checkpoint "
                               f"{path} NEW.pt", map_location)
    if not isinstance(ckpt, dict) or "model_config" not in ckpt or "model" not in ckpt:
        raise ValueError(f"{path} is not a loopstudy checkpoint (needs 'model_config' and 'model')")
    if ckpt.get("format") != FORMAT:
        raise ValueError(f"{path} is a loopstudy checkpoint of an older format; convert it: python -m "
                         f"tooling.convert_checkpoint {path} NEW.pt")
    if not intact:
        raise unsealed(path)
    ckpt = legacy.upgraded(ckpt, path)
    check_weights(path, ckpt["model_config"], ckpt["model"])
    return ckpt


def load_model(path, map_location="cpu"):
    """A model.GPT from a checkpoint written by train.py or grow.py, or from an export folder (tooling.export:
    its info holds the keys the tools read) -> (model, checkpoint dict)."""
    if is_export(path):
        return load_exported(path)
    ckpt = load_checkpoint(path, map_location)  # its weights fit its config: checked before this builds it
    model = GPT(ModelConfig.from_dict(ckpt["model_config"]))
    model.load_state_dict(ckpt["model"])
    return model, ckpt


def save_file(path, ckpt):
    """Write ckpt (a dict of whole tensors and plain data) atomically, after checking its weights, with
    the format mark, every tensor's checksum and the seal."""
    check_finite(ckpt["model"].values(), (ckpt.get("state") or {}).get("step"), path)
    ckpt = dict(ckpt, format=FORMAT)
    ckpt["checksums"] = tensor_checksums(ckpt)
    if os.path.isdir(path):
        raise ValueError(f"cannot write checkpoint {path}: it is a directory; give a file name")
    try:
        write_atomic(path, lambda f: save_sealed(ckpt, f))
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
            write_sharded_meta(tmp, dict(meta, file_checksums=checksums))
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


def write_sharded_meta(path, meta):
    """A ckpt.dcp/'s meta.pt (sealed, in the current format), written atomically."""
    write_atomic(os.path.join(path, SHARDED_META), lambda f: save_sealed(dict(meta, format=FORMAT), f))


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


NOT_FOLLOWED = "refused (paths inside a checkpoint are never followed)"


def listed_files(path, checksums):
    """{name: size} of the files a ckpt.dcp/'s meta.pt lists (DCP's .metadata among them), each refused
    unless it is a plain name of a regular file inside the folder (no path, no link, no device) that has
    the CRC-32 it was written with."""
    if not isinstance(checksums, dict) or ".metadata" not in checksums:
        raise ValueError(f"{path}: {SHARDED_META} lists no checksum of .metadata; use another checkpoint")
    sizes = {}
    for name, value in checksums.items():
        if not isinstance(name, str) or name in ("", ".", "..") or os.path.basename(name) != name or "\0" in name:
            raise ValueError(f"{path}: {SHARDED_META} lists {name!r}, not a file name inside the checkpoint: "
                             f"{NOT_FOLLOWED}")
        file = os.path.join(path, name)
        if not os.path.lexists(file):
            raise ValueError(f"{path}: file {name} of the sharded checkpoint is missing")
        info = os.lstat(file)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{path}: {name} is not a regular file (a link, folder or device): {NOT_FOLLOWED}")
        if file_crc(file) != value:
            raise ValueError(f"{path}: file {name} does not have the bytes it was written with (corrupt); use "
                             "another checkpoint")
        sizes[name] = info.st_size
    return sizes


def read_dcp_metadata(path, files):
    """DCP's .metadata of a ckpt.dcp/, unpickled allowing only DCP's classes, and refused unless it holds
    only tensors (DCP unpickles a bytes entry with weights_only=False) stored inside `files` (the checked
    {name: size} of listed_files), untransformed -> (metadata, {name: a meta tensor of its shape and dtype})."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
    where = f"{path}/.metadata"
    try:
        with open(os.path.join(path, ".metadata"), "rb") as f:
            metadata = DCPMetadataUnpickler(f).load()
        if not isinstance(metadata, Metadata):
            raise TypeError(f"a {type(metadata).__name__}")
        entries, storage = dict(metadata.state_dict_metadata), dict(metadata.storage_data)
        tensors = {k: torch.empty(e.size, dtype=e.properties.dtype, device="meta") for k, e in entries.items()
                   if isinstance(e, TensorStorageMetadata)}
    except Exception as e:  # unpickling bytes that are not a pickle fails in many ways
        raise ValueError(f"{where} is not DCP metadata ({first_line(e)}): refused, loading it could run code") from None
    for name, entry in entries.items():
        if name not in tensors:
            raise ValueError(f"{where}: {name} is stored as {type(entry).__name__}, not as a tensor: refused, "
                             "loading it could run code")
    for index, info in storage.items():
        name, file = getattr(index, "fqn", index), getattr(info, "relative_path", None)
        if not isinstance(info, _StorageInfo) or not isinstance(file, str) or file not in files:
            raise ValueError(f"{where}: {name} is stored in {file!r}, not in a file of the checkpoint that "
                             f"{SHARDED_META} lists: {NOT_FOLLOWED}")
        if info.transform_descriptors:
            raise ValueError(f"{where}: {name} is stored transformed ({info.transform_descriptors}): refused")
        if not all(isinstance(v, int) and v >= 0 for v in (info.offset, info.length)) or \
                info.offset + info.length > files[file]:
            raise ValueError(f"{where}: {name} lies outside its file {file}: refused")
    return metadata, tensors


def dcp_reader(path, files):
    """DCP's file reader and load planner for a checked ckpt.dcp/: the reader reads .metadata through
    read_dcp_metadata (never plain pickle), the planner never unpickles a bytes entry."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class Reader(FileSystemReader):
        def read_metadata(self):  # no **kwargs: DCP then never falls back to a rank's own metadata file
            metadata = read_dcp_metadata(path, files)[0]
            metadata.storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value):
            raise ValueError(f"{path}/.metadata: {read_item.dest_index.fqn} is stored as pickled bytes: refused, "
                             "loading it could run code")

    return Reader(path), Planner()


def load_sharded_meta(path, formats=(FORMAT,)):
    """A ckpt.dcp/ directory's meta.pt (read without running code, its seal checked), after checking every
    file it lists (listed_files), DCP's .metadata (read_dcp_metadata) and that the weights fit the model
    config (check_weights). formats: those accepted (tooling.convert_checkpoint reads format 2)."""
    meta_path = os.path.join(path, SHARDED_META)
    if not os.path.isfile(meta_path):
        raise ValueError(f"{path} is not a sharded loopstudy checkpoint (no {SHARDED_META})")
    meta, intact = read_sealed(meta_path, hint="; resume from a ckpt.pt")
    if not isinstance(meta, dict) or meta.get("format") not in formats:
        hint = f"convert it: python -m tooling.convert_checkpoint {path} {path}" \
            if isinstance(meta, dict) and meta.get("format") == FORMAT_2 else "resume from a ckpt.pt"
        raise ValueError(f"{path} is a sharded checkpoint of an older format (or not one); {hint}")
    files = listed_files(path, meta.get("file_checksums"))
    _, tensors = read_dcp_metadata(path, files)
    if not intact and meta["format"] != FORMAT_2:  # after the checks above: what could run code is named first
        raise unsealed(meta_path)
    meta = legacy.upgraded(meta, path)
    check_weights(path, meta.get("model_config"), {k[len("model."):]: t for k, t in tensors.items()
                                                   if k.startswith("model.")})
    meta["path"], meta["files"] = path, files
    return meta


def load_sharded_tensors(meta, model, optimizers):
    """Fill model and optimizer state from a sharded checkpoint, in place, re-sharding onto however this
    process holds the parameters (FSDP2 shards of any world size, or whole tensors), through DCP's reader
    and planner narrowed to the checkpoint's own files and to tensors (dcp_reader). Non-finite weights
    are refused (on every rank alike)."""
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
    reader, planner = dcp_reader(meta["path"], meta["files"])
    with warnings.catch_warnings():  # one process resuming a sharded run is intended: DCP's warning is noise
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            dcp.load({"model": model_state, "optimizer": state}, storage_reader=reader, planner=planner)
        except (Exception, CheckpointException) as e:  # DCP lists every rank's failure (a BaseException)
            rank, cause = dcp_failure(e) if isinstance(e, CheckpointException) else (None, e)
            if distributed.peer_failure(cause):
                raise cause from None
            who = f"rank {rank}: {type(cause).__name__}: " if rank is not None and distributed.active() and \
                dist.get_world_size() > 1 else ""
            error = ValueError(f"cannot load the sharded checkpoint {meta['path']}: {who}{first_line(cause)}")
            raise (distributed.everywhere(error) if isinstance(e, CheckpointException) else error) from None
    flags = finite_flags(model_state.values(), collective=True)
    bad = next((name for name, finite in zip(model_state, flags) if not finite), None)
    if bad is not None:
        raise distributed.everywhere(ValueError(non_finite(meta["path"], bad)))
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
    if not isinstance(ckpt["state"], dict):
        raise ValueError(f"{path}: its state is not a train.py TrainState (a {type(ckpt['state']).__name__})")
    ckpt["path"] = path
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
    sharded (or replicated) as that state is (distribute_tensor); one of another shape or dtype is refused."""
    for opt in optimizers:
        for group in opt.param_groups:
            for p, name in zip(group["params"], group["param_names"]):
                if name in state_by_name:
                    template = empty_optimizer_state(opt, p)
                    for k, v in state_by_name[name].items():
                        want = template.get(k)
                        if torch.is_tensor(v) and torch.is_tensor(want) and (v.shape, v.dtype) != (want.shape,
                                                                                                  want.dtype):
                            raise ValueError(f"optimizer state {name}.{k} is stored as {v.dtype} of shape "
                                             f"{list(v.shape)}, the optimizer's is {want.dtype} of shape "
                                             f"{list(want.shape)}")
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
        return
    try:
        load_optimizer_state(optimizers, source["optimizer"]["state"])
    except ValueError as e:
        raise ValueError(f"{source.get('path', 'the checkpoint')}: {e}") from None
