"""The array-API core (adaclip.strategies / adaclip.transform) against the reference.

The same inputs and the same injected noise go through the core on NumPy, PyTorch and JAX
(eager and jit) arrays, split per parameter tensor, and through the flat-vector reference.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from adaclip import reference as R
from adaclip import strategies as S
from adaclip import transform as T
from adaclip.errors import InvalidGradientError, InvalidHyperparameterError


def split(v, shapes, lead=()):
    out, i = [], 0
    for sh in shapes:
        k = int(np.prod(sh, dtype=int))
        out.append(np.ascontiguousarray(v[..., i : i + k]).reshape((*lead, *sh)))
        i += k
    return out


def flat(arrays):
    return np.concatenate([np.asarray(a, dtype=np.float64).reshape(-1) for a in arrays])


BACKENDS = {
    "numpy": (lambda x: np.asarray(x), lambda f: f),
    "torch": (lambda x: torch.from_numpy(np.asarray(x)), lambda f: f),
    "jax": (lambda x: jnp.asarray(x), lambda f: f),
    "jax-jit": (lambda x: jnp.asarray(x), jax.jit),
}


@st.composite
def problems(draw):
    shapes = draw(
        st.lists(st.lists(st.integers(1, 4), min_size=0, max_size=3).map(tuple), min_size=1, max_size=4)
    )
    n = draw(st.integers(1, 5))
    d = sum(int(np.prod(s, dtype=int)) for s in shapes)
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    G = rng.normal(scale=draw(st.sampled_from([0.01, 1.0, 10.0])), size=(n, d))
    return shapes, G, rng


def run_core(backend, strategy, state_np, G, z, shapes, sigma, B):
    conv, wrap = BACKENDS[backend]
    n = G.shape[0]
    state = S.ClipState(
        step=conv(np.asarray(state_np.step)) if backend.startswith("jax") else state_np.step,
        mean=None if state_np.mean is None else [conv(x) for x in state_np.mean],
        std=None if state_np.std is None else [conv(x) for x in state_np.std],
    )
    grads = [conv(x) for x in split(G, shapes, (n,))]
    noise = [conv(x) for x in split(z, shapes)]
    step = wrap(lambda st_, g, nz: S.private_step(strategy, st_, g, nz, noise_multiplier=sigma, expected_batch_size=B))
    return step(state, grads, noise)


# JAX compiles per shape, so its cases draw fewer examples (same properties).
FEW = settings(max_examples=8)


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@given(problem=problems(), sigma=st.sampled_from([0.0, 1.1]), steps=st.integers(1, 3))
def test_adaptive_core_equals_reference_over_several_steps(backend, problem, sigma, steps):
    check_adaptive_against_reference(backend, problem, sigma, steps)


@pytest.mark.parametrize("backend", ["jax", "jax-jit"])
@FEW
@given(problem=problems(), sigma=st.sampled_from([0.0, 1.1]), steps=st.integers(1, 3))
def test_adaptive_core_equals_reference_over_several_steps_jax(backend, problem, sigma, steps):
    check_adaptive_against_reference(backend, problem, sigma, steps)


def check_adaptive_against_reference(backend, problem, sigma, steps):
    shapes, G, rng = problem
    d = G.shape[1]
    strategy = S.AdaptiveClipping(std_min=1e-3, std_max=2.0, beta_mean=0.9, beta_std=0.8)
    m, s = np.zeros(d), np.full(d, strategy.std_init)
    state = strategy.init(split(np.zeros(d), shapes))
    B = 1.5 * G.shape[0]
    with jax.enable_x64(True):
        for _ in range(steps):
            z = rng.normal(size=d)
            G = G + rng.normal(scale=0.1, size=G.shape)
            ref = R.adaclip_step(
                G, m, s, z, noise_multiplier=sigma, expected_batch_size=B, beta_mean=0.9, beta_std=0.8,
                std_min=1e-3, std_max=2.0,
            )
            got, new_state = run_core(backend, strategy, state, G, z, shapes, sigma, B)
            np.testing.assert_allclose(flat(got), ref[0], rtol=1e-12, atol=1e-13)
            np.testing.assert_allclose(flat(new_state.mean), ref[1], rtol=1e-12, atol=1e-13)
            np.testing.assert_allclose(flat(new_state.std), ref[2], rtol=1e-12, atol=1e-13)
            _, m, s = ref
            state = S.ClipState(
                step=int(new_state.step), mean=[np.asarray(x) for x in new_state.mean],
                std=[np.asarray(x) for x in new_state.std],
            )
        assert state.step == steps


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@given(problem=problems(), sigma=st.sampled_from([0.0, 0.7]))
def test_affine_family_equals_reference(backend, problem, sigma):
    check_affine_against_reference(backend, problem, sigma)


@FEW
@given(problem=problems(), sigma=st.sampled_from([0.0, 0.7]))
def test_affine_family_equals_reference_jax_jit(problem, sigma):
    check_affine_against_reference("jax-jit", problem, sigma)


def check_affine_against_reference(backend, problem, sigma):
    shapes, G, rng = problem
    d, n = G.shape[1], G.shape[0]
    sizes = [int(np.prod(s, dtype=int)) for s in shapes]
    z = rng.normal(size=d)
    alphas = tuple(float(a) for a in rng.uniform(0.2, 3.0, size=len(shapes)))
    cases = [
        (S.FlatClipping(max_grad_norm=0.8), R.flat_clip_step(G, z, max_grad_norm=0.8, noise_multiplier=sigma, expected_batch_size=n)),
        (
            S.PerLayerClipping(max_grad_norm=0.8),
            R.per_layer_clip_step(G, z, groups=sizes, max_grad_norm=0.8, noise_multiplier=sigma, expected_batch_size=n),
        ),
        (
            S.ScaledClipping(max_grad_norm=0.8, layer_scales=alphas),
            R.scaled_clip_step(
                G, z, groups=sizes, layer_scales=alphas, max_grad_norm=0.8, noise_multiplier=sigma, expected_batch_size=n
            ),
        ),
    ]
    norms = tuple(float(c) for c in rng.uniform(0.1, 2.0, size=len(shapes)))
    cases.append(
        (
            S.PerLayerClipping(group_max_grad_norms=norms),
            R.per_layer_clip_step(
                G, z, groups=sizes, max_grad_norm=1.0, group_max_grad_norms=norms, noise_multiplier=sigma,
                expected_batch_size=n,
            ),
        )
    )
    with jax.enable_x64(True):
        for strategy, want in cases:
            got, new_state = run_core(backend, strategy, S.ClipState(step=0), G, z, shapes, sigma, float(n))
            np.testing.assert_allclose(flat(got), want, rtol=1e-12, atol=1e-13)
            assert int(new_state.step) == 1


@given(problem=problems(), cut=st.integers(0, 5))
def test_micro_batch_sums_add_up_to_the_full_batch(problem, cut):
    """Virtual steps / data parallelism: clip_and_sum over parts, added, equals the whole."""
    shapes, G, rng = problem
    n = G.shape[0]
    cut = min(cut, n)
    strategy = S.AdaptiveClipping(std_min=1e-2, std_max=1.0)
    state = strategy.init(split(np.zeros(G.shape[1]), shapes))
    whole = S.clip_and_sum(strategy, state, split(G, shapes, (n,)))
    part_a = S.clip_and_sum(strategy, state, split(G[:cut], shapes, (cut,)))
    part_b = S.clip_and_sum(strategy, state, split(G[cut:], shapes, (n - cut,)))
    np.testing.assert_allclose(flat(part_a) + flat(part_b), flat(whole), rtol=1e-12, atol=1e-14)


def test_float32_statistics_stay_float32():
    strategy = S.AdaptiveClipping(std_min=1e-3, std_max=1.0)
    params = [torch.zeros(3, 2), torch.zeros(4)]
    state = strategy.init(params)
    grads = [torch.randn(5, 3, 2), torch.randn(5, 4)]
    noise = [torch.randn(3, 2), torch.randn(4)]
    out, new = S.private_step(strategy, state, grads, noise, noise_multiplier=1.0, expected_batch_size=5)
    assert all(x.dtype == torch.float32 for x in out + new.mean + new.std)


def test_release_updates_state_from_the_release_only():
    """Two different clipped sums with noise chosen to give the same release give the same state."""
    rng = np.random.default_rng(0)
    shapes = [(2, 3), (3,)]
    strategy = S.AdaptiveClipping(std_min=1e-2, std_max=1.0)
    state = S.ClipState(0, split(rng.normal(size=9) * 0.1, shapes), split(rng.uniform(0.05, 0.9, 9), shapes))
    sum1, sum2 = split(rng.normal(size=9), shapes), split(rng.normal(size=9) * 3, shapes)
    z1 = rng.normal(size=9)
    z2 = z1 + (flat(sum1) - flat(sum2)) / 2.0
    out1, st1 = S.release(strategy, state, sum1, split(z1, shapes), noise_multiplier=2.0, expected_batch_size=4.0)
    out2, st2 = S.release(strategy, state, sum2, split(z2, shapes), noise_multiplier=2.0, expected_batch_size=4.0)
    np.testing.assert_allclose(flat(out1), flat(out2), rtol=1e-12)
    np.testing.assert_allclose(flat(st1.std), flat(st2.std), rtol=1e-12)
    np.testing.assert_allclose(flat(st1.mean), flat(st2.mean), rtol=1e-12)


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "make, name",
    [
        (lambda: S.FlatClipping(max_grad_norm=0), "max_grad_norm"),
        (lambda: S.FlatClipping(max_grad_norm=float("inf")), "max_grad_norm"),
        (lambda: S.FlatClipping(max_grad_norm="x"), "max_grad_norm"),
        (lambda: S.AdaptiveClipping(std_min=1.0, std_max=0.5), "std_min must be <= std_max"),
        (lambda: S.AdaptiveClipping(std_min=-1.0), "std_min"),
        (lambda: S.AdaptiveClipping(beta_mean=1.5), "beta_mean"),
        (lambda: S.AdaptiveClipping(beta_std=1.0), "beta_std"),
        (lambda: S.PerLayerClipping(), "max_grad_norm or group_max_grad_norms"),
        (lambda: S.PerLayerClipping(group_max_grad_norms=(1.0, 0.0)), "group_max_grad_norms"),
        (lambda: S.ScaledClipping(max_grad_norm=1.0, layer_scales=()), "layer_scales"),
        (lambda: S.validate_mechanism(-0.1, 4), "noise_multiplier"),
        (lambda: S.validate_mechanism(1.0, 0), "expected_batch_size"),
        (lambda: S.validate_sample_rate(0.0), r"sample_rate must be in \(0, 1\]"),
        (lambda: S.validate_sample_rate(1.5), "sample_rate"),
        (lambda: S.validate_sample_rate("x"), "sample_rate must be a number"),
    ],
)
def test_invalid_hyperparameters_name_themselves(make, name):
    with pytest.raises(InvalidHyperparameterError, match=name):
        make()


def test_layer_count_mismatch_is_an_error():
    with pytest.raises(InvalidHyperparameterError, match="layer_scales has 2 entries for 3"):
        S.ScaledClipping(max_grad_norm=1.0, layer_scales=(1.0, 2.0)).transform(S.ClipState(0), 3)


@pytest.mark.parametrize(
    "grads, words",
    [
        ([np.zeros((2, 3)), np.zeros((3, 4))], "same leading batch size"),
        ([np.zeros((2, 3))], "for 1 tensors, expected 2"),
        ([np.zeros(3), np.zeros((2, 4))], "leading batch axis"),
        ([np.zeros((2, 3)), np.zeros((2, 5))], "leading batch axis"),
        ([np.zeros((0, 3)), np.zeros((0, 4))], "empty batch"),
        ([np.full((2, 3), np.nan), np.zeros((2, 4))], "NaN or inf"),
        ([np.zeros((2, 3)), np.full((2, 4), -np.inf)], "NaN or inf"),
    ],
)
def test_check_per_example_grads(grads, words):
    with pytest.raises(InvalidGradientError, match=words):
        T.check_per_example_grads(grads, [(3,), (4,)])


def test_check_per_example_grads_accepts_empty_poisson_batches_and_torch():
    assert T.check_per_example_grads([np.zeros((0, 3))], [(3,)], allow_empty=True) == 0
    assert T.check_per_example_grads([torch.zeros(4, 3)], [(3,)]) == 4
    with pytest.raises(InvalidGradientError, match="NaN"):
        T.check_per_example_grads([torch.full((4, 3), float("nan"))], [(3,)])


# --------------------------------------------------------------------------- initial clip norm


@given(
    c0=st.floats(1e-3, 1e3),
    d=st.integers(1, 10_000),
    spread=st.floats(1.0, 100.0),
)
def test_std_bounds_for_initial_clip_give_b0_equal_to_c0(c0, d, spread):
    from adaclip.strategies import std_bounds_for_initial_clip

    lo, hi = std_bounds_for_initial_clip(c0, d, spread=spread)
    s0 = math.sqrt(lo * hi)
    assert lo <= s0 <= hi
    assert hi / lo == pytest.approx(spread**2, rel=1e-9)
    assert s0 * math.sqrt(d) == pytest.approx(c0, rel=1e-9)  # b_0 = s_0·sqrt(d) = C0


def test_adaclip_from_initial_clip_first_step_is_flat_clipping():
    """At step 0 (m = 0, b = C0 everywhere) AdaCliP releases exactly DP-SGD's gradient."""
    rng = np.random.default_rng(0)
    shapes = [(3, 4), (4,)]
    d = sum(int(np.prod(s)) for s in shapes)
    grads = [rng.normal(size=(5, *s)) * 3.0 for s in shapes]
    noise = [rng.normal(size=s) for s in shapes]
    ada = S.AdaptiveClipping.from_initial_clip(0.7, d, beta_std=0.99)
    assert ada.beta_std == 0.99
    kw = dict(noise_multiplier=1.3, expected_batch_size=4.0)
    params = [np.zeros(s) for s in shapes]
    out_ada, _ = S.private_step(ada, ada.init(params), grads, noise, **kw)
    flat = S.FlatClipping(0.7)
    out_flat, _ = S.private_step(flat, flat.init(params), grads, noise, **kw)
    for a, b in zip(out_ada, out_flat, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "kwargs",
    [dict(initial_max_grad_norm=0.0, num_params=3), dict(initial_max_grad_norm=1.0, num_params=0),
     dict(initial_max_grad_norm=1.0, num_params=2.5), dict(initial_max_grad_norm=float("nan"), num_params=3),
     dict(initial_max_grad_norm=1.0, num_params=3, spread=0.5)],
)  # fmt: skip
def test_std_bounds_for_initial_clip_reject_bad_input(kwargs):
    from adaclip.strategies import std_bounds_for_initial_clip

    with pytest.raises(InvalidHyperparameterError):
        std_bounds_for_initial_clip(**kwargs)


