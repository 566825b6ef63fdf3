"""The guide's figures (``docs/images/*.png``), drawn from recorded runs and the library's own maths.

From the repository root::

    python benchmarks/figures.py                      # writes docs/images/{privacy_over_steps,accuracy_vs_epsilon,noise_correlation}.png
    python benchmarks/figures.py --out /tmp/figures   # somewhere else

About 15–30 s on 2 CPU cores (almost all of it the accountant's PLD compositions); it prints the
numbers behind each picture. Every number in the pictures is read from the main job's recorded
runs, ``benchmarks/results/round3_mnist1d-long_torch_sgd_eps{1,3,8}_main_pld.json`` (written by
``benchmarks/utility/round3.py ... --accountant pld --tag _main_pld``; tables in
``benchmarks/results/utility_round3.md``, *The main job at PLD-calibrated σ*), or computed here
with ``adaclip``:

- ``privacy_over_steps.png``: ε spent against the training step for the main job at ε = 3
  (N = 50,000, q = 0.00512, 1,950 steps, δ = 1e-5): DP-SGD (independent noise, b = 1) and banded
  noise (the run's b = 32) at their recorded σ, composed with an ``adaclip.accounting.Accountant``
  of the run's mechanism (PLD) exactly as the optimizer records them (one composition per step
  at rate q; banded: one per cycle of b steps at rate b·q, at its first step). The last point is
  checked against the ε the run recorded.
- ``accuracy_vs_epsilon.png``: test accuracy, mean ± standard error over the seeds, of the main
  job's four methods at ε = 1, 3, 8 (the recorded per-seed test accuracies).
- ``noise_correlation.png``: what banded noise is: the correlation between the noise of two steps
  (``x = C⁻¹z`` for the library's square-root coefficients, b = 8, 48 steps), and, over the main
  job's 1,950 steps, the standard deviation of each step's noise and of its running sum for
  b = 1, 8 and 32 at the σ_b that the main job's plan calibrated for ε = 3.

The PNGs are byte-stable across reruns with the same matplotlib (no timestamp or version in their
metadata). The docs build (``docs/hooks/build.py``) fails when a file named in :data:`FIGURES` is
missing from ``docs/images/``.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from a checkout without ``pip install -e .``
    sys.path.insert(0, str(ROOT))

#: The figures this script writes, by file name (the docs build checks that each is in docs/images/).
FIGURES = ["privacy_over_steps.png", "accuracy_vs_epsilon.png", "noise_correlation.png"]

RESULTS = ROOT / "benchmarks" / "results"
IMAGES = ROOT / "docs" / "images"
#: The main job's recordings at PLD-calibrated σ, one file per ε.
MAIN_JOB = "round3_mnist1d-long_torch_sgd_eps{epsilon:g}_main_pld.json"
MAIN_EPSILONS = (1.0, 3.0, 8.0)
#: The main job's methods in the order of the README's table, with their labels.
METHODS = {
    "flat": "DP-SGD (independent noise)",
    "flat+ema": "DP-SGD + EMA averaging",
    "banded+ema": "banded noise + EMA",
    "adaclip+banded+ema": "AdaClip() + banded noise + EMA",
}
COLORS = {"flat": "#1f77b4", "flat+ema": "#7fb3e0", "banded+ema": "#d62728", "adaclip+banded+ema": "#2ca02c"}
DPI = 100
#: No software version or timestamp in the PNG: reruns give the same bytes.
PNG_METADATA = {"Software": None}


# --------------------------------------------------------------------------- helpers


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _style() -> dict[str, Any]:
    return {
        "font.size": 10,
        "axes.titlesize": 11,
        "axes.grid": True,
        "grid.alpha": 0.3,
        "svg.hashsalt": "adaclip-figures",  # only for SVG output; PNGs are deterministic anyway
    }


def _save(fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI, metadata=PNG_METADATA)
    _pyplot().close(fig)
    return path


def _number(x: float) -> str:
    """``1e-5`` rather than ``1e-05``."""
    return re.sub(r"e([+-])0*(\d)", r"e\1\2", f"{x:g}").replace("e+", "e")


def load_main_job(epsilon: float, results: Path = RESULTS) -> dict[str, Any]:
    """The recorded main job at ``epsilon`` (one cell), with its top-level fields under ``"run"``."""
    path = Path(results) / MAIN_JOB.format(epsilon=epsilon)
    with path.open(encoding="utf-8") as f:
        run = json.load(f)
    cells = run["cells"]
    cell = cells.get(str(float(epsilon)))
    if cell is None:
        raise ValueError(f"{path} has no cell at epsilon = {epsilon:g} (cells: {sorted(cells)})")
    return {"run": run, "cell": cell, "path": path}


def _plan_with_bands(cell: dict[str, Any], bands: int) -> dict[str, Any]:
    for plan in cell["plans"].values():
        if plan["bands"] == bands:
            return plan
    raise ValueError(f"the recorded cell has no noise plan with b = {bands}")


def accuracy_summary(cell: dict[str, Any], method: str) -> tuple[float, float, int]:
    """(mean, standard error, seeds) of a method's recorded test accuracy, in percent."""
    values = np.array([r["metric"] for r in cell["final"][method]["runs"]], dtype=np.float64) * 100
    n = values.size
    se = float(values.std(ddof=1) / math.sqrt(n)) if n > 1 else 0.0
    return float(values.mean()), se, n


