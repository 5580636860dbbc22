"""Trust of the tools around training (grow.py, probe.py, sample.py, data/): each test is a case a prober found.
- no tool writes into a run folder another process holds (its lock); outside a run folder no lock is taken;
- every count a user gives has a limit, and the refusal says why;
- inputs that are not regular files (a named pipe, a symlink to /dev/zero) are refused instead of blocking;
- a lone surrogate in a .jsonl and a shard token outside the vocabulary are one line naming the file;
- every option's --help shows its default.
"""
import argparse
import importlib
import os
import shutil
import socket
import subprocess

import numpy as np
import pytest
import torch

import grow
import probe
import sample
import train
from conftest import one_line_error, small_corpus, within
from data import loader
from data import prepare as prep
from model import GPT, ModelConfig
from tooling import checkpoint
from tooling.checkpoint import plain_config, save_file


def tiny_checkpoint(path, data_dir=None, **overrides):
    """A tied prelude-core-coda checkpoint (4096-token vocabulary, as conftest's data_dir)."""
    torch.manual_seed(0)
    cfg = ModelConfig(**dict(vocab_size=4096, eot_token=4095, block_size=32, n_layer=4, n_embd=32, n_head=2,
                             layout="pcc", n_passes=2, tie_core=True) | overrides)
    save_file(str(path), dict(model_config=plain_config(cfg), model=GPT(cfg).state_dict(), state=dict(step=3),
                              data_dir=data_dir, tokenizer="gpt2-4096"))
    return str(path)


@pytest.fixture
def held_run(tmp_path):
    """A run folder (ckpt.pt, log.jsonl) whose lock a live process on this host holds, as a training does."""
    run = tmp_path / "run"
    run.mkdir()
    tiny_checkpoint(run / "ckpt.pt")
    (run / "log.jsonl").write_text('{"step": 3}\n')
    holder = subprocess.Popen(["sleep", "120"])
    (run / "lock").write_text(f"{socket.gethostname()} {holder.pid} 2026-11-30T23:59:59")
    yield run, holder
    holder.kill()
    holder.wait()


# ----------------------------------------------------------------------------------------------------
# 1. Writing into a run folder: only while holding its lock


def test_grow_in_place_refuses_a_run_folder_a_training_holds(held_run, capsys, monkeypatch):
    run, holder = held_run
    ckpt, before = str(run / "ckpt.pt"), (run / "ckpt.pt").read_bytes()
    err = one_line_error(grow.main, ["--ckpt", ckpt, "--passes", "4"], capsys, "grow.py")
    assert f"{run} is in use by process {holder.pid} on this host since 2026-11-30T23:59:59" in err
    assert "wait for it to finish, or write the grown checkpoint elsewhere with --out" in err
    (run / "lock").write_text("node-7 4242 2026-11-30T23:59:59")  # another host: cannot tell whether it runs
    err = one_line_error(grow.main, ["--ckpt", ckpt, "--passes", "4"], capsys, "grow.py")
    assert "process 4242 on host node-7" in err and "if it has ended, delete the lock" in err
    assert (run / "ckpt.pt").read_bytes() == before
    # the training has ended (its lock is stale): grow takes the lock, writes while holding it, releases it
    holder.kill()
    holder.wait()
    (run / "lock").write_text(f"{socket.gethostname()} {holder.pid} 2026-11-30T23:59:59")
    locks_at_save = []
    save = checkpoint.save_file
    monkeypatch.setattr(checkpoint, "save_file", lambda path, ckpt: (
        locks_at_save.append(open(os.path.dirname(path) + "/lock").read().split()[1]), save(path, ckpt)))
    assert grow.main(["--ckpt", ckpt, "--passes", "4"]) == 0
    assert locks_at_save == [str(os.getpid())] and not (run / "lock").exists()
    assert checkpoint.load_model(ckpt)[0].config.n_passes == 4


def test_grow_outside_a_run_folder_takes_no_lock(held_run, tmp_path, monkeypatch):
    run, _ = held_run
    (tmp_path / "elsewhere").mkdir()
    out = tmp_path / "elsewhere" / "grown.pt"
    save = checkpoint.save_file
    monkeypatch.setattr(checkpoint, "save_file", lambda path, ckpt: (
        os.listdir(os.path.dirname(path)) == [] or pytest.fail("a lock was taken"), save(path, ckpt)))
    assert grow.main(["--ckpt", str(run / "ckpt.pt"), "--passes", "4", "--out", str(out)]) == 0  # reading: no lock
    assert sorted(os.listdir(tmp_path / "elsewhere")) == ["grown.pt"]


@pytest.mark.parametrize("where", ["run", "run/probe"])
def test_probe_plots_refuse_a_run_folder_a_training_holds(held_run, tmp_path, capsys, where):
    run, holder = held_run
    err = one_line_error(probe.main, ["--ckpt", str(run / "ckpt.pt"), "--plot", str(tmp_path / where)], capsys,
                         "probe.py")
    assert f"is in use by process {holder.pid} on this host" in err and "elsewhere with --plot" in err
    assert not (run / "probe").exists() and sorted(os.listdir(run)) == ["ckpt.pt", "lock", "log.jsonl"]


