"""ladder.py and ladders/: the statistics against scipy, the searches, the reports' rules on
known inputs, resuming, tiny presets end to end, and the committed reports byte for byte."""

import importlib.util
import itertools
import json
import math
import os
import re
import shutil

import numpy as np
import pytest
from scipy import stats as scipy_stats

import fit
import synthetic_runs
import ladder
from ladders import decompose, khop, recipe, smelt, testtime, x
from ladders.presets import PRESETS, SEEDS
from ladders.runs import RunSpec, load_results
from ladders.stats import paired, pooled_std, profile_bound, profile_interval, seed_draws, t_interval

DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "ladder")
KEPT = [name for name in PRESETS if name != "smelt-micro"]


def preset(name, **changes):
    return dict(PRESETS[name], name=f"{name}-test", **changes)


# tiny designs, built here: the numbers mean nothing
ONE_LR = dict(key="matrix_lr", extend=0, seeds=1, every_point=False)
SMELT_TINY = preset("smelt-micro", cells=[("w32", 8)], branch_tpp=[0.1, 0.2], seeds=SEEDS[:1], workers=1,
                    bootstrap=0, lr=dict(ONE_LR, values=[4e-3]),
                    scales={"w32": PRESETS["smelt-micro"]["scales"]["w32"]})
X_TINY = preset("x-cpu-mini", model=dict(block_size=32), depths=[3], archs=("vanilla", "loop-grow"),
                seeds=SEEDS[:1], train=dict(batch_size=4, eval_tokens=512), lr=dict(ONE_LR, values=[0.04]),
                tpp_stored={"vanilla": 0.05, "loop-grow": 0.1}, workers=2)
KHOP_TINY = preset("smelt-cpu-khop", seeds=[1338], max_steps=6, eval_every=3, test_passes=3, workers=1,
                   train=dict(n_embd=24, n_head=2, head_dim=12, batch_size=4, warmup_steps=2))
TESTTIME_TINY = preset("x-cpu-testtime", depths=[3], seeds=[1], choices=[1, 2], test_passes=3, tpp_stored=0.1,
                       workers=1, model=dict(block_size=32), train=dict(batch_size=4, eval_tokens=512))



def test_t_intervals_pooled_stds_and_paired_contrasts_are_scipys():
    seeds = np.array([1.9414, 1.9324, 1.9419])
    mean, sem = seeds.mean(), scipy_stats.sem(seeds)
    lo, hi = t_interval(mean, seeds.std(ddof=1), 3, 2)
    assert (lo, hi) == pytest.approx(scipy_stats.t.interval(0.95, 2, mean, sem))
    sigma, dof = pooled_std([[1.0, 1.2, 1.4], [2.0, 2.2], [3.0]])  # a group of one adds nothing
    assert dof == 3 and sigma == pytest.approx(math.sqrt((0.08 + 0.02) / 3))
    assert pooled_std([[1.0], [2.0]]) == (None, 0)
    # A contrast paired by seed: on one point scipy's paired t-test; on several, the spread pooled.
    a, b = np.array([1.884, 1.875, 1.892, 1.880]), np.array([1.870, 1.866, 1.873, 1.871])
    c, ref = paired({"p": list(a - b)}), scipy_stats.ttest_rel(a, b)
    assert c["z"] == pytest.approx(ref.statistic) and c["p"] == pytest.approx(ref.pvalue) and c["dof"] == 3
    ci = ref.confidence_interval()
    assert (c["lo"], c["hi"]) == pytest.approx((ci.low, ci.high))
    d = {"p": [0.01, 0.03], "q": [0.02, 0.05, 0.02]}
    (sigma, dof), c = pooled_std(d.values()), paired(d)
    assert c["diff"] == pytest.approx((0.02 + 0.03) / 2) and dof == 3
    assert c["sigma"] == pytest.approx(sigma * math.sqrt(1 / 2 + 1 / 3) / 2)


def test_seed_bootstrap_gives_t_intervals_deterministically():
    draws = seed_draws([1.0, 2.0], [3, 1], 0.01, 4, n_draws=40000, seed=7)
    assert np.array_equal(draws, seed_draws([1.0, 2.0], [3, 1], 0.01, 4, n_draws=40000, seed=7))
    for j, (mean, n) in enumerate(((1.0, 3), (2.0, 1))):
        band = np.percentile(draws[:, j], [2.5, 97.5])
        assert band == pytest.approx(t_interval(mean, 0.01, n, 4), abs=0.02 * 0.01 * 2.78 / math.sqrt(n))


