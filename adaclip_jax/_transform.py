"""The private aggregation step as an optax ``GradientTransformation``.

One implementation, :func:`private_aggregate`, serves the whole affine clipping family
(transform, clip, add noise once, transform back); :func:`adaclip`, :func:`flat_clip`,
:func:`per_layer_clip` and :func:`scaled_clip` only choose the core strategy. The maths is
:func:`adaclip.strategies.clip_and_sum` and :func:`adaclip.strategies.release`; this module
adds the optax plumbing (pytrees, PRNG keys and secure mode, dtypes, static checks, data
parallelism).

For a strategy with centre ``a`` and scale ``b`` (both functions of the state only), the
update that goes to the next transformation of the chain is

.. math::
    \\tilde g = b ⊙ \\frac{Σ_i \\bar w_i + σ_t z}{B̄} + a,\\qquad
    \\bar w_i = w_i·\\min(1, r/‖w_i‖),\\quad w_i = (g_i − a)/b,\\quad z \\sim N(0, I),

with the sum over the units of the batch (leading axis of the input), ``B̄`` the *expected*
batch size (never the realised one) and one ``z`` per step, drawn from a split of the key in
the state (in secure mode, of that key with fresh OS bits folded in). For AdaCliP,
``a = m_t`` and ``b = sqrt(s_t)·sqrt(Σ s_t)``, and ``(m, s)`` are then updated from ``g̃``
alone (post-processing); the options of :class:`adaclip.AdaptiveClipping` (see
:mod:`adaclip.adaptive`) change how ``a``, ``b`` and the statistics are formed, never this step.

A strategy may release *auxiliary* sums with the gradient (the quantile rule's count of
unclipped units, ``strategy.num_auxiliary`` 0-d sums). They are extra entries of the summed
list: summed (``psum``-ed) like the tensors, noised with their own 0-d draws, and the
gradient's noise multiplier is raised to ``σ_g`` so that the pair is one Gaussian mechanism
with multiplier ``σ`` (:meth:`adaclip.strategies.Strategy.noise_multipliers`). The state and
the accountant only ever see ``σ``.
"""

from __future__ import annotations

import math
import secrets
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import io_callback

from adaclip import strategies as _strategies
from adaclip import transform as _core_transform
from adaclip.correlated.mechanism import BandedNoise, NoiseStreamState, resolve_noise_mechanism
from adaclip.errors import InvalidGradientError, InvalidHyperparameterError
from adaclip_jax import _kernel, _position

__all__ = [
    "AdaClipState",
    "ClippedSum",
    "PrivateTransformation",
    "private_aggregate",
    "adaclip",
    "flat_clip",
    "per_layer_clip",
    "scaled_clip",
    "quantile_clip",
    "automatic_clip",
    "scale_then_privatize",
    "with_public_statistics",
    "check_inputs",
    "refresh_key",
]

NoiseMultiplier = float | Callable[[jax.Array], Any]


class AdaClipState(NamedTuple):
    """State of :func:`private_aggregate` (and of every transformation built on it).

    Attributes:
      step: int32 scalar, number of updates applied (non-finite releases included).
      key: the PRNG key of the *next* step's noise; split on every update, so it advances
        every step (also on a non-finite step). **Secret in seeded mode**: it determines the
        noise of every later step (see "Checkpoints" in :func:`private_aggregate`). In secure
        mode it does not predict the noise (each step also folds in fresh OS bits).
      mean: AdaCliP's mean (centre) estimates ``m`` as a pytree with the parameters' structure
        (float32, or float64 for float64 parameters); ``None`` for stateless strategies and
        for ``centre="none"``. A function of earlier releases only (post-processing), not
        secret beyond them.
      std: AdaCliP's std estimates ``s``, likewise (``None`` for strategies without them).
      nonfinite_steps: int32 scalar, number of steps whose *released* gradient was not finite
        (e.g. a NaN, infinite or negative traced σ, or a traced σ the quantile rule's split
        cannot serve; a NaN/inf per-unit gradient does *not* make the release non-finite,
        that unit is dropped). A function of the released values only. On such a step
        ``mean``/``std``/``extra`` are kept unchanged.
      last_noise_multiplier: float32 scalar, the σ that the last update used (0 before the
        first update, and for a static σ = 0), the value given by the ``noise_multiplier=``
        keyword of ``update``, the schedule's ``σ_t``, or the constructor's σ. This is the
        *accounted* σ of the whole release, not the gradient's raised ``σ_g`` when a strategy
        releases an auxiliary count (quantile rule). :class:`adaclip_jax.PrivacyTracker` reads
        it to record the σ actually used.
      seeded: bool scalar, ``True`` in seeded mode (the noise is a function of ``key``),
        ``False`` in secure mode. :class:`adaclip_jax.PrivacyTracker` warns when a seeded
        state's key is used a second time (a restored or reused state replays its noise).
      extra: the core's option state (:attr:`adaclip.strategies.ClipState.extra`), ``None``
        for strategies and options without one. Unlike ``mean``/``std`` it keeps the core's
        *flat* layout: a dict whose values are lists with one entry per parameter leaf in
        ``jax.tree_util`` leaf order (an array, or ``None`` where the entry does not apply, e.g.
        ``"variance"`` of a factored matrix) or 0-d arrays (``"window_count"``,
        ``"clip_norm"``: the quantile rule's ``C_t``). A function of released values only,
        like ``mean``/``std``. Last, with a default, so states built by keyword without it
        stay valid.
      noise_buffers: ``None`` for independent noise (DP-SGD, and ``b = 1``). With banded noise
        (``noise_mechanism="banded"``, ``b > 1`` bands) a tuple of ``b − 1`` buffers, the last
        noise vectors ``x_{t−1}, x_{t−2}, …`` (most recent first), each a list with one array
        per parameter leaf (``jax.tree_util`` leaf order, the leaf's shape, the statistics
        dtype); zeros at ``init`` (which makes the first steps exact: a missing ``x_{t−j}`` is
        0). Shifted on every update, so the shapes never change under ``jit``; the stream's
        position is ``step``. **Secret, like the key, in both modes**: they are past noise, and
        subtracting them from past releases gives past clipped sums. A restored state carries
        its buffers (and its ``step``): restore them together, never one without the other.
        Last, with a default, so states built by keyword without it stay valid.
    """

    step: jax.Array
    key: jax.Array
    mean: Any
    std: Any
    nonfinite_steps: jax.Array
    last_noise_multiplier: jax.Array
    seeded: jax.Array
    extra: Any = None
    noise_buffers: Any = None


class ClippedSum(NamedTuple):
    """``Σ_i w̄_i``: per-unit gradients already transformed, clipped and summed (w-space),
    one array per parameter leaf, from :func:`adaclip_jax.clipped_sum_grads`.

    NOT private: it must only go to the ``update`` of the transformation whose state clipped
    it (in place of per-unit gradients), which adds the noise and rescales.

    Attributes:
      summed: the clipped sums, a pytree with the parameters' structure and shapes.
      auxiliary: the strategy's ``num_auxiliary`` auxiliary sums (0-d arrays, e.g. the
        quantile rule's count ``Σ_i (1[‖w_i‖ ≤ 1] − ½)``), in the core's order; ``()`` for
        strategies without them. Equally NOT private: they get their noise in ``update``.
    """

    summed: Any
    auxiliary: tuple[Any, ...] = ()


class _StrategySlot:
    """The core strategy of a transformation: given at construction, or built on first use
    from the number ``d`` of parameter coordinates (``adaclip(initial_max_grad_norm=C0)``:
    :meth:`adaclip.AdaptiveClipping.from_initial_clip` needs ``d``, known at ``init``).

    ``probe`` is a strategy with every hyperparameter that does not depend on ``d`` (used for
    the construction-time checks: kernel eligibility, σ validity, the kind of strategy).
    """

    def __init__(self, strategy: Any = None, build: Callable[[int], Any] | None = None, probe: Any = None):
        self._strategy = strategy
        self._build = build
        self._num_params: int | None = None
        self.probe = strategy if probe is None else probe

    def resolve(self, num_params: int) -> Any:
        """The strategy for a model with ``num_params`` coordinates (built once, then fixed)."""
        if self._build is None:
            return self._strategy
        if self._strategy is None:
            self._strategy = self._build(num_params)
            self._num_params = num_params
        elif num_params != self._num_params:
            raise InvalidHyperparameterError(
                f"this transformation resolved its strategy for d = {self._num_params} parameter "
                f"coordinates (initial_max_grad_norm sets std_min/std_max from d), got d = "
                f"{num_params}: build one transformation per model"
            )
        return self._strategy

    @property
    def resolved(self) -> Any:
        if self._strategy is None:
            raise InvalidHyperparameterError(
                "this transformation's strategy depends on the number of parameters "
                "(initial_max_grad_norm): call tx.init(params) first"
            )
        return self._strategy


def _num_params(shapes: Sequence[tuple[int, ...]]) -> int:
    """``d``, the number of coordinates (at least 1, as the PyTorch plugin counts it)."""
    return max(1, sum(math.prod(s) for s in shapes))


class PrivateTransformation(optax.GradientTransformationExtraArgs):
    """An ``optax.GradientTransformationExtraArgs`` that also carries its core strategy.

    ``tx.strategy`` is the :class:`adaclip.strategies.Strategy` it clips with
    (:func:`adaclip_jax.clipped_sum_grads` clips with it). With
    ``adaclip(initial_max_grad_norm=C0)`` the strategy depends on the number of parameters
    ``d`` and exists once ``tx.init(params)`` (or a first ``update``) has run; reading
    ``tx.strategy`` before raises :class:`~adaclip.errors.InvalidHyperparameterError`.
    ``tx.strategy_for(d)`` gives it for ``d`` coordinates in every case.

    It must be the first transformation of its chain (:func:`adaclip_jax.private_chain`): its
    ``init`` and ``update`` raise :class:`~adaclip.errors.InvalidHyperparameterError` when
    another member of an enclosing ``optax.chain``/``optax.named_chain`` runs before them.
    """

    def _slot(self) -> _StrategySlot:
        slot = self.__dict__.get("_adaclip_slot")
        if slot is None:  # e.g. a copy made through the tuple protocol, which drops attributes
            raise InvalidHyperparameterError(
                "this PrivateTransformation carries no strategy: build it with adaclip_jax "
                "(adaclip, flat_clip, private_aggregate, ...)"
            )
        return slot

    @property
    def strategy(self) -> Any:
        return self._slot().resolved

    def strategy_for(self, num_params: int) -> Any:
        """The strategy for a model with ``num_params`` coordinates."""
        return self._slot().resolve(num_params)

    @property
    def expected_batch_size(self) -> float:
        """``B̄``, the expected number of units per step that the release divides by."""
        self._slot()  # the same error as for a copy without the transformation's attributes
        return self.__dict__["_adaclip_expected_batch_size"]

    @property
    def noise_mechanism(self) -> str:
        """``"independent"`` or ``"banded"`` (correlated noise, :mod:`adaclip.correlated`)."""
        self._slot()
        return "independent" if self.__dict__.get("_adaclip_noise_mechanism") is None else "banded"

    def with_public_statistics(self, state: Any, public_per_example_grads: Any, *, weight: float = 1.0) -> Any:
        """:func:`adaclip_jax.with_public_statistics` with this transformation."""
        return with_public_statistics(self, state, public_per_example_grads, weight=weight)


