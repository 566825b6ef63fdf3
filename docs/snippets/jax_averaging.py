"""A jitted EMA of the parameters in JAX, as pure functions and as the last member of a chain."""
import jax
import jax.numpy as jnp
import optax

import adaclip_jax


def example_loss(params, x, y):
    logits = jnp.tanh(x @ params["w1"]) @ params["w2"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y)


k1, k2, kx, ky = jax.random.split(jax.random.key(0), 4)
params = {"w1": 0.3 * jax.random.normal(k1, (20, 16)), "w2": 0.3 * jax.random.normal(k2, (16, 3))}
x, y = jax.random.normal(kx, (32, 20)), jax.random.randint(ky, (32,), 0, 3)
grads_fn = adaclip_jax.per_example_grads(example_loss, batch_argnums=(1, 2))
steps = 20

# (a) pure init/update over an AveragingState, next to the optimizer state
tx = adaclip_jax.private_chain(
    adaclip_jax.flat_clip(max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=32,
                          key=jax.random.key(42)),
    optax.sgd(0.1),
)
avg = adaclip_jax.parameter_averaging("ema", total_steps=steps)   # H = 10, μ = 0.9
opt_state, avg_state = tx.init(params), avg.init(params)


@jax.jit
def train_step(params, opt_state, avg_state):
    updates, opt_state = tx.update(grads_fn(params, x, y), opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, opt_state, avg.update(avg_state, params)     # after the private step


for _ in range(steps):
    params, opt_state, avg_state = train_step(params, opt_state, avg_state)
eval_params = adaclip_jax.averaged_params(avg_state)

# (b) the same average kept in the optimizer state: the transformation goes LAST
tx_avg = adaclip_jax.private_chain(
    adaclip_jax.flat_clip(max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=32,
                          key=jax.random.key(42)),
    optax.sgd(0.1),
    adaclip_jax.averaging_transformation("ema", total_steps=steps),
)
params_b = {"w1": 0.3 * jax.random.normal(k1, (20, 16)), "w2": 0.3 * jax.random.normal(k2, (16, 3))}
opt_state_b = tx_avg.init(params_b)


@jax.jit
def train_step_b(params, opt_state):
    updates, opt_state = tx_avg.update(grads_fn(params, x, y), opt_state, params)
    return optax.apply_updates(params, updates), opt_state


for _ in range(steps):
    params_b, opt_state_b = train_step_b(params_b, opt_state_b)
same = jax.tree_util.tree_map(jnp.allclose, eval_params, adaclip_jax.averaged_params(opt_state_b))
print("count:", int(avg_state.count), "| (a) and (b) agree:", all(jax.tree_util.tree_leaves(same)))
