"""The plan of a banded-noise run, made before training from public quantities only.

A run with banded correlated noise (:mod:`adaclip.correlated.mechanism`) needs four numbers
before its first step, and every framework needs the same four:

1. **the number of bands** ``b``: the candidate ``b ∈ {1, 2, 4, …, 64}`` whose calibrated
   noise gives the workload the smallest expected error (runs shorter than
   :data:`MIN_STEPS_FOR_BANDS` steps: ``b = 1``),
   ``σ_b² · ‖A C_b⁻¹‖_F² / T`` (:func:`~adaclip.correlated.coefficients.choose_bands`; ``A``
   the workload: momentum SGD's momentum sums, Adam's first moment, or prefix sums). ``b = 1``,
   DP-SGD, is always a candidate; a candidate needs ``b·q ≤ 1`` (cyclic Poisson sampling draws
   each step from one of ``b`` groups at rate ``b·q``), ``b ≤ T``, and buffers
   (``(b − 1)·d`` numbers) within a memory budget;
2. **the noise multiplier** ``σ_b``: calibrated for the target ``(ε, δ)`` as ``⌈T/b⌉``
   compositions of the Poisson-subsampled Gaussian mechanism at rate ``b·q`` (amplified
   banded matrix factorisation: a unit's group is sampled at most once in every ``b``
   consecutive steps, and the noise of those ``b`` steps is one Gaussian release of the
   unit's ``b`` contributions through the factor ``C``, whose columns have unit norm);
3. **the coefficients** ``c_0 … c_{b−1}`` of ``C``: the truncated square root of the
   prefix-sum matrix (``"sqrt"``, the default and what the accuracy evidence is for) or
   coefficients optimised for the workload over the run (``"optimised"``);
4. **an adaptive optimizer's learning-rate factor**
   ``ρ = σ_b·√v̄ / σ_1`` (:func:`~adaclip.correlated.coefficients.adaptive_lr_scale`): Adam
   divides by a running second moment that the noise dominates, and banded noise makes it
   ``ρ²`` times DP-SGD's, so a learning rate tuned for DP-SGD is ``ρ`` times too small for
   banded noise. With the factor the choice of ``b`` is the expected-error rule's own; without
   it an adaptive optimizer's candidates stop at :data:`ADAPTIVE_OPTIMIZER_MAX_BANDS`.

:func:`plan_banded_noise` makes all four, as ``adaclip_torch.make_private`` does when it
chooses (the same rule, the same calibration), for the JAX transformations, the Flower
server or any loop of one's own. Privacy: every input is public and fixed before training
(the target, the sampling rate, the number of steps, the optimizer's kind, the model's size),
and no data is read, so the plan itself costs no privacy. The plan's accounting holds only if
the run samples with cyclic Poisson sampling at ``b·q`` (the frameworks' cyclic samplers) and
adds ``σ_b`` times the correlated noise with these coefficients at every step.
"""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Callable, Sequence
from typing import NamedTuple

from adaclip import accounting as _accounting
from adaclip.correlated import coefficients as _coefficients
from adaclip.correlated.mechanism import BandedNoise, accounted_sample_rate, accounted_steps
from adaclip.errors import InvalidHyperparameterError
from adaclip.options import integer_at_least, positive_int, validate_sample_rate

__all__ = [
    "ADAPTIVE_OPTIMIZER_MAX_BANDS",
    "MIN_STEPS_FOR_BANDS",
    "BANDED_BUFFER_BUDGET_BYTES",
    "BAND_CANDIDATES",
    "BandedNoisePlan",
    "banded_sigma_calibrator",
    "candidate_bands",
    "choose_banded_noise",
    "plan_banded_noise",
]

#: The numbers of bands the library chooses among (1: DP-SGD, always one).
BAND_CANDIDATES: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
#: An adaptive optimizer (Adam and kin) whose learning rate is *not* scaled by ρ gets at most this
#: many bands. An empirical rule from our benchmark, from before the factor existed: on MNIST-1D's
#: long run with Adam at ε = 3 the expected-error rule's b = 32 was level with DP-SGD at DP-SGD's
#: learning rate while b = 4 was ahead by 4.2 ± 0.2 points. With the learning rate times ρ the
#: rule's own b is the better choice.
ADAPTIVE_OPTIMIZER_MAX_BANDS = 4
#: The chosen b keeps the buffers, ``(b − 1)·d`` numbers, within this many bytes (1 GiB): a
#: 124M-parameter model in float32 gets at most b = 2. A ``bands=`` given by the user is kept.
BANDED_BUFFER_BUDGET_BYTES = 2**30

