"""match.py: analytic accounting against the real model, FlopCounterMode, [S1] sparsity, triple matching."""

import json
import os
import re
from dataclasses import replace
from unittest import mock

import pytest
import torch
from conftest import loop_experts, one_line_error
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import match
from tooling import match_cli
import model as model_module
from match import accounting, flops_per_token, fully_activated, run_flops, sparsity
from model import GPT, KVCache, ModelConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = dict(vocab_size=64, eot_token=63, block_size=32, n_layer=4, n_embd=32, n_head=4, init="nanogpt")
MOE = dict(n_expert=6, top_k=2, expert_hidden=16)

FAMILIES = {
    "dense": dict(),
    "dense_gqa_qknorm": dict(n_kv_head=2, head_dim=12, qk_norm=True),
    "dense_no_gain_qknorm": dict(norm_gain=False, qk_norm=True),
    "moe": dict(MOE),
    "moe_tied_embed_norm": dict(MOE, tie_embeddings=True, embed_norm=True),
    "smelt_moe": dict(MOE, layout="smelt", n_passes=2),
    "smelt_dense_r3": dict(layout="smelt", n_passes=3, loop_span=2),
    "layer_loop_moe": dict(MOE, layout="layer_loop", n_passes=2),
    "pcc_tied_both": dict(layout="pcc", n_layer=5, n_passes=3),
    "pcc_tied_norm_nogain": dict(layout="pcc", n_layer=5, n_passes=2, boundary="norm", norm_gain=False),
    "pcc_tied_inject": dict(layout="pcc", n_passes=2, boundary="inject"),
    "pcc_tied_none_moe": dict(MOE, layout="pcc", n_passes=2, boundary="none"),
    "pcc_untied_both_qk": dict(layout="pcc", n_layer=5, n_passes=2, tie_core=False, qk_norm=True),
    "pcc_untied_moe_embed_norm": dict(MOE, layout="pcc", n_passes=3, tie_core=False, embed_norm=True,
                                      tie_embeddings=True),
}


def make(name, **extra):
    return ModelConfig(**{**SMALL, **FAMILIES[name], **extra})


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_params_equal_the_real_model(name):
    cfg = make(name)
    torch.manual_seed(0)
    model = GPT(cfg)
    counts, a = model.num_params(), accounting(cfg)
    assert a["params_total"] == sum(p.numel() for p in model.parameters()) == counts["total"]
    assert a["params_stored"] == a["params_total"]  # [X10] N_s: every stored parameter
    assert a["params_embedding"] == counts["embedding"]
    assert a["params_nonembedding"] == counts["non_embedding"]
    assert a["params_active"] == counts["active"]
    assert a["stored_blocks"] == len(model.blocks)
    assert a["executed_layers"] == sum(s.kind == "block" for s in model.plan)


def touched_nonembedding(model):
    """Non-embedding params with a non-zero gradient; expert tensors count per expert slice."""
    touched = 0
    for name, p in model.named_parameters():
        if name.startswith(("wte.", "lm_head.")) or p.grad is None:
            continue
        if name.endswith(("ffn.w_gate", "ffn.w_up", "ffn.w_down")):  # (n_expert, ., .): count used experts
            used = (p.grad.flatten(1) != 0).any(dim=1)
            touched += int(used.sum()) * p[0].numel()
        elif (p.grad != 0).any():
            touched += p.numel()
    return touched


@pytest.mark.parametrize("name", ["dense", "dense_gqa_qknorm", "moe", "moe_tied_embed_norm", "smelt_dense_r3",
                                  "pcc_tied_both", "pcc_untied_both_qk", "pcc_untied_moe_embed_norm"])
def test_active_params_are_what_one_token_touches(name):
    """One token with gradients (exactly top_k experts per MoE execution) after a prefix held in the KV
    cache without gradients (so that its query and key matter: alone, softmax over one key is 1)."""
    cfg = make(name)
    torch.manual_seed(1)
    model = GPT(cfg)
    one_token_backward(model, token=7)
    assert touched_nonembedding(model) == accounting(cfg)["params_active"]


