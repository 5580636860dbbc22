"""ladder.py: the micro presets run the whole pipeline (matching, WSD stable runs, decay branches, CSV,
fits, bootstrap, report), an interrupted ladder resumes without retraining finished runs, and the
tolerant cell bootstrap equals fit.cell_bootstrap when no draw is underdetermined."""

import csv
import json
import os

import numpy as np
import pytest

import fit
import ladder
import train


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


def test_smelt_micro_end_to_end_and_resume(tmp_path):
    out = str(tmp_path / "smelt")
    preset = ladder.get_preset("smelt-micro")
    specs, cells = ladder.build(preset)
    n_branches = len(preset["branch_steps"])
    assert len(specs) == len(preset["cells"]) * 2 * (1 + n_branches)

    # matching: every twin is a SMELT model within the [S] tolerances of its baseline
    for name, base, twin, report in cells:
        assert twin.layout == "smelt" and twin.n_loops == 2 and base.layout == "plain"
        r = report["ratios"]
        assert 1.0 <= r["flops"] <= 1.05 and abs(r["params"] - 1) <= 0.015 and abs(r["kv"] - 1) <= 0.04

    # first attempt is killed in the middle of its third run (a decay branch from the last stable step)
    calls = []
    assert specs[2].role == "branch" and specs[2].meta["branch_step"] == preset["branch_steps"][-1]
    kill = counting_train(calls, stop_after=2, stop_at_step=preset["branch_steps"][-1] + 2)
    with pytest.raises(Interrupted):
        ladder.ladder("smelt-micro", out_dir=out, train_fn=kill, progress=False, log=lambda *a: None)
    assert len(calls) == 2
    done = [s.run_id for s in specs[:2]]
    assert calls == done
    mtimes = {rid: os.path.getmtime(os.path.join(out, "runs", rid, "result.json")) for rid in done}
    killed = os.path.join(out, "runs", specs[2].run_id)
    assert os.path.exists(os.path.join(killed, "ckpt.pt")) and not os.path.exists(os.path.join(killed, "result.json"))

    # the rerun trains exactly the missing runs, in order, and never the finished ones
    calls2 = []
    report = ladder.ladder("smelt-micro", out_dir=out, train_fn=counting_train(calls2), progress=False,
                           bootstrap=20, log=lambda *a: None)
    assert calls2 == [s.run_id for s in specs[2:]]
    for rid, t in mtimes.items():
        assert os.path.getmtime(os.path.join(out, "runs", rid, "result.json")) == t
    # a third invocation trains nothing
    calls3 = []
    ladder.ladder("smelt-micro", out_dir=out, train_fn=counting_train(calls3), progress=False, bootstrap=0,
                  log=lambda *a: None)
    assert calls3 == []

    # decay branches: start from the stable checkpoint, read only held-back data, D = stable + decay tokens
    results = {s.run_id: json.load(open(os.path.join(out, "runs", s.run_id, "result.json"))) for s in specs}
    for s in specs:
        r = results[s.run_id]
        if s.role == "branch":
            stable = results[s.needs]
            assert r["data_region"] == "branch" and stable["data_region"] == "stable"
            assert r["data_read"][0] >= stable["data_split"] and stable["data_read"][1] <= stable["data_split"]
            tokens_per_step = stable["tokens"] // stable["step"]
            assert r["tokens"] == s.meta["branch_step"] * tokens_per_step + preset["decay_tokens"]
            assert r["ckpt_path"] is None  # pruned
    # baseline and twin read the same token sequence (same windows)
    for cell, *_ in cells:
        assert results[f"baseline-{cell}-stable"]["data_read"] == results[f"smelt-{cell}-stable"]["data_read"]

    # runs.csv: one row per branch with the fit columns and the per-source losses
    rows = read_csv(os.path.join(out, "runs.csv"))
    assert len(rows) == len(preset["cells"]) * 2 * n_branches
    for col in ("arch", "cell", "F", "S", "D", "C", "loss", "loss_comedy", "loss_history", "loss_tragedy"):
        assert col in rows[0]
    for row in rows:
        assert float(row["C"]) == pytest.approx(float(row["F"]) * float(row["D"]), rel=1e-9)
        assert 0 < float(row["S"]) < 1 and np.isfinite(float(row["loss"]))
    assert {row["arch"] for row in rows} == {"baseline", "smelt"}

    # report: both surfaces fitted on all points, CE Gain with bootstrap bounds, TPP, win counts
    assert report["runs_finished"] == len(specs)
    for arch in ("baseline", "smelt"):
        assert report["fits"][arch]["n_points"] == len(rows) // 2
    assert report["ce_gain"] and all(np.isfinite(g["value"]) for g in report["ce_gain"])
    assert all(g["lo"] is not None and g["lo"] <= g["hi"] for g in report["ce_gain"])
    assert report["tpp"] and all(t["value"] > 0 for t in report["tpp"])
    wins, pairs = report["wins"]["all"]
    assert pairs == len(rows) // 2 and 0 <= wins <= pairs
    text = open(os.path.join(out, "report.txt")).read()
    assert "CE Gain" in text and "Table 10" in text and "wins" in text


