"""The NumPy reference of one user-level DP-FedAvg round (adaclip_flower.aggregation)."""

import numpy as np
import pytest
from scipy import stats

from adaclip import AdaptiveClipping, FlatClipping, PerLayerClipping, QuantileClipping, reference
from adaclip import estimators as est
from adaclip.errors import InvalidHyperparameterError

pytest.importorskip("flwr")  # before adaclip_flower, which imports it

from adaclip_flower import aggregation as agg  # noqa: E402
from adaclip_flower.aggregation import UserLevelMechanism  # noqa: E402

SHAPES = [(3, 2), (4,)]


def _updates(rng, n, scale=1.0):
    return [[scale * rng.standard_normal(s) for s in SHAPES] for _ in range(n)]


def _like():
    return [np.zeros(s) for s in SHAPES]


def _flat(u):
    return np.concatenate([np.ravel(t) for t in u])


def _mech(clipping=None, **kw):
    kw.setdefault("noise_multiplier", 1.0)
    kw.setdefault("sample_rate", 0.1)
    kw.setdefault("num_users", 50)
    return UserLevelMechanism(clipping=clipping or FlatClipping(max_grad_norm=1.0), **kw)


def test_flat_fixed_denominator_matches_the_estimators_module():
    rng = np.random.default_rng(0)
    ups = _updates(rng, 6, 3.0)
    m = _mech(noise_multiplier=0.0, weight_cap=10.0, total_weight=30.0)
    counts = [3, 25, 10, 0, 7, 12]
    w = m.user_weights(counts, 6)
    np.testing.assert_allclose(w, est.capped_user_weights(counts, weight_cap=10.0))
    out, _ = agg.aggregate_updates(m, m.clipping.init(_like()), agg.stack_updates(ups, _like()), weights=w, noise=None)
    clipped = [_flat(u) * min(1.0, 1.0 / np.linalg.norm(_flat(u))) for u in ups]
    expected = est.fixed_denominator_estimate(sum(wk * c for wk, c in zip(w, clipped)), sample_rate=0.1, total_weight=30.0)
    np.testing.assert_allclose(_flat(out), expected, rtol=1e-12)


def test_clipped_denominator_matches_the_estimators_module_and_carries_its_noise():
    rng = np.random.default_rng(1)
    ups = _updates(rng, 4, 3.0)
    m = _mech(noise_multiplier=0.7, estimator="clipped", weight_cap=5.0, total_weight=30.0, min_total_weight=20.0)
    w = m.user_weights([5, 5, 2, 9], 4)
    noise = agg.standard_normal_like(_like(), np.random.default_rng(2))
    out, _ = agg.aggregate_updates(m, m.clipping.init(_like()), agg.stack_updates(ups, _like()), weights=w, noise=noise)
    clipped = [_flat(u) * min(1.0, 1.0 / np.linalg.norm(_flat(u))) for u in ups]
    mean = est.clipped_denominator_estimate(
        sum(wk * c for wk, c in zip(w, clipped)), float(np.sum(w)), sample_rate=0.1, min_total_weight=20.0
    )
    std = 0.7 * est.clipped_denominator_sensitivity(clip_norm=1.0, sample_rate=0.1, min_total_weight=20.0)
    np.testing.assert_allclose(_flat(out), mean + std * _flat(noise), rtol=1e-12)


@pytest.mark.parametrize("sigma", [0.0, 0.8])
def test_adaclip_rounds_equal_the_numpy_reference(sigma):
    """Several rounds of AdaCliP aggregation = adaclip.reference.adaclip_step on the same
    (flattened) updates and injected noise, state included."""
    rng = np.random.default_rng(3)
    strat = AdaptiveClipping(std_min=1e-3, std_max=2.0, beta_mean=0.9, beta_std=0.9)
    m = _mech(strat, noise_multiplier=sigma, sample_rate=0.2, num_users=20)
    state = strat.init(_like())
    d = sum(int(np.prod(s)) for s in SHAPES)
    ref_m, ref_s = np.zeros(d), np.full(d, strat.std_init)
    for _ in range(4):
        ups = _updates(rng, 5, 0.5)
        noise = agg.standard_normal_like(_like(), rng)
        out, state = agg.aggregate_updates(m, state, agg.stack_updates(ups, _like()), noise=noise if sigma else None)
        g_ref, ref_m, ref_s = reference.adaclip_step(
            np.stack([_flat(u) for u in ups]), ref_m, ref_s, _flat(noise), noise_multiplier=sigma,
            expected_batch_size=4.0, beta_mean=0.9, beta_std=0.9, std_min=1e-3, std_max=2.0,
        )
        np.testing.assert_allclose(_flat(out), g_ref, rtol=1e-12, atol=1e-13)
        np.testing.assert_allclose(_flat(state.mean), ref_m, rtol=1e-12, atol=1e-13)
        np.testing.assert_allclose(_flat(state.std), ref_s, rtol=1e-12, atol=1e-13)


