"""Data sets, models and hyperparameter grids of the utility benchmark.

Every task returns a :class:`Task`: train / validation / test splits (NumPy arrays), a model
factory (PyTorch), and the per-task settings (expected batch size, epochs, grids). The
validation split is carved out of the training set; tuning trains on ``train`` minus
``val`` and scores on ``val``; the final runs train on the whole training set and report the
test split, which tuning never sees.

Tasks
-----
- ``digits-logreg`` / ``digits-mlp``: scikit-learn ``load_digits`` (1,797 8×8 images),
  features ``x/16`` (data-independent scaling), 20 % stratified test split (``random_state=0``),
  softmax regression (d = 650) or a 64-32-10 tanh MLP (d = 2,410).
- ``mnist1d-mlp`` / ``mnist1d-cnn``: MNIST-1D (Greydanus 2020), regenerated locally with
  ``mnist1d.data.make_dataset(get_dataset_args())`` (4,000 train / 1,000 test, length 40); the
  paper's MLP (40-100-100-10, ReLU) and CNN (three Conv1d with 25 channels, kernel 5/3/3,
  stride 2, padding 1, ReLU, then Linear(125, 10)).
- ``lstm-users``: user-level next-word prediction on synthetic users (:func:`make_users`),
  an embedding → :class:`adaclip_torch.layers.DPLSTM` → tied softmax model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

TASKS = ("digits-logreg", "digits-mlp", "mnist1d-mlp", "mnist1d-cnn", "lstm-users")


@dataclass
class Task:
    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    val_fraction: float
    make_model: Callable[[int], nn.Module]
    batch_size: float  # expected batch size B̄ (examples, or users for user-level tasks)
    epochs: int
    quick_epochs: int
    grids: dict[str, list[dict[str, Any]]]
    quick_grids: dict[str, list[dict[str, Any]]]
    user_train: np.ndarray | None = None  # user id of each training example (user-level tasks)
    user_test: np.ndarray | None = None
    metric: str = "accuracy"
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def user_level(self) -> bool:
        return self.user_train is not None


# --------------------------------------------------------------------------- grids


def make_grids(lrs: list[float], clips: list[float], ada: list[dict[str, float]]) -> dict[str, list[dict[str, Any]]]:
    """The SAME number of configurations for every private method: ``len(lrs)·len(clips)``
    for flat / per-layer / scaled (learning rate × C) and ``len(lrs)·len(ada)`` for AdaCliP
    (learning rate × (std_min, std_max, β2)); the caller keeps ``len(ada) == len(clips)``.
    The non-private baseline tunes the learning rate only."""
    if len(ada) != len(clips):
        raise ValueError("AdaCliP must get as many configurations as the clipping methods")
    clip_grid = [{"lr": lr, "max_grad_norm": c} for lr in lrs for c in clips]
    ada_grid = [{"lr": lr, **a} for lr in lrs for a in ada]
    return {
        "nonprivate": [{"lr": lr} for lr in lrs],
        "flat": clip_grid,
        "per_layer": [dict(g) for g in clip_grid],
        "scaled": [dict(g) for g in clip_grid],
        "adaclip": ada_grid,
    }


def _ada(std_min: float, std_max: float, beta_std: float) -> dict[str, float]:
    return {"std_min": std_min, "std_max": std_max, "beta_std": beta_std}


def ada_configs(d: int, settings: list[tuple[float, float]], spread: float = 30.0) -> list[dict[str, float]]:
    """AdaCliP configurations from ``(C0, β2)`` pairs: ``s0 = C0/√d`` so that at the start
    (every s equal) AdaCliP clips like flat clipping with ``C = C0`` (b_j = s0·√d), and the
    clamp range is ``[s0/spread, s0·spread]`` (std_min·std_max = s0², the port's initialisation)."""
    out = []
    for c0, beta in settings:
        s0 = c0 / np.sqrt(d)
        out.append(_ada(float(f"{s0 / spread:.3g}"), float(f"{s0 * spread:.3g}"), beta))
    return out


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


CLIPS = [0.1, 0.3, 1.0]
ADA = [(0.1, 0.99), (0.3, 0.99), (0.3, 0.999)]  # (C0, β2): same count as CLIPS
QUICK_CLIPS = [0.3, 1.0]
QUICK_ADA = [(0.3, 0.99), (1.0, 0.99)]


def ada_grid_on_clips(flat_grid: list[dict[str, Any]], d: int, beta_std: float = 0.999) -> list[dict[str, Any]]:
    """AdaCliP on exactly flat clipping's grid: for every ``(lr, C)`` of ``flat_grid`` the
    configuration ``(lr, C0 = C)`` with a fixed ``β2`` — the same learning rates and the same
    initial clip norms, so each AdaCliP configuration starts as its flat twin."""
    return [{"lr": g["lr"], **ada_configs(d, [(g["max_grad_norm"], beta_std)])[0]} for g in flat_grid]


def standard_grids(lrs: list[float], quick_lr: float, d: int):
    return (make_grids(lrs, CLIPS, ada_configs(d, ADA)),
            make_grids([quick_lr], QUICK_CLIPS, ada_configs(d, QUICK_ADA)))


# --------------------------------------------------------------------------- models


class LogReg(nn.Module):
    def __init__(self, d_in: int, k: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_in, k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def mlp(sizes: tuple[int, ...], act: type[nn.Module]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(act())
    return nn.Sequential(*layers)


class MNIST1DCNN(nn.Module):
    """The CNN of the MNIST-1D paper (``mnist1d`` repository, ``ConvBase``)."""

    def __init__(self, channels: int = 25, k: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(1, channels, 5, stride=2, padding=1)
        self.conv2 = nn.Conv1d(channels, channels, 3, stride=2, padding=1)
        self.conv3 = nn.Conv1d(channels, channels, 3, stride=2, padding=1)
        self.linear = nn.Linear(channels * 5, k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.view(-1, 1, x.shape[-1])
        h = torch.relu(self.conv1(h))
        h = torch.relu(self.conv2(h))
        h = torch.relu(self.conv3(h))
        return self.linear(h.view(h.shape[0], -1))


class TiedLSTMLM(nn.Module):
    """Embedding (V×H) → DPLSTM(H, H) → Linear(H, V) whose weight IS the embedding matrix
    (tied by assignment, as :mod:`adaclip_torch.grad_sample` asks)."""

    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        from adaclip_torch.layers import DPLSTM

        self.embed = nn.Embedding(vocab, hidden)
        nn.init.normal_(self.embed.weight, std=0.1)
        self.lstm = DPLSTM(hidden, hidden, batch_first=True)
        self.out = nn.Linear(hidden, vocab)
        self.out.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # (n, T) -> (n, T, V)
        h, _ = self.lstm(self.embed(tokens))
        return self.out(h)


def _seeded(factory: Callable[[], nn.Module]) -> Callable[[int], nn.Module]:
    def make(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return factory()

    return make


# --------------------------------------------------------------------------- synthetic users


def make_users(
    num_users: int,
    *,
    vocab_size: int = 200,
    zipf_exponent: float = 1.1,
    num_topics: int = 8,
    topic_concentration: float = 0.3,
    sentences_per_user: int = 8,
    sentence_length: int = 12,
    successor_prob: float = 0.5,
    seed: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """Synthetic users' text for user-level next-word prediction.

    Generator (all defaults are the benchmark's):

    - vocabulary of ``vocab_size = 200`` word ids; token 0 starts every sentence;
    - ``num_topics = 8`` topics. Topic k has its own random permutation π_k of the vocabulary
      and a unigram distribution Zipf-like over it: p_k(π_k(r)) ∝ (r + 1)^(−s) with
      ``zipf_exponent s = 1.1`` (rank r = 0 the most frequent), and a random *successor
      table* S_k: word → word;
    - each user draws a topic mixture θ ~ Dirichlet(``topic_concentration = 0.3``·1) and
      writes ``sentences_per_user = 8`` sentences of ``sentence_length = 12`` tokens (the
      first is 0). Each sentence picks one topic k ~ θ; each next word is, with probability
      ``successor_prob = 0.5``, S_k(previous word), else a fresh draw from p_k.

    So a model gains over the unigram baseline by learning the successor tables and by
    inferring the topic from the sentence so far. The topic tables are fixed by
    ``seed`` (shared by all users); the users are drawn from ``seed + 1`` onwards, so train
    and test users (different ``seed`` offsets in :func:`load_task`) share the language.

    Returns ``(sentences (num_users·sentences_per_user, sentence_length) int64, user id of
    each sentence)``.
    """
    unigrams, successors = make_topic_tables(
        vocab_size=vocab_size, zipf_exponent=zipf_exponent, num_topics=num_topics, seed=seed
    )
    return _draw_users(
        num_users, unigrams, successors, topic_concentration, sentences_per_user, sentence_length,
        successor_prob, np.random.default_rng(seed + 1),
    )


def make_topic_tables(
    *, vocab_size: int = 200, zipf_exponent: float = 1.1, num_topics: int = 8, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """The language of :func:`make_users`: per topic k, the unigram distribution p_k
    (``unigrams[k]``, Zipf over the random permutation π_k, token 0 the rarest) and the
    successor table S_k (``successors[k]``), drawn from ``default_rng(seed)``."""
    lang = np.random.default_rng(seed)
    ranks = np.arange(vocab_size, dtype=np.float64)
    zipf = (ranks + 1.0) ** (-zipf_exponent)
    zipf /= zipf.sum()
    unigrams = np.zeros((num_topics, vocab_size))
    successors = np.zeros((num_topics, vocab_size), dtype=np.int64)
    for k in range(num_topics):
        perm = lang.permutation(np.arange(1, vocab_size))
        perm = np.concatenate([perm, [0]])  # token 0 (sentence start) is the rarest
        unigrams[k, perm] = zipf
        successors[k] = lang.integers(1, vocab_size, size=vocab_size)
    return unigrams, successors


def _draw_users(num_users, unigrams, successors, alpha, n_sent, length, p_succ, rng):
    num_topics, vocab = unigrams.shape
    cum = np.cumsum(unigrams, axis=1)
    sents = np.zeros((num_users * n_sent, length), dtype=np.int64)
    users = np.repeat(np.arange(num_users), n_sent)
    for u in range(num_users):
        theta = rng.dirichlet(np.full(num_topics, alpha))
        topics = rng.choice(num_topics, size=n_sent, p=theta)
        for j, k in enumerate(topics):
            row = sents[u * n_sent + j]
            fresh = np.minimum(np.searchsorted(cum[k], rng.random(length)), vocab - 1)
            succ = rng.random(length) < p_succ
            for t in range(1, length):
                row[t] = successors[k, row[t - 1]] if succ[t] else fresh[t]
    return sents, users


# --------------------------------------------------------------------------- loading


def load_task(name: str) -> Task:
    if name in ("digits-logreg", "digits-mlp"):
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        x, y = load_digits(return_X_y=True)
        x = (x / 16.0).astype(np.float32)
        x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
        if name == "digits-logreg":
            make_model = _seeded(lambda: LogReg(64, 10))
            grids, quick = standard_grids([0.5, 2.0], 1.0, n_params(make_model(0)))
        else:
            make_model = _seeded(lambda: mlp((64, 32, 10), nn.Tanh))
            grids, quick = standard_grids([0.1, 0.3], 0.2, n_params(make_model(0)))
        return Task(name, x_tr, y_tr.astype(np.int64), x_te, y_te.astype(np.int64), 0.2, make_model,
                    batch_size=64.0, epochs=20, quick_epochs=10, grids=grids, quick_grids=quick)
    if name in ("mnist1d-mlp", "mnist1d-cnn"):
        from mnist1d.data import get_dataset_args, make_dataset

        d = make_dataset(get_dataset_args())  # regenerated locally, no download
        x_tr, y_tr = d["x"].astype(np.float32), d["y"].astype(np.int64)
        x_te, y_te = d["x_test"].astype(np.float32), d["y_test"].astype(np.int64)
        if name == "mnist1d-mlp":
            make_model = _seeded(lambda: mlp((40, 100, 100, 10), nn.ReLU))
        else:
            make_model = _seeded(MNIST1DCNN)
        grids, quick = standard_grids([0.05, 0.2], 0.1, n_params(make_model(0)))
        return Task(name, x_tr, y_tr, x_te, y_te, 0.2, make_model, batch_size=128.0, epochs=30,
                    quick_epochs=5, grids=grids, quick_grids=quick)
    if name == "lstm-users":
        vocab, hidden = 200, 32
        x_tr, u_tr = make_users(1000, vocab_size=vocab, seed=0)
        # Held-out users: same language (topic tables from seed 0), new users.
        x_all, u_all = make_users(1250, vocab_size=vocab, seed=0)
        x_te, u_te = x_all[len(x_tr):], u_all[len(x_tr):]
        grids, quick = standard_grids([0.5, 2.0], 1.0, n_params(TiedLSTMLM(vocab, hidden)))
        return Task(name, x_tr, x_tr, x_te, x_te, 0.2, _seeded(lambda: TiedLSTMLM(vocab, hidden)),
                    batch_size=50.0, epochs=20, quick_epochs=4, grids=grids, quick_grids=quick,
                    user_train=u_tr, user_test=u_te, metric="next-word accuracy",
                    extra={"vocab": vocab, "hidden": hidden})
    raise ValueError(f"unknown task {name!r}; choose from {TASKS}")


def split_validation(task: Task, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Indices (train_sub, val) of the training set; by user for user-level tasks."""
    rng = np.random.default_rng(1234 + seed)
    if task.user_level:
        users = np.unique(task.user_train)
        val_users = rng.choice(users, size=int(round(task.val_fraction * len(users))), replace=False)
        is_val = np.isin(task.user_train, val_users)
    else:
        n = len(task.y_train)
        is_val = np.zeros(n, dtype=bool)
        is_val[rng.choice(n, size=int(round(task.val_fraction * n)), replace=False)] = True
    return np.flatnonzero(~is_val), np.flatnonzero(is_val)
