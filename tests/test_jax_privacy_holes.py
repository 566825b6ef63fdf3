"""adaclip_jax privacy hygiene: what a release, a checkpoint or a bookkeeping path must not leak.

- a unit with a NaN/inf gradient (sampled or masked out) contributes exactly 0, on the ``jnp``
  path and on the fused Pallas path, whose clip factors come from an upper bound of the norm;
- secure mode folds fresh OS randomness into every step's noise (a restored state does not
  replay it), and ``refresh_key`` gives a restored seeded state a new key;
- ``PrivacyTracker`` records the σ the transformation used, not the σ it planned;
- ``unit_mask`` must be boolean;
- an invalid traced σ releases NaN instead of noise of the wrong scale;
- nothing reads the raw per-unit gradients before the private transformation: a member of
  ``optax.chain``/``optax.named_chain`` before it is refused at ``init`` and ``update``,
  ``private_chain`` builds the valid order, ``check_chain`` refuses wrappers around it;
- an argument of ``loss_fn`` outside ``batch_argnums`` that holds an array with the batch's
  leading size (labels left unbatched) is refused at trace time by every per-example entry
  point, unless declared ``shared_argnums``: otherwise every example reads all of it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import scipy.stats

import adaclip_jax
from adaclip import strategies
from adaclip.accounting import Accountant
from adaclip.errors import InvalidGradientError, InvalidHyperparameterError
from adaclip_jax import _kernel, _kernel_dispatch
from adaclip_jax import _transform as jax_transform

pytestmark = pytest.mark.jax


def _params(dtype=jnp.float32):
    return {"w": jnp.zeros((3, 40), dtype), "b": jnp.zeros((40,), dtype), "h": jnp.zeros((2, 5, 3), dtype)}


def _per_example(params, n, seed, scale=1.0):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda p: jnp.asarray(scale * rng.standard_normal((n,) + p.shape), p.dtype), params)


def _flat(tree):
    return np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree_util.tree_leaves(tree)])


def _poison(tree, row, value):
    """``tree`` with one entry of unit ``row`` set to ``value`` (in the leaf ``h``)."""
    return dict(tree, h=tree["h"].at[row, 1, 2].set(value))


# --------------------------------------------------------------------------- (1) non-finite units


@pytest.mark.parametrize("use_kernel", [False, True])
@pytest.mark.parametrize("bad_value", [np.nan, np.inf])
@pytest.mark.parametrize("masked", [False, True])
def test_nonfinite_unit_contributes_nothing(use_kernel, bad_value, masked):
    """A NaN/inf unit, sampled or masked out, gives the release (same key) and the statistics
    of the batch without it: finite, and nothing reveals that the unit was there."""
    with jax.enable_x64(True):
        params = _params(jnp.float64)
        tx = adaclip_jax.adaclip(noise_multiplier=0.8, expected_batch_size=4.0, key=3,
                                 std_min=1e-3, std_max=2.0, use_kernel=use_kernel, preset="patent")
        state = tx.init(params)
        _, state = jax.jit(tx.update)(_per_example(params, 4, 0, 0.5), state, params)  # m ≠ 0
        g = _poison(_per_example(params, 5, 1), 3, bad_value)
        mask = jnp.array([True, True, False, False, True]) if masked else None
        keep = np.array([0, 1, 4]) if masked else np.array([0, 1, 2, 4])
        step = jax.jit(lambda g, m: tx.update(g, state, params, unit_mask=m))
        got, got_state = step(g, mask)
        want, want_state = step(jax.tree.map(lambda x: x[keep], g), None)
        assert np.all(np.isfinite(_flat(got)))
        np.testing.assert_allclose(_flat(got), _flat(want), rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(_flat(got_state.std), _flat(want_state.std), rtol=1e-12)
        np.testing.assert_allclose(_flat(got_state.mean), _flat(want_state.mean), rtol=1e-12)
        assert int(got_state.nonfinite_steps) == 0


def test_release_kernel_skips_rows_with_factor_zero():
    """The fused release kernel (and its jnp reference) reads a row with clip factor 0 as zeros:
    a NaN/inf row contributes 0 instead of 0·NaN = NaN."""
    rng = np.random.default_rng(0)
    n, p = 11, 37
    g = jnp.asarray(rng.standard_normal((n, p)), jnp.float32)
    g = g.at[4, 3].set(jnp.nan).at[9, 0].set(jnp.inf)
    c = jnp.asarray(rng.uniform(0.2, 1.0, n), jnp.float32).at[4].set(0.0).at[9].set(0.0)
    a, b = jnp.zeros(p), jnp.asarray(rng.uniform(0.5, 2.0, p), jnp.float32)
    z, std = jnp.asarray(rng.standard_normal(p), jnp.float32), jnp.full((p,), 0.5, jnp.float32)
    kw = dict(noise_multiplier=1.0, expected_batch_size=5.0, beta_mean=0.9, beta_std=0.8, std_min=1e-3,
              std_max=2.0)
    keep = np.array([i for i in range(n) if i not in (4, 9)])
    clean = _kernel.clip_noise_update_reference(g[keep], c[keep], a, b, 1.0 / b, z, std, **kw)
    for got in (
        _kernel.clip_noise_update(g, c, a, b, 1.0 / b, z, std, interpret=True, block_cols=16, **kw),
        _kernel.clip_noise_update_reference(g, c, a, b, 1.0 / b, z, std, **kw),
    ):
        for x, y in zip(got, clean, strict=True):
            assert np.all(np.isfinite(np.asarray(x)))
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("block_cols", [8, _kernel.DEFAULT_BLOCK_COLS])
def test_fused_clip_factors_come_from_an_upper_bound_of_the_norm(block_cols):
    """In float32, c_i·‖w_i‖ ≤ 1 holds in exact (float64) arithmetic for every unit: rounding
    in the kernel's sums can only over-clip. Without the margin about half the units would be
    under-clipped by an ulp or so."""
    rng = np.random.default_rng(1)
    n, shapes = 256, [(3, 700), (1500,)]
    grads = [jnp.asarray(rng.standard_normal((n,) + s) * 5.0, jnp.float32) for s in shapes]
    centre = [jnp.asarray(rng.standard_normal(s) * 0.1, jnp.float32) for s in shapes]
    scale = [jnp.asarray(rng.uniform(0.5, 2.0, s), jnp.float32) for s in shapes]
    flat = [g.reshape(n, -1) for g in grads]
    inv = [1.0 / b for b in scale]
    strategy = strategies.AdaptiveClipping()

    def factors_with(block):
        sq = [
            _kernel.sq_norms(g, a.reshape(-1), u.reshape(-1), interpret=True, block_cols=block)
            * (1.0 + _kernel.sq_norms_margin(g.dtype, g.shape[1], block_cols=block))
            for g, a, u in zip(flat, centre, inv, strict=True)
        ]
        return strategies.group_clip_factors(strategy, sq)[0]

    factors = factors_with(block_cols)
    if block_cols == _kernel.DEFAULT_BLOCK_COLS:  # what the transformation uses
        fused = _kernel_dispatch._fused_clip_factors(strategy, flat, centre, inv, None, interpret=True)
        np.testing.assert_array_equal(np.asarray(fused), np.asarray(factors))
    exact = sum(
        np.sum(((np.asarray(g, np.float64) - np.asarray(a, np.float64)) / np.asarray(b, np.float64)) ** 2,
               axis=tuple(range(1, g.ndim)))
        for g, a, b in zip(grads, centre, scale, strict=True)
    )
    assert np.all(exact > 1.0)  # every unit is clipped
    clipped_norm = np.asarray(factors, np.float64) * np.sqrt(exact)
    assert np.all(clipped_norm <= 1.0)
    assert np.all(clipped_norm > 1.0 - 1e-4)  # over-clipping stays tiny


def test_sq_norms_margin_composes_the_tile_and_the_jnp_sums():
    from adaclip import transform as core

    u = 2.0**-24
    for p, block in [(1, 512), (37, 8), (4096, 512), (10**6, 512), (10**6, 1024)]:
        eta = _kernel.sq_norms_margin(jnp.float32, p, block_cols=block)
        tile = min(block, 1 << (p - 1).bit_length())
        tiles = -(-p // tile)
        assert eta >= tile * u + core.rounding_margin(jnp.float32, tiles)  # both sums are covered
        assert eta < 1e-3
    assert _kernel.sq_norms_margin(jnp.float64, 10**6) < 1e-12


# --------------------------------------------------------------------------- (2) secure mode, refresh_key


def _canary_setup(**kw):
    d, bbar = 8, 8.0
    tx = adaclip_jax.adaclip(noise_multiplier=4.0, expected_batch_size=bbar, **kw, preset="patent")
    params = jnp.zeros((d,))
    state = tx.init(params)
    rng = np.random.default_rng(0)
    batch = jnp.asarray(rng.standard_normal((6, d)) * 0.01, jnp.float32)
    canary = jnp.zeros((1, d)).at[0, 0].set(50.0)
    _, state = tx.update(batch, state, params)  # some history
    return tx, params, state, batch, canary, bbar


def _recovered_canary(tx, params, saved, batch, canary, bbar, step):
    """Two releases from the same (restored) state, on the batch with and without the canary:
    their difference, mapped back to w-space."""
    b = np.sqrt(np.asarray(saved.std)) * np.sqrt(np.sum(np.asarray(saved.std)))
    g1, _ = step(batch, saved, params)
    g2, _ = step(jnp.concatenate([batch, canary]), saved, params)
    return (np.asarray(g2, np.float64) - np.asarray(g1, np.float64)) * bbar / b


@pytest.mark.parametrize("use_jit", [False, True])
def test_secure_mode_restored_state_does_not_replay_the_noise(use_jit):
    """Seeded mode: the difference of two releases from one restored state is the canary's
    clipped vector (e₀), exactly. Secure mode: it is that plus fresh noise of std √2·σ."""
    canary_w = np.eye(8)[0]
    tx, params, saved, batch, canary, bbar = _canary_setup(key=jax.random.key(1234))
    step = jax.jit(tx.update) if use_jit else tx.update
    seeded = _recovered_canary(tx, params, saved, batch, canary, bbar, step)
    np.testing.assert_allclose(seeded, canary_w, atol=1e-3)  # the hole, in seeded mode
    tx, params, saved, batch, canary, bbar = _canary_setup(key=jax.random.key(1234), secure_mode=True)
    step = jax.jit(tx.update) if use_jit else tx.update
    secure = _recovered_canary(tx, params, saved, batch, canary, bbar, step)
    assert np.linalg.norm(secure - canary_w) > 1.0  # noise of std 4·√2 per coordinate remains


def test_secure_mode_fetches_new_bits_on_every_execution():
    """Same state, same batch: seeded mode repeats the release, secure mode never does — also
    from a compiled function called twice and inside lax.scan (nothing cached or hoisted)."""
    params = _params()
    g = _per_example(params, 3, 0)
    for secure in (False, True):
        tx = adaclip_jax.adaclip(noise_multiplier=1.0, expected_batch_size=3.0, key=0, secure_mode=secure, preset="patent")
        state = tx.init(params)
        step = jax.jit(lambda g, s, tx=tx: tx.update(g, s, params)[0])
        first, second = _flat(step(g, state)), _flat(step(g, state))

        def body(carry, _, tx=tx, state=state):
            return carry, tx.update(g, state, params)[0]["b"]

        _, scanned = jax.jit(lambda: jax.lax.scan(body, 0, None, length=3))()
        scanned = np.asarray(scanned)
        if secure:
            assert not np.allclose(first, second)
            assert not np.allclose(scanned[0], scanned[1]) and not np.allclose(scanned[1], scanned[2])
        else:
            np.testing.assert_array_equal(first, second)
            np.testing.assert_array_equal(scanned[0], scanned[2])


def test_secure_mode_noise_is_gaussian_with_the_right_scale():
    # OS randomness cannot be seeded: 20,000 draws and a 1e-5 level make a false alarm (1 in
    # 100,000 runs) and a missed 1.2× scale error (p ≈ 1e-40 expected) negligible.
    params = {"w": jnp.zeros((200, 100))}
    sigma, batch = 1.7, 8.0
    tx = adaclip_jax.adaclip(noise_multiplier=sigma, expected_batch_size=batch, std_min=1e-4, std_max=1.0,
                             secure_mode=True, preset="patent")
    update, _ = jax.jit(tx.update)({"w": jnp.zeros((3, 200, 100))}, tx.init(params), params)
    b = np.sqrt(1e-4) * np.sqrt(20_000)  # sqrt(s0)·sqrt(d·s0) at init
    x = np.asarray(update["w"], np.float64).ravel() / (b * sigma / batch)
    assert scipy.stats.kstest(x, "norm").pvalue > 1e-5
    assert scipy.stats.kstest(1.2 * x, "norm").pvalue < 1e-5  # the test can fail


def test_secure_mode_arguments():
    with pytest.raises(InvalidHyperparameterError, match="axis_name.*device"):
        adaclip_jax.flat_clip(max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=4, key=0,
                              axis_name="data", secure_mode=True)
    with pytest.raises(InvalidHyperparameterError, match="secure_mode"):
        adaclip_jax.adaclip(noise_multiplier=1.0, expected_batch_size=4, key=0, secure_mode="yes", preset="patent")
    with pytest.raises(InvalidHyperparameterError, match="key is required"):
        adaclip_jax.adaclip(noise_multiplier=1.0, expected_batch_size=4, preset="patent")
    params = _params()
    for factory, kw in [
        (adaclip_jax.adaclip, {}),
        (adaclip_jax.flat_clip, {"max_grad_norm": 1.0}),
        (adaclip_jax.per_layer_clip, {"max_grad_norm": 1.0}),
        (adaclip_jax.scaled_clip, {"max_grad_norm": 1.0, "layer_scales": [1.0, 1.0, 1.0]}),
    ]:
        tx = factory(noise_multiplier=1.0, expected_batch_size=4, secure_mode=True, **kw)  # no key needed
        u, _ = jax.jit(tx.update)(_per_example(params, 2, 0), tx.init(params), params)
        assert np.all(np.isfinite(_flat(u)))


def test_refresh_key_replaces_the_key_of_every_private_state_only():
    params = _params()
    tx = optax.chain(adaclip_jax.adaclip(noise_multiplier=1.0, expected_batch_size=4, key=7, preset="patent"), optax.adam(1e-3))
    state = tx.init(params)
    _, state = tx.update(_per_example(params, 4, 0), state, params)
    fresh = adaclip_jax.refresh_key(state)
    old_key, new_key = jax.random.key_data(state[0].key), jax.random.key_data(fresh[0].key)
    assert new_key.shape == old_key.shape and not np.array_equal(old_key, new_key)
    assert jax.random.key_impl(fresh[0].key) == jax.random.key_impl(state[0].key)
    assert not np.array_equal(new_key, jax.random.key_data(adaclip_jax.refresh_key(state)[0].key))
    rest = lambda s: [x for x in jax.tree_util.tree_leaves(s) if not jnp.issubdtype(x.dtype, jax.dtypes.prng_key)]  # noqa: E731
    for x, y in zip(rest(state), rest(fresh), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    given = adaclip_jax.refresh_key(state, 42)
    np.testing.assert_array_equal(jax.random.key_data(given[0].key), jax.random.key_data(jax.random.key(42)))
    bare = adaclip_jax.refresh_key(state[0], jax.random.key(5))  # an AdaClipState itself
    assert isinstance(bare, adaclip_jax.AdaClipState)
    legacy = adaclip_jax.adaclip(noise_multiplier=1.0, expected_batch_size=4, key=jax.random.PRNGKey(0), preset="patent")
    legacy_state = adaclip_jax.refresh_key(legacy.init(params))
    assert legacy_state.key.dtype == jnp.uint32 and legacy_state.key.shape == (2,)
    with pytest.raises(InvalidHyperparameterError, match="AdaClipState"):
        adaclip_jax.refresh_key(optax.adam(1e-3).init(params))


def test_refresh_key_after_restore_stops_the_seeded_replay():
    tx, params, saved, batch, canary, bbar = _canary_setup(key=jax.random.key(1234))
    b = np.sqrt(np.asarray(saved.std)) * np.sqrt(np.sum(np.asarray(saved.std)))
    g1, _ = tx.update(batch, saved, params)  # released before the checkpoint was restored
    g2, _ = tx.update(jnp.concatenate([batch, canary]), adaclip_jax.refresh_key(saved), params)
    recovered = (np.asarray(g2, np.float64) - np.asarray(g1, np.float64)) * bbar / b
    assert np.linalg.norm(recovered - np.eye(8)[0]) > 1.0


# --------------------------------------------------------------------------- (3) PrivacyTracker


def _train_step(tx, forward):
    @jax.jit
    def train_step(params, opt_state, grads, *, noise_multiplier):
        kw = {"noise_multiplier": noise_multiplier} if forward else {}
        updates, opt_state = tx.update(grads, opt_state, params, **kw)
        return optax.apply_updates(params, updates), opt_state

    return train_step


def _chain(sigma):
    return optax.chain(adaclip_jax.flat_clip(max_grad_norm=1.0, noise_multiplier=sigma, expected_batch_size=4,
                                             key=0), optax.sgd(0.1))


def test_state_records_the_sigma_each_update_used():
    params = _params()
    g = _per_example(params, 2, 0)
    tx = adaclip_jax.adaclip(noise_multiplier=lambda step: 0.5 + step.astype(jnp.float32), expected_batch_size=4,
                             key=0, preset="patent")
    state = tx.init(params)
    assert float(state.last_noise_multiplier) == 0.0
    _, state = tx.update(g, state, params)
    assert float(state.last_noise_multiplier) == 0.5
    _, state = jax.jit(tx.update)(g, state, params)
    assert float(state.last_noise_multiplier) == 1.5
    _, state = tx.update(g, state, params, noise_multiplier=jnp.float32(2.25))
    assert float(state.last_noise_multiplier) == 2.25
    zero = adaclip_jax.flat_clip(max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=4, key=0)
    _, zstate = zero.update(g, zero.init(params), params)
    assert zstate.last_noise_multiplier.dtype == jnp.float32 and float(zstate.last_noise_multiplier) == 0.0


def test_tracker_records_the_sigma_used_and_raises_when_it_is_below_the_plan():
    """The step ignores the tracker's σ = 5 and the transformation uses its own σ = 1: the
    accountant gets σ = 1, and the error names both values."""
    params = {"w": jnp.zeros((5,))}
    tx = _chain(1.0)
    acc = Accountant("rdp")
    tracker = adaclip_jax.PrivacyTracker(acc, sample_rate=0.1, noise_multiplier=5.0)
    with pytest.raises(InvalidHyperparameterError, match=r"noise_multiplier=1\.0.*noise_multiplier=5\.0.*[Ff]orward"):
        tracker.step(_train_step(tx, forward=False), params, tx.init(params), {"w": jnp.ones((4, 5))})
    assert acc.history == ((0.1, 1.0, 1),) and tracker.steps == 1


def test_tracker_records_a_lower_sigma_even_past_the_budget():
    params = {"w": jnp.zeros((5,))}
    tx = _chain(0.3)
    acc = Accountant("rdp", target_epsilon=1.0, delta=1e-5)
    tracker = adaclip_jax.PrivacyTracker(acc, sample_rate=0.01, noise_multiplier=5.0)
    assert not acc.would_exceed(noise_multiplier=5.0, sample_rate=0.01)
    assert acc.would_exceed(noise_multiplier=0.3, sample_rate=0.01)
    with pytest.raises(InvalidHyperparameterError, match="0.3"):
        tracker.step(_train_step(tx, forward=False), params, tx.init(params), {"w": jnp.ones((4, 5))})
    assert acc.steps == 1 and acc.history[0][1] == pytest.approx(0.3, rel=1e-6)
    assert acc.epsilon(1e-5) > 1.0


def test_tracker_records_a_higher_sigma_used_without_error():
    params = {"w": jnp.zeros((5,))}
    tx = _chain(3.0)
    acc = Accountant("rdp")
    tracker = adaclip_jax.PrivacyTracker(acc, sample_rate=0.1, noise_multiplier=1.0)
    tracker.step(_train_step(tx, forward=False), params, tx.init(params), {"w": jnp.ones((4, 5))})
    assert acc.history == ((0.1, 3.0, 1),)


def test_tracker_forwarded_sigma_is_recorded_exactly():
    params = {"w": jnp.zeros((5,))}
    tx = _chain(3.0)
    acc = Accountant("rdp")
    tracker = adaclip_jax.PrivacyTracker(acc, sample_rate=0.1, noise_multiplier=1.1)  # not a float32
    opt_state = tx.init(params)
    step = _train_step(tx, forward=True)
    for _ in range(3):
        params, opt_state = tracker.step(step, params, opt_state, {"w": jnp.ones((4, 5))})
    assert acc.history == ((0.1, 1.1, 3),)


def test_tracker_without_a_state_in_the_result_records_the_plan_and_raises():
    acc = Accountant("rdp")
    tracker = adaclip_jax.PrivacyTracker(acc, sample_rate=0.1, noise_multiplier=2.0)
    with pytest.raises(InvalidHyperparameterError, match="return the new opt_state"):
        tracker.step(lambda x, *, noise_multiplier: x + 1, 1)
    assert acc.history == ((0.1, 2.0, 1),)


def test_tracker_with_an_invalid_sigma_used_records_the_plan_and_raises():
    params = {"w": jnp.zeros((5,))}
    tx = _chain(1.0)
    acc = Accountant("rdp")
    tracker = adaclip_jax.PrivacyTracker(acc, sample_rate=0.1, noise_multiplier=2.0)
    inner = _train_step(tx, forward=True)

    def negated(params, opt_state, grads, *, noise_multiplier):
        return inner(params, opt_state, grads, noise_multiplier=-noise_multiplier)

    with pytest.raises(InvalidHyperparameterError, match="invalid"):
        tracker.step(negated, params, tx.init(params), {"w": jnp.ones((4, 5))})
    assert acc.history == ((0.1, 2.0, 1),)


# --------------------------------------------------------------------------- (4) unit_mask dtype


@pytest.mark.parametrize("mask", [jnp.full((4,), 0.5), jnp.array([1, 0, 1, 1]), np.array([1.0, 0.0, 1.0, 1.0])])
def test_unit_mask_must_be_boolean(mask):
    params = _params()
    g = _per_example(params, 4, 0)
    tx = adaclip_jax.adaclip(noise_multiplier=1.0, expected_batch_size=4, key=0, preset="patent")
    state = tx.init(params)
    dtype = str(jnp.asarray(mask).dtype)
    with pytest.raises(InvalidGradientError, match=f"boolean.*{dtype}"):
        tx.update(g, state, params, unit_mask=mask)
    with pytest.raises(InvalidGradientError, match="boolean"):
        jax.jit(lambda g, m: tx.update(g, state, params, unit_mask=m))(g, mask)

    def loss(p, x):
        return jnp.sum(p["b"] * x)

    fn = adaclip_jax.clipped_sum_grads(loss, tx, micro_batch_size=2)
    with pytest.raises(InvalidGradientError, match="boolean"):
        fn(state, params, jnp.ones((4, 40)), unit_mask=mask)
    fn(state, params, jnp.ones((4, 40)), unit_mask=jnp.asarray(mask) > 0)  # an explicit conversion works


# --------------------------------------------------------------------------- (5) invalid traced σ


@pytest.mark.parametrize("bad", [-1.0, np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("how", ["override", "schedule"])
def test_invalid_traced_sigma_releases_nan(bad, how):
    params = _params()
    g = _per_example(params, 3, 0)
    if how == "override":
        tx = adaclip_jax.adaclip(noise_multiplier=1.0, expected_batch_size=3, key=0, preset="patent")
        step = jax.jit(lambda g, s, nm: tx.update(g, s, params, noise_multiplier=nm))
    else:
        tx = adaclip_jax.adaclip(noise_multiplier=lambda step: jnp.where(step >= 1, bad, 1.0),
                                 expected_batch_size=3, key=0, preset="patent")
        step = jax.jit(lambda g, s, nm: tx.update(g, s, params))
    _, state = step(g, tx.init(params), jnp.float32(1.0))
    update, new_state = step(g, state, jnp.float32(bad))
    assert np.all(np.isnan(_flat(update)))
    np.testing.assert_array_equal(_flat(new_state.mean), _flat(state.mean))
    np.testing.assert_array_equal(_flat(new_state.std), _flat(state.std))
    assert int(new_state.nonfinite_steps) == 1 and int(new_state.step) == 2
    assert not np.array_equal(jax.random.key_data(new_state.key), jax.random.key_data(state.key))
    np.testing.assert_array_equal(np.asarray(new_state.last_noise_multiplier), np.float32(bad))
    with pytest.raises(InvalidHyperparameterError, match="noise_multiplier"):  # eager: still raises
        tx.update(g, state, params, noise_multiplier=jnp.float32(bad))


def test_tracker_warns_when_a_seeded_state_replays_its_key():
    """Seeded mode cannot stop a restored opt_state from replaying its key, but the tracker
    says so: a step given a state whose key an earlier step used warns; a refreshed key, the
    next state, and secure mode do not."""
    import warnings

    from adaclip.errors import NoiseReplayWarning

    params = jnp.zeros((5,))
    grads = jnp.ones((4, 5))

    def run(secure_mode):
        kw = {"secure_mode": True} if secure_mode else {"key": jax.random.key(987_654)}
        tx = adaclip_jax.flat_clip(max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=4, **kw)
        tracker = adaclip_jax.PrivacyTracker(Accountant("rdp"), sample_rate=0.1, noise_multiplier=1.0)

        @jax.jit
        def train_step(state, *, noise_multiplier):
            return tx.update(grads, state, params, noise_multiplier=noise_multiplier)

        return tx.init(params), tracker, train_step

    state, tracker, train_step = run(secure_mode=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NoiseReplayWarning)
        _, later = tracker.step(train_step, state)
        tracker.step(train_step, later)
        tracker.step(train_step, adaclip_jax.refresh_key(state))
    with pytest.warns(NoiseReplayWarning, match="replays that noise"):
        tracker.step(train_step, state)  # e.g. restored from a checkpoint made before `later`
    state, tracker, train_step = run(secure_mode=True)
    assert not bool(state.seeded)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NoiseReplayWarning)
        tracker.step(train_step, state)
        tracker.step(train_step, state)  # fresh OS bits each time: nothing replays


# --------------------------------------------------------------------------- (6) chain order


def _private(key=0, **kw):
    return adaclip_jax.adaclip(noise_multiplier=1.0, expected_batch_size=4, key=key, preset="patent", **kw)


_BEFORE = {
    # the two chains of the round-2 report: Adam's moments / a global-norm clip of raw units
    "adam, private": lambda: optax.chain(optax.adam(1e-2), _private()),
    "clip, private, adam": lambda: optax.chain(optax.clip_by_global_norm(1.0), _private(), optax.adam(1e-2)),
    "clip, chain(private, adam)": lambda: optax.chain(optax.clip_by_global_norm(1.0),
                                                      optax.chain(_private(), optax.adam(1e-2))),
    "named: clip, private": lambda: optax.named_chain(("clip", optax.clip_by_global_norm(1.0)), ("dp", _private())),
}


@pytest.mark.parametrize("name", sorted(_BEFORE))
def test_a_transformation_before_the_private_one_is_refused_at_init(name):
    """``optax.adam`` (moments of the raw (n, …) stack, broadcast silently) or
    ``clip_by_global_norm`` (every unit scaled by the norm of all of them) before the private
    transformation used to run without error; ``init`` now refuses and names the fix."""
    with pytest.raises(InvalidHyperparameterError, match=r"not the first transformation.*private_chain"):
        _BEFORE[name]().init(_params())


@pytest.mark.parametrize("use_jit", [False, True])
@pytest.mark.parametrize("named", [False, True])
def test_a_transformation_before_the_private_one_is_refused_at_update(use_jit, named):
    """A state assembled by hand (or from a checkpoint) skips the chain's ``init``; ``update``
    refuses too, at trace time under ``jit``, before the private transformation reads anything."""
    params, g = _params(), _per_example(_params(), 4, 0)
    clip, adam, private = optax.clip_by_global_norm(1.0), optax.adam(1e-2), _private()
    states = [clip.init(params), private.init(params), adam.init(params)]
    if named:
        tx = optax.named_chain(("clip", clip), ("dp", private), ("adam", adam))
        state = dict(zip(["clip", "dp", "adam"], states, strict=True))
    else:
        tx, state = optax.chain(clip, private, adam), tuple(states)
    update = jax.jit(tx.update) if use_jit else tx.update
    with pytest.raises(InvalidHyperparameterError, match=r"1 transformation\(s\) run before it in update"):
        update(g, state, params)


def test_the_same_private_transformation_twice_is_refused():
    private = _private()
    with pytest.raises(InvalidHyperparameterError, match="not the first"):
        optax.chain(private, optax.scale(1.0), private).init(_params())


def test_private_first_still_runs_in_every_valid_form():
    """First in a chain, in a nested chain, in a named chain, or alone: no refusal, and the
    state order checks pass."""
    params, g = _params(), _per_example(_params(), 4, 0)
    for tx in [
        _private(),
        optax.chain(_private(), optax.adam(1e-2)),
        optax.chain(optax.chain(_private(), optax.clip_by_global_norm(1.0)), optax.adam(1e-2)),
        optax.named_chain(("dp", _private()), ("adam", optax.adam(1e-2))),
        adaclip_jax.private_chain(_private(), optax.clip_by_global_norm(1.0), optax.adam(1e-2)),
    ]:
        state = tx.init(params)
        updates, state = jax.jit(tx.update)(g, state, params)
        assert all(np.isfinite(_flat(updates)))
        adaclip_jax.check_chain(tx, params)
        adaclip_jax.check_state_order(state)


def test_private_chain_is_the_manual_chain_bit_for_bit():
    params = _params()
    manual = optax.chain(_private(key=7), optax.clip_by_global_norm(1.0), optax.adam(1e-2))
    built = adaclip_jax.private_chain(_private(key=7), optax.clip_by_global_norm(1.0), optax.adam(1e-2))
    s_manual, s_built = manual.init(params), built.init(params)
    for step in range(3):
        g = _per_example(params, 4, step)
        u_manual, s_manual = jax.jit(manual.update)(g, s_manual, params, noise_multiplier=jnp.float32(0.5 + step))
        u_built, s_built = jax.jit(built.update)(g, s_built, params, noise_multiplier=jnp.float32(0.5 + step))
        jax.tree.map(np.testing.assert_array_equal, u_built, u_manual)
    assert jax.tree.structure(s_built) == jax.tree.structure(s_manual)
    for a, b in zip(jax.tree.leaves(s_built), jax.tree.leaves(s_manual), strict=True):
        if jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        np.testing.assert_array_equal(a, b)
    assert float(jax_transform._find_states(s_built)[0].last_noise_multiplier) == 2.5


def test_private_chain_refuses_bad_input():
    private, adam = _private(), optax.adam(1e-2)
    with pytest.raises(InvalidHyperparameterError, match="private transformation is argument 1: move it to the front"):
        adaclip_jax.private_chain(adam, private)
    with pytest.raises(InvalidHyperparameterError, match="no private transformation was given"):
        adaclip_jax.private_chain(adam)
    with pytest.raises(InvalidHyperparameterError, match="no private transformation was given"):
        adaclip_jax.private_chain(optax.chain(private, adam))  # a chain is not the private transformation
    with pytest.raises(InvalidHyperparameterError, match="argument 2 is a second private transformation"):
        adaclip_jax.private_chain(private, adam, _private())
    with pytest.raises(InvalidHyperparameterError, match="argument 1 is not an optax GradientTransformation"):
        adaclip_jax.private_chain(private, 0.1)
    with pytest.raises(InvalidHyperparameterError, match="carries no strategy"):
        adaclip_jax.private_chain(adaclip_jax.PrivateTransformation(private.init, private.update))


def test_check_chain_refuses_wrappers_a_missing_and_a_second_private_state():
    """Wrappers that see the per-unit gradients before the private transformation (gradient
    accumulation across steps, a mask that passes some leaves through raw), no private
    transformation, or two: refused from the state structure alone."""
    params = _params()
    mask = {"w": True, "b": False, "h": True}
    # MultiSteps: refused by the private transformation's own init (it runs inside check_chain)
    with pytest.raises(InvalidHyperparameterError, match="MultiSteps"):
        adaclip_jax.check_chain(optax.MultiSteps(optax.chain(_private(), optax.adam(1e-2)), 2), params)
    with pytest.raises(InvalidHyperparameterError, match=r"opt_state\[0\]<MaskedState>"):
        adaclip_jax.check_chain(optax.chain(optax.masked(_private(), mask), optax.adam(1e-2)), params)
    with pytest.raises(InvalidHyperparameterError, match="no private transformation state"):
        adaclip_jax.check_chain(optax.adam(1e-2), params)
    with pytest.raises(InvalidHyperparameterError, match="not an optax GradientTransformation"):
        adaclip_jax.check_chain(params, params)
    private, adam = _private(), optax.adam(1e-2)
    with pytest.raises(InvalidHyperparameterError, match=r"opt_state\[1\].*chain\(ScaleByAdamState"):
        adaclip_jax.check_state_order((adam.init(params), private.init(params)))
    with pytest.raises(InvalidHyperparameterError, match=r"opt_state\['dp'\]"):
        adaclip_jax.check_state_order({"adam": adam.init(params), "dp": private.init(params)})
    with pytest.raises(InvalidHyperparameterError, match="2 private transformation states"):
        adaclip_jax.check_state_order((private.init(params), private.init(params)))
    with pytest.raises(InvalidHyperparameterError, match="not the first"):  # the init's own check first
        adaclip_jax.check_chain(optax.chain(adam, private), params)


# --------------------------------------------------------------------------- (7) unbatched arguments

N_EX, K_EX = 16, 4


def _label_data():
    x = jax.random.normal(jax.random.PRNGKey(0), (N_EX, K_EX))
    y = jax.random.normal(jax.random.PRNGKey(1), (N_EX,))
    params = {"w": jax.random.normal(jax.random.PRNGKey(2), (K_EX,)), "b": jnp.zeros(())}
    return params, x, y


def _label_loss(p, x, y):
    """One example's squared error; given the whole label vector ``y`` it broadcasts silently."""
    return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)


