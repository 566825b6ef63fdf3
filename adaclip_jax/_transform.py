"""The private aggregation step as an optax ``GradientTransformation``.

One implementation, :func:`private_aggregate`, serves the whole affine clipping family
(transform, clip, add noise once, transform back); :func:`adaclip`, :func:`flat_clip`,
:func:`per_layer_clip` and :func:`scaled_clip` only choose the core strategy. The maths is
:func:`adaclip.strategies.clip_and_sum` and :func:`adaclip.strategies.release`; this module
adds the optax plumbing (pytrees, PRNG keys and secure mode, dtypes, static checks, data
parallelism).

For a strategy with centre ``a`` and scale ``b`` (both functions of the state only), the
update that goes to the next transformation of the chain is

.. math::
    \\tilde g = b ⊙ \\frac{Σ_i \\bar w_i + σ_t z}{B̄} + a,\\qquad
    \\bar w_i = w_i·\\min(1, r/‖w_i‖),\\quad w_i = (g_i − a)/b,\\quad z \\sim N(0, I),

with the sum over the units of the batch (leading axis of the input), ``B̄`` the *expected*
batch size (never the realised one) and one ``z`` per step, drawn from a split of the key in
the state (in secure mode, of that key with fresh OS bits folded in). For AdaCliP,
``a = m_t`` and ``b = sqrt(s_t)·sqrt(Σ s_t)``, and ``(m, s)`` are then updated from ``g̃``
alone (post-processing); the options of :class:`adaclip.AdaptiveClipping` (see
:mod:`adaclip.adaptive`) change how ``a``, ``b`` and the statistics are formed, never this step.

A strategy may release *auxiliary* sums with the gradient (the quantile rule's count of
unclipped units, ``strategy.num_auxiliary`` 0-d sums). They are extra entries of the summed
list: summed (``psum``-ed) like the tensors, noised with their own 0-d draws, and the
gradient's noise multiplier is raised to ``σ_g`` so that the pair is one Gaussian mechanism
with multiplier ``σ`` (:meth:`adaclip.strategies.Strategy.noise_multipliers`). The state and
the accountant only ever see ``σ``.

This module is the core of the build: :class:`PrivateTransformation` and its strategy slot,
:func:`_build` (validation at construction, then ``init``/``update``), and one update split as
:func:`_clipped_sum` (not private) then :func:`_privatize` (the noise, added once). The pieces
around it have their own modules: the state types (:mod:`adaclip_jax._state`), keys and OS
entropy (:mod:`adaclip_jax._keys`), argument and σ validation (:mod:`adaclip_jax._validation`),
kernel dispatch (:mod:`adaclip_jax._kernel_dispatch`), banded noise (:mod:`adaclip_jax._banded`)
and the public constructors (:mod:`adaclip_jax._aliases`, which imports this module; the
package ``adaclip_jax`` exports them). The private helpers that moved are still importable from
here.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from adaclip import strategies as _strategies
from adaclip.adaptive import warn_of_noise_drift
from adaclip.correlated.mechanism import BandedNoise
from adaclip.errors import InvalidGradientError, InvalidHyperparameterError
from adaclip_jax import _position
from adaclip_jax._banded import (
    _check_banded,
    _check_buffers,
    _correlate,
    _noise_mechanism,
    _other_sigma_guard,
    _refuse_other_sigma,
    _variance_table,
)
from adaclip_jax._kernel_dispatch import (
    _fused_adaclip_step,
    _kernel_active,
    _validate_use_kernel,
)
from adaclip_jax._keys import (
    _canonical_key,
    _draw_noise,
    _validate_secure_mode,
    refresh_key,
)
from adaclip_jax._state import AdaClipState, ClippedSum, _find_states, _stat_dtype
from adaclip_jax._validation import (
    NoiseMultiplier,
    _check_extra,
    _check_noise_split,
    _flatten_against_params,
    _invalid_sigma_guard,
    _resolve_sigma,
    _sigma_used,
    _static_checks,
    _validate_batch_size,
    _validate_noise_multiplier,
    _validate_unit_mask,
    check_inputs,
)

__all__ = [
    "AdaClipState",
    "ClippedSum",
    "PrivateTransformation",
    "with_public_statistics",
    "check_inputs",
    "refresh_key",
]


class _StrategySlot:
    """The core strategy of a transformation: given at construction, or built on first use
    from the number ``d`` of parameter coordinates (``adaclip(initial_max_grad_norm=C0)``:
    :meth:`adaclip.AdaptiveClipping.from_initial_clip` needs ``d``, known at ``init``).

    ``probe`` is a strategy with every hyperparameter that does not depend on ``d`` (used for
    the construction-time checks: kernel eligibility, σ validity, the kind of strategy).
    """

    def __init__(self, strategy: Any = None, build: Callable[[int], Any] | None = None, probe: Any = None):
        self._strategy = strategy
        self._build = build
        self._num_params: int | None = None
        self.probe = strategy if probe is None else probe

    def resolve(self, num_params: int) -> Any:
        """The strategy for a model with ``num_params`` coordinates (built once, then fixed)."""
        if self._build is None:
            return self._strategy
        if self._strategy is None:
            self._strategy = self._build(num_params)
            self._num_params = num_params
        elif num_params != self._num_params:
            raise InvalidHyperparameterError(
                f"this transformation resolved its strategy for d = {self._num_params} parameter "
                f"coordinates (initial_max_grad_norm sets std_min/std_max from d), got d = "
                f"{num_params}: build one transformation per model"
            )
        return self._strategy

    @property
    def resolved(self) -> Any:
        if self._strategy is None:
            raise InvalidHyperparameterError(
                "this transformation's strategy depends on the number of parameters "
                "(initial_max_grad_norm): call tx.init(params) first"
            )
        return self._strategy


def _num_params(shapes: Sequence[tuple[int, ...]]) -> int:
    """``d``, the number of coordinates (at least 1, as the PyTorch plugin counts it)."""
    return max(1, sum(math.prod(s) for s in shapes))


class PrivateTransformation(optax.GradientTransformationExtraArgs):
    """An ``optax.GradientTransformationExtraArgs`` that also carries its core strategy.

    ``tx.strategy`` is the :class:`adaclip.strategies.Strategy` it clips with
    (:func:`adaclip_jax.clipped_sum_grads` clips with it). With
    ``adaclip(initial_max_grad_norm=C0)`` the strategy depends on the number of parameters
    ``d`` and exists once ``tx.init(params)`` (or a first ``update``) has run; reading
    ``tx.strategy`` before raises :class:`~adaclip.errors.InvalidHyperparameterError`.
    ``tx.strategy_for(d)`` gives it for ``d`` coordinates in every case.

    It must be the first transformation of its chain (:func:`adaclip_jax.private_chain`): its
    ``init`` and ``update`` raise :class:`~adaclip.errors.InvalidHyperparameterError` when
    another member of an enclosing ``optax.chain``/``optax.named_chain`` runs before them.
    """

    def _slot(self) -> _StrategySlot:
        slot = self.__dict__.get("_adaclip_slot")
        if slot is None:  # e.g. a copy made through the tuple protocol, which drops attributes
            raise InvalidHyperparameterError(
                "this PrivateTransformation carries no strategy: build it with adaclip_jax "
                "(adaclip, flat_clip, private_aggregate, ...)"
            )
        return slot

    @property
    def strategy(self) -> Any:
        return self._slot().resolved

    def strategy_for(self, num_params: int) -> Any:
        """The strategy for a model with ``num_params`` coordinates."""
        return self._slot().resolve(num_params)

    @property
    def expected_batch_size(self) -> float:
        """``B̄``, the expected number of units per step that the release divides by."""
        self._slot()  # the same error as for a copy without the transformation's attributes
        return self.__dict__["_adaclip_expected_batch_size"]

    @property
    def noise_mechanism(self) -> str:
        """``"independent"`` or ``"banded"`` (correlated noise, :mod:`adaclip.correlated`)."""
        self._slot()
        return "independent" if self.__dict__.get("_adaclip_noise_mechanism") is None else "banded"

    def with_public_statistics(self, state: Any, public_per_example_grads: Any, *, weight: float = 1.0) -> Any:
        """:func:`adaclip_jax.with_public_statistics` with this transformation."""
        return with_public_statistics(self, state, public_per_example_grads, weight=weight)


# --------------------------------------------------------------------------- public statistics


def with_public_statistics(
    tx: Any, state: Any, public_per_example_grads: Any, *, weight: float = 1.0
) -> Any:
    """``state`` with its statistics moved towards those of *public* per-example gradients.

    Calls :meth:`adaclip.AdaptiveClipping.with_public_statistics`: with ``v_pub`` the
    per-coordinate variance ``Σ_i (g_i − ḡ)²/(n − 1)`` of the public gradients, the variance
    EMA becomes ``(1 − weight)·old + weight·pool(v_pub)`` (clamped to
    ``[std_min², std_max²]``; pooled as the strategy pools). The centre (``mean``) and
    everything else are left alone. Public data costs no privacy; nothing private is read.
    Typical use: at initialisation (``weight=1``) with ``freeze_statistics=True`` and
    ``scale="separated"`` (the public spread then sets only the shape).

    Args:
      tx: the private transformation (:func:`adaclip`, :func:`scale_then_privatize`; its
        strategy must be an :class:`adaclip.AdaptiveClipping`), or such a core strategy.
      state: its :class:`AdaClipState`, or a pytree holding exactly one (an ``optax.chain``
        state); the same structure is returned.
      public_per_example_grads: the parameters' pytree with a leading batch axis ``n ≥ 2``
        on every leaf (e.g. :func:`adaclip_jax.per_example_grads` on public data).
      weight: in ``(0, 1]``.

    Pure (no side effects) and traceable: ``weight`` must be a Python number.
    """
    is_state = lambda x: isinstance(x, AdaClipState)  # noqa: E731
    found = _find_states(state)
    if len(found) != 1:
        raise InvalidHyperparameterError(
            f"with_public_statistics: the state holds {len(found)} AdaClipState(s), expected exactly one"
        )
    (own,) = found
    if own.std is None:
        raise InvalidHyperparameterError(
            "with_public_statistics: this state has no statistics (std): it needs an AdaptiveClipping state"
        )
    std = jax.tree_util.tree_leaves(own.std)
    d = _num_params([tuple(s.shape) for s in std])
    strategy = tx.strategy_for(d) if isinstance(tx, PrivateTransformation) else tx
    if not isinstance(strategy, _strategies.AdaptiveClipping):
        raise InvalidHyperparameterError(
            f"with_public_statistics needs an AdaptiveClipping strategy, got {type(strategy).__name__}"
        )
    leaves, treedef = jax.tree_util.tree_flatten(public_per_example_grads)
    if treedef != jax.tree_util.tree_structure(own.std):
        raise InvalidGradientError(
            "the public per-example gradients do not have the parameters' tree structure"
        )
    grads = [jnp.asarray(g).astype(s.dtype) for g, s in zip(leaves, std, strict=True)]
    mean = None if own.mean is None else jax.tree_util.tree_leaves(own.mean)
    _check_extra(own.extra, len(std))
    core = _strategies.ClipState(step=own.step, mean=mean, std=std, extra=own.extra)
    new = strategy.with_public_statistics(core, grads, weight=weight)
    updated = own._replace(
        std=jax.tree_util.tree_unflatten(treedef, [x.astype(s.dtype) for x, s in zip(new.std, std, strict=True)]),
        extra=None if own.extra is None else jax.tree_util.tree_map(lambda n, o: n.astype(o.dtype), new.extra, own.extra),
    )
    return jax.tree_util.tree_map(lambda x: updated if is_state(x) else x, state, is_leaf=is_state)


def _keep_if_finite(finite: Any, new: Any, old: Any) -> Any:
    """``where(finite, new, old)`` leaf by leaf (``None`` entries kept), in ``old``'s dtypes."""
    return jax.tree_util.tree_map(lambda n, o: jnp.where(finite, n, o).astype(o.dtype), new, old)


