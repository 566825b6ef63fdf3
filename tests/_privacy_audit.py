"""White-box canary audits of the real optimizers (helpers for ``test_privacy_audit.py``).

What is audited
---------------
One *trial* is one step of a real optimizer: ``adaclip_torch.AdaClip``/``FlatClip`` on the
hooks path (``per_sample_mode="materialise"``) or the ghost path (``"ghost"``), or the optax
transformations ``adaclip_jax.adaclip``/``flat_clip`` (jitted ``update``). The auditor controls
the whole batch: in world 1 it holds only the canary, in world 0 no unit at all (PyTorch: a
zero-length forward/backward then ``step()``, or ``step(empty_batch=True)``; JAX: every row
masked out with ``unit_mask``, or a leading axis of 0). The canary is in the batch with
probability 1/2, independently in each trial, and the auditor records which.

Any core strategy can be audited the same way (:func:`core_trials` on
``adaclip.strategies.private_step``; ``torch_trials``/``jax_trials`` with a strategy object, run
by ``adaclip_torch.DPOptimizer(strategy=...)`` and ``adaclip_jax.private_aggregate``): the
adaptive options (their centre and scale come from the reference's transform), quantile clipping
and automatic clipping. A strategy with the quantile rule releases a count of unclipped units
beside the gradient; the score then combines both releases (see :func:`core_trials`), and stays
``N(0, σ²)`` against ``N(1, σ²)`` for a correct mechanism.

White box: the auditor sets the canary's *gradient*. With ``nn.Linear(d, 1, bias=False)``,
loss ``model(x).sum()`` and ``loss_reduction="sum"``, the per-example gradient of the weight is
the input row ``x`` itself; in JAX the per-unit gradients are the input of ``update``. From the
strategy's centre ``a`` and scale ``b`` of the state *before* the step (AdaCliP: ``a = m``,
``b = sqrt(s)·sqrt(Σ_j s_j)`` over all tensors, computed here in float64 from ``m`` and ``s``
with the formula of the spec, not with the library's code; flat clipping: ``a = 0``, ``b = C``)
the canary is

    x = a + L·b·u,     u a uniformly random unit vector (fresh in each trial), L > 1,

so ``w = (x − a)/b = L·u`` and a correct mechanism clips it to exactly ``u``: the canary's
contribution in w-space has the whole sensitivity, 1, in a direction the auditor knows.

Score of a trial, from the released gradient ``g̃`` (PyTorch: ``p.grad`` after ``step()``, the
wrapped optimizer being ``SGD(lr=0)``; JAX: the update):

    score = ⟨(g̃ − a)·B̄/b, u⟩ = ⟨Σ_i w̄_i + σ z, u⟩ .

For a correct mechanism ``score ~ N(0, σ²)`` in world 0 and ``N(1, σ²)`` in world 1, for every
strategy and whatever the history: the state only shifts (``a``) and scales (``b``) the
release, and it is a function of earlier releases, which the auditor sees too (choosing the
canary from it is an adaptive choice of neighbouring batches, which DP allows). Conditionally
on the past every score has the same distribution, so the trials are i.i.d. draws of the
*one-step* Gaussian mechanism with sensitivity 1 and noise multiplier σ, which is exactly
``μ``-GDP with ``μ = 1/σ``. The reference is the accountant's ε of that one step
(``Accountant("pld")``, ``q = 1``, σ, δ = 1e-5); for a Gaussian mechanism it equals the GDP
value (up to the PLD's pessimistic discretisation, +4e-9 at σ = 0.5). Note that with a correct
mechanism the *point estimate* of ε is above the accountant's about half the time: only a
lower confidence bound can be compared with it.

Estimators (the library's, :mod:`adaclip.audit.estimators`; each gives a one-sided lower
confidence bound on the ε of the one-step mechanism):

* :func:`gdp_fit` (parametric, powerful): ``μ̂ = (mean₁ − mean₀)/s₀``, the shift of the
  canary in units of the noise, ``s₀`` being the standard deviation of the scores of world 0
  (no unit: the noise alone, whatever the mechanism does with the canary). Delta-method
  standard error ``se² = s₁²/(n₁ s₀²) + 1/n₀ + μ̂²/(2(n₀ − 1))`` (the difference of the means,
  plus the uncertainty of ``log s₀``), ``μ_L = μ̂ − z_conf·se``, and ε(δ) from the GDP
  trade-off curve, ``δ(ε) = Φ(−ε/μ + μ/2) − e^ε·Φ(−ε/μ − μ/2)`` (solved for ε with ``brentq``).
  It assumes Gaussian scores: exact for a correct mechanism and for one with too little
  noise. Scaling by ``s₀`` rather than a pooled deviation keeps the bound valid and strong
  when world 1 is *more* variable, as with a canary that is under-clipped by a varying amount
  (world 1 is then a mixture of ``N(Δ_k, s₀²)``; the half-line ``{score > t*}`` attains δ(ε)
  for GDP, ``t* = s₀(ε/μ + μ/2)``, and where every ``Δ_k ≤ t*`` its probability is convex in
  ``Δ``, so Jensen gives ``δ_mixture(ε) ≥ δ_GDP(ε)`` at ``μ = mean Δ/s₀``: the bound stays
  valid. At σ = 0.5, δ = 1e-5, ``t* = 3``, which covers the ``‖w‖ = 3`` canary of the
  large-centre audit even left entirely unclipped; beyond that it is an approximation, like
  any parametric fit). A pooled deviation would dilute the shift with that variability.
  A non-finite score (a NaN/inf release) counts as a perfect distinguisher (``μ = ∞``).
* :func:`threshold_audit` (assumption-free): for each threshold ``t`` of a grid fixed in
  advance (multiples of the claimed σ, so independent of the data) the test "canary present
  iff score > t" and its mirror, Clopper–Pearson upper bounds on FPR and FNR, and
  ``ε ≥ log((1 − δ − FNR_U)/FPR_U)`` (and with FPR and FNR swapped). The confidence is split
  over all the bounds (Bonferroni), so the maximum over the grid is still a valid bound. It
  needs far more trials than the GDP fit to certify a large ε (the FPR must be resolved near
  ``e^{−ε}``), but it also catches mechanisms whose scores are not Gaussian, e.g. one that
  adds no noise at all.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import warnings
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from adaclip.accounting import Accountant
from adaclip.audit import estimators
from adaclip.errors import NoiseDominatedWarning, NoiseReplayWarning

DELTA = 1e-5
#: ‖w‖ of the canary before clipping; a correct mechanism clips it to norm 1.
CANARY_NORM = 10.0
#: Confidence of every lower bound the tests assert on.
CONFIDENCE = 0.999


def seed_for(name: str) -> int:
    """A fixed seed per audit case (stable across runs and Python versions)."""
    return zlib.crc32(name.encode()) % (2**31)


# --------------------------------------------------------------------------- estimators
# The estimators are the library's (adaclip.audit.estimators): one implementation, tested on
# its own against closed forms in test_audit_estimators.py. These wrappers only fix the audit's
# δ and confidence.


def gdp_epsilon(mu: float, delta: float = DELTA) -> float:
    """The smallest ε with ``δ(ε) ≤ delta`` for μ-GDP (:func:`adaclip.audit.gdp_epsilon`)."""
    return estimators.gdp_epsilon(mu, delta)


@functools.cache
def accountant_epsilon(noise_multiplier: float, delta: float = DELTA, sample_rate: float = 1.0) -> float:
    """ε(δ) that ``Accountant("pld")`` reports for ONE step with ``(q, σ)`` (cached: ~0.5 s each)."""
    acc = Accountant("pld")
    acc.step(noise_multiplier=noise_multiplier, sample_rate=sample_rate)
    return acc.epsilon(delta)


def gdp_fit(scores: np.ndarray, included: np.ndarray, *, confidence: float = CONFIDENCE,
            delta: float = DELTA) -> estimators.GdpFit:  # fmt: skip
    """:func:`adaclip.audit.gdp_fit` at the audit's δ and confidence."""
    return estimators.gdp_fit(scores, included, delta=delta, confidence=confidence)


