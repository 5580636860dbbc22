# plots.py: each figure is a PNG or, without matplotlib, one line and no file; `python plots.py LOG`.
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import fit
import plots
import synthetic_runs
from synthetic_runs import SYNTHETIC_SURFACES
from test_sample import error_line

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def eval_lines(n=5, sources=("comedy", "history")):
    """What train.py writes: a dict per eval, train_loss null at step 0."""
    return [dict(step=10 * i, tokens=20480 * i, flops=1.1e14 * i, lr=1e-3,
                 train_loss=6 - i / 2 if i else None, val_loss=6.1 - 0.45 * i,
                 val_loss_by_source={s: 6.1 - 0.45 * i + 0.1 * k for k, s in enumerate(sources)})
            for i in range(n)]


def write_log(path, lines):
    path.write_text("".join(json.dumps(x) + "\n" for x in lines) + "\n")  # and a blank line
    return str(path)


@pytest.fixture(scope="module")
def plot_calls():
    cols = [synthetic_runs.synthetic_power_runs(seed=seed) for seed in (0, 1)]  # repeated budgets
    runs = {a: tuple(np.concatenate([c[k][c["arch"] == a] for c in cols]) for k in ("C", "loss"))
            for a in synthetic_runs.SYNTHETIC_POWER_LAWS}
    fits = fit.fit_power_laws(runs, "vanilla")
    mult = {a: fit.compute_multiplier(*runs["vanilla"], *runs[a]) for a in runs}  # nan outside the range
    bands = {a: (0.95 * m, 1.05 * m) for a, m in mult.items()}
    frontiers = fit.frontier_curves({a: fit.SurfaceFit(**c) for a, c in SYNTHETIC_SURFACES.items()})
    curves = {f"{arch} L4w32-e16 b{b}": (list(range(b, 60)), [3 + 5 / (1 + x / 10) for x in range(b, 60)])
              for arch in ("baseline", "smelt") for b in (10, 20, 40)}
    contrasts = [("gain (nats)", [("a", 0.02, 0.01, 0.03), ("b", -0.01, -0.02, 0.005)]),
                 ("effect (nats)", [("c", -0.03, -0.05, -0.01)])]
    return {
        "loss_vs_compute": lambda p: plots.plot_loss_vs_compute(runs, fits, p),
        "multipliers": lambda p: plots.plot_multipliers(runs["vanilla"][0], mult, p, bands, "vanilla", "m"),
        "power_laws": lambda p: plots.plot_power_laws(runs, fits, mult, "vanilla", p),
        "loss_curves": lambda p: plots.plot_loss_curves(curves, p, title="decay branches", xlabel="step"),
        "surface_frontiers": lambda p: plots.plot_surface_frontiers(frontiers, [0.85, 0.95], p, (1e19, 1e22)),
        "contrasts": lambda p: plots.plot_contrasts(contrasts, p, title="paired contrasts"),
        "log": lambda p: plots.plot_log(eval_lines(), p, x="flops", title="a run"),
    }


@pytest.mark.parametrize("name", ["loss_vs_compute", "multipliers", "power_laws", "loss_curves",
                                  "surface_frontiers", "contrasts", "log"])
def test_plot_writes_png_or_one_line_without_matplotlib(plot_calls, tmp_path, monkeypatch, capsys, name):
    path = tmp_path / "figs" / f"{name}.png"
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    capsys.readouterr()
    assert plot_calls[name](str(path)) is False and os.listdir(tmp_path) == []
    assert capsys.readouterr() == ("", f"{path}: {plots.NO_MATPLOTLIB}\n")
    monkeypatch.undo()
    pytest.importorskip("matplotlib")
    assert plot_calls[name](str(path)) is True
    assert path.read_bytes().startswith(b"\x89PNG") and path.stat().st_size > 1000


def test_log_cli_writes_the_curves(tmp_path, capsys, monkeypatch):
    log = write_log(tmp_path / "log.jsonl", eval_lines(6))
    assert plots.read_log(log) == eval_lines(6)  # the blank line skipped
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert plots.main([log, "--out", str(tmp_path / "c.png")]) == 2  # without matplotlib: status 2
    assert capsys.readouterr() == ("", f"{tmp_path / 'c.png'}: {plots.NO_MATPLOTLIB}\n")
    monkeypatch.undo()
    pytest.importorskip("matplotlib")
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
    err = error_line(plots.main, [str(path), "--out", str(tmp_path / "c.png")], capsys, "plots.py")
    assert err.startswith(message.format(path=path)), err
    assert not (tmp_path / "c.png").exists()
