"""How long σ's calibration takes, and what σ it gives: RDP, the PLD search the library used
before (dp-accounting's Brent search on the 1e-4 grid, one point at a time), and today's
default PLD calibration (vectorised PLD, secant search, calibration grid 1e-3).

    python benchmarks/calibration_speed.py            # the Markdown tables of benchmarks/results/calibration_speed.md
    python benchmarks/calibration_speed.py --no-old   # without the slow old search (~70 s)

The run is the main job's (N = 50,000, B = 256, q = 0.00512, 1,950 steps, ε = 3, δ = 1e-5):
one σ for DP-SGD (b = 1), and the banded-noise plan (``plan_banded_noise``: σ_b for the seven
candidate b ∈ {1, …, 64}, the expected-error rule, as ``make_private`` does). Each row is a
fresh process's first calibration (the process cache is cleared before each), wall-clock.
Also: the ε each σ spends as the accountant reports it (PLD, grid 1e-4).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import math
import platform
import time

import dp_accounting
from dp_accounting.pld.pld_privacy_accountant import PLDAccountant

from adaclip import accounting
from adaclip.accounting._events import _RELATION, _run_event
from adaclip.correlated import plan_banded_noise
from adaclip.correlated.planning import BAND_CANDIDATES

N, B, T, EPS, DELTA = 50_000, 256, 1950, 3.0, 1e-5
Q = B / N


def _fine_epsilon(q: float, sigma: float, steps: int) -> float:
    acc = PLDAccountant(neighboring_relation=_RELATION, value_discretization_interval=1e-4)
    return acc.compose(_run_event(q, sigma, steps)).get_epsilon(DELTA)


def _old_pld(q: float, steps: int) -> float:
    """The library's PLD calibration before: bracket from 1, dp-accounting's Brent search, every
    ε(σ) from a fresh PLDAccountant on the 1e-4 grid (tol 1e-4 relative)."""

    def fresh() -> PLDAccountant:
        return PLDAccountant(neighboring_relation=_RELATION, value_discretization_interval=1e-4)

    def event(sigma: float) -> dp_accounting.DpEvent:
        return _run_event(q, float(sigma), steps)

    def eps(sigma: float) -> float:
        return float(fresh().compose(event(sigma)).get_epsilon(DELTA))

    return accounting._calibrate(eps, fresh, event, target_epsilon=EPS, delta=DELTA, q=q, steps=steps, tol=1e-4)


def _timed(fn):
    accounting._calibration._cache.clear()
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-old", action="store_true", help="skip the old PLD search (about 70 s)")
    args = parser.parse_args()
    versions = ", ".join(f"{p} {importlib.metadata.version(p)}" for p in ("dp-accounting", "numpy", "scipy"))
    print(f"Python {platform.python_version()}, {versions}, {platform.machine()}; one run each\n")

    print("| calibration | what | time | σ (b = 1) | ε at that σ (PLD, grid 1e-4) |")
    print("|---|---|---|---|---|")
    rows = [
        ("RDP (`accountant=\"rdp\"`)", lambda: accounting.calibrate_noise_multiplier(
            target_epsilon=EPS, delta=DELTA, sample_rate=Q, steps=T, accountant="rdp")),
        ("PLD, today's default", lambda: accounting.calibrate_noise_multiplier(
            target_epsilon=EPS, delta=DELTA, sample_rate=Q, steps=T)),
    ]  # fmt: skip
    if not args.no_old:
        rows.insert(1, ("PLD, before (Brent, grid 1e-4)", lambda: _old_pld(Q, T)))
    for name, fn in rows:
        seconds, sigma = _timed(fn)
        print(f"| {name} | one σ, DP-SGD | {seconds:.2f} s | {sigma:.5f} | {_fine_epsilon(Q, sigma, T):.5f} |")

    print("\n| calibration | banded plan (7 candidate b) | time | b chosen | σ_b | ε at σ_b (PLD, grid 1e-4) |")
    print("|---|---|---|---|---|---|")
    plans = [("RDP", "rdp"), ("PLD, today's default", "pld")]
    for name, mech in plans:
        seconds, plan = _timed(lambda mech=mech: plan_banded_noise(
            target_epsilon=EPS, delta=DELTA, sample_rate=Q, steps=T, workload="momentum", accountant=mech))  # fmt: skip
        eps = _fine_epsilon(plan.accounted_sample_rate, plan.noise_multiplier, plan.compositions)
        print(f"| {name} | all seven | {seconds:.2f} s | {plan.bands} | {plan.noise_multiplier:.5f} | {eps:.5f} |")
    if not args.no_old:
        t0 = time.perf_counter()
        old = {b: _old_pld(b * Q, math.ceil(T / b)) for b in BAND_CANDIDATES}
        seconds = time.perf_counter() - t0
        print(f"| PLD, before (Brent, grid 1e-4) | all seven | {seconds:.2f} s | — | b = 32: {old[32]:.5f} | "
              f"{_fine_epsilon(32 * Q, old[32], math.ceil(T / 32)):.5f} |")  # fmt: skip


if __name__ == "__main__":
    main()