def threshold_audit(scores: np.ndarray, included: np.ndarray, *, thresholds: Sequence[float],
                    confidence: float = CONFIDENCE, delta: float = DELTA) -> estimators.ThresholdBound:  # fmt: skip
    """:func:`adaclip.audit.threshold_epsilon` on a grid fixed in advance."""
    return estimators.threshold_epsilon(scores, included, delta=delta, confidence=confidence, thresholds=thresholds)


# --------------------------------------------------------------------------- one audit


@dataclasses.dataclass(frozen=True)
class Audit:
    """The trials of one audit and what the estimators make of them."""

    name: str
    scores: np.ndarray
    included: np.ndarray
    claimed_sigma: float  #: the σ the accountant is told
    accountant_epsilon: float  #: one step, q = 1, claimed σ, δ = 1e-5
    gdp: estimators.GdpFit
    threshold: estimators.ThresholdBound
    seconds: float = math.nan  #: wall time of the trials

    def summary(self) -> str:
        g = self.gdp
        return (
            f"{self.name}: {len(self.scores)} trials (n0={g.n0}, n1={g.n1}) in {self.seconds:.1f}s; "
            f"claimed σ={self.claimed_sigma:g} (μ={1 / self.claimed_sigma:.3f}, accountant ε={self.accountant_epsilon:.3f}); "
            f"sd0={g.sd0:.3f} sd1={g.sd1:.3f}; μ̂={g.mu:.3f}±{g.se:.3f} μ_L={g.mu_lower:.3f}; "
            f"ε̂={g.epsilon:.3f} ε_L(GDP)={g.epsilon_lower:.3f} ε_L(threshold)={self.threshold.epsilon_lower:.3f}"
        )


