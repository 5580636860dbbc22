"""data/prepare.py at scale: parquet/jsonl/--hf inputs into token shards, the same bytes for any number of
workers, a killed prepare rerun, the streaming split, training and resuming across shard boundaries, decay
branches on whole held-back shards, bits-per-byte lengths, and one-line errors. Everything on small
corpora the tests write; nothing is downloaded."""
import json
import math
import os
import signal
import socket
import subprocess
import sys

import numpy as np
import pytest

import train
from conftest import one_line_error, small_corpus
from data import loader, prepare as prep
from data import shards as prepared  # the reading of a prepared folder
from tooling.common import read_jsonl
from data.tokenizer import get_tokenizer, token_byte_lengths
from model import ModelConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches "
         "in bright summer light near old stone walls").split()


def documents(n=120, seed=0):
    """n documents of seeded random words, lengths 10..400 words, sources 'news' (2/3) and 'code' (1/3)."""
    rng = np.random.default_rng(seed)
    return [(" ".join(rng.choice(WORDS, int(rng.integers(10, 400)))) + ".\n", "news" if i % 3 else "code")
            for i in range(n)]


def write_jsonl(path, docs):
    path.write_text("".join(json.dumps({"text": text, "source": source}) + "\n" for text, source in docs))
    return str(path)


def files_of(folder):
    """{name: bytes} of every file in a prepared folder."""
    return {name: open(os.path.join(folder, name), "rb").read() for name in sorted(os.listdir(folder))}


def shard_files(folder):
    return {k: v for k, v in files_of(folder).items() if k != "meta.json"}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    docs = documents()
    return docs, write_jsonl(root / "docs.jsonl", docs)


# -----------------------------------------------------------------------------
# inputs -> shards

def test_jsonl_prepares_into_fixed_size_shards_that_decode_to_the_documents(corpus, tmp_path):
    docs, path = corpus
    out = prep.prepare([path], str(tmp_path / "out"), shard_tokens=2048, verbose=False)
    meta, tok = prepared.load_meta(out), get_tokenizer("gpt2-4096")
    assert meta["sources"] == ["code", "news"] and meta["version"] == prep.PREPARE_VERSION
    seen = set()
    for split in prep.SPLITS:
        shards = meta["shards"][split]
        tokens, spans = prepared.load_split(out, split), prepared.load_sources(out, split)
        assert [s["tokens"] for s in shards[:-1]] == [2048] * (len(shards) - 1) and 0 < shards[-1]["tokens"] <= 2048
        assert len(tokens) == meta["splits"][split]["tokens"] == sum(s["tokens"] for s in shards)
        flat = np.asarray(tokens)
        assert np.flatnonzero(flat == tok.eot_token).tolist() == spans[:, 0].tolist()  # eot precedes every document
        for start, end, source_id, doc in spans:
            assert tok.decode(tokens[start + 1:end]) == docs[doc][0] and meta["sources"][source_id] == docs[doc][1]
        for k, s in enumerate(shards):  # the per-shard range check recorded at prepare time
            assert s["max_token"] == int(flat[tokens.shard_starts[k]:tokens.shard_starts[k + 1]].max())
        crossing = [(s, e) for s, e in spans[:, :2] if np.searchsorted(tokens.shard_starts, s, "right") !=
                    np.searchsorted(tokens.shard_starts, e - 1, "right")]
        assert split == "val" or crossing  # documents continue into the next shard
        seen |= set(spans[:, 3].tolist())
    assert len(meta["shards"]["train"]) >= 10 and seen == set(range(len(docs)))
    # the unigram baselines, computed from per-chunk counts, against the tokens themselves
    train_counts = np.bincount(np.asarray(prepared.load_split(out, "train")), minlength=4096).astype(np.float64)
    p = train_counts[train_counts > 0] / train_counts.sum()
    assert meta["unigram_entropy_train_nats"] == pytest.approx(-(p * np.log(p)).sum(), rel=1e-12)
    smoothed = (train_counts + 1) / (train_counts.sum() + 4096)
    assert meta["unigram_xent_val_nats"] == pytest.approx(
        -np.log(smoothed[np.asarray(prepared.load_split(out, "val"))]).mean(), rel=1e-12)
    prep.verify(out, verbose=False)


