"""Validation of the JAX transformations' arguments and inputs, and the σ of each update.

Construction-time checks (``noise_multiplier``, ``expected_batch_size``), the per-update
resolution of σ (the ``noise_multiplier=`` keyword, a schedule's ``σ_t`` or the constant) with
its checks (a static σ raises before anything changes; a traced one cannot, and
:func:`_invalid_sigma_guard` turns its release into NaN instead), and the shape checks of
per-unit gradients, ``unit_mask`` and the state's ``extra`` that need no values, so they raise at
trace time under ``jax.jit``. :func:`check_inputs` is the eager, opt-in check that also reads
the values (NaN/inf). Everything here raises :class:`~adaclip.errors.InvalidHyperparameterError`
or :class:`~adaclip.errors.InvalidGradientError` and changes nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from adaclip import transform as _core_transform
from adaclip.errors import InvalidGradientError, InvalidHyperparameterError

__all__ = ["check_inputs"]

NoiseMultiplier = float | Callable[[jax.Array], Any]


def _validate_noise_multiplier(noise_multiplier: Any) -> NoiseMultiplier:
    if callable(noise_multiplier):
        return noise_multiplier
    try:
        x = float(noise_multiplier)
    except (TypeError, ValueError):
        raise InvalidHyperparameterError(
            f"noise_multiplier must be a number or a schedule (step -> σ), got {noise_multiplier!r}"
        ) from None
    if not math.isfinite(x) or x < 0:
        raise InvalidHyperparameterError(
            f"noise_multiplier must be finite and >= 0, got {noise_multiplier!r}"
        )
    return x


def _resolve_sigma(noise_multiplier: Any, sigma_default: NoiseMultiplier, step: jax.Array) -> Any:
    """σ of this update: the ``update`` keyword, else the schedule's ``σ_t``, else the constant.

    A Python number or a concrete (non-traced) array is validated here and raises
    :class:`InvalidHyperparameterError` before anything changes; a traced value cannot raise
    (see :func:`_invalid_sigma_guard`).
    """
    if noise_multiplier is None:
        return sigma_default(step) if callable(sigma_default) else sigma_default
    sigma = noise_multiplier
    if isinstance(sigma, (int, float, np.number)) and not isinstance(sigma, bool):
        return _validate_noise_multiplier(float(sigma))
    if not isinstance(sigma, jax.core.Tracer):
        _validate_noise_multiplier(np.asarray(sigma).item())  # concrete array: check it
    return sigma


def _invalid_sigma_guard(noisy: list[Any], sigma: Any) -> list[Any]:
    """The release, replaced by NaN where σ is not a finite number ``>= 0``.

    A traced σ (under ``jit``, or from a schedule) cannot raise, and a negative one would
    release noise of ``|σ|`` while an accountant might be told ``σ``. The step therefore
    releases NaN (a visibly failed step, nothing about the data), the statistics are kept
    (it is a non-finite release) and the key advances. A static σ was validated already.
    A traced σ that is valid but that the strategy's split cannot serve (the quantile rule's
    ``σ ≥ 2σ_b``) needs no guard here: the core's ``σ_g`` is then NaN, so is the release.
    """
    if isinstance(sigma, float):
        return noisy
    s = jnp.asarray(sigma)
    valid = jnp.isfinite(s) & (s >= 0)
    return [jnp.where(valid, x, jnp.full_like(x, jnp.nan)) for x in noisy]


def _sigma_used(sigma: Any) -> jax.Array:
    """σ of this update as the float32 scalar stored in ``last_noise_multiplier``."""
    return jnp.asarray(sigma, jnp.float32).reshape(())


def _check_noise_split(strategy: Any, sigma: Any, batch_size: float) -> None:
    """Raise :class:`InvalidHyperparameterError` now if the strategy cannot release at a
    *static* (Python or concrete) σ: ``strategy.noise_multipliers(σ, B̄)`` checks it (the
    quantile rule needs ``σ < 2σ_b`` to raise the gradient's multiplier to
    ``σ_g = (σ⁻² − (2σ_b)⁻²)^{-1/2}``). Called before anything changes. A traced σ is not
    checked: the core then returns ``σ_g = NaN`` and the release is NaN (state kept)."""
    if isinstance(sigma, jax.core.Tracer):
        return
    value = float(sigma) if isinstance(sigma, (int, float)) else float(np.asarray(sigma).reshape(()))
    if math.isfinite(value) and value >= 0:  # invalid values: _resolve_sigma / the guard
        strategy.noise_multipliers(value, batch_size)


def _validate_unit_mask(unit_mask: Any, n: int) -> jax.Array:
    """``unit_mask`` as a boolean ``(n,)`` array; anything else raises at trace time."""
    unit_mask = jnp.asarray(unit_mask)
    if unit_mask.dtype != jnp.bool_:
        raise InvalidGradientError(
            f"unit_mask must be a boolean array (True: the unit is present), got dtype "
            f"{unit_mask.dtype}; a numeric mask is ambiguous (0.5 would count as present), "
            "convert it explicitly, e.g. mask > 0"
        )
    if unit_mask.shape != (n,):
        raise InvalidGradientError(f"unit_mask has shape {unit_mask.shape}, expected ({n},)")
    return unit_mask


def _validate_batch_size(expected_batch_size: Any) -> float:
    try:
        x = float(expected_batch_size)
    except (TypeError, ValueError):
        raise InvalidHyperparameterError(
            f"expected_batch_size must be a number, got {expected_batch_size!r}"
        ) from None
    if not math.isfinite(x) or x <= 0:
        raise InvalidHyperparameterError(
            f"expected_batch_size must be finite and > 0, got {expected_batch_size!r}"
        )
    return x


def _static_checks(leaves: Sequence[Any], param_shapes: Sequence[tuple[int, ...]] | None) -> None:
    """Shape checks that need no values, so they raise at trace time even under ``jax.jit``."""
    if not leaves:
        raise InvalidGradientError("per-unit gradients are an empty pytree (no parameters)")
    if param_shapes is None:
        n = None
        for k, g in enumerate(leaves):
            if getattr(g, "ndim", 0) < 1:
                raise InvalidGradientError(
                    f"per-unit gradient leaf {k} is a scalar: a leading batch axis is required"
                )
            if n is None:
                n = g.shape[0]
            elif g.shape[0] != n:
                raise InvalidGradientError(
                    f"leaf {k} has {g.shape[0]} per-unit gradients, leaf 0 has {n}: "
                    "every leaf needs the same leading batch size"
                )
        return
    _core_transform.check_per_example_grads(leaves, param_shapes, allow_empty=True, check_finite=False)


def _flatten_against_params(updates: Any, params: Any) -> tuple[list[Any], Any, list[tuple[int, ...]] | None]:
    leaves, treedef = jax.tree_util.tree_flatten(updates)
    if params is None:
        return leaves, treedef, None
    p_leaves, p_treedef = jax.tree_util.tree_flatten(params)
    if p_treedef != treedef:
        raise InvalidGradientError(
            f"per-unit gradients have tree structure {treedef}, the parameters have {p_treedef}"
        )
    return leaves, treedef, [tuple(p.shape) for p in p_leaves]


def check_inputs(per_example_grads: Any, params: Any, *, allow_empty: bool = False) -> int:
    """Eager validation of per-unit gradients against the parameters; returns the batch size.

    Raises :class:`~adaclip.errors.InvalidGradientError` for a different tree structure, a
    missing leading batch axis, mismatched leading sizes or shapes, an empty batch (unless
    ``allow_empty``) and NaN/inf values. Call it outside ``jax.jit`` (it reads the values);
    inside ``jit`` the transformation does the shape checks at trace time only.

    This is the opt-in debugging mode for non-finite gradients: the transformation itself
    never raises on them (it drops such a unit from the sum, see :func:`private_aggregate`),
    because raising, like a NaN release, would reveal that a sampled unit had a bad gradient.
    Use it to find the cause while developing, on data whose privacy this does not concern.
    """
    leaves, _, shapes = _flatten_against_params(per_example_grads, params)
    return _core_transform.check_per_example_grads(leaves, shapes, allow_empty=allow_empty, check_finite=True)


def _check_extra(extra: Any, num_leaves: int) -> None:
    """The state's ``extra`` has one entry per leaf in each of its per-tensor lists."""
    if extra is None:
        return
    if not isinstance(extra, dict):
        raise InvalidGradientError(f"the state's extra must be a dict or None, got {type(extra).__name__}")
    for name, value in extra.items():
        if isinstance(value, (list, tuple)) and len(value) != num_leaves:
            raise InvalidGradientError(
                f"the state's extra[{name!r}] has {len(value)} entries for {num_leaves} parameter "
                "leaves: was the state initialised with these parameters?"
            )
