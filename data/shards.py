"""
Reading a data/prepare.py folder: meta.json after cheap checks, each split's shards as one read-only token
sequence (an np.memmap per shard), and the sources sidecars checked against the shards. The checks are the
cheap ones (files present, sizes as meta.json says, each shard's largest token id below n_vocab), so
opening a folder does not grow with the corpus; data/prepare.py --verify reads everything. This is its own
module, not part of data/loader.py: data/prepare.py needs it too (its cache check and --verify) and
data/loader.py imports data/prepare.py (the default corpus), so one file importing the other would be a
cycle, and data/prepare.py stays free of torch, which data/loader.py needs. numpy and the standard library.

    meta = load_meta("data/cache/default")                    # the index, checked
    tokens = load_split("data/cache/default", "train", meta)  # ShardedTokens: len(), tokens[a:b]
    spans = load_sources("data/cache/default", "val", meta)   # int64 (n_docs, 4) [start, end, source_id, doc_index]
"""

import json
import math
import os

import numpy as np

from data.tokenizer import get_tokenizer
from tooling.common import check_regular

PREPARE_VERSION = 2  # bump when the output layout changes: cached prepares are then rebuilt (2: shards)
SPLITS = ("train", "val")


def token_dtype(n_vocab):
    return np.uint16 if n_vocab <= 2**16 else np.uint32


class ShardedTokens:
    """The shards of one split as one read-only token sequence: len(), tokens[i], tokens[a:b] (a slice that
    crosses a shard boundary concatenates the pieces), np.asarray(tokens) (reads it all). Each shard is an
    np.memmap: nothing is read until sliced. n_vocab: the ids meta.json allows (data.loader checks each batch)."""

    def __init__(self, paths, sizes, dtype, n_vocab=None):
        self.dtype, self.paths, self.n_vocab = np.dtype(dtype), list(paths), n_vocab
        # shard k is [starts[k], starts[k+1])
        self.shard_starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
        self.shards = [np.memmap(p, dtype=self.dtype, mode="r") for p in paths]

    def where(self, position):
        """(shard file, position inside it) of a position of the split."""
        k = int(np.searchsorted(self.shard_starts, position, side="right")) - 1
        return self.paths[k], int(position - self.shard_starts[k])

    def __len__(self):
        return int(self.shard_starts[-1])

    def __getitem__(self, key):
        if isinstance(key, slice):
            start, stop, step = key.indices(len(self))
            if step != 1:
                raise ValueError("ShardedTokens slices take step 1 only")
            pieces = []
            k = int(np.searchsorted(self.shard_starts, start, side="right")) - 1
            while start < stop:
                end = min(stop, int(self.shard_starts[k + 1]))
                pieces.append(self.shards[k][start - self.shard_starts[k]:end - self.shard_starts[k]])
                start, k = end, k + 1
            return pieces[0] if len(pieces) == 1 else np.concatenate(pieces) if pieces else np.empty(0, self.dtype)
        i = int(key) + (len(self) if int(key) < 0 else 0)
        if not 0 <= i < len(self):
            raise IndexError(f"token index {key} out of range for {len(self):,} tokens")
        k = int(np.searchsorted(self.shard_starts, i, side="right")) - 1
        return self.shards[k][i - self.shard_starts[k]]

    def __array__(self, dtype=None, copy=None):
        tokens = np.asarray(self[0:len(self)])
        return tokens if dtype is None else tokens.astype(dtype)


