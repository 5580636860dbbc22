"""Tests for sample.py: seeded sampling, greedy = argmax, windows past block_size, test-time passes, CLI."""
import re

import pytest
import torch

import sample
from conftest import model_whose_blocks_matter
from data.tokenizer import get_tokenizer

SMALL = dict(vocab_size=4096, eot_token=4095, block_size=32, n_layer=2, n_embd=32, n_head=2, init="nanogpt")
# init="nanogpt": the default "x" init zeroes the lm head, every logit would be equal


def make_model(**overrides):
    return model_whose_blocks_matter(**(SMALL | overrides))


def save_checkpoint(model, path, tokenizer="gpt2-4096"):
    from tooling.checkpoint import plain_config, save_file
    ckpt = {"model_config": plain_config(model.config), "model": model.state_dict()}
    if tokenizer is not None:
        ckpt["tokenizer"] = tokenizer
    save_file(str(path), ckpt)
    return str(path)


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
    assert sample.sample_text(smelt, tok, "ROMEO:", 20, 1.0, 200, seed=1) == first[0]


def test_top_k_1_is_greedy(smelt, tok):
    ids = [smelt.config.eot_token] + tok.encode("ROMEO:")
    sampled = sample.generate_windowed(smelt, torch.tensor([ids]), 12, temperature=1.0, top_k=1,
                                       generator=torch.Generator().manual_seed(0))
    assert sampled[0].tolist() == greedy(smelt, ids, 12)


@pytest.mark.parametrize("overrides", [dict(layout="smelt", n_passes=2), dict(layout="plain"),
                                       dict(layout="pcc", n_layer=3, n_passes=2, tie_core=False)])
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
    text = sample.sample_text(smelt, tok, "ROMEO:", max_new_tokens=100, seed=0)
    assert text.startswith("ROMEO:") and len(tok.encode(text)) > 60


def test_n_passes_changes_a_looped_model(tok):
    for model, trained in [(make_model(layout="smelt", n_passes=2), 2),
                           (make_model(layout="pcc", n_layer=3, n_passes=2), 2)]:
        ids = [model.config.eot_token] + tok.encode("ROMEO:")
        default = greedy(model, ids, 16)
        assert greedy(model, ids, 16, n_passes=trained) == default
        for k in (1, 3):
            other = greedy(model, ids, 16, n_passes=k)
            assert other != default and other == greedy_reference(model, ids, 16, n_passes=k)


def test_n_passes_errors(tok):
    plain = make_model(layout="plain")
    with pytest.raises(ValueError, match="layout 'plain', nothing to loop"):
        sample.sample_text(plain, tok, max_new_tokens=4, n_passes=2)
    untied = make_model(layout="pcc", n_layer=3, n_passes=2, tie_core=False)
    with pytest.raises(ValueError, match="untied model has 2 cores, one per trained pass, so it runs at most 2 passes"):
        sample.sample_text(untied, tok, max_new_tokens=4, n_passes=3)
    assert sample.sample_text(untied, tok, max_new_tokens=4, n_passes=1)  # fewer passes than trained is fine
    with pytest.raises(ValueError, match="n_passes must be >= 1"):
        sample.sample_text(untied, tok, max_new_tokens=4, n_passes=0)


def test_sample_text_restores_training_mode(tok):
    model = make_model(layout="smelt", n_passes=2).train()
    sample.sample_text(model, tok, max_new_tokens=4)
    assert model.training
    model.eval()
    sample.sample_text(model, tok, max_new_tokens=4)
    assert not model.training


def test_tokenizer_must_fit_the_model(smelt):
    with pytest.raises(ValueError, match="more than the model's vocab_size=4096"):
        sample.sample_text(smelt, get_tokenizer("gpt2"), max_new_tokens=2)
    with pytest.raises(ValueError, match="the model's eot_token is 4095"):
        sample.sample_text(smelt, get_tokenizer("gpt2-512"), max_new_tokens=2)


# -----------------------------------------------------------------------------
# command line

