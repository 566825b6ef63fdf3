"""The mechanism: one private step for every strategy of the affine family.

A step transforms each unit's gradient with the strategy's centre ``a`` and scale ``b``,
clips it in the strategy's groups, sums, adds Gaussian noise once to the sum and transforms
back (the array-API primitives are in :mod:`adaclip.transform`)::

    w_i = (g_i − a)/b,   w̄_i = c_i·w_i with ‖w̄_i‖ ≤ r,   g̃ = b ⊙ (Σ_i w̄_i + σ z)/B̄ + a.

Every unit's contribution has norm ≤ 1 in w-space, so a step is the sampled Gaussian
mechanism with sensitivity 1 and noise multiplier σ, whatever the strategy: :func:`clip_and_sum`
(not private, its result must only go to :func:`release`) and :func:`release` (noise once,
rescale, and the strategy's next state from the released values only: post-processing), or
both at once in :func:`private_step`. The PyTorch, JAX and Flower plugins call these; they
never branch on the strategy.

This module also holds what a strategy is to the mechanism: its state (:class:`ClipState`),
the :class:`Strategy` protocol with its defaults, and :func:`check_state`, the checks a state
restored from a checkpoint passes before it is used. The strategies themselves are in
:mod:`adaclip.strategies` (which re-exports everything here).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

from adaclip import transform
from adaclip._array import namespace
from adaclip.errors import InvalidHyperparameterError
from adaclip.options import finite_positive, validate_sample_rate

Array = Any

__all__ = [
    "ClipState",
    "Strategy",
    "validate_mechanism",
    "validate_sample_rate",
    "per_tensor_clip_factors",
    "group_clip_factors",
    "clip_and_sum",
    "auxiliary_sums",
    "num_tensors_of",
    "release",
    "private_step",
    "check_state",
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

    Each per-tensor array has the parameter's shape. Where a strategy keeps one number per
    tensor (AdaCliP with ``pooling="tensor"``, ``AdaClip()``'s default) ``std`` and
    ``"variance"`` hold that number broadcast to the shape (with NumPy and PyTorch a stride-0
    view of one element: read-only, no memory; a copy is a full array).
    """

    step: Any
    mean: list[Array] | None = None
    std: list[Array] | None = None
    extra: dict[str, Any] | None = None


# --------------------------------------------------------------------------- validation


