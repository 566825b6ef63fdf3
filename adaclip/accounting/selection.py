"""Choosing a configuration privately: a random number of trials, and only the best released.

The problem
-----------
A practitioner compares ``C`` candidate configurations (averaging on or off, flat or quantile
clipping, AdaCliP or not, ...) and keeps the best. Every candidate is trained on the private
data, so the choice depends on the private data even when each run is differentially private:
releasing the best of ``k`` runs costs, in general, what ``k`` runs cost. Papernot and Steinke
(*Hyperparameter tuning with Renyi differential privacy*, ICLR 2022, arXiv:2110.03620) show
that this cost is much smaller, and grows only logarithmically with the expected number of
trials, when the number of trials is itself **random**, drawn from a suitable distribution, and
only the best trial is released.

The procedure (:func:`select_privately`)
----------------------------------------
Let ``Q`` be one *trial*: draw a candidate uniformly at random, train it with the DP mechanism
(``T`` steps of the Poisson-subsampled Gaussian with noise multiplier ``σ`` at sample rate
``q``, or banded noise with ``b`` bands: ``⌈T/b⌉`` compositions at rate ``b·q``, exactly as
:mod:`adaclip.accounting` records a run) and score the trained model. ``A`` draws
``K ~ D`` (below), runs ``Q`` ``K`` times independently on the same data, and outputs the
trial with the highest score, i.e. its ``(candidate, score, result)``; nothing else.

The theorems (Rényi DP of order ``λ > 1``; ``ε(λ)`` is one trial's RDP curve)
-----------------------------------------------------------------------------
- **Poisson** (``shape = ∞``, Theorem 6 of the paper): ``K ~ Poisson(μ)``. If ``Q`` is
  ``(λ, ε(λ))``-RDP and ``(ε̂, δ̂)``-DP with ``e^ε̂ ≤ 1 + 1/(λ − 1)``, then ``A`` is
  ``(λ, ε'(λ))``-RDP with

  .. math:: ε'(λ) = ε(λ) + μ·δ̂ + \\log(μ)/(λ − 1).

  dp-accounting takes ``ε̂ = log(1 + 1/(λ − 1))`` and ``δ̂`` the δ of one trial's RDP curve at
  ``ε̂`` (the improved RDP → DP conversion). ``K = 0`` has probability ``e^{−μ}``; then ``A``
  outputs nothing (a data-independent output, which the theorem allows).
- **Truncated negative binomial** (``0 ≤ shape = η < ∞``, Theorem 2): ``P(K = k) ∝
  (1 − γ)^k · Γ(k + η) / (Γ(η)·k!)`` for ``k ≥ 1`` (``η = 1``: geometric,
  ``P(K = k) = γ(1 − γ)^{k−1}``, mean ``1/γ``; ``η → 0``: logarithmic,
  ``P(K = k) ∝ (1 − γ)^k / k``), with ``γ ∈ (0, 1]`` set by the mean ``μ = E[K]``. If ``Q`` is
  ``(λ, ε(λ))``-RDP and ``(λ̂, ε(λ̂))``-RDP, then ``A`` is ``(λ, ε'(λ))``-RDP with

  .. math:: ε'(λ) = ε(λ) + (1 + η)\\,\\bigl((1 − 1/λ̂)\\,ε(λ̂) + \\log(1/γ)/λ̂\\bigr) + \\log(μ)/(λ − 1),

  minimised over ``λ̂`` (dp-accounting then uses that RDP is non-decreasing in ``λ``).

``ε'(λ)`` converts to ``(ε, δ)`` as any RDP curve does. dp-accounting 0.6.0 implements both in
its RDP accountant (``dp_accounting.dp_event.RepeatAndSelectDpEvent(event, mean, shape)``, with
``shape = inf`` for Poisson; the class is not exported at the package's top level); its PLD
accountant does not support the event. **So the selection is always accounted with RDP**, even
though a single run is accounted with PLD by default: ``ε_run`` in these bounds is RDP's.

What the theorems assume, and what the guarantee covers
--------------------------------------------------------
1. **One trial is one DP mechanism with one RDP curve.** Picking the candidate uniformly is
   part of ``Q``; a mixture of mechanisms is at least as private as the least private of them
   (Rényi divergence is jointly quasi-convex), so every candidate's run must be accounted as at
   most the run described by ``(σ, q, T, b)``: **all candidates share the per-run privacy
   parameters** (same σ, sample rate, steps and bands, or more noise / fewer steps). Candidates
   may differ in anything that does not enter the accounting (clipping rule, averaging,
   learning rate, AdaCliP options, model).
2. **The score is part of the trial's output.** With the score computed from the trained model
   (the DP output) and data that are *not* private (a public validation split), it is
   post-processing and costs nothing more. If the validation split is private (its examples are
   units to protect), the score must be a DP release itself: e.g. the number of correct
   validation predictions plus ``N(0, s²)`` noise (sensitivity 1 under add-or-remove), passed as
   ``score_noise_multiplier=s``; the trial is then accounted as the run composed with that
   Gaussian mechanism (an upper bound: with a fixed split each unit is in one of the two
   parts). A score computed without noise on private validation data is *not* covered: the
   ε then protects the training units only.
3. **The number of trials is random and drawn by the library**, from the stated distribution,
   with a generator the user does not steer by results: not chosen, stopped early or rerun
   after looking at scores. A selection that is repeated (for instance because the first one
   ran no trial, or its pick was disappointing) is a second selection and its ε composes.
4. **Only the best trial is released**: its candidate, score and result. Releasing all scores
   (logs, dashboards, printed per-trial accuracies), the number of trials ``K``, the best
   trial's index or the wall-clock time of the selection (which grows with ``K``) voids the
   theorem: conditional on ``K = k`` the best of ``k`` trials can cost up to ``k`` runs.

Neighbouring data sets differ by adding or removing one unit (an example, or a user for
user-level training), as everywhere in :mod:`adaclip.accounting`.
"""

