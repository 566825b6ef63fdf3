"""Peak memory and step time with and without activation checkpointing, private and not, in
float32 and bfloat16.

A GPT-2-style model (random init from a ``GPT2Config``, dropout off), full fine-tuning with SGD
(no momentum), the loss ``per_example_lm_loss`` summed over the batch. Each configuration runs
in a fresh process, one torch thread. Two grids:

``--grid full`` (the recorded table): 4 layers, hidden 256, 4 heads, vocab 1,000, 256 tokens,
batch 8; {non-private, private ``FlatClip(per_sample_mode="ghost")``, private
``FlatClip(per_sample_mode="materialise")``} × {checkpointing off, on (Hugging Face's
``gradient_checkpointing_enable``/``activation_checkpointing_enable``, non-reentrant)} ×
{float32 parameters, bfloat16 parameters (``model.to(torch.bfloat16)``), float32 parameters
under ``torch.autocast("cpu", dtype=torch.bfloat16)``}. ``--training``/``--precisions`` cut it.

``--grid legacy`` (the default, the first version's table): 4 layers, hidden 256, 128 tokens,
batch 16, float32; non-private and ``FlatClip(per_sample_mode="auto")`` × checkpointing off/on,
with the resident-set probe (``benchmarks/_memory.py``) beside the live-tensor peak.

**Peak memory: live tensor bytes, counted by the profiler.** The process runs under
``torch.profiler.profile(profile_memory=True)`` from before the model is built to the end of the
measured step; every tensor allocation and free on the CPU allocator is a ``[memory]`` event with
a signed byte count (``nbytes``). In time order their running sum is the bytes of live tensors
created inside the window. The measured step (forward, backward, ``opt.step()``,
``opt.zero_grad()``) follows one warm-up step and is delimited by a ``record_function`` marker;
the table reports the running sum just before it (the state: parameters, optimizer state,
inputs), its growth at the end of the forward pass and loss (what is held for the backward pass:
saved activations, the per-sample hooks' captured inputs, the logits), its maximum during the
step (the peak) and the phase the peak falls in (forward, backward, or ``optimizer``:
``opt.step()`` and ``opt.zero_grad()``, where the private optimizer clips, noises and updates),
in MiB (2**20 bytes). This counts tensors,
not the allocator's caches or fragmentation and not buffers libraries allocate outside torch's
allocator (oneDNN scratch space): what ``torch.cuda.max_memory_allocated`` counts on a GPU, not
the resident set. ``--self-check`` validates it on known answers (run before every table too):
a 100 MiB tensor allocated inside the window raises the peak by 100 MiB, a tensor freed before a
second is allocated counts once (the peak is not the sum), a matmul's output and a bfloat16
tensor have their known sizes, and holding 100 MiB over a forward/backward pass adds exactly 100
MiB to its peak. The step time is the median of ``--steps`` steps timed after the profiled window
(no profiler running), in the same process.

    # the recorded table (benchmarks/results/checkpointing.md): about 25 minutes on 2 CPU cores,
    # where the bfloat16 and autocast cells take 16-25 s a step (no native bf16 arithmetic)
    python benchmarks/checkpointing_memory.py --grid full --steps 3 --timeout 900 --json out.json
    python benchmarks/checkpointing_memory.py                 # the first version's table (RSS + live), ~2 min
    python benchmarks/checkpointing_memory.py --self-check    # the probe's known-answer checks only (seconds)
    python benchmarks/checkpointing_memory.py --grid full --quick   # a smoke run (tiny model, ~3 min)
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterable
from typing import Any

MIB = 2**20
MARK = "checkpointing_memory::measured_step"
FORWARD = "checkpointing_memory::forward"
BACKWARD = "checkpointing_memory::backward"
OPTIMIZER = "checkpointing_memory::optimizer"
PHASES = {"forward": FORWARD, "backward": BACKWARD, "optimizer": OPTIMIZER}
TRAININGS = ("nonprivate", "ghost", "materialise")
PRECISIONS = ("fp32", "bf16", "autocast")
LABEL = {
    "nonprivate": "non-private",
    "auto": "private (FlatClip, auto)",
    "ghost": "private (FlatClip, ghost)",
    "materialise": "private (FlatClip, materialise)",
    "fp32": "float32",
    "bf16": "bfloat16 params",
    "autocast": "float32 + autocast bf16",
}
# (layers, hidden, heads, vocab, seq, batch)
SIZES = {
    "full": (4, 256, 4, 1000, 256, 8),
    "legacy": (4, 256, 4, 1000, 128, 16),
    "quick": (1, 32, 2, 100, 16, 4),
}
LEGACY = [(private, ckpt) for private in (False, True) for ckpt in (False, True)]


# ---------------------------------------------------------------------------------------------
# the probe: live tensor bytes from the profiler's memory events


def memory_profile() -> Any:
    """A CPU profiler that records every allocation and free (no shapes, no stacks)."""
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False)


def _events(prof: Any) -> list[Any]:
    return list(prof.profiler.kineto_results.events())


def memory_deltas(prof: Any) -> list[tuple[int, int]]:
    """``(time_ns, signed bytes)`` of every CPU ``[memory]`` event of a finished profile, in time
    order (ties keep the profiler's order)."""
    out = [(e.start_ns(), i, e.nbytes()) for i, e in enumerate(_events(prof))
           if e.name() == "[memory]" and str(e.device_type()).endswith("CPU")]  # fmt: skip
    out.sort()
    return [(t, b) for t, _, b in out]


def window(prof: Any, name: str) -> tuple[int, int]:
    """Start and end (ns) of the one ``record_function(name)`` range of a finished profile."""
    (w,) = [(e.start_ns(), e.end_ns()) for e in _events(prof) if e.name() == name]
    return w


def live_bytes(
    deltas: Iterable[tuple[int, int]], start: int | None = None, end: int | None = None
) -> dict[str, int]:
    """Running sum of the deltas: ``before`` (at ``start``), ``peak`` (its maximum over
    ``[start, end]``, at least ``before``) and ``after`` (at ``end``). Bytes; the zero is the
    first event of the profile."""
    running, before, peak = 0, None, None
    for t, b in deltas:
        if start is not None and t < start:
            running += b
            continue
        if before is None:
            before = peak = running
        if end is not None and t > end:
            break
        running += b
        peak = max(peak, running)
    if before is None:
        before = peak = running
    return {"before": before, "peak": peak, "after": running}


def peak_of(fn: Callable[[], Any]) -> dict[str, int]:
    """Run ``fn`` once under the probe: the peak and net growth (bytes) of live tensors."""
    gc.collect()
    with memory_profile() as prof:
        fn()
    return live_bytes(memory_deltas(prof))


def self_check(verbose: bool = True) -> dict[str, float]:
    """The probe's known-answer checks; raises ``AssertionError`` when one fails. Returns the
    measured figures (MiB)."""
    import torch

    torch.set_num_threads(1)
    res: dict[str, float] = {}

    def close(name: str, got_bytes: int, want_bytes: int, rel: float = 0.02) -> None:
        res[name] = got_bytes / MIB
        ok = abs(got_bytes - want_bytes) <= rel * want_bytes
        if verbose:
            print(f"self-check {name}: {got_bytes / MIB:.3f} MiB (want {want_bytes / MIB:.3f} ± {rel:.0%})"
                  f" {'ok' if ok else 'FAILED'}", file=sys.stderr)  # fmt: skip
        assert ok, f"memory probe self-check {name}: {got_bytes} bytes, want {want_bytes} ± {rel:.0%}"

    # 1. one 100 MiB tensor allocated, written and freed inside the window
    def big() -> None:
        x = torch.empty(100 * MIB, dtype=torch.uint8)
        x.fill_(1)
        del x

    r = peak_of(big)
    close("100MiB_tensor_peak", r["peak"], 100 * MIB)
    assert r["after"] == 0, r

    # 2. freed before the next allocation: the peak is the larger, not the sum
    def sequential() -> None:
        x = torch.empty(100 * MIB, dtype=torch.uint8)
        del x
        y = torch.empty(50 * MIB, dtype=torch.uint8)
        del y

    close("free_then_alloc_peak", peak_of(sequential)["peak"], 100 * MIB)

    # 3. a matmul's output (inputs allocated before the window) and a bfloat16 tensor
    a, b = torch.randn(2048, 1024), torch.randn(1024, 2048)
    close("matmul_output", peak_of(lambda: a @ b)["peak"], 2048 * 2048 * 4)
    close(
        "bf16_tensor", peak_of(lambda: torch.zeros(4096, 4096, dtype=torch.bfloat16))["peak"], 4096 * 4096 * 2
    )

    # 4. a forward/backward pass, alone and with 100 MiB held over it: the peak rises by 100 MiB
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 512))
    x = torch.randn(256, 512)

    def fwd_bwd() -> None:
        net(x).square().sum().backward()
        net.zero_grad(set_to_none=True)

    def held() -> None:
        h = torch.empty(100 * MIB, dtype=torch.uint8)
        h.fill_(0)
        fwd_bwd()
        del h

    fwd_bwd()
    p0 = peak_of(fwd_bwd)["peak"]
    p1 = peak_of(held)["peak"]
    res["fwd_bwd_peak"] = p0 / MIB
    close("fwd_bwd_plus_100MiB", p1 - p0, 100 * MIB)
    # and the pass's own peak is at least its gradients + the saved hidden activations
    grads = sum(p.numel() * 4 for p in net.parameters())
    hidden = 256 * 2048 * 4
    assert p0 >= grads + hidden, (p0, grads, hidden)
    if verbose:
        print(f"self-check fwd_bwd_peak: {p0 / MIB:.2f} MiB >= gradients + hidden "
              f"{(grads + hidden) / MIB:.2f} MiB ok", file=sys.stderr)  # fmt: skip
    return res


