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

from typing import Any

# the refusal is the core's, shared with the JAX tracker: one wording everywhere
from adaclip.accounting._refusal import check_budget

__all__ = ["check_budget", "record", "write_ahead"]


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
