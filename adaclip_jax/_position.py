"""Where a private transformation sits in the ``optax.chain`` that calls it.

The private transformation must be the *first* transformation to read the per-unit gradients.
``optax.chain(t_1, ..., t_k)`` calls ``t_1.update`` on the updates it is given, then feeds each
output to the next transformation; every ``t_j`` with ``j < i`` therefore runs on the raw
per-unit gradients ``(g_1, ..., g_n)`` before the private ``t_i`` does. Such a ``t_j`` is not
part of the mechanism: its output (the input of ``t_i``) and its *new state* are functions of
individual examples in the clear. ``optax.adam`` before the private transformation keeps
moments ``μ ← β_1 μ + (1 − β_1) g`` of the raw ``(n, …)`` stack (``μ`` broadcasts from the
parameters' shape to ``(n, …)`` without an error), which later steps reuse and which a
checkpoint stores; ``optax.clip_by_global_norm`` rescales every unit by the norm of the *whole*
stack, so each unit's input to the mechanism depends on the other units, and the sensitivity
argument (one unit changes the clipped sum by at most 1 in w-space) no longer describes the
released quantity. Neither changes a shape, so the private transformation cannot tell from its
input that something ran before it: no value-level test can separate ``g`` from ``f(g)``.

What this module checks instead is the *call*: ``optax.chain`` and ``optax.named_chain`` are
plain Python loops, and while one of them runs a transformation its frame holds the states
already produced (``new_state``) or, in ``init``, the tuple of init functions and the one being
called. :func:`transformations_before` walks the Python stack from the private transformation's
``init``/``update`` up through every directly enclosing ``chain``/``named_chain`` frame
(nested chains included) and returns how many transformations come before it. It runs at trace
time, so it also works under ``jax.jit``, ``lax.scan`` and ``shard_map``, and costs a few frame
look-ups per trace.

Honest limits. It recognises only optax's own ``chain``/``named_chain`` (by their code objects,
taken from a probe chain at first use, so an optax upgrade that rewrites them is still
recognised as long as the frames keep their local names; if they do not, the check finds
nothing and allows the call: it *fails open*, and the tests pin it on the installed optax).
Other combinators and wrappers (``optax.MultiSteps``, ``optax.masked``, ``optax.partition``,
``optax.apply_if_finite`` around the private transformation, or a hand-written chain) are not
seen here; :func:`adaclip_jax.check_chain` inspects the state structure and refuses those, and
:func:`adaclip_jax.private_chain` builds the one valid order.
"""

from __future__ import annotations

import sys
from types import CodeType, FrameType

import optax

from adaclip.errors import InvalidHyperparameterError

__all__ = ["refuse_if_not_first", "refuse_if_wrapped", "transformations_before"]

#: How many enclosing frames to inspect at most (nested chains deeper than this are not
#: followed; each level of nesting costs one frame in ``update`` and two in ``init``).
_MAX_DEPTH = 64


class _ChainCodes:
    """The code objects of ``optax.chain``'s and ``optax.named_chain``'s inner functions."""

    def __init__(self) -> None:
        probe = optax.chain(optax.identity())
        named = optax.named_chain(("probe", optax.identity()))
        self.chain_init: CodeType = probe.init.__code__
        self.chain_update: CodeType = probe.update.__code__
        self.chain_init_genexpr: CodeType | None = next(
            (c for c in self.chain_init.co_consts if isinstance(c, CodeType) and c.co_name == "<genexpr>"),
            None,
        )
        self.named_init: CodeType = named.init.__code__
        self.named_update: CodeType = named.update.__code__


_codes: _ChainCodes | None = None


def _chain_codes() -> _ChainCodes:
    global _codes
    if _codes is None:
        _codes = _ChainCodes()
    return _codes


def _current_frame(depth: int) -> FrameType | None:
    """The frame ``depth`` levels above the caller of this function, or ``None``."""
    getframe = getattr(sys, "_getframe", None)
    if getframe is None:  # not CPython-like: nothing to inspect (fails open, see the module)
        return None
    try:
        return getframe(depth + 1)
    except ValueError:
        return None


def _update_position(frame: FrameType | None, codes: _ChainCodes) -> tuple[int, str] | None:
    """``(number of transformations before, combinator)`` over the enclosing update frames."""
    for _ in range(_MAX_DEPTH):
        if frame is None:
            return None
        if frame.f_code is codes.chain_update or frame.f_code is codes.named_update:
            done = frame.f_locals.get("new_state")
            if done is not None and len(done) > 0:
                name = "optax.chain" if frame.f_code is codes.chain_update else "optax.named_chain"
                return len(done), name
            frame = frame.f_back  # first of this chain: the chain itself may be nested
            continue
        return None
    return None


