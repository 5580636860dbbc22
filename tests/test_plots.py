# tooling/plots.py: every figure is written (PNG, deterministic, atomically) or, without matplotlib, one
# line and no file; a run's curves from its log.jsonl (`python -m tooling.plots`) and its errors.
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import fit
from tooling import plots

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = ("comedy", "history", "tragedy")


def eval_lines(n=5, sources=SOURCES):
    """What train.py writes: one JSON object per eval; train_loss null at step 0."""
    lines = []
    for i in range(n):
        step = 10 * i
        line = dict(step=step, tokens=2048 * step, flops=5.4e9 * 2048 * step, lr=1e-3,
                    train_loss=None if i == 0 else 6.0 - 0.5 * i, val_loss=6.1 - 0.45 * i, epochs=0.01 * i)
        if sources:
            line["val_loss_by_source"] = {s: line["val_loss"] + 0.1 * k for k, s in enumerate(sources)}
        lines.append(line)
    return lines


def write_log(path, lines):
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return str(path)


LOG = dict(step=[0, 10], tokens=[0, 20480], flops=[0.0, 1.1e14], train_loss=[None, 5.5], val_loss=[6.1, 5.6],
           by_source={"comedy": [6.0, 5.5], "history": [None, 5.7]})


# ----------------------------------------------------------------------------- the fits' figures

@pytest.fixture(scope="module")
def plot_calls():
    """name -> call(path) for each plot function, on real fits of the synthetic runs."""
    runs = {}
    for seed in (0, 1):  # two seeds: repeated points at every budget
        cols = fit.synthetic_power_runs(seed=seed)
        for a in dict.fromkeys(cols["arch"].tolist()):
            m = cols["arch"] == a
            C, L = runs.get(a, ((), ()))
            runs[a] = (np.concatenate([C, cols["C"][m]]), np.concatenate([L, cols["loss"][m]]))
    fits = fit.fit_power_laws(runs, "vanilla")
    ref_C = runs["vanilla"][0]
    mult = {a: fit.compute_multiplier(*runs["vanilla"], *runs[a]) for a in runs}  # nan outside the range
    bands = {a: (0.95 * m, 1.05 * m) for a, m in mult.items()}
    surface = fit.synthetic_surface_runs()
    budgets, sparsities = [1e20, 1e21, 1e22], [0.85, 0.95]
    boot = fit.cell_bootstrap(surface, "baseline", "smelt", budgets, sparsities, n_draws=4, n_workers=1, progress=False)
    curves = {f"{arch} L4w32-e16 b{b}": (list(range(b, 60)), [3 + 5 / (1 + x / 10) for x in range(b, 60)])
              for arch in ("baseline", "smelt") for b in (10, 20, 40)}
    return {
        "loss_vs_compute": lambda p: plots.plot_loss_vs_compute(runs, fits, p),
        "multipliers": lambda p: plots.plot_multipliers(ref_C, mult, p, bands=bands, ref="vanilla"),
        "power_laws": lambda p: plots.plot_power_laws(runs, fits, mult, "vanilla", p),
        "ce_gain": lambda p: plots.plot_ce_gain(budgets, sparsities, boot["value"]["ce_gain"], p,
                                                lo=boot["lo"]["ce_gain"], hi=boot["hi"]["ce_gain"]),
        "loss_curves": lambda p: plots.plot_loss_curves(curves, p, title="decay branches", xlabel="step"),
        "surface_frontiers": lambda p: plots.plot_surface_frontiers(fit.frontier_curves(boot["full_fits"]), sparsities, p,
                                                                    C_range=(1e19, 1e22)),
        "log": lambda p: plots.plot_log(LOG, p, x="flops", title="a run"),
    }


PLOTS = ["loss_vs_compute", "multipliers", "power_laws", "ce_gain", "loss_curves", "surface_frontiers", "log"]


@pytest.mark.parametrize("name", PLOTS)
def test_plot_writes_png(plot_calls, tmp_path, name):
    pytest.importorskip("matplotlib")
    path = tmp_path / f"{name}.png"
    assert plot_calls[name](str(path)) is True
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG") and len(data) > 1000
    assert os.listdir(tmp_path) == [path.name]  # written atomically: no temp file left beside it
    assert plot_calls[name](str(tmp_path / "again.png")) and (tmp_path / "again.png").read_bytes() == data  # deterministic


