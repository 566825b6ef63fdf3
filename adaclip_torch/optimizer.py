"""Wrap any ``torch.optim`` optimizer so that every step is differentially private.

:class:`DPOptimizer` holds the one private path for every strategy of the affine family
(:mod:`adaclip.strategies`); :class:`AdaClip` (with every adaptive option), :class:`FlatClip`,
:class:`PerLayerClip`, :class:`ScaledClip`, :class:`QuantileClip` and :class:`AutomaticClip`
only choose the strategy. A step, with ``g_i`` the per-unit gradients the grad-sample hooks
left in ``p.grad_sample`` (all tensors together form one vector of ``d`` coordinates):

.. math::
    \\tilde g_t = b_t ⊙ \\frac{\\sum_i \\mathrm{clip}_1((g_i - a_t)/b_t) + σ_t z}{\\bar B} + a_t,
    \\qquad z \\sim N(0, I_d),

computed by :func:`adaclip.strategies.clip_and_sum` and :func:`adaclip.strategies.release`
(the core; nothing is re-derived here). A strategy that releases *auxiliary* sums with the
gradient (the quantile rule's count of unclipped units) gets them as extra 0-d entries after
the K per-tensor sums, on every per-sample path (materialised, ghost, user level, virtual
steps, empty batches, data parallel) without a branch on the strategy: they are summed,
accumulated and all-reduced like the rest, get one standard normal each, and the release
uses ``(σ_g, σ_aux) = strategy.noise_multipliers(σ_t, B̄)`` while the accountant records
``σ_t``. ``\\tilde g_t`` goes into ``p.grad`` and the wrapped
optimizer (SGD, Adam, Adagrad, ...) steps on it unchanged. ``B̄`` is the *expected* batch
size, never the realised one; the AdaCliP moments are updated from ``\\tilde g_t`` only.

The per-unit side of a step — reading the batch, the per-unit norms and clip factors, the
clipped sum — is a *per-sample engine* (:mod:`adaclip_torch.engines`), chosen at construction
from ``per_sample_mode`` and ``use_kernel``: materialised per-example gradients, ghost norms,
or the fused Triton kernels (which also release). This module is the mechanism around it:
the privacy checks, the schedule, the budget, noise drawn once, the release, the commit and
the checkpoints.

Failure atomicity: every error raised before the release can have left the optimizer (bad
gradients, missing backward, budget exceeded, a refused model or parameter, ...) leaves the
parameters, ``p.grad``, ``p.grad_sample``, the AdaCliP state, the step counter, the noise
generator and the accountant exactly as they were. Once the wrapped optimizer's ``step`` has
been called (or, with ``distributed=True``, the noisy all-reduce has started), the step *is*
released even if something raises afterwards — the wrapped optimizer, or a hook on it: it is
accounted, the AdaCliP state moves on, and the noise generator is never rewound, so a retried
step draws fresh noise (reusing the draw would let the difference of the two releases cancel
it). The exception is then re-raised.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from adaclip import schedules as _schedules
from adaclip import strategies as _strategies
from adaclip import transform as _transform
from adaclip.errors import BudgetExceededError, InvalidGradientError, InvalidHyperparameterError
from adaclip.strategies import ClipState
from adaclip.transform import check_per_example_grads
from adaclip_torch import validation as _validation
from adaclip_torch.correlated import NoiseStream, make_noise_mechanism
from adaclip_torch.engines import EngineContext, PerSampleEngine, StepInputs, make_engine, resolve_kernel
from adaclip_torch.engines.base import group_by_unit as group_by_unit  # re-exported: it lived here
from adaclip_torch.ghost import PER_SAMPLE_MODES
from adaclip_torch.noise import NoiseSource

__all__ = [
    "DPOptimizer",
    "AdaClip",
    "FlatClip",
    "PerLayerClip",
    "ScaledClip",
    "QuantileClip",
    "AutomaticClip",
    "adaptive_clipping",
    "NONFINITE_MODES",
]

Tensor = torch.Tensor

#: What a unit with a NaN/inf per-unit gradient does: ``"zero"`` (the default) drops it — it
#: contributes 0, which stays within the sensitivity and does not reveal it —, ``"raise"``
#: raises :class:`InvalidGradientError` before anything changes (a debugging aid: the error
#: itself depends on one unit's data, so do not use it where the errors are observable).
NONFINITE_MODES = ("zero", "raise")


# --------------------------------------------------------------------------- helpers


def _trainable_params(optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
    """The ``requires_grad`` parameters of the optimizer's groups, in group order, deduplicated."""
    seen: set[int] = set()
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def _parameter_names(model: nn.Module, params: Sequence[Tensor]) -> list[str]:
    """Names of ``params`` in ``model``; raises if one of them is not a model parameter."""
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=True)}
    out = []
    for k, p in enumerate(params):
        if id(p) not in names:
            raise InvalidHyperparameterError(
                f"optimizer parameter #{k} (shape {tuple(p.shape)}) is not a parameter of model: "
                "the per-example gradients come from the model, so every trainable parameter of "
                "the optimizer must belong to it"
            )
        out.append(names[id(p)])
    return out


def _ddp_wrapped(model: nn.Module) -> bool:
    return isinstance(model, nn.parallel.DistributedDataParallel)


def _statistics_dtype(params: Sequence[Tensor]) -> torch.dtype:
    """float64 if any parameter is float64, else float32 (never lower precision)."""
    return torch.float64 if any(p.dtype == torch.float64 for p in params) else torch.float32


def _check_sample_rate(sample_rate: Any) -> float | None:
    return None if sample_rate is None else _strategies.validate_sample_rate(sample_rate)


def _transform_of(strategy: Any, state: ClipState, num_tensors: int) -> tuple[Any, Any]:
    """``strategy.transform(state, num_tensors)`` as a plain function (for ``torch.compile``)."""
    return strategy.transform(state, num_tensors)