# --------------------------------------------------------------------------- helpers


def _canonical_key(key: Any, secure_mode: bool = False) -> jax.Array:
    if key is None:
        if secure_mode:
            return _os_key()
        raise InvalidHyperparameterError(
            "key is required: pass a PRNG key such as jax.random.key(seed) for the noise "
            "(or secure_mode=True, which draws it from the OS)"
        )
    if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
        return jax.random.key(int(key))
    if isinstance(key, jax.Array) and (
        jnp.issubdtype(key.dtype, jax.dtypes.prng_key) or (key.dtype == jnp.uint32 and key.shape == (2,))
    ):
        return key
    raise InvalidHyperparameterError(
        f"key must be a PRNG key (jax.random.key(seed)) or an int seed, got {key!r}"
    )


#: 32-bit words of OS randomness folded into the noise key of every step in secure mode.
_ENTROPY_WORDS = 4


def _os_words(shape: tuple[int, ...]) -> np.ndarray:
    """uint32 words from the operating system's CSPRNG (:mod:`secrets`)."""
    count = math.prod(shape)
    return np.frombuffer(secrets.token_bytes(4 * count), dtype=np.uint32).reshape(shape).copy()


def _os_entropy() -> np.ndarray:
    """The host side of :func:`_fold_os_entropy`: ``_ENTROPY_WORDS`` fresh words per call."""
    return _os_words((_ENTROPY_WORDS,))


def _os_key() -> jax.Array:
    """A PRNG key (default implementation) whose data comes from the OS, not from a seed."""
    template = jax.random.key(0)
    data = jax.random.key_data(template)
    return jax.random.wrap_key_data(
        jnp.asarray(_os_words(tuple(data.shape))), impl=jax.random.key_impl(template)
    )


def _fold_os_entropy(key: jax.Array) -> jax.Array:
    """``key`` with ``32·_ENTROPY_WORDS`` fresh bits from the OS folded in (secure mode).

    The bits are fetched at *run* time by ``jax.experimental.io_callback``, a host callback
    with side effects: under ``jax.jit`` (and inside ``lax.scan``) it is neither constant-folded
    nor cached nor hoisted, so every execution of the update fetches new bits. The bits are
    never stored, so neither the key in the state nor a restored checkpoint predicts the noise.
    """
    words = io_callback(_os_entropy, jax.ShapeDtypeStruct((_ENTROPY_WORDS,), jnp.uint32), ordered=False)
    for i in range(_ENTROPY_WORDS):
        key = jax.random.fold_in(key, words[i])
    return key


def _stat_dtype(dtype: Any) -> Any:
    """Statistics and the clipping maths run in at least float32 (float64 stays float64)."""
    return jnp.promote_types(dtype, jnp.float32)


def _validate_noise_multiplier(noise_multiplier: Any) -> NoiseMultiplier:
    if callable(noise_multiplier):
        return noise_multiplier
    try:
        x = float(noise_multiplier)
    except (TypeError, ValueError):
        raise InvalidHyperparameterError(
            f"noise_multiplier must be a number or a schedule (step -> σ), got {noise_multiplier!r}"
        ) from None
    if not math.isfinite(x) or x < 0:
        raise InvalidHyperparameterError(
            f"noise_multiplier must be finite and >= 0, got {noise_multiplier!r}"
        )
    return x


def _resolve_sigma(noise_multiplier: Any, sigma_default: NoiseMultiplier, step: jax.Array) -> Any:
    """σ of this update: the ``update`` keyword, else the schedule's ``σ_t``, else the constant.

    A Python number or a concrete (non-traced) array is validated here and raises
    :class:`InvalidHyperparameterError` before anything changes; a traced value cannot raise
    (see :func:`_invalid_sigma_guard`).
    """
    if noise_multiplier is None:
        return sigma_default(step) if callable(sigma_default) else sigma_default
    sigma = noise_multiplier
    if isinstance(sigma, (int, float, np.number)) and not isinstance(sigma, bool):
        return _validate_noise_multiplier(float(sigma))
    if not isinstance(sigma, jax.core.Tracer):
        _validate_noise_multiplier(np.asarray(sigma).item())  # concrete array: check it
    return sigma


def _invalid_sigma_guard(noisy: list[Any], sigma: Any) -> list[Any]:
    """The release, replaced by NaN where σ is not a finite number ``>= 0``.

    A traced σ (under ``jit``, or from a schedule) cannot raise, and a negative one would
    release noise of ``|σ|`` while an accountant might be told ``σ``. The step therefore
    releases NaN (a visibly failed step, nothing about the data), the statistics are kept
    (it is a non-finite release) and the key advances. A static σ was validated already.
    A traced σ that is valid but that the strategy's split cannot serve (the quantile rule's
    ``σ ≥ 2σ_b``) needs no guard here: the core's ``σ_g`` is then NaN, so is the release.
    """
    if isinstance(sigma, float):
        return noisy
    s = jnp.asarray(sigma)
    valid = jnp.isfinite(s) & (s >= 0)
    return [jnp.where(valid, x, jnp.full_like(x, jnp.nan)) for x in noisy]


def _sigma_used(sigma: Any) -> jax.Array:
    """σ of this update as the float32 scalar stored in ``last_noise_multiplier``."""
    return jnp.asarray(sigma, jnp.float32).reshape(())


def _check_noise_split(strategy: Any, sigma: Any, batch_size: float) -> None:
    """Raise :class:`InvalidHyperparameterError` now if the strategy cannot release at a
    *static* (Python or concrete) σ: ``strategy.noise_multipliers(σ, B̄)`` checks it (the
    quantile rule needs ``σ < 2σ_b`` to raise the gradient's multiplier to
    ``σ_g = (σ⁻² − (2σ_b)⁻²)^{-1/2}``). Called before anything changes. A traced σ is not
    checked: the core then returns ``σ_g = NaN`` and the release is NaN (state kept)."""
    if isinstance(sigma, jax.core.Tracer):
        return
    value = float(sigma) if isinstance(sigma, (int, float)) else float(np.asarray(sigma).reshape(()))
    if math.isfinite(value) and value >= 0:  # invalid values: _resolve_sigma / the guard
        strategy.noise_multipliers(value, batch_size)


def _validate_unit_mask(unit_mask: Any, n: int) -> jax.Array:
    """``unit_mask`` as a boolean ``(n,)`` array; anything else raises at trace time."""
    unit_mask = jnp.asarray(unit_mask)
    if unit_mask.dtype != jnp.bool_:
        raise InvalidGradientError(
            f"unit_mask must be a boolean array (True: the unit is present), got dtype "
            f"{unit_mask.dtype}; a numeric mask is ambiguous (0.5 would count as present), "
            "convert it explicitly, e.g. mask > 0"
        )
    if unit_mask.shape != (n,):
        raise InvalidGradientError(f"unit_mask has shape {unit_mask.shape}, expected ({n},)")
    return unit_mask


def _validate_secure_mode(secure_mode: Any, axis_name: Any) -> bool:
    if secure_mode is not True and secure_mode is not False:
        raise InvalidHyperparameterError(f"secure_mode must be True or False, got {secure_mode!r}")
    if secure_mode and axis_name is not None:
        raise InvalidHyperparameterError(
            "secure_mode=True cannot be combined with axis_name: every device would fold "
            "different OS bits into its key and draw different noise, so the noise would no "
            "longer be added exactly once to the global sum; use secure_mode=False with a "
            "secret seed from secrets.randbits, or a single device"
        )
    return secure_mode


def _validate_batch_size(expected_batch_size: Any) -> float:
    try:
        x = float(expected_batch_size)
    except (TypeError, ValueError):
        raise InvalidHyperparameterError(
            f"expected_batch_size must be a number, got {expected_batch_size!r}"
        ) from None
    if not math.isfinite(x) or x <= 0:
        raise InvalidHyperparameterError(
            f"expected_batch_size must be finite and > 0, got {expected_batch_size!r}"
        )
    return x


def _static_checks(leaves: Sequence[Any], param_shapes: Sequence[tuple[int, ...]] | None) -> None:
    """Shape checks that need no values, so they raise at trace time even under ``jax.jit``."""
    if not leaves:
        raise InvalidGradientError("per-unit gradients are an empty pytree (no parameters)")
    if param_shapes is None:
        n = None
        for k, g in enumerate(leaves):
            if getattr(g, "ndim", 0) < 1:
                raise InvalidGradientError(
                    f"per-unit gradient leaf {k} is a scalar: a leading batch axis is required"
                )
            if n is None:
                n = g.shape[0]
            elif g.shape[0] != n:
                raise InvalidGradientError(
                    f"leaf {k} has {g.shape[0]} per-unit gradients, leaf 0 has {n}: "
                    "every leaf needs the same leading batch size"
                )
        return
    _core_transform.check_per_example_grads(leaves, param_shapes, allow_empty=True, check_finite=False)


def _flatten_against_params(updates: Any, params: Any) -> tuple[list[Any], Any, list[tuple[int, ...]] | None]:
    leaves, treedef = jax.tree_util.tree_flatten(updates)
    if params is None:
        return leaves, treedef, None
    p_leaves, p_treedef = jax.tree_util.tree_flatten(params)
    if p_treedef != treedef:
        raise InvalidGradientError(
            f"per-unit gradients have tree structure {treedef}, the parameters have {p_treedef}"
        )
    return leaves, treedef, [tuple(p.shape) for p in p_leaves]


