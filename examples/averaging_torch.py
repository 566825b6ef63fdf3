"""Parameter averaging with DP-SGD on scikit-learn's digits: last iterate vs averaged iterate.

:func:`adaclip_torch.make_private` makes the optimizer private; a
:class:`adaclip_torch.ParameterAverage` attached to it updates an EMA of the parameters after
every private step (post-processing of the released iterates: no extra privacy cost). The test
accuracy of the last iterate and of the average (``with avg.averaged(): ...``) are printed.

    python examples/averaging_torch.py --epochs 20 --sigma 1.0 --seed 0
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

from adaclip_torch import ParameterAverage, make_private


def load_data(seed: int) -> tuple[TensorDataset, TensorDataset]:
    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)
    scaler = StandardScaler().fit(x_train)  # the scaler sees the training features: treat as public

    def to_ds(a, b):
        return TensorDataset(torch.tensor(scaler.transform(a), dtype=torch.float32), torch.tensor(b))

    return to_ds(x_train, y_train), to_ds(x_test, y_test)


def accuracy(model: nn.Module, data: TensorDataset) -> float:
    x, y = data.tensors
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--sigma", type=float, default=1.0, help="noise multiplier σ")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)  # a tiny MLP: one thread is fastest
    train_ds, test_ds = load_data(args.seed)

    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    loader = DataLoader(train_ds, batch_size=args.batch_size)
    model, optimizer, loader = make_private(
        model, optimizer, loader, noise_multiplier=args.sigma, max_grad_norm=1.0, seed=args.seed
    )
    total_steps = args.epochs * len(loader)
    avg = ParameterAverage(model, kind="ema", total_steps=total_steps)  # H = 10 % of the run
    avg.attach(optimizer)  # one update after every private step

    start = time.perf_counter()
    criterion = nn.CrossEntropyLoss()
    for _ in range(args.epochs):
        for x, y in loader:
            if len(x) == 0:  # a Poisson batch can be empty: release noise only
                optimizer.step(empty_batch=True)
            else:
                criterion(model(x), y).backward()
                optimizer.step()
            optimizer.zero_grad()

    last = accuracy(model, test_ds)
    with avg.averaged():  # the averaged parameters, the live ones restored on exit
        averaged = accuracy(model, test_ds)
    eps = optimizer.accountant.epsilon(1e-5)
    print(f"{avg!r} over {total_steps} steps, σ={args.sigma}, ε={eps:.2f} at δ=1e-5 "
          f"({time.perf_counter() - start:.1f}s)")
    print(f"test accuracy: last iterate {last:.3f}, averaged {averaged:.3f}")


if __name__ == "__main__":
    main()
