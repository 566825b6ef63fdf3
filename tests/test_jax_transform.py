"""adaclip_jax transformations against the NumPy reference, optax, and on bad input."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import scipy.stats
from hypothesis import given, settings
from hypothesis import strategies as st

import adaclip_jax
from adaclip import reference
from adaclip.errors import InvalidGradientError, InvalidHyperparameterError

pytestmark = pytest.mark.jax


# --------------------------------------------------------------------------- helpers


def make_params(dtype=jnp.float32):
    """A nested pytree: dict with a list and a tuple inside."""
    return {
        "dense": [jnp.zeros((3, 2), dtype), jnp.zeros((2,), dtype)],
        "head": (jnp.zeros((2, 1), dtype),),
        "scalar": jnp.zeros((), dtype),
    }


def random_per_example(params, n, seed, scale=1.0, dtype=None):
    rng = np.random.default_rng(seed)
    leaves, treedef = jax.tree_util.tree_flatten(params)
    out = [jnp.asarray(scale * rng.standard_normal((n,) + p.shape), dtype or p.dtype) for p in leaves]
    return jax.tree_util.tree_unflatten(treedef, out)


def flat_rows(tree):
    """``(n, d)`` NumPy matrix of per-unit gradients in ``jax.tree_util`` leaf order."""
    leaves = jax.tree_util.tree_leaves(tree)
    n = leaves[0].shape[0]
    return np.concatenate([np.asarray(x, np.float64).reshape(n, -1) for x in leaves], axis=1)


def flat(tree):
    return np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree_util.tree_leaves(tree)])


def group_sizes(params):
    return [int(np.prod(p.shape)) for p in jax.tree_util.tree_leaves(params)]


def drawn_noise(key, params):
    """The standard-normal draw a step with state key ``key`` adds (documented key contract:
    ``new_key, noise_key = split(key)``; one ``split(noise_key, K)`` key per leaf)."""
    leaves = jax.tree_util.tree_leaves(params)
    _, noise_key = jax.random.split(key)
    keys = jax.random.split(noise_key, len(leaves))
    dt = jnp.promote_types(leaves[0].dtype, jnp.float32)
    return np.concatenate(
        [
            np.asarray(jax.random.normal(k, p.shape, dt), np.float64).ravel()
            for k, p in zip(keys, leaves, strict=True)
        ]
    )


# --------------------------------------------------------------------------- AdaCliP vs reference


@pytest.mark.parametrize("sigma", [0.0, 1.3])
def test_adaclip_matches_reference_over_several_steps(sigma):
    with jax.enable_x64(True):
        params = make_params(jnp.float64)
        kw = dict(std_min=1e-3, std_max=2.0, beta_mean=0.9, beta_std=0.8)
        tx = adaclip_jax.adaclip(noise_multiplier=sigma, expected_batch_size=6.5, key=jax.random.key(3), **kw, preset="patent")
        state = tx.init(params)
        d = sum(group_sizes(params))
        mean = np.zeros(d)
        std = np.full(d, np.sqrt(kw["std_min"] * kw["std_max"]))
        step = jax.jit(tx.update)
        for t in range(5):
            g = random_per_example(params, n=4, seed=t, scale=0.5 + t)
            z = drawn_noise(state.key, params)
            update, state = step(g, state, params)
            ref_grad, mean, std = reference.adaclip_step(
                flat_rows(g), mean, std, z, noise_multiplier=sigma, expected_batch_size=6.5, **kw
            )
            np.testing.assert_allclose(flat(update), ref_grad, rtol=1e-10, atol=1e-12)
            np.testing.assert_allclose(flat(state.mean), mean, rtol=1e-10, atol=1e-14)
            np.testing.assert_allclose(flat(state.std), std, rtol=1e-10, atol=1e-14)
            assert int(state.step) == t + 1
            # The state keeps the parameters' tree structure.
            assert jax.tree_util.tree_structure(state.mean) == jax.tree_util.tree_structure(params)


@settings(max_examples=8)
@given(
    n=st.integers(1, 6),
    scale=st.floats(1e-3, 1e3),
    batch=st.floats(0.5, 20.0),
    seed=st.integers(0, 2**16),
)
def test_adaclip_matches_reference_property(n, scale, batch, seed):
    with jax.enable_x64(True):
        params = make_params(jnp.float64)
        tx = adaclip_jax.adaclip(noise_multiplier=0.0, expected_batch_size=batch, key=0, preset="patent")
        state = tx.init(params)
        d = sum(group_sizes(params))
        mean, std = np.zeros(d), np.full(d, np.sqrt(1e-5))
        step = jax.jit(tx.update)
        for t in range(2):
            g = random_per_example(params, n=n, seed=seed + t, scale=scale)
            update, state = step(g, state, params)
            ref, mean, std = reference.adaclip_step(
                flat_rows(g),
                mean,
                std,
                np.zeros(d),
                noise_multiplier=0.0,
                expected_batch_size=batch,
                std_min=1e-5,
                std_max=1.0,
            )
            np.testing.assert_allclose(flat(update), ref, rtol=1e-9, atol=1e-12 * max(1.0, scale))
            np.testing.assert_allclose(flat(state.std), std, rtol=1e-9)


def test_adaclip_float32_close_to_reference():
    params = make_params()
    tx = adaclip_jax.adaclip(noise_multiplier=0.0, expected_batch_size=5, key=0, preset="patent")
    state = tx.init(params)
    g = random_per_example(params, 5, seed=1)
    update, state = jax.jit(tx.update)(g, state, params)
    d = sum(group_sizes(params))
    ref, _, std = reference.adaclip_step(
        flat_rows(g),
        np.zeros(d),
        np.full(d, np.sqrt(1e-5)),
        np.zeros(d),
        noise_multiplier=0.0,
        expected_batch_size=5,
        std_min=1e-5,
        std_max=1.0,
    )
    assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves(update))
    np.testing.assert_allclose(flat(update), ref, rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(flat(state.std), std, rtol=1e-4)


# --------------------------------------------------------------------------- the affine family


def test_flat_clip_matches_reference_with_noise():
    with jax.enable_x64(True):
        params = make_params(jnp.float64)
        tx = adaclip_jax.flat_clip(max_grad_norm=0.7, noise_multiplier=1.1, expected_batch_size=3.5, key=9)
        state = tx.init(params)
        assert state.mean is None and state.std is None
        step = jax.jit(tx.update)
        for t in range(3):
            g = random_per_example(params, 4, seed=10 + t)
            z = drawn_noise(state.key, params)
            update, state = step(g, state, params)
            ref = reference.flat_clip_step(
                flat_rows(g), z, max_grad_norm=0.7, noise_multiplier=1.1, expected_batch_size=3.5
            )
            np.testing.assert_allclose(flat(update), ref, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("clip", [1e-3, 0.5, 1e3])
def test_flat_clip_equals_optax_dp_aggregate_at_sigma_zero(clip):
    params = make_params()
    n = 7
    g = random_per_example(params, n, seed=4)
    ours = adaclip_jax.flat_clip(max_grad_norm=clip, noise_multiplier=0.0, expected_batch_size=n, key=0)
    theirs = optax.contrib.differentially_private_aggregate(
        l2_norm_clip=clip, noise_multiplier=0.0, key=jax.random.key(0)
    )
    u1, _ = jax.jit(ours.update)(g, ours.init(params), params)
    u2, _ = jax.jit(theirs.update)(g, theirs.init(params), params)
    # Our clip factors come from an upper bound of the norm (adaclip.transform.rounding_margin):
    # clipped units differ from optax's by at most that float32 margin, ~1e-6 here.
    np.testing.assert_allclose(flat(u1), flat(u2), rtol=3e-6, atol=1e-9)
    # optax divides by the realised n; we divide by the expected B̄ (here 2n): exactly half.
    half = adaclip_jax.flat_clip(max_grad_norm=clip, noise_multiplier=0.0, expected_batch_size=2 * n, key=0)
    u3, _ = jax.jit(half.update)(g, half.init(params), params)
    np.testing.assert_allclose(2 * flat(u3), flat(u2), rtol=3e-6, atol=1e-9)


@pytest.mark.parametrize("group_norms", [None, (0.1, 0.5, 2.0, 1.0)])
def test_per_layer_clip_matches_reference(group_norms):
    with jax.enable_x64(True):
        params = make_params(jnp.float64)
        kw = dict(max_grad_norm=1.5) if group_norms is None else dict(group_max_grad_norms=group_norms)
        tx = adaclip_jax.per_layer_clip(noise_multiplier=0.8, expected_batch_size=4.0, key=1, **kw)
        state = tx.init(params)
        g = random_per_example(params, 5, seed=5, scale=3.0)
        z = drawn_noise(state.key, params)
        update, _ = jax.jit(tx.update)(g, state, params)
        ref = reference.per_layer_clip_step(
            flat_rows(g),
            z,
            groups=group_sizes(params),
            max_grad_norm=kw.get("max_grad_norm"),
            group_max_grad_norms=group_norms,
            noise_multiplier=0.8,
            expected_batch_size=4.0,
        )
        np.testing.assert_allclose(flat(update), ref, rtol=1e-10, atol=1e-13)


def test_scaled_clip_matches_reference():
    with jax.enable_x64(True):
        params = make_params(jnp.float64)
        scales = (0.5, 2.0, 1.0, 0.1)
        tx = adaclip_jax.scaled_clip(
            max_grad_norm=0.9, layer_scales=scales, noise_multiplier=0.6, expected_batch_size=5.0, key=2
        )
        state = tx.init(params)
        g = random_per_example(params, 5, seed=6, scale=2.0)
        z = drawn_noise(state.key, params)
        update, _ = jax.jit(tx.update)(g, state, params)
        ref = reference.scaled_clip_step(
            flat_rows(g),
            z,
            groups=group_sizes(params),
            layer_scales=scales,
            max_grad_norm=0.9,
            noise_multiplier=0.6,
            expected_batch_size=5.0,
        )
        np.testing.assert_allclose(flat(update), ref, rtol=1e-10, atol=1e-13)


def test_scaled_clip_wrong_number_of_scales_raises_at_trace_time():
    params = make_params()
    tx = adaclip_jax.scaled_clip(
        max_grad_norm=1.0, layer_scales=(1.0, 2.0), noise_multiplier=1.0, expected_batch_size=4, key=0
    )
    state = tx.init(params)
    with pytest.raises(InvalidHyperparameterError, match="layer_scales"):
        jax.jit(tx.update)(random_per_example(params, 3, 0), state, params)


# --------------------------------------------------------------------------- noise


def test_noise_distribution_ks():
    """Zero gradients: the output is b·σ·z/B̄ + m with m = 0, b = s0·sqrt(d) at init."""
    params = {"w": jnp.zeros((50, 40))}
    sigma, batch = 1.7, 8.0
    tx = adaclip_jax.adaclip(
        noise_multiplier=sigma, expected_batch_size=batch, key=jax.random.key(11), std_min=1e-4, std_max=1.0, preset="patent"
    )
    state = tx.init(params)
    g = {"w": jnp.zeros((3, 50, 40))}
    update, _ = jax.jit(tx.update)(g, state, params)
    d = 2000
    b = np.sqrt(1e-4) * np.sqrt(d)  # sqrt(s0)·sqrt(d·s0)
    x = np.asarray(update["w"], np.float64).ravel() / (b * sigma / batch)
    assert scipy.stats.kstest(x, "norm").pvalue > 1e-3
    # And the wrong scale is rejected by the same test (the test can fail).
    assert scipy.stats.kstest(1.2 * x, "norm").pvalue < 1e-3


def test_flat_noise_distribution_ks():
    params = {"a": jnp.zeros((1000,)), "b": jnp.zeros((10, 100))}
    tx = adaclip_jax.flat_clip(max_grad_norm=0.3, noise_multiplier=2.0, expected_batch_size=10, key=5)
    update, _ = jax.jit(tx.update)(
        jax.tree.map(lambda p: jnp.zeros((2,) + p.shape), params), tx.init(params), params
    )
    x = flat(update) / (0.3 * 2.0 / 10)
    assert scipy.stats.kstest(x, "norm").pvalue > 1e-3


def test_key_advances_every_step():
    params = make_params()
    tx = adaclip_jax.flat_clip(max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=2, key=0)
    state = tx.init(params)
    g = random_per_example(params, 2, seed=0)
    seen = []
    step = jax.jit(tx.update)
    for _ in range(3):
        old_key = state.key
        update, state = step(g, state, params)
        assert not np.array_equal(jax.random.key_data(old_key), jax.random.key_data(state.key))
        seen.append(flat(update))
    assert not np.allclose(seen[0], seen[1]) and not np.allclose(seen[1], seen[2])
    # Leaves get independent noise (not one draw reused).
    z = drawn_noise(jax.random.key(0), params)
    assert len(np.unique(np.round(z, 6))) == z.size


def test_legacy_uint32_key_accepted():
    params = make_params()
    tx = adaclip_jax.adaclip(noise_multiplier=1.0, expected_batch_size=2, key=jax.random.PRNGKey(0), preset="patent")
    update, state = jax.jit(tx.update)(random_per_example(params, 2, 0), tx.init(params), params)
    assert np.all(np.isfinite(flat(update)))


# --------------------------------------------------------------------------- jit, chain, dtypes, pytrees


def test_jit_equals_eager_and_chain_with_adam():
    params = make_params()
    tx = optax.chain(
        adaclip_jax.adaclip(noise_multiplier=1.1, expected_batch_size=4, key=jax.random.key(0), preset="patent"),
        optax.adam(1e-2),
    )
    s_eager = s_jit = tx.init(params)
    step = jax.jit(tx.update)
    for t in range(3):
        g = random_per_example(params, 4, seed=t)
        u1, s_eager = tx.update(g, s_eager, params)
        u2, s_jit = step(g, s_jit, params)
        np.testing.assert_allclose(flat(u1), flat(u2), rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(flat(s_eager[0].std), flat(s_jit[0].std), rtol=1e-5)


def test_bfloat16_params():
    params = make_params(jnp.bfloat16)
    tx = adaclip_jax.adaclip(noise_multiplier=0.5, expected_batch_size=4, key=0, preset="patent")
    state = tx.init(params)
    assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves((state.mean, state.std)))
    g = random_per_example(params, 4, seed=1)
    update, state = jax.jit(tx.update)(g, state, params)
    assert all(u.dtype == jnp.bfloat16 for u in jax.tree_util.tree_leaves(update))
    assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves((state.mean, state.std)))
    # Same as running the float32 maths on the bf16 inputs, then casting.
    params32 = make_params()
    tx32 = adaclip_jax.adaclip(noise_multiplier=0.5, expected_batch_size=4, key=0, preset="patent")
    u32, s32 = jax.jit(tx32.update)(
        jax.tree.map(lambda x: x.astype(jnp.float32), g), tx32.init(params32), params32
    )
    np.testing.assert_allclose(
        flat(update), flat(jax.tree.map(lambda x: x.astype(jnp.bfloat16), u32)), rtol=1e-2
    )
    np.testing.assert_allclose(flat(state.std), flat(s32.std), rtol=1e-6)


def test_without_params_output_dtype_follows_input():
    params = make_params()
    tx = adaclip_jax.flat_clip(max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=3, key=0)
    g = random_per_example(params, 3, 0)
    update, _ = tx.update(g, tx.init(params))
    assert jax.tree_util.tree_structure(update) == jax.tree_util.tree_structure(params)
    assert all(
        u.shape == p.shape
        for u, p in zip(jax.tree_util.tree_leaves(update), jax.tree_util.tree_leaves(params), strict=True)
    )


def test_noise_multiplier_schedule_and_override():
    """A jnp schedule of the step, and the per-call override, both set σ_t."""
    params = {"w": jnp.zeros((400,))}
    g = {"w": jnp.zeros((2, 400))}
    sched = lambda step: jnp.where(step < 1, 0.0, 10.0)  # noqa: E731
    tx = adaclip_jax.flat_clip(max_grad_norm=1.0, noise_multiplier=sched, expected_batch_size=1, key=0)
    state = tx.init(params)
    update_fn = jax.jit(tx.update)
    u0, state = update_fn(g, state, params)
    u1, state = update_fn(g, state, params)
    assert np.all(np.asarray(u0["w"]) == 0) and np.std(np.asarray(u1["w"])) > 5
    # override through optax.chain's extra arguments
    chained = optax.chain(
        adaclip_jax.flat_clip(max_grad_norm=1.0, noise_multiplier=10.0, expected_batch_size=1, key=0),
        optax.sgd(1.0),
    )
    u, _ = jax.jit(chained.update)(g, chained.init(params), params, noise_multiplier=jnp.float32(0.0))
    assert np.all(np.asarray(u["w"]) == 0)


# --------------------------------------------------------------------------- masks


@pytest.mark.parametrize("factory", ["adaclip", "flat"])
def test_unit_mask_equals_dropping_rows(factory):
    with jax.enable_x64(True):
        params = make_params(jnp.float64)
        if factory == "adaclip":
            tx = adaclip_jax.adaclip(noise_multiplier=0.7, expected_batch_size=3, key=4, preset="patent")
        else:
            tx = adaclip_jax.flat_clip(max_grad_norm=0.5, noise_multiplier=0.7, expected_batch_size=3, key=4)
        state_a = state_b = tx.init(params)
        # a step first so that AdaCliP's centre m is non-zero
        g0 = random_per_example(params, 3, seed=0)
        step = jax.jit(tx.update)
        _, state_a = step(g0, state_a, params)
        _, state_b = step(g0, state_b, params)
        g = random_per_example(params, 6, seed=1)
        mask = jnp.array([True, False, True, True, False, False])
        keep = np.flatnonzero(np.asarray(mask))
        u_mask, s_mask = step(g, state_a, params, unit_mask=mask)
        u_drop, s_drop = step(jax.tree.map(lambda x: x[keep], g), state_b, params)
        np.testing.assert_allclose(flat(u_mask), flat(u_drop), rtol=1e-12, atol=1e-14)
        if factory == "adaclip":
            np.testing.assert_allclose(flat(s_mask.std), flat(s_drop.std), rtol=1e-12)


def test_empty_batch_releases_noise_only():
    with jax.enable_x64(True):
        params = make_params(jnp.float64)
        tx = adaclip_jax.adaclip(noise_multiplier=1.0, expected_batch_size=3, key=4, preset="patent")
        state = tx.init(params)
        g = random_per_example(params, 0, seed=0)
        z = drawn_noise(state.key, params)
        update, _ = jax.jit(tx.update)(g, state, params)
        d = sum(group_sizes(params))
        ref, _, _ = reference.adaclip_step(
            np.zeros((0, d)),
            np.zeros(d),
            np.full(d, np.sqrt(1e-5)),
            z,
            noise_multiplier=1.0,
            expected_batch_size=3,
            std_min=1e-5,
            std_max=1.0,
            allow_empty=True,
        )
        np.testing.assert_allclose(flat(update), ref, rtol=1e-12)


# --------------------------------------------------------------------------- bad input


def test_bad_hyperparameters():
    with pytest.raises(InvalidHyperparameterError, match="noise_multiplier"):
        adaclip_jax.adaclip(noise_multiplier=-1.0, expected_batch_size=4, key=0, preset="patent")
    with pytest.raises(InvalidHyperparameterError, match="expected_batch_size"):
        adaclip_jax.adaclip(noise_multiplier=1.0, expected_batch_size=0, key=0, preset="patent")
    with pytest.raises(InvalidHyperparameterError, match="key"):
        adaclip_jax.adaclip(noise_multiplier=1.0, expected_batch_size=4, key=None, preset="patent")
    with pytest.raises(InvalidHyperparameterError, match="std_min"):
        adaclip_jax.adaclip(noise_multiplier=1.0, expected_batch_size=4, key=0, std_min=2.0, std_max=1.0, preset="patent")
    with pytest.raises(InvalidHyperparameterError, match="max_grad_norm"):
        adaclip_jax.flat_clip(max_grad_norm=0.0, noise_multiplier=1.0, expected_batch_size=4, key=0)


@pytest.mark.parametrize("use_jit", [False, True])
def test_bad_shapes_raise_even_under_jit(use_jit):
    params = make_params()
    tx = adaclip_jax.adaclip(noise_multiplier=1.0, expected_batch_size=4, key=0, preset="patent")
    state = tx.init(params)
    update = jax.jit(tx.update) if use_jit else tx.update
    good = random_per_example(params, 3, 0)
    missing_axis = jax.tree.map(lambda x: x[0], good)
    with pytest.raises(InvalidGradientError):
        update(missing_axis, state, params)
    mismatched = dict(good, scalar=jnp.zeros((4,)))
    with pytest.raises(InvalidGradientError, match="batch size"):
        update(mismatched, state, params)
    wrong_tree = {"dense": good["dense"], "head": good["head"]}
    with pytest.raises(InvalidGradientError, match="tree structure"):
        update(wrong_tree, state, params)
    with pytest.raises(InvalidGradientError, match="unit_mask"):
        update(good, state, params, unit_mask=jnp.ones((5,), bool))


def test_check_inputs_eager():
    params = make_params()
    good = random_per_example(params, 3, 0)
    assert adaclip_jax.check_inputs(good, params) == 3
    bad = jax.tree.map(lambda x: x.at[0].set(jnp.nan) if x.ndim == 3 else x, good)
    with pytest.raises(InvalidGradientError, match="NaN"):
        adaclip_jax.check_inputs(bad, params)
    inf = dict(good, scalar=good["scalar"].at[1].set(jnp.inf))
    with pytest.raises(InvalidGradientError, match="NaN or inf"):
        adaclip_jax.check_inputs(inf, params)
    with pytest.raises(InvalidGradientError, match="empty"):
        adaclip_jax.check_inputs(random_per_example(params, 0, 0), params)
    assert adaclip_jax.check_inputs(random_per_example(params, 0, 0), params, allow_empty=True) == 0


@pytest.mark.parametrize("bad_value", [np.nan, np.inf, -np.inf])
def test_nonfinite_unit_under_jit_is_dropped_from_the_release(bad_value):
    """A unit with a NaN/inf entry contributes exactly 0: the release (same key) and the new
    statistics are those of the batch without that unit, and nothing counts it."""
    with jax.enable_x64(True):
        params = make_params(jnp.float64)
        tx = adaclip_jax.adaclip(noise_multiplier=1.0, expected_batch_size=3, key=0, preset="patent")
        state = tx.init(params)
        step = jax.jit(tx.update)
        _, state = step(random_per_example(params, 3, 0), state, params)
        bad = random_per_example(params, 3, 1)
        bad["head"] = (bad["head"][0].at[2, 0, 0].set(bad_value),)
        update, new_state = step(bad, state, params)
        without, state_without = step(jax.tree.map(lambda x: x[:2], bad), state, params)
        assert np.all(np.isfinite(flat(update)))
        np.testing.assert_allclose(flat(update), flat(without), rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(flat(new_state.std), flat(state_without.std), rtol=1e-12)
        assert int(new_state.nonfinite_steps) == 0 and int(new_state.step) == 2
        assert not np.array_equal(jax.random.key_data(new_state.key), jax.random.key_data(state.key))


@pytest.mark.parametrize("build", ["flat_clip", "adaclip"])
def test_jitted_step_drops_a_nan_unit_without_a_conditional_over_the_gradients(build):
    """A whole jitted step (``vmap(grad)`` then the update): a unit whose input is NaN is dropped
    (the release equals that of the batch without it, same key), and the compiled step holds no
    ``conditional``: a ``lax.cond`` taking the ``n·d`` per-unit gradients makes XLA materialise
    them and copy them in its branches, an extra pass over memory on every step."""
    sizes = (6, 5, 3)
    keys = jax.random.split(jax.random.key(3), len(sizes) - 1)
    params = [{"w": jax.random.normal(k, (i, o)) / np.sqrt(i), "b": jnp.zeros((o,))}
              for k, i, o in zip(keys, sizes[:-1], sizes[1:])]

    def loss_one(p, x, y):
        h = jax.nn.relu(x @ p[0]["w"] + p[0]["b"])
        return optax.softmax_cross_entropy_with_integer_labels(h @ p[1]["w"] + p[1]["b"], y)

    if build == "flat_clip":
        tx = adaclip_jax.flat_clip(max_grad_norm=0.5, noise_multiplier=1.0, expected_batch_size=4, key=0)
    else:
        tx = adaclip_jax.adaclip(noise_multiplier=1.0, expected_batch_size=4, key=0)
    per_ex = adaclip_jax.per_example_grads(loss_one, batch_argnums=(1, 2))
    step = jax.jit(lambda p, s, x, y: tx.update(per_ex(p, x, y), s, p))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((4, sizes[0])), jnp.float32)
    y = jnp.asarray([0, 1, 2, 1])
    state = tx.init(params)
    assert "conditional(" not in step.lower(params, state, x, y).compile().as_text()
    bad = x.at[2, 0].set(jnp.nan)
    update, _ = step(params, state, bad, y)
    keep = np.array([0, 1, 3])
    without, _ = step(params, state, x[keep], y[keep])
    assert np.all(np.isfinite(flat(update)))
    np.testing.assert_allclose(flat(update), flat(without), rtol=1e-5, atol=1e-7)


def test_invalid_traced_sigma_releases_nan_and_keeps_the_statistics():
    """A non-finite release (here from a NaN σ under jit) leaves mean/std unchanged, is
    counted in nonfinite_steps, and the key advances; the next good step proceeds."""
    params = make_params()
    tx = adaclip_jax.adaclip(noise_multiplier=1.0, expected_batch_size=3, key=0, preset="patent")
    state = tx.init(params)
    step = jax.jit(lambda g, s, nm: tx.update(g, s, params, noise_multiplier=nm))
    _, state = step(random_per_example(params, 3, 0), state, jnp.float32(1.0))
    update, new_state = step(random_per_example(params, 3, 1), state, jnp.float32(jnp.nan))
    assert np.all(np.isnan(flat(update)))
    np.testing.assert_array_equal(flat(new_state.mean), flat(state.mean))
    np.testing.assert_array_equal(flat(new_state.std), flat(state.std))
    assert int(new_state.nonfinite_steps) == 1 and int(new_state.step) == 2
    assert not np.array_equal(jax.random.key_data(new_state.key), jax.random.key_data(state.key))
    update, newer = step(random_per_example(params, 3, 2), new_state, jnp.float32(1.0))
    assert np.all(np.isfinite(flat(update))) and int(newer.nonfinite_steps) == 1


def test_apply_if_finite_on_the_inner_optimizer_skips_a_nonfinite_release():
    """The documented pattern: adaclip first, the rest of the chain wrapped in apply_if_finite.
    A NaN unit does not make the release non-finite (it is dropped), so the inner optimizer
    steps; a non-finite release (an invalid traced σ) is skipped."""
    params = make_params()
    tx = optax.chain(
        adaclip_jax.adaclip(noise_multiplier=1.0, expected_batch_size=3, key=0, preset="patent"),
        optax.apply_if_finite(optax.adam(1e-2), max_consecutive_errors=5),
    )
    state = tx.init(params)
    step = jax.jit(lambda g, s, nm: tx.update(g, s, params, noise_multiplier=nm))
    bad = random_per_example(params, 3, 1)
    bad["scalar"] = bad["scalar"].at[0].set(jnp.nan)
    update, new_state = step(bad, state, jnp.float32(1.0))
    assert np.all(np.isfinite(flat(update))) and int(new_state[1].total_notfinite) == 0
    update, newer = step(random_per_example(params, 3, 2), new_state, jnp.float32(-1.0))
    assert np.all(flat(update) == 0)
    np.testing.assert_array_equal(flat(newer[0].std), flat(new_state[0].std))
    assert int(newer[1].total_notfinite) == 1
    np.testing.assert_array_equal(flat(newer[1].inner_state[0].mu), flat(new_state[1].inner_state[0].mu))


def test_bad_noise_multiplier_override_raises_before_any_change():
    params = make_params()
    tx = adaclip_jax.adaclip(noise_multiplier=1.0, expected_batch_size=3, key=0, preset="patent")
    state = tx.init(params)
    g = random_per_example(params, 3, 0)
    for bad in (-0.5, float("nan"), jnp.float32(-1.0)):
        with pytest.raises(InvalidHyperparameterError, match="noise_multiplier"):
            tx.update(g, state, params, noise_multiplier=bad)
    with pytest.raises(InvalidGradientError, match="tree structure"):
        adaclip_jax.check_inputs({"dense": g["dense"]}, params)


def test_state_from_other_params_is_rejected():
    params = make_params()
    tx = adaclip_jax.adaclip(noise_multiplier=1.0, expected_batch_size=3, key=0, preset="patent")
    other_state = tx.init({"w": jnp.zeros((4,))})
    with pytest.raises(InvalidGradientError, match="state"):
        tx.update(random_per_example(params, 3, 0), other_state, params)


def test_noise_is_coordinatewise_b_sigma_over_batch_after_adaptation():
    """With a non-uniform b (after some steps), g̃(σ) − g̃(0) = b·σ·z/B̄ with z ~ N(0, I)."""
    from adaclip import transform as core

    rng = np.random.default_rng(0)
    params = {"w": jnp.zeros((40, 50))}
    sigma, batch = 2.0, 16.0
    # beta_std = 0: s follows the last variance estimate, so one noiseless step with
    # coordinate-dependent gradient means makes b clearly non-uniform.
    tx = adaclip_jax.adaclip(
        noise_multiplier=sigma, expected_batch_size=batch, key=7, std_min=1e-6, std_max=1.0, beta_std=0.0, preset="patent"
    )
    state = tx.init(params)
    step = jax.jit(tx.update)
    spread = jnp.asarray(np.exp(rng.uniform(-6, 0, (40, 50))), jnp.float32)
    g = {"w": jnp.broadcast_to(spread, (16, 40, 50)) * 1e-1}
    _, state = step(g, state, params, noise_multiplier=jnp.float32(0.0))
    b = np.asarray(core.auxiliary_scale([state.std["w"]])[0], np.float64)
    assert b.max() / b.min() > 10  # the scale really is coordinate-wise here
    g = {"w": jnp.asarray(rng.standard_normal((16, 40, 50)), jnp.float32) * spread}
    noisy, _ = step(g, state, params)
    clean, _ = step(g, state, params, noise_multiplier=jnp.float32(0.0))
    z = (np.asarray(noisy["w"], np.float64) - np.asarray(clean["w"], np.float64)) / (b * sigma / batch)
    assert scipy.stats.kstest(z.ravel(), "norm").pvalue > 1e-3
    # A uniform scale (flat noise) would not pass: the test can fail.
    z_flat = (np.asarray(noisy["w"]) - np.asarray(clean["w"])) / (b.mean() * sigma / batch)
    assert scipy.stats.kstest(z_flat.ravel(), "norm").pvalue < 1e-3


def test_new_state_is_a_function_of_the_release_only():
    """Post-processing: (m, s) after the step follow from g̃ and the old state alone."""
    with jax.enable_x64(True):
        params = make_params(jnp.float64)
        kw = dict(std_min=1e-3, std_max=1.0, beta_mean=0.95, beta_std=0.85)
        tx = adaclip_jax.adaclip(noise_multiplier=1.1, expected_batch_size=4.0, key=1, **kw, preset="patent")
        state = tx.init(params)
        step = jax.jit(tx.update)
        for t in range(3):
            update, new_state = step(random_per_example(params, 4, seed=t, scale=2.0), state, params)
            m, s = reference.update_moments(
                flat(update),
                flat(state.mean),
                flat(state.std),
                noise_multiplier=1.1,
                expected_batch_size=4.0,
                **kw,
            )
            np.testing.assert_allclose(flat(new_state.mean), m, rtol=1e-12)
            np.testing.assert_allclose(flat(new_state.std), s, rtol=1e-12)
            state = new_state


def test_adaclip_init_warns_when_its_estimates_would_follow_the_noise():
    """The optax transformation checks κ = 2φ(1)·d·σ²/B̄² at init (shapes and hyperparameters
    only): NoiseDominatedWarning when κ > 1, pointing past optax at the user's line; none at
    κ < 1, for flat clipping, or for a σ schedule (its σ_0 may be traced)."""
    import warnings

    from adaclip.errors import NoiseDominatedWarning

    params = {"w": jnp.zeros((40, 50)), "b": jnp.zeros(50)}  # d = 2050: κ = 1 at B̄ ≈ 31.5·σ
    tx = optax.chain(adaclip_jax.adaclip(noise_multiplier=1.0, expected_batch_size=16.0, key=0, preset="patent"), optax.sgd(0.1))
    with pytest.warns(NoiseDominatedWarning, match="d = 2050") as record:
        tx.init(params)
    assert record[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error", NoiseDominatedWarning)
        adaclip_jax.adaclip(noise_multiplier=1.0, expected_batch_size=64.0, key=0, preset="patent").init(params)
        adaclip_jax.flat_clip(max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=1.0, key=0).init(params)
        adaclip_jax.adaclip(noise_multiplier=lambda step: 1.0, expected_batch_size=1.0, key=0, preset="patent").init(params)
