"""The affine clipping family and the one private step that serves all of it.

A *strategy* says how to transform per-unit gradients before clipping (centre ``a``, scale
``b``), how to group coordinates for clipping, and how its state evolves from the released
gradient. :func:`private_step` runs the shared path for any strategy:

=============  =========  ===========================  ================================
strategy       centre a   scale b                      clip
=============  =========  ===========================  ================================
FlatClipping   0          C                            ‖w‖ ≤ 1
PerLayer…      0          C = sqrt(Σ_k C_k²)           ‖w_k‖ ≤ C_k / C per group
Scaled…        0          C·α_k on group k             ‖w‖ ≤ 1
AdaptiveClip…  m_t        sqrt(s_t)·sqrt(Σ s_t)        ‖w‖ ≤ 1
=============  =========  ===========================  ================================

In every case each unit's contribution has norm ≤ 1 in w-space, so a step is the sampled
Gaussian mechanism with sensitivity 1 and noise multiplier σ (accounted by
:mod:`adaclip.accounting`). The centre and scale depend only on the state, which depends only
on earlier *released* gradients: post-processing.

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

from adaclip import transform
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
    "std_bounds_for_initial_clip",
    "noise_drift_number",
    "warn_if_noise_dominated",
    "clip_and_sum",
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
    """

    step: Any
    mean: list[Array] | None = None
    std: list[Array] | None = None


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
    """What :func:`private_step` needs from a strategy."""

    def init(self, params: Sequence[Array]) -> ClipState: ...

    def transform(self, state: ClipState, num_tensors: int) -> tuple[list[Array] | None, list[Any]]:
        """``(centre, scale)`` for this step, from the state only."""
        ...

    def clip_groups(self, num_tensors: int) -> list[tuple[list[int], float]]:
        """``[(tensor indices, radius), ...]``: each group's transformed norm is clipped to
        its radius; the radii satisfy ``Σ r² <= 1``."""
        ...

    def update(
        self,
        state: ClipState,
        noisy_grad: list[Array],
        scale: list[Any],
        *,
        noise_multiplier: Any,
        expected_batch_size: Any,
    ) -> ClipState: ...


def _whole_vector(num_tensors: int) -> list[tuple[list[int], float]]:
    return [(list(range(num_tensors)), 1.0)]


class _StatelessMixin:
    def init(self, params: Sequence[Array]) -> ClipState:
        return ClipState(step=0)

    def update(self, state: ClipState, noisy_grad, scale, *, noise_multiplier, expected_batch_size) -> ClipState:
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


