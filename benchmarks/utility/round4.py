"""Utility benchmark, round four: real data sets against published results (PyTorch).

Round three's harness (:mod:`round3`: its noise plans, training runs, tuning and final-run
protocol, JSON layout and tables) on the real-data tasks of :mod:`tasks_round4` — full MNIST
with the CNN of the DP-SGD anchors (``mnist-cnn``) and Rotten Tomatoes fresh/rotten snippets
with a bag of embeddings (``rt-bag``) — plus the non-private ceiling. One command per (task, ε),
from the repository root::

    python benchmarks/utility/round4.py --task mnist-cnn --epsilons 3 --methods flat recommended nonprivate --seeds 2
    python benchmarks/utility/round4.py --report benchmarks/results/round4_*.json

Methods (:data:`METHODS`): round three's (``flat``: DP-SGD, ``FlatClipping(C)``, Poisson
sampling, independent noise; ``recommended``: banded correlated noise with b chosen by the
library's rule — what ``make_private(noise_mechanism="auto")`` chooses — evaluated with the
parameter averaging picked on validation among none and an EMA with μ ∈ {0.9, 0.99, 0.999};
any other name of :data:`methods_round3.METHODS`), and ``nonprivate``: the same model, inner
optimizer (SGD, momentum 0.9), batch size and number of steps without clipping or noise
(uniformly shuffled batches of ``B = round(B̄)``, ``round(N/B̄)`` steps an epoch), its learning
rate tuned on its own grid (``--np-lrs``).

Protocol (round three's, on the fixed validation split of the task): every configuration of
the grid (``--lrs`` × ``--clips``, the same for every private method) trains on the training
rows minus the validation rows with one tuning seed (1000) and is scored on validation; the
best validation score wins (with its μ for the averaged methods); the winners train on all
training rows with seeds 0..S−1 and are scored **once** on the test split. Within a seed the
methods share the initialisation, the sampler's seed and the noise seed. δ = 1e-5, q = B̄/N,
T = epochs · round(1/q). The accountant is PLD (``--accountant pld``, make_private's default;
round three's records used RDP): σ is calibrated with it and the optimizer's accountant
records the run with it.

Output: ``benchmarks/results/round4_<task>_torch_sgd_eps<ε><tag>.json`` (round three's layout,
plus ``cell["nonprivate"]``, ``task_info`` and the machine's load); ``--report`` prints the
summary table (with the anchors), the picks and round three's per-method tables.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import numpy as np  # noqa: E402
import round3  # noqa: E402
import torch  # noqa: E402
from methods_round3 import DECAYS  # noqa: E402
from methods_round3 import METHODS as ROUND3_METHODS  # noqa: E402
from run import machine, summarise, versions  # noqa: E402
from tasks_round4 import LRS, NP_LRS, ROUND4_TASKS, load_round4_task, split_fixed  # noqa: E402
from utility_tasks import Task  # noqa: E402
from utility_train import evaluate, make_optimizer, task_loss  # noqa: E402

RESULTS = HERE.parent / "results"
DELTA = round3.DELTA
METHODS = (*ROUND3_METHODS, "nonprivate")
DEFAULT_METHODS = ("flat", "recommended", "nonprivate")
#: published end-to-end results on MNIST (no public data, no handcrafted features), for the report
ANCHORS = {
    "mnist-cnn": [
        ("DP-SGD, tanh CNN (Papernot et al. 2020, tempered sigmoids)", "2.93", "98.1"),
        ("DP-SGD, the same CNN with ReLU (Papernot et al. 2020)", "2.93", "96.1"),
        ("DP-SGD (Abadi et al. 2016, DP-PCA input projection + MLP)", "2–8", "about 97"),
    ]
}


# --------------------------------------------------------------------------- tasks


def subset_task(task: Task, n_train: int, n_valid: int, n_test: int) -> Task:
    """A tiny copy of ``task`` (smoke runs, tests): the first ``n_train`` tuning rows, the first
    ``n_valid`` validation rows and the first ``n_test`` test rows; ``val_idx`` renumbered."""
    import dataclasses

    sub, val = split_fixed(task)
    rows = np.concatenate([sub[:n_train], val[:n_valid]])
    extra = dict(task.extra, val_idx=np.arange(len(sub[:n_train]), len(rows)))
    return dataclasses.replace(task, x_train=task.x_train[rows], y_train=task.y_train[rows],
                               x_test=task.x_test[:n_test], y_test=task.y_test[:n_test], extra=extra)  # fmt: skip


def task_info(task: Task) -> dict[str, Any]:
    """What the JSON records about the task (no arrays)."""
    sub, val = split_fixed(task)
    model = task.make_model(0)
    return {
        "train_rows": len(task.y_train), "tuning_rows": len(sub), "validation_rows": len(val),
        "test_rows": len(task.y_test), "parameters": sum(p.numel() for p in model.parameters()),
        "model": repr(model), **{k: v for k, v in task.extra.items() if k != "val_idx"},
    }  # fmt: skip


# --------------------------------------------------------------------------- non-private ceiling


def train_nonprivate(task: Task, hp: dict[str, float], *, seed: int, train_idx: np.ndarray, eval_idx: np.ndarray | None,
                     epochs: int) -> dict[str, Any]:  # fmt: skip
    """The same model, inner optimizer, batch size and number of steps as the private runs
    (``epochs · round(N/B̄)``), without clipping or noise: each epoch a seeded permutation cut
    into batches of ``B = round(B̄)`` (the last may be shorter). Scored on validation rows
    ``eval_idx`` or on the test split (``None``)."""
    from adaclip_torch.data import sample_rate_for, steps_per_epoch

    t0 = time.perf_counter()
    torch.manual_seed(seed)
    model = task.make_model(seed)
    inner = make_optimizer("sgd", [p for p in model.parameters() if p.requires_grad], hp["lr"])
    x_tr, y_tr = torch.as_tensor(task.x_train[train_idx]), torch.as_tensor(task.y_train[train_idx])
    n = len(y_tr)
    batch = round(task.batch_size)
    per_epoch = steps_per_epoch(sample_rate_for(task.batch_size, n))
    generator = torch.Generator().manual_seed(seed + 1)
    steps = 0
    for _ in range(epochs):
        perm = torch.randperm(n, generator=generator)
        if per_epoch * batch > n:  # round(N/B) batches of B need more than N rows: continue on a second permutation
            perm = torch.cat([perm, torch.randperm(n, generator=generator)])
        for s in range(per_epoch):
            idx = perm[s * batch : (s + 1) * batch]
            task_loss(task, model, x_tr[idx], y_tr[idx]).backward()
            inner.step()
            inner.zero_grad()
            steps += 1
    ex, ey = (task.x_test, task.y_test) if eval_idx is None else (task.x_train[eval_idx], task.y_train[eval_idx])
    return {"metric": evaluate(task, model, ex, ey)["metric"], "epsilon": math.inf, "sigma": 0.0, "bands": 1,
            "steps": steps, "seconds": time.perf_counter() - t0}  # fmt: skip


def run_nonprivate(task: Task, args: argparse.Namespace, log: Any) -> dict[str, Any]:
    """Tuning (``--np-lrs`` on the validation split, ``--tune-seeds`` seeds) and final runs
    (seeds 0..S−1, the test split once) of the non-private ceiling."""
    sub, val = split_fixed(task)
    full = np.arange(len(task.y_train))
    epochs = args.epochs or task.epochs
    rows = []
    for lr in args.np_lrs:
        runs = [train_nonprivate(task, {"lr": lr}, seed=1000 + s, train_idx=sub, eval_idx=val, epochs=epochs)
                for s in range(args.tune_seeds)]  # fmt: skip
        rows.append({"hp": {"lr": lr}, "runs": runs})
        log(f"  tune nonprivate {{'lr': {lr}}}: val {runs[0]['metric']:.4f} ({runs[0]['seconds']:.0f}s)")
    best = max(rows, key=lambda r: (float(np.mean([x["metric"] for x in r["runs"]])), -rows.index(r)))
    winner = {"hp": best["hp"], "val_mean": float(np.mean([x["metric"] for x in best["runs"]]))}
    finals = []
    for seed in range(args.seeds):
        r = train_nonprivate(task, winner["hp"], seed=seed, train_idx=full, eval_idx=None, epochs=epochs)
        r["seed"] = seed
        finals.append(r)
        log(f"  final nonprivate {winner['hp']} seed {seed}: test {r['metric']:.4f} ({r['seconds']:.0f}s)")
    metrics = [r["metric"] for r in finals]
    return {"tuning": rows, "winner": winner, "final": {
        "hp": winner["hp"], "mu": None, "bands": 1, "sigma": 0.0, "steps": finals[0]["steps"],
        "runs": [{"seed": r["seed"], "metric": r["metric"]} for r in finals], "test": summarise(metrics),
        "epsilon_spent": math.inf, "seconds_per_run": float(np.mean([r["seconds"] for r in finals])), "raw": finals,
    }}  # fmt: skip


# --------------------------------------------------------------------------- one cell


def run_cell(task: Task, args: argparse.Namespace, epsilon: float, log: Any = print) -> dict[str, Any]:
    """Round three's :func:`round3.run_cell` on the task's fixed validation split for the
    private methods, then the non-private ceiling if asked."""
    private = [m for m in args.methods if m != "nonprivate"]
    t0 = time.perf_counter()
    cell: dict[str, Any] = {"epsilon": epsilon, "plans": {}, "tuning": {}, "winners": {}, "final": {}}
    if private:
        original = round3.split_validation
        round3.split_validation = lambda t, seed=0: split_fixed(t) if "val_idx" in t.extra else original(t, seed)
        try:
            cell = round3.run_cell(task, argparse.Namespace(**{**vars(args), "methods": private}), epsilon, log)
        finally:
            round3.split_validation = original
    if "nonprivate" in args.methods:
        cell["nonprivate"] = run_nonprivate(task, args, log)
    cell["wall_seconds"] = time.perf_counter() - t0
    return cell


# --------------------------------------------------------------------------- report


def _pct(values: list[float]) -> str:
    m = 100.0 * np.asarray(values)
    se = m.std(ddof=1) / math.sqrt(len(m)) if len(m) > 1 else math.nan
    return f"{m.mean():.2f} ± {se:.2f}" if len(m) > 1 else f"{m.mean():.2f} (1 seed)"


def summary_rows(results: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Per task: one row per (ε, method) final and per non-private final, from every file."""
    by_task: dict[str, list[dict[str, Any]]] = {}
    for res in results:
        for eps, cell in res["cells"].items():
            rows = by_task.setdefault(res["task"], [])
            base = cell["final"].get("flat")
            for method, f in cell["final"].items():
                delta = "—"
                if base is not None and method != "flat":
                    d, se = round3.paired(f, base)
                    delta = f"{d:+.2f} ± {se:.2f} ({round3.verdict(d, se)})"
                rows.append({"eps": float(eps), "method": method, "f": f, "delta": delta, "epochs": res["epochs"],
                             "batch": res["expected_batch_size"], "file": res.get("file", "")})  # fmt: skip
            if "nonprivate" in cell:
                rows.append({"eps": math.inf, "method": "nonprivate", "f": cell["nonprivate"]["final"], "delta": "—",
                             "epochs": res["epochs"], "batch": res["expected_batch_size"], "file": res.get("file", "")})  # fmt: skip
    return by_task