def test_profile_interval():
    assert profile_bound(3.74e-4, 54) == pytest.approx(scipy_stats.chi2.ppf(0.95, 1) / 2 * 3.74e-4 / 54)
    a = np.linspace(0, 2, 21)
    lo, hi, edge = profile_interval(a, (a - 1.0) ** 2, 0.045)  # inside: |a - 1| <= 0.2; then the next values
    assert (lo, hi, edge) == (pytest.approx(0.7), pytest.approx(1.3), False)
    assert profile_interval(a, np.zeros_like(a), 0.01) == (0.0, 2.0, True)  # flat: not bounded by the data



# A train.train stand-in for smelt-micro (128 tokens a step): a loss falling with the run's steps.
def fake_train(settings):
    steps = settings.get("max_steps") or int(re.search(r"step(\d+)", settings["init_from"]).group(1)) + \
        settings["decay_tokens"] // 128
    return dict(val_loss=3.0 - 0.1 * math.log(steps) + 0.01 * (settings.get("seed", 1337) - 1337),
                tokens=steps * 128, flops=1e6 * steps, step=steps, seconds=0.0, train_losses=[1.0],
                val_loss_by_source=None)


def test_each_sweep_point_brackets_its_own_optimum():
    p = preset("x-cpu-mini-tuned", archs=("vanilla", "loop-2"), depths=[3, 4], seeds=SEEDS[:2],
               lr=dict(key="matrix_lr", values=[0.02, 0.04], extend=2, seeds=2, every_point=True))
    optimum = {("vanilla", 3): 0.03, ("vanilla", 4): 0.012, ("loop-2", 3): 0.5, ("loop-2", 4): 0.06}

    def loss(m):
        return 1 + np.log(m["grid_lr"] / optimum[m["arch"], m["depth"]]) ** 2 + 1e-3 * (m["seed"] - 1337)
    specs, sweep, _ = ladder.resolve(p, lambda specs: {s.run_id: dict(val_loss=loss(s.meta)) for s in specs})
    tried = {pt: sorted({s.meta["grid_lr"] for s in specs if (s.meta["arch"], s.meta["depth"]) == pt})
             for pt in optimum}
    assert tried == {("vanilla", 3): [0.02, 0.04, 0.08], ("vanilla", 4): [0.005, 0.01, 0.02, 0.04],
                     ("loop-2", 3): [0.02, 0.04, 0.08, 0.16], ("loop-2", 4): [0.02, 0.04, 0.08, 0.16]}
    best = {(r["arch"], r["depth"]): r["value"] for r in sweep if r["carried"]}
    assert best == {("vanilla", 3): 0.04, ("vanilla", 4): 0.01, ("loop-2", 3): 0.16, ("loop-2", 4): 0.08}
    ladder_runs = x.rows([s for s in specs if s.meta.get("role") != "sweep"], {s.run_id: dict(
        flops=1.0, tokens=1.0, val_loss=1.0, seconds=0.0, val_loss_by_source=None) for s in specs})
    assert {r["run_id"] for r in ladder_runs} == {f"{a}-d{d}-matrix_lr{v:g}-s{s}"
                                                  for (a, d), v in best.items() for s in SEEDS[:2]}


def synthetic_rows(scales):
    runs = synthetic_runs.synthetic_surface_runs(seed=0, scales=scales, n_checkpoints=3)
    return [dict(arch=a, cell=c, F=F, S=S, D=D, C=F * D, loss=loss, branch_tpp=0, seed=1337)
            for a, c, F, S, D, loss in zip(*(runs[k] for k in ("arch", "cell", "F", "S", "D", "loss")))]


@pytest.mark.parametrize("name", ["x-cpu-mini", "x-cpu-mini-tuned"])
def test_the_x_ladders_scale_every_lr_with_stored_parameters_by_x16(name):
    """[X16] GLR(N) = GLR(N_0) (N / N_0)^beta, N the built module's stored parameters."""
    from model import GPT
    p = PRESETS[name]
    for arch in p["archs"]:
        beta = p["lr_beta"][arch]
        stored = {d: sum(w.numel() for w in GPT(x.config(p, arch, d)).parameters()) for d in p["depths"]}
        recipe = x.recipe(arch)[1]
        for depth in p["depths"]:
            settings = x.settings_of(p, arch, depth, x.config(p, arch, depth), 100, 0.05, beta)
            factor = (stored[depth] / stored[p["depths"][0]]) ** beta
            assert factor <= 1 and (factor < 0.9) == (depth > p["depths"][0])  # deeper, smaller steps
            for key in ("matrix_lr", "embedding_lr", "unembedding_lr"):
                want = 0.05 * recipe[key] / recipe["matrix_lr"] * factor
                assert settings[key] == pytest.approx(want, rel=1e-9), (arch, depth, key)


