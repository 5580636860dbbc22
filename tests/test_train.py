"""train.py on a small corpus and a very small looped MoE, a few steps each."""
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
import torch.nn.functional as F

import configurator
import match
import train
from data import prepare as prep
from data.loader import get_tokenizer, load_data, windows
from loss_eval import evaluate
from model import GPT, ModelConfig, load_checkpoint

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = dict(n_layer=2, n_embd=32, n_head=2, n_expert=4, top_k=2, layout="smelt", n_passes=2, block_size=32,
             batch_size=4, eval_tokens=256, warmup_steps=2, eval_interval=100)


def run(data_dir, out, **overrides):
    return train.train(SMALL | dict(data_dir=data_dir, out_dir=str(out)) | overrides)


def log_of(summary):
    return [json.loads(line) for line in open(summary["log_path"])]


def strip(log):  # without the wall-clock times and speeds
    return [{k: v for k, v in r.items() if k not in ("seconds", "tokens_per_s", "mfu")} for r in log]


def main_error(argv, capsys):
    status = train.main(argv)
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1 and err.startswith("train.py: error: "), (status, err)
    return err


def test_help_lists_45_settings_each_described(capsys):
    assert train.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert len(train.DEFAULTS) == 45  # as README.md says
    for key in train.DEFAULTS:
        line = next(line for line in out.splitlines() if line.strip().startswith(f"{key}:"))
        assert "=" in line and "#" in line or key == "wandb_project", line


UNTIED = "--layout=pcc_untied --n_layer=3 --n_passes=2 "


@pytest.mark.parametrize("args, message", [
    ("--n_embed=64", "unknown setting 'n_embed' in the command line (did you mean n_embd?)"),
    ("--max_steps=abc", "max_steps='abc' in the command line: expected a"),
    ("config/nope.py", "config file not found: config/nope.py"),
    ("{tmp}/c.py", "unknown setting 'max_step' in"), ("--layout=loop", "layout='loop': must be plain, smelt"),
    ("--warmup_steps=-5", "warmup_steps=-5: must be >= 0"), ("--embedding_lr=-0.1", "embedding_lr=-0.1"),
    ("--matrix_lr=-1", "matrix_lr=-1.0: must be >= 0"), ("--unembedding_lr=-1", "unembedding_lr=-1.0"),
    ("--weight_decay=-1", "weight_decay=-1.0"), ("--max_steps=0", "max_steps=0: must be >= 1"),
    ("--batch_size=0", "batch_size=0"), ("--global_batch=-8", "global_batch=-8"), ("--seed=-1", "seed=-1"),
    ("--eval_interval=0", "eval_interval=0"), ("--eval_tokens=0", "eval_tokens=0"),
    ("--grow_at=-1", "grow_at=-1.0"), ("--decay_tokens=-1", "decay_tokens=-1"),
    ("--decay_fraction=1.5", "decay_fraction=1.5: must be in [0, 1]"),
    ("--save_steps=[5,0]", "save_steps=[5, 0]: each must be a step >= 1"),
    ("--n_passes_choices=[0,2]", "n_passes_choices=[0, 2]: each must be >= 1"),
    ("--n_passes_choices=[1,65]", "n_passes_choices=[1, 65]: each must be in [1, 64]"),
    (UNTIED + "--n_passes_choices=[1,3]", "n_passes_choices=[1, 3]: each must be in [1, 2]"),
    ("--optimizer=sgd", "optimizer='sgd': must be one of muon, muon_x, adamw"),
    ("--parallel=zero", "parallel='zero': must be one of ddp, fsdp, fsdp_grad_op, hsdp"),
])
def test_a_bad_value_is_refused_before_anything_is_written(tmp_path, data_dir, capsys, args, message):
    out = tmp_path / "run"
    (tmp_path / "c.py").write_text("max_step = 3\n")
    args = args.format(tmp=tmp_path).split()
    err = main_error([f"--out_dir={out}", f"--data_dir={data_dir}", "--max_steps=4", *args], capsys)
    assert err.startswith(f"train.py: error: {message}"), err
    assert not out.exists()


def test_a_config_file_includes_another_and_is_overridden(tmp_path):
    (tmp_path / "base.py").write_text("n_layer = 6\nmax_steps = 10\n")
    (tmp_path / "run.py").write_text('include("base.py")\nmax_steps = 20\n')
    assert configurator.configure(train.DEFAULTS, [str(tmp_path / "run.py"), "--n_embd=64"]) == dict(
        n_layer=6, max_steps=20, n_embd=64)


@pytest.mark.parametrize("name", sorted(n for n in os.listdir(os.path.join(REPO, "config")) if n[0] != "_"))
def test_every_config_file_is_a_valid_run(name):
    settings = train.DEFAULTS | configurator.configure(train.DEFAULTS, [os.path.join(REPO, "config", name)])
    ModelConfig(vocab_size=50304, **{k: settings[k] for k in train.MODEL_SETTINGS})


