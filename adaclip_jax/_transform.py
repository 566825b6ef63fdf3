"""The private aggregation step as an optax ``GradientTransformation``.

One implementation, :func:`private_aggregate`, serves the whole affine clipping family
(SPEC §3); :func:`adaclip`, :func:`flat_clip`, :func:`per_layer_clip` and :func:`scaled_clip`
only choose the core strategy. The maths is :func:`adaclip.strategies.clip_and_sum` and
:func:`adaclip.strategies.release`; this module adds the optax plumbing (pytrees, PRNG keys,
dtypes, static checks, data parallelism).

For a strategy with centre ``a`` and scale ``b`` (both functions of the state only), the
update that goes to the next transformation of the chain is

.. math::
    \\tilde g = b ⊙ \\frac{Σ_i \\bar w_i + σ_t z}{B̄} + a,\\qquad
    \\bar w_i = w_i·\\min(1, r/‖w_i‖),\\quad w_i = (g_i − a)/b,\\quad z \\sim N(0, I),

with the sum over the units of the batch (leading axis of the input), ``B̄`` the *expected*
batch size (never the realised one) and one ``z`` per step, drawn from a split of the key in
the state. For AdaCliP, ``a = m_t`` and ``b = sqrt(s_t)·sqrt(Σ s_t)``, and ``(m, s)`` are then
updated from ``g̃`` alone (post-processing).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from adaclip import strategies as _strategies
from adaclip import transform as _core_transform
from adaclip.errors import InvalidGradientError, InvalidHyperparameterError
from adaclip_jax import _kernel

__all__ = [
    "AdaClipState",
    "ClippedSum",
    "PrivateTransformation",
    "private_aggregate",
    "adaclip",
    "flat_clip",
    "per_layer_clip",
    "scaled_clip",
    "check_inputs",
]

NoiseMultiplier = float | Callable[[jax.Array], Any]


class AdaClipState(NamedTuple):
    """State of :func:`private_aggregate` (and of every transformation built on it).

    Attributes:
      step: int32 scalar, number of updates applied (non-finite releases included).
      key: the PRNG key of the *next* step's noise; split on every update, so it advances
        every step (also on a non-finite step).
      mean: AdaCliP's mean estimates ``m`` as a pytree with the parameters' structure
        (float32, or float64 for float64 parameters); ``None`` for stateless strategies.
      std: AdaCliP's std estimates ``s``, likewise.
      nonfinite_steps: int32 scalar, number of steps whose *released* gradient was not finite
        (NaN/inf in the input). On such a step ``mean``/``std`` are kept unchanged.
    """

    step: jax.Array
    key: jax.Array
    mean: Any
    std: Any
    nonfinite_steps: jax.Array


class ClippedSum(NamedTuple):
    """``Σ_i w̄_i``: per-unit gradients already transformed, clipped and summed (w-space),
    one array per parameter leaf, from :func:`adaclip_jax.clipped_sum_grads`.

    NOT private: it must only go to the ``update`` of the transformation whose state clipped
    it (in place of per-unit gradients), which adds the noise and rescales.
    """

    summed: Any


class PrivateTransformation(optax.GradientTransformationExtraArgs):
    """An ``optax.GradientTransformationExtraArgs`` that also carries its core ``strategy``
    (attribute ``strategy``), so :func:`adaclip_jax.clipped_sum_grads` can clip with it."""


# --------------------------------------------------------------------------- helpers


def _canonical_key(key: Any) -> jax.Array:
    if key is None:
        raise InvalidHyperparameterError(
            "key is required: pass a PRNG key such as jax.random.key(seed) for the noise"
        )
    if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
        return jax.random.key(int(key))
    if isinstance(key, jax.Array) and (
        jnp.issubdtype(key.dtype, jax.dtypes.prng_key) or (key.dtype == jnp.uint32 and key.shape == (2,))
    ):
        return key
    raise InvalidHyperparameterError(
        f"key must be a PRNG key (jax.random.key(seed)) or an int seed, got {key!r}"
    )


def _stat_dtype(dtype: Any) -> Any:
    """Statistics and the clipping maths run in at least float32 (float64 stays float64)."""
    return jnp.promote_types(dtype, jnp.float32)


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
    """
    leaves, _, shapes = _flatten_against_params(per_example_grads, params)
    return _core_transform.check_per_example_grads(leaves, shapes, allow_empty=allow_empty, check_finite=True)


