"""match.py: accounting against the real model and FlopCounterMode, [S1] sparsity, triple matching."""

import json
import os
import re
from dataclasses import replace
from unittest import mock

import pytest
import torch
from conftest import REPO as ROOT, loop_experts
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import match
import model as model_module
import train
from match import accounting, flops_per_token, fully_activated, run_flops, sparsity
from model import GPT, KVCache, ModelConfig

SMALL = dict(vocab_size=64, block_size=32, n_layer=4, n_embd=32, n_head=4, init="nanogpt")  # tied wte
MOE = dict(n_expert=6, top_k=2, expert_hidden=16)
UNTIED = dict(init="x")  # the [X] init: an untied lm head

FAMILIES = {  # dense_gqa_x: QK-norm, no gains, embed norm
    "dense": dict(), "dense_gqa_x": dict(n_kv_head=2, head_dim=12, norms="x", **UNTIED),
    "dense_padded_vocab": dict(n_logits=50, eot_token=49, **UNTIED),
    "moe": dict(MOE, **UNTIED), "moe_x": dict(MOE, norms="x"),
    "smelt_moe": dict(MOE, layout="smelt", n_passes=2), "smelt_dense_r3": dict(layout="smelt", n_passes=3),
    "layer_loop_moe": dict(MOE, layout="layer_loop", n_passes=2),
    "pcc_tied_both": dict(layout="pcc", n_layer=5, n_passes=3),
    "pcc_tied_norm_x": dict(layout="pcc", n_layer=5, n_passes=2, boundary="norm", norms="x"),
    "pcc_tied_inject": dict(layout="pcc", n_passes=2, boundary="inject"),
    "pcc_tied_none_moe": dict(MOE, layout="pcc", n_passes=2, boundary="none"),
    "pcc_untied_both": dict(layout="pcc_untied", n_layer=5, n_passes=2, **UNTIED),
    "pcc_untied_moe_x": dict(MOE, layout="pcc_untied", n_passes=3, norms="x", **UNTIED)}


def make(name, **extra):
    return ModelConfig(**{**SMALL, **FAMILIES[name], **extra})


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_params_equal_the_real_model(name):
    cfg = make(name)
    model = GPT(cfg)
    counts, a = model.num_params(), accounting(cfg)
    total = sum(p.numel() for p in model.parameters())
    assert a["params_total"] == a["params_stored"] == total == counts["total"]
    assert [a[f"params_{k}"] for k in ("embedding", "nonembedding", "active")] == \
        [counts[k] for k in ("embedding", "non_embedding", "active")]
    assert a["stored_blocks"] == len(model.blocks)
    assert a["executed_layers"] == sum(s.kind == "block" for s in model.plan)
    # 6 N_c is the non-attention matmul FLOPs
    assert a["flops_6n"] == sum(a[f"flops_{k}"] for k in ("attn_proj", "router", "ffn", "unembedding"))
    assert a["flops_per_token"] == pytest.approx(3 * a["flops_forward"])
    assert flops_per_token(cfg, backward=False) == pytest.approx(a["flops_forward"])


@pytest.mark.parametrize("name", ["dense", "dense_gqa_x", "moe", "moe_x", "smelt_dense_r3", "smelt_moe",
                                  "pcc_tied_both", "pcc_untied_both", "pcc_untied_moe_x"])
def test_active_params_are_what_one_token_touches(name):
    """One token's backward after a 3-token prefix in the KV cache (alone, the query would not matter)."""
    cfg = make(name)
    torch.manual_seed(1)
    model = GPT(cfg)
    with torch.no_grad():
        for p in model.parameters():  # the [X] init's zeros would stop gradients
            p.add_(0.05 * torch.randn_like(p))
        model(torch.tensor([[5, 9, 11]]), cache=(cache := KVCache()))
    model(torch.tensor([[7]]), targets=torch.tensor([[3]]), cache=cache)[1].backward()
    touched = 0
    for name, p in model.named_parameters():
        if name.startswith(("wte.", "lm_head.")) or p.grad is None:
            continue
        if name.endswith(("ffn.w_gate_up", "ffn.w_down")):  # (n_expert, ...): count the used experts
            touched += int((p.grad.flatten(1) != 0).any(dim=1).sum()) * p[0].numel()
        elif (p.grad != 0).any():
            touched += p.numel()
    active, visits = accounting(cfg)["params_active"], cfg.executed_layers() - cfg.n_blocks
    # a second visit of a stored MoE layer may route elsewhere: up to top_k more experts
    extra = visits * cfg.top_k * 3 * cfg.n_embd * cfg.expert_hidden if cfg.n_expert else 0
    assert active <= touched <= active + extra


