"""The client-side mod of :class:`adaclip_flower.server.ClientSideClipping`.

Add :func:`adaclip_mod` to a ``ClientApp``'s mods (last, so that it sees the final model):

.. code-block:: python

    app = ClientApp(mods=[adaclip_mod])

On a train message from :class:`~adaclip_flower.server.ClientSideClipping` it takes out the
public transform ``(a, b)``, the clip groups and the noise share ``σ/√n`` that the server
added, lets the app train on the plain message (one ArrayRecord, one ConfigRecord, as any
app expects), and replaces the returned model ``θ_k`` by the client's noisy contribution in
the transformed space,

.. math:: ω_k \\bar w_k + \\frac{σ}{\\sqrt n} z_k,\\qquad
          w_k = \\frac{θ_k − θ − a}{b}\\ \\text{clipped per group},\\qquad
          ω_k = \\min(n_k/ŵ, 1)\\ \\text{(1 without a cap)},

with ``z_k`` drawn from a generator seeded by the OS. An update that is not finite or of the
wrong shape contributes ``0`` plus the noise share; if the app itself fails, the reply is the
noise share alone. Either way the reply looks like any other, so the server learns nothing
from its shape. Messages without the server's keys pass through unchanged.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp.typing import ClientAppCallable

from adaclip_flower import aggregation
from adaclip_flower.server import CONFIG_KEY, TRANSFORM_KEY

__all__ = ["adaclip_mod", "contribution_from_config"]


def contribution_from_config(
    update: list[np.ndarray] | None,
    like: list[np.ndarray],
    transform: ArrayRecord,
    config: Any,
    *,
    num_examples: Any,
    rng: np.random.Generator,
) -> list[np.ndarray]:
    """The noisy contribution for ``update`` (``None``: none) under the server's transform
    and config; see the module docstring."""
    num = int(config["num-tensors"])
    scale = [transform[f"scale.{j}"].numpy() for j in range(num)]
    centre = [transform[f"centre.{j}"].numpy() for j in range(num)] if bool(config["has-centre"]) else None
    group_of = list(config["group-of"])
    radii = list(config["group-radius"])
    groups = [([j for j in range(num) if group_of[j] == g], float(r)) for g, r in enumerate(radii)]
    cap = float(config["weight-cap"])
    weight = 1.0
    if cap > 0:
        try:
            n = float(num_examples)
            weight = min(n / cap, 1.0) if np.isfinite(n) and n >= 0 else 0.0
        except (TypeError, ValueError):
            weight = 0.0
    stacked = aggregation.stack_updates([update], like)
    if not stacked.valid[0]:
        weight = 0.0
    rows = [s[0] for s in stacked.stacked]
    return aggregation.clip_and_noise_update(
        rows, centre, scale, groups, weight=weight, noise_std=float(config["noise-std"]), rng=rng
    )


def adaclip_mod(msg: Message, ctxt: Context, call_next: ClientAppCallable) -> Message:
    """Client-side clipping and noise share for :class:`~adaclip_flower.server.ClientSideClipping`."""
    content = msg.content
    if msg.metadata.message_type != MessageType.TRAIN or TRANSFORM_KEY not in content.array_records:
        return call_next(msg, ctxt)
    transform = content.array_records[TRANSFORM_KEY]
    config = content.config_records[CONFIG_KEY]
    plain = RecordDict({k: v for k, v in content.items() if k not in (TRANSFORM_KEY, CONFIG_KEY)})
    (model_key, model), = plain.array_records.items()
    names = list(model.keys())
    like = [np.asarray(a.numpy()) for a in model.values()]
    inner = Message(content=plain, metadata=msg.metadata)
    update = None
    num_examples = None
    try:
        reply = call_next(inner, ctxt)
        if not reply.has_error():
            out = reply.content.array_records
            record = out.get(model_key) if model_key in out else next(iter(out.values()))
            if list(record.keys()) == names:
                got = [np.asarray(a.numpy()) for a in record.values()]
                update = [g.astype(np.float64) - c.astype(np.float64) for g, c in zip(got, like, strict=True)]
            key = str(config["weighted-by-key"])
            for metrics in reply.content.metric_records.values():
                if key in metrics:
                    num_examples = metrics[key]
    except Exception:  # noqa: BLE001 - a failed app still sends its noise share
        update = None
    contribution = contribution_from_config(
        update, like, transform, config, num_examples=num_examples, rng=aggregation.noise_generator(None)
    )
    arrays = ArrayRecord({name: Array(np.asarray(c)) for name, c in zip(names, contribution, strict=True)})
    return Message(content=RecordDict({model_key: arrays, "metrics": MetricRecord({"num-examples": 1})}), reply_to=msg)
