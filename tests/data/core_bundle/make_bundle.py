"""
Writes this tiny self-made CORE bundle (same layout as the public DCLM/nanochat eval bundle).
Deterministic: rerunning rewrites identical files. Run from the repo root:

    python tests/data/core_bundle/make_bundle.py

The Dyck items come from the tests' generator synthetic_tasks.dyck_items (BIG-bench format,
boundary="none": the evaluator's " " delimiter joins context and continuation); --local uses the small
stand-alone generator below instead.
"""
import argparse
import json
import os
import random
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
DYCK_PROMPT = "Complete the rest of the sequence, making sure that the parentheses are closed properly. Input:"
PAIRS = {"(": ")", "[": "]", "{": "}", "<": ">"}


def local_dyck_items(n, seed, max_open=4, max_len=10):
    """BIG-bench-style Dyck completion: a prefix with open brackets; the continuation closes them."""
    rng = random.Random(seed)
    items = []
    while len(items) < n:
        stack, seq = [], []
        length = rng.randint(3, max_len)
        while len(seq) < length:
            if stack and (len(stack) >= max_open or rng.random() < 0.4):
                seq.append(PAIRS[stack.pop()])
            else:
                b = rng.choice(sorted(PAIRS))
                stack.append(b)
                seq.append(b)
        if not stack:
            continue
        items.append({"context": f"{DYCK_PROMPT} {' '.join(seq)}",
                      "continuation": " ".join(PAIRS[b] for b in reversed(stack))})
    return items


def arith_mc_items():
    """4-way multiple choice; gold positions balanced (each index twice) so 'always choice 0' scores 25%."""
    rows = []
    problems = [(2, 3), (4, 1), (3, 3), (5, 2), (6, 1), (2, 2), (7, 1), (1, 8)]
    for i, (a, b) in enumerate(problems):
        ans = a + b
        wrong = [ans + 1, ans - 1, ans + 2]
        gold = i % 4
        choices = wrong[:gold] + [ans] + wrong[gold:]
        rows.append({"query": f"Question: What is {a} plus {b}?\nAnswer:", "choices": [str(c) for c in choices],
                     "gold": gold})
    return rows


def winograd_items():
    """Schema items (two contexts, shared continuation); gold alternates so the 50% baseline is exact."""
    base = [
        ("The trophy did not fit in the suitcase because the {} was too big.", "trophy", "suitcase"),
        ("The cup fell off the table because the {} was too close to the edge.", "cup", "table"),
        ("The man could not lift his son because the {} was so heavy.", "son", "man"),
        ("The ball broke the window because the {} was made of glass.", "window", "ball"),
        ("The dog chased the cat because the {} was hungry.", "dog", "cat"),
        ("The river flooded the town because the {} was swollen with rain.", "river", "town"),
        ("The branch fell on the car because the {} was rotten.", "branch", "car"),
        ("The bird could not reach the seed because the {} was too small.", "bird", "seed"),
    ]
    rows = []
    for i, (template, right, wrong) in enumerate(base):
        head, tail = template.split("{}")
        options = [head + right, head + wrong]
        gold = i % 2
        if gold == 1:
            options.reverse()
        rows.append({"context_options": options, "continuation": tail.strip(), "gold": gold})
    return rows


def copy_items():
    words = ["apple", "river", "stone", "cloud", "tiger", "lemon", "piano", "candle"]
    return [{"context": f"Repeat the word three times: {w}", "continuation": " ".join([w] * 3)} for w in words]


TASKS = [  # label, category dir, file, type, shots, delimiter, random baseline, rows
    ("toy_arith_mc", "symbolic_problem_solving", "toy_arith_mc.jsonl", "multiple_choice", 3, " ", 25.0),
    ("toy_winograd", "language_understanding", "toy_winograd.jsonl", "schema", 0, " ", 50.0),
    ("dyck_mini", "symbolic_problem_solving", "dyck_mini.jsonl", "language_modeling", 3, " ", 0.0),
    ("copy_mini", "symbolic_problem_solving", "copy_mini.jsonl", "language_modeling", 2, "\\nOutput: ", 0.0),
]


def write_atomic(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8", newline="") as f:
        f.write(text)
    os.replace(tmp, path)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--local", action="store_true", help="stand-alone Dyck generator instead of synthetic_tasks")
    args = p.parse_args()
    if args.local:
        dyck = local_dyck_items(16, seed=0)
    else:
        sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # tests/
        from synthetic_tasks import BIGBENCH_DYCK_PROMPT, dyck_items
        dyck = dyck_items(16, seed=0, n_types=4, max_depth=4, max_length=12, prompt=BIGBENCH_DYCK_PROMPT,
                          boundary="none")
    rows = {"toy_arith_mc": arith_mc_items(), "toy_winograd": winograd_items(), "dyck_mini": dyck,
            "copy_mini": copy_items()}
    yaml_lines = ["# self-made tiny CORE bundle for tests and the README demo (see README.md); same format as",
                  "# the public eval bundle's core.yaml", "icl_tasks:"]
    for label, cat, fname, ttype, shots, delim, rb in TASKS:
        write_atomic(os.path.join(HERE, "eval_data", cat, fname),
                     "".join(json.dumps(r) + "\n" for r in rows[label]))
        yaml_lines += ["-", f"  label: {label}", f"  dataset_uri: {cat}/{fname}", f"  num_fewshot: [{shots}]",
                       f"  icl_task_type: {ttype}", f"  continuation_delimiter: \"{delim}\""]
    write_atomic(os.path.join(HERE, "core.yaml"), "\n".join(yaml_lines) + "\n")
    header = ["Eval Task", "Task Category", "Task Type", "#shots", "#datapoints", "Random baseline",
              "Centered Metric?", "Description"]
    lines = [",".join(header)]
    for label, cat, fname, ttype, shots, delim, rb in TASKS:
        lines.append(",".join([label, cat, ttype, str(shots), str(len(rows[label])), str(rb), "Yes",
                               f"self-made {ttype} task"]))
    write_atomic(os.path.join(HERE, "eval_meta_data.csv"), "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
