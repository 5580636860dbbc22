"""
Synthetic structured tasks: Dyck languages (balanced brackets), a+b= arithmetic and copying.
Each task has a seeded generator of eval items {"context": str, "continuation": str} (the
language-modelling format of DCLM / llm-foundry eval bundles: score log p(continuation | context))
and a generator of training documents to mix into a corpus.

    dyck_items(2, seed=0)  -> [{"context": "[ ] { } [", "continuation": " ]"},
                               {"context": "( { } [ ] ( [ ] (", "continuation": " ) ) )"}]
    dyck_corpus_text(2, seed=0) -> ["[ ] { } [ [ ( [ ] ) ... ]\\n( ) [ { ...", ...]   (one Dyck word per line)

Dyck items follow BIG-bench `dyck_languages`: the context is a prefix of a balanced word with at least
one bracket still open; the continuation is the unique shortest completion (the open brackets closed
in reverse order). Brackets are separated by single spaces. Where that boundary space goes:
  boundary="continuation" (default)  "( [ { }" + " ] )"   context + continuation == the balanced word,
                                     and GPT-2 BPE tokenizes it as in training text (" ]" is one token):
                                     tokens(context) + tokens(continuation) == tokens(context + continuation)
  boundary="context"                 "( [ { } " + "] )"    a lone " " token the model never saw in training
  boundary="none"                    "( [ { }" + "] )"    BIG-bench; the evaluator joins with " "
Generators use random.Random(seed): same items for the same arguments on every machine.
"""
import argparse
import os
import random
import sys

if __package__ in (None, ""):  # run as a script: python data/synthetic.py
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tooling.common import cli_error

BRACKETS = [("(", ")"), ("[", "]"), ("{", "}"), ("<", ">")]
BIGBENCH_DYCK_PROMPT = ("Complete the rest of the sequence, making sure that the parentheses are closed properly. "
                        "Input: ")


# -----------------------------------------------------------------------------
# Dyck languages

def dyck_word(rng, n_types=3, max_depth=6, length=20):
    """A random balanced bracket word: a list of `length` (even) bracket strings, nesting <= max_depth."""
    if not 1 <= n_types <= len(BRACKETS):
        raise ValueError(f"n_types must be in 1..{len(BRACKETS)}, got {n_types}")
    if length <= 0 or length % 2:
        raise ValueError(f"length must be a positive even number, got {length}")
    if max_depth < 1:
        raise ValueError(f"max_depth must be >= 1, got {max_depth}")
    word, stack = [], []
    for step in range(length):
        remaining = length - step  # len(stack) and remaining always have the same parity
        must_close = len(stack) == remaining or len(stack) == max_depth
        if stack and (must_close or rng.random() < 0.5):
            word.append(BRACKETS[stack.pop()][1])
        else:
            stack.append(rng.randrange(n_types))
            word.append(BRACKETS[stack[-1]][0])
    return word


def closing_sequence(prefix):
    """The shortest list of brackets closing `prefix` (list or space-separated str); ValueError if it cannot."""
    tokens = prefix.split() if isinstance(prefix, str) else list(prefix)
    opening = {o: c for o, c in BRACKETS}
    closing = {c for _, c in BRACKETS}
    stack = []
    for i, t in enumerate(tokens):
        if t in opening:
            stack.append(opening[t])
        elif t in closing:
            if not stack or stack.pop() != t:
                raise ValueError(f"bracket {i} ({t!r}) closes nothing open in {' '.join(tokens)!r}")
        else:
            raise ValueError(f"token {i} ({t!r}) is not a bracket")
    return stack[::-1]


def is_balanced(word):
    """True when `word` (list or space-separated str) is a complete Dyck word."""
    try:
        return closing_sequence(word) == []
    except ValueError:
        return False