@pytest.mark.parametrize("name, depth", dict(dense_gqa_x=2, moe=2, smelt_moe=2, pcc_tied_both=3,
                                             pcc_untied_moe_x=3, dense_padded_vocab=1).items())
def test_matmul_flops_match_flop_counter(name, depth):
    """Exact for the matmuls, all that FlopCounterMode sees, over the full T x T square: attended = T. SDPA
    runs its math path (the counter misses the CPU flash kernel), the experts a loop of matmuls."""
    cfg = make(name, n_layer=depth)  # shallow: the counter's Python dispatch costs ~1 ms per op
    assert cfg.executed_layers() > depth or cfg.layout == "plain"
    torch.manual_seed(3)
    model, idx = GPT(cfg), torch.randint(0, cfg.eot_token, (2, 8))  # no eot: one document
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter, \
            mock.patch.object(model_module, "run_experts", loop_experts):
        model(idx, targets=idx)[1].backward()
    a = accounting(cfg, attended=8)
    assert counter.get_total_flops() / 16 == pytest.approx(a["flops_per_token"] - a["flops_norms"], rel=1e-9)


def test_looped_flops_and_kv_equal_the_unrolled_twins():
    tied, untied = make("pcc_tied_both"), make("pcc_tied_both", layout="pcc_untied")
    assert flops_per_token(tied) == flops_per_token(untied)
    a_tied, a_untied = accounting(tied), accounting(untied)
    assert a_tied["kv_per_token"] == a_untied["kv_per_token"]
    assert a_tied["stored_blocks"] < a_untied["stored_blocks"]
    smelt, plain6 = make("smelt_moe"), make("moe", n_layer=6, init="nanogpt")  # 2 + 2 x 2 executions of 4
    assert flops_per_token(smelt) == flops_per_token(plain6)
    assert accounting(smelt)["params_compute_active"] == accounting(plain6)["params_compute_active"]
    assert accounting(smelt)["params_nonembedding"] < accounting(plain6)["params_nonembedding"]
    # the KV cache grows with the executed layers, not the stored ones
    kv = {r: accounting(make("smelt_moe", n_passes=r))["kv_per_token"] for r in (1, 2, 3)}
    per_layer = 2 * 4 * 8  # 2 x n_kv_head x head_dim
    assert kv == {1: 4 * per_layer, 2: 6 * per_layer, 3: 8 * per_layer}
    assert accounting(make("dense"), kv_bytes_per_element=4)["kv_bytes_per_token"] == 4 * 4 * per_layer


def test_x10_counts_of_the_x_d8_vanilla():
    """N_s of the [X] d8 Vanilla is the [X] code's 205.8M (N_c: test_grow's test_param_counts_...)."""
    cfg, _, _ = match.read_config(os.path.join(ROOT, "config", "x_d8_vanilla.py"), vocab_size=50304)
    assert (cfg.n_layer, cfg.n_embd, cfg.norms, cfg.layout) == (8, 1024, "x", "plain")
    assert round(accounting(cfg)["params_stored"] / 1e5) == 2058


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


def test_run_flops_token_weights_growth_phases():
    """[X13]: 2 passes for a quarter of the tokens, then 4 (rho = 0.75)."""
    cfg = make("pcc_tied_both", n_passes=2)
    out = run_flops(cfg, [(100, 2), (300, 4)])
    f2, f4 = flops_per_token(cfg, n_passes=2), flops_per_token(cfg, n_passes=4)
    n2, n4 = (accounting(cfg, n_passes=k)["params_compute_active"] for k in (2, 4))
    assert out["flops"] == pytest.approx(100 * f2 + 300 * f4) and out["mean_passes"] == pytest.approx(3.5)
    assert out["flops_per_token"] == pytest.approx(0.25 * f2 + 0.75 * f4)
    assert out["params_compute_active"] == pytest.approx(0.25 * n2 + 0.75 * n4)
    untied2, untied4 = replace(cfg, layout="pcc_untied"), replace(cfg, layout="pcc_untied", n_passes=4)
    assert run_flops(untied2, [(100, untied2), (300, untied4)])["flops"] == pytest.approx(out["flops"])
    with pytest.raises(ValueError, match="runs 1 to 2 passes"):
        run_flops(untied2, [(100, 4)])  # an untied model has no cores for more passes