@contextlib.contextmanager
def _quiet_dynamo() -> Iterator[None]:
    """Silence dynamo's note on tracing through ``functools.lru_cache``: array-api-compat's
    namespace lookup is such a cache, keyed by the array type, deterministic per type."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Dynamo detected a call to a `functools.lru_cache`")
        yield


class _ReadOnlyError(InvalidHyperparameterError, AttributeError):
    """An Opacus-style attribute that is read-only here (or absent for this strategy): an
    :class:`InvalidHyperparameterError` that is also an ``AttributeError``, so ``getattr(opt,
    name, default)`` and ``hasattr`` behave as for a missing attribute."""


# --------------------------------------------------------------------------- the wrapper


class DPOptimizer(torch.optim.Optimizer):
    """Differentially private wrapper of a ``torch.optim`` optimizer.

    Args:
      optimizer: the optimizer to wrap; it steps on the privatised gradient.
      model: the module whose parameters ``optimizer`` trains; grad-sample hooks are
        attached to it (unless ``attach_hooks=False``: then something else must set
        ``p.grad_sample`` to the ``(n, *p.shape)`` per-example gradients before ``step``).
      strategy: an :mod:`adaclip.strategies` strategy (AdaCliP with any options, flat,
        per-layer, scaled, quantile, automatic).
      noise_multiplier: σ for every step (give this or ``noise_schedule``).
      expected_batch_size: B̄, the *expected* number of units per (logical) step:
        ``q·N`` under Poisson sampling, the batch size otherwise; users per step at user level.
      noise_schedule: an :mod:`adaclip.schedules` schedule giving ``σ_t`` (and ``C_t``).
      accountant: an :class:`adaclip.accounting.Accountant`; each step records ``(q, σ_t)``
        and a step that would exceed its budget raises :class:`BudgetExceededError` first.
      sample_rate: ``q``, needed with an accountant.
      seed: seed of the noise generator, for reproducible experiments: its state is then saved
        in checkpoints (keep them and the seed secret) and restoring one warns that the noise
        replays. ``None`` (default): seeded from the OS, never saved, re-seeded from the OS
        when a checkpoint is restored.
      secure_mode: draw noise from the OS CSPRNG with the floating-point-attack
        mitigation of :mod:`adaclip_torch.noise` (no reproducible noise state).
      loss_reduction: ``"mean"`` or ``"sum"``, how the loss is reduced over the batch.
      batch_first: whether the model's inputs have the batch on axis 0.
      attach_hooks: attach :class:`adaclip_torch.grad_sample.GradSampleHooks` to ``model``.
      distributed: data parallel over ``torch.distributed`` (see
        :mod:`adaclip_torch.distributed`): each rank clips its own units, the clipped sums
        are all-reduced, and rank 0 alone adds the noise. Also the switch for a model sharded
        with FSDP2 (``torch.distributed.fsdp.fully_shard``; detected from its DTensor
        parameters, :attr:`fsdp`): the units' norms and clipped sums are those of the full
        parameters, the noise is added once as above, and each rank writes its shard of the
        release into ``p.grad``, replacing FSDP's raw gradient (FSDP1, mixed or non-default
        sharding, banded noise and ``averaging`` are refused with FSDP2).
      per_sample_mode: how the per-unit norms and the clipped sum are computed (the per-sample
        engine, :mod:`adaclip_torch.engines`, exposed as :attr:`engine`); every mode computes
        the same step (ghost norms are upper bounds: rounding can only over-clip).
        ``"auto"`` (default): the fused kernels where they run (``use_kernel``, below: they
        read materialised per-example gradients), otherwise weighted ghost norms for
        ``nn.Linear``/``nn.Embedding``/``transformers`` ``Conv1D`` layers, tied embeddings included
        (no ``p.grad_sample`` is formed for them, see
        :mod:`adaclip_torch.ghost`) and materialised per-example gradients for every other
        layer (convolutions included, and layers without a ghost rule). ``"materialise"``:
        per-example gradients of every layer, left in ``p.grad_sample`` after ``backward()``
        (choose it to read them). ``"ghost"``: ghost norms for convolutions too (the memory
        mode). :attr:`per_sample_mode` is the mode in use (``"materialise"`` when ``"auto"``
        chose the kernels).
      use_kernel: the fused Triton kernels (:mod:`adaclip_torch.kernels`) for the
        clip–sum–noise–rescale–update pass. ``None`` (auto): on when the parameters are
        float32 CUDA tensors, triton is installed, the strategy is flat clipping or the
        patent's AdaCliP (``AdaptiveClipping`` with ``is_patent``: every option at its
        default), ``per_sample_mode`` is ``"materialise"`` or ``"auto"`` and
        ``distributed=False``; else off. ``True``: on, or :class:`InvalidHyperparameterError`
        naming what prevents it (``per_sample_mode="ghost"`` does). ``False``: the
        core path. The kernel path computes the same step as the core path (tests check
        them against each other on the same noise); it serves :meth:`step` on per-example
        or per-user gradients, while :meth:`accumulate` and ``empty_batch=True`` steps take
        the core path. The noise comes from this optimizer's generator either way (so
        ``seed``, ``secure_mode`` and checkpoints behave the same).
      nonfinite: a unit whose per-unit gradient has a NaN/inf entry: ``"zero"`` (default)
        drops it — it contributes 0 to the clipped sum, within the sensitivity, and the
        release stays finite, so it does not reveal that unit; ``"raise"`` raises
        :class:`InvalidGradientError` naming the parameters before anything changes (for
        debugging; the error depends on one unit's data).
      compile_release: run the release — ``+σz``, the rescale ``a + b ⊙ (·)/B̄`` and the
        strategy's state update, :func:`adaclip.strategies.release` — and the next step's
        transform ``(a, b) = strategy.transform(state)`` under ``torch.compile``, which fuses
        their elementwise passes over the d coordinates (on CPU about 3× faster for AdaCliP's
        release on a 795k-parameter MLP, see the speed benchmarks). The clipping is not
        compiled: every unit is clipped in the space of the ``(a, b)`` the step releases
        with, so the sensitivity argument is unchanged; the noise is drawn as without it.
        The compiled path equals the eager one up to float rounding (not bit for bit).
        The first steps compile (seconds; again when the strategy or shapes change), and it
        needs a working ``torch.compile`` backend (a C++ compiler on CPU). Off by default. It
        does not apply to the fused kernels (``use_kernel``), which release themselves.
      noise_mechanism: ``"independent"`` (default: DP-SGD's fresh noise every step) or
        ``"banded"`` (correlated noise, amplified banded matrix factorisation, see
        :mod:`adaclip.correlated`): ``x_t = (z_t − Σ_j c_j x_{t−j})/c_0`` with ``bands`` bands,
        accounted as ``⌈T/b⌉`` compositions at rate ``p = b·q`` — the accountant records at the
        first step of each cycle of ``b`` steps. A :class:`adaclip.correlated.BandedNoise` gives
        the coefficients (``"banded"`` takes the truncated square root). Needs ``sampler`` and a
        constant ``noise_multiplier``; ``compile_release`` and the fused kernels are not used
        with it. With ``distributed=True`` rank 0 draws and correlates the noise with its
        buffers (added once, like independent noise); each rank passes its own
        :class:`~adaclip_torch.data.CyclicPoissonBatchSampler` over its shard of the data, and a
        checkpoint is rank 0's state, loaded on every rank. The buffers (the last ``b − 1`` noise vectors) are secret
        and saved in checkpoints only with ``seed``; otherwise a restore starts a new cycle.
      bands: ``b`` for ``noise_mechanism="banded"``.
      sampler: the :class:`~adaclip_torch.data.CyclicPoissonBatchSampler` (``bands=b``) that
        draws the batches, required with banded noise and checked at each step.
      averaging: keep an average of the parameters after each private step
        (:class:`adaclip_torch.ParameterAverage`; post-processing of the releases, free in
        privacy): an EMA decay in ``[0, 1)``, an :class:`adaclip.averaging.AveragingConfig`, or a
        mapping of its keywords (``"ema"``/``"tail"`` need the run length: ``make_private`` fills
        it in). Evaluate and save the average inside ``with optimizer.averaged(): ...``; it is
        part of :meth:`state_dict`.

    Privacy checks made at every :meth:`step` (and :meth:`accumulate`), before anything
    changes: every parameter the wrapped optimizer can step is privatised — a parameter
    frozen at wrapping time and unfrozen later, or added with ``add_param_group`` on the
    wrapped optimizer, is refused rather than stepped on its raw gradient; the model contains
    no module that mixes the examples of a batch (:mod:`adaclip_torch.validation`: any
    BatchNorm, also one added after wrapping); the parameters kept their dtype, device and
    shape (``model.double()`` after wrapping is refused).
    ``param_groups``, ``state`` and ``defaults`` are the wrapped optimizer's, so LR schedulers
    work on the wrapper. ``add_param_group`` is not supported (the AdaCliP transform depends on
    the whole parameter vector): wrap a new optimizer instead.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: nn.Module,
        *,
        strategy: Any,
        noise_multiplier: float | None = None,
        expected_batch_size: float,
        noise_schedule: Any = None,
        accountant: Any = None,
        sample_rate: float | None = None,
        seed: int | None = None,
        secure_mode: bool = False,
        loss_reduction: str = "mean",
        batch_first: bool = True,
        attach_hooks: bool = True,
        distributed: bool = False,
        per_sample_mode: str = "auto",
        use_kernel: bool | None = None,
        nonfinite: str = "zero",
        compile_release: bool = False,
        noise_mechanism: Any = "independent",
        bands: int | None = None,
        sampler: Any = None,
        averaging: Any = None,
    ) -> None:
        # Deliberately no super().__init__: the parameter groups and state live in `optimizer`.
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise InvalidHyperparameterError(f"optimizer must be a torch.optim.Optimizer, got {optimizer!r}")
        if isinstance(optimizer, DPOptimizer):
            raise InvalidHyperparameterError("optimizer is already a DPOptimizer: wrap the plain optimizer once")
        if not isinstance(model, nn.Module):
            raise InvalidHyperparameterError(f"model must be a torch.nn.Module, got {model!r}")
        if per_sample_mode not in PER_SAMPLE_MODES:
            raise InvalidHyperparameterError(
                f"per_sample_mode must be one of {PER_SAMPLE_MODES}, got {per_sample_mode!r}"
            )
        if loss_reduction not in ("mean", "sum"):
            raise InvalidHyperparameterError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
        if nonfinite not in NONFINITE_MODES:
            raise InvalidHyperparameterError(f"nonfinite must be one of {NONFINITE_MODES}, got {nonfinite!r}")
        if _ddp_wrapped(model):
            why = (
                "" if distributed else ", and without distributed=True every rank would release its own "
                "noisy gradient, so the ranks would silently drift apart"
            )
            raise InvalidHyperparameterError(
                "model is wrapped in torch.nn.parallel.DistributedDataParallel, whose all-reduce of raw "
                f"gradients the private step does not use{why}. Pass the unwrapped module (model.module) "
                "with distributed=True: each rank clips its own units, the clipped sums are all-reduced "
                "and rank 0 alone adds the noise (expected_batch_size is then the global B̄)"
            )
        _validation.check_model(model)
        from adaclip_torch import distributed as _distributed

        _distributed.refuse_fsdp1(model)
        self.noise_schedule = self._make_schedule(noise_multiplier, noise_schedule)
        _, self._expected_batch_size = _strategies.validate_mechanism(0.0, expected_batch_size)
        self._sample_rate = _check_sample_rate(sample_rate)
        if accountant is not None and self.sample_rate is None:
            raise InvalidHyperparameterError("an accountant needs sample_rate (q) to record each step")
        self.original_optimizer = optimizer
        self.model = model
        self.strategy = strategy
        self.accountant = accountant
        self.loss_reduction = loss_reduction
        self.distributed = bool(distributed)
        self.nonfinite = nonfinite
        if not isinstance(compile_release, bool):
            raise InvalidHyperparameterError(f"compile_release must be True or False, got {compile_release!r}")
        self.compile_release = compile_release
        self._compiled: dict[Callable[..., Any], Callable[..., Any]] = {}
        self.params = _trainable_params(optimizer)
        if not self.params:
            raise InvalidHyperparameterError("the optimizer has no trainable parameters")
        self.param_names = _parameter_names(model, self.params)
        # FSDP2: the parameters are sharded DTensors; shapes are their full shapes, the state and
        # every sum are full-size plain tensors, and p.grad gets this rank's shard of the release
        self._fsdp = _distributed.check_fsdp(self.params, self.param_names, distributed=self.distributed)
        if self._fsdp and averaging is not None:
            raise InvalidHyperparameterError(
                "averaging= is not supported with FSDP2-sharded parameters yet: average the local shards "
                "yourself after each step (p.to_local() of every parameter; post-processing of the releases, "
                "free in privacy), or train without FSDP2"
            )
        self._shapes = [tuple(p.shape) for p in self.params]
        self._layouts = [(p.dtype, p.device) for p in self.params]
        self._dtype = _statistics_dtype(self.params)
        self._transform_cache: tuple[ClipState, Any, tuple[Any, Any]] | None = None
        self._clip_state: ClipState = strategy.init(
            [_distributed.full_template(p, self._dtype) if self._fsdp else p.detach().to(self._dtype) for p in self.params]
        )
        # Validates strategy-specific lengths (layer_scales, group norms) and step 0's noise
        # multipliers (the quantile rule needs σ < 2σ_b) up front.
        self._noise_multipliers(self._strategy_at(0), self.noise_schedule.at(0).noise_multiplier)
        if isinstance(strategy, _strategies.AdaptiveClipping) and strategy.scale == "coupled":
            # κ describes the coupled scale b = √s·√Σs, whose clip level follows the statistics
            _strategies.warn_if_noise_dominated(
                sum(p.numel() for p in self.params),
                self.noise_schedule.at(0).noise_multiplier,
                self.expected_batch_size,
            )
        self.use_kernel = use_kernel
        # refused (use_kernel=True) before any hook is attached. "auto" picks the kernels where
        # they run (they read materialised per-example gradients), else the ghost engine
        kernel = resolve_kernel(
            use_kernel,
            strategy,
            per_sample_mode="materialise" if per_sample_mode == "auto" else per_sample_mode,
            distributed=self.distributed,
            dtype=self._dtype,
            params=self.params,
        )
        if kernel and per_sample_mode == "auto":
            per_sample_mode = "materialise"
        self._stream = self._make_stream(noise_mechanism, bands, sampler, noise_schedule)  # before any hook
        if self._fsdp and self._stream is not None:
            raise InvalidHyperparameterError(
                "noise_mechanism='banded' is not supported with FSDP2-sharded parameters yet: use the "
                "independent noise (the default), or banded noise with plain data parallelism (distributed=True "
                "on an unsharded model)"
            )
        from adaclip_torch.averaging import ParameterAverage

        self.average = ParameterAverage.from_spec(model, averaging)
        self._noise = NoiseSource(seed=seed, secure_mode=secure_mode)
        self._accumulated: list[Tensor] | None = None
        # the units in the pending sum: None (none from a batch), "examples", or the user ids
        self._pending_units: str | frozenset[int] | None = None
        # set by adaclip_torch.BatchMemoryManager while it drives this optimizer (see step())
        self._physical_batches: Any = None
        self._steps = 0
        self.grad_sample_hooks = None
        if attach_hooks:
            from adaclip_torch.grad_sample import GradSampleHooks

            self.grad_sample_hooks = GradSampleHooks(model, loss_reduction=loss_reduction, batch_first=batch_first)
        self.per_sample_mode = per_sample_mode
        context = EngineContext(tuple(self.params), tuple(self.param_names), tuple(self._shapes), self._dtype)
        self._engine = make_engine(
            per_sample_mode, context, model=model, hooks=self.grad_sample_hooks, use_kernel=kernel
        )

    # ------------------------------------------------------------------ forwarding

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.original_optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.original_optimizer.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.original_optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.original_optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.original_optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.original_optimizer.defaults = value

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise InvalidHyperparameterError(
            "add_param_group is not supported on a DPOptimizer: the clipping transform covers the "
            "whole parameter vector; build the wrapped optimizer with every group, then wrap it"
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.strategy!r}, B̄={self.expected_batch_size}, wrapping {self.original_optimizer!r})"

    def remove_hooks(self) -> None:
        """Detach the grad-sample hooks from the model (e.g. to wrap it again)."""
        if self.grad_sample_hooks is not None:
            self.grad_sample_hooks.remove()
            self.grad_sample_hooks = None

    # ------------------------------------------------------------------ read-only views

    @property
    def steps(self) -> int:
        """Number of private steps released so far."""
        return self._steps

    # Opacus's attribute names, read-only: they are hyperparameters of the mechanism, fixed at
    # construction; assigning one (which Opacus allows) would change the privacy of every later
    # step behind the accountant's back, so it is refused with the way to do it here.

    @property
    def noise_multiplier(self) -> float:
        """σ of the next step: the noise multiplier given at construction, or the schedule's
        ``σ_t`` with a ``noise_schedule``. It is what the accountant records (for the quantile
        rule the gradient's own ``σ_g`` is larger: :meth:`hyperparameters`). Read-only."""
        return float(self.noise_schedule.at(self._steps).noise_multiplier)

    @noise_multiplier.setter
    def noise_multiplier(self, value: Any) -> None:
        raise _ReadOnlyError(
            "noise_multiplier is fixed when the optimizer is built (each step is accounted with it); it "
            "cannot be assigned. For a noise multiplier that changes over training pass "
            "noise_schedule= (adaclip.schedules: LinearNoiseDecay, ExponentialNoiseDecay, Retune) when building "
            "the wrapper; to change it from here on, build a new wrapper with the same accountant"
        )

    @property
    def max_grad_norm(self) -> float:
        """The clip norm ``C`` of the next step, for the strategies that have one: flat
        clipping's ``C`` (each unit's whole gradient is clipped to norm ``C``); per-layer
        clipping's *total* ``C`` (tensor k clipped to ``C/√K``); scaled clipping's ``C`` (tensor
        k scaled by ``C·layer_scales[k]``); the quantile rule's current ``C_t`` (it adapts);
        automatic clipping's ``C`` (the scale of the normalised units). A ``noise_schedule``
        that sets ``C_t`` gives that.

        AdaCliP (any preset) has no clip norm — each unit is clipped to norm 1 after the
        transform ``(g − a)/b`` with a centre and scale learnt from the releases — and per-layer
        clipping with ``group_max_grad_norms`` has one per tensor: for them reading it raises
        an ``AttributeError`` (an :class:`InvalidHyperparameterError`) that names what to read
        instead (:meth:`centre_and_scale`, :meth:`hyperparameters`). Read-only."""
        if isinstance(self.strategy, _strategies.AdaptiveClipping):
            raise _ReadOnlyError(
                f"{type(self).__name__} (AdaCliP) has no max_grad_norm: each unit g is clipped to norm 1 "
                "after the transform (g - a)/b, with a centre a and a scale b learnt from the releases, so "
                "no single clip norm bounds a unit's gradient. Read optimizer.centre_and_scale() for the "
                "a and b the next step clips with, optimizer.hyperparameters().max_grad_norm for the "
                "separated scale's C_t (the clip level b is proportional to), or "
                "strategy.initial_max_grad_norm / make_private's max_grad_norm= for the clip norm of the "
                "first step"
            )
        norm = self.hyperparameters().max_grad_norm
        if norm is None:
            groups = getattr(self.strategy, "group_max_grad_norms", None)
            hint = (
                f"its per-tensor clip norms are optimizer.strategy.group_max_grad_norms = {tuple(groups)!r}"
                if groups is not None else "read optimizer.hyperparameters() and optimizer.strategy"
            )
            raise _ReadOnlyError(
                f"{type(self).__name__} ({type(self.strategy).__name__}) has no single max_grad_norm: {hint}"
            )
        return float(norm)

    @max_grad_norm.setter
    def max_grad_norm(self, value: Any) -> None:
        raise _ReadOnlyError(
            "max_grad_norm is fixed when the optimizer is built; it cannot be assigned. For a clip norm "
            "that changes over training pass a noise_schedule= that sets it (e.g. "
            "adaclip.schedules.Retune(..., max_grad_norm=)), or use an adaptive strategy (QuantileClip, AdaClip); to change it from "
            "here on, build a new wrapper with the same accountant"
        )

    @property
    def expected_batch_size(self) -> float:
        """``B̄``, the expected number of units per (logical) step (``q·N`` under Poisson
        sampling): the denominator of every release. Read-only."""
        return self._expected_batch_size

    @expected_batch_size.setter
    def expected_batch_size(self, value: Any) -> None:
        raise _ReadOnlyError(
            "expected_batch_size is fixed when the optimizer is built: it is B̄ = q·N, the expected size of "
            "the logical batch, which every release divides by. It cannot be assigned. To split logical "
            "batches into smaller physical ones keep it (adaclip_torch.BatchMemoryManager, or "
            "optimizer.accumulate()); for another sampling rate build a new wrapper"
        )

    @property
    def sample_rate(self) -> float | None:
        """``q``, the probability that a unit joins a (logical) step, which the accountant
        records (``None`` without one). Read-only."""
        return self._sample_rate

    @sample_rate.setter
    def sample_rate(self, value: Any) -> None:
        raise _ReadOnlyError(
            "sample_rate is fixed when the optimizer is built (the accountant records it at every step); "
            "it cannot be assigned. For another sampling rate build a new wrapper (and loader) with the "
            "same accountant"
        )

    def get_epsilon(self, delta: float | None = None) -> float:
        """ε spent so far at ``delta``: ``optimizer.accountant.epsilon(delta)`` (Opacus's
        ``privacy_engine.get_epsilon(delta)``). ``delta`` defaults to the accountant's budget δ.

        Raises:
          InvalidHyperparameterError: no accountant is attached (build the wrapper with
            ``accountant=`` and ``sample_rate=``, or use :func:`adaclip_torch.make_private`), or
            ``delta`` is missing (no budget δ) or not in (0, 1).
        """
        if self.accountant is None:
            raise InvalidHyperparameterError(
                "get_epsilon() needs an accountant: build the wrapper with accountant= (an "
                "adaclip.accounting.Accountant) and sample_rate=, or use adaclip_torch.make_private, "
                "which attaches one"
            )
        return float(self.accountant.epsilon(delta))

    def signal_skip_step(self, do_skip: bool = True) -> None:
        """Opacus's hook for its ``BatchMemoryManager``; refused here (nothing changes).

        Opacus's manager splits each logical batch into physical batches of indices without
        regard to the privacy unit and signals the optimizer to skip all but the last step; use
        :class:`adaclip_torch.BatchMemoryManager` (same arguments) instead, which accumulates
        with :meth:`accumulate`, keeps each user in one physical batch at user level, and
        releases (and accounts) once per logical batch."""
        raise InvalidHyperparameterError(
            "Opacus's BatchMemoryManager (optimizer.signal_skip_step) does not drive an adaclip optimizer: "
            "use adaclip_torch.BatchMemoryManager(data_loader=, max_physical_batch_size=, optimizer=) "
            "with the same arguments, in the same 'with ... as loader:' loop"
        )

    @property
    def clip_state(self) -> ClipState:
        """The strategy's state: AdaCliP's ``mean``/``std`` (one tensor per parameter) and the
        options' ``extra`` (e.g. ``extra["clip_norm"]``, the quantile rule's ``C_t``)."""
        return self._clip_state

    @property
    def noise_source(self) -> NoiseSource:
        return self._noise

    @property
    def fused_kernels(self) -> bool:
        """Whether :meth:`step` runs the fused kernels (a configuration, fixed at construction;
        see ``use_kernel``). There is deliberately no count of the steps that took them: a
        batch with no units takes the core path, so such a count would reveal how many
        Poisson batches were empty."""
        return self._engine.fuses_release

    @property
    def fsdp(self) -> bool:
        """Whether the privatised parameters are FSDP2-sharded DTensors (``fully_shard``), detected
        at construction (with ``distributed=True``; see :mod:`adaclip_torch.distributed`): the
        mechanism then works on full-size tensors and each rank writes its shard of the release."""
        return self._fsdp

    @property
    def engine(self) -> PerSampleEngine:
        """The per-sample engine (:mod:`adaclip_torch.engines`) that turns each batch into the
        clipped sum: chosen at construction from ``per_sample_mode`` and ``use_kernel``."""
        return self._engine

    def hyperparameters(self, step: int | None = None) -> _schedules.StepHyperparameters:
        """``(σ_t, C_t)`` of step ``t`` (the next step by default). ``C_t`` is the clip norm the
        step uses (the strategy's own when the schedule keeps it); ``None`` for strategies
        without a single clip norm (AdaCliP's coupled scale, per-layer with per-group norms).

        A clip norm adapted by the quantile rule (:class:`~adaclip.strategies.QuantileClipping`,
        ``AdaptiveClipping(scale="separated", quantile=...)``) lives in the state:
        ``C_t = C_{t−1}·exp(−η(f̃ − γ))`` is a function of the released counts, so it is reported
        for the next step (from the state) and ``None`` for any other step (a past one is not
        kept, a later one depends on releases not made yet). ``σ_t`` is the accounted noise
        multiplier; the gradient's own ``σ_g`` is ``strategy.noise_multipliers(σ_t, B̄)[0]``."""
        t = self._steps if step is None else step
        hp = self.noise_schedule.at(t)
        if hp.max_grad_norm is None:
            hp = hp._replace(max_grad_norm=self._clip_norm_at(self._strategy_at(t), t))
        return hp

    def _clip_norm_at(self, strategy: Any, t: int) -> float | None:
        """``C_t`` for :meth:`hyperparameters`: the state's adapted clip norm for the next step,
        else the strategy's fixed ``max_grad_norm`` (``None`` where it has none)."""
        adapted = (self._clip_state.extra or {}).get("clip_norm")
        if adapted is not None:
            return float(adapted) if t == self._steps else None
        return getattr(strategy, "max_grad_norm", None)

    # ------------------------------------------------------------------ the private step

    def step(
        self,
        closure: Callable[[], Any] | None = None,
        *,
        user_ids: Tensor | None = None,
        empty_batch: bool = False,
    ) -> Any:
        """Release one private gradient and step the wrapped optimizer on it.

        Reads ``p.grad_sample`` (left by ``loss.backward()``), adds it to anything gathered by
        :meth:`accumulate`, clips, adds noise once, rescales, writes ``p.grad`` and calls the
        wrapped ``step()``. ``user_ids`` (one integer per example) sums each user's examples
        into one unit before clipping (user-level privacy; ``expected_batch_size`` is then
        the expected number of users per step). Returns ``closure()``'s loss, if given.

        ``empty_batch=True`` is the step of a Poisson batch with no units, for models that
        cannot run forward on an empty batch (e.g. ``nn.LSTM``): no backward is needed, the
        clipped sum is zero and the step releases ``b ⊙ σz/B̄ + a`` (still a private step:
        it is accounted and updates the AdaCliP moments). Models that accept a zero-length
        batch can simply run forward/backward on it and call ``step()``.
        """
        if self._physical_batches is not None and not self._physical_batches.releases:
            # inside a BatchMemoryManager, on a physical batch that is not the last of its
            # logical batch: the step only adds the batch to the pending sum
            if empty_batch:
                raise InvalidGradientError(
                    "step(empty_batch=True) on a physical batch that is not the last of its logical batch: "
                    "only a whole logical batch can be empty"
                )
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            self.accumulate(user_ids=user_ids)
            return loss
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_unchanged()
        t = self._steps
        hp = self.noise_schedule.at(t)
        strategy = self._strategy_at(t)
        # (σ_g, σ_aux) from the accounted σ: an invalid σ (the quantile rule's σ ≥ 2σ_b) raises
        # here, before anything changes
        self._noise_multipliers(strategy, hp.noise_multiplier)
        if self._stream is not None:
            self._stream.check_sampler(t)
        # A fused engine clips and releases a fresh batch itself; an empty batch, a pending
        # sum (accumulate, add_unit_gradients) or correlated noise takes the core path, as does
        # every other engine.
        fused = (
            self._engine.fuses_release and not empty_batch and self._accumulated is None and self._stream is None
        )
        with torch.no_grad():
            if empty_batch:
                summed = self._empty_sum(strategy)
            elif fused:
                inputs = self._engine_inputs()
                pending = self._engine.clip(inputs, strategy, user_ids)
            else:
                summed = self._pending_sum(strategy, user_ids, require=self._accumulated is None)
        self._check_budget(hp.noise_multiplier)
        logged = self._write_ahead(hp.noise_multiplier)
        if self.distributed:
            from adaclip_torch.distributed import require_process_group

            require_process_group()
        rng_state = None if self._noise.secure_mode else self._noise.get_state()
        old_grads = [p.grad for p in self.params]
        # From the moment a value computed from this step's noise may have left (the noisy
        # all-reduce sent it to other ranks, or the wrapped optimizer — and its hooks — saw it),
        # the step is released: it is accounted, the state moves on, and the generator never
        # rewinds, even if something raises afterwards. A failure before that undoes everything.
        released = self.distributed
        new_state: ClipState | None = None
        try:
            with torch.no_grad():
                if fused:
                    noisy_grad, new_state = self._engine.release(
                        inputs,
                        strategy,
                        pending,
                        hp.noise_multiplier,
                        noise=self._noise,
                        expected_batch_size=self.expected_batch_size,
                    )
                else:
                    noisy_grad, new_state = self._release(strategy, summed, hp.noise_multiplier)
            for p, g in zip(self.params, noisy_grad, strict=True):
                p.grad = self._as_grad(g, p)
            released = True
            self.original_optimizer.step()
        except BaseException:
            if released:
                self._commit(new_state, hp.noise_multiplier, logged=logged)
            else:
                for p, g in zip(self.params, old_grads, strict=True):
                    p.grad = g
                if rng_state is not None:
                    self._noise.set_state(rng_state)
                if self._stream is not None:
                    self._stream.discard()
            raise
        self._commit(new_state, hp.noise_multiplier, logged=logged)
        if self.average is not None:
            self.average.update()
        return loss

    def accumulate(self, *, user_ids: Tensor | None = None) -> None:
        """Virtual step: clip and sum this physical batch into a buffer, release nothing.

        The next :meth:`step` adds its own batch (if any) and releases the whole logical
        batch once, with one noise draw: ``Σ`` over all physical batches of the clipped
        units, then ``+σz``, ``/B̄``. Set ``expected_batch_size`` to the *logical* batch size.
        At user level each user's examples must all be in one physical batch: a user id met
        again in a later physical batch of the same logical batch, or user-level and
        example-level physical batches mixed, raise :class:`InvalidGradientError` before
        anything changes (the user would count as two units in one release).
        Clears ``p.grad_sample`` and ``p.grad`` afterwards (it is :meth:`zero_grad`).
        :class:`adaclip_torch.BatchMemoryManager` drives it for you (Opacus's loop).
        """
        self._check_unchanged()
        units = self._check_pending_units(user_ids)
        strategy = self._strategy_at(self._steps)
        self._noise_multipliers(strategy, self.noise_schedule.at(self._steps).noise_multiplier)
        with torch.no_grad():
            summed = self._pending_sum(strategy, user_ids, require=True, check_units=False)
        self._accumulated = summed
        self._pending_units = units
        self._clear_per_example_grads()
        for p in self.params:
            p.grad = None

    def add_unit_gradients(self, per_unit_grads: Sequence[Tensor]) -> None:
        """Add units whose gradients are given to the next release (white-box auditing).

        ``per_unit_grads``: one ``(n, *p.shape)`` tensor per privatised parameter, in
        :attr:`params` order, ``n ≥ 1`` units. They are clipped with the current state, exactly
        as the batch's units are (same centre, scale, clip rule, auxiliary count), and summed
        into the pending buffer that the next :meth:`step` releases with the batch, under one
        noise draw. The next ``step()`` needs no backward if only such units are pending.

        These units are *data*: they are privatised by the mechanism like any other and their
        influence on the release is bounded by the clipping. This is how
        :class:`adaclip_torch.audit.GradientCanaryAuditor` inserts canaries whose gradient the
        auditor chooses. ``expected_batch_size`` and ``sample_rate`` are not changed: in an audit
        the canaries are a few extra units of a large data set.

        Raises :class:`InvalidGradientError` for gradients of the wrong number, shape, or an
        empty batch (nothing changes then). A unit with NaN/inf entries follows ``nonfinite``
        (``"zero"``: it contributes nothing; ``"raise"``: refused, nothing changes).
        """
        grads = self._given_grads(per_unit_grads, argument="per_unit_grads", what="unit", check_finite=False)
        self._check_unchanged()
        strategy = self._strategy_at(self._steps)
        self._noise_multipliers(strategy, self.noise_schedule.at(self._steps).noise_multiplier)
        with torch.no_grad():
            summed = self._engine.clipped_sum(self._engine_inputs(), strategy, grads)
            if self._accumulated is not None:
                summed = [a + s for a, s in zip(self._accumulated, summed, strict=True)]
        self._accumulated = summed

    def centre_and_scale(self) -> tuple[list[Tensor] | None, list[Tensor]]:
        """The centre ``a`` and scale ``b`` the next :meth:`step` clips with, one entry per
        privatised parameter (``a`` is ``None`` for strategies without a centre; a ``b`` entry
        is a tensor of the parameter's shape, or a 0-d tensor for a per-tensor scale).

        A function of the state, i.e. of earlier releases only: public, like the released
        gradients. A unit ``g`` is clipped as ``w = (g − a)/b`` and the step releases
        ``a + b ⊙ (Σ w̄ + σz)/B̄``; auditors and diagnostics read it.
        """
        self._check_unchanged()
        centre, scale = self._transformed(self._strategy_at(self._steps))

        def as_tensor(x: Any, p: Tensor) -> Tensor:
            return x.detach().clone() if isinstance(x, Tensor) else torch.tensor(float(x), dtype=self._dtype, device=p.device)

        a = None if centre is None else [as_tensor(x, p) for x, p in zip(centre, self.params, strict=True)]
        return a, [as_tensor(x, p) for x, p in zip(scale, self.params, strict=True)]

    def use_public_statistics(self, per_example_grads: Sequence[Tensor], *, weight: float = 1.0) -> None:
        """Shape the clipping statistics with *public* per-example gradients (no privacy cost).

        ``per_example_grads``: one ``(n, *p.shape)`` tensor per privatised parameter, in
        :attr:`params` order (``n >= 2`` examples of public data, e.g. computed by hand, or
        read from ``p.grad_sample`` after a backward pass on a public batch with
        ``per_sample_mode="materialise"``: the default ``"auto"`` forms none for
        ``nn.Linear``/``nn.Embedding`` layers). With ``v_pub`` their per-coordinate
        variance ``Σ_i (g_i − ḡ)²/(n − 1)``, the variance EMA becomes

        .. math::  v' = (1 − w)\\,v + w\\,\\mathrm{pool}(v_{pub}),

        clamped to ``[std_min², std_max²]`` (``w = weight ∈ (0, 1]``; ``w = 1`` replaces the
        statistics, e.g. before the first step; less refreshes them during training). The
        centre is left alone. See :meth:`adaclip.strategies.AdaptiveClipping.with_public_statistics`
        (with the coupled scale the public spread also sets the clip level: prefer
        ``scale="separated"``, which takes only the shape; ``freeze_statistics=True`` then
        keeps it).

        Raises :class:`InvalidHyperparameterError` for a strategy without statistics (only
        :class:`~adaclip.strategies.AdaptiveClipping` has them), a bad ``weight`` or fewer than
        2 examples, :class:`InvalidGradientError` for gradients of the wrong number, shape or
        with NaN/inf entries, or between :meth:`accumulate` and :meth:`step` (the pending sum
        was clipped with the current statistics); nothing changes then.
        """
        public = getattr(self.strategy, "with_public_statistics", None)
        if public is None:
            raise InvalidHyperparameterError(
                f"use_public_statistics needs a strategy with clipping statistics (AdaptiveClipping), "
                f"not {type(self.strategy).__name__}"
            )
        if self._accumulated is not None:
            raise InvalidGradientError(
                "use_public_statistics() after accumulate() and before step(): the pending clipped sum was "
                "clipped with the current statistics and must be released with them; call step() first"
            )
        grads = self._given_grads(per_example_grads, argument="per_example_grads", what="public per-example")
        with torch.no_grad():
            new_state = public(self._clip_state, grads, weight=weight)
        self._clip_state = new_state
        self._transform_cache = None

    def _given_grads(self, grads: Any, *, argument: str, what: str, check_finite: bool = True) -> list[Tensor]:
        """Validate gradients handed in by the caller (one ``(n, *p.shape)`` tensor per privatised
        parameter) and return them detached, in the statistics dtype, on the parameters' devices.
        Raises :class:`InvalidGradientError` naming ``argument``; nothing is changed."""
        if isinstance(grads, Tensor) or not isinstance(grads, (list, tuple)):
            raise InvalidGradientError(
                f"{argument} must be a list with one (n, *p.shape) tensor per privatised parameter, "
                f"got {type(grads).__name__}"
            )
        for name, g in zip(self.param_names, grads):
            if not isinstance(g, Tensor):
                raise InvalidGradientError(f"{what} gradient of {name!r} is not a tensor: {type(g).__name__}")
        check_per_example_grads(list(grads), self._shapes, names=self.param_names, check_finite=check_finite)
        return [g.detach().to(dtype=self._dtype, device=p.device) for g, p in zip(grads, self.params, strict=True)]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear ``p.grad`` (wrapped optimizer), the per-example gradients and anything pending.

        Pending means: the clipped sum gathered by :meth:`accumulate` or
        :meth:`add_unit_gradients` and not yet released. It is dropped (:meth:`discard_pending`),
        with a :class:`UserWarning` when there was such a sum: a logical batch that is abandoned
        (an error, an out-of-memory retry) must not be released with the next one, where its
        examples would be counted a second time in one noisy sum while the step is accounted once.
        In a gradient-accumulation loop call ``zero_grad()`` only after :meth:`step`, never between
        :meth:`accumulate` calls of one logical batch (``accumulate()`` already clears what the next
        backward needs cleared). Inside :class:`adaclip_torch.BatchMemoryManager`'s loop it keeps the
        pending sum of the logical batch in progress (Opacus's loop calls it on every physical batch).
        """
        if self._physical_batches is not None:
            # a BatchMemoryManager is driving the steps: the pending sum belongs to the logical
            # batch in progress (the manager itself drops a logical batch that was not released)
            self._clear_per_example_grads()
            self.original_optimizer.zero_grad(set_to_none=set_to_none)
            return
        if self.discard_pending():
            warnings.warn(
                "zero_grad() discarded the clipped sum gathered by accumulate() since the last "
                "step(): those examples will not be released. In a gradient-accumulation loop call "
                "zero_grad() after step() only; call discard_pending() to drop a batch on purpose "
                "without this warning",
                UserWarning,
                stacklevel=2,
            )
        self.original_optimizer.zero_grad(set_to_none=set_to_none)

    def averaged(self) -> Any:
        """Context manager: the model holds the averaged parameters inside the ``with`` block (to
        evaluate or save them) and its live ones again after it, also on an exception. Needs
        ``averaging=`` (or ``make_private(..., averaging=...)``)."""
        if self.average is None:
            raise InvalidHyperparameterError(
                "this optimizer keeps no parameter average: build it with averaging= (e.g. "
                "make_private(..., averaging='ema'))"
            )
        return self.average.averaged()

    def discard_pending(self) -> bool:
        """Drop everything gathered for the next release and not yet released: the clipped sum of
        :meth:`accumulate` / :meth:`add_unit_gradients` and the per-example gradients of the last
        backward pass. Nothing is released or accounted, the statistics and the noise generator are
        untouched, and :meth:`state_dict` works again. Use it to abandon a logical batch (e.g.
        before retrying after an out-of-memory error). Returns whether a pending clipped sum was
        dropped."""
        had_sum = self._accumulated is not None
        self._accumulated = None
        self._pending_units = None
        self._clear_per_example_grads()
        return had_sum

    # ------------------------------------------------------------------ internals

    def _make_stream(self, noise_mechanism: Any, bands: Any, sampler: Any, noise_schedule: Any) -> NoiseStream | None:
        """The correlated-noise stream (``None``: independent noise), with its constraints."""
        mechanism = make_noise_mechanism(noise_mechanism, bands)
        if mechanism is None:
            if sampler is not None:
                raise InvalidHyperparameterError("sampler= is for noise_mechanism='banded' only")
            return None
        why = (
            "a noise_schedule (the factorisation needs one σ for every step)" if noise_schedule is not None else
            "compile_release=True" if self.compile_release else None
        )
        if why is not None:
            raise InvalidHyperparameterError(f"noise_mechanism='banded' does not support {why} yet")
        return NoiseStream(mechanism, sample_rate=self.sample_rate, sampler=sampler)

    @property
    def noise_mechanism(self) -> str:
        """``"independent"`` or ``"banded"``."""
        return "independent" if self._stream is None else "banded"

    @property
    def noise_coefficients(self) -> tuple[float, ...] | None:
        """The banded noise's coefficients ``c_0 … c_{b−1}`` (public: they are hyperparameters);
        ``None`` with independent noise."""
        return None if self._stream is None else tuple(self._stream.mechanism.coefficients)

    @property
    def noise_stream_start(self) -> int | None:
        """The step at which the banded noise stream (and its accounting cycle) last (re)started:
        0, or the step of a restore without buffers; ``None`` with independent noise."""
        return None if self._stream is None else int(self._stream.cycle_start)

    @property
    def accounted_sample_rate(self) -> float | None:
        """The rate the accountant records: ``q``, or ``p = b·q`` with banded noise."""
        return self.sample_rate if self._stream is None else self._stream.accounted_rate

    def _records_now(self) -> bool:
        """Whether this step is accounted (always, except inside a cycle of banded noise)."""
        return self._stream is None or self._stream.records_at(self._steps)

    @staticmethod
    def _make_schedule(noise_multiplier: Any, noise_schedule: Any) -> Any:
        if noise_schedule is None:
            if noise_multiplier is None:
                raise InvalidHyperparameterError("give noise_multiplier or noise_schedule")
            sigma, _ = _strategies.validate_mechanism(noise_multiplier, 1.0)
            return _schedules.ConstantSchedule(sigma)
        if noise_multiplier is not None:
            raise InvalidHyperparameterError("give noise_multiplier or noise_schedule, not both")
        if not isinstance(noise_schedule, _schedules.Schedule):
            raise InvalidHyperparameterError(f"noise_schedule must have .at(step), got {noise_schedule!r}")
        return noise_schedule

    def _strategy_at(self, step: int) -> Any:
        """The strategy with step ``t``'s clip norm applied; checks per-tensor lengths
        (``layer_scales``, ``group_max_grad_norms``) against the parameters (on the current
        state: a strategy such as QuantileClipping reads its clip norm from it)."""
        strategy = _schedules.apply_to_strategy(self.strategy, self.noise_schedule.at(step))
        if not isinstance(strategy, _strategies.AdaptiveClipping):
            strategy.transform(self._clip_state, len(self.params))
            strategy.clip_groups(len(self.params))
        return strategy

    def _noise_multipliers(self, strategy: Any, noise_multiplier: float) -> tuple[Any, Any]:
        """``(σ_g, σ_aux)`` for a step accounted at ``σ = noise_multiplier``
        (:meth:`adaclip.strategies.Strategy.noise_multipliers`; ``(σ, 0)`` for a strategy that
        predates auxiliary releases). Raises :class:`InvalidHyperparameterError` for a σ the
        strategy cannot split (the quantile rule needs ``σ < 2σ_b``), changing nothing."""
        split = getattr(strategy, "noise_multipliers", None)
        if split is None:
            return noise_multiplier, 0.0
        return split(noise_multiplier, self.expected_batch_size)

    def _check_unchanged(self) -> None:
        """Refuse a step that would not be private, before anything changes: a parameter the
        wrapped optimizer could step on its raw gradient (unfrozen after wrapping, or added to
        it with ``add_param_group``), a privatised parameter frozen, re-typed or moved since
        wrapping, or a module that mixes examples (also one added after wrapping)."""
        _validation.check_model(self.model, when="the model cannot be trained privately: ")
        ours = {id(p) for p in self.params}
        for group in self.original_optimizer.param_groups:
            for p in group["params"]:
                if id(p) in ours or not (p.requires_grad or p.grad is not None):
                    continue
                names = {id(q): n for n, q in self.model.named_parameters()}
                name = names.get(id(p), f"<not in the model, shape {tuple(p.shape)}>")
                raise InvalidHyperparameterError(
                    f"parameter {name!r} would be stepped by the wrapped optimizer on its raw, un-noised "
                    "gradient: it was frozen when the optimizer was wrapped and has been unfrozen since, "
                    "or it was added to the wrapped optimizer afterwards (add_param_group). The privacy "
                    "transform covers the parameters trainable at wrapping time: after unfreezing, wrap "
                    "the optimizer again (a new DPOptimizer over the new set of parameters)"
                )
        for name, p, (dtype, device) in zip(self.param_names, self.params, self._layouts, strict=True):
            if not p.requires_grad:
                raise InvalidHyperparameterError(
                    f"parameter {name!r} was frozen after wrapping (requires_grad=False): the wrapped "
                    "optimizer would step it on noise alone. Wrap the optimizer again over the "
                    "parameters that are still trainable"
                )
            if p.dtype != dtype or p.device != device:
                raise InvalidHyperparameterError(
                    f"parameter {name!r} changed from {dtype} on {device} to {p.dtype} on {p.device} "
                    "after wrapping (model.double(), model.to(...)?): the privacy statistics and the "
                    "wrapped optimizer's state still have the old layout. Convert the model first, then "
                    "build and wrap the optimizer"
                )

    def _as_grad(self, g: Tensor, p: Tensor) -> Tensor:
        """The released gradient ``g`` (full size) as ``p.grad``: in ``p``'s dtype and device, or
        with FSDP2 this rank's shard of it as a DTensor laid out like ``p``
        (:func:`adaclip_torch.distributed.shard_of`), which replaces FSDP's raw gradient."""
        if self._fsdp:
            from adaclip_torch.distributed import shard_of

            return shard_of(g, p)
        return g.to(dtype=p.dtype, device=p.device)

    def _engine_inputs(self) -> StepInputs:
        """What the engine reads at this call (:class:`~adaclip_torch.engines.StepInputs`): the
        current state and its cached transform, ``nonfinite`` and the attached hooks."""
        return StepInputs(self._clip_state, self._transformed, self.nonfinite, self.grad_sample_hooks)

    def _pending_sum(
        self, strategy: Any, user_ids: Tensor | None, *, require: bool, check_units: bool = True
    ) -> list[Tensor]:
        """``Σ`` clipped units of this batch plus the accumulated buffer (new tensors), entry by
        entry: the K per-tensor sums, then the auxiliary sums. With a pending sum, the batch's
        units are checked against it first (:meth:`_check_pending_units`)."""
        inputs = self._engine_inputs()
        sources = self._engine.unit_sources(inputs, user_ids, require=require)
        if sources is None:
            return list(self._accumulated)  # type: ignore[arg-type]
        if check_units and self._accumulated is not None:
            self._check_pending_units(user_ids)
        summed = self._engine.clipped_sum(inputs, strategy, sources)
        if self._accumulated is not None:
            summed = [a + s for a, s in zip(self._accumulated, summed, strict=True)]
        return summed

    def _empty_sum(self, strategy: Any) -> list[Tensor]:
        """The clipped sum of a batch with no units (plus any accumulated buffer): zeros, and
        the auxiliary sums of no units (0-d zeros), from the core."""
        if self._engine.collect(self._engine_inputs()) is not None:
            raise InvalidGradientError("empty_batch=True but the parameters have per-example gradients")
        empty = [torch.zeros((0, *p.shape), dtype=self._dtype, device=p.device) for p in self.params]
        summed = _strategies.clip_and_sum(strategy, self._clip_state, empty, transformed=self._transformed(strategy))
        if self._accumulated is not None:
            summed = [a + s for a, s in zip(self._accumulated, summed, strict=True)]
        return summed

    def _check_pending_units(self, user_ids: Tensor | None) -> str | frozenset[int]:
        """The units of this physical batch (``"examples"``, or its user ids), checked against
        those already in the pending sum: a user in two physical batches of one logical batch,
        or user-level and example-level batches mixed, would be two units of one release, so it
        raises :class:`InvalidGradientError` (nothing changes)."""
        if user_ids is None:
            units: str | frozenset[int] = "examples"
        else:
            units = frozenset(int(u) for u in torch.as_tensor(user_ids).reshape(-1).unique().tolist())
        pending = self._pending_units
        if pending is None:
            return units
        if isinstance(pending, str) or isinstance(units, str):
            if pending != units:
                raise InvalidGradientError(
                    "this physical batch is "
                    + ("user-level (user_ids given)" if pending == "examples" else "example-level (no user_ids)")
                    + " but the pending sum of its logical batch was gathered "
                    + ("per example" if pending == "examples" else "per user")
                    + ": one logical batch must use one kind of unit; nothing was changed"
                )
            return units
        again = pending & units
        if again:
            raise InvalidGradientError(
                f"user(s) {sorted(again)[:5]} already contributed to an earlier physical batch of this logical "
                "batch: each user's examples must all be in one physical batch (otherwise the user is two "
                "units of one release); adaclip_torch.BatchMemoryManager splits at user boundaries. Nothing "
                "was changed"
            )
        return pending | units

    def _check_budget(self, noise_multiplier: float) -> None:
        if self.accountant is None or not self._records_now():
            return
        rate = self.accounted_sample_rate
        if self.accountant.would_exceed(noise_multiplier=noise_multiplier, sample_rate=rate):
            raise BudgetExceededError(
                f"step {self._steps} (noise_multiplier={noise_multiplier}, sample_rate={rate}) "
                "would exceed the accountant's privacy budget; nothing was changed"
            )

    def _write_ahead(self, noise_multiplier: float) -> bool:
        """With an accountant that keeps a crash-safe ledger (``Accountant(ledger=...)``), append
        this step's record and ``fsync`` it *before* anything computed from the step's noise can
        leave (the noisy all-reduce, ``p.grad``, the wrapped optimizer): a crash at any later
        point can then only over-count. Returns whether it wrote (``step(logged=True)`` then
        records the step in memory without writing it again). A step that fails before its
        release leaves the ledger one step ahead of memory — conservative by design."""
        if self.accountant is None or getattr(self.accountant, "ledger", None) is None or not self._records_now():
            return False
        self.accountant.write_ahead(noise_multiplier=noise_multiplier, sample_rate=self.accounted_sample_rate)
        return True

    def _release(self, strategy: Any, summed: list[Tensor], noise_multiplier: float) -> tuple[list[Tensor], ClipState]:
        """Noise once, rescale, update the state (locally, or across ranks).

        ``summed`` holds the K per-tensor sums then the auxiliary sums. Locally one standard
        normal is drawn per entry (a 0-d draw per auxiliary sum) and
        :func:`adaclip.strategies.release` multiplies them by ``(σ_g, σ_aux)``. With
        ``distributed=True`` rank 0 adds ``σ_g·z`` to the tensors and ``σ_aux·z`` to the
        auxiliary entries before the all-reduce, and the release adds nothing (``noise=None``)."""
        extra: dict[str, Any] = {}
        num = _strategies.num_tensors_of(strategy, summed)
        if self.distributed:
            from adaclip_torch.distributed import noisy_all_reduce

            sigma_grad, sigma_aux = self._noise_multipliers(strategy, noise_multiplier)
            multipliers = [sigma_grad] * num + [sigma_aux] * (len(summed) - num)
            correlate = None
            if self._stream is not None and noise_multiplier > 0:
                # banded: rank 0 (the only one that draws) correlates its draws with its
                # buffers; the other ranks only move their streams' position (same v_t)
                extra["noise_variance"] = self._stream.variance()
                stream = self._stream
                correlate = lambda z: stream.correlate(z[:num]) + list(z[num:])  # noqa: E731
                self._stream.advance()  # replaced by correlate's pending state on rank 0
            summed = noisy_all_reduce(summed, self._noise, multipliers, correlate=correlate)
            noise = None
        else:
            noise = self._noise.standard_normal(summed) if noise_multiplier > 0 else None
        if noise is not None and self._stream is not None:
            # correlated noise on the gradient's entries; the auxiliary sums keep fresh draws
            noise = self._stream.correlate(noise[:num]) + list(noise[num:])
            extra["noise_variance"] = self._stream.variance()
        transformed = self._transformed(strategy)
        return self._maybe_compiled(_strategies.release)(
            strategy,
            self._clip_state,
            summed,
            noise,
            noise_multiplier=noise_multiplier,
            expected_batch_size=self.expected_batch_size,
            transformed=transformed,
            **extra,
        )

    def _maybe_compiled(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn``, or with ``compile_release=True`` its ``torch.compile`` (made once)."""
        if not self.compile_release:
            return fn
        compiled = self._compiled.get(fn)
        if compiled is None:
            traced = torch.compile(fn)

            def compiled(*args: Any, **kwargs: Any) -> Any:
                with _quiet_dynamo():  # only around compiled calls: the eager path stays untouched
                    return traced(*args, **kwargs)

            self._compiled[fn] = compiled
        return compiled

    def _transformed(self, strategy: Any) -> tuple[Any, Any]:
        """``strategy.transform`` of the current state (the centre ``a`` and scale ``b``),
        computed once per state: the clipping pass and the release of a step share it."""
        cached = self._transform_cache
        if cached is None or cached[0] is not self._clip_state or cached[1] != strategy:
            value = self._maybe_compiled(_transform_of)(strategy, self._clip_state, len(self.params))
            self._transform_cache = cached = (self._clip_state, strategy, value)
        return cached[2]

    def _commit(self, new_state: ClipState | None, noise_multiplier: float, *, logged: bool = False) -> None:
        """The step is released: account it, move the state on (``None``: the release failed
        after the noise was sent to other ranks — the statistics stay, the step still counts)."""
        if new_state is not None:
            self._clip_state = new_state
            self._transform_cache = None  # it holds the old state's scale: let it go
        records = self._records_now()
        if self._stream is not None:
            self._stream.commit()
        self._steps += 1
        self._accumulated = None
        self._pending_units = None
        self._clear_per_example_grads()
        if self.accountant is not None and records:
            kwargs = {"logged": True} if logged else {}
            self.accountant.step(noise_multiplier=noise_multiplier, sample_rate=self.accounted_sample_rate, **kwargs)

    def _clear_per_example_grads(self) -> None:
        if self.grad_sample_hooks is not None and hasattr(self.grad_sample_hooks, "clear"):
            self.grad_sample_hooks.clear()
        for p in self.model.parameters():
            if getattr(p, "grad_sample", None) is not None:
                p.grad_sample = None

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """Wrapped optimizer state + strategy state + step count + noise mode + accountant.

        The strategy state is its :class:`~adaclip.strategies.ClipState`: ``step``, ``mean``,
        ``std`` and the options' ``extra`` dict (lists of per-tensor tensors or ``None``, and
        0-d tensors: variance accumulators, delayed-statistics windows, the Kalman variance,
        the quantile rule's ``C_t``), all copied.

        What is secret in it: nothing is un-noised — the AdaCliP statistics (and every ``extra``
        entry) are functions of released values, and the accountant holds hyperparameters. With an explicit
        ``seed`` the noise generator's state is saved too, and it predicts the next noise:
        keep such a checkpoint as secret as the seed. Without a seed (the default) or in
        secure mode no generator state is saved. Refused between :meth:`accumulate` and
        :meth:`step` (the pending clipped sum is not noised yet and must never be saved).
        """
        if self._accumulated is not None:
            raise InvalidGradientError(
                "state_dict() after accumulate() and before step(): the accumulated clipped sum is "
                "not noised yet and must not be saved; call step() first (or discard_pending() to "
                "drop it)"
            )
        state = self._clip_state
        return {
            "optimizer": self.original_optimizer.state_dict(),
            "clip_state": {
                "step": int(state.step),
                "mean": None if state.mean is None else [m.detach().clone() for m in state.mean],
                "std": None if state.std is None else [s.detach().clone() for s in state.std],
                "extra": _copy_extra(state.extra),
            },
            "steps": self._steps,
            "noise": self._noise.state_dict(),
            "accountant": None if self.accountant is None else self.accountant.state_dict(),
            **(
                {}
                if self._stream is None
                else {"noise_stream": self._stream.state_dict(with_buffers=self._noise.mode == "seeded")}
            ),
            **({} if self.average is None else {"averaging": self.average.state_dict()}),
        }

    _STATE_KEYS = ("optimizer", "clip_state", "steps", "noise", "accountant")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Restore what :meth:`state_dict` saved; everything is checked before anything changes.

        Refused (:class:`InvalidHyperparameterError`): missing keys; AdaCliP statistics that are
        not finite, not positive or outside ``[std_min, std_max]`` (beyond rounding), of the
        wrong shape; option state (``clip_state["extra"]``) whose keys differ from the
        strategy's, with entries of the wrong shape, ``None`` where a tensor belongs (or the
        reverse) or not finite, a clip norm ``<= 0``, a window count that is not a whole number
        in ``[0, update_every)``, a Kalman variance below 0 other than the ``-1`` of "no
        observation yet"; negative step counts; a pending un-noised sum. The noise generator is
        re-seeded from the OS (default), restored with a
        :class:`~adaclip.errors.NoiseReplayWarning` (explicit ``seed``), or left alone (secure mode).
        Any pending :meth:`accumulate` is discarded.

        The accountant never forgets a release: if it has recorded more steps than the
        checkpoint's (restoring an earlier checkpoint in the same process, e.g. to rewind after
        a divergence), it keeps its history and a ``UserWarning`` says so; the steps after the
        checkpoint were released and still count. In a fresh process it loads the checkpoint's.
        """
        if not isinstance(state_dict, dict):
            raise InvalidHyperparameterError(f"state_dict must be a dict, got {type(state_dict).__name__}")
        missing = [k for k in self._STATE_KEYS if k not in state_dict]
        if missing:
            raise InvalidHyperparameterError(
                f"state_dict is missing {missing}: it was not made by DPOptimizer.state_dict()"
            )
        if state_dict.get("accumulated") is not None:
            raise InvalidHyperparameterError(
                "state_dict holds an accumulated clipped sum: un-noised sums are never restored"
            )
        clip_state = self._clip_state_from(state_dict["clip_state"])
        if ("averaging" in state_dict) != (self.average is not None):
            raise InvalidHyperparameterError(
                "state_dict and this optimizer disagree on whether a parameter average is kept"
            )
        if "noise_stream" in state_dict and self._stream is None:
            raise InvalidHyperparameterError(
                "state_dict has a correlated-noise stream but this optimizer uses independent noise"
            )
        if (state_dict["accountant"] is None) != (self.accountant is None):
            raise InvalidHyperparameterError(
                "state_dict and this optimizer disagree on whether an accountant is attached"
            )
        steps = _count("state_dict['steps']", state_dict["steps"])
        self._noise.check_state_dict(state_dict["noise"])
        # correlated noise: the buffers come back only with the generator (seeded mode);
        # otherwise the stream restarts with a new accounting cycle
        stream = None if self._stream is None else self._stream.parse_state(
            state_dict.get("noise_stream") if self._noise.mode == "seeded" else None, steps=steps, shapes=self._shapes
        )
        # The wrapped optimizer and the accountant validate their own parts; snapshot them so
        # that a refusal by either rolls both back. The noise source is loaded last (it cannot
        # fail after its check; in seeded mode it warns).
        snapshot = (
            copy.deepcopy(self.original_optimizer.state_dict()),
            None if self.accountant is None else self.accountant.state_dict(),
            None if self.average is None else self.average.state_dict(),
        )
        keep_accountant = self._accountant_is_ahead_of(state_dict["accountant"])
        try:
            self.original_optimizer.load_state_dict(state_dict["optimizer"])
            if self.accountant is not None and not keep_accountant:
                self.accountant.load_state_dict(state_dict["accountant"])
            if self.average is not None:
                self.average.load_state_dict(state_dict["averaging"])
        except BaseException:
            self.original_optimizer.load_state_dict(snapshot[0])
            if self.accountant is not None:
                self.accountant.load_state_dict(snapshot[1])
            if self.average is not None:
                self.average.load_state_dict(snapshot[2])
            raise
        if self._stream is not None:
            self._stream.apply_state(stream)
        self._noise.load_state_dict(state_dict["noise"])
        self._clip_state = clip_state
        self._transform_cache = None
        self._steps = steps
        self._accumulated = None
        self._pending_units = None
        if keep_accountant:
            warnings.warn(
                f"kept the accountant's history ({self.accountant.steps} steps) instead of rolling it "
                "back to the checkpoint's: the releases made since that checkpoint were spent and still "
                "count. (Restoring in a fresh process loads the checkpoint's accountant.)",
                UserWarning,
                stacklevel=2,
            )

    def _accountant_is_ahead_of(self, saved: Any) -> bool:
        """Whether the attached accountant has recorded more steps than the checkpoint's (an
        in-process rewind): it is then kept, as an accountant never forgets a release."""
        if self.accountant is None or not hasattr(self.accountant, "steps"):
            return False
        probe = copy.deepcopy(self.accountant)
        probe.load_state_dict(saved)  # validates it (raises before anything changes)
        return int(self.accountant.steps) > int(probe.steps)

    def _like_param(self, x: Any, k: int, what: str) -> Tensor:
        return self._like(x, self._shapes[k], self.params[k].device, f"{what} for {self.param_names[k]!r}")

    def _like(self, x: Any, shape: tuple[int, ...], device: torch.device, what: str) -> Tensor:
        """``x`` as a finite statistics-dtype tensor of ``shape`` on ``device`` (a copy)."""
        try:
            t = torch.as_tensor(x)
        except (TypeError, ValueError, RuntimeError):
            raise InvalidHyperparameterError(f"state_dict {what} is not a tensor: {type(x).__name__}") from None
        if tuple(t.shape) != tuple(shape):
            raise InvalidHyperparameterError(f"state_dict {what} has shape {tuple(t.shape)}, expected {tuple(shape)}")
        if not (t.dtype.is_floating_point or t.dtype in (torch.int32, torch.int64)):
            raise InvalidHyperparameterError(f"state_dict {what} has dtype {t.dtype}, expected a real dtype")
        t = t.to(dtype=self._dtype, device=device).clone()
        if not bool(torch.isfinite(t).all()):
            raise InvalidHyperparameterError(f"state_dict {what} contains NaN or inf")
        return t

    def _extra_from(self, saved: Any) -> dict[str, Any] | None:
        """The option state ``clip_state["extra"]`` of a checkpoint, checked against this
        strategy's (the keys, and per entry ``None``-ness, shape and range) and copied."""
        template = self._clip_state.extra
        if template is None:
            if saved:
                raise InvalidHyperparameterError(
                    f"state_dict clip_state['extra'] has option state {sorted(saved) if isinstance(saved, dict) else saved!r}, "
                    f"but {type(self.strategy).__name__} keeps none: the checkpoint is of another strategy"
                )
            return None
        if not isinstance(saved, dict):
            raise InvalidHyperparameterError(
                f"state_dict clip_state['extra'] must be a dict with {sorted(template)} (the option state of "
                f"{type(self.strategy).__name__}), got {type(saved).__name__}: the checkpoint is of another "
                "strategy or options"
            )
        if set(saved) != set(template):
            missing, unexpected = sorted(set(template) - set(saved)), sorted(set(saved) - set(template))
            raise InvalidHyperparameterError(
                f"state_dict clip_state['extra'] does not match the strategy's options: missing {missing}, "
                f"unexpected {unexpected}"
            )
        out: dict[str, Any] = {}
        for key, like in template.items():
            value, what = saved[key], f"clip_state['extra'][{key!r}]"
            if isinstance(like, list):
                if not isinstance(value, (list, tuple)) or len(value) != len(like):
                    raise InvalidHyperparameterError(
                        f"state_dict {what} must be a list of {len(like)} entries (one per tensor), got {value!r}"[:300]
                    )
                entries: list[Tensor | None] = []
                for k, (v, ref) in enumerate(zip(value, like, strict=True)):
                    label = f"{what} for {self.param_names[k]!r}"
                    if (v is None) != (ref is None):
                        raise InvalidHyperparameterError(
                            f"state_dict {label} is {'None' if v is None else 'a tensor'}, expected "
                            f"{'None (the entry does not apply to this tensor)' if ref is None else 'a tensor'}"
                        )
                    entries.append(None if v is None else self._like(v, tuple(ref.shape), ref.device, label))
                out[key] = entries
                checked = [e for e in entries if e is not None]
            else:
                out[key] = self._like(value, tuple(like.shape), like.device, what)
                checked = [out[key]]
            _check_extra_values(key, checked, what, getattr(self.strategy, "update_every", None))
        return out

    def _clip_state_from(self, saved: Any) -> ClipState:
        if not isinstance(saved, dict) or "step" not in saved:
            raise InvalidHyperparameterError("state_dict['clip_state'] must be a dict with 'step', 'mean' and 'std'")

        def tensors(key: str) -> list[Tensor] | None:
            values = saved.get(key)
            if (values is None) != (getattr(self._clip_state, key) is None):
                raise InvalidHyperparameterError(f"state_dict clip_state[{key!r}] does not match the strategy")
            if values is None:
                return None
            if len(values) != len(self.params):
                raise InvalidHyperparameterError(
                    f"state_dict clip_state[{key!r}] has {len(values)} tensors, expected {len(self.params)}"
                )
            return [self._like_param(v, k, f"clip_state[{key!r}]") for k, v in enumerate(values)]

        std = tensors("std")
        if std is not None:
            # s always stays in [std_min, std_max]; allow the rounding of the statistics dtype
            slack = 16 * _transform.unit_roundoff(self._dtype)
            low, high = self.strategy.std_min * (1 - slack), self.strategy.std_max * (1 + slack)
            for k, v in enumerate(std):
                if float(v.min()) < low or float(v.max()) > high:
                    raise InvalidHyperparameterError(
                        f"state_dict clip_state['std'] for {self.param_names[k]!r} is outside "
                        f"[std_min, std_max] = [{self.strategy.std_min}, {self.strategy.std_max}] "
                        f"(min {float(v.min())}, max {float(v.max())})"
                    )
        step = _count("state_dict clip_state['step']", saved["step"])
        extra = self._extra_from(saved.get("extra"))
        return ClipState(step=step, mean=tensors("mean"), std=std, extra=extra)


def _copy_extra(extra: dict[str, Any] | None) -> dict[str, Any] | None:
    """A detached copy of ``ClipState.extra`` (lists of tensors or ``None``, and 0-d tensors)."""
    if extra is None:
        return None
    return {
        key: [None if t is None else t.detach().clone() for t in value]
        if isinstance(value, (list, tuple))
        else value.detach().clone()
        for key, value in extra.items()
    }


def _check_extra_values(key: str, tensors: Sequence[Tensor], what: str, update_every: Any) -> None:
    """The ranges of the documented ``extra`` entries (already finite): ``clip_norm > 0``;
    ``window_count`` a whole number in ``[0, update_every)``; ``window_noise >= 0`` (a sum of
    noise variances); ``centre_var >= 0`` or ``-1`` (no observation yet). The variance
    accumulators may be negative (the unbiased correction) and are only required finite."""
    for t in tensors:
        if key == "clip_norm" and not bool((t > 0).all()):
            raise InvalidHyperparameterError(f"state_dict {what} must be > 0, got {t.tolist()!r}")
        if key == "window_count":
            ok = bool(((t >= 0) & (t == torch.round(t))).all())
            if ok and isinstance(update_every, int):
                ok = bool((t < update_every).all())
            if not ok:
                raise InvalidHyperparameterError(
                    f"state_dict {what} must be a whole number in [0, update_every={update_every}), got {t.tolist()!r}"
                )
        if key == "window_noise" and not bool((t >= 0).all()):
            raise InvalidHyperparameterError(f"state_dict {what} must be >= 0 (a sum of noise variances)")
        if key == "centre_var" and not bool(((t >= 0) | (t == -1)).all()):
            raise InvalidHyperparameterError(
                f"state_dict {what} must be >= 0, or -1 where no release has been observed yet"
            )


def _count(what: str, value: Any) -> int:
    """A step count from a checkpoint: an integer ``>= 0`` (a 0-d integer tensor is accepted)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.dtype.is_floating_point:
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidHyperparameterError(f"{what} must be an int >= 0, got {value!r}")
    return value


# --------------------------------------------------------------------------- thin constructors


#: Built in the core so that PyTorch and JAX resolve the options the same way.
adaptive_clipping = _strategies.adaptive_clipping


class AdaClip(DPOptimizer):
    """AdaCliP (adaptive clipping) around ``optimizer``, with every option of
    :class:`adaclip.strategies.AdaptiveClipping`.

    ``AdaClip(torch.optim.Adam(model.parameters()), model, noise_multiplier=1.1,
    expected_batch_size=256)``. ``preset`` picks the starting point
    (:data:`adaclip.strategies.ADAPTIVE_PRESETS`); every keyword given overrides it:

    - ``"centred"`` (default): each unit's deviation from the running mean of the released
      gradients, ``w_i = (g_i − a_t)/b_t`` with ``a_{t+1} = β1·a_t + (1 − β1)·g̃_t`` (β1 = 0.99,
      ``a_0 = 0``), is clipped to norm 1. ``b_t = C·s_t^½/mean(s_t^½)`` has one value per
      tensor, learned from the releases (noise variance removed after averaging, β2 = 0.999),
      and starts flat at ``C = max_grad_norm`` (default 1), so the first step is flat
      clipping. It is the AdaCliP-family configuration that did best without tuning in our
      benchmark (where its shape stayed within about 1 % of flat).
    - ``"patent"``: the patent's AdaCliP, ``b = √s·√Σs`` with per-coordinate statistics
      (``std_min = 1e-5``, ``std_max = 1``, ``β1 = 0.99``, ``β2 = 0.9``), as in the paper.

    ``initial_max_grad_norm=C0`` starts clipping exactly like ``FlatClip(max_grad_norm=C0)``:
    with the default preset it is ``max_grad_norm``; with ``preset="patent"`` it sets
    ``std_min, std_max`` from :func:`adaclip.strategies.std_bounds_for_initial_clip` (``s``
    may then move a factor ``std_spread`` (30) either way, ``d`` = the number of trainable
    coordinates). Coming from Opacus, pass your ``max_grad_norm`` here.

    ``std_min``, ``std_max``, ``beta_mean`` (β1) and ``beta_std`` (β2) are those of
    :class:`adaclip.strategies.AdaptiveClipping`; the other keywords are
    :class:`DPOptimizer`'s. The options (keyword-only, ``None`` = the preset's value; the
    maths in :mod:`adaclip.adaptive`), each read only from the state, so each is
    post-processing:

    - ``scale``: ``"coupled"`` (``b = √s·√Σs``, ``preset="patent"``) or ``"separated"``
      (``b = C_t·s^p/mean(s^p)``, ``p = shape_power``, ``C_t = max_grad_norm`` or adapted by
      ``quantile``; the default preset);
    - ``statistic``: ``"deviation"`` (of ``g̃ − a``) or ``"second_moment"`` (of ``g̃``);
    - ``correction``: ``"clamp"``, ``"unbiased"`` or ``"none"`` (how the noise variance
      ``b²σ²/B̄²`` is removed);
    - ``pooling``: ``"coordinate"``, ``"tensor"`` or ``"factored"`` (``R_i K_j/mean(R)``);
    - ``update_every``: ``k``, statistics from the average of ``k`` releases;
    - ``centre``: ``"ema"``, ``"debiased"`` (``m/(1 − β₁ᵗ)``), ``"kalman"`` (gain
      ``K = P⁻/(P⁻ + b²σ²/B̄²)``, process noise ``process_noise``) or ``"none"``;
    - ``freeze_statistics``: keep ``s`` (e.g. from :meth:`DPOptimizer.use_public_statistics`);
      ``False`` lets the default preset learn a shape from the releases;
    - ``quantile``: a :class:`adaclip.strategies.QuantileRule` adapting ``C_t`` (separated
      only): it releases a clip count with noise ``σ_b`` and raises the gradient's noise to
      ``σ_g = (σ⁻² − (2σ_b)⁻²)^{-1/2}``; the accountant records ``σ``;
    - ``initial_variance``: ``u_0``, the start of the variance averages (default ``s_0²``).

    Only ``preset="patent"`` with the patent's options has fused kernels; the others take the
    core path (``use_kernel=True`` is refused).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: nn.Module,
        *,
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
        **kwargs: Any,
    ) -> None:
        num_params = 1
        if isinstance(optimizer, torch.optim.Optimizer):
            num_params = max(1, sum(p.numel() for p in _trainable_params(optimizer)))  # else DPOptimizer raises
        options = dict(
            scale=scale, shape_power=shape_power, statistic=statistic, correction=correction, pooling=pooling,
            update_every=update_every, centre=centre, process_noise=process_noise,
            freeze_statistics=freeze_statistics, quantile=quantile, initial_variance=initial_variance,
        )  # fmt: skip
        strategy = adaptive_clipping(
            num_params,
            preset=preset,
            std_min=std_min,
            std_max=std_max,
            beta_mean=beta_mean,
            beta_std=beta_std,
            initial_max_grad_norm=initial_max_grad_norm,
            std_spread=std_spread,
            max_grad_norm=max_grad_norm,
            **options,
        )
        super().__init__(optimizer, model, strategy=strategy, **kwargs)


