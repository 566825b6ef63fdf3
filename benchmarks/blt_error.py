"""Expected error of the prefix-sum workload at equal (ε, δ): independent noise (DP-SGD, Poisson
sampling), banded noise (cyclic Poisson, the library's choice of b) and BLT noise (fixed order,
no amplification).

Each cell is one setting ``(N, B, epochs, ε)``; the figure is the mean squared error of the
prefix sums of the releases per coordinate, in units of the clip norm squared:
``σ² · ‖S C⁻¹‖_F² / n`` with σ calibrated for the target by the method's own accounting (RDP,
δ = 1e-5). Everything is computed (no training, no randomness), so one run suffices; the
timings are the BLT fit's wall time on a shared machine.

    python benchmarks/blt_error.py --out benchmarks/results/blt_error.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import scipy  # noqa: E402

from adaclip.accounting import (  # noqa: E402
    MinSeparationParticipation,
    calibrate_block_noise_multiplier,
    calibrate_noise_multiplier,
)
from adaclip.correlated import coefficients as co  # noqa: E402
from adaclip.correlated.blt import fit_blt, prefix_error  # noqa: E402

DELTA = 1e-5


def cell(n_data: int, batch: int, epochs: int, epsilon: float, buffers: int) -> dict:
    q = batch / n_data
    # independent: Poisson at q, round(1/q) steps per epoch (make_private's plan)
    n_poisson = epochs * max(1, round(1 / q))
    s_ind = calibrate_noise_multiplier(target_epsilon=epsilon, delta=DELTA, sample_rate=q, steps=n_poisson)
    err_ind = s_ind**2 * (n_poisson + 1) / 2

    # banded: the library's choice of b on the prefix workload (square-root coefficients)
    def sigma_for(b: int) -> float:
        if b * q > 1:
            return math.inf
        return calibrate_noise_multiplier(
            target_epsilon=epsilon, delta=DELTA, sample_rate=b * q, steps=-(-n_poisson // b)
        )

    cands = [b for b in (2, 4, 8, 16, 32, 64) if b <= n_poisson]
    best_b, table = co.choose_bands(candidates=cands, n=n_poisson, sigma_for_bands=sigma_for, optimise=False,
                                    workload="prefix")
    s_band, err_band, _ = table[best_b]

    # BLT: fixed order, b = ceil(N/B) batches per epoch, no amplification
    sep = -(-n_data // batch)
    n_fixed = epochs * sep
    t0 = time.perf_counter()
    mech = fit_blt(n_fixed, buffers=buffers, min_separation=sep)
    fit_s = time.perf_counter() - t0
    prefix = MinSeparationParticipation(sep).prefix_sensitivities_squared(mech.column(n_fixed))
    s_blt = calibrate_block_noise_multiplier(target_epsilon=epsilon, delta=DELTA, prefix=prefix, block=sep)
    err_blt = s_blt**2 * prefix_error(mech.inverse_coefficients(n_fixed))
    return {
        "N": n_data, "B": batch, "epochs": epochs, "epsilon": epsilon, "steps_poisson": n_poisson,
        "steps_fixed": n_fixed, "sigma_independent": s_ind, "err_independent": err_ind, "bands": best_b,
        "sigma_banded": s_band, "err_banded": err_band, "sigma_blt": s_blt, "sensitivity_blt": math.sqrt(prefix[-1]),
        "err_blt": err_blt, "blt_fit_seconds": fit_s, "theta": list(mech.theta), "omega": list(mech.omega),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--buffers", type=int, default=3)
    args = parser.parse_args()
    rows = []
    for n_data, batch in ((60_000, 256), (60_000, 1024), (60_000, 4096)):
        for epochs in (1, 5, 20):
            for epsilon in (1.0, 8.0):
                row = cell(n_data, batch, epochs, epsilon, args.buffers)
                rows.append(row)
                print(
                    f"N={n_data} B={batch:5d} E={epochs:2d} eps={epsilon:3.0f}  steps={row['steps_fixed']:5d}  "
                    f"indep {row['err_independent']:10.4g}  banded(b={row['bands']:2d}) {row['err_banded']:10.4g}  "
                    f"blt {row['err_blt']:10.4g}  blt/indep {row['err_blt'] / row['err_independent']:7.3f}  "
                    f"blt/banded {row['err_blt'] / row['err_banded']:7.3f}  fit {row['blt_fit_seconds']:.2f}s",
                    flush=True,
                )
    meta = {"python": platform.python_version(), "numpy": np.__version__, "scipy": scipy.__version__,
            "machine": platform.machine(), "buffers": args.buffers, "delta": DELTA}  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
