"""One-run white-box canary audit of the quantile rule with banded noise, next to flat clipping.

The runs are those of ``tests/test_torch_audit_banded.py`` (its ``audited_run``, imported, so that
the configuration lives in one place): learning rate 0 on a ``Linear(50, 40)`` (d = 2,000),
N = 64 examples, cyclic Poisson sampling with b = 4 bands at q = 1/8 (rate ½ in a group's steps),
T = 80 steps, σ = 4 accounted (PLD: 20 compositions at rate ½), m = 1000 canaries. QuantileClip
starts at ``C_0 = 1`` and follows the released count (``quantile_options`` there: B̄ counts the
canaries, σ_b = B̄/20, γ the data's median, η = 1); FlatClip keeps ``C = 1``.

The gradient's noise multiplier is ``σ_g`` (σ for flat clipping; ``(σ⁻² − (2σ_b)⁻²)^{-1/2}`` for
the quantile rule, whose count takes the rest of the budget), so the whitened matched filter
predicts GDP ``μ = b·q·√(T/b)/(s·σ_g)`` with ``s`` the released share of the noise (1, or ½ in the
negative control; for the quantile rule also ``σ/σ_g``: the gradient left at σ while the count is
released too), and the excluded canaries' spread ``s·σ_g·‖C s_g‖`` (printed over ``σ_g·‖C s_g‖``). For the quantile rule each run is also scored with the read-backs normalised by
``C_0`` instead of each step's ``C_t`` (``r_t·C_t/C_0``, whitened and matched the same way;
computed here only for comparison): what an auditor that ignored the adaptation would see.

``--setting larger``: the slow test's setting instead (b = 8, q = 1/16, T = 320, m = 2000).

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/audit/quantile_banded_canaries.py [--seeds 0 1 2] \
        [--setting larger]
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import numpy as np
import torch

from adaclip.adaptive import split_noise_multiplier
from adaclip.audit.report import audit_scores

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))
import test_torch_audit_banded as cfg  # noqa: E402

#: the default-suite setting and the slow test's (``test_banded_audit_larger``); σ = 4 in both
SETTINGS = {
    "default": {"bands": cfg.BANDS, "q": cfg.Q, "steps": cfg.STEPS, "num_canaries": cfg.M},
    "larger": {"bands": 8, "q": 1 / 16, "steps": 320, "num_canaries": 2000},
}


def run(strategy: str, seed: int, noise_scale: float, setting: dict) -> dict[str, object]:
    """One audited run: the auditor's report, the clip norms, ``σ_g`` and the predicted μ; for
    the quantile rule also the report of the score normalised by ``C_0``."""
    clip_norms: list[float] = []
    auditor, accountant, reads, _ = cfg.audited_run(strategy=strategy, seed=seed, noise_scale=noise_scale,
                                                    clip_norms=clip_norms, **setting)  # fmt: skip
    sigma_g = cfg.gradient_noise_multiplier(auditor.optimizer)
    bands, steps = setting["bands"], setting["steps"]
    slots_per_group = math.sqrt(steps / bands)
    out: dict[str, object] = {
        "sigma_g": sigma_g,
        "predicted_mu": bands * setting["q"] * slots_per_group / (noise_scale * sigma_g),
        "spread": sigma_g * slots_per_group,  # the excluded canaries' σ_g·‖C s_g‖ at the claimed σ_g
        "clip_norms": (min(clip_norms), max(clip_norms), clip_norms[-1]),
        "per-step C_t": auditor.report(delta=cfg.DELTA),
    }
    if strategy == "quantile":
        canaries = auditor.canaries
        big_c = cfg.toeplitz(canaries.coefficients, steps)
        slots = np.array([[t % bands == g for g in canaries.groups] for t in range(steps)], dtype=float)
        stale = reads * (np.array(clip_norms) / clip_norms[0])[:, None]
        scores = ((big_c @ stale) * (big_c @ slots)).sum(0)
        out["C_0 only"] = audit_scores(scores, canaries.included, delta=cfg.DELTA,
                                       accountant_epsilon=accountant.epsilon(cfg.DELTA))  # fmt: skip
    return out


def runs(strategy: str, setting: dict) -> list[tuple[str, float]]:
    """The runs of a strategy: correct, σ/2 released, and for the quantile rule the gradient's
    noise released at σ instead of σ_g (``noise_scale = σ/σ_g``: the count's share not split off,
    a leak the score's μ̂ barely moves with but the excluded canaries' spread shows)."""
    out = [("correct", 1.0), ("σ/2 released", 0.5)]
    if strategy == "quantile":
        bbar, _ = cfg.quantile_options(q=setting["q"], num_canaries=setting["num_canaries"])
        out.append(("gradient at σ", cfg.SIGMA / split_noise_multiplier(cfg.SIGMA, bbar / 20)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--setting", choices=sorted(SETTINGS), default="default")
    args = parser.parse_args()
    setting = SETTINGS[args.setting]
    torch.set_num_threads(1)
    print("| strategy | run | seed | σ_g | predicted μ | read-back | ε_emp (one-run) | GDP μ̂ ± se | s₀/(σ_g‖Cs_g‖) "
          "| GDP ε [90 %] | accountant ε | C_t min / max / last |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for seed in args.seeds:
        for strategy in ("flat", "quantile"):
            for name, scale in runs(strategy, setting):
                out = run(strategy, seed, scale, setting)
                lo, hi, last = out["clip_norms"]
                for score in ("per-step C_t", "C_0 only"):
                    if score not in out:
                        continue
                    rep, g = out[score], out[score].gdp
                    print(f"| {strategy} | {name} | {seed} | {out['sigma_g']:.3f} | {out['predicted_mu']:.3f} "
                          f"| {score} | {rep.epsilon_lower:.3f} | {g.mu:.3f} ± {g.se:.3f} "
                          f"| {g.sd0 / out['spread']:.3f} | {g.epsilon:.2f} [{g.epsilon_lower:.2f}, "
                          f"{g.epsilon_upper:.2f}] | {rep.accountant_epsilon:.3f} | {lo:.2f} / {hi:.2f} / {last:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
