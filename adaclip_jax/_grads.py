"""Per-unit gradients: ``vmap(grad)`` over the batch, micro-batching and user-level units.

A *unit* is what one privacy guarantee protects: an example, or a user (all of
that user's examples). The private transformations take one gradient per unit, stacked on a
leading axis. For user-level DP the gradients of a user's examples are summed *before*
clipping, so the user's whole contribution is clipped once.

**Argument roles.** Every per-example entry point (:func:`per_example_grads`,
:func:`clipped_sum_grads`, :func:`adaclip_jax.ghost_clipped_sum_grads`,
:func:`adaclip_jax.ghost_coverage`) gives each positional argument of ``loss_fn`` one role:
the parameters (``argnums``, differentiated), batched (``batch_argnums``: ``vmap`` hands
example ``i`` row ``i`` of every leaf), declared shared (``shared_argnums``: every example gets
the whole argument), or undeclared. An undeclared argument is also given whole to every
example, so the one rule, checked at trace time (shapes are static under ``jit``) before
``loss_fn`` is traced, is: **an undeclared argument may not hold an array leaf whose leading
size is the batch's** (:func:`_batch_size` refuses it with
:class:`~adaclip.errors.InvalidHyperparameterError`, naming ``batch_argnums=(..)`` and
``shared_argnums=(..)`` as the two fixes). Scalars and arrays of another leading size pass.

Why: clipping bounds the sensitivity only if unit ``i``'s gradient depends on unit ``i``'s data
alone. Labels left out of ``batch_argnums`` reach every example whole (``loss_fn(params, x, y)``
with the default ``batch_argnums=1``: ``jnp.mean((pred - y)**2)`` broadcasts over all the
labels), so changing one label moves every unit's clipped gradient and the clipped sum by up
to ``2·n·C`` instead of ``2·C``, with no error and a plausible loss. An array with one row per
example is almost always such data; a genuinely shared array whose leading size equals the
batch's by chance (a table, a buffer) must be declared, since no shape can tell the two apart.
Neither silent choice is safe: batching a shared table would silently change the model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from adaclip import strategies as _strategies
from adaclip.errors import InvalidGradientError, InvalidHyperparameterError
from adaclip.options import positive_int
from adaclip_jax._state import ClippedSum, _stat_dtype
from adaclip_jax._transform import PrivateTransformation, _num_params
from adaclip_jax._validation import _check_extra, _validate_unit_mask

__all__ = ["per_example_grads", "sum_by_unit", "clipped_sum_grads", "add_clipped_sums"]

ArgNums = int | Sequence[int]


class _ArgRoles(NamedTuple):
    """The role of each positional argument of ``loss_fn`` (see the module docstring)."""

    params: int
    batched: frozenset[int]
    shared: frozenset[int]

    def in_axes(self, num_args: int) -> tuple[int | None, ...]:
        """``vmap``'s ``in_axes``: axis 0 for the batched arguments, ``None`` for the rest."""
        return tuple(0 if i in self.batched else None for i in range(num_args))


def _positive_int_or_none(name: str, value: Any) -> int | None:
    return None if value is None else positive_int(name, value)


def _argnum_set(name: str, value: Any) -> frozenset[int]:
    """``value`` (an int or a sequence of ints, each ``>= 0``) as a set of argument positions."""
    iterable = isinstance(value, Iterable) and not isinstance(value, (str, bytes))
    values = tuple(value) if iterable else (value,)
    for v in values:
        if isinstance(v, bool) or not hasattr(v, "__index__") or int(v) < 0:
            raise InvalidHyperparameterError(
                f"{name} must be a non-negative int or a sequence of them, got {value!r}"
            )
    return frozenset(int(v) for v in values)


