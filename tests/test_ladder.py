"""ladder.py and ladders/: the micro presets run the whole pipeline (LR sweep, matching, WSD stable runs with seeds,
decay branches, growth, CSV, fits, bootstrap, report, figures), an interrupted ladder resumes without
retraining finished runs, the cpu-mini designs keep their principles (TPP, growth, epochs), and the
noise bookkeeping marks what is within the measured seed spread."""

import csv
import glob
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import fit
import grow
import ladder
import train
from conftest import REPO, one_line_error
from ladders import pipeline
from ladders.common import data_plan, tokens_per_step, world_size
from ladders.stats import seed_spread, within_noise
from ladders.presets import PRESETS, SEEDS, X_LR_BETA, LRSweep, get_preset
from ladders.recipe import recipe_plan
from ladders.smelt import surface_bootstrap
from ladders.specs import build, describe_presets, full_plan
from ladders.sweep import best_lrs, bracketed_sweep, sweep_table
from ladders.x import multiplier_bootstrap, x_config
from tooling.checkpoint import load_model
from tooling.jobs import RunSpec, load_result, write_json_atomic


class Interrupted(Exception):
    pass


def counting_train(calls, stop_after=None, stop_at_step=None):
    """train.train that records its run names; after `stop_after` finished runs the next run is killed
    mid-way: it trains up to stop_at_step (writing its checkpoint and log, as a real run does) and raises."""
    def train_fn(settings):
        if stop_after is not None and len(calls) >= stop_after:
            train.train(dict(settings, stop_at_step=stop_at_step))
            raise Interrupted(f"killed during {settings['run_name']}")
        calls.append(settings["run_name"])
        return train.train(settings)
    return train_fn


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def quiet(*args, **kwargs):
    pass


def test_smelt_micro_end_to_end_and_resume(tmp_path):
    out = str(tmp_path / "smelt")
    preset = get_preset("smelt-micro")
    data = data_plan(preset)
    sweep, cells = build(preset, data)
    assert [s.role for s in sweep] == ["sweep"] * 4  # 2 LRs x (baseline, twin) at the first cell
    plan, _ = full_plan(preset, data)
    n_branches, seeds = len(preset.branch_tpp), len(preset.seeds)
    assert len(plan) == 4 + len(cells) * (seeds + 1) * (1 + n_branches)

    # matching: every twin is a SMELT model within the [S] tolerances of its baseline
    for name, base, twin, report in cells:
        assert twin.layout == "smelt" and twin.n_passes == 2 and base.layout == "plain"
        r = report["ratios"]
        assert 1.0 <= r["flops"] <= 1.05 and abs(r["params"] - 1) <= 0.015 and abs(r["kv"] - 1) <= 0.04

    # the first attempt is killed in the middle of its third run (a sweep run)
    calls = []
    kill = counting_train(calls, stop_after=2, stop_at_step=3)
    with pytest.raises(Interrupted):
        pipeline.ladder("smelt-micro", out_dir=out, train_fn=kill, progress=False, log=quiet)
    assert calls == [s.run_id for s in sweep[:2]]
    mtimes = {rid: os.path.getmtime(os.path.join(out, "runs", rid, "result.json")) for rid in calls}
    killed = os.path.join(out, "runs", sweep[2].run_id)
    assert os.path.exists(os.path.join(killed, "ckpt.pt")) and not os.path.exists(os.path.join(killed, "result.json"))

    # the rerun trains exactly the missing runs, never the finished ones; a third invocation trains nothing
    calls2 = []
    report = pipeline.ladder("smelt-micro", out_dir=out, train_fn=counting_train(calls2), progress=False,
                           bootstrap=20, log=quiet)
    assert set(calls2) == {s.run_id for s in plan} - set(calls) and len(calls2) == len(plan) - 2
    for rid, t in mtimes.items():
        assert os.path.getmtime(os.path.join(out, "runs", rid, "result.json")) == t
    calls3 = []
    pipeline.ladder("smelt-micro", out_dir=out, train_fn=counting_train(calls3), progress=False, bootstrap=0, log=quiet)
    assert calls3 == []

    # the LR sweep picked, per architecture, the value with the lowest validation loss, and every later run uses it
    key = preset.lr_sweep.key
    results = {s.run_id: json.load(open(os.path.join(out, "runs", s.run_id, "result.json"))) for s in plan}
    for arch in ("baseline", "smelt"):
        swept = {s.settings[key]: results[s.run_id]["val_loss"] for s in sweep if s.arch == arch}
        assert report["lrs"][arch] == min(swept, key=swept.get)
    specs, _ = build(preset, data, report["lrs"])
    assert {s.settings[key] for s in specs if s.role == "stable"} == set(report["lrs"].values())
    assert all(s.settings[key] == report["lrs"][s.arch] for s in specs if s.role == "stable")

    # decay branches: start from the stable checkpoint, read only held-back data, D = stable + decay tokens
    step_tokens = tokens_per_step(preset)
    for s in plan:
        r = results[s.run_id]
        if s.role == "branch":
            stable = results[s.needs]
            assert r["data_region"] == "branch" and stable["data_region"] == "stable"
            assert r["data_read"][0] >= stable["data_split"] and stable["data_read"][1] <= stable["data_split"]
            assert r["tokens"] == s.meta["branch_step"] * step_tokens + s.settings["decay_tokens"]
            assert r["tokens"] >= s.meta["branch_tpp"] * s.meta["N"]  # at least the planned budget
            assert r["ckpt_path"] is None  # pruned
    # baseline and twin of the first seed read the same token sequence (same windows); other seeds others
    for cell, *_ in cells:
        first, second = (f"baseline-{cell}-s{seed}-stable" for seed in preset.seeds)
        assert results[first]["data_read"] == results[f"smelt-{cell}-s{preset.seeds[0]}-stable"]["data_read"]

    # runs.csv: one row per branch with the fit columns, the seed, TPP, epochs and the per-source losses
    rows = read_csv(os.path.join(out, "runs.csv"))
    assert len(rows) == len(cells) * (seeds + 1) * n_branches
    for col in ("arch", "cell", "seed", "F", "S", "D", "C", "loss", "tpp", "epochs", "loss_comedy", "loss_tragedy"):
        assert col in rows[0]
    for row in rows:
        assert float(row["C"]) == pytest.approx(float(row["F"]) * float(row["D"]), rel=1e-9)
        assert 0 < float(row["S"]) < 1 and np.isfinite(float(row["loss"]))

    # report: both surfaces on all points; F at 2 levels identifies neither, so no CE Gain (not even a value)
    for arch, n in (("baseline", len(cells) * seeds * n_branches), ("smelt", len(cells) * n_branches)):
        assert report["fits"][arch]["n_points"] == n
    assert report["identified"] == {"baseline": False, "smelt": False} and report["ce_gain"] == report["tpp"] == []
    assert report["seed_spread"]["pooled_std"] > 0 and len(report["seed_spread"]["groups"]) == len(cells) * n_branches
    wins, pairs = report["wins"]["all"]
    assert pairs == len(cells) * n_branches and 0 <= wins <= pairs
    text = open(os.path.join(out, "report.txt")).read()
    assert "CE Gain" in text and "Table 10" in text and "LR sweep" in text and "seed spread" in text
    assert "[S5] CE Gain and [S3] TPP: not reported" in text and "| CE Gain [S5]" in text and "| cannot tell |" in text


