"""Saving an optax state that holds a private transformation's state with ordinary tools.

:class:`~adaclip_jax.AdaClipState` keeps its noise key as a typed PRNG key
(``jax.random.key``), which NumPy cannot represent: ``np.savez`` of the state's leaves raises
``TypeError: JAX array with PRNGKey dtype cannot be converted to a NumPy array``.
:func:`state_to_numpy` turns every leaf into a NumPy array — a typed key into its raw
``uint32`` key data (``jax.random.key_data``) — and :func:`state_from_numpy` turns such arrays
back into a state shaped like a template (the ``init`` of the same optimizer on the same
parameters), wrapping key data back into keys of the template's implementation::

    arrays = adaclip_jax.state_to_numpy(opt_state)
    np.savez("opt_state.npz", *jax.tree_util.tree_leaves(arrays))
    ...
    with np.load("opt_state.npz") as f:
        leaves = [f[f"arr_{i}"] for i in range(len(f.files))]
    template = tx.init(params)
    opt_state = adaclip_jax.state_from_numpy(
        jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(template), leaves), template)

**What the file holds is secret.** In seeded mode the key determines all future noise, and a
run with banded noise keeps its last ``b − 1`` noise draws in ``noise_buffers``: whoever reads
the file can subtract them from later releases. Store it like the training data. After a
restore, :func:`adaclip_jax.refresh_key` gives the state a fresh key so that the restored run
does not replay noise it has already used (in secure mode every step folds in fresh OS
randomness, so the saved key alone predicts nothing; the buffers still are secret).

``state_from_numpy(..., strategy=tx.strategy)`` also checks the strategy's part of every
restored :class:`~adaclip_jax.AdaClipState` (``step``, ``mean``, ``std``, ``extra``) with the
core's :func:`adaclip.mechanism.check_state`, so that a checkpoint of another model, strategy or
option set, or a corrupted one, is refused instead of silently driving the clipping.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from adaclip.errors import InvalidHyperparameterError
from adaclip.mechanism import ClipState, check_state
from adaclip_jax._state import AdaClipState, _find_states

__all__ = ["state_to_numpy", "state_from_numpy"]


def _is_key(x: Any) -> bool:
    return isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def state_to_numpy(state: Any) -> Any:
    """``state`` with every array leaf as a NumPy array; typed PRNG keys become their
    ``uint32`` key data. ``None`` leaves (absent statistics) stay ``None``."""
    return jax.tree_util.tree_map(
        lambda x: np.asarray(jax.random.key_data(x)) if _is_key(x) else np.asarray(x), state
    )


def state_from_numpy(arrays: Any, like: Any, *, strategy: Any = None) -> Any:
    """The state ``arrays`` (from :func:`state_to_numpy`, e.g. read back from ``np.load``)
    as JAX arrays shaped like ``like``: where ``like`` holds a typed key, the array is its key
    data, wrapped with the same PRNG implementation; other leaves take ``like``'s dtype.

    ``strategy`` (optional): the core strategy of the transformation that built ``like``
    (``tx.strategy`` after ``tx.init``). When given, the strategy's part of every
    :class:`~adaclip_jax.AdaClipState` in ``arrays`` — ``step``, ``mean``, ``std``, ``extra``,
    its tensors in ``jax.tree_util`` leaf order — is checked against the same part of the
    template with :func:`adaclip.mechanism.check_state` (``strategy.check_state`` where the
    strategy has it) before anything is converted: shapes, real dtypes, finiteness, AdaCliP's
    ``s`` within ``[std_min, std_max]``, a step count ``>= 0`` and the ranges of the option
    state. Its messages start with ``"restored state"`` (``"restored state #i"`` for the
    ``i``-th of several states). Every value checked is a function of released values, so
    this is about correctness, not privacy. The state returned is the same as without
    ``strategy``.

    Raises:
      InvalidHyperparameterError: the structures differ, or a leaf's shape (or a key's data
        shape) differs from the template's; with ``strategy``, the core's check refuses a
        state, or ``like`` holds no :class:`~adaclip_jax.AdaClipState`. Nothing is returned
        half-converted.
    """
    like_leaves, like_def = jax.tree_util.tree_flatten(like)
    leaves, treedef = jax.tree_util.tree_flatten(arrays)
    if treedef != like_def:
        raise InvalidHyperparameterError(
            f"the saved state's structure differs from the template's: {treedef} vs {like_def}; build "
            "the template with the same optimizer's init on the same parameters"
        )
    if strategy is not None:
        _check_strategy_states(strategy, arrays, like)
    out = []
    for i, (x, ref) in enumerate(zip(leaves, like_leaves, strict=True)):
        x = np.asarray(x)
        if _is_key(ref):
            want = tuple(jax.random.key_data(ref).shape)
            if x.shape != want or x.dtype != np.uint32:
                raise InvalidHyperparameterError(
                    f"leaf {i}: a PRNG key's data must be uint32 of shape {want}, got {x.dtype} {x.shape}"
                )
            out.append(jax.random.wrap_key_data(jnp.asarray(x), impl=jax.random.key_impl(ref)))
        else:
            if x.shape != tuple(jnp.shape(ref)):
                raise InvalidHyperparameterError(
                    f"leaf {i}: shape {x.shape} differs from the template's {tuple(jnp.shape(ref))}"
                )
            out.append(jnp.asarray(x, dtype=jnp.result_type(ref)))
    return jax.tree_util.tree_unflatten(like_def, out)


def _clip_state(state: AdaClipState) -> ClipState:
    """The core's view of ``state``: per-tensor lists in ``jax.tree_util`` leaf order, ``extra``
    as it is (already the core's flat layout)."""
    def flat(tree: Any) -> list[Any] | None:
        return None if tree is None else jax.tree_util.tree_leaves(tree)

    return ClipState(step=state.step, mean=flat(state.mean), std=flat(state.std), extra=state.extra)


def _check_strategy_states(strategy: Any, arrays: Any, like: Any) -> None:
    """Run the core's check on the strategy part of every state of ``arrays`` against the
    state at the same place in ``like`` (the structures are already known to match)."""
    saved, templates = _find_states(arrays), _find_states(like)
    if not templates:
        raise InvalidHyperparameterError(
            "state_from_numpy(strategy=...): the template holds no AdaClipState, so there is no "
            "strategy state to check; pass strategy only for the state of an adaclip_jax transformation"
        )
    check = getattr(strategy, "check_state", None)
    for i, (state, template) in enumerate(zip(saved, templates, strict=True)):
        source = "restored state" if len(templates) == 1 else f"restored state #{i}"
        if check is not None:
            check(_clip_state(state), _clip_state(template), source=source)
        else:  # a strategy of the protocol without the optional method
            check_state(strategy, _clip_state(state), _clip_state(template), source=source)