def test_parquet_gives_the_same_shards_as_jsonl(corpus, tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    docs, path = corpus
    table = pa.table({"text": [t for t, _ in docs], "source": [s for _, s in docs], "id": list(range(len(docs)))})
    pq.write_table(table, tmp_path / "docs.parquet", row_group_size=50)  # several row groups
    a = prep.prepare([path], str(tmp_path / "jsonl"), shard_tokens=4096, verbose=False)
    b = prep.prepare([str(tmp_path / "docs.parquet")], str(tmp_path / "parquet"), shard_tokens=4096, verbose=False)
    assert shard_files(a) == shard_files(b)
    pq.write_table(pa.table({"text": [t for t, _ in docs[:5]]}), tmp_path / "nosource.parquet")  # source: the stem
    c = prep.prepare([str(tmp_path / "nosource.parquet")], str(tmp_path / "nosource"), verbose=False)
    assert prepared.load_meta(c)["sources"] == ["nosource"]


def test_output_is_byte_identical_for_one_and_two_workers(corpus, tmp_path):
    docs, _ = corpus
    paths = [write_jsonl(tmp_path / "a.jsonl", docs[:70]), write_jsonl(tmp_path / "b.jsonl", docs[70:])]
    settings = dict(shard_tokens=4096, val_tokens=3000, verbose=False)
    one = prep.prepare(paths, str(tmp_path / "w1"), workers=1, **settings)
    two = prep.prepare(paths, str(tmp_path / "w2"), workers=2, **settings)  # both passes on the pool
    assert files_of(one) == files_of(two) and len(files_of(one)) > 6  # meta.json included
    first = prep.prepare(paths, str(tmp_path / "first"), workers=2, max_documents=90, verbose=False)
    alone = prep.prepare([write_jsonl(tmp_path / "c.jsonl", docs[:90])], str(tmp_path / "alone"), verbose=False)
    assert shard_files(first) == shard_files(alone)  # --max_documents: the first 90 documents only


def test_hf_dataset_streams_from_a_local_folder(corpus, tmp_path, monkeypatch):
    """The --hf code path (datasets in streaming mode) on a local folder: no network is touched."""
    pytest.importorskip("datasets")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))  # its caches, if it writes any

    def refuse(*args, **kwargs):
        raise AssertionError("network access attempted")
    monkeypatch.setattr(socket.socket, "connect", refuse)
    docs, path = corpus
    folder = tmp_path / "dataset"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", docs)
    a = prep.prepare(hf=str(folder), out_dir=str(tmp_path / "hf"), shard_tokens=4096, verbose=False)
    b = prep.prepare([path], str(tmp_path / "local"), shard_tokens=4096, verbose=False)
    assert shard_files(a) == shard_files(b)


# -----------------------------------------------------------------------------
# the split

def first_version_split(sources, val_fraction, seed):
    """The split rule of data/prepare.py version 1, written out (the corpus in memory): the slow twin."""
    rng = np.random.default_rng(seed)
    is_val = np.zeros(len(sources), dtype=bool)
    for source in sorted(set(sources)):
        members = np.array([i for i, s in enumerate(sources) if s == source])
        if len(members) >= 2:
            k = min(max(1, math.floor(val_fraction * len(members) + 0.5)), len(members) - 1)
            is_val[rng.permutation(members)[:k]] = True
    if not is_val.any():
        k = min(max(1, math.floor(val_fraction * len(sources) + 0.5)), len(sources) - 1)
        is_val[rng.permutation(len(sources))[:k]] = True
    return set(np.flatnonzero(is_val).tolist())


@pytest.mark.parametrize("seed", [0, 3])
def test_val_fraction_streams_the_first_versions_split(tmp_path, seed):
    docs = documents(60, seed=seed) + [("a lone document", "solo")]
    path = write_jsonl(tmp_path / "d.jsonl", docs)
    out = prep.prepare([path], str(tmp_path / "out"), val_fraction=0.2, seed=seed, verbose=False)
    val = set(prepared.load_sources(out, "val")[:, 3].tolist())
    assert val == first_version_split([s for _, s in docs], 0.2, seed)
    single = [(f"document {i}", f"s{i}") for i in range(5)]  # every source has one document: split across them
    out = prep.prepare([write_jsonl(tmp_path / "s.jsonl", single)], str(tmp_path / "single"), val_fraction=0.4,
                       seed=seed, verbose=False)
    val = set(prepared.load_sources(out, "val")[:, 3].tolist())
    assert val == first_version_split([s for _, s in single], 0.4, seed)


