"""The [S] ladder designed to identify its surface: the LR swept at every scale for both arms (each scale's cells
train at its own best value, every seed of both arms), the report's intervals for all six [S2] coefficients and its
identifiability rule (fewer than 4 levels of F: not identifiable by design; more: the profile decides), and
smelt-cpu-surface's plan and budget, before anything trains."""

import json
import os
import re
import shutil

import numpy as np
import pytest

import ladder
import train
from ladders import pipeline
from ladders.common import world_size
from ladders.presets import SEEDS, get_preset
from ladders.smelt import SURFACE_COEFFICIENTS, f_levels, grid_lines, smelt_cells, surface_lines
from ladders.specs import describe_presets, full_plan
from test_depth_sweep import quiet, result
from tooling import tables

MICRO = "smelt-scale-sweep-micro"


@pytest.fixture(scope="module")
def micro(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("scale-sweep"))
    report = pipeline.ladder(MICRO, out_dir=out, progress=False, log=quiet, workers=2)
    return out, report


def test_every_scale_sweeps_both_arms_and_its_cells_train_at_its_best_value(micro):
    out, report = micro
    preset = get_preset(MICRO)
    sweep = preset.lr_sweep
    rows = tables.read_rows_csv(os.path.join(out, "lr_sweep.csv"))
    assert list(rows[0]) == ["arch", "scale", "key", "value", "val_loss", "carried"]
    first_cell = {}
    for scale, n_expert in preset.cells:
        first_cell.setdefault(scale, f"{scale}-e{n_expert}")
    for arch in ("baseline", "smelt"):
        for scale in preset.scales:
            losses = {r["value"]: r["val_loss"] for r in rows if r["arch"] == arch and r["scale"] == scale}
            assert set(sweep.values) <= set(losses)
            for value in losses:  # lr_sweep.seeds seeds of every value, at the scale's first cell, sweep_tpp long
                for seed in SEEDS[:sweep.seeds]:
                    r = result(out, f"sweep-{arch}-{first_cell[scale]}-{sweep.key}{value:g}-s{seed}")
                    assert r["settings"]["matrix_lr"] == value and r["settings"]["seed"] == seed
            best = min(losses, key=losses.get)  # the mean over the seeds (lr_sweep.csv)
            assert report["lrs"][f"{arch}-{scale}"] == best
            assert sum(r["carried"] for r in rows if r["arch"] == arch and r["scale"] == scale) == 1
            for cell_scale, n_expert in preset.cells:  # every cell of the scale: its best value, every seed
                if cell_scale != scale:
                    continue
                for seed in preset.seeds:
                    r = result(out, f"{arch}-{scale}-e{n_expert}-s{seed}-stable")
                    assert r["settings"]["matrix_lr"] == best


def test_both_arms_have_every_seed_in_the_surface_rows(micro):
    out, _ = micro
    preset = get_preset(MICRO)
    runs = tables.read_rows_csv(os.path.join(out, "runs.csv"))
    for arch in ("baseline", "smelt"):
        assert {r["seed"] for r in runs if r["arch"] == arch} == set(preset.seeds)
    assert len(runs) == len(preset.cells) * 2 * len(preset.seeds) * len(preset.branch_tpp)


def test_report_says_the_sweep_is_per_scale_and_rebuilds_from_its_csvs(micro, tmp_path):
    out, _ = micro
    text = open(os.path.join(out, "report.txt")).read()
    assert "LR sweep (matrix_lr) at every scale" in text
    for scale in get_preset(MICRO).scales:  # one block per scale, its values as a header
        assert re.search(rf"^ +{scale}( +0\.00\d+)+$", text, re.M)
    assert "the noise of a difference of two 2-seed means" in text and "one seed of the twin" not in text
    for name in ("runs.csv", "lr_sweep.csv"):
        shutil.copy(os.path.join(out, name), tmp_path / f"{MICRO}-{name}")
    assert ladder.main(["--preset", MICRO, "--from-csv", str(tmp_path / f"{MICRO}-runs.csv"), "--no-progress"]) == 0
    assert (tmp_path / f"{MICRO}-report.txt").read_text() == text


def test_the_surface_table_gives_every_coefficient_its_interval():
    class Fit:
        E, A, a, b, K, c, gamma, rmse, n_points = 1.2, 30.0, 0.3, 0.5, 8.0, 0.4, 0.4, 0.01, 30
    fits = {"baseline": Fit(), "smelt": Fit()}
    lo = {f"{role}.{k}": 0.5 * getattr(Fit, k) for role in ("ref", "target") for k in SURFACE_COEFFICIENTS}
    hi = {f"{role}.{k}": 1.5 * getattr(Fit, k) for role in ("ref", "target") for k in SURFACE_COEFFICIENTS}
    lo["target.b"] = -0.1  # an exponent whose interval reaches 0
    out = {"fits": {"baseline": {}, "smelt": {}}}
    text = "\n".join(surface_lines(fits, {"lo": lo, "hi": hi}, out))
    assert "95% cell-bootstrap interval of every coefficient" in text
    for coef in SURFACE_COEFFICIENTS:
        assert len(re.findall(rf"^ +{coef} = ", text, re.M)) == 2
        assert out["fits"]["baseline"][f"{coef}_interval"] == [lo[f"ref.{coef}"], hi[f"ref.{coef}"]]
    assert text.count("interval reaches 0") == 1 and "b = 0.5 [-0.1, 0.75]  <- interval reaches 0" in text