def _masked_clip_and_sum(strategy: Any, state: Any, grads: list[Any], unit_mask: Any) -> list[Any]:
    """:func:`adaclip.strategies.clip_and_sum` with the clip factor of masked-out units set to 0.

    The same composition of core functions as ``clip_and_sum`` (transform, per-tensor clip
    factors, clipped sum); a unit with factor 0 contributes ``0·(g_i − a)/b = 0``. Masking the
    ``(n,)`` factors costs O(n), where masking the gradients would cost a pass over ``n·d``.
    """
    centre, scale = strategy.transform(state, len(grads))
    factors = _strategies.per_tensor_clip_factors(strategy, grads, centre, scale)
    keep = unit_mask.astype(bool)
    factors = [jnp.where(keep, c, jnp.zeros_like(c)) for c in factors]
    return _core_transform.clipped_sum(grads, centre, scale, factors)


def _validate_use_kernel(use_kernel: Any, strategy: Any, axis_name: Any) -> bool | str:
    if use_kernel is not True and use_kernel is not False and use_kernel != "auto":
        raise InvalidHyperparameterError(f'use_kernel must be True, False or "auto", got {use_kernel!r}')
    if use_kernel is True:
        if not isinstance(strategy, _strategies.AdaptiveClipping):
            raise InvalidHyperparameterError(
                "use_kernel=True is implemented for AdaptiveClipping only (the fused AdaCliP path)"
            )
        if axis_name is not None:
            raise InvalidHyperparameterError(
                "use_kernel=True fuses the sum with the noise, which axis_name (psum of the "
                "per-device sums before the noise) does not allow; use use_kernel=False"
            )
    return use_kernel


