"""When do AdaCliP's std estimates follow the gradients, and when do they drift on the noise?

    python benchmarks/adaclip_drift.py            # prints the Markdown tables of benchmarks/results/utility_round1.md

Steps 7–8 of AdaCliP (docs: *The algorithm and its privacy*) estimate the per-coordinate variance from the released gradient:
``v = clamp((g̃ − m)² − b²σ²/B̄², std_min², std_max²)``, ``s² ← β2·s² + (1 − β2)·v``. The
subtraction removes the noise variance *on average*, but the clamp cuts the negative values,
and when the noise dominates the deviation ``g̃ − m ≈ bσz/B̄`` it leaves

    E[v] ≈ E[(z² − 1)⁺]·b²σ²/B̄² = 2φ(1)·b²σ²/B̄² ≈ 0.484·b²σ²/B̄²      (z ~ N(0, 1)).

With equal estimates ``b² = s²·d``, so one step multiplies ``E[s²]`` by ``1 + (1 − β2)(κ − 1)``
with the *drift number* (``adaclip.strategies.noise_drift_number``)

    κ = 2φ(1) · d · σ² / B̄².

κ > 1: the estimates grow geometrically on the noise alone (and b, hence the noise, with them)
until std_max stops them; κ < 1: they shrink towards std_min. Only the gradient signal that
stands above the noise moves s away from this drift. This script checks the law on the NumPy
reference (``adaclip.reference.adaclip_step``) with no units in the batch (pure noise) and
with per-unit gradients of known, unequal per-coordinate variance, and tabulates κ for the
utility benchmark's settings.
"""

from __future__ import annotations

import argparse
import math

import numpy as np

from adaclip import reference
from adaclip.strategies import noise_drift_number as drift_number


def simulate(d: int, sigma: float, bbar: float, steps: int, beta_std: float, seed: int,
             n_units: int = 0, spread: float = 1e4) -> tuple[float, float]:
    """Mean log-growth per step of mean(s), measured and predicted (pure noise: n_units = 0)."""
    rng = np.random.default_rng(seed)
    s0 = 1e-3
    lo, hi = s0 / spread, s0 * spread
    mean, std = np.zeros(d), np.full(d, s0)
    log_s = [math.log(std.mean())]
    for _ in range(steps):
        g = np.zeros((n_units, d))
        _, mean, std = reference.adaclip_step(
            g, mean, std, rng.standard_normal(d), noise_multiplier=sigma, expected_batch_size=bbar,
            beta_mean=0.99, beta_std=beta_std, std_min=lo, std_max=hi, allow_empty=True)
        log_s.append(math.log(std.mean()))
    measured = (log_s[-1] - log_s[0]) / steps
    kappa = drift_number(d, sigma, bbar)
    predicted = 0.5 * math.log(1.0 + (1.0 - beta_std) * (kappa - 1.0))
    return measured, predicted


def tracks_signal(d: int, sigma: float, bbar: int, steps: int, seed: int) -> tuple[float, float]:
    """Per-unit gradients ``N(0, diag(τ²))`` with τ spread over two decades (so the averaged
    gradient's per-coordinate std is ``τ/sqrt(B̄)``: what s should follow). Returns the
    correlation of ``log s`` with ``log τ`` after ``steps`` steps, and mean(s) end / start."""
    rng = np.random.default_rng(seed)
    tau = np.exp(rng.uniform(math.log(1e-3), math.log(1e-1), size=d))
    s0 = float(np.mean(tau))
    lo, hi = s0 / 1e3, s0 * 1e3
    mean, std = np.zeros(d), np.full(d, s0)
    for _ in range(steps):
        g = rng.standard_normal((bbar, d)) * tau
        _, mean, std = reference.adaclip_step(
            g, mean, std, rng.standard_normal(d), noise_multiplier=sigma, expected_batch_size=bbar,
            beta_mean=0.99, beta_std=0.99, std_min=lo, std_max=hi)
    corr = float(np.corrcoef(np.log(std), np.log(tau))[0, 1])
    return corr, float(std.mean() / s0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--results", nargs="*", default=None,
                   help="utility-benchmark JSONs whose settings to tabulate κ for "
                        "(default: benchmarks/results/utility_*_torch.json)")
    args = p.parse_args()

    print("Pure noise (no units in the batch), d = 1000, β2 = 0.99, "
          f"{args.steps} steps, seed {args.seed}: mean log-growth of mean(s) per step\n")
    print("| σ | B̄ | κ | measured | predicted 0.5·ln(1 + (1−β2)(κ−1)) |")
    print("|---|---|---|---|---|")
    for sigma, bbar in [(0.5, 64), (1.0, 64), (1.0, 32), (2.0, 64), (2.0, 32), (4.0, 64), (1.0, 16)]:
        m, pr = simulate(1000, sigma, bbar, args.steps, 0.99, args.seed)
        print(f"| {sigma:g} | {bbar} | {drift_number(1000, sigma, bbar):.3f} | {m:+.5f} | {pr:+.5f} |")

    print("\nWith signal: per-unit gradients N(0, diag(τ²)), τ log-uniform on [1e-3, 1e-1], "
          f"B̄ = n = 64, d = 400, β2 = 0.99, 200 steps, seed {args.seed}: corr(log s, log τ) at the "
          "end, and mean(s) at the end / at the start\n")
    print("| σ | κ | corr(log s, log τ) | mean(s) end / start |")
    print("|---|---|---|---|")
    for sigma in [0.0, 0.3, 1.0, 3.0, 6.0]:
        corr, ratio = tracks_signal(400, sigma, 64, 200, args.seed)
        print(f"| {sigma:g} | {drift_number(400, sigma, 64):.3f} | {corr:.3f} | {ratio:.3g} |")

    print("\nκ of the utility benchmark's runs (d = trainable parameters of the task's model, "
          "B̄ and σ as run; κ > 1: the estimates grow on the noise alone)\n")
    print("| task | d | B̄ | ε: σ → κ |")
    print("|---|---|---|---|")
    for task, d, bbar, sigmas in benchmark_settings(args.results):
        cells = ", ".join(f"{eps:g}: {s:.3f} → {drift_number(d, s, bbar):.2f}" for eps, s in sigmas)
        print(f"| {task} | {d:,} | {bbar:g} | {cells} |")


def benchmark_settings(paths: list[str] | None):
    """``(task, d, B̄, [(ε, σ), ...])`` of the recorded utility runs (full runs, PyTorch)."""
    import json
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent
    sys.path.insert(0, str(here / "utility"))
    from utility_tasks import load_task, n_params

    if paths is None:
        paths = sorted(str(p) for p in (here / "results").glob("utility_*_torch.json"))
    for path in paths:
        out = json.loads(Path(path).read_text())
        task = load_task(out["task"])
        sigmas = sorted({(float(k.split("@")[1]), f["sigma"]) for k, f in out["final"].items() if "@" in k})
        yield out["task"], n_params(task.make_model(0)), out["expected_batch_size"], sigmas


if __name__ == "__main__":
    main()
