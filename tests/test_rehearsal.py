"""The CUDA code path rehearsed on CPU: bf16 autocast through every layout (forward, backward, generate),
no host read in a training step, torch.compile(fullgraph=True) of every layout family's training step (one
graph, no recompiles), and FSDP2's bf16 policy. What CUDA adds beyond this is bench/gpu_check.sh's.

Tolerances: bf16 keeps 8 bits of mantissa; through a few layers of a small random model the loss moves by
well under 1%."""
import pytest
import torch
import torch.distributed as dist

import train
from model import GPT, ModelConfig

VOCAB, EOT = 256, 255
LAYOUTS = {
    "plain-gqa-qknorm": dict(layout="plain", n_kv_head=1, norms="x"),
    "smelt-moe": dict(layout="smelt", n_passes=2, n_expert=4, top_k=2, expert_hidden=16),
    "layer-loop": dict(layout="layer_loop", n_passes=2),
    "pcc-tied-boundary": dict(layout="pcc", n_layer=3, n_passes=2, boundary="both", boundary_alpha=0.7, norms="x"),
    "pcc-untied-moe": dict(layout="pcc_untied", n_layer=3, n_passes=2, n_expert=4, top_k=2),
}


def build(kw, seed=0):
    torch.manual_seed(seed)
    cfg = ModelConfig(**dict(vocab_size=VOCAB, eot_token=EOT, block_size=32, n_layer=4, n_embd=32, n_head=2,
                             init="nanogpt") | kw)
    return GPT(cfg)


def tokens(B=2, T=24):
    idx = torch.randint(0, EOT, (B, T), generator=torch.Generator().manual_seed(1))
    idx[:, 9] = EOT  # a document boundary: the document mask is on
    return idx


@pytest.mark.parametrize("name", LAYOUTS)
def test_bf16_autocast_forward_backward_generate(name):
    idx = tokens()
    losses, grads = {}, {}
    for dtype in (torch.float32, torch.bfloat16):
        model = build(LAYOUTS[name])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            logits, loss = model(idx, idx)
        loss.backward()
        assert torch.isfinite(loss) and logits.dtype == dtype
        grads[dtype] = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        assert torch.isfinite(grads[dtype]).all()
        losses[dtype] = loss.item()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            out = model.generate(idx[:1, :8], 6, temperature=0.0)
        assert out.shape == (1, 14) and int(out.max()) < VOCAB
    assert losses[torch.bfloat16] == pytest.approx(losses[torch.float32], rel=0.01)
    cosine = torch.nn.functional.cosine_similarity(grads[torch.bfloat16], grads[torch.float32], dim=0)
    assert cosine > 0.99, cosine


# ---- no host read in the training step


class HostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Records every op of a forward + backward that copies a device value to the host, or waits for one:
    .item() / bool() / int() (aten._local_scalar_dense) and the ops whose output shape is a value (nonzero,
    masked indexing, unique, bincount, repeat_interleave without its output size). On a GPU each stalls the
    CPU until the device catches up. .tolist() bypasses the dispatcher: a spy counts it."""
    VALUE_SHAPED = {"nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_consecutive", "bincount",
                    "repeat_interleave", "_local_scalar_dense", "masked_scatter", "argwhere"}

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        bool_index = name in ("index", "index_put", "index_put_") and any(
            t is not None and t.dtype == torch.bool for t in (args[1] if len(args) > 1 else []))
        if name in self.VALUE_SHAPED and not (name == "repeat_interleave" and (kwargs or {}).get("output_size")) \
                or bool_index:
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


HOST_READ_CASES = {**LAYOUTS, "smelt-moe-random-passes": LAYOUTS["smelt-moe"] | dict(n_passes=3),
                   "pcc-untied-fewer-passes": LAYOUTS["pcc-untied-moe"] | dict(n_passes=3)}


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("name", HOST_READ_CASES)
def test_the_training_step_reads_nothing_back_to_the_host(name, bf16, monkeypatch):
    model = build(HOST_READ_CASES[name])
    model.activation_checkpointing = name.startswith("pcc")  # its recomputation in the backward too
    listed = []
    original = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: listed.append(t.shape) or original(t))
    n_passes = 2 if "passes" in name else None
    with HostReads() as reads:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            _, loss = model(tokens(4, 32), tokens(4, 32), n_passes=n_passes)
        loss.backward()
    assert reads.seen == [] and listed == [], (reads.seen, listed)
    assert model.blocks[-1].attn.q_proj.weight.grad is not None  # the step ran through to the last block


def test_the_host_read_count_sees_what_a_gpu_would_wait_for(monkeypatch):
    """The counter is not blind: the per-expert loop (conftest.loop_experts reads the tokens per expert),
    an .item() and a boolean mask are all caught."""
    import model as model_module
    from conftest import loop_experts
    model = build(LAYOUTS["smelt-moe"])
    listed = []
    original = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: listed.append(t.shape) or original(t))
    monkeypatch.setattr(model_module, "run_experts", loop_experts)
    with HostReads() as reads:
        _, loss = model(tokens(), tokens())
        loss.item()
        loss.new_ones(3)[torch.tensor([True, False, True])]
    assert len(listed) == model.config.executed_layers() and reads.seen == ["_local_scalar_dense", "index"]


# ---- torch.compile: one graph per layout, no recompiles


def compiled_training_steps(model, compiled, steps, n_passes=None, bf16=False, zero_router_at=None):
    """`steps` training steps (forward, backward, AdamW) through `compiled`, each on another batch whose
    document boundary moves; returns the number of distinct graphs dynamo made after each step."""
    import torch._dynamo.utils
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    graphs = []
    for step in range(steps):
        idx = torch.randint(0, EOT, (4, 32), generator=torch.Generator().manual_seed(step))
        idx[:, 7 + step] = EOT  # the document boundary moves: the mask changes every step
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


COMPILE_CASES = [("smelt-moe", "checkpointed"), ("pcc-untied-moe", "bf16")]  # bf16: torch's grouped GEMM


@pytest.mark.parametrize("name, variant", COMPILE_CASES)
def test_the_training_step_compiles_to_one_graph(name, variant):
    """torch.compile(fullgraph=True) of forward + backward: no graph break anywhere (a break raises), and
    later steps with other batches, other routing and experts left without tokens make no new graph.
    Dynamo decides graphs before any backend runs, so aot_eager (trace forward and backward, no code
    generation) rehearses that part of --compile=True in seconds."""
    import torch._dynamo
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = build(LAYOUTS[name])
    model.activation_checkpointing = variant == "checkpointed"
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    graphs = compiled_training_steps(model, compiled, 4, bf16=variant == "bf16", zero_router_at=2)
    assert graphs == [1, 1, 1, 1], graphs


def test_moe_experts_with_zero_or_one_token_do_not_recompile():
    """The grouped GEMM's shapes are the assignments', never the tokens per expert: any routing, experts
    with 0 or 1 rows included, runs the graph compiled first."""
    import torch._dynamo
    import torch._dynamo.utils
    import model as model_module
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    run = torch.compile(model_module.run_experts, fullgraph=True, backend="aot_eager")
    w = [torch.randn(4, 2, 16, 32, requires_grad=True), torch.randn(4, 32, 16, requires_grad=True)]
    x = torch.randn(6, 32, requires_grad=True)
    token_of = torch.arange(12) % 6
    for counts in ([3, 3, 3, 3], [12, 0, 0, 0], [0, 1, 11, 0], [1, 1, 1, 9]):
        run(x, token_of, torch.tensor(counts), *w, torch.rand(12)).square().sum().backward()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("untie", [True])
def test_random_passes_compile_once_per_choice_and_growth_once(untie):
    """Random passes: one graph per pass count drawn (n_passes is a Python int: a different plan); growth
    changes the plan (and, untied, the blocks) once: one graph more, then none."""
    import torch._dynamo
    import grow
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = build(dict(layout="pcc", n_layer=3, n_passes=1, boundary="both", boundary_alpha=0.7))
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    drawn = compiled_training_steps(model, compiled, 4, n_passes=[1, 2, 1, 2])
    assert drawn == [1, 2, 2, 2]
    grow.grow(model, 2, untie=untie)  # tied: more passes; untie: the core copied
    assert compiled_training_steps(model, compiled, 3)[-1] - drawn[-1] <= 1



@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
@pytest.mark.parametrize("name", LAYOUTS)
def test_the_blocks_and_the_loss_compile_one_graph_each_under_ddp_and_fsdp(name, parallel):
    """train.compile_blocks, CUDA's default, with aot_eager: each block's forward and the loss one graph with
    no break (fullgraph: a break raises), DDP's and FSDP2's hooks outside them, shared by every block and
    visit (one per residual scale), recomputed in the backward under FSDP2; later batches make no new graph,
    and the losses are eager's."""
    import torch._dynamo
    import torch._dynamo.utils
    from torch.nn.parallel import DistributedDataParallel
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    eager, model = build(LAYOUTS[name]), build(LAYOUTS[name])
    if parallel == "fsdp":
        train.shard(model, train.TrainConfig(parallel="fsdp"), bf16=False)
        assert model.activation_checkpointing  # a CPU run recomputes: the compiled forward runs twice
    train.compile_blocks(model, backend="aot_eager")
    step_model = DistributedDataParallel(model) if parallel == "ddp" else model
    graphs = compiled_training_steps(model, step_model, 3)
    scales = {s.scale for s in model.plan if s.kind == "block"}
    assert graphs == [len(scales) + 1] * 3, graphs
    compiled_training_steps(eager, eager, 3)  # the same batches and updates, eager
    idx = tokens(B=4, T=32)
    assert step_model(idx, idx)[1].item() == pytest.approx(eager(idx, idx)[1].item(), rel=1e-4)