def analyse(name: str, scores: np.ndarray, included: np.ndarray, claimed_sigma: float, *,
            seconds: float = math.nan, confidence: float = CONFIDENCE) -> Audit:  # fmt: skip
    """Both estimators on one run of trials, against the accountant's one-step ε for ``claimed_sigma``."""
    grid = [claimed_sigma * k / 4 for k in range(-8, 21)]  # −2σ … 5σ in steps of σ/4, fixed in advance
    return Audit(
        name=name,
        scores=np.asarray(scores),
        included=np.asarray(included),
        claimed_sigma=claimed_sigma,
        accountant_epsilon=accountant_epsilon(claimed_sigma),
        gdp=gdp_fit(scores, included, confidence=confidence),
        threshold=threshold_audit(scores, included, thresholds=grid, confidence=confidence),
        seconds=seconds,
    )


def _unit_vector(rng: np.random.Generator, d: int) -> np.ndarray:
    u = rng.standard_normal(d)
    return u / np.linalg.norm(u)


def _adaclip_centre_scale(
    mean: Sequence[np.ndarray], std: Sequence[np.ndarray]
) -> tuple[np.ndarray, np.ndarray]:
    """AdaCliP's ``a = m`` and ``b = sqrt(s)·sqrt(Σ_j s_j)`` (all tensors flattened, in order),
    in float64, from the spec's formula (independent of the library's transform)."""
    m = np.concatenate([np.asarray(x, dtype=np.float64).ravel() for x in mean])
    s = np.concatenate([np.asarray(x, dtype=np.float64).ravel() for x in std])
    return m, np.sqrt(s) * math.sqrt(float(s.sum()))


def _canary(a: np.ndarray, b: np.ndarray, u: np.ndarray, norm: float, kind: str) -> np.ndarray:
    """``a + norm·b·u``; ``kind="nan"`` also puts a NaN in its first coordinate (such a unit
    must contribute nothing, so the audit then expects μ ≈ 0)."""
    x = a + norm * b * u
    if kind == "nan":
        x[0] = np.nan
    elif kind != "clipped":
        raise ValueError(kind)
    return x


def _warmup_batches(
    rng: np.random.Generator, dim: int, rows: int, steps: int, scale: float
) -> list[np.ndarray]:
    """Training-like batches (a common non-zero mean, unequal variances per coordinate), so
    that AdaCliP's audited states have ``m ≠ 0`` and unequal ``s``."""
    centre = rng.standard_normal(dim) * scale / math.sqrt(dim)
    spread = np.exp(rng.uniform(-2, 1, size=dim)) * scale / math.sqrt(dim)
    return [centre + spread * rng.standard_normal((rows, dim)) for _ in range(steps)]


