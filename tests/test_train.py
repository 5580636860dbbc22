"""train.py: optimizers, schedule, data order, resume, decay branches, growth, DDP, failure modes.
Runs on a small prepared slice of the embedded corpus and a very small looped MoE, a few steps each."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import train
from data import prepare as prep
from model import GPT, ModelConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# a very small SMELT MoE: block 0 looped twice, block 1 once; 4 experts, top-2
SMALL = dict(n_layer=2, n_embd=32, n_head=2, n_expert=4, top_k=2, layout="smelt", n_loops=2, block_size=32,
             batch_size=4, eval_tokens=256, warmup_steps=2, eval_interval=100, progress=False)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """A few acts of each source of the embedded corpus, prepared like the real thing (~30k tokens)."""
    root = tmp_path_factory.mktemp("data")
    lines, per_source = [], {}
    with open(prep.DEFAULT_CORPUS) as f:
        for line in f:
            doc = json.loads(line)
            if per_source.get(doc["source"], 0) < 3:
                per_source[doc["source"]] = per_source.get(doc["source"], 0) + 1
                lines.append(json.dumps({"text": doc["text"][:8000], "source": doc["source"]}))
    corpus = root / "corpus.jsonl"
    corpus.write_text("\n".join(lines) + "\n")
    return prep.prepare([str(corpus)], str(root / "prepared"), val_fraction=0.34, seed=0, verbose=False)


def run(data_dir, out, **overrides):
    return train.train(SMALL | dict(data_dir=data_dir, out_dir=str(out)) | overrides)


# ---- settings


def test_tiny_config_file_equals_defaults():
    values = train.read_config_file(os.path.join(REPO, "config", "tiny.py"))
    assert values and all(train.DEFAULTS[k] == v for k, v in values.items())
    cfg = train.model_config_from(train.DEFAULTS)
    assert cfg.layout == "smelt" and cfg.n_loops == 2 and cfg.n_expert == 8


def test_unknown_key_and_wrong_type_fail_clearly(tmp_path):
    with pytest.raises(ValueError, match="unknown command-line key 'max_stepz'"):
        train.parse_args(["--max_stepz=3"])
    with pytest.raises(ValueError, match="max_steps='abc' has type str, expected int"):
        train.parse_args(["--max_steps=abc"])
    with pytest.raises(ValueError, match="n_embd=1.5 has type float, expected int"):
        train.parse_args(["--n_embd=1.5"])
    bad = tmp_path / "bad.py"
    bad.write_text("import math\nlearning_rate = 0.1\n")
    with pytest.raises(ValueError, match="unknown key in .*bad.py 'learning_rate'"):
        train.parse_args([str(bad)])
    assert train.parse_args(["--max_tokens=1e6", "--layout=pcc", "--grow_at=300"]) == \
        dict(max_tokens=1000000, layout="pcc", grow_at=300.0)
    with pytest.raises(ValueError, match="unknown setting 'nope'"):
        train.train({"nope": 1})
    assert train.main(["--optimizer=sgd"]) == 2  # CLI: one clear line and exit status 2, no traceback


def test_missing_and_corrupt_data_fail_clearly(tmp_path, data_dir):
    with pytest.raises(FileNotFoundError, match="meta.json not found"):
        run(str(tmp_path / "nowhere"), tmp_path)
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in os.listdir(data_dir):
        (broken / name).write_bytes(open(os.path.join(data_dir, name), "rb").read())
    with open(broken / "train.bin", "r+b") as f:
        f.truncate(1001)
    with pytest.raises(ValueError, match="train.bin is truncated or corrupt"):
        run(str(broken), tmp_path)


# ---- optimizers and schedule


@pytest.mark.parametrize("model_overrides", [
    dict(),  # the tiny default: SMELT MoE
    dict(n_expert=0, layout="pcc", n_layer=3, n_passes=2, tie_core=False, norm_gain=False),
    dict(n_expert=0, tie_embeddings=True, init="nanogpt", qk_norm=True),
])
@pytest.mark.parametrize("optimizer", ["muon", "adamw"])
def test_param_groups_cover_every_parameter_once(model_overrides, optimizer):
    settings = train.resolve_settings(dict(n_embd=32, n_head=2, optimizer=optimizer) | model_overrides)
    model = GPT(train.model_config_from(settings))
    optimizers = train.build_optimizers(model, train.train_config_from(settings))
    seen = [id(p) for opt in optimizers for group in opt.param_groups for p in group["params"]]
    assert sorted(seen) == sorted(id(p) for p in model.parameters())  # every parameter exactly once
    kinds = {g["name"]: type(opt).__name__ for opt in optimizers for g in opt.param_groups}
    assert kinds["embedding"] == "AdamW" and kinds["scalar" if "scalar" in kinds else "embedding"] == "AdamW"
    assert kinds["matrix"] == ("Muon" if optimizer == "muon" else "AdamW")
    if "router" in kinds:
        assert kinds["router"] == "AdamW"


def test_wsd_schedule_warmup_stable_decay_to_floor():
    lrs = [train.wsd_multiplier(s, 4, 10, 20, "cosine", 0.1) for s in range(20)]
    assert lrs[0] == 0.25 and lrs[3] == 1.0 and lrs[4:10] == [1.0] * 6
    assert all(a > b for a, b in zip(lrs[10:], lrs[11:])) and lrs[-1] == pytest.approx(0.1)
    linear = [train.wsd_multiplier(s, 0, 10, 20, "linear", 0.0) for s in range(20)]
    assert linear[14] == pytest.approx(0.5) and linear[-1] == 0.0
    assert train.lr_scaling(4e6, 1e6, -0.5) == pytest.approx(0.5)  # [X16]


def test_token_stream_is_seeded_and_covers_every_window_each_epoch():
    tokens = np.arange(1001)
    stream = train.TokenStream(tokens, 10, seed=3, start=100, stop=901)
    first_epoch = stream.offsets(0, stream.n_windows)
    assert sorted(first_epoch) == list(range(100, 100 + 10 * stream.n_windows, 10))
    assert not np.array_equal(first_epoch, stream.offsets(stream.n_windows, stream.n_windows))  # reshuffled
    np.testing.assert_array_equal(stream.offsets(5, 7), train.TokenStream(tokens, 10, 3, 100, 901).offsets(5, 7))
    x, y, _ = stream.batch(0, 2)
    assert torch.equal(x[:, 1:], y[:, :-1])


# ---- training runs


def test_loss_falls_on_the_tiny_default(tmp_path, data_dir):
    """The tiny default model and optimizer (smaller batch and step count than the CLI default)."""
    summary = train.train(dict(data_dir=data_dir, out_dir=str(tmp_path), batch_size=8, max_steps=20,
                               warmup_steps=4, eval_interval=20, eval_tokens=1024, progress=False))
    losses = summary["train_losses"]
    assert losses[0] == pytest.approx(np.log(4096), abs=0.05)  # [X] init: zero lm head -> uniform
    assert np.mean(losses[-4:]) < losses[0] - 1.5
    assert summary["val_loss"] < summary["unigram_entropy"]  # a context-free model cannot beat this
    log = [json.loads(line) for line in open(summary["log_path"])]
    assert [r["step"] for r in log] == [0, 20] and log[-1]["val_loss"] < log[0]["val_loss"] - 1.0
    last = log[-1]
    assert set(last["val_loss_by_source"]) == {"comedy", "history", "tragedy"}
    assert 0 <= last["expert_load_min"] <= 1 / 8 <= last["expert_load_max"] <= 1 and last["balance"] >= 1.0
    assert last["tokens"] == 20 * 8 * 128 and last["flops"] == pytest.approx(
        train.flops_per_token(train.model_config_from(train.DEFAULTS)) * last["tokens"])
    model, ckpt = GPT.from_checkpoint(summary["ckpt_path"])
    assert ckpt["step"] == 20 and ckpt["tokens_seen"] == last["tokens"] and ckpt["data_dir"] == data_dir
    assert set(ckpt["optimizer"]["state"]) == {n for n, _ in model.named_parameters()}  # keyed by name


def test_resume_gives_identical_losses(tmp_path, data_dir):
    common = dict(max_steps=6, n_passes_choices=[1, 2, 3], eval_interval=3, grad_accum=2)
    straight = run(data_dir, tmp_path / "a", **common)
    first = run(data_dir, tmp_path / "b", stop_at_step=3, **common)
    assert first["step"] == 3
    second = train.train(dict(out_dir=str(tmp_path / "b"), resume=True, progress=False))
    assert second["step"] == 6
    assert first["train_losses"] + second["train_losses"] == straight["train_losses"]  # bitwise
    assert second["val_loss"] == straight["val_loss"] and second["flops"] == straight["flops"]
    log_a = [json.loads(l) for l in open(straight["log_path"])]
    log_b = [json.loads(l) for l in open(second["log_path"])]
    strip = lambda log: [{k: v for k, v in r.items() if k != "seconds"} for r in log]
    assert strip(log_b) == strip(log_a)  # the log continues exactly (incl. the eval at the stop)  # noqa
    assert len(log_a[-1]["flops_by_passes"]) > 1  # random passes per step: several K were run


def test_decay_branch_forks_weights_decays_to_floor_on_unseen_data(tmp_path, data_dir):
    stable = run(data_dir, tmp_path, run_name="stable", max_steps=6, decay_fraction=0.0, save_steps=[4],
                 matrix_lr=0.03)
    assert stable["data_region"] == "stable" and stable["data_read"][1] <= stable["data_split"]
    ckpt_path = os.path.join(stable["run_dir"], "ckpt_step4.pt")
    branch = train.train(dict(out_dir=str(tmp_path), init_from=ckpt_path, decay_branch=True,
                              decay_tokens=5 * 4 * 32, min_lr_fraction=0.1, progress=False))
    assert branch["run_dir"].endswith("stable_decay4") and os.path.exists(branch["ckpt_path"])
    assert branch["step"] == 4 + 5 and branch["max_steps"] == 9
    assert branch["data_region"] == "branch" and branch["data_read"][0] >= branch["data_split"]  # unseen data
    # its first loss is the step-4 checkpoint's loss on the first held-back batch: it starts from those weights
    model, ckpt = GPT.from_checkpoint(ckpt_path)
    train_tokens = prep.load_split(data_dir, "train")
    stream = train.TokenStream(train_tokens, 32, 1337, branch["data_split"], len(train_tokens))
    x, y, _ = stream.batch(0, 4)
    model(x, y)
    assert branch["train_losses"][0] == pytest.approx(model.last_stats["ce"].item(), rel=1e-6)
    log = [json.loads(l) for l in open(branch["log_path"])]
    assert log[-1]["lr"] == pytest.approx(0.1 * 0.03)  # the floor, inherited matrix_lr
    assert log[-1]["tokens"] == ckpt["tokens_seen"] + 5 * 4 * 32


@pytest.mark.parametrize("untie", [False, True])
def test_growth_flops_by_phase_and_resume_across_growth(tmp_path, data_dir, untie):
    pcc = dict(layout="pcc", n_layer=3, n_passes=1, n_expert=0, max_steps=6, grow_at=0.5, grow_to=3,
               grow_untie=untie, grow_rewarm_steps=2, eval_interval=3)
    summary = run(data_dir, tmp_path / "a", **pcc)
    model, ckpt = GPT.from_checkpoint(summary["ckpt_path"])
    assert model.config.n_passes == 3 and model.config.tie_core == (not untie) and ckpt["grown"]
    assert set(ckpt["optimizer"]["state"]) == {n for n, _ in model.named_parameters()}
    flops = ckpt["flops_by_passes"]  # 3 steps at K=1, then 3 at K=3, each at its own FLOPs per token
    before = ModelConfig.from_dict(ckpt["model_config"] | dict(n_passes=1, tie_core=True))
    tokens_per_step = 4 * 32
    assert flops[1] == pytest.approx(3 * tokens_per_step * train.flops_per_token(before))
    assert flops[3] == pytest.approx(3 * tokens_per_step * train.flops_per_token(model.config))
    assert all(np.isfinite(summary["train_losses"]))
    # stop right before the growth step, resume: it grows then and the curve is identical
    first = run(data_dir, tmp_path / "b", stop_at_step=3, **pcc)
    second = train.train(dict(out_dir=str(tmp_path / "b"), resume=True, progress=False))
    assert first["train_losses"] + second["train_losses"] == summary["train_losses"]


def test_non_finite_loss_stops_and_keeps_last_checkpoint(tmp_path, data_dir, monkeypatch):
    run(data_dir, tmp_path, run_name="nan", max_steps=2, eval_interval=1)
    path = os.path.join(tmp_path, "nan", "ckpt.pt")
    before = torch.load(path, weights_only=False)
    original = GPT.forward

    def poisoned(self, idx, targets=None, **kw):
        logits, loss = original(self, idx, targets, **kw)
        return logits, loss * float("nan")

    monkeypatch.setattr(GPT, "forward", poisoned)
    with pytest.raises(train.NonFiniteLoss, match="non-finite loss .* at step 2.*last good checkpoint is kept"):
        train.train(dict(out_dir=str(tmp_path), run_name="nan", resume=True, max_steps=4, progress=False))
    after = torch.load(path, weights_only=False)
    assert after["step"] == before["step"] == 2
    assert all(torch.equal(after["model"][k], before["model"][k]) for k in before["model"])


def test_interrupted_checkpoint_write_keeps_previous(tmp_path, data_dir, monkeypatch):
    summary = run(data_dir, tmp_path, max_steps=2)
    before = open(summary["ckpt_path"], "rb").read()

    def crash(obj, f, *a, **k):
        f.write(b"half a checkpoint")
        raise KeyboardInterrupt("killed mid-write")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        train.train(SMALL | dict(data_dir=data_dir, out_dir=str(tmp_path), resume=True, max_steps=4))
    assert open(summary["ckpt_path"], "rb").read() == before
    assert [f for f in os.listdir(summary["run_dir"]) if ".tmp-" in f] == []


def test_ddp_two_processes_match_one_process_with_accumulation(tmp_path, data_dir):
    settings = dict(max_steps=3, eval_interval=1, eval_tokens=512)
    single = run(data_dir, tmp_path / "one", grad_accum=2, **settings)
    two_processes = SMALL | settings | dict(data_dir=data_dir, out_dir=str(tmp_path / "two"))
    args = [f"--{k}={v!r}" for k, v in two_processes.items()]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             os.path.join(REPO, "train.py"), *args], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    one = [json.loads(l) for l in open(single["log_path"])]
    two = [json.loads(l) for l in open(os.path.join(tmp_path, "two", "tiny", "log.jsonl"))]
    assert [r["tokens"] for r in two] == [r["tokens"] for r in one]  # same global batch
    for a, b in zip(one[1:], two[1:]):
        assert b["train_loss"] == pytest.approx(a["train_loss"], abs=2e-4)
        assert b["val_loss"] == pytest.approx(a["val_loss"], abs=2e-4)
