"""
DCLM CORE as nanochat scores it [X17], answer NLL [X18], k-shot sweeps [S ICL],
and the validation loss by document length [S].

    python eval_core.py --ckpt CKPT --bundle tests/data/core_bundle   # the self-made toy bundle
    python eval_core.py --ckpt CKPT --bundle ~/eval_bundle --fewshot_seeds 0,1,2  # [X]'s seeds
    python eval_core.py --ckpt CKPT --bundle ~/eval_bundle --kshot_sweep --json   # k = 0 to 32
    python eval_core.py --ckpt CKPT --length_buckets   # the run's val loss by document length

The bundle is an unzipped DCLM/nanochat eval bundle; nothing is downloaded (nanochat's
carries DCLM's v1 baselines). Scoring is nanochat's core_eval.py, checked item by item in
tests; where it would raise or assert (too few items for the shots, a crop into the answer,
a BPE merge across the prompt/answer join) we go on and count it, or stop with one line.
"""
import argparse
import csv
import hashlib
import json
import os
import random
import sys

import numpy as np
import torch
import torch.nn.functional as F
import yaml
from tqdm import tqdm

from data.loader import get_tokenizer, load_data
from model import load_checkpoint

# nanochat's seeds for the item shuffle and the few-shot draw.
SHUFFLE_SEED, FEWSHOT_SEED = 1337, 1234
KSHOT_SWEEP = (0, 1, 2, 4, 8, 16, 32)  # [S ICL]
# [S] Upper bounds of the length buckets, in tokens.
LENGTH_BUCKETS = (32, 64, 128, 256, 512, 1024, 2048, 4096)
# [X Table 10]'s frozen subset of nanochat's 22 tasks.
CORE17_LABELS = (
    "hellaswag_zeroshot", "jeopardy", "bigbench_qa_wikidata", "arc_easy",
    "arc_challenge", "copa", "piqa", "openbook_qa", "lambada_openai",
    "hellaswag", "winograd", "winogrande", "bigbench_dyck_languages",
    "agi_eval_lsat_ar", "bigbench_operators", "squad", "coqa",
)
# DCLM's random baselines (percent) changed on 2025-09-05: (v1,
# new).
BASELINE_CHANGES = {
    "commonsense_qa": (20.0, 40.3),
    "agi_eval_lsat_ar": (20.0, 25.0),
    "bigbench_language_identification": (9.1, 25.0),
}
KNOWN_FINGERPRINTS = {
    "e908e4e0e145860290d46fb37c5d1bad52bbf22da843073ff0e6b6f624250e52":
    "karpathy's eval_bundle.zip, as the [X] code pins it"
}


# -------------------- The bundle


def load_bundle(bundle_dir, baselines="bundle"):
    # core.yaml's tasks, with random baselines (percent) from the
    # bundle or a published table.
    try:
        with open(os.path.join(bundle_dir, "core.yaml")) as f:
            entries = yaml.safe_load(f)["icl_tasks"]
        with open(os.path.join(bundle_dir, "eval_meta_data.csv"), newline="") as f:
            rows = csv.DictReader(f)
            random_baseline = {r["Eval Task"]: float(r["Random baseline"]) for r in rows}
        tasks = [dict(label=t["label"], icl_task_type=t["icl_task_type"],
                      num_fewshot=t["num_fewshot"][0],
                      continuation_delimiter=t.get("continuation_delimiter", " "),
                      random_baseline=random_baseline[t["label"]],
                      path=os.path.join(bundle_dir, "eval_data", t["dataset_uri"]))
                 for t in entries]
    except (KeyError, TypeError, ValueError, yaml.YAMLError) as e:
        reason = " ".join(str(e).split())
        raise ValueError(f"{bundle_dir}: not a readable eval bundle ({reason})") from None
    if baselines != "bundle":
        for t in (t for t in tasks if t["label"] in BASELINE_CHANGES):
            v1, new = BASELINE_CHANGES[t["label"]]
            t["random_baseline"] = new if baselines == "2025-09-05" else v1
    digest = fingerprint(bundle_dir)
    return dict(dir=bundle_dir, tasks=tasks, fingerprint=digest, baselines=baselines)


