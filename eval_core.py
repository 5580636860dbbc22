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

Semantics follow nanochat's scorer (nanochat/core_eval.py, scripts/base_eval.py):
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
  LM s = len(tokens(without)). A sequence longer than the model context loses its first tokens (each
  sequence its own excess) and its span shifts down with it.
- one forward; loss at position p predicts token p+1, so the span's losses are [s-1, e-1).
  MC/schema: the pick is nanochat's mean_losses.index(min(mean_losses)) over the options' mean span
  losses, i.e. the first of the lowest; an empty span (an option whose tokens are a prefix of another
  option's, or a span the crop shifted to start at 0) has mean nan, which wins when it is the first
  option and never wins anywhere else. LM: correct if every greedy prediction in the span equals the
  reference token.
Answer NLL [X18]: mean loss of the gold continuation given the gold prompt, where (as the [X] code does)
the continuation starts at the common token prefix of tokens(prompt) and tokens(prompt minus continuation);
for LM tasks it is the scored span. If the crop cut into the gold answer, the NLL covers what is left of
it (from position 1) and the item is counted as answer_cropped.

Differences from nanochat (deliberate; each is tested):
- batching: items of one task are batched together (length-sorted, right-padded with eot) instead of one
  item per forward. A causal model gives the same losses up to float rounding, so only options within
  rounding of a tie can be picked differently.
- cropping: nanochat crops only models that declare max_seq_len (its former HuggingFace GPT-2 wrapper);
  its own GPT declares none and reads prompts past its training length. Our GPT cannot read past
  block_size, so every model is cropped the way nanochat crops those models. Where nanochat's crop
  asserts (a span shifted below 0) or its LM comparison fails on the shapes (an LM span shifted to 0),
  we stop with an error naming the task and item.
- few-shot pool smaller than k (e.g. --max_per_task 5 on a 10-shot task): nanochat's random.sample
  raises ValueError and the run stops; we use all n-1 other items, in that rng's sample order, and
  report fewshot_used.
- LM: if tokens(without) is not a prefix of tokens(with) (a BPE merge across the join), nanochat asserts;
  we start the span at the common prefix and count such items ("boundary_fixed" in the report).
- fewshot_seeds: item idx of seed s draws with random.Random(s + idx), as the [X] code passes its seeds;
  the default 1234 reproduces nanochat; "--fewshot_seeds 0,1,2" are [X]'s seeds 0/1/2, averaged (task
  accuracy and NLL are seed means; zero-shot tasks run once).
