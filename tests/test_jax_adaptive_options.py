"""adaclip_jax with the adaptive options of AdaptiveClipping, the quantile rule and automatic
clipping, against the core's :func:`adaclip.strategies.private_step` run in NumPy (float64)
on the same per-unit gradients and the same noise draws.

Noise contract (documented in :func:`adaclip_jax.private_aggregate`): ``new_key, noise_key =
split(key)``, then one key of ``split(noise_key, K + A)`` per entry of the summed list: the
``K`` parameter leaves (their shapes), then the ``A = strategy.num_auxiliary`` auxiliary sums
(0-d draws).
"""

from __future__ import annotations

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import adaclip_jax
from adaclip import strategies
from adaclip.accounting import Accountant
from adaclip.errors import InvalidGradientError, InvalidHyperparameterError, NoiseDominatedWarning
from adaclip.strategies import AdaptiveClipping, QuantileRule

pytestmark = pytest.mark.jax

SIGMA = 1.3
BATCH = 6.5
N = 6
BASE = dict(std_min=1e-3, std_max=2.0, beta_mean=0.9, beta_std=0.8)
RULE = QuantileRule(target_quantile=0.6, learning_rate=0.3, count_noise_multiplier=2.0)

#: name -> (factory of the transformation from noise_multiplier/expected_batch_size/key, ...).
CONFIGS = {
    "coupled_unbiased": lambda **kw: adaclip_jax.adaclip(correction="unbiased", **BASE, **kw, preset="patent"),
    "tensor_pooling": lambda **kw: adaclip_jax.adaclip(pooling="tensor", **BASE, **kw, preset="patent"),
    "factored_pooling": lambda **kw: adaclip_jax.adaclip(pooling="factored", correction="unbiased", **BASE, **kw, preset="patent"),
    "update_every_3": lambda **kw: adaclip_jax.adaclip(update_every=3, **BASE, **kw, preset="patent"),
    "debiased_centre": lambda **kw: adaclip_jax.adaclip(centre="debiased", **BASE, **kw, preset="patent"),
    "kalman_centre": lambda **kw: adaclip_jax.adaclip(centre="kalman", process_noise=0.05, **BASE, **kw, preset="patent"),
    "no_centre": lambda **kw: adaclip_jax.adaclip(centre="none", **BASE, **kw, preset="patent"),
    "separated": lambda **kw: adaclip_jax.adaclip(scale="separated", max_grad_norm=1.0, **BASE, **kw, preset="patent"),
    "separated_quantile": lambda **kw: adaclip_jax.adaclip(
        scale="separated", max_grad_norm=1.0, quantile=RULE, **BASE, **kw, preset="patent"
    ),
    "scale_then_privatize": lambda **kw: adaclip_jax.scale_then_privatize(
        max_grad_norm=1.0, beta=0.9, spread=100.0, **kw
    ),
    "quantile_clip": lambda **kw: adaclip_jax.quantile_clip(max_grad_norm=1.0, quantile=RULE, **kw),
    "automatic_clip": lambda **kw: adaclip_jax.automatic_clip(max_grad_norm=0.8, stability=0.05, **kw),
    "combined": lambda **kw: adaclip_jax.adaclip(
        scale="separated", max_grad_norm=0.7, shape_power=1.0, quantile=RULE, pooling="factored",
        correction="unbiased", update_every=2, centre="kalman", process_noise=0.05, statistic="deviation",
        **BASE, **kw, preset="patent"
    ),  # fmt: skip
}


# --------------------------------------------------------------------------- helpers


def make_params(dtype=jnp.float64):
    """Leaves of every kind the options treat differently: a matrix and a 3-d tensor
    (factored), a vector and a scalar (pooled per tensor)."""
    return {
        "a": jnp.zeros((3, 4), dtype),
        "b": jnp.zeros((4,), dtype),
        "c": jnp.zeros((2, 3, 2), dtype),
        "s": jnp.zeros((), dtype),
    }


def shapes_of(params):
    return [tuple(p.shape) for p in jax.tree_util.tree_leaves(params)]


