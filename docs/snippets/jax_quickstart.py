"""AdaCliP as the first element of an optax chain, per-example gradients, a jitted step."""
import jax
import jax.numpy as jnp
import optax

import adaclip_jax


def example_loss(params, x, y):
    """Loss of ONE example: x has shape (20,), y is a scalar label."""
    logits = jnp.tanh(x @ params["w1"] + params["b1"]) @ params["w2"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y)


k1, k2, kx, ky = jax.random.split(jax.random.key(0), 4)
params = {"w1": 0.3 * jax.random.normal(k1, (20, 16)), "b1": jnp.zeros(16),
          "w2": 0.3 * jax.random.normal(k2, (16, 3))}

tx = optax.chain(
    adaclip_jax.adaclip(noise_multiplier=1.1, expected_batch_size=32, key=jax.random.key(42),
                        std_min=1e-5, std_max=1e-2, preset="patent"),
    optax.adam(1e-3),
)
opt_state = tx.init(params)
grads_fn = adaclip_jax.per_example_grads(example_loss, batch_argnums=(1, 2))


@jax.jit
def train_step(params, opt_state, x, y):
    per_example = grads_fn(params, x, y)          # every leaf gets a leading axis of 32
    updates, opt_state = tx.update(per_example, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


x = jax.random.normal(kx, (32, 20))
y = jax.random.randint(ky, (32,), 0, 3)
adaclip_jax.check_inputs(grads_fn(params, x, y), params)   # eager NaN/shape check (optional)
for _ in range(5):
    params, opt_state = train_step(params, opt_state, x, y)
print("steps:", int(opt_state[0].step), "| w1 shape:", params["w1"].shape)
