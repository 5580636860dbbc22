"""
Turn text documents into token shards: fixed-size nanoGPT-style memmaps per split, a sources sidecar per
shard, and meta.json, the index, written last. Streams: memory stays bounded whatever the corpus size.

    python data/prepare.py                                  # the embedded corpus -> data/cache/default
    python data/prepare.py my.jsonl notes/*.txt --tokenizer gpt2 --out data/cache/mine
    python data/prepare.py fineweb/*.parquet --tokenizer gpt2 --out data/cache/fineweb_gpt2 \
        --workers 16 --val_tokens 10000000
    python data/prepare.py --hf HuggingFaceFW/fineweb-edu --hf_config sample-10BT --tokenizer gpt2 --out DIR
    python data/prepare.py --verify --out data/cache/mine   # re-read every shard and check it

Inputs (files or folders, folders searched recursively for *.txt, *.jsonl and *.parquet):
  .jsonl    one document per line: {"text": str, "source": str (optional)}; other fields are ignored.
  .txt      one document per file; a line holding only <|endoftext|> (spaces around it allowed) separates documents.
  .parquet  a string column `text`, optional string column `source` (needs pyarrow: requirements-data.txt).
  --hf NAME a Hugging Face dataset read in streaming mode by `datasets` (requirements-data.txt): its
            `text` column, and `source` when it has one. Only when asked; nothing else touches the network.
  A document without a source label gets its file's stem as source (my.jsonl -> "my"; --hf: the name's
  last part, "fineweb-edu"). Empty (blank) documents are skipped and counted.

Output in DIR (a shard is written under a temp name and renamed when complete; meta.json is written last,
so a folder without meta.json is an incomplete prepare and is refused by the loader):
  {split}_{k:06d}.bin          shard k of split 'train' or 'val': flat token ids (uint16 when n_vocab <=
                               65536, else uint32), exactly --shard_tokens tokens except the split's last
                               shard. Every document is PRECEDED by eot_token: eot is the BOS / separator,
                               so a document mask that starts a new document at each eot sees exactly one
                               document per segment. A document may continue into the next shard of its
                               split; train and val never share a document.
  {split}_{k:06d}_sources.npy  int64 (n, 4): [start, end, source_id, doc_index] of the documents that start
                               in shard k, as positions in the whole split (its shards concatenated):
                               tokens[start] == eot, tokens[start+1:end] is the document; over all shards
                               the spans tile the split. source_id indexes meta["sources"]; doc_index =
                               position among the input's non-empty documents.
  meta.json                    tokenizer, n_vocab, eot_token, dtype, per split token / document / byte
                               counts and per-source counts, unigram baselines, the shard index (file,
                               tokens, documents, largest token id, sha256), the corpus fingerprint.

Split (document level, stratified by source, deterministic given --seed, never holding the corpus): a first
cheap pass counts each source's documents (no tokenizing); then each source with n >= 2 documents gives k
of them to val, k = max(1, round(f * n)) but never all n, chosen by a seeded draw of k ranks among the
source's documents (if every source has a single document, k of all documents). With --val_fraction f
that is the rule of the first version of this file, draw included (the same documents go to val). With
--val_tokens B, f = B / (the corpus's tokens, estimated in the first pass from each source's bytes and its
tokens per byte on every 100th document), so val holds about B tokens in whole documents (the exact count
is in meta.json) with each source in proportion to its size. The second pass tokenizes with --workers
processes, chunks of documents in input order, results written in input order: the output is
byte-identical for any number of workers (from Python, call prepare(workers > 1) under
`if __name__ == "__main__":`: the workers are spawned and import the calling script).
--shuffle_documents writes each split's documents in a seeded random order instead (the first version's
order; it holds the corpus in memory: small corpora only, the embedded one uses it so that its numbers
stay). --max_documents N keeps the first N non-empty documents (a slice of a large dataset).

A killed prepare leaves no meta.json and no shard under its final name that was not complete; rerunning
rebuilds the folder from scratch (it first removes every shard, sidecar and temp file of this layout
there), so a folder never mixes two prepares. Opening checks what is cheap (meta.json, every listed file
present with the size meta.json says, each shard's largest token id recorded at prepare time below
n_vocab): start-up time does not grow with the corpus. --verify reads everything. Reading the inputs is
data/documents.py, opening a prepared folder data/shards.py.
"""
import collections
import concurrent.futures
import contextlib
import glob
import hashlib
import json
import math
import multiprocessing
import os
import re
import sys
import tempfile
import time
from array import array

