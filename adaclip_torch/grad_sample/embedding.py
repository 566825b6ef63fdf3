"""Per-sample gradients of ``nn.Embedding``.

With token ids t (shape (n, *)) and δ = ∂L/∂y (shape (n, *, D)), row v of example i's weight
gradient is the sum of δ over the positions where example i used token v:

    ∂L_i/∂W[v] = Σ_{l : t_{i,l} = v} δ_{i,l},

and the ``padding_idx`` row (if any) gets zero, as in torch's own backward. Computed with one
``index_add_`` into an (n·V, D) buffer, example i's tokens offset by i·V.

``scale_grad_by_freq=True`` scales by frequencies counted over the whole mini-batch, which
couples the examples; it is rejected when the hooks are attached.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .registry import register_grad_sampler


@register_grad_sampler(nn.Embedding)
def embedding_grad_sample(
    module: nn.Embedding, activations: tuple[torch.Tensor, ...], backprops: torch.Tensor
) -> dict[str, torch.Tensor]:
    if not module.weight.requires_grad:
        return {}
    ids = activations[0]
    n = ids.shape[0]
    num, dim = module.num_embeddings, module.embedding_dim
    flat_ids = ids.reshape(n, math.prod(ids.shape[1:])).long()
    offsets = torch.arange(n, device=ids.device).unsqueeze(1) * num
    rows = (flat_ids + offsets).reshape(-1)
    values = backprops.reshape(-1, dim).to(module.weight.dtype)
    gs = torch.zeros(n * num, dim, dtype=module.weight.dtype, device=module.weight.device)
    gs.index_add_(0, rows, values)
    gs = gs.view(n, num, dim)
    if module.padding_idx is not None:
        gs[:, module.padding_idx] = 0
    return {"weight": gs}