def per_unit(params, n, seed):
    """Per-unit gradients with row scales spread so that some units are clipped, some not."""
    rng = np.random.default_rng(seed)
    rows = rng.uniform(0.02, 0.6, n)
    leaves, treedef = jax.tree_util.tree_flatten(params)
    out = [
        jnp.asarray(rows.reshape((n,) + (1,) * p.ndim) * rng.standard_normal((n,) + p.shape), p.dtype)
        for p in leaves
    ]
    return jax.tree_util.tree_unflatten(treedef, out)


def drawn_noise(key, shapes, num_aux, dtype=jnp.float64):
    """The standard-normal draws of a step whose state key is ``key`` (see the module doc)."""
    _, noise_key = jax.random.split(key)
    all_shapes = list(shapes) + [()] * num_aux
    keys = jax.random.split(noise_key, len(all_shapes))
    return [np.asarray(jax.random.normal(k, s, dtype), np.float64) for k, s in zip(keys, all_shapes, strict=True)]


def np_leaves(tree):
    return [np.asarray(x, np.float64) for x in jax.tree_util.tree_leaves(tree)]


def assert_close_lists(got, want, rtol=1e-10, atol=1e-12):
    assert len(got) == len(want)
    for x, y in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(x, np.float64), np.asarray(y, np.float64), rtol=rtol, atol=atol)


def assert_state_matches(state, ref, rtol=1e-10, atol=1e-12):
    """``state`` (AdaClipState) holds the same statistics as the core's NumPy ``ref``."""
    assert int(state.step) == ref.step
    for name in ("mean", "std"):
        want = getattr(ref, name)
        got = getattr(state, name)
        assert (got is None) == (want is None), name
        if want is not None:
            assert_close_lists(np_leaves(got), want, rtol, atol)
    assert (state.extra is None) == (ref.extra is None)
    if ref.extra is not None:
        assert jax.tree_util.tree_structure(state.extra) == jax.tree_util.tree_structure(ref.extra)
        assert_close_lists(np_leaves(state.extra), np_leaves(ref.extra), rtol, atol)


def reference_run(strategy, params, grads_per_step, keys, sigma, batch, masks=None):
    """The core's ``private_step`` in NumPy float64, step by step, on the kept rows."""
    shapes = shapes_of(params)
    ref = strategy.init([np.zeros(s) for s in shapes])
    outs, states = [], []
    for t, (g, key) in enumerate(zip(grads_per_step, keys, strict=True)):
        rows = np_leaves(g)
        if masks is not None:
            keep = np.asarray(masks[t])
            rows = [x[keep] for x in rows]
        z = None if sigma == 0.0 else drawn_noise(key, shapes, strategy.num_auxiliary)
        out, ref = strategies.private_step(strategy, ref, rows, z, noise_multiplier=sigma, expected_batch_size=batch)
        outs.append(out)
        states.append(ref)
    return outs, states


def poison(g, mask):
    """``g`` with NaN in the rows that ``mask`` marks absent: they must contribute nothing."""
    bad = ~np.asarray(mask)
    return jax.tree_util.tree_map(
        lambda x: jnp.where(bad.reshape((-1,) + (1,) * (x.ndim - 1)), jnp.nan, x), g
    )


# --------------------------------------------------------------------------- against the core


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_jitted_update_matches_core_private_step_in_numpy(name):
    """Three jitted steps (each with one masked-out, NaN-poisoned unit) equal the core's NumPy
    ``private_step`` on the kept units with the same noise: the release and the whole state."""
    with jax.enable_x64(True):
        params = make_params()
        tx = CONFIGS[name](noise_multiplier=SIGMA, expected_batch_size=BATCH, key=jax.random.key(5))
        state = tx.init(params)
        step = jax.jit(lambda g, s, m: tx.update(g, s, params, unit_mask=m))
        grads = [per_unit(params, N, 10 * t + 1) for t in range(3)]
        masks = [np.arange(N) != (2 * t + 1) for t in range(3)]
        keys, outs, states = [], [], []
        for g, m in zip(grads, masks, strict=True):
            keys.append(state.key)
            out, state = step(poison(g, m), state, jnp.asarray(m))
            outs.append(out)
            states.append(state)
        want_out, want_states = reference_run(tx.strategy, params, grads, keys, SIGMA, BATCH, masks)
        for out, st, want, ref in zip(outs, states, want_out, want_states, strict=True):
            assert_close_lists(np_leaves(out), want)
            assert_state_matches(st, ref)
            assert int(st.nonfinite_steps) == 0
            # The accounted σ, never the quantile rule's raised σ_g.
            assert float(st.last_noise_multiplier) == np.float32(SIGMA)
        if tx.strategy.num_auxiliary:
            sigma_g, _ = tx.strategy.noise_multipliers(SIGMA, BATCH)
            assert sigma_g > SIGMA


