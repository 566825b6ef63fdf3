"""The parts of the adaptive transforms: centre, statistics, scale and clip radius.

:class:`adaclip.strategies.AdaptiveClipping` (in :mod:`adaclip.adaptive_strategy`) composes
one choice of each part; :class:`QuantileRule` (here, shared with
:class:`adaclip.strategies.QuantileClipping`) adapts the clip radius; the end of the module
holds the maths of AdaCliP's starting point (:func:`std_bounds_for_initial_clip`) and of
its noise drift (:func:`noise_drift_number`, with the warning the wrappers raise). Every part is
a small pure function of the strategy's state and of *released* values (or public data), so
each option keeps the privacy argument of the affine family: the centre ``a`` and scale ``b``
of step ``t`` are post-processing of the releases before ``t``.

Notation: ``g̃`` the released gradient, ``a`` the centre and ``b`` the scale step ``t`` used,
``σ`` the gradient's noise multiplier, ``B̄`` the expected batch size, so the noise in ``g̃``
has the known per-coordinate variance ``n = b²σ²/B̄²``.

**Centres** (``a_t``; ``m`` is the stored estimate):

- ``"none"``: ``a = 0``.
- ``"ema"`` (the patent): ``a = m``, ``m' = β₁m + (1−β₁)g̃``.
- ``"debiased"``: the same EMA, used as ``a = m/(1−β₁ᵗ)`` (``a = 0`` at ``t = 0``), so a long
  EMA (β₁ = 0.999) is not pulled towards its zero start.
- ``"kalman"``: a Kalman filter per coordinate for a random-walk mean ``μ_{t+1} = μ_t + η``
  observed as ``g̃ = μ_t + ε``: ``R = n`` (the mechanism's known noise variance),
  process variance ``Q = ρR``, ``P⁻ = P + Q``, gain ``K = P⁻/(P⁻ + R)``, ``m' = m + K(g̃ − m)``,
  ``P' = K·R``. The first release is taken whole (``K = 1``); with ``R = 0`` (σ = 0) ``K = 1``.
  With a constant ``R`` the gain settles at ``K* = (√(ρ² + 4ρ) − ρ)/2``: an EMA with weight
  ``K*``; the filter differs in its warm-up and when the noise level changes (a σ schedule,
  a scale that adapts).

**Statistics** (the spread that shapes ``b``; ``s`` is kept in ``[std_min, std_max]``):

- the per-coordinate signal ``x = g̃ − a`` (``"deviation"``, the patent) or ``x = g̃``
  (``"second_moment"``, scale-then-privatize);
- delayed by ``k`` (``update_every``): ``D = Σ x``, ``N = Σ n`` over the last ``k`` releases and,
  at the window's end, ``v = D²/k − N/k`` (the average's squared value minus its noise variance
  ``N/k²``, times ``k`` so that it targets the same quantity as ``k = 1``, ``v = x² − n``, when
  the window's signals are independent zero-mean fluctuations, as the deviation from the centre
  is meant to be; a persistent offset of the window is counted ``k`` times, as drift);
- the correction: ``"clamp"`` (the patent: ``v`` is clamped to ``[std_min², std_max²]`` before
  the EMA), ``"unbiased"`` (the EMA ``u`` of the unclamped ``v``, clamped once, at use) or
  ``"none"`` (the EMA of ``x²`` with no noise subtracted, clamped at use);
- the pooling, before the EMA: ``"coordinate"`` (the patent), ``"tensor"`` (the mean of ``v``
  over each tensor), ``"factored"`` (for a tensor with ≥ 2 axes seen as ``out × rest``: EMAs
  ``R`` of ``v``'s row means and ``K`` of its column means, estimate ``R⁺_i K⁺_j / mean(R⁺)``
  with ``x⁺ = max(x, 0)``: a factor below 0, which the unbiased correction allows, is a
  variance below the noise, taken as 0; ``R⁺ = 0`` gives 0, i.e. the floor ``std_min²``;
  tensors with fewer axes are pooled per tensor).

**Scales**: ``"coupled"`` (the patent, ``b = √s·√Σs``) or ``"separated"``,
``b = C_t·shape``, ``shape = s^p / mean(s^p)`` (mean over every coordinate of every tensor, so
equal statistics give flat clipping at ``C_t``), ``C_t`` fixed or adapted by the quantile rule.

**Quantile rule** (Andrew et al., *Differentially private learning with adaptive clipping*,
2021): each unit adds ``1[‖w_i‖ ≤ 1] − ½`` to a count released with noise ``N(0, σ_b²)``;
``f̃ = count/B̄ + ½`` and ``C_{t+1} = C_t·exp(−η(f̃ − γ))``. The count has sensitivity ½, so
with the gradient's noise multiplier raised to ``σ_g = (σ⁻² − (2σ_b)⁻²)^{-1/2}`` the pair is
one Gaussian mechanism with multiplier ``σ`` (what the accountant records).
"""

