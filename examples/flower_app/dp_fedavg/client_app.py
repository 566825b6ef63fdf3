"""The ClientApp: local training of the node's user (settings from the run config)."""

from __future__ import annotations

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from dp_fedavg.task import build_client_app, settings

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    return build_client_app(settings(context.run_config))(msg, context)