# --------------------------------------------------------------------------- noise drift of s


@pytest.mark.parametrize("sigma,bbar,rel", [(1.0, 64.0, 0.1), (2.0, 32.0, 0.1), (4.0, 32.0, 0.25)])
def test_std_estimates_drift_on_pure_noise_as_the_drift_number_predicts(sigma, bbar, rel):
    """No units (pure noise): mean(s) changes per step by 0.5·ln(1 + (1 − β2)(κ − 1)), growing
    iff κ = noise_drift_number(d, σ, B̄) > 1 (the clamp of step 7 keeps 2φ(1) of the noise).
    First order: at large κ (15 here) the spread of s and of the per-step factor make the
    realised log-rate lower than this (never higher)."""
    d, steps, beta_std = 2000, 200, 0.99
    kappa = S.noise_drift_number(d, sigma, bbar)
    rng = np.random.default_rng(1)
    mean, std = np.zeros(d), np.full(d, 1e-3)
    for _ in range(steps):
        _, mean, std = R.adaclip_step(np.zeros((0, d)), mean, std, rng.standard_normal(d), noise_multiplier=sigma,
                                      expected_batch_size=bbar, beta_std=beta_std, std_min=1e-7, std_max=1e6,
                                      allow_empty=True)  # fmt: skip
    rate = math.log(std.mean() / 1e-3) / steps
    predicted = 0.5 * math.log(1 + (1 - beta_std) * (kappa - 1))
    assert (rate > 0) == (kappa > 1)
    assert rate == pytest.approx(predicted, rel=rel)
    assert rate <= predicted + 1e-4


