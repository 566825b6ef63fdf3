"""Per-sample gradients of ``nn.LayerNorm``, ``nn.RMSNorm`` and ``nn.GroupNorm`` (elementwise affine).

Both compute y = x̂ ⊙ γ + β, where x̂ is x normalised *within one example* (over the last
dims for LayerNorm, over each group's channels and positions for GroupNorm) — so they are
per-example operations and, with δ = ∂L/∂y,

    LayerNorm:  ∂L_i/∂γ = Σ_{positions} δ_i ⊙ x̂_i,        ∂L_i/∂β = Σ_{positions} δ_i
                (sums over the dims before ``normalized_shape``, excluding the batch);
    GroupNorm:  ∂L_i/∂γ_c = Σ_{spatial} δ_{i,c} x̂_{i,c},    ∂L_i/∂β_c = Σ_{spatial} δ_{i,c}.

``nn.RMSNorm`` (y = x̂ ⊙ γ, x̂ = x / √(mean(x²) + ε) over ``normalized_shape``) has the same
weight rule as LayerNorm: ``∂L_i/∂γ = Σ_{positions} δ_i ⊙ x̂_i``. (The RMSNorm classes of
``transformers`` — ``LlamaRMSNorm``, ``T5LayerNorm``, … — are their own types, with their own
dtype handling and, in some models, a ``1 + γ`` scale: they take the exact :mod:`torch.func`
fallback.)

x̂ is recomputed from the captured input with the functional form without affine parameters.
(BatchNorm normalises across the batch, so it has no per-example gradient; the hooks reject it.)
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .registry import register_grad_sampler


@register_grad_sampler(nn.LayerNorm)
def layer_norm_grad_sample(
    module: nn.LayerNorm, activations: tuple[torch.Tensor, ...], backprops: torch.Tensor
) -> dict[str, torch.Tensor]:
    x = activations[0]
    k = len(module.normalized_shape)
    reduce_dims = list(range(1, x.dim() - k))
    out: dict[str, torch.Tensor] = {}
    if module.weight is not None and module.weight.requires_grad:
        x_hat = F.layer_norm(x, module.normalized_shape, eps=module.eps)
        prod = backprops * x_hat
        out["weight"] = prod.sum(dim=reduce_dims) if reduce_dims else prod
    if module.bias is not None and module.bias.requires_grad:
        out["bias"] = backprops.sum(dim=reduce_dims) if reduce_dims else backprops
    return out


@register_grad_sampler(nn.GroupNorm, batch_first_sensitive=False)
def group_norm_grad_sample(
    module: nn.GroupNorm, activations: tuple[torch.Tensor, ...], backprops: torch.Tensor
) -> dict[str, torch.Tensor]:
    x = activations[0]
    n, c = x.shape[0], module.num_channels
    out: dict[str, torch.Tensor] = {}
    if module.weight is not None and module.weight.requires_grad:
        x_hat = F.group_norm(x, module.num_groups, eps=module.eps)
        out["weight"] = (backprops * x_hat).reshape(n, c, math.prod(x.shape[2:])).sum(dim=2)
    if module.bias is not None and module.bias.requires_grad:
        out["bias"] = backprops.reshape(n, c, math.prod(x.shape[2:])).sum(dim=2)
    return out


if hasattr(nn, "RMSNorm"):

    @register_grad_sampler(nn.RMSNorm)
    def rms_norm_grad_sample(
        module: nn.RMSNorm, activations: tuple[torch.Tensor, ...], backprops: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        x = activations[0]
        if module.weight is None or not module.weight.requires_grad:
            return {}
        k = len(module.normalized_shape)
        reduce_dims = list(range(1, x.dim() - k))
        x_hat = F.rms_norm(x, module.normalized_shape, eps=module.eps)
        prod = backprops * x_hat
        return {"weight": prod.sum(dim=reduce_dims) if reduce_dims else prod}