def test_a_surface_is_reported_only_where_the_grid_identifies_it(monkeypatch):
    assert [len(smelt.f_levels(F)) for F in ([1.0, 1.05, 2.0, 2.2, 4.0], [1.0, 1.2, 1.44])] == [3, 1]
    monkeypatch.setattr(smelt, "PROFILE_A", np.geomspace(0.01, 10.0, 16))  # a coarser profile: faster
    text = "\n".join(smelt.surface_lines(dict(bootstrap=8), synthetic_rows((2.5e8, 5e8, 1e9, 2e9))))
    for arch in smelt.ARCHS:
        lo, hi = map(float, re.search(rf"{arch} .*\n.* a in \[([0-9.e-]+), ([0-9.e-]+)\]", text).groups())
        assert lo < synthetic_runs.SYNTHETIC_SURFACES[arch]["a"] < hi
    assert "NOT identified" not in text and "cell bootstrap: 8 draws" in text
    assert len(re.findall(r"CE Gain of SMELT at C=.* \[[-+0-9.]+, [-+0-9.]+\]", text)) == 2 * 3
    committed = open(os.path.join(DOCS, "smelt-cpu-mini-report.txt")).read()
    assert committed.count("NOT identified (F at 3 levels") == 2 and "TPP: not reported" in committed


def test_multipliers_read_seed_means_and_their_bands_hold_them():
    """Two seeds at one compute must not make a crossing of their own."""
    arm = [(1e12, 1.93, 3), (1e12, 1.89, 3), (2e12, 1.86, 4), (2e12, 1.84, 4), (4e12, 1.80, 5),
           (4e12, 1.80, 5)]
    C, L = x.depth_means(arm)
    assert list(C) == [1e12, 2e12, 4e12] and L == pytest.approx([1.91, 1.85, 1.80])
    assert fit.compute_multiplier([2e12], [1.90], C, L)[0] == pytest.approx(2 / 2 ** (1 / 6))
    pts = {name: [(c, l + 1e-3 * (i % 2), d) for i, (c, d, l) in enumerate(
        (c, d, l) for c, d, l0 in zip((1e12, 2e12, 4e12), (3, 4, 5), losses) for l in (l0, l0))]
        for name, losses in (("vanilla", (1.95, 1.90, 1.85)), ("b", (1.91, 1.85, 1.80)))}
    lo, hi, defined = x.multiplier_bands(pts, (), 400, 0)["b", "vanilla"]
    m = fit.compute_multiplier(*x.depth_means(pts["vanilla"]), *x.depth_means(pts["b"]))
    assert np.all((lo <= m) & (m <= hi) | np.isnan(m)) and defined[1] > 0.9



def test_a_ladder_resumes_without_retraining(tmp_path, monkeypatch):
    """A rerun trains only the missing runs; a run trained with other settings is refused."""
    calls = []

    def train_fn(settings):
        if len(calls) == 3 and not any(c == "died" for c in calls):
            calls.append("died")
            raise KeyboardInterrupt
        calls.append(settings["out_dir"])
        return fake_train(settings)
    monkeypatch.setattr(smelt, "surface_lines", lambda preset, rows: [])  # no fits of these made-up losses
    p, out = dict(PRESETS["smelt-micro"], name="smelt-micro", workers=1), str(tmp_path / "ladder")
    with pytest.raises(KeyboardInterrupt):
        ladder.run(p, out, train_fn)
    first = [c for c in calls if c != "died"]
    mtimes = {c: os.path.getmtime(os.path.join(c, "result.json")) for c in first}
    ladder.run(p, out, train_fn)
    second = calls[len(first) + 1:]
    runs = os.listdir(os.path.join(out, "runs"))
    assert len(first) == 3 and not set(first) & set(second) and len(first) + len(second) == len(runs) == 40
    assert all(os.path.getmtime(os.path.join(c, "result.json")) == t for c, t in mtimes.items())
    calls.clear()
    text = ladder.run(p, out, train_fn)
    assert calls == [] and "matching ([S] Table 10" in text and "seed std pooled over every arm" in text
    os.remove(os.path.join(out, "report.txt"))
    assert ladder.main(["--preset", "smelt-micro", "--report_only", "--out", out]) == 0
    assert open(os.path.join(out, "report.txt")).read() == text
    with pytest.raises(ValueError, match="trained with other settings"):
        load_results(out, [RunSpec(runs[0], dict(seed=7))])


