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
compute something else, so it goes to the :mod:`torch.func` fallback instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["GradSampler", "GradSampleRule", "register_grad_sampler", "get_grad_sampler", "GRAD_SAMPLERS"]

GradSampler = Callable[[nn.Module, tuple[torch.Tensor, ...], torch.Tensor], dict[str, torch.Tensor]]


@dataclass(frozen=True)
class GradSampleRule:
    """A registered rule.

    ``batch_first_sensitive``: whether the module's batch dimension follows the engine's
    ``batch_first`` flag (``True`` for layers that act on the last dimension, like
    ``nn.Linear``) or is always dim 0 by the layer's own layout (``False`` for convolutions
    and ``nn.GroupNorm``, whose inputs are ``(N, C, *)``).
    """

    fn: GradSampler
    batch_first_sensitive: bool = True


GRAD_SAMPLERS: dict[type[nn.Module], GradSampleRule] = {}


def register_grad_sampler(
    *module_types: type[nn.Module], batch_first_sensitive: bool = True
) -> Callable[[GradSampler], GradSampler]:
    """Decorator registering ``fn`` as the per-sample-gradient rule of ``module_types``.

    Registering a type again replaces its rule (so a user can override a built-in one).
    """
    if not module_types:
        raise TypeError("register_grad_sampler needs at least one module type")
    for t in module_types:
        if not (isinstance(t, type) and issubclass(t, nn.Module)):
            raise TypeError(f"register_grad_sampler expects nn.Module subclasses, got {t!r}")

    def decorator(fn: GradSampler) -> GradSampler:
        for t in module_types:
            GRAD_SAMPLERS[t] = GradSampleRule(fn, batch_first_sensitive)
        return fn

    return decorator


def get_grad_sampler(module: nn.Module) -> GradSampleRule | None:
    """The rule registered for ``type(module)`` exactly, or ``None``."""
    return GRAD_SAMPLERS.get(type(module))
