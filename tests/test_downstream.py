# downstream.py: [S6]-[S7] calibration and the [X19]-[X21] prediction pipeline, as functions and through
# `python downstream.py calibrate | predict` on CSV files the tests write (known parameters recovered).
import json
import math

import numpy as np
import pytest

import downstream as ds
from fit import PowerLawFit

TRUE_SIGMOID = ds.SigmoidCalibration(b=0.25, a=0.5, alpha=6.0, tau=2.6, d=-1)


# ----------------------------------------------------------------------------- the functions

def test_sigmoid_calibration_and_residuals():
    rng = np.random.default_rng(4)
    loss = np.linspace(2.2, 3.2, 40)
    score = TRUE_SIGMOID.predict(loss) + 0.002 * rng.standard_normal(40)
    cal = ds.fit_calibration(loss, score, direction=-1)
    assert cal.r2 > 0.99 and abs(cal.tau - 2.6) < 0.05
    assert np.all(np.diff(cal.predict(loss)) < 0)  # monotone, decreasing with loss
    tgt_loss = np.linspace(2.3, 3.0, 10)
    delta = ds.calibration_residuals(cal, tgt_loss, TRUE_SIGMOID.predict(tgt_loss) + 0.02, sign=+1)
    assert np.all(np.abs(delta - 0.02) < 0.005)  # target better than reference at equal loss -> delta > 0
    delta_loss_metric = ds.calibration_residuals(cal, tgt_loss, TRUE_SIGMOID.predict(tgt_loss) - 0.02, sign=-1)
    assert np.all(delta_loss_metric > 0)


def test_downstream_pipeline():
    C = np.geomspace(1e18, 1e20, 8)
    laws = [PowerLawFit(E=1.0, A=1.2, gamma=0.25), PowerLawFit(E=0.5, A=2.0, gamma=0.2)]
    sig_true = [(4.0, 6.0), (3.0, 4.0)]
    fitted_laws = [ds.fit_task_nll(C, law.loss(C)) for law in laws]  # [X19]
    for f, law in zip(fitted_laws, laws):
        assert abs(f.gamma - law.gamma) < 1e-3
    B = np.linspace(1.2, 2.2, 20)
    sigs = [ds.fit_task_sigmoid(B, 1 / (1 + np.exp(s * B - b))) for s, b in sig_true]  # [X20]
    assert np.allclose(sigs, sig_true, atol=1e-4)
    filtered = ds.predict_core(C, fitted_laws, sigs, 1.0)
    r = ds.fit_core_scale(filtered, 0.87 * filtered)  # [X21]
    assert abs(r - 0.87) < 1e-12
    target = float(ds.predict_core(3e19, fitted_laws, sigs, r))
    assert abs(ds.compute_for_core(target, fitted_laws, sigs, r) / 3e19 - 1) < 1e-6
    assert math.isnan(ds.compute_for_core(0.99, fitted_laws, sigs, r))  # never reached: nan, not a guess


# ----------------------------------------------------------------------------- calibrate

def error_line(capsys, argv):
    """The exit status 2 and the last line on stderr (argparse prints the usage above it)."""
    with pytest.raises(SystemExit) as e:
        ds.main(argv)
    captured = capsys.readouterr()
    assert e.value.code == 2 and captured.out == ""
    return captured.err.splitlines()[-1]


def calibration_csv(tmp_path, truth=TRUE_SIGMOID, offset=0.02, extra=()):
    """vanilla: 30 endpoints on `truth` with 0.2% noise; loop-2: 8 endpoints on it + offset, the last outside
    vanilla's loss range; a seed column the reader ignores."""
    rng = np.random.default_rng(0)
    rows = ["arch,loss,score,seed"]
    rows += [f"vanilla,{x:.6f},{truth.predict(x) + 0.002 * rng.standard_normal():.6f},{i}"
             for i, x in enumerate(np.linspace(2.2, 3.2, 30))]
    rows += [f"loop-2,{x:.6f},{truth.predict(x) + offset:.6f},0" for x in np.linspace(2.3, 3.3, 8)]
    path = tmp_path / "endpoints.csv"
    path.write_text("\n".join(rows + list(extra)) + "\n")
    return str(path)


