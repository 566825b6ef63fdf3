"""PrivateTrainer: private training through the Hugging Face Trainer, equal to the plain loop.

The plain loop (``tests/_hf_trainer_task.py``) is make_private with the Trainer's optimizer,
schedule and batch size, the per-example loss and a step for every Poisson batch. With the same
seed the Trainer's run must end on the same parameters (and the same average), with the same
accountant, and must log nothing computed from the sampled batches."""

from __future__ import annotations

import copy
import logging
import math

import pytest
import torch
from _hf_trainer_task import Records, collate, plain_loop, tiny_gpt2, training_arguments
from torch import nn

from adaclip.errors import InvalidHyperparameterError
from adaclip_torch.trainer import PRIVATE_LOG_KEYS, PrivateTrainer

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

PRIVACY = dict(target_epsilon=3.0, delta=1e-3, seed=0)


def _trainer(model: nn.Module, args, n: int = 48, **privacy) -> PrivateTrainer:
    return PrivateTrainer(model=model, args=args, train_dataset=Records(n), eval_dataset=Records(16, seed=1),
                          data_collator=collate, **privacy)  # fmt: skip


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize(
    "privacy",
    [
        pytest.param(dict(noise_mechanism="banded", averaging="ema"), id="banded+ema"),
        # the Trainer's code is the same whatever the mechanism builds: these two are slow-only
        pytest.param(dict(noise_mechanism="independent"), id="dp-sgd", marks=pytest.mark.slow),
        pytest.param(dict(noise_mechanism="independent", strategy="adaclip"), id="adaclip", marks=pytest.mark.slow),
    ],
)
def test_the_trainer_takes_the_same_steps_as_the_plain_loop(tmp_path, privacy) -> None:
    args = training_arguments(str(tmp_path), per_device_train_batch_size=2)  # q = 1/16: empty batches occur
    model = tiny_gpt2()
    twin = copy.deepcopy(model)
    trainer = _trainer(model, args, n=32, **PRIVACY, **privacy)
    trainer.train()
    loop = plain_loop(twin, Records(32), training_arguments(str(tmp_path), per_device_train_batch_size=2),
                      **PRIVACY, **privacy)  # fmt: skip
    dp = trainer.private_optimizer
    assert dp.steps == loop.steps == 2 * 16
    assert dp.noise_mechanism == loop.noise_mechanism and dp.bands == loop.bands
    for a, b in zip(_params(model), _params(twin), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert trainer.epsilon == pytest.approx(loop.get_epsilon(), rel=1e-12)
    assert trainer.epsilon <= PRIVACY["target_epsilon"]
    if dp.average is not None:
        for (_, a), (_, b) in zip(sorted(dp.average.averaged_parameters().items()),
                                  sorted(loop.average.averaged_parameters().items()), strict=True):  # fmt: skip
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    # the run did move the model (a test of equality between two runs that did nothing would pass)
    assert any(not torch.equal(a, b) for a, b in zip(_params(model), _params(tiny_gpt2()), strict=True))


def test_bf16_and_activation_checkpointing_from_the_training_arguments(tmp_path) -> None:
    """``bf16=True`` (autocast through Accelerate) and ``gradient_checkpointing=True`` (the Trainer
    calls ``gradient_checkpointing_enable()``): the same steps as the plain loop under
    ``torch.autocast`` with checkpointing, and within bfloat16's precision of float32."""
    settings = dict(per_device_train_batch_size=4, num_train_epochs=1, bf16=True, gradient_checkpointing=True)
    model, twin, reference = tiny_gpt2(), tiny_gpt2(), tiny_gpt2()
    trainer = _trainer(model, training_arguments(str(tmp_path), **settings), noise_multiplier=0.5, seed=0)
    assert trainer.accelerator.mixed_precision == "bf16"
    dtypes = set()
    model.lm_head.register_forward_hook(lambda m, a, out: dtypes.add(out.dtype) if torch.is_grad_enabled() else None)
    trainer.train()
    assert dtypes == {torch.bfloat16}  # the training forward passes ran under autocast
    assert model.is_gradient_checkpointing
    plain_loop(twin, Records(48), training_arguments(str(tmp_path), **settings), noise_multiplier=0.5, seed=0)
    for a, b in zip(_params(model), _params(twin), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    float32 = dict(settings, bf16=False, gradient_checkpointing=False)
    plain_loop(reference, Records(48), training_arguments(str(tmp_path), **float32), noise_multiplier=0.5, seed=0)
    moved = max((a - b).abs().max().item() for a, b in zip(_params(reference), _params(tiny_gpt2()), strict=True))
    apart = max((a - b).abs().max().item() for a, b in zip(_params(model), _params(reference), strict=True))
    assert apart < 0.05 * moved  # bfloat16 rounding, not another run


def test_empty_batches_are_released_as_noise_alone(tmp_path) -> None:
    """With B = 1 of N = 48 about a third of the Poisson batches are empty: the Trainer skips
    their forward pass and the optimizer still releases (and accounts) each of them."""
    trainer = _trainer(tiny_gpt2(), training_arguments(str(tmp_path), per_device_train_batch_size=1,
                                                       num_train_epochs=1), n=24, noise_multiplier=1.0, seed=0)  # fmt: skip
    sizes = []
    real_step = trainer.training_step

    def counting_step(model, inputs, num_items_in_batch=None):
        sizes.append(0 if len(inputs) == 0 else len(inputs["input_ids"]))
        return real_step(model, inputs, num_items_in_batch)

    trainer.training_step = counting_step
    trainer.train()
    assert sizes.count(0) >= 3 and len(sizes) == 24  # P(fewer than 3 of 24 empty) < 1e-3; seeded anyway
    assert trainer.private_optimizer.steps == 24 == trainer.private_optimizer.accountant.steps


def test_the_logs_hold_nothing_computed_from_the_sampled_batches(tmp_path) -> None:
    args = training_arguments(str(tmp_path), eval_strategy="epoch", logging_steps=4)
    trainer = _trainer(tiny_gpt2(), args, **PRIVACY, noise_mechanism="independent")
    out = trainer.train()
    history = trainer.state.log_history
    assert history and all(not (PRIVATE_LOG_KEYS & entry.keys()) for entry in history)
    steps = [e for e in history if "learning_rate" in e]
    assert len(steps) == trainer.private_optimizer.steps // 4 and all("epsilon" in e for e in steps)
    assert [e["epsilon"] for e in steps] == sorted(e["epsilon"] for e in steps)  # ε only grows
    assert any("eval_loss" in e for e in history)  # the held-out metrics are kept
    assert math.isnan(out.training_loss) and "train_loss" not in out.metrics
    assert out.metrics["epsilon"] == pytest.approx(trainer.epsilon)
    assert trainer.args.max_grad_norm == 0.0  # the Trainer's own clipping of the summed gradient


def test_the_clip_norm_is_args_max_grad_norm_unless_given(tmp_path) -> None:
    trainer = _trainer(tiny_gpt2(), training_arguments(str(tmp_path), max_grad_norm=0.5), noise_multiplier=1.0)
    assert trainer.private_optimizer.max_grad_norm == pytest.approx(0.5)
    given = _trainer(tiny_gpt2(), training_arguments(str(tmp_path), max_grad_norm=0.5), noise_multiplier=1.0,
                     max_grad_norm=2.0)  # fmt: skip
    assert given.private_optimizer.max_grad_norm == pytest.approx(2.0)


def test_evaluate_and_save_model_use_the_average(tmp_path) -> None:
    trainer = _trainer(tiny_gpt2(), training_arguments(str(tmp_path)), **PRIVACY, averaging=0.5)
    trainer.train()
    live = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    averaged = trainer.private_optimizer.average.averaged_parameters()
    assert any(not torch.equal(live[n], averaged[n]) for n in averaged)
    trainer.save_model(str(tmp_path / "saved"))
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "saved" / "model.safetensors"))
    for name, value in averaged.items():
        torch.testing.assert_close(saved[name], value.to(saved[name].dtype))
    after = {n: p.detach() for n, p in trainer.model.named_parameters()}
    assert all(torch.equal(live[n], after[n]) for n in live)  # the live parameters are back
    seen = []
    trainer.model.register_forward_pre_hook(lambda m, a: seen.append(m.transformer.wte.weight.detach().clone()))
    trainer.evaluate()
    torch.testing.assert_close(seen[0], averaged["transformer.wte.weight"])


