"""The methods of the utility benchmark's round three (:mod:`round3`): what each evaluates.

Each method is a training run (:data:`RUN_OF`) read either on its live parameters or on an
average of them (:func:`uses_ema`, μ picked on validation among :func:`averaging_candidates`);
:data:`BASELINES` are what the recommended configuration is judged against. Kept apart from the
training harness (PyTorch) so that the report (:mod:`report_round3`) imports no framework;
:mod:`round3` re-exports them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

DECAYS = (0.9, 0.99, 0.999)  # EMA decays μ, picked on validation
METHODS = (
    "flat", "flat+ema", "banded", "banded+ema", "banded-grid", "banded-grid+ema", "adaclip+banded+ema", "adaclip+ema",
    "quantile", "per-layer", "recommended", "blt", "blt+ema", "banded-lr", "recommended-lr",
    "banded-lr-nocap", "recommended-lr-nocap", "quantile-banded", "recommended-quantile",
)  # fmt: skip
#: what a practitioner already has: the recommended configuration is judged against the best of these
BASELINES = ("flat", "quantile", "per-layer")
DEFAULT_METHODS = ("flat", "flat+ema", "banded", "banded+ema")
# each method is (the training run it evaluates, whether it reads the EMA)
RUN_OF = {"flat": "flat", "flat+ema": "flat", "banded": "banded", "banded+ema": "banded",
          "banded-grid": "banded-grid", "banded-grid+ema": "banded-grid",
          "adaclip+banded+ema": "adaclip-banded", "adaclip+ema": "adaclip",
          "quantile": "quantile", "per-layer": "per-layer", "recommended": "banded",
          "blt": "blt", "blt+ema": "blt", "banded-lr": "banded-lr", "recommended-lr": "banded-lr",
          "banded-lr-nocap": "banded-lr-nocap", "recommended-lr-nocap": "banded-lr-nocap",
          "quantile-banded": "quantile-banded", "recommended-quantile": "quantile-banded"}  # fmt: skip
#: the recommended configurations U1 reads against the best baseline (``recommended-lr``: the same
#: with an adaptive optimizer's learning rate scaled by ``adaptive_lr_scale``; ``-nocap``: and b
#: chosen by the expected-error rule without the adaptive optimizers' cap; ``recommended-quantile``:
#: the same noise plan with the quantile rule's clipping instead of flat clipping)
RECOMMENDED = ("recommended", "recommended-lr", "recommended-lr-nocap", "recommended-quantile")
#: the flat-clipping recommended configuration that the library's current defaults give, first present
#: (Adam: the lr factor and the rule's uncapped b; SGD, or b = 1: ``recommended``)
FLAT_RECOMMENDED = ("recommended-lr-nocap", "recommended-lr", "recommended")


def uses_ema(method: str) -> bool:
    return method.endswith("+ema") or method in RECOMMENDED


def averaging_candidates(method: str) -> tuple[float | None, ...]:
    """The averaging choices picked on validation with lr and C: μ ∈ DECAYS for ``X+ema``; for
    ``recommended`` (and ``recommended-lr``) also ``None`` (no averaging), so that on runs where the average hurts the
    validation rule can keep the live parameters."""
    if method in RECOMMENDED:
        return (None, *DECAYS)
    return DECAYS if uses_ema(method) else (None,)


def pick_winner(rows: list[dict[str, Any]], method: str) -> dict[str, Any]:
    """The winner of ``method`` among tuning ``rows`` (one per grid point, each with its runs):
    the best mean validation accuracy over the averaging choices the method may pick
    (:func:`averaging_candidates`: the live parameters' ``metric`` for ``None``, ``ema<μ>``
    otherwise); ties go to the first grid point, then the smallest μ."""
    best: dict[str, Any] | None = None
    for row in rows:
        for mu in averaging_candidates(method):
            val = float(np.mean([run["metric"] if mu is None else run[f"ema{mu}"] for run in row["runs"]]))
            if best is None or val > best["val_mean"]:
                best = {"hp": row["hp"], "mu": mu, "val_mean": val, "bands": row["runs"][0]["bands"]}
                if "bands_arg" in row:
                    best["bands_arg"] = row["bands_arg"]
    if best is None:
        raise ValueError(f"no tuning runs for {method}")
    return best


def pick_clipping(cell: dict[str, Any]) -> str | None:
    """The recommended configuration with its clipping picked on validation: of the flat-clipping
    one (the first of :data:`FLAT_RECOMMENDED` the cell has) and ``recommended-quantile`` (the
    same noise plan with the quantile rule's clipping), the one whose validation winner has the
    higher mean (ties: flat). ``None`` unless the cell has both. Reads validation means only,
    never a test score; its tuning budget is the two methods' grids together."""
    final, winners = cell.get("final", {}), cell.get("winners", {})
    flat = next((m for m in FLAT_RECOMMENDED if m in final), None)
    if flat is None or "recommended-quantile" not in final:
        return None
    candidates = (flat, "recommended-quantile")
    return max(candidates, key=lambda m: (winners[m]["val_mean"], -candidates.index(m)))
