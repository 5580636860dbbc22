"""eval_core.py item by item against a transcription of nanochat's scorer; CORE [X17] [X18] on stub
models with known losses; k-shot sweeps, the length-bucket loss, the CLI."""
import collections
import json
import math
import random
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import eval_core as ec
from data.prepare import prepare
from test_sample import BUNDLE, error_line, save_checkpoint


class CharTokenizer:
    """One token per ASCII character; eot (= BOS = pad) is 0."""
    eot_token, n_vocab, name = 0, 128, "char"

    def encode(self, text):
        assert all(0 < ord(c) < 128 for c in text), text
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


class MergeTokenizer(CharTokenizer):
    """Fuses ":A" into token 127, so a BPE-like merge crosses the join."""
    def encode(self, text):
        return [127 if c == "\0" else ord(c) for c in text.replace(":A", "\0")]


class BigramModel(torch.nn.Module):
    """logits[t] = table[idx[t]]: every loss is -log softmax(table)[prev, next]."""
    def __init__(self, block_size=1024):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(128, 128, generator=torch.Generator().manual_seed(0)) * 3)
        self.config = type("C", (), {"block_size": block_size})()
        self.logp = F.log_softmax(self.table.detach().double(), dim=-1).tolist()

    def forward(self, idx):
        return self.table[idx], None

    def loss(self, prev, nxt):
        return -self.logp[prev][nxt]


class OracleModel(torch.nn.Module):
    """A perfect next-token oracle: all mass on the token at t+1."""
    config = type("C", (), {"block_size": 4096})()

    def forward(self, idx):
        return F.one_hot(torch.roll(idx, -1, dims=1), 128).float() * 100.0, None


class FirstChoiceModel(OracleModel):
    """Every span token costs 1e4 (all mass on token 0): the first choice wins, LM greedy fails."""
    def forward(self, idx):
        return F.one_hot(torch.zeros_like(idx), 128).float() * 1e4


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
    """nanochat/core_eval.py evaluate_example after its few-shot draw, statement by statement (prompts from
    ec.render_*, pinned below) -> (is_correct, pred, mean_losses); raises where nanochat raises."""
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
        prompts = ec.render_lm(item, delim, fewshot)
        tokens_without, tokens_with = [[bos_id] + tokenizer.encode(p) for p in prompts]
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
    mean_losses = [losses[i, si - 1:ei - 1].mean().item()
                   for i, (si, ei) in enumerate(zip(start_idxs, end_idxs))]
    pred_idx = mean_losses.index(min(mean_losses))
    return pred_idx == item["gold"], pred_idx, mean_losses


def score_one(model, item, task_type, delim=" ", fewshot=(), max_len=None):
    ex = ec.build_example(item, task_type, delim, TOK, fewshot, max_len)
    (res,) = ec.score_examples(model, [ex], task_type, TOK.eot_token)
    return res, ex


TOK = CharTokenizer()
MC_TASK = {"label": "t", "icl_task_type": "multiple_choice", "num_fewshot": 0, "continuation_delimiter": " "}


def bos(text):
    return [0] + [ord(c) for c in text]


def bigram_nll(model, ids, start):
    """Mean -log p(ids[t] | ids[t-1]) over t >= start."""
    return sum(model.loss(ids[t - 1], ids[t]) for t in range(start, len(ids))) / (len(ids) - start)


def test_render_mc_exact_strings_and_spans():
    item = {"query": "Q: 1+1?", "choices": ["2", "3"], "gold": 0}
    shots = [{"query": "Q: 2+2?", "choices": ["5", "4"], "gold": 1},
             {"query": "Q: 0+1?", "choices": ["1"], "gold": 0}]
    prompts = ec.render_mc(item, " ", shots)
    assert prompts == ["Q: 2+2? 4\n\nQ: 0+1? 1\n\nQ: 1+1? 2", "Q: 2+2? 4\n\nQ: 0+1? 1\n\nQ: 1+1? 3"]
    ex = ec.build_example(item, "multiple_choice", " ", TOK, shots)
    n = len(bos("Q: 2+2? 4\n\nQ: 0+1? 1\n\nQ: 1+1? "))
    assert ex["tokens"] == [bos(p) for p in prompts] and ex["gold"] == 0
    assert (ex["starts"], ex["ends"], ex["answer_start"]) == ([n, n], [n + 1, n + 1], n)
    # choices sharing a first word: the MC span starts after the common prefix, the answer NLL span does not
    item = {"query": "Pick:", "choices": ["a cat", "a dog"], "gold": 1}
    ex = ec.build_example(item, "multiple_choice", " ", TOK)
    assert ex["starts"] == [len(bos("Pick: a "))] * 2 and ex["answer_start"] == len(bos("Pick: "))


