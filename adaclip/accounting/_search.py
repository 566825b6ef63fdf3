"""The integer search behind the budget: the largest number of further steps that fits.

ε(δ) of a history is non-decreasing in the number of steps appended to it, so "how many more
steps with this ``(q, σ)`` keep ε within the budget" is a search over an integer for the last
point where a monotone function stays under a target. :class:`~adaclip.accounting.Accountant`
runs it once per new ``(q, σ)`` and keeps the answer; the composers only evaluate ε.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from adaclip import _progress

#: What :meth:`Accountant.remaining_steps` returns when the number of steps that fit is
#: unbounded (``q = 0``, or no budget) or at least this large.
UNBOUNDED_STEPS: int = 2**53


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


def steps_that_fit(
    q: float,
    sigma: float,
    limit: int,
    *,
    target: float,
    epsilon_now: Callable[[], float],
    epsilon_after: Callable[[int], float],
    progress: bool | None,
    mechanism: str,
) -> int:
    """Largest ``k <= limit`` such that ``k`` more steps with ``(q, σ)`` keep ε within ``target``.

    ``epsilon_now()`` is ε of the history, ``epsilon_after(k)`` ε after ``k`` more such steps.
    With ``q = 0`` the steps touch no data (ε does not change): all of them fit or none does;
    with ``σ = 0`` one step already has ε = ∞. Otherwise :func:`_largest_fitting` searches, each
    probe shown as progress (:mod:`adaclip._progress`) when ``progress`` asks for it.
    """
    if q == 0:  # touches no data: ε does not change
        return limit if epsilon_now() <= target else 0
    if sigma == 0:  # one step already has ε = ∞
        return 0
    with _progress.progress(
        progress,
        f"privacy budget ({mechanism}): steps that fit at sigma={sigma:.4g}, q={q:.4g}",
        unit="probe",
    ) as report:

        def probe(k: int) -> float:
            eps = epsilon_after(k)
            report.update(1, steps=k, epsilon=f"{eps:.4g}")
            return eps

        return _largest_fitting(probe, target, limit, epsilon_now)
