"""match.py's memory planner against the real model and shards, autograd, and FSDP2's memory tracker."""

import glob
import itertools
import json
import os
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from test_match import FAMILIES, ROOT, SMALL, make  # the same model families as the accounting tests

import match
from model import GPT, ModelConfig
import model as model_module
from muon import Muon



def is_muon(name, p):
    """train.py's rule, restated: Muon takes every block matrix of 2 or more dims but the routers."""
    return p.dim() >= 2 and not name.startswith(("wte.", "lm_head.")) and ".router." not in name


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_state_bytes_are_the_real_models(name):
    model = GPT(make(name))
    n_params = sum(p.numel() for p in model.parameters())
    assert match.state_bytes_per_rank(model.config, 1, "adamw") == 16 * n_params  # 4 + 4 + 8 bytes
    muon = sum(p.numel() * (12 if is_muon(n, p) else 16) for n, p in model.named_parameters())
    assert match.state_bytes_per_rank(model.config, 1, "muon") == muon


def test_fsdp_states_count_the_fullest_shard_by_hand():
    """One dense block; torch.chunk gives rank 0 of 3 ceil(n / 3) rows: 64 -> 22, 32 -> 11, 256 -> 86."""
    cfg = ModelConfig(**{**SMALL, "n_layer": 1, "mlp_hidden": 256})
    assert (cfg.vocab_size, cfg.n_embd, cfg.mlp_hidden, cfg.tie_embeddings) == (64, 32, 256, True)
    for world, (v, h, f) in {2: (32, 16, 128), 3: (22, 11, 86)}.items():
        matrices = 4 * h * 32 + 2 * f * 32 + h * 256  # q, k, v, o; gate, up (256, 32); down (32, 256)
        adamw = v * 32 + 3 * h  # the tied wte / lm head; norm1, norm2, norm_f gains
        assert match.state_bytes_per_rank(cfg, world, "muon") == 12 * matrices + 16 * adamw
        assert match.state_bytes_per_rank(cfg, world, "adamw") == 16 * (matrices + adamw)


def test_fsdp_states_equal_a_real_fully_sharded_model():
    """Every rank's local weights, gradients and AdamW moments after a step of FSDP2 over 3 fake ranks."""
    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    cfg, world = make("moe", n_layer=2, n_expert=5), 3  # 5 experts, 64 rows, width 32: all uneven
    per_rank = []
    for rank in range(world):
        dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=rank, world_size=world)
        try:
            mesh = init_device_mesh("cpu", (world,))
            torch.manual_seed(0)
            model = GPT(cfg)
            for block in model.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
            opt = torch.optim.AdamW(model.parameters())
            idx = torch.randint(0, cfg.eot_token, (1, 8))
            model(idx, targets=idx)[1].backward()
            opt.step()
            local = [t.to_local() for p in model.parameters() for t in (p, p.grad)]
            local += [v.to_local() for s in opt.state.values() for k, v in s.items() if k != "step"]
            per_rank.append(sum(t.numel() * t.element_size() for t in local))
        finally:
            dist.destroy_process_group()
    assert per_rank[0] == max(per_rank) > per_rank[-1]
    assert match.state_bytes_per_rank(cfg, world, "adamw") == per_rank[0]


ACTIVATION_LAYOUTS = {
    "dense": dict(), "dense_gqa_x": dict(n_kv_head=2, head_dim=24, norms="x"),
    "smelt_moe": dict(n_expert=8, top_k=2, expert_hidden=32, layout="smelt", n_passes=2),
    "pcc_k2": dict(layout="pcc", n_layer=5, n_passes=2),
    "pcc_untied_x": dict(layout="pcc_untied", n_layer=5, n_passes=2, norms="x")}


