"""The weight swap of the capture-only mode (used by the ghost path of the optimizers).

For the modules :meth:`~.hooks.GradSampleHooks.capture_only` selects with
``skip_weight_grads=True``, :class:`_WeightSwap` (a base of :class:`~.hooks.GradSampleHooks`)
keeps autograd from computing the batch gradient of their weight, which the ghost path never
reads: a forward pre-hook swaps in a detached alias of the weight for the duration of each call
(same storage, same values), and a forward hook that runs first, even when the forward raises,
puts the weight back.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from ._state import hooks_muted

__all__: list[str] = []


class _WeightSwap:
    """The hooks that swap a capture-only module's weight out and back in (see the module
    docstring)."""

    _active: bool
    # capture-only modules whose weight autograd does not differentiate (see capture_only):
    # the hooks that swap it out and back in, and the weights swapped out during a call
    _detach_handles: list[Any]
    _swapped: dict[nn.Module, list[nn.Parameter]]

    def _add_detach_hooks(self, modules: set[nn.Module]) -> None:
        """Swap the weight of each of ``modules`` out of every call made with gradients enabled."""
        for m in modules:
            self._detach_handles.append(m.register_forward_pre_hook(self._detach_weight))
            # first among the forward hooks, and run even when forward raises
            self._detach_handles.append(m.register_forward_hook(self._restore_weight, prepend=True, always_call=True))

    def _remove_detach_hooks(self) -> None:
        for h in self._detach_handles:
            h.remove()
        self._detach_handles = []


    def _detach_weight(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        """Forward pre-hook of a capture-only module: swap its weight for a detached alias."""
        if not self._active or hooks_muted() or not torch.is_grad_enabled():
            return
        weight = module._parameters.get("weight")
        if weight is None or not weight.requires_grad:
            return
        bias = module._parameters.get("bias")
        needs_grad = (bias is not None and bias.requires_grad) or any(
            isinstance(a, torch.Tensor) and a.requires_grad for a in tree_flatten(args)[0]
        )
        if not needs_grad:  # the output would not require grad: keep the weight attached
            return
        self._swapped.setdefault(module, []).append(weight)
        module._parameters["weight"] = weight.detach()  # type: ignore[assignment]

    def _restore_weight(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        """Forward hook (first, always called): put the swapped-out weight back."""
        stack = self._swapped.get(module)
        if stack:
            module._parameters["weight"] = stack.pop()
            if not stack:
                del self._swapped[module]

