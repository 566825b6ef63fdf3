"""adaclip_jax.PrivacyTracker: every step recorded exactly once with (q, σ used), budget first."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import adaclip_jax
from adaclip.accounting import Accountant
from adaclip.errors import BudgetExceededError, InvalidGradientError, InvalidHyperparameterError
from adaclip.schedules import LinearNoiseDecay

pytestmark = pytest.mark.jax


def used_state(sigma):
    """The AdaClipState a transformation returns after an update that used ``sigma``."""
    return adaclip_jax.AdaClipState(
        step=jnp.ones([], jnp.int32),
        key=jax.random.key(0),
        mean=None,
        std=None,
        nonfinite_steps=jnp.zeros([], jnp.int32),
        last_noise_multiplier=jnp.asarray(sigma, jnp.float32),
        seeded=jnp.asarray(True),
    )


def test_records_each_step_once_with_schedule_sigma():
    acc = Accountant("rdp")
    sched = LinearNoiseDecay(initial_noise_multiplier=2.0, decay_rate=1.0, steps_per_epoch=2)
    tracker = adaclip_jax.PrivacyTracker(acc, sample_rate=0.01, noise_multiplier=sched)
    seen = []

    def fake_step(x, *, noise_multiplier):
        seen.append(float(noise_multiplier))
        return x + 1, used_state(noise_multiplier)

    x = 0
    for _ in range(5):
        x, _ = tracker.step(fake_step, x)
    assert x == 5 and tracker.steps == 5 and acc.steps == 5
    expected = [sched.at(t).noise_multiplier for t in range(5)]
    # σ passed to the step is float32, rounded up (never less noise than accounted).
    assert all(s >= e and s - e < 1e-6 for s, e in zip(seen, expected, strict=True))
    ref = Accountant("rdp")
    for e in expected:
        ref.step(noise_multiplier=e, sample_rate=0.01)
    assert tracker.epsilon(1e-5) == pytest.approx(ref.epsilon(1e-5), rel=1e-12)


def test_budget_checked_before_the_step():
    acc = Accountant("rdp", target_epsilon=1.0, delta=1e-5)
    tracker = adaclip_jax.PrivacyTracker(acc, sample_rate=0.5, noise_multiplier=0.8)
    calls = []
    with pytest.raises(BudgetExceededError):
        for _ in range(1000):
            tracker.step(lambda *, noise_multiplier: (calls.append(1), used_state(noise_multiplier)))
    assert len(calls) == tracker.steps == acc.steps  # the refused step neither ran nor was recorded
    assert acc.epsilon(1e-5) <= 1.0


def test_failed_step_is_recorded_conservatively_and_bad_arguments():
    """A step function that raises may have released something before it failed: the tracker
    records the planned σ, then re-raises."""
    acc = Accountant("rdp")
    tracker = adaclip_jax.PrivacyTracker(acc, sample_rate=0.1, noise_multiplier=1.0)

    def bad(*, noise_multiplier):
        raise InvalidGradientError("boom")

    with pytest.raises(InvalidGradientError, match="boom"):
        tracker.step(bad)
    assert tracker.steps == 1 and acc.history == ((0.1, 1.0, 1),)
    with pytest.raises(InvalidHyperparameterError, match="sample_rate"):
        adaclip_jax.PrivacyTracker(acc, sample_rate=0.0, noise_multiplier=1.0)
    with pytest.raises(InvalidHyperparameterError, match="noise_multiplier"):
        adaclip_jax.PrivacyTracker(acc, sample_rate=0.1, noise_multiplier=-1.0)


def test_state_dict_round_trip():
    tracker = adaclip_jax.PrivacyTracker(Accountant("rdp"), sample_rate=0.1, noise_multiplier=1.0)
    for _ in range(3):
        tracker.step(lambda *, noise_multiplier: used_state(noise_multiplier))
    other = adaclip_jax.PrivacyTracker(Accountant("rdp"), sample_rate=0.1, noise_multiplier=1.0)
    other.load_state_dict(tracker.state_dict())
    assert other.steps == 3 and other.epsilon(1e-5) == pytest.approx(tracker.epsilon(1e-5))


def test_end_to_end_jitted_training_step_uses_tracker_sigma():
    """The σ the tracker accounts is the σ the transformation uses."""
    params = {"w": jnp.zeros((500,))}
    tx = optax.chain(
        adaclip_jax.flat_clip(max_grad_norm=1.0, noise_multiplier=123.0, expected_batch_size=1, key=0),
        optax.sgd(1.0),
    )

    @jax.jit
    def train_step(params, opt_state, grads, *, noise_multiplier):
        updates, opt_state = tx.update(grads, opt_state, params, noise_multiplier=noise_multiplier)
        return optax.apply_updates(params, updates), opt_state

    acc = Accountant("rdp")
    tracker = adaclip_jax.PrivacyTracker(
        acc, sample_rate=0.01, noise_multiplier=lambda t: 0.0 if t == 0 else 2.0
    )
    opt_state = tx.init(params)
    grads = {"w": jnp.zeros((1, 500))}
    p1, opt_state = tracker.step(train_step, params, opt_state, grads)
    assert np.all(np.asarray(p1["w"]) == 0)  # σ_0 = 0, not the constructor's 123
    p2, opt_state = tracker.step(train_step, p1, opt_state, grads)
    assert 1.5 < np.std(np.asarray(p2["w"])) < 2.5  # σ_1 = 2, C = 1, B̄ = 1
    assert [r for r in acc.history]  # recorded
    assert acc.steps == 2
