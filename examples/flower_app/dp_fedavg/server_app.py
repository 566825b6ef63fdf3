"""The ServerApp: pretrain on public data, run DP-FedAvg, report accuracy on both test sets and ε."""

from __future__ import annotations

from logging import INFO

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp
from flwr.supercore import log

from adaclip_flower.torch_client import load_model_arrays, model_arrays
from dp_fedavg.task import build_strategy, pretrained_model, settings, task


def quality(cfg, model) -> str:
    t = task(int(cfg["num-users"]))
    return (f"next-word accuracy users {t.metric(model, *t.test_user):.3f}, "
            f"public {t.metric(model, *t.test_public):.3f}")


def run(grid: Grid, cfg) -> str:
    """Train and return the summary (also logged): quality before and after, and ε."""
    model = pretrained_model(cfg)
    before = f"pretrained on public data: {quality(cfg, model)}"
    log(INFO, "%s", before)
    strategy, sigma = build_strategy(cfg, sum(p.numel() for p in model.parameters()))
    result = strategy.start(grid=grid, initial_arrays=model_arrays(model), num_rounds=int(cfg["num-server-rounds"]))
    load_model_arrays(model, result.arrays)
    summary = (f"DP-FedAvg ({cfg['clipping']} clipping, sigma {sigma:.3f}, rehearsal {cfg['rehearsal']}): "
               f"{quality(cfg, model)}; user-level epsilon {strategy.epsilon:.3f} at delta {cfg['delta']:g} "
               f"after {strategy.accountant.steps} rounds")
    log(INFO, "%s", summary)
    return f"{before}\n{summary}"


app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    run(grid, settings(context.run_config))
