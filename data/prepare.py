"""
Documents -> nanoGPT's token files in a folder: train.bin and val.bin (uint16 token ids, uint32 above
65,536 ids), every document PRECEDED by <|endoftext|>; val_sources.bin (uint32: the source id of each val
token) when there are several sources; meta.json. See docs/data.md.

    python data/prepare.py                                # the embedded corpus -> data/cache/default
    python data/prepare.py my.jsonl notes/ --tokenizer gpt2 --out data/cache/mine
    python data/prepare.py --hf HuggingFaceFW/fineweb-edu --hf_config sample-10BT --tokenizer gpt2 \
        --val_tokens 10000000 --max_documents 1500000 --workers 16 --out data/cache/fineweb_gpt2
"""
import argparse
import base64
import contextlib
import functools
import glob
import importlib
import itertools
import json
import math
import os
import re
import shutil
import sys
import tempfile
import time

import numpy as np
import tiktoken
import tiktoken_ext.openai_public
from tqdm import tqdm

if __package__ in (None, ""):  # run as a script: python data/prepare.py
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DATA_DIR = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT = os.path.join(DATA_DIR, "cache", "default")
DEFAULT_TOKENIZER = "gpt2-4096"
RANKS = os.path.join(DATA_DIR, "tokenizer", "gpt2.tiktoken")  # OpenAI's r50k_base ranks (MIT), shipped
VERSION = 3  # of the prepared folder's layout: train.bin, val.bin, val_sources.bin, meta.json


# -----------------------------------------------------------------------------
# tokenizers: GPT-2 BPE from the shipped ranks file, never downloaded

class Tokenizer:
    """A named tiktoken encoding; encode() treats "<|endoftext|>" in text as plain text."""

    def __init__(self, name, encoding):
        self.name, self.encoding = name, encoding
        self.n_vocab, self.eot_token = encoding.n_vocab, encoding.eot_token

    def encode(self, text):
        return self.encoding.encode_ordinary(text)

    def decode(self, ids):
        return self.encoding.decode([int(i) for i in ids])


@functools.lru_cache(maxsize=8)
def get_tokenizer(name=DEFAULT_TOKENIZER):
    """'gpt2' (50,257 ids) or 'gpt2-N': the first N-1 GPT-2 ranks + <|endoftext|> = N-1. A prefix of the
    ranks is a valid BPE: the 256 bytes come first and every merge joins two lower-ranked tokens."""
    n_vocab = 50257 if name == "gpt2" else int(name[5:]) if re.fullmatch(r"gpt2-\d+", str(name)) else 0
    if not 257 <= n_vocab <= 50257:
        raise ValueError(f"unknown tokenizer {name!r}: 'gpt2' or 'gpt2-N' with 257 <= N <= 50257")
    with open(RANKS, "rb") as f:
        ranks = {base64.b64decode(token): int(rank) for token, rank in map(bytes.split, f)}
    encoding = tiktoken.Encoding(name, pat_str=tiktoken_ext.openai_public.r50k_pat_str,
                                 mergeable_ranks={b: r for b, r in ranks.items() if r < n_vocab - 1},
                                 special_tokens={"<|endoftext|>": n_vocab - 1}, explicit_n_vocab=n_vocab)
    return Tokenizer(name, encoding)


def default_dir(tokenizer=DEFAULT_TOKENIZER):
    """Where the embedded corpus is prepared: data/cache/default, or default-<tokenizer> for another one."""
    return DEFAULT_OUT if tokenizer == DEFAULT_TOKENIZER else f"{DEFAULT_OUT}-{tokenizer}"


def read_meta(data_dir, tokenizer=None):
    """meta.json of a prepared folder of this layout (and of this tokenizer, when given), or None."""
    try:
        with open(os.path.join(data_dir, "meta.json")) as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return None
    return meta if meta.get("version") == VERSION and tokenizer in (None, meta["tokenizer"]) else None


DEFAULT_CORPUS = os.path.join(DATA_DIR, "corpus", "shakespeare.jsonl")
EXTENSIONS = (".txt", ".jsonl", ".parquet")
CHUNK = 1024  # documents per call of tiktoken's batch encoder, appended to the files at once
EOT_LINE = re.compile(r"^[ \t]*<\|endoftext\|>[ \t]*(?:\n|$)", re.M)  # separates the documents of a .txt
FILES = ("train.bin", "val.bin", "val_sources.bin", "meta.json")