from __future__ import annotations

import functools
import math
import numbers
import random
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from adaclip.accounting._calibration import _calibrate
from adaclip.accounting._checks import (
    _as_float,
    _check_count,
    _check_delta,
    _check_epsilon,
    _check_noise_multiplier,
    _check_orders,
    _check_sample_rate,
)
from adaclip.accounting._cyclic import _check_bands, accounted_sample_rate, accounted_steps
from adaclip.accounting._events import _run_event
from adaclip.accounting._logs import _quiet_dp_accounting_logs
from adaclip.accounting._rdp import RdpComposer
from adaclip.errors import InvalidHyperparameterError

if TYPE_CHECKING:
    import dp_accounting

__all__ = [
    "TRIAL_DISTRIBUTIONS",
    "Selection",
    "calibrate_selection_noise_multiplier",
    "draw_number_of_trials",
    "probability_never_tried",
    "select_privately",
    "selection_epsilon",
    "selection_event",
]

#: The named distributions of the number of trials, as dp-accounting's ``shape``: Poisson
#: (``inf``), geometric (truncated negative binomial with ``η = 1``) and logarithmic (``η = 0``).
#: Any other ``shape = η ≥ 0`` is the truncated negative binomial with that ``η``.
TRIAL_DISTRIBUTIONS: dict[str, float] = {"poisson": math.inf, "geometric": 1.0, "logarithmic": 0.0}

# The sampler stops searching the tail once the probability left beyond the current count is
# provably below this (the count drawn then takes that mass: a total-variation error < 1e-15).
_TAIL = 1e-18


class Selection(NamedTuple):
    """What :func:`select_privately` returns.

    Attributes:
      candidate: the best trial's candidate (``None`` when no trial ran: only with Poisson).
      score: its score (``None`` when no trial ran).
      result: what ``run_candidate`` returned with that score (``None`` when no trial ran).
      candidate_index: the candidate's position in ``candidates`` (``None`` when no trial ran).
      epsilon: ε of releasing ``(candidate, score, result)``, at ``delta``.
      delta: δ of that guarantee.
      trials: how many trials ran. **For your records only**: the number of trials is not part
        of the released output, and publishing it voids the guarantee (see the module
        docstring, assumption 4).
      mean_trials: the expected number of trials the count was drawn with.
      shape: the distribution's shape (``inf``: Poisson, ``1``: geometric, ``0``: logarithmic).
    """

    candidate: Any
    score: float | None
    result: Any
    candidate_index: int | None
    epsilon: float
    delta: float
    trials: int
    mean_trials: float
    shape: float


# ------------------------------------------------------------------------ argument checks


