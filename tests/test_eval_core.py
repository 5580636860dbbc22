import collections
import json
import sys
import math
import os
import random
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import eval_core as ec
from tooling import core_bundle

BUNDLE = os.path.join(os.path.dirname(__file__), "data", "core_bundle")


class CharTokenizer:
    """One token per ASCII character; eot (= BOS, = pad) is 0, which never occurs in text."""
    eot_token = 0
    n_vocab = 128
    name = "char"

    def encode(self, text):
        assert all(0 < ord(c) < 128 for c in text), text
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


class MergeTokenizer(CharTokenizer):
    """Char tokenizer that fuses ":A" into one token (100 + ...), so a BPE-like merge crosses the join."""
    def encode(self, text):
        out, i = [], 0
        while i < len(text):
            if text[i:i + 2] == ":A":
                out.append(127)
                i += 2
            else:
                out.append(ord(text[i]))
                i += 1
        return out


class BigramModel(torch.nn.Module):
    """logits[t] = table[idx[t]]: every loss is a known number -log softmax(table)[prev, next]."""
    def __init__(self, vocab=128, seed=0, block_size=1024):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.table = torch.nn.Parameter(torch.randn(vocab, vocab, generator=g) * 3)
        self.config = type("C", (), {"block_size": block_size})()

    def forward(self, idx):
        return self.table[idx], None

    def loss(self, prev, nxt):
        if not hasattr(self, "_logp"):
            self._logp = F.log_softmax(self.table.detach().double(), dim=-1).tolist()
        return -self._logp[prev][nxt]


class OracleModel(torch.nn.Module):
    """Copies its input: at position t it puts all mass on the token at t+1 (a perfect next-token oracle)."""
    def __init__(self, vocab=128, block_size=4096):
        super().__init__()
        self.vocab = vocab
        self.config = type("C", (), {"block_size": block_size})()

    def forward(self, idx):
        nxt = torch.roll(idx, -1, dims=1)
        return F.one_hot(nxt, self.vocab).float() * 100.0, None


class FirstChoiceModel(torch.nn.Module):
    """Constant logits peaked on token 0 (never a target): every span token costs exactly 1e4, so all
    choices tie and the first one wins; LM greedy predictions are always wrong."""
    def __init__(self, vocab=128, block_size=4096):
        super().__init__()
        self.vocab = vocab
        self.config = type("C", (), {"block_size": block_size})()

    def forward(self, idx):
        logits = torch.zeros(*idx.shape, self.vocab)
        logits[..., 0] = 1e4
        return logits


def nanochat_find_common_length(token_sequences, direction="left"):
    """nanochat/core_eval.py find_common_length, verbatim."""
    min_len = min(len(seq) for seq in token_sequences)
    indices = {"left": range(min_len), "right": range(-1, -min_len - 1, -1)}[direction]
    for i, idx in enumerate(indices):
        token = token_sequences[0][idx]
        if not all(seq[idx] == token for seq in token_sequences):
            return i
    return min_len


@torch.no_grad()
def nanochat_evaluate_example(model, tokenizer, item, task_type, delim, fewshot=(), max_len=None):
    """nanochat/core_eval.py evaluate_example after its few-shot draw, transcribed statement by statement
    (prompts from ec.render_*, whose exact strings the tests above pin). Returns (is_correct, pred,
    mean_losses); pred and mean_losses are None for LM. Raises where nanochat raises."""
    bos_id = tokenizer.eot_token
    if task_type == "multiple_choice":
        tokens = [[bos_id] + tokenizer.encode(p) for p in ec.render_mc(item, delim, fewshot)]
        start_idxs = [nanochat_find_common_length(tokens, "left")] * len(tokens)
        end_idxs = [len(x) for x in tokens]
    elif task_type == "schema":
        tokens = [[bos_id] + tokenizer.encode(p) for p in ec.render_schema(item, delim, fewshot)]
        suffix_length = nanochat_find_common_length(tokens, "right")
        end_idxs = [len(x) for x in tokens]
        start_idxs = [ei - suffix_length for ei in end_idxs]
    else:
        tokens_without, tokens_with = [[bos_id] + tokenizer.encode(p) for p in ec.render_lm(item, delim, fewshot)]
        start_idx, end_idx = len(tokens_without), len(tokens_with)
        assert start_idx < end_idx and tokens_without == tokens_with[:start_idx]
        tokens, start_idxs, end_idxs = [tokens_with], [start_idx], [end_idx]
    if max_len is not None:
        new_tokens, new_start_idxs, new_end_idxs = [], [], []
        for t, s, e in zip(tokens, start_idxs, end_idxs):
            if len(t) > max_len:
                num_to_crop = len(t) - max_len
                new_tokens.append(t[-max_len:])
                new_start_idxs.append(s - num_to_crop)
                new_end_idxs.append(e - num_to_crop)
                assert s - num_to_crop >= 0, "this should never happen right?"
                assert e - num_to_crop >= 0, "this should never happen right?"
            else:
                new_tokens.append(t)
                new_start_idxs.append(s)
                new_end_idxs.append(e)
        tokens, start_idxs, end_idxs = new_tokens, new_start_idxs, new_end_idxs
    input_ids = torch.full((len(tokens), max(len(x) for x in tokens)), bos_id, dtype=torch.long)
    for i, x in enumerate(tokens):
        input_ids[i, :len(x)] = torch.tensor(x, dtype=torch.long)
    outputs = model(input_ids)
    outputs = outputs[0] if isinstance(outputs, tuple) else outputs
    batch_size, seq_len = input_ids.size()
    target_ids = torch.roll(input_ids, shifts=-1, dims=1)
    losses = F.cross_entropy(outputs.view(batch_size * seq_len, -1), target_ids.view(batch_size * seq_len),
                             reduction="none").view(batch_size, seq_len)
    losses[:, -1] = float("nan")
    predictions = outputs.argmax(dim=-1)
    if task_type == "language_modeling":
        si, ei = start_idxs[0], end_idxs[0]
        return torch.all(predictions[0, si - 1:ei - 1] == input_ids[0, si:ei]).item(), None, None
    mean_losses = [losses[i, si - 1:ei - 1].mean().item() for i, (si, ei) in enumerate(zip(start_idxs, end_idxs))]
    pred_idx = mean_losses.index(min(mean_losses))
    return pred_idx == item["gold"], pred_idx, mean_losses


