"""The accounting rule of cyclic Poisson sampling (banded correlated noise).

Every unit is assigned once to one of ``b`` groups, independently and uniformly at random; step
``t`` samples only group ``t mod b``, each of its units with probability ``p = b·q``. Two
participations of a unit are then at least ``b`` steps apart, and a run of ``T`` steps with
banded noise of ``b`` bands is accounted as ``⌈T/b⌉`` compositions of the Poisson-subsampled
Gaussian mechanism at rate ``p`` (:mod:`adaclip.correlated.mechanism` has the argument). The
rule lives here, with the rest of the accounting, so that the accounting needs nothing from
:mod:`adaclip.correlated` (which re-exports these names, their public home).
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from adaclip.errors import InvalidHyperparameterError
from adaclip.options import positive_int, validate_sample_rate

__all__ = ["accounted_sample_rate", "accounted_steps"]


def _check_bands(bands: Any) -> int:
    return positive_int("bands", bands)


def accounted_sample_rate(sample_rate: float, bands: int) -> float:
    """``p = b·q``: the rate at which a unit of the step's group is sampled under cyclic Poisson
    sampling (the rate the accountant records). Refuses ``b·q > 1``: the expected batch ``qN``
    could not be drawn from a group of ``N/b`` units."""
    b = _check_bands(bands)
    q = validate_sample_rate(sample_rate)
    p = b * q
    if p > 1 + 1e-12:
        raise InvalidHyperparameterError(
            f"bands={b} with sample_rate={q!r}: cyclic Poisson sampling draws each step from one of b "
            f"groups at rate b·q = {p:.4g} > 1. Use at most {math.floor(1 / q)} bands at this sample rate"
        )
    return min(1.0, p)


def accounted_steps(steps: int, bands: int) -> int:
    """``⌈T/b⌉``: the number of compositions the accountant records for ``T`` steps."""
    b = _check_bands(bands)
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 0:
        raise InvalidHyperparameterError(f"steps must be a non-negative int, got {steps!r}")
    return -(-int(steps) // b)
