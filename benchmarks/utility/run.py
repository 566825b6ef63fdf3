"""Utility benchmark: AdaCliP vs flat, per-layer and eDP-SGD (scaled) clipping at equal (ε, δ).

One command per task (run from the repository root)::

    python benchmarks/utility/run.py --task digits-mlp --epsilons 1 3 8 --seeds 3
    python benchmarks/utility/run.py --task digits-logreg --framework jax --epsilons 1 3 8 --seeds 3
    python benchmarks/utility/run.py --task lstm-users --quick

(``python -m benchmarks.utility.run`` does not work here: an unrelated ``benchmarks`` package
is installed in site-packages and shadows the repository's folder.)

For each ε: every private method gets the same δ, the same sampling rate q = B̄/N (users for
``lstm-users``), the same number of steps and hence the same σ, calibrated with
``adaclip.accounting`` (RDP). δ = 1e-5 for every task (N ≤ 4,000 units, so 1e-5 < 1/N^1.1).

Protocol:
1. Tuning: each method's grid (the SAME number of configurations for every private method,
   see :func:`utility_tasks.make_grids`) is trained on the training set minus a validation
   split (20 %, by user for ``lstm-users``) with ``--tune-seeds`` seeds and scored on the
   validation split; the best mean wins. The non-private baseline tunes the learning rate.
2. Final: the winner is retrained on the whole training set with seeds 0..S−1 and scored on
   the test split (never seen in tuning): mean ± std (sample std, ddof = 1) over seeds.

Output: ``benchmarks/results/utility_<task>_<framework>[_quick].json`` (grids, every tuning
score, winners, final per-seed metrics, curves, AdaCliP b/std traces, versions, machine,
date) and PNG plots beside it (accuracy vs ε, training curves, AdaCliP b and std).
``--quick``: the task's short schedule, 1 tuning seed, 2 configurations per method.

``--optimizer adam`` wraps Adam instead of SGD with momentum (PyTorch only); its learning-rate
grid is Adam's own (``utility_train.ADAM_LRS`` = {1e-3, 3e-3, 1e-2}, quick 3e-3) unless
``--lrs`` is given, and the output files get ``_adam`` in their names.

Twins (``--methods flat ada-patent ... automatic``, PyTorch, example level): the adaptive
options of ``utility_train.TWIN_METHODS`` are not tuned: each takes flat clipping's
validation winner ``(lr, C)`` at the same ε (its clip region at step 0 is flat's ball of
radius C), and runs the same final seeds, so every (twin, flat) pair shares the model
initialisation, the Poisson batches and the noise seed. ``report.py --adaptive-twins`` gives
the paired differences and the scale diagnostic.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from report import table, winners_table  # noqa: E402,F401  (the result tables: defined with the report)
from utility_tasks import (  # noqa: E402
    ADA,
    CLIPS,
    QUICK_ADA,
    QUICK_CLIPS,
    TASKS,
    ada_configs,
    ada_grid_on_clips,
    load_task,
    make_grids,
    n_params,
    split_validation,
)
from utility_train import (  # noqa: E402
    ADAM_LRS,
    ADAM_QUICK_LR,
    DELAY,
    METHODS,
    OPTIMIZERS,
    SEPARATED_STD,
    TWIN_BETA_STD,
    TWIN_METHODS,
    TWIN_S0,
    train_jax,
    train_torch,
)

RESULTS = HERE.parent / "results"
DELTA = 1e-5


def versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for pkg in ("numpy", "torch", "jax", "optax", "dp-accounting", "scikit-learn", "mnist1d", "tqdm", "matplotlib"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{os.cpu_count()} cores, {cpu}, no GPU used (torch {torch.__version__} CPU)"


def summarise(values: list[float]) -> dict[str, float]:
    a = np.asarray(values, dtype=np.float64)
    return {"mean": float(a.mean()), "std": float(a.std(ddof=1)) if len(a) > 1 else 0.0, "n": int(len(a))}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tqdm import tqdm

    torch.set_num_threads(args.threads)
    logging.getLogger("absl").setLevel(logging.ERROR)  # dp-accounting's RDP-order convergence chatter
    task = load_task(args.task)
    if args.epochs is not None:
        task.epochs = task.quick_epochs = args.epochs
    if args.batch_size is not None:
        task.batch_size = float(args.batch_size)
    epochs = task.quick_epochs if args.quick else task.epochs
    grids = task.quick_grids if args.quick else task.grids
    num_params = n_params(task.make_model(0))
    if args.optimizer == "adam":  # Adam's own learning rates (--lrs still overrides them)
        grids = (make_grids([ADAM_QUICK_LR], QUICK_CLIPS, ada_configs(num_params, QUICK_ADA)) if args.quick
                 else make_grids(list(ADAM_LRS), CLIPS, ada_configs(num_params, ADA)))  # fmt: skip
    if args.lrs is not None or args.clips is not None:
        if args.clips is not None and args.ada_grid != "flat-clips" and "adaclip" in args.methods:
            raise SystemExit("--clips needs --ada-grid flat-clips (AdaCliP's C0 then follows the same list)")
        lrs = args.lrs if args.lrs is not None else [g["lr"] for g in grids["nonprivate"]]
        ada = ADA if args.clips is None else [(c, 0.999) for c in args.clips]  # replaced below when flat-clips
        grids = make_grids(lrs, args.clips or CLIPS, ada_configs(num_params, ada))
    if args.ada_grid == "flat-clips":
        grids = {**grids, "adaclip": ada_grid_on_clips(grids["flat"], num_params)}
    if args.max_configs is not None:
        grids = {m: g[: args.max_configs] for m, g in grids.items()}
    reuse = json.loads(args.winners_from.read_text()) if args.winners_from else None
    if reuse is not None:
        grids = {m: [] for m in grids}
    tune_seeds = args.tune_seeds if args.tune_seeds is not None else (1 if args.quick else 2)
    methods = [m for m in METHODS if m in args.methods]
    twins = [m for m in methods if m in TWIN_METHODS]
    if twins and "flat" not in methods:
        raise SystemExit(f"{', '.join(twins)} run at flat clipping's winner: add flat to --methods")
    grids = {**grids, **{m: [] for m in twins}}  # not tuned: flat's winner
    trainer = train_jax if args.framework == "jax" else train_torch
    train_kw = {"optimizer": args.optimizer} if args.framework == "jax" else {
        "optimizer": args.optimizer, "twin_s0": args.twin_s0}  # fmt: skip
    train_sub, val = split_validation(task)
    full = np.arange(len(task.y_train))
    units = (lambda idx: len(np.unique(task.user_train[idx]))) if task.user_level else len
    steps_tune = epochs * max(1, round(units(train_sub) / task.batch_size))
    steps_final = epochs * max(1, round(units(full) / task.batch_size))
    n_runs = sum(
        len(grids.get(m, [])) * tune_seeds * (1 if m == "nonprivate" else len(args.epsilons)) for m in methods
    )
    n_final = sum(args.seeds * (1 if m == "nonprivate" else len(args.epsilons)) for m in methods)
    total_steps = n_runs * steps_tune + n_final * steps_final
    out: dict[str, Any] = {
        "task": task.name, "framework": args.framework, "quick": bool(args.quick), "delta": DELTA,
        "epsilons": list(args.epsilons), "seeds": list(range(args.seeds)), "tune_seeds": list(range(tune_seeds)),
        "epochs": epochs, "expected_batch_size": task.batch_size, "metric": task.metric,
        "num_params": num_params,
        "units_train": units(full), "units_tune": units(train_sub), "units_val": units(val),
        "user_level": task.user_level, "optimizer": OPTIMIZERS[args.optimizer], "optimizer_name": args.optimizer,
        "lr_grid": sorted({g["lr"] for g in grids.get("flat", grids["nonprivate"])}), "grids": grids,
        "command": "python benchmarks/utility/run.py " + " ".join(sys.argv[1:]),
        "versions": versions(), "machine": machine(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "tuning": {}, "winners": {}, "final": {},
    }
    if twins:
        out["twins"] = {
            "methods": twins, "of": "flat", "beta_std": TWIN_BETA_STD, "update_every": DELAY,
            "separated_std": SEPARATED_STD if args.twin_s0 == "fixed" else "C/sqrt(d) * [1/30, 30] (stp: [1e-4, 1e4])",
            "s0": args.twin_s0,
            "rule": "each twin runs at flat clipping's validation winner (lr, C) of the same ε, seeds as flat",
        }  # fmt: skip
    eval_sets = {
        "val": (task.x_train[val], task.y_train[val]),
        "test": (task.x_test, task.y_test),
    }
    start = time.perf_counter()
    with tqdm(total=total_steps, desc=f"{task.name}/{args.framework}", unit="step", disable=args.no_progress, mininterval=3) as bar:
        for method in methods:
            eps_list = [None] if method == "nonprivate" else list(args.epsilons)
            for eps in eps_list:
                key = f"{method}@{eps}" if eps is not None else method
                scores = []
                if reuse is not None:
                    best = dict(reuse["winners"][key], reused_from=str(args.winners_from))
                if method in TWIN_METHODS:  # flat's winner of this ε (flat runs first)
                    best = dict(out["winners"][f"flat@{eps}"], twin_of=f"flat@{eps}")
                for hp in ([] if (reuse is not None or method in TWIN_METHODS) else grids[method]):
                    vals = [
                        trainer(task, method, hp, epsilon=eps, delta=DELTA, seed=1000 + s, train_idx=train_sub,
                                eval_x=eval_sets["val"][0], eval_y=eval_sets["val"][1], epochs=epochs,
                                progress=bar, **train_kw)["metric"]
                        for s in range(tune_seeds)
                    ]
                    scores.append({"hp": hp, "val": vals, "val_mean": float(np.mean(vals))})
                if reuse is None and method not in TWIN_METHODS:
                    best = max(scores, key=lambda r: r["val_mean"])  # ties: the first in grid order
                out["tuning"][key] = scores
                out["winners"][key] = best
                runs = []
                for seed in range(args.seeds):
                    r = trainer(task, method, best["hp"], epsilon=eps, delta=DELTA, seed=seed, train_idx=full,
                                eval_x=eval_sets["test"][0], eval_y=eval_sets["test"][1], epochs=epochs,
                                curves=True, progress=bar, **train_kw)
                    r["seed"] = seed
                    runs.append(r)
                out["final"][key] = {
                    "method": method, "epsilon": eps, "hp": best["hp"], "runs": runs,
                    "test": summarise([r["metric"] for r in runs]),
                    "sigma": runs[0]["sigma"], "steps": runs[0]["steps"],
                    "epsilon_spent": max(r["epsilon"] for r in runs),
                }
                if task.user_level:
                    out["final"][key]["perplexity"] = summarise([r["perplexity"] for r in runs])
                bar.set_postfix_str(f"{key}: {out['final'][key]['test']['mean']:.3f}")
    out["wall_seconds"] = time.perf_counter() - start
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", required=True, choices=TASKS)
    p.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 3.0, 8.0])
    p.add_argument("--seeds", type=int, default=3, help="final-run seeds 0..S-1")
    p.add_argument("--tune-seeds", type=int, default=None, help="seeds per tuning configuration (default 2; quick 1)")
    p.add_argument("--quick", action="store_true", help="short schedule, 2 configurations per method")
    p.add_argument("--framework", choices=("torch", "jax"), default="torch")
    p.add_argument("--optimizer", choices=tuple(OPTIMIZERS), default="sgd",
                   help="the wrapped optimizer: SGD with momentum 0.9, or Adam (own lr grid {1e-3, 3e-3, 1e-2})")
    # The twins of the adaptive options are opt-in (name them): the default is the tuned comparison.
    p.add_argument("--methods", nargs="+", default=[m for m in METHODS if m not in TWIN_METHODS], choices=METHODS)
    p.add_argument("--epochs", type=int, default=None, help="override the task's epochs")
    p.add_argument("--batch-size", type=int, default=None,
                   help="override the task's expected batch size B̄ (q = B̄/N; σ is recalibrated for it)")
    p.add_argument("--lrs", type=float, nargs="+", default=None, help="override the learning-rate grid (every method)")
    p.add_argument("--clips", type=float, nargs="+", default=None,
                   help="override the clip-norm grid C (and AdaCliP's C0; needs --ada-grid flat-clips)")
    p.add_argument("--max-configs", type=int, default=None, help="keep the first K configurations of each grid")
    p.add_argument("--ada-grid", choices=["mixed", "flat-clips"], default="mixed",
                   help="AdaCliP's grid: 'mixed' (C0, β2) ∈ {(0.1, .99), (0.3, .99), (0.3, .999)}; "
                        "'flat-clips': C0 on flat's C grid with β2 = 0.999")
    p.add_argument("--twin-s0", choices=TWIN_S0, default="fixed",
                   help="twins' separated statistics start: 'fixed' s0 = 1e-3, std ∈ [1e-8, 1e2] (stp: its own "
                        "s0 = 1); 'clip' s0 = C/√d, std ∈ s0·[1/30, 30] (stp: s0·[1e-4, 1e4])")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--tag", default="", help="suffix of the output files")
    p.add_argument("--winners-from", type=Path, default=None,
                   help="skip tuning: reuse the winners of an earlier result JSON (e.g. torch's, for a JAX agreement run)")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.framework == "jax" and not args.task.startswith("digits"):
        p.error("--framework jax covers digits-logreg and digits-mlp")
    if args.framework == "jax" and (args.optimizer != "sgd" or set(args.methods) & set(TWIN_METHODS)):
        p.error("--framework jax runs SGD with momentum and the four original methods")
    if args.task == "lstm-users" and set(args.methods) & set(TWIN_METHODS):
        p.error("the twin methods are example level: not lstm-users")
    out = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    opt = "" if args.optimizer == "sgd" else f"_{args.optimizer}"
    stem = f"utility_{args.task}_{args.framework}{opt}{'_quick' if args.quick else ''}{args.tag}"
    path = args.out / f"{stem}.json"
    path.write_text(json.dumps(out, indent=1, default=lambda o: None if isinstance(o, float) and math.isinf(o) else str(o)))
    print(f"wrote {path} ({out['wall_seconds']:.0f}s)")
    print(table(out))
    print(winners_table(out))
    if not args.no_plots:
        from utility_plots import plot_all

        for f in plot_all(out, args.out, stem):
            print(f"wrote {f}")
    return out


if __name__ == "__main__":
    main()
