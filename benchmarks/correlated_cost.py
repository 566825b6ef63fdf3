"""Cost of correlated noise: step time and buffer memory against independent noise.

One PyTorch MLP (784-1000-10 by default, d ≈ 795k), flat clipping, batch 256, one thread. Each
round times ``--steps`` steps of every configuration (independent noise, then banded noise with
each ``b`` of ``--bands``), interleaved so that the machine's load hits them alike; the ratio of
a configuration is the median over rounds of its median step time divided by independent
noise's in the same round. The buffers hold ``(b − 1)·d`` numbers in the statistics dtype; the
table gives them in MiB (counted from the stream's tensors, not estimated). ``--blt M`` adds BLT
noise with ``M`` buffers (``noise_mechanism="blt"`` fitted for the run, fixed-order batches of the
same size). ``--loop`` adds, for each ``b``, banded noise correlated by the per-band loop of
fused multiply-adds (the stream's path before the buffers became one matrix: ``b − 1`` passes
over the running sum, against one matrix-vector product that reads each buffer once), so the two
are compared in the same run. ``--device cuda`` runs on a GPU: noise drawn on the device (``seed=None``), every step
timed between two ``torch.cuda.synchronize()``.

    python benchmarks/correlated_cost.py --rounds 5 --steps 30 --out benchmarks/results/correlated_cost.json
    python benchmarks/correlated_cost.py --device cuda --hidden 4000 --blt 4 --rounds 5 --steps 30
    python benchmarks/correlated_cost.py --rounds 7 --steps 30 --loop --out benchmarks/results/correlated_cost_matrix.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from adaclip_torch import FlatClip
from adaclip_torch.data import CyclicPoissonBatchSampler, FixedOrderBatchSampler, PoissonBatchSampler

BLT_STEPS = 2_000  # the run BLT's factor is fitted for (fixed order: its total steps)


def _forever(sampler: Any) -> Any:
    while True:
        yield from sampler


def build(
    bands: int, *, n: int, batch: int, hidden: int, device: str = "cpu", blt_buffers: int | None = None
) -> tuple[nn.Module, FlatClip, Any]:
    """``bands == 1``: independent noise; ``> 1``: banded; ``blt_buffers``: BLT (``bands`` ignored)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(784, hidden), nn.ReLU(), nn.Linear(hidden, 10)).to(device)
    q = batch / n
    gen = torch.Generator().manual_seed(1)
    seed = None if device != "cpu" else 0  # on a GPU the noise is drawn on the device
    if blt_buffers is not None:
        sampler_blt = FixedOrderBatchSampler(n, batch, generator=gen, total_steps=BLT_STEPS)
        opt = FlatClip(torch.optim.SGD(model.parameters(), lr=0.01), model, noise_multiplier=1.0, max_grad_norm=1.0,
                       expected_batch_size=float(batch), sample_rate=q, per_sample_mode="auto", seed=seed,
                       noise_mechanism="blt", buffers=blt_buffers, sampler=sampler_blt)  # fmt: skip
        return model, opt, _forever(sampler_blt)
    if bands == 1:
        sampler: Any = PoissonBatchSampler(n, q, num_steps=10**6, generator=gen)
        extra: dict[str, Any] = {}
    else:
        sampler = CyclicPoissonBatchSampler(n, q, bands, num_steps=10**6, generator=gen)
        extra = {"noise_mechanism": "banded", "bands": bands, "sampler": sampler}
    opt = FlatClip(torch.optim.SGD(model.parameters(), lr=0.01), model, noise_multiplier=1.0, max_grad_norm=1.0,
                   expected_batch_size=float(batch), sample_rate=q, per_sample_mode="auto", seed=seed, **extra)
    return model, opt, iter(sampler)


def time_steps(model: nn.Module, opt: FlatClip, batches: Any, x: torch.Tensor, y: torch.Tensor, steps: int) -> float:
    cuda = x.is_cuda
    times = []
    for _ in range(steps):
        idx = torch.as_tensor(next(batches), dtype=torch.long).to(x.device)
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        if len(idx) == 0:
            opt.step(empty_batch=True)
        else:
            nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
        opt.zero_grad()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def correlation_ms(bands: list[int], shapes: list[tuple[int, ...]], *, rounds: int, steps: int) -> list[dict[str, Any]]:
    """The stream's correlation alone (``correlate`` + ``commit`` on fixed draws shaped like the
    model's parameters), the buffer matrix against the per-band loop, interleaved: the medians
    over rounds of the mean time of ``steps`` steps."""
    from adaclip.correlated import BandedNoise
    from adaclip.correlated.coefficients import sqrt_toeplitz_coefficients
    from adaclip_torch.correlated import NoiseStream

    out = []
    z = [torch.randn(sh) for sh in shapes]
    for b in bands:
        streams = {}
        for kind in ("matrix", "loop"):
            sampler = CyclicPoissonBatchSampler(100 * b, 1 / (2 * b), b)
            stream = NoiseStream(BandedNoise(sqrt_toeplitz_coefficients(b)), sample_rate=1 / (2 * b), sampler=sampler)
            if kind == "loop":
                stream._ring_applies = lambda z: False
            for _ in range(b + 2):  # fill the buffers
                stream.correlate(z)
                stream.commit()
            streams[kind] = stream
        times: dict[str, list[float]] = {k: [] for k in streams}
        for _ in range(rounds):
            for kind, stream in streams.items():
                start = time.perf_counter()
                for _ in range(steps):
                    stream.correlate(z)
                    stream.commit()
                times[kind].append(1e3 * (time.perf_counter() - start) / steps)
        uses_matrix = streams["matrix"]._ring_applies(z)
        out.append({"bands": b, "matrix_ms": statistics.median(times["matrix"]), "loop_ms": statistics.median(times["loop"]),
                    "matrix_used": uses_matrix})  # fmt: skip
    return out