def _compile_eager_call(sigma_default: Any, noise_multiplier: Any, arguments: Any) -> bool:
    """Whether an ``update`` call runs compiled (``jax.jit``) rather than op by op.

    Called eagerly (no argument is a tracer), the update would dispatch a few hundred small
    operations one at a time — ~100 ms where the compiled update takes under a millisecond on
    a small MLP — so it runs the same function through ``jax.jit`` instead. Inside the user's
    own ``jit``/``scan``/``shard_map`` the arguments are tracers and nothing changes. The
    result is the same computation (XLA may fuse floating-point operations differently, as
    it does for any jitted step). Calls that pass ``noise_multiplier=`` or use a noise
    schedule stay eager, so that an invalid concrete σ still raises a clear error before
    anything changes (under ``jit`` it can only turn the release into NaN), and so does
    everything under ``jax.disable_jit()``.
    """
    if noise_multiplier is not None or callable(sigma_default):
        return False
    if jax.config.jax_disable_jit:
        return False
    return not any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree_util.tree_leaves(arguments))


# --------------------------------------------------------------------------- one update


@dataclasses.dataclass(frozen=True, eq=False)
class _Config:
    """What :func:`_build` fixed at construction (validated), read by every ``init``/``update``."""

    slot: _StrategySlot
    sigma_default: NoiseMultiplier
    batch_size: float
    use_kernel: bool | str
    secure_mode: bool
    axis_name: Any
    mechanism: BandedNoise | None
    variances: np.ndarray | None  # v_t of banded noise (:func:`_variance_table`), else None
    base_key: jax.Array


