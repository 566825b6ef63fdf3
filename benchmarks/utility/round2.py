"""Utility benchmark, round two: every method at an equal tuning budget, and the tuning-free
protocol, on the round-two tasks (:mod:`tasks_round2`) and the first round's.

One command per (task, inner optimizer), from the repository root::

    python benchmarks/utility/round2.py --task raw-digits-mlp --optimizer adam --epsilons 1 3 8 --seeds 3
    python benchmarks/utility/round2.py --report benchmarks/results/round2_*.json

Protocol, per (task, inner optimizer, ε):

1. **Equal budget.** Every private method of :data:`METHODS` gets the same grid, the task's
   two learning rates × ``C ∈ {0.1, 1}`` (4 configurations; ``C`` is the clip norm, or the
   initial clip norm of the adaptive methods, which start as flat clipping's ball of radius
   ``C``). Each configuration trains on the training set minus a 20 % validation split
   (by user at user level) with ``--tune-seeds`` seeds; the best validation mean wins.
2. **Tuning-free.** Each method at its default ``C = 1`` with only the learning rate tuned
   (the configurations of step 1 with ``C = 1``), and the patent's AdaCliP at its own
   defaults (``std_min = 1e-5``, ``std_max = 1``, ``β2 = 0.9``) with the learning rate tuned.
3. **Final runs.** Every winner is retrained on the whole training set with seeds
   ``0..S−1`` and scored on the test split, which tuning never reads. Within a seed every
   method shares the model initialisation, the Poisson batches and the noise generator's
   seed, so differences are paired.

Every method of one (task, ε) has the same q = B̄/N, steps, δ = 1e-5 and σ (RDP-calibrated
for the whole run); the quantile rule spends part of σ on its count and the accountant
records σ. The inner optimizer is SGD with momentum 0.9 or Adam (β = (0.9, 0.999)); all
methods of a cell share it.

``--framework jax`` runs the MLP tasks with ``optax.chain(adaclip_jax.private_aggregate(
strategy, ...), optax.sgd|adam)`` on per-example gradients of the Poisson batch (padded to
a multiple of 32, padding masked out), from the PyTorch model's initial weights. With
``--winners-from`` it skips tuning and reuses PyTorch's winners.

Output: ``benchmarks/results/round2_<task>_<framework>_<optimizer>[tag].json``; ``--report``
(the same as ``report_round2.py FILES``) turns a set of them into the Markdown tables of
``benchmarks/results/utility_round2.md`` and the plots. The methods and grids are
:mod:`methods_round2`'s.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import sys
import time
import warnings
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from calibration import calibrated_sigma  # noqa: E402
from methods_round2 import (  # noqa: E402,F401  (re-exported: tests and round3 use them from here)
    ADAM_LRS,
    ADAPTIVE,
    BASELINES,
    BETA_STD,
    CLIPS,
    DEFAULT_CLIP,
    METHODS,
    PATENT_DEFAULTS,
    SGD_LRS,
    grid,
    strategy_for,
)
from run import machine, summarise, versions  # noqa: E402
from tasks_round2 import ROUND2_TASKS, load_round2_task  # noqa: E402
from torch import nn  # noqa: E402
from utility_tasks import TASKS, Task, load_task, split_validation  # noqa: E402
from utility_train import (  # noqa: E402
    OPTIMIZERS,
    evaluate,
    is_language_model,
    make_optimizer,
    make_private_twin,
    scale_diagnostic,
    task_loss,
)

import adaclip.accounting as accounting  # noqa: E402
from adaclip import _progress  # noqa: E402
from adaclip.errors import NoiseDominatedWarning  # noqa: E402

RESULTS = HERE.parent / "results"
DELTA = 1e-5

def load(name: str) -> Task:
    return load_round2_task(name) if name in ROUND2_TASKS else load_task(name)


def trainable(model: nn.Module) -> list[torch.Tensor]:
    return [p for p in model.parameters() if p.requires_grad]


def spread_of(strategy: Any, state: Any, shapes: list[tuple[int, ...]]) -> float:
    """q90/q10 of the clip scale b over all coordinates (1 for a flat shape)."""
    _, scale = strategy.transform(state, len(shapes))
    b = np.concatenate([np.broadcast_to(np.asarray(s.detach().cpu() if hasattr(s, "detach") else s, np.float64),
                                        shape).ravel() for s, shape in zip(scale, shapes, strict=True)])  # fmt: skip
    q10, q90 = np.quantile(b, [0.1, 0.9])
    return float(q90 / q10) if q10 > 0 else math.inf


# --------------------------------------------------------------------------- PyTorch


def train_torch(task: Task, method: str, hp: dict[str, float], *, optimizer: str, epsilon: float, seed: int,
                train_idx: np.ndarray, eval_idx: np.ndarray | None, epochs: int, trace: bool = False) -> dict[str, Any]:
    """One private run; scored on ``task.x_train[eval_idx]`` (validation) or the test split
    (``eval_idx=None``). ``trace``: record the clip scale's spread after every epoch."""
    torch.manual_seed(seed)
    model = task.make_model(seed)
    params = trainable(model)
    num_params = sum(p.numel() for p in params)
    inner = make_optimizer(optimizer, params, hp["lr"])
    strategy = strategy_for(method, hp["max_grad_norm"], num_params)
    x_tr = torch.as_tensor(task.x_train[train_idx])
    y_tr = torch.as_tensor(task.y_train[train_idx])
    if task.user_level:
        from adaclip_torch import DPOptimizer, PoissonUserBatchSampler

        users = torch.as_tensor(task.user_train[train_idx])
        n_units = int(torch.unique(users).numel())
        q = task.batch_size / n_units
        per_epoch = max(1, round(1 / q))
        sigma = calibrated_sigma(target_epsilon=epsilon, delta=DELTA, sample_rate=q, steps=epochs * per_epoch,
                                 accountant="rdp")  # fmt: skip
        sampler = PoissonUserBatchSampler(users, q, num_steps=per_epoch, generator=torch.Generator().manual_seed(seed + 1))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", NoiseDominatedWarning)
            opt = DPOptimizer(inner, model, strategy=strategy, noise_multiplier=sigma,
                              expected_batch_size=sampler.expected_batch_size,
                              accountant=accounting.Accountant("rdp", target_epsilon=epsilon, delta=DELTA),
                              sample_rate=q, seed=seed, use_kernel=False)  # fmt: skip
        batches = lambda: ((torch.as_tensor(i),) for i in sampler)  # noqa: E731
    else:
        opt = make_private_twin(task, model, inner, x_tr, y_tr, strategy, epsilon=epsilon, delta=DELTA,
                                epochs=epochs, seed=seed)  # fmt: skip
        batches = lambda: iter(opt.twin_loader)  # noqa: E731
    shapes = [tuple(p.shape) for p in opt.params]
    initial_state = opt.clip_state
    spreads = []
    for _ in range(epochs):
        for batch in batches():
            if task.user_level:
                idx = batch[0]
                if len(idx) == 0:
                    opt.step(empty_batch=True)
                else:
                    task_loss(task, model, x_tr[idx], x_tr[idx]).backward()
                    opt.step(user_ids=users[idx])
            else:
                x, y = batch
                if len(x) == 0:
                    opt.step(empty_batch=True)
                else:
                    task_loss(task, model, x, y).backward()
                    opt.step()
            opt.zero_grad()
        if trace and hasattr(opt.strategy, "transform"):
            spreads.append(spread_of(opt.strategy, opt.clip_state, shapes))
    if eval_idx is None:
        scores = evaluate(task, model, task.x_test, task.y_test)
    else:
        scores = evaluate(task, model, task.x_train[eval_idx], task.y_train[eval_idx])
    out = {**scores, "epsilon": opt.accountant.epsilon(DELTA), "sigma": float(opt.hyperparameters().noise_multiplier),
           "steps": opt.steps}  # fmt: skip
    if trace and hasattr(opt.strategy, "transform"):
        out["spread"] = spreads
        out["diagnostic"] = {k: v for k, v in scale_diagnostic(opt.strategy, opt.clip_state, initial_state, shapes).items()
                             if k != "tensors"}  # fmt: skip
    opt.remove_hooks()
    return out


