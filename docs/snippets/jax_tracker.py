"""Poisson sampling with a static shape (unit_mask), a noise schedule and PrivacyTracker."""
import jax
import jax.numpy as jnp
import numpy as np
import optax

import adaclip_jax
from adaclip.accounting import Accountant, calibrate_noise_multiplier
from adaclip.schedules import ConstantSchedule


def example_loss(params, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(x @ params["w"] + params["b"], y)


N, q, steps = 500, 0.1, 30
rng = np.random.default_rng(0)
x_all = jnp.asarray(rng.standard_normal((N, 20)), jnp.float32)
y_all = jnp.asarray(rng.integers(0, 3, N))
params = {"w": jnp.zeros((20, 3)), "b": jnp.zeros(3)}

sigma = calibrate_noise_multiplier(target_epsilon=2.0, delta=1e-5, sample_rate=q, steps=steps)
tx = optax.chain(adaclip_jax.adaclip(noise_multiplier=sigma, expected_batch_size=q * N,
                                     key=jax.random.key(1), std_max=1e-2, preset="patent"),
                 optax.sgd(0.5))
opt_state = tx.init(params)
grads_fn = adaclip_jax.per_example_grads(example_loss, batch_argnums=(1, 2))


@jax.jit
def train_step(params, opt_state, mask, *, noise_multiplier):
    grads = grads_fn(params, x_all, y_all)       # all N rows: a static shape
    updates, opt_state = tx.update(grads, opt_state, params,
                                   noise_multiplier=noise_multiplier, unit_mask=mask)
    return optax.apply_updates(params, updates), opt_state


tracker = adaclip_jax.PrivacyTracker(Accountant(target_epsilon=2.0, delta=1e-5),
                                     sample_rate=q, noise_multiplier=ConstantSchedule(sigma))
for _ in range(steps):
    mask = jnp.asarray(rng.random(N) < q)        # Poisson: each row in with probability q
    params, opt_state = tracker.step(train_step, params, opt_state, mask)
print(f"sigma = {sigma:.3f}, {tracker.steps} steps, epsilon = {tracker.epsilon(1e-5):.3f}")

try:                                             # the budget is spent: the next step is refused
    tracker.step(train_step, params, opt_state, mask)
except Exception as err:
    print(type(err).__name__)
