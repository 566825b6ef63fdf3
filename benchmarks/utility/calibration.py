"""The benchmarks' memoised σ calibration.

Every method and seed of one comparison trains with the same σ, the noise multiplier that
:func:`adaclip.accounting.calibrate_noise_multiplier` calibrates for the comparison's
``(ε, δ, q, steps, accountant)``. The calibration is a root search over accountant runs: it is
deterministic in those arguments and costs seconds, so the harnesses ask :func:`calibrated_sigma`
instead, which computes it once per argument tuple with the library function itself and returns
the very same float afterwards.

This is a local wrapper that the harnesses call explicitly: nothing in :mod:`adaclip` is
replaced, so a library call (``make_private`` calibrating on its own, a test) always runs the
uncached function. It imports no framework (NumPy-only core), so report scripts may import it.
"""

from __future__ import annotations

import functools

import adaclip.accounting as _accounting


@functools.cache
def _calibrated(target_epsilon: float, delta: float, sample_rate: float, steps: int, accountant: str) -> float:
    return _accounting.calibrate_noise_multiplier(
        target_epsilon=target_epsilon, delta=delta, sample_rate=sample_rate, steps=steps, accountant=accountant
    )


def calibrated_sigma(
    *, target_epsilon: float, delta: float, sample_rate: float, steps: int, accountant: str = "rdp"
) -> float:
    """σ of :func:`adaclip.accounting.calibrate_noise_multiplier` (default ``tol`` and accountant
    options) for these arguments, computed once per process and argument tuple."""
    return _calibrated(target_epsilon, delta, sample_rate, steps, accountant)


def cache_info() -> functools._CacheInfo:
    """Hits and misses of the memo (what a test or a curious harness may ask)."""
    return _calibrated.cache_info()
