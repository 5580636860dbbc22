import ast
import builtins
import importlib.util
import math
import os
import re
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import model as model_module
from model import GPT, MoE, ForwardContext, KVCache, ModelConfig, core_split, execution_plan, load_checkpoint
from probe import record_blocks

VOCAB, EOT = 97, 96
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny(**kw):
    base = dict(vocab_size=VOCAB, eot_token=EOT, block_size=64, n_layer=4, n_embd=32, n_head=4, n_kv_head=2,
                head_dim=8, mlp_hidden=48, init="nanogpt")
    return ModelConfig(**base | kw)


def build(seed=0, **kw):
    torch.manual_seed(seed)
    return GPT(tiny(**kw)).eval()


def tokens(B=2, T=24, seed=1, eot_at=()):
    idx = torch.randint(0, EOT, (B, T), generator=torch.Generator().manual_seed(seed))
    idx[:, list(eot_at)] = EOT
    return idx


@pytest.mark.parametrize("L, first, last", [(10, 3, 7), (12, 4, 9), (20, 6, 15), (30, 8, 22)])
def test_smelt_loops_the_middle_half(L, first, last):
    cfg = ModelConfig(n_layer=L, n_embd=64, n_head=4, layout="smelt", n_passes=2)
    plan = [s for s in execution_plan(cfg) if s.kind == "block"]
    assert len(plan) == L + (last - first + 1) == cfg.executed_layers()
    # model-loop: the whole span (1-based first..last) twice, each update scaled by 1/2
    span = list(range(first, last + 1))
    assert [s.block + 1 for s in plan] == list(range(1, first)) + span + span + list(range(last + 1, L + 1))
    assert [s.scale for s in plan] == [0.5 if s.block + 1 in span else 1.0 for s in plan]


def test_layer_loop_repeats_each_layer_in_place():
    plan = [s for s in execution_plan(tiny(layout="layer_loop", n_passes=3)) if s.kind == "block"]
    looped = [(b, v) for b in (1, 2) for v in (1, 2, 3)]
    assert [(s.block, s.visit) for s in plan] == [(0, 1)] + looped + [(3, 1)]
    assert [s.scale for s in plan] == [1.0] + [1 / 3] * 6 + [1.0]


