"""The data-constrained ladder with its LR tuned where it is used (RepeatPreset.tune_every_point, x-cpu-repeat-tuned):
the search finds a known optimum of LR and weight decay at every point, every best is bracketed by its
neighbours on both grids, the other seeds run at the best pair; a ladder that builds on a finished one's
runs.csv (builds_on) trains none of its runs again and ends where retraining everything ends; a row that is
not a run of the preset is refused in one line."""

import math
import os
import shutil

import pytest

import grow
from conftest import rebuilt_committed
from ladders import pipeline
from ladders.common import data_plan, grid_limits, lr_scaling, sweep_limits
from ladders.presets import get_preset
from ladders.repeat import imported_results, lr_keys, repeat_arms, repeat_config, repeat_tuned
from ladders.specs import build
from tooling import tables

OPT_LR = {1: 0.04, 2: 0.02}  # the known optimum of the matrix LR (as the first depth's value) and of the weight
OPT_WD = {1: 0.025, 2: 0.4}  # decay per K: the search must move off the carried LR and the grid's middle


def known_loss(settings):
    """A loss with a known optimum: a bowl in log LR and log weight decay around OPT_* of its K (the LR
    divided by [X16]'s factor at its depth, so that the optimum is the same grid value at every depth),
    plus a small seed offset (the pooled seed std is not 0)."""
    preset = get_preset("x-repeat-tuned-micro")
    k, depth = settings["n_passes"], settings["n_layer"]
    anchor = grow.stored_params(repeat_config(preset, 1, preset.depths[0]))
    n_s = grow.stored_params(repeat_config(preset, k, depth))
    lr = settings["matrix_lr"] / lr_scaling(n_s, anchor, preset.lr_scaling_beta)
    return (3.0 - 0.01 * depth - 0.02 * k + 0.01 * math.log2(lr / OPT_LR[k]) ** 2
            + 0.004 * math.log2(settings["weight_decay"] / OPT_WD[k]) ** 2 + 0.0005 * (settings["seed"] - 1337))


def counting_known(calls):
    def train_fn(settings):
        calls.append(settings["run_name"])
        tokens = settings["max_steps"] * settings["batch_size"] * settings["block_size"]
        return dict(val_loss=known_loss(settings), tokens=tokens, seconds=0.0, max_steps=settings["max_steps"],
                    step=settings["max_steps"], flops=6.0 * tokens * settings["n_layer"] * settings["n_passes"] * 1e3,
                    train_losses=[known_loss(settings) - 0.1])
    return train_fn


def quiet(*args, **kwargs):
    pass


def ladder(out, calls, **overrides):
    return pipeline.ladder("x-repeat-tuned-micro", out_dir=str(out), train_fn=counting_known(calls), progress=False,
                           log=quiet, **overrides)


def reachable_best(preset, k, depth, lr0):
    """The grid pair (LR as the first depth's value, weight decay) the search can reach with the lowest known loss."""
    lr_ratio, lr_lo, lr_hi = sweep_limits(preset)
    wd_ratio, wd_lo, wd_hi = grid_limits(preset.weight_decays, preset.wd_extend)
    lrs = [lr0 * lr_ratio ** j for j in range(-6, 7) if lr_lo / lr_ratio <= lr0 * lr_ratio ** j <= lr_hi * lr_ratio]
    wds = [preset.weight_decays[0] * wd_ratio ** j for j in range(-6, 7)
           if wd_lo / wd_ratio <= preset.weight_decays[0] * wd_ratio ** j <= wd_hi * wd_ratio]
    cfg = repeat_config(preset, k, depth)
    scale = lr_scaling(grow.stored_params(cfg), grow.stored_params(repeat_config(preset, 1, preset.depths[0])),
                       preset.lr_scaling_beta)
    return min(((v, w) for v in lrs for w in wds), key=lambda p: known_loss(
        dict(n_passes=k, n_layer=depth, matrix_lr=p[0] * scale, weight_decay=p[1], seed=1337)))