class QuantileClip(DPOptimizer):
    """Flat clipping whose clip norm follows the quantile rule (Andrew et al., 2021):
    :class:`adaclip.strategies.QuantileClipping`.

    Each unit is clipped to ``C_t``; the release also carries the count
    ``Σ_i (1[‖g_i‖ ≤ C_t] − ½)`` with noise ``N(0, σ_b²)`` (``σ_b = count_noise_multiplier``,
    default ``B̄/20``), and ``C_{t+1} = C_t·exp(−η(count/B̄ + ½ − γ))`` with ``γ =
    target_quantile``, ``η = clip_learning_rate``, ``C_0 = max_grad_norm``. The gradient's
    noise multiplier is ``σ_g = (σ⁻² − (2σ_b)⁻²)^{-1/2}`` so that gradient and count together
    are one Gaussian mechanism with multiplier ``σ`` (what the accountant records); this needs
    ``σ < 2σ_b`` at every step (checked at construction and at each step, before anything
    changes). :meth:`DPOptimizer.hyperparameters` reports the next step's ``C_t``.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: nn.Module,
        *,
        max_grad_norm: float = 1.0,
        target_quantile: float = 0.5,
        clip_learning_rate: float = 0.2,
        count_noise_multiplier: float | None = None,
        **kwargs: Any,
    ) -> None:
        rule = _strategies.QuantileRule(
            target_quantile=target_quantile,
            learning_rate=clip_learning_rate,
            count_noise_multiplier=count_noise_multiplier,
        )
        super().__init__(optimizer, model, strategy=_strategies.QuantileClipping(max_grad_norm, rule), **kwargs)


class AutomaticClip(DPOptimizer):
    """Automatic clipping (Bu et al., 2022): :class:`adaclip.strategies.AutomaticClipping`.

    Every unit is normalised rather than clipped, ``w̄_i = w_i/(‖w_i‖ + γ)`` with
    ``w_i = g_i/C`` (``C = max_grad_norm``, ``γ = stability``), so ``‖w̄_i‖ < 1`` and the
    release is ``C·(Σ_i w̄_i + σz)/B̄``: no clip norm to tune (``C`` only scales the update,
    which the learning rate absorbs).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: nn.Module,
        *,
        max_grad_norm: float = 1.0,
        stability: float = 0.01,
        **kwargs: Any,
    ) -> None:
        strategy = _strategies.AutomaticClipping(max_grad_norm=max_grad_norm, stability=stability)
        super().__init__(optimizer, model, strategy=strategy, **kwargs)