def dyck_items(n, seed, n_types=3, max_depth=6, min_length=4, max_length=20, min_open=1, prompt="",
               boundary="continuation"):
    """n items {context, continuation}: a prefix of a random Dyck word with >= min_open brackets open,
    and its closing sequence (so the continuation has >= min_open brackets)."""
    if boundary not in ("continuation", "context", "none"):
        raise ValueError(f"boundary must be 'continuation', 'context' or 'none', got {boundary!r}")
    if max_depth < 1:
        raise ValueError(f"max_depth must be >= 1, got {max_depth}")
    if min_length < 2 or min_length > max_length:
        raise ValueError(f"need 2 <= min_length <= max_length, got {min_length}, {max_length}")
    if not 1 <= min_open <= min(max_depth, max_length // 2):
        raise ValueError(f"min_open must be in 1..min(max_depth, max_length // 2), got {min_open}")
    rng = random.Random(seed)
    lengths = list(range(min_length + min_length % 2, max_length + 1, 2))
    items = []
    while len(items) < n:
        word = dyck_word(rng, n_types, max_depth, rng.choice(lengths))
        depth, cuts = 0, []
        for i, t in enumerate(word[:-1]):
            depth += 1 if t in "([{<" else -1
            if depth >= min_open:
                cuts.append(i + 1)
        if not cuts:
            continue  # this word never nests min_open deep: draw another
        prefix = word[:rng.choice(cuts)]
        context, continuation = " ".join(prefix), " ".join(closing_sequence(prefix))
        if boundary == "continuation":
            continuation = " " + continuation
        elif boundary == "context":
            context = context + " "
        items.append({"context": prompt + context, "continuation": continuation})
    return items


def dyck_corpus_text(n_docs, seed, n_types=3, max_depth=6, min_length=2, max_length=40, words_per_doc=16):
    """n_docs training documents, each `words_per_doc` random Dyck words, one per line."""
    rng = random.Random(seed)
    lengths = list(range(min_length + min_length % 2, max_length + 1, 2))
    return ["\n".join(" ".join(dyck_word(rng, n_types, max_depth, rng.choice(lengths))) for _ in range(words_per_doc))
            for _ in range(n_docs)]


# -----------------------------------------------------------------------------
# arithmetic: "a+b=" -> "c"

def arithmetic_items(n, seed, n_digits=2, op="+"):
    """n items {"context": "12+34=", "continuation": "46"} with operands of up to n_digits digits."""
    if op not in ("+", "-", "*"):
        raise ValueError(f"op must be '+', '-' or '*', got {op!r}")
    rng = random.Random(seed)
    items = []
    for _ in range(n):
        a, b = rng.randrange(10 ** n_digits), rng.randrange(10 ** n_digits)
        result = a + b if op == "+" else a - b if op == "-" else a * b
        items.append({"context": f"{a}{op}{b}=", "continuation": str(result)})
    return items


def arithmetic_corpus_text(n_docs, seed, n_digits=2, op="+", lines_per_doc=32):
    """n_docs documents of `lines_per_doc` lines 'a+b=c'."""
    rng = random.Random(seed)
    docs = (arithmetic_items(lines_per_doc, rng.random(), n_digits, op) for _ in range(n_docs))
    return ["\n".join(i["context"] + i["continuation"] for i in items) for items in docs]


# -----------------------------------------------------------------------------
# copy: "copy a c b :" -> " a c b"

def copy_items(n, seed, min_length=3, max_length=8, alphabet="abcdefghij"):
    """n items {"context": "copy a c b :", "continuation": " a c b"}: repeat the symbols after the colon."""
    rng = random.Random(seed)
    items = []
    for _ in range(n):
        symbols = " ".join(rng.choice(alphabet) for _ in range(rng.randint(min_length, max_length)))
        items.append({"context": f"copy {symbols} :", "continuation": f" {symbols}"})
    return items


def main(argv=None):
    parser = argparse.ArgumentParser(description="Print a few items of each synthetic task and one Dyck training "
                                                 "document.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--n_types", type=int, default=3, help=f"Dyck bracket types, 1..{len(BRACKETS)}")
    parser.add_argument("--max_depth", type=int, default=6, help="Dyck nesting depth, >= 1")
    args = parser.parse_args(argv)
    try:
        items = dyck_items(3, args.seed, args.n_types, args.max_depth) + arithmetic_items(2, args.seed) \
            + copy_items(2, args.seed)
        document = dyck_corpus_text(1, args.seed, args.n_types, args.max_depth, words_per_doc=4)[0]
    except ValueError as e:
        return cli_error("synthetic.py", e)
    for item in items:
        print(repr(item["context"]), "->", repr(item["continuation"]))
    print(document)
    return 0


if __name__ == "__main__":
    sys.exit(main())
