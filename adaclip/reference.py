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
from adaclip.options import finite_positive

__all__ = [
    "auxiliary_transform",
    "adaclip_step",
    "flat_clip_step",
    "per_layer_clip_step",
    "scaled_clip_step",
    "update_moments",
    "split_noise_multiplier",
    "count_noise_multiplier",
    "adaptive_init",
    "adaptive_transform",
    "adaptive_update",
    "adaptive_clip_step",
    "public_statistics",
    "quantile_clip_step",
    "automatic_clip_step",
]


# --------------------------------------------------------------------------- checks


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
    noise_multiplier = finite_positive("noise_multiplier", noise_multiplier, allow_zero=True)
    expected_batch_size = finite_positive("expected_batch_size", expected_batch_size)
    beta_mean = _check_unit_interval("beta_mean", beta_mean)
    beta_std = _check_unit_interval("beta_std", beta_std)
    std_min = finite_positive("std_min", std_min)
    std_max = finite_positive("std_max", std_max)
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
    max_grad_norm = finite_positive("max_grad_norm", max_grad_norm)
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
    noise_multiplier = finite_positive("noise_multiplier", noise_multiplier, allow_zero=True)
    expected_batch_size = finite_positive("expected_batch_size", expected_batch_size)
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
        total = finite_positive("max_grad_norm", max_grad_norm)
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
    max_grad_norm = finite_positive("max_grad_norm", max_grad_norm)
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


# --------------------------------------------------------------------------- adaptive options
#
# AdaCliP with the options of adaclip.strategies.AdaptiveClipping, the quantile rule, quantile
# clipping and automatic clipping, written from the maths of the module docstring of
# adaclip.adaptive (not from its code). Everything is flat: the d coordinates of all parameter
# tensors concatenated in order; ``shapes`` (the parameter shapes) only tells where a tensor
# starts and ends (tensor pooling) and how a tensor is seen as ``out × rest`` (factored pooling).
#
# The state is a dict of float64 vectors and scalars, with the keys of ClipState:
#
#   "step"          t, the number of steps taken
#   "mean"          (d,) the centre's estimate m (absent for centre="none")
#   "std"           (d,) the std estimates s, in [std_min, std_max]
#   "variance"      the unclamped variance EMA u of every tensor that is not factored,
#                   concatenated (only when correction != "clamp" or pooling == "factored";
#                   with the clamp correction and no factoring the EMA is s² itself, as in
#                   the patent's step 8)
#   "rows", "cols"  the row-mean and column-mean EMAs R, K of every factored tensor,
#                   concatenated (only when some tensor is factored)
#   "window_sum", "window_noise" (d,) and "window_count" (scalar): D, N and how many releases
#                   the current window holds (only when update_every > 1)
#   "centre_var"    (d,) the Kalman centre's variance P, −1 before the first observation
#   "clip_norm"     C_t of the quantile rule (only with a quantile rule)

_ADAPTIVE_DEFAULTS = dict(
    std_min=1e-5, std_max=1.0, beta_mean=0.99, beta_std=0.9, scale="coupled", max_grad_norm=None,
    shape_power=0.5, statistic="deviation", correction="clamp", pooling="coordinate", update_every=1,
    centre="ema", process_noise=0.01, freeze_statistics=False, quantile=None, initial_variance=None,
)  # fmt: skip


