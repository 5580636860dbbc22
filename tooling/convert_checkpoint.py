"""
Convert a checkpoint of an older loopstudy format into the current one (tooling/checkpoint.py).

    python -m tooling.convert_checkpoint out/old/ckpt.pt out/old/ckpt_v3.pt
    python -m tooling.convert_checkpoint out/run/ckpt.dcp out/run/ckpt.dcp     (a sharded one, in place)

Format 2 (plain data, unsealed) is read the safe way (weights_only=True), its tensors' CRC-32s checked; a
ckpt.dcp/ of format 2 keeps its shards (checked as a resume checks them) and gets a sealed meta.pt.
Format 1 guards against nothing, knowingly: reading it unpickles it, and unpickling a file can run any code
it holds. The current tools refuse such files for that reason; convert only a checkpoint you trust (one
your own older runs wrote). The result holds only tensors and plain data, with every tensor's checksum and
the file's seal, and loads with torch.load(weights_only=True).
"""

import dataclasses
import os
import shutil
import sys

import torch

from tooling import checkpoint
from tooling.common import cli_error, first_line, parser

OLD_STATE = ("step", "tokens_seen", "flops_seen", "flops_by_passes", "branch_start_step", "grown", "last_eval")


def plain(value):
    """Derived sizes, numpy scalars and tuples of them as the plain values they stand for."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):  # a config or TrainState object
        return plain(dataclasses.asdict(value))
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(plain(v) for v in value)
    if isinstance(value, bool) or value is None or isinstance(value, (str, torch.Tensor)):
        return value
    if isinstance(value, int):
        return int(value)
    if hasattr(value, "item"):  # numpy scalars
        return value.item()
    return value


def convert(old):
    """An older checkpoint dict -> the current layout (the run's state under "state")."""
    new = {k: plain(v) for k, v in old.items() if k not in OLD_STATE + ("data_position", "rng", "checksums")}
    position = old.get("data_position") or {}
    if "state" in old:  # already a TrainState (of fields): only plain data now
        new["state"] = plain(old["state"])
    else:  # the first format: the state's fields at the top level
        new["state"] = {k: plain(old.get(k)) for k in OLD_STATE if k in old}
        new["state"].update(data_region=position.get("region", "stable"), data_position=position.get("windows", 0))
    new["state"].setdefault("flops_by_passes", {})
    if "rng" in old:
        new["rng"] = {k: v for k, v in old["rng"].items() if k in ("torch", "cuda")}  # the numpy state is unused
    return new


def convert_sharded(old, new):
    """A ckpt.dcp/ of format 2 -> new (a copy, or old itself: in place), with a sealed meta.pt."""
    meta = checkpoint.load_sharded_meta(old, formats=(checkpoint.FORMAT, checkpoint.FORMAT_2))  # every file checked
    if meta["format"] == checkpoint.FORMAT:
        raise ValueError(f"{old} is already in the current format ({checkpoint.FORMAT}): nothing to convert")
    if os.path.abspath(new) != os.path.abspath(old):
        if os.path.exists(new):
            raise ValueError(f"{new} exists: give a new folder, or {old} itself to convert it in place")
        shutil.copytree(old, new)
    checkpoint.write_sharded_meta(new, {k: v for k, v in meta.items() if k not in ("path", "files")})
    checkpoint.load_sharded_meta(new)  # it loads the current way now


def convert_file(old, new):
    with open(old, "rb") as f:
        if f.read(4) != b"PK\x03\x04":
            raise ValueError(f"{old} is not a loopstudy checkpoint (not a zip file as torch.save writes them)")
    try:
        current = torch.load(old, map_location="cpu", weights_only=True)  # safe: of which format?
    except Exception:
        current = None
    fmt = current.get("format") if isinstance(current, dict) else None
    if fmt == checkpoint.FORMAT or checkpoint.seal_intact(old) is not None:
        checkpoint.load_checkpoint(old)  # a corrupt one is refused, never sealed again
        raise ValueError(f"{old} is already in the current format ({checkpoint.FORMAT}): nothing to convert")
    if fmt == checkpoint.FORMAT_2:  # plain data: read the safe way, its tensors' CRC-32s checked
        checkpoint.verify_checksums(current, old)
        ckpt = current
    else:
        ckpt = torch.load(old, map_location="cpu", weights_only=False)  # knowingly: see the docstring
    if not isinstance(ckpt, dict) or "model" not in ckpt or "model_config" not in ckpt:
        raise ValueError(f"{old} is not a loopstudy checkpoint (needs 'model_config' and 'model')")
    checkpoint.save_file(new, convert(ckpt))
    checkpoint.load_model(new)  # it loads the safe way now


def main(argv=None):
    p = parser("tooling.convert_checkpoint", description="Convert an older loopstudy checkpoint (a format-1 file is "
               "read the unsafe way: only files you trust) into the current format.")
    p.add_argument("old", help="the older checkpoint: a file (format 1 is read with pickle: it can run code), or a "
                               "ckpt.dcp/ folder")
    p.add_argument("new", help="where to write the converted checkpoint (a ckpt.dcp/: the same folder converts it in "
                               "place)")
    args = p.parse_args(argv)
    try:
        if not os.path.exists(args.old):
            raise FileNotFoundError(f"checkpoint not found: {args.old}")
        (convert_sharded if os.path.isdir(args.old) else convert_file)(args.old, args.new)
    except (ValueError, OSError) as e:
        return cli_error("tooling.convert_checkpoint", e)
    except Exception as e:  # a file pickle cannot read
        return cli_error("tooling.convert_checkpoint", ValueError(f"cannot read {args.old}: {first_line(e)}"))
    print(f"converted {args.old} -> {args.new}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
