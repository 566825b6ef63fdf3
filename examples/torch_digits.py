"""AdaCliP vs flat clipping (DP-SGD) on scikit-learn's digits, at the same (ε, δ).

For each strategy, :func:`adaclip_torch.make_private` calibrates the noise multiplier σ for
the target ε over the whole run, replaces the loader's sampling by Poisson sampling
(q = batch_size / N) and attaches an accountant; the script trains a small MLP and prints
the test accuracy and the ε the accountant reports.

    python examples/torch_digits.py --epochs 10 --epsilon 3 --seed 0
"""

from __future__ import annotations

import argparse
import time

import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from sklearn.preprocessing import StandardScaler
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from adaclip_torch import make_private


def load_data(seed: int) -> tuple[TensorDataset, TensorDataset]:
    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)
    scaler = StandardScaler().fit(x_train)  # the scaler sees the training features: treat as public
    to_ds = lambda a, b: TensorDataset(  # noqa: E731
        torch.tensor(scaler.transform(a), dtype=torch.float32), torch.tensor(b, dtype=torch.int64)
    )
    return to_ds(x_train, y_train), to_ds(x_test, y_test)


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10))


def accuracy(model: nn.Module, data: TensorDataset) -> float:
    x, y = data.tensors
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def train(strategy: str, args: argparse.Namespace, train_ds, test_ds, **strategy_kwargs) -> tuple[float, float, float]:
    model = make_model(args.seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loader = DataLoader(train_ds, batch_size=args.batch_size)
    model, optimizer, loader = make_private(
        model, optimizer, loader, target_epsilon=args.epsilon, delta=args.delta, epochs=args.epochs,
        strategy=strategy, seed=args.seed, **strategy_kwargs,
    )
    criterion = nn.CrossEntropyLoss()
    for _ in range(args.epochs):
        for x, y in loader:
            if len(x) == 0:  # a Poisson batch can be empty: release noise only
                optimizer.step(empty_batch=True)
            else:
                criterion(model(x), y).backward()
                optimizer.step()
            optimizer.zero_grad()
    sigma = optimizer.hyperparameters().noise_multiplier
    return accuracy(model, test_ds), optimizer.accountant.epsilon(args.delta), sigma


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--epsilon", type=float, default=3.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--max-grad-norm", type=float, default=1.0, help="C of flat clipping")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)  # a tiny MLP: one thread is fastest
    train_ds, test_ds = load_data(args.seed)
    runs = {
        "adaclip": dict(max_grad_norm=args.max_grad_norm),  # AdaClip's default preset, started at flat's C
        "flat": dict(max_grad_norm=args.max_grad_norm),
    }
    print(f"digits: {len(train_ds)} train / {len(test_ds)} test, target ε={args.epsilon}, δ={args.delta}")
    for strategy, kwargs in runs.items():
        start = time.perf_counter()
        acc, eps, sigma = train(strategy, args, train_ds, test_ds, **kwargs)
        print(f"{strategy:>8}: test accuracy {acc:.3f}  ε={eps:.3f}  σ={sigma:.3f}  "
              f"({time.perf_counter() - start:.1f}s)")


if __name__ == "__main__":
    main()
