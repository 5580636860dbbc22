"""train.py: optimizers, schedule, data order, resume, decay branches, growth, DDP, failure modes.
Runs on a small prepared slice of the embedded corpus and a very small looped MoE, a few steps each."""
import json
import math
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import grow
import train
from data import prepare as prep, shards
from data.loader import TokenStream
from model import GPT, ModelConfig
from tooling import memory, rundir
from tooling.checkpoint import NonFiniteLoss, load_model
from tooling.settings import described_fields

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# a very small SMELT MoE: block 0 looped twice, block 1 once; 4 experts, top-2
SMALL = dict(n_layer=2, n_embd=32, n_head=2, n_expert=4, top_k=2, layout="smelt", n_passes=2, block_size=32,
             batch_size=4, eval_tokens=256, warmup_steps=2, eval_interval=100)


def run(data_dir, out, **overrides):
    return train.train(SMALL | dict(data_dir=data_dir, out_dir=str(out)) | overrides)


# ---- settings


def test_defaults_live_in_one_place_and_train_the_tiny_smelt_moe():
    """train.py's defaults are TrainConfig's and ModelConfig's field defaults as declared (a derived size stays
    "derive", so it follows the sizes a run sets) with the tiny model on top; the fields a run takes from its
    data (eot_token, n_logits) are no settings."""
    from dataclasses import fields
    expected = {f.name: getattr(train.TrainConfig(), f.name) for f in fields(train.TrainConfig)}
    expected |= {f.name: f.default for f in fields(ModelConfig) if f.name not in train.FROM_DATA} | train.TINY_MODEL
    assert train.DEFAULTS == expected and train.DEFAULTS["head_dim"] == 0 and train.DEFAULTS["mlp_hidden"] == 0
    wide = train.SETTINGS.build(train.ModelConfig, train.SETTINGS.resolve({"n_embd": 256, "n_head": 2}))
    assert (wide.head_dim, wide.n_kv_head, wide.mlp_hidden) == (128, 2, 768)  # derived from the run's own sizes
    cfg = train.SETTINGS.build(train.ModelConfig, train.DEFAULTS)
    assert (cfg.layout, cfg.n_passes, cfg.n_passes, cfg.n_expert, cfg.top_k, cfg.block_size) == ("smelt", 2, 2, 8, 2, 128)


def test_unknown_key_and_wrong_type_fail_clearly(tmp_path):
    with pytest.raises(ValueError, match="unknown command-line key 'max_stepz'"):
        train.SETTINGS.parse(["--max_stepz=3"])
    with pytest.raises(ValueError, match="max_steps='abc' has type str, expected int"):
        train.SETTINGS.parse(["--max_steps=abc"])
    with pytest.raises(ValueError, match="n_embd=1.5 has type float, expected int"):
        train.SETTINGS.parse(["--n_embd=1.5"])
    bad = tmp_path / "bad.py"
    bad.write_text("import math\nlearning_rate = 0.1\n")
    with pytest.raises(ValueError, match="unknown key in .*bad.py 'learning_rate'"):
        train.SETTINGS.parse([str(bad)])
    assert train.SETTINGS.parse(["--max_steps=1e6", "--layout=pcc", "--grow_at=300"]) == \
        dict(max_steps=1000000, layout="pcc", grow_at=300.0)
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
    with open(broken / "train_000000.bin", "r+b") as f:
        f.truncate(1001)
    with pytest.raises(ValueError, match="train_000000.bin is truncated or corrupt"):
        run(str(broken), tmp_path)


# ---- optimizers and schedule


@pytest.mark.parametrize("model_overrides", [
    dict(),  # the tiny default: SMELT MoE
    dict(n_expert=0, layout="pcc", n_layer=3, n_passes=2, tie_core=False, norm_gain=False),
    dict(n_expert=0, tie_embeddings=True, init="nanogpt", qk_norm=True),
])
@pytest.mark.parametrize("optimizer", ["muon", "adamw"])
def test_param_groups_cover_every_parameter_once(model_overrides, optimizer):
    settings = train.SETTINGS.resolve(dict(n_embd=32, n_head=2, optimizer=optimizer) | model_overrides)
    model = GPT(train.SETTINGS.build(train.ModelConfig, settings))
    optimizers = train.build_optimizers(model, train.SETTINGS.build(train.TrainConfig, settings))
    seen = [id(p) for opt in optimizers for group in opt.param_groups for p in group["params"]]
    assert sorted(seen) == sorted(id(p) for p in model.parameters())  # every parameter exactly once
    kinds = {g["name"]: type(opt).__name__ for opt in optimizers for g in opt.param_groups}
    assert kinds["embedding"] == "AdamW" and kinds["scalar" if "scalar" in kinds else "embedding"] == "AdamW"
    assert kinds["matrix"] == ("Muon" if optimizer == "muon" else "AdamW")
    if "router" in kinds:
        assert kinds["router"] == "AdamW"


