"""The ServerApp: DP-FedAvg from a random model, test accuracy before and after, and ε."""

from __future__ import annotations

import logging
from logging import INFO, WARNING

from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.supercore import log

from adaclip_flower.torch_client import load_model_arrays, model_arrays
from dp_fedavg.task import accuracy, build_strategy, make_model, settings


def run(grid: Grid, cfg) -> str:
    """Train and return the summary (also logged): accuracy on the held-out test digits before
    and after, and the user-level ε spent."""
    nodes = len(list(grid.get_node_ids()))
    if nodes != int(cfg["num-users"]):
        log(WARNING, "the federation has %d SuperNodes but the run config says num-users = %s: every node is still "
            "sampled at q = users-per-round / num-users (the accounting holds), but a node whose partition-id is "
            "not a user fails its rounds; run with --federation-config \"num-supernodes=%s\"",
            nodes, cfg["num-users"], cfg["num-users"])
    model = make_model(int(cfg["seed"]))
    strategy = build_strategy(cfg, sum(p.numel() for p in model.parameters()))
    rounds = int(cfg["num-server-rounds"])

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        """Server-side evaluation on the test digits (not the users' data): nothing private."""
        m = make_model()
        load_model_arrays(m, arrays)
        return MetricRecord({"accuracy": accuracy(m)})

    result = strategy.start(grid=grid, initial_arrays=model_arrays(model), num_rounds=rounds, evaluate_fn=evaluate)
    before = result.evaluate_metrics_serverapp[0]["accuracy"]
    after = result.evaluate_metrics_serverapp[rounds]["accuracy"]
    m = strategy.mechanism
    summary = "\n".join([
        f"DP-FedAvg on the digits: {m.num_users} users, {cfg['users-per-round']:g} per round (q = {m.sample_rate:g}), "
        f"{rounds} rounds, {cfg['clipping']} clipping {'at' if cfg['clipping'] == 'flat' else 'starting at'} "
        f"S = {cfg['clip-norm']:g}, sigma = {m.noise_multiplier:.3f}",
        f"test accuracy before {before:.3f} (random initial model; chance 0.1), after {after:.3f}",
        f"user-level epsilon {strategy.epsilon:.3f} at delta {strategy.delta:g} after {strategy.accountant.steps} "
        f"rounds (target {cfg['epsilon']:g})",
    ])
    for line in summary.splitlines():
        log(INFO, "%s", line)
    return summary


app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    # Show what ServerSideClipping announces (logger "adaclip_flower.server") in the run's log.
    announcements = logging.getLogger("adaclip_flower")
    if not announcements.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        announcements.addHandler(handler)
        announcements.setLevel(logging.INFO)
    run(grid, settings(context.run_config))