def record_sdpa(monkeypatch):
    """The (q, attn_mask) of every later call to F.scaled_dot_product_attention."""
    calls, sdpa = [], F.scaled_dot_product_attention

    def recording(q, *args, attn_mask=None, **kwargs):
        calls.append((q, attn_mask))
        return sdpa(q, *args, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    return calls


def test_rope_is_its_definition(monkeypatch):
    """RoPE as the [X] code and nanochat define it: position p turns the pair (x_i, x_{i + D/2}) by p theta_i,
    theta_i = base^(-2i/D), y_i = x_i cos + x_{i+D/2} sin, y_{i+D/2} = x_{i+D/2} cos - x_i sin."""
    model = build(head_dim=8, n_layer=1)  # base 10000: theta = 1, 0.1, 0.01, 0.001; no QK-norm
    projected, calls = [], record_sdpa(monkeypatch)
    model.blocks[0].attn.q_proj.register_forward_hook(lambda module, inputs, out: projected.append(out))
    with torch.no_grad():
        model(tokens(B=1, T=41))
    x, rotated = projected[0].view(41, 4, 8), calls[0][0][0]  # (T, head, D) before, (head, T, D) after
    for p in (1, 3, 40):
        for i, theta in enumerate((1.0, 0.1, 0.01, 0.001)):
            a, b = x[p, 0, i].item(), x[p, 0, i + 4].item()
            cos, sin = math.cos(p * theta), math.sin(p * theta)
            assert rotated[0, p, i].item() == pytest.approx(a * cos + b * sin, abs=1e-5)
            assert rotated[0, p, i + 4].item() == pytest.approx(b * cos - a * sin, abs=1e-5)


def test_n_logits_cuts_the_padded_vocabulary_before_the_softmax():
    model = build(vocab_size=128, eot_token=EOT, n_logits=100)
    logits, loss = model(idx := tokens(B=2, T=12), idx)
    assert logits.shape[-1] == 100
    torch.testing.assert_close(loss, F.cross_entropy(logits.flatten(0, 1), idx.flatten()))
    assert model.generate(idx[:, :4], 8, temperature=1.0).max() < 100


@pytest.mark.parametrize("depth, split", [(6, (2, 2, 2)), (7, (2, 3, 2)), (8, (2, 3, 3)), (10, (3, 4, 3))])
def test_prelude_core_coda_split(depth, split):
    cfg = ModelConfig(n_layer=depth, n_embd=64, n_head=4, layout="pcc", n_passes=2)
    assert core_split(depth) == split
    assert cfg.executed_layers() == split[0] + 2 * split[1] + split[2]  # [X2]


def test_smelt_r1_is_the_baseline_bit_for_bit():
    base, looped = build(layout="plain"), GPT(tiny(layout="smelt", n_passes=1)).eval()
    looped.load_state_dict(base.state_dict())
    idx = tokens(eot_at=(9,))
    assert torch.equal(base(idx)[0], looped(idx)[0])


def test_smelt_r2_matches_hand_unrolled_S8_S9():
    model = build(layout="smelt", n_passes=2, n_layer=4, n_expert=6, top_k=2, expert_hidden=16)
    ctx = ForwardContext(model.rope_cos[:24], model.rope_sin[:24], None)
    x = model.wte(idx := tokens())
    for layer in [0, 1, 2, 1, 2, 3]:  # L=4, m=2: prelude 1 layer, layers 2-3 twice, then layer 4
        block = model.blocks[layer]
        scale = 0.5 if layer in (1, 2) else 1.0
        d_attn = scale * block.attn(block.norm1(x), ctx)  # [S8]
        d_moe = scale * block.ffn(block.norm2(x + d_attn))[0]  # [S9] sees the scaled attention write
        x = x + d_attn + d_moe
    torch.testing.assert_close(model(idx)[0], model.lm_head(model.norm_f(x)), rtol=1e-5, atol=1e-5)


def test_untied_copies_of_the_tied_core_compute_the_same_function():
    K, (P, C, D) = 3, core_split(5)
    tied = build(layout="pcc", n_layer=5, n_passes=K)
    untied = GPT(tiny(layout="pcc_untied", n_layer=5, n_passes=K)).eval()
    tied_block = list(range(P)) + [P + j % C for j in range(K * C)] + [P + C + j for j in range(D)]
    src, rename = tied.state_dict(), lambda m: f"blocks.{tied_block[int(m[1])]}"
    untied.load_state_dict({n: src[re.sub(r"^blocks\.(\d+)", rename, n)] for n in untied.state_dict()})
    idx = tokens(eot_at=(5,))
    torch.testing.assert_close(tied(idx)[0], untied(idx)[0], rtol=1e-5, atol=1e-5)
    core_params = sum(p.numel() for b in list(tied.blocks)[P:P + C] for p in b.parameters())
    assert untied.num_params()["total"] - tied.num_params()["total"] == (K - 1) * core_params


@pytest.mark.parametrize("boundary, norm, alpha",
                         [("both", True, 0.7), ("norm", True, 0), ("inject", False, 0.5), ("none", False, 0)])
def test_boundary_operator_before_each_later_pass_and_the_coda(boundary, norm, alpha):
    """The [X] code's h0: the first core pass sees the prelude output e; then BO(h, e) = RMSNorm(h) + alpha e
    [X3] (or its one part, or nothing: a plain deep transformer) before every later pass and the coda."""
    model = build(layout="pcc", n_layer=3, n_passes=2, boundary=boundary, boundary_alpha=alpha or 0.5)
    with record_blocks(model) as rec:
        model(tokens())
    e = rec[0]["resid_out"]
    assert torch.equal(rec[1]["resid_in"], e)
    for before, after in ((rec[1], rec[2]), (rec[2], rec[3])):
        h = F.rms_norm(before["resid_out"], (32,), eps=1e-6) if norm else before["resid_out"]
        torch.testing.assert_close(after["resid_in"], h + alpha * e)


@pytest.mark.parametrize("layout", ["plain", "smelt", "pcc"])
def test_causal_and_document_mask(layout):
    model = build(layout=layout, n_layer=4, n_passes=1 if layout == "plain" else 2)
    idx = tokens(B=1, T=30, eot_at=(0, 12))
    logits = model(idx)[0]
    later = torch.cat([idx[:, :25], (idx[:, 25:] + 1) % EOT], 1)  # changing the future leaves the past
    torch.testing.assert_close(model(later)[0][:, :25], logits[:, :25])
    other = torch.cat([idx[:, :1], (idx[:, 1:12] + 7) % EOT, idx[:, 12:]], 1)  # and document 1, document 2
    changed = model(other)[0]
    torch.testing.assert_close(changed[:, 12:], logits[:, 12:], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(changed[:, 1:12], logits[:, 1:12])
    unmasked = build(layout=layout, n_layer=4, n_passes=1 if layout == "plain" else 2, document_mask=False)
    assert not torch.allclose(unmasked(other)[0][:, 12:], unmasked(idx)[0][:, 12:])  # [X]: no document mask


def test_document_mask_of_a_batch_is_per_row(monkeypatch):
    """Each row's own document boundaries (one row has none): SDPA gets each row's causal document mask."""
    T, eots = 20, [(0, 7), (12,), ()]
    idx, expected = tokens(B=3, T=T, seed=3), torch.zeros(3, 1, T, T, dtype=torch.bool)
    for row, positions in enumerate(eots):
        idx[row, list(positions)] = EOT
        doc = torch.tensor([sum(p <= t for p in positions) for t in range(T)])  # an eot starts a document
        expected[row, 0] = (doc[:, None] == doc[None, :]).tril()
    calls = record_sdpa(monkeypatch)
    with torch.no_grad():
        build()(idx)  # a CPU: SDPA with the boolean mask (model.FLEX_DEVICES)
    assert calls and all(m is not None and torch.equal(m == 0, expected) for _, m in calls)


@pytest.mark.parametrize("cached", [0, 50])
def test_sdpa_by_blocks_of_queries_equals_one_call(cached):
    """model.sdpa, 128 queries at a time, equals one SDPA call over every key (outputs and gradients), at 300
    queries (a partial last block), GQA, documents and cached keys."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 300, 16, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 2, cached + 300, 16, generator=g, requires_grad=True) for _ in range(2))
    docs = torch.zeros(2, cached + 300, dtype=torch.long)
    docs[0, cached + 70:], docs[0, cached + 260:] = 1, 2  # row 1: one document
    allowed = model_module.attention_mask(docs[:, cached:], docs, cached)
    mask = torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))  # additive, as GPT.forward's
    one_call = lambda q, k, v, mask: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    outs = [[y, *torch.autograd.grad(y.square().sum(), (q, k, v))]
            for y in (model_module.sdpa(q, k, v, mask), one_call(q, k, v, mask))]
    for blocks, whole in zip(*outs):
        torch.testing.assert_close(blocks, whole, rtol=1e-5, atol=1e-5)


def naive_moe(moe, x):
    """Every token through its top-k experts (weights renormalised) one at a time: the obvious reference."""
    flat = x.reshape(-1, x.size(-1))
    w, ids = moe.router(flat).float().softmax(-1).topk(moe.top_k, dim=-1)
    w = w / w.sum(-1, keepdim=True)

    def expert(e, v):  # SwiGLU: gate, up, down
        return moe.w_down[e] @ (F.silu(moe.w_gate_up[e, 0] @ v) * (moe.w_gate_up[e, 1] @ v))

    rows = [sum(w[t, j] * expert(e, v) for j, e in enumerate(ids[t])) for t, v in enumerate(flat)]
    return torch.stack(rows).view_as(x)


def test_moe_sparse_dispatch_equals_naive_reference():
    torch.manual_seed(0)
    moe = MoE(tiny(n_expert=7, top_k=3, expert_hidden=12))
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(2, 9, 32, requires_grad=True)
    out, router = moe(x)
    ref = naive_moe(moe, x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(out)
    for a, b in zip(*(torch.autograd.grad(y, [x, *moe.parameters()], g) for y in (out, ref))):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert router["counts"].sum() == 18 * 3


@pytest.mark.parametrize("width, hidden", [(32, 16), (33, 19)])
@pytest.mark.parametrize("counts", [[7, 0, 13, 1, 16], [37, 0, 0, 0, 0], [0, 0, 0, 0, 37]])
def test_grouped_experts_equal_the_per_expert_loop(counts, width, hidden):
    """model.run_experts against conftest.loop_experts (one expert at a time): outputs and gradients, fp32
    within rounding, bf16 autocast within one bf16 rounding (x's gradient two), experts with 0 or 1 token."""
    from conftest import loop_experts
    g = torch.Generator().manual_seed(sum(counts) + width)
    n, n_tokens = sum(counts), 20
    x = torch.randn(n_tokens, width, generator=g, requires_grad=True)
    weights = [torch.randn(5, 2, hidden, width, generator=g, requires_grad=True),  # gate and up
               torch.randn(5, width, hidden, generator=g, requires_grad=True)]
    token_of = torch.randint(0, n_tokens, (n,), generator=g)
    row_weights = torch.rand(n, generator=g, requires_grad=True)
    upstream = torch.randn(n_tokens, width, generator=g)
    for bf16 in (False, True):
        results = []
        for experts in (loop_experts, model_module.run_experts):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                y = experts(x, token_of, torch.tensor(counts), *weights, row_weights)
            results.append([y, *torch.autograd.grad(y, [x, *weights, row_weights], upstream)])
        for i, (reference, grouped) in enumerate(zip(*results)):
            assert grouped.dtype == reference.dtype == torch.float32
            scale = reference.abs().max().item() + 1e-12
            # x is cast to bf16 before the gather: its gradient (i = 1) is summed in bf16
            bound = 1e-6 if not bf16 else 2 ** -7 if i == 1 else 2 ** -8
            assert (grouped - reference).abs().max().item() <= scale * bound


def test_balance_loss_minimum_for_uniform_router_and_the_fully_activated_reference():
    moe = MoE(tiny(n_expert=8, top_k=2, expert_hidden=8))
    torch.nn.init.zeros_(moe.router.weight)  # uniform router probabilities
    _, router = moe(torch.randn(3, 5, 32))
    assert router["balance"].item() == pytest.approx(1.0, abs=1e-6)  # E * sum f_e / E = 1
    assert router["z_loss"].item() == pytest.approx(math.log(8) ** 2, rel=1e-5)
    _, router = MoE(tiny(n_expert=4, top_k=4, expert_hidden=8))(torch.randn(2, 5, 32))
    assert router["counts"].tolist() == [10, 10, 10, 10]  # [S1]: every expert runs


def test_loss_and_gradients_reach_every_pass_and_every_used_expert():
    """The loss: cross-entropy over the targets that are not -1, plus 0.01 balance and 0.001 z-loss."""
    model = build(layout="pcc", n_layer=3, n_passes=3, n_expert=6, top_k=2, expert_hidden=8).train()
    pass_grads = []
    model.blocks[core_split(3)[0]].register_forward_hook(
        lambda m, inputs, out: out[0].register_hook(lambda g: pass_grads.append(g.norm().item())) and None)
    idx = tokens(B=2, T=32)
    targets = idx.masked_fill(idx < 10, -1)
    logits, loss, stats = model(idx, targets, return_stats=True)
    ce = F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1), ignore_index=-1)
    torch.testing.assert_close(stats["ce"], ce)
    torch.testing.assert_close(loss, ce + 0.01 * stats["balance"] + 0.001 * stats["z_loss"])
    loss.backward()
    assert len(pass_grads) == 3 and all(g > 0 for g in pass_grads)
    executed = [s.block for s in model.plan if s.kind == "block"]
    for i, block in enumerate(model.blocks):
        rows = [n for n, b in enumerate(executed) if b == i]
        received = stats["expert_counts"][rows].sum(0) > 0  # (MoE executions, E)
        got_grad = block.ffn.w_gate_up.grad.flatten(1).abs().sum(1) > 0
        assert rows and torch.equal(received, got_grad)
        assert block.attn.q_proj.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("kw", [
    dict(layout="plain"), dict(layout="smelt", n_passes=2, n_expert=5, top_k=2, expert_hidden=8),
    dict(layout="layer_loop", n_passes=2), dict(layout="pcc", n_layer=3, n_passes=4),
    dict(layout="pcc_untied", n_layer=3, n_passes=2),
    dict(layout="pcc_untied", n_layer=3, n_passes=4, norms="x")])
def test_kv_cache_generation_equals_recomputation(kw):
    model = build(**kw)
    prompt = tokens(B=2, T=10, eot_at=(4,))
    out = model.generate(prompt, 12, temperature=0)
    # each generated token is the argmax of a full forward over everything before it (up to near-ties)
    logits = model(out)[0][:, prompt.size(1) - 1:-1]
    chosen = logits.gather(-1, out[:, prompt.size(1):, None]).squeeze(-1)
    assert out.shape == (2, 22) and torch.all(chosen >= logits.max(-1).values - 1e-5)
    # and the cached logits equal the full forward's, across an eot in the continuation too
    cache, full = KVCache(), tokens(B=2, T=20, eot_at=(4, 13))
    a, b = model(full[:, :9], cache=cache)[0], model(full[:, 9:], cache=cache)[0]
    torch.testing.assert_close(torch.cat([a, b], 1), model(full)[0], rtol=1e-4, atol=1e-5)
    assert len(cache.keys) == model.config.executed_layers()
    with pytest.raises(ValueError, match="block_size"):
        model.generate(tokens(T=60), 10)


def test_num_params_breakdown():
    n = build(n_expert=6, top_k=2, expert_hidden=8, init="x").num_params()
    assert n["embedding"] == 2 * VOCAB * 32 and n["total"] == n["embedding"] + n["non_embedding"]
    assert n["non_embedding"] - n["active"] == 4 * (6 - 2) * 3 * 8 * 32  # unrouted experts
    assert (dense := build(init="x").num_params())["active"] == dense["non_embedding"]
    assert build(init="nanogpt").num_params()["embedding"] == VOCAB * 32  # tied


@pytest.mark.parametrize("kw, field", [
    (dict(n_head=4, n_kv_head=3), "n_kv_head"), (dict(n_expert=4, top_k=5), "top_k"),
    (dict(layout="smelt", n_layer=1), "n_layer"), (dict(layout="pcc", n_passes=0), "n_passes"),
    (dict(n_passes=0), "n_passes"), (dict(layout="spiral"), "layout"), (dict(boundary="maybe"), "boundary"),
    (dict(head_dim=7), "head_dim"), (dict(eot_token=500), "eot_token"),
    (dict(layout="pcc", n_layer=0), "n_layer"), (dict(norms="rms"), "norms")])
def test_bad_configs_name_the_field(kw, field):
    with pytest.raises(ValueError, match=f"^{field}="):
        tiny(**kw)


@pytest.mark.parametrize("kw", [dict(layout="pcc", n_layer=3, n_passes=2),
                                dict(layout="smelt", n_passes=2, n_expert=4, top_k=2, expert_hidden=16)])
def test_x_init_zeroes_exactly_the_writes_to_the_residual_stream_and_the_head(kw):
    """[X] code: zero writes to the residual stream and lm head; U(-s, s), s = 3^0.5 / sqrt(width), for every
    input matrix (router and gate/up too); a normal embedding; norm gains 1."""
    model = GPT(tiny(init="x", **kw))
    bound = 3 ** 0.5 / 32 ** 0.5
    assert "n_expert" not in kw or "blocks.0.ffn.w_down" in model.state_dict()
    for name, p in model.named_parameters():
        if p.dim() == 1:
            assert torch.equal(p, torch.ones_like(p)), name
        elif name.endswith(("o_proj.weight", "w_down.weight", "ffn.w_down")) or name == "lm_head.weight":
            assert torch.equal(p, torch.zeros_like(p)), name
        elif name == "wte.weight":
            assert p.std().item() == pytest.approx(0.02, rel=0.05), name
        else:
            assert p.abs().max() <= bound and p.max() > 0.9 * bound and p.min() < -0.9 * bound, name


def test_checkpoint_round_trip(tmp_path):
    model = build(layout="smelt", n_passes=2, init="nanogpt")  # tied embeddings too
    path = tmp_path / "ckpt.pt"
    torch.save({"model_config": model.config.to_dict(), "model": model.state_dict(), "tokenizer": "t"}, path)
    loaded, info = load_checkpoint(str(path))
    assert torch.equal(loaded(tokens())[0], model(tokens())[0]) and info["tokenizer"] == "t"
    assert loaded.lm_head.weight is loaded.wte.weight
    with pytest.raises(FileNotFoundError, match="missing.pt"):
        load_checkpoint(str(tmp_path / "missing.pt"))


@pytest.mark.filterwarnings("ignore")
def test_flex_attention_path_equals_sdpa_path(monkeypatch):
    """FlexAttention (CUDA's path) computes SDPA's masked attention; forward only (no CPU backward)."""
    model = build(layout="smelt", n_passes=2)
    idx = tokens(B=2, T=40, eot_at=(0, 11, 29))
    calls = record_sdpa(monkeypatch)
    with torch.no_grad():
        sdpa, n_calls = model(idx)[0], len(calls)
        monkeypatch.setattr(model_module, "FLEX_DEVICES", ("cuda", "cpu"))
        torch.testing.assert_close(model(idx)[0], sdpa, rtol=1e-4, atol=1e-5)
    assert n_calls and len(calls) == n_calls  # the flex path ran


def test_model_py_works_copied_alone(tmp_path):
    """Alone in an empty folder model.py builds and trains every layout family, and the Triton kernels are
    never imported (kernels.apply is the only way they come in)."""
    import subprocess
    import sys
    (tmp_path / "model.py").write_text(open(os.path.join(REPO, "model.py")).read())
    script = """import sys, torch
from model import GPT, ModelConfig
torch.manual_seed(0)
for kw in [dict(layout="smelt", n_passes=2, n_expert=4, top_k=2), dict(layout="pcc", n_passes=2, norms="x"),
           dict(layout="layer_loop", n_passes=2), dict()]:
    model = GPT(ModelConfig(vocab_size=64, eot_token=63, block_size=16, n_embd=32, n_head=2, **kw))
    opt, idx, losses = torch.optim.AdamW(model.parameters(), lr=3e-3), torch.randint(0, 63, (4, 16)), []
    for _ in range(20):
        loss = model(idx, idx)[1]; opt.zero_grad(); loss.backward(); opt.step(); losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, (kw, losses)
assert "kernels" not in sys.modules  # (torch.optim may import triton itself)
print("ok")"""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


PREAMBLE = ("import math\nfrom dataclasses import dataclass\nfrom typing import Optional\nimport torch\n"
            "import torch.nn as nn\nimport torch.nn.functional as F\n")
# the pieces a user copies, each with what it needs: the copy tests fail if a piece comes to need more
MOE_PIECE = ("MoE run_experts compute_dtype grouped_mm GROUPED_MM _grouped_mm_op _ _grouped_mm_backward"
             " _grouped_mm_save")
LOOP_PIECE = MOE_PIECE + (" NORM_EPS RMSNorm rope_tables apply_rope Attention sdpa _compiled_flex"
                          " flex_attention MLP Block scaled ForwardContext Step execution_plan core_split")


def copied(names, tmp_path):
    """PREAMBLE and model.py's top-level statements that define (or register with) `names`, as a module.
    Every global the copy reads must be defined in it: a piece that comes to need more fails here."""
    kept = []
    for node in ast.parse(open(os.path.join(REPO, "model.py")).read()).body:
        call = node.value.func if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) else None
        defined = {getattr(node, "name", None), getattr(getattr(call, "value", None), "id", None)}
        defined |= {getattr(t, "id", None) for t in getattr(node, "targets", [])}
        if defined & set(names.split()):
            kept.append(ast.unparse(node))
    code = PREAMBLE + "\n".join(kept)
    nodes = list(ast.walk(ast.parse(code)))
    bound = set(dir(builtins)) | {getattr(n, "name", None) or getattr(n, "arg", None) for n in nodes}
    bound |= {n.asname for n in nodes if isinstance(n, ast.alias)}
    bound |= {n.id for n in nodes if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load)}
    assert {n.id for n in nodes if isinstance(n, ast.Name)} <= bound
    (path := tmp_path / f"piece_{tmp_path.name}.py").write_text(code)
    module = importlib.util.module_from_spec(spec := importlib.util.spec_from_file_location(path.stem, path))
    spec.loader.exec_module(module)
    return module


