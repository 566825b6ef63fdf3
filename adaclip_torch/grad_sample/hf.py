"""Per-sample-gradient rules for Hugging Face ``transformers`` layer types.

``transformers.pytorch_utils.Conv1D`` (GPT-2, GPT-J's ancestors, DistilGPT-2, …) is a Linear layer
with the weight stored transposed: ``y = x W + b`` with ``W`` of shape ``(in, out)``. With ``x_i``
of shape ``(T, in)`` (T positions) and ``δ_i = ∂L/∂y_i`` of shape ``(T, out)``:

    ∂L_i/∂W = Σ_t x_{i,t} δ_{i,t}ᵀ  (shape (in, out)),      ∂L_i/∂b = Σ_t δ_{i,t},

the transpose of ``nn.Linear``'s rule. Its ghost form (:class:`Conv1DGhost`) is
:class:`~.linear.LinearGhost`'s on the transposed weight: the centre and scale are transposed
in, the sums and per-example gradients transposed out; norms are unchanged by the transposition.

The rule is registered (by exact type, like every rule) when hooks are attached and
``transformers`` is already imported — a model holding a ``Conv1D`` means it is — so importing
adaclip_torch never imports transformers. A rule the user registered for ``Conv1D`` is kept.
"""

from __future__ import annotations

import math
import sys

import torch
from torch import nn

from adaclip.errors import InvalidGradientError

from .linear import LinearGhost
from .registry import GRAD_SAMPLERS, register_grad_sampler

__all__ = ["conv1d_grad_sample", "Conv1DGhost", "register_transformers_rules", "transformers_conv1d"]


def conv1d_grad_sample(
    module: nn.Module, activations: tuple[torch.Tensor, ...], backprops: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Per-example gradients of a ``transformers`` ``Conv1D`` (weight ``(in, out)``)."""
    x = activations[0]
    if x.dim() < 2:
        raise InvalidGradientError(
            f"Conv1D input of shape {tuple(x.shape)} has no batch dimension; per-sample gradients "
            "need a batched input (n, ..., in_features)"
        )
    n = x.shape[0]
    nx, nf = module.weight.shape
    length = math.prod(x.shape[1:-1])
    a = x.reshape(n, length, nx)
    d = backprops.reshape(n, length, nf)
    out: dict[str, torch.Tensor] = {}
    if module.weight.requires_grad:
        out["weight"] = torch.bmm(a.transpose(1, 2), d.to(a.dtype))
    if module.bias is not None and module.bias.requires_grad:
        out["bias"] = d.sum(dim=1)
    return out


class Conv1DGhost(LinearGhost):
    """Ghost norms of ``transformers``' ``Conv1D`` (weight ``(in, out)``): the Linear forms on the
    transposed weight (kind ``"linear_t"``)."""

    kind = "linear_t"

    @classmethod
    def applies(cls, module: nn.Module) -> bool:
        return getattr(module, "weight", None) is not None and module.weight.ndim == 2

    def _features(self) -> tuple[int, int]:
        nx, nf = self.module.weight.shape
        return nx, nf

    def _as_matrix(self, t: object) -> object:
        if isinstance(t, torch.Tensor) and t.ndim == 2:
            return t.T
        return t

    def _weight_out(self, w: torch.Tensor) -> torch.Tensor:
        return w.T

    def _samples_out(self, g: torch.Tensor) -> torch.Tensor:
        return g.transpose(1, 2)


def transformers_conv1d() -> type[nn.Module] | None:
    """``transformers.pytorch_utils.Conv1D`` if transformers is imported, else ``None``."""
    mod = sys.modules.get("transformers.pytorch_utils")
    cls = getattr(mod, "Conv1D", None) if mod is not None else None
    return cls if isinstance(cls, type) and issubclass(cls, nn.Module) else None


def register_transformers_rules() -> None:
    """Register the rules above for the ``transformers`` types that are imported (idempotent)."""
    conv1d = transformers_conv1d()
    if conv1d is not None and conv1d not in GRAD_SAMPLERS:
        register_grad_sampler(conv1d, ghost=Conv1DGhost)(conv1d_grad_sample)