def score_one(model, item, task_type, delim=" ", fewshot=(), max_len=None):
    """eval_core's (result, built example) for one item under the char tokenizer."""
    ex = ec.build_example(item, task_type, delim, TOK, fewshot, max_len)
    (res,) = ec.score_examples(model, [ex], task_type, TOK.eot_token)
    return res, ex


TOK = CharTokenizer()
MC_ITEM = {"query": "Q: 1+1?", "choices": ["2", "3"], "gold": 0}
MC_SHOTS = [{"query": "Q: 2+2?", "choices": ["5", "4"], "gold": 1}, {"query": "Q: 0+1?", "choices": ["1"], "gold": 0}]


def bos(text):
    return [0] + [ord(c) for c in text]


# ---------------------------------------------------------------- rendering and spans

def test_render_mc_exact_strings_and_spans():
    prompts = ec.render_mc(MC_ITEM, " ", MC_SHOTS)
    assert prompts == ["Q: 2+2? 4\n\nQ: 0+1? 1\n\nQ: 1+1? 2", "Q: 2+2? 4\n\nQ: 0+1? 1\n\nQ: 1+1? 3"]
    ex = ec.build_example(MC_ITEM, "multiple_choice", " ", TOK, MC_SHOTS)
    n = len(bos("Q: 2+2? 4\n\nQ: 0+1? 1\n\nQ: 1+1? "))
    assert ex["tokens"] == [bos(p) for p in prompts]
    assert ex["starts"] == [n, n] and ex["ends"] == [n + 1, n + 1]  # only the differing answer token
    assert ex["answer_start"] == n and ex["gold"] == 0
    # choices sharing a first word: the MC span starts after the common prefix, the answer NLL span does not
    item = {"query": "Pick:", "choices": ["a cat", "a dog"], "gold": 1}
    ex = ec.build_example(item, "multiple_choice", " ", TOK)
    assert ex["starts"] == [len(bos("Pick: a ")), len(bos("Pick: a "))]
    assert ex["answer_start"] == len(bos("Pick: "))


def test_render_schema_exact_strings_and_spans():
    item = {"context_options": ["The cup hit the table", "The cup hit the floor"], "continuation": "and broke.",
            "gold": 1}
    shot = {"context_options": ["A dog", "A cat"], "continuation": "meowed.", "gold": 1}
    prompts = ec.render_schema(item, " ", [shot])
    assert prompts == ["A cat meowed.\n\nThe cup hit the table and broke.",
                       "A cat meowed.\n\nThe cup hit the floor and broke."]
    ex = ec.build_example(item, "schema", " ", TOK, [shot])
    suffix = len(" and broke.")  # common token suffix: "table"/"floor" differ in their last letter
    assert ex["ends"] == [len(bos(p)) for p in prompts]
    assert ex["starts"] == [e - suffix for e in ex["ends"]]
    assert ex["answer_start"] == len(bos("A cat meowed.\n\nThe cup hit the floor "))


def test_render_lm_exact_strings_and_spans():
    item = {"context": "  Input: ( [  ", "continuation": "] )"}
    shots = [{"context": "Input: <", "continuation": ">"}]
    without, with_ = ec.render_lm(item, " ", shots)
    assert without == "Input: < >\n\nInput: ( ["  # context trimmed, then the whole prompt stripped
    assert with_ == "Input: < >\n\nInput: ( [ ] )"
    ex = ec.build_example(item, "language_modeling", " ", TOK, shots)
    assert ex["tokens"] == [bos(with_)]
    assert ex["starts"] == [len(bos(without))] and ex["ends"] == [len(bos(with_))]
    assert TOK.decode(ex["tokens"][0][ex["starts"][0]:]) == " ] )"  # the delimiter's space is scored too
    assert not ex["boundary_fixed"]
    # multi-character delimiter (as in "\nAnswer: ")
    without, with_ = ec.render_lm({"context": "Repeat: x", "continuation": "x x"}, "\nOutput: ")
    assert (without, with_) == ("Repeat: x\nOutput:", "Repeat: x\nOutput: x x")


def test_lm_boundary_moved_by_merge_uses_common_prefix():
    tok = MergeTokenizer()
    ex = ec.build_example({"context": "Q:", "continuation": "A"}, "language_modeling", "", tok)
    # without = "Q:" -> [0, Q, :]; with = "Q:A" -> [0, Q, <:A>]; common prefix 2
    assert ex["tokens"] == [[0, ord("Q"), 127]] and ex["starts"] == [2] and ex["boundary_fixed"]


def test_crop_from_left():
    item = {"context": "abcdefghij", "continuation": "XY"}
    ex = ec.build_example(item, "language_modeling", " ", TOK, max_len=6)
    full = bos("abcdefghij XY")
    assert ex["tokens"] == [full[-6:]]
    assert ex["starts"] == [len(bos("abcdefghij")) - (len(full) - 6)] and ex["ends"] == [6]
    assert TOK.decode(ex["tokens"][0][ex["starts"][0]:]) == " XY"
    # a crop that leaves the LM span starting at 0 (or below): nanochat fails there too
    for max_len in (3, 2):
        with pytest.raises(ValueError, match="does not fit in the model context.*nanochat's crop would assert"):
            ec.build_example(item, "language_modeling", " ", TOK, max_len=max_len)


def test_shuffle_and_fewshot_seeds_match_nanochat():
    data = list(range(20))
    ref = list(data)
    random.Random(1337).shuffle(ref)
    assert ec.shuffle_and_cut(data, 5) == ref[:5] and ec.shuffle_and_cut(data) == ref
    for idx in (0, 7):
        want = [data[i] for i in random.Random(1234 + idx).sample([i for i in range(20) if i != idx], 4)]
        got = ec.sample_fewshot(data, idx, 4)
        assert got == want and idx not in got
    assert ec.sample_fewshot(data, 3, 4, seed=0) == [data[i] for i in random.Random(3).sample(
        [i for i in range(20) if i != 3], 4)]



