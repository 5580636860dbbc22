"""probe.py: every statistic on constructed inputs with a known answer, run_probes on tiny models, and
the CLI end to end on a tiny looped MoE checkpoint and a non-looped one."""
import json
import math
import os

import numpy as np
import pytest
import torch

import probe
from data.prepare import prepare
from model import GPT, ModelConfig
from conftest import small_corpus
from test_sample import error_line, save_checkpoint

VOCAB, EOT = 512, 511


def random_topk_sets(n_tokens, k, n, generator):
    return torch.rand(n_tokens, n, generator=generator).argsort(dim=-1)[:, :k]


def test_routing_overlap_identical_is_k_and_independent_is_k2_over_n():
    g = torch.Generator().manual_seed(0)
    ids, other = random_topk_sets(20000, 8, 64, g), random_topk_sets(20000, 8, 64, g)
    assert probe.routing_overlap(ids, ids) == 8 == probe.routing_overlap(ids, ids.flip(-1))  # order is free
    assert probe.random_routing_overlap(8, 64) == 1.0
    assert abs(probe.routing_overlap(ids, other) - 1.0) < 0.05
    assert probe.routing_overlap(torch.arange(8).expand(5, 8), torch.arange(8, 16).expand(5, 8)) == 0


def test_norm_ratio_cosine_and_kl():
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1))
    assert probe.norm_ratio(x, x) == pytest.approx(1.0) and probe.norm_ratio(3 * x, x) == pytest.approx(3.0)
    assert [probe.mean_cosine(x, 3 * x), probe.mean_cosine(x, -x)] == pytest.approx([1.0, -1.0])
    # a ratio of mean norms, not a mean of ratios: token norms 1 and 3 -> 2 and 2 gives 4/4
    a, b = torch.tensor([[1.0, 0.0], [3.0, 0.0]]), torch.tensor([[0.0, 2.0], [0.0, 2.0]])
    assert probe.norm_ratio(b, a) == pytest.approx(1.0) and probe.mean_cosine(a, b) == pytest.approx(0.0)
    assert probe.kl_to_final(x, x) == pytest.approx(0.0, abs=1e-6)
    p, q = torch.tensor([0.8, 0.2]), torch.tensor([0.5, 0.5])
    expected = 0.8 * math.log(0.8 / 0.5) + 0.2 * math.log(0.2 / 0.5)
    assert probe.kl_to_final(p.log(), q.log()) == pytest.approx(expected, rel=1e-5)


def test_cross_visit_cosine_matrix_same_vs_mismatched():
    e = torch.eye(4)
    u1 = [e[i].expand(3, 5, 4) for i in range(3)]
    matrix = probe.cross_visit_cosine_matrix(u1, [2 * u for u in u1])
    assert torch.allclose(matrix, torch.eye(3, dtype=torch.float64))
    assert probe.same_and_mismatched(matrix) == pytest.approx((1.0, 0.0))
    # the second visit adds an orthogonal direction of equal size: cosine 1/sqrt(2) on the diagonal
    same, mismatched = probe.same_and_mismatched(probe.cross_visit_cosine_matrix(u1, [u + e[3] for u in u1]))
    assert same == pytest.approx(1 / math.sqrt(2)) and mismatched == pytest.approx(0.0)
    assert probe.same_and_mismatched(probe.cross_visit_cosine_matrix(u1[:1], u1[:1]))[1] is None