class _Inputs(NamedTuple):
    """One update's input, flattened (``jax.tree_util`` leaf order) and checked against the state."""

    pre_summed: bool  # a ClippedSum rather than per-unit gradients
    treedef: Any
    grads: list[Any]  # per-unit gradients (or a ClippedSum's sums) in the statistics' dtypes
    auxiliary: list[Any]  # a ClippedSum's auxiliary sums ([] for per-unit gradients)
    unit_shapes: list[tuple[int, ...]]  # the parameters' shapes
    out_dtypes: list[Any]  # the release's dtypes (the parameters', else the input's)
    stat_dtypes: list[Any]
    mean: list[Any] | None  # the state's statistics, flattened
    std: list[Any] | None
    unit_mask: Any  # validated boolean (n,) array, or None
    strategy: Any
    core_state: Any  # the state as the core's ClipState


class _Released(NamedTuple):
    """The noised release of one update, before the guards, and what it advanced."""

    noisy: list[Any]  # g̃, one array per leaf (statistics dtype)
    core: Any  # the core's new ClipState (kept only if the release is finite)
    key: jax.Array  # the next step's key
    buffers: Any  # the shifted banded-noise buffers (the state's own for independent noise)


def _flatten_updates(
    updates: Any, params: Any, unit_mask: Any, pre_summed: bool
) -> tuple[list[Any], Any, list[tuple[int, ...]]]:
    """``(leaves, treedef, parameter shapes)`` of per-unit gradients or of a ClippedSum's sums,
    with the checks that need no values (they raise at trace time)."""
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
        return leaves, treedef, [tuple(g.shape) for g in leaves]
    leaves, treedef, shapes = _flatten_against_params(updates, params)
    _static_checks(leaves, shapes)
    return leaves, treedef, [tuple(g.shape[1:]) for g in leaves]


