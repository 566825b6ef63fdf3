"""JAX at fixed shapes: a banded-noise step on the whole data set with a mask, against the same
step on the Poisson batch padded to a bucket (``adaclip_jax.padded_batch``).

Both runs make the same releases (same keys, same units; the padded rows are masked out). The
masked pattern computes all N per-example gradients every step; the padded one computes a
bucket's worth, ``M ≥ q·N``, and compiles once per bucket used. Timed in one process, the two
runs interleaved over ``--rounds``; the table reports the median total time of ``--steps`` steps
(compilation included) and the median step time after the first compilation of each shape.

    python benchmarks/jax_fixed_shapes.py --out benchmarks/results/jax_fixed_shapes.md
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

import adaclip_jax


def _setup(n: int, dim: int, hidden: int) -> tuple:
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((n, dim)), jnp.float32)
    y = jnp.asarray(rng.integers(0, 10, n))
    params = {"w1": jnp.asarray(rng.standard_normal((dim, hidden)) / np.sqrt(dim), jnp.float32),
              "w2": jnp.asarray(rng.standard_normal((hidden, 10)) / np.sqrt(hidden), jnp.float32)}  # fmt: skip

    def loss(p, xb, yb):
        return optax.softmax_cross_entropy_with_integer_labels(jnp.tanh(xb @ p["w1"]) @ p["w2"], yb)

    return x, y, params, adaclip_jax.per_example_grads(loss, batch_argnums=(1, 2))


def run(kind: str, *, n: int, q: float, bands: int, steps: int, dim: int, hidden: int) -> tuple[float, list[float]]:
    """Total seconds for ``steps`` steps, and each step's seconds."""
    x, y, params, grads = _setup(n, dim, hidden)
    tx = adaclip_jax.private_chain(
        adaclip_jax.flat_clip(max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=q * n,
                              key=jax.random.key(1), noise_mechanism="banded", bands=bands),
        optax.sgd(0.1),
    )  # fmt: skip
    state = tx.init(params)
    sampling_key = jax.random.key(2)
    groups = adaclip_jax.assign_groups(sampling_key, n, bands)
    buckets = adaclip_jax.batch_buckets(q * n, n)

    @jax.jit
    def step_on(params, state, xb, yb, mask):
        updates, state = tx.update(grads(params, xb, yb), state, params, unit_mask=mask)
        return optax.apply_updates(params, updates), state

    times = []
    start = time.perf_counter()
    for t in range(steps):
        began = time.perf_counter()
        if kind == "masked":
            mask = adaclip_jax.cyclic_poisson_mask(sampling_key, t, groups, q * bands, bands=bands)
            params, state = step_on(params, state, x, y, mask)
        else:
            indices, mask = adaclip_jax.padded_batch(sampling_key, t, groups, q * bands, bands=bands, buckets=buckets)
            params, state = step_on(params, state, x[indices], y[indices], mask)
        jax.block_until_ready(params)
        times.append(time.perf_counter() - began)
    return time.perf_counter() - start, times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--q", type=float, default=1 / 16)
    parser.add_argument("--bands", type=int, default=4)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    setting = dict(n=args.n, q=args.q, bands=args.bands, steps=args.steps, dim=args.dim, hidden=args.hidden)
    totals: dict[str, list[float]] = {"masked": [], "padded": []}
    steady: dict[str, list[float]] = {"masked": [], "padded": []}
    for _ in range(args.rounds):
        for kind in totals:
            total, times = run(kind, **setting)
            totals[kind].append(total)
            steady[kind].append(statistics.median(times[len(times) // 2 :]))
    lines = [
        "# JAX at fixed shapes: the whole data set with a mask, or the batch padded to a bucket",
        "",
        f"`python benchmarks/jax_fixed_shapes.py{'' if args.out is None else f' --out {args.out}'}`: "
        f"N = {args.n}, q = {args.q:g} (B̄ = {args.q * args.n:g}), b = {args.bands}, {args.steps} steps, an MLP "
        f"{args.dim}-{args.hidden}-10 (tanh), flat clipping, banded noise, SGD; median of {args.rounds} rounds, "
        f"interleaved. {platform.machine()}, {jax.device_count()} {jax.default_backend()} device(s), "
        f"Python {sys.version.split()[0]}, jax {jax.__version__}, {datetime.date.today().isoformat()}.",
        "",
        "| pattern | total (compilation included) | a step, second half of the run | ratio to padded |",
        "|---|---|---|---|",
    ]
    padded_total, padded_step = statistics.median(totals["padded"]), statistics.median(steady["padded"])
    for kind, name in (("masked", "all N units, masked"), ("padded", "padded_batch (buckets)")):
        total, step = statistics.median(totals[kind]), statistics.median(steady[kind])
        lines.append(f"| {name} | {total:.2f} s | {1e3 * step:.1f} ms | {total / padded_total:.1f}× total, "
                     f"{step / padded_step:.1f}× a step |")  # fmt: skip
    lines += ["", f"Buckets: {adaclip_jax.batch_buckets(args.q * args.n, args.n)}.", ""]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