def one_token_backward(model, token):
    cache = KVCache()
    with torch.no_grad():
        model(torch.tensor([[5, 9, 11]]), cache=cache)
    _, loss = model(torch.tensor([[token]]), targets=torch.tensor([[3]]), cache=cache)
    loss.backward()


def test_looped_moe_touches_at_most_top_k_experts_per_visit():
    """A looped MoE layer may route the second visit elsewhere: the one-token touched set lies between
    the active count (top_k per stored layer) and top_k per visit."""
    cfg = make("smelt_moe")
    torch.manual_seed(2)
    model = GPT(cfg)
    one_token_backward(model, token=4)
    a = accounting(cfg)
    per_expert = 3 * cfg.n_embd * cfg.expert_hidden
    extra_visits = a["executed_layers"] - cfg.n_layer
    assert a["params_active"] <= touched_nonembedding(model) <= a["params_active"] + extra_visits * cfg.top_k * per_expert


def counted_flops(cfg, n_passes=None, B=2, T=8):
    """FlopCounterMode on a real forward + backward. SDPA is forced onto the math path: the CPU flash
    kernel is invisible to the counter, the math path's two bmms are seen (for the full T x T square).
    The counter has no formula for the MoE's grouped GEMMs: the experts run as their twin, the loop of
    per-expert matmuls (conftest.loop_experts, held equal to model.run_experts in test_model)."""
    torch.manual_seed(3)
    model = GPT(cfg)
    idx = torch.randint(0, cfg.eot_token, (B, T))  # no eot: one document, plain causal (is_causal)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter, \
            mock.patch.object(model_module, "run_experts", loop_experts):
        _, loss = model(idx, targets=idx, n_passes=n_passes)
        loss.backward()
    return counter.get_total_flops() / (B * T), model


@pytest.mark.parametrize("name, depth", [("dense_gqa_qknorm", 2), ("moe", 2), ("smelt_moe", 2), ("pcc_tied_both", 3),
                                         ("pcc_untied_moe_embed_norm", 3)])
def test_matmul_flops_match_flop_counter(name, depth):
    """Tolerance: exact (1e-9 relative) for the matmuls. The counter sees mm/bmm only: it misses the
    norms, softmax, SwiGLU, RoPE and the top-k combine (elementwise, which match.py leaves out or books
    under flops_norms), and it counts attention for the full T x T square whatever the causal or
    document mask, so the analytic side is evaluated at attended = T."""
    cfg = make(name, n_layer=depth)  # shallow: the counter's Python dispatch costs ~1 ms per op
    assert cfg.executed_layers() > depth or cfg.layout == "plain"
    T = 8
    counted, _ = counted_flops(cfg, T=T)
    a = accounting(cfg, attended=T)
    analytic = a["flops_per_token"] - a["flops_norms"]
    assert counted == pytest.approx(analytic, rel=1e-9)


def test_looped_flops_equal_the_unrolled_untied_twin():
    tied, untied = make("pcc_tied_both"), make("pcc_tied_both", tie_core=False)
    assert flops_per_token(tied) == flops_per_token(untied)  # the counter agrees with both (test above)
    # SMELT r=2 over 2 of 4 layers executes 6 blocks: the FLOPs of a plain 6-layer model
    smelt, plain6 = make("smelt_moe"), make("moe", n_layer=6)
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
    if not os.path.exists(os.path.join(ROOT, "config", "x_d8_vanilla.py")):
        pytest.skip("config/x_d8_vanilla.py not present")
    cfg, _ = load("x_d8_vanilla.py")
    assert round(accounting(cfg)["params_stored"] / 1e5) == 2058  # TPP 5 -> 1962 steps in the [X] code


def test_compute_active_counts_core_k_times():
    """[X10] N_c: prelude, coda and head once, core matrices K times, no input embedding."""
    cfg = make("pcc_tied_both")  # 5 -> 1/2/2, K=3
    block = match.block_shapes(cfg)["matmul_active"]
    assert accounting(cfg)["params_compute_active"] == (1 + 3 * 2 + 2) * block + cfg.vocab_size * cfg.n_embd
    assert accounting(cfg, n_passes=1)["params_compute_active"] == 5 * block + cfg.vocab_size * cfg.n_embd


