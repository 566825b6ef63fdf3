"""Which modules a private model may contain: a registry of rules, checked by module type.

Differential privacy with per-unit clipping needs two things from the model: one unit's
gradient must depend on that unit alone (otherwise clipping it does not bound its influence:
another unit can move it), and nothing computed from the private data may leave with the model
except through the noisy release. Some modules break one of these whether or not they own
parameters, so the check is by *module type* over every submodule, not only over the
parameter-owning ones:

* every BatchNorm (``BatchNorm1d/2d/3d``, lazy and ``SyncBatchNorm``; ``affine=False`` too):
  in training mode it normalises with the statistics of the whole batch, so one example's
  output and gradient depend on the other examples of the batch; its running statistics are
  also raw functions of the private data. Use ``GroupNorm`` or ``LayerNorm``;
* ``InstanceNorm`` with ``track_running_stats=True``: its running statistics are raw functions
  of the private data, stored in buffers that leave with the model, un-noised;
* ``nn.Embedding(scale_grad_by_freq=True)``: the scaling divides by token counts over the
  whole batch, coupling the examples.

:func:`check_model` runs when the optimizer wraps the model and again before every step, so a
module added after wrapping is caught too. :func:`register_module_rule` adds a rule for a
custom module type.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from torch import nn

from adaclip.errors import InvalidHyperparameterError

__all__ = ["ModuleRule", "MODULE_RULES", "register_module_rule", "unsupported_modules", "check_model"]


class ModuleRule(NamedTuple):
    """``applies(module)`` is true for a module the rule refuses; ``reason`` says why and what to use."""

    applies: Callable[[nn.Module], bool]
    reason: str


#: The rules, checked in order; the first that applies names the module.
MODULE_RULES: list[ModuleRule] = [
    ModuleRule(
        lambda m: isinstance(m, nn.modules.batchnorm._BatchNorm),
        "batch normalisation mixes the examples of a batch (one example's gradient depends on the "
        "others), with or without affine parameters, and its running statistics are un-noised "
        "functions of the private data; use GroupNorm or LayerNorm",
    ),
    ModuleRule(
        lambda m: isinstance(m, nn.modules.instancenorm._InstanceNorm) and bool(m.track_running_stats),
        "track_running_stats=True keeps running statistics of the private data in buffers that are "
        "released with the model without noise; set track_running_stats=False",
    ),
    ModuleRule(
        lambda m: isinstance(m, nn.Embedding) and bool(m.scale_grad_by_freq),
        "scale_grad_by_freq=True divides by token counts over the whole batch, which couples the "
        "examples; set scale_grad_by_freq=False",
    ),
]


def register_module_rule(applies: Callable[[nn.Module], bool], reason: str) -> None:
    """Refuse the modules for which ``applies(module)`` is true, explaining ``reason``."""
    if not callable(applies) or not isinstance(reason, str) or not reason:
        raise InvalidHyperparameterError("register_module_rule needs a callable and a non-empty reason")
    MODULE_RULES.append(ModuleRule(applies, reason))


def unsupported_modules(model: nn.Module) -> list[tuple[str, str]]:
    """``[(module name, reason), ...]`` for every submodule of ``model`` a rule refuses."""
    out = []
    for name, module in model.named_modules():
        for rule in MODULE_RULES:
            if rule.applies(module):
                out.append((name or "<root>", f"{type(module).__name__}: {rule.reason}"))
                break
    return out


def check_model(model: nn.Module, *, when: str = "") -> None:
    """Raise :class:`InvalidHyperparameterError` naming every module of ``model`` that a rule refuses."""
    found = unsupported_modules(model)
    if found:
        lines = "; ".join(f"module {name!r} is {reason}" for name, reason in found)
        raise InvalidHyperparameterError(f"{when}{lines}")
