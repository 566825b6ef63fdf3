"""The Rényi-DP composer: the ``"rdp"`` method of :class:`~adaclip.accounting.Accountant`.

One step with ``(q, σ)`` has Rényi divergence ``ε_α(q, σ)`` at each order ``α``, which
dp-accounting's ``RdpAccountant`` computes; runs compose additively,
``ε_α = Σ_runs count · ε_α(q, σ)``, and the total converts to (ε, δ)-DP with the improved
conversion ``ε = min_α ε_α + log((α-1)/α) − (log δ + log α)/(α − 1)`` (dp-accounting's
``compute_epsilon``). By default dp-accounting's own orders (1.1 … 10.9 in steps of 0.1,
11 … 63, 128, 256, 512, 1024).

**Exactness.** The sums are taken in run order with the same operations as ``RdpAccountant``
performs for the history's event, so ε is bit-for-bit dp-accounting's. What is cached: the
divergence vector of each recent ``(q, σ)`` (20–50 ms each to compute), the sum over all runs
but the last (closed runs never change), and the sum over all runs.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from adaclip.accounting import _events
from adaclip.accounting._events import Run, _step_event
from adaclip.accounting._logs import _quiet_dp_accounting_logs
from adaclip.accounting._search import UNBOUNDED_STEPS

if TYPE_CHECKING:
    import dp_accounting

_RDP_VECTOR_CACHE_SIZE = 64


def _default_orders() -> tuple[float, ...]:
    # lazy: dp-accounting loads SciPy and absl (1-2 s); only composing needs it
    from dp_accounting.rdp import rdp_privacy_accountant

    return tuple(float(a) for a in rdp_privacy_accountant.DEFAULT_RDP_ORDERS)


def _orders_array(orders: tuple[float, ...] | None) -> np.ndarray:
    """The orders as the array dp-accounting takes (its defaults for ``None``)."""
    return np.array(orders if orders is not None else _default_orders())


def _rdp_epsilon(orders: np.ndarray, rdp: np.ndarray, delta: float) -> float:
    """dp-accounting's RDP → (ε, δ) conversion, without its absl log messages."""
    # lazy: dp-accounting loads SciPy and absl (1-2 s); only composing needs it
    from dp_accounting.rdp import rdp_privacy_accountant

    with _quiet_dp_accounting_logs():
        return float(rdp_privacy_accountant.compute_epsilon(orders, rdp, delta)[0])


def _rdp_delta(orders: np.ndarray, rdp: np.ndarray, epsilon: float) -> float:
    """dp-accounting's RDP → δ(ε) conversion, without its absl log messages."""
    # lazy: dp-accounting loads SciPy and absl (1-2 s); only composing needs it
    from dp_accounting.rdp import rdp_privacy_accountant

    with _quiet_dp_accounting_logs():
        return float(rdp_privacy_accountant.compute_delta(orders, rdp, epsilon)[0])


class RdpComposer:
    """Composes a history of runs by Rényi DP (see the module docstring); a
    :class:`~adaclip.accounting._composer.Composer`.

    Args:
        rdp_orders: the orders (all > 1, already validated), or ``None`` for dp-accounting's.
    """

    mechanism = "rdp"

    def __init__(self, rdp_orders: tuple[float, ...] | None) -> None:
        self._orders_given = rdp_orders
        self._orders = _orders_array(rdp_orders)
        self._vectors: collections.OrderedDict[tuple[float, float], np.ndarray] = collections.OrderedDict()
        self.reset()

    def configure(self, *, pld_value_discretization_interval: float, rdp_orders: tuple[float, ...] | None) -> None:
        """Use these orders from now on (the divergences of other orders are dropped)."""
        if rdp_orders != self._orders_given:
            self._orders_given = rdp_orders
            self._orders = _orders_array(rdp_orders)
            self._vectors.clear()
            self.reset()

    def reset(self) -> None:
        # the sum over the first `_prefix_len` runs, and over all of them (None: not computed)
        self._prefix = np.zeros(len(self._orders), dtype=np.float64)
        self._prefix_len = 0
        self._total: np.ndarray | None = None

    def extended(self) -> None:
        self._total = None

    def dp_accountant(self) -> dp_accounting.PrivacyAccountant:
        """A new, empty ``RdpAccountant`` with these orders."""
        # lazy: dp-accounting loads SciPy and absl (1-2 s); only composing needs it
        from dp_accounting.rdp import rdp_privacy_accountant

        return rdp_privacy_accountant.RdpAccountant(orders=self._orders, neighboring_relation=_events._RELATION)

    # ---------------------------------------------------------------- composition

    def _vector(self, q: float, sigma: float) -> np.ndarray:
        """Rényi DP of one step at every order, as dp-accounting computes it."""
        key = (q, sigma)
        vec = self._vectors.get(key)
        if vec is None:
            acc = self.dp_accountant()
            with _quiet_dp_accounting_logs():
                vec = acc.compose(_step_event(q, sigma)).rdp
            self._vectors[key] = vec
            if len(self._vectors) > _RDP_VECTOR_CACHE_SIZE:
                self._vectors.popitem(last=False)
        else:
            self._vectors.move_to_end(key)
        return vec

    def _closed(self, runs: Sequence[Run]) -> np.ndarray:
        """Σ count·RDP over all runs but the last, summed in order (as RdpAccountant does)."""
        upto = max(len(runs) - 1, 0)
        while self._prefix_len < upto:
            q, s, c = runs[self._prefix_len]
            self._prefix = self._prefix + c * self._vector(q, s)
            self._prefix_len += 1
        return self._prefix

    def _full(self, runs: Sequence[Run]) -> np.ndarray:
        if self._total is None:
            total = self._closed(runs)
            if runs:
                q, s, c = runs[-1]
                total = total + c * self._vector(q, s)
            self._total = total
        return self._total

    # ---------------------------------------------------------------- queries

    def epsilon(self, runs: Sequence[Run], delta: float) -> float:
        return _rdp_epsilon(self._orders, self._full(runs), delta)

    def delta(self, runs: Sequence[Run], epsilon: float) -> float:
        return _rdp_delta(self._orders, self._full(runs), epsilon)

    def candidate_epsilon(self, runs: Sequence[Run], tail: Run, *, replaces_last: bool, delta: float) -> float:
        base = self._closed(runs) if replaces_last else self._full(runs)
        q, sigma, count = tail
        return _rdp_epsilon(self._orders, base + count * self._vector(q, sigma), delta)

    def horizon(self, n: int, steps: int) -> int:
        """A search is cheap (a probe is a vector sum): always search the whole range."""
        return UNBOUNDED_STEPS
