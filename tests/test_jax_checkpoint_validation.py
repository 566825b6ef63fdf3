"""``state_from_numpy(..., strategy=)``: a restored JAX state is checked by the core.

With ``strategy=`` (the strategy of the transformation that built the template),
:func:`adaclip_jax.state_from_numpy` runs the core's :func:`adaclip.mechanism.check_state` on
the strategy's part of every :class:`~adaclip_jax.AdaClipState` it restores: a corrupted
checkpoint (``s`` outside ``[std_min, std_max]``, a leaf of another shape, NaN, an option
state out of range) is refused with the core's message, and a state the transformation made
itself comes back exactly as without the check. Without ``strategy=`` nothing changes.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import adaclip_jax
from adaclip import strategies as S
from adaclip.errors import InvalidHyperparameterError

PARAMS = {"a": jnp.ones((3, 4)), "b": jnp.zeros(5)}


def _trained(tx, steps=3):
    """``(template, saved arrays)`` of ``tx`` after a few steps on random per-unit gradients."""
    state = tx.init(PARAMS)
    rng = np.random.default_rng(0)
    for _ in range(steps):
        grads = jax.tree_util.tree_map(lambda p: jnp.asarray(rng.normal(size=(6, *p.shape)), p.dtype), PARAMS)
        _, state = tx.update(grads, state, PARAMS)
    return tx.init(PARAMS), adaclip_jax.state_to_numpy(state)


def _patent():
    return adaclip_jax.adaclip(noise_multiplier=0.5, expected_batch_size=6.0, key=0, preset="patent",
                               std_min=1e-3, std_max=10.0)  # fmt: skip


def _equal_trees(x, y):
    xs, ys = jax.tree_util.tree_leaves(x), jax.tree_util.tree_leaves(y)
    assert jax.tree_util.tree_structure(x) == jax.tree_util.tree_structure(y) and len(xs) == len(ys)
    for a, b in zip(xs, ys):
        if jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize(
    "make",
    [
        _patent,
        lambda: adaclip_jax.adaclip(noise_multiplier=0.5, expected_batch_size=6.0, key=0),
        lambda: adaclip_jax.adaclip(noise_multiplier=0.5, expected_batch_size=6.0, key=0, pooling="factored",
                                    update_every=2, centre="kalman", quantile=S.QuantileRule()),
        lambda: adaclip_jax.flat_clip(max_grad_norm=1.0, noise_multiplier=0.5, expected_batch_size=6.0, key=0),
        lambda: adaclip_jax.quantile_clip(noise_multiplier=0.5, expected_batch_size=6.0, key=0),
    ],
    ids=["patent", "centred", "options", "flat", "quantile"],
)
def test_a_good_state_is_accepted_and_restored_as_without_the_check(make):
    tx = make()
    like, arrays = _trained(tx)
    checked = adaclip_jax.state_from_numpy(arrays, like, strategy=tx.strategy)
    _equal_trees(checked, adaclip_jax.state_from_numpy(arrays, like))


def test_negative_std_is_refused_with_the_core_message():
    tx = _patent()
    like, arrays = _trained(tx)
    bad = arrays._replace(std={**arrays.std, "a": -np.abs(arrays.std["a"])})
    adaclip_jax.state_from_numpy(bad, like)  # without the strategy: not checked, as before
    with pytest.raises(InvalidHyperparameterError, match=re.escape("is outside [std_min, std_max] = [0.001, 10.0]")):
        adaclip_jax.state_from_numpy(bad, like, strategy=tx.strategy)


def test_the_message_is_the_core_check_states_word_for_word():
    tx = _patent()
    like, arrays = _trained(tx)
    bad = arrays._replace(std={**arrays.std, "b": np.full(5, np.nan, np.float32)})
    leaves = jax.tree_util.tree_leaves
    core_like = S.ClipState(step=like.step, mean=leaves(like.mean), std=leaves(like.std), extra=like.extra)
    core_bad = S.ClipState(step=bad.step, mean=leaves(bad.mean), std=leaves(bad.std), extra=bad.extra)
    with pytest.raises(InvalidHyperparameterError) as core:
        tx.strategy.check_state(core_bad, core_like, source="restored state")
    with pytest.raises(InvalidHyperparameterError) as restored:
        adaclip_jax.state_from_numpy(bad, like, strategy=tx.strategy)
    assert str(restored.value) == str(core.value) == "restored state clip_state['std'] for tensor 1 contains NaN or inf"


def test_wrong_shape_is_refused_with_the_core_message():
    tx = _patent()
    like, arrays = _trained(tx)
    bad = arrays._replace(mean={**arrays.mean, "a": np.zeros((4, 3), np.float32)})
    with pytest.raises(InvalidHyperparameterError, match=re.escape("clip_state['mean'] for tensor 0 has shape (4, 3), expected (3, 4)")):
        adaclip_jax.state_from_numpy(bad, like, strategy=tx.strategy)


def test_nan_in_the_mean_is_refused():
    tx = _patent()
    like, arrays = _trained(tx)
    mean = np.array(arrays.mean["a"])
    mean[1, 2] = np.nan
    bad = arrays._replace(mean={**arrays.mean, "a": mean})
    with pytest.raises(InvalidHyperparameterError, match=re.escape("clip_state['mean'] for tensor 0 contains NaN or inf")):
        adaclip_jax.state_from_numpy(bad, like, strategy=tx.strategy)


def test_option_state_out_of_range_is_refused():
    tx = adaclip_jax.quantile_clip(noise_multiplier=0.5, expected_batch_size=6.0, key=0)
    like, arrays = _trained(tx)
    bad = arrays._replace(extra={**arrays.extra, "clip_norm": np.asarray(-1.0, np.float32)})
    with pytest.raises(InvalidHyperparameterError, match=re.escape("clip_state['extra']['clip_norm'] must be > 0")):
        adaclip_jax.state_from_numpy(bad, like, strategy=tx.strategy)


def test_the_state_inside_a_chain_is_checked():
    tx = _patent()
    chain = optax.chain(tx, optax.sgd(0.1))
    like, arrays = _trained(chain)
    good = adaclip_jax.state_from_numpy(arrays, like, strategy=tx.strategy)
    _equal_trees(good, adaclip_jax.state_from_numpy(arrays, like))
    own = arrays[0]
    bad = (own._replace(std={**own.std, "a": np.full((3, 4), 1e3, np.float32)}), *arrays[1:])
    with pytest.raises(InvalidHyperparameterError, match=re.escape("is outside [std_min, std_max]")):
        adaclip_jax.state_from_numpy(bad, like, strategy=tx.strategy)


def test_a_negative_step_is_refused():
    tx = _patent()
    like, arrays = _trained(tx)
    bad = arrays._replace(step=np.asarray(-1, np.int32))
    with pytest.raises(InvalidHyperparameterError, match=re.escape("clip_state['step'] must be an int >= 0")):
        adaclip_jax.state_from_numpy(bad, like, strategy=tx.strategy)


def test_strategy_given_but_no_private_state_is_refused():
    like = optax.sgd(0.1).init(PARAMS)
    arrays = adaclip_jax.state_to_numpy(like)
    with pytest.raises(InvalidHyperparameterError, match="holds no AdaClipState"):
        adaclip_jax.state_from_numpy(arrays, like, strategy=S.FlatClipping(1.0))
