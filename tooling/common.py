"""
Small helpers every tool shares, each in one place: atomic file writes, one-line CLI errors, and
reading JSON lines with errors that name the file and line. Standard library only.
"""

import argparse
import contextlib
import json
import math
import os
import signal
import stat
import sys
import tempfile
import threading

TEMP_MARK = ".tmp-"  # temp files are named .<final name>.tmp-<random> beside the final file


def write_atomic(path, write):
    """write(f) into a temp file beside `path`, then rename it over `path`: a reader (or a crash at any
    moment) never sees half a file, and the previous file stays intact until the rename. The file gets
    the permissions any new file would get (0666 minus the umask), not mkstemp's 0600."""
    path = os.path.abspath(path)
    directory, name = os.path.split(path)
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{name}{TEMP_MARK}")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.chmod(tmp, 0o666 & ~current_umask())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def current_umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


def check_regular(path, what="input file"):
    """Refuse a path that is not a regular file once symlinks are resolved: a named pipe or a device (a
    symlink to /dev/zero) would block forever or never end."""
    if not stat.S_ISREG(os.stat(path).st_mode):
        real = os.path.realpath(path)
        via = f" (a symlink to {real})" if real != os.path.abspath(path) else ""
        raise ValueError(f"{what} {path}{via} is not a regular file (a pipe or a device would block or never end); "
                         "give a file")


def cli_error(prog, error):
    """A user mistake (missing file, bad value) as one line on stderr; returns exit status 2, the
    convention argparse uses for bad usage."""
    print(f"{prog}: error: {error_message(error)}", file=sys.stderr)
    return 2


def error_message(error):
    """What cli_error says of an error: an OSError's reason and file, else its message."""
    return error.strerror + f": {error.filename}" if isinstance(error, OSError) and error.filename \
        and error.strerror else str(error)


def first_line(error, limit=300):
    """The first non-blank line of an exception's message (its type's name if it has none), cut to limit."""
    lines = [line for line in str(error).splitlines() if line.strip()]
    return (lines[0] if lines else type(error).__name__)[:limit]


class CliParser(argparse.ArgumentParser):
    """argparse whose usage mistakes (an unknown flag, a bad value) are one line `<prog>: error: ...` on
    stderr and exit status 2, like every other mistake of the tools; flags are never abbreviated (--ckp is
    not --ckpt: a typo is an error, not a guess). A subcommand's parser is of this class too."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{"allow_abbrev": False, **kwargs})

    def error(self, message):
        sys.exit(cli_error(self.prog, ValueError(message)))


def parser(prog, **kwargs):
    """The command line of the tool `prog` (a CliParser)."""
    return CliParser(prog=prog, **kwargs)


def number(kind=int, low=None, high=None, open_low=False, open_high=False, why=None):
    """An argparse type: a finite int (or float) in [low, high] (an end excluded with open_low / open_high);
    anything else is one line naming the flag (argparse adds it: "argument --top_k: ..."); why: the reason
    for the upper limit, said when a value is above it."""
    import argparse
    import math
    bounds = " and ".join(f"{'>' if is_open else '>='} {low}" if side == "low" else f"{'<' if is_open else '<='} {high}"
                          for side, bound, is_open in (("low", low, open_low), ("high", high, open_high))
                          if bound is not None)

    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, got {text!r}")
        if why and math.isfinite(value) and value > high:
            raise argparse.ArgumentTypeError(f"{text}: at most {high:,} ({why})")
        if not math.isfinite(value) or (low is not None and (value < low or (open_low and value == low))) or \
                (high is not None and (value > high or (open_high and value == high))):
            raise argparse.ArgumentTypeError(f"{text}: must be a finite number{' ' + bounds if bounds else ''}"
                                             if not math.isfinite(value) else f"{text}: must be {bounds}")
        return value

    parse.__name__ = kind.__name__
    return parse


def resolve_device(name):
    """A torch.device from a --device value: 'auto' -> cuda when available, else cpu; ValueError for a
    malformed or unavailable device. (torch is imported here, not at the top: common.py also serves
    torch-free tools such as fit.py.)"""
    import torch
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"unknown device {name!r} (expected auto, cpu, cuda or cuda:N)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r}: CUDA is not available on this machine")
    return device


def read_jsonl(path):
    """Yield (line number, object) for every non-blank line of a JSON-lines file, streamed (lines end at
    \n, \r\n or \r only: U+2028 and the like are valid inside a JSON string); a malformed line raises
    ValueError naming the file and the line."""
    try:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno}: malformed JSON ({e.msg} at column {e.colno})") from None
                yield lineno, record
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not valid UTF-8 ({e})") from None


def fmt(v, spec=".2f", missing="n/a"):
    """A report's number: format(v, spec) (v a number or a numeric string), or `missing` for None or a value
    that is not finite."""
    if v is None or not math.isfinite(float(v)):
        return missing
    return format(int(v) if spec.endswith("d") else float(v), spec)


class Terminated(KeyboardInterrupt):
    """SIGTERM (a cluster scheduler ending the job, torchrun stopping its workers), raised where the main
    thread is, so the run ends like after Ctrl-C: temp files removed, lock released, one line."""


@contextlib.contextmanager
def signals_deferred():
    """Inside (a checkpoint or log write, an import of an extension): Ctrl-C and SIGTERM wait until it is
    done, then are raised; raised inside torch.save's writer they would surface as a failed write, inside a
    nanobind extension (Triton) they abort the process."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived = []
    previous = {s: signal.signal(s, lambda signum, frame: arrived.append(signum))
                for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if arrived:
        raise Terminated() if arrived[0] == signal.SIGTERM else KeyboardInterrupt()