from __future__ import annotations

import dataclasses
import math
import sys
import warnings
from collections.abc import Sequence
from typing import Any

from adaclip import transform
from adaclip._array import namespace
from adaclip.errors import InvalidHyperparameterError, NoiseDominatedWarning
from adaclip.mechanism import _AffineDefaults, validate_mechanism
from adaclip.options import finite_positive, positive_int

Array = Any

CENTRES = ("none", "ema", "debiased", "kalman")
STATISTICS = ("deviation", "second_moment")
CORRECTIONS = ("clamp", "unbiased", "none")
POOLINGS = ("coordinate", "tensor", "factored")
SCALES = ("coupled", "separated")

__all__ = [
    "CENTRES",
    "STATISTICS",
    "CORRECTIONS",
    "POOLINGS",
    "SCALES",
    "noise_variance",
    "debiased_centre",
    "kalman_update",
    "factored_tensor",
    "pool",
    "pooled_ema",
    "estimate",
    "separated_scale",
    "tensor_value",
    "mean_square",
    "filled_like",
    "per_tensor_scale",
    "split_noise_multiplier",
    "quantile_update",
    "unclipped_indicator",
    "public_variance",
    "QuantileRule",
    "std_bounds_for_initial_clip",
    "CLAMPED_NOISE_FRACTION",
    "noise_drift_number",
    "warn_if_noise_dominated",
    "warn_of_noise_drift",
]


def _xp(*arrays: Any) -> Any:
    return namespace(*arrays)


def noise_variance(scale: Sequence[Any], noise_multiplier: Any, expected_batch_size: Any) -> list[Any]:
    """``n = b²σ²/B̄²`` per tensor: the variance the noise adds to each released coordinate."""
    factor = noise_multiplier * noise_multiplier / (expected_batch_size * expected_batch_size)
    return [b * b * factor for b in scale]


# --------------------------------------------------------------------------- centres


def debiased_centre(mean: Sequence[Array], step: Any, beta_mean: float) -> list[Array]:
    """``m/(1 − β₁ᵗ)`` (0 at ``t = 0``): an EMA started at 0, corrected for its start."""
    if isinstance(step, int):
        if step == 0:
            return [m * 0.0 for m in mean]
        factor = 1.0 / (1.0 - beta_mean**step)
        return [m * factor for m in mean]
    xp = _xp(*mean)
    t = xp.astype(step, mean[0].dtype) if hasattr(step, "dtype") else step
    denom = 1.0 - beta_mean**t
    factor = xp.where(step > 0, 1.0 / xp.where(step > 0, denom, xp.ones_like(denom)), xp.zeros_like(denom))
    return [m * factor for m in mean]


def kalman_update(
    mean: Sequence[Array],
    variance: Sequence[Array],
    released: Sequence[Array],
    noise_var: Sequence[Any],
    *,
    process_noise: float,
) -> tuple[list[Array], list[Array]]:
    """One Kalman step per coordinate (see the module doc). ``variance`` holds ``P``; a
    negative ``P`` marks "no observation yet" (the first release is taken whole)."""
    xp = _xp(*mean)
    new_mean, new_var = [], []
    for m, p, g, r in zip(mean, variance, released, noise_var, strict=True):
        r = r + xp.zeros_like(m)  # a float scale broadcasts to the tensor
        prior = p + process_noise * r
        denom = prior + r
        gain = xp.where(
            p < 0,
            xp.ones_like(m),
            xp.where(r > 0, prior / xp.where(denom > 0, denom, xp.ones_like(denom)), xp.ones_like(m)),
        )
        new_mean.append(m + gain * (g - m))
        new_var.append(gain * r)
    return new_mean, new_var


