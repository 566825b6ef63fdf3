"""The Pareto-tail estimate of ``adaclip.audit.pareto``: the Hill estimator (closed form, its
Gamma law, recovery of α), the Lilliefors test (statistic against SciPy's KS, p-value against
SciPy's Monte Carlo goodness-of-fit test, level by simulation, power against light tails), and
ε(δ)/δ(ε) (closed form on exact Pareto quantiles, round trips, a Gaussian privacy loss)."""

from __future__ import annotations

import inspect
import math

import numpy as np
import pytest

pytest.importorskip("scipy")

from scipy import stats  # noqa: E402

from adaclip.audit import pareto as P  # noqa: E402


def _pareto_log_ratios(rng: np.random.Generator, n: int, alpha: float, scale: float = 0.0) -> np.ndarray:
    """log X for X Pareto(α) with minimum e^scale: ``scale + Exp(1)/α``."""
    return scale + rng.standard_exponential(n) / alpha


# --------------------------------------------------------------------------- Hill


def test_hill_closed_form_and_scale_invariance():
    samples = [8.0, 4.0, 2.0, 1.0, 0.5]
    assert P.hill_estimator(samples, k=2) == pytest.approx(2 / (math.log(4) + math.log(2)), rel=1e-12)
    assert P.hill_estimator(np.array(samples) * 1e3, k=2) == pytest.approx(
        P.hill_estimator(samples, k=2), rel=1e-12
    )
    # only the k + 1 largest matter (the rest may even be 0 or negative)
    assert P.hill_estimator([8.0, 4.0, 2.0, -5.0, 0.0], k=2) == P.hill_estimator(samples, k=2)
    assert P.hill_estimator([3.0, 3.0, 3.0, 1.0], k=2) == math.inf


@pytest.mark.parametrize("alpha", [0.5, 2.0, 5.0])
def test_hill_recovers_alpha_within_its_standard_error(alpha):
    k = 100
    for seed in range(5):
        x = np.exp(_pareto_log_ratios(np.random.default_rng(seed), 10_000, alpha))
        assert abs(P.hill_estimator(x, k=k) - alpha) < 3 * alpha / math.sqrt(k)


def test_hill_has_the_gamma_law_on_exact_pareto_tails():
    """α·k/α̂ = α·Σ log-excesses ~ Gamma(k, 1) exactly; a light tail (uniform) is far off."""
    rng = np.random.default_rng(3)
    alpha, k = 1.7, 20
    draws = [
        alpha * k / P.hill_estimator(np.exp(_pareto_log_ratios(rng, 200, alpha)), k=k) for _ in range(400)
    ]
    assert stats.kstest(draws, stats.gamma(k).cdf).pvalue > 0.01
    light = [alpha * k / P.hill_estimator(1 + rng.uniform(size=200), k=k) for _ in range(400)]
    assert stats.kstest(light, stats.gamma(k).cdf).pvalue < 1e-6


# --------------------------------------------------------------------------- Lilliefors


def test_lilliefors_statistic_matches_scipy_kstest():
    rng = np.random.default_rng(0)
    for n in (3, 10, 57, 400):
        y = rng.standard_exponential(n) * 2.5
        expected = stats.kstest(y, stats.expon(0, y.mean()).cdf).statistic
        assert P.lilliefors_exponential(y).statistic == pytest.approx(expected, rel=1e-12)


def test_lilliefors_p_value_matches_scipy_goodness_of_fit():
    """SciPy's own Monte Carlo test (fitting the exponential's scale, location 0) agrees within
    the Monte Carlo error of the two simulations."""
    rng = np.random.default_rng(1)
    seed_kw = "rng" if "rng" in inspect.signature(stats.goodness_of_fit).parameters else "random_state"
    for y in (rng.standard_exponential(40), rng.uniform(size=40), np.abs(rng.standard_normal(40))):
        ours = P.lilliefors_exponential(y)
        ref = stats.goodness_of_fit(
            stats.expon, y, known_params={"loc": 0}, statistic="ks", n_mc_samples=9999, **{seed_kw: 0}
        )
        assert ours.statistic == pytest.approx(ref.statistic, rel=1e-12)
        p = max(ref.pvalue, 1e-3)
        assert abs(ours.p_value - ref.pvalue) < 4 * math.sqrt(p * (1 - p) * 2 / 1e4) + 2e-4