def test_tiny_presets_train_end_to_end(tmp_path):
    """Real training: branches fork at their steps, growth doubles the passes, k-hop calibrates."""
    out = str(tmp_path / "smelt")
    ladder.run(SMELT_TINY, out)
    rows = fit.read_runs(os.path.join(out, "runs.csv"))
    assert len(rows) == 2 * 2 and {r["arch"] for r in rows} == {"baseline", "smelt"}
    step_tokens = 4 * 32
    for r in rows:
        result = json.load(open(os.path.join(out, "runs", r["run_id"], "result.json")))
        assert r["D"] == r["branch_step"] * step_tokens + result["settings"]["decay_tokens"]
        log = [json.loads(line) for line in open(os.path.join(out, "runs", r["run_id"], "log.jsonl"))]
        assert log[0]["step"] > r["branch_step"] and log[-1]["tokens"] == r["D"]
        assert not os.path.exists(os.path.join(out, "runs", r["run_id"], "ckpt.pt"))
        assert r["C"] == pytest.approx(r["F"] * r["D"]) and 0 < r["S"] < 1
    out = str(tmp_path / "x")
    ladder.run(X_TINY, out)
    grown = fit.read_runs(os.path.join(out, "runs.csv"))[1]
    log = [json.loads(line) for line in open(os.path.join(out, "runs", grown["run_id"], "log.jsonl"))]
    assert grown["arch"] == "loop-grow" and set(log[-1]["flops_by_passes"]) == {"2", "4"}
    settings = json.load(open(os.path.join(out, "runs", grown["run_id"], "result.json")))["settings"]
    assert settings["grow_at"] == grown["grow_step"] and settings["optimizer"] == "muon_x"  # its [X] recipe
    out = str(tmp_path / "khop")  # its own loop: the calibration (it never learns in 6 steps), no report runs
    ladder.run(KHOP_TINY, out)
    rows = fit.read_runs(os.path.join(out, "runs.csv"))
    assert {(r["role"], r["seed"], r["step"]) for r in rows} == {("calibration", 1, 3), ("calibration", 1, 6),
                                                                 ("calibration", 2, 3), ("calibration", 2, 6)}
    assert "no reading: the 4-layer arm did not learn" in open(os.path.join(out, "report.txt")).read()
    out = str(tmp_path / "testtime")  # each checkpoint read at K = 1..3 on the same windows
    ladder.run(TESTTIME_TINY, out)
    rows = fit.read_runs(os.path.join(out, "runs.csv"))
    assert sorted((r["training"], r["passes"]) for r in rows) == [(t, k) for t in ("fixed", "random")
                                                                    for k in (1, 2, 3)]
    fixed = json.load(open(os.path.join(out, "runs", "fixed-d3-s1", "result.json")))
    assert next(r["loss"] for r in rows if (r["training"], r["passes"]) == ("fixed", 2)) == fixed["val_loss"]



@pytest.mark.parametrize("name", KEPT)
def test_committed_report_rebuilds_byte_for_byte(tmp_path, name):
    for part in ("runs.csv", "lr_sweep.csv"):
        if os.path.exists(os.path.join(DOCS, f"{name}-{part}")):  # (a ladder without a sweep has no lr_sweep)
            shutil.copy(os.path.join(DOCS, f"{name}-{part}"), tmp_path / part)
    plot = name == "x-cpu-mini" and importlib.util.find_spec("matplotlib") is not None  # and its figures
    assert ladder.main(["--preset", name, "--report_only", "--out", str(tmp_path)] + ["--plot"] * plot) == 0
    assert (tmp_path / "report.txt").read_text() == open(os.path.join(DOCS, f"{name}-report.txt")).read()
    for figure in ("loss_vs_compute.png", "multipliers.png") if plot else ():
        assert open(tmp_path / figure, "rb").read(4) == b"\x89PNG"