def check_inputs(per_example_grads: Any, params: Any, *, allow_empty: bool = False) -> int:
    """Eager validation of per-unit gradients against the parameters; returns the batch size.

    Raises :class:`~adaclip.errors.InvalidGradientError` for a different tree structure, a
    missing leading batch axis, mismatched leading sizes or shapes, an empty batch (unless
    ``allow_empty``) and NaN/inf values. Call it outside ``jax.jit`` (it reads the values);
    inside ``jit`` the transformation does the shape checks at trace time only.

    This is the opt-in debugging mode for non-finite gradients: the transformation itself
    never raises on them (it drops such a unit from the sum, see :func:`private_aggregate`),
    because raising, like a NaN release, would reveal that a sampled unit had a bad gradient.
    Use it to find the cause while developing, on data whose privacy this does not concern.
    """
    leaves, _, shapes = _flatten_against_params(per_example_grads, params)
    return _core_transform.check_per_example_grads(leaves, shapes, allow_empty=allow_empty, check_finite=True)


def _kernel_eligible(strategy: Any) -> bool:
    """Whether the fused kernels implement ``strategy``: the patent's AdaCliP only (every
    option at its default, :attr:`adaclip.AdaptiveClipping.is_patent`, and so no auxiliary
    release); the other options and strategies take the core's ``jnp`` path."""
    return (
        isinstance(strategy, _strategies.AdaptiveClipping)
        and strategy.is_patent
        and getattr(strategy, "num_auxiliary", 0) == 0
    )


def _validate_use_kernel(use_kernel: Any, strategy: Any, axis_name: Any) -> bool | str:
    if use_kernel is not True and use_kernel is not False and use_kernel != "auto":
        raise InvalidHyperparameterError(f'use_kernel must be True, False or "auto", got {use_kernel!r}')
    if use_kernel is True:
        if not _kernel_eligible(strategy):
            raise InvalidHyperparameterError(
                "use_kernel=True is implemented for the patent's AdaptiveClipping only (the fused "
                "AdaCliP path: every option at its default, AdaptiveClipping.is_patent); other "
                "strategies and options take the jnp path (use_kernel=False or \"auto\")"
            )
        if axis_name is not None:
            raise InvalidHyperparameterError(
                "use_kernel=True fuses the sum with the noise, which axis_name (psum of the "
                "per-device sums before the noise) does not allow; use use_kernel=False"
            )
        if jax.default_backend() == "gpu":
            raise InvalidHyperparameterError(
                "use_kernel=True is refused on GPU: the fused Pallas release kernel gave wrong "
                "moments (NaN) and updates for some shapes when compiled for an H200 (e.g. 1 or 3 "
                "rows of 5,000 columns, 64 rows of 784,000), although it agrees with the jnp path in "
                "interpret mode; use use_kernel=False (\"auto\" takes the jnp path)"
            )
    return use_kernel


def _kernel_active(use_kernel: bool | str, strategy: Any, axis_name: Any) -> tuple[bool, bool]:
    """``(use the fused kernels, run them in interpret mode)`` for this trace."""
    # "auto" takes the jnp path everywhere: compiled for a GPU, the release kernel failed its
    # check (see _validate_use_kernel, which refuses True there); off GPU the kernels only run
    # in interpret mode, a correctness tool.
    on_gpu = jax.default_backend() == "gpu"
    use = use_kernel is True and _kernel_eligible(strategy)
    return use, not on_gpu


# --------------------------------------------------------------------------- banded noise

#: Bounds on the length of the per-step noise-variance table of banded noise (see
#: :func:`_variance_table`): 1 024 entries at least, 65 536 at most (256 KB in float32).
_VARIANCE_TABLE_MIN = 1 << 10
_VARIANCE_TABLE_MAX = 1 << 16
#: The table is long enough when ``v_t`` four times further on exceeds its last entry by at most
#: this (relative to ``max(1, v)``).
_VARIANCE_TABLE_TOL = 1e-7


def _noise_mechanism(noise_mechanism: Any, bands: Any) -> BandedNoise | None:
    """``None`` for independent noise, else the :class:`adaclip.correlated.BandedNoise` asked
    for (:func:`adaclip.correlated.resolve_noise_mechanism`). One band is DP-SGD: ``None`` too,
    so the transformation is today's, draw for draw and state for state."""
    mechanism = resolve_noise_mechanism(noise_mechanism, bands)
    return None if mechanism is None or mechanism.bands == 1 else mechanism


def _check_banded(mechanism: BandedNoise | None, sigma_default: Any, axis_name: Any, use_kernel: Any) -> None:
    """What banded noise does not support (yet), refused before anything is built.

    Data parallelism (``axis_name``) is supported: the key and the buffers are replicated
    state, so every device draws the same ``z_t`` and computes the same ``x_t`` from the same
    buffers, and the noise (like the independent noise) is added once to the ``psum``-ed sum."""
    if mechanism is None:
        return
    why = (
        "a noise schedule (a callable noise_multiplier: the factorisation needs one σ for every step)"
        if callable(sigma_default) else
        "use_kernel=True (the fused kernels add independent noise)" if use_kernel is True else None
    )  # fmt: skip
    if why is not None:
        raise InvalidHyperparameterError(f"noise_mechanism='banded' does not support {why} yet")


def _variance_table(mechanism: BandedNoise) -> np.ndarray:
    """``v_0 … v_{L−1}`` (float64) of :meth:`adaclip.correlated.BandedNoise.variance`; the
    update uses ``v_{min(t, L−1)}``.

    ``v_t = Σ_{k≤t} r_k²`` is non-decreasing and converges when ``c(z)`` has no zero in the
    closed unit disc (the square-root coefficients; ``r`` then decays geometrically). ``L`` is
    the smallest power of two ``≥ max(1024, 16·b)`` with ``v_{4L−1} − v_{L−1} ≤ 1e-7·max(1, v)``,
    at most 65 536: for the square-root coefficients ``L = 1024`` up to ``b = 64`` (``v`` is
    within 1e-7 of its limit after 3 to 5·b steps, and equal to it in float64 well before step
    1024), so holding ``v_{L−1}`` beyond the table is exact to far below float32 resolution.
    Coefficients whose ``v`` does not settle by 65 536 steps warn (the statistics then subtract
    slightly too little noise variance late in the run; the noise itself, and so privacy, is
    unaffected); a ``v`` that overflows (``c(z)`` with a zero inside the unit disc: the noise
    grows without bound) is refused."""
    length = _VARIANCE_TABLE_MIN
    while length < 16 * mechanism.bands:
        length *= 2
    length = min(length, _VARIANCE_TABLE_MAX)
    while True:
        r = mechanism.inverse_coefficients(4 * length)
        with np.errstate(over="ignore", invalid="ignore"):
            v = np.cumsum(r * r)
        if not np.all(np.isfinite(v)):
            raise InvalidHyperparameterError(
                "the noise variance of these coefficients grows without bound (c(z) has a zero inside "
                "the unit disc): the noise would explode; use other coefficients"
            )
        settled = v[-1] - v[length - 1] <= _VARIANCE_TABLE_TOL * max(1.0, float(v[length - 1]))
        if settled or length >= _VARIANCE_TABLE_MAX:
            break
        length *= 2
    if not settled:
        warnings.warn(
            f"the per-step noise variance of these coefficients is still moving after {length} steps "
            f"({v[length - 1]:.6g} there, {v[-1]:.6g} at step {v.size - 1}); the statistics use "
            f"v_{length - 1} from then on (the noise itself is exact)",
            stacklevel=4,
        )
    return v[:length].copy()


def _same_sigma(sigma: Any, sigma_default: float) -> Any:
    """Whether a per-call σ is the constructor's σ up to float32 rounding (the tracker passes it
    rounded up): banded noise needs one σ for the whole run. A bool for a static σ, a traced
    bool otherwise."""
    if isinstance(sigma, (int, float)) or not isinstance(sigma, jax.core.Tracer):
        value = float(sigma) if isinstance(sigma, (int, float)) else float(np.asarray(sigma).reshape(()))
        return abs(value - sigma_default) <= 2.0**-20 * sigma_default
    s = jnp.asarray(sigma).reshape(())
    return jnp.abs(s - sigma_default) <= 2.0**-20 * sigma_default


def _check_buffers(buffers: Any, mechanism: BandedNoise | None, shapes: Sequence[tuple[int, ...]]) -> None:
    """The state's ``noise_buffers`` fit the transformation (trace-time: shapes only)."""
    if mechanism is None:
        if buffers is not None:
            raise InvalidGradientError(
                "the state carries banded-noise buffers but this transformation adds independent "
                "noise: was the state initialised by this transformation?"
            )
        return
    if buffers is None:
        raise InvalidGradientError(
            f"this transformation adds banded noise ({mechanism.bands} bands) but the state has no "
            "noise buffers: initialise the state with its init (a state of another transformation, "
            "or one saved before the buffers existed, cannot continue the stream)"
        )
    if (
        not isinstance(buffers, (tuple, list))
        or len(buffers) != mechanism.bands - 1
        or any(
            not isinstance(buf, (tuple, list)) or [tuple(jnp.shape(x)) for x in buf] != list(shapes)
            for buf in buffers
        )
    ):
        raise InvalidGradientError(
            f"the state's noise buffers do not match: expected {mechanism.bands - 1} buffers, each "
            f"with arrays of shapes {list(shapes)}: was the state initialised with these parameters?"
        )


def _fused_clip_factors(
    strategy: Any,
    flat: list[Any],
    centre: list[Any],
    inv: list[Any],
    unit_mask: Any,
    interpret: bool,
) -> Any:
    """The ``(n,)`` clip factors of the fused path, from upper bounds of the squared norms.

    Each leaf's kernel sum ``Ŝ_k`` is enlarged to ``Ŝ_k·(1 + η_k)`` with
    :func:`adaclip_jax._kernel.sq_norms_margin` (the kernel's own blocking), and the leaves
    are combined by :func:`adaclip.strategies.group_clip_factors` (which enlarges their sum by
    ``2K·u`` and gives factor 0 to a non-finite total), as on the ``jnp`` path: rounding can
    only over-clip, never under-clip, and a unit with a NaN/inf entry gets factor 0. Masked-out
    units get factor 0 too; the release kernel skips every row with factor 0.
    """
    sq = [
        _kernel.sq_norms(g, a.reshape(-1), u.reshape(-1), interpret=interpret)
        * (1.0 + _kernel.sq_norms_margin(g.dtype, g.shape[1]))
        for g, a, u in zip(flat, centre, inv, strict=True)
    ]
    factors = _strategies.group_clip_factors(strategy, sq)[0]  # one group: every leaf
    if unit_mask is not None:
        factors = jnp.where(unit_mask, factors, jnp.zeros_like(factors))
    return factors


