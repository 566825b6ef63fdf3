"""One training run of the utility benchmark, PyTorch or JAX, written as a user would.

PyTorch, example level: :func:`adaclip_torch.make_private` (σ calibrated by
``adaclip.accounting`` for the target ε over the whole run — through the memo of
:func:`calibration.calibrated_sigma`, passed as ``noise_multiplier`` with the budget it must
fit — Poisson loader with q = B̄/N, accountant attached). PyTorch, user level: :class:`adaclip_torch.PoissonUserBatchSampler`
plus the strategy class with ``calibrate_noise_multiplier`` and ``step(user_ids=...)``.
JAX: ``optax.chain(adaclip_jax.<strategy>(...), optax.sgd(lr, momentum=0.9))`` on per-example
gradients of the whole training set with a Poisson ``unit_mask`` (as ``examples/jax_digits.py``),
steps recorded by :class:`adaclip_jax.PrivacyTracker`.

Every private method of one (task, ε) comparison shares q, the number of steps, δ and
therefore σ. The wrapped optimizer is SGD with momentum 0.9 (``optimizer="sgd"``, the default)
or Adam (``optimizer="adam"``, PyTorch's defaults β = (0.9, 0.999), eps = 1e-8).

Twins (:data:`TWIN_METHODS`, PyTorch, example level): every adaptive option of
:mod:`adaclip.strategies` built so that its clip region at step 0 is flat clipping's ball of
radius ``C`` (:func:`twin_strategy`), wrapped with :class:`adaclip_torch.DPOptimizer` exactly as
``make_private`` wraps flat clipping (same σ, q, Poisson batches and noise seed), so a twin and
flat clipping at the same ``(lr, C)`` and seed differ only in the strategy. Each run records
:func:`scale_diagnostic` of the final clip state (released values only).
eDP-SGD's layer scales come from :func:`adaclip.layer_scales.layer_scales_from_public` on
*synthetic* inputs (uniform pixels for digits, standard normal for MNIST-1D, uniform tokens
for the LSTM) with random labels, at the initial model: no privacy cost.
"""

from __future__ import annotations

import math
import sys
import warnings
from typing import Any

import numpy as np
import torch
from calibration import calibrated_sigma
from methods_round1 import (  # noqa: F401  (re-exported: the harness and tests import them from here)
    ADAM_LRS,
    ADAM_QUICK_LR,
    AUX_METHODS,
    DELAY,
    METHODS,
    MOMENTUM,
    OPTIMIZERS,
    PRIVATE_METHODS,
    SEPARATED_STD,
    TWIN_BETA_STD,
    TWIN_METHODS,
    TWIN_S0,
)
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from utility_tasks import Task

from adaclip.accounting import Accountant
from adaclip.errors import NoiseDominatedWarning
from adaclip.layer_scales import layer_scales_from_public

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


def is_language_model(task: Task) -> bool:
    """Next-word prediction (user level, or example level with ``extra["lm"]``): the input is
    the token sequence and the target is the same sequence shifted by one."""
    return task.user_level or bool(task.extra.get("lm"))


def task_loss(task: Task, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if is_language_model(task):
        return lm_loss(model(x), x)
    return nn.functional.cross_entropy(model(x), y)


_LOG_FLOAT_MAX = math.log(sys.float_info.max)


def evaluate(task: Task, model: nn.Module, x: np.ndarray, y: np.ndarray) -> dict[str, float]:
    model.eval()
    with torch.no_grad():
        xt = torch.as_tensor(x)
        if is_language_model(task):
            logits = model(xt)[:, :-1]
            target = xt[:, 1:]
            acc = float((logits.argmax(-1) == target).float().mean())
            nll = float(nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1)))
            # A diverged run's loss can exceed what exp() represents; its perplexity is infinite.
            out = {"metric": acc, "perplexity": math.exp(nll) if nll < _LOG_FLOAT_MAX else math.inf}
        else:
            out = {"metric": float((model(xt).argmax(1) == torch.as_tensor(y)).float().mean())}
    model.train()
    return out


def public_per_example_grads_torch(task: Task, model: nn.Module) -> list[np.ndarray]:
    """Per-example gradients ``(n, *shape)`` per trainable tensor of synthetic (public) data
    at ``model`` (no privacy cost)."""
    xs, ys = synthetic_public(task)
    params = [p for p in model.parameters() if p.requires_grad]
    per_ex: list[list[np.ndarray]] = [[] for _ in params]
    for i in range(len(xs)):
        model.zero_grad()
        task_loss(task, model, torch.as_tensor(xs[i : i + 1]), torch.as_tensor(ys[i : i + 1])).backward()
        for k, p in enumerate(params):
            per_ex[k].append(p.grad.detach().numpy().copy())
    model.zero_grad()
    return [np.stack(g) for g in per_ex]