def _choose(name: str, value: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise InvalidHyperparameterError(f"{name} must be one of {allowed}, got {value!r}")
    return value


def _quantile_rule(quantile) -> dict | None:
    """``None``, or ``{"target_quantile": γ, "learning_rate": η, "count_noise_multiplier": σ_b or
    None}`` from a mapping or from any object with those attributes (a QuantileRule)."""
    if quantile is None:
        return None
    get = quantile.get if isinstance(quantile, dict) else (lambda k, d=None: getattr(quantile, k, d))
    gamma = float(get("target_quantile", 0.5))
    if not 0.0 < gamma < 1.0:
        raise InvalidHyperparameterError(f"target_quantile must be in (0, 1), got {gamma!r}")
    eta = finite_positive("learning_rate", get("learning_rate", 0.2))
    sigma_b = get("count_noise_multiplier", None)
    sigma_b = None if sigma_b is None else finite_positive("count_noise_multiplier", sigma_b)
    return {"target_quantile": gamma, "learning_rate": eta, "count_noise_multiplier": sigma_b}


def _adaptive_options(options: dict) -> dict:
    """The options with defaults filled in, checked (InvalidHyperparameterError otherwise)."""
    unknown = set(options) - set(_ADAPTIVE_DEFAULTS)
    if unknown:
        raise InvalidHyperparameterError(f"unknown options {sorted(unknown)}")
    o = {**_ADAPTIVE_DEFAULTS, **options}
    o["std_min"] = finite_positive("std_min", o["std_min"])
    o["std_max"] = finite_positive("std_max", o["std_max"])
    if o["std_min"] > o["std_max"]:
        raise InvalidHyperparameterError(f"std_min must be <= std_max, got {o['std_min']!r} > {o['std_max']!r}")
    o["beta_mean"] = _check_unit_interval("beta_mean", o["beta_mean"])
    o["beta_std"] = _check_unit_interval("beta_std", o["beta_std"])
    _choose("scale", o["scale"], ("coupled", "separated"))
    _choose("statistic", o["statistic"], ("deviation", "second_moment"))
    _choose("correction", o["correction"], ("clamp", "unbiased", "none"))
    _choose("pooling", o["pooling"], ("coordinate", "tensor", "factored"))
    _choose("centre", o["centre"], ("none", "ema", "debiased", "kalman"))
    o["shape_power"] = finite_positive("shape_power", o["shape_power"])
    o["process_noise"] = finite_positive("process_noise", o["process_noise"])
    k = o["update_every"]
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise InvalidHyperparameterError(f"update_every must be an int >= 1, got {k!r}")
    if not isinstance(o["freeze_statistics"], bool):
        raise InvalidHyperparameterError(f"freeze_statistics must be a bool, got {o['freeze_statistics']!r}")
    o["quantile"] = _quantile_rule(o["quantile"])
    if o["initial_variance"] is not None:
        o["initial_variance"] = finite_positive("initial_variance", o["initial_variance"], allow_zero=True)
    if o["scale"] == "separated":
        if o["max_grad_norm"] is None:
            raise InvalidHyperparameterError("scale='separated' needs max_grad_norm")
        o["max_grad_norm"] = finite_positive("max_grad_norm", o["max_grad_norm"])
    elif o["max_grad_norm"] is not None or o["quantile"] is not None or o["shape_power"] != 0.5:
        raise InvalidHyperparameterError("max_grad_norm, quantile and shape_power apply to scale='separated' only")
    return o


def _tensor_slices(shapes: Sequence[tuple[int, ...]]) -> list[slice]:
    """Where each tensor's coordinates sit in the flat vector."""
    sizes = [int(np.prod(shape, dtype=np.int64)) for shape in shapes]
    bounds = np.cumsum([0, *sizes])
    return [slice(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]


def _factored(shape: tuple[int, ...], pooling: str) -> bool:
    """Factored pooling applies to tensors with at least two axes, seen as ``out × rest``."""
    return pooling == "factored" and len(shape) >= 2


def _keeps_variance(o: dict) -> bool:
    """Whether the variance EMA is stored apart from ``s²`` (see the state's keys above)."""
    return o["correction"] != "clamp" or o["pooling"] == "factored"


def split_noise_multiplier(noise_multiplier: float, count_noise_multiplier: float) -> float:
    """``σ_g = (σ⁻² − (2σ_b)⁻²)^{-1/2}`` (0 for σ = 0): the gradient's multiplier when a count of
    sensitivity ½ is released with ``N(0, σ_b²)`` in the same step, so that the pair is one
    Gaussian mechanism with multiplier σ: ``1/σ_g² + (½)²/σ_b² = 1/σ²``. Needs ``σ < 2σ_b``."""
    sigma = finite_positive("noise_multiplier", noise_multiplier, allow_zero=True)
    sigma_b = finite_positive("count_noise_multiplier", count_noise_multiplier)
    if sigma == 0.0:
        return 0.0
    if not sigma < 2.0 * sigma_b:
        raise InvalidHyperparameterError(
            f"noise_multiplier must be < 2·count_noise_multiplier, got σ = {sigma!r}, σ_b = {sigma_b!r}"
        )
    return 1.0 / np.sqrt(1.0 / sigma**2 - 1.0 / (2.0 * sigma_b) ** 2)


def count_noise_multiplier(quantile, expected_batch_size: float) -> float:
    """``σ_b`` of a quantile rule: its own, or ``B̄/20`` (Andrew et al.'s recommendation)."""
    rule = _quantile_rule(quantile)
    given = rule["count_noise_multiplier"]
    return expected_batch_size / 20.0 if given is None else given


def _noise_multipliers(o: dict, noise_multiplier: float, expected_batch_size: float) -> tuple[float, float]:
    """``(σ_g, σ_b)``: the multipliers of the gradient's and the count's noise (σ and 0 without
    a quantile rule; both 0 for σ = 0)."""
    if o["quantile"] is None:
        return noise_multiplier, 0.0
    sigma_b = count_noise_multiplier(o["quantile"], expected_batch_size)
    sigma_g = split_noise_multiplier(noise_multiplier, sigma_b)
    return sigma_g, (0.0 if noise_multiplier == 0.0 else sigma_b)


def adaptive_init(shapes: Sequence[tuple[int, ...]], **options) -> dict:
    """The state at t = 0: ``m = 0``, every variance EMA at ``u_0`` (``initial_variance``, by
    default ``s_0² = std_min·std_max``) and ``s = sqrt(clamp(u_0, std_min², std_max²))``
    everywhere, empty windows, ``P = −1`` (no observation yet), ``C_0 = max_grad_norm``."""
    o = _adaptive_options(options)
    shapes = [tuple(s) for s in shapes]
    d = sum(sl.stop - sl.start for sl in _tensor_slices(shapes))
    if o["initial_variance"] is None:
        s0 = np.sqrt(o["std_min"] * o["std_max"])
        var0 = s0**2
    else:
        var0 = o["initial_variance"]
        s0 = np.sqrt(np.clip(var0, o["std_min"] ** 2, o["std_max"] ** 2))
    state: dict = {"step": 0, "std": np.full(d, s0)}
    if o["centre"] != "none":
        state["mean"] = np.zeros(d)
    if _keeps_variance(o):
        plain = [shape for shape in shapes if not _factored(shape, o["pooling"])]
        state["variance"] = np.full(sum(int(np.prod(s, dtype=np.int64)) for s in plain), var0)
        matrices = [shape for shape in shapes if _factored(shape, o["pooling"])]
        if matrices:
            state["rows"] = np.full(sum(shape[0] for shape in matrices), var0)
            state["cols"] = np.full(sum(int(np.prod(shape[1:], dtype=np.int64)) for shape in matrices), var0)
    if o["update_every"] > 1:
        state["window_sum"] = np.zeros(d)
        state["window_noise"] = np.zeros(d)
        state["window_count"] = 0.0
    if o["centre"] == "kalman":
        state["centre_var"] = np.full(d, -1.0)
    if o["quantile"] is not None:
        state["clip_norm"] = float(o["max_grad_norm"])
    return state


def adaptive_transform(state: dict, **options) -> tuple[np.ndarray, np.ndarray]:
    """``(a, b)``, the centre and the scale of the step, from the state alone.

    Centre: ``0`` ("none"), ``m`` ("ema", "kalman"), ``m/(1 − β₁ᵗ)`` ("debiased", 0 at t = 0).
    Scale: ``b = √s·√Σs`` ("coupled", the patent's step 302) or ``b = C_t·s^p/mean(s^p)``
    ("separated", the mean over all d coordinates; ``C_t`` the quantile rule's, or ``max_grad_norm``).
    """
    o = _adaptive_options(options)
    s = np.asarray(state["std"], dtype=np.float64)
    t = state["step"]
    if o["centre"] == "none":
        a = np.zeros_like(s)
    elif o["centre"] == "debiased":
        a = np.zeros_like(s) if t == 0 else state["mean"] / (1.0 - o["beta_mean"] ** t)
    else:
        a = state["mean"]
    if o["scale"] == "coupled":
        b = auxiliary_transform(s)
    else:
        clip_norm = state["clip_norm"] if o["quantile"] is not None else o["max_grad_norm"]
        shape = s ** o["shape_power"]
        b = clip_norm * shape / np.mean(shape)
    return a, b


def _statistics_update(state: dict, v: np.ndarray, *, beta: float, clamp_before: bool, shapes, o: dict) -> dict:
    """The EMAs of the statistics fed with ``v`` (one value per coordinate) with weight ``β``;
    returns the new ``std`` and accumulators.

    Pooling first: per coordinate, the mean over each tensor, or (factored) the row means and
    the column means of the ``out × rest`` matrix. ``clamp_before``: the pooled values are
    clamped to ``[std_min², std_max²]`` before the EMA (the patent's correction); the estimate
    is clamped at use in any case, ``s = sqrt(clamp(u))`` (factored: ``u_ij = R⁺_i K⁺_j/mean(R⁺)``
    with ``x⁺ = max(x, 0)``, 0 when every ``R_i ≤ 0``).
    """
    lo, hi = o["std_min"] ** 2, o["std_max"] ** 2
    std = np.array(state["std"], dtype=np.float64)
    out = {"std": std}
    variance = None if "variance" not in state else np.array(state["variance"], dtype=np.float64)
    rows = None if "rows" not in state else np.array(state["rows"], dtype=np.float64)
    cols = None if "cols" not in state else np.array(state["cols"], dtype=np.float64)
    at_var = at_row = at_col = 0  # where the next tensor's entries start in variance/rows/cols
    for shape, sl in zip(shapes, _tensor_slices(shapes)):
        x = v[sl]
        size = sl.stop - sl.start
        if _factored(shape, o["pooling"]):
            out_dim, rest = shape[0], size // shape[0]
            mat = x.reshape(out_dim, rest)
            row_means, col_means = mat.mean(axis=1), mat.mean(axis=0)
            if clamp_before:
                row_means, col_means = np.clip(row_means, lo, hi), np.clip(col_means, lo, hi)
            r = rows[at_row : at_row + out_dim] = beta * rows[at_row : at_row + out_dim] + (1.0 - beta) * row_means
            k = cols[at_col : at_col + rest] = beta * cols[at_col : at_col + rest] + (1.0 - beta) * col_means
            at_row, at_col = at_row + out_dim, at_col + rest
            # u_ij = R⁺_i K⁺_j / mean(R⁺): a factor below 0 (possible under the unbiased
            # correction) is a variance below the noise, i.e. 0; all of R⁺ at 0 gives u = 0.
            r_pos, k_pos = np.maximum(r, 0.0), np.maximum(k, 0.0)
            denom = np.mean(r_pos)
            estimate = np.outer(r_pos, k_pos) / denom if denom > 0 else np.zeros((out_dim, rest))
            std[sl] = np.sqrt(np.clip(estimate, lo, hi)).reshape(-1)
            continue
        pooled = x if o["pooling"] == "coordinate" else np.full(size, np.mean(x))
        if clamp_before:
            pooled = np.clip(pooled, lo, hi)
        if variance is None:  # the clamp correction without factoring: the EMA is s² (step 8)
            std[sl] = np.sqrt(beta * std[sl] ** 2 + (1.0 - beta) * pooled)
        else:
            u = variance[at_var : at_var + size] = beta * variance[at_var : at_var + size] + (1.0 - beta) * pooled
            std[sl] = np.sqrt(np.clip(u, lo, hi))
            at_var += size
    if variance is not None:
        out["variance"] = variance
    if rows is not None:
        out["rows"], out["cols"] = rows, cols
    return out


def adaptive_update(
    state: dict,
    noisy_grad: np.ndarray,
    noisy_count: float | None = None,
    *,
    shapes: Sequence[tuple[int, ...]],
    noise_multiplier: float,
    expected_batch_size: float,
    **options,
) -> dict:
    """The next state from the step's *released* values only: ``g̃`` and, with a quantile
    rule, the noisy count. ``noise_multiplier`` is the step's accounted σ (the gradient's noise
    was ``σ_g``, :func:`split_noise_multiplier`, with a quantile rule).

    1. ``a``, ``b`` of the step (from the state); the noise variance of ``g̃``, ``n = b²σ_g²/B̄²``.
    2. Statistics (unless frozen): the signal ``x = g̃ − a`` ("deviation") or ``x = g̃``
       ("second_moment"); ``v = x² − n`` ("clamp", "unbiased") or ``x²`` ("none"); delayed by
       ``k``: ``D = Σx``, ``N = Σn`` over the window and at its end ``v = D²/k − N/k`` (or
       ``D²/k``), the statistics being updated only then; the pooled EMA with ``β₂``.
    3. Centre: ``m' = β₁m + (1−β₁)g̃`` ("ema", "debiased"), or the Kalman step with ``R = n``,
       ``Q = ρR``: ``P⁻ = P + Q``, ``K = P⁻/(P⁻ + R)`` (1 for the first release or ``R = 0``),
       ``m' = m + K(g̃ − m)``, ``P' = K·R``.
    4. Quantile rule: ``f̃ = count/B̄ + ½``, ``C' = C·exp(−η(f̃ − γ))``.
    """
    o = _adaptive_options(options)
    shapes = [tuple(s) for s in shapes]
    noise_multiplier = finite_positive("noise_multiplier", noise_multiplier, allow_zero=True)
    expected_batch_size = finite_positive("expected_batch_size", expected_batch_size)
    sigma_g, _ = _noise_multipliers(o, noise_multiplier, expected_batch_size)
    g = np.asarray(noisy_grad, dtype=np.float64)
    # 1. The step's centre and scale, and the variance the noise put in each released coordinate.
    a, b = adaptive_transform(state, **options)
    n = b**2 * sigma_g**2 / expected_batch_size**2
    new = dict(state)
    # 2. Statistics.
    if not o["freeze_statistics"]:
        x = g - a if o["statistic"] == "deviation" else g
        subtract = o["correction"] != "none"
        k = o["update_every"]
        ready = True
        if k == 1:
            v = x**2 - n if subtract else x**2
        else:
            window_sum = state["window_sum"] + x
            window_noise = state["window_noise"] + n
            count = state["window_count"] + 1.0
            ready = count >= k
            if ready:  # the window is full: v from its sums, and a new window starts
                v = window_sum**2 / k - window_noise / k if subtract else window_sum**2 / k
                window_sum, window_noise, count = np.zeros_like(window_sum), np.zeros_like(window_noise), 0.0
            new["window_sum"], new["window_noise"], new["window_count"] = window_sum, window_noise, count
        if ready:
            new.update(
                _statistics_update(state, v, beta=o["beta_std"], clamp_before=o["correction"] == "clamp",
                                   shapes=shapes, o=o)
            )  # fmt: skip
    # 3. Centre.
    if o["centre"] in ("ema", "debiased"):
        new["mean"] = o["beta_mean"] * state["mean"] + (1.0 - o["beta_mean"]) * g
    elif o["centre"] == "kalman":
        m, p = state["mean"], state["centre_var"]
        prior = p + o["process_noise"] * n
        gain = np.where(p < 0, 1.0, np.where(n > 0, prior / np.where(n > 0, prior + n, 1.0), 1.0))
        new["mean"] = m + gain * (g - m)
        new["centre_var"] = gain * n
    # 4. Quantile rule.
    if o["quantile"] is not None:
        q = o["quantile"]
        fraction = noisy_count / expected_batch_size + 0.5
        new["clip_norm"] = state["clip_norm"] * np.exp(-q["learning_rate"] * (fraction - q["target_quantile"]))
    new["step"] = state["step"] + 1
    return new


def _adaptive_check_state(state: dict, d: int) -> None:
    for key in ("mean", "std", "window_sum", "window_noise", "centre_var"):
        if key in state:
            _check_vector(key, state[key], d)
    if np.any(np.asarray(state["std"]) <= 0):
        raise InvalidGradientError("std must be strictly positive")


def adaptive_clip_step(
    per_example_grads: np.ndarray,
    state: dict,
    noise: np.ndarray,
    count_noise: float = 0.0,
    *,
    shapes: Sequence[tuple[int, ...]],
    noise_multiplier: float,
    expected_batch_size: float,
    allow_empty: bool = False,
    **options,
) -> tuple[np.ndarray, dict]:
    """One step of AdaCliP with options (``options``: those of
    ``adaclip.strategies.AdaptiveClipping``, e.g. ``**dataclasses.asdict(strategy)``; the
    defaults are the patent, and then this is :func:`adaclip_step`, bit for bit).

    Args:
      per_example_grads: ``(n, d)`` per-unit gradients (rows with a NaN/inf are dropped).
      state: the state dict (see :func:`adaptive_init`).
      noise: ``(d,)`` draw from ``N(0, I)`` for the gradient.
      count_noise: a ``N(0, 1)`` draw for the quantile rule's count (unused without one).
      shapes: the parameter shapes (tensor boundaries), in the order of the coordinates.
      noise_multiplier: the step's accounted σ.
      expected_batch_size: ``B̄``.

    Returns:
      ``(noisy_grad, new_state)``.
    """
    o = _adaptive_options(options)
    noise_multiplier = finite_positive("noise_multiplier", noise_multiplier, allow_zero=True)
    expected_batch_size = finite_positive("expected_batch_size", expected_batch_size)
    shapes = [tuple(s) for s in shapes]
    d = sum(sl.stop - sl.start for sl in _tensor_slices(shapes))
    g = _check_grads(per_example_grads, d, allow_empty)
    z = _check_vector("noise", noise, d)
    _adaptive_check_state(state, d)
    sigma_g, sigma_b = _noise_multipliers(o, noise_multiplier, expected_batch_size)

    # Centre and scale from the state only.
    a, b = adaptive_transform(state, **options)
    # Transform, clip every unit's w to norm at most 1.
    w = (g - a) / b
    w_clipped = _clip_rows_to_unit_norm(w)
    # The quantile rule's count: Σ_i (1[‖w_i‖ ≤ 1] − ½), with noise σ_b·ζ.
    noisy_count = None
    if o["quantile"] is not None:
        norms = np.sqrt(np.sum(w * w, axis=1))
        noisy_count = float(np.sum((norms <= 1.0) - 0.5)) + sigma_b * float(count_noise)
    # Noise once on the sum, divided by B̄; back to gradient space.
    w_noisy = (np.sum(w_clipped, axis=0) + sigma_g * z) / expected_batch_size
    noisy_grad = b * w_noisy + a
    new_state = adaptive_update(
        state, noisy_grad, noisy_count, shapes=shapes, noise_multiplier=noise_multiplier,
        expected_batch_size=expected_batch_size, **options,
    )  # fmt: skip
    return noisy_grad, new_state


def public_statistics(state: dict, public_per_example_grads: np.ndarray, *, shapes, weight: float = 1.0,
                      **options) -> dict:  # fmt: skip
    """The state with its statistics moved towards those of *public* per-example gradients
    ``(n, d)``, ``n ≥ 2``: ``var_j = Σ_i (g_ij − ḡ_j)²/(n − 1)``, pooled and clamped to
    ``[std_min², std_max²]`` like the clamp correction, then mixed into every variance EMA as
    ``(1 − weight)·old + weight·new``. The centre, windows, ``C_t`` and ``t`` are untouched."""
    o = _adaptive_options(options)
    weight = finite_positive("weight", weight)
    if weight > 1:
        raise InvalidHyperparameterError(f"weight must be in (0, 1], got {weight!r}")
    g = np.asarray(public_per_example_grads, dtype=np.float64)
    if g.ndim != 2 or g.shape[0] < 2:
        raise InvalidHyperparameterError(f"public statistics need an (n, d) array with n >= 2, got {g.shape}")
    variance = np.sum((g - g.mean(axis=0)) ** 2, axis=0) / (g.shape[0] - 1)
    new = dict(state)
    new.update(_statistics_update(state, variance, beta=1.0 - weight, clamp_before=True,
                                  shapes=[tuple(s) for s in shapes], o=o))  # fmt: skip
    return new


def quantile_clip_step(
    per_example_grads: np.ndarray,
    clip_norm: float,
    noise: np.ndarray,
    count_noise: float,
    *,
    noise_multiplier: float,
    expected_batch_size: float,
    target_quantile: float = 0.5,
    learning_rate: float = 0.2,
    count_noise_multiplier: float | None = None,
    allow_empty: bool = False,
) -> tuple[np.ndarray, float]:
    """Flat clipping at the quantile rule's ``C_t`` (Andrew et al. 2021).

    ``g̃ = C_t·(Σ_i w̄_i + σ_g z)/B̄`` with ``w_i = g_i/C_t`` clipped to norm 1; the count
    ``Σ_i (1[‖w_i‖ ≤ 1] − ½) + σ_b ζ`` is released too, and
    ``C_{t+1} = C_t·exp(−η(count/B̄ + ½ − γ))``. Returns ``(noisy_grad, C_{t+1})``.
    """
    clip_norm = finite_positive("clip_norm", clip_norm)
    g, z, noise_multiplier, expected_batch_size = _check_stateless_inputs(
        per_example_grads, noise, noise_multiplier, expected_batch_size, allow_empty
    )
    rule = _quantile_rule(dict(target_quantile=target_quantile, learning_rate=learning_rate,
                               count_noise_multiplier=count_noise_multiplier))  # fmt: skip
    sigma_b = count_noise_multiplier if count_noise_multiplier is not None else expected_batch_size / 20.0
    sigma_g = split_noise_multiplier(noise_multiplier, sigma_b)
    if noise_multiplier == 0.0:
        sigma_b = 0.0
    w = g / clip_norm
    norms = np.sqrt(np.sum(w * w, axis=1))
    noisy_count = float(np.sum((norms <= 1.0) - 0.5)) + sigma_b * float(count_noise)
    noisy_grad = clip_norm * (np.sum(_clip_rows_to_unit_norm(w), axis=0) + sigma_g * z) / expected_batch_size
    fraction = noisy_count / expected_batch_size + 0.5
    new_clip_norm = clip_norm * np.exp(-rule["learning_rate"] * (fraction - rule["target_quantile"]))
    return noisy_grad, float(new_clip_norm)


def automatic_clip_step(
    per_example_grads: np.ndarray,
    noise: np.ndarray,
    *,
    max_grad_norm: float = 1.0,
    stability: float = 0.01,
    noise_multiplier: float,
    expected_batch_size: float,
    allow_empty: bool = False,
) -> np.ndarray:
    """Automatic clipping (Bu et al. 2022): ``w_i = g_i/C`` normalised to
    ``w̄_i = w_i/(‖w_i‖ + γ)`` (norm < 1), ``g̃ = C·(Σ_i w̄_i + σz)/B̄``."""
    max_grad_norm = finite_positive("max_grad_norm", max_grad_norm)
    stability = finite_positive("stability", stability)
    g, z, noise_multiplier, expected_batch_size = _check_stateless_inputs(
        per_example_grads, noise, noise_multiplier, expected_batch_size, allow_empty
    )
    w = g / max_grad_norm
    norms = np.sqrt(np.sum(w * w, axis=1))
    w_bar = w / (norms + stability)[:, None]
    return max_grad_norm * (np.sum(w_bar, axis=0) + noise_multiplier * z) / expected_batch_size
