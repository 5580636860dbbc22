"""
Documents -> nanoGPT's train.bin and val.bin, every document PRECEDED by
<|endoftext|>; val_sources.bin; meta.json (docs/training.md).

    python data/prepare.py                       # the embedded corpus -> data/cache/default
    python data/prepare.py --tokenizer gpt2-257  # byte level (the ladders): default-gpt2-257
    python data/prepare.py my.jsonl notes/ --tokenizer gpt2 --out data/cache/mine
    python data/prepare.py --hf HuggingFaceFW/fineweb-edu --out data/cache/fineweb

Memory does not grow with the corpus: .jsonl and .parquet stream (a .txt or a --hf row is
read whole), the --val_fraction pass keeps one integer per document, and --workers changes
only the speed. --val_tokens takes the first documents: a random sample only of a shuffled
corpus (FineWeb). A killed prepare leaves a hidden .OUT.tmp-* folder beside OUT: delete it.
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

DATA_DIR = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT = os.path.join(DATA_DIR, "cache", "default")
DEFAULT_TOKENIZER = "gpt2-4096"
# OpenAI's r50k_base ranks (MIT), shipped.
RANKS = os.path.join(DATA_DIR, "tokenizer", "gpt2.tiktoken")
# The prepared folder's layout.
VERSION = 3


# -----------------------------------------------------------------------------
# tokenizers: GPT-2 BPE from the shipped ranks, offline

class Tokenizer:
    """A named tiktoken encoding."""

    def __init__(self, name, encoding):
        self.name, self.encoding = name, encoding
        self.n_vocab, self.eot_token = encoding.n_vocab, encoding.eot_token

    def encode(self, text):
        # "<|endoftext|>" in a document is text, not the eot token.
        return self.encoding.encode_ordinary(text)

    def decode(self, ids):
        return self.encoding.decode([int(i) for i in ids])


@functools.lru_cache(maxsize=8)
def get_tokenizer(name=DEFAULT_TOKENIZER):
    """'gpt2' (50,257 ids) or 'gpt2-N': the first N-1 GPT-2 ranks + <|endoftext|> = N-1."""
    if name == "gpt2":
        n_vocab = 50257
    elif re.fullmatch(r"gpt2-\d+", str(name)):
        n_vocab = int(name[5:])
    else:
        n_vocab = 0
    if not 257 <= n_vocab <= 50257:
        raise ValueError(f"unknown tokenizer {name!r}: 'gpt2' or 'gpt2-N' with 257 <= N <= 50257")
    with open(RANKS, "rb") as f:
        ranks = {base64.b64decode(token): int(rank) for token, rank in map(bytes.split, f)}
    # A prefix of the ranks is a valid BPE: the 256 bytes come first, and a
    # merge joins two tokens of lower rank.
    encoding = tiktoken.Encoding(
        name,
        pat_str=tiktoken_ext.openai_public.r50k_pat_str,
        mergeable_ranks={b: r for b, r in ranks.items() if r < n_vocab - 1},
        special_tokens={"<|endoftext|>": n_vocab - 1},
        explicit_n_vocab=n_vocab,
    )
    return Tokenizer(name, encoding)


# Where the embedded corpus is prepared: data/cache/default[-<tokenizer>].
def default_dir(tokenizer=DEFAULT_TOKENIZER):
    return DEFAULT_OUT if tokenizer == DEFAULT_TOKENIZER else f"{DEFAULT_OUT}-{tokenizer}"


# meta.json of a prepared folder, or None if absent or of another layout or tokenizer.
def read_meta(data_dir, tokenizer=None):
    try:
        with open(os.path.join(data_dir, "meta.json")) as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return None
    if meta.get("version") != VERSION or tokenizer not in (None, meta["tokenizer"]):
        return None
    return meta


DEFAULT_CORPUS = os.path.join(DATA_DIR, "corpus", "shakespeare.jsonl")
EXTENSIONS = (".txt", ".jsonl", ".parquet")
# Documents per call of tiktoken's batch encoder.
CHUNK = 1024
# A line <|endoftext|> separates the documents of a .txt.
EOT_LINE = re.compile(r"^[ \t]*<\|endoftext\|>[ \t]*(?:\n|$)", re.M)
FILES = ("train.bin", "val.bin", "val_sources.bin", "meta.json")


# -----------------------------------------------------------------------------
# reading documents: (text, source), in input order

# pyarrow and datasets (requirements-data.txt) are imported when needed.
def optional(module):
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ImportError(f"no module {module}: pip install -r requirements-data.txt") from None


# The documents of a .txt, .jsonl or .parquet file.
def read_file(path):
    # A document without a source gets the file's stem.
    stem = os.path.splitext(os.path.basename(path))[0]
    # Parquet: the columns text and (optional) source.
    if path.endswith(".parquet"):
        pq = optional("pyarrow.parquet")
        columns = [c for c in ("text", "source") if c in pq.read_schema(path).names]
        for batch in pq.ParquetFile(path).iter_batches(batch_size=1024, columns=columns):
            rows = batch.to_pydict()
            sources = rows.get("source", [None] * batch.num_rows)
            for text, source in zip(rows["text"], sources):
                yield text, source or stem
    # JSON lines: {"text": ..., "source": ...}, source optional.
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
    # Text: documents are separated by a line <|endoftext|>.
    else:
        with open(path, encoding="utf-8-sig") as f:
            for text in EOT_LINE.split(f.read()):
                yield text, stem


# The train split of a Hugging Face dataset, streamed.
def read_hf(name, config=None):
    stem = name.rstrip("/").split("/")[-1]
    rows = optional("datasets").load_dataset(name, config, split="train", streaming=True)
    for row in rows:
        yield row["text"], row.get("source") or stem


# Files as given; folders give their data files, recursively, sorted.
def expand(inputs):
    files = []
    for path in inputs:
        if os.path.isdir(path):
            pattern = os.path.join(glob.escape(path), "**", "*")
            files += sorted(f for f in glob.glob(pattern, recursive=True) if f.endswith(EXTENSIONS))
        else:
            files.append(path)
    return files


# The first max_documents non-blank documents.
def documents(files=(), hf=None, hf_config=None, max_documents=None):
    readers = [read_hf(hf, hf_config)] if hf else map(read_file, files)
    docs = (doc for reader in readers for doc in reader if doc[0].strip())
    return itertools.islice(docs, max_documents)


# -----------------------------------------------------------------------------
# the split, by document

# Val flags of the documents, a seeded draw.
def split_documents(sources, fraction, rng):
    is_val = np.zeros(len(sources), dtype=bool)
    # round(fraction * n) of n documents, at least 1 and never all.
    k = lambda n: min(max(1, math.floor(fraction * n + 0.5)), n - 1)
    # Each source of two or more documents gives its share ...
    for source in np.unique(sources):
        members = np.flatnonzero(sources == source)
        if len(members) >= 2:
            is_val[members[rng.permutation(len(members))[:k(len(members))]]] = True
    # ... or, if every source has one document, all of them give k.
    if not is_val.any():
        is_val[rng.permutation(len(sources))[:k(len(sources))]] = True
    return is_val


# (source ids {name: id}, an iterator of (doc, split)): split 0 train, 1 val.
def split_stream(read, val_fraction, val_tokens, seed, shuffle):
    # With val_tokens the split is None: write() fills val first.
    if val_tokens:
        return {}, ((doc, None) for doc in read())
    # shuffle (the embedded corpus): each split in a seeded order, in memory.
    corpus = list(read()) if shuffle else None
    read = (lambda: iter(corpus)) if shuffle else read
    # A first pass reads the sources; ids go in sorted order.
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
# writing

# Appends the stream to folder's .bin files; returns the tokens and documents per
# split and the train split's token counts.
def write(folder, stream, source_ids, tok, val_tokens, train_tokens, workers, verbose):
    dtype = np.uint16 if tok.n_vocab <= 2**16 else np.uint32
    n, docs, counts = [0, 0], [0, 0], np.zeros(tok.n_vocab, dtype=np.int64)
    outs = [open(os.path.join(folder, name), "wb") for name in FILES[:3]]
    bar = tqdm(
        desc=f"tokenizing ({tok.name})", unit="doc", leave=False, disable=None if verbose else True
    )
    # Chunks of documents go through tiktoken's batch encoder.
    for chunk in iter(lambda: list(itertools.islice(stream, CHUNK)), []):
        texts = [text for (text, _), _ in chunk]
        encoded = tok.encoding.encode_ordinary_batch(texts, num_threads=workers)
        # Train tokens, val tokens and val source ids.
        parts = ([], [], [])
        for ((_, source), split), ids in zip(chunk, encoded):
            if split is None:
                split = int(n[1] < val_tokens)
            # The eot token PRECEDES every document.
            tokens = np.array([tok.eot_token] + ids, dtype=dtype)
            # train_tokens cuts the train split short.
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
        # Both splits are full: read no further.
        if val_tokens and n[1] >= val_tokens and train_tokens and n[0] >= train_tokens:
            break
    bar.close()
    for f in outs:
        f.close()
    return n, docs, counts


def prepare(
    inputs=(),
    out_dir=None,
    tokenizer=DEFAULT_TOKENIZER,
    val_fraction=0.05,
    val_tokens=0,
    seed=0,
    workers=1,
    max_documents=None,
    train_tokens=0,
    hf=None,
    hf_config=None,
    shuffle=False,
    verbose=True,
    keep_existing=False,
):
    """Tokenize inputs (files or folders) or the dataset hf into out_dir.
    keep_existing: a folder another process prepared meanwhile wins."""
    start, tok, files = time.time(), get_tokenizer(tokenizer), expand(inputs)
    read = lambda: documents(files, hf, hf_config, max_documents)
    source_ids, stream = split_stream(read, val_fraction, val_tokens, seed, shuffle)
    out_dir = out_dir or default_dir(tok.name)
    parent, base = os.path.split(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    # Written into a temporary folder, renamed into place.
    tmp = tempfile.mkdtemp(prefix=f".{base}.tmp-", dir=parent)
    try:
        n, docs, counts = write(
            tmp, stream, source_ids, tok, val_tokens, train_tokens, workers, verbose
        )
        if not docs[0] or not docs[1]:
            raise ValueError(
                f"{docs[0]} train and {docs[1]} val documents: need at least 2 non-blank "
                "documents (a .txt separates them with a line <|endoftext|>), one in each split"
            )
        if len(source_ids) < 2:
            os.remove(os.path.join(tmp, "val_sources.bin"))
        # The unigram entropy is the loss of the best context-free model.
        p = counts[counts > 0] / counts.sum()
        settings = dict(
            val_fraction=None if val_tokens else val_fraction,
            val_tokens=val_tokens,
            seed=seed,
            max_documents=max_documents,
            train_tokens=train_tokens,
            shuffle=shuffle,
        )
        meta = dict(
            version=VERSION,
            tokenizer=tok.name,
            n_vocab=tok.n_vocab,
            eot_token=tok.eot_token,
            dtype="uint16" if tok.n_vocab <= 2**16 else "uint32",
            train_tokens=n[0],
            val_tokens=n[1],
            train_documents=docs[0],
            val_documents=docs[1],
            sources=list(source_ids),
            unigram_entropy=float(-(p * np.log(p)).sum()),
            mean_doc_len=n[0] / docs[0],
            inputs=[hf] if hf else [os.path.basename(f) for f in files],
            settings=settings,
        )
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f, indent=1)
        try:
            # mkdtemp's folder is 0o700. The rename is atomic.
            os.chmod(tmp, 0o755)
            os.rename(tmp, out_dir)
        except OSError:
            # out_dir exists: replace its files, meta.json out first and back last.
            if not (keep_existing and read_meta(out_dir, tok.name)):
                for name in ("meta.json", "val_sources.bin"):
                    with contextlib.suppress(FileNotFoundError):
                        os.remove(os.path.join(out_dir, name))
                for name in FILES:
                    if os.path.exists(os.path.join(tmp, name)):
                        os.replace(os.path.join(tmp, name), os.path.join(out_dir, name))
    finally:
        # Nothing is left after a failure.
        shutil.rmtree(tmp, ignore_errors=True)
    if verbose:
        print(
            f"prepared {out_dir} in {time.time() - start:.1f}s: train {n[0]:,} tokens "
            f"({docs[0]:,} documents), val {n[1]:,} ({docs[1]:,}); "
            f"sources: {len(source_ids)}; {tok.name}"
        )
    return out_dir


def prepare_default(out_dir=None, tokenizer=DEFAULT_TOKENIZER, verbose=True):
    """The embedded corpus into out_dir, unless it is prepared there already."""
    out_dir = out_dir or default_dir(tokenizer)
    if not read_meta(out_dir, tokenizer):
        prepare(
            [DEFAULT_CORPUS], out_dir, tokenizer, shuffle=True, verbose=verbose, keep_existing=True
        )
    return out_dir


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="prepare.py",
        usage=argparse.SUPPRESS,
        description="Tokenize documents into train.bin / val.bin and meta.json (docs/training.md).",
    )
    parser.add_argument(
        "inputs",
        nargs="*",
        help=".txt / .jsonl / .parquet files or folders "
        "(default: the embedded corpus, prepared as load_data('') reads it)",
    )
    parser.add_argument("--hf", help="a Hugging Face dataset to stream instead (needs datasets)")
    parser.add_argument("--hf_config", help="its configuration, e.g. sample-10BT")
    parser.add_argument(
        "--tokenizer", default=DEFAULT_TOKENIZER, help="gpt2 or gpt2-N (default: gpt2-4096)"
    )
    parser.add_argument(
        "--out",
        dest="out_dir",
        metavar="OUT",
        help="the output folder (required with inputs; the embedded corpus: "
        "data/cache/default, or data/cache/default-TOKENIZER)",
    )
    val = parser.add_mutually_exclusive_group()
    val.add_argument(
        "--val_fraction",
        type=float,
        default=0.05,
        help="val: this fraction of each source's documents, a seeded draw (default: 0.05)",
    )
    val.add_argument(
        "--val_tokens",
        type=int,
        default=0,
        help="val: the first documents, until they hold this many tokens (default: 0, off)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="of the val draw (default: %(default)s)"
    )
    parser.add_argument(
        "--workers", type=int, default=1, help="threads of the batch encoder (default: 1)"
    )
    parser.add_argument(
        "--max_documents", type=int, help="read only the first N non-blank documents"
    )
    parser.add_argument(
        "--train_tokens",
        type=int,
        default=0,
        help="keep only the first N train tokens (runs reread them: [X] D.1's unique tokens)",
    )
    args = parser.parse_args(argv)
    # No inputs: the embedded corpus.
    embedded = not args.inputs and not args.hf
    for path in args.inputs:
        if not os.path.isdir(path) and not (os.path.isfile(path) and path.endswith(EXTENSIONS)):
            parser.error(f"no such .txt, .jsonl or .parquet file or folder: {path}")
    # The embedded corpus has one split, load_data("")'s.
    split_options = (args.val_tokens, args.train_tokens, args.max_documents, args.seed)
    if embedded and (any(split_options) or args.val_fraction != 0.05):
        parser.error(
            "the embedded corpus is split as load_data('') reads it; to split it otherwise, "
            f"give {os.path.relpath(DEFAULT_CORPUS)} as an input, with --out"
        )
    # Other data needs a folder of its own.
    if not embedded and not args.out_dir:
        parser.error("--out is required with inputs or --hf")
    # The options are named as prepare()'s arguments.
    settings = vars(args)
    inputs = settings.pop("inputs")
    # A bad tokenizer, input line or missing extra: one line.
    try:
        prepare([DEFAULT_CORPUS] if embedded else inputs, shuffle=embedded, **settings)
    except (ValueError, ImportError) as e:
        parser.error(str(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