def _check_mean_trials(value: Any) -> float:
    x = _as_float("mean_trials", value)
    if not (math.isfinite(x) and x >= 1):
        raise InvalidHyperparameterError(
            f"mean_trials must be a finite number >= 1 (the expected number of trials; the bounds "
            f"of Papernot and Steinke as dp-accounting implements them need at least 1), got {value!r}"
        )
    return x


def _check_shape(value: Any) -> float:
    if isinstance(value, str):
        key = value.strip().lower()
        if key in TRIAL_DISTRIBUTIONS:
            return TRIAL_DISTRIBUTIONS[key]
        raise InvalidHyperparameterError(
            f"shape must be one of {sorted(TRIAL_DISTRIBUTIONS)} or a number >= 0 (inf: Poisson), got {value!r}"
        )
    x = _as_float("shape", value)
    if math.isnan(x) or x < 0:
        raise InvalidHyperparameterError(
            f"shape must be one of {sorted(TRIAL_DISTRIBUTIONS)} or a number >= 0 (inf: Poisson), got {value!r}"
        )
    return x


def _accounted_run(
    noise_multiplier: Any, sample_rate: Any, steps: Any, bands: Any
) -> tuple[float, float, int]:
    """``(σ, p, n)``: one run as the accountant records it, ``n = ⌈T/b⌉`` compositions at
    ``p = b·q`` (``b = 1``: ``T`` steps at ``q``), all arguments checked."""
    sigma = _check_noise_multiplier(noise_multiplier)
    q = _check_sample_rate(sample_rate, allow_zero=False)
    steps = _check_count(steps, "steps")
    b = _check_bands(bands)
    return sigma, accounted_sample_rate(q, b), accounted_steps(steps, b)


def _check_score_noise(value: Any) -> float | None:
    if value is None:
        return None
    x = _as_float("score_noise_multiplier", value)
    if not (math.isfinite(x) and x > 0):
        raise InvalidHyperparameterError(
            f"score_noise_multiplier must be None or finite and > 0, got {value!r}"
        )
    return x


# ------------------------------------------------------------------------ accounting


def _trial_event(sigma: float, p: float, n: int, score_sigma: float | None) -> dp_accounting.DpEvent:
    """One trial: the run (the accountant's own event for it), composed with the Gaussian
    mechanism of a noisy score when the score reads private data."""
    run = _run_event(p, sigma, n)
    if score_sigma is None:
        return run
    import dp_accounting  # lazy: dp-accounting loads SciPy and absl (1-2 s); only accounting needs it

    return dp_accounting.ComposedDpEvent([run, dp_accounting.GaussianDpEvent(noise_multiplier=score_sigma)])


def _repeat_and_select(trial: dp_accounting.DpEvent, mean: float, shape: float) -> dp_accounting.DpEvent:
    # dp-accounting 0.6.0 does not export it at the top level
    from dp_accounting.dp_event import RepeatAndSelectDpEvent

    return RepeatAndSelectDpEvent(event=trial, mean=mean, shape=shape)


def selection_event(
    *,
    noise_multiplier: float,
    sample_rate: float,
    steps: int,
    mean_trials: float,
    shape: float | str = "geometric",
    bands: int = 1,
    score_noise_multiplier: float | None = None,
) -> dp_accounting.DpEvent:
    """The dp-accounting event of a private selection (for dp-accounting's own tools).

    ``RepeatAndSelectDpEvent(trial, mean_trials, shape)``, where ``trial`` is one run as
    :class:`~adaclip.accounting.Accountant` records it —
    ``SelfComposedDpEvent(PoissonSampledDpEvent(p, GaussianDpEvent(σ)), n)`` with ``n = ⌈T/b⌉``
    compositions at ``p = b·q`` (``bands = b = 1``: DP-SGD, ``T`` steps at ``q``) — composed
    with ``GaussianDpEvent(score_noise_multiplier)`` when that is given. Only dp-accounting's
    RDP accountant supports it. Arguments as in :func:`selection_epsilon`.
    """
    sigma, p, n = _accounted_run(noise_multiplier, sample_rate, steps, bands)
    return _repeat_and_select(
        _trial_event(sigma, p, n, _check_score_noise(score_noise_multiplier)),
        _check_mean_trials(mean_trials),
        _check_shape(shape),
    )


