"""Synthetic runs with known coefficients: the ground truth of fit.py's, plots.py's and ladder.py's tests."""
import math

import numpy as np

from fit import PowerLawFit, SurfaceFit

# E, a, c, K as published in [S]; A and b chosen for this demo.
SYNTHETIC_SURFACES = {"baseline": dict(E=1.4439, A=2500.0, a=0.3703, b=0.5, K=1.975e6, c=0.6594),
                      "smelt": dict(E=1.4493, A=4200.0, a=0.3892, b=0.55, K=5.264e6, c=0.7011)}


def synthetic_surface_runs(surfaces=None, noise=0.003, seed=0, scales=(2.5e8, 5e8, 1e9, 2e9),
                           sparsities=(0.75, 0.85, 0.95), n_checkpoints=6):
    """[S]-shaped columns: per arch, scales x sparsities cells of n_checkpoints, loss x exp(noise N)."""
    rng, surfaces = np.random.default_rng(seed), surfaces or SYNTHETIC_SURFACES
    rows = [(arch, f"s{i}-S{S:g}", F, S, D) for arch in surfaces for i, F in enumerate(scales)
            for j, S in enumerate(sparsities)
            for D in np.geomspace(1.3e19, 2.2e21 * F / scales[-1], n_checkpoints) / F * (1 + 0.1 * j)]
    loss = [float(SurfaceFit(**surfaces[r[0]]).loss(*r[2:])) * math.exp(noise * rng.normal()) for r in rows]
    return {k: np.array(v, dtype=object if k in ("arch", "cell") else float)
            for k, v in zip(("arch", "cell", "F", "S", "D", "loss"), [*zip(*rows), loss])}


# [X]-shaped ladders (power_example.csv), E shared [X7]: loop-2 improves A, untied-grow gamma [X6].
SYNTHETIC_POWER_E = 2.0
SYNTHETIC_POWER_LAWS = {"vanilla": dict(A=1.5, gamma=0.30), "loop-2": dict(A=1.4, gamma=0.30),
                        "untied-grow": dict(A=1.45, gamma=0.32)}


def synthetic_power_runs(budgets=(1e18, 3e18, 1e19, 3e19, 1e20), noise=0.001, seed=0):
    rng, E = np.random.default_rng(seed), SYNTHETIC_POWER_E
    rows = [(arch, float(C), float(PowerLawFit(E=E, **law).loss(C)) * math.exp(noise * rng.normal()))
            for arch, law in SYNTHETIC_POWER_LAWS.items() for C in budgets]
    return {k: np.array(v, dtype=object if k == "arch" else float)
            for k, v in zip(("arch", "C", "loss"), zip(*rows))}