@pytest.mark.parametrize("optimizer", ["muon", "adamw"])
def test_param_groups_cover_every_parameter_once(optimizer):
    model = GPT(ModelConfig(n_layer=3, n_embd=32, n_head=2, n_expert=4, top_k=2, layout="pcc_untied",
                            n_passes=2))
    config = train.TrainConfig(optimizer=optimizer)
    named = [n for group in train.param_groups(model, config) for n, _ in group[4]]
    assert sorted(named) == sorted(n for n, _ in model.named_parameters())
    kinds = {g[0]: g[1] for g in train.param_groups(model, config)}
    assert kinds["matrix"] == optimizer and kinds["router"] == kinds["embedding"] == "adamw"


def test_the_schedule_warmup_stable_decay_to_zero_and_growth():
    m = [train.wsd_multiplier(s, 10, 70, 100) for s in range(100)]
    assert m[0] == pytest.approx(0.1) and m[9] == 1.0 and m[10:70] == [1.0] * 60
    assert all(a > b for a, b in zip(m[70:], m[71:])) and m[-1] == pytest.approx(0.0, abs=1e-12)
    lin = [train.wsd_multiplier(s, 0, 90, 100, "linear") for s in range(100)]
    assert lin[90] == 1.0 and lin[99] == 0.0 and lin[95] == pytest.approx(4 / 9)
    config = train.TrainConfig(max_steps=100, warmup_steps=10, decay_fraction=0.3)
    assert train.plan_schedule(config, 1024) == (100, 70, None)  # decays over exactly the last 30%
    # growth re-warms the LR, and muon_x warms its momentum
    config = train.TrainConfig(optimizer="muon_x", warmup_steps=0, decay_fraction=0.0, grow_at=0.5,
                               max_steps=2563)
    steps, _, grow_step = train.plan_schedule(config, 1024)
    assert grow_step == 1281  # [X] d8: 40 re-warm steps of 2,563
    assert [train.lr_multiplier(config, grow_step + s, steps, steps, grow_step) for s in (0, 20, 40)] == \
        [0.0, 0.5, 1.0]
    assert train.muon_momentum(config, 0, 2355) == 0.85 and train.muon_momentum(config, 300, 2355) == 0.95


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
        match.flops_per_token(model.config, avg_doc_len=avg_doc_len) * last["tokens"])
    assert ckpt["state"]["step"] == 20 and ckpt["config"]["data_dir"] == data_dir
    assert set(ckpt["optimizers"]["state"]) == {n for n, _ in model.named_parameters()}  # keyed by name
    # the speed: none before a step, at most the wall clock's, no MFU on a CPU
    assert log[0]["tokens_per_s"] is None and last["mfu"] is None is summary["mfu"]
    assert 0 < last["tokens_per_s"] and 20 * 8 * 128 / last["seconds"] < summary["tokens_per_s"]


def test_bits_per_byte_on_text_with_end_of_text_tokens_and_of_a_uniform_model(tmp_path, data_dir):
    """bpb: the nats of every target but eot over the UTF-8 bytes of the targets' text, in bits; the
    val loss averages every target, eot included. A zero lm head predicts uniformly: loss log(V)."""
    docs = [{"text": f"Act {i}. " + "Enter a messenger, with letters. " * (1 + i % 3)} for i in range(40)]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    data = load_data(prep.prepare([str(tmp_path / "c.jsonl")], str(tmp_path / "p"), val_fraction=0.5, seed=0,
                                  verbose=False))
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=4096, block_size=16, n_layer=1, n_embd=16, n_head=2, init="nanogpt"))
    n = (len(data.val) - 1) // 16  # eval_tokens large enough: every window once
    metrics = evaluate(model, data, 10 ** 6, 4)
    rows = torch.from_numpy(windows(data.val, [16 * i for i in range(n)], 16))
    with torch.no_grad():
        ce = F.cross_entropy(model(rows[:, :-1])[0].flatten(0, 1), rows[:, 1:].flatten(), reduction="none")
    targets = rows[:, 1:].flatten()
    text = targets != data.meta["eot_token"]
    assert (~text).sum() >= 10  # the instrument: eot targets are there
    enc = get_tokenizer(data.meta["tokenizer"]).encoding
    n_bytes = sum(len(enc.decode_bytes([t])) for t in targets[text].tolist())
    assert metrics["val_loss"] == pytest.approx(ce.mean().item(), rel=1e-5)
    assert metrics["val_bpb"] == pytest.approx(ce[text].sum().item() / n_bytes / math.log(2), rel=1e-5)
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
    """Exact resume, with random passes and two micro-batches per step; the log continues, each eval
    with the mean training loss since the last."""
    common = dict(decay_fraction=0.0, n_passes_choices=[1, 2, 3], eval_interval=3, global_batch=8)
    straight = run(data_dir, tmp_path / "a", max_steps=7, **common)
    losses, log = straight["train_losses"], log_of(straight)
    assert [r["step"] for r in log] == [0, 3, 6, 7] and log[0]["train_loss"] is None
    for r, window in zip(log[1:], (losses[0:3], losses[3:6], losses[6:7])):
        assert r["train_loss"] == pytest.approx(sum(window) / len(window), rel=1e-12)
    first = run(data_dir, tmp_path / "b", max_steps=3, **common)
    second = train.train(dict(out_dir=str(tmp_path / "b"), init_from="resume", max_steps=7))
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
    stable = run(data_dir, tmp_path / "stable", max_steps=6, decay_fraction=0.0, save_steps=[4],
                 matrix_lr=0.03)
    ckpt_path = os.path.join(stable["run_dir"], "ckpt_step4.pt")
    branch = train.train(dict(init_from=ckpt_path, decay_tokens=5 * 4 * 32))
    assert branch["run_dir"].endswith("stable_decay4") and branch["step"] == 9
    # its first loss: the step-4 weights on the first held-back batch
    model, ckpt = load_checkpoint(ckpt_path)
    x, y = load_data(data_dir).stream(32, 1337, branch=True).batch(0, 4)
    ce = model(x, y, return_stats=True)[2]["ce"].item()
    assert branch["train_losses"][0] == pytest.approx(ce, rel=1e-5)
    log = log_of(branch)
    assert log[-1]["lr"] == 0.0 and log[-1]["tokens"] == ckpt["state"]["tokens"] + 5 * 4 * 32
    assert load_checkpoint(branch["ckpt_path"])[1]["config"]["matrix_lr"] == 0.03  # inherited
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
    flops = ckpt["state"]["flops_by_passes"]  # 3 steps at K=1, then 3 at K=2
    avg = min(load_data(data_dir).meta["mean_doc_len"], 32)
    before = ModelConfig(**dict(ckpt["model_config"], n_passes=1, layout=layout))
    assert flops[1] == pytest.approx(3 * 128 * match.flops_per_token(before, avg_doc_len=avg))
    assert flops[2] == pytest.approx(3 * 128 * match.flops_per_token(model.config, avg_doc_len=avg))
    first = run(data_dir, tmp_path / "b", **(pcc | dict(max_steps=4)))  # grown at step 3 of 4, then resumed
    second = train.train(dict(out_dir=str(tmp_path / "b"), init_from="resume", max_steps=6))
    assert first["train_losses"] + second["train_losses"] == summary["train_losses"]


