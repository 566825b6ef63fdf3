"""LoRA (peft) on a tiny GPT-2: the per-sample paths and checkpoints.

- The ghost path on LoRA's two small matrices (and on a ``modules_to_save`` copy of the final
  layer norm) computes the same per-example gradients and clipped sums as materialise and
  auto, and as a micro-batch reference (one example at a time), in float64 with padding.
  ``tests/test_torch_hf_models.py`` covers LoRA r = 4 without ``modules_to_save``; this adds
  r = 8, the ``modules_to_save`` wrapper, AdaCliP's centred clipping and which layers go where.
- Checkpoints: the adapters saved with ``save_pretrained`` (the LoRA matrices and the
  ``modules_to_save`` copy, nothing of the frozen base), the private optimizer's
  ``state_dict()`` and the Poisson sampler's state, loaded into a fresh base with
  ``PeftModel.from_pretrained(..., is_trainable=True)``. Seeded (``seed=``), a run resumed from
  the checkpoint equals the uninterrupted run bit for bit; unseeded, the checkpoint holds no
  noise generator state and the resumed run draws fresh noise (and keeps counting ε).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

peft = pytest.importorskip("peft")
T = pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402

from adaclip.errors import InvalidHyperparameterError, NoiseReplayWarning  # noqa: E402
from adaclip_torch import AdaClip, FlatClip, make_private  # noqa: E402
from adaclip_torch.engines import StepInputs  # noqa: E402
from adaclip_torch.losses import per_example_lm_loss  # noqa: E402

pytestmark = [
    pytest.mark.torch,
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),  # peft's call
]
warnings.filterwarnings("ignore", module="transformers")
warnings.filterwarnings("ignore", module="peft")
T.logging.set_verbosity_error()

V, L = 40, 8
MODES = ("materialise", "ghost", "auto")


def base_model(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    config = T.GPT2Config(vocab_size=V, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    return T.GPT2LMHeadModel(config).to(dtype)


def lora_config(r: int = 8) -> peft.LoraConfig:
    return peft.LoraConfig(r=r, lora_alpha=16, lora_dropout=0.0, target_modules=["c_attn", "c_proj"],
                           fan_in_fan_out=True, modules_to_save=["transformer.ln_f"])  # fmt: skip


def lora_model(dtype: torch.dtype = torch.float32, r: int = 8, perturb: bool = True) -> nn.Module:
    model = peft.get_peft_model(base_model(dtype), lora_config(r))
    if perturb:  # B starts at 0 (so A's gradients are 0) and the norm's copy at the base's: move them
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.requires_grad and ("lora_B" in name or "modules_to_save" in name):
                    p.add_(0.1 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    model.train()
    return model


def padded(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(1, V, (n, L), generator=gen)
    lengths = torch.randint(2, L + 1, (n,), generator=gen)
    mask = (torch.arange(L)[None, :] < lengths[:, None]).long()
    return ids * mask, mask


def lm_loss(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids, attention_mask=mask).logits
    return per_example_lm_loss(logits, ids.masked_fill(mask == 0, -100))  # Σ_i of each example's token mean


def trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


# ------------------------------------------------------------------------------ the paths
def reference(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    params = trainable(model)
    rows = []
    for i in range(len(ids)):
        model.zero_grad(set_to_none=True)
        lm_loss(model, ids[i : i + 1], mask[i : i + 1]).backward()
        rows.append([torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in params])
    model.zero_grad(set_to_none=True)
    return [torch.stack([r[k] for r in rows]) for k in range(len(params))]


def engine_outputs(opt: FlatClip, loss: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The engine's clipped sums and per-example gradients after ``loss.backward()``; no step."""
    loss.backward()
    state = opt.clip_state
    inputs = StepInputs(state, lambda s: s.transform(state, len(opt.params)), "zero", opt.grad_sample_hooks)
    sums = opt.engine.clipped_sum(inputs, opt.strategy, opt.engine.unit_sources(inputs, require=True))
    per_example = opt.engine.collect(inputs)
    opt.zero_grad()
    return sums[: len(opt.params)], per_example