def test_val_tokens_is_a_whole_document_budget_stratified_by_source(tmp_path):
    docs = documents(600, seed=1)
    path = write_jsonl(tmp_path / "d.jsonl", docs)
    out = prep.prepare([path], str(tmp_path / "a"), val_tokens=12_000, shard_tokens=8192, verbose=False)
    meta = prepared.load_meta(out)
    train_docs = set(prepared.load_sources(out, "train")[:, 3].tolist())
    val_spans = prepared.load_sources(out, "val")
    val_docs = set(val_spans[:, 3].tolist())
    assert train_docs.isdisjoint(val_docs) and train_docs | val_docs == set(range(len(docs)))  # no straddling
    assert abs(meta["splits"]["val"]["tokens"] - 12_000) < 0.25 * 12_000  # whole documents, drawn: about the budget
    total = {s: meta["splits"]["train"]["source_documents"][s] + meta["splits"]["val"]["source_documents"][s]
             for s in meta["sources"]}
    for s in meta["sources"]:  # each source gives the same fraction of its documents, rounded
        assert meta["splits"]["val"]["source_documents"][s] == round(total[s] * len(val_docs) / len(docs)) or \
            abs(meta["splits"]["val"]["source_documents"][s] / total[s] - len(val_docs) / len(docs)) < 0.01
    again = prep.prepare([path], str(tmp_path / "b"), val_tokens=12_000, shard_tokens=8192, verbose=False)
    other = prep.prepare([path], str(tmp_path / "c"), val_tokens=12_000, shard_tokens=8192, seed=1, verbose=False)
    assert files_of(again) == files_of(out)
    assert set(prepared.load_sources(other, "val")[:, 3].tolist()) != val_docs


# -----------------------------------------------------------------------------
# a killed prepare, rerun

def test_prepare_killed_mid_shard_then_rerun_gives_the_uninterrupted_output(corpus, tmp_path):
    _, path = corpus
    argv = [path, "--out", str(tmp_path / "killed"), "--shard_tokens", "4096", "--workers", "2", "--val_tokens", "3000"]
    script = (f"import os, signal, sys\nsys.path.insert(0, {REPO!r})\nfrom data import prepare as p\n"
              "add = p.ShardWriter.add\n"
              "def add_then_die(self, *args):\n"
              "    add(self, *args)\n"
              "    if self.split == 'train' and self.shards and self.file is not None:  # in the middle of shard 1\n"
              "        os.killpg(0, signal.SIGKILL)  # this process and its workers, as a crash would\n"
              "p.ShardWriter.add = add_then_die\n"
              f"p.main({argv!r})\n")
    result = subprocess.run([sys.executable, "-c", script], start_new_session=True, capture_output=True, timeout=120)
    assert result.returncode == -signal.SIGKILL, result.stderr.decode()[-2000:]
    left = sorted(os.listdir(tmp_path / "killed"))
    assert "meta.json" not in left and "train_000000.bin" in left
    assert any(name.startswith(".train_000001.bin.tmp-") for name in left)  # the shard being written: a temp name
    assert not any(name.startswith("train_000001") for name in left)
    with pytest.raises(FileNotFoundError, match="meta.json not found.*stopped"):
        loader.load_data(str(tmp_path / "killed"))
    assert prep.main([path, "--out", str(tmp_path / "killed"), "--shard_tokens", "4096", "--val_tokens", "3000"]) == 0
    reference = prep.prepare([path], str(tmp_path / "straight"), shard_tokens=4096, val_tokens=3000, verbose=False)
    assert files_of(tmp_path / "killed") == files_of(reference)  # no temp file, nothing of the killed run left


# -----------------------------------------------------------------------------
# training from shards