def test_render_schema_exact_strings_and_spans():
    item = {"context_options": ["The cup hit the table", "The cup hit the floor"],
            "continuation": "and broke.", "gold": 1}
    shot = {"context_options": ["A dog", "A cat"], "continuation": "meowed.", "gold": 1}
    prompts = ec.render_schema(item, " ", [shot])
    assert prompts == ["A cat meowed.\n\nThe cup hit the table and broke.",
                       "A cat meowed.\n\nThe cup hit the floor and broke."]
    ex = ec.build_example(item, "schema", " ", TOK, [shot])
    assert ex["ends"] == [len(bos(p)) for p in prompts]
    assert ex["starts"] == [e - len(" and broke.") for e in ex["ends"]]
    assert ex["answer_start"] == len(bos("A cat meowed.\n\nThe cup hit the floor "))


def test_render_lm_exact_strings_and_spans():
    item = {"context": "  Input: ( [  ", "continuation": "] )"}
    shots = [{"context": "Input: <", "continuation": ">"}]
    without, with_ = ec.render_lm(item, " ", shots)
    assert (without, with_) == ("Input: < >\n\nInput: ( [", "Input: < >\n\nInput: ( [ ] )")
    ex = ec.build_example(item, "language_modeling", " ", TOK, shots)
    assert ex["tokens"] == [bos(with_)] and ex["ends"] == [len(bos(with_))] and not ex["boundary_fixed"]
    assert TOK.decode(ex["tokens"][0][ex["starts"][0]:]) == " ] )"  # the delimiter's space is scored too
    without, with_ = ec.render_lm({"context": "Repeat: x", "continuation": "x x"}, "\nOutput: ")
    assert (without, with_) == ("Repeat: x\nOutput:", "Repeat: x\nOutput: x x")
    # a BPE merge across the join: the span starts at the common prefix
    ex = ec.build_example({"context": "Q:", "continuation": "A"}, "language_modeling", "", MergeTokenizer())
    assert ex["tokens"] == [[0, ord("Q"), 127]] and ex["starts"] == [2] and ex["boundary_fixed"]


def test_shuffle_and_fewshot_draws_match_nanochat():
    data, ref = list(range(20)), list(range(20))
    random.Random(1337).shuffle(ref)
    assert ec.shuffle_and_cut(data, 5) == ref[:5] and ec.shuffle_and_cut(data) == ref
    for idx, seed in ((0, 1234), (7, 1234), (3, 0)):
        want = random.Random(seed + idx).sample([i for i in range(20) if i != idx], 4)
        assert ec.sample_fewshot(data, idx, 4, seed) == want
    # fewer other items than k: nanochat's rng.sample raises; we take all of them in that rng's order
    data = [{"query": f"q{i}?", "choices": ["a", "b"], "gold": i % 2} for i in range(3)]
    for idx in range(3):
        picks = random.Random(1234 + idx).sample([i for i in range(3) if i != idx], 2)
        assert ec.sample_fewshot(data, idx, 5) == [data[i] for i in picks]  # fewshot_used: the k-shot sweep


