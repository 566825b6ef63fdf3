"""Properties of adaclip.reference, the implementation that decides correctness."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from adaclip import reference as R
from adaclip.errors import InvalidGradientError, InvalidHyperparameterError


def independent_adaclip_step(G, m, s, z, sigma, B, beta1, beta2, smin, smax):
    """A second implementation, written from the algorithm's steps with explicit Python loops."""
    n, d = G.shape
    total = 0.0
    for j in range(d):
        total += s[j]
    b = [np.sqrt(s[j]) * np.sqrt(total) for j in range(d)]
    acc = [0.0] * d
    for i in range(n):
        w = [(G[i, j] - m[j]) / b[j] for j in range(d)]
        norm = np.sqrt(sum(x * x for x in w))
        scale = 1.0 if norm <= 1.0 else 1.0 / norm
        for j in range(d):
            acc[j] += w[j] * scale
    gt = np.empty(d)
    new_m = np.empty(d)
    new_s = np.empty(d)
    for j in range(d):
        gt[j] = b[j] * ((acc[j] + sigma * z[j]) / B) + m[j]
        v = (gt[j] - m[j]) ** 2 - b[j] ** 2 * sigma**2 / B**2
        v = min(max(v, smin**2), smax**2)
        new_s[j] = np.sqrt(beta2 * s[j] ** 2 + (1 - beta2) * v)
        new_m[j] = beta1 * m[j] + (1 - beta1) * gt[j]
    return gt, new_m, new_s


@st.composite
def adaclip_inputs(draw):
    n = draw(st.integers(1, 6))
    d = draw(st.integers(1, 9))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    smin = draw(st.sampled_from([1e-4, 1e-3, 1e-2]))
    smax = smin * draw(st.sampled_from([1.0, 10.0, 1e3]))
    G = rng.normal(scale=draw(st.sampled_from([1e-3, 0.1, 1.0, 10.0])), size=(n, d))
    m = rng.normal(scale=0.1, size=d)
    s = rng.uniform(smin, smax, size=d)
    z = rng.normal(size=d)
    sigma = draw(st.sampled_from([0.0, 0.5, 1.1, 3.0]))
    B = draw(st.sampled_from([1.0, float(n), 2.5 * n]))
    return G, m, s, z, sigma, B, smin, smax


@given(adaclip_inputs(), st.sampled_from([0.0, 0.5, 0.99]), st.sampled_from([0.0, 0.9]))
def test_matches_independent_implementation(inputs, beta1, beta2):
    G, m, s, z, sigma, B, smin, smax = inputs
    got = R.adaclip_step(
        G, m, s, z, noise_multiplier=sigma, expected_batch_size=B,
        beta_mean=beta1, beta_std=beta2, std_min=smin, std_max=smax,
    )
    want = independent_adaclip_step(G, m, s, z, sigma, B, beta1, beta2, smin, smax)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


def test_no_noise_and_huge_std_is_the_plain_mean_gradient():
    rng = np.random.default_rng(0)
    G = rng.normal(size=(8, 5))
    m = rng.normal(size=5)
    s = np.full(5, 1e6)
    gt, _, _ = R.adaclip_step(
        G, m, s, rng.normal(size=5), noise_multiplier=0.0, expected_batch_size=8,
        std_min=1e6, std_max=1e6,
    )
    np.testing.assert_allclose(gt, G.mean(axis=0), rtol=1e-10, atol=1e-12)


@given(adaclip_inputs())
def test_each_contribution_has_transformed_norm_at_most_one(inputs):
    G, m, s, z, _, _, smin, smax = inputs
    b = R.auxiliary_transform(s)
    for row in G:  # one unit, no noise, B̄ = 1: the release is that unit's clipped vector
        gt, _, _ = R.adaclip_step(
            row[None, :], m, s, z, noise_multiplier=0.0, expected_batch_size=1.0, std_min=smin, std_max=smax
        )
        w_bar = (gt - m) / b
        assert np.linalg.norm(w_bar) <= 1.0 + 1e-12
        w = (row - m) / b
        if np.linalg.norm(w) <= 1.0:  # inside the ball: untouched
            np.testing.assert_allclose(w_bar, w, rtol=1e-12, atol=1e-15)


@given(adaclip_inputs(), st.integers(1, 5))
def test_std_stays_in_range_over_many_steps(inputs, steps):
    G, m, s, z, sigma, B, smin, smax = inputs
    rng = np.random.default_rng(1)
    for _ in range(steps):
        _, m, s = R.adaclip_step(
            G, m, s, rng.normal(size=s.shape), noise_multiplier=sigma, expected_batch_size=B,
            std_min=smin, std_max=smax,
        )
        assert np.all(s >= smin * (1 - 1e-12)) and np.all(s <= smax * (1 + 1e-12))