def test_list_shows_every_preset_and_the_plan_meets_its_budget(capsys):
    assert ladder.main(["--list"]) == 0
    listing = capsys.readouterr().out
    for name, p in PRESETS.items():
        line = next(line for line in listing.splitlines() if line.split()[0] == name)
        runs, flops = re.search(r"(\d+) runs, ([0-9.e+]+) FLOPs", line).groups()
        budget = re.search(r"before the run: (\d+) runs[^,]*, ([0-9.e]+) FLOPs", p.get("budget") or "")
        if budget:  # the design's runs and FLOPs, as written before its run
            assert runs == budget.group(1) and float(flops) == pytest.approx(float(budget.group(2)), rel=0.03)
    with pytest.raises(SystemExit) as e:  # one line naming the missing file, exit status 2
        ladder.main(["--preset", "smelt-micro", "--report_only", "--out", "/nonexistent"])
    assert e.value.code == 2 and "/nonexistent/runs.csv" in capsys.readouterr().err


def test_the_decomposition_plans_five_arms_on_the_same_tokens():
    specs, _ = decompose.plan(dict(PRESETS["smelt-cpu-decompose"], name="d"), {})
    assert len(specs) == 3 * 2 * 5 * 2
    point = ("L4w48-e16", 16, 1337)
    by = {s.meta["arm"]: s for s in specs if (s.meta["cell"], s.meta["tpp"], s.meta["seed"]) == point}
    assert len({s.settings["max_steps"] for s in by.values()}) == 1  # every arm reads the same tokens
    a, b, c, d, e = (by[k].settings for k in "ABCDE")
    assert [s["layout"] for s in (a, b, c, d, e)] == ["plain", "plain", "smelt", "smelt", "plain"]
    assert b["n_embd"] == c["n_embd"] < a["n_embd"] == d["n_embd"] == e["n_embd"]
    assert b["n_expert"] == c["n_expert"] and d["n_expert"] == e["n_expert"] == a["n_expert"]
    assert e["n_layer"] == 6 and d["n_passes"] == c["n_passes"] == 2  # E as deep as D executes (4 + 2)
    assert [by[k].meta["lr"] for k in "ABCDE"] == [0.006] * 5  # L4w48: both arms' sweeps found 0.006


def test_the_decomposition_reads_its_rule_on_known_losses():
    noise = dict(A=(1e-3, -1e-3), B=(-1e-3, 1e-3), C=(5e-4, -5e-4), D=(-5e-4, 5e-4), E=(0.0, 0.0))
    rows = [dict(cell=cell, tpp=tpp, arm=arm, seed=seed, loss=loss + (tpp == 4) + 0.03 * seed + noise[arm][seed - 1])
            for cell in ("L4w32-e16", "L4w48-e16") for tpp in (4, 16)
            for arm, loss in dict(A=2.0, B=2.05, C=2.05, D=2.01, E=2.0).items() for seed in (1, 2)]
    text = "\n".join(decompose.report(dict(PRESETS["smelt-cpu-decompose"], name="d"), rows))
    d = np.array([[1.05 + 0.03 * s + noise["B"][s - 1] - 1.0 - 0.03 * s - noise["A"][s - 1] for s in (1, 2)]] * 4)
    sigma = np.sqrt(np.var(d, axis=1, ddof=1).mean()) / np.sqrt(8)  # pooled over 4 points, 8 runs a contrast
    lo, hi = scipy_stats.t.interval(0.95, 4, 0.05, sigma)
    assert f"B - A (narrowing to the twin's shape): +0.0500 nats [{lo:+.4f}, {hi:+.4f}]" in text
    assert "C - B (the loop on the narrow model): +0.0000" in text and "D - A (the loop at full width): +0.0100" in text
    assert "gate: every arm's loss falls from tpp 4 to 16" in text
    assert text.endswith("the deficit is the narrowing (B - A above +2 sigma, C - B within 2 sigma of 0)")
    z = {"B-A": 0.0, "C-B": 0.0, "C-A": 0.0, "D-A": 0.0, "E-A": 0.0}
    assert decompose.reading(dict(z, **{"C-B": -2.5})).startswith("the loop helps")
    assert decompose.reading(dict(z, **{"E-A": -3.0})).startswith("depth helps but the loop does not")
    assert decompose.reading(z) == "no reading of the rule holds"
    stalled = [dict(r, loss=r["loss"] - 2 * (r["tpp"] == 4)) if r["arm"] == "D" else r for r in rows]
    assert "no reading: the instrument failed" in decompose.report(dict(PRESETS["smelt-cpu-decompose"], name="d"),
                                                                  stalled)[-1]