def _arg_roles(argnums: Any, batch_argnums: Any, shared_argnums: Any = ()) -> _ArgRoles:
    """Checks the declared roles when the entry point is built (before any call).

    Raises:
      InvalidHyperparameterError: ``argnums`` is not an int; ``batch_argnums`` is empty; an
        argument number is not a non-negative int; the parameters are declared batched or
        shared; an argument is declared both batched and shared.
    """
    if isinstance(argnums, bool) or not isinstance(argnums, int) or argnums < 0:
        raise InvalidHyperparameterError(f"argnums must be a non-negative int, got {argnums!r}")
    batched = _argnum_set("batch_argnums", batch_argnums)
    shared = _argnum_set("shared_argnums", shared_argnums)
    if not batched:
        raise InvalidHyperparameterError("batch_argnums must name at least one argument")
    if argnums in batched:
        raise InvalidHyperparameterError("argnums (the parameters) cannot be a batched argument")
    if argnums in shared:
        raise InvalidHyperparameterError(
            "argnums (the parameters) is given whole to every example already: leave it out of shared_argnums"
        )
    if batched & shared:
        raise InvalidHyperparameterError(
            f"arguments {sorted(batched & shared)} are in both batch_argnums and shared_argnums"
        )
    return _ArgRoles(argnums, batched, shared)


def _undeclared_of_batch_size(args: Sequence[Any], roles: _ArgRoles, n: int) -> list[tuple[int, str]]:
    """``(argument number, leaf path)`` of every leaf of an undeclared argument (neither the
    parameters, batched nor shared) whose leading size is ``n``. Pure, static shapes only."""
    found = []
    for i, arg in enumerate(args):
        if i == roles.params or i in roles.batched or i in roles.shared:
            continue
        for path, leaf in jax.tree_util.tree_flatten_with_path(arg)[0]:
            shape = getattr(leaf, "shape", ())
            if len(shape) >= 1 and int(shape[0]) == n:
                found.append((i, jax.tree_util.keystr(path)))
    return found


def _refusal(found: list[tuple[int, str]], roles: _ArgRoles, n: int) -> InvalidHyperparameterError:
    """The error for :func:`_undeclared_of_batch_size`'s leaves, naming both fixes."""
    nums = sorted({i for i, _ in found})
    leaves = ", ".join(f"argument {i}{path}" for i, path in found)
    is_, holds = ("is", "holds") if len(found) == 1 else ("are", "hold")
    batch_fix = tuple(sorted(roles.batched | set(nums)))
    return InvalidHyperparameterError(
        f"{leaves} of loss_fn {is_} not in batch_argnums={tuple(sorted(roles.batched))} but {holds} "
        f"an array with the batch's leading size ({n}): vmap would give every example all of it "
        f"(e.g. every label), so one example's data would reach every example's clipped gradient "
        f"and clipping would not bound the sensitivity. If it holds one entry per example, pass "
        f"batch_argnums={batch_fix}; if every example genuinely shares it, declare it with "
        f"shared_argnums={tuple(nums)}."
    )


def sum_by_unit(per_example: Any, unit_ids: jax.Array, *, num_units: int) -> tuple[Any, jax.Array]:
    """Sum per-example gradients of the same unit (user): ``G_u = Σ_{i: id_i = u} g_i``.

    Args:
      per_example: pytree of ``(n, *shape)`` arrays.
      unit_ids: ``(n,)`` integer ids in ``[0, num_units)``; ids outside that range are dropped
        (``jax.ops.segment_sum`` semantics), so use them for padding rows.
      num_units: static number of units (rows of the output).

    Returns:
      ``(per_unit, unit_mask)``: pytree of ``(num_units, *shape)`` arrays, and a boolean
      ``(num_units,)`` mask, True for units with at least one example in the batch. Pass the
      mask as ``unit_mask=`` to the transformation's ``update``: an absent unit must add
      nothing (for AdaCliP a zero gradient is *not* nothing, the centre is ``m``).
    """
    num_units = _positive_int_or_none("num_units", num_units)
    if num_units is None:
        raise InvalidHyperparameterError("num_units is required")
    unit_ids = jnp.asarray(unit_ids)
    leaves = jax.tree_util.tree_leaves(per_example)
    if unit_ids.ndim != 1 or any(g.ndim < 1 or g.shape[0] != unit_ids.shape[0] for g in leaves):
        raise InvalidGradientError(
            f"unit_ids must have shape (n,) matching the leading batch axis, got {unit_ids.shape}"
        )
    per_unit = jax.tree_util.tree_map(
        lambda g: jax.ops.segment_sum(g, unit_ids, num_segments=num_units), per_example
    )
    counts = jax.ops.segment_sum(jnp.ones(unit_ids.shape, jnp.int32), unit_ids, num_segments=num_units)
    return per_unit, counts > 0


