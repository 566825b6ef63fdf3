"""Shared helpers of the torch-optimizer tests (no tests here).

``microbatch_grad_sample`` is the slow, obviously-correct per-example gradient: one backward
per example. The tests compare the wrapper (fed either by it or by the real grad-sample
engine) against :mod:`adaclip.reference` on flattened vectors.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn


def engine_available() -> bool:
    try:
        from adaclip_torch.grad_sample import GradSampleHooks  # noqa: F401
    except ImportError:
        return False
    return True


def microbatch_per_example(model: nn.Module, params, loss_fn, x, y) -> list[torch.Tensor]:
    """``[(n, *p.shape)]``: gradient of each example's own loss, one backward per example."""
    rows: list[list[torch.Tensor]] = [[] for _ in params]
    for i in range(x.shape[0]):
        loss = loss_fn(model(x[i : i + 1]), y[i : i + 1])
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        for k, (p, g) in enumerate(zip(params, grads)):
            rows[k].append(torch.zeros_like(p) if g is None else g.detach())
    return [
        torch.stack(r) if r else torch.zeros((0, *p.shape), dtype=p.dtype) for r, p in zip(rows, params)
    ]


def set_microbatch_grad_sample(model: nn.Module, params, loss_fn, x, y) -> list[torch.Tensor]:
    """Test double of the grad-sample engine: sets ``p.grad_sample`` and a batch ``p.grad``."""
    per_example = microbatch_per_example(model, params, loss_fn, x, y)
    for p, g in zip(params, per_example):
        p.grad_sample = g
        p.grad = g.mean(0) if g.shape[0] else torch.zeros_like(p)
    return per_example


def flat(per_example: list[torch.Tensor]) -> np.ndarray:
    """``(n, d)`` float64 from per-tensor ``(n, *shape)`` tensors, in parameter order."""
    n = per_example[0].shape[0]
    return np.concatenate([g.detach().double().reshape(n, -1).numpy() for g in per_example], axis=1)


def flat_vec(tensors) -> np.ndarray:
    return np.concatenate([t.detach().double().reshape(-1).numpy() for t in tensors])


def mlp(seed: int = 0, dtype=torch.float64, d_in: int = 6, hidden: int = 5, d_out: int = 3) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), nn.Linear(hidden, d_out)).to(dtype)


def batch(seed: int, n: int = 8, dtype=torch.float64, d_in: int = 6, d_out: int = 3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=g, dtype=dtype)
    y = torch.randint(0, d_out, (n,), generator=g)
    return x, y


class FakeAccountant:
    """Minimal accountant double: budget = a maximum number of steps."""

    def __init__(self, max_steps: int):
        self.max_steps = max_steps
        self.history: list[tuple[float, float]] = []

    def would_exceed(self, *, noise_multiplier, sample_rate, num_steps=1):
        return len(self.history) + num_steps > self.max_steps

    def step(self, *, noise_multiplier, sample_rate, num_steps=1):
        self.history.extend([(noise_multiplier, sample_rate)] * num_steps)

    def state_dict(self):
        return {"history": list(self.history), "max_steps": self.max_steps}

    def load_state_dict(self, d):
        self.history = list(d["history"])
        self.max_steps = d["max_steps"]