# -----------------------------------------------------------------------------
# reading documents: (text, source), streamed in input order

def optional(module):
    """pyarrow / datasets (requirements-data.txt), imported when first needed."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ImportError(f"no module {module}: pip install -r requirements-data.txt") from None


def read_file(path):
    """The documents of a .txt (separated by lines <|endoftext|>), .jsonl ({"text", optional "source"} per
    line) or .parquet file (columns text, optional source); the source defaults to the file's stem."""
    stem = os.path.splitext(os.path.basename(path))[0]
    if path.endswith(".parquet"):
        pq = optional("pyarrow.parquet")
        columns = [c for c in ("text", "source") if c in pq.read_schema(path).names]
        for batch in pq.ParquetFile(path).iter_batches(batch_size=1024, columns=columns):
            rows = batch.to_pydict()
            sources = rows.get("source", [None] * batch.num_rows)
            yield from ((text, source or stem) for text, source in zip(rows["text"], sources))
    elif path.endswith(".jsonl"):
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError:
                    row = None
                if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                    raise ValueError(f"{path}:{lineno}: not a JSON object with a string 'text'")
                yield row["text"], row.get("source") or stem
    else:
        with open(path, encoding="utf-8-sig") as f:
            yield from ((text, stem) for text in EOT_LINE.split(f.read()))


def read_hf(name, config=None):
    """The train split of a Hugging Face dataset, streamed by `datasets` (the network, only when asked)."""
    stem = name.rstrip("/").split("/")[-1]
    for row in optional("datasets").load_dataset(name, config, split="train", streaming=True):
        yield row["text"], row.get("source") or stem


def expand(inputs):
    """Files as given; a folder -> its .txt / .jsonl / .parquet files, recursively, sorted."""
    found = lambda folder: sorted(f for f in glob.glob(os.path.join(glob.escape(folder), "**", "*"),
                                                       recursive=True) if f.endswith(EXTENSIONS))
    return [file for path in inputs for file in (found(path) if os.path.isdir(path) else [path])]


def documents(files=(), hf=None, hf_config=None, max_documents=None):
    """(text, source) of every non-blank document in input order (the first max_documents of them)."""
    readers = [read_hf(hf, hf_config)] if hf else map(read_file, files)
    return itertools.islice((doc for reader in readers for doc in reader if doc[0].strip()), max_documents)


# -----------------------------------------------------------------------------
# the split, by document

def split_documents(sources, fraction, rng):
    """Val flags: each source with n >= 2 documents gives k = round(fraction * n) of them (at least 1,
    never all), a seeded draw; when every source has one document, k of all the documents."""
    is_val = np.zeros(len(sources), dtype=bool)
    k = lambda n: min(max(1, math.floor(fraction * n + 0.5)), n - 1)
    for source in np.unique(sources):
        members = np.flatnonzero(sources == source)
        if len(members) >= 2:
            is_val[members[rng.permutation(len(members))[:k(len(members))]]] = True
    if not is_val.any():
        is_val[rng.permutation(len(sources))[:k(len(sources))]] = True
    return is_val


def split_stream(read, val_fraction, val_tokens, seed, shuffle):
    """(source ids {name: id}, an iterator of ((text, source), split)): split 0 train, 1 val, None for
    "val until it holds val_tokens tokens" (decided as they are written). Else split_documents, after a first
    pass that reads each document's source (ids in sorted order). shuffle: each split in a seeded random
    order, the corpus in memory (the embedded corpus's)."""
    if val_tokens:
        return {}, ((doc, None) for doc in read())
    corpus = list(read()) if shuffle else None
    read = (lambda: iter(corpus)) if shuffle else read
    seen = {}
    first = np.array([seen.setdefault(source, len(seen)) for _, source in read()], dtype=np.int64)
    source_ids = {source: i for i, source in enumerate(sorted(seen))}
    rng = np.random.default_rng(seed)
    sources = np.array([source_ids[s] for s in seen], dtype=np.int64)[first]
    is_val = split_documents(sources, val_fraction, rng)
    if not shuffle:
        return source_ids, zip(read(), is_val.astype(int).tolist())
    order = [rng.permutation(np.flatnonzero(~is_val)), rng.permutation(np.flatnonzero(is_val))]
    return source_ids, ((corpus[i], int(is_val[i])) for i in np.concatenate(order))