def per_example_grads(
    loss_fn: Callable[..., Any],
    *,
    micro_batch_size: int | None = None,
    has_aux: bool = False,
    argnums: int = 0,
    batch_argnums: ArgNums = 1,
    shared_argnums: ArgNums = (),
    num_units: int | None = None,
) -> Callable[..., Any]:
    """Per-unit gradients of ``loss_fn`` with a leading batch axis, ready for the transformations.

    ``loss_fn(params, batch, ...)`` is the loss of ONE example: every array of ``batch`` is
    indexed without its batch axis (``jax.vmap`` removes it). The returned function takes the
    same arguments, with the arguments in ``batch_argnums`` batched along axis 0, and returns
    ``grads`` (the ``argnums`` argument's pytree, each leaf with a leading axis of size ``n``),
    or ``(grads, aux)`` when ``has_aux`` (``aux`` per example).

    Args:
      loss_fn: per-example loss.
      micro_batch_size: if set, gradients are computed ``micro_batch_size`` examples at a time
        (``lax.map`` over chunks) to bound the activation memory of ``vmap``; ``n`` must be a
        multiple of it (pad and use ``unit_mask`` otherwise).
      has_aux: ``loss_fn`` returns ``(loss, aux)``.
      argnums: which argument to differentiate (an int).
      batch_argnums: which arguments carry the batch axis (default: the second). Put every
        argument with one entry per example here: ``loss_fn(params, x, y)`` needs
        ``batch_argnums=(1, 2)``.
      shared_argnums: arguments every example reads whole although a leaf's leading size may
        equal the batch's (a lookup table, a buffer). Other arguments outside
        ``batch_argnums`` are also read whole, but one holding an array with the batch's
        leading size is refused: see below.
      num_units: user-level units. The returned function then requires the keyword
        ``unit_ids`` (``(n,)`` ints in ``[0, num_units)``) and returns
        ``((per_unit_grads, unit_mask), aux?)`` from :func:`sum_by_unit`: each user's
        examples are summed before clipping.

    Raises:
      InvalidHyperparameterError: at trace time, before ``loss_fn`` is traced, when an
        argument that is neither the parameters nor in ``batch_argnums`` nor in
        ``shared_argnums`` holds an array leaf whose leading size is the batch's. Every example
        would read all of it — labels left unbatched make each example's loss depend on every
        label, and one changed label then moves every unit's gradient, so clipping no longer
        bounds the sensitivity. Whether such an array is per-example data or shared cannot be
        told from its shape, so it is refused rather than guessed: the message names
        ``batch_argnums=(..)`` and ``shared_argnums=(..)``. (Also when a declared argument
        number is out of range, negative, or in two roles.)
    """
    micro_batch_size = _positive_int_or_none("micro_batch_size", micro_batch_size)
    num_units = _positive_int_or_none("num_units", num_units)
    roles = _arg_roles(argnums, batch_argnums, shared_argnums)
    grad_fn = jax.grad(loss_fn, argnums=argnums, has_aux=has_aux)

    def _vmapped(*args):
        return jax.vmap(grad_fn, in_axes=roles.in_axes(len(args)))(*args)

    def compute(*args, unit_ids=None):
        n = _batch_size(args, roles)
        if micro_batch_size is None or micro_batch_size >= n:
            out = _vmapped(*args)
        else:
            out = _chunked_map(_vmapped, args, roles.batched, n, micro_batch_size)
        if num_units is None:
            if unit_ids is not None:
                raise InvalidHyperparameterError(
                    "unit_ids given but per_example_grads was built without num_units"
                )
            return out
        if unit_ids is None:
            raise InvalidHyperparameterError("num_units is set: pass unit_ids=(n,) integer ids")
        grads, aux = out if has_aux else (out, None)
        grouped = sum_by_unit(grads, unit_ids, num_units=num_units)
        return (grouped, aux) if has_aux else grouped

    return compute


