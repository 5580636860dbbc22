"""
Synthetic structured tasks, as seeded generators of eval items {"context", "continuation"} (score
log p(continuation | context), the DCLM / llm-foundry format) and of training documents: Dyck languages
(balanced brackets, nesting up to max_depth), a+b= arithmetic, copying.

    dyck_items(2, seed=0)  -> [{"context": "[ ] { } [", "continuation": " ]"}, ...]

A Dyck item (BIG-bench `dyck_languages`) is a prefix of a balanced word with at least min_open brackets
still open; its continuation is the shortest completion. Where the boundary space goes:
  boundary="continuation" (default)  "( [ { }" + " ] )"  tokens(context) + tokens(continuation) ==
                                     tokens(context + continuation) under GPT-2 BPE, as in training text
  boundary="context"                 "( [ { } " + "] )"
  boundary="none"                    "( [ { }" + "] )"   BIG-bench's; its evaluator joins with " "
"""
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
    """The shortest list of brackets closing `prefix` (a list or a space-separated str); None if a bracket in
    it closes nothing open or a token is not a bracket."""
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
        depths = itertools.accumulate(1 if t in "([{<" else -1 for t in word[:-1])  # after each bracket
        cuts = [i for i, depth in enumerate(depths, 1) if depth >= min_open]
        if cuts:  # else this word never nests min_open deep: draw another
            prefix = word[:rng.choice(cuts)]
            items.append({"context": prompt + " ".join(prefix) + space[0],
                          "continuation": space[1] + " ".join(closing_sequence(prefix))})
    return items


def dyck_corpus_text(n_docs, seed, n_types=3, max_depth=6, min_length=2, max_length=40, words_per_doc=16):
    """n_docs training documents of words_per_doc random Dyck words, one per line."""
    rng = random.Random(seed)
    lengths = list(range(min_length + min_length % 2, max_length + 1, 2))
    word = lambda: " ".join(dyck_word(rng, n_types, max_depth, rng.choice(lengths)))
    return ["\n".join(word() for _ in range(words_per_doc)) for _ in range(n_docs)]


def arithmetic_items(n, seed, n_digits=2, op="+"):
    """n items {"context": "12+34=", "continuation": "46"}, operands of up to n_digits digits (op + - *)."""
    rng = random.Random(seed)
    apply = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}[op]
    pairs = [(rng.randrange(10 ** n_digits), rng.randrange(10 ** n_digits)) for _ in range(n)]
    return [{"context": f"{a}{op}{b}=", "continuation": str(apply(a, b))} for a, b in pairs]


def copy_items(n, seed, min_length=3, max_length=8, alphabet="abcdefghij"):
    """n items {"context": "copy a c b :", "continuation": " a c b"}: repeat the symbols after the colon."""
    rng = random.Random(seed)
    items = []
    for _ in range(n):
        symbols = " ".join(rng.choice(alphabet) for _ in range(rng.randint(min_length, max_length)))
        items.append({"context": f"copy {symbols} :", "continuation": f" {symbols}"})
    return items