@pytest.fixture(scope="module")
def x_micro(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("x"))
    archs = ["vanilla", "loop-2", "untied-grow"]  # a subset keeps the test fast; the preset has all six
    report = pipeline.ladder("x-micro", out_dir=out, progress=False, log=quiet, archs=archs, workers=2)
    return out, archs, report


def test_x_micro_budgets_growth_fits_and_noise(x_micro):
    out, archs, report = x_micro
    preset = get_preset("x-micro", archs=archs)
    rows = read_csv(os.path.join(out, "runs.csv"))
    seeds = len(preset.seeds)
    assert len(rows) == len(preset.depths) * len(archs) * seeds  # every architecture runs every seed
    step_tokens = tokens_per_step(preset)
    for r in rows:  # every architecture at its own budget: its [X] TPP x its own stored parameters, whole steps
        assert 0 <= float(r["D"]) - preset.tpp_stored[r["arch"]] * float(r["N_s"]) < step_tokens
        assert float(r["epochs"]) < 1  # no data repetition
    by = {(r["arch"], int(r["depth"])): r for r in rows}
    for d in preset.depths:  # the looped models run more blocks per token: more compute at the same TPP
        assert float(by[("loop-2", d)]["C"]) > float(by[("vanilla", d)]["C"])
    # untied-grow grew at its [X15] step: its log shows passes 2 then 4 and its checkpoint 4 untied cores
    grown = [r for r in rows if r["arch"] == "untied-grow" and int(r["depth"]) == preset.depths[-1]][0]
    log = [json.loads(line) for line in open(os.path.join(out, "runs", grown["run_id"], "log.jsonl"))]
    assert set(log[-1]["flops_by_passes"]) == {"2", "4"}
    model, _ = load_model(os.path.join(out, "runs", grown["run_id"], "ckpt.pt"))
    assert model.config.n_passes == 4 and not model.config.tie_core
    # the sweep: every architecture's swept values, the chosen one carried up the ladder
    assert set(report["lr_sweep"]) == set(archs) and set(report["lrs"]) == set(archs)
    # power laws: E from vanilla (every seed) below every vanilla loss; multipliers with bands and noise marks
    assert set(report["fits"]) == set(archs)
    assert 0 < report["fits"]["vanilla"]["E"] < min(float(r["loss"]) for r in rows if r["arch"] == "vanilla")
    assert report["seed_spread"]["pooled_std"] > 0
    for a in archs[1:]:
        records = report["multipliers"][a]
        assert len(records) == len(preset.depths)
        for m in records:
            assert m["fitted_lo"] <= m["fitted"] <= m["fitted_hi"] or m["fitted"] is None
            assert m["within_noise"] == (m["fitted_lo"] <= 1.0 <= m["fitted_hi"])


