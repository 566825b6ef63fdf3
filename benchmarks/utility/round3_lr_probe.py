"""A diagnostic outside round three's protocol: tuning runs of :mod:`round3` at learning rates
off the grid, scored on the validation split, printed as one JSON line per run.

Used to ask why banded noise lost with Adam on ``lstm-users-long`` (the results page says
what it showed)::

    python benchmarks/utility/round3_lr_probe.py --task lstm-users-long --optimizer adam --kind banded --lr 0.03
    python benchmarks/utility/round3_lr_probe.py --task lstm-users-long --optimizer adam --kind flat --lr 0.03 --bands 1
    python benchmarks/utility/round3_lr_probe.py --task lstm-users-long --optimizer adam --kind banded --lr 0.01 --bands 2

The run is the tuning run the harness would make (tuning split, seed 1000, the plan of
:func:`round3.plan_noise`; ``--bands`` omitted: the library's rule), so its numbers compare
with the harness's tuning log, not with the test-split tables. Several ``--lr`` values and
``--seeds S`` (tuning seeds 1000 … 1000+S−1) make a learning-rate sweep, e.g. where the best lr of
banded noise with Adam sits against DP-SGD's::

    python benchmarks/utility/round3_lr_probe.py --task mnist1d-long --optimizer adam --kind banded \
        --lr 0.0025 0.005 0.01 0.02 0.04 0.08 --seeds 2
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import round3  # noqa: E402
import torch  # noqa: E402
from utility_tasks import split_validation  # noqa: E402


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", required=True)
    p.add_argument("--optimizer", choices=("sgd", "adam"), required=True)
    p.add_argument("--kind", choices=("flat", "banded", "quantile"), required=True)
    p.add_argument("--lr", type=float, nargs="+", required=True)
    p.add_argument("--seeds", type=int, default=1, help="tuning seeds 1000 .. 1000+S-1")
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--bands", type=int, default=None, help="b (default: the library's rule)")
    p.add_argument("--epsilon", type=float, default=3.0)
    p.add_argument("--epochs", type=int, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    task = round3.load_any(args.task)
    train_sub, val = split_validation(task)
    epochs = args.epochs or task.epochs
    bands = 1 if args.kind in ("flat", "quantile") else args.bands
    plan = round3.plan_noise(task, round3.units_of(task, train_sub), epochs, args.epsilon, args.optimizer, bands)
    outs = []
    for lr in args.lr:
        for seed in range(1000, 1000 + args.seeds):
            run = round3.train(task, args.kind, {"lr": lr, "max_grad_norm": args.clip}, plan, optimizer=args.optimizer,
                               epsilon=args.epsilon, seed=seed, train_idx=train_sub, eval_idx=val, epochs=epochs)  # fmt: skip
            out = {"task": task.name, "optimizer": args.optimizer, "kind": args.kind, "lr": lr, "clip": args.clip,
                   "seed": seed, "bands": run["bands"], "sigma": run["sigma"], "validation": run["metric"],
                   **{k: v for k, v in run.items() if k.startswith("ema")}, "epsilon": run["epsilon"]}  # fmt: skip
            print(json.dumps(out), flush=True)
            outs.append(out)
    return outs


if __name__ == "__main__":
    main()