def test_fewer_than_four_levels_of_f_is_not_identifiable_by_design_more_is_the_profiles_call():
    def lines(F):
        n = len(F)
        runs = dict(arch=np.array(["baseline"] * n), cell=np.array([f"c{i}" for i in range(n)]), F=np.array(F),
                    S=np.full(n, 0.8), D=np.full(n, 1e5))
        return "\n".join(grid_lines([dict(n_layer=2)] * n, runs, {}))
    three = lines([1e5, 1.1e5, 2e5, 4e5, 8e5, 1.2e6])  # 1e5 and 1.1e5 are one level: 5 levels, 12x
    assert "not identifiable by design" not in three and "decade" not in three
    assert "not identifiable by design" in lines([1e5, 2e5, 4e5])  # 3 levels
    five = lines([1e5, 1.5e5, 2.3e5, 3.4e5, 5e5])  # 5 levels, 5x
    assert "not identifiable by design" not in five and "the profile's call" in five


def test_smelt_cpu_surface_design_on_the_plan():
    """6 scales, 2 sparsities each (S about 0.75 and 0.9), F at 6 levels per arm; 2 seeds of both arms; each
    (arm, scale) swept at its first cell, 3 values x 2 seeds; every run's settings valid; the budget string names
    the plan's runs and FLOPs and stays within 75 minutes."""
    preset = get_preset("smelt-cpu-surface")
    assert len(preset.scales) >= 5 and preset.seed_every_arch and preset.seeds == SEEDS[:2]
    cells = smelt_cells(preset)
    assert len(cells) == 2 * len(preset.scales)
    for name, baseline, twin, _ in cells:  # a twin [S] would train: narrowed, not 8 wide with 1,005 experts
        assert 0.7 <= twin.n_embd / baseline.n_embd <= 1 and twin.n_expert <= 2.5 * baseline.n_expert, name
    specs, _ = full_plan(preset, world=world_size(preset))
    stable = [s for s in specs if s.role == "stable"]
    for arch in ("baseline", "smelt"):
        F = [s.meta["F"] for s in stable if s.arch == arch]
        assert len(f_levels(F)) == len(preset.scales)  # F moves within each sparsity: one level per scale
        for scale, n_expert in preset.cells:
            seeds = {s.settings["seed"] for s in stable if s.arch == arch and s.cell == f"{scale}-e{n_expert}"}
            assert seeds == set(SEEDS[:2])
        S = sorted({round(s.meta["S"], 2) for s in stable if s.arch == "baseline"})
        assert min(S) < 0.8 and max(S) > 0.88  # two sparsities
        for scale in preset.scales:
            swept = [s for s in specs if s.role == "sweep" and s.arch == arch and s.meta["scale"] == scale]
            assert sorted((s.settings["matrix_lr"], s.settings["seed"]) for s in swept) == sorted(
                (v, seed) for v in preset.lr_sweep.values for seed in SEEDS[:2])
            assert all(s.meta["tpp"] == preset.sweep_tpp for s in swept)
    for s in specs:
        for key, value in s.settings.items():
            train.SETTINGS.check(key, value)
        train.SETTINGS.build(train.TrainConfig, train.SETTINGS.resolve(s.settings))
    plan = json.loads(describe_presets(as_json=True))["presets"]["smelt-cpu-surface"]
    flops = f"{plan['flops']:.1e}".replace("e+", "e")
    assert f"{len(specs)} runs (plus bracketing), {flops} FLOPs" in preset.budget and len(plan["runs"]) == len(specs)
    minutes = int(re.search(r"about (\d+) min on 2 workers", preset.budget).group(1))
    assert minutes == pytest.approx((plan["flops"] / 1.04e10 + 3 * len(specs)) / 2 / 60, abs=3) and minutes <= 75


def test_committed_surface_report_rebuilds_from_its_csvs_and_says_what_the_docs_quote(tmp_path):
    """docs/ladder/smelt-cpu-surface-report.txt is what `ladder.py --from-csv` writes from its CSVs (bootstrap
    intervals masked: their last digits are the CPU's); the run's surfaces reach E = 0 along the profile of a, so
    they are not identified and no CE Gain or TPP is printed, whatever the F levels."""
    from test_ladder import committed, mask_bands
    name = "smelt-cpu-surface"
    for part in ("runs.csv", "lr_sweep.csv"):
        shutil.copy(committed(f"{name}-{part}"), tmp_path / f"{name}-{part}")
    report = pipeline.rereport(name, str(tmp_path / f"{name}-runs.csv"), log=quiet, progress=False)
    text = (tmp_path / f"{name}-report.txt").read_text()
    assert mask_bands(text) == mask_bands(open(committed(f"{name}-report.txt")).read())
    assert report["grid"]["F_levels"] == {"baseline": 5, "smelt": 5} and report["grid"]["cells"] == 10
    assert report["identified"] == {"baseline": False, "smelt": False} and report["ce_gain"] == report["tpp"] == []
    assert all(p["E_reaches_0"] and not p["at_edge"] for p in report["profile"].values())
    assert "NOT identified (E reaches 0 along it: the floor is not resolved)" in text
    for row in ("per-pair wins (SMELT loss < baseline loss at the same cell, branch and seed): 2/60",
                "| SMELT reaches a lower loss than its compute-matched baseline in every pair ([S]: 96/96) | does not | "
                "2/60 pairs; SMELT - baseline +0.0552 [+0.0325, +0.0779]",
                "| CE Gain [S5] 6.8-18% at 1e20-1e21 FLOPs, and the compute-optimal TPP [S3] | cannot tell | not reported",
                "6 of 10 optima resolved", "pooled 0.0103"):
        assert row in text
