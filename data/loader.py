"""
data/: the embedded corpus, offline GPT-2 tokenizers, prepare.py and this loader.
Training reads a prepared folder (train.bin, val.bin) as a seeded stream of windows:

    x, y = load_data("").stream(block_size, seed).batch(first=0, count=8)
    load_data("data/cache/mine").stream(block_size, seed, branch=True)  # the tail [S]
"""
import functools
import os
from dataclasses import dataclass
from typing import Optional

import numpy as np

from data.prepare import DEFAULT_OUT, DEFAULT_TOKENIZER, get_tokenizer, prepare_default, read_meta
from data.prepare import default_dir  # noqa: F401 (re-exported)

# The tail of the train split that only decay branches read. [S]
BRANCH_FRACTION = 0.1


# -----------------------------------------------------------------------------
# the training windows

# int64 array (len(offsets), seq_len + 1): the windows starting at offsets.
def windows(tokens, offsets, seq_len):
    return np.stack([np.asarray(tokens[o:o + seq_len + 1], dtype=np.int64) for o in offsets])


class Stream:
    """Windows of seq_len + 1 tokens of tokens[start:stop], seq_len apart."""

    def __init__(self, tokens, seq_len, seed, start, stop, name):
        self.tokens, self.seq_len, self.seed = tokens, seq_len, seed
        self.start, self.name = start, name
        self.n_windows = (stop - start - 1) // seq_len
        if self.n_windows < 1:
            raise ValueError(
                f"the {name} region of the data holds {stop - start:,} tokens, fewer than "
                f"block_size + 1 = {seq_len + 1}"
            )
        self._perm = (None, None)

    # Each epoch reads the windows in its own seeded order, so window n of the
    # run depends on (seed, n) only: a checkpoint needs to keep just n.
    def permutation(self, epoch):
        if self._perm[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._perm = (epoch, rng.permutation(self.n_windows))
        return self._perm[1]

    def offsets(self, first, count):
        """Token offsets of windows first .. first + count - 1."""
        index = np.arange(first, first + count)
        out = np.empty(count, dtype=np.int64)
        # The windows may span several epochs.
        for epoch in np.unique(index // self.n_windows).tolist():
            sel = index // self.n_windows == epoch
            window = self.permutation(epoch)[index[sel] % self.n_windows]
            out[sel] = self.start + window * self.seq_len
        return out

    def batch(self, first, count, device="cpu"):
        """(x, y) int64 tensors (count, seq_len) on device."""
        import torch
        device = torch.device(device)
        offsets = self.offsets(first, count)
        rows = torch.from_numpy(windows(self.tokens, offsets, self.seq_len))
        # Pinned memory lets the copy to the GPU run asynchronously.
        if device.type == "cuda":
            rows = rows.pin_memory().to(device, non_blocking=True)
        else:
            rows = rows.to(device)
        return rows[:, :-1], rows[:, 1:]


# -----------------------------------------------------------------------------
# a prepared folder, trusted: nothing is checked beyond meta.json

@dataclass
class Data:
    data_dir: str
    # tokenizer, n_vocab, dtype, sources, ... (docs/training.md)
    meta: dict
    train: np.ndarray
    val: np.ndarray
    # The source id of each val token; None with one source.
    val_sources: Optional[np.ndarray]

    @property
    def source_names(self):
        return self.meta["sources"]

    # The UTF-8 bytes of each token: bits per byte's denominator.
    @functools.cached_property
    def token_bytes(self):
        import torch
        encoding = get_tokenizer(self.meta["tokenizer"]).encoding
        lengths = [len(encoding.decode_single_token_bytes(i)) for i in range(encoding.n_vocab)]
        # The eot token is no text.
        lengths[encoding.eot_token] = 0
        return torch.tensor(lengths, dtype=torch.int64)

    def stream(self, seq_len, seed, branch=False):
        """The train split's stable region, or its tail (branch)."""
        n = len(self.train)
        cut = n - int(n * BRANCH_FRACTION)
        start, stop, name = (cut, n, "branch") if branch else (0, cut, "stable")
        return Stream(self.train, seq_len, seed, start, stop, name)


def load_data(data_dir=""):
    """A data/prepare.py folder, memmapped ("": the embedded corpus)."""
    # The embedded corpus is prepared on first use.
    if not data_dir:
        data_dir = DEFAULT_OUT
        if not read_meta(DEFAULT_OUT, DEFAULT_TOKENIZER):
            prepare_default(DEFAULT_OUT)
    meta = read_meta(data_dir)
    if meta is None:
        raise FileNotFoundError(
            f"{os.path.join(data_dir, 'meta.json')}: not found or not of this layout; "
            f"run data/prepare.py ... --out {data_dir}"
        )

    def split(name, dtype):
        return np.memmap(os.path.join(data_dir, name), dtype=dtype, mode="r")

    sources = split("val_sources.bin", np.uint32) if len(meta["sources"]) > 1 else None
    train, val = split("train.bin", meta["dtype"]), split("val.bin", meta["dtype"])
    return Data(data_dir, meta, train, val, sources)