def load_meta(data_dir):
    """meta.json of a prepared folder, after cheap checks: its version, every shard and sidecar present, each
    shard of the size meta.json says, each shard's largest token id (recorded at prepare time) < n_vocab."""
    meta_path = os.path.join(data_dir, "meta.json")
    if not os.path.exists(meta_path):
        raise FileNotFoundError(f"{meta_path} not found: prepare the data first (python data/prepare.py ... --out "
                                f"{data_dir}); a prepare that was stopped leaves no meta.json, rerun it")
    check_regular(meta_path, "the index")
    try:
        with open(meta_path) as f:
            meta = json.load(f)
        version = meta.get("version")
        if version == PREPARE_VERSION:
            itemsize = np.dtype(meta["dtype"]).itemsize
            n_vocab, eot, n_sources = int(meta["n_vocab"]), int(meta["eot_token"]), len(meta["sources"])
            tokenizer, entropy = meta["tokenizer"], float(meta["unigram_entropy_train_nats"])
            if not isinstance(tokenizer, str) or not math.isfinite(entropy) or len(set(meta["sources"])) != n_sources:
                raise ValueError("tokenizer must be a name, unigram_entropy_train_nats finite, sources distinct")
            counts = {split: int(meta["splits"][split]["tokens"]) for split in SPLITS}
            shards = {split: [(s["file"], s["sources"], int(s["tokens"]), int(s["max_token"]))
                              for s in meta["shards"][split]] for split in SPLITS}
    except (ValueError, KeyError, TypeError, AttributeError) as e:  # ValueError includes json.JSONDecodeError
        raise ValueError(f"{meta_path} is corrupt ({type(e).__name__}: {e}); re-run data/prepare.py") from None
    if version != PREPARE_VERSION:
        raise ValueError(f"{meta_path} was written by another version of data/prepare.py (format version {version}, "
                         f"this one reads {PREPARE_VERSION}); re-run data/prepare.py")
    if not 0 <= eot < n_vocab or n_sources < 1:
        raise ValueError(f"{meta_path} is corrupt: eot_token={eot} is not below n_vocab={n_vocab} or no sources; "
                         f"re-run data/prepare.py")
    if meta["dtype"] != np.dtype(token_dtype(n_vocab)).name:
        raise ValueError(f"{meta_path} is corrupt: dtype {meta['dtype']!r}, but prepare writes "
                         f"{np.dtype(token_dtype(n_vocab)).name} for n_vocab={n_vocab}; re-run data/prepare.py")
    try:
        known = get_tokenizer(tokenizer)
    except ValueError:  # a tokenizer this module does not build (a test's, a user's): nothing to compare
        known = None
    if known is not None and (known.n_vocab, known.eot_token) != (n_vocab, eot):
        raise ValueError(f"{meta_path} is corrupt: tokenizer {tokenizer} has n_vocab={known.n_vocab} and "
                         f"eot_token={known.eot_token}, meta.json says {n_vocab} and {eot}; re-run data/prepare.py")
    for split in SPLITS:
        if sum(s[2] for s in shards[split]) != counts[split]:
            raise ValueError(f"{meta_path} is corrupt: the {split} shards hold {sum(s[2] for s in shards[split]):,} "
                             f"tokens, its splits say {counts[split]:,}; re-run data/prepare.py")
        for name, sources, n_tokens, max_token in shards[split]:
            path = os.path.join(data_dir, name)
            for needed in (path, os.path.join(data_dir, sources)):
                if not os.path.exists(needed):
                    raise FileNotFoundError(f"{needed} not found (listed in {meta_path}); re-run data/prepare.py")
            size, expected = os.path.getsize(path), n_tokens * itemsize
            if size != expected:
                raise ValueError(f"{path} is truncated or corrupt: {size:,} bytes, expected {expected:,} "
                                 f"({n_tokens:,} {meta['dtype']} tokens per meta.json); re-run data/prepare.py")
            if max_token >= n_vocab:
                raise ValueError(f"{path}: token id {max_token} is outside the vocabulary (n_vocab={n_vocab} in "
                                 f"meta.json); re-run data/prepare.py")
    return meta