def _batch_size(args: Sequence[Any], roles: _ArgRoles) -> int:
    """The common leading size ``n`` of the batched arguments, after checking every argument's
    role against ``args`` (static shapes: at trace time, before ``loss_fn`` is traced).

    Raises:
      InvalidHyperparameterError: a declared argument number is out of range, or an undeclared
        argument holds an array leaf of leading size ``n`` (see the module docstring).
      InvalidGradientError: a batched leaf without a leading axis, or different leading sizes.
    """
    for name, nums in (("batch_argnums", roles.batched), ("shared_argnums", roles.shared)):
        if nums and max(nums) >= len(args):
            raise InvalidHyperparameterError(f"{name} {sorted(nums)} out of range for {len(args)} arguments")
    if roles.params >= len(args):
        raise InvalidHyperparameterError(f"argnums {roles.params} out of range for {len(args)} arguments")
    batched = [jax.tree_util.tree_leaves(args[i]) for i in sorted(roles.batched)]
    sizes = {int(x.shape[0]) if getattr(x, "ndim", 0) >= 1 else None for leaves in batched for x in leaves}
    if None in sizes:
        raise InvalidGradientError("every batched argument needs a leading batch axis")
    if len(sizes) != 1:
        raise InvalidGradientError(f"batched arguments have different leading sizes {sorted(sizes)}")
    (n,) = sizes
    found = _undeclared_of_batch_size(args, roles, n)
    if found:
        raise _refusal(found, roles, n)
    return n


def _split_chunks(args: Sequence[Any], batch_set: frozenset[int], n: int, micro_batch_size: int) -> dict[int, Any]:
    if n % micro_batch_size:
        raise InvalidGradientError(f"batch size {n} is not a multiple of micro_batch_size={micro_batch_size}")
    chunks = n // micro_batch_size

    def split(x):
        return x.reshape((chunks, micro_batch_size) + x.shape[1:])

    return {i: jax.tree_util.tree_map(split, args[i]) for i in batch_set}


def _chunked_map(
    fn: Callable[..., Any], args: Sequence[Any], batch_set: frozenset[int], n: int, micro_batch_size: int
):
    """``fn(*args)`` computed ``micro_batch_size`` rows at a time with ``lax.map``."""
    chunked = _split_chunks(args, batch_set, n, micro_batch_size)

    def one_chunk(chunk):
        return fn(*[chunk[i] if i in batch_set else a for i, a in enumerate(args)])

    stacked = jax.lax.map(one_chunk, chunked)
    return jax.tree_util.tree_map(lambda x: x.reshape((n,) + x.shape[2:]), stacked)


def _strategy_source(tx: Any) -> Callable[[int], Any]:
    """``num_params -> strategy`` of a private transformation of this package (or of any object
    carrying a core ``strategy``); a chain is refused."""
    if isinstance(tx, PrivateTransformation):
        return tx.strategy_for
    if getattr(tx, "strategy", None) is not None:  # any object carrying a core strategy
        return lambda num_params: tx.strategy
    raise InvalidHyperparameterError(
        "tx must be a transformation from adaclip_jax (adaclip, flat_clip, ...), not a chain"
    )