import numpy as np
from tqdm import tqdm

if __package__ in (None, ""):  # run as a script: python data/prepare.py
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tooling.common import TEMP_MARK, check_regular, cli_error, current_umask, write_atomic
from tooling.common import parser as common_parser  # write_atomic is also imported from here (ladder.py)
from data.documents import Corpus, corpus_fingerprint, expand_inputs
from data.shards import PREPARE_VERSION, SPLITS, load_meta, load_sources, token_dtype
from data.tokenizer import ENDOFTEXT, get_tokenizer

DATA_DIR = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CORPUS = os.path.join(DATA_DIR, "corpus", "shakespeare.jsonl")
DEFAULT_OUT = os.path.join(DATA_DIR, "cache", "default")
DEFAULT_SHARD_TOKENS = 100_000_000  # 200 MB of uint16 per shard, as modded-nanogpt's FineWeb shards
MIN_SHARD_TOKENS = 1024
CHUNK_BYTES = 1 << 20  # documents are sent to a worker in chunks of about 1 MB of text
SAMPLE_EVERY = 100  # --val_tokens: tokens per byte measured on every 100th document of each source
SHARD_NAME = re.compile(r"^(train|val)_\d{6}(\.bin|_sources\.npy)$")
OLD_LAYOUT = ("train.bin", "val.bin", "train_sources.npy", "val_sources.npy")  # version 1, one file per split


def shard_name(split, k):
    return f"{split}_{k:06d}.bin"


def sidecar_name(split, k):
    return f"{split}_{k:06d}_sources.npy"


# -----------------------------------------------------------------------------
# split: which documents go to val, decided from per-source document counts

def count_documents(documents, tok=None, verbose=False):
    """First pass, no tokenizing: {source: [documents, utf-8 bytes, sampled bytes, sampled tokens]}; with a
    tokenizer, every SAMPLE_EVERY-th document of each source (its first included) is tokenized for the
    tokens-per-byte estimate --val_tokens needs."""
    counts = {}
    for text, source in tqdm(documents, desc="counting documents", unit="doc", leave=False,
                             disable=None if verbose else True):
        c = counts.setdefault(source, [0, 0, 0, 0])
        n_bytes = len(text.encode("utf-8"))
        if tok is not None and c[0] % SAMPLE_EVERY == 0:
            c[2] += n_bytes
            c[3] += len(tok.encode(text))
        c[0] += 1
        c[1] += n_bytes
    return counts


def count_file(job):
    """A first-pass job: (path, tokenizer name or None, most documents to count or None) -> that file's counts."""
    path, name, limit = job
    return count_documents(Corpus([path], max_documents=limit), get_tokenizer(name) if name else None)


def count_corpus(corpus, tokenizer_name, pool, workers, verbose):
    """The first pass over all inputs, one job per file (on the workers; in order when --max_documents must
    know where to stop), the counts summed per source. The tokens-per-byte sample is per file (every
    SAMPLE_EVERY-th document of each source in each file), so the result does not depend on the workers."""
    if corpus.hf:
        return count_documents(corpus, get_tokenizer(tokenizer_name) if tokenizer_name else None, verbose)
    if corpus.max_documents is None:
        results = in_order(count_file, ((path, tokenizer_name, None) for path in corpus.files), pool, workers)
    else:
        def in_turn(remaining=corpus.max_documents):
            for path in corpus.files:
                if remaining:
                    counts = count_file((path, tokenizer_name, remaining))
                    remaining -= sum(c[0] for c in counts.values())
                    yield counts
        results = in_turn()
    total = {}
    for counts in tqdm(results, total=len(corpus.files), desc="counting documents", unit="file", leave=False,
                       disable=None if verbose else True):
        for source, c in counts.items():
            total[source] = [a + b for a, b in zip(total.get(source, [0, 0, 0, 0]), c)]
    return total


