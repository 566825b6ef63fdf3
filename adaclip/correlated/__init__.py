"""Correlated noise: the release's noise as a streaming mechanism (amplified banded matrix
factorisation, or buffered linear Toeplitz noise without amplification).

- :mod:`adaclip.correlated.mechanism` — :class:`BandedNoise` (``b = 1`` is DP-SGD's independent
  noise), its streaming state, the per-step noise variance, and the accounting rule (``⌈T/b⌉``
  compositions at rate ``p = b·q``);
- :mod:`adaclip.correlated.coefficients` — the Toeplitz coefficients: the truncated square root
  and coefficients optimised for the training workload, the expected error, and the choice of
  ``b`` before training;
- :mod:`adaclip.correlated.blt` — :class:`BltNoise` (buffered linear Toeplitz: a dense Toeplitz
  factor streamed with ``m`` buffers), its fit for the prefix-sum workload; its accounting is
  :class:`adaclip.accounting.MinSeparationGaussian` (no amplification).
"""

from adaclip.correlated.blt import BltNoise, fit_blt
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
    "BltNoise",
    "fit_blt",
    "NoiseStreamState",
    "accounted_sample_rate",
    "accounted_steps",
    "check_coefficients",
    "independent",
    "resolve_noise_mechanism",
]
