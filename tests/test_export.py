"""Tests for tooling/export.py and the export folder's reading (tooling/weights.py): a round trip gives the same
logits, tied weights are stored once, config.json and the README say what the weights are, every tool's
--ckpt reads the folder, a damaged folder is refused in one line, and no half-written export is ever left."""
import json
import os

import pytest
import torch

safetensors = pytest.importorskip("safetensors")
from safetensors.torch import load_file, save_file  # noqa: E402

import eval_core  # noqa: E402
import probe  # noqa: E402
import sample  # noqa: E402
from conftest import REPO, one_line_error  # noqa: E402
from data.prepare import prepare  # noqa: E402
from model import GPT, ModelConfig  # noqa: E402
from tooling import export, weights  # noqa: E402
from tooling.checkpoint import load_model, plain_config  # noqa: E402
from tooling.checkpoint import save_file as save_checkpoint_file  # noqa: E402

SMALL = dict(vocab_size=4096, eot_token=4095, block_size=64, n_layer=4, n_embd=32, n_head=2, init="nanogpt")
LOOPED_MOE = dict(layout="smelt", n_passes=2, n_expert=4, top_k=2)
TIED = dict(tie_embeddings=True)
STATE = {"step": 120, "tokens_seen": 245760, "last_eval": {"val_loss": 4.25, "val_bpb": 2.5}}
BUNDLE = os.path.join(REPO, "tests", "data", "core_bundle")


def write_checkpoint(path, data_dir=None, **overrides):
    torch.manual_seed(0)
    model = GPT(ModelConfig(**(SMALL | overrides)))
    save_checkpoint_file(str(path), {"model_config": plain_config(model.config), "model": model.state_dict(),
                                     "tokenizer": "gpt2-4096", "state": STATE, "data_dir": data_dir,
                                     "train_config": {"run_name": "demo"}})
    return str(path), model


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """{"moe" | "tied": (checkpoint path, export folder, the model)}."""
    root = tmp_path_factory.mktemp("export")
    out = {}
    for name, overrides in (("moe", LOOPED_MOE), ("tied", TIED)):
        ckpt, model = write_checkpoint(root / f"{name}.pt", **overrides)
        assert export.main([ckpt, "--out", str(root / name)]) == 0
        out[name] = (ckpt, str(root / name), model)
    return out


@pytest.mark.parametrize("name", ["moe", "tied"])
def test_round_trip_gives_the_same_logits(exported, name):
    _, folder, model = exported[name]
    loaded, info = load_model(folder)
    idx = torch.randint(0, 4096, (2, 40), generator=torch.Generator().manual_seed(1))
    for n_passes in (None, 1, 3):
        with torch.no_grad():
            assert torch.equal(model(idx, n_passes=n_passes)[0], loaded(idx, n_passes=n_passes)[0])
    assert info["tokenizer"] == "gpt2-4096" and info["state"] == {"step": 120, "tokens_seen": 245760}


def test_tied_weights_are_stored_once(exported):
    _, folder, _ = exported["tied"]
    path = os.path.join(folder, weights.WEIGHTS_FILE)
    stored = load_file(path)
    assert "wte.weight" in stored and "lm_head.weight" not in stored
    with safetensors.safe_open(path, framework="pt") as f:
        metadata = f.metadata()
    sealed = json.loads(metadata.pop(weights.SEALED_KEY))  # config.json but its sha256, repeated in the header
    assert metadata == {"format": "pt", "lm_head.weight": "wte.weight"}  # the alias as safetensors' save_model names it
    config = json.loads(open(os.path.join(folder, weights.CONFIG_FILE)).read())
    assert sealed == {k: v for k, v in config.items() if k != "sha256"}
    loaded, _ = load_model(folder)
    assert loaded.lm_head.weight is loaded.wte.weight
    from safetensors.torch import load_model as safetensors_load_model  # the ecosystem's loader reads it too
    config = json.loads(open(os.path.join(folder, weights.CONFIG_FILE)).read())
    plain = GPT(ModelConfig(**config["model_config"]))
    assert safetensors_load_model(plain, path) == (set(), [])
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), loaded.state_dict().values()))
    assert set(stored) == set(exported["tied"][2].state_dict()) - {"lm_head.weight"}
    assert "lm_head.weight" in load_file(os.path.join(exported["moe"][1], weights.WEIGHTS_FILE))  # untied: both


def test_config_json_and_readme_say_what_the_weights_are(exported):
    ckpt, folder, model = exported["moe"]
    config = json.loads(open(os.path.join(folder, weights.CONFIG_FILE)).read())
    assert config["format"] == weights.EXPORT_FORMAT and config["model_config"] == plain_config(model.config)
    assert config["tokenizer"] == "gpt2-4096"
    assert config["trained"] == {"step": 120, "tokens_seen": 245760, "val_loss": 4.25, "val_bpb": 2.5,
                                 "run_name": "demo"}
    assert config["sha256"] == weights.file_sha256(os.path.join(folder, weights.WEIGHTS_FILE))
    readme = open(os.path.join(folder, weights.README_FILE)).read()
    for needle in ("# demo", "smelt: 4 layers, layers 1-2 executed 2 times", "K = 1 to 64", "gpt2-4096",
                   "step 120, 245,760 tokens", "4.2500 nats per token (2.5000 bits per byte)",
                   "MoE: 4 experts", "python sample.py --ckpt moe"):
        assert needle in readme, needle
    assert set(os.listdir(folder)) == {weights.WEIGHTS_FILE, weights.CONFIG_FILE, weights.README_FILE}