def _check_auxiliary(auxiliary: Any, strategy: Any) -> list[Any]:
    """A ClippedSum's auxiliary sums: ``strategy.num_auxiliary`` 0-d arrays."""
    num_aux = getattr(strategy, "num_auxiliary", 0)
    auxiliary = list(auxiliary)
    if len(auxiliary) != num_aux or any(jnp.shape(x) != () for x in auxiliary):
        raise InvalidGradientError(
            f"ClippedSum has {len(auxiliary)} auxiliary sums of shapes "
            f"{[tuple(jnp.shape(x)) for x in auxiliary]}; the strategy releases {num_aux} "
            "0-d auxiliary sums: build it with clipped_sum_grads of this transformation"
        )
    return auxiliary


def _check_statistics(
    state: AdaClipState, treedef: Any, unit_shapes: list[tuple[int, ...]]
) -> tuple[list[Any] | None, list[Any] | None]:
    """The state's ``(mean, std)`` leaves, refused unless they fit the parameters."""
    mean = None if state.mean is None else jax.tree_util.tree_leaves(state.mean)
    std = None if state.std is None else jax.tree_util.tree_leaves(state.std)
    stats_tree = state.std if state.std is not None else state.mean
    stats = std if std is not None else mean
    if stats is not None and (
        jax.tree_util.tree_structure(stats_tree) != treedef
        or [tuple(m.shape) for m in stats] != unit_shapes
        or (mean is not None and [tuple(m.shape) for m in mean] != unit_shapes)
    ):
        raise InvalidGradientError(
            "the state's statistics do not match the per-unit gradients (tree structure or "
            "shapes): was the state initialised with these parameters?"
        )
    return mean, std


