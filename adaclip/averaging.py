"""Parameter averaging: an exponential moving average (EMA) or a tail average of the iterates.

Averaging the iterates of DP training removes part of the noise that the last iterate still
carries: on long runs the average is typically 1–3 accuracy points better than the last
iterate. This module is the framework-neutral maths (plain arithmetic on arrays, so NumPy,
PyTorch and JAX arrays all work); :class:`adaclip_torch.ParameterAverage` and
:func:`adaclip_jax.parameter_averaging` apply it to a model's parameters and to a pytree.

**The two averages.** Write ``θ_0`` for the initial parameters and ``θ_s`` for the parameters
after the ``s``-th optimizer step. Every update blends the new iterate into the average,

.. math::

    \\bar θ \\leftarrow (1 - w)\\,\\bar θ + w\\,θ_{s},

with a weight ``w`` that depends only on the configuration and on the number ``t`` of updates
averaged so far (:func:`averaging_weight`):

- ``kind="ema"`` — exponential moving average with warm-up: ``θ̄_0 = θ_0`` and
  ``θ̄_{t+1} = μ_t θ̄_t + (1 − μ_t) θ_{t+1}`` with ``μ_t = min(μ, (1 + t)/(10 + t))``
  (``warmup=False``: ``μ_t = μ``). The warm-up keeps the first iterates, which are far from
  where training ends, from dominating the average for ``~H`` steps: ``μ_0 = 0.1``,
  ``μ_1 ≈ 0.18``, ``μ_9 ≈ 0.53``, and ``μ_t`` reaches ``μ`` after about ``10/(1 − μ)`` steps.
  The decay can be given as the *horizon* ``H``, the number of steps the average effectively
  spans: ``μ = 1 − 1/H`` (:func:`ema_decay_for_horizon`; the weights ``(1 − μ)μ^k`` have mean
  age ``μ/(1 − μ) ≈ H``).
- ``kind="tail"`` — the uniform average of the iterates from step ``start`` on:
  ``θ̄ = mean(θ_s for s ≥ start)``, kept as a running mean ``θ̄ ← θ̄ + (θ − θ̄)/(k + 1)`` where
  ``k`` iterates are already in it.

Before ``start`` (for either kind) the average simply follows the parameters (``w = 1``), so
it is always a usable set of parameters; the EMA's warm-up counts from ``start``.

**Default horizon.** :func:`default_horizon` gives ``H = 10 %`` of the run (clamped to
``[10, total_steps]``). An average over 5–20 % of the run is the sensible range: shorter and it
removes little noise; longer and it mixes in iterates from early in training, which are still
far from the optimum (the bias outweighs the variance it removes). 10 % is the middle of that
range; a tail average with the default start covers the same last 10 %.

**Privacy.** The average is a function of the released iterates only: each ``θ_s`` is the
output of a private step, and averaging is post-processing of those outputs, so it costs no
privacy (no ε, no δ) and needs no accounting. That holds only if the average is updated from
the parameters *after* a private step — never from per-example gradients, un-noised sums, or
parameters stepped on a raw gradient. Updated from the parameters the optimizer has just
released, the averaged model can be evaluated, saved and published like the last iterate.

Example (NumPy)::

    config = AveragingConfig(kind="ema", horizon=100)
    average, count = init_average(params)
    for step in range(steps):
        params = private_update(params)                      # a released iterate
        average, count = update_average(config, average, params, count)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from adaclip._array import namespace
from adaclip.errors import InvalidHyperparameterError

__all__ = [
    "KINDS",
    "AveragingConfig",
    "averaging_weight",
    "blend",
    "config_from_spec",
    "default_horizon",
    "ema_decay_at",
    "ema_decay_for_horizon",
    "ema_horizon_for_decay",
    "init_average",
    "update_average",
]

KINDS = ("ema", "tail")

# The warm-up μ_t = min(μ, (1 + t)/(WARMUP_OFFSET + t)) (the convention of TensorFlow's
# ExponentialMovingAverage with num_updates).
WARMUP_OFFSET = 10


def _is_int(value: Any) -> bool:
    return not isinstance(value, bool) and hasattr(value, "__index__")


def _check_horizon(horizon: Any) -> float:
    if isinstance(horizon, (bool, str, bytes)):
        raise InvalidHyperparameterError(f"horizon must be a number >= 1, got {horizon!r}")
    try:
        h = float(horizon)
    except (TypeError, ValueError):
        raise InvalidHyperparameterError(f"horizon must be a number >= 1, got {horizon!r}") from None
    if not math.isfinite(h) or h < 1:
        raise InvalidHyperparameterError(
            f"horizon must be finite and >= 1 (H = 1 is the last iterate), got {horizon!r}"
        )
    return h


def _check_decay(decay: Any) -> float:
    if isinstance(decay, (bool, str, bytes)):
        raise InvalidHyperparameterError(f"decay must be a number in [0, 1), got {decay!r}")
    try:
        mu = float(decay)
    except (TypeError, ValueError):
        raise InvalidHyperparameterError(f"decay must be a number in [0, 1), got {decay!r}") from None
    if not (0.0 <= mu < 1.0):
        raise InvalidHyperparameterError(
            f"decay must be in [0, 1) (0 is the last iterate; 1 would never move), got {decay!r}"
        )
    return mu


def ema_decay_for_horizon(horizon: float) -> float:
    """The EMA decay ``μ = 1 − 1/H`` whose average spans about ``H`` steps (``H >= 1``).

    Raises:
      InvalidHyperparameterError: ``H`` is not a finite number ``>= 1``.
    """
    return 1.0 - 1.0 / _check_horizon(horizon)


def ema_horizon_for_decay(decay: float) -> float:
    """The horizon ``H = 1/(1 − μ)`` of an EMA decay ``μ`` in ``[0, 1)``.

    Raises:
      InvalidHyperparameterError: ``μ`` is not in ``[0, 1)``.
    """
    return 1.0 / (1.0 - _check_decay(decay))


def default_horizon(total_steps: int) -> int:
    """The default span of the average: 10 % of the run, clamped to ``[10, total_steps]``.

    ``ceil(total_steps/10)``, at least 10 steps (fewer would remove little noise) and at most
    the run. 5–20 % of the run is the sensible range (see the module docstring); 10 % is its
    middle.

    Raises:
      InvalidHyperparameterError: ``total_steps`` is not a positive integer.
    """
    if not _is_int(total_steps) or int(total_steps) <= 0:
        raise InvalidHyperparameterError(f"total_steps must be a positive integer, got {total_steps!r}")
    t = int(total_steps)
    return min(max(10, -(-t // 10)), t)


def ema_decay_at(decay: float, t: int, warmup: bool = True) -> float:
    """``μ_t = min(μ, (1 + t)/(10 + t))`` (``μ`` without warm-up), ``t`` updates averaged so far."""
    if not warmup:
        return float(decay)
    return min(float(decay), (1.0 + t) / (WARMUP_OFFSET + t))


@dataclasses.dataclass(frozen=True)
class AveragingConfig:
    """What to average and how; validated on construction.

    Args:
      kind: ``"ema"`` (exponential moving average) or ``"tail"`` (uniform average from
        ``start`` on).
      decay: the EMA decay ``μ`` in ``[0, 1)``. Give ``decay`` or ``horizon`` for ``"ema"``
        (neither for ``"tail"``).
      horizon: the EMA horizon ``H >= 1`` (``μ = 1 − 1/H``), in steps.
      start: the first step whose iterate is averaged (``0``: the initial parameters); before
        it the average follows the parameters. For ``"ema"`` the warm-up counts from it.
      warmup: the EMA warm-up ``μ_t = min(μ, (1 + t)/(10 + t))`` (ignored by ``"tail"``).

    Raises:
      InvalidHyperparameterError: an unknown ``kind``, a decay outside ``[0, 1)``, a horizon
        below 1, both or neither of ``decay``/``horizon`` for ``"ema"``, either for ``"tail"``,
        a negative or non-integer ``start``, a non-boolean ``warmup``.
    """

    kind: str = "ema"
    decay: float | None = None
    horizon: float | None = None
    start: int = 0
    warmup: bool = True

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidHyperparameterError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind == "ema":
            if (self.decay is None) == (self.horizon is None):
                raise InvalidHyperparameterError(
                    "an EMA needs exactly one of decay (μ) or horizon (H, μ = 1 − 1/H), got "
                    f"decay={self.decay!r}, horizon={self.horizon!r}"
                )
            if self.decay is not None:
                object.__setattr__(self, "decay", _check_decay(self.decay))
            else:
                object.__setattr__(self, "horizon", _check_horizon(self.horizon))
        elif self.decay is not None or self.horizon is not None:
            raise InvalidHyperparameterError(
                f"a tail average takes no decay or horizon (its span is set by start), got "
                f"decay={self.decay!r}, horizon={self.horizon!r}"
            )
        if not _is_int(self.start) or int(self.start) < 0:
            raise InvalidHyperparameterError(f"start must be an integer >= 0, got {self.start!r}")
        object.__setattr__(self, "start", int(self.start))
        if not isinstance(self.warmup, bool):
            raise InvalidHyperparameterError(f"warmup must be True or False, got {self.warmup!r}")

    @property
    def effective_decay(self) -> float | None:
        """The EMA's ``μ`` (from ``decay`` or ``horizon``); ``None`` for a tail average."""
        if self.kind != "ema":
            return None
        return self.decay if self.decay is not None else ema_decay_for_horizon(self.horizon)

    def as_dict(self) -> dict[str, Any]:
        """The fields as a plain dict (what checkpoints store)."""
        return dataclasses.asdict(self)