def test_the_recipe_fraction_is_balanced_and_keeps_both_corners():
    """I = RMOS: both corners, every two causes in all four combinations alike."""
    codes = recipe.configs()
    assert len(codes) == 16 and {"sssss", "xxxxx"} <= set(codes)
    for i, j in [(i, j) for i in range(5) for j in range(i + 1, 5)]:
        combos = [c[i] + c[j] for c in codes]
        assert all(combos.count(a + b) == 4 for a in "sx" for b in "sx")
    p = dict(PRESETS["smelt-cpu-recipe"], name="r")
    for code in ("sssss", "xxxxx", "sxsxs"):
        base, loop = recipe.model_of(p, code, False), recipe.model_of(p, code, True)
        assert base.executed_layers() == 4 and loop.executed_layers() == 6 and base.n_blocks == loop.n_blocks == 4
        assert (base.layout, loop.layout) == (("plain", "smelt") if code[3] == "s" else ("pcc", "pcc"))
        assert (loop.n_expert > 0) == (code[1] == "s") and (loop.norms == "x") == (code[4] == "x")
    specs, _ = recipe.plan(p, {})
    assert {s.meta["config"] for s in specs} == {"sweep-ss", "sweep-sx", "sweep-xs", "sweep-xx"}
    assert all(s.settings["seed"] == 1337 for s in specs)  # the sweep: the calibration seed only


def test_the_recipe_report_reads_known_causes():
    """The loop gains only where the FFN is dense: M's effect, and no other beyond noise."""
    p = dict(PRESETS["smelt-cpu-recipe"], name="r")
    rows = []
    codes = recipe.configs() + ["operator-1"]
    for code, arm, steps, seed in itertools.product(codes, ("base", "loop"), (100, 200), (1338, 1339, 1340)):
        gain = 0.06 * (arm == "loop" and code[1] == "x")
        loss = 2.5 - 0.2 * (steps == 200) + 0.01 * seed % 3 - gain + 0.04 * (code == "operator-1")
        noise = 1e-3 * ((7 * seed + 3 * (arm == "loop")) % 5)  # the same in every configuration
        C = steps * (1.5 if arm == "loop" else 1.0)
        rows += [dict(config=code, arm=arm, steps=steps, seed=seed, F=1.0, D=1, C=C, loss=loss + noise, lr=0.1,
                      run_id="r", seconds=1.0)] * (code != "operator-1" or arm == "base")
    sweep = [dict(arch=a, key="matrix_lr", value=v, val_loss=abs(math.log(v)), carried=v == 1.0)
             for a in ("ss", "sx", "xs", "xx") for v in (0.5, 1.0, 2.0)]
    text = "\n".join(recipe.report(p, rows, sweep))
    assert "  the FFN (M): the loop gains more with dense" in text
    for cause in ("the loop's updates (R)", "the optimizer (O)", "the loop's shape (S)", "the model recipe (P)"):
        assert f"  {cause}: within noise" in text, cause
    assert "the corners' gap is carried by the FFN" in text and "Operator-1's own recipe costs +0.04" in text
    assert "no reading" in recipe.report(p, rows, sweep[:2])[-1]  # a sweep's best at an edge: no gate


def test_the_khop_task_is_sanfords():
    """The vectorised generator against Sanford et al.'s definition, worked one string at a time."""
    inputs, targets, ks = khop.sequences(7, 3, 16)
    assert inputs.shape == targets.shape == (16, khop.LENGTH) and targets[:, 0].eq(khop.BLANK).all()
    for row, (x, y, k) in enumerate(zip(inputs.tolist(), targets.tolist(), ks)):
        letters = x[1:]
        assert x[0] == khop.LETTERS + k - 1 and all(a != b for a, b in zip(letters, letters[1:]))
        for i, want in enumerate(y[1:]):
            pointer = i
            for _ in range(k):
                earlier = [j for j in range(pointer) if letters[j] == letters[pointer]] if pointer >= 0 else []
                pointer = earlier[-1] + 1 if earlier else -1
            assert want == (letters[pointer] if pointer >= 0 else khop.NONE), (row, i)
    chance = khop.heuristic(2000, 1000)
    assert all(0.3 < e < 0.75 for e in chance.values())  # below a random letter, far above a lookup


