"""Where the noise of the JAX transformations comes from: PRNG keys and OS entropy.

The JAX counterpart of a noise source. Every update draws its Gaussian noise from a split of
the key in :class:`adaclip_jax.AdaClipState` (:func:`_draw_noise`): in seeded mode the noise
is a function of that key (reproducible, and the key is secret); in secure mode
(``secure_mode=True``) fresh bits from the operating system's CSPRNG are folded into the key
at run time first (:func:`_fold_os_entropy`, a host callback that ``jit`` never caches), so
neither the state nor a checkpoint predicts the noise. Also here: turning a user's ``key=``
into a PRNG key (:func:`_canonical_key`), keys drawn from the OS, and :func:`refresh_key`,
which gives a restored seeded-mode state a new key so that it does not replay its noise.

Banded correlated noise transforms these draws afterwards (:mod:`adaclip_jax._banded`).
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from adaclip.errors import InvalidHyperparameterError
from adaclip_jax._state import AdaClipState, _find_states

__all__ = ["refresh_key"]


def _canonical_key(key: Any, secure_mode: bool = False) -> jax.Array:
    if key is None:
        if secure_mode:
            return _os_key()
        raise InvalidHyperparameterError(
            "key is required: pass a PRNG key such as jax.random.key(seed) for the noise "
            "(or secure_mode=True, which draws it from the OS)"
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


#: 32-bit words of OS randomness folded into the noise key of every step in secure mode.
_ENTROPY_WORDS = 4


def _os_words(shape: tuple[int, ...]) -> np.ndarray:
    """uint32 words from the operating system's CSPRNG (:mod:`secrets`)."""
    count = math.prod(shape)
    return np.frombuffer(secrets.token_bytes(4 * count), dtype=np.uint32).reshape(shape).copy()


def _os_entropy() -> np.ndarray:
    """The host side of :func:`_fold_os_entropy`: ``_ENTROPY_WORDS`` fresh words per call."""
    return _os_words((_ENTROPY_WORDS,))


def _os_key() -> jax.Array:
    """A PRNG key (default implementation) whose data comes from the OS, not from a seed."""
    template = jax.random.key(0)
    data = jax.random.key_data(template)
    return jax.random.wrap_key_data(
        jnp.asarray(_os_words(tuple(data.shape))), impl=jax.random.key_impl(template)
    )


def _fold_os_entropy(key: jax.Array) -> jax.Array:
    """``key`` with ``32·_ENTROPY_WORDS`` fresh bits from the OS folded in (secure mode).

    The bits are fetched at *run* time by ``jax.experimental.io_callback``, a host callback
    with side effects: under ``jax.jit`` (and inside ``lax.scan``) it is neither constant-folded
    nor cached nor hoisted, so every execution of the update fetches new bits. The bits are
    never stored, so neither the key in the state nor a restored checkpoint predicts the noise.
    """
    words = io_callback(_os_entropy, jax.ShapeDtypeStruct((_ENTROPY_WORDS,), jnp.uint32), ordered=False)
    for i in range(_ENTROPY_WORDS):
        key = jax.random.fold_in(key, words[i])
    return key


def _validate_secure_mode(secure_mode: Any, axis_name: Any) -> bool:
    if secure_mode is not True and secure_mode is not False:
        raise InvalidHyperparameterError(f"secure_mode must be True or False, got {secure_mode!r}")
    if secure_mode and axis_name is not None:
        raise InvalidHyperparameterError(
            "secure_mode=True cannot be combined with axis_name: every device would fold "
            "different OS bits into its key and draw different noise, so the noise would no "
            "longer be added exactly once to the global sum; use secure_mode=False with a "
            "secret seed from secrets.randbits, or a single device"
        )
    return secure_mode


