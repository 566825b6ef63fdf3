"""When the JAX transformations use the fused Pallas kernels, and the fused AdaCliP step.

:mod:`adaclip_jax._kernel` holds the kernels themselves (per-unit transformed norms; clipped sum,
noise, rescale and moment update in one pass), which depend on nothing of the library but the
rounding bounds. This module is the policy around them: which strategies the kernels implement
(:func:`_kernel_eligible`: the patent's AdaCliP only), which ``use_kernel=`` values are accepted
where (:func:`_validate_use_kernel`: ``True`` is refused with ``axis_name``), whether a trace
takes them (:func:`_kernel_active`: ``True`` always, ``"auto"`` compiled on a GPU only),
and the step that replaces the core's ``clip_and_sum`` + ``release`` when it does
(:func:`_fused_adaclip_step`, same maths and same noise draws). Kept apart from the kernels so
that :mod:`adaclip_jax._kernel` stays a leaf that benchmarks can exercise on its own.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from adaclip import strategies as _strategies
from adaclip.errors import InvalidHyperparameterError
from adaclip_jax import _kernel


def _kernel_eligible(strategy: Any) -> bool:
    """Whether the fused kernels implement ``strategy``: the patent's AdaCliP only (every
    option at its default, :attr:`adaclip.AdaptiveClipping.is_patent`, and so no auxiliary
    release); the other options and strategies take the core's ``jnp`` path."""
    return (
        isinstance(strategy, _strategies.AdaptiveClipping)
        and strategy.is_patent
        and getattr(strategy, "num_auxiliary", 0) == 0
    )


def _validate_use_kernel(use_kernel: Any, strategy: Any, axis_name: Any) -> bool | str:
    if use_kernel is not True and use_kernel is not False and use_kernel != "auto":
        raise InvalidHyperparameterError(f'use_kernel must be True, False or "auto", got {use_kernel!r}')
    if use_kernel is True:
        if not _kernel_eligible(strategy):
            raise InvalidHyperparameterError(
                "use_kernel=True is implemented for the patent's AdaptiveClipping only (the fused "
                "AdaCliP path: every option at its default, AdaptiveClipping.is_patent); other "
                "strategies and options take the jnp path (use_kernel=False or \"auto\")"
            )
        if axis_name is not None:
            raise InvalidHyperparameterError(
                "use_kernel=True fuses the sum with the noise, which axis_name (psum of the "
                "per-device sums before the noise) does not allow; use use_kernel=False"
            )
    return use_kernel


def _kernel_active(use_kernel: bool | str, strategy: Any, axis_name: Any) -> tuple[bool, bool]:
    """``(use the fused kernels, run them in interpret mode)`` for this trace."""
    # "auto" takes the kernels compiled on a GPU (on an H200 they matched the jnp reference on
    # every checked shape and ran its release in 0.52-0.97x the time); off GPU the kernels only
    # run in Pallas's interpreter, a correctness tool, so "auto" takes the jnp path there.
    on_gpu = jax.default_backend() == "gpu"
    auto = use_kernel == "auto" and on_gpu and axis_name is None
    use = (use_kernel is True or auto) and _kernel_eligible(strategy)
    return use, not on_gpu


def _fused_clip_factors(
    strategy: Any,
    flat: list[Any],
    centre: list[Any],
    inv: list[Any],
    unit_mask: Any,
    interpret: bool,
) -> Any:
    """The ``(n,)`` clip factors of the fused path, from upper bounds of the squared norms.

    Each leaf's kernel sum ``Ŝ_k`` is enlarged to ``Ŝ_k·(1 + η_k)`` with
    :func:`adaclip_jax._kernel.sq_norms_margin` (the kernel's own blocking), and the leaves
    are combined by :func:`adaclip.strategies.group_clip_factors` (which enlarges their sum by
    ``2K·u`` and gives factor 0 to a non-finite total), as on the ``jnp`` path: rounding can
    only over-clip, never under-clip, and a unit with a NaN/inf entry gets factor 0. Masked-out
    units get factor 0 too; the release kernel skips every row with factor 0.
    """
    sq = [
        _kernel.sq_norms(g, a.reshape(-1), u.reshape(-1), interpret=interpret)
        * (1.0 + _kernel.sq_norms_margin(g.dtype, g.shape[1]))
        for g, a, u in zip(flat, centre, inv, strict=True)
    ]
    factors = _strategies.group_clip_factors(strategy, sq)[0]  # one group: every leaf
    if unit_mask is not None:
        factors = jnp.where(unit_mask, factors, jnp.zeros_like(factors))
    return factors


def _fused_adaclip_step(
    strategy: Any,
    core_state: Any,
    grads: list[Any],
    unit_mask: Any,
    noise: list[Any] | None,
    sigma: Any,
    batch_size: float,
    interpret: bool,
) -> tuple[list[Any], Any]:
    """AdaCliP's step with the Pallas kernels of :mod:`adaclip_jax._kernel`.

    Same maths and same noise draws as ``clip_and_sum`` + ``release`` of the core: centre and
    scale from the state only (``strategy.transform``), clip factors from upper bounds of the
    per-unit squared norms (:func:`_fused_clip_factors`), units with factor 0 (masked out, or
    with a NaN/inf entry) contributing exactly 0, noise added once per coordinate to the
    clipped sum, divided by the expected batch size.
    """
    n = grads[0].shape[0]
    centre, scale = strategy.transform(core_state, len(grads))
    inv = [1.0 / b for b in scale]
    flat = [g.reshape(n, -1) for g in grads]
    factors = _fused_clip_factors(strategy, flat, centre, inv, unit_mask, interpret)
    noisy, new_mean, new_std = [], [], []
    for k, g in enumerate(flat):
        out = _kernel.clip_noise_update(
            g,
            factors,
            centre[k].reshape(-1),
            scale[k].reshape(-1),
            inv[k].reshape(-1),
            None if noise is None else noise[k].reshape(-1),
            core_state.std[k].reshape(-1),
            noise_multiplier=sigma,
            expected_batch_size=batch_size,
            beta_mean=strategy.beta_mean,
            beta_std=strategy.beta_std,
            std_min=strategy.std_min,
            std_max=strategy.std_max,
            interpret=interpret,
        )
        shape = centre[k].shape
        noisy.append(out[0].reshape(shape))
        new_mean.append(out[1].reshape(shape))
        new_std.append(out[2].reshape(shape))
    new_core = _strategies.ClipState(step=core_state.step + 1, mean=new_mean, std=new_std, extra=core_state.extra)
    return noisy, new_core