def test_stub_model_known_losses_give_expected_choice_and_nll():
    model = BigramModel()
    item = {"query": "Q: 1+1?", "choices": ["2", "3", "11"], "gold": 2}
    res, _ = score_one(model, item, "multiple_choice")
    s = len(bos("Q: 1+1? "))
    expected = [bigram_nll(model, bos("Q: 1+1? " + c), s) for c in item["choices"]]
    assert res["mean_losses"] == pytest.approx(expected, rel=1e-5)
    assert res["pred"] == int(np.argmin(expected)) and res["correct"] == (res["pred"] == 2)
    assert res["answer_nll"] == pytest.approx(expected[2], rel=1e-5)
    # a full task: accuracy, centered accuracy [X17] and mean answer NLL [X18]
    items = [dict(item, gold=g) for g in range(3)] + [{"query": "Z?", "choices": ["a", "b"], "gold": 0}]
    r = ec.evaluate_task(model, TOK, MC_TASK, items)
    z = [bigram_nll(model, bos("Z? " + c), len(bos("Z? "))) for c in "ab"]
    preds = [x["pred"] for x in r["items"]]
    assert preds == [int(np.argmin(expected))] * 3 + [int(np.argmin(z))]
    acc = sum(p == it["gold"] for p, it in zip(preds, items)) / 4
    assert r["accuracy"] == acc and r["answer_nll"] == pytest.approx((sum(expected) + z[0]) / 4, rel=1e-5)
    assert ec.centered_accuracy(acc, 25.0) == pytest.approx((acc - 0.25) / 0.75)
    # LM: correct only when every greedy token is
    res, _ = score_one(model, {"context": "ab", "continuation": "cd"}, "language_modeling")
    ids, greedy = bos("ab cd"), model.table.argmax(-1)
    assert res["correct"] == all(greedy[ids[t - 1]].item() == ids[t] for t in range(3, len(ids)))
    assert res["answer_nll"] == pytest.approx(bigram_nll(model, ids, 3), rel=1e-5)


def test_oracle_solves_lm_items_and_first_choice_model_centres_to_zero():
    bundle = ec.load_bundle(BUNDLE)
    oracle = ec.evaluate_core(OracleModel(), TOK, bundle)
    for r in (oracle["tasks"]["dyck_mini"], oracle["tasks"]["copy_mini"]):
        assert r["accuracy"] == 1.0 and r["centered"] == 1.0 and r["answer_nll"] < 1e-6
    chance = ec.evaluate_core(FirstChoiceModel(), TOK, bundle)
    assert [r["accuracy"] for r in chance["tasks"].values()] == [0.25, 0.5, 0.0, 0.0]
    assert [r["centered"] for r in chance["tasks"].values()] == [0.0] * 4 and chance["core"] == 0.0


def test_random_baselines_centre_to_zero_and_published_tables(tmp_path):
    for rb in (0.0, 9.1, 20.0, 25.0, 40.3, 50.0, 62.0):
        assert ec.centered_accuracy(rb / 100, rb) == pytest.approx(0.0, abs=1e-12)
        assert ec.centered_accuracy(1.0, rb) == pytest.approx(1.0)
    b = shutil.copytree(BUNDLE, tmp_path / "bundle")
    (b / "eval_meta_data.csv").write_text("Eval Task,Random baseline\ntoy_arith_mc,25\ntoy_winograd,50\n"
                                         "commonsense_qa,20\ncopy_mini,0\n")
    (b / "core.yaml").write_text((b / "core.yaml").read_text().replace("dyck_mini", "commonsense_qa"))
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
        (tmp_path / "eval_data" / "x" / f"{label}.jsonl").write_text("\n".join(map(json.dumps, rows)))
        kind = "language_modeling" if lm else "multiple_choice"
        yaml_lines.append(f"- {{label: {label}, dataset_uri: x/{label}.jsonl, "
                          f"num_fewshot: [1], icl_task_type: {kind}}}")
        csv_lines.append(f"{label},{0 if lm else 50}")
    (tmp_path / "core.yaml").write_text("\n".join(yaml_lines) + "\n")
    (tmp_path / "eval_meta_data.csv").write_text("\n".join(csv_lines) + "\n")
    res = ec.evaluate_core(OracleModel(), TOK, str(tmp_path))
    tasks = res["tasks"]
    assert res["core"] == pytest.approx(np.mean([r["centered"] for r in tasks.values()]))
    assert res["core17"] == pytest.approx(np.mean([tasks[l]["centered"] for l in ec.CORE17_LABELS]))
    assert res["core17_nll"] == pytest.approx(np.mean([tasks[l]["answer_nll"] for l in ec.CORE17_LABELS]))
    assert ec.evaluate_core(OracleModel(), TOK, str(tmp_path), labels=core22[1:])["core17"] is None


