"""The budget keeper: the one protocol by which every front end spends privacy.

The PyTorch optimizer, the JAX tracker and the Flower strategy all spend their accountant's
budget the same way, with the functions of this module:

1. **Refuse before release** — :func:`refuse`: before a step changes anything, a step that would
   exceed the budget raises :class:`~adaclip.errors.BudgetExceededError`. The message reads the
   same everywhere: the step, its σ and accounted rate, the budget (ε, δ) and the ε already
   spent, and the caller's account of the planned run (``explain()``). Only public quantities
   appear in it.
2. **Write ahead** — :func:`write_ahead`: with an accountant that keeps a crash-safe ledger
   (``Accountant(ledger=...)``), the record is appended and ``fsync``-ed *before* any value
   computed from the step's noise can leave (a noisy all-reduce, a gradient, a model update).
   A crash at any later point can then only over-count.
   :func:`admit` does 1 then 2, for a front end about to release.
3. **Record once per cycle** — :func:`record`: once the step is released, the accountant counts
   it in memory (written ahead: not written again), also past the budget — a release that has
   left cannot be undone. Only the steps that open a cycle of the noise's accounting are recorded
   (:class:`Cycle`; every step with independent noise).
4. **Rollback**: a step that fails before step 2 changes nothing here. One that fails between
   2 and 3 is *not* taken off the ledger: the ledger then counts one record more than memory —
   conservative on purpose, since the release may have left before the failure; a new
   accountant on the ledger sees it, and this accountant's budget checks include it.

Which steps record, at which rate and with which noise multiplier is the noise family's
(:meth:`adaclip.correlated.contract.NoiseFamily.accounting`); this module only keeps the
protocol. The accountant may be an :class:`~adaclip.accounting.Accountant` or any object with
``would_exceed`` and ``step`` (``write_ahead``, ``record_released`` and ``ledger`` are used when
present).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from adaclip.errors import BudgetExceededError

__all__ = ["Cycle", "accounted_rate_words", "admit", "record", "refuse", "write_ahead"]


class Cycle:
    """Which steps the accountant records: the first of each cycle of ``length`` steps, counted
    from ``start`` (banded noise: ``b``; BLT: the min separation; independent noise: 1).
    :meth:`restart` opens a new cycle (a noise stream restored without its buffers)."""

    __slots__ = ("length", "start")

    def __init__(self, length: int = 1, start: int = 0) -> None:
        self.length = int(length)
        self.start = int(start)

    def records_at(self, index: int) -> bool:
        """Whether step ``index`` opens a cycle (and so is checked against the budget and recorded)."""
        return (index - self.start) % self.length == 0

    def restart(self, index: int) -> None:
        """A new cycle begins at step ``index``."""
        self.start = int(index)

    def __repr__(self) -> str:
        return f"Cycle(length={self.length}, start={self.start})"


def accounted_rate_words(sample_rate: float, bands: int, accounted_rate: float) -> str:
    """The rate a front end accounts each composition at, for its side of a refusal (public
    quantities only): ``"q = …"``, or with ``b > 1`` bands ``"p = b*q = … (q = …, b = … bands)"``."""
    if bands == 1:
        return f"q = {sample_rate:.6g}"
    return f"p = b*q = {accounted_rate:.6g} (q = {sample_rate:.6g}, b = {bands} bands)"


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


def refuse(
    accountant: Any,
    noise_multiplier: float,
    sample_rate: Any,
    *,
    step: int,
    records: bool,
    explain: Callable[[], str] | None = None,
    unit: str = "step",
) -> None:
    """Raise :class:`BudgetExceededError` if recording step ``step`` would exceed the budget.

    ``records``: whether this step is recorded at all (:meth:`Cycle.records_at`; the other steps
    of a cycle are covered by its record). ``unit`` names the step in the message (``"round"``
    for federated rounds). The message gives the budget, what is spent, and ``explain()``
    (computed only when refusing). Changes nothing."""
    if accountant is None or not records:
        return
    if accountant.would_exceed(noise_multiplier=noise_multiplier, sample_rate=sample_rate):
        raise BudgetExceededError(
            f"{unit} {step} (noise_multiplier={noise_multiplier}, accounted sample_rate={sample_rate}) "
            f"would exceed the accountant's privacy budget{_spent(accountant)}"
            f"{explain() if explain is not None else ''}; nothing was changed"
        )


def write_ahead(accountant: Any, noise_multiplier: float, sample_rate: Any, *, records: bool) -> bool:
    """With an accountant that keeps a crash-safe ledger, append this step's record and ``fsync``
    it *before* anything computed from the step's noise can leave. Returns whether it wrote
    (:func:`record` then records the step in memory without writing it again). Also checks the
    budget again (:meth:`~adaclip.accounting.Accountant.write_ahead`), so a release is never
    written past it."""
    if accountant is None or not records or getattr(accountant, "ledger", None) is None:
        return False
    accountant.write_ahead(noise_multiplier=noise_multiplier, sample_rate=sample_rate)
    return True


def admit(
    accountant: Any,
    noise_multiplier: float,
    sample_rate: Any,
    *,
    step: int,
    records: bool,
    explain: Callable[[], str] | None = None,
    unit: str = "step",
) -> bool:
    """Steps 1 and 2 of the protocol, in order, for a front end about to release: :func:`refuse`
    (raises, changing nothing, if the step would exceed the budget), then :func:`write_ahead`.
    Returns whether the record was written ahead (pass it to :func:`record` as ``logged``)."""
    refuse(accountant, noise_multiplier, sample_rate, step=step, records=records, explain=explain, unit=unit)
    return write_ahead(accountant, noise_multiplier, sample_rate, records=records)


def record(accountant: Any, noise_multiplier: float, sample_rate: Any, *, records: bool, logged: bool = False) -> None:
    """Count a released step (``logged``: :func:`write_ahead` already wrote it to the ledger),
    also past the budget: :meth:`~adaclip.accounting.Accountant.record_released` where the
    accountant has it, else its ``step``."""
    if accountant is None or not records:
        return
    kwargs = {"logged": True} if logged else {}
    release = getattr(accountant, "record_released", None)
    (accountant.step if release is None else release)(noise_multiplier=noise_multiplier, sample_rate=sample_rate, **kwargs)
