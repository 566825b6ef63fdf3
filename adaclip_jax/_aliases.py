"""The public constructors of the JAX transformations (as optax keeps its aliases apart).

:func:`private_aggregate` privatises per-unit gradients with any core strategy of the affine
clipping family; :func:`adaclip`, :func:`scale_then_privatize`, :func:`quantile_clip`,
:func:`automatic_clip`, :func:`flat_clip`, :func:`per_layer_clip` and :func:`scaled_clip` only
choose that strategy (:mod:`adaclip.strategies`) from their keywords. Every one of them ends in
:func:`adaclip_jax._transform._build`, the one implementation of the update; their docstrings
are the user's reference (``private_aggregate``'s describes the noise, the state, checkpoints
and the behaviour on bad input for all of them).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypedDict

from adaclip import strategies as _strategies
from adaclip.adaptive_strategy import depends_on_num_params
from adaclip.options import ADAPTIVE_OPTION_NAMES, AdaptiveOptions
from adaclip_jax._transform import PrivateTransformation, _build, _StrategySlot
from adaclip_jax._validation import NoiseMultiplier

if TYPE_CHECKING:
    from typing import Unpack  # Python >= 3.11; only the annotations use it

__all__ = [
    "private_aggregate",
    "adaclip",
    "flat_clip",
    "per_layer_clip",
    "scaled_clip",
    "quantile_clip",
    "automatic_clip",
    "scale_then_privatize",
]


class ReleaseOptions(TypedDict, total=False):
    """The release keywords every alias passes on to :func:`private_aggregate` unchanged:
    ``noise_multiplier`` and ``expected_batch_size`` (required), ``key``, ``axis_name``,
    ``secure_mode``, ``noise_mechanism`` and ``bands`` (optional, with
    :func:`private_aggregate`'s defaults). :func:`adaclip` also takes ``use_kernel``. Their
    meaning, and the behaviour on bad values, is documented once, at :func:`private_aggregate`.
    """

    noise_multiplier: NoiseMultiplier
    expected_batch_size: float
    key: Any
    axis_name: Any
    secure_mode: bool
    noise_mechanism: Any
    bands: int | None


#: The keywords of :class:`ReleaseOptions`; the first two are required.
RELEASE_OPTION_NAMES: tuple[str, ...] = tuple(ReleaseOptions.__annotations__)
_REQUIRED = ("noise_multiplier", "expected_batch_size")


def _release_options(alias: str, given: Mapping[str, Any], *, allowed: Sequence[str] = RELEASE_OPTION_NAMES) -> dict[str, Any]:
    """``given`` checked as Python checks a signature that names ``allowed`` as keyword-only
    parameters (the first two required): an unknown or missing keyword raises the
    ``TypeError`` Python would raise for ``alias``, before anything is built."""
    unknown = [name for name in given if name not in allowed]
    if unknown:
        raise TypeError(f"{alias}() got an unexpected keyword argument {unknown[0]!r}")
    missing = [name for name in _REQUIRED if name not in given]
    if missing:
        names = " and ".join(repr(m) for m in missing)
        plural = "s" if len(missing) > 1 else ""
        raise TypeError(f"{alias}() missing {len(missing)} required keyword-only argument{plural}: {names}")
    return dict(given)


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
        for clipped sum + noise + rescale + moment update), compiled on a GPU, in interpret
        mode elsewhere (slow: for testing). ``"auto"``: the kernels on a GPU, the ``jnp`` path
        elsewhere. Only for the patent's
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
    ``v_t`` computed at construction, held at its last entry beyond it:
    :func:`adaclip_jax._banded._variance_table`). The
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


def adaclip(
    *,
    noise_multiplier: NoiseMultiplier,
    expected_batch_size: float,
    key: Any = None,
    axis_name: Any = None,
    use_kernel: bool | str = False,
    secure_mode: bool = False,
    noise_mechanism: Any = "independent",
    bands: int | None = None,
    **options: Unpack[AdaptiveOptions],
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
      use_kernel: ``False`` (default: the core ``jnp`` path), ``"auto"`` (the kernels on a
        GPU, the ``jnp`` path elsewhere) or ``True`` (the fused Pallas kernels: compiled on a
        GPU, in interpret mode elsewhere, a correctness tool; refused unless every option is
        the patent's); see
        :func:`private_aggregate`.
      **options: AdaCliP's options, :class:`adaclip.options.AdaptiveOptions` (the same
        keywords as ``adaclip_torch.AdaClip``; the maths of each is documented there):
        ``preset`` (``"centred"``, the default, or ``"patent"``; keywords left ``None`` take
        its values), ``std_min``, ``std_max`` (patent: ``1e-5``, ``1.0``; centred:
        ``C/(30√d)``, ``30·C/√d``), ``beta_mean``, ``beta_std``, ``initial_max_grad_norm``,
        ``std_spread``, ``scale``, ``max_grad_norm``, ``shape_power``, ``statistic``,
        ``correction``, ``pooling``, ``update_every``, ``centre``, ``process_noise``,
        ``freeze_statistics``, ``quantile``, ``initial_variance``. An unknown keyword raises
        ``TypeError``, as for any function; a bad value raises
        :class:`~adaclip.errors.InvalidHyperparameterError` here. In JAX:

        - ``initial_max_grad_norm`` (``C0``, instead of ``std_min``/``std_max``) and the
          separated scale without ``std_min``/``std_max`` set the std bounds from ``d`` = the
          number of parameter coordinates (``s_0 = C0/√d``, ``std_min = s_0/std_spread``,
          ``std_max = s_0·std_spread``, :meth:`adaclip.AdaptiveClipping.from_initial_clip`).
          ``d`` is known at ``tx.init(params)``, which builds the strategy (``tx.strategy``
          before that raises). As ``AdaClip(initial_max_grad_norm=)`` of the PyTorch plugin.
        - ``pooling="factored"`` pools rows × columns of each leaf with ≥ 2 axes
          (``out × rest``).
        - ``freeze_statistics`` keeps ``s`` as initialised (e.g. by
          :func:`with_public_statistics`).
        - ``quantile``: a static σ with ``σ ≥ 2σ_b`` raises
          :class:`InvalidHyperparameterError` (here, or in ``update`` for a per-call σ); a
          traced one releases NaN and keeps the state.
    """
    unknown = [name for name in options if name not in ADAPTIVE_OPTION_NAMES]
    if unknown:  # the error Python gives for a keyword the signature does not name
        raise TypeError(f"adaclip() got an unexpected keyword argument {unknown[0]!r}")

    def build(num_params: int) -> _strategies.AdaptiveClipping:
        return _strategies.adaptive_clipping(num_params, **options)

    probe = build(1)  # checks every hyperparameter now
    if depends_on_num_params(options, probe):
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
    beta: float = 0.999,
    spread: float = 1e4,
    **options: Any,
) -> PrivateTransformation:
    """Scale-then-privatize (Ganesh, McMahan, Thakurta, 2025):
    :meth:`adaclip.AdaptiveClipping.scale_then_privatize`.

    Centre 0; ``v̂ ← β v̂ + (1−β) g̃²`` (the released gradient's second moment, noise
    included); scale ``b = C·p`` with ``p = √v̂ / mean(√v̂)`` (so ``C = max_grad_norm`` keeps
    flat clipping's meaning), ``v̂`` kept within ``spread²`` either way of 1:

    .. math::
        \\tilde g = C p ⊙ (Σ_i \\bar w_i + σ z)/B̄,\\quad w_i = g_i/(C p).

    ``options``: the release keywords of :func:`private_aggregate` (:class:`ReleaseOptions`:
    ``noise_multiplier``, ``expected_batch_size``, ``key``, ``axis_name``, ``secure_mode``,
    ``noise_mechanism``, ``bands``) and other keyword options of
    :class:`adaclip.AdaptiveClipping` (e.g. ``quantile=``, ``update_every=``).
    """
    release = _release_options(
        "scale_then_privatize", {k: options.pop(k) for k in RELEASE_OPTION_NAMES if k in options}
    )
    strategy = _strategies.AdaptiveClipping.scale_then_privatize(max_grad_norm, beta=beta, spread=spread, **options)
    return private_aggregate(strategy, **release)