def measure(layout, autocast=False, checkpointing=False, kernels=False, **extra):
    """A config and the bytes of the distinct storages autograd saves for its backward, parameters and
    buffers aside."""
    cfg = ModelConfig(**{**SMALL, "vocab_size": 96, "block_size": 64, "n_embd": 64, "mlp_hidden": 256,
                         **ACTIVATION_LAYOUTS[layout], **extra})
    torch.manual_seed(0)
    model = GPT(cfg)
    model.activation_checkpointing = checkpointing
    if kernels:
        import kernels as triton_kernels
        from test_kernels import KERNELS  # model.py's classes -> their kernels, as train.py maps them
        triton_kernels.apply(model, KERNELS)
    idx, targets = torch.randint(0, cfg.eot_token, (2, 2, cfg.block_size))
    states = {t.untyped_storage().data_ptr() for t in itertools.chain(model.parameters(), model.buffers())}
    saved = {}

    def pack(t):  # every saved tensor stays referenced by the graph, so no address is reused meanwhile
        if t.untyped_storage().data_ptr() not in states:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        model(idx, targets=targets)
    return cfg, sum(saved.values())


@pytest.mark.parametrize("layout", sorted(ACTIVATION_LAYOUTS))
def test_activation_estimate_matches_what_autograd_saves(layout):
    """fp32: within 1% (the document mask and a few scalars are left out); checkpointed, to a few bytes."""
    cfg, real = measure(layout)
    assert match.activation_bytes(cfg, 2, mixed_precision=False)["saved"] == pytest.approx(real, rel=0.01)
    cfg, real = measure(layout, checkpointing=True)
    assert match.activation_bytes(cfg, 2, False, checkpointing=True)["saved"] == pytest.approx(real, rel=1e-4)


@pytest.mark.parametrize("layout", ["smelt_moe", "pcc_k2"])
def test_activation_estimate_under_bf16_autocast_and_of_the_kernels(layout):
    """bf16 autocast also keeps the weight copies (weight_copy_bytes, booked to DDP): within 2%. The
    Triton kernels (the interpreter on CPU) save less: within 1%."""
    cfg, real = measure(layout, autocast=True)
    estimate = match.activation_bytes(cfg, 2)["saved"] + match.weight_copy_bytes(cfg)
    assert estimate == pytest.approx(real, rel=0.02)
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("the kernels run on CUDA there; this checks the CPU interpreter")
    cfg, real = measure(layout, kernels=True, block_size=16)  # short: the interpreter is slow
    estimate = match.activation_bytes(cfg, 2, mixed_precision=False, kernels=True)["saved"]
    assert estimate == pytest.approx(real, rel=0.01)
    assert estimate < match.activation_bytes(cfg, 2, mixed_precision=False)["saved"]


def test_one_more_executed_block_saves_one_block():
    """per_block is the measured cost of one more visit; checkpointed, a visit keeps its fp32 input."""
    cfg2, real2 = measure("smelt_moe")
    cfg3, real3 = measure("smelt_moe", n_passes=3)  # 2 more visits (loop span 2)
    est = match.activation_bytes(cfg2, 2, mixed_precision=False)
    assert real3 - real2 == pytest.approx(2 * est["per_block"], rel=0.01)
    ckpt2, ckpt3 = (match.activation_bytes(c, 2, False, checkpointing=True) for c in (cfg2, cfg3))
    assert ckpt3["saved"] - ckpt2["saved"] == 2 * est["tokens"] * 4 * cfg2.n_embd
    assert ckpt2["recompute"] == est["per_block"] and ckpt2["total"] < est["total"]


