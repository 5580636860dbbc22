# downstream.py: calibration [S6]-[S7] and prediction [X19]-[X21] recover known parameters from CSVs.
import itertools
import json
import math

import numpy as np
import pytest

import downstream as ds
from fit import PowerLawFit
from test_sample import error_line


def run(capsys, *argv):
    assert ds.main(list(argv)) == 0
    out = capsys.readouterr().out
    return json.loads(out) if "--json" in argv else out


def write(tmp_path, rows):
    (tmp_path / "runs.csv").write_text("\n".join(rows))
    return str(tmp_path / "runs.csv")



def calibration_csv(tmp_path, truth, offset):
    """vanilla: 30 endpoints on `truth`, 0.2% noise; loop-2: 8 on it + offset, the last beyond vanilla's."""
    rng = np.random.default_rng(0)
    rows = [f"vanilla,{x:.6f},{truth.predict(x) + 0.002 * rng.standard_normal():.6f},{i}"
            for i, x in enumerate(np.linspace(2.2, 3.2, 30))]
    rows += [f"loop-2,{x:.6f},{truth.predict(x) + offset:.6f},0" for x in np.linspace(2.3, 3.3, 8)]
    return write(tmp_path, ["arch,loss,score,seed", *rows])  # a seed column the reader ignores


def test_cli_calibrate_recovers_the_sigmoid_and_the_target_offset(tmp_path, capsys):
    path = calibration_csv(tmp_path, ds.SigmoidCalibration(b=0.25, a=0.5, alpha=6.0, tau=2.6, d=-1), 0.02)
    out = run(capsys, "calibrate", path, "--ref", "vanilla", "--target", "loop-2", "--json")
    cal = out["calibration"]
    assert cal["d"] == -1 and out["n_ref"] == 30 and cal["r2"] > 0.999
    assert abs(cal["tau"] - 2.6) < 0.02 and abs(cal["alpha"] / 6.0 - 1) < 0.05
    assert abs(cal["a"] - 0.5) < 0.01 and abs(cal["b"] - 0.25) < 0.005
    res = out["residuals"]  # the target's rows; delta > 0: better than the reference at equal loss
    assert [r["loss"] for r in res] == pytest.approx(np.linspace(2.3, 3.3, 8))
    assert all(abs(r["delta"] - 0.02) < 0.003 for r in res) and abs(out["mean_delta"] - 0.02) < 0.002
    assert [r["inside"] for r in res] == [True] * 7 + [False]  # loss 3.3 > vanilla's 3.2
    text = run(capsys, "calibrate", path, "--ref", "vanilla", "--target", "loop-2")
    assert "mean delta +0.02" in text and "(outside vanilla's loss range [2.2, 3.2])" in text
    # an NLL-like score rises with loss and lower is better: a target 0.03 below is delta = +0.03
    path = calibration_csv(tmp_path, ds.SigmoidCalibration(b=1.0, a=2.0, alpha=4.0, tau=2.7, d=+1), -0.03)
    out = run(capsys, "calibrate", path, "--ref", "vanilla", "--target", "loop-2", "--rises", "--json")
    assert out["calibration"]["d"] == 1 and abs(out["calibration"]["tau"] - 2.7) < 0.05
    assert abs(out["mean_delta"] - 0.03) < 0.003


@pytest.mark.parametrize("text, message", [
    (None, "[Errno 2] No such file or directory: '{path}'"),
    ("arch,loss\nv,2.0\n", "{path}: no column score in its header"),
    ("arch,loss,score\nv,2.0,0.5\nv,2.1,abc\n", "{path} line 3: score 'abc' is not a number"),
    ("arch,loss,score\nv,2.0,0.5\nw,2.1,0.4\nv,2.2,0.3\nv,2.3,0.2\n",
     "{path}: arch 'v': sigmoid calibration: 3 points is too few to fit 4 coefficients"),
    ("arch,loss,score\nv,2.0,0.5\n", "{path}: no rows of arch 'w'"),
])
def test_cli_calibrate_mistakes_are_one_line_naming_the_file(tmp_path, capsys, text, message):
    path = write(tmp_path, [text]) if text else str(tmp_path / "none.csv")
    line = error_line(ds.main, ["calibrate", path, "--ref", "v", "--target", "w"], capsys, "downstream.py")
    assert line.startswith("downstream.py: error: " + message.format(path=path))



LAWS = {("vanilla", "hellaswag"): (1.0, 1.2, 0.25), ("vanilla", "squad"): (0.5, 2.0, 0.20),
        ("grow", "hellaswag"): (1.0, 1.1, 0.27), ("grow", "squad"): (0.5, 1.9, 0.22)}  # (E, A, alpha) [X19]
SIGMOIDS = {"hellaswag": (4.0, 6.0), "squad": (3.0, 4.0)}  # (s, b) [X20]
R = 0.87  # [X21]


def true_pipeline(arch):
    return [PowerLawFit(*LAWS[arch, t]) for t in SIGMOIDS], list(SIGMOIDS.values())


