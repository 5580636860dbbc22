"""
Convert a checkpoint of an older loopstudy format into the current one (tooling/checkpoint.py).

    python -m tooling.convert_checkpoint out/old/ckpt.pt out/old/ckpt_v2.pt

Guards against nothing, knowingly: reading OLD unpickles it, and unpickling a file can run any code it
holds. The current tools refuse such files for that reason; convert only a checkpoint you trust (one your
own older runs wrote). The result holds only tensors and plain data, with every tensor's checksum, and
loads with torch.load(weights_only=True).
"""

import dataclasses
import sys

import torch

from tooling import checkpoint
from tooling.common import cli_error, parser

OLD_STATE = ("step", "tokens_seen", "flops_seen", "flops_by_passes", "branch_start_step", "grown", "last_eval",
             "lr_scaling_params")


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


def main(argv=None):
    p = parser("tooling.convert_checkpoint", description="Convert an older loopstudy checkpoint (it is read the "
               "unsafe way: only files you trust) into the current format.")
    p.add_argument("old", help="the older checkpoint file (read with pickle: it can run code)")
    p.add_argument("new", help="where to write the converted checkpoint")
    args = p.parse_args(argv)
    try:
        current = torch.load(args.old, map_location="cpu", weights_only=True)  # safe: is it current already?
    except Exception:
        current = None
    try:
        if isinstance(current, dict) and current.get("format") == checkpoint.FORMAT:
            checkpoint.verify_checksums(current, args.old)  # never re-stamp a corrupt file with fresh checksums
            raise ValueError(f"{args.old} is already in the current format ({checkpoint.FORMAT}): nothing to convert")
        old = torch.load(args.old, map_location="cpu", weights_only=False)  # knowingly: see the docstring
        if not isinstance(old, dict) or "model" not in old or "model_config" not in old:
            raise ValueError(f"{args.old} is not a loopstudy checkpoint (needs 'model_config' and 'model')")
        checkpoint.save_file(args.new, convert(old))
        checkpoint.load_model(args.new)  # it loads the safe way now
    except (ValueError, OSError) as e:
        return cli_error("tooling.convert_checkpoint", e)
    except Exception as e:  # a file pickle cannot read
        return cli_error("tooling.convert_checkpoint", ValueError(f"cannot read {args.old}: {e}"))
    print(f"converted {args.old} -> {args.new}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
