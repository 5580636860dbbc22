"""Seeded Dyck-language eval items (BIG-bench `dyck_languages`) in the DCLM / llm-foundry format, scored
by log p(continuation | context); tests/data/core_bundle/make_bundle.py draws its items here. An item is
a prefix of a balanced word with at least min_open brackets open; its continuation is the shortest
completion. The boundary space goes into the continuation (the default: "( [ { }" + " ] )" tokenizes
as the joined text does), the context, or nowhere ("none": BIG-bench's; its evaluator joins with " ").

    dyck_items(2, seed=0)  -> [{"context": "[ ] { } [", "continuation": " ]"}, ...]"""
import itertools
import random

BRACKETS = [("(", ")"), ("[", "]"), ("{", "}"), ("<", ">")]
BIGBENCH_DYCK_PROMPT = ("Complete the rest of the sequence, making sure that the parentheses are closed "
                        "properly. Input: ")


def dyck_word(rng, n_types=3, max_depth=6, length=20):
    """A random balanced word: `length` (even) brackets of n_types kinds, nested at most max_depth deep."""
    word, stack = [], []
    for step in range(length):
        must_close = len(stack) == length - step or len(stack) == max_depth
        if stack and (must_close or rng.random() < 0.5):
            word.append(BRACKETS[stack.pop()][1])
        else:
            stack.append(rng.randrange(n_types))
            word.append(BRACKETS[stack[-1]][0])
    return word


def closing_sequence(prefix):
    """The brackets closing `prefix` (a list or a space-separated str); None if it is no Dyck prefix."""
    opening, stack = dict(BRACKETS), []
    for t in prefix.split() if isinstance(prefix, str) else prefix:
        if t in opening:
            stack.append(opening[t])
        elif not stack or stack.pop() != t:
            return None
    return stack[::-1]


def dyck_items(n, seed, n_types=3, max_depth=6, min_length=4, max_length=20, min_open=1, prompt="",
               boundary="continuation"):
    """n items: a prefix of a random Dyck word with >= min_open brackets open, and its closing sequence."""
    space = {"continuation": ("", " "), "context": (" ", ""), "none": ("", "")}[boundary]
    rng = random.Random(seed)
    lengths = list(range(min_length + min_length % 2, max_length + 1, 2))
    items = []
    while len(items) < n:
        word = dyck_word(rng, n_types, max_depth, rng.choice(lengths))
        # the depth after each bracket; a word that never nests min_open deep is redrawn
        depths = itertools.accumulate(1 if t in "([{<" else -1 for t in word[:-1])
        cuts = [i for i, depth in enumerate(depths, 1) if depth >= min_open]
        if cuts:
            prefix = word[:rng.choice(cuts)]
            items.append({"context": prompt + " ".join(prefix) + space[0],
                          "continuation": space[1] + " ".join(closing_sequence(prefix))})
    return items
