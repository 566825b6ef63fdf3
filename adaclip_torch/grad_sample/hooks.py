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
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten, tree_unflatten

from adaclip.errors import InvalidGradientError, InvalidHyperparameterError

from ..validation import check_model
from . import batch_free as _bf
from ._state import backward_muted, hooks_muted
from .functorch_fallback import (
    _check_batch,
    fallback_batch_dims,
    fallback_free_grad_sample,
    fallback_grad_sample,
)
from .hf import register_transformers_rules
from .registry import GradSampleRule, get_grad_sampler

__all__ = ["GradSampleHooks", "LOSS_REDUCTIONS"]

LOSS_REDUCTIONS = ("mean", "sum")
# model -> its attached hooks, both held weakly (the model object itself is left untouched). A
# strong value would keep the model alive through ``hooks.model`` for as long as the process runs
# unless remove() is called: one model per training of a sweep.
_ATTACHED: weakref.WeakKeyDictionary[nn.Module, weakref.ref[GradSampleHooks]] = weakref.WeakKeyDictionary()
_OWNED = "_adaclip_owned_sum"


def _current_backward() -> int:
    """An id of the backward pass now running (autograd's graph task; -1 outside one): hooks
    that fire in one ``backward()`` / ``autograd.grad`` call share it, another call gets another."""
    return int(torch._C._current_graph_task_id())


def _own_params(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module._parameters.values() if p is not None]


def _sharded_parameters(
    plans: list[tuple[nn.Module, GradSampleRule | bool]],
) -> dict[tuple[nn.Module, str], nn.Parameter]:
    """``(module, name) -> parameter`` for the hooked modules' parameters that are DTensors now
    (FSDP2's sharded parameters; ``name`` as the hooks store it: the module's own parameter
    name, or the dotted name within a fallback module's subtree). Empty for a model without
    DTensor parameters — always when ``torch.distributed.tensor`` was never imported.

    FSDP2 registers unsharded copies of these parameters on the modules around each forward and
    backward, so ``module.get_parameter(name)`` in a backward hook returns a tensor the optimizer
    does not hold; the per-example gradient (of the full, unsharded parameter: the hooks see
    this rank's examples and the full layer) belongs on the sharded parameter, whose ``shape``
    is the full one."""
    dtensor_module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(dtensor_module, "DTensor", None)
    if dtensor is None:
        return {}
    out: dict[tuple[nn.Module, str], nn.Parameter] = {}
    for m, plan in plans:
        named = m.named_parameters() if plan is True else m._parameters.items()
        for name, p in named:
            if isinstance(p, dtensor):
                out[(m, name)] = p
    return out


def _active_dropout(module: nn.Module) -> str | None:
    """A description of the first dropout active in ``module``'s forward (itself or a
    descendant, in training mode), or ``None``."""
    for name, c in module.named_modules():
        if not c.training:
            continue
        where = f"{type(c).__name__}" + (f" ({name})" if name else "")
        if isinstance(c, nn.modules.dropout._DropoutNd) and c.p > 0:
            return f"dropout p={c.p} in {where}"
        if isinstance(c, nn.MultiheadAttention) and c.dropout > 0:
            return f"attention dropout={c.dropout} in {where}"
        if isinstance(c, nn.RNNBase) and c.dropout > 0 and c.num_layers > 1:
            return f"inter-layer dropout={c.dropout} in {where}"
    return None


def _refuse_active_dropout(module: nn.Module, who: str, advice: str = "") -> None:
    """Refuse a fallback module with an active dropout: the fallback re-runs the forward, so its
    random mask would differ from the one the loss saw. ``who`` names the module in the message,
    ``advice`` is appended to it."""
    stochastic = _active_dropout(module)
    if stochastic is not None:
        raise InvalidHyperparameterError(
            f"{who}: {stochastic} is active (training mode) inside a module whose "
            "per-sample gradients come from the torch.func fallback, which re-runs the forward" + advice
        )