def _read_inputs(slot: _StrategySlot, updates: Any, state: AdaClipState, params: Any, unit_mask: Any) -> _Inputs:
    """Flatten and check one update's input against the parameters and the state, resolve the
    strategy, and cast the input to the statistics' dtypes (at least float32). Every check
    raises here, before any noise is drawn or any state changes."""
    pre_summed = isinstance(updates, ClippedSum)
    leaves, treedef, unit_shapes = _flatten_updates(updates, params, unit_mask, pre_summed)
    strategy = slot.resolve(_num_params(unit_shapes))
    auxiliary = _check_auxiliary(updates.auxiliary, strategy) if pre_summed else []
    if params is not None:
        out_dtypes = [jnp.result_type(p) for p in jax.tree_util.tree_leaves(params)]
    else:
        out_dtypes = [g.dtype for g in leaves]
    mean, std = _check_statistics(state, treedef, unit_shapes)
    _check_extra(state.extra, len(leaves))
    stats = std if std is not None else mean
    if stats is not None:
        stat_dtypes = [m.dtype for m in stats]
    else:
        stat_dtypes = [_stat_dtype(d) for d in out_dtypes]
    grads = [g.astype(dt) for g, dt in zip(leaves, stat_dtypes, strict=True)]
    core_state = _strategies.ClipState(step=state.step, mean=mean, std=std, extra=state.extra)
    if unit_mask is not None:
        unit_mask = _validate_unit_mask(unit_mask, grads[0].shape[0])
    return _Inputs(
        pre_summed, treedef, grads, auxiliary, unit_shapes, out_dtypes, stat_dtypes, mean, std, unit_mask,
        strategy, core_state,
    )  # fmt: skip


