"""Benchmark: the fused Triton AdaCliP/flat kernels vs the pure-torch path, with bandwidth.

    python benchmarks/kernel_bench.py                       # sizes up to P = 1e7 on CUDA
    python benchmarks/kernel_bench.py --sizes 1e5 1e6 --n 64 --json results.json

What it measures: one full step on flat buffers, ``fused_adaclip_step`` (norms, clip factors,
clipped sum, in-kernel Philox noise, rescale, moment update) and ``fused_flat_step``, for
per-unit gradients of shape ``(n, P)`` in float32, timed with CUDA events (median of
``--repeats`` after ``--warmup`` runs).

Bandwidth is ``bytes / time`` with the traffic an ideal implementation of the two-pass
algorithm needs, the same byte count for both paths so their numbers compare directly:

* AdaCliP: read ``g`` twice (``2·n·P`` floats), read ``m`` and ``s`` in each pass (``4·P``),
  write ``g̃``, ``m'``, ``s'`` (``3·P``) → ``4·(2nP + 7P)`` bytes;
* flat: read ``g`` twice, write ``g̃`` → ``4·(2nP + P)`` bytes.

A GPU is required for the kernels (Triton compiles for CUDA). On a machine without CUDA the
script says so and times only the torch path on the CPU (sizes capped by ``--cpu-max-p``),
so the numbers there describe the fallback, not the kernels. Triton's interpreter
(``TRITON_INTERPRET=1``) is for tests, never for timings.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from adaclip_torch.kernels import fused_adaclip_step, fused_flat_step, kernel_available  # noqa: E402


def _time(fn, *, device: str, warmup: int, repeats: int) -> float:
    """Median seconds per call."""
    for _ in range(warmup):
        fn()
    times = []
    if device == "cuda":
        torch.cuda.synchronize()
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_one(P: int, n: int, *, device: str, paths: list[str], warmup: int, repeats: int) -> list[dict]:
    gen = torch.Generator(device=device).manual_seed(P)
    g = torch.randn((n, P), generator=gen, device=device)
    mean = 0.01 * torch.randn(P, generator=gen, device=device)
    std = torch.rand(P, generator=gen, device=device) * 0.9 + 0.1
    ada_kw = dict(noise_multiplier=1.1, expected_batch_size=float(n), std_min=0.1, std_max=1.0)
    flat_kw = dict(max_grad_norm=1.0, noise_multiplier=1.1, expected_batch_size=float(n))
    counter = iter(range(10**9))
    rows = []
    for path in paths:
        use_kernel = path == "triton"

        def ada(use_kernel=use_kernel):
            return fused_adaclip_step(
                g, mean, std, seed=1, offset=next(counter) * P, use_kernel=use_kernel, **ada_kw
            )

        def flat(use_kernel=use_kernel):
            return fused_flat_step(g, seed=2, offset=next(counter) * P, use_kernel=use_kernel, **flat_kw)

        for step, fn, nbytes in (
            ("adaclip", ada, 4 * (2 * n * P + 7 * P)),
            ("flat", flat, 4 * (2 * n * P + P)),
        ):
            seconds = _time(fn, device=device, warmup=warmup, repeats=repeats)
            rows.append(dict(step=step, path=path, device=device, n=n, P=P, seconds=seconds,
                             bytes=nbytes, gbps=nbytes / seconds / 1e9))  # fmt: skip
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", type=float, default=[1e4, 1e5, 1e6, 1e7], help="values of P")
    parser.add_argument("--n", type=int, default=32, help="per-unit gradients per step (rows)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--cpu-max-p", type=float, default=1e6, help="largest P timed on CPU (torch path)")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args(argv)

    if torch.cuda.is_available():
        device = "cuda"
        if not kernel_available("cuda"):
            print("CUDA is present but triton is not installed: timing the torch path only.")
            paths = ["torch"]
        else:
            paths = ["triton", "torch"]
        sizes = [int(p) for p in args.sizes]
        where = torch.cuda.get_device_name()
    else:
        device = "cpu"
        paths = ["torch"]
        sizes = [int(p) for p in args.sizes if p <= args.cpu_max_p]
        where = platform.processor() or platform.machine()
        print(
            "No CUDA device: the Triton kernels need a GPU and are NOT timed here. Timing the\n"
            f"pure-torch fallback path on the CPU only (P <= {int(args.cpu_max_p)}); run this\n"
            "script on a CUDA machine with triton installed for the kernel numbers.\n"
        )

    rows = []
    print(f"device: {where}; n = {args.n}; median of {args.repeats} runs")
    print(f"{'step':8s} {'path':7s} {'P':>10s} {'ms':>10s} {'GB/s':>9s} {'speed-up':>9s}")
    for P in sizes:
        block = bench_one(P, args.n, device=device, paths=paths, warmup=args.warmup, repeats=args.repeats)
        base = {r["step"]: r["seconds"] for r in block if r["path"] == "torch"}
        for r in block:
            r["speedup_vs_torch"] = base[r["step"]] / r["seconds"]
            print(f"{r['step']:8s} {r['path']:7s} {P:>10d} {1e3 * r['seconds']:>10.3f} "
                  f"{r['gbps']:>9.1f} {r['speedup_vs_torch']:>8.2f}x")  # fmt: skip
        rows.extend(block)
    if args.json is not None:
        meta = dict(device=where, torch=torch.__version__, n=args.n, repeats=args.repeats)
        try:
            import triton

            meta["triton"] = triton.__version__
        except ImportError:
            meta["triton"] = None
        args.json.write_text(json.dumps(dict(meta=meta, rows=rows), indent=2))
    assert all(math.isfinite(r["seconds"]) for r in rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
