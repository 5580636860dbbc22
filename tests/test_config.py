"""Every named config describes one model, whichever tool reads it: train.py (its settings, tiny model
defaults underneath) and tooling.match_cli.read_config (match.py, grow.py, tooling/memory.py; ModelConfig's defaults
underneath) must agree on what executes and on every count. Fields a layout ignores (n_passes of a plain
model, top_k of a dense one) may differ."""
import glob
import os

import pytest

import match
from tooling import match_cli
import train
from model import execution_plan
from tooling.settings import read_config_file

# every run's config; config/_x_d8.py is the part the six x_d8 configs share (they include it), not a run
CONFIGS = sorted(glob.glob(os.path.join(os.path.dirname(os.path.dirname(__file__)), "config", "[!_]*.py")))


def test_a_config_includes_another_and_overrides_it(tmp_path):
    (tmp_path / "base.py").write_text("n_layer = 8\nn_embd = 64\n")
    (tmp_path / "run.py").write_text('include("base.py")\nn_embd = 32\n')
    assert read_config_file(str(tmp_path / "run.py")) == {"n_layer": 8, "n_embd": 32}
    (tmp_path / "a.py").write_text('include("b.py")\n')
    (tmp_path / "b.py").write_text('include("a.py")\n')
    with pytest.raises(ValueError, match="which includes it back"):
        read_config_file(str(tmp_path / "a.py"))
    loop_grow = read_config_file(os.path.join(os.path.dirname(CONFIGS[0]), "x_d8_loop_grow.py"))
    assert (loop_grow["n_passes"], loop_grow["grow_to"], loop_grow["block_size"]) == (2, 4, 2048)  # two levels


def test_there_are_named_configs():
    names = {os.path.basename(p) for p in CONFIGS}
    assert {"smelt_200m_base.py", "smelt_200m_s95.py", "x_d8_vanilla.py", "x_d8_operator1.py",
            "x_d8_loop2.py", "x_d8_untied2.py", "x_d8_loop_grow.py", "x_d8_untied_grow.py"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_train_and_from_file_read_the_same_model(path):
    via_train = train.SETTINGS.build(train.ModelConfig, train.SETTINGS.resolve(read_config_file(path)))
    via_file, _ = match_cli.read_config(path)
    assert execution_plan(via_train) == execution_plan(via_file)
    assert match.accounting(via_train) == match.accounting(via_file)


def settings_of(name):
    values = train.SETTINGS.resolve(train.SETTINGS.parse([os.path.join(os.path.dirname(CONFIGS[0]), name)]))
    return train.SETTINGS.build(train.TrainConfig, values), train.SETTINGS.build(train.ModelConfig, values)


@pytest.mark.parametrize("name", [os.path.basename(p) for p in CONFIGS if "x_d8" in p])
def test_x_configs_train_with_the_x_codes_recipe(name):
    """The optimizer, decay, clipping and attention the [X] code's d8 hyperparameters were tuned with."""
    config, cfg = settings_of(name)
    assert (config.optimizer, config.muon_momentum_warmup) == ("muon_x", 300)
    assert config.weight_decay > 0  # the matrices', the embedding's and the lm head's, as the [X] code
    assert config.grad_clip == 0.0 and config.decay_shape == "linear"
    assert not cfg.document_mask and cfg.vocab_size == 50304  # GPT-2's 50257 padded: the data's n_logits and eot
    assert "n_logits" not in train.SETTINGS.parse([os.path.join(os.path.dirname(CONFIGS[0]), name)])
    from tooling import guards
    for world in (1, 8):  # the [X] code's 524,288 tokens per step (32 x 1 x 8) on any number of GPUs
        guards.derive_grad_accum(config, world)
        assert config.batch_size * config.grad_accum * world * cfg.block_size == 524288
    assert config.final_eval_tokens >= 10_000_000  # its validation size, at least at the last eval


@pytest.mark.parametrize("name", ["smelt_200m_base.py", "smelt_200m_s95.py"])
def test_s_configs_train_with_the_s_recipe(name):
    """[S]: AdamW + WSD, 256 x 4096 tokens per step on any number of GPUs, 196,075 stable steps, six decay
    branches of 10B tokens the held-back data can hold, the segment mask on."""
    from tooling import guards
    config, cfg = settings_of(name)
    assert config.optimizer == "adamw" and config.decay_fraction == 0.0 and config.max_steps == 196075
    for world in (8, 16):
        guards.derive_grad_accum(config, world)
        assert config.batch_size * config.grad_accum * world == 256 and cfg.block_size == 4096
    assert config.save_steps == [10000, 20000, 50000, 100000, 150000] and config.decay_tokens == 10 ** 10
    stable = config.max_steps * 256 * 4096
    assert config.branch_data_fraction * (stable + config.decay_tokens) >= config.decay_tokens
    assert cfg.document_mask and config.parallel == "fsdp_grad_op"  # gathered once per micro-batch, not per visit


def test_the_s_twin_trains_exactly_as_its_baseline():
    """Each [S] config is complete on its own (nanoGPT style), so the recipe is written twice: every training
    setting of the SMELT twin equals its baseline's, so the two read identical token sequences."""
    from dataclasses import asdict
    (base, _), (twin, _) = settings_of("smelt_200m_base.py"), settings_of("smelt_200m_s95.py")
    differ = {k for k, v in asdict(base).items() if asdict(twin)[k] != v} - {"run_name"}
    assert not differ, differ