def _flat_tx(max_grad_norm=1e-3):
    return adaclip_jax.flat_clip(
        max_grad_norm=max_grad_norm, noise_multiplier=1.0, expected_batch_size=float(N_EX), key=3
    )


def _entry(name, loss, tx, **kw):
    """``fn(state, *args)`` for each per-example entry point of adaclip_jax."""
    if name == "per_example_grads":
        fn = adaclip_jax.per_example_grads(loss, **kw)
        return lambda state, *a: fn(*a)
    if name == "per_example_grads_micro":
        fn = adaclip_jax.per_example_grads(loss, micro_batch_size=4, **kw)
        return lambda state, *a: fn(*a)
    if name == "clipped_sum_grads":
        return adaclip_jax.clipped_sum_grads(loss, tx, **kw)
    if name == "clipped_sum_grads_micro":
        return adaclip_jax.clipped_sum_grads(loss, tx, micro_batch_size=4, **kw)
    if name == "ghost_clipped_sum_grads":
        return adaclip_jax.ghost_clipped_sum_grads(loss, tx, **kw)
    if name == "ghost_coverage":
        return lambda state, *a: adaclip_jax.ghost_coverage(loss, *a, **kw)
    raise AssertionError(name)


ENTRY_POINTS = [
    "per_example_grads",
    "per_example_grads_micro",
    "clipped_sum_grads",
    "clipped_sum_grads_micro",
    "ghost_clipped_sum_grads",
    "ghost_coverage",
]


