"""AdaCliP against flat clipping (DP-SGD) at the same (ε, δ): softmax regression on digits.

A plain NumPy training run on scikit-learn's ``load_digits`` (8×8 handwritten digits, 1,797
images, shipped with the package: nothing is downloaded). Both private methods use the same
Poisson sampling rate, the same number of steps and the same noise multiplier σ, calibrated by
:func:`adaclip.accounting.calibrate_noise_multiplier` for the target ε, so they spend exactly the
same privacy; the accountant attached to each run reports the ε it actually spent. A
non-private run gives the ceiling.

Run: ``python examples/numpy_digits.py`` (``--help`` for options).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from adaclip.accounting import Accountant, calibrate_noise_multiplier
from adaclip.strategies import AdaptiveClipping, FlatClipping, private_step
from adaclip.transform import check_per_example_grads


def load_data(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    x, y = load_digits(return_X_y=True)
    x = x / 16.0  # pixel intensities 0..16 → 0..1
    return train_test_split(x, y, test_size=0.25, random_state=seed, stratify=y)


def softmax(logits: np.ndarray) -> np.ndarray:
    z = logits - logits.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def per_example_grads(params: list[np.ndarray], x: np.ndarray, y: np.ndarray) -> list[np.ndarray]:
    """Per-example gradients of the cross-entropy of softmax regression: ``[(n,64,10), (n,10)]``."""
    w, b = params
    err = softmax(x @ w + b)
    err[np.arange(len(y)), y] -= 1.0
    return [x[:, :, None] * err[:, None, :], err]


def accuracy(params: list[np.ndarray], x: np.ndarray, y: np.ndarray) -> float:
    return float(np.mean(np.argmax(x @ params[0] + params[1], axis=1) == y))


def train(
    method: str,
    x: np.ndarray,
    y: np.ndarray,
    *,
    steps: int,
    sample_rate: float,
    noise_multiplier: float,
    learning_rate: float,
    strategy,
    seed: int,
    accountant: Accountant | None,
) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    params = [np.zeros((x.shape[1], 10)), np.zeros(10)]
    shapes = [p.shape for p in params]
    expected_batch_size = sample_rate * len(x)
    state = strategy.init(params) if strategy is not None else None
    for _ in range(steps):
        batch = rng.random(len(x)) < sample_rate  # Poisson sampling: batches of random size
        grads = per_example_grads(params, x[batch], y[batch])
        if method == "non-private":
            if batch.any():
                params = [p - learning_rate * g.mean(axis=0) for p, g in zip(params, grads)]
            continue
        check_per_example_grads(grads, shapes, allow_empty=True)
        accountant.step(noise_multiplier=noise_multiplier, sample_rate=sample_rate)
        noise = [rng.standard_normal(s) for s in shapes]
        noisy, state = private_step(
            strategy, state, grads, noise, noise_multiplier=noise_multiplier, expected_batch_size=expected_batch_size
        )
        params = [p - learning_rate * g for p, g in zip(params, noisy)]
    return params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epsilon", type=float, default=3.0, help="target ε (default 3)")
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=64, help="expected batch size B̄")
    parser.add_argument("--seeds", type=int, default=5, help="number of seeds (mean ± std reported)")
    # Defaults: the winners of benchmarks/tune_numpy_digits.py --epsilon 3 (equal budget,
    # validation split of the training set; see benchmarks/RESULTS.md).
    parser.add_argument("--learning-rate", type=float, default=2.0, help="SGD step size (non-private)")
    parser.add_argument("--flat-learning-rate", type=float, default=2.0)
    parser.add_argument("--max-grad-norm", type=float, default=0.5, help="C for flat clipping")
    parser.add_argument("--adaclip-learning-rate", type=float, default=2.0)
    parser.add_argument("--std-min", type=float, default=1e-3, help="AdaCliP std_min")
    parser.add_argument("--std-max", type=float, default=0.1, help="AdaCliP std_max")
    parser.add_argument("--beta-std", type=float, default=0.999, help="AdaCliP β2 (variance EMA)")
    args = parser.parse_args()

    t0 = time.time()
    x_train, x_test, y_train, y_test = load_data(0)
    sample_rate = args.batch_size / len(x_train)
    steps = int(round(args.epochs / sample_rate))
    sigma = calibrate_noise_multiplier(
        target_epsilon=args.epsilon, delta=args.delta, sample_rate=sample_rate, steps=steps
    )
    print(
        f"digits: {len(x_train)} train / {len(x_test)} test, softmax regression (d = {64 * 10 + 10}); "
        f"q = {sample_rate:.4f}, {steps} steps, σ = {sigma:.4f} for ε = {args.epsilon} at δ = {args.delta}"
    )
    methods = {
        "non-private": (None, args.learning_rate),
        "flat clipping (DP-SGD)": (FlatClipping(max_grad_norm=args.max_grad_norm), args.flat_learning_rate),
        "AdaCliP": (
            AdaptiveClipping(std_min=args.std_min, std_max=args.std_max, beta_std=args.beta_std),
            args.adaclip_learning_rate,
        ),
    }
    print(f"{'method':<24} {'test accuracy':>18} {'ε spent':>9}")
    for name, (strategy, lr) in methods.items():
        accs, eps = [], float("inf")
        for seed in range(args.seeds):
            accountant = None if strategy is None else Accountant()
            params = train(
                "non-private" if strategy is None else "private",
                x_train,
                y_train,
                steps=steps,
                sample_rate=sample_rate,
                noise_multiplier=sigma,
                learning_rate=lr,
                strategy=strategy,
                seed=seed,
                accountant=accountant,
            )
            accs.append(accuracy(params, x_test, y_test))
            if accountant is not None:
                eps = accountant.epsilon(args.delta)
        eps_text = "∞" if strategy is None else f"{eps:.3f}"
        print(f"{name:<24} {np.mean(accs):>9.4f} ± {np.std(accs):.4f} {eps_text:>9}")
    print(f"({args.seeds} seeds, {time.time() - t0:.1f} s)")


if __name__ == "__main__":
    main()
