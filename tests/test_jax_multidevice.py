"""Data parallelism: clip per device, psum, add the noise once. Runs in a subprocess with 4
forced CPU devices (XLA_FLAGS must be set before jax is imported)."""

from __future__ import annotations

import textwrap

import pytest
from _jax_devices import run_on_cpu_devices

pytestmark = pytest.mark.jax

SCRIPT = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import PartitionSpec as P
    import adaclip_jax

    assert jax.device_count() == 4, jax.devices()
    mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    params = {"w": jnp.ones((3, 2)), "b": [jnp.zeros(2)], "c": (jnp.zeros(()),)}
    rng = np.random.default_rng(0)

    def check(factory, sigma):
        single = factory(sigma, None)
        multi = factory(sigma, "data")
        s1 = s2 = single.init(params)
        step1 = jax.jit(single.update)
        step2 = jax.jit(jax.shard_map(
            multi.update, mesh=mesh, in_specs=(P("data"), P(), P()), out_specs=(P(), P())))
        for t in range(3):
            g = jax.tree.map(
                lambda p: jnp.asarray(rng.standard_normal((8,) + p.shape) * (1 + t), jnp.float32), params)
            u1, s1 = step1(g, s1, params)
            u2, s2 = step2(g, s2, params)
            for a, b in zip(jax.tree.leaves((u1, s1.mean, s1.std, s1.noise_buffers)),
                            jax.tree.leaves((u2, s2.mean, s2.std, s2.noise_buffers))):
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
            assert int(s2.step) == t + 1

    for sigma in (0.0, 1.0):
        check(lambda s, ax: adaclip_jax.adaclip(
            noise_multiplier=s, expected_batch_size=8, key=1, axis_name=ax), sigma)
        check(lambda s, ax: adaclip_jax.flat_clip(
            max_grad_norm=0.5, noise_multiplier=s, expected_batch_size=8, key=1, axis_name=ax), sigma)
        # banded noise: key and buffers replicated, so x_t is drawn once (the same on every device)
        check(lambda s, ax: adaclip_jax.flat_clip(
            max_grad_norm=0.5, noise_multiplier=s, expected_batch_size=8, key=1, axis_name=ax,
            noise_mechanism="banded", bands=3), sigma)
        check(lambda s, ax: adaclip_jax.adaclip(
            noise_multiplier=s, expected_batch_size=8, key=1, axis_name=ax,
            noise_mechanism="banded", bands=2), sigma)
    print("MULTIDEVICE-OK")
    """
)


def test_multi_device_equals_single_device():
    run_on_cpu_devices(SCRIPT, "MULTIDEVICE-OK")
