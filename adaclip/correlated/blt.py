"""Buffered linear Toeplitz (BLT) correlated noise: the factor, its streaming solve, its fit.

**The factor.** ``C`` is the ``n×n`` lower-triangular Toeplitz matrix whose first column is

.. math::  c_0 = 1, \\qquad c_k = \\sum_{j=1}^{m} ω_j\\, θ_j^{\\,k-1} \\quad (k ≥ 1),

with ``m`` *buffers*, decays ``0 ≤ θ_j < 1`` and weights ``ω_j ≥ 0``. Its generating function is
rational, ``c(z) = 1 + Σ_j ω_j z/(1 − θ_j z) = P(z)/Q(z)`` with ``Q(z) = Π_j (1 − θ_j z)`` and
``P(z) = Q(z) + z Σ_j ω_j Π_{i≠j}(1 − θ_i z)`` (both of degree ``m``, constant term 1), so the
inverse ``C⁻¹`` is lower-triangular Toeplitz with generating function ``Q(z)/P(z)`` — again a
BLT (its decays are the reciprocals of the zeros of ``P``). Both columns are computed exactly
by one IIR filter pass each (:func:`blt_column`, :func:`blt_inverse_column`).

**The noise** follows :class:`~adaclip.correlated.BandedNoise`'s convention: the release
``y = G + σ x`` with ``x = C⁻¹ z`` (``z`` iid standard normal), i.e. ``C y = C G + σ z``, the
factorisation ``A = B C`` adding ``σ A C⁻¹ z`` to the workload ``A G``. ``C x = z`` is solved
one step at a time with ``m`` buffers ``s_j`` (each shaped like the parameters):

.. math::  x_t = z_t - \\sum_j ω_j\\, s_{j,t}, \\qquad s_{j,t+1} = θ_j\\, s_{j,t} + x_t,
           \\qquad s_{j,0} = 0,

because ``s_{j,t} = Σ_{k≥1} θ_j^{k−1} x_{t−k}`` makes ``Σ_j ω_j s_{j,t} = Σ_{k≥1} c_k x_{t−k}``
— row ``t`` of ``C x = z``. The memory is ``m·d`` numbers whatever ``n``; the tests hold the
stream to the dense ``C⁻¹`` on small ``n`` (float64 rounding).

**Why non-negative, non-increasing.** :class:`BltNoise` requires ``ω_j ≥ 0`` and
``Σ_j ω_j ≤ 1``: then ``1 = c_0 ≥ c_1 ≥ c_2 ≥ … ≥ 0``, the condition under which
:mod:`adaclip.accounting` proves the worst participation pattern of min-separation
participation (participate at steps ``0, b, 2b, …``) and so computes the sensitivity exactly.

**The fit** (:func:`fit_blt`) chooses ``(θ, ω)`` for ``m`` buffers to minimise the error of the
prefix-sum workload ``S`` (SGD at a constant learning rate) *at equal privacy*:
``sens(C)² · err(S C⁻¹)`` where ``sens`` is the min-separation sensitivity (the noise
multiplier scales with it) and ``err`` the mean (``‖S C⁻¹‖_F²/n``) or the largest
(``max_t ‖row_t(S C⁻¹)‖²``) squared error per unit ``σ²``. It depends on public quantities only
(``n``, ``m``, the separation), is deterministic and cached.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np

from adaclip.accounting._min_separation import (
    MinSeparationParticipation,
    block_noise_multipliers,
    comb_response,
)
from adaclip.correlated.contract import NoiseStreamState, SamplerRequirement
from adaclip.errors import InvalidHyperparameterError
from adaclip.options import positive_int

__all__ = [
    "refuse_blt",
    "BlockAccounting",
    "BLT_BUFFERS",
    "DEFAULT_BLT_BUFFERS",
    "BltNoise",
    "blt_column",
    "blt_inverse_column",
    "fit_blt",
    "prefix_error",
]

Array = Any
ErrorKind = Literal["mean", "max"]

#: The buffer counts :func:`fit_blt` fits.
BLT_BUFFERS = (1, 2, 3, 4)
#: The default number of buffers (``m·d`` floats of state).
DEFAULT_BLT_BUFFERS = 3


def _check_buffers(value: Any, allowed: Sequence[int] | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise InvalidHyperparameterError(f"buffers must be a positive int, got {value!r}")
    if allowed is not None and value not in allowed:
        raise InvalidHyperparameterError(f"buffers must be one of {tuple(allowed)}, got {value!r}")
    return int(value)


def check_blt_parameters(theta: Any, omega: Any) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Validate ``(θ, ω)``: equal non-zero lengths, finite, ``0 ≤ θ_j < 1``, ``ω_j ≥ 0`` and
    ``Σ ω_j ≤ 1`` (so the column is non-negative and non-increasing). Returns tuples of floats."""
    arrays = []
    for name, value in (("theta", theta), ("omega", omega)):
        try:
            arr = np.asarray(value, dtype=np.float64)
        except (TypeError, ValueError):
            raise InvalidHyperparameterError(f"{name} must be a 1-d sequence of numbers, got {value!r}") from None
        if arr.ndim != 1 or arr.size == 0:
            raise InvalidHyperparameterError(f"{name} must be a non-empty 1-d sequence, got shape {arr.shape}")
        if not np.all(np.isfinite(arr)):
            raise InvalidHyperparameterError(f"{name} must be finite, got {arr.tolist()}")
        arrays.append(arr)
    th, om = arrays
    if th.size != om.size:
        raise InvalidHyperparameterError(f"theta and omega must have one entry per buffer, got {th.size} and {om.size}")
    if np.any(th < 0) or np.any(th >= 1):
        raise InvalidHyperparameterError(f"every theta must be in [0, 1), got {th.tolist()}")
    if np.any(om < 0) or float(np.sum(om)) > 1 + 1e-12:
        raise InvalidHyperparameterError(
            f"omega must be >= 0 with sum <= 1 (a non-negative, non-increasing column, which the "
            f"sensitivity argument needs), got {om.tolist()}"
        )
    return tuple(float(v) for v in th), tuple(float(v) for v in om)