# --------------------------------------------------------------------------- JAX


def train_jax(task: Task, method: str, hp: dict[str, float], *, optimizer: str, epsilon: float, seed: int,
              train_idx: np.ndarray, eval_idx: np.ndarray | None, epochs: int, trace: bool = False) -> dict[str, Any]:
    """The same run in JAX (MLP tasks, example level, all parameters trainable): the PyTorch
    model's initial weights, Poisson batches drawn with ``default_rng(seed + 1)``, noise from
    ``jax.random.key(seed)`` (so sampling and noise differ from PyTorch's streams)."""
    import jax
    import jax.numpy as jnp
    import optax

    import adaclip_jax

    torch_model = task.make_model(seed)
    if len(trainable(torch_model)) != len(list(torch_model.parameters())) or is_language_model(task):
        raise ValueError("the JAX path covers MLP tasks with every parameter trained")
    linears = [m for m in torch_model.modules() if isinstance(m, nn.Linear)]
    act = jnp.tanh if any(isinstance(m, nn.Tanh) for m in torch_model.modules()) else jax.nn.relu
    params = [{"w": jnp.asarray(m.weight.detach().numpy().T), "b": jnp.asarray(m.bias.detach().numpy())}
              for m in linears]  # fmt: skip
    num_params = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(params))

    def logits_fn(p, x):
        for layer in p[:-1]:
            x = act(x @ layer["w"] + layer["b"])
        return x @ p[-1]["w"] + p[-1]["b"]

    def example_loss(p, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(logits_fn(p, x[None]), y[None])[0]

    grads_fn = adaclip_jax.per_example_grads(example_loss, batch_argnums=(1, 2))
    x_tr, y_tr = task.x_train[train_idx], task.y_train[train_idx]
    n = len(y_tr)
    q = task.batch_size / n
    per_epoch = max(1, round(1 / q))
    total = epochs * per_epoch
    sigma = calibrated_sigma(target_epsilon=epsilon, delta=DELTA, sample_rate=q, steps=total, accountant="rdp")
    strategy = strategy_for(method, hp["max_grad_norm"], num_params)
    private = adaclip_jax.private_aggregate(strategy, noise_multiplier=sigma, expected_batch_size=task.batch_size,
                                            key=jax.random.key(seed))  # fmt: skip
    inner = optax.sgd(hp["lr"], momentum=0.9) if optimizer == "sgd" else optax.adam(hp["lr"])
    tx = optax.chain(private, inner)
    opt_state = tx.init(params)

    @jax.jit
    def step(p, state, x, y, mask, *, noise_multiplier):
        updates, state = tx.update(grads_fn(p, x, y), state, p, unit_mask=mask, noise_multiplier=noise_multiplier)
        return optax.apply_updates(p, updates), state

    tracker = adaclip_jax.PrivacyTracker(accounting.Accountant("rdp", target_epsilon=None), sample_rate=q,
                                         noise_multiplier=sigma)  # fmt: skip
    rng = np.random.default_rng(seed + 1)
    for _ in range(total):
        idx = np.flatnonzero(rng.random(n) < q)
        width = max(32, 32 * math.ceil(len(idx) / 32))  # padded: few compiled shapes, padding masked out
        pad = np.zeros(width, dtype=np.int64)
        pad[: len(idx)] = idx
        mask = np.arange(width) < len(idx)
        params, opt_state = tracker.step(step, params, opt_state, jnp.asarray(x_tr[pad]), jnp.asarray(y_tr[pad]),
                                         jnp.asarray(mask))  # fmt: skip
    ex, ey = (task.x_test, task.y_test) if eval_idx is None else (task.x_train[eval_idx], task.y_train[eval_idx])
    acc = float(jnp.mean(jnp.argmax(logits_fn(params, jnp.asarray(ex)), -1) == jnp.asarray(ey)))
    return {"metric": acc, "epsilon": tracker.epsilon(DELTA), "sigma": float(sigma), "steps": total}


# --------------------------------------------------------------------------- protocol


def run_cell(task: Task, args: argparse.Namespace, epsilon: float, reuse: dict[str, Any] | None) -> dict[str, Any]:
    """Tuning, tuning-free picks and final runs of one (task, optimizer, ε); a progress bar
    counts the training runs on a terminal (off with ``--quiet`` or when stderr is not one)."""
    bar = _progress.progress(False if args.quiet else None, f"{task.name}, ε = {epsilon:g}", unit="run")
    try:
        return _run_cell(task, args, epsilon, reuse, bar)
    finally:
        bar.close()


def _run_cell(
    task: Task, args: argparse.Namespace, epsilon: float, reuse: dict[str, Any] | None, bar: Any
) -> dict[str, Any]:
    base_trainer = train_jax if args.framework == "jax" else train_torch

    def trainer(*a: Any, **k: Any) -> dict[str, Any]:
        out = base_trainer(*a, **k)
        bar.update(1)
        return out

    train_sub, val = split_validation(task)
    full = np.arange(len(task.y_train))
    epochs = args.epochs or task.epochs
    kw = {"optimizer": args.optimizer, "epsilon": epsilon, "epochs": epochs}
    cell: dict[str, Any] = {"epsilon": epsilon, "tuning": {}, "winners": {}, "tuning_free": {}, "final": {}}
    configs = grid(task.name, args.optimizer)

    def tune(method: str, hps: list[dict[str, float]]) -> list[dict[str, Any]]:
        rows = []
        for hp in hps:
            vals = [trainer(task, method, hp, seed=1000 + s, train_idx=train_sub, eval_idx=val, **kw)["metric"]
                    for s in range(args.tune_seeds)]  # fmt: skip
            rows.append({"hp": hp, "val": vals, "val_mean": float(np.mean(vals))})
        return rows

    picks: dict[str, dict[str, float]] = {}
    for method in args.methods:
        if reuse is not None:
            cell["winners"][method] = reuse["winners"][method]
            picks[f"{method}|tuned"] = reuse["winners"][method]["hp"]
            continue
        rows = tune(method, configs)
        cell["tuning"][method] = rows
        best = max(rows, key=lambda r: r["val_mean"])  # ties: the first in grid order
        cell["winners"][method] = best
        picks[f"{method}|tuned"] = best["hp"]
        if not args.no_tuning_free:
            at_default = [r for r in rows if r["hp"]["max_grad_norm"] == DEFAULT_CLIP]
            free = max(at_default, key=lambda r: r["val_mean"])
            cell["tuning_free"][method] = free
            picks[f"{method}|free"] = free["hp"]
    if reuse is None and not args.no_tuning_free:
        lrs = sorted({c["lr"] for c in configs})
        rows = tune(PATENT_DEFAULTS, [{"lr": lr, "max_grad_norm": DEFAULT_CLIP} for lr in lrs])
        cell["tuning"][PATENT_DEFAULTS] = rows
        cell["tuning_free"][PATENT_DEFAULTS] = max(rows, key=lambda r: r["val_mean"])
        picks[f"{PATENT_DEFAULTS}|free"] = cell["tuning_free"][PATENT_DEFAULTS]["hp"]
    done: dict[tuple[str, tuple], dict[str, Any]] = {}
    for key, hp in picks.items():
        method = key.split("|")[0]
        ident = (method, tuple(sorted(hp.items())))
        if ident not in done:
            runs = []
            for seed in range(args.seeds):
                r = trainer(task, method, hp, seed=seed, train_idx=full, eval_idx=None,
                            trace=method in ADAPTIVE + (PATENT_DEFAULTS,), **kw)  # fmt: skip
                r["seed"] = seed
                runs.append(r)
            done[ident] = {"method": method, "hp": hp, "runs": runs, "test": summarise([r["metric"] for r in runs]),
                           "sigma": runs[0]["sigma"], "steps": runs[0]["steps"],
                           "epsilon_spent": max(r["epsilon"] for r in runs)}  # fmt: skip
        cell["final"][key] = done[ident]
    return cell


def cell_table(cell: dict[str, Any], metric: str) -> str:
    """The final runs of one cell: method, protocol, configuration, test metric (mean ± std
    over seeds), σ and the largest ε any seed's accountant reported."""
    lines = [f"| method | protocol | lr | C | test {metric} | σ | ε spent |", "|---|---|---|---|---|---|---|"]
    for key, f in cell["final"].items():
        method, protocol = key.split("|")
        clip = "—" if method == PATENT_DEFAULTS else f"{f['hp']['max_grad_norm']:g}"
        lines.append(f"| {method} | {'tuned lr × C' if protocol == 'tuned' else 'defaults, lr tuned'} | "
                     f"{f['hp']['lr']:g} | {clip} | {f['test']['mean']:.3f} ± {f['test']['std']:.3f} | "
                     f"{f['sigma']:.3f} | {f['epsilon_spent']:.3f} |")  # fmt: skip
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    logging.getLogger("absl").setLevel(logging.ERROR)
    task = load(args.task)
    if args.batch_size is not None:
        task.batch_size = float(args.batch_size)
    reuse = json.loads(args.winners_from.read_text()) if args.winners_from else None
    model = task.make_model(0)
    out: dict[str, Any] = {
        "task": task.name, "framework": args.framework, "optimizer": OPTIMIZERS[args.optimizer],
        "optimizer_name": args.optimizer, "delta": DELTA, "epsilons": list(args.epsilons),
        "seeds": list(range(args.seeds)), "tune_seeds": list(range(args.tune_seeds)), "epochs": args.epochs or task.epochs,
        "expected_batch_size": task.batch_size, "metric": task.metric, "user_level": task.user_level,
        "num_params": sum(p.numel() for p in trainable(model)), "units_train": int(
            len(np.unique(task.user_train)) if task.user_level else len(task.y_train)),
        "grid": grid(task.name, args.optimizer), "methods": list(args.methods),
        "command": "python benchmarks/utility/round2.py " + " ".join(sys.argv[1:]),
        "versions": versions(), "machine": machine(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "cells": {},
    }  # fmt: skip
    start = time.perf_counter()
    for eps in args.epsilons:
        t0 = time.perf_counter()
        cell_reuse = None if reuse is None else reuse["cells"][str(eps)]
        out["cells"][str(eps)] = run_cell(task, args, eps, cell_reuse)
        if not args.quiet:
            print(f"\n{task.name}, {args.framework}, {OPTIMIZERS[args.optimizer]}, ε = {eps:g}, δ = {DELTA:g} "
                  f"({time.perf_counter() - t0:.0f} s)\n{cell_table(out['cells'][str(eps)], task.metric)}", flush=True)  # fmt: skip
    out["wall_seconds"] = time.perf_counter() - start
    return out


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", choices=TASKS + ROUND2_TASKS)
    p.add_argument("--optimizer", choices=tuple(OPTIMIZERS), default="sgd")
    p.add_argument("--framework", choices=("torch", "jax"), default="torch")
    p.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 3.0, 8.0])
    p.add_argument("--seeds", type=int, default=3, help="final-run seeds 0..S-1")
    p.add_argument("--tune-seeds", type=int, default=1)
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--epochs", type=int, default=None, help="override the task's epochs (tests, smoke runs)")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--no-tuning-free", action="store_true")
    p.add_argument("--winners-from", type=Path, default=None, help="reuse the tuned winners of an earlier JSON")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--tag", default="")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--report", type=Path, nargs="+", default=None, help="print the tables of these JSONs")
    p.add_argument("--plots", type=Path, default=None, help="with --report: write the plots into this folder")
    args = p.parse_args(argv)
    if args.report:  # the report's own command: report_round2.py FILES [--plots DIR]
        import report_round2

        report_round2.main([str(f) for f in args.report] + ([] if args.plots is None else ["--plots", str(args.plots)]))
        return None
    if args.task is None:
        p.error("--task is required (or --report)")
    if args.winners_from is not None:
        args.no_tuning_free = True
    out = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"round2_{args.task}_{args.framework}_{args.optimizer}{args.tag}.json"
    path.write_text(json.dumps(out, indent=1, default=str))
    print(f"wrote {path} ({out['wall_seconds']:.0f}s)")
    return out


if __name__ == "__main__":
    main()
