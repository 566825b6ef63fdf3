"""User-level DP in JAX: per_example_grads(num_units=...) sums each user's examples."""
import jax
import jax.numpy as jnp
import optax

import adaclip_jax


def example_loss(params, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(x @ params["w"], y)


num_users = 8                          # users in this (padded) batch slot
params = {"w": jnp.zeros((20, 3))}
tx = optax.chain(adaclip_jax.flat_clip(max_grad_norm=1.0, noise_multiplier=1.0,
                                       expected_batch_size=4.0,  # expected USERS per step
                                       key=jax.random.key(0)),
                 optax.sgd(0.1))
opt_state = tx.init(params)
grads_fn = adaclip_jax.per_example_grads(example_loss, batch_argnums=(1, 2), num_units=num_users)

kx, ky = jax.random.split(jax.random.key(1))
x = jax.random.normal(kx, (32, 20))
y = jax.random.randint(ky, (32,), 0, 3)
# user of each example; users 6 and 7 have no examples this step; -1 marks a padding row
unit_ids = jnp.array([0, 1, 2, 3, 4, 5] * 5 + [-1, -1])

per_user, unit_mask = grads_fn(params, x, y, unit_ids=unit_ids)
print("per-user gradient shape:", per_user["w"].shape, "| present:", unit_mask.tolist())
updates, opt_state = tx.update(per_user, opt_state, params, unit_mask=unit_mask)
params = optax.apply_updates(params, updates)
