"""The noise mechanism of the release: independent (DP-SGD), banded or BLT correlated noise.

(BLT, buffered linear Toeplitz noise, is :class:`adaclip.correlated.blt.BltNoise`: the same
convention ``x = C⁻¹ z`` with a dense Toeplitz ``C`` streamed with ``m`` buffers, accounted
without amplification under min-separation participation — see that module and
:mod:`adaclip.accounting._min_separation`. This module's argument below is banded noise's.)

The release at step ``t`` adds ``σ·x_t`` to the clipped sum. With **independent** noise
``x_t = z_t``, a fresh standard normal per step (DP-SGD). With **banded** noise (amplified
banded matrix factorisation, "BandMF") the vector of all steps' noise is ``x = C⁻¹ z`` for a
lower-triangular Toeplitz matrix ``C`` with ``b`` bands, coefficients ``c_0 > 0, c_1, …,
c_{b−1}`` and unit norm ``‖c‖₂ = 1``. Because ``C`` is lower triangular, ``C x = z`` can be
solved one step at a time:

.. math::  x_t = \\Big(z_t - \\sum_{j=1}^{b-1} c_j\\, x_{t-j}\\Big) \\Big/ c_0 ,

which needs the last ``b − 1`` noise vectors (``(b − 1)·d`` numbers, the *buffers*). The
noise is anti-correlated across steps, so what training integrates (prefix sums of the
releases, momentum, Adam's moments) carries less noise than with independent draws.

**Privacy argument.** Multiply the releases ``y = G + σ C⁻¹ z`` by ``C``: ``C y = C G + σ z``,
a Gaussian mechanism on ``C G`` — post-processing in both directions, so the two are equally
private. One unit's participation at step ``s`` changes column ``s`` of ``C G`` by at most the
clip norm times the column's norm, ``≤ ‖c‖₂ = 1`` (columns near the end are truncated, hence
shorter). Column ``s`` touches rows ``s … s + b − 1`` only. Under **cyclic Poisson sampling**
(every unit is assigned to one of ``b`` groups independently and uniformly at random; step
``t`` samples only group ``t mod b``, each of its units with probability ``p = b·q``) two
participations of a unit are at least ``b`` steps apart, so they touch disjoint rows, and the
whole run is accounted as ``⌈T/b⌉`` compositions of the Poisson-subsampled Gaussian mechanism
with rate ``p`` and noise multiplier ``σ`` (Choquette-Choo et al., *Amplified banded matrix
factorization*, NeurIPS 2023). With ``b = 1``, ``c = [1]``: ``x_t = z_t``, ``p = q`` and ``T``
compositions — DP-SGD exactly, draw for draw.

What must hold for that argument, and is checked here or by the callers: ``‖c‖₂ = 1`` and
``c_0 > 0`` (no further scaling of the noise by ``‖c‖``); ``b·q ≤ 1``; the sampler is the
cyclic Poisson one with the same ``b`` (a shuffling loader or plain Poisson sampling lets a
unit participate twice within ``b`` steps); the buffers are as secret as the generator's
state (they are past noise: subtracting them from past releases reveals past clipped sums);
a buffer that is lost (a restart without them) must start a new accounting cycle.

**Statistics.** Strategies that learn from the release (AdaCliP) subtract the known noise
variance. The per-coordinate variance of ``x_t`` is ``v_t = Σ_{k≤t} r_k²`` where ``r`` are the
coefficients of ``C⁻¹`` (:meth:`BandedNoise.variance`); it is 1 for independent noise and
above 1 for banded noise.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from adaclip.accounting._cyclic import _check_bands, accounted_sample_rate, accounted_steps
from adaclip.correlated import blt as _blt
from adaclip.correlated.coefficients import sqrt_toeplitz_coefficients
from adaclip.correlated.contract import NoiseStreamState, SamplerRequirement, is_noise_family
from adaclip.errors import InvalidHyperparameterError

__all__ = [
    "NOISE_MECHANISMS",
    "BandedNoise",
    "CycleAccounting",
    "NoiseStreamState",
    "accounted_sample_rate",
    "accounted_steps",
    "check_coefficients",
    "independent",
    "resolve_noise_mechanism",
]

NOISE_MECHANISMS = ("independent", "banded", "blt")

Array = Any


def check_coefficients(coefficients: Any) -> tuple[float, ...]:
    """Validate banded Toeplitz coefficients ``c_0 … c_{b−1}``: 1-d, finite, ``c_0 > 0`` and
    unit norm (to 1e-9; the norm is the sensitivity, so it is checked, never rescaled here).
    Returns them as a tuple of floats."""
    try:
        c = np.asarray(coefficients, dtype=np.float64)
    except (TypeError, ValueError):
        raise InvalidHyperparameterError(f"coefficients must be a 1-d sequence of numbers, got {coefficients!r}") from None
    if c.ndim != 1 or c.size == 0:
        raise InvalidHyperparameterError(f"coefficients must be a non-empty 1-d sequence, got shape {c.shape}")
    if not np.all(np.isfinite(c)):
        raise InvalidHyperparameterError(f"coefficients must be finite, got {c.tolist()}")
    if c[0] <= 0:
        raise InvalidHyperparameterError(f"the first coefficient c_0 must be > 0, got {c[0]!r}")
    norm = float(np.linalg.norm(c))
    if abs(norm - 1.0) > 1e-9:
        raise InvalidHyperparameterError(
            f"coefficients must have unit norm (it is the sensitivity of one participation), got "
            f"‖c‖ = {norm!r}; divide them by their norm"
        )
    return tuple(float(v) for v in c)


class CycleAccounting(NamedTuple):
    """The accounting of noise whose records all carry the noise multiplier ``σ``: one record at
    rate ``rate`` at the first step of each cycle of ``cycle`` steps
    (:class:`adaclip.correlated.contract.NoiseAccounting`)."""

    rate: float
    cycle: int

    def noise_multiplier(self, sigma: float, start: int) -> float:
        """``σ``, whatever the cycle."""
        return sigma


class BandedNoise:
    """Banded Toeplitz correlated noise (``b = 1``: independent noise, DP-SGD).

    Args:
      coefficients: ``c_0 … c_{b−1}``, unit norm, ``c_0 > 0`` (see
        :mod:`adaclip.correlated.coefficients` for optimised ones). ``b = len(coefficients)``.

    The maths and the privacy argument are in the module docstring. Pure functions over the
    array API: :meth:`init` and :meth:`correlate` work on NumPy, PyTorch and JAX arrays alike.
    """

    family = "banded"
    size_label = "bands"

    def __init__(self, coefficients: Sequence[float]) -> None:
        self.coefficients = check_coefficients(coefficients)
        self._variances = np.ones(0)

    @property
    def bands(self) -> int:
        """``b``, the number of bands."""
        return len(self.coefficients)

    # ------------------------------------------------------------ the noise contract
    # (adaclip.correlated.contract.NoiseFamily: the sampler, the accounting, the checkpoint rule)

    @property
    def size(self) -> int:
        """The family's order: ``b``."""
        return self.bands

    @property
    def state_size(self) -> int:
        """The buffers a running stream holds at most: the last ``b − 1`` noise vectors."""
        return self.bands - 1

    @property
    def sampler_requirement(self) -> SamplerRequirement:
        """Cyclic Poisson sampling over ``b`` groups (with ``b = 1``: Poisson sampling, the same
        draws): two participations of a unit are then at least ``b`` steps apart."""
        return SamplerRequirement("cyclic_poisson", self.bands)

    def accounting(self, sample_rate: float, *, separation: int | None = None) -> CycleAccounting:
        """``⌈T/b⌉`` compositions of the Poisson-subsampled Gaussian at rate ``p = b·q``
        (:func:`accounted_sample_rate`; refuses ``b·q > 1``), one at the first step of each
        cycle of ``b`` steps, with noise multiplier ``σ``. ``separation`` is not used."""
        return CycleAccounting(rate=accounted_sample_rate(sample_rate, self.bands), cycle=self.bands)

    def saved_buffers(self, stream_step: int) -> int:
        """The buffers a stream holds after ``stream_step`` steps: ``min(t, b − 1)``."""
        return min(stream_step, self.bands - 1)

    def checkpoint_tag(self) -> dict[str, Any]:
        """What a saved stream carries to say which noise made it: ``{"bands": b}``."""
        return {"bands": self.bands}

    @property
    def name(self) -> str:
        return "independent" if self.bands == 1 else "banded"

    def __repr__(self) -> str:
        return f"BandedNoise(bands={self.bands})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BandedNoise) and other.coefficients == self.coefficients

    def __hash__(self) -> int:
        return hash(self.coefficients)

    def init(self) -> NoiseStreamState:
        """The state of a stream that has produced nothing (empty buffers)."""
        return NoiseStreamState(history=(), step=0)

    def correlate(self, state: NoiseStreamState, z: Sequence[Array]) -> tuple[list[Array], NoiseStreamState]:
        """``x_t = (z_t − Σ_{j≥1} c_j x_{t−j}) / c_0`` for each array of ``z`` (the step's fresh
        standard normals, one array per parameter tensor). Returns ``x_t`` and the next state.

        With ``b = 1`` this returns ``z`` itself, unchanged (bit for bit DP-SGD)."""
        if self.bands == 1:
            return list(z), NoiseStreamState(history=(), step=state.step + 1)
        c = self.coefficients
        x = []
        for k, zk in enumerate(z):
            acc = zk
            for j, past in enumerate(state.history, start=1):
                acc = acc - c[j] * past[k]
            x.append(acc / c[0])
        history = ((*x,), *state.history)[: self.bands - 1]
        return x, NoiseStreamState(history=tuple(history), step=state.step + 1)

    def inverse_coefficients(self, n: int) -> np.ndarray:
        """The first ``n`` coefficients ``r`` of ``C⁻¹`` (lower-triangular Toeplitz):
        ``r_0 = 1/c_0``, ``r_k = −(Σ_{j=1}^{min(k, b−1)} c_j r_{k−j}) / c_0`` — the impulse
        response of the recursive filter ``1/c(z)``."""
        import scipy.signal  # lazy: SciPy costs 1-2 s at import; only filtering coefficients needs it

        impulse = np.zeros(max(int(n), 0))
        if impulse.size:
            impulse[0] = 1.0
        return scipy.signal.lfilter([1.0], np.asarray(self.coefficients), impulse)

    def variance(self, step: int) -> float:
        """``v_t = Σ_{k≤t} r_k²``, the per-coordinate variance of ``x_t`` (``t`` counted from the
        stream's start); 1 for ``b = 1``. Computed up to ``t`` (at least 1 024 steps ahead) and
        cached."""
        if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
            raise InvalidHyperparameterError(f"step must be a non-negative int, got {step!r}")
        t = int(step)
        if self.bands == 1:
            return 1.0
        if t >= len(self._variances):
            r = self.inverse_coefficients(max(t + 1, 2 * len(self._variances), 1024))
            self._variances = np.cumsum(r * r)
        return float(self._variances[t])