# ---------------------------------------------------------------------------------------------
# one configuration, in its own process


def _build(
    training: str, checkpointing: bool, precision: str, sizes: tuple[int, ...]
) -> tuple[Any, Callable[..., None]]:
    import contextlib

    import torch
    import transformers as T

    from adaclip_torch import FlatClip
    from adaclip_torch.losses import per_example_lm_loss

    layers, hidden, heads, vocab, seq, batch = sizes
    torch.manual_seed(0)
    model = T.GPT2LMHeadModel(T.GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=hidden, n_layer=layers,
                                           n_head=heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))  # fmt: skip
    if precision == "bf16":
        model.to(torch.bfloat16)
    model.train()
    if checkpointing:
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    sgd = torch.optim.SGD(model.parameters(), lr=1e-3)
    if training == "nonprivate":
        opt = sgd
    else:
        opt = FlatClip(sgd, model, noise_multiplier=1.0, expected_batch_size=float(batch), max_grad_norm=1.0,
                       loss_reduction="sum", per_sample_mode=training, seed=0)  # fmt: skip
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))

    def step(mark: bool = False) -> None:
        # mark: the phases inside record_function ranges, for the profile
        def phase(name: str) -> Any:
            return torch.profiler.record_function(name) if mark else contextlib.nullcontext()

        cast = (
            torch.autocast("cpu", dtype=torch.bfloat16)
            if precision == "autocast"
            else contextlib.nullcontext()
        )
        with phase(FORWARD), cast:  # with the loss
            loss = per_example_lm_loss(model(input_ids=ids).logits, ids)
        with phase(BACKWARD):
            loss.backward()
        with phase(OPTIMIZER):  # the private optimizer's clipping, noise and update
            opt.step()
            opt.zero_grad()

    return model, step