def test_search_recovers_a_known_optimum_at_every_point(tmp_path):
    calls = []
    report = ladder(tmp_path, calls)
    preset = get_preset("x-repeat-tuned-micro")
    rows = tables.read_rows_csv(os.path.join(tmp_path, "runs.csv"))
    lr0 = report["lrs"][lr_keys(preset)[0]]
    lr_ratio, lr_lo, lr_hi = sweep_limits(preset)
    wd_ratio, wd_lo, wd_hi = grid_limits(preset.weight_decays, preset.wd_extend)
    for k in preset.passes:
        for d in preset.depths:
            mine = [r for r in rows if r["K"] == k and r["depth"] == d]
            first = {(round(math.log2(r["lr"] / [x for x in mine if x["role"] == "run"][0]["lr"])), r["wd"]): r["loss"]
                     for r in mine if r["role"] != "seed"}
            (step, wd) = min(first, key=first.get)
            v, w = reachable_best(preset, k, d, lr0)
            assert (lr0 * 2.0 ** step, wd) == pytest.approx((v, w))  # the known optimum, as near as the grids go
            lr_best = lr0 * 2.0 ** step
            needed = [(step - 1, wd)] * (lr_best > lr_lo) + [(step + 1, wd)] * (lr_best < lr_hi) + \
                [(step, wd / wd_ratio)] * (wd > wd_lo) + [(step, wd * wd_ratio)] * (wd < wd_hi)
            for j, nw in needed:  # the best is bracketed on both grids (inside their limits)
                assert any(jj == j and ww == pytest.approx(nw) for jj, ww in first), (k, d, j, nw)
            best = [r for r in mine if r["loss"] == first[step, wd]][0]
            seeds = [r for r in mine if r["role"] == "seed"]
            assert {r["seed"] for r in seeds} == set(preset.seeds[1:])
            assert {(r["lr"], r["wd"]) for r in seeds} == {(best["lr"], best["wd"])}  # seeds at the best pair
    assert len(calls) == len(set(calls))  # every run trained once
    text = open(os.path.join(tmp_path, "report.txt")).read()
    assert "LR searched with the weight decay at every (K, stored depth)" in text
    assert "the LR was searched with the weight decay at every (K, depth): the carried LR stayed best at" in text
    assert set(report["lr_search"]) == {f"K{k}-d{d}" for k in preset.passes for d in preset.depths}


def test_a_ladder_that_builds_on_finished_runs_trains_none_of_them_again(tmp_path):
    """Stage 1 (the same preset without the search) into A; the tuned ladder building on A's runs.csv retrains
    only the LR sweep (its losses compared with A's lr_sweep.csv) and ends where the tuned ladder trained from
    scratch ends: the same runs, the same losses; its report rebuilds from its CSVs byte for byte."""
    first, second, scratch = [], [], []
    ladder(tmp_path / "a", first, tune_every_point=False)
    a_rows = tables.read_rows_csv(tmp_path / "a" / "runs.csv")
    report = ladder(tmp_path / "b", second, builds_on=str(tmp_path / "a" / "runs.csv"))
    ladder(tmp_path / "c", scratch)
    b_rows = tables.read_rows_csv(tmp_path / "b" / "runs.csv")
    c_rows = tables.read_rows_csv(tmp_path / "c" / "runs.csv")
    a_ids = {r["run_id"] for r in a_rows}
    sweep_ids = {s.run_id for s in build(get_preset("x-repeat-tuned-micro"))[0]}
    assert set(second) & a_ids <= sweep_ids and set(second) & sweep_ids == sweep_ids  # of A's runs, the sweep only
    assert {r["run_id"] for r in b_rows if r["imported"]} == ({r["run_id"] for r in b_rows} & a_ids) - sweep_ids
    strip = lambda rows: sorted((r["run_id"], r["role"], r["loss"]) for r in rows)  # noqa: E731
    assert strip(b_rows) == strip(c_rows)
    text = open(tmp_path / "b" / "report.txt").read()
    imported = sum(r["imported"] for r in b_rows)
    assert f"builds on {tmp_path / 'a' / 'runs.csv'}: {imported} of these {len(b_rows)} runs are its runs" in text
    assert "the largest difference from its lr_sweep.csv 0 nats" in text
    assert report["lr_search"]
    for name in ("runs.csv", "lr_sweep.csv"):
        shutil.copy(tmp_path / "b" / name, tmp_path / f"x-repeat-tuned-micro-{name}")
    pipeline.rereport("x-repeat-tuned-micro", str(tmp_path / "x-repeat-tuned-micro-runs.csv"), log=quiet,
                      builds_on=str(tmp_path / "a" / "runs.csv"))
    assert (tmp_path / "x-repeat-tuned-micro-report.txt").read_text() == text