def config_from_spec(spec: Any, total_steps: int | None = None) -> AveragingConfig | None:
    """An :class:`AveragingConfig` from a short specification, for plugin keywords.

    ``spec`` is one of:

    - ``None`` — no averaging (returns ``None``);
    - ``"ema"`` — an EMA over the :func:`default_horizon` of ``total_steps``;
    - ``"tail"`` — the tail average of the last :func:`default_horizon` steps
      (``start = total_steps − H``);
    - a float in ``[0, 1)`` — an EMA with that decay (``total_steps`` not needed);
    - an :class:`AveragingConfig` — used as is;
    - a mapping — the keywords of :class:`AveragingConfig`; an ``"ema"`` with neither
      ``decay`` nor ``horizon`` gets the default horizon of ``total_steps``.

    Raises:
      InvalidHyperparameterError: any other spec, or ``"ema"``/``"tail"`` without
        ``total_steps``.
    """
    if spec is None or isinstance(spec, AveragingConfig):
        return spec
    if isinstance(spec, str):
        if spec not in KINDS:
            raise InvalidHyperparameterError(f"averaging must be one of {KINDS}, a decay or a config, got {spec!r}")
        if total_steps is None:
            raise InvalidHyperparameterError(
                f"averaging={spec!r} takes its span from the run length: give total_steps (or an explicit "
                "decay/horizon/start in an AveragingConfig)"
            )
        h = default_horizon(total_steps)
        if spec == "ema":
            return AveragingConfig(kind="ema", horizon=h)
        return AveragingConfig(kind="tail", start=int(total_steps) - h)
    if isinstance(spec, float):
        return AveragingConfig(kind="ema", decay=spec)
    if isinstance(spec, Mapping):
        kwargs = dict(spec)
        if kwargs.get("kind", "ema") == "ema" and kwargs.get("decay") is None and kwargs.get("horizon") is None:
            if total_steps is None:
                raise InvalidHyperparameterError("an EMA without decay or horizon needs total_steps")
            kwargs["horizon"] = default_horizon(total_steps)
        try:
            return AveragingConfig(**kwargs)
        except TypeError as e:
            raise InvalidHyperparameterError(f"averaging spec {spec!r}: {e}") from None
    raise InvalidHyperparameterError(
        f"averaging must be None, 'ema', 'tail', a decay in [0, 1), a mapping or an AveragingConfig, got {spec!r}"
    )