def _fused_adaclip_step(
    strategy: Any,
    core_state: Any,
    grads: list[Any],
    unit_mask: Any,
    noise: list[Any] | None,
    sigma: Any,
    batch_size: float,
    interpret: bool,
) -> tuple[list[Any], Any]:
    """AdaCliP's step with the Pallas kernels of :mod:`adaclip_jax._kernel`.

    Same maths and same noise draws as ``clip_and_sum`` + ``release`` of the core: centre and
    scale from the state only (``strategy.transform``), clip factors from upper bounds of the
    per-unit squared norms (:func:`_fused_clip_factors`), units with factor 0 (masked out, or
    with a NaN/inf entry) contributing exactly 0, noise added once per coordinate to the
    clipped sum, divided by the expected batch size.
    """
    n = grads[0].shape[0]
    centre, scale = strategy.transform(core_state, len(grads))
    inv = [1.0 / b for b in scale]
    flat = [g.reshape(n, -1) for g in grads]
    factors = _fused_clip_factors(strategy, flat, centre, inv, unit_mask, interpret)
    noisy, new_mean, new_std = [], [], []
    for k, g in enumerate(flat):
        out = _kernel.clip_noise_update(
            g,
            factors,
            centre[k].reshape(-1),
            scale[k].reshape(-1),
            inv[k].reshape(-1),
            None if noise is None else noise[k].reshape(-1),
            core_state.std[k].reshape(-1),
            noise_multiplier=sigma,
            expected_batch_size=batch_size,
            beta_mean=strategy.beta_mean,
            beta_std=strategy.beta_std,
            std_min=strategy.std_min,
            std_max=strategy.std_max,
            interpret=interpret,
        )
        shape = centre[k].shape
        noisy.append(out[0].reshape(shape))
        new_mean.append(out[1].reshape(shape))
        new_std.append(out[2].reshape(shape))
    new_core = _strategies.ClipState(step=core_state.step + 1, mean=new_mean, std=new_std, extra=core_state.extra)
    return noisy, new_core


def _find_states(tree: Any) -> list[AdaClipState]:
    """Every :class:`AdaClipState` inside ``tree`` (e.g. an ``optax.chain`` state), in
    ``jax.tree_util`` order."""
    is_state = lambda x: isinstance(x, AdaClipState)  # noqa: E731
    return [x for x in jax.tree_util.tree_leaves(tree, is_leaf=is_state) if is_state(x)]


def _key_like(new: jax.Array, old: Any) -> jax.Array:
    """``new`` in the representation of ``old`` (typed key or legacy ``uint32`` data), so a
    jitted step that takes the state does not see a new type."""
    new_typed = jnp.issubdtype(new.dtype, jax.dtypes.prng_key)
    old_typed = jnp.issubdtype(old.dtype, jax.dtypes.prng_key)
    if new_typed and not old_typed:
        data = jax.random.key_data(new)
        return data if data.shape == old.shape else new
    if old_typed and not new_typed:
        impl = jax.random.key_impl(old)
        if tuple(new.shape) == tuple(jax.random.key_data(old).shape):
            return jax.random.wrap_key_data(new, impl=impl)
    return new


def _os_key_like(old: Any) -> jax.Array:
    """A key of ``old``'s kind (implementation and representation) with data from the OS."""
    if jnp.issubdtype(old.dtype, jax.dtypes.prng_key):
        shape = tuple(jax.random.key_data(old).shape)
        return jax.random.wrap_key_data(jnp.asarray(_os_words(shape)), impl=jax.random.key_impl(old))
    return jnp.asarray(_os_words(tuple(old.shape)), jnp.uint32)


def refresh_key(state: Any, key: Any = None) -> Any:
    """``state`` with a new noise key in every :class:`AdaClipState` it contains.

    ``state`` is an :class:`AdaClipState` or any pytree holding one (an ``optax.chain``
    state, a checkpoint dict); everything else is returned unchanged. With ``key=None`` the new
    key's data comes from the operating system (:mod:`secrets`); otherwise ``key`` (a PRNG key
    or an int seed) is used, folded with the state's index when there are several.

    Use it after restoring a checkpoint in seeded mode (``secure_mode=False``): the restored
    key would otherwise draw, bit for bit, the noise of the steps that followed the checkpoint
    the first time, and if anything those steps released was kept or seen, a release on other
    data cancels the noise in the difference (it reveals the units that differ). Keep the
    restored key only to reproduce the *same* run exactly. In secure mode a restore never
    replays noise, so this is not needed.

    Raises :class:`InvalidHyperparameterError` when ``state`` contains no ``AdaClipState``.
    """
    found = _find_states(state)
    if not found:
        raise InvalidHyperparameterError(
            "refresh_key: the state contains no AdaClipState (pass the opt_state of a chain "
            "that contains an adaclip_jax transformation)"
        )
    if key is None:
        keys = [_os_key_like(s.key) for s in found]
    else:
        base = _canonical_key(key)
        keys = [base] if len(found) == 1 else [jax.random.fold_in(base, i) for i in range(len(found))]
        keys = [_key_like(k, s.key) for k, s in zip(keys, found, strict=True)]
    fresh = iter(keys)
    is_state = lambda x: isinstance(x, AdaClipState)  # noqa: E731
    return jax.tree_util.tree_map(
        lambda x: x._replace(key=next(fresh)) if is_state(x) else x, state, is_leaf=is_state
    )


# --------------------------------------------------------------------------- the transformation


