"""From canary scores to ε: lower confidence bounds and estimates of a mechanism's privacy.

An audit inserts *canaries* into a training run, each one *included* or not, and gives every
canary a *score* read from what the mechanism released: the higher the score, the more the
release looks as if the canary was in. Three estimators turn the scores into statements about
the ε of the mechanism at a fixed δ:

* :func:`one_run_epsilon` (Steinke, Nasr & Jagielski, *Privacy auditing with one (1) training
  run*, 2023): m canaries in ONE run, each included by an independent fair coin. The auditor
  guesses "in" for the canaries with the highest scores; if it is right too often for an
  (ε, δ)-DP mechanism, ε is rejected. A lower confidence bound, valid whatever the scores'
  distribution.
* :func:`threshold_epsilon`: many runs (or many independent trials of one step), each with or
  without the canary: Clopper–Pearson bounds on the false-positive and false-negative rates of
  the test "in iff score > t" give a lower confidence bound, also free of assumptions on the
  scores, but needing many trials.
* :func:`gdp_fit`: a parametric fit, the scores read as the two Gaussians of a μ-GDP mechanism
  (Dong, Roth & Su, *Gaussian differential privacy*, 2019/2022). Far more powerful on Gaussian
  scores, but it assumes them.

Conventions. ``scores``: one float per canary (or trial); higher = more likely included.
``included``: True where the canary was inserted. A NaN score counts as +inf (above every
threshold: a non-finite release is taken as a perfect tell); −inf is below every threshold.
``confidence`` is the probability with which a bound holds, ``significance = 1 − confidence``;
``delta`` is the δ at which ε is stated. Lower bounds are ≥ 0: 0 when nothing is certified.

Gaussian DP. A mechanism is μ-GDP when telling any two neighbouring inputs apart is no easier
than telling ``N(0, 1)`` from ``N(μ, 1)``; the Gaussian mechanism with sensitivity Δ and noise
standard deviation σ is ``(Δ/σ)``-GDP. μ-GDP is (ε, δ(ε))-DP for every ε ≥ 0 with

    δ(ε) = Φ(−ε/μ + μ/2) − e^ε·Φ(−ε/μ − μ/2),

and no smaller δ (Dong, Roth & Su, Corollary 2.13): :func:`gdp_delta`, :func:`gdp_epsilon` and
:func:`gdp_mu` convert between μ, ε and δ.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from scipy import optimize, special, stats

from adaclip.accounting import Accountant
from adaclip.options import integer_at_least

__all__ = [
    "gdp_delta",
    "gdp_epsilon",
    "gdp_mu",
    "clopper_pearson_upper",
    "clopper_pearson_interval",
    "OneRunBound",
    "one_run_p_value",
    "one_run_epsilon",
    "default_guesses",
    "ThresholdBound",
    "threshold_epsilon",
    "GdpFit",
    "gdp_fit",
    "accountant_epsilon",
]


# --------------------------------------------------------------------------- validation


def _real(name: str, value: Any) -> float:
    if isinstance(value, (bool, str, bytes)) or value is None:
        raise ValueError(f"{name} must be a real number, got {value!r}")
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a real number, got {value!r}") from None
    if math.isnan(x):
        raise ValueError(f"{name} must not be NaN, got {value!r}")
    return x


def _open_unit(name: str, value: Any) -> float:
    x = _real(name, value)
    if not 0.0 < x < 1.0:
        raise ValueError(f"{name} must be in (0, 1), got {value!r}")
    return x


def _delta(value: Any, *, allow_zero: bool) -> float:
    x = _real("delta", value)
    if not ((0.0 <= x if allow_zero else 0.0 < x) and x < 1.0):
        interval = "[0, 1)" if allow_zero else "(0, 1)"
        raise ValueError(f"delta must be in {interval}, got {value!r}")
    return x


def _scores_and_included(scores: Any, included: Any) -> tuple[np.ndarray, np.ndarray]:
    """1-d float scores (NaN → +inf) and a boolean mask of the same length."""
    s = np.asarray(scores, dtype=np.float64)
    inc = np.asarray(included)
    if s.ndim != 1:
        raise ValueError(f"scores must be 1-d, got shape {s.shape}")
    if inc.shape != s.shape:
        raise ValueError(
            f"scores and included must have the same length, got shapes {s.shape} and {inc.shape}"
        )
    if s.size == 0:
        raise ValueError("scores is empty: nothing to audit")
    if inc.dtype != bool:
        if inc.dtype.kind not in "iuf" or not np.all((inc == 0) | (inc == 1)):
            raise ValueError(f"included must be boolean (or 0/1), got dtype {inc.dtype}")
        inc = inc.astype(bool)
    return np.where(np.isnan(s), np.inf, s), inc


def _both_worlds(included: np.ndarray, minimum: int) -> tuple[int, int]:
    n1 = int(included.sum())
    n0 = int(included.size - n1)
    if n0 < minimum or n1 < minimum:
        raise ValueError(
            f"included must have at least {minimum} canaries on each side, got {n1} included and {n0} excluded"
        )
    return n0, n1


# --------------------------------------------------------------------------- Gaussian DP

_LOG_FLOOR = -1e4  # below log of the smallest double: "δ = 0" for the root searches


def _log_gdp_delta(epsilon: float, mu: float) -> float:
    """``log δ(ε)`` of μ-GDP for finite ``μ > 0`` and finite ``ε``, in the log domain:
    ``log Φ(a) + log(1 − exp(ε + log Φ(b) − log Φ(a)))`` with ``a = −ε/μ + μ/2``, ``b = a − μ``,
    which neither overflows (``e^ε``) nor cancels catastrophically when δ is tiny."""
    a = -epsilon / mu + mu / 2
    log_pa = float(special.log_ndtr(a))
    if log_pa == -math.inf:
        return -math.inf
    ratio = epsilon + float(special.log_ndtr(a - mu)) - log_pa
    if ratio >= 0.0:  # rounding: the difference is below the resolution of the terms
        return -math.inf
    return log_pa + math.log(-math.expm1(ratio))


def gdp_delta(epsilon: float, mu: float) -> float:
    """δ(ε) of μ-GDP: ``Φ(−ε/μ + μ/2) − e^ε·Φ(−ε/μ − μ/2)``, the smallest δ for which a μ-GDP
    mechanism is (ε, δ)-DP.

    This is the largest difference ``P[M(D) ∈ S] − e^ε·P[M(D′) ∈ S]`` over events S for the pair
    ``N(μ, 1)``, ``N(0, 1)``, attained by the half-line ``S = {y > ε/μ + μ/2}`` (where the
    likelihood ratio exceeds ``e^ε``). Evaluated in the log domain (see :func:`_log_gdp_delta`).

    ``μ ≤ 0`` gives 0 (a non-positive μ, e.g. the lower end of a fitted interval, is read as
    no distinguishability), ``μ = inf`` gives 1 for finite ε, ``ε = inf`` gives 0.
    """
    eps = _real("epsilon", epsilon)
    m = _real("mu", mu)
    if eps < 0:
        raise ValueError(f"epsilon must be >= 0, got {epsilon!r}")
    if m <= 0 or math.isinf(eps):
        return 0.0
    if math.isinf(m):
        return 1.0
    return math.exp(_log_gdp_delta(eps, m))


def gdp_epsilon(mu: float, delta: float) -> float:
    """The smallest ε ≥ 0 with ``δ(ε) ≤ delta`` for μ-GDP (see :func:`gdp_delta`).

    0 for ``μ ≤ 0`` (and whenever ``δ(0) ≤ delta``), ``inf`` for ``μ = inf``. δ(ε) decreases
    in ε, and ``δ(ε) ≤ Φ(−ε/μ + μ/2)``, which equals ``delta`` at
    ``ε₊ = μ·(μ/2 + Φ⁻¹(1 − delta))``: the root lies in ``[0, ε₊]`` and is found by Brent's
    method on ``log δ(ε) − log delta``.
    """
    m = _real("mu", mu)
    d = _delta(delta, allow_zero=False)
    if m <= 0:
        return 0.0
    if math.isinf(m):
        return math.inf
    target = math.log(d)

    def gap(eps: float) -> float:  # clamped: Brent's method needs finite values
        return max(_log_gdp_delta(eps, m), _LOG_FLOOR) - target

    if gap(0.0) <= 0:
        return 0.0
    hi = m * (m / 2 - float(special.ndtri(d))) if d < 0.5 else m * m / 2  # Φ⁻¹(1 − d) = −Φ⁻¹(d)
    hi = max(hi, 1e-12)
    while gap(hi) > 0:  # only for rounding at the edge of the bracket
        hi *= 2
    return float(optimize.brentq(gap, 0.0, hi, xtol=1e-13, rtol=1e-13, maxiter=500))


def gdp_mu(epsilon: float, delta: float) -> float:
    """The μ of the Gaussian mechanism that is exactly (ε, δ)-DP: ``δ(ε; μ) = delta``.

    The inverse of :func:`gdp_epsilon` in μ (``gdp_epsilon(gdp_mu(ε, δ), δ) = ε``); for a
    Gaussian mechanism with sensitivity 1 it is ``1/σ`` for the σ that calibrates it to
    (ε, δ). δ(ε; μ) increases in μ, from 0 at ``μ = 0`` to 1, so the root is unique; it is
    bracketed by doubling and found by Brent's method. At ``ε = 0``,
    ``μ = 2·Φ⁻¹((1 + δ)/2)``.
    """
    eps = _real("epsilon", epsilon)
    d = _delta(delta, allow_zero=False)
    if eps < 0:
        raise ValueError(f"epsilon must be >= 0, got {epsilon!r}")
    if math.isinf(eps):
        return math.inf
    if eps == 0:
        return 2 * float(special.ndtri((1 + d) / 2))
    target = math.log(d)

    def gap(mu: float) -> float:
        return max(_log_gdp_delta(eps, mu), _LOG_FLOOR) - target

    hi = 1.0
    while gap(hi) < 0:
        hi *= 2
    lo = hi / 2
    while gap(lo) > 0:
        lo /= 2
    return float(optimize.brentq(gap, lo, hi, xtol=1e-15, rtol=1e-13, maxiter=500))


# --------------------------------------------------------------------------- Clopper–Pearson


def _cp_upper(k: np.ndarray, n: int, significance: float) -> np.ndarray:
    """Vectorised one-sided Clopper–Pearson upper bounds (no validation)."""
    k = np.asarray(k)
    safe = np.minimum(k, n - 1)
    return np.where(k >= n, 1.0, stats.beta.ppf(1.0 - significance, safe + 1, n - safe))


def clopper_pearson_upper(k: int, n: int, significance: float) -> float:
    """One-sided Clopper–Pearson upper confidence bound on a binomial proportion.

    With ``k`` successes in ``n`` trials, the bound is the p at which
    ``P[Binom(n, p) ≤ k] = significance``, i.e. the ``1 − significance`` quantile of
    ``Beta(k + 1, n − k)`` (1 when ``k = n``). For every true p, ``P[p > bound] ≤
    significance``: the bound is exact (conservative for a discrete outcome), with no normal
    approximation.
    """
    n = integer_at_least("n", n, 1)
    k = integer_at_least("k", k, 0)
    if k > n:
        raise ValueError(f"k must be <= n = {n}, got {k}")
    sig = _open_unit("significance", significance)
    return float(_cp_upper(np.asarray(k), n, sig))


def clopper_pearson_interval(k: int, n: int, confidence: float) -> tuple[float, float]:
    """Two-sided Clopper–Pearson interval for a binomial proportion at level ``confidence``.

    ``[Beta(k, n − k + 1) quantile at α/2, Beta(k + 1, n − k) quantile at 1 − α/2]`` with
    ``α = 1 − confidence`` (0 when ``k = 0``, 1 when ``k = n``): each end misses the true p
    with probability at most α/2, so the interval covers it with probability ≥ ``confidence``.
    """
    n = integer_at_least("n", n, 1)
    k = integer_at_least("k", k, 0)
    if k > n:
        raise ValueError(f"k must be <= n = {n}, got {k}")
    alpha = 1.0 - _open_unit("confidence", confidence)
    lower = 0.0 if k == 0 else float(stats.beta.ppf(alpha / 2, k, n - k + 1))
    upper = 1.0 if k == n else float(stats.beta.ppf(1 - alpha / 2, k + 1, n - k))
    return lower, upper


# --------------------------------------------------------------------------- one run


@dataclasses.dataclass(frozen=True)
class OneRunBound:
    """The one-run lower bound of :func:`one_run_epsilon`.

    Attributes:
      epsilon_lower: with probability ≥ ``confidence`` the mechanism is not (ε, ``delta``)-DP
        for any ε below this (0: nothing certified).
      num_guesses: ``r``, how many canaries the chosen guess set calls "in".
      num_correct: ``v``, how many of them were included.
      num_canaries: ``m``.
      threshold: the score cut of the chosen guesses: "in" iff ``score ≥ threshold``
        (``inf`` when no canary is guessed).
      confidence, delta: where the bound is stated.
    """

    epsilon_lower: float
    num_guesses: int
    num_correct: int
    num_canaries: int
    threshold: float
    confidence: float
    delta: float


def _binomial_sf(v: int, r: int, q: np.ndarray) -> np.ndarray:
    """``P[Binom(r, q) ≥ v]`` (1 for ``v ≤ 0``)."""
    return np.where(v <= 0, 1.0, stats.binom.sf(v - 1, r, q))


def _one_run_p(epsilon: np.ndarray, r: int, v: int, m: int, delta: float) -> np.ndarray:
    """Vectorised p-value of :func:`one_run_p_value` over an array of ε (no validation)."""
    eps = np.asarray(epsilon, dtype=np.float64)
    q = special.expit(eps)
    beta = _binomial_sf(v, r, q)
    if delta == 0.0 or v == 0:
        return np.minimum(beta, 1.0)
    # P[v − i ≤ Binom(r, q) ≤ v − 1] for i = 1..v, as cumulative sums of the pmf from v − 1 down.
    j = np.arange(v - 1, -1, -1)
    pmf = stats.binom.pmf(j[None, :], r, q.reshape(-1, 1))
    mass = np.cumsum(pmf, axis=1) / np.arange(1, v + 1)[None, :]
    alpha = mass.max(axis=1).reshape(eps.shape)
    return np.minimum(beta + 2.0 * m * delta * alpha, 1.0)


def one_run_p_value(
    epsilon: float, *, num_guesses: int, num_correct: int, num_canaries: int, delta: float
) -> float:
    """p-value of ``num_correct`` right guesses out of ``num_guesses`` under (ε, δ)-DP.

    Steinke, Nasr & Jagielski (2023). Each of the ``m = num_canaries`` canaries is included
    by an independent fair coin; after seeing the output, the auditor guesses "in" for ``r``
    canaries and abstains on the rest; ``W`` counts its correct guesses. With
    ``q = e^ε/(1 + e^ε)`` and ``f(u) = P[Binom(r, q) ≥ u]``:

    * ε-DP (δ = 0): ``P[W ≥ v] ≤ f(v)``. Given the output, each guessed canary's coin is
      still "in" with probability at most ``q`` (ε-DP bounds the posterior odds of any one
      coin by ``e^ε``, even conditionally on the other coins), so ``W`` is dominated by
      ``Binom(r, q)``.
    * (ε, δ)-DP: ``P[W ≥ v] ≤ f(v) + 2mδ·max_{i=1..v} (f(v − i) − f(v))/i``, their
      approximate-DP version of the same domination.

    The returned p-value is that bound, capped at 1: if the mechanism is (ε, δ)-DP then
    ``P[p ≤ s] ≤ s`` for every ``s``. It holds for every guess set that is a function of the
    output alone (not of the coins), whatever the mechanism does with its other inputs.
    """
    eps = _real("epsilon", epsilon)
    if eps < 0:
        raise ValueError(f"epsilon must be >= 0, got {epsilon!r}")
    m = integer_at_least("num_canaries", num_canaries, 1)
    r = integer_at_least("num_guesses", num_guesses, 0)
    v = integer_at_least("num_correct", num_correct, 0)
    if r > m:
        raise ValueError(f"num_guesses must be <= num_canaries = {m}, got {r}")
    if v > r:
        raise ValueError(f"num_correct must be <= num_guesses = {r}, got {v}")
    return float(_one_run_p(np.asarray(eps), r, v, m, _delta(delta, allow_zero=True)))


def _one_run_epsilon_from_counts(r: int, v: int, m: int, delta: float, significance: float) -> float:
    """The smallest ε whose one-run p-value exceeds ``significance`` (0 if none below it does).

    Inverting a test into a confidence set: ``C = {ε : p(ε) > significance}`` contains the true ε
    with probability ≥ ``1 − significance``, so ``inf C`` is a valid lower bound (it exceeds the
    true ε only when the true ε was rejected). δ = 0: ``p(ε) = P[Binom(r, q) ≥ v]`` increases
    in q, and ``p = significance`` at ``q_L = Beta(v, r − v + 1)``'s ``significance`` quantile
    (the Clopper–Pearson lower bound), so ``ε = logit(q_L)`` in closed form. δ > 0: ``p_δ ≥ p_0``,
    so the first crossing lies in ``[0, ε₀]``; it is located on a grid of 64 cells (the
    δ-term need not be monotone in ε, so a root search alone could skip a crossing) and refined
    by Brent's method in its cell.
    """
    if v == 0 or r == 0:
        return 0.0
    q_lo = float(stats.beta.ppf(significance, v, r - v + 1))
    one_minus = float(stats.beta.isf(significance, r - v + 1, v))
    if not q_lo > 0.5:
        return 0.0
    eps0 = math.log(q_lo) - math.log(one_minus) if one_minus > 0 else math.inf
    if delta == 0.0:
        return eps0
    if not math.isfinite(eps0):  # q_L rounds to 1: bracket where β is already above significance
        eps0 = 40.0
        while _one_run_p(np.asarray(eps0), r, v, m, 0.0) <= significance:
            eps0 *= 2
    grid = np.linspace(0.0, eps0, 65)
    above = np.flatnonzero(_one_run_p(grid, r, v, m, delta) > significance)
    if above.size == 0:
        return float(eps0)
    first = int(above[0])
    if first == 0:
        return 0.0

    def excess(eps: float) -> float:
        return float(_one_run_p(np.asarray(eps), r, v, m, delta)) - significance

    return float(optimize.brentq(excess, grid[first - 1], grid[first], xtol=1e-10))


def default_guesses(num_canaries: int) -> tuple[int, ...]:
    """The guess counts :func:`one_run_epsilon` tries by default: the powers of two up to
    ``m/2`` and ``⌊m/2⌋`` itself (``m = num_canaries``), e.g. 1, 2, 4, …, 256, 500 for 1000.

    A function of ``m`` only, so it is fixed before the scores are seen. A geometric grid is
    within a factor of 2 of any guess count at a Bonferroni cost of ``log₂ m`` candidates;
    guessing more than half the canaries "in" cannot help when half of them are included.
    """
    m = integer_at_least("num_canaries", num_canaries, 1)
    ks = {1 << j for j in range(max(m // 2, 1).bit_length()) if (1 << j) <= max(m // 2, 1)}
    ks.add(max(m // 2, 1))
    return tuple(sorted(ks))


def _guess_set(sorted_scores: np.ndarray, k: int) -> tuple[int, float]:
    """The number of top-scored canaries guessed "in" for a target ``k``, and the cut.

    Guesses are a level set ``{score ≥ t}`` of the scores, so ties are never split by the
    canaries' order (which may carry the inclusions, e.g. members listed first). When the
    ``k``-th highest score is tied, the tie group is taken whole or dropped, whichever leaves
    the count closer to ``k`` (dropped on a draw): a rule on the scores alone.
    """
    m = sorted_scores.size
    t = sorted_scores[m - k]  # the k-th highest
    take = m - int(np.searchsorted(sorted_scores, t, side="left"))  # #{score ≥ t}
    drop = m - int(np.searchsorted(sorted_scores, t, side="right"))  # #{score > t}
    if take - k < k - drop:
        return take, float(t)
    return drop, (float(sorted_scores[m - drop]) if drop > 0 else math.inf)


def one_run_epsilon(
    scores: Any,
    included: Any,
    *,
    delta: float,
    confidence: float = 0.95,
    guesses: Sequence[int] | None = None,
) -> OneRunBound:
    """Lower confidence bound on ε from ONE run with m canaries (Steinke, Nasr & Jagielski 2023).

    The auditor guesses "in" for the ``k`` canaries with the highest scores and abstains on
    the rest (the one-sided version: no "out" guesses), counts the right guesses ``v`` of its
    ``r`` guesses and rejects every ε whose p-value (:func:`one_run_p_value`) is at most the
    significance; ``epsilon_lower`` is the smallest ε not rejected.

    Requirements, on which the validity rests:

    * each canary was included by an **independent fair coin** (probability ½), drawn
      independently of everything the auditor does not control;
    * the scores are computed from the mechanism's output (and public information) *without
      looking at the coins*. The guesses are then a level set ``{score ≥ t}``: when the k-th
      highest score is tied, its whole tie group is guessed or none of it, whichever leaves
      the count closer to k (none on a draw), so the canaries' order, which may carry the
      coins (members listed first), never breaks a tie;
    * ``guesses`` (the candidate ``k``) is fixed in advance. Several candidates are allowed:
      each is tested at ``significance/len(guesses)`` (Bonferroni), so the best of them is
      still a bound at ``confidence``. Default: :func:`default_guesses`.

    It then holds for any mechanism and any score distribution: with probability ≥
    ``confidence`` the mechanism is not (ε, δ)-DP for any ε < ``epsilon_lower`` with respect
    to adding or removing one canary. It is conservative: even with perfect guesses it
    cannot exceed ``logit((significance/len(guesses))^(1/r))`` and for δ > 0 it stays well
    below the true ε of, e.g., a Gaussian mechanism.

    Returns the candidate with the largest bound (on a draw the first).
    """
    s, inc = _scores_and_included(scores, included)
    d = _delta(delta, allow_zero=True)
    conf = _open_unit("confidence", confidence)
    m = s.size
    if guesses is None:
        ks = default_guesses(m)
    else:
        ks = tuple(guesses)
        if not ks:
            raise ValueError("guesses must not be empty")
        for k in ks:
            integer_at_least("guesses entry", k, 1)
            if k > m:
                raise ValueError(f"guesses entries must be <= the number of canaries {m}, got {k}")
        ks = tuple(sorted({int(k) for k in ks}))
    significance = (1.0 - conf) / len(ks)
    order = np.argsort(s, kind="stable")
    sorted_scores = s[order]
    correct_prefix = np.concatenate([[0], np.cumsum(inc[order][::-1])])  # v for the top r
    best: OneRunBound | None = None
    for k in ks:
        r, cut = _guess_set(sorted_scores, k)
        v = int(correct_prefix[r])
        eps = _one_run_epsilon_from_counts(r, v, m, d, significance)
        if best is None or eps > best.epsilon_lower:
            best = OneRunBound(eps, r, v, m, cut, conf, d)
    assert best is not None
    return best


# --------------------------------------------------------------------------- thresholds


@dataclasses.dataclass(frozen=True)
class ThresholdBound:
    """The threshold-test lower bound of :func:`threshold_epsilon`.

    Attributes:
      epsilon_lower: the best bound over the thresholds and both directions (≥ 0).
      threshold: the threshold ``t`` where it was reached (the best ratio when nothing is
        certified).
      direction: ``"add"`` (the test "included iff score > t": adding the canary is what is
        detected) or ``"remove"`` (its mirror, "excluded iff score ≤ t").
      fpr_upper, fnr_upper: the Clopper–Pearson upper bounds on ``P₀[score > t]`` and
        ``P₁[score ≤ t]`` at that threshold.
      confidence, delta: where the bound is stated.
    """

    epsilon_lower: float
    threshold: float
    direction: str
    fpr_upper: float
    fnr_upper: float
    confidence: float
    delta: float


def threshold_epsilon(
    scores: Any,
    included: Any,
    *,
    delta: float,
    confidence: float = 0.95,
    thresholds: Sequence[float] | None = None,
) -> ThresholdBound:
    """Assumption-free lower confidence bound on ε from many independent trials.

    Each trial runs the mechanism once, with the canary (``included``) or without, and
    scores the output; the trials must be independent draws (the canary's presence decided
    independently in each). For a threshold t let ``FPR = P₀[score > t]`` (canary absent)
    and ``FNR = P₁[score ≤ t]`` (present). (ε, δ)-DP applied to the event ``{score > t}``
    gives ``1 − FNR ≤ e^ε·FPR + δ`` ("add") and to its complement ``1 − FPR ≤ e^ε·FNR + δ``
    ("remove"), hence

        ε ≥ log((1 − δ − FNR_U)/FPR_U)     and     ε ≥ log((1 − δ − FPR_U)/FNR_U)

    whenever ``FPR ≤ FPR_U`` and ``FNR ≤ FNR_U``. These are one-sided Clopper–Pearson bounds
    from the counts of each world. For thresholds given in advance the significance is split
    evenly over ``4·len(thresholds)`` bounds (an FPR and an FNR bound per threshold and
    direction; Bonferroni), so all the bounds hold together with probability ≥
    ``confidence`` and the maximum over thresholds and directions is a valid bound.

    ``thresholds`` must not be chosen from these scores, with one exception, the default:
    every distinct score, with the significance split over ``4·(n₀ + n₁)`` bounds (one
    threshold per score, ties included). These thresholds come from the data, yet the bounds
    hold together at *every* real threshold. Between two consecutive world-0 scores the count
    ``#{y₀ > t}`` is constant while ``P₀[score > t]`` is largest at the lower score, so every FPR
    bound holds once it holds at the world-0 scores; at the j-th largest of them
    ``P₀[score > t]`` is the j-th smallest of ``n₀`` uniforms, ``Beta(j, n₀ − j + 1)``, whose
    ``1 − α`` quantile is exactly the Clopper–Pearson bound for the count ``j − 1``: each of
    these ``n₀`` bounds fails with probability α (for continuous scores; ties are reduced to
    that case by breaking them with an independent uniform draw, which changes no count).
    Likewise the FNR bounds, checked just below each of the ``n₁`` world-1 scores. So all of
    them hold with probability ≥ ``1 − (n₀ + n₁)·α``.

    It needs many trials to certify a large ε: with ``n₀`` trials without the canary the FPR
    bound is at least about ``log(1/α)/n₀``, so ε is capped near ``log(n₀/log(1/α))``.
    """
    s, inc = _scores_and_included(scores, included)
    d = _delta(delta, allow_zero=True)
    conf = _open_unit("confidence", confidence)
    n0, n1 = _both_worlds(inc, 1)
    if thresholds is None:
        ts = np.unique(s)
        num_bounds = 4 * s.size
    else:
        ts = np.asarray(thresholds, dtype=np.float64)
        if ts.ndim != 1 or ts.size == 0:
            raise ValueError(f"thresholds must be a non-empty 1-d sequence, got shape {ts.shape}")
        if np.any(np.isnan(ts)):
            raise ValueError("thresholds must not contain NaN")
        num_bounds = 4 * ts.size
    alpha = (1.0 - conf) / num_bounds
    y0, y1 = np.sort(s[~inc]), np.sort(s[inc])
    fp = n0 - np.searchsorted(y0, ts, side="right")  # world 0 above t
    fn = np.searchsorted(y1, ts, side="right")  # world 1 at or below t
    fpr_u = _cp_upper(fp, n0, alpha)
    fnr_u = _cp_upper(fn, n1, alpha)
    ratios = np.stack([(1.0 - d - fnr_u) / fpr_u, (1.0 - d - fpr_u) / fnr_u])  # add, remove
    direction, index = np.unravel_index(int(np.argmax(ratios)), ratios.shape)
    best = float(ratios[direction, index])
    return ThresholdBound(
        epsilon_lower=max(0.0, math.log(best)) if best > 0 else 0.0,
        threshold=float(ts[index]),
        direction=("add", "remove")[int(direction)],
        fpr_upper=float(fpr_u[index]),
        fnr_upper=float(fnr_u[index]),
        confidence=conf,
        delta=d,
    )


# --------------------------------------------------------------------------- Gaussian-DP fit


@dataclasses.dataclass(frozen=True)
class GdpFit:
    """The Gaussian-DP fit of :func:`gdp_fit`.

    Attributes:
      mu: the point estimate ``μ̂ = (mean₁ − mean₀)/s₀``.
      se: its delta-method standard error.
      mu_lower, mu_upper: ``μ̂ ∓ z·se`` with ``z = Φ⁻¹(confidence)``: each a one-sided bound at
        ``confidence``, together a two-sided interval at ``2·confidence − 1``.
      epsilon, epsilon_lower, epsilon_upper: ε at ``delta`` of μ-GDP at ``mu``, ``mu_lower`` and
        ``mu_upper`` (:func:`gdp_epsilon`; 0 for a μ ≤ 0).
      sd0, sd1: sample standard deviations of the scores without and with the canary.
      n0, n1: the number of scores without and with the canary.
      confidence, delta: where the bounds are stated.
    """

    mu: float
    se: float
    mu_lower: float
    mu_upper: float
    epsilon: float
    epsilon_lower: float
    epsilon_upper: float
    sd0: float
    sd1: float
    n0: int
    n1: int
    confidence: float
    delta: float


def gdp_fit(scores: Any, included: Any, *, delta: float, confidence: float = 0.95) -> GdpFit:
    """Fit μ-GDP to the scores and convert it to ε at ``delta``, with a confidence interval.

    Model: the scores are ``N(m₀, σ₀²)`` without the canary and shifted by the canary's
    contribution with it; the mechanism's μ is the shift in units of the noise. Estimate

        μ̂ = (ȳ₁ − ȳ₀)/s₀,   se² = s₁²/(n₁ s₀²) + 1/n₀ + μ̂²/(2(n₀ − 1)),

    the delta-method variance of the difference of the means divided by ``s₀``, plus the
    uncertainty of ``log s₀`` (variance ≈ ``1/(2(n₀ − 1))`` for Gaussian data). Then
    ``μ_L = μ̂ − z·se`` and ``μ_U = μ̂ + z·se`` with ``z = Φ⁻¹(confidence)`` (large-sample normal
    approximation), and ε at each through :func:`gdp_epsilon`. ``epsilon_lower`` is the
    empirical lower bound; ``[epsilon_lower, epsilon_upper]`` an interval at level
    ``2·confidence − 1``.

    Why ``s₀``, the spread of the scores *without* the canary, and not a pooled deviation:
    world 0 holds the noise alone, whatever the mechanism does with the canary, so ``s₀``
    measures exactly the unit of μ. A canary whose contribution varies from trial to trial
    (e.g. under-clipped by a varying amount) makes world 1 *wider*: a mixture of
    ``N(Δ_k, σ₀²)``. The optimal test of GDP at ε is the half-line ``{score > t*}``,
    ``t* = σ₀(ε/μ + μ/2)``; where every ``Δ_k ≤ t*`` its probability under world 1 is convex
    in Δ, so by Jensen the mixture's δ(ε) is at least that of GDP with ``μ = mean Δ/σ₀``: the
    fit still bounds ε from below. A pooled deviation would count that extra width as noise
    and shrink μ̂.

    Assumptions: Gaussian scores in world 0, independent trials (or canaries), and enough of
    them for the normal approximation of μ̂. It is an estimate with an approximate interval,
    not an assumption-free certificate (use :func:`one_run_epsilon` or
    :func:`threshold_epsilon` for that); on Gaussian scores it is far more powerful. Scores are
    oriented so that the canary raises them: a negative shift gives ε = 0.

    A non-finite score (a NaN or infinite release) counts as a perfect distinguisher
    (``μ = inf``); zero spread in world 0 gives ``μ = inf`` if the means differ upwards, else 0.
    """
    s, inc = _scores_and_included(scores, included)
    d = _delta(delta, allow_zero=False)
    conf = _open_unit("confidence", confidence)
    n0, n1 = _both_worlds(inc, 2)
    y1, y0 = s[inc], s[~inc]

    def fit(mu: float, se: float, lo: float, hi: float, sd0: float, sd1: float) -> GdpFit:
        return GdpFit(
            mu=mu,
            se=se,
            mu_lower=lo,
            mu_upper=hi,
            epsilon=gdp_epsilon(mu, d),
            epsilon_lower=gdp_epsilon(lo, d),
            epsilon_upper=gdp_epsilon(hi, d),
            sd0=sd0,
            sd1=sd1,
            n0=n0,
            n1=n1,
            confidence=conf,
            delta=d,
        )

    if not np.all(np.isfinite(s)):
        return fit(math.inf, 0.0, math.inf, math.inf, math.nan, math.nan)
    v0, v1 = float(np.var(y0, ddof=1)), float(np.var(y1, ddof=1))
    diff = float(np.mean(y1) - np.mean(y0))
    if v0 == 0.0:
        mu = math.inf if diff > 0 else 0.0
        return fit(mu, 0.0, mu, mu, 0.0, math.sqrt(v1))
    mu = diff / math.sqrt(v0)
    se = math.sqrt(v1 / (n1 * v0) + 1.0 / n0 + mu * mu / (2.0 * (n0 - 1)))
    z = float(special.ndtri(conf))
    return fit(mu, se, mu - z * se, mu + z * se, math.sqrt(v0), math.sqrt(v1))


# --------------------------------------------------------------------------- accountant


@functools.lru_cache(maxsize=256)
def _accountant_epsilon(noise_multiplier: float, steps: int, sample_rate: float, delta: float) -> float:
    acc = Accountant("pld")
    acc.step(noise_multiplier=noise_multiplier, sample_rate=sample_rate, num_steps=steps)
    return float(acc.epsilon(delta))


def accountant_epsilon(
    noise_multiplier: float, *, steps: int = 1, sample_rate: float = 1.0, delta: float
) -> float:
    """ε at ``delta`` that ``adaclip.accounting.Accountant("pld")`` reports for ``steps`` steps
    of the sampled Gaussian mechanism ``(sample_rate, noise_multiplier)``: the yardstick an
    empirical ε is compared with. Cached (one PLD costs up to about half a second).

    For one full-batch step (``steps = 1``, ``sample_rate = 1``) this is the Gaussian
    mechanism, i.e. :func:`gdp_epsilon` at ``μ = 1/noise_multiplier`` up to the PLD's
    pessimistic discretisation.
    """
    sigma = _real("noise_multiplier", noise_multiplier)
    if not (math.isfinite(sigma) and sigma >= 0):
        raise ValueError(f"noise_multiplier must be finite and >= 0, got {noise_multiplier!r}")
    n = integer_at_least("steps", steps, 1)
    q = _real("sample_rate", sample_rate)
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"sample_rate must be in [0, 1], got {sample_rate!r}")
    return _accountant_epsilon(sigma, n, q, _delta(delta, allow_zero=False))