def test_lora_with_modules_to_save_agrees_across_paths_and_with_the_reference():
    model = lora_model(torch.float64)
    params = trainable(model)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert sum("lora_A" in n for n in names) == sum("lora_B" in n for n in names) == 6
    assert [n for n in names if "modules_to_save" in n] == [
        "base_model.model.transformer.ln_f.modules_to_save.default.weight",
        "base_model.model.transformer.ln_f.modules_to_save.default.bias",
    ]
    ids, mask = padded(5, torch.Generator().manual_seed(3))
    ref = reference(model, ids, mask)
    norms = torch.sqrt(sum((g.flatten(1) ** 2).sum(1) for g in ref))
    clip = float(norms.median())  # some examples clipped, some not
    factors = torch.clamp(clip / norms, max=1.0)
    expected = [(g * factors.view(-1, *[1] * (g.ndim - 1))).sum(0) / clip for g in ref]
    for mode in MODES:
        opt = FlatClip(torch.optim.SGD(params, lr=0.0), model, noise_multiplier=1.0, expected_batch_size=5.0,
                       max_grad_norm=clip, per_sample_mode=mode, loss_reduction="sum")  # fmt: skip
        try:
            sums, per_example = engine_outputs(opt, lm_loss(model, ids, mask))
            for got, want in zip(per_example, ref, strict=True):
                torch.testing.assert_close(got, want, rtol=1e-7, atol=1e-10)
            for got, want in zip(sums, expected, strict=True):
                torch.testing.assert_close(got, want, rtol=1e-7, atol=1e-9)
            if mode == "ghost":  # LoRA's A and B are nn.Linear: both on the ghost path; the frozen base is not
                kinds = {type(m).__name__: k for m, k in opt.engine.modules.items()}
                adapters = [m for m in opt.engine.modules if isinstance(m, nn.Linear)]
                assert kinds == {"Linear": "linear"} and len(adapters) == 12, kinds
                assert {tuple(m.weight.shape) for m in adapters} >= {(8, 32), (96, 8), (32, 8), (8, 128)}
        finally:
            opt.remove_hooks()