def test_x_report_says_what_it_compares_and_rebuilds_from_csv(x_micro, tmp_path):
    out, archs, report = x_micro
    text = open(os.path.join(out, "report.txt")).read()
    # the loss table compares equal depth; the report prints what each architecture spent there
    assert "equal depth (the same stored blocks) is not equal compute" in text
    rows = read_csv(os.path.join(out, "runs.csv"))
    by = {(r["arch"], r["depth"]): r for r in rows}
    d = rows[0]["depth"]
    tokens = float(by[("loop-2", d)]["D"]) / float(by[("vanilla", d)]["D"])
    assert f"{tokens:.2f}/" in text and tokens > 1
    # each LR: the mean-best of the sweep's seeds, carried up by [X16] with the architecture's own beta
    lr_line = next(line for line in text.splitlines() if "carried up by [X16]" in line)
    assert all(f"{a} {report['lrs'][a]:g} (beta {X_LR_BETA[a]:g})" in lr_line for a in archs)
    preset = get_preset("x-micro", archs=archs)
    run = next(r for r in rows if r["arch"] == "untied-grow" and r["depth"] == str(preset.depths[-1]))
    settings = json.load(open(os.path.join(out, "runs", run["run_id"], "result.json")))["settings"]
    first = x_config(preset, "untied-grow", preset.depths[0])[0]
    last = x_config(preset, "untied-grow", preset.depths[-1])[0]  # [X16] carried from the first depth's N_s
    scale = (grow.stored_params(last) / grow.stored_params(first)) ** -0.6
    assert settings["matrix_lr"] == pytest.approx(report["lrs"]["untied-grow"] * scale, rel=1e-12)
    assert settings["adam_betas"] == [0.8, 0.99] and settings["optimizer"] == "muon_x"  # its recipe, config/x_d8_*
    assert settings["embedding_lr"] == pytest.approx(settings["matrix_lr"] * 0.0064 / 0.04)
    # multipliers by interpolation only (the fitted ones are not printed)
    assert "interpolated" in text and "'x' = extrapolated" not in text and " fitted " not in text
    for a in archs[1:]:
        for m in report["multipliers"][a]:
            assert m["extrapolated"] in (True, False)
            if m["measured"] is None:  # vanilla's loss outside the arch's losses: the law is read outside its range
                assert m["extrapolated"]
    # lr_sweep.csv holds every swept value; runs.csv and it rebuild the same report without the run folders
    sweep = read_csv(os.path.join(out, "lr_sweep.csv"))
    assert {r["arch"] for r in sweep} == set(archs) and sum(r["carried"] == "True" for r in sweep) == len(archs)
    for name in ("runs.csv", "lr_sweep.csv"):
        shutil.copy(os.path.join(out, name), tmp_path / f"x-micro-{name}")
    again = pipeline.rereport("x-micro", str(tmp_path / "x-micro-runs.csv"), log=quiet, archs=archs)
    assert (tmp_path / "x-micro-report.txt").read_text() == text
    assert again["multipliers"] == json.load(open(os.path.join(out, "report.json")))["multipliers"]
    with pytest.raises(ValueError, match="expected a file named runs.csv"):
        pipeline.rereport("x-micro", os.path.join(out, "report.json"), log=quiet)


def committed(name):
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "ladder", name)


def mask_bands(text):
    """A report without its bootstrap bands (the seed bootstrap's last digits may move on another CPU)."""
    return [re.sub(r"\[[-+0-9.,e ]*(undefined)?[-+0-9.,e ]*\]", "[]", line) for line in text.splitlines()]


@pytest.mark.parametrize("name", ["x-cpu-mini", "x-cpu-mini-tuned", "x-cpu-mini-v1"])
def test_committed_x_report_rebuilds_from_its_csv(tmp_path, name):
    """docs/ladder/NAME-report.txt is what `ladder.py --from-csv docs/ladder/NAME-runs.csv` writes (bands
    masked: their last digit is the CPU's)."""
    for part in ("runs.csv", "lr_sweep.csv"):
        shutil.copy(committed(f"{name}-{part}"), tmp_path / f"{name}-{part}")
    assert ladder.main(["--preset", name, "--from-csv", str(tmp_path / f"{name}-runs.csv"), "--no-progress"]) == 0
    text = (tmp_path / f"{name}-report.txt").read_text()
    assert mask_bands(text) == mask_bands(open(committed(f"{name}-report.txt")).read())
    if name == "x-cpu-mini":  # the README's numbers, and its claims table (every architecture seeded)
        assert "loop-2 interpolated                   - 1.652" in text and "epochs read 0.08..0.85" in text
        for row in ("| growing beats not growing (loop-grow vs loop-2), more so with budget | does not | 1.02 ",
                    "| growing beats not growing (untied-grow vs untied-2), more so with budget | does not | 0.92 ",
                    "| untied beats tied (untied-2 vs loop-2) by a constant factor | reproduces | 1.32 ",
                    "| their multipliers rise with budget (the exponent gains) | does not |",
                    "| untied beats tied (untied-grow vs loop-grow) by a constant factor | cannot tell | 1.23 "):
            assert row in text
        return
    if name == "x-cpu-mini-tuned":  # docs/ladder.md's and the README's numbers
        for row in ("| growing beats not growing (loop-grow vs loop-2), more so with budget | does not | 1.04 ",
                    "| untied beats tied (untied-grow vs loop-grow) by a constant factor | reproduces | 1.23 ",
                    "| the boundary operator alone (Operator-1) needs less compute than vanilla, more so with budget "
                    "| cannot tell | 1.13 ", "all 20 points peaked at the same grid value (0.16)"):
            assert row in text
        assert "untied-2" not in text
        return
    assert "| paper claim |" not in text  # one seed but the reference's: no pair has its own seed spread
    assert "loop-2 1.33/1.72 1.50/2.19 1.40/1.93 1.33/1.76" in text  # tokens / FLOPs vs vanilla at d3..d6


