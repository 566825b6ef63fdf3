"""The privacy budget around a private step: refuse, write ahead, record.

Each released step is recorded by the optimizer's accountant (:class:`adaclip.accounting.Accountant`)
as one composition at ``(σ_t, q)`` — or, with banded noise, once per cycle of ``b`` steps at
rate ``p = b·q`` (``records`` says whether this step is such a step). In a step's life:

1. :func:`check_budget` — before anything changes, a step that would exceed the budget raises
   :class:`~adaclip.errors.BudgetExceededError`;
2. :func:`write_ahead` — with a crash-safe ledger, the record is on disk before any value
   computed from the step's noise can leave;
3. :func:`record` — once the step is released, the accountant counts it in memory.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from adaclip.errors import BudgetExceededError

__all__ = ["check_budget", "record", "write_ahead"]


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

    The message gives the budget, what is spent, and ``explain()`` (the caller's account of the
    planned run: the noise, the rates, the planned steps), computed only when refusing."""
    if accountant is None or not records:
        return
    if accountant.would_exceed(noise_multiplier=noise_multiplier, sample_rate=sample_rate):
        spent = ""
        target, delta = getattr(accountant, "target_epsilon", None), getattr(accountant, "delta", None)
        if target is not None and delta is not None:
            try:  # (an accountant-like object of the user's may not answer these)
                spent = (f": the budget is epsilon={target:g} at delta={delta:g}, and {accountant.steps} accounted "
                         f"step(s) have spent epsilon={accountant.epsilon(delta):.4g}")  # fmt: skip
            except Exception:  # noqa: BLE001 - the refusal itself must not fail
                spent = ""
        raise BudgetExceededError(
            f"step {step} (noise_multiplier={noise_multiplier}, accounted sample_rate={sample_rate}) "
            f"would exceed the accountant's privacy budget{spent}{explain() if explain is not None else ''}; "
            "nothing was changed"
        )


def write_ahead(accountant: Any, noise_multiplier: float, sample_rate: Any, *, records: bool) -> bool:
    """With an accountant that keeps a crash-safe ledger (``Accountant(ledger=...)``), append
    this step's record and ``fsync`` it *before* anything computed from the step's noise can
    leave (the noisy all-reduce, ``p.grad``, the wrapped optimizer): a crash at any later
    point can then only over-count. Returns whether it wrote (:func:`record` then records
    the step in memory without writing it again). A step that fails before its release
    leaves the ledger one step ahead of memory — conservative by design."""
    if accountant is None or getattr(accountant, "ledger", None) is None or not records:
        return False
    accountant.write_ahead(noise_multiplier=noise_multiplier, sample_rate=sample_rate)
    return True


def record(accountant: Any, noise_multiplier: float, sample_rate: Any, *, records: bool, logged: bool) -> None:
    """Count a released step (``logged``: :func:`write_ahead` already wrote it to the ledger)."""
    if accountant is not None and records:
        kwargs = {"logged": True} if logged else {}
        accountant.step(noise_multiplier=noise_multiplier, sample_rate=sample_rate, **kwargs)