def val_fraction_for_tokens(counts, val_tokens):
    """--val_tokens as a fraction of the corpus's estimated tokens (each document: its eot + bytes * tokens/byte)."""
    estimate = sum(n + n_bytes * (s_tokens / s_bytes if s_bytes else 1.0)
                   for n, n_bytes, s_bytes, s_tokens in counts.values())
    if val_tokens >= estimate:
        raise ValueError(f"--val_tokens {val_tokens:,} is not below the corpus's ~{estimate:,.0f} tokens")
    return val_tokens / estimate


def choose_val(doc_counts, fraction, seed, few=False):
    """{source: sorted ranks, among that source's documents, of its val documents} (or {None: sorted indices
    among all documents} when every source has a single document), and the generator after the draws.
    few=False draws a permutation of each source (the first version's draw, reproduced exactly);
    few=True draws k of n without replacement (rng.choice: memory ~ k, for --val_tokens' few of many)."""
    n_docs = sum(doc_counts.values())
    if n_docs < 2:
        raise ValueError(f"need at least 2 non-empty documents for a train/val split, got {n_docs} "
                         f"(separate documents in a .txt with a line '{ENDOFTEXT}', or use .jsonl)")
    rng = np.random.default_rng(seed)
    draw = (lambda n, k: rng.choice(n, k, replace=False)) if few else (lambda n, k: rng.permutation(n)[:k])
    count = lambda n: min(max(1, math.floor(fraction * n + 0.5)), n - 1)  # at least one, never all
    ranks = {source: np.sort(draw(n, count(n))) for source, n in sorted(doc_counts.items()) if n >= 2}
    if not ranks:  # every source has a single document: split across sources instead
        ranks = {None: np.sort(draw(n_docs, count(n_docs)))}
    return ranks, rng


class ValMembership:
    """Streams the val decision: documents arrive in input order, each source's k-th is val when k is one
    of that source's drawn ranks (sorted, so one pointer per source suffices)."""

    def __init__(self, ranks):
        self.ranks, self.seen, self.next = ranks, collections.Counter(), collections.Counter()

    def is_val(self, source, doc_index):
        key = None if None in self.ranks else source
        position = doc_index if key is None else self.seen[source]
        self.seen[source] += 1
        ranks, i = self.ranks.get(key), self.next[key]
        if ranks is not None and i < len(ranks) and ranks[i] == position:
            self.next[key] += 1
            return True
        return False


# -----------------------------------------------------------------------------
# tokenizing: chunks of documents, in order, on `workers` processes

def chunks_of(documents, chunk_bytes=CHUNK_BYTES):
    """Group (doc_index, text, source_id, split_index) into (texts, int64 rows [doc_index, source_id, split])
    of about chunk_bytes characters each."""
    texts, rows, size = [], [], 0
    for doc_index, text, source_id, split_index in documents:
        texts.append(text)
        rows.append((doc_index, source_id, split_index))
        size += len(text)
        if size >= chunk_bytes:
            yield texts, np.array(rows, dtype=np.int64)
            texts, rows, size = [], [], 0
    if texts:
        yield texts, np.array(rows, dtype=np.int64)


def tokenize_chunk(job):
    """A worker's job: (tokenizer name, (texts, rows)) -> (rows, token count per document (its eot included),
    utf-8 bytes per document, characters, flat tokens with an eot before each document)."""
    name, (texts, rows) = job
    tok = get_tokenizer(name)  # built once per process (lru_cache)
    ids = [tok.encoding.encode_ordinary(t) for t in texts]  # one thread per worker: the workers are the parallelism
    lengths = np.array([1 + len(x) for x in ids], dtype=np.int64)
    tokens = np.empty(int(lengths.sum()), dtype=token_dtype(tok.n_vocab))
    position = 0
    for x in ids:
        tokens[position] = tok.eot_token  # every document is PRECEDED by eot
        tokens[position + 1:position + 1 + len(x)] = x
        position += 1 + len(x)
    n_bytes = np.array([len(t.encode("utf-8")) for t in texts], dtype=np.int64)
    return rows, lengths, n_bytes, sum(map(len, texts)), tokens