def test_without_mask_and_at_sigma_zero():
    """The unmasked path, and σ = 0 (no draws; the count is released without noise)."""
    with jax.enable_x64(True):
        params = make_params()
        for sigma in (SIGMA, 0.0):
            tx = CONFIGS["combined"](noise_multiplier=sigma, expected_batch_size=BATCH, key=3)
            state = tx.init(params)
            step = jax.jit(lambda g, s, tx=tx: tx.update(g, s, params))
            grads = [per_unit(params, N, 50 + t) for t in range(3)]
            keys, outs, states = [], [], []
            for g in grads:
                keys.append(state.key)
                out, state = step(g, state)
                outs.append(out)
                states.append(state)
            want_out, want_states = reference_run(tx.strategy, params, grads, keys, sigma, BATCH)
            for out, st, want, ref in zip(outs, states, want_out, want_states, strict=True):
                assert_close_lists(np_leaves(out), want)
                assert_state_matches(st, ref)


def linear_loss(params, x):
    """``Σ_k ⟨p_k, x_k⟩``: the per-example gradient is ``x`` itself."""
    return sum(jnp.vdot(p, xx) for p, xx in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(x)))


@pytest.mark.parametrize("name", ["quantile_clip", "combined"])
def test_clipped_sum_grads_carries_the_auxiliary_sums(name):
    """Pre-summed chunk by chunk (with a mask): ``ClippedSum`` carries the count; the releases
    and the states equal the core's NumPy step on the kept units."""
    with jax.enable_x64(True):
        params = make_params()
        tx = CONFIGS[name](noise_multiplier=SIGMA, expected_batch_size=BATCH, key=jax.random.key(8))
        summer = jax.jit(adaclip_jax.clipped_sum_grads(linear_loss, tx, micro_batch_size=2))
        step = jax.jit(lambda u, s: tx.update(u, s, params))
        state = tx.init(params)
        grads = [per_unit(params, N, 70 + t) for t in range(3)]
        masks = [np.arange(N) != t for t in range(3)]
        keys, outs, states = [], [], []
        for g, m in zip(grads, masks, strict=True):
            keys.append(state.key)
            summed = summer(state, params, g, unit_mask=jnp.asarray(m))
            assert isinstance(summed, adaclip_jax.ClippedSum)
            assert len(summed.auxiliary) == tx.strategy.num_auxiliary == 1
            assert all(jnp.shape(a) == () for a in summed.auxiliary)
            out, state = step(summed, state)
            outs.append(out)
            states.append(state)
        want_out, want_states = reference_run(tx.strategy, params, grads, keys, SIGMA, BATCH, masks)
        for out, st, want, ref in zip(outs, states, want_out, want_states, strict=True):
            assert_close_lists(np_leaves(out), want)
            assert_state_matches(st, ref)


def test_clipped_sum_without_its_auxiliary_sums_is_refused():
    params = make_params(jnp.float32)
    tx = CONFIGS["quantile_clip"](noise_multiplier=SIGMA, expected_batch_size=BATCH, key=0)
    state = tx.init(params)
    summed = adaclip_jax.ClippedSum(jax.tree_util.tree_map(jnp.zeros_like, params))  # no count
    with pytest.raises(InvalidGradientError, match="auxiliary"):
        tx.update(summed, state, params)
    with pytest.raises(InvalidGradientError, match="auxiliary"):
        tx.update(summed._replace(auxiliary=(jnp.zeros(2),)), state, params)


