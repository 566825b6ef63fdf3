"""User-level DP aggregation of client updates (DP-FedAvg / DP-FedSGD), in NumPy.

This module is the in-process reference of one federated round's release; the Flower
strategy wrappers (:mod:`adaclip_flower.server`) and client mod (:mod:`adaclip_flower.mods`)
call it and nothing else does the maths.

**The round.** ``U`` users; each joins a round independently with probability ``q`` (Poisson
sampling). Sampled user ``k`` trains locally from the global model ``θ`` and sends
``θ_k``; its *update* is ``Δ_k = θ_k − θ``, one array per model tensor. With the clipping
strategy's public transform ``(a, b)`` (a centre and a per-coordinate scale, learned from
earlier *released* aggregates only — flat clipping is ``a = 0, b = S``):

.. math::

    w_k = \\frac{Δ_k − a}{b},\\qquad
    \\bar w_k = w_k \\min\\Big(1, \\frac{1}{\\lVert w_k\\rVert}\\Big)\\quad(\\text{per clip group}),

and with user weights ``ω_k = \\min(n_k/ŵ, 1) ∈ [0, 1]`` (``n_k`` the user's examples, ``ŵ``
the cap; ``ω_k = 1`` without a cap) the released mean update is

.. math::

    \\tilde Δ = a + b \\odot \\frac{\\sum_k ω_k \\bar w_k + σ z}{q W}
    \\qquad\\text{(fixed denominator)},

    \\tilde Δ = a + b \\odot \\Big(\\frac{\\sum_k ω_k \\bar w_k}{\\max(q W_{\\min}, \\sum_k ω_k)}
    + \\frac{2σ z}{q W_{\\min}}\\Big)
    \\qquad\\text{(clipped denominator)},

``z ~ N(0, I)`` drawn once per round, ``W`` the total weight of all users (``U`` for unit
weights) and ``W_min ≤ W`` a floor. The clipped-denominator form is the core's release with
sum ``Σ_k ω_k \\bar w_k · qW_min / max(qW_min, Σ_k ω_k)``, noise multiplier ``2σ`` and
``B̄ = qW_min``.

**Privacy argument.** Adding or removing one user changes ``Σ_k ω_k \\bar w_k`` by a vector
of norm at most ``ω_k ≤ 1`` in the transformed space, which the transform ``(a, b)`` does
not depend on (it is a function of earlier releases). The fixed-denominator release is
therefore the sampled Gaussian mechanism with noise multiplier ``σ`` at rate ``q``; the
clipped-denominator estimate changes by at most ``2/(qW_min)`` (McMahan et al., *Learning
differentially private recurrent language models*, 2018) and gets noise ``σ`` times that.
Either way the accountant records ``(q, σ)`` per round. The strategy's state is updated from
``\\tilde Δ`` and the old state only. A user whose update is missing, non-finite or of the
wrong shape contributes exactly nothing (its weight is set to 0): that is a change within
the sensitivity, so handling it neither raises nor reveals which users were sampled.

**Banded correlated noise** (``noise_mechanism``, :mod:`adaclip.correlated`): the gradient
entries of ``z`` are replaced by ``x_t = (z_t − Σ_{j≥1} c_j x_{t−j})/c_0`` of the round's place
``t`` in the run (:func:`correlate_noise`; the buffers ``x_{t−1}, …`` are the caller's secret
state), the auxiliary sums keep fresh draws, and adaptive strategies subtract ``σ²·v_t``
(``noise_variance``). Users must then be sampled cyclically (:attr:`UserLevelMechanism.bands`
groups, rate ``p = b·q``) and the run is accounted as ``⌈T/b⌉`` compositions at ``(p, σ)``.

**Client-side noise** (secure-aggregation compatible): each of the ``n`` sampled users clips
its own update with the public transform and adds ``N(0, σ²/n)`` per coordinate in the
transformed space, so the sum of the ``n`` shares carries exactly ``σ²``. Shares that do not
arrive (a dropout, a rejected reply) are made up by the server: it adds
``N(0, σ²·(n − m)/n)`` for ``m`` shares received, never less noise than ``σ²`` in total.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
from collections.abc import Sequence
from typing import Any

import numpy as np

from adaclip import estimators as _estimators
from adaclip import strategies as _strategies
from adaclip import transform as _transform
from adaclip.correlated.blt import refuse_blt
from adaclip.correlated.mechanism import (
    BandedNoise,
    NoiseStreamState,
    resolve_noise_mechanism,
)
from adaclip.errors import InvalidHyperparameterError
from adaclip.options import finite_positive
from adaclip.strategies import ClipState, Strategy

__all__ = [
    "ESTIMATORS",
    "UserLevelMechanism",
    "make_noise_mechanism",
    "correlate_noise",
    "ValidUpdates",
    "stack_updates",
    "noise_generator",
    "standard_normal_like",
    "aggregate_updates",
    "client_noise_std",
    "clip_and_noise_update",
    "release_client_sums",
    "missing_share_noise_multiplier",
]

#: The estimators of a weighted average over sampled users (:mod:`adaclip.estimators`).
ESTIMATORS = _estimators.ESTIMATORS


@dataclasses.dataclass(frozen=True)
class UserLevelMechanism:
    """The hyperparameters of one user-level DP release per round.

    Args:
      clipping: a strategy of :mod:`adaclip.strategies` (flat, per-layer, scaled, AdaCliP and
        its options, automatic, quantile); it clips each user's update in its transformed
        space.
      noise_multiplier: ``σ ≥ 0`` (``0`` only for testing: no privacy).
      sample_rate: ``q ∈ (0, 1]``, the probability that a user joins a round.
      num_users: ``U``, the number of users in the population.
      estimator: ``"fixed"`` (unbiased, sensitivity ``1/(qW)``) or ``"clipped"`` (lower
        variance when the sampled weight varies, sensitivity ``2/(qW_min)``).
      weight_cap: ``ŵ``: users are weighted ``min(n_k/ŵ, 1)`` by their number of examples
        ``n_k``; ``None`` (default): every user weighs 1.
      total_weight: ``W``, the total weight of all users. Defaults to ``num_users`` (right for
        unit weights; with a cap, pass your estimate of ``Σ_k min(n_k/ŵ, 1)`` — it must not
        be computed from the users' private counts without privacy).
      min_total_weight: ``W_min`` of the clipped denominator (default ``total_weight``).
      noise_mechanism: ``None`` (default): independent noise every round (DP-FedAvg as in
        McMahan et al.); or a :class:`adaclip.correlated.BandedNoise` with ``b`` bands (see
        :func:`make_noise_mechanism`): banded correlated noise, which needs cyclic Poisson
        sampling of the users (``b`` groups, rate ``p = b·q``; ``b·q ≤ 1`` is checked here)
        and is accounted as one composition at ``(p, σ)`` per cycle of ``b`` rounds.
    """

    clipping: Strategy
    noise_multiplier: float
    sample_rate: float
    num_users: int
    estimator: str = "fixed"
    weight_cap: float | None = None
    total_weight: float | None = None
    min_total_weight: float | None = None
    noise_mechanism: BandedNoise | None = None
    _release: _estimators.EstimatorRelease = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("transform", "clip_groups", "init", "update"):
            if not callable(getattr(self.clipping, name, None)):
                raise InvalidHyperparameterError(
                    f"clipping must be a strategy of adaclip.strategies (FlatClipping, AdaptiveClipping, …), "
                    f"got {self.clipping!r}"
                )
        sigma = float(self.noise_multiplier)
        if isinstance(self.noise_multiplier, bool) or not math.isfinite(sigma) or sigma < 0:
            raise InvalidHyperparameterError(f"noise_multiplier must be finite and >= 0, got {self.noise_multiplier!r}")
        object.__setattr__(self, "noise_multiplier", sigma)
        object.__setattr__(self, "sample_rate", _strategies.validate_sample_rate(self.sample_rate))
        if isinstance(self.num_users, bool) or not isinstance(self.num_users, (int, np.integer)) or self.num_users < 1:
            raise InvalidHyperparameterError(f"num_users must be a positive int, got {self.num_users!r}")
        total = float(self.num_users) if self.total_weight is None else self.total_weight
        release = _estimators.estimator_release(
            self.estimator, sample_rate=self.sample_rate, total_weight=total, min_total_weight=self.min_total_weight
        )
        if self.weight_cap is not None:
            object.__setattr__(self, "weight_cap", finite_positive("weight_cap", self.weight_cap))
        object.__setattr__(self, "total_weight", finite_positive("total_weight", total))
        floor = self.total_weight if self.min_total_weight is None else self.min_total_weight
        object.__setattr__(self, "min_total_weight", finite_positive("min_total_weight", floor))
        object.__setattr__(self, "_release", release)
        weighted = self.weight_cap is not None or self.estimator == "clipped"
        if weighted and getattr(self.clipping, "num_auxiliary", 0):
            raise InvalidHyperparameterError(
                "strategies with an auxiliary count (the quantile rule) need unit weights and the fixed "
                "denominator: their count is normalised by the expected number of users"
            )
        if self.noise_mechanism is not None:
            if not isinstance(self.noise_mechanism, BandedNoise):
                raise InvalidHyperparameterError(
                    f"noise_mechanism must be None or an adaclip.correlated.BandedNoise, got {self.noise_mechanism!r}"
                )
            self.noise_mechanism.accounting(self.sample_rate)  # refuses b·q > 1

    @property
    def bands(self) -> int:
        """``b``: the number of bands of the noise and of sampling groups (1: independent noise)."""
        return 1 if self.noise_mechanism is None else self.noise_mechanism.bands

    @property
    def accounted_sample_rate(self) -> float:
        """The rate the accountant records: ``q`` with independent noise, ``p = b·q`` (the rate
        within the round's group) with banded noise."""
        if self.noise_mechanism is None:
            return self.sample_rate
        return self.noise_mechanism.accounting(self.sample_rate).rate

    def opens_cycle(self, index: int) -> bool:
        """Whether the round at place ``index`` (0-based, counted in released rounds) opens a
        cycle of ``b`` rounds: the accountant records one composition then (every round with
        independent noise)."""
        return index % self.bands == 0

    @property
    def expected_batch_size(self) -> float:
        """``B̄`` of the core's release: ``qW`` (fixed) or ``qW_min`` (clipped), the estimator's
        denominator (:func:`adaclip.estimators.estimator_release`)."""
        return self._release.denominator

    @property
    def release_noise_multiplier(self) -> float:
        """The multiplier of ``z`` on the core's sum: ``σ`` (fixed) or ``2σ`` (clipped), the
        estimator's sensitivity factor times ``σ``."""
        return self._release.sensitivity_factor * self.noise_multiplier

    def user_weights(self, num_examples: Sequence[Any] | None, count: int) -> np.ndarray:
        """``ω_k``: ``min(n_k/ŵ, 1)`` with a cap, else ones. An invalid ``n_k`` (negative,
        non-finite, not a number) gives weight 0: that user contributes nothing."""
        if self.weight_cap is None:
            return np.ones(count)
        if num_examples is None or len(num_examples) != count:
            raise InvalidHyperparameterError("weight_cap needs one num_examples entry per update")
        return _estimators.capped_user_weights(num_examples, weight_cap=self.weight_cap, invalid="zero")


@dataclasses.dataclass(frozen=True)
class ValidUpdates:
    """Client updates stacked per tensor: ``stacked[j]`` is ``(n, *shape_j)`` float64, and
    ``valid[k]`` says whether update ``k`` had the right tensors, shapes and finite values
    (invalid rows are zeros and must be given weight 0)."""

    stacked: list[np.ndarray]
    valid: np.ndarray


def stack_updates(updates: Sequence[Sequence[Any] | None], like: Sequence[np.ndarray]) -> ValidUpdates:
    """Stack the users' updates (one list of arrays each, ``None`` for a missing one) per
    tensor, in float64, checking each against the tensors of ``like`` (count, shape, finite).

    Never raises on a bad update: it gets a zero row and ``valid = False``."""
    n = len(updates)
    stacked = [np.zeros((n,) + tuple(np.shape(t)), dtype=np.float64) for t in like]
    valid = np.zeros(n, dtype=bool)
    for k, update in enumerate(updates):
        try:
            if update is None or len(update) != len(like):
                continue
            rows = [np.asarray(u, dtype=np.float64) for u in update]
            if any(r.shape != s.shape[1:] for r, s in zip(rows, stacked, strict=True)):
                continue
            if not all(np.isfinite(r).all() for r in rows):
                continue
        except (TypeError, ValueError, OverflowError):
            continue
        for s, r in zip(stacked, rows, strict=True):
            s[k] = r
        valid[k] = True
    return ValidUpdates(stacked, valid)


def noise_generator(seed: int | None = None) -> np.random.Generator:
    """A NumPy generator for the release's noise: seeded from the OS's randomness
    (:func:`secrets.randbits`, 128 bits) unless a ``seed`` is given (experiments only: a known
    seed predicts the noise)."""
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0):
        raise InvalidHyperparameterError(f"seed must be a non-negative int or None, got {seed!r}")
    return np.random.default_rng(secrets.randbits(128) if seed is None else int(seed))


def standard_normal_like(arrays: Sequence[np.ndarray], rng: np.random.Generator, extra: int = 0) -> list[np.ndarray]:
    """One ``N(0, I)`` float64 array per entry of ``arrays`` (its shape), then ``extra`` 0-d
    draws (the strategy's auxiliary sums)."""
    out = [rng.standard_normal(np.shape(a)) for a in arrays]
    return out + [np.asarray(rng.standard_normal()) for _ in range(extra)]


def make_noise_mechanism(noise_mechanism: Any = "independent", bands: Any = None) -> BandedNoise | None:
    """``None`` for independent noise, else the :class:`adaclip.correlated.BandedNoise` asked
    for (:func:`adaclip.correlated.resolve_noise_mechanism`)."""
    refuse_blt(noise_mechanism, where="the Flower aggregation")
    return resolve_noise_mechanism(noise_mechanism, bands)


def correlate_noise(
    mechanism: UserLevelMechanism, stream: NoiseStreamState, noise: Sequence[np.ndarray]
) -> tuple[list[np.ndarray], float, NoiseStreamState]:
    """The round's noise under the mechanism's noise: ``x_t`` (banded, from the stream's
    buffers) on the gradient entries of ``noise`` (:func:`standard_normal_like`'s fresh
    draws), the auxiliary entries unchanged. Returns ``(noise, v_t, next_stream)``: the
    per-coordinate variance ``v_t`` to pass to :func:`aggregate_updates` as
    ``noise_variance``, and the stream to keep once the round is released. Independent noise:
    the draws unchanged, ``1.0`` and the same stream.

    ``stream`` and ``next_stream`` hold past noise: as secret as the generator's state (from
    them and the releases, past sums follow)."""
    if mechanism.noise_mechanism is None:
        return list(noise), 1.0, stream
    num = len(noise) - int(getattr(mechanism.clipping, "num_auxiliary", 0))
    variance = mechanism.noise_mechanism.variance(stream.step)
    x, next_stream = mechanism.noise_mechanism.correlate(stream, list(noise[:num]))
    return list(x) + list(noise[num:]), variance, next_stream


def _transformed(mechanism: UserLevelMechanism, state: ClipState, num: int) -> tuple[Any, Any]:
    return mechanism.clipping.transform(state, num)


def aggregate_updates(
    mechanism: UserLevelMechanism,
    state: ClipState,
    updates: ValidUpdates,
    *,
    weights: np.ndarray | None = None,
    noise: Sequence[np.ndarray] | None,
    noise_variance: float = 1.0,
) -> tuple[list[np.ndarray], ClipState]:
    """One round's release from the users' raw updates (server-side clipping).

    Args:
      mechanism: the round's hyperparameters.
      state: the clipping strategy's state (from ``mechanism.clipping.init`` and earlier
        releases).
      updates: :func:`stack_updates` of the sampled users' updates (possibly none).
      weights: ``ω_k ∈ [0, 1]`` per update (``mechanism.user_weights``); ``None``: ones.
        Invalid updates get weight 0 whatever is given.
      noise: standard-normal draws shaped like the tensors, then ``num_auxiliary`` 0-d draws
        (:func:`standard_normal_like`), or with banded noise the :func:`correlate_noise` of
        those draws; ``None`` only when ``σ = 0``.
      noise_variance: ``v_t``, the per-coordinate variance of the gradient entries of
        ``noise`` (1 for fresh draws; :func:`correlate_noise` gives it for banded noise).
        Adaptive strategies subtract ``σ²·v_t`` from what they learn.

    Returns:
      ``(mean_update, new_state)``: ``Δ̃`` per tensor (float64) and the strategy's next state.
    """
    if noise is None and mechanism.noise_multiplier > 0:
        raise InvalidHyperparameterError("noise is required when noise_multiplier > 0")
    n = updates.valid.shape[0]
    omega = np.ones(n) if weights is None else np.asarray(weights, dtype=np.float64)
    if omega.shape != (n,) or not np.all((omega >= 0) & (omega <= 1)):
        raise InvalidHyperparameterError("weights must be one value in [0, 1] per update")
    omega = np.where(updates.valid, omega, 0.0)
    num = len(updates.stacked)
    transformed = _transformed(mechanism, state, num)
    summed = _strategies.clip_and_sum(
        mechanism.clipping,
        state,
        updates.stacked,
        transformed=transformed,
        unit_mask=updates.valid,
        unit_weights=omega,
    )
    if mechanism.estimator == "clipped":
        shrink = _estimators.clipped_denominator_shrink(float(np.sum(omega)), denominator=mechanism.expected_batch_size)
        summed = [s * shrink for s in summed[:num]] + list(summed[num:])
    return _strategies.release(
        mechanism.clipping,
        state,
        summed,
        None if mechanism.noise_multiplier == 0 else noise,
        noise_multiplier=mechanism.release_noise_multiplier,
        expected_batch_size=mechanism.expected_batch_size,
        transformed=transformed,
        noise_variance=noise_variance,
    )


# --------------------------------------------------------------------------- client-side noise


def client_noise_std(noise_multiplier: float, num_sampled: int) -> float:
    """The standard deviation of each of ``n`` clients' noise shares (transformed space):
    ``σ/√n``, so that ``n`` shares sum to variance ``σ²``."""
    if num_sampled < 1:
        raise InvalidHyperparameterError(f"num_sampled must be >= 1, got {num_sampled!r}")
    return float(noise_multiplier) / math.sqrt(num_sampled)


def missing_share_noise_multiplier(noise_multiplier: float, num_sampled: int, num_received: int) -> float:
    """The server's make-up noise multiplier when only ``m`` of ``n`` shares arrived:
    ``σ·√((n − m)/n)`` (``σ`` when nobody was sampled), so the release carries ``σ²``."""
    if num_sampled == 0:
        return float(noise_multiplier)
    if not 0 <= num_received <= num_sampled:
        raise InvalidHyperparameterError("num_received must be in [0, num_sampled]")
    return float(noise_multiplier) * math.sqrt((num_sampled - num_received) / num_sampled)


class _PublicGroups:
    """The clip groups of a strategy, as sent to a client: ``clip_groups`` and the default
    clip factors ``min(1, r/‖w‖)`` (the core's :func:`group_clip_factors` needs nothing else)."""

    def __init__(self, groups: Sequence[tuple[Sequence[int], float]]):
        self._groups = [(list(m), float(r)) for m, r in groups]

    def clip_groups(self, num_tensors: int) -> list[tuple[list[int], float]]:
        return self._groups

    def clip_factors(self, sq_norm: Any, radius: float) -> Any:
        return _transform.clip_factors(sq_norm, radius)


def clip_and_noise_update(
    update: Sequence[np.ndarray],
    centre: Sequence[np.ndarray] | None,
    scale: Sequence[Any],
    groups: Sequence[tuple[Sequence[int], float]],
    *,
    weight: float = 1.0,
    noise_std: float,
    rng: np.random.Generator,
) -> list[np.ndarray]:
    """A client's noisy, clipped contribution in the transformed space:
    ``ω·\\bar w + (σ/√n)·z``, ``\\bar w`` the update clipped with the public transform and
    clip groups (the same core functions as the server-side path, on a batch of one). A
    non-finite update contributes ``0`` plus its noise share: it is dropped, not refused, so
    the reply looks the same as any other."""
    if not 0.0 <= float(weight) <= 1.0:
        raise InvalidHyperparameterError(f"weight must be in [0, 1], got {weight!r}")
    rows = [np.asarray(u, dtype=np.float64)[None] for u in update]
    sq = _transform.transformed_sq_norms(rows, centre, scale)
    factors = _strategies.group_clip_factors(_PublicGroups(groups), sq)
    factors = [c * float(weight) for c in factors]
    nonfinite = _transform.nonfinite_units(sq)
    summed = _transform.clipped_sum(rows, centre, scale, factors, nonfinite=nonfinite)
    return [s + noise_std * rng.standard_normal(s.shape) for s in summed]


def release_client_sums(
    mechanism: UserLevelMechanism,
    state: ClipState,
    noisy_sum: Sequence[np.ndarray],
    *,
    make_up_noise: Sequence[np.ndarray] | None,
    make_up_multiplier: float,
) -> tuple[list[np.ndarray], ClipState]:
    """Release from the sum of the clients' noisy contributions (client-side clipping):
    add the make-up noise for missing shares, rescale with the public transform, and update
    the strategy's state (the core's release with the noise already in the sum)."""
    if mechanism.estimator != "fixed" or getattr(mechanism.clipping, "num_auxiliary", 0):
        raise InvalidHyperparameterError("client-side noise supports the fixed denominator without auxiliary sums")
    total = [np.asarray(s, dtype=np.float64) for s in noisy_sum]
    if make_up_multiplier > 0:
        if make_up_noise is None:
            raise InvalidHyperparameterError("make_up_noise is required when make_up_multiplier > 0")
        total = [t + make_up_multiplier * z for t, z in zip(total, make_up_noise, strict=True)]
    return _strategies.release(
        mechanism.clipping,
        state,
        total,
        None,
        noise_multiplier=mechanism.noise_multiplier,
        expected_batch_size=mechanism.expected_batch_size,
    )