def test_a_diverging_run_stops_and_every_checkpoint_it_saved_is_finite(tmp_path, data_dir):
    """An LR of 1e6 breaks the weights before a training loss can show it, so the run checks the
    weights and the val loss too, and stops before the broken step is logged or saved."""
    lrs = dict(matrix_lr=1e6, embedding_lr=1e6, unembedding_lr=1e6)
    with pytest.raises(FloatingPointError) as e:
        train.train(dict(data_dir=data_dir, out_dir=str(tmp_path), batch_size=2, eval_tokens=512,
                         warmup_steps=1, max_steps=12, eval_interval=1, save_steps=list(range(1, 13)), **lrs))
    stopped = int(str(e.value).split("by step ")[1].split(":")[0])
    saved = {p.name: torch.load(p, weights_only=True) for p in tmp_path.glob("ckpt*.pt")}
    steps = {f"ckpt_step{s}.pt" for s in range(1, stopped)}
    assert set(saved) == ({"ckpt.pt"} if stopped > 1 else set()) | steps
    for name, ckpt in saved.items():
        states = [t for state in ckpt["optimizers"]["state"].values() for t in state.values()]
        assert all(t.isfinite().all() for t in [*ckpt["model"].values(), *states]), name
    log = [json.loads(line) for line in open(tmp_path / "log.jsonl")]
    assert [r["step"] for r in log] == list(range(stopped)) and all(math.isfinite(r["val_loss"]) for r in log)
    last = f"{tmp_path / 'ckpt.pt'} (step {stopped - 1}) is the last checkpoint"
    assert str(e.value).endswith(last if stopped > 1 else "no checkpoint was saved")
    assert stopped == 1 or saved["ckpt.pt"]["state"]["step"] == stopped - 1


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


def test_an_interrupted_checkpoint_write_keeps_the_previous_one(tmp_path, data_dir, monkeypatch):
    run(data_dir, tmp_path, max_steps=2, eval_interval=2, decay_fraction=0.0)
    before, save = (tmp_path / "ckpt.pt").read_bytes(), torch.save

    def half_then_fail(obj, f, *a, **k):  # a disk that fills up mid-write
        save(obj, f, *a, **k)
        with open(f, "r+b") as h:
            h.truncate(100)
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(torch, "save", half_then_fail)
    with pytest.raises(OSError):
        train.train(dict(out_dir=str(tmp_path), init_from="resume", max_steps=4))
    assert (tmp_path / "ckpt.pt").read_bytes() == before


def test_a_pickled_payload_runs_nothing_through_init_from(tmp_path, capsys):
    from test_trust_tools import Payload
    torch.save(dict(model_config={}, model={}, boom=Payload(tmp_path / "ran")), tmp_path / "evil.pt")
    argv = [f"--init_from={tmp_path / 'evil.pt'}", f"--out_dir={tmp_path / 'x'}"]
    assert "evil.pt: not a checkpoint of tensors" in main_error(argv, capsys)
    assert not (tmp_path / "ran").exists()