def private_aggregate(
    strategy: Any,
    *,
    noise_multiplier: NoiseMultiplier,
    expected_batch_size: float,
    key: Any = None,
    axis_name: Any = None,
    use_kernel: bool | str = False,
    secure_mode: bool = False,
    noise_mechanism: Any = "independent",
    bands: int | None = None,
) -> PrivateTransformation:
    """Privatise per-unit gradients with any strategy of the affine family.

    The input ``updates`` of ``update`` are per-unit gradients: the parameters' pytree with a
    leading batch axis on every leaf (e.g. from :func:`adaclip_jax.per_example_grads`). The
    output is the privatised gradient ``g̃`` (parameters' shapes, cast to the parameters'
    dtype, or to the input dtype when ``params`` is not passed), to be consumed by the rest of
    the chain.

    **It must come first** (:func:`adaclip_jax.private_chain` builds ``optax.chain(tx, *rest)``).
    A transformation before it would read the raw ``g_i``, which this mechanism has not yet
    privatised: its state (e.g. Adam's moments of the per-unit stack) and its output (e.g. a
    global-norm clip, which scales each unit by the norm of all of them, so one unit moves every
    other unit's input) depend on individual examples, outside the sensitivity bound and the
    accounting. Shape-preserving transformations cannot be told apart by their output, so
    ``init`` and ``update`` check the *call* instead: inside ``optax.chain`` /
    ``optax.named_chain`` (nested ones too, also under ``jit``) they raise
    :class:`~adaclip.errors.InvalidHyperparameterError` when another member of the chain runs
    before them (:mod:`adaclip_jax._position`), before anything is read or changed. Wrappers
    (``optax.MultiSteps``, ``optax.masked``, ...) are not seen by that check;
    :func:`adaclip_jax.check_chain` refuses them from the state structure.

    Args:
      strategy: a core strategy (:class:`adaclip.AdaptiveClipping` with any of its options,
        :class:`adaclip.FlatClipping`, :class:`adaclip.PerLayerClipping`,
        :class:`adaclip.ScaledClipping`, :class:`adaclip.QuantileClipping`,
        :class:`adaclip.AutomaticClipping`). Per-tensor settings (``group_max_grad_norms``,
        ``layer_scales``) and the per-tensor lists of the state's ``extra`` follow
        ``jax.tree_util`` leaf order. A strategy with auxiliary sums (the quantile rule) also
        needs ``σ < 2σ_b``: a static σ that fails it raises
        :class:`InvalidHyperparameterError` here or in ``update``; a traced one releases NaN.
      noise_multiplier: ``σ >= 0``, or a schedule ``step -> σ_t`` written with ``jnp`` (traced
        under ``jit``; ``step`` is the state's int32 counter; the accountant must be told the
        same ``σ_t``). It can be overridden per call with the ``noise_multiplier=`` keyword of
        ``update`` (an extra argument that ``optax.chain`` forwards), which is how
        :class:`adaclip_jax.PrivacyTracker` passes ``σ_t``. A Python number or a concrete
        array that is negative, NaN or infinite raises :class:`InvalidHyperparameterError`;
        a *traced* one cannot raise, and the step then releases NaN (see "Invalid σ").
      expected_batch_size: ``B̄ > 0``, the *expected* number of units per step (``q·N`` under
        Poisson sampling). The sum is always divided by ``B̄``, never by the realised size.
      key: a PRNG key (``jax.random.key(seed)``) or an int seed; required unless
        ``secure_mode``, where it defaults to a key drawn from the OS. ``jax.random`` is not a
        cryptographically secure generator; in seeded mode draw the seed from ``secrets`` and
        keep it (and the state's key) secret.
      axis_name: for data parallelism inside ``shard_map``/``pmap`` over the batch: each device
        clips and sums its shard, the sums are ``psum``-ed over ``axis_name``, and the noise is
        drawn from the (replicated) key, so every device adds the same ``z`` to the same global
        sum: noise is added exactly once. Not with ``secure_mode``.
      use_kernel: ``False`` (default here): the core's ``jnp`` path. ``True``: AdaCliP's fused
        Pallas kernels (:mod:`adaclip_jax._kernel`: per-unit transformed norms, then one pass
        for clipped sum + noise + rescale + moment update), in interpret mode off GPU (slow:
        for testing); refused on GPU, where the compiled release kernel gave wrong results
        for some shapes on an H200. ``"auto"``: the ``jnp`` path (it will pick the kernels on
        GPU once they pass there). Only for the patent's
        :class:`adaclip.AdaptiveClipping` (every option at its default, ``is_patent``) and
        without ``axis_name`` (``"auto"`` takes the ``jnp`` path otherwise); a :class:`ClippedSum`
        input and an empty batch always take the ``jnp`` path. Results agree with the ``jnp``
        path up to float rounding, with the same noise draws.
      secure_mode: ``False`` (seeded mode, default): the noise of step ``t`` is a function of
        the key in the state, so runs are reproducible. ``True``: every update folds
        ``128`` fresh bits from the OS (:mod:`secrets`, fetched at run time with
        ``jax.experimental.io_callback``, so it also works under ``jit`` and is never cached)
        into the key before splitting it; the noise is then unpredictable from the state and
        never replays, at the cost of a host callback per step and of reproducibility.
        Refused with ``axis_name`` (each device would draw different bits). In seeded mode,
        :class:`adaclip_jax.PrivacyTracker` warns :class:`~adaclip.errors.NoiseReplayWarning`
        when a step is given a state whose key it has already seen (a restored or reused state).
      noise_mechanism: ``"independent"`` (default: DP-SGD's fresh noise every step),
        ``"banded"`` (banded correlated noise with ``bands`` bands and the truncated
        square-root coefficients) or an :class:`adaclip.correlated.BandedNoise` (your
        coefficients, e.g. :func:`adaclip.correlated.coefficients.optimise_banded_coefficients`).
        See "Banded noise" below. One band is independent noise, draw for draw.
      bands: ``b`` for ``noise_mechanism="banded"``.

    ``update(updates, state, params=None, *, noise_multiplier=None, unit_mask=None)``:
    ``updates`` may also be a :class:`ClippedSum` from :func:`adaclip_jax.clipped_sum_grads`
    (clipped and summed chunk by chunk with this state, memory ``O(chunk·d)``, with the
    strategy's auxiliary sums in ``ClippedSum.auxiliary``); the update then only adds the
    noise, rescales and updates the state.

    Noise: with ``K`` parameter leaves and ``A = strategy.num_auxiliary`` auxiliary sums, the
    step splits its key as ``new_key, noise_key = split(key)`` and draws
    ``z_j = normal(split(noise_key, K + A)[j], shape_j)``: one draw per leaf (the leaf's shape)
    then one 0-d draw per auxiliary sum, in the stats dtype. The release is
    ``b ⊙ (Σ w̄ + σ_g z)/B̄ + a`` and each auxiliary sum gets ``σ_aux·z``, with
    ``(σ_g, σ_aux) = strategy.noise_multipliers(σ, B̄)`` (``(σ, 0)`` without auxiliary sums).
    ``unit_mask`` is an optional **boolean** ``(n,)`` array marking the units that are present
    (padding rows, absent users, Poisson-sampled-out rows are ``False``); a numeric mask raises
    :class:`~adaclip.errors.InvalidGradientError` (at trace time). Masked rows contribute
    exactly nothing, whatever their values (their clip factor is 0 and their rows are
    dropped from the sum). It lets a Poisson-sampled batch be padded to a static shape.

    Non-finite input: a unit whose per-unit gradient has a NaN or inf entry (or whose
    transformed norm overflows) gets the clip factor 0 and its rows are dropped from the sum:
    it contributes exactly 0, the same as if it were absent. The release stays finite and is
    the release of the batch without that unit, so the unit's presence is not revealed (a
    NaN release, or a counter of bad units, would reveal that *some* sampled unit had a bad
    gradient), and the unit stays within the sensitivity of 1. This is the behaviour under
    ``jit`` and eagerly. For debugging, :func:`check_inputs` (eager, opt-in) raises an
    :class:`~adaclip.errors.InvalidGradientError` on NaN/inf per-unit gradients before the
    step.

    Invalid σ: a traced ``noise_multiplier`` (or a schedule's ``σ_t``) that is negative, NaN or
    infinite, or that the strategy cannot split (quantile rule: ``σ ≥ 2σ_b``), cannot raise
    under ``jit``; the step releases NaN (the failure is visible and reveals nothing about the
    data), ``mean``/``std``/``extra`` are kept, ``nonfinite_steps`` counts it and the key
    advances. ``last_noise_multiplier`` records the σ given (for a negative, NaN or infinite
    one :class:`adaclip_jax.PrivacyTracker` then raises). ``nonfinite_steps`` counts every step whose
    release is not finite; it is a function of the released values only. To skip such
    steps in the inner optimizer, wrap the *rest* of the chain:
    ``optax.chain(adaclip(...), optax.apply_if_finite(optax.adam(...), max_consecutive_errors))``
    (wrapping the whole chain does not work: ``apply_if_finite`` returns zeros shaped like its
    per-unit input).

    Banded noise (:mod:`adaclip.correlated.mechanism`: maths and privacy argument): the
    gradient's draws ``z_t`` (the same draws as above) become
    ``x_t = (z_t − Σ_{j=1}^{b−1} c_j x_{t−j})/c_0``, with the last ``b − 1`` noise vectors kept
    in ``state.noise_buffers`` (zeros at ``init``, shifted every step: fixed shapes under
    ``jit``); the auxiliary sums keep their independent draws. Strategies that learn from the
    release (AdaCliP) subtract the noise's variance ``σ_g²·v_t``
    (:meth:`adaclip.correlated.BandedNoise.variance` at ``t = state.step``, from a table of
    ``v_t`` computed here, held at its last entry beyond it: :func:`_variance_table`). The
    accounting is ``⌈T/b⌉`` compositions at rate ``p = b·q``, which holds only with **cyclic
    Poisson sampling** with the same ``b`` (:func:`adaclip_jax.assign_groups` and
    :func:`adaclip_jax.cyclic_poisson_mask` at ``step = state.step``, passed as ``unit_mask=``)
    and :class:`adaclip_jax.PrivacyTracker` with ``bands=b``. One σ for the whole run: a
    callable ``noise_multiplier`` is refused, and so are a per-call ``noise_multiplier`` that is
    not the constructor's σ up to float32 rounding (a static one raises, a traced one releases
    NaN, as an invalid σ), ``axis_name`` and ``use_kernel=True`` (``"auto"`` takes the ``jnp``
    path). The buffers are secret in both modes (past noise: subtracting them from past releases
    gives past clipped sums); save and restore them with the rest of the state, never apart
    from ``step``. With a static ``σ = 0`` nothing is drawn and the buffers stay zero.

    Checkpoints: the state (:class:`AdaClipState`) is a pytree you save as usual. ``mean``,
    ``std``, ``extra``, ``step``, ``nonfinite_steps`` and ``last_noise_multiplier`` are
    functions of released values and hyperparameters. ``key`` is **secret in seeded mode**: it determines
    the noise of every later step, so whoever holds it can subtract the noise from later
    releases. On restore in seeded mode, the steps after the restore draw exactly the noise
    of the steps that followed the checkpoint the first time: if any release of those first
    steps was kept or seen, a release on different data cancels the noise in the difference
    and reveals the units that differ (a clipped gradient in the clear). Call
    :func:`adaclip_jax.refresh_key` on the restored state unless you are reproducing the
    same run bit for bit. In secure mode the saved key does not predict the noise and a
    restored state never replays it.
    """
    return _build(
        _StrategySlot(strategy),
        noise_multiplier=noise_multiplier,
        expected_batch_size=expected_batch_size,
        key=key,
        axis_name=axis_name,
        use_kernel=use_kernel,
        secure_mode=secure_mode,
        noise_mechanism=noise_mechanism,
        bands=bands,
    )


def _check_extra(extra: Any, num_leaves: int) -> None:
    """The state's ``extra`` has one entry per leaf in each of its per-tensor lists."""
    if extra is None:
        return
    if not isinstance(extra, dict):
        raise InvalidGradientError(f"the state's extra must be a dict or None, got {type(extra).__name__}")
    for name, value in extra.items():
        if isinstance(value, (list, tuple)) and len(value) != num_leaves:
            raise InvalidGradientError(
                f"the state's extra[{name!r}] has {len(value)} entries for {num_leaves} parameter "
                "leaves: was the state initialised with these parameters?"
            )


def _keep_if_finite(finite: Any, new: Any, old: Any) -> Any:
    """``where(finite, new, old)`` leaf by leaf (``None`` entries kept), in ``old``'s dtypes."""
    return jax.tree_util.tree_map(lambda n, o: jnp.where(finite, n, o).astype(o.dtype), new, old)


def _compile_eager_call(sigma_default: Any, noise_multiplier: Any, arguments: Any) -> bool:
    """Whether an ``update`` call runs compiled (``jax.jit``) rather than op by op.

    Called eagerly (no argument is a tracer), the update would dispatch a few hundred small
    operations one at a time — ~100 ms where the compiled update takes under a millisecond on
    a small MLP — so it runs the same function through ``jax.jit`` instead. Inside the user's
    own ``jit``/``scan``/``shard_map`` the arguments are tracers and nothing changes. The
    result is the same computation (XLA may fuse floating-point operations differently, as
    it does for any jitted step). Calls that pass ``noise_multiplier=`` or use a noise
    schedule stay eager, so that an invalid concrete σ still raises a clear error before
    anything changes (under ``jit`` it can only turn the release into NaN), and so does
    everything under ``jax.disable_jit()``.
    """
    if noise_multiplier is not None or callable(sigma_default):
        return False
    if jax.config.jax_disable_jit:
        return False
    return not any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree_util.tree_leaves(arguments))


