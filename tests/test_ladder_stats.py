"""ladders/stats.py, the statistics every ladder report's claims rest on, against scipy and known answers:
t-intervals, the sqrt(2) of a difference, the seed bootstrap (a Student t per mean, deterministic) and its
agreement, profile intervals; then the reports' rules built on them: a switch point claimed only when the
bootstrap agrees, a SMELT surface reported only where the grid identifies it, [X]'s numbers from its data."""

import csv
import math
import os

import numpy as np
import pytest
from scipy import stats as scipy_stats

import fit
from ladders.presets import get_preset
from ladders.repeat_report import repeat_budget_lines
from ladders.smelt import f_levels, grid_lines, identifiability_lines, smelt_report, smelt_surfaces
from ladders.stats import (AGREEMENT, agreement, claims_lines, contrast, difference, difference_sigma, interval_verdict,
                           pooled_std, profile_bound, profile_interval, seed_draws, share_verdict, t_interval)
from ladders.x import X_PAPER_MULTIPLIERS, multiplier_claim, rises

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_t_interval_is_scipys():
    seeds = np.array([1.9414, 1.9324, 1.9419])  # x-cpu-repeat K = 1, d3
    mean, sem = seeds.mean(), scipy_stats.sem(seeds)
    assert t_interval(mean, seeds.std(ddof=1), 3, 2) == pytest.approx(scipy_stats.t.interval(0.95, 2, mean, sem))
    # three seeds: the interval is far wider than their min..max (t(2) = 4.30)
    lo, hi = t_interval(mean, seeds.std(ddof=1), 3, 2)
    assert lo < seeds.min() - 0.005 and hi > seeds.max() + 0.005
    # a pooled std: sum of (n - 1) s^2 over the groups, its dof theirs; a group of one adds nothing
    groups = [[1.0, 1.2, 1.4], [2.0, 2.2], [3.0]]
    sigma, dof = pooled_std(groups)
    assert dof == 3 and sigma == pytest.approx(math.sqrt((0.08 + 0.02) / 3))
    assert pooled_std([[1.0], [2.0]]) == (None, 0)
    assert t_interval(2.0, sigma, 1, dof) == pytest.approx(scipy_stats.t.interval(0.95, 3, 2.0, sigma))


def test_a_difference_has_sqrt2_sigma_and_scipys_p():
    assert difference_sigma(0.0155) == pytest.approx(math.sqrt(2) * 0.0155)  # a pair of single runs
    assert difference_sigma(1.0, 3, 3) == pytest.approx(math.sqrt(2 / 3))
    a, b = np.array([1.8847, 1.8751, 1.8916]), np.array([1.8708, 1.8647, 1.8734])
    sigma, dof = pooled_std([a, b])
    d = difference(a.mean(), 3, b.mean(), 3, sigma, dof)
    student = scipy_stats.ttest_ind(a, b, equal_var=True)  # the same pooled two-sample t-test
    assert d["z"] == pytest.approx(student.statistic) and d["p"] == pytest.approx(student.pvalue)
    half = scipy_stats.t.ppf(0.975, 4) * sigma * math.sqrt(2 / 3)
    assert (d["lo"], d["hi"]) == pytest.approx((d["diff"] - half, d["diff"] + half))
    # a difference of two differences (an interaction): sigma sqrt(sum 1/n) over its four means
    c = contrast([(1, 2.0, 2), (-1, 1.9, 2), (-1, 1.5, 3), (1, 1.45, 3)], 0.01, 10)
    s = 0.01 * math.sqrt(1 / 2 + 1 / 2 + 1 / 3 + 1 / 3)
    assert c["diff"] == pytest.approx(0.05) and c["sigma"] == pytest.approx(s)
    assert c["p"] == pytest.approx(2 * scipy_stats.t.sf(0.05 / s, 10))