def test_fewshot_pool_smaller_than_k_uses_all_other_items():
    """nanochat's rng.sample(others, k) raises when k > n-1; we take all n-1 others in that rng's sample order
    and report how many were used."""
    data = [{"query": f"q{i}?", "choices": ["a", "b"], "gold": i % 2} for i in range(3)]
    for idx in range(3):
        others = [i for i in range(3) if i != idx]
        with pytest.raises(ValueError):  # what nanochat's evaluate_example runs
            random.Random(1234 + idx).sample(others, 5)
        assert ec.sample_fewshot(data, idx, 5) == [data[i] for i in random.Random(1234 + idx).sample(others, 2)]
    task = {"label": "t", "icl_task_type": "multiple_choice", "num_fewshot": 5, "continuation_delimiter": " "}
    r = ec.evaluate_task(BigramModel(), TOK, task, data)
    assert r["fewshot_used"] == 2 and r["n"] == 3
    assert ec.evaluate_task(BigramModel(), TOK, task, data, num_fewshot=1)["fewshot_used"] == 1
    res = ec.evaluate_core(BigramModel(), TOK, BUNDLE, num_fewshot=32, labels=["toy_arith_mc"], progress=False)
    assert res["tasks"]["toy_arith_mc"]["fewshot_used"] == 7  # 8 items
    assert "used all of them" in ec.format_core_table(res) and "'toy_arith_mc': '7 of 32'" in ec.format_core_table(res)


# ---------------------------------------------------------------- scoring

def test_stub_model_known_losses_give_expected_choice_and_nll():
    model = BigramModel()
    item = {"query": "Q: 1+1?", "choices": ["2", "3", "11"], "gold": 2}
    ex = ec.build_example(item, "multiple_choice", " ", TOK)
    (res,) = ec.score_examples(model, [ex], "multiple_choice", TOK.eot_token)

    def mean_loss(text, start):  # mean of -log p(tok_t | tok_{t-1}) over targets t >= start
        ids = bos(text)
        return sum(model.loss(ids[t - 1], ids[t]) for t in range(start, len(ids))) / (len(ids) - start)

    s = len(bos("Q: 1+1? "))
    expected = [mean_loss("Q: 1+1? " + c, s) for c in item["choices"]]
    assert res["mean_losses"] == pytest.approx(expected, rel=1e-5)
    assert res["pred"] == int(np.argmin(expected)) and res["correct"] == (res["pred"] == 2)
    assert res["answer_nll"] == pytest.approx(mean_loss("Q: 1+1? 11", s), rel=1e-5)

    # a full task: accuracy, centered accuracy [X17] and mean answer NLL [X18]
    items = [dict(item, gold=g) for g in range(3)] + [{"query": "Z?", "choices": ["a", "b"], "gold": 0}]
    task = {"label": "t", "icl_task_type": "multiple_choice", "num_fewshot": 0, "continuation_delimiter": " "}
    r = ec.evaluate_task(model, TOK, task, items)
    preds = [x["pred"] for x in r["items"]]
    golds = [it["gold"] for it in items]
    acc = sum(p == g for p, g in zip(preds, golds)) / 4
    assert r["accuracy"] == acc
    z = [mean_loss("Z? " + c, len(bos("Z? "))) for c in "ab"]
    assert preds == [int(np.argmin(expected))] * 3 + [int(np.argmin(z))]
    nll = (sum(mean_loss("Q: 1+1? " + c, s) for c in item["choices"]) + z[0]) / 4
    assert r["answer_nll"] == pytest.approx(nll, rel=1e-5)
    assert ec.centered_accuracy(acc, 25.0) == pytest.approx((acc - 0.25) / 0.75)


def test_lm_scoring_requires_every_greedy_token():
    model = BigramModel()
    item = {"context": "ab", "continuation": "cd"}
    ex = ec.build_example(item, "language_modeling", " ", TOK)
    (res,) = ec.score_examples(model, [ex], "language_modeling", TOK.eot_token)
    ids = bos("ab cd")
    greedy = model.table.argmax(-1)
    want = all(greedy[ids[t - 1]].item() == ids[t] for t in range(len(bos("ab")), len(ids)))
    assert res["correct"] == want
    assert res["answer_nll"] == pytest.approx(
        sum(model.loss(ids[t - 1], ids[t]) for t in range(3, 6)) / 3, rel=1e-5)


def assert_same_scores(a, b, task_type, rel, tie_margin):
    """Two runs of one task that differ only in batching: the guarantee is equal losses up to float
    rounding (rel), hence equal picks for every item whose best two options are more than tie_margin apart."""
    decided = 0
    for x, y in zip(a["items"], b["items"], strict=True):
        assert x["mean_losses"] == pytest.approx(y["mean_losses"], rel=rel, nan_ok=True)
        assert x["answer_nll"] == pytest.approx(y["answer_nll"], rel=rel)
        finite = sorted(loss for loss in x["mean_losses"] if not math.isnan(loss))
        if task_type != "language_modeling" and (len(finite) < 2 or finite[1] - finite[0] > tie_margin):
            assert x["pred"] == y["pred"]
            decided += 1
    return decided


def test_batching_does_not_change_results():
    model = BigramModel()
    bundle = core_bundle.load_bundle(BUNDLE)
    for task in bundle["tasks"]:
        data = ec.shuffle_and_cut(core_bundle.load_task_data(task))
        a = ec.evaluate_task(model, TOK, task, data, batch_tokens=256)
        b = ec.evaluate_task(model, TOK, task, data, batch_tokens=1 << 16)
        decided = assert_same_scores(a, b, task["icl_task_type"], rel=1e-6, tie_margin=1e-4)
        if task["icl_task_type"] != "language_modeling":
            assert decided == len(data)  # the bigram's options are never near a tie here
        else:  # LM: every greedy prediction is a table lookup, the same in any batch
            assert [x["correct"] for x in a["items"]] == [x["correct"] for x in b["items"]]


def test_oracle_solves_lm_items_and_first_choice_model_centres_to_zero():
    bundle = core_bundle.load_bundle(BUNDLE)
    oracle = ec.evaluate_core(OracleModel(), TOK, bundle, progress=False)
    for label in ("dyck_mini", "copy_mini"):
        r = oracle["tasks"][label]
        assert r["accuracy"] == 1.0 and r["centered"] == 1.0 and r["answer_nll"] < 1e-6
    assert oracle["tasks"]["dyck_mini"]["n"] == 16 and oracle["tasks"]["dyck_mini"]["num_fewshot"] == 3
    chance = ec.evaluate_core(FirstChoiceModel(), TOK, bundle, progress=False)
    assert chance["tasks"]["toy_arith_mc"]["accuracy"] == 0.25
    assert chance["tasks"]["toy_winograd"]["accuracy"] == 0.5
    for r in chance["tasks"].values():
        assert r["centered"] == 0.0
    assert chance["core"] == 0.0 and chance["core17"] is None