# ----------------------------------------------------------------------------------------------------
# 2. Bounded work: every count has a limit that says why

PASSES = "at most 64 (4 x the 16 test-time passes the papers go to; each pass runs the looped blocks again)"
COUNTS = [
    (grow.main, "grow.py", ["--passes", "100000000"], f"argument --passes: 100000000: {PASSES}"),
    (probe.main, "probe.py", ["--n_passes", "100000"], f"argument --n_passes: 100000: {PASSES}"),
    (probe.main, "probe.py", ["--visits", "1", "100000"], "argument --visits: 100000: at most 64 (a block runs once"),
    (sample.main, "sample.py", ["--n_passes", "1000000"], f"argument --n_passes: 1000000: {PASSES}"),
    (sample.main, "sample.py", ["--num_samples", "100000"],
     "argument --num_samples: 100000: at most 1,000 (samples run one after another, each printed whole)"),
    (sample.main, "sample.py", ["--max_new_tokens", "100000000"],
     "argument --max_new_tokens: 100000000: at most 1,000,000 (over all samples: one forward of the model"),
    (sample.main, "sample.py", ["--num_samples", "100", "--max_new_tokens", "20000"],
     "num_samples x max_new_tokens = 2,000,000 new tokens: at most 1,000,000 (over all samples: one forward"),
]


@pytest.mark.parametrize("main, prog, args, message", COUNTS, ids=[f"{p} {' '.join(a)}" for _, p, a, _ in COUNTS])
def test_every_count_has_a_limit_that_says_why(main, prog, args, message, tmp_path, capsys):
    missing = str(tmp_path / "absent.pt")  # refused before the checkpoint is read
    assert message in one_line_error(main, ["--ckpt", missing, *args], capsys, prog)


def test_prepare_seed_stays_exact_in_json(tmp_path, capsys):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "one"}\n{"text": "two"}\n')
    err = one_line_error(prep.main, [str(corpus), "--out", str(tmp_path / "out"), "--seed", str(2**53)], capsys,
                         "prepare.py")
    assert f"seed must be an integer in [0, 2**53) (meta.json records it), got {2**53}" in err


def test_pass_limits_hold_from_python_too():
    cfg = ModelConfig(vocab_size=64, eot_token=63, block_size=16, n_layer=4, n_embd=32, n_head=2, layout="pcc",
                      n_passes=2)
    with pytest.raises(ValueError, match=r"n_passes=65: at most 64 \(4 x the 16"):
        grow.grown_config(cfg, 65)  # also train.py's grow_to
    with pytest.raises(ValueError, match=r"n_passes=65: at most 64"):
        sample.check_n_passes(cfg, 65)
    assert grow.grown_config(cfg, 64).n_passes == 64
    from model import execution_plan
    for layout_cfg in (cfg, ModelConfig(vocab_size=64, eot_token=63, block_size=16, n_layer=4, n_embd=32, n_head=2,
                                        layout="smelt", n_passes=2)):
        with pytest.raises(ValueError, match=r"in \[1, 64\] \(4 x the 16"):  # any forward's n_passes=
            execution_plan(layout_cfg, 65)
    with pytest.raises(ValueError, match=r"ModelConfig.n_passes=65: at most 64"):
        ModelConfig(layout="smelt", n_passes=65)


def test_probe_attention_limits(tmp_path, data_dir, capsys, monkeypatch):
    ckpt = tiny_checkpoint(tmp_path / "model.pt", data_dir)
    err = one_line_error(probe.main, ["--ckpt", ckpt, "--attn_topk", "17"], capsys, "probe.py")
    assert "--attn_topk 17: at most seq_len // 2 = 16 (only queries with 2 x attn_topk attendable keys" in err
    monkeypatch.setattr(probe, "MAX_RECORDED_BYTES", 1 << 18)
    err = one_line_error(probe.main, ["--ckpt", ckpt, "--tokens", "512"], capsys, "probe.py")
    assert ("a probe forward keeps the attention of every executed block: 8 windows x 2 heads x 32^2 x 4 bytes x 6 "
            "blocks = 0.000366 GiB, above 0.000244 GiB; lower --batch_size or --seq_len") in err


# ----------------------------------------------------------------------------------------------------
# 3. Inputs that are not regular files; text that is not text


def test_prepare_reads_only_regular_files(tmp_path, capsys):
    os.mkfifo(tmp_path / "pipe.jsonl")
    os.symlink("/dev/zero", tmp_path / "zero.txt")
    folder = tmp_path / "folder"
    folder.mkdir()
    os.mkfifo(folder / "inside.jsonl")
    out = ["--out", str(tmp_path / "out")]
    with within(60):
        for path, named in ((tmp_path / "pipe.jsonl", "pipe.jsonl"), (tmp_path / "zero.txt", "zero.txt (a symlink to "
                            "/dev/zero)"), (folder, "inside.jsonl")):
            err = one_line_error(prep.main, [str(path), *out], capsys, "prepare.py")
            assert f"{named} is not a regular file (a pipe or a device would block or never end)" in err, err
        os.mkfifo(tmp_path / "meta.json")  # an index that is a pipe: refused, never read
        err = one_line_error(prep.main, ["--verify", "--out", str(tmp_path)], capsys, "prepare.py")
        assert f"the index {tmp_path / 'meta.json'} is not a regular file" in err
    assert not (tmp_path / "out").exists()