def _key_like(new: jax.Array, old: Any) -> jax.Array:
    """``new`` in the representation of ``old`` (typed key or legacy ``uint32`` data), so a
    jitted step that takes the state does not see a new type."""
    new_typed = jnp.issubdtype(new.dtype, jax.dtypes.prng_key)
    old_typed = jnp.issubdtype(old.dtype, jax.dtypes.prng_key)
    if new_typed and not old_typed:
        data = jax.random.key_data(new)
        return data if data.shape == old.shape else new
    if old_typed and not new_typed:
        impl = jax.random.key_impl(old)
        if tuple(new.shape) == tuple(jax.random.key_data(old).shape):
            return jax.random.wrap_key_data(new, impl=impl)
    return new


def _os_key_like(old: Any) -> jax.Array:
    """A key of ``old``'s kind (implementation and representation) with data from the OS."""
    if jnp.issubdtype(old.dtype, jax.dtypes.prng_key):
        shape = tuple(jax.random.key_data(old).shape)
        return jax.random.wrap_key_data(jnp.asarray(_os_words(shape)), impl=jax.random.key_impl(old))
    return jnp.asarray(_os_words(tuple(old.shape)), jnp.uint32)


def refresh_key(state: Any, key: Any = None) -> Any:
    """``state`` with a new noise key in every :class:`AdaClipState` it contains.

    ``state`` is an :class:`AdaClipState` or any pytree holding one (an ``optax.chain``
    state, a checkpoint dict); everything else is returned unchanged. With ``key=None`` the new
    key's data comes from the operating system (:mod:`secrets`); otherwise ``key`` (a PRNG key
    or an int seed) is used, folded with the state's index when there are several.

    Use it after restoring a checkpoint in seeded mode (``secure_mode=False``): the restored
    key would otherwise draw, bit for bit, the noise of the steps that followed the checkpoint
    the first time, and if anything those steps released was kept or seen, a release on other
    data cancels the noise in the difference (it reveals the units that differ). Keep the
    restored key only to reproduce the *same* run exactly. In secure mode a restore never
    replays noise, so this is not needed.

    Raises :class:`InvalidHyperparameterError` when ``state`` contains no ``AdaClipState``.
    """
    found = _find_states(state)
    if not found:
        raise InvalidHyperparameterError(
            "refresh_key: the state contains no AdaClipState (pass the opt_state of a chain "
            "that contains an adaclip_jax transformation)"
        )
    if key is None:
        keys = [_os_key_like(s.key) for s in found]
    else:
        base = _canonical_key(key)
        keys = [base] if len(found) == 1 else [jax.random.fold_in(base, i) for i in range(len(found))]
        keys = [_key_like(k, s.key) for k, s in zip(keys, found, strict=True)]
    fresh = iter(keys)
    is_state = lambda x: isinstance(x, AdaClipState)  # noqa: E731
    return jax.tree_util.tree_map(
        lambda x: x._replace(key=next(fresh)) if is_state(x) else x, state, is_leaf=is_state
    )


def _draw_noise(
    key: jax.Array,
    secure_mode: bool,
    shapes: Sequence[tuple[int, ...]],
    dtypes: Sequence[Any],
    sigma: Any,
) -> tuple[jax.Array, list[jax.Array] | None]:
    """``(next step's key, z)``: the standard normal draws of one update.

    In secure mode the OS bits are folded into ``key`` first. Then
    ``new_key, noise_key = split(key)`` and ``z_j = normal(split(noise_key, J)[j], shapes[j])``
    in ``dtypes[j]``, one draw per entry of the summed list (the ``K`` leaf-shaped draws, then
    one 0-d draw per auxiliary sum); the core scales them by ``σ_g`` and ``σ_aux``. With a
    static ``σ = 0`` nothing is drawn (``z`` is ``None``); the key advances all the same.
    """
    key = _fold_os_entropy(key) if secure_mode else key
    new_key, noise_key = jax.random.split(key)
    if isinstance(sigma, float) and sigma == 0.0:
        return new_key, None  # static σ = 0: nothing to draw
    keys = jax.random.split(noise_key, len(shapes))
    noise = [jax.random.normal(k, shp, dt) for k, shp, dt in zip(keys, shapes, dtypes, strict=True)]
    return new_key, noise
