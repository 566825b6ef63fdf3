"""Per-step hyperparameter schedules: noise decay and (C, σ) retuning (as in eDP-SGD and DP-FedAvg).

A schedule maps a step number ``t`` (0-based, counting optimizer steps) to the
:class:`StepHyperparameters` of that step: the noise multiplier ``σ_t`` and, for strategies
with a clip norm, an optional new ``C_t``. The plugins ask the schedule once per step, record
``(q, σ_t)`` with the accountant, and apply ``C_t`` with :func:`apply_to_strategy`.

Noise decay (eDP-SGD): ``σ_t = σ_0 · d(e)`` with ``e = t // steps_per_epoch`` and
``d(e) = 1/(1 + τe)`` (linear) or ``exp(−τe)`` (exponential).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple, Protocol, runtime_checkable

from adaclip.errors import InvalidHyperparameterError
from adaclip.options import finite_positive, positive_int

__all__ = [
    "StepHyperparameters",
    "Schedule",
    "ConstantSchedule",
    "LinearNoiseDecay",
    "ExponentialNoiseDecay",
    "Retune",
    "apply_to_strategy",
]


class StepHyperparameters(NamedTuple):
    """The hyperparameters of one step: ``σ_t`` and the clip norm ``C_t`` (``None``: keep)."""

    noise_multiplier: float
    max_grad_norm: float | None = None


@runtime_checkable
class Schedule(Protocol):
    """Anything with ``at(step) -> StepHyperparameters``."""

    def at(self, step: int) -> StepHyperparameters: ...


def _nonnegative(name: str, value: Any) -> float:
    return finite_positive(name, value, allow_zero=True)


def _optional_clip(value: Any) -> float | None:
    if value is None:
        return None
    x = _nonnegative("max_grad_norm", value)
    if x == 0:
        raise InvalidHyperparameterError("max_grad_norm must be > 0, got 0")
    return x


def _step(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, (int,)) and not hasattr(step, "__index__"):
        raise InvalidHyperparameterError(f"step must be an integer, got {step!r}")
    t = int(step)
    if t < 0:
        raise InvalidHyperparameterError(f"step must be >= 0, got {t}")
    return t


@dataclasses.dataclass(frozen=True)
class ConstantSchedule:
    """``σ_t = noise_multiplier`` (and ``C_t = max_grad_norm`` if given) for every step."""

    noise_multiplier: float
    max_grad_norm: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "noise_multiplier", _nonnegative("noise_multiplier", self.noise_multiplier))
        object.__setattr__(self, "max_grad_norm", _optional_clip(self.max_grad_norm))

    def at(self, step: int) -> StepHyperparameters:
        _step(step)
        return StepHyperparameters(self.noise_multiplier, self.max_grad_norm)


@dataclasses.dataclass(frozen=True)
class _EpochDecay:
    """``σ_t = σ_0 · d(e)`` with ``e = t // steps_per_epoch``; subclasses give ``d``."""

    initial_noise_multiplier: float
    decay_rate: float
    steps_per_epoch: int
    max_grad_norm: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "initial_noise_multiplier", _nonnegative("initial_noise_multiplier", self.initial_noise_multiplier)
        )
        object.__setattr__(self, "decay_rate", _nonnegative("decay_rate", self.decay_rate))
        object.__setattr__(self, "steps_per_epoch", positive_int("steps_per_epoch", self.steps_per_epoch))
        object.__setattr__(self, "max_grad_norm", _optional_clip(self.max_grad_norm))

    def decay(self, epoch: int) -> float:
        raise NotImplementedError

    def at(self, step: int) -> StepHyperparameters:
        epoch = _step(step) // self.steps_per_epoch
        return StepHyperparameters(self.initial_noise_multiplier * self.decay(epoch), self.max_grad_norm)


@dataclasses.dataclass(frozen=True)
class LinearNoiseDecay(_EpochDecay):
    """``σ_t = σ_0 / (1 + τ·e)``, ``e = t // steps_per_epoch`` (eDP-SGD's linear decay)."""

    def decay(self, epoch: int) -> float:
        return 1.0 / (1.0 + self.decay_rate * epoch)


@dataclasses.dataclass(frozen=True)
class ExponentialNoiseDecay(_EpochDecay):
    """``σ_t = σ_0 · exp(−τ·e)``, ``e = t // steps_per_epoch`` (eDP-SGD's exponential decay)."""

    def decay(self, epoch: int) -> float:
        return math.exp(-self.decay_rate * epoch)


@dataclasses.dataclass(frozen=True)
class Retune:
    """Follow ``before`` until ``at_step``, then retune ``(C, σ)`` together (as McMahan et al. 2018 do).

    From ``at_step`` on, the schedule is ``after`` if given, else ``before`` with
    ``noise_multiplier`` and/or ``max_grad_norm`` overridden. Retunes chain:
    ``Retune(Retune(s, at_step=100, ...), at_step=200, ...)``.
    """

    before: Schedule
    at_step: int
    noise_multiplier: float | None = None
    max_grad_norm: float | None = None
    after: Schedule | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.before, Schedule):
            raise InvalidHyperparameterError(f"before must be a schedule, got {self.before!r}")
        if self.after is not None and not isinstance(self.after, Schedule):
            raise InvalidHyperparameterError(f"after must be a schedule, got {self.after!r}")
        object.__setattr__(self, "at_step", positive_int("at_step", self.at_step))
        if self.noise_multiplier is not None:
            object.__setattr__(self, "noise_multiplier", _nonnegative("noise_multiplier", self.noise_multiplier))
        object.__setattr__(self, "max_grad_norm", _optional_clip(self.max_grad_norm))
        if self.after is None and self.noise_multiplier is None and self.max_grad_norm is None:
            raise InvalidHyperparameterError(
                "Retune needs noise_multiplier, max_grad_norm or an after schedule"
            )

    def at(self, step: int) -> StepHyperparameters:
        t = _step(step)
        if t < self.at_step:
            return self.before.at(t)
        if self.after is not None:
            return self.after.at(t)
        base = self.before.at(t)
        return StepHyperparameters(
            base.noise_multiplier if self.noise_multiplier is None else self.noise_multiplier,
            base.max_grad_norm if self.max_grad_norm is None else self.max_grad_norm,
        )


def apply_to_strategy(strategy: Any, hyperparameters: StepHyperparameters) -> Any:
    """The strategy with this step's clip norm applied (unchanged when ``C_t`` is ``None``).

    Raises :class:`InvalidHyperparameterError` if the schedule sets ``C_t`` for a strategy
    without a single clip norm (AdaCliP adapts its own; per-layer with explicit per-group
    norms has no single ``C``).
    """
    if hyperparameters.max_grad_norm is None:
        return strategy
    if getattr(strategy, "adapts_clip_norm", False):
        raise InvalidHyperparameterError(
            f"the schedule sets max_grad_norm, but {type(strategy).__name__} adapts its clip norm with "
            "the quantile rule (max_grad_norm is only its initial value): drop one of the two"
        )
    if getattr(strategy, "max_grad_norm", None) is None:
        raise InvalidHyperparameterError(
            f"the schedule sets max_grad_norm, but {type(strategy).__name__} has no single clip norm"
        )
    return dataclasses.replace(strategy, max_grad_norm=hyperparameters.max_grad_norm)
