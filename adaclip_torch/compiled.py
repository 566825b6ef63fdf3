"""Per-example gradients as one compiled region: ``torch.func`` under ``torch.compile``.

The grad-sample hooks (:mod:`adaclip_torch.grad_sample`) capture each layer's activations and
output gradients during an eager ``loss.backward()``. Under ``torch.compile`` they do not run
as in eager mode (a compiled forward loses some layers' per-example gradients), so a compiled
model is refused (:mod:`adaclip_torch.validation`). This module is the supported way to train
with ``torch.compile``: the whole per-example gradient computation is one function,

.. math::

    G(θ, X, Y) = \\big(∇_θ\\, ℓ(f_θ(x_i), y_i)\\big)_{i=1}^{n}
    = \\operatorname{vmap}_i\\big(∇_θ\\, ℓ(f_θ(x_i), y_i)\\big),

built from ``torch.func.functional_call``, ``grad`` and ``vmap`` and compiled as a whole
(``torch.compile``: one graph for an MLP or a CNN, no graph break; :meth:`graph_breaks`
lists them for your model). Its result is written to ``p.grad_sample``, which the optimizer
reads in place of the hooks' (it must be built with ``attach_hooks=False``); the clipping, the
noise, the rescale and the accounting are the optimizer's own and unchanged.

**Privacy.** ``G`` holds each example's gradient of its own loss, computed from that example
alone (``vmap`` maps the one-example function over the batch: nothing couples the examples,
and a module that does — batch normalisation — is refused when the optimizer is built). The
optimizer clips each row of ``G`` exactly as it clips the hooks' per-example gradients, so the
sensitivity argument, the noise and the accountant are those of the eager step. Randomness in
the forward (dropout) is drawn per example (``randomness="different"``).

**Exactness.** Without compiling (``compile=False``) the steps equal the hooks' bit for bit on
an MLP (with a summed loss: a mean's ``1/n``, undone on the hooks' gradients, rounds) and up to
float rounding on a CNN (the hooks unfold the convolution's patches, ``torch.func`` runs its
backward: other orders of summation); compiled, up to float rounding (inductor fuses and
reorders the sums), as ``compile_release=True`` does for the release.

**Cost.** ``G`` materialises one gradient per example (``n·d`` numbers), as
``per_sample_mode="materialise"`` does; the ghost engine does not, and on CPU it is faster than
this region for ``Linear``-heavy models (``benchmarks/results/compile_region.md``). The region
is for models the hooks cannot follow and for backends where the compiled graph pays.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from adaclip.errors import InvalidHyperparameterError
from adaclip.options import positive_int
from adaclip_torch.optimizer import DPOptimizer

__all__ = ["CompiledPerExampleGradients"]

Tensor = torch.Tensor


class CompiledPerExampleGradients:
    """The per-example gradients of ``optimizer``'s model, computed as one ``torch.compile``\\d
    region and written to ``p.grad_sample`` (the maths and the privacy argument: the module).

    Args:
      optimizer: a :class:`~adaclip_torch.DPOptimizer` built with ``attach_hooks=False`` on the
        *uncompiled* model (the region compiles it), e.g. ``FlatClip(torch.optim.SGD(...),
        model, ..., attach_hooks=False)``.
      loss_fn: ``loss_fn(output, target) -> scalar``, called on a batch of one example (the
        loss of that example: a ``"mean"`` or ``"sum"`` reduction are the same there).
      compile: compile the region with ``torch.compile`` (default ``True``); ``False`` runs the
        same ``torch.func`` function eagerly.
      pad_to_multiple: compiled, a batch of ``n`` examples is run as one of ``n`` rounded up to
        a multiple of this (default 32), the extra rows copies of the first example whose
        gradients are dropped before anything reads them: the compiled graph is specialised to
        the batch size (``vmap``'s), so Poisson batches, whose size varies, would otherwise
        compile again for every new size. ``1``: no padding. Eagerly nothing is padded.
      **compile_options: passed to ``torch.compile`` (``mode=``, ``backend=``).

    Calling it on a batch ``(inputs, targets)`` sets ``p.grad_sample`` (``(n, *p.shape)``) for
    every parameter the optimizer privatises and returns the batch's mean loss (detached);
    then call ``optimizer.step()``. A batch with no examples has no gradients to compute: use
    ``optimizer.step(empty_batch=True)``.

    One call per release (or per :meth:`~adaclip_torch.DPOptimizer.accumulate`): a second call
    replaces ``p.grad_sample``, as a second batch through the hooks would not.

    Raises:
        InvalidHyperparameterError: the optimizer has grad-sample hooks attached (both would
            write ``p.grad_sample``), its parameters are FSDP2 shards, ``loss_fn`` is not
            callable, ``pad_to_multiple`` is not a positive integer, or the model is a compiled
            module (pass the uncompiled one: the region compiles it).
    """

    def __init__(
        self, optimizer: DPOptimizer, loss_fn: Callable[[Tensor, Tensor], Tensor], *, compile: bool = True,
        pad_to_multiple: int = 32, **compile_options: Any,
    ) -> None:  # fmt: skip
        if not isinstance(optimizer, DPOptimizer):
            raise InvalidHyperparameterError(f"optimizer must be an adaclip_torch DPOptimizer, got {type(optimizer).__name__}")
        if optimizer.grad_sample_hooks is not None:
            raise InvalidHyperparameterError(
                "the optimizer has grad-sample hooks attached, which would also write p.grad_sample; build it "
                "with attach_hooks=False for the compiled region"
            )
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
        self.compiled = compile
        self.pad_to_multiple = multiple if compile else 1
        by_id = {id(p): name for name, p in model.named_parameters()}
        self._names = [by_id[id(p)] for p in optimizer.params]
        self._region = self._build(model, loss_fn)
        if compile:
            self._region = torch.compile(self._region, **compile_options)

    def _build(self, model: nn.Module, loss_fn: Callable[[Tensor, Tensor], Tensor]) -> Callable[..., Any]:
        """``(params, inputs, targets) -> (per-example gradients, per-example losses)``."""

        def one(params: dict[str, Tensor], x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
            loss = loss_fn(torch.func.functional_call(model, params, (x.unsqueeze(0),)), y.unsqueeze(0))
            return loss, loss.detach()

        per_example = torch.func.grad(one, has_aux=True)
        return torch.func.vmap(per_example, in_dims=(None, 0, 0), randomness="different")

    def _params(self) -> dict[str, Tensor]:
        return {name: p.detach() for name, p in zip(self._names, self.optimizer.params, strict=True)}

    def __call__(self, inputs: Tensor, targets: Tensor) -> Tensor:
        if inputs.shape[0] == 0:
            raise InvalidHyperparameterError(
                "an empty batch has no per-example gradients: call optimizer.step(empty_batch=True)"
            )
        n = inputs.shape[0]
        inputs, targets = self._padded(inputs, n), self._padded(targets, n)
        grads, losses = self._region(self._params(), inputs, targets)
        for name, p in zip(self._names, self.optimizer.params, strict=True):
            p.grad_sample = grads[name][:n]  # the padding's rows never leave
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
        uncompiled = self._build(self.optimizer.model, self.loss_fn)
        report = torch._dynamo.explain(uncompiled)(self._params(), inputs, targets)
        return [str(reason.reason) for reason in report.break_reasons]
