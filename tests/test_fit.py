# fit.py: recovery of known laws, Epoch AI's Chinchilla replication, [X]'s published numbers from its
# ladders, the closed forms [S3]-[S5], multipliers, cell bootstrap, quadratic vertex, read_runs, the CLI.
import csv
import hashlib
import json
import math
import os
import sys

import numpy as np
import pytest
from scipy.optimize import brentq, minimize_scalar

import fit
import synthetic_runs
from synthetic_runs import SYNTHETIC_POWER_E, SYNTHETIC_POWER_LAWS, SYNTHETIC_SURFACES as SURFACES
from test_sample import error_line

DATA = os.path.join(os.path.dirname(__file__), "data", "chinchilla_fig4_epoch.csv")
POWER_EXAMPLE = os.path.join(os.path.dirname(__file__), "data", "power_example.csv")
X_LADDERS = os.path.join(os.path.dirname(__file__), "data", "fineweb_ladders.csv")  # [X]'s released ladders
X_LADDERS_SHA256 = "94e787a140c3094981d82779d9c75c971f40a541970bcfbbdee0e8292d730e2c"  # README_fineweb.md


def arch_arrays(runs, arch):
    m = runs["arch"] == arch
    return tuple(np.asarray(runs[k][m], dtype=float) for k in ("F", "S", "D", "loss"))


def power_law(E=2.0, A=1.5, gamma=0.3):
    return fit.PowerLawFit(E=E, A=A, gamma=gamma)


def run(capsys, *argv):
    assert fit.main(list(argv)) == 0
    out = capsys.readouterr().out
    return json.loads(out) if "--json" in argv else out



@pytest.mark.parametrize("noise, seed", [(0.002, 0), (0.002, 1), (0.0, 0)])
def test_surface_recovers_coefficients(noise, seed):
    # Noise-free, exact: a plain 72-start grid missed `a` by 0.12 here; variable projection must not.
    runs = synthetic_runs.synthetic_surface_runs(noise=noise, seed=seed)
    for arch, true in SURFACES.items():
        f = fit.fit_surface(*arch_arrays(runs, arch))
        for k in ("E", "a", "b", "c"):
            assert abs(getattr(f, k) - true[k]) < (0.02 if noise else 1e-5), (arch, k)
        assert all(0.7 < getattr(f, k) / true[k] < 1.4 for k in ("A", "K")), arch
        assert abs(f.gamma - fit.SurfaceFit(**true).gamma) < 0.01
        assert 0.001 < f.rmse < 0.01 if noise else f.rmse < 1e-8  # noise 0.2% of a loss ~2 nats


def test_chinchilla_recovers_synthetic():
    true = dict(E=1.8, A=500.0, B=2000.0, alpha=0.35, beta=0.37)
    N = np.repeat(np.geomspace(5e7, 1e10, 12), 8)
    D = N * np.tile(np.geomspace(2, 200, 8), 12)
    noise = np.exp(0.003 * np.random.default_rng(0).standard_normal(len(N)))
    f = fit.fit_chinchilla(N, D, fit.ChinchillaFit(**true).loss(N, D) * noise)
    assert abs(f.E - 1.8) < 0.03 and abs(f.alpha - 0.35) < 0.02 and abs(f.beta - 0.37) < 0.02


@pytest.mark.parametrize("free_fit", [fit.fit_power_law_x, fit.fit_power_law_huber_log])
def test_power_law_recovers_synthetic(free_fit):
    C = np.geomspace(1e17, 1e20, 12)
    f = free_fit(C, power_law().loss(C) * np.exp(0.002 * np.random.default_rng(1).standard_normal(12)))
    assert abs(f.E - 2.0) < 0.08 and abs(f.gamma - 0.3) < 0.04 and abs(f.A - 1.5) < 0.1