@pytest.mark.parametrize("name", PLOTS)
def test_plot_without_matplotlib_is_one_line_and_no_file(plot_calls, tmp_path, monkeypatch, capsys, name):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    path = tmp_path / f"{name}.png"
    capsys.readouterr()
    assert plot_calls[name](str(path)) is False
    assert not path.exists() and os.listdir(tmp_path) == []
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert captured.out == "" and len(lines) == 1 and "pip install -r requirements-plot.txt" in lines[0], captured.err


def test_plot_save_is_atomic_and_closes_the_figure(tmp_path):
    class Fig:  # the two calls _save makes, without matplotlib
        def savefig(self, f, format, **kw):
            if format == "xyz":
                raise ValueError("Format 'xyz' is not supported")
            f.write(f"{format} image".encode())

    class Plt:
        closed = []

        def close(self, fig):
            self.closed.append(fig)

    plt, fig = Plt(), Fig()
    plots._save(plt, fig, str(tmp_path / "out" / "m.PDF"))
    assert (tmp_path / "out" / "m.PDF").read_text() == "pdf image" and plt.closed == [fig]
    with pytest.raises(ValueError, match="xyz"):
        plots._save(plt, fig, str(tmp_path / "out" / "m.xyz"))
    assert sorted(os.listdir(tmp_path / "out")) == ["m.PDF"] and plt.closed == [fig, fig]  # no temp file left
    plots._save(plt, fig, str(tmp_path / "noext"))
    assert (tmp_path / "noext").read_text() == "png image"



def test_plot_ce_gain_checks_shapes(tmp_path):
    with pytest.raises(ValueError, match=r"gain has shape \(2,\), expected"):
        plots.plot_ce_gain([1e20, 1e21], [0.9], [0.1, 0.2], str(tmp_path / "g.png"))
    with pytest.raises(ValueError, match="both lo and hi"):
        plots.plot_ce_gain([1e20], [0.9], [[0.1]], str(tmp_path / "g.png"), lo=[[0.0]])
    assert not (tmp_path / "g.png").exists()


def test_requirements_plot_names_matplotlib():
    path = os.path.join(os.path.dirname(__file__), "..", "requirements-plot.txt")
    lines = [l.strip() for l in open(path) if l.strip()]
    assert [l for l in lines if not l.startswith("#")] == ["matplotlib"] and "optional" in lines[0].lower()


def test_log_axis_minor_labels_only_at_two_and_five():
    labels = [plots._two_five_label(x, None) for x in (2e11, 3e11, 5e11, 7e11, 2e12, 5e-3)]
    assert labels == [r"$2\times10^{11}$", "", r"$5\times10^{11}$", "", r"$2\times10^{12}$", r"$5\times10^{-3}$"]


def test_figure_without_matplotlib_says_so_in_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    assert plots.pyplot("out/x") is None
    assert capsys.readouterr().err == ("out/x: matplotlib is not installed, so no figure was written (figures are "
                                       "optional: pip install -r requirements-plot.txt)\n")


# ----------------------------------------------------------------------------- a run's curves from its log.jsonl

def test_read_log_columns(tmp_path):
    lines = eval_lines(4)
    del lines[2]["val_loss_by_source"]["history"]  # a source without windows in one eval
    log = plots.read_log(write_log(tmp_path / "log.jsonl", lines))
    assert log["step"] == [0, 10, 20, 30] and log["tokens"] == [0, 20480, 40960, 61440]
    assert log["train_loss"][0] is None and log["train_loss"][1:] == [5.5, 5.0, 4.5]
    assert list(log["by_source"]) == list(SOURCES)
    assert log["by_source"]["history"][2] is None and None not in log["by_source"]["comedy"]
    assert all(len(v) == 4 for v in log["by_source"].values())
    late = eval_lines(3, sources=())
    late[2]["val_loss_by_source"] = {"code": 3.0}  # a source first seen late: None before it
    assert plots.read_log(write_log(tmp_path / "late.jsonl", late))["by_source"] == {"code": [None, None, 3.0]}