- malformed bundles stop with an error naming file and line where nanochat crashes or renders garbage:
  a null continuation_delimiter is rejected (nanochat renders "None"), blank jsonl lines are skipped
  (nanochat's json.loads fails on them). One case nanochat does score: an MC item whose gold choice is
  the empty string is rejected, since its answer NLL would be undefined.
"""

import collections.abc
import csv
import hashlib
import json
import math
import os
import random
import sys

import numpy as np
import torch
import torch.nn.functional as F
import yaml
from tqdm import tqdm

from tooling import common
from tooling.common import cli_error, number, read_jsonl, resolve_device

PROG = "eval_core.py"  # the name CLI errors start with

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
    """The k few-shot examples of item idx: random.Random(seed + idx).sample(other indices, k). With fewer
    than k other items we take all of them (in that rng's order) where nanochat's sample raises ValueError;
    evaluate_task reports the number used."""
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
    boundary_fixed, answer_cropped) with the scored span of seq r being tokens[r][starts[r]:ends[r]]; a span
    starting at 0 (cut exactly there by the crop) has no scorable token, as in nanochat."""
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
    answer_cropped = False
    if max_len is not None:  # crop each sequence from the left to the model's context, as nanochat does
        if max_len < 2:
            raise ValueError(f"a model context of {max_len} tokens cannot score anything")
        for r, t in enumerate(tokens):
            crop = len(t) - max_len
            if crop > 0:
                tokens[r], starts[r], ends[r] = t[crop:], starts[r] - crop, ends[r] - crop
                if r == gold:
                    a -= crop
        # nanochat asserts start >= 0. At start 0 its MC/schema slice losses[-1:e-1] is empty (mean nan;
        # score_examples does the same); its LM comparison fails on the shapes there, so LM needs start >= 1.
        if min(starts) < (1 if task_type == "language_modeling" else 0):
            raise ValueError(f"the continuation does not fit in the model context of {max_len} tokens "
                             "(nanochat's crop would assert)")
        if a < 1:  # [X18] the crop cut into the gold answer: its NLL covers what is left (position 0 has no loss)
            a, answer_cropped = 1, True
    return {"tokens": tokens, "starts": starts, "ends": ends, "gold": gold, "answer_start": a,
            "boundary_fixed": fixed, "answer_cropped": answer_cropped}


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
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            logits = forward_logits(model, idx)  # float32 whatever the forward ran in
        for r, i in enumerate(batch):
            lo, hi = spans[i]
            pred_logits = logits[r, lo - 1:hi - 1]  # position p predicts token p+1
            targets = idx[r, lo:hi]
            losses = F.cross_entropy(pred_logits, targets, reduction="none")
            out_losses[i] = losses.cpu()
            out_hits[i] = (pred_logits.argmax(dim=-1) == targets).cpu()
    return out_losses, out_hits


def nanochat_choice(mean_losses):
    """The option nanochat picks, mean_losses.index(min(mean_losses)), spelled out: Python's min keeps
    its running best unless a later value is smaller, and nan (an empty span) compares False both ways,
    so a nan first option wins, a nan elsewhere never wins, otherwise the first of the lowest wins."""
    best = 0
    for r, loss in enumerate(mean_losses):
        if loss < mean_losses[best]:
            best = r
    return best


def score_examples(model, examples, task_type, pad_id, batch_tokens=16384, autocast_dtype=None):
    """Score built examples -> list of dicts(correct, pred, answer_nll, mean_losses)."""
    seqs, spans, owner = [], [], []
    for e_i, ex in enumerate(examples):
        for r, t in enumerate(ex["tokens"]):
            lo = max(ex["starts"][r], 1)  # position 0 has no prediction (a span cut to start there is empty)
            if r == ex["gold"]:
                lo = min(lo, ex["answer_start"])
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
            start = ex["starts"][r]
            span = loss[start - lo:] if start >= 1 else loss[:0]
            # nanochat: mean loss over the span; an empty span's mean is nan (see nanochat_choice)
            mean_losses.append(span.mean().item() if span.numel() else float("nan"))
        g_loss, g_hits, g_lo = per_seq[(e_i, gold)]
        answer_nll = g_loss[ex["answer_start"] - g_lo:].mean().item()  # [X18] gold answer, per token
        if task_type == "language_modeling":
            pred = 0
            correct = bool(g_hits[ex["starts"][gold] - g_lo:].all())  # every greedy token exact
        else:
            pred = nanochat_choice(mean_losses)
            correct = pred == gold
        results.append({"correct": correct, "pred": pred, "answer_nll": answer_nll, "mean_losses": mean_losses})
    return results


def centered_accuracy(accuracy, random_baseline_percent):
    """[X17] c = (a - b) / (1 - b), b the random baseline as a fraction."""
    b = 0.01 * random_baseline_percent
    return (accuracy - b) / (1.0 - b)


def evaluate_task(model, tokenizer, task, data, num_fewshot=None, fewshot_seed=FEWSHOT_SEED,
                  max_len=None, batch_tokens=16384, autocast_dtype=None):
    """Accuracy and mean answer NLL of one task on already subsampled data (few-shot drawn from data).
    Also counts what differs from a plain run: fewshot_used (k, or all n-1 other items when fewer),
    boundary_fixed (LM items whose span starts at the common prefix) and answer_cropped (items whose
    answer NLL lost tokens to the crop)."""
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
            "answer_nll": sum(r["answer_nll"] for r in scored) / n, "fewshot_used": min(k, n - 1),
            "boundary_fixed": sum(ex["boundary_fixed"] for ex in examples),
            "answer_cropped": sum(ex["answer_cropped"] for ex in examples), "items": scored}


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
            "per_seed_accuracy": accs if k > 0 else accs * len(seeds), "fewshot_used": per_seed[0]["fewshot_used"],
            # item counts depend on the few-shot draw: report the largest over the seeds
            "boundary_fixed": max(r["boundary_fixed"] for r in per_seed),
            "answer_cropped": max(r["answer_cropped"] for r in per_seed)}
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
                                  "centered": centered_accuracy(r["accuracy"], task["random_baseline"]),
                                  "fewshot_used": r["fewshot_used"]}
    mean = {k: {m: _mean(per_task[l][k][m] for l in labels) for m in ("accuracy", "centered", "answer_nll")}
            for k in ks}
    return {"ks": list(ks), "tasks": per_task, "mean": mean}