def test_worked_example_of_smelt():
    """[S] 200M, S~0.95: the paper's budgets, and the config files are exactly the baseline and twin."""
    base = match.preset_baseline("smelt-200m-s95")
    assert (base.n_layer, base.n_embd, base.n_expert) == (12, 1280, 192)
    a = accounting(base, avg_doc_len=512)
    assert a["flops_per_token"] == pytest.approx(1.33e9, rel=0.01)
    assert a["params_nonembedding"] == pytest.approx(3.87e9, rel=0.01)
    assert a["params_active"] == pytest.approx(0.207e9, rel=0.015)
    twin, report = match.match(base, "smelt", avg_doc_len=512)
    assert (twin.n_head, twin.n_kv_head, twin.head_dim, twin.executed_layers()) == (12, 2, 88, 18)
    assert report["ratios"]["kv"] == (18 * 2 * 2 * 88) / (12 * 2 * 2 * 128)  # 6336 / 6144, by hand
    assert report["matched"]["flops_per_token"] == pytest.approx(1.362e9, rel=1e-3)
    assert report["sparsity_matched"]["S"] == pytest.approx(0.945, abs=5e-4)
    assert report["sparsity_baseline"]["S"] == pytest.approx(0.946, abs=5e-4)
    for name, cfg in (("smelt_200m_base.py", base), ("smelt_200m_s95.py", twin)):
        assert match.read_config(os.path.join(ROOT, "config", name))[0] == cfg  # default vocabulary: 4096


def test_search_options_group_into_one_object():
    base, options = match.preset_baseline("smelt-200m-s95"), dict(width_multiple=(16, 8), hidden_multiple=8)
    by_object, _ = match.match(base, "smelt", avg_doc_len=512, search=match.MatchSearch(**options))
    assert by_object == match.match(base, "smelt", avg_doc_len=512, **options)[0]
    assert match.MatchSearch(flops_tol=0.02).flops_tol == (0.02, 0.02)
    with pytest.raises(TypeError, match="width_multiples"):
        match.match(base, "smelt", width_multiples=(8,))


def test_flops_only_matching_of_a_prelude_core_coda_recipe():
    base = ModelConfig(**{**SMALL, "n_layer": 6, "n_embd": 512, "n_head": 8})
    twin, report = match.match(base, "pcc2", budgets=("flops",))
    assert twin.layout == "pcc" and (twin.n_embd, twin.n_head, twin.mlp_hidden) == (432, 8, 1296)
    # params are not a budget here: reported, unmatched; the head shape is kept
    assert (round(report["ratios"]["flops"], 4), round(report["ratios"]["params"], 4)) == (1.0049, 0.7525)
    assert (twin.head_dim, twin.n_kv_head) == (base.head_dim, base.n_kv_head) == (64, 8)


def test_infeasible_requests_say_which_budget_and_by_how_much():
    tiny_kv = ModelConfig(**{**SMALL, **MOE, "n_embd": 64, "n_head": 4, "n_kv_head": 1, "head_dim": 16})
    with pytest.raises(ValueError, match=r"KV budget cannot be met.*off by 100\.0%"):
        match.match(tiny_kv, dict(layout="smelt", n_passes=3))  # 8 executions: head_dim 8 < 16 needed
    dense = ModelConfig(**{**SMALL, "n_embd": 128})
    # a dense model cannot buy back the params it loses by narrowing
    with pytest.raises(ValueError, match=r"params budget not met: ratio 0\.\d+ outside 1 \+- 0\.015 by \d"):
        match.match(dense, "smelt")
    with pytest.raises(ValueError, match="budgets"):
        match.match(dense, "smelt", budgets=("latency",))


@pytest.mark.parametrize("options, message", [
    (dict(params_tol=-0.1), "match option params_tol=-0.1 out of range"),
    (dict(flops_tol=(0.0, float("nan"))), "match option flops_tol=(0.0, nan)"),
    (dict(kv_tol=1.5), "match option kv_tol=1.5"), (dict(width_multiple=0), "option width_multiple=(0,)"),
    (dict(head_dim_range=(0, 8)), "match option head_dim_range=(0, 8)"),
    (dict(budgets=()), "budgets=(): give at least one"), (dict(attended=float("nan")), "need attended > 0")])
