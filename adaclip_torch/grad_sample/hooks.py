"""The hook engine: :class:`GradSampleHooks`.

Every module that owns parameters directly gets one forward hook. On each call made with
gradients enabled, the hook keeps the call's inputs (detached) in a closure and registers a
gradient hook on the call's output: a plain tensor hook on the one output of a module with a
rule, a *multi-gradient* hook (``torch.autograd.graph.register_multi_grad_hook``, mode
``"all"``) on the output tensors of a module that uses the fallback. In the backward pass that
hook fires once, with the gradients of all the outputs that reached the loss (``None`` for the
others), and turns inputs + output gradients into per-example parameter gradients — with the
module's registered rule, or else the :mod:`torch.func` fallback — and adds them to
``param.grad_sample``. The closures hold the module and the hooks object weakly and no output
(the graph owns them, and a cycle through it is never collected).

Because every call has its own closure, a module called several times in one forward pass (a
shared layer, an RNN cell unrolled over time) and a parameter used by several modules (tied
embedding/softmax weights) simply get one contribution per call, summed — which is exactly the
per-example gradient of the total loss. Nothing is kept on the module between calls, so a
forward pass without a backward leaks nothing once its graph is freed.

The batch size n of each call of the model (dim 0 of its tensor inputs, when they agree) is
recorded by a forward pre-hook on the model. A module call whose input does not carry it — an
``nn.Embedding`` on position ids of shape ``(1, L)``, a module declared batch-free (T5's relative
attention bias, indexed without a batch dim), … (:meth:`GradSampleHooks._batch_free_call`) — is a
*batch-free* call: its per-example gradients are taken where its output meets the batch
(:mod:`adaclip_torch.grad_sample.batch_free`, with the maths and the privacy argument).

The engine is split by concern: :mod:`._plan` walks the model and decides which modules get a
rule and which the fallback; :mod:`._routing` tells batch-free calls from batched ones;
:mod:`._watchers` holds the backward hooks each call registers; :mod:`._accumulate` checks and
stores what they produce; :mod:`._capture` swaps weights out for the ghost path's capture-only
modules. :class:`GradSampleHooks` composes them and holds the public lifecycle.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from adaclip.errors import InvalidHyperparameterError

from ..validation import check_model
from ._accumulate import _Accumulator
from ._capture import _WeightSwap
from ._plan import _sharded_parameters, plan_modules
from ._routing import _BatchRouting
from ._state import hooks_muted
from ._watchers import watch_fallback, watch_fallback_free, watch_rule, watch_rule_free
from .functorch_fallback import fallback_batch_dims
from .hf import register_transformers_rules
from .registry import GradSampleRule

__all__ = ["GradSampleHooks", "LOSS_REDUCTIONS"]

LOSS_REDUCTIONS = ("mean", "sum")
# model -> its attached hooks, both held weakly (the model object itself is left untouched). A
# strong value would keep the model alive through ``hooks.model`` for as long as the process runs
# unless remove() is called: one model per training of a sweep.
_ATTACHED: weakref.WeakKeyDictionary[nn.Module, weakref.ref[GradSampleHooks]] = weakref.WeakKeyDictionary()


def _check_arguments(model: Any, loss_reduction: Any, batch_first: Any, allow_multiple_backward: Any) -> None:
    """Refuse invalid arguments of :class:`GradSampleHooks`, and a model that already has hooks."""
    if not isinstance(model, nn.Module):
        raise InvalidHyperparameterError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if loss_reduction not in LOSS_REDUCTIONS:
        raise InvalidHyperparameterError(
            f"loss_reduction must be one of {LOSS_REDUCTIONS}, got {loss_reduction!r}"
        )
    if not isinstance(batch_first, bool):
        raise InvalidHyperparameterError(f"batch_first must be a bool, got {batch_first!r}")
    if not isinstance(allow_multiple_backward, bool):
        raise InvalidHyperparameterError(
            f"allow_multiple_backward must be a bool, got {allow_multiple_backward!r}"
        )
    attached = _ATTACHED.get(model)
    if attached is not None and attached() is not None:
        raise InvalidHyperparameterError(
            "model already has GradSampleHooks attached (a DPOptimizer wrapping it?): call "
            "remove_hooks() on that optimizer, or remove() on the GradSampleHooks, first"
        )


class GradSampleHooks(_WeightSwap, _BatchRouting, _Accumulator):
    """Attach per-sample-gradient hooks to ``model``.

    After ``loss.backward()``, every parameter ``p`` with ``p.requires_grad`` holds
    ``p.grad_sample`` of shape ``(n, *p.shape)``: row i is the gradient of example i's own loss
    (not divided by n), summed over every use of ``p`` in the forward pass.

    Args:
        model: the module to instrument (hooks go on it and every submodule that owns parameters).
        loss_reduction: ``"mean"`` if the loss averages over the n examples (the captured
            gradients are then multiplied by n) or ``"sum"`` if it sums them.
        batch_first: whether module inputs carry the batch on dim 0 (``True``) or dim 1
            (``False``, sequence-first layouts). Convolutions and GroupNorm always use dim 0 (their
            torch layout); ``nn.RNNBase`` modules follow their own ``batch_first`` flag.

    One backward pass per batch: row i of ``grad_sample`` is *unit* i, and everything that
    reaches row i before :meth:`clear` is clipped together as one unit. Within one backward
    pass that is exactly right: a module called several times (a shared layer, an unrolled RNN
    cell, tied weights) adds one contribution per call, and a forward over *paired* inputs in one
    graph (a siamese or contrastive model whose loss reads ``model(a)[i]`` and ``model(b)[i]``)
    makes the pair ``(a_i, b_i)`` the unit — the privacy guarantee is then about pairs, so each
    pair must be one record of the data set (or one user's). A *second* backward pass before
    :meth:`clear` would add another batch's example i to row i, merging unrelated examples into
    one unit while the step is accounted as one batch; it raises :class:`InvalidGradientError`
    from ``loss.backward()`` before anything of that pass is stored (with a
    :class:`~adaclip_torch.DPOptimizer`: call ``optimizer.accumulate()`` or ``step()`` between
    batches, or sum the losses of one batch and call ``backward()`` once). The same holds for
    calls inside one pass whose batch sizes differ. ``allow_multiple_backward=True`` (standalone
    use only; the optimizers never set it) restores summing passes row by row, for callers who
    know the rows of every pass are the same examples (several losses of one batch, with
    ``retain_graph=True``). A ``grad_sample`` tensor may be updated in place by later
    contributions until :meth:`clear`; copy it if you need a snapshot.

    Empty batches (n = 0): if the model's forward and backward run on an empty batch (Linear,
    Embedding, Conv, norms, ``nn.LSTM`` and the fallback do in torch 2.13), every ``grad_sample`` is
    a ``(0, *shape)`` tensor; a module whose forward rejects n = 0 raises torch's own error from
    the forward pass (nothing is captured). The backward of an empty batch must still run: with
    ``reduction="mean"`` the loss is NaN (0/0) but its gradients are empty, so that is harmless.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        loss_reduction: str = "mean",
        batch_first: bool = True,
        allow_multiple_backward: bool = False,
    ) -> None:
        _check_arguments(model, loss_reduction, batch_first, allow_multiple_backward)
        check_model(model)
        register_transformers_rules()  # rules for transformers' layer types, if it is imported
        # how each hooked module is handled, its path (for messages), the modules declared batch-free
        plan = plan_modules(model)
        self._plans: dict[nn.Module, GradSampleRule | bool] = plan.plans
        self._paths: dict[nn.Module, str] = plan.paths
        self._batch_free: set[nn.Module] = plan.batch_free
        self.model = model
        self.loss_reduction = loss_reduction
        self.batch_first = batch_first
        self._batch_dim = 0 if batch_first else 1
        self._active = True
        self._batch_size = 0
        self._accum_n: int | None = None
        self.allow_multiple_backward = allow_multiple_backward
        # the autograd graph task (backward pass) whose per-sample gradients are held, if any
        self._accum_pass: int | None = None
        # Modules whose (input, output-gradient) pairs are kept instead of turned into
        # grad_sample (the optimizer's ghost path computes norms and clipped sums from them).
        self._capture: set[nn.Module] = set()
        # (input, output gradient of the loss as reduced, loss scale s): s·gradient is the
        # per-example output gradient (s = n under loss_reduction="mean", else 1)
        self.captures: dict[nn.Module, list[tuple[torch.Tensor, torch.Tensor, float]]] = {}
        # FSDP2 (fully_shard): the parameters registered now are the sharded DTensors the
        # optimizer holds, but during forward/backward FSDP registers unsharded copies in their
        # place; per-example gradients are stored on the sharded ones (see _store)
        self._sharded: dict[tuple[nn.Module, str], nn.Parameter] = _sharded_parameters(
            [(m, self._plans[m]) for _, m in plan.modules]
        )
        self._handles = [m.register_forward_hook(self._forward_hook, with_kwargs=True) for _, m in plan.modules]
        # the batch size of each (nested) call of the model, for the batch-free calls
        self._call_n: list[int | None] = []
        self._provenance: list[Any] = []
        self._handles.append(model.register_forward_pre_hook(self._model_pre_hook, with_kwargs=True, prepend=True))
        self._handles.append(model.register_forward_hook(self._model_post_hook, always_call=True))
        # capture-only modules whose weight autograd does not differentiate (see capture_only):
        # the hooks that swap it out and back in, and the weights swapped out during a call
        self._detach_handles: list[Any] = []
        self._swapped: dict[nn.Module, list[nn.Parameter]] = {}
        _ATTACHED[model] = weakref.ref(self)

    # ------------------------------------------------------------------ public API
    @property
    def batch_size(self) -> int:
        """n of the last backward pass that produced per-sample gradients (0 if none)."""
        return self._batch_size

    @property
    def ruled_modules(self) -> set[nn.Module]:
        """The hooked modules whose calls go through a registered rule (the others use the
        :mod:`torch.func` fallback, or are covered by a parent's); only these can be captured
        (:meth:`capture_only`)."""
        return {m for m, plan in self._plans.items() if isinstance(plan, GradSampleRule)}

    def module_path(self, module: nn.Module) -> str:
        """``module``'s dotted path in the model (``"<root>"`` for the model itself)."""
        return self._paths.get(module) or "<root>"

    def _where(self, module: nn.Module) -> str:
        return f"{type(module).__name__} `{self.module_path(module)}`"

    def clear(self) -> None:
        """Delete ``grad_sample`` from every parameter of the model (and every captured
        activation/backprop pair) and restart accumulation."""
        for p in self.model.parameters():
            if hasattr(p, "grad_sample"):
                del p.grad_sample
        self.captures = {}
        self._accum_n = None
        self._accum_pass = None

    def _loss_scale(self, n: int) -> float:
        """``s`` with ``s·δ`` example i's own output gradient, for the gradient ``δ`` of the loss
        as reduced: ``n`` under ``loss_reduction="mean"``, else 1."""
        return float(n) if self.loss_reduction == "mean" else 1.0

    def capture_only(self, modules: Any, *, skip_weight_grads: bool = True) -> None:
        """For these hooked modules (ruled ones only), keep each call's ``(input, output
        gradient, s)`` — batch first; the gradient as autograd gave it, of the loss as reduced,
        and ``s`` the factor that makes it per-example (``n`` under ``loss_reduction="mean"``,
        else 1; the ghost forms apply it to their per-example results instead of a pass over
        the gradient) — in ``self.captures[module]`` instead of computing ``grad_sample``. Used
        by the ghost path of :class:`adaclip_torch.DPOptimizer`; an empty set restores the default.

        ``skip_weight_grads`` (default): autograd does not compute the batch gradient of these
        modules' ``weight``, which the ghost path never reads (it forms ``Σ_i c_i g_i`` from the
        captures). During each call made with gradients enabled the weight is replaced by a
        detached alias of itself (same storage, same values: the output is bit-identical), and
        put back as soon as the call returns or raises. Autograd then skips the weight-gradient
        product (``Eᵀ X`` for a Linear layer: a third of its backward), and ``weight.grad`` is
        left as it was. The weight stays attached when nothing else in the call needs a
        gradient (no trainable bias and no input that requires one, e.g. an ``nn.Embedding``
        or a first layer without bias): the output gradient the capture needs would not exist.
        """
        modules = set(modules)
        for m in modules:
            if not isinstance(self._plans.get(m), GradSampleRule):
                why = "its type has no registered grad-sample rule"
                if m in self._paths and m not in self._plans:
                    why = ("it is covered by the torch.func fallback of a parent module that owns parameters "
                           "itself, which computes the per-example gradients of its whole subtree")  # fmt: skip
                raise InvalidHyperparameterError(
                    f"{self._where(m)} cannot be captured for the ghost path: {why}; leave it to the "
                    "materialised path (ghost_modules(..., hooked=hooks.ruled_modules) selects only "
                    "capturable modules)"
                )
        self._remove_detach_hooks()
        self._capture = modules
        self.captures = {}
        if skip_weight_grads:
            self._add_detach_hooks(modules)


    @contextmanager
    def paused(self) -> Iterator[None]:
        """Within the block the hooks ignore every call of the model's modules (nothing is
        captured or stored); they resume afterwards. For callers that run the model's modules
        themselves and hand the calls over with :meth:`deliver_call`, as the compiled region of
        :mod:`adaclip_torch.compiled` does."""
        was, self._active = self._active, False
        try:
            yield
        finally:
            self._active = was

    def remove(self) -> None:
        """Detach every hook and delete all ``grad_sample``: the model is as before.

        Graphs built before ``remove()`` are ignored if backpropagated afterwards.
        """
        self._active = False
        for h in self._handles:
            h.remove()
        self._handles = []
        self._remove_detach_hooks()
        self.clear()
        attached = _ATTACHED.get(self.model)
        if attached is not None and attached() is self:
            del _ATTACHED[self.model]

    def __enter__(self) -> GradSampleHooks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    # ------------------------------------------------------------------ internals
    def _forward_hook(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> Any:
        """Forward hook of every hooked module: on a call made with gradients enabled that has
        trainable parameters and differentiable outputs, register the backward hook that turns the
        call into per-example gradients (:mod:`._watchers`). Returns the output of a batch-free
        call wrapped (:mod:`.batch_free`), else ``None`` (the output as it is)."""
        if not self._active or hooks_muted() or not torch.is_grad_enabled():
            return None
        plan = self._plans.get(module)
        if plan is None:
            return
        if plan is True:  # fallback over the subtree
            names = [k for k, p in module.named_parameters() if p.requires_grad]
        else:
            names = [k for k, p in module._parameters.items() if p is not None and p.requires_grad]
        if not names:
            return None
        out_leaves, _ = tree_flatten(output)
        watched = [
            (k, t) for k, t in enumerate(out_leaves) if isinstance(t, torch.Tensor) and t.requires_grad
        ]
        if not watched:
            return None
        in_leaves = tree_flatten((args, kwargs))[0]
        if isinstance(plan, GradSampleRule):
            n = self._batch_free_call(module, plan, args, in_leaves, None)
            if n is not None:
                return watch_rule_free(self, module, plan, args, output, watched, n)
            watch_rule(self, module, plan, args, watched)
        else:
            in_dims, _ = fallback_batch_dims(module, args, kwargs, output, self._batch_dim)
            n = self._batch_free_call(module, plan, args, in_leaves, in_dims)
            if n is not None:
                return watch_fallback_free(self, module, names, args, kwargs, output, out_leaves, watched, n)
            watch_fallback(self, module, names, args, kwargs, output, out_leaves, watched)
        return None

