"""Parameter averaging for JAX: an EMA or tail average of a parameter pytree, jittable.

The average is of *parameters*, not of updates, so the primary API is a pair of pure functions
over an :class:`AveragingState` (jittable; the count is a traced ``int32`` scalar)::

    avg = adaclip_jax.parameter_averaging("ema", total_steps=steps)    # H = 10 % of the run
    avg_state = avg.init(params)
    # in the (jitted) train step, after params = optax.apply_updates(params, updates):
    avg_state = avg.update(avg_state, params)
    eval_params = adaclip_jax.averaged_params(avg_state)

For code that only threads an optax state, :func:`averaging_transformation` is the same average
as an optax ``GradientTransformation``: it returns the updates unchanged and keeps
``average(optax.apply_updates(params, updates))`` in its state. **It must be the last member of
the chain** (it sees the final updates, so it can form the new parameters), and the step must
apply them with ``optax.apply_updates``; ``adaclip_jax.averaged_params(opt_state)`` finds its
state in the chain's::

    tx = adaclip_jax.private_chain(adaclip_jax.flat_clip(...), optax.sgd(0.1),
                                   adaclip_jax.averaging_transformation("ema", horizon=100))

Maths (warm-up, tail average, default horizon) and the privacy argument: :mod:`adaclip.averaging`.
The average is post-processing of the released parameters (free in privacy); update it only
from parameters after a private step. Non-float leaves (integer counters in a params pytree) are
not averaged: the average holds their current value.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from adaclip.averaging import (
    AveragingConfig,
    averaging_weight,
    blend,
    config_from_spec,
    default_horizon,
)
from adaclip.errors import InvalidHyperparameterError

__all__ = [
    "AveragingState",
    "ParameterAveraging",
    "averaged_params",
    "averaging_transformation",
]


class AveragingState(NamedTuple):
    """The running average: ``average`` (a pytree like the parameters) and ``count``, the number
    of updates averaged so far (an ``int32`` scalar)."""

    average: Any
    count: jax.Array


class ParameterAveraging(NamedTuple):
    """What :func:`parameter_averaging` returns: pure ``init(params)`` and ``update(state, params)``."""

    init: Callable[[Any], AveragingState]
    update: Callable[[AveragingState, Any], AveragingState]
    config: AveragingConfig


def _config(
    kind: str | AveragingConfig,
    decay: float | None,
    horizon: float | None,
    start: int | None,
    warmup: bool,
    total_steps: int | None,
) -> AveragingConfig:
    if not isinstance(kind, str):
        # a config, a decay, a mapping: the plugin specification of adaclip.averaging.config_from_spec
        if (decay, horizon, start) != (None, None, None) or warmup is not True:
            raise InvalidHyperparameterError(
                f"give kind={kind!r} or the keywords decay/horizon/start/warmup, not both"
            )
        config = config_from_spec(kind, total_steps)
        if config is None:
            raise InvalidHyperparameterError("parameter_averaging(None): there is nothing to average")
        return config
    if kind == "ema" and decay is None and horizon is None:
        if total_steps is None:
            raise InvalidHyperparameterError(
                "an EMA needs decay, horizon or total_steps (for the default horizon, 10 % of the run)"
            )
        horizon = default_horizon(total_steps)
    if kind == "tail" and start is None and total_steps is not None:
        start = int(total_steps) - default_horizon(total_steps)
    return AveragingConfig(kind=kind, decay=decay, horizon=horizon, start=0 if start is None else start, warmup=warmup)


def _is_float(x: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def parameter_averaging(
    kind: str | AveragingConfig = "ema",
    *,
    decay: float | None = None,
    horizon: float | None = None,
    start: int | None = None,
    warmup: bool = True,
    total_steps: int | None = None,
) -> ParameterAveraging:
    """An EMA or tail average of a parameter pytree: pure ``init`` and ``update``, jittable.

    Args:
      kind: ``"ema"``, ``"tail"``, or (then without ``decay``/``horizon``/``start``/``warmup``)
        an :class:`adaclip.averaging.AveragingConfig`, a decay in ``[0, 1)`` or a mapping of
        its keywords (:func:`adaclip.averaging.config_from_spec`).
      decay: the EMA decay ``μ`` in ``[0, 1)``.
      horizon: the EMA horizon ``H`` in steps (``μ = 1 − 1/H``).
      start: the first averaged step (tail: its window; EMA: the warm-up counts from it).
        A tail average with ``total_steps`` and no ``start`` covers the last 10 % of the run.
      warmup: the EMA warm-up ``μ_t = min(μ, (1 + t)/(10 + t))``.
      total_steps: the planned number of steps; an EMA without ``decay`` or ``horizon`` spans
        :func:`adaclip.averaging.default_horizon` of it.

    Returns ``ParameterAveraging(init, update, config)``: ``init(params)`` is
    ``AveragingState(average=copy of params, count=0)``; ``update(state, params)`` blends the
    new parameters in and returns the new state (the weight comes from the traced count, so
    one compiled step serves the whole run). Float leaves keep their dtype (blended in at least float32).

    Raises:
      InvalidHyperparameterError: an invalid configuration (when called, not when traced).
    """
    config = _config(kind, decay, horizon, start, warmup, total_steps)

    def init(params: Any) -> AveragingState:
        average = jax.tree_util.tree_map(lambda p: jnp.array(p, copy=True), params)
        return AveragingState(average=average, count=jnp.zeros([], jnp.int32))

    def update(state: AveragingState, params: Any) -> AveragingState:
        w = averaging_weight(config, state.count, xp=jnp, dtype=jnp.result_type(float))

        def leaf(a: Any, p: Any) -> Any:
            p = jnp.asarray(p)
            if not _is_float(a):
                return p.astype(jnp.result_type(a))
            # blended in at least float32, so bf16/fp16 leaves keep a precise weight
            ct = jnp.promote_types(a.dtype, jnp.float32)
            return blend(a.astype(ct), p.astype(ct), w.astype(ct)).astype(a.dtype)

        average = jax.tree_util.tree_map(leaf, state.average, params)
        return AveragingState(average=average, count=state.count + 1)

    return ParameterAveraging(init=init, update=update, config=config)


def averaging_transformation(
    kind: str | AveragingConfig = "ema",
    *,
    decay: float | None = None,
    horizon: float | None = None,
    start: int | None = None,
    warmup: bool = True,
    total_steps: int | None = None,
) -> optax.GradientTransformation:
    """:func:`parameter_averaging` as the **last** member of an optax chain.

    ``update(updates, state, params)`` returns ``updates`` unchanged and a state whose average
    has blended in ``optax.apply_updates(params, updates)`` — the parameters the step is about
    to produce, if it applies the final updates with ``optax.apply_updates`` and nothing after
    this transformation changes them. ``params`` is required. Arguments as :func:`parameter_averaging`.
    """
    avg = parameter_averaging(kind, decay=decay, horizon=horizon, start=start, warmup=warmup, total_steps=total_steps)

    def init_fn(params: Any) -> AveragingState:
        return avg.init(params)

    def update_fn(updates: Any, state: AveragingState, params: Any = None) -> tuple[Any, AveragingState]:
        if params is None:
            raise InvalidHyperparameterError(
                "averaging_transformation needs params: call tx.update(updates, opt_state, params)"
            )
        return updates, avg.update(state, optax.apply_updates(params, updates))

    return optax.GradientTransformation(init_fn, update_fn)


def averaged_params(state: Any) -> Any:
    """The averaged parameters in ``state``: an :class:`AveragingState`, or an optax state
    (a chain's tuple, a ``named_chain``'s dict, …) holding exactly one.

    Raises:
      InvalidHyperparameterError: ``state`` holds no :class:`AveragingState`, or several.
    """
    if isinstance(state, AveragingState):
        return state.average
    found = [
        s
        for s in jax.tree_util.tree_leaves(state, is_leaf=lambda x: isinstance(x, AveragingState))
        if isinstance(s, AveragingState)
    ]
    if len(found) != 1:
        raise InvalidHyperparameterError(
            f"the state holds {len(found)} AveragingState(s); averaged_params needs exactly one "
            "(pass that AveragingState itself)"
        )
    return found[0].average
