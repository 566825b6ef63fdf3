"""Federated tasks of the Flower benchmark: public pretraining, then user-level private
fine-tuning on users whose data distribution differs from the public one.

Every task is a :class:`FederatedTask`: a seeded model factory, the loss, each training user's
data (``user_data(k)``), a public set (for pretraining and for rehearsal), a validation set
drawn from *held-out users* (for tuning), and two test sets — one from the users' distribution
(``test_user``) and one from the public distribution (``test_public``) — touched only for the
final report.

Tasks
-----
- ``lm-users``: next-word prediction on the synthetic language of
  ``benchmarks/utility/utility_tasks.make_users`` (200-word vocabulary, 8 topics, each with a
  Zipf unigram table and a successor table; the tables come from ``make_topic_tables(seed=0)``).
  The public corpus uses topics 0–3 (mixtures Dirichlet(1.0) over those topics, 8 000
  sentences); the users use topics 4–7 (mixtures Dirichlet(0.3), as ``make_users``), so the
  vocabulary and the way the language is generated are shared but the users' topics (word
  frequencies, successor tables) are new. Default 1 000 training users × 8 sentences of 12
  tokens; 200 validation users, 250 test users, 2 000 public test sentences. Model: Embedding
  200×32 → LSTM(32, 64) → Linear(64, 200); loss: cross-entropy of the next token over positions
  1..T−1; metric: next-word top-1 accuracy over the same positions.
- ``mnist1d-shift``: MNIST-1D (Greydanus 2020) regenerated locally with
  ``mnist1d.data.make_dataset`` (``num_samples = 10 000``: 8 000 train / 2 000 test). Half of
  the training split (4 000, original features) is public; the other half is the users' pool,
  whose 40 features are permuted by one fixed random permutation (the shifted distribution).
  Default 400 training users × 5 examples, non-IID by label skew (each user's labels follow its
  own Dirichlet(1.0) class mixture); 80 validation users × 5 from the rest of the pool. Test:
  1 000 test examples with original features (``test_public``) and the other 1 000 permuted
  (``test_user``). Model: MLP 40-100-100-10 (ReLU); metric: accuracy.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

_UTILITY = Path(__file__).resolve().parent.parent / "utility"
if str(_UTILITY) not in sys.path:
    sys.path.insert(0, str(_UTILITY))

from utility_tasks import _draw_users, make_topic_tables  # noqa: E402

TASK_NAMES = ("lm-users", "mnist1d-shift")

Tensors = tuple[torch.Tensor, torch.Tensor]


@dataclass
class FederatedTask:
    name: str
    num_users: int
    make_model: Callable[[int], nn.Module]  # seed -> freshly initialised model
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    user_data: Callable[[int], Tensors]  # training user k -> (x, y)
    public: Tensors
    test_user: Tensors
    test_public: Tensors
    val_user: Tensors
    metric_name: str
    metric_fn: Callable[[torch.Tensor, torch.Tensor], float] = field(repr=False, default=None)  # (outputs, y)
    examples_per_user: int = 0
    pretrain_defaults: dict[str, Any] = field(default_factory=dict)  # epochs, batch_size, learning_rate

    @torch.no_grad()
    def metric(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 1024) -> float:
        """The task's quality metric (higher is better) of ``model`` on ``(x, y)``."""
        was_training = model.training
        model.eval()
        outs = [model(x[i:i + batch_size]) for i in range(0, len(x), batch_size)]
        model.train(was_training)
        return float(self.metric_fn(torch.cat(outs), y))

    @torch.no_grad()
    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 1024) -> float:
        was_training = model.training
        model.eval()
        total = 0.0
        for i in range(0, len(x), batch_size):
            total += float(self.loss_fn(model(x[i:i + batch_size]), y[i:i + batch_size])) * len(x[i:i + batch_size])
        model.train(was_training)
        return total / len(x)


def _seeded(factory: Callable[[], nn.Module]) -> Callable[[int], nn.Module]:
    def make(seed: int = 0) -> nn.Module:
        torch.manual_seed(seed)
        return factory()

    return make


# --------------------------------------------------------------------------- lm-users


class LSTMLM(nn.Module):
    """Embedding (V×E) → LSTM(E, H) → Linear(H, V); tokens (n, T) → logits (n, T, V)."""

    def __init__(self, vocab: int = 200, embed: int = 32, hidden: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, embed)
        self.lstm = nn.LSTM(embed, hidden, batch_first=True)
        self.out = nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h, _ = self.lstm(self.embed(tokens))
        return self.out(h)


def next_token_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of token t given tokens < t, over t = 1..T−1."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def next_token_accuracy(logits: torch.Tensor, tokens: torch.Tensor) -> float:
    return float((logits[:, :-1].argmax(-1) == tokens[:, 1:]).float().mean())


