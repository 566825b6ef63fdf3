"""Per-sample engines: how :class:`~adaclip_torch.optimizer.DPOptimizer` turns a batch into the clipped sum of its units.

The optimizer is the mechanism (checks, schedule, budget, noise once, release, commit,
checkpoints); an engine supplies the per-unit side of a step behind one interface,
:class:`PerSampleEngine` (:mod:`adaclip_torch.engines.base`, with the maths and the privacy
argument shared by all engines):

- :class:`MaterialisedEngine` (``per_sample_mode="materialise"``): the ``(n, *shape)``
  per-example gradients the hooks leave in ``p.grad_sample``;
- :class:`GhostEngine` (``"ghost"``, ``"auto"``): ghost norms for ``nn.Linear`` /
  ``nn.Embedding`` (and convolutions in ``"ghost"``), the materialised path for the rest;
- :class:`KernelEngine` (``use_kernel``): the fused Triton passes, which also release.

:func:`make_engine` picks one.
"""

from __future__ import annotations

from torch import nn

from adaclip.errors import InvalidHyperparameterError
from adaclip_torch.engines.base import EngineContext, PerSampleEngine, Source, StepInputs, group_by_unit
from adaclip_torch.engines.ghost import GhostEngine
from adaclip_torch.engines.kernel import ClippedUnits, KernelEngine, kernel_refusals, resolve_kernel
from adaclip_torch.engines.materialise import MaterialisedEngine
from adaclip_torch.ghost import PER_SAMPLE_MODES
from adaclip_torch.grad_sample import GradSampleHooks

__all__ = [
    "ClippedUnits",
    "EngineContext",
    "GhostEngine",
    "KernelEngine",
    "MaterialisedEngine",
    "PerSampleEngine",
    "Source",
    "StepInputs",
    "group_by_unit",
    "kernel_refusals",
    "make_engine",
    "resolve_kernel",
]


def make_engine(
    per_sample_mode: str,
    context: EngineContext,
    *,
    model: nn.Module,
    hooks: GradSampleHooks | None = None,
    use_kernel: bool = False,
) -> PerSampleEngine:
    """The engine for ``per_sample_mode`` and the *resolved* ``use_kernel``
    (:func:`resolve_kernel`, which refuses the kernels outside ``"materialise"``).

    ``"ghost"``/``"auto"`` need the grad-sample ``hooks`` attached to ``model`` to capture
    the ghost modules' calls: the ghost engine switches them to capturing here. Without hooks
    (``attach_hooks=False``: something else sets ``p.grad_sample``) every mode reads
    ``p.grad_sample``, i.e. is the materialised engine."""
    if per_sample_mode not in PER_SAMPLE_MODES:
        raise InvalidHyperparameterError(
            f"per_sample_mode must be one of {PER_SAMPLE_MODES}, got {per_sample_mode!r}"
        )
    if use_kernel:
        if per_sample_mode != "materialise":
            raise InvalidHyperparameterError(
                "the fused kernels read materialised per-example gradients (per_sample_mode='materialise'), "
                f"got per_sample_mode={per_sample_mode!r}"
            )
        return KernelEngine(context)
    if per_sample_mode == "materialise" or hooks is None:
        return MaterialisedEngine(context)
    return GhostEngine(context, model=model, mode=per_sample_mode, hooks=hooks)