def test_random_baselines_centre_to_zero_and_versions():
    for rb in (0.0, 9.1, 20.0, 25.0, 40.3, 50.0, 62.0):
        assert ec.centered_accuracy(rb / 100, rb) == pytest.approx(0.0, abs=1e-12)
        assert ec.centered_accuracy(1.0, rb) == pytest.approx(1.0)
    v1 = {k: old for k, (old, new) in core_bundle.RANDOM_BASELINE_CHANGES.items()}
    v2 = {k: new for k, (old, new) in core_bundle.RANDOM_BASELINE_CHANGES.items()}
    assert core_bundle.random_baseline_version(v1) == "v1" and core_bundle.random_baseline_version(v2) == "2025-09-05"
    assert v2 == {"commonsense_qa": 40.3, "agi_eval_lsat_ar": 25.0, "bigbench_language_identification": 25.0}
    assert core_bundle.random_baseline_version(dict(v1, commonsense_qa=33.0)).startswith("custom")
    bundle = {"random_baselines": dict(v1, piqa=50.0), "baseline_version": "v1",
              "tasks": [{"label": k, "random_baseline": v} for k, v in dict(v1, piqa=50.0).items()]}
    new = core_bundle.with_baseline_version(bundle, "2025-09-05")
    assert {t["label"]: t["random_baseline"] for t in new["tasks"]} == dict(v2, piqa=50.0)
    assert new["baseline_version"].startswith("2025-09-05") and bundle["tasks"][0]["random_baseline"] == 20.0


def test_core17_subset_and_summary(tmp_path):
    assert len(ec.CORE22_LABELS) == 22 and len(ec.CORE17_LABELS) == 17
    assert not set(ec.CORE17_EXCLUDED) & set(ec.CORE17_LABELS)
    # a 22-task bundle in the public layout: LM tasks the oracle solves, MC tasks it ties on (first choice)
    (tmp_path / "eval_data" / "x").mkdir(parents=True)
    yaml_lines, csv_lines = ["icl_tasks:"], ["Eval Task,Random baseline"]
    for i, label in enumerate(ec.CORE22_LABELS):
        lm = i % 2 == 0
        rows = ([{"context": f"c{j}", "continuation": f"w{j}"} for j in range(3)] if lm else
                [{"query": f"q{j}", "choices": ["a", "b"], "gold": j % 2} for j in range(2)])
        (tmp_path / "eval_data" / "x" / f"{label}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        yaml_lines += [f"- label: {label}", f"  dataset_uri: x/{label}.jsonl", "  num_fewshot: [1]",
                       f"  icl_task_type: {'language_modeling' if lm else 'multiple_choice'}"]
        csv_lines.append(f"{label},{0 if lm else 50}")
    (tmp_path / "core.yaml").write_text("\n".join(yaml_lines) + "\n")
    (tmp_path / "eval_meta_data.csv").write_text("\n".join(csv_lines) + "\n")
    res = ec.evaluate_core(OracleModel(), TOK, str(tmp_path), progress=False)
    centered = {l: r["centered"] for l, r in res["tasks"].items()}
    assert res["core"] == pytest.approx(np.mean(list(centered.values())))
    assert res["core17"] == pytest.approx(np.mean([centered[l] for l in ec.CORE17_LABELS]))
    assert res["core17_nll"] == pytest.approx(np.mean([res["tasks"][l]["answer_nll"] for l in ec.CORE17_LABELS]))
    assert res["core17_missing"] == []


def test_fewshot_seeds_average():
    model = BigramModel()
    bundle = core_bundle.load_bundle(BUNDLE)
    res = ec.evaluate_core(model, TOK, bundle, fewshot_seeds=(0, 1, 2), labels=["toy_arith_mc", "toy_winograd"],
                           progress=False)
    per_seed = []
    task = next(t for t in bundle["tasks"] if t["label"] == "toy_arith_mc")
    data = ec.shuffle_and_cut(core_bundle.load_task_data(task))
    for s in (0, 1, 2):
        per_seed.append(ec.evaluate_task(model, TOK, task, data, fewshot_seed=s)["accuracy"])
    r = res["tasks"]["toy_arith_mc"]
    assert r["per_seed_accuracy"] == per_seed and r["accuracy"] == pytest.approx(np.mean(per_seed))
    assert res["tasks"]["toy_winograd"]["accuracy_std"] == 0.0  # zero-shot: seed-independent


def test_kshot_sweep_shapes_and_zero_shot_matches_core():
    model = BigramModel()
    sweep = ec.kshot_sweep(model, TOK, BUNDLE, ks=(0, 1, 32), progress=False)
    assert set(sweep["tasks"]) == {"toy_arith_mc", "dyck_mini", "copy_mini"}  # the few-shot tasks
    core0 = ec.evaluate_core(model, TOK, BUNDLE, num_fewshot=0, progress=False)
    for label, per_k in sweep["tasks"].items():
        assert per_k[0]["accuracy"] == core0["tasks"][label]["accuracy"]  # the same code path and inputs
        assert set(per_k) == {0, 1, 32}
        assert per_k[1]["fewshot_used"] == 1 and per_k[32]["fewshot_used"] == core0["tasks"][label]["n"] - 1


# ---------------------------------------------------------------- bundle files

def test_read_core_yaml_public_style(tmp_path):
    tasks = core_bundle.read_core_yaml(os.path.join(BUNDLE, "core.yaml"))
    assert [t["label"] for t in tasks] == ["toy_arith_mc", "toy_winograd", "dyck_mini", "copy_mini"]
    assert [t["num_fewshot"] for t in tasks] == [3, 0, 3, 2] and [t["line"] for t in tasks] == [5, 11, 17, 23]
    assert tasks[3]["continuation_delimiter"] == "\nOutput: "
    public_style = (  # the shapes the public core.yaml uses: '-' alone, comments, block and flow lists
        "# comment\nicl_tasks:\n"
        "-\n  label: jeopardy\n  dataset_uri: world_knowledge/jeopardy_all.jsonl # a comment\n"
        "  num_fewshot: [10]\n  icl_task_type: language_modeling\n"
        "  continuation_delimiter: \"\\nAnswer: \" # this separates questions from answers\n"
        "  has_categories: true\n"
        "- label: 'it''s #1'\n  dataset_uri: a/b.jsonl\n  num_fewshot:\n  - 0\n"
        "  icl_task_type: multiple_choice\n")
    p = tmp_path / "core.yaml"
    p.write_text(public_style)
    first, second = core_bundle.read_core_yaml(str(p))
    assert first == {"label": "jeopardy", "dataset_uri": "world_knowledge/jeopardy_all.jsonl", "num_fewshot": 10,
                     "icl_task_type": "language_modeling", "continuation_delimiter": "\nAnswer: ", "line": 4}
    assert second["label"] == "it's #1" and second["num_fewshot"] == 0 and second["line"] == 10
    assert second["continuation_delimiter"] == " "  # nanochat's default when the key is absent


