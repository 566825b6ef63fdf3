"""What the server and the clients share: the data, the model, and how the run's settings
build the strategy and the client app.

**Data.** scikit-learn's digits (1,797 images of 8×8 pixels, values 0–16; shipped with
scikit-learn, nothing is downloaded). A fixed permutation (seed 0, drawn without looking at the
data) holds out 360 images as the server's test set and deals the other 1,437 out to the users
round-robin: user ``k`` holds images ``k, k + U, k + 2U, …`` of the permuted training part.
Pixels are divided by 16, their known range: no statistic of anyone's data is computed.

**Model.** Softmax regression (one ``Linear(64, 10)``: 650 parameters), randomly initialised:
before training it is at chance (about 0.1).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.serverapp.strategy import FedAvgM

from adaclip import AdaptiveClipping, FlatClipping
from adaclip.accounting import Accountant, calibrate_noise_multiplier
from adaclip_flower import ServerSideClipping
from adaclip_flower.torch_client import client_app
from dp_fedavg.settings import DEFAULTS, NUM_TEST, settings

__all__ = ["DEFAULTS", "settings", "digits", "user_data", "make_model", "accuracy", "build_strategy",
           "build_client_app"]


def _load_digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits, ``load_digits(return_X_y=True)``. Read from the CSV file that
    scikit-learn ships (the file ``load_digits`` reads) when it is where scikit-learn keeps it:
    importing scikit-learn would cost every simulated client process seconds."""
    spec = importlib.util.find_spec("sklearn")
    if spec is not None and spec.submodule_search_locations:
        path = Path(next(iter(spec.submodule_search_locations))) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            data = np.loadtxt(path, delimiter=",")
            return data[:, :-1], data[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits

    return load_digits(return_X_y=True)


@lru_cache(maxsize=1)
def digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x_train, y_train, x_test, y_test)``: the permuted digits, pixels scaled to [0, 1]."""
    x, y = _load_digits()
    order = np.random.default_rng(0).permutation(len(x))
    x = torch.tensor(x[order] / 16.0, dtype=torch.float32)
    y = torch.tensor(y[order], dtype=torch.int64)
    return x[NUM_TEST:], y[NUM_TEST:], x[:NUM_TEST], y[:NUM_TEST]


def user_data(user: int, num_users: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The digits of user ``user`` of ``num_users``."""
    x, y, _, _ = digits()
    if num_users > len(x):
        raise ValueError(f"{num_users} users, but only {len(x)} training digits to deal out")
    if not 0 <= user < num_users:
        raise ValueError(f"this node's partition-id {user} is not a user of {num_users}: give the federation "
                         "num-users SuperNodes")
    return x[user::num_users], y[user::num_users]


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(64, 10)


def accuracy(model: torch.nn.Module) -> float:
    """Accuracy on the server's held-out test digits (none of them is a user's)."""
    _, _, x, y = digits()
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def build_strategy(cfg: Mapping[str, Any], num_params: int) -> ServerSideClipping:
    """``ServerSideClipping`` around ``FedAvgM`` (the server optimizer), with σ calibrated so
    that the planned rounds spend the target user-level ε, and an accountant whose budget
    refuses any round beyond it."""
    num_users = int(cfg["num-users"])
    q = float(cfg["users-per-round"]) / num_users
    epsilon, delta = float(cfg["epsilon"]), float(cfg["delta"])
    sigma = calibrate_noise_multiplier(target_epsilon=epsilon, delta=delta, sample_rate=q,
                                       steps=int(cfg["num-server-rounds"]))
    clip = float(cfg["clip-norm"])
    if cfg["clipping"] == "adaclip":
        clipping = AdaptiveClipping.from_initial_clip(clip, num_params=num_params)
    elif cfg["clipping"] == "flat":
        clipping = FlatClipping(max_grad_norm=clip)
    else:
        raise ValueError(f"clipping must be 'flat' or 'adaclip', got {cfg['clipping']!r}")
    return ServerSideClipping(
        FedAvgM(server_learning_rate=float(cfg["server-lr"]), server_momentum=float(cfg["server-momentum"])),
        clipping=clipping, noise_multiplier=sigma, sample_rate=q, num_users=num_users,
        accountant=Accountant(target_epsilon=epsilon, delta=delta), seed=int(cfg["seed"]),
    )


def build_client_app(cfg: Mapping[str, Any]):
    """The clients: E epochs of local SGD from the global model on the node's user (its
    ``partition-id``); the reply is the trained model, which the server clips and noises."""
    num_users = int(cfg["num-users"])
    seed = int(cfg["seed"])
    return client_app(lambda: make_model(seed), lambda ctx: user_data(int(ctx.node_config["partition-id"]), num_users),
                      epochs=int(cfg["epochs"]), batch_size=int(cfg["batch-size"]),
                      learning_rate=float(cfg["client-lr"]), seed=seed)
