"""data/: the embedded corpus's tokens, the tokenizers, prepare.py, the window stream, the Dyck tasks."""
import hashlib
import json
import os
import socket
import subprocess
import sys
import types

import numpy as np
import pytest

import synthetic_tasks as synthetic
from data import prepare as prep
from data.loader import BRANCH_FRACTION, Data, default_dir, get_tokenizer, load_data, windows
from test_sample import error_line

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLE = "First Citizen:\nBefore we proceed any further, hear me.\n\nAll: Speak. 1234 é 😀 <|endoftext|>\n"
TXT = ["first txt doc\n", "second txt doc\n"]
sha = lambda a: hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()

# sha256 of the embedded corpus's train, val and val source ids (as uint8), as prepared at 89b7b10
EMBEDDED = {
    "gpt2-4096": (802588, 71703, "7f392731c653e8ecc7c4f09ce2fa52d5c5df083d59c9e104a7924421c25ced73",
                  "c1e38ef3f381ceeee235b42e0fdfe137abeb5009f14e2c1440f5b3900d747617",
                  "f186dde071efa3260b09face60cb1cf989a3f0db4c7b3623e7acb38d337e4fa4"),
    "gpt2-257": (2093830, 184564, "f5bbddd2ae63d0aa9965f5b039ec31f4bee7b300654746c381f65599620909b6",
                 "50afcd6af991f9228f7691cfddbd44408a68c019f2c466b61606b179769f596c",
                 "d0fd351e53fc5f81bd3f1d6b1ebc94944b4d1a476954a4badf6278d75ad9d6d5"),
}
# ... and of its window offsets at block_size 256, seed 1337: the same batches
STREAM = {False: "43763620fd388737b3b0ffcc381f9ddb76da974c01b801b67a8cb498963342b1",
          True: "eb174a160525e043534c727abbef09b725fea2dc3139135db7aab313ecea53db"}


@pytest.mark.parametrize("tokenizer", ["gpt2-4096", "gpt2-257"])
def test_the_embedded_corpus_gives_the_tokens_training_always_read(tokenizer, tmp_path):
    data = load_data(prep.prepare_default(str(tmp_path / "default"), tokenizer, verbose=False))
    n_train, n_val, *hashes = EMBEDDED[tokenizer]
    assert (len(data.train), len(data.val), data.train.dtype) == (n_train, n_val, np.uint16)
    assert [sha(data.train), sha(data.val), sha(data.val_sources.astype(np.uint8))] == hashes
    assert data.source_names == ["comedy", "history", "tragedy"] and data.meta["tokenizer"] == tokenizer
    if tokenizer == "gpt2-4096":
        assert data.meta["unigram_entropy"] == pytest.approx(6.0702144621)
        assert data.meta["mean_doc_len"] == pytest.approx(802588 / 84)
        assert load_data("").data_dir == default_dir() and sha(load_data("").train) == hashes[0]
        for branch, expected in STREAM.items():
            assert sha(data.stream(256, 1337, branch=branch).offsets(0, 20000)) == expected



def test_gpt2_known_ids_round_trip_prefix_vocabularies_and_unknown_names():
    tok = get_tokenizer("gpt2")
    assert tok.encode("hello world") == [31373, 995] and (tok.n_vocab, tok.eot_token) == (50257, 50256)
    ids = tok.encode(SAMPLE)
    assert tok.decode(np.array(ids, dtype=np.uint16)) == SAMPLE and tok.eot_token not in ids
    for n in (257, 4096):
        small, ids = get_tokenizer(f"gpt2-{n}"), get_tokenizer(f"gpt2-{n}").encode(SAMPLE)
        assert (small.n_vocab, small.eot_token) == (n, n - 1) and small.decode(ids) == SAMPLE
        same = small.encoding.decode_single_token_bytes, tok.encoding.decode_single_token_bytes
        assert max(ids) < n - 1 and all(same[0](i) == same[1](i) for i in set(ids))  # as in GPT-2
    for name in ["gpt2-100", "gpt2-99999", "bert", "gpt2-", "cl100k_base"]:
        with pytest.raises(ValueError, match=r"unknown tokenizer .*'gpt2-N' with 257 <= N <= 50257"):
            get_tokenizer(name)