def _clipped_sum(inputs: _Inputs, axis_name: Any) -> ClippedSum:
    """``Σ_i w̄_i`` and the strategy's auxiliary sums of one update, summed over devices.

    Per-unit gradients go through the core's :func:`adaclip.strategies.clip_and_sum` (``K``
    clipped sums, then the auxiliary sums; masked-out units and units with a NaN/inf entry get
    the clip factor 0 and count in neither); a :class:`ClippedSum` input is already summed (its
    auxiliary sums are cast to the statistics' dtype). With ``axis_name`` every entry, the
    auxiliary sums too (one global count), is ``psum``-ed before the noise. Not private: the
    result only goes to :func:`_privatize`. Here ``summed`` is flat (one array per leaf).
    """
    if inputs.pre_summed:
        aux_dtype = jnp.result_type(*inputs.stat_dtypes)
        summed = inputs.grads + [jnp.asarray(x).astype(aux_dtype) for x in inputs.auxiliary]
    else:
        summed = _strategies.clip_and_sum(inputs.strategy, inputs.core_state, inputs.grads, unit_mask=inputs.unit_mask)
    if axis_name is not None:
        summed = jax.lax.psum(summed, axis_name)
    num = len(inputs.grads)
    return ClippedSum(summed=list(summed[:num]), auxiliary=tuple(summed[num:]))


def _privatize(clipped: ClippedSum, state: AdaClipState, sigma: Any, cfg: _Config, inputs: _Inputs) -> _Released:
    """The noise added once to the clipped sum, rescaled, and the statistics' update.

    One standard normal draw per entry of the summed list (:func:`adaclip_jax._keys._draw_noise`,
    leaf-shaped, then 0-d for the auxiliary sums); with banded noise the gradient's draws become
    ``x_t`` (:func:`adaclip_jax._banded._correlate`). The core's
    :func:`adaclip.strategies.release` computes ``b ⊙ (Σ w̄ + σ_g z)/B̄ + a`` and the new
    statistics from it; it is given the accounted σ and derives ``σ_g`` and ``σ_aux`` itself.
    """
    summed = list(clipped.summed) + list(clipped.auxiliary)
    shapes, dtypes = [tuple(x.shape) for x in summed], [x.dtype for x in summed]
    new_key, noise = _draw_noise(state.key, cfg.secure_mode, shapes, dtypes, sigma)
    new_buffers, release_extra = state.noise_buffers, {}
    if cfg.mechanism is not None and noise is not None:
        noise, new_buffers, release_extra = _correlate(
            cfg.mechanism, cfg.variances, state.step, state.noise_buffers, noise, len(clipped.summed)
        )
    noisy, new_core = _strategies.release(
        inputs.strategy,
        inputs.core_state,
        summed,
        noise,
        noise_multiplier=sigma,  # the accounted σ; the core derives σ_g and σ_aux
        expected_batch_size=cfg.batch_size,
        **release_extra,
    )
    return _Released(noisy, new_core, new_key, new_buffers)


def _privatize_fused(state: AdaClipState, sigma: Any, cfg: _Config, inputs: _Inputs, interpret: bool) -> _Released:
    """:func:`_clipped_sum` and :func:`_privatize` in one pass of the Pallas kernels
    (:func:`adaclip_jax._kernel_dispatch._fused_adaclip_step`): the same noise draws (one per
    leaf, leaf-shaped, in the statistics' dtypes), the same maths. Independent noise only."""
    shapes = [tuple(m.shape) for m in inputs.mean]
    new_key, noise = _draw_noise(state.key, cfg.secure_mode, shapes, inputs.stat_dtypes, sigma)
    noisy, new_core = _fused_adaclip_step(
        inputs.strategy, inputs.core_state, inputs.grads, inputs.unit_mask, noise, sigma, cfg.batch_size, interpret
    )
    return _Released(noisy, new_core, new_key, state.noise_buffers)


