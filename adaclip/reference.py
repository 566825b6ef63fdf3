"""The reference implementation: plain NumPy on flat vectors, readable against the patent.

This module *decides correctness*. Every other path (the array-API core in
:mod:`adaclip.transform`, the PyTorch and JAX plugins, the fused kernels) is tested against
these functions on the same inputs and the same injected noise. It favours clarity over speed:
gradients are a single ``(n, d)`` matrix (all model parameters flattened together), state is a
pair of ``(d,)`` vectors, and each line maps to one numbered step of the algorithm (the docs' *The algorithm and its privacy* page) / the patent
(US 2023/…, "adaptive clipping", FIG. 2 steps 212–214 and FIG. 3 steps 302–310).

Noise is *injected*: callers pass ``noise``, a draw from the standard normal ``N(0, I_d)``,
and the functions multiply it by the noise multiplier. That keeps the functions
deterministic, so tests can compare implementations exactly.

Non-finite units: a unit (row) whose gradient has a NaN or inf entry is dropped, i.e. it
contributes exactly 0 to the clipped sum. That is a valid clipping (norm 0 ≤ 1), and it keeps
one bad unit from deciding the release by its presence (a NaN release, or an error, would).

Notation: ``g_i`` per-unit gradient, ``m`` mean estimate, ``s`` standard-deviation
estimate, ``b`` auxiliary transform, ``σ`` noise multiplier, ``B̄`` expected batch size.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from adaclip.errors import InvalidGradientError, InvalidHyperparameterError

__all__ = [
    "auxiliary_transform",
    "adaclip_step",
    "flat_clip_step",
    "per_layer_clip_step",
    "scaled_clip_step",
    "update_moments",
]


# --------------------------------------------------------------------------- checks


def _check_positive(name: str, value: float, *, allow_zero: bool = False) -> float:
    value = float(value)
    if not np.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise InvalidHyperparameterError(f"{name} must be finite and {bound}, got {value!r}")
    return value


def _check_unit_interval(name: str, value: float) -> float:
    value = float(value)
    if not (0.0 <= value < 1.0):
        raise InvalidHyperparameterError(f"{name} must be in [0, 1), got {value!r}")
    return value


def _check_grads(per_example_grads: np.ndarray, d: int | None, allow_empty: bool) -> np.ndarray:
    g = np.asarray(per_example_grads)
    if g.ndim != 2:
        raise InvalidGradientError(
            f"per_example_grads must have shape (n, d), got an array of shape {g.shape}"
        )
    if d is not None and g.shape[1] != d:
        raise InvalidGradientError(
            f"per_example_grads has {g.shape[1]} coordinates but the state has {d}"
        )
    if g.shape[0] == 0 and not allow_empty:
        raise InvalidGradientError(
            "empty batch: per_example_grads has no rows (pass allow_empty=True for a "
            "Poisson-sampled step, which then releases noise only)"
        )
    # A unit with a NaN/inf entry contributes nothing: its row is dropped before the transform.
    # (Raising, or letting NaN reach the sum, would let that one unit decide the release.)
    return g[np.all(np.isfinite(g), axis=1)]


def _check_vector(name: str, value: np.ndarray, d: int) -> np.ndarray:
    v = np.asarray(value)
    if v.shape != (d,):
        raise InvalidGradientError(f"{name} must have shape ({d},), got {v.shape}")
    if not np.all(np.isfinite(v)):
        raise InvalidGradientError(f"{name} contains NaN or inf")
    return v


def _clip_rows_to_unit_norm(w: np.ndarray) -> np.ndarray:
    """Step 306: scale each row to norm at most 1 (rows already inside are left alone)."""
    norms = np.sqrt(np.sum(w * w, axis=1))
    factors = np.minimum(1.0, 1.0 / np.maximum(norms, np.finfo(w.dtype).tiny))
    return w * factors[:, None]


# --------------------------------------------------------------------------- AdaCliP


def auxiliary_transform(std: np.ndarray) -> np.ndarray:
    """Step 302: ``b = sqrt(s) · sqrt(Σ_j s_j)``, the noise-minimising scale."""
    std = np.asarray(std)
    return np.sqrt(std) * np.sqrt(np.sum(std))


def update_moments(
    noisy_grad: np.ndarray,
    mean: np.ndarray,
    std: np.ndarray,
    *,
    noise_multiplier: float,
    expected_batch_size: float,
    beta_mean: float = 0.99,
    beta_std: float = 0.9,
    std_min: float,
    std_max: float,
) -> tuple[np.ndarray, np.ndarray]:
    """Steps 212–214 (steps 7–9 of the algorithm): update ``m`` and ``s`` from the *released* gradient.

    Only ``noisy_grad`` (already clipped and noised) and the previous state enter here, so the
    update is post-processing of a differentially private release.

    .. math::
        v = \\operatorname{clamp}\\big((\\tilde g - m)^2 - b^2 σ^2 / B̄^2,\\ s_{min}^2,\\ s_{max}^2\\big),\\quad
        s' = \\sqrt{β_2 s^2 + (1-β_2) v},\\quad m' = β_1 m + (1-β_1)\\tilde g
    """
    b = auxiliary_transform(std)
    # Step 7: squared deviation of the released gradient from the pre-update mean, minus the
    # variance the noise itself contributed in gradient space, b² σ² / B̄².
    variance = (noisy_grad - mean) ** 2 - b**2 * noise_multiplier**2 / expected_batch_size**2
    variance = np.clip(variance, std_min**2, std_max**2)
    # Step 8 (214): exponential moving average of the variance, reported as a std.
    new_std = np.sqrt(beta_std * std**2 + (1.0 - beta_std) * variance)
    # Step 9 (212): interpolate the mean towards the released gradient.
    new_mean = beta_mean * mean + (1.0 - beta_mean) * noisy_grad
    return new_mean, new_std


def adaclip_step(
    per_example_grads: np.ndarray,
    mean: np.ndarray,
    std: np.ndarray,
    noise: np.ndarray,
    *,
    noise_multiplier: float,
    expected_batch_size: float,
    beta_mean: float = 0.99,
    beta_std: float = 0.9,
    std_min: float,
    std_max: float,
    allow_empty: bool = False,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One AdaCliP step (steps 1–9 of the algorithm) on flat vectors.

    Args:
      per_example_grads: ``(n, d)`` per-unit gradients ``g_i``.
      mean: ``(d,)`` mean estimate ``m_t``.
      std: ``(d,)`` standard-deviation estimate ``s_t``, inside ``[std_min, std_max]``.
      noise: ``(d,)`` draw from ``N(0, I)``; multiplied here by ``noise_multiplier``.
      noise_multiplier: ``σ_t >= 0``.
      expected_batch_size: ``B̄ > 0``, the *expected* batch size (never the realised ``n``).
      beta_mean: ``β1`` in ``[0, 1)``, interpolation weight of the mean estimate.
      beta_std: ``β2`` in ``[0, 1)``, interpolation weight of the variance estimate.
      std_min: lower end of the range ``s`` is kept in, ``0 < std_min <= std_max``.
      std_max: upper end of that range.
      allow_empty: accept ``n = 0`` (Poisson sampling): the step then releases noise only.

    Returns:
      ``(noisy_grad, new_mean, new_std)``: the privacy-preserving gradient ``g̃_t`` to hand to
      the optimizer, and ``m_{t+1}``, ``s_{t+1}``.

    Raises:
      InvalidHyperparameterError, InvalidGradientError: before anything is computed.
    """
    noise_multiplier = _check_positive("noise_multiplier", noise_multiplier, allow_zero=True)
    expected_batch_size = _check_positive("expected_batch_size", expected_batch_size)
    beta_mean = _check_unit_interval("beta_mean", beta_mean)
    beta_std = _check_unit_interval("beta_std", beta_std)
    std_min = _check_positive("std_min", std_min)
    std_max = _check_positive("std_max", std_max)
    if std_min > std_max:
        raise InvalidHyperparameterError(
            f"std_min must be <= std_max, got std_min={std_min!r} > std_max={std_max!r}"
        )
    mean_arr = np.asarray(mean)
    if mean_arr.ndim != 1:
        raise InvalidGradientError(f"mean must be a vector of shape (d,), got {mean_arr.shape}")
    d = mean_arr.shape[0]
    g = _check_grads(per_example_grads, d, allow_empty)
    m = _check_vector("mean", mean_arr, d)
    s = _check_vector("std", std, d)
    z = _check_vector("noise", noise, d)
    if np.any(s <= 0):
        raise InvalidGradientError("std must be strictly positive")

    # Step 302: auxiliary transform b_t = sqrt(s_t) · sqrt(Σ_j s_t[j]).
    b = auxiliary_transform(s)
    # Step 304: transform each unit's gradient, w_i = (g_i − m_t) / b_t.
    w = (g - m) / b
    # Step 306: clip every transformed vector to L2 norm at most 1.
    w_clipped = _clip_rows_to_unit_norm(w)
    # Step 308: add N(0, σ² I) once to the sum; divide by the expected batch size.
    w_noisy = (np.sum(w_clipped, axis=0) + noise_multiplier * z) / expected_batch_size
    # Step 310: rescale back to gradient space, g̃_t = b_t ⊙ w̃ + m_t.
    noisy_grad = b * w_noisy + m
    # Steps 212–214: moments from the released gradient only.
    new_mean, new_std = update_moments(
        noisy_grad,
        m,
        s,
        noise_multiplier=noise_multiplier,
        expected_batch_size=expected_batch_size,
        beta_mean=beta_mean,
        beta_std=beta_std,
        std_min=std_min,
        std_max=std_max,
    )
    return noisy_grad, new_mean, new_std


