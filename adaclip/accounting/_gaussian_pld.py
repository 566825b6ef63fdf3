"""The privacy loss distribution of one Poisson-subsampled Gaussian step, built fast.

:func:`gaussian_pld` returns what dp-accounting's
``privacy_loss_distribution.from_gaussian_mechanism(σ, sampling_prob=q,
value_discretization_interval=Δ)`` returns (sensitivity 1, pessimistic estimate, connect the
dots, log-mass truncation bound −50, add-or-remove-one neighbours), computed with the same
dp-accounting code except for one function: the hockey-stick divergence ``δ(ε)`` at the grid's
privacy losses, which dp-accounting evaluates in a Python loop, one grid point at a time (about
60,000 calls for ``q = 0.005``, ``Δ = 10⁻³``, most of the time of a PLD calibration). Here it is
evaluated for the whole grid at once with NumPy, by the same formulas:

For the Gaussian mechanism with noise ``N(0, σ²)`` and sensitivity 1, subsampled at rate ``q``
(``μ`` the noise density; dp-accounting's supplementary material, and its
``GaussianPrivacyLoss``):

- *remove* (``μ_upper = q·μ(x + 1) + (1 − q)·μ(x)``, ``μ_lower = μ``): the privacy loss at
  ``x`` is at least ``ε`` exactly for ``x ≤ x(ε)`` with
  ``ε₀ = log(1 + (e^ε − 1)/q)`` (the loss without subsampling) and ``x(ε) = −1/2 − ε₀·σ²``,
  for ``ε > log(1 − q)`` (below it, ``δ = 1 − e^ε``);
- *add* (``μ_upper = μ``, ``μ_lower = q·μ(x − 1) + (1 − q)·μ(x)``):
  ``ε₀ = −log(1 + (e^{−ε} − 1)/q)`` and ``x(ε) = 1 − 1/2 − ε₀·σ²``, for
  ``ε < −log(1 − q)`` (above it, ``δ = 0``);

and ``δ(ε) = μ_upper_cdf(x(ε)) − e^ε·μ_lower_cdf(x(ε))``, clipped to ``[0, 1]``. Without
subsampling (``q = 1``) both are ``x(ε) = −1/2 − ε·σ²`` and only *remove* is built, as there.

``log(a·e^b + c)`` with ``a = 1/q``, ``c = 1 − 1/q < 0`` is computed as dp-accounting's
``log_a_times_exp_b_plus_c`` does (``d + log1p(−e^{log(−c) − d})`` with ``d = b + log a``;
``log(a + c)`` at ``b = 0``). Whether ``ε`` is at the boundary is decided by
``math.isclose``'s rule, as there.

**Privacy argument.** The result is the same pessimistic PLD as dp-accounting's, so ε computed
from it is the same upper bound: equal up to floating-point rounding in the last bits of each
``δ(ε)`` (NumPy's vectorised ``log``/``exp`` may round differently from the scalar ones;
``tests/test_accounting_pld_fast.py`` checks every probability against dp-accounting's to
1e-12 relative and the composed ε to 1e-9). The fast path uses two private functions of
dp-accounting (``_create_pld_pmf_from_monotone_privacy_loss`` and
``_pld_for_subsampled_mechanism``); where a version of dp-accounting lacks them, or a case
falls outside the formulas above (a ValueError of the scalar path), dp-accounting's
own ``from_gaussian_mechanism`` is used.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from dp_accounting.pld import privacy_loss_distribution as _pld_module
from dp_accounting.pld import privacy_loss_mechanism as _plm

from adaclip.accounting._events import _RELATION

_AdjacencyType = _plm.AdjacencyType
_create_pmf = getattr(_pld_module, "_create_pld_pmf_from_monotone_privacy_loss", None)
_subsampled = getattr(_pld_module, "_pld_for_subsampled_mechanism", None)

#: Whether the vectorised path is available with this dp-accounting (else the scalar one is used).
FAST_PATH_AVAILABLE: bool = _create_pmf is not None and _subsampled is not None


def _isclose(a: np.ndarray, b: float) -> np.ndarray:
    """``math.isclose(a, b)`` (relative tolerance 1e-9, no absolute tolerance), elementwise."""
    return np.abs(a - b) <= 1e-9 * np.maximum(np.abs(a), abs(b))


class _VectorisedGaussianPrivacyLoss(_plm.GaussianPrivacyLoss):
    """dp-accounting's ``GaussianPrivacyLoss`` with :meth:`get_delta_for_epsilon` evaluated for
    an array of ε at once (see the module docstring for the formulas)."""

    def get_delta_for_epsilon(self, epsilon: Any) -> Any:
        is_scalar = isinstance(epsilon, (int, float, np.floating, np.integer))
        epsilons = np.array([epsilon], dtype=float) if is_scalar else np.asarray(epsilon, dtype=float)
        q = self.sampling_prob
        s = self.sensitivity
        var = self._standard_deviation**2
        deltas = np.zeros_like(epsilons, dtype=float)
        if q == 1.0:  # no subsampling: add and remove are the same, the loss is linear in x
            x = -0.5 * s - epsilons * var / s
            deltas = np.clip(self.mu_upper_cdf(x) - np.exp(epsilons + self.mu_lower_log_cdf(x)), 0, 1)
            return float(deltas[0]) if is_scalar else deltas
        if self.adjacency_type == _AdjacencyType.ADD:
            inverse = epsilons < -math.log1p(-q)
        elif self.adjacency_type == _AdjacencyType.REMOVE:
            inverse = epsilons > math.log1p(-q)
            deltas[~inverse] = -np.expm1(epsilons[~inverse])
        else:  # pragma: no cover - only add/remove are built here
            raise ValueError(f"{self.adjacency_type} adjacency type is not supported here")
        eps = epsilons[inverse]
        a = 1 / q
        c = 1 - 1 / q  # < 0 for q < 1
        log_a, log_minus_c = np.log(a), np.log(-c)
        if self.adjacency_type == _AdjacencyType.ADD:
            boundary = -math.log(1 - q)
            if np.any((eps > boundary) & ~_isclose(eps, boundary)):  # pragma: no cover - as the scalar path
                raise ValueError("privacy loss larger than -log(1 - sampling_prob)")
            b = -eps
        else:
            boundary = math.log(1 - q)
            if np.any((eps <= boundary) & ~_isclose(eps, boundary)):  # pragma: no cover - as the scalar path
                raise ValueError("privacy loss smaller than log(1 - sampling_prob)")
            b = eps
        d = b + log_a
        with np.errstate(divide="ignore", invalid="ignore"):
            loss = d + np.log1p(-np.exp(log_minus_c - d))  # log(a·e^b + c)
        loss = np.where(b == 0, np.log(a + c), loss)
        at_boundary = _isclose(eps, boundary)
        if self.adjacency_type == _AdjacencyType.ADD:
            loss = -loss  # ε₀ = −log(a·e^{−ε} + c)
            x = s + (-0.5 * s - loss * var / s)
            x = np.where(at_boundary, -math.inf, x)  # the loss without subsampling is +∞
        else:
            x = -0.5 * s - loss * var / s
            x = np.where(at_boundary, math.inf, x)  # the loss without subsampling is −∞
        deltas[inverse] = self.mu_upper_cdf(x) - np.exp(eps + self.mu_lower_log_cdf(x))
        if not np.all(np.isfinite(deltas)):  # never hand on a NaN: the scalar path decides instead
            raise ValueError("non-finite hockey-stick divergence in the vectorised evaluation")
        deltas = np.clip(deltas, 0, 1)
        return float(deltas[0]) if is_scalar else deltas


def _scalar_pld(sigma: float, q: float, interval: float) -> _pld_module.PrivacyLossDistribution:
    return _pld_module.from_gaussian_mechanism(
        standard_deviation=sigma,
        value_discretization_interval=interval,
        sampling_prob=q,
        neighboring_relation=_RELATION,
    )


def gaussian_pld(sigma: float, q: float, interval: float) -> _pld_module.PrivacyLossDistribution:
    """The PLD of one step, as ``from_gaussian_mechanism(σ, sampling_prob=q,
    value_discretization_interval=interval)`` (see the module docstring); ``σ > 0``,
    ``0 < q <= 1``."""
    if not FAST_PATH_AVAILABLE:
        return _scalar_pld(sigma, q, interval)

    def single(adjacency: Any) -> Any:
        loss = _VectorisedGaussianPrivacyLoss(sigma, sensitivity=1, sampling_prob=q, adjacency_type=adjacency)
        return _create_pmf(loss, pessimistic_estimate=True, value_discretization_interval=interval, use_connect_dots=True)

    try:
        return _subsampled(single, q)
    except ValueError:  # a boundary case (or a non-finite value) the scalar path decides
        return _scalar_pld(sigma, q, interval)
