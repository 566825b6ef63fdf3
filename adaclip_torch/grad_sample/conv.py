"""Per-sample gradients of ``nn.Conv1d`` and ``nn.Conv2d`` (unfold based).

A convolution is a matrix product on unfolded patches: with U_i = unfold(x_i) of shape
(C_in·K, L) (K = kernel elements, L = output positions) and δ_i = ∂L/∂y_i of shape (C_out, L),
y_i = W U_i + b, so

    ∂L_i/∂W = δ_i U_iᵀ   (reshaped to (C_out, C_in/g, *kernel)),      ∂L_i/∂b = Σ_l δ_{i,·,l}.

With g groups, output channels of group j only see input channels of group j: the product is
taken per group. Padding (any ``padding_mode``, also ``padding='same'``) is applied explicitly
with the module's own amounts before unfolding, so stride and dilation are all unfold needs.
Conv1d is treated as a Conv2d of height 1. The batch is always dim 0 (torch's (N, C, *) layout).

Ghost form (:class:`ConvGhost`, ``groups=1`` only, and only in ``per_sample_mode="ghost"``): the
Linear forms of :class:`~.linear.LinearGhost` on the unfolded patches, with T = the number of
output pixels and the weight seen as a ``(C_out, C_in·K)`` matrix. On the benchmark CNN its Gram
form is dearer than forming the per-example gradients (T² (C·K + C_out) > C·K·C_out for a first
layer with many output pixels), so ``"auto"`` keeps materialising convolutions.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from adaclip.errors import InvalidGradientError

from .linear import LinearGhost
from .registry import register_grad_sampler

__all__ = ["conv1d_grad_sample", "conv2d_grad_sample", "ConvGhost", "unfold_patches", "strided_unfold"]


def unfold_patches(module: nn.Conv1d | nn.Conv2d, x: torch.Tensor, spatial: int) -> torch.Tensor:
    """The unfolded input patches ``U_i``, shape ``(n, C_in·K, L)``: the module's padding applied
    explicitly (any ``padding_mode``), then ``F.unfold`` with its stride and dilation (Conv1d as a
    Conv2d of height 1)."""
    pad = module._reversed_padding_repeated_twice
    if any(p != 0 for p in pad):
        mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
        x = F.pad(x, pad, mode=mode)
    kernel, stride, dilation = module.kernel_size, module.stride, module.dilation
    if spatial == 1:
        x = x.unsqueeze(2)
        kernel, stride, dilation = (1, kernel[0]), (1, stride[0]), (1, dilation[0])
    return strided_unfold(x, kernel, stride, dilation)


def strided_unfold(
    x: torch.Tensor, kernel: tuple[int, int], stride: tuple[int, int], dilation: tuple[int, int]
) -> torch.Tensor:
    """``F.unfold(x, kernel, dilation=dilation, stride=stride)`` (no padding) as strided views
    and one copy: ``(n, C, H, W)`` → ``(n, C·kh·kw, L_h·L_w)``, rows ordered (channel, kernel
    row, kernel column), columns row-major over output positions — the same values in the same
    places. ``F.unfold`` (``im2col``) loops over the batch on CUDA, one launch per example
    (6 ms for 1,024 MNIST-sized examples on an H200); the views cost one copy whatever n."""
    n, c = x.shape[0], x.shape[1]
    (kh, kw), (sh, sw), (dh, dw) = kernel, stride, dilation
    span_h, span_w = (kh - 1) * dh + 1, (kw - 1) * dw + 1
    # (n, C, L_h, L_w, span_h, span_w): each output position's receptive field
    windows = x.unfold(2, span_h, sh).unfold(3, span_w, sw)
    windows = windows[..., ::dh, ::dw]  # (n, C, L_h, L_w, kh, kw): the dilated taps
    length = windows.shape[2] * windows.shape[3]
    return windows.permute(0, 1, 4, 5, 2, 3).reshape(n, c * kh * kw, length)


def _conv_grad_sample(
    module: nn.Conv1d | nn.Conv2d, x: torch.Tensor, backprops: torch.Tensor, spatial: int
) -> dict[str, torch.Tensor]:
    if x.dim() != spatial + 2:
        raise InvalidGradientError(
            f"{type(module).__name__} input of shape {tuple(x.shape)} is not batched; per-sample "
            f"gradients need (n, C, {'L' if spatial == 1 else 'H, W'})"
        )
    n = x.shape[0]
    out: dict[str, torch.Tensor] = {}
    if module.bias is not None and module.bias.requires_grad:
        out["bias"] = backprops.reshape(n, module.out_channels, math.prod(backprops.shape[2:])).sum(dim=2)
    if not module.weight.requires_grad:
        return out
    if n == 0:
        out["weight"] = module.weight.new_zeros((0, *module.weight.shape))
        return out
    cols = unfold_patches(module, x, spatial)
    g = module.groups
    length = cols.shape[-1]
    cols = cols.reshape(n, g, cols.shape[1] // g, length)
    d = backprops.reshape(n, g, module.out_channels // g, math.prod(backprops.shape[2:]))
    if d.shape[-1] != length:
        raise InvalidGradientError(
            f"{type(module).__name__}: {length} unfolded positions but an output gradient with "
            f"{d.shape[-1]}; the module's forward is not a standard convolution"
        )
    gw = torch.einsum("ngol,ngkl->ngok", d, cols)
    out["weight"] = gw.reshape(n, *module.weight.shape)
    return out


def conv1d_grad_sample(
    module: nn.Conv1d, activations: tuple[torch.Tensor, ...], backprops: torch.Tensor
) -> dict[str, torch.Tensor]:
    return _conv_grad_sample(module, activations[0], backprops, 1)


def conv2d_grad_sample(
    module: nn.Conv2d, activations: tuple[torch.Tensor, ...], backprops: torch.Tensor
) -> dict[str, torch.Tensor]:
    return _conv_grad_sample(module, activations[0], backprops, 2)


class ConvGhost(LinearGhost):
    """Ghost norms of ``nn.Conv1d`` / ``nn.Conv2d`` with ``groups=1`` (any padding mode, stride,
    dilation): a Linear layer on the unfolded input patches (``x_{it}`` = the patch of output
    pixel t, C_in·K long; ``e_{it}`` = the output gradient there), so :class:`LinearGhost`'s
    forms apply with T = the number of output pixels and the weight as a ``(C_out, C_in·K)``
    matrix. Only in ``per_sample_mode="ghost"`` (the memory mode; module doc)."""

    kind = "conv"
    memory_mode_only = True

    @classmethod
    def applies(cls, module: nn.Module) -> bool:
        return type(module) in (nn.Conv1d, nn.Conv2d) and module.groups == 1

    def _capture(self, captures: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        module, n, dtype = self.module, self.n, self.dtype
        spatial = 1 if isinstance(module, nn.Conv1d) else 2
        xs, es = [], []
        for x, e in captures:
            if x.dim() != spatial + 2:
                raise InvalidGradientError(
                    f"{type(module).__name__} input of shape {tuple(x.shape)} is not batched"
                )
            xs.append(unfold_patches(module, x, spatial).transpose(1, 2).to(dtype))
            es.append(e.reshape(n, module.out_channels, math.prod(e.shape[2:])).transpose(1, 2).to(dtype))
            if xs[-1].shape[1] != es[-1].shape[1]:
                raise InvalidGradientError(
                    f"{type(module).__name__}: {xs[-1].shape[1]} unfolded positions but an output "
                    f"gradient with {es[-1].shape[1]}; the module's forward is not a standard convolution"
                )
        self._set_positions(xs, es)
        self.in_f, self.out_f = self.x.shape[2], module.out_channels

    def _as_matrix(self, t: object) -> object:
        if isinstance(t, torch.Tensor) and t.ndim > 2:
            return t.reshape(self.out_f, self.in_f)
        return t

    def _weight_out(self, w: torch.Tensor) -> torch.Tensor:
        return w.reshape(self.module.weight.shape)

    def _samples_out(self, g: torch.Tensor) -> torch.Tensor:
        return g.reshape(g.shape[0], *self.module.weight.shape)


register_grad_sampler(nn.Conv1d, batch_first_sensitive=False, ghost=ConvGhost)(conv1d_grad_sample)
register_grad_sampler(nn.Conv2d, batch_first_sensitive=False, ghost=ConvGhost)(conv2d_grad_sample)