def resolve_noise_mechanism(
    noise_mechanism: Any = "independent",
    bands: Any = None,
    *,
    buffers: Any = None,
    steps: Any = None,
    min_separation: Any = None,
) -> Any:
    """The mechanism a plugin keyword asks for: ``None`` for ``"independent"`` (DP-SGD's fresh
    noise), a :class:`BandedNoise` with the truncated square-root coefficients for ``"banded"``
    with ``bands=b`` (``b = 1`` included: the caller decides whether one band takes the
    independent path), or a given :class:`BandedNoise` (e.g. optimised coefficients; ``bands``,
    if given, must agree), or any other object implementing
    :class:`adaclip.correlated.contract.NoiseFamily` (passed through). ``"blt"``: :func:`adaclip.correlated.blt.fit_blt` with ``buffers``
    (default :data:`~adaclip.correlated.blt.DEFAULT_BLT_BUFFERS`) for ``steps`` steps and
    ``min_separation`` (both public, both required), or a given
    :class:`~adaclip.correlated.blt.BltNoise` (``buffers``, if given, must agree). Raises
    :class:`InvalidHyperparameterError` otherwise."""
    if isinstance(noise_mechanism, _blt.BltNoise) or (isinstance(noise_mechanism, str) and noise_mechanism == "blt"):
        if bands is not None:
            raise InvalidHyperparameterError("bands= is for noise_mechanism='banded'; BLT noise takes buffers=")
        if isinstance(noise_mechanism, _blt.BltNoise):
            if buffers is not None and buffers != noise_mechanism.buffers:
                raise InvalidHyperparameterError(
                    f"buffers={buffers!r} disagrees with the given mechanism's {noise_mechanism.buffers} buffers"
                )
            return noise_mechanism
        if steps is None or min_separation is None:
            raise InvalidHyperparameterError(
                "noise_mechanism='blt' fits its factor for the run: it needs the number of steps and the "
                "min separation (the batches per epoch of a FixedOrderBatchSampler, given num_steps=), "
                "or pass an adaclip.correlated.blt.BltNoise (fit_blt(n, buffers=m, min_separation=b))"
            )
        m = _blt.DEFAULT_BLT_BUFFERS if buffers is None else buffers
        return _blt.fit_blt(steps, buffers=m, min_separation=min_separation)
    if buffers is not None:
        raise InvalidHyperparameterError("buffers= is for noise_mechanism='blt'")
    if isinstance(noise_mechanism, BandedNoise):
        if bands is not None and bands != noise_mechanism.bands:
            raise InvalidHyperparameterError(
                f"bands={bands!r} disagrees with the given mechanism's {noise_mechanism.bands} bands"
            )
        return noise_mechanism
    if isinstance(noise_mechanism, str) and noise_mechanism == "independent":
        if bands is not None and bands != 1:
            raise InvalidHyperparameterError(
                f"bands={bands!r} needs noise_mechanism='banded' (independent noise has one band)"
            )
        return None
    if isinstance(noise_mechanism, str) and noise_mechanism == "banded":
        if bands is None:
            raise InvalidHyperparameterError(
                "noise_mechanism='banded' needs bands=b, chosen before training from public quantities "
                "(adaclip.correlated.coefficients.choose_bands picks it; make_private does when bands=None)"
            )
        return BandedNoise(sqrt_toeplitz_coefficients(_check_bands(bands)))
    if is_noise_family(noise_mechanism):  # another family (adaclip.correlated.contract)
        if bands is not None:
            raise InvalidHyperparameterError(
                f"bands= is for noise_mechanism='banded', not for {type(noise_mechanism).__name__}"
            )
        return noise_mechanism
    raise InvalidHyperparameterError(
        "noise_mechanism must be 'independent', 'banded', 'blt', an adaclip.correlated.BandedNoise, an "
        "adaclip.correlated.blt.BltNoise or another adaclip.correlated.contract.NoiseFamily, "
        f"got {noise_mechanism!r}"
    )


def independent() -> BandedNoise:
    """DP-SGD's noise: ``b = 1``, ``c = [1]``."""
    return BandedNoise([1.0])