def test_wsd_schedule_warmup_stable_decay_to_zero():
    lrs = [train.wsd_multiplier(s, 4, 10, 20, "cosine") for s in range(20)]
    assert lrs[0] == 0.25 and lrs[3] == 1.0 and lrs[4:10] == [1.0] * 6
    assert all(a > b for a, b in zip(lrs[10:], lrs[11:])) and lrs[-1] == pytest.approx(0.0)
    # linear: the [X] code's warm-down, 1 at the decay's first step, 0 at the last, (it - start) / (n - 1)
    linear = [train.wsd_multiplier(s, 0, 10, 20, "linear") for s in range(20)]
    assert linear[10] == 1.0 and linear[14] == pytest.approx(1 - 4 / 9) and linear[-1] == 0.0
    assert train.wsd_multiplier(10, 0, 10, 11, "linear") == 0.0  # a one-step decay


def test_token_stream_is_seeded_and_covers_every_window_each_epoch():
    tokens = np.arange(1001)
    stream = TokenStream(tokens, 10, seed=3, start=100, stop=901)
    first_epoch = stream.offsets(0, stream.n_windows)
    assert sorted(first_epoch) == list(range(100, 100 + 10 * stream.n_windows, 10))
    assert not np.array_equal(first_epoch, stream.offsets(stream.n_windows, stream.n_windows))  # reshuffled
    np.testing.assert_array_equal(stream.offsets(5, 7), TokenStream(tokens, 10, 3, 100, 901).offsets(5, 7))
    x, y = stream.batch(0, 2)
    assert torch.equal(x[:, 1:], y[:, :-1])


# ---- training runs


def test_loss_falls_on_the_tiny_default(tmp_path, data_dir):
    """The tiny default model and optimizer (smaller batch and step count than the CLI default)."""
    summary = train.train(dict(data_dir=data_dir, out_dir=str(tmp_path), batch_size=8, max_steps=20,
                               warmup_steps=4, eval_interval=20, eval_tokens=1024))
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
        train.flops_per_token(train.SETTINGS.build(train.ModelConfig, train.DEFAULTS)) * last["tokens"])
    model, ckpt = load_model(summary["ckpt_path"])
    assert ckpt["state"]["step"] == 20 and ckpt["state"]["tokens_seen"] == last["tokens"]
    assert ckpt["data_dir"] == data_dir
    assert set(ckpt["optimizer"]["state"]) == {n for n, _ in model.named_parameters()}  # keyed by name


def test_resume_gives_identical_losses(tmp_path, data_dir):
    common = dict(max_steps=6, n_passes_choices=[1, 2, 3], eval_interval=3, global_batch=8)  # 2 micro-batches
    straight = run(data_dir, tmp_path / "a", **common)
    first = run(data_dir, tmp_path / "b", stop_at_step=3, **common)
    assert first["step"] == 3
    second = train.train(dict(out_dir=str(tmp_path / "b"), init_from="resume"))
    assert second["step"] == 6
    assert first["train_losses"] + second["train_losses"] == straight["train_losses"]  # bitwise
    assert second["val_loss"] == straight["val_loss"] and second["flops"] == straight["flops"]
    log_a = [json.loads(l) for l in open(straight["log_path"])]
    log_b = [json.loads(l) for l in open(second["log_path"])]
    strip = lambda log: [{k: v for k, v in r.items() if k != "seconds"} for r in log]
    assert strip(log_b) == strip(log_a)  # the log continues exactly (incl. the eval at the stop)  # noqa
    assert len(log_a[-1]["flops_by_passes"]) > 1  # random passes per step: several K were run


def test_decay_branch_forks_weights_decays_to_zero_on_unseen_data(tmp_path, data_dir):
    stable = run(data_dir, tmp_path, run_name="stable", max_steps=6, decay_fraction=0.0, save_steps=[4],
                 matrix_lr=0.03)
    assert stable["data_region"] == "stable" and stable["data_read"][1] <= stable["data_split"]
    ckpt_path = os.path.join(stable["run_dir"], "ckpt_step4.pt")
    branch = train.train(dict(out_dir=str(tmp_path), init_from=ckpt_path, decay_tokens=5 * 4 * 32))
    assert branch["run_dir"].endswith("stable_decay4") and os.path.exists(branch["ckpt_path"])
    assert branch["step"] == 4 + 5 and branch["max_steps"] == 9
    assert branch["data_region"] == "branch" and branch["data_read"][0] >= branch["data_split"]  # unseen data
    # its first loss is the step-4 checkpoint's loss on the first held-back batch: it starts from those weights
    model, ckpt = load_model(ckpt_path)
    train_tokens = shards.load_split(data_dir, "train")
    stream = TokenStream(train_tokens, 32, 1337, branch["data_split"], len(train_tokens))
    x, y = stream.batch(0, 4)
    assert branch["train_losses"][0] == pytest.approx(model(x, y, return_stats=True)[2]["ce"].item(), rel=1e-5)
    log = [json.loads(l) for l in open(branch["log_path"])]
    assert log[-1]["lr"] == 0.0  # decayed to 0 at the last step
    assert load_model(branch["ckpt_path"])[1]["train_config"]["matrix_lr"] == 0.03  # inherited
    assert log[-1]["tokens"] == ckpt["state"]["tokens_seen"] + 5 * 4 * 32