def _lm_users(num_users: int) -> FederatedTask:
    vocab, n_sent, length, p_succ = 200, 8, 12, 0.5
    unigrams, successors = make_topic_tables(vocab_size=vocab, num_topics=8, seed=0)
    pub_u, pub_s = unigrams[:4], successors[:4]
    usr_u, usr_s = unigrams[4:], successors[4:]

    def draw(n_users: int, shifted: bool, alpha: float, seed: int) -> np.ndarray:
        u, s = (usr_u, usr_s) if shifted else (pub_u, pub_s)
        sents, _ = _draw_users(n_users, u, s, alpha, n_sent, length, p_succ, np.random.default_rng(seed))
        return sents

    train = torch.from_numpy(draw(num_users, True, 0.3, 101))
    val = torch.from_numpy(draw(200, True, 0.3, 102))
    test_user = torch.from_numpy(draw(250, True, 0.3, 103))
    public = torch.from_numpy(draw(1000, False, 1.0, 104))
    test_public = torch.from_numpy(draw(250, False, 1.0, 105))

    def user_data(user: int) -> Tensors:
        if not 0 <= user < num_users:
            raise IndexError(f"user {user} out of range [0, {num_users})")
        x = train[user * n_sent:(user + 1) * n_sent]
        return x, x

    return FederatedTask(
        name="lm-users", num_users=num_users, make_model=_seeded(lambda: LSTMLM(vocab, 32, 64)),
        loss_fn=next_token_loss, user_data=user_data, public=(public, public),
        test_user=(test_user, test_user), test_public=(test_public, test_public), val_user=(val, val),
        metric_name="next-word accuracy", metric_fn=next_token_accuracy, examples_per_user=n_sent,
        pretrain_defaults={"epochs": 10, "batch_size": 64, "learning_rate": 3e-3},
    )


# --------------------------------------------------------------------------- mnist1d-shift


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(40, 100), nn.ReLU(), nn.Linear(100, 100), nn.ReLU(), nn.Linear(100, 10))


def accuracy(logits: torch.Tensor, y: torch.Tensor) -> float:
    return float((logits.argmax(-1) == y).float().mean())


_MNIST1D_CACHE: dict[str, Any] = {}


def _mnist1d() -> dict[str, np.ndarray]:
    if "data" not in _MNIST1D_CACHE:
        from mnist1d.data import get_dataset_args, make_dataset

        args = get_dataset_args()
        args.num_samples = 10_000
        _MNIST1D_CACHE["data"] = make_dataset(args)  # regenerated locally, no download
    return _MNIST1D_CACHE["data"]


def _label_skew_users(labels: np.ndarray, pool: np.ndarray, n_users: int, per_user: int, alpha: float,
                      rng: np.random.Generator) -> list[np.ndarray]:
    """Assign ``per_user`` pool indices to each of ``n_users`` users: each user draws a class
    mixture θ ~ Dirichlet(α) and each of its examples a class ~ θ (renormalised over the classes
    with examples left), taken without replacement from that class's shuffled queue."""
    classes = np.unique(labels[pool])
    queues = {c: list(rng.permutation(pool[labels[pool] == c])) for c in classes}
    users = []
    for _ in range(n_users):
        theta = rng.dirichlet(np.full(len(classes), alpha))
        picked = []
        for _ in range(per_user):
            avail = np.array([len(queues[c]) > 0 for c in classes])
            if not avail.any():
                raise ValueError("the pool is too small for that many users")
            p = theta * avail
            p = p / p.sum() if p.sum() > 0 else avail / avail.sum()
            c = classes[rng.choice(len(classes), p=p)]
            picked.append(queues[c].pop())
        users.append(np.array(picked))
    return users


