"""U1 with the validation pick counted in ε: the recommended configuration's clipping chosen by
private selection at the *same total ε* as DP-SGD, trained, on the main job's cell.

Round three reported the recommended configuration "picked on validation": the clipping (flat
or AdaCliP) and the averaging are chosen by the validation score of runs that each spend the
whole ε, and the pick itself is not counted. This script runs three arms per seed on one cell
(default: the README's main job, MNIST-1D long run, momentum SGD, lr 0.2, C = 1, ε = 3):

- **DP-SGD**: one run at ε (PLD), the averaging μ picked on the validation rows inside the run;
- **each candidate alone**: banded noise with flat clipping, or with AdaCliP, one run at ε each
  (no choice between them: nothing to count beyond the μ picked on the public validation rows);
- **recommended, public pick**: banded noise at the library's b, one run with flat clipping and
  one with AdaCliP, each at ε (PLD); the best of the two (and of the averaging) on the
  validation rows is reported. The validation rows are treated as *public*: the pick is free,
  and the two runs' ε is not summed — what round three's U1 assumed;
- **recommended, selection counted**: the same two candidates chosen by
  :func:`adaclip.accounting.select_privately` (Papernot & Steinke's repeat-and-select: a
  geometric number of trials with mean 2 = the number of candidates, each trial a uniformly drawn
  candidate, only the best trial released), every trial trained at the σ that
  :func:`~adaclip.accounting.calibrate_selection_noise_multiplier` gives for the *whole
  selection* to stay within ε (RDP: the only accountant with the event). Validation scores are
  read without noise, so the validation rows are public here too (the selection's ε covers the
  training rows); the averaging μ is picked inside each trial (post-processing of that trial).

Every arm trains on the same training rows (the cell's tuning split), scores on its validation
rows, and reports the picked run's test accuracy; within a seed the arms share the model
initialisation and sampler seed. One command::

    python benchmarks/utility/selection_at_total_epsilon.py --seeds 10 --out benchmarks/results/u1_selection_trained.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import numpy as np  # noqa: E402
import round3  # noqa: E402
import torch  # noqa: E402

from adaclip.accounting import calibrate_selection_noise_multiplier, select_privately  # noqa: E402

CANDIDATES = ("banded", "adaclip-banded")  # flat clipping or AdaCliP, both on the banded plan
#: the reported arms: DP-SGD; each candidate alone at ε (no clipping choice, μ on validation);
#: the public pick between them; the pick by private selection at the same total ε
ARMS = ("dpsgd", "banded", "adaclip-banded", "public", "selected")


def best_of(run: dict[str, Any]) -> tuple[float, float, str]:
    """(validation score, test score, which) of the run's live parameters or best EMA."""
    keys = ["metric"] + [f"ema{mu}" for mu in round3.DECAYS]
    key = max(keys, key=lambda k: run[k])  # ties: the first (live parameters)
    return run[key], run[f"test_{key}"], key


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--task", default="mnist1d-long")
    p.add_argument("--optimizer", default="sgd")
    p.add_argument("--epsilon", type=float, default=3.0)
    p.add_argument("--lr", type=float, default=0.2)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--seeds", type=int, default=10)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    round3.ACCOUNTANT = "pld"  # single runs as make_private accounts them
    task = round3.load_any(args.task)
    train_rows, val_rows = round3.split_validation(task)
    n = round3.units_of(task, train_rows)
    epochs = task.epochs
    eps = args.epsilon
    hp = {"lr": args.lr, "max_grad_norm": args.clip}
    flat_plan = round3.plan_noise(task, n, epochs, eps, args.optimizer, 1)
    banded_plan = round3.plan_noise(task, n, epochs, eps, args.optimizer, None)
    b, q, steps = banded_plan["bands"], banded_plan["q"], banded_plan["steps"]
    sigma_sel = calibrate_selection_noise_multiplier(
        target_epsilon=eps, delta=round3.DELTA, sample_rate=q, steps=steps, mean_trials=len(CANDIDATES), bands=b
    )
    selection_plan = dict(banded_plan, sigma=sigma_sel)
    print(f"{args.task} {args.optimizer} eps={eps}: b={b}, q={q:.5f}, T={steps}; sigma DP-SGD {flat_plan['sigma']:.3f}, "
          f"banded {banded_plan['sigma']:.3f}, banded inside the selection {sigma_sel:.3f}", flush=True)  # fmt: skip

    def run(kind: str, plan: dict[str, Any], seed: int) -> dict[str, Any]:
        return round3.train(task, kind, hp, plan, optimizer=args.optimizer, epsilon=eps, seed=seed,
                            train_idx=train_rows, eval_idx=val_rows, epochs=epochs, also_test=True)  # fmt: skip

    rows = []
    t0 = time.perf_counter()
    for seed in range(args.seeds):
        dpsgd = best_of(run("flat", flat_plan, seed))
        each = {kind: best_of(run(kind, banded_plan, seed)) for kind in CANDIDATES}
        public = max((each[kind] + (kind,) for kind in CANDIDATES), key=lambda r: r[0])

        def trial(kind: str, t: int, seed: int = seed) -> tuple[float, Any]:
            val, test, which = best_of(run(kind, selection_plan, seed * 100 + t))
            return val, (test, which)

        sel = select_privately(CANDIDATES, trial, mean_trials=len(CANDIDATES), noise_multiplier=sigma_sel,
                               sample_rate=q, steps=steps, delta=round3.DELTA, bands=b, seed=10_000 + seed)  # fmt: skip
        row = {"seed": seed, "dpsgd": dpsgd[1], "dpsgd_pick": dpsgd[2], "banded": each["banded"][1],
               "adaclip-banded": each["adaclip-banded"][1], "public": public[1], "public_pick": f"{public[3]}/{public[2]}",
               "selected": sel.result[0], "selected_pick": f"{sel.candidate}/{sel.result[1]}", "selection_epsilon": sel.epsilon}
        rows.append(row)
        # what a selection releases only: not its trials, their number or its time (which grows with it)
        print(f"seed {seed}: DP-SGD {row['dpsgd']:.4f}, banded {row['banded']:.4f}, AdaCliP+banded "
              f"{row['adaclip-banded']:.4f}, public pick {row['public']:.4f} ({row['public_pick']}), "
              f"selection counted {row['selected']:.4f} ({row['selected_pick']}, ε {sel.epsilon:.3f})", flush=True)

    def mean_se(values: list[float]) -> tuple[float, float]:
        return statistics.mean(values), statistics.stdev(values) / np.sqrt(len(values)) if len(values) > 1 else 0.0

    summary = {
        arm: mean_se([100 * r[arm] for r in rows]) for arm in ARMS
    } | {
        f"{arm}-dpsgd": mean_se([100 * (r[arm] - r["dpsgd"]) for r in rows]) for arm in ARMS[1:]
    }
    for key, (m, se) in summary.items():
        print(f"{key}: {m:.2f} ± {se:.2f}")
    record = {"task": args.task, "optimizer": args.optimizer, "epsilon": eps, "delta": round3.DELTA, "lr": args.lr,
              "clip": args.clip, "bands": b, "sample_rate": q, "steps": steps, "sigma_dpsgd": flat_plan["sigma"],
              "sigma_banded": banded_plan["sigma"], "sigma_selection": sigma_sel, "candidates": list(CANDIDATES),
              "rows": rows, "summary": summary, "seconds_all_seeds": time.perf_counter() - t0,
              "machine": round3.machine(), "versions": round3.versions()}  # fmt: skip
    if args.out is not None:
        args.out.write_text(json.dumps(record, indent=1))
    return record


if __name__ == "__main__":
    main()