def test_document_starts_attendable_keys_and_sink_mass():
    idx = torch.tensor([[5, 6, EOT, 7, 8, EOT, 9], [EOT, 1, 2, 3, 4, 5, 6]])
    starts = probe.document_starts(idx, EOT)
    assert starts.tolist() == [[0, 0, 2, 2, 2, 5, 5], [0, 0, 0, 0, 0, 0, 0]]
    assert probe.attendable_keys(starts).tolist() == [[1, 2, 1, 2, 3, 1, 2], [1, 2, 3, 4, 5, 6, 7]]
    # head h puts masses[h] on the document start and the rest evenly on the other keys it may see
    idx = torch.tensor([[3, 4, 5, EOT, 6, 7, 8, 9], [EOT, 1, EOT, 2, 3, EOT, 4, 5]])
    starts, masses = probe.document_starts(idx, EOT), [0.6, 0.1, 0.0]
    probs = torch.zeros(2, 3, 8, 8)
    for b, t in np.ndindex(2, 8):
        s = int(starts[b, t])
        for h, mass in enumerate(masses):
            probs[b, h, t, s] = 1.0 if s == t else mass
            probs[b, h, t, s + 1:t + 1] = (1 - mass) / max(t - s, 1)
    assert torch.allclose(probs.sum(-1), torch.ones(2, 3, 8))
    mass, n_queries = probe.sink_mass(probs, starts)
    assert n_queries == 16 - 5  # the 5 document starts do not count
    assert torch.allclose(mass, torch.tensor(masses, dtype=torch.float64))
    # uniform attention over the document: mean of 1/(t - s + 1) over non-start queries
    uniform = torch.ones(4, 4).tril() / torch.arange(1, 5)[:, None]
    mass, n_queries = probe.sink_mass(uniform[None, None], torch.zeros(1, 4, dtype=torch.long))
    assert n_queries == 3 and mass.item() == pytest.approx((1 / 2 + 1 / 3 + 1 / 4) / 3)


def test_topk_attention_overlap_same_head_vs_other_head():
    B, H, T, k = 2, 3, 40, 4
    scores = torch.randn(B, H, T, T, generator=torch.Generator().manual_seed(2))
    probs = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf")).softmax(-1)
    matrix, n_queries = probe.topk_attention_overlap(probs, probs, torch.arange(1, T + 1).expand(B, T), k)
    assert n_queries == B * (T - (2 * k - 1))  # queries with fewer than 2k keys are left out
    assert torch.allclose(matrix.diagonal(), torch.ones(H, dtype=torch.float64))
    assert (probe.diagonal_and_control(matrix)[1] < 0.5).all()  # random heads share few top-k keys
    # heads that attend to disjoint key sets: the other-head control is exactly 0
    disjoint = torch.zeros(1, 2, 2 * k + 1, 2 * k + 1)
    disjoint[0, 0, -1, :k] = disjoint[0, 1, -1, k:2 * k] = 1 / k
    n_keys = torch.tensor([[0] * 2 * k + [2 * k + 1]])
    matrix, n_queries = probe.topk_attention_overlap(disjoint, disjoint, n_keys, k)
    assert n_queries == 1 and torch.allclose(matrix, torch.eye(2, dtype=torch.float64))


@pytest.mark.parametrize("curve, depth, peak, status", [
    ([5, 9, 6, 3, 1.5, 0.5, 0], 5, 2, "ok"),          # peak after block 2; block 5 first within 2 nats
    ([1, 9, 5, 2.0, 3, 0], 4, 2, "ok"),               # "within" includes exactly 2 nats
    ([9, 9, 1, 0], 3, 1, "ok"),                       # ties: the first maximum is the peak
    ([1, 9, 5, 4, 3], None, 2, "never"), ([0, 1, 2, 9], None, 4, "peak_is_last"),
    ([0.1, 0.3, 0.2, 0], 3, 2, "peak_within_threshold"),
])
def test_kl_effective_depth_on_constructed_curves(curve, depth, peak, status):
    result = probe.kl_effective_depth(curve, threshold=2.0)
    assert (result["depth"], result["peak"], result["status"]) == (depth, peak, status)
    assert result["peak_kl"] == max(curve)


def tiny_model(seed=0, **overrides):
    torch.manual_seed(seed)
    base = dict(vocab_size=VOCAB, eot_token=EOT, block_size=64, n_layer=4, n_embd=64, n_head=4,
                init="nanogpt")
    return GPT(ModelConfig(**(base | overrides)))


