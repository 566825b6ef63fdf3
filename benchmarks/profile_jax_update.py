"""Where the JAX private update spends its time: ``tx.update`` alone, and the HLO of a whole step.

Usage::

    python benchmarks/profile_jax_update.py                      # n = 256, 1024; 7 rounds
    python benchmarks/profile_jax_update.py --batches 256 --hlo-dir /tmp/hlo   # also dump the HLO text

Two views of the same three transformations (``optax.contrib.differentially_private_aggregate``,
``adaclip_jax.flat_clip``, ``adaclip_jax.adaclip``; clip 1, σ = 1, on the MLP 784-1000-10 of
``speed_jax.py``):

1. ``update`` timing: ``jax.jit(tx.update)`` with the per-example gradients given as an input
   (already in memory), interleaved rounds, medians and spread. This isolates the
   transformation (clip, sum, noise, state) from the gradient computation.
2. HLO census: the optimised HLO (``jax.jit(...).lower(...).compile().as_text()``) of that
   update and of the whole jitted training step of ``speed_jax.py`` (``vmap(grad)``, the
   transformation, adam). Per-example gradients of the first layer are ``n × 784 × 1000``
   floats (0.8 GB at n = 256), so each *top-level* instruction (outside fusion bodies) that
   writes or reads an array of that size is one pass over memory: the census counts them
   (``big writes``/``big reads``), by opcode, and counts conditionals (a ``lax.cond`` whose
   operand is the per-example gradient makes XLA materialise it, often with a layout copy).

The update alone and the whole step can disagree: inside a step XLA fuses elementwise work on
the per-example gradients into the fusion that produces them (free), while ``update`` alone
must read its input from memory for every such operation. Users run whole steps.
"""

from __future__ import annotations

import argparse
import collections
import os
import platform
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import speed_jax  # noqa: E402

import adaclip_jax  # noqa: E402

METHODS = ("optax_dpsgd", "flat_clip", "adaclip")


def transformations(n: int, *, clip: float = 1.0, sigma: float = 1.0) -> dict[str, optax.GradientTransformation]:
    """The three private transformations alone (no optimizer after them)."""
    key = jax.random.key(0)
    return {
        "optax_dpsgd": optax.contrib.differentially_private_aggregate(clip, sigma, key),
        "flat_clip": adaclip_jax.flat_clip(max_grad_norm=clip, noise_multiplier=sigma, expected_batch_size=n, key=key),
        "adaclip": adaclip_jax.adaclip(noise_multiplier=sigma, expected_batch_size=n, key=key),
    }


# --------------------------------------------------------------------------- HLO census

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%(\S+)\s*=\s*(.*)$")
_ARRAY = re.compile(r"\b[a-z]+[0-9]*\[([0-9,]*)\]")


def _balanced(text: str, start: int) -> int:
    """Index just past the parenthesis that closes the one at ``text[start]``."""
    depth = 0
    for k in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[k], 0)
        if depth == 0:
            return k + 1
    return len(text)


def _parse(rhs: str) -> tuple[int, str, list[str]]:
    """``(largest array in the result, opcode, operand names)`` of one HLO instruction."""
    end = _balanced(rhs, 0) if rhs.startswith("(") else rhs.index(" ")
    shape_text, rest = rhs[:end], rhs[end:].lstrip()
    size = max((int(np.prod([int(d) for d in m.split(",") if d])) if m else 1
                for m in _ARRAY.findall(shape_text)), default=0)
    paren = rest.find("(")
    opcode = rest[:paren].strip()
    operands = re.findall(r"%([\w.\-]+)", rest[paren:_balanced(rest, paren)])
    return size, opcode, operands


