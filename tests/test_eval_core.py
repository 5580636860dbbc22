"""eval_core.py: prompts, spans and choices item by item against a transcription of nanochat's scorer, CORE and
its parts [X17] [X18] on stub models with known losses, k-shot sweeps, the length-bucket loss, the CLI."""
import collections
import json
import math
import os
import random
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import eval_core as ec
from test_sample import error_line, save_checkpoint

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
    res = ec.evaluate_core(BigramModel(), TOK, BUNDLE, num_fewshot=32, labels=["toy_arith_mc"])
    assert res["tasks"]["toy_arith_mc"]["fewshot_used"] == 7  # 8 items


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
    bundle = ec.load_bundle(BUNDLE)
    for task in bundle["tasks"]:
        data = ec.shuffle_and_cut(ec.load_task_data(task))
        a = ec.evaluate_task(model, TOK, task, data, batch_tokens=256)
        b = ec.evaluate_task(model, TOK, task, data, batch_tokens=1 << 16)
        decided = assert_same_scores(a, b, task["icl_task_type"], rel=1e-6, tie_margin=1e-4)
        if task["icl_task_type"] != "language_modeling":
            assert decided == len(data)  # the bigram's options are never near a tie here
        else:  # LM: every greedy prediction is a table lookup, the same in any batch
            assert [x["correct"] for x in a["items"]] == [x["correct"] for x in b["items"]]


def test_oracle_solves_lm_items_and_first_choice_model_centres_to_zero():
    bundle = ec.load_bundle(BUNDLE)
    oracle = ec.evaluate_core(OracleModel(), TOK, bundle)
    for label in ("dyck_mini", "copy_mini"):
        r = oracle["tasks"][label]
        assert r["accuracy"] == 1.0 and r["centered"] == 1.0 and r["answer_nll"] < 1e-6
    assert oracle["tasks"]["dyck_mini"]["n"] == 16 and oracle["tasks"]["dyck_mini"]["num_fewshot"] == 3
    chance = ec.evaluate_core(FirstChoiceModel(), TOK, bundle)
    assert chance["tasks"]["toy_arith_mc"]["accuracy"] == 0.25
    assert chance["tasks"]["toy_winograd"]["accuracy"] == 0.5
    for r in chance["tasks"].values():
        assert r["centered"] == 0.0
    assert chance["core"] == 0.0 and chance["core17"] is None


def test_random_baselines_centre_to_zero_and_published_tables(tmp_path):
    for rb in (0.0, 9.1, 20.0, 25.0, 40.3, 50.0, 62.0):
        assert ec.centered_accuracy(rb / 100, rb) == pytest.approx(0.0, abs=1e-12)
        assert ec.centered_accuracy(1.0, rb) == pytest.approx(1.0)
    b = _copy_bundle(tmp_path)
    (b / "eval_meta_data.csv").write_text("Eval Task,Random baseline\ntoy_arith_mc,25\ntoy_winograd,50\n"
                                         "dyck_mini,20\ncopy_mini,0\n")
    (b / "core.yaml").write_text((b / "core.yaml").read_text().replace("dyck_mini", "commonsense_qa"))
    (b / "eval_meta_data.csv").write_text((b / "eval_meta_data.csv").read_text().replace("dyck_mini", "commonsense_qa"))
    baseline = {v: {t["label"]: t["random_baseline"] for t in ec.load_bundle(str(b), v)["tasks"]}
                for v in ("bundle", "v1", "2025-09-05")}
    assert baseline["bundle"]["commonsense_qa"] == 20.0 == baseline["v1"]["commonsense_qa"]
    assert baseline["2025-09-05"] == dict(baseline["bundle"], commonsense_qa=40.3)  # only the changed row


