"""The affine clipping family and the one private step that serves all of it.

A *strategy* says how to transform per-unit gradients before clipping (centre ``a``, scale
``b``), how to group coordinates for clipping, and how its state evolves from the released
gradient. :func:`private_step` runs the shared path for any strategy:

==============  =========  ===========================  ================================
strategy        centre a   scale b                      clip
==============  =========  ===========================  ================================
FlatClipping    0          C                            ‖w‖ ≤ 1
PerLayer…       0          C = sqrt(Σ_k C_k²)           ‖w_k‖ ≤ C_k / C per group
Scaled…         0          C·α_k on group k             ‖w‖ ≤ 1
AdaptiveClip…   m_t        sqrt(s_t)·sqrt(Σ s_t)        ‖w‖ ≤ 1   (the patent; options below)
QuantileClip…   0          C_t (quantile rule)          ‖w‖ ≤ 1, plus a released count
AutomaticClip…  0          C                            w/(‖w‖ + γ)  (normalisation)
==============  =========  ===========================  ================================

In every case each unit's contribution has norm ≤ 1 in w-space, so a step is the sampled
Gaussian mechanism with sensitivity 1 and noise multiplier σ (accounted by
:mod:`adaclip.accounting`). The centre and scale depend only on the state, which depends only
on earlier *released* values: post-processing. A strategy may release more than the gradient
in the same step (the quantile rule's count of unclipped units): such *auxiliary* sums ride
along with the clipped sum as extra entries, get their own noise, and the gradient's noise
multiplier is raised so that the whole release is one Gaussian mechanism with multiplier σ
(:meth:`Strategy.noise_multipliers`).

Strategies are frozen dataclasses; they validate their hyperparameters on construction and
raise :class:`~adaclip.errors.InvalidHyperparameterError` naming the offending one.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

from adaclip import adaptive, transform
from adaclip._array import namespace
from adaclip.errors import InvalidHyperparameterError, NoiseDominatedWarning

Array = Any

__all__ = [
    "ClipState",
    "Strategy",
    "FlatClipping",
    "PerLayerClipping",
    "ScaledClipping",
    "AdaptiveClipping",
    "QuantileRule",
    "QuantileClipping",
    "AutomaticClipping",
    "adaptive_clipping",
    "ADAPTIVE_PRESETS",
    "DEFAULT_PRESET",
    "std_bounds_for_initial_clip",
    "noise_drift_number",
    "warn_if_noise_dominated",
    "clip_and_sum",
    "auxiliary_sums",
    "num_tensors_of",
    "release",
    "private_step",
    "per_tensor_clip_factors",
    "group_clip_factors",
    "validate_mechanism",
    "validate_sample_rate",
]


class ClipState(NamedTuple):
    """State of a strategy, one entry per parameter tensor.

    Attributes:
      step: number of steps taken (an int, or a scalar array under ``jax.jit``).
      mean: AdaCliP's mean estimates ``m`` (``None`` for strategies without one).
      std: AdaCliP's standard-deviation estimates ``s`` (``None`` likewise).
      extra: option-specific state (``None`` when there is none), a dict whose values are lists
        with one entry per tensor (an array, or ``None`` where the entry does not apply) or
        0-d arrays: ``"variance"`` (the unclamped variance EMA), ``"rows"``/``"cols"``
        (factored EMAs), ``"window_sum"``/``"window_noise"``/``"window_count"`` (delayed
        statistics), ``"centre_var"`` (the Kalman centre's variance), ``"clip_norm"`` (the
        quantile rule's ``C_t``). Like ``mean`` and ``std``, every entry is a function of
        released values only.
    """

    step: Any
    mean: list[Array] | None = None
    std: list[Array] | None = None
    extra: dict[str, Any] | None = None


# --------------------------------------------------------------------------- validation


def _finite_positive(name: str, value: Any, *, allow_zero: bool = False) -> float:
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise InvalidHyperparameterError(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(x) or x < 0 or (x == 0 and not allow_zero):
        raise InvalidHyperparameterError(
            f"{name} must be finite and {'>= 0' if allow_zero else '> 0'}, got {value!r}"
        )
    return x


def _beta(name: str, value: Any) -> float:
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise InvalidHyperparameterError(f"{name} must be a number, got {value!r}") from None
    if not 0.0 <= x < 1.0:
        raise InvalidHyperparameterError(f"{name} must be in [0, 1), got {value!r}")
    return x


def _positive_list(name: str, values: Any) -> tuple[float, ...]:
    try:
        out = tuple(float(v) for v in values)
    except (TypeError, ValueError):
        raise InvalidHyperparameterError(f"{name} must be a sequence of numbers, got {values!r}") from None
    if not out or any(not math.isfinite(v) or v <= 0 for v in out):
        raise InvalidHyperparameterError(f"{name} must be positive finite numbers, got {values!r}")
    return out


def validate_sample_rate(sample_rate: Any) -> float:
    """Check the Poisson sampling rate ``q ∈ (0, 1]``; return it as a float."""
    try:
        q = float(sample_rate)
    except (TypeError, ValueError):
        raise InvalidHyperparameterError(f"sample_rate must be a number, got {sample_rate!r}") from None
    if not 0.0 < q <= 1.0:
        raise InvalidHyperparameterError(f"sample_rate must be in (0, 1], got {sample_rate!r}")
    return q


def validate_mechanism(noise_multiplier: Any, expected_batch_size: Any) -> tuple[float, float]:
    """Check ``σ >= 0`` and ``B̄ > 0`` (finite); return them as floats."""
    return (
        _finite_positive("noise_multiplier", noise_multiplier, allow_zero=True),
        _finite_positive("expected_batch_size", expected_batch_size),
    )


# --------------------------------------------------------------------------- strategies


class Strategy(Protocol):
    """What :func:`private_step` needs from a strategy.

    ``num_auxiliary`` sums are released with the gradient (0 for most strategies): they are
    appended to the clipped sum, noised with ``noise_multipliers(σ, B̄)[1]`` and handed to
    ``update`` as ``auxiliary``. The framework paths (PyTorch, JAX, data parallel, virtual
    steps) treat them as extra entries of the sum and never branch on the strategy.
    """

    num_auxiliary: int

    def init(self, params: Sequence[Array]) -> ClipState: ...

    def transform(self, state: ClipState, num_tensors: int) -> tuple[list[Array] | None, list[Any]]:
        """``(centre, scale)`` for this step, from the state only."""
        ...

    def clip_groups(self, num_tensors: int) -> list[tuple[list[int], float]]:
        """``[(tensor indices, radius), ...]``: each group's transformed norm is clipped to
        its radius; the radii satisfy ``Σ r² <= 1``."""
        ...

    def clip_factors(self, sq_norm: Array, radius: float) -> Array:
        """The ``(n,)`` factors ``c_i`` from upper bounds of a group's squared norms, with
        ``‖c_i w_i‖ ≤ radius`` (0 for a non-finite norm)."""
        ...

    def auxiliary_sums(self, state: ClipState, sq_norms: Sequence[Array], factors: Sequence[Array]) -> list[Array]:
        """``num_auxiliary`` 0-d sums over the units (e.g. the count of unclipped units)."""
        ...

    def noise_multipliers(self, noise_multiplier: Any, expected_batch_size: Any) -> tuple[Any, Any]:
        """``(σ_g, σ_aux)``: the noise multipliers of the gradient and of the auxiliary sums
        for a step accounted at ``σ``."""
        ...

    def update(
        self,
        state: ClipState,
        noisy_grad: list[Array],
        scale: list[Any],
        *,
        auxiliary: Sequence[Array] = (),
        noise_multiplier: Any,
        expected_batch_size: Any,
    ) -> ClipState:
        """The next state from the release (``noise_multiplier`` is ``σ_g``)."""
        ...


def _whole_vector(num_tensors: int) -> list[tuple[list[int], float]]:
    return [(list(range(num_tensors)), 1.0)]


class _AffineDefaults:
    """Defaults of the protocol: clip to the radius, nothing released beside the gradient."""

    num_auxiliary = 0

    def clip_factors(self, sq_norm: Array, radius: float) -> Array:
        return transform.clip_factors(sq_norm, radius)

    def auxiliary_sums(self, state: ClipState, sq_norms, factors) -> list[Array]:
        return []

    def noise_multipliers(self, noise_multiplier: Any, expected_batch_size: Any) -> tuple[Any, Any]:
        return noise_multiplier, 0.0


class _StatelessMixin(_AffineDefaults):
    def init(self, params: Sequence[Array]) -> ClipState:
        return ClipState(step=0)

    def update(self, state: ClipState, noisy_grad, scale, *, auxiliary=(), noise_multiplier, expected_batch_size) -> ClipState:
        return state._replace(step=state.step + 1)


@dataclasses.dataclass(frozen=True)
class FlatClipping(_StatelessMixin):
    """DP-SGD: clip each unit's whole gradient to ``max_grad_norm`` (C)."""

    max_grad_norm: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "max_grad_norm", _finite_positive("max_grad_norm", self.max_grad_norm))

    def transform(self, state: ClipState, num_tensors: int):
        return None, [self.max_grad_norm] * num_tensors

    def clip_groups(self, num_tensors: int):
        return _whole_vector(num_tensors)


