"""adaclip_jax.noise_schedule: the core schedules as jnp functions of the step, under jit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import adaclip_jax
from adaclip.errors import InvalidHyperparameterError
from adaclip.schedules import ConstantSchedule, ExponentialNoiseDecay, LinearNoiseDecay, Retune

pytestmark = pytest.mark.jax

SCHEDULES = [
    ConstantSchedule(1.3),
    LinearNoiseDecay(initial_noise_multiplier=2.0, decay_rate=0.5, steps_per_epoch=3),
    ExponentialNoiseDecay(initial_noise_multiplier=2.0, decay_rate=0.3, steps_per_epoch=4),
    Retune(
        LinearNoiseDecay(initial_noise_multiplier=2.0, decay_rate=0.5, steps_per_epoch=3),
        at_step=7,
        noise_multiplier=0.9,
    ),
    Retune(
        ConstantSchedule(1.0),
        at_step=5,
        after=ExponentialNoiseDecay(initial_noise_multiplier=3.0, decay_rate=0.1, steps_per_epoch=2),
    ),
]


@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: type(s).__name__)
def test_matches_python_schedule_under_jit(schedule):
    fn = jax.jit(jax.vmap(adaclip_jax.noise_schedule(schedule)))
    steps = np.arange(20)
    got = np.asarray(fn(jnp.asarray(steps, jnp.int32)))
    expected = np.array([schedule.at(int(t)).noise_multiplier for t in steps])
    np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_drives_the_transformation():
    params = {"w": jnp.zeros((2000,))}
    sched = Retune(ConstantSchedule(0.0), at_step=1, noise_multiplier=4.0)
    tx = adaclip_jax.flat_clip(
        max_grad_norm=1.0, noise_multiplier=adaclip_jax.noise_schedule(sched), expected_batch_size=2.0, key=0
    )
    state = tx.init(params)
    step = jax.jit(tx.update)
    g = {"w": jnp.zeros((2, 2000))}
    u0, state = step(g, state, params)
    u1, state = step(g, state, params)
    assert np.all(np.asarray(u0["w"]) == 0)
    assert np.std(np.asarray(u1["w"])) == pytest.approx(2.0, rel=0.1)  # C·σ/B̄ = 4/2


def test_unsupported():
    with pytest.raises(InvalidHyperparameterError, match="max_grad_norm"):
        adaclip_jax.noise_schedule(Retune(ConstantSchedule(1.0), at_step=3, max_grad_norm=2.0))
    with pytest.raises(InvalidHyperparameterError, match="unsupported"):
        adaclip_jax.noise_schedule(lambda t: 1.0)
