"""Banded noise under data parallelism with the buffers sharded: one jitted step over a mesh,
the batch split along "data", each device keeping 1/4 of every noise buffer. Forces 4 CPU
devices so it runs anywhere; on accelerators drop the XLA_FLAGS line."""
import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"  # before importing jax

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import adaclip_jax


def example_loss(params, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(x @ params["w"] + params["b"], y)


mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))  # Auto, not Explicit
replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
params = jax.device_put({"w": jnp.zeros((20, 3)), "b": jnp.zeros(3)}, replicated)
private = adaclip_jax.flat_clip(max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=64,
                                key=jax.random.key(0), noise_mechanism="banded", bands=4)  # no axis_name
tx = adaclip_jax.private_chain(private, optax.sgd(0.1))
opt_state = adaclip_jax.shard_noise_buffers(tx.init(params), mesh, "data")  # buffers split, rest replicated
state_shardings = adaclip_jax.noise_buffer_shardings(opt_state, mesh, "data")
grads_fn = adaclip_jax.per_example_grads(example_loss, batch_argnums=(1, 2))


def train_step(params, opt_state, x, y):
    updates, opt_state = tx.update(grads_fn(params, x, y), opt_state, params)
    return optax.apply_updates(params, updates), opt_state


# out_shardings keeps the buffers split from step to step; the state is donated (updated in place)
step = jax.jit(train_step, out_shardings=(replicated, state_shardings), donate_argnums=1)
kx, ky = jax.random.split(jax.random.key(1))
x = jax.device_put(jax.random.normal(kx, (64, 20)), split)  # 16 examples per device
y = jax.device_put(jax.random.randint(ky, (64,), 0, 3), split)
for _ in range(3):
    params, opt_state = step(params, opt_state, x, y)

b_buffer, w_buffer = opt_state[0].noise_buffers[0]  # the newest buffer, leaves in tree order (b, w)
print(int(opt_state[0].step), "steps; w's buffer", w_buffer.shape, "split as", w_buffer.sharding.spec,
      [s.data.shape for s in w_buffer.addressable_shards], "; b's (3 is not divisible by 4) replicated:",
      b_buffer.sharding.is_fully_replicated)
assert all(s.data.size * 4 == w_buffer.size for s in w_buffer.addressable_shards)