@dataclasses.dataclass(frozen=True)
class PerLayerClipping(_StatelessMixin):
    """Per-layer clipping (McMahan et al. 2018): tensor ``k`` clipped to ``C_k``, noise ``σ·C``.

    ``C = sqrt(Σ_k C_k²)``. Without ``group_max_grad_norms``, ``C_k = max_grad_norm/√K``
    (the budget spread equally over the K tensors), so ``C = max_grad_norm``.
    """

    max_grad_norm: float | None = None
    group_max_grad_norms: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.group_max_grad_norms is not None:
            norms = _positive_list("group_max_grad_norms", self.group_max_grad_norms)
            object.__setattr__(self, "group_max_grad_norms", norms)
            if self.max_grad_norm is not None:
                raise InvalidHyperparameterError(
                    "give either max_grad_norm or group_max_grad_norms, not both"
                )
        elif self.max_grad_norm is None:
            raise InvalidHyperparameterError("PerLayerClipping needs max_grad_norm or group_max_grad_norms")
        else:
            object.__setattr__(self, "max_grad_norm", _finite_positive("max_grad_norm", self.max_grad_norm))

    def _thresholds(self, num_tensors: int) -> tuple[float, ...]:
        if self.group_max_grad_norms is None:
            return (self.max_grad_norm / math.sqrt(num_tensors),) * num_tensors
        if len(self.group_max_grad_norms) != num_tensors:
            raise InvalidHyperparameterError(
                f"group_max_grad_norms has {len(self.group_max_grad_norms)} entries for "
                f"{num_tensors} parameter tensors"
            )
        return self.group_max_grad_norms

    def total_norm(self, num_tensors: int) -> float:
        """``C = sqrt(Σ_k C_k²)``, the sensitivity in gradient space."""
        return math.sqrt(sum(c * c for c in self._thresholds(num_tensors)))

    def transform(self, state: ClipState, num_tensors: int):
        return None, [self.total_norm(num_tensors)] * num_tensors

    def clip_groups(self, num_tensors: int):
        total = self.total_norm(num_tensors)
        return [([k], c / total) for k, c in enumerate(self._thresholds(num_tensors))]


@dataclasses.dataclass(frozen=True)
class ScaledClipping(_StatelessMixin):
    """eDP-SGD scaling (Dupuy et al., *An efficient DP-SGD mechanism for large scale NLU models*): scale ``C·α_k`` on tensor ``k``, clip the whole vector.

    ``layer_scales`` (the ``α_k``) must come from public data or from a privatised,
    accounted release: see :mod:`adaclip.layer_scales`. Taking them from the private first
    batch in the clear leaks that batch.
    """

    max_grad_norm: float
    layer_scales: tuple[float, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "max_grad_norm", _finite_positive("max_grad_norm", self.max_grad_norm))
        object.__setattr__(self, "layer_scales", _positive_list("layer_scales", self.layer_scales))

    def transform(self, state: ClipState, num_tensors: int):
        if len(self.layer_scales) != num_tensors:
            raise InvalidHyperparameterError(
                f"layer_scales has {len(self.layer_scales)} entries for {num_tensors} parameter tensors"
            )
        return None, [self.max_grad_norm * a for a in self.layer_scales]

    def clip_groups(self, num_tensors: int):
        return _whole_vector(num_tensors)


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise InvalidHyperparameterError(f"{name} must be one of {allowed}, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class QuantileRule(_AffineDefaults):
    """The quantile rule for the clip norm (Andrew et al., *Differentially private learning
    with adaptive clipping*, 2021): ``C_{t+1} = C_t·exp(−η(f̃_t − γ))``, ``f̃_t`` the released
    fraction of units whose transformed norm was at most 1 (unclipped).

    Each unit adds ``1[‖w_i‖ ≤ 1] − ½`` to a count released with noise ``N(0, σ_b²)``
    (sensitivity ½); the gradient's noise multiplier is raised to
    ``σ_g = (σ⁻² − (2σ_b)⁻²)^{-1/2}`` so that the gradient and the count together are one
    Gaussian mechanism with multiplier ``σ``, which is what the accountant records.

    Args:
      target_quantile: ``γ ∈ (0, 1)``, the fraction of units left unclipped at equilibrium.
      learning_rate: ``η > 0`` of the geometric update.
      count_noise_multiplier: ``σ_b`` in units of the count; ``None``: ``B̄/20`` (the paper's
        recommendation). Must exceed ``σ/2`` at every step.
    """

    target_quantile: float = 0.5
    learning_rate: float = 0.2
    count_noise_multiplier: float | None = None

    def __post_init__(self) -> None:
        q = _finite_positive("target_quantile", self.target_quantile)
        if not 0.0 < q < 1.0:
            raise InvalidHyperparameterError(f"target_quantile must be in (0, 1), got {self.target_quantile!r}")
        object.__setattr__(self, "target_quantile", q)
        object.__setattr__(self, "learning_rate", _finite_positive("learning_rate", self.learning_rate))
        if self.count_noise_multiplier is not None:
            object.__setattr__(
                self, "count_noise_multiplier", _finite_positive("count_noise_multiplier", self.count_noise_multiplier)
            )

    def count_noise(self, expected_batch_size: Any) -> Any:
        """``σ_b``: the given one, or ``B̄/20``."""
        return expected_batch_size / 20.0 if self.count_noise_multiplier is None else self.count_noise_multiplier

    def noise_multipliers(self, noise_multiplier: Any, expected_batch_size: Any) -> tuple[Any, Any]:
        """``(σ_g, σ_b)`` (both 0 for ``σ = 0``); raises for ``σ ≥ 2σ_b`` (Python numbers)."""
        sigma_b = self.count_noise(expected_batch_size)
        sigma_g = adaptive.split_noise_multiplier(noise_multiplier, sigma_b)
        if isinstance(noise_multiplier, (int, float)):
            return sigma_g, (0.0 if float(noise_multiplier) == 0.0 else sigma_b)
        return sigma_g, sigma_b * (noise_multiplier > 0)

    def count(self, sq_norms: Sequence[Array], factors: Sequence[Array]) -> Array:
        """``Σ_i (1[‖w_i‖ ≤ 1] − ½)`` over the units (0 for dropped or masked units), from the
        whole vector's squared-norm bound (enlarged for the rounding of the sum over tensors)."""
        total = sum(sq_norms[1:], sq_norms[0])
        total = total * (1.0 + 2.0 * len(sq_norms) * transform.unit_roundoff(total.dtype))
        xp = namespace(total)
        return xp.sum(adaptive.unclipped_indicator(total, 1.0, factors[0]))

    def next_clip_norm(self, clip_norm: Any, noisy_count: Any, expected_batch_size: Any) -> Any:
        return adaptive.quantile_update(
            clip_norm,
            noisy_count,
            expected_batch_size=expected_batch_size,
            target_quantile=self.target_quantile,
            learning_rate=self.learning_rate,
        )


def _scalar_like(params: Sequence[Array], value: float) -> Array:
    """A 0-d array of ``params[0]``'s namespace, dtype and device holding ``value``."""
    xp = namespace(*params)
    return xp.full_like(xp.sum(params[0]), value)


@dataclasses.dataclass(frozen=True)
class QuantileClipping(_AffineDefaults):
    """Flat clipping with the quantile-adapted clip norm ``C_t`` (:class:`QuantileRule`).

    ``max_grad_norm`` is the initial ``C_0``. The state holds ``C_t`` (``extra["clip_norm"]``),
    a function of the released counts only.
    """

    max_grad_norm: float = 1.0
    quantile: QuantileRule = dataclasses.field(default_factory=QuantileRule)

    num_auxiliary = 1
    #: ``C_t`` lives in the state; a schedule cannot set it (:func:`adaclip.schedules.apply_to_strategy`).
    adapts_clip_norm = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "max_grad_norm", _finite_positive("max_grad_norm", self.max_grad_norm))
        if not isinstance(self.quantile, QuantileRule):
            raise InvalidHyperparameterError(f"quantile must be a QuantileRule, got {self.quantile!r}")

    def init(self, params: Sequence[Array]) -> ClipState:
        return ClipState(step=0, extra={"clip_norm": _scalar_like(params, self.max_grad_norm)})

    def transform(self, state: ClipState, num_tensors: int):
        return None, [state.extra["clip_norm"]] * num_tensors

    def clip_groups(self, num_tensors: int):
        return _whole_vector(num_tensors)

    def auxiliary_sums(self, state: ClipState, sq_norms, factors) -> list[Array]:
        return [self.quantile.count(sq_norms, factors)]

    def noise_multipliers(self, noise_multiplier: Any, expected_batch_size: Any) -> tuple[Any, Any]:
        return self.quantile.noise_multipliers(noise_multiplier, expected_batch_size)

    def update(self, state, noisy_grad, scale, *, auxiliary=(), noise_multiplier, expected_batch_size) -> ClipState:
        clip_norm = self.quantile.next_clip_norm(state.extra["clip_norm"], auxiliary[0], expected_batch_size)
        return ClipState(step=state.step + 1, extra={"clip_norm": clip_norm})