@given(adaclip_inputs())
def test_equal_stds_is_flat_clipping_with_matching_clip_norm(inputs):
    G, _, s, z, sigma, B, smin, smax = inputs
    d = G.shape[1]
    s0 = float(np.sqrt(smin * smax))
    gt, _, _ = R.adaclip_step(
        G, np.zeros(d), np.full(d, s0), z, noise_multiplier=sigma, expected_batch_size=B,
        std_min=smin, std_max=smax,
    )
    flat = R.flat_clip_step(G, z, max_grad_norm=s0 * np.sqrt(d), noise_multiplier=sigma, expected_batch_size=B)
    np.testing.assert_allclose(gt, flat, rtol=1e-12, atol=1e-15)


@given(adaclip_inputs(), st.integers(0, 2**31 - 1))
def test_invariant_to_the_order_of_examples(inputs, seed):
    G, m, s, z, sigma, B, smin, smax = inputs
    perm = np.random.default_rng(seed).permutation(G.shape[0])
    kw = dict(noise_multiplier=sigma, expected_batch_size=B, std_min=smin, std_max=smax)
    for a, b in zip(R.adaclip_step(G, m, s, z, **kw), R.adaclip_step(G[perm], m, s, z, **kw)):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_shapes_and_dtypes(dtype):
    rng = np.random.default_rng(2)
    G = rng.normal(size=(4, 6)).astype(dtype)
    m = np.zeros(6, dtype)
    s = np.full(6, 0.1, dtype)
    z = rng.normal(size=6).astype(dtype)
    out = R.adaclip_step(G, m, s, z, noise_multiplier=1.0, expected_batch_size=4, std_min=0.01, std_max=1.0)
    for x in out:
        assert x.shape == (6,) and x.dtype == dtype
    flat = R.flat_clip_step(G, z, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=4)
    assert flat.shape == (6,) and flat.dtype == dtype


def test_denominator_is_the_expected_batch_size_not_n():
    """Units sitting exactly at the mean contribute w = 0: adding them changes nothing, so the
    realised n never enters the release (dividing by n would change it)."""
    rng = np.random.default_rng(3)
    G = rng.normal(size=(3, 4))
    m = rng.normal(size=4)
    s = np.full(4, 0.5)
    z = rng.normal(size=4)
    kw = dict(noise_multiplier=1.0, expected_batch_size=5.0, std_min=0.1, std_max=1.0)
    a = R.adaclip_step(G, m, s, z, **kw)
    b = R.adaclip_step(np.vstack([G, m, m]), m, s, z, **kw)
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, rtol=1e-13)