def test_load_exported_state_for_a_new_run(exported):
    _, folder, model = exported["tied"]
    model_config, state, info = export.load_exported_state(folder)
    assert model_config == plain_config(model.config)
    assert sorted(state) == sorted(model.state_dict())  # every name, the tied alias restored
    assert state["lm_head.weight"] is state["wte.weight"]
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert info["trained"]["step"] == 120 and info["path"] == folder


@pytest.fixture(scope="module")
def probe_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("probe_data")
    text = open(os.path.join(REPO, "data", "corpus", "shakespeare.jsonl")).readline()
    docs = root / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": json.loads(text)["text"][i * 600:(i + 1) * 600]}) + "\n"
                            for i in range(8)))
    return prepare([str(docs)], str(root / "data"), val_fraction=0.5, seed=0, verbose=False)


def test_every_tool_reads_the_folder_as_it_reads_the_checkpoint(exported, probe_data, capsys):
    ckpt, folder, _ = exported["moe"]
    runs = [(sample.main, ["--num_samples", "1", "--max_new_tokens", "8", "--temperature", "0"]),
            (eval_core.main, ["--bundle", BUNDLE, "--max_per_task", "2", "--json", "--no_progress"]),
            (probe.main, ["--data_dir", probe_data, "--tokens", "128", "--json"])]
    for main, argv in runs:
        outputs = []
        for path in (ckpt, folder):
            assert main(["--ckpt", path] + argv) == 0, main
            outputs.append(capsys.readouterr().out.replace(path, "CKPT"))
        assert outputs[0] == outputs[1] and outputs[0].strip(), main
    import eval_harness
    model, tokenizer, info = eval_harness.load_model_and_tokenizer(folder)
    assert tokenizer.name == "gpt2-4096" and info["trained"]["run_name"] == "demo"


def damage(folder, tmp_path, name, change):
    """A copy of the export folder with one change; change(copy) edits it."""
    import shutil
    copy = tmp_path / name
    shutil.copytree(folder, copy)
    change(copy)
    return str(copy)


def edit_config(edit):
    def change(folder):
        path = folder / weights.CONFIG_FILE
        config = json.loads(path.read_text())
        edit(config)
        path.write_text(json.dumps(config))
    return change


def rewrite_weights(edit, seal=True):
    """Change the tensors, keeping the header's metadata (the sealed config: without seal, dropped), and record
    the new file's SHA-256, so the check after those is the one tested."""
    def change(folder):
        path = str(folder / weights.WEIGHTS_FILE)
        with safetensors.safe_open(path, framework="pt") as f:
            metadata = f.metadata()
        if not seal:
            metadata.pop(weights.SEALED_KEY)
        tensors = load_file(path)
        edit(tensors)
        save_file(tensors, path, metadata=metadata)
        config = folder / weights.CONFIG_FILE
        config.write_text(json.dumps(json.loads(config.read_text()) | {"sha256": weights.file_sha256(path)}))
    return change


def damaged_cases(moe, tied, tmp_path):
    """(folder, text its one error line must hold) for each way an export can be broken."""
    def flip_byte(folder):
        path = folder / weights.WEIGHTS_FILE
        data = bytearray(path.read_bytes())
        data[-5] ^= 0x40
        path.write_bytes(bytes(data))

    def truncate(folder):
        path = folder / weights.WEIGHTS_FILE
        path.write_bytes(path.read_bytes()[:100])
        edit_config(lambda c: c.update(sha256=weights.file_sha256(str(path))))(folder)

    def nan(t):
        t["wte.weight"][0, 0] = float("nan")

    def as_int(t):
        t["norm_f.weight"] = t["norm_f.weight"].long()

    def both_tied(t):
        t["lm_head.weight"] = t["wte.weight"].clone()

    def narrower(t):
        t["norm_f.weight"] = t["norm_f.weight"][:16]

    cases = [("malformed", lambda f: (f / weights.CONFIG_FILE).write_text("{not json"), "config.json: malformed JSON"),
             ("no_config_key", edit_config(lambda c: c.pop("model_config")), "'model_config' is missing"),
             ("format", edit_config(lambda c: c.update(format="other")), "is not the config of a loopstudy export"),
             ("bad_config", edit_config(lambda c: c["model_config"].update(n_layer=0)), "model_config is not valid"),
             ("unknown_key", edit_config(lambda c: c["model_config"].update(depth=3)), "unknown ModelConfig keys"),
             ("trained", edit_config(lambda c: c["trained"].update(step="x")), "trained.step='x'"),
             ("edited", edit_config(lambda c: c["model_config"].update(n_passes=3)), "differs from the config sealed"),
             ("unsealed", rewrite_weights(lambda t: None, seal=False), "differs from the config sealed"),
             ("mismatch", rewrite_weights(narrower), "model.safetensors: the weights do not match the model config"),
             ("flipped", flip_byte, "model.safetensors does not have the bytes it was written with"),
             ("truncated", truncate, "cannot read"),
             ("no_weights", lambda f: os.remove(f / weights.WEIGHTS_FILE),
              "an export folder without model.safetensors"),
             ("nan", rewrite_weights(nan), "weight wte.weight holds NaN or inf"),
             ("int", rewrite_weights(as_int), "norm_f.weight is stored as torch.int64")]
    out = [(damage(moe, tmp_path, name, change), needle) for name, change, needle in cases]
    out.append((damage(tied, tmp_path, "both_tied", rewrite_weights(both_tied)), "holds both lm_head.weight"))
    out.append((damage(tied, tmp_path, "device", lambda f: (os.remove(f / weights.CONFIG_FILE),
                                                            os.symlink("/dev/zero", f / weights.CONFIG_FILE))),
                "is not a regular file"))
    (tmp_path / "empty").mkdir()
    out.append((str(tmp_path / "empty"), "is a directory, not a checkpoint file (nor an export folder"))
    return out