def public_layer_scales_torch(task: Task, model: nn.Module) -> tuple[float, ...]:
    """eDP-SGD α_k from per-example gradients of synthetic (public) data on the initial model."""
    return layer_scales_from_public(public_per_example_grads_torch(task, model))


def make_optimizer(name: str, params: Any, lr: float) -> torch.optim.Optimizer:
    """The wrapped (inner) optimizer: SGD with momentum 0.9, or Adam with PyTorch's defaults."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=MOMENTUM)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    raise ValueError(f"optimizer must be one of {sorted(OPTIMIZERS)}, got {name!r}")


def twin_strategy(method: str, max_grad_norm: float, num_params: int, s0: str = "fixed") -> Any:
    """The strategy of ``method`` whose clip region at step 0 is flat clipping's ball of
    radius ``C = max_grad_norm`` (``"flat"`` gives flat clipping itself).

    - ``ada-patent``: the patent's AdaCliP, ``from_initial_clip(C, d)``, β2 = 0.999 (as the
      ``--ada-grid flat-clips`` runs); ``ada-unbiased``: the same with ``correction="unbiased"``;
    - ``ada-tensor`` / ``ada-factored`` / ``ada-delayed``: separated scale at ``C`` (the
      statistics set only the shape), unbiased correction, pooled per tensor / row × column /
      per tensor updated every 10 steps (β2 = 0.999¹⁰, the same horizon in steps);
    - ``ada-public``: separated, per tensor, statistics frozen at those of public per-example
      gradients (set by the caller, :func:`train_torch`);
    - ``stp``: scale-then-privatize at ``C``;
    - ``centre-debiased`` / ``centre-kalman``: separated with frozen (uniform) statistics, so the
      shape stays flat and only the centre differs from flat clipping (β1 = 0.999 debiased EMA,
      or the Kalman centre); ``centre-quantile``: the Kalman centre plus the quantile rule on C;
    - ``quantile``: flat clipping with the quantile rule (C0 = C); ``automatic``: automatic
      clipping with C as its scale.

    ``s0="fixed"`` (default): the separated scales use std ∈ [1e-8, 1e2] (:data:`SEPARATED_STD`,
    so s starts at 1e-3): only the shape of s matters there, so the range is wide; ``stp`` keeps
    its constructor's s0 = 1, range [1e-4, 1e4]. ``s0="clip"``: every one starts at
    ``s0 = C/√d`` (the per-coordinate spread of the clip ball), with the patent twins' range
    ``s0·[1/30, 30]`` (stp: ``s0·[1e-4, 1e4]``): the variance EMA starts near the size of the
    released coordinates, and one tensor's b can fall at most 30× below another's.
    """
    from adaclip.strategies import (
        AdaptiveClipping,
        AutomaticClipping,
        FlatClipping,
        QuantileClipping,
        QuantileRule,
    )

    c = float(max_grad_norm)
    if s0 not in TWIN_S0:
        raise ValueError(f"s0 must be one of {TWIN_S0}, got {s0!r}")
    start = c / math.sqrt(num_params)
    std_range = SEPARATED_STD if s0 == "fixed" else {"std_min": start / 30.0, "std_max": start * 30.0}
    stp_range = {} if s0 == "fixed" else {"std_min": start / 1e4, "std_max": start * 1e4}
    sep = dict(std_range, scale="separated", max_grad_norm=c)
    if method == "flat":
        return FlatClipping(c)
    if method == "ada-patent":
        return AdaptiveClipping.from_initial_clip(c, num_params, beta_std=TWIN_BETA_STD)
    if method == "ada-unbiased":
        return AdaptiveClipping.from_initial_clip(c, num_params, beta_std=TWIN_BETA_STD, correction="unbiased")
    if method == "ada-tensor":
        return AdaptiveClipping(**sep, beta_std=TWIN_BETA_STD, pooling="tensor", correction="unbiased")
    if method == "ada-factored":
        return AdaptiveClipping(**sep, beta_std=TWIN_BETA_STD, pooling="factored", correction="unbiased")
    if method == "ada-delayed":
        return AdaptiveClipping(**sep, beta_std=TWIN_BETA_STD**DELAY, pooling="tensor", correction="unbiased",
                                update_every=DELAY)  # fmt: skip
    if method == "ada-public":
        return AdaptiveClipping(**sep, pooling="tensor", freeze_statistics=True)
    if method == "stp":
        return AdaptiveClipping.scale_then_privatize(c, **stp_range)
    if method == "centre-debiased":
        return AdaptiveClipping(**sep, centre="debiased", beta_mean=0.999, freeze_statistics=True)
    if method == "centre-kalman":
        return AdaptiveClipping(**sep, centre="kalman", freeze_statistics=True)
    if method == "centre-quantile":
        return AdaptiveClipping(**sep, centre="kalman", freeze_statistics=True, quantile=QuantileRule())
    if method == "quantile":
        return QuantileClipping(c, QuantileRule())
    if method == "automatic":
        return AutomaticClipping(max_grad_norm=c)
    raise ValueError(f"no twin strategy for {method!r}")


def _flat_numpy(x: Any, shape: tuple[int, ...]) -> np.ndarray:
    if hasattr(x, "detach"):
        x = x.detach().cpu()
    return np.broadcast_to(np.asarray(x, dtype=np.float64), shape).ravel()


def scale_diagnostic(strategy: Any, state: Any, initial_state: Any, shapes: list[tuple[int, ...]]) -> dict[str, Any]:
    """Does the transform adapt? From ``strategy.transform`` of the final and the initial
    state (functions of released values only; of public data for ``ada-public``'s start).

    Whole vector: ``q90_q10`` (spread of b over all coordinates: 1 for flat clipping),
    ``between`` (max/min over tensors of the tensor's mean b), ``within`` (the largest
    within-tensor q90/q10), ``moved = ‖b − b⁰‖/‖b⁰‖``, ``level = mean b / mean b⁰`` (C_t/C0 for
    the quantile rule), ``centre = ‖a/b‖`` (the centre in clip units; 0 without one), and
    ``q90_q10_start`` (the spread at step 0: > 1 only for public statistics). ``tensors``: the
    per-tensor rows of :func:`adaclip.diagnostics.scale_report` where that module exists.
    """
    num = len(shapes)
    centre, scale = strategy.transform(state, num)
    _, scale0 = strategy.transform(initial_state, num)
    b = [_flat_numpy(s, shape) for s, shape in zip(scale, shapes, strict=True)]
    b0 = [_flat_numpy(s, shape) for s, shape in zip(scale0, shapes, strict=True)]
    a = [np.zeros_like(x) for x in b] if centre is None else [
        _flat_numpy(c, shape) for c, shape in zip(centre, shapes, strict=True)
    ]  # fmt: skip
    allb, allb0 = np.concatenate(b), np.concatenate(b0)

    def spread(x: np.ndarray) -> float:
        q10, q90 = np.quantile(x, [0.1, 0.9])
        return float(q90 / q10) if q10 > 0 else math.inf

    means = np.array([x.mean() for x in b])
    out: dict[str, Any] = {
        "q90_q10": spread(allb),
        "max_min": float(allb.max() / allb.min()) if allb.min() > 0 else math.inf,
        "between": float(means.max() / means.min()) if means.min() > 0 else math.inf,
        "within": max(spread(x) for x in b),
        "moved": float(np.linalg.norm(allb - allb0) / np.linalg.norm(allb0)),
        "level": float(allb.mean() / allb0.mean()),
        "centre": float(np.sqrt(sum(float(np.sum((x / y) ** 2)) for x, y in zip(a, b, strict=True)))),
        "q90_q10_start": spread(allb0),
    }
    try:
        from adaclip.diagnostics import scale_report
    except ImportError:
        return out
    params = [np.zeros(shape) for shape in shapes]
    out["tensors"] = [r._asdict() for r in scale_report(strategy, state, initial_state=initial_state, params=params)]
    return out


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
    optimizer: str = "sgd",
    twin_s0: str = "fixed",
) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = task.make_model(seed)
    inner = make_optimizer(optimizer, model.parameters(), hp["lr"])
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
        optimizer = inner
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
        sigma = calibrated_sigma(target_epsilon=epsilon, delta=delta, sample_rate=q,
                                 steps=epochs * steps_per_epoch)
        cls = {"adaclip": AdaClip, "flat": FlatClip, "per_layer": PerLayerClip, "scaled": ScaledClip}[method]
        if method not in ("adaclip", "flat", "per_layer", "scaled"):
            raise ValueError(f"{method!r} is example-level only (user-level tasks run the four original methods)")
        opt = cls(inner, model, noise_multiplier=sigma, expected_batch_size=sampler.expected_batch_size,
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
        if method in TWIN_METHODS:
            strategy = twin_strategy(method, hp["max_grad_norm"], sum(p.numel() for p in model.parameters()),
                                     s0=twin_s0)
            if method == "ada-public":  # before the grad-sample hooks are attached
                grads = [torch.as_tensor(g) for g in public_per_example_grads_torch(task, model)]
            opt = make_private_twin(task, model, inner, x_tr, y_tr, strategy, epsilon=epsilon, delta=delta,
                                    epochs=epochs, seed=seed)
            loader = opt.twin_loader
            if method == "ada-public":
                if hasattr(opt, "use_public_statistics"):
                    opt.use_public_statistics(grads)
                else:  # the core method on the wrapper's state (before any step)
                    opt._clip_state = strategy.with_public_statistics(opt.clip_state, grads)
            initial_state = opt.clip_state
        else:
            from adaclip_torch import make_private
            from adaclip_torch.data import sample_rate_for, steps_per_epoch

            loader = DataLoader(TensorDataset(x_tr, y_tr), batch_size=int(task.batch_size))
            # the σ make_private would calibrate for (ε, δ, epochs) (RDP, epochs·round(1/q) steps at
            # q = B/N), memoised across methods and seeds; make_private still checks it fits the budget
            q = sample_rate_for(int(task.batch_size), len(y_tr))
            sigma = calibrated_sigma(target_epsilon=epsilon, delta=delta, sample_rate=q,
                                     steps=epochs * steps_per_epoch(q))
            # rounds one and two compare clipping under DP-SGD's noise: independent, as recorded
            model, opt, loader = make_private(model, inner, loader, noise_multiplier=sigma, target_epsilon=epsilon,
                                              delta=delta, epochs=epochs, strategy=method, seed=seed,
                                              noise_mechanism="independent", **strategy_kwargs)
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
    if method in TWIN_METHODS:
        result["diagnostic"] = scale_diagnostic(opt.strategy, opt.clip_state, initial_state,
                                                [tuple(p.shape) for p in opt.params])
    if hasattr(opt, "remove_hooks"):
        opt.remove_hooks()
    return result


def make_private_twin(
    task: Task,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    strategy: Any,
    *,
    epsilon: float,
    delta: float,
    epochs: int,
    seed: int,
) -> Any:
    """``make_private(model, optimizer, loader, target_epsilon=, delta=, epochs=, seed=)`` for a
    strategy object (``make_private`` takes strategy names only): the same q = B̄/N, the same
    σ (RDP, calibrated for ``epochs·round(1/q)`` steps), the same Poisson loader seeded with
    ``seed + 1``, the same noise seed and accountant, so a twin shares flat clipping's batches
    and noise stream. Returns the :class:`adaclip_torch.DPOptimizer`; its loader is
    ``.twin_loader``."""
    import adaclip.accounting as accounting
    from adaclip_torch import DPOptimizer
    from adaclip_torch.data import poisson_data_loader, sample_rate_for, steps_per_epoch

    dataset = TensorDataset(x, y)
    q = sample_rate_for(int(task.batch_size), len(dataset))
    num_steps = steps_per_epoch(q)
    # make_private's calibration (RDP, epochs·round(1/q) steps at q), memoised for the harness
    sigma = calibrated_sigma(target_epsilon=epsilon, delta=delta, sample_rate=q, steps=epochs * num_steps)
    generator = torch.Generator()
    generator.manual_seed(int(seed) + 1)
    loader = poisson_data_loader(dataset, q, num_steps=num_steps, generator=generator)
    with warnings.catch_warnings():  # κ > 1 warnings: the harness reports κ itself
        warnings.simplefilter("ignore", NoiseDominatedWarning)
        opt = DPOptimizer(
            optimizer, model, strategy=strategy, noise_multiplier=sigma, expected_batch_size=q * len(dataset),
            accountant=accounting.Accountant("rdp", target_epsilon=epsilon, delta=delta), sample_rate=q,
            seed=int(seed), use_kernel=False,  # the core path (CPU: what make_private's auto gives flat)
        )  # fmt: skip
    opt.twin_loader = loader
    return opt


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
    optimizer: str = "sgd",
) -> dict[str, Any]:
    """Digits tasks only, SGD with momentum only. The initial parameters are the PyTorch model's (same seed), so the
    two frameworks start from the same point; sampling and noise streams differ."""
    import jax
    import jax.numpy as jnp
    import optax

    import adaclip_jax

    if task.user_level or not task.name.startswith("digits"):
        raise ValueError("the JAX path covers the digits tasks")
    if optimizer != "sgd" or method in TWIN_METHODS:
        raise ValueError("the JAX path runs SGD with momentum and the four original methods")
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

    sigma = calibrated_sigma(target_epsilon=epsilon, delta=delta, sample_rate=q, steps=total)
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
