"""White-box gradient canaries: the core bookkeeping, and one-run audits of the real optimizers.

The contract: for a correct mechanism the audit's ε_emp (one-run lower bound) and the GDP fit's
lower end stay at or below the accountant's ε; a mechanism with half the claimed noise, or none,
is detected (its audit exceeds the ε claimed for it). The runs use full batches (q = 1): every
included canary is in every step, so its score is exactly N(T, Tσ²) against N(0, Tσ²) plus the
data's common nuisance, and the accountant's ε is that of √T/σ-GDP.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from adaclip import strategies as S
from adaclip.accounting import Accountant
from adaclip.audit.estimators import gdp_epsilon
from adaclip.audit.gradient_canaries import GradientCanaries, flatten_centre_scale

DELTA = 1e-5


def accountant_eps(sigma: float, steps: int, q: float = 1.0) -> float:
    acc = Accountant("pld")
    for _ in range(steps):
        acc.step(noise_multiplier=sigma, sample_rate=q)
    return acc.epsilon(DELTA)


# --------------------------------------------------------------------------- the core set


def test_coordinates_are_distinct_and_inclusions_fair():
    c = GradientCanaries(5000, num_canaries=4000, seed=1, sample_rate=1.0)
    assert len(np.unique(c.coordinates)) == 4000
    assert c.included.dtype == bool
    # Bernoulli(½): a two-sided binomial test at 0.1 %
    assert stats.binomtest(int(c.included.sum()), 4000, 0.5).pvalue > 1e-3


def test_same_seed_same_canaries_other_seed_other():
    a = GradientCanaries(100, num_canaries=50, seed=3, sample_rate=0.5)
    b = GradientCanaries(100, num_canaries=50, seed=3, sample_rate=0.5)
    c = GradientCanaries(100, num_canaries=50, seed=4, sample_rate=0.5)
    assert np.array_equal(a.coordinates, b.coordinates) and np.array_equal(a.included, b.included)
    assert np.array_equal(a.sample(), b.sample())
    assert not (np.array_equal(a.coordinates, c.coordinates) and np.array_equal(a.included, c.included))


def test_sampling_rate_only_included():
    c = GradientCanaries(1000, num_canaries=1000, seed=0, sample_rate=0.3)
    counts = np.zeros(1000)
    for _ in range(200):
        counts[c.sample()] += 1
    assert counts[~c.included].sum() == 0
    rate = counts[c.included].sum() / (200 * c.included.sum())
    assert abs(rate - 0.3) < 0.01


def test_gradients_and_readback_formula():
    rng = np.random.default_rng(0)
    d = 12
    c = GradientCanaries(d, num_canaries=4, seed=0, sample_rate=1.0, canary_norm=7.0)
    a, b = rng.standard_normal(d), rng.uniform(0.5, 2.0, d)
    rows = c.gradients(np.array([0, 2]), a, b)
    for r, i in zip(rows, (0, 2)):
        w = (r - a) / b
        expected = np.zeros(d)
        expected[c.coordinates[i]] = 7.0
        np.testing.assert_allclose(w, expected, atol=1e-12)
    released = a + b * rng.standard_normal(d)
    c.observe(released, a, b, expected_batch_size=3.0, sampled=np.array([0, 2]))
    j = c.coordinates
    np.testing.assert_allclose(c.scores, (released[j] - a[j]) * 3.0 / b[j])
    assert c.times_sampled.tolist() == [1, 0, 1, 0] and c.steps == 1


def test_nan_release_counts_as_a_perfect_distinguisher():
    c = GradientCanaries(4, num_canaries=2, seed=0, sample_rate=1.0)
    c.observe(np.full(4, np.nan), np.zeros(4), np.ones(4), expected_batch_size=1.0)
    assert np.all(np.isinf(c.scores))


def test_flatten_centre_scale_broadcasts_scalars():
    a, b = flatten_centre_scale(None, [2.0, np.array([[1.0, 3.0]])], [3, 2])
    np.testing.assert_array_equal(a, np.zeros(5))
    np.testing.assert_array_equal(b, [2, 2, 2, 1, 3])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_params=3, num_canaries=4), "exceeds num_params"),
        (dict(num_params=0, num_canaries=1), "num_params"),
        (dict(num_params=3, num_canaries=0), "num_canaries"),
        (dict(num_params=3, num_canaries=1, sample_rate=0.0), "sample_rate"),
        (dict(num_params=3, num_canaries=1, sample_rate=1.5), "sample_rate"),
        (dict(num_params=3, num_canaries=1, canary_norm=1.0), "canary_norm"),
        (dict(num_params=3, num_canaries=1, inclusion_probability=1.0), "inclusion_probability"),
    ],
)
def test_bad_arguments(kwargs, match):
    args = dict(seed=0, sample_rate=1.0) | kwargs
    d = args.pop("num_params")
    with pytest.raises(ValueError, match=match):
        GradientCanaries(d, **args)


def test_observe_and_report_errors():
    c = GradientCanaries(4, num_canaries=2, seed=0, sample_rate=1.0)
    with pytest.raises(ValueError, match="after training"):
        c.report(delta=DELTA)
    with pytest.raises(ValueError, match="flat vector of 4"):
        c.observe(np.zeros(3), np.zeros(4), np.ones(4), expected_batch_size=1.0)
    with pytest.raises(ValueError, match="expected_batch_size"):
        c.observe(np.zeros(4), np.zeros(4), np.ones(4), expected_batch_size=0.0)
    assert c.steps == 0 and np.all(c.scores == 0)


# --------------------------------------------------------------------------- the NumPy core mechanism


def core_run(strategy, *, sigma: float, steps: int, num_canaries: int, seed: int, shapes=((20, 15), (15,))):
    """``steps`` full-batch private steps of the core on training-like data plus canaries."""
    rng = np.random.default_rng(seed)
    sizes = [math.prod(s) for s in shapes]
    d = sum(sizes)
    canaries = GradientCanaries(d, num_canaries=num_canaries, seed=seed, sample_rate=1.0)
    state = strategy.init([np.zeros(s) for s in shapes])
    bbar = 8.0
    for _ in range(steps):
        centre, scale = strategy.transform(state, len(shapes))
        a, b = flatten_centre_scale(centre, scale, sizes)
        sampled = canaries.sample()
        data = 0.3 * rng.standard_normal((8, d)) / math.sqrt(d) + 0.05
        units = np.concatenate([data, canaries.gradients(sampled, a, b)])
        per_unit, start = [], 0
        for s, n in zip(shapes, sizes):
            per_unit.append(units[:, start : start + n].reshape(len(units), *s))
            start += n
        noise = [rng.standard_normal(s) for s in shapes] + [
            np.asarray(rng.standard_normal()) for _ in range(getattr(strategy, "num_auxiliary", 0))
        ]
        out, state = S.private_step(
            strategy, state, per_unit, noise, noise_multiplier=sigma, expected_batch_size=bbar
        )
        released = np.concatenate([np.asarray(x).reshape(-1) for x in out])
        canaries.observe(released, a, b, expected_batch_size=bbar, sampled=sampled)
    return canaries


CORE_STRATEGIES = {
    "flat": S.FlatClipping(max_grad_norm=1.0),
    "adaclip": S.AdaptiveClipping.from_initial_clip(1.0, 315),
    "adaclip-ema": S.AdaptiveClipping.from_initial_clip(
        1.0, 315, centre="ema", scale="separated", max_grad_norm=1.0
    ),
    "automatic": S.AutomaticClipping(max_grad_norm=1.0),
}


@pytest.mark.parametrize("name", sorted(CORE_STRATEGIES))
def test_core_audit_within_accountant(name):
    sigma, steps = 2.0, 4  # √T/σ = 1
    canaries = core_run(CORE_STRATEGIES[name], sigma=sigma, steps=steps, num_canaries=300, seed=11)
    eps = accountant_eps(sigma, steps)
    rep = canaries.report(delta=DELTA, accountant_epsilon=eps)
    assert not rep.exceeds_accountant, str(rep)
    assert rep.gdp.epsilon_lower <= eps, str(rep)
    # the GDP fit sees the right shift: μ̂ within 4 standard errors of √T/σ (the data nuisance
    # can only shrink it)
    assert rep.gdp.mu < 1.0 + 4 * rep.gdp.se and rep.gdp.mu > 1.0 - 4 * rep.gdp.se - 0.2, str(rep)


def test_core_audit_detects_half_the_noise():
    sigma, steps = 4.0, 4  # claimed √T/σ = 0.5
    claimed = accountant_eps(sigma, steps)
    canaries = core_run(CORE_STRATEGIES["adaclip"], sigma=sigma / 2, steps=steps, num_canaries=300, seed=12)
    rep = canaries.report(delta=DELTA, accountant_epsilon=claimed)
    assert rep.gdp.epsilon_lower > claimed, str(rep)


def test_core_audit_detects_no_noise():
    claimed = accountant_eps(4.0, 4)
    canaries = core_run(CORE_STRATEGIES["flat"], sigma=0.0, steps=4, num_canaries=300, seed=13)
    rep = canaries.report(delta=DELTA, accountant_epsilon=claimed)
    assert rep.exceeds_accountant, str(rep)  # the assumption-free bound already sees it


def test_gdp_reference_value():
    # the yardstick used above: √T/σ-GDP at δ = 1e-5 is what the PLD accountant reports for q = 1
    assert abs(gdp_epsilon(1.0, DELTA) - accountant_eps(2.0, 4)) < 1e-3
