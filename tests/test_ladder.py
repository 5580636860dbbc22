"""ladder.py and ladders/: the statistics against scipy and known answers (t-intervals, the sqrt(2) of a
difference, the seed bootstrap, profile intervals); the searches recover a known optimum; the reports' rules
(a surface reported only where the grid identifies it, the best K and its agreement); a ladder resumes
without retraining; tiny presets (built here) train end to end; every committed report rebuilds byte for byte
from its CSVs; --list shows every preset's plan and its budget."""

import importlib.util
import json
import math
import os
import re
import shutil

import numpy as np
import pytest
from scipy import stats as scipy_stats

import fit
import ladder
from ladders import repeat, smelt, x
from ladders.presets import PRESETS, SEEDS
from ladders.runs import RunSpec, data_dir, load_results
from ladders.stats import (agreement, contrast, difference, interpolated_optimum, pooled_std, profile_bound,
                           profile_interval, seed_draws, t_interval)

DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "ladder")
KEPT = ["smelt-cpu-mini", "smelt-cpu-surface", "smelt-cpu-decompose", "smelt-cpu-hops", "x-cpu-mini", "x-cpu-mini-tuned",
        "x-cpu-repeat", "x-cpu-repeat-tuned"]


def preset(name, **changes):
    return dict(PRESETS[name], name=f"{name}-test", **changes)


# tiny designs, built here: the numbers mean nothing
SMELT_TINY = preset("smelt-micro", cells=[("w32", 8)], scales={"w32": PRESETS["smelt-micro"][
    "scales"]["w32"]}, branch_tpp=[0.1, 0.2], seeds=SEEDS[:1], workers=1, bootstrap=0,
    lr=dict(key="matrix_lr", values=[4e-3], extend=0, seeds=1, every_point=False))
X_TINY = preset("x-cpu-mini", model=dict(block_size=32), depths=[3], archs=("vanilla", "loop-grow"),
                seeds=SEEDS[:1], train=dict(batch_size=4, eval_tokens=512),
                tpp_stored={"vanilla": 0.05, "loop-grow": 0.1}, workers=2,
                lr=dict(key="matrix_lr", values=[0.04], extend=0, seeds=1, every_point=False))
REPEAT_TINY = preset("x-cpu-repeat", model=dict(block_size=32), depths=[3], passes=[1], arms=[(2000, 2)],
                     seeds=SEEDS[:1], train=dict(batch_size=4, eval_tokens=512), workers=1,
                     weight_decays=[0.1], wd_extend=0, seeded_passes=[], bootstrap=50,
                     lr=dict(key="matrix_lr", values=[0.04], extend=0, seeds=1, weight_decay=0.1))
HOPS_TINY = preset("smelt-cpu-hops", scales={"L4w32": dict(n_layer=4, n_embd=32, expert_hidden=16)},
                   cells=[("L4w32", 16)], task=dict(n_symbols=8, max_hops=4, train_docs=2000, eval_docs=8),
                   steps=2, seeds=[1, 2], workers=1, train=dict(optimizer="adamw", batch_size=4, warmup_steps=1,
                                                               eval_tokens=512))


# ---------------------------------------------------------------------------------------------------------
# the statistics

def test_t_interval_and_pooled_std_are_scipys():
    seeds = np.array([1.9414, 1.9324, 1.9419])
    mean, sem = seeds.mean(), scipy_stats.sem(seeds)
    lo, hi = t_interval(mean, seeds.std(ddof=1), 3, 2)
    assert (lo, hi) == pytest.approx(scipy_stats.t.interval(0.95, 2, mean, sem))
    assert lo < seeds.min() - 0.005 and hi > seeds.max() + 0.005  # t(2) = 4.30: wider than three seeds' range
    sigma, dof = pooled_std([[1.0, 1.2, 1.4], [2.0, 2.2], [3.0]])  # a group of one adds nothing
    assert dof == 3 and sigma == pytest.approx(math.sqrt((0.08 + 0.02) / 3))
    assert pooled_std([[1.0], [2.0]]) == (None, 0)