@functools.lru_cache(maxsize=256)
def _selection_epsilon(
    sigma: float, p: float, n: int, delta: float, mean: float, shape: float,
    orders: tuple[float, ...] | None, score_sigma: float | None,
) -> float:  # fmt: skip
    if sigma == 0:
        return math.inf  # σ = 0 is no privacy, as for the accountant
    accountant = RdpComposer(orders).dp_accountant()
    with _quiet_dp_accounting_logs():
        accountant.compose(_repeat_and_select(_trial_event(sigma, p, n, score_sigma), mean, shape))
        return float(accountant.get_epsilon(delta))


def selection_epsilon(
    *,
    noise_multiplier: float,
    sample_rate: float,
    steps: int,
    delta: float,
    mean_trials: float,
    shape: float | str = "geometric",
    bands: int = 1,
    score_noise_multiplier: float | None = None,
    rdp_orders: Sequence[float] | None = None,
) -> float:
    """ε at ``delta`` of releasing the best of a random number of trials (repeat-and-select).

    Each trial is one run as :mod:`adaclip.accounting` describes it: ``steps`` steps of the
    Poisson-subsampled Gaussian with ``noise_multiplier`` σ at ``sample_rate`` q, or with
    banded noise (``bands = b > 1``) ``⌈T/b⌉`` compositions at rate ``b·q``; plus, when
    ``score_noise_multiplier = s`` is given, a Gaussian mechanism with noise ``s`` (sensitivity 1)
    for a score read from private validation data. The number of trials has mean
    ``mean_trials`` (>= 1) and the distribution ``shape``: ``"poisson"`` (``inf``),
    ``"geometric"`` (``1``, the default), ``"logarithmic"`` (``0``), or a number ``η >= 0``
    (truncated negative binomial). The bound is Papernot and Steinke's (Theorem 6 for Poisson,
    Theorem 2 otherwise; see the module docstring), computed by dp-accounting's RDP accountant
    at ``rdp_orders`` (``None``: dp-accounting's). RDP only: dp-accounting's PLD accountant does
    not support the event. σ = 0 gives ``inf``. Results are cached for the process.

    Raises:
        InvalidHyperparameterError: an argument is out of range (named in the message).
    """
    sigma, p, n = _accounted_run(noise_multiplier, sample_rate, steps, bands)
    return _selection_epsilon(
        sigma, p, n, _check_delta(delta), _check_mean_trials(mean_trials), _check_shape(shape),
        _check_orders(rdp_orders), _check_score_noise(score_noise_multiplier),
    )  # fmt: skip


def calibrate_selection_noise_multiplier(
    *,
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    mean_trials: float,
    shape: float | str = "geometric",
    bands: int = 1,
    score_noise_multiplier: float | None = None,
    tol: float = 1e-4,
    rdp_orders: Sequence[float] | None = None,
) -> float:
    """Smallest σ such that the whole selection stays within ``(target_epsilon, delta)``.

    The σ every trial's run must use so that :func:`selection_epsilon` with these arguments is
    at most ``target_epsilon``: the best of a random number of trials (mean ``mean_trials``,
    distribution ``shape``), each a run of ``steps`` steps at ``sample_rate`` (``bands``:
    ``⌈T/b⌉`` compositions at ``b·q``), however many candidates the trials choose among (the
    bound does not depend on their number). The same search as
    :func:`~adaclip.accounting.calibrate_noise_multiplier` with ``accountant="rdp"`` (a bracket,
    then dp-accounting's Brent search), on the selection's event; the σ returned meets the
    budget and is within ``tol`` relative of the smallest σ that does. Give every candidate this
    σ (and these q, T, b); for banded noise, build the run with ``bands=b`` and this σ instead
    of a plan's own σ_b, which is calibrated for one run.

    Raises:
        InvalidHyperparameterError: an argument is out of range, or the budget cannot be met
            (e.g. a ``score_noise_multiplier`` that alone spends more than the target).
    """
    target_epsilon = _check_epsilon(target_epsilon, "target_epsilon")
    delta = _check_delta(delta)
    _, p, n = _accounted_run(1.0, sample_rate, steps, bands)
    mean = _check_mean_trials(mean_trials)
    eta = _check_shape(shape)
    score_sigma = _check_score_noise(score_noise_multiplier)
    orders = _check_orders(rdp_orders)
    tol = _as_float("tol", tol)
    if not (math.isfinite(tol) and 0 < tol < 1):
        raise InvalidHyperparameterError(f"tol must be in (0, 1), got {tol!r}")
    fresh = RdpComposer(orders).dp_accountant

    def event(sigma: float) -> dp_accounting.DpEvent:
        return _repeat_and_select(_trial_event(float(sigma), p, n, score_sigma), mean, eta)

    def eps(sigma: float) -> float:
        return _selection_epsilon(float(sigma), p, n, delta, mean, eta, orders, score_sigma)

    import dp_accounting  # lazy: dp-accounting loads SciPy and absl (1-2 s); only accounting needs it

    # σ → ∞: the training costs nothing, what is left is the score's cost and the selection's own
    # terms (log μ, log 1/γ): a target at or below that cannot be met by any σ
    limit_trial = (
        dp_accounting.NoOpDpEvent()
        if score_sigma is None
        else dp_accounting.GaussianDpEvent(noise_multiplier=score_sigma)
    )
    with _quiet_dp_accounting_logs():
        floor = float(fresh().compose(_repeat_and_select(limit_trial, mean, eta)).get_epsilon(delta))
        if floor >= target_epsilon:
            raise InvalidHyperparameterError(
                f"target_epsilon={target_epsilon!r} cannot be met at delta={delta!r}: with mean_trials={mean!r} "
                f"and shape={eta!r} the selection costs epsilon={floor:.4g} even with no training cost (sigma -> inf)"
                + (
                    ""
                    if score_sigma is None
                    else f", from the noisy score (score_noise_multiplier={score_sigma!r})"
                )
            )
        return _calibrate(
            eps, fresh, event, target_epsilon=target_epsilon, delta=delta, q=p, steps=n, tol=tol
        )


