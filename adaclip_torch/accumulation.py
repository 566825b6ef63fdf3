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

from collections.abc import Sequence
from typing import Any

import torch

from adaclip.errors import InvalidGradientError
from adaclip.transform import check_per_example_grads

__all__ = ["PendingSum", "given_grads"]

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
