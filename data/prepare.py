"""
Turn text documents into nanoGPT-style token memmaps (train.bin / val.bin) with a sources sidecar.

    python data/prepare.py                                  # the embedded corpus -> data/cache/default
    python data/prepare.py my.jsonl notes/*.txt --tokenizer gpt2 --out data/cache/mine
    python data/prepare.py corpus_dir/ --val_fraction 0.1 --seed 1

Inputs (files or folders, folders searched recursively for *.txt and *.jsonl):
  .jsonl  one document per line: {"text": str, "source": str (optional)}; other fields are ignored.
  .txt    one document per file; a line that is exactly <|endoftext|> separates documents inside a file.
  A document without a source label gets its file's stem as source (my.jsonl -> "my").

Output in DIR (every file written to a temp name and renamed; meta.json is written last):
  train.bin, val.bin   flat token ids (uint16 when n_vocab <= 65536, else uint32). Every document is
                       PRECEDED by eot_token: eot is the BOS / separator, so a document mask that
                       starts a new document at each eot sees exactly one document per segment.
  {split}_sources.npy  int64 (n_docs, 4): [start, end, source_id, doc_index] per document in file
                       order. tokens[start] == eot, tokens[start+1:end] is the document; the spans
                       tile the file. source_id indexes meta["sources"]; doc_index = position in the input.
  meta.json            tokenizer, n_vocab, eot_token, dtype, per-split token/document counts, per-source
                       token counts, unigram baselines, corpus fingerprint.

Split: document-level, stratified by source and deterministic given --seed: each source with >= 2
documents gives max(1, round(val_fraction * n)) of them (never all) to val, so every such source has a
val loss. Document order within each split is shuffled with the same seed.

Loading checks what training would otherwise trip over far from the cause: load_meta checks file sizes
and that each sidecar tiles its .bin with known source ids; load_split checks every token id < n_vocab.
Errors are ValueErrors naming the file, the value and its position.
"""
import argparse
import hashlib
import json
import math
import os
import sys
import time

import numpy as np
from tqdm import tqdm

if __package__ in (None, ""):  # run as a script: python data/prepare.py
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tooling.common import cli_error, read_jsonl, write_atomic  # write_atomic is also imported from here (ladder.py)
from data.tokenizer import ENDOFTEXT, get_tokenizer

PREPARE_VERSION = 1  # bump when the output layout changes: cached prepares are then rebuilt
DATA_DIR = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CORPUS = os.path.join(DATA_DIR, "corpus", "shakespeare.jsonl")
DEFAULT_OUT = os.path.join(DATA_DIR, "cache", "default")
SPLITS = ("train", "val")


# -----------------------------------------------------------------------------
# reading documents

def expand_inputs(inputs):
    """Files as given, folders -> their *.txt / *.jsonl files (sorted). Clear errors for bad paths."""
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    files = []
    for path in map(str, inputs):
        if os.path.isdir(path):
            found = sorted(os.path.join(root, name) for root, _, names in os.walk(path)
                           for name in names if name.endswith((".txt", ".jsonl")))
            if not found:
                raise ValueError(f"input folder {path} contains no .txt or .jsonl files")
            files.extend(found)
        elif not os.path.exists(path):
            raise FileNotFoundError(f"input file not found: {path}")
        elif not path.endswith((".txt", ".jsonl")):
            raise ValueError(f"input file {path}: unsupported extension (expected .txt or .jsonl)")
        else:
            files.append(path)
    if not files:
        raise ValueError("no input files given")
    return files


def read_documents(path):
    """[(text, source)] from one .txt or .jsonl file; jsonl errors name the file and line number."""
    stem = os.path.splitext(os.path.basename(path))[0]
    if path.endswith(".jsonl"):
        return [read_jsonl_document(path, lineno, row, stem) for lineno, row in read_jsonl(path)]
    try:
        with open(path, encoding="utf-8") as f:
            content = f.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not valid UTF-8 ({e})") from None
    docs, current = [], []
    for line in content.splitlines(keepends=True):
        if line.strip() == ENDOFTEXT:
            docs.append("".join(current))
            current = []
        else:
            current.append(line)
    docs.append("".join(current))
    return [(d, stem) for d in docs]


def read_jsonl_document(path, lineno, row, default_source):
    """(text, source) of one parsed jsonl line; ValueError naming path:lineno when a field is wrong."""
    if not isinstance(row, dict):
        raise ValueError(f"{path}:{lineno}: expected a JSON object with a 'text' field, got {type(row).__name__}")
    if "text" not in row:
        raise ValueError(f"{path}:{lineno}: missing field 'text'")
    if not isinstance(row["text"], str):
        raise ValueError(f"{path}:{lineno}: field 'text' must be a string, got {type(row['text']).__name__}")
    source = row.get("source", default_source)
    if not isinstance(source, str) or not source:
        raise ValueError(f"{path}:{lineno}: field 'source' must be a non-empty string, got {source!r}")
    return row["text"], source


