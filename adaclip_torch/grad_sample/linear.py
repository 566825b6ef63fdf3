"""Per-sample gradients of ``nn.Linear``.

For y = x Wᵀ + b with x of shape (n, *, in) (``*``: any number of sequence dims, flattened to
one of length L), example i's gradients are sums over its own positions l:

    ∂L_i/∂W = Σ_l  δ_{i,l} x_{i,l}ᵀ   (shape (out, in)),      ∂L_i/∂b = Σ_l δ_{i,l},

with δ = ∂L/∂y. One batched matrix product computes all n at once.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from adaclip.errors import InvalidGradientError

from .registry import register_grad_sampler


@register_grad_sampler(nn.Linear)
def linear_grad_sample(
    module: nn.Linear, activations: tuple[torch.Tensor, ...], backprops: torch.Tensor
) -> dict[str, torch.Tensor]:
    x = activations[0]
    if x.dim() < 2:
        raise InvalidGradientError(
            f"nn.Linear input of shape {tuple(x.shape)} has no batch dimension; "
            "per-sample gradients need a batched input (n, ..., in_features)"
        )
    n = x.shape[0]
    length = math.prod(x.shape[1:-1])  # positions per example (1 without sequence dims)
    a = x.reshape(n, length, module.in_features)
    d = backprops.reshape(n, length, module.out_features)
    out: dict[str, torch.Tensor] = {}
    if module.weight.requires_grad:
        out["weight"] = torch.bmm(d.transpose(1, 2), a)
    if module.bias is not None and module.bias.requires_grad:
        out["bias"] = d.sum(dim=1)
    return out