def _one(spec: dict[str, Any]) -> dict[str, Any]:
    import pathlib

    import torch
    import transformers as T

    warnings.filterwarnings("ignore")
    T.logging.set_verbosity_error()
    torch.set_num_threads(1)
    sizes = tuple(spec["sizes"])
    args = (spec["training"], spec["checkpointing"], spec["precision"], sizes)
    out: dict[str, Any] = dict(spec)
    first = None
    if spec.get("rss"):
        # the first version's sequence, first in the process (the resident set's high-water mark
        # is not reset by anything but this probe): three warm-up steps, the RSS growth over two
        sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
        from _memory import peak_growth_mib

        first = _build(*args)
        for _ in range(3):
            first[1]()
        out["rss_peak_mib"] = peak_growth_mib(first[1], torch.device("cpu"))
    with memory_profile() as prof:  # a model of its own: only tensors made in the window count
        model, step = _build(*args)
        step()  # warm-up: lazily created state (optimizer, noise) is part of the state before
        gc.collect()
        from torch.profiler import record_function

        with record_function(MARK):
            step(mark=True)
    start, end = window(prof, MARK)
    deltas = memory_deltas(prof)
    live = live_bytes(deltas, start, end)
    forward = live_bytes(deltas, start, window(prof, FORWARD)[1])
    phases = {k: live_bytes(deltas, *window(prof, v))["peak"] for k, v in PHASES.items()}
    del prof, deltas
    out["param_mib"] = sum(p.numel() * p.element_size() for p in model.parameters()) / MIB
    out["state_mib"] = live["before"] / MIB
    out["peak_mib"] = live["peak"] / MIB
    out["step_peak_mib"] = (live["peak"] - live["before"]) / MIB
    out["after_forward_mib"] = (forward["after"] - live["before"]) / MIB  # held for the backward pass
    out["phase_peak_mib"] = {k: (v - live["before"]) / MIB for k, v in phases.items()}  # above the state
    out["peak_phase"] = max(phases, key=lambda k: phases[k])
    if first is not None:  # time the first version's model, as it did
        step = first[1]
        del model
    times = []
    for _ in range(spec["steps"]):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    out["step_s"] = statistics.median(times)
    out["step_times_s"] = times
    return out


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b > 0 else "—"