def test_cli_calibrate_recovers_the_sigmoid_and_the_target_offset(tmp_path, capsys):
    path = calibration_csv(tmp_path)
    assert ds.main(["calibrate", path, "--ref", "vanilla", "--target", "loop-2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    cal = out["calibration"]
    assert cal["d"] == -1 and out["n_ref"] == 30 and cal["r2"] > 0.999
    assert abs(cal["tau"] - 2.6) < 0.02 and abs(cal["alpha"] / 6.0 - 1) < 0.05
    assert abs(cal["a"] - 0.5) < 0.01 and abs(cal["b"] - 0.25) < 0.005
    assert [r["loss"] for r in out["residuals"]] == pytest.approx(np.linspace(2.3, 3.3, 8))  # the target's rows
    assert all(abs(r["delta"] - 0.02) < 0.003 for r in out["residuals"]) and abs(out["mean_delta"] - 0.02) < 0.002
    assert [r["inside"] for r in out["residuals"]] == [True] * 7 + [False]  # loss 3.3 > vanilla's 3.2
    assert ds.main(["calibrate", path, "--ref", "vanilla", "--target", "loop-2"]) == 0
    text = capsys.readouterr().out
    assert "[S6] vanilla (30 endpoints)" in text and "R^2 = 0.99" in text and "mean delta +0.02" in text
    assert "  loss 3.3000 score " in text and "(outside vanilla's loss range [2.2, 3.2])" in text


def test_cli_calibrate_a_score_that_rises_with_loss(tmp_path, capsys):
    # an NLL-like score: it rises with loss and lower is better, so a target 0.03 below is delta = +0.03
    truth = ds.SigmoidCalibration(b=1.0, a=2.0, alpha=4.0, tau=2.7, d=+1)
    path = calibration_csv(tmp_path, truth, offset=-0.03)
    assert ds.main(["calibrate", path, "--ref", "vanilla", "--target", "loop-2", "--rises", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["calibration"]["d"] == 1 and abs(out["calibration"]["tau"] - 2.7) < 0.05
    assert abs(out["mean_delta"] - 0.03) < 0.003


@pytest.mark.parametrize("text, message", [
    ("arch,loss\nv,2.0\n", "downstream.py: error: {path}: no column score in its header"),
    ("arch,loss,score\nv,2.0,0.5\nv,2.1,abc\n", "downstream.py: error: {path} line 3: score 'abc' is not a number"),
    ("arch,loss,score\nv,2.0,0.5\nw,2.1,0.4\nv,2.2,0.3\nv,2.3,0.2\n",
     "downstream.py: error: {path}: arch 'v': sigmoid calibration: 3 points is too few to fit 4 coefficients"),
    ("arch,loss,score\nv,2.0,0.5\n", "downstream.py: error: {path}: no rows of arch 'w'"),
])
def test_cli_calibrate_mistakes_are_one_line_naming_the_file(tmp_path, capsys, text, message):
    path = tmp_path / "endpoints.csv"
    path.write_text(text)
    assert error_line(capsys, ["calibrate", str(path), "--ref", "v", "--target", "w"]).startswith(
        message.format(path=path))


# ----------------------------------------------------------------------------- predict

LAWS = {("vanilla", "hellaswag"): (1.0, 1.2, 0.25), ("vanilla", "squad"): (0.5, 2.0, 0.20),
        ("grow", "hellaswag"): (1.0, 1.1, 0.27), ("grow", "squad"): (0.5, 1.9, 0.22)}  # (E, A, alpha) [X19]
SIGMOIDS = {"hellaswag": (4.0, 6.0), "squad": (3.0, 4.0)}  # (s, b) [X20]
R = 0.87  # [X21]


def true_pipeline(arch):
    tasks = sorted(SIGMOIDS)
    return [PowerLawFit(*LAWS[arch, t]) for t in tasks], [SIGMOIDS[t] for t in tasks]


def tasks_csv(tmp_path, rows=None):
    """Six checkpoints per arch, noise-free: nll on the [X19] law, centered on the [X20] sigmoid, core =
    R x their mean [X21] (repeated on each task row of the checkpoint); a note column the reader ignores."""
    if rows is not None:
        rows = [f"{row},x" for row in rows]
    else:
        rows = []
        for arch in ("vanilla", "grow"):
            for C in np.geomspace(1e18, 1e20, 6):
                B = {t: PowerLawFit(*LAWS[arch, t]).loss(C) for t in SIGMOIDS}
                cen = {t: 1 / (1 + math.exp(s * B[t] - b)) for t, (s, b) in SIGMOIDS.items()}
                core = R * np.mean(list(cen.values()))
                rows += [f"{arch},{C:.17g},{t},{B[t]:.17g},{cen[t]:.17g},{core:.17g},x" for t in SIGMOIDS]
    path = tmp_path / "tasks.csv"
    path.write_text("arch,C,task,nll,centered,core,note\n" + "\n".join(rows) + "\n")
    return str(path)


def test_cli_predict_recovers_the_pipeline_and_its_predictions(tmp_path, capsys):
    path = tasks_csv(tmp_path)
    assert ds.main(["predict", path, "--budgets", "3e19,1e21", "--core", "0.3,0.5,0.99", "--ref", "vanilla",
                    "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tasks"] == ["hellaswag", "squad"] and abs(out["r"] - R) < 1e-9 and out["r_rmse"] < 1e-9
    for t, (s, b) in SIGMOIDS.items():
        assert abs(out["sigmoids"][t]["s"] - s) < 1e-4 and abs(out["sigmoids"][t]["b"] - b) < 1e-4
    for (arch, t), (E, A, alpha) in LAWS.items():
        law = out["laws"][arch][t]
        assert abs(law["alpha"] - alpha) < 1e-4 and abs(law["E"] - E) < 1e-4 and abs(law["A"] / A - 1) < 1e-4
    computes = {}
    for arch in ("vanilla", "grow"):
        laws, sigs = true_pipeline(arch)
        for got, C in zip(out["core"][arch], (3e19, 1e21)):  # beyond the measured 1e20 too: the laws extrapolate
            assert abs(got - float(ds.predict_core(C, laws, sigs, R))) < 1e-5
        computes[arch] = [ds.compute_for_core(v, laws, sigs, R) for v in (0.3, 0.5)]
        got = out["compute"][arch]
        assert len(got) == 3 and got[2] is None  # CORE 0.99: never reached
        for c, true in zip(got, computes[arch]):
            assert abs(c / true - 1) < 1e-4
    for m, ref, arm in zip(out["multiplier"]["grow"], computes["vanilla"], computes["grow"]):
        assert abs(m / (ref / arm) - 1) < 1e-4 and m > 1  # grow needs less compute
    assert out["multiplier"]["vanilla"][0] == pytest.approx(1.0)
    assert ds.main(["predict", path, "--core", "0.3", "--ref", "vanilla"]) == 0
    text = capsys.readouterr().out
    assert "r = 0.87000 (rmse 0.0000 on 12 checkpoints)" in text and "hellaswag: s=4.0000 b=6.0000" in text
    assert "grow: compute for CORE 0.3:" in text and "vs vanilla)" in text


GOOD = ["v,1e18,t,2.0,0.1,0.1", "v,1e19,t,1.8,0.2,0.2", "v,1e20,t,1.7,0.3,0.3", "v,1e21,t,1.65,0.35,0.35"]


@pytest.mark.parametrize("rows, argv, message", [
    (GOOD + ["v,1e21,t,1.6,0.36,0.35"], [], "{path}: checkpoint (v, C=1e+21) needs each task (t) once and one core"),
    (["v,1e18,t,2,0.1,0.1", "v,1e18,u,2,0.2,0.2"], [], "{path}: checkpoint (v, C=1e+18) needs each task (t, u) once"
                                                       " and one core; it has 2 rows"),  # two CORE values
    (GOOD + ["v,1e22,u,1.6,0.36,0.4"], [], "{path}: checkpoint (v, C=1e+18) needs each task (t, u) once"),
    (GOOD + ["w,1e18,t,2.0,0.1,0.1", "w,1e19,t,1.9,0.1,0.1"], [],
     "{path}: arch 'w', task 't': 2 points at 2 distinct computes is too few to fit 3 coefficients"),
    (GOOD[:1] + ["v,2e18,t,2.0,nan,0.1"], [], "{path} line 3: centered nan is not a number"),
    (GOOD, ["--ref", "nope"], "{path}: no arch 'nope' (have v)"),
    (GOOD, ["--core", "x"], "argument --core: invalid floats value: 'x'"),
])
def test_cli_predict_mistakes_are_one_line(tmp_path, capsys, rows, argv, message):
    path = tasks_csv(tmp_path, rows)
    assert message.format(path=path) in error_line(capsys, ["predict", path, *argv])


def test_cli_missing_file(capsys):
    assert error_line(capsys, ["calibrate", "no/such.csv", "--ref", "v", "--target", "w"]) == \
        "downstream.py: error: [Errno 2] No such file or directory: 'no/such.csv'"
