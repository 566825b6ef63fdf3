"""What the accountant costs, and the reference values it reproduces.

    python benchmarks/accounting_cost.py          # prints the Markdown tables of benchmarks/results/accounting.md

Measures, for ``adaclip.accounting.Accountant`` with RDP and PLD:

* ε of the two reference runs in the accounting docs (δ = 1e-5);
* the first ε query of a new ``(q, σ)`` (for RDP this computes the Rényi divergences of the
  sampled Gaussian once; for PLD it builds and self-composes the privacy loss distribution),
  and a query after more steps with the same ``(q, σ)`` (RDP reuses the divergences);
* recording a training run of 14,062 steps one ``step()`` call at a time under a budget (the
  budget check searches once per new ``(q, σ)`` and is O(1) per step after that).

Median of ``--repeats`` fresh accountants (wall-clock, ``time.perf_counter``).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import platform
import statistics
import time

from adaclip.accounting import Accountant

DELTA = 1e-5
REFERENCES = [  # (σ, q, steps, mechanisms): the docs' reference runs
    (1.1, 256 / 60000, 14062, ("rdp", "pld")),
    (1.5, 0.04, 2250, ("rdp",)),
]


def _timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def query_costs(mechanism: str, sigma: float, q: float, steps: int, repeats: int) -> tuple[float, float, float]:
    """(ε, first query seconds, second query seconds after ``steps`` more steps)."""
    first, second, eps = [], [], 0.0
    for _ in range(repeats):
        acc = Accountant(mechanism)
        acc.step(noise_multiplier=sigma, sample_rate=q, num_steps=steps)
        t1, eps = _timed(lambda acc=acc: acc.epsilon(DELTA))
        acc.step(noise_multiplier=sigma, sample_rate=q, num_steps=steps)
        t2, _ = _timed(lambda acc=acc: acc.epsilon(DELTA))
        first.append(t1)
        second.append(t2)
    return float(eps), statistics.median(first), statistics.median(second)


def budgeted_run(mechanism: str, sigma: float, q: float, steps: int, target: float, repeats: int) -> float:
    """Seconds to record ``steps`` single steps under a budget of ``target``."""
    times = []
    for _ in range(repeats):
        acc = Accountant(mechanism, target_epsilon=target, delta=DELTA)

        def run(acc=acc):
            for _ in range(steps):
                acc.step(noise_multiplier=sigma, sample_rate=q)

        times.append(_timed(run)[0])
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    print(f"Python {platform.python_version()}, dp-accounting {importlib.metadata.version('dp-accounting')}, "
          f"{platform.machine()}; median of {args.repeats}\n")
    print("| mechanism | σ | q | steps | ε (δ = 1e-5) | first ε query | query after as many more steps |")
    print("|---|---|---|---|---|---|---|")
    for sigma, q, steps, mechanisms in REFERENCES:
        for mech in mechanisms:
            eps, t1, t2 = query_costs(mech, sigma, q, steps, args.repeats)
            print(f"| {mech} | {sigma} | {q:.6g} | {steps} | {eps:.4f} | {t1 * 1e3:.1f} ms | {t2 * 1e3:.2f} ms |")
    print("\n| mechanism | budget ε | steps recorded one call each | total | per step |")
    print("|---|---|---|---|---|")
    sigma, q, steps, _ = REFERENCES[0]
    for mech in ("rdp", "pld"):
        total = budgeted_run(mech, sigma, q, steps, 3.0, args.repeats)
        print(f"| {mech} | 3.0 | {steps} (σ = {sigma}, q = {q:.6g}) | {total:.3f} s | {total / steps * 1e6:.1f} µs |")


if __name__ == "__main__":
    main()
