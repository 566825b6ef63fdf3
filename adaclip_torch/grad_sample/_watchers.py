"""The backward half of the hook engine: what a hooked call leaves in the autograd graph.

For each call of a hooked module made with gradients enabled, :meth:`.hooks.GradSampleHooks._forward_hook`
picks one of four *watchers*, by the module's plan (a registered rule, or the :mod:`torch.func`
fallback) and by whether the call is batched or batch-free (:mod:`.batch_free`):

- :func:`watch_rule`: a plain tensor hook on the call's one output, which feeds the rule;
- :func:`watch_fallback`: a multi-gradient hook on the call's outputs, which re-runs the call
  per example (:func:`~.functorch_fallback.fallback_grad_sample`);
- :func:`watch_rule_free` and :func:`watch_fallback_free`: the same for a batch-free call, whose
  per-example output gradients are routed where its output meets the batch.

Each watcher keeps, in the closure of its hook, the call's detached inputs and nothing else of
the call: the hooks object and the module are held weakly (:func:`_live`) and the outputs not at
all, since the hook lives in the autograd graph (C++), where a reference cycle is never
collected. When the hook fires it checks the batch size (``hooks._check_n``) and hands the
per-example gradients to ``hooks._store`` (or to ``hooks.captures``, for the ghost path).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten, tree_unflatten

from adaclip.errors import InvalidGradientError, InvalidHyperparameterError

from . import batch_free as _bf
from ._state import backward_muted
from .functorch_fallback import (
    _check_batch,
    fallback_batch_dims,
    fallback_free_grad_sample,
    fallback_grad_sample,
)
from .registry import GradSampleRule

if TYPE_CHECKING:
    from .hooks import GradSampleHooks

__all__ = ["watch_fallback", "watch_fallback_free", "watch_rule", "watch_rule_free"]


def _current_backward() -> int:
    """An id of the backward pass now running (autograd's graph task; -1 outside one): hooks
    that fire in one ``backward()`` / ``autograd.grad`` call share it, another call gets another."""
    return int(torch._C._current_graph_task_id())


def _pass_of(origin: int) -> int:
    """The backward pass a gradient contribution belongs to, for the one-pass check
    (:meth:`~._accumulate._Accumulator._check_n`). ``origin`` is :func:`_current_backward` at the
    module call. An ordinary call (``origin = -1``) belongs to the pass now delivering its
    gradient. A call made *inside* backward pass ``P`` is a checkpointed segment's forward being
    recomputed: reentrant activation checkpointing (``torch.utils.checkpoint(...,
    use_reentrant=True)``) re-runs the segment and then a nested ``backward`` inside ``P``, whose
    graph task has another id; its contributions are ``P``'s — the same batch, delivered once.
    A second ``backward()`` of the user's own runs forward calls outside any pass, so it is still
    refused."""
    return origin if origin >= 0 else _current_backward()



def _common_precision(g: torch.Tensor, x: tuple[Any, ...]) -> tuple[torch.Tensor, tuple[Any, ...]]:
    """The output gradient and the floating-point inputs of a call in one dtype, the widest of
    them. Under ``torch.autocast`` a layer with float32 inputs computes in bfloat16/float16, so
    its output gradient arrives in the low precision while its captured inputs are float32; the
    rule then works in float32. (The per-example gradients it returns are the ones that are
    clipped and summed, so their norms are measured on exactly what is released.)"""
    floats = [a for a in x if isinstance(a, torch.Tensor) and a.is_floating_point()]
    if not g.is_floating_point() or all(a.dtype == g.dtype for a in floats):
        return g, x
    dtype = g.dtype
    for a in floats:
        dtype = torch.promote_types(dtype, a.dtype)
    cast = tuple(a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in x)
    return g.to(dtype), cast


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
    (The hooks hold both weakly, see :func:`watch_rule`.)"""
    hooks, module = hooks_ref(), module_ref()
    if hooks is None or module is None or not hooks._active or backward_muted():
        return None
    return hooks, module


def watch_rule(
    hooks: GradSampleHooks,
    module: nn.Module,
    rule: GradSampleRule,
    args: tuple[Any, ...],
    watched: list[tuple[int, torch.Tensor]],
) -> None:
    """A batched call of a module with a registered rule: when the gradient of its one output
    arrives, the rule turns the call's inputs and that gradient (both batch first, the gradient
    scaled for the loss reduction) into per-example gradients — or the pair is captured."""
    bd = hooks._batch_dim if rule.batch_first_sensitive else 0
    acts = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
    if len(watched) != 1 or watched[0][0] != 0:
        raise InvalidGradientError(f"{hooks._where(module)}: its grad-sample rule expects one output tensor")

    # The hook lives in the autograd graph (C++), which Python's garbage collector cannot
    # traverse while the graph is referenced: a closure holding the hooks object or the
    # module strongly would keep the model, its optimizer state and each step's activations
    # alive after the model is dropped. Hold them weakly; the closure keeps only this
    # call's detached inputs, freed with the graph.
    hooks_ref, module_ref = weakref.ref(hooks), weakref.ref(module)
    origin = _current_backward()  # -1, or the pass recomputing this call (checkpointing)

    def on_grads(grads: Any) -> None:
        live = _live(hooks_ref, module_ref)
        if live is None or grads[0] is None:
            return
        hooks, module = live
        backward = _pass_of(origin)
        g = hooks._to_batch_first(module, grads[0], bd, "output gradient")
        x = tuple(
            hooks._to_batch_first(module, a, bd, "input") if isinstance(a, torch.Tensor) else a
            for a in acts
        )
        g, x = _common_precision(g, x)
        hooks.deliver_call(module, x, g, loss_scale=hooks._loss_scale(g.shape[0]), backward=backward)

    # One output tensor: a plain tensor hook. ``register_multi_grad_hook`` would call it the
    # same way, but its inner closure holds the output's grad_fn, on which the hook is
    # registered: a cycle through C++ that the collector never breaks.
    watched[0][1].register_hook(lambda grad: on_grads((grad,)))



def watch_fallback(
    hooks: GradSampleHooks,
    module: nn.Module,
    names: list[str],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    output: Any,
    out_leaves: list[Any],
    watched: list[tuple[int, torch.Tensor]],
) -> None:
    """A batched call of a module on the :mod:`torch.func` fallback: when the gradients of its
    outputs arrive (one multi-gradient hook), the call is re-run per example on its detached
    inputs and pulled back to the parameters (:func:`fallback_grad_sample`). Refused up front: an
    active dropout inside it, and an RNN fed a ``PackedSequence``."""
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
    in_dims, out_dims = fallback_batch_dims(module, args, kwargs, output, hooks._batch_dim)
    # batch-free inputs (the same for every example) are passed to each example as they are
    raw = tree_flatten((args, kwargs))[0]
    in_dims = [None if isinstance(t, _bf.BatchFreeTensor) else d for t, d in zip(raw, in_dims, strict=False)]
    if len(in_dims) != len(in_leaves) or len(out_dims) != len(out_leaves):
        raise InvalidGradientError(f"{type(module).__name__}: could not align batch dims with its inputs")
    path = hooks.module_path(module)
    n_in = _check_batch(module, in_leaves, in_dims, "input", path)
    _check_batch(module, out_leaves, out_dims, "output", path)

    hooks_ref, module_ref = weakref.ref(hooks), weakref.ref(module)  # see watch_rule
    # indices only: a closure holding the outputs would hold their grad_fns, on which the
    # hook is registered (a cycle through the graph, never collected)
    watched_leaves = [k for k, _ in watched]
    origin = _current_backward()  # see watch_rule

    def on_grads(grads: Any) -> None:
        live = _live(hooks_ref, module_ref)
        if live is None:
            return
        hooks, module = live
        out_grads = [(k, g, out_dims[k]) for k, g in zip(watched_leaves, grads) if g is not None]
        if not out_grads:
            return
        backward = _pass_of(origin)
        n = out_grads[0][1].shape[out_grads[0][2]]
        if n_in is not None and n_in != n:
            raise InvalidGradientError(
                f"{type(module).__name__}: inputs have batch size {n_in}, output gradients {n}"
            )
        hooks._check_n(module, n, backward)
        if hooks.loss_reduction == "mean":
            out_grads = [(k, g * n, d) for k, g, d in out_grads]
        hooks._store(
            module, fallback_grad_sample(module, names, in_leaves, in_spec, in_dims, out_grads, n), n
        )

    register_multi_grad_hook([t for _, t in watched], on_grads, mode="all")



def watch_rule_free(
    hooks: GradSampleHooks,
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
        raise InvalidGradientError(f"{hooks._where(module)}: its grad-sample rule expects one output tensor")
    x = args[0].detach()
    rest = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args[1:])
    o_shape = tuple(output.shape)
    batch_one = x.ndim >= 1 and x.shape[0] == 1 and len(o_shape) >= 1 and o_shape[0] == 1
    if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        batch_one = x.ndim == len(module.kernel_size) + 2
    where = hooks._where(module)
    alias, routed = _bf.new_source(output, n, where)
    hooks_ref, module_ref = weakref.ref(hooks), weakref.ref(module)  # see watch_rule
    origin = _current_backward()  # see watch_rule

    def on_total(grad: torch.Tensor) -> None:
        live = _live(hooks_ref, module_ref)
        if live is None:
            return
        hooks, module = live
        per = routed.take()
        if per is None:
            per = grad.new_zeros((n, *grad.shape))
        _bf.check_routed(where, grad, per)
        g = per.reshape(n, *o_shape[1:]) if batch_one else per
        xb = x.expand(n, *x.shape[1:]) if batch_one else x.unsqueeze(0).expand(n, *x.shape)
        hooks.deliver_call(module, (xb, *rest), g, loss_scale=hooks._loss_scale(n), backward=_pass_of(origin))

    with _bf.DisableTorchFunctionSubclass():
        output.register_hook(lambda grad: on_total(grad))
    return alias



def watch_fallback_free(
    hooks: GradSampleHooks,
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
    where = hooks._where(module)
    _refuse_active_dropout(module, where)
    in_leaves, in_spec = _detached_leaves(args, kwargs)
    new_leaves = list(out_leaves)
    routeds = []
    for k, t in watched:
        new_leaves[k], routed = _bf.new_source(t, n, where)
        routeds.append(routed)
    hooks_ref, module_ref = weakref.ref(hooks), weakref.ref(module)  # see watch_rule
    watched_leaves = [k for k, _ in watched]
    origin = _current_backward()  # see watch_rule

    def on_grads(grads: Any) -> None:
        live = _live(hooks_ref, module_ref)
        if live is None:
            return
        hooks, module = live
        per_out = []
        for k, routed, g in zip(watched_leaves, routeds, grads, strict=True):
            per = routed.take()
            if g is None and per is None:
                continue
            if per is None:
                per = g.new_zeros((n, *g.shape))
            if g is not None:
                _bf.check_routed(where, g, per)
            per_out.append((k, per * n if hooks.loss_reduction == "mean" else per))
        if not per_out:
            return
        hooks._check_n(module, n, _pass_of(origin))
        hooks._store(module, fallback_free_grad_sample(module, names, in_leaves, in_spec, per_out, n), n)

    with _bf.DisableTorchFunctionSubclass():
        register_multi_grad_hook([t for _, t in watched], on_grads, mode="all")
    return tree_unflatten(new_leaves, tree_flatten(output)[1])