def test_the_khop_report_reads_its_rule_on_known_errors():
    p = dict(PRESETS["smelt-cpu-khop"], name="k")
    err = {"L2": (0.01, 0.4, 0.5, 0.6), "L4": (0.01, 0.02, 0.03, 0.3), "P": (0.01, 0.03, 0.3, 0.5),
           "S": (0.01, 0.02, 0.03, 0.3)}
    rows = [dict(arm="L4", seed=s, role="calibration", step=250, passes="", k=k, error=0.01, heuristic=0.5)
            for s in (1, 2) for k in (1, 2, 3, 4)]
    for arm, errors in err.items():
        for seed, e in ((1338, 0.0), (1339, 0.004), (1340, 0.008)):
            for passes in (range(1, 7) if arm in "PS" else [1]):
                rows += [dict(arm=arm, seed=seed, role="report", step=500, passes=passes, k=k, error=v + e +
                              0.01 * (passes != 3 and arm in "PS"), heuristic=0.5) for k, v in enumerate(errors, 1)]
    text = "\n".join(khop.report(p, rows))
    assert "gate: the 4-layer arm learns k = 1 and 2 on every report seed" in text and "  depth pays" in text
    assert "  SMELT's loop, 2 run as 4: as good as 4 layers and better than 2" in text
    assert "  prelude-core-coda, 2 run as 4: between 2 and 4 layers" in text
    assert "L2 (2 layers)   0.014 (1.00)   0.404 (0.00)" in text
    assert [label[-10:] for label, *_ in khop.summary(p, rows)] == ["at k = 1-3"] * 3  # the figure reads there
    unlearnt = [dict(r, error=0.5) if (r["arm"], r["seed"], r["k"]) == ("L4", 1339, 2) else r for r in rows]
    assert "no reading: the instrument failed" in khop.report(p, unlearnt)[-1] and khop.summary(p, unlearnt) == []


def test_the_summary_figure_reads_what_each_report_reads():
    """The k-hop rows are its report's contrasts; the recipe's say its gate failed."""
    lines = ladder.summary()
    report = open(os.path.join(DOCS, "smelt-cpu-khop-report.txt")).read()
    numbers = lambda text: [float(v) for v in re.findall(r"[+-]\d\.\d+", text)]  # noqa: E731
    depth = numbers(re.search(r"L2 - L4: (.*?\]) ", report).group(1))
    row = next(line for line in lines if line.startswith("smelt-cpu-khop: 4 layers vs 2 layers, at k = 1-2:"))
    assert np.allclose(numbers(row.split(": ")[-1]), depth, atol=5e-4)
    assert "no reading" in open(os.path.join(DOCS, "smelt-cpu-recipe-report.txt")).read()
    recipe_rows = [line for line in lines if line.startswith("smelt-cpu-recipe")]
    assert len(recipe_rows) == 3 and all("(no reading: its gate failed)" in line for line in recipe_rows)


def test_the_testtime_report_reads_x_figure_17():
    """Made-up curves: the fixed-K model best at 2 and 0.03 worse at 8; the random-K model flat from 4 on."""
    p = dict(PRESETS["x-cpu-testtime"], name="t")
    rows = [dict(depth=d, training=t, seed=s, passes=k, loss=2.0 + 0.01 * s + (abs(k - 2) * 0.005 + 0.05 * (k == 1)
                 if t == "fixed" else 0.05 * max(0, 4 - k)) + 1e-4 * ((k * s) % 3), C=1, D=1, run_id="r", seconds=1)
            for d in (4, 6) for t in ("fixed", "random") for s in (1, 2, 3) for k in range(1, 9)]
    text = "\n".join(testtime.report(p, rows))
    assert "  fixed K: best at its trained K = 2; at K = 8 it loses beyond noise (+0.0300" in text
    assert "  random K: flat (K = 8 within +-0.01 of K = 4); no test-time gain" in text
    flat = [dict(r, loss=2.0 + 0.01 * r["seed"] + 1e-4 * ((r["passes"] * r["seed"]) % 3)) for r in rows]
    assert "no reading: the instrument failed" in testtime.report(p, flat)[-1]