def test_committed_smelt_report_prints_no_undefined_number(tmp_path):
    """The smelt-cpu-mini-v1 baseline surface is degenerate: no CE Gain and no baseline TPP, neither a value
    nor an interval; the matching is the matcher's tolerance; the grid cannot identify the surface."""
    for name in ("runs.csv", "lr_sweep.csv"):
        shutil.copy(committed(f"smelt-cpu-mini-v1-{name}"), tmp_path / f"smelt-cpu-mini-v1-{name}")
    report = pipeline.rereport("smelt-cpu-mini-v1", str(tmp_path / "smelt-cpu-mini-v1-runs.csv"), bootstrap=20, log=quiet,
                             progress=False)
    text = (tmp_path / "smelt-cpu-mini-v1-report.txt").read_text()
    assert "+1.0000" not in text and "[undefined" not in text and "undefined]" not in text
    assert "note: the baseline surface is degenerate" in text and "[S5] CE Gain and [S3] TPP: not reported" in text
    assert report["identified"] == {"baseline": False, "smelt": False} and report["ce_gain"] == report["tpp"] == []
    assert "by construction: match.match accepts only a twin with F in [1.000, 1.050]" in text
    assert "F spans 2.2x within each architecture" in text and "not identifiable by design" in text
    assert "4 layers in every cell" in text and "F takes 3 levels" in text
    assert report["grid"]["cells"] == 6 and 2.2 < report["grid"]["F_span"] < 2.3  # the baseline's own F
    committed_text = open(committed("smelt-cpu-mini-v1-report.txt")).read()
    for line in ("note: the baseline surface is degenerate", "[S5] CE Gain and [S3] TPP: not reported",
                 "by construction", "not identifiable by design"):
        assert line in committed_text


def test_plot_writes_figures_or_says_how_to_get_matplotlib(x_micro, tmp_path, monkeypatch, capsys):
    out, archs, _ = x_micro
    pytest.importorskip("matplotlib")
    report = pipeline.ladder("x-micro", out_dir=out, progress=False, log=quiet, archs=archs, fit_only=True, plot=True)
    assert [os.path.basename(p) for p in report["plots"]] == ["loss_vs_compute.png", "multipliers.png"]
    assert all(open(p, "rb").read(4) == b"\x89PNG" for p in report["plots"])
    capsys.readouterr()
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    for p in report["plots"]:
        os.remove(p)
    again = pipeline.ladder("x-micro", out_dir=out, progress=False, log=quiet, archs=archs, fit_only=True, plot=True)
    err = capsys.readouterr().err.strip().splitlines()
    assert again["plots"] == [] and len(err) == 1 and "requirements-plot.txt" in err[0]
    assert not any(os.path.exists(p) for p in report["plots"])


@pytest.mark.parametrize("name", ["smelt-cpu-mini-v1", "x-cpu-mini-v1"])
def test_cpu_mini_designs_sit_near_the_frontier(name):
    """Checked on the plan, before anything trains: TPP >= 10 for every run, the same TPP (within 2x)
    from the smallest to the largest point, at most 4 epochs, and no growth on the decay-start step."""
    preset = get_preset(name)
    records = json.loads(describe_presets(as_json=True))["presets"][name]["runs"]
    assert records and all(r["tpp"] >= 10 for r in records)
    assert all(r["epochs"] is not None and r["epochs"] <= 4 for r in records)
    groups = {}
    for r in records:  # same role (and branch point) at every ladder point
        groups.setdefault((r["role"], r["arch"], r["run_id"].rsplit("-b", 1)[-1] if r["role"] == "branch" else ""),
                          []).append(r["tpp"])
    assert all(max(v) / min(v) <= 2 for v in groups.values())
    for r in records:
        assert set(r) >= {"arch", "params_nonembedding", "params_stored", "tokens", "flops", "tpp", "epochs",
                          "grow_step", "decay_start_step"}
        if r["grow_step"] is not None:
            assert r["grow_step"] != r["decay_start_step"] and r["arch"].endswith("grow")
        elif r["arch"].endswith("grow"):
            pytest.fail(f"{r['run_id']} should grow")
    if name == "x-cpu-mini-v1":
        depths = {r["cell"] for r in records if r["role"] == "run"}
        assert depths == {f"d{d}" for d in preset.depths}
        for d in preset.depths:  # three seeds of the reference at every point (first depth: in the sweep too)
            seeds = {r["run_id"].rsplit("-s", 1)[1] for r in records if r["arch"] == "vanilla" and r["cell"] == f"d{d}"}
            assert seeds == {str(s) for s in SEEDS}