def test_noise_drift_number_values_and_checks():
    assert S.noise_drift_number(1000, 1.0, 10.0) == pytest.approx(2 * math.exp(-0.5) / math.sqrt(2 * math.pi) * 10)
    assert S.noise_drift_number(5, 0.0, 1.0) == 0.0
    for bad in [dict(num_params=0, noise_multiplier=1.0, expected_batch_size=1.0),
                dict(num_params=3, noise_multiplier=-1.0, expected_batch_size=1.0),
                dict(num_params=3, noise_multiplier=1.0, expected_batch_size=0.0)]:  # fmt: skip
        with pytest.raises(InvalidHyperparameterError):
            S.noise_drift_number(**bad)


def test_warn_if_noise_dominated_warns_exactly_when_kappa_exceeds_one():
    import warnings

    from adaclip.errors import NoiseDominatedWarning

    d = 2000
    # κ = 2φ(1)·d·σ²/B̄² crosses 1 at B̄ = sqrt(2φ(1)·d)·σ ≈ 31.1 for σ = 1.
    with pytest.warns(NoiseDominatedWarning, match=r"drift number is [0-9.]+ > 1.*at least 32 at this σ"):
        kappa = S.warn_if_noise_dominated(d, 1.0, 30.0)
    assert kappa == pytest.approx(S.noise_drift_number(d, 1.0, 30.0)) and kappa > 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert S.warn_if_noise_dominated(d, 1.0, 32.0) < 1
        assert S.warn_if_noise_dominated(d, 0.0, 1.0) == 0.0
    with pytest.raises(InvalidHyperparameterError):
        S.warn_if_noise_dominated(d, 1.0, -1.0)


def test_noise_dominated_warning_points_at_the_callers_line():
    from adaclip.errors import NoiseDominatedWarning

    with pytest.warns(NoiseDominatedWarning) as record:
        S.warn_if_noise_dominated(10_000, 4.0, 8.0)
    assert record[0].filename == __file__