@pytest.mark.parametrize("untie", [False, True])
def test_growth_flops_by_phase_and_resume_across_growth(tmp_path, data_dir, untie):
    pcc = dict(layout="pcc", n_layer=3, n_passes=1, n_expert=0, max_steps=6, grow_at=0.5, grow_to=3,
               grow_untie=untie, grow_rewarm_steps=2, eval_interval=3)
    summary = run(data_dir, tmp_path / "a", **pcc)
    model, ckpt = load_model(summary["ckpt_path"])
    assert model.config.n_passes == 3 and model.config.tie_core == (not untie) and ckpt["state"]["grown"]
    assert set(ckpt["optimizer"]["state"]) == {n for n, _ in model.named_parameters()}
    flops = ckpt["state"]["flops_by_passes"]  # 3 steps at K=1, then 3 at K=3, each at its own FLOPs per token
    before = ModelConfig.from_dict(ckpt["model_config"] | dict(n_passes=1, tie_core=True))
    tokens_per_step = 4 * 32
    assert flops[1] == pytest.approx(3 * tokens_per_step * train.flops_per_token(before))
    assert flops[3] == pytest.approx(3 * tokens_per_step * train.flops_per_token(model.config))
    assert all(np.isfinite(summary["train_losses"]))
    # stop right before the growth step, resume: it grows then and the curve is identical
    first = run(data_dir, tmp_path / "b", stop_at_step=3, **pcc)
    second = train.train(dict(out_dir=str(tmp_path / "b"), init_from="resume"))
    assert first["train_losses"] + second["train_losses"] == summary["train_losses"]


def test_non_finite_loss_stops_and_keeps_last_checkpoint(tmp_path, data_dir, monkeypatch):
    run(data_dir, tmp_path, run_name="nan", max_steps=2, eval_interval=1)
    path = os.path.join(tmp_path, "nan", "ckpt.pt")
    before = torch.load(path, weights_only=True)
    original = GPT.forward

    def poisoned(self, idx, targets=None, **kw):
        logits, loss, *stats = original(self, idx, targets, **kw)
        return logits, loss * float("nan"), *stats

    monkeypatch.setattr(GPT, "forward", poisoned)
    with pytest.raises(NonFiniteLoss, match="non-finite loss .* at step 2.*last good checkpoint is kept"):
        train.train(dict(out_dir=str(tmp_path), run_name="nan", init_from="resume", max_steps=4))
    after = torch.load(path, weights_only=True)
    assert after["state"]["step"] == before["state"]["step"] == 2
    assert all(torch.equal(after["model"][k], before["model"][k]) for k in before["model"])


def test_a_loss_read_late_is_still_refused_before_the_checkpoint(tmp_path, data_dir, monkeypatch):
    """The loop reads the loss every log_interval steps and at evals: a loss that turns non-finite between
    two reads (in the 4th step, "step 3" as the log counts the steps before it) is named by its own step,
    and nothing is written after it."""
    original, calls = GPT.forward, []

    def poisoned_at_step_4(self, idx, targets=None, **kw):
        logits, loss, *stats = original(self, idx, targets, **kw)
        if targets is not None and self.training:
            calls.append(1)
            if len(calls) == 4:
                loss = loss * float("inf")
        return logits, loss, *stats

    monkeypatch.setattr(GPT, "forward", poisoned_at_step_4)
    with pytest.raises(NonFiniteLoss, match=r"non-finite loss \(inf\) at step 3\. Stopped; the last good "
                                                  r"checkpoint is kept: .*ckpt\.pt"):
        run(data_dir, tmp_path, run_name="late", max_steps=8, eval_interval=2, log_interval=3)
    assert len(calls) == 4  # the read after the 4th step refused before its eval and checkpoint
    assert torch.load(os.path.join(tmp_path, "late", "ckpt.pt"), weights_only=True)["state"]["step"] == 2