def _counting(loss):
    """``loss`` and a list whose length counts its traces (nothing computed: nothing traced)."""
    calls: list[int] = []

    def counted(*a):
        calls.append(1)
        return loss(*a)

    return counted, calls


@pytest.mark.parametrize("use_jit", [False, True])
@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_unbatched_argument_of_the_batch_size_is_refused(name, use_jit):
    """The repro of issue 41 (5): ``loss_fn(params, x, y)`` with the default ``batch_argnums=1``
    gave every example the whole label vector. Refused at trace time, before ``loss_fn`` is
    traced, with a message naming both fixes."""
    params, x, y = _label_data()
    tx = _flat_tx()
    state = tx.init(params)
    loss, calls = _counting(_label_loss)
    fn = _entry(name, loss, tx)
    if use_jit and name != "ghost_coverage":
        fn = jax.jit(fn)
    with pytest.raises(InvalidHyperparameterError, match=r"batch_argnums=\(1, 2\)") as err:
        fn(state, params, x, y)
    assert "shared_argnums=(2,)" in str(err.value)
    assert "argument 2" in str(err.value) and str(N_EX) in str(err.value)
    assert calls == []  # refused before anything was traced or computed
    # Given as an int or a one-element sequence, the same refusal.
    with pytest.raises(InvalidHyperparameterError, match=r"batch_argnums=\(1, 2\)"):
        _entry(name, loss, tx, batch_argnums=(1,))(state, params, x, y)
    assert calls == []


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_unbatched_pytree_leaf_of_the_batch_size_is_refused(name):
    """Leaves of a pytree argument are checked one by one, and the message names the leaf; a
    scalar or an array of another leading size in the same argument is fine."""
    params, x, y = _label_data()
    tx = _flat_tx()

    def loss(p, x, extra):
        return _label_loss(p, x, extra["y"]) * extra["scale"] + jnp.sum(extra["weights"])

    extra = {"y": y, "scale": jnp.float32(2.0), "weights": jnp.ones((K_EX + 1,))}
    with pytest.raises(InvalidHyperparameterError, match=r"\['y'\]"):
        _entry(name, loss, tx)(tx.init(params), params, x, extra)
    ok = {"y": jnp.float32(0.5), "scale": jnp.float32(2.0), "weights": jnp.ones((K_EX + 1,))}
    _entry(name, loss, tx)(tx.init(params), params, x, ok)


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_unbatched_argument_controls_pass(name):
    """The controls: ``batch_argnums=(1, 2)``; a shared argument of another leading size, or a
    scalar; and a genuinely shared array of the batch's size declared with ``shared_argnums``
    (equal to closing over it); parameters whose leading size equals the batch's are never
    refused (they are what is differentiated, not data)."""
    params, x, y = _label_data()
    tx = _flat_tx()
    state = tx.init(params)
    _entry(name, _label_loss, tx, batch_argnums=(1, 2))(state, params, x, y)

    def weighted(p, x, w):  # w: one weight per feature, shared by every example
        return jnp.sum(w * x * p["w"]) + p["b"]

    _entry(name, weighted, tx)(state, params, x, jnp.arange(K_EX, dtype=jnp.float32))
    _entry(name, _label_loss, tx)(state, params, x, jnp.float32(0.3))

    def table_loss(p, x, table):  # table: (N_EX, K_EX), shared, its size the batch's by chance
        return jnp.sum((table @ (x * p["w"])) ** 2) + p["b"]

    table = jax.random.normal(jax.random.PRNGKey(5), (N_EX, K_EX))
    got = _entry(name, table_loss, tx, shared_argnums=2)(state, params, x, table)
    closed = _entry(name, lambda p, x: table_loss(p, x, table), tx)(state, params, x)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(closed), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    if name != "ghost_coverage":
        jax.jit(_entry(name, table_loss, tx, shared_argnums=(2,)))(state, params, x, table)

    wide = {"w": jnp.zeros((N_EX,)), "b": jnp.zeros(())}  # a parameter leaf of the batch's size
    _entry(name, lambda p, x: jnp.sum(x @ p["w"][:K_EX]) + p["b"], tx)(tx.init(wide), wide, x)


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_bad_argument_roles_are_refused(name):
    """``shared_argnums`` and ``batch_argnums`` are disjoint, exclude the parameters, and are
    non-negative ints within range (checked when the arguments are known)."""
    params, x, y = _label_data()
    tx = _flat_tx()
    state = tx.init(params)

    def build_and_call(**kw):
        return _entry(name, _label_loss, tx, **kw)(state, params, x, y)

    with pytest.raises(InvalidHyperparameterError, match="both"):
        build_and_call(batch_argnums=(1, 2), shared_argnums=2)
    with pytest.raises(InvalidHyperparameterError, match="parameters"):
        build_and_call(batch_argnums=(1, 2), shared_argnums=0)
    for bad in (-1, True, 1.0, "2"):
        with pytest.raises(InvalidHyperparameterError, match="shared_argnums"):
            build_and_call(batch_argnums=1, shared_argnums=bad)
        with pytest.raises(InvalidHyperparameterError, match="batch_argnums"):
            build_and_call(batch_argnums=bad)
    with pytest.raises(InvalidHyperparameterError, match="batch_argnums"):
        build_and_call(batch_argnums=())
    with pytest.raises(InvalidHyperparameterError, match="out of range"):
        build_and_call(batch_argnums=(1, 2), shared_argnums=3)