# --------------------------------------------------------------------------- the affine family


def flat_clip_step(
    per_example_grads: np.ndarray,
    noise: np.ndarray,
    *,
    max_grad_norm: float,
    noise_multiplier: float,
    expected_batch_size: float,
    allow_empty: bool = False,
) -> np.ndarray:
    """DP-SGD (flat clipping): ``(Σ_i g_i·min(1, C/‖g_i‖) + C·σ·z) / B̄``.

    In the affine family: centre 0, scale ``C`` everywhere, clip ``‖w‖ <= 1``.
    """
    max_grad_norm = _check_positive("max_grad_norm", max_grad_norm)
    g, z, noise_multiplier, expected_batch_size = _check_stateless_inputs(
        per_example_grads, noise, noise_multiplier, expected_batch_size, allow_empty
    )
    w_clipped = _clip_rows_to_unit_norm(g / max_grad_norm)
    return max_grad_norm * (np.sum(w_clipped, axis=0) + noise_multiplier * z) / expected_batch_size


def _check_stateless_inputs(
    per_example_grads: np.ndarray,
    noise: np.ndarray,
    noise_multiplier: float,
    expected_batch_size: float,
    allow_empty: bool,
) -> tuple[np.ndarray, np.ndarray, float, float]:
    """Validate the inputs shared by the strategies without state; return ``(g, z, σ, B̄)``."""
    noise_multiplier = _check_positive("noise_multiplier", noise_multiplier, allow_zero=True)
    expected_batch_size = _check_positive("expected_batch_size", expected_batch_size)
    z = np.asarray(noise)
    g = _check_grads(per_example_grads, z.shape[0] if z.ndim == 1 else None, allow_empty)
    z = _check_vector("noise", z, g.shape[1])
    return g, z, noise_multiplier, expected_batch_size


