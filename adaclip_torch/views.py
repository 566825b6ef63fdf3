"""The public, read-only side of :class:`~adaclip_torch.optimizer.DPOptimizer`.

Two mixins the optimizer inherits, so that what a user reads about the mechanism lives apart
from how a step is made:

- :class:`HyperparameterViews`: the mechanism's hyperparameters under Opacus's attribute names
  (``noise_multiplier``, ``max_grad_norm``, ``expected_batch_size``, ``sample_rate``), the
  schedule's ``(σ_t, C_t)``, the noise mechanism, the spent ε. They are fixed at construction:
  assigning one (which Opacus allows) would change the privacy of every later step behind the
  accountant's back, so each setter refuses with the way to do it here.
- :class:`StatisticsViews`: the clipping statistics — the strategy's state, the centre and
  scale the next step clips with (functions of earlier releases only, so public), and shaping
  them with public gradients.

Both read the optimizer's own attributes (``_steps``, ``noise_schedule``, ``strategy``,
``_clip_state``, ``_stream``, ...), set by :class:`DPOptimizer.__init__`; neither holds state.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch

from adaclip import schedules as _schedules
from adaclip import strategies as _strategies
from adaclip.errors import InvalidGradientError, InvalidHyperparameterError
from adaclip.strategies import ClipState
from adaclip_torch.engines import PerSampleEngine
from adaclip_torch.noise import NoiseSource

__all__ = ["HyperparameterViews", "StatisticsViews"]

Tensor = torch.Tensor


class _ReadOnlyError(InvalidHyperparameterError, AttributeError):
    """An Opacus-style attribute that is read-only here (or absent for this strategy): an
    :class:`InvalidHyperparameterError` that is also an ``AttributeError``, so ``getattr(opt,
    name, default)`` and ``hasattr`` behave as for a missing attribute."""


class HyperparameterViews:
    """The mechanism's hyperparameters, read-only (a mixin of
    :class:`~adaclip_torch.optimizer.DPOptimizer`)."""

    # set by DPOptimizer.__init__
    _steps: int
    _expected_batch_size: float
    _sample_rate: float | None
    _fsdp: bool
    _stream: Any
    _engine: PerSampleEngine
    _noise: NoiseSource
    _clip_state: ClipState
    noise_schedule: Any
    strategy: Any
    accountant: Any

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

    @property
    def noise_mechanism(self) -> str:
        """``"independent"``, ``"banded"`` or ``"blt"``."""
        return "independent" if self._stream is None else self._stream.kind

    @property
    def noise_coefficients(self) -> tuple[float, ...] | None:
        """The banded noise's coefficients ``c_0 … c_{b−1}`` (public: they are hyperparameters);
        ``None`` with independent or BLT noise (BLT's ``θ, ω``: :attr:`correlated_noise`)."""
        if self._stream is None or self._stream.kind != "banded":
            return None
        return tuple(self._stream.mechanism.coefficients)

    @property
    def correlated_noise(self) -> Any:
        """The correlated-noise mechanism the optimizer releases with, as a new object carrying
        only its public hyperparameters: :class:`~adaclip.correlated.BandedNoise` (``c``) or
        :class:`~adaclip.correlated.BltNoise` (``θ, ω``); ``None`` with independent noise.

        The stream's buffers (past noise, as secret as the generator) are not part of it, and
        changing the returned object changes nothing in the optimizer."""
        if self._stream is None:
            return None
        mechanism = self._stream.mechanism
        if self._stream.kind == "blt":
            return type(mechanism)(mechanism.theta, mechanism.omega)
        if self._stream.kind == "banded":
            return type(mechanism)(mechanism.coefficients)
        return copy.deepcopy(mechanism)  # another family: its own public hyperparameters

    @property
    def lr_scale(self) -> float:
        """The factor ``ρ`` by which :func:`~adaclip_torch.make_private` multiplied the wrapped
        adaptive optimizer's learning rates for banded noise (``scale_adaptive_lr``; see
        :func:`adaclip.correlated.coefficients.adaptive_lr_scale`); 1.0 when it did not."""
        return float(getattr(self, "_lr_scale", 1.0))

    @property
    def noise_stream_start(self) -> int | None:
        """The step at which the banded noise stream (and its accounting cycle) last (re)started:
        0, or the step of a restore without buffers; ``None`` with independent noise."""
        return None if self._stream is None else int(self._stream.cycle_start)

    @property
    def min_separation(self) -> int | None:
        """With BLT noise, ``b``: the fixed-order sampler's batches per epoch, the separation
        between a unit's steps that the accountant assumes (public); ``None`` otherwise."""
        if self._stream is None or self._stream.kind != "blt":
            return None
        return int(self._stream.cycle)

    @property
    def accounted_sample_rate(self) -> float | None:
        """The rate the accountant records: ``q``, ``p = b·q`` with banded noise, 1 with BLT noise."""
        return self.sample_rate if self._stream is None else self._stream.accounted_rate

    @property
    def bands(self) -> int | None:
        """``b``, the number of bands of the noise: 1 with independent noise (DP-SGD), the banded
        noise's ``b``; ``None`` with BLT noise (its separation is :attr:`min_separation`)."""
        if self._stream is None:
            return 1
        if self._stream.kind != "banded":
            return None
        return len(self._stream.mechanism.coefficients)

    def summary(self) -> str:
        """What this optimizer releases and how it is accounted, one fact per line: the
        clipping, σ and the clip norm of the next step, the noise (mechanism, ``b``), the
        sampling rate and the accounted rate, the learning-rate factor applied to the wrapped
        optimizer, the averaging, and the accountant (method, budget, steps and ε so far).
        Public hyperparameters and counts only. ε is computed at the budget's δ (with PLD an ε
        query takes a fraction of a second)."""
        hp = self.hyperparameters()
        lines = [
            f"{type(self).__name__} over {type(self.original_optimizer).__name__}",
            f"  clipping: {self.strategy!r}",
            f"  noise multiplier (sigma): {hp.noise_multiplier:.6g}; clip norm: "
            f"{'none (AdaCliP scale)' if hp.max_grad_norm is None else f'{hp.max_grad_norm:.6g}'}",
            f"  expected batch size: {self.expected_batch_size:g}",
        ]
        noise = self.noise_mechanism
        if noise == "banded":
            noise += f", b = {self.bands} (coefficients {', '.join(f'{c:.4g}' for c in self.noise_coefficients or ())})"
        elif noise == "blt":
            noise += f", min separation {self.min_separation}"
        shard = getattr(getattr(self, "_stream", None), "shard", None)
        if shard is not None:
            noise += (f"; noise state sharded over {shard.world} ranks (this rank: coordinates {shard.start}.."
                      f"{shard.end}, {self._stream.mechanism.state_size * shard.size} buffer numbers)")  # fmt: skip
        elif self.distributed and noise != "independent":
            noise += "; noise state on rank 0"
        lines.append(f"  noise: {noise}")
        rate = self.sample_rate
        if rate is not None:
            accounted = self.accounted_sample_rate
            lines.append(f"  sample rate q: {rate:.6g}" + ("" if accounted == rate else f"; accounted rate: {accounted:.6g}"))
        if self.lr_scale != 1.0:
            lines.append(f"  learning rate of the wrapped optimizer multiplied by {self.lr_scale:.6g} (scale_adaptive_lr)")
        lines.append(f"  averaging: {'none' if self.average is None else repr(self.average)}")
        acc = self.accountant
        if acc is None:
            lines.append("  accountant: none (the steps are not accounted)")
        else:
            budget = "no budget" if acc.target_epsilon is None else f"budget epsilon={acc.target_epsilon:g} at delta={acc.delta:g}"
            spent = f", epsilon so far {acc.epsilon():.4g}" if acc.delta is not None else ""
            lines.append(f"  accountant: {acc.mechanism}, {budget}; {acc.steps} accounted step(s) after {self.steps} "
                         f"release(s){spent}")  # fmt: skip
        return "\n".join(lines)


class StatisticsViews:
    """The clipping statistics: read them, and shape them with public data (a mixin of
    :class:`~adaclip_torch.optimizer.DPOptimizer`)."""

    # set by DPOptimizer.__init__
    _clip_state: ClipState
    _dtype: torch.dtype
    params: list[Tensor]
    strategy: Any

    @property
    def clip_state(self) -> ClipState:
        """The strategy's state: AdaCliP's ``mean``/``std`` (one tensor per parameter) and the
        options' ``extra`` (e.g. ``extra["clip_norm"]``, the quantile rule's ``C_t``)."""
        return self._clip_state

    def centre_and_scale(self) -> tuple[list[Tensor] | None, list[Tensor]]:
        """The centre ``a`` and scale ``b`` the next :meth:`step` clips with, one entry per
        privatised parameter (``a`` is ``None`` for strategies without a centre; a ``b`` entry
        is a tensor of the parameter's shape, or a 0-d tensor for a per-tensor scale).

        A function of the state, i.e. of earlier releases only: public, like the released
        gradients. A unit ``g`` is clipped as ``w = (g − a)/b`` and the step releases
        ``a + b ⊙ (Σ w̄ + σz)/B̄``; auditors and diagnostics read it.
        """
        self._check_unchanged()
        centre, scale = self._releaser.transformed(self._strategy_at(self._steps))

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
        self._releaser.restore(new_state)
