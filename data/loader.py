"""
Reading a prepared data folder for training: the splits, the val sources, the unigram baseline, and
the seeded stream of training windows.

The train split (its shards concatenated, data.shards.ShardedTokens) is cut into windows of
block_size + 1 tokens, read in a seeded random order per epoch. A window may cross a shard boundary (the
two pieces are read and joined), so the windows, and training, do not depend on --shard_tokens.
Window number n (counting from 0 over the whole run) is deterministic given (seed, n), so a checkpoint
only needs n (the data position) and every process computes the same order. The tail of the train split
is held back: stable runs never read it, decay branches read only it, so a branch always trains on data
its stable phase has not seen ([S]: no repetition). Its size is branch_data_fraction of the split, rounded
to whole shards at the end of the split when it is at least one shard long (held_back_start).

Opening a folder reads meta.json and the val sidecars only: start-up does not grow with the corpus.
"""

import functools
from dataclasses import dataclass, replace
from typing import Optional

import numpy as np
import torch

from data import prepare as prep
from data import shards
from data.tokenizer import token_byte_lengths
from tooling import distributed


class TokenStream:
    """Windows of seq_len + 1 tokens of tokens[start:stop], read in a seeded random order per epoch."""

    def __init__(self, tokens, seq_len, seed, start=0, stop=None, name="stable"):
        stop = len(tokens) if stop is None else stop
        self.tokens, self.seq_len, self.seed, self.start, self.stop = tokens, seq_len, seed, start, stop
        self.name = name
        self.n_windows = (stop - start - 1) // seq_len
        if self.n_windows < 1:
            raise ValueError(f"the {name} region of the data has {stop - start} tokens: fewer than block_size + 1 "
                             f"= {seq_len + 1}")
        self._perms = {}

    def permutation(self, epoch):
        if epoch not in self._perms:
            self._perms = {epoch: np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)}
        return self._perms[epoch]

    def offsets(self, first, count):
        """Token offsets of windows first .. first + count - 1."""
        index = np.arange(first, first + count)
        out = np.empty(count, dtype=np.int64)
        for epoch in np.unique(index // self.n_windows):
            sel = index // self.n_windows == epoch
            out[sel] = self.start + self.permutation(int(epoch))[index[sel] % self.n_windows] * self.seq_len
        return out

    def batch(self, first, count, device="cpu"):
        """(x, y) int64 tensors (count, seq_len) on device of windows first .. first + count - 1."""
        rows = to_device(windows(self.tokens, self.offsets(first, count), self.seq_len), torch.device(device))
        return rows[:, :-1], rows[:, 1:]


def windows(tokens, offsets, seq_len):
    """int64 array (len(offsets), seq_len + 1) of the token windows starting at offsets. Token ids of a
    prepared split (tokens.n_vocab known) are checked: an id outside the vocabulary is one line naming its
    shard and position, not an IndexError (a device-side assert on CUDA) inside the model."""
    rows = np.stack([np.asarray(tokens[o:o + seq_len + 1], dtype=np.int64) for o in offsets])
    # Checked per batch on the host, before it goes to the device (no GPU sync): one max over the batch's
    # tokens, microseconds next to the forward. meta.json's per-shard max_token (checked at open) says what
    # prepare wrote, not what the shard holds now; scanning every shard at open would read the whole corpus.
    n_vocab = getattr(tokens, "n_vocab", None)
    if n_vocab is not None and rows.size and rows.max() >= n_vocab:
        row, col = np.argwhere(rows >= n_vocab)[0]
        path, position = tokens.where(int(offsets[row]) + int(col))
        raise ValueError(f"{path}: token id {rows[row, col]} at position {position:,} is outside the vocabulary "
                         f"(n_vocab={n_vocab} in meta.json): the shard changed after it was prepared; re-run "
                         "data/prepare.py (--verify checks every shard)")
    return rows


def to_device(array, device):
    """A numpy array as a tensor on device: on CUDA through pinned memory, copied without a host sync."""
    rows = torch.from_numpy(array)
    return rows.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else rows.to(device)


@dataclass
class Data:
    """A data/prepare.py folder, opened: token shards, the val split's sources, the unigram baseline."""
    data_dir: str
    meta: dict
    train_tokens: np.ndarray  # shards.ShardedTokens (or any 1-D array): len() and slicing
    val_tokens: np.ndarray
    val_sources: Optional[np.ndarray]  # source id per val token (None without several sources)
    unigram_entropy: float  # of the train split: the loss of the best context-free model

    @property
    def source_names(self):
        return self.meta.get("sources", [])

    @functools.cached_property
    def token_bytes(self):
        """int64 tensor (n_vocab,): UTF-8 bytes of each token id, 0 for eot (the denominator of bits per byte)."""
        return torch.tensor(token_byte_lengths(self.meta))

    @property
    def provenance(self):
        """What a checkpoint records about its data: the tokenizer and the folder (the TrainState: its
        fingerprint)."""
        return dict(tokenizer=self.meta.get("tokenizer"), data_dir=self.data_dir)

    @property
    def fingerprint(self):
        """sha256 of the inputs and settings the folder was prepared from (meta.json), or None."""
        return self.meta.get("fingerprint")

    def stream(self, seq_len, seed, branch_data_fraction, branch=False, unique_tokens=0):
        """The training windows: the stable region, or (a decay branch) the held-back tail; unique_tokens > 0:
        only the region's first unique_tokens tokens (a run longer than they are rereads them)."""
        n = len(self.train_tokens)
        shard_sizes = [s["tokens"] for s in self.meta.get("shards", {}).get("train", [])] or [n]
        split = held_back_start(shard_sizes, branch_data_fraction)
        start, stop, name = (split, n, "branch") if branch else (0, split, "stable")
        if unique_tokens:
            if not seq_len + 1 <= unique_tokens <= stop - start:
                raise ValueError(f"unique_tokens={unique_tokens:,}: must be in [block_size + 1, {stop - start:,}] "
                                 f"(the {name} region of {self.data_dir or 'the embedded corpus'} holds "
                                 f"{stop - start:,} tokens)")
            stop = start + unique_tokens
        stream = TokenStream(self.train_tokens, seq_len, seed, start, stop, name)
        stream.fingerprint = self.fingerprint
        return stream


def held_back_start(shard_sizes, fraction):
    """Where the held-back tail of a train split made of shards of these sizes starts: n - int(n * fraction),
    moved to the nearest shard boundary when the tail is at least one shard long (so a decay branch reads
    whole shards at the end of the split, and the tail changes by at most half a shard); a shorter tail
    (a small corpus, the embedded one's single shard) stays exact."""
    n = int(sum(shard_sizes))
    held = int(n * fraction)
    boundaries = np.cumsum(shard_sizes)[:-1]  # where shards 1.. start
    if held == 0 or not len(boundaries) or held < shard_sizes[0]:
        return n - held
    return int(boundaries[np.argmin(np.abs(boundaries - (n - held)))])


def open_data(data_dir, model_config=None, world=1, master=True, new_model=False):
    """(load_data, the model config) checked against the model that will read it: its vocabulary must hold
    the data's token ids and share its end-of-text token. new_model: the model is built for this data and
    takes both from it (eot_token; n_logits, the data's vocabulary, when vocab_size pads it). With several
    processes and the embedded corpus, rank 0 prepares it first (a barrier through the store: a failure there
    ends the others, with its line)."""
    if world > 1 and not data_dir:
        if master:
            load_data("")
        distributed.barrier("the embedded corpus")
    data = load_data(data_dir)
    n_vocab, eot = data.meta["n_vocab"], data.meta["eot_token"]
    if new_model and model_config is not None and n_vocab <= model_config.vocab_size:
        padded = n_vocab < model_config.vocab_size  # [X]: 50257 of 50304 rows; the rest never take probability
        model_config = replace(model_config, eot_token=eot, n_logits=n_vocab if padded else 0)
    logits = model_config and (model_config.n_logits or model_config.vocab_size)  # the ids the model can predict
    if model_config is not None and len(data.val_tokens) < model_config.block_size + 1:
        raise ValueError(f"{data.data_dir}: the val split has {len(data.val_tokens):,} tokens, fewer than "
                         f"block_size + 1 = {model_config.block_size + 1} (one window to evaluate on); prepare it with "
                         "more val documents (--val_fraction / --val_tokens) or lower block_size")
    if model_config is not None and (logits < n_vocab or model_config.eot_token != eot):
        raise ValueError(f"{data.data_dir} holds tokens of tokenizer {data.meta.get('tokenizer')} (n_vocab={n_vocab}, "
                         f"eot_token={eot}), which the model does not fit: vocab_size={model_config.vocab_size} "
                         f"(n_logits={model_config.n_logits}), eot_token={model_config.eot_token}; prepare the data "
                         f"with the model's tokenizer or set data_dir to such a folder"
                         + (f" (or vocab_size >= {n_vocab})" if new_model else ""))
    return data, model_config


def load_data(data_dir):
    """Open a data/prepare.py folder ("" -> the embedded corpus, prepared once, offline) without reading its
    tokens: meta.json's checks (files present, sizes, token ids in range at prepare time) and the val split's
    sidecars; clear errors (file named) for missing or corrupt files."""
    if not data_dir:
        data_dir = prep.prepare_default(prep.DEFAULT_OUT)
    meta = shards.load_meta(data_dir)  # checked once; the splits are opened from it
    train_tokens, val_tokens = shards.load_split(data_dir, "train", meta), shards.load_split(data_dir, "val", meta)
    if not len(val_tokens) or not len(train_tokens):
        raise ValueError(f"{data_dir}: the {'val' if len(train_tokens) else 'train'} split is empty; re-run "
                         f"data/prepare.py with more documents")
    val_sources = None
    if len(meta.get("sources", [])) > 1:
        val_sources = shards.token_source_ids(shards.load_sources(data_dir, "val", meta), len(val_tokens))
    return Data(data_dir, meta, train_tokens, val_tokens, val_sources, float(meta["unigram_entropy_train_nats"]))