# --------------------------------------------------------------------------- PyTorch


def torch_trials(
    strategy: Any,
    *,
    per_sample_mode: str = "materialise",
    noise_multiplier: float,
    trials: int,
    seed: int,
    dim: int = 32,
    expected_batch_size: float = 4.0,
    max_grad_norm: float = 1.0,
    warmup_steps: int = 10,
    empty_world: str = "zero_length",
    loaded_ratio: float | None = None,
    canary_norm: float = CANARY_NORM,
    canary: str = "clipped",
    claimed_sigma: float | None = None,
    claimed_strategy: Any = None,
) -> tuple[np.ndarray, np.ndarray, float]:
    """``trials`` audit steps of ``AdaClip``/``FlatClip`` wrapping ``SGD(lr=0)`` on
    ``nn.Linear(dim, 1, bias=False)`` (float32), with an ``Accountant("pld")`` attached
    (``sample_rate=1``).

    ``strategy``: ``"adaclip"`` (``initial_max_grad_norm=max_grad_norm``) or ``"flat"``, or a
    core strategy object (AdaCliP with any options, quantile or automatic clipping...), run by
    ``adaclip_torch.DPOptimizer(strategy=...)``, warmed up like AdaCliP and scored as in
    :func:`core_trials` (with the released count for the quantile rule, weighted for
    ``claimed_sigma``, default ``noise_multiplier``).
    ``empty_world``: ``"zero_length"`` (forward/backward on a ``(0, dim)`` batch, then
    ``step()``) or ``"empty_batch"`` (``step(empty_batch=True)``). AdaCliP first takes
    ``warmup_steps`` private steps on training-like batches of ``expected_batch_size`` rows.
    ``loaded_ratio``: instead of warming up, before *every* trial load with
    ``opt.load_state_dict`` an AdaCliP state with ``s = std_min`` and ``m = loaded_ratio·b·v``
    (``v`` a fixed unit vector), i.e. ``‖m/b‖ = loaded_ratio``; the rest of the state dict is
    the optimizer's current one, the noise generator's state included, so nothing replays.

    Returns ``(scores, included, σ)`` with the σ the optimizer reported to its accountant
    (checked to be one run of ``q = 1``).
    """
    import torch
    from torch import nn

    import adaclip_torch

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    model = nn.Linear(dim, 1, bias=False)
    acc = Accountant("pld")
    common = dict(noise_multiplier=noise_multiplier, expected_batch_size=expected_batch_size, loss_reduction="sum",
                  per_sample_mode=per_sample_mode, seed=seed, accountant=acc, sample_rate=1.0)  # fmt: skip
    sgd = torch.optim.SGD(model.parameters(), lr=0.0)
    generic = not isinstance(strategy, str)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NoiseDominatedWarning)
        if generic:
            opt = adaclip_torch.DPOptimizer(sgd, model, strategy=strategy, **common)
        elif strategy == "adaclip":
            opt = adaclip_torch.AdaClip(sgd, model, initial_max_grad_norm=max_grad_norm, **common, preset="patent")
        elif strategy == "flat":
            opt = adaclip_torch.FlatClip(sgd, model, max_grad_norm=max_grad_norm, **common)
        else:
            raise ValueError(strategy)
    adaptive = generic or strategy == "adaclip"
    score = _Score(strategy if claimed_strategy is None else claimed_strategy,
                   noise_multiplier if claimed_sigma is None else claimed_sigma, expected_batch_size)  # fmt: skip

    def numpy(tensors):
        return None if tensors is None else [x.detach().cpu().numpy() for x in tensors]

    def centre_scale() -> tuple[np.ndarray, np.ndarray]:
        if generic:
            st = opt.clip_state
            return _strategy_centre_scale(strategy, st.step, numpy(st.mean), numpy(st.std), _clip_norm(st.extra), dim)
        if not adaptive:
            return np.zeros(dim), np.full(dim, max_grad_norm)
        st = opt.clip_state
        return _adaclip_centre_scale([m.detach().cpu().numpy() for m in st.mean],
                                     [s.detach().cpu().numpy() for s in st.std])  # fmt: skip

    if adaptive and loaded_ratio is None:
        for x in _warmup_batches(rng, dim, int(expected_batch_size), warmup_steps, max_grad_norm):
            model(torch.tensor(x, dtype=torch.float32)).sum().backward()
            opt.step()
            opt.zero_grad()
    if loaded_ratio is not None:
        if strategy != "adaclip":
            raise ValueError("loaded_ratio is for AdaCliP")
        s_val = opt.strategy.std_min
        loaded_mean = torch.tensor(loaded_ratio * s_val * math.sqrt(dim) * _unit_vector(rng, dim),
                                   dtype=torch.float32).reshape(1, dim)  # fmt: skip
        loaded_std = torch.full((1, dim), s_val, dtype=torch.float32)
    scores = np.empty(trials)
    included = rng.random(trials) < 0.5
    for t in range(trials):
        if loaded_ratio is not None:
            sd = opt.state_dict()
            sd["clip_state"] = copy.deepcopy(sd["clip_state"])
            sd["clip_state"]["mean"] = [loaded_mean.clone()]
            sd["clip_state"]["std"] = [loaded_std.clone()]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", NoiseReplayWarning)  # the generator state is the current one
                opt.load_state_dict(sd)
        a, b = centre_scale()
        clip_before = _clip_norm(opt.clip_state.extra) if generic else None
        u = _unit_vector(rng, dim)
        if included[t]:
            x = torch.tensor(_canary(a, b, u, canary_norm, canary), dtype=torch.float32).reshape(1, dim)
            model(x).sum().backward()
            opt.step()
        elif empty_world == "zero_length":
            model(torch.zeros((0, dim))).sum().backward()
            opt.step()
        elif empty_world == "empty_batch":
            opt.step(empty_batch=True)
        else:
            raise ValueError(empty_world)
        g = model.weight.grad.detach().double().numpy().reshape(-1)
        opt.zero_grad()
        after = _clip_norm(opt.clip_state.extra) if generic else None
        scores[t] = score(g, a, b, u, clip_before, after) if generic else float(np.dot((g - a) * expected_batch_size / b, u))
    runs = acc.history
    assert len(runs) == 1 and runs[0][0] == 1.0, runs
    return scores, included, float(runs[0][1])


