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

Coming from Opacus (``ModuleValidator.validate`` / ``ModuleValidator.fix``): :func:`validate`
lists what a rule refuses, and :func:`fix` returns a copy of the model with the refused modules
it knows how to replace replaced — every BatchNorm by a ``GroupNorm`` over the same channels,
``InstanceNorm(track_running_stats=True)`` by the same norm without running statistics, and
``Embedding(scale_grad_by_freq=True)`` without the scaling.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from adaclip.errors import InvalidHyperparameterError

__all__ = [
    "ModuleRule",
    "MODULE_RULES",
    "register_module_rule",
    "unsupported_modules",
    "check_model",
    "validate",
    "fix",
    "group_norm_groups",
]

#: The most groups :func:`fix` gives the ``GroupNorm`` that replaces a BatchNorm (as Opacus).
MAX_GROUPS = 32


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
        "functions of the private data; use GroupNorm or LayerNorm (adaclip_torch.validation.fix(model) "
        "returns a copy with every BatchNorm replaced by a GroupNorm)",
    ),
    ModuleRule(
        lambda m: isinstance(m, nn.modules.instancenorm._InstanceNorm) and bool(m.track_running_stats),
        "track_running_stats=True keeps running statistics of the private data in buffers that are "
        "released with the model without noise; set track_running_stats=False "
        "(adaclip_torch.validation.fix(model) does)",
    ),
    ModuleRule(
        lambda m: type(m).__name__ == "OptimizedModule" and isinstance(getattr(m, "_orig_mod", None), nn.Module),
        "a torch.compile'd model: the per-example hooks do not run correctly under torch.compile (a "
        "compiled forward loses some layers' per-example gradients and the step fails); pass the "
        "uncompiled model (model._orig_mod), and to compile the per-example work use "
        "adaclip_torch.compiled.CompiledPerExampleGradients: method='capture' keeps the hooks and ghost "
        "clipping, method='vmap' needs attach_hooks=False (compile_release=True compiles the release)",
    ),
    ModuleRule(
        lambda m: isinstance(m, nn.Embedding) and bool(m.scale_grad_by_freq),
        "scale_grad_by_freq=True divides by token counts over the whole batch, which couples the "
        "examples; set scale_grad_by_freq=False (adaclip_torch.validation.fix(model) does)",
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


def validate(model: nn.Module) -> list[str]:
    """Every problem that would make ``model`` refused for private training, one line each
    (``"module 'name' is Type: reason"``); ``[]`` when there is none. Opacus's
    ``ModuleValidator.validate(model)``; :func:`fix` repairs the BatchNorm, InstanceNorm and
    Embedding ones."""
    if not isinstance(model, nn.Module):
        raise InvalidHyperparameterError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    return [f"module {name!r} is {reason}" for name, reason in unsupported_modules(model)]


def group_norm_groups(num_channels: int, max_groups: int = MAX_GROUPS) -> int:
    """The number of groups of the ``GroupNorm`` that :func:`fix` puts in place of a BatchNorm
    over ``num_channels`` channels: ``min(max_groups, C)`` when it divides ``C`` (Opacus's
    choice), otherwise the largest divisor of ``C`` below it (``GroupNorm`` needs one)."""
    if isinstance(num_channels, bool) or not isinstance(num_channels, int) or num_channels <= 0:
        raise InvalidHyperparameterError(f"num_channels must be a positive int, got {num_channels!r}")
    for groups in range(min(max_groups, num_channels), 0, -1):
        if num_channels % groups == 0:
            return groups
    return 1  # pragma: no cover - 1 divides everything


def _like(new: nn.Module, old: nn.Module) -> nn.Module:
    """``new`` on the device and in the dtype of ``old``'s parameters or buffers."""
    tensors = [*old.parameters(recurse=False), *old.buffers(recurse=False)]
    floating = [t for t in tensors if t.is_floating_point()]
    if floating:
        new = new.to(device=floating[0].device, dtype=floating[0].dtype)
    elif tensors:
        new = new.to(device=tensors[0].device)
    new.train(old.training)
    return new


def _replacement(module: nn.Module) -> nn.Module | None:
    """The module :func:`fix` puts in place of ``module`` (``None``: it is fine as it is)."""
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        channels = int(module.num_features)
        return _like(nn.GroupNorm(group_norm_groups(channels), channels, eps=module.eps, affine=module.affine), module)
    if isinstance(module, nn.modules.instancenorm._InstanceNorm) and module.track_running_stats:
        new = type(module)(
            module.num_features, eps=module.eps, momentum=module.momentum, affine=module.affine,
            track_running_stats=False,
        )  # fmt: skip
        new = _like(new, module)
        if module.affine:
            with torch.no_grad():
                new.weight.copy_(module.weight)
                new.bias.copy_(module.bias)
            new.weight.requires_grad_(module.weight.requires_grad)
            new.bias.requires_grad_(module.bias.requires_grad)
        return new
    if isinstance(module, nn.Embedding) and module.scale_grad_by_freq:
        new = copy.deepcopy(module)
        new.scale_grad_by_freq = False
        return new
    return None


def fix(model: nn.Module) -> nn.Module:
    """A copy of ``model`` in which every module a rule refuses and that has a private
    counterpart is replaced; ``model`` itself is left unchanged (Opacus's
    ``ModuleValidator.fix``).

    - every BatchNorm (``BatchNorm1d/2d/3d``, ``SyncBatchNorm``, the lazy ones once
      initialised) over ``C`` channels becomes ``nn.GroupNorm(G, C, eps=, affine=)`` with
      ``G = min(32, C)`` if that divides ``C``, else the largest divisor of ``C`` below it
      (:func:`group_norm_groups`). It is a new, freshly initialised layer (weight 1, bias 0):
      GroupNorm normalises each example over its own channels, not over the batch, so the
      BatchNorm's running statistics and affine parameters do not carry over — fine-tune or
      train after fixing;
    - ``InstanceNorm*(track_running_stats=True)`` becomes the same norm with
      ``track_running_stats=False`` (in training it normalised with the example's own
      statistics anyway); its affine parameters are kept;
    - ``nn.Embedding(scale_grad_by_freq=True)`` becomes the same embedding (same weights)
      without the scaling.

    The new modules have the dtype, device and train/eval mode of those they replace; a
    module shared by several parents is replaced by one shared module. The result is checked:
    a module refused by a rule that ``fix`` cannot repair (one added with
    :func:`register_module_rule`) raises :class:`InvalidHyperparameterError` naming it, and
    nothing is returned.

    Raises:
      InvalidHyperparameterError: ``model`` is not a module, a lazy norm is not initialised, or a
        refused module has no automatic replacement.
    """
    if not isinstance(model, nn.Module):
        raise InvalidHyperparameterError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.lazy.LazyModuleMixin) and module.has_uninitialized_params():
            raise InvalidHyperparameterError(
                f"module {name or '<root>'!r} is an uninitialised {type(module).__name__}: its sizes are not known "
                "yet (and it cannot be copied); run one forward pass first, then fix()"
            )
    fixed = copy.deepcopy(model)
    replaced: dict[int, nn.Module] = {}
    for module in list(fixed.modules()):
        new = _replacement(module)
        if new is not None:
            replaced[id(module)] = new
    if id(fixed) in replaced:
        fixed = replaced[id(fixed)]
    else:
        for parent in list(fixed.modules()):
            for child_name, child in list(parent._modules.items()):  # every reference (named_children dedups)
                if child is not None and id(child) in replaced:
                    setattr(parent, child_name, replaced[id(child)])
    left = unsupported_modules(fixed)
    if left:
        lines = "; ".join(f"module {name!r} is {reason}" for name, reason in left)
        raise InvalidHyperparameterError(f"fix() cannot replace every refused module automatically: {lines}")
    return fixed
