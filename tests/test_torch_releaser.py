"""The release part of the PyTorch step is one object that owns its state
(:class:`adaclip_torch.release.Releaser`): the generator, the noise stream, the strategy's state
and the transform cache; the optimizer reads them from it and the step goes through it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import adaclip_torch.release as release_module
from adaclip_torch import AdaClip, FlatClip, make_private
from adaclip_torch.release import Releaser


def _flat(seed: int = 5) -> tuple[nn.Module, FlatClip]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 3))
    opt = FlatClip(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=1.0, max_grad_norm=1.0,
                   expected_batch_size=8.0, seed=seed)  # fmt: skip
    return model, opt


def _backward(model: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
    nn.functional.cross_entropy(model(x), y).backward()


def test_the_optimizer_reads_the_release_state_from_its_releaser():
    model, opt = _flat()
    part = opt._releaser
    assert isinstance(part, Releaser)
    assert opt._clip_state is part.state and opt._noise is part.noise and opt._stream is part.stream is None
    _backward(model, 1)
    opt.step()
    assert opt._clip_state is part.state and part.state.step == 1
    opt.remove_hooks()
    model, private, loader = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                          torch.utils.data.DataLoader(torch.utils.data.TensorDataset(
                                              torch.randn(64, 6), torch.randint(0, 3, (64,))), batch_size=8),
                                          target_epsilon=3.0, delta=1e-5, epochs=2, seed=0, progress=False,
                                          noise_mechanism="banded", bands=2)  # fmt: skip
    assert private._stream is private._releaser.stream is not None


def test_a_release_that_fails_rewinds_the_generator_and_the_stream(monkeypatch):
    # the release draws its noise, then fails before anything leaves: the releaser rewinds the
    # generator to where the release found it, so the next step draws what it would have drawn
    want_model, want = _flat()
    _backward(want_model, 1)
    want.step()
    expected = [p.grad.clone() for p in want_model.parameters()]

    model, opt = _flat()
    original = release_module.release

    def fails_after_drawing(*args, **kwargs):
        kwargs["noise"].standard_normal([torch.zeros(3)])  # a draw, then a failure
        raise RuntimeError("injected")

    monkeypatch.setattr(release_module, "release", fails_after_drawing)
    _backward(model, 1)
    before = [p.grad for p in model.parameters()]
    with pytest.raises(RuntimeError, match="injected"):
        opt.step()
    assert opt.steps == 0 and all(p.grad is g for p, g in zip(model.parameters(), before, strict=True))
    monkeypatch.setattr(release_module, "release", original)
    opt.step()  # the same batch's per-example gradients are still there
    for p, g in zip(model.parameters(), expected, strict=True):
        assert torch.equal(p.grad, g)


def test_restored_state_drops_the_cached_transform():
    model, opt = _flat()
    ada = AdaClip(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=1.0, expected_batch_size=8.0,
                  seed=1, attach_hooks=False)  # fmt: skip
    part = ada._releaser
    strategy = ada._strategy_at(0)
    first = part.transformed(strategy)
    assert part.transformed(strategy) is first  # cached per state
    part.restore(part.state)  # e.g. a checkpoint: the cache is dropped
    again = part.transformed(strategy)
    assert again is not first
    for a, b in zip(again[1], first[1], strict=True):
        assert torch.equal(torch.as_tensor(a), torch.as_tensor(b))
