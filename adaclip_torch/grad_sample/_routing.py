"""Batch-free routing: which calls of a hooked module do not carry the batch.

:class:`_BatchRouting` (a base of :class:`~.hooks.GradSampleHooks`) records, with a forward
pre-hook and a forward hook on the model, the batch size n of each (nested) call of the model,
and decides for each call of a hooked module whether it is *batch-free*
(:meth:`~_BatchRouting._batch_free_call`): its per-example gradients are then taken where its
output meets the batch (:mod:`.batch_free`, with the maths and the privacy argument).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from adaclip.errors import InvalidGradientError

from . import batch_free as _bf
from ._provenance import BatchProvenance
from ._state import hooks_muted
from .registry import GradSampleRule

__all__: list[str] = []


class _BatchRouting:
    """The model-call batch sizes and the batch-free decision (see the module docstring)."""

    model: nn.Module
    _batch_dim: int
    _batch_free: set[nn.Module]
    # the batch size of each (nested) call of the model, for the batch-free calls
    _call_n: list[int | None]
    # what descends from each (nested) call's batched inputs (None: not tracked), see _provenance
    _provenance: list[BatchProvenance | None]
    _active: bool

    if TYPE_CHECKING:  # defined by GradSampleHooks

        def module_path(self, module: nn.Module) -> str: ...

        def _where(self, module: nn.Module) -> str: ...

    def _model_pre_hook(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Record the batch size of this call of the model: dim 0 of its tensor inputs, if those of
        size other than 1 agree (1 if all have size 1; ``None`` if they disagree, or with
        ``batch_first=False``)."""
        n: int | None = None
        leaves = tree_flatten((args, kwargs))[0]
        if self._batch_dim == 0:
            sizes = {int(t.shape[0]) for t in leaves if isinstance(t, torch.Tensor) and t.ndim >= 1}
            big = sizes - {1}
            n = next(iter(big)) if len(big) == 1 else (1 if sizes == {1} else None)
        self._call_n.append(n)
        provenance = None
        if n is not None and self._active and not hooks_muted() and torch.is_grad_enabled():
            # which tensors of this call descend from its batched inputs (:mod:`._provenance`)
            provenance = BatchProvenance(n)
            provenance.mark_inputs(leaves)
            provenance.__enter__()
        self._provenance.append(provenance)

    def _model_post_hook(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if self._call_n:
            self._call_n.pop()
        if self._provenance:
            provenance = self._provenance.pop()
            if provenance is not None:
                provenance.__exit__(None, None, None)

    def _batch_free_call(self, module: nn.Module, plan: GradSampleRule | bool, args: tuple[Any, ...],
                         leaves: list[Any], dims: list[int | None] | None) -> int | None:  # fmt: skip
        """The batch size n if this call of ``module`` is batch-free (its per-example gradients are
        routed, :mod:`.batch_free`), else ``None`` (a batched call, as before).

        Batch-free (batch-first layouts only; never the model itself, whose inputs define the
        batch — an ``nn.LSTM(batch_first=False)`` hooked on its own has it on dim 1):

        - its input does not descend from the model call's batched inputs (:mod:`._provenance`:
          an index built in ``forward`` such as ``torch.arange(L)``, a buffer, a parameter),
          whatever its shape — also when its dim 0 equals the batch size by chance; for a
          fallback module, when none of its tensor inputs does;
        - its input is a batch-free tensor (the output of a batch-free call, not yet combined with
          the batch) — for a fallback module, every tensor input is;
        - the module was declared batch-free (:func:`~.batch_free.mark_batch_free`, or an
          ``nn.Embedding`` named ``relative_attention_bias``);
        - where provenance is not tracked (a module called outside the model's forward): an
          ``nn.Embedding`` called on ids of size 1 on dim 0 (position ids ``(1, L)``) while the
          model was called with a batch n ≠ 1;
        - a fallback module called without any tensor input (a learned constant).

        A module called on batched inputs whose output does not carry the batch (BART's decoder
        position embedding reads the ids only for their shape and returns ``(1, L, d)``) is not
        taken for batch-free by itself — a module that averaged over the batch would look the
        same, and its "per-example" gradients would depend on the other examples — it must be
        declared: its per-example gradients are then ``J_fᵀ δ_i`` of the call as it ran.

        n is then the model call's batch size (dim 0 of its tensor inputs, see
        :meth:`_model_pre_hook`); where it is unknown, the call is refused if it must be
        batch-free, and taken for a batched one otherwise (the batch-size check of the backward
        pass then refuses a mismatch, naming the module)."""
        if self._batch_dim != 0 or module is self.model:
            return None
        model_n = self._call_n[-1] if self._call_n else None
        provenance = self._provenance[-1] if self._provenance else None
        if isinstance(plan, GradSampleRule):
            x = args[0] if args else None
            if isinstance(x, _bf.BatchFreeTensor):
                return _bf.call_batch_size([x])
            free = module in self._batch_free or _bf.is_batch_free_module("", module)
            if not free and provenance is not None and isinstance(x, torch.Tensor):
                free = not provenance.descends(x)
            elif not free and type(module) is nn.Embedding and model_n not in (None, 1):
                free = isinstance(x, torch.Tensor) and x.ndim >= 1 and x.shape[0] == 1
        else:
            carriers = [t for t, d in zip(leaves, dims or [], strict=False) if d is not None and isinstance(t, torch.Tensor)]
            if carriers and all(isinstance(t, _bf.BatchFreeTensor) for t in carriers):
                return _bf.call_batch_size(carriers)
            declared = module in self._batch_free or _bf.is_batch_free_module("", module)
            plain = [t for t in carriers if not isinstance(t, _bf.BatchFreeTensor)]
            batched = bool(plain) and (provenance is None or any(provenance.descends(t) for t in plain))
            if not declared and batched:
                # batched: batch-free inputs among them are passed to every example as they are;
                # plain inputs that do not descend from the batch are split on their batch dim like
                # the others (each example's function then reads only its own slice of them)
                return None
            free = True  # no tensor input at all, none that descends from the batch, or declared
        if not free:
            return None
        if model_n is None:
            raise InvalidGradientError(
                f"{self._where(module)} is called on an input that does not carry the batch, but the batch "
                "size of the model call is unknown: the model's tensor inputs must agree on dim 0 (size 1 "
                "aside), and the module must be called inside the model's forward. Otherwise call it on a "
                f"batched input, or freeze it (model.{self.module_path(module)}.requires_grad_(False))"
            )
        return model_n