def _state_arrays(state):
    """Every leaf of a state as a NumPy array (typed PRNG keys as their key data)."""
    def raw(leaf):
        if jnp.issubdtype(jnp.result_type(leaf), jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        return np.asarray(leaf).copy()

    return [raw(leaf) for leaf in jax.tree_util.tree_leaves(state)]


@pytest.mark.parametrize("name", ["clipped_sum_grads", "clipped_sum_grads_micro", "ghost_clipped_sum_grads"])
def test_refusal_changes_no_state(name):
    """After the refusal the state is the one passed in, and the corrected call then releases
    exactly what it would have released without the refused call."""
    params, x, y = _label_data()
    tx = _flat_tx(max_grad_norm=0.5)
    state = tx.init(params)
    before = _state_arrays(state)
    with pytest.raises(InvalidHyperparameterError):
        jax.jit(_entry(name, _label_loss, tx))(state, params, x, y)
    for a, b in zip(before, _state_arrays(state), strict=True):
        np.testing.assert_array_equal(a, b)
    fixed = jax.jit(_entry(name, _label_loss, tx, batch_argnums=(1, 2)))
    released, new_state = tx.update(fixed(state, params, x, y), state, params)
    fresh = tx.init(params)
    want, want_state = tx.update(fixed(fresh, params, x, y), fresh, params)
    np.testing.assert_array_equal(_flat(released), _flat(want))
    for a, b in zip(_state_arrays(new_state), _state_arrays(want_state), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("name", ["clipped_sum_grads", "clipped_sum_grads_micro", "ghost_clipped_sum_grads"])
def test_one_changed_label_moves_the_clipped_sum_by_at_most_two(name):
    """The repro's measure under the fixed call: ``D'`` = ``D`` with one label changed by 50;
    every unit clipped (C small), so ``‖S(D) − S(D')‖ ≤ 2`` in w-space (replace-one) — the
    unbatched call moved it by 8.5."""
    params, x, y = _label_data()
    tx = _flat_tx()
    state = tx.init(params)
    fn = jax.jit(_entry(name, _label_loss, tx, batch_argnums=(1, 2)))
    s1 = fn(state, params, x, y).summed
    s2 = fn(state, params, x, y.at[0].add(50.0)).summed
    assert np.linalg.norm(_flat(s1) - _flat(s2)) <= 2.0 + 1e-5


@pytest.mark.parametrize("micro_batch_size", [None, 4])
def test_one_changed_label_moves_only_its_own_per_example_gradient(micro_batch_size):
    params, x, y = _label_data()
    fn = jax.jit(adaclip_jax.per_example_grads(_label_loss, batch_argnums=(1, 2), micro_batch_size=micro_batch_size))
    g1 = fn(params, x, y)
    g2 = fn(params, x, y.at[0].add(50.0))
    for a, b in zip(jax.tree_util.tree_leaves(g1), jax.tree_util.tree_leaves(g2), strict=True):
        np.testing.assert_array_equal(np.asarray(a)[1:], np.asarray(b)[1:])
        assert not np.array_equal(np.asarray(a)[0], np.asarray(b)[0])