def _check_groups(groups: Sequence[int], d: int) -> list[slice]:
    sizes = [int(k) for k in groups]
    if not sizes or any(k <= 0 for k in sizes) or sum(sizes) != d:
        raise InvalidHyperparameterError(
            f"groups must be positive sizes summing to d={d}, got {list(groups)!r}"
        )
    bounds = np.cumsum([0, *sizes])
    return [slice(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]


def per_layer_clip_step(
    per_example_grads: np.ndarray,
    noise: np.ndarray,
    *,
    groups: Sequence[int],
    max_grad_norm: float,
    noise_multiplier: float,
    expected_batch_size: float,
    group_max_grad_norms: Sequence[float] | None = None,
    allow_empty: bool = False,
) -> np.ndarray:
    """Per-layer clipping (McMahan et al. 2018, *Learning differentially private recurrent language models*).

    Group ``k`` (``groups`` gives the sizes of consecutive coordinate blocks) is clipped to
    its own threshold ``C_k``; the total sensitivity is ``C = sqrt(Σ_k C_k²)`` and the noise
    ``N(0, σ² C²)`` is added once to the sum. By default ``C_k = C/√K``. In the affine family:
    centre 0, scale ``C`` everywhere, and group ``k`` of ``w`` clipped to radius ``C_k / C``
    (``1/√K`` by default), so ``‖w‖ <= 1`` and the w-space noise is ``σ``.
    """
    g, z, noise_multiplier, expected_batch_size = _check_stateless_inputs(
        per_example_grads, noise, noise_multiplier, expected_batch_size, allow_empty
    )
    slices = _check_groups(groups, g.shape[1])
    if group_max_grad_norms is None:
        total = _check_positive("max_grad_norm", max_grad_norm)
        radii = np.full(len(slices), 1.0 / np.sqrt(len(slices)))
    else:
        thresholds = np.asarray([float(c) for c in group_max_grad_norms])
        if thresholds.shape != (len(slices),) or np.any(~np.isfinite(thresholds)) or np.any(thresholds <= 0):
            raise InvalidHyperparameterError(
                f"group_max_grad_norms must be {len(slices)} positive numbers, got {group_max_grad_norms!r}"
            )
        total = float(np.sqrt(np.sum(thresholds**2)))
        radii = thresholds / total
    w = g / total
    for sl, radius in zip(slices, radii):
        block = w[:, sl]
        norms = np.sqrt(np.sum(block * block, axis=1))
        w[:, sl] = block * np.minimum(1.0, radius / np.maximum(norms, np.finfo(w.dtype).tiny))[:, None]
    return total * (np.sum(w, axis=0) + noise_multiplier * z) / expected_batch_size


def scaled_clip_step(
    per_example_grads: np.ndarray,
    noise: np.ndarray,
    *,
    groups: Sequence[int],
    layer_scales: Sequence[float],
    max_grad_norm: float,
    noise_multiplier: float,
    expected_batch_size: float,
    allow_empty: bool = False,
) -> np.ndarray:
    """eDP-SGD scaling (Dupuy et al., *An efficient DP-SGD mechanism for large scale NLU models*): divide group ``k`` by ``α_k``, clip the whole vector to
    ``C``, add ``N(0, σ²C²)``, multiply group ``k`` back by ``α_k``.

    In the affine family: centre 0, scale ``C·α_k`` on group ``k``, clip ``‖w‖ <= 1``. The
    ``layer_scales`` must not come from the private data unless released privately (see
    :mod:`adaclip.layer_scales`).
    """
    max_grad_norm = _check_positive("max_grad_norm", max_grad_norm)
    g, z, noise_multiplier, expected_batch_size = _check_stateless_inputs(
        per_example_grads, noise, noise_multiplier, expected_batch_size, allow_empty
    )
    slices = _check_groups(groups, g.shape[1])
    alphas = np.asarray([float(a) for a in layer_scales])
    if alphas.shape != (len(slices),) or np.any(~np.isfinite(alphas)) or np.any(alphas <= 0):
        raise InvalidHyperparameterError(
            f"layer_scales must be {len(slices)} positive numbers, got {layer_scales!r}"
        )
    b = np.concatenate([np.full(sl.stop - sl.start, max_grad_norm * a) for sl, a in zip(slices, alphas)])
    w_clipped = _clip_rows_to_unit_norm(g / b)
    return b * (np.sum(w_clipped, axis=0) + noise_multiplier * z) / expected_batch_size