def _next_state(state: AdaClipState, inputs: _Inputs, released: _Released, sigma: Any) -> AdaClipState:
    """The state after one update. A non-finite release keeps every statistic (mean, std,
    extra) as it was and counts in ``nonfinite_steps``; the key and the step advance always."""
    finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in released.noisy]))
    unflatten = lambda xs: jax.tree_util.tree_unflatten(inputs.treedef, xs)  # noqa: E731
    mean, std, new_core = inputs.mean, inputs.std, released.core
    mean_tree = None if mean is None else unflatten(_keep_if_finite(finite, list(new_core.mean), mean))
    std_tree = None if std is None else unflatten(_keep_if_finite(finite, list(new_core.std), std))
    new_extra = None if state.extra is None else _keep_if_finite(finite, new_core.extra, state.extra)
    return AdaClipState(
        step=state.step + 1,
        key=released.key,
        mean=mean_tree,
        std=std_tree,
        nonfinite_steps=state.nonfinite_steps + jnp.where(finite, 0, 1).astype(jnp.int32),
        last_noise_multiplier=_sigma_used(sigma),  # σ, never σ_g: what is accounted
        seeded=state.seeded,
        extra=new_extra,
        noise_buffers=released.buffers,
    )


def _update_body(
    cfg: _Config,
    updates: Any,
    state: AdaClipState,
    params: Any = None,
    *,
    noise_multiplier: Any = None,
    unit_mask: Any = None,
) -> tuple[Any, AdaClipState]:
    """One ``update``: read and check the input, resolve σ (every check before anything
    changes), then :func:`_clipped_sum` and :func:`_privatize` (or the fused kernels), the
    invalid-σ guards, and the next state. Returns the release in the parameters' structure."""
    inputs = _read_inputs(cfg.slot, updates, state, params, unit_mask)
    sigma = _resolve_sigma(noise_multiplier, cfg.sigma_default, state.step)
    _check_noise_split(inputs.strategy, sigma, cfg.batch_size)  # before anything changes
    _check_buffers(state.noise_buffers, cfg.mechanism, inputs.unit_shapes)
    if cfg.mechanism is not None and noise_multiplier is not None:
        _refuse_other_sigma(sigma, cfg.sigma_default)

    fused, interpret = _kernel_active(cfg.use_kernel, inputs.strategy, cfg.axis_name)
    if fused and cfg.mechanism is None and not inputs.pre_summed and inputs.grads[0].shape[0] > 0:
        released = _privatize_fused(state, sigma, cfg, inputs, interpret)
    else:
        released = _privatize(_clipped_sum(inputs, cfg.axis_name), state, sigma, cfg, inputs)
    noisy = _invalid_sigma_guard(released.noisy, sigma)
    if cfg.mechanism is not None:
        noisy = _other_sigma_guard(noisy, sigma, cfg.sigma_default)
    released = released._replace(noisy=noisy)

    new_state = _next_state(state, inputs, released, sigma)
    out = [g.astype(dt) for g, dt in zip(noisy, inputs.out_dtypes, strict=True)]
    return jax.tree_util.tree_unflatten(inputs.treedef, out), new_state


def _init_state(cfg: _Config, params: Any) -> AdaClipState:
    """``init``: resolve the strategy from the parameters' size, warn when AdaCliP's coupled
    scale would be driven by the noise, and start the state (zero statistics templates in the
    statistics' dtypes, zero banded-noise buffers, the constructor's key)."""
    leaves, treedef = jax.tree_util.tree_flatten(params)
    strategy = cfg.slot.resolve(_num_params([tuple(jnp.shape(p)) for p in leaves]))
    sigma_default = cfg.sigma_default
    if not callable(sigma_default) and leaves:
        # κ from hyperparameters and shapes only (a schedule's σ_0 may be traced: skipped), and
        # only where the noise can drive the clip level (strategy.noise_drift_applies(): AdaCliP's
        # coupled scale; see noise_drift_number).
        warn_of_noise_drift(strategy, sum(math.prod(jnp.shape(p)) for p in leaves), sigma_default, cfg.batch_size)
    templates = [jnp.zeros(jnp.shape(p), _stat_dtype(jnp.result_type(p))) for p in leaves]
    mechanism = cfg.mechanism
    # a fresh zero array for every buffer (one array shared by all would be donated twice by
    # ``jax.jit(..., donate_argnums=...)``)
    buffers = None if mechanism is None else tuple(
        [jnp.zeros_like(t) for t in templates] for _ in range(mechanism.bands - 1)
    )
    core = strategy.init(templates)
    mean = None if core.mean is None else jax.tree_util.tree_unflatten(treedef, list(core.mean))
    std = None if core.std is None else jax.tree_util.tree_unflatten(treedef, list(core.std))
    return AdaClipState(
        step=jnp.zeros([], jnp.int32),
        key=cfg.base_key,
        mean=mean,
        std=std,
        nonfinite_steps=jnp.zeros([], jnp.int32),
        last_noise_multiplier=jnp.zeros([], jnp.float32),
        seeded=jnp.asarray(not cfg.secure_mode),
        extra=core.extra,
        noise_buffers=buffers,
    )


