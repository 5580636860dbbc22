"""sample.py: greedy = the argmax of a full forward, windows past block_size, test-time passes, the CLI;
the export: the same logits back, a tied weight stored once, read by every tool, nothing half-written."""
import dataclasses
import json
import os

import pytest
import torch

import sample
from conftest import model_whose_blocks_matter
from data.loader import get_tokenizer

# init="nanogpt": the default "x" init zeroes the lm head, every logit would be equal
SMALL = dict(vocab_size=4096, eot_token=4095, block_size=32, n_layer=2, n_embd=32, n_head=2, mlp_hidden=256,
             init="nanogpt")
TOK = get_tokenizer("gpt2-4096")
BUNDLE = os.path.join(os.path.dirname(__file__), "data", "core_bundle")


def make_model(**overrides):
    return model_whose_blocks_matter(**(SMALL | overrides))


def save_checkpoint(model, path, tokenizer="gpt2-4096", **extra):
    """A ckpt.pt as train.py writes it (train.py adds config, optimizers, state, rng)."""
    config = json.loads(json.dumps(dataclasses.asdict(model.config)))  # plain ints for weights_only
    ckpt = dict(model=model.state_dict(), model_config=config, tokenizer=tokenizer, step=0)
    torch.save(ckpt | extra, path)
    return str(path)


