"""
nanoGPT's configurator: the defaults, then config files (Python, run as code: trust them), then
--key=value (a Python literal, else a string).

    python train.py config/x_d8_loop2.py --max_steps=100
    overrides = configure(DEFAULTS, sys.argv[1:])  # a bad key or value: ValueError

A config file may start with `include("other.py")` to take another file's settings first.
"""

import ast
import difflib
import os


def read_config(path):
    """{name: value} of a config file's assignments, but names starting with _."""
    if not os.path.isfile(path):
        raise ValueError(f"config file not found: {path}")
    namespace = {}

    # An included file is found relative to this one.
    def include(name):
        namespace.update(read_config(os.path.join(os.path.dirname(path), name)))

    with open(path) as f:
        exec(compile(f.read(), path, "exec"), {"include": include}, namespace)
    return {k: v for k, v in namespace.items() if not k.startswith("_")}


def configure(defaults, argv):
    """{key: value} of the config files, then --key=value, each checked against its default."""
    settings = {}
    for arg in argv:
        if arg.startswith("--"):
            key, eq, text = arg[2:].partition("=")
            try:
                value = ast.literal_eval(text) if eq else True
            except (ValueError, SyntaxError):
                value = text
            settings[key] = checked(defaults, key, value)
        else:
            for k, v in read_config(arg).items():
                settings[k] = checked(defaults, k, v, arg)
    return settings


def checked(defaults, key, value, where="the command line"):
    """The value in its default's type, or a ValueError."""
    if key not in defaults:
        close = difflib.get_close_matches(key, defaults, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ValueError(
            f"unknown setting {key!r} in {where}{hint}; python train.py --help lists them"
        )
    default = defaults[key]
    # --matrix_lr=1 is 1.0, and --max_steps=1e4 is 10000.
    if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if isinstance(default, int) and isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(default, (list, tuple)) and isinstance(value, (list, tuple)):
        value = type(default)(value)
    if type(value) is not type(default):
        expected = f"expected a {type(default).__name__} like {default!r}"
        raise ValueError(f"{key}={value!r} in {where}: {expected}")
    return value
