"""train.py on a small slice of the embedded corpus and a very small looped MoE, a few steps each: settings,
optimizers, schedule, resume, decay branches, growth, and what it refuses."""
import json
import math
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import configurator
import train
from data.loader import load_data
from model import GPT, ModelConfig, load_checkpoint

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# a very small SMELT MoE: block 0 looped twice, block 1 once; 4 experts, top-2
SMALL = dict(n_layer=2, n_embd=32, n_head=2, n_expert=4, top_k=2, layout="smelt", n_passes=2, block_size=32,
             batch_size=4, eval_tokens=256, warmup_steps=2, eval_interval=100)


def run(data_dir, out, **overrides):
    return train.train(SMALL | dict(data_dir=data_dir, out_dir=str(out)) | overrides)


def log_of(summary):
    return [json.loads(line) for line in open(summary["log_path"])]


def strip(log):  # a log without its wall-clock times
    return [{k: v for k, v in r.items() if k != "seconds"} for r in log]


def main_error(argv, capsys):
    status = train.main(argv)
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1 and err.startswith("train.py: error: "), (status, err)
    return err


# ---- settings


def test_help_lists_45_settings_each_described(capsys):
    assert train.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert len(train.DEFAULTS) == 45
    for key in train.DEFAULTS:  # every setting on a line with its default and what it does
        line = next(line for line in out.splitlines() if line.strip().startswith(f"{key}:"))
        assert "=" in line and "#" in line or key in ("wandb_project",), line


def test_a_bad_setting_is_one_line_naming_it(tmp_path, capsys):
    err = main_error(["--n_embed=64"], capsys)
    assert "'n_embed'" in err and "did you mean n_embd" in err
    assert "max_steps" in main_error(["--max_steps=abc"], capsys)
    assert "layout" in main_error([f"--out_dir={tmp_path}", "--layout=loop"], capsys)
    assert "config file not found" in main_error(["config/nope.py"], capsys)
    (tmp_path / "c.py").write_text("max_step = 3\n")
    assert "max_step" in main_error([str(tmp_path / "c.py")], capsys)


def test_a_config_file_includes_another_and_is_overridden(tmp_path):
    (tmp_path / "base.py").write_text("n_layer = 6\nmax_steps = 10\n")
    (tmp_path / "run.py").write_text('include("base.py")\nmax_steps = 20\n')
    assert configurator.configure(train.DEFAULTS, [str(tmp_path / "run.py"), "--n_embd=64"]) == dict(
        n_layer=6, max_steps=20, n_embd=64)


@pytest.mark.parametrize("name", sorted(os.listdir(os.path.join(REPO, "config"))))
def test_every_config_file_is_a_valid_run(name):
    if name.startswith("_"):
        return
    settings = train.DEFAULTS | configurator.configure(train.DEFAULTS, [os.path.join(REPO, "config", name)])
    ModelConfig(vocab_size=50304, **{k: settings[k] for k in train.MODEL_SETTINGS})


# ---- optimizers and the schedule


@pytest.mark.parametrize("optimizer", ["muon", "adamw"])
def test_param_groups_cover_every_parameter_once(optimizer):
    model = GPT(ModelConfig(n_layer=3, n_embd=32, n_head=2, n_expert=4, top_k=2, layout="pcc_untied", n_passes=2))
    config = train.TrainConfig(optimizer=optimizer)
    named = [n for group in train.param_groups(model, config) for n, _ in group[4]]
    assert sorted(named) == sorted(n for n, _ in model.named_parameters())
    kinds = {g[0]: g[1] for g in train.param_groups(model, config)}
    assert kinds["matrix"] == optimizer and kinds["router"] == kinds["embedding"] == "adamw"


