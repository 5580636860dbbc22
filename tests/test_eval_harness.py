"""Tests for eval_harness.py: lm-eval's harness on small local tasks (a task YAML reading a local JSONL file:
nothing from the network), its answers held against the model's own forward, eval_core's scoring and
sample.py's greedy decoding; the --n_passes sweep against separate runs; the command line and its errors."""
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
from data.loader import get_tokenizer  # noqa: E402
from test_sample import error_line, save_checkpoint  # noqa: E402

TOK = get_tokenizer("gpt2-4096")
EOT = TOK.eot_token
SMALL = dict(vocab_size=4096, eot_token=EOT, block_size=32, n_layer=4, n_embd=32, n_head=2, init="nanogpt")
LOOPED = dict(layout="smelt", n_passes=2, n_expert=4, top_k=2)  # trained with 2 passes
CHOICES = ["1", "2", "3", "cat"]  # one token each after the space lm-eval and eval_core put before them
TASKS = ["toy_mc", "toy_long", "toy_text", "toy_gen"]
MAX_GEN = 40  # more than a block of 32 tokens: generation goes on in windows


def make_model(**overrides):
    return model_whose_blocks_matter(**(SMALL | overrides))


def task_yaml(folder, name, output_type, body):
    """A task YAML reading folder/<name>.jsonl through HF datasets' json builder, cached inside folder."""
    (folder / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {folder / name}.jsonl\n"
        f"  cache_dir: {folder / 'hf_cache'}\ntest_split: test\noutput_type: {output_type}\n{body}")


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


MC_ITEMS = [{"query": q, "choices": CHOICES, "gold": i % 4} for i, q in enumerate(
    ["Q: one plus one is", "The cat sat on the", "Two and two make", "Count: 1, 2,", "ROMEO: My lady",
     "Numbers follow:", "What is three?", "A dog or a", "Say a number:", "First, second,", "JULIET: O",
     "The answer is"])]
LONG_CONTEXT = " ".join(["the king and the queen of the land"] * 6)  # more than block_size tokens
TEXTS = ["the king", "ROMEO: what light through yonder window breaks", " ".join(["a word or two"] * 30)]
PROMPTS = [f"Say {i}:" for i in range(4)]  # one length: generated in one batch


