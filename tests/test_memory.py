"""tooling/memory.py: the memory planner against the real model, FSDP2's real shards and what autograd saves."""

import glob
import itertools
import json
import os
import re

import pytest
import torch
from conftest import one_line_error
from test_match import FAMILIES, SMALL, make  # the same model families as the accounting tests

import match
from model import GPT, ModelConfig
from tooling import match_cli, memory

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))




def optimizer_group(name, p):
    """train.param_groups' rule, restated: the embedding, lm head, routers and vectors go to AdamW,
    every other parameter of 2 or more dims to Muon."""
    if name.startswith("wte."):
        return "embedding"
    if name.startswith("lm_head."):
        return "unembedding"
    if ".router." in name:
        return "router"
    return "matrix" if p.dim() >= 2 else "vector"


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_param_shapes_are_the_real_models(name):
    cfg = make(name)
    model = GPT(cfg)
    real = sorted((tuple(p.shape), optimizer_group(n, p)) for n, p in model.named_parameters())
    assert sorted((shape, group) for _, shape, group in match.param_shapes(cfg)) == real
    n_params = sum(p.numel() for p in model.parameters())
    assert memory.state_bytes_per_rank(cfg, 1, "adamw") == 16 * n_params  # 4 weight + 4 grad + 8 moments
    muon = sum(p.numel() * (12 if optimizer_group(n, p) == "matrix" else 16) for n, p in model.named_parameters())
    assert memory.state_bytes_per_rank(cfg, 1, "muon") == muon


def test_fsdp_states_count_the_fullest_shard_by_hand():
    """One dense block, vocab 64, width 32, hidden 256. torch.chunk over 3 ranks: 64 rows -> 22/22/20,
    32 -> 11/11/10, 256 -> 86/86/84; rank 0 holds ceil(n / 3) rows of everything. Over 2 ranks: halves."""
    cfg = ModelConfig(**{**SMALL, "n_layer": 1})
    assert (cfg.vocab_size, cfg.n_embd, cfg.mlp_hidden) == (64, 32, 256)
    for world, (v, h, f) in {2: (32, 16, 128), 3: (22, 11, 86)}.items():
        matrices = 4 * h * 32 + 2 * f * 32 + h * 256  # q, k, v, o; gate, up (256, 32); down (32, 256)
        adamw = 2 * v * 32 + 3 * h  # wte, lm_head; norm1, norm2, norm_f gains
        assert memory.state_bytes_per_rank(cfg, world, "muon") == 12 * matrices + 16 * adamw
        assert memory.state_bytes_per_rank(cfg, world, "adamw") == 16 * (matrices + adamw)
    model = GPT(make("pcc_untied_moe_embed_norm"))  # odd shapes: experts 6, vocab 64, heads 8 over 3 and 5 ranks
    for world in (3, 5):
        chunks = sum(p.chunk(world, dim=0)[0].numel() * (12 if optimizer_group(n, p) == "matrix" else 16)
                     for n, p in model.named_parameters())
        assert memory.state_bytes_per_rank(model.config, world, "muon") == chunks


def test_fsdp_states_equal_a_real_fully_sharded_model():
    """FSDP2 itself (fully_shard per block and on the model) over 3 ranks of a fake process group: every
    rank's local weights, gradients and AdamW moments after one step; rank 0 is the fullest."""
    dist = pytest.importorskip("torch.distributed")
    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    cfg, world = make("moe", n_layer=2, n_expert=5), 3  # 5 experts, 64 vocab rows, 32 width: all uneven over 3
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
            local = [p.to_local() for p in model.parameters()] + [p.grad.to_local() for p in model.parameters()]
            local += [v.to_local() for s in opt.state.values() for k, v in s.items() if k != "step"]
            per_rank.append(sum(t.numel() * t.element_size() for t in local))
        finally:
            dist.destroy_process_group()
    assert per_rank[0] == max(per_rank) > per_rank[-1]
    assert memory.state_bytes_per_rank(cfg, world, "adamw") == per_rank[0]