#: Runs shorter than this many steps get ``b = 1`` (DP-SGD) from the rule. An empirical rule
#: (``benchmarks/results/utility_short_runs.md``, 10 seeds): on 16-step runs the expected-error
#: choice (b = 2 … 16) was behind DP-SGD by 0.5–1.3 points in 7 of 10 cells (MNIST and digits
#: MLPs, ε ∈ {1, 3, 8}), while at 60 steps it was never behind. The expected error prices only
#: the noise; on short runs cyclic sampling's cost (measured with the noise at zero: up to
#: 1.7 points on MNIST) and few steps dominate. 50 lies between the 22-step cells of round
#: three (level) and the 60/66-step ones (ahead); 22–60 steps are otherwise untested.
MIN_STEPS_FOR_BANDS = 50

#: :func:`plan_banded_noise` says what it planned through this logger, once per call (INFO).
logger = logging.getLogger(__name__)

_WORKLOADS = ("prefix", "momentum")
_BAND_COEFFICIENTS = ("sqrt", "optimised")


class BandedNoisePlan(NamedTuple):
    """What a banded-noise run needs before its first step (:func:`plan_banded_noise`).

    Attributes:
      bands: ``b`` (1: DP-SGD, independent noise and plain Poisson sampling).
      coefficients: ``c_0 … c_{b−1}`` (unit norm; ``(1.0,)`` for ``b = 1``).
      noise_multiplier: ``σ_b``, calibrated for ``⌈T/b⌉`` compositions at rate ``b·q``.
      sample_rate: ``q``, the expected fraction of units in a step.
      steps: ``T``, the steps the calibration is for.
      lr_scale: ``ρ``, the factor for an adaptive optimizer's learning rate (1.0 when not scaled).
      independent_noise_multiplier: ``σ_1``, DP-SGD's noise multiplier for the same run (the
        denominator of ρ, and what ``b = 1`` would use).
      accountant: the accountant σ was calibrated with (``"pld"`` or ``"rdp"``).
      target_epsilon: ε of the budget the plan was calibrated for (``None``: not recorded).
      delta: δ of that budget (``None``: not recorded).
      bands_chosen: whether ``b`` was chosen by the library's rule (``bands=None``) rather
        than given.

    :meth:`summary` says all of it in a few lines; ``print(plan.summary())``.
    """

    bands: int
    coefficients: tuple[float, ...]
    noise_multiplier: float
    sample_rate: float
    steps: int
    lr_scale: float
    independent_noise_multiplier: float
    accountant: str = "pld"
    target_epsilon: float | None = None
    delta: float | None = None
    bands_chosen: bool = False

    def summary(self) -> str:
        """The plan in words: the noise, σ and its budget, the accounting, the sampling and ρ."""
        if self.bands == 1:
            noise = "independent noise (DP-SGD), b = 1"
        else:
            noise = f"banded noise, b = {self.bands}"
        if self.bands_chosen:
            noise += " (chosen by the expected-error rule)"
        budget = ""
        if self.target_epsilon is not None and self.delta is not None:
            budget = f" for epsilon = {self.target_epsilon:g}, delta = {self.delta:g}"
        sampling = (
            "Poisson sampling at rate q"
            if self.bands == 1
            else f"cyclic Poisson sampling: b = {self.bands} groups, each step one group at rate b*q"
        )
        lines = [
            f"noise: {noise}",
            f"noise multiplier (sigma): {self.noise_multiplier:.6g}, calibrated with {self.accountant}{budget} "
            f"(DP-SGD's for the same run: {self.independent_noise_multiplier:.6g})",
            f"steps: {self.steps}, accounted as {self.compositions} composition(s) at rate "
            f"{self.accounted_sample_rate:.6g} (q = {self.sample_rate:.6g})",
            f"sampling: {sampling}",
            f"adaptive optimizer's learning rate factor (lr_scale): {self.lr_scale:.6g}"
            + (" -- multiply your Adam learning rate by it" if self.lr_scale != 1.0 else ""),
        ]
        return "BandedNoisePlan\n" + "\n".join(f"  {line}" for line in lines)

    @property
    def noise(self) -> BandedNoise:
        """The mechanism, for ``noise_mechanism=`` of the transformations and wrappers."""
        return BandedNoise(self.coefficients)

    @property
    def noise_mechanism(self) -> str:
        """``"banded"``, or ``"independent"`` when ``b = 1``."""
        return self.noise.name

    @property
    def accounted_sample_rate(self) -> float:
        """``p = b·q``: each step's sampling rate within its group (the accountant's rate)."""
        return accounted_sample_rate(self.sample_rate, self.bands)

    @property
    def compositions(self) -> int:
        """``⌈T/b⌉``: the Poisson-subsampled Gaussian events the accountant records."""
        return accounted_steps(self.steps, self.bands)

    def buffer_numbers(self, parameters: int) -> int:
        """``(b − 1)·d``: the numbers of noise state kept for a model of ``d`` parameters."""
        return (self.bands - 1) * integer_at_least("parameters", parameters, 0)


