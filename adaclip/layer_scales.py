"""eDP-SGD layer scales ``α_k`` (Dupuy et al.), obtained without leaking the private data.

eDP-SGD scales tensor ``k`` by ``α_k`` proportional to its gradient norm in the first
iteration. Read off the private data in the clear, those norms are a release that no
accountant counts. Two ways keep the guarantee:

- :func:`layer_scales_from_public` — from gradients of *public* (or synthetic) data: free.
- :func:`private_layer_scales` — from the private batch, as a Gaussian release: each unit's
  vector of per-tensor norms ``u_i = (‖g_{i,1}‖, …, ‖g_{i,K}‖)`` is clipped to L2 norm
  ``clip_norm``, summed, noised with ``N(0, σ²·clip_norm²·I_K)`` and divided by ``B̄``. That is
  one more sampled Gaussian step with sensitivity ``clip_norm`` and noise multiplier ``σ``:
  record it with the accountant (pass ``accountant=`` and ``sample_rate=`` to do so here).

Both return scales normalised to root-mean-square 1, ``sqrt(mean_k α_k²) = 1``, so equal
per-tensor norms give ``α = 1`` (flat clipping) and ``max_grad_norm`` keeps its meaning.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from adaclip._array import namespace
from adaclip.errors import InvalidHyperparameterError
from adaclip.strategies import validate_mechanism
from adaclip.transform import check_per_example_grads

__all__ = ["per_tensor_norms", "layer_scales_from_public", "private_layer_scales", "normalise_scales"]


def per_tensor_norms(per_example_grads: Sequence[Any]) -> np.ndarray:
    """``(n, K)`` NumPy matrix of per-unit, per-tensor L2 norms."""
    xp = namespace(*per_example_grads)
    cols = []
    for g in per_example_grads:
        sq = xp.sum(g * g, axis=tuple(range(1, g.ndim))) if g.ndim > 1 else g * g
        cols.append(np.asarray(xp.sqrt(sq), dtype=np.float64).reshape(-1))
    return np.stack(cols, axis=1)


def normalise_scales(norms: Sequence[float], *, min_fraction: float = 1e-3) -> tuple[float, ...]:
    """Floor ``norms`` at ``min_fraction·max(norms)`` (scales must be > 0) and normalise to
    root-mean-square 1."""
    r = np.asarray(norms, dtype=np.float64)
    if r.ndim != 1 or r.size == 0 or not np.all(np.isfinite(r)):
        raise InvalidHyperparameterError(f"norms must be a non-empty finite vector, got {norms!r}")
    if not 0 < min_fraction <= 1:
        raise InvalidHyperparameterError(f"min_fraction must be in (0, 1], got {min_fraction!r}")
    top = float(np.max(r))
    if top <= 0:
        return (1.0,) * r.size
    r = np.maximum(r, min_fraction * top)
    return tuple(float(a) for a in r / np.sqrt(np.mean(r * r)))


def layer_scales_from_public(per_example_grads: Sequence[Any], *, min_fraction: float = 1e-3) -> tuple[float, ...]:
    """``α_k ∝`` mean per-unit norm of tensor ``k`` on *public* data (no privacy cost)."""
    check_per_example_grads(per_example_grads, [tuple(g.shape[1:]) for g in per_example_grads])
    return normalise_scales(per_tensor_norms(per_example_grads).mean(axis=0), min_fraction=min_fraction)


def private_layer_scales(
    per_example_grads: Sequence[Any],
    noise: np.ndarray | None = None,
    *,
    noise_multiplier: float,
    expected_batch_size: float,
    clip_norm: float = 1.0,
    min_fraction: float = 1e-3,
    rng: np.random.Generator | None = None,
    accountant: Any = None,
    sample_rate: float | None = None,
) -> tuple[float, ...]:
    """``α_k`` from a private batch, released with the Gaussian mechanism.

    .. math::
        \\hat r = \\Big(Σ_i u_i·\\min(1, c/‖u_i‖) + σ c z\\Big)/B̄,\\qquad
        α = \\operatorname{normalise}(\\max(\\hat r, \\text{floor}))

    Args:
      per_example_grads: one ``(n, *shape)`` array per tensor (private data).
      noise: a ``(K,)`` standard-normal draw (injected, for tests); drawn from ``rng`` if
        ``None``.
      noise_multiplier: σ of this release (must be > 0: σ = 0 would leak).
      expected_batch_size: B̄ of the batch the gradients come from.
      clip_norm: c, the bound on each unit's vector of per-tensor norms.
      accountant: if given (with ``sample_rate``), the release is recorded as one sampled
        Gaussian step *before* it is computed (a budget refusal leaves everything unchanged).
      sample_rate: ``q`` of the batch, for the accountant.
    """
    sigma, batch = validate_mechanism(noise_multiplier, expected_batch_size)
    if sigma == 0:
        raise InvalidHyperparameterError("noise_multiplier must be > 0 for a private release, got 0")
    if not np.isfinite(clip_norm) or clip_norm <= 0:
        raise InvalidHyperparameterError(f"clip_norm must be finite and > 0, got {clip_norm!r}")
    if (accountant is None) != (sample_rate is None):
        raise InvalidHyperparameterError("pass accountant and sample_rate together")
    check_per_example_grads(per_example_grads, [tuple(g.shape[1:]) for g in per_example_grads], allow_empty=True)
    k = len(per_example_grads)
    if noise is None:
        noise = (rng if rng is not None else np.random.default_rng()).standard_normal(k)
    noise = np.asarray(noise, dtype=np.float64)
    if noise.shape != (k,):
        raise InvalidHyperparameterError(f"noise must have shape ({k},), got {noise.shape}")
    if accountant is not None:
        accountant.step(noise_multiplier=sigma, sample_rate=sample_rate)
    u = per_tensor_norms(per_example_grads)
    norms = np.sqrt(np.sum(u * u, axis=1, keepdims=True))
    u = u * np.minimum(1.0, clip_norm / np.maximum(norms, np.finfo(np.float64).tiny))
    noisy_mean = (u.sum(axis=0) + sigma * clip_norm * noise) / batch
    return normalise_scales(np.maximum(noisy_mean, 0.0), min_fraction=min_fraction)