def test_fewshot_seeds_average_and_kshot_sweep():
    model, bundle = BigramModel(), ec.load_bundle(BUNDLE)
    res = ec.evaluate_core(model, TOK, bundle, fewshot_seeds=(0, 1, 2),
                           labels=["toy_arith_mc", "toy_winograd"])
    task = bundle["tasks"][0]
    data = ec.shuffle_and_cut(ec.load_task_data(task))
    per_seed = [ec.evaluate_task(model, TOK, task, data, fewshot_seed=s)["accuracy"] for s in (0, 1, 2)]
    r = res["tasks"]["toy_arith_mc"]
    assert r["per_seed_accuracy"] == per_seed and r["accuracy"] == pytest.approx(np.mean(per_seed))
    winograd = res["tasks"]["toy_winograd"]  # 0-shot: one run
    assert winograd["per_seed_accuracy"] == [winograd["accuracy"]]
    sweep = ec.kshot_sweep(model, TOK, bundle, ks=(0, 1, 32))
    assert set(sweep["tasks"]) == {"toy_arith_mc", "dyck_mini", "copy_mini"}  # the few-shot tasks
    core0 = ec.evaluate_core(model, TOK, bundle, num_fewshot=0)
    for label, per_k in sweep["tasks"].items():
        assert per_k[0]["accuracy"] == core0["tasks"][label]["accuracy"] and set(per_k) == {0, 1, 32}
        assert per_k[1]["fewshot_used"] == 1 and per_k[32]["fewshot_used"] == core0["tasks"][label]["n"] - 1


def test_bundle_reading_and_fingerprint(tmp_path):
    bundle = ec.load_bundle(BUNDLE)
    tasks = bundle["tasks"]
    assert [(t["label"], t["num_fewshot"], t["random_baseline"]) for t in tasks] == [
        ("toy_arith_mc", 3, 25.0), ("toy_winograd", 0, 50.0), ("dyck_mini", 3, 0.0), ("copy_mini", 2, 0.0)]
    assert tasks[3]["continuation_delimiter"] == "\nOutput: " and len(ec.load_task_data(tasks[2])) == 16
    b = shutil.copytree(BUNDLE, tmp_path / "bundle")
    assert ec.fingerprint(str(b)) == bundle["fingerprint"] and len(bundle["fingerprint"]) == 64
    f = b / "eval_data" / "symbolic_problem_solving" / "copy_mini.jsonl"
    f.write_text(f.read_text() + "\n\n")  # blank lines are skipped
    assert ec.load_task_data(ec.load_bundle(str(b))["tasks"][3]) == ec.load_task_data(tasks[3])
    assert ec.fingerprint(str(b)) != bundle["fingerprint"]  # every byte of every file counts


def test_length_bucket_loss_matches_manual():
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 128, size=n).tolist() for n in (3, 30, 33, 64, 70, 5, 200)]
    tokens = np.array(sum(([0] + d for d in docs), []), dtype=np.uint16)
    assert ec.split_documents(tokens, 0)[:2] == [(1, 4), (5, 35)]
    model = BigramModel(block_size=64)
    buckets = ec.length_bucket_loss(model, tokens, 0)
    # by hand: each doc read as [eot] + doc; a bigram only sees the previous token, so windows change nothing
    sums = {}
    for a, b in ec.split_documents(tokens, 0):
        s = sums.setdefault(ec.bucket_of(b - a), [0.0, 0])
        s[0] += bigram_nll(model, [0] + [int(x) for x in tokens[a:b]], 1) * (b - a)
        s[1] += b - a
    for lab, (total, n) in sums.items():
        assert buckets[lab]["loss"] == pytest.approx(total / n, rel=1e-5) and buckets[lab]["n_tokens"] == n
    assert buckets["32"]["n_docs"] == 3 and buckets["64"]["n_docs"] == 2 and buckets["256"]["n_tokens"] == 200
    assert buckets["4096"]["loss"] is None and list(buckets)[-1] == ">4096"
    assert (ec.bucket_of(4097), ec.bucket_of(32), ec.bucket_of(33)) == (">4096", "32", "64")
    first = ec.length_bucket_loss(model, tokens, 0, max_tokens=33)  # whole documents until 33 are read
    assert sum(b["n_docs"] for b in first.values()) == 2


def _tiny_gpt(vocab=128, eot=0, block_size=256):
    from model import GPT, ModelConfig
    torch.manual_seed(0)
    return GPT(ModelConfig(vocab_size=vocab, eot_token=eot, block_size=block_size, n_layer=2,
                           n_embd=32, n_head=2, init="nanogpt")).eval()