def _copy_bundle(tmp_path):
    dst = tmp_path / "bundle"
    shutil.copytree(BUNDLE, dst)
    return dst


def test_core_yaml_errors_name_file_line_and_task(tmp_path):
    y = _copy_bundle(tmp_path) / "core.yaml"
    text = y.read_text()
    entry2 = r"core\.yaml:11: icl_tasks entry 2 \('toy_winograd'\)"
    cases = [
        (text.replace("  dataset_uri: language_understanding/toy_winograd.jsonl\n", ""),
         entry2 + " is missing required key 'dataset_uri'"),
        (text.replace("icl_task_type: schema", "icl_task_type: generation_task_with_answers"),
         entry2 + ": unknown icl_task_type 'generation_task_with_answers'"),
        (text.replace("num_fewshot: [0]", "num_fewshot: 0"), entry2 + ": num_fewshot must be a list"),
        (text.replace("num_fewshot: [0]", "num_fewshot: [-1]"), entry2 + ": num_fewshot must be a list"),
        (text.replace("label: toy_winograd", "label: 7"), r"core\.yaml:11: icl_tasks entry 2: label must be a"),
        (text.replace('continuation_delimiter: "\\nOutput: "', "continuation_delimiter: null"),
         r"core\.yaml:23: icl_tasks entry 4 \('copy_mini'\): continuation_delimiter must be a string"),
        (text.replace("label: copy_mini", "label: dyck_mini"),
         r"core\.yaml:23: icl_tasks entry 4 \('dyck_mini'\): duplicate task label \(first at line 17\)"),
        (text.replace("icl_tasks:", "tasks:"), r"core\.yaml: missing top-level key 'icl_tasks'"),
        ("", r"core\.yaml: missing top-level key 'icl_tasks'"),
        ("icl_tasks: []\n", r"core\.yaml: 'icl_tasks' must be a non-empty list"),
        ("icl_tasks:\n- just a string\n", r"core\.yaml:2: icl_tasks entry 1 is not a mapping"),
        # malformed YAML: the line comes from PyYAML's problem_mark
        ("icl_tasks:\n- label: a\n\tdataset_uri: b\n", r"core\.yaml:3: malformed YAML: .*'\\t'"),
        ("icl_tasks:\n- label: a\n  x: [1, 2\n", r"core\.yaml:4: malformed YAML: .*flow sequence"),
        ("icl_tasks:\n- label: a\n dataset_uri: b\n", r"core\.yaml:3: malformed YAML"),
    ]
    for bad_text, message in cases:
        y.write_text(bad_text)
        with pytest.raises(ValueError, match=message):
            core_bundle.read_core_yaml(str(y))


def test_bad_jsonl_and_items_name_file_and_line(tmp_path):
    b = _copy_bundle(tmp_path)
    f = b / "eval_data" / "symbolic_problem_solving" / "copy_mini.jsonl"
    lines = f.read_text().splitlines()
    task = next(t for t in core_bundle.load_bundle(str(b))["tasks"] if t["label"] == "copy_mini")
    f.write_text("\n".join(lines[:2] + [""] + lines[2:]) + "\n\n")  # blank lines are skipped (nanochat fails)
    assert core_bundle.load_task_data(task) == [json.loads(line) for line in lines]
    f.write_text("\n".join(lines[:2] + ['{"context": "x", "continuation": '] + lines[3:]) + "\n")
    with pytest.raises(ValueError, match=r"copy_mini\.jsonl:3: malformed JSON"):
        core_bundle.load_task_data(task)
    f.write_text("\n".join(lines[:4] + ['{"context": "x"}'] + lines[5:]) + "\n")
    with pytest.raises(ValueError, match=r"copy_mini\.jsonl:5: language_modeling item is missing key 'continuation'"):
        core_bundle.load_task_data(task)
    g = b / "eval_data" / "symbolic_problem_solving" / "toy_arith_mc.jsonl"
    g.write_text('{"query": "q", "choices": ["a", "b"], "gold": 2}\n')
    task = next(t for t in core_bundle.load_bundle(str(b))["tasks"] if t["label"] == "toy_arith_mc")
    with pytest.raises(ValueError, match=r"toy_arith_mc\.jsonl:1: gold must be an int index"):
        core_bundle.load_task_data(task)


def test_bundle_errors_and_fingerprint(tmp_path):
    b = _copy_bundle(tmp_path)
    fp = core_bundle.bundle_fingerprint(str(b))
    assert fp == core_bundle.bundle_fingerprint(BUNDLE) and len(fp) == 64
    assert core_bundle.load_bundle(str(b))["fingerprint"] == fp
    c = b / "eval_meta_data.csv"
    c.write_text(c.read_text().replace("copy_mini,symbolic_problem_solving", "other,symbolic_problem_solving"))
    with pytest.raises(ValueError, match=r"core\.yaml:23: task 'copy_mini' has no row in .*eval_meta_data\.csv"):
        core_bundle.load_bundle(str(b))
    assert core_bundle.bundle_fingerprint(str(b)) != fp
    c.write_text("Eval Task,Random baseline\ncopy_mini,abc\n")
    with pytest.raises(ValueError, match=r"eval_meta_data\.csv:2: random baseline for 'copy_mini' is not a number"):
        core_bundle.load_bundle(str(b))
    with pytest.raises(FileNotFoundError, match="never downloads"):
        core_bundle.load_bundle(str(tmp_path / "nope"))
    shutil.rmtree(b / "eval_data" / "language_understanding")
    shutil.copy(os.path.join(BUNDLE, "eval_meta_data.csv"), c)
    with pytest.raises(FileNotFoundError, match=r"core\.yaml:11: dataset_uri of 'toy_winograd' points to a missing"):
        core_bundle.load_bundle(str(b))