@dataclasses.dataclass(frozen=True)
class AdaptiveClipping:
    """AdaCliP (Pichapati et al., *AdaCliP: adaptive clipping for private SGD*; US 2021/0049298 A1): centre ``m_t``, scale ``b_t = sqrt(s_t)·sqrt(Σ s_t)``.

    Args:
      std_min: lower end of the range the std estimates ``s`` stay in. With ``std_max`` it
        sets ``s_0 = sqrt(std_min·std_max)`` and how far the clip region can shrink and grow:
        ``b`` at initialisation is ``s_0·sqrt(d)`` per coordinate.
      std_max: upper end of that range.
      beta_mean: ``β1``, interpolation weight of the mean estimate (0.99 in public ports).
      beta_std: ``β2``, interpolation weight of the variance estimate (0.9).
    """

    std_min: float = 1e-5
    std_max: float = 1.0
    beta_mean: float = 0.99
    beta_std: float = 0.9

    def __post_init__(self) -> None:
        object.__setattr__(self, "std_min", _finite_positive("std_min", self.std_min))
        object.__setattr__(self, "std_max", _finite_positive("std_max", self.std_max))
        if self.std_min > self.std_max:
            raise InvalidHyperparameterError(
                f"std_min must be <= std_max, got std_min={self.std_min!r} > std_max={self.std_max!r}"
            )
        object.__setattr__(self, "beta_mean", _beta("beta_mean", self.beta_mean))
        object.__setattr__(self, "beta_std", _beta("beta_std", self.beta_std))

    @classmethod
    def from_initial_clip(
        cls,
        initial_max_grad_norm: float,
        num_params: int,
        *,
        spread: float = 30.0,
        beta_mean: float = 0.99,
        beta_std: float = 0.9,
    ) -> AdaptiveClipping:
        """AdaCliP that starts out clipping like flat clipping at ``initial_max_grad_norm``.

        ``std_min``/``std_max`` come from :func:`std_bounds_for_initial_clip`: the clip
        region at step 0 is the ball of radius ``C0 = initial_max_grad_norm`` (as DP-SGD with
        ``max_grad_norm=C0``) and ``s`` may then move a factor ``spread`` either way.
        """
        std_min, std_max = std_bounds_for_initial_clip(initial_max_grad_norm, num_params, spread=spread)
        return cls(std_min=std_min, std_max=std_max, beta_mean=beta_mean, beta_std=beta_std)

    @property
    def std_init(self) -> float:
        """``s_0 = sqrt(std_min · std_max)``."""
        return math.sqrt(self.std_min * self.std_max)

    def init(self, params: Sequence[Array]) -> ClipState:
        """``m_0 = 0``, ``s_0 = sqrt(std_min·std_max)``, shaped and typed like ``params``."""
        xp = namespace(*params)
        mean = [xp.zeros_like(p) for p in params]
        std = [xp.full_like(p, self.std_init) for p in params]
        return ClipState(step=0, mean=mean, std=std)

    def transform(self, state: ClipState, num_tensors: int):
        return list(state.mean), transform.auxiliary_scale(state.std)

    def clip_groups(self, num_tensors: int):
        return _whole_vector(num_tensors)

    def update(self, state: ClipState, noisy_grad, scale, *, noise_multiplier, expected_batch_size) -> ClipState:
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
        return ClipState(step=state.step + 1, mean=new_mean, std=new_std)


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
        c = transform.clip_factors(group_sq, radius)
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
) -> list[Array]:
    """Transform, clip and sum the per-unit gradients: ``Σ_i w̄_i``, one array per tensor.

    Sums from several micro-batches (virtual steps) or several processes (data parallel) may
    be added together before :func:`release`; each unit must appear in exactly one of them.
    No noise is added here: the result is *not* private and must only go to :func:`release`.
    ``transformed``: ``strategy.transform(state, K)`` if the caller already has it (it depends
    on the state only, so a step can compute it once for this function and :func:`release`).
    """
    centre, scale = strategy.transform(state, len(per_example_grads)) if transformed is None else transformed
    sq_norms = transform.transformed_sq_norms(per_example_grads, centre, scale)
    factors = group_clip_factors(strategy, sq_norms)
    nonfinite = transform.nonfinite_units(sq_norms) if sq_norms else None
    return transform.clipped_sum(per_example_grads, centre, scale, factors, nonfinite=nonfinite)


def release(
    strategy: Strategy,
    state: ClipState,
    summed: Sequence[Array],
    noise: Sequence[Array] | None,
    *,
    noise_multiplier: Any,
    expected_batch_size: Any,
    transformed: tuple[Any, Any] | None = None,
) -> tuple[list[Array], ClipState]:
    """Add ``σ·noise`` once to the clipped sum, rescale, and update the strategy's state.

    Returns ``(noisy_grad, new_state)``; the new state is computed from ``noisy_grad`` and the
    old state only (post-processing of the release). ``transformed`` as in :func:`clip_and_sum`.
    """
    centre, scale = strategy.transform(state, len(summed)) if transformed is None else transformed
    noisy_grad = transform.noise_and_rescale(
        summed,
        noise,
        centre,
        scale,
        noise_multiplier=noise_multiplier,
        expected_batch_size=expected_batch_size,
    )
    new_state = strategy.update(
        state,
        noisy_grad,
        scale,
        noise_multiplier=noise_multiplier,
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
      noise: standard-normal draws, one array per tensor shaped like the parameter (``None``
        only when ``noise_multiplier`` is 0). The function multiplies them by σ.
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