@dataclasses.dataclass(frozen=True)
class AutomaticClipping(_StatelessMixin):
    """Automatic clipping (Bu et al., *Automatic clipping: differentially private deep learning
    made easier and stronger*, 2022): every unit is normalised, ``w̄_i = w_i/(‖w_i‖ + γ)``
    with ``w_i = g_i/C``, so ``‖w̄_i‖ < 1`` (sensitivity 1) and no clip norm needs tuning:
    ``C`` only sets the release's scale (``C = 1`` is the paper's form, the learning rate
    absorbs the rest). ``stability`` is ``γ > 0``.
    """

    max_grad_norm: float = 1.0
    stability: float = 0.01

    def __post_init__(self) -> None:
        object.__setattr__(self, "max_grad_norm", _finite_positive("max_grad_norm", self.max_grad_norm))
        object.__setattr__(self, "stability", _finite_positive("stability", self.stability))

    def transform(self, state: ClipState, num_tensors: int):
        return None, [self.max_grad_norm] * num_tensors

    def clip_groups(self, num_tensors: int):
        return _whole_vector(num_tensors)

    def clip_factors(self, sq_norm: Array, radius: float) -> Array:
        """``r/(‖w‖ + γr)`` from an upper bound of ``‖w‖²`` (so ``‖c·w‖ < r``); 0 if not finite."""
        xp = namespace(sq_norm)
        norm = xp.sqrt(sq_norm)
        factor = radius / (norm + self.stability * radius)
        return xp.where(xp.isfinite(norm), factor, xp.zeros_like(factor))


