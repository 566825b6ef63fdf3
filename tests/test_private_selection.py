"""Private selection (``adaclip.accounting.selection``): the accounting of the best of a random
number of trials (Papernot & Steinke 2022, arXiv:2110.03620), its calibration, the sampler of the
number of trials and the driver ``select_privately``."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.privacy_accountant import NeighboringRelation
from dp_accounting.rdp import rdp_privacy_accountant
from scipy import optimize, stats

from adaclip.accounting import (
    TRIAL_DISTRIBUTIONS,
    Selection,
    calibrate_noise_multiplier,
    calibrate_selection_noise_multiplier,
    draw_number_of_trials,
    probability_never_tried,
    select_privately,
    selection_epsilon,
    selection_event,
)
from adaclip.accounting import selection as selection_module
from adaclip.errors import InvalidHyperparameterError

Q, T, SIGMA, DELTA = 0.01, 500, 1.0, 1e-5
RUN = {"noise_multiplier": SIGMA, "sample_rate": Q, "steps": T}
ORDERS = (2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0, 32.0, 64.0)


def _run_event(q: float = Q, sigma: float = SIGMA, steps: int = T) -> dp_event.DpEvent:
    return dp_event.SelfComposedDpEvent(
        dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)), steps
    )


def _rdp_accountant(orders=None) -> rdp_privacy_accountant.RdpAccountant:
    kwargs = {} if orders is None else {"orders": list(orders)}
    return rdp_privacy_accountant.RdpAccountant(
        neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE, **kwargs
    )


def _run_rdp(orders) -> np.ndarray:
    return _rdp_accountant(orders).compose(_run_event()).rdp


def _delta_at(orders, rdp, eps: float) -> float:
    """δ of an RDP curve at ε, by hand: the smaller of the KL bound δ <= sqrt(1 − e^{−ε_α})
    and the improved conversion (Canonne, Kamath & Steinke 2020, Prop. 12)
    log δ = (α − 1)(ε_α − ε + log(1 − 1/α)) − log α, minimised over the orders."""
    best = math.inf
    for a, r in zip(orders, rdp):
        best = min(
            best, 0.5 * math.log1p(-math.exp(-r)), (a - 1) * (r - eps + math.log1p(-1 / a)) - math.log(a)
        )
    return math.exp(best)


def _epsilon_at(orders, rdp, delta: float) -> float:
    """ε of an RDP curve at δ, by hand: min over α of ε_α + log(1 − 1/α) − log(δα)/(α − 1)."""
    return max(0.0, min(r + math.log1p(-1 / a) - math.log(delta * a) / (a - 1) for a, r in zip(orders, rdp)))


# ------------------------------------------------------------------------ the accountant


@pytest.mark.parametrize("shape", [math.inf, 1.0, 0.0, 2.5])
@pytest.mark.parametrize("mean", [1.0, 3.0, 10.0])
def test_epsilon_is_dp_accountings_rdp_on_the_same_event(shape, mean):
    expected = (
        _rdp_accountant()
        .compose(dp_event.RepeatAndSelectDpEvent(_run_event(), mean, shape))
        .get_epsilon(DELTA)
    )
    assert selection_epsilon(**RUN, delta=DELTA, mean_trials=mean, shape=shape) == expected
    assert selection_event(**RUN, mean_trials=mean, shape=shape) == dp_event.RepeatAndSelectDpEvent(
        _run_event(), mean, shape
    )


def test_shape_names_are_dp_accountings_shapes():
    # dp-accounting: shape = inf is Poisson, 1 geometric, 0 logarithmic (not 0 = Poisson)
    assert TRIAL_DISTRIBUTIONS == {"poisson": math.inf, "geometric": 1.0, "logarithmic": 0.0}
    for name, shape in TRIAL_DISTRIBUTIONS.items():
        assert selection_epsilon(**RUN, delta=DELTA, mean_trials=4, shape=name) == selection_epsilon(
            **RUN, delta=DELTA, mean_trials=4, shape=shape
        )


def test_pld_does_not_support_the_event():
    """Why the selection is accounted with RDP: dp-accounting's PLD accountant refuses it."""
    from dp_accounting.pld import pld_privacy_accountant

    event = dp_event.RepeatAndSelectDpEvent(_run_event(), 3.0, 1.0)
    assert not pld_privacy_accountant.PLDAccountant().supports(event)
    assert _rdp_accountant().supports(event)