# --------------------------------------------------------------------------- statistics


def factored_tensor(x: Array) -> bool:
    """Whether ``x`` (a per-coordinate array shaped like a parameter) is pooled row × column
    under ``"factored"`` (two or more axes), rather than per tensor."""
    return x.ndim >= 2


def _as_matrix(x: Array, xp: Any) -> Array:
    return xp.reshape(x, (x.shape[0], -1))


def pool(v: Array, pooling: str) -> Any:
    """``v`` (one tensor's per-coordinate values) pooled: itself, its mean broadcast, or
    (factored) the pair ``(row means, column means)`` of the ``out × rest`` matrix."""
    xp = _xp(v)
    if pooling == "coordinate":
        return v
    if pooling == "factored" and factored_tensor(v):
        mat = _as_matrix(v, xp)
        return xp.mean(mat, axis=1), xp.mean(mat, axis=0)
    return xp.mean(v) + xp.zeros_like(v)


def pooled_ema(
    accumulator: Any, v: Array, *, pooling: str, beta: float, clamp: tuple[float, float] | None
) -> Any:
    """``β·acc + (1−β)·pool(v)`` with ``pool(v)`` clamped to ``clamp`` first (the patent's
    correction) or not (``None``). ``acc`` is an array, or a ``(rows, cols)`` pair when factored."""
    xp = _xp(v)
    pooled = pool(v, pooling)
    if isinstance(pooled, tuple):
        parts = pooled if clamp is None else tuple(xp.clip(p, min=clamp[0], max=clamp[1]) for p in pooled)
        return tuple(beta * a + (1.0 - beta) * p for a, p in zip(accumulator, parts, strict=True))
    if clamp is not None:
        pooled = xp.clip(pooled, min=clamp[0], max=clamp[1])
    return beta * accumulator + (1.0 - beta) * pooled


def estimate(accumulator: Any, shape: tuple[int, ...], clamp: tuple[float, float]) -> Array:
    """The clamped variance estimate per coordinate from an accumulator (an array, or the
    factored pair: ``R⁺_i K⁺_j / mean(R⁺)`` with ``x⁺ = max(x, 0)``, 0 where ``R⁺ = 0``).

    The factors are variances: under the unbiased correction an EMA can fall below 0 (a
    variance below the noise), which is taken as 0, so that two negative factors never make a
    positive estimate and ``mean(R) ≤ 0`` gives the floor ``std_min²`` (with the clamp
    correction the factors stay ``≥ std_min²`` and this is ``R_i K_j / mean(R)``)."""
    if isinstance(accumulator, tuple):
        rows, cols = accumulator
        xp = _xp(rows, cols)
        rows = xp.maximum(rows, xp.zeros_like(rows))
        cols = xp.maximum(cols, xp.zeros_like(cols))
        denom = xp.mean(rows)
        denom = xp.where(denom > 0, denom, xp.ones_like(denom))  # rows are all 0 there: the estimate is 0
        full = xp.reshape(rows[:, None] * cols[None, :] / denom, shape)
    else:
        xp = _xp(accumulator)
        full = accumulator
    return xp.clip(full, min=clamp[0], max=clamp[1])


def separated_scale(std: Sequence[Array], clip_norm: Any, power: float) -> list[Array]:
    """``b = C·s^p / mean(s^p)``, the mean over every coordinate of every tensor."""
    xp = _xp(*std)
    shaped = [s if power == 1.0 else (xp.sqrt(s) if power == 0.5 else s**power) for s in std]
    total = sum(xp.sum(x) for x in shaped)
    count = sum(math.prod(x.shape) for x in shaped)
    factor = clip_norm * count / total
    return [x * factor for x in shaped]


