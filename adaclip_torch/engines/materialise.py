"""The materialised engine: clip the ``(n, *shape)`` per-example gradients the hooks left in ``p.grad_sample``.

Per tensor ``k`` the squared transformed norms are computed as in
:func:`adaclip.transform.transformed_sq_norms`, an *upper bound* of the exact

.. math::
    ‖(g_{ik} - a_k)/b_k‖^2 = \\sum_j \\big((g_{ikj} - a_{kj})\\cdot(1/b_{kj})\\big)^2,

the computed sum times ``1 + η`` with ``η`` = :func:`adaclip.transform.rounding_margin` of
the tensor's size (so rounding can only over-clip), a chunk of rows at a time in one reused,
cache-sized buffer (:func:`_chunked_sq_norms`). The clip factors come from
:func:`adaclip.strategies.group_clip_factors` and the sums
``S_k = (Σ_i c_i g_ik − (Σ_i c_i) a_k)/b_k`` from :func:`adaclip.transform.clipped_sum`: a
unit whose norm is not finite has the factor 0 and its rows are dropped (set to 0, not
multiplied: ``0·NaN`` is NaN), so it contributes exactly 0 and the release stays finite.

The same :meth:`MaterialisedEngine.clipped_sum` serves every engine's core path: its sources
may also be ghost ``(GhostLayer, name)`` pairs (:mod:`adaclip_torch.engines.ghost`), whose
``norm`` is an upper bound too and whose ``weighted_sum`` drops units with factor 0.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import torch

from adaclip import strategies as _strategies
from adaclip import transform as _transform
from adaclip.errors import InvalidGradientError
from adaclip.transform import check_per_example_grads
from adaclip_torch._precision import full_float32_precision
from adaclip_torch.engines.base import PerSampleEngine, Source, StepInputs, group_by_unit
from adaclip_torch.ghost import GhostLayer

__all__ = ["MaterialisedEngine"]

Tensor = torch.Tensor

# Rows of one chunk of the norm computation: a cache-sized working buffer, reused.
_NORM_CHUNK_ELEMENTS = 1 << 18


def _chunked_sq_norms(g: Tensor, centre: Tensor | None, scale: Any) -> Tensor:
    """:func:`adaclip.transform.transformed_sq_norms` of one tensor: an upper bound of
    ``Σ ((g_i − a)·(1/b))²``, computed a chunk of rows at a time in one reused, cache-sized
    buffer (equal to the core up to rounding, with the same rounding margin; the core's
    elementwise expression allocates ``(n, *shape)`` temporaries)."""
    n = int(g.shape[0])
    if n == 0 or g.ndim == 1:
        return _transform.transformed_sq_norms([g], None if centre is None else [centre], [scale])[0]
    width = g[0].numel()
    rows = max(1, min(n, _NORM_CHUNK_ELEMENTS // max(1, width)))
    inv = 1.0 / scale
    buf = torch.empty((rows, *g.shape[1:]), dtype=g.dtype, device=g.device)
    out = torch.empty(n, dtype=g.dtype, device=g.device)
    dims = tuple(range(1, g.ndim))
    for s in range(0, n, rows):
        chunk = g[s : s + rows]
        w = buf[: chunk.shape[0]]
        if centre is None:
            torch.mul(chunk, inv, out=w)
        else:
            torch.sub(chunk, centre, out=w)
            w.mul_(inv)
        torch.sum(w.mul_(w), dim=dims, out=out[s : s + chunk.shape[0]])
    return out.mul_(1.0 + _transform.rounding_margin(g.dtype, width))


def _by_ghost_source(sources: Sequence[Source]) -> list[tuple[Any, list[int]]]:
    """The ghost sources among ``sources`` (``(layer, name)`` pairs), each with the indices of
    its parameters, in order of first appearance."""
    groups: dict[int, tuple[Any, list[int]]] = {}
    for k, src in enumerate(sources):
        if not isinstance(src, Tensor):
            groups.setdefault(id(src[0]), (src[0], []))[1].append(k)
    return list(groups.values())


class MaterialisedEngine(PerSampleEngine):
    """Per-example gradients of every layer, read from ``p.grad_sample`` (``per_sample_mode="materialise"``).

    Subclasses change where the sources come from (:meth:`_batch`): the ghost engine
    replaces some parameters' tensors with ghost pairs, the kernel engine fuses the step.
    """

    def unit_sources(
        self, inputs: StepInputs, user_ids: Tensor | None = None, *, require: bool
    ) -> list[Source] | None:
        if user_ids is None:
            sources = self._sources(inputs)
        else:
            grads = self.collect(inputs)
            sources = None if grads is None else group_by_unit(grads, user_ids)
        if sources is None:
            if require:
                raise InvalidGradientError(
                    "step() without backward: no parameter has grad_sample; call loss.backward() "
                    "on a forward pass of the wrapped model first"
                )
            if user_ids is not None:
                raise InvalidGradientError("user_ids given but there are no per-example gradients")
        return sources

    def collect(self, inputs: StepInputs) -> list[Tensor] | None:
        # ghost layers' gradients are formed here: only for paths that need them all
        sources = self._sources(inputs)
        if sources is None:
            return None
        return [g if isinstance(g, Tensor) else g[0].materialise(g[1]) for g in sources]

    @full_float32_precision()
    def clipped_sum(self, inputs: StepInputs, strategy: Any, sources: Sequence[Source]) -> list[Tensor]:
        """:func:`adaclip.strategies.clip_and_sum` for ``sources`` (per-example gradient tensors
        and/or ghost layers): every tensor's norm bound first (the clip factor needs the
        total), then the clipped sums ``Σ_i c_i (g_i − a)/b``, then the strategy's
        ``num_auxiliary`` 0-d auxiliary sums (:func:`adaclip.strategies.auxiliary_sums`, from the
        same bounds and factors). Same operations as the core, in chunks; a unit with a
        non-finite norm gets the factor 0 and contributes nothing.

        Runs with float32 matrix products in full precision whatever the user's
        ``torch.set_float32_matmul_precision`` (:class:`~adaclip_torch._precision.full_float32_precision`):
        the ghost norms and every clipped sum are matrix products, and TF32/bfloat16 inputs
        would let a unit's contribution exceed the norm bound it was clipped with."""
        centre, scale = inputs.transformed(strategy)
        centres = [None] * len(sources) if centre is None else centre
        ghosts = _by_ghost_source(sources)
        sq: list[Any] = [None] * len(sources)
        for k, src in enumerate(sources):
            if isinstance(src, Tensor):
                sq[k] = _chunked_sq_norms(src, centres[k], scale[k])
        for ghost, ks in ghosts:  # inside this method's guard; each ghost source asked once
            norms = ghost.norms_within_guard([sources[k][1] for k in ks], [centres[k] for k in ks], [scale[k] for k in ks])
            for k, norm in zip(ks, norms, strict=True):
                sq[k] = norm
        self._check_nonfinite(inputs, sq)
        factors = _strategies.group_clip_factors(strategy, sq)
        nonfinite = _transform.nonfinite_units(sq)
        if not bool(nonfinite.any()):  # one check for the whole step (a sync on GPU)
            nonfinite = False
        weighted: dict[int, Tensor] = {}
        for ghost, ks in ghosts:
            sums = ghost.weighted_sums_within_guard([sources[k][1] for k in ks], [factors[k] for k in ks])
            weighted.update(zip(ks, sums, strict=True))
        summed = []
        for k, src in enumerate(sources):
            a = centres[k]
            if isinstance(src, Tensor):
                args = ([src], None if a is None else [a], [scale[k]], [factors[k]])
                summed.append(_transform.clipped_sum(*args, nonfinite=nonfinite)[0])
            else:
                w = weighted.pop(k)
                if a is not None:  # Σ c_i g_i − (Σ c_i)·a in one pass
                    w = torch.addcmul(w, a, factors[k].sum().to(w.dtype), value=-1.0)
                summed.append(w / scale[k])
        # the strategy's auxiliary sums (the quantile rule's count) from the same bounds and
        # factors as the clipping: extra entries that ride along to the release
        return summed + _strategies.auxiliary_sums(strategy, inputs.state, sq, factors)

    def _batch(self, inputs: StepInputs) -> tuple[list[Any], Collection[GhostLayer]]:
        """Per parameter its raw source (``p.grad_sample``, ``None`` where there is none), and
        the ghost layers among them (none here)."""
        return [getattr(p, "grad_sample", None) for p in self._context.params], ()

    def _sources(self, inputs: StepInputs) -> list[Source] | None:
        """Per parameter its ``grad_sample`` or ``(GhostLayer, name)``; ``None`` if none.

        Shapes are checked here; NaN/inf entries are handled by the clipped sums (a non-finite
        entry makes its unit's norm non-finite: the unit is dropped, or ``nonfinite="raise"``
        raises), which also saves a full pass over the per-example gradients."""
        out, layers = self._batch(inputs)
        if all(g is None for g in out):
            return None
        ctx = self._context
        for name, g in zip(ctx.param_names, out, strict=True):
            if g is None:
                raise InvalidGradientError(
                    f"parameter {name!r} has no grad_sample while others do: it was not used in the "
                    "forward pass or its layer type has no per-example gradient rule"
                )
            if not isinstance(g, (Tensor, tuple)):
                raise InvalidGradientError(f"grad_sample of {name!r} is not a tensor: {type(g).__name__}")
        materialised = [(k, g) for k, g in enumerate(out) if isinstance(g, Tensor)]
        if materialised:  # (all on the ghost path: nothing to check here)
            check_per_example_grads(
                [g for _, g in materialised],
                [ctx.shapes[k] for k, _ in materialised],
                allow_empty=True,
                check_finite=False,
                names=[ctx.param_names[k] for k, _ in materialised],
            )
        ns = {int(g.shape[0]) for _, g in materialised} | {layer.n for layer in layers}
        if len(ns) > 1:
            raise InvalidGradientError(f"per-example gradients with different batch sizes {sorted(ns)}")
        return [g.detach().to(ctx.dtype) if isinstance(g, Tensor) else g for g in out]