def test_x_free_fit_start_bounds_and_refusals():
    C = np.geomspace(1e17, 1e20, 8)
    exact = power_law().loss(C)
    f = fit.fit_power_law_x(C, exact)
    assert abs(f.E - 2.0) < 1e-6 and abs(f.gamma - 0.3) < 1e-6 and abs(f.A - 1.5) < 1e-6
    pure = 10.0 * (C / 1e18) ** -0.05  # E = 0 stays inside the bounds 0 <= E < min L
    g = fit.fit_power_law_x(C, pure)
    assert 0.0 <= g.E < pure.min() and abs(g.gamma - 0.05) < 1e-3
    with pytest.raises(ValueError, match="power-law fit: 3 points at 3 distinct computes is too few to fit"):
        fit.fit_power_law_x(C[:3], exact[:3])
    with pytest.raises(ValueError, match="6 points at 2 distinct computes is too few"):  # repeated seeds
        fit.fit_power_law_x(np.repeat(C[:2], 3), np.repeat(exact[:2], 3))


def test_fixed_E_fit_gives_the_slope_standard_error():
    C = np.geomspace(1e17, 1e20, 10)
    L = 2.0 + 1.5 * (C / 1e18) ** -0.3 * np.exp(0.01 * np.random.default_rng(5).standard_normal(10))
    f = fit.fit_power_law_fixed_E(C, L, 2.0)
    x, y = np.log(C / 1e18), np.log(L - 2.0)
    slope, intercept = np.polyfit(x, y, 1)
    resid = y - (slope * x + intercept)
    se = math.sqrt(np.sum(resid ** 2) / (len(x) - 2) / np.sum((x - x.mean()) ** 2))  # OLS slope error by hand
    assert (f.gamma, f.A) == pytest.approx((-slope, math.exp(intercept)), rel=1e-12) and 0 < f.gamma_se < 0.01
    assert f.gamma_se == pytest.approx(se, rel=1e-9)
    with pytest.raises(ValueError, match="2 points at 2 distinct computes is too few"):  # no error estimate
        fit.fit_power_law_fixed_E(C[:2], L[:2], 2.0)



def epoch_points():
    rows = fit.read_runs(DATA, numbers=("params", "train_flops", "loss"))
    N, C, L = (np.array([r[k] for r in rows]) for k in ("params", "train_flops", "loss"))
    keep = np.argsort(L)[:-5]  # drop the 5 highest-loss points, as Epoch did
    return N[keep], (C / (6 * N))[keep], L[keep]


def test_chinchilla_epoch_replication_and_its_traps():
    N, D, L = epoch_points()
    ours = fit.fit_chinchilla(N, D, L)
    assert len(L) == 240 and abs(ours.E - 1.817) < 0.003 and abs(ours.A - 478) < 4 and abs(ours.B - 2144) < 25
    assert abs(ours.alpha - 0.347) < 0.002 and abs(ours.beta - 0.367) < 0.002
    # Trap 1: the naive optimiser (scipy's tolerances) from Hoffmann's values stalls next to them.
    for reduce in ("sum", "mean"):
        naive = fit.fit_chinchilla(N, D, L, grid=None, inits=[fit.HOFFMANN_INIT], reduce=reduce,
                                   centre=False, tol="scipy")
        assert abs(naive.E - 1.69) < 0.02 and abs(naive.B - 410.7) < 5 and naive.beta < 0.3
        assert naive.objective > ours.objective * 1.1
    # Trap 2: even from the grid, a mean-reduced loss makes L-BFGS-B stop early.
    early = fit.fit_chinchilla(N, D, L, reduce="mean", tol="scipy")
    assert abs(early.B / ours.B - 1) > 0.2 and early.objective > ours.objective
    # Our protocol reaches the same optimum whatever the start or reduction.
    for kwargs in (dict(reduce="mean"), dict(grid=None, inits=[fit.HOFFMANN_INIT])):
        other = fit.fit_chinchilla(N, D, L, **kwargs)
        assert abs(other.E - ours.E) < 1e-4 and other.objective <= ours.objective * (1 + 1e-6)



def numeric_frontier(f, C, S):
    """min over F of L(F, S, C/F), by a bounded scalar search in log F."""
    res = minimize_scalar(lambda lf: float(f.loss(math.exp(lf), S, C / math.exp(lf))), method="bounded",
                          bounds=(math.log(C) - 60, math.log(C) - 10), options=dict(xatol=1e-10))
    return math.exp(res.x), res.fun


