"""
Settings of a script, for any dataclasses it hands in: defaults, config files, --key=value, --help.

Guards against: a setting that does not exist (a typo trains with the default in silence), a value of the
wrong type (--n_embd=1.5, --max_steps=abc), a non-finite number, and a config file that does not run
(named with its line). The comment beside a field's default is its --help text (continued on indented
comment lines), so a setting is described where it is defined, once.

    SETTINGS = Settings(TrainConfig, ModelConfig, defaults={"block_size": 128}, groups={...})
    overrides = SETTINGS.parse(["config/x.py", "--max_steps=10"])  # a config file, then --key=value
    values = SETTINGS.resolve(overrides)                            # defaults <- overrides, all checked
    config = SETTINGS.build(TrainConfig, values)

Config files are Python (nanoGPT's configurator style): reading one runs it. Read only the files you trust.
"""

import ast
import inspect
import math
import os
import re
import traceback
import types
from dataclasses import MISSING, fields

NON_FINITE = ("nan", "+nan", "-nan", "inf", "+inf", "-inf", "infinity", "+infinity", "-infinity")


def read_config_file(path, _including=()):
    """The assignments of a nanoGPT-style config file (plain python) as {name: value}; a file that does
    not exist or does not run raises an error naming the file and line. The file is executed: it is
    code, like nanoGPT's config files. `include("other.py")` in it reads another config file's assignments
    first (the six config/x_d8_*.py share config/_x_d8.py this way)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"config file not found: {path}")
    namespace = {}
    try:
        with open(path, encoding="utf-8") as f:
            source = f.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: config file is not UTF-8 text (byte {e.start}: {e.reason})") from None

    def include(name):  # another config file's assignments first (its path relative to this file's folder)
        included = os.path.join(os.path.dirname(path), name)
        reading = (*_including, os.path.abspath(path))  # the files being read now: a cycle is an error
        if os.path.abspath(included) in reading:
            raise ValueError(f"{path}: includes {name}, which includes it back")
        namespace.update(read_config_file(included, reading))

    try:
        exec(compile(source, path, "exec"), {"include": include}, namespace)
    except SyntaxError as e:
        raise ValueError(f"{path}:{e.lineno}: syntax error in config file: {e.msg}") from None
    except (Exception, SystemExit) as e:  # the file runs python: NameError, ImportError, sys.exit(), ...
        line = next((t.lineno for t in reversed(traceback.extract_tb(e.__traceback__)) if t.filename == path), None)
        where = f"{path}:{line}" if line else path
        raise ValueError(f"{where}: config file failed: {type(e).__name__}: {e}") from None
    return {k: v for k, v in namespace.items() if not k.startswith("_") and not isinstance(v, types.ModuleType)}


def declared_fields(path, class_name):
    """The field names a dataclass declares in a source file, read without importing it (match.py and the
    tools that read config files know train.py's TrainConfig this way: importing train.py would be a cycle)."""
    with open(path) as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            return [n.target.id for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]
    raise ValueError(f"{path} defines no class {class_name}")


def described_fields(cls):
    """{field: the comment beside its default, with the indented comment lines that continue it}."""
    descriptions, last = {}, None
    for line in inspect.getsource(cls).splitlines():
        if m := re.match(r"\s+(\w+): [^=]+= .*?  # (.*)$", line):
            descriptions[m[1]], last = m[2], m[1]
        elif (m := re.match(r"\s+#\s{2,}(.*)$", line)) and last:
            descriptions[last] += " " + m[1]
        else:
            last = None
    return descriptions


class Settings:
    """The flat settings of several dataclasses (field names must not collide). defaults: values that
    replace the dataclasses' own defaults (train.py's tiny model). groups: {title: [keys]} for --help,
    in order, every key in exactly one. went: {a setting an earlier release had: what to use instead}.
    not_settings: fields that are no settings (train.py: the data's eot_token); build() passes them on from
    the values when they hold them (a checkpoint's model), else the dataclass derives its own."""

    def __init__(self, *classes, defaults=None, groups=None, prog="train.py", went=None, not_settings=()):
        self.classes, self.groups, self.prog, self.went = classes, dict(groups or {}), prog, dict(went or {})
        self.not_settings = {cls: [f.name for f in fields(cls) if f.name in not_settings] for cls in classes}
        self.keys = {cls: [f.name for f in fields(cls) if f.name not in not_settings] for cls in classes}
        self.defaults = {}  # as declared: a size that __post_init__ derives (0 -> derive) stays 0 here, so it
        for cls in classes:  # is derived again from the sizes a run gives (--n_embd=256: head_dim 64)
            self.defaults.update({f.name: f.default if f.default is not MISSING else f.default_factory()
                                  for f in fields(cls) if f.name not in not_settings})
        self.declared = dict(self.defaults)  # the dataclasses' own: a setting at it is neutral (n_passes=1)
        unknown = sorted(set(defaults or {}) - set(self.defaults))
        if unknown:
            raise ValueError(f"defaults for unknown settings {unknown}")
        self.defaults.update(defaults or {})
        listed = [k for keys in self.groups.values() for k in keys]
        if not set(listed) <= set(self.defaults):
            raise ValueError(f"help groups name unknown settings {sorted(set(listed) - set(self.defaults))}")
        twice, missing = sorted({k for k in listed if listed.count(k) > 1}), sorted(set(self.defaults) - set(listed))
        if self.groups and (twice or missing):
            raise ValueError(f"every setting in one help group: {missing} in none, {twice} in two")

    def check(self, key, value, where="setting"):
        """Type-check one setting against its default; returns the (normalised) value."""
        if key not in self.defaults and key in self.went:  # a setting of an earlier release
            raise ValueError(f"unknown {where} {key!r}: it went ({self.went[key]}; docs/training.md, "
                             "'Settings that went')")
        if key not in self.defaults:
            close = [k for k in self.defaults if k.split("_")[0] == key.split("_")[0]][:5]
            hint = f" (similar: {', '.join(close)})" if close else ""
            raise ValueError(f"unknown {where} {key!r}{hint}; run `python {self.prog} --help` for the list")
        default = self.defaults[key]
        if isinstance(default, bool):
            ok, expected = isinstance(value, bool), "bool"
        elif isinstance(default, int):
            if isinstance(value, float) and value.is_integer():  # --max_steps=1e6
                value = int(value)
            ok, expected = isinstance(value, int) and not isinstance(value, bool), "int"
            if ok and abs(value) >= 2 ** 53:  # beyond what a float (1e30) says exactly, and any count we run
                raise ValueError(f"{where} {key}={value!r}: must be below 2**53")
        elif isinstance(default, float):
            ok, expected = isinstance(value, (int, float)) and not isinstance(value, bool), "float"
            value = float(value) if ok else value
            if ok and not math.isfinite(value):
                raise ValueError(f"{where} {key}={value!r}: must be a finite number")
        elif isinstance(default, (list, tuple)):
            ok, expected = isinstance(value, (list, tuple)), type(default).__name__
            value = type(default)(value) if ok else value
        else:
            ok, expected = isinstance(value, type(default)), type(default).__name__
        if not ok:
            raise ValueError(f"{where} {key}={value!r} has type {type(value).__name__}, expected {expected} "
                             f"(default {default!r})")
        return value

    def parse(self, argv):
        """[config/NAME.py ...] [--key=value ...] -> overrides dict. Values are python literals
        (literal_eval), anything else is a string. A config file without a run_name names the run after
        itself (config/x_d8_loop2.py -> x_d8_loop2) when run_name is a setting."""
        overrides = {}
        for arg in argv:
            if not arg.startswith("--"):
                values = {k: self.check(k, v, where=f"key in {arg}") for k, v in read_config_file(arg).items()}
                if "run_name" in self.defaults:
                    overrides["run_name"] = os.path.splitext(os.path.basename(arg))[0]
                overrides.update(values)
                continue
            key, eq, text = arg[2:].partition("=")
            if not eq:
                raise ValueError(f"expected --key=value, got {arg!r}")
            try:
                value = ast.literal_eval(text)
            except (ValueError, SyntaxError):
                value = float(text) if text.strip().lower() in NON_FINITE else text  # refused as a number
            overrides[key] = self.check(key, value, where="command-line key")
        return overrides

    def resolve(self, overrides, base=None, not_inherited=()):
        """defaults, then `base` (e.g. a checkpoint's settings, minus the keys in not_inherited), then
        overrides -> one flat dict; every key checked and every dataclass built once to validate it."""
        values = dict(self.defaults)
        for key, value in (base or {}).items():
            if key in self.defaults and key not in not_inherited:
                values[key] = value
        for key, value in overrides.items():
            values[key] = self.check(key, value)
        for cls in self.classes:
            self.build(cls, values)
        return values

    def build(self, cls, values):
        """An instance of one of the dataclasses from its keys of `values`."""
        passed_on = {k: values[k] for k in self.not_settings[cls] if k in values}
        return cls(**{k: values[k] for k in self.keys[cls]}, **passed_on)

    def help(self):
        """--help: the groups in order (without groups: each dataclass's keys), each key with its default
        and the comment beside it."""
        described = {}
        for cls in self.classes:
            described.update(described_fields(cls))
        sections = list(self.groups.items()) or [(f"{cls.__name__} settings", self.keys[cls]) for cls in self.classes]
        lines = [f"usage: python {self.prog} [config/NAME.py ...] [--key=value ...]", ""]
        for title, keys in sections:
            if keys:
                lines.append(f"{title}:")
                lines += [f"  --{k}={self.defaults[k]!r}".ljust(34) + f" {described.get(k, '')}" for k in keys]
                lines.append("")
        return "\n".join(lines)
