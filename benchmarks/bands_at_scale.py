"""Which b the library's rule gives large models, on 1, 2 and 8 ranks, before and after sharding.

``make_private(..., target_epsilon=, epochs=)`` chooses the number of bands b of banded noise
among 1, 2, 4, …, 64 by the expected error of the optimizer's workload, keeping the buffers,
``(b − 1)·d`` float32 numbers, within 1 GiB (:data:`adaclip.correlated.planning.BANDED_BUFFER_BUDGET_BYTES`).
Before the buffers were sharded, rank 0 held all of them whatever the number of ranks R; now each
rank holds ``(b − 1)·d/R`` (``noise_sharding``, the default with ``distributed=True``). This
script runs the rule itself (:func:`adaclip.correlated.planning.candidate_bands`,
:func:`adaclip.correlated.coefficients.choose_bands` with σ_b calibrated by PLD) for
GPT-2-small-, 500M- and 1B-parameter models and prints, for each R, the b chosen and its
expected error relative to DP-SGD's (b = 1), before and after. Public quantities only; nothing
is trained. The workload is Adam's first moment (β1 = 0.9, momentum-like) with the learning
rate scaled (``scale_adaptive_lr``, the default with banded noise), so the adaptive cap of 4
bands does not apply.

    python benchmarks/bands_at_scale.py --out benchmarks/results/bands_at_scale.md
"""

from __future__ import annotations

import argparse
import datetime
import functools
import platform
import sys
from pathlib import Path

import numpy as np

from adaclip.accounting import MinSeparationParticipation, calibrate_block_noise_multiplier
from adaclip.correlated.blt import fit_blt
from adaclip.correlated.coefficients import choose_bands
from adaclip.correlated.planning import (
    BAND_CANDIDATES,
    BANDED_BUFFER_BUDGET_BYTES,
    banded_sigma_calibrator,
    candidate_bands,
)

#: the numbers of BLT buffers tried (m·d numbers, whatever the run's length)
BLT_BUFFERS = (1, 2, 3, 4)
MODELS = {"124M (GPT-2 small)": 124_000_000, "500M": 500_000_000, "1B": 1_000_000_000}
RANKS = (1, 2, 8)
#: (name, N, expected batch B, epochs, ε): a fine-tuning run and a longer one, δ = 1e-5
SCENARIOS = (("fine-tune: N = 100k, B = 1,024, 3 epochs, ε = 8", 100_000, 1024, 3, 8.0),
             ("fine-tune at ε = 1: N = 100k, B = 1,024, 3 epochs", 100_000, 1024, 3, 1.0),
             ("long: N = 1M, B = 4,096, 10 epochs, ε = 3", 1_000_000, 4096, 10, 3.0))  # fmt: skip


def momentum_error(inverse_column: np.ndarray, n: int, beta: float = 0.9) -> float:
    """``‖A C⁻¹‖_F² / n`` for Adam's first moment ``A_{t,s} = Σ_{k=s}^{t} β^{k−s}`` and a Toeplitz
    ``C⁻¹`` with first column ``inverse_column``: ``A C⁻¹`` is Toeplitz with column ``a * r`` (a
    convolution), whose entry ``j`` appears ``n − j`` times. The same quantity as
    :func:`adaclip.correlated.coefficients.expected_error` with ``workload="momentum"`` (equal
    to it on banded coefficients), for a dense factor."""
    a = (1 - beta ** (np.arange(n) + 1)) / (1 - beta)
    w = np.convolve(a, inverse_column[:n])[:n]
    return float(np.sum((n - np.arange(n)) * w**2) / n)