@pytest.mark.parametrize(
    ("overrides", "privacy", "names"),
    [
        (dict(gradient_accumulation_steps=2), {}, "gradient_accumulation_steps"),
        (dict(fp16=True), {}, "fp16"),
        (dict(max_steps=5), {}, "max_steps"),
        (dict(num_train_epochs=1.5), {}, "num_train_epochs"),
        (dict(label_smoothing_factor=0.1), {}, "label_smoothing_factor"),
        (dict(include_num_input_tokens_seen="all"), {}, "include_num_input_tokens_seen"),
        (dict(train_sampling_strategy="sequential"), {}, "train_sampling_strategy"),
        (dict(auto_find_batch_size=True), {}, "auto_find_batch_size"),
        ({}, dict(epochs=3), "epochs"),
        ({}, dict(loss_reduction="mean"), "loss_reduction"),
        ({}, dict(target_epsilon=-1.0, delta=1e-3), "target_epsilon"),
    ],
)
def test_what_cannot_be_honoured_is_refused_before_anything_is_built(tmp_path, overrides, privacy, names) -> None:
    model = tiny_gpt2()
    before = _params(model)
    try:
        args = training_arguments(str(tmp_path), **overrides)
    except ValueError:  # a combination transformers itself refuses (fp16 on CPU)
        pytest.skip("transformers refuses these arguments itself")
    with pytest.raises(InvalidHyperparameterError, match=names):
        _trainer(model, args, **{"noise_multiplier": 1.0, **privacy})
    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) for m in model.modules())
    assert hooks == 0 and all(torch.equal(a, b) for a, b in zip(before, _params(model), strict=True))


