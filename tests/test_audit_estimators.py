"""The estimators of ``adaclip.audit.estimators``: Gaussian-DP conversions against dp-accounting,
Clopper–Pearson coverage, the one-run bound (closed forms, validity by simulation, power), the
threshold bound and the Gaussian-DP fit (coverage, detection of a too-weak mechanism)."""

from __future__ import annotations

import math

import numpy as np
import pytest

pytest.importorskip("scipy")

import dp_accounting  # noqa: E402
from dp_accounting.pld import privacy_loss_mechanism  # noqa: E402
from scipy import special, stats  # noqa: E402

from adaclip.accounting import Accountant  # noqa: E402
from adaclip.audit import estimators as E  # noqa: E402

DELTA = 1e-5


def _gaussian_trials(rng: np.random.Generator, n: int, mu: float) -> tuple[np.ndarray, np.ndarray]:
    """n trials of the μ-GDP Gaussian mechanism: score ~ N(μ·1[in], 1), inclusion a fair coin."""
    included = rng.random(n) < 0.5
    return mu * included + rng.standard_normal(n), included


# --------------------------------------------------------------------------- Gaussian DP


@pytest.mark.parametrize("sigma", [0.2, 0.5, 1.0, 2.0, 10.0])
def test_gdp_conversions_match_dp_accounting_closed_forms(sigma):
    mu = 1 / sigma
    loss = privacy_loss_mechanism.GaussianPrivacyLoss(standard_deviation=sigma, sensitivity=1.0)
    for eps in (0.0, 0.1, 1.0, 3.0):
        assert E.gdp_delta(eps, mu) == pytest.approx(loss.get_delta_for_epsilon(eps), rel=1e-9, abs=1e-300)
    for delta in (1e-12, 1e-5, 1e-2):
        eps = E.gdp_epsilon(mu, delta)
        assert eps == pytest.approx(dp_accounting.get_epsilon_gaussian(sigma, delta), rel=1e-9, abs=1e-12)
        if eps > 0:
            assert E.gdp_mu(eps, delta) == pytest.approx(
                1 / dp_accounting.get_sigma_gaussian(eps, delta), rel=1e-9
            )


@pytest.mark.parametrize("sigma", [0.5, 1.0, 2.0])
def test_gdp_epsilon_matches_the_pld_accountant_for_one_gaussian_step(sigma):
    pld = Accountant("pld")
    pld.step(noise_multiplier=sigma, sample_rate=1.0)
    assert E.gdp_epsilon(1 / sigma, DELTA) == pytest.approx(pld.epsilon(DELTA), rel=1e-6)
    # the package's thin wrapper gives the same number, and the PLD is pessimistic (never below)
    assert E.accountant_epsilon(sigma, delta=DELTA) == pld.epsilon(DELTA)
    assert E.accountant_epsilon(sigma, delta=DELTA) >= E.gdp_epsilon(1 / sigma, DELTA) - 1e-12


def test_gdp_round_trips_and_edges():
    for mu in (0.05, 0.3, 1.0, 4.0, 30.0):
        for delta in (1e-10, 1e-5, 0.1):
            eps = E.gdp_epsilon(mu, delta)
            if eps > 0:
                assert E.gdp_mu(eps, delta) == pytest.approx(mu, rel=1e-9)
                assert E.gdp_delta(eps, mu) == pytest.approx(delta, rel=1e-8)
                assert E.gdp_delta(eps * 0.99, mu) > delta  # the *smallest* such ε
    # ε = 0: δ(0) = Φ(μ/2) − Φ(−μ/2) = delta at μ = 2Φ⁻¹((1 + δ)/2)
    assert E.gdp_delta(0.0, E.gdp_mu(0.0, 0.2)) == pytest.approx(0.2, rel=1e-12)
    assert E.gdp_epsilon(0.0, DELTA) == 0.0 and E.gdp_epsilon(-1.0, DELTA) == 0.0
    assert E.gdp_epsilon(math.inf, DELTA) == math.inf and E.gdp_mu(math.inf, DELTA) == math.inf
    assert (
        E.gdp_delta(1.0, math.inf) == 1.0
        and E.gdp_delta(math.inf, 2.0) == 0.0
        and E.gdp_delta(1.0, 0.0) == 0.0
    )
    # the log domain: tiny δ, where Φ(a) − e^ε·Φ(b) cancels to many digits, stay accurate
    loss = privacy_loss_mechanism.GaussianPrivacyLoss(standard_deviation=1.0, sensitivity=1.0)
    for eps in (10.0, 20.0, 30.0):
        assert E.gdp_delta(eps, 1.0) == pytest.approx(loss.get_delta_for_epsilon(eps), rel=1e-9)
    for delta in (1e-300, 1e-100):
        for mu in (0.01, 1.0, 100.0):
            eps = E.gdp_epsilon(mu, delta)
            assert eps == pytest.approx(dp_accounting.get_epsilon_gaussian(1 / mu, delta), rel=1e-11)
            assert E.gdp_mu(eps, delta) == pytest.approx(mu, rel=1e-11)