def trains_one_step(module, loss_fn):
    """Finite at init and after one SGD step; the names of the parameters the step changed."""
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    assert all(torch.isfinite(p).all() for p in before.values())
    (loss := loss_fn()).backward()
    torch.optim.SGD(module.parameters(), lr=0.1).step()
    assert torch.isfinite(loss) and all(torch.isfinite(p).all() for p in module.parameters())
    return {n for n, p in module.named_parameters() if not torch.equal(p, before[n])}


def test_the_moe_works_copied_alone(tmp_path):
    """The MoE's definitions alone, with a short config: its own [X] init (a zero w_down) and its weighted
    router losses."""
    piece = copied(MOE_PIECE, tmp_path)
    cfg = SimpleNamespace(n_embd=32, n_expert=4, top_k=2, expert_hidden=16, uniform_init_scale=3 ** 0.5)
    torch.manual_seed(0)
    moe, x = piece.MoE(cfg), torch.randn(2, 8, 32)
    assert not moe.w_down.any() and moe.w_gate_up.abs().max() <= 3 ** 0.5 / 32 ** 0.5

    def loss():
        out, router = moe(x)
        return piece.MoE.add_router_loss((out - x).square().mean(), router["balance"], router["z_loss"])

    assert trains_one_step(moe, loss) == {"router.weight", "w_down"}  # a zero w_down: no gate/up gradient