def _run(spec: dict[str, Any], timeout: float | None) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--one", json.dumps(spec)]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return dict(spec, error=f"over the {timeout:.0f} s limit")
    if proc.returncode != 0:
        return dict(spec, error=(proc.stderr.strip().splitlines() or ["?"])[-1])
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["wall_s"] = time.perf_counter() - t0
    return out


# ---------------------------------------------------------------------------------------------
# the tables


def _legacy(args: argparse.Namespace) -> list[dict[str, Any]]:
    sizes = SIZES["quick" if args.quick else "legacy"]
    rows = {}
    for private, ckpt in LEGACY:
        spec = {"training": "auto" if private else "nonprivate", "checkpointing": ckpt, "precision": "fp32",
                "sizes": sizes, "steps": args.steps, "rss": True}  # fmt: skip
        r = _run(spec, args.timeout)
        if "error" in r:
            raise SystemExit(f"{spec}: {r['error']}")
        rows[(private, ckpt)] = r
        print(f"{LABEL[spec['training']]}, checkpointing {'on' if ckpt else 'off'}: "
              f"{ {k: r[k] for k in ('rss_peak_mib', 'peak_mib', 'state_mib', 'step_s')} }", file=sys.stderr)  # fmt: skip
    print("| training | checkpointing | peak memory growth (MiB) | step (s) | memory / without | time / without "
          "| peak live tensors (MiB) | live / without |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for private, ckpt in LEGACY:
        r, base = rows[(private, ckpt)], rows[(private, False)]
        print(f"| {'private (FlatClip, auto)' if private else 'non-private'} | {'on' if ckpt else 'off'} | "
              f"{r['rss_peak_mib']:.0f} | {r['step_s']:.3f} | {_ratio(r['rss_peak_mib'], base['rss_peak_mib'])} | "
              f"{r['step_s'] / base['step_s']:.2f} | {r['peak_mib']:.1f} | {r['peak_mib'] / base['peak_mib']:.2f} |")  # fmt: skip
    return list(rows.values())


def full_table(cells: list[dict[str, Any]]) -> str:
    """The markdown tables of a ``--grid full`` run: every cell against the non-private float32
    cell without checkpointing, what checkpointing saves in each (training, precision), and each
    phase's peak (above the state before the step)."""
    by = {(c["training"], c["checkpointing"], c["precision"]): c for c in cells}
    base = by.get(("nonprivate", False, "fp32"))
    ok = base is not None and "error" not in base
    lines = [
        "| training | precision | checkpointing | state before the step (MiB) | held after the forward (MiB) "
        "| peak above the state (MiB) | peak during | peak live tensors (MiB) | peak / base | step (s, median) "
        "| time / base |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        head = (
            f"| {LABEL[c['training']]} | {LABEL[c['precision']]} | {'on' if c['checkpointing'] else 'off'} |"
        )
        if "error" in c:
            lines.append(f"{head} — | — | — | — | — | — | — | — |  <!-- {c['error']} -->")
            continue
        rp = f"{c['peak_mib'] / base['peak_mib']:.2f}" if ok else "—"
        rt = f"{c['step_s'] / base['step_s']:.2f}" if ok else "—"
        lines.append(f"{head} {c['state_mib']:.1f} | {c['after_forward_mib']:.1f} | {c['step_peak_mib']:.1f} | "
                     f"{c['peak_phase']} | {c['peak_mib']:.1f} | {rp} | {c['step_s']:.3f} | {rt} |")  # fmt: skip
    lines += [
        "",
        "| training | precision | held after the forward, off → on (MiB) | peak off (MiB) | peak on (MiB) "
        "| checkpointing saves (MiB) | saves (% of off) | peak during, off / on | time on / off |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for t in TRAININGS:
        for p in PRECISIONS:
            off, on = by.get((t, False, p)), by.get((t, True, p))
            if off is None or on is None or "error" in off or "error" in on:
                continue
            saved = off["peak_mib"] - on["peak_mib"]
            lines.append(f"| {LABEL[t]} | {LABEL[p]} | {off['after_forward_mib']:.1f} → {on['after_forward_mib']:.1f} | "
                         f"{off['peak_mib']:.1f} | {on['peak_mib']:.1f} | {saved:.1f} | "
                         f"{100 * saved / off['peak_mib']:.0f} % | {off['peak_phase']} / {on['peak_phase']} | "
                         f"{on['step_s'] / off['step_s']:.2f} |")  # fmt: skip
    lines += [
        "",
        "| training | precision | checkpointing | forward peak (MiB) | backward peak (MiB) | optimizer peak (MiB) |",
        "|---|---|---|---|---|---|",
    ]
    for c in cells:
        if "error" not in c:
            ph = c["phase_peak_mib"]
            lines.append(f"| {LABEL[c['training']]} | {LABEL[c['precision']]} | {'on' if c['checkpointing'] else 'off'} "
                         f"| {ph['forward']:.1f} | {ph['backward']:.1f} | {ph['optimizer']:.1f} |")  # fmt: skip
    return "\n".join(lines)


def _full(args: argparse.Namespace) -> list[dict[str, Any]]:
    sizes = SIZES["quick" if args.quick else "full"]
    cells = []
    for training in args.training:
        for precision in args.precisions:
            for ckpt in (False, True):
                spec = {"training": training, "checkpointing": ckpt, "precision": precision, "sizes": sizes,
                        "steps": args.steps}  # fmt: skip
                r = _run(spec, args.timeout)
                cells.append(r)
                shown = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()
                         if k in ("state_mib", "after_forward_mib", "peak_mib", "peak_phase", "step_s", "wall_s", "error")}  # fmt: skip
                print(f"{LABEL[training]}, {LABEL[precision]}, checkpointing {'on' if ckpt else 'off'}: {shown}",
                      file=sys.stderr, flush=True)  # fmt: skip
    print(full_table(cells))
    return cells


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--grid", choices=("legacy", "full"), default="legacy",
                    help="legacy: the first version's four rows with the RSS probe (default); full: the "
                         "training × checkpointing × precision grid")  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="a tiny model (a smoke run, not a measurement)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per configuration (default 5)")
    ap.add_argument(
        "--training", nargs="+", choices=TRAININGS, default=list(TRAININGS), help="full grid: rows"
    )
    ap.add_argument(
        "--precisions", nargs="+", choices=PRECISIONS, default=list(PRECISIONS), help="full grid: rows"
    )
    ap.add_argument("--timeout", type=float, default=None, help="seconds per configuration (then left out)")
    ap.add_argument("--self-check", action="store_true", help="only the probe's known-answer checks")
    ap.add_argument("--json", default=None, help="write the cells (and the self-check) to this file")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one is not None:
        print(json.dumps(_one(json.loads(args.one))))
        return
    check = self_check()
    if args.self_check:
        print(json.dumps(check))
        return
    cells = _full(args) if args.grid == "full" else _legacy(args)
    if args.json:
        import platform

        import torch
        import transformers

        meta = {"argv": sys.argv, "python": platform.python_version(), "torch": torch.__version__,
                "transformers": transformers.__version__, "date": time.strftime("%Y-%m-%d")}  # fmt: skip
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "self_check": check, "cells": cells}, f, indent=1)


if __name__ == "__main__":
    main()
