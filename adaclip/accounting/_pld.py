"""The privacy-loss-distribution composer: the ``"pld"`` method of
:class:`~adaclip.accounting.Accountant`.

The PLD of one step is dp-accounting's ``from_gaussian_mechanism(σ, sampling_prob=q)`` with a
pessimistic discretisation of interval ``pld_value_discretization_interval``; a run is that
PLD self-composed ``count`` times, and runs compose (by FFT) in order. ε is an upper bound that
tends to the exact ε of the mechanism as the interval shrinks; it is tighter than RDP, and a
composition costs ~0.15–0.4 s at the default interval.

**Exactness.** Runs are composed in run order with the same operations as ``PLDAccountant``
performs for the history's event, so ε is dp-accounting's. A step with ``q = 0`` touches no data
and is skipped; one with ``q > 0`` and ``σ = 0`` makes ε infinite (δ 1), as ``PLDAccountant``
treats it. What is cached: the one-step PLD of each recent ``(q, σ)``, the composition of all
runs but the last (PLDs are immutable, so closed runs are composed once), and that of all runs.

**Search horizon.** A budget search composes PLDs of about as many steps as it probes, so when
the budget leaves room for far more steps than have been taken it stops at a horizon (at least
:data:`_PLD_MIN_HORIZON` steps, or :data:`_PLD_HORIZON_FACTOR` × the steps so far) and the
accountant searches again when that is used up: the cost follows the training length.
"""

from __future__ import annotations

import collections
import math
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from adaclip import _progress
from adaclip.accounting import _events
from adaclip.accounting._events import Run
from adaclip.accounting._search import UNBOUNDED_STEPS

if TYPE_CHECKING:
    import dp_accounting
    from dp_accounting.pld import privacy_loss_distribution

#: Default PLD discretisation interval. 1e-3 overestimates the first reference value
#: (σ = 1.1, q = 256/60000, 14 062 steps, δ = 1e-5) as 2.3905 instead of 2.382; 1e-4 gives
#: 2.3817 and composes that run in about half a second.
DEFAULT_PLD_VALUE_DISCRETIZATION_INTERVAL: float = 1e-4

# With PLD, a search for the steps that fit composes PLDs of that many steps; when far more
# steps fit than have been taken, step() only proves that this many more fit (at least
# _PLD_MIN_HORIZON, or _PLD_HORIZON_FACTOR times the steps so far) and looks again later.
# They are read through the package (adaclip.accounting._PLD_MIN_HORIZON, ...) at each search,
# so that setting them there (as a test does, to force short horizons) takes effect.
_PLD_MIN_HORIZON = 2**16
_PLD_HORIZON_FACTOR = 4
_PLD_CACHE_SIZE = 8

# (composed privacy loss distribution, whether a non-private step (q > 0, σ = 0) occurred)
_PldState = tuple[Any, bool]


def _horizon_parameters() -> tuple[int, int]:
    """``(_PLD_MIN_HORIZON, _PLD_HORIZON_FACTOR)`` as the package ``adaclip.accounting`` holds
    them now (it re-exports them from here; the value set there wins)."""
    package = sys.modules[__package__]
    return package._PLD_MIN_HORIZON, package._PLD_HORIZON_FACTOR


def gaussian_pld(sigma: float, q: float, interval: float) -> privacy_loss_distribution.PrivacyLossDistribution:
    """:func:`adaclip.accounting._gaussian_pld.gaussian_pld` (the PLD of one step), imported on
    first use; a name of this module (and of ``_calibration``, which imports it from here)."""
    # lazy: _gaussian_pld subclasses a dp-accounting class, and dp-accounting loads SciPy (1-2 s)
    from adaclip.accounting import _gaussian_pld

    return _gaussian_pld.gaussian_pld(sigma, q, interval)


def _pld_epsilon(state: _PldState, delta: float) -> float:
    pld, non_private = state
    return math.inf if non_private else float(pld.get_epsilon_for_delta(delta))