def test_builds_on_refuses_a_row_that_is_not_a_run_of_the_preset(tmp_path):
    ladder(tmp_path / "a", [], tune_every_point=False)
    rows = tables.read_rows_csv(tmp_path / "a" / "runs.csv")
    preset = get_preset("x-repeat-tuned-micro")
    for column, value in (("D", rows[3]["D"] + 128), ("wd", 0.3), ("K", 3)):
        bad = [dict(r) for r in rows]
        bad[3][column] = value
        tables.write_rows_csv(str(tmp_path / "bad-runs.csv"), bad)
        with pytest.raises(ValueError, match=rf"bad-runs.csv line 5: run {rows[3]['run_id']} is not a run of preset "
                                             "x-repeat-tuned-micro"):
            imported_results(get_preset(preset.name, builds_on=str(tmp_path / "bad-runs.csv")), data_plan(preset))
    with pytest.raises(ValueError, match="builds_on .*missing-runs.csv: no such file"):
        imported_results(get_preset(preset.name, builds_on=str(tmp_path / "missing-runs.csv")), data_plan(preset))


def test_x_cpu_repeat_tuned_is_x_cpu_repeat_continued():
    """x-cpu-repeat-tuned: x-cpu-repeat's settings with the search; every committed x-cpu-repeat run imports as a
    run of it, and with them its grid is complete (nothing of the first stage is trained again)."""
    tuned, first = get_preset("x-cpu-repeat-tuned"), get_preset("x-cpu-repeat")
    assert tuned.tune_every_point and not first.tune_every_point
    for f in ("model", "train", "arms", "depths", "passes", "weight_decays", "seeds", "lr_sweep", "lr_scaling_beta",
              "width_per_depth", "wd_extend", "seeded_passes"):
        assert getattr(tuned, f) == getattr(first, f), f
    data = data_plan(tuned)
    imported = imported_results(tuned, data)
    assert len(imported) == len(tables.read_rows_csv(os.path.join(pipeline.REPO, tuned.builds_on)))
    lrs = {key: 0.08 for key in lr_keys(tuned)}  # what x-cpu-repeat's sweep chose in every budget (its lr_sweep.csv)
    specs, complete = repeat_tuned(tuned, data, lrs, imported)
    assert not complete and {s.role for s in specs if s.run_id not in imported} == {"tune"}
    assert len([s for s in specs if s.run_id not in imported]) == 2 * len(repeat_arms(tuned)) * len(tuned.passes) \
        * len(tuned.depths)  # the search's first step: the LR / 2 and x 2 at every point's best weight decay


def test_committed_tuned_report_rebuilds_from_its_csv(tmp_path):
    """docs/ladder/x-cpu-repeat-tuned-report.txt is what `ladder.py --from-csv` writes from the committed CSVs
    (bootstrap bands masked), and says what the README and docs/ladder.md quote: every point bracketed, the
    LR exponent against [X16]'s, the claims that depend on where K = 1's best size is."""
    report, text = rebuilt_committed("x-cpu-repeat-tuned", tmp_path)
    rows = tables.read_rows_csv(os.path.join(pipeline.REPO, "docs", "ladder", "x-cpu-repeat-tuned-runs.csv"))
    first = tables.read_rows_csv(os.path.join(pipeline.REPO, get_preset("x-cpu-repeat-tuned").builds_on))
    assert {r["run_id"] for r in rows if r["imported"]} <= {r["run_id"] for r in first}
    for arm, out in report["arms"].items():
        assert len(out["lr_search"]) == 12 and not any(v["edge"] for v in out["lr_search"].values())
        lo, hi = out["lr_exponent"]["interval"]
        assert hi < -0.6 or lo > -0.6  # the best LR does not follow [X16]'s beta here
    assert "its LR sweep, retrained here: 12 values, the largest difference from its lr_sweep.csv 0 nats" in text
    for row in ("| the best LR scales with stored parameters as [X16] with beta -0.6 (the [X] code's Operator-1 "
                "ladder) | does not |",
                "| looping reaches a loss WD-tuned K = 1 does not (K = 4 vs K = 1, each at its best size) | cannot "
                "tell |",
                "| looping reaches the best K = 1 loss with 1/2.2 of its compute (C*/C = 2.2) | does not |",
                "| the looped models' advantage comes from the repeated data (a larger looping gain with 10 epochs "
                "than with fresh data) | reproduces |"):
        assert row in text
    assert report["across"]["gain_effect"]["lo"] > 0
