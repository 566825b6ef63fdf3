"""Calibration: the smallest noise multiplier σ that meets a budget (ε, δ) over a planned run.

The plan is ``steps`` steps of the Poisson-subsampled Gaussian at one sample rate, accounted by
the same method and options as :class:`~adaclip.accounting.Accountant` would account them. ε(σ)
decreases with σ, so σ* is the root of ε(σ) = target.

- ``"rdp"``: the search brackets the root, then hands it to dp-accounting's Brent search (each
  ε(σ) from the composer's dp-accounting accountant).
- ``"pld"`` (the default): a secant search on ``log ε`` against ``log σ`` (nearly a straight
  line), first on a coarse grid (interval :data:`COARSE_PLD_VALUE_DISCRETIZATION_INTERVAL`, to
  find the neighbourhood) and then on the calibration grid
  (:data:`CALIBRATION_PLD_VALUE_DISCRETIZATION_INTERVAL`, 1e-3 by default). Every ε(σ) is the
  pessimistic PLD of ``steps`` steps (:func:`~adaclip.accounting._gaussian_pld.gaussian_pld`,
  dp-accounting's PLD built with its per-point loop vectorised), so the σ returned meets the
  budget on that grid. About 8–10 evaluations, ~0.1 s each for a run of 2,000 steps at
  ``q = 0.005``.

**Why a coarser grid is safe.** Every pessimistic discretisation over-estimates ε; a coarser
grid (``Δ = 10⁻³``) over-estimates it slightly more than the accountant's (``10⁻⁴``), by
0.03 % on the main job's plan (2.99998 against 2.99922 at the calibrated σ), which is what
``tests/test_accounting_pld_fast.py`` checks on a grid of runs. So σ meets the budget also as
the accountant reports it, and is larger than the fine grid's σ* by a similar, negligible
fraction. The accountant enforces the budget in any case: a run never spends more than its ε.

Results are cached by ``(mechanism, q, steps, δ, ε, tol, options)`` for the process.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from adaclip import _progress
from adaclip.accounting._checks import (
    _as_float,
    _check_count,
    _check_delta,
    _check_discretization,
    _check_epsilon,
    _check_orders,
    _check_sample_rate,
)
from adaclip.accounting._composer import make_composer
from adaclip.accounting._events import _run_event
from adaclip.accounting._logs import _quiet_dp_accounting_logs
from adaclip.accounting._mechanisms import accounting_method
from adaclip.accounting._pld import DEFAULT_PLD_VALUE_DISCRETIZATION_INTERVAL, gaussian_pld
from adaclip.errors import InvalidHyperparameterError

if TYPE_CHECKING:
    import dp_accounting

#: The grid of a PLD calibration's final search (pessimistic; see the module docstring).
CALIBRATION_PLD_VALUE_DISCRETIZATION_INTERVAL: float = 1e-3
#: The grid on which a PLD calibration first finds the neighbourhood of σ*.
COARSE_PLD_VALUE_DISCRETIZATION_INTERVAL: float = 1e-2
# the coarse search stops once σ is known within this relative width
_COARSE_TOL = 1e-2
# σ outside [_SIGMA_MIN, _SIGMA_MAX]: nothing to calibrate, or the budget cannot be met
_SIGMA_MIN, _SIGMA_MAX = 1e-12, 1e12
_CACHE_SIZE = 256
_cache: collections.OrderedDict[tuple[Any, ...], float] = collections.OrderedDict()


def calibrate_noise_multiplier(
    *,
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    accountant: str | None = None,
    mechanism: str | None = None,
    tol: float = 1e-4,
    pld_value_discretization_interval: float | None = None,
    rdp_orders: Sequence[float] | None = None,
    progress: bool | None = None,
    initial_sigma: float | None = None,
) -> float:
    """Smallest noise multiplier σ with ε(δ) <= ``target_epsilon`` after ``steps`` steps.

    Each step is the Poisson-subsampled Gaussian mechanism with sample rate ``q`` =
    ``sample_rate`` (in (0, 1]), accounted as :class:`Accountant` does with the same
    ``accountant`` (the method: ``"pld"``, the default and the tightest; ``"prv"`` is ``"pld"``;
    ``"rdp"``; ``"gdp"`` is refused: see :class:`Accountant`; ``mechanism=``, its old name, is
    deprecated and warns :class:`FutureWarning`). ε(σ) decreases with σ, so the answer σ* is
    the root of ε(σ) = target_epsilon. The returned σ always satisfies the budget and is
    within ``tol`` *relative* of σ*: ``σ* <= σ <= σ*·(1 + tol)``.

    ``"pld"``: ε(σ) is the pessimistic PLD on the grid ``pld_value_discretization_interval``
    (``None``: :data:`CALIBRATION_PLD_VALUE_DISCRETIZATION_INTERVAL`, 1e-3, which
    over-estimates ε by a hair more than the accountant's 1e-4, so the σ found meets the
    budget as the accountant reports it too); a secant search on ``log ε(log σ)``, first on a
    coarse grid: about a second for the main job's 1,950 steps at ``q = 0.005``. ``"rdp"``:
    a bracket found by halving/doubling from 1 and dp-accounting's Brent search
    (``dp_accounting.calibrate_dp_mechanism``). Results are cached for the process.

    ``progress`` shows the evaluations on stderr (the σ tried): ``None`` (default) once the
    calibration has run for a second (a bar on a terminal, a line per second through the
    ``adaclip._progress`` logger when stderr is a file or a pipe), ``True`` always, ``False``
    never. ``initial_sigma`` (``"pld"`` only) is where the search starts (default 1): a good
    guess saves evaluations; the result is the same within ``tol``.

    Raises:
        InvalidHyperparameterError: an argument is out of range (named in the message).
    """
    target_epsilon = _check_epsilon(target_epsilon, "target_epsilon")
    delta = _check_delta(delta, "delta")
    q = _check_sample_rate(sample_rate, allow_zero=False)
    steps = _check_count(steps, "steps")
    mechanism = accounting_method(accountant, mechanism, caller="calibrate_noise_multiplier")
    tol = _as_float("tol", tol)
    if not (math.isfinite(tol) and 0 < tol < 1):
        raise InvalidHyperparameterError(f"tol must be in (0, 1), got {tol!r}")
    if pld_value_discretization_interval is None:
        pld_value_discretization_interval = (
            CALIBRATION_PLD_VALUE_DISCRETIZATION_INTERVAL if mechanism == "pld" else DEFAULT_PLD_VALUE_DISCRETIZATION_INTERVAL
        )
    interval = _check_discretization(pld_value_discretization_interval)
    orders = _check_orders(rdp_orders)
    progress = _progress.check_progress(progress)
    if initial_sigma is not None:
        initial_sigma = _as_float("initial_sigma", initial_sigma)
        if not (math.isfinite(initial_sigma) and _SIGMA_MIN < initial_sigma < _SIGMA_MAX):
            raise InvalidHyperparameterError(f"initial_sigma must be a finite number > 0, got {initial_sigma!r}")
    key = (mechanism, q, steps, delta, target_epsilon, tol, interval if mechanism == "pld" else orders)
    desc = f"calibrating sigma ({mechanism}, {steps} steps, target epsilon={target_epsilon:g})"
    if key in _cache:
        _cache.move_to_end(key)
        with _progress.progress(progress, desc, unit="evaluation") as report:
            report.update(0, sigma=f"{_cache[key]:.5g}", cached="yes")  # says what it chose, from the cache
        return _cache[key]

    with _quiet_dp_accounting_logs(), _progress.progress(progress, desc, unit="evaluation") as report:
        if mechanism == "pld":
            sigma = _calibrate_pld(report, target_epsilon=target_epsilon, delta=delta, q=q, steps=steps, tol=tol,
                                   interval=interval, start=1.0 if initial_sigma is None else initial_sigma)  # fmt: skip
        else:
            composer = make_composer(mechanism, pld_value_discretization_interval=interval, rdp_orders=orders,
                                     progress=progress)  # fmt: skip
            fresh = composer.dp_accountant

            def event(sigma: float) -> dp_accounting.DpEvent:
                # every evaluation of ε(σ), ours and calibrate_dp_mechanism's, builds one event
                report.update(1, sigma=f"{float(sigma):.5g}")
                return _run_event(q, float(sigma), steps)

            def eps(sigma: float) -> float:
                return float(fresh().compose(event(sigma)).get_epsilon(delta))

            sigma = _calibrate(eps, fresh, event, target_epsilon=target_epsilon, delta=delta, q=q, steps=steps, tol=tol)
    _cache[key] = sigma
    if len(_cache) > _CACHE_SIZE:
        _cache.popitem(last=False)
    return sigma


def _calibrate_pld(
    report: Any, *, target_epsilon: float, delta: float, q: float, steps: int, tol: float, interval: float,
    start: float,
) -> float:
    """The ``"pld"`` search of :func:`calibrate_noise_multiplier` (arguments validated)."""
    log_target = math.log(target_epsilon)

    def excess_at(grid: float) -> Callable[[float], float]:
        def excess(log_sigma: float) -> float:  # log ε(σ) − log target, decreasing in log σ
            sigma = math.exp(log_sigma)
            report.update(1, sigma=f"{sigma:.5g}")
            eps = float(gaussian_pld(sigma, q, grid).self_compose(steps).get_epsilon_for_delta(delta))
            return math.log(eps) - log_target if eps > 0 else -math.inf

        return excess

    def out_of_range(log_sigma: float) -> InvalidHyperparameterError:
        if log_sigma > 0:
            return InvalidHyperparameterError(
                f"target_epsilon={target_epsilon!r} cannot be met at delta={delta!r} with "
                f"sample_rate={q!r} and steps={steps}"
            )
        return InvalidHyperparameterError(
            f"target_epsilon={target_epsilon!r} is met with essentially no noise; nothing to calibrate"
        )

    # ε(σ) falls a little faster than 1/σ in the usual range: the first step's slope guess
    log_sigma, slope = math.log(start), -1.5
    coarse = COARSE_PLD_VALUE_DISCRETIZATION_INTERVAL
    if coarse > interval and tol < _COARSE_TOL:
        log_sigma, slope = _log_secant(excess_at(coarse), log_sigma, slope, math.log1p(_COARSE_TOL), out_of_range)
    log_sigma, _ = _log_secant(excess_at(interval), log_sigma, slope, math.log1p(tol), out_of_range)
    return math.exp(log_sigma)


def _log_secant(
    excess: Callable[[float], float],
    start: float,
    slope: float,
    width: float,
    out_of_range: Callable[[float], Exception],
) -> tuple[float, float]:
    """The root of a decreasing ``excess(u)`` (``u = log σ``), bracketed to ``width``.

    Secant steps from ``start`` (the first with ``slope``), each aimed a quarter of ``width``
    beyond the estimated root so that the next evaluation lands on the other side of it;
    steps are at most a factor 4 in σ until the root is bracketed, then kept inside the
    bracket, which is bisected when three steps in a row fail to halve it. Returns
    ``(hi, slope)``: the upper end of a bracket ``lo < root <= hi`` with ``hi − lo <= width``
    (``excess(hi) <= 0``: σ = e^hi meets the budget) and the last slope seen.
    """
    lo: tuple[float, float] | None = None  # excess > 0
    hi: tuple[float, float] | None = None  # excess <= 0
    prev: tuple[float, float] | None = None
    margin = 0.25 * width
    u = start
    slow = 0
    last_width = math.inf
    for _ in range(200):
        if not (math.log(_SIGMA_MIN) <= u <= math.log(_SIGMA_MAX)):
            raise out_of_range(u)
        value = excess(u)
        if value > 0:
            if lo is None or u > lo[0]:
                lo = (u, value)
        elif hi is None or u < hi[0]:
            hi = (u, value)
        if lo is not None and hi is not None:
            bracket = hi[0] - lo[0]
            if bracket <= width:
                return hi[0], slope
            slow = slow + 1 if bracket > 0.5 * last_width else 0
            last_width = bracket
        if prev is not None and u != prev[0] and math.isfinite(value) and math.isfinite(prev[1]):
            s = (value - prev[1]) / (u - prev[0])
            if s < 0:
                slope = s
        prev = (u, value)
        aim = -value / slope + (margin if value > 0 else -margin) if math.isfinite(value) else math.copysign(9.0, value)
        step = max(-math.log(4.0), min(math.log(4.0), aim))
        u_next = u + step
        if lo is not None and hi is not None and (slow >= 3 or not lo[0] < u_next < hi[0]):
            u_next = 0.5 * (lo[0] + hi[0])
            slow = 0
        u = u_next
    raise out_of_range(u)  # pragma: no cover - 200 evaluations: the bracket halves every few


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
    import dp_accounting  # lazy: dp-accounting loads SciPy and absl (1-2 s); only calibration needs it

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