def tiny_tokens(rows=4, seq_len=64):
    idx = torch.randint(0, VOCAB - 1, (rows, seq_len), generator=torch.Generator().manual_seed(0))
    idx[:, 0] = idx[1::2, seq_len // 2] = EOT
    return idx


LOOPED_MOE = dict(layout="smelt", n_passes=2, n_expert=8, top_k=2)


def test_record_blocks_records_every_executed_block_and_changes_nothing():
    model = tiny_model(layout="smelt", n_passes=2, n_expert=4, top_k=2, expert_hidden=8, n_kv_head=2).eval()
    idx = tiny_tokens(rows=2, seq_len=24)
    idx[:, 7] = EOT
    plain_logits = model(idx)[0]
    with probe.record_blocks(model) as records:
        logits = model(idx)[0]
    assert torch.equal(logits, plain_logits)  # hooks only read
    assert all(not block._forward_hooks and not block._forward_pre_hooks for block in model.blocks)  # removed
    assert [(r["block"], r["visit"]) for r in records] == [(0, 1), (1, 1), (2, 1), (1, 2), (2, 2), (3, 1)]
    r = records[3]
    assert {"resid_in", "attn_in", "q", "k", "v", "attn_probs", "attn_context", "attn_output", "update",
            "attn_update", "ffn_in", "ffn_update", "resid_out", "expert_ids"} <= set(r)
    assert r["attn_probs"].shape == (2, 4, 24, 24)
    torch.testing.assert_close(r["attn_probs"].sum(-1), torch.ones(2, 4, 24))
    assert r["attn_probs"][:, :, 10, :7].abs().max() == 0  # document mask: position 10 is in document 2
    torch.testing.assert_close(r["resid_out"], r["resid_in"] + r["attn_update"] + r["ffn_update"])
    # the explicit softmax reproduces what SDPA computed inside the block
    attn_output = model.blocks[r["block"]].attn.o_proj(r["attn_context"].transpose(1, 2).reshape(2, 24, -1))
    torch.testing.assert_close(attn_output, r["attn_output"], rtol=1e-4, atol=1e-5)


def test_run_probes_identical_visits_give_overlap_k_and_cosine_1():
    """Zero out-projections in the loop span: the stream entering visit 2 equals visit 1's, so every
    routing set, attention pattern and projection repeats exactly."""
    model = tiny_model(**LOOPED_MOE)
    start = model.config.loop_start
    with torch.no_grad():
        for block in model.blocks[start:start + model.config.loop_span]:
            block.attn.o_proj.weight.zero_()
            block.ffn.w_down.zero_()
    result = probe.run_probes(model, tiny_tokens(), attn_topk=4)
    assert result["looped"] and result["loop_layers"] == [1, 2]
    for layer in result["layers"]:
        assert [layer["routing_overlap"], layer["routing_random"]] == pytest.approx([2.0, 0.5])
        assert [layer["cosine"][q] for q in ("X", "Q", "K", "V", "PV")] == pytest.approx([1.0] * 5, abs=1e-5)
        assert layer["norm_ratio"]["ffn_in"] == pytest.approx(1.0, abs=1e-5)
        assert layer["topk_overlap_same_head"] == pytest.approx(1.0)
        assert layer["sink_visit_a"] == pytest.approx(layer["sink_visit_b"], abs=1e-6)


def test_run_probes_micro_batches_agree_and_last_lens_is_final():
    model = tiny_model(1, **LOOPED_MOE)
    whole = probe.run_probes(model, tiny_tokens(), batch_size=4, attn_topk=4)
    split = probe.run_probes(model, tiny_tokens(), batch_size=1, attn_topk=4)
    assert whole["executed_blocks"] == model.config.executed_layers() == 6
    assert [e["visit"] for e in whole["sink"]] == [1, 1, 1, 2, 2, 1]
    assert np.allclose(whole["kl"]["curve"], split["kl"]["curve"], atol=1e-6)
    assert whole["kl"]["curve"][-1] == pytest.approx(0.0, abs=1e-5)  # the lens after the last block = output
    for a, b in zip(whole["layers"], split["layers"]):
        for key in ("routing_overlap", "topk_overlap_same_head", "topk_overlap_other_head", "sink_visit_b"):
            assert a[key] == pytest.approx(b[key], abs=1e-6)
        assert a["norm_ratio"] == pytest.approx(b["norm_ratio"], abs=1e-6)
    same = whole["update_cosine"]["same_layer"]
    assert same == pytest.approx(split["update_cosine"]["same_layer"], abs=1e-6)  # JSON-ready: the CLI tests


def test_run_probes_pcc():  # a non-looped model: test_cli_non_looped_and_mistakes
    tied = probe.run_probes(tiny_model(2, layout="pcc", n_passes=3), tiny_tokens(rows=2), (2, 3), attn_topk=4)
    assert tied["loop_layers"] == [1, 2] and tied["visits"] == [2, 3]
    untied = probe.run_probes(tiny_model(2, layout="pcc_untied", n_passes=2), tiny_tokens(rows=2))
    assert not untied["looped"] and untied["executed_blocks"] == 6


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """conftest's small corpus in GPT-2's first 512 tokens, half held out."""
    root = tmp_path_factory.mktemp("probe_data")
    return prepare([small_corpus(root)], str(root / "data"), "gpt2-512", 0.5, seed=0, verbose=False)


def write_checkpoint(tmp_path, data_dir, name, **overrides):
    return save_checkpoint(tiny_model(**overrides), tmp_path / f"{name}.pt", "gpt2-512",
                           config=dict(data_dir=data_dir))


def test_cli_looped_moe_json_and_text(tmp_path, data_dir, capsys):
    ckpt = write_checkpoint(tmp_path, data_dir, "looped", **LOOPED_MOE)
    assert probe.main(["--ckpt", ckpt, "--tokens", "256", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)  # exactly one JSON object on stdout
    assert result["looped"] and result["loop_layers"] == [1, 2] and result["n_tokens"] == 256
    summary = result["summary"]
    assert summary["routing_random"] == pytest.approx(0.5) and 0 <= summary["routing_overlap"] <= 2
    assert set(summary["norm_ratio"]) == {"update", "attn", "ffn", "ffn_in"}
    assert len(result["layers"][0]["sink_per_head_visit_b"]) == 4
    assert result["kl"]["status"] in ("ok", "peak_within_threshold", "never", "peak_is_last")
    plot = ["--plot", str(tmp_path / "plots")] if probe.importlib.util.find_spec("matplotlib") else []
    assert probe.main(["--ckpt", ckpt, "--tokens", "128"] + plot) == 0
    out = capsys.readouterr().out
    assert "loop layers [1, 2]" in out and "KL effective depth" in out
    assert not plot or sorted(os.listdir(tmp_path / "plots")) == ["kl_depth.png", "sink_heatmap.png"]


def test_cli_non_looped_and_mistakes(tmp_path, data_dir, capsys):
    ckpt = write_checkpoint(tmp_path, data_dir, "plain")
    assert probe.main(["--ckpt", ckpt, "--tokens", "128", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["looped"] is False and result["layers"] is None and len(result["kl"]["curve"]) == 4
    assert probe.main(["--ckpt", ckpt, "--tokens", "128"]) == 0 and "n/a" in capsys.readouterr().out
    # mistakes: one line, status 2
    loop = ["--ckpt", ckpt, "--n_passes", "2"]
    assert "nothing to loop" in error_line(probe.main, loop, capsys, "probe.py")
    nodata = write_checkpoint(tmp_path, str(tmp_path / "missing"), "nodata")
    assert "missing" in error_line(probe.main, ["--ckpt", nodata], capsys, "probe.py")
    assert "absent.pt" in error_line(probe.main, ["--ckpt", str(tmp_path / "absent.pt")], capsys, "probe.py")
    other = save_checkpoint(tiny_model(vocab_size=4096, eot_token=4095), tmp_path / "other.pt",
                            config=dict(data_dir=data_dir))
    assert "holds gpt2-512 tokens" in error_line(probe.main, ["--ckpt", other], capsys, "probe.py")