def test_a_damaged_export_is_refused_in_one_line(exported, tmp_path, capsys):
    for folder, needle in damaged_cases(exported["moe"][1], exported["tied"][1], tmp_path):
        err = one_line_error(sample.main, ["--ckpt", folder, "--max_new_tokens", "1"], capsys, "sample.py")
        assert needle in err and folder in err, (folder, err)


def test_no_half_written_export_is_left(exported, tmp_path, capsys, monkeypatch):
    ckpt, folder, _ = exported["moe"]
    out = tmp_path / "out"

    def fail(model, directory):
        assert os.listdir(directory)  # the files were written, into the temp folder
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(export, "check_round_trip", fail)
    assert "No space left on device" in one_line_error(export.main, [ckpt, "--out", str(out)], capsys,
                                                       "tooling.export")
    assert os.listdir(tmp_path) == []  # neither the export nor its temp folder
    monkeypatch.undo()
    assert export.main([ckpt, "--out", str(out)]) == 0
    before = open(out / weights.CONFIG_FILE).read()
    monkeypatch.setattr(export, "check_round_trip", fail)
    one_line_error(export.main, [ckpt, "--out", str(out), "--overwrite"], capsys, "tooling.export")
    assert open(out / weights.CONFIG_FILE).read() == before and os.listdir(tmp_path) == ["out"]
    monkeypatch.undo()
    assert export.main([folder, "--out", str(out), "--overwrite"]) == 0  # an export exported again
    assert json.loads(open(out / weights.CONFIG_FILE).read())["trained"]["run_name"] == "demo"
    assert os.listdir(tmp_path) == ["out"] and "exported" in capsys.readouterr().out


def test_cli_refusals(exported, tmp_path, capsys):
    ckpt, folder, _ = exported["moe"]
    (tmp_path / "file").write_text("x")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    cases = [([str(tmp_path / "absent.pt"), "--out", str(tmp_path / "x")], "checkpoint not found"),
             ([ckpt, "--out", folder], "already exists: give a new folder, or --overwrite"),
             ([ckpt, "--out", str(tmp_path / "other"), "--overwrite"], "holds files that are not an export"),
             ([ckpt, "--out", str(tmp_path / "file")], "is a file: give a folder")]
    for argv, needle in cases:
        assert needle in one_line_error(export.main, argv, capsys, "tooling.export"), argv
    assert open(tmp_path / "other" / "notes.txt").read() == "mine"


def test_train_init_from_an_export_starts_a_new_run_from_its_weights(exported, data_dir, tmp_path):
    """train.py --init_from=DIR: the export's model and weights at step 0 (its first eval is the exported
    model's own val loss), a fresh optimizer, the command's data; a decay branch needs a training checkpoint."""
    import train
    from data.loader import load_data
    from loss_eval import evaluate
    _, folder, model = exported["moe"]
    settings = dict(init_from=folder, data_dir=data_dir, out_dir=str(tmp_path), run_name="from_export", max_steps=2,
                    batch_size=2, eval_tokens=256, warmup_steps=1, eval_interval=1)
    summary = train.train(settings)
    log = [json.loads(line) for line in open(summary["log_path"])]
    assert [r["step"] for r in log] == [0, 1, 2]
    expected = evaluate(model.eval(), load_data(data_dir), train.TrainConfig(batch_size=2, eval_tokens=256))
    assert log[0]["val_loss"] == pytest.approx(expected["val_loss"], rel=1e-6)
    trained = torch.load(summary["ckpt_path"], weights_only=True)
    assert trained["state"]["step"] == 2 and trained["model_config"] == plain_config(model.config)
    assert not torch.equal(trained["model"]["wte.weight"], model.wte.weight)  # it trained from there
    with pytest.raises(ValueError, match="an export holds weights only"):
        train.train(settings | dict(run_name="branch", decay_tokens=256))  # a branch forks a checkpoint
