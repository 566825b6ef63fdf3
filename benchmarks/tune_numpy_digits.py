"""Equal-budget hyperparameter search for examples/numpy_digits.py (validation split only).

Each method gets the same number of configurations (18), each scored by mean validation
accuracy over 3 seeds on a split of the *training* set; the test set is not touched. The
example's defaults are the winners printed here.

Run: ``python benchmarks/tune_numpy_digits.py --epsilon 3``
"""

from __future__ import annotations

import argparse
import itertools
import pathlib
import sys

import numpy as np
from sklearn.model_selection import train_test_split

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
import numpy_digits as nd  # noqa: E402

from adaclip.accounting import Accountant, calibrate_noise_multiplier  # noqa: E402
from adaclip.strategies import AdaptiveClipping, FlatClipping  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epsilon", type=float, default=3.0)
    parser.add_argument("--epochs", type=int, default=30)
    args = parser.parse_args()
    x_tr, _, y_tr, _ = nd.load_data(0)
    x_a, x_v, y_a, y_v = train_test_split(x_tr, y_tr, test_size=0.25, random_state=1, stratify=y_tr)
    q = 64 / len(x_a)
    steps = int(round(args.epochs / q))
    sigma = calibrate_noise_multiplier(target_epsilon=args.epsilon, delta=1e-5, sample_rate=q, steps=steps)

    def score(strategy, lr: float) -> float:
        accs = []
        for seed in range(3):
            p = nd.train(
                "private", x_a, y_a, steps=steps, sample_rate=q, noise_multiplier=sigma, learning_rate=lr,
                strategy=strategy, seed=seed, accountant=Accountant(),
            )
            accs.append(nd.accuracy(p, x_v, y_v))
        return float(np.mean(accs))

    lrs = [0.5, 1.0, 2.0]
    flat = [
        (score(FlatClipping(max_grad_norm=c), lr), f"flat C={c} lr={lr}")
        for c, lr in itertools.product([0.1, 0.3, 0.5, 1.0, 2.0, 3.0], lrs)
    ]
    ada_grid = [(1e-3, 0.1, 0.9), (1e-3, 1.0, 0.9), (1e-2, 0.1, 0.9), (1e-3, 0.1, 0.999), (1e-3, 1.0, 0.999), (1e-2, 0.1, 0.999)]
    ada = [
        (score(AdaptiveClipping(std_min=a, std_max=b, beta_std=bs), lr), f"adaclip std_min={a} std_max={b} beta_std={bs} lr={lr}")
        for (a, b, bs), lr in itertools.product(ada_grid, lrs)
    ]
    print(f"ε = {args.epsilon}, σ = {sigma:.4f}, q = {q:.4f}, {steps} steps; validation accuracy (3 seeds)")
    for name, results in (("flat", flat), ("adaclip", ada)):
        results.sort(key=lambda r: -r[0])
        print(f"best {name}: {results[0][1]}  ({results[0][0]:.4f}); runner-up {results[1][1]} ({results[1][0]:.4f})")


if __name__ == "__main__":
    main()