# --------------------------------------------------------------------------- Clopper–Pearson


def test_clopper_pearson_closed_forms():
    sig = 0.05
    assert E.clopper_pearson_upper(0, 40, sig) == pytest.approx(1 - sig ** (1 / 40), rel=1e-12)
    assert E.clopper_pearson_upper(40, 40, sig) == 1.0
    lo, hi = E.clopper_pearson_interval(0, 40, 0.9)
    assert lo == 0.0 and hi == pytest.approx(1 - 0.05 ** (1 / 40), rel=1e-12)
    lo, hi = E.clopper_pearson_interval(40, 40, 0.9)
    assert hi == 1.0 and lo == pytest.approx(0.05 ** (1 / 40), rel=1e-12)
    # the defining equation: P[Binom(n, U) ≤ k] = significance
    u = E.clopper_pearson_upper(7, 50, sig)
    assert stats.binom.cdf(7, 50, u) == pytest.approx(sig, rel=1e-9)


@pytest.mark.parametrize("n,p", [(20, 0.1), (100, 0.5), (1000, 0.01), (300, 0.97)])
def test_clopper_pearson_coverage_by_simulation(n, p):
    rng = np.random.default_rng(n)
    draws = rng.binomial(n, p, size=4000)
    uppers = {k: E.clopper_pearson_upper(int(k), n, 0.05) for k in np.unique(draws)}
    intervals = {k: E.clopper_pearson_interval(int(k), n, 0.9) for k in np.unique(draws)}
    upper_miss = np.mean([uppers[k] < p for k in draws])
    interval_miss = np.mean([not (intervals[k][0] <= p <= intervals[k][1]) for k in draws])
    tol = 3 * math.sqrt(0.05 * 0.95 / draws.size)
    assert upper_miss <= 0.05 + tol
    assert interval_miss <= 0.10 + 3 * math.sqrt(0.1 * 0.9 / draws.size)
    # negative control: a bound at the 60 % level misses far more often than 5 %
    assert np.mean([E.clopper_pearson_upper(int(k), n, 0.4) < p for k in draws]) > 0.05 + tol


# --------------------------------------------------------------------------- one run


def _p_value_literal(eps, r, v, m, delta):
    """The p-value exactly as written in the paper: f(v) + 2mδ·max_i (f(v − i) − f(v))/i."""
    q = math.exp(eps) / (1 + math.exp(eps))

    def f(u):
        return 1.0 if u <= 0 else float(stats.binom.sf(u - 1, r, q))

    extra = max([(f(v - i) - f(v)) / i for i in range(1, v + 1)], default=0.0)
    return min(1.0, f(v) + 2 * m * delta * extra)


@pytest.mark.parametrize(
    "m,r,v", [(10, 5, 5), (100, 40, 31), (1000, 100, 100), (1000, 500, 260), (50, 20, 0)]
)
@pytest.mark.parametrize("delta", [0.0, 1e-5, 1e-2])
def test_one_run_p_value_matches_the_literal_formula(m, r, v, delta):
    for eps in (0.0, 0.5, 2.0, 6.0):
        got = E.one_run_p_value(eps, num_guesses=r, num_correct=v, num_canaries=m, delta=delta)
        assert got == pytest.approx(_p_value_literal(eps, r, v, m, delta), rel=1e-9, abs=1e-15)