def test_state_sees_gradients_only_through_the_noisy_release():
    """Two different batches whose noisy releases coincide (noise chosen to make them so)
    yield the same new state: m and s are functions of the release only."""
    rng = np.random.default_rng(4)
    d = 7
    m = rng.normal(scale=0.1, size=d)
    s = rng.uniform(0.05, 0.5, size=d)
    sigma, B = 1.3, 4.0
    G1 = rng.normal(size=(4, d))
    G2 = rng.normal(scale=5.0, size=(2, d))
    b = R.auxiliary_transform(s)

    def clipped_sum(G):
        w = (G - m) / b
        return (w * np.minimum(1.0, 1.0 / np.linalg.norm(w, axis=1))[:, None]).sum(axis=0)

    z1 = rng.normal(size=d)
    z2 = z1 + (clipped_sum(G1) - clipped_sum(G2)) / sigma
    kw = dict(noise_multiplier=sigma, expected_batch_size=B, std_min=0.01, std_max=1.0)
    g1, m1, s1 = R.adaclip_step(G1, m, s, z1, **kw)
    g2, m2, s2 = R.adaclip_step(G2, m, s, z2, **kw)
    np.testing.assert_allclose(g1, g2, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(m1, m2, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(s1, s2, rtol=1e-12, atol=1e-14)
    # and update_moments is exactly the reference's state update
    um, us = R.update_moments(g1, m, s, noise_multiplier=sigma, expected_batch_size=B, std_min=0.01, std_max=1.0)
    np.testing.assert_array_equal(um, m1)
    np.testing.assert_array_equal(us, s1)


def test_per_layer_default_thresholds_and_noise():
    rng = np.random.default_rng(5)
    G = rng.normal(scale=3.0, size=(5, 6))
    z = rng.normal(size=6)
    C, sigma, B = 2.0, 0.7, 5.0
    got = R.per_layer_clip_step(G, z, groups=[2, 4], max_grad_norm=C, noise_multiplier=sigma, expected_batch_size=B)
    want = np.zeros(6)
    for sl in (slice(0, 2), slice(2, 6)):
        block = G[:, sl]
        norms = np.linalg.norm(block, axis=1)
        want[sl] = (block * np.minimum(1, (C / np.sqrt(2)) / norms)[:, None]).sum(axis=0)
    want = (want + C * sigma * z) / B
    np.testing.assert_allclose(got, want, rtol=1e-12)


def test_scaled_clip_follows_edp_sgd():
    rng = np.random.default_rng(6)
    G = rng.normal(size=(5, 5))
    z = rng.normal(size=5)
    alphas, C, sigma, B = [0.5, 2.0], 1.5, 0.9, 4.0
    got = R.scaled_clip_step(
        G, z, groups=[3, 2], layer_scales=alphas, max_grad_norm=C, noise_multiplier=sigma, expected_batch_size=B
    )
    a = np.array([0.5] * 3 + [2.0] * 2)
    scaled = G / a
    clipped = scaled * np.minimum(1, C / np.linalg.norm(scaled, axis=1))[:, None]
    want = a * (clipped.sum(axis=0) + C * sigma * z) / B
    np.testing.assert_allclose(got, want, rtol=1e-12)


# ----------------------------------------------------------------------------- bad input


def _inputs():
    rng = np.random.default_rng(7)
    return rng.normal(size=(3, 4)), np.zeros(4), np.full(4, 0.1), rng.normal(size=4)


GOOD = dict(noise_multiplier=1.0, expected_batch_size=3.0, std_min=0.01, std_max=1.0)


@pytest.mark.parametrize(
    "mutate, error, words",
    [
        (lambda a: a.__setitem__(0, a[0][:0]), InvalidGradientError, "empty batch"),
        (lambda a: a.__setitem__(0, a[0][:, :3]), InvalidGradientError, "coordinates"),
        (lambda a: a.__setitem__(0, a[0][0]), InvalidGradientError, r"shape \(n, d\)"),
        (lambda a: a.__setitem__(2, a[2][:3]), InvalidGradientError, "std must have shape"),
        (lambda a: a.__setitem__(3, a[3][:2]), InvalidGradientError, "noise must have shape"),
    ],
)
def test_bad_gradients_raise_clearly_and_touch_nothing(mutate, error, words):
    args = list(_inputs())
    mutate(args)
    copies = [np.array(a, copy=True) for a in args]
    with pytest.raises(error, match=words):
        R.adaclip_step(*args, **GOOD)
    for a, c in zip(args, copies):
        np.testing.assert_array_equal(a, c)


@pytest.mark.parametrize(
    "override, name",
    [
        (dict(noise_multiplier=-1.0), "noise_multiplier"),
        (dict(noise_multiplier=float("nan")), "noise_multiplier"),
        (dict(expected_batch_size=0.0), "expected_batch_size"),
        (dict(std_min=2.0, std_max=1.0), "std_min must be <= std_max"),
        (dict(std_min=0.0), "std_min"),
        (dict(beta_mean=1.0), "beta_mean"),
        (dict(beta_std=-0.1), "beta_std"),
    ],
)
def test_bad_hyperparameters_are_named(override, name):
    with pytest.raises(InvalidHyperparameterError, match=name):
        R.adaclip_step(*_inputs(), **{**GOOD, **override})


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_non_finite_unit_contributes_nothing(bad):
    """A unit with a NaN/inf entry is dropped: the release equals the release without it, in
    every step of the reference (its presence must not turn the release into NaN or an error)."""
    G, m, s, z = _inputs()
    with_bad = np.concatenate([G, G[:1]])
    with_bad[-1, 2] = bad
    np.testing.assert_array_equal(R.adaclip_step(with_bad, m, s, z, **GOOD)[0], R.adaclip_step(G, m, s, z, **GOOD)[0])
    flat = dict(max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=3)
    np.testing.assert_array_equal(R.flat_clip_step(with_bad, z, **flat), R.flat_clip_step(G, z, **flat))
    layer = dict(groups=[2, 2], **flat)
    np.testing.assert_array_equal(R.per_layer_clip_step(with_bad, z, **layer), R.per_layer_clip_step(G, z, **layer))
    only_bad = with_bad[-1:]
    np.testing.assert_array_equal(
        R.flat_clip_step(only_bad, z, **flat), R.flat_clip_step(np.zeros((0, 4)), z, allow_empty=True, **flat)
    )


def test_empty_batch_allowed_for_poisson_sampling_releases_noise_only():
    _, m, s, z = _inputs()
    gt, _, _ = R.adaclip_step(np.zeros((0, 4)), m, s, z, allow_empty=True, **GOOD)
    np.testing.assert_allclose(gt, R.auxiliary_transform(s) * z / 3.0 + m)


def test_flat_clip_bad_input():
    G, _, _, z = _inputs()
    with pytest.raises(InvalidHyperparameterError, match="max_grad_norm"):
        R.flat_clip_step(G, z, max_grad_norm=0.0, noise_multiplier=1.0, expected_batch_size=3)
    with pytest.raises(InvalidHyperparameterError, match="groups"):
        R.per_layer_clip_step(G, z, groups=[1, 2], max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=3)
    with pytest.raises(InvalidHyperparameterError, match="layer_scales"):
        R.scaled_clip_step(
            G, z, groups=[2, 2], layer_scales=[1.0, -1.0], max_grad_norm=1.0, noise_multiplier=1.0,
            expected_batch_size=3,
        )
