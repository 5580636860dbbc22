"""
DCLM CORE evaluation, compatible with the public eval bundle that nanochat uses, plus the extra
measurements of the two papers: answer NLL [X18], the frozen 17-task subset [X Table 10], few-shot
seeds, k-shot sweeps [S ICL] and per-document-length-bucket validation loss [S].

    python eval_core.py --ckpt out/ckpt.pt --bundle tests/data/core_bundle
    python eval_core.py --ckpt out/ckpt.pt --bundle ~/eval_bundle --max_per_task 500 --json
    python eval_core.py --ckpt out/ckpt.pt --bundle ~/eval_bundle --fewshot_seeds 0,1,2
    python eval_core.py --ckpt out/ckpt.pt --bundle ~/eval_bundle --kshot_sweep
    python eval_core.py --ckpt out/ckpt.pt --length_buckets data/cache/default   # no --bundle needed

Bundle layout (read from the path you give; nothing is ever downloaded):
    core.yaml            icl_tasks: a list of {label, dataset_uri, num_fewshot: [k], icl_task_type,
                         continuation_delimiter (default ' ')}
    eval_data/**.jsonl   one item per line. multiple_choice: {query, choices, gold};
                         schema: {context_options, continuation, gold}; language_modeling: {context, continuation}
    eval_meta_data.csv   'Eval Task' -> 'Random baseline' (percent)
The bundle fingerprint is sha256 over (relative path, sha256 of the file) for every file, walked in
sorted order; the same recipe as the [X] code, so its pinned value is recognised (KNOWN_FINGERPRINTS).

Random-baseline versions (they change CORE, so every report prints which one it used):
    v1           mlfoundations/dclm eval/eval_meta_data.csv before 2025-09-05 (kept upstream as
                 eval_meta_data_v1.csv); nanochat's bundle carries these values.
    2025-09-05   commit 6204236 changed three rows: commonsense_qa 20 -> 40.3,
                 agi_eval_lsat_ar 20 -> 25, bigbench_language_identification 9.1 -> 25.

Semantics follow nanochat's core_eval exactly:
- data shuffled with random.Random(1337), then cut to [:max_per_task]; few-shot examples for item idx
  are rng.sample(all other idx, k) with rng = random.Random(seed + idx), seed 1234 by default.
- prompts (few-shot blocks joined by "\\n\\n"):
    multiple_choice  "{query}{delim}{choices[gold]}" ... "{query}{delim}{choice}" one prompt per choice
    schema           "{context_options[gold]}{delim}{continuation}" ... "{context}{delim}{continuation}"
                     one prompt per context option
    language_model   "{context.strip()}{delim}{continuation}" ...; without = "...{context.strip()}{delim}".strip(),
                     with = "...{context.strip()}{delim}{continuation}"
- tokens = [BOS] + encode(prompt), BOS = the tokenizer's eot token (our document separator).
  Scored span [s, e): MC s = common token prefix of all choices; schema s = e - common token suffix;
  LM s = len(tokens(without)). Sequences longer than the model context are cropped from the left.
- one forward; loss at position p predicts token p+1, so the span's losses are [s-1, e-1).
  MC/schema: correct if the first argmin of the mean span loss is gold. LM: correct if every greedy
  prediction in the span equals the reference token.
Answer NLL [X18]: mean loss of the gold continuation given the gold prompt, where (as the [X] code does)
the continuation starts at the common token prefix of tokens(prompt) and tokens(prompt minus continuation);
for LM tasks it is the scored span.

Where we differ from nanochat (all no-ops on well-formed data):
- items of one task are batched together (length-sorted, right-padded with eot) instead of one item per
  forward; a causal model gives the same scores up to float rounding (tests check this).
- LM: if tokens(without) is not a prefix of tokens(with) (a BPE merge across the join), nanochat asserts;
  we start the span at the common prefix and count such items ("boundary_fixed" in the report).
- MC/schema: a choice with an empty span (its tokens are a prefix of another choice's) gets mean loss
  +inf and never wins (nanochat would take the mean of nothing, nan).
- fewshot_seeds: item idx of seed s draws with random.Random(s + idx), as the [X] code passes its seeds;
  the default 1234 reproduces nanochat; "--fewshot_seeds 0,1,2" are [X]'s seeds 0/1/2, averaged (task
  accuracy and NLL are seed means; zero-shot tasks run once).
"""

import argparse
import collections.abc
import csv
import hashlib
import json
import math
import os
import random
import re
import sys

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

try:  # PyYAML is optional; the small reader below handles the subset core.yaml uses
    import yaml
except ImportError:
    yaml = None

TASK_TYPES = ("multiple_choice", "schema", "language_modeling")
SHUFFLE_SEED = 1337  # nanochat: random.Random(1337).shuffle(data), then data[:max_per_task]
FEWSHOT_SEED = 1234  # nanochat: random.Random(1234 + idx) draws item idx's few-shot examples
KSHOT_SWEEP = (0, 1, 2, 4, 8, 16, 32)  # [S ICL]
LENGTH_BUCKETS = (32, 64, 128, 256, 512, 1024, 2048, 4096)  # [S] upper bounds, document token counts

# the 22 CORE tasks, in nanochat's core.yaml order
CORE22_LABELS = (
    "hellaswag_zeroshot", "jeopardy", "bigbench_qa_wikidata", "arc_easy", "arc_challenge", "copa",
    "commonsense_qa", "piqa", "openbook_qa", "lambada_openai", "hellaswag", "winograd", "winogrande",
    "bigbench_dyck_languages", "agi_eval_lsat_ar", "bigbench_cs_algorithms", "bigbench_operators",
    "bigbench_repeat_copy_logic", "squad", "coqa", "boolq", "bigbench_language_identification",
)
# [X Table 10] frozen Vanilla-only filter: the paper names these commonsense_qa, boolq, cs_algorithms,
# language_identification, repeat_copy_logic; mapped here to the public bundle's labels
CORE17_EXCLUDED = ("commonsense_qa", "boolq", "bigbench_cs_algorithms",
                   "bigbench_language_identification", "bigbench_repeat_copy_logic")
CORE17_LABELS = tuple(label for label in CORE22_LABELS if label not in CORE17_EXCLUDED)

# the three rows that differ between the two published random-baseline tables: (v1, 2025-09-05)
RANDOM_BASELINE_CHANGES = {
    "commonsense_qa": (20.0, 40.3),
    "agi_eval_lsat_ar": (20.0, 25.0),
    "bigbench_language_identification": (9.1, 25.0),
}
KNOWN_FINGERPRINTS = {
    "e908e4e0e145860290d46fb37c5d1bad52bbf22da843073ff0e6b6f624250e52":
        "karpathy eval_bundle.zip as pinned by the [X] code (qlabs-eng/scaling-exponents core_eval.py)",
}


# ----------------------------------------------------------------------------------------------
# core.yaml: PyYAML when installed, otherwise a strict reader for exactly the subset the bundle uses.
# Both return the task mappings with "__line__" (line of the task) and "__key_lines__" (line per key)
# so every later error can name file and line.

def _yaml_error(path, line, msg):
    return ValueError(f"{path}:{line}: {msg}")