def test_closed_forms_match_numeric_optimum():
    assert round(fit.SurfaceFit(**SURFACES["baseline"]).gamma, 3) == 0.237  # [S4] ac / (a + c)
    f = fit.SurfaceFit(**SURFACES["smelt"])
    assert round(f.gamma, 3) == 0.250
    for C, S in ((1e20, 0.85), (1e21, 0.95), (3e22, 0.5)):
        F_num, L_num = numeric_frontier(f, C, S)
        F_opt = fit.optimal_flops(f, C, S)
        assert abs(F_opt / F_num - 1) < 1e-4 and abs(fit.frontier_loss(f, C, S) - L_num) < 1e-10  # [S3], [S4]
        assert abs(fit.tpp(f, C, S) - (C / F_opt) / (F_opt / 6)) < 1e-9 * fit.tpp(f, C, S)
        assert abs(fit.frontier_compute(f, fit.frontier_loss(f, C, S), S) / C - 1) < 1e-10
    fits = {a: fit.SurfaceFit(**c) for a, c in SURFACES.items()}
    C = np.geomspace(1e19, 1e22, 5)
    for arch, (gamma, excess) in fit.frontier_curves(fits).items():  # [S4] L* - E = f(S) C^-gamma, per arch
        assert gamma == fits[arch].gamma
        f_S = fit.frontier_prefactor(fits[arch], 0.9)
        assert excess(C, 0.9) == pytest.approx(f_S * C ** -gamma, rel=1e-9)


def test_ce_gain_properties():
    base = fit.SurfaceFit(**SURFACES["baseline"])
    C, S = np.array([1e20, 1e21, 1e22]), 0.9
    assert np.all(np.abs(fit.ce_gain(base, fit.SurfaceFit(**SURFACES["baseline"]), C, S)) < 1e-12)
    assert np.all(fit.ce_gain(base, fit.SurfaceFit(**{**SURFACES["baseline"], "A": 2000.0}), C, S) > 0)
    assert np.all(fit.ce_gain(base, fit.SurfaceFit(**{**SURFACES["baseline"], "K": 3e6}), C, S) < 0)
    # equal to a direct numeric inversion: numeric frontiers, root find in log C
    tgt = fit.SurfaceFit(**SURFACES["smelt"])
    for C1 in (1e20, 1e21):
        L_tgt = numeric_frontier(tgt, C1, S)[1]
        log_c_ref = brentq(lambda lc: numeric_frontier(base, math.exp(lc), S)[1] - L_tgt, math.log(1e17),
                           math.log(1e25), xtol=1e-12)
        assert abs(fit.ce_gain(base, tgt, C1, S) - (1 - C1 / math.exp(log_c_ref))) < 1e-6


def test_subset_fits_share_exponents():
    base = SURFACES["baseline"]
    subsets = {"code": dict(base, E=1.30, A=2000.0), "web": dict(base, E=1.55, K=2.5e6)}
    parts = [synthetic_runs.synthetic_surface_runs({n: c}, noise=0.001, seed=3) for n, c in subsets.items()]
    cols = [np.concatenate([p[k] for p in parts]).astype(float) for k in ("F", "S", "D", "loss")]
    labels = [n for n, p in zip(subsets, parts) for _ in p["loss"]]
    full = fit.SurfaceFit(**base)
    fits = fit.fit_subsets(full, *cols, labels)
    for name, coefs in subsets.items():
        f = fits[name]
        assert (f.a, f.b, f.c) == (full.a, full.b, full.c)
        assert abs(f.E - coefs["E"]) < 0.01 and (f.A, f.K) == pytest.approx((coefs["A"], coefs["K"]), rel=0.1)



