"""The kernel engine: the fused Triton passes of :mod:`adaclip_torch.kernels` for flat clipping and the patent's AdaCliP.

A step on a fresh batch takes two passes, one launch per parameter tensor each, on the
materialised per-unit gradients seen as ``(n, P_k)`` rows:

1. :meth:`KernelEngine.clip`: per tensor an *upper bound* of ``‖(g_i − m)/b‖²`` (the blocked
   float32 sum times ``1 + η``, :func:`adaclip_torch.kernels.reference.sq_norms_margin`, so
   rounding can only over-clip), with ``b = C`` (flat clipping) or AdaCliP's coupled
   ``b = √s·√Σs`` built in the kernel from ``s`` and the whole vector's ``Σ s``; then the
   clip factors ``c_i = min(1, 1/‖w_i‖)`` of the total (:func:`adaclip.strategies.group_clip_factors`:
   0 for a unit whose norm is not finite);
2. :meth:`KernelEngine.release`: the clipped sum ``Σ_i c_i (g_i − m)/b`` (a row with
   ``c_i = 0`` or NaN is dropped, not multiplied, so a non-finite unit contributes exactly 0),
   plus ``σ z`` with ``z`` drawn once from the optimizer's noise generator, then
   ``b ⊙ (·)/B̄ + m`` (flat clipping: ``C·(·)/B̄``) and, for AdaCliP, the moment update from
   the released gradient only. The kernels build ``b`` from the same ``s`` and ``Σ s`` as
   pass 1, bit for bit, so the factors were computed for the ``b`` that is applied.

The result is the core path's step to float32 rounding (the tests check them against each
other on the same noise). Virtual steps, given units and empty batches take the core path:
for them this engine is the materialised one (:meth:`unit_sources`, :meth:`clipped_sum`).

:func:`resolve_kernel` decides whether the kernels can serve an optimizer
(``DPOptimizer(use_kernel=...)``) and says what prevents them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar, NamedTuple

import torch

from adaclip import strategies as _strategies
from adaclip.errors import InvalidHyperparameterError
from adaclip.strategies import ClipState
from adaclip_torch import kernels
from adaclip_torch.engines.base import StepInputs
from adaclip_torch.engines.materialise import MaterialisedEngine
from adaclip_torch.noise import NoiseSource

__all__ = ["KernelEngine", "ClippedUnits", "kernel_refusals", "resolve_kernel"]

Tensor = torch.Tensor

#: The options of :class:`~adaclip.strategies.AdaptiveClipping` that ``is_patent`` reads, with
#: the patent's values (the fused kernels implement exactly these).
_PATENT_OPTIONS: dict[str, Any] = {
    "scale": "coupled",
    "statistic": "deviation",
    "correction": "clamp",
    "pooling": "coordinate",
    "update_every": 1,
    "centre": "ema",
    "freeze_statistics": False,
}


def _non_patent_options(strategy: Any) -> list[str]:
    """``name=value`` for each option of an AdaptiveClipping that differs from the patent's."""
    return [f"{k}={getattr(strategy, k)!r}" for k, v in _PATENT_OPTIONS.items() if getattr(strategy, k) != v]


def kernel_refusals(
    strategy: Any, *, per_sample_mode: str, distributed: bool, dtype: torch.dtype, params: Sequence[Tensor]
) -> list[str]:
    """Why the fused kernels cannot serve this configuration (``[]``: they can)."""
    device = params[0].device
    reasons = []
    if type(strategy) is _strategies.AdaptiveClipping:
        if not strategy.is_patent:
            reasons.append(
                "they implement the patent's AdaCliP only (AdaptiveClipping with every option at its "
                f"default, is_patent), and this one sets {', '.join(_non_patent_options(strategy))}"
            )
    elif type(strategy) is not _strategies.FlatClipping:
        reasons.append(f"they implement AdaCliP and flat clipping, not {type(strategy).__name__}")
    if getattr(strategy, "num_auxiliary", 0):
        reasons.append(
            "the strategy releases auxiliary sums (a clip count), which the kernels do not compute"
        )
    if per_sample_mode != "materialise":
        reasons.append("they read materialised per-example gradients (per_sample_mode='materialise')")
    if distributed:
        reasons.append("distributed=True adds the noise after the all-reduce, not in the clipping pass")
    if dtype != torch.float32:
        reasons.append(f"they keep float32 statistics, these parameters give {dtype}")
    if any(p.device != device for p in params):
        reasons.append("the parameters are on more than one device")
    elif not kernels.kernel_available(device):
        reasons.append(
            f"Triton cannot run on {device} (it needs triton and CUDA, or TRITON_INTERPRET=1 "
            "set before triton is imported for the CPU interpreter)"
        )
    return reasons


def resolve_kernel(
    use_kernel: bool | None,
    strategy: Any,
    *,
    per_sample_mode: str,
    distributed: bool,
    dtype: torch.dtype,
    params: Sequence[Tensor],
) -> bool:
    """Whether a step runs the fused kernels (``use_kernel`` of
    :class:`~adaclip_torch.optimizer.DPOptimizer`): ``False`` → no; ``None`` → when nothing
    prevents them and the parameters are on CUDA; ``True`` → yes, or
    :class:`~adaclip.errors.InvalidHyperparameterError` naming every reason they cannot run
    (:func:`kernel_refusals`). ``params``: the privatised parameters; ``dtype``: the statistics
    dtype."""
    if use_kernel is False:
        return False
    if use_kernel is not None and use_kernel is not True:
        raise InvalidHyperparameterError(f"use_kernel must be True, False or None, got {use_kernel!r}")
    reasons = kernel_refusals(
        strategy, per_sample_mode=per_sample_mode, distributed=distributed, dtype=dtype, params=params
    )
    if use_kernel is None:
        return not reasons and params[0].device.type == "cuda"
    if reasons:
        raise InvalidHyperparameterError(
            "use_kernel=True, but the fused kernels cannot run here: " + "; ".join(reasons)
        )
    return True