def test_real_model_padding_invariance_and_length_windows():
    model = _tiny_gpt(block_size=64)
    decided = 0
    # right-padding with eot changes a causal model's scores by rounding only
    for task in ec.load_bundle(BUNDLE)["tasks"]:
        data = ec.shuffle_and_cut(ec.load_task_data(task), 3)
        a = ec.evaluate_task(model, TOK, task, data, batch_tokens=600)
        b = ec.evaluate_task(model, TOK, task, data, batch_tokens=1 << 15)
        for x, y in zip(a["items"], b["items"], strict=True):  # equal losses; equal picks beyond a near-tie
            assert x["mean_losses"] == pytest.approx(y["mean_losses"], rel=1e-4, nan_ok=True)
            assert x["answer_nll"] == pytest.approx(y["answer_nll"], rel=1e-4)
            finite = sorted(loss for loss in x["mean_losses"] if not math.isnan(loss))
            if task["icl_task_type"] != "language_modeling" and (
                    len(finite) < 2 or finite[1] - finite[0] > 1e-3):
                assert x["pred"] == y["pred"]
                decided += 1
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
    corpus = tmp_path / "c.jsonl"
    texts = [("word " * n).strip() for n in (3, 20, 50, 90, 7, 30)]
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    data = prepare([str(corpus)], str(tmp_path / "prep"), val_fraction=0.5, seed=0, verbose=False)
    ckpt = save_checkpoint(_tiny_gpt(vocab=4096, eot=4095, block_size=128), tmp_path / "ckpt.pt",
                           config={"data_dir": data})
    argv = ["--ckpt", ckpt, "--bundle", BUNDLE, "--max_per_task", "2", "--tasks", "dyck_mini,toy_winograd",
            "--device", "cpu"]
    assert ec.main(argv + ["--json", "--length_buckets", "--kshot_sweep"]) == 0
    out = json.loads(capsys.readouterr().out)
    model, tok, _ = ec.load_model_and_tokenizer(ckpt)
    direct = ec.evaluate_core(model, tok, BUNDLE, 2, labels=["dyck_mini", "toy_winograd"])
    assert out["core"]["core"] == pytest.approx(direct["core"], rel=1e-9)  # the same computation, via JSON
    assert [r["n"] for r in out["core"]["tasks"].values()] == [2, 2]
    assert sum(b["n_docs"] for b in out["length_buckets"].values()) == 3
    assert list(out["kshot"]["tasks"]["dyck_mini"]) == [str(k) for k in ec.KSHOT_SWEEP]
    assert ec.main(argv) == 0
    text = capsys.readouterr().out
    assert all(s in text for s in ("dyck_mini", "CORE (2 tasks)", f"sha256 {direct['fingerprint']}"))


def test_cli_mistakes_are_one_line_with_status_2(tmp_path, capsys):
    ckpt = save_checkpoint(_tiny_gpt(vocab=4096, eot=4095), tmp_path / "ckpt.pt")
    bad_yaml, bad_item = shutil.copytree(BUNDLE, tmp_path / "a"), shutil.copytree(BUNDLE, tmp_path / "b")
    (bad_yaml / "core.yaml").write_text("icl_tasks:\n- label: a\n\tdataset_uri: b\n")
    (bad_item / "eval_data" / "symbolic_problem_solving" / "copy_mini.jsonl").write_text('{"context": "x"\n')
    (tmp_path / "c.txt").write_text("one two\n<|endoftext|>\nthree four\n")  # data of another tokenizer
    other = prepare([str(tmp_path / "c.txt")], str(tmp_path / "prep"), "gpt2-512", 0.5, verbose=False)
    ok, lengths = ["--ckpt", ckpt, "--bundle", BUNDLE], ["--ckpt", ckpt, "--length_buckets"]
    for argv, needle in [(["--ckpt", str(tmp_path / "missing.pt"), "--bundle", BUNDLE], "missing.pt"),
                         (["--ckpt", ckpt, "--bundle", str(tmp_path / "nope")], "core.yaml"),
                         (["--ckpt", ckpt, "--bundle", str(bad_yaml)], "not a readable eval bundle"),
                         (["--ckpt", ckpt, "--bundle", str(bad_item)], "copy_mini.jsonl: malformed JSON"),
                         (ok + ["--tasks", "toy_arith_mc,nope"], "--tasks: not in"),
                         (ok + ["--fewshot_seeds", "0,x"], "--fewshot_seeds"),
                         (["--ckpt", ckpt], "give --bundle (CORE) and/or --length_buckets"),
                         (lengths + ["--data_dir", str(tmp_path / "nodata")], "nodata"),
                         (lengths + ["--data_dir", other], "holds gpt2-512 tokens")]:
        assert needle in error_line(ec.main, argv, capsys, "eval_core.py"), argv


