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
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from adaclip.errors import InvalidHyperparameterError

__all__ = ["state_to_numpy", "state_from_numpy"]


def _is_key(x: Any) -> bool:
    return isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def state_to_numpy(state: Any) -> Any:
    """``state`` with every array leaf as a NumPy array; typed PRNG keys become their
    ``uint32`` key data. ``None`` leaves (absent statistics) stay ``None``."""
    return jax.tree_util.tree_map(
        lambda x: np.asarray(jax.random.key_data(x)) if _is_key(x) else np.asarray(x), state
    )


def state_from_numpy(arrays: Any, like: Any) -> Any:
    """The state ``arrays`` (from :func:`state_to_numpy`, e.g. read back from ``np.load``)
    as JAX arrays shaped like ``like``: where ``like`` holds a typed key, the array is its key
    data, wrapped with the same PRNG implementation; other leaves take ``like``'s dtype.

    Raises:
      InvalidHyperparameterError: the structures differ, or a leaf's shape (or a key's data
        shape) differs from the template's; nothing is returned half-converted.
    """
    like_leaves, like_def = jax.tree_util.tree_flatten(like)
    leaves, treedef = jax.tree_util.tree_flatten(arrays)
    if treedef != like_def:
        raise InvalidHyperparameterError(
            f"the saved state's structure differs from the template's: {treedef} vs {like_def}; build "
            "the template with the same optimizer's init on the same parameters"
        )
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