SMALL = dict(n_layer=2, n_embd=32, n_head=2, n_expert=4, top_k=2, layout="smelt", n_passes=2, block_size=128,
             batch_size=4, eval_tokens=512, warmup_steps=2, eval_interval=2)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """The documents of the conftest data_dir (small_corpus) in one shard and in 1,024-token shards."""
    root = tmp_path_factory.mktemp("sharded")
    corpus = small_corpus(root)
    one = prep.prepare([corpus], str(root / "one"), val_fraction=0.34, verbose=False)
    many = prep.prepare([corpus], str(root / "many"), val_fraction=0.34, shard_tokens=1024, verbose=False)
    return one, many


def test_windows_cross_shard_boundaries_and_do_not_depend_on_shard_size(sharded):
    one, many = (loader.load_data(d) for d in sharded)
    assert len(many.meta["shards"]["train"]) > 10 and len(one.meta["shards"]["train"]) == 1
    assert np.array_equal(np.asarray(one.train_tokens), np.asarray(many.train_tokens))
    # a held-back tail shorter than a shard stays exact, so both layouts give the same stream
    a, b = one.stream(128, 7, 0.01), many.stream(128, 7, 0.01)
    assert (a.start, a.stop, a.n_windows) == (b.start, b.stop, b.n_windows)
    xa, ya = a.batch(0, 64)
    xb, yb = b.batch(0, 64)
    assert np.array_equal(xa.numpy(), xb.numpy()) and np.array_equal(ya.numpy(), yb.numpy())
    starts = many.train_tokens.shard_starts
    offsets = b.offsets(0, 64)
    assert any(np.searchsorted(starts, o, "right") != np.searchsorted(starts, o + 128, "right") for o in offsets)
    assert np.array_equal(many.val_sources[:], one.val_sources[:])


def test_training_resumes_exactly_across_shard_boundaries(sharded, tmp_path):
    data_dir = sharded[1]
    common = dict(data_dir=data_dir, max_steps=6)
    straight = train.train(SMALL | common | dict(out_dir=str(tmp_path / "a")))
    first = train.train(SMALL | common | dict(out_dir=str(tmp_path / "b"), stop_at_step=4))
    second = train.train(dict(out_dir=str(tmp_path / "b"), init_from="resume"))
    assert first["train_losses"] + second["train_losses"] == straight["train_losses"]  # bitwise
    strip = lambda path: [{k: v for k, v in json.loads(line).items() if k != "seconds"} for line in open(path)]
    assert strip(second["log_path"]) == strip(straight["log_path"])
    data = loader.load_data(data_dir)
    stream = data.stream(128, 1337, train.DEFAULTS["branch_data_fraction"])
    offsets, starts = stream.offsets(0, 6 * 4), data.train_tokens.shard_starts
    assert any(np.searchsorted(starts, o, "right") != np.searchsorted(starts, o + 128, "right") for o in offsets)


def test_held_back_region_is_whole_shards_at_the_end(sharded, tmp_path):
    assert loader.held_back_start([1000], 0.1) == 900  # one shard: exact, as before
    assert loader.held_back_start([100] * 10 + [30], 0.05) == 1030 - 51  # a tail shorter than a shard: exact
    assert loader.held_back_start([100] * 10 + [30], 0.1) == 900  # 103 held back -> the last 1.3 shards
    assert loader.held_back_start([100] * 10 + [30], 0.3) == 700  # 309 -> 330
    assert loader.held_back_start([100] * 10, 0.0) == 1000  # nothing held back
    data_dir = sharded[1]
    boundaries = np.cumsum([s["tokens"] for s in loader.load_data(data_dir).meta["shards"]["train"]])
    stable = train.train(SMALL | dict(data_dir=data_dir, out_dir=str(tmp_path), run_name="stable", max_steps=4,
                                      decay_fraction=0.0, save_steps=[2], eval_interval=4))
    assert stable["data_split"] in boundaries and stable["data_read"][1] <= stable["data_split"]
    branch = train.train(dict(out_dir=str(tmp_path), init_from=os.path.join(stable["run_dir"], "ckpt_step2.pt"),
                              decay_tokens=2 * 4 * 128))
    assert branch["data_region"] == "branch" and branch["data_split"] == stable["data_split"]
    assert stable["data_split"] <= branch["data_read"][0] and branch["data_read"][1] <= boundaries[-1]


# -----------------------------------------------------------------------------
# bits per byte

