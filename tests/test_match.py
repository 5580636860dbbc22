"""match.py: analytic accounting against the real model and FlopCounterMode, [S1] sparsity, triple matching."""

import json
import os
import re
from dataclasses import replace
from unittest import mock

import pytest
import torch
from conftest import loop_experts
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import match
import model as model_module
import train
from match import accounting, flops_per_token, fully_activated, run_flops, sparsity
from model import GPT, KVCache, ModelConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = dict(vocab_size=64, block_size=32, n_layer=4, n_embd=32, n_head=4, init="nanogpt")  # nanogpt: tied wte
MOE = dict(n_expert=6, top_k=2, expert_hidden=16)
UNTIED = dict(init="x")  # the [X] init: an untied lm head

FAMILIES = {
    "dense": dict(),
    "dense_gqa_x": dict(n_kv_head=2, head_dim=12, norms="x", **UNTIED),  # QK-norm, no gains, embed norm
    "dense_padded_vocab": dict(n_logits=50, eot_token=49, **UNTIED),
    "moe": dict(MOE, **UNTIED),
    "moe_x": dict(MOE, norms="x"),
    "smelt_moe": dict(MOE, layout="smelt", n_passes=2),
    "smelt_dense_r3": dict(layout="smelt", n_passes=3),
    "layer_loop_moe": dict(MOE, layout="layer_loop", n_passes=2),
    "pcc_tied_both": dict(layout="pcc", n_layer=5, n_passes=3),
    "pcc_tied_norm_x": dict(layout="pcc", n_layer=5, n_passes=2, boundary="norm", norms="x"),
    "pcc_tied_inject": dict(layout="pcc", n_passes=2, boundary="inject"),
    "pcc_tied_none_moe": dict(MOE, layout="pcc", n_passes=2, boundary="none"),
    "pcc_untied_both": dict(layout="pcc_untied", n_layer=5, n_passes=2, **UNTIED),
    "pcc_untied_moe_x": dict(MOE, layout="pcc_untied", n_passes=3, norms="x", **UNTIED),
}


def make(name, **extra):
    return ModelConfig(**{**SMALL, **FAMILIES[name], **extra})


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_params_equal_the_real_model(name):
    cfg = make(name)
    model = GPT(cfg)
    counts, a = model.num_params(), accounting(cfg)
    assert a["params_total"] == a["params_stored"] == sum(p.numel() for p in model.parameters()) == counts["total"]
    assert (a["params_embedding"], a["params_nonembedding"], a["params_active"]) == \
        (counts["embedding"], counts["non_embedding"], counts["active"])
    assert a["stored_blocks"] == len(model.blocks)
    assert a["executed_layers"] == sum(s.kind == "block" for s in model.plan)


def touched_nonembedding(model):
    """Non-embedding params with a non-zero gradient; expert tensors count per expert slice."""
    touched = 0
    for name, p in model.named_parameters():
        if name.startswith(("wte.", "lm_head.")) or p.grad is None:
            continue
        if name.endswith(("ffn.w_gate_up", "ffn.w_down")):  # (n_expert, ...): count used experts
            touched += int((p.grad.flatten(1) != 0).any(dim=1).sum()) * p[0].numel()
        elif (p.grad != 0).any():
            touched += p.numel()
    return touched


