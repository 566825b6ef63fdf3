"""The core's fast forms (two-stage reduction, reciprocal scale) against the NumPy reference,
float64, on NumPy, PyTorch and JAX: the same results up to float rounding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from adaclip import AdaptiveClipping, FlatClipping, reference, strategies, transform

BACKENDS = {
    "numpy": lambda x: np.asarray(x, np.float64),
    "torch": lambda x: torch.as_tensor(np.asarray(x, np.float64)),
    "jax": lambda x: jnp.asarray(np.asarray(x, np.float64)),
}

# Shapes that take the two-stage reduction (>= 3 axes with a long last axis) and ones that don't.
SHAPES = [(3, 200), (2, 2, 130), (7,), (4, 128), (5, 3)]


def _check_branch_is_exercised():
    assert any(len(s) >= 2 and s[-1] >= transform._LANES_MIN for s in SHAPES)


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_transformed_sq_norms_match_numpy_formula(backend):
    _check_branch_is_exercised()
    mk = BACKENDS[backend]
    rng = np.random.default_rng(1)
    n = 6
    g = [rng.standard_normal((n,) + s) * 10.0 for s in SHAPES]
    a = [rng.standard_normal(s) for s in SHAPES]
    b = [rng.uniform(0.1, 3.0, s) for s in SHAPES]
    with jax.enable_x64(True):
        got = transform.transformed_sq_norms([mk(x) for x in g], [mk(x) for x in a], [mk(x) for x in b])
        for k, (gk, ak, bk) in enumerate(zip(g, a, b)):
            want = np.sum(((gk - ak) / bk) ** 2, axis=tuple(range(1, gk.ndim)))
            assert tuple(got[k].shape) == (n,)
            np.testing.assert_allclose(np.asarray(got[k]), want, rtol=1e-12)
        # Float scale (flat clipping) and no centre.
        got = transform.transformed_sq_norms([mk(x) for x in g], None, [2.5] * len(g))
        for k, gk in enumerate(g):
            np.testing.assert_allclose(np.asarray(got[k]), np.sum((gk / 2.5) ** 2, axis=tuple(range(1, gk.ndim))), rtol=1e-12)


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_private_step_matches_reference_on_wide_tensors(backend):
    mk = BACKENDS[backend]
    rng = np.random.default_rng(2)
    n, sigma, batch = 5, 0.7, 4.5
    g = [rng.standard_normal((n,) + s) for s in SHAPES]
    z = [rng.standard_normal(s) for s in SHAPES]
    rows = np.concatenate([x.reshape(n, -1) for x in g], axis=1)
    zflat = np.concatenate([x.ravel() for x in z])
    with jax.enable_x64(True):
        strat = AdaptiveClipping(std_min=1e-3, std_max=2.0)
        state = strat.init([mk(np.zeros(s)) for s in SHAPES])
        mean, std = np.zeros(rows.shape[1]), np.full(rows.shape[1], strat.std_init)
        for _ in range(2):
            out, state = strategies.private_step(strat, state, [mk(x) for x in g], [mk(x) for x in z],
                                                 noise_multiplier=sigma, expected_batch_size=batch)
            ref, mean, std = reference.adaclip_step(rows, mean, std, zflat, noise_multiplier=sigma,
                                                    expected_batch_size=batch, std_min=1e-3, std_max=2.0)
            flat = np.concatenate([np.asarray(x).ravel() for x in out])
            np.testing.assert_allclose(flat, ref, rtol=1e-12, atol=1e-14)
            np.testing.assert_allclose(np.concatenate([np.asarray(x).ravel() for x in state.std]), std, rtol=1e-12)
        out, _ = strategies.private_step(FlatClipping(0.8), FlatClipping(0.8).init([]), [mk(x) for x in g],
                                         [mk(x) for x in z], noise_multiplier=sigma, expected_batch_size=batch)
        ref = reference.flat_clip_step(rows, zflat, max_grad_norm=0.8, noise_multiplier=sigma, expected_batch_size=batch)
        np.testing.assert_allclose(np.concatenate([np.asarray(x).ravel() for x in out]), ref, rtol=1e-12, atol=1e-14)