def test_attention_cost_follows_the_attended_length():
    cfg = make("dense")
    assert accounting(cfg)["attended"] == (cfg.block_size + 1) / 2  # default: one document, causal
    assert accounting(cfg, avg_doc_len=9)["attended"] == 5
    a10, a20 = accounting(cfg, attended=10), accounting(cfg, attended=20)
    assert a20["flops_attn_scores"] == 2 * a10["flops_attn_scores"]
    assert a20["flops_ffn"] == a10["flops_ffn"]
    with pytest.raises(ValueError, match="either attended or avg_doc_len"):
        accounting(cfg, attended=3, avg_doc_len=5)


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
    tied, untied = accounting(make("pcc_tied_both")), accounting(make("pcc_tied_both", tie_core=False))
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
    untied2, untied4 = replace(cfg, tie_core=False), replace(cfg, tie_core=False, n_passes=4)
    grown = run_flops(untied2, [(100, untied2), (300, untied4)])
    assert grown["flops"] == pytest.approx(out["flops"])
    with pytest.raises(ValueError, match="untied"):
        run_flops(untied2, [(100, 4)])  # an untied model cannot run passes it has no cores for


def load(name):
    """config/NAME -> (ModelConfig, avg_doc_len)."""
    cfg, settings = match_cli.read_config(os.path.join(ROOT, "config", name))
    return cfg, settings["avg_doc_len"]


def test_worked_example_of_smelt():
    """[S] 200M, S~0.95: baseline L=12, H=1280, 192 experts -> ~1.33e9 FLOPs/token, ~3.87e9 non-embedding
    params; SMELT twin H=1056, 288 experts, F ratio 1.020, N ratio 1.004, KV 1.031 (README table; the
    paper: 1.37e9 FLOPs (+2.9%), 3.89e9 params (+0.4%), KV within 4%)."""
    base, doc_len = load("smelt_200m_base.py")
    assert (base.n_layer, base.n_embd, base.n_expert) == (12, 1280, 192)
    a = accounting(base, avg_doc_len=doc_len)
    assert a["flops_per_token"] == pytest.approx(1.33e9, rel=0.01)
    assert a["params_nonembedding"] == pytest.approx(3.87e9, rel=0.01)
    assert a["params_active"] == pytest.approx(0.207e9, rel=0.015)
    twin, report = match.match(base, "smelt", avg_doc_len=doc_len)  # its speed: report["seconds"], not a test
    assert (twin.n_embd, twin.n_expert, twin.expert_hidden) == (1056, 288, 352)
    assert (twin.n_head, twin.n_kv_head, twin.head_dim, twin.executed_layers()) == (12, 2, 88, 18)
    r = report["ratios"]
    assert r["kv"] == (18 * 2 * 2 * 88) / (12 * 2 * 2 * 128)  # 6336 / 6144, recomputed by hand
    assert r["flops"] == pytest.approx(1.020, abs=5e-4) and r["params"] == pytest.approx(1.004, abs=5e-4)
    assert report["matched"]["flops_per_token"] == pytest.approx(1.362e9, rel=1e-3)
    assert report["sparsity_matched"]["S"] == pytest.approx(0.945, abs=5e-4)
    assert report["sparsity_baseline"]["S"] == pytest.approx(0.946, abs=5e-4)
    stored, _ = load("smelt_200m_s95.py")
    assert stored == twin  # the config file is exactly what match() finds
    again, _ = match.match(base, "smelt", avg_doc_len=doc_len)
    assert again == twin  # deterministic


def test_search_options_group_into_one_object():
    """match(..., search=MatchSearch(...)) and the same options as keywords find the same twin; a
    misspelt option is named."""
    base, doc_len = load("smelt_200m_base.py")
    grid = match.MatchSearch(width_multiple=(16, 8), hidden_multiple=8, expert_multiple=1)
    by_object, _ = match.match(base, "smelt", avg_doc_len=doc_len, search=grid)
    by_keywords, _ = match.match(base, "smelt", avg_doc_len=doc_len, width_multiple=(16, 8), hidden_multiple=8,
                                 expert_multiple=1)
    assert by_object == by_keywords and by_object.n_embd % 16 == 0
    assert match.MatchSearch(flops_tol=0.02).flops_tol == (0.02, 0.02)
    with pytest.raises(ValueError, match="unknown match options.*width_multiples"):
        match.match(base, "smelt", width_multiples=(8,))


