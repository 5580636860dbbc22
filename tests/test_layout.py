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


def imports(path, modules):
    """The project modules a file imports, anywhere in it (lazy imports inside functions included)."""
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
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
    for name, deps in graph().items():
        if name.startswith("tooling"):
            outside = {d for d in deps if not d.startswith("tooling") and d not in ("model", "match")}
            assert not outside, f"{name} imports {sorted(outside)}: tooling imports model.py, match.py and itself only"


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
    train_lines = [line for line in open(os.path.join(REPO, "train.py")) if line.strip()]
    assert len(train_lines) <= 450, f"train.py has {len(train_lines)} non-blank lines (at most 450)"
    for name, path in sources().items():
        limit = 80 if os.path.basename(path) in LEARNER_FILES and os.path.dirname(path) == REPO else 100
        long = [(fn, n) for fn, n in functions(path) if n > limit]
        assert not long, f"{os.path.relpath(path, REPO)}: functions longer than {limit} lines: {long}"


def test_readme_is_short():
    lines = open(os.path.join(REPO, "README.md")).read().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines (at most 300; long sections go to docs/)"
