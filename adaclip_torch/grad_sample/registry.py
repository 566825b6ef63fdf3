"""Registry of per-layer per-sample-gradient rules.

A *rule* turns what one call of a module saw in the forward pass (its input activations)
and what it received in the backward pass (the gradient of the loss with respect to its
output) into the per-example gradients of the module's own parameters:

    rule(module, activations, backprops) -> {param_name: tensor of shape (n, *param.shape)}

``activations`` is the tuple of the module's positional inputs (detached) and ``backprops``
the gradient of the output; both have the batch on dim 0 (the engine moves it there). A rule
returns entries only for parameters that need them (``requires_grad``); the engine scales
them for the loss reduction and accumulates them into ``param.grad_sample``.

Rules are looked up by the module's exact type: a subclass that overrides ``forward`` may
compute something else, so it goes to the :mod:`torch.func` fallback instead. The one
exception is the class FSDP2 (``torch.distributed.fsdp.fully_shard``) gives a module it shards,
``FSDP<Type>`` with bases ``(FSDPModule, Type)`` and no ``forward`` of its own: it computes what
``Type`` computes (FSDP only swaps the parameters in and out around the call), so it gets
``Type``'s rule.

A rule may come with a ghost form (``ghost=``, a :class:`~.ghost_layer.GhostLayer` subclass):
the norms and the clipped sum of the same per-example gradients computed from the captured
activations and output gradients, without forming them (:mod:`adaclip_torch.ghost`). A layer
type's file registers both, so everything the library knows about one layer type is in one
place (:mod:`.linear`, :mod:`.conv`, :mod:`.embedding`, :mod:`.hf`). Registering a rule without
``ghost=`` (a user's override of a built-in one) sends the type to the materialised path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from .ghost_layer import GhostLayer

__all__ = ["GradSampler", "GradSampleRule", "register_grad_sampler", "get_grad_sampler", "GRAD_SAMPLERS"]

GradSampler = Callable[[nn.Module, tuple[torch.Tensor, ...], torch.Tensor], dict[str, torch.Tensor]]


@dataclass(frozen=True)
class GradSampleRule:
    """A registered rule.

    ``batch_first_sensitive``: whether the module's batch dimension follows the engine's
    ``batch_first`` flag (``True`` for layers that act on the last dimension, like
    ``nn.Linear``) or is always dim 0 by the layer's own layout (``False`` for convolutions
    and ``nn.GroupNorm``, whose inputs are ``(N, C, *)``).

    ``ghost``: the :class:`~.ghost_layer.GhostLayer` subclass computing this rule's norms and
    weighted sums from the captured calls, or ``None`` (the type is always materialised).
    """

    fn: GradSampler
    batch_first_sensitive: bool = True
    ghost: type[GhostLayer] | None = None


GRAD_SAMPLERS: dict[type[nn.Module], GradSampleRule] = {}


def register_grad_sampler(
    *module_types: type[nn.Module], batch_first_sensitive: bool = True, ghost: type[GhostLayer] | None = None
) -> Callable[[GradSampler], GradSampler]:
    """Decorator registering ``fn`` as the per-sample-gradient rule of ``module_types`` (with
    its ghost form ``ghost``, if any: :class:`GradSampleRule`).

    Registering a type again replaces its rule (so a user can override a built-in one).
    """
    if not module_types:
        raise TypeError("register_grad_sampler needs at least one module type")
    for t in module_types:
        if not (isinstance(t, type) and issubclass(t, nn.Module)):
            raise TypeError(f"register_grad_sampler expects nn.Module subclasses, got {t!r}")
    if ghost is not None and not (isinstance(ghost, type) and getattr(ghost, "kind", "") and callable(getattr(ghost, "applies", None))):
        raise TypeError(f"register_grad_sampler's ghost= expects a GhostLayer subclass with a kind, got {ghost!r}")

    def decorator(fn: GradSampler) -> GradSampler:
        for t in module_types:
            GRAD_SAMPLERS[t] = GradSampleRule(fn, batch_first_sensitive, ghost)
        return fn

    return decorator


def fsdp_base_class(cls: type) -> type | None:
    """The original class of a module that FSDP2's ``fully_shard`` re-classed (``FSDP<Type>``,
    bases ``(FSDPModule, Type)``, no ``forward`` of its own), else ``None``. Checked by name and
    module so that nothing of ``torch.distributed`` is imported here."""
    bases = cls.__bases__
    if len(bases) != 2 or "forward" in cls.__dict__:
        return None
    wrapper = bases[0]
    if wrapper.__name__ != "FSDPModule" or not wrapper.__module__.startswith("torch.distributed.fsdp"):
        return None
    return bases[1]


def get_grad_sampler(module: nn.Module) -> GradSampleRule | None:
    """The rule registered for ``type(module)`` exactly (for a module sharded by FSDP2's
    ``fully_shard``, for its original type: :func:`fsdp_base_class`), or ``None``."""
    cls = type(module)
    rule = GRAD_SAMPLERS.get(cls)
    if rule is None:
        base = fsdp_base_class(cls)
        if base is not None:
            rule = GRAD_SAMPLERS.get(base)
    return rule
