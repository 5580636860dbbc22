"""
DCLM CORE evaluation, compatible with the public eval bundle that nanochat uses (its layout and reading:
tooling/core_bundle.py; the parser and the tables printed: tooling/core_report.py), plus the extra
measurements of the two papers: answer NLL [X18], the frozen 17-task subset [X Table 10], few-shot
seeds, k-shot sweeps [S ICL] and per-document-length-bucket validation loss [S].

    python eval_core.py --ckpt out/ckpt.pt --bundle tests/data/core_bundle
    python eval_core.py --ckpt out/ckpt.pt --bundle ~/eval_bundle --max_per_task 500 --json
    python eval_core.py --ckpt out/ckpt.pt --bundle ~/eval_bundle --fewshot_seeds 0,1,2
    python eval_core.py --ckpt out/ckpt.pt --bundle ~/eval_bundle --kshot_sweep
    python eval_core.py --ckpt out/ckpt.pt --length_buckets data/cache/default   # no --bundle needed

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
import json
import os
import random
import sys

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from tooling.common import cli_error, resolve_device
from tooling.core_bundle import TASK_TYPES, check_labels, load_bundle, load_task_data, with_baseline_version
from tooling.core_report import build_parser, format_core_table, parse_seeds, print_kshot_table, print_length_table

PROG = "eval_core.py"  # the name CLI errors start with

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
    of each document's own tokens (the sidecar's spans minus their leading eot). Without data.shards,
    reads the split's shards listed in meta.json and finds documents between eot tokens."""
    try:
        from data.shards import load_meta, load_sources, load_split
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

def load_model_and_tokenizer(path, device="cpu"):
    """(model on device in eval mode, tokenizer) from a train.py checkpoint."""
    from tooling.checkpoint import load_model  # imported here: the evaluation functions work with any model
    from data.tokenizer import get_tokenizer
    model, ckpt = load_model(path, map_location="cpu")  # clear ValueErrors for bad files
    tokenizer = get_tokenizer(ckpt.get("tokenizer") or "gpt2-4096")
    if model.config.eot_token != tokenizer.eot_token or model.config.vocab_size < tokenizer.n_vocab:
        raise ValueError(f"{path}: model eot_token {model.config.eot_token} / vocab {model.config.vocab_size} do not "
                         f"match tokenizer {tokenizer.name!r} (eot {tokenizer.eot_token}, {tokenizer.n_vocab} tokens)")
    return model.to(device).eval(), tokenizer


def run(args):
    """The CLI's work -> report dict. Arguments, the bundle's files and the length-bucket data are checked
    before the model is loaded, so most mistakes cost no evaluation time (a task's items are checked when
    the task is read). Mistakes raise ValueError or OSError."""
    if args.bundle is None and args.length_buckets is None:
        raise ValueError("give --bundle (CORE) and/or --length_buckets DATA_DIR")
    if args.kshot_sweep and args.bundle is None:
        raise ValueError("--kshot_sweep needs --bundle")
    seeds = parse_seeds(args.fewshot_seeds)  # one line naming the flag for a bad list
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
    model, tokenizer = load_model_and_tokenizer(args.ckpt, device)
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
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    p = build_parser(PROG, FEWSHOT_SEED, KSHOT_SWEEP, default_device)
    args = p.parse_args(argv)
    try:
        run(args)
    except (OSError, ValueError) as e:  # a user mistake (missing file, bad value): one line, exit status 2
        return cli_error(PROG, e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
