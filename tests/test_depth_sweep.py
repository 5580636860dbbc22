"""The LR swept at every depth of an [X] ladder (lr_sweep.at_every_depth): every (architecture, depth) runs every
value (x [X16]'s factor from the first depth), each point brackets its own optimum, the ladder point is the runs
at its best value (plus the seeds the sweep did not run), the report rebuilds from its CSVs byte for byte, and
x-cpu-mini-tuned's plan and budget are what its preset says, before anything trains."""

import json
import os
import re
import shutil
from dataclasses import replace

import numpy as np
import pytest

import grow
import ladder
import train
from ladders import pipeline
from ladders.common import data_plan, sweep_limits, world_size
from ladders.presets import SEEDS, X_LR_BETA, LRSweep, get_preset
from ladders.specs import build, describe_presets, full_plan
from ladders.sweep import best_lrs, bracketed_sweep, sweep_from_rows, sweep_lines, sweep_rows, sweep_table
from ladders.x import x_config, x_report
from tooling import tables

MICRO = "x-depth-sweep-micro"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def quiet(*args, **kwargs):
    pass


@pytest.fixture(scope="module")
def micro(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("depth-sweep"))
    report = pipeline.ladder(MICRO, out_dir=out, progress=False, log=quiet, workers=2)
    return out, report


def result(out, run_id):
    with open(os.path.join(out, "runs", run_id, "result.json")) as f:
        return json.load(f)


def test_every_point_runs_every_value_at_its_x16_scale(micro):
    out, _ = micro
    preset = get_preset(MICRO)
    sweep = preset.lr_sweep
    rows = tables.read_rows_csv(os.path.join(out, "lr_sweep.csv"))
    assert list(rows[0]) == ["arch", "depth", "key", "value", "val_loss", "carried"]
    for a in preset.archs:
        anchor = grow.stored_params(x_config(preset, a, preset.depths[0])[0])
        for d in preset.depths:
            tried = {r["value"] for r in rows if r["arch"] == a and r["depth"] == d}
            assert set(sweep.values) <= tried
            scale = (grow.stored_params(x_config(preset, a, d)[0]) / anchor) ** X_LR_BETA[a]  # [X16] from d3
            for v in tried:
                for seed in preset.seeds[:sweep.seeds]:
                    r = result(out, f"{a}-d{d}-{sweep.key}{v:g}-s{seed}")
                    assert r["settings"]["matrix_lr"] == pytest.approx(v * scale, rel=1e-12)
                    assert r["tokens"] == result(out, f"{a}-d{d}-{sweep.key}{sweep.values[0]:g}-s{seed}")["tokens"]
    assert sum(r["carried"] for r in rows) == len(preset.archs) * len(preset.depths)


def test_each_point_is_its_best_value_bracketed(micro):
    out, report = micro
    preset = get_preset(MICRO)
    sweep = preset.lr_sweep
    _, lo, hi = sweep_limits(preset)
    swept = tables.read_rows_csv(os.path.join(out, "lr_sweep.csv"))
    runs = tables.read_rows_csv(os.path.join(out, "runs.csv"))
    assert len(runs) == len(preset.archs) * len(preset.depths) * len(preset.seeds)
    for a in preset.archs:
        for d in preset.depths:
            losses = {r["value"]: r["val_loss"] for r in swept if r["arch"] == a and r["depth"] == d}
            best = min(losses, key=losses.get)
            assert report["lrs"][f"{a}-d{d}"] == best
            assert best not in (min(losses), max(losses)) or not lo < best < hi  # at an edge only at the limit
            point = [r for r in runs if r["arch"] == a and r["depth"] == d]
            assert {r["seed"] for r in point} == set(preset.seeds)  # the sweep's seed and the extra one
            assert {r["run_id"] for r in point} == {f"{a}-d{d}-{sweep.key}{best:g}-s{s}" for s in preset.seeds}
            first = next(r for r in point if r["seed"] == preset.seeds[0])
            assert first["loss"] == pytest.approx(losses[best])  # one sweep seed: its run is the point's


def test_report_says_the_sweep_is_per_depth_and_rebuilds_from_its_csvs(micro, tmp_path):
    out, _ = micro
    text = open(os.path.join(out, "report.txt")).read()
    assert "LR sweep (matrix_lr) at every depth" in text and "full-length ladder runs" in text
    assert "no LR is carried up the ladder" in text and "at the first ladder point" not in text
    assert re.search(r"^ +d4 +0\.02 +0\.04", text, re.M)  # one block per depth
    for name in ("runs.csv", "lr_sweep.csv"):
        shutil.copy(os.path.join(out, name), tmp_path / f"{MICRO}-{name}")
    assert ladder.main(["--preset", MICRO, "--from-csv", str(tmp_path / f"{MICRO}-runs.csv"), "--no-progress"]) == 0
    assert (tmp_path / f"{MICRO}-report.txt").read_text() == text