@pytest.mark.parametrize("x", ["tokens", "flops"])
def test_log_cli_writes_the_curves(tmp_path, capsys, x):
    pytest.importorskip("matplotlib")
    log = write_log(tmp_path / "log.jsonl", eval_lines(6))
    png = tmp_path / "figs" / "curves.png"
    assert plots.main([log, "--out", str(png), "--x", x]) == 0
    data = png.read_bytes()
    assert data.startswith(b"\x89PNG") and len(data) > 1000
    assert capsys.readouterr().out == f"wrote {png}\n" and os.listdir(png.parent) == ["curves.png"]
    assert plots.main([log]) == 0  # default: curves.png beside the log
    assert (tmp_path / "curves.png").read_bytes().startswith(b"\x89PNG")


def test_log_cli_as_a_module(tmp_path):
    pytest.importorskip("matplotlib")
    log = write_log(tmp_path / "log.jsonl", eval_lines(3, sources=()))
    png = tmp_path / "curves.png"
    run = subprocess.run([sys.executable, "-m", "tooling.plots", log, "--out", str(png)], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert png.read_bytes().startswith(b"\x89PNG")
    run = subprocess.run([sys.executable, "-m", "tooling.plots", str(tmp_path / "nope.jsonl")], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.splitlines() == [f"tooling.plots: error: No such file or directory: {tmp_path / 'nope.jsonl'}"]


def good_line(**changes):
    line = eval_lines(2)[1]
    line.update(changes)
    return json.dumps(line)


@pytest.mark.parametrize("text, message", [
    ("", "log.jsonl: no evals in the log (an empty file)"),
    ("\n\n", "log.jsonl: no evals in the log"),
    (good_line() + "\n{not json\n", "log.jsonl:2: malformed JSON"),
    ("[1, 2]\n", "log.jsonl:1: expected a JSON object (one eval of train.py), got list"),
    (good_line() + "\n" + json.dumps({"step": 20, "tokens": 1, "flops": 2.0, "train_loss": 5.0}) + "\n",
     "log.jsonl:2: no 'val_loss' field; is this a train.py log.jsonl?"),
    (good_line(tokens="many") + "\n", "log.jsonl:1: 'tokens' must be a finite number, got 'many'"),
    (good_line(val_loss=None) + "\n", "log.jsonl:1: 'val_loss' must be a finite number, got None"),
    (good_line(flops=True) + "\n", "log.jsonl:1: 'flops' must be a finite number, got True"),
    (good_line(train_loss=float("inf")) + "\n", "log.jsonl:1: 'train_loss' must be a finite number or null, got inf"),
    (good_line(val_loss_by_source=[5.0]) + "\n", "log.jsonl:1: 'val_loss_by_source' must be an object"),
    (good_line(val_loss_by_source={"comedy": "x"}) + "\n",
     "log.jsonl:1: 'val_loss_by_source.comedy' must be a finite number or null, got 'x'"),
])
def test_log_cli_malformed_log_is_one_line_and_status_2(tmp_path, capsys, text, message):
    path = tmp_path / "log.jsonl"
    path.write_text(text)
    png = tmp_path / "curves.png"
    assert plots.main([str(path), "--out", str(png)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.splitlines()) == 1, captured.err
    assert captured.err.startswith(f"tooling.plots: error: {path}") and message in captured.err, captured.err
    assert not png.exists()


def test_log_cli_not_utf8_or_missing(tmp_path, capsys):
    path = tmp_path / "log.jsonl"
    path.write_bytes(b"\xff\xfe{}\n")
    assert plots.main([str(path)]) == 2
    assert capsys.readouterr().err.startswith(f"tooling.plots: error: {path}: not valid UTF-8")
    assert plots.main([str(tmp_path / "none" / "log.jsonl")]) == 2
    assert capsys.readouterr().err == f"tooling.plots: error: No such file or directory: {tmp_path / 'none' / 'log.jsonl'}\n"


def test_log_cli_without_matplotlib_is_one_line(tmp_path, monkeypatch, capsys):
    log = write_log(tmp_path / "log.jsonl", eval_lines(3))
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    assert plots.main([log, "--out", str(tmp_path / "c.png")]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ("tooling.plots: error: matplotlib is not installed, so no figure was "
                                                   "written (pip install -r requirements-plot.txt)\n")
    assert os.listdir(tmp_path) == ["log.jsonl"]


def test_plot_log_checks_the_x_axis(tmp_path):
    with pytest.raises(ValueError, match="x must be one of tokens, flops"):
        plots.plot_log(LOG, str(tmp_path / "c.png"), x="steps")
