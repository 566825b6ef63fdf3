"""A bit-for-bit fingerprint of the PyTorch optimizer: the parameters after a few seeded steps of
37 configurations (flat, AdaCliP centred and patent, quantile and per-layer clipping; an MLP, a
sequence model, a convolution and an embedding; ``per_sample_mode`` materialise, ghost and auto; the default
``make_private`` with SGD and with AdaCliP and Adam, with and without EMA averaging, and the ε
spent).

A refactor that claims "the same arithmetic" saves the fingerprint before and compares after:

    python benchmarks/step_fingerprint.py save before.pt      # on the old commit
    python benchmarks/step_fingerprint.py compare before.pt   # on the new one: "identical"

The comparison is ``torch.equal`` per tensor: bit for bit, no tolerance.
"""

from __future__ import annotations

import logging
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the library of this checkout, whatever is installed
    sys.path.insert(0, str(ROOT))

from adaclip_torch import AdaClip, FlatClip, PerLayerClip, QuantileClip, make_private  # noqa: E402

BATCH = 16


def _data(n: int = 64, seq: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, *((seq,) if seq else ()), 12, generator=g)
    return x, torch.randint(0, 3, (n,), generator=g)


class _Sequence(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner, self.out = nn.Linear(12, 16), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.inner(x)).mean(1))


class _Conv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.out = nn.Conv1d(3, 4, 3), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.conv(x.reshape(x.shape[0], 3, 6))).flatten(1))


class _Embedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.out = nn.Embedding(20, 8, padding_idx=0), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.embed(x).mean(1))


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 3))


def _wrapper(cls: type, mode: str, **options: object) -> Callable[[nn.Module], object]:
    def build(model: nn.Module) -> object:
        sgd = torch.optim.SGD(model.parameters(), lr=0.1)
        return cls(sgd, model, expected_batch_size=float(BATCH), seed=7, per_sample_mode=mode, **options)

    return build


def _wrapped(name: str, build: Callable[[nn.Module], object], model_fn: Callable[[], nn.Module],
             x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:  # fmt: skip
    torch.manual_seed(1)
    model = model_fn()
    opt = build(model)
    for t in range(4):
        nn.functional.cross_entropy(model(x[BATCH * t : BATCH * (t + 1)]), y[BATCH * t : BATCH * (t + 1)]).backward()
        opt.step()
        opt.zero_grad()
    return {f"{name}.{k}": v.detach().clone() for k, v in model.state_dict().items()}


def _made_private(name: str, optimizer: str, averaging: str | None, **options: object) -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    model = _mlp()
    x, y = _data(n=256)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)
    opt_cls = torch.optim.SGD if optimizer == "sgd" else torch.optim.Adam
    inner = opt_cls(model.parameters(), lr=0.1 if optimizer == "sgd" else 0.01)
    model, opt, loader = make_private(model, inner, loader, target_epsilon=3.0, delta=1e-5, epochs=2, seed=0,
                                      averaging=averaging, progress=False, **options)  # fmt: skip
    for xb, yb in loader:
        nn.functional.cross_entropy(model(xb), yb).backward()
        opt.step()
        opt.zero_grad()
    out = {f"{name}.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    out[f"{name}.epsilon"] = torch.tensor(opt.accountant.epsilon(1e-5), dtype=torch.float64)
    return out


def fingerprint() -> dict[str, torch.Tensor]:
    """Every configuration's parameters after its steps."""
    logging.disable(logging.WARNING)
    warnings.simplefilter("ignore")
    flat, conv = _data(), (torch.randn(64, 18, generator=torch.Generator().manual_seed(3)), _data()[1])
    seq = _data(seq=5)
    tokens = (torch.randint(0, 20, (64, 6), generator=torch.Generator().manual_seed(4)), _data()[1])
    out: dict[str, torch.Tensor] = {}
    for mode in ("materialise", "ghost", "auto"):
        cases = [
            ("flat", _wrapper(FlatClip, mode, noise_multiplier=1.0, max_grad_norm=0.5), _mlp, flat),
            ("adaclip", _wrapper(AdaClip, mode, noise_multiplier=1.0, max_grad_norm=0.5), _mlp, flat),
            ("patent", _wrapper(AdaClip, mode, noise_multiplier=1.0, preset="patent"), _mlp, flat),
            ("seq-flat", _wrapper(FlatClip, mode, noise_multiplier=1.0, max_grad_norm=0.5), _Sequence, seq),
            ("seq-adaclip", _wrapper(AdaClip, mode, noise_multiplier=1.0, max_grad_norm=0.5), _Sequence, seq),
            ("quantile", _wrapper(QuantileClip, mode, noise_multiplier=0.5, max_grad_norm=0.5), _mlp, flat),
            ("per-layer", _wrapper(PerLayerClip, mode, noise_multiplier=1.0, max_grad_norm=0.5), _mlp, flat),
            ("conv-flat", _wrapper(FlatClip, mode, noise_multiplier=1.0, max_grad_norm=0.5), _Conv, conv),
            ("conv-adaclip", _wrapper(AdaClip, mode, noise_multiplier=1.0, max_grad_norm=0.5), _Conv, conv),
            ("embedding-flat", _wrapper(FlatClip, mode, noise_multiplier=1.0, max_grad_norm=0.5), _Embedding, tokens),
            ("embedding-adaclip", _wrapper(AdaClip, mode, noise_multiplier=1.0, max_grad_norm=0.5), _Embedding, tokens),
        ]
        for name, build, model_fn, (x, y) in cases:
            out |= _wrapped(f"{name}-{mode}", build, model_fn, x, y)
    for averaging in (None, "ema"):
        out |= _made_private(f"make_private-sgd-{averaging}", "sgd", averaging)
        out |= _made_private(f"make_private-adaclip-adam-{averaging}", "adam", averaging, strategy="adaclip")
    return out


def main(argv: list[str]) -> None:
    if len(argv) != 2 or argv[0] not in ("save", "compare"):
        raise SystemExit("usage: step_fingerprint.py save|compare FILE.pt")
    out = fingerprint()
    if argv[0] == "save":
        torch.save(out, argv[1])
        print(f"saved {len(out)} tensors to {argv[1]}")
        return
    before = torch.load(argv[1])
    if before.keys() != out.keys():
        raise SystemExit(f"different configurations: {sorted(set(before) ^ set(out))}")
    differ = [k for k in out if not torch.equal(before[k], out[k])]
    print(f"{len(out)} tensors: " + ("identical" if not differ else f"{len(differ)} DIFFER: {differ[:10]}"))
    raise SystemExit(1 if differ else 0)


if __name__ == "__main__":
    main(sys.argv[1:])