def _strip_comment(text):
    """Drop a '#' comment that is outside quotes and starts a word (YAML's rule)."""
    quote = None
    i = 0
    while i < len(text):
        c = text[i]
        if quote == '"' and c == "\\":
            i += 2
            continue
        if quote:
            if c == quote:
                if quote == "'" and text[i + 1:i + 2] == "'":
                    i += 2
                    continue
                quote = None
        elif c in "\"'" and (i == 0 or text[i - 1] in " \t[,:"):
            quote = c
        elif c == "#" and (i == 0 or text[i - 1] in " \t"):
            return text[:i].rstrip()
        i += 1
    return text.rstrip()


_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "0": "\0", "\\": "\\", '"': '"', "/": "/", " ": " ",
            "a": "\a", "b": "\b", "e": "\x1b", "f": "\f", "v": "\v"}


def _parse_scalar(text, path, line):
    """One YAML scalar: "double" (escapes), 'single', int, float, bool, null or a plain string."""
    text = text.strip()
    if text.startswith('"'):
        out, i = [], 1
        while i < len(text):
            c = text[i]
            if c == "\\":
                nxt = text[i + 1:i + 2]
                if nxt in _ESCAPES:
                    out.append(_ESCAPES[nxt])
                    i += 2
                elif nxt in ("x", "u", "U"):
                    width = {"x": 2, "u": 4, "U": 8}[nxt]
                    digits = text[i + 2:i + 2 + width]
                    if len(digits) != width or not all(d in "0123456789abcdefABCDEF" for d in digits):
                        raise _yaml_error(path, line, f"bad escape in {text!r}")
                    out.append(chr(int(digits, 16)))
                    i += 2 + width
                else:
                    raise _yaml_error(path, line, f"unsupported escape '\\{nxt}' in {text!r}")
            elif c == '"':
                if text[i + 1:].strip():
                    raise _yaml_error(path, line, f"text after closing quote in {text!r}")
                return "".join(out)
            else:
                out.append(c)
                i += 1
        raise _yaml_error(path, line, f"unterminated double-quoted string {text!r}")
    if text.startswith("'"):
        out, i = [], 1
        while i < len(text):
            if text[i] == "'":
                if text[i + 1:i + 2] == "'":
                    out.append("'")
                    i += 2
                    continue
                if text[i + 1:].strip():
                    raise _yaml_error(path, line, f"text after closing quote in {text!r}")
                return "".join(out)
            out.append(text[i])
            i += 1
        raise _yaml_error(path, line, f"unterminated single-quoted string {text!r}")
    if text == "" or text in ("~", "null", "Null", "NULL"):
        return None
    if text in ("true", "True", "TRUE", "yes", "Yes", "YES", "on", "On", "ON"):  # YAML 1.1 booleans, as PyYAML
        return True
    if text in ("false", "False", "FALSE", "no", "No", "NO", "off", "Off", "OFF"):
        return False
    if re.fullmatch(r"[-+]?(0|[1-9][0-9]*)", text):
        return int(text)
    if re.fullmatch(r"[-+]?([0-9]+\.[0-9]*|\.[0-9]+)([eE][-+][0-9]+)?", text):
        return float(text)
    if re.fullmatch(r"[-+]?[0-9][0-9_xXoObB.:eE+-]*", text):  # octal, hex, 1_000, 1e5, sexagesimal...
        raise _yaml_error(path, line, f"ambiguous number {text!r}; quote it or write a plain decimal")
    if text[0] in "[]{}&*!|>%@`," or ": " in text or text.endswith(":"):
        raise _yaml_error(path, line, f"unsupported YAML value {text!r} (this reader knows scalars, "
                                      "quoted strings and one-line [lists]; install PyYAML for more)")
    return text


def _parse_value(text, path, line):
    text = text.strip()
    if text.startswith("["):
        if not text.endswith("]"):
            raise _yaml_error(path, line, f"unterminated or multi-line flow list {text!r}")
        inner = text[1:-1].strip()
        if not inner:
            return []
        if any(c in inner for c in "[]{}"):
            raise _yaml_error(path, line, f"nested flow collections are not supported: {text!r}")
        parts, buf, quote = [], "", None
        for c in inner:  # split on commas outside quotes
            if quote:
                quote = None if c == quote else quote
            elif c in "\"'":
                quote = c
            elif c == ",":
                parts.append(buf)
                buf = ""
                continue
            buf += c
        parts.append(buf)
        return [_parse_scalar(p, path, line) for p in parts]
    if text.startswith("{"):
        raise _yaml_error(path, line, f"flow mappings are not supported: {text!r}")
    return _parse_scalar(text, path, line)


def _split_key(text, path, line):
    m = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_\-]*)\s*:(?:\s+(.*))?", text)
    if not m:
        raise _yaml_error(path, line, f"expected 'key: value', got {text!r}")
    return m.group(1), (m.group(2) or "")


def parse_core_yaml(text, path="core.yaml"):
    """Strict reader for the core.yaml subset: a top-level mapping whose values are scalars or (icl_tasks)
    a block list of flat mappings (values: scalars, one-line [lists] or block lists of scalars)."""
    lines = []
    for n, raw in enumerate(text.splitlines(), start=1):
        body = _strip_comment(raw)
        if not body.strip() or body.strip() in ("---", "..."):
            continue
        lead = body[:len(body) - len(body.lstrip(" \t"))]
        if "\t" in lead:
            raise _yaml_error(path, n, "tab in indentation")
        lines.append((n, len(lead), body.strip()))

    top = {}
    i = 0
    while i < len(lines):
        n, indent, body = lines[i]
        if indent != 0:
            raise _yaml_error(path, n, f"unexpected indentation at top level: {body!r}")
        key, rest = _split_key(body, path, n)
        if key in top:
            raise _yaml_error(path, n, f"duplicate key {key!r}")
        i += 1
        is_item = i < len(lines) and (lines[i][2] == "-" or lines[i][2].startswith(("- ", "-\t")))
        if rest.strip() or not is_item:
            if not rest.strip() and i < len(lines) and lines[i][1] > 0:
                raise _yaml_error(path, lines[i][0], f"nested values under {key!r} are not supported "
                                                     "(only a list of flat mappings like icl_tasks)")
            top[key] = _parse_value(rest, path, n)
            continue
        tasks = []
        # list items: lines starting with '-' at one indent (may be 0, YAML allows it under a key)
        while i < len(lines) and lines[i][2].startswith("-") and (lines[i][2] == "-" or lines[i][2][1] in " \t"):
            n_item, dash_indent, body = lines[i]
            if tasks and dash_indent != tasks[-1]["__dash__"]:
                raise _yaml_error(path, n_item, "inconsistent indentation of icl_tasks items")
            task = {"__line__": n_item, "__key_lines__": {}, "__dash__": dash_indent}
            tasks.append(task)
            inline = body[1:].strip()
            i += 1
            key_indent = None
            pending = []  # (line, indent or None for the inline first key, text) of this item's keys
            if inline:
                pending.append((n_item, None, inline))
            while i < len(lines) and lines[i][1] > dash_indent:
                pending.append(lines[i])
                i += 1
            if pending:  # PyYAML marks a mapping at its first key; do the same
                task["__line__"] = pending[0][0]
            j = 0
            while j < len(pending):
                n_key, k_indent, text_k = pending[j]
                if text_k.startswith("- ") or text_k == "-":
                    raise _yaml_error(path, n_key, f"unexpected list item {text_k!r}")
                if k_indent is not None:
                    if key_indent is None:
                        key_indent = k_indent
                    elif k_indent != key_indent:
                        raise _yaml_error(path, n_key, f"inconsistent indentation for key line {text_k!r}")
                item_key, item_rest = _split_key(text_k, path, n_key)
                if item_key in task["__key_lines__"]:
                    raise _yaml_error(path, n_key, f"duplicate key {item_key!r}")
                j += 1
                if item_rest.strip():
                    value = _parse_value(item_rest, path, n_key)
                else:  # a block list of scalars may follow ("num_fewshot:\n  - 0")
                    value, items = None, []
                    while j < len(pending) and (pending[j][2].startswith("- ") or pending[j][2] == "-"):
                        items.append(_parse_scalar(pending[j][2][1:], path, pending[j][0]))
                        j += 1
                    if items:
                        value = items
                task[item_key] = value
                task["__key_lines__"][item_key] = n_key
        for task in tasks:
            del task["__dash__"]
        top[key] = tasks
    return top


