"""
The documents data/prepare.py tokenizes: input files and folders (.txt, .jsonl, .parquet) or a Hugging Face
dataset, read as a stream of (text, source) in input order that can be read again (the split reads it
twice), and the fingerprint of a prepare (its settings and every input file's bytes). Each reader yields
its file's documents in order, empty ones included (Corpus skips and counts them); a malformed input is
one ValueError naming the file and the line or row. pyarrow and datasets are optional
(requirements-data.txt), imported when first needed.

    corpus = Corpus(expand_inputs(["my.jsonl", "notes/"]))   # or Corpus(hf="HuggingFaceFW/fineweb-edu")
    for text, source in corpus: ...
"""

import hashlib
import importlib
import json
import os

from data.shards import PREPARE_VERSION
from data.tokenizer import ENDOFTEXT
from tooling.common import check_regular, first_line, read_jsonl

EXTENSIONS = (".txt", ".jsonl", ".parquet")


def import_optional(module, needed_by):
    """An optional dependency (requirements-data.txt), imported when first needed; one line when missing."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ValueError(f"{needed_by} needs {module.split('.')[0]}: pip install -r requirements-data.txt") from None


def expand_inputs(inputs):
    """Files as given, folders -> their *.txt / *.jsonl / *.parquet files (sorted). Clear errors for bad paths."""
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    files, seen = [], {}
    for path in map(str, inputs):
        if os.path.isdir(path):
            found = sorted(os.path.join(root, name) for root, _, names in os.walk(path)
                           for name in names if name.lower().endswith(EXTENSIONS))
            if not found:
                raise ValueError(f"input folder {path} contains no .txt, .jsonl or .parquet files")
        elif not os.path.exists(path):
            raise FileNotFoundError(f"input file not found: {path}")
        elif not path.lower().endswith(EXTENSIONS):
            raise ValueError(f"input file {path}: unsupported extension (expected .txt, .jsonl or .parquet)")
        else:
            found = [path]
        for file in found:  # a file read twice would put its documents in both splits
            check_regular(file)
            real = os.path.realpath(file)
            if real in seen:
                raise ValueError(f"input file {file} is given twice (also as {seen[real]}): each input once")
            seen[real] = file
        files.extend(found)
    if not files:
        raise ValueError("no input files given")
    return files


def read_documents(path):
    """(text, source) of every document of one .txt / .jsonl / .parquet file, streamed."""
    stem = os.path.splitext(os.path.basename(path))[0]
    if path.lower().endswith(".jsonl"):
        return (read_jsonl_document(path, lineno, row, stem) for lineno, row in read_jsonl(path))
    if path.lower().endswith(".parquet"):
        return read_parquet(path, stem)
    return read_txt(path, stem)


def read_txt(path, stem):
    """Documents of a .txt file, separated by lines holding only <|endoftext|>, read line by line."""
    current = []
    try:
        with open(path, encoding="utf-8-sig") as f:  # a leading byte-order mark is not text
            for physical_line in f:
                for line in physical_line.splitlines(keepends=True):  # str.splitlines' line ends, as before
                    if line.strip() == ENDOFTEXT:
                        yield "".join(current), stem
                        current = []
                    else:
                        current.append(line)
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not valid UTF-8 ({e})") from None
    yield "".join(current), stem


def read_jsonl_document(path, lineno, row, default_source):
    """(text, source) of one parsed jsonl line; ValueError naming path:lineno when a field is wrong."""
    if not isinstance(row, dict):
        raise ValueError(f"{path}:{lineno}: expected a JSON object with a 'text' field, got {type(row).__name__}")
    if "text" not in row:
        raise ValueError(f"{path}:{lineno}: missing field 'text'")
    if not isinstance(row["text"], str):
        raise ValueError(f"{path}:{lineno}: field 'text' must be a string, got {type(row['text']).__name__}")
    try:  # JSON may escape a lone surrogate (\udcff), which no UTF-8 encoder takes: named here, not in a worker
        row["text"].encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{path}:{lineno}: field 'text' holds a lone surrogate {row['text'][e.start]!r} at character "
                         f"{e.start} (an unpaired \\ud800-\\udfff escape), which is not text") from None
    source = row.get("source", default_source)
    if not isinstance(source, str) or not source:
        raise ValueError(f"{path}:{lineno}: field 'source' must be a non-empty string, got {source!r}")
    return row["text"], source


def read_parquet(path, stem):
    """Documents of a parquet file: its `text` column, `source` when present, 1,024 rows at a time."""
    pq = import_optional("pyarrow.parquet", f"reading {path}")
    pa = import_optional("pyarrow", f"reading {path}")
    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{path}: not a readable parquet file ({first_line(e)})") from None
    schema = parquet.schema_arrow
    if "text" not in schema.names:
        raise ValueError(f"{path}: no 'text' column (columns: {', '.join(schema.names)})")
    columns = ["text"] + (["source"] if "source" in schema.names else [])
    for column in columns:
        kind = schema.field(column).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or str(kind) == "string_view"):
            raise ValueError(f"{path}: column '{column}' must hold strings, it holds {kind}")
    row = 0
    for batch in parquet.iter_batches(batch_size=1024, columns=columns):
        texts = batch.column(0).to_pylist()
        sources = batch.column(1).to_pylist() if len(columns) == 2 else [None] * len(texts)
        for text, source in zip(texts, sources):
            if text is None:
                raise ValueError(f"{path}: row {row}: 'text' is null")
            yield text, source or stem
            row += 1


def read_hf(name, config=None, split="train"):
    """Documents of a Hugging Face dataset, streamed by `datasets` (downloads as it reads)."""
    datasets = import_optional("datasets", f"--hf {name}")
    try:
        dataset = datasets.load_dataset(name, config, split=split, streaming=True)
    except Exception as e:  # datasets raises many kinds (not found, no such config, offline): one line
        raise ValueError(f"--hf {name}: cannot open it ({type(e).__name__}: {first_line(e)})") from None
    features = getattr(dataset, "features", None)
    if features is not None and "text" not in features:
        raise ValueError(f"--hf {name}: no 'text' column (columns: {', '.join(features)})")
    default_source = name.rstrip("/").split("/")[-1]
    for row_index, row in enumerate(dataset):
        text, source = row.get("text"), row.get("source") or default_source
        if not isinstance(text, str):
            raise ValueError(f"--hf {name}: row {row_index}: 'text' must be a string, got {type(text).__name__}")
        yield text, str(source)


class Corpus:
    """The inputs as a stream of (text, source) that can be read again (the split reads it twice)."""

    def __init__(self, files=(), hf=None, hf_config=None, hf_split="train", max_documents=None):
        self.files, self.hf, self.hf_config, self.hf_split = list(files), hf, hf_config, hf_split
        self.max_documents = max_documents

    def __iter__(self):
        """Non-empty documents in input order (the first max_documents of them); self.empty counts the
        blank ones skipped."""
        self.empty, n = 0, 0
        readers = [read_hf(self.hf, self.hf_config, self.hf_split)] if self.hf else map(read_documents, self.files)
        for reader in readers:
            for text, source in reader:
                if not text.strip():
                    self.empty += 1
                    continue
                if n == self.max_documents:
                    return
                yield text, source
                n += 1

    def names(self):
        if self.hf:
            return [f"hf:{self.hf}" + (f"/{self.hf_config}" if self.hf_config else "") + f":{self.hf_split}"]
        return [os.path.basename(f) for f in self.files]

    def fingerprint(self, settings):
        """sha256 over the prepare settings and every input file's name and bytes (--hf: the dataset's name)."""
        h = hashlib.sha256(json.dumps([PREPARE_VERSION, settings, self.names()]).encode())
        for path in self.files:
            h.update(os.path.basename(path).encode() + b"\0")
            with open(path, "rb") as f:
                h.update(hashlib.file_digest(f, "sha256").digest())
        return h.hexdigest()


def corpus_fingerprint(files, settings):
    return Corpus(files).fingerprint(settings)