def test_flops_only_matching_of_a_prelude_core_coda_recipe():
    base = ModelConfig(**{**SMALL, "n_layer": 6, "n_embd": 512, "n_head": 8})
    twin, report = match.match(base, "pcc2", budgets=("flops",))
    assert twin.layout == "pcc" and (twin.n_embd, twin.n_head, twin.mlp_hidden) == (432, 8, 1296)
    assert report["ratios"]["flops"] == pytest.approx(1.0049, abs=1e-4)
    assert report["ratios"]["params"] == pytest.approx(0.7525, abs=1e-4)  # not a budget here: unmatched
    # the baseline's head shape is kept, even where the baseline derived it (head_dim 0 -> 512 / 8)
    assert (twin.head_dim, twin.n_kv_head) == (base.head_dim, base.n_kv_head) == (64, 8)


def test_infeasible_requests_say_which_budget_and_by_how_much():
    tiny_kv = ModelConfig(**{**SMALL, **MOE, "n_embd": 64, "n_head": 4, "n_kv_head": 1, "head_dim": 16})
    with pytest.raises(ValueError, match=r"KV budget cannot be met.*off by 200\.0%"):
        match.match(tiny_kv, dict(layout="smelt", n_passes=3, loop_span=4))
    dense = ModelConfig(**{**SMALL, "n_embd": 128})
    with pytest.raises(ValueError, match=r"params budget not met: ratio 0\.\d+ outside 1 \+- 0\.015 by \d+\.\d+%"):
        match.match(dense, "smelt")  # a dense model cannot buy back the params it loses by narrowing
    with pytest.raises(ValueError, match="unknown budgets"):
        match.match(dense, "smelt", budgets=("latency",))