class ClippedUnits(NamedTuple):
    """What :meth:`KernelEngine.clip` hands to :meth:`KernelEngine.release`: the per-unit
    gradients as ``(n, P_k)`` rows, one per tensor, and the ``(n,)`` clip factors ``c_i``."""

    units: list[Tensor]
    factors: Tensor


class KernelEngine(MaterialisedEngine):
    """The fused kernels (``use_kernel``) on materialised per-example or per-user gradients;
    flat clipping or the patent's AdaCliP, float32, one device, not distributed
    (:func:`resolve_kernel`)."""

    fuses_release: ClassVar[bool] = True

    def clip(self, inputs: StepInputs, strategy: Any, user_ids: Tensor | None = None) -> ClippedUnits:
        """Per-unit gradients as ``(n, P_k)`` rows and their clip factors ``c_i`` (kernel pass 1).

        Each tensor is one launch; AdaCliP's ``b_k`` comes from the whole vector's ``Σ s``. The
        kernels' norms are upper bounds and a non-finite unit gets the factor 0, which the
        release kernel drops, as on the core path."""
        # lazy: triton is optional and heavy; importing adaclip_torch must not import it
        from adaclip_torch.kernels import triton_adaclip

        sources = self.unit_sources(inputs, user_ids, require=True)
        assert sources is not None
        shapes = self._context.shapes
        n = int(sources[0].shape[0])
        units = [g.reshape(n, math.prod(shape)) for g, shape in zip(sources, shapes, strict=True)]
        state = inputs.state
        if state.std is None:  # flat clipping: one scalar scale C
            inv_c = 1.0 / float(inputs.transformed(strategy)[1][0])
            sq = [triton_adaclip.transformed_sq_norms(g, None, inv_b=inv_c) for g in units]
        else:  # the kernels form b from s and Σs themselves, bit for bit as the release will
            std_sum = _std_sum(state)
            sq = [
                triton_adaclip.transformed_sq_norms(g, m.reshape(-1), s.reshape(-1), std_sum=std_sum)
                for g, m, s in zip(units, state.mean, state.std, strict=True)
            ]
        self._check_nonfinite(inputs, sq)
        return ClippedUnits(units, _strategies.group_clip_factors(strategy, sq)[0])

    def release(
        self,
        inputs: StepInputs,
        strategy: Any,
        pending: ClippedUnits,
        noise_multiplier: float,
        *,
        noise: NoiseSource,
        expected_batch_size: float,
    ) -> tuple[list[Tensor], ClipState]:
        """Kernel pass 2, one launch per tensor: ``Σ_i c_i g_i``, noise, rescale and (AdaCliP)
        the moment update, with ``z`` drawn from ``noise`` (the optimizer's generator)."""
        # lazy: triton is optional and heavy; importing adaclip_torch must not import it
        from adaclip_torch.kernels import triton_adaclip

        units, factors = pending
        ctx = self._context
        if noise_multiplier > 0:
            z_all = [z.reshape(-1) for z in noise.standard_normal(ctx.params, dtype=ctx.dtype)]
        else:  # σ = 0: no draw, as in the core path (the generator does not advance)
            z_all = [torch.zeros(g.shape[1], dtype=g.dtype, device=g.device) for g in units]
        mechanism = {"noise_multiplier": noise_multiplier, "expected_batch_size": expected_batch_size}
        state = inputs.state
        if isinstance(strategy, _strategies.FlatClipping):
            grads = [
                triton_adaclip.fused_flat_release(
                    g, factors, max_grad_norm=strategy.max_grad_norm, noise=z, **mechanism
                )
                for g, z in zip(units, z_all, strict=True)
            ]
            new_state = state._replace(step=state.step + 1)
        else:
            std_sum = _std_sum(state)
            outs = [
                triton_adaclip.fused_release(
                    g,
                    factors,
                    m.reshape(-1),
                    s.reshape(-1),
                    noise=z,
                    std_sum=std_sum,
                    beta_mean=strategy.beta_mean,
                    beta_std=strategy.beta_std,
                    std_min=strategy.std_min,
                    std_max=strategy.std_max,
                    **mechanism,
                )
                for g, m, s, z in zip(units, state.mean, state.std, z_all, strict=True)
            ]
            grads = [o[0] for o in outs]
            new_state = ClipState(
                step=state.step + 1,
                mean=[o[1].reshape(shape) for o, shape in zip(outs, ctx.shapes, strict=True)],
                std=[o[2].reshape(shape) for o, shape in zip(outs, ctx.shapes, strict=True)],
                extra=state.extra,
            )
        return [g.reshape(shape) for g, shape in zip(grads, ctx.shapes, strict=True)], new_state


def _std_sum(state: ClipState) -> Tensor:
    """``Σ_j s_j`` over the whole vector, the one value both kernel passes build ``b`` from."""
    return torch.stack([s.sum() for s in state.std]).sum()
