"""PyTorch clients for DP-FedAvg: local training from the global model, with optional
random rehearsal on public data.

**Local training.** A sampled user starts from the global model ``θ`` and runs ``E`` epochs
of minibatch SGD (batch size ``b``, learning rate ``η``, optional momentum) over its own
examples; it returns ``θ_k``. ``E = 1`` with ``b`` ≥ the user's examples is DP-FedSGD (one
gradient step per user and round); larger ``E`` or smaller ``b`` is DP-FedAvg.

**Random rehearsal** (Robins 1995; used for on-device fine-tuning of language models): to
keep quality on general data while fine-tuning on users' data, each round the user adds
``⌈ρ·n_k⌉`` examples drawn at random (without replacement) from a *public* data set to its
``n_k`` own examples and trains on the union. Public data is privacy-free; the user's weight
still counts only its own ``n_k``.

Nothing here is private on its own: privacy comes from the server's (or the mod's) clipping
and noise on the update ``θ_k − θ``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from adaclip.errors import InvalidHyperparameterError

__all__ = ["train_locally", "rehearsal_mix", "client_app", "model_arrays", "load_model_arrays"]

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _check(name: str, value: Any, *, integer: bool = False, allow_zero: bool = False) -> None:
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok or not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        kind = "int" if integer else "number"
        raise InvalidHyperparameterError(f"{name} must be a {'non-negative' if allow_zero else 'positive'} {kind}, got {value!r}")


def rehearsal_mix(
    inputs: torch.Tensor,
    targets: torch.Tensor,
    public: tuple[torch.Tensor, torch.Tensor] | None,
    rehearsal_fraction: float,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The user's examples plus ``⌈ρ·n⌉`` public ones drawn without replacement (at most all
    of them); ``ρ = 0`` or no public data returns the user's examples."""
    _check("rehearsal_fraction", rehearsal_fraction, allow_zero=True)
    if public is None or rehearsal_fraction == 0 or len(inputs) == 0:
        return inputs, targets
    px, py = public
    k = min(math.ceil(rehearsal_fraction * len(inputs)), len(px))
    pick = torch.randperm(len(px), generator=generator)[:k]
    return torch.cat([inputs, px[pick]]), torch.cat([targets, py[pick]])


def train_locally(
    model: torch.nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    *,
    epochs: int = 1,
    batch_size: int = 16,
    learning_rate: float = 0.1,
    momentum: float = 0.0,
    loss_fn: Loss | None = None,
    public: tuple[torch.Tensor, torch.Tensor] | None = None,
    rehearsal_fraction: float = 0.0,
    generator: torch.Generator | None = None,
) -> float:
    """``E`` epochs of minibatch SGD on the user's data (plus rehearsal); returns the mean
    training loss of the last epoch (for the client's own use: it is not private)."""
    _check("epochs", epochs, integer=True)
    _check("batch_size", batch_size, integer=True)
    _check("learning_rate", learning_rate)
    _check("momentum", momentum, allow_zero=True)
    loss_fn = loss_fn or torch.nn.functional.cross_entropy
    x, y = rehearsal_mix(inputs, targets, public, rehearsal_fraction, generator)
    params = list(model.parameters())
    buffers: list[torch.Tensor | None] = [None] * len(params)
    model.train()
    last = float("nan")
    for _ in range(epochs):
        order = torch.randperm(len(x), generator=generator)
        total, count = 0.0, 0
        for start in range(0, len(x), batch_size):
            idx = order[start:start + batch_size]
            for p in params:
                p.grad = None
            loss = loss_fn(model(x[idx]), y[idx])
            loss.backward()
            _sgd_step(params, buffers, learning_rate, momentum)
            total += float(loss.detach()) * len(idx)
            count += len(idx)
        last = total / max(count, 1)
    return last


@torch.no_grad()
def _sgd_step(params: list[torch.Tensor], buffers: list[torch.Tensor | None], lr: float, momentum: float) -> None:
    """One step of ``torch.optim.SGD(params, lr, momentum)`` (no dampening, Nesterov or weight
    decay), with the same operations in the same order. Written out because building a
    ``torch.optim`` optimizer first imports ``torch._dynamo``, seconds in every fresh process,
    which a simulation's client processes each paid."""
    for i, p in enumerate(params):
        if p.grad is None:
            continue
        step = p.grad
        if momentum != 0:
            buf = buffers[i]
            buffers[i] = buf = torch.clone(step).detach() if buf is None else buf.mul_(momentum).add_(step)
            step = buf
        p.add_(step, alpha=-lr)


def model_arrays(model: torch.nn.Module) -> ArrayRecord:
    """The model's state as an ArrayRecord (the global model the server sends)."""
    return ArrayRecord(model.state_dict())


def load_model_arrays(model: torch.nn.Module, arrays: ArrayRecord) -> None:
    """Load an ArrayRecord made by :func:`model_arrays` (or released by the server)."""
    model.load_state_dict(arrays.to_torch_state_dict())


def client_app(
    make_model: Callable[[], torch.nn.Module],
    load_user_data: Callable[[Context], tuple[torch.Tensor, torch.Tensor]],
    *,
    epochs: int = 1,
    batch_size: int = 16,
    learning_rate: float = 0.1,
    momentum: float = 0.0,
    loss_fn: Loss | None = None,
    public: tuple[torch.Tensor, torch.Tensor] | None = None,
    rehearsal_fraction: float = 0.0,
    mods: Sequence[Callable[..., Message]] = (),
    seed: int | None = None,
) -> ClientApp:
    """A Flower ``ClientApp`` whose train handler runs :func:`train_locally` from the received
    model on ``load_user_data(context)`` (this node's user: e.g. its ``partition-id``) and
    replies with the trained model and ``num-examples`` = the user's own example count.

    ``mods``: e.g. ``[adaclip_flower.mods.adaclip_mod]`` for :class:`ClientSideClipping`.
    ``seed``: seeds the local shuffling and rehearsal draws (with the node's partition id and
    the round), for reproducible experiments; ``None`` uses PyTorch's global generator.
    """
    for name, value in (("epochs", epochs), ("batch_size", batch_size)):
        _check(name, value, integer=True)
    _check("learning_rate", learning_rate)
    _check("rehearsal_fraction", rehearsal_fraction, allow_zero=True)
    app = ClientApp(mods=list(mods))

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        (key, arrays), = msg.content.array_records.items()
        model = make_model()
        load_model_arrays(model, arrays)
        inputs, targets = load_user_data(context)
        generator = None
        if seed is not None:
            config = next(iter(msg.content.config_records.values()), {})
            node = int(context.node_config.get("partition-id", 0))
            rnd = int(config.get("server-round", 0))
            generator = torch.Generator().manual_seed((seed * 1_000_003 + node) * 1_000_003 + rnd)
        train_locally(
            model, inputs, targets, epochs=epochs, batch_size=batch_size, learning_rate=learning_rate,
            momentum=momentum, loss_fn=loss_fn, public=public, rehearsal_fraction=rehearsal_fraction,
            generator=generator,
        )
        reply = RecordDict({key: ArrayRecord(model.state_dict()), "metrics": MetricRecord({"num-examples": len(inputs)})})
        return Message(content=reply, reply_to=msg)

    return app