def test_core17_subset_and_summary(tmp_path):
    excluded = ("commonsense_qa", "boolq", "bigbench_cs_algorithms", "bigbench_language_identification",
                "bigbench_repeat_copy_logic")  # [X Table 10]'s filter of nanochat's 22 tasks
    core22 = ec.CORE17_LABELS + excluded
    assert len(set(core22)) == 22 and len(ec.CORE17_LABELS) == 17
    # a 22-task bundle in the public layout: LM tasks the oracle solves, MC tasks it ties on (first choice)
    (tmp_path / "eval_data" / "x").mkdir(parents=True)
    yaml_lines, csv_lines = ["icl_tasks:"], ["Eval Task,Random baseline"]
    for i, label in enumerate(core22):
        lm = i % 2 == 0
        rows = ([{"context": f"c{j}", "continuation": f"w{j}"} for j in range(3)] if lm else
                [{"query": f"q{j}", "choices": ["a", "b"], "gold": j % 2} for j in range(2)])
        (tmp_path / "eval_data" / "x" / f"{label}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        yaml_lines += [f"- label: {label}", f"  dataset_uri: x/{label}.jsonl", "  num_fewshot: [1]",
                       f"  icl_task_type: {'language_modeling' if lm else 'multiple_choice'}"]
        csv_lines.append(f"{label},{0 if lm else 50}")
    (tmp_path / "core.yaml").write_text("\n".join(yaml_lines) + "\n")
    (tmp_path / "eval_meta_data.csv").write_text("\n".join(csv_lines) + "\n")
    res = ec.evaluate_core(OracleModel(), TOK, str(tmp_path))
    centered = {l: r["centered"] for l, r in res["tasks"].items()}
    assert res["core"] == pytest.approx(np.mean(list(centered.values())))
    assert res["core17"] == pytest.approx(np.mean([centered[l] for l in ec.CORE17_LABELS]))
    assert res["core17_nll"] == pytest.approx(np.mean([res["tasks"][l]["answer_nll"] for l in ec.CORE17_LABELS]))
    assert ec.evaluate_core(OracleModel(), TOK, str(tmp_path), labels=core22[1:])["core17"] is None


def test_fewshot_seeds_average():
    model = BigramModel()
    bundle = ec.load_bundle(BUNDLE)
    res = ec.evaluate_core(model, TOK, bundle, fewshot_seeds=(0, 1, 2), labels=["toy_arith_mc", "toy_winograd"])
    per_seed = []
    task = next(t for t in bundle["tasks"] if t["label"] == "toy_arith_mc")
    data = ec.shuffle_and_cut(ec.load_task_data(task))
    for s in (0, 1, 2):
        per_seed.append(ec.evaluate_task(model, TOK, task, data, fewshot_seed=s)["accuracy"])
    r = res["tasks"]["toy_arith_mc"]
    assert r["per_seed_accuracy"] == per_seed and r["accuracy"] == pytest.approx(np.mean(per_seed))
    assert res["tasks"]["toy_winograd"]["per_seed_accuracy"] == [res["tasks"]["toy_winograd"]["accuracy"]]  # 0-shot: once


def test_kshot_sweep_shapes_and_zero_shot_matches_core():
    model = BigramModel()
    sweep = ec.kshot_sweep(model, TOK, BUNDLE, ks=(0, 1, 32))
    assert set(sweep["tasks"]) == {"toy_arith_mc", "dyck_mini", "copy_mini"}  # the few-shot tasks
    core0 = ec.evaluate_core(model, TOK, BUNDLE, num_fewshot=0)
    for label, per_k in sweep["tasks"].items():
        assert per_k[0]["accuracy"] == core0["tasks"][label]["accuracy"]  # the same code path and inputs
        assert set(per_k) == {0, 1, 32}
        assert per_k[1]["fewshot_used"] == 1 and per_k[32]["fewshot_used"] == core0["tasks"][label]["n"] - 1


# ---------------------------------------------------------------- bundle files

def _copy_bundle(tmp_path):
    dst = tmp_path / "bundle"
    shutil.copytree(BUNDLE, dst)
    return dst


def test_bundle_reading_and_fingerprint(tmp_path):
    bundle = ec.load_bundle(BUNDLE)
    tasks = bundle["tasks"]
    assert [t["label"] for t in tasks] == ["toy_arith_mc", "toy_winograd", "dyck_mini", "copy_mini"]
    assert [t["num_fewshot"] for t in tasks] == [3, 0, 3, 2] and tasks[3]["continuation_delimiter"] == "\nOutput: "
    assert [t["random_baseline"] for t in tasks] == [25.0, 50.0, 0.0, 0.0]
    assert len(ec.load_task_data(tasks[2])) == 16
    b = _copy_bundle(tmp_path)
    assert ec.fingerprint(str(b)) == bundle["fingerprint"] and len(bundle["fingerprint"]) == 64
    f = b / "eval_data" / "symbolic_problem_solving" / "copy_mini.jsonl"
    f.write_text(f.read_text() + "\n\n")  # blank lines are skipped
    assert ec.load_task_data(ec.load_bundle(str(b))["tasks"][3]) == ec.load_task_data(tasks[3])
    assert ec.fingerprint(str(b)) != bundle["fingerprint"]  # every byte of every file counts


