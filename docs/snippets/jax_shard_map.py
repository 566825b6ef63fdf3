"""Data parallelism with shard_map: clip per device, psum, noise once. Forces 4 CPU devices
so it runs anywhere; on accelerators drop the XLA_FLAGS line."""
import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"  # before importing jax

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

import adaclip_jax


def example_loss(params, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(x @ params["w"], y)


mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
params = {"w": jnp.zeros((20, 3))}
private = adaclip_jax.adaclip(noise_multiplier=1.0, expected_batch_size=64,  # global B̄
                              key=jax.random.key(0), std_max=1e-2, axis_name="data", preset="patent")
tx = optax.chain(private, optax.sgd(0.1))
opt_state = tx.init(params)
grads_fn = adaclip_jax.per_example_grads(example_loss, batch_argnums=(1, 2))


def local_update(params, opt_state, x, y):
    grads = grads_fn(params, x, y)                # this device's 16 examples
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


step = jax.jit(jax.shard_map(local_update, mesh=mesh,
                             in_specs=(P(), P(), P("data"), P("data")),
                             out_specs=(P(), P())))
kx, ky = jax.random.split(jax.random.key(1))
x = jax.random.normal(kx, (64, 20))
y = jax.random.randint(ky, (64,), 0, 3)
for _ in range(3):
    params, opt_state = step(params, opt_state, x, y)
print(jax.device_count(), "devices; steps:", int(opt_state[0].step))
