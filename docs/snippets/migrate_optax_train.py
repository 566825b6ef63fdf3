"""Before/after: optax.contrib.dpsgd and the equivalent adaclip_jax chain, same loop."""
import jax
import jax.numpy as jnp
import optax

import adaclip_jax


def example_loss(params, x, y):          # the loss of ONE example, as both libraries expect
    return optax.softmax_cross_entropy_with_integer_labels(x @ params["w"] + params["b"], y)


params0 = {"w": jnp.zeros((20, 3)), "b": jnp.zeros(3)}
kx, ky = jax.random.split(jax.random.key(0))
x = jax.random.normal(kx, (64, 20))
y = jax.random.randint(ky, (64,), 0, 3)
grads_fn = jax.vmap(jax.grad(example_loss), in_axes=(None, 0, 0))   # per-example gradients

# --8<-- [start:before]
tx = optax.contrib.dpsgd(learning_rate=0.1, l2_norm_clip=1.0, noise_multiplier=1.1,
                         seed=0, momentum=0.9)
params, opt_state = params0, tx.init(params0)
for _ in range(3):
    updates, opt_state = tx.update(grads_fn(params, x, y), opt_state, params)
    params = optax.apply_updates(params, updates)
# --8<-- [end:before]
before = params

# --8<-- [start:after]
tx = optax.chain(
    adaclip_jax.flat_clip(max_grad_norm=1.0, noise_multiplier=1.1,
                          expected_batch_size=64,        # B̄ = q·N; here the fixed batch size
                          key=jax.random.key(0)),
    optax.sgd(learning_rate=0.1, momentum=0.9),
)
# AdaCliP instead: adaclip_jax.adaclip(noise_multiplier=1.1, expected_batch_size=64,
#                                      key=jax.random.key(0), std_max=1e-2, beta_std=0.999, preset="patent")
params, opt_state = params0, tx.init(params0)
for _ in range(3):
    updates, opt_state = tx.update(grads_fn(params, x, y), opt_state, params)
    params = optax.apply_updates(params, updates)
# --8<-- [end:after]
print("both ran; parameter shapes:", jax.tree.map(jnp.shape, (before, params)))