def averaging_weight(config: AveragingConfig, count: Any, *, xp: Any = None, dtype: Any = None) -> Any:
    """The weight ``w`` of the new iterate in the update that follows ``count`` updates.

    The update is ``θ̄ ← (1 − w) θ̄ + w θ``; ``count`` is the number of updates made so far
    (0 at :func:`init_average`), so the new iterate is ``θ_{count+1}`` and its position in
    the averaging window is ``j = count + 1 − start``:

    - ``j <= 0`` (before ``start``): ``w = 1`` (the average follows the parameters);
    - ``"tail"``: ``w = 1/(j + 1)``, for ``j >= 0`` (at ``j = 0``, ``w = 1``: ``θ_start`` opens
      the window);
    - ``"ema"``: ``w = 1 − μ_{j−1}`` with ``μ_t`` of :func:`ema_decay_at`, for ``j >= 1``.

    ``count`` a Python ``int``: returns a Python float (double precision). ``count`` an array
    (a traced JAX scalar, say): computed with the array namespace ``xp`` (default: ``count``'s)
    in ``dtype`` (default: the namespace's default float), without Python branching on its value,
    so it can be jitted.
    """
    start = config.start
    if xp is None and _is_int(count) and not hasattr(count, "dtype"):
        j = int(count) + 1 - start
        if j <= 0:
            return 1.0
        if config.kind == "tail":
            return 1.0 / (j + 1)
        return 1.0 - ema_decay_at(config.effective_decay, j - 1, config.warmup)
    xp = namespace(count) if xp is None else xp
    if dtype is None:
        dtype = xp.asarray(1.0).dtype
    j = xp.astype(xp.asarray(count), dtype) + (1.0 - start)
    jc = xp.maximum(j, xp.ones_like(j))  # keeps the unused branch finite before start
    if config.kind == "tail":
        inside = 1.0 / (jc + 1.0)
    else:
        t = jc - 1.0
        mu_t = (1.0 + t) / (WARMUP_OFFSET + t) if config.warmup else xp.zeros_like(t) + 1.0
        mu_t = xp.minimum(mu_t, xp.full_like(mu_t, config.effective_decay))
        inside = 1.0 - mu_t
    return xp.where(j <= 0.0, xp.ones_like(j), inside)


