"""The release of a private step: noise once, rescale, update the strategy's state.

Given the clipped sum of a step (the K per-tensor sums, then the strategy's auxiliary 0-d
sums), :func:`release` draws the noise — locally, or added by rank 0 inside the noisy
all-reduce with ``distributed=True``, correlated with the banded stream's buffers when there
is one — and hands it to :func:`adaclip.strategies.release`, which computes

.. math::  \\tilde g_t = a_t + b_t ⊙ \\frac{\\sum_i \\bar w_i + σ_t z}{\\bar B}

and the next state (nothing is re-derived here). The gradient's entries get ``σ_g`` and the
auxiliary ones ``σ_aux``, ``(σ_g, σ_aux) = strategy.noise_multipliers(σ_t, B̄)``
(:meth:`adaclip.strategies.Strategy.noise_multipliers`), while the accountant records ``σ_t``.

Two caches serve the release and the clipping before it: :class:`CompileCache`
(``compile_release=True``: the release and the transform run under ``torch.compile``, made
once per function) and :class:`TransformCache` (the centre and scale ``(a, b)`` of the
current state, computed once: every unit is clipped in the space of the ``(a, b)`` the step
releases with, which is what the sensitivity argument needs).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from adaclip import strategies as _strategies
from adaclip.strategies import ClipState
from adaclip_torch.distributed import noisy_all_reduce, sharded_noisy_all_reduce
from adaclip_torch.noise import NoiseSource

__all__ = ["CompileCache", "Releaser", "TransformCache", "release"]

Tensor = torch.Tensor


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


class CompileCache:
    """``fn``, or with :attr:`enabled` its ``torch.compile`` (made once per function).

    The compiled path equals the eager one up to float rounding (not bit for bit); the
    eager path is untouched when disabled."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._compiled: dict[Callable[..., Any], Callable[..., Any]] = {}

    def __call__(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        if not self.enabled:
            return fn
        compiled = self._compiled.get(fn)
        if compiled is None:
            traced = torch.compile(fn)

            def compiled(*args: Any, **kwargs: Any) -> Any:
                with _quiet_dynamo():  # only around compiled calls: the eager path stays untouched
                    return traced(*args, **kwargs)

            self._compiled[fn] = compiled
        return compiled


class TransformCache:
    """``strategy.transform`` of a state (the centre ``a`` and scale ``b``), computed once per
    state: the clipping pass and the release of a step share it. Keyed by the state's identity
    and the strategy; :meth:`forget` drops it when the state moves on."""

    def __init__(self, compile_cache: CompileCache, num_tensors: int) -> None:
        self._compile = compile_cache
        self._num_tensors = num_tensors
        self._cached: tuple[ClipState, Any, tuple[Any, Any]] | None = None

    def __call__(self, strategy: Any, state: ClipState) -> tuple[Any, Any]:
        cached = self._cached
        if cached is None or cached[0] is not state or cached[1] != strategy:
            value = self._compile(_transform_of)(strategy, state, self._num_tensors)
            self._cached = cached = (state, strategy, value)
        return cached[2]

    def forget(self) -> None:
        """Drop the cached transform (it holds the old state's scale)."""
        self._cached = None


class Releaser:
    """The release part of a private step, and the state it owns: the noise source ``noise``,
    the correlated noise stream ``stream`` (``None``: independent noise), the strategy's state
    ``state`` (a function of released values only), and the caches of its transform and of the
    compiled release.

    A step asks it, in order: :meth:`check` (σ's split, before anything changes),
    :meth:`transformed` (the ``(a, b)`` the units are clipped with, computed once per state),
    :meth:`release` (noise once, rescale, the next state, which stays pending; or
    :meth:`release_fused` for an engine that fuses its clip with the release), and then
    :meth:`commit` (the state moves on, the stream advances) or, if the step failed before
    anything left, :meth:`rollback` (the generator rewinds to where the release found it, the
    stream drops its pending draw). The optimizer that holds it owns the rest (the accountant, the pending
    sum, the sampler's count, the averaging).

    The parts are set as the optimizer is built (``noise``, ``stream`` and ``state`` start as
    ``None``; ``transforms`` needs the number of tensors): see
    :class:`~adaclip_torch.optimizer.DPOptimizer`.
    """

    def __init__(self, *, compile_cache: CompileCache, expected_batch_size: float, distributed: bool) -> None:
        self.compile = compile_cache
        self.expected_batch_size = expected_batch_size
        self.distributed = distributed
        self.noise: NoiseSource | None = None
        self.stream: Any = None
        self.state: ClipState | None = None
        self.transforms: TransformCache | None = None
        self._undo: Any = None  # the generator's state before the pending release

    def check(self, strategy: Any, noise_multiplier: float) -> tuple[Any, Any]:
        """``(σ_g, σ_aux)`` of a step accounted at σ: the strategy protocol's
        :meth:`adaclip.strategies.Strategy.noise_multipliers`, which the core's release also
        calls (``(σ, 0)`` for every strategy without auxiliary sums). Raises
        :class:`InvalidHyperparameterError`, changing nothing, for a σ the strategy cannot split
        (the quantile rule needs ``σ < 2σ_b``)."""
        return strategy.noise_multipliers(noise_multiplier, self.expected_batch_size)

    def transformed(self, strategy: Any) -> tuple[Any, Any]:
        """``strategy.transform`` of the current state (the centre ``a`` and scale ``b``),
        computed once per state: the clipping pass and the release of a step share it."""
        return self.transforms(strategy, self.state)  # type: ignore[misc]

    def restore(self, state: ClipState) -> None:
        """Replace the state (a checkpoint, public statistics) and drop the cached transform."""
        self.state = state
        self.transforms.forget()  # type: ignore[union-attr]

    def _remember(self) -> None:
        """Keep the generator's state for :meth:`rollback` (not in secure mode, whose generator
        never rewinds)."""
        self._undo = None if self.noise.secure_mode else self.noise.snapshot()  # type: ignore[union-attr]

    def release(self, strategy: Any, summed: list[Tensor], noise_multiplier: float) -> tuple[list[Tensor], ClipState]:
        """:func:`release` of ``summed`` with this part's noise, stream and state: the noisy
        gradient and the next state (not yet the current one: :meth:`commit`)."""
        self._remember()
        return release(
            strategy, self.state, summed, noise_multiplier, noise=self.noise, stream=self.stream,  # type: ignore[arg-type]
            distributed=self.distributed, expected_batch_size=self.expected_batch_size,
            transformed=self.transformed(strategy), compile_cache=self.compile,
        )  # fmt: skip

    def release_fused(self, engine: Any, inputs: Any, strategy: Any, clipped: Any, noise_multiplier: float) -> tuple[list[Tensor], ClipState]:
        """The release of an engine that fuses its clip with it (``engine.release``), with this
        part's noise: the noisy gradient and the next state (pending, as :meth:`release`)."""
        self._remember()
        return engine.release(
            inputs, strategy, clipped, noise_multiplier, noise=self.noise, expected_batch_size=self.expected_batch_size
        )

    def commit(self, new_state: ClipState | None) -> None:
        """The step is released: the state moves on (``None``: the release failed after the noise
        was sent to other ranks — the statistics stay) and the stream advances."""
        self._undo = None
        if new_state is not None:
            self.restore(new_state)  # the cache holds the old state's scale: let it go
        if self.stream is not None:
            self.stream.commit()

    def rollback(self) -> None:
        """Undo a step that failed before its release: the generator (to where the release
        found it) and the stream's pending draw."""
        undo, self._undo = self._undo, None
        if undo is not None:
            self.noise.restore(undo)  # type: ignore[union-attr]
        if self.stream is not None:
            self.stream.discard()


def release(
    strategy: Any,
    state: ClipState,
    summed: list[Tensor],
    noise_multiplier: float,
    *,
    noise: NoiseSource,
    stream: Any,
    distributed: bool,
    expected_batch_size: float,
    transformed: tuple[Any, Any],
    compile_cache: CompileCache,
) -> tuple[list[Tensor], ClipState]:
    """Noise once, rescale, update the state (locally, or across ranks).

    ``summed`` holds the K per-tensor sums then the auxiliary sums. Locally one standard
    normal is drawn per entry (a 0-d draw per auxiliary sum) and
    :func:`adaclip.strategies.release` multiplies them by ``(σ_g, σ_aux)``. With
    ``distributed=True`` rank 0 adds ``σ_g·z`` to the tensors and ``σ_aux·z`` to the
    auxiliary entries before the all-reduce, and the release adds nothing (``noise=None``).
    ``stream`` is the banded noise's :class:`~adaclip_torch.correlated.NoiseStream` (``None``:
    independent noise); ``transformed`` the ``(a, b)`` the units were clipped with."""
    extra: dict[str, Any] = {}
    num = _strategies.num_tensors_of(strategy, summed)
    if distributed:
        summed = _noisy_all_reduce(strategy, summed, noise_multiplier, num, noise, stream, expected_batch_size, extra)
        draws = None
    else:
        draws = noise.standard_normal(summed) if noise_multiplier > 0 else None
    if draws is not None and stream is not None:
        # correlated noise on the gradient's entries; the auxiliary sums keep fresh draws
        draws = stream.correlate(draws[:num]) + list(draws[num:])
        extra["noise_variance"] = stream.variance()
    return compile_cache(_strategies.release)(
        strategy,
        state,
        summed,
        draws,
        noise_multiplier=noise_multiplier,
        expected_batch_size=expected_batch_size,
        transformed=transformed,
        **extra,
    )


def _noisy_all_reduce(
    strategy: Any,
    summed: list[Tensor],
    noise_multiplier: float,
    num: int,
    noise: NoiseSource,
    stream: Any,
    expected_batch_size: float,
    extra: dict[str, Any],
) -> list[Tensor]:
    """The all-reduced sums with rank 0's noise in them (``σ_g`` on the ``num`` tensors, ``σ_aux``
    on the auxiliary entries); with banded noise, sets ``extra["noise_variance"]``."""
    sigma_grad, sigma_aux = strategy.noise_multipliers(noise_multiplier, expected_batch_size)
    multipliers = [sigma_grad] * num + [sigma_aux] * (len(summed) - num)
    if stream is not None and stream.shard is not None and noise_multiplier > 0:
        # sharded noise state: every rank draws and correlates its own slice of the coordinates
        extra["noise_variance"] = stream.variance()
        return sharded_noisy_all_reduce(
            summed, noise, num_tensors=num, sigma_grad=sigma_grad, sigma_aux=sigma_aux, shard=stream.shard,
            correlate=stream.correlate, advance=stream.advance,
        )  # fmt: skip
    correlate = None
    if stream is not None and noise_multiplier > 0:
        # banded: rank 0 (the only one that draws) correlates its draws with its
        # buffers; the other ranks only move their streams' position (same v_t)
        extra["noise_variance"] = stream.variance()
        correlate = lambda z: stream.correlate(z[:num]) + list(z[num:])  # noqa: E731
        stream.advance()  # replaced by correlate's pending state on rank 0
    return noisy_all_reduce(summed, noise, multipliers, correlate=correlate)