# -----------------------------------------------------------------------------
# writing: chunks of documents through tiktoken's batch encoder, appended to the files

def write(folder, stream, source_ids, tok, val_tokens, train_tokens, workers, verbose):
    """Append the stream's documents to folder's train.bin, val.bin and val_sources.bin; returns
    (tokens per split, documents per split, the train split's token counts)."""
    dtype = np.uint16 if tok.n_vocab <= 2**16 else np.uint32
    n, docs, counts = [0, 0], [0, 0], np.zeros(tok.n_vocab, dtype=np.int64)
    outs = [open(os.path.join(folder, name), "wb") for name in FILES[:3]]
    bar = tqdm(desc=f"tokenizing ({tok.name})", unit="doc", leave=False, disable=None if verbose else True)
    for chunk in iter(lambda: list(itertools.islice(stream, CHUNK)), []):
        encoded = tok.encoding.encode_ordinary_batch([text for (text, _), _ in chunk], num_threads=workers)
        parts = ([], [], [])  # train tokens, val tokens, val source ids
        for ((_, source), split), ids in zip(chunk, encoded):
            split = int(n[1] < val_tokens) if split is None else split
            tokens = np.array([tok.eot_token] + ids, dtype=dtype)  # eot PRECEDES every document
            if split == 0 and train_tokens:
                tokens = tokens[:max(0, train_tokens - n[0])]
            if len(tokens):
                parts[split].append(tokens)
                n[split], docs[split] = n[split] + len(tokens), docs[split] + 1
                sid = source_ids.setdefault(source, len(source_ids))
                if split:
                    parts[2].append(np.full(len(tokens), sid, dtype=np.uint32))
        parts = [np.concatenate(p) if p else np.zeros(0, np.uint16) for p in parts]
        for f, part in zip(outs, parts):
            f.write(part.tobytes())
        counts += np.bincount(parts[0], minlength=tok.n_vocab)
        bar.update(len(chunk))
        if val_tokens and n[1] >= val_tokens and train_tokens and n[0] >= train_tokens:
            break  # both splits are full: read no further
    bar.close()
    for f in outs:
        f.close()
    return n, docs, counts


def prepare(inputs=(), out_dir=None, tokenizer=DEFAULT_TOKENIZER, val_fraction=0.05, val_tokens=0, seed=0,
            workers=1, max_documents=None, train_tokens=0, hf=None, hf_config=None, shuffle=False,
            verbose=True, keep_existing=False):
    """Tokenize the documents of inputs (files or folders) or of the dataset hf into out_dir (split_stream
    says how they are split); train_tokens > 0 keeps the first train_tokens train tokens. Written in a
    temporary folder renamed into place; keep_existing: a folder another process prepared meanwhile wins."""
    start, tok, files = time.time(), get_tokenizer(tokenizer), expand(inputs)
    read = lambda: documents(files, hf, hf_config, max_documents)
    source_ids, stream = split_stream(read, val_fraction, val_tokens, seed, shuffle)
    out_dir = out_dir or default_dir(tok.name)
    parent, base = os.path.split(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{base}.tmp-", dir=parent)
    try:
        n, docs, counts = write(tmp, stream, source_ids, tok, val_tokens, train_tokens, workers, verbose)
        if not docs[0] or not docs[1]:
            raise ValueError(f"{docs[0]} train and {docs[1]} val documents: need at least 2 non-blank "
                             "documents (a .txt separates them with a line <|endoftext|>), one in each split")
        if len(source_ids) < 2:
            os.remove(os.path.join(tmp, "val_sources.bin"))
        p = counts[counts > 0] / counts.sum()
        meta = dict(version=VERSION, tokenizer=tok.name, n_vocab=tok.n_vocab, eot_token=tok.eot_token,
                    dtype="uint16" if tok.n_vocab <= 2**16 else "uint32", train_tokens=n[0], val_tokens=n[1],
                    train_documents=docs[0], val_documents=docs[1], sources=list(source_ids),
                    unigram_entropy=float(-(p * np.log(p)).sum()), mean_doc_len=n[0] / docs[0],
                    inputs=[hf] if hf else [os.path.basename(f) for f in files],
                    settings=dict(val_fraction=None if val_tokens else val_fraction, val_tokens=val_tokens,
                                  seed=seed, max_documents=max_documents, train_tokens=train_tokens,
                                  shuffle=shuffle))
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f, indent=1)
        try:
            os.chmod(tmp, 0o755)  # mkdtemp's is 0o700
            os.rename(tmp, out_dir)  # atomic: out_dir did not exist (or was empty)
        except OSError:  # it exists: replace its files, meta.json out first and back last
            if not (keep_existing and read_meta(out_dir, tok.name)):
                for name in ("meta.json", "val_sources.bin"):
                    with contextlib.suppress(FileNotFoundError):
                        os.remove(os.path.join(out_dir, name))
                for name in FILES:
                    if os.path.exists(os.path.join(tmp, name)):
                        os.replace(os.path.join(tmp, name), os.path.join(out_dir, name))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone after the rename; else what is left of it
    if verbose:
        print(f"prepared {out_dir} in {time.time() - start:.1f}s: train {n[0]:,} tokens ({docs[0]:,} "
              f"documents), val {n[1]:,} ({docs[1]:,}); sources: {len(source_ids)}; {tok.name}")
    return out_dir