def fingerprint(bundle_dir):
    # The [X] code's sha256 over every (path, file sha256), sorted.
    digest = hashlib.sha256()
    for root, dirs, files in os.walk(bundle_dir):
        dirs.sort()
        for name in sorted(files):
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                digest.update(os.path.relpath(path, bundle_dir).encode())
                digest.update(hashlib.sha256(f.read()).hexdigest().encode())
    return digest.hexdigest()


def load_task_data(task):
    with open(task["path"]) as f:
        try:
            return [json.loads(line) for line in f if line.strip()]
        except ValueError as e:
            raise ValueError(f"{task['path']}: malformed JSON ({e})") from None


def shuffle_and_cut(items, max_per_task=-1):
    # nanochat's subsample: shuffle, keep max_per_task (-1: all).
    items = list(items)
    random.Random(SHUFFLE_SEED).shuffle(items)
    return items[:max_per_task] if max_per_task > 0 else items


def sample_fewshot(data, idx, k, seed=FEWSHOT_SEED):
    # nanochat's Random(seed + idx).sample(others, k), or all others
    # when fewer: sample() draws positions, so range(n - 1) mapped
    # past idx is the very same draw.
    if k <= 0:
        return []
    n_other = len(data) - 1
    picks = random.Random(seed + idx).sample(range(n_other), min(k, n_other))
    return [data[j if j < idx else j + 1] for j in picks]


# -------------------- Prompts and their scored spans


def render_mc(item, delim, fewshot=()):
    prefix = "".join(f"{ex['query']}{delim}{ex['choices'][ex['gold']]}\n\n" for ex in fewshot)
    return [f"{prefix}{item['query']}{delim}{c}" for c in item["choices"]]


def render_schema(item, delim, fewshot=()):
    shots = (f"{ex['context_options'][ex['gold']]}{delim}{ex['continuation']}" for ex in fewshot)
    prefix = "".join(f"{shot}\n\n" for shot in shots)
    return [f"{prefix}{c}{delim}{item['continuation']}" for c in item["context_options"]]


def render_lm(item, delim, fewshot=()):
    # The prompt without the continuation (stripped), and with it.
    prefix = "".join(f"{ex['context'].strip()}{delim}{ex['continuation']}\n\n" for ex in fewshot)
    base = f"{prefix}{item['context'].strip()}{delim}"
    return [base.strip(), base + item["continuation"]]


def common_prefix_len(seqs):
    n = min(len(s) for s in seqs)
    differs = (i for i in range(n) if any(s[i] != seqs[0][i] for s in seqs))
    return next(differs, n)


def common_suffix_len(seqs):
    n = min(len(s) for s in seqs)
    differs = (i for i in range(n) if any(s[-1 - i] != seqs[0][-1 - i] for s in seqs))
    return next(differs, n)


def encode_with_bos(tokenizer, text):
    return [tokenizer.eot_token] + list(tokenizer.encode(text))


