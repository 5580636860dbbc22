"""eval_harness.py: lm-eval on local toy tasks against the model's own forward, eval_core and sample.py."""
import json
import math
import sys

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")
import lm_eval.evaluator  # noqa: E402  (the module whose environment report the tests skip)
import lm_eval.tasks  # noqa: E402

import eval_core  # noqa: E402
import eval_harness as eh  # noqa: E402
import sample  # noqa: E402
from conftest import model_whose_blocks_matter  # noqa: E402
from test_sample import TOK, error_line, save_checkpoint  # noqa: E402

EOT = TOK.eot_token
SMALL = dict(vocab_size=4096, eot_token=EOT, block_size=32, n_layer=4, n_embd=32, n_head=2, init="nanogpt")
TASKS = ["toy_mc", "toy_long", "toy_text", "toy_gen"]
MAX_GEN = 40  # more than a block of 32 tokens: generation goes on in windows


def make_model(**overrides):
    return model_whose_blocks_matter(**(SMALL | overrides))


def write_task(folder, name, records, output_type, metrics, **config):
    """folder/<name>.jsonl and a task YAML (as JSON) reading it through HF datasets' json builder."""
    (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    files = dict(data_files=dict(test=f"{folder / name}.jsonl"), cache_dir=str(folder / "hf_cache"))
    (folder / f"{name}.yaml").write_text(json.dumps(dict(
        task=name, dataset_path="json", dataset_kwargs=files, test_split="test", output_type=output_type,
        metric_list=[{"metric": m} for m in metrics], **config)))


# the choices are one token each after the space lm-eval and eval_core put before them
MC_ITEMS = [{"query": q, "choices": ["1", "2", "3", "cat"], "gold": i % 4} for i, q in enumerate(
    ["Q: one plus one is", "The cat sat on the", "Two and two make", "Count: 1, 2,", "ROMEO: My lady",
     "Numbers follow:", "What is three?", "A dog or a", "Say a number:", "First, second,", "JULIET: O",
     "The answer is"])]
LONG_CONTEXT = " ".join(["the king and the queen of the land"] * 6)  # more than block_size tokens
TEXTS = ["the king", "ROMEO: what light through yonder window breaks", " ".join(["a word or two"] * 30)]
PROMPTS = [f"Say {i}:" for i in range(4)]  # one length: generated in one batch


def write_tasks(folder):
    write_task(folder, "toy_mc", MC_ITEMS, "multiple_choice", ["acc"], doc_to_text="{{query}}",
               doc_to_choice="{{choices}}", doc_to_target="{{gold}}")
    long = [{"context": LONG_CONTEXT[:n], "continuation": " of the land"} for n in (10, 120, 200, 1000)]
    write_task(folder, "toy_long", long, "loglikelihood", ["perplexity", "acc"], doc_to_text="{{context}}",
               doc_to_target="{{continuation}}", target_delimiter="")
    write_task(folder, "toy_text", [{"text": t} for t in TEXTS], "loglikelihood_rolling",
               ["word_perplexity", "bits_per_byte"], doc_to_text="", doc_to_target="{{text}}")
    write_task(folder, "toy_gen", [{"question": p, "answer": "1"} for p in PROMPTS], "generate_until",
               ["exact_match"], doc_to_text="{{question}}", doc_to_target="{{answer}}",
               generation_kwargs=dict(until=["\n\n"], max_gen_toks=MAX_GEN, do_sample=False))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The harness on the looped model as a sweep over 1 and 2 passes, and alone at 2 (no env report)."""
    root = tmp_path_factory.mktemp("harness")
    write_tasks(root)
    model = make_model(layout="smelt", n_passes=2, n_expert=4, top_k=2)  # trained with 2 passes
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setattr(lm_eval.evaluator, "add_env_info", lambda results: None)
        lm = eh.lm_class()(model, TOK, progress=False)
        sweep = eh.evaluate(lm, TASKS, [1, 2], include_path=str(root), bootstrap_iters=0)
        alone = eh.evaluate(lm, TASKS, [2], include_path=str(root), bootstrap_iters=0)[2]  # = sweep[2]
    return dict(tasks=str(root), model=model, ckpt=save_checkpoint(model, root / "ckpt.pt"),
                sweep=sweep, alone=alone)


def samples(results, task):
    return sorted(results["samples"][task], key=lambda s: s["doc_id"])


def own_loglikelihood(model, context, continuation, n_passes):
    """(log p(continuation | <|endoftext|> + context), greedy) from a forward on its last block + 1 tokens."""
    whole = [EOT] + TOK.encode(context + continuation)
    n = len(whole) - 1 - len(TOK.encode(context))
    seq = whole[-(model.config.block_size + 1):]
    with torch.no_grad():
        logprobs = model(torch.tensor([seq[:-1]]), n_passes=n_passes)[0][0].log_softmax(-1)
    positions = range(len(seq) - 1 - n, len(seq) - 1)
    greedy = all(int(logprobs[p].argmax()) == seq[p + 1] for p in positions)
    return sum(float(logprobs[p, seq[p + 1]]) for p in positions), greedy


def own_rolling(model, text, n_passes):
    """Sum of log p(token | document before it), block_size predictions per forward, full windows."""
    tokens, block = TOK.encode(text), model.config.block_size
    inputs, total, done = [EOT] + tokens[:-1], 0.0, 0  # inputs[i] predicts tokens[i]
    while done < len(tokens):
        end = min(done + block, len(tokens))
        start = max(0, end - block)
        with torch.no_grad():
            logprobs = model(torch.tensor([inputs[start:end]]), n_passes=n_passes)[0][0].log_softmax(-1)
        total += sum(float(logprobs[i - start, tokens[i]]) for i in range(done, end))
        done = end
    return total


@pytest.mark.parametrize("k", [1, 2])
def test_loglikelihoods_and_rolling_equal_the_models_own_forward(setup, k):
    assert len(TOK.encode(LONG_CONTEXT)) > setup["model"].config.block_size  # the left cut is exercised
    checked = 0
    for task in ("toy_mc", "toy_long"):
        for item in samples(setup["sweep"][k], task):
            for (context, continuation), [(logprob, greedy)] in zip(item["arguments"], item["resps"]):
                want, want_greedy = own_loglikelihood(setup["model"], context, continuation, k)
                assert logprob == pytest.approx(want, rel=1e-5, abs=1e-5) and greedy == want_greedy, context
                checked += 1
    assert checked == 4 * len(MC_ITEMS) + 4
    assert len(TOK.encode(TEXTS[-1])) > 2 * setup["model"].config.block_size  # the last window overlaps
    for item, text in zip(samples(setup["sweep"][k], "toy_text"), TEXTS):
        assert item["resps"][0][0] == pytest.approx(own_rolling(setup["model"], text, k), rel=1e-5)


def test_multiple_choice_accuracy_equals_eval_core_scoring(setup):
    """eval_core's mean loss of each choice's span (one token here) picks what lm-eval's acc picks."""
    model, harness = setup["model"], setup["sweep"][2]
    examples = [eval_core.build_example(item, "multiple_choice", " ", TOK, max_len=32) for item in MC_ITEMS]
    scored = eval_core.score_examples(model, examples, "multiple_choice", EOT)
    for item, result in zip(samples(harness, "toy_mc"), scored):
        losses = [-logprob for [(logprob, _)] in item["resps"]]
        assert losses == pytest.approx(result["mean_losses"], rel=1e-5, abs=1e-5)
    accuracy = sum(r["correct"] for r in scored) / len(scored)
    assert harness["results"]["toy_mc"]["acc,none"] == pytest.approx(accuracy, abs=1e-12)


def test_generation_equals_sample_py_greedy_decoding(setup):
    ids, outputs = torch.tensor([[EOT] + TOK.encode(prompt) for prompt in PROMPTS]), {}
    for k in (1, 2):
        new = sample.generate_windowed(setup["model"], ids, MAX_GEN, temperature=0, n_passes=k).tolist()
        outputs[k] = [s["resps"][0][0] for s in samples(setup["sweep"][k], "toy_gen")]
        assert outputs[k] == [TOK.decode(t).split("\n\n")[0].split("<|endoftext|>")[0] for t in new]
    assert outputs[1] != outputs[2]
    prompt = [EOT] + TOK.encode("Say 0:")  # greedy_until stops at the first stop string to appear
    full = sample.generate_windowed(setup["model"], torch.tensor([prompt]), 12, temperature=0)[0].tolist()
    stop = TOK.decode(full[:3])  # in the text once the third new token is there
    assert eh.greedy_until(setup["model"], TOK, [prompt], ("never", stop), 12) == [stop]
    assert eh.greedy_until(setup["model"], TOK, [prompt], (), 12) == [TOK.decode(full)]


def test_a_sweep_equals_separate_runs_and_a_registry_built_model(setup, monkeypatch):
    sweep, alone = setup["sweep"][2], setup["alone"]  # K = 2 after K = 1 ran, and alone
    assert sweep["results"] == alone["results"]
    for task in TASKS:
        assert [s["resps"] for s in samples(sweep, task)] == [s["resps"] for s in samples(alone, task)]
    assert [setup["sweep"][k]["config"]["n_passes"] for k in (1, 2)] == [1, 2]
    one, two = (setup["sweep"][k]["results"]["toy_text"]["bits_per_byte,none"] for k in (1, 2))
    assert math.isfinite(one) and one != two  # the passes change the answers
    monkeypatch.setattr(lm_eval.evaluator, "add_env_info", lambda results: None)
    eh.lm_class()  # registers "loopstudy": lm-eval builds it from model_args, and it equals K = 1
    results = lm_eval.simple_evaluate(
        model="loopstudy", model_args=f"ckpt={setup['ckpt']},n_passes=1,progress=False", tasks=["toy_mc"],
        task_manager=eh.task_manager(["toy_mc"], setup["tasks"]), bootstrap_iters=0, batch_size=3)
    assert results["results"]["toy_mc"] == setup["sweep"][1]["results"]["toy_mc"]
    assert results["config"]["n_passes"] == 1 and results["config"]["model_source"] == setup["ckpt"]


def test_cli_prints_lm_evals_table_and_writes_its_json(setup, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(lm_eval.evaluator, "add_env_info", lambda results: None)
    argv = ["--ckpt", setup["ckpt"], "--tasks", "toy_mc", "--include_path", setup["tasks"], "--limit", "4",
            "--bootstrap_iters", "0", "--output", str(tmp_path / "out.json")]
    assert eh.main(argv) == 0
    assert "|toy_mc|" in capsys.readouterr().out.replace(" ", "")
    results = json.loads((tmp_path / "out.json").read_text())
    first4 = [s for s in samples(setup["sweep"][2], "toy_mc") if s["doc_id"] < 4]
    want = sum(max(range(4), key=lambda c: s["resps"][c][0][0]) == s["target"] for s in first4) / 4
    assert results["results"]["toy_mc"]["acc,none"] == pytest.approx(want)
    assert results["config"]["n_passes"] == 2 and results["config"]["limit"] == 4 and "samples" not in results
    assert eh.main(argv + ["--n_passes", "1,2", "--log_samples"]) == 0  # a sweep: one table, all runs
    assert capsys.readouterr().out.count("| Tasks | Metric | n_passes=1 | n_passes=2 |") == 1
    written = json.loads((tmp_path / "out.json").read_text())
    assert written["n_passes"] == [1, 2] and set(written["results"]) == {"1", "2"}
    assert len(written["results"]["2"]["samples"]["toy_mc"]) == 4


def test_cli_mistakes_are_one_line_with_status_2(setup, tmp_path, capsys, monkeypatch):
    ok = ["--ckpt", setup["ckpt"], "--tasks", "toy_mc", "--include_path", setup["tasks"]]
    untied = save_checkpoint(make_model(layout="pcc_untied", n_layer=3, n_passes=2), tmp_path / "untied.pt")
    plain = save_checkpoint(make_model(), tmp_path / "plain.pt")
    real = lm_eval.tasks.TaskManager  # lm-eval's own index (14k tasks, seconds to build) left out here
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", lambda include_path=None, include_defaults=True:
                        real(include_path=include_path, include_defaults=False))
    for argv, needle in [(ok + ["--n_passes", "1,x"], "--n_passes"),
                         (["--ckpt", untied, "--tasks", "toy_mc", "--n_passes", "1,3"], "runs 1 to 2 passes"),
                         (["--ckpt", plain, "--tasks", "toy_mc", "--n_passes", "2"], "nothing to loop"),
                         (["--ckpt", str(tmp_path / "absent.pt"), "--tasks", "toy_mc"], "absent.pt"),
                         (ok + ["--tasks", "toy_mc,nope"], "--tasks: unknown task 'nope'")]:
        assert needle in error_line(eh.main, argv, capsys, "eval_harness.py"), argv
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # what `import lm_eval` meets without the package
    assert "pip install -r requirements-eval.txt" in error_line(eh.main, ok, capsys, "eval_harness.py")