def test_compute_multiplier_interpolates_uses_falling_pairs_and_never_extrapolates():
    C = np.geomspace(1e17, 1e19, 6)
    L = power_law().loss(C)
    assert np.all(fit.compute_multiplier(C, L, C, L) == 1.0)  # exactly
    assert np.all(np.isnan(fit.compute_multiplier(C, L, C, 0.5 * L)))  # every ref loss out of the arm's range
    assert np.allclose(fit.compute_multiplier(C[1:-1], L[1:-1], C / 2, L), 2.0, rtol=1e-12)
    # log C linear in L, a quarter of the way from C[2] to C[3]; t and 1 - t would differ
    pi = fit.compute_multiplier([3e18], [L[2] + 0.25 * (L[3] - L[2])], C, L)[0]
    assert pi == pytest.approx(3e18 / math.exp(0.75 * math.log(C[2]) + 0.25 * math.log(C[3])), rel=1e-12)
    assert fit.compute_multiplier([5e18], [L[-1]], C, L)[0] == pytest.approx(5e18 / C[-1], rel=1e-12)
    assert np.isnan(fit.compute_multiplier([1e18], [L[0] * 1.01], C, L)[0])
    assert np.isnan(fit.compute_multiplier([1e18], [L[-1] * 0.99], C, L)[0])
    C = np.array([1e18, 2e18, 4e18, 8e18])
    # The loss rises from 2e18 to 4e18: 2.7 is bracketed by that rising pair, skipped, and by (4e18, 8e18).
    L = np.array([2.5, 2.3, 2.8, 2.2])
    want = math.exp(math.log(4e18) + (2.8 - 2.7) / (2.8 - 2.2) * (math.log(8e18) - math.log(4e18)))
    assert fit.compute_multiplier([1e19], [2.7], C, L)[0] == pytest.approx(1e19 / want, rel=1e-12)
    # 2.4 is bracketed by two falling pairs: the smallest compute wins, whatever order the points come in
    first = 1e19 / math.exp(math.log(1e18) + (2.5 - 2.4) / (2.5 - 2.3) * math.log(2.0))
    for order in ([0, 1, 2, 3], [2, 0, 3, 1]):
        assert fit.compute_multiplier([1e19], [2.4], C[order], L[order])[0] == pytest.approx(first, rel=1e-12)
    assert np.isnan(fit.compute_multiplier([1e19], [2.9], C, L)[0])  # above every falling pair


def test_power_laws_shared_E():
    rng = np.random.default_rng(2)
    C = np.geomspace(1e17, 1e20, 8)
    runs = {"vanilla": (C, power_law(A=1.5, gamma=0.30).loss(C) * np.exp(0.001 * rng.standard_normal(8))),
            "loop": (C, power_law(A=1.4, gamma=0.32).loss(C) * np.exp(0.001 * rng.standard_normal(8)))}
    fits = fit.fit_power_laws(runs, "vanilla")
    assert fits["vanilla"].E == fits["loop"].E
    assert abs(fits["loop"].gamma - 0.32) < 0.03 and fits["loop"].gamma > fits["vanilla"].gamma
    # the multiplier [X6] of the fitted laws rises with C as the true one, (1.5/1.4)^(1/0.32) (C/C0)^(1/16)
    L_ref = fits["vanilla"].loss(C)
    true = (1.5 / 1.4) ** (1 / 0.32) * (C / 1e18) ** (0.02 / 0.32)
    assert np.all(np.abs(fits["vanilla"].compute(L_ref) / fits["loop"].compute(L_ref) / true - 1) < 0.02)
    # the reference too is fitted with E held fixed: its gamma is the regression's
    free = fit.fit_power_law_x(*runs["vanilla"])
    fixed = fit.fit_power_law_fixed_E(*runs["vanilla"], free.E)
    assert (fits["vanilla"].E, fits["vanilla"].gamma) == (free.E, fixed.gamma)
    assert all(0 < f.gamma_se < 0.01 for f in fits.values())
    per_arch = fit.fit_power_laws(runs, "vanilla", shared_E=False)["loop"].E
    assert per_arch != free.E and per_arch == fit.fit_power_law_x(*runs["loop"]).E


# [X]'s published numbers from its own ladders (tests/data/README_fineweb.md): the exponents to 5e-5 (0.11125
# has 5 significant digits), the multipliers at Vanilla's largest budget (1.006e20) to 2 decimals, E to 1e-3.
X_GAMMA = {"vanilla": 0.11125, "operator_1": 0.11427, "loop_2": 0.11411, "loop_grow": 0.11593,
           "untied_2": 0.11411, "untied_grow": 0.11679, "deep_vanilla": 0.11139, "deep_vanilla_grow": 0.11376}
X_MULT_1E20 = {"operator_1": 1.25, "loop_grow": 1.36, "untied_grow": 1.55}
X_E = 1.7064