def test_one_run_perfect_separation_closed_form():
    m, k = 200, 64
    included = np.arange(m) % 2 == 0
    scores = included.astype(float)
    sig = 0.05
    # δ = 0 and r = k right guesses out of k: q^k ≤ sig ⇔ ε ≤ logit(sig^(1/k))
    bound = E.one_run_epsilon(scores, included, delta=0.0, confidence=1 - sig, guesses=[k])
    # the scores tie in two groups of 100: k = 64 is rounded to the nearer level set (100)
    assert (bound.num_guesses, bound.num_correct, bound.num_canaries, bound.threshold) == (100, 100, m, 1.0)
    assert bound.epsilon_lower == pytest.approx(special.logit(sig ** (1 / 100)), rel=1e-10)
    # distinct scores: exactly k guesses
    scores = included + np.linspace(0, 0.5, m)
    bound = E.one_run_epsilon(scores, included, delta=0.0, confidence=1 - sig, guesses=[k])
    assert bound.num_guesses == k and bound.num_correct == k
    assert bound.epsilon_lower == pytest.approx(special.logit(sig ** (1 / k)), rel=1e-10)
    # the default grid splits the significance over its candidates (Bonferroni)
    grid = E.default_guesses(m)
    assert grid == (1, 2, 4, 8, 16, 32, 64, 100)
    bound = E.one_run_epsilon(scores, included, delta=0.0, confidence=1 - sig)
    assert bound.num_guesses == 100
    assert bound.epsilon_lower == pytest.approx(special.logit((sig / len(grid)) ** (1 / 100)), rel=1e-10)
    # δ > 0 costs something, and the bound sits where the p-value crosses the significance
    with_delta = E.one_run_epsilon(scores, included, delta=DELTA, confidence=1 - sig, guesses=[k])
    assert 0 < with_delta.epsilon_lower < special.logit(sig ** (1 / k))
    p = E.one_run_p_value(with_delta.epsilon_lower, num_guesses=k, num_correct=k, num_canaries=m, delta=DELTA)
    assert p == pytest.approx(sig, rel=1e-6)


def test_one_run_random_scores_certify_nothing():
    bounds = []
    for seed in range(10):
        rng = np.random.default_rng(seed)
        included = rng.random(1000) < 0.5
        bounds.append(E.one_run_epsilon(rng.standard_normal(1000), included, delta=DELTA).epsilon_lower)
    assert max(bounds) <= 0.3 and sum(b == 0.0 for b in bounds) >= 8, bounds


def test_one_run_ties_never_split_by_order():
    """Members listed first and every score equal: a tie-break by position would 'guess' them
    all right; guesses are level sets of the scores, so nothing is certified."""
    included = np.r_[np.ones(500, bool), np.zeros(500, bool)]
    for members in (included, ~included):  # members first, then members last
        bound = E.one_run_epsilon(np.zeros(1000), members, delta=0.0)
        assert bound.epsilon_lower == 0.0 and bound.num_guesses in (0, 1000)
    # the same with distinct scores in that order is (rightly) a perfect attack
    assert E.one_run_epsilon(-np.arange(1000.0), included, delta=0.0).epsilon_lower > 3


def test_one_run_nan_scores_count_as_highest():
    rng = np.random.default_rng(1)
    included = rng.random(400) < 0.5
    scores = rng.standard_normal(400)
    scores[included] = np.nan  # a non-finite release whenever the canary is in: a perfect tell
    bound = E.one_run_epsilon(scores, included, delta=DELTA)
    assert bound.num_correct == bound.num_guesses > 0 and bound.epsilon_lower > 3


@pytest.mark.parametrize("mu", [1.0, 2.0, 4.0])
def test_one_run_gaussian_mechanism_bound_is_valid_and_has_power(mu):
    true_eps = E.gdp_epsilon(mu, DELTA)
    bounds = []
    for seed in range(4):
        scores, included = _gaussian_trials(np.random.default_rng(100 + seed), 1000, mu)
        bounds.append(E.one_run_epsilon(scores, included, delta=DELTA).epsilon_lower)
    assert max(bounds) <= true_eps
    assert min(bounds) > {1.0: 0.5, 2.0: 1.5, 4.0: 3.0}[mu], bounds
    if mu == 4.0:  # detects a mechanism claimed to be 0.5-GDP (ε ≈ 2.0)
        assert min(bounds) > E.gdp_epsilon(0.5, DELTA)


