"""The per-sample-gradient hooks must not keep anything alive through the autograd graph.

Hooks registered on a tensor live in the autograd graph, which is C++ that Python's garbage
collector cannot traverse. A hook closure that holds (directly or through
``register_multi_grad_hook``'s own closure) the output's ``grad_fn``, the hooks object or the
module forms a cycle the collector never breaks: each step's activations, and after training the
model itself, stayed in memory (a hyperparameter sweep in one process grew by gigabytes). The
registry of attached hooks must not hold the model either (through ``hooks.model``): a sweep
seldom calls ``remove_hooks()``.
"""

from __future__ import annotations

import gc
import weakref

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from adaclip.strategies import FlatClipping  # noqa: E402
from adaclip_torch import DPOptimizer  # noqa: E402


def _hook_closures() -> int:
    return sum(1 for o in gc.get_objects() if callable(o) and getattr(o, "__name__", "") == "on_grads")


def _train(model: nn.Module, steps: int, shape: tuple[int, ...]) -> DPOptimizer:
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, strategy=FlatClipping(1.0),
                      noise_multiplier=1.0, expected_batch_size=16.0, seed=0)  # fmt: skip
    for _ in range(steps):
        x, y = torch.randn(16, *shape), torch.randint(0, 3, (16,))
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return opt


class _Sequence(nn.Module):  # an LSTM: per-sample gradients from the torch.func fallback
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(4, 8, batch_first=True)
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.lstm(x)[0][:, -1])


@pytest.mark.parametrize("remove_hooks", [True, False], ids=["remove_hooks", "dropped"])
@pytest.mark.parametrize(
    "make, shape",
    [(lambda: nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3)), (6,)), (_Sequence, (5, 4))],
    ids=["rules", "fallback"],
)
def test_the_model_is_freed_once_training_is_over(make, shape, remove_hooks):
    model = make()
    opt = _train(model, steps=4, shape=shape)
    if remove_hooks:
        opt.remove_hooks()
    alive = weakref.ref(model)
    del model, opt
    gc.collect()
    assert alive() is None


@pytest.mark.parametrize(
    "make, shape",
    [(lambda: nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3)), (6,)), (_Sequence, (5, 4))],
    ids=["rules", "fallback"],
)
def test_hooks_of_past_steps_are_freed(make, shape):
    gc.collect()
    before = _hook_closures()
    model = make()
    opt = _train(model, steps=12, shape=shape)
    gc.collect()
    # at most one pending hook per module (none after a completed backward)
    assert _hook_closures() - before <= len(list(model.modules()))
    opt.remove_hooks()
