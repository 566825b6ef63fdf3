"""White-box gradient canaries for one-run auditing of a private optimizer.

The auditor adds *m* extra units to the training data whose gradients it chooses, each
included with probability ½ independently of everything else, and watches the released noisy
gradients. The canaries are Dirac canaries in the clipping space: canary ``i`` owns one
coordinate ``j_i`` (all distinct, drawn at random), and whenever it is in a batch its gradient
is

    g_i = a + L·b ⊙ e_{j_i},     so that     w_i = (g_i − a)/b = L·e_{j_i},

where ``a`` and ``b`` are the strategy's centre and scale for that step (public: they are
functions of earlier releases only; flat clipping has ``a = 0``, ``b = C``, the quantile rule
``a = 0``, ``b = C_t`` with ``C_t`` adapted from the released counts, so its canaries follow the
clip norm step by step) and ``L > 1`` the canary norm. Every strategy of the affine family clips ``w_i`` to (at most) norm 1, so a present
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

BLT correlated noise (``blt=BltNoise(θ, ω)``, ``min_separation=b``; :mod:`adaclip.correlated.blt`).
The release is again ``y = G + σ C⁻¹ z``, now with ``C`` the *dense* lower-triangular Toeplitz
matrix of the BLT's column (``c_0 = 1``, ``c_k = Σ_j ω_j θ_j^{k−1}``), and the accounting differs:
the data come in fixed-order batches (one public shuffle, then ``b`` batches visited in the same
order every epoch), so a unit takes part in exactly the steps ``t ≡ s (mod b)`` of its batch
``s``, at most ``⌈T/b⌉`` of them, and nothing about who participates is random — no
amplification. The accountant holds the Gaussian mechanism ``C G + σ z`` with the
min-separation sensitivity ``Δ_T = max_P ‖C u_P‖``, attained at ``P* = {0, b, 2b, …}``
(:mod:`adaclip.accounting._min_separation`): GDP with ``μ_T = Δ_T/σ``.

*Participation.* The canaries follow the same rule: each is given one slot ``g_i ∈ {0 … b−1}``
(independently and uniformly, by the auditor's public seed, independently of its coin), and an
included canary joins *every* step ``t ≡ g_i (mod b)`` — there is no draw, and no
``sample_rate`` (it is refused: canaries sampled at a rate would be an amplified mechanism that
the accountant's ε does not describe). :meth:`GradientCanaries.check_sampled` refuses a canary
outside its slot, which would join two steps less than ``b`` apart.

*Score.* Over the steps since the noise stream started, canary ``i``'s read-back series is
``r = [i included]·s_g + n + σ C⁻¹ z`` (``s_g``: the 0/1 indicator of slot ``g``'s steps;
``n``: the data's nuisance; ``C`` the leading block for those steps, whose inverse is the
leading block of ``C⁻¹``). Whitening, ``C r = [i included]·C s_g + C n + σ z``, is computed one
step at a time by :meth:`adaclip.correlated.BltNoise.whiten` (``w_t = r_t + Σ_j ω_j u_j``,
``u_j ← θ_j u_j + r_t``: the recursion that undoes the stream's ``correlate``), on the
read-backs and on the slot indicators alike (the template ``C s_g``). The score is the
normalised matched filter

    score_i = ⟨C r, C s_g⟩ / ‖C s_g‖.

*Its distribution.* Given the slot and the nuisance (neither depends on the coin), the score is
``N(ν_i, σ²)`` for an excluded canary and ``N(ν_i + ‖C s_g‖, σ²)`` for an included one
(``ν_i = ⟨C n, C s_g⟩/‖C s_g‖``): exactly the pair of ``μ_g``-GDP, ``μ_g = ‖C s_g‖/σ`` — every
included canary has the same shift, since nothing is sampled (flat clipping clips it to exactly
``e_j``; automatic clipping to a little less, a smaller shift). The log-likelihood ratio of the
two worlds, ``(‖C s_g‖·score_i − ½‖C s_g‖²)/σ²``, is increasing in the score: it is the
Neyman–Pearson statistic, no function of the releases tells the two worlds apart better (among
linear statistics ``⟨r, v⟩`` Cauchy–Schwarz gives the signal-to-noise ratio
``⟨s_g, v⟩/(σ‖C⁻ᵀ v‖) ≤ ‖C s_g‖/σ``, equal at ``v ∝ Cᵀ C s_g``). As ``s_g`` is a
min-separation pattern, ``‖C s_g‖ ≤ Δ_T``, with equality for slot 0 (its pattern is ``P*``)
when the audit sees the whole stream: a correct run's GDP fit finds ``μ̂ ≈ mean_i ‖C s_{g_i}‖/σ``,
at most and nearly the accountant's ``μ_T`` — the audit of BLT is tight, there is no
amplification for it to miss — and the excluded canaries' spread ``s₀ ≈ σ``. Dividing by
``‖C s_g‖`` (public: slot and steps) gives every canary the spread σ without it, which the GDP
fit's common-spread model needs; the templates' norms differ a little across slots (a slot
that starts later loses the last rows). Half the noise doubles every ``μ_g``; a wrong whitening
loses both the spread σ and power (raw read-backs, ``C = I``: for the tests' factor a spread of
about ``1.25σ`` and half the μ).

*Privacy argument.* A canary is a unit of the accounted mechanism: clipped and noised by the
optimizer, in the steps of one slot of the fixed order (separation ``b``, at most ``⌈T/b⌉``
steps), the participation for which the accountant's Gaussian mechanism ``σ/Δ_T`` holds for
every unit (zero-out neighbours, no amplification claimed). Its slot is public side
information, independent of its coin, and the order needs no secrecy (the accounting assumes
none), so the run is DP with respect to each canary's coin given all the slots, at the
accountant's (ε, δ); the score uses the releases and public quantities only (coordinates,
each step's ``(a, b)``, the slots, ``θ`` and ``ω``). Unlike cyclic Poisson canaries there are no
sampling draws whose use would cancel an amplification: the participations are a function of
slot and coin. So the one-run bound's premise holds. A restore without buffers restarts the
noise stream (``C`` block diagonal) and its accounting; the whitening restarts at
``stream_start`` too. The recursion needs every release of the stream, so a step that is
neither the next one nor a restart is refused (:meth:`GradientCanaries.check_step`). An audit
that starts after the stream whitens with the leading part of the filter only: still a valid
score, not exactly white (the earlier noise leaks in; the GDP fit's ``s₀`` measures it).

Privacy note: canaries are *units of the training data* — they are clipped and noised by the
mechanism like every other unit (the optimizers add them through their clipping path, never
past it). Auditing does not weaken the guarantee of the real units; it adds m fictitious ones.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from adaclip.audit.input_canaries import draw_inclusion
from adaclip.audit.report import AuditReport, audit_scores
from adaclip.correlated.blt import BltNoise
from adaclip.correlated.mechanism import accounted_sample_rate, check_coefficients
from adaclip.errors import InvalidHyperparameterError
from adaclip.options import positive_int

__all__ = ["GradientCanaries", "flatten_centre_scale"]


def _probability(name: str, value: Any, *, open_low: bool = True) -> float:
    ok = isinstance(value, (int, float, np.floating)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or not ((0 < value) if open_low else (0 <= value)) or value > 1:
        raise ValueError(f"{name} must be in (0, 1], got {value!r}")
    return float(value)


def _check_canary_rule(
    sample_rate: Any, noise_coefficients: Any, blt: Any, min_separation: Any
) -> float | None:
    """The canaries' sampling rate ``q`` (``None`` with BLT noise, whose canaries follow the
    fixed order), after refusing combinations the audit cannot honour."""
    if blt is None:
        if min_separation is not None:
            raise InvalidHyperparameterError(
                f"min_separation={min_separation!r} is for BLT noise (blt=BltNoise(...)); Poisson and cyclic "
                "Poisson canaries take sample_rate"
            )
        if sample_rate is None:
            raise InvalidHyperparameterError("sample_rate is required (the data's Poisson rate q)")
        return _probability("sample_rate", sample_rate)
    if not isinstance(blt, BltNoise):
        raise InvalidHyperparameterError(f"blt must be an adaclip.correlated.BltNoise, got {blt!r}")
    if noise_coefficients is not None:
        raise InvalidHyperparameterError("give either noise_coefficients (banded noise) or blt (BLT noise), not both")
    if sample_rate is not None:
        raise InvalidHyperparameterError(
            f"sample_rate={sample_rate!r} with BLT noise: BLT is accounted for fixed-order batches without "
            "amplification, so the canaries follow the fixed order too (each in one slot, an included one in "
            "every step of its slot) and have no sampling rate; leave sample_rate out"
        )
    if isinstance(min_separation, bool) or not isinstance(min_separation, (int, np.integer)) or min_separation < 1:
        raise InvalidHyperparameterError(
            f"min_separation must be a positive int with BLT noise (the fixed order's batches per epoch b), "
            f"got {min_separation!r}"
        )
    return None


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
        use the data's Poisson rate so that a canary is a unit like any other. Required, except
        with BLT noise, where it must be left out (fixed order: no sampling).
      canary_norm: ``L > 1``, the norm of ``w_i`` before clipping (10: clipped to 1 by any
        strategy, also automatic clipping's ``w/(‖w‖ + γ)`` comes within ``γ/L`` of it).
      inclusion_probability: ½ for the one-run bound (its theorem assumes fair coins).
      noise_coefficients: the banded noise's ``c_0 … c_{b−1}`` (unit norm, ``c_0 > 0``) when the
        audited release uses banded correlated noise; ``None`` (or ``[1.0]``): independent
        noise. With ``b > 1`` the canaries follow cyclic Poisson sampling at rate ``b·q`` in
        their group's steps (``b·q ≤ 1``) and are scored by the whitened matched filter (module
        docstring).
      blt: the :class:`~adaclip.correlated.BltNoise` (``θ, ω``) of an audited release with BLT
        noise over fixed-order batches; needs ``min_separation`` and no ``sample_rate`` (nor
        ``noise_coefficients``): each canary is given one slot of the fixed order and an
        included one joins every step of its slot (module docstring).
      min_separation: ``b``, the fixed order's batches per epoch (BLT only): the steps between
        two participations of a unit, the separation the BLT accounting assumes.
    """

    def __init__(
        self,
        num_params: int,
        *,
        num_canaries: int,
        seed: int,
        sample_rate: float | None = None,
        canary_norm: float = 10.0,
        inclusion_probability: float = 0.5,
        noise_coefficients: Sequence[float] | None = None,
        blt: BltNoise | None = None,
        min_separation: int | None = None,
    ) -> None:
        d = positive_int("num_params", num_params)
        m = positive_int("num_canaries", num_canaries)
        if m > d:
            raise ValueError(
                f"num_canaries={m} exceeds num_params={d}: each Dirac canary needs a coordinate of its own"
            )
        q = _check_canary_rule(sample_rate, noise_coefficients, blt, min_separation)
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
        coefficients = (1.0,) if noise_coefficients is None else check_coefficients(noise_coefficients)
        bands = len(coefficients)
        group_rate = 1.0 if q is None else accounted_sample_rate(q, bands)  # refuses b·q > 1
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
        #: ``"independent"``, ``"banded"`` or ``"blt"``
        self.kind = "blt" if blt is not None else ("banded" if bands > 1 else "independent")
        #: the BLT noise (``None`` otherwise) and its fixed order's ``b`` (1 otherwise)
        self.blt, self.min_separation = blt, (1 if min_separation is None else int(min_separation))
        #: the period of the groups: ``b`` (banded), the min separation (BLT), 1 (independent)
        self.cycle = self.min_separation if self.kind == "blt" else bands
        #: each canary's group — BLT: its slot of the fixed order — (independent, uniform; drawn
        #: after everything else, so ``b = 1`` draws what it always did); ``None`` for ``b = 1``
        self.groups = None if self.cycle == 1 else rng.integers(self.cycle, size=m)
        # BLT: the whitening's buffers (of the read-backs and of the slot templates), where the
        # current whitening started, and Σ_t ‖(C s_g)_t‖² per canary
        self._whitening: Any = None
        self._whitening_start: int | None = None
        self._template_energy = np.zeros(m)
        self._matched = np.zeros(m)
        # banded: the last b − 1 read-backs at the canaries' coordinates, {step: values}
        self._history: dict[int, np.ndarray] = {}
        self._first_step: int | None = None
        self._last_step: int | None = None
        #: Σ_t of the read-back coordinate per canary
        self.scores = np.zeros(m)  # banded: Σ_t w_t·c_{(t − g) mod b}, the whitened matched filter
        # BLT: ⟨C r, C s_g⟩/‖C s_g‖, the normalised whitened matched filter
        #: how often each canary was in a released step
        self.times_sampled = np.zeros(m, dtype=np.int64)
        self.steps = 0

    def sample(self, step: int | None = None) -> np.ndarray:
        """Indices of the canaries in this step's batch: included ones, each with probability
        ``q`` (a fresh draw per step).

        Banded noise: only the included canaries of group ``step mod b``, each with probability
        ``p = b·q``. ``step`` is the mechanism's step index (the optimizer's step count; default:
        the number of steps observed so far); it is ignored for ``b = 1``.

        BLT noise: every included canary of slot ``step mod b`` (no draw: the fixed order)."""
        if self.kind == "blt":
            t = self._step_index(step)
            return np.flatnonzero(self.included & (self.groups == t % self.cycle))
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
        the run more often than the banded accounting allows. BLT noise: the same arguments
        (the group is the canary's slot); its whitening is a recursion over consecutive steps,
        so a step that is neither the next one nor the stream's restart is refused
        (:meth:`check_step`).
        """
        released = self._check_flat(released, "released")
        centre, scale = self._check_flat(centre, "centre"), self._check_flat(scale, "scale")
        if not (isinstance(expected_batch_size, (int, float)) and expected_batch_size > 0):
            raise ValueError(f"expected_batch_size must be positive, got {expected_batch_size!r}")
        sampled_idx = None if sampled is None else np.asarray(sampled, dtype=np.int64)
        t = None if self.kind == "independent" else self.check_step(step, stream_start)
        if sampled_idx is not None:
            self.check_sampled(sampled_idx, t)
        j = self.coordinates
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            read = (released[j] - centre[j]) * float(expected_batch_size) / scale[j]
        if t is None:
            self.scores += np.where(np.isnan(read), np.inf, read)  # a NaN release reveals everything
        elif self.kind == "blt":
            self._observe_blt(read, t, stream_start)
        else:
            self._observe_banded(read, t, stream_start)
        if sampled_idx is not None:
            self.times_sampled[sampled_idx] += 1
        self.steps += 1

    def check_step(self, step: int | None, stream_start: int | None = None) -> int:
        """The step index of an observation with correlated noise, checked (``ValueError``,
        nothing changes): ``stream_start`` an int in ``[0, step]``, steps increasing, and with
        BLT noise consecutive — the next step after the last one observed, or the stream's
        restart (``step == stream_start``): the whitening ``C r`` is a recursion over every
        release of the stream, and a release it did not see (an ``optimizer.step()`` outside the
        auditor) would leave it wrong. Audit with a new auditor then. A driver calls it before
        stepping; :meth:`observe` checks again."""
        t = self._step_index(step)
        if stream_start is not None and not (
            isinstance(stream_start, (int, np.integer)) and not isinstance(stream_start, bool) and 0 <= stream_start <= t
        ):
            raise ValueError(f"stream_start must be an int in [0, step={t}], got {stream_start!r}")
        if self._last_step is not None and t <= self._last_step:
            raise ValueError(f"step {t} observed after step {self._last_step}: steps must increase")
        if self.kind == "blt" and self._last_step is not None and t != self._last_step + 1 and t != stream_start:
            raise ValueError(
                f"step {t} observed after step {self._last_step} with BLT noise: the whitening needs every "
                "release of the noise stream (was the optimizer stepped outside the auditor?); audit the "
                "rest of the run with a new auditor"
            )
        return t

    def check_sampled(self, sampled: np.ndarray, step: int | None = None) -> None:
        """Refuse (``ValueError``) a set of sampled canaries that a unit of the accounted
        mechanism could not be: a canary twice in one step (twice the sensitivity), or, with
        banded noise, one outside group ``step mod b`` (the cyclic rule), with BLT noise one
        outside slot ``step mod b`` (the fixed order). A driver that samples canaries itself
        calls it before inserting them; :meth:`observe` checks again."""
        idx = np.asarray(sampled, dtype=np.int64).reshape(-1)
        if np.any(idx < 0) or np.any(idx >= self.num_canaries) or np.unique(idx).size != idx.size:
            raise ValueError(
                f"sampled canaries must be distinct indices in [0, {self.num_canaries}), got {idx.tolist()}"
            )
        if self.cycle == 1:
            return
        t = self._step_index(step)
        if self.kind == "blt":
            if np.any(self.groups[idx] != t % self.cycle):  # type: ignore[index]
                raise ValueError(
                    f"a sampled canary is not in slot {t % self.cycle} of step {t}: with BLT noise a canary "
                    f"joins only its slot's steps (fixed order, min separation {self.cycle}), else it joins "
                    "more often than the BLT accounting allows"
                )
            return
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

    def _observe_blt(self, read: np.ndarray, t: int, stream_start: int | None) -> None:
        """``score_i = ⟨C r, C s_g⟩/‖C s_g‖`` over the steps since the whitening started (the
        later of the first observed step and ``stream_start``): one step of
        :meth:`adaclip.correlated.BltNoise.whiten` on the read-backs ``r_t`` and on the slot
        indicators ``(s_g)_t = [t ≡ g mod b]`` (the template ``C s_g``), then
        ``Σ_t (C r)_t (C s_g)_t`` and ``Σ_t (C s_g)_t²``."""
        if self._first_step is None:
            self._first_step = t
        start = self._first_step if stream_start is None else max(int(stream_start), self._first_step)
        blt = self.blt
        assert blt is not None
        if self._whitening_start != start:  # a new stream: C is block diagonal, both restart
            self._whitening, self._whitening_start = blt.init(), start
        slot = (self.groups == t % self.cycle).astype(np.float64)  # type: ignore[union-attr]
        with np.errstate(invalid="ignore", over="ignore"):
            (w, template), self._whitening = blt.whiten(self._whitening, [read, slot])
            gain = w * template
            self._matched += np.where(np.isnan(gain), np.inf, gain)  # a NaN release reveals everything
            self._matched[np.isnan(self._matched)] = np.inf
            self._template_energy += template * template
            seen = self._template_energy > 0
            self.scores = np.where(seen, self._matched / np.sqrt(np.where(seen, self._template_energy, 1.0)), 0.0)
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
