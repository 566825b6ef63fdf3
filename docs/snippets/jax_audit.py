"""Audit a JAX/optax training run with white-box gradient canaries."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits

import adaclip_jax
from adaclip.accounting import Accountant, calibrate_noise_multiplier
from adaclip_jax.audit import GradientCanaryAuditor


def example_loss(params, x, y):
    logits = jnp.tanh(x @ params["w1"] + params["b1"]) @ params["w2"] + params["b2"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y)


x, y = load_digits(return_X_y=True)
x, y = jnp.asarray(x[:1200] / 16.0, jnp.float32), jnp.asarray(y[:1200])
N, q, steps = 1200, 100 / 1200, 120
sigma = calibrate_noise_multiplier(target_epsilon=3.0, delta=1e-5, sample_rate=q, steps=steps)
k1, k2 = jax.random.split(jax.random.key(0))
params = {"w1": 0.1 * jax.random.normal(k1, (64, 32)), "b1": jnp.zeros(32),
          "w2": 0.1 * jax.random.normal(k2, (32, 10)), "b2": jnp.zeros(10)}

# While auditing, keep the private transformation apart from the rest of the chain: the
# auditor reads the noisy gradient it releases.
private = adaclip_jax.adaclip(noise_multiplier=sigma, expected_batch_size=q * N,
                              key=jax.random.key(1), initial_max_grad_norm=1.0)
momentum = optax.sgd(0.5, momentum=0.9)
private_state, momentum_state = private.init(params), momentum.init(params)
auditor = GradientCanaryAuditor(private, params, num_canaries=1000, seed=2, sample_rate=q)
accountant = Accountant("pld")
grads_fn = jax.jit(adaclip_jax.per_example_grads(example_loss, batch_argnums=(1, 2)))
release = jax.jit(lambda g, s, m: private.update(g, s, params, unit_mask=m))

rng = np.random.default_rng(3)
padded = 160   # Poisson batches padded to a static size (B̄ = 100: more than 160 is a 6σ event)
for _ in range(steps):
    idx = np.flatnonzero(rng.random(N) < q)[:padded]
    rows = np.zeros(padded, int)
    rows[: len(idx)] = idx
    mask = jnp.asarray(np.arange(padded) < len(idx))
    grads = grads_fn(params, x[rows], y[rows])
    grads, mask = auditor.insert(grads, private_state, unit_mask=mask)   # + this step's canaries
    noisy, private_state = release(grads, private_state, mask)
    auditor.observe(noisy)
    accountant.step(noise_multiplier=sigma, sample_rate=q)
    updates, momentum_state = momentum.update(noisy, momentum_state, params)
    params = optax.apply_updates(params, updates)

report = auditor.report(delta=1e-5, accountant=accountant)
print(report)
assert report.epsilon_lower <= report.accountant_epsilon
