"""White-box gradient canaries for one-run auditing of a private optimizer.

The auditor adds *m* extra units to the training data whose gradients it chooses, each
included with probability ½ independently of everything else, and watches the released noisy
gradients. The canaries are Dirac canaries in the clipping space: canary ``i`` owns one
coordinate ``j_i`` (all distinct, drawn at random), and whenever it is in a batch its gradient
is

    g_i = a + L·b ⊙ e_{j_i},     so that     w_i = (g_i − a)/b = L·e_{j_i},

where ``a`` and ``b`` are the strategy's centre and scale for that step (public: they are
functions of earlier releases only; flat clipping has ``a = 0``, ``b = C``) and ``L > 1`` the
canary norm. Every strategy of the affine family clips ``w_i`` to (at most) norm 1, so a present
canary adds (up to) ``e_{j_i}`` to the clipped sum ``Σ_u w̄_u``: the full sensitivity, in a
direction no other canary uses.

Score. A step releases ``g̃ = a + b ⊙ (Σ_u w̄_u + σ z)/B̄``. The auditor reads coordinate ``j_i``
back into the clipping space and sums over the steps it has seen:

    score_i = Σ_t (g̃_{t,j_i} − a_{t,j_i})·B̄/b_{t,j_i} = Σ_t (Σ_u w̄_{t,u,j_i} + σ z_{t,j_i}).

An included canary adds one for every step in which it was sampled (the data's Poisson rate
``q``, as for any other unit, so the accountant's ε is the right yardstick); an excluded one adds
nothing. The data's own clipped gradients add to every coordinate, a common nuisance that only
costs power. Because each canary owns its coordinate and the noise is independent across
coordinates, the m scores are m looks at the mechanism in one training run.

Training reacts to a canary: its parameter moves, and where the loss depends on that coordinate
the data's gradients pull it back, so in a model that learns an included canary's score is
damped by the data's response. The bound stays valid (the inclusions are coins the training
never sees) but loses power; to audit the mechanism rather than the model, audit a run whose
wrapped optimizer has learning rate 0, or a few full-batch steps.

From scores to ε: :func:`adaclip.audit.report.audit_scores` (the one-run bound of Steinke,
Nasr & Jagielski 2023, which only needs the inclusions to be independent fair coins, and a
Gaussian-DP fit as a parametric estimate).

Privacy note: canaries are *units of the training data* — they are clipped and noised by the
mechanism like every other unit (the optimizers add them through their clipping path, never
past it). Auditing does not weaken the guarantee of the real units; it adds m fictitious ones.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from adaclip.audit.report import AuditReport, audit_scores

__all__ = ["GradientCanaries", "flatten_centre_scale"]


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _probability(name: str, value: Any, *, open_low: bool = True) -> float:
    ok = isinstance(value, (int, float, np.floating)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or not ((0 < value) if open_low else (0 <= value)) or value > 1:
        raise ValueError(f"{name} must be in (0, 1], got {value!r}")
    return float(value)


def flatten_centre_scale(
    centre: Sequence[Any] | None, scale: Sequence[Any], sizes: Sequence[int]
) -> tuple[np.ndarray, np.ndarray]:
    """``(a, b)`` as flat float64 vectors over all ``sum(sizes)`` coordinates.

    ``centre``: one array per tensor or ``None`` (no centre: zeros); ``scale``: one entry per
    tensor, an array of the tensor's size or a scalar (broadcast). Entries may be NumPy, torch
    (on any device) or JAX arrays, or Python floats.
    """
    d = int(sum(sizes))
    a = (
        np.zeros(d)
        if centre is None
        else np.concatenate([_as_numpy(x, n) for x, n in zip(centre, sizes, strict=True)])
    )
    b = np.concatenate([_as_numpy(x, n) for x, n in zip(scale, sizes, strict=True)])
    return a, b


def _as_numpy(x: Any, size: int) -> np.ndarray:
    if hasattr(x, "detach"):  # torch
        x = x.detach().cpu()
    arr = np.asarray(x, dtype=np.float64)
    return np.full(size, float(arr)) if arr.ndim == 0 else arr.reshape(-1)


class GradientCanaries:
    """m white-box Dirac canaries over ``num_params`` coordinates (see the module docstring).

    Framework-agnostic bookkeeping: which canaries are in the run, which of them a step samples,
    their gradients for that step's ``(a, b)``, and the scores read back from the release. The
    PyTorch and JAX auditors (``adaclip_torch.audit``, ``adaclip_jax.audit``) drive it.

    Args:
      num_params: ``d``, the number of privatised coordinates (``m ≤ d``: each canary owns one).
      num_canaries: ``m``. More canaries tighten the one-run bound (its ceiling grows with the
        number of correct guesses) at the cost of ``m`` extra units.
      seed: seeds the coordinates, the inclusions and the per-step sampling (the auditor's
        randomness, separate from the mechanism's noise).
      sample_rate: ``q``, the probability that an included canary is in a given step's batch;
        use the data's Poisson rate so that a canary is a unit like any other.
      canary_norm: ``L > 1``, the norm of ``w_i`` before clipping (10: clipped to 1 by any
        strategy, also automatic clipping's ``w/(‖w‖ + γ)`` comes within ``γ/L`` of it).
      inclusion_probability: ½ for the one-run bound (its theorem assumes fair coins).
    """

    def __init__(
        self,
        num_params: int,
        *,
        num_canaries: int,
        seed: int,
        sample_rate: float,
        canary_norm: float = 10.0,
        inclusion_probability: float = 0.5,
    ) -> None:
        d = _positive_int("num_params", num_params)
        m = _positive_int("num_canaries", num_canaries)
        if m > d:
            raise ValueError(
                f"num_canaries={m} exceeds num_params={d}: each Dirac canary needs a coordinate of its own"
            )
        q = _probability("sample_rate", sample_rate)
        p = _probability("inclusion_probability", inclusion_probability)
        if p >= 1:
            raise ValueError(
                "inclusion_probability must be below 1: the audit compares included and excluded canaries"
            )
        ok_norm = isinstance(canary_norm, (int, float)) and not isinstance(canary_norm, bool)
        if not ok_norm or not math.isfinite(canary_norm) or canary_norm <= 1:
            raise ValueError(
                f"canary_norm must be a finite number > 1 (so that clipping binds), got {canary_norm!r}"
            )
        from adaclip.audit.input_canaries import draw_inclusion

        rng = np.random.default_rng(seed)
        self.num_params, self.num_canaries, self.sample_rate = d, m, q
        self.canary_norm = float(canary_norm)
        #: the coordinate each canary owns (distinct)
        self.coordinates = np.sort(rng.choice(d, size=m, replace=False))
        #: which canaries are in the run (independent Bernoulli(p))
        self.included = draw_inclusion(m, seed=int(rng.integers(2**63)), probability=p)
        self._sampling = np.random.default_rng(int(rng.integers(2**63)))
        #: Σ_t of the read-back coordinate per canary
        self.scores = np.zeros(m)
        #: how often each canary was in a released step
        self.times_sampled = np.zeros(m, dtype=np.int64)
        self.steps = 0

    def sample(self) -> np.ndarray:
        """Indices of the canaries in this step's batch: included ones, each with probability
        ``q`` (a fresh draw per step)."""
        hit = self._sampling.random(self.num_canaries) < self.sample_rate
        return np.flatnonzero(hit & self.included)

    def gradients(self, indices: np.ndarray, centre: np.ndarray, scale: np.ndarray) -> np.ndarray:
        """``(len(indices), d)`` per-unit gradients ``a + L·b ⊙ e_{j_i}`` (float64) for the flat
        centre ``a`` and scale ``b`` of the step (:func:`flatten_centre_scale`)."""
        centre, scale = self._check_flat(centre, "centre"), self._check_flat(scale, "scale")
        rows = np.repeat(centre[None, :], len(indices), axis=0)
        cols = self.coordinates[np.asarray(indices, dtype=np.int64)]
        rows[np.arange(len(indices)), cols] += self.canary_norm * scale[cols]
        return rows

    def observe(
        self, released: np.ndarray, centre: np.ndarray, scale: np.ndarray, *, expected_batch_size: float,
        sampled: np.ndarray | None = None,
    ) -> None:  # fmt: skip
        """Add one release to the scores: ``(g̃_j − a_j)·B̄/b_j`` at every canary's coordinate.

        ``released``: the step's noisy gradient, flat over the ``d`` coordinates (the release
        itself, before any later transformation such as momentum or Adam); ``centre``/``scale``:
        the ``(a, b)`` the step used; ``sampled``: the indices :meth:`sample` gave for the step.
        """
        released = self._check_flat(released, "released")
        centre, scale = self._check_flat(centre, "centre"), self._check_flat(scale, "scale")
        if not (isinstance(expected_batch_size, (int, float)) and expected_batch_size > 0):
            raise ValueError(f"expected_batch_size must be positive, got {expected_batch_size!r}")
        j = self.coordinates
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            read = (released[j] - centre[j]) * float(expected_batch_size) / scale[j]
        self.scores += np.where(np.isnan(read), np.inf, read)  # a NaN release reveals everything
        if sampled is not None:
            self.times_sampled[np.asarray(sampled, dtype=np.int64)] += 1
        self.steps += 1

    def report(
        self, *, delta: float, confidence: float = 0.95, accountant_epsilon: float | None = None
    ) -> AuditReport:
        """The empirical ε of the run so far (:func:`adaclip.audit.report.audit_scores`)."""
        if self.steps == 0:
            raise ValueError("no step observed yet: audit after training")
        return audit_scores(
            self.scores,
            self.included,
            delta=delta,
            confidence=confidence,
            accountant_epsilon=accountant_epsilon,
        )

    def _check_flat(self, x: Any, name: str) -> np.ndarray:
        arr = np.asarray(x, dtype=np.float64)
        if arr.shape != (self.num_params,):
            raise ValueError(
                f"{name} must be a flat vector of {self.num_params} coordinates, got shape {arr.shape}"
            )
        return arr