def test_sweep_brackets_each_point_on_its_own():
    """Synthetic losses, a parabola in log LR with a known optimum per (arch, depth): each point extends
    beyond its own edge until bracketed (at most `extend` steps), independently of the other depths."""
    preset = get_preset(MICRO, archs=("vanilla", "loop-2"),
                        lr_sweep=LRSweep(key="matrix_lr", values=[0.02, 0.04], extend=2, seeds=2, at_every_depth=True))
    data = data_plan(preset)
    optimum = {("vanilla", 3): 0.03, ("vanilla", 4): 0.012, ("loop-2", 3): 0.5, ("loop-2", 4): 0.06}
    rounds = []

    def loss(s):  # in the grid's units (meta lr): the point's optimum, whatever [X16] scales it to
        return 1 + np.log(s.meta["lr"] / optimum[s.arch, s.meta["depth"]]) ** 2 + 1e-3 * (s.meta["seed"] - 1337)

    def run(specs):
        rounds.append(sorted((s.arch, s.meta["depth"], s.meta["lr"]) for s in specs if s.meta["seed"] == SEEDS[0]))
        return {s.run_id: dict(val_loss=loss(s)) for s in specs}

    results, specs = bracketed_sweep(preset, data, run)
    tried = {p: sorted({s.meta["lr"] for s in specs if (s.arch, s.meta["depth"]) == p}) for p in optimum}
    assert tried == {("vanilla", 3): [0.02, 0.04, 0.08], ("vanilla", 4): [0.005, 0.01, 0.02, 0.04],
                     ("loop-2", 3): [0.02, 0.04, 0.08, 0.16], ("loop-2", 4): [0.02, 0.04, 0.08, 0.16]}
    assert rounds[1] == [("loop-2", 3, 0.08), ("loop-2", 4, 0.08), ("vanilla", 3, 0.08), ("vanilla", 4, 0.01)]
    for p, values in tried.items():  # every value tried, lr_sweep.seeds seeds each
        assert sorted(s.meta["lr"] for s in specs if (s.arch, s.meta["depth"]) == p) == sorted(values * 2)
    lrs = best_lrs(preset, results, specs)
    assert lrs == {("vanilla", 3): 0.04, ("vanilla", 4): 0.01, ("loop-2", 3): 0.16, ("loop-2", 4): 0.08}
    # the ladder: each point at its own value, every seed (the sweep's runs at it are the point's)
    points, _ = build(preset, data, lrs)
    ids = {s.run_id for s in specs}
    assert {(s.arch, s.meta["depth"], s.meta["lr"]) for s in points} == {(a, d, v) for (a, d), v in lrs.items()}
    assert all(s.run_id in ids for s in points)
    # the table: one block per depth; lr_sweep.csv's rows give it back (with its depth column)
    lines, table = sweep_table(preset, results, specs, lrs)
    assert set(table) == {3, 4}
    assert re.search(r"^ +d4 +0\.005 +0\.01 +0\.02 +0\.04 +0\.08 +0\.16$", "\n".join(lines), re.M)
    assert table[4]["vanilla"]["0.005"] == pytest.approx(1 + np.log(0.005 / 0.012) ** 2 + 5e-4)  # the seeds' mean
    assert "0.005" not in table[3]["vanilla"] and table[3]["vanilla"]["0.16"] is None  # d3 never tried 0.005
    rows = sweep_rows("matrix_lr", table, lrs)
    assert all("depth" in r for r in rows) and sum(r["carried"] for r in rows) == len(lrs)
    key, losses, chosen = sweep_from_rows(rows)
    assert key == "matrix_lr" and chosen == lrs and sweep_lines(key, losses, chosen)[0] == lines


def test_a_sweep_file_without_depth_reads_as_before():
    rows = [dict(arch="vanilla", key="matrix_lr", value=0.02, val_loss=3.0, carried=False),
            dict(arch="vanilla", key="matrix_lr", value=0.04, val_loss=2.9, carried=True)]
    key, losses, chosen = sweep_from_rows(rows)
    assert losses == {"vanilla": {0.02: 3.0, 0.04: 2.9}} and chosen == {"vanilla": 0.04}
    lines, table = sweep_lines(key, losses, chosen)
    assert lines[0].startswith("LR sweep (matrix_lr) at the first ladder point")
    assert sweep_rows(key, table, chosen) == rows


def test_only_x_ladders_sweep_at_every_depth():
    preset = get_preset("x-repeat-micro")
    with pytest.raises(ValueError, match="at_every_depth is for"):
        build(replace(preset, lr_sweep=replace(preset.lr_sweep, at_every_depth=True)))


