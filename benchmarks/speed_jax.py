"""Speed of one jitted JAX training step: non-private, optax DP-SGD, adaclip_jax flat_clip, adaclip.

Usage::

    python benchmarks/speed_jax.py            # MLP 784-1000-10 and a small CNN, batch 64/256/1024
    python benchmarks/speed_jax.py --quick    # batch 64/256 only, fewer repeats
    python benchmarks/speed_jax.py --core     # the core's transformed norms, NumPy/torch/JAX
    python benchmarks/speed_jax.py --eager    # update() called eagerly: ours vs optax's aggregate
    python benchmarks/speed_jax.py --methods ghost,ghost_adaclip   # a subset (nonprivate always)

Every step is one ``jax.jit``-compiled function: per-example gradients (``vmap(grad)``; a
plain ``grad`` of the mean loss for the non-private baseline), the gradient transformation,
``optax.adam`` and ``optax.apply_updates``. Data are random (only speed is measured). The
methods are timed *interleaved* (round r runs every method once, in turn), each call ends
with ``block_until_ready``; the table gives the median over rounds and the ratios of the
medians to ``optax_dpsgd`` (``optax.contrib.differentially_private_aggregate`` + adam) from
the same run, so a noisy (shared) machine affects all methods alike.

Methods: ``nonprivate``; ``optax_dpsgd``; ``flat_clip`` (``adaclip_jax.flat_clip``);
``ghost`` (the same ``flat_clip``, its clipped sum from
:func:`adaclip_jax.ghost_clipped_sum_grads`: ghost norms, no per-example gradients);
``ghost_adaclip`` (``adaclip`` with its clipped sum from ghost norms);
``adaclip`` (``adaclip_jax.adaclip``, default ``use_kernel=False``: the core jnp path);
With ``--kernel`` (on a GPU) two more: ``patent`` (``adaclip_jax.adaclip(preset="patent")``,
``use_kernel=False``) and ``patent+kernel`` (the same with ``use_kernel=True``: the fused Pallas
kernels). Off GPU the fused path is not timed: its kernels run in Pallas's interpreter there, a
correctness tool that is orders of magnitude slower.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import adaclip_jax


def init_mlp(key, sizes=(784, 1000, 10)):
    params = []
    for k, (i, o) in zip(jax.random.split(key, len(sizes) - 1), zip(sizes[:-1], sizes[1:])):
        params.append({"w": jax.random.normal(k, (i, o)) / np.sqrt(i), "b": jnp.zeros((o,))})
    return params


def mlp(params, x):
    x = x.reshape(-1)
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


def init_cnn(key):
    k1, k2, k3 = jax.random.split(key, 3)
    return {
        "c1": jax.random.normal(k1, (16, 1, 3, 3)) / 3.0,
        "c2": jax.random.normal(k2, (32, 16, 3, 3)) / 12.0,
        "d": jax.random.normal(k3, (32 * 7 * 7, 10)) / np.sqrt(32 * 49),
        "b": jnp.zeros((10,)),
    }


def cnn(params, x):
    x = x.reshape(1, 1, 28, 28)
    dn = ("NCHW", "OIHW", "NCHW")
    x = jax.nn.relu(jax.lax.conv_general_dilated(x, params["c1"], (2, 2), "SAME", dimension_numbers=dn))
    x = jax.nn.relu(jax.lax.conv_general_dilated(x, params["c2"], (2, 2), "SAME", dimension_numbers=dn))
    return x.reshape(-1) @ params["d"] + params["b"]


def make_steps(apply, params, batch, *, sigma=1.0, clip=1.0, kernel=False, methods=None):
    """One jitted ``step(params, opt_state, x, y) -> (params, opt_state)`` per method."""
    n = batch

    def loss_one(p, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(apply(p, x), y)

    def loss_mean(p, x, y):
        return jnp.mean(jax.vmap(loss_one, in_axes=(None, 0, 0))(p, x, y))

    per_ex = adaclip_jax.per_example_grads(loss_one, batch_argnums=(1, 2))
    key = jax.random.key(0)
    ghost_private = adaclip_jax.flat_clip(max_grad_norm=clip, noise_multiplier=sigma, expected_batch_size=n, key=key)
    ghost_adaclip = adaclip_jax.adaclip(noise_multiplier=sigma, expected_batch_size=n, key=key)
    txs = {
        "nonprivate": optax.adam(1e-3),
        "optax_dpsgd": optax.chain(
            optax.contrib.differentially_private_aggregate(clip, sigma, key), optax.adam(1e-3)
        ),
        "flat_clip": optax.chain(
            adaclip_jax.flat_clip(max_grad_norm=clip, noise_multiplier=sigma, expected_batch_size=n, key=key),
            optax.adam(1e-3),
        ),
        "ghost": optax.chain(ghost_private, optax.adam(1e-3)),
        "adaclip": optax.chain(
            adaclip_jax.adaclip(noise_multiplier=sigma, expected_batch_size=n, key=key), optax.adam(1e-3)
        ),
        "ghost_adaclip": optax.chain(ghost_adaclip, optax.adam(1e-3)),
    }
    if kernel:
        for label, use in (("patent", False), ("patent+kernel", True)):
            txs[label] = optax.chain(
                adaclip_jax.adaclip(noise_multiplier=sigma, expected_batch_size=n, key=key, preset="patent",
                                    use_kernel=use),
                optax.adam(1e-3),
            )
    if methods is not None:
        txs = {name: tx for name, tx in txs.items() if name in methods}
    steps, states = {}, {}
    for name, tx in txs.items():
        grad_fn = jax.grad(loss_mean) if name == "nonprivate" else per_ex
        if name.startswith("ghost"):  # the clipped sum from ghost norms, given the private element's state
            private = ghost_private if name == "ghost" else ghost_adaclip
            clip_fn = adaclip_jax.ghost_clipped_sum_grads(loss_one, private, batch_argnums=(1, 2))

            def step(p, s, x, y, tx=tx, clip_fn=clip_fn):
                u, s = tx.update(clip_fn(s[0], p, x, y), s, p)
                return optax.apply_updates(p, u), s
        else:

            def step(p, s, x, y, tx=tx, grad_fn=grad_fn):
                g = grad_fn(p, x, y)
                u, s = tx.update(g, s, p)
                return optax.apply_updates(p, u), s

        steps[name] = jax.jit(step)
        states[name] = tx.init(params)
    return steps, states


def time_config(apply, params, batch, rounds, seed=0, kernel=False, methods=None):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((batch, 784)).astype(np.float32))
    y = jnp.asarray(rng.integers(0, 10, batch))
    steps, states = make_steps(apply, params, batch, kernel=kernel, methods=methods)
    for name in steps:  # compile + warm up
        jax.block_until_ready(steps[name](params, states[name], x, y))
        jax.block_until_ready(steps[name](params, states[name], x, y))
    times = {name: [] for name in steps}
    for _ in range(rounds):
        for name in steps:
            t0 = time.perf_counter()
            jax.block_until_ready(steps[name](params, states[name], x, y))
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def core_norms(n=256, rounds=5):
    """``transform.transformed_sq_norms`` (current core) vs the previous one-reduction form
    ``sum(((g - a)/b)**2, axes)`` on NumPy, PyTorch and JAX (jit), MLP 784-1000-10 shapes."""
    import torch

    from adaclip import transform

    rng = np.random.default_rng(0)
    shapes = [(784, 1000), (1000,), (1000, 10), (10,)]
    g = [rng.standard_normal((n,) + s).astype(np.float32) for s in shapes]
    a = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    b = [rng.uniform(0.5, 2.0, s).astype(np.float32) for s in shapes]

    def previous(xp):
        def f(G, A, B):
            return [xp.sum(((x - c) / d) ** 2, axis=tuple(range(1, x.ndim))) for x, c, d in zip(G, A, B)]
        return f

    libs = {
        "numpy": (lambda x: x, previous(np), transform.transformed_sq_norms, lambda r: r),
        "torch": (torch.as_tensor, previous(torch), transform.transformed_sq_norms, lambda r: r),
        "jax": (jnp.asarray, jax.jit(previous(jnp)), jax.jit(transform.transformed_sq_norms),
                jax.block_until_ready),
    }
    for lib, (mk, old, new, sync) in libs.items():
        G, A, B = [mk(x) for x in g], [mk(x) for x in a], [mk(x) for x in b]
        if lib == "torch":
            fns = {"previous": lambda: previous(torch)(G, A, B), "current": lambda: new(G, A, B),  # noqa: B023 (used in this iteration only)
                   "sum(g*g)": lambda: [torch.sum(x * x, dim=tuple(range(1, x.ndim))) for x in G]}  # noqa: B023 (used in this iteration only)
        else:
            gg = (jax.jit(lambda G: [jnp.sum(x * x, axis=tuple(range(1, x.ndim))) for x in G])
                  if lib == "jax" else (lambda G: [np.sum(x * x, axis=tuple(range(1, x.ndim))) for x in G]))
            fns = {"previous": lambda: old(G, A, B), "current": lambda: new(G, A, B), "sum(g*g)": lambda: gg(G)}  # noqa: B023
        for f in fns.values():
            sync(f())
        times = {k: [] for k in fns}
        for _ in range(rounds):
            for k, f in fns.items():
                t0 = time.perf_counter()
                sync(f())
                times[k].append(time.perf_counter() - t0)
        med = {k: 1e3 * statistics.median(v) for k, v in times.items()}
        print(f"core norms {lib:5s} n={n}: " + "  ".join(f"{k}={v:8.1f}ms" for k, v in med.items())
              + f"  previous/current={med['previous'] / med['current']:.2f}x", flush=True)


def eager_updates(rounds=11, cases=(("quickstart 20-16-3", (20, 16, 3), 32), ("mlp 784-1000-10", (784, 1000, 10), 64))):
    """The transformation's ``update`` called eagerly (no ``jax.jit`` around it, as a user
    trying the library in a notebook does): ours (which compiles itself on an eager call) vs
    optax's ``differentially_private_aggregate`` eager and jitted; per-example gradients are
    given (computed once). Interleaved rounds, medians."""
    rows = []
    for name, sizes, n in cases:
        params = init_mlp(jax.random.key(1), sizes)
        g = jax.tree_util.tree_map(lambda p: 0.01 * jax.random.normal(jax.random.key(2), (n,) + p.shape), params)  # noqa: B023
        key = jax.random.key(0)
        optax_tx = optax.contrib.differentially_private_aggregate(1.0, 1.0, key)
        txs = {
            "optax_aggregate_eager": (optax_tx.update, optax_tx.init(params)),
            "optax_aggregate_jit": (jax.jit(optax_tx.update), optax_tx.init(params)),
        }
        for label, tx in (
            ("flat_clip_eager", adaclip_jax.flat_clip(max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=n, key=key)),
            ("adaclip_eager", adaclip_jax.adaclip(noise_multiplier=1.0, expected_batch_size=n, key=key)),
        ):
            txs[label] = (tx.update, tx.init(params))
        for fn, st in txs.values():  # first call: compiles where it does
            jax.block_until_ready(fn(g, st, params)[0])
        times = {k: [] for k in txs}
        for _ in range(rounds):
            for k, (fn, st) in txs.items():
                t0 = time.perf_counter()
                jax.block_until_ready(fn(g, st, params)[0])
                times[k].append(time.perf_counter() - t0)
        med = {k: 1e3 * statistics.median(v) for k, v in times.items()}
        base = med["optax_aggregate_eager"]
        rows.append({"case": name, "batch": n, "ms": med, "ratio_to_optax_eager": {k: v / base for k, v in med.items()}})
        print(f"{name} n={n}: " + "  ".join(f"{k}={v:8.2f}ms ({v / base:4.2f}x)" for k, v in med.items()), flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="batch 64/256 only, 5 rounds")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--models", default="mlp,cnn")
    ap.add_argument("--batches", default=None, help="comma-separated batch sizes")
    ap.add_argument("--json", default=None, help="also write the results to this file")
    ap.add_argument("--core", action="store_true", help="only time the core's transformed norms")
    ap.add_argument("--eager", action="store_true", help="only time eager update calls against optax's")
    ap.add_argument("--methods", default=None,
                    help="comma-separated subset of the methods to time (nonprivate is always timed)")
    ap.add_argument("--kernel", action="store_true",
                    help="also time the patent's AdaCliP with and without the fused Pallas kernels (GPU)")
    args = ap.parse_args(argv)
    methods = None if args.methods is None else {"nonprivate", *args.methods.split(",")}
    if args.eager:
        print(f"jax {jax.__version__}, optax {optax.__version__}, python {platform.python_version()}, "
              f"{jax.devices()[0].platform}, {platform.machine()}")
        rows = eager_updates(rounds=args.rounds or 11)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(rows, fh, indent=1)
        return 0
    if args.core:
        core_norms(rounds=args.rounds or 5)
        return 0
    rounds = args.rounds or (5 if args.quick else 11)
    batches = [int(b) for b in (args.batches or ("64,256" if args.quick else "64,256,1024")).split(",")]
    models = {
        "mlp": (mlp, init_mlp(jax.random.key(1))),
        "cnn": (cnn, init_cnn(jax.random.key(2))),
    }
    print(f"jax {jax.__version__}, optax {optax.__version__}, python {platform.python_version()}, "
          f"{jax.devices()[0].platform}, {platform.machine()}; rounds={rounds}")
    rows = []
    for mname in args.models.split(","):
        apply, params = models[mname]
        d = sum(int(np.prod(p.shape)) for p in jax.tree_util.tree_leaves(params))
        for b in batches:
            med = time_config(apply, params, b, rounds, kernel=args.kernel, methods=methods)
            base = med.get("optax_dpsgd", med["nonprivate"])  # the parenthesised ratios' baseline
            row = {"model": mname, "params": d, "batch": b, "ms": {k: 1e3 * v for k, v in med.items()},
                   "ratio_to_nonprivate": {k: v / med["nonprivate"] for k, v in med.items()}}
            if "optax_dpsgd" in med:
                row["ratio_to_optax_dpsgd"] = {k: v / base for k, v in med.items()}
            rows.append(row)
            print(f"{mname:4s} d={d:7d} n={b:5d} " + "  ".join(
                f"{k}={1e3 * v:8.2f}ms ({v / base:4.2f}x)" for k, v in med.items()), flush=True)
            print("     vs nonprivate: " + "  ".join(
                f"{k}={v / med['nonprivate']:5.2f}x" for k, v in med.items()), flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