def test_seed_spread_and_within_noise_marking():
    """Synthetic ladders with a known seed spread: the pooled std is recovered; an architecture equal
    to the reference gets multiplier bands that include 1, one with a 1.5x compute advantage does not."""
    rng = np.random.default_rng(0)
    E, A, gamma, C0, sigma = 2.0, 1.5, 0.3, 1e12, 0.005
    budgets = np.geomspace(1e11, 1e13, 5)
    law = lambda C, scale=1.0: E + A * (scale * C / C0) ** -gamma  # noqa: E731
    points = {"vanilla": [(C, law(C) + sigma * rng.standard_normal(), i) for i, C in enumerate(budgets)
                          for _ in range(3)],
              "same": [(C, law(C), i) for i, C in enumerate(budgets)],
              "better": [(C, law(C, 1.5), i) for i, C in enumerate(budgets)]}
    rows = [dict(arch=a, depth=d, loss=l) for a, pts in points.items() for _, l, d in pts]
    per, pooled, dof = seed_spread(rows, ("depth",), "vanilla")
    assert pooled == pytest.approx(sigma, rel=0.5) and all(n == 3 for *_, n in per.values()) and dof == 10
    exact = [dict(arch="vanilla", depth=0, loss=v) for v in (1.0, 1.2, 1.4)] + \
        [dict(arch="vanilla", depth=1, loss=v) for v in (2.0, 2.2)]
    assert seed_spread(exact, ("depth",), "vanilla")[1] == pytest.approx(np.sqrt((0.08 + 0.02) / 3))
    ref_C, bands, _ = multiplier_bootstrap(points, "vanilla", pooled, n_draws=200, seed=1)
    lo, hi = bands["same"]["fitted"]
    assert np.all(lo <= 1.0) and np.all(hi >= 1.0)
    lo, hi = bands["better"]["fitted"]
    assert np.all(lo > 1.2) and np.all(hi < 1.8)
    assert within_noise(0.9, 1.1, 1.0) is True and within_noise(1.1, 1.3, 1.0) is False
    assert within_noise(None, 1.0, 1.0) is None


def test_bootstrap_skips_underdetermined_draws():
    """With 4 cells x 3 points per arch a draw of only 2 distinct cells holds 6 points, too few for
    six coefficients: such draws are skipped and counted, the rest still give intervals."""
    runs = fit.synthetic_surface_runs(seed=1)
    cells = sorted(set(runs["cell"]))[:4]
    keep = np.zeros(len(runs["cell"]), dtype=bool)
    for arch in ("baseline", "smelt"):
        for c in cells:
            keep[np.flatnonzero((runs["arch"] == arch) & (runs["cell"] == c))[:3]] = True
    runs = {k: np.asarray(v)[keep] for k, v in runs.items()}
    out = surface_bootstrap(runs, "baseline", "smelt", [1e20], [0.85], 8, seed=3, progress=False)
    assert 0 < out["skipped"] < 8
    assert np.all(np.isfinite(out["lo"]["ref.gamma"]))


def test_changed_settings_are_refused(tmp_path):
    spec = RunSpec("r1", "vanilla", "d2", "run", dict(max_steps=3), {})
    write_json_atomic(os.path.join(tmp_path, "runs", "r1", "result.json"), dict(settings=dict(max_steps=4)))
    with pytest.raises(ValueError, match="different settings"):
        load_result(str(tmp_path), spec, train.DEFAULTS)
    # a setting added to model.py / train.py since (absent from the stored result) counts when not at its default
    ok = RunSpec("r2", "vanilla", "d2", "run", dict(max_steps=3, zero_initial_state=True, qk_norm=False), {})
    write_json_atomic(os.path.join(tmp_path, "runs", "r2", "result.json"), dict(settings=dict(max_steps=3)))
    assert load_result(str(tmp_path), ok, train.DEFAULTS) is not None
    changed = RunSpec("r2", "vanilla", "d2", "run", dict(max_steps=3, qk_norm=True), {})
    with pytest.raises(ValueError, match="different settings"):
        load_result(str(tmp_path), changed, train.DEFAULTS)
    with pytest.raises(ValueError, match="unknown preset"):
        get_preset("nope")
    assert ladder.main(["--preset", "nope"]) == 2


def test_every_preset_builds_with_valid_train_settings(capsys):
    # GPU presets are documented, not run: they must still match every cell and give valid settings
    assert ladder.main(["--list"]) == 0
    listing = capsys.readouterr().out
    for name in PRESETS:
        assert name in listing and "not buildable" not in listing
    for name in ("smelt-gpu-1node", "x-gpu-2node", "x-cpu-mini", "x-cpu-mini-v1", "x-cpu-repeat", "x-cpu-repeat-v1",
                 "smelt-cpu-mini", "smelt-cpu-mini-v1"):
        preset = get_preset(name)
        specs, _ = full_plan(preset, world=world_size(preset))
        for s in specs:
            for key, value in s.settings.items():
                train.SETTINGS.check(key, value)
            train.SETTINGS.build(train.TrainConfig, train.SETTINGS.resolve(
                {k: v for k, v in s.settings.items() if k != "init_from"}))


