"""Benchmark and check: adaclip_jax's fused Pallas kernels against their jnp references, on a GPU.

    python benchmarks/kernel_bench_jax.py                      # on a GPU: compiled kernels
    python benchmarks/kernel_bench_jax.py --n 64 256 --json out.json

What it measures, for each parameter leaf of the 784-1000-10 MLP (795,010 parameters) and of a
4,000,000-parameter linear layer, flattened to ``(n, P)`` float32 per-example gradients: the two
kernels of :mod:`adaclip_jax._kernel` (``sq_norms``; ``clip_noise_update``, the clipped sum,
noise, rescale and moment update) against their ``*_reference`` jnp functions on the same
inputs and noise. The check is the largest relative difference of each output and the number
of entries that differ by more than ``rtol = 1e-4`` (any is a failure); the time is the median
of ``--repeats`` jitted calls after ``--warmup`` (``block_until_ready``), summed over the
leaves, kernel over reference (below 1: the kernels are faster).

The first version of the release kernel failed this check on an H200 (its last column tile
stored past the outputs' end); padded to whole tiles it passes, and ``adaclip_jax``'s
``use_kernel="auto"`` takes the kernels on a GPU. Rerun it on a new device. Without a GPU the kernels run in Pallas's interpreter (a correctness tool): the script then
checks one small cell and reports no times.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from adaclip_jax import _kernel  # noqa: E402

MODELS = {
    "mlp-784-1000-10": {"w1": (784, 1000), "b1": (1000,), "w2": (1000, 10), "b2": (10,)},
    "linear-4M": {"w": (2000, 2000)},
    "small": {"w": (5000,), "b": (37,)},  # off GPU: the shapes that failed there, interpreted
}


def _rel(a, b) -> tuple[float, int]:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    bad = int(np.sum(~np.isclose(a, b, rtol=1e-4, atol=1e-6)))
    with np.errstate(invalid="ignore"):
        return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30)), bad


def _median_time(fn, args, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


MOMENTS = dict(beta_mean=0.9, beta_std=0.8, std_min=1e-3, std_max=2.0)


def run_cell(model: str, n: int, warmup: int, repeats: int, timed: bool, interpret: bool) -> dict:
    kw = dict(noise_multiplier=1.0, expected_batch_size=float(n), **MOMENTS)
    rng = np.random.default_rng(0)
    worst, bad, t_kernel, t_ref = 0.0, 0, 0.0, 0.0
    for shape in MODELS[model].values():
        p = int(np.prod(shape))
        g = jnp.asarray(0.01 * rng.standard_normal((n, p)), jnp.float32)
        a = jnp.asarray(0.001 * rng.standard_normal(p), jnp.float32)
        b = jnp.asarray(rng.uniform(0.5, 2.0, p), jnp.float32)
        std = jnp.asarray(rng.uniform(1e-3, 2.0, p), jnp.float32)
        z = jnp.asarray(rng.standard_normal(p), jnp.float32)
        c = jnp.asarray(rng.uniform(0.0, 1.0, n), jnp.float32)
        args = (g, c, a, b, 1.0 / b, z, std)
        kernel = jax.jit(lambda *x: (_kernel.sq_norms(x[0], x[2], x[4], interpret=interpret),
                                     _kernel.clip_noise_update(*x, interpret=interpret, **kw)))  # fmt: skip
        reference = jax.jit(lambda *x: (_kernel.sq_norms_reference(x[0], x[2], x[4]),
                                        _kernel.clip_noise_update_reference(*x, **kw)))  # fmt: skip
        got, want = kernel(*args), reference(*args)
        for x, y in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
            r, k = _rel(x, y)
            worst, bad = max(worst, r) if np.isfinite(r) else float("nan"), bad + k
        if timed:
            t_kernel += _median_time(kernel, args, warmup, repeats)
            t_ref += _median_time(reference, args, warmup, repeats)
    row = {"model": model, "n": n, "max_rel_diff": worst, "entries_off": bad}
    if timed:
        row |= {"reference_ms": 1e3 * t_ref, "kernel_ms": 1e3 * t_kernel, "ratio": t_kernel / t_ref}
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", nargs="+", type=int, default=[64, 256, 1024], help="batch sizes")
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    on_gpu = jax.default_backend() == "gpu"
    device = jax.devices()[0].device_kind
    print(f"python {platform.python_version()}, jax {jax.__version__}, backend {jax.default_backend()}, {device}")
    rows = []
    cells = [(m, n) for m in args.models for n in args.n] if on_gpu else [("small", 3)]
    if not on_gpu:
        print("no GPU: the kernels run in Pallas's interpreter; agreement on one small cell, no times")
    print("| model | n | max rel. difference | entries off | reference ms | kernel ms | kernel / reference |")
    print("|---|---|---|---|---|---|---|")
    for model, n in cells:
        row = run_cell(model, n, args.warmup, args.repeats, timed=on_gpu, interpret=not on_gpu)
        rows.append(row)
        t = (f"{row['reference_ms']:.3f} | {row['kernel_ms']:.3f} | {row['ratio']:.2f}" if on_gpu else "- | - | -")
        print(f"| {model} | {n} | {row['max_rel_diff']:.1e} | {row['entries_off']} | {t} |", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"device": device, "jax": jax.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