def _mnist1d_shift(num_users: int) -> FederatedTask:
    per_user, n_val_users = 5, 80
    d = _mnist1d()
    x_tr, y_tr = d["x"].astype(np.float32), d["y"].astype(np.int64)
    x_te, y_te = d["x_test"].astype(np.float32), d["y_test"].astype(np.int64)
    rng = np.random.default_rng(0)
    order = rng.permutation(len(x_tr))
    half = len(x_tr) // 2
    pub_idx, pool = order[:half], order[half:]
    if (num_users + n_val_users) * per_user > len(pool):
        raise ValueError(f"mnist1d-shift supports at most {len(pool) // per_user - n_val_users} users")
    perm = np.random.default_rng(1).permutation(x_tr.shape[1])  # the fixed feature permutation
    users = _label_skew_users(y_tr, pool, num_users + n_val_users, per_user, 1.0, np.random.default_rng(2))
    train_users, val_users = users[:num_users], users[num_users:]
    xs = torch.from_numpy(x_tr[:, perm].copy())
    ys = torch.from_numpy(y_tr)
    user_x = [xs[idx] for idx in train_users]
    user_y = [ys[idx] for idx in train_users]
    val_idx = np.concatenate(val_users)
    te_order = np.random.default_rng(3).permutation(len(x_te))
    te_pub, te_usr = te_order[: len(x_te) // 2], te_order[len(x_te) // 2:]

    def user_data(user: int) -> Tensors:
        return user_x[user], user_y[user]

    return FederatedTask(
        name="mnist1d-shift", num_users=num_users, make_model=_seeded(_mlp), loss_fn=F.cross_entropy,
        user_data=user_data, public=(torch.from_numpy(x_tr[pub_idx]), torch.from_numpy(y_tr[pub_idx])),
        test_user=(torch.from_numpy(x_te[te_usr][:, perm].copy()), torch.from_numpy(y_te[te_usr])),
        test_public=(torch.from_numpy(x_te[te_pub]), torch.from_numpy(y_te[te_pub])),
        val_user=(xs[val_idx], ys[val_idx]), metric_name="accuracy", metric_fn=accuracy,
        examples_per_user=per_user,
        pretrain_defaults={"epochs": 40, "batch_size": 64, "learning_rate": 3e-3},
    )


# --------------------------------------------------------------------------- API


def load_federated_task(name: str, *, num_users: int | None = None) -> FederatedTask:
    """The task ``name`` (``"lm-users"`` or ``"mnist1d-shift"``) with ``num_users`` training
    users (default 1 000 and 400). Deterministic: the same call gives the same data."""
    if name == "lm-users":
        return _lm_users(1000 if num_users is None else int(num_users))
    if name == "mnist1d-shift":
        return _mnist1d_shift(400 if num_users is None else int(num_users))
    raise ValueError(f"unknown task {name!r}; choose from {TASK_NAMES}")


def pretrain(task: FederatedTask, model: nn.Module, *, epochs: int, batch_size: int, learning_rate: float,
             seed: int) -> nn.Module:
    """Non-private pretraining on ``task.public``: Adam, ``epochs`` passes of shuffled
    minibatches (shuffling seeded by ``seed``). Trains ``model`` in place and returns it."""
    x, y = task.public
    gen = torch.Generator().manual_seed(int(seed))
    opt = torch.optim.Adam(model.parameters(), lr=learning_rate)
    model.train()
    for _ in range(int(epochs)):
        order = torch.randperm(len(x), generator=gen)
        for i in range(0, len(x), int(batch_size)):
            idx = order[i:i + int(batch_size)]
            opt.zero_grad()
            task.loss_fn(model(x[idx]), y[idx]).backward()
            opt.step()
    model.eval()
    return model


# --------------------------------------------------------------------------- Flower client

_LOADED: dict[tuple[str, int], FederatedTask] = {}


def cached_task(name: str, num_users: int) -> FederatedTask:
    """:func:`load_federated_task`, memoised per process (each simulation worker loads once)."""
    key = (name, int(num_users))
    if key not in _LOADED:
        _LOADED[key] = load_federated_task(name, num_users=num_users)
    return _LOADED[key]


def configurable_client_app():
    """A Flower ``ClientApp`` whose local training is read from the train message's config:
    ``task``, ``num-users``, ``epochs``, ``batch-size``, ``client-lr``, ``rehearsal`` (ρ) and
    ``seed``; the node's ``partition-id`` is the user. It runs
    :func:`adaclip_flower.torch_client.train_locally` (the same local SGD and random rehearsal
    as :func:`adaclip_flower.torch_client.client_app`), so one simulation can run many
    configurations. Replies with the trained model and ``num-examples`` = the user's own count."""
    from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp

    from adaclip_flower.torch_client import load_model_arrays, train_locally

    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        (key, arrays), = msg.content.array_records.items()
        cfg = next(iter(msg.content.config_records.values()))
        task = cached_task(str(cfg["task"]), int(cfg["num-users"]))
        model = task.make_model(0)
        load_model_arrays(model, arrays)
        user = int(context.node_config["partition-id"])
        x, y = task.user_data(user)
        rho = float(cfg["rehearsal"])
        gen = torch.Generator().manual_seed((int(cfg["seed"]) * 1_000_003 + user) * 1_000_003 + int(cfg["server-round"]))
        batch = int(cfg["batch-size"]) if int(cfg["batch-size"]) > 0 else 10**9  # <= 0: the whole data
        train_locally(model, x, y, epochs=int(cfg["epochs"]), batch_size=batch, learning_rate=float(cfg["client-lr"]),
                      loss_fn=task.loss_fn, public=task.public if rho > 0 else None, rehearsal_fraction=rho,
                      generator=gen)
        reply = RecordDict({key: ArrayRecord(model.state_dict()), "metrics": MetricRecord({"num-examples": len(x)})})
        return Message(content=reply, reply_to=msg)

    return app


__all__ = ["FederatedTask", "TASK_NAMES", "load_federated_task", "pretrain", "LSTMLM", "next_token_loss", "cached_task",
           "configurable_client_app"]