def candidate_bands(
    *,
    sample_rate: float,
    steps: int,
    adaptive_optimizer: bool = False,
    lr_scaled: bool = False,
    bytes_per_band: int = 0,
    buffer_budget_bytes: int = BANDED_BUFFER_BUDGET_BYTES,
    candidates: Sequence[int] = BAND_CANDIDATES,
) -> list[int]:
    """The numbers of bands the choice is made among: each ``b`` of ``candidates`` with
    ``b·q ≤ 1`` (cyclic Poisson sampling), ``b ≤ T``, buffers ``(b − 1)·bytes_per_band`` within
    ``buffer_budget_bytes``, and, for an adaptive optimizer whose learning rate is not scaled by
    ρ, ``b ≤`` :data:`ADAPTIVE_OPTIMIZER_MAX_BANDS`. A run of fewer than
    :data:`MIN_STEPS_FOR_BANDS` steps gets only ``b = 1`` (DP-SGD): there the measured choice was
    more often behind DP-SGD than ahead. Public quantities only."""
    q = validate_sample_rate(sample_rate)
    n = positive_int("steps", steps)
    per_band = integer_at_least("bytes_per_band", bytes_per_band, 0)
    budget = integer_at_least("buffer_budget_bytes", buffer_budget_bytes, 0)
    capped = bool(adaptive_optimizer) and not bool(lr_scaled)
    cap = ADAPTIVE_OPTIMIZER_MAX_BANDS if capped else max(candidates)
    if n < MIN_STEPS_FOR_BANDS:
        cap = 1
    return [b for b in candidates
            if b * q <= 1 and b <= n and b <= cap and (b - 1) * per_band <= budget]  # fmt: skip


def banded_sigma_calibrator(
    *,
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    accountant: str = "pld",
    progress: bool | None = None,
    cache: dict[int, float] | None = None,
) -> Callable[[int], float]:
    """``b ↦ σ_b``: the noise multiplier calibrated for ``(ε, δ)`` as ``⌈T/b⌉`` compositions of
    the Poisson-subsampled Gaussian at rate ``b·q`` (``b = 1``: DP-SGD's). Each ``b`` is
    calibrated once, in ``cache`` (a PLD calibration takes seconds); arguments checked by the
    caller. Looks :func:`adaclip.accounting.calibrate_noise_multiplier` up at each call."""
    calibrated = {} if cache is None else cache

    def guess(b: int) -> float | None:
        # σ_b grows by about 1.25 per doubling of b (a starting point for the search only)
        if accountant != "pld" or not calibrated:
            return None
        near = min(calibrated, key=lambda k: abs(math.log(k / b)))
        return calibrated[near] * 1.25 ** math.log2(b / near)

    def sigma_for(b: int) -> float:
        if b not in calibrated:
            start = guess(b)
            calibrated[b] = _accounting.calibrate_noise_multiplier(
                target_epsilon=target_epsilon, delta=delta, sample_rate=accounted_sample_rate(sample_rate, b),
                steps=accounted_steps(steps, b), accountant=accountant, progress=progress,
                **({} if start is None else {"initial_sigma": start}),
            )  # fmt: skip
        return calibrated[b]

    return sigma_for


