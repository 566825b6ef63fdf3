"""The accountant hook: record every training step exactly once, outside ``jax.jit``.

Accounting is Python-side bookkeeping (``dp-accounting`` is not traceable), so it lives in
the training loop, around the jitted step, not inside the transformation::

    tracker = adaclip_jax.PrivacyTracker(accountant, sample_rate=q, noise_multiplier=schedule)

    @jax.jit
    def train_step(params, opt_state, batch, *, noise_multiplier):
        grads = adaclip_jax.per_example_grads(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params, noise_multiplier=noise_multiplier)
        return optax.apply_updates(params, updates), opt_state

    for batch in batches:
        params, opt_state = tracker.step(train_step, params, opt_state, batch)
        print(tracker.epsilon(1e-5))

:meth:`PrivacyTracker.step` computes ``σ_t`` for the step, checks the budget *before*
running it (raising :class:`~adaclip.errors.BudgetExceededError`, nothing changed), runs the
step with ``noise_multiplier=σ_t`` (so the σ that is accounted is the σ that is used: one
source of truth), and records ``(q, σ_t)`` once it returned. A step that raises is not
recorded.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np

from adaclip.errors import BudgetExceededError, InvalidHyperparameterError
from adaclip.strategies import validate_sample_rate

__all__ = ["PrivacyTracker"]


def _as_sigma(value: Any, step: int) -> float:
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise InvalidHyperparameterError(
            f"the noise schedule returned {value!r} at step {step}; expected a number"
        ) from None
    if not math.isfinite(x) or x < 0:
        raise InvalidHyperparameterError(
            f"noise_multiplier must be finite and >= 0, got {x!r} at step {step}"
        )
    return x


def _float32_at_least(sigma: float) -> jnp.ndarray:
    """``σ`` as a float32 scalar, rounded *up* so the noise used is never below the σ accounted."""
    x = np.float32(sigma)
    if float(x) < sigma:
        x = np.nextafter(x, np.float32(np.inf))
    return jnp.asarray(x, jnp.float32)


class PrivacyTracker:
    """Couples a training loop to an :class:`adaclip.accounting.Accountant`.

    Args:
      accountant: an ``Accountant`` (anything with ``step``, ``would_exceed``, ``epsilon``,
        ``state_dict``, ``load_state_dict``), possibly with a budget (``target_epsilon``).
      sample_rate: ``q``, the probability that a unit joins a step (``B̄/N``).
      noise_multiplier: ``σ``, a schedule from :mod:`adaclip.schedules` (anything with
        ``at(step).noise_multiplier``), or a function ``step -> σ_t`` of a Python int.
      start_step: the index of the first step (to resume; :meth:`load_state_dict` sets it).
    """

    def __init__(self, accountant: Any, *, sample_rate: float, noise_multiplier: Any, start_step: int = 0):
        q = validate_sample_rate(sample_rate)
        if isinstance(start_step, bool) or not isinstance(start_step, int) or start_step < 0:
            raise InvalidHyperparameterError(f"start_step must be an int >= 0, got {start_step!r}")
        if not (hasattr(noise_multiplier, "at") or callable(noise_multiplier)):
            _as_sigma(noise_multiplier, 0)
        self.accountant = accountant
        self.sample_rate = q
        self._schedule = noise_multiplier
        self._steps = start_step

    @property
    def steps(self) -> int:
        """Number of steps recorded (the index of the next step)."""
        return self._steps

    def noise_multiplier_at(self, step: int) -> float:
        """``σ_t`` of step ``step``."""
        s = self._schedule
        if hasattr(s, "at"):
            value = s.at(step).noise_multiplier
        elif callable(s):
            value = s(step)
        else:
            value = s
        return _as_sigma(value, step)

    def check_budget(self) -> float:
        """``σ_t`` of the next step; raises ``BudgetExceededError`` if it would exceed the budget."""
        sigma = self.noise_multiplier_at(self._steps)
        if self.accountant.would_exceed(noise_multiplier=sigma, sample_rate=self.sample_rate):
            raise BudgetExceededError(
                f"step {self._steps} (noise_multiplier={sigma}, sample_rate={self.sample_rate}) "
                "would exceed the privacy budget"
            )
        return sigma

    def step(self, update_fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``update_fn(*args, noise_multiplier=σ_t, **kwargs)`` and record it.

        The budget is checked first (``BudgetExceededError``, nothing run or recorded); the
        step is recorded with the accountant only after ``update_fn`` returned. ``σ_t`` is
        passed as a float32 scalar array (rounded up), so a jitted ``update_fn`` does not recompile when
        ``σ_t`` changes; forward it to ``tx.update(..., noise_multiplier=...)``.
        """
        sigma = self.check_budget()
        result = update_fn(*args, noise_multiplier=_float32_at_least(sigma), **kwargs)
        self.accountant.step(noise_multiplier=sigma, sample_rate=self.sample_rate)
        self._steps += 1
        return result

    def epsilon(self, delta: float) -> float:
        """ε(δ) spent so far."""
        return self.accountant.epsilon(delta)

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self._steps, "accountant": self.accountant.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        steps = state["steps"]
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise InvalidHyperparameterError(f"state['steps'] must be an int >= 0, got {steps!r}")
        self.accountant.load_state_dict(state["accountant"])
        self._steps = steps
