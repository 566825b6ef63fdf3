"""adaclip_jax.per_example_grads and user-level units against explicit loops of jax.grad."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import adaclip_jax
from adaclip import reference
from adaclip.errors import InvalidGradientError, InvalidHyperparameterError

pytestmark = pytest.mark.jax


def loss_fn(params, x, y):
    """Per-example squared error of a tiny two-layer model (x: (3,), y: scalar)."""
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    pred = h @ params["w2"][0]
    return (pred - y) ** 2


def make():
    rng = np.random.default_rng(0)
    params = {
        "w1": jnp.asarray(rng.standard_normal((3, 4)), jnp.float32),
        "b1": jnp.asarray(rng.standard_normal(4), jnp.float32),
        "w2": [jnp.asarray(rng.standard_normal(4), jnp.float32)],
    }
    x = jnp.asarray(rng.standard_normal((8, 3)), jnp.float32)
    y = jnp.asarray(rng.standard_normal(8), jnp.float32)
    return params, x, y


def loop_grads(params, x, y):
    per = [jax.grad(loss_fn)(params, x[i], y[i]) for i in range(x.shape[0])]
    return jax.tree.map(lambda *g: jnp.stack(g), *per)


def assert_tree_close(a, b, **kw):
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for u, v in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), **kw)


@pytest.mark.parametrize("micro_batch_size", [None, 2, 8])
def test_per_example_grads_equals_loop(micro_batch_size):
    params, x, y = make()
    fn = jax.jit(
        adaclip_jax.per_example_grads(loss_fn, micro_batch_size=micro_batch_size, batch_argnums=(1, 2))
    )
    assert_tree_close(fn(params, x, y), loop_grads(params, x, y), rtol=1e-5, atol=1e-6)


def test_has_aux_and_dict_batch():
    params, x, y = make()

    def loss_aux(p, batch):
        loss = loss_fn(p, batch["x"], batch["y"])
        return loss, {"loss": loss}

    grads, aux = adaclip_jax.per_example_grads(loss_aux, has_aux=True, micro_batch_size=4)(
        params, {"x": x, "y": y}
    )
    assert_tree_close(grads, loop_grads(params, x, y), rtol=1e-5, atol=1e-6)
    expected = np.array([loss_fn(params, x[i], y[i]) for i in range(8)])
    np.testing.assert_allclose(np.asarray(aux["loss"]), expected, rtol=1e-5)


def test_argnums_other_than_zero():
    params, x, y = make()
    fn = adaclip_jax.per_example_grads(lambda xx, p, yy: loss_fn(p, xx, yy), argnums=1, batch_argnums=(0, 2))
    assert_tree_close(fn(x, params, y), loop_grads(params, x, y), rtol=1e-5, atol=1e-6)


def test_user_level_units_sum_before_clipping():
    params, x, y = make()
    user_ids = jnp.array([2, 0, 2, 1, 0, 2, 4, 4])  # user 3 absent
    fn = jax.jit(adaclip_jax.per_example_grads(loss_fn, batch_argnums=(1, 2), num_units=5))
    per_user, mask = fn(params, x, y, unit_ids=user_ids)
    per_ex = loop_grads(params, x, y)
    ids = np.asarray(user_ids)
    expected = jax.tree.map(lambda g: jnp.stack([g[ids == u].sum(0) for u in range(5)]), per_ex)
    assert_tree_close(per_user, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(mask), [True, True, True, False, True])

    # The private step on users equals the reference on the users present (user-level DP).
    with jax.enable_x64(True):
        per_user64 = jax.tree.map(lambda g: jnp.asarray(g, jnp.float64), per_user)
        params64 = jax.tree.map(lambda g: jnp.asarray(g, jnp.float64), params)
        tx = adaclip_jax.adaclip(noise_multiplier=0.0, expected_batch_size=4.0, key=0, preset="patent")
        update, _ = jax.jit(tx.update)(per_user64, tx.init(params64), params64, unit_mask=mask)
        rows = np.concatenate(
            [np.asarray(g, np.float64).reshape(5, -1) for g in jax.tree_util.tree_leaves(per_user64)], axis=1
        )[np.asarray(mask)]
        d = rows.shape[1]
        ref, _, _ = reference.adaclip_step(
            rows,
            np.zeros(d),
            np.full(d, np.sqrt(1e-5)),
            np.zeros(d),
            noise_multiplier=0.0,
            expected_batch_size=4.0,
            std_min=1e-5,
            std_max=1.0,
        )
        got = np.concatenate([np.asarray(u).ravel() for u in jax.tree_util.tree_leaves(update)])
        np.testing.assert_allclose(got, ref, rtol=1e-10, atol=1e-14)


def test_sum_by_unit_drops_out_of_range_ids():
    g = {"a": jnp.arange(6.0).reshape(3, 2)}
    per_unit, mask = adaclip_jax.sum_by_unit(g, jnp.array([0, 5, 0]), num_units=2)
    np.testing.assert_array_equal(np.asarray(per_unit["a"]), [[4.0, 6.0], [0.0, 0.0]])
    np.testing.assert_array_equal(np.asarray(mask), [True, False])


def test_bad_arguments():
    params, x, y = make()
    with pytest.raises(InvalidHyperparameterError, match="micro_batch_size"):
        adaclip_jax.per_example_grads(loss_fn, micro_batch_size=0)
    with pytest.raises(InvalidHyperparameterError, match="argnums"):
        adaclip_jax.per_example_grads(loss_fn, argnums=1, batch_argnums=1)
    fn = adaclip_jax.per_example_grads(loss_fn, batch_argnums=(1, 2), micro_batch_size=3)
    with pytest.raises(InvalidGradientError, match="multiple"):
        fn(params, x, y)
    fn = adaclip_jax.per_example_grads(loss_fn, batch_argnums=(1, 2))
    with pytest.raises(InvalidGradientError, match="leading sizes"):
        fn(params, x, y[:5])
    with pytest.raises(InvalidGradientError, match="leading batch axis"):
        fn(params, x, jnp.float32(1.0))
    with pytest.raises(InvalidHyperparameterError, match="unit_ids"):
        adaclip_jax.per_example_grads(loss_fn, batch_argnums=(1, 2), num_units=3)(params, x, y)
    with pytest.raises(InvalidGradientError, match="unit_ids"):
        adaclip_jax.sum_by_unit({"a": jnp.zeros((3, 2))}, jnp.zeros((4,), jnp.int32), num_units=2)


@pytest.mark.parametrize("micro_batch_size", [None, 2])
@pytest.mark.parametrize("kind", ["adaclip", "per_layer"])
def test_clipped_sum_grads_equals_per_example_path(micro_batch_size, kind):
    """Clipping chunk by chunk, then releasing, equals clipping all per-unit gradients."""
    params, x, y = make()
    mask = jnp.array([True, True, False, True, True, True, False, True])
    with jax.enable_x64(True):
        params = jax.tree.map(lambda p: jnp.asarray(p, jnp.float64), params)
        x, y = jnp.asarray(x, jnp.float64), jnp.asarray(y, jnp.float64)
        if kind == "adaclip":
            tx = adaclip_jax.adaclip(noise_multiplier=0.9, expected_batch_size=6.0, key=3, std_min=1e-3, preset="patent")
        else:
            tx = adaclip_jax.per_layer_clip(
                max_grad_norm=0.3, noise_multiplier=0.9, expected_batch_size=6.0, key=3
            )
        state_a = state_b = tx.init(params)
        per_ex = adaclip_jax.per_example_grads(loss_fn, batch_argnums=(1, 2))
        fused = adaclip_jax.clipped_sum_grads(
            loss_fn, tx, micro_batch_size=micro_batch_size, batch_argnums=(1, 2)
        )

        @jax.jit
        def step_a(state):
            return tx.update(per_ex(params, x, y), state, params, unit_mask=mask)

        @jax.jit
        def step_b(state):
            return tx.update(fused(state, params, x, y, unit_mask=mask), state, params)

        for _ in range(2):  # the second step clips around a non-zero AdaCliP centre
            u_a, state_a = step_a(state_a)
            u_b, state_b = step_b(state_b)
            assert_tree_close(u_a, u_b, rtol=1e-10, atol=1e-13)
            if kind == "adaclip":
                assert_tree_close(state_a.std, state_b.std, rtol=1e-10)


def test_clipped_sum_grads_bad_arguments():
    params, x, y = make()
    tx = adaclip_jax.flat_clip(max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=4, key=0)
    chain = optax.chain(tx, optax.sgd(0.1))
    with pytest.raises(InvalidHyperparameterError, match="not a chain"):
        adaclip_jax.clipped_sum_grads(loss_fn, chain)
    fused = adaclip_jax.clipped_sum_grads(loss_fn, tx, micro_batch_size=3, batch_argnums=(1, 2))
    with pytest.raises(InvalidGradientError, match="multiple"):
        fused(tx.init(params), params, x, y)
    summed = adaclip_jax.clipped_sum_grads(loss_fn, tx, batch_argnums=(1, 2))(tx.init(params), params, x, y)
    with pytest.raises(InvalidGradientError, match="unit_mask"):
        tx.update(summed, tx.init(params), params, unit_mask=jnp.ones(8, bool))
