"""The accountant: a run's privacy history, its budget, and its saved state.

:class:`Accountant` keeps the history of a training run as runs ``(q, σ, count)`` (see
``_events``), checks every new step against an optional budget (ε, δ), and saves and restores
itself (``_persistence``), optionally backed by a crash-safe ledger (:mod:`adaclip.ledger`). It
does not compose privacy itself: its composer (``_composer.make_composer``: Rényi DP in
``_rdp``, privacy loss distributions in ``_pld``) turns the history into ε or δ.
"""

from __future__ import annotations

import math
import os
import warnings
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from adaclip import _progress
from adaclip.accounting import _calibration, _persistence
from adaclip.accounting._checks import (
    _as_float,
    _check_budget,
    _check_count,
    _check_delta,
    _check_discretization,
    _check_logged,
    _check_noise_multiplier,
    _check_orders,
    _check_sample_rate,
)
from adaclip.accounting._composer import Composer, make_composer
from adaclip.accounting._events import Run, history_event
from adaclip.accounting._mechanisms import MECHANISMS, _check_mechanism, accounting_method, resolve_mechanism
from adaclip.accounting._pld import DEFAULT_PLD_VALUE_DISCRETIZATION_INTERVAL
from adaclip.accounting._rdp import _orders_array
from adaclip.accounting._search import UNBOUNDED_STEPS, steps_that_fit
from adaclip.errors import BudgetExceededError, InvalidHyperparameterError
from adaclip.ledger import PrivacyLedger

if TYPE_CHECKING:
    import dp_accounting


