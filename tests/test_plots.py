# plots.py: every figure is written (PNG) or, without matplotlib, one line and no file;
# a run's curves from its log.jsonl (`python plots.py LOG`) and its one-line errors.
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import fit
import synthetic_runs
import plots

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def eval_lines(n=5, sources=("comedy", "history")):
    """What train.py writes: one JSON object per eval; train_loss null at step 0."""
    lines = []
    for i in range(n):
        line = dict(step=10 * i, tokens=20480 * i, flops=1.1e14 * i, lr=1e-3, train_loss=None if i == 0 else 6 - i / 2,
                    val_loss=6.1 - 0.45 * i)
        if sources:
            line["val_loss_by_source"] = {s: line["val_loss"] + 0.1 * k for k, s in enumerate(sources)}
        lines.append(line)
    return lines


def write_log(path, lines):
    path.write_text("".join(json.dumps(x) + "\n" for x in lines) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def plot_calls():
    """name -> call(path) for each plot function, on real fits of the synthetic runs."""
    runs = {}
    for seed in (0, 1):  # two seeds: repeated points at every budget
        cols = synthetic_runs.synthetic_power_runs(seed=seed)
        for a in dict.fromkeys(cols["arch"].tolist()):
            m = cols["arch"] == a
            C, L = runs.get(a, ((), ()))
            runs[a] = (np.concatenate([C, cols["C"][m]]), np.concatenate([L, cols["loss"][m]]))
    fits = fit.fit_power_laws(runs, "vanilla")
    ref_C = runs["vanilla"][0]
    mult = {a: fit.compute_multiplier(*runs["vanilla"], *runs[a]) for a in runs}  # nan outside the range
    bands = {a: (0.95 * m, 1.05 * m) for a, m in mult.items()}
    surfaces = {a: fit.SurfaceFit(**c) for a, c in synthetic_runs.SYNTHETIC_SURFACES.items()}
    sparsities = [0.85, 0.95]
    curves = {f"{arch} L4w32-e16 b{b}": (list(range(b, 60)), [3 + 5 / (1 + x / 10) for x in range(b, 60)])
              for arch in ("baseline", "smelt") for b in (10, 20, 40)}
    contrasts = [("gain (nats)", [("a", 0.02, 0.01, 0.03), ("b", -0.01, -0.02, 0.005)]),
                 ("effect (nats)", [("c", -0.03, -0.05, -0.01)])]
    return {
        "loss_vs_compute": lambda p: plots.plot_loss_vs_compute(runs, fits, p),
        "multipliers": lambda p: plots.plot_multipliers(ref_C, mult, p, bands=bands, ref="vanilla", title="m"),
        "power_laws": lambda p: plots.plot_power_laws(runs, fits, mult, "vanilla", p),
        "loss_curves": lambda p: plots.plot_loss_curves(curves, p, title="decay branches", xlabel="step"),
        "surface_frontiers": lambda p: plots.plot_surface_frontiers(fit.frontier_curves(surfaces), sparsities, p,
                                                                    C_range=(1e19, 1e22)),
        "contrasts": lambda p: plots.plot_contrasts(contrasts, p, title="paired contrasts"),
        "log": lambda p: plots.plot_log(eval_lines(), p, x="flops", title="a run"),
    }


PLOTS = ["loss_vs_compute", "multipliers", "power_laws", "loss_curves", "surface_frontiers",
         "contrasts", "log"]


@pytest.mark.parametrize("name", PLOTS)
def test_plot_writes_png(plot_calls, tmp_path, name):
    pytest.importorskip("matplotlib")
    path = tmp_path / "figs" / f"{name}.png"
    assert plot_calls[name](str(path)) is True
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG") and len(data) > 1000


@pytest.mark.parametrize("name", PLOTS)
def test_plot_without_matplotlib_is_one_line_and_no_file(plot_calls, tmp_path, monkeypatch, capsys, name):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    path = tmp_path / f"{name}.png"
    capsys.readouterr()
    assert plot_calls[name](str(path)) is False
    assert os.listdir(tmp_path) == []
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == f"{path}: {plots.NO_MATPLOTLIB}\n"


def test_requirements_plot_names_matplotlib():
    lines = [line.strip() for line in open(os.path.join(REPO, "requirements-plot.txt")) if line.strip()]
    assert [line for line in lines if not line.startswith("#")] == ["matplotlib"] and "optional" in lines[0].lower()


def test_read_log_is_the_eval_lines(tmp_path):
    lines = eval_lines(4)
    assert plots.read_log(write_log(tmp_path / "log.jsonl", lines)) == lines  # blank lines skipped


def test_log_cli_writes_the_curves(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    log = write_log(tmp_path / "log.jsonl", eval_lines(6))
    png = tmp_path / "figs" / "curves.png"
    assert plots.main([log, "--out", str(png), "--x", "flops"]) == 0
    assert png.read_bytes().startswith(b"\x89PNG") and capsys.readouterr().out == f"wrote {png}\n"
    assert plots.main([log]) == 0  # default: curves.png beside the log
    assert (tmp_path / "curves.png").read_bytes().startswith(b"\x89PNG")
    run = subprocess.run([sys.executable, "plots.py", log, "--out", str(tmp_path / "c.png")], cwd=REPO,
                         capture_output=True, text=True, timeout=120)  # as the README runs it
    assert run.returncode == 0 and (tmp_path / "c.png").exists(), run.stderr


@pytest.mark.parametrize("text, message", [
    (None, "plots.py: error: [Errno 2] No such file or directory: '{path}'"),
    ("{not json\n", "plots.py: error: {path}: JSONDecodeError: Expecting property name"),
    (json.dumps({"step": 0, "val_loss": 3.0}) + "\n", "plots.py: error: {path}: KeyError: 'tokens'"),
])
def test_log_cli_mistakes_are_one_line_and_status_2(tmp_path, capsys, text, message):
    path = tmp_path / "log.jsonl"
    if text is not None:
        path.write_text(text)
    with pytest.raises(SystemExit) as e:
        plots.main([str(path), "--out", str(tmp_path / "c.png")])
    err = capsys.readouterr().err.splitlines()[-1]
    assert e.value.code == 2 and err.startswith(message.format(path=path)), err
    assert not (tmp_path / "c.png").exists()


def test_log_cli_without_matplotlib_is_one_line(tmp_path, monkeypatch, capsys):
    log = write_log(tmp_path / "log.jsonl", eval_lines(3))
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert plots.main([log, "--out", str(tmp_path / "c.png")]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == f"{tmp_path / 'c.png'}: {plots.NO_MATPLOTLIB}\n"