def _build(
    slot: _StrategySlot,
    *,
    noise_multiplier: NoiseMultiplier,
    expected_batch_size: float,
    key: Any,
    axis_name: Any,
    use_kernel: bool | str,
    secure_mode: bool,
    noise_mechanism: Any = "independent",
    bands: int | None = None,
) -> PrivateTransformation:
    """:func:`private_aggregate` for a strategy that may be resolved at ``init`` (see
    :class:`_StrategySlot`)."""
    sigma_default = _validate_noise_multiplier(noise_multiplier)
    use_kernel = _validate_use_kernel(use_kernel, slot.probe, axis_name)
    secure_mode = _validate_secure_mode(secure_mode, axis_name)
    batch_size = _validate_batch_size(expected_batch_size)
    if not callable(sigma_default):
        _check_noise_split(slot.probe, sigma_default, batch_size)
    mechanism = _noise_mechanism(noise_mechanism, bands)
    _check_banded(mechanism, sigma_default, axis_name, use_kernel)
    variances = None if mechanism is None else _variance_table(mechanism)
    base_key = _canonical_key(key, secure_mode)

    def init_fn(params: Any) -> AdaClipState:
        _position.refuse_if_not_first("init")  # a transformation before this one: refused
        _position.refuse_if_wrapped("init")  # optax.MultiSteps around it: refused
        leaves, treedef = jax.tree_util.tree_flatten(params)
        strategy = slot.resolve(_num_params([tuple(jnp.shape(p)) for p in leaves]))
        if (
            isinstance(strategy, _strategies.AdaptiveClipping)
            and strategy.scale == "coupled"
            and not callable(sigma_default)
            and leaves
        ):
            # κ from hyperparameters and shapes only (a schedule's σ_0 may be traced: skipped).
            # Only the coupled scale lets the noise drive the clip level (see noise_drift_number).
            _strategies.warn_if_noise_dominated(
                sum(math.prod(jnp.shape(p)) for p in leaves), sigma_default, batch_size
            )
        templates = [jnp.zeros(jnp.shape(p), _stat_dtype(jnp.result_type(p))) for p in leaves]
        buffers = None if mechanism is None else tuple(list(templates) for _ in range(mechanism.bands - 1))
        core = strategy.init(templates)
        mean = None if core.mean is None else jax.tree_util.tree_unflatten(treedef, list(core.mean))
        std = None if core.std is None else jax.tree_util.tree_unflatten(treedef, list(core.std))
        return AdaClipState(
            step=jnp.zeros([], jnp.int32),
            key=base_key,
            mean=mean,
            std=std,
            nonfinite_steps=jnp.zeros([], jnp.int32),
            last_noise_multiplier=jnp.zeros([], jnp.float32),
            seeded=jnp.asarray(not secure_mode),
            extra=core.extra,
            noise_buffers=buffers,
        )

    def update_fn(updates, state, params=None, *, noise_multiplier=None, unit_mask=None, **extra_args):
        del extra_args  # arguments meant for other transformations of the chain
        _position.refuse_if_not_first("update")  # before anything is read or changed
        _position.refuse_if_wrapped("update")
        if _compile_eager_call(sigma_default, noise_multiplier, (updates, state, params, unit_mask)):
            return compiled_update(updates, state, params, unit_mask)
        return update_body(updates, state, params, noise_multiplier=noise_multiplier, unit_mask=unit_mask)

    def update_body(updates, state, params=None, *, noise_multiplier=None, unit_mask=None):
        pre_summed = isinstance(updates, ClippedSum)
        if pre_summed:
            if unit_mask is not None:
                raise InvalidGradientError(
                    "unit_mask applies to per-unit gradients; pass it to clipped_sum_grads instead"
                )
            leaves, treedef, shapes = _flatten_against_params(updates.summed, params)
            if shapes is not None and [tuple(g.shape) for g in leaves] != shapes:
                raise InvalidGradientError(
                    f"ClippedSum has shapes {[tuple(g.shape) for g in leaves]}, the parameters {shapes}"
                )
            unit_shapes = [tuple(g.shape) for g in leaves]
        else:
            leaves, treedef, shapes = _flatten_against_params(updates, params)
            _static_checks(leaves, shapes)
            unit_shapes = [tuple(g.shape[1:]) for g in leaves]
        strategy = slot.resolve(_num_params(unit_shapes))
        num_aux = getattr(strategy, "num_auxiliary", 0)
        if pre_summed:
            auxiliary = list(updates.auxiliary)
            if len(auxiliary) != num_aux or any(jnp.shape(x) != () for x in auxiliary):
                raise InvalidGradientError(
                    f"ClippedSum has {len(auxiliary)} auxiliary sums of shapes "
                    f"{[tuple(jnp.shape(x)) for x in auxiliary]}; the strategy releases {num_aux} "
                    "0-d auxiliary sums: build it with clipped_sum_grads of this transformation"
                )
        if params is not None:
            out_dtypes = [jnp.result_type(p) for p in jax.tree_util.tree_leaves(params)]
        else:
            out_dtypes = [g.dtype for g in leaves]

        mean = None if state.mean is None else jax.tree_util.tree_leaves(state.mean)
        std = None if state.std is None else jax.tree_util.tree_leaves(state.std)
        stats_tree = state.std if state.std is not None else state.mean
        stats = std if std is not None else mean
        if stats is not None and (
            jax.tree_util.tree_structure(stats_tree) != treedef
            or [tuple(m.shape) for m in stats] != unit_shapes
            or (mean is not None and [tuple(m.shape) for m in mean] != unit_shapes)
        ):
            raise InvalidGradientError(
                "the state's statistics do not match the per-unit gradients (tree structure or "
                "shapes): was the state initialised with these parameters?"
            )
        _check_extra(state.extra, len(leaves))
        if stats is not None:
            stat_dtypes = [m.dtype for m in stats]
        else:
            stat_dtypes = [_stat_dtype(d) for d in out_dtypes]
        grads = [g.astype(dt) for g, dt in zip(leaves, stat_dtypes, strict=True)]
        core_state = _strategies.ClipState(step=state.step, mean=mean, std=std, extra=state.extra)

        if unit_mask is not None:
            unit_mask = _validate_unit_mask(unit_mask, grads[0].shape[0])
        sigma = _resolve_sigma(noise_multiplier, sigma_default, state.step)
        _check_noise_split(strategy, sigma, batch_size)  # before anything changes
        _check_buffers(state.noise_buffers, mechanism, unit_shapes)
        if mechanism is not None and noise_multiplier is not None and _same_sigma(sigma, sigma_default) is False:
            raise InvalidHyperparameterError(
                f"banded noise needs one σ for the whole run: this call's noise_multiplier={float(sigma)!r} "
                f"is not the transformation's {sigma_default!r}"
            )

        fused, interpret = _kernel_active(use_kernel, strategy, axis_name)
        fused = fused and mechanism is None and not pre_summed and grads[0].shape[0] > 0
        if fused:
            summed_shapes = [tuple(m.shape) for m in mean]
        elif pre_summed:
            aux_dtype = jnp.result_type(*stat_dtypes)
            summed = grads + [jnp.asarray(x).astype(aux_dtype) for x in auxiliary]
        else:
            # K clipped sums, then the strategy's auxiliary sums (0-d); masked-out units get
            # the clip factor 0 and count in neither.
            summed = _strategies.clip_and_sum(strategy, core_state, grads, unit_mask=unit_mask)
        if not fused:
            if axis_name is not None:
                summed = jax.lax.psum(summed, axis_name)  # auxiliary sums too: one global count
            summed_shapes = [tuple(x.shape) for x in summed]
        noise_dtypes = stat_dtypes if fused else [x.dtype for x in summed]

        key = _fold_os_entropy(state.key) if secure_mode else state.key
        new_key, noise_key = jax.random.split(key)
        if isinstance(sigma, float) and sigma == 0.0:
            noise = None  # static σ = 0: nothing to draw
        else:
            # One draw per entry of the summed list: K leaf-shaped draws, then one 0-d draw
            # per auxiliary sum; the core scales them by σ_g and σ_aux.
            keys = jax.random.split(noise_key, len(summed_shapes))
            noise = [
                jax.random.normal(k, shp, dt)
                for k, shp, dt in zip(keys, summed_shapes, noise_dtypes, strict=True)
            ]
        new_buffers, release_extra = state.noise_buffers, {}
        if mechanism is not None and noise is not None:
            # banded: x_t from z_t and the b − 1 buffers (zeros before the stream's start make
            # the first steps exact); the auxiliary sums keep their independent draws
            num = len(leaves)
            history = tuple(
                tuple(x.astype(z.dtype) for x, z in zip(buf, noise[:num], strict=True)) for buf in state.noise_buffers
            )
            x, stream = mechanism.correlate(NoiseStreamState(history=history, step=0), noise[:num])
            noise = list(x) + noise[num:]
            new_buffers = tuple(
                [h.astype(o.dtype) for h, o in zip(hist, old, strict=True)]
                for hist, old in zip(stream.history, state.noise_buffers, strict=True)
            )
            table = jnp.asarray(variances, jnp.result_type(*noise_dtypes[:num]))
            release_extra["noise_variance"] = table[jnp.minimum(state.step, variances.size - 1)]
        if fused:
            noisy, new_core = _fused_adaclip_step(
                strategy, core_state, grads, unit_mask, noise, sigma, batch_size, interpret
            )
        else:
            noisy, new_core = _strategies.release(
                strategy,
                core_state,
                summed,
                noise,
                noise_multiplier=sigma,  # the accounted σ; the core derives σ_g and σ_aux
                expected_batch_size=batch_size,
                **release_extra,
            )
        noisy = _invalid_sigma_guard(noisy, sigma)
        if mechanism is not None and isinstance(sigma, jax.core.Tracer):
            # a traced σ other than the run's one: the banded argument does not cover it
            same = _same_sigma(sigma, sigma_default)
            noisy = [jnp.where(same, g, jnp.full_like(g, jnp.nan)) for g in noisy]

        # A non-finite release keeps every statistic (mean, std, extra) as it was.
        finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in noisy]))
        unflatten = lambda xs: jax.tree_util.tree_unflatten(treedef, xs)  # noqa: E731
        mean_tree = None if mean is None else unflatten(_keep_if_finite(finite, list(new_core.mean), mean))
        std_tree = None if std is None else unflatten(_keep_if_finite(finite, list(new_core.std), std))
        new_extra = None if state.extra is None else _keep_if_finite(finite, new_core.extra, state.extra)
        new_state = AdaClipState(
            step=state.step + 1,
            key=new_key,
            mean=mean_tree,
            std=std_tree,
            nonfinite_steps=state.nonfinite_steps + jnp.where(finite, 0, 1).astype(jnp.int32),
            last_noise_multiplier=_sigma_used(sigma),  # σ, never σ_g: what is accounted
            seeded=state.seeded,
            extra=new_extra,
            noise_buffers=new_buffers,
        )
        out = [g.astype(dt) for g, dt in zip(noisy, out_dtypes, strict=True)]
        return jax.tree_util.tree_unflatten(treedef, out), new_state

    # An eager call runs the update compiled (see _compile_eager_call); one compiled function
    # per transformation, retraced by jax.jit only when shapes, dtypes or structure change.
    compiled_update = jax.jit(
        lambda updates, state, params, unit_mask: update_body(updates, state, params, unit_mask=unit_mask)
    )

    tx = PrivateTransformation(init_fn, update_fn)
    tx.__dict__["_adaclip_slot"] = slot
    tx.__dict__["_adaclip_expected_batch_size"] = batch_size
    tx.__dict__["_adaclip_noise_mechanism"] = mechanism
    return tx