# --------------------------------------------------------------------------- JAX


def jax_trials(
    strategy: Any,
    *,
    noise_multiplier: float,
    trials: int,
    seed: int,
    shapes: Sequence[tuple[int, ...]] = ((4, 6), (6,), (2, 1)),
    expected_batch_size: float = 4.0,
    max_grad_norm: float = 1.0,
    warmup_steps: int = 10,
    empty_world: str = "mask",
    canary_norm: float = CANARY_NORM,
    canary: str = "clipped",
    claimed_sigma: float | None = None,
    claimed_strategy: Any = None,
) -> tuple[np.ndarray, np.ndarray, float]:
    """``trials`` audit steps of ``adaclip_jax.adaclip``/``flat_clip`` (jitted ``update``), or
    of ``adaclip_jax.private_aggregate(strategy)`` for a core strategy object (scored as in
    :func:`core_trials`, with the released count for the quantile rule; the masked rows must
    then add nothing to the count either).

    The parameters are a dict of float32 leaves of ``shapes``; the canary spans all of them
    (flattened in ``jax.tree_util`` order). AdaCliP gets the ``std_min``/``std_max`` that
    ``initial_max_grad_norm=max_grad_norm`` gives in PyTorch, and warms up as in
    :func:`torch_trials`. ``empty_world``:

    * ``"mask"``: every step passes ``B̄`` rows (a padded static shape, as with Poisson
      sampling under ``jit``), *all* of them copies of the canary, with ``unit_mask`` True for
      row 0 only in world 1 and all False in world 0: masked rows must contribute nothing, so
      a leak through the mask would show as a larger shift;
    * ``"empty"``: world 1 passes the canary alone, world 0 a leading axis of 0 (no mask).

    Returns ``(scores, included, σ)`` with the σ the state says it used
    (``last_noise_multiplier``, what :class:`adaclip_jax.PrivacyTracker` records).
    """
    import jax
    import jax.numpy as jnp

    import adaclip_jax

    rng = np.random.default_rng(seed)
    params = {f"p{k}": jnp.zeros(s, jnp.float32) for k, s in enumerate(shapes)}
    leaves, treedef = jax.tree_util.tree_flatten(params)
    sizes = [int(np.prod(leaf.shape)) for leaf in leaves]
    dim = sum(sizes)
    rows = int(expected_batch_size)
    generic = not isinstance(strategy, str)
    adaptive = generic or strategy == "adaclip"
    score = _Score(strategy if claimed_strategy is None else claimed_strategy,
                   noise_multiplier if claimed_sigma is None else claimed_sigma, expected_batch_size)  # fmt: skip
    key = jax.random.key(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NoiseDominatedWarning)
        if generic:
            tx = adaclip_jax.private_aggregate(strategy, noise_multiplier=noise_multiplier,
                                               expected_batch_size=expected_batch_size, key=key)  # fmt: skip
        elif strategy == "adaclip":
            s0 = max_grad_norm / math.sqrt(dim)  # std_bounds_for_initial_clip with spread 30
            tx = adaclip_jax.adaclip(noise_multiplier=noise_multiplier, expected_batch_size=expected_batch_size,
                                     key=key, std_min=s0 / 30, std_max=s0 * 30, preset="patent")  # fmt: skip
        elif strategy == "flat":
            tx = adaclip_jax.flat_clip(max_grad_norm=max_grad_norm, noise_multiplier=noise_multiplier,
                                       expected_batch_size=expected_batch_size, key=key)  # fmt: skip
        else:
            raise ValueError(strategy)
        state = tx.init(params)

    def per_unit(x: np.ndarray) -> dict:
        """``(n, dim)`` rows → the parameters' pytree with a leading axis ``n``."""
        parts, start = [], 0
        for leaf, size in zip(leaves, sizes, strict=True):
            parts.append(
                jnp.asarray(x[:, start : start + size].reshape((x.shape[0], *leaf.shape)), jnp.float32)
            )
            start += size
        return jax.tree_util.tree_unflatten(treedef, parts)

    def flat(tree) -> np.ndarray:
        return np.concatenate(
            [np.asarray(x, dtype=np.float64).ravel() for x in jax.tree_util.tree_leaves(tree)]
        )

    masked = jax.jit(lambda g, s, mask: tx.update(g, s, params, unit_mask=mask))
    plain = jax.jit(lambda g, s: tx.update(g, s, params))

    def as_numpy(tree):
        return None if tree is None else [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]

    def centre_scale() -> tuple[np.ndarray, np.ndarray]:
        if generic:
            return _strategy_centre_scale(strategy, state.step, as_numpy(state.mean), as_numpy(state.std),
                                          _clip_norm(state.extra), dim)  # fmt: skip
        if not adaptive:
            return np.zeros(dim), np.full(dim, max_grad_norm)
        return _adaclip_centre_scale([np.asarray(x) for x in jax.tree_util.tree_leaves(state.mean)],
                                     [np.asarray(x) for x in jax.tree_util.tree_leaves(state.std)])  # fmt: skip

    if adaptive:
        every = jnp.ones((rows,), bool)
        for x in _warmup_batches(rng, dim, rows, warmup_steps, max_grad_norm):
            _, state = masked(per_unit(x), state, every)
    first_only = jnp.asarray(np.arange(rows) == 0)
    none = jnp.zeros((rows,), bool)
    scores = np.empty(trials)
    included = rng.random(trials) < 0.5
    sigmas = set()
    for t in range(trials):
        a, b = centre_scale()
        clip_before = _clip_norm(state.extra) if generic else None
        u = _unit_vector(rng, dim)
        x = _canary(a, b, u, canary_norm, canary)[None, :]
        if empty_world == "mask":
            out, state = masked(
                per_unit(np.repeat(x, rows, axis=0)), state, first_only if included[t] else none
            )
        elif empty_world == "empty":
            out, state = plain(per_unit(x if included[t] else np.zeros((0, dim))), state)
        else:
            raise ValueError(empty_world)
        sigmas.add(float(state.last_noise_multiplier))
        if generic:
            scores[t] = score(flat(out), a, b, u, clip_before, _clip_norm(state.extra))
        else:
            scores[t] = float(np.dot((flat(out) - a) * expected_batch_size / b, u))
    assert len(sigmas) == 1, sigmas
    return scores, included, sigmas.pop()