def quantile_clip(
    *,
    max_grad_norm: float = 1.0,
    quantile: _strategies.QuantileRule | None = None,
    **release: Unpack[ReleaseOptions],
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
    release = _release_options("quantile_clip", release)
    rule = _strategies.QuantileRule() if quantile is None else quantile
    return private_aggregate(_strategies.QuantileClipping(max_grad_norm, rule), **release)


def automatic_clip(
    *,
    max_grad_norm: float = 1.0,
    stability: float = 0.01,
    **release: Unpack[ReleaseOptions],
) -> PrivateTransformation:
    """Automatic clipping (Bu et al., 2022): :class:`adaclip.AutomaticClipping`.

    .. math::
        \\tilde g = C (Σ_i w_i/(‖w_i‖ + γ) + σ z)/B̄,\\qquad w_i = g_i/C,

    every unit normalised (``‖w̄_i‖ < 1``, sensitivity 1), so no clip norm needs tuning:
    ``C = max_grad_norm`` only sets the release's scale, ``γ = stability > 0``. ``key``,
    ``axis_name``, ``secure_mode``, ``noise_mechanism`` and ``bands`` are those of
    :func:`private_aggregate`.
    """
    release = _release_options("automatic_clip", release)
    return private_aggregate(_strategies.AutomaticClipping(max_grad_norm, stability), **release)


def flat_clip(
    *,
    max_grad_norm: float,
    **release: Unpack[ReleaseOptions],
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
    release = _release_options("flat_clip", release)
    return private_aggregate(_strategies.FlatClipping(max_grad_norm), **release)


def per_layer_clip(
    *,
    max_grad_norm: float | None = None,
    group_max_grad_norms: Sequence[float] | None = None,
    **release: Unpack[ReleaseOptions],
) -> PrivateTransformation:
    """Per-layer clipping (McMahan et al. 2018): each parameter leaf ``k`` clipped to ``C_k``.

    ``C = sqrt(Σ_k C_k²)``; the noise ``N(0, σ²C²)`` is added once to the sum. Without
    ``group_max_grad_norms`` (in ``jax.tree_util`` leaf order), ``C_k = max_grad_norm/√K``.
    ``key``, ``axis_name``, ``secure_mode``, ``noise_mechanism`` and ``bands`` are those of
    :func:`private_aggregate`.
    """
    release = _release_options("per_layer_clip", release)
    groups = None if group_max_grad_norms is None else tuple(group_max_grad_norms)
    return private_aggregate(_strategies.PerLayerClipping(max_grad_norm=max_grad_norm, group_max_grad_norms=groups), **release)


def scaled_clip(
    *,
    max_grad_norm: float,
    layer_scales: Sequence[float],
    **release: Unpack[ReleaseOptions],
) -> PrivateTransformation:
    """eDP-SGD scaling (Dupuy et al.): scale ``C·α_k`` on leaf ``k``, clip the whole vector.

    ``layer_scales`` (``α_k``, ``jax.tree_util`` leaf order) must come from public data or a
    privatised, accounted release (:mod:`adaclip.layer_scales`), never from private data in
    the clear. ``key``, ``axis_name``, ``secure_mode``, ``noise_mechanism`` and ``bands`` are
    those of :func:`private_aggregate`.
    """
    release = _release_options("scaled_clip", release)
    return private_aggregate(_strategies.ScaledClipping(max_grad_norm, tuple(layer_scales)), **release)
