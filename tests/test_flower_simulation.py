"""End to end on Flower's simulation engine: with σ = 0, two rounds of the wrappers equal the
in-process reference for the same clients and the same sampling."""

import logging

import numpy as np
import pytest

pytest.importorskip("flwr")
pytest.importorskip("ray")

import _flower_apps as apps  # noqa: E402
from flwr.app import Context  # noqa: E402
from flwr.serverapp import Grid, ServerApp  # noqa: E402
from flwr.serverapp.strategy import FedAvg  # noqa: E402
from flwr.simulation import run_simulation  # noqa: E402

from adaclip import AdaptiveClipping, FlatClipping  # noqa: E402
from adaclip_flower import ClientSideClipping, ServerSideClipping, adaclip_mod  # noqa: E402
from adaclip_flower import aggregation as agg  # noqa: E402
from adaclip_flower.torch_client import model_arrays  # noqa: E402


def _recording(cls):
    class Recording(cls):
        """Records which users replied in each round (from the test mod's tag)."""

        sampled: dict[int, list[int]] = {}
        thetas: dict[int, dict[str, np.ndarray]] = {}

        def configure_train(self, server_round, arrays, config, grid):
            self.thetas[server_round] = {k: a.numpy() for k, a in arrays.items()}
            return super().configure_train(server_round, arrays, config, grid)

        def aggregate_train(self, server_round, replies):
            replies = list(replies)
            self.sampled[server_round] = sorted(
                int(r.content["metrics"]["partition-id"]) for r in replies if not r.has_error()
            )
            return super().aggregate_train(server_round, replies)

    return Recording


def _simulate(strategy, client_app, rounds):
    out = {}
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        result = strategy.start(grid=grid, initial_arrays=model_arrays(apps.make_model()), num_rounds=rounds)
        out["arrays"] = {k: a.numpy() for k, a in result.arrays.items()}
        out["metrics"] = dict(result.train_metrics_clientapp)

    logging.getLogger("flwr").setLevel(logging.WARNING)
    run_simulation(server_app=server, client_app=client_app, num_supernodes=apps.NUM_USERS,
                   backend_config={"client_resources": {"num_cpus": 1}})
    return out


@pytest.mark.parametrize(
    "side,clipping",
    [("server", FlatClipping(max_grad_norm=0.3)), ("client", AdaptiveClipping(std_min=0.01, std_max=0.5))],
)
def test_sigma_zero_rounds_equal_the_in_process_reference(side, clipping):
    cls = _recording(ServerSideClipping if side == "server" else ClientSideClipping)
    cls.sampled, cls.thetas = {}, {}
    strategy = cls(FedAvg(), clipping=clipping, noise_multiplier=0.0, sample_rate=0.5, num_users=apps.NUM_USERS,
                   delta=1e-5, seed=5)
    mods = [adaclip_mod] if side == "client" else []
    out = _simulate(strategy, apps.client_app(mods), rounds=2)
    mech = strategy.mechanism
    names = list(cls.thetas[1].keys())
    like = [np.zeros_like(cls.thetas[1][k], dtype=np.float64) for k in names]
    state = clipping.init(like)
    theta = cls.thetas[1]
    for rnd in (1, 2):
        np.testing.assert_allclose(np.concatenate([cls.thetas[rnd][k].ravel() for k in names]),
                                   np.concatenate([theta[k].ravel() for k in names]), rtol=1e-6, atol=1e-7)
        ups = [apps.local_update(u, theta, rnd) for u in cls.sampled[rnd]]
        mean, state = agg.aggregate_updates(mech, state, agg.stack_updates(ups, like), noise=None)
        theta = {k: (theta[k].astype(np.float64) + m).astype(np.float32) for k, m in zip(names, mean)}
    assert sum(len(v) for v in cls.sampled.values()) > 0
    for k in names:
        np.testing.assert_allclose(out["arrays"][k], theta[k], rtol=1e-5, atol=1e-6)
    assert out["metrics"][2]["rounds-released"] == 2
