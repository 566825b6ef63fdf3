"""A tiny causal-LM task for the PrivateTrainer tests, and the plain loop it must equal.

The plain loop is what a user writes without the ``Trainer``: ``make_private`` on the same
optimizer (the ``Trainer``'s class, keyword arguments and weight-decay groups), the same loader
(batch size, collator), the same learning-rate schedule, the per-example loss, ``step()`` for
every Poisson batch (``empty_batch=True`` for an empty one)."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, get_scheduler

from adaclip_torch import make_private
from adaclip_torch.losses import per_example_lm_loss

VOCAB, LENGTH = 40, 12


class Records(Dataset):
    """``n`` token sequences of 4 to 12 tokens (a record: one sequence)."""

    def __init__(self, n: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, VOCAB, (n, LENGTH), generator=g)
        self.lengths = torch.randint(4, LENGTH + 1, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        return {"input_ids": self.ids[i, : int(self.lengths[i])].tolist()}


def collate(examples: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
    """Right padding; labels are the ids with padding at -100; an empty batch is ``{}``."""
    if not examples:
        return {}
    width = max(len(e["input_ids"]) for e in examples)
    ids = torch.zeros(len(examples), width, dtype=torch.long)
    mask = torch.zeros(len(examples), width, dtype=torch.long)
    for i, e in enumerate(examples):
        ids[i, : len(e["input_ids"])] = torch.tensor(e["input_ids"])
        mask[i, : len(e["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


collate.handles_empty_batch = True  # type: ignore[attr-defined]


def tiny_gpt2(seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    return GPT2LMHeadModel(config)


def training_arguments(out: str, **overrides: Any) -> TrainingArguments:
    settings: dict[str, Any] = dict(
        output_dir=out, per_device_train_batch_size=4, num_train_epochs=2, learning_rate=1e-3,
        logging_steps=1000, save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
        dataloader_num_workers=0, seed=0,
    )  # fmt: skip
    settings.update(overrides)
    return TrainingArguments(**settings)


def plain_loop(model: torch.nn.Module, data: Dataset, args: TrainingArguments, **privacy: Any) -> Any:
    """The loop a user writes by hand; returns the private optimizer. ``args.bf16``: the forward
    pass under ``torch.autocast("cpu", dtype=torch.bfloat16)``; ``args.gradient_checkpointing``:
    ``model.gradient_checkpointing_enable()``."""
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs)
    precision = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bool(args.bf16))
    opt_cls, opt_kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
    decay = set(Trainer.get_decay_parameter_names(None, model))
    groups = [
        {"params": [p for n, p in model.named_parameters() if n in decay and p.requires_grad],
         "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if n not in decay and p.requires_grad],
         "weight_decay": 0.0},
    ]  # fmt: skip
    base = opt_cls(groups, **opt_kwargs)
    loader = DataLoader(data, batch_size=args.per_device_train_batch_size, shuffle=True, collate_fn=collate)
    epochs = int(args.num_train_epochs)
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    extra = {"distributed": True} if world > 1 else {}
    if privacy.get("target_epsilon") is not None:
        extra["epochs"] = epochs
    model, optimizer, private_loader = make_private(
        model, base, loader, max_grad_norm=privacy.pop("max_grad_norm", args.max_grad_norm),
        loss_reduction="sum", **extra, **privacy,
    )  # fmt: skip
    scheduler = get_scheduler(args.lr_scheduler_type, optimizer, num_warmup_steps=args.warmup_steps,
                              num_training_steps=epochs * len(private_loader))  # fmt: skip
    model.train()
    for _ in range(epochs):
        for batch in private_loader:
            if len(batch) == 0:
                optimizer.step(empty_batch=True)
            else:
                with precision:
                    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
                    loss = per_example_lm_loss(logits, batch["labels"], batch_reduction="sum")
                loss.backward()
                optimizer.step()
            scheduler.step()
            model.zero_grad()
    return optimizer
