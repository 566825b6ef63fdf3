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

This module holds the strategies with a fixed transform and the quantile-adapted flat clip;
the others live beside their maths and are re-exported here, so that ``adaclip.strategies``
stays the one place to import any strategy or step from:

- :mod:`adaclip.mechanism`: :class:`ClipState`, the :class:`Strategy` protocol and the step
  (:func:`clip_and_sum`, :func:`release`, :func:`private_step`, :func:`check_state`, ...);
- :mod:`adaclip.adaptive_strategy`: :class:`AdaptiveClipping` and :func:`adaptive_clipping`;
- :mod:`adaclip.adaptive`: :class:`QuantileRule`, :func:`std_bounds_for_initial_clip` and the
  noise drift number;
- :mod:`adaclip.options`: AdaCliP's option set (:class:`AdaptiveOptions`) and its presets.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from adaclip._array import namespace
from adaclip.adaptive import (
    CLAMPED_NOISE_FRACTION,
    QuantileRule,
    noise_drift_number,
    std_bounds_for_initial_clip,
    warn_if_noise_dominated,
    warn_of_noise_drift,
)
from adaclip.adaptive_strategy import (
    AdaptiveClipping,
    adaptive_clipping,
    depends_on_num_params,
    strategy_from_kwargs,
)
from adaclip.errors import InvalidHyperparameterError
from adaclip.mechanism import (
    ClipState,
    Strategy,
    _AffineDefaults,
    _StatelessMixin,
    auxiliary_sums,
    check_state,
    clip_and_sum,
    group_clip_factors,
    num_tensors_of,
    per_tensor_clip_factors,
    private_step,
    release,
    scalar_like,
    validate_mechanism,
    validate_sample_rate,
)
from adaclip.options import (
    ADAPTIVE_OPTION_NAMES,
    ADAPTIVE_PRESETS,
    DEFAULT_PRESET,
    AdaptiveOptions,
    split_adaptive_options,
)
from adaclip.options import finite_positive as _finite_positive
from adaclip.options import positive_list as _positive_list

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
    "strategy_from_kwargs",
    "depends_on_num_params",
    "AdaptiveOptions",
    "ADAPTIVE_OPTION_NAMES",
    "split_adaptive_options",
    "ADAPTIVE_PRESETS",
    "DEFAULT_PRESET",
    "std_bounds_for_initial_clip",
    "CLAMPED_NOISE_FRACTION",
    "noise_drift_number",
    "warn_if_noise_dominated",
    "warn_of_noise_drift",
    "clip_and_sum",
    "auxiliary_sums",
    "num_tensors_of",
    "release",
    "private_step",
    "per_tensor_clip_factors",
    "group_clip_factors",
    "check_state",
    "validate_mechanism",
    "validate_sample_rate",
]


@dataclasses.dataclass(frozen=True)
class FlatClipping(_StatelessMixin):
    """DP-SGD: clip each unit's whole gradient to ``max_grad_norm`` (C)."""

    max_grad_norm: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "max_grad_norm", _finite_positive("max_grad_norm", self.max_grad_norm))

    def transform(self, state: ClipState, num_tensors: int):
        return None, [self.max_grad_norm] * num_tensors


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
        return ClipState(step=0, extra={"clip_norm": scalar_like(params, self.max_grad_norm)})

    def transform(self, state: ClipState, num_tensors: int):
        return None, [state.extra["clip_norm"]] * num_tensors

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

    def clip_factors(self, sq_norm: Array, radius: float) -> Array:
        """``r/(‖w‖ + γr)`` from an upper bound of ``‖w‖²`` (so ``‖c·w‖ < r``); 0 if not finite."""
        xp = namespace(sq_norm)
        norm = xp.sqrt(sq_norm)
        factor = radius / (norm + self.stability * radius)
        return xp.where(xp.isfinite(norm), factor, xp.zeros_like(factor))