def _bands(config: Any) -> int | None:
    """``b`` of a banded (or independent) configuration, ``None`` for BLT."""
    if isinstance(config, int):
        return config
    return int(config[4:]) if config.startswith("loop") else None


def buffer_mib(opt: FlatClip) -> float:
    stream = opt._stream
    if stream is None:
        return 0.0
    return sum(t.numel() * t.element_size() for x in stream._state.history for t in x) / 2**20


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bands", type=int, nargs="+", default=[4, 16, 64])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=1000)
    ap.add_argument("--blt", type=int, nargs="*", default=[], help="BLT configurations: their numbers of buffers")
    ap.add_argument("--loop", action="store_true", help="also each b correlated by the per-band loop")
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    n = 60_000
    x, y = torch.randn(n, 784, device=a.device), torch.randint(0, 10, (n,), device=a.device)
    configs: list[Any] = [1, *a.bands, *(f"loop{b}" for b in (a.bands if a.loop else ())), *(f"blt{m}" for m in a.blt)]
    runs = {}
    for b in configs:
        bands = b if isinstance(b, int) else int(b[4:]) if b.startswith("loop") else 1
        blt = int(b[3:]) if isinstance(b, str) and b.startswith("blt") else None
        runs[b] = build(bands, n=n, batch=a.batch, hidden=a.hidden, device=a.device, blt_buffers=blt)
        if isinstance(b, str) and b.startswith("loop"):
            runs[b][1]._stream._ring_applies = lambda z: False  # the per-band loop
    d = sum(p.numel() for p in runs[1][0].parameters())
    for b, (model, opt, batches) in runs.items():  # warm-up, and fill every buffer
        time_steps(model, opt, batches, x, y, max(3, b if isinstance(b, int) else int(b[4:]) if b.startswith("loop") else 3))
    medians: dict[int, list[float]] = {b: [] for b in configs}
    for _ in range(a.rounds):
        for b, (model, opt, batches) in runs.items():
            medians[b].append(time_steps(model, opt, batches, x, y, a.steps))
    rows = []
    for b in configs:
        ratios = [m / i for m, i in zip(medians[b], medians[1], strict=True)]
        rows.append({"bands": b, "median_step_ms": 1e3 * statistics.median(medians[b]),
                     "ratio_vs_independent": statistics.median(ratios), "ratio_range": [min(ratios), max(ratios)],
                     "buffer_mib": buffer_mib(runs[b][1]),
                     "buffer_floats": (_bands(b) - 1) * d if _bands(b) else int(b[3:]) * d})  # fmt: skip
    print(f"MLP 784-{a.hidden}-10 (d = {d:,}), batch {a.batch}, flat clipping, per_sample_mode='auto', 1 thread, "
          f"{a.device}; {a.rounds} rounds × {a.steps} steps")
    print("| noise | step (ms, median) | vs independent (median, range over rounds) | buffers |")
    print("|---|---|---|---|")
    for r in rows:
        b = r["bands"]
        name = ("independent" if b == 1 else f"banded, b = {b}" if isinstance(b, int)
                else f"banded, b = {b[4:]}, per-band loop" if b.startswith("loop") else f"BLT, {b[3:]} buffers")  # fmt: skip
        print(f"| {name} | {r['median_step_ms']:.1f} | {r['ratio_vs_independent']:.2f} "
              f"({r['ratio_range'][0]:.2f}–{r['ratio_range'][1]:.2f}) | {r['buffer_mib']:.0f} MiB |")
    correlation = []
    if a.loop:
        shapes = [tuple(p.shape) for p in runs[1][0].parameters()]
        correlation = correlation_ms(a.bands, shapes, rounds=a.rounds, steps=a.steps)
        print("\nThe correlation alone (the stream's correlate + commit, ms a step, median over rounds):")
        print("| b | one matrix-vector product | per-band loop | ratio | the stream uses |")
        print("|---|---|---|---|---|")
        for r in correlation:
            print(f"| {r['bands']} | {r['matrix_ms']:.2f} | {r['loop_ms']:.2f} | {r['matrix_ms'] / r['loop_ms']:.2f} | "
                  f"{'the matrix' if r['matrix_used'] else 'the loop'} |")
    if a.out is not None:
        a.out.write_text(json.dumps({
            "command": "python benchmarks/correlated_cost.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "machine": {"python": platform.python_version(), "torch": torch.__version__,
                        "platform": platform.platform(), "device": a.device,
                        "gpu": torch.cuda.get_device_name() if a.device.startswith("cuda") else None},
            "d": d, "rows": rows, "correlation_alone": correlation}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
