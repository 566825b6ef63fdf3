"""The pending clipped sum: virtual steps, and units handed in between two releases.

:meth:`DPOptimizer.accumulate <adaclip_torch.optimizer.DPOptimizer.accumulate>` (one physical
batch of a logical batch) and :meth:`~adaclip_torch.optimizer.DPOptimizer.add_unit_gradients`
(units whose gradients the caller gives, e.g. an auditor's canaries) clip their units and add
them to a :class:`PendingSum`; the next ``step()`` adds its own batch and releases the whole
sum once, under one noise draw, accounted once. The sum is un-noised: it is never saved in a
checkpoint and never released twice (``zero_grad``/``discard_pending`` drop it).

At user level every user must be one unit of the release, so each user's examples must all
be in one physical batch: :meth:`PendingSum.units_with` refuses a user met again, or user-level
and example-level batches mixed, before anything changes.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch

from adaclip.errors import InvalidGradientError
from adaclip.transform import check_per_example_grads

__all__ = ["PendingSum", "VirtualSteps", "given_grads"]

Tensor = torch.Tensor

#: The units in a pending sum: ``None`` (none from a batch), ``"examples"``, or the user ids.
Units = str | frozenset[int] | None


class PendingSum:
    """The clipped sum gathered since the last release (``summed``, ``None`` when there is
    none) and the units it holds (``units``)."""

    def __init__(self) -> None:
        self.summed: list[Tensor] | None = None
        self.units: Units = None

    def set(self, summed: list[Tensor], units: Units) -> None:
        self.summed = summed
        self.units = units

    def clear(self) -> bool:
        """Drop the pending sum; returns whether there was one."""
        had_sum = self.summed is not None
        self.summed = None
        self.units = None
        return had_sum

    def plus(self, summed: list[Tensor]) -> list[Tensor]:
        """``summed`` plus the pending sum, entry by entry (new tensors; ``summed`` itself when
        nothing is pending)."""
        if self.summed is None:
            return summed
        return [a + s for a, s in zip(self.summed, summed, strict=True)]

    def units_with(self, user_ids: Tensor | None) -> str | frozenset[int]:
        """The units of this physical batch (``"examples"``, or its user ids), checked against
        those already in the pending sum and joined with them: a user in two physical batches of
        one logical batch, or user-level and example-level batches mixed, would be two units of
        one release, so it raises :class:`InvalidGradientError` (nothing changes)."""
        if user_ids is None:
            units: str | frozenset[int] = "examples"
        else:
            units = frozenset(int(u) for u in torch.as_tensor(user_ids).reshape(-1).unique().tolist())
        pending = self.units
        if pending is None:
            return units
        if isinstance(pending, str) or isinstance(units, str):
            if pending != units:
                raise InvalidGradientError(
                    "this physical batch is "
                    + ("user-level (user_ids given)" if pending == "examples" else "example-level (no user_ids)")
                    + " but the pending sum of its logical batch was gathered "
                    + ("per example" if pending == "examples" else "per user")
                    + ": one logical batch must use one kind of unit; nothing was changed"
                )
            return units
        again = pending & units
        if again:
            raise InvalidGradientError(
                f"user(s) {sorted(again)[:5]} already contributed to an earlier physical batch of this logical "
                "batch: each user's examples must all be in one physical batch (otherwise the user is two "
                "units of one release); adaclip_torch.BatchMemoryManager splits at user boundaries. Nothing "
                "was changed"
            )
        return pending | units


def given_grads(
    grads: Any,
    *,
    params: Sequence[Tensor],
    names: Sequence[str],
    shapes: Sequence[tuple[int, ...]],
    dtype: torch.dtype,
    argument: str,
    what: str,
    check_finite: bool = True,
) -> list[Tensor]:
    """Validate gradients handed in by the caller (one ``(n, *p.shape)`` tensor per privatised
    parameter) and return them detached, in the statistics dtype, on the parameters' devices.
    Raises :class:`InvalidGradientError` naming ``argument``; nothing is changed."""
    if isinstance(grads, Tensor) or not isinstance(grads, (list, tuple)):
        raise InvalidGradientError(
            f"{argument} must be a list with one (n, *p.shape) tensor per privatised parameter, "
            f"got {type(grads).__name__}"
        )
    for name, g in zip(names, grads):
        if not isinstance(g, Tensor):
            raise InvalidGradientError(f"{what} gradient of {name!r} is not a tensor: {type(g).__name__}")
    check_per_example_grads(list(grads), list(shapes), names=list(names), check_finite=check_finite)
    return [g.detach().to(dtype=dtype, device=p.device) for g, p in zip(grads, params, strict=True)]


class VirtualSteps:
    """The pending-sum side of :class:`~adaclip_torch.optimizer.DPOptimizer` (a mixin): virtual
    steps (:meth:`accumulate`), units handed in (:meth:`add_unit_gradients`), and dropping what
    is pending (:meth:`discard_pending`, :meth:`zero_grad`). The sum lives in the optimizer's
    :class:`PendingSum` (``_pending``); it is clipped with the optimizer's own engine."""

    # set by DPOptimizer.__init__
    _pending: PendingSum
    _physical_batches: Any
    _steps: int
    params: list[Tensor]
    noise_schedule: Any
    original_optimizer: Any

    def accumulate(self, *, user_ids: Tensor | None = None) -> None:
        """Virtual step: clip and sum this physical batch into a buffer, release nothing.

        The next :meth:`step` adds its own batch (if any) and releases the whole logical
        batch once, with one noise draw: ``Σ`` over all physical batches of the clipped
        units, then ``+σz``, ``/B̄``. Set ``expected_batch_size`` to the *logical* batch size.
        At user level each user's examples must all be in one physical batch: a user id met
        again in a later physical batch of the same logical batch, or user-level and
        example-level physical batches mixed, raise :class:`InvalidGradientError` before
        anything changes (the user would count as two units in one release).
        Clears ``p.grad_sample`` and ``p.grad`` afterwards (it is :meth:`zero_grad`).
        :class:`adaclip_torch.BatchMemoryManager` drives it for you (Opacus's loop).
        """
        self._check_unchanged()
        units = self._pending.units_with(user_ids)
        strategy = self._strategy_at(self._steps)
        self._releaser.check(strategy, self.noise_schedule.at(self._steps).noise_multiplier)
        with torch.no_grad():
            summed = self._pending_sum(strategy, user_ids, require=True, check_units=False)
        self._pending.set(summed, units)
        self._clear_per_example_grads()
        for p in self.params:
            p.grad = None

    def add_unit_gradients(self, per_unit_grads: Sequence[Tensor]) -> None:
        """Add units whose gradients are given to the next release (white-box auditing).

        ``per_unit_grads``: one ``(n, *p.shape)`` tensor per privatised parameter, in
        :attr:`params` order, ``n ≥ 1`` units. They are clipped with the current state, exactly
        as the batch's units are (same centre, scale, clip rule, auxiliary count), and summed
        into the pending buffer that the next :meth:`step` releases with the batch, under one
        noise draw. The next ``step()`` needs no backward if only such units are pending.

        These units are *data*: they are privatised by the mechanism like any other and their
        influence on the release is bounded by the clipping. This is how
        :class:`adaclip_torch.audit.GradientCanaryAuditor` inserts canaries whose gradient the
        auditor chooses. ``expected_batch_size`` and ``sample_rate`` are not changed: in an audit
        the canaries are a few extra units of a large data set.

        Raises :class:`InvalidGradientError` for gradients of the wrong number, shape, or an
        empty batch (nothing changes then). A unit with NaN/inf entries follows ``nonfinite``
        (``"zero"``: it contributes nothing; ``"raise"``: refused, nothing changes).
        """
        grads = self._given_grads(per_unit_grads, argument="per_unit_grads", what="unit", check_finite=False)
        self._check_unchanged()
        strategy = self._strategy_at(self._steps)
        self._releaser.check(strategy, self.noise_schedule.at(self._steps).noise_multiplier)
        with torch.no_grad():
            summed = self._pending.plus(self._engine.clipped_sum(self._engine_inputs(), strategy, grads))
        self._pending.summed = summed  # the units of the batches already pending stay as they were

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear ``p.grad`` (wrapped optimizer), the per-example gradients and anything pending.

        Pending means: the clipped sum gathered by :meth:`accumulate` or
        :meth:`add_unit_gradients` and not yet released. It is dropped (:meth:`discard_pending`),
        with a :class:`UserWarning` when there was such a sum: a logical batch that is abandoned
        (an error, an out-of-memory retry) must not be released with the next one, where its
        examples would be counted a second time in one noisy sum while the step is accounted once.
        In a gradient-accumulation loop call ``zero_grad()`` only after :meth:`step`, never between
        :meth:`accumulate` calls of one logical batch (``accumulate()`` already clears what the next
        backward needs cleared). Inside :class:`adaclip_torch.BatchMemoryManager`'s loop it keeps the
        pending sum of the logical batch in progress (Opacus's loop calls it on every physical batch).
        """
        if self._physical_batches is not None:
            # a BatchMemoryManager is driving the steps: the pending sum belongs to the logical
            # batch in progress (the manager itself drops a logical batch that was not released)
            self._clear_per_example_grads()
            self.original_optimizer.zero_grad(set_to_none=set_to_none)
            return
        if self.discard_pending():
            warnings.warn(
                "zero_grad() discarded the clipped sum gathered by accumulate() since the last "
                "step(): those examples will not be released. In a gradient-accumulation loop call "
                "zero_grad() after step() only; call discard_pending() to drop a batch on purpose "
                "without this warning",
                UserWarning,
                stacklevel=2,
            )
        self.original_optimizer.zero_grad(set_to_none=set_to_none)

    def discard_pending(self) -> bool:
        """Drop everything gathered for the next release and not yet released: the clipped sum of
        :meth:`accumulate` / :meth:`add_unit_gradients` and the per-example gradients of the last
        backward pass. Nothing is released or accounted, the statistics and the noise generator are
        untouched, and :meth:`state_dict` works again. Use it to abandon a logical batch (e.g.
        before retrying after an out-of-memory error). Returns whether a pending clipped sum was
        dropped."""
        had_sum = self._pending.clear()
        self._clear_per_example_grads()
        return had_sum


    @property
    def _accumulated(self) -> list[Tensor] | None:
        """The pending clipped sum (``None``: nothing pending); see :mod:`adaclip_torch.accumulation`."""
        return self._pending.summed