def saved_activation_bytes(model, idx, targets, autocast=False):
    """Bytes of the distinct storages autograd saves for the backward of one forward (parameters and
    buffers are states, not activations)."""
    states = {t.untyped_storage().data_ptr() for t in itertools.chain(model.parameters(), model.buffers())}
    saved = {}

    def pack(t):  # every saved tensor stays referenced by the graph, so no address is reused meanwhile
        storage = t.untyped_storage()
        if storage.data_ptr() not in states:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        model(idx, targets=targets)
    return sum(saved.values())


ACTIVATION_LAYOUTS = {
    "dense": dict(),
    "dense_gqa_qknorm_nogain": dict(n_kv_head=2, head_dim=24, qk_norm=True, norm_gain=False, embed_norm=True),
    "smelt_moe": dict(n_expert=8, top_k=2, expert_hidden=32, layout="smelt", n_passes=2),
    "pcc_tied_k2": dict(layout="pcc", n_layer=5, n_passes=2),
}


def measure(layout, autocast=False, kernels=False, **extra):
    cfg = ModelConfig(**{**SMALL, "vocab_size": 96, "eot_token": 95, "block_size": 64, "n_embd": 64,
                         **ACTIVATION_LAYOUTS[layout], **extra})
    torch.manual_seed(0)
    model = GPT(cfg)
    if kernels:
        import kernels as triton_kernels
        from test_kernels import KERNELS  # model.py's classes -> their kernels, as train.py maps them
        triton_kernels.apply(model, KERNELS)
    idx, targets = torch.randint(0, cfg.eot_token, (2, 2, cfg.block_size))  # no eot: no document mask
    return cfg, saved_activation_bytes(model, idx, targets, autocast)


@pytest.mark.parametrize("layout", sorted(ACTIVATION_LAYOUTS))
def test_activation_estimate_matches_what_autograd_saves(layout):
    """fp32, PyTorch reference path: within 1% (measured: exact up to a few bytes of scalars, and +0.5%
    for prelude-core-coda, whose RMSNorm of the zero state h0 keeps less than a norm of a live h)."""
    cfg, real = measure(layout)
    estimate = memory.activation_bytes(cfg, micro_batch=2, mixed_precision=False, kernels=False)
    assert estimate["saved"] == pytest.approx(real, rel=0.01)


@pytest.mark.parametrize("layout", ["smelt_moe", "pcc_tied_k2"])
def test_activation_estimate_under_bf16_autocast(layout):
    """bf16 autocast (CPU): autograd also keeps the bf16 weight copies (weight_copy_bytes, booked to DDP).
    Within 10% (measured 0.94 for SMELT MoE, whose reference experts cast each routed token twice,
    1.00 for pcc)."""
    cfg, real = measure(layout, autocast=True)
    estimate = memory.activation_bytes(cfg, micro_batch=2, mixed_precision=True, kernels=False)["saved"]
    assert estimate + memory.weight_copy_bytes(cfg) == pytest.approx(real, rel=0.10)