def error_line(main, argv, capsys, prog):
    """A CLI mistake: status 2, no stdout, stderr's last line `prog: error: ...` (the usage above it)."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    out, err = capsys.readouterr()
    assert exit_.value.code == 2 and out == "" and err.splitlines()[-1].startswith(f"{prog}: error: "), err
    return err.splitlines()[-1]


@pytest.fixture(scope="module")
def smelt():
    return make_model(layout="smelt", n_passes=2)


def greedy_reference(model, ids, max_new_tokens, n_passes=None):
    """Greedy decoding the slow way: a full forward per token, a full context cut to its last half."""
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


@pytest.mark.parametrize("overrides,passes", [
    (dict(layout="smelt", n_passes=2), (1, 3)), (dict(layout="plain"), ()),
    (dict(layout="pcc", n_layer=3, n_passes=2, n_embd=64), (1, 3)),
    (dict(layout="pcc_untied", n_layer=3, n_passes=2), (1,))])
def test_greedy_is_argmax_of_a_full_forward_at_any_number_of_passes(overrides, passes):
    model = make_model(**overrides)
    ids = [model.config.eot_token] + TOK.encode("ROMEO:")
    new = greedy(model, ids, 16)
    assert len(set(new)) > 1 and new == greedy_reference(model, ids, 16)  # not degenerate
    assert not passes or greedy(model, ids, 16, n_passes=2) == new  # as trained
    for k in passes:
        other = greedy(model, ids, 16, n_passes=k)
        assert other != new and other == greedy_reference(model, ids, 16, n_passes=k)


def test_generation_past_block_size(smelt):
    ids = [smelt.config.eot_token] + TOK.encode("ROMEO:")
    n = 3 * smelt.config.block_size + 5
    new = greedy(smelt, ids, n)
    assert len(new) == n and new == greedy_reference(smelt, ids, n)
    long_prompt = (ids * 20)[:50]  # longer than block_size=32 on its own
    assert greedy(smelt, long_prompt, 10) == greedy_reference(smelt, long_prompt, 10)
    sampled = sample.generate_windowed(smelt, torch.tensor([ids, ids]), n, temperature=1.0, top_k=1)
    assert sampled.tolist() == [new, new]  # top_k=1 is greedy
    assert sample.generate_windowed(smelt, torch.tensor([ids]), 0).shape == (1, 0)


def test_sampling_fewer_passes_than_trained_leaves_the_mode_as_found():
    untied = make_model(layout="pcc_untied", n_layer=3, n_passes=2).train()
    assert sample.sample_texts(untied, TOK, max_new_tokens=4, n_passes=1) and untied.training


def test_cli_prints_separated_seeded_samples(smelt, tmp_path, capsys):
    ckpt = save_checkpoint(smelt, tmp_path / "ckpt.pt")
    args = ["--ckpt", ckpt, "--start", "ROMEO:", "--num_samples", "2", "--max_new_tokens", "40"]
    assert sample.main(args) == 0
    out = capsys.readouterr().out
    expected = sample.sample_texts(smelt, TOK, "ROMEO:", 2, 40, 0.8, 200, seed=1337)
    assert out == "".join(text + "\n" + sample.SEPARATOR + "\n" for text in expected)
    assert len(set(expected)) == 2 and all(t.startswith("ROMEO:") and len(t) > 6 for t in expected)
    sample.main(args + ["--seed", "1"])  # another seed, other samples
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
    plain = ["--ckpt", f"{tmp_path}/plain.pt"]
    for args, needle in [(["--ckpt", f"{tmp_path}/nope.pt"], "nope.pt"),
                         (plain + ["--n_passes", "2"], "nothing to loop"),
                         (["--ckpt", f"{tmp_path}/untied.pt", "--n_passes", "3"], "runs 1 to 2 passes"),
                         (plain + ["--start", f"FILE:{tmp_path}/missing.txt"], "missing"),
                         (plain + ["--start", f"FILE:{tmp_path}/latin1.txt"], "utf-8"),
                         (plain + ["--device", "nonsense"], "nonsense"),
                         (plain + ["--export", f"{tmp_path}/taken"], "exists"),
                         (["--num_samples", "x"], "--num_samples")]:
        assert needle in error_line(sample.main, args + ["--max_new_tokens", "4"], capsys, "sample.py"), args


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    pytest.importorskip("safetensors")
    root, out = tmp_path_factory.mktemp("export"), {}
    for name, overrides in (("moe", dict(layout="smelt", n_passes=2, n_expert=4, top_k=2)), ("tied", {})):
        model = make_model(**overrides)  # init="nanogpt" ties the lm head to wte
        ckpt = save_checkpoint(model, root / f"{name}.pt", step=120)
        assert sample.main(["--ckpt", ckpt, "--export", str(root / name)]) == 0
        out[name] = (ckpt, str(root / name), model)
    return out


@pytest.mark.parametrize("name", ["moe", "tied"])
def test_export_round_trip_gives_the_same_logits_and_stores_a_tied_weight_once(exported, name):
    from safetensors import safe_open
    from safetensors.torch import load_model
    from model import GPT, ModelConfig, load_checkpoint
    _, folder, model = exported[name]
    loaded, info = load_checkpoint(folder)
    idx = torch.randint(0, 4096, (2, 30), generator=torch.Generator().manual_seed(1))
    for n_passes in (None, 1, 3):
        with torch.no_grad():
            assert torch.equal(model(idx, n_passes=n_passes)[0], loaded(idx, n_passes=n_passes)[0])
    assert info == {"model_config": json.loads(json.dumps(dataclasses.asdict(model.config))),
                    "tokenizer": "gpt2-4096", "step": 120}
    assert sorted(os.listdir(folder)) == ["README.md", "config.json", "model.safetensors"]
    weights = os.path.join(folder, "model.safetensors")
    with safe_open(weights, framework="pt") as f:  # the tied weight stored once ...
        assert len({"lm_head.weight", "wte.weight"} & set(f.keys())) == 1
    plain = GPT(ModelConfig(**info["model_config"]))  # ... the ecosystem's own loader restores the tie
    load_model(plain, weights)
    assert plain.lm_head.weight is plain.wte.weight
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), model.state_dict().values()))


def test_every_tool_reads_the_export_as_it_reads_the_checkpoint(exported, tmp_path, capsys):
    import eval_core
    import probe
    from data.prepare import prepare
    (tmp_path / "c.txt").write_text("\n<|endoftext|>\n".join(f"ROMEO: what light {i}" for i in range(6)))
    data = prepare([str(tmp_path / "c.txt")], str(tmp_path / "data"), val_fraction=0.5, seed=0, verbose=False)
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

    def full_disk(model, path):
        open(path, "wb").write(b"partial")
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(safetensors.torch, "save_model", full_disk)
    with pytest.raises(OSError, match="No space left"):
        sample.main(["--ckpt", exported["moe"][0], "--export", str(tmp_path / "out")])
    assert os.listdir(tmp_path) == []  # neither the export nor its temporary folder