def test_prepare_names_the_file_and_line_of_a_lone_surrogate(tmp_path, capsys):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "fine"}\n{"text": "ab\\udcffcd"}\n{"text": "also fine"}\n')  # valid JSON
    err = one_line_error(prep.main, [str(corpus), "--out", str(tmp_path / "out")], capsys, "prepare.py")
    assert f"{corpus}:2: field 'text' holds a lone surrogate '\\udcff' at character 2" in err
    corpus.write_bytes(b'{"text": "fine"}\n{"text": "ab\xffcd"}\n')  # invalid UTF-8 bytes: the file is named
    err = one_line_error(prep.main, [str(corpus), "--out", str(tmp_path / "out")], capsys, "prepare.py")
    assert f"{corpus}: not valid UTF-8" in err


def test_sample_prompt_file_must_be_a_regular_file(tmp_path, capsys):
    os.mkfifo(tmp_path / "pipe.txt")
    with within(60):
        for path in (tmp_path / "pipe.txt", tmp_path):
            err = one_line_error(sample.main, ["--ckpt", str(tmp_path / "absent.pt"), "--start", f"FILE:{path}"],
                                 capsys, "sample.py")
            assert f"prompt file {path} is not a regular file" in err
    (tmp_path / "long.txt").write_text("x" * (sample.MAX_PROMPT_CHARS + 1))
    with pytest.raises(ValueError, match="is over 1,048,576 characters"):
        sample.read_start(f"FILE:{tmp_path / 'long.txt'}")


# ----------------------------------------------------------------------------------------------------
# 4. A shard that changed after prepare: a token id outside the vocabulary


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded")
    return prep.prepare([small_corpus(root)], str(root / "prepared"), val_fraction=0.34, seed=0, shard_tokens=4096,
                        verbose=False)


def test_loader_names_the_shard_and_position_of_a_token_outside_the_vocabulary(sharded, tmp_path):
    data_dir = shutil.copytree(sharded, tmp_path / "data")
    tokens = np.memmap(data_dir / "train_000002.bin", dtype=np.uint16, mode="r+")
    tokens[123] = 4096  # n_vocab is 4096; the file keeps its size, so opening does not see it
    tokens.flush()
    data = loader.load_data(str(data_dir))
    stream = data.stream(32, 0, 0.0)
    with pytest.raises(ValueError, match=r"train_000002\.bin: token id 4096 at position 123 is outside the "
                                         r"vocabulary \(n_vocab=4096 in meta\.json\)"):
        stream.batch(0, stream.n_windows)


def test_training_on_such_a_shard_stops_with_one_line(data_dir, tmp_path, capsys):
    copy = shutil.copytree(data_dir, tmp_path / "data")
    tokens = np.memmap(copy / "train_000000.bin", dtype=np.uint16, mode="r+")
    tokens[:] = 5000  # every window holds one: the first batch has it
    tokens.flush()
    settings = dict(n_layer=2, n_embd=32, n_head=2, n_expert=0, layout="plain", block_size=32, batch_size=2,
                    eval_tokens=64, max_steps=2, warmup_steps=1, data_dir=str(copy),
                    out_dir=str(tmp_path / "out"))
    argv = [f"--{k}={v}" for k, v in settings.items()]
    err = one_line_error(train.main, argv, capsys, "train.py")
    assert "train_000000.bin: token id 5000 at position" in err and "outside the vocabulary (n_vocab=4096" in err


# ----------------------------------------------------------------------------------------------------
# 5. Names and help texts


def test_growth_step_names_the_setting_max_steps():
    with pytest.raises(ValueError, match=r"grow_at=2000 is after the last step max_steps=1000"):
        grow.growth_step(1000, 2000)


class Captured(BaseException):
    def __init__(self, parser):
        super().__init__()
        self.parser = parser


@pytest.mark.parametrize("module_name", ["eval_core", "probe", "data.prepare", "grow", "sample"])
def test_help_shows_every_default(module_name, monkeypatch):
    def capture(self, args=None, namespace=None):
        raise Captured(self)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    with pytest.raises(Captured) as e:
        importlib.import_module(module_name).main([])
    parser = e.value.parser
    formatter = parser._get_formatter()
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        text = " ".join(formatter._expand_help(action).split())
        if action.required and action.option_strings:
            assert "(required)" in text, (action.dest, text)
            continue
        assert "(default: " in text, (action.dest, text)
        shown = text[text.index("(default: "):]
        value = isinstance(action.default, (str, int, float)) and not isinstance(action.default, bool)
        if value and action.default != "":
            assert str(action.default) in shown, (action.dest, text)
        elif isinstance(action.default, tuple):
            assert " ".join(map(str, action.default)) in shown, (action.dest, text)
