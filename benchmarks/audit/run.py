"""Auditing benchmark: measured leakage next to accuracy, for every method of the utility benchmark.

One command, from the repository root (run the file: ``python -m benchmarks.audit.run`` is
shadowed by an unrelated ``benchmarks`` package in site-packages)::

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/audit/run.py --tasks digits-mlp mnist1d-mlp

For each task, method (non-private, flat, per-layer, eDP-SGD "scaled", AdaCliP) and ε ∈ {1, 3, 8}
the configuration is the utility benchmark's validation winner, read from
``benchmarks/results/utility_<task>_torch.json`` (nothing is tuned here), trained with
``benchmarks/utility/utility_train.train_torch`` (PyTorch, SGD with momentum 0.9, σ calibrated by
``adaclip.accounting`` for the target ε over the whole run, Poisson sampling q = B̄/N). Per seed:

1. **Data.** Before anything is trained, a fixed canary pool of ``m`` examples is carved out of
   the training set (the test split stays untouched). The remaining *real* training set is
   what every model of this benchmark learns from.
2. **Black-box canaries.** :func:`adaclip.audit.input_canaries.mislabelled_canaries` gives each
   pool example a wrong label (uniform over the other classes) and includes it with
   probability 1/2, independently; the included ones are appended to the real training set, so
   N = |real| + #included and q = B̄/N, σ and the number of steps follow from that N: the
   accountant's ε is the stated ε for the data set actually trained on.
3. **Target run.** The method's winner trains on that set; test accuracy on the test split.
4. **One-run audit.** Score of a canary = −(cross-entropy of the trained model on the canary's
   wrong label); :func:`adaclip.audit.report.audit_scores` turns the m scores and the inclusion
   coins into the one-run lower bound ε_emp (Steinke, Nasr & Jagielski 2023; 95 %, δ = 1e-5)
   and the Gaussian-DP fit (a parametric estimate, not a certificate).
5. **Membership inference.** Members: a random subset of the real training set, as large as
   the test split; non-members: the test split (never trained on, never used for any choice).
   Loss-threshold attack (Yeom et al. 2018) on their per-example losses, and a shadow-model
   attack (Shokri et al. 2017): ``K = 2`` shadow models trained with the same method,
   hyperparameters, schedule and ε on a shadow pool = the real training set minus the evaluated
   members (so disjoint from the evaluated members and non-members); ``shadow_model_attack``
   cuts the pool into 2K disjoint parts (each shadow's members and non-members), so a shadow
   trains on about a sixth of the target's N (σ calibrated for its own N). The attack model
   (logistic regression on the sorted output probabilities plus the loss of the true label) is
   applied to the target's outputs on the evaluated members / non-members.

Reported per cell: mean ± standard error over seeds of test accuracy, ε_emp, GDP-fit ε, AUC
(loss and shadow) and TPR at 1 % / 10 % FPR; the accountant's ε both as the RDP accountant the
run used (``ε spent``) and as the tighter PLD accountant of the same (σ, q, steps). Also: the
largest ε the one-run bound could certify at this m (perfectly separated scores), which bounds
what a black-box audit with m canaries can show at all. And a negative control: the loss attack
on the excluded canaries' inputs with their *true* labels (training-split examples never trained
on) against the test split, which must give AUC ≈ 0.5: the AUC of "no membership" at these sizes.

Output: ``benchmarks/results/audit_<task>_torch[_quick][tag].json`` (configuration, every per-seed
value, canary scores, versions, machine, date, command, wall time) and
``audit_<task>_torch[...]_vs_epsilon.png``. ``--quick``: 1 seed, ε = 8, 3 epochs, 40 canaries
(a smoke run). Cost: about 5 minutes for both tasks on one CPU thread (2-core machine).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import importlib.util
import json
import logging
import math
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
UTILITY = HERE.parent / "utility"
RESULTS = HERE.parent / "results"
sys.path.insert(0, str(UTILITY))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from utility_tasks import Task, load_task  # noqa: E402
from utility_train import train_torch  # noqa: E402

from adaclip.accounting import Accountant  # noqa: E402
from adaclip.audit.estimators import one_run_epsilon  # noqa: E402
from adaclip.audit.input_canaries import InputCanaries, mislabelled_canaries  # noqa: E402
from adaclip.audit.membership import loss_threshold_attack, shadow_model_attack  # noqa: E402
from adaclip.audit.report import AuditReport, audit_scores  # noqa: E402

TASKS = ("digits-mlp", "mnist1d-mlp")
METHODS = ("nonprivate", "flat", "per_layer", "scaled", "adaclip")
DELTA = 1e-5
CONFIDENCE = 0.95
FPRS = (0.01, 0.1)
NUM_CLASSES = 10
# m per task: the canary pool is carved out of the training set, and about half of it is
# included with wrong labels; m is chosen so that the included canaries are ≈ 7 % of the
# trained-on set (label noise the methods' accuracy tolerates) and the pool ≤ 14 % of the
# training split. The one-run bound grows only like log m (see max_certifiable_epsilon).
NUM_CANARIES = {"digits-mlp": 200, "mnist1d-mlp": 500}
NUM_SHADOWS = 2  # the shadow pool is cut into 2·K disjoint parts: K = 2 keeps each shadow's N largest
SHADOW_FEATURES = "sorted_loss"  # the sorted output probabilities plus the loss of the true label
LAYOUT_SEED = 20_231  # the canary pool (fixed for the task)
CANARY_SEED = 30_000  # + seed: canary labels and inclusion coins
MEMBER_SEED = 40_000  # + seed: the evaluated members
SHADOW_SEED = 50_000  # + seed: shadow splits and shadow training seeds


def _utility_run() -> Any:
    """The utility harness's ``run.py`` (its versions(), machine())."""
    if "utility_run" in sys.modules:
        return sys.modules["utility_run"]
    spec = importlib.util.spec_from_file_location("utility_run", UTILITY / "run.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["utility_run"] = mod
    spec.loader.exec_module(mod)
    return mod


# --------------------------------------------------------------------------- data


@dataclasses.dataclass(frozen=True)
class Layout:
    """Indices into the task's training split: the real training set and the canary pool."""

    real: np.ndarray
    pool: np.ndarray


def carve_pool(num_train: int, num_canaries: int, *, seed: int = LAYOUT_SEED) -> Layout:
    """Split ``range(num_train)`` into the canary pool (``num_canaries`` examples, random) and
    the real training set (the rest), before any training."""
    if not 0 < num_canaries < num_train:
        raise ValueError(f"num_canaries must be in (0, {num_train}), got {num_canaries}")
    perm = np.random.default_rng(seed).permutation(num_train)
    return Layout(real=np.sort(perm[num_canaries:]), pool=np.sort(perm[:num_canaries]))


def _with_data(task: Task, x: np.ndarray, y: np.ndarray, box: dict[str, Any]) -> Task:
    """A copy of ``task`` whose training split is ``(x, y)`` and whose model factory keeps the
    model it builds in ``box`` (``train_torch`` trains it in place and returns metrics only)."""

    def make(seed: int) -> torch.nn.Module:
        box["model"] = task.make_model(seed)
        return box["model"]

    return dataclasses.replace(task, x_train=x, y_train=y, make_model=make)


def train(
    task: Task,
    method: str,
    hp: dict[str, Any],
    *,
    epsilon: float | None,
    seed: int,
    x: np.ndarray,
    y: np.ndarray,
    epochs: int,
) -> tuple[torch.nn.Module, dict[str, Any]]:
    """One utility-harness run (``train_torch``) on ``(x, y)``; returns ``(model, result)``.
    The sample rate is ``q = B̄/len(x)`` (make_private's), and σ is calibrated for it."""
    box: dict[str, Any] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # noise-dominated (κ) warnings: the utility benchmark reports κ
        result = train_torch(
            _with_data(task, x, y, box), method, hp, epsilon=epsilon, delta=DELTA, seed=seed,
            train_idx=np.arange(len(y)), eval_x=task.x_test, eval_y=task.y_test, epochs=epochs,
        )  # fmt: skip
    model = box["model"]
    model.eval()
    return model, result


def outputs(model: torch.nn.Module, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(per-example cross-entropy, softmax probabilities)`` of ``model`` on ``(x, y)``."""
    with torch.no_grad():
        logits = model(torch.as_tensor(np.array(x, dtype=np.float32))).double()
        loss = torch.nn.functional.cross_entropy(
            logits, torch.as_tensor(np.array(y, dtype=np.int64)), reduction="none"
        )
        return loss.numpy(), torch.softmax(logits, dim=1).numpy()


def true_labels(canaries: InputCanaries, pool_x: np.ndarray, pool_y: np.ndarray) -> np.ndarray:
    """The pool's (true) label of each canary, found by matching its input row in the pool;
    checks that every canary's label is a wrong one."""
    flat_c = canaries.x.reshape(canaries.num_canaries, -1)
    flat_p = pool_x.reshape(len(pool_x), -1)
    match = np.array([np.flatnonzero(np.all(flat_p == row, axis=1))[0] for row in flat_c])
    y = pool_y[match].astype(np.int64)
    if np.any(y == canaries.y):
        raise AssertionError("a mislabelled canary kept its true label")
    return y


@functools.cache
def pld_epsilon(sigma: float, sample_rate: float, steps: int, delta: float = DELTA) -> float:
    """ε at ``delta`` of ``steps`` Poisson-subsampled Gaussian steps by the PLD accountant (the
    tighter accountant; the runs themselves are calibrated and tracked with RDP)."""
    acc = Accountant("pld")
    acc.record_released(noise_multiplier=sigma, sample_rate=sample_rate, num_steps=steps)
    return float(acc.epsilon(delta))


def max_certifiable_epsilon(
    included: np.ndarray, *, delta: float = DELTA, confidence: float = CONFIDENCE
) -> float:
    """The largest ε the one-run bound can certify with these inclusion coins: the bound on
    perfectly separated scores (every included canary above every excluded one)."""
    return float(
        one_run_epsilon(
            included.astype(np.float64), included, delta=delta, confidence=confidence
        ).epsilon_lower
    )


# --------------------------------------------------------------------------- one cell


def _record(obj: Any) -> Any:
    """A frozen result dataclass as a JSON-ready dict (NumPy scalars/arrays to Python)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: _record(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): _record(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_record(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def shadow_trainer(
    task: Task, method: str, hp: dict[str, Any], *, epsilon: float | None, epochs: int
) -> Callable[[np.ndarray, np.ndarray, int], Callable[[np.ndarray], np.ndarray]]:
    """``train_shadow(x, y, seed) -> predict_proba`` for the shadow attack: the target's method,
    hyperparameters and ε (σ calibrated for the shadow's own N), the target's schedule."""

    def train_shadow(x: np.ndarray, y: np.ndarray, seed: int) -> Callable[[np.ndarray], np.ndarray]:
        model, _ = train(task, method, hp, epsilon=epsilon, seed=int(seed), x=x.astype(np.float32),
                         y=y.astype(np.int64), epochs=epochs)  # fmt: skip

        def predict_proba(xq: np.ndarray) -> np.ndarray:
            with torch.no_grad():
                return torch.softmax(model(torch.as_tensor(xq.astype(np.float32))).double(), dim=1).numpy()

        return predict_proba

    return train_shadow


def run_seed(
    task: Task,
    method: str,
    hp: dict[str, Any],
    *,
    epsilon: float | None,
    seed: int,
    layout: Layout,
    num_canaries: int,
    epochs: int,
    num_shadows: int,
) -> dict[str, Any]:
    """Train one target with canaries and audit it (canaries, loss attack, shadow attack)."""
    start = time.perf_counter()
    x_real, y_real = task.x_train[layout.real], task.y_train[layout.real]
    canaries: InputCanaries = mislabelled_canaries(
        task.x_train[layout.pool], task.y_train[layout.pool], num_canaries=num_canaries,
        num_classes=NUM_CLASSES, seed=CANARY_SEED + seed,
    )  # fmt: skip
    x, y = canaries.insert(x_real, y_real, seed=CANARY_SEED + seed)
    x, y = np.asarray(x, dtype=np.float32), np.asarray(y, dtype=np.int64)
    included = np.asarray(canaries.included, dtype=bool)
    model, result = train(task, method, hp, epsilon=epsilon, seed=seed, x=x, y=y, epochs=epochs)

    # One-run audit: canary score = −loss on the canary's (wrong) label.
    canary_loss, _ = outputs(
        model, np.asarray(canaries.x, dtype=np.float32), np.asarray(canaries.y, dtype=np.int64)
    )
    scores = -canary_loss
    q = float(task.batch_size) / len(y)
    private = epsilon is not None
    eps_pld = pld_epsilon(float(result["sigma"]), q, int(result["steps"])) if private else math.inf
    report: AuditReport = audit_scores(scores, included, delta=DELTA, confidence=CONFIDENCE,
                                       accountant_epsilon=epsilon if private else None)  # fmt: skip

    # Membership inference: members (subset of the real training set) vs the test split.
    n_out = len(task.y_test)
    rng = np.random.default_rng(MEMBER_SEED + seed)
    member_pos = np.sort(rng.choice(len(layout.real), size=n_out, replace=False))
    shadow_pos = np.setdiff1d(np.arange(len(layout.real)), member_pos)
    loss_in, prob_in = outputs(model, x_real[member_pos], y_real[member_pos])
    loss_out, prob_out = outputs(model, task.x_test, task.y_test)
    loss_attack = loss_threshold_attack(loss_in, loss_out, fprs=FPRS, confidence=CONFIDENCE)
    # Negative control: the excluded canaries' inputs with their true labels were never trained
    # on either, so "them vs the test split" must give AUC ≈ 0.5 (train and test splits exchangeable).
    true_y = true_labels(canaries, task.x_train[layout.pool], task.y_train[layout.pool])
    out_pool = ~included
    control_loss, _ = outputs(model, canaries.x[out_pool], true_y[out_pool])
    control = loss_threshold_attack(control_loss, loss_out, fprs=FPRS, confidence=CONFIDENCE)
    shadow = None
    if num_shadows > 0:
        shadow = shadow_model_attack(
            train_shadow=shadow_trainer(task, method, hp, epsilon=epsilon, epochs=epochs),
            shadow_data=(x_real[shadow_pos], y_real[shadow_pos]),
            target_outputs_members=prob_in, target_outputs_nonmembers=prob_out,
            target_labels_members=y_real[member_pos], target_labels_nonmembers=task.y_test,
            num_shadows=num_shadows, seed=SHADOW_SEED + seed, fprs=FPRS, confidence=CONFIDENCE,
            features=SHADOW_FEATURES,
        )  # fmt: skip
    return {
        "seed": seed,
        "test_accuracy": float(result["metric"]),
        "train_size": int(len(y)),
        "real_train_size": int(len(y_real)),
        "num_included": int(included.sum()),
        "sample_rate": q if private else None,
        "sigma": float(result["sigma"]),
        "steps": int(result["steps"]),
        "accountant_epsilon_rdp": float(result["epsilon"]),
        "accountant_epsilon_pld": eps_pld,
        "epsilon_lower": float(report.epsilon_lower),
        "gdp_epsilon": float(report.gdp.epsilon) if report.gdp is not None else None,
        "exceeds_accountant": bool(private and report.epsilon_lower > min(epsilon, eps_pld)),
        "max_certifiable_epsilon": max_certifiable_epsilon(included),
        "audit": _record(report),
        "loss_attack": _record(loss_attack),
        "control_attack": _record(control),
        "shadow_attack": None if shadow is None else _record(shadow),
        "members_evaluated": int(len(member_pos)),
        "nonmembers_evaluated": int(n_out),
        "shadow_pool_size": int(len(shadow_pos)),
        "shadow_train_size": int(len(shadow_pos) // (2 * num_shadows)) if num_shadows > 0 else 0,
        "canary_scores": [round(float(s), 5) for s in scores],
        "included": [int(b) for b in included],
        "seconds": time.perf_counter() - start,
    }


# --------------------------------------------------------------------------- summaries


def mean_se(values: list[float]) -> dict[str, Any]:
    """Mean and standard error (sample std / √n) over seeds; non-finite values propagate."""
    a = np.asarray([np.nan if v is None else v for v in values], dtype=np.float64)
    n = len(a)
    se = (
        float(a.std(ddof=1) / math.sqrt(n))
        if n > 1 and np.all(np.isfinite(a))
        else (0.0 if n == 1 else math.nan)
    )
    return {"mean": float(a.mean()), "se": se, "n": n, "values": a.tolist()}


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    def get(r: dict[str, Any], path: str) -> Any:
        for k in path.split("."):
            r = None if r is None else r.get(k)
        return r

    paths = {
        "test_accuracy": "test_accuracy",
        "epsilon_lower": "epsilon_lower",
        "gdp_epsilon": "gdp_epsilon",
        "gdp_epsilon_lower": "audit.gdp.epsilon_lower",
        "loss_auc": "loss_attack.auc",
        "loss_tpr_at_1pct": "loss_attack.tpr_at_fpr.0.01",
        "loss_tpr_at_10pct": "loss_attack.tpr_at_fpr.0.1",
        "control_auc": "control_attack.auc",
        "shadow_auc": "shadow_attack.auc",
        "shadow_tpr_at_1pct": "shadow_attack.tpr_at_fpr.0.01",
        "shadow_tpr_at_10pct": "shadow_attack.tpr_at_fpr.0.1",
        "accountant_epsilon_rdp": "accountant_epsilon_rdp",
        "accountant_epsilon_pld": "accountant_epsilon_pld",
        "max_certifiable_epsilon": "max_certifiable_epsilon",
    }
    out = {}
    for name, path in paths.items():
        vals = [_tpr(r, path) if ".tpr_at_fpr." in path else get(r, path) for r in runs]
        if all(v is not None for v in vals):
            out[name] = mean_se(vals)
    out["any_exceeds_accountant"] = any(r["exceeds_accountant"] for r in runs)
    return out


def _tpr(run: dict[str, Any], path: str) -> float | None:
    attack, _, fpr = path.partition(".tpr_at_fpr.")
    res = run.get(attack)
    if res is None:
        return None
    table = res["tpr_at_fpr"]
    for k, v in table.items():
        if math.isclose(float(k), float(fpr)):
            return float(v)
    return None


# --------------------------------------------------------------------------- one task


def audit_task(
    task_name: str,
    *,
    methods: tuple[str, ...] = METHODS,
    epsilons: tuple[float, ...] = (1.0, 3.0, 8.0),
    seeds: int = 3,
    num_canaries: int | None = None,
    num_shadows: int = NUM_SHADOWS,
    shadow_epsilons: tuple[float, ...] | None = None,
    epochs: int | None = None,
    winners_from: Path | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """The whole audit of one task: every method × ε × seed. ``shadow_epsilons``: the ε at
    which the private methods also get the shadow attack (``None``: all; the non-private
    baseline always gets it when ``num_shadows > 0``). Returns the JSON-ready record."""
    # σ: utility_train's runs calibrate through the harness's memo (calibration.calibrated_sigma)
    logging.getLogger("absl").setLevel(logging.ERROR)
    task = load_task(task_name)
    epochs = task.epochs if epochs is None else int(epochs)
    m = NUM_CANARIES[task_name] if num_canaries is None else int(num_canaries)
    winners_from = winners_from or RESULTS / f"utility_{task_name}_torch.json"
    utility = json.loads(Path(winners_from).read_text())
    if utility.get("quick") or utility.get("optimizer_name", "sgd") != "sgd":
        raise ValueError(f"{winners_from} is not the full SGD protocol")
    layout = carve_pool(len(task.y_train), m)
    start = time.perf_counter()
    cells: dict[str, Any] = {}
    for method in methods:
        for eps in [None] if method == "nonprivate" else list(epsilons):
            key = method if eps is None else f"{method}@{float(eps)}"
            hp = utility["winners"][key]["hp"]
            shadows = num_shadows if (eps is None or shadow_epsilons is None or eps in shadow_epsilons) else 0
            runs = [
                run_seed(task, method, hp, epsilon=eps, seed=s, layout=layout, num_canaries=m, epochs=epochs,
                         num_shadows=shadows)
                for s in range(seeds)
            ]  # fmt: skip
            cells[key] = {
                "method": method, "epsilon": eps, "hp": hp, "num_shadows": shadows,
                "utility_benchmark_test": utility["final"][key]["test"],
                "runs": runs, "summary": summarise(runs),
            }  # fmt: skip
            if progress:
                s = cells[key]["summary"]
                print(
                    f"{task_name} {key}: acc {s['test_accuracy']['mean']:.3f}  ε_emp ≥ {s['epsilon_lower']['mean']:.3f}"
                    f"  loss AUC {s['loss_auc']['mean']:.3f}"
                    + (f"  shadow AUC {s['shadow_auc']['mean']:.3f}" if "shadow_auc" in s else "")
                    + f"  ({sum(r['seconds'] for r in runs):.0f}s)",
                    flush=True,
                )
    ur = _utility_run()
    return {
        "task": task_name, "framework": "torch", "delta": DELTA, "confidence": CONFIDENCE,
        "epsilons": [float(e) for e in epsilons], "methods": list(methods), "seeds": list(range(seeds)),
        "epochs": epochs, "expected_batch_size": float(task.batch_size), "optimizer": "SGD(momentum=0.9)",
        "winners_from": str(Path(winners_from).resolve().relative_to(HERE.parents[1]))
        if Path(winners_from).resolve().is_relative_to(HERE.parents[1]) else str(winners_from),
        "data": {
            "train_split": int(len(task.y_train)), "test_split": int(len(task.y_test)),
            "canary_pool": "carved out of the training split before training (fixed, seed "
                           f"{LAYOUT_SEED}); the test split is untouched",
            "num_canaries": m, "real_train_size": int(len(layout.real)),
            "canary_kind": "mislabelled (label uniform over the other classes), included w.p. 1/2",
            "members": "random subset of the real training set, as large as the test split (per seed)",
            "nonmembers": "the test split",
            "shadow_pool": "real training set minus the evaluated members (per seed)",
        },
        "num_shadows": num_shadows,
        "shadow_epsilons": None if shadow_epsilons is None else [float(e) for e in shadow_epsilons],
        "fprs": list(FPRS), "cells": cells,
        "versions": ur.versions(), "machine": ur.machine(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "wall_seconds": time.perf_counter() - start,
    }  # fmt: skip


# --------------------------------------------------------------------------- tables and plots


def _cell(s: dict[str, Any] | None, fmt: str = ".3f") -> str:
    if s is None:
        return "—"
    mean, se = s["mean"], s["se"]
    if not math.isfinite(mean):
        return "∞" if mean > 0 else "—"
    return f"{mean:{fmt}} ± {se:{fmt}}" if s["n"] > 1 else f"{mean:{fmt}}"


def table(out: dict[str, Any]) -> str:
    """Markdown: one row per method × ε (mean ± SE over seeds)."""
    head = (
        "| method | ε | test acc. | (utility bench) | ε_emp ≥ (one-run) | GDP-fit ε | loss AUC | TPR@1 % FPR "
        "| shadow AUC | control AUC | accountant ε (RDP / PLD) |"
    )
    lines = [head, "|" + "---|" * 11]
    for c in out["cells"].values():
        s = c["summary"]
        ub = c["utility_benchmark_test"]
        eps = "—" if c["epsilon"] is None else f"{c['epsilon']:g}"
        acct = "∞" if c["epsilon"] is None else (
            f"{s['accountant_epsilon_rdp']['mean']:.2f} / {s['accountant_epsilon_pld']['mean']:.2f}")  # fmt: skip
        lines.append(
            f"| {c['method']} | {eps} | {_cell(s['test_accuracy'])} | {ub['mean']:.3f} | {_cell(s['epsilon_lower'], '.2f')} "
            f"| {_cell(s.get('gdp_epsilon'), '.2f')} | {_cell(s['loss_auc'])} | {_cell(s['loss_tpr_at_1pct'])} "
            f"| {_cell(s.get('shadow_auc'))} | {_cell(s.get('control_auc'))} | {acct} |"
        )
    return "\n".join(lines)


COLORS = {"flat": "tab:blue", "per_layer": "tab:orange", "scaled": "tab:green", "adaclip": "tab:red",
          "nonprivate": "black"}  # fmt: skip


def plot(out: dict[str, Any], path: Path) -> Path:
    """Three panels against ε: test accuracy, MIA AUC (loss solid, shadow dashed), ε_emp with
    the accountant's ε (diagonal) and the most this m can certify."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    eps = out["epsilons"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    panels = [
        ("test_accuracy", "test accuracy"),
        ("loss_auc", "membership AUC"),
        ("epsilon_lower", "ε_emp (one-run, 95 %)"),
    ]
    for ax, (name, label) in zip(axes, panels):
        for m in out["methods"]:
            if m == "nonprivate":
                s = out["cells"]["nonprivate"]["summary"]
                ax.axhline(s[name]["mean"], color="black", ls="--", label="non-private")
                if name == "loss_auc" and "shadow_auc" in s:
                    ax.axhline(s["shadow_auc"]["mean"], color="black", ls=":", label="non-private (shadow)")
                continue
            keys = [f"{m}@{float(e)}" for e in eps]
            ss = [out["cells"][k]["summary"] for k in keys]
            ax.errorbar(eps, [s[name]["mean"] for s in ss], yerr=[s[name]["se"] for s in ss], marker="o",
                        capsize=3, color=COLORS[m], label=m)  # fmt: skip
            if name == "loss_auc" and all("shadow_auc" in s for s in ss):
                ax.errorbar(eps, [s["shadow_auc"]["mean"] for s in ss], yerr=[s["shadow_auc"]["se"] for s in ss],
                            marker="s", capsize=3, color=COLORS[m], ls="--", alpha=0.6)  # fmt: skip
        if name == "epsilon_lower":
            ax.plot(eps, eps, color="grey", ls=":", label="accountant ε")
            cap = max(c["summary"]["max_certifiable_epsilon"]["mean"] for c in out["cells"].values())
            ax.axhline(cap, color="grey", ls="-.", label=f"most m={out['data']['num_canaries']} can certify")
        if name == "loss_auc":
            ax.axhline(0.5, color="grey", lw=0.8)
        ax.set_xscale("log")
        ax.set_xticks(eps, [f"{e:g}" for e in eps])
        ax.minorticks_off()
        ax.set_xlabel(f"accountant ε (δ = {out['delta']:g})")
        ax.set_ylabel(label)
    axes[1].set_title("loss attack (solid), shadow attack (dashed)", fontsize=9)
    axes[2].legend(fontsize=7)
    axes[0].legend(fontsize=7)
    fig.suptitle(
        f"{out['task']} (torch): accuracy and measured leakage, mean ± SE over {len(out['seeds'])} seeds"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 3.0, 8.0])
    p.add_argument("--seeds", type=int, default=3, help="seeds 0..S-1 per cell")
    p.add_argument("--canaries", type=int, default=None, help="m (default per task: digits 200, mnist1d 500)")
    p.add_argument(
        "--shadows", type=int, default=NUM_SHADOWS, help="shadow models per target (0: no shadow attack)"
    )
    p.add_argument(
        "--shadow-epsilons",
        type=float,
        nargs="+",
        default=None,
        help="ε at which the private methods get the shadow attack (default: all)",
    )
    p.add_argument("--epochs", type=int, default=None, help="override the task's epochs")
    p.add_argument("--quick", action="store_true", help="smoke run: 1 seed, ε = 8, 3 epochs, 40 canaries")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--tag", default="")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--report", type=Path, nargs="+", default=None,
                   help="print the Markdown table of earlier result JSONs and exit (nothing is run)")  # fmt: skip
    args = p.parse_args(argv)
    if args.report:
        for path in args.report:
            print(f"{path}:\n{table(json.loads(path.read_text()))}\n")
        return []
    if args.quick:
        args.seeds, args.epsilons, args.epochs = 1, [8.0], args.epochs or 3
        args.canaries = args.canaries or 40
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for name in args.tasks:
        out = audit_task(name, methods=tuple(args.methods), epsilons=tuple(args.epsilons), seeds=args.seeds,
                         num_canaries=args.canaries, num_shadows=args.shadows,
                         shadow_epsilons=None if args.shadow_epsilons is None else tuple(args.shadow_epsilons),
                         epochs=args.epochs)  # fmt: skip
        out["quick"] = bool(args.quick)
        out["command"] = "python benchmarks/audit/run.py " + " ".join(sys.argv[1:] if argv is None else argv)
        out["threads"] = args.threads
        stem = f"audit_{name}_torch{'_quick' if args.quick else ''}{args.tag}"
        path = args.out / f"{stem}.json"
        path.write_text(json.dumps(out, indent=1))
        print(f"wrote {path} ({out['wall_seconds']:.0f}s)")
        print(table(out))
        if not args.no_plots:
            print(f"wrote {plot(out, args.out / f'{stem}_vs_epsilon.png')}")
        results.append(out)
    return results


if __name__ == "__main__":
    main()