def test_x_ladders_file_is_the_released_one():
    assert hashlib.sha256(open(X_LADDERS, "rb").read()).hexdigest() == X_LADDERS_SHA256  # byte for byte, CRLF
    rows = fit.read_runs(X_LADDERS, numbers=("depth", "C", "loss"), text=("arch",),
                         rename={"arm": "arch", "compute_flops": "C", "val_loss": "loss"})
    assert [rows[0][k] for k in ("arch", "depth", "C", "loss")] == ["vanilla", 6, 3.252671e17, 3.560862]
    assert len(rows) == 58 and {r["arch"] for r in rows} == set(X_GAMMA) and rows[-1]["arch"] == "untied_grow"


def test_x_protocol_reproduces_the_published_exponents_and_multipliers(capsys):
    # The default protocol, [X]'s, C0 = 1e18; the multipliers at Vanilla's points with depth >= 8, as [X].
    out = run(capsys, "power", X_LADDERS, "--ref", "vanilla", "--min-depth", "8", "--json")
    assert abs(out["E"] - X_E) < 1e-3 and len(out["budgets"]) == 7
    for a, published in X_GAMMA.items():
        assert abs(out["fits"][a]["gamma"] - published) < 5e-5 and 0 < out["fits"][a]["gamma_se"] < 1e-3, a
    assert out["budgets"][-1] == pytest.approx(1.006363e20)
    assert all(round(out["multipliers"][a][-1], 2) == m for a, m in X_MULT_1E20.items())
    # Huber on log-loss, kept as an option: a lower E and exponents about 0.001 lower
    huber = run(capsys, "power", X_LADDERS, "--ref", "vanilla", "--protocol", "huber-log", "--json")
    assert huber["E"] < out["E"] - 0.01 and abs(huber["fits"]["vanilla"]["gamma"] - 0.1101) < 1e-4
    assert all(0.0005 < out["fits"][a]["gamma"] - huber["fits"][a]["gamma"] < 0.002 for a in X_GAMMA)
    # without --min-depth every Vanilla point is a budget: d6 too, where Vanilla's loss is above every other's
    m = run(capsys, "power", X_LADDERS, "--ref", "vanilla", "--json")["multipliers"]["untied_grow"]
    assert len(m) == 8 and m[0] is None
    text = run(capsys, "power", X_LADDERS, "--ref", "vanilla", "--min-depth", "8")
    assert "E = 1.7064" in text and "gamma=0.11125 +- 0.0003" in text and "untied_grow: E=1.7064" in text
    assert "(depth >= 8)" in text and "1.01e+20:1.553" in text


def test_cell_bootstrap_seeded_and_worker_independent():
    runs = synthetic_runs.synthetic_surface_runs(noise=0.003, seed=0)
    kw = dict(budgets=[1e20, 1e21], sparsities=[0.85, 0.95], n_draws=6, seed=7, keep_draws=True)
    one = fit.cell_bootstrap(runs, "baseline", "smelt", n_workers=1, **kw)
    two = fit.cell_bootstrap(runs, "baseline", "smelt", n_workers=2, full_fits=one["full_fits"], **kw)
    assert one["lo"]["ce_gain"].shape == (2, 2)
    for k in one["draws"]:
        np.testing.assert_array_equal(one["draws"][k], two["draws"][k])
    assert np.ptp(one["draws"]["ref.gamma"]) > 0 and np.all(one["lo"]["ce_gain"] <= one["hi"]["ce_gain"])