def _core_state_for(state: Any, p_leaves: Sequence[Any]) -> tuple[Any, list[Any]]:
    """The core :class:`~adaclip.strategies.ClipState` of a transformation's state for these
    parameter leaves, and the statistics' dtypes (the state's, else each parameter's statistics
    dtype). Raises :class:`InvalidGradientError` when the statistics do not match the
    parameters, and checks ``extra``."""
    mean = None if state.mean is None else jax.tree_util.tree_leaves(state.mean)
    std = None if state.std is None else jax.tree_util.tree_leaves(state.std)
    stats = std if std is not None else mean
    if stats is not None:
        if [m.shape for m in stats] != [p.shape for p in p_leaves] or (
            mean is not None and [m.shape for m in mean] != [p.shape for p in p_leaves]
        ):
            raise InvalidGradientError("the state's statistics do not match the parameters")
        dtypes = [m.dtype for m in stats]
    else:
        dtypes = [_stat_dtype(jnp.result_type(p)) for p in p_leaves]
    extra = getattr(state, "extra", None)
    _check_extra(extra, len(p_leaves))
    return _strategies.ClipState(step=state.step, mean=mean, std=std, extra=extra), dtypes


def clipped_sum_grads(
    loss_fn: Callable[..., Any],
    tx: Any,
    *,
    micro_batch_size: int | None = None,
    argnums: int = 0,
    batch_argnums: ArgNums = 1,
    shared_argnums: ArgNums = (),
) -> Callable[..., Any]:
    """Per-unit gradients, clipped and summed chunk by chunk: memory ``O(micro_batch_size·d)``.

    :func:`per_example_grads` materialises all ``n·d`` per-unit gradients. This computes
    ``Σ_i w̄_i`` (the core's :func:`adaclip.strategies.clip_and_sum`) for ``micro_batch_size``
    units at a time and adds the chunk sums (``lax.scan``), which the core allows: every unit
    is in exactly one chunk, and the noise is added once, later, by ``tx.update``.

    Args:
      loss_fn: per-example loss, as for :func:`per_example_grads` (no ``has_aux``).
      tx: a transformation of this package (:func:`adaclip_jax.adaclip`, :func:`flat_clip`, …;
        in a chain, the private element itself, not the chain).
      micro_batch_size: units per chunk (``n`` must be a multiple); ``None``: one chunk.
      argnums, batch_argnums, shared_argnums: the arguments' roles, as for
        :func:`per_example_grads`: an argument outside all three holding an array with the
        batch's leading size is refused (every unit would read all of it, e.g. all the labels,
        and the clipped sum's sensitivity would exceed ``2·C``).

    Returns:
      ``fn(state, *args, unit_mask=None) -> ClippedSum`` (``unit_mask``: a boolean ``(n,)``
      array, as for the transformation's ``update``) where ``state`` is ``tx``'s
      :class:`AdaClipState` (the clip uses its centre and scale). Pass the result to
      ``tx.update`` (or the chain's) in place of per-unit gradients: it releases it with the
      same state. A strategy's auxiliary sums (the quantile rule's count of unclipped units,
      from the same clip factors) are summed chunk by chunk too and travel in
      ``ClippedSum.auxiliary``. With ``adaclip(initial_max_grad_norm=...)`` the strategy is
      resolved from the parameters' size, so ``tx.init`` need not have run. User-level units
      (``num_units``) are not supported on this path.
    """
    strategy_for = _strategy_source(tx)
    micro_batch_size = _positive_int_or_none("micro_batch_size", micro_batch_size)
    roles = _arg_roles(argnums, batch_argnums, shared_argnums)
    batch_set = roles.batched
    grad_fn = jax.grad(loss_fn, argnums=argnums)

    def compute(state, *args, unit_mask=None):
        n = _batch_size(args, roles)
        params = args[argnums]
        p_leaves, treedef = jax.tree_util.tree_flatten(params)
        strategy = strategy_for(_num_params([tuple(p.shape) for p in p_leaves]))
        core_state, dtypes = _core_state_for(state, p_leaves)
        in_axes = roles.in_axes(len(args))
        if unit_mask is not None:
            unit_mask = _validate_unit_mask(unit_mask, n)

        def chunk_sum(chunk_args, mask):
            # K clipped sums, then the strategy's auxiliary sums (0-d): the same entries as
            # the per-unit path of tx.update, so chunk sums add entry by entry.
            g = jax.vmap(grad_fn, in_axes=in_axes)(*chunk_args)
            leaves = [x.astype(dt) for x, dt in zip(jax.tree_util.tree_leaves(g), dtypes, strict=True)]
            return _strategies.clip_and_sum(strategy, core_state, leaves, unit_mask=mask)

        if micro_batch_size is None or micro_batch_size >= n:
            summed = chunk_sum(args, unit_mask)
        else:
            chunked = _split_chunks(args, batch_set, n, micro_batch_size)
            masks = None if unit_mask is None else unit_mask.reshape((-1, micro_batch_size))

            def body(carry, xs):
                chunk, mask = xs
                full = [chunk[i] if i in batch_set else a for i, a in enumerate(args)]
                part = chunk_sum(full, mask)
                return [c + p for c, p in zip(carry, part, strict=True)], None

            # The carry: zeros shaped like one chunk's entries (K tensors, then 0-d auxiliary sums).
            first = jax.tree_util.tree_map(lambda x: x[0], (chunked, masks))
            shapes = jax.eval_shape(
                lambda xs: chunk_sum([xs[0][i] if i in batch_set else a for i, a in enumerate(args)], xs[1]),
                first,
            )
            init = [jnp.zeros(x.shape, x.dtype) for x in shapes]
            summed, _ = jax.lax.scan(body, init, (chunked, masks))
        num = len(p_leaves)
        return ClippedSum(jax.tree_util.tree_unflatten(treedef, summed[:num]), tuple(summed[num:]))

    return compute