def test_invalid_updates_contribute_exactly_nothing():
    rng = np.random.default_rng(4)
    ups = _updates(rng, 4, 2.0)
    bad = [[np.full((3, 2), np.nan), np.zeros(4)], [np.zeros((2, 2)), np.zeros(4)], None, [np.zeros((3, 2))], ["x", "y"]]
    m = _mech(noise_multiplier=1.3, estimator="clipped", min_total_weight=10.0)
    noise = agg.standard_normal_like(_like(), np.random.default_rng(5))
    state = m.clipping.init(_like())
    good, _ = agg.aggregate_updates(m, state, agg.stack_updates(ups, _like()), noise=noise)
    stacked = agg.stack_updates(bad[:2] + ups + bad[2:], _like())
    assert stacked.valid.tolist() == [False, False, True, True, True, True, False, False, False]
    mixed, _ = agg.aggregate_updates(m, state, stacked, noise=noise)
    for a, b in zip(good, mixed):
        np.testing.assert_array_equal(a, b)


def test_weights_out_of_range_and_missing_noise_are_refused():
    m = _mech()
    stacked = agg.stack_updates(_updates(np.random.default_rng(0), 2), _like())
    state = m.clipping.init(_like())
    with pytest.raises(InvalidHyperparameterError):
        agg.aggregate_updates(m, state, stacked, weights=np.array([0.5, 1.5]), noise=None)
    with pytest.raises(InvalidHyperparameterError, match="noise is required"):
        agg.aggregate_updates(m, state, stacked, noise=None)


def test_the_mechanism_releases_the_core_estimators():
    # one implementation of the estimators: the user-level mechanism's denominator and noise
    # factor are adaclip.estimators' (D, κ), its weights the core's capped weights
    for kw in ({}, {"estimator": "clipped", "total_weight": 30.0, "min_total_weight": 20.0}):
        m = _mech(noise_multiplier=0.7, weight_cap=5.0, **kw)
        release = est.estimator_release(m.estimator, sample_rate=m.sample_rate, total_weight=m.total_weight,
                                        min_total_weight=m.min_total_weight)  # fmt: skip
        assert (m.expected_batch_size, m.release_noise_multiplier) == (release.denominator, release.sensitivity_factor * 0.7)
    assert agg.ESTIMATORS is est.ESTIMATORS


def test_user_weights_drop_invalid_counts():
    m = _mech(weight_cap=4.0)
    np.testing.assert_array_equal(m.user_weights([2, 8, -1, float("nan"), None, "a", True], 7), [0.5, 1, 0, 0, 0, 0, 0])


@pytest.mark.parametrize(
    "kwargs",
    [
        {"noise_multiplier": -1.0},
        {"noise_multiplier": float("nan")},
        {"sample_rate": 0.0},
        {"sample_rate": 1.5},
        {"num_users": 0},
        {"num_users": 2.5},
        {"estimator": "median"},
        {"weight_cap": 0.0},
        {"total_weight": -3.0},
        {"min_total_weight": 100.0},
        {"clipping": "flat"},
    ],
)
def test_bad_hyperparameters_are_refused(kwargs):
    base = {"clipping": FlatClipping(max_grad_norm=1.0), "noise_multiplier": 1.0, "sample_rate": 0.1, "num_users": 50}
    base.update(kwargs)
    with pytest.raises(InvalidHyperparameterError):
        UserLevelMechanism(**base)


def test_quantile_rule_needs_unit_weights_and_the_fixed_denominator():
    with pytest.raises(InvalidHyperparameterError, match="auxiliary"):
        _mech(QuantileClipping(max_grad_norm=1.0), weight_cap=3.0)
    _mech(QuantileClipping(max_grad_norm=1.0))  # unit weights, fixed: fine


