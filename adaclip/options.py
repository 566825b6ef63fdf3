"""What a hyperparameter may be: the checks every strategy runs, and AdaCliP's option set.

Two things live here, both below every strategy module:

- the small checks that turn a user's value into a float (or refuse it with
  :class:`~adaclip.errors.InvalidHyperparameterError` naming the hyperparameter), shared by
  :mod:`adaclip.mechanism`, :mod:`adaclip.strategies` and the adaptive strategy;
- :class:`AdaptiveOptions`, the keywords of AdaCliP declared once — the core's
  :func:`adaclip.strategies.adaptive_clipping`, ``adaclip_torch.AdaClip`` and
  ``adaclip_jax.adaclip`` take the same set — with the named starting points
  (:data:`ADAPTIVE_PRESETS`) that keywords override.

The maths of each option is in :mod:`adaclip.adaptive`; the strategy that composes them is
:class:`adaclip.strategies.AdaptiveClipping`.
"""

from __future__ import annotations

import math
import operator
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypedDict

from adaclip.errors import InvalidHyperparameterError

if TYPE_CHECKING:
    from adaclip.adaptive import QuantileRule

__all__ = [
    "AdaptiveOptions",
    "ADAPTIVE_OPTION_NAMES",
    "ADAPTIVE_PRESETS",
    "DEFAULT_PRESET",
    "split_adaptive_options",
    "finite_positive",
    "beta",
    "positive_list",
    "choice",
    "positive_int",
    "MECHANISM_KEYWORD_DEPRECATION",
    "warn_mechanism_keyword",
]


# --------------------------------------------------------------------------- checks