def add_clipped_sums(*sums: Any) -> Any:
    """The :class:`~adaclip_jax.ClippedSum` of several physical batches of one logical batch.

    A logical batch too large for memory is processed as physical batches
    ``B = B_1 ∪ … ∪ B_k`` (disjoint): ``Σ_{i∈B} w̄_i = Σ_j Σ_{i∈B_j} w̄_i``, and the strategy's
    auxiliary sums add the same way. Every physical batch must be clipped with the *same*
    state (the one the single ``update`` then receives), so the result equals the clipped sum
    of the whole logical batch and the release — noise added once, one accountant step at the
    logical batch's sampling rate — is that of the logical batch::

        clip = adaclip_jax.clipped_sum_grads(loss_fn, private, micro_batch_size=64)
        total = adaclip_jax.add_clipped_sums(*(clip(opt_state[0], params, b) for b in physical))
        updates, opt_state = tx.update(total, opt_state, params)

    Like its inputs, the result is NOT private: it may only go to that ``update``.

    Raises:
      InvalidGradientError: no sums, an argument that is not a ``ClippedSum``, or sums whose
        structures, shapes or numbers of auxiliary sums differ.
    """
    if not sums:
        raise InvalidGradientError("add_clipped_sums needs at least one ClippedSum")
    for s in sums:
        if not isinstance(s, ClippedSum):
            raise InvalidGradientError(
                f"add_clipped_sums takes the ClippedSum values of clipped_sum_grads, got {type(s).__name__}"
            )
    first = sums[0]
    structure = jax.tree_util.tree_structure(first.summed)
    shapes = [jnp.shape(x) for x in jax.tree_util.tree_leaves(first.summed)]
    for s in sums[1:]:
        if jax.tree_util.tree_structure(s.summed) != structure or [
            jnp.shape(x) for x in jax.tree_util.tree_leaves(s.summed)
        ] != shapes:
            raise InvalidGradientError("add_clipped_sums: the ClippedSums differ in structure or shapes")
        if len(s.auxiliary) != len(first.auxiliary):
            raise InvalidGradientError("add_clipped_sums: the ClippedSums carry different numbers of auxiliary sums")
    summed = jax.tree_util.tree_map(lambda *xs: sum(xs[1:], xs[0]), *(s.summed for s in sums))
    auxiliary = tuple(sum((s.auxiliary[i] for s in sums[1:]), first.auxiliary[i]) for i in range(len(first.auxiliary)))
    return ClippedSum(summed=summed, auxiliary=auxiliary)