# ---------------------------------------------------------------- length buckets

def write_prepared(folder, tokens, eot, n_vocab, shard_tokens):
    """A data/prepare.py folder whose train and val splits are both `tokens` (documents start at eot),
    written by its ShardWriter."""
    from data import prepare as prep
    starts = np.flatnonzero(tokens == eot)
    shards = {}
    for split in prep.SPLITS:
        writer = prep.ShardWriter(str(folder), split, shard_tokens, tokens.dtype)
        for i, (a, b) in enumerate(zip(starts, np.append(starts[1:], len(tokens)))):
            writer.add(tokens[a:b], 0, i)
        shards[split] = writer.seal()
    (folder / "meta.json").write_text(json.dumps({
        "version": prep.PREPARE_VERSION, "dtype": tokens.dtype.name, "eot_token": eot, "tokenizer": "char",
        "n_vocab": n_vocab, "sources": ["random"], "splits": {s: {"tokens": len(tokens)} for s in prep.SPLITS},
        "unigram_entropy_train_nats": 1.0,
        "shards": shards}))


def test_length_bucket_loss_matches_manual_and_packing(tmp_path):
    rng = np.random.default_rng(0)
    eot = 0
    lengths = [3, 30, 33, 64, 70, 5, 200]
    stream = []
    for n in lengths:
        stream += [eot] + rng.integers(1, 128, size=n).tolist()
    arr = np.array(stream, dtype=np.uint16)
    write_prepared(tmp_path, arr, eot, n_vocab=128, shard_tokens=100)  # the data/prepare.py layout, 4 shards
    tokens, meta, doc_spans = ec.load_token_split(str(tmp_path), "val")
    assert doc_spans == ec.split_documents(tokens, eot) and doc_spans[:2] == [(1, 4), (5, 35)]
    assert np.array_equal(np.asarray(tokens), arr)  # read across the shard boundaries
    with pytest.MonkeyPatch.context() as mp:  # eval_core copied alone, without data.shards: the same split
        mp.setitem(sys.modules, "data.shards", None)
        alone_tokens, _, alone_spans = ec.load_token_split(str(tmp_path), "val")
    assert np.array_equal(alone_tokens, arr) and alone_spans == doc_spans
    model = BigramModel(block_size=64)
    packed = ec.length_bucket_loss(model, tokens, eot, progress=False)
    alone = ec.length_bucket_loss(model, tokens, eot, pack=False, progress=False)
    # manual: each doc = [eot] + doc, windows of 64 targets; a bigram only looks at the previous token,
    # and a continuation window starts from the previous window's last token
    sums = {}
    for a, b in ec.split_documents(tokens, eot):
        ids = [eot] + [int(x) for x in tokens[a:b]]
        total = sum(model.loss(ids[t - 1], ids[t]) for t in range(1, len(ids)))
        lab = ec.bucket_of(b - a)
        s = sums.setdefault(lab, [0.0, 0])
        s[0] += total
        s[1] += b - a
    for lab, (total, n) in sums.items():
        assert packed[lab]["loss"] == pytest.approx(total / n, rel=1e-5)
        assert alone[lab]["loss"] == pytest.approx(total / n, rel=1e-5)
    assert packed["32"]["n_docs"] == 3 and packed["64"]["n_docs"] == 2 and packed["256"]["n_tokens"] == 200
    assert packed["4096"]["loss"] is None and list(packed)[-1] == ">4096"
    assert ec.bucket_of(4097) == ">4096" and ec.bucket_of(32) == "32" and ec.bucket_of(33) == "64"


# ---------------------------------------------------------------- CLI

def test_cli_json_and_table(monkeypatch, capsys):
    monkeypatch.setattr(ec, "load_model_and_tokenizer", lambda path, device="cpu": (BigramModel(), TOK))
    assert ec.main(["--ckpt", "x.pt", "--bundle", BUNDLE, "--max_per_task", "4", "--json", "--no_progress"]) == 0
    out = json.loads(capsys.readouterr().out)
    direct = ec.evaluate_core(BigramModel(), TOK, BUNDLE, max_per_task=4, progress=False)
    assert out["core"]["core"] == pytest.approx(direct["core"], rel=1e-9)  # the same computation, via JSON
    assert all(r["n"] == 4 for r in out["core"]["tasks"].values())
    assert ec.main(["--ckpt", "x.pt", "--bundle", BUNDLE, "--no_progress"]) == 0
    text = capsys.readouterr().out
    for needle in ("toy_arith_mc", "dyck_mini", "CORE (4 tasks)", "answer_nll", "fingerprint sha256"):
        assert needle in text


# ---------------------------------------------------------------- with the real model.py

def _tiny_gpt(vocab=128, eot=0, block_size=256):
    model_mod = pytest.importorskip("model")
    cfg = model_mod.ModelConfig(vocab_size=vocab, eot_token=eot, block_size=block_size, n_layer=2, n_embd=32,
                                n_head=2, init="nanogpt")
    torch.manual_seed(0)
    return model_mod.GPT(cfg).eval(), cfg


def test_real_model_padding_and_packing_invariance(tmp_path):
    model, _ = _tiny_gpt()
    bundle = core_bundle.load_bundle(BUNDLE)
    decided = 0
    for task in bundle["tasks"]:  # right-padding with eot changes a causal model's scores by rounding only
        data = ec.shuffle_and_cut(core_bundle.load_task_data(task), 3)
        a = ec.evaluate_task(model, TOK, task, data, batch_tokens=600)
        b = ec.evaluate_task(model, TOK, task, data, batch_tokens=1 << 15)
        decided += assert_same_scores(a, b, task["icl_task_type"], rel=1e-4, tie_margin=1e-3)
    assert decided > 0
    rng = np.random.default_rng(1)
    stream = []
    for n in (5, 40, 150, 17):
        stream += [0] + rng.integers(1, 128, size=n).tolist()
    tokens = np.array(stream)
    packed = ec.length_bucket_loss(model, tokens, 0, block_size=64, progress=False)
    alone = ec.length_bucket_loss(model, tokens, 0, block_size=64, pack=False, progress=False)
    for lab in packed:  # the eot document mask keeps packed documents apart
        if packed[lab]["n_docs"]:
            assert packed[lab]["loss"] == pytest.approx(alone[lab]["loss"], rel=1e-4)


