"""Per-example loss reductions: each example's loss a function of that example alone.

Why. Differentially private training clips *per-example* gradients: the released sum
``Σ_i clip(g_i) + noise`` changes by at most the clip norm ``C`` when one example is added or
removed, *provided* ``g_i`` depends on example i only. The per-example gradient the hooks
compute is the gradient of example i's term of the loss, so the loss must be a sum (or a mean
with a fixed divisor) of per-example terms.

Hugging Face's language-modelling loss is not: ``model(input_ids, labels=labels).loss``
(``ForCausalLMLoss``, the seq2seq loss, token classification) is the mean over *all* non-ignored
tokens of the batch,

.. math::
    L_{HF} = \\frac{\\sum_i \\sum_{t \\in T_i} ℓ_{i,t}}{\\sum_j |T_j|},

so example i's gradient, ``∇ Σ_{t∈T_i} ℓ_{i,t} / Σ_j |T_j|``, depends on the lengths of the other
examples (their padding). With ``loss_reduction="mean"`` the hooks multiply by n and take
``(n / Σ_j|T_j|)·∇Σ_{t∈T_i} ℓ_{i,t}`` as example i's gradient: adding or removing one example
changes ``Σ_j |T_j|`` and so rescales *every* other example's contribution. Two neighbouring
batches then differ in many clipped terms, and the sensitivity is no longer ``C`` — the noise is
calibrated for a guarantee the training does not have. (With equal lengths and no padding the
factor is the constant ``1/L``, and nothing breaks.) The same holds for a classification loss
whose mean skips ignored labels (the divisor counts the others).

The fix: reduce *within* each example first, ``ℓ_i = mean_{t ∈ T_i} ℓ_{i,t}`` (or the sum over its
tokens), a function of example i alone, then over the examples:
``L = Σ_i ℓ_i`` (``batch_reduction="sum"``, with ``loss_reduction="sum"`` in the optimizer) or
``L = (1/n) Σ_i ℓ_i`` (``"mean"``, with ``loss_reduction="mean"``). Either way
``p.grad_sample[i] = ∇ℓ_i``, and the (noise-free) clipped sum changes by at most ``C`` when one
example is added or removed.

.. code-block:: python

    logits = model(input_ids=ids, attention_mask=mask).logits          # no labels: no HF loss
    labels = ids.masked_fill(mask == 0, -100)
    per_example_lm_loss(logits, labels).backward()                    # optimizer: loss_reduction="sum"
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from adaclip.errors import InvalidHyperparameterError

__all__ = ["per_example_lm_loss", "per_example_classification_loss"]

Tensor = torch.Tensor
_REDUCTIONS = ("token_mean", "sum")
_BATCH_REDUCTIONS = ("sum", "mean", "none")


def _reduce_batch(per: Tensor, batch_reduction: str) -> Tensor:
    if batch_reduction == "sum":
        return per.sum()
    if batch_reduction == "mean":
        return per.mean() if per.numel() else per.sum()  # an empty batch: 0, not NaN
    return per


def _check(batch_reduction: str) -> None:
    if batch_reduction not in _BATCH_REDUCTIONS:
        raise InvalidHyperparameterError(
            f"batch_reduction must be one of {_BATCH_REDUCTIONS}, got {batch_reduction!r}"
        )


def per_example_lm_loss(
    logits: Tensor,
    labels: Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "token_mean",
    shift: bool = True,
    batch_reduction: str = "sum",
) -> Tensor:
    """Token cross-entropy reduced per example, then over the batch (module doc: why).

    Args:
        logits: ``(n, T, V)`` (the model's ``.logits``).
        labels: ``(n, T)`` token ids; ``ignore_index`` marks positions without a loss (padding).
        reduction: per example, ``"token_mean"`` (mean over the example's own non-ignored tokens,
            the per-example analogue of Hugging Face's loss; an example without any is 0) or
            ``"sum"`` (their sum).
        shift: predict token t+1 from position t (causal LMs, as ``ForCausalLMLoss`` does); ``False``
            for seq2seq decoders (T5's labels are already the targets) and token classification.
        batch_reduction: ``"sum"`` (use ``loss_reduction="sum"``), ``"mean"`` (over the n examples,
            use ``loss_reduction="mean"``) or ``"none"`` (the ``(n,)`` per-example losses).

    The cross-entropy is computed in float32 at least (as Hugging Face upcasts the logits).
    """
    if reduction not in _REDUCTIONS:
        raise InvalidHyperparameterError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    _check(batch_reduction)
    if logits.ndim != 3 or labels.shape != logits.shape[:2]:
        raise InvalidHyperparameterError(
            f"per_example_lm_loss expects logits (n, T, V) and labels (n, T), got {tuple(logits.shape)} "
            f"and {tuple(labels.shape)}"
        )
    if shift:
        logits, labels = logits[:, :-1], labels[:, 1:]
    n, t, v = logits.shape
    dtype = torch.promote_types(logits.dtype, torch.float32)
    tokens = F.cross_entropy(
        logits.reshape(n * t, v).to(dtype), labels.reshape(n * t), ignore_index=ignore_index, reduction="none"
    ).reshape(n, t)
    per = tokens.sum(dim=1)
    if reduction == "token_mean":
        per = per / (labels != ignore_index).sum(dim=1).clamp_min(1).to(dtype)
    return _reduce_batch(per, batch_reduction)


def per_example_classification_loss(
    logits: Tensor, labels: Tensor, *, ignore_index: int = -100, batch_reduction: str = "sum"
) -> Tensor:
    """Cross-entropy of one label per example (sequence or image classification), reduced over
    the batch without the coupling of a mean that skips ignored labels: an example labelled
    ``ignore_index`` contributes 0 and the divisor of ``"mean"`` is n, not the number of the
    others. (Hugging Face's ``...ForSequenceClassification`` loss is the plain mean when no label
    is ignored, which is per-example already, with ``loss_reduction="mean"``.)

    ``logits``: ``(n, C)``; ``labels``: ``(n,)``. ``batch_reduction`` as in :func:`per_example_lm_loss`.
    """
    _check(batch_reduction)
    if logits.ndim != 2 or labels.shape != logits.shape[:1]:
        raise InvalidHyperparameterError(
            f"per_example_classification_loss expects logits (n, C) and labels (n,), got {tuple(logits.shape)} "
            f"and {tuple(labels.shape)}"
        )
    dtype = torch.promote_types(logits.dtype, torch.float32)
    per = F.cross_entropy(logits.to(dtype), labels, ignore_index=ignore_index, reduction="none")
    return _reduce_batch(per, batch_reduction)