def run_cli(capsys, *args):
    try:
        rc = sample.main(list(args))
    except SystemExit as e:  # argparse's own refusals (a flag's range)
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_prints_separated_seeded_samples(smelt, tok, tmp_path, capsys):
    ckpt = save_checkpoint(smelt, tmp_path / "ckpt.pt")
    args = ["--ckpt", ckpt, "--start", "ROMEO:", "--num_samples", "2", "--max_new_tokens", "40",
            "--temperature", "0.8", "--top_k", "200", "--seed", "1337", "--device", "cpu"]
    rc, out, err = run_cli(capsys, *args)
    assert rc == 0 and err == ""
    expected = sample.sample_texts(smelt, tok, "ROMEO:", 2, 40, 0.8, 200, seed=1337)
    assert out == "".join(text + "\n" + sample.SEPARATOR + "\n" for text in expected)
    assert run_cli(capsys, *args)[1] == out
    assert run_cli(capsys, *args[:-4], "--seed", "1")[1] != out


def test_cli_prompt_from_file_and_empty_start(smelt, tmp_path, capsys):
    ckpt = save_checkpoint(smelt, tmp_path / "ckpt.pt")
    prompt = "ROMEO:\nBut soft, what light through yonder window breaks?\n"
    (tmp_path / "prompt.txt").write_text(prompt, encoding="utf-8")
    common = ["--ckpt", ckpt, "--num_samples", "1", "--max_new_tokens", "10", "--temperature", "0"]
    rc, from_file, _ = run_cli(capsys, *common, "--start", f"FILE:{tmp_path / 'prompt.txt'}")
    assert rc == 0 and from_file.startswith(prompt)
    assert run_cli(capsys, *common, "--start", prompt)[1] == from_file
    rc, empty, _ = run_cli(capsys, *common, "--start", "")
    assert rc == 0 and empty.endswith(sample.SEPARATOR + "\n") and len(empty) > len(sample.SEPARATOR) + 1
    assert run_cli(capsys, *common)[1] == empty  # the default start is ""


def test_cli_without_tokenizer_in_checkpoint(smelt, tmp_path, capsys):
    ckpt = save_checkpoint(smelt, tmp_path / "ckpt.pt", tokenizer=None)
    rc, out, err = run_cli(capsys, "--ckpt", ckpt, "--max_new_tokens", "4")
    assert rc == 2 and out == "" and "pass --tokenizer" in err
    rc, out, _ = run_cli(capsys, "--ckpt", ckpt, "--max_new_tokens", "4", "--tokenizer", "gpt2-4096")
    assert rc == 0 and out.count(sample.SEPARATOR) == 3


@pytest.mark.parametrize("args,message", [
    (["--num_samples", "0"], "argument --num_samples: 0: must be >= 1"),
    (["--temperature", "-0.5"], "argument --temperature: -0.5: must be >= 0"),
    (["--top_k", "0"], "argument --top_k: 0: must be >= 1"),
    (["--n_passes", "0"], "argument --n_passes: 0: must be >= 1"),
    (["--max_new_tokens", "-1"], "argument --max_new_tokens: -1: must be >= 0"),
    (["--start", "FILE:{tmp}/missing.txt"], "cannot read prompt file .*missing.txt: No such file"),
    (["--start", "FILE:{tmp}/latin1.txt"], "latin1.txt is not UTF-8"),
    (["--ckpt", "{tmp}/nope.pt"], "checkpoint not found: .*nope.pt"),
    (["--ckpt", "{tmp}/garbage.pt"], "cannot read checkpoint .*garbage.pt"),
    (["--ckpt", "{tmp}/plain.pt", "--n_passes", "2"], "layout 'plain', nothing to loop"),
    (["--ckpt", "{tmp}/untied.pt", "--n_passes", "3"], "at most 2 passes"),
    (["--tokenizer", "bert"], "unknown tokenizer 'bert'"),
    (["--device", "nonsense"], "unknown device 'nonsense'"),
])
def test_cli_errors_are_one_line_exit_2(tmp_path, capsys, args, message):
    save_checkpoint(make_model(layout="smelt", n_passes=2), tmp_path / "smelt.pt")
    save_checkpoint(make_model(layout="plain"), tmp_path / "plain.pt")
    save_checkpoint(make_model(layout="pcc", n_layer=3, n_passes=2, tie_core=False), tmp_path / "untied.pt")
    (tmp_path / "garbage.pt").write_bytes(b"not a checkpoint")
    (tmp_path / "latin1.txt").write_bytes("Roméo".encode("latin-1"))
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    rc, out, err = run_cli(capsys, "--ckpt", str(tmp_path / "smelt.pt"), "--max_new_tokens", "4", *args)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("sample.py: error: ")
    assert re.search(message, err), err

