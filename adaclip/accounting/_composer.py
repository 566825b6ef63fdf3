"""What :class:`~adaclip.accounting.Accountant` asks of an accounting method: the
:class:`Composer` protocol, and :func:`make_composer`, the one place a method's name picks its
class (``"rdp"``: :class:`~adaclip.accounting._rdp.RdpComposer`, ``"pld"``:
:class:`~adaclip.accounting._pld.PldComposer`).

The accountant owns the history (its runs ``(q, σ, count)``, oldest first), the budget and the
persistence; a composer turns that history into ε or δ and keeps whatever caches make repeated
queries cheap. The history reaches it as an argument on every query, under one contract: between
two calls of :meth:`Composer.reset` the history only grows at its end (the last run's count
grows, or a run is appended), and :meth:`Composer.extended` is called after each growth. That is
what lets a composer keep the composition of all runs but the last (closed runs never change).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from adaclip.accounting._events import Run
from adaclip.accounting._pld import PldComposer
from adaclip.accounting._rdp import RdpComposer

if TYPE_CHECKING:
    import dp_accounting


class Composer(Protocol):
    """One accounting method's composition of a history of Poisson-subsampled Gaussian runs."""

    #: The method's name, one of :data:`~adaclip.accounting.MECHANISMS`.
    mechanism: str

    def configure(self, *, pld_value_discretization_interval: float, rdp_orders: tuple[float, ...] | None) -> None:
        """Take the accountant's (validated) options; a change of the option this method uses
        drops the caches computed with the old value (and counts as :meth:`reset`)."""
        ...

    def reset(self) -> None:
        """The history was replaced: forget every composition of it."""
        ...

    def extended(self) -> None:
        """The history grew at its end: forget the composition of the whole history."""
        ...

    def epsilon(self, runs: Sequence[Run], delta: float) -> float:
        """ε such that ``runs`` (not empty) are (ε, δ)-DP; ``inf`` if one is non-private."""
        ...

    def delta(self, runs: Sequence[Run], epsilon: float) -> float:
        """δ such that ``runs`` (not empty) are (ε, δ)-DP."""
        ...

    def candidate_epsilon(self, runs: Sequence[Run], tail: Run, *, replaces_last: bool, delta: float) -> float:
        """ε(δ) of ``runs`` followed by ``tail`` (``tail`` in place of the last run when
        ``replaces_last``, i.e. the last run grown to ``tail``'s count); ``runs`` unchanged."""
        ...

    def horizon(self, n: int, steps: int) -> int:
        """How many further steps (at least ``n``) a budget search looks at after ``steps`` steps;
        :data:`~adaclip.accounting.UNBOUNDED_STEPS` for the whole range."""
        ...

    def dp_accountant(self) -> dp_accounting.PrivacyAccountant:
        """A new, empty dp-accounting accountant of this method with these options."""
        ...


def make_composer(
    mechanism: str,
    *,
    pld_value_discretization_interval: float,
    rdp_orders: tuple[float, ...] | None,
    progress: bool | None,
) -> Composer:
    """The composer of ``mechanism`` (one of :data:`~adaclip.accounting.MECHANISMS`, already
    resolved) with these (validated) options."""
    # lazy: dp-accounting loads SciPy (1-2 s); loaded here so that no timed progress block counts it
    import dp_accounting  # noqa: F401

    if mechanism == "rdp":
        return RdpComposer(rdp_orders)
    return PldComposer(pld_value_discretization_interval, progress)