@pytest.mark.parametrize("layout", ["smelt_moe", "pcc_tied_k2"])
def test_activation_estimate_of_the_kernel_path(layout):
    """The Triton path (RMSNorm, SwiGLU, grouped-GEMM MoE kernels; the interpreter on CPU) saves less:
    within 1% (measured: exact for pcc, -0.1% for MoE, the kernel's tile maps)."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("the kernels run on CUDA there; this checks the CPU interpreter")
    cfg, real = measure(layout, kernels=True)
    estimate = memory.activation_bytes(cfg, micro_batch=2, mixed_precision=False, kernels=True)
    assert estimate["saved"] == pytest.approx(real, rel=0.01)
    assert estimate["saved"] < memory.activation_bytes(cfg, 2, mixed_precision=False, kernels=False)["saved"]


def test_one_more_executed_block_saves_one_block():
    """per_block (what a block recomputes under activation checkpointing) equals the measured cost of one
    more loop visit; with checkpointing the visit keeps only its fp32 input, 4 x n_embd bytes per token."""
    cfg2, real2 = measure("smelt_moe")
    cfg3, real3 = measure("smelt_moe", n_passes=3)  # 2 more visits (loop span 2)
    est = memory.activation_bytes(cfg2, 2, mixed_precision=False, kernels=False)
    assert real3 - real2 == pytest.approx(2 * est["per_block"], rel=0.01)
    ckpt2, ckpt3 = (memory.activation_bytes(c, 2, mixed_precision=False, activation_checkpointing=True,
                                           kernels=False) for c in (cfg2, cfg3))
    assert ckpt3["saved"] - ckpt2["saved"] == 2 * est["tokens"] * 4 * cfg2.n_embd
    assert ckpt2["recompute"] == pytest.approx((real3 - real2) / 2, rel=0.01)  # one visit, measured
    assert ckpt2["total"] < memory.activation_bytes(cfg2, 2, mixed_precision=False)["total"]


def test_memory_plan_is_consistent():
    base, _ = match_cli.preset_baseline("smelt-200m-s95")
    plan = memory.memory_plan(base, world_size=16, micro_batch=2)
    for name in ("ddp", "fsdp"):
        m = plan[name]
        parts = m["states_gb_per_gpu"] + m["activations_gb_per_gpu"] + m["transient_gb_per_gpu"]
        assert m["total_gb_per_gpu"] == pytest.approx(parts)
        assert m["fits"] == (m["total_gb_per_gpu"] <= 0.9 * 80)
        if m["max_micro_batch"]:  # it fits, one more does not
            assert memory.memory_plan(base, 16, m["max_micro_batch"])[name]["fits"]
        assert not memory.memory_plan(base, 16, m["max_micro_batch"] + 1)[name]["fits"]
    assert plan["ddp"]["states_gb_per_gpu"] * 2 ** 30 == memory.state_bytes_per_rank(base, 1)
    assert plan["fsdp"]["states_gb_per_gpu"] == pytest.approx(plan["ddp"]["states_gb_per_gpu"] / 16, rel=0.01)
    assert plan["ddp"]["activations_gb_per_gpu"] == plan["fsdp"]["activations_gb_per_gpu"]
    adamw = memory.memory_plan(base, 16, 2, optimizer="adamw")
    assert adamw["ddp"]["states_gb_per_gpu"] > plan["ddp"]["states_gb_per_gpu"]  # 16 vs 12 bytes per matrix weight
    # the 1.6B, S~0.97 baseline (53.9B params) needs FSDP: 16 x 53.9e9 bytes of AdamW-level state alone
    big, _ = match_cli.preset_baseline("smelt-1.6b-s97")
    big_plan = memory.memory_plan(big, 16, 1, activation_checkpointing=True)
    assert not big_plan["ddp"]["fits"] and big_plan["fsdp"]["fits"]


def test_cli_json_and_table(capsys):
    config = os.path.join(ROOT, "config", "x_d8_vanilla.py")
    assert memory.main([config, "--world_size", "16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    keys = {"states_gb_per_gpu", "activations_gb_per_gpu", "total_gb_per_gpu", "fits"}
    assert keys <= set(out["ddp"]) and keys <= set(out["fsdp"])
    assert out["micro_batch"] == 32 and out["world_size"] == 16  # the config's batch_size
    assert memory.main(["--preset", "smelt-200m-s95", "--micro_batch", "1", "--json",
                        "--activation_checkpointing", "--optimizer", "adamw", "--gpu_gb", "141"]) == 0
    out = json.loads(capsys.readouterr().out)
    for side in ("baseline", "matched"):
        m = out[side]
        assert (m["micro_batch"], m["optimizer"], m["activation_checkpointing"], m["gpu_gb"]) == (1, "adamw", True, 141)
        assert keys <= set(m["fsdp"])
    assert memory.main(["--preset", "smelt-200m-s95", "--world_size", "16"]) == 0
    text = capsys.readouterr().out
    assert text.count("memory per GPU") == 2 and "fsdp" in text and "max micro-batch" in text


@pytest.mark.parametrize("argv, message", [
    (["--preset", "smelt-200m-s95", "--world_size", "0"], "argument --world_size: 0: must be >= 1"),
    (["--preset", "smelt-200m-s95", "--micro_batch", "0"], "argument --micro_batch: 0: must be >= 1"),
    (["--preset", "smelt-200m-s95", "--gpu_gb", "-80"], "argument --gpu_gb: -80: must be > 0"),
    (["--preset", "smelt-200m-s95", "--optimizer", "sgd"], "invalid choice: 'sgd'"),
    (["--preset", "smelt-200m-s95", "--world_size", "two"], "argument --world_size: expected an integer, got 'two'"),
    (["config/no_such_config.py"], "config file not found"),
])
def test_cli_mistakes_are_one_line_and_exit_2(argv, message, capsys):
    assert message in one_line_error(memory.main, argv, capsys, "tooling.memory")


# ---- every GPU run the README and the configs give fits where they say it runs


def gpu_runs():
    """(label, world_size, train.py argv) of the README's GPU commands and of each config on a node of 8."""
    text = open(os.path.join(ROOT, "README.md")).read()
    block = text.split("## On GPUs")[1].split("```bash")[1].split("```")[0]
    for line in block.splitlines():
        words = line.split("  #")[0].split()
        if words and words[0] == "torchrun":
            flags = dict(w[2:].split("=", 1) for w in words[:words.index("train.py")] if w.startswith("--") and "=" in w)
            world = int(flags.get("nproc_per_node", 1)) * int(flags.get("nnodes", 1))
            yield " ".join(words), world, words[words.index("train.py") + 1:]
    for path in sorted(glob.glob(os.path.join(ROOT, "config", "[!_]*.py"))):
        yield f"torchrun --nproc_per_node=8 train.py {os.path.relpath(path, ROOT)}", 8, [path]