def test_cli_end_to_end_with_checkpoint(tmp_path, capsys):
    pytest.importorskip("model")
    prepare = pytest.importorskip("data.prepare")
    model, cfg = _tiny_gpt(vocab=4096, eot=4095, block_size=128)
    ckpt = tmp_path / "ckpt.pt"
    from tooling.checkpoint import plain_config, save_file
    save_file(str(ckpt), {"model_config": plain_config(cfg), "model": model.state_dict(), "tokenizer": "gpt2-4096"})
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": ("word " * n).strip()}) + "\n" for n in (3, 20, 50, 90, 7, 30)))
    prepare.prepare([str(corpus)], str(tmp_path / "prep"), val_fraction=0.5, verbose=False)
    assert ec.main(["--ckpt", str(ckpt), "--bundle", BUNDLE, "--max_per_task", "2", "--no_progress", "--json",
                    "--length_buckets", str(tmp_path / "prep"), "--kshot_sweep", "--kshot_tasks", "dyck_mini"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["core"]["tasks"]) == {"toy_arith_mc", "toy_winograd", "dyck_mini", "copy_mini"}
    assert math.isfinite(out["core"]["core"]) and math.isfinite(out["core"]["core_nll"])
    assert sum(b["n_docs"] for b in out["length_buckets"].values()) == 3
    assert list(out["kshot"]["tasks"]["dyck_mini"]) == [str(k) for k in ec.KSHOT_SWEEP]


def _cli_cases(tmp_path):
    """(name, argv, text the one error line must contain) for user mistakes the CLI must report in one line."""
    ok = ["--bundle", BUNDLE]
    (tmp_path / "corrupt.pt").write_bytes(b"not a torch file")
    torch.save({"weights": [1, 2]}, tmp_path / "foreign.pt")
    model, cfg = _tiny_gpt()
    state = model.state_dict()
    state.pop(next(iter(state)))
    from tooling.checkpoint import plain_config, save_file
    save_file(str(tmp_path / "mismatch.pt"), {"model_config": plain_config(cfg), "model": state})
    bundles = {}
    for missing in ("core.yaml", "eval_meta_data.csv", "eval_data"):
        b = tmp_path / f"no_{missing}"
        shutil.copytree(BUNDLE, b)
        (shutil.rmtree if missing == "eval_data" else os.remove)(b / missing)
        bundles[missing] = str(b)
    bad_yaml = tmp_path / "bad_yaml"
    shutil.copytree(BUNDLE, bad_yaml)
    (bad_yaml / "core.yaml").write_text("icl_tasks:\n- label: a\n\tdataset_uri: b\n")
    ckpt = ["--ckpt", str(tmp_path / "missing.pt")]
    return [
        ("missing ckpt", ckpt + ok, "checkpoint not found"),
        ("corrupt ckpt", ["--ckpt", str(tmp_path / "corrupt.pt")] + ok, "cannot read checkpoint"),
        ("foreign ckpt", ["--ckpt", str(tmp_path / "foreign.pt")] + ok, "is not a loopstudy checkpoint"),
        ("weights mismatch", ["--ckpt", str(tmp_path / "mismatch.pt")] + ok, "weights do not match the model config"),
        ("missing bundle", ckpt + ["--bundle", str(tmp_path / "nope")], "eval bundle directory not found"),
        ("no core.yaml", ckpt + ["--bundle", bundles["core.yaml"]], "missing " + bundles["core.yaml"]),
        ("no meta csv", ckpt + ["--bundle", bundles["eval_meta_data.csv"]], "eval_meta_data.csv"),
        ("no eval_data", ckpt + ["--bundle", bundles["eval_data"]], "missing the folder"),
        ("malformed yaml", ckpt + ["--bundle", str(bad_yaml)], "core.yaml:3: malformed YAML"),
        ("bad seeds", ckpt + ok + ["--fewshot_seeds", "0,x"], "--fewshot_seeds must be distinct integers"),
        ("repeated seeds", ckpt + ok + ["--fewshot_seeds", "1,1"], "--fewshot_seeds must be distinct"),
        ("unknown task", ckpt + ok + ["--tasks", "toy_arith_mc,nope"], "--tasks: labels not in"),
        ("unknown kshot task", ckpt + ok + ["--kshot_sweep", "--kshot_tasks", "nope"], "--kshot_tasks: labels"),
        ("bad device", ckpt + ok + ["--device", "gpu7"], "unknown device 'gpu7'"),
        ("missing length dir", ckpt + ["--length_buckets", str(tmp_path / "nodata")], "meta.json not found"),
        ("nothing to do", ckpt, "give --bundle (CORE) and/or --length_buckets"),
        ("sweep without bundle", ckpt + ["--kshot_sweep", "--length_buckets", str(tmp_path)], "needs --bundle"),
    ]


def test_cli_user_mistakes_are_one_line_errors_with_status_2(tmp_path, capsys):
    for name, argv, needle in _cli_cases(tmp_path):
        assert ec.main(argv + ["--no_progress"]) == 2, name
        captured = capsys.readouterr()
        lines = captured.err.splitlines()
        assert len(lines) == 1 and lines[0].startswith("eval_core.py: error: "), (name, captured.err)
        assert needle in lines[0], (name, lines[0])
        assert captured.out == "", name


# ---------------------------------------------------------------- edges, against nanochat's own code

def test_empty_span_choice_follows_nanochat_nan_argmin():
    """An option whose tokens are a prefix of another option's has an empty span; nanochat's mean is nan and
    mean_losses.index(min(mean_losses)) then picks it when it is the first option and never otherwise."""
    model = BigramModel()
    for choices, gold, want_pred in ((["a", "ab"], 1, 0),    # empty span first: it wins, gold loses
                                     (["ab", "a"], 1, 0),    # empty span later: never wins
                                     (["", "yes"], 1, 0),    # an empty string choice is the same case
                                     (["ab", "a", "ac"], 0, None)):  # nan in the middle is skipped
        item = {"query": "Q:", "choices": choices, "gold": gold}
        res, _ = score_one(model, item, "multiple_choice")
        ref_correct, ref_pred, ref_losses = nanochat_evaluate_example(model, TOK, item, "multiple_choice", " ")
        assert res["pred"] == ref_pred and res["correct"] == ref_correct, choices
        assert [math.isnan(x) for x in res["mean_losses"]] == [math.isnan(x) for x in ref_losses]
        if want_pred is not None:
            assert res["pred"] == want_pred
        else:
            assert res["pred"] == (0 if res["mean_losses"][0] < res["mean_losses"][2] else 2)
    assert ec.nanochat_choice([float("nan"), 1.0, 0.5]) == 0 and ec.nanochat_choice([2.0, float("nan"), 1.0]) == 2
    assert ec.nanochat_choice([1.0, 0.5, 0.5]) == 1
    with pytest.raises(ValueError, match=r"x\.jsonl:4: .*gold choice a non-empty string"):
        core_bundle._check_item({"query": "Q:", "choices": ["", "yes"], "gold": 0}, "multiple_choice", "x.jsonl", 4)


def test_crop_inside_shared_prefix_scores_like_nanochat():
    model = BigramModel()
    item = {"query": "Pick:", "choices": ["a cat", "a horse"], "gold": 1}
    s = len(bos("Pick: a "))  # common prefix: the shared "a " belongs to it; the answer NLL starts before it
    assert [len(bos("Pick: " + c)) for c in item["choices"]] == [12, 14] and s == 9
    # max_len 6: crops of 6 and 8 leave spans at 3 and 1; the gold answer ("a horse") loses "a " to the crop
    res, ex = score_one(model, item, "multiple_choice", max_len=6)
    assert ex["starts"] == [3, 1] and ex["tokens"][1] == bos("Pick: a horse")[8:]
    assert ex["answer_start"] == 1 and ex["answer_cropped"]
    ids = ex["tokens"][1]
    assert res["answer_nll"] == pytest.approx(
        sum(model.loss(ids[t - 1], ids[t]) for t in range(1, len(ids))) / (len(ids) - 1), rel=1e-5)
    assert (res["correct"], res["pred"]) == nanochat_evaluate_example(model, TOK, item, "multiple_choice", " ",
                                                                      max_len=6)[:2]
    # max_len 5: the longer choice's span now starts at 0 -> nan; it is not first, so the other choice wins
    res, ex = score_one(model, item, "multiple_choice", max_len=5)
    assert ex["starts"] == [2, 0] and math.isnan(res["mean_losses"][1]) and res["pred"] == 0
    assert (res["correct"], res["pred"]) == nanochat_evaluate_example(model, TOK, item, "multiple_choice", " ",
                                                                      max_len=5)[:2]
    swapped = {"query": "Pick:", "choices": ["a horse", "a cat"], "gold": 0}  # ... and first, so it wins
    res, _ = score_one(model, swapped, "multiple_choice", max_len=5)
    assert res["pred"] == 0 and res["correct"]
    assert nanochat_evaluate_example(model, TOK, swapped, "multiple_choice", " ", max_len=5)[:2] == (True, 0)
    # max_len 4: a span shifted below 0; nanochat asserts, we stop with an error naming the task and item
    with pytest.raises(AssertionError):
        nanochat_evaluate_example(model, TOK, item, "multiple_choice", " ", max_len=4)
    task = {"label": "t", "icl_task_type": "multiple_choice", "num_fewshot": 0, "continuation_delimiter": " "}
    with pytest.raises(ValueError, match=r"task 't' item 0 .*does not fit in the model context of 4 tokens"):
        ec.evaluate_task(model, TOK, task, [item], max_len=4)
    # a task run counts the items whose answer NLL lost tokens to the crop
    r = ec.evaluate_task(model, TOK, task, [item, swapped], max_len=6)
    assert r["answer_cropped"] == 2


def test_random_edge_items_score_like_nanochat():
    """Random tiny items aimed at the edges (options that are prefixes of each other, empty and repeated wrong
    options, crops at every length) scored by eval_core and by the transcribed nanochat code: the same pick,
    the same correctness, and an error exactly where nanochat raises."""
    rng = random.Random(0)
    model = BigramModel()
    seen = collections.Counter()
    for _ in range(400):
        task_type = rng.choice(ec.TASK_TYPES)
        delim = rng.choice([" ", "", "\n"])
        if task_type == "multiple_choice":
            choices = [rng.choice(["", "a", "ab", "abc", "b", "ba", "a b"]) for _ in range(rng.randint(2, 4))]
            gold = rng.choice([i for i, c in enumerate(choices) if c] or [None])
            if gold is None:
                continue
            item = {"query": rng.choice(["Q:", "x", "Pick one:"]), "choices": choices, "gold": gold}
            shots = [{"query": "S:", "choices": ["ab", "b"], "gold": 0}] * rng.randint(0, 1)
        elif task_type == "schema":
            options = [rng.choice(["a", "ba", "cba", "the a", "xyz"]) for _ in range(rng.randint(2, 3))]
            item = {"context_options": options, "continuation": rng.choice(["a", "is a", "z."]),
                    "gold": rng.randrange(len(options))}
            shots = [{"context_options": ["q", "r"], "continuation": "s", "gold": 1}] * rng.randint(0, 1)
        else:
            item = {"context": rng.choice(["ab", "x y", " c "]), "continuation": rng.choice(["a", "bc", "a b"])}
            shots = [{"context": "u", "continuation": "v"}] * rng.randint(0, 1)
        full = max(len(t) for t in ec.build_example(item, task_type, delim, TOK, shots)["tokens"])
        max_len = rng.randint(2, full + 1)
        try:
            ref = nanochat_evaluate_example(model, TOK, item, task_type, delim, shots, max_len)
        except (AssertionError, RuntimeError):  # nanochat's crop asserts, or its LM comparison fails
            with pytest.raises(ValueError, match="does not fit"):
                ec.build_example(item, task_type, delim, TOK, shots, max_len)
            seen["nanochat raises"] += 1
            continue
        res, ex = score_one(model, item, task_type, delim, shots, max_len)
        assert res["correct"] == ref[0], item
        if task_type != "language_modeling":
            assert res["pred"] == ref[1], item
            assert res["mean_losses"] == pytest.approx(ref[2], rel=1e-5, nan_ok=True)
            seen["nan first"] += math.isnan(ref[2][0])
            seen["nan later"] += any(math.isnan(x) for x in ref[2][1:])
            seen["span at 0"] += 0 in ex["starts"]
        seen["cropped"] += full > max_len
        seen["scored"] += 1
    for case in ("nanochat raises", "nan first", "nan later", "span at 0", "cropped"):
        assert seen[case] >= 3, seen  # every edge was actually exercised
