"""grow.py: growth of live models and checkpoints, optimizer state, the schedule maths [X8]-[X15]."""

import math
import os
from dataclasses import asdict

import pytest
import torch

import configurator
import grow
from model import GPT, ModelConfig, core_split, execution_plan, load_checkpoint

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_config(**overrides):
    # n_layer 4 -> the [X] split 1/2/1: a two-block core, so copies of multi-block cores are exercised
    base = dict(vocab_size=64, eot_token=63, block_size=16, n_layer=4, n_embd=32, n_head=2, layout="pcc",
                n_passes=2, norms="x", residual_multiplier=0.5, boundary_alpha=0.7) | overrides
    if base["layout"] == "plain":
        base.pop("n_passes")
    return ModelConfig(**base)


def random_model(cfg, seed=0):
    """Seeded noise in every parameter: the [X] init's zeros would hide blocks from the output."""
    torch.manual_seed(seed)
    model = GPT(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model.eval()


def tokens(seed=1, batch=2, length=12, vocab=63):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=g)


@pytest.mark.parametrize("layout, kf", [("pcc", 4), ("smelt", 3)])
def test_growth_of_a_tied_loop_changes_only_the_pass_count(layout, kf):
    model = random_model(cfg := tiny_config(layout=layout, n_passes=2))
    before = {n: (p, p.detach().clone()) for n, p in model.named_parameters()}
    config_before, idx = asdict(model.config), tokens()
    with torch.no_grad():
        expected, ungrown = model(idx, n_passes=kf)[0], model(idx)[0]
    param_map = grow.grow(model, kf)
    assert param_map == {n: n for n in before} and grow.copied_names(param_map) == []
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    assert all(after[n] is obj and torch.equal(obj, value) for n, (obj, value) in before.items())
    changed = {k for k, v in asdict(model.config).items() if v != config_before[k]}
    assert changed == {"n_passes"} and model.config.n_passes == kf
    assert cfg.n_passes == 2  # the caller's ModelConfig is not mutated
    assert model.plan == execution_plan(model.config, kf)
    with torch.no_grad():
        grown = model(idx)[0]
    assert torch.equal(grown, expected) and not torch.allclose(grown, ungrown)


def hand_built(cfg_dict, blocks_from, source_model):
    """A fresh GPT whose block i holds the weights of source_model.blocks[blocks_from[i]]."""
    model, state, new_state = GPT(ModelConfig(**cfg_dict)), source_model.state_dict(), {}
    for name in model.state_dict():
        _, i, rest = name.split(".", 2) if name.startswith("blocks.") else (0, -1, 0)
        new_state[name] = state[f"blocks.{blocks_from[int(i)]}.{rest}" if i != -1 else name]
    model.load_state_dict(new_state)
    return model.eval()


@pytest.mark.parametrize("k0,kf,schedule", [(2, 4, [0, 1, 0, 1]), (2, 3, [0, 1, 0]), (1, 3, [0, 0, 0])])
def test_untied_growth_copies_cores_depthwise(k0, kf, schedule):
    model = random_model(cfg := tiny_config(n_passes=k0, layout="pcc_untied"))
    P, C, D = core_split(cfg.n_layer)
    old_objects = dict(model.named_parameters())
    old = {n: p.detach().clone() for n, p in old_objects.items()}
    old_blocks, idx = list(model.blocks), tokens()
    with torch.no_grad():
        ungrown = model(idx)[0]
    # built by hand: prelude, cores in the [X] order j % K0, coda
    core = [P + s * C + j for s in schedule for j in range(C)]
    blocks_from = [*range(P), *core, *range(P + k0 * C, P + k0 * C + D)]
    reference = hand_built({**asdict(cfg), "n_passes": kf}, blocks_from, model)

    param_map = grow.grow(model, kf)
    assert model.config.n_passes == kf and not model.config.tie_core
    assert len(model.blocks) == P + kf * C + D == len(blocks_from)
    assert model.plan == execution_plan(model.config)
    after, copies = dict(model.named_parameters()), set(grow.copied_names(param_map))
    assert list(param_map) == list(after)  # every parameter, in named_parameters order
    assert len(copies) == (kf - k0) * C * len(list(old_blocks[P].parameters()))
    for name, source in param_map.items():
        # each equals its source; originals are the same objects (optimizer references stay valid)
        assert torch.equal(after[name], old[source]), name
        assert (after[name] is old_objects[source]) == (name not in copies)
    blocks = list(model.blocks)
    assert blocks[:P] == old_blocks[:P] and blocks[P + kf * C:] == old_blocks[P + k0 * C:]  # coda moved
    with torch.no_grad():
        grown = model(idx)[0]
    assert torch.equal(grown, reference(idx)[0]) and not torch.allclose(grown, ungrown)