def test_server_noise_is_gaussian_with_the_accounted_std_ks():
    """σ=1.1 around the noiseless release: KS against N(0, (σ·S/(qU))²); σ/2 is detected."""
    rng = np.random.default_rng(6)
    ups = _updates(rng, 3, 2.0)
    m = _mech(FlatClipping(max_grad_norm=0.5), noise_multiplier=1.1, sample_rate=0.1, num_users=40)
    m0 = _mech(FlatClipping(max_grad_norm=0.5), noise_multiplier=0.0, sample_rate=0.1, num_users=40)
    stacked = agg.stack_updates(ups, _like())
    state = m.clipping.init(_like())
    clean = _flat(agg.aggregate_updates(m0, state, stacked, noise=None)[0])
    gen = agg.noise_generator(7)
    draws = np.concatenate([
        _flat(agg.aggregate_updates(m, state, stacked, noise=agg.standard_normal_like(_like(), gen))[0]) - clean
        for _ in range(300)
    ])
    std = 1.1 * 0.5 / 4.0
    assert stats.kstest(draws / std, "norm").pvalue > 1e-3
    assert stats.kstest(draws / (std / 2), "norm").pvalue < 1e-6


def test_client_shares_and_make_up_sum_to_sigma_squared_ks():
    """n clients add N(0, σ²/n); with m of n received the server adds σ²(n−m)/n: the total is
    N(0, σ²). Without the make-up, the total is detectably too small (negative control)."""
    sigma, n, m_recv = 1.3, 7, 4
    rng = np.random.default_rng(8)
    centre, scale, groups = None, [1.0, 1.0], [([0, 1], 1.0)]
    totals, short = [], []
    zero = [np.zeros(s) for s in SHAPES]
    for _ in range(400):
        shares = [agg.clip_and_noise_update(zero, centre, scale, groups, noise_std=agg.client_noise_std(sigma, n), rng=rng)
                  for _ in range(m_recv)]
        s = _flat([sum(x[j] for x in shares) for j in range(2)])
        extra = agg.missing_share_noise_multiplier(sigma, n, m_recv) * rng.standard_normal(s.shape)
        totals.append(s + extra)
        short.append(s)
    assert stats.kstest(np.concatenate(totals) / sigma, "norm").pvalue > 1e-3
    assert stats.kstest(np.concatenate(short) / sigma, "norm").pvalue < 1e-6
    assert agg.missing_share_noise_multiplier(sigma, 0, 0) == sigma
    assert agg.missing_share_noise_multiplier(sigma, n, n) == 0.0


def test_client_contribution_equals_the_server_side_clip():
    """A client's contribution with σ=0 is its server-side clipped, weighted row, for
    per-layer groups and for AdaCliP's centred, scaled transform."""
    rng = np.random.default_rng(9)
    for strat in (PerLayerClipping(max_grad_norm=1.0), AdaptiveClipping(std_min=0.01, std_max=1.0)):
        state = strat.init(_like())
        state = strat.update(state, [0.3 * np.ones(s) for s in SHAPES], strat.transform(state, 2)[1],
                             noise_multiplier=1.0, expected_batch_size=5.0) if isinstance(strat, AdaptiveClipping) else state
        centre, scale = strat.transform(state, 2)
        ups = _updates(rng, 3, 2.0)
        m = _mech(strat, noise_multiplier=0.0, sample_rate=0.5, num_users=2)
        server, _ = agg.aggregate_updates(m, state, agg.stack_updates(ups, _like()), weights=np.array([1.0, 0.5, 0.25]), noise=None)
        shares = [agg.clip_and_noise_update(u, centre, scale, strat.clip_groups(2), weight=w, noise_std=0.0, rng=rng)
                  for u, w in zip(ups, [1.0, 0.5, 0.25])]
        summed = [sum(s[j] for s in shares) for j in range(2)]
        client, _ = agg.release_client_sums(m, state, summed, make_up_noise=None, make_up_multiplier=0.0)
        for a, b in zip(server, client):
            np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-15)


def test_nonfinite_client_update_sends_only_its_noise_share():
    rng = np.random.default_rng(10)
    out = agg.clip_and_noise_update([np.full((3, 2), np.inf), np.zeros(4)], None, [1.0, 1.0], [([0, 1], 1.0)],
                                    noise_std=0.0, rng=rng)
    assert all(np.all(o == 0) for o in out)


def test_unit_weights_keep_each_contribution_within_the_clip_radius():
    """The core's weighted clipped sum: one user's removal moves it by at most 1."""
    from adaclip.strategies import clip_and_sum

    rng = np.random.default_rng(11)
    strat = FlatClipping(max_grad_norm=1.0)
    g = [rng.standard_normal((5,) + s) * 10 for s in SHAPES]
    w = np.array([1.0, 0.3, 0.0, 0.9, 0.5])
    full = _flat(clip_and_sum(strat, strat.init(_like()), g, unit_weights=w))
    for k in range(5):
        mask = np.ones(5, bool)
        mask[k] = False
        without = _flat(clip_and_sum(strat, strat.init(_like()), g, unit_mask=mask, unit_weights=w))
        assert np.linalg.norm(full - without) <= w[k] * (1 + 1e-12)
