"""Host-side cost of one private step, where the arithmetic is negligible: our optimizer vs Opacus.

    python benchmarks/host_overhead.py             # the table
    python benchmarks/host_overhead.py flat_auto   # and cProfile's top functions of one method

Two figures, on the CPU with one torch thread:

* the step time (forward + backward + step + zero_grad) on a tiny model (8-8-2, batch 4), where
  the time is the library's Python and dispatch overhead: median of 200 interleaved rounds after
  20 warm-up steps;
* the time of drawing the 784-1000-10 MLP's noise (795,010 standard normals) with the
  optimizer's noise source (:class:`adaclip_torch.noise.NoiseSource`, a CPU generator whatever
  the device, so that one seed gives the same noise everywhere): on a GPU this draw and the copy
  to the device are per-step host work that Opacus, which draws on the device, does not do.
"""

from __future__ import annotations

import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from adaclip_torch import AdaClip, FlatClip  # noqa: E402
from adaclip_torch.noise import NoiseSource  # noqa: E402

METHODS = ["nonprivate", "flat_auto", "flat_materialise", "adaclip_auto", "opacus_hooks"]


def build_step(kind: str, x: torch.Tensor, y: torch.Tensor):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    forward, opt = model, sgd
    if kind == "opacus_hooks":
        from opacus import PrivacyEngine
        from torch.utils.data import DataLoader, TensorDataset

        loader = DataLoader(TensorDataset(x, y), batch_size=len(x))
        forward, opt, _ = PrivacyEngine().make_private(
            module=model, optimizer=sgd, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0,
            poisson_sampling=False, grad_sample_mode="hooks",
        )  # fmt: skip
    elif kind != "nonprivate":
        strategy, mode = kind.split("_")
        common = dict(noise_multiplier=1.0, expected_batch_size=len(x), seed=0, per_sample_mode=mode)
        opt = FlatClip(sgd, model, max_grad_norm=1.0, **common) if strategy == "flat" else AdaClip(sgd, model, **common)

    def step() -> None:
        nn.functional.cross_entropy(forward(x), y).backward()
        opt.step()
        opt.zero_grad()

    return step


def main() -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    x, y = torch.randn(4, 8, generator=torch.Generator().manual_seed(1)), torch.tensor([0, 1, 0, 1])
    steps = {k: build_step(k, x, y) for k in METHODS}
    for step in steps.values():
        for _ in range(20):
            step()
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(200):
        for k, step in steps.items():
            t0 = time.perf_counter()
            step()
            times[k].append(time.perf_counter() - t0)
    print("| method (8-8-2, batch 4, CPU, 1 thread) | step µs (median of 200) |")
    print("|---|---|")
    for k, v in times.items():
        print(f"| {k} | {1e6 * statistics.median(v):.0f} |")
    source = NoiseSource(seed=0)
    like = [torch.zeros(784 * 1000), torch.zeros(1000), torch.zeros(1000 * 10), torch.zeros(10)]
    for _ in range(3):
        source.standard_normal(like)
    draws = []
    for _ in range(20):
        t0 = time.perf_counter()
        source.standard_normal(like)
        draws.append(time.perf_counter() - t0)
    print(f"\nNoiseSource.standard_normal of the MLP's 795,010 normals: {1e3 * statistics.median(draws):.2f} ms (median of 20)")
    if len(sys.argv) > 1:
        import cProfile
        import pstats

        profile = cProfile.Profile()
        profile.enable()
        for _ in range(300):
            steps[sys.argv[1]]()
        profile.disable()
        pstats.Stats(profile).sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    main()
