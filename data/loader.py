"""
What training reads: a data/prepare.py folder (nanoGPT's train.bin / val.bin, memmapped) and the seeded
stream of training windows (the offline GPT-2 tokenizers are data/prepare.py's, get_tokenizer here too):

    x, y = load_data("").stream(block_size, seed).batch(first=0, count=8, device="cpu")
"""
import functools
import os
from dataclasses import dataclass
from typing import Optional

import numpy as np

from data.prepare import (DEFAULT_OUT, DEFAULT_TOKENIZER, default_dir, get_tokenizer,  # noqa: F401
                          prepare_default, read_meta)

BRANCH_FRACTION = 0.1  # [S] the tail of the train split that only decay branches read


# -----------------------------------------------------------------------------
# the training windows

def windows(tokens, offsets, seq_len):
    """int64 array (len(offsets), seq_len + 1): the windows of tokens starting at offsets."""
    return np.stack([np.asarray(tokens[o:o + seq_len + 1], dtype=np.int64) for o in offsets])


class Stream:
    """Windows of seq_len + 1 tokens of tokens[start:stop], seq_len apart, read in a seeded random order per
    epoch: window n (counting from 0 over the whole run) depends on (seed, n) only: a checkpoint keeps n."""

    def __init__(self, tokens, seq_len, seed, start, stop, name):
        self.tokens, self.seq_len, self.seed, self.start, self.name = tokens, seq_len, seed, start, name
        self.n_windows = (stop - start - 1) // seq_len
        if self.n_windows < 1:
            raise ValueError(f"the {name} region of the data holds {stop - start:,} tokens, fewer than "
                             f"block_size + 1 = {seq_len + 1}")
        self._perm = (None, None)

    def permutation(self, epoch):
        if self._perm[0] != epoch:
            self._perm = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.n_windows))
        return self._perm[1]

    def offsets(self, first, count):
        """Token offsets of windows first .. first + count - 1."""
        index = np.arange(first, first + count)
        out = np.empty(count, dtype=np.int64)
        for epoch in np.unique(index // self.n_windows).tolist():
            sel = index // self.n_windows == epoch
            out[sel] = self.start + self.permutation(epoch)[index[sel] % self.n_windows] * self.seq_len
        return out

    def batch(self, first, count, device="cpu"):
        """(x, y) int64 tensors (count, seq_len) on device: windows first .. first + count - 1."""
        import torch
        device = torch.device(device)
        rows = torch.from_numpy(windows(self.tokens, self.offsets(first, count), self.seq_len))
        rows = rows.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else rows.to(device)
        return rows[:, :-1], rows[:, 1:]


# -----------------------------------------------------------------------------
# a prepared folder (trusted input: nothing is checked beyond meta.json being there)

@dataclass
class Data:
    data_dir: str
    meta: dict  # tokenizer, n_vocab, eot_token, dtype, sources, unigram_entropy, mean_doc_len, token counts
    train: np.ndarray
    val: np.ndarray
    val_sources: Optional[np.ndarray]  # source id of each val token (None without several sources)

    @property
    def source_names(self):
        return self.meta["sources"]

    @functools.cached_property
    def token_bytes(self):
        """int64 tensor (n_vocab,): UTF-8 bytes of each token id, 0 for eot (bits per byte's denominator)."""
        import torch
        encoding = get_tokenizer(self.meta["tokenizer"]).encoding
        lengths = [len(encoding.decode_single_token_bytes(i)) for i in range(encoding.n_vocab)]
        lengths[encoding.eot_token] = 0
        return torch.tensor(lengths, dtype=torch.int64)

    def stream(self, seq_len, seed, branch=False):
        """The stable region [0, n - int(n * 0.1)) of the train split, or (decay branches) the tail."""
        n = len(self.train)
        cut = n - int(n * BRANCH_FRACTION)
        start, stop, name = (cut, n, "branch") if branch else (0, cut, "stable")
        return Stream(self.train, seq_len, seed, start, stop, name)


def load_data(data_dir=""):
    """A data/prepare.py folder, memmapped ("": the embedded corpus, prepared offline on first use)."""
    if not data_dir:
        data_dir = DEFAULT_OUT
        if not read_meta(DEFAULT_OUT, DEFAULT_TOKENIZER):
            prepare_default(DEFAULT_OUT)
    meta = read_meta(data_dir)
    if meta is None:
        raise FileNotFoundError(f"{os.path.join(data_dir, 'meta.json')}: not found or not of this layout; "
                                f"run data/prepare.py ... --out {data_dir}")
    split = lambda name, dtype: np.memmap(os.path.join(data_dir, name), dtype=dtype, mode="r")
    sources = split("val_sources.bin", np.uint32) if len(meta["sources"]) > 1 else None
    return Data(data_dir, meta, split("train.bin", meta["dtype"]), split("val.bin", meta["dtype"]), sources)
