"""A tiny federated task for the simulation and deployment tests: 8 users with 6 examples
each of a 3-class linear problem in R^5; the model is one Linear layer."""

from __future__ import annotations

import numpy as np
import torch
from flwr.app import Context, Message

from adaclip_flower import torch_client

NUM_USERS = 8
EPOCHS, BATCH, LR, SEED = 2, 4, 0.5, 11


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(5, 3)


def user_data(user: int) -> tuple[torch.Tensor, torch.Tensor]:
    rng = np.random.default_rng(1000 + user)
    x = rng.standard_normal((6, 5)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64) + (x[:, 1] > 0.5).astype(np.int64)
    return torch.from_numpy(x), torch.from_numpy(y)


def load_user_data(context: Context) -> tuple[torch.Tensor, torch.Tensor]:
    return user_data(int(context.node_config["partition-id"]))


def tag_partition(msg: Message, ctxt: Context, call_next) -> Message:
    """A test mod: adds the node's partition id to the reply's metrics, so the test can tell
    which users were sampled (the wrappers never forward client metrics)."""
    reply = call_next(msg, ctxt)
    if not reply.has_error():
        for record in reply.content.metric_records.values():
            record["partition-id"] = int(ctxt.node_config["partition-id"])
    return reply


def client_app(mods=()):
    return torch_client.client_app(
        make_model, load_user_data, epochs=EPOCHS, batch_size=BATCH, learning_rate=LR,
        mods=[tag_partition, *mods], seed=SEED,
    )


def local_update(user: int, theta: dict[str, np.ndarray], server_round: int) -> list[np.ndarray]:
    """What a sampled user sends, computed in this process the way the ClientApp does."""
    model = make_model()
    model.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in theta.items()})
    x, y = user_data(user)
    gen = torch.Generator().manual_seed((SEED * 1_000_003 + user) * 1_000_003 + server_round)
    torch_client.train_locally(model, x, y, epochs=EPOCHS, batch_size=BATCH, learning_rate=LR, generator=gen)
    return [v.detach().numpy().astype(np.float64) - np.asarray(theta[k], np.float64) for k, v in model.state_dict().items()]


# --------------------------------------------------------------------------- deployment app
# The components of tests/flower_app/pyproject.toml: every node is sampled (q = 1) with σ = 0 and
# client-side AdaCliP clipping, so the test can recompute the final model in-process.

def _deploy_server():
    import json
    import pathlib

    from flwr.serverapp import ServerApp
    from flwr.serverapp.strategy import FedAvg

    from adaclip import AdaptiveClipping
    from adaclip_flower import ClientSideClipping

    app = ServerApp()

    @app.main()
    def main(grid, context: Context) -> None:
        cfg = context.run_config
        nodes = int(cfg["min-nodes"])
        strategy = ClientSideClipping(
            FedAvg(min_available_nodes=nodes, min_train_nodes=nodes),
            clipping=AdaptiveClipping(std_min=0.01, std_max=0.5), noise_multiplier=0.0, sample_rate=1.0,
            num_users=nodes, delta=1e-5, seed=0,
        )
        result = strategy.start(grid=grid, initial_arrays=torch_client.model_arrays(make_model()),
                                num_rounds=int(cfg["num-server-rounds"]))
        out = pathlib.Path(str(cfg["output-path"]))
        out.parent.mkdir(parents=True, exist_ok=True)
        np.savez(out.with_suffix(".tmp.npz"), **{k: a.numpy() for k, a in result.arrays.items()})
        out.with_suffix(".tmp.npz").rename(out)
        out.with_suffix(".json").write_text(json.dumps({"rounds-released": strategy.accountant.steps}))

    return app


def _deploy_client():
    from adaclip_flower import adaclip_mod

    return client_app([adaclip_mod])


deploy_server_app = _deploy_server()
deploy_client_app = _deploy_client()