def test_memory_plan_is_consistent():
    base = match.preset_baseline("smelt-200m-s95")
    plan = match.memory_plan(base, world_size=16, micro_batch=2)
    for mode in match.MODES:
        m = plan[mode]
        assert m["total_gb"] == pytest.approx(m["states_gb"] + m["activations_gb"] + m["transient_gb"])
        assert m["fits"] == (m["total_gb"] <= 0.9 * 80) and m["activation_checkpointing"] == (mode != "ddp")
        if m["max_micro_batch"]:  # it fits, one more does not
            assert match.memory_plan(base, 16, m["max_micro_batch"])[mode]["fits"]
        assert not match.memory_plan(base, 16, m["max_micro_batch"] + 1)[mode]["fits"]
    assert plan["ddp"]["states_gb"] * 2 ** 30 == match.state_bytes_per_rank(base, 1)
    assert plan["fsdp"]["states_gb"] == pytest.approx(plan["ddp"]["states_gb"] / 16, rel=0.01)
    assert plan["fsdp"]["total_gb"] < plan["fsdp_grad_op"]["total_gb"]  # every block kept gathered
    assert plan["fsdp"]["all_gather_gb"] > plan["fsdp_grad_op"]["all_gather_gb"]  # but gathered once
    adamw = match.memory_plan(base, 16, 2, optimizer="adamw")["ddp"]
    assert adamw["states_gb"] > plan["ddp"]["states_gb"]  # 16 vs 12 bytes per matrix weight
    big = match.memory_plan(match.preset_baseline("smelt-1.6b-s97"), 16, 1)  # 53.9B params: FSDP only
    assert not big["ddp"]["fits"] and big["fsdp"]["fits"]


def test_cli_memory_table_and_json(capsys):
    match.main([os.path.join(ROOT, "config", "x_d8_vanilla.py"), "--memory", "--world_size", "16", "--json",
                "--vocab_size", "50304"])
    out = json.loads(capsys.readouterr().out)
    assert out["vocab_size"] == 50304 and set(match.MODES) <= set(out["baseline"])
    plan = out["baseline"]
    assert (plan["micro_batch"], plan["world_size"], plan["optimizer"]) == (32, 16, "muon_x")  # the config's
    assert {"states_gb", "activations_gb", "total_gb", "fits", "max_micro_batch"} <= set(plan["fsdp"])
    match.main(["--preset", "smelt-200m-s95", "--memory", "--micro_batch", "1", "--optimizer", "adamw",
                "--gpu_gb", "141"])
    text = capsys.readouterr().out
    assert text.count("memory per GPU (GiB): 8 GPUs x 141 GiB") == 2 and "matched: " in text
    assert "adamw" in text and all(mode in text for mode in match.MODES)


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "config", "[!_]*.py"))),
                         ids=os.path.basename)
def test_every_config_fits_a_node_of_80_gb_gpus(path):
    """At its own micro-batch, optimizer and parallel mode, as built and after growth (grow_at doubles the
    passes), at GPT-2's padded vocabulary, the largest any config uses."""
    cfg, settings, _ = match.read_config(path, vocab_size=50304)
    for shape in [cfg] + ([replace(cfg, n_passes=2 * cfg.n_passes)] if settings.get("grow_at") else []):
        plan = match.memory_plan(shape, 8, settings.get("batch_size", 1), settings.get("optimizer", "muon"))
        mode = settings.get("parallel", "ddp")
        assert plan[mode]["fits"], f"{plan[mode]['total_gb']:.1f} GiB per GPU ({mode})"


