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
the checkpoints. :meth:`DPOptimizer.step` chains them; each concept lives in its own module:

- :mod:`adaclip_torch.wrapping` — the construction checks and the drift guard run before each step;
- :mod:`adaclip_torch.accumulation` — the pending clipped sum (virtual steps, units handed in);
- :mod:`adaclip.accounting.keeper` — the budget protocol: refuse a step over budget, write ahead to the ledger, record;
- :mod:`adaclip_torch.release` — noise once (or the noisy all-reduce), rescale, the state update,
  and the compile and transform caches;
- :mod:`adaclip_torch.checkpoint` — what :meth:`~DPOptimizer.state_dict` saves and how a
  checkpoint is validated before :meth:`~DPOptimizer.load_state_dict` restores it;
- :mod:`adaclip_torch.views` — the read-only hyperparameters (Opacus's names) and statistics;
- :mod:`adaclip_torch.forwarding` — ``param_groups``/``state``/``defaults`` of the wrapped optimizer.

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

import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from adaclip import schedules as _schedules
from adaclip import strategies as _strategies
from adaclip.accounting import keeper as _keeper
from adaclip.errors import InvalidGradientError, InvalidHyperparameterError
from adaclip.options import AdaptiveOptions, split_adaptive_options
from adaclip.strategies import ClipState
from adaclip_torch import checkpoint as _checkpoint
from adaclip_torch import distributed as _distributed
from adaclip_torch import wrapping as _wrapping
from adaclip_torch.accumulation import PendingSum, VirtualSteps, given_grads
from adaclip_torch.averaging import ParameterAverage
from adaclip_torch.data import PoissonUserBatchSampler, draw_counter
from adaclip_torch.engines import EngineContext, StepInputs, make_engine, resolve_kernel
from adaclip_torch.forwarding import WrappedOptimizer
from adaclip_torch.grad_sample import GradSampleHooks
from adaclip_torch.noise import NoiseSource
from adaclip_torch.release import CompileCache, Releaser, TransformCache
from adaclip_torch.views import HyperparameterViews, StatisticsViews
from adaclip_torch.wrapping import NONFINITE_MODES

if TYPE_CHECKING:
    from typing import Unpack  # Python >= 3.11; only the annotations use it

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


class _Spend(NamedTuple):
    """One step's record for the budget keeper (:meth:`DPOptimizer._spend`): ``σ`` and the rate
    it is recorded with, and whether the step is recorded at all."""

    noise_multiplier: float
    sample_rate: float
    records: bool

    @property
    def event(self) -> tuple[float, float]:
        """``(σ, rate)``, the keeper's positional arguments."""
        return self.noise_multiplier, self.sample_rate


def _call(closure: Callable[[], Any] | None) -> Any:
    """``closure()`` with gradients enabled (``None`` without a closure)."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


# --------------------------------------------------------------------------- the wrapper


class DPOptimizer(VirtualSteps, HyperparameterViews, StatisticsViews, WrappedOptimizer):
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
        release into ``p.grad``, replacing FSDP's raw gradient (FSDP1 and mixed or non-default
        sharding are refused). Banded noise keeps its state sharded (``noise_sharding``) and
        ``averaging`` averages each rank's parameter shards.
      per_sample_mode: how the per-unit norms and the clipped sum are computed (the per-sample
        engine, :mod:`adaclip_torch.engines`, exposed as :attr:`engine`); every mode computes
        the same step (ghost norms are upper bounds: rounding can only over-clip).
        ``"auto"`` (default): weighted ghost norms for
        ``nn.Linear``/``nn.Embedding``/``transformers`` ``Conv1D`` layers, tied embeddings included
        (no ``p.grad_sample`` is formed for them, see
        :mod:`adaclip_torch.ghost`) and materialised per-example gradients for every other
        layer (convolutions included, and layers without a ghost rule). ``"materialise"``:
        per-example gradients of every layer, left in ``p.grad_sample`` after ``backward()``
        (choose it to read them). ``"ghost"``: ghost norms for convolutions too (the memory
        mode). :attr:`per_sample_mode` is the mode in use (``"materialise"`` when
        ``use_kernel=True`` took the kernels under ``"auto"``).
      use_kernel: the fused Triton kernels (:mod:`adaclip_torch.kernels`) for the
        clip–sum–noise–rescale–update pass. ``None`` (auto): on when ``per_sample_mode`` is
        ``"materialise"``, the parameters are float32 CUDA tensors, triton is installed, the
        strategy is flat clipping or the patent's AdaCliP (``AdaptiveClipping`` with
        ``is_patent``: every option at its default) and ``distributed=False``; else off (so
        under the default ``per_sample_mode="auto"`` the ghost engine runs: the kernels read
        materialised per-example gradients, which cost far more memory). ``True``: on (under
        ``"auto"`` it materialises), or :class:`InvalidHyperparameterError`
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
        with it. With ``distributed=True`` the noise is added once, like independent noise: by
        default each rank draws and correlates the noise of its own slice of the coordinates
        (see ``noise_sharding``; ``"rank0"``: rank 0 draws all of it and holds every buffer);
        each rank passes its own :class:`~adaclip_torch.data.CyclicPoissonBatchSampler` over its
        shard of the data. The buffers (the last ``b − 1`` noise vectors) are secret
        and saved in checkpoints only with ``seed``; otherwise a restore starts a new cycle.
        ``"blt"``: buffered linear Toeplitz noise (:mod:`adaclip.correlated.blt`), a dense
        Toeplitz factor streamed with ``buffers`` buffers (``m·d`` numbers), fitted for the
        sampler's ``total_steps`` (or a given :class:`adaclip.correlated.BltNoise`); it needs a
        :class:`~adaclip_torch.data.FixedOrderBatchSampler` and gets **no amplification**: the
        accountant records, at the first step of each epoch-long block of ``b`` steps, a Gaussian
        event at rate 1 whose noise multiplier makes the composition that of the Gaussian
        mechanism ``σ/Δ_t`` (:class:`adaclip.accounting.MinSeparationGaussian`). With
        ``distributed=True`` each rank passes its own fixed-order sampler over an equal share
        of the units (same batches per epoch and ``total_steps``, checked across the ranks) and
        the noise state is sharded like banded noise's (``m·d/R`` numbers per rank).
      bands: ``b`` for ``noise_mechanism="banded"``.
      noise_sharding: where correlated (banded or BLT) noise's state lives with ``distributed=True``: ``"auto"``
        (default) and ``"sharded"``: every rank draws and correlates the noise of its own
        contiguous slice of the coordinates (:func:`adaclip_torch.distributed.sharded_noisy_all_reduce`),
        so each holds ``(b − 1)·d/R`` buffer numbers (BLT: ``m·d/R``); with ``seed`` each rank's generator is
        seeded with :func:`adaclip_torch.distributed.rank_seed` (``seed``, rank), and every rank
        saves and loads its own checkpoint (one file per rank, same number of ranks; another
        rank's buffers are refused). ``"rank0"``: rank 0 draws and correlates all of it and holds
        every buffer (the release equals a single process's with rank 0's seed). Independent
        noise is always drawn by rank 0.
      sampler: the batch sampler of the loader the run iterates (its ``batch_sampler``): the
        :class:`~adaclip_torch.data.CyclicPoissonBatchSampler` (``bands=b``), required with
        banded noise; with ``"blt"`` the :class:`~adaclip_torch.data.FixedOrderBatchSampler`;
        optional with independent noise, a :class:`~adaclip_torch.data.PoissonBatchSampler`
        or :class:`~adaclip_torch.data.PoissonUserBatchSampler` at ``sample_rate``
        (``make_private`` always gives its loader's). Every step is then checked, before
        anything changes, to release the next batch the loop received from it, exactly once:
        none skipped, none stepped twice, none from another loader. With banded or BLT noise
        step ``t`` must release draw ``t`` (:meth:`adaclip_torch.data.DrawCounter.check_step`:
        restore the sampler's state with the optimizer's); with independent noise each step
        needs one new batch since the previous one
        (:meth:`~adaclip_torch.data.DrawCounter.check_next`: Poisson draws carry no schedule,
        so a fresh sampler may follow a restore). With DataLoader workers the loader must count
        what it hands out (:class:`~adaclip_torch.data.CountingDataLoader`, which
        :func:`~adaclip_torch.data.poisson_data_loader` returns). A
        :class:`~adaclip_torch.data.PoissonUserBatchSampler` makes the run user level: every
        step and :meth:`accumulate` on a batch then needs ``user_ids=``.
      buffers: ``m`` (1 to 4) for ``noise_mechanism="blt"`` (default 3).
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
    shape (``model.double()`` after wrapping is refused); with a ``sampler``, the step
    releases the sampler's next draw (see ``sampler``), and at user level it has ``user_ids``.
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
        buffers: int | None = None,
        noise_sharding: str = "auto",
    ) -> None:
        # Deliberately no super().__init__: the parameter groups and state live in `optimizer`.
        # The checks run in this order (each refusal before anything is attached to the model).
        _wrapping.check_arguments(
            optimizer, model, already_wrapped=isinstance(optimizer, DPOptimizer), per_sample_mode=per_sample_mode,
            loss_reduction=loss_reduction, nonfinite=nonfinite, distributed=distributed,
        )  # fmt: skip
        self.noise_schedule = _wrapping.make_schedule(noise_multiplier, noise_schedule)
        _, self._expected_batch_size = _strategies.validate_mechanism(0.0, expected_batch_size)
        self._sample_rate = _wrapping.check_sample_rate(sample_rate)
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
        # the release part: its noise, stream and state are set below, as they become known
        self._releaser = Releaser(
            compile_cache=CompileCache(compile_release), expected_batch_size=self._expected_batch_size,
            distributed=self.distributed,
        )  # fmt: skip
        self._init_parameters(averaging)
        self.use_kernel = use_kernel
        # refused (use_kernel=True) before any hook is attached. The kernels read materialised
        # per-example gradients: use_kernel=None takes them with per_sample_mode="materialise"
        # only (under "auto" the ghost engine keeps memory low: on an H200 the kernels took 10x
        # the memory of ghost norms on an MLP and were not faster overall); use_kernel=True with
        # "auto" materialises for them
        kernel = resolve_kernel(
            use_kernel if use_kernel is not None or per_sample_mode == "materialise" else False,
            strategy,
            per_sample_mode="materialise" if per_sample_mode == "auto" else per_sample_mode,
            distributed=self.distributed,
            dtype=self._dtype,
            params=self.params,
        )
        if kernel and per_sample_mode == "auto":
            per_sample_mode = "materialise"
        self._releaser.stream = _wrapping.make_stream(  # before any hook
            noise_mechanism, bands, sampler, noise_schedule=noise_schedule,
            compile_release=self.compile_release, sample_rate=self.sample_rate, buffers=buffers,
            distributed=self.distributed,
        )  # fmt: skip
        seed = self._shard_noise_state(noise_sharding, seed)
        # the sampler whose draws each step must release (checked in _pre_step), and whether it
        # samples users (then every batch must come with user_ids)
        self._sampler = sampler
        self._draws = draw_counter(sampler)
        # independent noise: the sampler's hand-outs at the last step (each step needs one more)
        self._handed = 0 if self._draws is None else self._draws.handed
        self._empty_marked = False  # mark_empty_batch(): the next step releases an empty batch
        self._samples_users = isinstance(sampler, PoissonUserBatchSampler)

        self.average = ParameterAverage.from_spec(model, averaging)
        self._releaser.noise = NoiseSource(seed=seed, secure_mode=secure_mode)
        self._pending = PendingSum()
        # set by adaclip_torch.BatchMemoryManager while it drives this optimizer (see step())
        self._physical_batches: Any = None
        self._steps = 0
        self._init_engine(per_sample_mode, kernel, attach_hooks=attach_hooks, batch_first=batch_first)

    def _init_parameters(self, averaging: Any) -> None:
        """The privatised parameters (names, layouts, FSDP2), the statistics dtype, the strategy's
        initial state, and the checks on the step-0 mechanism that need them."""

        self.params = _wrapping.trainable_params(self.original_optimizer)
        if not self.params:
            raise InvalidHyperparameterError("the optimizer has no trainable parameters")
        self.param_names = _wrapping.parameter_names(self.model, self.params)
        # FSDP2: the parameters are sharded DTensors; shapes are their full shapes, the state and
        # every sum are full-size plain tensors, and p.grad gets this rank's shard of the release
        self._fsdp = _distributed.check_fsdp(self.params, self.param_names, distributed=self.distributed)
        self._shapes = [tuple(p.shape) for p in self.params]
        self._layouts = [(p.dtype, p.device) for p in self.params]
        self._dtype = _wrapping.statistics_dtype(self.params)
        self._releaser.transforms = TransformCache(self._releaser.compile, len(self.params))
        self._releaser.state = self.strategy.init(
            [_distributed.full_template(p, self._dtype) if self._fsdp else p.detach().to(self._dtype) for p in self.params]
        )
        # Validates strategy-specific lengths (layer_scales, group norms) and step 0's noise
        # multipliers (the quantile rule needs σ < 2σ_b) up front.
        self._releaser.check(self._strategy_at(0), self.noise_schedule.at(0).noise_multiplier)
        # κ where the clip level follows the statistics (AdaCliP's coupled scale b = √s·√Σs)
        _strategies.warn_of_noise_drift(
            self.strategy,
            sum(p.numel() for p in self.params),
            self.noise_schedule.at(0).noise_multiplier,
            self.expected_batch_size,
        )

    def _init_engine(self, per_sample_mode: str, kernel: bool, *, attach_hooks: bool, batch_first: bool) -> None:
        """Attach the grad-sample hooks (unless ``attach_hooks=False``) and build the engine."""
        self.grad_sample_hooks = None
        if attach_hooks:
            self.grad_sample_hooks = GradSampleHooks(
                self.model, loss_reduction=self.loss_reduction, batch_first=batch_first
            )
        self.per_sample_mode = per_sample_mode
        context = EngineContext(tuple(self.params), tuple(self.param_names), tuple(self._shapes), self._dtype)
        self._engine = make_engine(
            per_sample_mode, context, model=self.model, hooks=self.grad_sample_hooks, use_kernel=kernel
        )

    @property
    def compile_release(self) -> bool:
        """Whether the release and the transform run under ``torch.compile`` (see the argument)."""
        return self._releaser.compile.enabled

    @compile_release.setter
    def compile_release(self, value: bool) -> None:
        self._releaser.compile.enabled = value

    def __repr__(self) -> str:
        noise = self.noise_mechanism + (f"(b={self.bands})" if self.noise_mechanism == "banded" else "")
        acc = self.accountant
        accounted = "" if acc is None else f", accountant={acc.mechanism}" + (
            "" if acc.target_epsilon is None else f"(ε≤{acc.target_epsilon:g}, δ={acc.delta:g})"
        )
        averaging = "" if self.average is None else f", averaging={self.average!r}"
        return (
            f"{type(self).__name__}({self.strategy!r}, σ={self.noise_multiplier:.6g}, B̄={self.expected_batch_size}, "
            f"noise={noise}{accounted}{averaging}, steps={self.steps}, wrapping {self.original_optimizer!r})"
        )

    def _budget_context(self) -> str:
        """The planned run, for a budget refusal: the sampling rate the user set and the one
        the accountant records, and the steps make_private planned (public quantities only)."""
        parts = []
        q = self.sample_rate
        if self.noise_mechanism == "banded" and q is not None:
            parts.append(f"with banded noise (b = {self.bands}) each cycle of {self.bands} steps is accounted once, "
                         f"at rate b*q = {self.accounted_sample_rate:.4g} (your q = {q:.4g})")  # fmt: skip
        elif self.noise_mechanism == "blt":
            parts.append("BLT noise is accounted block by block at rate 1 (no amplification)")
        planned = getattr(self, "_planned_run", None)
        if planned is not None:
            epochs, steps = planned
            parts.append(f"make_private planned {epochs} epoch(s) = {steps} steps for this budget")
        return "".join(f"; {p}" for p in parts)

    def remove_hooks(self) -> None:
        """Detach the grad-sample hooks from the model (e.g. to wrap it again)."""
        if self.grad_sample_hooks is not None:
            self.grad_sample_hooks.remove()
            self.grad_sample_hooks = None

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

        The phases: the closure; :meth:`_pre_step` (the privacy checks, ``(σ_t, C_t)``);
        :meth:`_clip_and_sum` (the engine); the budget (refuse, write ahead); and
        :meth:`_release_and_step` (noise, rescale, ``p.grad``, the wrapped ``step()``, commit).
        """
        empty_batch = empty_batch or self._empty_marked
        if self._physical_batches is not None and not self._physical_batches.releases:
            return self._virtual_step(closure, user_ids=user_ids, empty_batch=empty_batch)
        loss = _call(closure)
        hp, strategy = self._pre_step()
        # A fused engine clips and releases a fresh batch itself; an empty batch, a pending
        # sum (accumulate, add_unit_gradients) or correlated noise takes the core path, as does
        # every other engine.
        fused = self._engine.fuses_release and not empty_batch and self._pending.summed is None and self._stream is None
        with torch.no_grad():
            inputs, clipped = self._clip_and_sum(strategy, user_ids, empty_batch=empty_batch, fused=fused)
        spend = self._spend(hp.noise_multiplier)
        logged = _keeper.admit(self.accountant, *spend.event, step=self._steps, records=spend.records,
                               explain=self._budget_context)  # fmt: skip
        if self.distributed:
            _distributed.require_process_group()
        self._release_and_step(strategy, hp.noise_multiplier, inputs, clipped, spend=spend, logged=logged)
        if self.average is not None:
            self.average.update()
        return loss

    def _shard_noise_state(self, noise_sharding: Any, seed: int | None) -> int | None:
        """Resolve ``noise_sharding``; under sharded noise state give the stream its slice of the
        coordinates and return this rank's seed (:func:`adaclip_torch.distributed.rank_seed`)."""
        if noise_sharding not in ("auto", "sharded", "rank0"):
            raise InvalidHyperparameterError(
                f"noise_sharding must be 'auto', 'sharded' or 'rank0', got {noise_sharding!r}"
            )
        correlated = self._stream is not None
        if noise_sharding == "sharded" and not (self.distributed and correlated):
            raise InvalidHyperparameterError(
                "noise_sharding='sharded' splits correlated noise's buffers over the ranks: it needs "
                "noise_mechanism='banded' or 'blt' and distributed=True"
            )
        if self.distributed and correlated and self._stream.kind == "blt":
            self._check_blt_schedule_across_ranks()
        self.noise_sharding = "sharded" if self.distributed and correlated and noise_sharding != "rank0" else "rank0"
        if self.noise_sharding == "rank0":
            return seed
        total = sum(p.numel() for p in self.params)
        self._stream.shard = _distributed.noise_shard(total, dist.get_rank(), dist.get_world_size())
        return None if seed is None else _distributed.rank_seed(seed, dist.get_rank())

    def _check_blt_schedule_across_ranks(self) -> None:
        """BLT under data parallelism: every rank's fixed-order sampler must have the same
        batches per epoch (the min separation ``b``, hence the blocks the accountants record)
        and the same number of steps (the fitted factor); one collective at construction, and
        every rank raises together when they differ."""
        _distributed.require_process_group()
        sampler = self._stream.sampler
        mine = (int(sampler.num_batches), sampler.total_steps)
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        if any(other != mine for other in everyone):
            raise InvalidHyperparameterError(
                "BLT noise with distributed=True needs the same fixed-order schedule on every rank (batches per "
                f"epoch, total steps); the ranks' FixedOrderBatchSampler have {everyone}: give every rank an "
                "equal share of the units and the same batch_size and total_steps"
            )

    def mark_empty_batch(self) -> None:
        """Say that the batch in the loop's hands has no units: the next :meth:`step` is
        ``step(empty_batch=True)``.

        For loops that call ``step()`` themselves and cannot pass the keyword (the Hugging Face
        ``Trainer``, through Accelerate's optimizer wrapper): the loop skips the forward and
        backward passes of an empty Poisson batch, calls this, and the next ``step()`` releases
        the noise alone (accounted as every step). The mark is cleared by that step once it
        has released; a step refused before it releases keeps it. A step that finds per-example
        gradients while marked is refused (:class:`~adaclip.errors.InvalidGradientError`): the
        batch was not empty after all."""
        self._empty_marked = True

    def _virtual_step(self, closure: Callable[[], Any] | None, *, user_ids: Tensor | None, empty_batch: bool) -> Any:
        """Inside a BatchMemoryManager, on a physical batch that is not the last of its logical
        batch: the step only adds the batch to the pending sum."""
        if empty_batch:
            raise InvalidGradientError(
                "step(empty_batch=True) on a physical batch that is not the last of its logical batch: "
                "only a whole logical batch can be empty"
            )
        loss = _call(closure)
        self.accumulate(user_ids=user_ids)
        return loss

    def _pre_step(self) -> tuple[Any, Any]:
        """The checks before a release, changing nothing: the drift guard, the strategy's split of
        σ (the quantile rule's σ ≥ 2σ_b raises here), the sampler (the step releases the next
        batch the loop received; with correlated noise step ``t`` releases draw ``t``). Returns
        step ``t``'s hyperparameters and strategy."""
        self._check_unchanged()
        t = self._steps
        hp = self.noise_schedule.at(t)
        strategy = self._strategy_at(t, hp)
        self._releaser.check(strategy, hp.noise_multiplier)
        if self._draws is not None:
            if self._stream is None or not self._stream.indexed:  # Poisson: one new batch per step
                what = "independent noise" if self._stream is None else f"{self._stream.kind} noise"
                self._draws.check_next(self._handed, what=what)
            else:  # the groups / fixed batches follow the draw index: step t on draw t
                self._draws.check_step(t, what=f"{self._stream.kind} noise")
        return hp, strategy

    def _clip_and_sum(
        self, strategy: Any, user_ids: Tensor | None, *, empty_batch: bool, fused: bool
    ) -> tuple[StepInputs | None, Any]:
        """The clipped sum of this step's units (and the pending sum): for a fused engine its
        inputs and its pending clip, else ``(None, summed)``."""
        if fused:
            if user_ids is None:
                self._refuse_examples_at_user_level()
            inputs = self._engine_inputs()
            return inputs, self._engine.clip(inputs, strategy, user_ids)
        if empty_batch:
            return None, self._empty_sum(strategy)
        return None, self._pending_sum(strategy, user_ids, require=self._pending.summed is None)

    def _release_and_step(
        self, strategy: Any, noise_multiplier: float, inputs: StepInputs | None, clipped: Any, *, spend: _Spend,
        logged: bool,
    ) -> None:
        """Noise, rescale, write ``p.grad``, step the wrapped optimizer, commit.

        From the moment a value computed from this step's noise may have left (the noisy
        all-reduce sent it to other ranks, or the wrapped optimizer — and its hooks — saw it),
        the step is released: it is accounted, the state moves on, and the generator never
        rewinds, even if something raises afterwards. A failure before that undoes everything."""
        old_grads = [p.grad for p in self.params]
        released = self.distributed
        new_state: ClipState | None = None
        try:
            with torch.no_grad():
                if inputs is not None:  # the fused engine releases its own clip
                    noisy_grad, new_state = self._releaser.release_fused(
                        self._engine, inputs, strategy, clipped, noise_multiplier
                    )
                else:
                    noisy_grad, new_state = self._releaser.release(strategy, clipped, noise_multiplier)
            for p, g in zip(self.params, noisy_grad, strict=True):
                p.grad = self._as_grad(g, p)
            released = True
            self.original_optimizer.step()
        except BaseException:
            if released:
                self._commit(new_state, spend, logged=logged)
            else:
                self._rollback(old_grads)
            raise
        self._commit(new_state, spend, logged=logged)

    def _commit(self, new_state: ClipState | None, spend: _Spend, *, logged: bool = False) -> None:
        """The step is released: account it (``spend``, as checked before the release), move the
        state on (``None``: the release failed after the noise was sent to other ranks — the
        statistics stay, the step still counts)."""
        self._releaser.commit(new_state)
        self._handed += 1  # the batch this step released (checked in _pre_step)
        self._empty_marked = False
        self._steps += 1
        self._pending.clear()
        self._clear_per_example_grads()
        _keeper.record(self.accountant, *spend.event, records=spend.records, logged=logged)

    def _rollback(self, old_grads: list[Tensor | None]) -> None:
        """Undo a step that failed before its release: ``p.grad``, the generator, the stream."""
        for p, g in zip(self.params, old_grads, strict=True):
            p.grad = g
        self._releaser.rollback()

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

    # ------------------------------------------------------------------ internals

    # The release part's state (:class:`~adaclip_torch.release.Releaser` owns it), under the names
    # the views, the checkpoints and the virtual steps read it by.
    @property
    def _clip_state(self) -> ClipState:
        return self._releaser.state  # type: ignore[return-value]

    @property
    def _noise(self) -> NoiseSource:
        return self._releaser.noise  # type: ignore[return-value]

    @property
    def _stream(self) -> Any:
        return self._releaser.stream


    def _strategy_at(self, step: int, hyperparameters: Any = None) -> Any:
        """The strategy with step ``t``'s clip norm applied (``hyperparameters``: step ``t``'s,
        if the caller has them); checks per-tensor lengths (``layer_scales``,
        ``group_max_grad_norms``) against the parameters (on the current state: a strategy such
        as QuantileClipping reads its clip norm from it)."""
        hp = self.noise_schedule.at(step) if hyperparameters is None else hyperparameters
        strategy = _schedules.apply_to_strategy(self.strategy, hp)
        if not isinstance(strategy, _strategies.AdaptiveClipping):
            self._releaser.transformed(strategy)  # computed once per state: the step reuses it
            strategy.clip_groups(len(self.params))
        return strategy

    def _spend(self, noise_multiplier: float) -> _Spend:
        """What the budget keeper checks before this step's release and records after it:
        whether the step is recorded at all (always, except inside a cycle of correlated noise),
        the noise multiplier recorded (``σ``, or with BLT noise the block's effective one:
        :meth:`adaclip_torch.correlated.NoiseStream.accounted_noise_multiplier`) and the rate."""
        stream = self._stream
        if stream is None:
            return _Spend(noise_multiplier, self._sample_rate, records=True)
        if not stream.cycles.records_at(self._steps):
            return _Spend(noise_multiplier, stream.accounted_rate, records=False)
        return _Spend(stream.accounted_noise_multiplier(noise_multiplier, self._steps), stream.accounted_rate, records=True)

    def _check_unchanged(self) -> None:
        """The drift guard, :func:`adaclip_torch.wrapping.check_unchanged`."""
        _wrapping.check_unchanged(self.model, self.original_optimizer, self.params, self.param_names, self._layouts)

    def _given_grads(self, grads: Any, *, argument: str, what: str, check_finite: bool = True) -> list[Tensor]:
        """:func:`adaclip_torch.accumulation.given_grads` against the privatised parameters."""
        return given_grads(
            grads, params=self.params, names=self.param_names, shapes=self._shapes, dtype=self._dtype,
            argument=argument, what=what, check_finite=check_finite,
        )  # fmt: skip

    def _as_grad(self, g: Tensor, p: Tensor) -> Tensor:
        """The released gradient ``g`` (full size) as ``p.grad``: in ``p``'s dtype and device, or
        with FSDP2 this rank's shard of it as a DTensor laid out like ``p``
        (:func:`adaclip_torch.distributed.shard_of`), which replaces FSDP's raw gradient."""
        if self._fsdp:
            return _distributed.shard_of(g, p)
        return g.to(dtype=p.dtype, device=p.device)

    def _engine_inputs(self) -> StepInputs:
        """What the engine reads at this call (:class:`~adaclip_torch.engines.StepInputs`): the
        current state and its cached transform, ``nonfinite`` and the attached hooks."""
        return StepInputs(self._clip_state, self._releaser.transformed, self.nonfinite, self.grad_sample_hooks)

    def _pending_sum(
        self, strategy: Any, user_ids: Tensor | None, *, require: bool, check_units: bool = True
    ) -> list[Tensor]:
        """``Σ`` clipped units of this batch plus the accumulated buffer (new tensors), entry by
        entry: the K per-tensor sums, then the auxiliary sums. With a pending sum, the batch's
        units are checked against it first (:meth:`PendingSum.units_with`)."""
        inputs = self._engine_inputs()
        sources = self._engine.unit_sources(inputs, user_ids, require=require)
        if sources is None:
            return list(self._pending.summed)  # type: ignore[arg-type]
        if user_ids is None:
            self._refuse_examples_at_user_level()
        pending = self._pending.summed is not None
        if check_units and pending:
            self._pending.units_with(user_ids)
        summed = self._engine.clipped_sum(inputs, strategy, sources)
        return self._pending.plus(summed) if pending else summed

    @property
    def user_level(self) -> bool:
        """Whether the optimizer knows the run is user level: its ``sampler`` is a
        :class:`~adaclip_torch.data.PoissonUserBatchSampler`, or a
        :class:`~adaclip_torch.BatchMemoryManager` over such a sampler drives it."""
        driving = self._physical_batches
        return self._samples_users or bool(driving is not None and getattr(driving, "user_level", False))

    def _refuse_examples_at_user_level(self) -> None:
        """A batch's units without ``user_ids`` are its examples; at user level the accountant
        counts users (``q`` is a user's rate, ``B̄`` users per step), so clipping each example
        would let a user with ``k`` examples move the release by ``k·C``: refused, before
        anything changes."""
        if self.user_level:
            raise InvalidGradientError(
                "this run is user level (the sampler is a PoissonUserBatchSampler: q and B̄ count users), "
                "but the batch came without user_ids=, so each example would be clipped on its own and a user "
                "with k examples could move the release by k·C. Pass the batch's user ids: "
                "optimizer.step(user_ids=...) (and accumulate(user_ids=...)); step(empty_batch=True) for a "
                "batch with no user. Nothing was changed"
            )

    def _empty_sum(self, strategy: Any) -> list[Tensor]:
        """The clipped sum of a batch with no units (plus any accumulated buffer): zeros, and
        the auxiliary sums of no units (0-d zeros), from the core."""
        if self._engine.collect(self._engine_inputs()) is not None:
            raise InvalidGradientError("empty_batch=True but the parameters have per-example gradients")
        empty = [torch.zeros((0, *p.shape), dtype=self._dtype, device=p.device) for p in self.params]
        summed = _strategies.clip_and_sum(strategy, self._clip_state, empty, transformed=self._releaser.transformed(strategy))
        return self._pending.plus(summed)

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
        return _checkpoint.dump(self)

    def load_state_dict(  # type: ignore[override]
        self, state_dict: dict[str, Any], *, ignore_ledger: bool = False
    ) -> None:
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

        A checkpoint of a run that kept a crash-safe ledger (``make_private(..., ledger=)``,
        ``Accountant(..., ledger=)``) is restored only with that ledger: the releases made after
        the checkpoint are recorded there and nowhere else. Restored into an optimizer whose
        accountant has no ledger (a restart that forgot ``ledger=``) it is refused, naming the
        ledger's path, and nothing changes — parameters, wrapped optimizer, clip state,
        accountant, noise generator. With the run's ledger, the ledger's history is kept (see
        :meth:`adaclip.accounting.Accountant.load_state_dict`).

        Args:
            state_dict: a :meth:`state_dict`.
            ignore_ledger: ``True`` restores a ledger run's checkpoint without its ledger, for a
                run whose ledger is lost for good or when only the model matters. **ε then
                under-counts** by every release made after the checkpoint; a ``UserWarning``
                says so (see :meth:`adaclip.accounting.Accountant.load_state_dict`).
        """
        state_dict = _checkpoint.own_rank_parts(self, state_dict)  # distributed: this rank's parts
        restored = _checkpoint.validate(self, state_dict, ignore_ledger=ignore_ledger)  # nothing has changed
        snapshot = _checkpoint.Snapshot.take(self)
        try:  # the parts that check themselves while loading; a refusal by one rolls all back
            _checkpoint.load_delegated(
                self, state_dict, keep_accountant=restored.keep_accountant, ignore_ledger=ignore_ledger
            )
        except BaseException:
            snapshot.restore(self)
            raise
        # commit: nothing below can fail (the noise source was checked; in seeded mode it warns)
        if self._stream is not None:
            self._stream.apply_state(restored.stream)
        self._noise.load_state_dict(state_dict["noise"])
        self._releaser.restore(restored.clip_state)
        self._steps = restored.steps
        self._pending.clear()
        if restored.keep_accountant:
            warnings.warn(
                f"kept the accountant's history ({self.accountant.steps} steps) instead of rolling it "
                "back to the checkpoint's: the releases made since that checkpoint were spent and still "
                "count. (Restoring in a fresh process loads the checkpoint's accountant.)",
                UserWarning,
                stacklevel=2,
            )


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

    The keywords that choose the strategy are :class:`adaclip.options.AdaptiveOptions`
    (``preset``, ``std_min``, ``std_max``, ``beta_mean`` (β1), ``beta_std`` (β2),
    ``initial_max_grad_norm``, ``std_spread``, ``max_grad_norm`` and the options below, each
    documented there), declared once for the core's :func:`adaclip.strategies.adaptive_clipping`
    (which builds it), this wrapper and ``adaclip_jax.adaclip``; every other keyword is
    :class:`DPOptimizer`'s (an unknown one is refused by it with Python's ``TypeError``). All
    are keyword-only. The options (``None`` = the preset's value; the maths in
    :mod:`adaclip.adaptive`), each read only from the state, so each is post-processing:

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

    def __init__(self, optimizer: torch.optim.Optimizer, model: nn.Module, **kwargs: Any) -> None:
        num_params = 1
        if isinstance(optimizer, torch.optim.Optimizer):
            num_params = max(1, sum(p.numel() for p in _wrapping.trainable_params(optimizer)))  # else DPOptimizer raises
        options, rest = split_adaptive_options(kwargs)
        super().__init__(optimizer, model, strategy=self._strategy_of(num_params, **options), **rest)

    @staticmethod
    def _strategy_of(num_params: int, **options: Unpack[AdaptiveOptions]) -> _strategies.AdaptiveClipping:
        """The strategy of ``AdaClip(**options)`` for ``d = num_params`` trainable coordinates
        (``make_private`` builds it first, with ``d = 1``, to check the values)."""
        return adaptive_clipping(num_params, **options)


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
        strategy = self._strategy_of(
            1, max_grad_norm=max_grad_norm, target_quantile=target_quantile,
            clip_learning_rate=clip_learning_rate, count_noise_multiplier=count_noise_multiplier,
        )  # fmt: skip
        super().__init__(optimizer, model, strategy=strategy, **kwargs)

    @staticmethod
    def _strategy_of(
        num_params: int,
        *,
        max_grad_norm: float,
        target_quantile: float,
        clip_learning_rate: float,
        count_noise_multiplier: float | None,
    ) -> _strategies.QuantileClipping:
        """The strategy of ``QuantileClip(...)`` (``num_params`` is not used)."""
        rule = _strategies.QuantileRule(
            target_quantile=target_quantile,
            learning_rate=clip_learning_rate,
            count_noise_multiplier=count_noise_multiplier,
        )
        return _strategies.QuantileClipping(max_grad_norm, rule)


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
        strategy = self._strategy_of(1, max_grad_norm=max_grad_norm, stability=stability)
        super().__init__(optimizer, model, strategy=strategy, **kwargs)

    @staticmethod
    def _strategy_of(num_params: int, *, max_grad_norm: float, stability: float) -> _strategies.AutomaticClipping:
        """The strategy of ``AutomaticClip(...)`` (``num_params`` is not used)."""
        return _strategies.AutomaticClipping(max_grad_norm=max_grad_norm, stability=stability)


class FlatClip(DPOptimizer):
    """DP-SGD flat clipping of each unit's whole gradient to ``max_grad_norm`` (``C``, default 1.0)."""

    def __init__(
        self, optimizer: torch.optim.Optimizer, model: nn.Module, *, max_grad_norm: float = 1.0, **kwargs: Any
    ) -> None:
        super().__init__(optimizer, model, strategy=self._strategy_of(1, max_grad_norm=max_grad_norm), **kwargs)

    @staticmethod
    def _strategy_of(num_params: int, *, max_grad_norm: float) -> _strategies.FlatClipping:
        """The strategy of ``FlatClip(...)`` (``num_params`` is not used)."""
        return _strategies.FlatClipping(max_grad_norm)


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
        strategy = self._strategy_of(1, max_grad_norm=max_grad_norm, group_max_grad_norms=group_max_grad_norms)
        super().__init__(optimizer, model, strategy=strategy, **kwargs)

    @staticmethod
    def _strategy_of(
        num_params: int, *, max_grad_norm: float | None, group_max_grad_norms: Sequence[float] | None
    ) -> _strategies.PerLayerClipping:
        """The strategy of ``PerLayerClip(...)`` (``num_params`` is not used)."""
        return _strategies.PerLayerClipping(
            max_grad_norm=max_grad_norm,
            group_max_grad_norms=None if group_max_grad_norms is None else tuple(group_max_grad_norms),
        )


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
        strategy = self._strategy_of(1, max_grad_norm=max_grad_norm, layer_scales=layer_scales)
        super().__init__(optimizer, model, strategy=strategy, **kwargs)

    @staticmethod
    def _strategy_of(num_params: int, *, max_grad_norm: float, layer_scales: Sequence[float]) -> _strategies.ScaledClipping:
        """The strategy of ``ScaledClip(...)`` (``num_params`` is not used)."""
        return _strategies.ScaledClipping(max_grad_norm, tuple(layer_scales))