@pytest.mark.parametrize("layout", ["smelt", "pcc"])
def test_the_looped_stack_works_copied_alone(tmp_path, layout):
    """Block, the boundary operator and the plan alone, with a short config: SMELT (an MoE, the middle half
    twice) and prelude-core-coda (1/1/1, the core twice, BO before the second pass and the coda)."""
    piece = copied(LOOP_PIECE + " BoundaryOperator", tmp_path)
    cfg = SimpleNamespace(n_embd=32, n_head=2, n_kv_head=1, head_dim=16, qk_norm=False, norm_gain=True,
                          residual_multiplier=1.0, mlp_hidden=64, n_expert=4, top_k=2, expert_hidden=16,
                          uniform_init_scale=3 ** 0.5, layout=layout, n_layer=4 if layout == "smelt" else 3,
                          n_passes=2, loop_scale="auto", boundary="both", boundary_alpha=0.5,
                          most_passes=2, tie_core=True, loop_start=1, loop_span=2)
    plan = piece.execution_plan(cfg)
    expected = {"smelt": [(0, 1.0), (1, 0.5), (2, 0.5), (1, 0.5), (2, 0.5), (3, 1.0)],
                "pcc": [(0, 1.0), (1, 1.0), (1, 1.0), (2, 1.0)]}[layout]
    assert [(s.block, s.scale) for s in plan if s.kind == "block"] == expected
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList([*map(piece.Block, [cfg] * cfg.n_layer), piece.BoundaryOperator(cfg)])
    ctx, x = piece.ForwardContext(*piece.rope_tables(16, 8), None), torch.randn(2, 8, 32)

    def loss():
        h = anchor = x
        for step in plan:
            if step.kind == "block":
                h, _ = blocks[step.block](h, step.scale, ctx)
            elif step.kind == "anchor":
                anchor = h
            else:
                h = blocks[-1](h, anchor, step.norm, step.inject)
        return (h - x.roll(1, 1)).square().mean()

    changed = trains_one_step(blocks, loss)
    assert {f"{i}.attn.q_proj.weight" for i in range(cfg.n_layer)} <= changed
    assert ("3.norm.weight" if layout == "pcc" else "3.ffn.w_down") in changed  # BO's norm; a zero w_down


