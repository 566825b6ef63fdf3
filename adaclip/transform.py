"""The transform–clip–noise–rescale path, written once for every array library.

Each function takes *lists of arrays*, one entry per parameter tensor (never one giant
flattened vector), and works on any namespace that follows the Python array API standard:
NumPy, PyTorch (through ``array-api-compat``) and ``jax.numpy`` (natively, also under
``jax.jit``). The PyTorch and JAX plugins call these functions; they do not re-derive the
maths. Every strategy of the affine family is "transform with centre ``a`` and scale
``b``, clip in groups, add noise once to the sum, transform back":

.. math::
    w_i = (g_i - a)/b,\\qquad \\bar w_i = w_i·\\min(1, r/‖w_i‖),\\qquad
    \\tilde g = b ⊙ (Σ_i \\bar w_i + σ z)/B̄ + a .

Per-unit gradients are arrays of shape ``(n, *param.shape)`` (leading batch axis). ``centre``
is ``None`` (zero) or a list of arrays shaped like the parameters; ``scale`` is a list whose
entries are arrays shaped like the parameters or Python floats (broadcast).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from adaclip._array import namespace
from adaclip.errors import InvalidGradientError

Array = Any  # an array of any array-API namespace
Scale = Any  # an Array or a Python float

__all__ = [
    "auxiliary_scale",
    "rounding_margin",
    "nested_rounding_margin",
    "transformed_sq_norms",
    "clip_factors",
    "clipped_sum",
    "drop_units",
    "nonfinite_units",
    "unit_roundoff",
    "noise_and_rescale",
    "update_moments",
    "check_per_example_grads",
]


def _batch_axes(x: Array) -> tuple[int, ...]:
    return tuple(range(1, x.ndim))


def auxiliary_scale(std: Sequence[Array]) -> list[Array]:
    """AdaCliP's transform (step 302): ``b = sqrt(s)·sqrt(Σ_j s_j)``, Σ over *all* tensors."""
    xp = namespace(*std)
    total = sum(xp.sum(s) for s in std)
    root_total = xp.sqrt(total)
    return [xp.sqrt(s) * root_total for s in std]


def _reciprocal(scale: Scale) -> Scale:
    """``1/b`` once per tensor, so the ``n·d`` elementwise work multiplies instead of divides."""
    return 1.0 / scale


def _sum_of_squares(w: Array, xp: Any) -> Array:
    """``Σ w²`` over every axis but the leading (batch) one: an ``(n,)`` array.

    For a tensor with at least two parameter axes whose last axis is long, the reduction runs
    in two stages: first over the middle axes (independent accumulators along the last axis,
    which XLA:CPU vectorises), then over the last axis as a contraction with a vector of ones
    (a ``tensordot``, which XLA does not merge back into the first reduction). A single fused
    reduction over all axes of an elementwise expression is a serial, unvectorised loop on
    XLA:CPU (jax 0.10), 1.5-4x slower. Only for JAX: NumPy is several times slower with the
    two-stage form (a middle-axis reduction) and PyTorch gains nothing. The two forms differ by
    floating-point summation order only.
    """
    sq = w * w
    if w.ndim == 1:
        return sq
    if w.ndim >= 3 and w.shape[-1] >= _LANES_MIN and _is_jax(xp):
        partial = xp.sum(sq, axis=tuple(range(1, w.ndim - 1)))
        ones = xp.ones((w.shape[-1],), dtype=w.dtype)  # JAX only: placed with its consumer
        return xp.tensordot(partial, ones, axes=1)
    return xp.sum(sq, axis=_batch_axes(w))


def _is_jax(xp: Any) -> bool:
    return getattr(xp, "__name__", "").startswith("jax")


# Shortest last axis for the two-stage reduction of _sum_of_squares (shorter ones gain nothing).
_LANES_MIN = 128


def unit_roundoff(dtype: Any) -> float:
    """``u = 2^-p`` of a floating-point dtype (half the machine epsilon): ``fl(x) = x(1 + δ)``,
    ``|δ| ≤ u`` for every correctly rounded operation."""
    import numpy as np

    try:
        return float(np.finfo(np.dtype(dtype)).eps) / 2.0
    except TypeError:  # a torch or JAX dtype NumPy does not know by name
        name = str(dtype).rsplit(".", 1)[-1]
        return float(np.finfo(np.dtype(name)).eps) / 2.0 if name != "bfloat16" else 2.0**-8