def choose_banded_noise(
    *,
    bands: int | None,
    steps: int | None,
    sigma_for_bands: Callable[[int], float] | None,
    candidates: Sequence[int] = (),
    optimise: bool = False,
    workload: str = "prefix",
    momentum: float = 0.9,
) -> BandedNoise:
    """The banded noise of a run: ``bands`` given, or chosen among ``candidates``
    (:func:`candidate_bands`) by the expected-error rule with ``sigma_for_bands``
    (:func:`banded_sigma_calibrator`); the square-root coefficients, or (``optimise``, with
    ``steps`` known and ``b > 1``) coefficients optimised for the workload over ``steps``.
    Arguments checked by the caller."""
    shape = {"workload": workload, "momentum": momentum} if workload == "momentum" else {"workload": workload}
    if bands is None:
        assert steps is not None and sigma_for_bands is not None
        bands, _ = _coefficients.choose_bands(
            candidates=candidates, n=steps, sigma_for_bands=sigma_for_bands, optimise=optimise, **shape
        )
    if not optimise or steps is None or bands == 1:
        return BandedNoise(_coefficients.sqrt_toeplitz_coefficients(bands))
    return BandedNoise(_coefficients.optimise_banded_coefficients(bands, steps, **shape))


def plan_banded_noise(
    *,
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    bands: int | None = None,
    workload: str = "prefix",
    momentum: float = 0.9,
    adaptive_optimizer: bool = False,
    scale_adaptive_lr: bool | None = None,
    band_coefficients: str = "sqrt",
    accountant: str = "pld",
    bytes_per_band: int = 0,
    buffer_budget_bytes: int = BANDED_BUFFER_BUDGET_BYTES,
    progress: bool | None = None,
) -> BandedNoisePlan:
    """Plan a banded-noise run for a target ``(ε, δ)``: ``b``, ``σ_b``, the coefficients and ρ.

    The same rule and calibration as ``adaclip_torch.make_private(..., noise_mechanism="banded",
    bands=None, target_epsilon=ε, delta=δ, epochs=E)`` (see the module docstring for the maths
    and the privacy argument). Use it with the JAX transformations::

        plan = plan_banded_noise(target_epsilon=3.0, delta=1e-5, sample_rate=q, steps=T,
                                 workload="momentum", momentum=0.9, adaptive_optimizer=True)
        private = adaclip_jax.adaclip(noise_multiplier=plan.noise_multiplier,
                                      noise_mechanism=plan.noise, ...)
        tx = adaclip_jax.private_chain(private, optax.adam(learning_rate * plan.lr_scale))
        # sample each step with adaclip_jax.cyclic_poisson_mask(..., plan.accounted_sample_rate,
        # bands=plan.bands); account with PrivacyTracker(..., bands=plan.bands)

    Args:
      target_epsilon: ε of the whole run's budget (> 0).
      delta: δ of that budget, in (0, 1).
      sample_rate: ``q``, each unit's probability of being in a step's batch (plain Poisson
        terms; the groups' rate is ``b·q``).
      steps: ``T``, the number of steps of the run.
      bands: ``b`` given (kept as is, σ calibrated for it), or ``None``: chosen by the rule.
      workload: what training integrates of the releases: ``"momentum"`` (SGD with momentum,
        and Adam's first moment, β1 as ``momentum``) or ``"prefix"`` (plain SGD).
      momentum: the workload's momentum, in (0, 1).
      adaptive_optimizer: the optimizer divides by a running second moment (Adam, AdamW, ...).
      scale_adaptive_lr: multiply an adaptive optimizer's learning rate by ρ (``lr_scale``):
        ``None`` (default) when ``adaptive_optimizer`` and ``b > 1``; ``True``: the same,
        refused without ``adaptive_optimizer``; ``False``: never (and the choice of ``b`` then
        stops at :data:`ADAPTIVE_OPTIMIZER_MAX_BANDS` for an adaptive optimizer).
      band_coefficients: ``"sqrt"`` (default) or ``"optimised"`` (for the workload over ``T``).
      accountant: ``"pld"`` (default: the tightest valid accounting) or ``"rdp"`` (looser: about
        7 % more noise); ``"prv"`` is taken as ``"pld"``.
      bytes_per_band: the bytes of one band's buffer (the trainable parameters' elements times
        their element size): with ``bands=None`` larger ``b`` whose buffers exceed
        ``buffer_budget_bytes`` are left out. 0 (default): no memory limit.
      buffer_budget_bytes: the buffers' memory budget (default 1 GiB).
      progress: show slow calibrations on stderr (``None``: once they have taken a second;
        see :mod:`adaclip._progress`).

    Returns:
      a :class:`BandedNoisePlan`.

    Raises:
      InvalidHyperparameterError: an argument out of range or inconsistent with another, raised
        before any calibration.
    """
    q = validate_sample_rate(sample_rate)
    n = positive_int("steps", steps)
    if not isinstance(workload, str) or workload not in _WORKLOADS:
        raise InvalidHyperparameterError(f"workload must be one of {_WORKLOADS}, got {workload!r}")
    if isinstance(momentum, bool) or not isinstance(momentum, numbers.Real) or not (0 < float(momentum) < 1):
        raise InvalidHyperparameterError(f"momentum must be a number in (0, 1), got {momentum!r}")
    if not isinstance(adaptive_optimizer, bool):
        raise InvalidHyperparameterError(f"adaptive_optimizer must be a bool, got {adaptive_optimizer!r}")
    if scale_adaptive_lr is not None and not isinstance(scale_adaptive_lr, bool):
        raise InvalidHyperparameterError(f"scale_adaptive_lr must be True, False or None, got {scale_adaptive_lr!r}")
    if scale_adaptive_lr is True and not adaptive_optimizer:
        raise InvalidHyperparameterError(
            "scale_adaptive_lr=True is for adaptive optimizers (Adam and kin, adaptive_optimizer=True): "
            "SGD's step does not divide by the noise's second moment"
        )
    if not isinstance(band_coefficients, str) or band_coefficients not in _BAND_COEFFICIENTS:
        raise InvalidHyperparameterError(
            f"band_coefficients must be one of {_BAND_COEFFICIENTS}, got {band_coefficients!r}"
        )
    if not isinstance(progress, (bool, type(None))):
        raise InvalidHyperparameterError(f"progress must be True, False or None, got {progress!r}")
    mechanism = _accounting.resolve_mechanism(accountant)
    if isinstance(target_epsilon, bool) or not isinstance(target_epsilon, numbers.Real) or not (
        math.isfinite(float(target_epsilon)) and float(target_epsilon) > 0
    ):
        raise InvalidHyperparameterError(f"target_epsilon must be a finite number > 0, got {target_epsilon!r}")
    if isinstance(delta, bool) or not isinstance(delta, numbers.Real) or not (0 < float(delta) < 1):
        raise InvalidHyperparameterError(f"delta must be a number in (0, 1), got {delta!r}")
    chosen = bands is None  # b by the library's rule, not given
    if bands is not None:
        bands = positive_int("bands", bands)
        accounted_sample_rate(q, bands)  # refuses b·q > 1 with the message naming the largest b
        if bands > n:
            raise InvalidHyperparameterError(f"bands={bands} exceeds the run's steps={n}")
    per_band = integer_at_least("bytes_per_band", bytes_per_band, 0)
    budget = integer_at_least("buffer_budget_bytes", buffer_budget_bytes, 0)
    lr_scaled = adaptive_optimizer and scale_adaptive_lr is not False
    sigma_for = banded_sigma_calibrator(
        target_epsilon=float(target_epsilon), delta=float(delta), sample_rate=q, steps=n, accountant=mechanism,
        progress=progress,
    )  # fmt: skip
    candidates = () if bands is not None else candidate_bands(
        sample_rate=q, steps=n, adaptive_optimizer=adaptive_optimizer, lr_scaled=lr_scaled, bytes_per_band=per_band,
        buffer_budget_bytes=budget,
    )  # fmt: skip
    noise = choose_banded_noise(
        bands=bands, steps=n, sigma_for_bands=sigma_for, candidates=candidates,
        optimise=band_coefficients == "optimised", workload=workload, momentum=float(momentum),
    )  # fmt: skip
    bands, coefficients = noise.bands, noise.coefficients
    sigma = sigma_for(bands)
    sigma_independent = sigma_for(1)
    lr_scale = 1.0
    if lr_scaled and bands > 1:
        lr_scale = _coefficients.adaptive_lr_scale(coefficients, n, sigma=sigma, sigma_independent=sigma_independent)
    plan = BandedNoisePlan(
        bands=int(bands), coefficients=tuple(float(c) for c in coefficients), noise_multiplier=float(sigma),
        sample_rate=q, steps=n, lr_scale=float(lr_scale), independent_noise_multiplier=float(sigma_independent),
        accountant=mechanism, target_epsilon=float(target_epsilon), delta=float(delta), bands_chosen=chosen,
    )  # fmt: skip
    logger.info("plan_banded_noise planned:\n%s", plan.summary())  # public quantities only
    return plan
