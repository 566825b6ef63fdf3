"""Privacy accounting for DP-SGD-style training with adaptive clipping.

What is accounted
-----------------
Every private step of adaclip clips the contribution of each *privacy unit* (an example, or a
user when training is user-level) so that its ℓ2 norm in the clipped (whitened, for AdaCliP)
space is at most 1, sums the clipped contributions of a Poisson-sampled batch and adds
Gaussian noise of standard deviation ``σ`` times that bound. Whatever the clip norm ``C`` and
the AdaCliP scaling are, the release is therefore a *sampled Gaussian mechanism* with
sensitivity 1 and noise multiplier ``σ``: each unit is in the batch independently with
probability ``q`` (the sample rate), and

.. math::

    M(D) = \\sum_{x \\in B} \\bar g(x) + \\mathcal N(0, \\sigma^2 I), \\qquad
    B \\sim \\mathrm{Poisson}(D, q), \\quad \\lVert \\bar g(x) \\rVert_2 \\le 1 .

Adjacency is *add-or-remove-one* (two data sets are neighbours when one is the other plus one
unit), the relation for which Poisson subsampling amplifies privacy. Everything here counts
in units: an (ε, δ) guarantee is per example for example-level training and per user for
user-level training; ``q`` must be the sampling probability *of that unit*.

A training run is a sequence of such steps, possibly with ``(q, σ)`` changing over time
(noise decay, retuning). It is recorded compactly as *runs* ``(q, σ, count)`` and composed
with `dp-accounting <https://github.com/google/differential-privacy>`_ as the event

.. code-block:: python

    ComposedDpEvent([SelfComposedDpEvent(PoissonSampledDpEvent(q, GaussianDpEvent(σ)), count)
                     for (q, σ, count) in runs])

by either accountant:

- ``"rdp"``: Rényi DP of the sampled Gaussian mechanism at a set of orders ``α``, composed
  additively, ``ε_α = Σ_runs count · ε_α(q, σ)``, and converted to (ε, δ)-DP with the
  improved conversion ``ε = min_α ε_α + log((α-1)/α) − (log δ + log α)/(α − 1)``
  (dp-accounting's ``compute_epsilon``). By default dp-accounting's own orders
  (1.1 … 10.9 in steps of 0.1, 11 … 63, 128, 256, 512, 1024).
- ``"pld"``: privacy loss distributions (pessimistic discretisation with interval
  ``pld_value_discretization_interval``), composed by FFT; tighter than RDP (ε is an
  upper bound that tends to the exact ε of the mechanism as the interval shrinks).

Reference values (δ = 1e-5), which the defaults reproduce to 1e-3 relative tolerance:
σ = 1.1, q = 256/60000, 14 062 steps → RDP ε ≈ 2.597, PLD ε ≈ 2.382; σ = 1.5, q = 0.04,
2 250 steps → RDP ε ≈ 7.329. The PLD value needs an interval of at most ~5e-4: with 1e-3
the pessimistic estimate is 2.3905 (0.36 % high), hence the default of 1e-4 (2.3817).

``σ = 0`` is accepted and means *no privacy*: any step with ``q > 0`` and ``σ = 0`` makes ε
infinite (and ``delta_for`` 1). Steps with ``q = 0`` touch no data and cost nothing.

dp-accounting's RDP code reports numerical trouble through the ``absl`` logger, e.g.
``_compute_log_a_frac failed to converge ... Excluding this order from the epsilon
computation`` (the order is then dropped, which can only make ε larger, never smaller). A
calibration can trigger thousands of these, so while this module calls into dp-accounting it
raises that logger's level to ``ERROR`` and restores it afterwards. Python warnings
(:func:`warnings.warn`) and exceptions are unaffected.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import math
import operator
import os
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import dp_accounting
import numpy as np
from dp_accounting.pld import pld_privacy_accountant, privacy_loss_distribution
from dp_accounting.privacy_accountant import NeighboringRelation
from dp_accounting.rdp import rdp_privacy_accountant

from adaclip import _progress
from adaclip.errors import BudgetExceededError, InvalidHyperparameterError
from adaclip.ledger import PrivacyLedger

__all__ = [
    "Accountant",
    "PrivacyLedger",
    "calibrate_noise_multiplier",
    "MECHANISMS",
    "MECHANISM_ALIASES",
    "REFUSED_MECHANISMS",
    "resolve_mechanism",
    "DEFAULT_PLD_VALUE_DISCRETIZATION_INTERVAL",
    "UNBOUNDED_STEPS",
]

#: The accounting methods :class:`Accountant` supports.
MECHANISMS: tuple[str, ...] = ("rdp", "pld")

#: Other names accepted for a mechanism, and the mechanism they stand for. ``"prv"`` is Opacus's
#: default accountant (Gopi et al., 2021: the privacy loss *random variable*, whose distribution
#: is the privacy loss distribution): it and ``"pld"`` compute the same quantity, the
#: distribution of the privacy loss of the Poisson-subsampled Gaussian, numerically (a
#: discretisation composed by FFT), and both report an upper bound on ε. ``"prv"`` is computed
#: with dp-accounting's PLD (pessimistic discretisation) — see the Accounting page, "Opacus's
#: accountants", for the comparison with Opacus's own PRV accountant.
MECHANISM_ALIASES: dict[str, str] = {"prv": "pld"}

#: Names that are refused, with the reason (they would not give an upper bound on ε).
REFUSED_MECHANISMS: dict[str, str] = {
    "gdp": (
        "Opacus's 'gdp' accountant applies the central limit theorem to the composed subsampled "
        "Gaussian steps (mu-GDP); that is an approximation, not an upper bound on epsilon, and it "
        "under-reports epsilon in ordinary settings (sigma=1.0, q=0.01, 1000 steps, delta=1e-5: "
        "GDP says 1.62, the PLD upper bound is 1.83). Use 'pld' (a tight upper bound; 'prv', "
        "Opacus's default, is computed as 'pld') or 'rdp' (a looser upper bound, faster)"
    ),
}

#: Default PLD discretisation interval. 1e-3 overestimates the first reference value
#: (σ = 1.1, q = 256/60000, 14 062 steps, δ = 1e-5) as 2.3905 instead of 2.382; 1e-4 gives
#: 2.3817 and composes that run in about half a second.
DEFAULT_PLD_VALUE_DISCRETIZATION_INTERVAL: float = 1e-4

#: What :meth:`Accountant.remaining_steps` returns when the number of steps that fit is
#: unbounded (``q = 0``, or no budget) or at least this large.
UNBOUNDED_STEPS: int = 2**53

_RELATION = NeighboringRelation.ADD_OR_REMOVE_ONE
_STATE_FORMAT = "adaclip.accounting.Accountant"
_STATE_VERSION = 1
# With PLD, a search for the steps that fit composes PLDs of that many steps; when far more
# steps fit than have been taken, step() only proves that this many more fit (at least
# _PLD_MIN_HORIZON, or _PLD_HORIZON_FACTOR times the steps so far) and looks again later.
_PLD_MIN_HORIZON = 2**16
_PLD_HORIZON_FACTOR = 4
_RDP_VECTOR_CACHE_SIZE = 64
_PLD_CACHE_SIZE = 8

Run = tuple[float, float, int]
# (composed privacy loss distribution, whether a non-private step (q > 0, σ = 0) occurred)
_PldState = tuple[Any, bool]


# --------------------------------------------------------------------------------------
# dp-accounting's absl log messages
# --------------------------------------------------------------------------------------

_ABSL_LOGGER_NAME = "absl"
_QUIET_LEVEL = logging.ERROR
_quiet_lock = threading.Lock()
_quiet_depth = 0  # how many _quiet_dp_accounting_logs blocks are open, in all threads
_quiet_restore: int | None = None  # level to restore when the outermost block exits (None: untouched)


@contextlib.contextmanager
def _quiet_dp_accounting_logs() -> Iterator[None]:
    """Hide the ``absl`` logger's warnings (dp-accounting's) for the duration of the block.

    dp-accounting logs ``_compute_log_a_frac failed to converge ...`` (and a few other
    numerical notices) through ``logging.getLogger("absl")`` at level ``WARNING``; a
    calibration can emit thousands of them. Inside the block that logger's level is raised
    to ``ERROR`` (if it is lower). Blocks nest and may be open in several threads at once: a
    lock and a counter track them, and when the outermost open block exits the level the
    logger had before is restored — unless something else set another level meanwhile, which
    is then kept. Records at ``ERROR`` and above still pass; :func:`warnings.warn` warnings
    and exceptions are untouched (only the ``absl`` logger's level changes). A ``WARNING``
    that another thread logs to ``absl`` while a block is open is hidden as well.
    """
    global _quiet_depth, _quiet_restore
    logger = logging.getLogger(_ABSL_LOGGER_NAME)
    with _quiet_lock:
        if _quiet_depth == 0:
            _quiet_restore = None
            if logger.getEffectiveLevel() < _QUIET_LEVEL:
                _quiet_restore = logger.level
                logger.setLevel(_QUIET_LEVEL)
        _quiet_depth += 1
    try:
        yield
    finally:
        with _quiet_lock:
            _quiet_depth -= 1
            if _quiet_depth == 0 and _quiet_restore is not None:
                if logger.level == _QUIET_LEVEL:
                    logger.setLevel(_quiet_restore)
                _quiet_restore = None


def _rdp_epsilon(orders: np.ndarray, rdp: np.ndarray, delta: float) -> float:
    """dp-accounting's RDP → (ε, δ) conversion, without its absl log messages."""
    with _quiet_dp_accounting_logs():
        return float(rdp_privacy_accountant.compute_epsilon(orders, rdp, delta)[0])


def _rdp_delta(orders: np.ndarray, rdp: np.ndarray, epsilon: float) -> float:
    """dp-accounting's RDP → δ(ε) conversion, without its absl log messages."""
    with _quiet_dp_accounting_logs():
        return float(rdp_privacy_accountant.compute_delta(orders, rdp, epsilon)[0])


# --------------------------------------------------------------------------------------
# validation helpers
# --------------------------------------------------------------------------------------


def _as_float(name: str, value: Any) -> float:
    if isinstance(value, (bool, str, bytes)) or value is None:
        raise InvalidHyperparameterError(f"{name} must be a real number, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise InvalidHyperparameterError(f"{name} must be a real number, got {value!r}") from None


def _check_noise_multiplier(value: Any, name: str = "noise_multiplier") -> float:
    x = _as_float(name, value)
    if not math.isfinite(x) or x < 0:
        raise InvalidHyperparameterError(f"{name} must be finite and >= 0, got {value!r}")
    return x


def _check_sample_rate(value: Any, name: str = "sample_rate", *, allow_zero: bool = True) -> float:
    x = _as_float(name, value)
    low_ok = x >= 0 if allow_zero else x > 0
    if not (low_ok and x <= 1):
        interval = "[0, 1]" if allow_zero else "(0, 1]"
        raise InvalidHyperparameterError(f"{name} must be in {interval}, got {value!r}")
    return x


def _check_count(value: Any, name: str = "num_steps") -> int:
    if isinstance(value, bool):
        raise InvalidHyperparameterError(f"{name} must be a positive integer, got {value!r}")
    try:
        n = operator.index(value)
    except TypeError:
        raise InvalidHyperparameterError(f"{name} must be a positive integer, got {value!r}") from None
    if n < 1:
        raise InvalidHyperparameterError(f"{name} must be a positive integer, got {value!r}")
    return int(n)


def _check_epsilon(value: Any, name: str = "target_epsilon") -> float:
    x = _as_float(name, value)
    if not math.isfinite(x) or x <= 0:
        raise InvalidHyperparameterError(f"{name} must be finite and > 0, got {value!r}")
    return x


def _check_delta(value: Any, name: str = "delta") -> float:
    x = _as_float(name, value)
    if not (0 < x < 1):
        raise InvalidHyperparameterError(f"{name} must be in (0, 1), got {value!r}")
    return x


def _check_mechanism(value: Any, name: str = "mechanism") -> str:
    """The mechanism ``value`` names (``"prv"`` → ``"pld"``); refused names say why."""
    if isinstance(value, str):
        if value in REFUSED_MECHANISMS:
            raise InvalidHyperparameterError(f"{name}={value!r} is refused: {REFUSED_MECHANISMS[value]}")
        value = MECHANISM_ALIASES.get(value, value)
        if value in MECHANISMS:
            return value
    accepted = (*MECHANISMS, *MECHANISM_ALIASES)
    raise InvalidHyperparameterError(
        f"{name} must be one of {accepted} ('prv' is computed as 'pld'), got {value!r}"
    )


def resolve_mechanism(mechanism: Any = "rdp", accountant: Any = None, *, default: str = "rdp") -> str:
    """The accounting mechanism named by ``mechanism=`` (adaclip's keyword) or ``accountant=``
    (Opacus's, a string), as one of :data:`MECHANISMS`.

    ``accountant`` (when not ``None``) wins over a ``mechanism`` left at its ``default``; the
    two given with different meanings are refused. ``"prv"`` means ``"pld"``
    (:data:`MECHANISM_ALIASES`); ``"gdp"`` is refused with the reason
    (:data:`REFUSED_MECHANISMS`).

    Raises:
        InvalidHyperparameterError: an unknown or refused name, a non-string ``accountant``, or
            the two keywords naming different mechanisms.
    """
    chosen = _check_mechanism(mechanism)
    if accountant is None:
        return chosen
    if not isinstance(accountant, str):
        raise InvalidHyperparameterError(
            f"accountant= takes the name of the accounting method ('rdp', 'pld' or 'prv', as in Opacus's "
            f"PrivacyEngine(accountant=...)), got {type(accountant).__name__}; to use an Accountant object "
            "of your own, pass it to the optimizer wrapper (accountant=, sample_rate=)"
        )
    other = _check_mechanism(accountant, "accountant")
    if mechanism != default and chosen != other:
        raise InvalidHyperparameterError(
            f"mechanism={mechanism!r} and accountant={accountant!r} name different accounting methods; "
            "give one of them (accountant= is Opacus's name for mechanism=)"
        )
    return other


def _check_discretization(value: Any) -> float:
    name = "pld_value_discretization_interval"
    x = _as_float(name, value)
    if not (math.isfinite(x) and 0 < x < 1):
        raise InvalidHyperparameterError(f"{name} must be in (0, 1), got {value!r}")
    return x


def _check_orders(value: Any) -> tuple[float, ...] | None:
    if value is None:
        return None
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise InvalidHyperparameterError(f"rdp_orders must be a sequence of numbers > 1, got {value!r}")
    orders = tuple(_as_float("rdp_orders", a) for a in value)
    if not orders:
        raise InvalidHyperparameterError("rdp_orders must not be empty")
    for a in orders:
        if not (math.isfinite(a) and a > 1):
            raise InvalidHyperparameterError(f"rdp_orders must all be finite and > 1, got {a!r}")
    return orders


def _check_budget(target_epsilon: Any, delta: Any) -> tuple[float | None, float | None]:
    if target_epsilon is None and delta is None:
        return None, None
    if target_epsilon is None:
        raise InvalidHyperparameterError(
            f"delta={delta!r} was given without target_epsilon; give both or neither"
        )
    if delta is None:
        raise InvalidHyperparameterError(
            f"target_epsilon={target_epsilon!r} was given without delta; give both or neither"
        )
    return _check_epsilon(target_epsilon), _check_delta(delta)


def _step_event(q: float, sigma: float) -> dp_accounting.DpEvent:
    return dp_accounting.PoissonSampledDpEvent(
        sampling_probability=q, event=dp_accounting.GaussianDpEvent(noise_multiplier=sigma)
    )


def _run_event(q: float, sigma: float, count: int) -> dp_accounting.DpEvent:
    return dp_accounting.SelfComposedDpEvent(event=_step_event(q, sigma), count=count)


def _default_orders() -> tuple[float, ...]:
    return tuple(float(a) for a in rdp_privacy_accountant.DEFAULT_RDP_ORDERS)


# --------------------------------------------------------------------------------------
# integer search for the largest number of steps that fits
# --------------------------------------------------------------------------------------


def _largest_fitting(
    epsilon_at: Callable[[int], float], target: float, limit: int, epsilon_at_zero: Callable[[], float]
) -> int:
    """Largest ``k`` in ``[0, limit]`` with ``epsilon_at(k) <= target``.

    Assumes ``epsilon_at`` is non-decreasing (ε grows with the number of steps). First an
    exponential search from ``k = 1`` finds a bracket ``lo`` (fits) < ``hi`` (exceeds); the
    growth factor is ``(target/ε(k))²`` clipped to [2, 1024], since ε grows roughly like the
    square root of the number of steps or faster. Then the bracket is narrowed to
    ``hi = lo + 1`` by regula falsi on ε² (nearly linear in the count) with the Illinois
    modification, falling back to bisection after three evaluations in a row that fail to
    halve the bracket. The result ``lo`` satisfies
    ``ε(lo) <= target`` and, unless ``lo == limit``, ``ε(lo + 1) > target`` — both evaluated.
    """
    lo, eps_lo = 0, None
    k = 1
    while True:
        e = epsilon_at(k)
        if e <= target:
            lo, eps_lo = k, e
            if k >= limit:
                return limit
            factor = (target / e) ** 2 if e > 0 else 1024.0
            factor = min(max(factor, 2.0), 1024.0)
            k = min(limit, max(k + 1, int(k * factor)))
        else:
            hi, eps_hi = k, e
            break
    if hi - lo <= 1:
        return lo
    if eps_lo is None:
        eps_lo = epsilon_at_zero()
    # Interpolate ε² (close to linear in the number of steps for Gaussian noise).
    t2 = target * target
    g_lo, g_hi = eps_lo * eps_lo - t2, eps_hi * eps_hi - t2  # g_lo <= 0 < g_hi
    side = 0
    slow = 0
    while hi - lo > 1:
        width = hi - lo
        if slow < 3 and math.isfinite(g_hi) and math.isfinite(g_lo) and g_hi > g_lo:
            k = lo + int(round(width * (-g_lo) / (g_hi - g_lo)))
            k = min(max(k, lo + 1), hi - 1)
        else:
            k = lo + width // 2
        e = epsilon_at(k)
        g = e * e - t2
        if e <= target:
            lo, g_lo = k, g
            if side == -1:
                g_hi /= 2
            side = -1
        else:
            hi, g_hi = k, g
            if side == 1:
                g_lo /= 2
            side = 1
        slow = slow + 1 if 2 * (hi - lo) > width + 1 else 0
    return lo


def _check_logged(value: Any) -> bool:
    if not isinstance(value, bool):
        raise InvalidHyperparameterError(f"logged must be True or False, got {value!r}")
    return value


def _prefix_problem(prefix: Sequence[Run], runs: Sequence[Run]) -> str | None:
    """``None`` if the steps of ``prefix`` (its runs expanded to one ``(q, σ)`` per step) are
    the first steps of ``runs``; otherwise where they part."""
    i = j = 0
    left_a = left_b = 0
    pa = pb = (0.0, 0.0)
    step = 0
    while True:
        if left_a == 0:
            if i == len(prefix):
                return None
            pa, left_a = (prefix[i][0], prefix[i][1]), prefix[i][2]
            i += 1
        if left_b == 0:
            if j == len(runs):
                total = sum(r[2] for r in prefix)
                return f"the checkpoint records {total} steps, the ledger only {step}"
            pb, left_b = (runs[j][0], runs[j][1]), runs[j][2]
            j += 1
        if pa != pb:
            return (
                f"step {step + 1} has (sample_rate, noise_multiplier) = {pa} in the checkpoint and {pb} "
                "in the ledger"
            )
        k = min(left_a, left_b)
        left_a -= k
        left_b -= k
        step += k


# --------------------------------------------------------------------------------------
# the accountant
# --------------------------------------------------------------------------------------


class Accountant:
    """Privacy accountant for a sequence of Poisson-subsampled Gaussian steps.

    Args:
        mechanism: ``"rdp"`` (Rényi DP, fast) or ``"pld"`` (privacy loss distributions,
            tighter, slower); ``"prv"`` (Opacus's default accountant) is accepted and computed
            as ``"pld"`` (:data:`MECHANISM_ALIASES`: the same quantity, see the Accounting
            page); ``"gdp"`` is refused (a central-limit approximation, not an upper bound).
        accountant: Opacus's name for ``mechanism`` (``Accountant(accountant="prv")``); give
            one of the two.
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
            ``mechanism``; the accountant starts from everything it records. A missing one is
            created. See *Ledger* below.
        progress: show progress on stderr while a slow query runs (a ``"pld"`` budget search,
            the composition of a long heterogeneous history): ``None`` (default) only when
            stderr is a terminal and the work has taken a second, ``True`` always, ``False``
            never (:mod:`adaclip._progress`).

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
    checks of this one count it too. :meth:`state_dict` names the ledger's :attr:`run_id`, and
    :meth:`load_state_dict` restores a checkpoint only onto its own run's ledger, keeping the
    ledger's history (never lowering ε). One accountant (one ledger object) writes a ledger at
    a time; :meth:`close` releases it. A copy of the accountant (``copy.deepcopy``, pickling) is
    detached: it records in memory only.
    """

    _progress: bool | None = None  # (an accountant pickled before the option existed has none)

    def __init__(
        self,
        mechanism: str = "rdp",
        *,
        accountant: str | None = None,
        target_epsilon: float | None = None,
        delta: float | None = None,
        pld_value_discretization_interval: float = DEFAULT_PLD_VALUE_DISCRETIZATION_INTERVAL,
        rdp_orders: Sequence[float] | None = None,
        ledger: str | os.PathLike[str] | PrivacyLedger | None = None,
        progress: bool | None = None,
    ) -> None:
        self._mechanism = resolve_mechanism(mechanism, accountant)
        self._progress = _progress.check_progress(progress)
        self._target_epsilon, self._delta = _check_budget(target_epsilon, delta)
        self._pld_interval = _check_discretization(pld_value_discretization_interval)
        self._rdp_orders = _check_orders(rdp_orders)
        self._orders_array = np.array(self._rdp_orders if self._rdp_orders is not None else _default_orders())
        self._rdp_vectors: collections.OrderedDict[tuple[float, float], np.ndarray] = collections.OrderedDict()
        self._pld_steps: collections.OrderedDict[tuple[float, float], Any] = collections.OrderedDict()
        # steps written ahead to the ledger and not yet recorded in memory, per (q, σ)
        self._pending: collections.Counter[tuple[float, float]] = collections.Counter()
        self._ledger: PrivacyLedger | None = None
        self._run_id: str | None = None
        self._reset_history([])
        if ledger is not None:
            self._attach(ledger)

    def _attach(self, ledger: str | os.PathLike[str] | PrivacyLedger) -> None:
        if isinstance(ledger, PrivacyLedger):
            if ledger.closed:
                raise InvalidHyperparameterError(f"ledger {ledger.path!r} is closed")
            if ledger.mechanism != self._mechanism:
                raise InvalidHyperparameterError(
                    f"mechanism mismatch: ledger {ledger.path!r} records a {ledger.mechanism!r} run, this "
                    f"accountant uses {self._mechanism!r}; a ledger is accounted with the mechanism it was created with"
                )
            led = ledger
        elif isinstance(ledger, (str, os.PathLike)) and not isinstance(ledger, bytes):
            led = PrivacyLedger(ledger, mechanism=self._mechanism)  # refuses another mechanism
        else:
            raise InvalidHyperparameterError(f"ledger must be a path, a PrivacyLedger or None, got {ledger!r}")
        self._ledger = led
        self._run_id = led.run_id
        self._reset_history(list(led.history))

    def __getstate__(self) -> dict[str, Any]:
        """Copies and pickles are detached from the ledger (which has a single writer)."""
        state = self.__dict__.copy()
        state["_ledger"] = None
        return state

    # ---------------------------------------------------------------- properties

    @property
    def mechanism(self) -> str:
        """``"rdp"`` or ``"pld"`` (also for an accountant made with ``"prv"``)."""
        return self._mechanism

    @property
    def progress(self) -> bool | None:
        """Whether slow queries show progress (``None``: on a terminal only)."""
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
        return tuple(float(a) for a in self._orders_array)

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
        return f"Accountant(mechanism={self._mechanism!r}, steps={self._steps}, runs={len(self._runs)}{budget})"

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
        if self._mechanism == "rdp":
            return UNBOUNDED_STEPS
        return max(n, min(UNBOUNDED_STEPS, max(_PLD_MIN_HORIZON, _PLD_HORIZON_FACTOR * (self._steps + n))))

    def _count_fitting(self, q: float, sigma: float, limit: int) -> tuple[int, int]:
        """(largest k <= limit fitting the budget, limit) for the current history."""
        target, delta = self._target_epsilon, self._delta
        assert target is not None and delta is not None
        if q == 0:  # touches no data: ε does not change
            return (limit if self.epsilon(delta) <= target else 0), limit
        if sigma == 0:  # one step already has ε = ∞
            return 0, limit
        with _progress.progress(
            self._progress,
            f"privacy budget ({self._mechanism}): steps that fit at sigma={sigma:.4g}, q={q:.4g}",
            unit="probe",
        ) as report:

            def probe(k: int) -> float:
                eps = self._candidate_epsilon(q, sigma, k, delta)
                report.update(1, steps=k, epsilon=f"{eps:.4g}")
                return eps

            k = _largest_fitting(probe, target, limit, lambda: self.epsilon(delta))
        return k, limit

    def _record(self, q: float, sigma: float, n: int) -> None:
        runs = self._runs
        if runs and runs[-1][0] == q and runs[-1][1] == sigma:
            runs[-1] = (q, sigma, runs[-1][2] + n)
        else:
            runs.append((q, sigma, n))
        self._steps += n
        self._rdp_total = None
        self._pld_full = None
        if self._eps_cache:
            self._eps_cache = {}
        if self._target_epsilon is not None:
            key = (q, sigma)
            entry = self._fit.get(key)
            self._fit = {key: (entry[0] - n, entry[1] - n)} if entry is not None else {}

    def _reset_history(self, runs: list[Run]) -> None:
        self._runs: list[Run] = runs
        self._steps: int = sum(r[2] for r in runs)
        # compositions of the first `*_prefix_len` runs (closed runs never change)
        self._rdp_prefix = np.zeros(len(self._orders_array), dtype=np.float64)
        self._rdp_prefix_len = 0
        self._pld_prefix: _PldState | None = None
        self._pld_prefix_len = 0
        self._rdp_total: np.ndarray | None = None
        self._pld_full: _PldState | None = None
        self._eps_cache: dict[float, float] = {}
        self._fit: dict[tuple[float, float], tuple[int, int]] = {}

    # ---------------------------------------------------------------- composition

    def _rdp_vector(self, q: float, sigma: float) -> np.ndarray:
        """Rényi DP of one step at every order, as dp-accounting computes it."""
        key = (q, sigma)
        vec = self._rdp_vectors.get(key)
        if vec is None:
            acc = rdp_privacy_accountant.RdpAccountant(orders=self._orders_array, neighboring_relation=_RELATION)
            with _quiet_dp_accounting_logs():
                vec = acc.compose(_step_event(q, sigma)).rdp
            self._rdp_vectors[key] = vec
            if len(self._rdp_vectors) > _RDP_VECTOR_CACHE_SIZE:
                self._rdp_vectors.popitem(last=False)
        else:
            self._rdp_vectors.move_to_end(key)
        return vec

    def _closed_rdp(self) -> np.ndarray:
        """Σ count·RDP over all runs but the last, summed in order (as RdpAccountant does)."""
        upto = max(len(self._runs) - 1, 0)
        while self._rdp_prefix_len < upto:
            q, s, c = self._runs[self._rdp_prefix_len]
            self._rdp_prefix = self._rdp_prefix + c * self._rdp_vector(q, s)
            self._rdp_prefix_len += 1
        return self._rdp_prefix

    def _full_rdp(self) -> np.ndarray:
        if self._rdp_total is None:
            total = self._closed_rdp()
            if self._runs:
                q, s, c = self._runs[-1]
                total = total + c * self._rdp_vector(q, s)
            self._rdp_total = total
        return self._rdp_total

    def _step_pld(self, q: float, sigma: float) -> privacy_loss_distribution.PrivacyLossDistribution:
        """PLD of one step (q > 0, σ > 0), built as PLDAccountant builds it; cached."""
        key = (q, sigma)
        pld = self._pld_steps.get(key)
        if pld is None:
            pld = privacy_loss_distribution.from_gaussian_mechanism(
                standard_deviation=sigma,
                value_discretization_interval=self._pld_interval,
                sampling_prob=q,
                neighboring_relation=_RELATION,
            )
            self._pld_steps[key] = pld
            if len(self._pld_steps) > _PLD_CACHE_SIZE:
                self._pld_steps.popitem(last=False)
        else:
            self._pld_steps.move_to_end(key)
        return pld

    def _compose_pld(self, state: _PldState, run: Run) -> _PldState:
        """``state`` composed with one run, exactly as PLDAccountant composes that run."""
        q, sigma, count = run
        pld, non_private = state
        if q == 0:
            return state
        if sigma == 0:
            return pld, True
        return pld.compose(self._step_pld(q, sigma).self_compose(count)), non_private

    def _closed_pld(self) -> _PldState:
        """The composition of all runs but the last (PLDs are immutable: safe to share)."""
        if self._pld_prefix is None:
            self._pld_prefix = (privacy_loss_distribution.identity(value_discretization_interval=self._pld_interval), False)
            self._pld_prefix_len = 0
        upto = max(len(self._runs) - 1, 0)
        if self._pld_prefix_len >= upto:
            return self._pld_prefix
        with _progress.progress(
            self._progress, "privacy loss distribution: composing runs", total=upto - self._pld_prefix_len, unit="run"
        ) as report:
            while self._pld_prefix_len < upto:
                self._pld_prefix = self._compose_pld(self._pld_prefix, self._runs[self._pld_prefix_len])
                self._pld_prefix_len += 1
                report.update(1)
        return self._pld_prefix

    def _full_pld(self) -> _PldState:
        if self._pld_full is None:
            state = self._closed_pld()
            if self._runs:
                state = self._compose_pld(state, self._runs[-1])
            self._pld_full = state
        return self._pld_full

    @staticmethod
    def _pld_epsilon(state: _PldState, delta: float) -> float:
        pld, non_private = state
        return math.inf if non_private else float(pld.get_epsilon_for_delta(delta))

    def _candidate_epsilon(self, q: float, sigma: float, k: int, delta: float) -> float:
        """ε(δ) of the history after recording ``k`` more steps with (q, σ) (history unchanged)."""
        if k == 0:
            return self.epsilon(delta)
        runs = self._runs
        merge = bool(runs) and runs[-1][0] == q and runs[-1][1] == sigma
        count = runs[-1][2] + k if merge else k
        if self._mechanism == "rdp":
            base = self._closed_rdp() if merge else self._full_rdp()
            total = base + count * self._rdp_vector(q, sigma)
            return _rdp_epsilon(self._orders_array, total, delta)
        state = self._compose_pld(self._closed_pld() if merge else self._full_pld(), (q, sigma, count))
        return self._pld_epsilon(state, delta)

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
            if not self._runs:
                eps = 0.0
            elif self._mechanism == "rdp":
                eps = _rdp_epsilon(self._orders_array, self._full_rdp(), d)
            else:
                eps = self._pld_epsilon(self._full_pld(), d)
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
        if self._mechanism == "rdp":
            return _rdp_delta(self._orders_array, self._full_rdp(), eps)
        pld, non_private = self._full_pld()
        return 1.0 if non_private else float(pld.get_delta_for_epsilon(eps))

    def to_dp_event(self) -> dp_accounting.DpEvent:
        """The history as a dp-accounting event (``NoOpDpEvent`` when empty)."""
        if not self._runs:
            return dp_accounting.NoOpDpEvent()
        return dp_accounting.ComposedDpEvent([_run_event(q, s, c) for q, s, c in self._runs])

    # ---------------------------------------------------------------- persistence

    def state_dict(self) -> dict[str, Any]:
        """A JSON-serialisable snapshot: mechanism, budget, options, history and the ledger's
        ``run_id`` (``None`` without a ledger)."""
        return {
            "format": _STATE_FORMAT,
            "version": _STATE_VERSION,
            "mechanism": self._mechanism,
            "target_epsilon": self._target_epsilon,
            "delta": self._delta,
            "options": {
                "pld_value_discretization_interval": self._pld_interval,
                "rdp_orders": None if self._rdp_orders is None else list(self._rdp_orders),
            },
            "history": [[q, s, c] for q, s, c in self._runs],
            "run_id": self._run_id,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict`: budget, options and history.

        The mechanism must be this accountant's. Everything is validated first; on any
        problem :class:`~adaclip.errors.InvalidHyperparameterError` is raised and the
        accountant is unchanged. Adjacent runs with the same ``(q, σ)`` are merged. A history
        that already exceeds the loaded budget is accepted (it happened); no step then fits.

        With a ledger, a checkpoint is restored only onto its own run: its ``run_id`` must be
        the ledger's (a ledger that does not match the run is refused), and its history must be
        a prefix of the ledger's, step by step. The history then becomes the *ledger's*: steps
        recorded after the checkpoint was saved still count, so restoring an older checkpoint
        never lowers ε. A checkpoint without a ``run_id`` (saved without a ledger) is accepted
        only by a ledger that records no step yet: its history is appended to the ledger
        (fsynced) first; a ledger that already records steps refuses it. Without a ledger the
        checkpoint's history is taken as it is (and its ``run_id`` carried along).
        """
        if not isinstance(state, Mapping):
            raise InvalidHyperparameterError(f"state must be a mapping, got {type(state).__name__}")
        fmt = state.get("format", _STATE_FORMAT)
        if fmt != _STATE_FORMAT:
            raise InvalidHyperparameterError(f"state format must be {_STATE_FORMAT!r}, got {fmt!r}")
        version = state.get("version", _STATE_VERSION)
        if version != _STATE_VERSION:
            raise InvalidHyperparameterError(f"state version {version!r} is not supported")
        if "mechanism" not in state:
            raise InvalidHyperparameterError("state has no 'mechanism'")
        mechanism = state["mechanism"]
        if mechanism != self._mechanism:
            raise InvalidHyperparameterError(
                f"mechanism mismatch: the state is for {mechanism!r}, this accountant uses {self._mechanism!r}"
            )
        target_epsilon, delta = _check_budget(state.get("target_epsilon"), state.get("delta"))
        options = state.get("options", {})
        if not isinstance(options, Mapping):
            raise InvalidHyperparameterError(f"state 'options' must be a mapping, got {options!r}")
        unknown = set(options) - {"pld_value_discretization_interval", "rdp_orders"}
        if unknown:
            raise InvalidHyperparameterError(f"state 'options' has unknown keys {sorted(unknown)}")
        interval = _check_discretization(
            options.get("pld_value_discretization_interval", DEFAULT_PLD_VALUE_DISCRETIZATION_INTERVAL)
        )
        orders = _check_orders(options.get("rdp_orders"))
        runs = self._parse_history(state.get("history"))
        run_id = state.get("run_id")
        if run_id is not None and (not isinstance(run_id, str) or not run_id):
            raise InvalidHyperparameterError(f"state 'run_id' must be a non-empty string or None, got {run_id!r}")
        ledger = self._ledger
        to_append: list[Run] = []
        if ledger is not None:
            if ledger.closed:
                raise InvalidHyperparameterError(f"ledger {ledger.path!r} is closed; the state was not loaded")
            if run_id is None:
                if ledger.steps:
                    raise InvalidHyperparameterError(
                        f"the checkpoint names no ledger run (it was saved without a ledger) and ledger "
                        f"{ledger.path!r} already records {ledger.steps} steps of run {ledger.run_id}: a ledger "
                        "that does not match the run is refused. Load the checkpoint with the ledger it was "
                        "saved with, or into an accountant with a new ledger"
                    )
                to_append = runs
            elif run_id != ledger.run_id:
                raise InvalidHyperparameterError(
                    f"the checkpoint belongs to ledger run {run_id}, but ledger {ledger.path!r} records run "
                    f"{ledger.run_id}: a ledger that does not match the run is refused. Use that run's ledger"
                )
            else:
                problem = _prefix_problem(runs, list(ledger.history))
                if problem is not None:
                    raise InvalidHyperparameterError(
                        f"the checkpoint's history is not a prefix of the history in ledger {ledger.path!r} "
                        f"({problem}): the checkpoint and the ledger disagree (a ledger restored from an "
                        "older copy, or edited?); refused"
                    )

        for q, sigma, count in to_append:  # the ledger first: if this fails, memory is unchanged
            ledger.append(sample_rate=q, noise_multiplier=sigma, count=count)  # type: ignore[union-attr]
        self._target_epsilon, self._delta = target_epsilon, delta
        if interval != self._pld_interval:
            self._pld_interval = interval
            self._pld_steps.clear()
        if orders != self._rdp_orders:
            self._rdp_orders = orders
            self._orders_array = np.array(orders if orders is not None else _default_orders())
            self._rdp_vectors.clear()
        self._pending.clear()
        if ledger is not None:
            self._reset_history(list(ledger.history))
        else:
            self._reset_history(runs)
            self._run_id = run_id

    @staticmethod
    def _parse_history(history: Any) -> list[Run]:
        if history is None or isinstance(history, (str, bytes, Mapping)) or not isinstance(history, Iterable):
            raise InvalidHyperparameterError(f"state 'history' must be a list of [q, sigma, count], got {history!r}")
        runs: list[Run] = []
        for i, run in enumerate(history):
            if isinstance(run, (str, bytes, Mapping)) or not isinstance(run, Sequence) or len(run) != 3:
                raise InvalidHyperparameterError(
                    f"state 'history' entry {i} must be [sample_rate, noise_multiplier, count], got {run!r}"
                )
            q = _check_sample_rate(run[0], f"history[{i}] sample_rate")
            s = _check_noise_multiplier(run[1], f"history[{i}] noise_multiplier")
            c = _check_count(run[2], f"history[{i}] count")
            if runs and runs[-1][0] == q and runs[-1][1] == s:
                runs[-1] = (q, s, runs[-1][2] + c)
            else:
                runs.append((q, s, c))
        return runs

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write :meth:`state_dict` as JSON to ``path`` (atomically: temp file, then rename)."""
        text = json.dumps(self.state_dict(), indent=2, allow_nan=False)
        path = os.fspath(path)
        directory = os.path.dirname(os.path.abspath(path))
        fd, tmp = tempfile.mkstemp(prefix=".accountant-", suffix=".json", dir=directory)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text + "\n")
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise

    @classmethod
    def load(
        cls, path: str | os.PathLike[str], *, ledger: str | os.PathLike[str] | PrivacyLedger | None = None
    ) -> Accountant:
        """An accountant restored from a file written by :meth:`save`.

        With ``ledger=``, onto that ledger, as :meth:`load_state_dict` restores it (the
        ledger's history wins). A checkpoint that names a ledger run is refused if the ledger
        path does not exist (a ledger cannot be recreated from a checkpoint: the releases
        after it would be lost), before anything is created.
        """
        with open(path, encoding="utf-8") as f:
            try:
                state = json.load(f)
            except json.JSONDecodeError as err:
                raise InvalidHyperparameterError(f"{os.fspath(path)!r} is not valid JSON: {err}") from None
        if not isinstance(state, Mapping) or "mechanism" not in state:
            raise InvalidHyperparameterError(f"{os.fspath(path)!r} does not hold an accountant state")
        mechanism = _check_mechanism(state["mechanism"])
        if (
            isinstance(ledger, (str, os.PathLike))
            and state.get("run_id") is not None
            and not os.path.exists(ledger)
        ):
            raise InvalidHyperparameterError(
                f"{os.fspath(path)!r} belongs to ledger run {state['run_id']!r}, but the ledger "
                f"{os.fspath(ledger)!r} does not exist: pass that run's ledger (a new ledger would not "
                "count the releases made after the checkpoint)"
            )
        accountant = cls(mechanism, ledger=ledger)
        try:
            accountant.load_state_dict(state)
        except BaseException:
            if accountant.ledger is not None and accountant.ledger is not ledger:
                accountant.close()
            raise
        return accountant


# --------------------------------------------------------------------------------------
# calibration
# --------------------------------------------------------------------------------------


def calibrate_noise_multiplier(
    *,
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    mechanism: str = "rdp",
    tol: float = 1e-4,
    pld_value_discretization_interval: float = DEFAULT_PLD_VALUE_DISCRETIZATION_INTERVAL,
    rdp_orders: Sequence[float] | None = None,
    progress: bool | None = None,
) -> float:
    """Smallest noise multiplier σ with ε(δ) <= ``target_epsilon`` after ``steps`` steps.

    Each step is the Poisson-subsampled Gaussian mechanism with sample rate ``q`` =
    ``sample_rate`` (in (0, 1]), accounted as :class:`Accountant` does with the same
    ``mechanism`` and options (``"prv"`` is ``"pld"``, ``"gdp"`` is refused: see
    :class:`Accountant`). ε(σ) decreases with σ, so the answer σ* is the root of
    ε(σ) = target_epsilon; a bracket ``[σ_lo, σ_hi]`` is found by halving/doubling from 1 and
    handed to ``dp_accounting.calibrate_dp_mechanism`` (Brent's method). The returned σ
    always satisfies the budget and is within ``tol`` *relative* of σ*:
    ``σ* <= σ <= σ*·(1 + tol)``.

    Each evaluation of ε(σ) composes ``steps`` steps: milliseconds with ``"rdp"``, a fraction
    of a second with ``"pld"``, whose calibration takes 20–30 of them. ``progress`` shows them
    on stderr (the σ tried and its ε): ``None`` (default) only when stderr is a terminal and
    the calibration has run for a second, ``True`` always, ``False`` never.

    Raises:
        InvalidHyperparameterError: an argument is out of range (named in the message).
    """
    target_epsilon = _check_epsilon(target_epsilon, "target_epsilon")
    delta = _check_delta(delta, "delta")
    q = _check_sample_rate(sample_rate, allow_zero=False)
    steps = _check_count(steps, "steps")
    mechanism = _check_mechanism(mechanism)
    tol = _as_float("tol", tol)
    if not (math.isfinite(tol) and 0 < tol < 1):
        raise InvalidHyperparameterError(f"tol must be in (0, 1), got {tol!r}")
    interval = _check_discretization(pld_value_discretization_interval)
    orders = _check_orders(rdp_orders)
    progress = _progress.check_progress(progress)
    orders_array = np.array(orders if orders is not None else _default_orders())

    def fresh() -> dp_accounting.PrivacyAccountant:
        if mechanism == "rdp":
            return rdp_privacy_accountant.RdpAccountant(orders=orders_array, neighboring_relation=_RELATION)
        return pld_privacy_accountant.PLDAccountant(
            neighboring_relation=_RELATION, value_discretization_interval=interval
        )

    desc = f"calibrating sigma ({mechanism}, {steps} steps, target epsilon={target_epsilon:g})"
    with _quiet_dp_accounting_logs(), _progress.progress(progress, desc, unit="evaluation") as report:

        def event(sigma: float) -> dp_accounting.DpEvent:
            # every evaluation of ε(σ), ours and calibrate_dp_mechanism's, builds one event
            report.update(1, sigma=f"{float(sigma):.5g}")
            return _run_event(q, float(sigma), steps)

        def eps(sigma: float) -> float:
            return float(fresh().compose(event(sigma)).get_epsilon(delta))

        return _calibrate(eps, fresh, event, target_epsilon=target_epsilon, delta=delta, q=q, steps=steps, tol=tol)


def _calibrate(
    eps: Callable[[float], float],
    fresh: Callable[[], dp_accounting.PrivacyAccountant],
    event: Callable[[float], dp_accounting.DpEvent],
    *,
    target_epsilon: float,
    delta: float,
    q: float,
    steps: int,
    tol: float,
) -> float:
    """The search of :func:`calibrate_noise_multiplier` (arguments already validated)."""
    # Bracket: eps(lo) > target >= eps(hi). ε → ∞ as σ → 0 (q > 0) and → 0 as σ → ∞.
    lo = hi = 1.0
    if eps(1.0) <= target_epsilon:
        lo = 0.5
        while eps(lo) <= target_epsilon:
            hi, lo = lo, lo / 2
            if lo < 1e-12:
                raise InvalidHyperparameterError(
                    f"target_epsilon={target_epsilon!r} is met with essentially no noise; nothing to calibrate"
                )
    else:
        hi = 2.0
        while eps(hi) > target_epsilon:
            lo, hi = hi, hi * 2
            if hi > 1e12:
                raise InvalidHyperparameterError(
                    f"target_epsilon={target_epsilon!r} cannot be met at delta={delta!r} with "
                    f"sample_rate={q!r} and steps={steps}"
                )
    abs_tol = tol * lo  # lo < σ*, so |σ - σ*| <= tol·lo is within tol relative
    sigma = float(
        dp_accounting.calibrate_dp_mechanism(
            fresh,
            event,
            target_epsilon,
            delta,
            bracket_interval=dp_accounting.ExplicitBracketInterval(lo, hi),
            tol=abs_tol,
        )
    )
    # calibrate_dp_mechanism already guarantees the budget; make sure regardless.
    if eps(sigma) > target_epsilon:  # pragma: no cover - defensive
        for _ in range(8):
            sigma += abs_tol
            if eps(sigma) <= target_epsilon:
                break
        else:
            sigma = hi
    return sigma