# --------------------------------------------------------------------------- one number per tensor
#
# Under ``pooling="tensor"`` every statistic is one number per tensor: ``s`` and the variance
# accumulator are uniform within each tensor (``init`` fills them, every update writes one pooled
# value). The functions below let a step read that number, pool the signal and build the scale
# without a pass over the tensor per arithmetic operation: the stored arrays are read at one
# coordinate and written once per step; the scale is one 0-d array per tensor, which the
# transform, the clipping (materialised and ghost) and the release broadcast as they do flat
# clipping's ``C``.


def tensor_value(x: Array) -> Array:
    """The one number of a tensor that is uniform (a 0-d array: ``x``'s first coordinate)."""
    xp = _xp(x)
    return xp.reshape(x, (-1,))[0]


def mean_square(x: Array) -> Array:
    """``mean(x²)`` over every coordinate of ``x`` (a 0-d array): one dot product, one pass."""
    xp = _xp(x)
    flat = xp.reshape(x, (-1,))
    return xp.vecdot(flat, flat) / flat.shape[0]


def filled_like(x: Array, value: Array) -> Array:
    """An array shaped and typed like ``x`` holding ``value`` (a 0-d array) everywhere, as a
    broadcast of the one number: NumPy and PyTorch store one element (a read-only view with
    stride 0), so keeping a statistic "per coordinate" costs neither memory nor a pass; a copy
    (:func:`copy.deepcopy`, ``clone``, a cast) is a full array again, with the same values.
    Under ``jax.jit`` XLA materialises the output as usual."""
    xp = _xp(x)
    return xp.broadcast_to(xp.astype(value, x.dtype), x.shape)


def per_tensor_scale(
    values: Sequence[Array], sizes: Sequence[int], *, scale: str, clip_norm: Any = None, power: float = 0.5
) -> list[Array]:
    """The scale ``b`` of tensors whose statistics ``s`` are one number each (``values``; ``sizes``
    their numbers of coordinates), one 0-d array per tensor: the same maths as
    :func:`adaclip.transform.auxiliary_scale` (``scale="coupled"``, ``b = √s·√Σs`` with ``Σs``
    over every coordinate, ``Σ_k n_k s_k``) and :func:`separated_scale` (``b = C·s^p/mean(s^p)``
    with ``mean(s^p) = Σ_k n_k s_k^p / Σ_k n_k``), without a pass over any tensor."""
    xp = _xp(*values)
    if scale == "coupled":
        root_total = xp.sqrt(sum(n * s for n, s in zip(sizes, values, strict=True)))
        return [xp.sqrt(s) * root_total for s in values]
    shaped = [s if power == 1.0 else (xp.sqrt(s) if power == 0.5 else s**power) for s in values]
    total = sum(n * x for n, x in zip(sizes, shaped, strict=True))
    factor = clip_norm * sum(sizes) / total
    return [x * factor for x in shaped]


def public_variance(per_example_grads: Sequence[Array]) -> list[Array]:
    """The per-coordinate variance of public per-example gradients (one ``(n, *shape)`` array
    per tensor, ``n ≥ 2``): ``Σ_i (g_i − ḡ)²/(n − 1)``. Public data costs no privacy."""
    xp = _xp(*per_example_grads)
    out = []
    for g in per_example_grads:
        n = g.shape[0]
        if n < 2:
            raise InvalidHyperparameterError(f"public statistics need at least 2 examples, got {n}")
        centred = g - xp.mean(g, axis=0)
        out.append(xp.sum(centred * centred, axis=0) / (n - 1))
    return out


# --------------------------------------------------------------------------- quantile rule


