"""A Pareto-tail estimate of ε from generated sequences.

Setting. Two models A and B are trained on neighbouring sets of users (B without one user,
say). Sequences ``s`` are sampled from A, and both models score them: the *privacy loss*
of a sequence is

    L(s) = log P_A(s) − log P_B(s),     X = e^L = P_A(s)/P_B(s).

For the pair (A, B), in this direction, the (ε, δ) condition ``P_A[S] ≤ e^ε·P_B[S] + δ`` holds
for every event S with ``δ(ε) = E_A[(1 − e^{ε − L})₊]``, and ``δ(ε) ≤ P_A[L > ε]``: so the
tail of the privacy loss, ``P[X > e^ε] ≤ δ``, is enough. The tail matters far out (δ of 1e-5
and below), where a sample of n sequences holds few or no points; the estimate extrapolates
it with a Pareto model.

Model. Above a high threshold ``u``, ``P[X > x] ≈ P[X > u]·(x/u)^{−α}`` (a Pareto tail with
index α; a heavier tail has a smaller α). With the order statistics ``X_(1) ≥ X_(2) ≥ … ≥
X_(n)`` of the sample and ``u = X_(k+1)``:

* the Hill (1975) estimator of the index from the k largest points,
  ``α̂ = k / Σ_{i=1..k} log(X_(i)/X_(k+1))`` (:func:`hill_estimator`), the maximum-likelihood
  estimate when the log-excesses are exponential; its standard error is about ``α/√k``;
* the log-excesses ``Y_i = log(X_(i)/X_(k+1))``, i = 1..k, are then i.i.d. exponential with
  rate α (given ``X_(k+1)``, the points above it are an i.i.d. sample of the tail above it, and
  the log of a Pareto variable over its scale is exponential). Testing that they are
  exponential tests the Pareto hypothesis (the transform of Koning & Peng, 2008), with the
  Lilliefors (1969) test for an exponential of unknown mean
  (:func:`lilliefors_exponential`);
* the tail estimate ``δ(ε) = (k/n)·(e^ε/X_(k+1))^{−α̂}`` for ``e^ε ≥ X_(k+1)``, and its
  inverse ``ε(δ) = log X_(k+1) + log(k/(nδ))/α̂`` for ``δ ≤ k/n``
  (:func:`pareto_tail_epsilon`).

Everything is computed on the log scale (``log X = L``): log-likelihood ratios of long
sequences are far outside the range of ``exp``.

Light tails. A privacy loss with a lighter-than-exponential tail (``X`` lognormal, i.e. ``L``
Gaussian, as for the Gaussian mechanism) is in no Pareto family, yet its excesses over a high
threshold are close to exponential, so the Lilliefors test rarely rejects it at a moderate k.
The fitted exponential tail of L then decays too slowly far out, and ε at a small δ tends to
be over-estimated (by about 5–10 % at δ = 1e-5 with n = 10 000 and k = 100), which errs on the
cautious side. A bounded privacy loss (e.g. uniform) is rejected.

What it is and is not: an *estimate* of the privacy loss of ONE pair of neighbouring data sets
in one direction, resting on the tail model (which the Lilliefors test can reject, but never
confirm). It is not a confidence bound, and a DP guarantee is a statement about every pair:
compare it with the accountant's ε as a plausibility check of how much of the budget this
pair uses.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import numpy as np

from adaclip.options import integer_at_least

__all__ = [
    "hill_estimator",
    "LillieforsResult",
    "lilliefors_exponential",
    "ParetoTailEstimate",
    "pareto_tail_epsilon",
    "sequence_log_ratios",
]

_CHUNK = 1 << 21  # simulated values per block of the Monte Carlo null (16 MiB of float64)




def _open_unit(name: str, value: Any) -> float:
    if isinstance(value, (bool, str, bytes)) or value is None:
        raise ValueError(f"{name} must be a real number in (0, 1), got {value!r}")
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a real number in (0, 1), got {value!r}") from None
    if not 0.0 < x < 1.0:
        raise ValueError(f"{name} must be in (0, 1), got {value!r}")
    return x


def _vector(name: str, values: Any) -> np.ndarray:
    x = np.asarray(values, dtype=np.float64)
    if x.ndim != 1:
        raise ValueError(f"{name} must be 1-d, got shape {x.shape}")
    if np.any(np.isnan(x)):
        raise ValueError(f"{name} must not contain NaN")
    return x


# --------------------------------------------------------------------------- Hill


def _hill_from_logs(descending_logs: np.ndarray, k: int) -> float:
    """``k / Σ_{i≤k} (ℓ_(i) − ℓ_(k+1))`` from log-values sorted in decreasing order."""
    excess = float(np.sum(descending_logs[:k] - descending_logs[k]))
    return math.inf if excess == 0.0 else k / excess


def hill_estimator(samples: Any, *, k: int) -> float:
    """Hill (1975) estimate of the tail index α from the ``k`` largest of positive samples.

    ``α̂ = k / Σ_{i=1..k} log(X_(i)/X_(k+1))`` with ``X_(1) ≥ … ≥ X_(n)``. If the tail above
    ``X_(k+1)`` is exactly Pareto with index α, the k log-excesses are i.i.d. exponential with
    rate α, their sum is Gamma(k, α), and α̂ is the maximum-likelihood estimate, with
    ``E[α̂] = α·k/(k − 1)`` and standard error ≈ ``α/√k``. A larger k lowers the variance but
    brings in more of the distribution's body, where the Pareto model may not hold.

    Only the ``k + 1`` largest samples are used; they must be finite and ``X_(k+1) > 0``.
    Returns ``inf`` when they are all equal (no spread: a tail lighter than any Pareto).
    """
    x = _vector("samples", samples)
    n = x.size
    k = integer_at_least("k", k, 1)
    if k >= n:
        raise ValueError(f"k must be < the number of samples {n}, got {k}")
    top = -np.sort(-x)[: k + 1]
    if not np.all(np.isfinite(top)):
        raise ValueError("samples: the k + 1 largest must be finite")
    if not top[k] > 0:
        raise ValueError(f"samples: the (k+1)-th largest must be > 0, got {top[k]!r}")
    return _hill_from_logs(np.log(top), k)


# --------------------------------------------------------------------------- Lilliefors


@dataclasses.dataclass(frozen=True)
class LillieforsResult:
    """The Lilliefors test of :func:`lilliefors_exponential`.

    Attributes:
      statistic: ``D = sup_y |F_n(y) − (1 − e^{−y/ȳ})|``.
      p_value: the Monte Carlo p-value ``(1 + #{D_sim ≥ D})/(N + 1)``.
      critical_value: rejected iff ``statistic > critical_value`` (same as ``p_value ≤
        significance``); ``inf`` when N is too small to ever reject at this significance.
      significance: the level of the test.
      rejected: whether exponentiality is rejected at ``significance``.
    """

    statistic: float
    p_value: float
    critical_value: float
    significance: float
    rejected: bool


def _ks_exponential(rows: np.ndarray) -> np.ndarray:
    """Kolmogorov–Smirnov distance of each row's empirical cdf to the exponential with the
    row's own mean: ``max_i max(i/n − F(y_(i)), F(y_(i)) − (i − 1)/n)``."""
    y = np.sort(rows, axis=-1)
    n = y.shape[-1]
    f = -np.expm1(-y / y.mean(axis=-1, keepdims=True))
    i = np.arange(1, n + 1)
    return np.maximum((i / n - f).max(axis=-1), (f - (i - 1) / n).max(axis=-1))


@functools.lru_cache(maxsize=16)
def _lilliefors_null(n: int, num_simulations: int, seed: int) -> np.ndarray:
    """Sorted statistics of ``num_simulations`` standard-exponential samples of size n
    (read-only; cached, as the null only depends on n)."""
    rng = np.random.default_rng(seed)
    rows = max(1, _CHUNK // n)
    out = np.concatenate(
        [
            _ks_exponential(rng.standard_exponential((min(rows, num_simulations - start), n)))
            for start in range(0, num_simulations, rows)
        ]
    )
    out.sort()
    out.setflags(write=False)
    return out


def lilliefors_exponential(
    samples: Any, *, significance: float = 0.05, num_simulations: int = 10_000, seed: int = 0
) -> LillieforsResult:
    """Lilliefors (1969) test that ``samples`` are i.i.d. exponential with an unknown mean.

    The Kolmogorov–Smirnov distance ``D`` between the empirical cdf and the exponential cdf
    with the sample mean as its mean. Fitting the mean makes D smaller than for a known
    distribution, so the usual KS tables do not apply; but D does not depend on the true
    mean (rescaling the sample rescales its mean alike), so its null distribution is that
    of standard exponential samples of the same size, simulated here: ``num_simulations``
    draws from a generator seeded with ``seed`` (the result is deterministic; the simulation
    for a given size is cached). The p-value ``(1 + #{D_sim ≥ D})/(N + 1)`` gives an exact
    level-``significance`` test for any N (the observed D ranks uniformly among the
    simulated ones under the null); as an estimate of the exact p-value it has Monte Carlo
    standard error ``√(p(1 − p)/N)``, at most 0.005 for the default ``N = 10 000`` (0.0022
    at p = 0.05).

    ``samples``: at least 3 finite values ≥ 0, not all 0.
    """
    y = _vector("samples", samples)
    if y.size < 3:
        raise ValueError(f"samples must hold at least 3 values, got {y.size}")
    if not np.all(np.isfinite(y)) or np.any(y < 0):
        raise ValueError("samples must be finite and >= 0")
    if not y.sum() > 0:
        raise ValueError("samples must not all be 0")
    sig = _open_unit("significance", significance)
    num = integer_at_least("num_simulations", num_simulations, 1)
    seed = integer_at_least("seed", seed, 0)
    stat = float(_ks_exponential(y))
    null = _lilliefors_null(y.size, num, seed)
    exceed = num - int(np.searchsorted(null, stat, side="left"))  # #{D_sim ≥ D}
    p = (1 + exceed) / (num + 1)
    allowed = math.floor(sig * (num + 1)) - 1  # reject iff #{D_sim ≥ D} ≤ allowed, i.e. p ≤ sig
    while (allowed + 2) / (num + 1) <= sig:  # exact in the same arithmetic as p ≤ sig
        allowed += 1
    while allowed >= 0 and (allowed + 1) / (num + 1) > sig:
        allowed -= 1
    critical = float(null[num - allowed - 1]) if allowed >= 0 else math.inf
    return LillieforsResult(
        statistic=stat, p_value=p, critical_value=critical, significance=sig, rejected=p <= sig
    )


# --------------------------------------------------------------------------- the tail estimate


@dataclasses.dataclass(frozen=True)
class ParetoTailEstimate:
    """The Pareto-tail estimate of :func:`pareto_tail_epsilon`.

    Attributes:
      alpha: the Hill estimate α̂ of the tail index of ``X = P_A(s)/P_B(s)``.
      log_threshold: ``log X_(k+1)``, where the tail model starts (see :attr:`threshold`).
      k: the number of points in the tail; ``n`` the sample size.
      lilliefors: the test of the Pareto hypothesis on the k log-excesses; if it rejects, the
        tail is not Pareto-like at this k and the extrapolation is not to be trusted.
      epsilon: ``epsilon_at(delta)``.
      delta: the δ of ``epsilon``.
    """

    alpha: float
    log_threshold: float
    k: int
    n: int
    lilliefors: LillieforsResult
    epsilon: float
    delta: float

    @property
    def threshold(self) -> float:
        """``X_(k+1) = exp(log_threshold)`` (``inf`` if it overflows)."""
        return math.exp(self.log_threshold) if self.log_threshold < 709.0 else math.inf

    @property
    def alpha_se(self) -> float:
        """Approximate standard error of α̂, ``α̂/√k``."""
        return self.alpha / math.sqrt(self.k)

    def epsilon_at(self, delta: float) -> float:
        """Estimated ε at ``delta``: ``log X_(k+1) + log(k/(n·delta))/α̂``, clipped at 0.

        For ``delta > k/n`` the tail model does not reach (it starts at the (k/n)-quantile);
        then ``log X_(k+1)`` (clipped at 0) is returned: a sample fraction ``k/n < delta``
        exceeds it, so it over-estimates ε(delta) rather than under-estimating it.
        """
        d = _open_unit("delta", delta)
        tail = self.k / self.n
        if d >= tail:
            return max(0.0, self.log_threshold)
        return max(0.0, self.log_threshold + math.log(tail / d) / self.alpha)

    def delta_at(self, epsilon: float) -> float:
        """Estimated tail ``P[X > e^ε] = (k/n)·exp(−α̂(ε − log X_(k+1)))`` for
        ``ε ≥ log X_(k+1)``, the δ at which the pair meets the (ε, δ) condition.

        Below the threshold the model does not apply and ``k/n`` is returned, a lower
        estimate there (at least that fraction of the sample exceeds such an ε).
        """
        if isinstance(epsilon, (bool, str, bytes)) or epsilon is None:
            raise ValueError(f"epsilon must be a real number >= 0, got {epsilon!r}")
        eps = float(epsilon)
        if not eps >= 0:
            raise ValueError(f"epsilon must be >= 0, got {epsilon!r}")
        tail = self.k / self.n
        if eps <= self.log_threshold:
            return tail
        return tail * math.exp(-self.alpha * (eps - self.log_threshold))


def pareto_tail_epsilon(
    log_ratios: Any,
    *,
    delta: float,
    k: int | None = None,
    significance: float = 0.05,
    seed: int = 0,
    num_simulations: int = 10_000,
) -> ParetoTailEstimate:
    """Estimate ε at ``delta`` from the privacy losses of sequences sampled from model A.

    ``log_ratios``: ``log P_A(s) − log P_B(s)`` for n sequences ``s ~ A`` (see
    :func:`sequence_log_ratios`). The k largest define the tail: Hill's α̂ from their
    log-excesses over the (k+1)-th largest, the Lilliefors test (at ``significance``, with
    ``num_simulations`` Monte Carlo draws from ``seed``) of their exponentiality, and
    ``ε(δ) = log X_(k+1) + log(k/(nδ))/α̂`` (see :class:`ParetoTailEstimate`).

    ``k``: default ``⌈√n⌉``, a common rule of thumb: the Hill estimator is consistent when
    ``k → ∞`` and ``k/n → 0``, and √n balances the variance (``α²/k``) against the bias from
    points below the region where the tail is Pareto. Must satisfy ``3 ≤ k < n``.

    The k + 1 largest log ratios must be finite (``X_(k+1) > 0``): a ``+inf`` (a sequence
    that B cannot produce) is an unbounded privacy loss that no tail model describes, and a
    ``−inf`` among them leaves no tail to model; both are refused.
    """
    x = _vector("log_ratios", log_ratios)
    n = x.size
    if n < 4:
        raise ValueError(f"log_ratios must hold at least 4 values, got {n}")
    k = math.ceil(math.sqrt(n)) if k is None else integer_at_least("k", k, 3)
    if k >= n:
        raise ValueError(f"k must be < the number of log_ratios {n}, got {k}")
    d = _open_unit("delta", delta)
    top = -np.sort(-x)[: k + 1]
    if np.any(top == np.inf):
        raise ValueError(
            f"log_ratios contains +inf ({int(np.sum(x == np.inf))} sequences that model B cannot "
            "produce): the privacy loss is unbounded there and δ is at least their fraction"
        )
    if not np.all(np.isfinite(top)):
        raise ValueError("log_ratios: the k + 1 largest must be finite (the tail starts at -inf)")
    alpha = _hill_from_logs(top, k)
    if math.isinf(alpha):
        raise ValueError(
            f"log_ratios: the {k} largest all equal the (k+1)-th ({top[k]!r}): no tail to fit; use a larger k"
        )
    test = lilliefors_exponential(
        top[:k] - top[k], significance=significance, num_simulations=num_simulations, seed=seed
    )
    estimate = ParetoTailEstimate(
        alpha=alpha, log_threshold=float(top[k]), k=k, n=n, lilliefors=test, epsilon=math.nan, delta=d
    )
    return dataclasses.replace(estimate, epsilon=estimate.epsilon_at(d))


def sequence_log_ratios(log_prob_a: Any, log_prob_b: Any) -> np.ndarray:
    """``log P_A(s) − log P_B(s)`` per sequence, the input of :func:`pareto_tail_epsilon`.

    ``log_prob_a``, ``log_prob_b``: the two models' log-probabilities (sums of the token
    log-probabilities) of the same sequences, sampled from A, in the same order: 1-d, the
    same length, finite.
    """
    a = np.asarray(log_prob_a, dtype=np.float64)
    b = np.asarray(log_prob_b, dtype=np.float64)
    if a.ndim != 1 or b.ndim != 1:
        raise ValueError(f"log_prob_a and log_prob_b must be 1-d, got shapes {a.shape} and {b.shape}")
    if a.shape != b.shape:
        raise ValueError(f"log_prob_a and log_prob_b must have the same length, got {a.size} and {b.size}")
    for name, v in (("log_prob_a", a), ("log_prob_b", b)):
        if not np.all(np.isfinite(v)):
            raise ValueError(f"{name} must be finite")
    return a - b
