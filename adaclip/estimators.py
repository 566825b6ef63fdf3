"""Estimators of a weighted average over sampled users (user-level DP; McMahan et al., *Learning differentially private recurrent language models*).

With users sampled independently at rate ``q``, user ``k`` of weight ``w_k`` contributing a
clipped update ``Δ_k`` (``‖Δ_k‖ <= S``), the server estimates ``Σ_k w_k Δ_k / W`` by

- the fixed denominator  ``f_f = Σ_k w_k Δ_k / (q·W)``, sensitivity ``S/(q·W)`` (unbiased);
- the clipped denominator ``f_c = Σ_k w_k Δ_k / max(q·W_min, Σ_k w_k)``, sensitivity
  ``2S/(q·W_min)`` (lower variance when the sampled weight varies).

Weights are capped, ``w_k = min(n_k/ŵ, 1)``, so one user's weight is at most 1. Noise for a
Gaussian release is ``σ`` times the sensitivity. These functions take arrays of any array-API
namespace (or Python numbers for the scalars).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from adaclip.errors import InvalidHyperparameterError
from adaclip.options import finite_positive, validate_sample_rate

__all__ = [
    "capped_user_weights",
    "fixed_denominator_estimate",
    "fixed_denominator_sensitivity",
    "clipped_denominator_estimate",
    "clipped_denominator_sensitivity",
]


def capped_user_weights(num_examples: Any, *, weight_cap: float) -> Any:
    """``w_k = min(n_k / ŵ, 1)`` for users with ``n_k`` examples and cap ``ŵ``."""
    cap = finite_positive("weight_cap", weight_cap)
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
