"""The interface of the per-sample engines: how one batch becomes the clipped sum of its units.

A *unit* is what the privacy guarantee protects: one example, or with ``user_ids`` one user,
whose per-unit gradient is the sum of its examples' (:func:`group_by_unit`). Its gradient
``g_i`` covers all ``K`` privatised tensors together (one vector). With the centre ``a`` and
scale ``b`` of the strategy's transform (functions of the state, i.e. of earlier releases
only), an engine computes, per tensor ``k``,

.. math::
    S_k = \\sum_i c_i\\,(g_{ik} - a_k)/b_k,

with the clip factors ``c_i`` from :func:`adaclip.strategies.group_clip_factors`: per clip
group ``G`` of radius ``r_G`` (the radii satisfy ``Σ_G r_G² ≤ 1``), the strategy's
``clip_factors`` of the group's squared transformed norm ``‖w_{iG}‖² = Σ_{k∈G} ‖(g_{ik} − a_k)/b_k‖²``
give ``‖c_i w_{iG}‖ ≤ r_G`` (clipping: ``c_i = min(1, r_G/‖w_{iG}‖)``); then the strategy's
auxiliary sums (:func:`adaclip.strategies.auxiliary_sums`, e.g. the quantile rule's count),
from the same norms and factors. Every unit's contribution ``c_i (g_i − a)/b`` thus has norm
at most 1: that is the sensitivity the noise is calibrated to, whatever engine produced the
sum.

Two rules make that hold in floating point:

- the squared norms an engine computes are *upper bounds* of the exact ones: the computed
  value times ``1 + η`` (:func:`adaclip.transform.rounding_margin`, or the Triton kernels'
  :func:`~adaclip_torch.kernels.reference.sq_norms_margin` for their blocked sums), and the
  ghost norms of :mod:`adaclip_torch.ghost` add a bound on the rounding error of their
  expansion. A larger norm gives a smaller factor, so rounding can only over-clip, never
  under-clip;
- a unit whose squared norm is not finite (a NaN/inf entry, or an overflow) gets the factor 0
  and its rows are *dropped* from the sum rather than multiplied (``0·inf`` is NaN), so it
  contributes exactly 0: within the sensitivity, and the release stays finite, so it does not
  reveal that unit. With ``nonfinite="raise"`` the engine raises
  :class:`~adaclip.errors.InvalidGradientError` instead, before anything changes.

Engines only *read* the batch (``p.grad_sample``, the hooks' captures) and the clip state:
they never write parameters, ``p.grad``, ``p.grad_sample``, the state or the accountant, so an
error raised by :meth:`~PerSampleEngine.unit_sources`, :meth:`~PerSampleEngine.clipped_sum`,
:meth:`~PerSampleEngine.collect` or :meth:`~PerSampleEngine.clip` leaves the optimizer exactly
as it was. A fused engine's :meth:`~PerSampleEngine.release` draws the noise (the optimizer
rewinds the generator if the step fails before it is released) and *returns* the released
gradient and the next state: :class:`~adaclip_torch.optimizer.DPOptimizer` writes ``p.grad``,
decides when the step counts as released, accounts it and commits the state.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeAlias

import torch

from adaclip.errors import InvalidGradientError
from adaclip.strategies import ClipState
from adaclip_torch.ghost import GhostLayer, TiedGhost
from adaclip_torch.grad_sample import GradSampleHooks
from adaclip_torch.noise import NoiseSource

__all__ = ["EngineContext", "PerSampleEngine", "Source", "StepInputs", "group_by_unit"]

Tensor = torch.Tensor

#: One privatised parameter's per-unit gradients in a batch: an ``(n, *shape)`` tensor, or a
#: ``(GhostLayer, parameter name)`` pair — a ``(TiedGhost, "weight")`` pair for a weight tied
#: across modules — whose gradients are never formed in full.
Source: TypeAlias = Tensor | tuple[GhostLayer | TiedGhost, str]


@dataclass(frozen=True, eq=False)
class EngineContext:
    """What an engine knows of the optimizer it serves, fixed at construction: ``params`` (the
    privatised parameters, in the optimizer's order), ``param_names`` (their names in the
    model), ``shapes`` and ``dtype`` (the statistics dtype: float64 if any parameter is
    float64, else float32)."""

    params: tuple[Tensor, ...]
    param_names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtype: torch.dtype


@dataclass(frozen=True, eq=False)
class StepInputs:
    """What one engine call reads from the optimizer as it is at that call (it changes
    between calls, so the optimizer passes it in rather than the engine keeping it).

    - ``state``: the strategy state the units are clipped with (it moves on at every release);
    - ``transformed(strategy)``: the centre ``a`` and scale ``b`` of ``state``
      (``strategy.transform``), computed on demand and cached by the optimizer, so that the
      clipping pass and the release share them (and the fused AdaCliP pass, which builds
      ``b`` itself, never forms them);
    - ``nonfinite``: ``"zero"`` (drop a unit with a non-finite norm) or ``"raise"``;
    - ``hooks``: the grad-sample hooks attached now (``None`` without, or after
      ``remove_hooks``), whose captures the ghost engine reads.
    """

    state: ClipState
    transformed: Callable[[Any], tuple[Any, Any]]
    nonfinite: str = "zero"
    hooks: GradSampleHooks | None = None


class PerSampleEngine(abc.ABC):
    """Turns the batch left by ``loss.backward()`` into the clipped sum (see the module doc).

    - :meth:`unit_sources`: this batch's per-unit gradients, one :data:`Source` per privatised
      parameter (validated shapes, statistics dtype), or per-user sums with ``user_ids``;
    - :meth:`clipped_sum`: the ``K`` per-tensor clipped sums of given sources, then the
      strategy's auxiliary sums (also used for units handed in by
      :meth:`~adaclip_torch.optimizer.DPOptimizer.add_unit_gradients`);
    - :meth:`collect`: the per-example gradients of every parameter, materialised.

    An engine with ``fuses_release`` (the fused kernels) also clips (:meth:`clip`) and
    releases (:meth:`release`: noise once, rescale, next state) in its own passes; the optimizer
    then uses these for a step on a fresh batch, and the core path (:meth:`clipped_sum`, then
    the core release) for everything else (virtual steps, given units, empty batches).

    Every method takes the optimizer's :class:`StepInputs` of the moment.
    """

    #: Whether :meth:`clip` and :meth:`release` replace :meth:`clipped_sum` and the core release.
    fuses_release: ClassVar[bool] = False

    def __init__(self, context: EngineContext) -> None:
        self._context = context

    @property
    def context(self) -> EngineContext:
        return self._context

    @abc.abstractmethod
    def unit_sources(
        self, inputs: StepInputs, user_ids: Tensor | None = None, *, require: bool
    ) -> list[Source] | None:
        """One source per privatised parameter for this batch's units; per-user sums
        (materialised ``(U, *shape)`` tensors) with ``user_ids``. ``None`` when no backward
        left per-example gradients and ``require`` is false; raises
        :class:`~adaclip.errors.InvalidGradientError` when ``require`` is true then, when
        ``user_ids`` is given without gradients, or for malformed gradients."""

    @abc.abstractmethod
    def clipped_sum(self, inputs: StepInputs, strategy: Any, sources: Sequence[Source]) -> list[Tensor]:
        """``S_k = Σ_i c_i (g_ik − a_k)/b_k`` for ``k = 1..K`` (new tensors), then the
        strategy's auxiliary sums (0-d), clipped with ``inputs.state``."""

    @abc.abstractmethod
    def collect(self, inputs: StepInputs) -> list[Tensor] | None:
        """This batch's ``(n, *shape)`` per-example gradients of every privatised parameter
        (statistics dtype), or ``None`` if there are none."""

    def clip(self, inputs: StepInputs, strategy: Any, user_ids: Tensor | None = None) -> Any:
        """Fused engines: the first pass of a step on this batch (per-unit norms and clip
        factors); returns what :meth:`release` needs. Changes nothing."""
        raise NotImplementedError(f"{type(self).__name__} does not fuse the release: use clipped_sum")

    def release(
        self,
        inputs: StepInputs,
        strategy: Any,
        pending: Any,
        noise_multiplier: float,
        *,
        noise: NoiseSource,
        expected_batch_size: float,
    ) -> tuple[list[Tensor], ClipState]:
        """Fused engines: the second pass (clipped sum, noise drawn once from ``noise``,
        rescale by ``B̄``, next state); returns the released gradient (one tensor per
        parameter) and the next state, which the optimizer commits."""
        raise NotImplementedError(f"{type(self).__name__} does not fuse the release: use the core release")

    def _check_nonfinite(self, inputs: StepInputs, sq: Sequence[Tensor]) -> None:
        """With ``nonfinite="raise"``: raise naming the parameters where a unit's squared norm
        is not finite (a NaN/inf entry, or an overflow). With ``"zero"`` nothing happens here:
        the clip factor of such a unit is 0 (:func:`adaclip.transform.clip_factors`)."""
        if inputs.nonfinite != "raise":
            return
        names = self._context.param_names
        bad = [name for name, v in zip(names, sq, strict=True) if not bool(torch.isfinite(v).all())]
        if bad:
            raise InvalidGradientError(
                f"per-unit gradients of {', '.join(map(repr, bad))} contain NaN or inf (or their norm "
                "overflows); nonfinite='raise' refuses the step (the default 'zero' drops such units)"
            )