def test_sweep_extends_until_every_optimum_is_bracketed():
    """Synthetic sweep losses with a known optimum per architecture (a parabola in log LR): an optimum
    inside the grid adds nothing; one at the edge adds values beyond it until it is inside, at most
    `extend` steps; missing results (--fit-only) stop the extension."""
    archs = ["vanilla", "operator-1", "loop-2"]
    preset = get_preset("x-micro", archs=archs, lr_sweep=LRSweep(key="matrix_lr", values=[0.02, 0.04], extend=2))
    data = data_plan(preset)
    optimum = {"vanilla": 0.03, "operator-1": 0.012, "loop-2": 0.5}  # inside, below, far above the grid
    rounds = []

    def run(specs):
        rounds.append(sorted((s.arch, s.settings["matrix_lr"]) for s in specs))
        return {s.run_id: dict(val_loss=1 + np.log(s.settings["matrix_lr"] / optimum[s.arch]) ** 2) for s in specs}

    results, specs = bracketed_sweep(preset, data, run)
    tried = {a: sorted(s.settings["matrix_lr"] for s in specs if s.arch == a) for a in archs}
    assert tried == {"vanilla": [0.02, 0.04, 0.08],  # 0.04 was best at the edge; 0.08 brackets it
                     "operator-1": [0.005, 0.01, 0.02, 0.04],
                     "loop-2": [0.02, 0.04, 0.08, 0.16]}  # still rising at 2 steps beyond: the limit
    assert len(rounds) == 3 and rounds[1] == [("loop-2", 0.08), ("operator-1", 0.01), ("vanilla", 0.08)]
    assert best_lrs(preset, results, specs) == {"vanilla": 0.04, "operator-1": 0.01, "loop-2": 0.16}
    assert all(s.role == "sweep" and s.cell == "d3" for s in specs)
    lines, table = sweep_table(preset, results, specs, best_lrs(preset, results, specs))
    assert set(table["vanilla"]) == {"0.005", "0.01", "0.02", "0.04", "0.08", "0.16"}
    assert table["vanilla"]["0.16"] is None and table["loop-2"]["0.16"] == pytest.approx(1 + np.log(0.16 / 0.5) ** 2)

    # --fit-only over a sweep whose extension was never trained: the grid's results only, no error
    missing = lambda specs: {s.run_id: (dict(val_loss=1 + np.log(s.settings["matrix_lr"] / optimum[s.arch]) ** 2)  # noqa: E731
                                        if s.settings["matrix_lr"] in (0.02, 0.04) else None) for s in specs}
    _, grid_only = bracketed_sweep(preset, data, missing)
    assert sorted({s.settings["matrix_lr"] for s in grid_only}) == [0.02, 0.04]


# ----------------------------------------------------------------------------------------------------
# --plan CONFIG: the recipe of a config file, derived from it and train.py's defaults

def config_values(path):
    """A config file's settings as train.py resolves them (the numbers the plan must derive, not restate)."""
    return train.SETTINGS.resolve(train.SETTINGS.parse([path]))


def train_args(command):
    """A printed command's train.py arguments (the python / torchrun prefix removed)."""
    words = shlex.split(command)
    return words[:words.index("train.py")], words[words.index("train.py") + 1:]


