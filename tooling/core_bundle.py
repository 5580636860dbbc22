"""
Reading a DCLM CORE eval bundle (the public layout nanochat uses; nothing is ever downloaded): core.yaml's
task list, each task's eval_data/*.jsonl items, eval_meta_data.csv's random baselines (and which published
version they are), and the bundle's fingerprint. Every mistake in a bundle is one ValueError or
FileNotFoundError naming the file and the line, raised before any model is run. It is tooling, not part
of eval_core.py, because it is file formats and validation, not an idea of either paper: eval_core.py
(the scoring, verified item for item against nanochat's scorer) imports it, and by the layout rule it
imports nothing of the project but tooling (it needs no torch).

    bundle = load_bundle("tests/data/core_bundle")   # {dir, tasks, random_baselines, fingerprint, ...}
    items = load_task_data(bundle["tasks"][0])       # that task's items, each checked

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
"""

import csv
import hashlib
import math
import os

import yaml

from tooling.common import read_jsonl

TASK_TYPES = ("multiple_choice", "schema", "language_modeling")
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
# core.yaml

TASK_KEYS = ("label", "dataset_uri", "num_fewshot", "icl_task_type")  # required in every icl_tasks entry


def read_core_yaml(path):
    """Read and validate core.yaml -> list of task dicts {label, dataset_uri, num_fewshot (int),
    icl_task_type, continuation_delimiter, line}. Errors name the file and the line of the task entry."""
    try:
        with open(path, "r", encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not valid UTF-8 ({e})") from None
    try:
        doc = yaml.safe_load(text)
        root = yaml.compose(text, Loader=yaml.SafeLoader)  # the same document as nodes, which know their lines
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else path
        context = getattr(e, "context", None)
        raise ValueError(f"{where}: malformed YAML: {context + ', ' if context else ''}"
                         f"{getattr(e, 'problem', None) or e}") from None
    if not isinstance(doc, dict) or "icl_tasks" not in doc:
        raise ValueError(f"{path}: missing top-level key 'icl_tasks'")
    if not isinstance(doc["icl_tasks"], list) or not doc["icl_tasks"]:
        raise ValueError(f"{path}: 'icl_tasks' must be a non-empty list of task mappings")
    tasks_node = [value for key, value in root.value if key.value == "icl_tasks"][-1]  # the last wins, as in safe_load
    tasks, first_line_of = [], {}
    for i, (raw, node) in enumerate(zip(doc["icl_tasks"], tasks_node.value), start=1):
        line = node.start_mark.line + 1
        entry = f"{path}:{line}: icl_tasks entry {i}"
        if not isinstance(raw, dict):
            raise ValueError(f"{entry} is not a mapping of task keys: {raw!r}")
        if isinstance(raw.get("label"), str):
            entry += f" ({raw['label']!r})"
        for key in TASK_KEYS:
            if raw.get(key) is None:
                raise ValueError(f"{entry} is missing required key {key!r}")
        label, uri, shots, task_type = (raw[key] for key in TASK_KEYS)
        delim = raw.get("continuation_delimiter", " ")  # nanochat's default
        for key, value in (("label", label), ("dataset_uri", uri)):
            if not isinstance(value, str) or not value:
                raise ValueError(f"{entry}: {key} must be a non-empty string, got {value!r}")
        if label in first_line_of:
            raise ValueError(f"{entry}: duplicate task label (first at line {first_line_of[label]})")
        first_line_of[label] = line
        if not isinstance(shots, list) or not shots or not all(
                isinstance(k, int) and not isinstance(k, bool) and k >= 0 for k in shots):
            raise ValueError(f"{entry}: num_fewshot must be a list like [10] of non-negative ints, got {shots!r}")
        if task_type not in TASK_TYPES:
            raise ValueError(f"{entry}: unknown icl_task_type {task_type!r}; expected one of {TASK_TYPES}")
        if not isinstance(delim, str):  # a null here would render as "None" in nanochat's template
            raise ValueError(f"{entry}: continuation_delimiter must be a string (omit it for the default ' '), "
                             f"got {delim!r}")
        tasks.append({"label": label, "dataset_uri": uri,
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
        try:
            return _read_random_baselines(csv.DictReader(f), path)
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}: not valid UTF-8 ({e})") from None
        except csv.Error as e:
            raise ValueError(f"{path}: malformed CSV ({e})") from None


def _read_random_baselines(reader, path):
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
    if not os.path.isdir(os.path.join(bundle_dir, "eval_data")):
        raise FileNotFoundError(f"eval bundle is missing the folder {os.path.join(bundle_dir, 'eval_data')}")
    tasks = read_core_yaml(yaml_path)
    baselines = read_random_baselines(csv_path)
    for task in tasks:
        if task["label"] not in baselines:
            raise ValueError(f"{yaml_path}:{task['line']}: task {task['label']!r} has no row in {csv_path}")
        task["random_baseline"] = baselines[task["label"]]
        eval_data = os.path.realpath(os.path.join(bundle_dir, "eval_data"))
        data_path = os.path.realpath(os.path.join(eval_data, task["dataset_uri"]))
        if os.path.isabs(task["dataset_uri"]) or os.path.commonpath([eval_data, data_path]) != eval_data:
            raise ValueError(f"{yaml_path}:{task['line']}: dataset_uri of {task['label']!r} is "
                             f"{task['dataset_uri']!r}, outside the bundle's eval_data/: refused (a bundle reads "
                             "only its own files)")
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
    # an empty wrong choice is fine (an empty span, scored as nanochat does); an empty gold choice has no
    # answer to take the NLL of
    if task_type == "multiple_choice":
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
    for lineno, item in read_jsonl(task["path"]):
        _check_item(item, task["icl_task_type"], task["path"], lineno)
        items.append(item)
    if not items:
        raise ValueError(f"{task['path']}: no items")
    return items


def check_labels(bundle, labels, flag):
    unknown = [label for label in labels or () if label not in {t["label"] for t in bundle["tasks"]}]
    if unknown:
        raise ValueError(f"{flag}: labels not in {os.path.join(bundle['dir'], 'core.yaml')}: {unknown}")