def test_compute_for_core_inverts_predict_core():
    laws, sigs = true_pipeline("vanilla")
    target = float(ds.predict_core(3e19, laws, sigs, R))
    assert abs(ds.compute_for_core(target, laws, sigs, R) / 3e19 - 1) < 1e-6
    assert math.isnan(ds.compute_for_core(0.99, laws, sigs, R))  # never reached: nan, not a guess


def tasks_csv(tmp_path, rows=None):
    """Six noise-free checkpoints per arch on LAWS, SIGMOIDS and R; a note column the reader ignores."""
    if rows is None:
        rows = []
        for arch, C in itertools.product(("vanilla", "grow"), np.geomspace(1e18, 1e20, 6)):
            B = {t: PowerLawFit(*LAWS[arch, t]).loss(C) for t in SIGMOIDS}
            cen = {t: 1 / (1 + math.exp(s * B[t] - b)) for t, (s, b) in SIGMOIDS.items()}
            core = R * np.mean(list(cen.values()))
            rows += [f"{arch},{C:.17g},{t},{B[t]:.17g},{cen[t]:.17g},{core:.17g}" for t in SIGMOIDS]
    return write(tmp_path, ["arch,C,task,nll,centered,core,note", *(f"{row},x" for row in rows)])


def test_cli_predict_recovers_the_pipeline_and_its_predictions(tmp_path, capsys):
    path = tasks_csv(tmp_path)
    argv = ["predict", path, "--budgets", "3e19,1e21", "--core", "0.3,0.5,0.99", "--ref", "vanilla", "--json"]
    out = run(capsys, *argv)
    assert out["tasks"] == ["hellaswag", "squad"] and abs(out["r"] - R) < 1e-9 and out["r_rmse"] < 1e-9
    for t, (s, b) in SIGMOIDS.items():
        assert (out["sigmoids"][t]["s"], out["sigmoids"][t]["b"]) == pytest.approx((s, b), abs=1e-4)
    for (arch, t), (E, A, alpha) in LAWS.items():
        law = out["laws"][arch][t]
        assert abs(law["alpha"] - alpha) < 1e-4 and abs(law["E"] - E) < 1e-4 and abs(law["A"] / A - 1) < 1e-4
    computes = {}
    for arch in ("vanilla", "grow"):
        laws, sigs = true_pipeline(arch)
        want = [ds.predict_core(C, laws, sigs, R) for C in (3e19, 1e21)]  # beyond 1e20 the laws extrapolate
        assert out["core"][arch] == pytest.approx(want, abs=1e-5)
        computes[arch] = [ds.compute_for_core(v, laws, sigs, R) for v in (0.3, 0.5)]
        got = out["compute"][arch]
        assert got[2] is None and got[:2] == pytest.approx(computes[arch], rel=1e-4)  # 0.99: never reached
    for m, ref, arm in zip(out["multiplier"]["grow"], computes["vanilla"], computes["grow"]):
        assert abs(m / (ref / arm) - 1) < 1e-4 and m > 1  # grow needs less compute
    assert out["multiplier"]["vanilla"][0] == pytest.approx(1.0)
    text = run(capsys, "predict", path, "--core", "0.3", "--ref", "vanilla")
    assert "r = 0.87000 (rmse 0.0000 on 12 checkpoints)" in text and "grow: compute for CORE 0.3:" in text


GOOD = ["v,1e18,t,2.0,0.1,0.1", "v,1e19,t,1.8,0.2,0.2", "v,1e20,t,1.7,0.3,0.3", "v,1e21,t,1.65,0.35,0.35"]


@pytest.mark.parametrize("rows, argv, message", [
    (GOOD + ["v,1e21,t,1.6,0.36,0.35"], [], "{path}: checkpoint (v, C=1e+21) needs each task (t) once"),
    (["v,1e18,t,2,0.1,0.1", "v,1e18,u,2,0.2,0.2"], [],  # two CORE values
     "{path}: checkpoint (v, C=1e+18) needs each task (t, u) once and one core; it has 2 rows"),
    (GOOD + ["v,1e22,u,1.6,0.36,0.4"], [], "{path}: checkpoint (v, C=1e+18) needs each task (t, u) once"),
    (GOOD + ["w,1e18,t,2.0,0.1,0.1", "w,1e19,t,1.9,0.1,0.1"], [],
     "{path}: arch 'w', task 't': 2 points at 2 distinct computes is too few to fit 3 coefficients"),
    (GOOD[:1] + ["v,2e18,t,2.0,nan,0.1"], [], "{path} line 3: centered nan is not a number"),
    (GOOD, ["--ref", "nope"], "{path}: no arch 'nope' (have v)"),
    (GOOD, ["--core", "x"], "argument --core: invalid floats value: 'x'"),
])
def test_cli_predict_mistakes_are_one_line(tmp_path, capsys, rows, argv, message):
    path = tasks_csv(tmp_path, rows)
    prog = "downstream.py predict" if "--core" in argv else "downstream.py"  # argparse: the subcommand
    assert message.format(path=path) in error_line(ds.main, ["predict", path, *argv], capsys, prog)