def test_wsd_schedule_warmup_stable_decay_to_zero():
    m = [train.wsd_multiplier(s, 10, 70, 100) for s in range(100)]
    assert m[0] == pytest.approx(0.1) and m[9] == 1.0 and m[10:70] == [1.0] * 60
    assert all(a > b for a, b in zip(m[70:], m[71:])) and m[-1] == pytest.approx(0.0, abs=1e-12)
    lin = [train.wsd_multiplier(s, 0, 90, 100, "linear") for s in range(100)]
    assert lin[90] == 1.0 and lin[99] == 0.0 and lin[95] == pytest.approx(4 / 9)
    config = train.TrainConfig(max_steps=100, warmup_steps=10, decay_fraction=0.3)
    assert train.plan_schedule(config, 1024) == (100, 70, None)  # decays over exactly the last 30%


def test_growth_rewarms_and_muon_x_warms_its_momentum():
    config = train.TrainConfig(optimizer="muon_x", warmup_steps=0, decay_fraction=0.0, grow_at=0.5,
                               max_steps=2563)
    steps, _, grow_step = train.plan_schedule(config, 1024)
    assert grow_step == 1281  # [X] d8: 40 re-warm steps of 2,563
    assert [train.lr_multiplier(config, grow_step + s, steps, steps, grow_step) for s in (0, 20, 40)] == \
        [0.0, 0.5, 1.0]
    assert train.muon_momentum(config, 0, 2355) == 0.85 and train.muon_momentum(config, 300, 2355) == 0.95


# ---- runs


def test_loss_falls_on_the_tiny_default(tmp_path, data_dir):
    summary = train.train(dict(data_dir=data_dir, out_dir=str(tmp_path), batch_size=8, max_steps=20,
                               warmup_steps=4, eval_interval=20, eval_tokens=1024))
    losses = summary["train_losses"]
    assert losses[0] == pytest.approx(np.log(4096), abs=0.05)  # [X] init: a zero lm head is uniform
    assert np.mean(losses[-4:]) < losses[0] - 1.5 and summary["val_loss"] < summary["unigram_entropy"]
    log = log_of(summary)
    assert [r["step"] for r in log] == [0, 20] and log[-1]["val_loss"] < log[0]["val_loss"] - 1.0
    last = log[-1]
    assert set(last["val_loss_by_source"]) == {"comedy", "history", "tragedy"}
    assert 0 <= last["expert_load_min"] <= 1 / 8 <= last["expert_load_max"] <= 1 and last["balance"] >= 1.0
    model, ckpt = load_checkpoint(summary["ckpt_path"])
    avg_doc_len = min(load_data(data_dir).meta["mean_doc_len"], 128)
    assert last["tokens"] == 20 * 8 * 128 and last["flops"] == pytest.approx(
        train.flops_per_token(model.config, None, avg_doc_len) * last["tokens"])
    assert ckpt["state"]["step"] == 20 and ckpt["config"]["data_dir"] == data_dir
    assert set(ckpt["optimizers"]["state"]) == {n for n, _ in model.named_parameters()}  # keyed by name


def test_val_bits_per_byte_of_a_uniform_model(data_dir):
    """A zero lm head predicts uniformly: loss log(V), bits per byte = the text tokens' nats / bytes / ln 2."""
    from loss_eval import evaluate
    data = load_data(data_dir)
    model = GPT(ModelConfig(vocab_size=4096, block_size=32, n_layer=1, n_embd=16, n_head=2))
    metrics = evaluate(model, data, 32 * 8, 4)
    assert metrics["val_loss"] == pytest.approx(math.log(4096), rel=1e-6)
    total = (len(data.val) - 1) // 32
    starts = np.linspace(0, total - 1, 8).round().astype(np.int64) * 32
    targets = np.concatenate([data.val[s + 1:s + 33] for s in starts]).astype(np.int64)
    n_bytes = data.token_bytes[targets]
    expected = (n_bytes > 0).sum().item() * math.log(4096) / n_bytes.sum().item() / math.log(2)
    assert metrics["val_bpb"] == pytest.approx(expected, rel=1e-6)


