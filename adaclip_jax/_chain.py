"""The one valid order of an optimizer with a private transformation, and checks of it.

**Rule: the private transformation comes first.** The per-unit gradients ``g_1, …, g_n`` are
the private data; the private transformation (:func:`adaclip_jax.adaclip`,
:func:`adaclip_jax.flat_clip`, :func:`adaclip_jax.private_aggregate`, …) is the Gaussian
mechanism that turns them into the release ``g̃ = b ⊙ (Σ_i w̄_i + σ z)/B̄ + a``, whose
sensitivity to one unit is bounded by clipping (``‖w̄_i‖ ≤ 1``). Everything *after* it reads
only ``g̃`` (and its own state, a function of earlier releases): post-processing, which costs
no privacy. Anything *before* it reads the ``g_i`` in the clear, so

- its output, the mechanism's input, need not be a function of one unit at a time:
  ``optax.clip_by_global_norm`` scales every unit by the norm of the whole stack, so removing one
  unit changes every other unit's input and the clipped sum by more than the sensitivity the
  accountant assumes;
- its state is a function of individual examples that no noise protects: ``optax.adam``'s moments
  ``μ ← β_1 μ + (1 − β_1) g`` of the raw stack (``μ`` silently broadcasts from the parameters'
  shape to ``(n, …)``), kept across steps, stored in checkpoints and read by later steps.

Neither changes a shape, so the private transformation cannot tell from its input whether it
was first (``f(g)`` looks like ``g``). Three defences:

1. :func:`private_chain` ``(private, *rest)`` builds ``optax.chain(private, *rest)`` and refuses
   anything else in first place, or a second private transformation;
2. inside ``optax.chain``/``optax.named_chain`` the private transformation's ``init`` and
   ``update`` refuse to run when the chain has already run another member
   (:mod:`adaclip_jax._position`: it inspects the chain's frames, at trace time);
3. :func:`check_chain` / :func:`check_state_order` inspect the structure of the optimizer's state,
   which also catches wrappers that the frame check does not see (``optax.MultiSteps``,
   ``optax.masked``, ``optax.partition``, ``optax.apply_if_finite`` around the private
   transformation): ``optax.chain``'s state is the plain tuple of its members' states in order,
   ``optax.named_chain``'s the ordered dict of them, so the private state
   (:class:`adaclip_jax.AdaClipState`) must be reached from the root by first positions only.

A per-unit map applied to each unit alone (``g_i ↦ f(g_i)``, no state, no other unit read) is
harmless before the mechanism, but it is not an optax transformation: apply it to the stacked
gradients before calling ``update`` (e.g. inside the function that computes them).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import jax
import optax

from adaclip.errors import AdaClipError, InvalidHyperparameterError
from adaclip_jax._state import AdaClipState
from adaclip_jax._transform import PrivateTransformation

__all__ = ["private_chain", "check_chain", "check_state_order"]

_FIX = (
    "put the private transformation first: adaclip_jax.private_chain(private, *rest), "
    "e.g. private_chain(adaclip_jax.adaclip(...), optax.adam(1e-3))"
)


def _is_transformation(tx: Any) -> bool:
    return callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))


def private_chain(private: PrivateTransformation, /, *rest: Any) -> optax.GradientTransformationExtraArgs:
    """``optax.chain(private, *rest)``: the private transformation first, then the rest.

    The only valid order (see the module): ``private`` turns the per-unit gradients into the
    noised release and each of ``rest`` (``optax.clip_by_global_norm``, ``optax.adam``,
    schedules, …) post-processes that release. The result *is* ``optax.chain(private, *rest)``
    (same state, same updates, bit for bit), so it can be jitted, checkpointed and wrapped in
    :class:`adaclip_jax.PrivacyTracker` steps like any optax chain; extra ``update`` keywords
    (``noise_multiplier=``, ``unit_mask=``) are forwarded by ``optax.chain``.

    Args:
      private: an adaclip_jax private transformation (:func:`adaclip_jax.adaclip`,
        :func:`adaclip_jax.flat_clip`, :func:`adaclip_jax.private_aggregate`, …).
      *rest: optax transformations applied, in order, to the release.

    Raises:
      InvalidHyperparameterError: ``private`` is not a private transformation (the message says
        where the private one is when it is among ``rest``), one of ``rest`` is a second private
        transformation (it would read the first one's release, not per-unit gradients, and
        clip and noise it again under an accounting that does not describe it) or is not an
        optax transformation. Nothing is built.
    """
    if not isinstance(private, PrivateTransformation):
        where = [i for i, t in enumerate(rest, start=1) if isinstance(t, PrivateTransformation)]
        hint = (
            f"; the private transformation is argument {where[0]}: move it to the front"
            if where
            else "; no private transformation was given"
        )
        raise InvalidHyperparameterError(
            f"private_chain: the first argument must be an adaclip_jax private transformation "
            f"(adaclip, flat_clip, private_aggregate, ...), got {type(private).__name__}{hint}. "
            "Any transformation before the private one reads the raw per-unit gradients"
        )
    private._slot()  # a copy without the transformation's attributes raises here
    for i, tx in enumerate(rest, start=1):
        if isinstance(tx, PrivateTransformation):
            raise InvalidHyperparameterError(
                f"private_chain: argument {i} is a second private transformation; it would read "
                "the first one's release instead of per-unit gradients. Use one private "
                "transformation, first"
            )
        if not _is_transformation(tx):
            raise InvalidHyperparameterError(
                f"private_chain: argument {i} is not an optax GradientTransformation "
                f"(no init/update), got {type(tx).__name__}"
            )
    return optax.chain(private, *rest)


def _describe(state: Any, depth: int = 0) -> str:
    """A short name for a transformation's state: its type, with the members of a chain."""
    if depth < 2 and type(state) is tuple:
        return "chain(" + ", ".join(_describe(x, depth + 1) for x in state) + ")"
    if depth < 2 and isinstance(state, dict):
        return "named_chain(" + ", ".join(f"{k}: {_describe(v, depth + 1)}" for k, v in state.items()) + ")"
    return type(state).__name__