NAMES = {"flat": "DP-SGD, tuned", "recommended": "recommended (make_private defaults: banded + averaging)",
         "nonprivate": "non-private ceiling (same model, steps)"}  # fmt: skip


def report(results: list[dict[str, Any]]) -> str:
    out = []
    for task, rows in summary_rows(results).items():
        rows = sorted(rows, key=lambda r: (-r["eps"], r["method"] != "flat"))
        rows = sorted(rows, key=lambda r: (r["eps"] != math.inf, r["eps"]))
        out.append(f"**{task}: test accuracy (%), mean ± SE over seeds, each configuration scored once on the test split**\n")
        out.append("| configuration | ε (δ = 1e-5) | epochs × B̄ | steps | lr | C | μ | b | σ | test acc. % | seeds | Δ vs DP-SGD at the same ε (paired) | s/run |")
        out.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            f = r["f"]
            eps = "∞" if r["eps"] == math.inf else f"{r['eps']:g} (spent {f['epsilon_spent']:.3f})"
            c = f["hp"].get("max_grad_norm", "—")
            out.append(f"| {NAMES.get(r['method'], r['method'])} | {eps} | {r['epochs']} × {r['batch']:g} | {f['steps']} | "
                       f"{f['hp']['lr']:g} | {c} | {'—' if f['mu'] is None else f['mu']} | {f['bands']} | "
                       f"{f['sigma']:.3f} | {_pct([x['metric'] for x in f['runs']])} | {len(f['runs'])} | "
                       f"{r['delta']} | {f['seconds_per_run']:.0f} |")  # fmt: skip
        for name, eps, acc in ANCHORS.get(task, []):
            out.append(f"| *published*: {name} | {eps} | — | — | — | — | — | — | — | {acc} | — | — | — |")
        out.append("")
        for rec in (r for r in rows if r["method"] == "recommended"):
            for flat in (r for r in rows if r["method"] == "flat" and r["eps"] > rec["eps"]):
                d, se = round3.paired(rec["f"], flat["f"])
                out.append(f"- recommended at ε = {rec['eps']:g} vs tuned DP-SGD at ε = {flat['eps']:g} "
                           f"({flat['eps'] / rec['eps']:.2g}× the budget): {d:+.2f} ± {se:.2f} points "
                           f"(paired by seed, {round3.verdict(d, se)})")  # fmt: skip
        out.append("")
    out.append("**Tuning (validation accuracy %, tuning seed 1000; the pick of each method in bold)**\n")
    out.append("| task | ε | run | lr | C | live | EMA 0.9 | EMA 0.99 | EMA 0.999 | s/run |")
    out.append("|---|---|---|---|---|---|---|---|---|---|")
    for res in results:
        for eps, cell in res["cells"].items():
            for kind, rows in cell["tuning"].items():
                for row in rows:
                    r = row["runs"][0]
                    chosen = [m for m, w in cell["winners"].items() if round3.RUN_OF[m] == kind and w["hp"] == row["hp"]]
                    cells = [f"{100 * r['metric']:.2f}"] + [f"{100 * r[f'ema{mu}']:.2f}" for mu in DECAYS]
                    for m in chosen:
                        mu = cell["winners"][m]["mu"]
                        i = 0 if mu is None else 1 + DECAYS.index(mu)
                        cells[i] = f"**{cells[i]}** ({m})"
                    out.append(f"| {res['task']} | {float(eps):g} | {kind} (b = {r['bands']}) | {row['hp']['lr']:g} | "
                               f"{row['hp']['max_grad_norm']:g} | {' | '.join(cells)} | {r['seconds']:.0f} |")  # fmt: skip
            if "nonprivate" in cell:
                win = cell["nonprivate"]["winner"]["hp"]
                for row in cell["nonprivate"]["tuning"]:
                    r = row["runs"][0]
                    v = f"{100 * r['metric']:.2f}"
                    out.append(f"| {res['task']} | ∞ | nonprivate | {row['hp']['lr']:g} | — | "
                               f"{f'**{v}**' if row['hp'] == win else v} | — | — | — | {r['seconds']:.0f} |")  # fmt: skip
    out.append("")
    out.append(round3.report([{**r, "cells": {k: {**c, "final": c["final"]} for k, c in r["cells"].items() if c["final"]}}
                              for r in results if any(c["final"] for c in r["cells"].values())]))  # fmt: skip
    return "\n".join(out)


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", choices=ROUND4_TASKS)
    p.add_argument("--epsilons", type=float, nargs="+", default=[3.0])
    p.add_argument("--seeds", type=int, default=2, help="final-run seeds 0..S-1")
    p.add_argument("--tune-seeds", type=int, default=1)
    p.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS), choices=METHODS)
    p.add_argument("--lrs", type=float, nargs="+", default=None, help="learning rates (default: tasks_round4.LRS)")
    p.add_argument("--clips", type=float, nargs="+", default=[1.0], help="clip norms C of the grid")
    p.add_argument("--np-lrs", type=float, nargs="+", default=None, help="the non-private ceiling's learning rates (default: tasks_round4.NP_LRS)")
    p.add_argument("--epochs", type=int, default=None, help="override the task's epochs")
    p.add_argument("--batch-size", type=float, default=None, help="override the task's expected batch size B̄")
    p.add_argument("--subset", type=int, nargs=3, default=None, metavar=("TRAIN", "VALID", "TEST"),
                   help="keep only the first rows of each split (smoke runs, tests)")
    p.add_argument("--bands-grid", type=int, nargs="+", default=[4, 16], help="b values of banded-grid")
    p.add_argument("--accountant", choices=("rdp", "pld"), default="pld")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--tag", default="")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--report", type=Path, nargs="+", default=None, help="print the tables of these JSONs")
    p.add_argument("--write", type=Path, default=None, help="with --report: write the tables to this file")
    args = p.parse_args(argv)
    if args.report:
        results = []
        for f in args.report:
            res = json.loads(f.read_text())
            res["file"] = f.name
            results.append(res)
        text = report(results)
        if args.write:
            args.write.write_text(text + "\n")
        else:
            print(text)
        return None
    if args.task is None:
        p.error("--task is required (or --report)")
    torch.set_num_threads(args.threads)
    logging.getLogger("absl").setLevel(logging.ERROR)
    accountant = round3.ACCOUNTANT
    round3.ACCOUNTANT = args.accountant  # round3.plan_noise and the optimizers' accountants read it
    try:
        return _run(args, argv)
    finally:
        round3.ACCOUNTANT = accountant  # as it was (round3.main and its tests default to RDP)