def test_x_micro_equal_flops_growth_and_power_fits(tmp_path):
    out = str(tmp_path / "x")
    archs = ["vanilla", "loop-2", "untied-grow"]  # a subset keeps the test fast; the preset has all six
    preset = ladder.get_preset("x-micro", archs=archs)
    specs, _ = ladder.build(preset)
    assert len(specs) == len(archs) * len(preset["depths"])
    report = ladder.ladder("x-micro", out_dir=out, progress=False, log=lambda *a: None, archs=archs)
    rows = read_csv(os.path.join(out, "runs.csv"))
    assert len(rows) == len(specs)
    by = {(r["arch"], int(r["depth"])): r for r in rows}
    for d in preset["depths"]:
        C = {a: float(by[(a, d)]["C"]) for a in archs}
        # equal compute per ladder point, up to whole steps
        for a in archs:
            assert C[a] == pytest.approx(float(by[(a, d)]["C_target"]), rel=0.2)
        # the looped models see fewer tokens for the same compute
        assert int(by[("loop-2", d)]["D"]) < int(by[("vanilla", d)]["D"])
    # untied-grow really grew: its log shows passes 2 then 4, and the grown checkpoint has 4 untied cores
    log = [json.loads(line) for line in open(os.path.join(out, "runs", f"untied-grow-d{preset['depths'][-1]}", "log.jsonl"))]
    assert set(log[-1]["flops_by_passes"]) == {"2", "4"}
    from model import GPT
    model, _ = GPT.from_checkpoint(os.path.join(out, "runs", f"untied-grow-d{preset['depths'][-1]}", "ckpt.pt"))
    assert model.config.n_passes == 4 and not model.config.tie_core
    # power laws: E from vanilla, one (A, gamma) per fitted arch; multipliers at vanilla's budgets
    assert set(report["fits"]) == set(archs)
    assert 0 < report["fits"]["vanilla"]["E"] < min(float(by[("vanilla", d)]["loss"]) for d in preset["depths"])  # [X7] E below every vanilla loss
    for a in archs[1:]:
        assert len(report["multipliers"][a]) == len(preset["depths"])


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
    out = ladder.surface_bootstrap(runs, "baseline", "smelt", [1e20], [0.85], 8, seed=3, progress=False)
    assert 0 < out["skipped"] < 8
    assert np.all(np.isfinite(out["lo"]["ref.gamma"]))


def test_changed_settings_are_refused(tmp_path):
    spec = ladder.RunSpec("r1", "vanilla", "d2", "run", dict(max_steps=3), {})
    ladder.write_json_atomic(os.path.join(tmp_path, "runs", "r1", "result.json"), dict(settings=dict(max_steps=4)))
    with pytest.raises(ValueError, match="different settings"):
        ladder.load_result(str(tmp_path), spec)
    # a setting added to model.py / train.py since (absent from the stored result) counts when not at its default
    ok = ladder.RunSpec("r2", "vanilla", "d2", "run", dict(max_steps=3, zero_initial_state=True, qk_norm=False), {})
    ladder.write_json_atomic(os.path.join(tmp_path, "runs", "r2", "result.json"), dict(settings=dict(max_steps=3)))
    assert ladder.load_result(str(tmp_path), ok) is not None
    changed = ladder.RunSpec("r2", "vanilla", "d2", "run", dict(max_steps=3, qk_norm=True), {})
    with pytest.raises(ValueError, match="different settings"):
        ladder.load_result(str(tmp_path), changed)
    with pytest.raises(ValueError, match="unknown preset"):
        ladder.get_preset("nope")


def test_every_preset_builds_with_valid_train_settings(capsys):
    # GPU presets are documented, not run: they must still match every cell and give valid settings
    assert ladder.main(["--list"]) == 0
    listing = capsys.readouterr().out
    for name in ladder.PRESETS:
        assert name in listing and "not buildable" not in listing
    for name in ("smelt-gpu-1node", "x-gpu-2node", "x-cpu-mini"):
        preset = ladder.get_preset(name)
        specs, _ = ladder.build(preset, ladder.world_size(preset))
        for s in specs:
            for key, value in s.settings.items():
                train.check_setting(key, value)