# ----------------------------------------------------------------------------------------------
# per-document-length-bucket validation loss [S]

def load_token_split(data_dir, split="val"):
    """(tokens, meta, doc_spans) of a data/prepare.py folder: tokens a 1-D array, doc_spans [(start, end)]
    of each document's own tokens (the sidecar's spans minus their leading eot). Without data.prepare,
    reads the split's shards listed in meta.json and finds documents between eot tokens."""
    try:
        from data.prepare import load_meta, load_sources, load_split
    except ImportError:
        load_meta = None
    if load_meta is not None:
        meta = load_meta(data_dir)
        tokens = load_split(data_dir, split, meta)
        spans = load_sources(data_dir, split, meta)
        return tokens, meta, [(int(s) + 1, int(e)) for s, e in spans[:, :2] if e - s > 1]
    meta_path = os.path.join(data_dir, "meta.json")
    if not os.path.isfile(meta_path):
        raise FileNotFoundError(f"{meta_path} not found (run data/prepare.py first)")
    with open(meta_path, "r", encoding="utf-8") as f:
        meta = json.load(f)
    paths = [os.path.join(data_dir, shard["file"]) for shard in meta["shards"][split]]  # its shards, in order
    tokens = np.concatenate([np.fromfile(p, dtype=np.dtype(meta["dtype"])) for p in paths])
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
    short = {l: f"{r['fewshot_used']} of {r['num_fewshot']}" for l, r in res["tasks"].items()
             if r["fewshot_used"] < r["num_fewshot"]}
    if short:
        lines.append(f"note: tasks with fewer other items than shots used all of them (nanochat's sample would "
                     f"raise): {short}")
    cropped = {l: r["answer_cropped"] for l, r in res["tasks"].items() if r["answer_cropped"]}
    if cropped:
        lines.append(f"note: items whose answer NLL lost tokens to the crop to the model context: {cropped}")
    return "\n".join(lines)


def load_checkpoint(path, device="cpu"):
    """(model on device in eval mode, tokenizer) from a train.py checkpoint."""
    from tooling.checkpoint import load_model  # imported here: the evaluation functions work with any model
    from data.tokenizer import get_tokenizer
    model, ckpt = load_model(path, map_location="cpu")  # clear ValueErrors for bad files
    tokenizer = get_tokenizer(ckpt.get("tokenizer") or "gpt2-4096")
    if model.config.eot_token != tokenizer.eot_token or model.config.vocab_size < tokenizer.n_vocab:
        raise ValueError(f"{path}: model eot_token {model.config.eot_token} / vocab {model.config.vocab_size} do not "
                         f"match tokenizer {tokenizer.name!r} (eot {tokenizer.eot_token}, {tokenizer.n_vocab} tokens)")
    return model.to(device).eval(), tokenizer