def _run(args: argparse.Namespace, argv: list[str] | None) -> dict[str, Any] | None:
    task = load_round4_task(args.task)
    if args.subset:
        task = subset_task(task, *args.subset)
    if args.batch_size:
        task.batch_size = float(args.batch_size)
    lrs = args.lrs or list(LRS[args.task])
    args.np_lrs = args.np_lrs or list(NP_LRS[args.task])
    args.configs = [{"lr": lr, "max_grad_norm": c} for lr in lrs for c in args.clips]
    args.optimizer, args.framework, args.reuse = "sgd", "torch", None
    log = (lambda *a, **k: None) if args.quiet else (lambda *a, **k: print(*a, **k, flush=True))
    args.out.mkdir(parents=True, exist_ok=True)
    info = task_info(task)
    last = None
    for eps in args.epsilons:
        out: dict[str, Any] = {
            "round": 4, "task": task.name, "framework": "torch", "optimizer": "SGD(momentum=0.9)", "optimizer_name": "sgd",
            "delta": DELTA, "epsilons": [eps], "seeds": list(range(args.seeds)), "tune_seeds": list(range(args.tune_seeds)),
            "epochs": args.epochs or task.epochs, "accountant": args.accountant, "expected_batch_size": task.batch_size,
            "grid": args.configs, "np_grid": [{"lr": lr} for lr in args.np_lrs], "decays": list(DECAYS),
            "methods": list(args.methods), "bands_grid": list(args.bands_grid), "task_info": info,
            "command": "python benchmarks/utility/round4.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "versions": versions(), "machine": machine(), "nproc": os.cpu_count(), "threads": args.threads,
            "load_average_start": os.getloadavg(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "cells": {},
        }  # fmt: skip
        log(f"{task.name}, ε = {eps:g}, {out['epochs']} epochs, B̄ = {task.batch_size:g}, grid {args.configs}")
        out["cells"][str(eps)] = run_cell(task, args, eps, log)
        out["load_average_end"] = os.getloadavg()
        path = args.out / f"round4_{task.name}_torch_sgd_eps{eps:g}{args.tag}.json"
        path.write_text(json.dumps(out, indent=1, default=str))
        log(report([{**out, "file": path.name}]))
        log(f"wrote {path} ({out['cells'][str(eps)]['wall_seconds']:.0f}s)")
        last = out
    return last


if __name__ == "__main__":
    main()