def test_banded_run_is_ceil_t_over_b_compositions_at_b_times_q():
    banded = selection_epsilon(
        noise_multiplier=2.0, sample_rate=0.005, steps=1001, bands=4, delta=DELTA, mean_trials=5
    )
    plain = selection_epsilon(noise_multiplier=2.0, sample_rate=0.02, steps=251, delta=DELTA, mean_trials=5)
    assert banded == plain
    assert banded != selection_epsilon(
        noise_multiplier=2.0, sample_rate=0.005, steps=1001, delta=DELTA, mean_trials=5
    )


def test_poisson_bound_by_hand():
    """Papernot & Steinke, Theorem 6: K ~ Poisson(μ); if one trial is (λ, ε(λ))-RDP and
    (ε̂, δ̂)-DP with e^ε̂ <= 1 + 1/(λ − 1), the best of K trials is (λ, ε'(λ))-RDP with
    ε'(λ) = ε(λ) + μ·δ̂ + log(μ)/(λ − 1). dp-accounting takes ε̂ = log(1 + 1/(λ − 1)) and δ̂ the
    run's δ at ε̂; recomputed here at every order, then converted to (ε, δ) by hand."""
    mu = 6.0
    rdp = _run_rdp(ORDERS)
    hand = []
    for lam, eps_lam in zip(ORDERS, rdp):
        eps_hat = math.log1p(1 / (lam - 1))
        delta_hat = _delta_at(ORDERS, rdp, eps_hat)
        hand.append(eps_lam + mu * delta_hat + math.log(mu) / (lam - 1))
    # at one order, λ = 8, against the accountant's RDP curve of the selection
    composed = (
        _rdp_accountant(ORDERS).compose(dp_event.RepeatAndSelectDpEvent(_run_event(), mu, math.inf)).rdp
    )
    i = ORDERS.index(8.0)
    assert math.isclose(composed[i], hand[i], rel_tol=1e-12)
    assert hand[i] > rdp[i]
    got = selection_epsilon(**RUN, delta=DELTA, mean_trials=mu, shape="poisson", rdp_orders=ORDERS)
    assert math.isclose(got, _epsilon_at(ORDERS, hand, DELTA), rel_tol=1e-12)


def test_geometric_bound_by_hand():
    """Papernot & Steinke, Theorem 2 with η = 1 (geometric, γ = 1/μ): ε'(λ) = ε(λ) +
    2·min_λ̂ ((1 − 1/λ̂)ε(λ̂) + log(1/γ)/λ̂) + log(μ)/(λ − 1), then made non-decreasing in λ
    (RDP is monotone in the order: ε'(λ) <= ε'(λ') for λ <= λ')."""
    mu = 6.0
    rdp = _run_rdp(ORDERS)
    c = 2 * min((1 - 1 / a) * r + math.log(mu) / a for a, r in zip(ORDERS, rdp))
    raw = [r + c + math.log(mu) / (a - 1) for a, r in zip(ORDERS, rdp)]
    hand = [min(raw[i:]) for i in range(len(raw))]
    got = selection_epsilon(**RUN, delta=DELTA, mean_trials=mu, shape="geometric", rdp_orders=ORDERS)
    assert math.isclose(got, _epsilon_at(ORDERS, hand, DELTA), rel_tol=1e-12)


@pytest.mark.parametrize("shape", ["poisson", "geometric", "logarithmic", 3.0])
def test_more_trials_cost_more_and_more_noise_costs_less(shape):
    by_mean = [selection_epsilon(**RUN, delta=DELTA, mean_trials=m, shape=shape) for m in (1, 2, 4, 10, 30)]
    assert all(a < b for a, b in zip(by_mean, by_mean[1:])), by_mean
    by_sigma = [
        selection_epsilon(noise_multiplier=s, sample_rate=Q, steps=T, delta=DELTA, mean_trials=5, shape=shape)
        for s in (0.8, 1.0, 1.5)
    ]
    assert all(a > b for a, b in zip(by_sigma, by_sigma[1:])), by_sigma


def test_one_trial_sanity():
    """A truncated negative binomial with mean 1 is one trial: its bound is one run's RDP ε plus
    a little (the theorem's constant at γ = 1); Poisson(1) can run several trials and costs more."""
    one_run = _rdp_accountant().compose(_run_event()).get_epsilon(DELTA)
    for shape in ("geometric", "logarithmic", 3.0):
        eps = selection_epsilon(**RUN, delta=DELTA, mean_trials=1, shape=shape)
        assert one_run <= eps <= 1.05 * one_run, (shape, eps, one_run)
        assert {draw_number_of_trials(random.Random(s), mean_trials=1, shape=shape) for s in range(50)} == {1}
    assert selection_epsilon(**RUN, delta=DELTA, mean_trials=1, shape="poisson") > 1.05 * one_run


