"""Numerical safety of the core: rounding may over-clip, never under-clip, and a unit with a
NaN/inf gradient contributes nothing (on NumPy, PyTorch, JAX and under ``jax.jit``)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from adaclip import strategies as S
from adaclip import transform as T

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
jnp = jax.numpy

BACKENDS = {
    "numpy": lambda x: np.asarray(x),
    "torch": lambda x: torch.as_tensor(np.asarray(x)),
    "jax": lambda x: jnp.asarray(np.asarray(x)),
}


def _np(x):
    return np.asarray(x.detach() if isinstance(x, torch.Tensor) else x)


def test_rounding_margin_formula():
    u32 = 2.0**-24
    assert T.unit_roundoff(np.float32) == u32 and T.unit_roundoff(torch.float32) == u32
    assert T.unit_roundoff(jnp.float32) == u32 and T.unit_roundoff(torch.float64) == 2.0**-53
    # k = 1: min(1, B) + 1 + 0 + 12 = 14 units of roundoff
    assert T.rounding_margin(np.float32, 1) == pytest.approx(14 * u32 / (1 - 14 * u32))
    k = 10**6
    eff = 512 + math.ceil(k / 512) + 2 * math.ceil(math.log2(k)) + 12
    assert T.rounding_margin(np.float32, k) == pytest.approx(eff * u32 / (1 - eff * u32))
    assert T.rounding_margin(np.float32, k) < 2e-4  # over-clip of at most ~1e-4 in norm
    with pytest.raises(ValueError, match="no useful rounding bound"):
        T.rounding_margin(np.float16, 10**9)


def test_nested_margin_covers_every_level_and_their_products():
    # inner sums computed within a factor (1 + η_1) and the outer sum of them within (1 + η_2)
    # bound the exact nested sum only by (1 + η_1)(1 + η_2): the levels' sum misses η_1·η_2
    for dtype, cases in [(np.float32, [(600,), (600, 600), (64, 4096, 10**4)]), (np.float64, [(600, 600)]),
                         (torch.bfloat16, [(3, 5), (3, 5, 7)])]:
        for lengths in cases:
            levels = [T.rounding_margin(dtype, k) for k in lengths]
            eta = T.nested_rounding_margin(dtype, *lengths)
            cross = sum(a * b for i, a in enumerate(levels) for b in levels[i + 1 :])
            assert eta >= sum(levels) + cross  # Π(1 + η_i) − 1 to second order, no cancellation
            assert eta <= (sum(levels) + cross + math.prod(levels)) * (1 + 1e-12)  # and no more


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize(
    "rows",
    [
        np.ones((2, 1 << 20), np.float32),  # equal terms: where a sequential float32 sum stalls
        np.random.default_rng(0).random((3, 300_001)).astype(np.float32),
        np.random.default_rng(1).standard_normal((4, 7, 129)).astype(np.float32) * 1e-3,
    ],
    ids=["ones-2^20", "uniform-3e5", "normal-3d"],
)
def test_squared_norms_are_upper_bounds(backend, rows):
    g = BACKENDS[backend](rows)
    exact = np.sum(rows.astype(np.float64).reshape(rows.shape[0], -1) ** 2, axis=1)
    fn = jax.jit(T.transformed_sq_norms) if backend == "jax" else T.transformed_sq_norms
    (bound,) = fn([g], None, [1.0])
    assert np.all(_np(bound).astype(np.float64) >= exact)
    assert np.all(_np(bound) <= exact * (1 + 1e-3))  # and not a useless one


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_clipped_units_never_exceed_the_radius(backend):
    """Units placed just outside the unit sphere (float32): the clipped contribution, in exact
    arithmetic on the float32 inputs, has norm ≤ 1."""
    rng = np.random.default_rng(3)
    d, n = 4099, 64
    w = rng.standard_normal((n, d))
    w /= np.linalg.norm(w, axis=1, keepdims=True)
    w *= 1.0 + np.linspace(-3e-7, 3e-7, n)[:, None]  # within float32 rounding of the boundary
    g = w.astype(np.float32)
    (sq,) = T.transformed_sq_norms([BACKENDS[backend](g)], None, [1.0])
    c = _np(T.clip_factors(sq)).astype(np.float64)
    exact_norm = np.linalg.norm(g.astype(np.float64), axis=1)
    assert np.all(c * exact_norm <= 1.0)


def _bad_batch(bad, n=5):
    rng = np.random.default_rng(11)
    grads = [rng.standard_normal((n, 3, 2)), rng.standard_normal((n, 4))]
    with_bad = [np.concatenate([g, g[:1]]) for g in grads]
    with_bad[1][-1, 2] = bad
    return grads, with_bad


STRATEGIES = [
    S.FlatClipping(0.7),
    S.PerLayerClipping(max_grad_norm=0.5),
    S.ScaledClipping(0.7, (1.0, 2.0)),
    S.AdaptiveClipping(std_min=0.01, std_max=1.0),
]


@pytest.mark.parametrize("backend", sorted(BACKENDS) + ["jax-jit"])
@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: type(s).__name__)
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_non_finite_unit_is_dropped_by_clip_and_sum(backend, strategy, bad):
    grads, with_bad = _bad_batch(bad)
    to = BACKENDS[backend.split("-")[0]]
    state = strategy.init([to(np.zeros(g.shape[1:])) for g in grads])
    if state.mean is not None:  # a non-trivial centre: dropping is not "a zero gradient"
        state = state._replace(mean=[m + 0.3 for m in state.mean])
    fn = S.clip_and_sum
    if backend == "jax-jit":
        fn = jax.jit(S.clip_and_sum, static_argnums=0)
    expected = fn(strategy, state, [to(g) for g in grads])
    got = fn(strategy, state, [to(g) for g in with_bad])
    for e, o in zip(expected, got):
        assert np.all(np.isfinite(_np(o)))
        # float32 on a GPU sums the rows in another order when one is dropped: a few ulps
        tol = 1e-12 if _np(o).dtype == np.float64 else 1e-6
        np.testing.assert_allclose(_np(o), _np(e), rtol=tol, atol=tol)


def test_clip_factors_of_non_finite_norms_are_zero():
    sq = np.array([0.25, 4.0, np.nan, np.inf, 0.0])
    np.testing.assert_array_equal(T.clip_factors(sq), [1.0, 0.5, 0.0, 0.0, 1.0])


def test_drop_units_leaves_kept_units_alone_and_copies_nothing_when_none_is_dropped():
    g = np.arange(6.0).reshape(3, 2)
    assert T.drop_units(g, np.ones(3)) is g
    g[1, 0] = np.nan
    np.testing.assert_array_equal(T.drop_units(g, np.array([1.0, 0.0, 0.5])), [[0.0, 1.0], [0.0, 0.0], [4.0, 5.0]])
