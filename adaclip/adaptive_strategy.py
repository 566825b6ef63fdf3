"""AdaCliP as a strategy: :class:`AdaptiveClipping` and how its options build it.

:class:`AdaptiveClipping` composes one choice of each part of :mod:`adaclip.adaptive` (centre,
statistics, scale, quantile rule) into a strategy of the affine family that
:mod:`adaclip.mechanism` runs; :func:`adaptive_clipping` builds it from
:class:`adaclip.options.AdaptiveOptions` (the keywords the PyTorch and JAX wrappers take) and a
preset. Every option reads only the strategy's state, which reads only released values, so
each is post-processing of the same Gaussian mechanism. :mod:`adaclip.strategies` re-exports
everything here.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from adaclip import adaptive, transform
from adaclip._array import namespace
from adaclip.adaptive import QuantileRule, std_bounds_for_initial_clip
from adaclip.errors import InvalidHyperparameterError
from adaclip.mechanism import ClipState, _AffineDefaults, scalar_like
from adaclip.options import (
    ADAPTIVE_PRESETS,
    DEFAULT_PRESET,
    AdaptiveOptions,
    split_adaptive_options,
)
from adaclip.options import beta as _beta
from adaclip.options import choice as _choice
from adaclip.options import finite_positive as _finite_positive

if TYPE_CHECKING:
    from typing import Unpack  # Python >= 3.11; only the annotations use it

Array = Any

__all__ = ["AdaptiveClipping", "adaptive_clipping", "strategy_from_kwargs", "depends_on_num_params"]


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
        With ``"tensor"`` the statistics are one number per tensor and the step works with that
        number: ``transform`` returns ``b`` as one 0-d array per tensor, the update pools the
        signal with one dot product (``mean((g̃ − a)²)``) and stores ``s`` and the variance
        average as broadcasts of the number (:func:`adaclip.adaptive.filled_like`); the maths is
        the per-coordinate one's (the reference agrees within rounding).
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

    def noise_drift_applies(self) -> bool:
        """Whether the noise drift number applies (:func:`adaclip.adaptive.noise_drift_number`):
        only the coupled scale ``b = √s·√Σs`` lets the noise drive the clip level."""
        return self.scale == "coupled"

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
            extra["window_count"] = scalar_like(params, 0.0)
        if self.centre == "kalman":
            extra["centre_var"] = [xp.full_like(p, -1.0) for p in params]
        if self.quantile is not None:
            extra["clip_norm"] = scalar_like(params, self.max_grad_norm)
        return ClipState(step=0, mean=mean, std=std, extra=extra or None)

    def check_restored(self, state: ClipState, *, names: Sequence[str] | None, source: str) -> None:
        """What :func:`adaclip.strategies.check_state` adds for this strategy: with
        ``pooling="tensor"`` each tensor's ``std`` and variance accumulator must be one number
        across the tensor (what this strategy writes; the step reads one coordinate of each),
        else refused: the checkpoint is of other options (e.g. per-coordinate statistics)."""
        if self.pooling != "tensor" or state.std is None:
            return
        stored = [("std", state.std)]
        if "variance" in (state.extra or {}):
            stored.append(("extra']['variance", state.extra["variance"]))
        for key, arrays in stored:
            for k, x in enumerate(arrays):
                if x is None or math.prod(x.shape) == 0:
                    continue
                xp = namespace(x)
                if not bool(xp.all(x == adaptive.tensor_value(x))):
                    where = f"tensor {k}" if names is None else repr(names[k])
                    raise InvalidHyperparameterError(
                        f"{source} clip_state['{key}'] for {where} is not one number across the tensor, "
                        "but pooling='tensor' keeps one value per tensor: the checkpoint is of other "
                        "options (e.g. per-coordinate statistics)"
                    )

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

    def _pools_per_tensor(self, arrays: Sequence[Array]) -> bool:
        """Whether the statistics are one number per tensor (``pooling="tensor"``) and the step
        can work with those numbers (every tensor has a coordinate). ``std`` and the variance
        accumulator are then uniform within each tensor: :meth:`init` fills them and every
        update writes one pooled value, so reading one coordinate reads the tensor's number."""
        return self.pooling == "tensor" and all(math.prod(a.shape) > 0 for a in arrays)

    def transform(self, state: ClipState, num_tensors: int):
        if self._pools_per_tensor(state.std):
            # one number per tensor: ``b`` as 0-d arrays, broadcast like flat clipping's ``C``
            # (the same maths as the per-coordinate forms below, without a pass over a tensor)
            scale = adaptive.per_tensor_scale(
                [adaptive.tensor_value(s) for s in state.std],
                [math.prod(s.shape) for s in state.std],
                scale=self.scale,
                clip_norm=self.clip_norm_of(state),
                power=self.shape_power,
            )
            return self.centre_of(state), scale
        if self.scale == "coupled":
            scale = transform.auxiliary_scale(state.std)
        else:
            scale = adaptive.separated_scale(state.std, self.clip_norm_of(state), self.shape_power)
        return self.centre_of(state), scale

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
        return ClipState(step=state.step, mean=state.mean, std=new_std, extra=extra or None)

    def _per_tensor_statistics_step(
        self, state: ClipState, pooled: list[Array], *, beta: float, clamp_each: bool
    ) -> ClipState:
        """:meth:`_statistics_step` for statistics that are one number per tensor: ``pooled``
        holds each tensor's mean of ``v`` (0-d arrays); the EMA runs on the numbers and each
        stored array is written once."""
        xp = namespace(*state.std)
        bounds = (self.std_min**2, self.std_max**2)
        extra = dict(state.extra or {})
        variance = list(extra.get("variance", [None] * len(pooled)))
        new_std = []
        for k, (p, s) in enumerate(zip(pooled, state.std, strict=True)):
            if clamp_each:
                p = xp.clip(p, min=bounds[0], max=bounds[1])
            if self._keeps_accumulator():
                acc = beta * adaptive.tensor_value(variance[k]) + (1.0 - beta) * p
                variance[k] = adaptive.filled_like(variance[k], acc)
                estimate = xp.clip(acc, min=bounds[0], max=bounds[1])
            else:
                old = adaptive.tensor_value(s)
                estimate = beta * (old * old) + (1.0 - beta) * p
            new_std.append(adaptive.filled_like(s, xp.sqrt(estimate)))
        if "variance" in extra:
            extra["variance"] = variance
        return ClipState(step=state.step, mean=state.mean, std=new_std, extra=extra or None)

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
        deviation = None  # g̃ − m, when the statistics computed it (the EMA centre reuses it)
        if not self.freeze_statistics:
            signal = list(noisy_grad) if (centre is None or self.statistic == "second_moment") else [
                g - a for g, a in zip(noisy_grad, centre, strict=True)
            ]
            if self.centre == "ema" and self.statistic == "deviation":
                deviation = signal
            subtract = self.correction != "none"
            k = self.update_every
            # the numbers' path needs one noise variance per tensor: a caller's per-coordinate
            # scale (not this strategy's transform) takes the per-coordinate path, which pools
            if k == 1 and self._pools_per_tensor(state.std) and all(getattr(n, "ndim", 0) == 0 for n in noise_var):
                squares = [adaptive.mean_square(x) for x in signal]
                pooled = [m - n if subtract else m for m, n in zip(squares, noise_var, strict=True)]
                new = self._per_tensor_statistics_step(
                    state, pooled, beta=self.beta_std, clamp_each=self.correction == "clamp"
                )
            elif k == 1:
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
                new = ClipState(step=state.step, mean=state.mean, std=std, extra=merged)
        extra = dict(new.extra) if new.extra is not None else None
        if deviation is not None:  # m' = m + (1 − β₁)(g̃ − m): the same EMA, one pass fewer
            mean = [m + (1.0 - self.beta_mean) * x for m, x in zip(state.mean, deviation, strict=True)]
        elif self.centre in ("ema", "debiased"):
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


