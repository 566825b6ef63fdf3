"""Banded-noise buffers sharded across devices (adaclip_jax.sharding): each device holds 1/R of
every buffer leaf, the sharded run equals the single-device run, and the buffers stay sharded.
Runs in a subprocess with 4 forced CPU devices (XLA_FLAGS must be set before jax is imported)."""

from __future__ import annotations

import textwrap

import pytest
from _jax_devices import run_on_cpu_devices

pytestmark = pytest.mark.jax

SCRIPT = textwrap.dedent(
    """
    import warnings
    from concurrent.futures import ThreadPoolExecutor
    import jax, jax.numpy as jnp, numpy as np, optax
    from jax.sharding import NamedSharding, PartitionSpec as P
    import adaclip_jax
    from adaclip.errors import InvalidHyperparameterError

    assert jax.device_count() == 4, jax.devices()
    assert jax.config.jax_threefry_partitionable
    mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    rep, data = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    # w: split along axis 0 (12), v: along axis 1 (20, the largest divisible), b and c: replicated
    params = {"w": jnp.ones((12, 8)), "v": jnp.ones((3, 20)), "b": jnp.zeros(3), "c": jnp.zeros(())}
    SPECS = {"b": P(), "c": P(), "v": P(None, "data"), "w": P("data", None)}
    NAMES = sorted(params)  # jax.tree_util leaf order of the dict
    params_rep = jax.device_put(params, rep)  # the sharded runs' parameters: replicated
    BANDS, SIGMA, B = 3, 1.0, 8
    rng = np.random.default_rng(0)

    def buffers(opt_state):
        (state,) = [s for s in jax.tree_util.tree_leaves(
            opt_state, is_leaf=lambda x: isinstance(x, adaclip_jax.AdaClipState))
            if isinstance(s, adaclip_jax.AdaClipState)]
        return state

    def per_device_buffer_bytes(state):
        # bytes of noise buffers each device holds (its addressable shards)
        held = {d: 0 for d in jax.devices()}
        for leaf in jax.tree_util.tree_leaves(state.noise_buffers):
            for shard in leaf.addressable_shards:
                held[shard.device] += shard.data.nbytes
        return held

    def quarter_per_device(leaf):
        shards = leaf.addressable_shards
        return (len({s.device for s in shards}) == 4 and len({str(s.index) for s in shards}) == 4
                and all(s.data.size * 4 == leaf.size for s in shards))

    def check_sharded(state):
        for buf in state.noise_buffers:
            for name, leaf in zip(NAMES, buf):
                assert leaf.sharding.is_equivalent_to(NamedSharding(mesh, SPECS[name]), leaf.ndim), (
                    name, leaf.sharding)
                assert quarter_per_device(leaf) == (name in ("v", "w")), name
        size = lambda n: int(np.prod(params[n].shape))  # noqa: E731
        expected = 4 * (BANDS - 1) * sum(size(n) // 4 if n in ("v", "w") else size(n) for n in NAMES)
        assert set(per_device_buffer_bytes(state).values()) == {expected}, per_device_buffer_bytes(state)
        return expected

    def compile_all(*lowered):  # XLA compiles outside the GIL: use every core
        with ThreadPoolExecutor(len(lowered)) as pool:
            return list(pool.map(lambda low: low.compile(), lowered))

    def grads(t):
        return {k: jnp.asarray(rng.standard_normal((B,) + p.shape) * (1 + t), jnp.float32)
                for k, p in params.items()}

    def same(a, b, exact):
        if jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        a, b = np.asarray(a), np.asarray(b)
        if exact:
            assert np.array_equal(a, b), np.max(np.abs(a - b))
        else:
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)

    def compare(s1, s2, u1, u2):
        s1, s2 = buffers(s1), buffers(s2)
        # the noise (buffers), the key and the step: bit for bit
        for a, b in zip(jax.tree_util.tree_leaves((s1.noise_buffers, s1.key, s1.step)),
                        jax.tree_util.tree_leaves((s2.noise_buffers, s2.key, s2.step))):
            same(a, b, exact=True)
        # the release and the statistics: float32 rounding (the clipped sum's order differs)
        for a, b in zip(jax.tree_util.tree_leaves((u1, s1.mean, s1.std)),
                        jax.tree_util.tree_leaves((u2, s2.mean, s2.std))):
            same(a, b, exact=False)

    # ---- (1) placement: each device holds 1/4 of every divisible buffer leaf
    flat = lambda **kw: adaclip_jax.flat_clip(  # noqa: E731
        max_grad_norm=0.5, noise_multiplier=SIGMA, expected_batch_size=B, key=1,
        noise_mechanism="banded", bands=BANDS, **kw)
    tx = flat()
    init = tx.init(params)
    sharded = adaclip_jax.shard_noise_buffers(init, mesh, "data")
    shardings = adaclip_jax.noise_buffer_shardings(init, mesh, "data")
    assert jax.tree_util.tree_structure(shardings) == jax.tree_util.tree_structure(
        jax.tree_util.tree_map(lambda x: 0, init))
    assert adaclip_jax.noise_buffer_shardings(jax.eval_shape(tx.init, params), mesh, "data") == shardings
    expected = check_sharded(sharded)
    for a, b in zip(jax.tree_util.tree_leaves(init), jax.tree_util.tree_leaves(sharded)):
        same(a, b, exact=True)
    assert sharded.key.sharding.is_fully_replicated and sharded.step.sharding.is_fully_replicated
    # fresh buffers: no two leaves of the result share memory, none is the input's
    pointers = [s.data.unsafe_buffer_pointer() for x in jax.tree_util.tree_leaves(sharded)
                for s in x.addressable_shards]
    inputs = {x.unsafe_buffer_pointer() for x in jax.tree_util.tree_leaves(init)
              if not jnp.issubdtype(x.dtype, jax.dtypes.prng_key)}
    assert len(set(pointers)) == len(pointers) and not inputs & set(pointers)

    # ---- (4) negative control: the same checks refuse replicated buffers
    replicated = jax.device_put(init, rep)
    full = set(per_device_buffer_bytes(replicated).values())
    assert full == {4 * (BANDS - 1) * sum(int(np.prod(p.shape)) for p in params.values())}
    assert full != {expected} and not quarter_per_device(replicated.noise_buffers[0][NAMES.index("w")])
    try:
        check_sharded(replicated)
    except AssertionError:
        pass
    else:
        raise SystemExit("check_sharded accepted replicated buffers")

    # ---- (2)+(3) several steps equal the single-device run; the buffers stay sharded
    # flat_clip: the bare update, out_shardings and a donated state
    g0 = grads(0)
    single, step = compile_all(
        jax.jit(tx.update).lower(g0, init, params),
        jax.jit(tx.update, out_shardings=(rep, shardings), donate_argnums=1).lower(
            jax.device_put(g0, data), sharded, params_rep))
    s1, s2 = init, sharded
    for t in range(3):
        g = grads(t)
        u1, s1 = single(g, s1, params)
        u2, s2 = step(jax.device_put(g, data), s2, params_rep)
        compare(s1, s2, u1, u2)
        check_sharded(s2)
        assert int(s2.step) == t + 1

    # adaclip in a chain (the helpers find its state), a whole train step
    chain = adaclip_jax.private_chain(
        adaclip_jax.adaclip(noise_multiplier=SIGMA, expected_batch_size=B, key=2,
                            noise_mechanism="banded", bands=BANDS),
        optax.sgd(0.1))

    def train(p, opt_state, g):
        updates, opt_state = chain.update(g, opt_state, p)
        return optax.apply_updates(p, updates), opt_state

    o1 = chain.init(params)
    o2 = adaclip_jax.shard_noise_buffers(o1, mesh, "data")
    check_sharded(buffers(o2))
    # (and the secure-mode step below, compiled alongside)
    secure = flat(secure_mode=True)
    s = adaclip_jax.shard_noise_buffers(secure.init(params), mesh, "data")
    zeros = jax.device_put({k: jnp.zeros((B,) + p.shape) for k, p in params.items()}, data)
    single, step, secure_step = compile_all(
        jax.jit(train).lower(params, o1, g0),
        jax.jit(train, out_shardings=(rep, adaclip_jax.noise_buffer_shardings(o2, mesh, "data")),
                donate_argnums=1).lower(params_rep, o2, jax.device_put(g0, data)),
        jax.jit(secure.update, out_shardings=(rep, adaclip_jax.noise_buffer_shardings(s, mesh, "data"))
                ).lower(zeros, s, params_rep))
    p1, p2 = params, params_rep
    for t in range(3):
        g = grads(t)
        p1, o1 = single(p1, o1, g)
        p2, o2 = step(p2, o2, jax.device_put(g, data))
        compare(o1, o2, p1, p2)
        check_sharded(buffers(o2))
        assert int(buffers(o2).step) == t + 1

    # secure mode: one OS draw folded into the one replicated key; every coordinate's release
    # carries the x_t its owner keeps (zero gradients: release = sigma*C*x_t/B)
    for _ in range(2):
        u, s = secure_step(zeros, s, params_rep)
        keys = [np.asarray(jax.random.key_data(x.data)) for x in s.key.addressable_shards]
        assert all(np.array_equal(keys[0], k) for k in keys)
        for name, x in zip(NAMES, s.noise_buffers[0]):
            np.testing.assert_allclose(np.asarray(u[name]), SIGMA * 0.5 / B * np.asarray(x), rtol=1e-6)
        check_sharded(s)

    # refusals and the warning
    for bad in (lambda: adaclip_jax.noise_buffer_shardings({"x": jnp.ones(3)}, mesh, "data"),
                lambda: adaclip_jax.noise_buffer_shardings(init, mesh, "model"),
                lambda: adaclip_jax.shard_noise_buffers(init, "mesh", "data")):
        try:
            bad()
        except InvalidHyperparameterError:
            pass
        else:
            raise SystemExit("not refused")
    jax.config.update("jax_threefry_partitionable", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        adaclip_jax.noise_buffer_shardings(init, mesh, "data")
    jax.config.update("jax_threefry_partitionable", True)
    assert any("jax_threefry_partitionable" in str(w.message) for w in caught)
    assert "adaclip_jax" not in caught[0].filename, caught[0].filename  # points at the caller
    print("SHARDED-BUFFERS-OK")
    """
)


def test_sharded_noise_buffers():
    run_on_cpu_devices(SCRIPT, "SHARDED-BUFFERS-OK")