@dataclasses.dataclass(frozen=True)
class AdaptiveClipping(_AffineDefaults):
    """AdaCliP (Pichapati et al., *AdaCliP: adaptive clipping for private SGD*; US 2021/0049298 A1): centre ``m_t``, scale ``b_t = sqrt(s_t)·sqrt(Σ s_t)``, and its remedies.

    With the defaults this is the patent's algorithm, bit for bit. The keyword-only options
    change one part each (see :mod:`adaclip.adaptive` for the maths of every part); all of
    them read only the state, which reads only released values, so every option is
    post-processing of the same Gaussian mechanism.

    Args:
      std_min: lower end of the range the std estimates ``s`` stay in. With ``std_max`` it
        sets ``s_0 = sqrt(std_min·std_max)`` and how far the clip region can shrink and grow:
        ``b`` at initialisation is ``s_0·sqrt(d)`` per coordinate (coupled scale).
      std_max: upper end of that range.
      beta_mean: ``β1``, interpolation weight of the mean estimate (0.99 in public ports).
      beta_std: ``β2``, interpolation weight of the variance estimate (0.9).
      scale: ``"coupled"`` (the patent, ``b = √s·√Σs``: the statistics set the clip level
        too) or ``"separated"`` (``b = C_t·s^p/mean(s^p)``: the statistics set only the shape,
        ``C_t`` is ``max_grad_norm`` or adapted by ``quantile``).
      max_grad_norm: ``C`` of the separated scale (the initial ``C_0`` with ``quantile``).
      shape_power: ``p`` of the separated scale (0.5: AdaCliP's noise-minimising shape; 1:
        proportional to the spread, as scale-then-privatize).
      statistic: ``"deviation"`` (the spread of ``g̃ − a``, the patent) or
        ``"second_moment"`` (of ``g̃``, scale-then-privatize).
      correction: how the known noise variance ``b²σ²/B̄²`` is removed: ``"clamp"`` (the
        patent: subtract, clamp each step), ``"unbiased"`` (subtract, average unclamped,
        clamp at use) or ``"none"`` (not subtracted).
      pooling: ``"coordinate"`` (the patent), ``"tensor"`` or ``"factored"`` (row × column).
      update_every: ``k``; the statistics are updated every ``k`` steps from the average of
        the last ``k`` releases (delayed statistics); the centre still moves every step.
      centre: ``"ema"`` (the patent), ``"debiased"``, ``"kalman"`` or ``"none"``.
      process_noise: ``ρ`` of the Kalman centre (process variance ``ρ·b²σ²/B̄²``).
      freeze_statistics: keep ``s`` as initialised (e.g. from public data,
        :meth:`with_public_statistics`); the centre and ``C_t`` still move.
      quantile: a :class:`QuantileRule` adapting ``C_t`` (separated scale only); it releases
        a count with the gradient and raises the gradient's noise multiplier accordingly.
      initial_variance: ``u_0``, the start of every variance average (default ``s_0²``);
        ``s`` starts at ``sqrt(clamp(u_0, std_min², std_max²))``. ``0`` starts an average of
        released squares from nothing, as an optimiser's second moment does (the separated
        shape is then flat until the releases lift coordinates above ``std_min``).
    """

    std_min: float = 1e-5
    std_max: float = 1.0
    beta_mean: float = 0.99
    beta_std: float = 0.9
    scale: str = dataclasses.field(default="coupled", kw_only=True)
    max_grad_norm: float | None = dataclasses.field(default=None, kw_only=True)
    shape_power: float = dataclasses.field(default=0.5, kw_only=True)
    statistic: str = dataclasses.field(default="deviation", kw_only=True)
    correction: str = dataclasses.field(default="clamp", kw_only=True)
    pooling: str = dataclasses.field(default="coordinate", kw_only=True)
    update_every: int = dataclasses.field(default=1, kw_only=True)
    centre: str = dataclasses.field(default="ema", kw_only=True)
    process_noise: float = dataclasses.field(default=0.01, kw_only=True)
    freeze_statistics: bool = dataclasses.field(default=False, kw_only=True)
    quantile: QuantileRule | None = dataclasses.field(default=None, kw_only=True)
    initial_variance: float | None = dataclasses.field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        object.__setattr__(self, "std_min", _finite_positive("std_min", self.std_min))
        object.__setattr__(self, "std_max", _finite_positive("std_max", self.std_max))
        if self.std_min > self.std_max:
            raise InvalidHyperparameterError(
                f"std_min must be <= std_max, got std_min={self.std_min!r} > std_max={self.std_max!r}"
            )
        object.__setattr__(self, "beta_mean", _beta("beta_mean", self.beta_mean))
        object.__setattr__(self, "beta_std", _beta("beta_std", self.beta_std))
        _choice("scale", self.scale, adaptive.SCALES)
        _choice("statistic", self.statistic, adaptive.STATISTICS)
        _choice("correction", self.correction, adaptive.CORRECTIONS)
        _choice("pooling", self.pooling, adaptive.POOLINGS)
        _choice("centre", self.centre, adaptive.CENTRES)
        object.__setattr__(self, "shape_power", _finite_positive("shape_power", self.shape_power))
        object.__setattr__(self, "process_noise", _finite_positive("process_noise", self.process_noise))
        k = self.update_every
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise InvalidHyperparameterError(f"update_every must be an int >= 1, got {k!r}")
        if not isinstance(self.freeze_statistics, bool):
            raise InvalidHyperparameterError(f"freeze_statistics must be a bool, got {self.freeze_statistics!r}")
        if self.quantile is not None and not isinstance(self.quantile, QuantileRule):
            raise InvalidHyperparameterError(f"quantile must be a QuantileRule or None, got {self.quantile!r}")
        if self.initial_variance is not None:
            object.__setattr__(
                self, "initial_variance", _finite_positive("initial_variance", self.initial_variance, allow_zero=True)
            )
        if self.scale == "separated":
            if self.max_grad_norm is None:
                raise InvalidHyperparameterError(
                    "scale='separated' needs max_grad_norm (C, or the quantile rule's initial C_0)"
                )
            object.__setattr__(self, "max_grad_norm", _finite_positive("max_grad_norm", self.max_grad_norm))
        else:
            if self.max_grad_norm is not None:
                raise InvalidHyperparameterError(
                    "max_grad_norm applies to scale='separated'; the coupled scale sets its clip level "
                    "from std_min/std_max (see AdaptiveClipping.from_initial_clip)"
                )
            if self.quantile is not None:
                raise InvalidHyperparameterError("quantile adapts the clip norm of scale='separated' only")
            if self.shape_power != 0.5:
                raise InvalidHyperparameterError("shape_power applies to scale='separated' only")

    # ------------------------------------------------------------------ named variants

    @classmethod
    def from_initial_clip(
        cls,
        initial_max_grad_norm: float,
        num_params: int,
        *,
        spread: float = 30.0,
        beta_mean: float = 0.99,
        beta_std: float = 0.9,
        **options: Any,
    ) -> AdaptiveClipping:
        """AdaCliP that starts out clipping like flat clipping at ``initial_max_grad_norm``.

        ``std_min``/``std_max`` come from :func:`std_bounds_for_initial_clip`: the clip
        region at step 0 is the ball of radius ``C0 = initial_max_grad_norm`` (as DP-SGD with
        ``max_grad_norm=C0``) and ``s`` may then move a factor ``spread`` either way.
        ``options``: the keyword-only options of the class (coupled scale).
        """
        std_min, std_max = std_bounds_for_initial_clip(initial_max_grad_norm, num_params, spread=spread)
        return cls(std_min=std_min, std_max=std_max, beta_mean=beta_mean, beta_std=beta_std, **options)

    @classmethod
    def scale_then_privatize(
        cls, max_grad_norm: float, *, beta: float = 0.999, spread: float = 1e4, **options: Any
    ) -> AdaptiveClipping:
        """Scale-then-privatize (Ganesh, McMahan, Thakurta, *On design principles for private
        adaptive optimizers*, 2025): centre 0, scale from the EMA ``v̂`` of the released
        gradients' squares (noise included, as an optimiser's second moment), ``b = C·p``.

        Here ``p = √v̂`` normalised to mean 1 over the coordinates (so ``C`` keeps flat
        clipping's meaning) and floored by the std range (``std_min = 1/spread``), which plays
        the role of the paper's ``ε``. ``v̂`` starts at 0 (``initial_variance=0``), as an
        optimiser's second moment does, so the shape is flat until the releases lift
        coordinates above the floor; normalising the shape makes a bias correction of the
        average unnecessary.
        """
        s0 = 1.0
        defaults = dict(
            std_min=s0 / spread, std_max=s0 * spread, beta_std=beta, scale="separated",
            max_grad_norm=max_grad_norm, shape_power=1.0, statistic="second_moment",
            correction="none", centre="none", initial_variance=0.0,
        )  # fmt: skip
        defaults.update(options)
        return cls(**defaults)

    # ------------------------------------------------------------------ parts

    @property
    def std_init(self) -> float:
        """``s_0 = sqrt(std_min · std_max)``, or ``sqrt(clamp(initial_variance))`` when given."""
        if self.initial_variance is None:
            return math.sqrt(self.std_min * self.std_max)
        return math.sqrt(min(max(self.initial_variance, self.std_min**2), self.std_max**2))

    @property
    def variance_init(self) -> float:
        """``u_0``: ``initial_variance``, or ``s_0²``."""
        return self.std_init**2 if self.initial_variance is None else self.initial_variance

    @property
    def num_auxiliary(self) -> int:  # type: ignore[override]
        return 0 if self.quantile is None else 1

    @property
    def adapts_clip_norm(self) -> bool:
        """Whether ``C_t`` follows the quantile rule (then a schedule cannot set it)."""
        return self.quantile is not None

    @property
    def is_patent(self) -> bool:
        """Whether every option is the patent's (the exact AdaCliP update)."""
        return (
            self.scale == "coupled" and self.statistic == "deviation" and self.correction == "clamp"
            and self.pooling == "coordinate" and self.update_every == 1 and self.centre == "ema"
            and not self.freeze_statistics and self.initial_variance is None
        )  # fmt: skip

    def _keeps_accumulator(self) -> bool:
        """Whether the variance EMA lives in ``extra`` (rather than as ``s²``)."""
        return self.correction != "clamp" or self.pooling == "factored"

    def init(self, params: Sequence[Array]) -> ClipState:
        """``m_0 = 0``, ``s_0 = sqrt(std_min·std_max)``, shaped and typed like ``params``; the
        options' state in ``extra`` (see :class:`ClipState`)."""
        xp = namespace(*params)
        mean = None if self.centre == "none" else [xp.zeros_like(p) for p in params]
        std = [xp.full_like(p, self.std_init) for p in params]
        extra: dict[str, Any] = {}
        var0 = self.variance_init
        if self._keeps_accumulator():
            factored = [self.pooling == "factored" and adaptive.factored_tensor(p) for p in params]
            extra["variance"] = [None if f else xp.full_like(p, var0) for p, f in zip(params, factored, strict=True)]
            if any(factored):
                mats = [xp.reshape(p, (p.shape[0], -1)) if f else None for p, f in zip(params, factored, strict=True)]
                extra["rows"] = [None if m is None else xp.full_like(m[:, 0], var0) for m in mats]
                extra["cols"] = [None if m is None else xp.full_like(m[0, :], var0) for m in mats]
        if self.update_every > 1:
            extra["window_sum"] = [xp.zeros_like(p) for p in params]
            extra["window_noise"] = [xp.zeros_like(p) for p in params]
            extra["window_count"] = _scalar_like(params, 0.0)
        if self.centre == "kalman":
            extra["centre_var"] = [xp.full_like(p, -1.0) for p in params]
        if self.quantile is not None:
            extra["clip_norm"] = _scalar_like(params, self.max_grad_norm)
        return ClipState(step=0, mean=mean, std=std, extra=extra or None)

    def centre_of(self, state: ClipState) -> list[Array] | None:
        """The centre ``a_t`` from the state."""
        if self.centre == "none":
            return None
        if self.centre == "debiased":
            return adaptive.debiased_centre(state.mean, state.step, self.beta_mean)
        return list(state.mean)

    def clip_norm_of(self, state: ClipState) -> Any:
        """``C_t`` of the separated scale (``None`` for the coupled one)."""
        if self.scale == "coupled":
            return None
        return state.extra["clip_norm"] if self.quantile is not None else self.max_grad_norm

    def transform(self, state: ClipState, num_tensors: int):
        if self.scale == "coupled":
            scale = transform.auxiliary_scale(state.std)
        else:
            scale = adaptive.separated_scale(state.std, self.clip_norm_of(state), self.shape_power)
        return self.centre_of(state), scale

    def clip_groups(self, num_tensors: int):
        return _whole_vector(num_tensors)

    def auxiliary_sums(self, state: ClipState, sq_norms, factors) -> list[Array]:
        return [] if self.quantile is None else [self.quantile.count(sq_norms, factors)]

    def noise_multipliers(self, noise_multiplier: Any, expected_batch_size: Any) -> tuple[Any, Any]:
        if self.quantile is None:
            return noise_multiplier, 0.0
        return self.quantile.noise_multipliers(noise_multiplier, expected_batch_size)

    # ------------------------------------------------------------------ public statistics

    def with_public_statistics(
        self, state: ClipState, per_example_grads: Sequence[Array], *, weight: float = 1.0
    ) -> ClipState:
        """``state`` with its statistics moved towards those of *public* per-example gradients
        (one ``(n, *shape)`` array per tensor): the variance EMA becomes
        ``(1 − weight)·old + weight·pool(var_public)`` (clamped to the std range), at
        initialisation (``weight=1``) or as a refresh during training. Public data costs no
        privacy; the centre is left alone (a public centre goes stale, its spread does not).
        With the coupled scale the public spread of *single* examples sets the clip level too:
        prefer ``scale="separated"``, where only the shape is taken."""
        w = _finite_positive("weight", weight)
        if w > 1:
            raise InvalidHyperparameterError(f"weight must be in (0, 1], got {weight!r}")
        if len(per_example_grads) != len(state.std):
            raise InvalidHyperparameterError(
                f"{len(per_example_grads)} public gradient arrays for {len(state.std)} parameter tensors"
            )
        for g, s in zip(per_example_grads, state.std, strict=True):
            if tuple(g.shape[1:]) != tuple(s.shape):
                raise InvalidHyperparameterError(
                    f"a public per-example gradient has shape {tuple(g.shape)}, expected (n, {tuple(s.shape)})"
                )
        variance = adaptive.public_variance(per_example_grads)
        return self._statistics_step(state, variance, beta=1.0 - w, clamp_each=True)

    # ------------------------------------------------------------------ update

    def _statistics_step(self, state: ClipState, v: list[Array], *, beta: float, clamp_each: bool):
        """The pooled EMA of ``v`` with weight ``beta``; returns a state with new ``std`` (and
        accumulators in ``extra``)."""
        xp = namespace(*state.std)
        bounds = (self.std_min**2, self.std_max**2)
        clamp = bounds if clamp_each else None
        extra = dict(state.extra or {})
        new_std = []
        variance = list(extra.get("variance", [None] * len(v)))
        rows = list(extra.get("rows", [None] * len(v)))
        cols = list(extra.get("cols", [None] * len(v)))
        for k, (x, s) in enumerate(zip(v, state.std, strict=True)):
            if not self._keeps_accumulator():
                sq = adaptive.pooled_ema(s * s, x, pooling=self.pooling, beta=beta, clamp=bounds)
                new_std.append(xp.sqrt(sq))
                continue
            if rows[k] is not None:
                acc = adaptive.pooled_ema((rows[k], cols[k]), x, pooling=self.pooling, beta=beta, clamp=clamp)
                rows[k], cols[k] = acc
            else:
                acc = variance[k] = adaptive.pooled_ema(variance[k], x, pooling=self.pooling, beta=beta, clamp=clamp)
            new_std.append(xp.sqrt(adaptive.estimate(acc, tuple(s.shape), bounds)))
        if "variance" in extra:
            extra["variance"] = variance
        if "rows" in extra:
            extra["rows"], extra["cols"] = rows, cols
        return state._replace(std=new_std, extra=extra or None)

    def update(self, state, noisy_grad, scale, *, auxiliary=(), noise_multiplier, expected_batch_size) -> ClipState:
        if self.is_patent:
            new_mean, new_std = transform.update_moments(
                noisy_grad,
                state.mean,
                state.std,
                scale,
                noise_multiplier=noise_multiplier,
                expected_batch_size=expected_batch_size,
                beta_mean=self.beta_mean,
                beta_std=self.beta_std,
                std_min=self.std_min,
                std_max=self.std_max,
            )
            return ClipState(step=state.step + 1, mean=new_mean, std=new_std, extra=state.extra)
        xp = namespace(*noisy_grad)
        centre = self.centre_of(state)
        noise_var = adaptive.noise_variance(scale, noise_multiplier, expected_batch_size)
        new = state
        if not self.freeze_statistics:
            signal = list(noisy_grad) if (centre is None or self.statistic == "second_moment") else [
                g - a for g, a in zip(noisy_grad, centre, strict=True)
            ]
            subtract = self.correction != "none"
            k = self.update_every
            if k == 1:
                v = [x * x - n if subtract else x * x for x, n in zip(signal, noise_var, strict=True)]
                new = self._statistics_step(state, v, beta=self.beta_std, clamp_each=self.correction == "clamp")
            else:
                extra = dict(state.extra)
                total = [d + x for d, x in zip(extra["window_sum"], signal, strict=True)]
                noise_total = [m + n for m, n in zip(extra["window_noise"], noise_var, strict=True)]
                count = extra["window_count"] + 1.0
                ready = count >= k
                v = [d * d / k - m / k if subtract else d * d / k for d, m in zip(total, noise_total, strict=True)]
                done = self._statistics_step(state, v, beta=self.beta_std, clamp_each=self.correction == "clamp")
                pick = lambda a, b: None if a is None else xp.where(ready, a, b)  # noqa: E731
                std = [pick(a, b) for a, b in zip(done.std, state.std, strict=True)]
                merged = dict(extra)
                for key in ("variance", "rows", "cols"):
                    if key in extra:
                        merged[key] = [pick(a, b) for a, b in zip(done.extra[key], extra[key], strict=True)]
                merged["window_sum"] = [xp.where(ready, xp.zeros_like(d), d) for d in total]
                merged["window_noise"] = [xp.where(ready, xp.zeros_like(m), m) for m in noise_total]
                merged["window_count"] = xp.where(ready, xp.zeros_like(count), count)
                new = state._replace(std=std, extra=merged)
        extra = dict(new.extra) if new.extra is not None else None
        if self.centre in ("ema", "debiased"):
            mean = [self.beta_mean * m + (1.0 - self.beta_mean) * g for m, g in zip(state.mean, noisy_grad, strict=True)]
        elif self.centre == "kalman":
            mean, extra["centre_var"] = adaptive.kalman_update(
                state.mean, state.extra["centre_var"], noisy_grad, noise_var, process_noise=self.process_noise
            )
        else:
            mean = None
        if self.quantile is not None:
            extra["clip_norm"] = self.quantile.next_clip_norm(state.extra["clip_norm"], auxiliary[0], expected_batch_size)
        return ClipState(step=state.step + 1, mean=mean, std=new.std, extra=extra)