# ---------------------------------------------------------------- length buckets

def test_length_bucket_loss_matches_manual():
    rng = np.random.default_rng(0)
    eot, stream = 0, []
    for n in [3, 30, 33, 64, 70, 5, 200]:
        stream += [eot] + rng.integers(1, 128, size=n).tolist()
    tokens = np.array(stream, dtype=np.uint16)
    assert ec.split_documents(tokens, eot)[:2] == [(1, 4), (5, 35)]
    model = BigramModel(block_size=64)
    buckets = ec.length_bucket_loss(model, tokens, eot)
    # manual: each doc read as [eot] + doc; a bigram only looks at the previous token, and a window after the
    # first starts at the previous window's last target
    sums = {}
    for a, b in ec.split_documents(tokens, eot):
        ids = [eot] + [int(x) for x in tokens[a:b]]
        s = sums.setdefault(ec.bucket_of(b - a), [0.0, 0])
        s[0] += sum(model.loss(ids[t - 1], ids[t]) for t in range(1, len(ids)))
        s[1] += b - a
    for lab, (total, n) in sums.items():
        assert buckets[lab]["loss"] == pytest.approx(total / n, rel=1e-5) and buckets[lab]["n_tokens"] == n
    assert buckets["32"]["n_docs"] == 3 and buckets["64"]["n_docs"] == 2 and buckets["256"]["n_tokens"] == 200
    assert buckets["4096"]["loss"] is None and list(buckets)[-1] == ">4096"
    assert ec.bucket_of(4097) == ">4096" and ec.bucket_of(32) == "32" and ec.bucket_of(33) == "64"
    first = ec.length_bucket_loss(model, tokens, eot, max_tokens=33)  # whole documents until 33 are read
    assert sum(b["n_docs"] for b in first.values()) == 2


# ---------------------------------------------------------------- CLI and the real model.py

