"""BandMF coefficients: square-root and optimised Toeplitz factorisations, their expected error
against dense matrices, and the choice of the number of bands."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
import scipy.linalg

from adaclip.correlated import coefficients as K
from adaclip.errors import InvalidHyperparameterError


def dense_c(c, n):
    """The n×n lower-triangular Toeplitz matrix with first column c (truncated/padded)."""
    col = np.zeros(n)
    c = np.asarray(c, dtype=float)[:n]
    col[: c.size] = c
    return scipy.linalg.toeplitz(col, np.zeros(n))


def cosine_schedule(n):
    return 0.05 + 0.5 * (1 + np.cos(np.pi * np.arange(n) / n))


def perturbed_sqrt(bands, seed=0):
    """A unit-norm, c_0 > 0, non-monotone coefficient vector (not a special case)."""
    rng = np.random.default_rng(seed)
    c = K.sqrt_toeplitz_coefficients(bands) + 0.05 * rng.standard_normal(bands)
    c[0] = abs(c[0])
    return c / np.linalg.norm(c)


@pytest.fixture(autouse=True)
def _fresh_cache():
    K._optimise_cached.cache_clear()
    yield
    K._optimise_cached.cache_clear()


# --------------------------------------------------------------------------------------
# b = 1 is DP-SGD
# --------------------------------------------------------------------------------------


def test_one_band_is_dp_sgd():
    assert K.sqrt_toeplitz_coefficients(1).tolist() == [1.0]
    assert K.optimise_banded_coefficients(1, 100).tolist() == [1.0]
    assert K.optimise_banded_coefficients(1, 100, workload="momentum").tolist() == [1.0]
    r = K.inverse_toeplitz_coefficients([1.0], 20)
    assert r.tolist() == [1.0] + [0.0] * 19
    assert K.noise_variances([1.0], 20).tolist() == [1.0] * 20


def test_identity_prefix_error_is_exactly_n_plus_one_over_two_and_full_sqrt_is_much_lower():
    n = 256
    # ‖S‖_F² = n(n+1)/2, so the per-step mean is (n+1)/2.
    assert K.expected_error([1.0], n) == pytest.approx((n + 1) / 2, rel=1e-14)
    assert K.expected_error([1.0], n) == pytest.approx(np.sum(K.prefix_sum_workload(n) ** 2) / n, rel=1e-14)
    full = K.expected_error(K.sqrt_toeplitz_coefficients(n), n)
    # ‖S E⁻¹‖_F² = ‖E‖_F² with E = S^{1/2}: grows like log² n per step, not like n.
    assert full < 8.0  # measured 7.12 vs 128.5
    assert full < 0.06 * K.expected_error([1.0], n)


# --------------------------------------------------------------------------------------
# coefficients
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("bands", [2, 3, 8, 64, 1000])
def test_sqrt_coefficients_are_normalised_central_binomials(bands):
    c = K.sqrt_toeplitz_coefficients(bands)
    kmax = min(bands, 60)  # math.comb / 4**k exactly representable enough below this
    raw = np.array([math.comb(2 * k, k) / 4**k for k in range(kmax)])
    assert c.shape == (bands,)
    assert np.linalg.norm(c) == pytest.approx(1.0, abs=1e-14)
    np.testing.assert_allclose(c[:kmax] / c[0], raw, rtol=1e-13)
    assert np.all(c > 0) and np.all(np.diff(c) < 0)


def test_full_sqrt_squares_to_the_prefix_sum_matrix():
    n = 40
    e = dense_c(K.sqrt_toeplitz_coefficients(n) / K.sqrt_toeplitz_coefficients(n)[0], n)
    np.testing.assert_allclose(e @ e, K.prefix_sum_workload(n), atol=1e-12)


@pytest.mark.parametrize(
    "c",
    [K.sqrt_toeplitz_coefficients(8), perturbed_sqrt(5), [2.0, -0.5, 0.25], K.sqrt_toeplitz_coefficients(50)],
)
def test_inverse_coefficients_invert_c(c):
    n = 50
    r = K.inverse_toeplitz_coefficients(c, n)
    cmat, cinv = dense_c(c, n), dense_c(r, n)
    np.testing.assert_allclose(cmat @ cinv, np.eye(n), atol=1e-12)
    np.testing.assert_allclose(cinv, np.linalg.inv(cmat), atol=1e-12)


def test_inverse_coefficients_recurrence_and_short_n():
    c = np.array([0.8, 0.5, -0.2, 0.1])
    r = K.inverse_toeplitz_coefficients(c, 12)
    expected = [1 / c[0]]
    for k in range(1, 12):
        s = sum(c[j] * expected[k - j] for j in range(1, min(k, 3) + 1))
        expected.append(-s / c[0])
    np.testing.assert_allclose(r, expected, rtol=1e-13)
    np.testing.assert_allclose(K.inverse_toeplitz_coefficients(c, 2), expected[:2])  # n < bands is fine here


def test_inverse_coefficients_are_stable_for_long_streams():
    r = K.inverse_toeplitz_coefficients(K.sqrt_toeplitz_coefficients(64), 100_000)
    assert np.all(np.isfinite(r)) and np.max(np.abs(r)) <= r[0]


@pytest.mark.parametrize("c", [K.sqrt_toeplitz_coefficients(6), perturbed_sqrt(7, seed=3), [1.0]])
def test_noise_variances_are_row_sums_of_squares_of_c_inverse(c):
    n = 50
    v = K.noise_variances(c, n)
    cinv = np.linalg.inv(dense_c(c, n))
    np.testing.assert_allclose(v, np.sum(cinv**2, axis=1), rtol=1e-12)
    if len(c) > 1:
        assert v[0] == pytest.approx(1 / c[0] ** 2) and np.all(np.diff(v) >= 0) and v[-1] > 1


# --------------------------------------------------------------------------------------
# workloads and expected error
# --------------------------------------------------------------------------------------


def test_dense_workloads():
    n = 7
    beta, eta = 0.7, np.linspace(1.0, 0.2, n)
    a = K.momentum_workload(n, momentum=beta, learning_rates=eta)
    for t in range(n):
        for s in range(n):
            want = sum(eta[k] * beta ** (k - s) for k in range(s, t + 1)) if s <= t else 0.0
            assert a[t, s] == pytest.approx(want, rel=1e-14, abs=0)
    np.testing.assert_array_equal(K.momentum_workload(n, momentum=0.0), K.prefix_sum_workload(n))
    np.testing.assert_allclose(
        K.momentum_workload(n, momentum=beta, learning_rates=2.0), 2 * K.momentum_workload(n, momentum=beta)
    )


CASES = [
    ("prefix", 0.9, None),
    ("prefix", 0.9, 0.3),
    ("prefix", 0.9, "schedule"),
    ("momentum", 0.9, None),
    ("momentum", 0.5, 0.3),
    ("momentum", 0.9, "schedule"),
]


def _workload_kwargs(workload, momentum, lr, n):
    return {
        "workload": workload,
        "momentum": momentum,
        "learning_rates": cosine_schedule(n) if isinstance(lr, str) else lr,
    }


def _dense_error(c, n, workload, momentum, learning_rates):
    eta = 1.0 if learning_rates is None else learning_rates
    a = K.momentum_workload(n, momentum=momentum if workload == "momentum" else 0.0, learning_rates=eta)
    b = a @ np.linalg.inv(dense_c(c, n))
    return float(np.sum(b**2)) / n


@pytest.mark.parametrize("workload,momentum,lr", CASES)
@pytest.mark.parametrize(
    "c",
    [
        [1.0],
        K.sqrt_toeplitz_coefficients(4),
        perturbed_sqrt(9, seed=1),
        [1.5, 0.3, -0.4],
        K.sqrt_toeplitz_coefficients(60),
    ],
)
def test_expected_error_matches_dense(workload, momentum, lr, c):
    n = 60
    kw = _workload_kwargs(workload, momentum, lr, n)
    got = K.expected_error(c, n, **kw)
    assert got == pytest.approx(_dense_error(c, n, **kw), rel=1e-10)


def test_schedule_rows_streamed_equal_dense(monkeypatch):
    n = 80
    eta = cosine_schedule(n)
    c = perturbed_sqrt(6, seed=2)
    dense = K.expected_error(c, n, workload="momentum", learning_rates=eta)
    assert K._ScheduleQuadratic(eta).dense is not None
    monkeypatch.setattr(K, "_DENSE_SCHEDULE_MAX_N", 10)
    assert K._ScheduleQuadratic(eta).dense is None
    streamed = K.expected_error(c, n, workload="momentum", learning_rates=eta)
    assert streamed == pytest.approx(dense, rel=1e-12)
    assert streamed == pytest.approx(_dense_error(c, n, "momentum", 0.9, eta), rel=1e-10)


def test_constant_schedule_takes_the_toeplitz_path():
    n = 50
    c = K.sqrt_toeplitz_coefficients(5)
    assert K.expected_error(c, n, learning_rates=np.full(n, 0.5)) == K.expected_error(
        c, n, learning_rates=0.5
    )


@pytest.mark.parametrize("workload,momentum,lr", CASES)
def test_analytic_gradient_matches_finite_differences(workload, momentum, lr):
    n, bands = 70, 6
    kw = _workload_kwargs(workload, momentum, lr, n)
    beta, eta = K._workload(kw["workload"], kw["momentum"], kw["learning_rates"], n)
    schedule = K._ScheduleQuadratic(eta) if isinstance(eta, np.ndarray) else None
    c = perturbed_sqrt(bands, seed=4)
    phi, grad = K._error_and_gradient(c, n, beta, eta, schedule)
    assert phi == pytest.approx(n * K.expected_error(c, n, **kw), rel=1e-14)
    step = 1e-6
    fd = np.array(
        [
            (
                K._error_and_gradient(c + step * e, n, beta, eta, schedule)[0]
                - K._error_and_gradient(c - step * e, n, beta, eta, schedule)[0]
            )
            / (2 * step)
            for e in np.eye(bands)
        ]
    )
    np.testing.assert_allclose(grad, fd, rtol=1e-6, atol=1e-6 * np.max(np.abs(fd)))


def test_unstable_inverse_reports_infinite_error():
    c = np.array([0.1, 1.0]) / math.hypot(0.1, 1.0)  # zero of c(z) at −0.1: r grows like 10^k
    assert K.expected_error(c, 2000) == math.inf
    assert K.expected_error(c, 2000, workload="momentum") == math.inf
    assert math.isfinite(K.expected_error(c, 20))


# --------------------------------------------------------------------------------------
# optimisation
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("workload,momentum,lr", CASES)
@pytest.mark.parametrize("bands,n", [(2, 64), (4, 64), (16, 300)])
def test_optimiser_never_worse_than_sqrt_and_stays_feasible(workload, momentum, lr, bands, n):
    kw = _workload_kwargs(workload, momentum, lr, n)
    c = K.optimise_banded_coefficients(bands, n, **kw)
    assert c.shape == (bands,) and c[0] > 0
    assert np.linalg.norm(c) == pytest.approx(1.0, abs=1e-14)
    assert K.expected_error(c, n, **kw) <= K.expected_error(K.sqrt_toeplitz_coefficients(bands), n, **kw)


def test_optimiser_returns_the_sqrt_start_when_nothing_beats_it():
    # max_iter=1 still evaluates; whatever it returns is no worse than the start, exactly.
    c = K.optimise_banded_coefficients(8, 200, max_iter=1)
    assert K.expected_error(c, 200) <= K.expected_error(K.sqrt_toeplitz_coefficients(8), 200)


@pytest.mark.parametrize("workload,bound", [("momentum", 0.70), ("prefix", 0.80)])
def test_optimiser_strictly_improves_on_sqrt_at_16_bands(workload, bound):
    # Measured (n=1000, b=16): momentum 4782.66 → 3152.66 (×0.659); prefix 50.94 → 39.42 (×0.774):
    # the truncated square root is not optimal among 16-band factorisations even for prefix sums.
    n = 1000
    sqrt_err = K.expected_error(K.sqrt_toeplitz_coefficients(16), n, workload=workload)
    opt_err = K.expected_error(K.optimise_banded_coefficients(16, n, workload=workload), n, workload=workload)
    assert opt_err < bound * sqrt_err


def test_optimiser_is_deterministic():
    kw = {"workload": "momentum", "learning_rates": cosine_schedule(300)}
    first = K.optimise_banded_coefficients(12, 300, **kw)
    K._optimise_cached.cache_clear()
    second = K.optimise_banded_coefficients(12, 300, **kw)
    np.testing.assert_array_equal(first, second)


def test_cache_hits_return_copies():
    first = K.optimise_banded_coefficients(8, 400, workload="momentum", momentum=0.8)
    saved = first.copy()
    first[:] = -1.0
    second = K.optimise_banded_coefficients(8, 400, workload="momentum", momentum=0.8)
    assert K._optimise_cached.cache_info().hits == 1
    np.testing.assert_array_equal(second, saved)
    assert second.flags.writeable and second is not first
    # A different schedule is a different key.
    K.optimise_banded_coefficients(
        8, 400, workload="momentum", momentum=0.8, learning_rates=cosine_schedule(400)
    )
    assert K._optimise_cached.cache_info().misses == 2


@pytest.mark.parametrize("workload", ["prefix", "momentum"])
def test_optimiser_timing_n1950_b16(workload, capsys):
    start = time.perf_counter()
    c = K.optimise_banded_coefficients(16, 1950, workload=workload)
    elapsed = time.perf_counter() - start
    with capsys.disabled():
        print(f"\n[timing] optimise_banded_coefficients(16, 1950, workload={workload!r}): {elapsed:.3f} s")
    assert elapsed < 30.0
    assert K.expected_error(c, 1950, workload=workload) < K.expected_error(
        K.sqrt_toeplitz_coefficients(16), 1950, workload=workload
    )


@pytest.mark.slow
def test_optimiser_timing_long_stream(capsys):
    start = time.perf_counter()
    c = K.optimise_banded_coefficients(64, 100_000, workload="momentum")
    elapsed = time.perf_counter() - start
    with capsys.disabled():
        print(f"\n[timing] optimise_banded_coefficients(64, 100000, momentum): {elapsed:.3f} s")
    assert elapsed < 120.0
    assert np.all(np.isfinite(K.inverse_toeplitz_coefficients(c, 100_000)))


# --------------------------------------------------------------------------------------
# choosing b
# --------------------------------------------------------------------------------------


def test_choose_bands_with_constant_sigma_prefers_the_most_bands_for_prefix_sums():
    calls = []

    def sigma(b):
        calls.append(b)
        return 1.0

    best, table = K.choose_bands(candidates=[64, 4, 16, 16], n=256, sigma_for_bands=sigma)
    assert sorted(table) == [1, 4, 16, 64] and calls == [1, 4, 16, 64]
    assert best == 64
    errors = [table[b][1] for b in (1, 4, 16, 64)]
    assert errors == sorted(errors, reverse=True)
    assert table[1][1] == pytest.approx(257 / 2)
    for b, (s, err, c) in table.items():
        assert s == 1.0 and c.shape == (b,)
        assert err == pytest.approx(K.expected_error(c, 256), rel=1e-14)


def test_choose_bands_picks_one_when_sigma_grows_fast_enough():
    # σ_b = b: σ_b²·error_b ≥ 4·66 > 128.5 = error_1 for every b ≥ 2 (n = 256).
    best, table = K.choose_bands(candidates=[2, 8, 64], n=256, sigma_for_bands=float)
    assert best == 1
    assert all(table[b][1] > table[1][1] for b in (2, 8, 64))


def test_choose_bands_trades_sigma_against_error_for_momentum():
    n = 500
    sigmas = {1: 1.0, 4: 1.3, 16: 3.0}
    best, table = K.choose_bands(
        candidates=[4, 16], n=n, sigma_for_bands=sigmas.__getitem__, workload="momentum"
    )
    for s, err, c in table.values():
        assert err == pytest.approx(s**2 * K.expected_error(c, n, workload="momentum"), rel=1e-14)
    assert best == min(table, key=lambda b: table[b][1])
    # Measured (n=500): error_1 = 23705, error_4 = 5975, error_16 = 1577 (unit σ), so
    # 1.69·5975 ≈ 10100 beats 23705 (b=1) and 9·1577 ≈ 14190 (b=16).
    assert best == 4


def test_choose_bands_skips_infeasible_and_can_use_sqrt():
    best, table = K.choose_bands(
        candidates=[2, 4, 8], n=64, sigma_for_bands=lambda b: 1.0 if b <= 4 else math.inf, optimise=False
    )
    assert best == 4 and table[8][1] == math.inf
    for b in table:
        np.testing.assert_array_equal(table[b][2], K.sqrt_toeplitz_coefficients(b))
    with pytest.raises(InvalidHyperparameterError, match="infeasible"):
        K.choose_bands(candidates=[2], n=64, sigma_for_bands=lambda b: math.inf)


# --------------------------------------------------------------------------------------
# bad input
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: K.sqrt_toeplitz_coefficients(0), "bands"),
        (lambda: K.sqrt_toeplitz_coefficients(2.0), "bands"),
        (lambda: K.sqrt_toeplitz_coefficients(True), "bands"),
        (lambda: K.inverse_toeplitz_coefficients([1.0, 0.5], 0), "n"),
        (lambda: K.inverse_toeplitz_coefficients([0.0, 1.0], 5), "c_0"),
        (lambda: K.inverse_toeplitz_coefficients([-1.0, 0.5], 5), "c_0"),
        (lambda: K.inverse_toeplitz_coefficients([[1.0, 0.5]], 5), "1-d"),
        (lambda: K.inverse_toeplitz_coefficients([], 5), "1-d"),
        (lambda: K.noise_variances([1.0, np.nan], 5), "finite"),
        (lambda: K.noise_variances([1.0, np.inf], 5), "finite"),
        (lambda: K.noise_variances(["a"], 5), "real"),
        (lambda: K.expected_error([1.0, 0.5, 0.2], 2), "bands"),
        (lambda: K.expected_error([1.0], 10, workload="adam"), "workload"),
        (lambda: K.expected_error([1.0], 10, workload="momentum", momentum=1.0), "momentum"),
        (lambda: K.expected_error([1.0], 10, workload="momentum", momentum=-0.1), "momentum"),
        (lambda: K.expected_error([1.0], 10, momentum=float("nan")), "momentum"),
        (lambda: K.expected_error([1.0], 10, learning_rates=-1.0), "learning_rates"),
        (lambda: K.expected_error([1.0], 10, learning_rates=0.0), "learning_rates"),
        (lambda: K.expected_error([1.0], 10, learning_rates=np.ones(9)), "learning_rates"),
        (lambda: K.expected_error([1.0], 3, learning_rates=[1.0, np.nan, 1.0]), "learning_rates"),
        (lambda: K.expected_error([1.0], 3, learning_rates=[1.0, -0.1, 1.0]), "learning_rates"),
        (lambda: K.expected_error([1.0], 3, learning_rates=[0.0, 0.0, 0.0]), "learning_rates"),
        (lambda: K.momentum_workload(5, momentum=1.5), "momentum"),
        (lambda: K.prefix_sum_workload(0), "n"),
        (lambda: K.optimise_banded_coefficients(8, 4), "bands"),
        (lambda: K.optimise_banded_coefficients(-1, 4), "bands"),
        (lambda: K.optimise_banded_coefficients(2, 4, max_iter=0), "max_iter"),
        (lambda: K.choose_bands(candidates=[0], n=10, sigma_for_bands=float), "bands"),
        (lambda: K.choose_bands(candidates=[11], n=10, sigma_for_bands=float), "exceeds"),
        (lambda: K.choose_bands(candidates=[2.5], n=10, sigma_for_bands=float), "bands"),
        (lambda: K.choose_bands(candidates=5, n=10, sigma_for_bands=float), "candidates"),
        (lambda: K.choose_bands(candidates=[2], n=10, sigma_for_bands=1.0), "callable"),
        (lambda: K.choose_bands(candidates=[2], n=10, sigma_for_bands=lambda b: -1.0), "sigma_for_bands"),
        (
            lambda: K.choose_bands(candidates=[2], n=10, sigma_for_bands=lambda b: float("nan")),
            "sigma_for_bands",
        ),
        (lambda: K.choose_bands(candidates=[2], n=10, sigma_for_bands=lambda b: "1"), "sigma_for_bands"),
    ],
)
def test_bad_inputs_raise(call, match):
    with pytest.raises(InvalidHyperparameterError, match=match):
        call()


# --------------------------------------------------------------------------------------
# the learning-rate factor of adaptive optimizers
# --------------------------------------------------------------------------------------


def test_adaptive_lr_scale_of_one_band_is_the_ratio_of_noise_multipliers():
    assert K.adaptive_lr_scale([1.0], 500, sigma=1.5, sigma_independent=0.75) == 2.0


@pytest.mark.parametrize("bands", [2, 4, 16])
def test_adaptive_lr_scale_is_the_rms_of_the_released_noise_over_dp_sgds(bands):
    """ρ·σ_1 is the root mean square, over steps and coordinates, of the noise the banded stream
    actually releases (σ_b·x_t with x_t from :class:`BandedNoise`), the quantity Adam's second
    moment averages. Negative control: σ_b/σ_1 alone (the noise multipliers, ignoring the
    correlation's per-step variance) is off by more than the Monte-Carlo error."""
    from adaclip.correlated import BandedNoise

    n, d, sigma_b, sigma_1 = 300, 2000, 1.4, 0.9
    c = K.sqrt_toeplitz_coefficients(bands)
    mechanism, rng = BandedNoise(c), np.random.default_rng(bands)
    state, total = mechanism.init(), 0.0
    for _ in range(n):
        (x,), state = mechanism.correlate(state, [rng.standard_normal(d)])
        total += float(np.sum((sigma_b * x) ** 2))
    rms_ratio = math.sqrt(total / (n * d)) / sigma_1
    rho = K.adaptive_lr_scale(c, n, sigma=sigma_b, sigma_independent=sigma_1)
    assert rms_ratio == pytest.approx(rho, rel=0.01)
    assert abs(rms_ratio - sigma_b / sigma_1) > 0.1 * rho


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"n": 0, "sigma": 1.0, "sigma_independent": 1.0}, "n"),
        ({"n": 10, "sigma": 0.0, "sigma_independent": 1.0}, "sigma"),
        ({"n": 10, "sigma": 1.0, "sigma_independent": -1.0}, "sigma_independent"),
        ({"n": 10, "sigma": float("inf"), "sigma_independent": 1.0}, "sigma"),
        ({"n": 10, "sigma": 1.0, "sigma_independent": float("nan")}, "sigma_independent"),
        ({"n": 10, "sigma": "1", "sigma_independent": 1.0}, "sigma"),
    ],
)
def test_adaptive_lr_scale_refuses_bad_input(kwargs, match):
    n = kwargs.pop("n")
    with pytest.raises(InvalidHyperparameterError, match=match):
        K.adaptive_lr_scale([0.8, 0.6], n, **kwargs)