#: Named starting points of :func:`adaptive_clipping` (``AdaClip(preset=...)`` in PyTorch,
#: ``adaclip_jax.adaclip(preset=...)`` in JAX). Each is a set of :class:`AdaptiveClipping`
#: keywords; keywords given explicitly override the preset's.
#:
#: - ``"centred"`` (the default): clipping of the deviation ``g − a`` from the patent's running
#:   mean ``a = EMA_{β1}(g̃)`` (β1 = 0.99) with the separated scale ``b = C·s^½/mean(s^½)``
#:   at ``C = max_grad_norm`` (default 1): one scale per tensor (``pooling="tensor"``), learned
#:   from the releases with the noise removed after averaging (``correction="unbiased"``,
#:   β2 = 0.999), ``s`` within 30× either way of ``C/√d``. It starts as flat clipping at ``C``.
#:   The best tuning-free AdaCliP-family configuration of our utility benchmark (round two),
#:   where its shape stayed within about 1 % of flat.
#: - ``"patent"``: the patent's AdaCliP (coupled scale ``b = √s·√Σs``, per-coordinate
#:   statistics, clamped noise correction, ``std_min = 1e-5``, ``std_max = 1``, ``β1 = 0.99``,
#:   ``β2 = 0.9``), :class:`AdaptiveClipping`'s own defaults.
ADAPTIVE_PRESETS: dict[str, dict[str, Any]] = {
    "centred": {"scale": "separated", "max_grad_norm": 1.0, "beta_mean": 0.99, "beta_std": 0.999,
                "centre": "ema", "pooling": "tensor", "correction": "unbiased"},
    "patent": {"scale": "coupled", "std_min": 1e-5, "std_max": 1.0, "beta_mean": 0.99, "beta_std": 0.9},
}  # fmt: skip
DEFAULT_PRESET = "centred"