def validate_mechanism(noise_multiplier: Any, expected_batch_size: Any) -> tuple[float, float]:
    """Check ``σ >= 0`` and ``B̄ > 0`` (finite); return them as floats."""
    return (
        finite_positive("noise_multiplier", noise_multiplier, allow_zero=True),
        finite_positive("expected_batch_size", expected_batch_size),
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

    # Optional (the built-in strategies have them through their defaults):
    # ``check_state(state, like, **options)`` (see :func:`check_state`) and
    # ``noise_drift_applies()`` (see :func:`adaclip.adaptive.warn_of_noise_drift`).


def whole_vector(num_tensors: int) -> list[tuple[list[int], float]]:
    """One clip group: every tensor together, radius 1 (the whole vector clipped to norm 1)."""
    return [(list(range(num_tensors)), 1.0)]


class _AffineDefaults:
    """Defaults of the protocol: one clip group, clip to the radius, nothing released beside the gradient."""

    num_auxiliary = 0

    def clip_groups(self, num_tensors: int) -> list[tuple[list[int], float]]:
        """One clip group, the whole vector at radius 1 (:func:`whole_vector`): every strategy
        but per-layer clipping."""
        return whole_vector(num_tensors)

    #: ``clip_factors(sq_norm, radius)``: :func:`adaclip.transform.clip_factors`, ``min(1, r/√s)``
    #: (0 for a unit whose norm is not finite).
    clip_factors = staticmethod(transform.clip_factors)

    def auxiliary_sums(self, state: ClipState, sq_norms, factors) -> list[Array]:
        return []

    def noise_multipliers(self, noise_multiplier: Any, expected_batch_size: Any) -> tuple[Any, Any]:
        return noise_multiplier, 0.0

    def noise_drift_applies(self) -> bool:
        """Whether the noise can drive this strategy's clip level, so that the noise drift
        number is worth a warning (:func:`adaclip.adaptive.warn_of_noise_drift`): only for
        AdaCliP's coupled scale."""
        return False

    def check_state(self, state: ClipState, like: ClipState, **options: Any) -> ClipState:
        """A restored ``state`` checked against ``like`` (this strategy's own state for the same
        parameters) and copied: see :func:`check_state` for ``options`` and what is refused."""
        return check_state(self, state, like, **options)


class _StatelessMixin(_AffineDefaults):
    def init(self, params: Sequence[Array]) -> ClipState:
        return ClipState(step=0)

    def update(self, state: ClipState, noisy_grad, scale, *, auxiliary=(), noise_multiplier, expected_batch_size) -> ClipState:
        # every field spelled out, not ``_replace``: under ``compile_release=True`` torch 2.11's
        # dynamo traced ``_replace`` on this state into a malformed tuple (IndexError)
        return ClipState(step=state.step + 1, mean=state.mean, std=state.std, extra=state.extra)


def scalar_like(params: Sequence[Array], value: float) -> Array:
    """A 0-d array of ``params[0]``'s namespace, dtype and device holding ``value``."""
    xp = namespace(*params)
    return xp.full_like(xp.sum(params[0]), value)


# --------------------------------------------------------------------------- the step


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
    dropped = None  # the units with a non-finite norm anywhere: needed only with several groups
    factors: list[Array | None] = [None] * num
    for members, radius in strategy.clip_groups(num):
        group_sq = sum(sq_norms[k] for k in members)
        group_sq = group_sq * (1.0 + 2.0 * len(members) * transform.unit_roundoff(group_sq.dtype))
        c = strategy.clip_factors(group_sq, radius)
        if len(members) < num:  # per-layer groups: a unit non-finite elsewhere is dropped here too
            if dropped is None:
                dropped = transform.nonfinite_units(sq_norms)
            xp = namespace(c)
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


# --------------------------------------------------------------------------- restored states


class _Reader:
    """Turns one saved leaf into a checked array like a template entry (see :func:`check_state`)."""

    def __init__(self, like: ClipState, source: str, asarray: Callable[[Any], Array] | None) -> None:
        self.like, self.source, self._asarray = like, source, asarray

    def asarray(self, x: Any) -> Array:
        if self._asarray is not None:
            return self._asarray(x)
        templates = [a for a in _leaves(self.like) if a is not None]
        return namespace(*templates).asarray(x)

    def read(self, x: Any, ref: Array, what: str) -> Array:
        """``x`` as a finite array of ``ref``'s shape and dtype (a copy), or refused."""
        where = f"{self.source} {what}"
        try:
            t = self.asarray(x)
        except (TypeError, ValueError, RuntimeError):
            raise InvalidHyperparameterError(f"{where} is not a tensor: {type(x).__name__}") from None
        if tuple(t.shape) != tuple(ref.shape):
            raise InvalidHyperparameterError(f"{where} has shape {tuple(t.shape)}, expected {tuple(ref.shape)}")
        xp = namespace(t)
        if not (xp.isdtype(t.dtype, "real floating") or t.dtype in (xp.int32, xp.int64)):
            raise InvalidHyperparameterError(f"{where} has dtype {t.dtype}, expected a real dtype")
        t = xp.astype(t, ref.dtype, copy=True)
        if not bool(xp.all(xp.isfinite(t))):
            raise InvalidHyperparameterError(f"{where} contains NaN or inf")
        return t


def _leaves(state: ClipState) -> list[Any]:
    out = list(state.mean or []) + list(state.std or [])
    for value in (state.extra or {}).values():
        out.extend(value if isinstance(value, (list, tuple)) else [value])
    return out


def _label(what: str, names: Sequence[str] | None, k: int) -> str:
    return f"{what} for {names[k]!r}" if names is not None else f"{what} for tensor {k}"


def _step_count(what: str, value: Any) -> int:
    """A step count: an int ``>= 0``; a one-element array of an integer (or bool) dtype counts."""
    if hasattr(value, "shape") and hasattr(value, "dtype") and math.prod(value.shape) == 1:
        xp = namespace(value)
        if not xp.isdtype(value.dtype, ("real floating", "complex floating")):
            value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidHyperparameterError(f"{what} must be an int >= 0, got {value!r}")
    return value


def _per_tensor(reader: _Reader, values: Any, like: Any, key: str, names: Sequence[str] | None) -> list[Array] | None:
    """``mean`` or ``std``: ``None`` exactly where the template has none, else one array per tensor."""
    what = f"clip_state[{key!r}]"
    if (values is None) != (like is None):
        raise InvalidHyperparameterError(f"{reader.source} {what} does not match the strategy")
    if values is None:
        return None
    if len(values) != len(like):
        raise InvalidHyperparameterError(
            f"{reader.source} {what} has {len(values)} tensors, expected {len(like)}"
        )
    return [reader.read(v, ref, _label(what, names, k)) for k, (v, ref) in enumerate(zip(values, like))]


def _check_std_range(strategy: Any, std: list[Array], names: Sequence[str] | None, source: str) -> None:
    """``s`` always stays in ``[std_min, std_max]``; allow the rounding of its dtype."""
    for k, v in enumerate(std):
        xp = namespace(v)
        slack = 16 * transform.unit_roundoff(v.dtype)
        low, high = strategy.std_min * (1 - slack), strategy.std_max * (1 + slack)
        lo, hi = float(xp.min(v)), float(xp.max(v))
        if lo < low or hi > high:
            label = _label("clip_state['std']", names, k)
            raise InvalidHyperparameterError(
                f"{source} {label} is outside "
                f"[std_min, std_max] = [{strategy.std_min}, {strategy.std_max}] (min {lo}, max {hi})"
            )


def _as_list(t: Array) -> Any:
    return t.tolist() if hasattr(t, "tolist") else t


def _check_extra_values(key: str, arrays: Sequence[Array], what: str, update_every: Any) -> None:
    """The ranges of the documented ``extra`` entries (already finite): ``clip_norm > 0``;
    ``window_count`` a whole number in ``[0, update_every)``; ``window_noise >= 0`` (a sum of
    noise variances); ``centre_var >= 0`` or ``-1`` (no observation yet). The variance
    accumulators may be negative (the unbiased correction) and are only required finite."""
    for t in arrays:
        xp = namespace(t)
        if key == "clip_norm" and not bool(xp.all(t > 0)):
            raise InvalidHyperparameterError(f"{what} must be > 0, got {_as_list(t)!r}")
        if key == "window_count":
            ok = bool(xp.all(xp.logical_and(t >= 0, t == xp.round(t))))
            if ok and isinstance(update_every, int):
                ok = bool(xp.all(t < update_every))
            if not ok:
                raise InvalidHyperparameterError(
                    f"{what} must be a whole number in [0, update_every={update_every}), got {_as_list(t)!r}"
                )
        if key == "window_noise" and not bool(xp.all(t >= 0)):
            raise InvalidHyperparameterError(f"{what} must be >= 0 (a sum of noise variances)")
        if key == "centre_var" and not bool(xp.all(xp.logical_or(t >= 0, t == -1))):
            raise InvalidHyperparameterError(f"{what} must be >= 0, or -1 where no release has been observed yet")


def _check_extra_keys(strategy: Any, saved: Any, template: dict[str, Any] | None, source: str) -> None:
    """The option state's keys are the strategy's (a checkpoint of other options is refused)."""
    name = type(strategy).__name__
    if template is None:
        if saved:
            listed = sorted(saved) if isinstance(saved, dict) else saved
            raise InvalidHyperparameterError(
                f"{source} clip_state['extra'] has option state {listed!r}, "
                f"but {name} keeps none: the checkpoint is of another strategy"
            )
        return
    if not isinstance(saved, dict):
        raise InvalidHyperparameterError(
            f"{source} clip_state['extra'] must be a dict with {sorted(template)} (the option state of "
            f"{name}), got {type(saved).__name__}: the checkpoint is of another strategy or options"
        )
    if set(saved) != set(template):
        missing, unexpected = sorted(set(template) - set(saved)), sorted(set(saved) - set(template))
        raise InvalidHyperparameterError(
            f"{source} clip_state['extra'] does not match the strategy's options: missing {missing}, "
            f"unexpected {unexpected}"
        )


def _extra(
    strategy: Any, reader: _Reader, saved: Any, template: dict[str, Any] | None, names: Sequence[str] | None
) -> dict[str, Any] | None:
    """The option state ``extra`` checked against the template's (keys, and per entry
    ``None``-ness, shape, dtype, finiteness and range) and copied."""
    source = reader.source
    _check_extra_keys(strategy, saved, template, source)
    if template is None:
        return None
    out: dict[str, Any] = {}
    for key, like in template.items():
        value, what = saved[key], f"clip_state['extra'][{key!r}]"
        if isinstance(like, list):
            if not isinstance(value, (list, tuple)) or len(value) != len(like):
                raise InvalidHyperparameterError(
                    f"{source} {what} must be a list of {len(like)} entries (one per tensor), got {value!r}"[:300]
                )
            entries: list[Array | None] = []
            for k, (v, ref) in enumerate(zip(value, like, strict=True)):
                label = _label(what, names, k)
                if (v is None) != (ref is None):
                    raise InvalidHyperparameterError(
                        f"{source} {label} is {'None' if v is None else 'a tensor'}, expected "
                        f"{'None (the entry does not apply to this tensor)' if ref is None else 'a tensor'}"
                    )
                entries.append(None if v is None else reader.read(v, ref, label))
            out[key] = entries
            checked = [e for e in entries if e is not None]
        else:
            out[key] = reader.read(value, like, what)
            checked = [out[key]]
        _check_extra_values(key, checked, f"{source} {what}", getattr(strategy, "update_every", None))
    return out


def check_state(
    strategy: Strategy,
    state: ClipState,
    like: ClipState,
    *,
    names: Sequence[str] | None = None,
    source: str = "state_dict",
    asarray: Callable[[Any], Array] | None = None,
) -> ClipState:
    """A strategy state restored from a checkpoint, checked and copied before it is used.

    ``like`` is the strategy's own state for the same parameters (its ``init`` of them, or the
    current state): it gives which entries exist, their shapes and their dtypes. Every array of
    ``state`` is converted with ``asarray`` (default: ``asarray`` of ``like``'s array
    namespace) and must have the template's shape and a real dtype (floating, int32 or int64);
    it is then cast to the template's dtype (a copy; the device is left as it is, the caller
    places the arrays) and must be finite. Refused as well, with
    :class:`~adaclip.errors.InvalidHyperparameterError`: ``mean``/``std``/``extra`` present
    where the strategy keeps none or the reverse, lists of the wrong length, ``extra`` keys
    other than the strategy's, an ``extra`` entry ``None`` where an array belongs (or the
    reverse); AdaCliP's ``s`` outside ``[std_min, std_max]`` beyond 16 units of roundoff of its
    dtype; a step count that is not an int ``>= 0`` (a one-element integer array counts); and
    the ranges of the ``extra`` entries: ``clip_norm > 0``, ``window_count`` a whole number in
    ``[0, update_every)``, ``window_noise >= 0``, ``centre_var >= 0`` or ``-1`` (no
    observation yet). The variance accumulators may be negative and are only required finite.
    A strategy with a ``check_restored(state, names=, source=)`` method adds its own invariants
    last (:class:`~adaclip.strategies.AdaptiveClipping` with ``pooling="tensor"``: each tensor's
    statistics one number across the tensor).

    Every value of a restored state is a function of released values, so none of this is
    about privacy: it keeps a checkpoint of another model, strategy or option set (or a
    corrupted one) from silently driving the clipping.

    Args:
      strategy: the strategy the state is for.
      state: the restored state (``step``, lists of per-tensor arrays, ``extra`` a dict).
      like: the template state.
      names: one name per tensor (e.g. parameter names), for the messages.
      source: what the state came from, the first word of every message.
      asarray: how to turn a saved leaf into an array (e.g. ``torch.as_tensor``).

    Returns:
      The checked state: ``step`` an int, every array a copy in the template's dtype. The
      checks run in the order ``std``, its range, ``step``, ``extra``, ``mean``.
    """
    reader = _Reader(like, source, asarray)
    std = _per_tensor(reader, state.std, like.std, "std", names)
    if std is not None:
        _check_std_range(strategy, std, names, source)
    step = _step_count(f"{source} clip_state['step']", state.step)
    extra = _extra(strategy, reader, state.extra, like.extra, names)
    mean = _per_tensor(reader, state.mean, like.mean, "mean", names)
    checked = ClipState(step=step, mean=mean, std=std, extra=extra)
    strategy_rules = getattr(strategy, "check_restored", None)
    if strategy_rules is not None:  # what the strategy's own invariants add (AdaptiveClipping: pooling)
        strategy_rules(checked, names=names, source=source)
    return checked