def _detached_leaves(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], Any]:
    """The leaves of a call's ``(args, kwargs)``, tensors detached, and the tree's spec: what a
    fallback hook keeps of the call (never the graph) to re-run it per example."""
    leaves, spec = tree_flatten((args, kwargs))
    return [x.detach() if isinstance(x, torch.Tensor) else x for x in leaves], spec


def _live(hooks_ref: weakref.ref[Any], module_ref: weakref.ref[nn.Module]) -> tuple[Any, nn.Module] | None:
    """The hooks object and the module a backward hook was registered for, or ``None`` when the
    hook must do nothing: either was collected, the hooks are inactive, or backward is muted.
    (The hooks hold both weakly, see ``GradSampleHooks._watch_rule``.)"""
    hooks, module = hooks_ref(), module_ref()
    if hooks is None or module is None or not hooks._active or backward_muted():
        return None
    return hooks, module


class GradSampleHooks:
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
        check_model(model)
        register_transformers_rules()  # rules for transformers' layer types, if it is imported
        # The plan of every hooked module: its rule, or the fallback over its own parameters —
        # or over its whole subtree when it has parameter-owning descendants (a module such as
        # nn.MultiheadAttention uses its child's weights without calling the child, whose hooks
        # would then never fire); descendants of such a module are not hooked themselves.
        self._plans: dict[nn.Module, GradSampleRule | bool] = {}
        covered: set[int] = set()
        modules: list[tuple[str, nn.Module]] = []
        # module -> its path in the model, for messages; modules declared batch-free
        self._paths: dict[nn.Module, str] = {}
        self._batch_free: set[nn.Module] = set()
        for name, m in model.named_modules():
            self._paths.setdefault(m, name)
            if _bf.is_batch_free_module(name, m):
                self._batch_free.add(m)
        for name, m in model.named_modules():  # pre-order: parents before children
            if id(m) in covered or not _own_params(m):
                continue
            rule = get_grad_sampler(m)
            subtree = rule is None and any(_own_params(c) for c in m.modules() if c is not m)
            if subtree:
                for c in m.modules():
                    if c is not m:
                        covered.add(id(c))
            self._plans[m] = rule if rule is not None else subtree
            modules.append((name, m))
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
        self.captures: dict[nn.Module, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        # FSDP2 (fully_shard): the parameters registered now are the sharded DTensors the
        # optimizer holds, but during forward/backward FSDP registers unsharded copies in their
        # place; per-example gradients are stored on the sharded ones (see _store)
        self._sharded: dict[tuple[nn.Module, str], nn.Parameter] = _sharded_parameters(
            [(m, self._plans[m]) for _, m in modules]
        )
        self._handles = [m.register_forward_hook(self._forward_hook, with_kwargs=True) for _, m in modules]
        # the batch size of each (nested) call of the model, for the batch-free calls
        self._call_n: list[int | None] = []
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

    def capture_only(self, modules: Any, *, skip_weight_grads: bool = True) -> None:
        """For these hooked modules (ruled ones only), keep each call's ``(input, output
        gradient)`` — batch first, the gradient scaled for the loss reduction — in
        ``self.captures[module]`` instead of computing ``grad_sample``. Used by the ghost
        path of :class:`adaclip_torch.DPOptimizer`; an empty set restores the default.

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
            for m in modules:
                self._detach_handles.append(m.register_forward_pre_hook(self._detach_weight))
                # first among the forward hooks, and run even when forward raises
                self._detach_handles.append(m.register_forward_hook(self._restore_weight, prepend=True, always_call=True))

    def _remove_detach_hooks(self) -> None:
        for h in self._detach_handles:
            h.remove()
        self._detach_handles = []

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

    def _model_pre_hook(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Record the batch size of this call of the model: dim 0 of its tensor inputs, if those of
        size other than 1 agree (1 if all have size 1; ``None`` if they disagree, or with
        ``batch_first=False``)."""
        n: int | None = None
        if self._batch_dim == 0:
            sizes = {int(t.shape[0]) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.ndim >= 1}
            big = sizes - {1}
            n = next(iter(big)) if len(big) == 1 else (1 if sizes == {1} else None)
        self._call_n.append(n)

    def _model_post_hook(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if self._call_n:
            self._call_n.pop()

    def _batch_free_call(self, module: nn.Module, plan: GradSampleRule | bool, args: tuple[Any, ...],
                         leaves: list[Any], dims: list[int | None] | None) -> int | None:  # fmt: skip
        """The batch size n if this call of ``module`` is batch-free (its per-example gradients are
        routed, :mod:`.batch_free`), else ``None`` (a batched call, as before).

        Batch-free (batch-first layouts only; never the model itself, whose inputs define the
        batch — an ``nn.LSTM(batch_first=False)`` hooked on its own has it on dim 1):

        - its input is a batch-free tensor (the output of a batch-free call, not yet combined with
          the batch) — for a fallback module, every tensor input is;
        - the module was declared batch-free (:func:`~.batch_free.mark_batch_free`, or an
          ``nn.Embedding`` named ``relative_attention_bias``);
        - an ``nn.Embedding`` called on ids of size 1 on dim 0 (position ids ``(1, L)``) while the
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
        if isinstance(plan, GradSampleRule):
            x = args[0] if args else None
            if isinstance(x, _bf.BatchFreeTensor):
                return _bf.call_batch_size([x])
            free = module in self._batch_free or _bf.is_batch_free_module("", module)
            if not free and type(module) is nn.Embedding and model_n not in (None, 1):
                free = isinstance(x, torch.Tensor) and x.ndim >= 1 and x.shape[0] == 1
        else:
            carriers = [t for t, d in zip(leaves, dims or [], strict=False) if d is not None and isinstance(t, torch.Tensor)]
            if carriers and all(isinstance(t, _bf.BatchFreeTensor) for t in carriers):
                return _bf.call_batch_size(carriers)
            declared = module in self._batch_free or _bf.is_batch_free_module("", module)
            if not declared and any(not isinstance(t, _bf.BatchFreeTensor) for t in carriers):
                return None  # batched (batch-free inputs among them are passed to every example as they are)
            free = True  # no tensor input at all, or declared
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

    def _forward_hook(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> Any:
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
                return self._watch_rule_free(module, plan, args, output, watched, n)
            self._watch_rule(module, plan, args, watched)
        else:
            in_dims, _ = fallback_batch_dims(module, args, kwargs, output, self._batch_dim)
            n = self._batch_free_call(module, plan, args, in_leaves, in_dims)
            if n is not None:
                return self._watch_fallback_free(module, names, args, kwargs, output, out_leaves, watched, n)
            self._watch_fallback(module, names, args, kwargs, output, out_leaves, watched)
        return None

    def _watch_rule_free(
        self,
        module: nn.Module,
        rule: GradSampleRule,
        args: tuple[Any, ...],
        output: torch.Tensor,
        watched: list[tuple[int, torch.Tensor]],
        n: int,
    ) -> torch.Tensor:
        """A batch-free call of a ruled module: the output is returned wrapped (so that its per-example
        gradients are routed where it meets the batch, :mod:`.batch_free`); when its gradient arrives,
        the routed ``δ`` (n, *output) and the input expanded to n go to the rule (or the capture).

        Layout: an input and output of size 1 on dim 0 are one example's (``u``, ``o``); otherwise
        the input has no batch dim and ``u[None]``, ``o[None]`` are. Either way the rule sees
        ``u`` repeated n times and ``δ_i`` in row i."""
        if len(watched) != 1 or watched[0][0] != 0:
            raise InvalidGradientError(f"{self._where(module)}: its grad-sample rule expects one output tensor")
        x = args[0].detach()
        rest = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args[1:])
        o_shape = tuple(output.shape)
        batch_one = x.ndim >= 1 and x.shape[0] == 1 and len(o_shape) >= 1 and o_shape[0] == 1
        if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            batch_one = x.ndim == len(module.kernel_size) + 2
        where = self._where(module)
        alias, routed = _bf.new_source(output, n, where)
        hooks_ref, module_ref = weakref.ref(self), weakref.ref(module)  # see _watch_rule

        def on_total(grad: torch.Tensor) -> None:
            live = _live(hooks_ref, module_ref)
            if live is None:
                return
            self, module = live
            per = routed.take()
            if per is None:
                per = grad.new_zeros((n, *grad.shape))
            _bf.check_routed(where, grad, per)
            g = per.reshape(n, *o_shape[1:]) if batch_one else per
            xb = x.expand(n, *x.shape[1:]) if batch_one else x.unsqueeze(0).expand(n, *x.shape)
            if self.loss_reduction == "mean":
                g = g * n
            self._check_n(module, n, _current_backward())
            if module in self._capture:
                self.captures.setdefault(module, []).append((xb, g))
                return
            self._store(module, rule.fn(module, (xb, *rest), g), n)

        with _bf.DisableTorchFunctionSubclass():
            output.register_hook(lambda grad: on_total(grad))
        return alias

    def _watch_fallback_free(
        self,
        module: nn.Module,
        names: list[str],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        output: Any,
        out_leaves: list[Any],
        watched: list[tuple[int, torch.Tensor]],
        n: int,
    ) -> Any:
        """A batch-free call of a module on the fallback: every differentiable output is wrapped;
        when their gradients arrive, the routed ``δ`` of each is pulled back to the parameters by
        one vector–Jacobian product of the call (its inputs are the same for every example),
        batched over the examples (:func:`fallback_free_grad_sample`)."""
        where = self._where(module)
        _refuse_active_dropout(module, where)
        in_leaves, in_spec = _detached_leaves(args, kwargs)
        new_leaves = list(out_leaves)
        routeds = []
        for k, t in watched:
            new_leaves[k], routed = _bf.new_source(t, n, where)
            routeds.append(routed)
        hooks_ref, module_ref = weakref.ref(self), weakref.ref(module)  # see _watch_rule
        watched_leaves = [k for k, _ in watched]

        def on_grads(grads: Any) -> None:
            live = _live(hooks_ref, module_ref)
            if live is None:
                return
            self, module = live
            per_out = []
            for k, routed, g in zip(watched_leaves, routeds, grads, strict=True):
                per = routed.take()
                if g is None and per is None:
                    continue
                if per is None:
                    per = g.new_zeros((n, *g.shape))
                if g is not None:
                    _bf.check_routed(where, g, per)
                per_out.append((k, per * n if self.loss_reduction == "mean" else per))
            if not per_out:
                return
            self._check_n(module, n, _current_backward())
            self._store(module, fallback_free_grad_sample(module, names, in_leaves, in_spec, per_out, n), n)

        with _bf.DisableTorchFunctionSubclass():
            register_multi_grad_hook([t for _, t in watched], on_grads, mode="all")
        return tree_unflatten(new_leaves, tree_flatten(output)[1])

    def _watch_rule(
        self,
        module: nn.Module,
        rule: GradSampleRule,
        args: tuple[Any, ...],
        watched: list[tuple[int, torch.Tensor]],
    ) -> None:
        bd = self._batch_dim if rule.batch_first_sensitive else 0
        acts = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
        if len(watched) != 1 or watched[0][0] != 0:
            raise InvalidGradientError(f"{self._where(module)}: its grad-sample rule expects one output tensor")

        # The hook lives in the autograd graph (C++), which Python's garbage collector cannot
        # traverse while the graph is referenced: a closure holding the hooks object or the
        # module strongly would keep the model, its optimizer state and each step's activations
        # alive after the model is dropped. Hold them weakly; the closure keeps only this
        # call's detached inputs, freed with the graph.
        hooks_ref, module_ref = weakref.ref(self), weakref.ref(module)

        def on_grads(grads: Any) -> None:
            live = _live(hooks_ref, module_ref)
            if live is None or grads[0] is None:
                return
            self, module = live
            backward = _current_backward()
            g = self._to_batch_first(module, grads[0], bd, "output gradient")
            x = tuple(
                self._to_batch_first(module, a, bd, "input") if isinstance(a, torch.Tensor) else a
                for a in acts
            )
            n = g.shape[0]
            if self.loss_reduction == "mean":
                g = g * n
            self._check_n(module, n, backward)
            if module in self._capture:
                self.captures.setdefault(module, []).append((x[0], g))
                return
            self._store(module, rule.fn(module, x, g), n)

        # One output tensor: a plain tensor hook. ``register_multi_grad_hook`` would call it the
        # same way, but its inner closure holds the output's grad_fn, on which the hook is
        # registered: a cycle through C++ that the collector never breaks.
        watched[0][1].register_hook(lambda grad: on_grads((grad,)))

    def _watch_fallback(
        self,
        module: nn.Module,
        names: list[str],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        output: Any,
        out_leaves: list[Any],
        watched: list[tuple[int, torch.Tensor]],
    ) -> None:
        _refuse_active_dropout(
            module,
            type(module).__name__,
            " — the random mask would differ. Use dropout=0 there (put nn.Dropout between modules "
            "instead) or, for an LSTM, adaclip_torch.layers.DPLSTM",
        )
        if isinstance(module, nn.RNNBase) and isinstance(
            args[0] if args else kwargs.get("input"), nn.utils.rnn.PackedSequence
        ):
            raise InvalidGradientError(
                f"{type(module).__name__} with a PackedSequence input is not supported by the "
                "per-sample-gradient fallback; pad the sequences instead"
            )
        in_leaves, in_spec = _detached_leaves(args, kwargs)
        in_dims, out_dims = fallback_batch_dims(module, args, kwargs, output, self._batch_dim)
        # batch-free inputs (the same for every example) are passed to each example as they are
        raw = tree_flatten((args, kwargs))[0]
        in_dims = [None if isinstance(t, _bf.BatchFreeTensor) else d for t, d in zip(raw, in_dims, strict=False)]
        if len(in_dims) != len(in_leaves) or len(out_dims) != len(out_leaves):
            raise InvalidGradientError(f"{type(module).__name__}: could not align batch dims with its inputs")
        path = self.module_path(module)
        n_in = _check_batch(module, in_leaves, in_dims, "input", path)
        _check_batch(module, out_leaves, out_dims, "output", path)

        hooks_ref, module_ref = weakref.ref(self), weakref.ref(module)  # see _watch_rule
        # indices only: a closure holding the outputs would hold their grad_fns, on which the
        # hook is registered (a cycle through the graph, never collected)
        watched_leaves = [k for k, _ in watched]

        def on_grads(grads: Any) -> None:
            live = _live(hooks_ref, module_ref)
            if live is None:
                return
            self, module = live
            out_grads = [(k, g, out_dims[k]) for k, g in zip(watched_leaves, grads) if g is not None]
            if not out_grads:
                return
            backward = _current_backward()
            n = out_grads[0][1].shape[out_grads[0][2]]
            if n_in is not None and n_in != n:
                raise InvalidGradientError(
                    f"{type(module).__name__}: inputs have batch size {n_in}, output gradients {n}"
                )
            self._check_n(module, n, backward)
            if self.loss_reduction == "mean":
                out_grads = [(k, g * n, d) for k, g, d in out_grads]
            self._store(
                module, fallback_grad_sample(module, names, in_leaves, in_spec, in_dims, out_grads, n), n
            )

        register_multi_grad_hook([t for _, t in watched], on_grads, mode="all")

    def _to_batch_first(self, module: nn.Module, t: torch.Tensor, bd: int, what: str) -> torch.Tensor:
        if bd == 0:
            return t
        if t.dim() <= bd:
            raise InvalidGradientError(
                f"{type(module).__name__}: {what} of shape {tuple(t.shape)} has no batch dim {bd} "
                "(batch_first=False)"
            )
        return t.movedim(bd, 0)

    def _check_n(self, module: nn.Module, n: int, backward: int) -> None:
        """Refuse a contribution that would merge units: one from a second backward pass before
        :meth:`clear` (unless ``allow_multiple_backward``), or one whose batch size differs from
        the rows held. Raises before anything of the contribution is stored."""
        if (
            not self.allow_multiple_backward
            and self._accum_pass is not None
            and backward != self._accum_pass
        ):
            raise InvalidGradientError(
                "a second backward pass before the per-example gradients of the first were used: "
                "its example i would be added to the first pass's example i and both clipped as ONE "
                "unit, while the step is accounted as one batch. With a DPOptimizer call "
                "optimizer.accumulate() (or step()) after each backward — accumulate() is gradient "
                "accumulation over physical batches — or optimizer.zero_grad() to drop the first "
                "pass; for several losses of one batch, sum them and call backward() once. Nothing "
                "of this pass was stored"
            )
        if self._accum_n is not None and n != self._accum_n:
            hint = ""
            if n > 1 and self._accum_n > 1 and (n % self._accum_n == 0 or self._accum_n % n == 0):
                hint = (
                    ". A module called on the batch's positions flattened into dim 0 (a reshape of "
                    "(n, L, d) to (n·L, d), as OPT's MLP does) has rows that are tokens, not examples: keep "
                    "the batch on dim 0 around it, or freeze it "
                    f"(model.{self.module_path(module)}.requires_grad_(False))"
                )
            elif 1 in (n, self._accum_n) or self._batch_dim != 0:
                hint = (
                    ". If a module is called on an input that does not carry the batch (position ids of "
                    "batch 1, an index without a batch dim), its per-example gradients are routed where its "
                    "output meets the batch — but only with batch_first=True and when the model's tensor "
                    "inputs agree on dim 0 (size 1 aside), which tell the batch size, and for nn.Embedding, "
                    "modules fed by such calls, and modules declared with "
                    f"adaclip_torch.grad_sample.mark_batch_free(model.{self.module_path(module)}); otherwise "
                    "call it on a batched input or freeze it "
                    f"(model.{self.module_path(module)}.requires_grad_(False))"
                )
            raise InvalidGradientError(
                f"{self._where(module)}: a backward contribution with batch size {n} while "
                f"per-example gradients of batch size {self._accum_n} are held: row i is unit i, so "
                "every call must see the same batch. With a DPOptimizer call optimizer.accumulate() "
                "or step() between batches (or zero_grad() to drop the held ones); with "
                f"GradSampleHooks alone, clear(){hint}"
            )
        self._accum_n = n
        self._batch_size = n
        self._accum_pass = backward

    def _store(self, module: nn.Module, samples: dict[str, torch.Tensor], n: int) -> None:
        for name, gs in samples.items():
            p = self._sharded.get((module, name))
            if p is None:
                p = module.get_parameter(name)
            if not p.requires_grad:
                continue
            gs = gs.to(dtype=p.dtype)
            if gs.shape != (n, *p.shape):
                raise InvalidGradientError(
                    f"{type(module).__name__}.{name}: per-sample gradient of shape {tuple(gs.shape)}, "
                    f"expected {(n, *p.shape)}"
                )
            prev = getattr(p, "grad_sample", None)
            if prev is None:
                p.grad_sample = gs
            elif prev.shape != gs.shape:
                raise InvalidGradientError(
                    f"{type(module).__name__}.{name}: accumulated grad_sample has shape "
                    f"{tuple(prev.shape)}, the new one {tuple(gs.shape)}; call clear() between batches"
                )
            elif getattr(prev, _OWNED, False):
                prev.add_(gs)  # a sum this engine allocated: safe to update in place
            else:
                total = prev + gs  # never write into a tensor autograd or a rule may still use
                setattr(total, _OWNED, True)
                p.grad_sample = total
