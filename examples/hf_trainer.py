"""Private fine-tuning through the Hugging Face ``Trainer``: one changed line, ``PrivateTrainer``.

The same task as ``examples/hf_finetune.py`` (whose data and model helpers it imports): a small
GPT-2 (``GPT2LMHeadModel`` from a config, random init, no download) is pretrained **without
privacy** on the docstrings of Python standard-library modules, then fine-tuned **privately**
on NumPy's docstrings — here with ``transformers.Trainer``'s own loop, ``TrainingArguments``,
evaluation every epoch and ``save_model()``. The only change from a non-private script is
``PrivateTrainer(..., target_epsilon=..., delta=..., averaging="ema")`` in place of
``Trainer(...)``. It prints what the library built (banded correlated noise when its rule
expects it to pay), the held-out perplexity before and after, and the ε spent.

A record (the privacy unit) is one window of at most 64 characters of a docstring (32 with
``--quick``); ``examples/hf_finetune.py`` explains the unit and the held-out split.

    python examples/hf_trainer.py --quick                        # CI: about 30 s on 2 CPU cores
    python examples/hf_trainer.py --quick --bf16 --checkpointing # bf16 autocast, activation checkpointing
    torchrun --nproc_per_node 2 examples/hf_trainer.py --quick   # two processes (gloo on CPU)
    python examples/hf_trainer.py --save DIR                     # the averaged model, save_pretrained
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch
import transformers
from torch.utils.data import Dataset
from transformers import TrainingArguments

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_finetune import (  # noqa: E402  (the data and model of the sibling example)
    FULL,
    PRIVATE_MODULES,
    PUBLIC_MODULES,
    QUICK,
    CharTokenizer,
    build_model,
    docstrings,
    pretrain,
    split,
    windows,
)

from adaclip_torch.trainer import PrivateTrainer  # noqa: E402

warnings.filterwarnings("ignore", module="transformers")
warnings.filterwarnings("ignore", module="accelerate")
transformers.logging.set_verbosity_error()


class Records(Dataset):
    """The private records as the Trainer expects them: one dict per record."""

    def __init__(self, ids: torch.Tensor, mask: torch.Tensor) -> None:
        self.ids, self.mask = ids, mask

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i]}


def collate(records: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack; the labels are the ids with padding at -100. An empty Poisson batch is ``{}``."""
    if not records:
        return {}
    ids = torch.stack([r["input_ids"] for r in records])
    mask = torch.stack([r["attention_mask"] for r in records])
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


collate.handles_empty_batch = True  # type: ignore[attr-defined]  # the collator says what an empty batch is


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model and few steps (CI)")
    parser.add_argument("--epsilon", type=float, default=8.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW's learning rate (before the library's factor)")
    parser.add_argument("--bf16", action="store_true", help="TrainingArguments(bf16=True): bfloat16 autocast")
    parser.add_argument("--checkpointing", action="store_true", help="TrainingArguments(gradient_checkpointing=True)")
    parser.add_argument("--seed", type=int, default=0, help="the model's initialisation and the pretraining")
    parser.add_argument("--save", type=Path, help="save the averaged model here (save_pretrained)")
    args = parser.parse_args(argv)
    importlib.import_module("torch._dynamo")  # before torchrun's process group (see adaclip_torch.distributed)
    setting = QUICK if args.quick else FULL
    torch.set_num_threads(1)
    started = time.perf_counter()

    tokenizer = CharTokenizer()
    public_train, _ = split(docstrings(PUBLIC_MODULES))
    private_train, private_test = split(docstrings(PRIVATE_MODULES))
    pub_ids, pub_mask = windows(public_train, tokenizer, setting.length)
    priv_ids, priv_mask = windows(private_train, tokenizer, setting.length)
    test_ids, test_mask = windows(private_test, tokenizer, setting.length)
    if setting.private_records:
        priv_ids, priv_mask = priv_ids[: setting.private_records], priv_mask[: setting.private_records]
    test_ids, test_mask = test_ids[: setting.eval_records], test_mask[: setting.eval_records]

    model = build_model(setting, tokenizer.vocab_size, args.seed)
    pretrain(model, pub_ids, pub_mask, setting.pretrain_steps, setting.pretrain_batch, args.seed)

    training = TrainingArguments(
        output_dir=str(args.save or "/tmp/adaclip-hf-trainer"), num_train_epochs=args.epochs,
        per_device_train_batch_size=setting.batch_size, learning_rate=args.lr, lr_scheduler_type="constant",
        eval_strategy="epoch", per_device_eval_batch_size=128, logging_strategy="epoch", save_strategy="no",
        report_to=[], use_cpu=True, bf16=args.bf16, gradient_checkpointing=args.checkpointing,
        ddp_backend="gloo" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None, disable_tqdm=True,
    )  # fmt: skip
    trainer = PrivateTrainer(  # the one changed line: Trainer -> PrivateTrainer, plus the budget
        model=model, args=training, train_dataset=Records(priv_ids, priv_mask),
        eval_dataset=Records(test_ids, test_mask), data_collator=collate,
        target_epsilon=args.epsilon, delta=args.delta, averaging="ema",
    )  # fmt: skip
    main_process = training.process_index == 0
    dp = trainer.private_optimizer
    before = trainer.evaluate()["eval_loss"]
    if main_process:
        print(f"private: {len(priv_ids)} records of <= {setting.length} characters, {training.world_size} "
              f"process(es); held out: {len(test_ids)} records")  # fmt: skip
        print(f"built: {dp.noise_mechanism} noise, b = {dp.bands}, sigma = {dp.noise_multiplier:.3f}, "
              f"q = {dp.sample_rate:.4f}, {args.epochs} epochs = {args.epochs * len(trainer.private_loader)} steps, "
              f"EMA of the parameters; bf16: {args.bf16}; checkpointing: {args.checkpointing}")  # fmt: skip
        print(f"before: held-out loss {before:.3f} nats/char, perplexity {math.exp(before):.2f}")
    trainer.train()
    after = trainer.evaluate()["eval_loss"]  # the averaged model
    if args.save:
        trainer.save_model(str(args.save))
    if main_process:
        print(f"after:  held-out loss {after:.3f} nats/char, perplexity {math.exp(after):.2f} (averaged model)")
        print(f"epsilon = {trainer.epsilon:.4f} (delta = {args.delta:g}, target {args.epsilon:g}); "
              f"{time.perf_counter() - started:.0f} s")  # fmt: skip


if __name__ == "__main__":
    main()
