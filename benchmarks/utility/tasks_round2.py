"""Round-two tasks of the utility benchmark: settings closer to DP practice.

Every task is a :class:`utility_tasks.Task` built from data a package ships or that we
generate (nothing is downloaded at run time). The validation split is carved out of the
training set as for the first five tasks; the test split is only read by the final runs.

- ``raw-digits-mlp`` (**heterogeneous feature scales**): ``load_digits`` with each pixel
  multiplied by a fixed scale ``10^u``, ``u ~ Uniform(−1.5, 1.5)`` drawn once from
  ``default_rng(0)`` (data-independent, so public): input scales span three orders of
  magnitude, as raw features do when nobody standardises them (standardisation fitted on the
  private data would itself have to be privatised). 64-32-10 tanh MLP, B̄ = 64, 20 epochs.
- ``mnist1d-finetune`` / ``mnist1d-finetune-head`` (**public pretraining → private
  fine-tuning**): the 40-100-100-10 MLP is pretrained without privacy on the standard MNIST-1D
  set (the public task: 4,000 examples, seed 42) and fine-tuned privately on a *shifted*
  private set (seed 7, 2.5× the i.i.d. noise, 1.4× the correlated noise, 1.2× the shear;
  4,000 train / 1,000 test). The public model scores 59.7 % on its own test split and 45.0 %
  on the private one before fine-tuning. ``-head`` trains the last layer only (1,010 parameters);
  the full variant all 15,210. B̄ = 128, 10 epochs.
- ``transformer-lm`` / ``transformer-users`` (**a small transformer**): next-word prediction
  on the synthetic users' language of :func:`utility_tasks.make_users` (vocabulary 200,
  sentences of 12 tokens) with a one-block pre-LayerNorm causal transformer (token and
  position embeddings, two-head self-attention of Linear projections, a 32-64-32 GELU MLP,
  final LayerNorm, tied output; d = 15,592). Example level (``-lm``, the unit is a sentence:
  2,000 users' 16,000 sentences, B̄ = 256, 5 epochs) and user level (``-users``, the unit is a
  user with 8 sentences: 4,000 users, B̄ = 100 users, 5 epochs).
- ``lstm-users-many`` (**user-level LSTM at many users**): :class:`utility_tasks.TiedLSTMLM`
  on 8,000 synthetic users (the first round's task had 1,000), B̄ = 200 users, 5 epochs, so
  κ = 0.48·d·σ²/B̄² is below 1 at every ε measured.
- ``mnist1d-long`` (**a long run**): MNIST-1D regenerated with 62,500 examples (seed 11; 50,000
  train / 12,500 test), the paper's MLP, B̄ = 256, 10 epochs: about 2,000 steps.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch
from torch import nn
from utility_tasks import Task, TiedLSTMLM, _seeded, make_users, mlp

ROUND2_TASKS = (
    "raw-digits-mlp",
    "mnist1d-finetune",
    "mnist1d-finetune-head",
    "transformer-lm",
    "transformer-users",
    "lstm-users-many",
    "mnist1d-long",
)

RAW_SCALE_DECADES = 1.5  # u ~ Uniform(−1.5, 1.5): pixel scales 10^u span 10³
PRIVATE_SHIFT = {"seed": 7, "iid_noise_scale": 0.05, "corr_noise_scale": 0.35, "shear_scale": 0.9}


# --------------------------------------------------------------------------- models


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention from ``nn.Linear`` projections (each Linear gets its
    per-example gradients from the registered rule; ``nn.MultiheadAttention`` would need the
    slower functional fallback)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        if width % heads:
            raise ValueError("width must be a multiple of heads")
        self.heads = heads
        self.query = nn.Linear(width, width)
        self.key = nn.Linear(width, width)
        self.value = nn.Linear(width, width)
        self.out = nn.Linear(width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # (n, T, W)
        n, t, w = h.shape
        split = (n, t, self.heads, w // self.heads)
        q = self.query(h).view(split).transpose(1, 2)
        k = self.key(h).view(split).transpose(1, 2)
        v = self.value(h).view(split).transpose(1, 2)
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(a.transpose(1, 2).reshape(n, t, w))


class TinyTransformerLM(nn.Module):
    """One pre-LayerNorm transformer block: tokens (n, T) → logits (n, T, V), output tied to
    the token embedding (by assignment, as for :class:`utility_tasks.TiedLSTMLM`)."""

    def __init__(self, vocab: int, length: int, width: int = 32, heads: int = 2, hidden: int = 64) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(length, width)
        nn.init.normal_(self.tokens.weight, std=0.1)
        nn.init.normal_(self.positions.weight, std=0.1)
        self.norm1 = nn.LayerNorm(width)
        self.attention = CausalSelfAttention(width, heads)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))
        self.norm_out = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)
        self.head.weight = self.tokens.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n, t = tokens.shape
        pos = torch.arange(t, device=tokens.device).expand(n, t)
        h = self.tokens(tokens) + self.positions(pos)
        h = h + self.attention(self.norm1(h))
        h = h + self.mlp(self.norm2(h))
        return self.head(self.norm_out(h))


# --------------------------------------------------------------------------- data


@functools.cache
def _mnist1d(num_samples: int = 5000, **overrides: Any) -> tuple[np.ndarray, ...]:
    from mnist1d.data import get_dataset_args, make_dataset

    args = get_dataset_args()
    args.num_samples = num_samples
    for k, v in overrides.items():
        setattr(args, k, v)
    d = make_dataset(args)  # regenerated locally, no download
    return (d["x"].astype(np.float32), d["y"].astype(np.int64), d["x_test"].astype(np.float32),
            d["y_test"].astype(np.int64))  # fmt: skip


def raw_pixel_scales(num_features: int = 64) -> np.ndarray:
    """The fixed, data-independent per-pixel scales of ``raw-digits-mlp``."""
    u = np.random.default_rng(0).uniform(-RAW_SCALE_DECADES, RAW_SCALE_DECADES, size=num_features)
    return (10.0**u).astype(np.float32)


@functools.cache
def pretrained_mnist1d_mlp(epochs: int = 30, lr: float = 1e-3, seed: int = 0) -> dict[str, torch.Tensor]:
    """The public model: the MLP trained without privacy on the standard MNIST-1D set (Adam,
    batch 128). Public data, so no privacy cost; deterministic in ``seed``."""
    x, y, _, _ = _mnist1d()
    torch.manual_seed(seed)
    model = mlp((40, 100, 100, 10), nn.ReLU)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    xt, yt = torch.as_tensor(x), torch.as_tensor(y)
    g = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        perm = torch.randperm(len(xt), generator=g)
        for i in range(0, len(xt), 128):
            idx = perm[i : i + 128]
            opt.zero_grad()
            nn.functional.cross_entropy(model(xt[idx]), yt[idx]).backward()
            opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _finetune_model(head_only: bool):
    def make(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        model = mlp((40, 100, 100, 10), nn.ReLU)
        model.load_state_dict(pretrained_mnist1d_mlp())
        if head_only:
            for p in list(model.parameters())[:-2]:
                p.requires_grad_(False)
        return model

    return make


def load_round2_task(name: str) -> Task:
    """The :class:`Task` of a round-two task (grids are set by the round-two driver)."""
    common: dict[str, Any] = {"grids": {}, "quick_grids": {}}
    if name == "raw-digits-mlp":
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        x, y = load_digits(return_X_y=True)
        x = (x / 16.0 * raw_pixel_scales()).astype(np.float32)
        x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
        return Task(name, x_tr, y_tr.astype(np.int64), x_te, y_te.astype(np.int64), 0.2,
                    _seeded(lambda: mlp((64, 32, 10), nn.Tanh)), batch_size=64.0, epochs=20, quick_epochs=4,
                    extra={"scales": "10^U(-1.5, 1.5) per pixel, default_rng(0)"}, **common)  # fmt: skip
    if name in ("mnist1d-finetune", "mnist1d-finetune-head"):
        x_tr, y_tr, x_te, y_te = _mnist1d(**PRIVATE_SHIFT)
        return Task(name, x_tr, y_tr, x_te, y_te, 0.2, _finetune_model(name.endswith("-head")), batch_size=128.0,
                    epochs=10, quick_epochs=2, extra={"private_shift": dict(PRIVATE_SHIFT)}, **common)  # fmt: skip
    if name == "mnist1d-long":
        x_tr, y_tr, x_te, y_te = _mnist1d(num_samples=62500, seed=11)
        return Task(name, x_tr, y_tr, x_te, y_te, 0.2, _seeded(lambda: mlp((40, 100, 100, 10), nn.ReLU)),
                    batch_size=256.0, epochs=10, quick_epochs=1, **common)  # fmt: skip
    if name in ("transformer-lm", "transformer-users", "lstm-users-many"):
        vocab, length = 200, 12
        users = {"transformer-lm": 2000, "transformer-users": 4000, "lstm-users-many": 8000}[name]
        held_out = users // 8
        x_all, u_all = make_users(users + held_out, vocab_size=vocab, seed=0)
        cut = users * 8
        x_tr, u_tr, x_te, u_te = x_all[:cut], u_all[:cut], x_all[cut:], u_all[cut:]
        if name == "lstm-users-many":
            factory = _seeded(lambda: TiedLSTMLM(vocab, 32))
        else:
            factory = _seeded(lambda: TinyTransformerLM(vocab, length))
        extra = {"vocab": vocab, "hidden": 32}
        if name == "transformer-lm":  # example level: every sentence is a unit
            return Task(name, x_tr, x_tr, x_te, x_te, 0.2, factory, batch_size=256.0, epochs=5, quick_epochs=1,
                        metric="next-word accuracy", extra={**extra, "lm": True}, **common)  # fmt: skip
        return Task(name, x_tr, x_tr, x_te, x_te, 0.2, factory, batch_size=100.0 if name == "transformer-users" else 200.0,
                    epochs=5, quick_epochs=1,
                    user_train=u_tr, user_test=u_te, metric="next-word accuracy", extra=extra, **common)  # fmt: skip
    raise ValueError(f"unknown round-two task {name!r}; choose from {ROUND2_TASKS}")