# ------------------------------------------------------------------------ the number of trials


def _tnb_mean(gamma: float, eta: float) -> float:
    """E[K] of the truncated negative binomial: ``η(1/γ − 1)/(1 − γ^η)`` (``η = 0``:
    ``(1 − γ)/(γ·log(1/γ))``), decreasing in γ from ``∞`` (γ → 0) to 1 (γ = 1)."""
    if gamma >= 1:
        return 1.0
    log_gamma = math.log(gamma)
    b = log_gamma / (gamma - 1)  # log(1/γ)/(1 − γ)
    x = eta * log_gamma
    a = math.expm1(x) / x if x != 0 else 1.0  # (1 − γ^η)/(η·log(1/γ))
    return 1.0 / (gamma * a * b)


@functools.lru_cache(maxsize=64)
def _tnb_gamma(eta: float, mean: float) -> float:
    """γ of the truncated negative binomial with ``E[K] <= mean`` (``= mean`` to 1e-14 relative).

    The side of the root matters for privacy: dp-accounting bounds the selection with a γ below
    the root (its ``_gamma_truncated_negative_binomial``, "the conservative estimate") and with
    ``log(mean)``; the count drawn here has ``γ`` at or above the root, so ``log(1/γ)`` and
    ``log E[K]`` are both at most what the bound uses."""
    if eta == 1:
        return 1.0 / mean  # geometric, exactly
    lo, hi = 0.0, 1.0  # _tnb_mean(lo) > mean >= _tnb_mean(hi)
    for _ in range(200):
        if hi - lo <= 1e-14 * hi:
            break
        mid = 0.5 * (lo + hi)
        if _tnb_mean(mid, eta) <= mean:
            hi = mid
        else:
            lo = mid
    return hi


def _log_pmf_and_ratio(mean: float, eta: float) -> tuple[int, Callable[[int], float], Callable[[int], float]]:
    """``(k₀, log P(K = k), r(k))``: the smallest count, the log-probabilities and a bound ``r(k)``
    on every ratio ``P(K = j + 1)/P(K = j)`` for ``j >= k``, so that ``P(K > k) <= P(K = k)·r/(1 − r)``
    when ``r < 1``."""
    if math.isinf(eta):  # Poisson(μ)
        log_mu = math.log(mean)
        return 0, (lambda k: -mean + k * log_mu - math.lgamma(k + 1)), (lambda k: mean / (k + 1))
    gamma = _tnb_gamma(eta, mean)
    log_q = math.log1p(-gamma)  # log(1 − γ)
    if eta == 0:  # logarithmic: (1 − γ)^k / (k·log(1/γ))
        log_norm = math.log(-math.log(gamma))
        return 1, (lambda k: k * log_q - math.log(k) - log_norm), (lambda k: 1.0 - gamma)
    # (1 − γ)^k Γ(k + η)/(Γ(η) k!) / (γ^{−η} − 1); ratio (1 − γ)(k + η)/(k + 1), decreasing in k
    # for η > 1 and increasing to 1 − γ for η < 1
    log_norm = math.log(math.expm1(-eta * math.log(gamma))) + math.lgamma(eta)
    return (
        1,
        lambda k: k * log_q + math.lgamma(k + eta) - math.lgamma(k + 1) - log_norm,
        lambda k: max((1.0 - gamma) * (k + eta) / (k + 1), 1.0 - gamma),
    )