def test_the_chunked_cross_entropy_equals_the_whole_one_and_compiles_to_one(monkeypatch):
    """Past CE_CHUNK logits the eager loss runs chunk by chunk: one cross-entropy's loss and gradient, with
    ignored targets and a shorter last chunk. Compiled, it is one cross-entropy with no checkpoint."""
    logits = torch.randn(3, 37, 50, dtype=torch.float64).float().requires_grad_()
    targets = torch.randint(0, 50, (3, 37))
    targets[0, :5] = -1
    whole = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-1)
    monkeypatch.setattr(model_module, "CE_CHUNK", 50 * 8)  # 8 tokens a chunk: 14 chunks, the last of 7
    chunked = model_module.cross_entropy(logits, targets)
    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=0)
    torch.testing.assert_close(torch.autograd.grad(chunked, logits)[0], torch.autograd.grad(whole, logits)[0],
                               rtol=1e-5, atol=1e-8)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # bf16 logits: each chunk's loss in fp32
        assert model_module.cross_entropy(logits.bfloat16(), targets).dtype == torch.float32
    graphs = []
    compiled = torch.compile(model_module.cross_entropy, fullgraph=True,
                             backend=lambda gm, inputs: graphs.append(gm) or gm)
    loss = compiled(logits.detach(), targets)
    calls = [node.target for node in graphs[0].graph.nodes if node.op == "call_function"]
    assert len(graphs) == 1 and calls.count(F.cross_entropy) == 1, calls
    assert not any("checkpoint" in str(target) for target in calls), calls
    torch.testing.assert_close(loss, chunked.detach(), rtol=1e-6, atol=0)


def test_replace_derives_the_unset_sizes_again_and_keeps_the_given_ones():
    wider = ModelConfig(n_embd=128, n_head=4, head_dim=0, n_kv_head=2).replace(n_embd=256)
    assert (wider.head_dim, wider.mlp_hidden, wider.expert_hidden, wider.n_kv_head) == (64, 688, 86, 2)
    assert ModelConfig(head_dim=48).replace(n_embd=256).head_dim == 48
    assert ModelConfig(**wider.to_dict()) == wider and type(wider.eot_token) is int
