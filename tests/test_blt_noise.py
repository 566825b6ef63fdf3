"""BLT correlated noise (adaclip.correlated.blt) and its accounting without amplification
(adaclip.accounting.MinSeparationGaussian / MinSeparationParticipation)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import scipy.linalg
import scipy.stats

from adaclip.accounting import (
    Accountant,
    MinSeparationGaussian,
    MinSeparationParticipation,
    calibrate_noise_multiplier,
)
from adaclip.correlated import NOISE_MECHANISMS, resolve_noise_mechanism
from adaclip.correlated import blt as B
from adaclip.errors import InvalidHyperparameterError

THETA = (0.93, 0.6, 0.2)
OMEGA = (0.25, 0.2, 0.1)


def _dense(theta, omega, n):
    c = B.blt_column(theta, omega, n)
    return scipy.linalg.toeplitz(c, np.zeros(n))


def test_column_matches_the_definition_and_inverse_is_the_dense_inverse():
    n = 15
    c = B.blt_column(THETA, OMEGA, n)
    direct = np.array([1.0] + [sum(w * t ** (k - 1) for t, w in zip(THETA, OMEGA)) for k in range(1, n)])
    np.testing.assert_allclose(c, direct, rtol=1e-13, atol=1e-15)
    inv = np.linalg.inv(_dense(THETA, OMEGA, n))
    np.testing.assert_allclose(B.blt_inverse_column(THETA, OMEGA, n), inv[:, 0], rtol=1e-11, atol=1e-14)
    np.testing.assert_allclose(inv, scipy.linalg.toeplitz(inv[:, 0], np.zeros(n)), atol=1e-13)  # Toeplitz


@pytest.mark.parametrize("theta,omega", [(THETA, OMEGA), ((0.5,), (1.0,)), ((0.99, 0.0), (0.3, 0.7))])
def test_streaming_equals_the_dense_solve(theta, omega):
    n, rng = 11, np.random.default_rng(0)
    mech = B.BltNoise(theta, omega)
    z = [rng.standard_normal((n, 3, 2)), rng.standard_normal((n, 4))]
    state, xs = mech.init(), []
    for t in range(n):
        x, state = mech.correlate(state, [z[0][t], z[1][t]])
        xs.append(x)
    assert state.step == n and len(state.history) == len(theta)
    inv = np.linalg.inv(_dense(theta, omega, n))
    for k in range(2):
        dense = np.einsum("ts,s...->t...", inv, z[k])
        np.testing.assert_allclose(np.stack([x[k] for x in xs]), dense, rtol=1e-10, atol=1e-12)


def test_correlate_leaves_the_state_unchanged_and_variance_is_the_row_norm():
    mech = B.BltNoise(THETA, OMEGA)
    s0 = mech.init()
    _, s1 = mech.correlate(s0, [np.ones(3)])
    before = [b[0].copy() for b in s1.history]
    mech.correlate(s1, [np.ones(3)])
    for b, old in zip(s1.history, before, strict=True):
        np.testing.assert_array_equal(b[0], old)
    inv = np.linalg.inv(_dense(THETA, OMEGA, 20))
    for t in (0, 1, 7, 19):
        assert mech.variance(t) == pytest.approx(float(np.sum(inv[t] ** 2)), rel=1e-12)


@pytest.mark.parametrize(
    "theta,omega",
    [((1.0,), (0.5,)), ((-0.1,), (0.5,)), ((0.5,), (-0.1,)), ((0.5, 0.4), (0.6, 0.6)), ((0.5,), (0.1, 0.2)), ((), ())],
)
def test_invalid_parameters_are_refused(theta, omega):
    with pytest.raises(InvalidHyperparameterError):
        B.BltNoise(theta, omega)


def _objective(mech, n, b):
    y = MinSeparationParticipation(b).worst_response(mech.column(n))
    return float(np.dot(y, y)) * B.prefix_error(mech.inverse_coefficients(n))


def test_fit_is_deterministic_cached_valid_and_beats_independent_noise():
    n, b = 400, 40
    first = B.fit_blt(n, buffers=2, min_separation=b)
    B._fit_cached.cache_clear()
    again = B.fit_blt(n, buffers=2, min_separation=b)
    assert (first.theta, first.omega) == (again.theta, again.omega)
    assert B._fit_cached.cache_info().currsize == 2  # m = 2 and its start, the m = 1 fit
    assert B.fit_blt(n, buffers=2, min_separation=b) == again and B._fit_cached.cache_info().hits >= 1
    assert all(0 < t < 1 for t in first.theta) and all(w >= 0 for w in first.omega) and sum(first.omega) < 1
    identity = (n / b) * (n + 1) / 2  # sens² = k, mean error (n+1)/2
    one = _objective(B.fit_blt(n, buffers=1, min_separation=b), n, b)
    two = _objective(first, n, b)
    assert two <= one * (1 + 1e-9) and one < identity / 10


def test_fit_rejects_bad_arguments():
    for kwargs in ({"buffers": 5}, {"buffers": 0}, {"error": "median"}, {"min_separation": 0}):
        with pytest.raises(InvalidHyperparameterError):
            B.fit_blt(50, **kwargs)


def test_resolve_blt():
    assert "blt" in NOISE_MECHANISMS
    mech = B.BltNoise(THETA, OMEGA)
    assert resolve_noise_mechanism(mech) is mech
    assert resolve_noise_mechanism("blt", steps=60, min_separation=6, buffers=2).buffers == 2
    for kwargs in ({}, {"bands": 2, "steps": 60, "min_separation": 6}):
        with pytest.raises(InvalidHyperparameterError):
            resolve_noise_mechanism("blt", **kwargs)
    with pytest.raises(InvalidHyperparameterError):
        resolve_noise_mechanism(mech, buffers=2)
    with pytest.raises(InvalidHyperparameterError):
        resolve_noise_mechanism("banded", bands=2, buffers=2)


# ---------------------------------------------------------------------------------- sensitivity


def _brute_force(column, n, b, k):
    """max over every pattern of at most k steps in [0, n), pairwise >= b apart, of ||C u||."""
    C = scipy.linalg.toeplitz(np.asarray(column)[:n], np.zeros(n))
    best = 0.0
    for size in range(1, k + 1):
        for pattern in itertools.combinations(range(n), size):
            if all(q - p >= b for p, q in itertools.pairwise(pattern)):
                u = np.zeros(n)
                u[list(pattern)] = 1
                best = max(best, float(np.linalg.norm(C @ u)))
    return best


@pytest.mark.parametrize("n,b", [(9, 2), (10, 3), (8, 8), (11, 4)])
def test_worst_pattern_is_the_earliest_comb(n, b):
    rng = np.random.default_rng(n * 10 + b)
    columns = [B.blt_column(THETA, OMEGA, n), np.sort(rng.uniform(0, 1, n))[::-1]]
    for column in columns:
        part = MinSeparationParticipation(b)
        k = part.participations(n)
        assert k == -(-n // b)
        assert part.sensitivity(column) == pytest.approx(_brute_force(column, n, b, k), rel=1e-12)
        capped = MinSeparationParticipation(b, max_participations=2)
        assert capped.sensitivity(column) == pytest.approx(_brute_force(column, n, b, min(k, 2)), rel=1e-12)


def test_sensitivity_needs_a_monotone_column_and_the_claim_fails_without_it():
    n, b = 9, 3
    column = np.array([1.0, 0.0, 0.0, 0.0, 0.9, 0.0, 0.0, 0.0, 0.0])  # non-negative, not monotone
    with pytest.raises(InvalidHyperparameterError):
        MinSeparationParticipation(b).sensitivity(column)
    comb = np.zeros(n)
    comb[[0, 3, 6]] = 1
    C = scipy.linalg.toeplitz(column, np.zeros(n))
    assert _brute_force(column, n, b, 3) > np.linalg.norm(C @ comb) + 1e-6  # the comb is not the worst here


@pytest.mark.parametrize("n,b", [(10, 1), (10, 3), (100, 7), (5, 9)])
def test_identity_sensitivity_is_sqrt_k(n, b):
    column = np.zeros(n)
    column[0] = 1
    part = MinSeparationParticipation(b)
    assert part.sensitivity(column) == pytest.approx(math.sqrt(-(-n // b)), rel=1e-15)
    capped = MinSeparationParticipation(b, max_participations=2)
    assert capped.sensitivity(column) == pytest.approx(math.sqrt(min(2, -(-n // b))), rel=1e-15)


def test_prefix_sensitivities_are_the_sensitivities_of_prefixes():
    n, b = 30, 4
    column = B.blt_column(THETA, OMEGA, n)
    part = MinSeparationParticipation(b)
    s = part.prefix_sensitivities_squared(column)
    assert s[0] == 0 and np.all(np.diff(s) > 0)
    for t in (1, 4, 5, 17, 30):
        assert s[t] == pytest.approx(part.sensitivity(column[:t]) ** 2, rel=1e-12)


# ---------------------------------------------------------------------------------- accounting


def _gaussian_delta(eps, mu):
    """Exact δ(ε) of the Gaussian mechanism with sensitivity/σ = mu (Balle & Wang 2018)."""
    return scipy.stats.norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * scipy.stats.norm.cdf(-eps / mu - mu / 2)


@pytest.mark.parametrize("sigma,sens", [(2.0, 1.0), (6.0, 3.0), (1.0, 1.5)])
def test_epsilon_of_the_gaussian_mechanism_matches_the_exact_value(sigma, sens):
    delta = 1e-5
    mech = MinSeparationGaussian(noise_multiplier=sigma, sensitivity=sens)
    assert mech.effective_noise_multiplier == sigma / sens
    exact = scipy.optimize.brentq(lambda e: _gaussian_delta(e, sens / sigma) - delta, 1e-6, 100)
    pld = mech.epsilon(delta)
    assert exact * (1 - 1e-9) <= pld <= exact * (1 + 2e-3)
    rdp = mech.epsilon(delta, accountant="rdp")
    assert rdp >= pld


def test_calibration_round_trip():
    target, delta, sens = 2.0, 1e-5, 3.2
    mech = MinSeparationGaussian.calibrate(target_epsilon=target, delta=delta, sensitivity=sens, tol=1e-5)
    assert mech.sensitivity == sens
    assert mech.epsilon(delta) <= target
    assert MinSeparationGaussian(noise_multiplier=mech.noise_multiplier * (1 - 1e-3), sensitivity=sens).epsilon(
        delta
    ) > target
    sigma1 = calibrate_noise_multiplier(target_epsilon=target, delta=delta, sample_rate=1.0, steps=1, accountant="pld")
    assert mech.noise_multiplier == pytest.approx(sigma1 * sens, rel=2e-4)


def test_invalid_accounting_arguments():
    for kwargs in ({"noise_multiplier": 0.0, "sensitivity": 1.0}, {"noise_multiplier": 1.0, "sensitivity": -1.0}):
        with pytest.raises(InvalidHyperparameterError):
            MinSeparationGaussian(**kwargs)
    with pytest.raises(InvalidHyperparameterError):
        MinSeparationParticipation(0)


def test_block_increments_compose_to_the_whole_run():
    """Recording σ/√(S(end) − S(start)) per block composes (RDP: exactly) to σ/Δ_n."""
    n, b, sigma, delta = 40, 8, 5.0, 1e-5
    column = B.blt_column(THETA, OMEGA, n)
    part = MinSeparationParticipation(b)
    s = part.prefix_sensitivities_squared(column)
    acc = Accountant(accountant="rdp")
    for start in range(0, n, b):
        acc.step(noise_multiplier=sigma / math.sqrt(s[min(start + b, n)] - s[start]), sample_rate=1.0)
    whole = MinSeparationGaussian(noise_multiplier=sigma, sensitivity=part.sensitivity(column))
    assert acc.epsilon(delta) == pytest.approx(whole.epsilon(delta, accountant="rdp"), rel=1e-9)


# ---------------------------------------------------------------------------------- statistics


def _stream_samples(mech, n, d, seed):
    rng = np.random.default_rng(seed)
    z = rng.standard_normal((n, d))
    state, xs = mech.init(), []
    for t in range(n):
        x, state = mech.correlate(state, [z[t]])
        xs.append(x[0])
    return np.stack(xs)  # (n, d): d independent samples of the n-step noise vector


def _covariance_ok(x, expected, d):
    emp = x @ x.T / d
    scale = np.sqrt(np.outer(np.diag(expected), np.diag(expected)) + expected**2)  # sd of x_s x_t
    return bool(np.all(np.abs(emp - expected) <= 5 * scale / math.sqrt(d)))


def test_released_noise_has_the_covariance_of_c_inverse():
    n, d = 8, 40_000
    mech = B.BltNoise(THETA, OMEGA)
    inv = np.linalg.inv(_dense(THETA, OMEGA, n))
    expected = inv @ inv.T
    x = _stream_samples(mech, n, d, seed=1)
    assert _covariance_ok(x, expected, d)
    # whitened by C the noise is iid N(0, 1): KS per step
    white = _dense(THETA, OMEGA, n) @ x
    assert min(scipy.stats.kstest(white[t], "norm").pvalue for t in range(n)) > 1e-4
    # negative controls: independent noise does not have that covariance, and x itself is not N(0,1)
    fresh = np.random.default_rng(2).standard_normal((n, d))
    assert not _covariance_ok(fresh, expected, d)
    assert scipy.stats.kstest(x[n - 1], "norm").pvalue < 1e-6


@pytest.mark.parametrize("mechanism", ["rdp", pytest.param("pld", marks=pytest.mark.slow)])
def test_block_calibration_meets_the_budget_as_the_accountant_composes_it(mechanism):
    from adaclip.accounting import block_noise_multipliers, calibrate_block_noise_multiplier

    n, b, target, delta = 24, 6, 3.0, 1e-5
    part = MinSeparationParticipation(b)
    column = B.blt_column(THETA, OMEGA, n)
    prefix = part.prefix_sensitivities_squared(column)
    sigma = calibrate_block_noise_multiplier(
        target_epsilon=target, delta=delta, prefix=prefix, block=b, accountant=mechanism, tol=1e-5
    )

    def spent(s):
        acc = Accountant(accountant=mechanism)
        for m in block_noise_multipliers(s, prefix, b):
            acc.step(noise_multiplier=m, sample_rate=1.0)
        return acc.epsilon(delta)

    assert spent(sigma) <= target < spent(sigma * (1 - 1e-3))
    if mechanism == "rdp":  # RDP composes Gaussians exactly: the one-shot calibration
        whole = MinSeparationGaussian.calibrate(
            target_epsilon=target, delta=delta, sensitivity=part.sensitivity(column), accountant="rdp", tol=1e-5
        )
        assert sigma == pytest.approx(whole.noise_multiplier, rel=1e-4)


@pytest.mark.parametrize("mech", ["blt", B.BltNoise(THETA, OMEGA)])
def test_jax_and_flower_refuse_blt_with_a_clear_error(mech):
    adaclip_jax = pytest.importorskip("adaclip_jax")
    with pytest.raises(InvalidHyperparameterError, match="not supported in the JAX"):
        adaclip_jax.flat_clip(noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=4, noise_mechanism=mech)
    aggregation = pytest.importorskip("adaclip_flower.aggregation")
    with pytest.raises(InvalidHyperparameterError, match="not supported in the Flower"):
        aggregation.make_noise_mechanism(mech)


def test_prefix_error_is_the_dense_workload_error():
    n = 13
    inv = np.linalg.inv(_dense(THETA, OMEGA, n))
    b_mat = np.tril(np.ones((n, n))) @ inv  # S C⁻¹
    r = B.blt_inverse_column(THETA, OMEGA, n)
    assert B.prefix_error(r, error="mean") == pytest.approx(np.sum(b_mat**2) / n, rel=1e-12)
    assert B.prefix_error(r, error="max") == pytest.approx(np.max(np.sum(b_mat**2, axis=1)), rel=1e-12)
    identity = np.zeros(n)
    identity[0] = 1
    assert B.prefix_error(identity) == pytest.approx((n + 1) / 2)  # DP-SGD's (n + 1)/2
    worst = B.fit_blt(200, buffers=1, error="max")
    assert worst != B.fit_blt(200, buffers=1, error="mean")  # the objective matters