def _kernel_active(use_kernel: bool | str, strategy: Any, axis_name: Any) -> tuple[bool, bool]:
    """``(use the fused kernels, run them in interpret mode)`` for this trace."""
    on_gpu = jax.default_backend() == "gpu"
    if use_kernel == "auto":
        use = on_gpu and axis_name is None and isinstance(strategy, _strategies.AdaptiveClipping)
    else:
        use = bool(use_kernel)
    return use, not on_gpu


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
    scale from the state only (``strategy.transform``), clip factors from
    :func:`adaclip.transform.clip_factors` on the summed per-leaf squared norms, noise added
    once per coordinate to the clipped sum, divided by the expected batch size.
    """
    n = grads[0].shape[0]
    centre, scale = strategy.transform(core_state, len(grads))
    inv = [1.0 / b for b in scale]
    flat = [g.reshape(n, -1) for g in grads]
    sq = sum(
        _kernel.sq_norms(g, a.reshape(-1), u.reshape(-1), interpret=interpret)
        for g, a, u in zip(flat, centre, inv, strict=True)
    )
    ((_, radius),) = strategy.clip_groups(len(grads))
    factors = _core_transform.clip_factors(sq, radius)
    if unit_mask is not None:
        factors = jnp.where(unit_mask.astype(bool), factors, jnp.zeros_like(factors))
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
    new_core = _strategies.ClipState(step=core_state.step + 1, mean=new_mean, std=new_std)
    return noisy, new_core


# --------------------------------------------------------------------------- the transformation


def private_aggregate(
    strategy: Any,
    *,
    noise_multiplier: NoiseMultiplier,
    expected_batch_size: float,
    key: Any,
    axis_name: Any = None,
    use_kernel: bool | str = False,
) -> PrivateTransformation:
    """Privatise per-unit gradients with any strategy of the affine family.

    The input ``updates`` of ``update`` are per-unit gradients: the parameters' pytree with a
    leading batch axis on every leaf (e.g. from :func:`adaclip_jax.per_example_grads`). The
    output is the privatised gradient ``g̃`` (parameters' shapes, cast to the parameters'
    dtype, or to the input dtype when ``params`` is not passed), to be consumed by the rest of
    the chain. Put it first in an ``optax.chain``.

    Args:
      strategy: a core strategy (:class:`adaclip.AdaptiveClipping`, :class:`adaclip.FlatClipping`,
        :class:`adaclip.PerLayerClipping`, :class:`adaclip.ScaledClipping`). Per-tensor
        settings (``group_max_grad_norms``, ``layer_scales``) follow ``jax.tree_util`` leaf order.
      noise_multiplier: ``σ >= 0``, or a schedule ``step -> σ_t`` written with ``jnp`` (traced
        under ``jit``; ``step`` is the state's int32 counter; its values cannot be checked
        under ``jit``, so it must return ``σ_t >= 0``, and the accountant must be told the same
        ``σ_t``). It can be overridden per call with
        the ``noise_multiplier=`` keyword of ``update`` (an extra argument that ``optax.chain``
        forwards), which is how :class:`adaclip_jax.PrivacyTracker` passes ``σ_t``.
      expected_batch_size: ``B̄ > 0``, the *expected* number of units per step (``q·N`` under
        Poisson sampling). The sum is always divided by ``B̄``, never by the realised size.
      key: a PRNG key (``jax.random.key(seed)``) or an int seed. ``jax.random`` is not a
        cryptographically secure generator; for a formal guarantee against an adversary who
        could predict it, draw the seed from ``secrets``.
      axis_name: for data parallelism inside ``shard_map``/``pmap`` over the batch: each device
        clips and sums its shard, the sums are ``psum``-ed over ``axis_name``, and the noise is
        drawn from the (replicated) key, so every device adds the same ``z`` to the same global
        sum: noise is added exactly once.
      use_kernel: ``False`` (default here): the core's ``jnp`` path. ``True``: AdaCliP's fused
        Pallas kernels (:mod:`adaclip_jax._kernel`: per-unit transformed norms, then one pass
        for clipped sum + noise + rescale + moment update), in interpret mode off GPU (slow:
        for testing). ``"auto"``: the kernels on GPU only. Only for
        :class:`adaclip.AdaptiveClipping` and without ``axis_name``; a :class:`ClippedSum`
        input and an empty batch always take the ``jnp`` path. Results agree with the ``jnp``
        path up to float rounding, with the same noise draws.

    ``update(updates, state, params=None, *, noise_multiplier=None, unit_mask=None)``:
    ``updates`` may also be a :class:`ClippedSum` from :func:`adaclip_jax.clipped_sum_grads`
    (clipped and summed chunk by chunk with this state, memory ``O(chunk·d)``); the update
    then only adds the noise, rescales and updates the state.
    ``unit_mask`` is an optional boolean ``(n,)`` array marking the units that are present
    (padding rows, absent users, Poisson-sampled-out rows are ``False``); masked rows
    contribute nothing (their clip factor is set to 0; they must still be finite, as a
    ``0·NaN`` is NaN). It lets a Poisson-sampled batch be padded to a static shape.

    Non-finite input: under ``jit`` values cannot raise. A NaN/inf per-unit gradient makes the
    released ``g̃`` non-finite (the clip factor of that unit is NaN, or 0 times inf), so the
    update that goes down the chain is NaN — the failure stays visible. The strategy's state
    (``mean``, ``std``) is *not* updated on such a step (the decision uses only the released
    ``g̃``, so it is post-processing), ``nonfinite_steps`` counts it, and the key advances.
    To skip such steps, wrap the *rest* of the chain:
    ``optax.chain(adaclip(...), optax.apply_if_finite(optax.adam(...), max_consecutive_errors))``
    (wrapping the whole chain does not work: ``apply_if_finite`` returns zeros shaped like its
    per-unit input). Or call
    :func:`check_inputs` eagerly to get an :class:`~adaclip.errors.InvalidGradientError`.
    """
    sigma_default = _validate_noise_multiplier(noise_multiplier)
    use_kernel = _validate_use_kernel(use_kernel, strategy, axis_name)
    batch_size = _validate_batch_size(expected_batch_size)
    base_key = _canonical_key(key)

    def init_fn(params: Any) -> AdaClipState:
        leaves, treedef = jax.tree_util.tree_flatten(params)
        if isinstance(strategy, _strategies.AdaptiveClipping) and not callable(sigma_default) and leaves:
            # κ from hyperparameters and shapes only (a schedule's σ_0 may be traced: skipped).
            _strategies.warn_if_noise_dominated(
                sum(math.prod(jnp.shape(p)) for p in leaves), sigma_default, batch_size
            )
        templates = [jnp.zeros(jnp.shape(p), _stat_dtype(jnp.result_type(p))) for p in leaves]
        core = strategy.init(templates)
        mean = None if core.mean is None else jax.tree_util.tree_unflatten(treedef, list(core.mean))
        std = None if core.std is None else jax.tree_util.tree_unflatten(treedef, list(core.std))
        return AdaClipState(
            step=jnp.zeros([], jnp.int32),
            key=base_key,
            mean=mean,
            std=std,
            nonfinite_steps=jnp.zeros([], jnp.int32),
        )

    def update_fn(updates, state, params=None, *, noise_multiplier=None, unit_mask=None, **extra_args):
        del extra_args  # arguments meant for other transformations of the chain
        pre_summed = isinstance(updates, ClippedSum)
        if pre_summed:
            if unit_mask is not None:
                raise InvalidGradientError(
                    "unit_mask applies to per-unit gradients; pass it to clipped_sum_grads instead"
                )
            leaves, treedef, shapes = _flatten_against_params(updates.summed, params)
            if shapes is not None and [tuple(g.shape) for g in leaves] != shapes:
                raise InvalidGradientError(
                    f"ClippedSum has shapes {[tuple(g.shape) for g in leaves]}, the parameters {shapes}"
                )
            unit_shapes = [tuple(g.shape) for g in leaves]
        else:
            leaves, treedef, shapes = _flatten_against_params(updates, params)
            _static_checks(leaves, shapes)
            unit_shapes = [tuple(g.shape[1:]) for g in leaves]
        if params is not None:
            out_dtypes = [jnp.result_type(p) for p in jax.tree_util.tree_leaves(params)]
        else:
            out_dtypes = [g.dtype for g in leaves]

        mean = None if state.mean is None else jax.tree_util.tree_leaves(state.mean)
        std = None if state.std is None else jax.tree_util.tree_leaves(state.std)
        if mean is not None and (
            jax.tree_util.tree_structure(state.mean) != treedef
            or [tuple(m.shape) for m in mean] != unit_shapes
        ):
            raise InvalidGradientError(
                "the state's statistics do not match the per-unit gradients (tree structure or "
                "shapes): was the state initialised with these parameters?"
            )
        if mean is not None:
            stat_dtypes = [m.dtype for m in mean]
        else:
            stat_dtypes = [_stat_dtype(d) for d in out_dtypes]
        grads = [g.astype(dt) for g, dt in zip(leaves, stat_dtypes, strict=True)]
        core_state = _strategies.ClipState(step=state.step, mean=mean, std=std)

        if unit_mask is not None:
            unit_mask = jnp.asarray(unit_mask)
            if unit_mask.shape != (grads[0].shape[0],):
                raise InvalidGradientError(
                    f"unit_mask has shape {unit_mask.shape}, expected ({grads[0].shape[0]},)"
                )

        if noise_multiplier is not None:
            sigma = noise_multiplier
            if isinstance(sigma, (int, float, np.number)) and not isinstance(sigma, bool):
                sigma = _validate_noise_multiplier(float(sigma))
            elif not isinstance(sigma, jax.core.Tracer):
                _validate_noise_multiplier(np.asarray(sigma).item())  # concrete array: check it
        elif callable(sigma_default):
            sigma = sigma_default(state.step)
        else:
            sigma = sigma_default

        fused, interpret = _kernel_active(use_kernel, strategy, axis_name)
        fused = fused and not pre_summed and grads[0].shape[0] > 0
        if fused:
            summed_shapes = [tuple(m.shape) for m in mean]
        elif pre_summed:
            summed = grads
        elif unit_mask is None:
            summed = _strategies.clip_and_sum(strategy, core_state, grads)
        else:
            summed = _masked_clip_and_sum(strategy, core_state, grads, unit_mask)
        if not fused:
            if axis_name is not None:
                summed = jax.lax.psum(summed, axis_name)
            summed_shapes = [tuple(x.shape) for x in summed]
        noise_dtypes = stat_dtypes if fused else [x.dtype for x in summed]

        new_key, noise_key = jax.random.split(state.key)
        if isinstance(sigma, float) and sigma == 0.0:
            noise = None  # static σ = 0: nothing to draw
        else:
            keys = jax.random.split(noise_key, len(summed_shapes))
            noise = [
                jax.random.normal(k, shp, dt)
                for k, shp, dt in zip(keys, summed_shapes, noise_dtypes, strict=True)
            ]
        if fused:
            noisy, new_core = _fused_adaclip_step(
                strategy, core_state, grads, unit_mask, noise, sigma, batch_size, interpret
            )
        else:
            noisy, new_core = _strategies.release(
                strategy,
                core_state,
                summed,
                noise,
                noise_multiplier=sigma,
                expected_batch_size=batch_size,
            )

        finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in noisy]))
        if mean is not None:
            new_mean = [jnp.where(finite, n, o) for n, o in zip(new_core.mean, mean, strict=True)]
            new_std = [jnp.where(finite, n, o) for n, o in zip(new_core.std, std, strict=True)]
            mean_tree = jax.tree_util.tree_unflatten(treedef, new_mean)
            std_tree = jax.tree_util.tree_unflatten(treedef, new_std)
        else:
            mean_tree = std_tree = None
        new_state = AdaClipState(
            step=state.step + 1,
            key=new_key,
            mean=mean_tree,
            std=std_tree,
            nonfinite_steps=state.nonfinite_steps + jnp.where(finite, 0, 1).astype(jnp.int32),
        )
        out = [g.astype(dt) for g, dt in zip(noisy, out_dtypes, strict=True)]
        return jax.tree_util.tree_unflatten(treedef, out), new_state

    tx = PrivateTransformation(init_fn, update_fn)
    tx.strategy = strategy
    return tx


def adaclip(
    *,
    noise_multiplier: NoiseMultiplier,
    expected_batch_size: float,
    key: Any,
    std_min: float = 1e-5,
    std_max: float = 1.0,
    beta_mean: float = 0.99,
    beta_std: float = 0.9,
    axis_name: Any = None,
    use_kernel: bool | str = False,
) -> PrivateTransformation:
    """AdaCliP (SPEC §2): coordinate-wise adaptive clipping of per-unit gradients.

    .. math::
        b_t = \\sqrt{s_t}\\sqrt{Σ_j s_t[j]},\\quad w_i = (g_i − m_t)/b_t,\\quad
        \\tilde g_t = b_t ⊙ (Σ_i \\bar w_i + σ_t z)/B̄ + m_t,

    then ``v = clamp((g̃−m)² − b²σ²/B̄², s_min², s_max²)``, ``s ← sqrt(β2 s² + (1−β2) v)``,
    ``m ← β1 m + (1−β1) g̃``. Each step is the sampled Gaussian mechanism with sensitivity 1
    and noise multiplier ``σ_t`` (same accounting as DP-SGD). See :func:`private_aggregate`
    for the arguments, the state and the behaviour on bad input.

    Args:
      std_min: lower end of the range of the std estimates; ``s_0 = sqrt(std_min·std_max)``.
      std_max: upper end of that range.
      beta_mean: ``β1``, interpolation weight of the mean estimate.
      beta_std: ``β2``, interpolation weight of the variance estimate.
      use_kernel: ``False`` (default: the core ``jnp`` path), ``"auto"`` (fused Pallas
        kernels on GPU, the ``jnp`` path elsewhere) or ``True`` (kernels; interpret mode off
        GPU); see :func:`private_aggregate`. The default stays ``False`` until the kernels
        have been run on a GPU (they are tested in interpret mode only).
    """
    strategy = _strategies.AdaptiveClipping(
        std_min=std_min, std_max=std_max, beta_mean=beta_mean, beta_std=beta_std
    )
    return private_aggregate(
        strategy,
        noise_multiplier=noise_multiplier,
        expected_batch_size=expected_batch_size,
        key=key,
        axis_name=axis_name,
        use_kernel=use_kernel,
    )


def flat_clip(
    *,
    max_grad_norm: float,
    noise_multiplier: NoiseMultiplier,
    expected_batch_size: float,
    key: Any,
    axis_name: Any = None,
) -> PrivateTransformation:
    """DP-SGD (flat clipping): ``g̃ = (Σ_i g_i·min(1, C/‖g_i‖) + C·σ·z)/B̄``.

    Relation to ``optax.contrib.differentially_private_aggregate(l2_norm_clip, noise_multiplier,
    key)`` (optax 0.2.8): same clipping (global norm of each unit's gradient over all leaves)
    and the same noise standard deviation ``C·σ`` on the sum, but optax divides by the
    *realised* batch size ``n`` (the leading axis of the input), while this divides by the
    *expected* ``B̄`` — what the sampled-Gaussian accounting assumes (dividing by ``n`` leaks
    ``n`` under Poisson sampling). With ``expected_batch_size = n`` and the same inputs the
    two give the same result for ``σ = 0``; for ``σ > 0`` the distributions are the same but
    the draws differ (different key splitting). Argument names: ``l2_norm_clip`` is
    ``max_grad_norm`` here; optax's deprecated ``seed=`` is ``key=`` (an int is accepted).
    """
    return private_aggregate(
        _strategies.FlatClipping(max_grad_norm),
        noise_multiplier=noise_multiplier,
        expected_batch_size=expected_batch_size,
        key=key,
        axis_name=axis_name,
    )


def per_layer_clip(
    *,
    noise_multiplier: NoiseMultiplier,
    expected_batch_size: float,
    key: Any,
    max_grad_norm: float | None = None,
    group_max_grad_norms: Sequence[float] | None = None,
    axis_name: Any = None,
) -> PrivateTransformation:
    """Per-layer clipping (seed ``000``): each parameter leaf ``k`` clipped to ``C_k``.

    ``C = sqrt(Σ_k C_k²)``; the noise ``N(0, σ²C²)`` is added once to the sum. Without
    ``group_max_grad_norms`` (in ``jax.tree_util`` leaf order), ``C_k = max_grad_norm/√K``.
    """
    return private_aggregate(
        _strategies.PerLayerClipping(
            max_grad_norm=max_grad_norm,
            group_max_grad_norms=None if group_max_grad_norms is None else tuple(group_max_grad_norms),
        ),
        noise_multiplier=noise_multiplier,
        expected_batch_size=expected_batch_size,
        key=key,
        axis_name=axis_name,
    )


def scaled_clip(
    *,
    max_grad_norm: float,
    layer_scales: Sequence[float],
    noise_multiplier: NoiseMultiplier,
    expected_batch_size: float,
    key: Any,
    axis_name: Any = None,
) -> PrivateTransformation:
    """eDP-SGD scaling (seed ``003``): scale ``C·α_k`` on leaf ``k``, clip the whole vector.

    ``layer_scales`` (``α_k``, ``jax.tree_util`` leaf order) must come from public data or a
    privatised, accounted release (:mod:`adaclip.layer_scales`), never from private data in
    the clear.
    """
    return private_aggregate(
        _strategies.ScaledClipping(max_grad_norm, tuple(layer_scales)),
        noise_multiplier=noise_multiplier,
        expected_batch_size=expected_batch_size,
        key=key,
        axis_name=axis_name,
    )