def build_example(item, task_type, delim, tokenizer, fewshot=(), max_len=None):
    # Render, tokenize and crop one item; the span of sequence r,
    # tokens[r][starts[r]:ends[r]], is scored.
    fixed = False
    if task_type == "language_modeling":
        prompts = render_lm(item, delim, fewshot)
        without, with_ = (encode_with_bos(tokenizer, p) for p in prompts)
        s = len(without)
        # A BPE merge across the join moved the boundary (nanochat
        # asserts): score from the common prefix.
        if with_[:s] != without:
            s, fixed = common_prefix_len([with_, without]), True
        if s >= len(with_):
            raise ValueError(f"continuation {item['continuation']!r} has no tokens of its own")
        tokens, starts, ends, gold, a = [with_], [s], [len(with_)], 0, s
    else:
        mc = task_type == "multiple_choice"
        prompts = (render_mc if mc else render_schema)(item, delim, fewshot)
        tokens = [encode_with_bos(tokenizer, p) for p in prompts]
        gold = item["gold"]
        ends = [len(t) for t in tokens]
        if mc:
            starts = [common_prefix_len(tokens)] * len(tokens)
        else:
            suffix = common_suffix_len(tokens)
            starts = [e - suffix for e in ends]
        # [X18] The answer starts at the common prefix of
        # tokens(prompt) and tokens(prompt minus answer).
        answer = item["choices"][gold] if mc else item["continuation"]
        context = encode_with_bos(tokenizer, prompts[gold][:len(prompts[gold]) - len(answer)])
        a = min(common_prefix_len([tokens[gold], context]), len(tokens[gold]) - 1)
    cropped = False
    if max_len is not None:
        # Crop from the left to the model's context, as nanochat does.
        for r, t in enumerate(tokens):
            crop = max(0, len(t) - max_len)
            tokens[r], starts[r], ends[r] = t[crop:], starts[r] - crop, ends[r] - crop
            a -= crop if r == gold else 0
        # nanochat asserts start >= 0; at 0 its MC mean is nan and its
        # LM comparison fails.
        if min(starts) < (task_type == "language_modeling"):
            raise ValueError(
                f"the continuation does not fit in the model context of "
                f"{max_len} tokens (nanochat's crop would assert)"
            )
        # If the crop cut into the answer, its NLL covers the rest.
        a, cropped = max(a, 1), a < 1
    return dict(tokens=tokens, starts=starts, ends=ends, gold=gold, answer_start=a,
                boundary_fixed=fixed, answer_cropped=cropped)


# -------------------- Scoring


def load_model_and_tokenizer(path, device="cpu"):
    model, info = load_checkpoint(path, device)
    return model.eval(), get_tokenizer(info["tokenizer"]), info


@torch.no_grad()
def forward_logits(model, idx, n_passes=None, cache=None, autocast_dtype=None):
    with torch.autocast(idx.device.type, dtype=autocast_dtype, enabled=bool(autocast_dtype)):
        if n_passes is None and cache is None:
            out = model(idx)
        else:
            out = model(idx, n_passes=n_passes, cache=cache)
    return (out[0] if isinstance(out, tuple) else out).float()


def model_device(model):
    return next(model.parameters(), torch.zeros(0)).device