def test_untie_then_grow_from_a_tied_model():
    cfg = tiny_config(n_passes=2, layout="pcc")
    model, idx = random_model(cfg), tokens()
    with torch.no_grad():
        tied_out, tied_out_4 = model(idx)[0], model(idx, n_passes=4)[0]
    untied_only = random_model(cfg)  # the same seed: the same weights
    param_map = grow.grow(untied_only, 2, untie=True)  # untie alone: same function, 2 stored cores
    assert not untied_only.config.tie_core and len(untied_only.blocks) == 1 + 2 * 2 + 1
    assert len(grow.copied_names(param_map)) == 2 * 7  # one copy of the 2-block core (7 matrices each)
    param_map = grow.grow(model, 4, untie=True)  # untie and grow: 4 copies of the single tied core
    for name, source in param_map.items():
        i = int(name.split(".")[1]) if name.startswith("blocks.") else -1
        assert not 1 <= i < 1 + 4 * 2 or source.startswith(f"blocks.{1 + (i - 1) % 2}.")
    with torch.no_grad():  # the same functions as the tied model at K=2 and, unrolled, at K=4
        assert torch.equal(untied_only(idx)[0], tied_out) and torch.equal(model(idx)[0], tied_out_4)


def test_deep_vanilla_growth_of_a_plain_transformer():
    cfg = tiny_config(layout="plain", n_layer=5)
    model, idx = random_model(cfg), tokens()
    names_before = [n for n, _ in model.named_parameters()]
    with torch.no_grad():
        plain_out = model(idx)[0]
    # the same blocks read as pcc_untied with boundary "none" and K=1 compute the same function
    as_pcc = hand_built(asdict(cfg) | dict(layout="pcc_untied", n_passes=1, boundary="none"), range(5), model)
    param_map, c = grow.grow(model, 2), model.config
    assert (c.layout, c.boundary, c.n_passes, core_split(5)) == ("pcc_untied", "none", 2, (1, 2, 2))
    reference = hand_built(asdict(c), [0, 1, 2, 1, 2, 3, 4], as_pcc)
    with torch.no_grad():
        assert torch.equal(as_pcc(idx)[0], plain_out) and torch.equal(model(idx)[0], reference(idx)[0])
    assert set(param_map.values()) == set(names_before)


@pytest.mark.parametrize("overrides, n_passes, untie", [  # Loop-Grow, untie alone, untie and grow
    (dict(), 4, False), (dict(), 2, True), (dict(), 3, True),
    (dict(layout="pcc_untied"), 4, False), (dict(layout="plain", n_layer=5), 2, False),
    (dict(layout="smelt", n_passes=2), 3, False), (dict(layout="layer_loop", n_passes=2), 4, False)])
def test_grown_config_is_what_growth_leaves(overrides, n_passes, untie):
    cfg = tiny_config(**overrides)
    grow.grow(model := GPT(cfg), n_passes, untie)
    planned = grow.grown_config(cfg, n_passes, untie)
    assert planned == model.config
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in GPT(planned).parameters())


def test_growth_errors_are_clear():
    for cfg, n_passes in ((tiny_config(n_passes=3), 2), (tiny_config(n_passes=3), 3),
                          (tiny_config(layout="smelt", n_passes=2), 1)):
        with pytest.raises(ValueError, match=f"cannot grow {cfg.n_passes} passes to {n_passes}"):
            grow.grow(GPT(cfg), n_passes)
    assert grow.growth_step(1000, 0.82) == 820 and grow.growth_step(1000, 500) == 500
    with pytest.raises(ValueError, match="grow_at"):
        grow.growth_step(1000, 2000)