def test_auxiliary_sum_is_psummed_over_the_axis():
    """Data parallel (``axis_name``; ``vmap`` stands in for the devices): each shard clips and
    counts, the tensors *and* the count are summed, the noise is drawn once."""
    params = make_params(jnp.float32)
    single = CONFIGS["separated_quantile"](noise_multiplier=SIGMA, expected_batch_size=8, key=4)
    multi = CONFIGS["separated_quantile"](noise_multiplier=SIGMA, expected_batch_size=8, key=4, axis_name="d")
    g = per_unit(params, 8, 3)
    sharded = jax.tree_util.tree_map(lambda x: x.reshape((4, 2) + x.shape[1:]), g)
    step1 = jax.jit(single.update)
    step2 = jax.jit(jax.vmap(multi.update, in_axes=(0, None, None), out_axes=0, axis_name="d"))
    s1 = s2 = single.init(params)
    for _ in range(2):
        u1, s1 = step1(g, s1, params)
        u2, s2 = step2(sharded, s2, params)
        s2 = jax.tree_util.tree_map(lambda x: x[0], s2)
        assert_close_lists(np_leaves(u1), [x[0] for x in np_leaves(u2)], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(float(s1.extra["clip_norm"]), float(s2.extra["clip_norm"]), rtol=1e-6)


# --------------------------------------------------------------------------- σ validity


def test_invalid_static_sigma_for_the_quantile_rule_raises():
    """``σ ≥ 2σ_b`` (here the default ``σ_b = B̄/20``) cannot be split: refused up front."""
    with pytest.raises(InvalidHyperparameterError, match="count_noise_multiplier"):
        adaclip_jax.quantile_clip(noise_multiplier=SIGMA, expected_batch_size=BATCH, key=0)
    with pytest.raises(InvalidHyperparameterError, match="count_noise_multiplier"):
        adaclip_jax.adaclip(noise_multiplier=SIGMA, expected_batch_size=BATCH, key=0, scale="separated",
                            max_grad_norm=1.0, quantile=QuantileRule(), preset="patent")  # fmt: skip
    params = make_params(jnp.float32)
    tx = adaclip_jax.quantile_clip(noise_multiplier=0.1, expected_batch_size=BATCH, key=0)
    state = tx.init(params)
    g = per_unit(params, N, 0)
    for bad in (5.0, jnp.float32(5.0)):  # a per-call σ, Python or concrete: raises before any change
        with pytest.raises(InvalidHyperparameterError, match="count_noise_multiplier"):
            tx.update(g, state, params, noise_multiplier=bad)


def test_invalid_traced_sigma_releases_nan_and_keeps_the_state():
    """A traced σ the split cannot serve (``σ ≥ 2σ_b``: the core's ``σ_g`` is NaN), or one that
    is invalid outright, releases NaN; mean, std and extra (``C_t``, windows, Kalman P) stay."""
    params = make_params(jnp.float32)
    tx = CONFIGS["combined"](noise_multiplier=0.5, expected_batch_size=BATCH, key=1)
    step = jax.jit(lambda g, s, nm: tx.update(g, s, params, noise_multiplier=nm))
    state = tx.init(params)
    _, state = step(per_unit(params, N, 1), state, jnp.float32(0.5))  # move off the initial state
    for bad in (5.0, -1.0, float("nan")):
        out, new = step(per_unit(params, N, 2), state, jnp.float32(bad))
        assert all(np.isnan(np.asarray(x)).all() for x in jax.tree_util.tree_leaves(out)), bad
        for name in ("mean", "std", "extra"):
            old_leaves = jax.tree_util.tree_leaves(getattr(state, name))
            new_leaves = jax.tree_util.tree_leaves(getattr(new, name))
            assert old_leaves, name
            for a, b in zip(old_leaves, new_leaves, strict=True):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
                assert a.dtype == b.dtype
        assert int(new.nonfinite_steps) == 1 and int(new.step) == 2
        assert not np.array_equal(jax.random.key_data(new.key), jax.random.key_data(state.key))
        np.testing.assert_equal(float(new.last_noise_multiplier), np.float32(bad))
    out, newer = step(per_unit(params, N, 3), new, jnp.float32(0.5))  # and the next valid step is fine
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree_util.tree_leaves(out))
    assert int(newer.nonfinite_steps) == 1