def test_lilliefors_level_and_power():
    rng = np.random.default_rng(2)
    reps = 300
    rejected = sum(P.lilliefors_exponential(rng.standard_exponential(30) * 7).rejected for _ in range(reps))
    # Binomial(300, 0.05): 15 expected; (4, 27) holds with probability > 0.999
    assert 4 <= rejected <= 27, rejected
    # negative controls: bounded and half-normal samples are not exponential
    assert all(P.lilliefors_exponential(rng.uniform(size=200)).rejected for _ in range(10))
    assert sum(P.lilliefors_exponential(np.abs(rng.standard_normal(400))).rejected for _ in range(10)) >= 8


def test_lilliefors_critical_value_and_determinism():
    rng = np.random.default_rng(4)
    for _ in range(50):
        y = rng.standard_exponential(25) ** rng.uniform(0.5, 1.5)
        res = P.lilliefors_exponential(y, significance=0.1)
        assert res.rejected == (res.statistic > res.critical_value) == (res.p_value <= 0.1)
    y = rng.standard_exponential(25)
    assert P.lilliefors_exponential(y, seed=5) == P.lilliefors_exponential(y, seed=5)
    assert (
        P.lilliefors_exponential(y, seed=5).critical_value
        != P.lilliefors_exponential(y, seed=6).critical_value
    )
    # too few simulations to ever reach the level: never rejects
    tiny = P.lilliefors_exponential(rng.uniform(size=100), num_simulations=10, significance=0.05)
    assert tiny.critical_value == math.inf and not tiny.rejected and tiny.p_value == 1 / 11


# --------------------------------------------------------------------------- the tail estimate


def test_pareto_tails_pass_lilliefors_at_about_the_nominal_rate():
    rng = np.random.default_rng(5)
    reps = 200
    estimates = [
        P.pareto_tail_epsilon(_pareto_log_ratios(rng, 400, 2.0, 1.0), delta=1e-5) for _ in range(reps)
    ]
    assert all(e.k == 20 and e.n == 400 for e in estimates)
    rejected = sum(e.lilliefors.rejected for e in estimates)
    assert 1 <= rejected <= 21, rejected  # Binomial(200, 0.05) ∈ [1, 21] with probability > 0.999


def test_light_tails_are_rejected():
    """Uniform log ratios (a bounded privacy loss): the log-excesses over the threshold are
    uniform, not exponential."""
    for seed in range(10):
        estimate = P.pareto_tail_epsilon(np.random.default_rng(seed).uniform(size=10_000), delta=1e-5)
        assert estimate.lilliefors.rejected and estimate.lilliefors.p_value < 0.01


def test_epsilon_matches_the_closed_form_on_exact_quantiles():
    n, alpha, delta = 10_000, 2.5, 1e-5
    # exact upper quantiles of log X with P[X > x] = x^{−α}: log x_i = −log(i/(n + 1))/α
    logs = -np.log(np.arange(1, n + 1) / (n + 1)) / alpha
    estimate = P.pareto_tail_epsilon(logs[::-1].copy(), delta=delta)
    k = math.ceil(math.sqrt(n))
    alpha_hat = k / np.sum(logs[:k] - logs[k])
    assert (estimate.k, estimate.n) == (k, n)
    assert estimate.alpha == pytest.approx(alpha_hat, rel=1e-12)
    assert estimate.log_threshold == logs[k] and estimate.threshold == pytest.approx(
        math.exp(logs[k]), rel=1e-12
    )
    expected = logs[k] + math.log(k / (n * delta)) / alpha_hat
    assert estimate.epsilon == pytest.approx(expected, rel=1e-12)
    assert estimate.epsilon == pytest.approx(-math.log(delta) / alpha, rel=0.03)  # the true ε(δ)
    assert not estimate.lilliefors.rejected


def test_delta_at_and_epsilon_at_are_inverse():
    estimate = P.pareto_tail_epsilon(_pareto_log_ratios(np.random.default_rng(6), 5000, 1.3, 0.5), delta=1e-6)
    tail = estimate.k / estimate.n
    for delta in (1e-9, 1e-6, 1e-3, tail):
        assert estimate.delta_at(estimate.epsilon_at(delta)) == pytest.approx(delta, rel=1e-10)
    assert estimate.epsilon == estimate.epsilon_at(1e-6)
    eps = [estimate.epsilon_at(d) for d in (1e-9, 1e-6, 1e-3)]
    assert eps[0] > eps[1] > eps[2] > estimate.log_threshold
    # outside the tail model: the threshold itself, and k/n
    assert estimate.epsilon_at(0.5) == max(0.0, estimate.log_threshold)
    assert estimate.delta_at(0.0) == tail
    # α̂'s standard error
    assert estimate.alpha_se == pytest.approx(estimate.alpha / math.sqrt(estimate.k))