def test_copy_optimizer_state_fresh_and_source():
    model = random_model(tiny_config(n_passes=2, layout="pcc_untied"))
    state = {n: {"step": torch.tensor(5.0), "exp_avg": torch.full_like(p, i)}
             for i, (n, p) in enumerate(model.named_parameters())}
    param_map = grow.grow(model, 4)
    copies = set(grow.copied_names(param_map))
    fresh = grow.copy_optimizer_state(state, param_map)
    assert set(fresh) == set(param_map) - copies
    assert all(fresh[name] is state[param_map[name]] for name in fresh)  # originals keep theirs, renamed
    sourced = grow.copy_optimizer_state(state, param_map, copies="source")
    assert set(sourced) == set(param_map)
    for name in copies:
        src = state[param_map[name]]["exp_avg"]
        assert torch.equal(sourced[name]["exp_avg"], src) and sourced[name]["exp_avg"] is not src


@pytest.mark.parametrize("layout", ["pcc", "pcc_untied"])
def test_training_continues_after_growth(layout):
    torch.manual_seed(0)
    model = GPT(tiny_config(n_passes=1, layout=layout, n_embd=32, init="x", uniform_init_scale=1.0,
                            embed_init_std=0.5, residual_multiplier=1.0, boundary_alpha=1.0))
    x = torch.randint(0, 63, (2, 16), generator=torch.Generator().manual_seed(3))
    y = torch.roll(x, -1, dims=1)

    def train(model, optimizer, steps):
        losses = []
        for _ in range(steps):
            optimizer.zero_grad(set_to_none=True)
            (loss := model(x, y)[1]).backward()
            optimizer.step()
            losses.append(loss.item())
        return losses

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    before = train(model, optimizer, 10)
    names = {id(p): n for n, p in model.named_parameters()}
    state = {names[id(p)]: s for p, s in optimizer.state.items()}
    with torch.no_grad():
        loss_at_growth = model(x, y)[1].item()
    param_map = grow.grow(model, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    params = dict(model.named_parameters())
    for name, s in grow.copy_optimizer_state(state, param_map).items():
        optimizer.state[params[name]] = s
    after = train(model, optimizer, 10)
    assert all(math.isfinite(v) for v in before + after) and before[-1] < before[0]
    assert sum(after[-3:]) / 3 < min(after[0], loss_at_growth)  # still learning after the switch


def test_cli_grows_a_checkpoint_and_remaps_optimizer_state(tmp_path, capsys):
    model = random_model(cfg := tiny_config(n_passes=2, layout="pcc_untied"))
    state = {n: dict(step=torch.tensor(3.0), exp_avg=torch.ones_like(p)) for n, p in model.named_parameters()}
    names = list(state)
    ckpt = {"model_config": cfg.to_dict(), "model": model.state_dict(), "state": {"step": 7, "tokens": 123},
            "config": {"n_passes": 2}, "tokenizer": "gpt2-64",
            "optimizers": {"state": state, "param_groups": [dict(lr=0.1, params=names, param_names=names)]}}
    src, dst = str(tmp_path / "in.pt"), str(tmp_path / "out.pt")
    torch.save(ckpt, src)
    grow.main(["--ckpt", src, "--passes", "4", "--out", dst])
    grown, out = load_checkpoint(dst)
    assert (grown.config.n_passes, len(grown.blocks), out["config"]["n_passes"]) == (4, 1 + 4 * 2 + 1, 4)
    assert out["state"] == {"step": 7, "tokens": 123, "grown": True}
    opt, grown_names = out["optimizers"], [n for n, _ in grown.named_parameters()]
    assert sorted(opt["param_groups"][0]["params"]) == sorted(grown_names)
    param_map = grow.grow(model, 4)
    assert set(opt["state"]) == set(grown_names) - set(grow.copied_names(param_map))
    with torch.no_grad():  # the same function as growing the live model
        assert torch.equal(grown(tokens())[0], model(tokens())[0])
    with pytest.raises(SystemExit):  # fewer passes: one line, status 2
        grow.main(["--ckpt", dst, "--passes", "2", "--out", dst])
    assert "cannot grow 4 passes to 2" in capsys.readouterr().err




def test_x15_inverts_x9_and_x14_and_tends_to_its_limit():
    assert round(grow.growth_fraction_limit(0.902), 3) == 0.217  # Loop-Grow
    assert round(grow.growth_fraction_limit(0.883), 3) == 0.265  # Untied-Grow
    for a, b in grow.AFFINE_LAW.values():
        # the limit when b << a TPP and E_4/E_2 = 3/2
        assert grow.optimal_growth_fraction(1e9, a, b, 1.5) == pytest.approx(grow.growth_fraction_limit(a))
        for tpp_k2 in (5.0, 7.0, 8.0, 30.0):
            rho = grow.optimal_growth_fraction(tpp_k2, a, b, 1.4)
            # at rho*, [X14]'s TPP of the grown run equals the affine law [X9]
            assert 0 < rho < 1 and grow.grown_tpp(tpp_k2, rho, 1.4) == pytest.approx(a * tpp_k2 + b)


def test_param_counts_agree_with_the_model():
    for cfg in (tiny_config(n_passes=2), tiny_config(n_passes=3, layout="pcc_untied"),
                tiny_config(layout="plain"), tiny_config(n_expert=4, top_k=2)):
        model = GPT(cfg)
        # N_c: every executed block (counted per execution) + the lm head matrix, no input embedding
        per_block = {i: sum(p.numel() for p in b.parameters()) for i, b in enumerate(model.blocks)}
        if cfg.n_expert:
            f = model.blocks[0].ffn
            inactive = (cfg.n_expert - cfg.top_k) * (f.w_gate_up[0].numel() + f.w_down[0].numel())
            per_block = {i: n - inactive for i, n in per_block.items()}
        executed = sum(per_block[s.block] for s in model.plan if s.kind == "block")
        assert grow.compute_active_params(cfg) == executed + model.lm_head.weight.numel()


def test_x13_x14_against_a_token_weighted_run():
    """Simulate a 2 -> 4 grown run step by step and compare with the closed forms [X13], [X14]."""
    cfg = tiny_config(n_passes=2, layout="pcc")
    n_c, n_s2 = {k: grow.compute_active_params(cfg, k) for k in (1, 2, 4)}, grow.stored_params(cfg)
    steps, tokens_per_step = 1000, 4096
    tokens = steps * tokens_per_step
    for rho in (0.0, 0.18, 0.29, 0.5, 1.0):
        passes = [2 if s < round((1 - rho) * steps) else 4 for s in range(steps)]
        flops = sum(6 * tokens_per_step * n_c[k] for k in passes)
        assert grow.mean_passes(rho) == pytest.approx(sum(passes) / steps)
        assert grow.grown_training_flops(tokens, rho, n_c[2], n_c[4]) == pytest.approx(flops)
        assert grow.grown_tokens_for_budget(flops, rho, n_c[2], n_c[4]) == pytest.approx(tokens)
        # [X14] a fixed K=2 run with the same compute sees tokens_k2; both TPPs over N_s,2
        tokens_k2 = flops / (6 * n_c[2])
        e2, e4 = n_c[2] / n_c[1], n_c[4] / n_c[1]
        e_rho = (flops / (6 * tokens)) / n_c[1]  # token-weighted E_K_rho, directly
        assert grow.grown_expansion(rho, e4 / e2) == pytest.approx(e_rho / e2)
        assert grow.grown_tpp(tokens_k2 / n_s2, rho, e4 / e2) == pytest.approx(tokens / n_s2)
        assert grow.tokens_per_param(tokens, n_s2) == tokens / n_s2


def test_x10_x11_x12_relations():
    tied, untied = tiny_config(n_passes=1, layout="pcc"), tiny_config(n_passes=1, layout="pcc_untied")
    assert grow.storage_ratio(tied, 4) == 1.0 < grow.storage_ratio(untied, 4)
    assert grow.expansion_ratio(tied, 4) == pytest.approx(grow.expansion_ratio(untied, 4))
    # [X11]: TPP_K from first principles: same compute, D_K = D_1 / E_K, over N_s,K
    n_s1, d1 = grow.stored_params(untied), 1e6
    e4, s4 = grow.expansion_ratio(untied, 4), grow.storage_ratio(untied, 4)
    assert grow.tpp_at_passes(d1 / n_s1, e4, s4) == pytest.approx((d1 / e4) / grow.stored_params(untied, 4))
    assert grow.optimal_tpp(10) == pytest.approx(1.19 * 10 ** 0.85)
    assert grow.optimal_tpp(10, tied=False) == pytest.approx(1.34 * 10 ** 0.74)
    assert grow.optimal_expansion(10, tied=False) == pytest.approx(0.83 * 10 ** 0.15)


@pytest.mark.parametrize("name,tpp_ref,rho", [("loop_grow", 7, 0.18), ("untied_grow", 8, 0.29)])
def test_x_d8_grow_configs_follow_x13_x14(name, tpp_ref, rho):
    """The [X] code's d8 step counts (2563 Loop-Grow, 3341 Untied-Grow) follow Table 9's recipe."""
    path = os.path.join(REPO, "config", f"x_d8_{name}.py")
    settings = configurator.read_config(path)
    model_keys = ModelConfig.__dataclass_fields__.keys() & settings
    cfg = ModelConfig(vocab_size=50304, **{k: settings[k] for k in model_keys})
    assert (*core_split(cfg.n_layer), cfg.n_passes, cfg.n_embd) == (2, 3, 3, 2, 1024)
    assert settings["grow_at"] == pytest.approx(1 - rho)  # growth doubles the passes: 2 -> 4
    assert settings["global_batch"] * cfg.block_size == 524288  # tokens per step
    assert round(grow.grown_run_tokens(cfg, tpp_ref, rho) / 524288) == settings["max_steps"]
    # and the [X] d8 crossover is the [X15] optimum at that reference TPP, to the 2 decimals the code uses
    e_ratio = grow.compute_active_params(cfg, 4) / grow.compute_active_params(cfg)
    assert round(grow.optimal_growth_fraction(tpp_ref, *grow.AFFINE_LAW[name], e_ratio), 2) == rho
    grow.main(["--schedule", path])


@pytest.mark.parametrize("layout", ["pcc_untied", "pcc"])
def test_sharded_growth_copies_what_growing_the_whole_model_copies(layout):
    """train.grow_model under FSDP2 copies each rank's shards: after a step of AdamW, the same weights,
    optimizer state and logits as growing the whole model."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict, set_model_state_dict)
    import train
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # conftest ends it
    cfg = ModelConfig(vocab_size=64, block_size=16, n_layer=3, n_embd=32, n_head=2, layout=layout, n_passes=1)
    config = train.TrainConfig(optimizer="adamw", parallel="fsdp")
    full, cpu = StateDictOptions(full_state_dict=True), torch.device("cpu")
    torch.manual_seed(0)
    models = [GPT(cfg), train.build_model(cfg, config, False, cpu, True)]
    set_model_state_dict(models[1], models[0].state_dict(), options=full)
    idx, grown = torch.randint(0, 64, (2, 16)), []
    for model, sharded in zip(models, (False, True)):
        optimizers = train.build_optimizers(model, config, False)
        model(idx, idx)[1].backward()
        for opt in optimizers:
            opt.step()
        grown.append(train.grow_model(model, optimizers, config, False, cpu, sharded))
    (whole, whole_opt), (shard, shard_opt) = grown
    assert shard.config == whole.config and whole.config.n_passes == 2
    weights = get_model_state_dict(shard, options=full)
    assert weights.keys() == whole.state_dict().keys()
    assert all(torch.equal(weights[k], v) for k, v in whole.state_dict().items())
    state = [get_optimizer_state_dict(m, o, options=full)["state"] for m, o in grown]
    assert state[0].keys() == state[1].keys()
    assert all(torch.equal(torch.as_tensor(state[0][n][k]), torch.as_tensor(v)) for n in state[1]
               for k, v in state[1][n].items())
    with torch.no_grad():
        assert torch.equal(shard(idx)[0], whole(idx)[0])
