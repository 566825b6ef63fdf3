"""Memory O(chunk·d): clip and sum chunk by chunk with clipped_sum_grads."""
import jax
import jax.numpy as jnp
import optax

import adaclip_jax


def example_loss(params, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(x @ params["w"], y)


params = {"w": jnp.zeros((20, 3))}
private = adaclip_jax.adaclip(noise_multiplier=1.0, expected_batch_size=256,
                              key=jax.random.key(0), std_max=1e-2, preset="patent")
tx = optax.chain(private, optax.sgd(0.1))
opt_state = tx.init(params)
summed_fn = adaclip_jax.clipped_sum_grads(example_loss, private, micro_batch_size=64,
                                          batch_argnums=(1, 2))


@jax.jit
def train_step(params, opt_state, x, y):
    clipped = summed_fn(opt_state[0], params, x, y)   # the private element's state
    updates, opt_state = tx.update(clipped, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


kx, ky = jax.random.split(jax.random.key(1))
x = jax.random.normal(kx, (256, 20))
y = jax.random.randint(ky, (256,), 0, 3)
params, opt_state = train_step(params, opt_state, x, y)
print("one step from 4 chunks of 64; step =", int(opt_state[0].step))
