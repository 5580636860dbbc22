"""The CUDA code path rehearsed on CPU: bf16 autocast through every layout, no host read in a training step,
torch.compile(fullgraph=True) of every layout family's training step (one graph, no recompiles), and FSDP2's
bf16 policy. What CUDA adds beyond this is bench/gpu_check.sh's."""
import pytest
import torch
import torch._dynamo.utils
import torch.distributed as dist

import model as model_module
import train
from model import GPT, ModelConfig

VOCAB, EOT = 256, 255
LAYOUTS = {"plain-gqa-qknorm": dict(layout="plain", n_kv_head=1, norms="x"),
           "smelt-moe": dict(layout="smelt", n_passes=2, n_expert=4, top_k=2, expert_hidden=16),
           "layer-loop": dict(layout="layer_loop", n_passes=2),
           "pcc-tied-boundary": dict(layout="pcc", n_layer=3, n_passes=2, boundary_alpha=0.7, norms="x"),
           "pcc-untied-moe": dict(layout="pcc_untied", n_layer=3, n_passes=2, n_expert=4, top_k=2)}


def build(kw, seed=0):
    torch.manual_seed(seed)
    base = dict(vocab_size=VOCAB, block_size=32, n_layer=4, n_embd=32, n_head=2, init="nanogpt")  # eot: 255
    return GPT(ModelConfig(**base | kw))


def tokens(B=2, T=24):  # an eot at 9: a document boundary, the document mask is on
    idx = torch.randint(0, EOT, (B, T), generator=torch.Generator().manual_seed(1))
    return idx.index_fill_(1, torch.tensor([9]), EOT)


def fresh_dynamo():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()


@pytest.mark.parametrize("name", LAYOUTS)
def test_bf16_autocast_forward_backward_generate(name):
    """bf16 keeps 8 bits of mantissa: through a few small layers the loss moves by well under 1%."""
    idx, losses, grads = tokens(), {}, {}
    for bf16 in (False, True):
        model = build(LAYOUTS[name])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits, loss = model(idx, idx)
            out = model.generate(idx[:1, :8], 6, temperature=0.0)
        loss.backward()
        grads[bf16] = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        assert logits.dtype == (torch.bfloat16 if bf16 else torch.float32)
        assert torch.isfinite(grads[bf16]).all() and out.shape == (1, 14) and int(out.max()) < VOCAB
        losses[bf16] = loss.item()
    assert losses[True] == pytest.approx(losses[False], rel=0.01)
    assert torch.nn.functional.cosine_similarity(grads[True], grads[False], dim=0) > 0.99


class HostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Every op of a forward + backward that copies a device value to the host or waits for one (on a GPU
    each stalls the CPU): .item() / bool() / int() and the ops whose output shape is a value."""
    VALUE_SHAPED = {"nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_consecutive",
                    "bincount", "repeat_interleave", "_local_scalar_dense", "masked_scatter", "argwhere"}

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        bool_index = name in ("index", "index_put", "index_put_") and any(
            t is not None and t.dtype == torch.bool for t in (args[1] if len(args) > 1 else []))
        sized = name == "repeat_interleave" and (kwargs or {}).get("output_size")  # given: no host read
        if name in self.VALUE_SHAPED and not sized or bool_index:
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


def count_tolist(monkeypatch):
    """.tolist() bypasses the dispatcher: a spy lists it."""
    listed, original = [], torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: listed.append(t.shape) or original(t))
    return listed


HOST_READ_CASES = {**LAYOUTS, "smelt-moe-random-passes": LAYOUTS["smelt-moe"] | dict(n_passes=3),
                   "pcc-untied-fewer-passes": LAYOUTS["pcc-untied-moe"] | dict(n_passes=3)}


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("name", HOST_READ_CASES)
def test_the_training_step_reads_nothing_back_to_the_host(name, bf16, monkeypatch):
    model = build(HOST_READ_CASES[name])
    model.activation_checkpointing = name.startswith("pcc")  # its recomputation in the backward too
    listed = count_tolist(monkeypatch)
    with HostReads() as reads:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            _, loss = model(tokens(4, 32), tokens(4, 32), n_passes=2 if "passes" in name else None)
        loss.backward()
    assert reads.seen == [] and listed == [], (reads.seen, listed)
    assert model.blocks[-1].attn.q_proj.weight.grad is not None  # the step ran through to the last block


def test_the_host_read_count_sees_what_a_gpu_would_wait_for(monkeypatch):
    """The counter is not blind: the per-expert loop (conftest.loop_experts), .item() and a boolean mask."""
    from conftest import loop_experts
    model = build(LAYOUTS["smelt-moe"])
    listed = count_tolist(monkeypatch)
    monkeypatch.setattr(model_module, "run_experts", loop_experts)
    with HostReads() as reads:
        model(tokens(), tokens())[1].item()
        torch.ones(3)[torch.tensor([True, False, True])]
    assert len(listed) == model.config.executed_layers() and reads.seen == ["_local_scalar_dense", "index"]


def compiled_training_steps(model, compiled, steps, n_passes=None, bf16=False, zero_router_at=None):
    """`steps` AdamW steps through `compiled`, each batch's document boundary elsewhere; returns the number
    of distinct graphs dynamo made after each step."""
    opt, graphs = torch.optim.AdamW(model.parameters(), lr=1e-3), []
    for step in range(steps):
        idx = torch.randint(0, EOT, (4, 32), generator=torch.Generator().manual_seed(step))
        idx[:, 7 + step] = EOT
        if step == zero_router_at:  # equal logits: every token picks experts 0 and 1, the others get no token
            for m in model.modules():
                if hasattr(m, "router"):
                    torch.nn.init.zeros_(m.router.weight)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            _, loss = compiled(idx, idx, n_passes=None if n_passes is None else n_passes[step])
        loss.backward()
        opt.step()
        opt.zero_grad()
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    return graphs


@pytest.mark.parametrize("name, variant", [("smelt-moe", "checkpointed"), ("pcc-untied-moe", "bf16")])
def test_the_training_step_compiles_to_one_graph(name, variant):
    """fullgraph=True: no graph break, and other batches, routings and experts without tokens make no new
    graph. Dynamo decides graphs before any backend runs: aot_eager rehearses that part of --compile."""
    fresh_dynamo()
    model = build(LAYOUTS[name])
    model.activation_checkpointing = variant == "checkpointed"
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    assert compiled_training_steps(model, compiled, 4, bf16=variant == "bf16", zero_router_at=2) == [1] * 4


def test_moe_experts_with_zero_or_one_token_do_not_recompile():
    """The grouped GEMM's shapes are the assignments', never the tokens per expert."""
    fresh_dynamo()
    run = torch.compile(model_module.run_experts, fullgraph=True, backend="aot_eager")
    w = [torch.randn(4, 2, 16, 32, requires_grad=True), torch.randn(4, 32, 16, requires_grad=True)]
    x, token_of = torch.randn(6, 32, requires_grad=True), torch.arange(12) % 6
    for counts in ([3, 3, 3, 3], [12, 0, 0, 0], [0, 1, 11, 0], [1, 1, 1, 9]):
        run(x, token_of, torch.tensor(counts), *w, torch.rand(12)).square().sum().backward()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_random_passes_compile_once_per_choice_and_growth_once():
    """One graph per pass count drawn (a different plan); growth (untying the core) one graph more."""
    import grow
    fresh_dynamo()
    model = build(dict(layout="pcc", n_layer=3, n_passes=1, boundary="both", boundary_alpha=0.7))
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    assert (drawn := compiled_training_steps(model, compiled, 4, n_passes=[1, 2, 1, 2])) == [1, 2, 2, 2]
    grow.grow(model, 2, untie=True)
    assert compiled_training_steps(model, compiled, 3)[-1] - drawn[-1] <= 1


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
@pytest.mark.parametrize("name", LAYOUTS)
def test_the_blocks_and_the_loss_compile_one_graph_each_under_ddp_and_fsdp(name, parallel):
    """train.compile_blocks (CUDA's default): one graph per residual scale, shared by every block and visit,
    and one for the loss, DDP's and FSDP2's hooks outside; no new graph later, and eager's losses."""
    from torch.nn.parallel import DistributedDataParallel
    fresh_dynamo()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # conftest ends it
    eager, model = build(LAYOUTS[name]), build(LAYOUTS[name])
    if parallel == "fsdp":
        train.shard(model, train.TrainConfig(parallel="fsdp"), bf16=False)
        assert model.activation_checkpointing  # a CPU run recomputes: the compiled forward runs twice
    train.compile_blocks(model, backend="aot_eager")
    step_model = DistributedDataParallel(model) if parallel == "ddp" else model
    graphs = compiled_training_steps(model, step_model, 3)
    assert graphs == [len({s.scale for s in model.plan if s.kind == "block"}) + 1] * 3, graphs
    compiled_training_steps(eager, eager, 3)  # the same batches and updates, eager
    idx = tokens(B=4, T=32)
    assert step_model(idx, idx)[1].item() == pytest.approx(eager(idx, idx)[1].item(), rel=1e-4)


@pytest.mark.parametrize("layout", [dict(n_expert=4, top_k=2, layout="smelt", n_passes=2),
                                    dict(layout="pcc", n_layer=3, n_passes=2)])
def test_fsdp_bf16_policy_keeps_the_residual_stream_fp32(layout):
    """train.shard's bf16 policy (CUDA's): the blocks gather bf16 weights, every block's input stays fp32 as
    under DDP's autocast, and the two losses agree to bf16 precision."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # conftest ends it
    plain, sharded, losses = build(layout), build(layout), {}
    train.shard(sharded, train.TrainConfig(parallel="fsdp"), bf16=True)
    for name, model in (("ddp", plain), ("fsdp", sharded)):
        ins, weights = [], []
        hooks = [b.register_forward_pre_hook(lambda m, args: ins.append(args[0].dtype)) for b in model.blocks]
        hooks.append(model.blocks[0].attn.q_proj.register_forward_pre_hook(
            lambda m, args: weights.append(m.weight.dtype)))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses[name] = model(tokens(), tokens())[1].float().item()
        for h in hooks:
            h.remove()
        assert set(ins) == {torch.float32}, (name, ins)
        assert set(weights) == {torch.bfloat16 if name == "fsdp" else torch.float32}
    assert losses["fsdp"] == pytest.approx(losses["ddp"], rel=2e-2)


@pytest.mark.filterwarnings("ignore")
def test_the_flex_attention_path_compiles_to_one_graph(monkeypatch):
    """CUDA's attention path (FlexAttention, the document block mask, GQA) under fullgraph: the mask is built
    inside the graph, other boundaries make no new graph, and the logits are SDPA's (forward only)."""
    model = build(dict(layout="smelt", n_passes=2, n_kv_head=1, norms="x", n_expert=4, top_k=2))
    batches = [tokens(B=2, T=32).index_fill_(1, torch.tensor([5 + 4 * step]), EOT) for step in range(3)]
    with torch.no_grad():
        sdpa = [model(idx)[0] for idx in batches]
        monkeypatch.setattr(model_module, "FLEX_DEVICES", ("cuda", "cpu"))
        fresh_dynamo()
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
        for idx, expected in zip(batches, sdpa):
            torch.testing.assert_close(compiled(idx)[0], expected, rtol=1e-4, atol=1e-5)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_qk_norm_output_keeps_the_attention_dtype_when_autocast_runs_it_in_fp32(monkeypatch):
    """CUDA autocast runs rms_norm in fp32 (CPU's does not): forced here, q, k and v still share bf16."""
    rms_norm = torch.nn.functional.rms_norm
    monkeypatch.setattr(torch.nn.functional, "rms_norm", lambda x, *args: rms_norm(x.float(), *args))
    model = build(dict(norms="x", n_kv_head=1))
    attn = model.blocks[0].attn
    ctx = type("Ctx", (), dict(cos=model.rope_cos[:24], sin=model.rope_sin[:24]))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert attn.q_norm(torch.randn(1, 2, 24, 16).bfloat16()).dtype == torch.float32  # forced
        q, k, v = attn.qkv(torch.randn(2, 24, 32), ctx)
    assert q.dtype == k.dtype == v.dtype == torch.bfloat16


def test_a_config_with_derived_sizes_compiles_to_one_graph():
    """Sizes left to be derived are plain ints (issue 63: an int subclass broke dynamo): one graph."""
    torch._dynamo.reset()
    model = GPT(ModelConfig(vocab_size=64, block_size=32, n_embd=32, n_head=2, n_layer=1))
    assert type(model.config.eot_token) is int and model.config.eot_token == 63
    idx = torch.randint(0, 63, (2, 32)).index_fill_(1, torch.tensor([5]), 63)
    torch.compile(model, fullgraph=True, backend="aot_eager")(idx, idx)[1].backward()
