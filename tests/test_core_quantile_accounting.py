"""The quantile rule's split of the noise, and its accounting.

A step with the quantile rule releases the clipped gradient sum (sensitivity 1) with noise
``σ_g`` and the count of unclipped units (sensitivity ½) with noise ``σ_b``. With
``σ_g = (σ⁻² − (2σ_b)⁻²)^{-1/2}`` the pair is one Gaussian mechanism with multiplier σ:
``μ² = 1/σ_g² + (½)²/σ_b² = 1/σ²`` (divide each part by its noise: a Gaussian with unit noise
and a sensitivity vector of norm μ). So the accountant records σ, as for DP-SGD.

Checked here: the core's ``σ_g`` against the hand formula; the released noise (KS tests, each
with a negative control at the un-split σ); the pair's privacy (μ, and PLDs of the two parts
composed) against the Gaussian mechanism at σ; and an Accountant fed the steps of a run as the
optimizers feed it (the accounted σ), against the ε of the mechanism the core actually ran.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from scipy import stats

from adaclip import reference as R
from adaclip import strategies as S
from adaclip.accounting import Accountant
from adaclip.errors import InvalidHyperparameterError

DELTA = 1e-5
#: KS: a correct law passes at this level, the negative control fails far below it
PASS_P, FAIL_P = 1e-3, 1e-8


def hand_sigma_g(sigma, sigma_b):
    return (sigma**-2 - (2 * sigma_b) ** -2) ** -0.5


# --------------------------------------------------------------------------- σ_g


@pytest.mark.parametrize(
    "sigma, sigma_b, bbar",
    [(1.0, 0.6, 8.0), (0.5, 0.3, 4.0), (2.0, 5.0, 100.0), (1.1, None, 256.0), (3.0, None, 64.0), (0.8, 0.41, 1.0)],
)
def test_gradient_multiplier_is_the_hand_formula(sigma, sigma_b, bbar):
    rule = S.QuantileRule(count_noise_multiplier=sigma_b)
    want_b = bbar / 20 if sigma_b is None else sigma_b  # the default σ_b = B̄/20
    want_g = hand_sigma_g(sigma, want_b)
    for strategy in (rule, S.QuantileClipping(quantile=rule),
                     S.AdaptiveClipping(scale="separated", max_grad_norm=1.0, quantile=rule)):  # fmt: skip
        sigma_g, got_b = strategy.noise_multipliers(sigma, bbar)
        assert sigma_g == pytest.approx(want_g, rel=1e-14)
        assert got_b == pytest.approx(want_b, rel=1e-15)
    assert R.split_noise_multiplier(sigma, want_b) == pytest.approx(want_g, rel=1e-14)
    # the pair is one Gaussian mechanism with multiplier σ
    assert 1 / want_g**2 + 0.5**2 / want_b**2 == pytest.approx(1 / sigma**2, rel=1e-13)
    assert want_g > sigma


def test_no_noise_and_strategies_without_a_count():
    assert S.QuantileRule(count_noise_multiplier=0.5).noise_multipliers(0.0, 8.0) == (0.0, 0.0)
    assert S.QuantileClipping().noise_multipliers(0.0, 8.0) == (0.0, 0.0)
    for strategy in (S.AdaptiveClipping(), S.AutomaticClipping(), S.FlatClipping(1.0)):
        assert strategy.noise_multipliers(1.3, 8.0) == (1.3, 0.0)
        assert getattr(strategy, "num_auxiliary", 0) == 0


@pytest.mark.parametrize("sigma, sigma_b", [(1.0, 0.5), (1.0, 0.2), (4.0, 1.99)])
def test_sigma_at_or_beyond_twice_the_count_noise_is_refused(sigma, sigma_b):
    with pytest.raises(InvalidHyperparameterError, match="count_noise_multiplier"):
        S.QuantileRule(count_noise_multiplier=sigma_b).noise_multipliers(sigma, 10.0)
    with pytest.raises(InvalidHyperparameterError):
        R.split_noise_multiplier(sigma, sigma_b)


def test_traced_sigma_gives_the_formula_or_nan():
    """Array σ (as under jax.jit): the formula where valid, NaN (poisoning the release) where not."""
    rule = S.QuantileRule(count_noise_multiplier=0.6)
    sigma_g, sigma_b = rule.noise_multipliers(np.asarray(1.0), 8.0)
    assert float(sigma_g) == pytest.approx(hand_sigma_g(1.0, 0.6), rel=1e-14) and float(sigma_b) == 0.6
    assert math.isnan(float(rule.noise_multipliers(np.asarray(1.5), 8.0)[0]))
    sigma_g, sigma_b = rule.noise_multipliers(np.asarray(0.0), 8.0)
    assert float(sigma_g) == 0.0 and float(sigma_b) == 0.0


# --------------------------------------------------------------------------- the released noise (KS)


SIGMA, SIGMA_B, BBAR, C0 = 1.0, 0.6, 8.0, 0.7
SIGMA_G = hand_sigma_g(SIGMA, SIGMA_B)  # 1.81: far enough from σ for the negative controls


def ks(sample, sd):
    return stats.kstest(sample, stats.norm(scale=sd).cdf).pvalue


def test_released_gradient_noise_has_the_split_std():
    """QuantileClipping, a batch of units: ``g̃ − C·Σw̄/B̄`` (the reference's noiseless release)
    is ``N(0, (σ_g·C/B̄)²)`` per coordinate, not ``N(0, (σ·C/B̄)²)``."""
    rng = np.random.default_rng(0)
    d = 20_000
    strategy = S.QuantileClipping(max_grad_norm=C0, quantile=S.QuantileRule(count_noise_multiplier=SIGMA_B))
    G = rng.normal(size=(6, d)) * 0.01
    state = strategy.init([np.zeros((100, 200))])
    noise = [rng.standard_normal((100, 200)), np.asarray(rng.standard_normal())]
    out, _ = S.private_step(strategy, state, [G.reshape(6, 100, 200)], noise, noise_multiplier=SIGMA,
                            expected_batch_size=BBAR)  # fmt: skip
    clean, _ = R.quantile_clip_step(G, C0, np.zeros(d), 0.0, noise_multiplier=0.0, expected_batch_size=BBAR)
    residual = out[0].reshape(-1) - clean
    assert ks(residual, SIGMA_G * C0 / BBAR) > PASS_P
    assert ks(residual, SIGMA * C0 / BBAR) < FAIL_P  # negative control: the un-split σ


def test_released_count_noise_has_std_sigma_b():
    """The count's noise, read back from ``C_{t+1} = C_t·exp(−η(f̃ − γ))`` after an empty step
    (count 0): ``count̃ = B̄(γ − ½ − log(C'/C)/η) ~ N(0, σ_b²)``, not ``N(0, σ²)``."""
    rng = np.random.default_rng(1)
    rule = S.QuantileRule(target_quantile=0.7, learning_rate=0.3, count_noise_multiplier=SIGMA_B)
    strategy = S.QuantileClipping(max_grad_norm=C0, quantile=rule)
    state = strategy.init([np.zeros(3)])
    empty = [np.zeros((0, 3))]
    counts = np.empty(3000)
    for i in range(len(counts)):
        noise = [rng.standard_normal(3), np.asarray(rng.standard_normal())]
        _, new = S.private_step(strategy, state, empty, noise, noise_multiplier=SIGMA, expected_batch_size=BBAR)
        counts[i] = BBAR * (0.7 - 0.5 - math.log(float(new.extra["clip_norm"]) / C0) / 0.3)
    assert ks(counts, SIGMA_B) > PASS_P
    assert ks(counts, SIGMA) < FAIL_P  # negative control


def test_adaptive_separated_quantile_noise_in_w_space():
    """AdaCliP with a separated scale and the quantile rule: ``(g̃ − a)·B̄/b = σ_g z`` on an
    empty step (a, b from the reference's transform)."""
    rng = np.random.default_rng(2)
    strategy = S.AdaptiveClipping(std_min=0.01, std_max=3.0, scale="separated", max_grad_norm=C0,
                                  quantile=S.QuantileRule(count_noise_multiplier=SIGMA_B), centre="kalman")  # fmt: skip
    shapes = [(50, 100), (40, 50), (3000,)]
    d = sum(math.prod(s) for s in shapes)
    state = strategy.init([np.zeros(s) for s in shapes])
    for _ in range(2):  # a state with a centre and unequal statistics
        G = rng.normal(size=(6, d)) * rng.uniform(0.01, 1.0, size=d)
        per_tensor, i = [], 0
        for s in shapes:
            per_tensor.append(G[:, i : i + math.prod(s)].reshape(6, *s))
            i += math.prod(s)
        noise = [rng.standard_normal(s) for s in shapes] + [np.asarray(rng.standard_normal())]
        _, state = S.private_step(strategy, state, per_tensor, noise, noise_multiplier=SIGMA, expected_batch_size=BBAR)
    flat = {"step": state.step, "std": np.concatenate([s.reshape(-1) for s in state.std]),
            "mean": np.concatenate([m.reshape(-1) for m in state.mean]), "clip_norm": float(state.extra["clip_norm"])}  # fmt: skip
    a, b = R.adaptive_transform(flat, **dataclasses.asdict(strategy))
    assert np.std(b) > 0.01 * np.mean(b) and np.any(a != 0)
    noise = [rng.standard_normal(s) for s in shapes] + [np.asarray(rng.standard_normal())]
    out, _ = S.private_step(strategy, state, [np.zeros((0, *s)) for s in shapes], noise, noise_multiplier=SIGMA,
                            expected_batch_size=BBAR)  # fmt: skip
    w = (np.concatenate([o.reshape(-1) for o in out]) - a) * BBAR / b
    assert ks(w, SIGMA_G) > PASS_P
    assert ks(w, SIGMA) < FAIL_P


# --------------------------------------------------------------------------- privacy of the pair


def gaussian_epsilon(mu, delta=DELTA):
    """ε(δ) of μ-GDP (the Gaussian mechanism with sensitivity/σ = μ), exact."""
    from scipy import optimize

    def excess(eps):
        return stats.norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * stats.norm.cdf(-eps / mu - mu / 2) - delta

    return optimize.brentq(excess, 0.0, 200.0, xtol=1e-12)


#: PLD discretisation of these checks (coarser than the accountant's 1e-4, for speed; the
#: pessimistic estimate is then up to ~0.5 % high)
INTERVAL = 1e-3


@pytest.mark.parametrize("sigma, sigma_b", [(0.8, 0.5), (1.0, 2.0)])
def test_the_pair_is_the_gaussian_mechanism_at_sigma(sigma, sigma_b):
    """Gradient (sensitivity 1, noise σ_g) and count (sensitivity ½, noise σ_b): the PLDs of the
    two parts composed give the ε of the Gaussian mechanism at σ (μ = 1/σ GDP, exact); with the
    un-split σ for the gradient the pair is μ-GDP at ``√(1/σ² + ¼/σ_b²)`` and leaks more than
    accounted (negative control)."""
    from dp_accounting.pld import privacy_loss_distribution as pld

    sigma_g, got_b = S.QuantileRule(count_noise_multiplier=sigma_b).noise_multipliers(sigma, 10.0)
    mu = math.sqrt(1 / sigma_g**2 + 0.5**2 / got_b**2)
    assert mu == pytest.approx(1 / sigma, rel=1e-13)

    def pair(gradient_sigma):
        return pld.from_gaussian_mechanism(gradient_sigma, sensitivity=1.0, value_discretization_interval=INTERVAL).compose(
            pld.from_gaussian_mechanism(got_b, sensitivity=0.5, value_discretization_interval=INTERVAL)
        )

    exact = gaussian_epsilon(1 / sigma)
    assert pair(sigma_g).get_epsilon_for_delta(DELTA) == pytest.approx(exact, rel=5e-3)
    unsplit = gaussian_epsilon(math.sqrt(1 / sigma**2 + 0.25 / got_b**2))
    assert unsplit > 1.03 * exact
    assert pair(sigma).get_epsilon_for_delta(DELTA) == pytest.approx(unsplit, rel=5e-3)


@pytest.mark.parametrize("sigma, sigma_b, q", [(1.0, 0.6, 0.01), (1.5, 2.0, 0.1)])
def test_sampled_pair_is_the_sampled_gaussian_at_sigma(sigma, sigma_b, q):
    """Under Poisson sampling the pair, divided by its noise, is a Gaussian with unit noise and
    sensitivity μ in the direction of (1/σ_g, ½/σ_b): its PLD at μ equals the PLD at σ."""
    from dp_accounting.pld import privacy_loss_distribution as pld

    sigma_g, got_b = S.QuantileRule(count_noise_multiplier=sigma_b).noise_multipliers(sigma, 10.0)
    mu = math.sqrt(1 / sigma_g**2 + 0.5**2 / got_b**2)
    kw = dict(sampling_prob=q, value_discretization_interval=INTERVAL)
    pair = pld.from_gaussian_mechanism(1.0, sensitivity=mu, **kw).self_compose(20)
    dpsgd = pld.from_gaussian_mechanism(sigma, sensitivity=1.0, **kw).self_compose(20)
    assert pair.get_epsilon_for_delta(DELTA) == pytest.approx(dpsgd.get_epsilon_for_delta(DELTA), rel=1e-6)
    accountant = Accountant("pld", pld_value_discretization_interval=INTERVAL)
    accountant.step(noise_multiplier=sigma, sample_rate=q, num_steps=20)
    assert accountant.epsilon(DELTA) == pytest.approx(pair.get_epsilon_for_delta(DELTA), rel=1e-6)


def test_accountant_fed_as_the_optimizers_feed_it_gives_dp_sgd_epsilon():
    """A Poisson-sampled run of QuantileClipping on the core, each step recorded as the
    optimizers record it (``Accountant.step(noise_multiplier=σ, sample_rate=q)``, the accounted
    σ, not σ_g): its ε is DP-SGD's at σ, and it is the ε of the mechanism the core actually ran,
    whose multipliers are read back from the releases (gradient noise from ``g̃`` minus the
    noiseless release, count noise from ``C_{t+1}``). Recording σ_g would under-report ε."""
    rng = np.random.default_rng(3)
    N, q, sigma, steps = 400, 0.05, 1.2, 30
    bbar = q * N  # 20: σ_b = B̄/20 = 1 by default, σ_g = (1/1.44 − 1/4)^(−1/2)
    data = rng.normal(size=(N, 12)) * rng.uniform(0.1, 2.0, size=12)
    rule = S.QuantileRule(target_quantile=0.5, learning_rate=0.2)
    strategy = S.QuantileClipping(max_grad_norm=1.0, quantile=rule)
    state = strategy.init([np.zeros((3, 4))])
    accountant, dpsgd = Accountant("rdp"), Accountant("rdp")
    seen_g, seen_b = [], []
    for _ in range(steps):
        batch = data[rng.random(N) < q]
        clip_norm = float(state.extra["clip_norm"])
        z, zc = rng.standard_normal(12), rng.standard_normal()
        out, state = S.private_step(strategy, state, [batch.reshape(-1, 3, 4)], [z.reshape(3, 4), np.asarray(zc)],
                                    noise_multiplier=sigma, expected_batch_size=bbar)  # fmt: skip
        accountant.step(noise_multiplier=sigma, sample_rate=q)  # what DPOptimizer / PrivacyTracker record
        dpsgd.step(noise_multiplier=sigma, sample_rate=q)
        clean, _ = R.quantile_clip_step(batch, clip_norm, np.zeros(12), 0.0, noise_multiplier=0.0,
                                        expected_batch_size=bbar)  # fmt: skip
        seen_g.append(np.median((out[0].reshape(-1) - clean) * bbar / (clip_norm * z)))
        norms = np.linalg.norm(batch / clip_norm, axis=1)
        count = float(np.sum((norms <= 1.0) - 0.5))
        noisy = bbar * (0.5 - 0.5 - math.log(float(state.extra["clip_norm"]) / clip_norm) / 0.2)
        seen_b.append((noisy - count) / zc)
    sigma_g, sigma_b = float(np.mean(seen_g)), float(np.mean(seen_b))
    assert np.ptp(seen_g) < 1e-9 and np.ptp(seen_b) < 1e-9  # the same multipliers every step
    assert sigma_g == pytest.approx(hand_sigma_g(sigma, bbar / 20), rel=1e-9)
    assert sigma_b == pytest.approx(bbar / 20, rel=1e-9)
    ran = Accountant("rdp")  # the mechanism that ran: a sampled Gaussian with 1/μ as its multiplier
    ran.step(noise_multiplier=(1 / sigma_g**2 + 0.25 / sigma_b**2) ** -0.5, sample_rate=q, num_steps=steps)
    eps = accountant.epsilon(DELTA)
    assert eps == dpsgd.epsilon(DELTA)
    assert eps == pytest.approx(ran.epsilon(DELTA), rel=1e-6)
    assert accountant.history == ((q, sigma, steps),)
    under = Accountant("rdp")
    under.step(noise_multiplier=sigma_g, sample_rate=q, num_steps=steps)
    assert under.epsilon(DELTA) < 0.8 * eps  # recording σ_g would claim more privacy than there is
