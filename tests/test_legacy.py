"""A checkpoint of the release before the settings were folded (n_loops, the prelude/core/coda split, model
constants as settings, [X16]'s N in the state) loads, resumes and forks as it is; one whose model this
release cannot build is refused in one line (tooling/legacy.py)."""
import pytest
import torch

import train
from model import GPT, ModelConfig
from tooling import checkpoint

OLD_FIELDS = dict(rope_base=10000.0, norm_eps=1e-6, router_renormalize=True, balance_loss_coef=0.01,
                  z_loss_coef=0.001, inject_before_coda=True)


def old_checkpoint(path, cfg, **old):
    """A training checkpoint of cfg's model written as the previous release wrote it."""
    torch.manual_seed(0)
    model = GPT(cfg)
    config = train.TrainConfig(max_steps=1)
    ckpt = checkpoint.training_checkpoint(model, train.build_optimizers(model, config), config,
                                          train.TrainState(step=1))
    stored = {k: v for k, v in ckpt["model_config"].items() if k != "n_passes" or cfg.layout == "pcc"}
    split = dict(n_prelude=cfg.n_prelude, n_core=cfg.n_core, n_coda=cfg.n_coda) if cfg.layout == "pcc" else \
        dict(n_prelude=-1, n_core=-1, n_coda=-1)
    loops = dict(n_loops=cfg.n_passes) if cfg.layout in ("smelt", "layer_loop") else dict(n_loops=1)
    ckpt["model_config"] = stored | OLD_FIELDS | split | loops | old
    ckpt["state"]["lr_scaling_params"] = 12345
    checkpoint.save_file(str(path), ckpt)
    return model


@pytest.mark.parametrize("layout", [dict(layout="smelt", n_passes=3, n_expert=4, top_k=2),
                                    dict(layout="pcc", n_layer=5, n_passes=2), dict(layout="plain")])
def test_an_old_checkpoint_loads_as_the_same_model(tmp_path, layout):
    cfg = ModelConfig(vocab_size=64, eot_token=63, block_size=16, n_layer=layout.pop("n_layer", 4), n_embd=32,
                      n_head=2, init="nanogpt", **layout)
    model = old_checkpoint(tmp_path / "old.pt", cfg)
    loaded, ckpt = checkpoint.load_model(str(tmp_path / "old.pt"))
    assert loaded.config == cfg and "lr_scaling_params" not in ckpt["state"]
    train.TrainState(**ckpt["state"])  # a resume builds its state from it
    idx = torch.randint(0, 63, (2, 16))
    torch.testing.assert_close(loaded(idx)[0], model(idx)[0])


@pytest.mark.parametrize("old, message", [
    (dict(rope_base=500000.0), "rope_base=500000.0; this release builds only rope_base=10000.0"),
    (dict(n_prelude=1, n_core=2, n_coda=2), "splits 4 blocks 1/2/2; this release builds the [X] even split only"),
])
def test_an_old_model_this_release_cannot_build_is_refused(tmp_path, old, message):
    cfg = ModelConfig(vocab_size=64, eot_token=63, block_size=16, n_layer=4, n_embd=32, n_head=2, layout="pcc",
                      n_passes=2)
    old_checkpoint(tmp_path / "old.pt", cfg, **old)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        checkpoint.load_model(str(tmp_path / "old.pt"))


def test_a_setting_that_went_says_what_to_use(tmp_path):
    from tooling.legacy import WENT
    assert not set(WENT) & set(train.DEFAULTS)  # none of them is a setting again
    with pytest.raises(ValueError, match=r"'grad_accum': it went \(global_batch sets the step"):
        train.SETTINGS.parse(["--grad_accum=2"])
    (tmp_path / "old.py").write_text("n_loops = 2\n")
    with pytest.raises(ValueError, match=r"key in .*old.py 'n_loops': it went \(n_passes is the loop count"):
        train.SETTINGS.parse([str(tmp_path / "old.py")])


def test_the_second_fold_reads_stored_settings_in_this_release():
    """A checkpoint of the release before: muon_variant="x" trains on as optimizer="muon_x", its attention
    field and the switches that went (resume, progress, sample) are dropped, the rest kept."""
    from tooling import legacy
    old = dict(model_config=dict(n_layer=2, attention="sdpa"),
               train_config=dict(optimizer="muon", muon_variant="x", resume=True, progress=False, sample=False,
                                 max_steps=7))
    new = legacy.upgraded_settings(old)
    assert new["model_config"] == dict(n_layer=2)
    assert new["train_config"] == dict(optimizer="muon_x", max_steps=7)
    original = legacy.upgraded_settings(dict(train_config=dict(optimizer="muon", muon_variant="original")))
    assert original["train_config"] == dict(optimizer="muon")
    # the third fold: reshard_after_forward=False is parallel="fsdp_grad_op"; overwrite, collective_timeout_s
    # and decay_branch (a branch's state says it) went
    stored = dict(parallel="fsdp", reshard_after_forward=False, overwrite=True, collective_timeout_s=60.0,
                  decay_branch=True, decay_tokens=512)
    assert legacy.upgraded_settings(dict(train_config=stored))["train_config"] == \
        dict(parallel="fsdp_grad_op", decay_tokens=512)
    resharded = dict(parallel="fsdp", reshard_after_forward=True)
    assert legacy.upgraded_settings(dict(train_config=resharded))["train_config"] == dict(parallel="fsdp")