@functools.cache
def blt_errors(
    num_samples: int, batch: int, epochs: int, epsilon: float, buffers: tuple[int, ...] = BLT_BUFFERS,
    accountant: str = "pld",
) -> dict[int, float]:
    """``m ↦`` the expected error of BLT noise with ``m`` buffers: fixed-order batches
    (``⌈N/B⌉`` an epoch, no amplification), the factor fitted by :func:`fit_blt` for the run,
    σ calibrated for the block-by-block record the optimizer makes (``accountant``: PLD, as
    ``make_private``; RDP is looser and much faster), the momentum workload."""
    separation = -(-num_samples // batch)
    n = epochs * separation
    out = {}
    for m in buffers:
        noise = fit_blt(n, buffers=m, min_separation=separation)
        prefix = MinSeparationParticipation(separation).prefix_sensitivities_squared(noise.column(n))
        sigma = calibrate_block_noise_multiplier(
            target_epsilon=epsilon, delta=1e-5, prefix=prefix, block=separation, accountant=accountant
        )
        out[m] = sigma**2 * momentum_error(noise.inverse_coefficients(n), n)
    return out


def rows(
    num_samples: int, batch: int, epochs: int, epsilon: float, *, blt_buffers: tuple[int, ...] = BLT_BUFFERS,
    blt_accountant: str = "pld",
) -> list[tuple]:
    q = batch / num_samples
    steps = epochs * max(1, round(1 / q))
    sigma_for = banded_sigma_calibrator(target_epsilon=epsilon, delta=1e-5, sample_rate=q, steps=steps)
    everything = candidate_bands(sample_rate=q, steps=steps, lr_scaled=True, adaptive_optimizer=True,
                                 candidates=BAND_CANDIDATES)  # fmt: skip
    _, table = choose_bands(candidates=everything, n=steps, sigma_for_bands=sigma_for, workload="momentum",
                            momentum=0.9, optimise=False)  # fmt: skip
    dp_sgd = table[1][1]
    unlimited = min((table[b][1], b) for b in [1, *everything])[1]
    out = []
    for model, d in MODELS.items():
        for ranks in RANKS:
            chosen = []
            for per_rank in (4 * d, -(-4 * d // ranks)):  # before: rank 0 holds all; after: 1/R each
                allowed = [b for b in everything if (b - 1) * per_rank <= BANDED_BUFFER_BUDGET_BYTES]
                best = min((table[b][1], b) for b in [1, *allowed])[1]
                chosen.append(best)
            blt = blt_errors(num_samples, batch, epochs, epsilon, blt_buffers, blt_accountant)
            fits = [m for m in blt_buffers if m * -(-4 * d // ranks) <= BANDED_BUFFER_BUDGET_BYTES]
            m = min(fits, key=blt.__getitem__) if fits else None
            out.append((model, ranks, chosen[0], table[chosen[0]][1] / dp_sgd, chosen[1], table[chosen[1]][1] / dp_sgd,
                        m, None if m is None else blt[m] / dp_sgd, unlimited, table[unlimited][1] / dp_sgd))  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the markdown table here")
    args = parser.parse_args(argv)
    lines = [
        "# Banded noise for large models: the b the rule chooses, before and after sharding the buffers",
        "",
        f"`python benchmarks/bands_at_scale.py --out {args.out}` on {platform.node() or 'this machine'} "
        f"({platform.processor() or platform.machine()}), Python {sys.version.split()[0]}, "
        f"{datetime.date.today().isoformat()}. Nothing is trained: the rule (candidates within the "
        "1 GiB buffer budget, σ_b calibrated with PLD, the expected error of Adam's first moment) run on "
        "public quantities. Error: the expected squared error of the workload relative to DP-SGD's "
        "(b = 1) at the same (ε, δ); lower is better. *Before*: rank 0 held every buffer (`(b − 1)·d` "
        "numbers); *after*: each rank holds `(b − 1)·d/R` (sharded noise state). *No memory limit*: the "
        "rule's choice without the budget, for reference. *BLT*: the memory-light mechanism (`noise_mechanism="
        "'blt'`): `m` buffers of `d` numbers whatever b or the run's length, sharded over the ranks too "
        "(`m·d/R` each), fixed-order batches without amplification (σ calibrated for its block-by-block "
        "record); `m` is the best of 1–4 that fits the same budget (—: none fits). Offloading the buffers to "
        "host memory is not built.",
        "",
    ]
    for name, n, batch, epochs, epsilon in SCENARIOS:
        lines += [f"## {name}", "",
                  "| model | ranks | before: b | error | after: b | error | BLT: m | error | no memory limit: b | error |",
                  "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for model, ranks, b0, e0, b1, e1, m, em, bu, eu in rows(n, batch, epochs, epsilon):
            blt = "— | —" if m is None else f"{m} | {em:.3f}"
            lines.append(f"| {model} | {ranks} | {b0} | {e0:.3f} | {b1} | {e1:.3f} | {blt} | {bu} | {eu:.3f} |")
        lines.append("")
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