def test_tracker_records_the_accounted_sigma_not_sigma_g():
    params = make_params(jnp.float32)
    tx = CONFIGS["quantile_clip"](noise_multiplier=SIGMA, expected_batch_size=BATCH, key=2)
    acc = Accountant("rdp")
    tracker = adaclip_jax.PrivacyTracker(acc, sample_rate=0.1, noise_multiplier=SIGMA)
    state = tx.init(params)
    step = jax.jit(lambda g, s, *, noise_multiplier: tx.update(g, s, params, noise_multiplier=noise_multiplier))
    for t in range(2):
        _, state = tracker.step(step, per_unit(params, N, t), state)
    ref = Accountant("rdp")
    for _ in range(2):
        ref.step(noise_multiplier=SIGMA, sample_rate=0.1)
    assert tracker.epsilon(1e-5) == pytest.approx(ref.epsilon(1e-5), rel=1e-12)


# --------------------------------------------------------------------------- construction


def test_initial_max_grad_norm_matches_from_initial_clip_and_torch():
    params = make_params(jnp.float32)
    d = sum(math.prod(s) for s in shapes_of(params))
    tx = adaclip_jax.adaclip(noise_multiplier=0.0, expected_batch_size=N, key=0, initial_max_grad_norm=0.4,
                             std_spread=10.0, beta_mean=0.8, centre="debiased", preset="patent")  # fmt: skip
    with pytest.raises(InvalidHyperparameterError, match="init"):
        tx.strategy  # noqa: B018  (d is not known before init)
    state = tx.init(params)
    want = AdaptiveClipping.from_initial_clip(0.4, d, spread=10.0, beta_mean=0.8, centre="debiased")
    assert tx.strategy == want
    torch = pytest.importorskip("torch")
    from adaclip_torch.optimizer import AdaClip

    torch.set_num_threads(1)
    model = torch.nn.Linear(d - 1, 1)  # d - 1 weights + 1 bias = d coordinates
    opt = AdaClip(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=0.0,
                  expected_batch_size=N, initial_max_grad_norm=0.4, std_spread=10.0, preset="patent")  # fmt: skip
    assert (opt.strategy.std_min, opt.strategy.std_max) == pytest.approx((want.std_min, want.std_max), rel=1e-12)
    # At step 0 it clips like flat clipping at C0 (centre 0, b = s0·√d = C0).
    g = per_unit(params, N, 4)
    flat = adaclip_jax.flat_clip(max_grad_norm=0.4, noise_multiplier=0.0, expected_batch_size=N, key=0)
    out, _ = jax.jit(tx.update)(g, state, params)
    want_out, _ = jax.jit(flat.update)(g, flat.init(params), params)
    assert_close_lists(np_leaves(out), np_leaves(want_out), rtol=1e-5, atol=1e-7)


def test_initial_max_grad_norm_resolves_on_a_first_update_and_refusals():
    params = make_params(jnp.float32)
    kw = dict(noise_multiplier=0.5, expected_batch_size=N, key=0)
    with pytest.raises(InvalidHyperparameterError, match="not both"):
        adaclip_jax.adaclip(initial_max_grad_norm=1.0, std_min=1e-3, **kw, preset="patent")
    with pytest.raises(InvalidHyperparameterError, match="initial_max_grad_norm"):
        adaclip_jax.adaclip(initial_max_grad_norm=-1.0, **kw, preset="patent")
    with pytest.raises(InvalidHyperparameterError, match="pooling"):
        adaclip_jax.adaclip(initial_max_grad_norm=1.0, pooling="rows", **kw, preset="patent")
    tx = adaclip_jax.adaclip(initial_max_grad_norm=1.0, **kw, preset="patent")
    state = adaclip_jax.adaclip(std_min=1.0, std_max=1.0, **kw, preset="patent").init(params)  # a state of the same shapes
    jax.eval_shape(lambda g, s: tx.update(g, s, params), per_unit(params, N, 0), state)  # traced: resolves d
    assert tx.strategy.std_max == pytest.approx(30.0 / math.sqrt(29))
    with pytest.raises(InvalidHyperparameterError, match="d = 29"):
        tx.init({"w": jnp.zeros((3,))})


