"""Correlated noise: the release's noise as a streaming mechanism (amplified banded matrix
factorisation).

- :mod:`adaclip.correlated.mechanism` — :class:`BandedNoise` (``b = 1`` is DP-SGD's independent
  noise), its streaming state, the per-step noise variance, and the accounting rule (``⌈T/b⌉``
  compositions at rate ``p = b·q``);
- :mod:`adaclip.correlated.coefficients` — the Toeplitz coefficients: the truncated square root
  and coefficients optimised for the training workload, the expected error, and the choice of
  ``b`` before training.
"""

from adaclip.correlated.mechanism import (
    NOISE_MECHANISMS,
    BandedNoise,
    NoiseStreamState,
    accounted_sample_rate,
    accounted_steps,
    check_coefficients,
    independent,
    resolve_noise_mechanism,
)

__all__ = [
    "NOISE_MECHANISMS",
    "BandedNoise",
    "NoiseStreamState",
    "accounted_sample_rate",
    "accounted_steps",
    "check_coefficients",
    "independent",
    "resolve_noise_mechanism",
]