def parse_seeds(text):
    """--fewshot_seeds '0,1,2' -> [0, 1, 2]."""
    try:
        seeds = [int(s) for s in text.split(",")]
    except ValueError:
        raise ValueError(f"--fewshot_seeds must be distinct integers separated by commas like 0,1,2, "
                         f"got {text!r}") from None
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"--fewshot_seeds must be distinct, got {text!r}")
    return seeds


def check_labels(bundle, labels, flag):
    unknown = [label for label in labels or () if label not in {t["label"] for t in bundle["tasks"]}]
    if unknown:
        raise ValueError(f"{flag}: labels not in {os.path.join(bundle['dir'], 'core.yaml')}: {unknown}")


def print_kshot_table(sweep):
    print("\nk-shot sweep [S ICL]: accuracy per k")
    print(f"{'task':34s} " + " ".join(f"{'k=' + str(k):>7s}" for k in sweep["ks"]))
    for label, per_k in sweep["tasks"].items():
        print(f"{label:34s} " + " ".join(f"{per_k[k]['accuracy']:7.4f}" for k in sweep["ks"]))
    print(f"{'mean centered':34s} " + " ".join(f"{sweep['mean'][k]['centered']:7.4f}" for k in sweep["ks"]))
    short = {f"{label} k={k}": per_k[k]["fewshot_used"] for label, per_k in sweep["tasks"].items()
             for k in sweep["ks"] if per_k[k]["fewshot_used"] < k}
    if short:
        print(f"note: shots used where a task has fewer other items than k (nanochat's sample would raise): {short}")


def print_length_table(buckets, split, data_dir):
    print(f"\nper-document-length-bucket {split} loss [S] ({data_dir})")
    print(f"{'bucket':>8s} {'docs':>7s} {'tokens':>9s} {'loss':>8s}")
    for lab, b in buckets.items():
        loss = f"{b['loss']:8.4f}" if b["loss"] is not None else f"{'-':>8s}"
        print(f"{'<=' + lab if lab[0] != '>' else lab:>8s} {b['n_docs']:7d} {b['n_tokens']:9d} {loss}")


def run(args):
    """The CLI's work -> report dict. Arguments, the bundle's files and the length-bucket data are checked
    before the model is loaded, so most mistakes cost no evaluation time (a task's items are checked when
    the task is read). Mistakes raise ValueError or OSError."""
    if args.bundle is None and args.length_buckets is None:
        raise ValueError("give --bundle (CORE) and/or --length_buckets DATA_DIR")
    if args.kshot_sweep and args.bundle is None:
        raise ValueError("--kshot_sweep needs --bundle")
    seeds = parse_seeds(args.fewshot_seeds)
    device = resolve_device(args.device)
    bundle = labels = ks_labels = length_data = None
    if args.bundle:
        bundle = load_bundle(args.bundle)
        if args.baselines != "bundle":
            bundle = with_baseline_version(bundle, args.baselines)
        labels = args.tasks.split(",") if args.tasks else None
        ks_labels = args.kshot_tasks.split(",") if args.kshot_tasks else None
        check_labels(bundle, labels, "--tasks")
        check_labels(bundle, ks_labels, "--kshot_tasks")
    if args.length_buckets:
        length_data = load_token_split(args.length_buckets, args.length_split)  # (tokens, meta, doc_spans)
    model, tokenizer = load_checkpoint(args.ckpt, device)
    if length_data is not None:
        meta = length_data[1]
        eot, prepared_with = int(meta["eot_token"]), meta.get("tokenizer", tokenizer.name)
        if eot != tokenizer.eot_token or prepared_with != tokenizer.name:
            raise ValueError(f"{args.length_buckets} was prepared with tokenizer {prepared_with!r} (eot {eot}) "
                             f"but the checkpoint uses {tokenizer.name!r} (eot {tokenizer.eot_token})")
    # bf16 autocast on CUDA only: a CPU has no fast bf16 (the CPU rehearsal of that path is in the tests)
    autocast_dtype = torch.bfloat16 if args.dtype == "bfloat16" and device.type == "cuda" else None
    progress = not args.no_progress
    report = {"ckpt": args.ckpt}
    if bundle is not None:
        print(f"eval bundle {bundle['dir']} sha256 fingerprint {bundle['fingerprint']}", file=sys.stderr)
        report["core"] = evaluate_core(model, tokenizer, bundle, args.max_per_task, seeds, labels,
                                       batch_tokens=args.batch_tokens, autocast_dtype=autocast_dtype,
                                       progress=progress)
        if not args.json:
            print(format_core_table(report["core"]))
        if args.kshot_sweep:
            report["kshot"] = kshot_sweep(model, tokenizer, bundle, KSHOT_SWEEP, ks_labels, args.max_per_task,
                                          seeds[0], args.batch_tokens, autocast_dtype, progress)
            if not args.json:
                print_kshot_table(report["kshot"])
    if length_data is not None:
        tokens, meta, doc_spans = length_data
        report["length_buckets"] = length_bucket_loss(model, tokens, int(meta["eot_token"]),
                                                      max_tokens=args.length_max_tokens, doc_spans=doc_spans,
                                                      batch_tokens=args.batch_tokens, progress=progress)
        if not args.json:
            print_length_table(report["length_buckets"], args.length_split, args.length_buckets)
    if args.json:
        for r in report.get("core", {}).get("tasks", {}).values():
            r.pop("items", None)
        print(json.dumps(report, default=str))
    return report