def test_gaussian_privacy_loss_is_estimated_within_a_few_percent():
    """The Gaussian mechanism's privacy loss, L ~ N(μ²/2, μ²) under A: its tail is lighter
    than any Pareto, the test does not see it at k = 100, and ε(1e-5) comes out within 15 % of
    the exact ``μ²/2 + μ·Φ⁻¹(1 − δ)`` (mostly above it)."""
    mu, delta = 1.0, 1e-5
    exact = mu * mu / 2 + mu * stats.norm.isf(delta)
    estimates = []
    for seed in range(6):
        logs = mu * mu / 2 + mu * np.random.default_rng(seed).standard_normal(10_000)
        estimates.append(P.pareto_tail_epsilon(logs, delta=delta).epsilon)
    assert all(abs(e - exact) < 0.15 * exact for e in estimates), (estimates, exact)
    assert np.median(estimates) > exact


def test_sequence_log_ratios():
    a = np.array([-10.0, -3.5, -200.0])
    b = np.array([-11.0, -3.0, -150.0])
    np.testing.assert_array_equal(P.sequence_log_ratios(a, b), [1.0, -0.5, -50.0])


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: P.hill_estimator([3.0, 2.0, 1.0], k=3), "k"),
        (lambda: P.hill_estimator([3.0, 2.0, 1.0], k=0), "k"),
        (lambda: P.hill_estimator([3.0, 2.0, 0.0], k=2), "> 0"),
        (lambda: P.hill_estimator([np.inf, 2.0, 1.0], k=1), "finite"),
        (lambda: P.hill_estimator([[3.0, 2.0]], k=1), "1-d"),
        (lambda: P.lilliefors_exponential([1.0, 2.0]), "at least 3"),
        (lambda: P.lilliefors_exponential([1.0, -2.0, 3.0]), ">= 0"),
        (lambda: P.lilliefors_exponential([0.0, 0.0, 0.0]), "all be 0"),
        (lambda: P.lilliefors_exponential([1.0, 2.0, 3.0], significance=1.0), "significance"),
        (lambda: P.lilliefors_exponential([1.0, 2.0, 3.0], num_simulations=0), "num_simulations"),
        (lambda: P.lilliefors_exponential([1.0, 2.0, 3.0], seed=-1), "seed"),
        (lambda: P.pareto_tail_epsilon(np.r_[np.inf, np.arange(20.0)], delta=1e-5), r"\+inf"),
        (lambda: P.pareto_tail_epsilon(np.r_[np.nan, np.arange(20.0)], delta=1e-5), "NaN"),
        (
            lambda: P.pareto_tail_epsilon(np.r_[np.full(5, -np.inf), np.arange(3.0)], delta=1e-5, k=3),
            "finite",
        ),
        (lambda: P.pareto_tail_epsilon(np.arange(20.0), delta=1e-5, k=2), "k"),
        (lambda: P.pareto_tail_epsilon(np.arange(20.0), delta=1e-5, k=20), "k"),
        (lambda: P.pareto_tail_epsilon(np.arange(3.0), delta=1e-5), "at least 4"),
        (lambda: P.pareto_tail_epsilon(np.arange(20.0), delta=0.0), "delta"),
        (lambda: P.pareto_tail_epsilon(np.arange(20.0), delta=1.0), "delta"),
        (lambda: P.pareto_tail_epsilon(np.r_[np.full(10, 5.0), np.arange(5.0)], delta=1e-5, k=4), "larger k"),
        (lambda: P.sequence_log_ratios([1.0, 2.0], [1.0]), "same length"),
        (lambda: P.sequence_log_ratios([1.0, np.inf], [1.0, 2.0]), "log_prob_a"),
        (lambda: P.sequence_log_ratios([1.0, 2.0], [np.nan, 2.0]), "log_prob_b"),
    ],
)
def test_validation_errors_name_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_estimate_methods_validate():
    estimate = P.pareto_tail_epsilon(np.arange(100.0), delta=1e-3)
    with pytest.raises(ValueError, match="delta"):
        estimate.epsilon_at(0.0)
    with pytest.raises(ValueError, match="epsilon"):
        estimate.delta_at(-1.0)
    with pytest.raises(AttributeError):
        estimate.alpha = 1.0