def test_resuming_from_a_trainer_checkpoint_is_refused(tmp_path) -> None:
    trainer = _trainer(tiny_gpt2(), training_arguments(str(tmp_path)), noise_multiplier=1.0)
    with pytest.raises(InvalidHyperparameterError, match="resume_from_checkpoint"):
        trainer.train(resume_from_checkpoint=str(tmp_path))
    assert trainer.private_optimizer.steps == 0


def test_a_classifier_and_a_custom_per_example_loss(tmp_path) -> None:
    from transformers import BertConfig, BertForSequenceClassification

    class Labelled(Records):
        def __getitem__(self, i):
            return {**super().__getitem__(i), "labels": int(self.ids[i, 0]) % 2}

    def classify(examples):
        if not examples:
            return {}
        batch = collate([{"input_ids": e["input_ids"]} for e in examples])
        batch["labels"] = torch.tensor([e["labels"] for e in examples])
        return batch

    classify.handles_empty_batch = True
    torch.manual_seed(0)
    bert = BertForSequenceClassification(BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1,
                                                    num_attention_heads=2, intermediate_size=32,
                                                    max_position_embeddings=16, num_labels=2))  # fmt: skip
    calls = []

    def loss(outputs, labels):
        calls.append(len(labels))
        return nn.functional.cross_entropy(outputs.logits, labels, reduction="none")

    for per_example_loss in (None, loss):
        trainer = PrivateTrainer(model=copy.deepcopy(bert), args=training_arguments(str(tmp_path), num_train_epochs=1),
                                 train_dataset=Labelled(32), data_collator=classify, noise_multiplier=1.0, seed=0,
                                 per_example_loss=per_example_loss)  # fmt: skip
        trainer.train()
        assert trainer.private_optimizer.steps == 8
    assert calls and sum(calls) > 0


def test_what_it_built_is_logged(tmp_path, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="adaclip_torch.trainer"):
        _trainer(tiny_gpt2(), training_arguments(str(tmp_path)), noise_multiplier=1.0)
    (message,) = [r.getMessage() for r in caplog.records if r.name == "adaclip_torch.trainer"]
    assert "C = 1" in message and "args.max_grad_norm" in message and "not logged" in message


def test_two_processes_launched_with_torchrun_equal_the_plain_data_parallel_loop(tmp_path) -> None:
    """``torchrun --nproc_per_node 2`` (what ``accelerate launch`` starts on CPU): each rank samples
    its own shard, the noise is added once in the optimizer's all-reduce, and the Trainer's run
    equals the plain data-parallel loop on every rank, the two ranks holding the same model."""
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    worker = Path(__file__).parent / "_hf_trainer_ddp_worker.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
         f"--master_port={port}", str(worker), str(tmp_path)],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for r, out in enumerate(ranks):
        assert out["rank"] == r and out["world"] == 2 and out["distributed"]
        assert out["expected_batch_size"] == pytest.approx(4.0)  # 2 ranks × B = 2: q = 4/48
        for a, b in zip(out["trainer"], out["loop"], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
        for name, value in out["trainer_average"].items():
            torch.testing.assert_close(value, out["loop_average"][name], rtol=0, atol=1e-6)
        assert out["epsilon"] == pytest.approx(out["loop_epsilon"]) and out["epsilon"] <= 3.0
    assert sorted(ranks[0]["shard"] + ranks[1]["shard"]) == list(range(48))  # disjoint shards, all examples
    for a, b in zip(ranks[0]["trainer"], ranks[1]["trainer"], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert any(not torch.equal(a, b) for a, b in zip(ranks[0]["trainer"], ranks[0]["initial"], strict=True))


def test_lora_through_the_trainer(tmp_path) -> None:
    """A peft model: only the adapters train (the frozen base costs nothing per example), the
    causal shift is recognised through the wrapper, and save_model writes the adapters. Without
    a budget δ no epsilon is logged (it would be nan)."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_gpt2(), LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True))
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    trainer = _trainer(model, training_arguments(str(tmp_path), num_train_epochs=1, logging_steps=2), n=16,
                       noise_multiplier=1.0, seed=0)  # fmt: skip
    assert trainer._shifts_labels(model)
    trainer.train()
    assert trainer.private_optimizer.steps == 4
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)
    assert all("epsilon" not in e for e in trainer.state.log_history)
    trainer.save_model(str(tmp_path / "adapter"))
    assert (tmp_path / "adapter" / "adapter_model.safetensors").exists()
