"""Federated benchmark: user-level DP-FedAvg on Flower's simulation engine, with flat, AdaCliP and
automatic clipping of the users' model updates, after public pretraining, on users whose
distribution differs from the public one.

One command, from the repository root (run the file: ``python -m benchmarks...`` is shadowed by
an unrelated ``benchmarks`` package in site-packages)::

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/federated/run.py --tasks lm-users mnist1d-shift --seeds 0 1 2

Protocol (per task; tasks in ``benchmarks/federated/fed_tasks.py``):

1. **Pretraining.** For each seed s, ``make_model(s)`` is pretrained non-privately on the public
   set (``fed_tasks.pretrain``, Adam); every method of that seed starts from this model.
2. **Methods.** (a) non-private FedAvg (Flower ``FedAvg``, ``fraction_train = q``); (b) DP-FedSGD,
   flat clipping: one local step on the user's whole data (E = 1, batch = n_k); (c) DP-FedAvg,
   flat clipping (E local epochs of minibatch SGD); (d) DP-FedAvg, AdaCliP
   (``AdaptiveClipping.from_initial_clip`` at flat's clip norm S, so it starts as (c)); (e)
   DP-FedAvg, automatic clipping; (c) and (d) also with random rehearsal ρ = 1 (each sampled user
   adds ⌈ρ·n_k⌉ random public examples to its own). Private methods:
   ``adaclip_flower.ServerSideClipping`` around ``FedAvg()`` (server learning rate 1), Poisson
   sampling at rate q, fixed denominator qU, the SAME σ for all (calibrated by
   ``adaclip.accounting.calibrate_noise_multiplier`` for user-level ε = ``--epsilon`` at δ = 1e-5
   over T rounds, RDP), and the accountant's ε of each run is recorded.
3. **Tuning.** Equal budget: 2 configurations per method, on seed 0, picked by quality on the
   validation users (held-out users, never the test users): clip norm S ∈ 2 values for every
   private method (client learning rate fixed), client learning rate ∈ 2 values for the
   non-private baseline. The test sets are evaluated only for the picked configurations.
4. **Final runs.** The picked configuration of each method on every seed (seed 0's tuning run is
   reused); quality on the users' test set and on the public test set, mean ± SE over seeds;
   also the pretrained model's quality.

Clients: ``fed_tasks.configurable_client_app`` (local SGD and rehearsal by
``adaclip_flower.torch_client.train_locally``; hyperparameters travel in the train config), so
each task is ONE ``flwr.simulation.run_simulation`` (U supernodes, one Ray worker with one CPU)
whose ServerApp runs every configuration in turn.

Output: ``benchmarks/results/federated_<task>[_quick].json`` (configuration, σ, every run's
validation / test quality and ε, versions, machine, date, command, wall time) and
``federated_<task>[_quick].png``. ``--quick``: a tiny smoke configuration (< 60 s for one task).
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
ROOT = HERE.parent.parent
RESULTS = HERE.parent / "results"
for _p in (str(HERE), str(HERE.parent / "utility")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import numpy as np  # noqa: E402
import torch  # noqa: E402
from fed_tasks import FederatedTask, cached_task, configurable_client_app, pretrain  # noqa: E402

METHODS = ("nonprivate", "fedsgd_flat", "flat", "flat_rehearsal", "adaclip", "adaclip_rehearsal", "automatic")
LABELS = {
    "nonprivate": "FedAvg (non-private)",
    "fedsgd_flat": "DP-FedSGD flat",
    "flat": "DP-FedAvg flat",
    "flat_rehearsal": "DP-FedAvg flat + rehearsal",
    "adaclip": "DP-FedAvg AdaCliP",
    "adaclip_rehearsal": "DP-FedAvg AdaCliP + rehearsal",
    "automatic": "DP-FedAvg automatic",
}
DELTA = 1e-5
REHEARSAL = 1.0

# Per task: population U, sample rate q, rounds T, local training, grids (2 values each).
CONFIGS: dict[str, dict[str, Any]] = {
    "lm-users": {
        "num_users": 1000, "sample_rate": 0.02, "rounds": 50, "epochs": 2, "batch_size": 4,
        "client_lr": 1.0, "nonprivate_lrs": [0.3, 1.0], "clips": [0.1, 0.4],
    },
    "mnist1d-shift": {
        "num_users": 400, "sample_rate": 0.05, "rounds": 50, "epochs": 2, "batch_size": 5,
        "client_lr": 0.1, "nonprivate_lrs": [0.03, 0.1], "clips": [0.1, 0.4],
    },
}
QUICK: dict[str, dict[str, Any]] = {
    "lm-users": {
        "num_users": 40, "sample_rate": 0.2, "rounds": 3, "epochs": 1, "batch_size": 4,
        "client_lr": 1.0, "nonprivate_lrs": [0.3, 1.0], "clips": [0.5, 2.0], "pretrain_epochs": 1,
    },
    "mnist1d-shift": {
        "num_users": 40, "sample_rate": 0.2, "rounds": 3, "epochs": 1, "batch_size": 5,
        "client_lr": 0.1, "nonprivate_lrs": [0.03, 0.1], "clips": [0.5, 2.0], "pretrain_epochs": 2,
    },
}


def versions() -> dict[str, str]:
    import flwr

    return {"python": platform.python_version(), "torch": torch.__version__, "flwr": flwr.__version__,
            "numpy": np.__version__}


def machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} CPU cores, {platform.platform()}"


def num_params(model: torch.nn.Module) -> int:
    return int(sum(v.numel() for v in model.state_dict().values()))


def grid_for(method: str, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """The 2 tuned configurations of ``method`` (the rest of the client settings fixed)."""
    if method == "nonprivate":
        return [{"client_lr": lr} for lr in cfg["nonprivate_lrs"]]
    return [{"clip": s} for s in cfg["clips"]]


def client_settings(method: str, conf: dict[str, Any], cfg: dict[str, Any], task: FederatedTask) -> dict[str, Any]:
    fedsgd = method == "fedsgd_flat"
    return {
        "epochs": 1 if fedsgd else cfg["epochs"],
        "batch-size": 0 if fedsgd else cfg["batch_size"],  # 0: the user's whole data in one batch
        "client-lr": conf.get("client_lr", cfg["client_lr"]),
        "rehearsal": REHEARSAL if method.endswith("_rehearsal") else 0.0,
    }


def make_strategy(method: str, conf: dict[str, Any], cfg: dict[str, Any], sigma: float, d: int, seed: int):
    from flwr.serverapp.strategy import FedAvg

    import adaclip
    from adaclip_flower import ServerSideClipping

    u, q = cfg["num_users"], cfg["sample_rate"]
    if method == "nonprivate":
        return FedAvg(fraction_train=q, fraction_evaluate=0.0, min_train_nodes=1, min_evaluate_nodes=0,
                      min_available_nodes=u)
    s = conf["clip"]
    if method in ("fedsgd_flat", "flat", "flat_rehearsal"):
        clipping = adaclip.FlatClipping(max_grad_norm=s)
    elif method in ("adaclip", "adaclip_rehearsal"):
        clipping = adaclip.AdaptiveClipping.from_initial_clip(s, d)
    elif method == "automatic":
        clipping = adaclip.AutomaticClipping(max_grad_norm=s)
    else:
        raise ValueError(method)
    return ServerSideClipping(FedAvg(), clipping=clipping, noise_multiplier=sigma, sample_rate=q, num_users=u,
                              delta=DELTA, seed=10_000 + seed)


def summarize(values: list[float]) -> dict[str, float]:
    a = np.asarray(values, dtype=float)
    se = float(a.std(ddof=1) / math.sqrt(len(a))) if len(a) > 1 else float("nan")
    return {"mean": float(a.mean()), "se": se, "n": int(len(a))}


def run_task(name: str, seeds: list[int], *, epsilon: float, quick: bool, log=print) -> dict[str, Any]:
    """Everything for one task inside one Flower simulation; returns the result dict."""
    from flwr.app import ArrayRecord, ConfigRecord, Context
    from flwr.serverapp import Grid, ServerApp
    from flwr.simulation import run_simulation

    from adaclip.accounting import calibrate_noise_multiplier
    from adaclip_flower.torch_client import load_model_arrays, model_arrays

    cfg = dict((QUICK if quick else CONFIGS)[name])
    u, q, rounds = cfg["num_users"], cfg["sample_rate"], cfg["rounds"]
    t0 = time.time()
    task = cached_task(name, u)
    pre_kw = dict(task.pretrain_defaults)
    if "pretrain_epochs" in cfg:
        pre_kw["epochs"] = cfg["pretrain_epochs"]
    sigma = calibrate_noise_multiplier(target_epsilon=epsilon, delta=DELTA, sample_rate=q, steps=rounds)
    log(f"[{name}] U={u} q={q} T={rounds} sigma={sigma:.4f} (eps={epsilon}, delta={DELTA})")

    pretrained: dict[int, dict[str, Any]] = {}
    for s in seeds:
        model = pretrain(task, task.make_model(s), seed=s, **pre_kw)
        pretrained[s] = {"arrays": model_arrays(model), "model": model}
    d = num_params(pretrained[seeds[0]]["model"])

    def quality(arrays: ArrayRecord, which: tuple[str, ...]) -> dict[str, float]:
        model = task.make_model(0)
        load_model_arrays(model, arrays)
        return {k: task.metric(model, *getattr(task, k)) for k in which}

    out: dict[str, Any] = {"runs": [], "tuning": {}, "chosen": {}}

    def one_run(grid: Grid, method: str, conf: dict[str, Any], seed: int) -> dict[str, Any]:
        t = time.time()
        strategy = make_strategy(method, conf, cfg, sigma, d, seed)
        train_config = ConfigRecord({"task": name, "num-users": u, "seed": seed,
                                     **client_settings(method, conf, cfg, task)})
        result = strategy.start(grid=grid, initial_arrays=pretrained[seed]["arrays"], num_rounds=rounds,
                                train_config=train_config)
        eps = float(strategy.epsilon) if hasattr(strategy, "epsilon") else None
        rec = {"method": method, "config": conf, "seed": seed, "epsilon_spent": eps,
               "arrays": result.arrays, "wall_s": time.time() - t}
        rec.update(quality(result.arrays, ("val_user",)))
        log(f"[{name}] {method} {conf} seed={seed}: val={rec['val_user']:.4f} eps={eps} ({rec['wall_s']:.1f} s)")
        return rec

    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        tune_seed = seeds[0]
        for method in METHODS:
            recs = [one_run(grid, method, conf, tune_seed) for conf in grid_for(method, cfg)]
            best = max(recs, key=lambda r: r["val_user"])
            out["tuning"][method] = [{"config": r["config"], "val_user": r["val_user"]} for r in recs]
            out["chosen"][method] = best["config"]
            out["runs"].append(best)
            for s in seeds[1:]:
                out["runs"].append(one_run(grid, method, best["config"], s))

    logging.getLogger("flwr").setLevel(logging.WARNING)
    # Simulation workers import the client's module from this folder.
    saved_path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(HERE), str(HERE.parent / "utility"), str(ROOT), saved_path or ""]
    )
    try:
        run_simulation(server_app=app, client_app=configurable_client_app(), num_supernodes=u,
                       backend_config={"client_resources": {"num_cpus": 1}, "init_args": {"num_cpus": 1}})
    finally:
        if saved_path is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved_path
    if len(out["runs"]) != len(METHODS) * len(seeds):
        raise RuntimeError(f"the simulation finished {len(out['runs'])} of {len(METHODS) * len(seeds)} runs")

    # Test sets: only now, only for the picked configurations.
    runs = []
    for rec in out["runs"]:
        rec = dict(rec)
        rec.update(quality(rec.pop("arrays"), ("test_user", "test_public")))
        runs.append(rec)
    pre = {s: quality(pretrained[s]["arrays"], ("val_user", "test_user", "test_public")) for s in seeds}
    summary: dict[str, Any] = {"pretrained": {k: summarize([pre[s][k] for s in seeds]) for k in ("test_user", "test_public")}}
    for method in METHODS:
        mine = [r for r in runs if r["method"] == method]
        summary[method] = {k: summarize([r[k] for r in mine]) for k in ("test_user", "test_public", "val_user")}
        eps = [r["epsilon_spent"] for r in mine if r["epsilon_spent"] is not None]
        summary[method]["max_epsilon_spent"] = max(eps) if eps else None
    return {
        "task": name, "metric": task.metric_name, "quick": quick, "seeds": seeds, "methods": list(METHODS),
        "labels": LABELS, "config": cfg, "num_params": d, "target_epsilon": epsilon, "delta": DELTA,
        "noise_multiplier": sigma, "rehearsal_fraction": REHEARSAL, "pretrain": pre_kw,
        "tuning": out["tuning"], "chosen": out["chosen"], "pretrained": {str(s): pre[s] for s in seeds},
        "runs": runs, "summary": summary, "wall_s": time.time() - t0,
    }


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["pretrained", *res["methods"]]
    labels = ["pretrained (public only)", *[res["labels"][m] for m in res["methods"]]]
    x = np.arange(len(names))
    fig, ax = plt.subplots(figsize=(10, 4.5))
    for off, key, lab in ((-0.2, "test_user", "users' test set"), (0.2, "test_public", "public test set")):
        means = [res["summary"][n][key]["mean"] for n in names]
        ses = [np.nan_to_num(res["summary"][n][key]["se"]) for n in names]
        ax.bar(x + off, means, 0.4, yerr=ses, capsize=3, label=lab)
    ax.set_xticks(x)
    ax.set_xticklabels(labels, rotation=25, ha="right", fontsize=8)
    ax.set_ylabel(res["metric"])
    ax.set_title(f"{res['task']}: user-level ε = {res['target_epsilon']} (δ = {res['delta']}), "
                 f"mean ± SE over {len(res['seeds'])} seeds")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", nargs="+", default=["lm-users", "mnist1d-shift"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--epsilon", type=float, default=3.0)
    parser.add_argument("--quick", action="store_true", help="tiny smoke configuration")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    written = []
    for name in args.tasks:
        started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        res = run_task(name, args.seeds, epsilon=args.epsilon, quick=args.quick)
        res.update({"versions": versions(), "machine": machine(), "date": started,
                    "command": "OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/federated/run.py "
                               + " ".join(argv if argv is not None else sys.argv[1:])})
        stem = f"federated_{name}" + ("_quick" if args.quick else "")
        path = args.out / f"{stem}.json"
        path.write_text(json.dumps(res, indent=1))
        written.append(path)
        if not args.no_plot:
            plot(res, args.out / f"{stem}.png")
        s = res["summary"]
        print(f"== {name} ({res['metric']}), wall {res['wall_s']:.0f} s")
        for m in ["pretrained", *res["methods"]]:
            print(f"  {m:20s} user {s[m]['test_user']['mean']:.4f} ± {s[m]['test_user']['se']:.4f}   "
                  f"public {s[m]['test_public']['mean']:.4f} ± {s[m]['test_public']['se']:.4f}")
    return written


if __name__ == "__main__":
    main()
