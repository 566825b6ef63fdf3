"""Passes over the largest weight in one private step: what the elementwise cost is made of.

Counts, for one PyTorch training step (forward, backward, ``opt.step()``, ``zero_grad``) of the
MLP 784-1000-10 at batch 256 with ``per_sample_mode="auto"``, every operation that writes a
tensor at least as large as the first layer's weight (1000 × 784; views excluded, they move no
data), and where in the library it happens. Unlike a timing this is exact and does not depend on
the machine's load: each such operation is one read-and-write sweep over 3 MiB, and on a CPU the
difference in sweeps between two configurations is most of the difference in their step time
beyond the matrix products.

    python benchmarks/step_passes.py --out benchmarks/results/step_passes.md
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

VIEWS = {"view", "_unsafe_view", "permute", "unsqueeze", "expand", "reshape", "t", "transpose", "alias",
         "squeeze", "select", "slice", "detach", "as_strided"}  # fmt: skip


class Passes(TorchDispatchMode):
    """Records ``(operation, library file:line)`` for every write of at least ``size`` elements."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size, self.ops = size, []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if isinstance(out, torch.Tensor) and out.numel() >= self.size and name not in VIEWS:
            frames = [f for f in traceback.extract_stack()[:-1] if "site-packages" not in f.filename]
            where = f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else "?"
            self.ops.append((name, where))
        return out


def _method(name: str) -> Callable[[nn.Module], Any]:
    from adaclip_torch import AdaClip, FlatClip

    kw = dict(noise_multiplier=1.0, expected_batch_size=256.0, per_sample_mode="auto", seed=0)

    def build(model: nn.Module) -> Any:
        sgd = torch.optim.SGD(model.parameters(), lr=0.01)
        if name == "nonprivate":
            return sgd
        if name == "flat_ghost":
            return FlatClip(sgd, model, max_grad_norm=1.0, **kw)
        if name == "adaclip_ghost":
            return AdaClip(sgd, model, **kw)
        if name == "patent_ghost":
            return AdaClip(sgd, model, preset="patent", **kw)
        raise ValueError(name)

    return build


def count(name: str, *, warm: int = 2) -> list[tuple[str, str]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(784, 1000), nn.ReLU(), nn.Linear(1000, 10))
    opt = _method(name)(model)
    x, y = torch.randn(256, 784), torch.randint(0, 10, (256,))
    for _ in range(warm + 1):
        with Passes(784 * 1000) as passes:
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    return passes.ops


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default="nonprivate,flat_ghost,adaclip_ghost,patent_ghost")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    lines = ["| method | passes over the 1000 × 784 weight in one step | where |", "|---|---|---|"]
    for name in a.methods.split(","):
        ops = count(name)
        where = ", ".join(f"{op} ({loc})" for op, loc in ops)
        lines.append(f"| {name} | {len(ops)} | {where} |")
    text = "\n".join(lines)
    print(text)
    if a.out is not None:
        a.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