def adaptive_clipping(num_params: int, **options: Unpack[AdaptiveOptions]) -> AdaptiveClipping:
    """The :class:`AdaptiveClipping` that ``adaclip_torch.AdaClip`` and ``adaclip_jax.adaclip`` build (``d =
    num_params`` trainable coordinates); ``options`` are :class:`adaclip.options.AdaptiveOptions`
    (each documented there).

    ``preset`` names the starting point (:data:`ADAPTIVE_PRESETS`): ``"centred"`` (default)
    or ``"patent"``. Every keyword given (not ``None``) overrides the preset's value.
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
    opts: dict[str, Any] = dict(options)
    preset = opts.pop("preset", DEFAULT_PRESET)
    std_spread = opts.pop("std_spread", 30.0)
    std_min, std_max = opts.pop("std_min", None), opts.pop("std_max", None)
    beta_mean, beta_std = opts.pop("beta_mean", None), opts.pop("beta_std", None)
    initial_max_grad_norm = opts.pop("initial_max_grad_norm", None)
    max_grad_norm = opts.pop("max_grad_norm", None)
    if not isinstance(preset, str) or preset not in ADAPTIVE_PRESETS:
        raise InvalidHyperparameterError(f"preset must be one of {sorted(ADAPTIVE_PRESETS)}, got {preset!r}")
    opts = {k: v for k, v in opts.items() if v is not None}  # None: "not given", the preset's value
    values = dict(ADAPTIVE_PRESETS[preset])
    scale = opts.pop("scale", values.pop("scale"))
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
    for key, value in opts.items():
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



def strategy_from_kwargs(num_params: int, kwargs: Mapping[str, Any]) -> tuple[AdaptiveClipping, dict[str, Any]]:
    """``(strategy, rest)``: :func:`adaptive_clipping` of the keywords of ``kwargs`` that are
    :class:`~adaclip.options.AdaptiveOptions`, and the other keywords (a wrapper's own), as
    given. Raises what :func:`adaptive_clipping` raises."""
    options, rest = split_adaptive_options(kwargs)
    return adaptive_clipping(num_params, **options), rest


def depends_on_num_params(options: AdaptiveOptions, probe: AdaptiveClipping) -> bool:
    """Whether :func:`adaptive_clipping` of ``options`` depends on ``d = num_params``: it does
    when the std bounds come from a clip norm (``initial_max_grad_norm``, or the separated
    scale without ``std_min``/``std_max``). ``probe`` is the strategy built for any ``d``
    (e.g. ``adaptive_clipping(1, **options)``, which also checks every option); a wrapper that
    learns ``d`` late (JAX, at ``init``) builds the strategy then when this is true."""
    if options.get("initial_max_grad_norm") is not None:
        return True
    return probe.scale == "separated" and options.get("std_min") is None and options.get("std_max") is None
