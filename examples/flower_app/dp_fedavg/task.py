"""What the server and the clients share: the task, the run's settings and how they build the
strategy and the client app. ``examples/flower_dp_fedavg.py`` calls the same functions."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flwr.serverapp.strategy import FedAvgM

from adaclip import AdaptiveClipping, FlatClipping
from adaclip.accounting import Accountant, calibrate_noise_multiplier
from adaclip_flower import ServerSideClipping
from adaclip_flower.torch_client import client_app

#: The run's settings and their defaults (those of ``pyproject.toml``).
DEFAULTS: dict[str, Any] = {
    "num-users": 1000, "users-per-round": 20.0, "num-server-rounds": 50, "epsilon": 3.0, "delta": 1e-5,
    "clipping": "flat", "clip-norm": 0.0, "client-lr": 1.0, "epochs": 2, "batch-size": 4, "rehearsal": 0.0,
    "server-lr": 1.0, "server-momentum": 0.0, "seed": 0,
}

_TASKS: dict[int, Any] = {}


def settings(run_config: Mapping[str, Any]) -> dict[str, Any]:
    """The defaults overridden by the run config."""
    out = dict(DEFAULTS)
    out.update({k: v for k, v in run_config.items() if k in DEFAULTS})
    return out


def task(num_users: int):
    """The ``lm-users`` task (loaded once per process)."""
    if num_users not in _TASKS:
        from fed_tasks import load_federated_task  # benchmarks/federated, on PYTHONPATH

        _TASKS[num_users] = load_federated_task("lm-users", num_users=num_users)
    return _TASKS[num_users]


def pretrained_model(cfg: Mapping[str, Any]):
    """The model pretrained (non-privately) on the public corpus."""
    from fed_tasks import pretrain

    t = task(int(cfg["num-users"]))
    return pretrain(t, t.make_model(int(cfg["seed"])), seed=int(cfg["seed"]), **t.pretrain_defaults)


def build_strategy(cfg: Mapping[str, Any], num_params: int) -> tuple[ServerSideClipping, float]:
    """``ServerSideClipping`` around ``FedAvgM`` with σ calibrated for the target ε over the
    planned rounds, and an accountant whose budget refuses any round beyond it."""
    q = float(cfg["users-per-round"]) / int(cfg["num-users"])
    sigma = calibrate_noise_multiplier(target_epsilon=float(cfg["epsilon"]), delta=float(cfg["delta"]),
                                       sample_rate=q, steps=int(cfg["num-server-rounds"]))
    adaclip = cfg["clipping"] == "adaclip"
    clip = float(cfg["clip-norm"]) or (0.1 if adaclip else 0.4)
    clipping = AdaptiveClipping.from_initial_clip(clip, num_params=num_params) if adaclip else FlatClipping(
        max_grad_norm=clip)
    strategy = ServerSideClipping(
        FedAvgM(server_learning_rate=float(cfg["server-lr"]), server_momentum=float(cfg["server-momentum"]),
                fraction_evaluate=0.0),
        clipping=clipping, noise_multiplier=sigma, sample_rate=q, num_users=int(cfg["num-users"]),
        accountant=Accountant(target_epsilon=float(cfg["epsilon"]), delta=float(cfg["delta"])),
        seed=int(cfg["seed"]),
    )
    return strategy, sigma


def build_client_app(cfg: Mapping[str, Any]):
    """The clients: local SGD from the global model on the node's user (its ``partition-id``),
    with random rehearsal on the public corpus when ``rehearsal`` > 0."""
    t = task(int(cfg["num-users"]))
    rho = float(cfg["rehearsal"])
    return client_app(lambda: t.make_model(0), lambda ctx: t.user_data(int(ctx.node_config["partition-id"])),
                      epochs=int(cfg["epochs"]), batch_size=int(cfg["batch-size"]),
                      learning_rate=float(cfg["client-lr"]), loss_fn=t.loss_fn, public=t.public if rho > 0 else None,
                      rehearsal_fraction=rho, seed=int(cfg["seed"]))