@contextlib.contextmanager
def worker_pool(workers):
    """workers == 1: no pool (everything in this process); else a pool of worker processes, started with
    spawn (safe beside threads, e.g. torch's), shut down when the `with` block ends."""
    if workers == 1:
        yield None
        return
    pool = concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
    try:
        yield pool
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def in_order(function, jobs, pool, workers):
    """function(job) for every job, results in job order: in this process without a pool, else on the pool
    with at most 2 * workers jobs in flight (reading every job ahead would be unbounded memory). A worker
    that dies (killed, out of memory) ends the prepare with one line instead of waiting for it forever."""
    if pool is None:
        yield from map(function, jobs)
        return
    pending = collections.deque()
    try:
        for job in jobs:
            pending.append(pool.submit(function, job))
            if len(pending) >= 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    except concurrent.futures.process.BrokenProcessPool:
        raise RuntimeError("a worker process died (killed, or out of memory?); nothing of this prepare is "
                           "complete: rerun it, with fewer --workers if memory ran out") from None


# -----------------------------------------------------------------------------
# writing: one ShardWriter per split

class ShardWriter:
    """One split's shards: documents appended in order, the token stream cut every shard_tokens tokens. A
    shard fills a temp file (the naming of tooling.common.write_atomic, kept open while it fills), renamed
    to its final name when complete; its sidecar follows (write_atomic)."""

    def __init__(self, out_dir, split, shard_tokens, dtype):
        self.out_dir, self.split, self.shard_tokens, self.dtype = out_dir, split, shard_tokens, np.dtype(dtype)
        self.position = 0  # tokens written to this split so far
        self.shards = []  # the meta.json entries of the complete shards
        self.file = None
        self.spans = array("q")  # [start, end, source_id, doc_index] of the documents starting in this shard

    def add(self, tokens, source_id, doc_index):
        """One document (its leading eot included); it continues into the next shard if this one fills."""
        self.spans.extend((self.position, self.position + len(tokens), source_id, doc_index))
        while len(tokens):
            if self.file is None:
                self.open_shard()
            piece, tokens = tokens[:self.shard_tokens - self.in_shard], tokens[self.shard_tokens - self.in_shard:]
            self.file.write(piece.data)
            self.sha256.update(piece.data)
            self.max_token = max(self.max_token, int(piece.max()))
            self.in_shard += len(piece)
            self.position += len(piece)
            if self.in_shard == self.shard_tokens:
                self.close_shard()

    def open_shard(self):
        name = shard_name(self.split, len(self.shards))
        fd, self.tmp = tempfile.mkstemp(dir=self.out_dir, prefix=f".{name}{TEMP_MARK}")
        self.file, self.in_shard, self.max_token, self.sha256 = os.fdopen(fd, "wb"), 0, 0, hashlib.sha256()

    def close_shard(self):
        k = len(self.shards)
        self.file.close()
        self.file = None
        os.chmod(self.tmp, 0o666 & ~current_umask())
        os.replace(self.tmp, os.path.join(self.out_dir, shard_name(self.split, k)))  # complete: its final name
        spans = np.frombuffer(self.spans, dtype=np.int64).reshape(-1, 4)
        write_atomic(os.path.join(self.out_dir, sidecar_name(self.split, k)), lambda f: np.save(f, spans))
        self.shards.append(dict(file=shard_name(self.split, k), sources=sidecar_name(self.split, k),
                                tokens=self.in_shard, documents=len(spans), max_token=self.max_token,
                                sha256=self.sha256.hexdigest()))
        self.spans = array("q")

    def seal(self):
        """Close the last (short) shard and return the meta.json entries of all of them."""
        if self.file is not None:
            self.close_shard()
        return self.shards

    def abandon(self):
        """After an error: remove the shard being written (a SIGKILL leaves it, under its temp name)."""
        if self.file is not None:
            self.file.close()
            os.remove(self.tmp)
            self.file = None


def check_out_folder(out_dir):
    """Refuse, before anything is read or removed, an output folder that holds data this module did not write:
    a meta.json that is not a data/prepare.py index, or train.bin / val.bin (a nanoGPT folder) without one."""
    meta_path = os.path.join(out_dir, "meta.json")
    if not out_dir:
        raise ValueError("--out is empty: name the output folder")
    if os.path.exists(meta_path):
        try:
            check_regular(meta_path, "the index")  # a pipe there would block the read
            with open(meta_path) as f:
                ours = json.load(f).get("format") == "loopstudy-tokens"
        except (OSError, ValueError, AttributeError):
            ours = False
        if not ours:
            raise ValueError(f"{meta_path} is not a data/prepare.py index: refusing to write into {out_dir} (its "
                             "files would be replaced); choose another --out")
    elif os.path.isdir(out_dir) and any(os.path.exists(os.path.join(out_dir, n)) for n in OLD_LAYOUT):
        raise ValueError(f"{out_dir} holds train.bin / val.bin but no data/prepare.py meta.json: refusing to replace "
                         "them; choose another --out")


