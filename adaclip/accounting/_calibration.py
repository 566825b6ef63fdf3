"""Calibration: the smallest noise multiplier σ that meets a budget (ε, δ) over a planned run.

The plan is ``steps`` steps of the Poisson-subsampled Gaussian at one sample rate, accounted by
the same method and options as :class:`~adaclip.accounting.Accountant` would account them (the
method's composer supplies dp-accounting's accountant). ε(σ) decreases with σ, so σ* is the root
of ε(σ) = target; the search brackets it, then hands it to dp-accounting's Brent search.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import dp_accounting

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
from adaclip.accounting._mechanisms import _check_mechanism
from adaclip.accounting._pld import DEFAULT_PLD_VALUE_DISCRETIZATION_INTERVAL
from adaclip.errors import InvalidHyperparameterError


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
    composer = make_composer(
        mechanism, pld_value_discretization_interval=interval, rdp_orders=orders, progress=progress
    )
    fresh = composer.dp_accountant

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