# --------------------------------------------------------------------------- any core strategy


def _flat(arrays) -> np.ndarray:
    return np.concatenate([np.asarray(a, dtype=np.float64).reshape(-1) for a in arrays])


def _strategy_centre_scale(strategy, step, mean, std, clip_norm, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """``(a, b)`` of a core strategy's next step from its state (``mean``/``std``: per-tensor
    arrays or ``None``; ``clip_norm``: the quantile rule's ``C_t`` or ``None``), in float64, by
    the formulas of the spec: AdaptiveClipping (any options) through
    :func:`adaclip.reference.adaptive_transform` (the reference, not the library's transform);
    the others ``a = 0`` and ``b = C`` (``C_t`` for quantile clipping)."""
    from adaclip import reference
    from adaclip import strategies as S

    if isinstance(strategy, S.AdaptiveClipping):
        flat = {"step": int(step), "std": _flat(std)}
        if mean is not None:
            flat["mean"] = _flat(mean)
        if clip_norm is not None:
            flat["clip_norm"] = float(clip_norm)
        return reference.adaptive_transform(flat, **dataclasses.asdict(strategy))
    if isinstance(strategy, S.QuantileClipping):
        return np.zeros(dim), np.full(dim, float(clip_norm))
    return np.zeros(dim), np.full(dim, float(strategy.max_grad_norm))


def _clip_norm(extra) -> float | None:
    return None if not extra or "clip_norm" not in extra else float(np.asarray(extra["clip_norm"]))


class _Score:
    """The score of a release for a core strategy (see :func:`core_trials`): ``⟨(g̃ − a)·B̄/b, u⟩``,
    combined with the released count when the strategy has the quantile rule."""

    def __init__(self, strategy, claimed_sigma: float, expected_batch_size: float):
        """``strategy``: the claimed one (its quantile rule's σ_b weighs the count)."""
        self.rule = getattr(strategy, "quantile", None)
        self.claimed, self.bbar = claimed_sigma, expected_batch_size
        if self.rule is not None:
            self.sigma_b = self.rule.count_noise(expected_batch_size)
            self.sigma_g = (claimed_sigma**-2 - (2.0 * self.sigma_b) ** -2) ** -0.5  # the hand formula

    def __call__(self, released: np.ndarray, a, b, u, clip_before: float | None, clip_after: float | None) -> float:
        y = float(np.dot((released - a) * self.bbar / b, u))
        if self.rule is None:
            return y
        # the released count, read back from C_{t+1} = C_t·exp(−η(count/B̄ + ½ − γ))
        count = self.bbar * (self.rule.target_quantile - 0.5 - math.log(clip_after / clip_before) / self.rule.learning_rate)
        return self.claimed**2 * (y / self.sigma_g**2 - 0.5 * count / self.sigma_b**2)


def core_trials(
    strategy,
    *,
    noise_multiplier: float,
    trials: int,
    seed: int,
    claimed_sigma: float | None = None,
    claimed_strategy: Any = None,
    shapes: Sequence[tuple[int, ...]] = ((4, 6), (6,), (2, 3, 2)),
    expected_batch_size: float = 4.0,
    warmup_steps: int = 10,
    canary_norm: float = CANARY_NORM,
    canary: str = "clipped",
) -> tuple[np.ndarray, np.ndarray, float]:
    """``trials`` audit steps of :func:`adaclip.strategies.private_step` (NumPy float64, the
    parameters split into ``shapes``: a matrix, a vector, a 3-d tensor) for any strategy of the
    core: AdaCliP with any options, quantile clipping, automatic clipping, flat clipping.

    World 1 passes the canary alone, world 0 an empty batch; the state is carried from trial to
    trial (after ``warmup_steps`` training-like steps), so the audited states have a centre,
    unequal statistics, a moved ``C_t``, half-full windows... The noise is standard normal from
    the trial's generator, handed to the core, which scales it (σ_g, σ_b) itself.

    With the quantile rule, the clipped canary counts −½ in world 1 and nothing does in world 0,
    so the released fraction is ``½ − 1/(2B̄)`` or ``½`` on average: a target quantile other than
    ``½ − 1/(4B̄)`` makes ``C_t`` drift geometrically over the trials (e^75 over 6 000 trials at
    ``γ = ½``, ``η = 0.2``, ``B̄ = 4``), until, in float32, the canary's squared norm overflows
    and the unit is dropped: give the audited rule that target.

    Score. Without a count it is ``⟨(g̃ − a)·B̄/b, u⟩`` as for the optimizers. With the quantile
    rule the step also releases the count ``Σ_i(1[‖w_i‖ ≤ 1] − ½) + σ_b ζ`` (the clipped canary
    adds −½), read back from the public ``C_{t+1} = C_t·exp(−η(count/B̄ + ½ − γ))``; the score
    is then the likelihood-ratio combination of the two releases,

        score = σ²·(y_g/σ_g² − ½·y_c/σ_b²),

    with ``(σ_g, σ_b)`` computed here from the *claimed* σ (``claimed_sigma``, default
    ``noise_multiplier``) and the claimed strategy's ``σ_b`` (``claimed_strategy``, default
    ``strategy``) by the hand formula ``σ_g = (σ⁻² − (2σ_b)⁻²)^{-1/2}``. For a correct
    mechanism its shift is ``σ²(1/σ_g² + ¼/σ_b²) = 1`` and its deviation σ: ``N(0, σ²)`` against
    ``N(1, σ²)``, the one-step Gaussian mechanism at the claimed σ, analysed as every other
    audit. A mechanism that under-noises either release, or whose count leaks more than ½,
    shows a larger μ.

    Returns ``(scores, included, σ)`` with σ the noise multiplier passed to the core.
    """
    from adaclip import strategies as S

    rng = np.random.default_rng(seed)
    sizes = [math.prod(s) for s in shapes]
    dim = sum(sizes)
    bbar = expected_batch_size
    score = _Score(strategy if claimed_strategy is None else claimed_strategy,
                   noise_multiplier if claimed_sigma is None else claimed_sigma, bbar)  # fmt: skip

    def per_unit(x: np.ndarray) -> list[np.ndarray]:
        out, start = [], 0
        for shape, size in zip(shapes, sizes, strict=True):
            out.append(np.ascontiguousarray(x[:, start : start + size]).reshape((x.shape[0], *shape)))
            start += size
        return out

    def noise() -> list[np.ndarray]:
        draws = [rng.standard_normal(shape) for shape in shapes]
        return draws + [np.asarray(rng.standard_normal()) for _ in range(getattr(strategy, "num_auxiliary", 0))]

    kw = dict(noise_multiplier=noise_multiplier, expected_batch_size=bbar)
    state = strategy.init([np.zeros(s) for s in shapes])
    for x in _warmup_batches(rng, dim, int(bbar), warmup_steps, 1.0):
        _, state = S.private_step(strategy, state, per_unit(x), noise(), **kw)
    scores = np.empty(trials)
    included = rng.random(trials) < 0.5
    for t in range(trials):
        clip_before = _clip_norm(state.extra)
        a, b = _strategy_centre_scale(strategy, state.step, state.mean, state.std, clip_before, dim)
        u = _unit_vector(rng, dim)
        x = _canary(a, b, u, canary_norm, canary)[None, :] if included[t] else np.zeros((0, dim))
        out, state = S.private_step(strategy, state, per_unit(x), noise(), **kw)
        scores[t] = score(_flat(out), a, b, u, clip_before, _clip_norm(state.extra))
    return scores, included, float(noise_multiplier)
