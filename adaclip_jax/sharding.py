"""Banded-noise buffers sharded across devices under data parallelism (GSPMD).

With banded correlated noise (``noise_mechanism="banded", bands=b``) every
:class:`~adaclip_jax.AdaClipState` keeps ``b − 1`` noise buffers, each shaped like the
parameters: ``(b − 1)·d`` numbers. Under ``shard_map`` with ``axis_name=`` they are replicated
state, whole on every device. This module places them **sharded** instead, for the other
data-parallel pattern: one ``jax.jit``-ed step over a mesh, the batch sharded along a mesh axis
and the transformation built **without** ``axis_name`` (the compiler partitions it)::

    mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    tx = adaclip_jax.private_chain(
        adaclip_jax.flat_clip(max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=256,
                              key=key, noise_mechanism="banded", bands=4),   # no axis_name
        optax.sgd(0.1))
    opt_state = adaclip_jax.shard_noise_buffers(tx.init(params), mesh, "data")
    state_shardings = adaclip_jax.noise_buffer_shardings(opt_state, mesh, "data")
    step = jax.jit(train_step, out_shardings=(replicated, state_shardings), donate_argnums=1)
    # batch: jax.device_put(batch, NamedSharding(mesh, P("data")))

Each device then holds about ``(b − 1)·d/R`` buffer numbers (``R`` the size of the mesh axis):
every buffer leaf is split along its largest axis whose size ``R`` divides. **A leaf with no such
axis stays replicated** (whole on every device): those are small in practice (biases, scales,
scalars); everything else in the optimizer state (key, step, AdaCliP's ``mean``/``std``, the
states of the other members of the chain) is replicated.

Why it is the same mechanism (the privacy argument):

- **Each coordinate's ``z_t`` is drawn once, and it is the single-device draw.** The step's
  standard normals are ``normal(k_j, shape_j)`` of keys that every device splits identically
  from the replicated key (:func:`adaclip_jax._keys._draw_noise`). With
  ``jax_threefry_partitionable`` (JAX's default since 0.5) the random bits of a coordinate are a
  function of the key and the coordinate's *global* index only, so XLA generates each shard's
  bits on the device that owns the shard: no device draws another's coordinates, and the numbers
  are bit for bit those of the unsharded draw. (With the flag off the numbers are still the same,
  but every device generates all of them before slicing: a warning says so.)
- **The banded recursion is coordinate-wise**: ``x_t = (z_t − Σ_{j=1}^{b−1} c_j x_{t−j})/c_0``
  mixes each coordinate only with its own past, so a device that owns a coordinate's ``z_t`` and
  its buffers computes its ``x_t`` alone; sharding the state changes where the numbers live, not
  which numbers they are. The noisy release ``Σ w̄ + σ_g x_t`` is formed once for the global
  clipped sum (the compiler sums the per-device partial sums before the noise is added), so the
  noise is added once, as on one device.
- **The buffers are as secret as the key**: they are past noise (subtracting them from past
  releases gives past clipped sums). A shard of them is secret in the same way: keep it on the
  devices, and checkpoint it like the whole state (:mod:`adaclip_jax.checkpoint`).

Measured on 4 forced CPU devices (``tests/test_jax_sharded_buffers.py``): the buffers are bit
for bit the single-device run's; the releases and the statistics agree to float32 rounding (the
clipped sum is added up in another order across devices). In the compiled step the buffers are
never gathered: the clipped sum is all-reduced (``d`` numbers per device, transient, as in any
data-parallel step), each device slices its part, draws its part of ``z_t`` (random bits of the
shard's shape) and updates its part of the buffers; the release is all-gathered only because the
parameters (and AdaCliP's statistics) are replicated.

Requirements: a mesh axis of type ``Auto`` (``jax.make_mesh(..., axis_types=(AxisType.Auto,))``;
with ``Explicit`` axes the sum over a sharded batch raises JAX's ``ShardingTypeError``), the
transformation built without ``axis_name`` (``axis_name`` is the ``shard_map`` pattern, whose
state is replicated), and seeded mode or secure mode alike (the OS bits are folded into the one
replicated key).
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from adaclip.errors import InvalidHyperparameterError
from adaclip_jax._state import AdaClipState, _find_states

__all__ = ["noise_buffer_shardings", "shard_noise_buffers"]


def _axis_names(mesh: Any, axis: Any) -> tuple[tuple[str, ...], int]:
    """``(names, R)``: the mesh axes the buffers are split over and the number of shards."""
    if not isinstance(mesh, Mesh):
        raise InvalidHyperparameterError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    names = (axis,) if isinstance(axis, str) else tuple(axis) if isinstance(axis, (tuple, list)) else None
    if not names or any(not isinstance(n, str) for n in names) or len(set(names)) != len(names):
        raise InvalidHyperparameterError(
            f"axis must be a mesh axis name or a tuple of distinct names, got {axis!r}"
        )
    unknown = [n for n in names if n not in mesh.shape]
    if unknown:
        raise InvalidHyperparameterError(
            f"axis {unknown[0]!r} is not an axis of the mesh (its axes: {tuple(mesh.axis_names)})"
        )
    return names, int(np.prod([mesh.shape[n] for n in names]))


def _shape(x: Any) -> tuple[int, ...]:
    shape = getattr(x, "shape", None)  # arrays and jax.ShapeDtypeStruct alike
    return tuple(int(n) for n in (np.shape(x) if shape is None else shape))


def _buffer_spec(shape: tuple[int, ...], names: tuple[str, ...], size: int) -> PartitionSpec:
    """The leaf split along its largest axis whose size ``size`` divides (the first such axis on a
    tie); ``PartitionSpec()`` (replicated) when none does."""
    candidates = [i for i, n in enumerate(shape) if n > 0 and n % size == 0]
    if size == 1 or not candidates:
        return PartitionSpec()
    dim = max(candidates, key=lambda i: (shape[i], -i))
    parts: list[Any] = [None] * len(shape)
    parts[dim] = names[0] if len(names) == 1 else names
    return PartitionSpec(*parts)


def noise_buffer_shardings(opt_state: Any, mesh: Mesh, axis: str | tuple[str, ...]) -> Any:
    """Shardings for a whole optimizer state: banded-noise buffers split over ``axis``, the rest
    replicated.

    Args:
      opt_state: an :class:`~adaclip_jax.AdaClipState` or any pytree holding one or several (an
        ``optax.chain`` state, a dict); its arrays, or ``jax.ShapeDtypeStruct``\\ s from
        ``jax.eval_shape(tx.init, params)``.
      mesh: a ``jax.sharding.Mesh``; the split axis should be of type ``Auto`` (see
        :mod:`adaclip_jax.sharding`).
      axis: the mesh axis name to split over (the data axis), or a tuple of names (split over
        their product).

    Returns:
      A pytree with ``opt_state``'s structure whose leaves are ``NamedSharding``\\ s: for every
      leaf of ``AdaClipState.noise_buffers``, a split of the leaf along its largest axis whose size
      is divisible by ``R`` (the number of devices along ``axis``; the first such axis on a tie),
      so each device holds ``1/R`` of it; a leaf with no such axis (in practice a small one: a
      bias, a scale, a scalar) is **replicated**; every other leaf is replicated. For ``jax.jit``'s
      ``in_shardings``/``out_shardings``, or :func:`jax.device_put` (prefer
      :func:`shard_noise_buffers`). A state with independent noise (no buffers) gets
      replicated shardings throughout.

    Raises:
      InvalidHyperparameterError: ``opt_state`` holds no ``AdaClipState``; ``mesh`` is not a
        ``Mesh``; ``axis`` is not one of its axes.

    Warns (``UserWarning``) when ``jax_threefry_partitionable`` is off: the noise is then still
    the same, but each device generates every coordinate's random bits, not only its own.
    """
    return _shardings(opt_state, mesh, axis, stacklevel=3)


def _shardings(opt_state: Any, mesh: Mesh, axis: Any, stacklevel: int) -> Any:
    """:func:`noise_buffer_shardings`; ``stacklevel`` points its warning at the user's call."""
    names, size = _axis_names(mesh, axis)
    if not _find_states(opt_state):
        raise InvalidHyperparameterError(
            "the state contains no AdaClipState (pass the opt_state of a chain that contains an "
            "adaclip_jax transformation)"
        )
    if not jax.config.jax_threefry_partitionable:
        warnings.warn(
            "jax_threefry_partitionable is off: with sharded noise buffers every device generates the "
            "random bits of every coordinate (the same numbers; the buffers stay sharded); set "
            "jax.config.update('jax_threefry_partitionable', True) to draw each shard on its device",
            stacklevel=stacklevel,
        )
    replicated = NamedSharding(mesh, PartitionSpec())

    def place(node: Any) -> Any:
        if not isinstance(node, AdaClipState):
            return replicated
        rest = jax.tree_util.tree_map(lambda _: replicated, node._replace(noise_buffers=None))
        buffers = jax.tree_util.tree_map(
            lambda b: NamedSharding(mesh, _buffer_spec(_shape(b), names, size)), node.noise_buffers
        )
        return rest._replace(noise_buffers=buffers)

    return jax.tree_util.tree_map(place, opt_state, is_leaf=lambda x: isinstance(x, AdaClipState))


def shard_noise_buffers(opt_state: Any, mesh: Mesh, axis: str | tuple[str, ...]) -> Any:
    """``opt_state`` placed on ``mesh`` with the shardings of :func:`noise_buffer_shardings`:
    each device keeps ``1/R`` of every banded-noise buffer leaf (``≈ (b − 1)·d/R`` numbers), the
    rest of the state replicated.

    Every leaf of the result is a fresh copy with buffers of its own: the result shares no memory
    with ``opt_state`` (which stays valid), and no two of its leaves share a buffer, which a
    jitted step with ``donate_argnums`` needs ("Attempt to donate the same buffer twice"
    otherwise; states from before each buffer got its own zero array had that). A one-time copy,
    leaf by leaf.

    Then keep the buffers sharded across steps: give the jitted step
    ``out_shardings=(..., noise_buffer_shardings(opt_state, mesh, axis))`` (the compiler usually
    keeps the input's sharding without it, but does not promise to), and donate the state.

    Raises and warns as :func:`noise_buffer_shardings`.
    """
    shardings = _shardings(opt_state, mesh, axis, stacklevel=3)
    return jax.tree_util.tree_map(lambda x, s: jax.device_put(jnp.copy(x), s), opt_state, shardings)
