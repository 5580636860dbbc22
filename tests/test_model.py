import math
import os

import pytest
import torch
import torch.nn.functional as F

import model as model_module
from model import GPT, MoE, ForwardContext, ModelConfig, core_split, execution_plan, load_checkpoint
from probe import record_blocks

VOCAB, EOT = 97, 96
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny(**kw):
    base = dict(vocab_size=VOCAB, eot_token=EOT, block_size=64, n_layer=4, n_embd=32, n_head=4, n_kv_head=2,
                head_dim=8, mlp_hidden=48, init="nanogpt")
    base.update(kw)
    return ModelConfig(**base)


def build(seed=0, **kw):
    torch.manual_seed(seed)
    return GPT(tiny(**kw)).eval()


def tokens(B=2, T=24, seed=1, eot_at=()):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, EOT, (B, T), generator=g)
    for p in eot_at:
        idx[:, p] = EOT
    return idx


# ---- layouts


@pytest.mark.parametrize("L, first, last", [(10, 3, 7), (12, 4, 9), (20, 6, 15), (30, 8, 22)])
def test_smelt_loops_the_middle_half(L, first, last):
    cfg = ModelConfig(n_layer=L, n_embd=64, n_head=4, layout="smelt", n_passes=2)
    plan = [s for s in execution_plan(cfg) if s.kind == "block"]
    looped = sorted({s.block + 1 for s in plan if s.visit == 2})  # 1-based
    assert looped == list(range(first, last + 1))
    assert len(plan) == L + (last - first + 1) == cfg.executed_layers()
    # model-loop: the whole span runs, then the whole span again, each update scaled by 1/2
    order = [s.block + 1 for s in plan]
    span = list(range(first, last + 1))
    assert order == list(range(1, first)) + span + span + list(range(last + 1, L + 1))
    assert all(s.scale == 0.5 for s in plan if s.block + 1 in span)


def test_layer_loop_repeats_each_layer_in_place():
    cfg = tiny(n_layer=4, layout="layer_loop", n_passes=3)
    order = [(s.block, s.visit) for s in execution_plan(cfg) if s.kind == "block"]
    assert order == [(0, 1), (1, 1), (1, 2), (1, 3), (2, 1), (2, 2), (2, 3), (3, 1)]


@pytest.mark.parametrize("layout", ["smelt", "layer_loop"])
def test_every_update_inside_the_loop_is_scaled_by_one_over_r(layout):
    """[S8]-[S9] in the forward itself: each block execution receives the scale its Step says, 1/r inside
    the loop span, 1 outside; and the update a block writes is its unscaled update times that scale."""
    model = build(n_layer=4, layout=layout, n_passes=3)
    seen = []
    hooks = [b.register_forward_pre_hook(lambda m, args, i=i: seen.append((i, args[1]))) for i, b in enumerate(model.blocks)]
    model(tokens(B=1, T=8))
    for h in hooks:
        h.remove()
    looped = set(range(model.config.loop_start, model.config.loop_start + model.config.loop_span))
    assert seen == [(i, 1 / 3 if i in looped else 1.0) for i in [s.block for s in model.plan if s.kind == "block"]]
    x = torch.randn(1, 8, 32)
    ctx = ForwardContext(model.rope_cos[:8], model.rope_sin[:8], None)
    block = model.blocks[1]
    full = block(x, 1.0, ctx)[0] - x
    third = block(x, 1 / 3, ctx)[0] - x
    assert not torch.allclose(third, full) and third.norm() < full.norm()  # the MoE/MLP sees the scaled write