@pytest.mark.parametrize("label, world, argv", list(gpu_runs()), ids=lambda v: v if isinstance(v, str) else "")
def test_every_documented_gpu_run_fits_on_80_gb_gpus(label, world, argv):
    """The planner's verdict (10% headroom kept) for the model as built and as it grows, at the run's own
    batch, accumulation, parallelism and reshard setting, on GPUs of 80 GB."""
    train = pytest.importorskip("train")
    import grow
    values = train.SETTINGS.resolve(train.SETTINGS.parse([a if not a.startswith("config/") else os.path.join(ROOT, a)
                                                          for a in argv]))
    config, cfg = train.SETTINGS.build(train.TrainConfig, values), train.SETTINGS.build(ModelConfig, values)
    from tooling import guards
    guards.derive_grad_accum(config, world)
    parallel = "fsdp" if config.sharded else "ddp"
    for when, shape in grow.shapes_of_run(cfg, config):
        plan = memory.memory_plan(shape, world, config.batch_size, config.optimizer, config.activation_checkpointing,
                                  gpu_gb=80, kernels=config.triton, grad_accum=config.grad_accum)[parallel]
        fits = plan["keep_gathered_fits"] if config.parallel == "fsdp_grad_op" else plan["fits"]
        assert fits, f"{label}{when}: {plan['total_gb_per_gpu']:.1f} GiB per GPU ({parallel})"


@pytest.mark.parametrize("layout, grad_accum", [(dict(layout="pcc", n_layer=3, n_passes=2, n_expert=0), 1),
                                                (dict(layout="smelt", n_layer=4, n_passes=2, n_expert=8, top_k=2), 2)])
