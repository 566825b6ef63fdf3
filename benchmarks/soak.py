"""Soak: many short trainings and one long one in a single process; memory and step time must
not drift.

Each *path* (PyTorch materialised per-sample gradients, ghost norms, user-level units; JAX) runs
``--trainings`` short trainings of a small MLP on random data, one after the other in this
process, each with a new model and optimizer, and then one long training of ``--long-steps``
steps. After every training it records the process's resident set size (``VmRSS``); during the
long one, the step time of each block of steps. The verdicts:

- memory: the RSS after the last training is within ``--rss-tolerance`` (10 %) of the RSS after
  the first ``--warmup`` trainings (allocator pools and compiled code settle in those);
- time: the median step time of the last block of the long run is within ``--time-tolerance``
  of the first block's (after its warm-up).

    python benchmarks/soak.py --trainings 200 --long-steps 20000 --out benchmarks/results/soak.json

Prints one line per path and writes the figures (RSS after each training, block step times) to
``--out``. Exit status 1 if a verdict fails.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

PATHS = ("materialise", "ghost", "user", "jax")


def rss_mib() -> float:
    """Current resident set size of this process, in MiB (Linux ``/proc/self/status``)."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _torch_training(path: str, seed: int) -> Callable[[int], list[float]]:
    """A function ``run(steps) -> step times`` training a fresh model on ``path``."""
    import torch
    from torch import nn

    from adaclip_torch import FlatClip

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(512, 32, generator=gen)
    y = torch.randint(0, 4, (512,), generator=gen)
    users = torch.arange(512) // 4

    def run(steps: int) -> list[float]:
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 4))
        mode = "ghost" if path == "ghost" else "materialise"
        opt = FlatClip(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=1.0,
                       max_grad_norm=1.0, expected_batch_size=32.0, per_sample_mode=mode, seed=seed)
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            idx = torch.randint(0, 512, (32,), generator=gen)
            nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            if path == "user":
                opt.step(user_ids=users[idx])
            else:
                opt.step()
            opt.zero_grad()
            times.append(time.perf_counter() - start)
        opt.remove_hooks()
        return times

    return run


def _jax_training(seed: int) -> Callable[[int], list[float]]:
    import jax
    import jax.numpy as jnp
    import optax

    import adaclip_jax

    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((512, 32)), jnp.float32)
    y = jnp.asarray(rng.integers(0, 4, 512))

    def loss(p, example):  # one example: x (32,), y ()
        xb, yb = example
        h = jnp.tanh(xb @ p["w1"] + p["b1"])
        return optax.softmax_cross_entropy_with_integer_labels(h @ p["w2"] + p["b2"], yb)

    per_example = adaclip_jax.per_example_grads(loss)

    def run(steps: int) -> list[float]:
        k = jax.random.key(seed)
        params = {"w1": 0.1 * jax.random.normal(k, (32, 64)), "b1": jnp.zeros(64),
                  "w2": 0.1 * jax.random.normal(jax.random.fold_in(k, 1), (64, 4)), "b2": jnp.zeros(4)}
        tx = adaclip_jax.private_chain(adaclip_jax.flat_clip(noise_multiplier=1.0, expected_batch_size=32.0,
                                                             max_grad_norm=1.0, key=seed), optax.sgd(0.1))
        state = tx.init(params)

        @jax.jit
        def step(p, s, xb, yb):
            g = per_example(p, (xb, yb))
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        times = []
        for _ in range(steps):
            start = time.perf_counter()
            idx = rng.integers(0, 512, 32)
            params, state = step(params, state, x[idx], y[idx])
            jax.block_until_ready(params)
            times.append(time.perf_counter() - start)
        return times

    return run


def soak(path: str, *, trainings: int, steps_per_training: int, long_steps: int, block: int) -> dict[str, Any]:
    """Run one path: ``trainings`` short trainings, then one long one. Returns the figures."""
    rss = []
    for i in range(trainings):
        run = _jax_training(i) if path == "jax" else _torch_training(path, i)
        run(steps_per_training)
        del run
        gc.collect()
        rss.append(rss_mib())
    run = _jax_training(10_000) if path == "jax" else _torch_training(path, 10_000)
    times = run(long_steps)
    gc.collect()
    rss_after_long = rss_mib()
    blocks = [statistics.median(times[i:i + block]) for i in range(0, len(times) - block + 1, block)]
    return {"rss_mib": rss, "rss_after_long_mib": rss_after_long, "block_median_step_s": blocks}


def verdicts(result: dict[str, Any], *, warmup: int, rss_tolerance: float, time_tolerance: float) -> dict[str, Any]:
    rss = result["rss_mib"]
    base = rss[min(warmup, len(rss)) - 1]
    last = max(rss[-1], result["rss_after_long_mib"])
    blocks = result["block_median_step_s"]
    first, final = (blocks[1] if len(blocks) > 2 else blocks[0]), blocks[-1]
    return {
        "rss_growth": last / base - 1,
        "rss_ok": last <= base * (1 + rss_tolerance),
        "time_ratio": final / first,
        "time_ok": final <= first * (1 + time_tolerance),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    ap.add_argument("--trainings", type=int, default=200)
    ap.add_argument("--steps-per-training", type=int, default=20)
    ap.add_argument("--long-steps", type=int, default=20_000)
    ap.add_argument("--block", type=int, default=1000)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--rss-tolerance", type=float, default=0.10)
    ap.add_argument("--time-tolerance", type=float, default=0.25)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    out: dict[str, Any] = {
        "command": "python benchmarks/soak.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {"python": platform.python_version(), "platform": platform.platform()},
        "paths": {},
    }
    ok = True
    for path in a.paths:
        start = time.perf_counter()
        result = soak(path, trainings=a.trainings, steps_per_training=a.steps_per_training,
                      long_steps=a.long_steps, block=min(a.block, a.long_steps))
        result.update(verdicts(result, warmup=a.warmup, rss_tolerance=a.rss_tolerance,
                               time_tolerance=a.time_tolerance))
        result["seconds"] = time.perf_counter() - start
        out["paths"][path] = result
        ok &= result["rss_ok"] and result["time_ok"]
        print(f"{path:12s} RSS after {a.warmup} trainings {result['rss_mib'][a.warmup - 1]:.0f} MiB, after "
              f"{a.trainings} + the long run {max(result['rss_mib'][-1], result['rss_after_long_mib']):.0f} MiB "
              f"({100 * result['rss_growth']:+.1f} %, {'ok' if result['rss_ok'] else 'GROWS'}); step time last/first "
              f"block {result['time_ratio']:.2f} ({'ok' if result['time_ok'] else 'SLOWER'}); {result['seconds']:.0f} s",
              flush=True)
    if a.out is not None:
        a.out.write_text(json.dumps(out, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
