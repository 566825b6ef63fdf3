"""Large logical batches: clip each physical batch, add the clipped sums, release once.

optax.MultiSteps around the private transformation is refused (it would average raw,
unclipped per-example gradients); this is the accumulation that keeps the mechanism intact.
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax

import adaclip.accounting
import adaclip.errors
import adaclip_jax


def example_loss(params, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(x @ params["w"], y)


N, logical, physical = 4096, 512, 128          # q = 512/4096; at most 128 examples in memory
params = {"w": jnp.zeros((20, 3))}
private = adaclip_jax.flat_clip(max_grad_norm=1.0, noise_multiplier=1.0,
                                expected_batch_size=logical, key=jax.random.key(0))
tx = adaclip_jax.private_chain(private, optax.sgd(0.5))
opt_state = tx.init(params)
clip = jax.jit(adaclip_jax.clipped_sum_grads(example_loss, private, batch_argnums=(1, 2)))
release = jax.jit(tx.update)
accountant = adaclip.accounting.Accountant()

try:                                            # the habit from optax, refused with a pointer
    optax.MultiSteps(adaclip_jax.private_chain(private, optax.sgd(0.5)), 4).init(params)
except adaclip.errors.InvalidHyperparameterError as err:
    print("MultiSteps:", str(err)[:60], "...")

rng = np.random.default_rng(0)
x = rng.normal(size=(N, 20)).astype(np.float32)
y = rng.integers(0, 3, size=N)
for _ in range(3):
    batch = np.flatnonzero(rng.random(N) < logical / N)        # one Poisson logical batch
    chunks = max(1, -(-batch.size // physical))                 # ceil; an empty batch is one chunk
    total = None
    for c in range(chunks):                                     # physical batches of 128 rows
        rows = batch[c * physical:(c + 1) * physical]
        mask = np.arange(physical) < rows.size                  # pad to one shape: no recompiles
        rows = np.resize(rows, physical) if rows.size else np.zeros(physical, int)
        part = clip(opt_state[0], params, x[rows], y[rows], unit_mask=mask)  # same state each time
        total = part if total is None else adaclip_jax.add_clipped_sums(total, part)
    updates, opt_state = release(total, opt_state, params)      # noise once, one step
    params = optax.apply_updates(params, updates)
    accountant.step(sample_rate=logical / N, noise_multiplier=1.0)  # the logical batch's q
print("steps:", int(opt_state[0].step), "| eps:", round(accountant.epsilon(1e-5), 3))