def main(argv=None):
    p = common.parser(PROG, description="DCLM CORE evaluation (nanochat-compatible), answer NLL, sweeps")
    p.add_argument("--ckpt", required=True, help="checkpoint written by train.py (required)")
    p.add_argument("--bundle",
                   help="eval bundle dir (core.yaml, eval_data/, eval_meta_data.csv) (default: none, no CORE)")
    p.add_argument("--max_per_task", type=number(int, -1), default=-1,
                   help="items per task after the 1337 shuffle, -1 for all (default: %(default)s)")
    p.add_argument("--fewshot_seeds", default=str(FEWSHOT_SEED),
                   help="comma list; item idx draws with random.Random(seed + idx); '0,1,2' = [X] seeds "
                        "(default: %(default)s, nanochat's)")
    p.add_argument("--tasks", default=None, help="comma list of task labels (default: all in the bundle)")
    p.add_argument("--kshot_sweep", action="store_true", help=f"[S ICL] sweep k in {KSHOT_SWEEP} (default: off)")
    p.add_argument("--kshot_tasks", default=None, help="comma list for the sweep (default: few-shot tasks)")
    p.add_argument("--length_buckets", metavar="DATA_DIR", default=None,
                   help="per-document-length-bucket val loss on a data/prepare.py output dir (default: none)")
    p.add_argument("--length_split", default="val", choices=["train", "val"],
                   help="the split of --length_buckets' data to measure (default: %(default)s)")
    p.add_argument("--length_max_tokens", type=number(int, 1), default=1 << 20,
                   help="token budget for --length_buckets, in whole documents (default: %(default)s)")
    p.add_argument("--baselines", choices=["bundle", "v1", "2025-09-05"], default="bundle",
                   help="random baselines: the bundle's csv as is, or one published version for the 3 rows that "
                        "changed (default: %(default)s)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="torch device to evaluate on, e.g. cpu, cuda, cuda:1 (default: cuda when available, else cpu)")
    p.add_argument("--batch_tokens", type=number(int, 1), default=16384,
                   help="padded tokens per forward (default: %(default)s)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="autocast on CUDA (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables (default: tables)")
    p.add_argument("--no_progress", action="store_true", help="no tqdm progress bars (default: bars on stderr)")
    args = p.parse_args(argv)
    try:
        run(args)
    except (OSError, ValueError) as e:  # a user mistake (missing file, bad value): one line, exit status 2
        return cli_error(PROG, e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