def test_a_difference_has_sqrt2_sigma_and_scipys_p():
    a, b = np.array([1.8847, 1.8751, 1.8916]), np.array([1.8708, 1.8647, 1.8734])
    sigma, dof = pooled_std([a, b])
    d = difference(a.mean(), 3, b.mean(), 3, sigma, dof)
    student = scipy_stats.ttest_ind(a, b, equal_var=True)  # the same pooled two-sample t-test
    assert d["z"] == pytest.approx(student.statistic) and d["p"] == pytest.approx(student.pvalue)
    assert difference(2.0, 1, 1.9, 1, 0.01, 5)["sigma"] == pytest.approx(math.sqrt(2) * 0.01)  # two runs
    c = contrast([(1, 2.0, 2), (-1, 1.9, 2), (-1, 1.5, 3), (1, 1.45, 3)], 0.01, 10)  # differences' difference
    s = 0.01 * math.sqrt(1 / 2 + 1 / 2 + 1 / 3 + 1 / 3)
    assert c["diff"] == pytest.approx(0.05) and c["sigma"] == pytest.approx(s)
    assert c["p"] == pytest.approx(2 * scipy_stats.t.sf(0.05 / s, 10))
    assert (c["lo"], c["hi"]) == pytest.approx(scipy_stats.t.interval(0.95, 10, 0.05, s))


def test_seed_bootstrap_gives_t_intervals_deterministically():
    draws = seed_draws([1.0, 2.0], [3, 1], 0.01, 4, n_draws=40000, seed=7)
    assert np.array_equal(draws, seed_draws([1.0, 2.0], [3, 1], 0.01, 4, n_draws=40000, seed=7))
    for j, (mean, n) in enumerate(((1.0, 3), (2.0, 1))):
        band = np.percentile(draws[:, j], [2.5, 97.5])
        assert band == pytest.approx(t_interval(mean, 0.01, n, 4), abs=0.02 * 0.01 * 2.78 / math.sqrt(n))
    apart = seed_draws([1.0, 1.1], [3, 3], 0.01, 8, n_draws=2000, seed=0).argmin(axis=1)
    tied = seed_draws([1.0, 1.0], [3, 3], 0.01, 8, n_draws=2000, seed=0).argmin(axis=1)
    assert agreement(apart[:, None], [0])[0] == 1.0 and 0.45 < agreement(tied[:, None], [0])[0] < 0.55


def test_profile_interval_and_a_grid_optimum():
    assert profile_bound(3.74e-4, 54) == pytest.approx(scipy_stats.chi2.ppf(0.95, 1) / 2 * 3.74e-4 / 54)
    a = np.linspace(0, 2, 21)
    lo, hi, edge = profile_interval(a, (a - 1.0) ** 2, 0.045)  # inside: |a - 1| <= 0.2; then the next values
    assert (lo, hi, edge) == (pytest.approx(0.7), pytest.approx(1.3), False)
    assert profile_interval(a, np.zeros_like(a), 0.01) == (0.0, 2.0, True)  # flat: not bounded by the data
    w = [0.1, 0.2, 0.4, 0.8]
    x_opt, edge = interpolated_optimum(w, [(np.log(v) - np.log(0.3)) ** 2 for v in w])
    assert x_opt == pytest.approx(0.3) and edge == 0
    assert interpolated_optimum(w, [1.0, 1.1, 1.2, 1.3]) == (0.1, -1)


# ---------------------------------------------------------------------------------------------------------
# the searches, on known losses (nothing trains)

def fake_train(settings):
    """A train.train stand-in for smelt-micro (128 tokens a step): a loss falling with the run's steps."""
    steps = settings.get("max_steps") or int(re.search(r"step(\d+)", settings["init_from"]).group(1)) + \
        settings["decay_tokens"] // 128
    return dict(val_loss=3.0 - 0.1 * math.log(steps) + 0.01 * (settings.get("seed", 1337) - 1337),
                tokens=steps * 128, flops=1e6 * steps, step=steps, seconds=0.0, train_losses=[1.0],
                val_loss_by_source=None)


