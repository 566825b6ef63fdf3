"""The three small library changes the PrivateTrainer rests on, each tested on its own:
``DPOptimizer.mark_empty_batch``, a collator that handles empty batches itself, and a seeded
noise source that does not warn when given back the state it is in."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

from adaclip.errors import InvalidGradientError, NoiseReplayWarning
from adaclip_torch import FlatClip
from adaclip_torch.data import empty_batch_collate
from adaclip_torch.noise import NoiseSource


def _optimizer(seed: int = 0) -> tuple[nn.Module, FlatClip]:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    return model, FlatClip(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=1.0,
                           expected_batch_size=4, max_grad_norm=1.0, seed=seed)  # fmt: skip


def test_mark_empty_batch_makes_the_next_step_an_empty_one() -> None:
    (model, marked), (twin, keyword) = _optimizer(), _optimizer()
    marked.mark_empty_batch()
    marked.step()  # no backward: the mark says the batch had no units
    keyword.step(empty_batch=True)
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)
    assert marked.steps == 1
    with pytest.raises(InvalidGradientError):  # the mark is spent: the next step needs gradients again
        marked.step()


def test_a_marked_step_with_per_example_gradients_is_refused_and_keeps_the_mark() -> None:
    model, opt = _optimizer()
    opt.mark_empty_batch()
    model(torch.ones(2, 3)).sum().backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(InvalidGradientError, match="empty_batch=True but the parameters have per-example"):
        opt.step()
    assert opt.steps == 0 and all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    opt.zero_grad()
    opt.step()  # still marked: released as an empty batch
    assert opt.steps == 1


class _Tokens(Dataset):
    def __len__(self) -> int:
        return 3

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        return {"input_ids": list(range(i + 2))}  # variable length: no zero-length form from one example


def test_a_collator_that_handles_empty_batches_is_called_on_them() -> None:
    def collate(examples):
        return {"n": len(examples)}

    wrapped = empty_batch_collate(_Tokens(), collate)
    assert wrapped([]) != {"n": 0}  # without the marker the library builds the empty batch itself
    collate.handles_empty_batch = True
    assert empty_batch_collate(_Tokens(), collate)([]) == {"n": 0}


def test_restoring_the_current_seeded_state_does_not_warn_but_a_past_one_does() -> None:
    source = NoiseSource(seed=3)
    state = source.state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("error", NoiseReplayWarning)
        source.load_state_dict(state)  # the state it is in (Accelerate's device-placement round trip)
    (first,) = source.standard_normal([torch.zeros(4)])
    with pytest.warns(NoiseReplayWarning):
        source.load_state_dict(state)  # from before the draw above: the next draw repeats it
    assert torch.equal(source.standard_normal([torch.zeros(4)])[0], first)
