"""Which modules of a model get hooks, and how each is handled: the *plan* of the hook engine.

:func:`plan_modules` walks the model once, when :class:`~.hooks.GradSampleHooks` is attached: a
module that owns parameters gets a registered rule (:mod:`.registry`) when its type has one, or
else the :mod:`torch.func` fallback — over its own parameters, or over its whole subtree when it
has parameter-owning descendants (which are then not hooked themselves). The walk also records
each module's path (for messages) and the modules declared batch-free (:mod:`.batch_free`), and
:func:`_sharded_parameters` finds the FSDP2-sharded parameters the per-example gradients belong
on. Nothing here registers a hook: the engine does, in the order of :attr:`ModulePlan.modules`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from torch import nn

from . import batch_free as _bf
from .registry import GradSampleRule, get_grad_sampler

__all__ = ["ModulePlan", "plan_modules"]


def _own_params(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module._parameters.values() if p is not None]


def _sharded_parameters(
    plans: list[tuple[nn.Module, GradSampleRule | bool]],
) -> dict[tuple[nn.Module, str], nn.Parameter]:
    """``(module, name) -> parameter`` for the hooked modules' parameters that are DTensors now
    (FSDP2's sharded parameters; ``name`` as the hooks store it: the module's own parameter
    name, or the dotted name within a fallback module's subtree). Empty for a model without
    DTensor parameters — always when ``torch.distributed.tensor`` was never imported.

    FSDP2 registers unsharded copies of these parameters on the modules around each forward and
    backward, so ``module.get_parameter(name)`` in a backward hook returns a tensor the optimizer
    does not hold; the per-example gradient (of the full, unsharded parameter: the hooks see
    this rank's examples and the full layer) belongs on the sharded parameter, whose ``shape``
    is the full one."""
    dtensor_module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(dtensor_module, "DTensor", None)
    if dtensor is None:
        return {}
    out: dict[tuple[nn.Module, str], nn.Parameter] = {}
    for m, plan in plans:
        named = m.named_parameters() if plan is True else m._parameters.items()
        for name, p in named:
            if isinstance(p, dtensor):
                out[(m, name)] = p
    return out



@dataclass
class ModulePlan:
    """The outcome of the walk over a model (see :func:`plan_modules`)."""

    # hooked module -> its rule, or ``True`` (fallback over the subtree) / ``False`` (over its own
    # parameters)
    plans: dict[nn.Module, GradSampleRule | bool] = field(default_factory=dict)
    # the hooked modules with their names, in the order of ``model.named_modules()``
    modules: list[tuple[str, nn.Module]] = field(default_factory=list)
    # module -> its path in the model, for messages
    paths: dict[nn.Module, str] = field(default_factory=dict)
    # the modules declared batch-free
    batch_free: set[nn.Module] = field(default_factory=set)


def plan_modules(model: nn.Module) -> ModulePlan:
    """Walk ``model`` and decide, for every module that owns parameters, how its per-example
    gradients are computed (see the module docstring)."""
    # The plan of every hooked module: its rule, or the fallback over its own parameters —
    # or over its whole subtree when it has parameter-owning descendants (a module such as
    # nn.MultiheadAttention uses its child's weights without calling the child, whose hooks
    # would then never fire); descendants of such a module are not hooked themselves.
    out = ModulePlan()
    covered: set[int] = set()
    for name, m in model.named_modules():
        out.paths.setdefault(m, name)
        if _bf.is_batch_free_module(name, m):
            out.batch_free.add(m)
    for name, m in model.named_modules():  # pre-order: parents before children
        if id(m) in covered or not _own_params(m):
            continue
        rule = get_grad_sampler(m)
        subtree = rule is None and any(_own_params(c) for c in m.modules() if c is not m)
        if subtree:
            for c in m.modules():
                if c is not m:
                    covered.add(id(c))
        out.plans[m] = rule if rule is not None else subtree
        out.modules.append((name, m))
    return out