def prepare_default(out_dir=None, tokenizer=DEFAULT_TOKENIZER, verbose=True):
    """The embedded corpus, split as load_data("") reads it, into out_dir (default: data/cache/default, or
    default-<tokenizer>), unless it is prepared there already."""
    out_dir = out_dir or default_dir(tokenizer)
    if not read_meta(out_dir, tokenizer):
        prepare([DEFAULT_CORPUS], out_dir, tokenizer, shuffle=True, verbose=verbose, keep_existing=True)
    return out_dir


def main(argv=None):
    parser = argparse.ArgumentParser(prog="prepare.py", usage=argparse.SUPPRESS, description="Tokenize "
                                     "documents into train.bin / val.bin and meta.json (docs/data.md).")
    parser.add_argument("inputs", nargs="*", help=".txt / .jsonl / .parquet files or folders (default: the "
                                                  "embedded corpus, prepared as load_data('') reads it)")
    parser.add_argument("--hf", help="a Hugging Face dataset to stream instead (needs datasets)")
    parser.add_argument("--hf_config", help="its configuration, e.g. sample-10BT")
    parser.add_argument("--tokenizer", default=DEFAULT_TOKENIZER, help="gpt2 or gpt2-N (default: gpt2-4096)")
    parser.add_argument("--out", help="the output folder (required with inputs; the embedded corpus: "
                                      "data/cache/default, or data/cache/default-TOKENIZER)")
    val = parser.add_mutually_exclusive_group()
    val.add_argument("--val_fraction", type=float, default=0.05,
                     help="val: this fraction of each source's documents, a seeded draw (default: 0.05)")
    val.add_argument("--val_tokens", type=int, default=0,
                     help="val: the first documents, until they hold this many tokens (default: 0, off)")
    parser.add_argument("--seed", type=int, default=0, help="of the val draw (default: %(default)s)")
    parser.add_argument("--workers", type=int, default=1, help="threads of the batch encoder (default: 1)")
    parser.add_argument("--max_documents", type=int, help="read only the first N non-blank documents")
    parser.add_argument("--train_tokens", type=int, default=0,
                        help="keep only the first N train tokens (runs reread them: [X] D.1's unique tokens)")
    args = parser.parse_args(argv)
    embedded = not args.inputs and not args.hf
    for path in args.inputs:
        if not os.path.isdir(path) and not (os.path.isfile(path) and path.endswith(EXTENSIONS)):
            parser.error(f"no such .txt, .jsonl or .parquet file or folder: {path}")
    if embedded and (args.val_tokens or args.train_tokens or args.max_documents or args.seed
                     or args.val_fraction != 0.05):
        parser.error("the embedded corpus is split as load_data('') reads it; to split it otherwise, give "
                     f"{os.path.relpath(DEFAULT_CORPUS)} as an input, with --out")
    if not embedded and not args.out:
        parser.error("--out is required with inputs or --hf")
    try:
        prepare([DEFAULT_CORPUS] if embedded else args.inputs, args.out, args.tokenizer, args.val_fraction,
                args.val_tokens, args.seed, args.workers, args.max_documents, args.train_tokens, args.hf,
                args.hf_config, shuffle=embedded)
    except (ValueError, ImportError) as e:  # a bad tokenizer name, a malformed input line, a missing extra
        parser.error(str(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