def test_adaclip_centred_clipping_agrees_across_paths_on_lora():
    """AdaCliP's per-coordinate centre and scale (after a step, so they are not the initial
    ones): ghost and auto release what materialise releases, step for step (same seed)."""
    ids, mask = padded(6, torch.Generator().manual_seed(4))
    released = {}
    for mode in MODES:
        model = lora_model(torch.float64)
        opt = AdaClip(torch.optim.SGD(trainable(model), lr=0.05), model, noise_multiplier=0.5,
                      expected_batch_size=6.0, initial_max_grad_norm=0.5, per_sample_mode=mode,
                      loss_reduction="sum", seed=0)  # fmt: skip
        for _ in range(3):
            lm_loss(model, ids, mask).backward()
            opt.step()
            opt.zero_grad()
        released[mode] = [p.detach().clone() for p in trainable(model)]
        opt.remove_hooks()
    for mode in ("ghost", "auto"):
        for got, want in zip(released[mode], released["materialise"], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


# ------------------------------------------------------------------------------ checkpoints
N, BATCH = 64, 16  # q = 1/4, 4 steps per epoch
DATA = TensorDataset(*padded(N, torch.Generator().manual_seed(5)))


def private_run(strategy: str, seed: int | None, *, resume: Path | None = None, r: int = 8):
    """A LoRA model and ``make_private``'s optimizer and loader; from a checkpoint if ``resume``:
    a fresh base, the adapters loaded with ``PeftModel.from_pretrained(..., is_trainable=True)``,
    then the optimizer's and the sampler's states."""
    if resume is None:
        model = lora_model(r=r)
    else:
        model = peft.PeftModel.from_pretrained(base_model(), str(resume), is_trainable=True)
        model.train()
    optimizer = torch.optim.AdamW(trainable(model), lr=1e-2)
    model, private, loader = make_private(
        model, optimizer, DataLoader(DATA, batch_size=BATCH), noise_multiplier=1.0, max_grad_norm=1.0,
        strategy=strategy, loss_reduction="sum", seed=seed, per_sample_mode="ghost", noise_mechanism="independent",
    )  # fmt: skip
    if resume is not None:
        state = torch.load(resume / "dp_state.pt", weights_only=False)
        private.load_state_dict(state["optimizer"])
        loader.batch_sampler.load_state_dict(state["sampler"])
    return model, private, loader


def cycle(loader: DataLoader) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Pass after pass: the Poisson sampler draws each batch from its generator when asked, so a
    restored sampler continues the same sequence whatever the position in the pass."""
    while True:
        yield from loader


def train(model, private, loader, steps: int) -> None:
    batches = cycle(loader)
    for _ in range(steps):
        ids, mask = next(batches)
        if len(ids) == 0:
            private.step(empty_batch=True)
        else:
            lm_loss(model, ids, mask).backward()
            private.step()
        private.zero_grad()


def save(model, private, loader, directory: Path) -> None:
    model.save_pretrained(str(directory))  # adapter_config.json + adapter_model.safetensors
    torch.save({"optimizer": private.state_dict(), "sampler": loader.batch_sampler.state_dict()},
               directory / "dp_state.pt")  # fmt: skip


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("strategy", ["flat", "adaclip"])
def test_seeded_lora_checkpoint_resumes_bit_for_bit(strategy, tmp_path):
    straight = private_run(strategy, seed=0)
    train(*straight, 6)
    first = private_run(strategy, seed=0)
    train(*first, 3)
    save(*first, tmp_path)
    assert "generator_state" in first[1].state_dict()["noise"]  # seeded: the noise is predictable, secret
    with pytest.warns(NoiseReplayWarning):
        resumed = private_run(strategy, seed=0, resume=tmp_path)
    loaded = adapter_state(resumed[0])
    assert list(loaded) == list(adapter_state(first[0]))  # same parameters, same order as the optimizer's
    for name, value in adapter_state(first[0]).items():
        assert torch.equal(loaded[name], value), name
    train(*resumed, 3)
    want, got = adapter_state(straight[0]), adapter_state(resumed[0])
    for name in want:
        assert torch.equal(got[name], want[name]), name
    assert resumed[1].steps == straight[1].steps == 6
    assert resumed[1].accountant.epsilon(1e-5) == straight[1].accountant.epsilon(1e-5)
    assert str(resumed[1].state_dict()["clip_state"]) == str(straight[1].state_dict()["clip_state"])


def test_the_adapter_checkpoint_holds_the_trainable_parameters_only(tmp_path):
    model, private, loader = private_run("adaclip", seed=0)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    train(model, private, loader, 2)
    save(model, private, loader, tmp_path)
    saved = load_file(str(tmp_path / "adapter_model.safetensors"))
    assert len(saved) == 14 and all("lora_" in k or "ln_f" in k for k in saved), sorted(saved)
    assert sum(v.numel() for v in saved.values()) == sum(p.numel() for p in trainable(model))
    for name, p in model.named_parameters():  # training moved nothing of the base
        if not p.requires_grad:
            assert torch.equal(p, frozen[name]), name


def test_unseeded_checkpoint_resumes_with_fresh_noise_and_keeps_counting(tmp_path):
    first = private_run("flat", seed=None)
    train(*first, 3)
    save(*first, tmp_path)
    assert "generator_state" not in first[1].state_dict()["noise"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", NoiseReplayWarning)  # nothing replays
        resumed = private_run("flat", seed=None, resume=tmp_path)
    assert resumed[1].steps == 3 and resumed[1].accountant.state_dict() == first[1].accountant.state_dict()
    for name, value in adapter_state(first[0]).items():
        assert torch.equal(adapter_state(resumed[0])[name], value), name
    train(*first, 1)
    train(*resumed, 1)  # the same batch (sampler restored), fresh noise
    assert resumed[1].steps == 4 and resumed[1].accountant.epsilon(1e-5) == first[1].accountant.epsilon(1e-5)
    assert any(not torch.equal(a, b) for a, b in zip(trainable(first[0]), trainable(resumed[0]), strict=True))


def test_an_optimizer_state_for_other_adapters_is_refused_and_changes_nothing(tmp_path):
    model, private, loader = private_run("adaclip", seed=0, r=8)
    train(model, private, loader, 1)
    state = private.state_dict()
    _, other, _ = private_run("adaclip", seed=0, r=4)  # AdaCliP's statistics have r = 8 shapes
    before = str(other.state_dict())
    with pytest.raises(InvalidHyperparameterError):
        other.load_state_dict(state)
    assert str(other.state_dict()) == before