def test_each_sweep_point_brackets_its_own_optimum():
    """A parabola in log LR with a known optimum per (arch, depth): each point runs beyond its edge until its
    best is bracketed, at most `extend` steps beyond the grid; each point trains at its own best."""
    p = preset("x-cpu-mini-tuned", archs=("vanilla", "loop-2"), depths=[3, 4], seeds=SEEDS[:2],
               lr=dict(key="matrix_lr", values=[0.02, 0.04], extend=2, seeds=2, every_point=True))
    optimum = {("vanilla", 3): 0.03, ("vanilla", 4): 0.012, ("loop-2", 3): 0.5, ("loop-2", 4): 0.06}

    def train(specs):
        def loss(s):
            return 1 + np.log(s.meta["grid_lr"] / optimum[s.meta["arch"], s.meta["depth"]]) ** 2 + 1e-3 * (
                s.meta["seed"] - 1337)
        return {s.run_id: dict(val_loss=loss(s)) for s in specs}
    specs, sweep, _ = ladder.resolve(p, train)
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


OPT = {1: (0.2, 0.025), 2: (0.02, 0.4)}  # K: the optimum (LR as the first depth's value, weight decay)


def test_repeat_search_recovers_a_known_optimum_at_every_point():
    """A bowl in log LR and log weight decay around a known optimum per K: the search walks from the carried
    LR and the grid's best weight decay to it (as near as the grids and their limits go), every best
    bracketed by its neighbours on both grids; the other seeds run at the best pair."""
    p = preset("x-cpu-repeat-tuned", depths=[3, 4], passes=[1, 2], arms=[(2000, 2)], seeded_passes=[1, 2],
               weight_decays=[0.1, 0.4], wd_extend=1, lr=dict(key="matrix_lr", values=[0.02, 0.04], extend=1,
                                                               seeds=1, weight_decay=0.2))

    def loss(s):
        lr, wd = OPT[s.meta["K"]]
        return 3.0 + 0.01 * math.log2(s.meta["grid_lr"] / lr) ** 2 + 0.004 * math.log2(
            s.settings["weight_decay"] / wd) ** 2 + 0.0005 * (s.meta["seed"] - 1337)
    specs, _, results = ladder.resolve(p, lambda todo: {s.run_id: dict(val_loss=loss(s)) for s in todo})
    for k, (lr, wd) in OPT.items():
        reachable = (min(max(lr, 0.01), 0.08), min(max(wd, 0.025), 1.6))  # the limits: a step beyond
        for d in p["depths"]:
            first = {(s.meta["grid_lr"], s.meta["wd"]): results[s.run_id]["val_loss"] for s in specs
                     if (s.meta["K"], s.meta["depth"], s.meta["seed"]) == (k, d, SEEDS[0])}
            best = min(first, key=first.get)
            assert best == pytest.approx(reachable)
            (lr, wd) = best
            for n in [(lr / 2, wd), (lr * 2, wd), (lr, wd / 4), (lr, wd * 4)]:  # bracketed, or beyond a limit
                assert n in first or not (0.01 <= n[0] <= 0.08 and 0.025 <= n[1] <= 1.6)
            seeds = [s for s in specs if (s.meta["K"], s.meta["depth"], s.meta["role"]) == (k, d, "seed")]
            assert [(s.meta["grid_lr"], s.meta["wd"], s.meta["seed"]) for s in seeds] == [(*best, SEEDS[1])]


# ---------------------------------------------------------------------------------------------------------
# the reports' rules on known answers