def test_token_bytes_count_utf8_bytes_and_nothing_touches_the_network(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("network access attempted")
    for target, name in [(socket.socket, "connect"), (socket.socket, "connect_ex"), (socket, "getaddrinfo")]:
        monkeypatch.setattr(target, name, refuse)
    get_tokenizer.cache_clear()
    text = "Héllo wörld, 1234 — 😀 naïve\n\tend"
    data = load_data(prep.prepare([write_corpus(tmp_path)[0]], str(tmp_path / "out"), verbose=False))
    tok = get_tokenizer(data.meta["tokenizer"])
    assert data.token_bytes[tok.eot_token] == 0 and data.token_bytes.shape == (tok.n_vocab,)
    assert int(data.token_bytes[[tok.eot_token] + tok.encode(text)].sum()) == len(text.encode())



def write_corpus(folder, n=40):
    """folder/a.jsonl (sources x, y, one row without) and b.txt (two documents); the documents."""
    words = "the quick brown fox jumps over a lazy dog while wizards judge boxing".split()
    rng = np.random.default_rng(0)
    rows = [{"text": " ".join(rng.choice(words, int(rng.integers(5, 80)))) + ".\n", "source": "xy"[i % 2]}
            for i in range(n)]
    rows += [{"text": "no source <|endoftext|> inside"}, {"text": "  "}]  # the blank one is skipped
    (folder / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    (folder / "b.txt").write_text("<|endoftext|>\n".join(TXT))
    docs = [(r["text"], r.get("source", "a")) for r in rows[:-1]]
    return str(folder / "a.jsonl"), str(folder / "b.txt"), docs + [(t, "b") for t in TXT]


def files(folder):
    return {name: open(os.path.join(folder, name), "rb").read() for name in sorted(os.listdir(folder))}


def read_documents(data):
    """[(split, text, source)] of a prepared folder, cut at its eot tokens."""
    tok, out = get_tokenizer(data.meta["tokenizer"]), []
    for split, tokens in (("train", data.train), ("val", data.val)):
        starts = np.flatnonzero(np.asarray(tokens) == tok.eot_token).tolist() + [len(tokens)]
        assert starts[0] == 0  # every document is PRECEDED by eot
        for a, b in zip(starts, starts[1:]):
            source = data.source_names[data.val_sources[a]] if split == "val" else None
            assert split == "train" or (data.val_sources[a:b] == data.val_sources[a]).all()
            out.append((split, tok.decode(tokens[a + 1:b]), source))
    return out


def test_prepare_writes_every_document_once_after_an_eot(tmp_path, monkeypatch):
    jsonl, txt, docs = write_corpus(tmp_path)
    out = prep.prepare([jsonl, txt], str(tmp_path / "out"), val_fraction=0.2, seed=1, verbose=False)
    data = load_data(out)
    meta = data.meta
    assert meta["n_vocab"] - 1 == meta["eot_token"] == 4095 and meta["sources"] == ["a", "b", "x", "y"]
    found = read_documents(data)
    train, val = ([(t, s) for split, t, s in found if split == name] for name in ("train", "val"))
    assert sorted(t for t, _ in train + val) == sorted(t for t, _ in docs)  # each document once
    for part in (train, val):  # in input order
        assert [t for t, _ in docs if t in {t for t, _ in part}] == [t for t, _ in part]
    assert {s for _, s in val} == {"b", "x", "y"} and all((t, s) in docs for t, s in val)  # a per source
    assert (meta["train_tokens"], meta["val_tokens"]) == (len(data.train), len(data.val))
    assert meta["train_documents"] + meta["val_documents"] == len(docs) and len(val) == meta["val_documents"]
    other = prep.prepare([jsonl, txt], str(tmp_path / "other"), val_fraction=0.2, seed=2, verbose=False)
    monkeypatch.setattr(prep, "CHUNK", 3)  # 15 chunks instead of 1, two threads, the folder as input
    again = prep.prepare([str(tmp_path)], str(tmp_path.parent / "again"), val_fraction=0.2, seed=1, workers=2,
                         verbose=False)
    assert files(again) == files(out) and files(other)["val.bin"] != files(again)["val.bin"]


def test_val_tokens_and_train_tokens(tmp_path):
    jsonl, _, docs = write_corpus(tmp_path)
    full = load_data(prep.prepare([jsonl], str(tmp_path / "full"), val_tokens=100, verbose=False))
    texts = [t for s, t, _ in read_documents(full) if s == "val"]
    assert texts == [t for t, _ in docs[:len(texts)]]  # val: the first documents ...
    last = len(get_tokenizer().encode(texts[-1])) + 1  # ... until they hold 100 tokens
    assert len(full.val) - last < 100 <= len(full.val)
    cut = load_data(prep.prepare([jsonl], str(tmp_path / "cut"), val_tokens=100, train_tokens=500,
                                 verbose=False))
    assert len(cut.train) == cut.meta["train_tokens"] == 500 and (cut.train == full.train[:500]).all()
    assert (cut.val == full.val).all() and cut.meta["sources"] == ["x", "y"]


def test_parquet_and_hf_give_the_jsonl_bytes(tmp_path, monkeypatch):
    jsonl, _, docs = write_corpus(tmp_path)
    rows = [{"text": t, "source": s} for t, s in docs[:-2] if s != "a"]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    expected = files(prep.prepare([str(tmp_path / "d.jsonl")], str(tmp_path / "jsonl"), verbose=False))
    fake = types.SimpleNamespace(load_dataset=lambda name, config, split, streaming: iter(rows))
    monkeypatch.setitem(sys.modules, "datasets", fake)  # the --hf path without the network
    hf = files(prep.prepare(hf="org/d", out_dir=str(tmp_path / "hf"), verbose=False))
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet", row_group_size=7)
    got = files(prep.prepare([str(tmp_path / "d.parquet")], str(tmp_path / "parquet"), verbose=False))
    for name in ("train.bin", "val.bin", "val_sources.bin"):
        assert got[name] == expected[name] == hf[name], name


def test_a_failed_prepare_leaves_nothing_and_a_rerun_replaces_the_folder(tmp_path, monkeypatch):
    jsonl, txt, _ = write_corpus(tmp_path)

    def killed(*args):
        raise KeyboardInterrupt
    with monkeypatch.context() as m:
        m.setattr(prep, "write", killed)
        with pytest.raises(KeyboardInterrupt):
            prep.prepare([jsonl], str(tmp_path / "out"), verbose=False)
    assert sorted(os.listdir(tmp_path)) == ["a.jsonl", "b.txt"]  # no folder, no temporary one
    out = prep.prepare([jsonl, txt], str(tmp_path / "out"), verbose=False)
    prep.prepare([txt], out, verbose=False)  # into a folder that exists: its files replaced
    assert load_data(out).meta["sources"] == ["b"]
    assert sorted(os.listdir(out)) == ["meta.json", "train.bin", "val.bin"]


def test_two_processes_preparing_the_embedded_corpus_both_end_with_it(tmp_path, monkeypatch):
    out, write, inode = str(tmp_path / "d"), prep.write, []

    def the_other_finishes_first(*args):  # while this prepare writes, another one renames its folder in
        monkeypatch.setattr(prep, "write", write)
        inode.append(os.stat(os.path.join(prep.prepare_default(out, "gpt2-257", False), "val.bin")).st_ino)
        return write(*args)
    monkeypatch.setattr(prep, "write", the_other_finishes_first)
    assert prep.prepare_default(out, "gpt2-257", verbose=False) == out and os.listdir(tmp_path) == ["d"]
    assert os.stat(os.path.join(out, "val.bin")).st_ino == inode[0]  # kept, not replaced
    out = str(tmp_path / "e")  # and for real
    code = f"from data import prepare; prepare.prepare_default({out!r}, 'gpt2-257', False)"
    runs = [subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stderr=subprocess.PIPE)
            for _ in range(2)]
    assert [p.wait(timeout=120) for p in runs] == [0, 0], [p.stderr.read() for p in runs]
    assert sorted(os.listdir(tmp_path)) == ["d", "e"] and sha(load_data(out).val) == EMBEDDED["gpt2-257"][3]



@pytest.mark.parametrize("seq_len", [16, 20, 25, 99])
def test_windows_follow_the_seeded_permutation_per_epoch_inside_their_region(seq_len):
    tokens = np.arange(1000, dtype=np.uint16)
    cut = 1000 - int(1000 * BRANCH_FRACTION)
    for branch, (start, stop) in ((False, (0, cut)), (True, (cut, 1000))):
        stream = Data("", {}, tokens, tokens, None).stream(seq_len, seed=5, branch=branch)
        n, i = stream.n_windows, max(0, stream.n_windows - 2)
        # counted by hand: the windows of seq_len + 1 tokens at start + k * seq_len, inside [start, stop)
        fits = [o for o in range(start, stop, seq_len) if o + seq_len + 1 <= stop]
        assert n == len(fits) and stream.name == ("branch" if branch else "stable")
        perm = lambda k: np.random.default_rng([5, k // n]).permutation(n)[k % n]
        twin = [start + seq_len * perm(k) for k in range(3 * n + 4)]
        assert stream.offsets(0, 3 * n + 4).tolist() == twin  # three epochs and a bit, in one call
        assert stream.offsets(i, 5).tolist() == twin[i:i + 5]  # across an epoch boundary
        read = windows(tokens, twin[:n], seq_len)
        assert sorted(read[:, 0].tolist()) == fits and read.min() >= start and read.max() < stop
    x, y = stream.batch(7, 4)
    rows = windows(tokens, stream.offsets(7, 4), seq_len)
    assert str(x.dtype) == str(y.dtype) == "torch.int64" and x.shape == (4, seq_len)
    assert (x.numpy() == rows[:, :-1]).all() and (y.numpy() == rows[:, 1:]).all()
    with pytest.raises(ValueError, match="fewer than block_size"):
        Data("", {}, tokens[:seq_len], tokens, None).stream(seq_len, seed=0)



def test_prepare_cli(tmp_path, capsys):
    jsonl, out = write_corpus(tmp_path)[0], str(tmp_path / "out")
    assert prep.main([jsonl, "--out", out, "--val_tokens", "50"]) == 0
    assert capsys.readouterr().out.startswith(f"prepared {out} in ")
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"text": \n')
    mistakes = [(["nope.txt", "--out", out], "no such .txt, .jsonl or .parquet file or folder: nope.txt"),
                ([jsonl, "--out", out, "--tokenizer", "gpt3"], "unknown tokenizer 'gpt3'"),
                ([jsonl], "--out is required"), (["--seed", "3"], "split as load_data('') reads it"),
                ([str(tmp_path / "bad.jsonl"), "--out", out], "bad.jsonl:2: not a JSON object")]
    for argv, needle in mistakes:
        assert needle in error_line(prep.main, argv, capsys, "prepare.py"), argv
    result = subprocess.run([sys.executable, os.path.join(REPO, "data", "prepare.py"), "missing.txt"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and result.stderr.splitlines()[-1].startswith("prepare.py: error: no such")
    with pytest.raises(FileNotFoundError, match="run data/prepare.py"):
        load_data(str(tmp_path / "nowhere"))



is_balanced = lambda word: synthetic.closing_sequence(word) == []


@pytest.mark.parametrize("n_types,max_depth", [(1, 2), (3, 6), (4, 3)])
def test_dyck_items_close_the_context_exactly(n_types, max_depth):
    make = lambda seed: synthetic.dyck_items(300, seed, n_types=n_types, max_depth=max_depth, max_length=24)
    items = make(1)
    allowed = {b for pair in synthetic.BRACKETS[:n_types] for b in pair}
    tok = get_tokenizer("gpt2-4096")
    for item in items:
        ctx, cont = item["context"], item["continuation"]
        assert cont.startswith(" ") and not ctx.endswith(" ")
        assert set(ctx.split()) | set(cont.split()) <= allowed
        assert cont.split() == synthetic.closing_sequence(ctx) != []  # the shortest completion
        assert is_balanced(ctx + cont) and not is_balanced(ctx + cont.rsplit(" ", 1)[0])
        # scoring sees the tokens training text has
        assert tok.encode(ctx) + tok.encode(cont) == tok.encode(ctx + cont)
    assert items == make(1) != make(2)


def test_dyck_boundaries_and_depth():
    a, b, c = (synthetic.dyck_items(20, seed=3, boundary=k, prompt=p) for k, p in
               [("continuation", ""), ("context", ""), ("none", synthetic.BIGBENCH_DYCK_PROMPT)])
    assert a[0] == {"context": "{ [ [ ( [", "continuation": " ] ) ] ] }"}  # the generator of 89b7b10
    for x, y, z in zip(a, b, c):
        assert x["context"] + x["continuation"] == y["context"] + y["continuation"]
        assert z["context"] == synthetic.BIGBENCH_DYCK_PROMPT + x["context"]
        assert z["continuation"] == x["continuation"][1:] == y["continuation"]
    deep = synthetic.dyck_items(50, seed=0, max_depth=5, min_open=3, max_length=30)
    assert min(len(i["continuation"].split()) for i in deep) >= 3
    words = ["( ]", "( (", ") (", "( x )", "( [ ] { < > } )"]
    assert [is_balanced(w) for w in words] == [False] * 4 + [True]