def test_option_errors_and_kernel_eligibility():
    kw = dict(noise_multiplier=1.0, expected_batch_size=N, key=0)
    with pytest.raises(InvalidHyperparameterError, match="max_grad_norm"):
        adaclip_jax.adaclip(scale="separated", **kw, preset="patent")
    with pytest.raises(InvalidHyperparameterError, match="centre"):
        adaclip_jax.adaclip(centre="median", **kw, preset="patent")
    with pytest.raises(InvalidHyperparameterError, match="is_patent"):
        adaclip_jax.adaclip(pooling="tensor", use_kernel=True, **kw, preset="patent")
    with pytest.raises(InvalidHyperparameterError, match="AdaptiveClipping"):
        adaclip_jax.private_aggregate(strategies.QuantileClipping(1.0, RULE), use_kernel=True, **kw)
    params = make_params(jnp.float32)
    g = per_unit(params, 3, 0)
    for tx in (adaclip_jax.adaclip(centre="kalman", use_kernel="auto", **kw, preset="patent"),
               adaclip_jax.adaclip(use_kernel=False, **kw, preset="patent")):  # fmt: skip
        jaxpr = str(jax.make_jaxpr(lambda g, s, tx=tx: tx.update(g, s, params))(g, tx.init(params)))
        assert "pallas_call" not in jaxpr
    if jax.default_backend() != "gpu":  # refused there (tests/test_jax_kernel.py)
        patent = adaclip_jax.adaclip(use_kernel=True, **kw, preset="patent")
        jaxpr = str(jax.make_jaxpr(lambda g, s: patent.update(g, s, params))(g, patent.init(params)))
        assert "pallas_call" in jaxpr


def test_noise_dominated_warning_only_for_the_coupled_scale():
    params = make_params(jnp.float32)
    kw = dict(noise_multiplier=10.0, expected_batch_size=1, key=0)
    with pytest.warns(NoiseDominatedWarning):
        adaclip_jax.adaclip(centre="kalman", **kw, preset="patent").init(params)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        adaclip_jax.adaclip(scale="separated", max_grad_norm=1.0, **kw, preset="patent").init(params)
        adaclip_jax.scale_then_privatize(max_grad_norm=1.0, **kw).init(params)
        adaclip_jax.automatic_clip(**kw).init(params)


def test_with_public_statistics_matches_the_core_and_works_in_a_chain():
    with jax.enable_x64(True):
        params = make_params()
        tx = adaclip_jax.adaclip(noise_multiplier=SIGMA, expected_batch_size=BATCH, key=0, scale="separated",
                                 max_grad_norm=1.0, pooling="factored", correction="unbiased",
                                 freeze_statistics=True, **BASE, preset="patent")  # fmt: skip
        state = tx.init(params)
        public = per_unit(params, 8, 99)
        new = jax.jit(lambda s, p: adaclip_jax.with_public_statistics(tx, s, p, weight=0.7))(state, public)
        core = tx.strategy
        ref = core.init([np.zeros(s) for s in shapes_of(params)])
        ref = core.with_public_statistics(ref, np_leaves(public), weight=0.7)
        assert_state_matches(new, ref)
        assert jax.tree_util.tree_structure(new) == jax.tree_util.tree_structure(state)
        # The method, on a chain's state: only the private element's statistics move.
        chain = optax.chain(tx, optax.sgd(0.1))
        chained = tx.with_public_statistics(chain.init(params), public, weight=0.7)
        assert_close_lists(np_leaves(chained[0].std), np_leaves(new.std))
        assert_close_lists(np_leaves(chained[0].mean), np_leaves(state.mean))  # the centre is left alone
        flat = adaclip_jax.flat_clip(max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=4, key=0)
        with pytest.raises(InvalidHyperparameterError, match="AdaptiveClipping"):
            adaclip_jax.with_public_statistics(flat, flat.init(params), public)