def test_repeat_analysis_recovers_known_answers():
    C1 = [1e12, 2e12, 4e12, 8e12]  # K = 1 improves with size, then overfits; K = 2 costs 1.5x and keeps going
    frontier = {1: list(zip(C1, [2.0, 1.8, 1.7, 1.75])),
                2: list(zip([1.5 * c for c in C1], [1.95, 1.72, 1.6, 1.5]))}
    best, l_star, c_star, reach = repeat.analysis(frontier, [1e12, 2e12, 1.2e13])
    assert best == [1, 1, 2] and (l_star, c_star) == (1.7, 4e12)
    assert reach == pytest.approx(3e12 * 2 ** (0.02 / 0.12))  # log-linear: 1.72 at 3e12, 1.6 at 6e12
    assert repeat.envelope(frontier[1], 1.2e13) == 1.7 and repeat.envelope(frontier[1], 5e11) == np.inf
    assert math.isnan(repeat.reach_compute(frontier[1], 1.0))

    def pts(gap, spread):  # three seeds per point
        losses = {1: [2.0, 1.8, 1.7, 1.65], 2: [2.02 + gap, 1.7 + gap, 1.55 + gap, 1.45 + gap]}
        return {(k, d): (c * (1 + 0.5 * (k - 1)), [v - spread, v, v + spread]) for k in (1, 2)
                for d, (c, v) in enumerate(zip(C1, losses[k]))}
    clear = "\n".join(repeat.budget_lines(dict(bootstrap=400), pts(0.0, 1e-3), 1e-3, 16))
    assert re.search(r"looped K is best at \(from [0-9.e+]+\): [0-9.e+]+, the same in 1.00", clear)
    tied = "\n".join(repeat.budget_lines(dict(bootstrap=400), pts(0.195, 0.05), 0.05, 16))
    share = float(re.search(r"the same in ([0-9.]+) of the draws", tied).group(1))
    assert share < 0.9  # K = 2 ahead at the top only, the noise ten times the difference: the draws disagree


def test_budgets_compared_recover_known_answers():
    """Fresh data where K = 1 stays best, a repeated budget where K = 1 overfits and K = 4 wins: the looping
    gains, their difference with its sigma over four means, and the best K at the top."""
    def section(label, epochs, losses):
        return (label, 1000, epochs), {(k, d): (1e12 * 2 ** d * (1 + 0.5 * (k - 1)), [v - 1e-3, v + 1e-3])
                                       for k, ls in losses.items() for d, v in enumerate(ls)}
    fresh = section("1kx1", 1, {1: [2.0, 1.8, 1.6, 1.5], 2: [2.0, 1.82, 1.63, 1.53],
                                4: [2.05, 1.86, 1.67, 1.57]})
    rep = section("1kx10", 10, {1: [2.0, 1.9, 1.95, 2.05], 2: [1.98, 1.85, 1.85, 1.9],
                                4: [1.97, 1.8, 1.75, 1.72]})
    text = "\n".join(repeat.across_lines(dict(bootstrap=200, passes=[1, 2, 4]), [fresh, rep]))
    assert "1kx1 -0.0300 (K = 2), 1kx10 +0.1800 (K = 4)" in text
    sigma = math.sqrt(2) * 1e-3 * math.sqrt(4 / 2)  # the std of [v - 1e-3, v + 1e-3], four means of 2 seeds
    lo, hi = scipy_stats.t.interval(0.95, 24, 0.21, sigma)
    assert f"+0.2100 nats [95% t-interval {lo:+.4f}, {hi:+.4f}]" in text
    assert re.search(r"larger with 1kx10 than with 1kx1 in 1.000", text)
    assert "held out" not in text
    # every choice made on the first seed (v - 1e-3), read on the second alone (v + 1e-3): the same gains
    tuned = "\n".join(repeat.across_lines(dict(bootstrap=200, passes=[1, 2, 4], tune=True, seeds=[7, 8]),
                                          [fresh, rep]))
    assert "chosen on seed 7, the losses of the other seeds: looping gain 1kx1 -0.0300 (K = 2), 1kx10 " \
        "+0.1800 (K = 4)" in tuned
    lo, hi = scipy_stats.t.interval(0.95, 24, 0.21, math.sqrt(2) * 1e-3 * 2)  # four means of one seed
    assert f"held out: the gain with 1kx10 minus the gain with 1kx1: +0.2100 nats [95% t-interval {lo:+.4f}, " \
        f"{hi:+.4f}]" in tuned