def one_token_backward(cfg, token, seed):
    """One token with gradients after a prefix held in the KV cache without gradients (alone, softmax over
    one key is 1 and the query would not matter). Every weight is perturbed: the [X] init's zeros stop
    gradients."""
    torch.manual_seed(seed)
    model = GPT(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
        cache = KVCache()
        model(torch.tensor([[5, 9, 11]]), cache=cache)
    model(torch.tensor([[token]]), targets=torch.tensor([[3]]), cache=cache)[1].backward()
    return model


@pytest.mark.parametrize("name", ["dense", "dense_gqa_x", "moe", "moe_x", "smelt_dense_r3", "pcc_tied_both",
                                  "pcc_untied_both", "pcc_untied_moe_x"])
def test_active_params_are_what_one_token_touches(name):
    cfg = make(name)
    assert touched_nonembedding(one_token_backward(cfg, 7, seed=1)) == accounting(cfg)["params_active"]


def test_looped_moe_touches_at_most_top_k_experts_per_visit():
    """A looped MoE layer may route its second visit elsewhere: the touched set lies between the active
    count (top_k per stored layer) and top_k per visit."""
    cfg = make("smelt_moe")
    a, touched = accounting(cfg), touched_nonembedding(one_token_backward(cfg, 4, seed=2))
    extra_visits = a["executed_layers"] - cfg.n_layer
    assert a["params_active"] <= touched <= a["params_active"] + extra_visits * cfg.top_k * 3 * 32 * 16


def counted_flops(cfg, B=2, T=8):
    """FlopCounterMode on a real forward + backward. SDPA is forced onto its math path (the CPU flash
    kernel is invisible to the counter; the math path's two bmms are seen, for the full T x T square). The
    counter has no formula for grouped GEMMs: the experts run as their twin, a loop of matmuls."""
    torch.manual_seed(3)
    model = GPT(cfg)
    idx = torch.randint(0, cfg.eot_token, (B, T))  # no eot: one document
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter, \
            mock.patch.object(model_module, "run_experts", loop_experts):
        model(idx, targets=idx)[1].backward()
    return counter.get_total_flops() / (B * T)


@pytest.mark.parametrize("name, depth", [("dense_gqa_x", 2), ("moe", 2), ("smelt_moe", 2), ("pcc_tied_both", 3),
                                         ("pcc_untied_moe_x", 3), ("dense_padded_vocab", 1)])
def test_matmul_flops_match_flop_counter(name, depth):
    """Exact (1e-9) for the matmuls. The counter sees mm/bmm only (not the norms, softmax, SwiGLU, RoPE,
    which match.py leaves out or books under flops_norms) and attention over the full T x T square
    whatever the mask, so the analytic side is evaluated at attended = T."""
    cfg = make(name, n_layer=depth)  # shallow: the counter's Python dispatch costs ~1 ms per op
    assert cfg.executed_layers() > depth or cfg.layout == "plain"
    a = accounting(cfg, attended=8)
    assert counted_flops(cfg, T=8) == pytest.approx(a["flops_per_token"] - a["flops_norms"], rel=1e-9)


def test_looped_flops_equal_the_unrolled_untied_twin():
    tied, untied = make("pcc_tied_both"), make("pcc_tied_both", layout="pcc_untied")
    assert flops_per_token(tied) == flops_per_token(untied)
    smelt, plain6 = make("smelt_moe"), make("moe", n_layer=6, init="nanogpt")  # 2 + 2 x 2 executions of 4 layers
    assert flops_per_token(smelt) == flops_per_token(plain6)
    assert accounting(smelt)["params_compute_active"] == accounting(plain6)["params_compute_active"]
    assert accounting(smelt)["params_nonembedding"] < accounting(plain6)["params_nonembedding"]


def test_six_n_c_is_the_non_attention_matmul_flops():
    for name in FAMILIES:
        a = accounting(make(name))
        assert a["flops_6n"] == a["flops_attn_proj"] + a["flops_router"] + a["flops_ffn"] + a["flops_unembedding"]
        assert a["flops_per_token"] == pytest.approx(3 * a["flops_forward"])
        assert flops_per_token(make(name), backward=False) == pytest.approx(a["flops_forward"])


def test_x_d8_vanilla_stores_the_x_codes_205_8m_params():
    """[X10] N_s of the [X] d8 Vanilla (config/x_d8_vanilla.py at GPT-2's padded vocabulary): 205.8M, the
    N of the [X] code's TPP step count (TPP 5 -> 1962 steps)."""
    cfg, _, _ = match.read_config(os.path.join(ROOT, "config", "x_d8_vanilla.py"), vocab_size=50304)
    assert (cfg.n_layer, cfg.n_embd, cfg.norms, cfg.layout) == (8, 1024, "x", "plain")
    assert round(accounting(cfg)["params_stored"] / 1e5) == 2058


def test_compute_active_counts_core_k_times():
    """[X10] N_c: prelude, coda and head once, core matrices K times, no input embedding."""
    cfg = make("pcc_tied_both")  # 5 -> 1/2/2, K=3
    block, head = match.block_shapes(cfg)["matmul_active"], cfg.vocab_size * cfg.n_embd
    assert accounting(cfg)["params_compute_active"] == (1 + 3 * 2 + 2) * block + head
    assert accounting(cfg, n_passes=1)["params_compute_active"] == 5 * block + head


def test_attention_cost_follows_the_attended_length():
    cfg = make("dense")
    assert accounting(cfg)["attended"] == (cfg.block_size + 1) / 2  # default: one document, causal
    assert accounting(cfg, avg_doc_len=9)["attended"] == 5
    a10, a20 = accounting(cfg, attended=10), accounting(cfg, attended=20)
    assert a20["flops_attn_scores"] == 2 * a10["flops_attn_scores"] and a20["flops_ffn"] == a10["flops_ffn"]
    for bad in (dict(attended=float("nan")), dict(attended=-1), dict(avg_doc_len=cfg.block_size + 1)):
        with pytest.raises(ValueError, match="need attended > 0"):
            accounting(cfg, **bad)


def test_sparsity_is_zero_for_the_fully_activated_reference():
    for name in ("dense", "moe", "smelt_moe", "pcc_tied_none_moe"):
        reference = fully_activated(make(name))
        assert reference.layout == "plain" and reference.n_expert in (0, reference.top_k)
        assert sparsity(reference)["S"] == pytest.approx(0, abs=1e-12)
    s = sparsity(make("moe"))
    assert 0 < s["S"] < 1 and s["N_act_eq"] == pytest.approx(s["F"] / s["F0"] * s["N0"])
    assert sparsity(make("smelt_dense_r3"))["S"] < 0  # a looped dense model spends more FLOPs per param


def test_kv_grows_with_executed_not_stored_layers():
    kv = {r: accounting(make("smelt_moe", n_passes=r))["kv_per_token"] for r in (1, 2, 3)}
    per_layer = 2 * 4 * 8  # 2 x n_kv_head x head_dim
    assert kv == {1: 4 * per_layer, 2: 6 * per_layer, 3: 8 * per_layer}
    assert accounting(make("smelt_moe", n_passes=3))["stored_blocks"] == 4
    tied, untied = accounting(make("pcc_tied_both")), accounting(make("pcc_tied_both", layout="pcc_untied"))
    assert tied["kv_per_token"] == untied["kv_per_token"] and tied["stored_blocks"] < untied["stored_blocks"]
    assert accounting(make("dense"), kv_bytes_per_element=4)["kv_bytes_per_token"] == 4 * 4 * per_layer


def test_run_flops_token_weights_growth_phases():
    """[X13] growing 2 -> 4 passes after a fraction 1 - rho of the tokens."""
    cfg = make("pcc_tied_both", n_passes=2)
    out = run_flops(cfg, [(100, 2), (300, 4)])
    f2, f4 = flops_per_token(cfg, n_passes=2), flops_per_token(cfg, n_passes=4)
    assert out["flops"] == pytest.approx(100 * f2 + 300 * f4)
    assert out["flops_per_token"] == pytest.approx(0.25 * f2 + 0.75 * f4)
    assert out["mean_passes"] == pytest.approx(3.5)  # K_rho = 2(1 - rho) + 4 rho, rho = 0.75
    n2, n4 = (accounting(cfg, n_passes=k)["params_compute_active"] for k in (2, 4))
    assert out["params_compute_active"] == pytest.approx(0.25 * n2 + 0.75 * n4)
    untied2, untied4 = replace(cfg, layout="pcc_untied"), replace(cfg, layout="pcc_untied", n_passes=4)
    assert run_flops(untied2, [(100, untied2), (300, untied4)])["flops"] == pytest.approx(out["flops"])
    with pytest.raises(ValueError, match="runs 1 to 2 passes"):
        run_flops(untied2, [(100, 4)])  # an untied model has no cores for more passes


# ---- matching


def test_worked_example_of_smelt():
    """[S] 200M, S~0.95: baseline L=12, H=1280, 192 experts -> ~1.33e9 FLOPs/token, ~3.87e9 non-embedding
    params; SMELT twin H=1056, 288 experts, F ratio 1.020, N ratio 1.004, KV 1.031 (the paper: 1.37e9
    FLOPs (+2.9%), 3.89e9 params (+0.4%), KV within 4%). The config files are exactly these models."""
    base = match.preset_baseline("smelt-200m-s95")
    assert (base.n_layer, base.n_embd, base.n_expert) == (12, 1280, 192)
    a = accounting(base, avg_doc_len=512)
    assert a["flops_per_token"] == pytest.approx(1.33e9, rel=0.01)
    assert a["params_nonembedding"] == pytest.approx(3.87e9, rel=0.01)
    assert a["params_active"] == pytest.approx(0.207e9, rel=0.015)
    twin, report = match.match(base, "smelt", avg_doc_len=512)
    assert (twin.n_embd, twin.n_expert, twin.expert_hidden) == (1056, 288, 352)
    assert (twin.n_head, twin.n_kv_head, twin.head_dim, twin.executed_layers()) == (12, 2, 88, 18)
    r = report["ratios"]
    assert r["kv"] == (18 * 2 * 2 * 88) / (12 * 2 * 2 * 128)  # 6336 / 6144, by hand
    assert r["flops"] == pytest.approx(1.020, abs=5e-4) and r["params"] == pytest.approx(1.004, abs=5e-4)
    assert report["matched"]["flops_per_token"] == pytest.approx(1.362e9, rel=1e-3)
    assert report["sparsity_matched"]["S"] == pytest.approx(0.945, abs=5e-4)
    assert report["sparsity_baseline"]["S"] == pytest.approx(0.946, abs=5e-4)
    for name, cfg in (("smelt_200m_base.py", base), ("smelt_200m_s95.py", twin)):
        assert match.read_config(os.path.join(ROOT, "config", name))[0] == cfg  # default vocabulary: 4096
    assert match.match(base, "smelt", avg_doc_len=512)[0] == twin  # deterministic


def test_search_options_group_into_one_object():
    base = match.preset_baseline("smelt-200m-s95")
    grid = match.MatchSearch(width_multiple=(16, 8), hidden_multiple=8, expert_multiple=1)
    by_object, _ = match.match(base, "smelt", avg_doc_len=512, search=grid)
    by_keywords, _ = match.match(base, "smelt", avg_doc_len=512, width_multiple=(16, 8), hidden_multiple=8,
                                 expert_multiple=1)
    assert by_object == by_keywords and by_object.n_embd % 16 == 0
    assert match.MatchSearch(flops_tol=0.02).flops_tol == (0.02, 0.02)
    with pytest.raises(TypeError, match="width_multiples"):
        match.match(base, "smelt", width_multiples=(8,))


def test_flops_only_matching_of_a_prelude_core_coda_recipe():
    base = ModelConfig(**{**SMALL, "n_layer": 6, "n_embd": 512, "n_head": 8})
    twin, report = match.match(base, "pcc2", budgets=("flops",))
    assert twin.layout == "pcc" and (twin.n_embd, twin.n_head, twin.mlp_hidden) == (432, 8, 1296)
    assert report["ratios"]["flops"] == pytest.approx(1.0049, abs=1e-4)
    assert report["ratios"]["params"] == pytest.approx(0.7525, abs=1e-4)  # not a budget here: unmatched
    assert (twin.head_dim, twin.n_kv_head) == (base.head_dim, base.n_kv_head) == (64, 8)  # kept as derived


def test_infeasible_requests_say_which_budget_and_by_how_much():
    tiny_kv = ModelConfig(**{**SMALL, **MOE, "n_embd": 64, "n_head": 4, "n_kv_head": 1, "head_dim": 16})
    with pytest.raises(ValueError, match=r"KV budget cannot be met.*off by 100\.0%"):
        match.match(tiny_kv, dict(layout="smelt", n_passes=3))  # 8 executions: head_dim 8 < 16 needed
    dense = ModelConfig(**{**SMALL, "n_embd": 128})
    with pytest.raises(ValueError, match=r"params budget not met: ratio 0\.\d+ outside 1 \+- 0\.015 by \d+\.\d+%"):
        match.match(dense, "smelt")  # a dense model cannot buy back the params it loses by narrowing
    with pytest.raises(ValueError, match="budgets"):
        match.match(dense, "smelt", budgets=("latency",))


@pytest.mark.parametrize("options, message", [
    (dict(params_tol=-0.1), "match option params_tol=-0.1 out of range"),
    (dict(kv_tol=1.5), "match option kv_tol=1.5"),
    (dict(flops_tol=(0.0, float("nan"))), "match option flops_tol=(0.0, nan)"),
    (dict(width_multiple=0), "match option width_multiple=(0,)"),
    (dict(hidden_multiple=0), "match option hidden_multiple=0"),
    (dict(head_dim_range=(0, 8)), "match option head_dim_range=(0, 8)"),
    (dict(budgets=()), "budgets=(): give at least one"),
    (dict(attended=float("nan")), "need attended > 0"),
])
def test_match_options_out_of_range_are_named(options, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        match.match(ModelConfig(n_layer=4, n_embd=64, n_head=2), "smelt", **options)


# match.py --preset smelt-SCALE-sS: the twin's (n_embd, n_expert, expert_hidden, n_head, n_kv_head, head_dim) and
# ratios F, N, KV to 4 decimals, as found when the presets were written (a change here is a change of results)
PRESET_TWINS = {
    "100m-s85": ((560, 82, 464, 9, 1, 64), (1.0420, 1.0061, 1.0)),
    "100m-s95": ((560, 256, 464, 9, 1, 64), (1.0477, 1.0029, 1.0)),
    "100m-s97": ((560, 416, 464, 8, 1, 64), (1.0384, 0.9963, 1.0)),
    "200m-s85": ((1056, 96, 352, 12, 2, 88), (1.0126, 0.9961, 1.0312)),
    "200m-s95": ((1056, 288, 352, 12, 2, 88), (1.0201, 1.0043, 1.0312)),
    "200m-s97": ((1056, 504, 352, 12, 2, 88), (1.0283, 1.0061, 1.0312)),
    "600m-s85": ((1472, 96, 480, 9, 1, 168), (1.0097, 0.9879, 0.9844)),
    "600m-s95": ((1472, 288, 480, 16, 2, 88), (1.0007, 0.9948, 1.0312)),
    "600m-s97": ((1472, 504, 480, 16, 2, 88), (1.0070, 0.9967, 1.0312)),
    "1.6b-s85": ((1888, 96, 624, 22, 2, 88), (1.0087, 0.9880, 1.0312)),
    "1.6b-s95": ((1888, 288, 624, 22, 2, 88), (1.0131, 0.9951, 1.0312)),
    "1.6b-s97": ((1888, 504, 624, 22, 2, 88), (1.0180, 0.9967, 1.0312)),
}


def test_every_scale_preset_matches_within_s_table_10s_tolerances():
    """Every twin within [S] Table 10's mismatches: F in [1, 1.05], N within 1.5%, KV within 4%."""
    assert sorted(PRESET_TWINS) == sorted(p[len("smelt-"):] for p in match.PRESETS)
    for name, (shape, ratios) in PRESET_TWINS.items():
        base = match.preset_baseline(f"smelt-{name}")
        twin, report = match.match(base, "smelt", avg_doc_len=512)
        assert (twin.n_embd, twin.n_expert, twin.expert_hidden, twin.n_head, twin.n_kv_head, twin.head_dim) == shape
        assert tuple(round(report["ratios"][b], 4) for b in ("flops", "params", "kv")) == ratios
        assert report["sparsity_baseline"]["S"] == pytest.approx(int(name[-2:]) / 100, abs=0.015)
    # the paper's sizes at 1.6B, S~0.97: 53.9B total params, a 504-expert SMELT twin
    assert accounting(match.preset_baseline("smelt-1.6b-s97"))["params_total"] == pytest.approx(53.89e9, rel=1e-3)


# ---- the command line


def test_cli_json_and_table(capsys):
    match.main(["--preset", "smelt-200m-s95", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"baseline", "matched", "ratios", "vocab_size", "vocab_from"}
    keys = {"n_embd", "n_expert", "n_layer", "executed_layers", "head_dim", "n_kv_head", "flops_per_token",
            "params_nonembedding", "params_active", "kv_per_token", "sparsity_S"}
    assert keys <= set(out["baseline"]) and keys <= set(out["matched"]) and set(out["ratios"]) == {"flops", "params", "kv"}
    assert (out["matched"]["n_embd"], out["matched"]["n_expert"], out["matched"]["executed_layers"]) == (1056, 288, 18)
    match.main(["--preset", "smelt-200m-s95"])
    text = capsys.readouterr().out
    assert "ratios (matched / baseline, as [S] Table 10): flops 1.0201, params 1.0043, kv 1.0312" in text
    match.main([os.path.join(ROOT, "config", "smelt_200m_base.py"), "--avg_doc_len", "512"])
    table = capsys.readouterr().out
    assert table.startswith("vocab_size 4096 from --vocab_size, attended 256.5 keys per query")
    assert re.search(r"flops_per_token +1\.3354e\+09", table) and "kv_per_token" in table and "sparsity_S" in table


def test_cli_takes_the_vocabulary_and_document_length_from_the_data(tmp_path, capsys):
    """As train.py: n_vocab padded to a multiple of 64 (the real size kept as n_logits), the data's eot
    token, its mean document length (capped at block_size) for the attention FLOPs."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "meta.json").write_text(json.dumps(dict(n_vocab=50257, eot_token=50256, mean_doc_len=99)))
    path = tmp_path / "c.py"
    path.write_text(f"n_layer = 2\nn_embd = 64\nn_head = 2\ndata_dir = {str(tmp_path / 'data')!r}\nbatch_size = 5\n")
    cfg, settings, where = match.read_config(str(path))
    assert (cfg.vocab_size, cfg.n_logits, cfg.eot_token, settings["batch_size"]) == (50304, 50257, 50256, 5)
    assert where.endswith("meta.json")
    match.main([str(path), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert (out["vocab_size"], out["attended"]) == (50304, 50.0)
    path.write_text("n_layer = 2\nn_embd = 64\nn_head = 2\ndata_dir = 'no/such/folder'\n")
    assert match.read_config(str(path), vocab_size=320)[0].vocab_size == 320
    path.write_text("n_layer = 2\nn_embd = 64\nn_head = 2\nn_expert = 16\n")  # the rest: train.py's defaults
    assert match.read_config(str(path))[0] == ModelConfig(**dict(
        {k: train.DEFAULTS[k] for k in train.MODEL_SETTINGS}, n_layer=2, n_embd=64, n_head=2, n_expert=16))


SMALL_CONFIG = "n_layer = 4\nn_embd = 64\nn_head = 2\nblock_size = 256\nlayout = 'plain'\nn_expert = 0\n"


@pytest.mark.parametrize("config, argv, message", [
    (None, ["--preset", "smelt-3b-s95"], "argument --preset: invalid choice: 'smelt-3b-s95'"),
    (None, ["config/no_such_config.py"], "config file not found"),
    (None, [], "give a config file or --preset"),
    ("n_layer = 1\nn_embd = 64\nn_head = 2\n", ["--recipe", "smelt"], "a loop needs n_layer >= 2"),
    (SMALL_CONFIG, ["--recipe", "layout=smelt,n_passes=1"], "executes 4 blocks per token, the baseline (plain) 4"),
    (SMALL_CONFIG, ["--recipe", "layout=plain"], "a recipe must loop a looped layout >= 2 times"),
    (SMALL_CONFIG, ["--recipe", "layout=pcc,n_passes=2,n_layer=0"], "n_layer=0: must be >= 1"),
    (SMALL_CONFIG, ["--recipe", "smelt3,x"], "expected a name in"),
    (SMALL_CONFIG, ["--avg_doc_len", "nan"], "argument --avg_doc_len: nan: must be a finite number > 0"),
    (SMALL_CONFIG, ["--avg_doc_len", "1000"], "a document length in [1, block_size=256]"),
    (SMALL_CONFIG, ["--attended", "-3"], "argument --attended: -3.0: must be a finite number > 0"),
    (SMALL_CONFIG, ["--world_size", "two"], "argument --world_size: invalid int value: 'two'"),
    (SMALL_CONFIG, ["--memory", "--micro_batch", "0"], "argument --micro_batch: 0: must be a finite number > 0"),
    (SMALL_CONFIG, ["--rec", "smelt"], "unrecognized arguments: --rec smelt"),  # no abbreviations
])
def test_cli_mistakes_are_one_line_and_exit_2(tmp_path, capsys, config, argv, message):
    """One line naming the mistake, exit status 2."""
    if config:
        (tmp_path / "c.py").write_text(config)
        argv = [str(tmp_path / "c.py"), *argv]
    with pytest.raises(SystemExit) as e:
        match.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("match.py: error: ") and err.count("\n") == 1
    assert err.splitlines()[-1].startswith("match.py: error: ") and message in err.splitlines()[-1]
