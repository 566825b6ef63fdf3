"""Correlated noise without amplification: min-separation participation and its Gaussian release.

**Participation.** A unit may take part in at most ``k`` of the ``n`` steps, any two of them at
least ``b`` steps apart (``b`` = ``min_separation``); by default ``k = ⌈n/b⌉``, the most that
fit. A fixed-order sampler (the data cut once into ``b`` disjoint batches, visited in the same
order every epoch: :class:`adaclip_torch.data.FixedOrderBatchSampler`) gives exactly this
pattern, with every unit's steps ``s, s + b, s + 2b, …``. Nothing is random about who
participates, so there is **no amplification by sampling**: the data order is public, and
neighbouring data sets differ in one unit's contributions (zero-out: that unit's clipped
gradients replaced by zeros at all its steps).

**The release** of a whole run with correlated noise ``x = C⁻¹ z`` is ``y = G + σ C⁻¹ z``;
multiplied by ``C`` (post-processing both ways) it is the Gaussian mechanism ``C G + σ z``. One
unit contributes ``g_s`` (``‖g_s‖ ≤ 1``) at its steps ``s ∈ P``, changing ``C G`` by
``Σ_{s∈P} C_{:,s} g_sᵀ`` whose squared Frobenius norm is
``Σ_{s,s'} ⟨C_{:,s}, C_{:,s'}⟩⟨g_s, g_{s'}⟩ ≤ ‖C u_P‖²`` when ``C ≥ 0`` entrywise (``u_P`` the 0/1
indicator of ``P``; equality at equal ``g_s``). The sensitivity is ``Δ = max_P ‖C u_P‖`` and the
run is the Gaussian mechanism with noise multiplier ``σ/Δ`` (:class:`MinSeparationGaussian`).

**The worst pattern** (:meth:`MinSeparationParticipation.sensitivity`). For ``C`` lower-triangular
Toeplitz with a non-negative, non-increasing first column ``c``, the maximum is attained at
``P* = {0, b, 2b, …, (k−1)b}``. Proof: let ``P = {s_1 < … < s_m}`` (``m ≤ k``). The shifts
below turn it into ``{0, b, …, (m−1)b}`` without decreasing ``‖C u‖``, and then adding the
participations ``mb, …, (k−1)b`` (they fit: ``(k−1)b < n``) only adds non-negative terms.
Suppose ``s_i = (i−1)b`` for ``i ≤ j`` (``0 ≤ j < m``). Split
``C u_P = p + v`` with ``p`` from the first ``j`` participations and ``v`` from the rest, and move
the rest left by ``δ = s_{j+1} − jb ≥ 0`` (still separated by ``b``): ``v`` becomes ``v'`` with
``v'_i = v_{i+δ}``. Over the rows ``i < n``:
``Σ v'_i² = Σ_{m∈[δ, n+δ)} v_m² ≥ Σ_{m<n} v_m²`` (``v`` vanishes below ``s_{j+1} ≥ δ``), and
``Σ p_i v'_i = Σ_m p_{m−δ} v_m ≥ Σ_m p_m v_m`` because ``p_i = Σ_{l<j} c_{i−lb}`` is
non-increasing for ``i ≥ (j−1)b`` (a sum of non-increasing sequences there) and ``v ≥ 0`` lives on
``m ≥ s_{j+1}``, where ``m − δ ≥ jb``. So ``‖p + v'‖² ≥ ‖p + v‖²``; by induction on ``j``, ``P*``
is the worst. (The tests check this against every pattern for small ``n``.)

**Streaming accounting.** A run that may stop at any step is accounted by prefixes: the first
``t`` releases are the Gaussian mechanism with sensitivity ``Δ_t² = S(t) = Σ_{i<t} y_i²``
(``y = C u_{P*}``; the argument above applies to the leading ``t×t`` block, itself
Toeplitz with the same column). Gaussian mechanisms compose exactly by adding ``Δ²/σ²``, so
recording, at the start of each block of ``b`` steps, a Gaussian event with noise multiplier
``σ/√(S(t_end) − S(t_start))`` makes the accountant's composition after any block equal to the
Gaussian mechanism ``σ/Δ_{t_end}`` of everything released up to the block's end — recorded
before the block's first release, so the accountant is never behind.

**Auxiliary releases** (AdaCliP's or the quantile rule's counts, with fresh independent noise
``σ_aux`` per step, ``1/σ_g² + ‖aux‖²_max/σ_aux² = 1/σ²``) are covered: they add at most
``k_t·‖aux‖²_max/σ_aux²`` to ``Δ²/σ_g²`` and ``k_t ≤ S(t)`` (the diagonal alone gives ``k_t``
since ``c_0 = 1`` and every entry is non-negative).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import TYPE_CHECKING, Any

import numpy as np

from adaclip.accounting._calibration import _calibrate, calibrate_noise_multiplier
from adaclip.accounting._checks import _check_delta, _check_epsilon
from adaclip.accounting._composer import make_composer
from adaclip.accounting._events import history_event
from adaclip.accounting._logs import _quiet_dp_accounting_logs
from adaclip.accounting._mechanisms import accounting_method
from adaclip.accounting._pld import DEFAULT_PLD_VALUE_DISCRETIZATION_INTERVAL
from adaclip.errors import InvalidHyperparameterError
from adaclip.options import positive_int

if TYPE_CHECKING:
    import dp_accounting

__all__ = [
    "comb_response",
    "MinSeparationGaussian",
    "MinSeparationParticipation",
    "block_noise_multipliers",
    "calibrate_block_noise_multiplier",
]


def _column(column: Any) -> np.ndarray:
    """A Toeplitz first column the worst-pattern argument covers: 1-d, finite, non-negative and
    non-increasing (to a relative 1e-12, for rounding of a computed column)."""
    try:
        c = np.asarray(column, dtype=np.float64)
    except (TypeError, ValueError):
        raise InvalidHyperparameterError(f"column must be a 1-d sequence of numbers, got {column!r}") from None
    if c.ndim != 1 or c.size == 0 or not np.all(np.isfinite(c)):
        raise InvalidHyperparameterError("column must be a non-empty, finite 1-d sequence")
    tol = 1e-12 * float(np.max(np.abs(c)))
    if np.any(c < -tol) or np.any(np.diff(c) > tol):
        raise InvalidHyperparameterError(
            "the min-separation sensitivity is computed for a non-negative, non-increasing column only "
            "(its worst participation pattern is then known); this column is not"
        )
    return np.maximum(c, 0.0)


def comb_response(column: np.ndarray, min_separation: int, participations: int | None = None) -> np.ndarray:
    """``y = C u`` for ``u`` the indicator of steps ``0, b, …, (k−1)b`` (``b = min_separation``,
    ``k = participations``, default all that fit) and ``C`` the lower-triangular Toeplitz matrix
    of ``column``, in ``O(n)``: with every comb step, ``y_i = Σ_{l: lb ≤ i} c_{i−lb}`` is a
    cumulative sum over the rows of ``column`` folded into rows of length ``b``; ``k`` steps
    only subtract that response shifted by ``kb``. No validation (see :func:`_column`)."""
    c = np.asarray(column, dtype=np.float64)
    n = c.size
    b = min(int(min_separation), n)
    rows = -(-n // b)
    folded = np.zeros(rows * b)
    folded[:n] = c
    y = np.cumsum(folded.reshape(rows, b), axis=0).ravel()[:n]
    if participations is not None and participations * b < n:
        shift = participations * b
        y[shift:] = y[shift:] - y[: n - shift].copy()
    return y


@dataclasses.dataclass(frozen=True)
class MinSeparationParticipation:
    """At most ``max_participations`` steps per unit (``None``: as many as fit, ``⌈n/b⌉``), any
    two at least ``min_separation = b`` apart. The module docstring has the worst-case proof."""

    min_separation: int
    max_participations: int | None = None

    def __post_init__(self) -> None:
        positive_int("min_separation", self.min_separation)
        if self.max_participations is not None:
            positive_int("max_participations", self.max_participations)

    def participations(self, steps: int) -> int:
        """``k``: how many times a unit takes part in ``steps`` steps at most."""
        fit = -(-positive_int("steps", steps) // self.min_separation)
        return fit if self.max_participations is None else min(fit, self.max_participations)

    def worst_response(self, column: Any) -> np.ndarray:
        """``y = C u_{P*}`` over ``n = len(column)`` steps (``P* = {0, b, …, (k−1)b}``)."""
        c = _column(column)
        return comb_response(c, self.min_separation, self.participations(c.size))

    def prefix_sensitivities_squared(self, column: Any) -> np.ndarray:
        """``S(t)`` for ``t = 0 … n`` (``S(0) = 0``): the squared sensitivity of the first ``t``
        releases."""
        y = self.worst_response(column)
        return np.concatenate(([0.0], np.cumsum(y * y)))

    def sensitivity(self, column: Any) -> float:
        """``Δ = ‖C u_{P*}‖``, the sensitivity of all ``n = len(column)`` releases."""
        y = self.worst_response(column)
        return float(math.sqrt(float(np.dot(y, y))))


@dataclasses.dataclass(frozen=True)
class MinSeparationGaussian:
    """The whole run's release: a Gaussian mechanism with noise multiplier ``σ`` on data whose
    sensitivity is ``Δ`` (:meth:`MinSeparationParticipation.sensitivity`) — no sampling, so no
    amplification. Accounted as ``dp_accounting.GaussianDpEvent(σ/Δ)`` by either method
    (``"pld"``: the Gaussian's privacy loss distribution, tight; ``"rdp"``: ``ε_α = α/(2(σ/Δ)²)``,
    looser)."""

    noise_multiplier: float
    sensitivity: float

    def __post_init__(self) -> None:
        for name in ("noise_multiplier", "sensitivity"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not (math.isfinite(v) and v > 0):
                raise InvalidHyperparameterError(f"{name} must be a finite number > 0, got {v!r}")

    @property
    def effective_noise_multiplier(self) -> float:
        """``σ/Δ``."""
        return float(self.noise_multiplier) / float(self.sensitivity)

    def dp_event(self) -> dp_accounting.DpEvent:
        import dp_accounting  # lazy: dp-accounting loads SciPy and absl (1-2 s); only accounting needs it

        return dp_accounting.GaussianDpEvent(noise_multiplier=self.effective_noise_multiplier)

    def epsilon(
        self,
        delta: float,
        *,
        accountant: str | None = None,
        mechanism: str | None = None,
        pld_value_discretization_interval: float = DEFAULT_PLD_VALUE_DISCRETIZATION_INTERVAL,
    ) -> float:
        """ε at ``delta`` (an upper bound), composed with the accounting method ``accountant``
        (default ``"pld"``; ``mechanism=``, its old name, is deprecated)."""
        method = accounting_method(accountant, mechanism, caller="MinSeparationGaussian.epsilon")
        delta = _check_delta(delta, "delta")
        composer = make_composer(
            method, pld_value_discretization_interval=pld_value_discretization_interval,
            rdp_orders=None, progress=False,
        )  # fmt: skip
        with _quiet_dp_accounting_logs():
            return float(composer.dp_accountant().compose(self.dp_event()).get_epsilon(delta))

    @classmethod
    def calibrate(
        cls,
        *,
        target_epsilon: float,
        delta: float,
        sensitivity: float,
        accountant: str | None = None,
        mechanism: str | None = None,
        tol: float = 1e-4,
        pld_value_discretization_interval: float = DEFAULT_PLD_VALUE_DISCRETIZATION_INTERVAL,
    ) -> MinSeparationGaussian:
        """The smallest ``σ`` (within ``tol`` relative) meeting ``(ε, δ)``: the Gaussian
        mechanism's own calibration (:func:`~adaclip.accounting.calibrate_noise_multiplier` with
        ``sample_rate=1``, one step, the accounting method ``accountant``; ``mechanism=``, its
        old name, is deprecated) gives ``σ/Δ``, times ``Δ``."""
        method = accounting_method(accountant, mechanism, caller="MinSeparationGaussian.calibrate")
        cls(noise_multiplier=1.0, sensitivity=sensitivity)  # validates Δ
        effective = calibrate_noise_multiplier(
            target_epsilon=target_epsilon, delta=delta, sample_rate=1.0, steps=1, accountant=method, tol=tol,
            pld_value_discretization_interval=pld_value_discretization_interval, progress=False,
        )  # fmt: skip
        return cls(noise_multiplier=effective * float(sensitivity), sensitivity=float(sensitivity))


def block_noise_multipliers(noise_multiplier: float, prefix: Any, block: int) -> list[float]:
    """The noise multipliers recorded for a run accounted block by block: ``σ/√(S(t_1) − S(t_0))``
    for each block ``[t_0, t_1)`` of ``block`` steps (the last one cut at ``n``), from the prefix
    sensitivities ``S(0) … S(n)`` (:meth:`MinSeparationParticipation.prefix_sensitivities_squared`)."""
    s = np.asarray(prefix, dtype=np.float64)
    n, b = s.size - 1, positive_int("block", block)
    sigma = float(noise_multiplier)
    return [sigma / math.sqrt(float(s[min(t + b, n)] - s[t])) for t in range(0, n, b)]


def calibrate_block_noise_multiplier(
    *,
    target_epsilon: float,
    delta: float,
    prefix: Any,
    block: int,
    accountant: str | None = None,
    mechanism: str | None = None,
    tol: float = 1e-4,
    pld_value_discretization_interval: float = DEFAULT_PLD_VALUE_DISCRETIZATION_INTERVAL,
) -> float:
    """The smallest ``σ`` (within ``tol`` relative) whose block-by-block record
    (:func:`block_noise_multipliers`, each a Gaussian event at rate 1) meets ``(ε, δ)`` as
    :class:`~adaclip.accounting.Accountant` composes it with the method ``accountant`` (default
    ``"pld"``; ``mechanism=``, its old name, is deprecated) — the same events the
    optimizer records, so a planned run never overshoots its budget by the composition's
    rounding. (With ``"rdp"`` this is exactly :meth:`MinSeparationGaussian.calibrate` with
    ``Δ = √S(n)``.)"""
    method = accounting_method(accountant, mechanism, caller="calibrate_block_noise_multiplier")
    target_epsilon = _check_epsilon(target_epsilon, "target_epsilon")
    delta = _check_delta(delta, "delta")
    composer = make_composer(
        method, pld_value_discretization_interval=pld_value_discretization_interval,
        rdp_orders=None, progress=False,
    )  # fmt: skip
    fresh = composer.dp_accountant

    def event(sigma: float) -> dp_accounting.DpEvent:
        return history_event([(1.0, s, 1) for s in block_noise_multipliers(float(sigma), prefix, block)])

    def eps(sigma: float) -> float:
        return float(fresh().compose(event(sigma)).get_epsilon(delta))

    with _quiet_dp_accounting_logs():
        return _calibrate(eps, fresh, event, target_epsilon=target_epsilon, delta=delta, q=1.0, steps=1, tol=tol)