def test_cli_json_and_table(capsys):
    assert match_cli.main(["--preset", "smelt-200m-s95", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"baseline", "matched", "ratios"}
    keys = {"n_embd", "n_expert", "n_layer", "executed_layers", "head_dim", "n_kv_head", "flops_per_token",
            "params_nonembedding", "params_active", "kv_per_token", "sparsity_S"}
    assert keys <= set(out["baseline"]) and keys <= set(out["matched"])
    assert set(out["ratios"]) == {"flops", "params", "kv"}
    assert (out["matched"]["n_embd"], out["matched"]["n_expert"], out["matched"]["executed_layers"]) == (1056, 288, 18)
    assert match_cli.main([os.path.join(ROOT, "config", "smelt_200m_base.py")]) == 0
    table = capsys.readouterr().out
    assert "flops_per_token" in table and "kv_per_token" in table and "sparsity_S" in table


@pytest.mark.parametrize("argv, message", [
    (["--preset", "smelt-3b-s95"], "unknown preset 'smelt-3b-s95'"),
    (["config/no_such_config.py"], "config file not found"),
    ([], "give exactly one of a config file or --preset"),
    (["--preset", "smelt-200m-s95", "--memory"], "unrecognized arguments: --memory"),  # now tooling/memory.py
])
def test_cli_mistakes_are_one_line_and_exit_2(argv, message, capsys):
    assert message in one_line_error(match_cli.main, argv, capsys, "match.py")


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


def test_every_scale_preset_matches():
    assert sorted(PRESET_TWINS) == sorted(f"{scale}-s{s}" for scale, v in match_cli.SCALES.items() for s in v[-1])
    for name, (shape, ratios) in PRESET_TWINS.items():
        base, doc_len = match_cli.preset_baseline(f"smelt-{name}")
        twin, report = match.match(base, "smelt", avg_doc_len=doc_len)
        assert (twin.n_embd, twin.n_expert, twin.expert_hidden, twin.n_head, twin.n_kv_head, twin.head_dim) == shape
        assert tuple(round(report["ratios"][b], 4) for b in ("flops", "params", "kv")) == ratios
        assert report["sparsity_baseline"]["S"] == pytest.approx(int(name[-2:]) / 100, abs=0.015)
    # the paper's sizes at 1.6B, S~0.97: 53.9B total params, a 504-expert SMELT twin
    base, _ = match_cli.preset_baseline("smelt-1.6b-s97")
    assert accounting(base)["params_total"] == pytest.approx(53.89e9, rel=1e-3)


def test_read_config_uses_the_model_reader(tmp_path):
    path = tmp_path / "c.py"
    path.write_text("n_layer = 2\nn_embd = 64\nn_head = 2\navg_doc_len = 0\nbatch_size = 5\n")
    cfg, settings = match_cli.read_config(str(path))
    assert (cfg.n_layer, cfg.n_embd) == (2, 64)
    assert settings == {"avg_doc_len": None, "batch_size": 5}  # 0: a full block_size document, as train.py


def config_file(tmp_path, text):
    path = tmp_path / "c.py"
    path.write_text(text)
    return str(path)


ONE_LAYER = "n_layer = 1\nn_embd = 64\nn_head = 2\nn_expert = 8\ntop_k = 2\nexpert_hidden = 32\n"
SMALL_CONFIG = "n_layer = 4\nn_embd = 64\nn_head = 2\n"


@pytest.mark.parametrize("config, argv, message", [
    # a recipe that gives a twin which does not loop: nothing to match
    (ONE_LAYER, ["--recipe", "smelt"], "loop_span=0"),  # n_layer // 2 = 0 layers loop
    (SMALL_CONFIG, ["--recipe", "layout=smelt,n_passes=1"],
     "n_passes=1: the twin runs every block once"),
    (SMALL_CONFIG, ["--recipe", "layout=pcc,n_passes=1"], "n_passes=1: the twin runs every block once"),
    (SMALL_CONFIG, ["--recipe", "layout=plain"], "layout='plain': the twin runs every block once"),
    (SMALL_CONFIG, ["--recipe", "layout=pcc,n_passes=2,n_layer=0"], "n_layer=0"),
    (None, ["--recipe", "smelt"], "the recipe adds no loop to it"),  # the SMELT twin is looped already
    # numbers out of range, named by their flag
    (SMALL_CONFIG, ["--avg_doc_len", "nan"], "argument --avg_doc_len: nan: must be a finite number >= 1"),
    (SMALL_CONFIG, ["--avg_doc_len", "0"], "argument --avg_doc_len: 0: must be >= 1"),
    (SMALL_CONFIG, ["--attended", "inf"], "argument --attended: inf: must be a finite number > 0"),
    (SMALL_CONFIG, ["--attended", "-3"], "argument --attended: -3: must be > 0"),
    (SMALL_CONFIG, ["--rec", "smelt"], "unrecognized arguments: --rec smelt"),  # no abbreviations
])
def test_refused_recipes_and_numbers_are_one_line(tmp_path, capsys, config, argv, message):
    path = config_file(tmp_path, config) if config else os.path.join(ROOT, "config", "smelt_200m_s95.py")
    assert message in one_line_error(match_cli.main, [path, *argv], capsys, "match.py")


@pytest.mark.parametrize("options, message", [
    (dict(params_tol=-0.1), "match option params_tol=-0.1: must be a fraction"),
    (dict(kv_tol=1.5), "match option kv_tol=1.5"),
    (dict(flops_tol=(0.0, float("nan"))), "match option flops_tol=(0.0, nan)"),
    (dict(width_multiple=0), "match option width_multiple=(0,)"),
    (dict(hidden_multiple=0), "match option hidden_multiple=0"),
    (dict(head_dim_range=(0, 8)), "match option head_dim_range=(0, 8)"),
    (dict(budgets=()), "budgets=(): give at least one"),
    (dict(attended=float("nan")), "attended must be a finite number > 0"),
])
def test_match_options_out_of_range_are_named(options, message):
    base = ModelConfig(n_layer=4, n_embd=64, n_head=2)
    with pytest.raises(ValueError, match=re.escape(message)):
        match.match(base, "smelt", **options)