def load_split(data_dir, split, meta=None):
    """The token shards of data_dir's split ('train' or 'val') as one read-only ShardedTokens, after
    load_meta's checks (no pass over the tokens; meta: load_meta's result when the caller has it)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    meta = meta or load_meta(data_dir)
    shards = meta["shards"][split]
    return ShardedTokens([os.path.join(data_dir, s["file"]) for s in shards], [s["tokens"] for s in shards],
                         meta["dtype"], int(meta["n_vocab"]))


def read_spans(data_dir, split, meta):
    """The split's sidecars concatenated, checked: integer rows [start, end, source_id, doc_index] whose spans
    tile the split's tokens in order, each starting inside its shard, with 0 <= source_id < n_sources. A
    ValueError names the file, the row and the value, instead of an IndexError deep inside training."""
    n_tokens, n_sources = int(meta["splits"][split]["tokens"]), len(meta["sources"])
    parts, shard_start, last_end = [], 0, 0
    for shard in meta["shards"][split]:
        path = os.path.join(data_dir, shard["sources"])
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path} not found; re-run data/prepare.py")
        try:
            spans = np.load(path)
        except (ValueError, OSError, EOFError) as e:
            raise ValueError(f"{path} is corrupt ({e}); re-run data/prepare.py") from None
        if spans.ndim != 2 or spans.shape[1] != 4 or not np.issubdtype(spans.dtype, np.integer):
            raise ValueError(f"{path} is corrupt: expected an integer array (n_docs, 4), got {spans.dtype} "
                             f"{spans.shape}; re-run data/prepare.py")
        shard_end = shard_start + int(shard["tokens"])
        starts, ends = spans[:, 0], spans[:, 1]
        expected_starts = np.concatenate([[last_end], ends[:-1]])
        bad = np.flatnonzero((starts != expected_starts) | (ends <= starts) | (ends > n_tokens) |
                             (starts < shard_start) | (starts >= shard_end))
        if len(bad):
            row = int(bad[0])
            raise ValueError(f"{path}: row {row} has span [{starts[row]}, {ends[row]}), but the spans must tile the "
                             f"{n_tokens:,} tokens of the {split} split in order (each starts where the previous "
                             f"ended, start < end, inside this shard [{shard_start}, {shard_end})); "
                             "re-run data/prepare.py")
        bad = np.flatnonzero((spans[:, 2] < 0) | (spans[:, 2] >= n_sources))
        if len(bad):
            row = int(bad[0])
            raise ValueError(f"{path}: row {row} has source_id {spans[row, 2]}, but meta.json lists {n_sources} "
                             f"sources (ids 0..{n_sources - 1}); re-run data/prepare.py")
        parts.append(spans.astype(np.int64))
        shard_start, last_end = shard_end, int(ends[-1]) if len(ends) else last_end
    if last_end != n_tokens:
        raise ValueError(f"{os.path.join(data_dir, meta['shards'][split][-1]['sources'])}: the spans end at "
                         f"{last_end:,}, not at the {split} split's {n_tokens:,} tokens; re-run data/prepare.py")
    return np.concatenate(parts) if parts else np.zeros((0, 4), dtype=np.int64)


def load_sources(data_dir, split, meta=None):
    """int64 (n_docs, 4) [start, end, source_id, doc_index] of the split, checked against its shards (every
    document starts with eot) and the source names load_meta(data_dir)['sources'] (meta: as load_split)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    meta = meta or load_meta(data_dir)
    spans, tokens, eot = read_spans(data_dir, split, meta), load_split(data_dir, split, meta), int(meta["eot_token"])
    shard_of = np.searchsorted(tokens.shard_starts, spans[:, 0], side="right") - 1
    for k, shard in enumerate(tokens.shards):  # one gather per shard: the token at each document's start
        rows = np.flatnonzero(shard_of == k)
        first = shard[spans[rows, 0] - tokens.shard_starts[k]]
        if (first != eot).any():
            row = int(rows[np.argmax(first != eot)])
            raise ValueError(f"{os.path.join(data_dir, meta['shards'][split][k]['file'])} is corrupt: document {row} "
                             f"of the {split} split starts at position {spans[row, 0]:,} with token "
                             f"{tokens[int(spans[row, 0])]}, not eot_token={eot}; re-run data/prepare.py")
    return spans


def token_source_ids(spans, n_tokens=None):
    """Source id of the document holding each token position (length = last span end, or n_tokens)."""
    ids = np.repeat(spans[:, 2], spans[:, 1] - spans[:, 0])
    return ids if n_tokens is None else ids[:n_tokens]