def test_quadratic_vertex():
    tpp = np.geomspace(2, 50, 7)
    loss = np.exp(1.0 + 0.05 * (np.log(tpp) - math.log(8.0)) ** 2)
    assert abs(fit.quadratic_vertex(tpp, loss)["x_opt"] - 8.0) < 1e-8  # the compute-optimal TPP
    rho = np.linspace(0.1, 0.9, 5)
    assert abs(fit.quadratic_vertex(rho, np.exp(1 + (rho - 0.27) ** 2), log_x=False)["x_opt"] - 0.27) < 1e-6
    three = fit.quadratic_vertex([1.0, 2.0, 4.0], [3.0, 1.0, 2.0], log_y=False)  # exactly through 3 points
    a, b, c = np.polyfit(np.log([1.0, 2.0, 4.0]), [3.0, 1.0, 2.0], 2)
    assert three["x_opt"] == pytest.approx(math.exp(-b / (2 * a)), rel=1e-12)
    with pytest.raises(ValueError, match="no minimum"):
        fit.quadratic_vertex(tpp, 1 / loss)
    with pytest.raises(ValueError, match=r"quadratic-vertex fit: no minimum \(2 points"):
        fit.quadratic_vertex([1.0, 2.0], [1.0, 2.0])


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_read_runs_types_renames_and_a_byte_order_mark(tmp_path):
    text = "\ufeffarch, C ,loss,note,seed,ok,gap\nv,1e18,3.5,x,1,True,\nw,2e18,3,y z,2,False,"
    path = write(tmp_path, "r.csv", text)
    rows = fit.read_runs(path, numbers=("C", "loss"), text=("arch",))
    assert rows == [dict(arch="v", C=1e18, loss=3.5, note="x", seed=1, ok=True, gap=None),
                    dict(arch="w", C=2e18, loss=3, note="y z", seed=2, ok=False, gap=None)]
    assert type(rows[1]["loss"]) is int and type(rows[0]["seed"]) is int  # as written: ints stay ints
    assert fit.read_runs(path, text=("label",), rename={"note": "label"})[0]["label"] == "x"
    assert fit.read_runs(write(tmp_path, "t.csv", "arch,C\n1e3,5\n"), text=("arch",))[0]["arch"] == "1e3"


@pytest.mark.parametrize("text, message", [
    ("arch,loss\nv,2.0\n", "r.csv: no column C in its header ['arch', 'loss']"),
    ("", "r.csv: no column C, loss, arch in its header []"),
    ("arch,C,loss\nv,1e18,2.0\nv,abc,2.0\n", "r.csv line 3: C 'abc' is not a number"),
    ("arch,C,loss\nv,1e18,2.0\nv,1e19,nan\n", "r.csv line 3: loss nan is not a number"),
    ("arch,C,loss\nv,1e18,2.0\nv,,2.0\n", "r.csv line 3: C None is not a number"),
    ("arch,C,loss\nv,1e18,2.0\nv,1e19\n", "r.csv line 3: loss None is not a number"),  # a short row
])
def test_read_runs_names_the_file_and_line_of_a_bad_row(tmp_path, text, message):
    with pytest.raises(ValueError) as e:
        fit.read_runs(write(tmp_path, "r.csv", text), numbers=("C", "loss"), text=("arch",))
    assert str(e.value) == str(tmp_path / message)


def test_power_example_file_is_the_generator_written_out():
    rows = fit.read_runs(POWER_EXAMPLE, numbers=("C", "loss"), text=("arch",))
    gen = synthetic_runs.synthetic_power_runs()
    assert [r["arch"] for r in rows] == list(gen["arch"])
    np.testing.assert_allclose([r["loss"] for r in rows], gen["loss"], rtol=1e-9)  # 10 significant digits



def surface_csv(tmp_path):
    runs = synthetic_runs.synthetic_surface_runs(noise=0.002, seed=0)
    with open(tmp_path / "runs.csv", "w", newline="") as f:
        csv.writer(f).writerows([[*runs, "note"], *([*row, "x"] for row in zip(*runs.values()))])
    return str(tmp_path / "runs.csv")


def test_cli_surface_json_and_text(tmp_path, capsys):
    path = surface_csv(tmp_path)
    out = run(capsys, "surface", path, "--ref", "baseline", "--target", "smelt", "--json")
    assert abs(out["fits"]["baseline"]["c"] - SURFACES["baseline"]["c"]) < 0.02
    assert out["budgets"] == [1e20, 1e21] and out["sparsity"] == [0.85, 0.95] and "lo" not in out
    fits = {a: fit.SurfaceFit(**{k: out["fits"][a][k] for k in "EAabKc"}) for a in ("baseline", "smelt")}
    assert out["value"]["ce_gain"][1][1] == pytest.approx(fit.ce_gain(*fits.values(), 1e21, 0.95), rel=1e-7)
    assert out["value"]["target.tpp"][0][0] == pytest.approx(fit.tpp(fits["smelt"], 1e20, 0.85), rel=1e-7)
    lines = run(capsys, "surface", path, "--ref", "baseline", "--target", "smelt", "--budgets", "1e21",
                "--sparsity", "0.9", "--bootstrap", "4", "--seed", "3").splitlines()
    assert lines[0].split() == ["arch", "E", "A", "a", "b", "K", "c", "gamma", "rmse"] and len(lines) == 5
    assert lines[4].startswith("  C=1e+21 S=0.9: CE Gain ") and lines[4].count("[") == 3