def test_match_options_out_of_range_are_named(options, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        match.match(ModelConfig(n_layer=4, n_embd=64, n_head=2), "smelt", **options)


# match.py --preset smelt-SCALE-sS: the twin's (n_embd, n_expert, expert_hidden, n_head, n_kv_head,
# head_dim) and F, N, KV ratios to 4 decimals, as found when the presets were written: a change of results
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
        twin, report = match.match(match.preset_baseline(f"smelt-{name}"), "smelt", avg_doc_len=512)
        keys = ("n_embd", "n_expert", "expert_hidden", "n_head", "n_kv_head", "head_dim")
        assert tuple(getattr(twin, k) for k in keys) == shape
        assert tuple(round(report["ratios"][b], 4) for b in ("flops", "params", "kv")) == ratios
        assert report["sparsity_baseline"]["S"] == pytest.approx(int(name[-2:]) / 100, abs=0.015)
    largest = accounting(match.preset_baseline("smelt-1.6b-s97"))
    assert largest["params_total"] == pytest.approx(53.89e9, rel=1e-3)  # the paper's 53.9B




def test_cli_json_and_table(capsys):
    match.main(["--preset", "smelt-200m-s95", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"baseline", "matched", "ratios", "vocab_size", "vocab_from"}
    assert list(out["ratios"]) == ["flops", "params", "kv"]
    match.main(["--preset", "smelt-200m-s95"])
    text = capsys.readouterr().out
    assert "ratios (matched / baseline, as [S] Table 10): flops 1.0201, params 1.0043, kv 1.0312" in text
    match.main([os.path.join(ROOT, "config", "smelt_200m_base.py"), "--avg_doc_len", "512"])
    table = capsys.readouterr().out
    assert table.startswith("vocab_size 4096 from --vocab_size, attended 256.5 keys per query")
    assert re.search(r"flops_per_token +1\.3354e\+09", table)


def test_cli_takes_the_vocabulary_and_document_length_from_the_data(tmp_path, capsys):
    """As train.py: n_vocab padded to 64 (n_logits the real size), the eot token, the mean document length."""
    (tmp_path / "meta.json").write_text(json.dumps(dict(n_vocab=50257, eot_token=50256, mean_doc_len=99)))
    path, model = tmp_path / "c.py", "n_layer = 2\nn_embd = 64\nn_head = 2\n"
    path.write_text(f"{model}data_dir = {str(tmp_path)!r}\nbatch_size = 5\n")
    cfg, settings, where = match.read_config(str(path))
    assert (cfg.vocab_size, cfg.n_logits, cfg.eot_token, settings["batch_size"]) == (50304, 50257, 50256, 5)
    assert where.endswith("meta.json")
    match.main([str(path), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert (out["vocab_size"], out["attended"]) == (50304, 50.0)
    path.write_text(f"{model}data_dir = 'no/such/folder'\n")
    assert match.read_config(str(path), vocab_size=320)[0].vocab_size == 320
    path.write_text(f"{model}n_expert = 16\n")  # the rest: train.py's defaults
    assert match.read_config(str(path))[0] == ModelConfig(**dict(
        {k: train.DEFAULTS[k] for k in train.MODEL_SETTINGS}, n_layer=2, n_embd=64, n_head=2, n_expert=16))


PLAIN4 = "n_layer = 4\nn_embd = 64\nn_head = 2\nblock_size = 256\nlayout = 'plain'\nn_expert = 0\n"


@pytest.mark.parametrize("config, argv, message", [
    (None, ["--preset", "smelt-3b-s95"], "argument --preset: invalid choice: 'smelt-3b-s95'"),
    (None, ["config/no_such_config.py"], "config file not found"),
    (None, [], "give a config file or --preset"),
    ("n_layer = 1\nn_embd = 64\nn_head = 2\n", ["--recipe", "smelt"], "a loop needs n_layer >= 2"),
    (PLAIN4, ["--recipe", "layout=smelt,n_passes=1"], "4 blocks per token, the baseline (plain) 4: a recipe"),
    (PLAIN4, ["--recipe", "layout=pcc,n_passes=2,n_layer=0"], "n_layer=0: must be >= 1"),
    (PLAIN4, ["--recipe", "smelt3,x"], "expected a name in"),
    (PLAIN4, ["--avg_doc_len", "nan"], "argument --avg_doc_len: nan: must be a finite number > 0"),
    (PLAIN4, ["--avg_doc_len", "1000"], "a document length in [1, block_size=256]"),
    (PLAIN4, ["--memory", "--micro_batch", "0"], "argument --micro_batch: 0: must be a finite number"),
    (PLAIN4, ["--rec", "smelt"], "unrecognized arguments: --rec smelt"),  # no abbreviations
])
def test_cli_mistakes_are_one_line_and_exit_2(tmp_path, capsys, config, argv, message):
    if config:
        (tmp_path / "c.py").write_text(config)
        argv = [str(tmp_path / "c.py"), *argv]
    with pytest.raises(SystemExit) as e:
        match.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("match.py: error: ") and err.count("\n") == 1
    assert message in err
