"""sample.py: seeded sampling, greedy = the argmax of a full forward, windows past block_size, test-time passes,
the CLI; the export: the same logits back, a tied weight stored once, every tool reading the folder as it reads
the checkpoint, nothing half-written."""
import dataclasses
import json
import os

import pytest
import torch

import sample
from conftest import model_whose_blocks_matter
from data.loader import get_tokenizer

SMALL = dict(vocab_size=4096, eot_token=4095, block_size=32, n_layer=2, n_embd=32, n_head=2, mlp_hidden=256,
             init="nanogpt")
# init="nanogpt": the default "x" init zeroes the lm head, every logit would be equal
BUNDLE = os.path.join(os.path.dirname(__file__), "data", "core_bundle")


def make_model(**overrides):
    return model_whose_blocks_matter(**(SMALL | overrides))


def save_checkpoint(model, path, tokenizer="gpt2-4096", **extra):
    """A ckpt.pt as train.py writes it (train.py adds config, optimizers, state, rng)."""
    config = json.loads(json.dumps(dataclasses.asdict(model.config)))  # plain ints for weights_only
    torch.save({"model": model.state_dict(), "model_config": config, "tokenizer": tokenizer, "step": 0, **extra},
               path)
    return str(path)


def error_line(main, argv, capsys, prog):
    """A CLI mistake: exit status 2, nothing on stdout, the last line on stderr `prog: error: ...` (argparse
    prints its usage above it)."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    out, err = capsys.readouterr()
    assert exit_.value.code == 2 and out == "" and err.splitlines()[-1].startswith(f"{prog}: error: "), err
    return err.splitlines()[-1]


@pytest.fixture(scope="module")
def tok():
    return get_tokenizer("gpt2-4096")


@pytest.fixture(scope="module")
def smelt():
    return make_model(layout="smelt", n_passes=2)


def greedy_reference(model, ids, max_new_tokens, n_passes=None):
    """Greedy decoding the slow way: a full forward over the whole context for every token, the context
    cut to its last block_size // 2 tokens whenever it is full (sample.py's window rule)."""
    context, new = list(ids), []
    for _ in range(max_new_tokens):
        if len(context) >= model.config.block_size:
            context = context[-(model.config.block_size // 2):]
        logits, _ = model(torch.tensor([context]), n_passes=n_passes)
        context.append(int(logits[0, -1].argmax()))
        new.append(context[-1])
    return new


def greedy(model, ids, max_new_tokens, n_passes=None):
    idx = torch.tensor([ids])
    return sample.generate_windowed(model, idx, max_new_tokens, temperature=0, n_passes=n_passes)[0].tolist()


# -----------------------------------------------------------------------------
# sampling

def test_seeded_sampling_is_deterministic(smelt, tok):
    kwargs = dict(start="ROMEO:", num_samples=3, max_new_tokens=20, temperature=1.0, top_k=200)
    first = sample.sample_texts(smelt, tok, seed=1, **kwargs)
    assert first == sample.sample_texts(smelt, tok, seed=1, **kwargs)
    assert first != sample.sample_texts(smelt, tok, seed=2, **kwargs)
    assert len(set(first)) == 3  # the samples of one call are not copies of each other
    assert all(text.startswith("ROMEO:") and len(text) > len("ROMEO:") for text in first)


def test_top_k_1_is_greedy(smelt, tok):
    ids = [smelt.config.eot_token] + tok.encode("ROMEO:")
    sampled = sample.generate_windowed(smelt, torch.tensor([ids]), 12, temperature=1.0, top_k=1,
                                       generator=torch.Generator().manual_seed(0))
    assert sampled[0].tolist() == greedy(smelt, ids, 12)


@pytest.mark.parametrize("overrides", [dict(layout="smelt", n_passes=2), dict(layout="plain"),
                                       dict(layout="pcc_untied", n_layer=3, n_passes=2)])
def test_greedy_is_argmax_of_a_full_forward(overrides, tok):
    model = make_model(**overrides)
    ids = [model.config.eot_token] + tok.encode("But soft, what light")
    new = greedy(model, ids, 16)
    assert len(new) == 16 and len(set(new)) > 1  # not degenerate
    assert new == greedy_reference(model, ids, 16)


def test_generation_past_block_size(smelt, tok):
    ids = [smelt.config.eot_token] + tok.encode("ROMEO:")
    n = 3 * smelt.config.block_size + 5
    new = greedy(smelt, ids, n)
    assert len(new) == n and new == greedy_reference(smelt, ids, n)
    long_prompt = (ids * 20)[:50]  # longer than block_size=32 on its own
    assert greedy(smelt, long_prompt, 10) == greedy_reference(smelt, long_prompt, 10)
    sampled = sample.generate_windowed(smelt, torch.tensor([ids, ids]), n, temperature=0.8, top_k=50,
                                       generator=torch.Generator().manual_seed(0))
    assert sampled.shape == (2, n)
    assert sample.generate_windowed(smelt, torch.tensor([ids]), 0).shape == (1, 0)


def test_n_passes_changes_a_looped_model(tok):
    for model, trained in [(make_model(layout="smelt", n_passes=2), 2),
                           (make_model(layout="pcc", n_layer=3, n_passes=2, n_embd=64), 2)]:
        ids = [model.config.eot_token] + tok.encode("ROMEO:")
        default = greedy(model, ids, 16)
        assert greedy(model, ids, 16, n_passes=trained) == default
        for k in (1, 3):
            other = greedy(model, ids, 16, n_passes=k)
            assert other != default and other == greedy_reference(model, ids, 16, n_passes=k)


def test_n_passes_refusals_and_training_mode(tok):
    with pytest.raises(ValueError, match="a plain model has nothing to loop"):
        sample.sample_texts(make_model(layout="plain"), tok, max_new_tokens=4, n_passes=2)
    untied = make_model(layout="pcc_untied", n_layer=3, n_passes=2)
    with pytest.raises(ValueError, match="n_passes=3: this model runs 1 to 2 passes"):
        sample.sample_texts(untied, tok, max_new_tokens=4, n_passes=3)
    assert sample.sample_texts(untied.train(), tok, max_new_tokens=4, n_passes=1)  # fewer passes than trained
    assert untied.training  # sampling leaves the model's mode as it found it


# -----------------------------------------------------------------------------
# command line

def test_cli_prints_separated_seeded_samples(smelt, tok, tmp_path, capsys):
    ckpt = save_checkpoint(smelt, tmp_path / "ckpt.pt")
    args = ["--ckpt", ckpt, "--start", "ROMEO:", "--num_samples", "2", "--max_new_tokens", "40", "--seed", "1337"]
    assert sample.main(args) == 0
    out = capsys.readouterr().out
    expected = sample.sample_texts(smelt, tok, "ROMEO:", 2, 40, 0.8, 200, seed=1337)
    assert out == "".join(text + "\n" + sample.SEPARATOR + "\n" for text in expected)
    sample.main(args[:-2] + ["--seed", "1"])
    assert capsys.readouterr().out != out
    prompt = "ROMEO:\nBut soft, what light through yonder window breaks?\n"
    (tmp_path / "prompt.txt").write_text(prompt, encoding="utf-8")
    common = ["--ckpt", ckpt, "--num_samples", "1", "--max_new_tokens", "10", "--temperature", "0"]
    sample.main(common + ["--start", f"FILE:{tmp_path / 'prompt.txt'}"])
    from_file = capsys.readouterr().out
    sample.main(common + ["--start", prompt])
    assert from_file.startswith(prompt) and capsys.readouterr().out == from_file


def test_cli_mistakes_are_one_line_with_status_2(tmp_path, capsys):
    save_checkpoint(make_model(layout="plain"), tmp_path / "plain.pt")
    save_checkpoint(make_model(layout="pcc_untied", n_layer=3, n_passes=2), tmp_path / "untied.pt")
    (tmp_path / "latin1.txt").write_bytes("Roméo".encode("latin-1"))
    (tmp_path / "taken").mkdir()
    for args, needle in [(["--ckpt", f"{tmp_path}/nope.pt"], "nope.pt"),
                         (["--ckpt", f"{tmp_path}/plain.pt", "--n_passes", "2"], "nothing to loop"),
                         (["--ckpt", f"{tmp_path}/untied.pt", "--n_passes", "3"], "runs 1 to 2 passes"),
                         (["--ckpt", f"{tmp_path}/plain.pt", "--start", f"FILE:{tmp_path}/missing.txt"], "missing"),
                         (["--ckpt", f"{tmp_path}/plain.pt", "--start", f"FILE:{tmp_path}/latin1.txt"], "utf-8"),
                         (["--ckpt", f"{tmp_path}/plain.pt", "--device", "nonsense"], "nonsense"),
                         (["--ckpt", f"{tmp_path}/plain.pt", "--export", f"{tmp_path}/taken"], "exists"),
                         (["--num_samples", "x"], "--num_samples")]:
        assert needle in error_line(sample.main, args + ["--max_new_tokens", "4"], capsys, "sample.py"), args


# -----------------------------------------------------------------------------
# the export

@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """{"moe" | "tied": (checkpoint path, export folder, the model)}."""
    pytest.importorskip("safetensors")
    root, out = tmp_path_factory.mktemp("export"), {}
    for name, overrides in (("moe", dict(layout="smelt", n_passes=2, n_expert=4, top_k=2)), ("tied", {})):
        model = make_model(**overrides)  # init="nanogpt" ties the lm head to wte
        ckpt = save_checkpoint(model, root / f"{name}.pt", step=120)
        assert sample.main(["--ckpt", ckpt, "--export", str(root / name)]) == 0
        out[name] = (ckpt, str(root / name), model)
    return out


@pytest.mark.parametrize("name", ["moe", "tied"])
def test_export_round_trip_gives_the_same_logits(exported, name):
    from model import load_checkpoint
    _, folder, model = exported[name]
    loaded, info = load_checkpoint(folder)
    idx = torch.randint(0, 4096, (2, 30), generator=torch.Generator().manual_seed(1))
    for n_passes in (None, 1, 3):
        with torch.no_grad():
            assert torch.equal(model(idx, n_passes=n_passes)[0], loaded(idx, n_passes=n_passes)[0])
    assert info == {"model_config": json.loads(json.dumps(dataclasses.asdict(model.config))),
                    "tokenizer": "gpt2-4096", "step": 120}
    assert sorted(os.listdir(folder)) == ["README.md", "config.json", "model.safetensors"]
    readme = open(os.path.join(folder, "README.md")).read()
    assert f"python sample.py --ckpt {name}" in readme and "gpt2-4096" in readme


def test_export_stores_a_tied_weight_once(exported):
    from safetensors import safe_open
    from safetensors.torch import load_model
    from model import GPT, ModelConfig
    _, folder, model = exported["tied"]
    with safe_open(os.path.join(folder, "model.safetensors"), framework="pt") as f:
        assert len({"lm_head.weight", "wte.weight"} & set(f.keys())) == 1
    config = json.load(open(os.path.join(folder, "config.json")))
    plain = GPT(ModelConfig(**config["model_config"]))  # the ecosystem's own loader restores the tie
    load_model(plain, os.path.join(folder, "model.safetensors"))
    assert plain.lm_head.weight is plain.wte.weight
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), model.state_dict().values()))


