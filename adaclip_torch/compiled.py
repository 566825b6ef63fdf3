"""The private step's per-example work as one compiled region: ``torch.func`` under ``torch.compile``.

The grad-sample hooks (:mod:`adaclip_torch.grad_sample`) capture each layer's activations and
output gradients during an eager ``loss.backward()``. Under ``torch.compile`` they do not run
as in eager mode (a compiled forward loses some layers' per-example gradients), so a compiled
model is refused (:mod:`adaclip_torch.validation`). This module is the supported way to train
with ``torch.compile``: what the hooks would learn is computed by one function, compiled as a
whole, in one of two ways (``method=``).

**``method="vmap"``** (default; the optimizer built with ``attach_hooks=False``): every
example's gradient,

.. math::

    G(θ, X, Y) = \\big(∇_θ\\, ℓ(f_θ(x_i), y_i)\\big)_{i=1}^{n}
    = \\operatorname{vmap}_i\\big(∇_θ\\, ℓ(f_θ(x_i), y_i)\\big),

from ``torch.func.functional_call``, ``grad`` and ``vmap``, written to ``p.grad_sample``. It
follows any model ``torch.func`` can (no ``torch.fx`` trace), and materialises ``n·d`` numbers.

**``method="capture"``** (the optimizer built with its hooks, any ``per_sample_mode``): the
model is traced with ``torch.fx`` and each call ``y = m(x)`` of a module with a grad-sample rule
becomes ``y + p``, ``p`` a zero probe (:mod:`adaclip_torch._capture_graph`). With the summed
per-example losses ``L = Σ_i ℓ_i``, ``∂L/∂p = ∂L/∂y = δ`` and row ``i`` of ``δ`` is example
``i``'s own output gradient; ``torch.func.grad`` with respect to the probes gives every call's
``δ`` in one backward pass that forms no weight gradient, and the graph returns every call's
input ``x``. Each ``(x, δ)`` is handed to the hooks as their own backward would
(:meth:`~adaclip_torch.grad_sample.GradSampleHooks.deliver_call`): the optimizer's ghost engine
computes norms and the clipped sum from them without forming per-example gradients, and the
materialised layers' rules form theirs. This is the book-keeping form of ghost clipping: one
forward, one backward, nothing recomputed.

Both are compiled with ``torch.compile`` (one graph for an MLP, a CNN or an embedding model;
:meth:`CompiledPerExampleGradients.graph_breaks` lists the breaks for yours). The clipping,
the noise, the rescale and the accounting are the optimizer's own and unchanged.

**Privacy.** ``vmap``: ``G`` holds each example's gradient of its own loss, computed from that
example alone (nothing couples the examples, and a module that does — batch normalisation — is
refused when the optimizer is built); dropout is drawn per example (``randomness="different"``).
``capture``: the loss is ``vmap``'d over the examples, so ``L`` is a sum of per-example terms;
row ``i`` of a captured input is taken for example ``i``'s only where the trace shows the
tensor is computed from the batch (a call on a position index or a buffer is refused at
construction: its rows are not examples), and every captured tensor must have the batch on
dim 0. Either way the optimizer clips exactly what it clips after the hooks, so the sensitivity
argument, the noise and the accountant are those of the eager step.

**Exactness.** Without compiling (``compile=False``) ``vmap`` equals the hooks bit for bit on an
MLP and ``capture`` equals them bit for bit on MLPs and embedding models, with a summed loss (a
mean's ``1/n``, undone on the hooks' gradients, rounds); a CNN's ``vmap`` and every compiled
region agree up to float rounding (other orders of summation), as ``compile_release=True`` does
for the release.

**Cost.** ``vmap`` materialises one gradient per example, as ``per_sample_mode="materialise"``
does; ``capture`` keeps the engine the optimizer chose (ghost norms for ``Linear`` and
``Embedding`` under the default ``"auto"``). Measured: ``benchmarks/results/compile_region.md``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

import torch

from adaclip.errors import InvalidGradientError, InvalidHyperparameterError
from adaclip.options import positive_int
from adaclip_torch._capture_graph import trace_for_capture
from adaclip_torch.optimizer import DPOptimizer

__all__ = ["CompiledPerExampleGradients", "METHODS"]

Tensor = torch.Tensor
_log = logging.getLogger(__name__)

#: How the region computes what the optimizer clips: ``"vmap"``, every example's gradient
#: (``torch.func``); ``"capture"``, every rule-carrying layer call's input and output gradient,
#: handed to the optimizer's hooks (its ghost or materialised engine then works as after an
#: eager ``backward()``).
METHODS = ("vmap", "capture")
#: the pass token the region's calls are handed over with (the hooks refuse a second pass
#: before the step; :meth:`CompiledPerExampleGradients.__call__` clears them first)
_REGION_PASS = -2


class CompiledPerExampleGradients:
    """What the optimizer clips for a batch — per-example gradients (``method="vmap"``) or every
    layer call's input and output gradient (``method="capture"``) — computed as one
    ``torch.compile``\\d region (the maths and the privacy argument: the module).

    Args:
      optimizer: a :class:`~adaclip_torch.DPOptimizer` on the *uncompiled* model (the region
        compiles it): built with ``attach_hooks=False`` for ``method="vmap"``, e.g.
        ``FlatClip(torch.optim.SGD(...), model, ..., attach_hooks=False)``; with its hooks (the
        default) for ``method="capture"``, which keeps its ``per_sample_mode``.
      loss_fn: ``loss_fn(output, target) -> scalar``, called on a batch of one example (the
        loss of that example: a ``"mean"`` or ``"sum"`` reduction are the same there).
      method: ``"vmap"`` (default) or ``"capture"`` (:data:`METHODS`; the module doc). Use
        ``"capture"`` for ``Linear``/``Embedding``-heavy models, where the ghost engine avoids
        the per-example gradients; ``"vmap"`` for models ``torch.fx`` cannot trace.
      compile: compile the region with ``torch.compile`` (default ``True``); ``False`` runs the
        same function eagerly.
      pad_to_multiple: compiled, a batch of ``n`` examples is run as one of ``n`` rounded up to
        a multiple of this (default 32), the extra rows copies of the first example whose
        results are dropped before anything reads them: the compiled graph is specialised to
        the batch size, so Poisson batches, whose size varies, would otherwise compile again
        for every new size. ``1``: no padding. Eagerly nothing is padded.
      **compile_options: passed to ``torch.compile`` (``mode=``, ``backend=``).

    Calling it on a batch ``(inputs, targets)`` leaves what a ``loss.backward()`` through the
    hooks would (``vmap``: ``p.grad_sample``, ``(n, *p.shape)``, for every parameter the
    optimizer privatises; ``capture``: the hooks' captures and ``grad_sample``) and returns the
    batch's mean loss (detached); then call ``optimizer.step()``. ``capture`` finds the shapes of
    its probes by one eager forward pass per new (padded) input shape. A batch with no examples
    has nothing to compute: use ``optimizer.step(empty_batch=True)``.

    One call per release (or per :meth:`~adaclip_torch.DPOptimizer.accumulate`): a second call
    replaces the first's results, as a second batch through the hooks would not.

    Raises:
        InvalidHyperparameterError: ``method`` is unknown or does not fit the optimizer (hooks
            attached for ``"vmap"``, none for ``"capture"``), its parameters are FSDP2 shards,
            ``loss_fn`` is not callable, ``pad_to_multiple`` is not a positive integer, the model
            is a compiled module (pass the uncompiled one: the region compiles it), or — for
            ``"capture"`` — the model cannot be traced, uses a parameter outside a module with a
            grad-sample rule, or calls such a module on a tensor not computed from the batch.
        InvalidGradientError: (when called, ``"capture"``) a captured tensor does not have the
            batch on dim 0; nothing is stored.
    """

    def __init__(
        self, optimizer: DPOptimizer, loss_fn: Callable[[Tensor, Tensor], Tensor], *, method: str = "vmap",
        compile: bool = True, pad_to_multiple: int = 32, **compile_options: Any,
    ) -> None:  # fmt: skip
        if not isinstance(optimizer, DPOptimizer):
            raise InvalidHyperparameterError(f"optimizer must be an adaclip_torch DPOptimizer, got {type(optimizer).__name__}")
        hooks = optimizer.grad_sample_hooks
        if method not in METHODS:
            raise InvalidHyperparameterError(f"method must be one of {METHODS}, got {method!r}")
        if method == "vmap" and hooks is not None:
            raise InvalidHyperparameterError(
                "the optimizer has grad-sample hooks attached, which would also write p.grad_sample; build it "
                "with attach_hooks=False for method='vmap', or use method='capture', which hands the hooks "
                "what they would have captured"
            )
        if method == "capture" and hooks is None:
            raise InvalidHyperparameterError(
                "method='capture' hands the calls to the optimizer's grad-sample hooks, and this optimizer has "
                "none (attach_hooks=False): build it with its hooks, or use method='vmap'"
            )
        if method == "capture" and not hooks.batch_first:
            raise InvalidHyperparameterError("method='capture' needs the batch on dim 0 (batch_first=True)")
        if not callable(loss_fn):
            raise InvalidHyperparameterError(f"loss_fn must be callable, got {loss_fn!r}")
        if not isinstance(compile, bool):
            raise InvalidHyperparameterError(f"compile must be True or False, got {compile!r}")
        multiple = positive_int("pad_to_multiple", pad_to_multiple)
        if optimizer.fsdp:
            raise InvalidHyperparameterError(
                "the compiled region does not run on FSDP2-sharded parameters (vmap over a DTensor); use the "
                "hooks (attach_hooks=True)"
            )
        model = optimizer.model
        if hasattr(model, "_orig_mod"):
            raise InvalidHyperparameterError("pass the uncompiled model to the optimizer: the region compiles it")
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        #: ``"vmap"`` or ``"capture"``: how the region computes what the optimizer clips
        self.method = method
        self.compiled = compile
        self.pad_to_multiple = multiple if compile else 1
        #: the (padded) batch sizes the compiled region has run: each compiles it once
        self.sizes_seen: set[int] = set()
        by_id = {id(p): name for name, p in model.named_parameters()}
        self._names = [by_id[id(p)] for p in optimizer.params]
        self._graph = trace_for_capture(model, hooks.ruled_modules, optimizer.params) if method == "capture" else None
        self._region = self._build()
        if compile:
            self._region = torch.compile(self._region, **compile_options)
        _log.info(
            "compiled region: method=%r, %s, batches padded to a multiple of %d%s", method,
            "compiled with torch.compile" if compile else "eager", self.pad_to_multiple,
            f", {len(self._graph.calls)} captured calls" if self._graph is not None else "",
        )  # fmt: skip

    def _one_loss(self, output: Tensor, target: Tensor) -> Tensor:
        return self.loss_fn(output.unsqueeze(0), target.unsqueeze(0))

    def _build(self) -> Callable[..., Any]:
        """``vmap``: ``(params, inputs, targets) -> (per-example gradients, per-example
        losses)``; ``capture``: ``(probes, params, inputs, targets) -> (output gradients of the
        captured calls, (their inputs, per-example losses))``."""
        model = self.optimizer.model
        if self._graph is None:

            def one(params: dict[str, Tensor], x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
                loss = self.loss_fn(torch.func.functional_call(model, params, (x.unsqueeze(0),)), y.unsqueeze(0))
                return loss, loss.detach()

            per_example = torch.func.grad(one, has_aux=True)
            return torch.func.vmap(per_example, in_dims=(None, 0, 0), randomness="different")
        rewired = self._graph.module

        def summed(probes: tuple[Tensor, ...], params: dict[str, Tensor], x: Tensor, y: Tensor) -> Any:
            output, call_inputs = torch.func.functional_call(rewired, params, (x, *probes))
            losses = torch.func.vmap(self._one_loss)(output, y)
            return losses.sum(), (call_inputs, losses.detach())

        return torch.func.grad(summed, argnums=0, has_aux=True)

    def _params(self) -> dict[str, Tensor]:
        return {name: p.detach() for name, p in zip(self._names, self.optimizer.params, strict=True)}

    def __call__(self, inputs: Tensor, targets: Tensor) -> Tensor:
        if inputs.shape[0] == 0:
            raise InvalidHyperparameterError(
                "an empty batch has no per-example gradients: call optimizer.step(empty_batch=True)"
            )
        n = inputs.shape[0]
        inputs, targets = self._padded(inputs, n), self._padded(targets, n)
        if self.compiled and int(inputs.shape[0]) not in self.sizes_seen:
            self.sizes_seen.add(int(inputs.shape[0]))
            _log.info("compiled region: a batch of %d rows (padded from %d) compiles the region for that size "
                      "(%d sizes so far)", int(inputs.shape[0]), n, len(self.sizes_seen))  # fmt: skip
        if self._graph is not None:
            return self._capture(inputs, targets, n)
        grads, losses = self._region(self._params(), inputs, targets)
        for name, p in zip(self._names, self.optimizer.params, strict=True):
            p.grad_sample = grads[name][:n]  # the padding's rows never leave
        return losses[:n].mean()

    def _capture(self, inputs: Tensor, targets: Tensor, n: int) -> Tensor:
        """Run the capture region and hand each call to the hooks, as their backward would."""
        hooks = self.optimizer.grad_sample_hooks
        assert hooks is not None and self._graph is not None
        with hooks.paused():  # the rewritten graph (and the probes' shape pass) call the hooked modules
            probes = self._graph.probes(inputs)
            grads, (call_inputs, losses) = self._region(probes, self._params(), inputs, targets)
        padded = int(inputs.shape[0])
        calls = []
        for module, args, g in zip(self._graph.calls, call_inputs, grads, strict=True):
            for t in (g, *(a for a in args if isinstance(a, Tensor))):
                if t.dim() == 0 or int(t.shape[0]) != padded:
                    raise InvalidGradientError(
                        f"{type(module).__name__} `{hooks.module_path(module)}`: a captured tensor of shape "
                        f"{tuple(t.shape)} does not have the batch ({padded} rows) on dim 0; nothing was stored"
                    )
            # the padding's rows never leave: sliced off before the hooks see anything
            calls.append((module, tuple(a[:n] if isinstance(a, Tensor) else a for a in args), g[:n]))
        hooks.clear()  # a second call replaces the first, as for method='vmap'
        for module, args, g in calls:
            hooks.deliver_call(module, args, g, loss_scale=1.0, backward=_REGION_PASS)
        return losses[:n].mean()

    def _padded(self, batch: Tensor, n: int) -> Tensor:
        """``batch`` with copies of its first row up to a multiple of :attr:`pad_to_multiple`."""
        extra = -n % self.pad_to_multiple
        if extra == 0:
            return batch
        return torch.cat([batch, batch[:1].expand(extra, *batch.shape[1:])])

    def graph_breaks(self, inputs: Tensor, targets: Tensor) -> list[str]:
        """The reasons ``torch._dynamo`` breaks the region's graph on this batch (``[]``: one
        graph), without running the step."""
        args: tuple[Any, ...] = (self._params(), inputs, targets)
        hooks = self.optimizer.grad_sample_hooks
        with contextlib.nullcontext() if hooks is None else hooks.paused():
            if self._graph is not None:
                args = (self._graph.probes(inputs), *args)
            report = torch._dynamo.explain(self._build())(*args)
        return [str(reason.reason) for reason in report.break_reasons]