def test_what_a_cpu_cannot_train_is_refused_before_anything_is_written(tmp_path, data_dir, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the tests run the kernels in the interpreter; a user would not
    with pytest.raises(ValueError, match="triton=True: the Triton kernels compile for CUDA"):
        run(data_dir, tmp_path, triton=True, device="cpu")
    assert not os.path.exists(os.path.join(tmp_path, "tiny"))


def test_a_run_without_checkpoints_writes_its_log_only(tmp_path, data_dir, capsys):
    """save_checkpoints=False (a benchmark): every eval is logged, the step-0 line too, no checkpoint exists."""
    summary = run(data_dir, tmp_path, max_steps=4, eval_interval=2, save_checkpoints=False)
    assert os.listdir(summary["run_dir"]) == ["log.jsonl"] and summary["ckpt_path"] is None
    assert [json.loads(line)["step"] for line in open(summary["log_path"])] == [0, 2, 4]
    out = capsys.readouterr().out
    assert "checkpoint: none (save_checkpoints=False)" in out and "sample" not in out.split("checkpoint:")[1]
    with pytest.raises(ValueError, match=r"save_steps=\[2\]: needs save_checkpoints=True"):
        run(data_dir, tmp_path / "b", max_steps=4, save_steps=[2], save_checkpoints=False)


def test_interrupted_checkpoint_write_keeps_previous(tmp_path, data_dir, monkeypatch):
    summary = run(data_dir, tmp_path, max_steps=2)
    before = open(summary["ckpt_path"], "rb").read()

    def crash(obj, f, *a, **k):
        f.write(b"half a checkpoint")
        raise KeyboardInterrupt("killed mid-write")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        train.train(SMALL | dict(data_dir=data_dir, out_dir=str(tmp_path), init_from="resume", max_steps=4))
    assert open(summary["ckpt_path"], "rb").read() == before
    assert [f for f in os.listdir(summary["run_dir"]) if ".tmp-" in f] == []


def test_ddp_two_processes_match_one_process_with_accumulation(tmp_path, data_dir, torchrun):
    settings = dict(max_steps=3, eval_interval=1, eval_tokens=512)
    single = run(data_dir, tmp_path / "one", global_batch=8, **settings)  # 2 micro-batches of 4
    two_processes = SMALL | settings | dict(data_dir=data_dir, out_dir=str(tmp_path / "two"))
    torchrun(["train.py", *[f"--{k}={v!r}" for k, v in two_processes.items()]], nproc=2)
    one = [json.loads(l) for l in open(single["log_path"])]
    two = [json.loads(l) for l in open(os.path.join(tmp_path, "two", "tiny", "log.jsonl"))]
    assert [r["tokens"] for r in two] == [r["tokens"] for r in one]  # same global batch
    for a, b in zip(one[1:], two[1:]):
        assert b["train_loss"] == pytest.approx(a["train_loss"], abs=2e-4)
        assert b["val_loss"] == pytest.approx(a["val_loss"], abs=2e-4)


# ---- first contact: resume, Ctrl-C, growth in place, [X16], data repetition, --help


def test_resuming_a_finished_run_says_so_and_can_be_extended(tmp_path, data_dir, capsys):
    done = run(data_dir, tmp_path, run_name="done", max_steps=2, eval_interval=1)
    again = train.train(dict(out_dir=str(tmp_path), run_name="done", init_from="resume"))
    assert again["step"] == 2 and again["val_loss"] == done["val_loss"] and again["train_losses"] == []
    assert "already finished: step 2 of max_steps 2" in capsys.readouterr().out
    assert train.main([f"--out_dir={tmp_path}", "--run_name=done", "--init_from=resume"]) == 0
    longer = train.train(dict(out_dir=str(tmp_path), run_name="done", init_from="resume", max_steps=4))
    assert longer["step"] == 4 and len(longer["train_losses"]) == 2
    log = [json.loads(line) for line in open(longer["log_path"])]
    assert [r["step"] for r in log] == [0, 1, 2, 3, 4]


def test_ctrl_c_says_where_the_checkpoint_is_and_how_to_resume(tmp_path, data_dir, monkeypatch, capsys):
    original = train.passes_of_step

    def interrupted_at_step_3(config, step):  # called at the start of every step
        if step == 3:
            raise KeyboardInterrupt
        return original(config, step)

    monkeypatch.setattr(train, "passes_of_step", interrupted_at_step_3)
    argv = [f"--{k}={v!r}" for k, v in (SMALL | dict(data_dir=data_dir, out_dir=str(tmp_path), run_name="c",
                                                     max_steps=6, eval_interval=2)).items()]
    assert train.main(argv) == 130
    err = capsys.readouterr().err
    assert "interrupted at step 3" in err and os.path.join(str(tmp_path), "c", "ckpt.pt") + " (step 2)" in err
    assert f"--out_dir={tmp_path} --run_name=c --init_from=resume" in err and "Traceback" not in err


def test_data_repetition_is_logged_warned_and_refused_for_branches(tmp_path, data_dir, capsys):
    # the stable region holds 127 windows of 33 tokens at this size; 40 steps x 4 sequences read 160
    wraps = run(data_dir, tmp_path, run_name="wraps", block_size=128, max_steps=40, eval_interval=20,
                save_steps=[10])
    assert "data repeats" in capsys.readouterr().out
    log = [json.loads(line) for line in open(wraps["log_path"])]
    assert log[0]["epochs"] == 0 and log[-1]["epochs"] == pytest.approx(160 / 127)
    with pytest.raises(ValueError, match=r"decay branch needs 100 windows .* held-back data has 14 .*reread"):
        train.train(dict(out_dir=str(tmp_path), init_from=os.path.join(wraps["run_dir"], "ckpt_step10.pt"),
                         decay_tokens=100 * 4 * 128 // 4))


def test_help_describes_every_setting():
    described = described_fields(train.TrainConfig) | described_fields(ModelConfig)
    missing = sorted(k for k in train.DEFAULTS if not described.get(k))
    assert missing == []
    text = train.SETTINGS.help()
    assert "--matrix_lr=0.0 " in text and "LR of the hidden matrices" in text
    assert "the first pass sees the prelude output e itself" in text  # a continued comment line
    titles = [line for line in text.splitlines() if line.endswith(":") and not line.startswith(" ")]
    assert titles == [f"{t}:" for t in train.HELP_GROUPS] and "other" not in text  # every setting in a named group
    n = len(train.DEFAULTS)
    assert f"lists every setting, each in a named group: {n} (" in open(os.path.join(REPO, "docs", "training.md")).read()
    assert f"({n} settings:" in open(os.path.join(REPO, "README.md")).read()  # the count the docs give is the real one


# ---- reliability: never save a bad checkpoint, never leave junk, never accept nonsense


def test_non_finite_weights_are_never_written(tmp_path, data_dir, monkeypatch):
    """The update of step 2 blows the weights up (the loss before it was fine): the eval/save at step 2
    must not write NaN weights as the last good checkpoint."""
    run(data_dir, tmp_path, run_name="nan", max_steps=1, warmup_steps=1, eval_interval=1)
    original = torch.optim.AdamW.step

    def blows_up(self, *args, **kwargs):  # the resumed run's first update is the second step's
        out = original(self, *args, **kwargs)
        with torch.no_grad():
            next(g for g in self.param_groups if g["name"] == "unembedding")["params"][0].fill_(float("nan"))
        return out

    monkeypatch.setattr(torch.optim.AdamW, "step", blows_up)
    with pytest.raises(NonFiniteLoss,
                       match="weights became non-finite at step 2.*previous checkpoint there is kept. Stopped. Lower"):
        train.train(dict(out_dir=str(tmp_path), run_name="nan", init_from="resume", max_steps=3))
    model, ckpt = load_model(os.path.join(tmp_path, "nan", "ckpt.pt"))
    assert ckpt["state"]["step"] == 1 and all(torch.isfinite(p).all() for p in model.parameters())
    log = [json.loads(line) for line in open(os.path.join(tmp_path, "nan", "log.jsonl"))]
    assert [r["step"] for r in log] == [0, 1]  # no log line for the checkpoint that was not written


def test_stale_temp_files_of_the_run_are_removed_at_start(tmp_path, data_dir):
    summary = run(data_dir, tmp_path, max_steps=1, warmup_steps=1)
    stale = [os.path.join(summary["run_dir"], name) for name in (".ckpt.pt.tmp-abc123", ".log.jsonl.tmp-x")]
    for path in stale:
        open(path, "wb").write(b"half a file")
    keep = os.path.join(summary["run_dir"], "notes.txt")
    open(keep, "w").write("mine")
    run(data_dir, tmp_path, init_from="resume", max_steps=2)
    assert not any(os.path.exists(p) for p in stale) and os.path.exists(keep)


def test_log_is_cut_back_to_the_checkpoint_on_resume(tmp_path, data_dir):
    """A run killed after its log line but before the checkpoint rename (old writers), or between the
    rename and its log line: the resumed log holds every eval step exactly once."""
    common = dict(max_steps=6, eval_interval=2)
    straight = run(data_dir, tmp_path / "a", **common)
    first = run(data_dir, tmp_path / "b", stop_at_step=4, **common)
    log_path = first["log_path"]
    lines = open(log_path).read().splitlines()
    ahead = json.loads(lines[-1]) | dict(step=5)
    with open(log_path, "w") as f:  # a line the checkpoint does not have, and the checkpoint's own line lost
        f.write("\n".join(lines[:-1] + [json.dumps(ahead)]) + "\n")
    second = run(data_dir, tmp_path / "b", init_from="resume", **common)
    steps = [json.loads(line)["step"] for line in open(second["log_path"])]
    assert steps == [0, 2, 4, 6] == [json.loads(line)["step"] for line in open(straight["log_path"])]


def test_a_second_training_into_a_locked_run_dir_is_refused(tmp_path, data_dir):
    import socket
    run_dir = tmp_path / "tiny"
    run_dir.mkdir()
    (run_dir / "lock").write_text(f"{socket.gethostname()} {os.getpid()}")  # a live process holds it
    with pytest.raises(ValueError, match=r"is in use by process \d+ on .*lock file"):
        run(data_dir, tmp_path, max_steps=1, warmup_steps=1)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (run_dir / "lock").write_text(f"{socket.gethostname()} {int(dead.stdout)}")  # its process is gone: stale
    run(data_dir, tmp_path, max_steps=1, warmup_steps=1)
    assert not (run_dir / "lock").exists()  # released at the end


@pytest.mark.parametrize("setting, value, message", [
    ("dtype", "bf16", "dtype='bf16': must be one of"),
    ("dtype", "float17", "dtype='float17'"),
    ("device", "cdua", "unknown device 'cdua'"),
    ("max_steps", 0, "max_steps=0: must be >= 1"),
    ("max_steps", -1, "max_steps=-1"),
    ("warmup_steps", -5, "warmup_steps=-5: must be >= 0"),
    ("matrix_lr", -1.0, "matrix_lr=-1.0: must be >= 0"),
    ("grad_clip", -1.0, "grad_clip=-1.0: must be >= 0"),
    ("eval_tokens", 0, "eval_tokens=0: must be >= 1"),
    ("n_passes_choices", [0], r"n_passes_choices=\[0\]: must be a list of pass counts in \[1, 64\]"),
    ("run_name", "../../x", "run_name='../../x': must be a plain folder name"),
    ("grow_to", 1, "grow_to=1: must be more than the model's 2 passes"),
    ("adam_betas", (0.9, 1.5), "adam_betas"),
    ("block_size", 300_000, r"block_size=300000, batch_size=4: this run needs about .* GiB .* is available"),
])
def test_bad_settings_are_refused_before_training_naming_the_setting(tmp_path, data_dir, setting, value, message):
    overrides = {setting: value} | (dict(grow_at=0.5) if setting == "grow_to" else {})
    with pytest.raises(ValueError, match=message):
        run(data_dir, tmp_path, **overrides)
    assert not os.path.exists(tmp_path / "tiny" / "log.jsonl")  # nothing ran


@pytest.mark.parametrize("growth, when", [
    (dict(grow_at=0.5, grow_to=4), "after growing to 4 passes"),
    (dict(n_passes_choices=[1, 2, 4]), r"at 4 passes \(n_passes_choices\)"),
])
def test_memory_check_covers_the_model_at_its_most_passes(tmp_path, monkeypatch, growth, when):
    settings = dict(layout="pcc", n_layer=3, n_embd=32, n_head=2, n_expert=0, n_passes=2, out_dir=str(tmp_path))
    cpu = torch.device("cpu")

    def check(available, **extra):
        monkeypatch.setattr(memory, "memory_reading", lambda device: dict(available=available, meminfo=available,
                                                                          cgroup=None))
        values, _, _ = rundir.resolve_run(train.SETTINGS, settings | extra)
        config, cfg = train.SETTINGS.build(train.TrainConfig, values), train.SETTINGS.build(ModelConfig, values)
        memory.check_memory(grow.shapes_of_run(cfg, config), config, cpu, False)

    low, high = 0, 2**40  # bisect the least memory the 2-pass run fits in
    while high - low > 1:
        middle = (low + high) // 2
        try:
            check(middle)
            high = middle
        except ValueError:
            low = middle
    check(high)
    with pytest.raises(ValueError, match=f"this run needs about .* GiB {when} .* is available"):
        check(high, **growth)


def test_untied_model_cannot_be_asked_for_more_passes_than_cores(tmp_path, data_dir):
    with pytest.raises(ValueError, match=r"the untied model has 2 cores, one per trained pass: it cannot run \[3\] passes"):
        run(data_dir, tmp_path, layout="pcc", n_layer=3, n_expert=0, n_passes=2, tie_core=False,
            n_passes_choices=[1, 3])
    with pytest.raises(ValueError, match=r"after growth the untied model has 2 cores, one per trained pass: it cannot run \[3\] passes"):
        run(data_dir, tmp_path, layout="pcc", n_layer=3, n_expert=0, n_passes=1, grow_at=2.0, grow_to=2,
            grow_untie=True, n_passes_choices=[1, 3])  # tied before growth: it could, until the growth step
    assert not os.path.exists(os.path.join(tmp_path, "tiny"))  # refused before anything was written


def test_clear_messages_for_disk_full_bad_out_dir_and_broken_config(tmp_path, data_dir, monkeypatch, capsys):
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(ValueError, match="cannot create the run directory .*a file is in the way"):
        run(data_dir, tmp_path / "file", max_steps=1, warmup_steps=1)
    broken = tmp_path / "broken.py"
    broken.write_text("max_steps = 3\nbatch_size = (\n")
    assert train.main([str(broken)]) == 2
    assert re.search(r"train.py: error: .*broken.py:\d+: syntax error in config file", capsys.readouterr().err)

    def disk_full(obj, f, *a, **k):
        f.write(b"partial")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 4480 vs 4374")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(OSError, match=r"could not write checkpoint .*ckpt.pt: the disk is full .*previous checkpoint"):
        run(data_dir, tmp_path, max_steps=1, warmup_steps=1)


def test_files_written_have_the_usual_permissions(tmp_path, data_dir):
    mask = os.umask(0o022)
    try:
        summary = run(data_dir, tmp_path, max_steps=1, warmup_steps=1)
    finally:
        os.umask(mask)
    assert os.stat(summary["ckpt_path"]).st_mode & 0o777 == 0o644
    assert os.stat(summary["log_path"]).st_mode & 0o777 == 0o644


def test_killed_during_a_checkpoint_write_then_resumed_ends_equal(tmp_path, data_dir):
    """kill -9 while a checkpoint is being written (polled: the moment a temp file exists), then resume:
    no temp file is left, the log has each eval step once, and the final weights equal an uninterrupted
    run's. The kill lands at a different moment each time; the verdict does not depend on it."""
    settings = SMALL | dict(data_dir=data_dir, max_steps=12, eval_interval=1, eval_tokens=64)
    straight = train.train(settings | dict(out_dir=str(tmp_path / "straight")))
    args = [f"--{k}={v!r}" for k, v in (settings | dict(out_dir=str(tmp_path / "killed"))).items()]
    run_dir = tmp_path / "killed" / "tiny"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    process = subprocess.Popen([sys.executable, os.path.join(REPO, "train.py"), *args], cwd=REPO, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    killed_mid_write, deadline = False, time.time() + 120
    while process.poll() is None and time.time() < deadline:
        if run_dir.is_dir() and any(".tmp-" in name for name in os.listdir(run_dir)) and \
                (run_dir / "ckpt.pt").exists():  # a write after the first complete checkpoint
            process.kill()
            killed_mid_write = True
            break
    process.wait(timeout=60)
    assert killed_mid_write, "the training process ended before a checkpoint write could be caught"
    resumed = train.train(dict(out_dir=str(tmp_path / "killed"), init_from="resume"))
    assert not any(".tmp-" in name for name in os.listdir(run_dir))
    steps = [json.loads(line)["step"] for line in open(resumed["log_path"])]
    assert steps == list(range(13))
    a, _ = load_model(straight["ckpt_path"])
    b, _ = load_model(resumed["ckpt_path"])
    assert all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))


def test_killed_after_the_first_checkpoint_before_its_log_lines_resumes_with_every_line(tmp_path, data_dir,
                                                                                         monkeypatch):
    """The moment the polled kill above can land on: the first checkpoint is in place, the log not yet
    written (it holds nothing: the step-0 eval waits for that checkpoint). The checkpoint carries the lines it
    is ahead of, so the resumed run's log still has every eval step once."""
    settings = SMALL | dict(data_dir=data_dir, max_steps=4, eval_interval=1, eval_tokens=64,
                            out_dir=str(tmp_path))
    write = rundir.RunDir.append_log

    def killed_before_the_write(self, record, wait_for_checkpoint=False):
        if self.saved_step is not None:
            raise RuntimeError("killed")
        return write(self, record, wait_for_checkpoint)

    with monkeypatch.context() as m:
        m.setattr(rundir.RunDir, "append_log", killed_before_the_write)
        with pytest.raises(RuntimeError, match="killed"):
            train.train(settings)
    run_dir = tmp_path / "tiny"
    assert not (run_dir / "log.jsonl").exists() and (run_dir / "ckpt.pt").exists()
    resumed = train.train(dict(out_dir=str(tmp_path), init_from="resume"))
    assert [json.loads(line)["step"] for line in open(resumed["log_path"])] == [0, 1, 2, 3, 4]


# ---- the papers' recipes: the schedule, [X]'s Muon, decay and attention, [S]'s global batch


def test_schedule_rewarms_after_growth_and_warms_up_muon_momentum():
    """The LR re-warm after growth is in the schedule a run steps by (0 at the growth step, linear back over
    grow_rewarm_steps), and Muon's momentum rises from 0.85 over muon_momentum_warmup steps ([X] code)."""
    config = train.TrainConfig(max_steps=100, warmup_steps=0, decay_fraction=0.0, grow_at=40.0, grow_to=4,
                               grow_rewarm_steps=10, muon_momentum_warmup=300)
    schedule = train.plan_schedule(config, train.TrainState(), tokens_per_step=1)
    assert [schedule.lr_multiplier(s) for s in (39, 40, 45, 50, 99)] == [1.0, 0.0, 0.5, 1.0, 1.0]
    assert [schedule.muon_momentum(s) for s in (0, 150, 300, 1000)] == pytest.approx([0.85, 0.9, 0.95, 0.95])
    optimizers = train.build_optimizers(GPT(ModelConfig(n_layer=1, n_embd=32, n_head=2)), config)
    assert train.set_schedule(optimizers, 0.5, 0.9) == pytest.approx(0.5 * train.MATRIX_LR["muon"])
    assert [g["momentum"] for g in optimizers[-1].param_groups] == [0.9]


def test_x_d8_recipe_trains_on_cpu_at_a_toy_width(tmp_path, data_dir):
    """config/x_d8_vanilla.py as it is (the [X] code's Muon, weight decay on every matrix and on the
    embedding and head, no clipping, attention across documents, the padded vocabulary cut before the
    softmax) at a toy width on GPT-2 tokens of the test corpus."""
    corpus = os.path.join(os.path.dirname(data_dir), "corpus.jsonl")
    gpt2 = prep.prepare([corpus], str(tmp_path / "gpt2"), tokenizer="gpt2", val_fraction=0.34, seed=0, verbose=False)
    overrides = train.SETTINGS.parse([os.path.join(REPO, "config", "x_d8_vanilla.py")])
    overrides |= dict(n_embd=64, n_head=2, head_dim=32, block_size=64, batch_size=2, global_batch=2, max_steps=4,
                      warmup_steps=1, eval_interval=2, eval_tokens=256, data_dir=gpt2, out_dir=str(tmp_path))
    summary = train.train(overrides)
    assert all(np.isfinite(summary["train_losses"])) and summary["step"] == 4
    model, ckpt = load_model(summary["ckpt_path"])
    assert model.config.n_logits == 50257 and not model.config.document_mask
    groups = {g["name"]: g for g in ckpt["optimizer"]["param_groups"]}
    assert groups["embedding"]["weight_decay"] == groups["unembedding"]["weight_decay"] == \
        groups["matrix"]["weight_decay"] == pytest.approx(0.0707106781187)
    state = ckpt["optimizer"]["state"]["blocks.0.attn.q_proj.weight"]
    assert set(state) == {"momentum_buffer", "second_momentum_buffer"}  # the x variant's
    assert ckpt["train_config"]["grad_clip"] == 0.0 and ckpt["train_config"]["optimizer"] == "muon_x"


def test_global_batch_gives_the_same_step_on_any_number_of_processes(tmp_path, data_dir):
    """global_batch fixes the sequences per step: grad_accum follows from batch_size and the world size."""
    from tooling import guards
    config = train.TrainConfig(batch_size=4, global_batch=32)
    guards.derive_grad_accum(config, 2)
    assert config.grad_accum == 4
    guards.derive_grad_accum(config, 8)
    assert config.grad_accum == 1
    with pytest.raises(ValueError, match="global_batch=32 is not a multiple of batch_size x processes = 4 x 3"):
        guards.derive_grad_accum(config, 3)
    summary = run(data_dir, tmp_path, max_steps=2, global_batch=8, batch_size=2)
    assert summary["tokens"] == 2 * 8 * 32  # 2 steps of 8 sequences of 32 tokens, grad_accum 4


def test_val_bits_per_byte_of_a_uniform_model(data_dir):
    """A model whose logits are all zero has CE ln V on every target, so BPB = ln V x (targets that stand
    for text) / (ln 2 x their UTF-8 bytes), the bytes counted by decoding the targets with the tokenizer."""
    from data.loader import load_data
    from data.tokenizer import get_tokenizer
    data = load_data(data_dir)
    settings = train.SETTINGS.resolve({})
    model = GPT(train.SETTINGS.build(train.ModelConfig, settings))
    torch.nn.init.zeros_(model.lm_head.weight)
    T, V = model.config.block_size, model.config.vocab_size
    out = train.evaluate(model, data, train.SETTINGS.build(train.TrainConfig, settings | dict(eval_tokens=1 << 30)))
    targets = np.asarray(data.val_tokens)[1:(len(data.val_tokens) - 1) // T * T + 1]  # every window's targets
    tok = get_tokenizer(data.meta["tokenizer"])
    text = targets[targets != tok.eot_token].tolist()
    assert out["val_loss"] == pytest.approx(math.log(V), rel=1e-6)
    assert out["val_bpb"] == pytest.approx(math.log(V) * len(text) / (math.log(2) * len(tok.encoding.decode_bytes(text))),
                                           rel=1e-6)


# ---- issue 34: the WSD schedule a run steps by, from plan_schedule (not wsd_multiplier alone)


def test_planned_schedule_decays_over_exactly_the_last_fraction():
    """decay_fraction 0.3 of 100 steps: steps 70..99 decay, so 69 is the last at the peak and 70 the first below
    it (cosine: 0.5 (1 + cos(pi / 30))), 99 at the floor; linear: 1 at 70, 1 - 1/29 at 71. The same for a
    decay branch forked at step 50 over 20 steps. Warmup: (step + 1) / warmup_steps."""
    state = train.TrainState()
    config = train.TrainConfig(warmup_steps=10, decay_fraction=0.3, max_steps=100)
    schedule = train.plan_schedule(config, state, tokens_per_step=10)
    lrs = [schedule.lr_multiplier(s) for s in range(100)]
    assert schedule.max_steps == 100 and state.decay_start == 70
    assert lrs[0] == 0.1 and lrs[9:70] == [1.0] * 61
    assert lrs[70] == pytest.approx(0.5 * (1 + math.cos(math.pi / 30))) and lrs[99] == pytest.approx(0.0)
    config = train.TrainConfig(max_steps=100, warmup_steps=10, decay_fraction=0.3, decay_shape="linear")
    linear = train.plan_schedule(config, state, tokens_per_step=1)
    assert [linear.lr_multiplier(s) for s in (69, 70, 71, 99)] == pytest.approx([1.0, 1.0, 1 - 1 / 29, 0.0])
    config = train.TrainConfig(warmup_steps=10, init_from="stable.pt", decay_tokens=200)
    config.decay_branch = True  # rundir.resolve_run: a fork with decay_tokens
    forked = train.TrainState(branch_start_step=50)
    branch = train.plan_schedule(config, forked, tokens_per_step=10)
    assert (branch.max_steps, branch.decay_start, branch.lr_multiplier(49)) == (70, 50, 1.0)
    assert branch.lr_multiplier(50) == pytest.approx(0.5 * (1 + math.cos(math.pi / 20)))