def test_cpu_mini_tuned_design_on_the_plan():
    """5 architectures x 4 depths x 3 values x 2 seeds, x-cpu-mini's budgets, valid train settings; its budget
    string names the plan's runs and FLOPs, and its minutes come from x-cpu-mini's measured run times."""
    preset, mini = get_preset("x-cpu-mini-tuned"), get_preset("x-cpu-mini")
    assert preset.archs == ("vanilla", "operator-1", "loop-2", "loop-grow", "untied-grow")
    assert preset.lr_sweep.values == [0.08, 0.16, 0.32] and preset.lr_sweep.extend == 2
    assert preset.lr_sweep.seeds == 2 and preset.seeds == SEEDS[:2] and preset.lr_sweep.at_every_depth
    specs, _ = full_plan(preset, world=world_size(preset))
    assert len(specs) == 5 * 4 * 3 * 2 and all(s.role == "sweep" for s in specs)
    for a in preset.archs:
        for d in preset.depths:
            got = sorted((s.meta["lr"], s.meta["seed"]) for s in specs if s.arch == a and s.meta["depth"] == d)
            assert got == sorted((v, seed) for v in preset.lr_sweep.values for seed in SEEDS[:2])
    ref = {(s.arch, s.meta["depth"]): s.meta["tokens"] for s in full_plan(mini)[0]}
    assert all(s.meta["tokens"] == ref[s.arch, s.meta["depth"]] for s in specs)  # the same points as x-cpu-mini
    for s in specs:
        for key, value in s.settings.items():
            train.SETTINGS.check(key, value)
        train.SETTINGS.build(train.TrainConfig, train.SETTINGS.resolve(s.settings))
    listing = describe_presets(as_json=True)
    plan = json.loads(listing)["presets"]["x-cpu-mini-tuned"]
    flops = f"{plan['flops']:.1e}".replace("e+", "e")  # 9.9e13
    assert f"{len(specs)} runs (plus bracketing), {flops} FLOPs" in preset.budget and len(plan["runs"]) == len(specs)
    rows = tables.read_rows_csv(os.path.join(REPO, "docs", "ladder", "x-cpu-mini-runs.csv"))
    seconds = sum(np.mean([r["seconds"] for r in rows if (r["arch"], r["depth"]) == (s.arch, s.meta["depth"])])
                  for s in specs)
    minutes = int(re.search(r"about (\d+) min on 2 workers", preset.budget).group(1))
    assert minutes == pytest.approx(seconds / 2 / 60 * 1.2, abs=3) and minutes <= 60


def test_report_of_a_per_depth_ladder_without_untied2(tmp_path):
    """Synthetic ladder points of x-cpu-mini-tuned (no untied-2): the claims table skips the pairs it lacks, and
    says that each point's LR is its own, not carried up from d3."""
    preset = get_preset("x-cpu-mini-tuned")
    specs, _ = full_plan(preset)
    factor = {"vanilla": 1.0, "operator-1": 1.1, "loop-2": 1.2, "loop-grow": 1.3, "untied-grow": 1.4}
    rows = []
    for s in specs:
        if s.meta["lr"] != 0.16:
            continue
        C = s.meta["F"] * s.meta["tokens"]
        rows.append(dict(arch=s.arch, cell=s.cell, depth=s.meta["depth"], width=s.meta["width"], seed=s.meta["seed"],
                         C=C, D=s.meta["tokens"], F=s.meta["F"], N=s.meta["N"], N_s=s.meta["N_s"], tpp=s.meta["tpp"],
                         epochs=s.meta.get("epochs"), grow_step=s.meta["grow_step"], run_id=s.run_id, seconds=1.0,
                         loss=1.5 + 30 * (C * factor[s.arch]) ** -0.2 + 0.002 * (s.meta["seed"] - 1337)))
    lrs = {(a, d): 0.16 if d < 6 else 1.28 for a in preset.archs for d in preset.depths}  # 1.28: the limit
    losses = {p: {0.08: 3.0, 0.16: 2.9, 0.32: 2.95 if p[1] < 6 else 2.8} for p in lrs}
    text, _, _ = x_report(preset, rows, sweep_lines("matrix_lr", losses, lrs), n_boot=20, lrs=lrs)
    assert "| paper claim |" in text and "untied-2" not in text
    assert "carried up" not in text.replace("no LR is carried up the ladder", "")
    assert "one sweep at d3" not in text and "each ladder point's LR is the mean-best of its own sweep" in text
    assert "vanilla 0.16/0.16/0.16/1.28" in text and "2 seeds per value" in text
    assert "; 5 of 20 points peaked at the bracketing limit, their optimum may lie beyond (vanilla d6 1.28, " in text
