"""Correlated noise: the release's noise as a streaming mechanism (amplified banded matrix
factorisation, or buffered linear Toeplitz noise without amplification).

- :mod:`adaclip.correlated.contract` — :class:`NoiseFamily`, what every noise family
  implements (its stream, the sampler it needs, its accounting, its checkpoint rule), and
  :class:`NoiseStreamState`;

- :mod:`adaclip.correlated.mechanism` — :class:`BandedNoise` (``b = 1`` is DP-SGD's independent
  noise), its streaming state, the per-step noise variance, and the accounting rule (``⌈T/b⌉``
  compositions at rate ``p = b·q``);
- :mod:`adaclip.correlated.coefficients` — the Toeplitz coefficients: the truncated square root
  and coefficients optimised for the training workload, the expected error, and the choice of
  ``b`` before training;
- :mod:`adaclip.correlated.blt` — :class:`BltNoise` (buffered linear Toeplitz: a dense Toeplitz
  factor streamed with ``m`` buffers), its fit for the prefix-sum workload; its accounting is
  :class:`adaclip.accounting.MinSeparationGaussian` (no amplification);
- :mod:`adaclip.correlated.planning` — :func:`plan_banded_noise`: a run's ``b``, calibrated σ,
  coefficients and an adaptive optimizer's learning-rate factor, before training, for any
  framework (``adaclip_torch.make_private`` applies the same rule).
"""

from adaclip.correlated.blt import BltNoise, fit_blt
from adaclip.correlated.contract import NoiseFamily, SamplerRequirement
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
from adaclip.correlated.planning import BandedNoisePlan, plan_banded_noise

__all__ = [
    "NOISE_MECHANISMS",
    "BandedNoise",
    "BandedNoisePlan",
    "BltNoise",
    "fit_blt",
    "NoiseFamily",
    "NoiseStreamState",
    "SamplerRequirement",
    "accounted_sample_rate",
    "accounted_steps",
    "check_coefficients",
    "independent",
    "plan_banded_noise",
    "resolve_noise_mechanism",
]
