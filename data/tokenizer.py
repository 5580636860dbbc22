"""
Offline GPT-2 BPE tokenizers built with tiktoken from the ranks file shipped in this repo
(data/tokenizer/gpt2.tiktoken, byte-identical to OpenAI's r50k_base.tiktoken, MIT; see
data/tokenizer/README.md). Nothing is ever downloaded: tiktoken.get_encoding is not used.

    get_tokenizer("gpt2")       # full GPT-2: 50,256 BPE ranks + <|endoftext|> = 50256, n_vocab 50,257
    get_tokenizer("gpt2-4096")  # first 4,095 GPT-2 ranks + <|endoftext|> = 4095, n_vocab 4,096

Why a prefix of the ranks is a valid smaller BPE: the ranks list the 256 single bytes first, then
each merge in priority order, and every merged token is the concatenation of two lower-ranked tokens.
Keeping ranks < N-1 therefore keeps every byte (so any text round-trips) and a merge-closed set of
tokens; encoding just stops merging earlier. For CPU runs the LM head is what costs: vocab 4,096
instead of 50,257 makes it 12x smaller, at about 2.6 characters per token instead of 4.
"""
import argparse
import functools
import os
import sys

import numpy as np
import tiktoken
import tiktoken.load
import tiktoken_ext.openai_public

if __package__ in (None, ""):  # run as a script: python data/tokenizer.py
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tooling.common import cli_error

RANKS_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tokenizer", "gpt2.tiktoken")
RANKS_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"  # r50k_base.tiktoken
GPT2_N_RANKS = 50256  # BPE ranks in the file; <|endoftext|> comes after them
MIN_VOCAB = 257       # 256 byte tokens + <|endoftext|>
ENDOFTEXT = "<|endoftext|>"
VALID_NAMES = (f"'gpt2' or 'gpt2-N' with {MIN_VOCAB} <= N <= {GPT2_N_RANKS + 1} "
               "(e.g. 'gpt2-512', 'gpt2-4096', 'gpt2-16384')")


class Tokenizer:
    """A named tiktoken encoding: .encode(text) -> ids (special tokens treated as plain text), .decode(ids)."""

    def __init__(self, name, encoding):
        self.name = name
        self.encoding = encoding
        self.n_vocab = encoding.n_vocab
        self.eot_token = encoding.eot_token

    def encode(self, text):
        return self.encoding.encode_ordinary(text)

    def encode_batch(self, texts, num_threads=2):
        return self.encoding.encode_ordinary_batch(list(texts), num_threads=num_threads)

    def decode(self, ids):
        return self.encoding.decode([int(i) for i in ids])

    def __repr__(self):
        return f"Tokenizer(name={self.name!r}, n_vocab={self.n_vocab}, eot_token={self.eot_token})"


@functools.lru_cache(maxsize=1)
def load_gpt2_ranks(path=RANKS_PATH):
    """{token bytes: rank} for the 50,256 GPT-2 BPE ranks; checks the file's sha256."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"GPT-2 ranks file not found: {path} (it ships with the repo under data/tokenizer/)")
    try:
        return tiktoken.load.load_tiktoken_bpe(path, expected_hash=RANKS_SHA256)
    except ValueError as e:
        raise ValueError(f"GPT-2 ranks file {path} is corrupt (sha256 differs from r50k_base): {e}") from None


def vocab_size_from_name(name):
    """'gpt2' -> 50257, 'gpt2-4096' -> 4096; ValueError listing the valid names otherwise."""
    if name == "gpt2":
        return GPT2_N_RANKS + 1
    prefix, _, size = str(name).partition("-")
    if prefix == "gpt2" and size.isdigit() and MIN_VOCAB <= int(size) <= GPT2_N_RANKS + 1:
        return int(size)
    raise ValueError(f"unknown tokenizer {name!r}; valid names: {VALID_NAMES}")


@functools.lru_cache(maxsize=8)
def get_tokenizer(name="gpt2-4096"):
    """The tokenizer called `name`: 'gpt2' (full GPT-2) or 'gpt2-N' (first N-1 ranks + <|endoftext|> = N-1)."""
    n_vocab = vocab_size_from_name(name)
    ranks = load_gpt2_ranks()
    mergeable_ranks = ranks if n_vocab == GPT2_N_RANKS + 1 else {b: r for b, r in ranks.items() if r < n_vocab - 1}
    encoding = tiktoken.Encoding(
        name,
        pat_str=tiktoken_ext.openai_public.r50k_pat_str,  # tiktoken's own GPT-2 split pattern
        mergeable_ranks=mergeable_ranks,
        special_tokens={ENDOFTEXT: n_vocab - 1},
        explicit_n_vocab=n_vocab,
    )
    return Tokenizer(name, encoding)


@functools.lru_cache(maxsize=8)
def _byte_lengths(name):
    tok = get_tokenizer(name)
    lengths = np.array([len(tok.encoding.decode_single_token_bytes(i)) for i in range(tok.n_vocab)], dtype=np.int64)
    lengths[tok.eot_token] = 0  # the separator stands for no text
    lengths.flags.writeable = False  # shared by every caller (cached)
    return lengths


def token_byte_lengths(tokenizer_name_or_meta):
    """int64 array (n_vocab,): the UTF-8 byte length of each token id's decoding, 0 for <|endoftext|>. The
    denominator of bits per byte: BPB = sum of CE nats over target tokens / (ln 2 * sum of their byte
    lengths). Takes a tokenizer name or a data/prepare.py meta.json dict (its "tokenizer")."""
    name = tokenizer_name_or_meta["tokenizer"] if isinstance(tokenizer_name_or_meta, dict) else tokenizer_name_or_meta
    return _byte_lengths(name)


def main(argv=None):
    parser = argparse.ArgumentParser(description="Encode a text with an offline GPT-2 tokenizer and decode it back.")
    parser.add_argument("name", nargs="?", default="gpt2-4096", help=VALID_NAMES)
    parser.add_argument("text", nargs="?", default="hello world")
    args = parser.parse_args(argv)
    try:
        tok = get_tokenizer(args.name)
    except (OSError, ValueError) as e:
        return cli_error("tokenizer.py", e)
    ids = tok.encode(args.text)
    print(tok, ids, repr(tok.decode(ids)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