def write_tasks(folder):
    write_jsonl(folder / "toy_mc.jsonl", MC_ITEMS)
    task_yaml(folder, "toy_mc", "multiple_choice", 'doc_to_text: "{{query}}"\ndoc_to_choice: "{{choices}}"\n'
              'doc_to_target: "{{gold}}"\nmetric_list:\n  - metric: acc\n')
    write_jsonl(folder / "toy_long.jsonl", [{"context": LONG_CONTEXT[:n], "continuation": " of the land"}
                                            for n in (10, 120, 200, len(LONG_CONTEXT))])
    task_yaml(folder, "toy_long", "loglikelihood", 'doc_to_text: "{{context}}"\ndoc_to_target: "{{continuation}}"\n'
              'target_delimiter: ""\nmetric_list:\n  - metric: perplexity\n  - metric: acc\n')
    write_jsonl(folder / "toy_text.jsonl", [{"text": t} for t in TEXTS])
    task_yaml(folder, "toy_text", "loglikelihood_rolling", 'doc_to_text: ""\ndoc_to_target: "{{text}}"\n'
              'metric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n')
    write_jsonl(folder / "toy_gen.jsonl", [{"question": p, "answer": "1"} for p in PROMPTS])
    task_yaml(folder, "toy_gen", "generate_until", 'doc_to_text: "{{question}}"\ndoc_to_target: "{{answer}}"\n'
              f'generation_kwargs:\n  until: ["\\n\\n"]\n  max_gen_toks: {MAX_GEN}\n  do_sample: false\n'
              'metric_list:\n  - metric: exact_match\n')


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The looped model, its checkpoint, the task folder; the harness run as a sweep over 1 and 2 passes
    and alone at 2 passes (lm-eval's environment report, seconds of `pip list` per run, skipped)."""
    root = tmp_path_factory.mktemp("harness")
    tasks = root / "tasks"
    tasks.mkdir()
    write_tasks(tasks)
    model = make_model(**LOOPED)
    ckpt = save_checkpoint(model, root / "ckpt.pt")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setattr(lm_eval.evaluator, "add_env_info", lambda results: None)
        lm = eh.lm_class()(model, TOK, progress=False)
        options = dict(include_path=str(tasks), bootstrap_iters=0)
        sweep = eh.evaluate(lm, TASKS, [1, 2], **options)
        alone = eh.evaluate(lm, TASKS, [2], **options)[2]  # what the sweep's second run must equal
    return dict(root=root, tasks=str(tasks), model=model, ckpt=ckpt, sweep=sweep, alone=alone)


def samples(results, task):
    return sorted(results["samples"][task], key=lambda s: s["doc_id"])


def own_loglikelihood(model, context, continuation, n_passes):
    """log p(continuation | <|endoftext|> + context) from one forward of the model on that sequence alone,
    cut to its last block_size + 1 tokens; the continuation's tokens are those tokens(context + continuation)
    has beyond tokens(context) (lm-eval's split)."""
    whole = [EOT] + TOK.encode(context + continuation)
    n = len(whole) - 1 - len(TOK.encode(context))
    seq = whole[-(model.config.block_size + 1):]
    with torch.no_grad():
        logprobs = model(torch.tensor([seq[:-1]]), n_passes=n_passes)[0][0].log_softmax(-1)
    positions = range(len(seq) - 1 - n, len(seq) - 1)
    greedy = all(int(logprobs[p].argmax()) == seq[p + 1] for p in positions)
    return sum(float(logprobs[p, seq[p + 1]]) for p in positions), greedy


@pytest.mark.parametrize("k", [1, 2])
def test_loglikelihoods_equal_the_models_own_forward(setup, k):
    results = setup["sweep"][k]
    checked = 0
    for task in ("toy_mc", "toy_long"):
        for item in samples(results, task):
            for (context, continuation), [(logprob, greedy)] in zip(item["arguments"], item["resps"]):
                want, want_greedy = own_loglikelihood(setup["model"], context, continuation, k)
                assert logprob == pytest.approx(want, rel=1e-5, abs=1e-5), (task, context, continuation)
                assert greedy == want_greedy
                checked += 1
    assert checked == 4 * len(MC_ITEMS) + 4
    long_tokens = len(TOK.encode(LONG_CONTEXT))
    assert long_tokens > setup["model"].config.block_size  # the left cut was exercised


def test_multiple_choice_accuracy_equals_eval_core_scoring(setup):
    """The same items scored by eval_core (mean loss of each choice's span, the choice here being one token)
    pick what lm-eval's acc picks; at the trained passes both read the same forward."""
    model = setup["model"]
    examples = [eval_core.build_example(item, "multiple_choice", " ", TOK, max_len=model.config.block_size)
                for item in MC_ITEMS]
    scored = eval_core.score_examples(model, examples, "multiple_choice", EOT)
    harness = setup["sweep"][2]
    for item, result in zip(samples(harness, "toy_mc"), scored):
        losses = [-logprob for [(logprob, _)] in item["resps"]]
        assert losses == pytest.approx(result["mean_losses"], rel=1e-5, abs=1e-5)
    accuracy = sum(r["correct"] for r in scored) / len(scored)
    assert harness["results"]["toy_mc"]["acc,none"] == pytest.approx(accuracy, abs=1e-12)


def own_rolling(model, text, n_passes):
    """Sum of log p(token | the document before it) over windows of block_size predictions, each window read
    as the block_size inputs that end at its last target (the first window's after <|endoftext|>)."""
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


def test_rolling_loglikelihood_equals_the_models_own_token_logprobs(setup):
    block = setup["model"].config.block_size
    assert len(TOK.encode(TEXTS[-1])) > 2 * block  # three windows, the last one partly overlapping
    for k in (1, 2):
        for item, text in zip(samples(setup["sweep"][k], "toy_text"), TEXTS):
            assert item["resps"][0][0] == pytest.approx(own_rolling(setup["model"], text, k), rel=1e-5)


def test_generation_equals_sample_py_greedy_decoding(setup):
    until = ["\n\n", "<|endoftext|>"]
    ids = torch.tensor([[EOT] + TOK.encode(prompt) for prompt in PROMPTS])  # one length: one batch
    for k in (1, 2):
        greedy = sample.generate_windowed(setup["model"], ids, MAX_GEN, temperature=0, n_passes=k)
        for item, new in zip(samples(setup["sweep"][k], "toy_gen"), greedy.tolist()):
            text = TOK.decode(new)
            for stop in until:
                text = text.split(stop)[0]
            assert item["resps"][0][0] == text
    outputs = {k: [s["resps"][0][0] for s in samples(setup["sweep"][k], "toy_gen")] for k in (1, 2)}
    assert outputs[1] != outputs[2]


def test_greedy_until_stops_at_the_first_stop_string():
    model = make_model(**LOOPED)
    prompt = [EOT] + TOK.encode("Say 0:")
    full = sample.generate_windowed(model, torch.tensor([prompt]), 12, temperature=0)[0].tolist()
    stop = TOK.decode(full[:3])  # first in the text once the third new token is there
    (text,) = eh.greedy_until(model, TOK, [prompt], ("never", stop), 12)
    assert text == stop
    (text,) = eh.greedy_until(model, TOK, [prompt], (), 12)
    assert text == TOK.decode(full)


def test_a_sweep_equals_separate_runs(setup):
    sweep, alone = setup["sweep"][2], setup["alone"]  # K = 2 after K = 1 ran, and alone
    assert sweep["results"] == alone["results"]
    for task in TASKS:
        assert [s["resps"] for s in samples(sweep, task)] == [s["resps"] for s in samples(alone, task)]
    assert [setup["sweep"][k]["config"]["n_passes"] for k in (1, 2)] == [1, 2]
    one, two = (setup["sweep"][k]["results"]["toy_text"]["bits_per_byte,none"] for k in (1, 2))
    assert math.isfinite(one) and one != two  # the passes change the answers: a sweep that ran K once would show
    table = eh.sweep_table(setup["sweep"])
    assert "| n_passes=1 | n_passes=2 |" in table and "| toy_mc | acc ↑ |" in table
    assert f"{setup['sweep'][2]['results']['toy_mc']['acc,none']:.4f}" in table.split("toy_mc")[1].splitlines()[0]


def test_lm_evals_own_model_arguments_build_it(setup, monkeypatch):
    """simple_evaluate(model="loopstudy", model_args=...) as lm-eval's registry builds models."""
    monkeypatch.setattr(lm_eval.evaluator, "add_env_info", lambda results: None)
    eh.lm_class()
    results = lm_eval.simple_evaluate(model="loopstudy", model_args=f"ckpt={setup['ckpt']},n_passes=1,progress=False",
                                      tasks=["toy_mc"], task_manager=eh.task_manager(["toy_mc"], setup["tasks"]),
                                      bootstrap_iters=0, batch_size=3)
    assert results["results"]["toy_mc"] == setup["sweep"][1]["results"]["toy_mc"]
    assert results["config"]["n_passes"] == 1 and results["config"]["model_source"] == setup["ckpt"]


def test_cli_prints_lm_evals_table_and_writes_its_json(setup, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(lm_eval.evaluator, "add_env_info", lambda results: None)
    out = tmp_path / "results.json"
    assert eh.main(["--ckpt", setup["ckpt"], "--tasks", "toy_mc", "--include_path", setup["tasks"], "--limit", "4",
                    "--bootstrap_iters", "0", "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "|toy_mc|" in printed.replace(" ", "") and "Metric" in printed
    results = json.loads(out.read_text())
    first4 = [s for s in samples(setup["sweep"][2], "toy_mc") if s["doc_id"] < 4]
    want = sum(max(range(4), key=lambda c: s["resps"][c][0][0]) == s["target"] for s in first4) / 4
    assert results["results"]["toy_mc"]["acc,none"] == pytest.approx(want)
    assert results["config"]["n_passes"] == 2 and results["config"]["limit"] == 4 and "samples" not in results


def test_cli_sweep_prints_one_table_and_writes_every_run(setup, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(lm_eval.evaluator, "add_env_info", lambda results: None)
    out = tmp_path / "sweep.json"
    argv = ["--ckpt", setup["ckpt"], "--tasks", "toy_mc", "--include_path", setup["tasks"], "--limit", "4",
            "--n_passes", "1,2", "--bootstrap_iters", "0", "--output", str(out), "--log_samples"]
    assert eh.main(argv) == 0
    printed = capsys.readouterr().out
    assert printed.count("| Tasks |") == 1 and "| n_passes=1 | n_passes=2 |" in printed
    written = json.loads(out.read_text())
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
                         (ok[:2] + ["--tasks", "toy_mc,nope", "--include_path", setup["tasks"]],
                          "--tasks: unknown task 'nope'")]:
        assert needle in error_line(eh.main, argv, capsys, "eval_harness.py"), argv
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # what `import lm_eval` meets without the package
    assert "pip install -r requirements-eval.txt" in error_line(eh.main, ok, capsys, "eval_harness.py")