def adaptive_clipping(
    num_params: int,
    *,
    preset: str = DEFAULT_PRESET,
    std_min: float | None = None,
    std_max: float | None = None,
    beta_mean: float | None = None,
    beta_std: float | None = None,
    initial_max_grad_norm: float | None = None,
    std_spread: float = 30.0,
    max_grad_norm: float | None = None,
    **options: Any,
) -> AdaptiveClipping:
    """The :class:`AdaptiveClipping` that ``adaclip_torch.AdaClip`` and ``adaclip_jax.adaclip`` build (``d =
    num_params`` trainable coordinates); ``options`` are its keyword-only options.

    ``preset`` names the starting point (:data:`ADAPTIVE_PRESETS`): ``"centred"`` (default)
    or ``"patent"``. Every keyword given (not ``None``; ``options`` too) overrides the preset's value.
    ``preset="patent"`` is :class:`AdaptiveClipping`'s own defaults, so with options (e.g.
    ``scale="separated"``) it is the class with those options; ``scale="coupled"`` needs
    ``preset="patent"``.

    ``initial_max_grad_norm = C0`` sets ``std_min, std_max = s_0/spread, s_0·spread`` with
    ``s_0 = C0/√d`` (:func:`adaclip.strategies.std_bounds_for_initial_clip`): with the coupled
    scale the first step then clips like flat clipping at ``C0``. With ``scale="separated"``
    (``b = C_t·s^p/mean(s^p)``, equal statistics at the start, so again flat clipping at
    ``C_0``) it is also ``max_grad_norm``, the separated scale's ``C`` (or the quantile rule's
    ``C_0``); giving both is refused, as is ``max_grad_norm`` with the coupled scale. With the
    separated scale and no bounds given, ``std_min, std_max`` are ``s_0/std_spread,
    s_0·std_spread`` with ``s_0 = C/√d`` (the shape may then spread ``std_spread²``-fold).
    """
    if not isinstance(preset, str) or preset not in ADAPTIVE_PRESETS:
        raise InvalidHyperparameterError(f"preset must be one of {sorted(ADAPTIVE_PRESETS)}, got {preset!r}")
    options = {k: v for k, v in options.items() if v is not None}  # None: "not given", the preset's value
    values = dict(ADAPTIVE_PRESETS[preset])
    scale = options.pop("scale", values.pop("scale"))
    values.pop("scale", None)
    if preset != "patent" and scale == "coupled":
        raise InvalidHyperparameterError(
            f"scale='coupled' is the patent's scale: pass preset='patent' (preset {preset!r} uses the separated scale)"
        )
    separated = scale == "separated"
    given = {"std_min": std_min, "std_max": std_max, "beta_mean": beta_mean, "beta_std": beta_std}
    for key, value in given.items():
        if value is not None:
            values[key] = value
    for key, value in options.items():
        values[key] = value
    preset_clip = values.pop("max_grad_norm", None)
    if initial_max_grad_norm is not None:
        if std_min is not None or std_max is not None:
            raise InvalidHyperparameterError("give initial_max_grad_norm or std_min/std_max, not both")
        if separated:
            if max_grad_norm is not None:
                raise InvalidHyperparameterError(
                    "give max_grad_norm or initial_max_grad_norm, not both: with scale='separated' the "
                    "initial clip norm is the separated scale's C (the quantile rule's C_0), so "
                    f"initial_max_grad_norm={initial_max_grad_norm!r} would set max_grad_norm too"
                )
            max_grad_norm = initial_max_grad_norm
        values["std_min"], values["std_max"] = std_bounds_for_initial_clip(
            initial_max_grad_norm, num_params, spread=std_spread
        )
    elif max_grad_norm is not None and not separated:
        raise InvalidHyperparameterError(
            f"max_grad_norm={max_grad_norm!r} is the clip norm C of scale='separated'; the patent's coupled "
            "scale sets its clip level from the statistics: start it at a clip norm C0 with "
            "initial_max_grad_norm=C0, or use the default preset"
        )
    if separated:
        max_grad_norm = preset_clip if max_grad_norm is None else max_grad_norm
        if max_grad_norm is None:
            raise InvalidHyperparameterError("scale='separated' needs max_grad_norm (C, or the quantile rule's C_0)")
        if "std_min" not in values and "std_max" not in values:
            values["std_min"], values["std_max"] = std_bounds_for_initial_clip(
                max_grad_norm, num_params, spread=std_spread
            )
    return AdaptiveClipping(scale=scale, max_grad_norm=max_grad_norm, **values)