# --------------------------------------------------------------------------- the build


def _build(
    slot: _StrategySlot,
    *,
    noise_multiplier: NoiseMultiplier,
    expected_batch_size: float,
    key: Any,
    axis_name: Any,
    use_kernel: bool | str,
    secure_mode: bool,
    noise_mechanism: Any = "independent",
    bands: int | None = None,
) -> PrivateTransformation:
    """:func:`adaclip_jax.private_aggregate` for a strategy that may be resolved at ``init``
    (see :class:`_StrategySlot`): validate every argument now, then close ``init``/``update``
    over the result (:func:`_init_state`, :func:`_update_body`)."""
    sigma_default = _validate_noise_multiplier(noise_multiplier)
    use_kernel = _validate_use_kernel(use_kernel, slot.probe, axis_name)
    secure_mode = _validate_secure_mode(secure_mode, axis_name)
    batch_size = _validate_batch_size(expected_batch_size)
    if not callable(sigma_default):
        _check_noise_split(slot.probe, sigma_default, batch_size)
    mechanism = _noise_mechanism(noise_mechanism, bands)
    _check_banded(mechanism, sigma_default, axis_name, use_kernel)
    variances = None if mechanism is None else _variance_table(mechanism)  # may warn: stacklevel
    cfg = _Config(
        slot, sigma_default, batch_size, use_kernel, secure_mode, axis_name, mechanism, variances,
        _canonical_key(key, secure_mode),
    )  # fmt: skip

    def init_fn(params: Any) -> AdaClipState:
        _position.refuse_if_not_first("init")  # a transformation before this one: refused
        _position.refuse_if_wrapped("init")  # optax.MultiSteps around it: refused
        return _init_state(cfg, params)

    def update_fn(updates, state, params=None, *, noise_multiplier=None, unit_mask=None, **extra_args):
        del extra_args  # arguments meant for other transformations of the chain
        _position.refuse_if_not_first("update")  # before anything is read or changed
        _position.refuse_if_wrapped("update")
        if _compile_eager_call(sigma_default, noise_multiplier, (updates, state, params, unit_mask)):
            return compiled_update(updates, state, params, unit_mask)
        return _update_body(cfg, updates, state, params, noise_multiplier=noise_multiplier, unit_mask=unit_mask)

    # An eager call runs the update compiled (see _compile_eager_call); one compiled function
    # per transformation, retraced by jax.jit only when shapes, dtypes or structure change.
    compiled_update = jax.jit(
        lambda updates, state, params, unit_mask: _update_body(cfg, updates, state, params, unit_mask=unit_mask)
    )

    tx = PrivateTransformation(init_fn, update_fn)
    tx.__dict__["_adaclip_slot"] = slot
    tx.__dict__["_adaclip_expected_batch_size"] = batch_size
    tx.__dict__["_adaclip_noise_mechanism"] = mechanism
    return tx