def split_noise_multiplier(noise_multiplier: Any, count_noise_multiplier: Any) -> Any:
    """``σ_g = (σ⁻² − (2σ_b)⁻²)^{-1/2}``, the gradient's multiplier when a count of
    sensitivity ½ is released with ``N(0, σ_b²)`` in the same step: the pair is then one
    Gaussian mechanism with multiplier ``σ``. Needs ``σ < 2σ_b``; ``σ = 0`` gives 0.

    Python numbers are checked and raise :class:`InvalidHyperparameterError`; arrays (a traced
    σ under ``jax.jit``) give NaN where ``σ ≥ 2σ_b``, which poisons the release instead.
    """
    if isinstance(noise_multiplier, (int, float)) and isinstance(count_noise_multiplier, (int, float)):
        sigma, sigma_b = float(noise_multiplier), float(count_noise_multiplier)
        if not math.isfinite(sigma) or sigma < 0:
            raise InvalidHyperparameterError(f"noise_multiplier must be finite and >= 0, got {noise_multiplier!r}")
        if sigma == 0.0:
            return 0.0
        if not sigma < 2.0 * sigma_b:
            raise InvalidHyperparameterError(
                f"the clip-count release needs noise_multiplier < 2·count_noise_multiplier, got "
                f"σ = {sigma:g} and σ_b = {sigma_b:g}: raise count_noise_multiplier (e.g. B̄/20)"
            )
        return (sigma**-2 - (2.0 * sigma_b) ** -2) ** -0.5
    xp = _xp(noise_multiplier, count_noise_multiplier)
    sigma = noise_multiplier + 0.0 * count_noise_multiplier
    safe = xp.where(sigma > 0, sigma, xp.ones_like(sigma))
    inner = safe**-2 - (2.0 * count_noise_multiplier) ** -2
    valid = xp.logical_and(xp.logical_and(inner > 0, sigma > 0), sigma < 2.0 * count_noise_multiplier)
    nan = xp.full_like(safe, float("nan"))
    return xp.where(sigma == 0, xp.zeros_like(safe), xp.where(valid, xp.where(valid, inner, xp.ones_like(inner)) ** -0.5, nan))


def unclipped_indicator(sq_norm: Array, radius: float, factors: Array) -> Array:
    """``1[‖w_i‖ ≤ r] − ½`` per unit from (upper bounds of) squared norms; 0 for a unit whose
    clip factor is 0 (dropped or masked), which stays inside the count's sensitivity ½."""
    xp = _xp(sq_norm, factors)
    inside = xp.astype(sq_norm <= radius * radius, sq_norm.dtype) - 0.5
    return xp.where(factors > 0, inside, xp.zeros_like(inside))


def quantile_update(
    clip_norm: Any, noisy_count: Any, *, expected_batch_size: Any, target_quantile: float, learning_rate: float
) -> Any:
    """``C' = C·exp(−η(f̃ − γ))`` with ``f̃ = count/B̄ + ½`` (the released, centred count)."""
    fraction = noisy_count / expected_batch_size + 0.5
    if isinstance(fraction, (int, float)) and isinstance(clip_norm, (int, float)):
        return clip_norm * math.exp(-learning_rate * (fraction - target_quantile))
    xp = _xp(clip_norm, fraction)
    return clip_norm * xp.exp(-learning_rate * (fraction - target_quantile))


