"""Private training through the Hugging Face ``Trainer``: :class:`PrivateTrainer`.

Replace ``Trainer`` by ``PrivateTrainer`` and add the privacy budget; the rest of a fine-tuning
script (``TrainingArguments``, the data set and collator, ``bf16``, activation checkpointing,
``accelerate launch`` or ``torchrun`` on several processes, ``evaluate()``, ``save_model()``)
stays as it is::

    trainer = PrivateTrainer(model=model, args=TrainingArguments(..., num_train_epochs=3),
                             train_dataset=train, eval_dataset=valid, data_collator=collator,
                             target_epsilon=3.0, delta=1e-5, averaging="ema")
    trainer.train()            # logs "epsilon" with the learning rate; no training loss
    trainer.evaluate()         # the averaged model
    trainer.save_model()       # the averaged model

What it builds. At construction, the ``Trainer``'s own optimizer (``args.optim``, learning rate,
weight decay groups) and a loader over ``train_dataset`` (``per_device_train_batch_size`` ``B``,
the ``data_collator``) go through :func:`adaclip_torch.make_private` with
``epochs = args.num_train_epochs`` and every privacy keyword given to ``PrivateTrainer``
(``target_epsilon``, ``delta``, ``noise_multiplier``, ``strategy``, ``max_grad_norm``,
``noise_mechanism``, ``bands``, ``averaging``, ``seed``, ``ledger``, ``per_sample_mode``, …): so
the training set is Poisson-sampled at ``q = R·B/N`` (cyclic Poisson for banded noise), the
accountant gets the budget, σ is calibrated for the planned run, and ``"auto"`` noise may choose
banded noise — exactly what ``make_private`` builds for the plain loop, and logged the same way.
With ``R > 1`` processes (``args.world_size``) each rank samples its own shard of the training
set and the optimizer adds the noise once, in its all-reduce (``distributed=True``).

Each step of :meth:`Trainer.train` then runs, per batch:

1. the forward pass **on the unwrapped model** (``accelerator.unwrap_model``): the
   ``DistributedDataParallel`` wrapper that Accelerate puts around it is bypassed, so its
   gradient all-reduce never runs (the optimizer's noisy all-reduce replaces it) and a rank
   whose Poisson batch is empty can skip its forward pass without the other ranks waiting for it;
2. the per-example loss, ``Σ_i ℓ_i`` (``loss_reduction="sum"``): the token mean of each example
   for a language model (:func:`~adaclip_torch.losses.per_example_lm_loss`, shifted for causal
   LMs), the cross-entropy of each example for a classifier, or ``per_example_loss(outputs,
   labels)`` given by you. Hugging Face's own loss averages over all the tokens of the batch and
   couples the examples (see the Hugging Face page of the docs);
3. ``backward()``; an empty batch skips 1–3 and calls
   :meth:`~adaclip_torch.optimizer.DPOptimizer.mark_empty_batch`;
4. the ``Trainer`` calls ``optimizer.step()``: the private step (clip each example, sum, noise,
   the update), then its learning-rate scheduler.

The privacy argument. Everything that leaves a step is computed from the released (noisy)
gradient, or from public values, or is the model's output on data outside the training set:

* the training loss, the gradient norm and the floating-point-operation count that the
  ``Trainer`` logs are computed from the sampled batch, and are **not** released by the
  mechanism: they are removed from the logs and from ``train()``'s result (the loss is
  reported as ``nan``); the logs get ``epsilon`` (ε spent so far at the budget's δ) instead;
* the ``Trainer``'s own gradient clipping is switched off (``args.max_grad_norm = 0``): the
  per-example clip norm ``C`` is ``max_grad_norm`` given to ``PrivateTrainer``, or
  ``args.max_grad_norm`` when not given (1.0 by default, what the ``Trainer`` clipped to);
* evaluation and ``save_model()`` see the averaged parameters when ``averaging`` is set
  (post-processing of the released steps); the eval loss is the model's own loss on the eval
  set, which is outside the training set and outside the guarantee, as with any held-out metric.

Refused, before anything is built (:class:`adaclip.errors.InvalidHyperparameterError`, naming the
setting and the way out): ``gradient_accumulation_steps > 1`` (use a larger
``per_device_train_batch_size``: it is the *expected* batch of each Poisson step), ``fp16=True``
(the loss scaler scales the per-example gradients before clipping; use ``bf16``), ``max_steps``
(the budget is planned in epochs), a fractional ``num_train_epochs``, label smoothing, counting
input tokens (a statistic of the sampled batches), ``train_sampling_strategy`` other than
``"random"`` (the sampler is Poisson sampling), DeepSpeed, FSDP (see the scale page),
``DataParallel`` on several GPUs, ``model_init``, ``auto_find_batch_size``, an iterable data set
and ``train(resume_from_checkpoint=...)`` (resume a run through the plain loop and a ``ledger``).
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, IterableDataset

from adaclip.errors import InvalidHyperparameterError
from adaclip_torch.losses import per_example_classification_loss, per_example_lm_loss
from adaclip_torch.optimizer import DPOptimizer
from adaclip_torch.privacy import make_private

try:
    from transformers import Trainer, TrainingArguments
    from transformers.trainer_utils import TrainOutput
except ImportError as err:  # pragma: no cover - the error names the extra
    raise ImportError(
        "adaclip_torch.trainer needs transformers (and accelerate): pip install 'adaclip[hf]'"
    ) from err

__all__ = ["PRIVATE_LOG_KEYS", "PrivateTrainer"]

logger = logging.getLogger(__name__)

#: What the ``Trainer`` logs from the sampled batches, outside the mechanism: removed.
PRIVATE_LOG_KEYS = frozenset({"loss", "grad_norm", "train_loss", "total_flos", "num_input_tokens_seen"})

#: make_private's keywords that PrivateTrainer fills in itself.
_SET_BY_THE_TRAINER = ("model", "module", "optimizer", "data_loader", "epochs", "distributed", "loss_reduction")


class _EmptyBatch(dict):
    """The collated form of an empty Poisson batch: no keys (the ``Trainer`` prefetches it
    like any batch; :meth:`PrivateTrainer.training_step` recognises it)."""


def _collate_empty(collate_fn: Callable[[list[Any]], Any]) -> Callable[[list[Any]], Any]:
    def collate(examples: list[Any]) -> Any:
        return _EmptyBatch() if len(examples) == 0 else collate_fn(examples)

    collate.handles_empty_batch = True  # type: ignore[attr-defined]  # (adaclip_torch.data.empty_batch_collate)
    return collate


def _refusals(args: TrainingArguments, trainer_kwargs: Mapping[str, Any]) -> list[str]:
    """The settings the private step cannot honour, each with its way out."""
    out = []
    if args.gradient_accumulation_steps != 1:
        out.append(
            f"gradient_accumulation_steps={args.gradient_accumulation_steps}: set it to 1 and give the "
            "logical batch as per_device_train_batch_size (the expected size of each Poisson batch)"
        )
    if args.fp16:
        out.append("fp16=True: its loss scaler scales the per-example gradients before clipping; use bf16=True")
    if args.max_steps is not None and args.max_steps > 0:
        out.append(f"max_steps={args.max_steps}: the budget is planned in epochs; set num_train_epochs")
    if float(args.num_train_epochs) != int(args.num_train_epochs) or args.num_train_epochs < 1:
        out.append(f"num_train_epochs={args.num_train_epochs}: give a whole number of epochs (>= 1)")
    if args.label_smoothing_factor:
        out.append("label_smoothing_factor: not supported by the per-example loss; set it to 0")
    if args.include_num_input_tokens_seen not in ("no", False, None):
        out.append(
            "include_num_input_tokens_seen: it counts the tokens of the sampled batches, a statistic outside "
            "the mechanism; leave it at 'no'"
        )
    if getattr(args, "train_sampling_strategy", "random") != "random":
        out.append(
            f"train_sampling_strategy={args.train_sampling_strategy!r}: the batches are Poisson-sampled "
            "(what the accountant assumes); leave it at 'random'"
        )
    if args.deepspeed:
        out.append("deepspeed: not supported")
    if args.fsdp:
        out.append("fsdp: not supported through the Trainer yet; use the plain loop with fully_shard")
    if args.n_gpu > 1:
        out.append("several GPUs in one process (DataParallel): launch one process per GPU (torchrun)")
    if args.auto_find_batch_size:
        out.append("auto_find_batch_size: the batch size sets the sample rate q; choose it yourself")
    if trainer_kwargs.get("model_init") is not None:
        out.append("model_init: pass the model itself")
    return out


class PrivateTrainer(Trainer):
    """A ``transformers.Trainer`` whose training steps are private (module doc: what it builds,
    the step, the privacy argument and what is refused).

    Args:
      *args, **kwargs: the ``Trainer``'s (``model``, ``args``, ``data_collator``,
        ``train_dataset``, ``eval_dataset``, ``processing_class``, ``compute_metrics``,
        ``callbacks``, ``optimizers``, …). Every other keyword is :func:`make_private`'s and is
        passed to it: the budget (``target_epsilon``, ``delta`` or ``target_delta``,
        ``noise_multiplier``, ``mechanism``, ``ledger``), clipping (``strategy``,
        ``max_grad_norm``, the strategy's options such as ``per_sample_mode``), the noise
        (``noise_mechanism``, ``bands``, ``seed``, ``secure_mode``) and ``averaging``. Not
        ``epochs`` (from ``args.num_train_epochs``), ``loss_reduction`` (the loss is a sum of
        per-example losses) or ``distributed`` (from ``args.world_size``).
      per_example_loss: ``f(outputs, labels) -> (n,)`` tensor of per-example losses, for a
        model whose output is neither a language model's (``logits`` of ``(n, T, V)`` with
        ``labels`` ``(n, T)``) nor a classifier's (``(n, C)`` with ``(n,)``). The step's loss
        is their sum; each must depend on its own example only.

    Attributes:
      private_optimizer: the :class:`~adaclip_torch.optimizer.DPOptimizer` (its ``summary()``
        says what was built).
      private_loader: the Poisson loader the ``Trainer`` trains on.
    """

    def __init__(
        self,
        *args: Any,
        per_example_loss: Callable[[Any, Tensor], Tensor] | None = None,
        **kwargs: Any,
    ) -> None:
        trainer_names = set(inspect.signature(Trainer.__init__).parameters) - {"self"}
        privacy = {k: kwargs.pop(k) for k in list(kwargs) if k not in trainer_names}
        given = sorted(set(privacy) & set(_SET_BY_THE_TRAINER))
        if given:
            raise InvalidHyperparameterError(
                f"PrivateTrainer sets {given} itself: epochs from args.num_train_epochs, the model, optimizer and "
                "loader from the Trainer's, distributed from args.world_size, loss_reduction='sum' (a sum of "
                "per-example losses); remove them"
            )
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        if training_args is not None:
            problems = _refusals(training_args, kwargs)
            if problems:
                raise InvalidHyperparameterError("PrivateTrainer cannot honour: " + "; ".join(problems))
        super().__init__(*args, **kwargs)
        problems = _refusals(self.args, kwargs)  # args defaulted by the Trainer
        if problems:
            raise InvalidHyperparameterError("PrivateTrainer cannot honour: " + "; ".join(problems))
        if self.train_dataset is None or isinstance(self.train_dataset, IterableDataset):
            raise InvalidHyperparameterError(
                "PrivateTrainer needs a train_dataset with a length (a map-style data set): Poisson sampling "
                "draws each example independently"
            )
        self._per_example_loss = per_example_loss
        self._privacy = privacy
        self.private_optimizer: DPOptimizer
        self.private_loader: DataLoader
        self._build()

    # ------------------------------------------------------------------ construction

    def _build(self) -> None:
        """make_private on the Trainer's optimizer and a loader over the training set."""
        privacy = dict(self._privacy)
        clip = privacy.pop("max_grad_norm", None)
        trainer_clip = float(self.args.max_grad_norm or 0.0)
        if clip is None:
            clip = trainer_clip if trainer_clip > 0 else None
        world = int(self.args.world_size)
        base_optimizer = self.optimizer if self.optimizer is not None else self.create_optimizer()
        loader = self._base_loader()
        if privacy.get("target_epsilon") is not None:  # σ calibrated (or checked) for the planned epochs
            privacy["epochs"] = int(self.args.num_train_epochs)
        if world > 1:
            privacy["distributed"] = True
        model, optimizer, private_loader = make_private(
            self.model, base_optimizer, loader, max_grad_norm=clip, loss_reduction="sum", **privacy
        )
        self.args.max_grad_norm = 0.0  # the Trainer's clipping of the summed gradient: off (per-example C above)
        self.optimizer = optimizer
        self.private_optimizer = optimizer
        self.private_loader = private_loader
        logger.info(
            "PrivateTrainer: per-example clip norm %s (%s); the Trainer's own gradient clipping is off; the "
            "training loss, gradient norm and FLOs are not logged (computed from the sampled batches, outside "
            "the mechanism); 'epsilon' is logged instead; %d process(es), expected batch %g per step",
            "from the strategy" if clip is None else f"C = {clip:g}",
            "given" if "max_grad_norm" in self._privacy else "args.max_grad_norm",
            world, optimizer.expected_batch_size,
        )  # fmt: skip

    def _base_loader(self) -> DataLoader:
        """The loader make_private replaces the sampling of: the training set, the collator
        (with the columns the model does not take removed, as the Trainer does), ``B`` and the
        worker settings; empty Poisson batches collate to :class:`_EmptyBatch`."""
        collator = self._get_collator_with_removed_columns(self.data_collator, description="training")
        return DataLoader(
            self.train_dataset, batch_size=self.args.per_device_train_batch_size, shuffle=True,
            collate_fn=_collate_empty(collator), num_workers=self.args.dataloader_num_workers,
            pin_memory=self.args.dataloader_pin_memory,
        )  # fmt: skip

    # ------------------------------------------------------------------ training

    def get_train_dataloader(self) -> DataLoader:
        """The Poisson loader (not prepared by Accelerate: each rank samples its own shard)."""
        return self.private_loader

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        if getattr(self, "private_optimizer", None) is not None:
            return self.private_optimizer
        return super().create_optimizer(model)

    def get_batch_samples(
        self, epoch_iterator: Iterator[Any], num_batches: int, device: torch.device
    ) -> tuple[list[Any], None]:
        """The next batches, without the Trainer's count of their label tokens (a statistic of the
        sampled batches, gathered across ranks; the per-example loss does not use it)."""
        batches = []
        for _ in range(num_batches):
            try:
                batches.append(next(epoch_iterator))
            except StopIteration:
                break
        return batches, None

    def training_step(
        self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None
    ) -> Tensor:
        """Forward and backward of the per-example loss on the unwrapped model (module doc); an
        empty batch marks the optimizer's next step as empty instead. Returns 0: the training
        loss is not released."""
        zero = torch.zeros((), device=self.args.device)
        if isinstance(inputs, _EmptyBatch) or len(inputs) == 0:
            self.private_optimizer.mark_empty_batch()
            return zero
        model = self.accelerator.unwrap_model(model)
        model.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager(), self.accelerator.autocast():
            loss = self.private_loss(model, inputs)
        loss.backward()
        return zero

    def private_loss(self, model: nn.Module, inputs: dict[str, Any]) -> Tensor:
        """``Σ_i ℓ_i``: the model called without ``labels`` (its own loss would couple the
        examples), then each example's loss from its own outputs."""
        inputs = dict(inputs)
        labels = inputs.pop("labels", None)
        if labels is None:
            raise InvalidHyperparameterError(
                "PrivateTrainer needs 'labels' in each batch to compute the per-example loss (a causal LM's "
                "collator sets labels = input_ids with padding at -100)"
            )
        config = getattr(model, "config", None)
        if getattr(config, "is_encoder_decoder", False) and "decoder_input_ids" not in inputs:
            prepare = getattr(model, "prepare_decoder_input_ids_from_labels", None)
            if prepare is None:
                raise InvalidHyperparameterError(
                    "an encoder-decoder model needs decoder_input_ids in the batch (or "
                    "prepare_decoder_input_ids_from_labels)"
                )
            inputs["decoder_input_ids"] = prepare(labels=labels)
        outputs = model(**inputs)
        if self._per_example_loss is not None:
            per = self._per_example_loss(outputs, labels)
            if per.shape != labels.shape[:1]:
                raise InvalidHyperparameterError(
                    f"per_example_loss must return one loss per example, shape ({labels.shape[0]},); got "
                    f"{tuple(per.shape)}"
                )
            return per.sum()
        logits = outputs["logits"] if isinstance(outputs, Mapping) else outputs[0]
        if logits.ndim == 3 and labels.ndim == 2:
            return per_example_lm_loss(logits, labels, shift=self._shifts_labels(model), batch_reduction="sum")
        if logits.ndim == 2 and labels.ndim == 1:
            return per_example_classification_loss(logits, labels, batch_reduction="sum")
        raise InvalidHyperparameterError(
            f"no per-example loss for logits {tuple(logits.shape)} and labels {tuple(labels.shape)}: pass "
            "per_example_loss=f(outputs, labels) returning one loss per example"
        )

    def _shifts_labels(self, model: nn.Module) -> bool:
        """Causal LMs predict token t+1 at position t (Hugging Face shifts inside the loss);
        seq2seq decoders and token classifiers do not shift."""
        config = getattr(model, "config", None)
        if getattr(config, "is_encoder_decoder", False):
            return False
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        base = getattr(getattr(model, "base_model", None), "model", model)  # peft's PeftModel
        names = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
        return type(model).__name__ in names or type(base).__name__ in names

    def floating_point_ops(self, inputs: dict[str, Any]) -> int:
        """0: a count from the sampled batch would tell its size."""
        return 0

    # ------------------------------------------------------------------ what leaves

    @property
    def epsilon(self) -> float:
        """ε spent so far, at the budget's δ (``nan`` without one: with ``noise_multiplier`` and no
        ``target_epsilon``, ask ``trainer.private_optimizer.get_epsilon(delta)``)."""
        accountant = self.private_optimizer.accountant
        try:
            return float(accountant.epsilon())
        except InvalidHyperparameterError:
            return math.nan

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """The Trainer's log without what it computed from the sampled batches
        (:data:`PRIVATE_LOG_KEYS`), with ``epsilon``."""
        logs = {k: v for k, v in logs.items() if k not in PRIVATE_LOG_KEYS}
        if self.private_optimizer.steps > 0 and not math.isnan(self.epsilon):
            logs["epsilon"] = self.epsilon
        super().log(logs, start_time)

    def train(self, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> TrainOutput:
        """``Trainer.train``; the result's ``training_loss`` is ``nan`` (not released) and its
        metrics carry ``epsilon``."""
        if resume_from_checkpoint not in (None, False):
            raise InvalidHyperparameterError(
                "train(resume_from_checkpoint=...) is not supported by PrivateTrainer: the Trainer's checkpoint "
                "does not restore the Poisson sampler's position and the accountant. Resume through the plain "
                "loop (adaclip_torch.checkpoint) with a ledger="
            )
        out = super().train(None, *args, **kwargs)
        metrics = {k: v for k, v in out.metrics.items() if k not in PRIVATE_LOG_KEYS}
        if not math.isnan(self.epsilon):
            metrics["epsilon"] = self.epsilon
        return TrainOutput(out.global_step, math.nan, metrics)

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        """``Trainer.evaluate`` on the averaged parameters when ``averaging`` is set."""
        with self._released_model():
            return super().evaluate(*args, **kwargs)

    def predict(self, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.predict`` on the averaged parameters when ``averaging`` is set."""
        with self._released_model():
            return super().predict(*args, **kwargs)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Saves the averaged parameters when ``averaging`` is set (the live ones inside the
        Trainer's own checkpoints, whose optimizer state holds the average)."""
        if _internal_call:
            return super().save_model(output_dir, _internal_call=True)
        with self._released_model():
            return super().save_model(output_dir, _internal_call=False)

    def _released_model(self) -> Any:
        import contextlib

        if self.private_optimizer.average is None:
            return contextlib.nullcontext()
        return self.private_optimizer.averaged()
