"""User-level DP-FedAvg on Flower's simulation engine: 100 users, AdaCliP aggregation."""

import logging

import numpy as np
import torch
from flwr.app import Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvgM
from flwr.simulation import run_simulation

from adaclip import AdaptiveClipping
from adaclip.accounting import Accountant, calibrate_noise_multiplier
from adaclip_flower import ServerSideClipping
from adaclip_flower.torch_client import client_app, model_arrays

NUM_USERS, USERS_PER_ROUND, ROUNDS = 100, 10, 10
q = USERS_PER_ROUND / NUM_USERS


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def user_data(user: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(user)  # each user: 20 examples of a shared task
    x = torch.randn(20, 8, generator=g)
    return x, (x[:, 0] + 0.5 * x[:, 1] > 0).long()


# Clients: 2 local epochs of SGD (batch 10) from the global model on their own data.
clients = client_app(make_model, lambda ctx: user_data(int(ctx.node_config["partition-id"])),
                     epochs=2, batch_size=10, learning_rate=0.1)

sigma = calibrate_noise_multiplier(target_epsilon=8.0, delta=1e-3, sample_rate=q, steps=ROUNDS)
strategy = ServerSideClipping(
    FedAvgM(server_learning_rate=1.0, server_momentum=0.5),  # the server optimizer
    clipping=AdaptiveClipping.from_initial_clip(0.5, num_params=178),  # starts as flat clipping at S = 0.5
    noise_multiplier=sigma, sample_rate=q, num_users=NUM_USERS,
    accountant=Accountant(target_epsilon=8.0, delta=1e-3),
)
x_test, y_test = user_data(10_000)


def evaluate(server_round: int, arrays) -> MetricRecord:  # on the server, on held-out data
    model = make_model()
    model.load_state_dict(arrays.to_torch_state_dict())
    return MetricRecord({"accuracy": float((model(x_test).argmax(1) == y_test).float().mean())})


server = ServerApp()


@server.main()
def main(grid: Grid, context: Context) -> None:
    result = strategy.start(grid=grid, initial_arrays=model_arrays(make_model()), num_rounds=ROUNDS,
                            evaluate_fn=evaluate)
    accuracy = result.evaluate_metrics_serverapp[ROUNDS]["accuracy"]
    print(f"accuracy {accuracy:.3f}, user-level epsilon {strategy.epsilon:.2f} at delta 1e-3 (sigma {sigma:.2f})")
    assert strategy.epsilon <= 8.0 and np.isfinite(accuracy)


logging.getLogger("flwr").setLevel(logging.WARNING)
run_simulation(server_app=server, client_app=clients, num_supernodes=NUM_USERS,
               backend_config={"client_resources": {"num_cpus": 1}})