def corpus_fingerprint(files, tokenizer, val_fraction, seed):
    """sha256 over the prepare settings and every input file's name and bytes."""
    h = hashlib.sha256(json.dumps([PREPARE_VERSION, tokenizer, float(val_fraction), int(seed)]).encode())
    for path in files:
        h.update(os.path.basename(path).encode() + b"\0")
        with open(path, "rb") as f:
            h.update(hashlib.sha256(f.read()).digest())
    return h.hexdigest()


# -----------------------------------------------------------------------------
# split

def split_documents(sources, val_fraction, seed):
    """Document-level, source-stratified split -> (train_indices, val_indices), each in shuffled order."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    n_docs = len(sources)
    if n_docs < 2:
        raise ValueError(f"need at least 2 non-empty documents for a train/val split, got {n_docs} "
                         f"(separate documents in a .txt with a line '{ENDOFTEXT}', or use .jsonl)")
    rng = np.random.default_rng(seed)
    is_val = np.zeros(n_docs, dtype=bool)
    for source in sorted(set(sources)):
        members = np.array([i for i, s in enumerate(sources) if s == source])
        if len(members) >= 2:
            k = min(max(1, math.floor(val_fraction * len(members) + 0.5)), len(members) - 1)
            is_val[rng.permutation(members)[:k]] = True
    if not is_val.any():  # every source has a single document: split across sources instead
        k = min(max(1, math.floor(val_fraction * n_docs + 0.5)), n_docs - 1)
        is_val[rng.permutation(n_docs)[:k]] = True
    train, val = np.flatnonzero(~is_val), np.flatnonzero(is_val)
    return rng.permutation(train), rng.permutation(val)


# -----------------------------------------------------------------------------
# writing

def token_dtype(n_vocab):
    return np.uint16 if n_vocab <= 2**16 else np.uint32


def unigram_baselines(train_tokens, val_tokens, n_vocab):
    """Entropy of the train unigram distribution and val cross-entropy under it (add-one), in nats/token:
    a trained model's val loss should end well below the latter."""
    counts = np.bincount(train_tokens, minlength=n_vocab).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    smoothed = (counts + 1.0) / (counts.sum() + n_vocab)
    return float(-(p * np.log(p)).sum()), float(-np.log(smoothed[val_tokens]).mean())


def prepare(inputs, out_dir, tokenizer="gpt2-4096", val_fraction=0.05, seed=0, verbose=True):
    """Tokenize `inputs` (.txt/.jsonl files or folders) into out_dir/{train,val}.bin + sidecars + meta.json."""
    start_time = time.time()
    tok = get_tokenizer(tokenizer)  # ValueError listing valid names if unknown
    files = expand_inputs(inputs)
    fingerprint = corpus_fingerprint(files, tokenizer, val_fraction, seed)
    texts, sources, n_empty = [], [], 0
    for path in files:
        for text, source in read_documents(path):
            if text.strip():
                texts.append(text)
                sources.append(source)
            else:
                n_empty += 1
    if not texts:
        raise ValueError(f"empty corpus: no non-empty documents in {', '.join(files)}")
    train_idx, val_idx = split_documents(sources, val_fraction, seed)

    ids = []
    chunk = 64
    for i in tqdm(range(0, len(texts), chunk), desc=f"tokenizing ({tokenizer})", unit="chunk", disable=not verbose):
        ids.extend(tok.encode_batch(texts[i:i + chunk]))

    source_names = sorted(set(sources))
    source_id = {s: i for i, s in enumerate(source_names)}
    dtype = token_dtype(tok.n_vocab)
    os.makedirs(out_dir, exist_ok=True)
    meta_path = os.path.join(out_dir, "meta.json")
    try:
        os.remove(meta_path)  # no meta.json = incomplete prepare, until the new one is written
    except FileNotFoundError:
        pass
    splits, tokens_by_split = {}, {}
    for split, order in zip(SPLITS, (train_idx, val_idx)):
        lengths = np.array([1 + len(ids[i]) for i in order], dtype=np.int64)  # +1: the leading eot
        ends = np.cumsum(lengths)
        spans = np.stack([ends - lengths, ends, [source_id[sources[i]] for i in order], order], axis=1).astype(np.int64)
        tokens = np.empty(int(ends[-1]), dtype=dtype)
        for s, e, _, doc in spans:
            tokens[s] = tok.eot_token
            tokens[s + 1:e] = ids[doc]
        write_atomic(os.path.join(out_dir, f"{split}.bin"), tokens.tofile)
        write_atomic(os.path.join(out_dir, f"{split}_sources.npy"), lambda f: np.save(f, spans))
        tokens_by_split[split] = tokens
        splits[split] = {
            "tokens": int(len(tokens)),
            "documents": int(len(order)),
            "source_tokens": {name: int(lengths[spans[:, 2] == j].sum()) for j, name in enumerate(source_names)},
            "source_documents": {name: int((spans[:, 2] == j).sum()) for j, name in enumerate(source_names)},
        }
    train_entropy, val_unigram_xent = unigram_baselines(tokens_by_split["train"], tokens_by_split["val"], tok.n_vocab)
    meta = {
        "format": "loopstudy-tokens",
        "version": PREPARE_VERSION,
        "tokenizer": tok.name,
        "n_vocab": tok.n_vocab,
        "eot_token": tok.eot_token,
        "dtype": np.dtype(dtype).name,
        "layout": "each document is preceded by eot_token; sidecar spans [start, end) include that eot",
        "sources": source_names,
        "splits": splits,
        "characters": int(sum(len(t) for t in texts)),
        "empty_documents_skipped": n_empty,
        "unigram_entropy_train_nats": train_entropy,
        "unigram_xent_val_nats": val_unigram_xent,
        "val_fraction": val_fraction,
        "seed": seed,
        "inputs": [os.path.basename(f) for f in files],
        "fingerprint": fingerprint,
    }
    write_atomic(meta_path, lambda f: f.write((json.dumps(meta, indent=1) + "\n").encode()))
    if verbose:
        print(f"prepared {out_dir} in {time.time() - start_time:.1f}s: " + ", ".join(
            f"{s} {splits[s]['tokens']:,} tokens / {splits[s]['documents']} docs" for s in SPLITS)
            + f"; sources {source_names}; {tok.name} ({tok.n_vocab} vocab, {meta['dtype']})")
    return out_dir