class PldComposer:
    """Composes a history of runs as privacy loss distributions (see the module docstring); a
    :class:`~adaclip.accounting._composer.Composer`.

    Args:
        pld_value_discretization_interval: the discretisation interval (validated).
        progress: whether composing many runs shows progress (:mod:`adaclip._progress`).
    """

    mechanism = "pld"

    def __init__(self, pld_value_discretization_interval: float, progress: bool | None) -> None:
        self._interval = pld_value_discretization_interval
        self._progress = progress
        self._steps: collections.OrderedDict[tuple[float, float], Any] = collections.OrderedDict()
        self.reset()

    def configure(self, *, pld_value_discretization_interval: float, rdp_orders: tuple[float, ...] | None) -> None:
        """Use this interval from now on (the PLDs of another interval are dropped)."""
        if pld_value_discretization_interval != self._interval:
            self._interval = pld_value_discretization_interval
            self._steps.clear()
            self.reset()

    def reset(self) -> None:
        # the composition of the first `_prefix_len` runs (None: not started), and of all of them
        self._prefix: _PldState | None = None
        self._prefix_len = 0
        self._full_state: _PldState | None = None

    def extended(self) -> None:
        self._full_state = None

    def dp_accountant(self) -> dp_accounting.PrivacyAccountant:
        """A new, empty ``PLDAccountant`` with this interval."""
        # lazy: dp-accounting loads SciPy and absl (1-2 s); only composing needs it
        from dp_accounting.pld import pld_privacy_accountant

        return pld_privacy_accountant.PLDAccountant(
            neighboring_relation=_events._RELATION, value_discretization_interval=self._interval
        )

    # ---------------------------------------------------------------- composition

    def _step_pld(self, q: float, sigma: float) -> privacy_loss_distribution.PrivacyLossDistribution:
        """PLD of one step (q > 0, σ > 0), as PLDAccountant builds it (:func:`gaussian_pld`:
        the same PLD, its per-point loop vectorised); cached."""
        key = (q, sigma)
        pld = self._steps.get(key)
        if pld is None:
            pld = gaussian_pld(sigma, q, self._interval)
            self._steps[key] = pld
            if len(self._steps) > _PLD_CACHE_SIZE:
                self._steps.popitem(last=False)
        else:
            self._steps.move_to_end(key)
        return pld

    def _compose(self, state: _PldState, run: Run) -> _PldState:
        """``state`` composed with one run, exactly as PLDAccountant composes that run."""
        q, sigma, count = run
        pld, non_private = state
        if q == 0:
            return state
        if sigma == 0:
            return pld, True
        return pld.compose(self._step_pld(q, sigma).self_compose(count)), non_private

    def _closed(self, runs: Sequence[Run]) -> _PldState:
        """The composition of all runs but the last (PLDs are immutable: safe to share)."""
        if self._prefix is None:
            # lazy: dp-accounting loads SciPy and absl (1-2 s); only composing needs it
            from dp_accounting.pld import privacy_loss_distribution

            self._prefix = (privacy_loss_distribution.identity(value_discretization_interval=self._interval), False)
            self._prefix_len = 0
        upto = max(len(runs) - 1, 0)
        if self._prefix_len >= upto:
            return self._prefix
        with _progress.progress(
            self._progress, "privacy loss distribution: composing runs", total=upto - self._prefix_len, unit="run"
        ) as report:
            while self._prefix_len < upto:
                self._prefix = self._compose(self._prefix, runs[self._prefix_len])
                self._prefix_len += 1
                report.update(1)
        return self._prefix

    def _full(self, runs: Sequence[Run]) -> _PldState:
        if self._full_state is None:
            state = self._closed(runs)
            if runs:
                state = self._compose(state, runs[-1])
            self._full_state = state
        return self._full_state

    # ---------------------------------------------------------------- queries

    def epsilon(self, runs: Sequence[Run], delta: float) -> float:
        return _pld_epsilon(self._full(runs), delta)

    def delta(self, runs: Sequence[Run], epsilon: float) -> float:
        pld, non_private = self._full(runs)
        return 1.0 if non_private else float(pld.get_delta_for_epsilon(epsilon))

    def candidate_epsilon(self, runs: Sequence[Run], tail: Run, *, replaces_last: bool, delta: float) -> float:
        state = self._compose(self._closed(runs) if replaces_last else self._full(runs), tail)
        return _pld_epsilon(state, delta)

    def horizon(self, n: int, steps: int) -> int:
        """How far a search for ``n`` more steps (after ``steps``) looks: see the module docstring."""
        min_horizon, factor = _horizon_parameters()
        return max(n, min(UNBOUNDED_STEPS, max(min_horizon, factor * (steps + n))))