def group_by_unit(per_example_grads: Sequence[Tensor], unit_ids: Tensor) -> list[Tensor]:
    """Sum the per-example gradients of each unit (user): ``G_u = Σ_{i: id_i = u} g_i``.

    Returns ``(U, *shape)`` tensors, ``U`` the number of distinct ids, ordered by id. Used for
    user-level privacy (the docs' *User-level DP* page): clipping ``G_u`` bounds each user's
    whole contribution.
    """
    n = int(per_example_grads[0].shape[0]) if per_example_grads else 0
    if not isinstance(unit_ids, Tensor):
        unit_ids = torch.as_tensor(unit_ids)
    if unit_ids.ndim != 1 or int(unit_ids.shape[0]) != n:
        raise InvalidGradientError(
            f"user_ids must be a 1-d tensor with one id per example ({n}), got shape {tuple(unit_ids.shape)}"
        )
    if unit_ids.dtype.is_floating_point or unit_ids.dtype.is_complex or unit_ids.dtype == torch.bool:
        raise InvalidGradientError(f"user_ids must be integers, got dtype {unit_ids.dtype}")
    unique, inverse = torch.unique(unit_ids, return_inverse=True)
    out = []
    for g in per_example_grads:
        grouped = torch.zeros((int(unique.shape[0]), *g.shape[1:]), dtype=g.dtype, device=g.device)
        out.append(grouped.index_add_(0, inverse.to(g.device), g))
    return out