def finite_positive(name: str, value: Any, *, allow_zero: bool = False) -> float:
    """``value`` as a finite float ``> 0`` (``>= 0`` with ``allow_zero``), else refused (a bool or
    a string too: ``True`` is not the number 1, nor ``"1"``, here)."""
    try:
        if isinstance(value, (bool, str, bytes)):
            raise TypeError
        x = float(value)
    except (TypeError, ValueError):
        raise InvalidHyperparameterError(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(x) or x < 0 or (x == 0 and not allow_zero):
        raise InvalidHyperparameterError(
            f"{name} must be finite and {'>= 0' if allow_zero else '> 0'}, got {value!r}"
        )
    return x


def beta(name: str, value: Any) -> float:
    """An interpolation weight of an exponential moving average: a float in ``[0, 1)``."""
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise InvalidHyperparameterError(f"{name} must be a number, got {value!r}") from None
    if not 0.0 <= x < 1.0:
        raise InvalidHyperparameterError(f"{name} must be in [0, 1), got {value!r}")
    return x


def positive_list(name: str, values: Any) -> tuple[float, ...]:
    """A non-empty sequence of finite numbers ``> 0``, as a tuple of floats."""
    try:
        out = tuple(float(v) for v in values)
    except (TypeError, ValueError):
        raise InvalidHyperparameterError(f"{name} must be a sequence of numbers, got {values!r}") from None
    if not out or any(not math.isfinite(v) or v <= 0 for v in out):
        raise InvalidHyperparameterError(f"{name} must be positive finite numbers, got {values!r}")
    return out


def choice(name: str, value: Any, allowed: tuple[str, ...]) -> str:
    """``value`` if it is one of ``allowed``, else refused."""
    if value not in allowed:
        raise InvalidHyperparameterError(f"{name} must be one of {allowed}, got {value!r}")
    return value


def validate_sample_rate(sample_rate: Any) -> float:
    """The Poisson sampling rate ``q ∈ (0, 1]`` as a float (a bool or a string is refused); the
    library's one check of a sample rate that must be positive."""
    try:
        if isinstance(sample_rate, (str, bytes)):
            raise TypeError
        q = float(sample_rate)
    except (TypeError, ValueError):
        raise InvalidHyperparameterError(f"sample_rate must be a number, got {sample_rate!r}") from None
    if isinstance(sample_rate, bool) or not 0.0 < q <= 1.0:
        raise InvalidHyperparameterError(f"sample_rate must be in (0, 1], got {sample_rate!r}")
    return q


def integer_at_least(name: str, value: Any, minimum: int) -> int:
    """An integer ``>= minimum`` as a Python ``int``: any integral type (``int``, NumPy's,
    anything with ``__index__``) but a bool, e.g. a number of canaries or of samples. Raises
    :class:`~adaclip.errors.InvalidHyperparameterError` (a ``ValueError``) naming ``name``, the
    bound and the value."""
    if not isinstance(value, bool):
        try:
            k = operator.index(value)
        except TypeError:
            k = None
        if k is not None and k >= minimum:
            return int(k)
    raise InvalidHyperparameterError(f"{name} must be an integer >= {minimum}, got {value!r}")


def positive_int(name: str, value: Any) -> int:
    """An integer ``>= 1`` as a Python ``int``: any integral type (``int``, NumPy's, anything with
    ``__index__``) but a bool, e.g. a number of parameter coordinates. The library's one check of
    a positive count; raises :class:`~adaclip.errors.InvalidHyperparameterError` (a ``ValueError``)
    naming ``name`` and the value."""
    if not isinstance(value, bool):
        try:
            k = operator.index(value)
        except TypeError:
            k = 0
        if k >= 1:
            return int(k)
    raise InvalidHyperparameterError(f"{name} must be a positive integer, got {value!r}")


# --------------------------------------------------------------------------- renamed keywords

#: What a function says when given ``mechanism=``, its old name for the accounting method.
MECHANISM_KEYWORD_DEPRECATION = (
    "{caller}(mechanism=...) is deprecated and will be removed in a later release: the accounting "
    "method is named accountant= (as in Opacus: accountant='pld', 'rdp' or 'prv'), with the same values "
    "and the same default. In adaclip 'mechanism' names the clip-and-noise release, and noise_mechanism= "
    "the noise it adds"
)


def warn_mechanism_keyword(caller: str, *, stacklevel: int) -> None:
    """Warn (:class:`FutureWarning`, shown to users by default) that ``caller``'s ``mechanism=``
    is now ``accountant=``. ``stacklevel`` counts from this function's caller: 1 is the line
    that calls this, 2 the line that called that function (the user's, for a public function
    that warns from its own body)."""
    warnings.warn(MECHANISM_KEYWORD_DEPRECATION.format(caller=caller), FutureWarning, stacklevel=stacklevel + 1)


# --------------------------------------------------------------------------- AdaCliP's options


class AdaptiveOptions(TypedDict, total=False):
    """The keywords of AdaCliP, every one optional: those of
    :func:`adaclip.strategies.adaptive_clipping`, ``adaclip_torch.AdaClip`` and
    ``adaclip_jax.adaclip``. A keyword left out (or ``None``, except ``preset`` and
    ``std_spread``) takes the preset's value, else the default of
    :class:`adaclip.strategies.AdaptiveClipping`.

    Notation (:mod:`adaclip.adaptive` has the maths of every part): ``g̃`` the released
    gradient, ``a`` the centre, ``b`` the scale, ``s`` the std estimates, ``σ`` the noise
    multiplier, ``B̄`` the expected batch size, ``d`` the number of coordinates. Each option
    reads only the strategy's state, which reads only released values, so every choice is
    post-processing of the same Gaussian mechanism and the accounting is unchanged.

    Attributes:
      preset: the starting point, a key of :data:`ADAPTIVE_PRESETS`: ``"centred"`` (the
        default) or ``"patent"``.
      std_min: lower end of the range ``s`` stays in. With ``std_max`` it sets
        ``s_0 = sqrt(std_min·std_max)`` and how far the clip region can shrink and grow
        (coupled scale: ``b = s_0·sqrt(d)`` per coordinate at initialisation).
      std_max: upper end of that range.
      beta_mean: ``β1``, the weight of the centre's EMA ``m' = β1·m + (1−β1)·g̃``.
      beta_std: ``β2``, the weight of the variance EMA ``s'² = β2·s² + (1−β2)·v``.
      initial_max_grad_norm: ``C0``, instead of ``std_min``/``std_max`` (refused together):
        ``s_0 = C0/√d``, ``std_min, std_max = s_0/std_spread, s_0·std_spread``
        (:func:`adaclip.strategies.std_bounds_for_initial_clip`), so the first step clips like
        flat clipping at ``C0``. With the separated scale it is also ``max_grad_norm`` (giving
        both is refused).
      std_spread: ``≥ 1``, how far ``s`` may move either way of ``s_0`` when the bounds come
        from a clip norm (30 when left out).
      scale: ``"coupled"`` (the patent, ``b = √s·√Σs``: the statistics set the clip level too;
        needs ``preset="patent"``) or ``"separated"`` (``b = C_t·s^p/mean(s^p)``: the
        statistics set only the shape).
      max_grad_norm: ``C`` of the separated scale (the initial ``C_0`` with ``quantile``);
        refused with the coupled scale.
      shape_power: ``p`` of the separated scale (0.5: AdaCliP's noise-minimising shape; 1:
        proportional to the spread, as scale-then-privatize).
      statistic: ``"deviation"`` (the spread of ``x = g̃ − a``, the patent) or
        ``"second_moment"`` (of ``x = g̃``, scale-then-privatize).
      correction: how the known noise variance ``n = b²σ²/B̄²`` is removed from ``x²``:
        ``"clamp"`` (the patent: ``v = clamp(x² − n, std_min², std_max²)`` each step),
        ``"unbiased"`` (the EMA of the unclamped ``x² − n``, clamped at use) or ``"none"``
        (the EMA of ``x²``, clamped at use).
      pooling: ``"coordinate"`` (the patent), ``"tensor"`` (the mean of ``v`` over each
        tensor) or ``"factored"`` (row and column EMAs ``R``, ``K`` of a tensor seen as
        ``out × rest``; estimate ``R⁺_i K⁺_j / mean(R⁺)``).
      update_every: ``k ≥ 1``; the statistics are updated every ``k`` steps from the last
        ``k`` releases, ``v = D²/k − N/k`` with ``D = Σ x``, ``N = Σ n`` (delayed statistics);
        the centre still moves every step.
      centre: ``"ema"`` (the patent, ``a = m``), ``"debiased"`` (``a = m/(1 − β1ᵗ)``),
        ``"kalman"`` (a per-coordinate Kalman filter with observation noise ``R = n``) or
        ``"none"`` (``a = 0``).
      process_noise: ``ρ`` of the Kalman centre (process variance ``Q = ρ·R``; the gain
        settles at ``K* = (√(ρ² + 4ρ) − ρ)/2``).
      freeze_statistics: keep ``s`` as initialised (e.g. from public data); the centre and
        ``C_t`` still move.
      quantile: a :class:`adaclip.strategies.QuantileRule` adapting ``C_t`` (separated scale
        only): ``C_{t+1} = C_t·exp(−η(f̃ − γ))`` from a released count of unclipped units,
        whose noise raises the gradient's multiplier to ``σ_g = (σ⁻² − (2σ_b)⁻²)^{-1/2}``
        (the accountant still records ``σ``).
      initial_variance: ``u_0``, the start of every variance average (default ``s_0²``);
        ``s`` starts at ``sqrt(clamp(u_0, std_min², std_max²))``; ``0`` starts an average of
        released squares from nothing, as an optimiser's second moment does.
    """

    preset: str
    std_min: float | None
    std_max: float | None
    beta_mean: float | None
    beta_std: float | None
    initial_max_grad_norm: float | None
    std_spread: float
    scale: str | None
    max_grad_norm: float | None
    shape_power: float | None
    statistic: str | None
    correction: str | None
    pooling: str | None
    update_every: int | None
    centre: str | None
    process_noise: float | None
    freeze_statistics: bool | None
    quantile: QuantileRule | None
    initial_variance: float | None


#: Every keyword of :class:`AdaptiveOptions`, in declaration order.
ADAPTIVE_OPTION_NAMES: tuple[str, ...] = tuple(AdaptiveOptions.__annotations__)


def split_adaptive_options(kwargs: Mapping[str, Any]) -> tuple[AdaptiveOptions, dict[str, Any]]:
    """``(options, rest)``: the keywords of ``kwargs`` that are AdaCliP's options, and the
    others (e.g. a wrapper's own keywords), neither changed."""
    options: dict[str, Any] = {k: v for k, v in kwargs.items() if k in ADAPTIVE_OPTION_NAMES}
    rest = {k: v for k, v in kwargs.items() if k not in ADAPTIVE_OPTION_NAMES}
    return options, rest  # type: ignore[return-value]


#: Named starting points of :func:`adaclip.strategies.adaptive_clipping` (``AdaClip(preset=...)``
#: in PyTorch, ``adaclip_jax.adaclip(preset=...)`` in JAX). Each is a set of
#: :class:`~adaclip.strategies.AdaptiveClipping` keywords; keywords given explicitly override the
#: preset's.
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
#:   ``β2 = 0.9``), :class:`~adaclip.strategies.AdaptiveClipping`'s own defaults.
ADAPTIVE_PRESETS: dict[str, dict[str, Any]] = {
    "centred": {"scale": "separated", "max_grad_norm": 1.0, "beta_mean": 0.99, "beta_std": 0.999,
                "centre": "ema", "pooling": "tensor", "correction": "unbiased"},
    "patent": {"scale": "coupled", "std_min": 1e-5, "std_max": 1.0, "beta_mean": 0.99, "beta_std": 0.9},
}  # fmt: skip
DEFAULT_PRESET = "centred"