def adaclip(
    *,
    noise_multiplier: NoiseMultiplier,
    expected_batch_size: float,
    key: Any = None,
    preset: str = _strategies.DEFAULT_PRESET,
    std_min: float | None = None,
    std_max: float | None = None,
    beta_mean: float | None = None,
    beta_std: float | None = None,
    initial_max_grad_norm: float | None = None,
    std_spread: float = 30.0,
    scale: str | None = None,
    max_grad_norm: float | None = None,
    shape_power: float | None = None,
    statistic: str | None = None,
    correction: str | None = None,
    pooling: str | None = None,
    update_every: int | None = None,
    centre: str | None = None,
    process_noise: float | None = None,
    freeze_statistics: bool | None = None,
    quantile: _strategies.QuantileRule | None = None,
    initial_variance: float | None = None,
    axis_name: Any = None,
    use_kernel: bool | str = False,
    secure_mode: bool = False,
    noise_mechanism: Any = "independent",
    bands: int | None = None,
) -> PrivateTransformation:
    """AdaCliP: adaptive clipping of per-unit gradients, and its options.

    ``preset`` picks the starting point (:data:`adaclip.strategies.ADAPTIVE_PRESETS`); every
    keyword given (not ``None``) overrides it. The default, ``"centred"``, clips each unit's
    deviation from the running mean of the releases, scaled per tensor:

    .. math::
        w_i = (g_i − a_t)/b_t,\\quad \\tilde g_t = b_t ⊙ (Σ_i \\bar w_i + σ_t z)/B̄ + a_t,\\quad
        a_{t+1} = β_1 a_t + (1 − β_1)\\tilde g_t,\\quad b_t = C\\,s_t^{1/2}/\\mathrm{mean}(s_t^{1/2})

    (β1 = 0.99, ``C = max_grad_norm`` = 1; one ``s`` per tensor, learned from the releases with
    the noise variance removed after averaging, β2 = 0.999; the first step is flat clipping at
    ``C``). It is the AdaCliP-family configuration that did best without tuning in our
    benchmark, where its shape stayed within about 1 % of flat.
    ``preset="patent"`` is the patent's algorithm with its defaults:

    .. math::
        b_t = \\sqrt{s_t}\\sqrt{Σ_j s_t[j]},\\quad w_i = (g_i − m_t)/b_t,\\quad
        \\tilde g_t = b_t ⊙ (Σ_i \\bar w_i + σ_t z)/B̄ + m_t,

    then ``v = clamp((g̃−m)² − b²σ²/B̄², s_min², s_max²)``, ``s ← sqrt(β2 s² + (1−β2) v)``,
    ``m ← β1 m + (1−β1) g̃``. Each step is the sampled Gaussian mechanism with sensitivity 1
    and noise multiplier ``σ_t`` (same accounting as DP-SGD). The keyword options are those
    of :class:`adaclip.AdaptiveClipping` (maths in :mod:`adaclip.adaptive`); each changes one
    part (centre ``a``, statistics ``s``, scale ``b``, clip level ``C_t``) and reads only
    released values, so the accounting is unchanged. With ``quantile=`` a count of unclipped
    units is released too and the gradient's noise multiplier becomes
    ``σ_g = (σ⁻² − (2σ_b)⁻²)^{-1/2}`` (the accountant still records ``σ``). See
    :func:`private_aggregate` for the other arguments (``key``, ``axis_name``,
    ``secure_mode``, ``noise_mechanism``, ``bands``), the state, checkpoints (the key is secret
    in seeded mode) and the behaviour on bad input.

    Args:
      preset: ``"centred"`` (default) or ``"patent"``; keywords left ``None`` take its values.
      std_min: lower end of the range of the std estimates; ``s_0 = sqrt(std_min·std_max)``
        (patent: ``1e-5``; centred: ``C/(30√d)``).
      std_max: upper end of that range (patent: ``1.0``; centred: ``30·C/√d``).
      beta_mean: ``β1``, interpolation weight of the mean estimate.
      beta_std: ``β2``, interpolation weight of the variance estimate.
      initial_max_grad_norm: ``C0``, instead of ``std_min``/``std_max`` (refused together):
        start out clipping like flat clipping at ``C0``,
        :meth:`adaclip.AdaptiveClipping.from_initial_clip` with ``d`` = the number of
        parameter coordinates (``s_0 = C0/√d``, ``std_min = s_0/std_spread``,
        ``std_max = s_0·std_spread``). ``d`` is known at ``tx.init(params)``, which builds the
        strategy (``tx.strategy`` before that raises). As ``AdaClip(initial_max_grad_norm=)``
        of the PyTorch plugin.
      std_spread: how far ``s`` may move either way of ``s_0`` with ``initial_max_grad_norm``.
      scale: ``"coupled"`` (the patent, ``b = √s·√Σs``) or ``"separated"``
        (``b = C_t·s^p/mean(s^p)``: the statistics set only the shape).
      max_grad_norm: ``C`` of the separated scale (the initial ``C_0`` with ``quantile``).
      shape_power: ``p`` of the separated scale.
      statistic: ``"deviation"`` (of ``g̃ − a``) or ``"second_moment"`` (of ``g̃``).
      correction: ``"clamp"`` (the patent), ``"unbiased"`` or ``"none"``.
      pooling: ``"coordinate"`` (the patent), ``"tensor"`` or ``"factored"`` (row × column of
        each leaf with ≥ 2 axes, ``out × rest``).
      update_every: ``k``: statistics from the average of the last ``k`` releases.
      centre: ``"ema"`` (the patent), ``"debiased"``, ``"kalman"`` or ``"none"``.
      process_noise: ``ρ`` of the Kalman centre.
      freeze_statistics: keep ``s`` as initialised (e.g. by :func:`with_public_statistics`).
      quantile: a :class:`adaclip.QuantileRule` adapting ``C_t`` (separated scale only). A
        static σ with ``σ ≥ 2σ_b`` raises :class:`InvalidHyperparameterError` (here, or in
        ``update`` for a per-call σ); a traced one releases NaN and keeps the state.
      initial_variance: ``u_0``, the start of the variance averages (default ``s_0²``).
      use_kernel: ``False`` (default: the core ``jnp`` path), ``"auto"`` (the ``jnp`` path
        for now) or ``True`` (the fused Pallas kernels in interpret mode, off GPU only: a
        correctness tool; refused on GPU, where the compiled release kernel gave wrong results
        for some shapes, and unless every option is the patent's); see
        :func:`private_aggregate`.
    """
    options: dict[str, Any] = dict(
        scale=scale, shape_power=shape_power, statistic=statistic, correction=correction, pooling=pooling,
        update_every=update_every, centre=centre, process_noise=process_noise,
        freeze_statistics=freeze_statistics, quantile=quantile, initial_variance=initial_variance,
    )  # fmt: skip

    def build(num_params: int) -> _strategies.AdaptiveClipping:
        return _strategies.adaptive_clipping(
            num_params, preset=preset, std_min=std_min, std_max=std_max, beta_mean=beta_mean, beta_std=beta_std,
            initial_max_grad_norm=initial_max_grad_norm, std_spread=std_spread, max_grad_norm=max_grad_norm,
            **options,
        )  # fmt: skip

    probe = build(1)  # checks every hyperparameter now
    if initial_max_grad_norm is not None or (probe.scale == "separated" and std_min is None and std_max is None):
        slot = _StrategySlot(build=build, probe=probe)  # the std bounds follow d, known at init
    else:
        slot = _StrategySlot(probe)  # d does not enter
    return _build(
        slot,
        noise_multiplier=noise_multiplier,
        expected_batch_size=expected_batch_size,
        key=key,
        axis_name=axis_name,
        use_kernel=use_kernel,
        secure_mode=secure_mode,
        noise_mechanism=noise_mechanism,
        bands=bands,
    )


def scale_then_privatize(
    *,
    max_grad_norm: float,
    noise_multiplier: NoiseMultiplier,
    expected_batch_size: float,
    key: Any = None,
    beta: float = 0.999,
    spread: float = 1e4,
    axis_name: Any = None,
    secure_mode: bool = False,
    noise_mechanism: Any = "independent",
    bands: int | None = None,
    **options: Any,
) -> PrivateTransformation:
    """Scale-then-privatize (Ganesh, McMahan, Thakurta, 2025):
    :meth:`adaclip.AdaptiveClipping.scale_then_privatize`.

    Centre 0; ``v̂ ← β v̂ + (1−β) g̃²`` (the released gradient's second moment, noise
    included); scale ``b = C·p`` with ``p = √v̂ / mean(√v̂)`` (so ``C = max_grad_norm`` keeps
    flat clipping's meaning), ``v̂`` kept within ``spread²`` either way of 1:

    .. math::
        \\tilde g = C p ⊙ (Σ_i \\bar w_i + σ z)/B̄,\\quad w_i = g_i/(C p).

    ``options``: other keyword options of :class:`adaclip.AdaptiveClipping` (e.g.
    ``quantile=``, ``update_every=``). ``key``, ``axis_name``, ``secure_mode``,
    ``noise_mechanism`` and ``bands`` are those of :func:`private_aggregate`.
    """
    strategy = _strategies.AdaptiveClipping.scale_then_privatize(max_grad_norm, beta=beta, spread=spread, **options)
    return private_aggregate(
        strategy,
        noise_multiplier=noise_multiplier,
        expected_batch_size=expected_batch_size,
        key=key,
        axis_name=axis_name,
        secure_mode=secure_mode,
        noise_mechanism=noise_mechanism,
        bands=bands,
    )


