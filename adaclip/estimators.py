"""Estimators of a weighted average over sampled users (user-level DP; McMahan et al., *Learning differentially private recurrent language models*).

With users sampled independently at rate ``q``, user ``k`` of weight ``w_k`` contributing a
clipped update ``Δ_k`` (``‖Δ_k‖ <= S``), the server estimates ``Σ_k w_k Δ_k / W`` by

- the fixed denominator  ``f_f = Σ_k w_k Δ_k / (q·W)``, sensitivity ``S/(q·W)`` (unbiased);
- the clipped denominator ``f_c = Σ_k w_k Δ_k / max(q·W_min, Σ_k w_k)``, sensitivity
  ``2S/(q·W_min)`` (lower variance when the sampled weight varies).

Weights are capped, ``w_k = min(n_k/ŵ, 1)``, so one user's weight is at most 1. Noise for a
Gaussian release is ``σ`` times the sensitivity. These functions take arrays of any array-API
namespace (or Python numbers for the scalars).

**As one release of the core mechanism.** Both estimators are the clip–sum–noise–rescale
release of :mod:`adaclip.mechanism` with per-unit clip norm ``S`` (after the strategy's
transform, ``S = 1``), divided by a *denominator* ``D`` and with noise ``κ·σ·S`` on the sum:

- fixed: ``D = qW``, ``κ = 1``;
- clipped: ``D = qW_min``, ``κ = 2``, and the weighted sum first multiplied by
  ``D / max(D, Σ_k w_k)`` (:func:`clipped_denominator_shrink`), so that
  ``sum/D = Σ_k w_k Δ_k / max(qW_min, Σ_k w_k)``.

:func:`estimator_release` gives ``(D, κ)``; the user-level front end (``adaclip_flower``)
releases with ``expected_batch_size = D`` and ``noise_multiplier = κσ``, so the estimate and
its sensitivity are the ones above by construction.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from adaclip.errors import InvalidHyperparameterError
from adaclip.options import finite_positive, validate_sample_rate

__all__ = [
    "ESTIMATORS",
    "EstimatorRelease",
    "estimator_release",
    "clipped_denominator_shrink",
    "capped_user_weights",
    "fixed_denominator_estimate",
    "fixed_denominator_sensitivity",
    "clipped_denominator_estimate",
    "clipped_denominator_sensitivity",
]


#: The estimators of a weighted average over sampled users.
ESTIMATORS: tuple[str, ...] = ("fixed", "clipped")


class EstimatorRelease(NamedTuple):
    """How an estimator is released by the core mechanism: the sum (after
    :func:`clipped_denominator_shrink` for ``"clipped"``) is divided by ``denominator`` and the
    noise on it is ``sensitivity_factor · σ`` times the clip norm."""

    denominator: float
    sensitivity_factor: float


def estimator_release(
    estimator: str, *, sample_rate: float, total_weight: float, min_total_weight: float | None = None
) -> EstimatorRelease:
    """``(D, κ)`` of ``estimator``: ``(qW, 1)`` for ``"fixed"``, ``(qW_min, 2)`` for ``"clipped"``
    (``W_min`` defaults to ``W``; it must not exceed it).

    Raises:
        InvalidHyperparameterError: an unknown estimator, ``q ∉ (0, 1]``, a non-positive or
            non-finite weight, or ``W_min > W``.
    """
    if estimator not in ESTIMATORS:
        raise InvalidHyperparameterError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}")
    rate = validate_sample_rate(sample_rate)
    total = finite_positive("total_weight", total_weight)
    floor = total if min_total_weight is None else finite_positive("min_total_weight", min_total_weight)
    if floor > total:
        raise InvalidHyperparameterError(f"min_total_weight ({floor!r}) must not exceed total_weight ({total!r})")
    if estimator == "fixed":
        return EstimatorRelease(rate * total, 1.0)
    return EstimatorRelease(rate * floor, 2.0)


def clipped_denominator_shrink(sampled_weight: float, *, denominator: float) -> float:
    """``D / max(D, Σ_k w_k)`` ∈ (0, 1]: the factor on the weighted sum that turns the division by
    ``D = qW_min`` into the clipped denominator's division by ``max(qW_min, Σ_k w_k)``. It never
    grows the sum, so the sum's sensitivity (one weight ≤ 1 times the clip norm) still holds
    before the division; the estimate's is ``2S/(qW_min)`` (a user's presence also moves
    ``Σ_k w_k``), which the noise factor ``κ = 2`` covers."""
    floor = finite_positive("denominator", denominator)
    return floor / max(floor, float(sampled_weight))


def _count_or_nan(value: Any) -> float:
    """``value`` as a float when it is a real, finite, non-negative count, else NaN."""
    if isinstance(value, bool):
        return math.nan
    try:
        x = float(value)
    except (TypeError, ValueError):
        return math.nan
    return x if math.isfinite(x) and x >= 0 else math.nan


def capped_user_weights(num_examples: Any, *, weight_cap: float, invalid: str = "raise") -> Any:
    """``w_k = min(n_k / ŵ, 1)`` for users with ``n_k`` examples and cap ``ŵ``.

    Args:
      num_examples: ``n_k`` per user.
      weight_cap: ``ŵ > 0``.
      invalid: ``"raise"`` (default): a negative count is an error; ``"zero"``: a count that is
        not a finite, non-negative real (negative, NaN, infinite, a bool, not a number) gets
        weight 0, so that user contributes nothing — what a server does with what clients
        report, where raising would reveal that the user was sampled.
    """
    cap = finite_positive("weight_cap", weight_cap)
    if invalid == "zero":
        n = np.array([_count_or_nan(x) for x in num_examples], dtype=np.float64)
        return np.where(np.isnan(n), 0.0, np.minimum(n / cap, 1.0))
    if invalid != "raise":
        raise InvalidHyperparameterError(f"invalid must be 'raise' or 'zero', got {invalid!r}")
    n = np.asarray(num_examples, dtype=np.float64)
    if np.any(n < 0):
        raise InvalidHyperparameterError("num_examples must be >= 0")
    return np.minimum(n / cap, 1.0)


def fixed_denominator_estimate(weighted_sum: Any, *, sample_rate: float, total_weight: float) -> Any:
    """``f_f = Σ_k w_k Δ_k / (q·W)``."""
    return weighted_sum / (validate_sample_rate(sample_rate) * finite_positive("total_weight", total_weight))


def fixed_denominator_sensitivity(*, clip_norm: float, sample_rate: float, total_weight: float) -> float:
    """``S / (q·W)``."""
    return finite_positive("clip_norm", clip_norm) / (validate_sample_rate(sample_rate) * finite_positive("total_weight", total_weight))


def clipped_denominator_estimate(
    weighted_sum: Any, sampled_weight: float, *, sample_rate: float, min_total_weight: float
) -> Any:
    """``f_c = Σ_k w_k Δ_k / max(q·W_min, Σ_k w_k)``."""
    floor = validate_sample_rate(sample_rate) * finite_positive("min_total_weight", min_total_weight)
    return weighted_sum / max(floor, float(sampled_weight))


def clipped_denominator_sensitivity(*, clip_norm: float, sample_rate: float, min_total_weight: float) -> float:
    """``2S / (q·W_min)``."""
    return 2.0 * finite_positive("clip_norm", clip_norm) / (
        validate_sample_rate(sample_rate) * finite_positive("min_total_weight", min_total_weight)
    )