# --------------------------------------------------------------------------- the step


def std_bounds_for_initial_clip(
    initial_max_grad_norm: float, num_params: int, *, spread: float = 30.0
) -> tuple[float, float]:
    """``(std_min, std_max)`` for AdaCliP given the flat clip norm it should start from.

    At initialisation every ``s_j = s_0 = sqrt(std_min·std_max)``, so ``b_j = s_0·sqrt(d)``
    and clipping ``(g − 0)/b`` to norm 1 is clipping ``g`` to norm ``s_0·sqrt(d)``. Hence
    ``s_0 = C0/sqrt(d)``, ``std_min = s_0/spread`` and ``std_max = s_0·spread``. The bounds
    depend on ``d`` (``num_params``, all trainable coordinates): absolute bounds such as the
    defaults ``(1e-5, 1)`` mean a different initial clip norm for every model size.

    Args:
      initial_max_grad_norm: ``C0 > 0``, e.g. the ``max_grad_norm`` tuned for DP-SGD.
      num_params: ``d``, the number of coordinates AdaCliP covers.
      spread: ``≥ 1``; ``s`` stays within a factor ``spread`` of ``s_0`` either way.
    """
    c0 = _finite_positive("initial_max_grad_norm", initial_max_grad_norm)
    if isinstance(num_params, bool) or not isinstance(num_params, int) or num_params < 1:
        raise InvalidHyperparameterError(f"num_params must be a positive int, got {num_params!r}")
    spread = _finite_positive("spread", spread)
    if spread < 1:
        raise InvalidHyperparameterError(f"spread must be >= 1, got {spread!r}")
    s0 = c0 / math.sqrt(num_params)
    return s0 / spread, s0 * spread


#: ``E[(z² − 1)⁺] = 2φ(1)`` for ``z ~ N(0, 1)``: the part of the noise variance that the clamp in
#: step 7 keeps when the released deviation is noise alone.
CLAMPED_NOISE_FRACTION = 2.0 * math.exp(-0.5) / math.sqrt(2.0 * math.pi)


def noise_drift_number(num_params: int, noise_multiplier: float, expected_batch_size: float) -> float:
    """``κ = 2φ(1)·d·σ²/B̄²``: whether AdaCliP's std estimates can follow the gradients.

    Step 7 subtracts the noise variance ``b²σ²/B̄²`` from the squared released deviation, then
    clamps below at ``std_min²``. Where the noise dominates the deviation, the clamp keeps
    ``E[(z² − 1)⁺] = 2φ(1) ≈ 0.484`` of the noise variance, and with ``b_j² = s_j·Σs`` one
    step multiplies ``E[s_j²]`` by about ``1 + (1 − β2)(κ·Σs/(d·s_j) − 1)``. So with
    ``κ > 1`` the estimates grow geometrically on the noise alone (and the noise with them,
    through ``b``) until ``std_max`` stops them, fastest where ``s_j`` is smallest — which
    evens them out towards flat clipping; with ``κ < 1`` they decay towards ``std_min``
    unless the gradients hold them up. ``benchmarks/adaclip_drift.py`` checks this on the
    reference. Keeping ``κ`` below 1 means ``B̄ ≳ 0.7·σ·sqrt(d)``.
    """
    if isinstance(num_params, bool) or not isinstance(num_params, int) or num_params < 1:
        raise InvalidHyperparameterError(f"num_params must be a positive int, got {num_params!r}")
    sigma, bbar = validate_mechanism(noise_multiplier, expected_batch_size)
    return CLAMPED_NOISE_FRACTION * num_params * sigma**2 / bbar**2


# Frames a warning skips to reach the user's line. optax too: ``optax.chain(...).init`` calls
# the JAX transformation's init on the user's behalf.
_OWN_PACKAGES = ("adaclip", "adaclip_torch", "adaclip_jax", "optax")


