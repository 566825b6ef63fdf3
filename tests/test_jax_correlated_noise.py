"""Banded correlated noise in adaclip_jax, checked against the core's NumPy maths.

The release of zero per-unit gradients with flat clipping at ``C = 1`` is ``σ·x_t/B̄``. With one
band it is ``σ·z_t/B̄``, so a one-band run with the same key gives the step's standard normals
``z_t`` exactly (σ and B̄ are powers of two); :class:`adaclip.correlated.BandedNoise` applied to
them in NumPy is the reference for ``x_t`` (the same reference the PyTorch plugin's tests use).
Also: one band is today's transformation bit for bit, the buffers under ``jit``, AdaCliP's
statistics, the tracker's accounting, the refusals and the cyclic Poisson masks.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import adaclip_jax
from adaclip import strategies
from adaclip.accounting import Accountant
from adaclip.correlated import BandedNoise
from adaclip.correlated.coefficients import sqrt_toeplitz_coefficients
from adaclip.errors import BudgetExceededError, InvalidGradientError, InvalidHyperparameterError
from adaclip_jax import _transform

pytestmark = pytest.mark.jax

SIGMA, BATCH = 2.0, 4.0  # powers of two: out·B̄/σ is exact
RULE = strategies.QuantileRule(target_quantile=0.6, learning_rate=0.3, count_noise_multiplier=2.0)


def _params():
    return {"b": jnp.zeros((3,)), "w": jnp.zeros((4, 3))}


def _zeros(n=5):
    return jax.tree_util.tree_map(lambda p: jnp.zeros((n, *p.shape)), _params())


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]


def _run(tx, steps, grads=None, **update_kw):
    """``steps`` jitted updates from ``tx.init``: the releases (leaf lists) and the states."""
    state = tx.init(_params())
    update = jax.jit(lambda g, s: tx.update(g, s, **update_kw))
    grads = _zeros() if grads is None else grads
    outs, states = [], [state]
    for _ in range(steps):
        out, state = update(grads, state)
        outs.append(_leaves(out))
        states.append(state)
    return outs, states


def _flat(noise_mechanism="independent", bands=None, sigma=SIGMA, **kw):
    return adaclip_jax.flat_clip(max_grad_norm=1.0, noise_multiplier=sigma, expected_batch_size=BATCH,
                                 key=jax.random.key(3), noise_mechanism=noise_mechanism, bands=bands, **kw)


@functools.lru_cache(maxsize=1)
def _one_band_releases():
    return _run(_flat(), 9)[0]


def _standard_normals(steps):
    """z_t of each step, read off a one-band (DP-SGD) run with the same key."""
    assert steps <= 9
    return [[x * BATCH / SIGMA for x in out] for out in _one_band_releases()[:steps]]


def _reference(coefficients, zs):
    mech = BandedNoise(coefficients)
    state, xs = mech.init(), []
    for z in zs:
        x, state = mech.correlate(state, z)
        xs.append(x)
    return xs


# ----------------------------------------------------------------------------- the noise


@pytest.mark.parametrize("bands", [2, 4])
def test_the_release_is_the_reference_banded_noise_on_the_same_draws(bands):
    steps = 9
    zs = _standard_normals(steps)
    outs, states = _run(_flat("banded", bands), steps)
    xs = _reference(sqrt_toeplitz_coefficients(bands), zs)
    for t in range(steps):
        for got, want in zip(outs[t], xs[t], strict=True):
            np.testing.assert_allclose(got * BATCH / SIGMA, want, rtol=2e-6, atol=2e-6)
    # negative control: after the first step the banded noise is not the independent one
    assert not np.allclose(outs[3][1] * BATCH / SIGMA, zs[3][1], atol=1e-3)
    np.testing.assert_allclose(outs[0][1] * BATCH / SIGMA, zs[0][1] / sqrt_toeplitz_coefficients(bands)[0], rtol=3e-7)
    # the buffers are the last b − 1 noise vectors, most recent first (leaf order)
    last = states[-1].noise_buffers
    assert len(last) == bands - 1
    for j, buf in enumerate(last):
        for got, want in zip(buf, xs[steps - 1 - j], strict=True):
            np.testing.assert_allclose(np.asarray(got), want, rtol=2e-6, atol=2e-6)


def test_a_given_banded_noise_uses_its_coefficients():
    c = np.array([0.8, -0.1, 0.5, 0.3])
    c = c / np.linalg.norm(c)
    zs = _standard_normals(6)
    outs, _ = _run(_flat(BandedNoise(c), bands=4), 6)
    for out, x in zip(outs, _reference(c, zs), strict=True):
        for got, want in zip(out, x, strict=True):
            np.testing.assert_allclose(got * BATCH / SIGMA, want, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("make", ["flat", "adaclip", "quantile"])
def test_one_band_is_independent_noise_bit_for_bit(make):
    rng = np.random.default_rng(0)
    grads = jax.tree_util.tree_map(lambda p: jnp.asarray(rng.standard_normal((6, *p.shape)), jnp.float32), _params())

    def build(**kw):
        if make == "flat":
            return _flat(sigma=1.1, **kw)
        if make == "adaclip":
            return adaclip_jax.adaclip(noise_multiplier=1.1, expected_batch_size=3.0, key=jax.random.key(5), **kw)
        return adaclip_jax.quantile_clip(noise_multiplier=1.1, expected_batch_size=3.0, key=jax.random.key(5),
                                         quantile=RULE, **kw)

    variants = [{}, {"noise_mechanism": "banded", "bands": 1}]
    if make == "flat":
        variants.append({"noise_mechanism": BandedNoise([1.0])})
    runs = [_run(build(**kw), 4, grads) for kw in variants]
    for outs, states in runs[1:]:
        assert states[-1].noise_buffers is None
        for a, b in zip(runs[0][0], outs, strict=True):
            for x, y in zip(a, b, strict=True):
                np.testing.assert_array_equal(x, y)
        for sa, sb in zip(runs[0][1], states, strict=True):
            assert jax.tree_util.tree_structure(sa) == jax.tree_util.tree_structure(sb)
            for x, y in zip(jax.tree_util.tree_leaves(sa), jax.tree_util.tree_leaves(sb), strict=True):
                if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
                    x, y = jax.random.key_data(x), jax.random.key_data(y)
                np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_the_auxiliary_count_keeps_independent_noise():
    """Quantile rule: the gradient's noise is banded, the count's draw is the independent one,
    so with zero gradients the clip norm follows the same path as with one band."""
    def run(**kw):
        tx = adaclip_jax.quantile_clip(noise_multiplier=1.0, expected_batch_size=BATCH, key=jax.random.key(2),
                                       quantile=RULE, **kw)
        return _run(tx, 6)

    outs_1, states_1 = run()
    outs_4, states_4 = run(noise_mechanism="banded", bands=4)
    norms_1 = [float(s.extra["clip_norm"]) for s in states_1]
    norms_4 = [float(s.extra["clip_norm"]) for s in states_4]
    assert norms_1 == norms_4 and len(set(norms_1)) > 2
    assert not np.allclose(outs_1[3][1], outs_4[3][1])


def test_jit_carries_the_buffers_with_fixed_shapes_and_traces_once():
    tx = _flat("banded", 4)
    traces = []

    @jax.jit
    def step(g, s):
        traces.append(1)
        return tx.update(g, s)

    state = tx.init(_params())
    assert [[x.shape for x in buf] for buf in state.noise_buffers] == [[(3,), (4, 3)]] * 3
    assert all(not np.any(np.asarray(x)) for buf in state.noise_buffers for x in buf)
    for _ in range(6):
        _, state = step(_zeros(), state)
    assert len(traces) == 1 and int(state.step) == 6
    # the scan of the same steps gives the same buffers
    state0 = tx.init(_params())
    final, _ = jax.lax.scan(lambda s, _: (tx.update(_zeros(), s)[1], None), state0, None, length=6)
    for a, b in zip(jax.tree_util.tree_leaves(state.noise_buffers), jax.tree_util.tree_leaves(final.noise_buffers),
                    strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


def test_the_variance_table_is_the_exact_variance_and_settles():
    for bands in (2, 16, 64):
        mech = BandedNoise(sqrt_toeplitz_coefficients(bands))
        table = _transform._variance_table(mech)
        assert table.size == 1024
        np.testing.assert_allclose(table[:50], [mech.variance(t) for t in range(50)], rtol=1e-12)
        for t in (table.size, 4 * table.size, 20_000):  # held at its last entry beyond the table
            assert abs(mech.variance(t) - table[-1]) < 1e-6
        assert table[-1] > table[0] >= 1.0
    # coefficients whose noise grows without bound are refused
    with pytest.raises(InvalidHyperparameterError, match="without bound"):
        _flat(BandedNoise(np.array([0.3, 1.0]) / np.linalg.norm([0.3, 1.0])))


# ----------------------------------------------------------------------------- AdaCliP


def test_adaclip_statistics_subtract_sigma_squared_v_t():
    """The JAX step equals the core's release with the banded x_t and noise_variance = v_t; with
    noise_variance = 1 (the negative control) the statistics differ."""
    bands, steps = 4, 4
    zs = _standard_normals(steps)
    xs = _reference(sqrt_toeplitz_coefficients(bands), zs)
    mech = BandedNoise(sqrt_toeplitz_coefficients(bands))
    rng = np.random.default_rng(1)
    grads = jax.tree_util.tree_map(lambda p: jnp.asarray(rng.standard_normal((5, *p.shape)), jnp.float32), _params())
    tx = adaclip_jax.adaclip(noise_multiplier=SIGMA, expected_batch_size=BATCH, key=jax.random.key(3),
                             noise_mechanism="banded", bands=bands)
    outs, states = _run(tx, steps, grads)
    strategy = tx.strategy
    g_leaves = [jnp.asarray(x) for x in jax.tree_util.tree_leaves(grads)]
    for t in (0, steps - 1):
        s = states[t]
        core = strategies.ClipState(step=s.step, mean=jax.tree_util.tree_leaves(s.mean),
                                    std=jax.tree_util.tree_leaves(s.std), extra=s.extra)
        summed = strategies.clip_and_sum(strategy, core, g_leaves)
        noise = [jnp.asarray(x) for x in xs[t]]
        noisy, new = strategies.release(strategy, core, summed, noise, noise_multiplier=SIGMA,
                                        expected_batch_size=BATCH, noise_variance=mech.variance(t))
        for got, want in zip(outs[t], noisy, strict=True):
            np.testing.assert_allclose(got, np.asarray(want), rtol=1e-5, atol=1e-6)
        for got, want in zip(jax.tree_util.tree_leaves(states[t + 1].std), new.std, strict=True):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-7)
        _, plain = strategies.release(strategy, core, summed, noise, noise_multiplier=SIGMA, expected_batch_size=BATCH)
        assert any(not np.allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
                   for a, b in zip(jax.tree_util.tree_leaves(states[t + 1].std), plain.std, strict=True))


def test_release_takes_an_array_noise_variance_and_keeps_the_float_path():
    strat = strategies.adaptive_clipping(6)
    state = strat.init([jnp.zeros((3, 2))])
    summed, noise = [jnp.ones((3, 2))], [jnp.full((3, 2), 0.5)]
    kw = dict(noise_multiplier=1.0, expected_batch_size=4.0)
    _, as_float = strategies.release(strat, state, summed, noise, noise_variance=4.0, **kw)
    _, as_array = strategies.release(strat, state, summed, noise, noise_variance=jnp.asarray(4.0), **kw)
    _, traced = jax.jit(lambda v: strategies.release(strat, state, summed, noise, noise_variance=v, **kw))(4.0)
    for a, b, c in zip(as_float.std, as_array.std, traced.std, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-7)
        np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=1e-7)


@pytest.mark.slow
def test_every_constructor_runs_with_banded_noise():
    rng = np.random.default_rng(2)
    grads = jax.tree_util.tree_map(lambda p: jnp.asarray(rng.standard_normal((6, *p.shape)), jnp.float32), _params())
    common = dict(noise_multiplier=1.0, expected_batch_size=3.0, key=jax.random.key(0), noise_mechanism="banded",
                  bands=3)
    for tx in (
        adaclip_jax.adaclip(**common),
        adaclip_jax.adaclip(**common, preset="patent", use_kernel="auto"),
        adaclip_jax.per_layer_clip(max_grad_norm=1.0, **common),
        adaclip_jax.scaled_clip(max_grad_norm=1.0, layer_scales=(1.0, 0.5), **common),
        adaclip_jax.automatic_clip(**common),
        adaclip_jax.scale_then_privatize(max_grad_norm=1.0, **common),
        adaclip_jax.private_aggregate(strategies.FlatClipping(1.0), **common),
    ):
        outs, states = _run(tx, 4, grads)
        assert len(states[-1].noise_buffers) == 2
        assert all(np.all(np.isfinite(x)) for out in outs for x in out)


# ----------------------------------------------------------------------------- refusals


def test_refusals_before_anything_is_built():
    base = dict(max_grad_norm=1.0, expected_batch_size=4.0, key=0)
    cases = [
        (dict(noise_multiplier=lambda t: 1.0, noise_mechanism="banded", bands=2), "noise schedule"),
        (dict(noise_multiplier=1.0, noise_mechanism="banded"), "needs bands"),
        (dict(noise_multiplier=1.0, bands=4), "needs noise_mechanism='banded'"),
        (dict(noise_multiplier=1.0, noise_mechanism="bandmf", bands=4), "noise_mechanism must be"),
        (dict(noise_multiplier=1.0, noise_mechanism=BandedNoise(sqrt_toeplitz_coefficients(3)), bands=4), "disagrees"),
        (dict(noise_multiplier=1.0, noise_mechanism="banded", bands=0), "bands"),
    ]
    for kw, words in cases:
        with pytest.raises(InvalidHyperparameterError, match=words):
            adaclip_jax.flat_clip(**base, **kw)
    with pytest.raises(InvalidHyperparameterError, match="use_kernel=True"):
        adaclip_jax.adaclip(noise_multiplier=1.0, expected_batch_size=4.0, key=0, preset="patent", use_kernel=True,
                            noise_mechanism="banded", bands=2)
    with pytest.raises(InvalidHyperparameterError, match="unit norm"):
        BandedNoise([1.0, 0.5])


def test_one_sigma_per_run_a_static_other_sigma_raises_a_traced_one_releases_nan():
    tx = _flat("banded", 2)
    state = tx.init(_params())
    with pytest.raises(InvalidHyperparameterError, match="one σ"):
        tx.update(_zeros(), state, noise_multiplier=1.0)
    out, new = tx.update(_zeros(), state, noise_multiplier=jnp.float32(SIGMA))  # the same σ: fine
    assert all(np.all(np.isfinite(x)) for x in _leaves(out))
    step = jax.jit(lambda g, s, sigma: tx.update(g, s, noise_multiplier=sigma))
    out, new = step(_zeros(), state, jnp.float32(1.0))
    assert all(np.all(np.isnan(x)) for x in _leaves(out)) and int(new.nonfinite_steps) == 1
    out, new = step(_zeros(), state, np.nextafter(np.float32(SIGMA), np.float32(3)))  # the tracker's rounding
    assert all(np.all(np.isfinite(x)) for x in _leaves(out))


def test_a_state_without_or_with_foreign_buffers_is_refused():
    banded, plain = _flat("banded", 3), _flat()
    with pytest.raises(InvalidGradientError, match="no noise buffers"):
        banded.update(_zeros(), plain.init(_params()))
    with pytest.raises(InvalidGradientError, match="carries banded-noise buffers"):
        plain.update(_zeros(), banded.init(_params()))
    with pytest.raises(InvalidGradientError, match="do not match"):
        _flat("banded", 4).update(_zeros(), banded.init(_params()))


# ----------------------------------------------------------------------------- accounting


def _used(sigma, bands):
    """The AdaClipState an update with ``sigma`` and ``bands`` returns."""
    buffers = None if bands == 1 else tuple([jnp.zeros(3)] for _ in range(bands - 1))
    return adaclip_jax.AdaClipState(step=jnp.ones([], jnp.int32), key=jax.random.key(0), mean=None, std=None,
                                    nonfinite_steps=jnp.zeros([], jnp.int32),
                                    last_noise_multiplier=jnp.asarray(sigma, jnp.float32),
                                    seeded=jnp.asarray(False), noise_buffers=buffers)


def test_the_tracker_records_one_composition_per_cycle_at_rate_bq():
    acc = Accountant("rdp")
    tracker = adaclip_jax.PrivacyTracker(acc, sample_rate=0.1, noise_multiplier=1.0, bands=4)
    assert tracker.accounted_sample_rate == pytest.approx(0.4)
    for _ in range(9):
        tracker.step(lambda *, noise_multiplier: _used(noise_multiplier, 4))
    assert tracker.steps == 9
    assert acc.history == ((0.4, 1.0, 3),)  # ⌈9/4⌉ at p = b·q
    # one band: every step at q
    acc1 = Accountant("rdp")
    one = adaclip_jax.PrivacyTracker(acc1, sample_rate=0.1, noise_multiplier=1.0, bands=1)
    for _ in range(3):
        one.step(lambda *, noise_multiplier: _used(noise_multiplier, 1))
    assert acc1.history == ((0.1, 1.0, 3),)


def test_the_tracker_with_a_jitted_banded_step():
    acc = Accountant("rdp")
    tx = _flat("banded", 2, sigma=1.0)
    tracker = adaclip_jax.PrivacyTracker(acc, sample_rate=0.25, noise_multiplier=1.0, bands=2)
    groups = adaclip_jax.assign_groups(jax.random.key(9), 5, 2)
    step = jax.jit(lambda g, s, m, *, noise_multiplier: tx.update(g, s, unit_mask=m, noise_multiplier=noise_multiplier))
    state = tx.init(_params())
    for _ in range(5):
        mask = adaclip_jax.cyclic_poisson_mask(jax.random.key(8), state.step, groups,
                                               tracker.accounted_sample_rate, bands=2)
        _, state = tracker.step(step, _zeros(), state, mask)
    assert acc.history == ((0.5, 1.0, 3),) and int(state.step) == 5


def test_the_tracker_refuses_bq_above_one_schedules_and_mismatched_bands():
    with pytest.raises(InvalidHyperparameterError, match="at most 3 bands"):
        adaclip_jax.PrivacyTracker(Accountant("rdp"), sample_rate=0.3, noise_multiplier=1.0, bands=4)
    with pytest.raises(InvalidHyperparameterError, match="one σ"):
        adaclip_jax.PrivacyTracker(Accountant("rdp"), sample_rate=0.1, noise_multiplier=lambda t: 1.0, bands=2)
    with pytest.raises(InvalidHyperparameterError, match="bands"):
        adaclip_jax.PrivacyTracker(Accountant("rdp"), sample_rate=0.1, noise_multiplier=1.0, bands=0)
    acc = Accountant("rdp")
    tracker = adaclip_jax.PrivacyTracker(acc, sample_rate=0.1, noise_multiplier=1.0, bands=4)
    ran = []

    def fn(state, *, noise_multiplier):
        ran.append(1)
        return _used(noise_multiplier, 1)

    with pytest.raises(InvalidHyperparameterError, match="1 band"):
        tracker.step(fn, _used(1.0, 1))  # an independent-noise state in the input: nothing runs
    assert not ran and acc.history == () and tracker.steps == 0
    with pytest.raises(InvalidHyperparameterError, match="1 band"):
        tracker.step(lambda *, noise_multiplier: _used(noise_multiplier, 1))  # only the result tells
    assert acc.history == ((0.4, 1.0, 1),) and tracker.steps == 1
    plain = adaclip_jax.PrivacyTracker(Accountant("rdp"), sample_rate=0.1, noise_multiplier=1.0)
    with pytest.raises(InvalidHyperparameterError, match="4 band"):
        plain.step(lambda *, noise_multiplier: _used(noise_multiplier, 4))
    assert plain.accountant.history == ((0.4, 1.0, 1),)  # recorded at the larger b's rate


def test_the_budget_is_checked_at_cycle_starts_only():
    one = Accountant("rdp")
    one.step(noise_multiplier=1.0, sample_rate=0.4, num_steps=2)
    acc = Accountant("rdp", target_epsilon=one.epsilon(1e-5) * 1.0001, delta=1e-5)  # two compositions
    tracker = adaclip_jax.PrivacyTracker(acc, sample_rate=0.1, noise_multiplier=1.0, bands=4)
    for _ in range(8):
        tracker.step(lambda *, noise_multiplier: _used(noise_multiplier, 4))
    with pytest.raises(BudgetExceededError):
        tracker.step(lambda *, noise_multiplier: _used(noise_multiplier, 4))
    assert tracker.steps == 8 and acc.history == ((0.4, 1.0, 2),)


def test_a_restored_tracker_opens_a_cycle_at_once():
    acc = Accountant("rdp")
    tracker = adaclip_jax.PrivacyTracker(acc, sample_rate=0.1, noise_multiplier=1.0, bands=4)
    for _ in range(6):
        tracker.step(lambda *, noise_multiplier: _used(noise_multiplier, 4))
    saved = tracker.state_dict()
    assert saved["bands"] == 4 and acc.history == ((0.4, 1.0, 2),)
    acc2 = Accountant("rdp")
    restored = adaclip_jax.PrivacyTracker(acc2, sample_rate=0.1, noise_multiplier=1.0, bands=4)
    restored.load_state_dict(saved)
    restored.step(lambda *, noise_multiplier: _used(noise_multiplier, 4))  # step 6: a new cycle
    assert acc2.history == ((0.4, 1.0, 3),)
    for _ in range(3):  # steps 7, 8, 9 are in it; step 10 opens the next
        restored.step(lambda *, noise_multiplier: _used(noise_multiplier, 4))
    assert acc2.history == ((0.4, 1.0, 3),)
    restored.step(lambda *, noise_multiplier: _used(noise_multiplier, 4))
    assert acc2.history == ((0.4, 1.0, 4),)
    # a start_step that is not a multiple of b records its first step too
    acc3 = Accountant("rdp")
    late = adaclip_jax.PrivacyTracker(acc3, sample_rate=0.1, noise_multiplier=1.0, bands=4, start_step=5)
    late.step(lambda *, noise_multiplier: _used(noise_multiplier, 4))
    assert acc3.history == ((0.4, 1.0, 1),)
    with pytest.raises(InvalidHyperparameterError, match="band"):
        adaclip_jax.PrivacyTracker(Accountant("rdp"), sample_rate=0.1, noise_multiplier=1.0).load_state_dict(saved)


def test_a_failing_step_inside_a_cycle_is_recorded_conservatively():
    acc = Accountant("rdp")
    tracker = adaclip_jax.PrivacyTracker(acc, sample_rate=0.1, noise_multiplier=1.0, bands=4)
    tracker.step(lambda *, noise_multiplier: _used(noise_multiplier, 4))

    def fails(*, noise_multiplier):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        tracker.step(fails)
    assert acc.history == ((0.4, 1.0, 2),) and tracker.steps == 2


# ----------------------------------------------------------------------------- sampling


def test_cyclic_poisson_masks():
    n, q, bands, steps = 2000, 0.05, 4, 40
    groups = adaclip_jax.assign_groups(jax.random.key(0), n, bands)
    assert groups.shape == (n,) and groups.dtype == jnp.int32
    assert np.bincount(np.asarray(groups), minlength=bands).min() > 400  # independent uniform
    key = jax.random.key(1)
    masks = np.stack([np.asarray(jax.jit(adaclip_jax.cyclic_poisson_mask, static_argnames="bands")(
        key, t, groups, bands * q, bands=bands)) for t in range(steps)])
    g = np.asarray(groups)
    for t in range(steps):
        assert not np.any(masks[t] & (g != t % bands))  # only the step's group
    for t in range(steps - bands + 1):
        assert masks[t:t + bands].sum(axis=0).max() <= 1  # at most once in any b consecutive steps
    in_group = np.array([masks[t][g == t % bands].mean() for t in range(steps)])
    assert in_group.mean() == pytest.approx(bands * q, rel=0.1)  # rate p = b·q within the group
    assert masks.sum(axis=1).mean() == pytest.approx(q * n, rel=0.1)  # expected batch q·N
    assert len({masks[t].tobytes() for t in range(steps)}) == steps  # fresh draws every step
    # one band: plain Poisson sampling, fold_in(key, step)
    ones = adaclip_jax.assign_groups(jax.random.key(0), n, 1)
    for t in (0, 3):
        want = jax.random.uniform(jax.random.fold_in(key, t), (n,)) < q
        np.testing.assert_array_equal(np.asarray(adaclip_jax.cyclic_poisson_mask(key, t, ones, q, bands=1)),
                                      np.asarray(want))
    for bad in (0.0, 1.5, math.nan):
        with pytest.raises(InvalidHyperparameterError, match="group_rate"):
            adaclip_jax.cyclic_poisson_mask(key, 0, groups, bad, bands=bands)
    with pytest.raises(InvalidHyperparameterError, match="bands"):
        adaclip_jax.assign_groups(key, n, 0)


def test_a_fresh_banded_state_can_be_donated_to_a_jitted_update():
    """Every buffer of a fresh state is its own zero array: ``jax.jit(update, donate_argnums=1)``
    (the usual way to update state in place) used to fail with "donate the same buffer twice"."""
    tx = adaclip_jax.flat_clip(max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=4, key=0,
                               noise_mechanism="banded", bands=3)  # fmt: skip
    params = {"w": jnp.ones((3, 2))}
    state = tx.init(params)
    _, new = jax.jit(tx.update, donate_argnums=1)({"w": jnp.ones((4, 3, 2))}, state, params)
    assert [[b.shape for b in buf] for buf in new.noise_buffers] == [[(3, 2)], [(3, 2)]]
