"""Fixed-shape Poisson and cyclic Poisson batches in JAX (``adaclip_jax.padded_batch``): the
sampled units' indices padded to a bucket, so a jitted step touches a batch, not all N units.

Checked: the same units as the full mask, step by step; the padded rows masked out; a private
update on the padded batch equal to the update on all N units with the mask (the release of the
Poisson batch, padding free); no truncation (a batch larger than a bucket goes to the next one,
and to N); the buckets refused when they could truncate."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import adaclip_jax
from adaclip.errors import InvalidHyperparameterError

N = 512


@pytest.mark.parametrize("bands", [1, 4])
def test_the_padded_batch_holds_exactly_the_sampled_units(bands):
    q = 0.05
    groups = adaclip_jax.assign_groups(jax.random.key(3), N, bands)
    buckets = adaclip_jax.batch_buckets(q * N, N)
    sizes = set()
    for step in range(12):
        indices, mask = adaclip_jax.padded_batch(jax.random.key(1), step, groups, q * bands, bands=bands,
                                                 buckets=buckets)  # fmt: skip
        full = np.asarray(adaclip_jax.cyclic_poisson_mask(jax.random.key(1), step, groups, q * bands, bands=bands))
        count = int(full.sum())
        assert indices.shape == mask.shape and indices.shape[0] in buckets and indices.shape[0] >= count
        np.testing.assert_array_equal(np.asarray(indices)[np.asarray(mask)], np.flatnonzero(full))
        assert int(mask.sum()) == count and not np.asarray(mask)[count:].any()
        sizes.add(indices.shape[0])
    assert len(sizes) <= 3  # a few compilations, not one per batch size


def test_a_batch_larger_than_a_bucket_goes_to_the_next_never_truncated():
    groups = adaclip_jax.assign_groups(jax.random.key(3), N, 1)
    indices, mask = adaclip_jax.padded_batch(jax.random.key(1), 0, groups, 0.2, bands=1, buckets=(8, 16, N))
    full = np.asarray(adaclip_jax.cyclic_poisson_mask(jax.random.key(1), 0, groups, 0.2, bands=1))
    assert indices.shape == (N,) and int(mask.sum()) == int(full.sum()) > 16


@pytest.mark.parametrize("buckets", [(64, 128), (128, 64, N), (0, N), (64.0, N), ()])
def test_buckets_that_could_truncate_are_refused(buckets):
    groups = adaclip_jax.assign_groups(jax.random.key(3), N, 1)
    with pytest.raises(InvalidHyperparameterError, match="buckets"):
        adaclip_jax.padded_batch(jax.random.key(1), 0, groups, 0.1, bands=1, buckets=buckets)


def test_the_update_on_the_padded_batch_equals_the_update_on_all_units_with_the_mask():
    """Banded noise (b = 2), flat clipping: the same key, the same state, the same release."""
    rng = np.random.default_rng(0)
    x, y = jnp.asarray(rng.standard_normal((N, 5)), jnp.float32), jnp.asarray(rng.integers(0, 3, N))
    params = {"w": jnp.asarray(rng.standard_normal((5, 3)) * 0.1, jnp.float32), "b": jnp.zeros(3)}

    def loss(p, xb, yb):
        return optax.softmax_cross_entropy_with_integer_labels(xb @ p["w"] + p["b"], yb)

    grads = adaclip_jax.per_example_grads(loss, batch_argnums=(1, 2))
    tx = adaclip_jax.flat_clip(max_grad_norm=0.5, noise_multiplier=1.0, expected_batch_size=0.05 * N,
                               key=jax.random.key(9), noise_mechanism="banded", bands=2)  # fmt: skip
    groups = adaclip_jax.assign_groups(jax.random.key(3), N, 2)
    buckets = adaclip_jax.batch_buckets(0.05 * N, N)
    full_state = padded_state = tx.init(params)
    for step in range(4):
        mask = adaclip_jax.cyclic_poisson_mask(jax.random.key(1), step, groups, 0.1, bands=2)
        full, full_state = tx.update(grads(params, x, y), full_state, params, unit_mask=mask)
        indices, unit_mask = adaclip_jax.padded_batch(jax.random.key(1), step, groups, 0.1, bands=2, buckets=buckets)
        padded, padded_state = tx.update(grads(params, x[indices], y[indices]), padded_state, params,
                                         unit_mask=unit_mask)  # fmt: skip
        assert indices.shape[0] < N
        for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(padded), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    # the run did release noise (equal zeros would pass the comparison above)
    assert float(jnp.abs(jax.tree.leaves(padded)[0]).max()) > 0


def test_the_default_buckets_rarely_fall_through_to_n():
    """Binomial batch sizes at B̄ = 256 over 20,000 steps: none above the largest bucket below N
    (the bound is about 1e-9 a step); with spread=1 (a negative control) many are."""
    buckets = adaclip_jax.batch_buckets(256.0, 100_000)
    counts = np.random.default_rng(0).binomial(100_000, 256 / 100_000, size=20_000)
    assert buckets[-1] == 100_000 and (counts > buckets[-2]).sum() == 0
    narrow = adaclip_jax.batch_buckets(256.0, 100_000, spread=1)
    assert (counts > narrow[-2]).sum() > 1000
