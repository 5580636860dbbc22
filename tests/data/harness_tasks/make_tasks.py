"""
Writes the two small local lm-eval tasks the docs and README run (deterministic), from the validation split
of the embedded corpus (data/cache/default, prepared on first use):

    shakespeare_cloze  multiple choice: three lines of a held-out play, then the real next line or one of
                       3 random lines of 30-90 characters of the held-out plays (200 items, chance 0.25)
    shakespeare_val    two held-out documents, read whole (rolling log-likelihood: bits per byte, perplexity)

Run from the repository root (the YAMLs name their data files relative to it):

    python tests/data/harness_tasks/make_tasks.py
"""
import json
import os
import random
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(HERE))))
from data.loader import get_tokenizer, load_data  # noqa: E402
from eval_core import split_documents  # noqa: E402

YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: tests/data/harness_tasks/{name}.jsonl   # relative to the repository root: run from there
test_split: test
output_type: {output_type}
{body}"""


def main():
    data = load_data("")
    tok = get_tokenizer(data.meta["tokenizer"])
    docs = [tok.decode(data.val[a:b].tolist()) for a, b in split_documents(data.val, tok.eot_token)]
    lines = [[line for line in doc.split("\n") if line.strip()] for doc in docs]
    pool = [line for doc in lines for line in doc if 30 <= len(line) <= 90]
    rng, items = random.Random(0), []
    while len(items) < 200:
        doc = rng.choice(lines)
        i = rng.randrange(3, len(doc))
        if not 30 <= len(doc[i]) <= 90:
            continue
        wrong, gold = rng.sample([line for line in pool if line != doc[i]], 3), rng.randrange(4)
        items.append({"context": "\n".join(doc[i - 3:i]) + "\n", "choices": wrong[:gold] + [doc[i]] + wrong[gold:],
                      "gold": gold})
    tasks = {"shakespeare_cloze": (items, "multiple_choice", 'doc_to_text: "{{context}}"\ndoc_to_choice: '
                                   '"{{choices}}"\ndoc_to_target: "{{gold}}"\ntarget_delimiter: ""\nmetric_list:\n'
                                   "  - metric: acc\n  - metric: acc_norm\n"),
             "shakespeare_val": ([{"text": doc} for doc in docs[:2]], "loglikelihood_rolling",
                                 'doc_to_text: ""\ndoc_to_target: "{{text}}"\nmetric_list:\n  - metric: '
                                 "word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n")}
    for name, (records, output_type, body) in tasks.items():
        with open(os.path.join(HERE, f"{name}.jsonl"), "w") as f:
            f.write("".join(json.dumps(r) + "\n" for r in records))
        with open(os.path.join(HERE, f"{name}.yaml"), "w") as f:
            f.write(YAML.format(name=name, output_type=output_type, body=body))
    print(f"wrote {', '.join(tasks)} to {HERE}")


if __name__ == "__main__":
    main()