def clear_folder(out_dir):
    """Remove what a previous prepare left in out_dir (meta.json first: the folder is incomplete from now on),
    only files of this layout: shards, sidecars, the old single-file layout, and temp files of either."""
    os.makedirs(out_dir, exist_ok=True)
    for name in ["meta.json"] + sorted(os.listdir(out_dir)):
        temp = name.startswith(".") and TEMP_MARK in name and SHARD_NAME.match(name[1:name.index(TEMP_MARK)])
        if name == "meta.json" or SHARD_NAME.match(name) or name in OLD_LAYOUT or temp:
            try:
                os.remove(os.path.join(out_dir, name))
            except FileNotFoundError:
                pass
    for stale in glob.glob(os.path.join(glob.escape(out_dir), f".meta.json{TEMP_MARK}*")):
        os.remove(stale)


def unigram_baselines(train_counts, val_counts):
    """Entropy of the train unigram distribution and val cross-entropy under it (add-one), in nats/token,
    from the two splits' token counts: a trained model's val loss should end well below the latter."""
    counts = train_counts.astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    smoothed = (counts + 1.0) / (counts.sum() + len(counts))
    return float(-(p * np.log(p)).sum()), float(-(val_counts * np.log(smoothed)).sum() / max(1, val_counts.sum()))


def check_settings(tokenizer, val_fraction, val_tokens, workers, shard_tokens, max_documents=None, seed=0):
    """Range checks, one line each naming the setting (the command-line flag of the same name)."""
    if val_tokens is not None and (not isinstance(val_tokens, int) or val_tokens < 1):
        raise ValueError("val_tokens must be an integer >= 1 (or 0 on the command line: use val_fraction), "
                         f"got {val_tokens}")
    if val_tokens is None and not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be an integer >= 1, got {workers}")
    if not isinstance(shard_tokens, int) or shard_tokens < MIN_SHARD_TOKENS:
        raise ValueError(f"shard_tokens must be an integer >= {MIN_SHARD_TOKENS}, got {shard_tokens}")
    if not isinstance(seed, int) or not 0 <= seed < 2**53:  # as train.py's seed: JSON keeps such integers exact
        raise ValueError(f"seed must be an integer in [0, 2**53) (meta.json records it), got {seed}")
    if max_documents is not None and (not isinstance(max_documents, int) or max_documents < 1):
        raise ValueError(f"max_documents must be an integer >= 1, got {max_documents}")
    return get_tokenizer(tokenizer)  # ValueError listing valid names if unknown


def prepare_settings(tokenizer, val_fraction, val_tokens, seed, shard_tokens, shuffle_documents, max_documents=None):
    """What the output depends on besides the inputs (not --workers): part of the fingerprint and of meta.json."""
    return dict(tokenizer=tokenizer, val_fraction=None if val_tokens else float(val_fraction), val_tokens=val_tokens,
                seed=int(seed), shard_tokens=int(shard_tokens),
                document_order="shuffled" if shuffle_documents else "input",
                max_documents=max_documents)


def prepare(inputs=(), out_dir=DEFAULT_OUT, tokenizer="gpt2-4096", val_fraction=0.05, seed=0, verbose=True,
            val_tokens=None, workers=1, shard_tokens=DEFAULT_SHARD_TOKENS, shuffle_documents=False,
            hf=None, hf_config=None, hf_split="train", max_documents=None):
    """Tokenize `inputs` (.txt/.jsonl/.parquet files or folders) or the dataset `hf` into out_dir's shards,
    sidecars and meta.json (see the module docstring). Returns out_dir."""
    start_time = time.time()
    tok = check_settings(tokenizer, val_fraction, val_tokens, workers, shard_tokens, max_documents, seed)
    corpus = Corpus([] if hf else expand_inputs(inputs), hf, hf_config, hf_split, max_documents)
    settings = prepare_settings(tok.name, val_fraction, val_tokens, seed, shard_tokens, shuffle_documents,
                                max_documents)
    fingerprint = corpus.fingerprint(settings)
    check_out_folder(out_dir)  # refused before any work; a previous prepare there is replaced once the split is known

    # the split, from per-source document counts (first pass), then the documents tagged in order
    with worker_pool(workers) as pool:
        return write_shards(corpus, out_dir, tok, settings, fingerprint, pool, workers, verbose, start_time)