def test_the_best_k_envelope_interpolates_between_sizes_or_reads_the_sizes_trained():
    points = [(1e11, 2.0), (4e11, 1.0)]
    assert repeat.envelope(points, 2e11) == pytest.approx(1.5)  # log-C halfway between the two sizes
    assert repeat.envelope(points, 2e11, interpolate=False) == 2.0  # only the size affordable at 2e11
    assert repeat.envelope(points, 0.5e11) == repeat.envelope(points, 0.5e11, interpolate=False) == math.inf
    frontier = {1: [(1e11, 2.0), (4e11, 1.0)], 2: [(1.5e11, 1.8)]}
    assert repeat.analysis(frontier, [2e11])[0] == [1] and repeat.analysis(frontier, [2e11], False)[0] == [2]


def synthetic_rows(scales):
    runs = fit.synthetic_surface_runs(seed=0, scales=scales, n_checkpoints=3)
    return [dict(arch=a, cell=c, F=F, S=S, D=D, C=F * D, loss=loss, branch_tpp=0, seed=1337)
            for a, c, F, S, D, loss in zip(*(runs[k] for k in ("arch", "cell", "F", "S", "D", "loss")))]


@pytest.mark.parametrize("name", ["x-cpu-mini", "x-cpu-repeat"])
def test_the_x_ladders_scale_every_lr_with_stored_parameters_by_x16(name):
    """[X16] GLR(N) = GLR(N_0) (N / N_0)^beta, N the stored parameters counted on the built module, N_0 at the
    first depth; the embedding and lm head LRs keep the recipe's ratios to the matrix LR."""
    from model import GPT
    p = PRESETS[name]
    for arch in (p["archs"] if name == "x-cpu-mini" else ["operator-1"]):
        beta = p["lr_beta"][arch] if isinstance(p["lr_beta"], dict) else p["lr_beta"]
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
    """[S]-like surfaces on F at 4 levels: identified (a's profile interval holds the true a), CE Gain and TPP
    with cell-bootstrap intervals. (On 3 levels, smelt-cpu-mini's, it is not, nor are they: its report.)"""
    assert [len(smelt.f_levels(F)) for F in ([1.0, 1.05, 2.0, 2.2, 4.0], [1.0, 1.2, 1.44])] == [3, 1]
    monkeypatch.setattr(smelt, "PROFILE_A", np.geomspace(0.01, 10.0, 16))  # a coarser profile: faster
    text = "\n".join(smelt.surface_lines(dict(bootstrap=8), synthetic_rows((2.5e8, 5e8, 1e9, 2e9))))
    for arch in smelt.ARCHS:
        lo, hi = map(float, re.search(rf"{arch} .*\n.* a in \[([0-9.e-]+), ([0-9.e-]+)\]", text).groups())
        assert lo < fit.SYNTHETIC_SURFACES[arch]["a"] < hi
    assert "NOT identified" not in text and "cell bootstrap: 8 draws" in text
    assert len(re.findall(r"CE Gain of SMELT at C=.* \[[-+0-9.]+, [-+0-9.]+\]", text)) == 2 * 3
    committed = open(os.path.join(DOCS, "smelt-cpu-mini-report.txt")).read()
    assert committed.count("NOT identified (F at 3 levels") == 2 and "TPP: not reported" in committed


def test_multipliers_read_seed_means_and_their_bands_hold_them():
    """Two seeds at one compute must not make a crossing of their own: the interpolated multiplier reads each
    architecture's per-depth means (1.91 at 1e12, 1.85 at 2e12 reach 1.90 at 1e12 x 2^(1/6))."""
    ref = [(1e12, 1.95, 3), (1e12, 1.96, 3), (2e12, 1.90, 4), (2e12, 1.91, 4), (4e12, 1.85, 5),
           (4e12, 1.84, 5)]
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


# ---------------------------------------------------------------------------------------------------------
# a ladder end to end

def test_a_ladder_resumes_without_retraining(tmp_path, monkeypatch):
    """The first attempt dies in its fourth run; the rerun trains exactly the missing runs, the finished ones
    untouched; a third trains nothing; the report rebuilds from the CSVs byte for byte; a run finished with
    other settings is refused."""
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
    assert calls == [] and "matching ([S] Table 10" in text and "seed spread of the baseline" in text
    os.remove(os.path.join(out, "report.txt"))
    assert ladder.main(["--preset", "smelt-micro", "--report_only", "--out", out]) == 0
    assert open(os.path.join(out, "report.txt")).read() == text
    with pytest.raises(ValueError, match="trained with other settings"):
        load_results(out, [RunSpec(runs[0], dict(seed=7))])


