"""Banded correlated noise in JAX: the plan (b, σ, Adam's lr factor), cyclic Poisson batches
padded to a few fixed sizes, the buffers in the state, ⌈T/b⌉ records."""
import jax
import jax.numpy as jnp
import numpy as np
import optax

import adaclip_jax
from adaclip.accounting import Accountant
from adaclip.correlated import plan_banded_noise


def example_loss(params, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(x @ params["w"] + params["b"], y)


N, q, steps = 500, 0.05, 40
rng = np.random.default_rng(0)
x_all = jnp.asarray(rng.standard_normal((N, 20)), jnp.float32)
y_all = jnp.asarray(rng.integers(0, 3, N))
params = {"w": jnp.zeros((20, 3)), "b": jnp.zeros(3)}

# before training, from public quantities only: b, σ_b for ⌈T/b⌉ compositions at rate p = b·q,
# the coefficients, and Adam's learning-rate factor ρ (what make_private does in PyTorch)
plan = plan_banded_noise(target_epsilon=2.0, delta=1e-5, sample_rate=q, steps=steps,
                         workload="momentum", momentum=0.9, adaptive_optimizer=True)
bands, sigma, p = plan.bands, plan.noise_multiplier, plan.accounted_sample_rate
private = adaclip_jax.adaclip(noise_multiplier=sigma, expected_batch_size=q * N, key=jax.random.key(1),
                              noise_mechanism=plan.noise)
tx = adaclip_jax.private_chain(private, optax.adam(1e-2 * plan.lr_scale))
opt_state = tx.init(params)                        # opt_state[0].noise_buffers: b − 1 zero buffers
grads_fn = adaclip_jax.per_example_grads(example_loss, batch_argnums=(1, 2))

sampling_key = jax.random.key(2)                   # secret, and not the noise key
groups = adaclip_jax.assign_groups(sampling_key, N, bands)   # once per run
buckets = adaclip_jax.batch_buckets(q * N, N)      # the fixed batch sizes a step may have


@jax.jit                                           # compiles once per bucket used
def train_step(params, opt_state, x, y, mask, *, noise_multiplier):
    grads = grads_fn(params, x, y)                 # the padded batch: a bucket's rows, not N
    updates, opt_state = tx.update(grads, opt_state, params,
                                   noise_multiplier=noise_multiplier, unit_mask=mask)
    return optax.apply_updates(params, updates), opt_state


tracker = adaclip_jax.PrivacyTracker(Accountant(target_epsilon=2.0, delta=1e-5),
                                     sample_rate=q, noise_multiplier=sigma, bands=bands)
for _ in range(steps):
    step = int(opt_state[0].step)                  # the release's step: its group is step mod b
    indices, mask = adaclip_jax.padded_batch(sampling_key, step, groups, p, bands=bands, buckets=buckets)
    params, opt_state = tracker.step(train_step, params, opt_state, x_all[indices], y_all[indices], mask)
print(f"b = {bands}, sigma = {sigma:.3f}, lr factor {plan.lr_scale:.2f}, {tracker.steps} steps, {tracker.accountant.steps} compositions at rate "
      f"{tracker.accounted_sample_rate}, epsilon = {tracker.epsilon(1e-5):.3f}")
assert tracker.accountant.steps == plan.compositions and tracker.epsilon(1e-5) <= 2.0