def write_shards(corpus, out_dir, tok, settings, fingerprint, pool, workers, verbose, start_time):
    """prepare's two passes on the worker pool (None: in this process)."""
    val_tokens, val_fraction, seed = settings["val_tokens"], settings["val_fraction"], settings["seed"]
    shuffle_documents, shard_tokens = settings["document_order"] == "shuffled", settings["shard_tokens"]
    if shuffle_documents:  # the first version's order: the corpus in memory
        documents = list(corpus)
        counts = count_documents(documents, tok if val_tokens else None, verbose)
    else:
        counts = count_corpus(corpus, tok.name if val_tokens else None, pool, workers, verbose)
    if not counts:
        raise ValueError(f"empty corpus: no non-empty documents in {', '.join(corpus.names())}")
    doc_counts = {source: c[0] for source, c in counts.items()}
    fraction = val_fraction_for_tokens(counts, val_tokens) if val_tokens else val_fraction
    ranks, rng = choose_val(doc_counts, fraction, seed, few=bool(val_tokens))
    source_names = sorted(doc_counts)
    source_id = {s: i for i, s in enumerate(source_names)}
    membership = ValMembership(ranks)
    if shuffle_documents:
        is_val = np.array([membership.is_val(source, i) for i, (_, source) in enumerate(documents)], dtype=bool)
        order = [(i, 0) for i in rng.permutation(np.flatnonzero(~is_val))] + \
                [(i, 1) for i in rng.permutation(np.flatnonzero(is_val))]
        tagged = ((int(i), documents[i][0], source_id[documents[i][1]], s) for i, s in order)
    else:
        tagged = ((i, text, source_id[source], int(membership.is_val(source, i)))
                  for i, (text, source) in enumerate(corpus))

    # the second pass: tokenize on the workers, write the shards in input order (a previous prepare there goes
    # now, once every error the first pass can find has been found)
    clear_folder(out_dir)
    dtype = token_dtype(tok.n_vocab)
    writers = [ShardWriter(out_dir, split, shard_tokens, dtype) for split in SPLITS]
    unigram = np.zeros((2, tok.n_vocab), dtype=np.int64)
    stats = {key: np.zeros((2, len(source_names)), dtype=np.int64) for key in ("tokens", "documents", "bytes")}
    characters = 0
    jobs = ((tok.name, chunk) for chunk in chunks_of(tagged))
    bar = tqdm(total=sum(doc_counts.values()), desc=f"tokenizing ({tok.name}, {workers} worker{'s' * (workers > 1)})",
               unit="doc", leave=False, disable=None if verbose else True)  # bars on a terminal only
    try:
        for rows, lengths, n_bytes, n_chars, tokens in in_order(tokenize_chunk, jobs, pool, workers):
            ends = np.cumsum(lengths)
            starts = (ends - lengths).tolist()
            for (doc_index, src, split_index), start, end in zip(rows.tolist(), starts, ends.tolist()):
                writers[split_index].add(tokens[start:end], src, doc_index)
            token_split = np.repeat(rows[:, 2], lengths)
            for split_index in np.unique(rows[:, 2]).tolist():  # the unigram baselines, counted as we go
                unigram[split_index] += np.bincount(tokens[token_split == split_index], minlength=tok.n_vocab)
            for key, values in (("tokens", lengths), ("documents", 1), ("bytes", n_bytes)):
                np.add.at(stats[key], (rows[:, 2], rows[:, 1]), values)
            characters += n_chars
            bar.update(len(rows))
        shards = {split: writer.seal() for split, writer in zip(SPLITS, writers)}
    except BaseException:
        for writer in writers:
            writer.abandon()
        raise
    finally:
        bar.close()

    splits = {split: {
        "tokens": int(stats["tokens"][j].sum()),
        "documents": int(stats["documents"][j].sum()),
        "bytes": int(stats["bytes"][j].sum()),
        "source_tokens": dict(zip(source_names, stats["tokens"][j].tolist())),
        "source_documents": dict(zip(source_names, stats["documents"][j].tolist())),
    } for j, split in enumerate(SPLITS)}
    train_entropy, val_unigram_xent = unigram_baselines(unigram[0], unigram[1])
    meta = {
        "format": "loopstudy-tokens",
        "version": PREPARE_VERSION,
        "tokenizer": tok.name,
        "n_vocab": tok.n_vocab,
        "eot_token": tok.eot_token,
        "dtype": np.dtype(dtype).name,
        "layout": "each document is preceded by eot_token; sidecar spans [start, end) include that eot and are "
                  "positions in the split's shards concatenated",
        "sources": source_names,
        "splits": splits,
        "characters": characters,
        "empty_documents_skipped": corpus.empty,
        "unigram_entropy_train_nats": train_entropy,
        "unigram_xent_val_nats": val_unigram_xent,
        "split_rule": "val_tokens" if val_tokens else "val_fraction",
        **settings,
        "inputs": corpus.names(),
        "fingerprint": fingerprint,
        "shards": shards,
    }
    write_atomic(os.path.join(out_dir, "meta.json"), lambda f: f.write((json.dumps(meta, indent=1) + "\n").encode()))
    if val_tokens and splits["val"]["tokens"] > 2 * val_tokens:  # every source with >= 2 documents gives one
        print(f"note: val holds {splits['val']['tokens']:,} tokens for --val_tokens {val_tokens:,}: each of the "
              f"{len(source_names)} sources gives val at least one whole document", file=sys.stderr)
    if verbose:
        print(f"prepared {out_dir} in {time.time() - start_time:.2f}s: " + ", ".join(
            f"{s} {splits[s]['tokens']:,} tokens / {splits[s]['documents']:,} docs / {len(shards[s])} shards"
            for s in SPLITS) + f"; {len(source_names)} sources; {tok.name} ({tok.n_vocab} vocab, {meta['dtype']})")
    return out_dir


