"""The state types of the JAX transformations: what an ``update`` carries from step to step.

:class:`AdaClipState` is the optax state of :func:`adaclip_jax.private_aggregate` (and of every
transformation built on it): the step counter, the noise key, AdaCliP's statistics, the core's
option state and the banded-noise buffers, with which parts are secret and which are functions
of released values. :class:`ClippedSum` is the not-yet-private clipped sum that
:func:`adaclip_jax.clipped_sum_grads` hands to ``update`` in place of per-unit gradients.
:func:`_find_states` locates the states inside a larger optimizer state (an ``optax.chain``
state, a checkpoint); :func:`_stat_dtype` is the dtype the statistics are kept in.

Nothing here computes a release: the build of the transformation is :mod:`adaclip_jax._transform`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

__all__ = ["AdaClipState", "ClippedSum"]


class AdaClipState(NamedTuple):
    """State of :func:`private_aggregate` (and of every transformation built on it).

    Attributes:
      step: int32 scalar, number of updates applied (non-finite releases included).
      key: the PRNG key of the *next* step's noise; split on every update, so it advances
        every step (also on a non-finite step). **Secret in seeded mode**: it determines the
        noise of every later step (see "Checkpoints" in :func:`private_aggregate`). In secure
        mode it does not predict the noise (each step also folds in fresh OS bits).
      mean: AdaCliP's mean (centre) estimates ``m`` as a pytree with the parameters' structure
        (float32, or float64 for float64 parameters); ``None`` for stateless strategies and
        for ``centre="none"``. A function of earlier releases only (post-processing), not
        secret beyond them.
      std: AdaCliP's std estimates ``s``, likewise (``None`` for strategies without them).
      nonfinite_steps: int32 scalar, number of steps whose *released* gradient was not finite
        (e.g. a NaN, infinite or negative traced σ, or a traced σ the quantile rule's split
        cannot serve; a NaN/inf per-unit gradient does *not* make the release non-finite,
        that unit is dropped). A function of the released values only. On such a step
        ``mean``/``std``/``extra`` are kept unchanged.
      last_noise_multiplier: float32 scalar, the σ that the last update used (0 before the
        first update, and for a static σ = 0), the value given by the ``noise_multiplier=``
        keyword of ``update``, the schedule's ``σ_t``, or the constructor's σ. This is the
        *accounted* σ of the whole release, not the gradient's raised ``σ_g`` when a strategy
        releases an auxiliary count (quantile rule). :class:`adaclip_jax.PrivacyTracker` reads
        it to record the σ actually used.
      seeded: bool scalar, ``True`` in seeded mode (the noise is a function of ``key``),
        ``False`` in secure mode. :class:`adaclip_jax.PrivacyTracker` warns when a seeded
        state's key is used a second time (a restored or reused state replays its noise).
      extra: the core's option state (:attr:`adaclip.strategies.ClipState.extra`), ``None``
        for strategies and options without one. Unlike ``mean``/``std`` it keeps the core's
        *flat* layout: a dict whose values are lists with one entry per parameter leaf in
        ``jax.tree_util`` leaf order (an array, or ``None`` where the entry does not apply, e.g.
        ``"variance"`` of a factored matrix) or 0-d arrays (``"window_count"``,
        ``"clip_norm"``: the quantile rule's ``C_t``). A function of released values only,
        like ``mean``/``std``. Last, with a default, so states built by keyword without it
        stay valid.
      noise_buffers: ``None`` for independent noise (DP-SGD, and ``b = 1``). With banded noise
        (``noise_mechanism="banded"``, ``b > 1`` bands) a tuple of ``b − 1`` buffers, the last
        noise vectors ``x_{t−1}, x_{t−2}, …`` (most recent first), each a list with one array
        per parameter leaf (``jax.tree_util`` leaf order, the leaf's shape, the statistics
        dtype); zeros at ``init`` (which makes the first steps exact: a missing ``x_{t−j}`` is
        0). Shifted on every update, so the shapes never change under ``jit``; the stream's
        position is ``step``. **Secret, like the key, in both modes**: they are past noise, and
        subtracting them from past releases gives past clipped sums. A restored state carries
        its buffers (and its ``step``): restore them together, never one without the other.
        Last, with a default, so states built by keyword without it stay valid.
    """

    step: jax.Array
    key: jax.Array
    mean: Any
    std: Any
    nonfinite_steps: jax.Array
    last_noise_multiplier: jax.Array
    seeded: jax.Array
    extra: Any = None
    noise_buffers: Any = None


class ClippedSum(NamedTuple):
    """``Σ_i w̄_i``: per-unit gradients already transformed, clipped and summed (w-space),
    one array per parameter leaf, from :func:`adaclip_jax.clipped_sum_grads`.

    NOT private: it must only go to the ``update`` of the transformation whose state clipped
    it (in place of per-unit gradients), which adds the noise and rescales.

    Attributes:
      summed: the clipped sums, a pytree with the parameters' structure and shapes.
      auxiliary: the strategy's ``num_auxiliary`` auxiliary sums (0-d arrays, e.g. the
        quantile rule's count ``Σ_i (1[‖w_i‖ ≤ 1] − ½)``), in the core's order; ``()`` for
        strategies without them. Equally NOT private: they get their noise in ``update``.
    """

    summed: Any
    auxiliary: tuple[Any, ...] = ()


def _stat_dtype(dtype: Any) -> Any:
    """Statistics and the clipping maths run in at least float32 (float64 stays float64)."""
    return jnp.promote_types(dtype, jnp.float32)


def _find_states(tree: Any) -> list[AdaClipState]:
    """Every :class:`AdaClipState` inside ``tree`` (e.g. an ``optax.chain`` state), in
    ``jax.tree_util`` order."""
    is_state = lambda x: isinstance(x, AdaClipState)  # noqa: E731
    return [x for x in jax.tree_util.tree_leaves(tree, is_leaf=is_state) if is_state(x)]