def test_cli_chinchilla_and_power_json(tmp_path, capsys):
    out = run(capsys, "chinchilla", DATA, "--drop-highest", "5", "--json")
    assert set(out) == {"E", "A", "B", "alpha", "beta", "objective"} and abs(out["E"] - 1.817) < 0.003
    assert "240 points: E=1.8172 A=477.83 B=2143.42" in run(capsys, "chinchilla", DATA, "--drop-highest", "5")
    by_D = "N,D,loss\n" + "".join(f"{n:g},{d:g},{2 + 400 / n ** 0.3 + 900 / d ** 0.3}\n"
                                  for n in (1e8, 3e8, 1e9) for d in (1e9, 1e10, 1e11))
    out = run(capsys, "chinchilla", write(tmp_path, "d.csv", by_D), "--json")  # N, D, loss: exact, noise-free
    assert abs(out["E"] - 2) < 1e-4 and abs(out["alpha"] - 0.3) < 1e-4 and abs(out["beta"] - 0.3) < 1e-4
    # Equal gammas: the multiplier [X6] is (1.5/1.4)^(1/0.3) = 1.2586 at every budget. Over 16
    # budgets (spacing not a divisor of that ratio), interpolating between neighbours is within 0.2%.
    C = np.geomspace(1e17, 1e19, 16)
    rows = [f"{a},{c:.17g},{l:.17g}" for a, A in (("vanilla", 1.5), ("loop", 1.4))
            for c, l in zip(C, power_law(A=A).loss(C))]
    path = write(tmp_path, "p.csv", "\n".join(["arch,C,loss", *rows]))
    out = run(capsys, "power", path, "--ref", "vanilla", "--json")
    assert out["fits"]["loop"]["E"] == out["E"] and abs(out["E"] - 2.0) < 1e-4
    vals = out["multipliers"]["loop"]  # vanilla's first loss is above all of loop's: no extrapolation
    assert vals[0] is None and all(abs(v / (1.5 / 1.4) ** (1 / 0.3) - 1) < 0.003 for v in vals[1:]), vals


def test_power_example_recovers_its_generating_laws(capsys):
    out = run(capsys, "power", POWER_EXAMPLE, "--ref", "vanilla", "--json")  # the README's command
    assert abs(out["E"] - SYNTHETIC_POWER_E) < 0.01  # 0.1% noise on 5 points: E = 1.993
    laws = {a: power_law(E=SYNTHETIC_POWER_E, **law) for a, law in SYNTHETIC_POWER_LAWS.items()}
    for a, law in laws.items():
        got = out["fits"][a]
        assert got["E"] == out["E"] and abs(got["gamma"] - law.gamma) < 0.004, a
        assert got["A"] == pytest.approx(law.A, rel=0.015), a
    C = np.array(out["budgets"])
    for a in ("loop-2", "untied-grow"):
        m = out["multipliers"][a]
        assert m[0] is None  # vanilla's smallest run is worse than any of the arch's: no extrapolation
        # [X]'s chord between points half a decade apart reaches a loss later than the convex law: 2-5% low
        rel = np.array(m[1:]) / (C / laws[a].compute(laws["vanilla"].loss(C)))[1:] - 1
        assert np.all((-0.06 < rel) & (rel < 0.005)), (a, rel)
    loop, grow = out["multipliers"]["loop-2"][1:], out["multipliers"]["untied-grow"][1:]
    assert np.ptp(loop) < 0.03 and np.all(np.diff(grow) > 0.05)  # constant vs exponent improvement
    out = run(capsys, "power", POWER_EXAMPLE, "--ref", "vanilla", "--per-arch-E", "--C0", "1e19", "--json")
    assert len({f["E"] for f in out["fits"].values()}) == 3 and out["fits"]["vanilla"]["C0"] == 1e19