@dataclasses.dataclass(frozen=True)
class QuantileRule(_AffineDefaults):
    """The quantile rule for the clip norm (Andrew et al., *Differentially private learning
    with adaptive clipping*, 2021): ``C_{t+1} = C_t·exp(−η(f̃_t − γ))``, ``f̃_t`` the released
    fraction of units whose transformed norm was at most 1 (unclipped).

    Each unit adds ``1[‖w_i‖ ≤ 1] − ½`` to a count released with noise ``N(0, σ_b²)``
    (sensitivity ½); the gradient's noise multiplier is raised to
    ``σ_g = (σ⁻² − (2σ_b)⁻²)^{-1/2}`` so that the gradient and the count together are one
    Gaussian mechanism with multiplier ``σ``, which is what the accountant records.

    Args:
      target_quantile: ``γ ∈ (0, 1)``, the fraction of units left unclipped at equilibrium.
      learning_rate: ``η > 0`` of the geometric update.
      count_noise_multiplier: ``σ_b`` in units of the count; ``None``: ``B̄/20`` (the paper's
        recommendation). Must exceed ``σ/2`` at every step.
    """

    target_quantile: float = 0.5
    learning_rate: float = 0.2
    count_noise_multiplier: float | None = None

    def __post_init__(self) -> None:
        q = finite_positive("target_quantile", self.target_quantile)
        if not 0.0 < q < 1.0:
            raise InvalidHyperparameterError(f"target_quantile must be in (0, 1), got {self.target_quantile!r}")
        object.__setattr__(self, "target_quantile", q)
        object.__setattr__(self, "learning_rate", finite_positive("learning_rate", self.learning_rate))
        if self.count_noise_multiplier is not None:
            object.__setattr__(
                self, "count_noise_multiplier", finite_positive("count_noise_multiplier", self.count_noise_multiplier)
            )

    def count_noise(self, expected_batch_size: Any) -> Any:
        """``σ_b``: the given one, or ``B̄/20``."""
        return expected_batch_size / 20.0 if self.count_noise_multiplier is None else self.count_noise_multiplier

    def noise_multipliers(self, noise_multiplier: Any, expected_batch_size: Any) -> tuple[Any, Any]:
        """``(σ_g, σ_b)`` (both 0 for ``σ = 0``); raises for ``σ ≥ 2σ_b`` (Python numbers)."""
        sigma_b = self.count_noise(expected_batch_size)
        sigma_g = split_noise_multiplier(noise_multiplier, sigma_b)
        if isinstance(noise_multiplier, (int, float)):
            return sigma_g, (0.0 if float(noise_multiplier) == 0.0 else sigma_b)
        return sigma_g, sigma_b * (noise_multiplier > 0)

    def count(self, sq_norms: Sequence[Array], factors: Sequence[Array]) -> Array:
        """``Σ_i (1[‖w_i‖ ≤ 1] − ½)`` over the units (0 for dropped or masked units), from the
        whole vector's squared-norm bound (enlarged for the rounding of the sum over tensors)."""
        total = sum(sq_norms[1:], sq_norms[0])
        total = total * (1.0 + 2.0 * len(sq_norms) * transform.unit_roundoff(total.dtype))
        xp = namespace(total)
        return xp.sum(unclipped_indicator(total, 1.0, factors[0]))

    def next_clip_norm(self, clip_norm: Any, noisy_count: Any, expected_batch_size: Any) -> Any:
        return quantile_update(
            clip_norm,
            noisy_count,
            expected_batch_size=expected_batch_size,
            target_quantile=self.target_quantile,
            learning_rate=self.learning_rate,
        )


# --------------------------------------------------------------------------- initial clip and noise drift


def std_bounds_for_initial_clip(
    initial_max_grad_norm: float, num_params: int, *, spread: float = 30.0
) -> tuple[float, float]:
    """``(std_min, std_max)`` for AdaCliP given the flat clip norm it should start from.

    At initialisation every ``s_j = s_0 = sqrt(std_min·std_max)``, so ``b_j = s_0·sqrt(d)``
    and clipping ``(g − 0)/b`` to norm 1 is clipping ``g`` to norm ``s_0·sqrt(d)``. Hence
    ``s_0 = C0/sqrt(d)``, ``std_min = s_0/spread`` and ``std_max = s_0·spread``. The bounds
    depend on ``d`` (``num_params``, all trainable coordinates): absolute bounds such as the
    defaults ``(1e-5, 1)`` mean a different initial clip norm for every model size.

    Args:
      initial_max_grad_norm: ``C0 > 0``, e.g. the ``max_grad_norm`` tuned for DP-SGD.
      num_params: ``d``, the number of coordinates AdaCliP covers.
      spread: ``≥ 1``; ``s`` stays within a factor ``spread`` of ``s_0`` either way.
    """
    c0 = finite_positive("initial_max_grad_norm", initial_max_grad_norm)
    positive_int("num_params", num_params)
    spread = finite_positive("spread", spread)
    if spread < 1:
        raise InvalidHyperparameterError(f"spread must be >= 1, got {spread!r}")
    s0 = c0 / math.sqrt(num_params)
    return s0 / spread, s0 * spread


