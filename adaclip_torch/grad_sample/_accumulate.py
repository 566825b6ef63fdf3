"""Where per-example gradients end up: the accumulation half of the hook engine.

:class:`_Accumulator` (a base of :class:`~.hooks.GradSampleHooks`) owns the rows held between two
:meth:`~.hooks.GradSampleHooks.clear` calls. Every backward contribution first goes through
:meth:`~_Accumulator._check_n`, which refuses one that would merge units (a second backward pass,
or a different batch size) before anything of it is stored, then through
:meth:`~_Accumulator._store`, which adds it to ``param.grad_sample`` — on the FSDP2-sharded
parameter when there is one, and in place only into a sum this engine allocated itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from adaclip.errors import InvalidGradientError

__all__: list[str] = []

_OWNED = "_adaclip_owned_sum"


class _Accumulator:
    """The per-example gradients held, and the checks that keep row i one unit (see the
    class docstring of :class:`~.hooks.GradSampleHooks`)."""

    allow_multiple_backward: bool
    _batch_dim: int
    _batch_size: int
    # the batch size of the rows held, and the autograd graph task (backward pass) they came from
    _accum_n: int | None
    _accum_pass: int | None
    _sharded: dict[tuple[nn.Module, str], nn.Parameter]
    _capture: set[nn.Module]
    captures: dict[nn.Module, list[tuple[torch.Tensor, torch.Tensor, float]]]
    _plans: dict[nn.Module, Any]

    if TYPE_CHECKING:  # defined by GradSampleHooks

        def module_path(self, module: nn.Module) -> str: ...

        def _where(self, module: nn.Module) -> str: ...

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

    def deliver_call(
        self, module: nn.Module, inputs: tuple[Any, ...], output_grad: torch.Tensor, *, loss_scale: float, backward: int
    ) -> None:
        """Hand over one call of a module with a registered rule: its positional inputs and the
        gradient of the loss with respect to its output, both with the batch on dim 0, where
        ``loss_scale · output_grad`` is each example's own output gradient (``n`` under a mean
        loss, else 1). A module the ghost path captures keeps ``(inputs[0], output_grad,
        loss_scale)`` in :attr:`captures`; any other gets the rule's per-example gradients added
        to ``param.grad_sample``. Refused first, with nothing stored, when the call would merge
        units (:meth:`_check_n`; ``backward`` names the pass it belongs to).

        The hooks' gradient watchers call it when a call's output gradient arrives;
        :class:`adaclip_torch.compiled.CompiledPerExampleGradients` calls it with the inputs and
        output gradients its compiled region returns."""
        n = int(output_grad.shape[0])
        self._check_n(module, n, backward)
        if module in self._capture:
            # kept as the loss's gradient: the ghost forms fold the loss scale into their
            # results (no pass over the gradient here)
            self.captures.setdefault(module, []).append((inputs[0], output_grad, loss_scale))
            return
        if loss_scale != 1.0:
            output_grad = output_grad * loss_scale
        self._store(module, self._plans[module].fn(module, inputs, output_grad), n)

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