@torch.no_grad()
def score_sequences(model, seqs, spans, pad_id, batch_tokens=16384, autocast_dtype=None):
    # (losses, greedy hits) of each sequence's span [lo, hi).
    device = model_device(model)
    # Longest first, right-padded, batch_tokens per forward.
    order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i]))
    losses, hits = [None] * len(seqs), [None] * len(seqs)
    pos = 0
    while pos < len(order):
        width = len(seqs[order[pos]])
        batch = order[pos:pos + max(1, batch_tokens // width)]
        pos += len(batch)
        idx = torch.full((len(batch), width), pad_id, dtype=torch.long)
        for r, i in enumerate(batch):
            idx[r, :len(seqs[i])] = torch.tensor(seqs[i])
        idx = idx.to(device)
        logits = forward_logits(model, idx, autocast_dtype=autocast_dtype)
        for r, i in enumerate(batch):
            lo, hi = spans[i]
            # Position p predicts token p + 1.
            pred, target = logits[r, lo - 1:hi - 1], idx[r, lo:hi]
            losses[i] = F.cross_entropy(pred, target, reduction="none").cpu()
            hits[i] = (pred.argmax(dim=-1) == target).cpu()
    return losses, hits


def nanochat_choice(mean_losses):
    # nanochat's mean_losses.index(min(mean_losses)): a nan first
    # option wins, a later nan never does.
    best = 0
    for r, loss in enumerate(mean_losses):
        best = r if loss < mean_losses[best] else best
    return best


def score_examples(model, examples, task_type, pad_id, batch_tokens=16384,
                   autocast_dtype=None):
    seqs, spans, owner = [], [], []
    for e, ex in enumerate(examples):
        for r, t in enumerate(ex["tokens"]):
            # Position 0 predicts nothing. Gold is scored from its
            # answer start too, for the answer NLL.
            lo = max(ex["starts"][r], 1)
            if r == ex["gold"]:
                lo = min(lo, ex["answer_start"])
            seqs.append(t)
            spans.append((lo, ex["ends"][r]))
            owner.append((e, r))
    losses, hits = score_sequences(model, seqs, spans, pad_id, batch_tokens, autocast_dtype)
    scored = {key: (losses[i], hits[i], spans[i][0]) for i, key in enumerate(owner)}
    results = []
    for e, ex in enumerate(examples):
        mean_losses = []
        for r, start in enumerate(ex["starts"]):
            loss, _, lo = scored[(e, r)]
            span = loss[start - lo:] if start >= 1 else loss[:0]
            # nanochat's mean of an empty span is nan.
            mean_losses.append(span.mean().item() if span.numel() else float("nan"))
        g_loss, g_hits, g_lo = scored[(e, ex["gold"])]
        if task_type == "language_modeling":
            # Correct when every greedy token is exact.
            pred, correct = 0, bool(g_hits[ex["starts"][0] - g_lo:].all())
        else:
            pred = nanochat_choice(mean_losses)
            correct = pred == ex["gold"]
        answer_nll = g_loss[ex["answer_start"] - g_lo:].mean().item()  # [X18]
        results.append(dict(correct=correct, pred=pred, mean_losses=mean_losses,
                            answer_nll=answer_nll))
    return results


def centered_accuracy(accuracy, random_baseline_percent):
    # [X17] c = (a - b) / (1 - b), b the random baseline.
    b = 0.01 * random_baseline_percent
    return (accuracy - b) / (1.0 - b)


def evaluate_task(model, tokenizer, task, data, num_fewshot=None,
                  fewshot_seed=FEWSHOT_SEED, max_len=None, batch_tokens=16384,
                  autocast_dtype=None):
    k = task["num_fewshot"] if num_fewshot is None else num_fewshot
    max_len = max_len or model.config.block_size
    task_type, examples = task["icl_task_type"], []
    for idx, item in enumerate(data):
        try:
            shots = sample_fewshot(data, idx, k, fewshot_seed)
            delim = task["continuation_delimiter"]
            example = build_example(item, task_type, delim, tokenizer, shots, max_len)
        except (ValueError, KeyError, TypeError, IndexError) as e:
            where = f"task {task['label']!r} item {idx} (after the shuffle)"
            raise ValueError(f"{where}: {e!r}") from None
        examples.append(example)
    items = score_examples(model, examples, task_type, tokenizer.eot_token, batch_tokens,
                           autocast_dtype)
    n = len(items)
    return dict(
        n=n, accuracy=sum(r["correct"] for r in items) / n, fewshot_used=min(k, n - 1),
        answer_nll=sum(r["answer_nll"] for r in items) / n, items=items,
        boundary_fixed=sum(ex["boundary_fixed"] for ex in examples),
        answer_cropped=sum(ex["answer_cropped"] for ex in examples),
    )


def mean(xs):
    xs = list(xs)
    return sum(xs) / len(xs) if xs else float("nan")


def evaluate_core(model, tokenizer, bundle, max_per_task=-1,
                  fewshot_seeds=(FEWSHOT_SEED,), labels=None, num_fewshot=None,
                  batch_tokens=16384, autocast_dtype=None):
    bundle = load_bundle(bundle) if isinstance(bundle, str) else bundle
    chosen = [t for t in bundle["tasks"] if labels is None or t["label"] in labels]
    tasks = {}
    for task in tqdm(chosen, desc="CORE", disable=None, file=sys.stderr):
        data = shuffle_and_cut(load_task_data(task), max_per_task)
        k = task["num_fewshot"] if num_fewshot is None else num_fewshot
        # Means over the few-shot seeds; a 0-shot task runs once.
        runs = [
            evaluate_task(model, tokenizer, task, data, k, s, None, batch_tokens, autocast_dtype)
            for s in (fewshot_seeds if k else fewshot_seeds[:1])
        ]
        accuracy = mean(r["accuracy"] for r in runs)
        tasks[task["label"]] = dict(
            task_type=task["icl_task_type"],
            num_fewshot=k,
            fewshot_used=runs[0]["fewshot_used"],
            n=runs[0]["n"],
            accuracy=accuracy,
            per_seed_accuracy=[r["accuracy"] for r in runs],
            random_baseline=task["random_baseline"],
            answer_nll=mean(r["answer_nll"] for r in runs),
            # Centering is affine: the seeds' mean centered.
            centered=centered_accuracy(accuracy, task["random_baseline"]),
            items=runs[0]["items"],
            boundary_fixed=max(r["boundary_fixed"] for r in runs),
            answer_cropped=max(r["answer_cropped"] for r in runs))
    out = dict(bundle=bundle["dir"], fingerprint=bundle["fingerprint"],
               baselines=bundle["baselines"], fewshot_seeds=list(fewshot_seeds),
               max_per_task=max_per_task, tasks=tasks, n_tasks=len(tasks))
    # CORE: mean centered accuracy [X17]; CORE NLL: mean answer NLL
    # [X18]. CORE-17 needs all of its tasks.
    for name, names in (("core", list(tasks)), ("core17", CORE17_LABELS)):
        out[name] = out[name + "_nll"] = None
        if all(label in tasks for label in names):
            out[name] = mean(tasks[label]["centered"] for label in names)
            out[name + "_nll"] = mean(tasks[label]["answer_nll"] for label in names)
    return out


def kshot_sweep(model, tokenizer, bundle, ks=KSHOT_SWEEP, labels=None,
                max_per_task=-1, fewshot_seed=FEWSHOT_SEED, batch_tokens=16384,
                autocast_dtype=None):
    # [S ICL] Each task at every k; by default the few-shot ones.
    bundle = load_bundle(bundle) if isinstance(bundle, str) else bundle
    if labels:
        tasks = [t for t in bundle["tasks"] if t["label"] in labels]
    else:
        tasks = [t for t in bundle["tasks"] if t["num_fewshot"] > 0]
    out = {}
    for task in tqdm(tasks, desc="k-shot sweep", disable=None, file=sys.stderr):
        data = shuffle_and_cut(load_task_data(task), max_per_task)
        out[task["label"]] = {}
        for k in ks:
            r = evaluate_task(model, tokenizer, task, data, k, fewshot_seed,
                              None, batch_tokens, autocast_dtype)
            centered = centered_accuracy(r["accuracy"], task["random_baseline"])
            out[task["label"]][k] = dict(accuracy=r["accuracy"], answer_nll=r["answer_nll"],
                                         centered=centered, fewshot_used=r["fewshot_used"])
    metrics = ("accuracy", "centered", "answer_nll")
    means = {k: {m: mean(t[k][m] for t in out.values()) for m in metrics} for k in ks}
    return dict(ks=list(ks), tasks=out, mean=means)


# -------------------- Validation loss by document length [S]


def split_documents(tokens, eot):
    # The (start, end) of each document's own tokens.
    cuts = np.flatnonzero(np.asarray(tokens) == eot)
    bounds = np.concatenate([[-1], cuts, [len(tokens)]])
    return [(int(a) + 1, int(b)) for a, b in zip(bounds[:-1], bounds[1:]) if b - a > 1]


def bucket_of(n_tokens, bounds=LENGTH_BUCKETS):
    # The smallest upper bound >= n_tokens, or '>last'.
    return next((str(b) for b in bounds if n_tokens <= b), f">{bounds[-1]}")


def length_bucket_loss(model, tokens, eot, bounds=LENGTH_BUCKETS,
                       max_tokens=None, batch_tokens=16384):
    spans = split_documents(tokens, eot)
    if max_tokens is not None:
        # Whole documents, until max_tokens are read.
        read = np.cumsum([b - a for a, b in spans])
        spans = spans[:int(np.searchsorted(read, max_tokens)) + 1]
    # [S] A document is read as [eot] + doc, so it predicts from
    # itself only, in windows of block_size tokens.
    seqs, owner, step = [], [], model.config.block_size - 1
    for d, (a, b) in enumerate(spans):
        doc = [eot] + [int(t) for t in tokens[a:b]]
        starts = range(0, b - a, step)
        seqs += [doc[w:w + step + 1] for w in starts]
        owner += [d] * len(starts)
    losses, _ = score_sequences(model, seqs, [(1, len(s)) for s in seqs], eot, batch_tokens)
    labels = [*map(str, bounds), f">{bounds[-1]}"]
    out = {label: dict(n_docs=0, n_tokens=0, loss=0.0) for label in labels}
    for d, loss in zip(owner, losses):
        bucket = bucket_of(spans[d][1] - spans[d][0], bounds)
        out[bucket]["loss"] += loss.double().sum().item()
    for a, b in spans:
        o = out[bucket_of(b - a, bounds)]
        o["n_docs"], o["n_tokens"] = o["n_docs"] + 1, o["n_tokens"] + b - a
    # Token-weighted means.
    for o in out.values():
        o["loss"] = o["loss"] / o["n_tokens"] if o["n_tokens"] else None
    return out


# -------------------- Command line


def print_report(report, data_dir):
    res = report.get("core")
    if res:
        known = KNOWN_FINGERPRINTS.get(res["fingerprint"], "not a known public bundle")
        print(f"bundle {res['bundle']}: sha256 {res['fingerprint']} ({known})\n"
              f"random baselines {res['baselines']}; seeds {res['fewshot_seeds']}; "
              f"max_per_task {res['max_per_task']}")
        print(f"{'task':34s} {'type':17s} shots {'n':>6s}  accuracy  centered answer_nll")
        for label, r in res["tasks"].items():
            print(f"{label:34s} {r['task_type']:17s} {r['fewshot_used']:5d} {r['n']:6d} "
                  f"{r['accuracy']:9.4f} {r['centered']:9.4f} {r['answer_nll']:10.4f}")
        core = f"CORE ({res['n_tasks']} tasks) [X17] [X18]"
        for name, key in ((core, "core"), ("CORE-17 [X]", "core17")):
            if res[key] is None:
                print(f"{name}: n/a (the bundle lacks some of its tasks)")
            else:
                print(f"{name:74s} {res[key]:9.4f} {res[key + '_nll']:10.4f}")
    if "kshot" in report:  # [S ICL]
        heads = " ".join(f"{f'k={k}':>7s}" for k in KSHOT_SWEEP)
        print(f"\nk-shot sweep: accuracy\n{'task':34s} " + heads)
        sweep = report["kshot"]
        rows = list(sweep["tasks"].items()) + [("mean centered", sweep["mean"])]
        for label, per_k in rows:
            key = "centered" if label == "mean centered" else "accuracy"
            cells = " ".join(f"{per_k[k][key]:7.4f}" for k in KSHOT_SWEEP)
            print(f"{label:34s} " + cells)
    if "length_buckets" in report:  # [S]
        print(f"\nvalidation loss by document length ({data_dir or 'the embedded corpus'})\n"
              f"{'tokens':>8s} {'docs':>7s} {'tokens':>9s} {'loss':>8s}")
        for label, b in report["length_buckets"].items():
            loss = "-" if b["loss"] is None else f"{b['loss']:.4f}"
            label = label if label[0] == ">" else "<=" + label
            print(f"{label:>8s} {b['n_docs']:7d} {b['n_tokens']:9d} {loss:>8s}")


def main(argv=None):
    p = argparse.ArgumentParser(prog="eval_core.py", usage=argparse.SUPPRESS,
                                description=__doc__.split("\n\n")[0].strip())
    arg = p.add_argument
    arg("--ckpt", required=True, help="a ckpt.pt or an export folder")
    arg("--bundle", help="an eval bundle folder (core.yaml, eval_data/, eval_meta_data.csv)")
    arg("--max_per_task", type=int, default=-1, help="items per task after the shuffle; -1: all")
    arg("--fewshot_seeds", type=lambda s: [int(x) for x in s.split(",")], default=[FEWSHOT_SEED],
        help="comma list; item idx draws with Random(seed + idx); 0,1,2 are [X]'s (default: 1234)")
    arg("--tasks", type=lambda s: s.split(","), help="comma list of task labels (default: all)")
    arg("--baselines", choices=["bundle", "v1", "2025-09-05"], default="bundle",
        help="the bundle's random baselines, or a published table for the 3 rows that changed")
    arg("--kshot_sweep", action="store_true", help=f"[S ICL] every k in {KSHOT_SWEEP}")
    arg("--length_buckets", action="store_true", help="[S] validation loss by document length")
    arg("--data_dir", help="its data (default: the run's)")
    arg("--length_tokens", type=int, default=1 << 20, help="its validation tokens")
    arg("--batch_tokens", type=int, default=16384, help="padded tokens per forward")
    arg("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="bf16 on CUDA")
    arg("--json", action="store_true", help="one JSON object instead of tables")
    args = p.parse_args(argv)
    if not args.bundle and not args.length_buckets:
        p.error("give --bundle (CORE) and/or --length_buckets")
    try:
        bundle = load_bundle(args.bundle, args.baselines) if args.bundle else None
        model, tokenizer, info = load_model_and_tokenizer(args.ckpt, args.device)
        data_dir = args.data_dir
        if data_dir is None:
            data_dir = (info.get("config") or {}).get("data_dir", "")
        data = load_data(data_dir) if args.length_buckets else None
    except (OSError, ValueError, RuntimeError) as e:
        # A missing or bad file, or a bad --device.
        p.error(str(e).splitlines()[0])
    unknown = set(args.tasks or ()) - {t["label"] for t in bundle["tasks"]} if bundle else set()
    if unknown:
        p.error(f"--tasks: not in {args.bundle}: {sorted(unknown)}")
    if data is not None and data.meta["tokenizer"] != tokenizer.name:
        p.error(f"{data.data_dir} holds {data.meta['tokenizer']} tokens, "
                f"the checkpoint reads {tokenizer.name}")
    autocast = torch.bfloat16 if model_device(model).type == "cuda" else None
    report = {"ckpt": args.ckpt}
    try:
        if bundle:
            report["core"] = evaluate_core(model, tokenizer, bundle, args.max_per_task,
                                           args.fewshot_seeds, args.tasks, None,
                                           args.batch_tokens, autocast)
        if bundle and args.kshot_sweep:
            report["kshot"] = kshot_sweep(model, tokenizer, bundle, KSHOT_SWEEP, args.tasks,
                                          args.max_per_task, args.fewshot_seeds[0],
                                          args.batch_tokens, autocast)
    except (OSError, ValueError) as e:
        # A malformed task file or item.
        p.error(str(e))
    if data is not None:
        report["length_buckets"] = length_bucket_loss(model, data.val, tokenizer.eot_token,
                                                      LENGTH_BUCKETS, args.length_tokens,
                                                      args.batch_tokens)
    for r in report.get("core", {}).get("tasks", {}).values():
        r.pop("items")
    print(json.dumps(report)) if args.json else print_report(report, data_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