def _yaml_load_with_lines(text, path):
    """PyYAML safe_load that also records the line of every mapping and of each of its keys."""
    class LineLoader(yaml.SafeLoader):
        pass

    def construct_mapping(loader, node, deep=False):
        mapping = yaml.SafeLoader.construct_mapping(loader, node, deep=deep)
        mapping["__line__"] = node.start_mark.line + 1
        mapping["__key_lines__"] = {k.value: k.start_mark.line + 1 for k, _ in node.value}
        return mapping

    LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, construct_mapping)
    try:
        doc = yaml.load(text, Loader=LineLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = mark.line + 1 if mark is not None else "?"
        raise _yaml_error(path, line, f"invalid YAML: {getattr(e, 'problem', e)}") from None
    if isinstance(doc, dict):
        doc.pop("__line__", None)
        doc.pop("__key_lines__", None)
    return doc


def read_core_yaml(path, use_yaml=None):
    """Read and validate core.yaml -> list of task dicts {label, dataset_uri, num_fewshot (int),
    icl_task_type, continuation_delimiter, line}. use_yaml: None = PyYAML if installed."""
    with open(path, "r", encoding="utf-8") as f:
        text = f.read()
    use_yaml = (yaml is not None) if use_yaml is None else use_yaml
    if use_yaml and yaml is None:
        raise ImportError("use_yaml=True but PyYAML is not installed")
    doc = _yaml_load_with_lines(text, path) if use_yaml else parse_core_yaml(text, path)
    if not isinstance(doc, dict) or "icl_tasks" not in doc:
        raise _yaml_error(path, 1, "missing top-level key 'icl_tasks'")
    raw_tasks = doc["icl_tasks"]
    if not isinstance(raw_tasks, list) or not raw_tasks:
        raise _yaml_error(path, 1, "'icl_tasks' must be a non-empty list of task mappings")
    tasks, seen = [], {}
    for raw in raw_tasks:
        if not isinstance(raw, dict):
            raise _yaml_error(path, "?", f"icl_tasks entry is not a mapping: {raw!r}")
        line, key_lines = raw["__line__"], raw["__key_lines__"]
        for key in ("label", "dataset_uri", "num_fewshot", "icl_task_type"):
            if raw.get(key) is None:
                raise _yaml_error(path, line, f"task is missing required key {key!r}"
                                              + (f" (label {raw['label']!r})" if raw.get("label") else ""))
        label = str(raw["label"])
        if label in seen:
            raise _yaml_error(path, key_lines["label"], f"duplicate task label {label!r} "
                                                        f"(first at line {seen[label]})")
        seen[label] = key_lines["label"]
        shots = raw["num_fewshot"]
        if not isinstance(shots, list) or not shots or not all(isinstance(k, int) and not isinstance(k, bool)
                                                              and k >= 0 for k in shots):
            raise _yaml_error(path, key_lines["num_fewshot"], f"num_fewshot must be a list like [10] of "
                                                              f"non-negative ints, got {shots!r}")
        task_type = raw["icl_task_type"]
        if task_type not in TASK_TYPES:
            raise _yaml_error(path, key_lines["icl_task_type"], f"unknown icl_task_type {task_type!r} for "
                                                                f"task {label!r}; expected one of {TASK_TYPES}")
        delim = raw.get("continuation_delimiter", " ")
        if delim is None:
            delim = " "
        if not isinstance(delim, str):
            raise _yaml_error(path, key_lines["continuation_delimiter"],
                              f"continuation_delimiter must be a string, got {delim!r}")
        tasks.append({"label": label, "dataset_uri": str(raw["dataset_uri"]),
                      "num_fewshot": shots[0],  # nanochat uses num_fewshot[0]
                      "icl_task_type": task_type, "continuation_delimiter": delim, "line": line})
    return tasks


# ----------------------------------------------------------------------------------------------
# bundle: tasks, data files, random baselines, fingerprint

def bundle_fingerprint(bundle_dir):
    """sha256 over (relative path, sha256 of file) for every file, dirs and files walked in sorted order."""
    digest = hashlib.sha256()
    for root, dirs, files in os.walk(bundle_dir):
        dirs.sort()
        for name in sorted(files):
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                file_digest = hashlib.sha256(f.read()).hexdigest()
            digest.update(os.path.relpath(path, bundle_dir).encode())
            digest.update(file_digest.encode())
    return digest.hexdigest()


def read_random_baselines(path):
    """eval_meta_data.csv -> {task label: random baseline in percent}."""
    with open(path, "r", encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        fields = reader.fieldnames or []
        rb_col = next((c for c in fields if c.strip().lower().startswith("random baseline")), None)
        if "Eval Task" not in fields or rb_col is None:
            raise ValueError(f"{path}:1: header needs columns 'Eval Task' and 'Random baseline', got {fields}")
        baselines = {}
        for row in reader:
            line = reader.line_num
            label = (row.get("Eval Task") or "").strip()
            if not label:
                raise ValueError(f"{path}:{line}: empty 'Eval Task'")
            try:
                rb = float(row[rb_col])
            except (TypeError, ValueError):
                raise ValueError(f"{path}:{line}: random baseline for {label!r} is not a number: "
                                 f"{row[rb_col]!r}") from None
            if not 0.0 <= rb < 100.0:
                raise ValueError(f"{path}:{line}: random baseline for {label!r} must be a percent in [0, 100)")
            baselines[label] = rb
    return baselines


def random_baseline_version(baselines):
    """'v1', '2025-09-05', or a description when the three rows that changed are absent/other."""
    present = [k for k in RANDOM_BASELINE_CHANGES if k in baselines]
    if not present:
        return "n/a (none of the changed DCLM rows present)"
    if all(math.isclose(baselines[k], RANDOM_BASELINE_CHANGES[k][0]) for k in present):
        return "v1"
    if all(math.isclose(baselines[k], RANDOM_BASELINE_CHANGES[k][1]) for k in present):
        return "2025-09-05"
    return "custom (matches neither published version)"


def with_baseline_version(bundle, version):
    """A copy of a loaded bundle whose three changed rows use one published table ('v1' or '2025-09-05'),
    so CORE can be reported under either version without editing the csv."""
    if version not in ("v1", "2025-09-05"):
        raise ValueError(f"baseline version must be 'v1' or '2025-09-05', got {version!r}")
    col = 0 if version == "v1" else 1
    baselines = dict(bundle["random_baselines"])
    baselines.update({k: v[col] for k, v in RANDOM_BASELINE_CHANGES.items() if k in baselines})
    tasks = [dict(t, random_baseline=baselines[t["label"]]) for t in bundle["tasks"]]
    return dict(bundle, tasks=tasks, random_baselines=baselines,
                baseline_version=f"{random_baseline_version(baselines)} (set by with_baseline_version)")


def load_bundle(bundle_dir):
    """Read a bundle directory: task list, random baselines, fingerprint. Never downloads."""
    bundle_dir = os.path.abspath(os.path.expanduser(bundle_dir))
    if not os.path.isdir(bundle_dir):
        raise FileNotFoundError(f"eval bundle directory not found: {bundle_dir} (this script never downloads; "
                                "unzip nanochat's eval_bundle.zip and pass its path)")
    yaml_path = os.path.join(bundle_dir, "core.yaml")
    csv_path = os.path.join(bundle_dir, "eval_meta_data.csv")
    for p in (yaml_path, csv_path):
        if not os.path.isfile(p):
            raise FileNotFoundError(f"eval bundle is missing {p}")
    tasks = read_core_yaml(yaml_path)
    baselines = read_random_baselines(csv_path)
    for task in tasks:
        if task["label"] not in baselines:
            raise ValueError(f"{yaml_path}:{task['line']}: task {task['label']!r} has no row in {csv_path}")
        task["random_baseline"] = baselines[task["label"]]
        data_path = os.path.normpath(os.path.join(bundle_dir, "eval_data", task["dataset_uri"]))
        if not os.path.isfile(data_path):
            raise FileNotFoundError(f"{yaml_path}:{task['line']}: dataset_uri of {task['label']!r} "
                                    f"points to a missing file {data_path}")
        task["path"] = data_path
    fingerprint = bundle_fingerprint(bundle_dir)
    return {"dir": bundle_dir, "tasks": tasks, "random_baselines": baselines, "fingerprint": fingerprint,
            "fingerprint_known": KNOWN_FINGERPRINTS.get(fingerprint),
            "baseline_version": random_baseline_version(baselines)}


def _check_item(item, task_type, path, line):
    def bad(msg):
        return ValueError(f"{path}:{line}: {msg}")

    def is_str_list(x):
        return isinstance(x, list) and len(x) > 0 and all(isinstance(s, str) for s in x)

    if not isinstance(item, dict):
        raise bad(f"item must be a JSON object, got {type(item).__name__}")
    need = {"multiple_choice": ("query", "choices", "gold"), "schema": ("context_options", "continuation", "gold"),
            "language_modeling": ("context", "continuation")}[task_type]
    for key in need:
        if key not in item:
            raise bad(f"{task_type} item is missing key {key!r}")
    options = item.get("choices") if task_type == "multiple_choice" else item.get("context_options")
    if task_type != "language_modeling":
        if not is_str_list(options):
            raise bad(f"{'choices' if task_type == 'multiple_choice' else 'context_options'} must be a non-empty "
                      "list of strings")
        gold = item["gold"]
        if isinstance(gold, bool) or not isinstance(gold, int) or not 0 <= gold < len(options):
            raise bad(f"gold must be an int index into {len(options)} options, got {gold!r}")
    if task_type == "multiple_choice":  # an empty wrong choice only has an empty span (it never wins)
        if not isinstance(item["query"], str) or item["choices"][item["gold"]] == "":
            raise bad("query must be a string and the gold choice a non-empty string")
    else:
        if not isinstance(item["continuation"], str) or item["continuation"] == "":
            raise bad("continuation must be a non-empty string")
        if task_type == "language_modeling" and not isinstance(item["context"], str):
            raise bad("context must be a string")


def load_task_data(task):
    """Read a task's jsonl; every item is validated, errors name file and line."""
    items = []
    with open(task["path"], "r", encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{task['path']}:{n}: invalid JSON ({e.msg} at column {e.colno})") from None
            _check_item(item, task["icl_task_type"], task["path"], n)
            items.append(item)
    if not items:
        raise ValueError(f"{task['path']}: no items")
    return items


def shuffle_and_cut(items, max_per_task=-1):
    """nanochat's subsample: shuffle with random.Random(1337), keep the first max_per_task (-1 = all)."""
    items = list(items)
    random.Random(SHUFFLE_SEED).shuffle(items)
    return items[:max_per_task] if max_per_task > 0 else items


class _AllBut(collections.abc.Sequence):
    """range(n) without idx, as a lazy sequence: random.sample draws exactly what it would from the list
    [i for i in range(n) if i != idx] without building it (O(n) per item on 10k-item tasks otherwise)."""
    def __init__(self, n, idx):
        self.n, self.idx = n, idx

    def __len__(self):
        return self.n - 1

    def __getitem__(self, j):
        if not 0 <= j < self.n - 1:
            raise IndexError(j)
        return j if j < self.idx else j + 1


def sample_fewshot(data, idx, k, seed=FEWSHOT_SEED):
    """The k few-shot examples of item idx: random.Random(seed + idx).sample(other indices, k)."""
    if k <= 0:
        return []
    available = _AllBut(len(data), idx)
    return [data[i] for i in random.Random(seed + idx).sample(available, min(k, len(available)))]


# ----------------------------------------------------------------------------------------------
# prompts and token spans

def render_mc(item, delim, fewshot=()):
    """One prompt per choice: few-shot "query{delim}gold_choice" blocks, then "query{delim}choice"."""
    prefix = "".join(f"{ex['query']}{delim}{ex['choices'][ex['gold']]}\n\n" for ex in fewshot)
    return [f"{prefix}{item['query']}{delim}{choice}" for choice in item["choices"]]


def render_schema(item, delim, fewshot=()):
    """One prompt per context option, all ending in the shared continuation."""
    prefix = "".join(f"{ex['context_options'][ex['gold']]}{delim}{ex['continuation']}\n\n" for ex in fewshot)
    return [f"{prefix}{ctx}{delim}{item['continuation']}" for ctx in item["context_options"]]


def render_lm(item, delim, fewshot=()):
    """[prompt without continuation (stripped), prompt with continuation]."""
    prefix = "".join(f"{ex['context'].strip()}{delim}{ex['continuation']}\n\n" for ex in fewshot)
    base = f"{prefix}{item['context'].strip()}{delim}"
    return [base.strip(), base + item["continuation"]]


def common_prefix_len(seqs):
    n = min(len(s) for s in seqs)
    for i in range(n):
        if any(s[i] != seqs[0][i] for s in seqs):
            return i
    return n


def common_suffix_len(seqs):
    n = min(len(s) for s in seqs)
    for i in range(1, n + 1):
        if any(s[-i] != seqs[0][-i] for s in seqs):
            return i - 1
    return n


def encode_with_bos(tokenizer, text):
    return [tokenizer.eot_token] + list(tokenizer.encode(text))


def answer_start(tokenizer, prompt, continuation):
    """[X18] first token of the gold continuation: common prefix of tokens(prompt) and tokens(prompt
    minus continuation); a token straddling the join counts as answer."""
    full = encode_with_bos(tokenizer, prompt)
    ctx = encode_with_bos(tokenizer, prompt[:len(prompt) - len(continuation)])
    return min(common_prefix_len([full, ctx]), len(full) - 1)


def build_example(item, task_type, delim, tokenizer, fewshot=(), max_len=None):
    """Render, tokenize and crop one item. Returns dict(tokens=[seq...], starts, ends, gold, answer_start,
    boundary_fixed) with the scored span of seq r being tokens[r][starts[r]:ends[r]]."""
    fixed = False
    if task_type == "multiple_choice":
        prompts = render_mc(item, delim, fewshot)
        tokens = [encode_with_bos(tokenizer, p) for p in prompts]
        s = common_prefix_len(tokens)
        starts, ends = [s] * len(tokens), [len(t) for t in tokens]
        gold = item["gold"]
        a = answer_start(tokenizer, prompts[gold], item["choices"][gold])
    elif task_type == "schema":
        prompts = render_schema(item, delim, fewshot)
        tokens = [encode_with_bos(tokenizer, p) for p in prompts]
        suffix = common_suffix_len(tokens)
        ends = [len(t) for t in tokens]
        starts = [e - suffix for e in ends]
        gold = item["gold"]
        a = answer_start(tokenizer, prompts[gold], item["continuation"])
    elif task_type == "language_modeling":
        without, with_ = render_lm(item, delim, fewshot)
        t_without, t_with = encode_with_bos(tokenizer, without), encode_with_bos(tokenizer, with_)
        s = len(t_without)
        if t_with[:s] != t_without:  # nanochat asserts here; a BPE merge across the join moved the boundary
            s, fixed = common_prefix_len([t_with, t_without]), True
        if s >= len(t_with):
            raise ValueError(f"continuation {item['continuation']!r} has no tokens of its own")
        tokens, starts, ends, gold, a = [t_with], [s], [len(t_with)], 0, s
    else:
        raise ValueError(f"unknown task type {task_type!r}; expected one of {TASK_TYPES}")
    if max_len is not None:  # crop from the left to the model's context, as nanochat does
        for r, t in enumerate(tokens):
            crop = len(t) - max_len
            if crop > 0:
                tokens[r], starts[r], ends[r] = t[crop:], starts[r] - crop, ends[r] - crop
                if r == gold:
                    a -= crop
        if min(starts) < 1 or a < 1:
            raise ValueError(f"the continuation does not fit in the model context of {max_len} tokens")
    return {"tokens": tokens, "starts": starts, "ends": ends, "gold": gold, "answer_start": a,
            "boundary_fixed": fixed}


# ----------------------------------------------------------------------------------------------
# scoring

def model_max_len(model):
    config = getattr(model, "config", None)
    for obj, name in ((config, "block_size"), (model, "max_seq_len"), (config, "sequence_len")):
        if obj is not None and getattr(obj, name, None):
            return int(getattr(obj, name))
    return None


def model_device(model):
    try:
        return next(model.parameters()).device
    except (StopIteration, AttributeError):
        return torch.device("cpu")


@torch.no_grad()
def forward_logits(model, idx):
    """Logits (B, T, V) in float32 from a model returning logits or (logits, loss)."""
    out = model(idx)
    logits = out[0] if isinstance(out, (tuple, list)) else out
    return logits.float()


@torch.no_grad()
def score_sequences(model, seqs, spans, pad_id, batch_tokens=16384, autocast_dtype=None):
    """Per sequence, the token losses and greedy hits for the targets at positions [lo, hi):
    losses[i][j] = -log p(seq[lo+j] | seq[:lo+j]). Sequences are length-sorted, right-padded with pad_id
    and batched up to batch_tokens tokens per forward. Returns (list of float32 losses, list of bool hits)."""
    device = model_device(model)
    order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i]))
    out_losses, out_hits = [None] * len(seqs), [None] * len(seqs)
    pos = 0
    while pos < len(order):
        width = len(seqs[order[pos]])
        rows = max(1, batch_tokens // max(width, 1))
        batch = order[pos:pos + rows]
        pos += len(batch)
        idx = torch.full((len(batch), width), pad_id, dtype=torch.long)
        for r, i in enumerate(batch):
            idx[r, :len(seqs[i])] = torch.tensor(seqs[i], dtype=torch.long)
        idx = idx.to(device)
        if autocast_dtype is not None and device.type == "cuda":
            with torch.autocast("cuda", dtype=autocast_dtype):
                logits = forward_logits(model, idx)
        else:
            logits = forward_logits(model, idx)
        for r, i in enumerate(batch):
            lo, hi = spans[i]
            pred_logits = logits[r, lo - 1:hi - 1]  # position p predicts token p+1
            targets = idx[r, lo:hi]
            losses = F.cross_entropy(pred_logits, targets, reduction="none")
            out_losses[i] = losses.cpu()
            out_hits[i] = (pred_logits.argmax(dim=-1) == targets).cpu()
    return out_losses, out_hits


def score_examples(model, examples, task_type, pad_id, batch_tokens=16384, autocast_dtype=None):
    """Score built examples -> list of dicts(correct, pred, answer_nll, mean_losses)."""
    seqs, spans, owner = [], [], []
    for e_i, ex in enumerate(examples):
        for r, t in enumerate(ex["tokens"]):
            lo = min(ex["starts"][r], ex["answer_start"]) if r == ex["gold"] else ex["starts"][r]
            seqs.append(t)
            spans.append((lo, ex["ends"][r]))
            owner.append((e_i, r))
    losses, hits = score_sequences(model, seqs, spans, pad_id, batch_tokens, autocast_dtype)
    per_seq = {key: (losses[i], hits[i], spans[i][0]) for i, key in enumerate(owner)}
    results = []
    for e_i, ex in enumerate(examples):
        gold = ex["gold"]
        mean_losses = []
        for r in range(len(ex["tokens"])):
            loss, _, lo = per_seq[(e_i, r)]
            span = loss[ex["starts"][r] - lo:]
            # nanochat: mean loss over the span; an empty span (degenerate choices) never wins
            mean_losses.append(span.mean().item() if span.numel() else float("inf"))
        g_loss, g_hits, g_lo = per_seq[(e_i, gold)]
        answer_nll = g_loss[ex["answer_start"] - g_lo:].mean().item()  # [X18] gold answer, per token
        if task_type == "language_modeling":
            pred = 0
            correct = bool(g_hits[ex["starts"][gold] - g_lo:].all())  # every greedy token exact
        else:
            pred = min(range(len(mean_losses)), key=lambda r: (mean_losses[r], r))  # first argmin
            correct = pred == gold
        results.append({"correct": correct, "pred": pred, "answer_nll": answer_nll, "mean_losses": mean_losses})
    return results


def centered_accuracy(accuracy, random_baseline_percent):
    """[X17] c = (a - b) / (1 - b), b the random baseline as a fraction."""
    b = 0.01 * random_baseline_percent
    return (accuracy - b) / (1.0 - b)


def evaluate_task(model, tokenizer, task, data, num_fewshot=None, fewshot_seed=FEWSHOT_SEED,
                  max_len=None, batch_tokens=16384, autocast_dtype=None):
    """Accuracy and mean answer NLL of one task on already subsampled data (few-shot drawn from data)."""
    k = task["num_fewshot"] if num_fewshot is None else num_fewshot
    max_len = model_max_len(model) if max_len is None else max_len
    examples = []
    for idx, item in enumerate(data):
        try:
            examples.append(build_example(item, task["icl_task_type"], task["continuation_delimiter"], tokenizer,
                                          sample_fewshot(data, idx, k, fewshot_seed), max_len))
        except ValueError as e:
            raise ValueError(f"task {task['label']!r} item {idx} (after shuffle): {e}") from None
    scored = score_examples(model, examples, task["icl_task_type"], tokenizer.eot_token, batch_tokens,
                            autocast_dtype)
    n = len(scored)
    return {"n": n, "accuracy": sum(r["correct"] for r in scored) / n,
            "answer_nll": sum(r["answer_nll"] for r in scored) / n,
            "boundary_fixed": sum(ex["boundary_fixed"] for ex in examples), "items": scored}


def _mean(xs):
    xs = list(xs)
    return sum(xs) / len(xs) if xs else float("nan")


def _std(xs):
    xs = list(xs)
    if len(xs) < 2:
        return 0.0
    mu = _mean(xs)
    return (sum((x - mu) ** 2 for x in xs) / len(xs)) ** 0.5


def core_summary(task_results, labels=None):
    """CORE = mean centered accuracy [X17]; CORE NLL = mean per-task answer NLL [X18]."""
    labels = list(task_results) if labels is None else labels
    return {"core": _mean(task_results[l]["centered"] for l in labels),
            "core_nll": _mean(task_results[l]["answer_nll"] for l in labels), "n_tasks": len(labels)}


def evaluate_core(model, tokenizer, bundle, max_per_task=-1, fewshot_seeds=(FEWSHOT_SEED,), labels=None,
                  num_fewshot=None, batch_tokens=16384, autocast_dtype=None, progress=True):
    """Evaluate every task of a bundle (a path or load_bundle's dict). With several few-shot seeds the task
    accuracy / NLL are seed means (zero-shot tasks do not depend on the seed and run once)."""
    bundle = load_bundle(bundle) if isinstance(bundle, str) else bundle
    seeds = [int(s) for s in fewshot_seeds]
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError(f"fewshot_seeds must be non-empty and distinct, got {fewshot_seeds}")
    tasks = bundle["tasks"] if labels is None else [t for t in bundle["tasks"] if t["label"] in set(labels)]
    if labels is not None and len(tasks) != len(set(labels)):
        missing = sorted(set(labels) - {t["label"] for t in tasks})
        raise ValueError(f"labels not in bundle: {missing}")
    was_training = getattr(model, "training", False)
    if hasattr(model, "eval"):
        model.eval()
    results = {}
    for task in tqdm(tasks, desc="CORE tasks", disable=not progress, file=sys.stderr):
        data = shuffle_and_cut(load_task_data(task), max_per_task)
        k = task["num_fewshot"] if num_fewshot is None else num_fewshot
        per_seed = []
        for seed in (seeds[:1] if k == 0 else seeds):
            r = evaluate_task(model, tokenizer, task, data, k, seed, batch_tokens=batch_tokens,
                              autocast_dtype=autocast_dtype)
            per_seed.append(r)
        accs = [r["accuracy"] for r in per_seed]
        nlls = [r["answer_nll"] for r in per_seed]
        acc = _mean(accs)
        results[task["label"]] = {
            "task_type": task["icl_task_type"], "num_fewshot": k, "n": per_seed[0]["n"],
            "accuracy": acc, "random_baseline": task["random_baseline"],
            "centered": centered_accuracy(acc, task["random_baseline"]),  # affine: centered of mean = mean of centered
            "answer_nll": _mean(nlls), "accuracy_std": _std(accs), "answer_nll_std": _std(nlls),
            "per_seed_accuracy": accs if k > 0 else accs * len(seeds),
            "boundary_fixed": per_seed[0]["boundary_fixed"]}
    if was_training and hasattr(model, "train"):
        model.train()
    out = {"bundle": bundle["dir"], "fingerprint": bundle["fingerprint"],
           "fingerprint_known": bundle["fingerprint_known"], "baseline_version": bundle["baseline_version"],
           "max_per_task": max_per_task, "fewshot_seeds": seeds, "tasks": results}
    out.update(core_summary(results))
    missing17 = [l for l in CORE17_LABELS if l not in results]
    if missing17:
        out.update({"core17": None, "core17_nll": None, "core17_missing": missing17})
    else:
        s17 = core_summary(results, CORE17_LABELS)
        out.update({"core17": s17["core"], "core17_nll": s17["core_nll"], "core17_missing": []})
    return out


def kshot_sweep(model, tokenizer, bundle, ks=KSHOT_SWEEP, labels=None, max_per_task=-1,
                fewshot_seed=FEWSHOT_SEED, batch_tokens=16384, autocast_dtype=None, progress=True):
    """[S ICL] accuracy / centered / answer NLL per task for every k; default tasks: those the bundle runs
    few-shot (num_fewshot > 0). Prompts longer than the context are cropped from the left."""
    bundle = load_bundle(bundle) if isinstance(bundle, str) else bundle
    if labels is None:
        labels = [t["label"] for t in bundle["tasks"] if t["num_fewshot"] > 0]
    by_label = {t["label"]: t for t in bundle["tasks"]}
    unknown = [l for l in labels if l not in by_label]
    if unknown:
        raise ValueError(f"kshot_sweep: labels not in bundle: {unknown}")
    if hasattr(model, "eval"):
        model.eval()
    per_task = {}
    for label in tqdm(labels, desc="k-shot sweep", disable=not progress, file=sys.stderr):
        task = by_label[label]
        data = shuffle_and_cut(load_task_data(task), max_per_task)
        per_task[label] = {}
        for k in ks:
            r = evaluate_task(model, tokenizer, task, data, k, fewshot_seed, batch_tokens=batch_tokens,
                              autocast_dtype=autocast_dtype)
            per_task[label][k] = {"accuracy": r["accuracy"], "answer_nll": r["answer_nll"],
                                  "centered": centered_accuracy(r["accuracy"], task["random_baseline"])}
    mean = {k: {m: _mean(per_task[l][k][m] for l in labels) for m in ("accuracy", "centered", "answer_nll")}
            for k in ks}
    return {"ks": list(ks), "tasks": per_task, "mean": mean}


# ----------------------------------------------------------------------------------------------
# per-document-length-bucket validation loss [S]

def load_token_split(data_dir, split="val"):
    """(tokens, meta, doc_spans) of a data/prepare.py folder: tokens a 1-D array, doc_spans [(start, end)]
    of each document's own tokens (the sidecar's spans minus their leading eot). Without data.prepare,
    reads {split}.bin with meta.json's dtype and finds documents between eot tokens."""
    try:
        from data.prepare import load_meta, load_sources, load_split
    except ImportError:
        load_meta = None
    if load_meta is not None:
        meta = load_meta(data_dir)
        tokens = load_split(data_dir, split)
        spans = load_sources(data_dir, split)
        return tokens, meta, [(int(s) + 1, int(e)) for s, e in spans[:, :2] if e - s > 1]
    meta_path = os.path.join(data_dir, "meta.json")
    bin_path = os.path.join(data_dir, f"{split}.bin")
    if not os.path.isfile(meta_path) or not os.path.isfile(bin_path):
        raise FileNotFoundError(f"{data_dir} needs meta.json and {split}.bin (run data/prepare.py first)")
    with open(meta_path, "r", encoding="utf-8") as f:
        meta = json.load(f)
    tokens = np.memmap(bin_path, dtype=np.dtype(meta.get("dtype", "uint16")), mode="r")
    return tokens, meta, split_documents(tokens, int(meta["eot_token"]))


def split_documents(tokens, eot):
    """Documents = maximal runs of non-eot tokens (eot separates documents and acts as BOS)."""
    tokens = np.asarray(tokens)
    cuts = np.flatnonzero(tokens == eot)
    bounds = np.concatenate([[-1], cuts, [len(tokens)]])
    return [(int(a) + 1, int(b)) for a, b in zip(bounds[:-1], bounds[1:]) if b - a > 1]


def bucket_of(n_tokens, bounds=LENGTH_BUCKETS):
    """Label of the smallest upper bound >= n_tokens, or '>last' for longer documents."""
    for b in bounds:
        if n_tokens <= b:
            return str(b)
    return f">{bounds[-1]}"


@torch.no_grad()
def length_bucket_loss(model, tokens, eot, block_size=None, bounds=LENGTH_BUCKETS, max_tokens=None,
                       doc_spans=None, batch_tokens=16384, pack=True, progress=True):
    """[S] mean next-token loss of documents grouped by their own token count. Each document is scored
    as [eot] + doc (eot = BOS), every doc token predicted from its document prefix only. Documents are
    packed into rows of block_size (the model's eot document mask keeps them apart; pack=False scores
    each alone); longer documents are scored in consecutive windows of block_size targets, each window
    starting a fresh context. Returns {bucket: {n_docs, n_tokens, loss (token-weighted), doc_mean_loss}}."""
    block_size = block_size or model_max_len(model)
    if not block_size:
        raise ValueError("length_bucket_loss needs block_size (model.config.block_size not found)")
    spans = split_documents(tokens, eot) if doc_spans is None else [(int(a), int(b)) for a, b in doc_spans]
    if max_tokens is not None:  # keep whole documents up to the token budget
        kept, total = [], 0
        for a, b in spans:
            if total >= max_tokens:
                break
            kept.append((a, b))
            total += b - a
        spans = kept
    # pieces: (doc id, input ids, target ids), one per window of <= block_size targets
    pieces = []
    for d, (a, b) in enumerate(spans):
        doc = [int(x) for x in tokens[a:b]]
        for w in range(0, len(doc), block_size):
            n = min(block_size, len(doc) - w)
            inputs = [eot] + doc[:n - 1] if w == 0 else doc[w - 1:w - 1 + n]
            pieces.append((d, inputs, doc[w:w + n], w > 0))
    rows, row, used = [], [], 0  # greedy packing in order
    for piece in pieces:
        # a continuation window has no leading eot, so it must open its row (nothing before it to attend to)
        if row and (not pack or piece[3] or used + len(piece[1]) > block_size):
            rows.append(row)
            row, used = [], 0
        row.append(piece)
        used += len(piece[1])
    if row:
        rows.append(row)
    device = model_device(model)
    if hasattr(model, "eval"):
        model.eval()
    doc_loss = np.zeros(len(spans))
    batch_rows = max(1, batch_tokens // block_size)
    for i in tqdm(range(0, len(rows), batch_rows), desc="length buckets", disable=not progress, file=sys.stderr):
        chunk = rows[i:i + batch_rows]
        width = max(sum(len(p[1]) for p in r) for r in chunk)
        idx = torch.full((len(chunk), width), eot, dtype=torch.long)
        tgt = torch.full((len(chunk), width), -1, dtype=torch.long)
        owner = np.full((len(chunk), width), -1)
        for r, row_pieces in enumerate(chunk):
            p0 = 0
            for d, inp, tg, _ in row_pieces:
                idx[r, p0:p0 + len(inp)] = torch.tensor(inp)
                tgt[r, p0:p0 + len(tg)] = torch.tensor(tg)
                owner[r, p0:p0 + len(tg)] = d
                p0 += len(inp)
        logits = forward_logits(model, idx.to(device))
        losses = F.cross_entropy(logits.reshape(-1, logits.size(-1)), tgt.to(device).reshape(-1),
                                 ignore_index=-1, reduction="none").view(tgt.shape).cpu().double().numpy()
        mask = owner >= 0
        np.add.at(doc_loss, owner[mask], losses[mask])
    out = {}
    labels = [str(b) for b in bounds] + [f">{bounds[-1]}"]
    for lab in labels:
        out[lab] = {"n_docs": 0, "n_tokens": 0, "loss_sum": 0.0, "doc_losses": []}
    for d, (a, b) in enumerate(spans):
        o = out[bucket_of(b - a, bounds)]
        o["n_docs"] += 1
        o["n_tokens"] += b - a
        o["loss_sum"] += doc_loss[d]
        o["doc_losses"].append(doc_loss[d] / (b - a))
    return {lab: {"n_docs": o["n_docs"], "n_tokens": o["n_tokens"],
                  "loss": o["loss_sum"] / o["n_tokens"] if o["n_tokens"] else None,
                  "doc_mean_loss": _mean(o["doc_losses"]) if o["doc_losses"] else None}
            for lab, o in out.items()}


# ----------------------------------------------------------------------------------------------
# CLI

TYPE_SHORT = {"multiple_choice": "MC", "schema": "schema", "language_modeling": "LM"}


def format_core_table(res):
    lines = [f"bundle      {res['bundle']}",
             f"fingerprint sha256 {res['fingerprint']} ({res['fingerprint_known'] or 'not a known public bundle'})",
             f"baselines   random-baseline version: {res['baseline_version']}",
             f"few-shot    seeds {res['fewshot_seeds']}, max_per_task {res['max_per_task']}",
             f"{'task':34s} {'type':6s} {'shots':>5s} {'n':>6s} {'accuracy':>9s} {'centered':>9s} {'answer_nll':>10s}"]
    for label, r in res["tasks"].items():
        lines.append(f"{label:34s} {TYPE_SHORT[r['task_type']]:6s} {r['num_fewshot']:5d} {r['n']:6d} "
                     f"{r['accuracy']:9.4f} {r['centered']:9.4f} {r['answer_nll']:10.4f}")
    lines.append(f"{'CORE (' + str(res['n_tasks']) + ' tasks) [X17]/[X18]':53s} {'':9s} {res['core']:9.4f} "
                 f"{res['core_nll']:10.4f}")
    if res["core17"] is None:
        lines.append(f"CORE-17 [X]: n/a (needs the 17 public task labels, {len(res['core17_missing'])} missing)")
    else:
        lines.append(f"{'CORE-17 [X Table 10]':53s} {'':9s} {res['core17']:9.4f} {res['core17_nll']:10.4f}")
    fixed = {l: r["boundary_fixed"] for l, r in res["tasks"].items() if r["boundary_fixed"]}
    if fixed:
        lines.append(f"note: LM items whose prompt-without tokens were not a prefix of prompt-with "
                     f"(span started at the common prefix; nanochat would assert): {fixed}")
    return "\n".join(lines)


def load_checkpoint(path, device="cpu"):
    """(model, tokenizer) from a train.py checkpoint."""
    from model import GPT  # imported here so the evaluation functions work with any model object
    from data.tokenizer import get_tokenizer
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint not found: {path}")
    model, ckpt = GPT.from_checkpoint(path, map_location=device)
    tokenizer = get_tokenizer(ckpt.get("tokenizer") or "gpt2-4096")
    if model.config.eot_token != tokenizer.eot_token or model.config.vocab_size < tokenizer.n_vocab:
        raise ValueError(f"{path}: model eot_token {model.config.eot_token} / vocab {model.config.vocab_size} do not "
                         f"match tokenizer {tokenizer.name!r} (eot {tokenizer.eot_token}, {tokenizer.n_vocab} tokens)")
    return model.to(device).eval(), tokenizer


def main(argv=None):
    p = argparse.ArgumentParser(description="DCLM CORE evaluation (nanochat-compatible), answer NLL, sweeps")
    p.add_argument("--ckpt", required=True, help="checkpoint written by train.py")
    p.add_argument("--bundle", help="eval bundle dir (core.yaml, eval_data/, eval_meta_data.csv)")
    p.add_argument("--max_per_task", type=int, default=-1, help="items per task after the 1337 shuffle (-1 all)")
    p.add_argument("--fewshot_seeds", default=str(FEWSHOT_SEED),
                   help="comma list; item idx draws with random.Random(seed + idx); '0,1,2' = [X] seeds")
    p.add_argument("--tasks", default=None, help="comma list of task labels (default: all in the bundle)")
    p.add_argument("--kshot_sweep", action="store_true", help=f"[S ICL] sweep k in {KSHOT_SWEEP}")
    p.add_argument("--kshot_tasks", default=None, help="comma list for the sweep (default: few-shot tasks)")
    p.add_argument("--length_buckets", metavar="DATA_DIR", default=None,
                   help="per-document-length-bucket val loss on a data/prepare.py output dir")
    p.add_argument("--length_split", default="val")
    p.add_argument("--length_max_tokens", type=int, default=1 << 20, help="token budget for --length_buckets")
    p.add_argument("--baselines", choices=["bundle", "v1", "2025-09-05"], default="bundle",
                   help="random baselines: the bundle's csv as is, or one published version for the 3 rows that changed")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch_tokens", type=int, default=16384, help="padded tokens per forward")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="autocast on CUDA")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--no_progress", action="store_true")
    args = p.parse_args(argv)
    if args.bundle is None and args.length_buckets is None:
        p.error("give --bundle (CORE) and/or --length_buckets DATA_DIR")
    model, tokenizer = load_checkpoint(args.ckpt, args.device)
    autocast_dtype = torch.bfloat16 if args.dtype == "bfloat16" else None
    progress = not args.no_progress
    report = {"ckpt": args.ckpt}
    if args.bundle:
        bundle = load_bundle(args.bundle)
        if args.baselines != "bundle":
            bundle = with_baseline_version(bundle, args.baselines)
        print(f"eval bundle {bundle['dir']} sha256 fingerprint {bundle['fingerprint']}", file=sys.stderr)
        labels = args.tasks.split(",") if args.tasks else None
        seeds = [int(s) for s in args.fewshot_seeds.split(",")]
        res = evaluate_core(model, tokenizer, bundle, args.max_per_task, seeds, labels,
                            batch_tokens=args.batch_tokens, autocast_dtype=autocast_dtype, progress=progress)
        report["core"] = res
        if not args.json:
            print(format_core_table(res))
        if args.kshot_sweep:
            ks_labels = args.kshot_tasks.split(",") if args.kshot_tasks else None
            sweep = kshot_sweep(model, tokenizer, bundle, KSHOT_SWEEP, ks_labels, args.max_per_task, seeds[0],
                                args.batch_tokens, autocast_dtype, progress)
            report["kshot"] = sweep
            if not args.json:
                print("\nk-shot sweep [S ICL]: accuracy per k")
                print(f"{'task':34s} " + " ".join(f"{'k=' + str(k):>7s}" for k in sweep["ks"]))
                for label, per_k in sweep["tasks"].items():
                    print(f"{label:34s} " + " ".join(f"{per_k[k]['accuracy']:7.4f}" for k in sweep["ks"]))
                print(f"{'mean centered':34s} " + " ".join(f"{sweep['mean'][k]['centered']:7.4f}" for k in sweep["ks"]))
    elif args.kshot_sweep:
        p.error("--kshot_sweep needs --bundle")
    if args.length_buckets:
        tokens, meta, doc_spans = load_token_split(args.length_buckets, args.length_split)
        eot = int(meta["eot_token"])
        if eot != tokenizer.eot_token or meta.get("tokenizer", tokenizer.name) != tokenizer.name:
            raise ValueError(f"{args.length_buckets} was prepared with tokenizer {meta.get('tokenizer')!r} "
                             f"(eot {eot}) but the checkpoint uses {tokenizer.name!r} (eot {tokenizer.eot_token})")
        buckets = length_bucket_loss(model, tokens, eot, max_tokens=args.length_max_tokens, doc_spans=doc_spans,
                                     batch_tokens=args.batch_tokens, progress=progress)
        report["length_buckets"] = buckets
        if not args.json:
            print(f"\nper-document-length-bucket {args.length_split} loss [S] ({args.length_buckets})")
            print(f"{'bucket':>8s} {'docs':>7s} {'tokens':>9s} {'loss':>8s}")
            for lab, b in buckets.items():
                loss = f"{b['loss']:8.4f}" if b["loss"] is not None else f"{'-':>8s}"
                print(f"{'<=' + lab if lab[0] != '>' else lab:>8s} {b['n_docs']:7d} {b['n_tokens']:9d} {loss}")
    if args.json:
        for r in report.get("core", {}).get("tasks", {}).values():
            r.pop("items", None)
        print(json.dumps(report, default=str))
    return report


if __name__ == "__main__":
    main()