def prepare_default(out_dir=DEFAULT_OUT, tokenizer="gpt2-4096", verbose=True):
    """Prepare the embedded Shakespeare corpus into out_dir unless an intact, identical prepare is there."""
    fingerprint = corpus_fingerprint([DEFAULT_CORPUS], tokenizer, 0.05, 0)
    try:
        if load_meta(out_dir)["fingerprint"] == fingerprint:
            return out_dir
    except (FileNotFoundError, ValueError):
        pass  # missing, stale or corrupt: rebuild
    return prepare([DEFAULT_CORPUS], out_dir, tokenizer=tokenizer, val_fraction=0.05, seed=0, verbose=verbose)


# -----------------------------------------------------------------------------
# loading

def load_meta(data_dir):
    """meta.json of a prepared folder, after checking every file exists, has the size meta says, and that
    each {split}_sources.npy tiles its .bin with known source ids. Token ids are checked by load_split."""
    meta_path = os.path.join(data_dir, "meta.json")
    if not os.path.exists(meta_path):
        raise FileNotFoundError(f"{meta_path} not found: prepare the data first (python data/prepare.py ... --out {data_dir})")
    try:
        with open(meta_path) as f:
            meta = json.load(f)
        itemsize = np.dtype(meta["dtype"]).itemsize
        counts = {split: int(meta["splits"][split]["tokens"]) for split in SPLITS}
        n_vocab, eot, n_sources = int(meta["n_vocab"]), int(meta["eot_token"]), len(meta["sources"])
    except (ValueError, KeyError, TypeError) as e:  # ValueError includes json.JSONDecodeError
        raise ValueError(f"{meta_path} is corrupt ({type(e).__name__}: {e}); re-run data/prepare.py") from None
    if not 0 <= eot < n_vocab:
        raise ValueError(f"{meta_path} is corrupt: eot_token={eot} is not below n_vocab={n_vocab}; re-run data/prepare.py")
    for split in SPLITS:
        bin_path = os.path.join(data_dir, f"{split}.bin")
        if not os.path.exists(bin_path):
            raise FileNotFoundError(f"{bin_path} not found (listed in {meta_path}); re-run data/prepare.py")
        size, expected = os.path.getsize(bin_path), counts[split] * itemsize
        if size != expected:
            raise ValueError(f"{bin_path} is truncated or corrupt: {size:,} bytes, expected {expected:,} "
                             f"({counts[split]:,} {meta['dtype']} tokens per meta.json); re-run data/prepare.py")
        spans = read_spans(data_dir, split, counts[split], n_sources)
        tokens = np.memmap(bin_path, dtype=meta["dtype"], mode="r")
        not_eot = np.flatnonzero(tokens[spans[:, 0]] != eot)
        if len(not_eot):
            row = int(not_eot[0])
            raise ValueError(f"{bin_path} is corrupt: document {row} of {split}_sources.npy starts at position "
                             f"{spans[row, 0]:,} with token {tokens[spans[row, 0]]}, not eot_token={eot}; "
                             f"re-run data/prepare.py")
    return meta