def _init_position(frame: FrameType | None, codes: _ChainCodes) -> tuple[int, str] | None:
    """As :func:`_update_position` for ``init``: ``chain``'s init calls its members from a
    generator expression (whose local ``fn`` is the member being initialised, ``init_fns``
    of the enclosing frame all of them); ``named_chain``'s from a loop that fills ``states``."""
    for _ in range(_MAX_DEPTH):
        if frame is None:
            return None
        if codes.chain_init_genexpr is not None and frame.f_code is codes.chain_init_genexpr:
            parent = frame.f_back
            fn = frame.f_locals.get("fn")
            if fn is None or parent is None or parent.f_code is not codes.chain_init:
                return None
            init_fns = parent.f_locals.get("init_fns")
            if init_fns is None:
                return None
            positions = [i for i, f in enumerate(init_fns) if f is fn]
            if positions and positions != [0]:
                # After another member, or the same transformation listed twice (its second
                # use would read the first one's release): either way not first.
                return max(positions), "optax.chain"
            frame = parent.f_back  # first here: the chain itself may be nested
            continue
        if frame.f_code is codes.named_init:
            done = frame.f_locals.get("states")
            if done is not None and len(done) > 0:
                return len(done), "optax.named_chain"
            frame = frame.f_back
            continue
        return None
    return None


def _caller_position(kind: str, depth: int) -> tuple[int, str] | None:
    """:func:`transformations_before` from the frame ``depth`` levels above the function that
    calls this one (``depth=2``: that function is called by the transformation, whose caller
    is inspected)."""
    codes = _chain_codes()
    frame = _current_frame(depth + 1)
    try:
        return _update_position(frame, codes) if kind == "update" else _init_position(frame, codes)
    finally:
        del frame  # frames reference their locals: do not keep them alive


def transformations_before(kind: str) -> tuple[int, str] | None:
    """How many transformations run before the caller in its enclosing optax chains.

    Call it first thing in a private transformation's ``init`` (``kind="init"``) or ``update``
    (``kind="update"``), directly (it inspects its caller's caller). Returns ``None`` when the
    caller is first in every directly enclosing ``optax.chain``/``optax.named_chain`` (or is
    not called by one), else ``(k, name)``: ``k ≥ 1`` transformations of the combinator
    ``name`` come before it. Fails open (``None``) where frames cannot be inspected.
    """
    return _caller_position(kind, 2)  # 1 level up: the transformation, 2: its caller


def refuse_if_not_first(kind: str) -> None:
    """Raise :class:`~adaclip.errors.InvalidHyperparameterError` when a transformation runs
    before the calling private transformation in an enclosing optax chain (see
    :func:`transformations_before`; call it directly from ``init``/``update``). Raised before
    the private transformation reads or changes anything."""
    found = _caller_position(kind, 2)
    if found is None:
        return
    count, combinator = found
    raise InvalidHyperparameterError(
        f"the private transformation is not the first transformation of its {combinator}: "
        f"{count} transformation(s) run before it{' in update' if kind == 'update' else ''}, "
        "on the raw per-unit gradients, which the mechanism has not privatised (their output "
        "and state depend on individual examples, e.g. Adam's moments or a global-norm clip "
        "of the whole batch). Put the private transformation first: "
        "adaclip_jax.private_chain(private, *rest) builds optax.chain(private, *rest), e.g. "
        "private_chain(adaclip_jax.adaclip(...), optax.clip_by_global_norm(1.0), optax.adam(1e-3))"
    )


#: How many enclosing frames :func:`refuse_if_wrapped` inspects: ``optax.MultiSteps.update``
#: calls the inner update through ``lax.cond``, a few dozen JAX frames below it.
_MAX_WRAPPER_DEPTH = 256


def _wrapper_codes() -> dict[CodeType, str]:
    """The code objects of wrappers that may not hold a private transformation."""
    codes: dict[CodeType, str] = {}
    multi = getattr(optax, "MultiSteps", None)
    for name in ("init", "update"):
        fn = getattr(multi, name, None)
        code = getattr(fn, "__code__", None)
        if code is not None:
            codes[code] = "optax.MultiSteps"
    return codes


_wrappers: dict[CodeType, str] | None = None


def refuse_if_wrapped(kind: str) -> None:
    """Raise :class:`~adaclip.errors.InvalidHyperparameterError` when the calling private
    transformation's ``init``/``update`` runs inside ``optax.MultiSteps``.

    ``MultiSteps`` averages the gradients it is given over ``k`` calls into one
    parameter-shaped array and only then calls the transformation it wraps. The private
    transformation needs the per-unit gradients (a leading batch axis) to clip each unit
    before anything sums them; after ``MultiSteps`` it would receive the raw, unclipped mean
    (and fail on its shape, with a message that does not say why). Large logical batches are
    built on the clipped side instead: :func:`adaclip_jax.clipped_sum_grads` clips a batch
    chunk by chunk, and :func:`adaclip_jax.add_clipped_sums` adds the clipped sums of several
    physical batches before the one ``update`` that adds the noise. Fails open where frames
    cannot be inspected (as :func:`transformations_before`).
    """
    global _wrappers
    if _wrappers is None:
        _wrappers = _wrapper_codes()
    frame = _current_frame(1)
    try:
        for _ in range(_MAX_WRAPPER_DEPTH):
            if frame is None:
                return
            name = _wrappers.get(frame.f_code)
            if name is not None:
                raise InvalidHyperparameterError(
                    f"the private transformation cannot run inside {name} ({kind}): it averages "
                    "raw per-unit gradients over several calls before the private transformation "
                    "sees them, so nothing would clip each unit. For large logical batches, clip "
                    "each physical batch with adaclip_jax.clipped_sum_grads(loss_fn, private, "
                    "micro_batch_size=...), add the results with adaclip_jax.add_clipped_sums, "
                    "and call the chain's update once per logical batch (see the JAX page, "
                    "'Large logical batches')"
                )
            frame = frame.f_back
    finally:
        del frame