@pytest.mark.parametrize("layout", [dict(n_expert=4, top_k=2, layout="smelt", n_passes=2),
                                    dict(layout="pcc", n_layer=3, n_passes=2)])
def test_fsdp_bf16_policy_keeps_the_residual_stream_fp32(layout):
    """train.shard's bf16 policy (CUDA's): the blocks gather bf16 weights, every block's input (the residual
    stream) stays fp32 as under DDP's autocast, and the two losses agree to bf16 precision."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch.manual_seed(0)
    plain = build(layout)
    sharded = build(layout)
    sharded.load_state_dict(plain.state_dict())
    train.shard(sharded, train.TrainConfig(parallel="fsdp"), bf16=True)
    idx = tokens()
    losses = {}
    for name, model in (("ddp", plain), ("fsdp", sharded)):
        inputs, weights = [], []
        hooks = [b.register_forward_pre_hook(lambda m, args: inputs.append(args[0].dtype)) for b in model.blocks]
        hooks.append(model.blocks[0].attn.q_proj.register_forward_pre_hook(
            lambda m, args: weights.append(m.weight.dtype)))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses[name] = model(idx, idx)[1].float()
        for h in hooks:
            h.remove()
        assert set(inputs) == {torch.float32}, (name, inputs)
        assert set(weights) == {torch.bfloat16 if name == "fsdp" else torch.float32}
    assert losses["fsdp"].item() == pytest.approx(losses["ddp"].item(), rel=2e-2)


def test_the_flex_attention_path_compiles_to_one_graph(monkeypatch):
    """CUDA's attention path (FlexAttention with the document block mask, GQA) compiled with fullgraph=True:
    the mask is built inside the graph, later batches with other boundaries make no new graph, and the
    logits are the SDPA path's. Forward only: FlexAttention has no backward on a CPU."""
    import warnings
    import torch._dynamo
    import torch._dynamo.utils
    import model as model_module
    model = build(dict(layout="smelt", n_passes=2, n_kv_head=1, norms="x", n_expert=4, top_k=2))
    batches = []
    for step in range(3):
        idx = tokens(B=2, T=32)
        idx[:, 5 + 4 * step] = EOT
        batches.append(idx)
    with torch.no_grad():
        sdpa = [model(idx)[0] for idx in batches]
    monkeypatch.setattr(model_module, "FLEX_DEVICES", ("cuda", "cpu"))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        for idx, expected in zip(batches, sdpa):
            torch.testing.assert_close(compiled(idx)[0], expected, rtol=1e-4, atol=1e-5)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_qk_norm_output_keeps_the_attention_dtype_when_autocast_runs_it_in_fp32(monkeypatch):
    """CUDA autocast runs rms_norm in fp32 (from PyTorch 2.12; CPU autocast does not): forced here, q, k
    and v still share autocast's bf16."""
    import torch.nn.functional as F
    rms_norm = F.rms_norm
    monkeypatch.setattr(F, "rms_norm", lambda x, *args: rms_norm(x.float(), *args))
    model = build(dict(norms="x", n_kv_head=1))
    attn = model.blocks[0].attn
    ctx = type("Ctx", (), dict(cos=model.rope_cos[:24], sin=model.rope_sin[:24]))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert attn.q_norm(torch.randn(1, 2, 24, 16).bfloat16()).dtype == torch.float32  # forced
        q, k, v = attn.qkv(torch.randn(2, 24, 32), ctx)
    assert q.dtype == k.dtype == v.dtype == torch.bfloat16


def test_a_config_with_derived_sizes_compiles_to_one_graph():
    """eot_token, n_kv_head, head_dim and the hidden sizes left to be derived (model.Derived, an int subclass
    dynamo cannot trace a comparison with): one graph, forward and backward."""
    import torch._dynamo
    torch._dynamo.reset()
    model = GPT(ModelConfig(vocab_size=64, block_size=32, n_embd=32, n_head=2, n_layer=1))
    assert isinstance(model.config.eot_token, type(model.config.head_dim)) and model.config.eot_token == 63
    idx = torch.randint(0, 63, (2, 32))
    idx[:, 5] = 63
    torch.compile(model, fullgraph=True, backend="aot_eager")(idx, idx)[1].backward()