def _caller_stacklevel() -> int:
    """``stacklevel`` of the first frame outside :data:`_OWN_PACKAGES` (the user's call)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] in _OWN_PACKAGES:
        frame, level = frame.f_back, level + 1
    return level


def warn_if_noise_dominated(num_params: int, noise_multiplier: float, expected_batch_size: float) -> float:
    """Return ``κ`` (:func:`noise_drift_number`) and warn with
    :class:`adaclip.errors.NoiseDominatedWarning` when ``κ > 1``.

    The AdaCliP wrappers call this once, when they are built (PyTorch) or initialised (JAX),
    with the first step's ``σ``; the warning points at the user's line. It reads only
    hyperparameters, never data.
    """
    kappa = noise_drift_number(num_params, noise_multiplier, expected_batch_size)
    if kappa > 1.0:
        need = math.ceil(math.sqrt(CLAMPED_NOISE_FRACTION * num_params) * float(noise_multiplier))
        warnings.warn(
            NoiseDominatedWarning(
                f"AdaCliP's noise drift number is {kappa:.3g} > 1 (d = {num_params}, "
                f"σ = {float(noise_multiplier):g}, B̄ = {float(expected_batch_size):g}): its std "
                "estimates will grow on the noise and stop following the gradients. In the "
                "benchmarks AdaCliP was behind flat clipping in nearly every such run; consider flat "
                f"clipping, or an expected batch size of at least {need} at this σ. "
                "See adaclip.strategies.noise_drift_number."
            ),
            stacklevel=_caller_stacklevel(),
        )
    return kappa


def per_tensor_clip_factors(
    strategy: Strategy,
    per_example_grads: Sequence[Array],
    centre: Sequence[Array] | None,
    scale: Sequence[Any],
) -> list[Array]:
    """The ``(n,)`` clip factor that applies to each tensor, from the strategy's groups.

    The squared norms are upper bounds (:func:`adaclip.transform.transformed_sq_norms`), so
    rounding may over-clip, never under-clip. A unit with a non-finite squared norm in any
    tensor gets the factor 0 in every group: its whole contribution is dropped.
    """
    return group_clip_factors(strategy, transform.transformed_sq_norms(per_example_grads, centre, scale))


def group_clip_factors(strategy: Strategy, sq_norms: Sequence[Array]) -> list[Array]:
    """Per-tensor clip factors from per-tensor upper bounds of the squared transformed norms.

    Each group's bound is the sum of its tensors' bounds, enlarged by ``2K·u`` for the
    rounding of that sum of ``K`` terms; a unit whose total is not finite gets the factor 0
    everywhere (:func:`adaclip.transform.clip_factors`), so it contributes nothing.
    """
    num = len(sq_norms)
    xp = namespace(*sq_norms)
    dropped = transform.nonfinite_units(sq_norms) if num else None
    factors: list[Array | None] = [None] * num
    for members, radius in strategy.clip_groups(num):
        group_sq = sum(sq_norms[k] for k in members)
        group_sq = group_sq * (1.0 + 2.0 * len(members) * transform.unit_roundoff(group_sq.dtype))
        c = strategy.clip_factors(group_sq, radius)
        if len(members) < num:  # per-layer groups: a unit non-finite elsewhere is dropped here too
            c = xp.where(dropped, xp.zeros_like(c), c)
        for k in members:
            factors[k] = c
    return factors  # type: ignore[return-value]


def clip_and_sum(
    strategy: Strategy,
    state: ClipState,
    per_example_grads: Sequence[Array],
    *,
    transformed: tuple[Any, Any] | None = None,
    unit_mask: Array | None = None,
    unit_weights: Array | None = None,
) -> list[Array]:
    """Transform, clip and sum the per-unit gradients: ``Σ_i w̄_i``, one array per tensor,
    followed by the strategy's ``num_auxiliary`` auxiliary sums (0-d arrays).

    Sums from several micro-batches (virtual steps) or several processes (data parallel) may
    be added together, entry by entry, before :func:`release`; each unit must appear in
    exactly one of them. No noise is added here: the result is *not* private and must only go
    to :func:`release`. ``transformed``: ``strategy.transform(state, K)`` if the caller
    already has it (it depends on the state only, so a step can compute it once for this
    function and :func:`release`). ``unit_mask`` (a boolean ``(n,)`` array, optional): units
    where it is false get the factor 0 and contribute nothing (nor to the auxiliary sums).
    ``unit_weights`` (an ``(n,)`` array in [0, 1], optional): the clipped sum becomes
    ``Σ_i ω_i w̄_i``; a weight of at most 1 keeps each unit's contribution within the clip
    radius, so the sensitivity is unchanged (weighted averages over users; the auxiliary sums
    stay unweighted). The caller checks the range.
    """
    centre, scale = strategy.transform(state, len(per_example_grads)) if transformed is None else transformed
    sq_norms = transform.transformed_sq_norms(per_example_grads, centre, scale)
    factors = group_clip_factors(strategy, sq_norms)
    if unit_mask is not None and factors:
        xp = namespace(*factors)
        factors = [xp.where(unit_mask, c, xp.zeros_like(c)) for c in factors]
    nonfinite = transform.nonfinite_units(sq_norms) if sq_norms else None
    aux = auxiliary_sums(strategy, state, sq_norms, factors)
    if unit_weights is not None and factors:
        factors = [c * unit_weights for c in factors]
    summed = transform.clipped_sum(per_example_grads, centre, scale, factors, nonfinite=nonfinite)
    return summed + aux


def auxiliary_sums(strategy: Strategy, state: ClipState, sq_norms: Sequence[Array], factors: Sequence[Array]) -> list[Array]:
    """The strategy's auxiliary sums over this batch's units (``[]`` for most strategies),
    from the same squared-norm bounds and factors as the clipping (every per-sample path calls
    this, so the count agrees with the clipping it describes)."""
    if not getattr(strategy, "num_auxiliary", 0):
        return []
    return list(strategy.auxiliary_sums(state, sq_norms, factors))


def num_tensors_of(strategy: Strategy, summed: Sequence[Array]) -> int:
    """How many entries of a clipped sum are parameter tensors (the rest are auxiliary)."""
    return len(summed) - getattr(strategy, "num_auxiliary", 0)


def release(
    strategy: Strategy,
    state: ClipState,
    summed: Sequence[Array],
    noise: Sequence[Array] | None,
    *,
    noise_multiplier: Any,
    expected_batch_size: Any,
    transformed: tuple[Any, Any] | None = None,
    noise_variance: Any = 1.0,
) -> tuple[list[Array], ClipState]:
    """Add noise once to the clipped sum (and to any auxiliary sum), rescale, and update the
    strategy's state.

    ``noise_multiplier`` is the step's (accounted) ``σ``; the gradient gets
    ``σ_g·z`` and the auxiliary sums ``σ_aux·z`` with ``(σ_g, σ_aux)`` from
    ``strategy.noise_multipliers`` (``σ_g = σ`` for strategies without auxiliary sums).
    ``noise=None``: no draw here (σ = 0, or the noise was already added, as the data-parallel
    path does). Returns ``(noisy_grad, new_state)``; the new state is computed from the
    released values and the old state only (post-processing of the release). ``transformed``
    as in :func:`clip_and_sum`.

    ``noise_variance``: the per-coordinate variance ``v_t`` of the gradient's noise draws
    (1 for independent standard normals; above 1 for the correlated noise of
    :mod:`adaclip.correlated`, whose ``x_t`` are not standard). The strategy's statistics
    subtract the noise's true variance ``σ_g²·v_t``: ``update`` is given ``σ_g·√v_t``. A Python
    number (``1.0``: ``σ_g`` itself, unchanged) or a 0-d array (e.g. a traced ``v_t`` under
    ``jax.jit``).
    """
    num = num_tensors_of(strategy, summed)
    centre, scale = strategy.transform(state, num) if transformed is None else transformed
    sigma_grad, sigma_aux = strategy.noise_multipliers(noise_multiplier, expected_batch_size)
    noisy_grad = transform.noise_and_rescale(
        summed[:num],
        None if noise is None else noise[:num],
        centre,
        scale,
        noise_multiplier=sigma_grad,
        expected_batch_size=expected_batch_size,
    )
    aux = list(summed[num:]) if noise is None else [a + sigma_aux * z for a, z in zip(summed[num:], noise[num:], strict=True)]
    if isinstance(noise_variance, (int, float)):
        sigma_stats = sigma_grad if noise_variance == 1.0 else sigma_grad * math.sqrt(noise_variance)
    else:  # an array (a traced per-step v_t)
        sigma_stats = sigma_grad * noise_variance**0.5
    new_state = strategy.update(
        state,
        noisy_grad,
        scale,
        auxiliary=aux,
        noise_multiplier=sigma_stats,
        expected_batch_size=expected_batch_size,
    )
    return noisy_grad, new_state


def private_step(
    strategy: Strategy,
    state: ClipState,
    per_example_grads: Sequence[Array],
    noise: Sequence[Array] | None,
    *,
    noise_multiplier: Any,
    expected_batch_size: Any,
) -> tuple[list[Array], ClipState]:
    """One private step of any strategy: transform, clip, sum, add noise, rescale, update.

    Args:
      strategy: a strategy of the affine family.
      state: its current :class:`ClipState`.
      per_example_grads: one ``(n, *shape)`` array per parameter tensor. Validate first with
        :func:`adaclip.transform.check_per_example_grads`; this function does no checks so
        that it can run under ``jax.jit``.
      noise: standard-normal draws, one array per tensor shaped like the parameter, then one
        0-d draw per auxiliary sum (``strategy.num_auxiliary``); ``None`` only when
        ``noise_multiplier`` is 0. The function multiplies them by the strategy's multipliers.
      noise_multiplier: σ for this step.
      expected_batch_size: B̄, the expected number of units per step.

    Returns:
      ``(noisy_grad, new_state)``: the privacy-preserving gradient, one array per tensor,
      and the strategy's next state (computed from ``noisy_grad`` and the old state only).
    """
    summed = clip_and_sum(strategy, state, per_example_grads)
    return release(
        strategy,
        state,
        summed,
        noise,
        noise_multiplier=noise_multiplier,
        expected_batch_size=expected_batch_size,
    )