class FlatClip(DPOptimizer):
    """DP-SGD flat clipping of each unit's whole gradient to ``max_grad_norm`` (``C``, default 1.0)."""

    def __init__(
        self, optimizer: torch.optim.Optimizer, model: nn.Module, *, max_grad_norm: float = 1.0, **kwargs: Any
    ) -> None:
        super().__init__(optimizer, model, strategy=_strategies.FlatClipping(max_grad_norm), **kwargs)


class PerLayerClip(DPOptimizer):
    """Per-layer clipping: tensor ``k`` clipped to ``C_k`` (``max_grad_norm/√K`` by default,
    or ``group_max_grad_norms[k]``, one per trainable tensor in optimizer order)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: nn.Module,
        *,
        max_grad_norm: float | None = None,
        group_max_grad_norms: Sequence[float] | None = None,
        **kwargs: Any,
    ) -> None:
        strategy = _strategies.PerLayerClipping(
            max_grad_norm=max_grad_norm,
            group_max_grad_norms=None if group_max_grad_norms is None else tuple(group_max_grad_norms),
        )
        super().__init__(optimizer, model, strategy=strategy, **kwargs)


class ScaledClip(DPOptimizer):
    """eDP-SGD scaled clipping: scale ``max_grad_norm·layer_scales[k]`` on tensor ``k``.

    ``layer_scales`` must come from public data or a privatised release
    (:mod:`adaclip.layer_scales`), one per trainable tensor in optimizer order.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: nn.Module,
        *,
        max_grad_norm: float,
        layer_scales: Sequence[float],
        **kwargs: Any,
    ) -> None:
        strategy = _strategies.ScaledClipping(max_grad_norm, tuple(layer_scales))
        super().__init__(optimizer, model, strategy=strategy, **kwargs)