def _draw_trials(rng: random.Random, mean: float, eta: float) -> int:
    """One count by inversion of the distribution function with one uniform draw."""
    if not math.isinf(eta) and _tnb_gamma(eta, mean) >= 1:
        return 1  # mean 1: exactly one trial
    k, log_pmf, ratio = _log_pmf_and_ratio(mean, eta)
    u = rng.random()
    cumulative = 0.0
    while True:
        p = math.exp(log_pmf(k))
        cumulative += p
        if u < cumulative:
            return k
        r = ratio(k)
        if r < 1 and p * r / (1 - r) < _TAIL:
            return k  # what is left is rounding (u within ~1e-16 of 1)
        k += 1


def draw_number_of_trials(rng: random.Random, *, mean_trials: float, shape: float | str = "geometric") -> int:
    """Draw how many trials a private selection runs.

    ``shape``: ``"poisson"`` (``inf``: ``K ~ Poisson(μ)``, ``K = 0`` possible), ``"geometric"``
    (``1``: ``P(K = k) = γ(1 − γ)^{k−1}``, ``γ = 1/μ``), ``"logarithmic"`` (``0``) or any ``η >= 0``
    (truncated negative binomial, ``K >= 1``), with ``E[K] = mean_trials = μ`` (for the truncated
    negative binomial ``γ`` is solved from μ on the side where ``E[K] <= μ``: see
    :func:`_tnb_gamma`). By inversion with one ``rng.random()``, exact up to floating point.
    ``rng`` is a :class:`random.Random` (seeded: reproducible) or a :class:`random.SystemRandom`
    (the operating system's entropy, what :func:`select_privately` uses without a seed).
    """
    return _draw_trials(rng, _check_mean_trials(mean_trials), _check_shape(shape))


def probability_never_tried(
    *, num_candidates: int, mean_trials: float, shape: float | str = "geometric"
) -> float:
    """The probability that a given candidate gets no trial: ``E[(1 − 1/C)^K]``.

    A planning aid for ``mean_trials`` (public: it reads no data). With ``s = 1 − 1/C``, the
    probability generating function of ``K``: Poisson ``e^{μ(s − 1)}``; truncated negative
    binomial ``((1 − (1 − γ)s)^{−η} − 1)/(γ^{−η} − 1)``; logarithmic
    ``log(1 − (1 − γ)s)/log(γ)``. E.g. 4 candidates, 10 trials on average: 8.2 % (Poisson),
    23.1 % (geometric),
    36.2 % (logarithmic: most of its mass is on one trial).
    """
    c = _check_count(num_candidates, "num_candidates")
    mean = _check_mean_trials(mean_trials)
    eta = _check_shape(shape)
    s = 1.0 - 1.0 / c
    if math.isinf(eta):
        return math.exp(mean * (s - 1.0))
    gamma = _tnb_gamma(eta, mean)
    if gamma >= 1:
        return s
    inner = 1.0 - (1.0 - gamma) * s  # in (γ, 1]
    if eta == 0:
        return math.log(inner) / math.log(gamma)
    return math.expm1(-eta * math.log(inner)) / math.expm1(-eta * math.log(gamma))


# ------------------------------------------------------------------------ the driver


def _as_score(value: Any) -> float:
    if isinstance(value, (bool, str, bytes)) or value is None:
        raise TypeError(f"run_candidate must return (score, result) with a real-number score, got {value!r}")
    try:
        score = float(value)
    except (TypeError, ValueError):
        raise TypeError(
            f"run_candidate must return (score, result) with a real-number score, got {value!r}"
        ) from None
    return -math.inf if math.isnan(score) else score  # NaN ranks last, whatever the trial