def quantile_clip(
    *,
    noise_multiplier: NoiseMultiplier,
    expected_batch_size: float,
    key: Any = None,
    max_grad_norm: float = 1.0,
    quantile: _strategies.QuantileRule | None = None,
    axis_name: Any = None,
    secure_mode: bool = False,
    noise_mechanism: Any = "independent",
    bands: int | None = None,
) -> PrivateTransformation:
    """Flat clipping with the quantile-adapted clip norm (Andrew et al., 2021):
    :class:`adaclip.QuantileClipping`.

    .. math::
        \\tilde g = (Σ_i g_i \\min(1, C_t/‖g_i‖) + C_t σ_g z)/B̄,\\qquad
        C_{t+1} = C_t \\exp(−η(\\tilde f_t − γ)),

    with ``f̃_t = (Σ_i (1[‖g_i‖ ≤ C_t] − ½) + σ_b z')/B̄ + ½`` the released fraction of
    unclipped units and ``σ_g = (σ⁻² − (2σ_b)⁻²)^{-1/2}``: the gradient and the count are
    one Gaussian mechanism with multiplier ``σ`` (what the accountant records; the state's
    ``last_noise_multiplier`` is ``σ``). ``C_t`` is ``state.extra["clip_norm"]``.

    Args:
      max_grad_norm: ``C_0``, the initial clip norm.
      quantile: the :class:`adaclip.QuantileRule` (``γ``, ``η``, ``σ_b``; default
        ``QuantileRule()``: median, ``η = 0.2``, ``σ_b = B̄/20``). Needs ``σ < 2σ_b``: a static
        σ that fails it raises :class:`InvalidHyperparameterError`, a traced one releases NaN.

    ``key``, ``axis_name``, ``secure_mode``, ``noise_mechanism`` and ``bands`` are those of
    :func:`private_aggregate`.
    """
    strategy = _strategies.QuantileClipping(
        max_grad_norm, _strategies.QuantileRule() if quantile is None else quantile
    )
    return private_aggregate(
        strategy,
        noise_multiplier=noise_multiplier,
        expected_batch_size=expected_batch_size,
        key=key,
        axis_name=axis_name,
        secure_mode=secure_mode,
        noise_mechanism=noise_mechanism,
        bands=bands,
    )


def automatic_clip(
    *,
    noise_multiplier: NoiseMultiplier,
    expected_batch_size: float,
    key: Any = None,
    max_grad_norm: float = 1.0,
    stability: float = 0.01,
    axis_name: Any = None,
    secure_mode: bool = False,
    noise_mechanism: Any = "independent",
    bands: int | None = None,
) -> PrivateTransformation:
    """Automatic clipping (Bu et al., 2022): :class:`adaclip.AutomaticClipping`.

    .. math::
        \\tilde g = C (Σ_i w_i/(‖w_i‖ + γ) + σ z)/B̄,\\qquad w_i = g_i/C,

    every unit normalised (``‖w̄_i‖ < 1``, sensitivity 1), so no clip norm needs tuning:
    ``C = max_grad_norm`` only sets the release's scale, ``γ = stability > 0``. ``key``,
    ``axis_name``, ``secure_mode``, ``noise_mechanism`` and ``bands`` are those of
    :func:`private_aggregate`.
    """
    return private_aggregate(
        _strategies.AutomaticClipping(max_grad_norm, stability),
        noise_multiplier=noise_multiplier,
        expected_batch_size=expected_batch_size,
        key=key,
        axis_name=axis_name,
        secure_mode=secure_mode,
        noise_mechanism=noise_mechanism,
        bands=bands,
    )


def with_public_statistics(
    tx: Any, state: Any, public_per_example_grads: Any, *, weight: float = 1.0
) -> Any:
    """``state`` with its statistics moved towards those of *public* per-example gradients.

    Calls :meth:`adaclip.AdaptiveClipping.with_public_statistics`: with ``v_pub`` the
    per-coordinate variance ``Σ_i (g_i − ḡ)²/(n − 1)`` of the public gradients, the variance
    EMA becomes ``(1 − weight)·old + weight·pool(v_pub)`` (clamped to
    ``[std_min², std_max²]``; pooled as the strategy pools). The centre (``mean``) and
    everything else are left alone. Public data costs no privacy; nothing private is read.
    Typical use: at initialisation (``weight=1``) with ``freeze_statistics=True`` and
    ``scale="separated"`` (the public spread then sets only the shape).

    Args:
      tx: the private transformation (:func:`adaclip`, :func:`scale_then_privatize`; its
        strategy must be an :class:`adaclip.AdaptiveClipping`), or such a core strategy.
      state: its :class:`AdaClipState`, or a pytree holding exactly one (an ``optax.chain``
        state); the same structure is returned.
      public_per_example_grads: the parameters' pytree with a leading batch axis ``n ≥ 2``
        on every leaf (e.g. :func:`adaclip_jax.per_example_grads` on public data).
      weight: in ``(0, 1]``.

    Pure (no side effects) and traceable: ``weight`` must be a Python number.
    """
    is_state = lambda x: isinstance(x, AdaClipState)  # noqa: E731
    found = _find_states(state)
    if len(found) != 1:
        raise InvalidHyperparameterError(
            f"with_public_statistics: the state holds {len(found)} AdaClipState(s), expected exactly one"
        )
    (own,) = found
    if own.std is None:
        raise InvalidHyperparameterError(
            "with_public_statistics: this state has no statistics (std): it needs an AdaptiveClipping state"
        )
    std = jax.tree_util.tree_leaves(own.std)
    d = _num_params([tuple(s.shape) for s in std])
    strategy = tx.strategy_for(d) if isinstance(tx, PrivateTransformation) else tx
    if not isinstance(strategy, _strategies.AdaptiveClipping):
        raise InvalidHyperparameterError(
            f"with_public_statistics needs an AdaptiveClipping strategy, got {type(strategy).__name__}"
        )
    leaves, treedef = jax.tree_util.tree_flatten(public_per_example_grads)
    if treedef != jax.tree_util.tree_structure(own.std):
        raise InvalidGradientError(
            "the public per-example gradients do not have the parameters' tree structure"
        )
    grads = [jnp.asarray(g).astype(s.dtype) for g, s in zip(leaves, std, strict=True)]
    mean = None if own.mean is None else jax.tree_util.tree_leaves(own.mean)
    _check_extra(own.extra, len(std))
    core = _strategies.ClipState(step=own.step, mean=mean, std=std, extra=own.extra)
    new = strategy.with_public_statistics(core, grads, weight=weight)
    updated = own._replace(
        std=jax.tree_util.tree_unflatten(treedef, [x.astype(s.dtype) for x, s in zip(new.std, std, strict=True)]),
        extra=None if own.extra is None else jax.tree_util.tree_map(lambda n, o: n.astype(o.dtype), new.extra, own.extra),
    )
    return jax.tree_util.tree_map(lambda x: updated if is_state(x) else x, state, is_leaf=is_state)


def flat_clip(
    *,
    max_grad_norm: float,
    noise_multiplier: NoiseMultiplier,
    expected_batch_size: float,
    key: Any = None,
    axis_name: Any = None,
    secure_mode: bool = False,
    noise_mechanism: Any = "independent",
    bands: int | None = None,
) -> PrivateTransformation:
    """DP-SGD (flat clipping): ``g̃ = (Σ_i g_i·min(1, C/‖g_i‖) + C·σ·z)/B̄``.

    Relation to ``optax.contrib.differentially_private_aggregate(l2_norm_clip, noise_multiplier,
    key)`` (optax 0.2.8): same clipping (global norm of each unit's gradient over all leaves)
    and the same noise standard deviation ``C·σ`` on the sum, but optax divides by the
    *realised* batch size ``n`` (the leading axis of the input), while this divides by the
    *expected* ``B̄`` — what the sampled-Gaussian accounting assumes (dividing by ``n`` leaks
    ``n`` under Poisson sampling). With ``expected_batch_size = n`` and the same inputs the
    two give the same result for ``σ = 0``; for ``σ > 0`` the distributions are the same but
    the draws differ (different key splitting). Argument names: ``l2_norm_clip`` is
    ``max_grad_norm`` here; optax's deprecated ``seed=`` is ``key=`` (an int is accepted).
    ``key``, ``axis_name``, ``secure_mode``, ``noise_mechanism`` and ``bands`` are those of
    :func:`private_aggregate` (which also describes the state, checkpoints and the behaviour on
    bad input).
    """
    return private_aggregate(
        _strategies.FlatClipping(max_grad_norm),
        noise_multiplier=noise_multiplier,
        expected_batch_size=expected_batch_size,
        key=key,
        axis_name=axis_name,
        secure_mode=secure_mode,
        noise_mechanism=noise_mechanism,
        bands=bands,
    )


def per_layer_clip(
    *,
    noise_multiplier: NoiseMultiplier,
    expected_batch_size: float,
    key: Any = None,
    max_grad_norm: float | None = None,
    group_max_grad_norms: Sequence[float] | None = None,
    axis_name: Any = None,
    secure_mode: bool = False,
    noise_mechanism: Any = "independent",
    bands: int | None = None,
) -> PrivateTransformation:
    """Per-layer clipping (McMahan et al. 2018): each parameter leaf ``k`` clipped to ``C_k``.

    ``C = sqrt(Σ_k C_k²)``; the noise ``N(0, σ²C²)`` is added once to the sum. Without
    ``group_max_grad_norms`` (in ``jax.tree_util`` leaf order), ``C_k = max_grad_norm/√K``.
    ``key``, ``axis_name``, ``secure_mode``, ``noise_mechanism`` and ``bands`` are those of
    :func:`private_aggregate`.
    """
    return private_aggregate(
        _strategies.PerLayerClipping(
            max_grad_norm=max_grad_norm,
            group_max_grad_norms=None if group_max_grad_norms is None else tuple(group_max_grad_norms),
        ),
        noise_multiplier=noise_multiplier,
        expected_batch_size=expected_batch_size,
        key=key,
        axis_name=axis_name,
        secure_mode=secure_mode,
        noise_mechanism=noise_mechanism,
        bands=bands,
    )


def scaled_clip(
    *,
    max_grad_norm: float,
    layer_scales: Sequence[float],
    noise_multiplier: NoiseMultiplier,
    expected_batch_size: float,
    key: Any = None,
    axis_name: Any = None,
    secure_mode: bool = False,
    noise_mechanism: Any = "independent",
    bands: int | None = None,
) -> PrivateTransformation:
    """eDP-SGD scaling (Dupuy et al.): scale ``C·α_k`` on leaf ``k``, clip the whole vector.

    ``layer_scales`` (``α_k``, ``jax.tree_util`` leaf order) must come from public data or a
    privatised, accounted release (:mod:`adaclip.layer_scales`), never from private data in
    the clear. ``key``, ``axis_name``, ``secure_mode``, ``noise_mechanism`` and ``bands`` are
    those of :func:`private_aggregate`.
    """
    return private_aggregate(
        _strategies.ScaledClipping(max_grad_norm, tuple(layer_scales)),
        noise_multiplier=noise_multiplier,
        expected_batch_size=expected_batch_size,
        key=key,
        axis_name=axis_name,
        secure_mode=secure_mode,
        noise_mechanism=noise_mechanism,
        bands=bands,
    )