def read_spans(data_dir, split, n_tokens, n_sources):
    """data_dir/{split}_sources.npy, checked: integer rows [start, end, source_id, doc_index] whose spans
    tile the n_tokens tokens of {split}.bin in order, with 0 <= source_id < n_sources. A ValueError names
    the file, the row and the value, instead of an IndexError deep inside training."""
    path = os.path.join(data_dir, f"{split}_sources.npy")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} not found; re-run data/prepare.py")
    try:
        spans = np.load(path)
    except (ValueError, OSError, EOFError) as e:
        raise ValueError(f"{path} is corrupt ({e}); re-run data/prepare.py") from None
    if spans.ndim != 2 or spans.shape[1] != 4 or len(spans) == 0 or not np.issubdtype(spans.dtype, np.integer):
        raise ValueError(f"{path} is corrupt: expected a non-empty integer array (n_docs, 4), got {spans.dtype} "
                         f"{spans.shape}; re-run data/prepare.py")
    starts, ends = spans[:, 0], spans[:, 1]
    expected_starts = np.concatenate([[0], ends[:-1]])
    bad = np.flatnonzero((starts != expected_starts) | (ends <= starts) | (ends > n_tokens))
    if len(bad) or ends[-1] != n_tokens:
        row = int(bad[0]) if len(bad) else len(spans) - 1
        raise ValueError(f"{path}: row {row} has span [{starts[row]}, {ends[row]}), but the spans must tile the "
                         f"{n_tokens:,} tokens of {split}.bin in order (each starts where the previous ended, "
                         f"start < end, the last ends at {n_tokens}); re-run data/prepare.py")
    bad = np.flatnonzero((spans[:, 2] < 0) | (spans[:, 2] >= n_sources))
    if len(bad):
        row = int(bad[0])
        raise ValueError(f"{path}: row {row} has source_id {spans[row, 2]}, but meta.json lists {n_sources} "
                         f"sources (ids 0..{n_sources - 1}); re-run data/prepare.py")
    return spans


def load_split(data_dir, split):
    """Read-only np.memmap of data_dir/{split}.bin (split = 'train' or 'val'), validated by load_meta,
    with every token id checked against meta["n_vocab"]."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    meta = load_meta(data_dir)
    bin_path = os.path.join(data_dir, f"{split}.bin")
    tokens = np.memmap(bin_path, dtype=meta["dtype"], mode="r")
    # One pass over the file: milliseconds for the default few MB, still a full read (seconds) for a
    # multi-GB file. Worth it: an id >= n_vocab otherwise ends as "IndexError: index out of range in
    # self" inside the embedding, far from the file that holds it.
    if len(tokens) and int(tokens.max()) >= meta["n_vocab"]:
        position = int(np.argmax(tokens >= meta["n_vocab"]))
        raise ValueError(f"{bin_path}: token id {int(tokens[position])} at position {position:,} is outside the "
                         f"vocabulary (n_vocab={meta['n_vocab']} in meta.json); re-run data/prepare.py")
    return tokens


def load_sources(data_dir, split):
    """int64 (n_docs, 4) [start, end, source_id, doc_index], checked against {split}.bin and the source
    names load_meta(data_dir)['sources']."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    meta = load_meta(data_dir)
    return read_spans(data_dir, split, int(meta["splits"][split]["tokens"]), len(meta["sources"]))


def token_source_ids(spans, n_tokens=None):
    """Source id of the document holding each token position (length = last span end, or n_tokens)."""
    ids = np.repeat(spans[:, 2], spans[:, 1] - spans[:, 0])
    return ids if n_tokens is None else ids[:n_tokens]


def main(argv=None):
    parser = argparse.ArgumentParser(description="Tokenize .txt/.jsonl documents into train.bin/val.bin (see the module docstring).")
    parser.add_argument("inputs", nargs="*", help=f"files or folders (default: the embedded corpus {os.path.relpath(DEFAULT_CORPUS)})")
    parser.add_argument("--tokenizer", default="gpt2-4096", help="'gpt2' or 'gpt2-N' (default gpt2-4096)")
    parser.add_argument("--out", default=None, help=f"output folder (default {os.path.relpath(DEFAULT_OUT)})")
    parser.add_argument("--val_fraction", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        prepare(args.inputs or [DEFAULT_CORPUS], args.out or DEFAULT_OUT, tokenizer=args.tokenizer,
                val_fraction=args.val_fraction, seed=args.seed)
    except (OSError, ValueError) as e:
        return cli_error("prepare.py", e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