def test_noisy_score_is_composed_into_the_trial():
    with_score = selection_epsilon(**RUN, delta=DELTA, mean_trials=5, score_noise_multiplier=10.0)
    trial = dp_event.ComposedDpEvent([_run_event(), dp_event.GaussianDpEvent(10.0)])
    expected = _rdp_accountant().compose(dp_event.RepeatAndSelectDpEvent(trial, 5.0, 1.0)).get_epsilon(DELTA)
    assert with_score == expected
    assert with_score > selection_epsilon(**RUN, delta=DELTA, mean_trials=5)


def test_no_noise_is_no_privacy():
    assert (
        selection_epsilon(noise_multiplier=0.0, sample_rate=Q, steps=T, delta=DELTA, mean_trials=3)
        == math.inf
    )


# ------------------------------------------------------------------------ calibration


@pytest.mark.parametrize("shape, bands", [("geometric", 1), ("poisson", 1), ("logarithmic", 4)])
def test_calibration_round_trip(shape, bands):
    target, mean, tol = 2.0, 10.0, 1e-4
    plan = {"sample_rate": Q, "steps": T, "bands": bands, "delta": DELTA, "mean_trials": mean, "shape": shape}
    sigma = calibrate_selection_noise_multiplier(target_epsilon=target, tol=tol, **plan)
    assert selection_epsilon(noise_multiplier=sigma, **plan) <= target
    assert selection_epsilon(noise_multiplier=sigma * (1 - 10 * tol), **plan) > target
    # one run alone (same RDP accounting) needs less noise than the selection
    single = calibrate_noise_multiplier(
        target_epsilon=target,
        delta=DELTA,
        sample_rate=Q * bands,
        steps=-(-T // bands),
        accountant="rdp",
        progress=False,
    )
    assert single < sigma


def test_calibration_refuses_an_impossible_budget():
    # the noisy score alone (σ = 0.2, ε ≫ 1) spends more than the target
    with pytest.raises(InvalidHyperparameterError, match="cannot be met"):
        calibrate_selection_noise_multiplier(
            target_epsilon=0.5, delta=DELTA, sample_rate=Q, steps=T, mean_trials=3, score_noise_multiplier=0.2
        )


# ------------------------------------------------------------------------ the number of trials


def _tnb_gamma_by_scipy(eta: float, mean: float) -> float:
    if eta == 0:
        return 1 - optimize.brentq(lambda p: stats.logser(p).mean() - mean, 1e-12, 1 - 1e-12, xtol=1e-15)

    def truncated_mean(g: float) -> float:
        return eta * (1 - g) / g / (1 - g**eta)

    return optimize.brentq(lambda g: truncated_mean(g) - mean, 1e-9, 1 - 1e-12, xtol=1e-15)


def _pmf(shape: float, mean: float):
    """The distribution of K, from SciPy (independent of the sampler's own formulas)."""
    if math.isinf(shape):
        return 0, stats.poisson(mean).pmf
    if shape == 1:
        return 1, stats.geom(1 / mean).pmf
    gamma = _tnb_gamma_by_scipy(shape, mean)
    if shape == 0:
        return 1, stats.logser(1 - gamma).pmf
    return 1, lambda k: stats.nbinom(shape, gamma).pmf(k) / (1 - gamma**shape)


def _chi_square_p(draws, shape: float, mean: float) -> float:
    """χ² goodness of fit of the draws against the distribution; bins with >= 5 expected, the
    last one the whole tail."""
    draws = np.asarray(draws)
    n = len(draws)
    k0, pmf = _pmf(shape, mean)
    observed, expected = [], []
    k, mass = k0, 0.0
    assert draws.min() >= k0
    while n * (1 - mass - pmf(k)) >= 5:
        observed.append(int(np.sum(draws == k)))
        expected.append(n * pmf(k))
        mass += pmf(k)
        k += 1
    observed.append(int(np.sum(draws >= k)))
    expected.append(n - sum(expected))
    return float(stats.chisquare(observed, expected).pvalue)


@pytest.mark.parametrize(
    "shape, mean",
    [(math.inf, 3.0), (math.inf, 20.0), (1.0, 3.0), (1.0, 10.0), (0.0, 3.0), (2.5, 4.0), (0.5, 6.0)],
)
def test_number_of_trials_follows_the_distribution(shape, mean):
    rng = random.Random(12345)
    draws = [draw_number_of_trials(rng, mean_trials=mean, shape=shape) for _ in range(20_000)]
    assert _chi_square_p(draws, shape, mean) > 1e-3
    assert abs(np.mean(draws) - mean) < 5 * np.std(draws) / math.sqrt(len(draws))


def test_the_chi_square_test_rejects_a_wrong_distribution():
    """Negative controls: the same test rejects Poisson draws taken for geometric ones, and
    Poisson(3) draws taken for Poisson(3.3)."""
    rng = random.Random(12345)
    poisson = [draw_number_of_trials(rng, mean_trials=3.0, shape="poisson") for _ in range(20_000)]
    assert min(poisson) == 0
    assert _chi_square_p([k for k in poisson if k >= 1], 1.0, 3.0) < 1e-10
    assert _chi_square_p(poisson, math.inf, 3.3) < 1e-6
    assert _chi_square_p(poisson, math.inf, 3.0) > 1e-3


@pytest.mark.parametrize("shape", [0.0, 0.5, 2.5, 7.0])
@pytest.mark.parametrize("mean", [1.5, 4.0, 40.0])
def test_sampled_gamma_is_on_the_side_the_bound_covers(shape, mean):
    """dp-accounting bounds the selection with γ at or below the root (``log(1/γ)`` larger) and
    log(mean); the sampler's γ is at or above it, with E[K] <= mean."""
    gamma = selection_module._tnb_gamma(shape, mean)
    assert gamma >= rdp_privacy_accountant._gamma_truncated_negative_binomial(shape, mean)
    assert rdp_privacy_accountant._truncated_negative_binomial_mean(gamma, shape) <= mean * (1 + 1e-12)
    assert math.isclose(gamma, _tnb_gamma_by_scipy(shape, mean), rel_tol=1e-8)


@pytest.mark.parametrize("shape", ["poisson", "geometric", "logarithmic", 2.5])
def test_probability_never_tried(shape):
    eta = TRIAL_DISTRIBUTIONS.get(shape, shape)
    k0, pmf = _pmf(eta, 10.0)
    ks = np.arange(k0, 2000)
    exact = float(np.sum(pmf(ks) * (1 - 1 / 4) ** ks))
    assert math.isclose(
        probability_never_tried(num_candidates=4, mean_trials=10, shape=shape), exact, rel_tol=1e-7
    )
    assert probability_never_tried(num_candidates=1, mean_trials=10, shape=shape) == pytest.approx(
        pmf(0) if k0 == 0 else 0
    )


# ------------------------------------------------------------------------ the driver

PRIVACY = {"noise_multiplier": SIGMA, "sample_rate": Q, "steps": T, "delta": DELTA}


def test_driver_draws_the_number_of_trials_and_the_candidates_as_stated():
    candidates = ("flat", "quantile", "adaclip")
    trials, picked, calls = [], [], []
    for seed in range(3000):
        calls.clear()
        selected = select_privately(
            candidates, lambda c, t: (calls.append((c, t)) or 0.0, None), mean_trials=3, shape="geometric", seed=seed,
            **PRIVACY,
        )  # fmt: skip
        assert selected.trials == len(calls) and [t for _, t in calls] == list(range(len(calls)))
        trials.append(selected.trials)
        picked.extend(c for c, _ in calls)
    assert _chi_square_p(trials, 1.0, 3.0) > 1e-3
    assert _chi_square_p(trials, math.inf, 3.0) < 1e-6  # negative control: not Poisson
    counts = [picked.count(c) for c in candidates]
    assert stats.chisquare(counts).pvalue > 1e-3  # uniform over the candidates
    assert stats.chisquare([counts[0] * 1.1, counts[1], counts[2] * 0.9]).pvalue < 1e-3  # which it can reject


def test_only_the_best_trial_is_returned():
    scores = random.Random(7)
    seen = []

    def run_candidate(candidate, trial):
        score = scores.random()
        result = object()
        seen.append((candidate, trial, score, result))
        return score, result

    selected = select_privately(list(range(5)), run_candidate, mean_trials=20, seed=3, **PRIVACY)
    assert isinstance(selected, Selection) and selected.trials == len(seen) > 1
    best = max(seen, key=lambda s: s[2])
    assert (selected.candidate, selected.score) == (best[0], best[2])
    assert selected.result is best[3]
    assert selected.candidate_index == best[0]
    assert selected.epsilon == selection_epsilon(**RUN, delta=DELTA, mean_trials=20)
    assert (selected.delta, selected.mean_trials, selected.shape) == (DELTA, 20.0, 1.0)
    # nothing else: no per-trial scores, no index of the best trial
    assert Selection._fields == (
        "candidate", "score", "result", "candidate_index", "epsilon", "delta", "trials", "mean_trials", "shape",
    )  # fmt: skip


def test_nan_ranks_last_and_ties_go_to_the_earlier_trial():
    outcomes = iter([(math.nan, "nan"), (0.5, "first"), (0.5, "second"), (0.1, "low")] * 100)

    selected = select_privately(
        ["x"], lambda c, t: next(outcomes), mean_trials=30, shape="geometric", seed=0, **PRIVACY
    )
    assert selected.trials >= 2
    assert (selected.score, selected.result) == (0.5, "first")


def test_seed_reproduces_and_no_seed_uses_the_system_generator(monkeypatch):
    def run(c, t):
        return float(c * 10 + t), (c, t)

    a = select_privately(range(4), run, mean_trials=5, seed=11, **PRIVACY)
    b = select_privately(range(4), run, mean_trials=5, seed=11, **PRIVACY)
    assert a == b
    made = []

    class Spy(random.SystemRandom):
        def __init__(self):
            made.append(self)
            super().__init__()

    monkeypatch.setattr(selection_module.random, "SystemRandom", Spy)
    select_privately(range(4), run, mean_trials=5, **PRIVACY)
    assert len(made) == 1


def test_poisson_can_run_no_trial():
    calls = []
    for seed in range(100):
        selected = select_privately(["a"], lambda c, t: (calls.append(t) or 1.0, "r"), mean_trials=1, shape="poisson",
                                    seed=seed, **PRIVACY)  # fmt: skip
        if selected.trials == 0:
            break
    else:
        pytest.fail("Poisson(1) drew no zero in 100 seeds")
    assert selected[:4] == (None, None, None, None)
    assert math.isfinite(selected.epsilon)


def _bad_inputs():
    ok = {"candidates": ["a", "b"], "mean_trials": 3, **PRIVACY}
    cases = {
        "empty candidates": {"candidates": []},
        "not iterable": {"candidates": 3},
        "mean 0": {"mean_trials": 0},
        "mean negative": {"mean_trials": -2},
        "mean below 1": {"mean_trials": 0.5},
        "mean nan": {"mean_trials": math.nan},
        "mean inf": {"mean_trials": math.inf},
        "mean str": {"mean_trials": "3"},
        "shape negative": {"shape": -1},
        "shape nan": {"shape": math.nan},
        "shape unknown": {"shape": "binomial"},
        "shape bool": {"shape": True},
        "seed float": {"seed": 1.5},
        "seed str": {"seed": "x"},
        "delta 0": {"delta": 0.0},
        "sigma negative": {"noise_multiplier": -1.0},
        "q 0": {"sample_rate": 0.0},
        "steps 0": {"steps": 0},
        "bands 0": {"bands": 0},
        "bands too many": {"bands": 200},  # b·q = 2 > 1
        "score noise 0": {"score_noise_multiplier": 0.0},
    }
    return [pytest.param({**ok, **change}, id=name) for name, change in cases.items()]


@pytest.mark.parametrize("kwargs", _bad_inputs())
def test_refusals_run_nothing(kwargs):
    calls = []
    candidates = kwargs.pop("candidates")
    with pytest.raises(InvalidHyperparameterError):
        select_privately(candidates, lambda c, t: calls.append(t) or (1.0, None), **kwargs)
    assert calls == []


def test_refuses_a_run_candidate_that_is_not_callable():
    with pytest.raises(InvalidHyperparameterError, match="run_candidate"):
        select_privately(["a"], "train", mean_trials=3, **PRIVACY)


@pytest.mark.parametrize("mean", [0, -1, 0.99])
def test_accounting_functions_refuse_a_mean_below_one(mean):
    with pytest.raises(InvalidHyperparameterError, match="mean_trials"):
        selection_epsilon(**RUN, delta=DELTA, mean_trials=mean)
    with pytest.raises(InvalidHyperparameterError, match="mean_trials"):
        calibrate_selection_noise_multiplier(
            target_epsilon=2, delta=DELTA, sample_rate=Q, steps=T, mean_trials=mean
        )
    with pytest.raises(InvalidHyperparameterError, match="mean_trials"):
        draw_number_of_trials(random.Random(0), mean_trials=mean)