def hlo_census(text: str, big: int) -> dict[str, object]:
    """Top-level instructions of an optimised HLO module that write or read an array of at least
    ``big`` elements (fusion bodies are skipped: a fusion is one pass however many ops it holds).

    Returns ``{"big_writes": {opcode: count}, "big_reads": {opcode: count}, "conditionals": k,
    "fusions": total top-level fusions, "instructions": total top-level instructions}``;
    ``bitcast``, ``tuple``, ``get-tuple-element``, ``parameter`` and ``constant`` move no data and
    are not counted."""
    computations: dict[str, list[str]] = {}
    name = None
    for line in text.splitlines():
        head = re.match(r"^(?:ENTRY\s+)?%(\S+)\s.*\{\s*$", line)
        if head:
            name = head.group(1)
            computations[name] = []
        elif line.startswith("}"):
            name = None
        elif name is not None:
            computations[name].append(line)
    fused = set()
    for lines in computations.values():
        for line in lines:
            if " fusion(" in line:
                fused.update(re.findall(r"calls=%([\w.\-]+)", line))
    writes: collections.Counter = collections.Counter()
    reads: collections.Counter = collections.Counter()
    conditionals = fusions = instructions = 0
    free = ("parameter", "get-tuple-element", "tuple", "bitcast", "constant")
    for cname, lines in computations.items():
        if cname in fused:
            continue
        sizes: dict[str, int] = {}
        for line in lines:
            m = _INSTR.match(line)
            if not m:
                continue
            iname, rhs = m.groups()
            size, opcode, operands = _parse(rhs)
            sizes[iname] = size
            if opcode in free:
                continue
            instructions += 1
            conditionals += opcode == "conditional"
            fusions += opcode == "fusion"
            label = opcode
            if opcode == "fusion":
                kind = re.search(r"kind=(\w+)", rhs)
                label = f"fusion:{kind.group(1) if kind else '?'}"
            if size >= big:
                writes[label] += 1
            if any(sizes.get(a, 0) >= big for a in operands):
                reads[label] += 1
    return {"big_writes": dict(writes), "big_reads": dict(reads), "conditionals": conditionals,
            "fusions": fusions, "instructions": instructions}


def _fmt_counts(c: dict[str, int]) -> str:
    return f"{sum(c.values())} (" + ", ".join(f"{k}={v}" for k, v in sorted(c.items())) + ")"


# --------------------------------------------------------------------------- timing


def profile(n: int, rounds: int, hlo_dir: str | None) -> list[dict]:
    params = speed_jax.init_mlp(jax.random.key(1))
    grads = jax.tree_util.tree_map(lambda p: 0.01 * jax.random.normal(jax.random.key(2), (n,) + p.shape), params)
    grads = jax.block_until_ready(grads)
    big = n * 784 * 1000
    txs = transformations(n)
    fns, states = {}, {}
    for name, tx in txs.items():
        fns[name] = jax.jit(lambda g, s, p, tx=tx: tx.update(g, s, p))
        states[name] = tx.init(params)
    rows = []
    compiled = {}
    for name in METHODS:
        compiled[name] = fns[name].lower(grads, states[name], params).compile()
        jax.block_until_ready(compiled[name](grads, states[name], params))
    times = {name: [] for name in METHODS}
    for _ in range(rounds):
        for name in METHODS:
            t0 = time.perf_counter()
            jax.block_until_ready(compiled[name](grads, states[name], params))
            times[name].append(time.perf_counter() - t0)
    # The whole step of speed_jax (per-example gradients computed inside the same jit).
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((n, 784)).astype(np.float32))
    y = jnp.asarray(rng.integers(0, 10, n))
    steps, step_states = speed_jax.make_steps(speed_jax.mlp, params, n)
    base = statistics.median(times["optax_dpsgd"])
    for name in METHODS:
        update_text = compiled[name].as_text()
        step_text = steps[name].lower(params, step_states[name], x, y).compile().as_text()
        if hlo_dir:
            os.makedirs(hlo_dir, exist_ok=True)
            for kind, text in (("update", update_text), ("step", step_text)):
                with open(os.path.join(hlo_dir, f"{kind}_{name}_{n}.hlo"), "w") as fh:
                    fh.write(text)
        t = times[name]
        row = {
            "method": name, "batch": n, "update_ms": 1e3 * statistics.median(t),
            "update_min_ms": 1e3 * min(t), "update_max_ms": 1e3 * max(t),
            "update_ratio": statistics.median(t) / base,
            "update_hlo": hlo_census(update_text, big), "step_hlo": hlo_census(step_text, big),
        }
        rows.append(row)
        print(f"n={n:5d} {name:12s} update {row['update_ms']:8.1f} ms ({row['update_ratio']:4.2f}x optax; "
              f"min {row['update_min_ms']:.1f}, max {row['update_max_ms']:.1f})", flush=True)
        for kind in ("update_hlo", "step_hlo"):
            h = row[kind]
            print(f"    {kind[:-4]:6s} HLO: big writes {_fmt_counts(h['big_writes'])}; big reads "
                  f"{_fmt_counts(h['big_reads'])}; conditionals {h['conditionals']}; "
                  f"top-level instructions {h['instructions']} (fusions {h['fusions']})", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="256,1024")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--hlo-dir", default=None, help="write the optimised HLO text of every update and step here")
    args = ap.parse_args(argv)
    print(f"jax {jax.__version__}, optax {optax.__version__}, python {platform.python_version()}, "
          f"{jax.devices()[0].platform}, {platform.machine()}; rounds={args.rounds}")
    for n in [int(b) for b in args.batches.split(",")]:
        profile(n, args.rounds, args.hlo_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
