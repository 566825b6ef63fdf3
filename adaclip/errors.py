"""Exceptions raised by adaclip.

Every error that adaclip raises for bad input is a subclass of :class:`AdaClipError`, so a
training loop can catch them all at once. Each one is raised *before* any state is touched:
the optimizer, the AdaCliP statistics and the accountant are exactly as they were.
"""

from __future__ import annotations

__all__ = [
    "AdaClipError",
    "InvalidHyperparameterError",
    "InvalidGradientError",
    "BudgetExceededError",
    "NoiseDominatedWarning",
    "NoiseReplayWarning",
]


class AdaClipError(Exception):
    """Base class of every adaclip error."""


class InvalidHyperparameterError(AdaClipError, ValueError):
    """A hyperparameter is out of range, of the wrong type, or inconsistent with another.

    The message names the hyperparameter and the value it received.
    """


class InvalidGradientError(AdaClipError, ValueError):
    """Per-unit gradients that cannot be privatised: NaN/inf, wrong shapes, an empty batch
    where one is not allowed, or a mismatch with the state."""


class BudgetExceededError(AdaClipError, RuntimeError):
    """The step would spend more privacy than the accountant's budget allows.

    Raised before the step; nothing (parameters, statistics, accountant) has changed.
    """


class NoiseDominatedWarning(UserWarning):
    """AdaCliP's std estimates would follow the noise rather than the gradients.

    Raised (as a warning, not an error) when the noise drift number
    ``κ = 2φ(1)·d·σ²/B̄²`` (:func:`adaclip.strategies.noise_drift_number`) exceeds 1 for an
    AdaCliP run. In the utility benchmark (``benchmarks/RESULTS.md``) AdaCliP was behind flat
    clipping in nearly every such setting; flat clipping, or a larger expected batch size, is
    the better choice there. Silence it with ``warnings.simplefilter("ignore", NoiseDominatedWarning)``.
    """


class NoiseReplayWarning(UserWarning):
    """A restored checkpoint will replay noise that has already been used.

    Raised when a *seeded* noise generator (an explicit ``seed``) is restored from a
    checkpoint: the steps after the restore draw exactly the noise of the steps that followed
    the checkpoint the first time. If anything released by those first steps (parameters,
    gradients, logs) was kept or seen, a replay on different data lets the difference of two
    releases cancel the noise. Use seeded restores only for bit-for-bit reproduction of the
    *same* run, or build the optimizer without a seed (its generator is then re-seeded from
    the OS on restore) or with ``secure_mode=True``.
    """