def tracked_peak(cfg, world, micro_batch, mode, optimizer, steps=2):
    """Peak bytes of one of `world` FSDP2 ranks as train.py runs it, under torch's FSDPMemTracker (a fake
    process group, FakeTensorMode: shapes without memory)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.testing._internal.distributed.fake_pg import FakeStore
    cfg = replace(cfg, document_mask=False)  # FlexAttention on a GPU keeps no mask; SDPA here none either
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))  # outside FakeTensorMode
        with FakeTensorMode():
            with torch.device("meta"):
                model = GPT(cfg)
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                          cast_forward_inputs=False)
            for block in model.blocks:
                fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=mode == "fsdp")
            fully_shard(model, mesh=mesh)
            model.to_empty(device="cpu")
            model.activation_checkpointing = True
            muon = [p for n, p in model.named_parameters() if is_muon(n, p) and optimizer == "muon"]
            optimizers = [torch.optim.AdamW([p for p in model.parameters() if all(p is not q for q in muon)])]
            optimizers += [Muon(muon, ns_dtype=torch.bfloat16)] if muon else []  # as on CUDA
            tracker = FSDPMemTracker(model, optimizers[-1])
            with tracker:
                for _ in range(steps):
                    idx = torch.randint(0, cfg.vocab_size - 1, (micro_batch, cfg.block_size))
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        loss = model(idx, idx)[1]
                    loss.backward()
                    for opt in optimizers:
                        opt.step()
                        opt.zero_grad(set_to_none=True)
                    tracker.reset_mod_stats()
            peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    finally:
        dist.destroy_process_group()
    return next(v for k, v in peak.items() if getattr(k, "value", k) == "Total")


PCC3 = dict(layout="pcc", n_layer=3, n_passes=2)
SMELT_MOE = dict(layout="smelt", n_passes=2, n_expert=8, top_k=2)


@pytest.mark.parametrize("layout, optimizer, mode, ce_chunk", [
    (PCC3, "muon", "fsdp", None), (PCC3, "muon", "fsdp", 2 ** 16),
    (SMELT_MOE | dict(n_layer=2), "adamw", "fsdp_grad_op", None)])
def test_planner_agrees_with_pytorchs_fsdp_memory_tracker(layout, optimizer, mode, ce_chunk, monkeypatch):
    """At toy size within 10% of the tracker's peak (measured 0.98-0.99; 0.86-1.04 at the configs' sizes)."""
    pytest.importorskip("torch.distributed._tools.fsdp2_mem_tracker")
    if ce_chunk:  # the loss in chunks
        monkeypatch.setattr(model_module, "CE_CHUNK", ce_chunk)
        monkeypatch.setattr(match, "CE_CHUNK", ce_chunk)
    cfg = ModelConfig(vocab_size=512, block_size=256, n_embd=128, n_head=4, **layout)
    planned = match.memory_plan(cfg, 4, 8, optimizer)[mode]["total_gb"] * 2 ** 30
    assert 0.9 <= planned / tracked_peak(cfg, 4, 8, mode, optimizer) <= 1.1


@pytest.mark.parametrize("layout, world", [(PCC3, 1), (SMELT_MOE | dict(n_layer=4), 2)])
def test_the_planner_counts_the_optimizer_step(layout, world):
    """At 16 tokens Muon's step is the peak: states plus optimizer_step_bytes, within 5% of the tracker's."""
    pytest.importorskip("torch.distributed._tools.fsdp2_mem_tracker")
    cfg = ModelConfig(vocab_size=512, block_size=16, n_embd=256, n_head=4, **layout)
    planned = match.memory_plan(cfg, world, 1, "muon")["fsdp"]["total_gb"] * 2 ** 30
    states = match.state_bytes_per_rank(cfg, world)
    assert planned == states + match.optimizer_step_bytes(cfg, world, sharded=True) > states * 1.5
    assert planned / tracked_peak(cfg, world, 1, "fsdp", "muon") == pytest.approx(1.0, abs=0.05)


@pytest.mark.parametrize("room", ["ample", "tight"])
def test_fsdp_recomputes_the_blocks_only_where_the_planner_says_they_do_not_fit(room, monkeypatch):
    """train.shard on a pretended GPU checkpoints only where the plan without it does not fit."""
    import types
    import train
    cfg = ModelConfig(vocab_size=512, block_size=256, n_embd=64, n_head=2, **PCC3)
    plans = (match.memory_plan(cfg, 1, 8, checkpointing=c)["fsdp"] for c in (True, False))
    with_it, without = (plan["total_gb"] for plan in plans)
    assert without > with_it
    gpu_gb = 80 if room == "ample" else (with_it + without) / 2 / (1 - match.HEADROOM)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(
        total_memory=gpu_gb * 2 ** 30))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with torch.device("meta"):
            model = GPT(cfg)
        train.shard(model, train.TrainConfig(parallel="fsdp", batch_size=8), bf16=False)
    finally:
        dist.destroy_process_group()
    assert model.activation_checkpointing == (room == "tight")