def test_every_tool_reads_the_export_as_it_reads_the_checkpoint(exported, tmp_path, capsys):
    import eval_core
    import probe
    from data.prepare import prepare
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n<|endoftext|>\n".join(f"ROMEO: what light {i} through yonder window" for i in range(6)))
    data = prepare([str(corpus)], str(tmp_path / "data"), val_fraction=0.5, seed=0, verbose=False)
    ckpt, folder, _ = exported["moe"]
    runs = [(sample.main, ["--num_samples", "1", "--max_new_tokens", "8", "--temperature", "0"]),
            (eval_core.main, ["--bundle", BUNDLE, "--max_per_task", "2", "--json"]),
            (probe.main, ["--data_dir", data, "--tokens", "64", "--json"])]
    for main, argv in runs:
        outputs = []
        for path in (ckpt, folder):
            assert main(["--ckpt", path] + argv) == 0, main
            outputs.append(capsys.readouterr().out.replace(path, "CKPT"))
        assert outputs[0] == outputs[1] and outputs[0].strip(), main


def test_no_half_written_export_is_left(exported, tmp_path, monkeypatch):
    import safetensors.torch
    ckpt, _, _ = exported["moe"]

    def full_disk(model, path):
        open(path, "wb").write(b"partial")
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(safetensors.torch, "save_model", full_disk)
    with pytest.raises(OSError, match="No space left"):
        sample.main(["--ckpt", ckpt, "--export", str(tmp_path / "out")])
    assert os.listdir(tmp_path) == []  # neither the export nor its temporary folder