def test_seed_bootstrap_gives_t_intervals_deterministically():
    draws = seed_draws([1.0, 2.0], [3, 1], 0.01, 4, n_draws=40000, seed=7)
    assert np.array_equal(draws, seed_draws([1.0, 2.0], [3, 1], 0.01, 4, n_draws=40000, seed=7))
    for j, (mean, n) in enumerate(((1.0, 3), (2.0, 1))):
        band = np.percentile(draws[:, j], [2.5, 97.5])
        assert band == pytest.approx(t_interval(mean, 0.01, n, 4), abs=0.02 * 0.01 * 2.78 / math.sqrt(n))


def test_bootstrap_agreement_separated_and_tied():
    # the best of two points: far apart, every draw agrees; equal, about half of them
    apart = seed_draws([1.0, 1.1], [3, 3], 0.01, 8, n_draws=2000, seed=0).argmin(axis=1)
    tied = seed_draws([1.0, 1.0], [3, 3], 0.01, 8, n_draws=2000, seed=0).argmin(axis=1)
    assert agreement(apart[:, None], [0])[0] == 1.0
    assert 0.45 < agreement(tied[:, None], [0])[0] < 0.55
    assert share_verdict(AGREEMENT) == "reproduces" and share_verdict(0.5) == "cannot tell"
    assert share_verdict(1 - AGREEMENT) == "does not"
    assert interval_verdict([(1.1, 1.3), (1.02, 1.2)], 1.0) == "reproduces"
    assert interval_verdict([(0.9, 1.1)], 1.0) == "cannot tell" and interval_verdict([(1.1, 1.2), (0.8, 0.95)], 1.0) \
        == "does not"


def test_switch_point_claimed_only_when_the_bootstrap_agrees():
    """repeat_budget_lines: a looped K clearly best above a budget -> the switch is claimed; two K within the
    seed noise of each other everywhere -> not claimed, and the claim says where the data cannot tell."""
    def report(gap, sigma):
        C1 = [1e12, 2e12, 4e12, 8e12]
        losses = {1: [2.0, 1.8, 1.7, 1.65], 2: [2.02 + gap, 1.7 + gap, 1.55 + gap, 1.45 + gap]}
        pts = {(k, d): (c * (1 + 0.5 * (k - 1)), [v - 1e-3, v, v + 1e-3]) for k in (1, 2)
               for d, (c, v) in enumerate(zip(C1, losses[k]))}
        frontier = {k: [(pts[k, d][0], losses[k][d]) for d in range(4)] for k in (1, 2)}
        out = {}
        lines = repeat_budget_lines(frontier, pts, (sigma, 16), 400, 0, out)
        return out, "\n".join(lines)
    clear, text = report(0.0, 0.001)
    assert clear["best_K_switch_share"] >= AGREEMENT and "claimed" in text and "not claimed" not in text
    assert clear["best_K_grows"] and clear["best_K_looped_share"][-1] == 1.0
    tied, text = report(0.195, 0.05)  # K = 2 just ahead at the top only, the noise ten times the difference
    assert tied["best_K"][-1] == 2 and tied["best_K_switch"] == pytest.approx(1.2e13)
    assert tied["best_K_switch_share"] < AGREEMENT and "not claimed" in text
    assert 1 - AGREEMENT < tied["best_K_looped_share"][-1] < AGREEMENT and not tied["best_K_grows"]


def test_profile_interval_and_its_bound():
    assert profile_bound(3.74e-4, 54) == pytest.approx(scipy_stats.chi2.ppf(0.95, 1) / 2 * 3.74e-4 / 54)
    a = np.linspace(0, 2, 21)
    lo, hi, edge = profile_interval(a, (a - 1.0) ** 2, 0.045)  # inside: |a - 1| <= 0.2; the nearest values outside
    assert (lo, hi, edge) == (pytest.approx(0.7), pytest.approx(1.3), False)
    assert profile_interval(a, np.zeros_like(a), 0.01) == (0.0, 2.0, True)  # flat: not bounded by the data