def test_plan_of_the_smelt_twin_has_its_stable_run_and_six_branches(monkeypatch, capsys):
    import match
    from model import ModelConfig
    from tooling import checkpoint, rundir
    monkeypatch.chdir(REPO)
    path = "config/smelt_200m_s95.py"
    v = config_values(path)
    plan = recipe_plan(path)
    runs = plan["runs"]
    assert len(runs) == 7 and [r["role"] for r in runs] == ["stable"] + ["branch"] * 6
    stable, branches = runs[0], runs[1:]
    # tokens: 256 sequences x 4096 tokens per step on any number of GPUs (global_batch)
    assert plan["tokens_per_step"] == 256 * 4096 == v["global_batch"] * v["block_size"]
    assert stable["steps"] == v["max_steps"] and stable["tokens"] == v["max_steps"] * 256 * 4096
    assert sum(b["decay_tokens"] for b in branches) == 6 * 10**10 == 6 * v["decay_tokens"]
    for b in branches:  # whole steps: the fewest that hold decay_tokens
        assert b["tokens"] == b["steps"] * plan["tokens_per_step"]
        assert b["decay_tokens"] <= b["tokens"] < b["decay_tokens"] + plan["tokens_per_step"]
    # one branch per save step and one from the end, each from a checkpoint the stable run writes (FSDP: .dcp)
    run = rundir.RunDir(os.path.join(v["out_dir"], v["run_name"]), sharded=v["parallel"] != "ddp")
    assert [b["from_step"] for b in branches] == v["save_steps"] + [v["max_steps"]] == [10000, 20000, 50000, 100000,
                                                                                       150000, 196075]
    assert [b["init_from"] for b in branches] == [run.step_path(s) for s in v["save_steps"]] + [run.resume_path]
    assert all(b["init_from"] in stable["checkpoints"] and b["init_from"].endswith(".dcp") for b in branches)
    # every command is train.py's command line under torchrun, one node of 8; its arguments parse
    for r in runs:
        prefix, args = train_args(r["command"])
        assert prefix == ["torchrun", "--standalone", "--nproc_per_node=8"] and args == r["argv"]
        train.SETTINGS.parse(args)
    assert stable["argv"] == [path]
    # a branch's run name is the one rundir.resolve_run gives it, from a checkpoint at that step
    model = {k: v[k] for k in train.SETTINGS.keys[ModelConfig]}
    for b in branches:
        fake = dict(train_config={k: v[k] for k in train.SETTINGS.keys[train.TrainConfig]}, model_config=model,
                    state=dict(step=b["from_step"], seqs_per_step=256, branch_start_step=None, decay_start=v["max_steps"]))
        monkeypatch.setattr(checkpoint, "load_train_checkpoint", lambda p, fake=fake: fake)
        values = rundir.resolve_run(train.SETTINGS, train.SETTINGS.parse(b["argv"]))[0]
        assert values["run_name"] == b["run_name"] == f"{v['run_name']}_decay{b['from_step']}" and values["decay_branch"]
    # FLOPs: match.flops_per_token at the config's avg_doc_len (512), every block execution counted
    F = match.flops_per_token(ModelConfig(**model), avg_doc_len=v["avg_doc_len"])
    assert all(r["flops"] == pytest.approx(F * r["tokens"], rel=1e-12) for r in runs)
    # the data: the stable region, and one branch's tail (every branch reads the same one), the smallest split
    d = plan["data"]
    assert d["stable_tokens"] == stable["windows"] * 4096 + 1 and d["branch_tokens"] == branches[0]["windows"] * 4096 + 1
    assert d["holds_one_branch"] and d["prepared_train_tokens"] is None
    f, n = v["branch_data_fraction"], d["smallest_train_split"]
    fits = lambda n: n - int(n * f) >= d["stable_tokens"] and int(n * f) >= d["branch_tokens"]  # noqa: E731
    assert fits(n) and not fits(n - 1) and not d["problems"]
    # the command line: text and JSON
    assert ladder.main(["--plan", path, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(plan))
    assert ladder.main(["--plan", path]) == 0
    text = capsys.readouterr().out
    assert all(r["command"] in text for r in runs) and "holds one branch" in text


def test_plan_of_the_x_configs_is_one_run_with_its_growth_step(monkeypatch):
    import grow
    import match
    from model import ModelConfig
    monkeypatch.chdir(REPO)
    for name, grows in (("x_d8_loop_grow", True), ("x_d8_vanilla", False)):
        path = f"config/{name}.py"
        v = config_values(path)
        plan = recipe_plan(path)
        (r,) = plan["runs"]
        step_tokens = v["global_batch"] * v["block_size"]  # 256 sequences on any number of processes
        assert r["role"] == "run" and r["run_name"] == name and r["steps"] == v["max_steps"]
        assert r["tokens"] == v["max_steps"] * step_tokens and plan["tokens_per_step"] == step_tokens
        cfg = ModelConfig(**{k: v[k] for k in train.SETTINGS.keys[ModelConfig]})
        if grows:  # [X13]: K passes before the growth step, grow_to after it
            g = grow.growth_step(v["max_steps"], v["grow_at"])
            assert r["grow_step"] == g and r["grow_to"] == v["grow_to"]
            flops = match.run_flops(cfg, [(g * step_tokens, cfg), ((v["max_steps"] - g) * step_tokens,
                                                                    grow.grown_config(cfg, v["grow_to"]))])["flops"]
        else:
            assert r["grow_step"] is None
            flops = match.flops_per_token(cfg) * r["tokens"]
        assert r["flops"] == pytest.approx(flops, rel=1e-12)
        assert train_args(r["command"]) == (["torchrun", "--standalone", "--nproc_per_node=8"], [path])
        assert any("no run of this plan reads" in n for n in plan["data"]["notes"])  # train.py's default tail
    one = recipe_plan("config/x_d8_vanilla.py", gpus=1)["runs"][0]
    assert train_args(one["command"]) == (["python"], ["config/x_d8_vanilla.py"])


def write_config(tmp_path, text, name="c.py"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


STABLE = "max_steps = 40\nbatch_size = 2\nblock_size = 32\ndecay_fraction = 0.0\n"


@pytest.mark.parametrize("text, argv, message", [
    (STABLE + "save_steps = [10, 50]\ndecay_tokens = 640\n", [], "save_steps [50] are after the last step (max_steps=40)"),
    (STABLE + "decay_tokens = 640\nbranch_data_fraction = 0.0\n", [], "branch_data_fraction=0.0 holds no data back"),
    (STABLE.replace("0.0", "0.3") + "save_steps = [10, 35]\ndecay_tokens = 640\n", [], "decay_fraction=0.3"),
    (STABLE + "global_batch = 6\n", ["--gpus", "4"], "global_batch=6 is not a multiple of batch_size x processes"),
    (STABLE + "init_from = 'out/x/ckpt.pt'\n", [], "init_from='out/x/ckpt.pt': --plan plans a recipe from its first step"),
    (STABLE + "max_step = 3\n", [], "unknown key in"),
])
def test_plan_refuses_a_recipe_that_cannot_run(tmp_path, capsys, text, argv, message):
    path = write_config(tmp_path, text)
    err = one_line_error(ladder.main, ["--plan", path, *argv], capsys, "ladder.py")
    assert message in err and (path in err or "global_batch" in message)


def test_plan_checks_the_prepared_data(tmp_path, data_dir):
    """With the data prepared here (~18k train tokens), the plan says whether its regions hold the runs:
    a tail too small for one branch is a problem (train.py would refuse the branches), and so is a stable
    region the stable run reads more than once; the fraction itself fits these runs (0.5)."""
    text = STABLE.replace("batch_size = 2", "batch_size = 8") + f"data_dir = {data_dir!r}\nsave_steps = [20]\n" \
        "decay_tokens = 40 * 8 * 32\nbranch_data_fraction = 0.5\n"
    d = recipe_plan(write_config(tmp_path, text), gpus=1)["data"]
    assert d["exact_fraction"] == pytest.approx(0.5, abs=1e-4) and d["prepared_train_tokens"] < d["read_tokens"]
    stable, branch = d["problems"]
    assert data_dir in stable and "epochs: data repeats" in stable
    assert data_dir in branch and "train.py refuses the branches" in branch


# ----------------------------------------------------------------------------------------------------
# the command line's refusals, Ctrl-C


@pytest.mark.parametrize("argv, message", [
    (["--preset", "smelt-micro", "--workers", "0"], "argument --workers: 0: must be >= 1"),
    (["--preset", "smelt-micro", "--threads", "0"], "argument --threads: 0: must be >= 1"),
    (["--preset", "smelt-micro", "--bootstrap", "-5"], "argument --bootstrap: -5: must be >= 0"),
    (["--preset", "smelt-micro", "--workers", "1.5"], "argument --workers: expected an integer, got '1.5'"),
    (["--preset", "smelt-micro", "--boot", "5"], "unrecognized arguments: --boot 5"),  # no abbreviations
    (["--plan", "config/x_d8_vanilla.py", "--gpus", "0"], "argument --gpus: 0: must be >= 1"),
    (["--plan", "config/x_d8_vanilla.py", "--workers", "2"], "--workers: not used with --plan"),
    (["--preset", "smelt-micro", "--json"], "--json: not used when training a ladder"),
    (["--preset", "smelt-micro", "--gpus", "8"], "--gpus: not used when training a ladder"),
    (["--preset", "x-micro", "--from-csv", "docs/ladder/x-cpu-mini-v1-runs.csv", "--out", "o"], "--out: not used with --from-csv"),
    (["--list", "--plot"], "--plot: not used with --list"),
])
def test_bad_flags_are_one_line_naming_the_flag(argv, message, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert message in one_line_error(ladder.main, argv, capsys, "ladder.py")


def test_fit_only_without_runs_points_at_the_committed_csv(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    err = one_line_error(ladder.main, ["--preset", "x-cpu-mini-v1", "--fit-only", "--plot", "--out", str(tmp_path)],
                         capsys, "ladder.py")
    assert "holds no finished runs" in err and "--from-csv docs/ladder/x-cpu-mini-v1-runs.csv --plot" in err
    err = one_line_error(ladder.main, ["--preset", "smelt-micro", "--fit-only", "--out", str(tmp_path)], capsys,
                         "ladder.py")
    assert "train them first" in err  # no committed runs.csv for the micro presets


@pytest.mark.parametrize("edit, message", [
    (lambda lines: lines[:4] + [lines[3]] + lines[4:], "x-cpu-mini-v1-runs.csv lines 4 and 5: the same row twice (equal run_id)"),
    (lambda lines: [lines[0], re.sub(r",2\.0807\d+,", ",nan,", lines[1])] + lines[2:],
     "x-cpu-mini-v1-runs.csv line 2, column 'loss': value must be finite, got 'nan'"),
])
def test_from_csv_refuses_a_repeated_run_and_a_nan(tmp_path, capsys, edit, message):
    lines = open(committed("x-cpu-mini-v1-runs.csv")).read().splitlines()
    (tmp_path / "x-cpu-mini-v1-runs.csv").write_text("\n".join(edit(lines)) + "\n")
    err = one_line_error(ladder.main, ["--preset", "x-cpu-mini-v1", "--from-csv", str(tmp_path / "x-cpu-mini-v1-runs.csv"),
                                       "--no-progress"], capsys, "ladder.py")
    assert message in err


def children_of(pid):
    """Process ids whose parent is pid (from /proc)."""
    kids = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            kids.append(int(entry))
    return kids


def running(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads process ids from /proc")
@pytest.mark.parametrize("sig, workers", [(signal.SIGINT, 1), (signal.SIGINT, 2), (signal.SIGTERM, 2)])
def test_ctrl_c_is_one_line_exit_130_and_ends_the_workers(tmp_path, sig, workers):
    """SIGINT (Ctrl-C) while a micro ladder trains: one line on stderr saying to rerun the same command,
    status 130, no traceback; with workers, every worker process ends with it (the resource tracker ends
    on its own). SIGTERM (a scheduler) alike, status 143."""
    out = tmp_path / "ladder"
    proc = subprocess.Popen([sys.executable, "ladder.py", "--preset", "smelt-micro", "--out", str(out), "--no-progress",
                             "--workers", str(workers)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    deadline = time.time() + 120
    while not glob.glob(str(out / "runs" / "*" / "train.out")):  # a run has started (train.py prints into it)
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.05)
    time.sleep(0.5)
    workers_of = [k for k in children_of(proc.pid) if b"resource_tracker" not in open(f"/proc/{k}/cmdline", "rb").read()]
    assert len(workers_of) == (workers if workers > 1 else 0)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig and "Traceback" not in err, (proc.returncode, err)  # what went wrong
    what = "interrupted" if sig == signal.SIGINT else "terminated"
    assert err.splitlines() == [f"ladder.py: {what}: rerun the same ladder.py command to continue (finished runs "
                                "are kept)"], err
    deadline = time.time() + 10
    while any(running(k) for k in workers_of) and time.time() < deadline:
        time.sleep(0.1)
    assert not any(running(k) for k in workers_of)
