"""Which tensors of a model call descend from the batch: provenance, not shape.

Why. The hooks take row i of a module's input for example i's. That is right when the input
was computed from the model call's batched inputs, and wrong when it was not: an index built
inside ``forward`` (nanoGPT's ``wpe(torch.arange(t))``, a relative-position matrix ``(L, L)``),
a buffer or a parameter. Such a tensor carries no example at all, whatever its dim 0 — and when
its dim 0 happens to equal the batch size n (sequence length L = n), its shape alone cannot tell
it from a batched input. Taken for batched, "example i's" gradient of ``wpe`` would be row i of
the output gradient, the sum over *all* examples at position i: one example would move the
clipped sum by up to √n·C (4.00·C at n = L = 16), while the accountant assumes C.

What. During each call of the hooked model (with gradients enabled) a
:class:`~torch.overrides.TorchFunctionMode` marks:

1. the model call's tensor inputs whose dim 0 is the batch size n (what defines the batch);
2. every tensor an operation returns when one of its tensor arguments is marked (the result of
   an in-place operation, or of ``out=``, is the written tensor);
3. the explicit broadcast of an unmarked tensor to the batch: ``expand`` / ``expand_as`` /
   ``broadcast_to`` / ``repeat`` from a dim 0 of 1 (or fewer dims) to a dim 0 of n — each row is
   then one example's copy of the same values (BERT's ``token_type_ids`` buffer expanded to
   ``(n, L)``), which is how the batch-free routing of :mod:`.batch_free` treats ``.expand()`` too.

A hooked module called on an unmarked input is a *batch-free* call whatever its shape: its
per-example gradients are routed where its output meets the batch (:mod:`.batch_free`), or the
call is refused there with a message naming the module. Marks live on the tensors for one
model call (a fresh token each call), so a tensor kept from an earlier call is unmarked.

Privacy. A marked tensor is, by construction, a function of the batch's inputs through the
recorded operations (or an explicit per-example copy), so row i of it belongs to example i under
the library's standing assumption that the model keeps examples independent. An unmarked tensor
is not a function of any example, so none of its rows may be attributed to one: routing it
through :mod:`.batch_free` gives every example its own gradient through its own copy of the
shared value, and clipping that bounds each example's contribution by C.

What it cannot see (and the docs say so): a model input that is not batched but whose dim 0
equals n by chance (pass such indices with a dim 0 of 1, e.g. ``position_ids`` of shape
``(1, L)``); an explicit ``expand``/``repeat`` of a non-batch tensor to a dim 0 that equals n by
chance; layouts whose batch is not on dim 0. Values that leave the tensor world (``x.tolist()``,
``int(x)``) and come back as new tensors are unmarked: a module called on them is routed or
refused, never silently taken for batched.

Cost: one Python call per torch operation of the forward pass (a few microseconds each), and
nothing in the backward pass.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["BatchProvenance", "descends_from_batch"]

_ATTR = "_adaclip_batch_token"
# ops that copy a tensor along new or size-1 leading dims: from a dim 0 of 1 to one of n they are
# the explicit broadcast to the batch (one copy per example)
_BROADCAST_TO_BATCH = frozenset({"expand", "expand_as", "broadcast_to", "repeat"})
_INPLACE_DUNDERS = frozenset(
    {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__",
     "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__"}
)  # fmt: skip
_NOT_WRITES = frozenset({"requires_grad_", "share_memory_", "retain_grad"})


def _marked(x: Any, token: object) -> bool:
    return isinstance(x, torch.Tensor) and getattr(x, _ATTR, None) is token


def _any_marked(values: Iterable[Any], token: object) -> bool:
    for x in values:
        if isinstance(x, torch.Tensor):
            if getattr(x, _ATTR, None) is token:
                return True
        elif isinstance(x, (list, tuple)):
            for y in x:
                if isinstance(y, torch.Tensor) and getattr(y, _ATTR, None) is token:
                    return True
    return False


def _mark(x: Any, token: object) -> None:
    if isinstance(x, torch.Tensor):
        setattr(x, _ATTR, token)
    elif isinstance(x, (list, tuple)):
        for y in x:
            if isinstance(y, torch.Tensor):
                setattr(y, _ATTR, token)


def _writes(name: str, kwargs: dict[str, Any]) -> bool:
    """Whether the operation ``name`` writes into its first argument (or into ``out=``)."""
    if name in _INPLACE_DUNDERS:
        return True
    return name.endswith("_") and not name.endswith("__") and not name.startswith("_") and name not in _NOT_WRITES


class BatchProvenance(TorchFunctionMode):
    """Marks the tensors of one model call that descend from its batched inputs (module doc).

    Args:
      batch_size: n, the model call's batch size (dim 0 of its batched inputs).
    """

    def __init__(self, batch_size: int) -> None:
        super().__init__()
        self.batch_size = int(batch_size)
        self.token = object()

    def mark_inputs(self, leaves: Iterable[Any]) -> None:
        """Mark the model call's tensor inputs whose dim 0 is the batch size."""
        n = self.batch_size
        for t in leaves:
            if isinstance(t, torch.Tensor) and t.ndim >= 1 and t.shape[0] == n:
                setattr(t, _ATTR, self.token)

    def descends(self, t: Any) -> bool:
        """Whether ``t`` was marked in this call (module doc)."""
        return _marked(t, self.token)

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        token = self.token
        if _any_marked(args, token) or (kwargs and _any_marked(kwargs.values(), token)):
            name = getattr(func, "__name__", "")
            written = kwargs.get("out")
            if written is not None:
                _mark(written, token)
            elif args and _writes(name, kwargs):
                _mark(args[0], token)
            _mark(out, token)
        elif args and isinstance(out, torch.Tensor) and getattr(func, "__name__", "") in _BROADCAST_TO_BATCH:
            src = args[0]
            if (
                isinstance(src, torch.Tensor)
                and out.ndim >= 1
                and out.shape[0] == self.batch_size
                and (src.ndim < out.ndim or (src.ndim >= 1 and src.shape[0] == 1))
            ):
                setattr(out, _ATTR, token)
        return out


def descends_from_batch(t: Any, provenance: BatchProvenance | None) -> bool | None:
    """``True``/``False`` whether ``t`` descends from the batch in the model call whose
    provenance is tracked; ``None`` where none is (outside a tracked model call)."""
    if provenance is None:
        return None
    return provenance.descends(t)