def synthetic_rows(scales):
    """fit.synthetic_surface_runs as runs.csv rows of a smelt ladder (a branch per D), at the given scales."""
    runs = fit.synthetic_surface_runs(seed=0, scales=scales)
    rows, seen = [], {}
    for a, cell, F, S, D, loss in zip(*(runs[k] for k in ("arch", "cell", "F", "S", "D", "loss"))):
        seen[a, cell] = seen.get((a, cell), -1) + 1
        rows.append(dict(arch=a, cell=cell, F=F, S=S, D=D, loss=loss, branch_tpp=seen[a, cell], seed=1337))
    return rows


def test_smelt_surface_reported_only_where_the_grid_identifies_it():
    """[S]-like surfaces on 4 levels of F: identified, a's profile interval holds the true a, CE Gain reported;
    on 3 levels: not identified, and the report says CE Gain and TPP are not reported."""
    assert [len(f_levels(F)) for F in ([1.0, 1.05, 2.0, 2.2, 4.0], [1.0, 1.2, 1.44])] == [3, 1]
    text, out, _ = smelt_report(get_preset("smelt-micro"), [], synthetic_rows((2.5e8, 5e8, 1e9, 2e9)), 0,
                                progress=False)
    assert out["identified"] == {"baseline": True, "smelt": True} and out["ce_gain"]
    for arch, p in out["profile"].items():
        assert p["a"][0] < fit.SYNTHETIC_SURFACES[arch]["a"] < p["a"][1] and not p["at_edge"]
    assert "| a six-coefficient [S2] surface L(F, S, D) per architecture, identified by the grid | reproduces" in text
    rows = synthetic_rows((2.5e8, 5e8, 1e9))
    runs = {k: np.asarray([r[k] for r in rows], dtype=object if k in ("arch", "cell") else float)
            for k in ("arch", "cell", "F", "S", "D", "loss")}
    out, lines = {"fits": {}}, []
    grid_lines(rows, runs, out)
    identifiability_lines(runs, smelt_surfaces(runs, lines, out), out)
    assert out["identified"] == {"baseline": False, "smelt": False} and out["grid"]["F_levels"]["baseline"] == 3


def test_x_claims_read_x_numbers_and_bands():
    """X_PAPER_MULTIPLIERS are [X]'s own ladders' interpolated multipliers (tests/data/fineweb_ladders.csv, d >= 8),
    first and last; a claim 'ahead and rising' needs every band above 1 and the last above the first."""
    ladders = {}
    for r in csv.DictReader(open(os.path.join(REPO, "tests", "data", "fineweb_ladders.csv"))):
        if int(r["depth"]) >= 8:
            ladders.setdefault(r["arm"].replace("_", "-"), []).append((float(r["compute_flops"]), float(r["val_loss"])))
    for (arm, ref), (first, last) in X_PAPER_MULTIPLIERS.items():
        m = fit.compute_multiplier(*zip(*sorted(ladders[ref])), *map(np.array, zip(*sorted(ladders[arm]))))
        m = m[np.isfinite(m)]
        assert (m[0], m[-1]) == (pytest.approx(first, abs=0.005), pytest.approx(last, abs=0.005)), (arm, ref)
    up = [dict(C=1e11, value=1.1, lo=1.05, hi=1.15), dict(C=1e12, value=1.3, lo=1.2, hi=1.4)]
    down = [dict(C=1e11, value=1.3, lo=1.2, hi=1.4), dict(C=1e12, value=0.9, lo=0.85, hi=0.95)]
    assert rises(up) == "reproduces" and rises(down) == "does not" and rises(up[:1]) == "cannot tell"
    assert multiplier_claim(up, (1.04, 1.08))[0] == "reproduces"
    assert multiplier_claim(down, (1.04, 1.08))[0] == "does not"
    assert multiplier_claim(down[:1], (1.0, 1.0), rising=False)[0] == "reproduces"
    table = claims_lines([("claim", "does not", "0.92 [0.86, 0.99]")])
    assert table[1:] == ["| paper claim | here | the number [95% interval] |", "| --- | --- | --- |",
                         "| claim | does not | 0.92 [0.86, 0.99] |"]