def test_planner_agrees_with_pytorchs_fsdp_memory_tracker(layout, grad_accum):
    """bench/fsdp_memory.py at toy size: one of 4 FSDP2 ranks (fake process group, FakeTensorMode, the bf16
    policy, Muon + AdamW, two steps) under torch's FSDPMemTracker; the planner's FSDP total within 10% of
    the tracker's peak (measured here: 1.04-1.07; on every GPU config 0.96-1.09, docs/training.md)."""
    pytest.importorskip("torch.distributed._tools.fsdp2_mem_tracker")
    import importlib.util
    spec = importlib.util.spec_from_file_location("fsdp_memory", os.path.join(ROOT, "bench", "fsdp_memory.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    cfg = ModelConfig(vocab_size=512, eot_token=511, block_size=256, n_embd=128, n_head=4, **layout)
    result = bench.compare("toy", cfg, world=4, micro_batch=8, grad_accum=grad_accum)
    assert 0.9 <= result["planner_over_tracker"] <= 1.1, result


# ---- the CPU check: cgroup limits, the document mask SDPA keeps


def write_files(root, files):
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)


def test_cgroup_v2_limit_of_the_process_or_a_parent_minus_reclaimable_cache(tmp_path):
    GiB = 2 ** 30
    write_files(tmp_path, {
        "proc_cgroup": "0::/user.slice/job\n",
        "cg/memory.max": "max\n",  # the root: no limit
        "cg/user.slice/memory.max": f"{4 * GiB}\n", "cg/user.slice/memory.current": f"{3 * GiB}\n",
        "cg/user.slice/memory.stat": f"anon 1\ninactive_file {GiB}\n",
        "cg/user.slice/job/memory.max": f"{int(2.2 * GiB)}\n", "cg/user.slice/job/memory.current": f"{GiB}\n",
        "cg/user.slice/job/memory.stat": f"inactive_file {GiB // 4}\nactive_file 5\n"})
    found = memory.cgroup_memory(str(tmp_path / "cg"), str(tmp_path / "proc_cgroup"))
    # the job's room: 2.2 GiB - (1 - 0.25) GiB = 1.45 GiB; its parent's: 4 - (3 - 1) = 2 GiB
    assert found["path"] == str(tmp_path / "cg/user.slice/job") and found["limit"] == int(2.2 * GiB)
    assert found["room"] == int(2.2 * GiB) - 3 * GiB // 4
    (tmp_path / "cg/user.slice/memory.current").write_text(f"{int(3.8 * GiB)}\n")  # now the parent binds
    assert memory.cgroup_memory(str(tmp_path / "cg"), str(tmp_path / "proc_cgroup"))["path"] == \
        str(tmp_path / "cg/user.slice")


def test_cgroup_v1_memory_controller_and_no_limit(tmp_path):
    GiB = 2 ** 30
    write_files(tmp_path, {
        "proc_cgroup": "12:cpu,cpuacct:/docker/abc\n5:memory:/docker/abc\n",
        "cg/memory/docker/abc/memory.limit_in_bytes": "9223372036854771712\n",  # v1's "no limit"
        "cg/memory/docker/abc/memory.usage_in_bytes": f"{GiB}\n",
        "cg/memory/docker/memory.limit_in_bytes": f"{3 * GiB}\n",
        "cg/memory/docker/memory.usage_in_bytes": f"{2 * GiB}\n",
        "cg/memory/docker/memory.stat": f"total_inactive_file {GiB // 2}\ninactive_file 7\n"})
    found = memory.cgroup_memory(str(tmp_path / "cg"), str(tmp_path / "proc_cgroup"))
    assert found == dict(room=3 * GiB - (2 * GiB - GiB // 2), limit=3 * GiB, usage=2 * GiB - GiB // 2,
                         path=str(tmp_path / "cg/memory/docker"))
    write_files(tmp_path, {"cg/memory/docker/memory.limit_in_bytes": "9223372036854771712\n"})
    assert memory.cgroup_memory(str(tmp_path / "cg"), str(tmp_path / "proc_cgroup")) is None  # no limit anywhere


def test_a_run_that_fits_memavailable_is_refused_by_its_cgroup(tmp_path, monkeypatch):
    """A 2.6 GiB cgroup on a host with plenty of MemAvailable (a run it accepted was OOM-killed there): the
    tiny default at 15 x 1024 (peak RSS 3.8 GiB measured, freed memory kept) is refused naming the cgroup,
    8 x 1024 (2.3 GiB, since the mask is shared) fits; the room is shared by the node's processes
    (LOCAL_WORLD_SIZE)."""
    import grow
    import train
    GiB = 2 ** 30
    write_files(tmp_path, {"meminfo": f"MemTotal: 99 kB\nMemAvailable: {64 * GiB // 1024} kB\n",
                           "proc_cgroup": "0::/job\n", "cg/job/memory.max": f"{int(2.6 * GiB)}\n",
                           "cg/job/memory.current": f"{GiB // 4}\n"})
    monkeypatch.setattr(memory, "MEMINFO", str(tmp_path / "meminfo"))
    monkeypatch.setattr(memory, "PROC_CGROUP", str(tmp_path / "proc_cgroup"))
    monkeypatch.setattr(memory, "CGROUP_ROOT", str(tmp_path / "cg"))
    cpu = torch.device("cpu")
    reading = memory.memory_reading(cpu)
    assert reading["meminfo"] == 64 * GiB and reading["available"] == int(2.6 * GiB) - GiB // 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert memory.memory_reading(cpu)["available"] == (int(2.6 * GiB) - GiB // 4) // 2
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    values = train.SETTINGS.resolve(dict(batch_size=15, block_size=1024))
    config, cfg = train.SETTINGS.build(train.TrainConfig, values), train.SETTINGS.build(ModelConfig, values)
    with pytest.raises(ValueError, match=r"this run needs about \d\.\d\d GiB .* allocator .* but 2\.35 GiB is "
                                         r"available on cpu \(cgroup limit 2\.60 GiB at .*job\)"):
        memory.check_memory(grow.shapes_of_run(cfg, config), config, cpu, False)
    values = train.SETTINGS.resolve(dict(batch_size=8, block_size=1024))
    config, cfg = train.SETTINGS.build(train.TrainConfig, values), train.SETTINGS.build(ModelConfig, values)
    defer, note = memory.check_memory(grow.shapes_of_run(cfg, config), config, cpu, False)
    assert re.match(r"memory: peak resident memory about \d\.\d\d GiB \(now \d\.\d\d GiB\); 2\.35 GiB available "
                    r"\(cgroup limit 2\.60 GiB", note), note


def test_the_document_mask_is_converted_once_and_shared_by_every_block():
    """SDPA converts a boolean mask to an additive one on each call and keeps every copy for the backward;
    the model converts it once per forward (model.additive_mask): the same outputs and gradients as
    SDPA's own conversion, one saved B x T^2 mask for all the executed blocks."""
    cfg = ModelConfig(**{**SMALL, "vocab_size": 96, "eot_token": 95, "block_size": 64, "n_embd": 32,
                         **ACTIVATION_LAYOUTS["pcc_tied_k2"]})
    torch.manual_seed(0)
    model = GPT(cfg)
    idx = torch.randint(0, cfg.eot_token, (2, cfg.block_size))
    idx[:, 20], idx[1, 45] = cfg.eot_token, cfg.eot_token  # documents: the mask is on
    masks = set()

    def pack(t):
        if t.shape == (idx.size(0), 1, cfg.block_size, cfg.block_size):
            masks.add(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(idx, targets=idx)[1]
    assert len(masks) == 1 and cfg.executed_layers() > 2
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    import model as model_module
    original = model_module.additive_mask
    try:  # SDPA's own conversion: hand it the boolean mask
        model_module.additive_mask = lambda mask, dtype: mask
        reference = model(idx, targets=idx)[1]
    finally:
        model_module.additive_mask = original
    reference.backward()
    assert torch.allclose(loss, reference, rtol=1e-6)
    for name, p in model.named_parameters():
        assert torch.allclose(p.grad, grads[name], rtol=1e-5, atol=1e-7), name