def test_crops_score_like_nanochat():
    model, item = BigramModel(), {"context": "abcdefghij", "continuation": "XY"}
    ex = ec.build_example(item, "language_modeling", " ", TOK, max_len=6)
    assert ex["tokens"] == [bos("abcdefghij XY")[-6:]] and ex["starts"] == [3]
    for max_len in (3, 2):  # the LM span would start at 0 or below: nanochat fails there too
        with pytest.raises(ValueError, match="does not fit in the model context.*nanochat's crop"):
            ec.build_example(item, "language_modeling", " ", TOK, max_len=max_len)
    # a crop inside the common prefix of MC choices
    item = {"query": "Pick:", "choices": ["a cat", "a horse"], "gold": 1}  # 12 and 14 tokens, common prefix 9

    def nanochat(item, max_len):
        return nanochat_evaluate_example(model, TOK, item, "multiple_choice", " ", max_len=max_len)[:2]

    # max_len 6: crops of 6 and 8 leave spans at 3 and 1; the gold answer ("a horse") loses "a " to the crop
    res, ex = score_one(model, item, "multiple_choice", max_len=6)
    assert ex["starts"] == [3, 1] and ex["tokens"][1] == bos("Pick: a horse")[8:]
    assert ex["answer_start"] == 1 and ex["answer_cropped"]
    assert res["answer_nll"] == pytest.approx(bigram_nll(model, ex["tokens"][1], 1), rel=1e-5)
    assert (res["correct"], res["pred"]) == nanochat(item, 6)
    # max_len 5, a span at 0 -> nan: test_random_edge_items_score_like_nanochat's "span at 0", "nan later"
    # max_len 4: a span shifted below 0; nanochat asserts, we stop with an error naming the task and item
    with pytest.raises(AssertionError):
        nanochat(item, 4)
    with pytest.raises(ValueError, match=r"task 't' item 0 .*does not fit in the model context of 4 tokens"):
        ec.evaluate_task(model, TOK, MC_TASK, [item], max_len=4)
    assert ec.evaluate_task(model, TOK, MC_TASK, [item, item], max_len=6)["answer_cropped"] == 2


def test_random_edge_items_score_like_nanochat():
    """Random tiny items aimed at the edges (prefix, empty and repeated options, crops at every length):
    the same pick and correctness as the nanochat transcription, an error exactly where it raises."""
    rng, model, seen = random.Random(0), BigramModel(), collections.Counter()
    for _ in range(400):
        task_type = rng.choice(("multiple_choice", "schema", "language_modeling"))
        delim = rng.choice([" ", "", "\n"])
        if task_type == "multiple_choice":
            choices = [rng.choice(["", "a", "ab", "abc", "b", "ba", "a b"]) for _ in range(rng.randint(2, 4))]
            if (gold := rng.choice([i for i, c in enumerate(choices) if c] or [None])) is None:
                continue
            item = {"query": rng.choice(["Q:", "x", "Pick one:"]), "choices": choices, "gold": gold}
            shots = [{"query": "S:", "choices": ["ab", "b"], "gold": 0}] * rng.randint(0, 1)
        elif task_type == "schema":
            options = [rng.choice(["a", "ba", "cba", "the a", "xyz"]) for _ in range(rng.randint(2, 3))]
            item = {"context_options": options, "continuation": rng.choice(["a", "is a", "z."]),
                    "gold": rng.randrange(len(options))}
            shots = [{"context_options": ["q", "r"], "continuation": "s", "gold": 1}] * rng.randint(0, 1)
        else:
            item = {"context": rng.choice(["ab", "x y", " c "]),
                    "continuation": rng.choice(["a", "bc", "a b"])}
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
    # an empty span's nan mean wins when first, never later, as in mean_losses.index(min(mean_losses))
    nan = float("nan")
    assert [ec.nanochat_choice(x) for x in ([nan, 1.0, 0.5], [2.0, nan, 1.0], [1.0, 0.5, 0.5])] == [0, 2, 1]
