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

Banded correlated noise (``noise_coefficients=c``, ``b = len(c) > 1``; the mechanism of
:mod:`adaclip.correlated.mechanism`). The release is ``y = G + σ C⁻¹ z`` with ``C`` the banded
lower-triangular Toeplitz matrix of ``c`` (``‖c‖₂ = 1``), so two things change.

*Sampling.* The mechanism is accounted as ``⌈T/b⌉`` compositions of the Poisson-subsampled
Gaussian at rate ``p = b·q``, which holds for units that join at most one step in any ``b``
consecutive ones (cyclic Poisson sampling). Plain Poisson canaries at rate ``q`` could join two
steps less than ``b`` apart — more than the accounting covers — so the audit would measure
another mechanism. The canaries therefore follow the same rule as the data: each is assigned,
independently and uniformly at random, to one of ``b`` groups ``g_i`` (independent of its
inclusion coin), and at step ``t`` only the canaries of group ``t mod b`` can be sampled, each
with probability ``p``. :meth:`GradientCanaries.observe` refuses a sampled set that breaks the
rule.

*Score.* Read back as above, canary ``i``'s coordinate is the series ``r = s + n + σ C⁻¹ z``
(``s``: its participations, ``n``: the data's nuisance). Whitening by ``C`` gives
``C r = C s + C n + σ z``: the noise becomes white, and the optimal *linear* detector of a
signal in the direction of the slot pattern ``s_g`` (1 at the steps of group ``g``, where the
canary may participate) is the matched filter in the whitened domain,

    score_i = ⟨C r, C s_{g_i}⟩ = Σ_t w_t·c_{(t − g_i) mod b},     w_t = Σ_{k<b} c_k r_{t−k}.

It is the likelihood-ratio direction (the data's nuisance aside). Split the whitened series
into the blocks of ``b`` rows
that each slot ``u ≡ g (mod b)`` of the canary touches (column ``u`` of ``C``: ``c`` on rows
``u … u + b − 1``, disjoint blocks for distinct slots); block ``k`` is ``N(0, σ²I)`` without
the canary and, with it, ``N(c, σ²I)`` with probability ``p`` (sampled) or ``N(0, σ²I)``. The
log-likelihood ratio is ``Σ_k log(1 − p + p·exp((⟨w_k, c⟩ − ½)/σ²))``: a function of the
projections ``⟨w_k, c⟩`` only, and its derivative in the canary's strength at zero (the locally
most powerful test) is ``p/σ²·Σ_k ⟨w_k, c⟩``, the score above; for ``p = 1`` it is exactly the
log-likelihood ratio up to a constant. Summing the raw releases instead ignores the noise's
correlation across steps and is the matched filter of white noise only.

What the score may use: the group ``g_i`` is public side information (independent of the coin),
and the mechanism is DP with respect to each canary *given its group* — the accounting's
argument conditions on the assignment — so the one-run bound stays valid. It must NOT use the
canary's sampling draws: its participations (:attr:`times_sampled`) are zero for every excluded
canary, i.e. they carry the coin itself, and even the draws made for all canaries alike (before
the inclusion mask) remove the amplification by sampling that the accountant's ε relies on — a
correct run then exceeds it (``tests/test_torch_audit_banded.py`` shows it).

With ``b = 1`` (``c = [1]``, ``C = I``, one group) everything reduces to the independent-noise
audit above, draw for draw and bit for bit. The whitening starts at the later of the first
observed step and the noise stream's start (``stream_start``); an audit that starts in the
middle of a stream whitens its first ``b − 1`` steps with part of the filter only: still a valid
score (any function of the releases is), slightly less powerful.

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
      noise_coefficients: the banded noise's ``c_0 … c_{b−1}`` (unit norm, ``c_0 > 0``) when the
        audited release uses banded correlated noise; ``None`` (or ``[1.0]``): independent
        noise. With ``b > 1`` the canaries follow cyclic Poisson sampling at rate ``b·q`` in
        their group's steps (``b·q ≤ 1``) and are scored by the whitened matched filter (module
        docstring).
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
        noise_coefficients: Sequence[float] | None = None,
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
        from adaclip.correlated.mechanism import accounted_sample_rate, check_coefficients

        coefficients = (1.0,) if noise_coefficients is None else check_coefficients(noise_coefficients)
        bands = len(coefficients)
        group_rate = accounted_sample_rate(q, bands)  # refuses b·q > 1
        rng = np.random.default_rng(seed)
        self.num_params, self.num_canaries, self.sample_rate = d, m, q
        self.canary_norm = float(canary_norm)
        #: the coordinate each canary owns (distinct)
        self.coordinates = np.sort(rng.choice(d, size=m, replace=False))
        #: which canaries are in the run (independent Bernoulli(p))
        self.included = draw_inclusion(m, seed=int(rng.integers(2**63)), probability=p)
        self._sampling = np.random.default_rng(int(rng.integers(2**63)))
        #: ``b``, the noise's bands (1: independent noise)
        self.bands = bands
        #: ``c_0 … c_{b−1}`` (``[1.0]`` for independent noise)
        self.coefficients = np.asarray(coefficients, dtype=np.float64)
        #: the rate of a canary in its group's steps, ``p = b·q`` (``q`` for ``b = 1``)
        self.group_rate = group_rate
        #: each canary's group (independent, uniform; drawn after everything else, so ``b = 1``
        #: draws what it always did); ``None`` for ``b = 1``
        self.groups = None if bands == 1 else rng.integers(bands, size=m)
        # banded: the last b − 1 read-backs at the canaries' coordinates, {step: values}
        self._history: dict[int, np.ndarray] = {}
        self._first_step: int | None = None
        self._last_step: int | None = None
        #: Σ_t of the read-back coordinate per canary
        self.scores = np.zeros(m)  # banded: Σ_t w_t·c_{(t − g) mod b}, the whitened matched filter
        #: how often each canary was in a released step
        self.times_sampled = np.zeros(m, dtype=np.int64)
        self.steps = 0

    def sample(self, step: int | None = None) -> np.ndarray:
        """Indices of the canaries in this step's batch: included ones, each with probability
        ``q`` (a fresh draw per step).

        Banded noise: only the included canaries of group ``step mod b``, each with probability
        ``p = b·q``. ``step`` is the mechanism's step index (the optimizer's step count; default:
        the number of steps observed so far); it is ignored for ``b = 1``."""
        if self.bands == 1:
            hit = self._sampling.random(self.num_canaries) < self.sample_rate
            return np.flatnonzero(hit & self.included)
        t = self._step_index(step)
        hit = self._sampling.random(self.num_canaries) < self.group_rate
        return np.flatnonzero(hit & self.included & (self.groups == t % self.bands))

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
        sampled: np.ndarray | None = None, step: int | None = None, stream_start: int | None = None,
    ) -> None:  # fmt: skip
        """Add one release to the scores: the read-back ``r_j = (g̃_j − a_j)·B̄/b_j`` at every
        canary's coordinate (independent noise: added as it is; banded: whitened and matched,
        see the module docstring).

        ``released``: the step's noisy gradient, flat over the ``d`` coordinates (the release
        itself, before any later transformation such as momentum or Adam); ``centre``/``scale``:
        the ``(a, b)`` the step used; ``sampled``: the indices :meth:`sample` gave for the step.
        Banded noise only (ignored for ``b = 1``): ``step``, the step index given to
        :meth:`sample` (default: the number of steps observed so far; steps must increase);
        ``stream_start``, the step at which the mechanism's noise stream (re)started, where the
        whitening must restart too (default: the first step observed). A ``sampled`` canary
        outside its group's step is refused (``ValueError``, nothing changes): it would join
        the run more often than the banded accounting allows.
        """
        released = self._check_flat(released, "released")
        centre, scale = self._check_flat(centre, "centre"), self._check_flat(scale, "scale")
        if not (isinstance(expected_batch_size, (int, float)) and expected_batch_size > 0):
            raise ValueError(f"expected_batch_size must be positive, got {expected_batch_size!r}")
        sampled_idx = None if sampled is None else np.asarray(sampled, dtype=np.int64)
        t = None
        if self.bands > 1:
            t = self._step_index(step)
            if stream_start is not None and not (
                isinstance(stream_start, (int, np.integer)) and not isinstance(stream_start, bool) and 0 <= stream_start <= t
            ):
                raise ValueError(f"stream_start must be an int in [0, step={t}], got {stream_start!r}")
            if self._last_step is not None and t <= self._last_step:
                raise ValueError(f"step {t} observed after step {self._last_step}: steps must increase")
            if sampled_idx is not None:
                self.check_sampled(sampled_idx, t)
        j = self.coordinates
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            read = (released[j] - centre[j]) * float(expected_batch_size) / scale[j]
        if t is None:
            self.scores += np.where(np.isnan(read), np.inf, read)  # a NaN release reveals everything
        else:
            self._observe_banded(read, t, stream_start)
        if sampled_idx is not None:
            self.times_sampled[sampled_idx] += 1
        self.steps += 1

    def check_sampled(self, sampled: np.ndarray, step: int | None = None) -> None:
        """Refuse (``ValueError``) a set of sampled canaries that breaks the cyclic rule of banded
        noise: each must be in group ``step mod b``. A driver that samples canaries itself calls
        it before inserting them; :meth:`observe` checks again. Nothing to check for ``b = 1``."""
        if self.bands == 1:
            return
        t = self._step_index(step)
        idx = np.asarray(sampled, dtype=np.int64)
        if np.any(self.groups[idx] != t % self.bands):  # type: ignore[index]
            raise ValueError(
                f"a sampled canary is not in group {t % self.bands} of step {t}: with banded noise a "
                "canary may join only its group's steps (cyclic Poisson sampling), else it joins "
                "more often than the accountant's ⌈T/b⌉ compositions at rate b·q allow"
            )

    def _step_index(self, step: int | None) -> int:
        if step is None:
            return self.steps
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        return int(step)

    def _observe_banded(self, read: np.ndarray, t: int, stream_start: int | None) -> None:
        """``score_i += w_t·c_{(t − g_i) mod b}`` with ``w_t = Σ_k c_k r_{t−k}``, both over the
        steps ``≥ max(stream_start, first observed step)`` that were observed."""
        if self._first_step is None:
            self._first_step = t
        start = self._first_step if stream_start is None else max(int(stream_start), self._first_step)
        b, c = self.bands, self.coefficients
        observed = {t: read, **{u: r for u, r in self._history.items() if u >= start}}
        with np.errstate(invalid="ignore", over="ignore"):
            w = sum(c[k] * observed[t - k] for k in range(b) if t - k in observed)
            lag = (t - self.groups) % b  # type: ignore[operator]
            # the template C·s_g at row t: c_lag if the canary's slot t − lag was observed
            slot_seen = np.isin(t - lag, np.fromiter(observed, dtype=np.int64))
            gain = w * np.where(slot_seen, c[lag], 0.0)
            self.scores += np.where(np.isnan(gain), np.inf, gain)  # a NaN release reveals everything
            self.scores[np.isnan(self.scores)] = np.inf
        self._history = {u: r for u, r in observed.items() if u > t - b}
        self._last_step = t

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
