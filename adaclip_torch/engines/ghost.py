"""The ghost engine: clip ``nn.Linear`` / ``nn.Embedding`` (and convolutions) without their per-example gradients.

For the modules :func:`adaclip_torch.ghost.ghost_modules` selects, the hooks keep each call's
input and output gradient (:meth:`~adaclip_torch.grad_sample.GradSampleHooks.capture_only`)
instead of forming ``p.grad_sample``; a :class:`~adaclip_torch.ghost.GhostLayer` built from
them stands for the ``(n, *shape)`` per-example gradients of the module's parameters:

- ``norm(name, a, b)`` is an *upper bound* of ``‖(g_i − a)/b‖²``: the expansion
  ``Σ D g_i² − 2 Σ (D a) g_i + Σ D a²`` (``D = 1/b²``) evaluated by matrix products, plus a
  bound on its rounding error (the formulas and the bound: :mod:`adaclip_torch.ghost`).
  Rounding can only over-clip;
- ``weighted_sum(name, c)`` is ``Σ_i c_i g_i`` (one product ``Eᵀ diag(c) X``), so the clipped
  sum is ``S = (Σ_i c_i g_i − (Σ_i c_i) a)/b``, the identity the materialised path uses. A
  unit whose norm is not finite (a NaN/inf input or output gradient) has the factor 0 and
  contributes exactly 0 (its rows are dropped, not multiplied).

The other parameters keep their ``p.grad_sample``; both kinds of source go through the same
:meth:`~adaclip_torch.engines.materialise.MaterialisedEngine.clipped_sum`, whose factors see
every tensor's norm (the clip groups span ghost and materialised tensors alike). Paths that
need every per-example gradient (per-user sums, :meth:`collect`) materialise the ghost layers.
A parameter shared by several ``nn.Linear``/``nn.Embedding`` modules (tied input/output
embeddings) is a :class:`~adaclip_torch.ghost.TiedGhost`: its per-example gradient is the sum over
its uses, whose norm includes the cross terms between them (:func:`~adaclip_torch.ghost.tied_ghost_groups`
selects them); any other shared parameter stays materialised.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from torch import nn

from adaclip_torch.engines.base import EngineContext, StepInputs
from adaclip_torch.engines.materialise import MaterialisedEngine
from adaclip_torch.ghost import GhostLayer, TiedGhost, ghost_kind, ghost_modules, tied_ghost_groups
from adaclip_torch.grad_sample import GradSampleHooks
from adaclip_torch.grad_sample.ghost_layer import build_layers

__all__ = ["GhostEngine"]


class GhostEngine(MaterialisedEngine):
    """Ghost norms for the eligible modules (``per_sample_mode="ghost"`` or ``"auto"``), the
    materialised path for the rest.

    Construction selects the modules (convolutions only in ``"ghost"``, the memory mode) and
    switches the hooks to capturing their calls (``hooks.capture_only``)."""

    def __init__(
        self, context: EngineContext, *, model: nn.Module, mode: str, hooks: GradSampleHooks
    ) -> None:
        super().__init__(context)
        self.mode = mode
        hooked = hooks.ruled_modules
        self._kinds: dict[nn.Module, str] = ghost_modules(
            model, context.params, convolutions=mode == "ghost", hooked=hooked
        )
        # param index -> (ghost module, parameter name in it)
        index = {id(p): k for k, p in enumerate(context.params)}
        self._params: dict[int, tuple[nn.Module, str]] = {}
        # param index -> every (module, name) using it, for tied weights (summed per example)
        self._tied: dict[int, list[tuple[nn.Module, str]]] = {}
        for p, holders in tied_ghost_groups(model, context.params, hooked=hooked):
            self._tied[index[id(p)]] = holders
            for m, _ in holders:
                kind = ghost_kind(m)
                assert kind is not None
                self._kinds[m] = kind
        tied = {id(context.params[k]) for k in self._tied}
        for m in self._kinds:
            for name, p in m._parameters.items():
                if p is not None and p.requires_grad and id(p) not in tied:
                    self._params[index[id(p)]] = (m, name)
        hooks.capture_only(self._kinds)

    @property
    def tied(self) -> dict[str, list[str]]:
        """The tied parameters on the ghost path: name -> the modules using it (by class)."""
        names = self._context.param_names
        return {names[k]: [f"{type(m).__name__}.{n}" for m, n in holders] for k, holders in self._tied.items()}

    @property
    def modules(self) -> dict[nn.Module, str]:
        """The modules on the ghost path and their kind (``"linear"``, ``"linear_t"`` for
        ``transformers``' ``Conv1D``, ``"embedding"``, ``"conv"``)."""
        return dict(self._kinds)

    def _layers(self, inputs: StepInputs) -> dict[nn.Module, GhostLayer]:
        """The ghost modules' captured calls of this batch (empty when none were captured)."""
        if not self._kinds or inputs.hooks is None:
            return {}
        return build_layers(self._kinds, inputs.hooks.captures, self._context.dtype, self.mode)

    def _batch(self, inputs: StepInputs) -> tuple[list[Any], Collection[GhostLayer]]:
        layers = self._layers(inputs)
        out: list[Any] = []
        for k, p in enumerate(self._context.params):
            holders = self._tied.get(k)
            if holders is not None:
                parts = [(layers[m], name) for m, name in holders if m in layers]
                out.append((TiedGhost(parts), "weight") if parts else getattr(p, "grad_sample", None))
                continue
            ghost = self._params.get(k)
            if ghost is not None and ghost[0] in layers:
                out.append((layers[ghost[0]], ghost[1]))
            else:
                out.append(getattr(p, "grad_sample", None))
        return out, layers.values()
