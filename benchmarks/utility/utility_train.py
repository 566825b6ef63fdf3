"""One training run of the utility benchmark, PyTorch or JAX, written as a user would.

PyTorch, example level: :func:`adaclip_torch.make_private` (σ calibrated by
``adaclip.accounting`` for the target ε over the whole run, Poisson loader with
q = B̄/N, accountant attached). PyTorch, user level: :class:`adaclip_torch.PoissonUserBatchSampler`
plus the strategy class with ``calibrate_noise_multiplier`` and ``step(user_ids=...)``.
JAX: ``optax.chain(adaclip_jax.<strategy>(...), optax.sgd(lr, momentum=0.9))`` on per-example
gradients of the whole training set with a Poisson ``unit_mask`` (as ``examples/jax_digits.py``),
steps recorded by :class:`adaclip_jax.PrivacyTracker`.

Every private method of one (task, ε) comparison shares q, the number of steps, δ and
therefore σ. The wrapped optimizer is SGD with momentum 0.9 everywhere.
eDP-SGD's layer scales come from :func:`adaclip.layer_scales.layer_scales_from_public` on
*synthetic* inputs (uniform pixels for digits, standard normal for MNIST-1D, uniform tokens
for the LSTM) with random labels, at the initial model: no privacy cost.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from utility_tasks import Task

from adaclip.accounting import Accountant, calibrate_noise_multiplier
from adaclip.layer_scales import layer_scales_from_public

PRIVATE_METHODS = ("flat", "per_layer", "scaled", "adaclip")
METHODS = ("nonprivate",) + PRIVATE_METHODS
MOMENTUM = 0.9
TRACE_TENSORS = 4  # AdaCliP b/std traced for the first few parameter tensors


# --------------------------------------------------------------------------- helpers


def synthetic_public(task: Task, n: int = 64, seed: int = 999) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    shape = task.x_train.shape[1:]
    if task.user_level:
        v = task.extra["vocab"]
        x = rng.integers(1, v, size=(n, *shape)).astype(np.int64)
        x[:, 0] = 0
        return x, x
    if task.name.startswith("digits"):
        x = rng.random((n, *shape)).astype(np.float32)
    else:
        x = rng.standard_normal((n, *shape)).astype(np.float32)
    return x, rng.integers(0, 10, size=n).astype(np.int64)


def lm_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def task_loss(task: Task, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if task.user_level:
        return lm_loss(model(x), x)
    return nn.functional.cross_entropy(model(x), y)


def evaluate(task: Task, model: nn.Module, x: np.ndarray, y: np.ndarray) -> dict[str, float]:
    model.eval()
    with torch.no_grad():
        xt = torch.as_tensor(x)
        if task.user_level:
            logits = model(xt)[:, :-1]
            target = xt[:, 1:]
            acc = float((logits.argmax(-1) == target).float().mean())
            nll = float(nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1)))
            out = {"metric": acc, "perplexity": math.exp(nll)}
        else:
            out = {"metric": float((model(xt).argmax(1) == torch.as_tensor(y)).float().mean())}
    model.train()
    return out


def public_layer_scales_torch(task: Task, model: nn.Module) -> tuple[float, ...]:
    """eDP-SGD α_k from per-example gradients of synthetic (public) data on the initial model."""
    xs, ys = synthetic_public(task)
    params = [p for p in model.parameters() if p.requires_grad]
    per_ex: list[list[np.ndarray]] = [[] for _ in params]
    for i in range(len(xs)):
        model.zero_grad()
        task_loss(task, model, torch.as_tensor(xs[i : i + 1]), torch.as_tensor(ys[i : i + 1])).backward()
        for k, p in enumerate(params):
            per_ex[k].append(p.grad.detach().numpy().copy())
    model.zero_grad()
    return layer_scales_from_public([np.stack(g) for g in per_ex])


def adaclip_trace(std: list[torch.Tensor]) -> dict[str, list[float]]:
    """Mean of s and of b = sqrt(s)·sqrt(Σ s) over each of the first few tensors."""
    total = float(sum(float(s.sum()) for s in std))
    out: dict[str, list[float]] = {"std": [], "b": []}
    for s in std[:TRACE_TENSORS]:
        out["std"].append(float(s.mean()))
        out["b"].append(float(torch.sqrt(s).mean()) * math.sqrt(total))
    return out


# --------------------------------------------------------------------------- PyTorch


def train_torch(
    task: Task,
    method: str,
    hp: dict[str, Any],
    *,
    epsilon: float | None,
    delta: float,
    seed: int,
    train_idx: np.ndarray,
    eval_x: np.ndarray,
    eval_y: np.ndarray,
    epochs: int,
    curves: bool = False,
    progress: Any = None,
) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = task.make_model(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=hp["lr"], momentum=MOMENTUM)
    x_tr = torch.as_tensor(task.x_train[train_idx])
    y_tr = torch.as_tensor(task.y_train[train_idx])
    strategy_kwargs = {k: v for k, v in hp.items() if k != "lr"}
    if method == "scaled":
        strategy_kwargs["layer_scales"] = public_layer_scales_torch(task, model)
    result: dict[str, Any] = {"curve": [], "trace": []}

    def record(epoch: int, opt: Any) -> None:
        if curves:
            result["curve"].append({"epoch": epoch, **evaluate(task, model, eval_x, eval_y)})
        if curves and method == "adaclip" and opt is not None:
            result["trace"].append({"epoch": epoch, "step": opt.steps, **adaclip_trace(opt.clip_state.std)})

    if method == "nonprivate":
        g = torch.Generator().manual_seed(seed)
        if task.user_level:
            loader = DataLoader(TensorDataset(x_tr), batch_size=64, shuffle=True, generator=g)
        else:
            loader = DataLoader(TensorDataset(x_tr, y_tr), batch_size=int(task.batch_size), shuffle=True, generator=g)
        record(0, None)
        for epoch in range(epochs):
            for batch in loader:
                x = batch[0]
                y = batch[1] if len(batch) > 1 else x
                task_loss(task, model, x, y).backward()
                optimizer.step()
                optimizer.zero_grad()
                if progress is not None:
                    progress.update(1)
            record(epoch + 1, None)
        result.update(evaluate(task, model, eval_x, eval_y), epsilon=math.inf, sigma=0.0, steps=epochs * len(loader))
        return result

    if task.user_level:
        from adaclip_torch import AdaClip, FlatClip, PerLayerClip, PoissonUserBatchSampler, ScaledClip

        users = torch.as_tensor(task.user_train[train_idx])
        num_users = int(torch.unique(users).numel())
        q = task.batch_size / num_users
        steps_per_epoch = max(1, round(1 / q))
        g = torch.Generator().manual_seed(seed + 1)
        sampler = PoissonUserBatchSampler(users, q, num_steps=steps_per_epoch, generator=g)
        sigma = calibrate_noise_multiplier(target_epsilon=epsilon, delta=delta, sample_rate=q,
                                           steps=epochs * steps_per_epoch)
        cls = {"adaclip": AdaClip, "flat": FlatClip, "per_layer": PerLayerClip, "scaled": ScaledClip}[method]
        opt = cls(optimizer, model, noise_multiplier=sigma, expected_batch_size=sampler.expected_batch_size,
                  accountant=Accountant("rdp", target_epsilon=epsilon, delta=delta), sample_rate=q, seed=seed,
                  **strategy_kwargs)
        record(0, opt)
        for epoch in range(epochs):
            for idx in sampler:
                if len(idx) == 0:
                    opt.step(empty_batch=True)
                else:
                    idx = torch.as_tensor(idx)
                    x = x_tr[idx]
                    lm_loss(model(x), x).backward()
                    opt.step(user_ids=users[idx])
                opt.zero_grad()
                if progress is not None:
                    progress.update(1)
            record(epoch + 1, opt)
    else:
        from adaclip_torch import make_private

        loader = DataLoader(TensorDataset(x_tr, y_tr), batch_size=int(task.batch_size))
        model, opt, loader = make_private(model, optimizer, loader, target_epsilon=epsilon, delta=delta,
                                          epochs=epochs, strategy=method, seed=seed, **strategy_kwargs)
        record(0, opt)
        for epoch in range(epochs):
            for x, y in loader:
                if len(x) == 0:  # an empty Poisson batch: release noise only
                    opt.step(empty_batch=True)
                else:
                    nn.functional.cross_entropy(model(x), y).backward()
                    opt.step()
                opt.zero_grad()
                if progress is not None:
                    progress.update(1)
            record(epoch + 1, opt)
    result.update(evaluate(task, model, eval_x, eval_y), epsilon=opt.accountant.epsilon(delta),
                  sigma=float(opt.hyperparameters().noise_multiplier), steps=opt.steps)
    if method == "scaled":
        result["layer_scales"] = list(strategy_kwargs["layer_scales"])
    if hasattr(opt, "remove_hooks"):
        opt.remove_hooks()
    return result


def steps_for(task: Task, n_units: int, epochs: int) -> int:
    q = task.batch_size / n_units
    return epochs * max(1, round(1 / q))


# --------------------------------------------------------------------------- JAX


def train_jax(
    task: Task,
    method: str,
    hp: dict[str, Any],
    *,
    epsilon: float | None,
    delta: float,
    seed: int,
    train_idx: np.ndarray,
    eval_x: np.ndarray,
    eval_y: np.ndarray,
    epochs: int,
    curves: bool = False,
    progress: Any = None,
) -> dict[str, Any]:
    """Digits tasks only. The initial parameters are the PyTorch model's (same seed), so the
    two frameworks start from the same point; sampling and noise streams differ."""
    import jax
    import jax.numpy as jnp
    import optax

    import adaclip_jax

    if task.user_level or not task.name.startswith("digits"):
        raise ValueError("the JAX path covers the digits tasks")
    torch_model = task.make_model(seed)
    linears = [m for m in torch_model.modules() if isinstance(m, nn.Linear)]
    params = [{"w": jnp.asarray(m.weight.detach().numpy().T), "b": jnp.asarray(m.bias.detach().numpy())}
              for m in linears]

    def logits_fn(params, x):
        for layer in params[:-1]:
            x = jnp.tanh(x @ layer["w"] + layer["b"])
        return x @ params[-1]["w"] + params[-1]["b"]

    def example_loss(params, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(logits_fn(params, x[None]), y[None])[0]

    grads_fn = adaclip_jax.per_example_grads(example_loss, batch_argnums=(1, 2))
    x_tr = jnp.asarray(task.x_train[train_idx])
    y_tr = jnp.asarray(task.y_train[train_idx])
    n = x_tr.shape[0]
    q = task.batch_size / n
    steps_per_epoch = max(1, round(1 / q))
    total = epochs * steps_per_epoch
    rng = np.random.default_rng(seed)

    def acc(params):
        return float(jnp.mean(jnp.argmax(logits_fn(params, jnp.asarray(eval_x)), -1) == jnp.asarray(eval_y)))

    result: dict[str, Any] = {"curve": [], "trace": []}
    if method == "nonprivate":
        tx = optax.sgd(hp["lr"], momentum=MOMENTUM)
        opt_state = tx.init(params)

        @jax.jit
        def np_step(params, opt_state, idx):
            g = jax.grad(lambda p: jnp.mean(jax.vmap(example_loss, (None, 0, 0))(p, x_tr[idx], y_tr[idx])))(params)
            u, opt_state = tx.update(g, opt_state, params)
            return optax.apply_updates(params, u), opt_state

        b = int(task.batch_size)
        for epoch in range(epochs):
            perm = rng.permutation(n)
            for s in range(n // b):
                params, opt_state = np_step(params, opt_state, jnp.asarray(perm[s * b:(s + 1) * b]))
                if progress is not None:
                    progress.update(1)
            if curves:
                result["curve"].append({"epoch": epoch + 1, "metric": acc(params)})
        result.update(metric=acc(params), epsilon=math.inf, sigma=0.0, steps=epochs * (n // b))
        return result

    sigma = calibrate_noise_multiplier(target_epsilon=epsilon, delta=delta, sample_rate=q, steps=total)
    key = jax.random.key(seed + 1)
    common = dict(noise_multiplier=sigma, expected_batch_size=task.batch_size, key=key)
    kw = {k: v for k, v in hp.items() if k != "lr"}
    if method == "adaclip":
        private = adaclip_jax.adaclip(**common, **kw)
    elif method == "flat":
        private = adaclip_jax.flat_clip(**common, **kw)
    elif method == "per_layer":
        private = adaclip_jax.per_layer_clip(**common, **kw)
    else:
        xs, ys = synthetic_public(task)
        leaves = jax.tree_util.tree_leaves(grads_fn(params, jnp.asarray(xs), jnp.asarray(ys)))
        kw["layer_scales"] = layer_scales_from_public([np.asarray(g) for g in leaves])
        result["layer_scales"] = list(kw["layer_scales"])
        private = adaclip_jax.scaled_clip(**common, **kw)
    tx = optax.chain(private, optax.sgd(hp["lr"], momentum=MOMENTUM))
    opt_state = tx.init(params)

    @jax.jit
    def train_step(params, opt_state, mask, *, noise_multiplier):
        grads = grads_fn(params, x_tr, y_tr)
        updates, opt_state = tx.update(grads, opt_state, params, noise_multiplier=noise_multiplier, unit_mask=mask)
        return optax.apply_updates(params, updates), opt_state

    tracker = adaclip_jax.PrivacyTracker(Accountant("rdp", target_epsilon=None), sample_rate=q,
                                         noise_multiplier=sigma)
    for epoch in range(epochs):
        for _ in range(steps_per_epoch):
            mask = jnp.asarray(rng.random(n) < q)
            params, opt_state = tracker.step(train_step, params, opt_state, mask)
            if progress is not None:
                progress.update(1)
        if curves:
            result["curve"].append({"epoch": epoch + 1, "metric": acc(params)})
    result.update(metric=acc(params), epsilon=tracker.epsilon(delta), sigma=float(sigma), steps=total)
    return result