DEFAULT_SETTINGS = dict(val_fraction=0.05, seed=0, shuffle_documents=True)  # the embedded corpus's prepare


def prepare_default(out_dir=DEFAULT_OUT, tokenizer="gpt2-4096", verbose=True):
    """Prepare the embedded Shakespeare corpus into out_dir unless an intact, identical prepare is there."""
    settings = prepare_settings(tokenizer, DEFAULT_SETTINGS["val_fraction"], None, DEFAULT_SETTINGS["seed"],
                                DEFAULT_SHARD_TOKENS, DEFAULT_SETTINGS["shuffle_documents"])
    try:
        if load_meta(out_dir)["fingerprint"] == corpus_fingerprint([DEFAULT_CORPUS], settings):
            return out_dir
    except (FileNotFoundError, ValueError):
        pass  # missing, stale or corrupt: rebuild
    return prepare([DEFAULT_CORPUS], out_dir, tokenizer=tokenizer, verbose=verbose, **DEFAULT_SETTINGS)


# -----------------------------------------------------------------------------
# checking everything: verify() (opening a folder, data/shards.py, checks only what is cheap)

def verify(data_dir, verbose=True):
    """Read every shard: its sha256 and largest token id as meta.json recorded them, every document starting
    with eot, the sidecars tiling each split. Returns meta; ValueError naming the file otherwise."""
    meta = load_meta(data_dir)
    for split in SPLITS:
        load_sources(data_dir, split, meta)  # spans tile the split, each document starts with eot
        for shard in tqdm(meta["shards"][split], desc=f"verifying {split}", unit="shard", leave=False,
                          disable=None if verbose else True):
            path = os.path.join(data_dir, shard["file"])
            with open(path, "rb") as f:
                if hashlib.file_digest(f, "sha256").hexdigest() != shard.get("sha256"):
                    raise ValueError(f"{path} is corrupt: its sha256 differs from meta.json's; re-run data/prepare.py")
            tokens = np.memmap(path, dtype=meta["dtype"], mode="r")
            if len(tokens) and int(tokens.max()) != shard["max_token"]:
                raise ValueError(f"{path} is corrupt: largest token id {int(tokens.max())}, meta.json says "
                                 f"{shard['max_token']}; re-run data/prepare.py")
    return meta