#: ``E[(z² − 1)⁺] = 2φ(1)`` for ``z ~ N(0, 1)``: the part of the noise variance that the clamp in
#: step 7 keeps when the released deviation is noise alone.
CLAMPED_NOISE_FRACTION = 2.0 * math.exp(-0.5) / math.sqrt(2.0 * math.pi)


def noise_drift_number(num_params: int, noise_multiplier: float, expected_batch_size: float) -> float:
    """``κ = 2φ(1)·d·σ²/B̄²``: whether AdaCliP's std estimates can follow the gradients.

    Step 7 subtracts the noise variance ``b²σ²/B̄²`` from the squared released deviation, then
    clamps below at ``std_min²``. Where the noise dominates the deviation, the clamp keeps
    ``E[(z² − 1)⁺] = 2φ(1) ≈ 0.484`` of the noise variance, and with ``b_j² = s_j·Σs`` one
    step multiplies ``E[s_j²]`` by about ``1 + (1 − β2)(κ·Σs/(d·s_j) − 1)``. So with
    ``κ > 1`` the estimates grow geometrically on the noise alone (and the noise with them,
    through ``b``) until ``std_max`` stops them, fastest where ``s_j`` is smallest — which
    evens them out towards flat clipping; with ``κ < 1`` they decay towards ``std_min``
    unless the gradients hold them up. ``benchmarks/adaclip_drift.py`` checks this on the
    reference. Keeping ``κ`` below 1 means ``B̄ ≳ 0.7·σ·sqrt(d)``.
    """
    positive_int("num_params", num_params)
    sigma, bbar = validate_mechanism(noise_multiplier, expected_batch_size)
    return CLAMPED_NOISE_FRACTION * num_params * sigma**2 / bbar**2


# Frames a warning skips to reach the user's line. optax too: ``optax.chain(...).init`` calls
# the JAX transformation's init on the user's behalf.
_OWN_PACKAGES = ("adaclip", "adaclip_torch", "adaclip_jax", "optax")


def _caller_stacklevel() -> int:
    """``stacklevel`` of the first frame outside :data:`_OWN_PACKAGES` (the user's call)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] in _OWN_PACKAGES:
        frame, level = frame.f_back, level + 1
    return level


def warn_if_noise_dominated(num_params: int, noise_multiplier: float, expected_batch_size: float) -> float:
    """Return ``κ`` (:func:`noise_drift_number`) and warn with
    :class:`adaclip.errors.NoiseDominatedWarning` when ``κ > 1``.

    The AdaCliP wrappers call this once, when they are built (PyTorch) or initialised (JAX),
    with the first step's ``σ``; the warning points at the user's line. It reads only
    hyperparameters, never data.
    """
    kappa = noise_drift_number(num_params, noise_multiplier, expected_batch_size)
    if kappa > 1.0:
        need = math.ceil(math.sqrt(CLAMPED_NOISE_FRACTION * num_params) * float(noise_multiplier))
        warnings.warn(
            NoiseDominatedWarning(
                f"AdaCliP's noise drift number is {kappa:.3g} > 1 (d = {num_params}, "
                f"σ = {float(noise_multiplier):g}, B̄ = {float(expected_batch_size):g}): its std "
                "estimates will grow on the noise and stop following the gradients. In the "
                "benchmarks AdaCliP was behind flat clipping in nearly every such run; consider flat "
                f"clipping, or an expected batch size of at least {need} at this σ. "
                "See adaclip.strategies.noise_drift_number."
            ),
            stacklevel=_caller_stacklevel(),
        )
    return kappa


def warn_of_noise_drift(
    strategy: Any, num_params: int, noise_multiplier: float, expected_batch_size: float
) -> float | None:
    """:func:`warn_if_noise_dominated` where the strategy's clip level can follow the noise
    (``strategy.noise_drift_applies()``: AdaCliP's coupled scale ``b = √s·√Σs``); ``None``, and
    no check, for every other strategy (one without the method too). Returns ``κ`` otherwise."""
    applies = getattr(strategy, "noise_drift_applies", None)
    if applies is None or not applies():
        return None
    return warn_if_noise_dominated(num_params, noise_multiplier, expected_batch_size)