@pytest.mark.parametrize("name", ["gpt2", "gpt2-257", "gpt2-4096"])
def test_token_byte_lengths_sum_to_the_utf8_length(name):
    text = "Héllo wörld, 1234 — 😀 naïve café\n\tend <|endoftext|>"
    tok, lengths = get_tokenizer(name), token_byte_lengths(name)
    assert lengths.dtype == np.int64 and lengths.shape == (tok.n_vocab,) and lengths[tok.eot_token] == 0
    assert int(lengths[tok.encode(text)].sum()) == len(text.encode("utf-8"))
    assert int(lengths[[tok.eot_token] + tok.encode(text)].sum()) == len(text.encode("utf-8"))  # eot adds no bytes


def test_meta_bytes_are_the_token_byte_lengths(corpus, tmp_path):
    _, path = corpus
    out = prep.prepare([path], str(tmp_path / "out"), shard_tokens=4096, verbose=False)
    meta = prepared.load_meta(out)
    lengths = token_byte_lengths(meta)
    for split in prep.SPLITS:
        assert int(lengths[np.asarray(prepared.load_split(out, split))].sum()) == meta["splits"][split]["bytes"]


# -----------------------------------------------------------------------------
# errors: one line naming the file or the flag

def test_bad_input_is_one_line_naming_the_file(corpus, tmp_path, capsys, monkeypatch):
    _, path = corpus
    out = str(tmp_path / "out")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": "broken\n')
    assert "bad.jsonl:2: malformed JSON" in one_line_error(prep.main, [str(bad), "--out", out], capsys, "prepare.py")
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed
    err = one_line_error(prep.main, ["--hf", "HuggingFaceFW/fineweb-edu", "--out", out], capsys, "prepare.py")
    assert "--hf HuggingFaceFW/fineweb-edu needs datasets: pip install -r requirements-data.txt" in err
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    (tmp_path / "x.parquet").write_bytes(b"PAR1")
    err = one_line_error(prep.main, [str(tmp_path / "x.parquet"), "--out", out], capsys, "prepare.py")
    assert "x.parquet needs pyarrow: pip install -r requirements-data.txt" in err


def test_parquet_without_text_column_is_one_line(tmp_path, capsys):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"content": ["a", "b"]}), tmp_path / "nt.parquet")
    err = one_line_error(prep.main, [str(tmp_path / "nt.parquet"), "--out", str(tmp_path / "o")], capsys, "prepare.py")
    assert "nt.parquet: no 'text' column (columns: content)" in err
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "ints.parquet")
    err = one_line_error(prep.main, [str(tmp_path / "ints.parquet"), "--out", str(tmp_path / "o")], capsys, "prepare.py")
    assert "ints.parquet: column 'text' must hold strings" in err
    (tmp_path / "junk.parquet").write_text("not parquet")
    err = one_line_error(prep.main, [str(tmp_path / "junk.parquet"), "--out", str(tmp_path / "o")], capsys, "prepare.py")
    assert "junk.parquet: not a readable parquet file" in err


@pytest.mark.parametrize("flags,message", [
    (["--workers", "0"], "--workers must be >= 1, got 0"),
    (["--shard_tokens", "100"], "--shard_tokens must be >= 1,024, got 100"),
    (["--val_tokens", "-1"], "--val_tokens must be >= 0, got -1"),
    (["--val_fraction", "0"], "--val_fraction must be in (0, 1), got 0.0"),
    (["--val_fraction", "0.1", "--val_tokens", "100"], "give --val_fraction or --val_tokens, not both"),
    (["--work", "2"], "unrecognized arguments: --work"),  # allow_abbrev=False: no guessing
    (["--workers", "two"], "argument --workers: invalid int value: 'two'"),
])
def test_bad_flags_are_one_line_naming_the_flag(corpus, tmp_path, capsys, flags, message):
    err = one_line_error(prep.main, [corpus[1], "--out", str(tmp_path / "o"), *flags], capsys, "prepare.py")
    assert message in err