#: Terms a backend is assumed to add sequentially before combining partial sums (see
#: :func:`rounding_margin`); BLAS and reduction kernels block at or below this.
SEQUENTIAL_BLOCK = 512


def rounding_margin(dtype: Any, num_terms: int) -> float:
    """``η``: a bound on the relative rounding error of a sum of ``num_terms`` non-negative
    products computed in ``dtype``, so that ``S ≤ Ŝ·(1 + η)`` for the exact sum ``S``.

    .. math::
        η = \\frac{k_\\text{eff}\\,u}{1 - k_\\text{eff}\\,u},\\qquad
        k_\\text{eff} = \\min(k, B) + \\lceil k/B \\rceil + 2\\lceil \\log_2 k \\rceil + 12,

    with ``u`` the unit roundoff and ``B`` = :data:`SEQUENTIAL_BLOCK`: a blocked summation that
    adds at most ``B`` terms in sequence and then combines the block sums in sequence or as a
    tree (what NumPy's pairwise sum, PyTorch's cascade sum, XLA's reductions and blocked BLAS
    dot products do) has a relative error of at most ``(min(k, B) + ⌈k/B⌉ + 2⌈log₂ k⌉)·u`` on
    non-negative terms; 12 more ``u`` cover the rounding of the transform ``(g − a)·(1/b)``,
    the squares, and the clip factor's square root and division. Clip factors taken from
    ``Ŝ·(1 + η)`` can only over-clip (by at most a relative ``η/2`` in norm, about 1e-4 for a
    float32 tensor of 10⁶ entries), never under-clip.
    """
    k = max(1, int(num_terms))
    effective = min(k, SEQUENTIAL_BLOCK) + -(-k // SEQUENTIAL_BLOCK) + 2 * math.ceil(math.log2(k)) + 12
    x = effective * unit_roundoff(dtype)
    if x >= 0.5:
        raise ValueError(f"a sum of {k} terms in {dtype} has no useful rounding bound")
    return x / (1.0 - x)



def nested_rounding_margin(dtype: Any, *lengths: int) -> float:
    """The rounding margin the ghost-norm forms use for a nested reduction, one level per entry
    of ``lengths`` (e.g. a matrix product's inner sum of ``in`` terms, then a sum of ``out`` of
    them): ``η = Π_i (1 + η_i) − 1`` with ``η_i`` each level's :func:`rounding_margin`.

    Why the product: if every inner sum is computed as ``Ŝ_j ≥ S_j/(1 + η_1)`` and the outer sum
    of the ``Ŝ_j`` as ``Ŝ ≥ (Σ_j Ŝ_j)/(1 + η_2)``, then ``S = Σ_j S_j ≤ Ŝ·(1 + η_1)(1 + η_2)``,
    and so on for more levels. The sum ``Σ_i η_i`` alone would miss the cross terms
    ``η_i η_j`` (second order in the unit roundoff) and could under-clip by that much. The
    product is accumulated as ``η ← η + η_i + η·η_i`` (positive terms only): ``Π(1 + η_i) − 1``
    computed as written would cancel, in float64, below the levels' sum."""
    eta = 0.0
    for k in lengths:
        level = rounding_margin(dtype, k)
        eta = eta + level + eta * level
    return eta


def transformed_sq_norms(
    per_example_grads: Sequence[Array],
    centre: Sequence[Array] | None,
    scale: Sequence[Scale],
) -> list[Array]:
    """An upper bound of ``‖(g_i − a)/b‖²`` per tensor: a list of ``(n,)`` arrays, one per
    parameter tensor.

    Summing the list over a clip group gives (an upper bound of) that group's squared
    transformed norm. Computed as ``Σ ((g_i − a)·(1/b))²`` (one reciprocal per tensor, no
    per-unit division) without keeping the transformed vectors beyond the fused expression,
    then multiplied by ``1 + η`` (:func:`rounding_margin` of the tensor's size), so that
    rounding can only make a unit look larger: clipping may over-clip, never under-clip.
    A unit with a NaN/inf entry gets a non-finite value here (see :func:`clip_factors`).
    """
    xp = namespace(*per_example_grads)
    out = []
    for k, g in enumerate(per_example_grads):
        diff = g if centre is None else g - centre[k]
        w = diff * _reciprocal(scale[k])
        size = math.prod(g.shape[1:])
        out.append(_sum_of_squares(w, xp) * (1.0 + rounding_margin(g.dtype, size)))
    return out


def clip_factors(sq_norm: Array, radius: float = 1.0) -> Array:
    """``min(1, r/‖w‖)`` from (upper bounds of) squared norms, safe at ``‖w‖ = 0`` (step 306).

    A unit whose squared norm is not finite (a NaN/inf in its gradient, or an overflow) gets
    the factor 0: it contributes nothing, which keeps it within the sensitivity, and its
    presence cannot turn the release into NaN (:func:`clipped_sum` drops its entries).
    """
    xp = namespace(sq_norm)
    norm = xp.sqrt(sq_norm)
    tiny = xp.finfo(norm.dtype).tiny
    factor = xp.minimum(xp.ones_like(norm), radius / xp.maximum(norm, xp.full_like(norm, tiny)))
    return xp.where(xp.isfinite(norm), factor, xp.zeros_like(factor))


def drop_units(g: Array, factors: Array, *, nonfinite: Array | bool | None = None) -> Array:
    """``g`` with the rows of dropped units set to 0, so that ``c_i·g_i`` is exactly 0 for
    them (their entries may be NaN or inf, and ``0·NaN`` is NaN).

    Only rows with a NaN/inf entry need rewriting: a finite row with factor 0 (e.g. a unit
    masked out) already contributes 0. ``nonfinite`` (a boolean ``(n,)`` array: the units whose
    squared norm is not finite, which every unit with a NaN/inf entry is) says which rows those
    are (``False``: none, checked by the caller); without it every unit with factor ``c_i ≤ 0``
    is rewritten. Eager backends return ``g`` itself when no row needs it. JAX always selects
    (``where``, no ``lax.cond``): inside a jitted step XLA fuses the select into the fusion that
    produces the per-unit gradients (no extra pass), whereas a ``cond`` with ``g`` as operand
    makes XLA materialise ``g`` for the conditional and copy it (to another layout) in both
    branches, an extra read and write of the ``n·d`` gradients on every step. The values are
    the same either way."""
    if g.shape[0] == 0 or nonfinite is False:
        return g
    xp = namespace(g, factors)
    drop = xp.logical_not(factors > 0) if nonfinite is None else nonfinite
    shaped = xp.reshape(drop, (g.shape[0],) + (1,) * (g.ndim - 1))
    if not _is_jax(xp) and not bool(xp.any(drop)):
        return g
    return xp.where(shaped, xp.zeros_like(g), g)


def nonfinite_units(sq_norms: Sequence[Array]) -> Array:
    """The units (a boolean ``(n,)`` array) whose total squared norm over ``sq_norms`` is not
    finite: those with a NaN/inf entry (or an overflowing norm). They get the clip factor 0."""
    xp = namespace(*sq_norms)
    return xp.logical_not(xp.isfinite(sum(sq_norms[1:], sq_norms[0])))


def clipped_sum(
    per_example_grads: Sequence[Array],
    centre: Sequence[Array] | None,
    scale: Sequence[Scale],
    factors: Sequence[Array],
    *,
    nonfinite: Array | bool | None = None,
) -> list[Array]:
    """``Σ_i c_i (g_i − a)/b`` per tensor, with ``factors[k]`` the ``(n,)`` clip factors that
    apply to tensor ``k``. Uses ``(Σ_i c_i g_i − (Σ_i c_i) a)/b`` so the per-unit transformed
    vectors are never stored. Units with factor 0 contribute exactly 0, whatever their entries
    (:func:`drop_units`; ``nonfinite``, from :func:`nonfinite_units`, spares the rewrite of
    finite rows)."""
    xp = namespace(*per_example_grads)
    out = []
    for k, g in enumerate(per_example_grads):
        c = xp.astype(factors[k], g.dtype)
        weighted = xp.tensordot(c, drop_units(g, c, nonfinite=nonfinite), axes=1)
        if centre is not None:
            weighted = weighted - xp.sum(c) * centre[k]
        out.append(weighted / scale[k])
    return out


def noise_and_rescale(
    summed: Sequence[Array],
    noise: Sequence[Array] | None,
    centre: Sequence[Array] | None,
    scale: Sequence[Scale],
    *,
    noise_multiplier: float | Array,
    expected_batch_size: float | Array,
) -> list[Array]:
    """Steps 308–310: ``g̃ = b ⊙ (Σ_i w̄_i + σ z)/B̄ + a``.

    ``noise`` holds standard-normal draws shaped like the parameters (``None`` for σ = 0);
    the noise is added once, to the sum, and the sum is divided by the *expected* batch size.
    """
    out = []
    for k, s in enumerate(summed):
        w = s if noise is None else s + noise_multiplier * noise[k]
        g = scale[k] * (w / expected_batch_size)
        out.append(g if centre is None else g + centre[k])
    return out


def update_moments(
    noisy_grad: Sequence[Array],
    mean: Sequence[Array],
    std: Sequence[Array],
    scale: Sequence[Array],
    *,
    noise_multiplier: float | Array,
    expected_batch_size: float | Array,
    beta_mean: float,
    beta_std: float,
    std_min: float,
    std_max: float,
) -> tuple[list[Array], list[Array]]:
    """Steps 212–214 from the *released* gradient only (post-processing).

    ``v = clamp((g̃ − m)² − b²σ²/B̄², s_min², s_max²)``, ``s' = sqrt(β2 s² + (1−β2) v)``,
    ``m' = β1 m + (1−β1) g̃``; ``scale`` is the ``b`` used for this step.
    """
    xp = namespace(*noisy_grad)
    new_mean, new_std = [], []
    noise_var = noise_multiplier * noise_multiplier / (expected_batch_size * expected_batch_size)
    for g, m, s, b in zip(noisy_grad, mean, std, scale, strict=True):
        dev = g - m
        v = xp.clip(dev * dev - b * b * noise_var, min=std_min * std_min, max=std_max * std_max)
        new_std.append(xp.sqrt(beta_std * s * s + (1.0 - beta_std) * v))
        new_mean.append(beta_mean * m + (1.0 - beta_mean) * g)
    return new_mean, new_std


def check_per_example_grads(
    per_example_grads: Sequence[Array],
    param_shapes: Sequence[tuple[int, ...]],
    *,
    allow_empty: bool = False,
    check_finite: bool = True,
    names: Sequence[str] | None = None,
) -> int:
    """Validate per-unit gradients against the parameter shapes; return the batch size ``n``.

    Raises :class:`InvalidGradientError` for a wrong number of tensors, a missing or
    inconsistent leading batch axis, a shape mismatch, an empty batch (unless ``allow_empty``)
    or NaN/inf entries (unless ``check_finite`` is off, e.g. inside ``jax.jit`` where the
    values are not known; callers then document what happens). ``names`` (one per tensor,
    e.g. the model's parameter names) are used in the messages instead of "tensor k".
    """
    if len(per_example_grads) != len(param_shapes):
        raise InvalidGradientError(
            f"got per-unit gradients for {len(per_example_grads)} tensors, "
            f"expected {len(param_shapes)}"
        )

    def label(k: int) -> str:
        return f"parameter {names[k]!r}" if names is not None else f"tensor {k}"

    n = None
    for k, (g, shape) in enumerate(zip(per_example_grads, param_shapes)):
        shape = tuple(shape)
        if tuple(g.shape[1:]) != shape or g.ndim != len(shape) + 1:
            raise InvalidGradientError(
                f"per-unit gradient of {label(k)} has shape {tuple(g.shape)}; expected "
                f"(n, {', '.join(map(str, shape))}) with a leading batch axis"
            )
        if n is None:
            n = int(g.shape[0])
        elif int(g.shape[0]) != n:
            raise InvalidGradientError(
                f"{label(k)} has {int(g.shape[0])} per-unit gradients, {label(0)} has {n}: "
                "every tensor needs the same leading batch size"
            )
    n = 0 if n is None else n
    if n == 0 and not allow_empty:
        raise InvalidGradientError(
            "empty batch: no per-unit gradients (Poisson-sampled steps pass allow_empty=True "
            "and release noise only)"
        )
    if check_finite and n > 0:
        xp = namespace(*per_example_grads)
        for k, g in enumerate(per_example_grads):
            if not bool(xp.all(xp.isfinite(g))):
                raise InvalidGradientError(f"per-unit gradient of {label(k)} contains NaN or inf")
    return n