def test_a_stable_run_extended_by_resume_equals_one_run(tmp_path, data_dir):
    """Exact resume: weights, optimizer state, data position, the schedule; random passes per step and
    two micro-batches per step included; the log continues where the checkpoint was."""
    common = dict(decay_fraction=0.0, n_passes_choices=[1, 2, 3], eval_interval=3, global_batch=8)
    straight = run(data_dir, tmp_path / "a", max_steps=6, **common)
    first = run(data_dir, tmp_path / "b", max_steps=3, **common)
    second = train.train(dict(out_dir=str(tmp_path / "b"), init_from="resume", max_steps=6))
    assert first["train_losses"] + second["train_losses"] == straight["train_losses"]  # bit for bit
    assert strip(log_of(second)) == strip(log_of(straight))
    assert len(log_of(straight)[-1]["flops_by_passes"]) > 1  # several K were drawn


def test_sigterm_saves_and_the_printed_command_resumes_exactly(tmp_path, data_dir):
    settings = SMALL | dict(data_dir=data_dir, max_steps=80, eval_interval=40)
    straight = train.train(settings | dict(out_dir=str(tmp_path / "a")))
    out = tmp_path / "b"
    argv = [f"--{k}={v}" for k, v in (settings | dict(out_dir=str(out))).items()]
    env = dict(os.environ, OMP_NUM_THREADS="1")  # the thread count changes the last bits, as pytest's 1
    proc = subprocess.Popen([sys.executable, "train.py", *argv], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    while not (out / "log.jsonl").exists() and proc.poll() is None:  # the step-0 eval is logged
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    output = proc.communicate(timeout=120)[0]
    assert proc.returncode == 130, output
    command = output.split("resume with\n")[1].strip()
    assert command == f"python train.py --out_dir={out} --init_from=resume"
    stopped = torch.load(out / "ckpt.pt", weights_only=True)["state"]["step"]
    assert 0 < stopped < 80
    resumed = subprocess.run(command.split(), cwd=REPO, capture_output=True, text=True, env=env)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert strip(log_of(dict(log_path=out / "log.jsonl"))) == strip(log_of(straight))


def test_decay_branch_forks_a_stable_checkpoint_onto_the_held_back_data(tmp_path, data_dir):
    stable = run(data_dir, tmp_path / "stable", max_steps=6, decay_fraction=0.0, save_steps=[4], matrix_lr=0.03)
    ckpt_path = os.path.join(stable["run_dir"], "ckpt_step4.pt")
    branch = train.train(dict(init_from=ckpt_path, decay_tokens=5 * 4 * 32))
    assert branch["run_dir"].endswith("stable_decay4") and branch["step"] == 9
    # its first loss is the step-4 weights' loss on the first held-back batch: from those weights, unseen data
    model, ckpt = load_checkpoint(ckpt_path)
    x, y = load_data(data_dir).stream(32, 1337, branch=True).batch(0, 4)
    assert branch["train_losses"][0] == pytest.approx(model(x, y, return_stats=True)[2]["ce"].item(), rel=1e-5)
    log = log_of(branch)
    assert log[-1]["lr"] == 0.0 and log[-1]["tokens"] == ckpt["state"]["tokens"] + 5 * 4 * 32
    assert load_checkpoint(branch["ckpt_path"])[1]["config"]["matrix_lr"] == 0.03  # inherited
    # refused: a branch from a checkpoint whose LR decays; one that would reread the held-back data
    decaying = run(data_dir, tmp_path / "decaying", max_steps=6, decay_fraction=0.5)
    with pytest.raises(ValueError, match="stable checkpoint"):
        train.train(dict(init_from=decaying["ckpt_path"], decay_tokens=128))
    with pytest.raises(ValueError, match="reread the held-back data"):
        train.train(dict(init_from=ckpt_path, decay_tokens=10 ** 9, out_dir=str(tmp_path / "x")))


@pytest.mark.parametrize("layout", ["pcc", "pcc_untied"])
def test_growth_doubles_the_passes_and_resumes_across_it(tmp_path, data_dir, layout):
    pcc = dict(layout=layout, n_layer=3, n_passes=1, n_expert=0, max_steps=6, grow_at=3.0, eval_interval=3,
               decay_fraction=0.0)
    summary = run(data_dir, tmp_path / "a", **pcc)
    model, ckpt = load_checkpoint(summary["ckpt_path"])
    assert model.config.n_passes == 2 and model.config.layout == layout and ckpt["state"]["grown"]
    assert len(model.blocks) == (3 if layout == "pcc" else 4)
    assert set(ckpt["optimizers"]["state"]) == {n for n, _ in model.named_parameters()}
    flops = ckpt["state"]["flops_by_passes"]  # 3 steps at K=1, then 3 at K=2, each at its own FLOPs per token
    avg = min(load_data(data_dir).meta["mean_doc_len"], 32)
    before = ModelConfig(**dict(ckpt["model_config"], n_passes=1, layout=layout))
    assert flops[1] == pytest.approx(3 * 128 * train.flops_per_token(before, None, avg))
    assert flops[2] == pytest.approx(3 * 128 * train.flops_per_token(model.config, None, avg))
    first = run(data_dir, tmp_path / "b", **(pcc | dict(max_steps=4)))  # grown at step 3 of 4, then resumed
    second = train.train(dict(out_dir=str(tmp_path / "b"), init_from="resume", max_steps=6))
    assert first["train_losses"] + second["train_losses"] == summary["train_losses"]


def test_non_finite_loss_stops_before_any_checkpoint_holds_it(tmp_path, data_dir, monkeypatch):
    run(data_dir, tmp_path, max_steps=2, eval_interval=2, decay_fraction=0.0)
    before = (tmp_path / "ckpt.pt").read_bytes()
    monkeypatch.setattr(GPT, "forward", lambda self, *a, **k: (None, torch.tensor(float("nan"),
                                                               requires_grad=True), {"ce": torch.tensor(0.0)}))
    with pytest.raises(FloatingPointError, match="non-finite by step"):
        train.train(dict(out_dir=str(tmp_path), init_from="resume", max_steps=4))
    assert (tmp_path / "ckpt.pt").read_bytes() == before


def test_an_interrupted_checkpoint_write_keeps_the_previous_one(tmp_path, data_dir, monkeypatch):
    run(data_dir, tmp_path, max_steps=2, eval_interval=2, decay_fraction=0.0)
    before = (tmp_path / "ckpt.pt").read_bytes()
    save = torch.save

    def half_then_fail(obj, f, *a, **k):
        save(obj, f, *a, **k)
        with open(f, "r+b") as h:
            h.truncate(100)
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(torch, "save", half_then_fail)
    with pytest.raises(OSError):
        train.train(dict(out_dir=str(tmp_path), init_from="resume", max_steps=4))
    assert (tmp_path / "ckpt.pt").read_bytes() == before


def test_a_new_run_into_a_run_folder_and_resuming_nothing_are_refused(tmp_path, data_dir):
    run(data_dir, tmp_path, max_steps=2, eval_interval=2)
    with pytest.raises(ValueError, match="holds a run"):
        run(data_dir, tmp_path, max_steps=2)
    with pytest.raises(ValueError, match="nothing to train"):
        train.train(dict(out_dir=str(tmp_path), init_from="resume"))
    with pytest.raises(ValueError, match="no checkpoint"):
        train.train(dict(out_dir=str(tmp_path / "none"), init_from="resume"))
    with pytest.raises(ValueError, match="keeps its checkpoint's shape"):
        train.train(dict(out_dir=str(tmp_path), init_from="resume", max_steps=4, n_layer=3))


def test_a_pickled_payload_runs_nothing_through_init_from(tmp_path, data_dir):
    class Boom:
        def __reduce__(self):
            return os.system, (f"touch {tmp_path / 'ran'}",)
    ckpt = tmp_path / "evil.pt"
    torch.save(dict(model_config={}, model={}, boom=Boom()), ckpt)
    with pytest.raises(ValueError, match="evil.pt: not a checkpoint of tensors"):
        train.train(dict(init_from=str(ckpt), out_dir=str(tmp_path / "x"), data_dir=data_dir))
    assert not (tmp_path / "ran").exists()


def test_wandb_logs_each_eval_offline(tmp_path, data_dir, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    run(data_dir, tmp_path / "run", max_steps=2, eval_interval=1, wandb_log=True, wandb_run_name="t")
    history = list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(history) == 1 and history[0].stat().st_size > 0
