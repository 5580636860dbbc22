"""
Reading a prepared data folder for training: the splits, the val sources, the unigram baseline, and
the seeded stream of training windows.

The train split is cut into windows of block_size + 1 tokens, read in a seeded random order per epoch.
Window number n (counting from 0 over the whole run) is deterministic given (seed, n), so a checkpoint
only needs n (the data position) and every process computes the same order. The last
branch_data_fraction of the train split is held back: stable runs never read it, decay branches read
only it, so a branch always trains on data its stable phase has not seen ([S]: no repetition).
"""

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from data import prepare as prep
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
    """int64 array (len(offsets), seq_len + 1) of the token windows starting at offsets."""
    return np.stack([np.asarray(tokens[o:o + seq_len + 1], dtype=np.int64) for o in offsets])


def to_device(array, device):
    """A numpy array as a tensor on device: on CUDA through pinned memory, copied without a host sync."""
    rows = torch.from_numpy(array)
    return rows.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else rows.to(device)


@dataclass
class Data:
    """A data/prepare.py folder, opened: token memmaps, the val split's sources, the unigram baseline."""
    data_dir: str
    meta: dict
    train_tokens: np.ndarray
    val_tokens: np.ndarray
    val_sources: Optional[np.ndarray]  # source id per val token (None without several sources)
    unigram_entropy: float  # of the train split: the loss of the best context-free model

    @property
    def source_names(self):
        return self.meta.get("sources", [])

    @property
    def provenance(self):
        """What a checkpoint records about its data: the tokenizer and the folder."""
        return dict(tokenizer=self.meta.get("tokenizer"), data_dir=self.data_dir)

    def stream(self, seq_len, seed, branch_data_fraction, branch=False):
        """The training windows: the stable region, or (a decay branch) the held-back tail."""
        n = len(self.train_tokens)
        split = n - int(n * branch_data_fraction)
        if branch:
            return TokenStream(self.train_tokens, seq_len, seed, split, n, "branch")
        return TokenStream(self.train_tokens, seq_len, seed, 0, split, "stable")


def open_data(data_dir, model_config=None, world=1, master=True):
    """load_data, checked against the model that will read it (its vocabulary must hold the data's token
    ids and share its end-of-text token); with several processes and the embedded corpus, rank 0
    prepares it first."""
    if world > 1 and not data_dir:
        if master:
            load_data("")
        distributed.barrier()
    data = load_data(data_dir)
    n_vocab, eot = data.meta["n_vocab"], data.meta["eot_token"]
    logits = model_config and (model_config.n_logits or model_config.vocab_size)  # the ids the model can predict
    if model_config is not None and (logits < n_vocab or model_config.eot_token != eot):
        raise ValueError(f"model vocab_size={model_config.vocab_size} (n_logits={model_config.n_logits}), eot_token="
                         f"{model_config.eot_token} do not fit the data ({data.data_dir}: n_vocab={n_vocab}, "
                         f"eot_token={eot})")
    return data


def load_data(data_dir):
    """Open a data/prepare.py folder ("" -> the embedded corpus, prepared once, offline); clear errors
    (file named) for missing or corrupt files and out-of-range token ids."""
    if not data_dir:
        data_dir = prep.prepare_default(prep.DEFAULT_OUT)
    meta = prep.load_meta(data_dir)
    train_tokens, val_tokens = prep.load_split(data_dir, "train"), prep.load_split(data_dir, "val")
    val_sources = None
    if len(meta.get("sources", [])) > 1:
        val_sources = prep.token_source_ids(prep.load_sources(data_dir, "val"), len(val_tokens))
    entropy = meta.get("unigram_entropy_train_nats") or unigram_entropy(train_tokens, meta["n_vocab"])
    return Data(data_dir, meta, train_tokens, val_tokens, val_sources, float(entropy))


def unigram_entropy(tokens, n_vocab):
    """Entropy (nats/token) of the token frequencies: the loss of the best context-free model."""
    counts = np.bincount(np.asarray(tokens), minlength=n_vocab).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())