def test_bad_prepared_folder_is_one_line_naming_the_file(sharded, tmp_path, capsys):
    import shutil
    folder = tmp_path / "copy"
    shutil.copytree(sharded[1], folder)
    data = loader.load_data(str(folder))
    model = ModelConfig(vocab_size=50257, eot_token=50256)  # a GPT-2 model: the shards are gpt2-4096
    with pytest.raises(ValueError) as e:
        loader.open_data(str(folder), model)
    assert "\n" not in str(e.value) and f"{folder} holds tokens of tokenizer gpt2-4096" in str(e.value)
    assert loader.open_data(str(folder), ModelConfig())[0].meta == data.meta
    # a new model takes the data's end-of-text id, and cuts a padded vocabulary to the data's
    _, fitted = loader.open_data(str(folder), ModelConfig(vocab_size=4160, eot_token=7), new_model=True)
    assert (fitted.eot_token, fitted.n_logits, fitted.vocab_size) == (4095, 4096, 4160)
    _, fitted = loader.open_data(str(folder), ModelConfig(vocab_size=4096), new_model=True)
    assert (fitted.eot_token, fitted.n_logits) == (4095, 0)  # the whole vocabulary: nothing to cut
    with pytest.raises(ValueError, match=r"n_vocab=4096.*\(or vocab_size >= 4096\)$"):
        loader.open_data(str(folder), ModelConfig(vocab_size=1000), new_model=True)
    shard = folder / "train_000003.bin"
    shard.write_bytes(shard.read_bytes()[:-2])  # truncated
    err = one_line_error(prep.main, ["--verify", "--out", str(folder)], capsys, "prepare.py")
    assert "train_000003.bin is truncated or corrupt: 2,046 bytes, expected 2,048" in err
    shard.unlink()  # missing
    err = one_line_error(prep.main, ["--verify", "--out", str(folder)], capsys, "prepare.py")
    assert "train_000003.bin not found (listed in" in err
    with pytest.raises(FileNotFoundError, match="train_000003.bin not found"):
        loader.load_data(str(folder))


def test_an_old_layout_folder_is_refused_then_rebuilt(tmp_path):
    out = tmp_path / "old"
    out.mkdir()
    (out / "train.bin").write_bytes(b"\0\0")
    (out / "meta.json").write_text(json.dumps({"format": "loopstudy-tokens", "version": 1}))
    with pytest.raises(ValueError, match="format version 1, this one reads 2"):
        loader.load_data(str(out))
    prep.prepare_default(str(out), verbose=False)
    assert "train.bin" not in os.listdir(out) and prepared.load_meta(str(out))["version"] == prep.PREPARE_VERSION


# -----------------------------------------------------------------------------
# found by probing: inputs, the output folder, meta.json, workers, the data a resume reads

def worker_that_dies(job):
    os._exit(9)  # as a worker killed by the OOM killer


def test_a_dead_worker_ends_the_prepare_with_one_line_instead_of_a_hang():
    with prep.worker_pool(2) as pool:
        with pytest.raises(RuntimeError, match=r"^a worker process died \(killed, or out of memory\?\)"):
            list(prep.in_order(worker_that_dies, range(4), pool, 2))


def test_jsonl_strings_may_hold_unicode_line_separators(tmp_path):
    texts = ["one\u2028two", "three\x85four", "five\u2029", "six"]
    path = tmp_path / "u.jsonl"
    path.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts), encoding="utf-8")
    assert [row["text"] for _, row in read_jsonl(str(path))] == texts


def test_an_input_given_twice_is_refused(corpus, tmp_path, capsys):
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "a.jsonl").write_text(open(corpus[1]).read())
    err = one_line_error(prep.main, [str(folder), str(folder / "a.jsonl"), "--out", str(tmp_path / "o")], capsys,
                         "prepare.py")
    assert "a.jsonl is given twice" in err


def test_an_output_folder_holding_other_data_is_refused_untouched(corpus, tmp_path, capsys):
    for name, files in (("foreign", {"meta.json": '{"mine": 1}', "train.bin": "x"}),
                        ("nanogpt", {"train.bin": "x", "val.bin": "y"})):
        out = tmp_path / name
        out.mkdir()
        for file, text in files.items():
            (out / file).write_text(text)
        err = one_line_error(prep.main, [corpus[1], "--out", str(out)], capsys, "prepare.py")
        assert "refusing to" in err and "choose another --out" in err
        assert {f: (out / f).read_text() for f in files} == files