def test_tiny_presets_train_end_to_end(tmp_path):
    """Real training: SMELT's stable runs save the branch points and each branch forks there (D = its stable
    steps + its decay tokens, its final weights removed); [X] growth doubles the passes at the [X15] step
    (two worker processes); the data-constrained run reads only its unique tokens, for its epochs."""
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
    out = str(tmp_path / "repeat")
    ladder.run(REPEAT_TINY, out, plot=True)
    (r,) = fit.read_runs(os.path.join(out, "runs.csv"))
    prepared = json.load(open(os.path.join(data_dir(REPEAT_TINY, 2000), "meta.json")))["train_tokens"]
    stable = prepared - int(0.1 * prepared)  # the stable region: the 2000 tokens (and at most one more)
    assert 2000 <= stable <= 2001
    assert r["epochs"] == pytest.approx(r["D"] / ((2000 - 1) // 32 * 32), rel=0.01) and r["epochs"] >= 2
    if importlib.util.find_spec("matplotlib"):  # its figures (without matplotlib: one line, no figure)
        assert all(open(os.path.join(out, f"2kx2-{f}.png"), "rb").read(4) == b"\x89PNG"
                   for f in ("frontier", "weight_decay"))
    out = str(tmp_path / "hops")  # the accuracy, from each run's checkpoint: every query once per k and passes
    ladder.run(HOPS_TINY, out)
    rows = fit.read_runs(os.path.join(out, "runs.csv"))
    for arm, passes in dict(A=[1], B=[1], C=[1, 2, 3, 4], D=[1, 2, 3, 4], P=[1, 2, 3, 4], E=[1]).items():
        for seed in (1, 2):
            mine = [r for r in rows if r["arm"] == arm and r["seed"] == seed]
            assert sorted({r["passes"] for r in mine}) == passes and {r["hops"] for r in mine} == {1, 2, 3, 4}
            assert all(sum(r["queries"] for r in mine if r["passes"] == p) == 8 * 12 for p in passes)


# ---------------------------------------------------------------------------------------------------------
# the committed reports, figures and the command line

@pytest.mark.parametrize("name", KEPT)
def test_committed_report_rebuilds_byte_for_byte(tmp_path, name):
    for part in ("runs.csv", "lr_sweep.csv"):
        if os.path.exists(os.path.join(DOCS, f"{name}-{part}")):  # (a ladder without a sweep has no lr_sweep)
            shutil.copy(os.path.join(DOCS, f"{name}-{part}"), tmp_path / part)
    assert ladder.main(["--preset", name, "--report_only", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "report.txt").read_text() == open(os.path.join(DOCS, f"{name}-report.txt")).read()


def test_figures_from_the_committed_csvs(tmp_path):
    pytest.importorskip("matplotlib")
    for part in ("runs.csv", "lr_sweep.csv"):
        shutil.copy(os.path.join(DOCS, f"x-cpu-mini-{part}"), tmp_path / part)
    assert ladder.main(["--preset", "x-cpu-mini", "--report_only", "--plot", "--out", str(tmp_path)]) == 0
    for figure in ("loss_vs_compute.png", "multipliers.png"):
        assert open(tmp_path / figure, "rb").read(4) == b"\x89PNG"
    shutil.copy(os.path.join(DOCS, "smelt-cpu-hops-runs.csv"), tmp_path / "runs.csv")
    assert ladder.main(["--preset", "smelt-cpu-hops", "--report_only", "--plot", "--out", str(tmp_path)]) == 0
    assert open(tmp_path / "L4w64-e16-accuracy.png", "rb").read(4) == b"\x89PNG"


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
    from ladders import decompose
    p = dict(PRESETS["smelt-cpu-decompose"], name="smelt-cpu-decompose")
    specs, _ = decompose.plan(p, {})
    assert len(specs) == 3 * 2 * 5 * 2
    point = [s for s in specs if s.meta["cell"] == "L4w48-e16" and s.meta["tpp"] == 16 and s.meta["seed"] == 1337]
    by = {s.meta["arm"]: s for s in point}
    assert len({s.settings["max_steps"] for s in point}) == 1  # every arm reads the same tokens
    a, b, c, d, e = (by[k].settings for k in "ABCDE")
    assert (a["layout"], c["layout"], d["layout"], b["layout"], e["layout"]) == ("plain", "smelt", "smelt", "plain",
                                                                                "plain")
    assert b["n_embd"] == c["n_embd"] < a["n_embd"] == d["n_embd"] == e["n_embd"]
    assert b["n_expert"] == c["n_expert"] and d["n_expert"] == e["n_expert"] == a["n_expert"]
    assert e["n_layer"] == 6 and d["n_passes"] == c["n_passes"] == 2  # E as deep as D executes (4 + 2)
    assert [by[k].meta["lr"] for k in "ABCDE"] == [0.006] * 5  # L4w48: both arms' sweeps found 0.006


def test_the_decomposition_reads_its_rule_on_known_losses():
    """Made-up losses (two seeds each, +-1e-3): narrowing costs 0.05, the loop adds nothing to the narrow
    model and costs 0.01 at full width, depth nothing: the contrasts, their sigma, the rule's reading."""
    from ladders import decompose
    rows = [dict(cell=cell, tpp=tpp, arm=arm, seed=seed, loss=loss + e) for cell in ("L4w32-e16", "L4w48-e16")
            for tpp in (4, 16) for arm, loss in dict(A=2.0, B=2.05, C=2.05, D=2.01, E=2.0).items()
            for seed, e in ((1, -1e-3), (2, 1e-3))]
    text = "\n".join(decompose.report(dict(PRESETS["smelt-cpu-decompose"], name="d"), rows))
    sigma = math.sqrt(2) * 1e-3  # a contrast of two 2-seed means: sigma; averaged over 4 points: sigma / 2
    lo, hi = scipy_stats.t.interval(0.95, 20, 0.05, sigma / 2)
    assert f"B - A (narrowing to the twin's shape): +0.0500 nats [{lo:+.4f}, {hi:+.4f}] = +70.7 sigma" in text
    assert "C - B (the loop on the narrow model): +0.0000" in text and "D - A (the loop at full width): +0.0100" in text
    assert text.endswith("the deficit is the narrowing (B - A above +2 sigma, C - B within 2 sigma of 0)")
    z = {"B-A": 0.0, "C-B": 0.0, "C-A": 0.0, "D-A": 0.0, "E-A": 0.0}
    assert decompose.reading(dict(z, **{"C-B": -2.5})).startswith("the loop helps")
    assert decompose.reading(dict(z, **{"E-A": -3.0})).startswith("depth helps but the loop does not")
    assert decompose.reading(z) == "no reading of the rule holds"


def test_the_hops_ladder_plans_six_arms_on_the_same_tokens():
    from ladders import hops
    specs, _ = hops.plan(dict(PRESETS["smelt-cpu-hops"], name="smelt-cpu-hops"), {})
    assert len(specs) == 6 * 2 and {s.meta["seed"] for s in specs} == {1338, 1339}  # 1337 chose the LR
    by = {s.meta["arm"]: s for s in specs if s.meta["seed"] == 1338}
    assert len({s.settings["max_steps"] for s in specs}) == 1 and {s.meta["lr"] for s in specs} == {0.006}
    m = {k: s.meta for k, s in by.items()}
    assert 1 <= m["C"]["F"] / m["A"]["F"] <= 1.05 and abs(m["C"]["N_stored"] / m["A"]["N_stored"] - 1) < 0.05
    assert m["D"]["N_stored"] == m["A"]["N_stored"] and m["P"]["N_stored"] - m["A"]["N_stored"] == 64  # BO gain
    assert m["D"]["F"] == pytest.approx(m["E"]["F"], rel=0.01) == m["P"]["F"] and m["E"]["n_layer"] == 6
    assert (by["P"].settings["layout"], by["P"].settings["n_passes"], by["D"].settings["layout"]) == ("pcc", 2,
                                                                                                      "smelt")


def test_hops_accuracy_reads_every_answer(monkeypatch):
    """An oracle that knows each next token scores 1 at every k; a model that always says "a" scores the
    share of answers that are "a"; every query is counted once."""
    import random
    import torch
    from data import synthetic
    from data.loader import get_tokenizer
    from ladders import hops
    task = dict(n_symbols=6, max_hops=3, eval_docs=40, tokenizer="gpt2-257")

    class Oracle(torch.nn.Module):
        config = type("C", (), dict(eot_token=256))

        def forward(self, idx, n_passes=None):
            return torch.nn.functional.one_hot(torch.cat([idx[:, 1:], idx[:, :1]], 1), 257).float(), None

    class SaysA(Oracle):
        def forward(self, idx, n_passes=None):
            a = get_tokenizer("gpt2-257").encode("a")[0]
            return torch.nn.functional.one_hot(torch.full_like(idx, a), 257).float(), None

    acc = hops.accuracy(Oracle(), task, batch=16)
    assert sorted(acc) == [1, 2, 3] and all(c == n for c, n in acc.values())
    assert sum(n for _, n in acc.values()) == 40 * 12
    rng = random.Random("hops-eval-1")
    docs = [synthetic.hops_document(rng, 6, 3) for _ in range(40)]
    a = sum(text[offset] == "a" for text, answers in docs for offset, _ in answers)
    assert sum(c for c, _ in hops.accuracy(SaysA(), task, batch=7).values()) == a > 0


def test_the_hops_report_reads_its_rule_on_known_accuracies():
    """Made-up accuracies (two seeds, +-0.01): fresh depth and both loops gain 0.2 at k >= 2, SMELT 0.1, a
    third pass 0.05 for P only: the contrasts and the rule's three readings."""
    from ladders import hops
    base = dict(A=0.2, B=0.15, C=0.3, D=0.4, P=0.4, E=0.4)
    rows = []
    for arm, v in base.items():
        for seed, e in ((1, -0.01), (2, 0.01)):
            for passes in ([1, 2, 3, 4] if arm in "CDP" else [1]):
                extra = 0.05 if arm == "P" and passes == 3 else 0.0
                for k in (1, 2, 3, 4):
                    rows.append(dict(arm=arm, cell="L4w64-e16", seed=seed, F=1.0, N_stored=1, passes=passes,
                                     hops=k, accuracy=(0.9 if k == 1 else v + e + extra), loss=1.0))
    text = "\n".join(hops.report(dict(PRESETS["smelt-cpu-hops"], name="h"), rows))
    sigma = math.sqrt(2) * 0.01  # per run: 0.01 off; a difference of two 2-seed means: sigma
    lo, hi = scipy_stats.t.interval(0.95, 6, 0.1, sigma)
    assert f"C - A (SMELT: equal FLOPs, parameters and KV cache): +0.100 [{lo:+.3f}, {hi:+.3f}] = +7.1 sigma" in text
    assert "P (trained at 2): 1: 0.400 2: 0.400 3: 0.450 4: 0.400; 3 - 2: +0.050" in text
    assert text.endswith("the second visit pays at equal stored parameters (D - A or P - A above +2 sigma), as "
                         "much as fresh depth at equal FLOPs\n  SMELT gains at matched compute (C - A above +2 "
                         "sigma)\n  passes beyond the trained ones pay at test time for P")
    z = dict.fromkeys(["C-A", "D-A", "P-A", "E-A", "D-E", "P-E", "C-B"], 0.0)
    assert hops.reading(z, {})[0].startswith("depth does not pay here")
    assert hops.reading(dict(z, **{"E-A": 3.0}), {})[0].startswith("depth pays (E - A above +2 sigma) but the loop")
    assert "less than fresh depth" in hops.reading(dict(z, **{"E-A": 5.0, "D-A": 3.0, "D-E": -2.5}), {})[0]
