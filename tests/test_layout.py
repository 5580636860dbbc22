"""The layout a learner reads: the ideas at the top level, the tooling beside them, arrows one way, no
import cycles, files and functions a reader can take in, and model.py pure PyTorch."""
import ast
import glob
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LEARNER_FILES = ("model.py", "train.py", "muon.py", "grow.py")


def sources():
    """{module name: path} of every project module (not tests, not bench scripts)."""
    paths = glob.glob(os.path.join(REPO, "*.py")) + glob.glob(os.path.join(REPO, "*", "*.py"))
    out = {}
    for path in paths:
        rel = os.path.relpath(path, REPO)
        if rel.split(os.sep)[0] in ("tests", "bench", "config", "docs"):
            continue
        name = rel[:-3].replace(os.sep, ".")
        out[name[:-len(".__init__")] if name.endswith(".__init__") else name] = path
    return out


def script_block(node):
    """`if __name__ == "__main__":` at module level: it runs only when the file is the script, whose module
    is then __main__, not the file's name, so its imports are no edge of the import graph."""
    test = node.test if isinstance(node, ast.If) else None
    return isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == "__name__" \
        and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in test.comparators)


def imports(path, modules):
    """The project modules a file imports, anywhere in it (lazy imports inside functions included)."""
    found = set()
    tree = ast.parse(open(path).read())
    tree.body = [node for node in tree.body if not script_block(node)]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        found |= {n for n in names if n in modules}
    return found


def graph():
    modules = sources()
    return {name: imports(path, modules) - {name} for name, path in modules.items()}


def test_no_import_cycles():
    edges, state, stack = graph(), {}, []

    def visit(node):  # depth-first; a grey node met again closes a cycle
        state[node] = "grey"
        stack.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == "grey":
                cycle = stack[stack.index(nxt):] + [nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "black"

    for node in sorted(edges):
        if node not in state:
            visit(node)


def test_tooling_imports_only_the_sources_of_truth_below_it():
    edges = graph()
    for name, deps in edges.items():
        if name.startswith("tooling"):
            outside = {d for d in deps if not d.startswith("tooling") and d not in ("model", "match")}
            assert not outside, f"{name} imports {sorted(outside)}: tooling imports model.py, match.py and itself only"
    for below in ("model", "match"):  # and nothing below tooling imports back into it
        assert not {d for d in edges[below] if d.startswith("tooling")}, f"{below} imports tooling"


def test_no_import_cycles_between_packages():
    """The same graph with each package one node (tooling, data, kernels, ladders; a top-level file is its own)."""
    edges = {}
    for name, deps in graph().items():
        package = name.split(".")[0]
        edges.setdefault(package, set()).update(d.split(".")[0] for d in deps)
    for package in edges:
        edges[package].discard(package)
    reach = {p: set(e) for p, e in edges.items()}
    for _ in range(len(reach)):  # transitive closure
        for p in reach:
            reach[p] |= set().union(*(reach.get(q, set()) for q in reach[p]))
    cycles = sorted(p for p in reach if p in reach[p])
    assert not cycles, f"packages that import themselves through others: {cycles}"


def test_kernels_and_the_copyable_files_import_nothing_of_the_project():
    edges = graph()
    for name, deps in edges.items():
        if name.startswith("kernels"):
            assert {d for d in deps if not d.startswith("kernels")} == set(), name
    assert edges["model"] == set() and edges["muon"] == set()


def test_model_py_is_pure_pytorch():
    """No kernel switch inside the model: the Triton kernels come in from outside (kernels.apply)."""
    path = os.path.join(REPO, "model.py")
    assert "use_triton" not in open(path).read()
    modules = {n.split(".")[0] for node in ast.walk(ast.parse(open(path).read()))
               for n in ([a.name for a in node.names] if isinstance(node, ast.Import) else
                         [node.module or ""] if isinstance(node, ast.ImportFrom) else [])}
    assert modules <= {"math", "dataclasses", "typing", "torch"}, modules


def functions(path):
    tree = ast.parse(open(path).read())
    return [(n.name, n.end_lineno - n.lineno + 1) for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def test_files_and_functions_a_reader_can_take_in():
    """One concern per file: at most 600 non-blank lines (model.py, the one model file, 700); functions of at
    most 100 lines (80 in the learner's files; train(), the loop written as commented paragraphs, 110); lines
    of at most 120 characters (train.py, read top to bottom, 100)."""
    train_lines = [line for line in open(os.path.join(REPO, "train.py")) if line.strip()]
    assert len(train_lines) <= 480, f"train.py has {len(train_lines)} non-blank lines (at most 480)"
    for name, path in sources().items():
        rel = os.path.relpath(path, REPO)
        size, lines = 700 if rel == "model.py" else 600, open(path).read().splitlines()
        assert sum(bool(line.strip()) for line in lines) <= size, f"{rel}: more than {size} non-blank lines"
        width = 100 if rel == "train.py" else 120
        wide = [i + 1 for i, line in enumerate(lines) if len(line) > width]
        assert not wide, f"{rel}: lines longer than {width} characters: {wide[:10]}"
        limit = 80 if os.path.basename(path) in LEARNER_FILES and os.path.dirname(path) == REPO else 100
        long = [(fn, n) for fn, n in functions(path) if n > (110 if (rel, fn) == ("train.py", "train") else limit)]
        assert not long, f"{rel}: functions longer than {limit} lines: {long}"


def test_readme_is_short():
    lines = open(os.path.join(REPO, "README.md")).read().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines (at most 300; long sections go to docs/)"