def test_one_run_coverage_on_randomised_response():
    """Randomised response is exactly ε-DP per canary and makes the number of right guesses
    exactly Binom(r, q): the bound at δ = 0 exceeds the true ε with probability ≤ 5 %, and
    close to it (the bound is tight). A mechanism twice as leaky is detected."""
    eps, m, reps = 1.0, 500, 1000
    rng = np.random.default_rng(7)

    def bound(true_eps: float) -> float:
        included = rng.random(m) < 0.5
        truthful = rng.random(m) < special.expit(true_eps)
        scores = np.where(included == truthful, 1.0, -1.0)
        return E.one_run_epsilon(scores, included, delta=0.0, guesses=[m // 2]).epsilon_lower

    miss = np.mean([bound(eps) > eps for _ in range(reps)])
    tol = 3 * math.sqrt(0.05 * 0.95 / reps)
    assert 0.02 <= miss <= 0.05 + tol, miss
    assert np.mean([bound(2 * eps) > eps for _ in range(100)]) > 0.9


# --------------------------------------------------------------------------- thresholds


def test_threshold_gaussian_bound_is_valid_and_close_with_many_trials():
    grid = np.arange(-8, 21) / 4  # fixed in advance
    for delta, n, mu in ((0.05, 100_000, 1.0), (DELTA, 20_000, 1.0), (DELTA, 20_000, 2.0)):
        scores, included = _gaussian_trials(np.random.default_rng(3), n, mu)
        bound = E.threshold_epsilon(scores, included, delta=delta, thresholds=grid)

        def population(t: float, mu: float = mu, delta: float = delta) -> float:  # exact distributions
            add = (1 - delta - stats.norm.cdf(t - mu)) / stats.norm.sf(t)
            remove = (1 - delta - stats.norm.sf(t)) / stats.norm.cdf(t - mu)
            return math.log(max(add, remove))

        best = max(population(t) for t in grid)
        true_eps = E.gdp_epsilon(mu, delta)
        assert bound.epsilon_lower <= best <= true_eps
        if delta == 0.05:
            assert bound.epsilon_lower >= 0.85 * true_eps, (bound, true_eps)
        assert bound.epsilon_lower >= 0.4 * true_eps


def test_threshold_no_noise_is_detected_in_closed_form():
    n = 4000
    included = np.random.default_rng(0).random(n) < 0.5
    n1 = int(included.sum())
    n0 = n - n1
    bound = E.threshold_epsilon(included.astype(float), included, delta=DELTA)
    alpha = 0.05 / (4 * n)  # the default thresholds: four bounds per score
    fpr_u, fnr_u = 1 - alpha ** (1 / n0), 1 - alpha ** (1 / n1)  # no error on either side
    expected = {"add": math.log((1 - DELTA - fnr_u) / fpr_u), "remove": math.log((1 - DELTA - fpr_u) / fnr_u)}
    assert bound.threshold == 0.0 and (bound.fpr_upper, bound.fnr_upper) == pytest.approx(
        (fpr_u, fnr_u), rel=1e-10
    )
    assert bound.direction == max(expected, key=expected.get)
    assert bound.epsilon_lower == pytest.approx(max(expected.values()), rel=1e-10)
    assert bound.epsilon_lower > E.gdp_epsilon(1.0, DELTA)  # far above a σ = 1 claim


def test_threshold_single_explicit_threshold_and_the_remove_direction():
    rng = np.random.default_rng(5)
    included = rng.random(2000) < 0.5
    scores = np.where(included, 1.0, rng.standard_normal(2000))  # the canary pins the score
    bound = E.threshold_epsilon(scores, included, delta=DELTA, thresholds=[0.5])
    n1, n0 = int(included.sum()), int((~included).sum())
    fp = int(np.sum(scores[~included] > 0.5))
    alpha = 0.05 / 4
    fpr_u = stats.beta.ppf(1 - alpha, fp + 1, n0 - fp)
    fnr_u = 1 - alpha ** (1 / n1)  # no world-1 score at or below 0.5
    assert bound.fpr_upper == pytest.approx(fpr_u, rel=1e-12) and bound.fnr_upper == pytest.approx(
        fnr_u, rel=1e-12
    )
    # removing the canary makes {score ≤ 0.5} likely where it was impossible: the mirror test wins
    assert bound.direction == "remove"
    assert bound.epsilon_lower == pytest.approx(math.log((1 - DELTA - fpr_u) / fnr_u), rel=1e-12)


def test_threshold_independent_scores_certify_nothing():
    for seed in range(5):
        rng = np.random.default_rng(seed)
        included = rng.random(4000) < 0.5
        assert E.threshold_epsilon(rng.standard_normal(4000), included, delta=DELTA).epsilon_lower == 0.0


# --------------------------------------------------------------------------- Gaussian-DP fit


def test_gdp_fit_recovers_mu_and_its_closed_form():
    scores, included = _gaussian_trials(np.random.default_rng(11), 4000, 1.0)
    fit = E.gdp_fit(scores, included, delta=DELTA)
    assert abs(fit.mu - 1.0) < 3 * fit.se
    y0, y1 = scores[~included], scores[included]
    s0, s1 = y0.std(ddof=1), y1.std(ddof=1)
    mu = (y1.mean() - y0.mean()) / s0
    se = math.sqrt(s1**2 / (len(y1) * s0**2) + 1 / len(y0) + mu**2 / (2 * (len(y0) - 1)))
    z = stats.norm.ppf(0.95)
    assert (fit.mu, fit.se) == pytest.approx((mu, se), rel=1e-12)
    assert (fit.mu_lower, fit.mu_upper) == pytest.approx((mu - z * se, mu + z * se), rel=1e-12)
    assert fit.epsilon_lower == pytest.approx(E.gdp_epsilon(mu - z * se, DELTA), rel=1e-12)
    assert fit.epsilon_lower < fit.epsilon < fit.epsilon_upper
    assert (fit.n0, fit.n1, fit.confidence, fit.delta) == (len(y0), len(y1), 0.95, DELTA)


def test_gdp_fit_coverage_by_simulation():
    """μ_L ≤ μ and μ ≤ μ_U each with probability ≈ 95 % (the normal approximation), so the
    two-sided interval covers at ≈ 90 %; not over-conservative either."""
    mu, reps = 1.0, 600
    rng = np.random.default_rng(12)
    low_miss = high_miss = 0
    for _ in range(reps):
        fit = E.gdp_fit(*_gaussian_trials(rng, 400, mu), delta=DELTA)
        low_miss += fit.mu_lower > mu
        high_miss += fit.mu_upper < mu
    tol = 3 * math.sqrt(0.05 * 0.95 / reps)
    assert 0.05 - tol <= low_miss / reps <= 0.05 + tol
    assert 0.05 - tol <= high_miss / reps <= 0.05 + tol


def test_gdp_fit_detects_half_the_noise():
    sigma = 1.0
    claimed = E.gdp_epsilon(1 / sigma, DELTA)
    rng = np.random.default_rng(13)
    included = rng.random(2000) < 0.5
    z = rng.standard_normal(2000)
    good = E.gdp_fit(included + sigma * z, included, delta=DELTA)
    bad = E.gdp_fit(included + sigma / 2 * z, included, delta=DELTA)
    assert good.epsilon_lower <= claimed < good.epsilon_upper
    assert bad.epsilon_lower > claimed  # μ = 2 where 1 is claimed


def test_gdp_fit_degenerate_scores():
    included = np.array([True, False] * 10)
    inf = E.gdp_fit(np.where(included, np.nan, 0.0), included, delta=DELTA)
    assert inf.mu == inf.mu_lower == inf.epsilon_lower == math.inf
    no_noise = E.gdp_fit(included.astype(float), included, delta=DELTA)
    assert no_noise.mu == math.inf and no_noise.sd0 == 0.0
    reversed_ = E.gdp_fit(-included.astype(float) + 0.01 * np.arange(20), included, delta=DELTA)
    assert reversed_.mu < 0 and reversed_.epsilon == reversed_.epsilon_upper == 0.0


# --------------------------------------------------------------------------- accountant


def test_accountant_epsilon_composes_and_is_cached():
    one = E.accountant_epsilon(1.0, delta=DELTA, sample_rate=0.1)
    many = E.accountant_epsilon(1.0, steps=50, delta=DELTA, sample_rate=0.1)
    acc = Accountant("pld")
    acc.step(noise_multiplier=1.0, sample_rate=0.1, num_steps=50)
    assert many == acc.epsilon(DELTA) and one < many
    before = E._accountant_epsilon.cache_info().hits
    E.accountant_epsilon(1.0, steps=50, delta=DELTA, sample_rate=0.1)
    assert E._accountant_epsilon.cache_info().hits == before + 1


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: E.gdp_fit([1.0, 2.0, 3.0], [True, True, True], delta=DELTA), "each side"),
        (lambda: E.threshold_epsilon([1.0, 2.0], [False, False], delta=DELTA), "each side"),
        (lambda: E.one_run_epsilon([1.0, 2.0], [True], delta=DELTA), "same length"),
        (lambda: E.gdp_fit([1.0, 2.0], [True, False, True], delta=DELTA), "same length"),
        (lambda: E.one_run_epsilon([], [], delta=DELTA), "empty"),
        (lambda: E.one_run_epsilon([[1.0]], [[True]], delta=DELTA), "1-d"),
        (lambda: E.one_run_epsilon([1.0, 2.0], [0.5, 1.0], delta=DELTA), "included"),
        (lambda: E.one_run_epsilon([1.0, 2.0], [1, 0], delta=DELTA, confidence=1.0), "confidence"),
        (lambda: E.one_run_epsilon([1.0, 2.0], [1, 0], delta=DELTA, confidence=0.0), "confidence"),
        (lambda: E.threshold_epsilon([1.0, 2.0], [1, 0], delta=DELTA, confidence=1.5), "confidence"),
        (lambda: E.gdp_fit([1.0, 2, 3, 4], [1, 0, 1, 0], delta=DELTA, confidence=-0.1), "confidence"),
        (lambda: E.one_run_epsilon([1.0, 2.0], [1, 0], delta=1.0), "delta"),
        (lambda: E.threshold_epsilon([1.0, 2.0], [1, 0], delta=-1e-5), "delta"),
        (lambda: E.gdp_fit([1.0, 2, 3, 4], [1, 0, 1, 0], delta=0.0), "delta"),
        (lambda: E.gdp_epsilon(1.0, 0.0), "delta"),
        (lambda: E.gdp_epsilon(1.0, 1.0), "delta"),
        (lambda: E.gdp_mu(1.0, 2.0), "delta"),
        (lambda: E.gdp_delta(-1.0, 1.0), "epsilon"),
        (lambda: E.gdp_delta(1.0, float("nan")), "mu"),
        (lambda: E.one_run_epsilon([1.0, 2.0], [1, 0], delta=DELTA, guesses=[3]), "guesses"),
        (lambda: E.one_run_epsilon([1.0, 2.0], [1, 0], delta=DELTA, guesses=[]), "guesses"),
        (lambda: E.one_run_epsilon([1.0, 2.0], [1, 0], delta=DELTA, guesses=[0]), "guesses"),
        (lambda: E.threshold_epsilon([1.0, 2.0], [1, 0], delta=DELTA, thresholds=[]), "thresholds"),
        (lambda: E.threshold_epsilon([1.0, 2.0], [1, 0], delta=DELTA, thresholds=[np.nan]), "thresholds"),
        (lambda: E.clopper_pearson_upper(5, 4, 0.05), "k"),
        (lambda: E.clopper_pearson_upper(0, 0, 0.05), "n"),
        (lambda: E.clopper_pearson_upper(1, 4, 1.0), "significance"),
        (lambda: E.clopper_pearson_interval(1, 4, 0.0), "confidence"),
        (
            lambda: E.one_run_p_value(1.0, num_guesses=5, num_correct=6, num_canaries=10, delta=0),
            "num_correct",
        ),
        (
            lambda: E.one_run_p_value(1.0, num_guesses=11, num_correct=6, num_canaries=10, delta=0),
            "num_guesses",
        ),
        (lambda: E.accountant_epsilon(-1.0, delta=DELTA), "noise_multiplier"),
        (lambda: E.accountant_epsilon(1.0, steps=0, delta=DELTA), "steps"),
        (lambda: E.accountant_epsilon(1.0, sample_rate=1.5, delta=DELTA), "sample_rate"),
    ],
)
def test_validation_errors_name_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_results_are_frozen():
    scores, included = _gaussian_trials(np.random.default_rng(0), 100, 1.0)
    for result in (
        E.one_run_epsilon(scores, included, delta=DELTA),
        E.threshold_epsilon(scores, included, delta=DELTA),
        E.gdp_fit(scores, included, delta=DELTA),
    ):
        with pytest.raises(AttributeError):
            result.delta = 0.5
