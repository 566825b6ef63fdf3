"""Refuse a step that would exceed the privacy budget, saying what was planned.

Every front end (the PyTorch optimizer, the JAX tracker) checks the budget *before* a step
changes anything, with this one function, so that the refusal reads the same everywhere: the
step, its σ and accounted rate, the budget (ε, δ) and the ε already spent, and the caller's
account of the planned run (``explain()``: the user's ``q`` next to the accounted rate ``b·q``,
the planned epochs and steps). Only public quantities appear in the message.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from adaclip.errors import BudgetExceededError

__all__ = ["check_budget"]


def _spent(accountant: Any) -> str:
    """``": the budget is ε at δ, and n accounted step(s) have spent ε'"`` (empty if unknown)."""
    target, delta = getattr(accountant, "target_epsilon", None), getattr(accountant, "delta", None)
    if target is None or delta is None:
        return ""
    try:  # (an accountant-like object of the user's may not answer these)
        return (f": the budget is epsilon={target:g} at delta={delta:g}, and {accountant.steps} accounted "
                f"step(s) have spent epsilon={accountant.epsilon(delta):.4g}")  # fmt: skip
    except Exception:  # noqa: BLE001 - the refusal itself must not fail
        return ""


def check_budget(
    accountant: Any,
    noise_multiplier: float,
    sample_rate: Any,
    *,
    step: int,
    records: bool,
    explain: Callable[[], str] | None = None,
) -> None:
    """Raise :class:`BudgetExceededError` if recording step ``step`` would exceed the budget.

    ``records``: whether this step is recorded at all (with banded noise only the first step of
    each cycle of ``b`` is; the others are covered by its composition). The message gives the
    budget, what is spent, and ``explain()`` (computed only when refusing)."""
    if accountant is None or not records:
        return
    if accountant.would_exceed(noise_multiplier=noise_multiplier, sample_rate=sample_rate):
        raise BudgetExceededError(
            f"step {step} (noise_multiplier={noise_multiplier}, accounted sample_rate={sample_rate}) "
            f"would exceed the accountant's privacy budget{_spent(accountant)}"
            f"{explain() if explain is not None else ''}; nothing was changed"
        )