ROWS = "".join(f"v,{c:g},{2 + 1.5 * (c / 1e18) ** -0.3:.6f}\n" for c in (1e18, 3e18, 1e19, 3e19, 1e20))
POWER_OK = "arch,C,loss\n" + ROWS


@pytest.mark.parametrize("argv, text, message", [
    (["power", "--ref", "v"], POWER_OK + "v,abc,2.0\n", "{path} line 7: C 'abc' is not"),
    (["power", "--ref", "v"], "arch,loss\nv,2\n", "{path}: no column C in its header"),
    (["power", "--ref", "v"], "arch,C,loss,loss\n" + ROWS.replace("\n", ",9.9\n"),
     "{path}: column 'loss' appears more than once in its header"),
    (["power", "--ref", "x"], POWER_OK, "{path}: no arch 'x' (have v)"),
    (["power", "--ref", "v"], POWER_OK + "w,1e18,3.5\nw,1e19,3.6\nw,1e20,3.7\n",
     "{path}: the loss of w does not fall with compute: no power law"),
    (["power", "--ref", "v"], POWER_OK + "w,1e18,1.5\nw,1e19,1.4\nw,1e20,1.3",
     "{path}: w: loss 1.3 <= shared E 2; fit E per architecture"),
    (["power", "--ref", "v", "--per-arch-E"], POWER_OK + "w,1e18,3.5\nw,1e19,3.5\nw,3e19,3.5\nw,1e20,3.5\n",
     "{path}: w: power-law fit: loss does not fall with compute for any E"),
    (["power", "--ref", "v"], POWER_OK + "w,1e18,3.5\nw,1e18,3.4\n",
     "{path}: w affine fit: 2 points at 1 distinct computes is too few to fit 2 coefficients"),
    (["power", "--ref", "v"], POWER_OK + "w,-1e18,3.5\nw,1e19,3.4\n", "{path}: C must be finite and > 0"),
    (["surface", "--ref", "b", "--target", "b"], "arch,cell,F,S,D,loss\n"
     + "".join(f"b,c{i},1e9,0.5,{1e10 * (i + 1)},2.0\n" for i in range(5)),
     "{path}: arch 'b': SMELT surface: 5 points is too few to fit 6 coefficients"),
    (["chinchilla", "--drop-highest", "2"], "N,D,loss\n" + "".join(f"{i + 1}e9,1e10,2.0\n" for i in range(6)),
     "{path}: Chinchilla fit: 4 points is too few to fit 5 coefficients"),
])
def test_cli_mistakes_are_one_line_and_status_2(tmp_path, capsys, argv, text, message):
    path = write(tmp_path, "p.csv", text)
    message = "fit.py: error: " + message.format(path=path)
    assert error_line(fit.main, [argv[0], path, *argv[1:]], capsys, "fit.py").startswith(message)


def test_cli_bad_flag_and_missing_file(tmp_path, capsys):
    argv = ["surface", write(tmp_path, "p.csv", "arch\n"), "--ref", "b", "--target", "b", "--budgets", "1,x"]
    assert error_line(fit.main, argv, capsys, "fit.py surface").endswith("invalid floats value: '1,x'")
    assert error_line(fit.main, ["power", "no/such.csv", "--ref", "v"], capsys, "fit.py") == \
        "fit.py: error: [Errno 2] No such file or directory: 'no/such.csv'"


def test_cli_plot_draws_the_fits_or_says_why_not(tmp_path, capsys, monkeypatch):
    pytest.importorskip("matplotlib")
    png = str(tmp_path / "{}.png")
    assert run(capsys, "power", POWER_EXAMPLE, "--ref", "vanilla", "--json", "--plot", png.format("p"))
    run(capsys, "surface", surface_csv(tmp_path), "--ref", "baseline", "--target", "smelt",
        "--plot", png.format("s"))
    assert all(open(png.format(f), "rb").read(4) == b"\x89PNG" for f in "ps")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    assert fit.main(["power", POWER_EXAMPLE, "--ref", "vanilla", "--json", "--plot", png.format("m")]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["fits"] and not os.path.exists(png.format("m"))
    assert captured.err == f"{png.format('m')}: matplotlib is not installed, so no figure was written " \
                           "(pip install -r requirements-plot.txt)\n"