def test_a_failing_prepare_keeps_the_previous_one(corpus, tmp_path, capsys):
    out = prep.prepare([corpus[1]], str(tmp_path / "out"), verbose=False)
    before = prepared.load_meta(out)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": \n')
    for argv in ([str(bad)], [corpus[1], "--val_tokens", "100000000"], [corpus[1], "--seed", "-1"]):
        err = one_line_error(prep.main, [*argv, "--out", out], capsys, "prepare.py")
        assert "bad.jsonl:2" in err or "--val_tokens" in err or "--seed must be >= 0" in err
        assert prepared.load_meta(out) == before


@pytest.mark.parametrize("edit, message", [
    (dict(dtype="float16"), "dtype 'float16', but prepare writes uint16 for n_vocab=4096"),
    (dict(tokenizer="gpt2"), "tokenizer gpt2 has n_vocab=50257 and eot_token=50256, meta.json says 4096 and 4095"),
    (dict(unigram_entropy_train_nats="abc"), "meta.json is corrupt (ValueError"),
    (dict(unigram_entropy_train_nats=None), "meta.json is corrupt (TypeError"),
    (dict(sources=["code", "code"]), "sources distinct"),
])
def test_a_hand_edited_meta_json_is_one_line_naming_it(corpus, tmp_path, edit, message):
    out = prep.prepare([corpus[1]], str(tmp_path / "out"), verbose=False)
    meta_path = os.path.join(out, "meta.json")
    meta = json.load(open(meta_path)) | edit
    json.dump(meta, open(meta_path, "w"))
    with pytest.raises(ValueError) as e:
        loader.load_data(out)
    assert message in str(e.value) and "meta.json" in str(e.value) and "\n" not in str(e.value)


def test_a_val_split_shorter_than_a_window_is_refused(sharded):
    with pytest.raises(ValueError, match=r"the val split has [\d,]+ tokens, fewer than block_size \+ 1 = 100001"):
        loader.open_data(sharded[0], ModelConfig(block_size=100000))


def test_resume_on_another_prepared_corpus_is_refused_init_from_starts_its_data_over(sharded, tmp_path):
    one, many = sharded  # the same documents, other shard size: another prepare (fingerprint)
    settings = SMALL | dict(data_dir=one, max_steps=4, out_dir=str(tmp_path), stop_at_step=2)
    train.train(settings)
    with pytest.raises(ValueError, match="this data_dir holds another prepared corpus"):
        train.train(dict(out_dir=str(tmp_path), init_from="resume", data_dir=many))
    forked = train.train(dict(init_from=str(tmp_path / "tiny" / "ckpt.pt"), data_dir=many, out_dir=str(tmp_path),
                              run_name="forked", max_steps=3))
    from tooling.checkpoint import load_checkpoint
    state = load_checkpoint(forked["ckpt_path"])["state"]  # one step (4 windows) read from the new data's first window
    assert forked["step"] == 3 and state["data_position"] == 4
    fingerprints = prepared.load_meta(many)["fingerprint"], prepared.load_meta(one)["fingerprint"]
    assert state["data_fingerprint"] == fingerprints[0] != fingerprints[1]


def test_the_ladder_plan_cuts_a_prepared_folder_as_training_does(sharded):
    """ladder --plan checks a prepared folder's regions with the cut Data.stream makes (the held-back tail
    starting at a shard boundary), not with the single-shard formula."""
    from types import SimpleNamespace

    from ladders.recipe import data_needs
    many = sharded[1]
    data, T, f = loader.load_data(many), 32, 0.3
    stable, branch = data.stream(T, 0, f), data.stream(T, 0, f, branch=True)
    config = SimpleNamespace(block_size=T, branch_data_fraction=f, data_dir=many)
    fits = data_needs(config, config, stable.n_windows, branch.n_windows, True)
    beyond = data_needs(config, config, stable.n_windows + 1, branch.n_windows + 1, True)
    assert stable.stop != len(data.train_tokens) - int(len(data.train_tokens) * f)  # the cut did move
    region = lambda plan: [p for p in plan["problems"] if "train tokens: its" in p]  # noqa: E731 (the folder's regions)
    assert region(fits) == [] and len(region(beyond)) == 2