def _private_paths(node: Any, path: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], str | None]]:
    """Each private state in ``node`` as ``(path, problem)``: ``problem`` is ``None`` when it
    is reached by first positions of chain states only, else why it is not first."""
    if isinstance(node, AdaClipState):
        yield path, None
        return
    if type(node) is tuple or isinstance(node, dict):  # optax.chain / optax.named_chain states
        items = list(enumerate(node)) if type(node) is tuple else list(node.items())
        for position, (label, child) in enumerate(items):
            here = path + (f"[{label!r}]",)
            for found, problem in _private_paths(child, here):
                if problem is None and position > 0:
                    before = ", ".join(_describe(v) for _, v in items[:position])
                    problem = (
                        f"{position} transformation(s) come before it (states: {before}), "
                        "and they read the raw per-unit gradients"
                    )
                yield found, problem
        return
    is_state = lambda x: isinstance(x, AdaClipState)  # noqa: E731
    inner = [x for x in jax.tree_util.tree_leaves(node, is_leaf=is_state) if is_state(x)]
    wrapped = (
        f"it is wrapped in {type(node).__name__}, a transformation that sees the per-unit "
        "gradients before the private one does (accumulates, masks, partitions or skips "
        "them); only optax.chain / optax.named_chain may hold it"
    )
    for _ in inner:
        yield path + (f"<{type(node).__name__}>",), wrapped


def check_state_order(opt_state: Any) -> None:
    """Refuse an optimizer state in which the private transformation is not first.

    ``opt_state`` is what ``tx.init(params)`` returned (or a later state of the same
    optimizer). ``optax.chain`` concatenates its members' states into a plain tuple in order
    and ``optax.named_chain`` into an ordered dict, so the private transformation ran first
    exactly when its :class:`adaclip_jax.AdaClipState` is reached from the root through first
    positions of such containers only. A state at position ``k > 0`` means ``k``
    transformations ran before it on the raw per-unit gradients; a state inside any other
    container (``optax.MultiSteps``, ``optax.masked``, ``optax.partition``,
    ``optax.apply_if_finite``, …) means a wrapper saw them first. Both are refused, as is a
    state with no private transformation or with two. Reads only the structure (no values):
    cheap, and valid for abstract states (``jax.eval_shape``).

    Limit: a hand-written transformation whose state is a plain tuple or dict is taken for a
    chain; prefer :func:`private_chain` to build the optimizer.

    Raises:
      InvalidHyperparameterError: with the path of the private state and the fix.
    """
    found = list(_private_paths(opt_state, ()))
    if not found:
        raise InvalidHyperparameterError(
            "the optimizer state holds no private transformation state (AdaClipState): the "
            "optimizer would apply the raw per-unit gradients; " + _FIX
        )
    if len(found) > 1:
        paths = ", ".join("".join(p) or "<root>" for p, _ in found)
        raise InvalidHyperparameterError(
            f"the optimizer state holds {len(found)} private transformation states (at {paths}): "
            "a second private transformation reads the first one's release, not per-unit "
            "gradients; use one private transformation, first"
        )
    ((path, problem),) = found
    if problem is not None:
        raise InvalidHyperparameterError(
            f"the private transformation is not first in the optimizer (its state is at "
            f"opt_state{''.join(path)}): {problem}; {_FIX}"
        )


def check_chain(tx: Any, params: Any) -> None:
    """Refuse an optimizer in which the private transformation is not first.

    Builds the state structure of ``tx.init(params)`` abstractly (``jax.eval_shape``: no
    memory for moments, no values read) and checks it with :func:`check_state_order`. A
    transformation before the private one inside ``optax.chain``/``optax.named_chain`` is
    already refused by the private transformation's own ``init``; this adds the wrappers and
    the "no private transformation" case. Call it once when the optimizer is built (e.g.
    before the training loop); :func:`private_chain` needs no check.

    Raises:
      InvalidHyperparameterError: ``tx`` is not an optax transformation, or its private
        transformation is missing, repeated, wrapped or not first.
    """
    if not _is_transformation(tx):
        raise InvalidHyperparameterError(
            f"check_chain: tx is not an optax GradientTransformation (no init/update), got {type(tx).__name__}"
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # init's warnings (e.g. noise-dominated) belong to the real init
        try:
            state = jax.eval_shape(tx.init, params)
        except AdaClipError:
            raise
        except Exception:  # an init that cannot be traced abstractly: run it for real
            state = tx.init(params)
    check_state_order(state)