def test_rope_is_a_rotation_that_sees_only_relative_positions():
    """RoPE keeps every vector's norm, and <rope(q, i), rope(k, j)> depends on i - j only."""
    from model import apply_rope, rope_tables
    cos, sin = rope_tables(16, 128)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 1, 1, 16, generator=g), torch.randn(1, 1, 1, 16, generator=g)

    def at(x, i):
        return apply_rope(x, cos[i:i + 1], sin[i:i + 1])

    torch.testing.assert_close(at(q, 37).norm(), q.norm())
    scores = {(i, j): (at(q, i) * at(k, j)).sum().item() for i in (3, 10, 40) for j in (0, 7, 33)}
    for (i, j), score in scores.items():
        assert score == pytest.approx((at(q, i - j + 50) * at(k, 50)).sum().item(), abs=1e-4)
    assert len({round(v, 4) for v in scores.values()}) > 3  # the position matters at all


def record_sdpa(monkeypatch):
    """The (q, attn_mask) of every call to F.scaled_dot_product_attention from now on (the call itself unchanged)."""
    calls, sdpa = [], F.scaled_dot_product_attention

    def recording(q, *args, attn_mask=None, **kwargs):
        calls.append((q, attn_mask))
        return sdpa(q, *args, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    return calls


def test_rope_is_its_definition(monkeypatch):
    """RoPE as model.py defines it (the [X] code's and nanochat's apply_rotary_emb, qlabs-eng/scaling-exponents
    models/layers.py): position p turns the pair (x_i, x_{i + D/2}) of the two halves by p theta_i,
    theta_i = base^(-2i/D), as y_i = x_i cos + x_{i+D/2} sin, y_{i+D/2} = x_{i+D/2} cos - x_i sin: the queries
    the first block hands SDPA against that written out with math.cos / math.sin. Position 1, pair 0: 1 rad."""
    model = build(head_dim=8, n_layer=1)  # base 10000: theta = 1, 0.1, 0.01, 0.001; no QK-norm
    projected = []
    model.blocks[0].attn.q_proj.register_forward_hook(lambda module, inputs, out: projected.append(out))
    calls = record_sdpa(monkeypatch)
    with torch.no_grad():
        model(tokens(B=1, T=41))
    x, rotated = projected[0].view(41, 4, 8), calls[0][0][0]  # (T, head, D) before, (head, T, D) after
    for p in (1, 3, 40):
        for i, theta in enumerate((1.0, 0.1, 0.01, 0.001)):
            a, b, angle = x[p, 0, i].item(), x[p, 0, i + 4].item(), p * theta
            assert rotated[0, p, i].item() == pytest.approx(a * math.cos(angle) + b * math.sin(angle), abs=1e-5)
            assert rotated[0, p, i + 4].item() == pytest.approx(b * math.cos(angle) - a * math.sin(angle), abs=1e-5)


def test_document_mask_off_attends_across_documents():
    """document_mask=False ([X]): a later document sees an earlier one; True ([S]): it does not."""
    idx = tokens(B=1, T=16, eot_at=(8,))
    changed = idx.clone()
    changed[0, 2] = (changed[0, 2] + 1) % EOT  # a token of the first document
    for mask in (True, False):
        model = build(document_mask=mask)
        after = model(changed)[0][0, 9:] - model(idx)[0][0, 9:]  # the second document's logits
        assert (after.abs().max() < 1e-6) == mask


def test_n_logits_cuts_the_padded_vocabulary_before_the_softmax():
    """[X] code: logits[..., :vocab] of a padded head; the loss is the CE over the real vocabulary."""
    model = build(vocab_size=128, eot_token=EOT, n_logits=100)
    idx = tokens(B=2, T=12)
    logits, loss = model(idx, idx)
    assert logits.shape[-1] == 100
    torch.testing.assert_close(loss, F.cross_entropy(logits.flatten(0, 1), idx.flatten()))
    assert model.generate(idx[:, :4], 8, temperature=1.0).max() < 100


@pytest.mark.parametrize("depth, split", [(6, (2, 2, 2)), (7, (2, 3, 2)), (8, (2, 3, 3)), (10, (3, 4, 3))])
def test_prelude_core_coda_split(depth, split):
    cfg = ModelConfig(n_layer=depth, n_embd=64, n_head=4, layout="pcc", n_passes=2)
    assert core_split(depth) == split
    assert cfg.executed_layers() == split[0] + 2 * split[1] + split[2]  # [X2]


def test_smelt_r1_is_the_baseline_bit_for_bit():
    base = build(layout="plain")
    looped = GPT(tiny(layout="smelt", n_passes=1)).eval()
    looped.load_state_dict(base.state_dict())
    idx = tokens(eot_at=(9,))
    assert torch.equal(base(idx)[0], looped(idx)[0])


def test_smelt_r2_matches_hand_unrolled_S8_S9():
    model = build(layout="smelt", n_passes=2, n_layer=4, n_expert=6, top_k=2, expert_hidden=16)
    idx = tokens()
    T = idx.size(1)
    ctx = ForwardContext(model.rope_cos[:T], model.rope_sin[:T], None)
    x = model.wte(idx)
    for layer in [0, 1, 2, 1, 2, 3]:  # L=4, m=2: prelude 1 layer, layers 2-3 twice, then layer 4
        block = model.blocks[layer]
        scale = 0.5 if layer in (1, 2) else 1.0
        d_attn = scale * block.attn(block.norm1(x), ctx)  # [S8]
        d_moe = scale * block.ffn(block.norm2(x + d_attn))[0]  # [S9] sees the scaled attention write
        x = x + d_attn + d_moe
    expected = model.lm_head(model.norm_f(x))
    torch.testing.assert_close(model(idx)[0], expected, rtol=1e-5, atol=1e-5)


# ---- tied vs untied cores, boundary operator


def test_untied_copies_of_the_tied_core_compute_the_same_function():
    K = 3
    tied = build(layout="pcc", n_layer=5, n_passes=K)
    untied = GPT(tiny(layout="pcc_untied", n_layer=5, n_passes=K)).eval()
    P, C, _ = core_split(5)
    src = tied.state_dict()
    dst = {}
    for name in untied.state_dict():
        if name.startswith("blocks."):
            i, rest = name.split(".", 2)[1:]
            i = int(i)
            if i < P:
                j = i
            elif i < P + K * C:
                j = P + (i - P) % C
            else:
                j = i - (K - 1) * C
            dst[name] = src[f"blocks.{j}.{rest}"]
        else:
            dst[name] = src[name]
    untied.load_state_dict(dst)
    idx = tokens(eot_at=(5,))
    torch.testing.assert_close(tied(idx)[0], untied(idx)[0], rtol=1e-5, atol=1e-5)
    core_params = sum(p.numel() for b in list(tied.blocks)[P:P + C] for p in b.parameters())
    assert untied.num_params()["total"] - tied.num_params()["total"] == (K - 1) * core_params


def pcc_records(boundary="both", alpha=0.7, K=2):
    model = build(layout="pcc", n_layer=3, n_passes=K, boundary=boundary, boundary_alpha=alpha, norms="x")
    with record_blocks(model) as records:
        logits = model(tokens())[0]
    return model, records, logits


def rms(x):
    return F.rms_norm(x, (x.size(-1),), eps=1e-6)


def test_boundary_both_first_pass_sees_e_then_bo_before_each_pass_and_the_coda():
    """The [X] code's h0: the first core pass sees the prelude output e; BO(h, e) = RMSNorm(h) + alpha e
    [X3] before every later pass and before the coda."""
    model, rec, _ = pcc_records("both", alpha=0.7)
    e = rec[0]["resid_out"]
    assert torch.equal(rec[1]["resid_in"], e)
    torch.testing.assert_close(rec[2]["resid_in"], rms(rec[1]["resid_out"]) + 0.7 * e)  # [X3]
    torch.testing.assert_close(rec[3]["resid_in"], rms(rec[2]["resid_out"]) + 0.7 * e)


def test_boundary_switches():
    _, rec, _ = pcc_records("norm")  # no injection: h starts at e and is only renormalised
    torch.testing.assert_close(rec[2]["resid_in"], rms(rec[1]["resid_out"]))
    torch.testing.assert_close(rec[3]["resid_in"], rms(rec[2]["resid_out"]))
    _, rec, _ = pcc_records("inject", alpha=0.5)
    e = rec[0]["resid_out"]
    torch.testing.assert_close(rec[2]["resid_in"], rec[1]["resid_out"] + 0.5 * e)
    _, rec, _ = pcc_records("none")  # a plain deep transformer
    assert torch.equal(rec[1]["resid_in"], rec[0]["resid_out"])
    assert torch.equal(rec[3]["resid_in"], rec[2]["resid_out"])
    outputs = [pcc_records(b)[2] for b in ("both", "norm", "inject", "none")]
    for i in range(4):
        for j in range(i):
            assert not torch.allclose(outputs[i], outputs[j])


def test_test_time_passes_override():
    model = build(layout="pcc", n_layer=3, n_passes=2)
    idx = tokens()
    with record_blocks(model) as records:
        model(idx, n_passes=4)
    assert [r["visit"] for r in records if r["block"] == 1] == [1, 2, 3, 4]
    assert torch.equal(model(idx, n_passes=2)[0], model(idx)[0])
    untied = build(layout="pcc_untied", n_layer=3, n_passes=2)
    untied(idx, n_passes=1)  # fewer passes than allocated cores is fine
    with pytest.raises(ValueError, match="1 to 2 passes"):
        untied(idx, n_passes=3)


# ---- masking


@pytest.mark.parametrize("layout", ["plain", "smelt", "pcc"])
def test_causal_and_document_mask(layout):
    model = build(layout=layout, n_layer=4, n_passes=1 if layout == "plain" else 2)
    idx = tokens(B=1, T=30, eot_at=(0, 12))
    logits = model(idx)[0]
    later = idx.clone()
    later[0, 25:] = (later[0, 25:] + 1) % EOT  # changing the future leaves the past unchanged
    torch.testing.assert_close(model(later)[0][:, :25], logits[:, :25])
    other = idx.clone()
    other[0, 1:12] = (other[0, 1:12] + 7) % EOT  # changing document 1 leaves document 2 unchanged
    changed = model(other)[0]
    torch.testing.assert_close(changed[:, 12:], logits[:, 12:], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(changed[:, 1:12], logits[:, 1:12])


def test_document_mask_of_a_batch_is_per_row(monkeypatch):
    """Rows of one batch with their own document boundaries (one row with none): the mask SDPA gets is, row by
    row, causal within each document, built here from the eot positions; and each document's logits are those
    of the document run alone (RoPE sees relative positions only)."""
    T, eots = 20, [(0, 7), (12,), ()]
    idx = tokens(B=3, T=T, seed=3)
    expected = torch.zeros(3, 1, T, T, dtype=torch.bool)
    for row, positions in enumerate(eots):
        idx[row, list(positions)] = EOT
        doc = [sum(p <= t for p in positions) for t in range(T)]  # an eot starts a document
        for i in range(T):
            for j in range(i + 1):
                expected[row, 0, i, j] = doc[i] == doc[j]
    calls = record_sdpa(monkeypatch)
    model = build()  # a CPU: SDPA with the boolean mask (model.FLEX_DEVICES)
    with torch.no_grad():
        logits = model(idx)[0]
        assert calls and all(m is not None and torch.equal(m == 0, expected) for _, m in calls)
        for row, positions in enumerate(eots):
            for start, end in zip((0, *positions), (*positions, T)):
                if end > start:
                    alone = model(idx[row:row + 1, start:end])[0][0]
                    torch.testing.assert_close(logits[row, start:end], alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cached", [0, 50])
def test_sdpa_by_blocks_of_queries_equals_one_call(cached):
    """model.sdpa runs SDPA under the mask 128 queries at a time, each block with the keys up to its last
    query only (SDPA skips the keys past the diagonal under is_causal alone): the outputs and gradients of
    one call over every key, at 300 queries (a partial last block), GQA, documents and cached keys."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 300, 16, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 2, cached + 300, 16, generator=g, requires_grad=True) for _ in range(2))
    docs = torch.zeros(2, cached + 300, dtype=torch.long)
    docs[0, cached + 70:], docs[0, cached + 260:] = 1, 2  # row 1: one document
    allowed = model_module.attention_mask(docs[:, cached:], docs, cached)
    mask = torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))  # additive, as GPT.forward's
    one_call = lambda q, k, v, mask: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    outs = []
    for attention in (model_module.sdpa, one_call):
        y = attention(q, k, v, mask)
        outs.append([y, *torch.autograd.grad(y.square().sum(), (q, k, v))])
    for blocks, whole in zip(*outs):
        torch.testing.assert_close(blocks, whole, rtol=1e-5, atol=1e-5)


# ---- MoE


def naive_moe(moe, x, renormalize):
    """Every token through its top-k experts one at a time: the obviously correct reference (the
    renormalisation is the test's setting, not read back from the module under test)."""
    flat = x.reshape(-1, x.size(-1))
    probs = moe.router(flat).float().softmax(-1)
    w, ids = probs.topk(moe.top_k, dim=-1)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    rows = []
    for t in range(flat.size(0)):
        acc = torch.zeros_like(flat[t])
        for j in range(moe.top_k):
            e = ids[t, j]
            h = F.silu(moe.w_gate_up[e, 0] @ flat[t]) * (moe.w_gate_up[e, 1] @ flat[t])  # gate, up
            acc = acc + w[t, j] * (moe.w_down[e] @ h)
        rows.append(acc)
    return torch.stack(rows).view_as(x)


def test_moe_sparse_dispatch_equals_naive_reference():
    torch.manual_seed(0)
    moe = MoE(tiny(n_expert=7, top_k=3, expert_hidden=12))
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(2, 9, 32, requires_grad=True)
    out, router = moe(x)
    ref = naive_moe(moe, x, True)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, [x] + list(moe.parameters()), g)
    grads_ref = torch.autograd.grad(ref, [x] + list(moe.parameters()), g)
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert router["counts"].sum() == 18 * 3


@pytest.mark.parametrize("width, hidden", [(32, 16), (33, 19)])
@pytest.mark.parametrize("counts", [[7, 0, 13, 1, 16], [37, 0, 0, 0, 0], [0, 0, 0, 0, 37]])
def test_grouped_experts_equal_the_per_expert_loop(counts, width, hidden):
    """model.run_experts (grouped GEMMs, no host read) against conftest.loop_experts (one expert at a time):
    outputs and every gradient, in fp32 within rounding and under bf16 autocast within one bf16 rounding (the
    input's gradient two), experts with 0 and 1 tokens among them."""
    from conftest import loop_experts
    from model import run_experts
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
        for experts in (loop_experts, run_experts):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                y = experts(x, token_of, torch.tensor(counts), *weights, row_weights)
            results.append([y, *torch.autograd.grad(y, [x, *weights, row_weights], upstream)])
        for i, (reference, grouped) in enumerate(zip(*results)):
            assert grouped.dtype == reference.dtype == torch.float32
            scale = reference.abs().max().item() + 1e-12
            # x is cast to bf16 once, before the gather: its gradient (i = 1) is summed in bf16 (a token's
            #   rows'), within two roundings (measured up to 0.89 of one with gate and up in one GEMM)
            bound = 1e-6 if not bf16 else 2 ** -7 if i == 1 else 2 ** -8
            assert (grouped - reference).abs().max().item() <= scale * bound


def test_balance_loss_minimum_for_uniform_router():
    moe = MoE(tiny(n_expert=8, top_k=2, expert_hidden=8))
    torch.nn.init.zeros_(moe.router.weight)  # uniform router probabilities
    torch.nn.init.normal_(moe.w_gate_up)
    _, router = moe(torch.randn(3, 5, 32))
    assert router["balance"].item() == pytest.approx(1.0, abs=1e-6)  # E * sum f_e / E = 1
    assert router["z_loss"].item() == pytest.approx(math.log(8) ** 2, rel=1e-5)


def test_fully_activated_reference_runs_every_expert():
    moe = MoE(tiny(n_expert=4, top_k=4, expert_hidden=8))
    _, router = moe(torch.randn(2, 5, 32))
    assert router["counts"].tolist() == [10, 10, 10, 10]


# ---- gradients


def test_gradients_reach_every_pass_and_every_used_expert():
    model = build(layout="pcc", n_layer=3, n_passes=3, n_expert=6, top_k=2, expert_hidden=8)
    model.train()
    core = model.blocks[core_split(3)[0]]
    pass_grads = []

    def keep_grad(module, inputs, output):
        output[0].register_hook(lambda g: pass_grads.append(g.norm().item()))  # (residual stream, router)

    handle = core.register_forward_hook(keep_grad)
    idx = tokens(B=2, T=32)
    _, loss, stats = model(idx, idx, return_stats=True)
    loss.backward()
    handle.remove()
    assert len(pass_grads) == 3 and all(g > 0 for g in pass_grads)
    counts = stats["expert_counts"]  # (MoE executions, E)
    for i, block in enumerate(model.blocks):
        used = [s for s in model.plan if s.kind == "block" and s.block == i]
        rows = [n for n, s in enumerate([s for s in model.plan if s.kind == "block"]) if s.block == i]
        received = counts[rows].sum(0) > 0
        got_grad = block.ffn.w_gate_up.grad.flatten(1).abs().sum(1) > 0
        assert used and torch.equal(received, got_grad)


def test_untied_cores_all_receive_gradients():
    model = build(layout="pcc_untied", n_layer=3, n_passes=3)
    idx = tokens()
    model(idx, idx)[1].backward()
    for block in model.blocks:
        assert block.attn.q_proj.weight.grad.abs().sum() > 0


# ---- generation with a KV cache


@pytest.mark.parametrize("kw", [dict(layout="plain"),
                                dict(layout="smelt", n_passes=2, n_expert=5, top_k=2, expert_hidden=8),
                                dict(layout="layer_loop", n_passes=2),
                                dict(layout="pcc", n_layer=3, n_passes=2),
                                dict(layout="pcc", n_layer=3, n_passes=4),
                                dict(layout="pcc_untied", n_layer=3, n_passes=2),
                                dict(layout="pcc_untied", n_layer=3, n_passes=4, norms="x")])
def test_kv_cache_generation_equals_recomputation(kw):
    model = build(**kw)
    prompt = tokens(B=2, T=10, eot_at=(4,))
    out = model.generate(prompt, 12, temperature=0)
    # each generated token is the argmax of a full forward over everything before it (a near-tie may
    # break either way: the cached and the full forward add in different orders)
    logits = model(out)[0][:, prompt.size(1) - 1:-1]
    chosen = logits.gather(-1, out[:, prompt.size(1):, None]).squeeze(-1)
    assert out.shape == (2, 22) and torch.all(chosen >= logits.max(-1).values - 1e-5)
    # and the cached logits equal the full forward's, including across an eot in the continuation
    from model import KVCache
    cache = KVCache()
    full = tokens(B=2, T=20, eot_at=(4, 13))
    a = model(full[:, :9], cache=cache)[0]
    b = model(full[:, 9:], cache=cache)[0]
    torch.testing.assert_close(torch.cat([a, b], 1), model(full)[0], rtol=1e-4, atol=1e-5)
    assert len(cache.keys) == model.config.executed_layers()


def test_generate_respects_block_size():
    model = build()
    with pytest.raises(ValueError, match="block_size"):
        model.generate(tokens(T=60), 10)


# ---- probes, params, configs, checkpoints


def test_num_params_breakdown():
    model = build(n_expert=6, top_k=2, expert_hidden=8, init="x")
    n = model.num_params()
    assert n["total"] == sum(p.numel() for p in model.parameters())
    assert n["embedding"] == 2 * VOCAB * 32
    per_expert = 3 * 8 * 32
    assert n["non_embedding"] - n["active"] == 4 * (6 - 2) * per_expert
    dense = build(init="x").num_params()
    assert dense["active"] == dense["non_embedding"]
    tied = GPT(tiny(init="nanogpt")).num_params()
    assert tied["embedding"] == VOCAB * 32


@pytest.mark.parametrize("kw, field", [
    (dict(n_head=4, n_kv_head=3), "n_kv_head"),
    (dict(n_expert=4, top_k=5), "top_k"),
    (dict(layout="smelt", n_layer=1), "n_layer"),
    (dict(layout="pcc", n_passes=0), "n_passes"),
    (dict(n_passes=0), "n_passes"),
    (dict(layout="spiral"), "layout"),
    (dict(boundary="maybe"), "boundary"),
    (dict(head_dim=7), "head_dim"),
    (dict(eot_token=500), "eot_token"),
    (dict(layout="pcc", n_layer=0), "n_layer"),
    (dict(norms="rms"), "norms"),
])
def test_bad_configs_name_the_field(kw, field):
    with pytest.raises(ValueError, match=f"^{field}="):
        tiny(**kw)


@pytest.mark.parametrize("kw", [dict(layout="pcc", n_layer=3, n_passes=2),
                                dict(layout="smelt", n_passes=2, n_expert=4, top_k=2, expert_hidden=16)])
def test_x_init_zeroes_exactly_the_writes_to_the_residual_stream_and_the_head(kw):
    """[X] code: zero c_proj (every write to the residual stream: attention out, the dense and each expert's
    down projection) and lm head; U(-s, s), s = 3^0.5 / sqrt(width), for every input matrix, the MoE's router
    and gate/up included; a normal embedding; norm gains 1."""
    model = GPT(tiny(init="x", **kw))
    bound, names = 3 ** 0.5 / 32 ** 0.5, [n for n, _ in model.named_parameters()]
    assert not kw.get("n_expert") or {"blocks.0.ffn.w_down", "blocks.0.ffn.router.weight"} <= set(names)
    for name, p in model.named_parameters():
        writes = name.rsplit(".", 2)[-2:] in (["o_proj", "weight"], ["w_down", "weight"]) or \
            name.endswith("ffn.w_down") or name == "lm_head.weight"
        if p.dim() == 1:
            assert torch.equal(p, torch.ones_like(p)), name
        elif writes:
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
    idx = tokens()
    assert torch.equal(loaded(idx)[0], model(idx)[0]) and info["tokenizer"] == "t"
    assert loaded.lm_head.weight is loaded.wte.weight
    with pytest.raises(FileNotFoundError, match="missing.pt"):
        load_checkpoint(str(tmp_path / "missing.pt"))


def test_loss_ignores_minus_one_and_includes_router_losses():
    model = build(n_expert=4, top_k=2, expert_hidden=8)
    idx = tokens()
    targets = idx.clone()
    targets[:, :5] = -1
    logits, loss, s = model(idx, targets, return_stats=True)
    ce = F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1), ignore_index=-1)
    torch.testing.assert_close(s["ce"], ce)
    torch.testing.assert_close(loss, ce + model_module.BALANCE_LOSS_COEF * s["balance"]
                               + model_module.Z_LOSS_COEF * s["z_loss"])


def test_flex_attention_path_equals_sdpa_path(monkeypatch):
    """FlexAttention (the CUDA fast path) computes the same document-masked attention as SDPA.
    Forward only: FlexAttention has no backward on CPU in torch 2.13."""
    import warnings
    model = build(layout="smelt", n_passes=2)
    idx = tokens(B=2, T=40, eot_at=(0, 11, 29))
    calls = record_sdpa(monkeypatch)
    with torch.no_grad():
        sdpa = model(idx)[0]
    assert calls
    monkeypatch.setattr(model_module, "FLEX_DEVICES", ("cuda", "cpu"))
    calls.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.no_grad():
            torch.testing.assert_close(model(idx)[0], sdpa, rtol=1e-4, atol=1e-5)
    assert not calls  # the flex path ran



def test_model_py_works_copied_alone(tmp_path):
    """model.py is the file people copy: alone in an empty folder it builds and trains every layout
    family, and the Triton kernels are never imported (kernels.apply is the only way they come in)."""
    import shutil
    import subprocess
    import sys
    shutil.copy(os.path.join(REPO, "model.py"), tmp_path / "model.py")
    script = """
import sys, torch
from model import GPT, ModelConfig
torch.manual_seed(0)
for kw in [dict(layout="smelt", n_passes=2, n_expert=4, top_k=2), dict(layout="pcc", n_passes=2, norms="x"),
           dict(layout="layer_loop", n_passes=2), dict()]:
    model = GPT(ModelConfig(vocab_size=64, eot_token=63, block_size=16, n_embd=32, n_head=2, **kw))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    idx = torch.randint(0, 63, (4, 16))
    losses = []
    for _ in range(20):
        _, loss = model(idx, idx)
        opt.zero_grad(); loss.backward(); opt.step(); losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, (kw, losses)
assert "kernels" not in sys.modules  # (torch.optim may import triton itself)
print("ok")
"""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


def test_the_chunked_cross_entropy_equals_the_whole_one(monkeypatch):
    """Past CE_CHUNK logits the loss runs chunk by chunk (an fp32 copy of one chunk at a time): the same
    loss and logits' gradient as one cross-entropy over everything, to fp32 rounding, ignored targets
    and a last chunk shorter than the others included."""
    logits = torch.randn(3, 37, 50, dtype=torch.float64).float().requires_grad_()
    targets = torch.randint(0, 50, (3, 37))
    targets[0, :5] = -1
    whole = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-1)
    (grad_whole,) = torch.autograd.grad(whole, logits)
    monkeypatch.setattr(model_module, "CE_CHUNK", 50 * 8)  # 8 tokens a chunk: 14 chunks, the last of 7
    chunked = model_module.cross_entropy(logits, targets)
    (grad_chunked,) = torch.autograd.grad(chunked, logits)
    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=0)
    torch.testing.assert_close(grad_chunked, grad_whole, rtol=1e-5, atol=1e-8)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # bf16 logits: each chunk's loss in fp32
        assert model_module.cross_entropy(logits.bfloat16(), targets).dtype == torch.float32


def test_the_compiled_cross_entropy_is_one_loss_over_every_chunk(monkeypatch):
    """Compiled, the loss is one cross-entropy however many chunks the eager one takes (Inductor fuses the
    fp32 cast into it, and compiles 98 checkpointed chunks ~20x slower than one): Dynamo's graph holds one
    cross_entropy and no checkpoint, and the loss equals the eager chunked one."""
    monkeypatch.setattr(model_module, "CE_CHUNK", 50 * 8)  # eager: 14 chunks
    logits, targets = torch.randn(3, 37, 50), torch.randint(0, 50, (3, 37))
    targets[0, :5] = -1
    graphs = []
    compiled = torch.compile(model_module.cross_entropy, fullgraph=True,
                             backend=lambda gm, inputs: graphs.append(gm) or gm)
    loss = compiled(logits, targets)
    calls = [node.target for node in graphs[0].graph.nodes if node.op == "call_function"]
    assert len(graphs) == 1 and calls.count(F.cross_entropy) == 1, calls
    assert not any("checkpoint" in str(target) for target in calls), calls
    torch.testing.assert_close(loss, model_module.cross_entropy(logits, targets), rtol=1e-6, atol=0)