# -----------------------------------------------------------------------------
# command line

def main(argv=None):
    parser = common_parser("prepare.py", allow_abbrev=False,
                           description="Tokenize documents into token shards (see the module docstring).")
    parser.add_argument("inputs", nargs="*", help=".txt/.jsonl/.parquet files or folders, regular files only "
                                                  f"(default: the embedded corpus {os.path.relpath(DEFAULT_CORPUS)})")
    parser.add_argument("--hf", default=None, help="a Hugging Face dataset to stream instead (needs datasets) "
                                                   "(default: none, read the inputs)")
    parser.add_argument("--hf_config", default=None, help="its configuration, e.g. sample-10BT (default: none)")
    parser.add_argument("--hf_split", default="train", help="the split of --hf to read (default: %(default)s)")
    parser.add_argument("--tokenizer", default="gpt2-4096", help="'gpt2' or 'gpt2-N' (default: %(default)s)")
    parser.add_argument("--out", default=None, help=f"output folder (default: {os.path.relpath(DEFAULT_OUT)})")
    parser.add_argument("--val_fraction", type=float, default=None,
                        help="val documents per source, as a fraction in (0, 1) (default: 0.05)")
    parser.add_argument("--val_tokens", type=int, default=0,
                        help="about this many val tokens instead, below the corpus's tokens (default: 0, use "
                             "--val_fraction)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the val draw and of --shuffle_documents "
                                                            "(default: %(default)s)")
    parser.add_argument("--workers", type=int, default=1, help="tokenizing processes, at most 4 x the CPUs (the output "
                                                               "does not depend on it) (default: %(default)s)")
    parser.add_argument("--shard_tokens", type=int, default=DEFAULT_SHARD_TOKENS,
                        help=f"tokens per shard, >= {MIN_SHARD_TOKENS} (default: %(default)s)")
    parser.add_argument("--max_documents", type=int, default=0,
                        help="only the first N non-empty documents (default: 0, all)")
    parser.add_argument("--shuffle_documents", action="store_true",
                        help="each split in a seeded random document order (holds the corpus in memory) "
                             "(default: input order; the embedded corpus is shuffled)")
    parser.add_argument("--verify", action="store_true",
                        help="only check the prepared folder --out, reading everything (default: prepare)")
    args = parser.parse_args(argv)
    try:
        for flag, value, minimum in (("--val_tokens", args.val_tokens, 0), ("--workers", args.workers, 1),
                                     ("--shard_tokens", args.shard_tokens, MIN_SHARD_TOKENS),
                                     ("--max_documents", args.max_documents, 0), ("--seed", args.seed, 0)):
            if value < minimum:
                raise ValueError(f"{flag} must be >= {minimum:,}, got {value}")
        if args.workers > 4 * (os.cpu_count() or 1):
            raise ValueError(f"--workers must be at most 4 x the {os.cpu_count()} CPUs here, got {args.workers}")
        if args.val_fraction is not None and not 0.0 < args.val_fraction < 1.0:
            raise ValueError(f"--val_fraction must be in (0, 1), got {args.val_fraction}")
        if args.val_fraction is not None and args.val_tokens:
            raise ValueError("give --val_fraction or --val_tokens, not both")
        if args.inputs and args.hf:
            raise ValueError("give input files or --hf, not both")
        out = DEFAULT_OUT if args.out is None else args.out
        if args.verify:
            meta = verify(out)
            print(f"{out}: ok, " + ", ".join(f"{s} {meta['splits'][s]['tokens']:,} tokens in "
                                             f"{len(meta['shards'][s])} shards" for s in SPLITS))
            return 0
        default = not args.inputs and not args.hf  # the embedded corpus, prepared as prepare_default does
        prepare([DEFAULT_CORPUS] if default else args.inputs, out, tokenizer=args.tokenizer,
                val_fraction=0.05 if args.val_fraction is None else args.val_fraction,
                val_tokens=args.val_tokens or None, seed=args.seed, workers=args.workers,
                shard_tokens=args.shard_tokens, shuffle_documents=args.shuffle_documents or default,
                hf=args.hf, hf_config=args.hf_config, hf_split=args.hf_split, max_documents=args.max_documents or None)
    except (OSError, ValueError, RuntimeError) as e:
        return cli_error("prepare.py", e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