class Accountant:
    """Privacy accountant for a sequence of Poisson-subsampled Gaussian steps.

    Args:
        accountant: the accounting method (Opacus's keyword; or the first, positional-only
            argument ``method``, ``Accountant("rdp")``): ``"pld"`` (privacy loss distributions: the
            tightest valid upper bound, the default) or ``"rdp"`` (Rényi DP: looser, about 7 % more noise for the same ε when
            σ is calibrated with it, cheaper to compute); ``"prv"`` (Opacus's default accountant)
            is accepted and computed as ``"pld"`` (:data:`MECHANISM_ALIASES`: the same
            quantity, see the Accounting page); ``"gdp"`` is refused (a central-limit
            approximation, not an upper bound). ``None`` (default): ``"pld"`` for a new run,
            and a run's own mechanism when this accountant resumes one: it opens an existing
            ``ledger=`` with the mechanism the ledger records, and :meth:`load_state_dict`
            (without a ledger) takes the checkpoint's, so a run begun with
            ``"rdp"`` goes on with ``"rdp"``. A method given by name is kept, and a
            ledger or checkpoint of another method is refused. The method is readable as
            :attr:`mechanism` (Opacus's accountants name theirs ``mechanism()``).
        mechanism: the old name of ``accountant=``: deprecated, it still works and warns
            :class:`FutureWarning` (in adaclip, "mechanism" names the clip-and-noise release).
        target_epsilon: optional budget ε. Given together with ``delta``, :meth:`step`
            refuses (raises :class:`~adaclip.errors.BudgetExceededError`) any step that would
            make ε(δ) exceed it.
        delta: the δ of the budget, in (0, 1). Also the default δ of :meth:`epsilon`.
        pld_value_discretization_interval: discretisation of the privacy loss for ``"pld"``
            (default :data:`DEFAULT_PLD_VALUE_DISCRETIZATION_INTERVAL`).
        rdp_orders: Rényi orders (all > 1) for ``"rdp"``; ``None`` uses dp-accounting's
            defaults.
        ledger: ``None`` (memory only), or the path of a crash-safe privacy ledger
            (:class:`adaclip.ledger.PrivacyLedger`, or an open one) that every recorded step is
            appended to, fsynced, *before* memory is updated. An existing ledger must record this
            ``mechanism`` (when one is given); the accountant starts from everything it records.
            A missing one is created. See *Ledger* below.
        progress: show progress on stderr while a slow query runs (a ``"pld"`` budget search,
            the composition of a long heterogeneous history): ``None`` (default) once the
            work has taken a second (a bar on a terminal; when stderr is a file or a pipe, a
            line per second through the ``adaclip._progress`` logger), ``True`` always,
            ``False`` never (:mod:`adaclip._progress`).

    Each call of :meth:`step` records ``num_steps`` steps with sample rate ``q`` and noise
    multiplier ``σ``. The history is kept as runs ``(q, σ, count)``; a step with the same
    ``(q, σ)`` as the last run extends it, so recording costs microseconds however long the
    training is. The privacy of the history is composed lazily, when ε or δ is asked for,
    and cached until the history changes.

    **Budget.** ε(δ) is non-decreasing in the number of steps. When a step with a new
    ``(q, σ)`` arrives, the accountant searches once for ``K``, the largest number of further
    steps with that ``(q, σ)`` whose ε stays within the budget (exponential search, then
    regula falsi / bisection over the integer count; each probe composes the history plus
    ``k`` such steps and converts to ε(δ)). The search evaluates both ``K`` (fits) and
    ``K + 1`` (exceeds). Recording ``n`` steps then only checks ``n <= K`` and lowers ``K`` by
    ``n``; nothing is composed per step. Any other history change (another ``(q, σ)``,
    :meth:`load_state_dict`) drops the cached ``K``. A refused step raises before anything
    changes. Costs (``benchmarks/accounting_cost.py``): for ``"rdp"`` a probe takes ~0.1–0.3 ms
    (the Rényi divergences of a ``(q, σ)`` are computed once, 20–50 ms, and reused), so a
    search takes milliseconds; for ``"pld"`` a probe is a PLD self-composition (~0.15–0.4 s
    at the default interval), a search
    takes about eight of them, and when the budget leaves room for far more steps than have
    been taken the search stops at a horizon (at least 65 536 steps, or 4× the steps so far)
    and is repeated when the horizon is used up, so the cost follows the training length.

    **Exactness.** The composition is done incrementally but in the same order and with the
    same operations as dp-accounting does for :meth:`to_dp_event`: for ``"rdp"`` the per-run
    Rényi divergences ``count · ε_α(q, σ)`` are summed in run order and converted with
    ``dp_accounting.rdp.compute_epsilon`` (bit-for-bit ``RdpAccountant``); for ``"pld"`` the
    PLD of each run, ``from_gaussian_mechanism(σ, sampling_prob=q).self_compose(count)``, is
    composed in run order (as ``PLDAccountant`` does; the single-step PLD of a ``(q, σ)`` and
    the composition of all runs but the last are cached).

    **Ledger.** With ``ledger=``, the in-memory history is backed by an append-only file that
    survives crashes (:mod:`adaclip.ledger` gives the privacy argument and the format). The
    rule is *write-ahead*: a step is on stable storage before anything computed from its release
    can leave, so a restart — from the ledger, whatever checkpoint is loaded — counts every
    release that can have been seen. :meth:`step` and :meth:`record_released` append (after
    validation and the budget check: a refused step writes nothing) and then update memory.
    A caller that cannot record in memory until the release has succeeded calls
    :meth:`write_ahead` before the release (it checks the budget and appends) and then
    ``step(..., logged=True)`` (or ``record_released(..., logged=True)``) after it, which
    records in memory without appending again. If the release fails in between, the ledger
    holds one step more than memory: an over-count, by design (a step that may have released
    is counted; never the reverse); a new accountant on that ledger counts it, and the budget
    checks of this one count it too. :meth:`state_dict` names the ledger's :attr:`run_id` (and
    its path), and :meth:`load_state_dict` restores such a checkpoint only onto its own run's
    ledger, keeping the ledger's history (never lowering ε); an accountant without a ledger
    refuses it (a restart that forgot ``ledger=`` would forget the releases after the
    checkpoint). One accountant (one ledger object) writes a ledger at a time; :meth:`close`
    releases it. A copy of the accountant (``copy.deepcopy``, pickling) is detached: it records
    in memory only.
    """

    _progress: bool | None = None  # (an accountant pickled before the option existed has none)
    _ledger_path: str | None = None  # (nor one pickled before checkpoints named the ledger's path)
    _mechanism_given: bool = True  # (one pickled before the default mechanism yielded named its own)

    def __init__(
        self,
        method: str | None = None,
        /,
        *,
        accountant: str | None = None,
        mechanism: str | None = None,
        target_epsilon: float | None = None,
        delta: float | None = None,
        pld_value_discretization_interval: float = DEFAULT_PLD_VALUE_DISCRETIZATION_INTERVAL,
        rdp_orders: Sequence[float] | None = None,
        ledger: str | os.PathLike[str] | PrivacyLedger | None = None,
        progress: bool | None = None,
    ) -> None:
        # a method named by the caller is kept; the default yields to a resumed run's own
        self._mechanism_given = any(name is not None for name in (method, accountant, mechanism))
        if method is not None:  # the positional name and accountant= must agree
            accountant = resolve_mechanism(method, accountant)
        self._mechanism = accounting_method(accountant, mechanism, caller="Accountant")
        self._progress = _progress.check_progress(progress)
        self._target_epsilon, self._delta = _check_budget(target_epsilon, delta)
        self._pld_interval = _check_discretization(pld_value_discretization_interval)
        self._rdp_orders = _check_orders(rdp_orders)
        self._composer: Composer = make_composer(
            self._mechanism,
            pld_value_discretization_interval=self._pld_interval,
            rdp_orders=self._rdp_orders,
            progress=self._progress,
        )
        # steps written ahead to the ledger and not yet recorded in memory, per (q, σ)
        self._pending: Counter[tuple[float, float]] = Counter()
        self._ledger: PrivacyLedger | None = None
        self._run_id: str | None = None
        self._ledger_path: str | None = None
        self._reset_history([])
        if ledger is not None:
            self._attach(ledger)

    def _attach(self, ledger: str | os.PathLike[str] | PrivacyLedger) -> None:
        led = _persistence.open_ledger(ledger, self._mechanism, adopt=not self._mechanism_given)
        if led.mechanism != self._mechanism:  # the default yields to the run's own mechanism
            self._use_mechanism(led.mechanism)
        self._ledger = led
        self._run_id = led.run_id
        self._ledger_path = os.path.abspath(led.path)
        self._reset_history(list(led.history))

    def _use_mechanism(self, mechanism: str) -> None:
        """Account with ``mechanism`` from now on (only while nothing is recorded)."""
        self._mechanism = mechanism
        self._composer = make_composer(
            mechanism, pld_value_discretization_interval=self._pld_interval, rdp_orders=self._rdp_orders,
            progress=self._progress,
        )  # fmt: skip

    def __getstate__(self) -> dict[str, Any]:
        """Copies and pickles are detached from the ledger (which has a single writer)."""
        state = self.__dict__.copy()
        state["_ledger"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore a pickle; one made before the composers existed (its caches held in the
        accountant itself) gets a fresh composer, and its caches are recomputed when needed."""
        self.__dict__.update(state if "_composer" in state else _from_old_pickle(state))

    # ---------------------------------------------------------------- properties

    @property
    def mechanism(self) -> str:
        """``"rdp"`` or ``"pld"`` (also for an accountant made with ``"prv"``)."""
        return self._mechanism

    @property
    def progress(self) -> bool | None:
        """Whether slow queries show progress (``None``: once they have taken a second)."""
        return self._progress

    @property
    def target_epsilon(self) -> float | None:
        """The budget ε, or ``None`` when there is no budget."""
        return self._target_epsilon

    @property
    def delta(self) -> float | None:
        """The budget δ, or ``None`` when there is no budget."""
        return self._delta

    @property
    def pld_value_discretization_interval(self) -> float:
        return self._pld_interval

    @property
    def rdp_orders(self) -> tuple[float, ...]:
        """The Rényi orders used by ``"rdp"`` (dp-accounting's defaults unless given)."""
        return tuple(float(a) for a in _orders_array(self._rdp_orders))

    @property
    def steps(self) -> int:
        """Total number of steps recorded."""
        return self._steps

    @property
    def history(self) -> tuple[Run, ...]:
        """The runs ``(sample_rate, noise_multiplier, count)``, oldest first."""
        return tuple(self._runs)

    @property
    def ledger(self) -> PrivacyLedger | None:
        """The crash-safe ledger this accountant appends to, or ``None``."""
        return self._ledger

    @property
    def run_id(self) -> str | None:
        """The ledger's run id (``None`` without a ledger, unless a loaded checkpoint or the
        accountant this one was copied from named one)."""
        return self._run_id

    def close(self) -> None:
        """Close the ledger (releasing its lock); recording then raises. No-op without one."""
        if self._ledger is not None:
            self._ledger.close()

    def __repr__(self) -> str:
        budget = ""
        if self._target_epsilon is not None:
            budget = f", target_epsilon={self._target_epsilon!r}, delta={self._delta!r}"
        if self._ledger is not None:
            budget += f", ledger={self._ledger.path!r}"
        return f"Accountant(accountant={self._mechanism!r}, steps={self._steps}, runs={len(self._runs)}{budget})"

    # ---------------------------------------------------------------- recording

    def step(
        self, *, noise_multiplier: float, sample_rate: float, num_steps: int = 1, logged: bool = False
    ) -> None:
        """Record ``num_steps`` steps with noise multiplier σ and sample rate q.

        With a ledger, the steps are appended to it (fsynced) after the checks and before
        memory changes. ``logged=True`` says the steps were announced with :meth:`write_ahead`
        (which checked the budget and appended them) and have been released since: they are
        recorded in memory like :meth:`record_released` records them (no budget check: the
        release has happened), and only the part of them not covered by outstanding
        write-aheads with this ``(q, σ)`` is appended now — the ledger never holds less than
        memory.

        Raises:
            InvalidHyperparameterError: an argument is invalid (σ < 0 or non-finite, q outside
                [0, 1], ``num_steps`` not a positive integer), or the ledger refuses to append
                (closed, replaced, an earlier append failed). Nothing is recorded.
            BudgetExceededError: with a budget, when ε(δ) after these steps (and after any steps
                written ahead with this ``(q, σ)`` and not yet recorded) would exceed
                ``target_epsilon``. Nothing is recorded (nor written).
            OSError: the ledger could not be written; memory is unchanged.
        """
        sigma = _check_noise_multiplier(noise_multiplier)
        q = _check_sample_rate(sample_rate)
        n = _check_count(num_steps)
        if _check_logged(logged):
            self._record_logged(q, sigma, n)
            return
        self._refuse_beyond_budget(q, sigma, n)
        self._append(q, sigma, n)
        self._record(q, sigma, n)

    def record_released(
        self, *, noise_multiplier: float, sample_rate: float, num_steps: int = 1, logged: bool = False
    ) -> None:
        """Record steps that have *already* been released, even beyond the budget.

        :meth:`step` refuses a step that would exceed the budget, before it runs. A release
        that has left (e.g. a step that used a smaller σ than planned) cannot be undone, so
        its cost is recorded whatever the budget says; :meth:`epsilon` then reports more
        than ``target_epsilon`` and every later :meth:`step` is refused. With a ledger the
        steps are appended first (fsynced); ``logged=True`` as in :meth:`step`.

        Raises:
            InvalidHyperparameterError: an argument is invalid, or the ledger refuses to append.
                Nothing is recorded.
            OSError: the ledger could not be written; memory is unchanged.
        """
        q = _check_sample_rate(sample_rate)
        sigma = _check_noise_multiplier(noise_multiplier)
        n = _check_count(num_steps)
        if _check_logged(logged):
            self._record_logged(q, sigma, n)
            return
        self._append(q, sigma, n)
        self._record(q, sigma, n)

    def write_ahead(self, *, noise_multiplier: float, sample_rate: float, num_steps: int = 1) -> None:
        """Announce steps about to be released: check the budget and append them to the ledger.

        For a caller that must log a release durably *before* it happens but may record it in
        memory only *after* it succeeded: ``write_ahead(...)``, then the release, then
        ``step(..., logged=True)`` (or ``record_released(..., logged=True)``) with the same
        ``(q, σ, num_steps)``. Memory is not changed here. If the release fails, do not call
        ``step``: the ledger then counts these steps and memory does not — an over-count, on
        purpose (the release may have left before it failed), which a new accountant on the
        ledger sees and this accountant's budget checks include (until a ``logged=True`` record
        of the same ``(q, σ)`` takes them up). Without a ledger nothing is written, but the
        checks are the same, so code behaves alike with and without one.

        Raises:
            InvalidHyperparameterError: an argument is invalid, or the ledger refuses to append.
            BudgetExceededError: as :meth:`step` would raise. Nothing is written.
            OSError: the ledger could not be written (the release must then not happen).
        """
        sigma = _check_noise_multiplier(noise_multiplier)
        q = _check_sample_rate(sample_rate)
        n = _check_count(num_steps)
        self._refuse_beyond_budget(q, sigma, n)
        self._append(q, sigma, n)
        self._pending[(q, sigma)] += n

    def _refuse_beyond_budget(self, q: float, sigma: float, n: int) -> None:
        """Raise BudgetExceededError if ``n`` more steps (plus those written ahead) exceed the budget."""
        if self._target_epsilon is None:
            return
        ahead = self._pending.get((q, sigma), 0)
        total = n + ahead
        if not self._admissible(q, sigma, total):
            eps = self._candidate_epsilon(q, sigma, total, self._delta)
            if eps <= self._target_epsilon:  # pragma: no cover - only if ε were not monotone
                self._fit[(q, sigma)] = (total, total)
            else:
                extra = f", {ahead} of them written ahead and not yet recorded" if ahead else ""
                raise BudgetExceededError(
                    f"privacy budget exceeded: recording {n} more step(s) with noise_multiplier="
                    f"{sigma!r}, sample_rate={q!r} would bring epsilon to {eps:.6g} at "
                    f"delta={self._delta!r}, above target_epsilon={self._target_epsilon!r} "
                    f"(steps so far: {self._steps}, would be {self._steps + total}{extra}); nothing was recorded"
                )

    def _append(self, q: float, sigma: float, n: int) -> None:
        if self._ledger is not None:
            self._ledger.append(sample_rate=q, noise_multiplier=sigma, count=n)

    def _record_logged(self, q: float, sigma: float, n: int) -> None:
        """Record released steps announced by write_ahead; append the part it did not cover."""
        key = (q, sigma)
        covered = min(self._pending.get(key, 0), n)
        if covered < n:
            self._append(q, sigma, n - covered)
        if covered:
            self._pending[key] -= covered
            if not self._pending[key]:
                del self._pending[key]
        self._record(q, sigma, n)

    def would_exceed(self, *, noise_multiplier: float, sample_rate: float, num_steps: int = 1) -> bool:
        """Whether :meth:`step` with these arguments would raise BudgetExceededError.

        Always ``False`` without a budget. Validates its arguments like :meth:`step`. Steps
        written ahead (:meth:`write_ahead`) and not yet recorded count as spent.
        """
        sigma = _check_noise_multiplier(noise_multiplier)
        q = _check_sample_rate(sample_rate)
        n = _check_count(num_steps)
        if self._target_epsilon is None:
            return False
        n += self._pending.get((q, sigma), 0)
        if self._admissible(q, sigma, n):
            return False
        return self._candidate_epsilon(q, sigma, n, self._delta) > self._target_epsilon

    def remaining_steps(self, *, noise_multiplier: float, sample_rate: float, limit: int | None = None) -> int:
        """How many more steps with this ``(q, σ)`` fit in the budget.

        Returns the largest ``k`` such that ε(δ) after ``k`` more such steps is at most
        ``target_epsilon``, capped at ``limit`` (default :data:`UNBOUNDED_STEPS`).
        Without a budget, or with ``q = 0``, the number is unbounded and ``limit`` is returned.
        Steps with this ``(q, σ)`` written ahead and not yet recorded count as spent.
        With ``"pld"`` the search composes PLDs of about that many steps, so a small ``limit``
        keeps it fast when the answer is huge.
        """
        sigma = _check_noise_multiplier(noise_multiplier)
        q = _check_sample_rate(sample_rate)
        cap = UNBOUNDED_STEPS if limit is None else _check_count(limit, "limit")
        if self._target_epsilon is None:
            return cap
        key = (q, sigma)
        ahead = self._pending.get(key, 0)  # written ahead, not yet recorded: already spent
        wanted = min(UNBOUNDED_STEPS, cap + ahead)
        entry = self._fit.get(key)
        if entry is None or (entry[0] == entry[1] and entry[0] < wanted):
            entry = self._count_fitting(q, sigma, wanted)
            self._fit[key] = entry
        return max(0, min(entry[0] - ahead, cap))

    def _admissible(self, q: float, sigma: float, n: int) -> bool:
        key = (q, sigma)
        entry = self._fit.get(key)
        # entry = (value, limit): `value` more steps fit; value == limit means "at least".
        if entry is None or (n > entry[0] and entry[0] == entry[1]):
            entry = self._count_fitting(q, sigma, self._horizon(n))
            self._fit[key] = entry
        return n <= entry[0]

    def _horizon(self, n: int) -> int:
        return self._composer.horizon(n, self._steps)

    def _count_fitting(self, q: float, sigma: float, limit: int) -> tuple[int, int]:
        """(largest k <= limit fitting the budget, limit) for the current history — or, from a
        screening search on a coarser grid, ``(k, k)``: at least ``k`` fit (see :meth:`_screen`)."""
        target, delta = self._target_epsilon, self._delta
        assert target is not None and delta is not None
        screened = self._screen(q, sigma, limit)
        if screened is not None:
            return screened
        k = steps_that_fit(
            q,
            sigma,
            limit,
            target=target,
            epsilon_now=lambda: self.epsilon(delta),
            epsilon_after=lambda k: self._candidate_epsilon(q, sigma, k, delta),
            progress=self._progress,
            mechanism=self._mechanism,
        )
        return k, limit

    def _screen(self, q: float, sigma: float, limit: int) -> tuple[int, int] | None:
        """A cheap lower bound on the steps that fit, or ``None``.

        With ``"pld"`` the search for the steps that fit composes PLDs of up to
        :data:`~adaclip.accounting._pld._PLD_MIN_HORIZON` steps on the accountant's grid (1e-4):
        seconds. Once per ``(q, σ)`` and history, it is first made on the calibration grid
        (1e-3, ten times fewer points), whose pessimistic ε is at least the fine grid's; the
        answer ``k`` is then confirmed with one composition on the accountant's own grid
        (``ε(k) <= target``, so every count up to ``k`` fits: ε grows with the count) and kept
        as "at least ``k``". A step beyond ``k`` searches on the accountant's grid as before, so
        every refusal, and every ε reported, is the accountant's own. A ``k`` the fine grid
        does not confirm is dropped (the fine search decides).
        """
        coarse_interval = _calibration.CALIBRATION_PLD_VALUE_DISCRETIZATION_INTERVAL
        key = (q, sigma)
        screened = self.__dict__.setdefault("_screened", set())  # (pickles from before it existed)
        if self._mechanism != "pld" or self._pld_interval >= coarse_interval or key in screened:
            return None
        screened.add(key)
        target, delta = self._target_epsilon, self._delta
        assert target is not None and delta is not None
        coarse = make_composer("pld", pld_value_discretization_interval=coarse_interval, rdp_orders=None, progress=False)
        runs = self._runs
        merge = bool(runs) and runs[-1][0] == q and runs[-1][1] == sigma
        base = runs[-1][2] if merge else 0

        def coarse_after(k: int) -> float:
            if k == 0:
                return coarse.epsilon(runs, delta) if runs else 0.0
            return coarse.candidate_epsilon(runs, (q, sigma, base + k), replaces_last=merge, delta=delta)

        k = steps_that_fit(
            q, sigma, limit, target=target, epsilon_now=lambda: coarse_after(0), epsilon_after=coarse_after,
            progress=self._progress, mechanism="pld, calibration grid",
        )  # fmt: skip
        if k == 0 or self._candidate_epsilon(q, sigma, k, delta) > target:
            return None
        return (k, limit) if k >= limit else (k, k)

    def _record(self, q: float, sigma: float, n: int) -> None:
        runs = self._runs
        if runs and runs[-1][0] == q and runs[-1][1] == sigma:
            runs[-1] = (q, sigma, runs[-1][2] + n)
        else:
            runs.append((q, sigma, n))
        self._steps += n
        self._composer.extended()
        if self._eps_cache:
            self._eps_cache = {}
        if self._target_epsilon is not None:
            key = (q, sigma)
            entry = self._fit.get(key)
            self._fit = {key: (entry[0] - n, entry[1] - n)} if entry is not None else {}
            self._screened = {key} & self.__dict__.get("_screened", set())

    def _reset_history(self, runs: list[Run]) -> None:
        self._runs: list[Run] = runs
        self._steps: int = sum(r[2] for r in runs)
        self._composer.reset()
        self._eps_cache: dict[float, float] = {}
        self._fit: dict[tuple[float, float], tuple[int, int]] = {}
        # (q, σ) whose steps that fit were screened on the calibration grid for this history
        self._screened: set[tuple[float, float]] = set()

    # ---------------------------------------------------------------- composition

    def _candidate_epsilon(self, q: float, sigma: float, k: int, delta: float) -> float:
        """ε(δ) of the history after recording ``k`` more steps with (q, σ) (history unchanged)."""
        if k == 0:
            return self.epsilon(delta)
        runs = self._runs
        merge = bool(runs) and runs[-1][0] == q and runs[-1][1] == sigma
        count = runs[-1][2] + k if merge else k
        return self._composer.candidate_epsilon(runs, (q, sigma, count), replaces_last=merge, delta=delta)

    # ---------------------------------------------------------------- queries

    def _resolve_delta(self, delta: float | None) -> float:
        if delta is None:
            if self._delta is None:
                raise InvalidHyperparameterError("delta must be given (this accountant has no budget delta)")
            return self._delta
        return _check_delta(delta)

    def epsilon(self, delta: float | None = None) -> float:
        """ε such that the recorded steps are (ε, δ)-DP; 0 for an empty history.

        ``delta`` defaults to the budget's δ. ``inf`` if a step had σ = 0 and q > 0.
        """
        d = self._resolve_delta(delta)
        eps = self._eps_cache.get(d)
        if eps is None:
            eps = self._composer.epsilon(self._runs, d) if self._runs else 0.0
            self._eps_cache[d] = eps
        return eps

    def get_epsilon(self, delta: float | None = None) -> float:
        """:meth:`epsilon` under Opacus's name (``accountant.get_epsilon(delta)``)."""
        return self.epsilon(delta)

    def delta_for(self, epsilon: float) -> float:
        """δ such that the recorded steps are (ε, δ)-DP; 0 for an empty history."""
        eps = _as_float("epsilon", epsilon)
        if not (math.isfinite(eps) and eps >= 0):
            raise InvalidHyperparameterError(f"epsilon must be finite and >= 0, got {epsilon!r}")
        if not self._runs:
            return 0.0
        return self._composer.delta(self._runs, eps)

    def to_dp_event(self) -> dp_accounting.DpEvent:
        """The history as a dp-accounting event (``NoOpDpEvent`` when empty)."""
        return history_event(self._runs)

    # ---------------------------------------------------------------- persistence

    def state_dict(self) -> dict[str, Any]:
        """A JSON-serialisable snapshot: mechanism, budget, options, history, the ledger's
        ``run_id`` and its absolute ``ledger_path`` (both ``None`` without a ledger; the path
        only serves the message of a restore that forgot ``ledger=``, it is never opened)."""
        return {
            "format": _persistence._STATE_FORMAT,
            "version": _persistence._STATE_VERSION,
            "mechanism": self._mechanism,
            "target_epsilon": self._target_epsilon,
            "delta": self._delta,
            "options": {
                "pld_value_discretization_interval": self._pld_interval,
                "rdp_orders": None if self._rdp_orders is None else list(self._rdp_orders),
            },
            "history": [[q, s, c] for q, s, c in self._runs],
            "run_id": self._run_id,
            "ledger_path": self._ledger_path,
        }

    def check_state_dict(self, state: Mapping[str, Any], *, ignore_ledger: bool = False) -> int:
        """Check ``state`` as :meth:`load_state_dict` would, changing nothing: raises what it
        would raise (:class:`~adaclip.errors.InvalidHyperparameterError`), the refusals of the
        crash-safe ledger included. Returns the number of steps ``state`` records."""
        loaded, _ = self._plan_load(state, ignore_ledger)
        return loaded.steps

    def _plan_load(
        self, state: Mapping[str, Any], ignore_ledger: bool
    ) -> tuple[_persistence.LoadedState, _persistence.Restore]:
        if not isinstance(ignore_ledger, bool):
            raise InvalidHyperparameterError(f"ignore_ledger must be True or False, got {ignore_ledger!r}")
        loaded = _persistence.parse_state(state, self._adoptable_mechanism(state))
        plan = _persistence.plan_restore(
            loaded, ledger=self._ledger, run_id=self._run_id, ignore_ledger=ignore_ledger
        )
        return loaded, plan

    def _adoptable_mechanism(self, state: Mapping[str, Any]) -> str:
        """The mechanism a state must have: this accountant's, or — for an accountant made with
        the default mechanism and without a ledger (which fixes the mechanism) — the state's own:
        a run begun with ``"rdp"`` is resumed with ``"rdp"``. (Without a ledger the loaded
        history replaces this one's whole, so no history ever mixes the two.)"""
        theirs = state.get("mechanism") if isinstance(state, Mapping) else None
        if not self._mechanism_given and self._ledger is None and isinstance(theirs, str) and theirs in MECHANISMS:
            return theirs
        return self._mechanism

    def load_state_dict(self, state: Mapping[str, Any], *, ignore_ledger: bool = False) -> None:
        """Restore a :meth:`state_dict`: budget, options and history.

        The mechanism must be this accountant's — unless it was made with the default
        mechanism and has no ledger: it then takes the checkpoint's (old checkpoints that
        recorded ``"rdp"`` keep it). Everything is validated first; on any
        problem :class:`~adaclip.errors.InvalidHyperparameterError` is raised and the
        accountant is unchanged. Adjacent runs with the same ``(q, σ)`` are merged. A history
        that already exceeds the loaded budget is accepted (it happened); no step then fits.

        **A checkpoint saved with a crash-safe ledger** (it names the ledger's ``run_id``) is
        restored only with that ledger. The ledger, not the checkpoint, records the releases
        the run made after the checkpoint was saved, and an accountant must never forget a
        release that may have been seen: restoring the checkpoint alone would count too few
        steps. So:

        - with a ledger, the checkpoint's ``run_id`` must be the ledger's (a ledger that does
          not match the run is refused) and its history a prefix of the ledger's, step by
          step. The history then becomes the *ledger's*: steps recorded after the checkpoint
          was saved still count, so restoring an older checkpoint never lowers ε;
        - without a ledger it is **refused** (a restart that forgot ``ledger=``); the message
          names the run's ledger path when the checkpoint knows it. An accountant without a
          ledger that already belongs to that run (a copy or pickle of the run's accountant,
          detached from the ledger by design) accepts its own run's checkpoints.

        A checkpoint without a ``run_id`` (saved without a ledger) is taken as it is without a
        ledger, and accepted by a ledger only if that records no step yet: its history is then
        appended to the ledger (fsynced) first; a ledger that already records steps refuses it.

        Args:
            state: a :meth:`state_dict`.
            ignore_ledger: ``True`` restores a checkpoint of a ledger run *without* its ledger,
                as if it had been saved without one: into an accountant without a ledger, or as
                the first steps of a new, empty ledger (another run's ledger that records steps
                still refuses it). It is for a run whose ledger is lost for good, or when only
                the model matters. **ε then under-counts**: the releases the run made after the
                checkpoint are not counted, and nothing can recover them. A ``UserWarning``
                says so. It changes nothing when the ledger is the checkpoint's own run's.
        """
        mechanism = self._adoptable_mechanism(state)
        loaded, plan = self._plan_load(state, ignore_ledger)
        if mechanism != self._mechanism:  # validated: a default accountant takes the run's own
            self._use_mechanism(mechanism)
        ledger = self._ledger
        for q, sigma, count in plan.to_append:  # the ledger first: if this fails, memory is unchanged
            ledger.append(sample_rate=q, noise_multiplier=sigma, count=count)  # type: ignore[union-attr]
        self._target_epsilon, self._delta = loaded.target_epsilon, loaded.delta
        self._pld_interval = loaded.pld_value_discretization_interval
        self._rdp_orders = loaded.rdp_orders
        self._composer.configure(
            pld_value_discretization_interval=self._pld_interval, rdp_orders=self._rdp_orders
        )
        self._pending.clear()
        if ledger is not None:
            self._reset_history(list(ledger.history))
        else:
            self._reset_history(loaded.runs)
            self._run_id = plan.run_id
            self._ledger_path = None if plan.run_id is None else loaded.ledger_path
        if plan.ignored:
            warnings.warn(
                f"restored a checkpoint of ledger run {loaded.run_id} without its ledger (ignore_ledger=True): "
                f"epsilon counts the {loaded.steps} steps the checkpoint records and none of the releases the "
                "run made after it, so it under-counts by those",
                UserWarning,
                stacklevel=2,
            )

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write :meth:`state_dict` as JSON to ``path`` (atomically: temp file, then rename)."""
        _persistence.write_state(path, self.state_dict())

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str],
        *,
        ledger: str | os.PathLike[str] | PrivacyLedger | None = None,
        ignore_ledger: bool = False,
    ) -> Accountant:
        """An accountant restored from a file written by :meth:`save`.

        With ``ledger=``, onto that ledger, as :meth:`load_state_dict` restores it (the
        ledger's history wins). A checkpoint that names a ledger run is refused without
        ``ledger=`` (it would forget the releases the run made after the checkpoint), and if
        the ledger path does not exist (a ledger cannot be recreated from a checkpoint: the
        releases after it would be lost), before anything is created. ``ignore_ledger=True``
        restores it anyway, as :meth:`load_state_dict` documents: **ε then under-counts**.
        """
        state = _persistence.read_state(path)
        mechanism = _check_mechanism(state["mechanism"])
        if ignore_ledger is not True:
            _persistence.refuse_missing_ledger(path, state, ledger)
        accountant = cls(mechanism, ledger=ledger)
        try:
            accountant.load_state_dict(state, ignore_ledger=ignore_ledger)
        except BaseException:
            if accountant.ledger is not None and accountant.ledger is not ledger:
                accountant.close()
            raise
        return accountant



# the attributes in which an accountant pickled before the composers existed kept its caches
_OLD_CACHE_ATTRIBUTES = (
    "_orders_array", "_rdp_vectors", "_pld_steps", "_rdp_prefix", "_rdp_prefix_len", "_pld_prefix",
    "_pld_prefix_len", "_rdp_total", "_pld_full",
)


def _from_old_pickle(state: dict[str, Any]) -> dict[str, Any]:
    """The state of an accountant pickled before the composers existed, with a new composer in
    place of the caches it kept itself (they are recomputed, to the same values, when needed)."""
    state = {k: v for k, v in state.items() if k not in _OLD_CACHE_ATTRIBUTES}
    state["_composer"] = make_composer(
        state["_mechanism"],
        pld_value_discretization_interval=state["_pld_interval"],
        rdp_orders=state["_rdp_orders"],
        progress=state.get("_progress"),
    )
    return state