def test_cli_json_and_table(monkeypatch, capsys):
    monkeypatch.setattr(ec, "load_model_and_tokenizer", lambda path, device: (BigramModel(), TOK, {}))
    assert ec.main(["--ckpt", "x.pt", "--bundle", BUNDLE, "--max_per_task", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    direct = ec.evaluate_core(BigramModel(), TOK, BUNDLE, max_per_task=4)
    assert out["core"]["core"] == pytest.approx(direct["core"], rel=1e-9)  # the same computation, via JSON
    assert all(r["n"] == 4 for r in out["core"]["tasks"].values())
    assert ec.main(["--ckpt", "x.pt", "--bundle", BUNDLE]) == 0
    text = capsys.readouterr().out
    for needle in ("toy_arith_mc", "dyck_mini", "CORE (4 tasks)", "answer_nll", f"sha256 {direct['fingerprint']}"):
        assert needle in text


def _tiny_gpt(vocab=128, eot=0, block_size=256):
    from model import GPT, ModelConfig
    torch.manual_seed(0)
    return GPT(ModelConfig(vocab_size=vocab, eot_token=eot, block_size=block_size, n_layer=2, n_embd=32, n_head=2,
                           init="nanogpt")).eval()


def test_real_model_padding_invariance_and_length_windows():
    model = _tiny_gpt(block_size=64)
    decided = 0
    for task in ec.load_bundle(BUNDLE)["tasks"]:  # right-padding with eot changes a causal model's scores by rounding
        data = ec.shuffle_and_cut(ec.load_task_data(task), 3)
        a = ec.evaluate_task(model, TOK, task, data, batch_tokens=600)
        b = ec.evaluate_task(model, TOK, task, data, batch_tokens=1 << 15)
        decided += assert_same_scores(a, b, task["icl_task_type"], rel=1e-4, tie_margin=1e-3)
    assert decided > 0
    rng = np.random.default_rng(1)
    docs = [rng.integers(1, 128, size=n).tolist() for n in (5, 40, 150, 17)]
    buckets = ec.length_bucket_loss(model, np.array(sum(([0] + d for d in docs), [])), 0, batch_tokens=300)
    for lab, doc in (("64", docs[1]), ("256", docs[2])):  # one forward per window of 64 tokens, by hand
        ids, total = [0] + doc, 0.0
        for w in range(0, len(doc), 63):
            seq = torch.tensor([ids[w:w + 64]])
            total += F.cross_entropy(model(seq)[0][0, :-1], seq[0, 1:], reduction="sum").item()
        assert buckets[lab]["loss"] == pytest.approx(total / len(doc), rel=1e-5)


def test_cli_end_to_end_with_a_checkpoint(tmp_path, capsys):
    from data.prepare import prepare
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": ("word " * n).strip()}) + "\n" for n in (3, 20, 50, 90, 7, 30)))
    data = prepare([str(corpus)], str(tmp_path / "prep"), val_fraction=0.5, seed=0, verbose=False)
    ckpt = save_checkpoint(_tiny_gpt(vocab=4096, eot=4095, block_size=128), tmp_path / "ckpt.pt",
                           config={"data_dir": data})
    assert ec.main(["--ckpt", ckpt, "--bundle", BUNDLE, "--max_per_task", "2", "--json", "--length_buckets",
                    "--kshot_sweep", "--tasks", "dyck_mini,toy_winograd"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["core"]["tasks"]) == {"toy_winograd", "dyck_mini"}
    assert math.isfinite(out["core"]["core"]) and math.isfinite(out["core"]["core_nll"])
    assert sum(b["n_docs"] for b in out["length_buckets"].values()) == 3
    assert list(out["kshot"]["tasks"]["dyck_mini"]) == [str(k) for k in ec.KSHOT_SWEEP]


def test_cli_mistakes_are_one_line_with_status_2(tmp_path, capsys):
    ckpt = save_checkpoint(_tiny_gpt(vocab=4096, eot=4095), tmp_path / "ckpt.pt")
    bad_yaml, bad_item = _copy_bundle(tmp_path), tmp_path / "bad_item"
    (bad_yaml / "core.yaml").write_text("icl_tasks:\n- label: a\n\tdataset_uri: b\n")
    shutil.copytree(BUNDLE, bad_item)
    (bad_item / "eval_data" / "symbolic_problem_solving" / "copy_mini.jsonl").write_text('{"context": "x"\n')
    other = tmp_path / "other"  # data of another tokenizer
    (other / "c.txt").parent.mkdir()
    (other / "c.txt").write_text("one two\n<|endoftext|>\nthree four\n")
    from data.prepare import prepare
    other_data = prepare([str(other / "c.txt")], str(other / "prep"), "gpt2-512", 0.5, verbose=False)
    ok = ["--ckpt", ckpt, "--bundle", BUNDLE]
    for argv, needle in [(["--ckpt", str(tmp_path / "missing.pt"), "--bundle", BUNDLE], "missing.pt"),
                         (["--ckpt", ckpt, "--bundle", str(tmp_path / "nope")], "core.yaml"),
                         (["--ckpt", ckpt, "--bundle", str(bad_yaml)], "not a readable eval bundle"),
                         (["--ckpt", ckpt, "--bundle", str(bad_item)], "copy_mini.jsonl: malformed JSON"),
                         (ok + ["--tasks", "toy_arith_mc,nope"], "--tasks: not in"),
                         (ok + ["--fewshot_seeds", "0,x"], "--fewshot_seeds"),
                         (["--ckpt", ckpt], "give --bundle (CORE) and/or --length_buckets"),
                         (["--ckpt", ckpt, "--length_buckets", "--data_dir", str(tmp_path / "nodata")], "nodata"),
                         (["--ckpt", ckpt, "--length_buckets", "--data_dir", other_data], "holds gpt2-512 tokens")]:
        assert needle in error_line(ec.main, argv, capsys, "eval_core.py"), argv


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
        task_type = rng.choice(("multiple_choice", "schema", "language_modeling"))
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
