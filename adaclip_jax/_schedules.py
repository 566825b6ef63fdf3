"""The core's noise schedules (:mod:`adaclip.schedules`) as ``jnp`` functions of the step.

``schedule.at(step)`` takes a Python int, so it cannot run under ``jax.jit``. :func:`noise_schedule`
returns the same ``σ_t`` as a traceable function of an integer array, to pass as the
``noise_multiplier`` of a transformation. (With :class:`adaclip_jax.PrivacyTracker`, σ_t is
computed in Python and passed to the step instead; both give the same values.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from adaclip import schedules as _schedules
from adaclip.errors import InvalidHyperparameterError

__all__ = ["noise_schedule"]


def noise_schedule(schedule: Any) -> Callable[[jax.Array], jax.Array]:
    """``step -> σ_t`` in ``jnp`` for a :mod:`adaclip.schedules` schedule (float32 result).

    Supports ``ConstantSchedule``, ``LinearNoiseDecay`` (``σ_0/(1 + τ·e)``),
    ``ExponentialNoiseDecay`` (``σ_0·exp(−τ·e)``), ``e = step // steps_per_epoch``, and
    ``Retune`` (``before`` until ``at_step``, then ``after`` or the overridden σ). A clip-norm
    retune (``max_grad_norm``) is not supported under ``jit`` and raises.
    """
    if isinstance(schedule, _schedules.ConstantSchedule):
        sigma = schedule.noise_multiplier
        return lambda step: jnp.full((), sigma, jnp.float32)
    if isinstance(schedule, (_schedules.LinearNoiseDecay, _schedules.ExponentialNoiseDecay)):
        s0, tau, spe = schedule.initial_noise_multiplier, schedule.decay_rate, schedule.steps_per_epoch
        linear = isinstance(schedule, _schedules.LinearNoiseDecay)

        def decay(step):
            epoch = (jnp.asarray(step) // spe).astype(jnp.float32)
            factor = 1.0 / (1.0 + tau * epoch) if linear else jnp.exp(-tau * epoch)
            return (s0 * factor).astype(jnp.float32)

        return decay
    if isinstance(schedule, _schedules.Retune):
        if schedule.max_grad_norm is not None:
            raise InvalidHyperparameterError(
                "Retune with max_grad_norm changes the clip norm, which the JAX transformations "
                "fix at construction; build a new transformation at the retune step instead"
            )
        before = noise_schedule(schedule.before)
        if schedule.after is not None:
            after = noise_schedule(schedule.after)
        elif schedule.noise_multiplier is not None:
            sigma = schedule.noise_multiplier
            after = lambda step: jnp.full((), sigma, jnp.float32)  # noqa: E731
        else:  # pragma: no cover - Retune validates that one of them is set
            after = before
        at = schedule.at_step
        return lambda step: jnp.where(jnp.asarray(step) < at, before(step), after(step))
    raise InvalidHyperparameterError(f"unsupported noise schedule {schedule!r}")