def _map(fn: Any, *trees: Any) -> Any:
    """``fn`` over arrays, or over matching lists/tuples/dicts of arrays."""
    first = trees[0]
    if isinstance(first, Mapping):
        keys = list(first)
        for other in trees[1:]:
            if not isinstance(other, Mapping) or list(other) != keys:
                raise InvalidHyperparameterError("average and params must have the same keys, in the same order")
        return type(first)((k, _map(fn, *(t[k] for t in trees))) for k in keys)
    if isinstance(first, (list, tuple)):
        for other in trees[1:]:
            if not isinstance(other, (list, tuple)) or len(other) != len(first):
                raise InvalidHyperparameterError("average and params must have the same structure")
        return type(first)(_map(fn, *parts) for parts in zip(*trees))
    return fn(*trees)


def blend(average: Any, params: Any, w: Any) -> Any:
    """``(1 − w)·average + w·params`` for one array (exact at ``w = 1`` and ``w = 0``)."""
    return (1.0 - w) * average + w * params


def _copy(x: Any) -> Any:
    xp = namespace(x)
    return xp.asarray(x, copy=True)


def init_average(params: Any) -> tuple[Any, int]:
    """``(θ̄_0, 0)``: a copy of ``params`` (an array, or a list/tuple/dict of arrays) and count 0."""
    return _map(_copy, params), 0


def update_average(config: AveragingConfig, average: Any, params: Any, count: Any) -> tuple[Any, Any]:
    """``(θ̄_new, count + 1)``: blend the new iterate ``params`` into ``average``.

    Pure: returns new arrays, modifies nothing. ``params`` must be the parameters *after* a
    private step (see the module docstring); ``average`` and ``params`` have the same structure
    (an array, or a list/tuple/dict of arrays).
    """
    if not isinstance(config, AveragingConfig):
        raise InvalidHyperparameterError(f"config must be an AveragingConfig, got {config!r}")
    w = averaging_weight(config, count)
    return _map(lambda a, p: blend(a, p, w), average, params), count + 1
