"""One audit, one line: the empirical ε of a set of canary scores next to the accountant's ε.

:func:`audit_scores` runs the two estimators a user needs on the scores of one training run:

* the **one-run lower bound** (:func:`adaclip.audit.estimators.one_run_epsilon`, Steinke, Nasr &
  Jagielski 2023): valid whatever the scores' distribution, as long as each canary was included
  by an independent fair coin. With probability at least ``confidence`` the mechanism is not
  ``(ε, δ)``-DP for any ``ε`` below it. This is ``ε_emp``: it must stay at or below the
  accountant's ε; a bound above it means the implementation leaks more than it accounts.
* the **Gaussian-DP fit** (:func:`adaclip.audit.estimators.gdp_fit`): a parametric estimate, the
  shift between the included and excluded canaries' scores in units of the excluded ones'
  spread, read as μ-GDP and converted to ε at δ, with its interval. It is far more sensitive (it
  sees a mechanism with half the claimed noise at a few hundred canaries), but it *assumes*
  Gaussian scores with a common spread, which holds for the white-box canaries of a full-batch
  run and only approximately otherwise (Poisson sampling makes an included canary's shift a
  binomial count). Read it as an estimate, not a certificate.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from adaclip.audit.estimators import GdpFit, OneRunBound, gdp_fit, one_run_epsilon

__all__ = ["AuditReport", "audit_scores"]


@dataclasses.dataclass(frozen=True)
class AuditReport:
    """The empirical privacy of one run, next to what the accountant claims.

    Attributes:
      epsilon_lower: ``ε_emp``, the one-run lower bound at ``delta`` and ``confidence``.
      one_run: the one-run bound's details (guesses, correct guesses).
      gdp: the Gaussian-DP fit (``None`` when not asked for); its ``epsilon`` is the point
        estimate and ``[epsilon_lower, epsilon_upper]`` a two-sided interval at level
        ``2·confidence − 1``.
      accountant_epsilon: the ε the accountant reports at the same δ (``None`` if not given).
      delta, confidence: where the bounds are stated.
      num_canaries, num_included: ``m`` and how many of them were in the run.
    """

    epsilon_lower: float
    one_run: OneRunBound
    gdp: GdpFit | None
    accountant_epsilon: float | None
    delta: float
    confidence: float
    num_canaries: int
    num_included: int

    @property
    def exceeds_accountant(self) -> bool:
        """Whether the certified ``ε_emp`` is above the accountant's ε: evidence of a leak
        (or, at the stated confidence, a rare false alarm)."""
        return self.accountant_epsilon is not None and self.epsilon_lower > self.accountant_epsilon

    def __str__(self) -> str:
        level = f"{100 * self.confidence:g} %"
        parts = [
            f"ε_emp ≥ {self.epsilon_lower:.3f} (one-run, {level}, δ={self.delta:g}, m={self.num_canaries})"
        ]
        if self.gdp is not None:
            g = self.gdp
            two_sided = f"{100 * (2 * self.confidence - 1):g} %"
            parts.append(
                f"GDP fit ε ≈ {_fmt(g.epsilon)} [{_fmt(g.epsilon_lower)}, {_fmt(g.epsilon_upper)}] ({two_sided})"
            )
        if self.accountant_epsilon is not None:
            parts.append(f"accountant ε = {self.accountant_epsilon:.3f}")
        return "; ".join(parts)


def _fmt(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:.3f}"


def audit_scores(
    scores: np.ndarray,
    included: np.ndarray,
    *,
    delta: float,
    confidence: float = 0.95,
    accountant_epsilon: float | None = None,
    gdp: bool = True,
) -> AuditReport:
    """Audit one run's canary scores (higher score = more likely included).

    ``scores``/``included``: one entry per canary (``included`` drawn by independent fair
    coins before training). ``accountant_epsilon``: the ε to compare with, at the same
    ``delta``. ``gdp``: also fit the Gaussian-DP estimate (needs at least 2 canaries on each
    side). Raises ``ValueError`` for mismatched or empty inputs.
    """
    scores = np.asarray(scores, dtype=np.float64)
    included = np.asarray(included)
    if scores.ndim != 1 or included.shape != scores.shape:
        raise ValueError(
            f"scores and included must be 1-d of the same length, got shapes {scores.shape} and {included.shape}"
        )
    if included.dtype != bool:
        raise ValueError(f"included must be a boolean array, got dtype {included.dtype}")
    if accountant_epsilon is not None and not (accountant_epsilon >= 0):
        raise ValueError(f"accountant_epsilon must be ≥ 0, got {accountant_epsilon!r}")
    one_run = one_run_epsilon(scores, included, delta=delta, confidence=confidence)
    fit = gdp_fit(scores, included, delta=delta, confidence=confidence) if gdp else None
    return AuditReport(
        epsilon_lower=float(one_run.epsilon_lower),
        one_run=one_run,
        gdp=fit,
        accountant_epsilon=None if accountant_epsilon is None else float(accountant_epsilon),
        delta=float(delta),
        confidence=float(confidence),
        num_canaries=int(scores.size),
        num_included=int(included.sum()),
    )