# --------------------------------------------------------------------------- 1. ε over the steps


def epsilon_over_steps(
    *,
    sigma: float,
    sample_rate: float,
    bands: int,
    steps: int,
    checkpoints: list[int],
    mechanism: str,
    delta: float,
) -> list[float]:
    """ε(δ) spent after each number of steps in ``checkpoints`` (increasing), recorded as the
    optimizer records it: ``⌈t/b⌉`` compositions of the sampled Gaussian at rate ``b·q``."""
    from adaclip.accounting import Accountant
    from adaclip.correlated import accounted_sample_rate, accounted_steps

    accountant = Accountant(mechanism)
    rate = accounted_sample_rate(sample_rate, bands)
    recorded, out = 0, []
    for t in checkpoints:
        if not 0 <= t <= steps:
            raise ValueError(f"checkpoint {t} outside 0..{steps}")
        due = accounted_steps(t, bands)
        if due > recorded:
            accountant.step(noise_multiplier=sigma, sample_rate=rate, num_steps=due - recorded)
            recorded = due
        out.append(accountant.epsilon(delta))
    return out


def plot_privacy_over_steps(
    out_dir: Path = IMAGES,
    *,
    results: Path = RESULTS,
    checkpoints: int = 20,
    log: Callable[[str], Any] | None = None,
) -> Path:
    """``privacy_over_steps.png``: ε spent against the step, DP-SGD and banded noise, main job at ε = 3."""
    job = load_main_job(3.0, results)
    run, cell = job["run"], job["cell"]
    delta, mechanism = float(run["delta"]), run["accountant"]
    banded_bands = int(cell["final"]["banded+ema"]["bands"])
    curves = []
    for method, bands in (("flat", 1), ("banded+ema", banded_bands)):
        plan = _plan_with_bands(cell, bands)
        q, total, sigma = float(plan["q"]), int(plan["steps"]), float(plan["sigma"])
        # Denser early, where ε grows fastest: the i-th of n points after K·(i/n)² compositions
        # (K = ⌈T/b⌉). A banded run records a composition at the first step of each cycle of b
        # steps and none inside it, so its points sit at those first steps (t = b·(k−1) + 1),
        # the corners of its staircase: the line through them is never below the ε spent.
        compositions = -(-total // bands)
        ks = sorted({max(1, round(compositions * (i / checkpoints) ** 2)) for i in range(1, checkpoints + 1)})
        marks = sorted({bands * (k - 1) + 1 for k in ks} | {total})
        eps = epsilon_over_steps(sigma=sigma, sample_rate=q, bands=bands, steps=total, checkpoints=marks,
                                 mechanism=mechanism, delta=delta)  # fmt: skip
        recorded = float(cell["final"][method]["epsilon_spent"])
        if not math.isclose(eps[-1], recorded, rel_tol=1e-3):
            raise RuntimeError(
                f"{job['path'].name}: the accountant gives ε = {eps[-1]:.4f} after {total} steps of {method}, "
                f"the run recorded {recorded:.4f}; the figure would not show the recorded run"
            )
        curves.append((bands, q, total, sigma, [0, *marks], [0.0, *eps]))
        if log:
            log(f"  b = {bands}, σ = {sigma:.4f}: ε = {eps[-1]:.4f} after {total} steps (recorded {recorded:.4f}); "
                + ", ".join(f"{e:.3f} at {t}" for t, e in zip(marks, eps)))  # fmt: skip
    target = float(cell["epsilon"])
    per_epoch = int(_plan_with_bands(cell, 1)["per_epoch"])
    n_units = round(float(run["expected_batch_size"]) / curves[0][1])

    plt = _pyplot()
    with plt.rc_context(_style()):
        fig, ax = plt.subplots(figsize=(7.2, 4.2))
        for (bands, q, total, sigma, xs, ys), color in zip(curves, ("#1f77b4", "#d62728")):
            if bands == 1:
                label = f"DP-SGD: independent noise, σ = {sigma:.3f}\n{total:,} compositions at q = {q:.5g}"
            else:
                label = (f"banded noise, b = {bands}, σ = {sigma:.3f}\n"
                         f"{math.ceil(total / bands):,} compositions at b·q = {bands * q:.4g}")  # fmt: skip
            ax.plot(xs, ys, marker="o", ms=3.5, color=color, label=label)
        ax.axhline(target, color="grey", ls="--", lw=1)
        ax.text(0.01, target, f" target ε = {target:g}", transform=ax.get_yaxis_transform(), va="bottom",
                color="grey", fontsize=9)  # fmt: skip
        ax.set_xlim(0, curves[0][2])
        ax.set_ylim(0, target * 1.12)
        ax.set_xlabel(f"training step ({per_epoch} steps = one epoch)")
        ax.set_ylabel(f"ε spent (δ = {_number(delta)})")
        ax.set_title(f"Privacy spent during the main job (N = {n_units:,}, {mechanism.upper()} accountant)")
        ax.legend(loc="lower right", fontsize=9)
        fig.tight_layout()
        return _save(fig, Path(out_dir) / "privacy_over_steps.png")


# --------------------------------------------------------------------------- 2. accuracy against ε


def plot_accuracy_vs_epsilon(
    out_dir: Path = IMAGES, *, results: Path = RESULTS, log: Callable[[str], Any] | None = None
) -> Path:
    """``accuracy_vs_epsilon.png``: the main job's methods at ε = 1, 3, 8 (mean ± SE over seeds)."""
    jobs = [load_main_job(e, results) for e in MAIN_EPSILONS]
    first = jobs[0]["run"]
    seeds = {len(j["run"]["seeds"]) for j in jobs}
    steps = {int(j["cell"]["final"]["flat"]["steps"]) for j in jobs}
    hp = {json.dumps(j["cell"]["final"][m]["hp"], sort_keys=True) for j in jobs for m in METHODS}
    if len(seeds) != 1 or len(steps) != 1 or len(hp) != 1:
        raise ValueError("the main job's recordings differ in seeds, steps or hyperparameters across ε")
    (n_seeds,), (n_steps,) = seeds, steps
    lr_clip = jobs[0]["cell"]["final"]["flat"]["hp"]

    plt = _pyplot()
    with plt.rc_context(_style()):
        fig, ax = plt.subplots(figsize=(7.2, 4.6))
        offsets = np.linspace(-0.045, 0.045, len(METHODS))
        for (method, label), off in zip(METHODS.items(), offsets):
            stats = [accuracy_summary(j["cell"], method) for j in jobs]
            if log:
                log(
                    f"  {method}: "
                    + ", ".join(
                        f"ε = {e:g} {m:.1f} ± {se:.1f} %" for e, (m, se, _) in zip(MAIN_EPSILONS, stats)
                    )
                )
            xs = [e * math.exp(off) for e in MAIN_EPSILONS]
            ax.errorbar(xs, [s[0] for s in stats], yerr=[s[1] for s in stats], marker="o", ms=5, capsize=3,
                        color=COLORS[method], label=label)  # fmt: skip
            if "banded" in method:
                for x, s, j in zip(xs, stats, jobs):
                    ax.annotate(f"b={j['cell']['final'][method]['bands']}", (x, s[0]), textcoords="offset points",
                                xytext=(6, -3), fontsize=7.5, color=COLORS[method])  # fmt: skip
        ax.set_xscale("log")
        ax.set_xticks(MAIN_EPSILONS, [f"{e:g}" for e in MAIN_EPSILONS])
        ax.minorticks_off()
        ax.set_xlim(MAIN_EPSILONS[0] / 1.3, MAIN_EPSILONS[-1] * 1.5)
        ax.set_xlabel(
            f"ε (δ = {_number(float(first['delta']))}, σ calibrated with {first['accountant'].upper()})"
        )
        ax.set_ylabel("test accuracy (%)")
        ax.set_title(
            f"MLP on MNIST-1D, {n_steps:,} steps of SGD-momentum (lr {lr_clip['lr']:g}, C = {lr_clip['max_grad_norm']:g})\n"
            f"test accuracy, mean ± standard error over {n_seeds} seeds",
            fontsize=10,
        )
        ax.legend(loc="upper left", fontsize=8.5)
        fig.tight_layout()
        return _save(fig, Path(out_dir) / "accuracy_vs_epsilon.png")


# --------------------------------------------------------------------------- 3. banded noise


def noise_correlation_matrix(bands: int, steps: int) -> np.ndarray:
    """corr(x_t, x_t′) for ``x = C⁻¹z`` with the library's square-root coefficients (``b`` bands)."""
    from adaclip.correlated import BandedNoise
    from adaclip.correlated.coefficients import sqrt_toeplitz_coefficients

    r = BandedNoise(sqrt_toeplitz_coefficients(bands)).inverse_coefficients(steps)
    lag = np.subtract.outer(np.arange(steps), np.arange(steps))
    c_inv = np.where(lag >= 0, r[np.clip(lag, 0, None)], 0.0)  # lower-triangular Toeplitz C⁻¹
    cov = c_inv @ c_inv.T
    sd = np.sqrt(np.diag(cov))
    return cov / np.outer(sd, sd)


def noise_std_per_step_and_sum(bands: int, steps: int, sigma: float) -> tuple[np.ndarray, np.ndarray]:
    """Per-coordinate standard deviation of ``σ·x_t`` and of the running sum ``σ·Σ_{s≤t} x_s``."""
    from adaclip.correlated.coefficients import (
        inverse_toeplitz_coefficients,
        noise_variances,
        sqrt_toeplitz_coefficients,
    )

    c = sqrt_toeplitz_coefficients(bands)
    per_step = sigma * np.sqrt(noise_variances(c, steps))
    prefix = np.cumsum(inverse_toeplitz_coefficients(c, steps))  # Σ_s x_s = Σ_k (Σ_{j≤t−k} r_j) z_k
    running = sigma * np.sqrt(np.cumsum(prefix * prefix))
    return per_step, running


def plot_noise_correlation(
    out_dir: Path = IMAGES,
    *,
    results: Path = RESULTS,
    bands: int = 8,
    steps: int = 48,
    compare: tuple[int, ...] = (1, 8, 32),
    log: Callable[[str], Any] | None = None,
) -> Path:
    """``noise_correlation.png``: correlation of banded noise across steps, and its size per step
    and summed, against independent noise at the same ε (σ_b from the main job's plan at ε = 3)."""
    job = load_main_job(3.0, results)
    cell = job["cell"]
    plan = _plan_with_bands(cell, int(cell["final"]["banded+ema"]["bands"]))
    choice = plan["choice"]
    total = int(plan["steps"])
    missing = [b for b in compare if str(b) not in choice]
    if missing:
        raise ValueError(f"{job['path'].name}: the recorded plan has no σ_b for b = {missing}")
    corr = noise_correlation_matrix(bands, steps)
    if log:
        mid = steps // 2
        log(f"  b = {bands}: correlation with the noise k steps earlier, k = 1..{bands + 1}: "
            + ", ".join(f"{corr[mid, mid - k]:+.3f}" for k in range(1, bands + 2)))  # fmt: skip

    plt = _pyplot()
    with plt.rc_context(_style()):
        fig = plt.figure(figsize=(10.5, 6.0))
        grid = fig.add_gridspec(2, 2, width_ratios=[1.0, 1.05])
        ax = fig.add_subplot(grid[:, 0])
        # the scale stops at ±0.4 so that the small correlations off the diagonal show (the diagonal is 1)
        image = ax.imshow(corr, cmap="RdBu_r", vmin=-0.4, vmax=0.4, interpolation="nearest")
        ax.grid(False)
        ax.set_xlabel("step t′")
        ax.set_ylabel("step t")
        ax.set_title(f"(a) correlation of the noise of steps t and t′\nbanded, b = {bands} (independent noise: the diagonal only)",
                     fontsize=10)  # fmt: skip
        fig.colorbar(image, ax=ax, fraction=0.046, pad=0.11, orientation="horizontal", extend="both",
                     label="correlation (1 on the diagonal, off the scale)")  # fmt: skip

        per_step_ax, running_ax = fig.add_subplot(grid[0, 1]), fig.add_subplot(grid[1, 1])
        t = np.arange(1, total + 1)
        colors = {1: "#1f77b4", 8: "#ff7f0e", 32: "#d62728"}
        for b in compare:
            sigma = float(choice[str(b)]["sigma"])
            per_step, running = noise_std_per_step_and_sum(b, total, sigma)
            name = "independent (b = 1)" if b == 1 else f"banded, b = {b}"
            color = colors.get(b)
            if log:
                log(f"  b = {b}, σ_b = {sigma:.4f}: std of a step's noise {per_step[-1]:.3f}, "
                    f"of the running sum after {total} steps {running[-1]:.2f}")  # fmt: skip
            per_step_ax.plot(t, per_step, color=color, label=f"{name}, σ = {sigma:.3f}")
            running_ax.plot(t, running, color=color, label=f"{name}, σ = {sigma:.3f}")
        per_step_ax.set_title("(b) noise added at each step", fontsize=10)
        running_ax.set_title("(c) noise of the running sum of the steps", fontsize=10)
        for a in (per_step_ax, running_ax):
            a.set_xlim(0, total)
            a.set_ylim(bottom=0)
            a.set_ylabel("std. dev. (× clip norm)")
        per_step_ax.tick_params(labelbottom=False)
        running_ax.set_xlabel(f"training step (the main job's {total:,})")
        running_ax.legend(fontsize=8, loc="upper left")
        fig.suptitle(
            f"Banded noise is larger at each step but anti-correlated, so its sums carry less noise\n"
            f"(σ calibrated for each b to the same ε = {float(cell['epsilon']):g} over the main job's steps)",
            fontsize=10.5,
        )
        fig.tight_layout()
        return _save(fig, Path(out_dir) / "noise_correlation.png")


# --------------------------------------------------------------------------- command line


def generators(
    checkpoints: int = 20, log: Callable[[str], Any] | None = None
) -> dict[str, Callable[..., Path]]:
    """One function per name of :data:`FIGURES`, each taking ``(out_dir, results=...)``;
    ``log`` receives the numbers behind the pictures, one line at a time."""
    table: dict[str, Callable[..., Path]] = {
        "privacy_over_steps.png": lambda out, results=RESULTS: plot_privacy_over_steps(
            out, results=results, checkpoints=checkpoints, log=log
        ),
        "accuracy_vs_epsilon.png": lambda out, results=RESULTS: plot_accuracy_vs_epsilon(
            out, results=results, log=log
        ),
        "noise_correlation.png": lambda out, results=RESULTS: plot_noise_correlation(
            out, results=results, log=log
        ),
    }
    assert list(table) == FIGURES, (list(table), FIGURES)
    return table


def generate(out_dir: Path = IMAGES, *, results: Path = RESULTS, checkpoints: int = 20) -> list[Path]:
    """Write every figure of :data:`FIGURES` into ``out_dir``; returns their paths."""
    return [make(Path(out_dir), results=Path(results)) for make in generators(checkpoints).values()]


def main(argv: list[str] | None = None) -> list[Path]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=IMAGES, help="folder for the PNGs (default: docs/images)")
    p.add_argument(
        "--results",
        type=Path,
        default=RESULTS,
        help="folder of the recorded runs (default: benchmarks/results)",
    )
    p.add_argument(
        "--checkpoints", type=int, default=20, help="points of the ε-over-steps curves (default: 20)"
    )
    args = p.parse_args(argv)
    if args.checkpoints < 1:
        p.error("--checkpoints must be >= 1")
    written = []
    for name, make in generators(args.checkpoints, log=print).items():
        t0 = time.perf_counter()
        print(name)
        path = make(args.out, results=args.results)
        print(f"{path} ({path.stat().st_size / 1024:.0f} KiB, {time.perf_counter() - t0:.1f} s)")
        written.append(path)
    return written


if __name__ == "__main__":
    main()