def _polynomials(theta: np.ndarray, omega: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(P, Q)`` in ascending powers of ``z``: ``c(z) = P(z)/Q(z)``."""
    q = np.poly(theta)  # Π(w − θ_j), descending in w  ==  Π(1 − θ_j z), ascending in z
    extra = np.zeros(theta.size + 1)
    for j in range(theta.size):
        extra[1:] += omega[j] * np.poly(np.delete(theta, j))
    return q + extra, q


def _impulse(b: np.ndarray, a: np.ndarray, n: int) -> np.ndarray:
    import scipy.signal  # lazy: SciPy costs 1-2 s at import; only filtering coefficients needs it

    impulse = np.zeros(n)
    impulse[0] = 1.0
    return scipy.signal.lfilter(b, a, impulse)


def blt_column(theta: Any, omega: Any, n: int) -> np.ndarray:
    """The first ``n`` coefficients of ``C``'s first column: ``1, Σ ω_j, Σ ω_j θ_j, …``."""
    th, om = (np.asarray(v, dtype=np.float64) for v in check_blt_parameters(theta, omega))
    p, q = _polynomials(th, om)
    return _impulse(p, q, positive_int("n", n))


def blt_inverse_column(theta: Any, omega: Any, n: int) -> np.ndarray:
    """The first ``n`` coefficients ``r`` of ``C⁻¹``'s first column (generating function
    ``Q(z)/P(z)``)."""
    th, om = (np.asarray(v, dtype=np.float64) for v in check_blt_parameters(theta, omega))
    p, q = _polynomials(th, om)
    return _impulse(q, p, positive_int("n", n))


def prefix_error(inverse_column: np.ndarray, *, error: ErrorKind = "mean") -> float:
    """Squared error of the prefix-sum workload per unit ``σ²`` (sensitivity not included):
    ``S C⁻¹`` is Toeplitz with first column ``u = cumsum(r)``; ``"mean"``: ``‖S C⁻¹‖_F²/n =
    Σ_k (n−k) u_k² / n``; ``"max"``: the last (largest) row, ``Σ_k u_k²``."""
    r = np.asarray(inverse_column, dtype=np.float64)
    u = np.cumsum(r)
    if error == "mean":
        n = r.size
        return float(np.dot(np.arange(n, 0, -1, dtype=np.float64), u * u) / n)
    if error == "max":
        return float(np.dot(u, u))
    raise InvalidHyperparameterError(f"error must be 'mean' or 'max', got {error!r}")


class BltNoise:
    """BLT correlated noise with ``m`` buffers (the module docstring has the maths).

    Args:
      theta: the decays ``θ_1 … θ_m`` in ``[0, 1)``.
      omega: the weights ``ω_1 … ω_m``, ``≥ 0`` with ``Σ ω ≤ 1``.

    Pure functions over the array API like :class:`~adaclip.correlated.BandedNoise`:
    :meth:`init` and :meth:`correlate` work on NumPy, PyTorch and JAX arrays alike. The stream's
    state (:class:`~adaclip.correlated.NoiseStreamState`) holds the ``m`` buffers ``s_j`` in
    ``history`` (empty before the first step: all zero) — as secret as the generator.
    """

    name = "blt"
    family = "blt"
    size_label = "BLT buffers"
    #: Fixed-order batches: every unit in one batch, visited once per epoch (the separation ``b``
    #: is the sampler's batches per epoch). No amplification: who participates is public.
    sampler_requirement = SamplerRequirement("fixed_order")

    def __init__(self, theta: Sequence[float], omega: Sequence[float]) -> None:
        self.theta, self.omega = check_blt_parameters(theta, omega)
        self._variances = np.ones(0)

    @property
    def buffers(self) -> int:
        """``m``, the number of buffers."""
        return len(self.theta)

    # ------------------------------------------------------------ the noise contract
    # (adaclip.correlated.contract.NoiseFamily: the sampler, the accounting, the checkpoint rule)

    @property
    def size(self) -> int:
        """The family's order: ``m``."""
        return self.buffers

    @property
    def state_size(self) -> int:
        """The buffers a running stream holds: ``m``."""
        return self.buffers

    def accounting(self, sample_rate: float, *, separation: int | None = None) -> BlockAccounting:
        """Min-separation participation with separation ``b = separation`` (the fixed-order
        sampler's batches per epoch), no amplification: a record at rate 1 at the first step of
        each block of ``b`` steps (:class:`BlockAccounting`). ``sample_rate`` is not used."""
        if separation is None:
            raise InvalidHyperparameterError("BLT noise is accounted for a min separation: give separation=b")
        return BlockAccounting(self, MinSeparationParticipation(positive_int("separation", separation)))

    def saved_buffers(self, stream_step: int) -> int:
        """The buffers a stream holds after ``stream_step`` steps: none before the first, then ``m``."""
        return 0 if stream_step == 0 else self.buffers

    def checkpoint_tag(self) -> dict[str, Any]:
        """What a saved stream carries to say which noise made it."""
        return {"mechanism": "blt", "blt_buffers": self.buffers}

    def __repr__(self) -> str:
        return f"BltNoise(theta={list(self.theta)!r}, omega={list(self.omega)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BltNoise) and (other.theta, other.omega) == (self.theta, self.omega)

    def __hash__(self) -> int:
        return hash((self.theta, self.omega))

    def column(self, n: int) -> np.ndarray:
        """``c_0 … c_{n−1}`` (:func:`blt_column`)."""
        return blt_column(self.theta, self.omega, n)

    def inverse_coefficients(self, n: int) -> np.ndarray:
        """``r_0 … r_{n−1}`` of ``C⁻¹`` (:func:`blt_inverse_column`)."""
        return blt_inverse_column(self.theta, self.omega, n)

    def init(self) -> NoiseStreamState:
        """The state of a stream that has produced nothing (buffers all zero, kept empty)."""
        return NoiseStreamState(history=(), step=0)

    def correlate(self, state: NoiseStreamState, z: Sequence[Array]) -> tuple[list[Array], NoiseStreamState]:
        """``x_t = z_t − Σ_j ω_j s_j`` and ``s_j ← θ_j s_j + x_t`` for each array of ``z`` (the
        step's fresh standard normals, one array per parameter tensor). Returns ``x_t`` and the
        next state; ``state`` is not modified."""
        return self._recursion(state, z, correlating=True)

    def whiten(self, state: NoiseStreamState, y: Sequence[Array]) -> tuple[list[Array], NoiseStreamState]:
        """Row ``t`` of ``C y``, one step at a time: ``w_t = y_t + Σ_j ω_j u_j`` and
        ``u_j ← θ_j u_j + y_t`` for each array of ``y`` (the step's values, one array per series),
        with buffers ``u_j = Σ_{k≥1} θ_j^{k−1} y_{t−k}`` of the *input* (:meth:`correlate` keeps
        them of its output). It undoes :meth:`correlate`: fed the stream's ``x_t``, it returns
        the ``z_t`` they were made from, so it turns a release ``y = G + σ C⁻¹ z`` into
        ``C G + σ z`` — white noise (the gradient-canary audit's whitening,
        :mod:`adaclip.audit.gradient_canaries`). Starts from :meth:`init`; ``state`` is not
        modified."""
        return self._recursion(state, y, correlating=False)

    def _recursion(
        self, state: NoiseStreamState, values: Sequence[Array], *, correlating: bool
    ) -> tuple[list[Array], NoiseStreamState]:
        """One step of the buffered recursion, both ways: ``out = v ∓ Σ_j ω_j u_j`` (``−`` to
        correlate, ``+`` to whiten), then ``u_j ← θ_j u_j + f`` with ``f`` the output when
        correlating (``C⁻¹``'s buffers hold ``x``) and the input when whitening (``C``'s hold ``y``)."""
        out = []
        for k, vk in enumerate(values):
            acc = vk
            for om, buf in zip(self.omega, state.history, strict=False):
                acc = acc - om * buf[k] if correlating else acc + om * buf[k]
            out.append(acc)
        fed = out if correlating else list(values)
        if state.history:
            history = tuple(
                tuple(th * buf[k] + fed[k] for k in range(len(fed)))
                for th, buf in zip(self.theta, state.history, strict=True)
            )
        else:
            history = tuple(tuple(fed) for _ in self.theta)
        return out, NoiseStreamState(history=history, step=state.step + 1)

    def variance(self, step: int) -> float:
        """``v_t = Σ_{k≤t} r_k²``, the per-coordinate variance of ``x_t`` (cached ahead, like
        :meth:`BandedNoise.variance`)."""
        if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
            raise InvalidHyperparameterError(f"step must be a non-negative int, got {step!r}")
        t = int(step)
        if t >= len(self._variances):
            r = self.inverse_coefficients(max(t + 1, 2 * len(self._variances), 1024))
            self._variances = np.cumsum(r * r)
        return float(self._variances[t])


class BlockAccounting:
    """BLT noise accounted block by block under min-separation participation (no amplification;
    :mod:`adaclip.accounting._min_separation` has the argument).

    At the first step ``t_0`` of each block of ``b`` steps (counted from the stream's start) the
    accountant records one Gaussian event at rate 1 with noise multiplier
    ``σ/√(S(t_1) − S(t_0))``, ``t_1 = t_0 + b``, from the prefix sensitivities ``S`` of the
    factor's worst participation pattern: the events then compose to the Gaussian mechanism
    ``σ/Δ_{t_1}`` of everything released up to ``t_1``. ``S`` is computed ahead and cached."""

    rate = 1.0

    def __init__(self, noise: BltNoise, participation: MinSeparationParticipation) -> None:
        self.noise = noise
        self.participation = participation
        self.cycle = participation.min_separation
        self._prefix = np.zeros(1)  # S(0..t) of the factor, grown on demand

    def noise_multiplier(self, sigma: float, start: int) -> float:
        """The record of the block ``[start, start + b)``; ``σ = 0`` stays 0 (no noise: ε = ∞)."""
        if sigma == 0:
            return sigma
        t0, t1 = start, start + self.cycle
        if self._prefix.size <= t1:
            n = max(t1 + 1, 2 * self._prefix.size, 4 * self.cycle)
            self._prefix = self.participation.prefix_sensitivities_squared(self.noise.column(n))
        return block_noise_multipliers(sigma, self._prefix[t0 : t1 + 1], self.cycle)[0]


# --------------------------------------------------------------------------------------
# the fit
# --------------------------------------------------------------------------------------


def _unpack(params: np.ndarray, m: int) -> tuple[np.ndarray, np.ndarray]:
    """Unconstrained ``(a, β)`` to ``θ = sigmoid(a)`` in (0, 1) and ``ω = e^β/(1 + Σ e^β)``
    (positive, sum < 1)."""
    a, beta = params[:m], params[m:]
    theta = 0.5 * (1.0 + np.tanh(0.5 * a))
    top = max(0.0, float(np.max(beta)))
    e = np.exp(beta - top)
    omega = e / (math.exp(-top) + float(np.sum(e)))
    return np.minimum(theta, 1.0 - 1e-12), omega


def _objective(params: np.ndarray, m: int, n: int, separation: int, error: ErrorKind) -> float:
    """``log sens² + log err`` (error at equal privacy), ``+inf``-like on overflow."""
    theta, omega = _unpack(params, m)
    p, q = _polynomials(theta, omega)
    with np.errstate(all="ignore"):
        c = _impulse(p, q, n)
        r = _impulse(q, p, n)
        y = comb_response(c, separation)
        sens2 = float(np.dot(y, y))
        err = prefix_error(r, error=error)
    if not (math.isfinite(sens2) and math.isfinite(err) and err > 0):
        return 1e6
    return math.log(sens2) + math.log(err)


@functools.lru_cache(maxsize=64)
def _fit_cached(n: int, m: int, separation: int, error: str) -> tuple[tuple[float, ...], tuple[float, ...]]:
    import scipy.optimize  # lazy: SciPy costs 1-2 s at import; only fitting coefficients needs it

    best: tuple[float, np.ndarray] | None = None
    # deterministic starts: time scales 1/(1 − θ) spread geometrically between 2 and n, and the
    # fit with one buffer fewer plus a faint extra buffer (so m buffers never do worse than m − 1)
    starts = []
    for spread in (1.0, 0.5):
        scales = np.geomspace(2.0, max(2.0, spread * n), m) if m > 1 else np.array([max(2.0, math.sqrt(n))])
        theta0 = 1.0 - 1.0 / scales
        starts.append((theta0, np.full(m, 0.5 / m)))
    if m > 1:
        th, om = _fit_cached(n, m - 1, separation, error)
        starts.append((np.array((*th, 0.5)), np.array((*om, 1e-3 * (1.0 - sum(om))))))
    for theta0, omega0 in starts:
        theta0 = np.clip(theta0, 1e-6, 1.0 - 1e-9)
        a0 = np.log(theta0 / (1.0 - theta0))
        beta0 = np.log(np.maximum(omega0, 1e-12) / (1.0 - float(np.sum(omega0))))  # inverse of _unpack's ω
        x0 = np.concatenate((a0, beta0))
        res = scipy.optimize.minimize(
            _objective, x0, args=(m, n, separation, error), method="Nelder-Mead",
            options={"maxiter": 400 * m, "xatol": 1e-7, "fatol": 1e-10},
        )  # fmt: skip
        res = scipy.optimize.minimize(
            _objective, res.x, args=(m, n, separation, error), method="L-BFGS-B",
            options={"maxiter": 200, "ftol": 1e-13, "gtol": 1e-9},
        )  # fmt: skip
        value = float(res.fun)
        if best is None or value < best[0]:
            best = (value, np.asarray(res.x))
    assert best is not None
    theta, omega = _unpack(best[1], m)
    order = np.argsort(-theta)
    return tuple(float(v) for v in theta[order]), tuple(float(v) for v in omega[order])


def fit_blt(
    n: int, *, buffers: int = DEFAULT_BLT_BUFFERS, min_separation: int | None = None, error: ErrorKind = "mean"
) -> BltNoise:
    """The BLT with ``buffers`` buffers that (locally) minimises the prefix-sum error at equal
    privacy, ``sens(C)² · err(S C⁻¹)``, over ``n`` steps.

    ``min_separation``: ``b``, the steps between two participations of a unit (the number of
    batches per epoch); ``None`` or ``b ≥ n`` is single participation. ``error``: ``"mean"``
    (``‖S C⁻¹‖_F²/n``) or ``"max"`` (the last row's squared norm).

    Parametrised without constraints by ``θ = sigmoid(a)``, ``ω = e^β/(1 + Σ e^β)`` (so
    ``θ ∈ (0, 1)``, ``ω > 0``, ``Σ ω < 1``: the column is positive and decreasing, ``C`` is
    invertible and the sensitivity argument applies); Nelder–Mead then L-BFGS-B on
    ``log sens² + log err`` from three fixed starts (two spreads of time scales, and the fit
    with ``m − 1`` buffers plus a faint one), each evaluation two ``O(n·m)`` filter passes. Deterministic; cached (an LRU cache keyed by ``(n, buffers, separation, error)``).
    """
    n = positive_int("n", n)
    m = _check_buffers(buffers, BLT_BUFFERS)
    b = n if min_separation is None else min(positive_int("min_separation", min_separation), n)
    if error not in ("mean", "max"):
        raise InvalidHyperparameterError(f"error must be 'mean' or 'max', got {error!r}")
    theta, omega = _fit_cached(n, m, b, error)
    return BltNoise(theta, omega)


def refuse_blt(noise_mechanism: Any, *, where: str) -> None:
    """Raise :class:`~adaclip.errors.InvalidHyperparameterError` when ``noise_mechanism`` is BLT
    (``"blt"`` or a :class:`BltNoise`) on a path that cannot account for it (``where``: "the JAX
    transformations", "the Flower aggregation"). BLT's accounting needs fixed-order
    participation, which only PyTorch's ``FixedOrderBatchSampler`` provides so far."""
    if isinstance(noise_mechanism, BltNoise) or (isinstance(noise_mechanism, str) and noise_mechanism == "blt"):
        raise InvalidHyperparameterError(
            f"noise_mechanism='blt' is not supported in {where} yet (it needs fixed-order batches and "
            "its own accounting, available in PyTorch: adaclip_torch with FixedOrderBatchSampler); use "
            "'independent' or 'banded'"
        )