def select_privately(
    candidates: Iterable[Any],
    run_candidate: Callable[[Any, int], tuple[float, Any]],
    *,
    mean_trials: float,
    noise_multiplier: float,
    sample_rate: float,
    steps: int,
    delta: float,
    bands: int = 1,
    shape: float | str = "geometric",
    score_noise_multiplier: float | None = None,
    seed: int | None = None,
    rdp_orders: Sequence[float] | None = None,
) -> Selection:
    """Pick the best of ``candidates`` by a DP score, with the selection counted in ε.

    Draws the number of trials ``K`` (:func:`draw_number_of_trials`: mean ``mean_trials``,
    distribution ``shape``); for each trial ``t = 0 … K − 1`` draws a candidate uniformly at
    random and calls ``run_candidate(candidate, t) -> (score, result)``, which trains the
    candidate privately and scores it (higher is better; NaN ranks last; ties go to the earlier
    trial, which for independent trials is the same as a uniform tie-break). Returns the best
    trial's candidate, score and result only, with ε of releasing them
    (:func:`selection_epsilon`, computed, and every argument checked, before any trial runs).

    **Every trial must be the run described by** ``noise_multiplier``, ``sample_rate``,
    ``steps`` and ``bands`` (the per-run privacy parameters; more noise or fewer steps is fine),
    whichever candidate it trains. With a private validation split the score must be noisy:
    the number of correct predictions plus ``N(0, score_noise_multiplier²)``, accounted here;
    without ``score_noise_multiplier`` the score must read only the trained model and public
    data. Publish only ``(candidate, score, result)`` and ε: not the other trials' scores or
    models, not :attr:`Selection.trials`, not the trial index (``t`` is given for seeding and
    bookkeeping), not the time the selection took. ``run_candidate`` must not log per-trial
    scores anywhere they are released. Do not rerun a selection to get a better pick or past
    ``K = 0`` (Poisson): each run is a new selection whose ε adds up. An exception raised by
    ``run_candidate`` propagates and ends the selection.

    ``seed=None`` draws from :class:`random.SystemRandom` (the operating system's entropy); an
    int seeds :class:`random.Random`, for reproducible tests and audits — never pick it after
    seeing results. Trials draw their own training noise: the seed only sets ``K`` and the
    candidates.

    Raises:
        InvalidHyperparameterError: ``candidates`` is empty, ``run_candidate`` is not callable,
            ``mean_trials < 1``, an unknown or negative ``shape``, a bad seed, or any per-run
            parameter out of range. Nothing has run then.
    """
    try:
        pool = tuple(candidates)
    except TypeError:
        raise InvalidHyperparameterError(
            f"candidates must be an iterable of configurations, got {candidates!r}"
        ) from None
    if not pool:
        raise InvalidHyperparameterError("candidates must not be empty")
    if not callable(run_candidate):
        raise InvalidHyperparameterError(f"run_candidate must be callable, got {run_candidate!r}")
    mean = _check_mean_trials(mean_trials)
    eta = _check_shape(shape)
    delta = _check_delta(delta)
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, numbers.Integral)):
        raise InvalidHyperparameterError(f"seed must be None or an int, got {seed!r}")
    epsilon = selection_epsilon(
        noise_multiplier=noise_multiplier, sample_rate=sample_rate, steps=steps, delta=delta,
        mean_trials=mean, shape=eta, bands=bands, score_noise_multiplier=score_noise_multiplier,
        rdp_orders=rdp_orders,
    )  # fmt: skip
    rng: random.Random = random.SystemRandom() if seed is None else random.Random(int(seed))
    trials = _draw_trials(rng, mean, eta)
    best: tuple[int, float, Any] | None = None  # (candidate index, score, result)
    for t in range(trials):
        index = rng.randrange(len(pool))
        returned = run_candidate(pool[index], t)
        if not (isinstance(returned, tuple) and len(returned) == 2):
            raise TypeError(
                f"run_candidate must return a (score, result) pair, got {type(returned).__name__}"
            )
        score = _as_score(returned[0])
        if best is None or score > best[1]:
            best = (index, score, returned[1])
    if best is None:
        return Selection(None, None, None, None, epsilon, delta, trials, mean, eta)
    index, score, result = best
    return Selection(pool[index], score, result, index, epsilon, delta, trials, mean, eta)
