"""An optax user's day-one habits with adaclip_jax: MultiSteps, np.savez of the state, eager calls."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import adaclip_jax
from adaclip.accounting import Accountant
from adaclip.errors import InvalidGradientError, InvalidHyperparameterError
from adaclip_jax import _transform

pytestmark = pytest.mark.jax


def _loss(params, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(x @ params["w"] + params["b"], y)


def _data(n=24, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 6)).astype(np.float32), rng.integers(0, 3, size=n)


PARAMS = {"w": jnp.full((6, 3), 0.1), "b": jnp.zeros(3)}


def _private(**kw):
    return adaclip_jax.flat_clip(max_grad_norm=0.5, noise_multiplier=1.0, expected_batch_size=24, key=3, **kw)


# --- optax.MultiSteps --------------------------------------------------------------------------


def test_multisteps_init_is_refused_naming_the_accumulation_helpers():
    tx = optax.MultiSteps(optax.chain(_private(), optax.adam(1e-3)), 4)
    with pytest.raises(InvalidHyperparameterError, match="MultiSteps") as err:
        tx.init(PARAMS)
    assert "clipped_sum_grads" in str(err.value) and "add_clipped_sums" in str(err.value)


def test_multisteps_update_is_refused_too():
    inner = optax.chain(_private(), optax.sgd(0.1))
    tx = optax.MultiSteps(inner, 2)
    # a MultiSteps state built around an inner state initialised outside MultiSteps
    inner_state = inner.init(PARAMS)
    state = optax.MultiStepsState(
        mini_step=jnp.zeros([], jnp.int32),
        gradient_step=jnp.zeros([], jnp.int32),
        inner_opt_state=inner_state,
        acc_grads=jax.tree_util.tree_map(jnp.zeros_like, PARAMS),
        skip_state=(),
    )
    x, y = _data()
    grads = adaclip_jax.per_example_grads(_loss, batch_argnums=(1, 2))(PARAMS, x, y)
    with pytest.raises(InvalidHyperparameterError, match="MultiSteps"):
        tx.update(grads, state, PARAMS)


def test_physical_batches_added_equal_the_logical_batch():
    x, y = _data(24)
    private = _private()
    tx = adaclip_jax.private_chain(private, optax.sgd(1.0))
    state = tx.init(PARAMS)
    clip = adaclip_jax.clipped_sum_grads(_loss, private, batch_argnums=(1, 2))
    whole = clip(state[0], PARAMS, x, y)
    parts = [clip(state[0], PARAMS, x[i : i + 8], y[i : i + 8]) for i in range(0, 24, 8)]
    total = adaclip_jax.add_clipped_sums(*parts)
    for a, b in zip(jax.tree_util.tree_leaves(whole.summed), jax.tree_util.tree_leaves(total.summed)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    # one release of the logical batch: the same noise and the same state as the whole batch
    u_whole, s_whole = tx.update(whole, state, PARAMS)
    u_total, s_total = tx.update(total, state, PARAMS)
    for a, b in zip(jax.tree_util.tree_leaves(u_whole), jax.tree_util.tree_leaves(u_total)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    assert int(s_total[0].step) == int(s_whole[0].step) == 1


def test_logical_batch_is_one_accounted_step():
    x, y = _data(24)
    private = _private()
    tx = adaclip_jax.private_chain(private, optax.sgd(1.0))
    state = tx.init(PARAMS)
    clip = adaclip_jax.clipped_sum_grads(_loss, private, batch_argnums=(1, 2))
    tracker = adaclip_jax.PrivacyTracker(Accountant("rdp"), noise_multiplier=1.0, sample_rate=0.25)
    for _ in range(3):
        total = adaclip_jax.add_clipped_sums(*(clip(state[0], PARAMS, x[i : i + 6], y[i : i + 6]) for i in range(0, 24, 6)))
        _, state = tracker.step(tx.update, total, state, PARAMS)
    assert tracker.accountant.steps == 3  # one per logical batch, not one per physical batch
    reference = Accountant("rdp")
    for _ in range(3):
        reference.step(sample_rate=0.25, noise_multiplier=1.0)
    assert tracker.accountant.epsilon(1e-5) == pytest.approx(reference.epsilon(1e-5))


def test_add_clipped_sums_refuses_mismatches():
    x, y = _data(8)
    private = _private()
    state = private.init(PARAMS)
    clip = adaclip_jax.clipped_sum_grads(_loss, private, batch_argnums=(1, 2))
    a = clip(state, PARAMS, x, y)
    with pytest.raises(InvalidGradientError):
        adaclip_jax.add_clipped_sums()
    with pytest.raises(InvalidGradientError):
        adaclip_jax.add_clipped_sums(a, a.summed)
    other = adaclip_jax.ClippedSum(summed={"w": a.summed["w"]}, auxiliary=a.auxiliary)
    with pytest.raises(InvalidGradientError):
        adaclip_jax.add_clipped_sums(a, other)


# --- np.savez of the state ---------------------------------------------------------------------


@pytest.mark.parametrize("build", [lambda: _private(), lambda: adaclip_jax.adaclip(noise_multiplier=1.0, expected_batch_size=24, key=1, noise_mechanism="banded", bands=3)])
def test_state_saves_with_np_savez_and_resumes_exactly(tmp_path, build):
    tx = adaclip_jax.private_chain(build(), optax.adam(1e-2))
    x, y = _data()
    grads = adaclip_jax.per_example_grads(_loss, batch_argnums=(1, 2))(PARAMS, x, y)
    state = tx.init(PARAMS)
    _, state = tx.update(grads, state, PARAMS)
    with pytest.raises(TypeError):  # the habit fails on the raw state
        np.savez(tmp_path / "raw.npz", *jax.tree_util.tree_leaves(state))
    leaves = jax.tree_util.tree_leaves(adaclip_jax.state_to_numpy(state))
    assert all(isinstance(v, np.ndarray) for v in leaves)
    np.savez(tmp_path / "s.npz", *leaves)
    with np.load(tmp_path / "s.npz") as f:
        loaded = [f[f"arr_{i}"] for i in range(len(f.files))]
    template = tx.init(PARAMS)
    restored = adaclip_jax.state_from_numpy(
        jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(template), loaded), template
    )
    u1, _ = tx.update(grads, state, PARAMS)
    u2, _ = tx.update(grads, restored, PARAMS)
    for a, b in zip(jax.tree_util.tree_leaves(u1), jax.tree_util.tree_leaves(u2)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_state_from_numpy_refuses_a_foreign_template():
    ada = adaclip_jax.adaclip(noise_multiplier=1.0, expected_batch_size=24, key=1)
    state = ada.init(PARAMS)
    arrays = adaclip_jax.state_to_numpy(state)
    other = adaclip_jax.adaclip(noise_multiplier=1.0, expected_batch_size=24, key=1).init({"w": jnp.zeros((6, 3))})
    with pytest.raises(InvalidHyperparameterError):
        adaclip_jax.state_from_numpy(arrays, other)
    bad = arrays._replace(key=np.zeros(3, np.uint32))
    with pytest.raises(InvalidHyperparameterError, match="key"):
        adaclip_jax.state_from_numpy(bad, state)


# --- eager calls run compiled ------------------------------------------------------------------


def test_eager_update_runs_compiled_and_equals_the_jitted_one(monkeypatch):
    seen = []
    original = _transform._compile_eager_call

    def spy(*args):
        seen.append(original(*args))
        return seen[-1]

    monkeypatch.setattr(_transform, "_compile_eager_call", spy)
    tx = adaclip_jax.private_chain(adaclip_jax.adaclip(noise_multiplier=1.0, expected_batch_size=24, key=5), optax.sgd(0.1))
    x, y = _data()
    grads = adaclip_jax.per_example_grads(_loss, batch_argnums=(1, 2))(PARAMS, x, y)
    state = tx.init(PARAMS)
    eager, eager_state = tx.update(grads, state, PARAMS)
    assert seen == [True]
    jitted, jitted_state = jax.jit(tx.update)(grads, state, PARAMS)
    assert seen == [True, False]  # inside the user's jit nothing changes
    for a, b in zip(jax.tree_util.tree_leaves((eager, eager_state.__getitem__(0).mean)), jax.tree_util.tree_leaves((jitted, jitted_state[0].mean))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    tx.update(grads, state, PARAMS, noise_multiplier=1.0)
    assert seen[-1] is False  # an explicit σ stays eager: a bad value raises before anything changes
    with pytest.raises(InvalidHyperparameterError):
        tx.update(grads, state, PARAMS, noise_multiplier=-1.0)
    with jax.disable_jit():
        tx.update(grads, state, PARAMS)
    assert seen[-1] is False
