"""Round three in JAX: one training run of :mod:`round3`'s protocol with ``adaclip_jax``.

``python benchmarks/utility/round3.py --framework jax ...`` swaps :func:`round3.train` for
:func:`train_jax`; everything else (the grid, the validation pick, the seeds, the noise plan
from :func:`round3.plan_noise`, the report) is the PyTorch harness's. What a run does:

- the model is the task's PyTorch model at the run's seed, its weights copied into a pytree of
  ``jnp`` arrays, and the same function written in ``jnp`` (MLP tasks only: a ``Sequential`` of
  ``Linear`` layers and one activation), so a JAX run starts where the PyTorch run does;
- units are sampled by :func:`adaclip_jax.cyclic_poisson_mask` with the plan's ``b`` (groups from
  :func:`adaclip_jax.assign_groups`; ``b = 1`` is Poisson sampling at ``q``), one sampling key
  per seed; the sampled rows are gathered and padded with ``unit_mask=False`` rows (which
  contribute nothing) to ``B̄ + 6√B̄`` rounded up to a multiple of :data:`BUCKET`, or to the
  next multiple above a larger batch: one shape is compiled in almost every run, and no
  sampled unit is ever dropped (dropping would change the sampling the accounting assumes);
- the private transformation (:func:`adaclip_jax.flat_clip`, :func:`adaclip_jax.adaclip`,
  :func:`adaclip_jax.quantile_clip` or :func:`adaclip_jax.per_layer_clip`, with
  ``noise_mechanism=BandedNoise(plan's coefficients)`` when ``b > 1``) comes first in an optax
  chain with ``optax.sgd(lr, momentum=0.9)`` or ``optax.adam(lr)``; an EMA of the parameters
  per decay of :data:`round3.DECAYS` (:func:`adaclip_jax.parameter_averaging`, warm-up as in
  PyTorch) follows them, post-processing of the releases;
- every step goes through :class:`adaclip_jax.PrivacyTracker` (``bands=b``), whose accountant
  reports the ε spent.

The noise key is the seed (``jax.random.key(seed)``), the sampling key ``seed + 1``: within a
seed every method shares the initialisation, the sampling and the noise key, so the Δs are
paired as in PyTorch. The JAX and PyTorch streams differ, so a JAX run is not the PyTorch
run's twin.
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import numpy as np

#: sampled batches are padded to a multiple of this many rows (masked out)
BUCKET = 32


def padded_size(num_sampled: int, mean_batch: float) -> int:
    """Rows of a step's padded batch: ``B̄ + 6√B̄`` rounded up to a multiple of :data:`BUCKET`,
    or the next multiple at or above ``num_sampled`` when the sample is larger (never fewer rows
    than sampled units)."""
    usual = -(-int(mean_batch + 6 * np.sqrt(mean_batch) + 1) // BUCKET) * BUCKET
    return max(usual, -(-num_sampled // BUCKET) * BUCKET)


def _mlp_of(model: Any) -> tuple[list[dict[str, Any]], str]:
    """The Linear layers of a PyTorch ``Sequential`` MLP as ``[{"w": (in, out), "b": (out,)}]``
    and the name of its activation."""
    import jax.numpy as jnp
    from torch import nn

    layers, acts = [], set()
    for m in model:
        if isinstance(m, nn.Linear):
            layers.append({"w": jnp.asarray(m.weight.detach().numpy().T), "b": jnp.asarray(m.bias.detach().numpy())})
        elif isinstance(m, (nn.ReLU, nn.Tanh)):
            acts.add(type(m).__name__.lower())
        else:
            raise ValueError(f"round3 --framework jax runs MLP tasks only, got a {type(m).__name__}")
    if len(acts) > 1:
        raise ValueError(f"one activation expected, got {sorted(acts)}")
    return layers, (acts.pop() if acts else "relu")


def _apply(params: list[dict[str, Any]], x: Any, act: str) -> Any:
    import jax

    f = jax.nn.relu if act == "relu" else jax.numpy.tanh
    for layer in params[:-1]:
        x = f(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


def private_transformation(run_kind: str, clip: float, plan: dict[str, Any], n_units: int, seed: int) -> Any:
    """The ``adaclip_jax`` transformation of a run kind (the PyTorch harness's
    :func:`round3.build_private`, in JAX)."""
    import jax

    import adaclip_jax
    from adaclip.correlated import BandedNoise
    from adaclip.strategies import QuantileRule

    b = plan["bands"]
    common: dict[str, Any] = {
        "noise_multiplier": plan["sigma"], "expected_batch_size": plan["q"] * n_units, "key": jax.random.key(seed),
    }  # fmt: skip
    if b > 1:
        common["noise_mechanism"] = BandedNoise(plan["coefficients"])
    if run_kind.startswith("adaclip"):
        return adaclip_jax.adaclip(max_grad_norm=clip, **common)
    if run_kind == "quantile":
        return adaclip_jax.quantile_clip(max_grad_norm=clip, quantile=QuantileRule(), **common)
    if run_kind == "per-layer":
        return adaclip_jax.per_layer_clip(max_grad_norm=clip, **common)
    return adaclip_jax.flat_clip(max_grad_norm=clip, **common)


def train_jax(
    task: Any,
    run_kind: str,
    hp: dict[str, float],
    plan: dict[str, Any],
    *,
    optimizer: str,
    epsilon: float,
    seed: int,
    train_idx: np.ndarray,
    eval_idx: np.ndarray | None,
    epochs: int,
) -> dict[str, Any]:
    """One private run in JAX; the same result keys as :func:`round3.train` (``metric``,
    ``ema<μ>`` for each decay, ``epsilon``, ``sigma``, ``bands``, ``steps``, ``seconds``)."""
    import jax
    import jax.numpy as jnp
    import optax
    import torch
    from round3 import DECAYS, DELTA
    from utility_train import MOMENTUM

    import adaclip_jax
    from adaclip.accounting import Accountant
    from adaclip.errors import NoiseReplayWarning

    t0 = time.perf_counter()
    torch.manual_seed(seed)
    params, act = _mlp_of(task.make_model(seed))
    x_tr = jnp.asarray(task.x_train[train_idx], jnp.float32)
    y_tr = jnp.asarray(task.y_train[train_idx])
    n_units, b = len(train_idx), plan["bands"]
    lr = hp["lr"] * plan.get("lr_scale", 1.0)  # banded-lr with Adam: adaptive_lr_scale's ρ
    inner = optax.sgd(lr, momentum=MOMENTUM) if optimizer == "sgd" else optax.adam(lr)
    averages = [adaclip_jax.parameter_averaging("ema", decay=mu) for mu in DECAYS]
    tx = optax.chain(private_transformation(run_kind, hp["max_grad_norm"], plan, n_units, seed), inner)
    opt_state = tx.init(params)
    avg_states = [a.init(params) for a in averages]

    def example_loss(p: Any, x: Any, y: Any) -> Any:
        return optax.softmax_cross_entropy_with_integer_labels(_apply(p, x[None], act), y[None])[0]

    grads_fn = adaclip_jax.per_example_grads(example_loss, batch_argnums=(1, 2))

    @jax.jit
    def train_step(p: Any, s: Any, avg: Any, idx: Any, mask: Any, *, noise_multiplier: Any) -> Any:
        g = grads_fn(p, x_tr[idx], y_tr[idx])
        updates, s = tx.update(g, s, p, noise_multiplier=noise_multiplier, unit_mask=mask)
        p = optax.apply_updates(p, updates)
        avg = [a.update(st, p) for a, st in zip(averages, avg, strict=True)]
        return p, s, avg

    mask_fn = jax.jit(adaclip_jax.cyclic_poisson_mask, static_argnames="bands")
    sample_key = jax.random.key(seed + 1)
    groups = adaclip_jax.assign_groups(jax.random.fold_in(sample_key, 0), n_units, b)
    tracker = adaclip_jax.PrivacyTracker(
        Accountant(plan["accountant"], target_epsilon=epsilon, delta=DELTA), sample_rate=plan["q"],
        noise_multiplier=plan["sigma"], bands=b,
    )  # fmt: skip
    steps = epochs * plan["per_epoch"]
    # every method of a seed shares the noise key (paired differences): the replay warning of
    # a key seen in an earlier run is expected here, where no run's release is ever combined
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NoiseReplayWarning)
        for t in range(steps):
            sampled = np.flatnonzero(np.asarray(mask_fn(sample_key, t, groups, plan["rate"], bands=b)))
            size = padded_size(len(sampled), plan["q"] * n_units)
            idx = np.zeros(size, np.int32)
            idx[: len(sampled)] = sampled
            mask = np.arange(size) < len(sampled)
            params, opt_state, avg_states = tracker.step(
                train_step, params, opt_state, avg_states, jnp.asarray(idx), jnp.asarray(mask)
            )
    ex, ey = (task.x_test, task.y_test) if eval_idx is None else (task.x_train[eval_idx], task.y_train[eval_idx])
    ex, ey = jnp.asarray(ex, jnp.float32), np.asarray(ey)

    def accuracy(p: Any) -> float:
        return float(np.mean(np.asarray(jnp.argmax(_apply(p, ex, act), -1)) == ey))

    out: dict[str, Any] = {"metric": accuracy(params)}
    for mu, st in zip(DECAYS, avg_states, strict=True):
        out[f"ema{mu}"] = accuracy(adaclip_jax.averaged_params(st))
    out.update(epsilon=tracker.epsilon(DELTA), sigma=plan["sigma"], bands=b, steps=steps,
               seconds=time.perf_counter() - t0)  # fmt: skip
    return out
