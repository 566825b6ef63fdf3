"""Coefficients of banded Toeplitz noise factorisations (BandMF) and their expected error.

Notation. ``n = T`` steps; ``C`` is the ``n×n`` lower-triangular Toeplitz matrix whose first
column is ``c_0 … c_{b−1}, 0, …`` (``b`` bands); its inverse is lower-triangular Toeplitz too,
with first column ``r`` (:func:`inverse_toeplitz_coefficients`). The noise is ``x = C⁻¹ z`` for
iid standard normal ``z``; with ``‖c‖₂ = 1`` one participation has sensitivity 1.

The **workload** ``A`` (lower triangular, ``n×n``) maps the gradient sequence to what training
uses. For SGD with momentum ``β`` and learning rates ``η_t`` (``m_k = β m_{k−1} + g_k``,
``θ_{t+1} = θ_0 − Σ_{k≤t} η_k m_k``)

.. math::  A_{t,s} = \\sum_{k=s}^{t} η_k β^{k-s}, \\qquad A = S\\,D\\,M,

with ``S`` the prefix-sum matrix (all-ones lower triangle), ``D = diag(η)`` and ``M`` the
lower-triangular Toeplitz matrix with first column ``β^k``. ``β = 0, η ≡ 1`` is the
**prefix-sum** workload (plain SGD, constant learning rate). The factorisation ``A = B·C``
with ``B = A C⁻¹`` releases ``C G + σ z`` and so adds ``σ B z`` to ``A G``; its expected
squared error per coordinate is ``σ²·‖A C⁻¹‖_F²``. :func:`expected_error` returns
``‖A C⁻¹‖_F² / n`` (mean over steps, per unit ``σ²``), and the figure of merit that compares
band counts is ``σ_b² · expected_error(c_b, n)`` (:func:`choose_bands`).

Computation. Lower-triangular Toeplitz matrices commute, so ``A C⁻¹ = S D H`` with ``H`` the
Toeplitz matrix whose first column ``h`` is the impulse response of the IIR filter
``1 / (c(z)(1 − βz))`` — ``O(n·b)`` with :func:`scipy.signal.lfilter`. Then

- constant learning rate ``η``: ``A C⁻¹`` is Toeplitz with first column ``u = η·cumsum(h)``
  and ``‖A C⁻¹‖_F² = Σ_k (n − k) u_k²`` — ``O(n·b)`` time and ``O(n)`` memory (``n = 10⁵`` is
  milliseconds);
- a learning-rate schedule: ``‖S D H‖_F² = hᵀ R h`` with ``R_{m,j} = Σ_{s≥0} G_{m+s, j+s}``
  and ``G_{a,b} = η_a η_b (n − max(a, b))``. ``R`` depends on ``η`` only; it is built once as a
  dense matrix for ``n ≤ 4096`` (``8·n²`` bytes, 134 MB at 4096) and then every evaluation is
  one matrix-vector product; above that its rows are regenerated on the fly (``O(n²)`` time,
  ``O(n)`` memory per evaluation: about 0.5 s at ``n = 10⁴``).

The gradient with respect to ``c`` is analytic: ``∂h/∂c_j = −Z^j C⁻¹ h`` (``Z`` the shift), so
with ``λ = ∂‖A C⁻¹‖_F²/∂h`` the gradient is ``−Σ_m λ_m q_{m−j}`` with ``q = C⁻¹ h`` — one more
filter pass.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable, Iterable
from typing import Any, Literal

import numpy as np

from adaclip.errors import InvalidHyperparameterError
from adaclip.options import positive_int

__all__ = [
    "Workload",
    "sqrt_toeplitz_coefficients",
    "inverse_toeplitz_coefficients",
    "noise_variances",
    "adaptive_lr_scale",
    "prefix_sum_workload",
    "momentum_workload",
    "expected_error",
    "optimise_banded_coefficients",
    "choose_bands",
]

Workload = Literal["prefix", "momentum"]

#: Largest ``n`` for which a learning-rate schedule's quadratic form ``R`` is kept as a dense
#: ``n×n`` matrix (``8·n²`` bytes); above it the rows are regenerated at every evaluation.
_DENSE_SCHEDULE_MAX_N = 4096

#: Default iteration cap of :func:`optimise_banded_coefficients` (L-BFGS-B iterations).
DEFAULT_MAX_ITER = 500


# --------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------




def _real(name: str, value: Any) -> float:
    if isinstance(value, (bool, str, bytes)) or not isinstance(value, numbers.Real):
        raise InvalidHyperparameterError(f"{name} must be a real number, got {value!r}")
    return float(value)


def _coefficients(c: Any, name: str = "coefficients") -> np.ndarray:
    """``c`` as a float64 1-d array with finite entries and ``c_0 > 0``."""
    if np.iscomplexobj(c):
        raise InvalidHyperparameterError(f"{name} must be real, got {c!r}")
    try:
        arr = np.array(c, dtype=np.float64)
    except (TypeError, ValueError):
        raise InvalidHyperparameterError(
            f"{name} must be a 1-d sequence of real numbers, got {c!r}"
        ) from None
    if arr.ndim != 1 or arr.size == 0:
        raise InvalidHyperparameterError(f"{name} must be a non-empty 1-d sequence, got shape {arr.shape}")
    if not np.all(np.isfinite(arr)):
        raise InvalidHyperparameterError(f"{name} must be finite, got {arr.tolist()}")
    if not arr[0] > 0:
        raise InvalidHyperparameterError(f"{name}[0] (c_0) must be > 0, got {arr[0]!r}")
    return arr


def _momentum(value: Any) -> float:
    beta = _real("momentum", value)
    if not (math.isfinite(beta) and 0.0 <= beta < 1.0):
        raise InvalidHyperparameterError(f"momentum must be in [0, 1), got {value!r}")
    return beta


def _learning_rates(value: Any, n: int) -> float | np.ndarray:
    """A positive scalar (constant learning rate) or a length-``n`` array (a schedule).

    A schedule whose entries are all equal is returned as a scalar (the fast Toeplitz path).
    """
    if value is None:
        return 1.0
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        eta = float(value)
        if not (math.isfinite(eta) and eta > 0):
            raise InvalidHyperparameterError(f"learning_rates must be finite and > 0, got {value!r}")
        return eta
    if isinstance(value, (bool, str, bytes)) or np.iscomplexobj(value):
        raise InvalidHyperparameterError(f"learning_rates must be a number or a 1-d array, got {value!r}")
    try:
        arr = np.array(value, dtype=np.float64)
    except (TypeError, ValueError):
        raise InvalidHyperparameterError(
            f"learning_rates must be a number or a 1-d array, got {value!r}"
        ) from None
    if arr.ndim == 0:
        return _learning_rates(float(arr), n)
    if arr.ndim != 1 or arr.size != n:
        raise InvalidHyperparameterError(
            f"learning_rates must have one entry per step (shape ({n},)), got shape {arr.shape}"
        )
    if not np.all(np.isfinite(arr)) or np.any(arr < 0):
        raise InvalidHyperparameterError("learning_rates must be finite and >= 0")
    if not np.any(arr > 0):
        raise InvalidHyperparameterError("learning_rates must not all be 0")
    if np.all(arr == arr[0]):
        return float(arr[0])
    return arr


def _workload(workload: Any, momentum: Any, learning_rates: Any, n: int) -> tuple[float, float | np.ndarray]:
    """``(β, η)`` of a workload: ``prefix`` is ``β = 0``; ``momentum`` uses ``momentum``."""
    if workload not in ("prefix", "momentum"):
        raise InvalidHyperparameterError(f"workload must be 'prefix' or 'momentum', got {workload!r}")
    beta = _momentum(momentum)  # validated for both, used only by "momentum"
    eta = _learning_rates(learning_rates, n)
    return (beta if workload == "momentum" else 0.0), eta


def _check_n_vs_bands(n: int, bands: int) -> None:
    if n < bands:
        raise InvalidHyperparameterError(
            f"n (the number of steps) must be >= bands, got n={n}, bands={bands}"
        )


# --------------------------------------------------------------------------------------
# coefficients
# --------------------------------------------------------------------------------------


def _impulse_response(a: np.ndarray, n: int) -> np.ndarray:
    """The first ``n`` coefficients of the power series ``1 / a(z)`` (``a_0 ≠ 0``), exactly."""
    import scipy.signal  # lazy: SciPy costs 1-2 s at import; only filtering coefficients needs it

    impulse = np.zeros(n)
    impulse[0] = 1.0
    with np.errstate(over="ignore", invalid="ignore"):
        return scipy.signal.lfilter([1.0], a, impulse)


#: Entries of an internal filter output below this fraction of its largest magnitude are set
#: to 0 (and filtering stops once the filter's state is that small and the input is over): they
#: change ``‖A C⁻¹‖_F²`` by far less than rounding does, and a slowly decaying response would
#: otherwise run through subnormal numbers for thousands of steps, which is ~10–50× slower.
_FLUSH = 1e-150
_CHUNK = 4096


def _fast_filter(a: np.ndarray, x: np.ndarray) -> np.ndarray:
    """``lfilter([1], a, x)`` (``C⁻¹``-type solve) in chunks, with a negligible tail flushed to 0.

    A non-finite output (an unstable ``1/a(z)`` overflowing) is returned as it stands.
    """
    import scipy.signal  # lazy: SciPy costs 1-2 s at import; only filtering coefficients needs it

    n = x.size
    nonzero = np.flatnonzero(x)
    input_end = int(nonzero[-1]) + 1 if nonzero.size else 0
    y = np.zeros(n)
    zi = np.zeros(a.size - 1)
    peak = 0.0
    with np.errstate(over="ignore", invalid="ignore"):
        for start in range(0, n, _CHUNK):
            stop = min(n, start + _CHUNK)
            if zi.size:
                seg, zi = scipy.signal.lfilter([1.0], a, x[start:stop], zi=zi)
            else:
                seg = x[start:stop] / a[0]
            y[start:stop] = seg
            peak = max(peak, float(np.max(np.abs(seg))))
            if not math.isfinite(peak):
                return y
            if stop >= input_end and (not zi.size or float(np.max(np.abs(zi))) < _FLUSH * peak):
                break
    y[np.abs(y) < _FLUSH * peak] = 0.0
    return y


def sqrt_toeplitz_coefficients(bands: int) -> np.ndarray:
    """The truncated square root of the prefix-sum matrix, normalised to unit ℓ2 norm.

    ``S = E²`` for the lower-triangular Toeplitz ``E`` with first column
    ``c_k = binom(2k, k) / 4^k`` (the power series of ``(1 − z)^{−1/2}``); this keeps
    ``c_0 … c_{b−1}`` and divides by their ℓ2 norm, so ``‖c‖₂ = 1``. ``b = 1`` gives ``[1.0]``
    (DP-SGD). The ``c_k`` are positive and strictly decreasing, so (Eneström–Kakeya) ``c(z)``
    has no zero in the closed unit disc and the inverse coefficients decay.
    """
    b = positive_int("bands", bands)
    k = np.arange(1, b, dtype=np.float64)
    c = np.concatenate(([1.0], np.cumprod((2.0 * k - 1.0) / (2.0 * k))))  # binom(2k,k)/4^k
    return c / np.linalg.norm(c)


def inverse_toeplitz_coefficients(c: Any, n: int) -> np.ndarray:
    """The first ``n`` coefficients ``r`` of ``C⁻¹`` (lower-triangular Toeplitz as well).

    ``r_0 = 1/c_0`` and ``r_k = −(Σ_{j=1}^{min(k, b−1)} c_j r_{k−j}) / c_0``: the impulse
    response of the IIR filter ``1 / c(z)``, computed by :func:`scipy.signal.lfilter` in
    ``O(n·b)``. It is numerically stable (``r`` bounded) when ``c(z)`` has no zero in the closed
    unit disc — e.g. for :func:`sqrt_toeplitz_coefficients`; otherwise ``r`` grows
    geometrically, which is the true inverse, not a rounding artefact. ``n`` may be smaller
    than ``len(c)``.
    """
    arr = _coefficients(c)
    return _impulse_response(arr, positive_int("n", n))


def noise_variances(c: Any, n: int) -> np.ndarray:
    """Per-coordinate variance of the noise ``x_t`` for ``t = 0 … n−1``: ``v_t = Σ_{k≤t} r_k²``.

    ``x = C⁻¹ z`` so ``x_t = Σ_{k≤t} r_k z_{t−k}``; the squared norm of row ``t`` of ``C⁻¹``.
    All ones for ``c = [1]`` (DP-SGD); non-decreasing in ``t``.
    """
    r = inverse_toeplitz_coefficients(c, n)
    return np.cumsum(r * r)


def adaptive_lr_scale(c: Any, n: int, *, sigma: float, sigma_independent: float) -> float:
    """The factor ``ρ`` by which to multiply an adaptive optimizer's learning rate when its
    releases carry banded noise instead of DP-SGD's independent noise at the same ``(ε, δ)``.

    Adam and its kin divide the first moment by ``√v̂``, a running mean of the squared
    releases. In DP training the noise usually dominates that mean (per coordinate the noise
    has standard deviation ``σ·C/B`` while the clipped signal is about ``C/√d``), so
    ``√v̂ ≈ σ_b·√v̄·C/B`` with ``v̄`` the mean over the ``n`` steps of the correlated noise's
    per-step variance :func:`noise_variances` (1 for independent noise). DP-SGD's run has
    ``√v̂ ≈ σ_1·C/B``. At the same learning rate the banded run's step on the signal is
    therefore smaller by

    .. math::  ρ = \\frac{σ_b \\sqrt{\\bar v}}{σ_1},

    and multiplying its learning rate by ``ρ`` gives it DP-SGD's step on the signal back; the
    noise it adds to the parameters is then the workload's correlated error in DP-SGD's units,
    which is what :func:`choose_bands` minimises. Without the factor, a learning rate tuned for
    DP-SGD is too small by ``ρ`` for the banded run. The rule assumes the noise dominates ``v̂``; where the signal
    does, the factor over-scales, so it is an option, not a default.

    Privacy: ``c``, ``n``, ``σ_b`` and ``σ_1`` are public (fixed before training by the target
    ``(ε, δ)``, the sampling rate and the number of steps), so the factor costs nothing.

    Args:
      c: the banded coefficients (``c = [1]`` gives ``σ_b / σ_1``).
      n: the number of steps ``T``.
      sigma: ``σ_b``, the banded run's noise multiplier.
      sigma_independent: ``σ_1``, DP-SGD's noise multiplier at the same ``(ε, δ)``, rate and ``T``.
    """
    n = positive_int("n", n)
    sigma = _real("sigma", sigma)
    sigma_independent = _real("sigma_independent", sigma_independent)
    for name, value in (("sigma", sigma), ("sigma_independent", sigma_independent)):
        if not (math.isfinite(value) and value > 0):
            raise InvalidHyperparameterError(f"{name} must be a finite number > 0, got {value!r}")
    mean_variance = float(np.mean(noise_variances(c, n)))
    return sigma * math.sqrt(mean_variance) / sigma_independent


# --------------------------------------------------------------------------------------
# workloads
# --------------------------------------------------------------------------------------


def prefix_sum_workload(n: int) -> np.ndarray:
    """The dense ``n×n`` prefix-sum workload (all-ones lower triangle): SGD, constant rate."""
    n = positive_int("n", n)
    return np.tril(np.ones((n, n)))


def momentum_workload(n: int, *, momentum: float, learning_rates: np.ndarray | float = 1.0) -> np.ndarray:
    """The dense ``n×n`` workload of SGD with momentum: ``A_{t,s} = Σ_{k=s}^{t} η_k β^{k−s}``.

    ``θ_{t+1} = θ_0 − Σ_{k≤t} η_k m_k`` with ``m_k = β m_{k−1} + g_k``; ``A = S·diag(η)·M``.
    ``O(n²)`` memory; :func:`expected_error` does not need it.
    """
    n = positive_int("n", n)
    beta = _momentum(momentum)
    eta = _learning_rates(learning_rates, n)
    eta_vec = np.broadcast_to(np.asarray(eta, dtype=np.float64), (n,))
    lag = np.subtract.outer(np.arange(n), np.arange(n))
    with np.errstate(under="ignore"):
        m = np.where(lag >= 0, beta ** np.maximum(lag, 0).astype(np.float64), 0.0)
    return np.cumsum(eta_vec[:, None] * m, axis=0)


# --------------------------------------------------------------------------------------
# the error ‖A C⁻¹‖_F² and its gradient
# --------------------------------------------------------------------------------------


def _toeplitz_quadratic(h: np.ndarray, eta: float) -> tuple[float, np.ndarray]:
    """``Φ = ‖η S H‖_F² = Σ_k (n−k) u_k²`` with ``u = η·cumsum(h)``, and ``λ = ∂Φ/∂h``."""
    n = h.size
    weights = np.arange(n, 0, -1, dtype=np.float64)  # n − k
    u = eta * np.cumsum(h)
    wu = weights * u
    phi = float(np.dot(wu, u))
    lam = 2.0 * eta * np.cumsum(wu[::-1])[::-1]
    return phi, lam


class _ScheduleQuadratic:
    """``Φ(h) = hᵀ R h = ‖S D H‖_F²`` for a learning-rate schedule ``η`` (``D = diag(η)``).

    ``R_{m,j} = tr((Z^m)ᵀ D SᵀS D Z^j) = Σ_{s≥0} G_{m+s, j+s}`` with
    ``G = D SᵀS D``, ``G_{a,b} = η_a η_b (n − max(a, b))``; row ``i`` of ``R`` is row ``i`` of
    ``G`` plus row ``i + 1`` of ``R`` shifted left by one.
    """

    def __init__(self, eta: np.ndarray) -> None:
        self.eta = eta
        self.n = eta.size
        self.dense: np.ndarray | None = None
        if self.n <= _DENSE_SCHEDULE_MAX_N:
            r = np.empty((self.n, self.n))
            for i, row in self._rows():
                r[i] = row
            self.dense = r

    def _rows(self):
        """Yield ``(i, R_i)`` for ``i = n−1 … 0`` (the yielded array is reused)."""
        n, eta = self.n, self.eta
        idx = np.arange(n)
        row = np.zeros(n)
        g = np.empty(n)
        for i in range(n - 1, -1, -1):
            np.multiply(eta, eta[i] * (n - np.maximum(idx, i)), out=g)
            row[:-1] = row[1:]
            row[-1] = 0.0
            row += g
            yield i, row

    def __call__(self, h: np.ndarray) -> tuple[float, np.ndarray]:
        if self.dense is not None:
            rh = self.dense @ h
        else:
            rh = np.empty(self.n)
            for i, row in self._rows():
                rh[i] = np.dot(row, h)
        return float(np.dot(h, rh)), 2.0 * rh


def _error_and_gradient(
    c: np.ndarray,
    n: int,
    beta: float,
    eta: float | np.ndarray,
    schedule: _ScheduleQuadratic | None,
    *,
    gradient: bool = True,
) -> tuple[float, np.ndarray | None]:
    """``Φ = ‖A C⁻¹‖_F²`` (not divided by ``n``) and ``∂Φ/∂c`` (``None`` unless ``gradient``).

    A non-finite ``Φ`` (``C⁻¹`` overflows) is returned as ``inf`` with a zero gradient.
    """
    a = np.convolve(c, [1.0, -beta]) if beta else c
    impulse = np.zeros(n)
    impulse[0] = 1.0
    h = _fast_filter(a, impulse)  # first column of H = M C⁻¹
    if not np.all(np.isfinite(h)):
        return math.inf, np.zeros_like(c)
    with np.errstate(over="ignore", invalid="ignore"):
        phi, lam = schedule(h) if schedule is not None else _toeplitz_quadratic(h, float(eta))
        if not math.isfinite(phi):
            return math.inf, np.zeros_like(c)
        if not gradient:
            return phi, None
        q = _fast_filter(c, h)  # C⁻¹ h
        # grad_j = −Σ_m λ_m q_{m−j}: windows[m] = (q_{m−b+1}, …, q_m) (zeros before q_0).
        padded = np.concatenate((np.zeros(c.size - 1), q))
        windows = np.lib.stride_tricks.sliding_window_view(padded, c.size)
        grad = -(lam @ windows)[::-1]
    if not np.all(np.isfinite(grad)):
        return math.inf, np.zeros_like(c)
    return phi, grad


def expected_error(
    c: Any,
    n: int,
    *,
    workload: Workload = "prefix",
    momentum: float = 0.9,
    learning_rates: np.ndarray | float | None = None,
) -> float:
    """Mean squared error per step, per unit ``σ²``: ``‖A C⁻¹‖_F² / n``.

    ``c``: the coefficients ``c_0 … c_{b−1}`` (``c_0 > 0``, ``b ≤ n``) — used as given: the
    sensitivity is ``‖c‖₂``, so pass unit-norm coefficients to compare factorisations.
    ``workload``: ``"prefix"`` (``A_{t,s} = Σ_{k=s}^{t} η_k``; ``momentum`` is validated but
    ignored) or ``"momentum"`` (``A_{t,s} = Σ_{k=s}^{t} η_k β^{k−s}``, ``β = momentum ∈ [0, 1)``).
    ``learning_rates``: ``None`` (1), a positive scalar, or one non-negative rate per step
    (not all 0).

    Cost: ``O(n·b)`` for a constant learning rate (any ``n``); ``O(n²)`` for a schedule (see
    the module docstring). For ``c = [1]`` and the prefix workload this is ``(n + 1)/2``.
    Returns ``inf`` when ``C⁻¹`` overflows (``c(z)`` has a zero well inside the unit disc).
    """
    arr = _coefficients(c)
    n = positive_int("n", n)
    _check_n_vs_bands(n, arr.size)
    beta, eta = _workload(workload, momentum, learning_rates, n)
    schedule = _ScheduleQuadratic(eta) if isinstance(eta, np.ndarray) else None
    phi, _ = _error_and_gradient(arr, n, beta, eta, schedule, gradient=False)
    return phi / n


# --------------------------------------------------------------------------------------
# optimisation
# --------------------------------------------------------------------------------------

#: Lower bound on ``w_0`` in the optimiser's parametrisation ``c = w/‖w‖`` (keeps ``c_0 > 0``).
_MIN_W0 = 1e-8
#: Objective value (in ``log Φ`` units) reported for a trial point whose ``C⁻¹`` overflows.
_OVERFLOW_OBJECTIVE = 1e4


@functools.lru_cache(maxsize=128)
def _optimise_cached(bands: int, n: int, beta: float, eta_key: float | bytes, max_iter: int) -> np.ndarray:
    import scipy.optimize  # lazy: SciPy costs 1-2 s at import; only fitting coefficients needs it

    start = sqrt_toeplitz_coefficients(bands)
    if bands == 1:
        start.setflags(write=False)
        return start
    eta: float | np.ndarray = (
        eta_key if isinstance(eta_key, float) else np.frombuffer(eta_key, dtype=np.float64)
    )
    schedule = _ScheduleQuadratic(eta) if isinstance(eta, np.ndarray) else None

    phi_start, _ = _error_and_gradient(start, n, beta, eta, schedule)
    best = {"phi": phi_start, "c": start}

    def objective(w: np.ndarray) -> tuple[float, np.ndarray]:
        norm = float(np.linalg.norm(w))
        c = w / norm
        phi, grad_c = _error_and_gradient(c, n, beta, eta, schedule)
        if not (math.isfinite(phi) and phi > 0):
            return _OVERFLOW_OBJECTIVE, np.zeros_like(w)
        if phi < best["phi"]:
            best["phi"], best["c"] = phi, c
        # d log Φ / dw for c = w/‖w‖: project out the radial direction.
        grad_w = (grad_c - c * np.dot(c, grad_c)) / (norm * phi)
        return math.log(phi), grad_w

    scipy.optimize.minimize(
        objective,
        start.copy(),
        jac=True,
        method="L-BFGS-B",
        bounds=[(_MIN_W0, None)] + [(None, None)] * (bands - 1),
        options={"maxiter": max_iter, "ftol": 1e-13, "gtol": 1e-10, "maxcor": 20},
    )
    result = np.array(best["c"], dtype=np.float64)
    result.setflags(write=False)
    return result


def optimise_banded_coefficients(
    bands: int,
    n: int,
    *,
    workload: Workload = "prefix",
    momentum: float = 0.9,
    learning_rates: np.ndarray | float | None = None,
    max_iter: int = DEFAULT_MAX_ITER,
) -> np.ndarray:
    """Unit-norm ``b``-band coefficients that (locally) minimise :func:`expected_error`.

    Minimises ``‖A C⁻¹‖_F²`` subject to ``‖c‖₂ = 1`` (sensitivity 1) by parametrising
    ``c = w/‖w‖`` and running L-BFGS-B on ``log ‖A C⁻¹‖_F²`` with the analytic gradient (module
    docstring) and the bound ``w_0 ≥ 1e−8`` (so ``c_0 > 0``), from
    :func:`sqrt_toeplitz_coefficients`. Returns the best point the optimiser evaluated, which
    is never worse than the square-root start (the start itself when nothing beat it); the
    result has unit norm and ``c_0 > 0``. ``b = 1`` returns ``[1.0]``.

    Deterministic (same inputs, same bits, on the same machine and BLAS thread count). Results
    are cached (an LRU cache over ``(bands, n, workload, momentum, learning rates, max_iter)``);
    every call returns a fresh copy. L-BFGS-B converges in 11–15 iterations here. Measured on a
    shared, loaded 2-core machine (range over runs; ``OPENBLAS_NUM_THREADS=1`` gives the low
    end): constant learning rate ``n = 1950, b = 16``: 0.01–0.08 s; ``n = 1950, b = 64``:
    0.01–0.02 s; ``n = 10⁴, b = 16``: 0.03 s; ``n = 10⁵, b = 16``: 0.2–0.5 s; ``n = 10⁵,
    b = 64``: 0.5–2.5 s. With a learning-rate schedule every evaluation is ``O(n²)``:
    ``n = 1950, b = 16``: 0.15–0.85 s; ``n = 4096, b = 16``: 1.3–2.1 s (about 1 s of it builds
    the dense ``R``); above 4096 each evaluation costs about ``0.5 s·(n/10⁴)²``.

    Note: the optimum trades per-step noise for less *integrated* noise — its per-step variance
    (:func:`noise_variances`) can be far above the square root's (``n = 1950, b = 16``,
    momentum 0.9: ``v_T`` ≈ 70 vs 2.5), which matters to statistics computed from single
    releases.
    """
    b = positive_int("bands", bands)
    n = positive_int("n", n)
    _check_n_vs_bands(n, b)
    iters = positive_int("max_iter", max_iter)
    beta, eta = _workload(workload, momentum, learning_rates, n)
    eta_key = eta if isinstance(eta, float) else np.ascontiguousarray(eta).tobytes()
    return _optimise_cached(b, n, beta, eta_key, iters).copy()


def choose_bands(
    *,
    candidates: Iterable[int],
    n: int,
    sigma_for_bands: Callable[[int], float],
    workload: Workload = "prefix",
    momentum: float = 0.9,
    learning_rates: np.ndarray | float | None = None,
    optimise: bool = True,
    max_iter: int = DEFAULT_MAX_ITER,
) -> tuple[int, dict[int, tuple[float, float, np.ndarray]]]:
    """Pick the number of bands ``b`` with the least expected error ``σ_b² · ‖A C_b⁻¹‖_F² / n``.

    For every candidate ``b`` (``1`` is always added: DP-SGD; each must be in ``[1, n]``):
    ``σ_b = sigma_for_bands(b)`` — the caller's calibration of the noise multiplier for the
    target ``(ε, δ)`` with ``b`` bands (``⌈T/b⌉`` compositions at rate ``b·q`` under cyclic
    Poisson sampling; return ``math.inf`` for a ``b`` that is infeasible, e.g. ``b·q > 1``) —
    and ``c_b`` = :func:`optimise_banded_coefficients` (:func:`sqrt_toeplitz_coefficients`
    with ``optimise=False`` or an infeasible ``b``). This module knows nothing about accounting.

    The choice uses public quantities only (``ε, δ, q, T``, the workload) and must be made
    before training, never from data: it is then free of privacy cost.

    Returns ``(best_b, table)`` with ``table[b] = (σ_b, σ_b² · expected_error(c_b, n), c_b)``;
    ties go to the smaller ``b``.
    """
    n = positive_int("n", n)
    if isinstance(candidates, (str, bytes)) or not isinstance(candidates, Iterable):
        raise InvalidHyperparameterError(f"candidates must be an iterable of integers, got {candidates!r}")
    bands_list = {1}
    for value in candidates:
        b = positive_int("each candidate number of bands", value)
        if b > n:
            raise InvalidHyperparameterError(f"a candidate number of bands exceeds n={n}: got {b}")
        bands_list.add(b)
    if not callable(sigma_for_bands):
        raise InvalidHyperparameterError(f"sigma_for_bands must be callable, got {sigma_for_bands!r}")
    _workload(workload, momentum, learning_rates, n)  # validate before any work

    table: dict[int, tuple[float, float, np.ndarray]] = {}
    best_b, best_err = 0, math.inf
    for b in sorted(bands_list):
        sigma = _real(f"sigma_for_bands({b})", sigma_for_bands(b))
        if math.isnan(sigma) or sigma <= 0:
            raise InvalidHyperparameterError(
                f"sigma_for_bands({b}) must be > 0 (or inf: infeasible), got {sigma!r}"
            )
        if optimise and not math.isinf(sigma):
            c = optimise_banded_coefficients(
                b, n, workload=workload, momentum=momentum, learning_rates=learning_rates, max_iter=max_iter
            )
        else:
            c = sqrt_toeplitz_coefficients(b)
        if math.isinf(sigma):
            err = math.inf
        else:
            mse = expected_error(c, n, workload=workload, momentum=momentum, learning_rates=learning_rates)
            err = sigma * sigma * mse
        table[b] = (sigma, err, c)
        if err < best_err:
            best_b, best_err = b, err
    if best_b == 0:
        raise InvalidHyperparameterError(
            "every candidate number of bands is infeasible (sigma_for_bands gave inf)"
        )
    return best_b, table
