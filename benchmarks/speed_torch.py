"""Step time and peak memory of private training in PyTorch on CPU: adaclip_torch vs Opacus.

Usage (Opacus comes with the ``peers`` extra: ``pip install torch==2.13.0 -e ".[torch,peers]"``)::

    python benchmarks/speed_torch.py            # MLP, CNN, LSTM LM at batch 64/256/1024
    python benchmarks/speed_torch.py --quick    # fewer repetitions, LSTM not at 1024, memory at 256 only
    python benchmarks/speed_torch.py --device cuda   # on a GPU (times with CUDA synchronisation)

One *step* is forward + backward + optimizer step (+ zero_grad) on a fixed random batch.
Methods (every private one with σ = 1, C = 1, plain SGD):

  nonprivate      the model and torch.optim.SGD alone (the LSTM LM uses nn.LSTM here)
  flat            adaclip_torch FlatClip, per-example gradients materialised
  flat_ghost      adaclip_torch FlatClip, per_sample_mode="auto" (ghost norms for Linear/Embedding)
  adaclip         adaclip_torch AdaClip, materialised
  adaclip_ghost   adaclip_torch AdaClip() (its default preset), per_sample_mode="auto"
  patent_ghost    adaclip_torch AdaClip(preset="patent"), per_sample_mode="auto"
  factored_ghost  adaclip_torch AdaClip(scale="separated", max_grad_norm=1, pooling="factored",
                  centre="none"), per_sample_mode="auto": the configuration whose ghost norms
                  cost what flat ones do (a rank-one scale while no clamp bites)
  <ours>+compile  one of ours with compile_release=True (the release under torch.compile),
                  e.g. adaclip_ghost+compile; warmed up for 4 steps (the compilation)
  <ours>+nokernel one of ours with use_kernel=False (on CUDA: the core path instead of the fused
                  Triton kernels that per_sample_mode="auto" picks there), e.g. flat_ghost+nokernel
  <ours>+osnoise  one of ours with seed=None (the default: noise from an OS-seeded generator,
                  drawn on the parameters' device) instead of seed=0 (drawn on the CPU generator
                  and copied, the same stream on every device), e.g. flat_ghost+osnoise
  nonprivate_compiled  the non-private step on ``torch.compile(model)`` (warmed up for 4 steps)
  flat_region     FlatClip with attach_hooks=False and its per-example gradients from
                  adaclip_torch.compiled.CompiledPerExampleGradients(compile=False): the
                  torch.func region, eager (mlp and cnn)
  flat_compiled   the same region under torch.compile (warmed up for 4 steps)
  flat_capture    FlatClip with its hooks (per_sample_mode="auto") fed by
                  CompiledPerExampleGradients(method="capture", compile=False): every layer
                  call's input and output gradient from one torch.fx-rewritten forward and a
                  backward to the probes, eager; the ghost engine clips them
  flat_capture_compiled    the same region under torch.compile (warmed up for 4 steps)
  adaclip_capture_compiled AdaClip()'s default fed the same way, with compile_release=True:
                  the region and the release both compiled
  opacus_hooks    Opacus PrivacyEngine, flat clipping, grad_sample_mode="hooks"
  opacus_ghost    Opacus PrivacyEngine, flat clipping, grad_sample_mode="ghost"
                  (its criterion wrapper runs the two backward passes of ghost clipping)

Models: ``mlp`` 784-1000-10 (the AdaCliP paper's), ``cnn`` two conv layers + two linear on
28×28 inputs, ``lstm`` embedding(1000, 128) → one-layer LSTM(128) → linear(1000) over 20
positions (our DPLSTM / Opacus DPLSTM).

Time: all methods of one (model, batch) are built in one process and timed in interleaved
rounds (round r times one step of every method, in turn), after warm-up steps (2; 1 with
``--quick``); torch runs on one thread unless ``--threads`` says otherwise; the
table gives medians over rounds and ratios of medians taken in that same run.

Memory: ``peak MiB`` is the growth of the process's peak resident set size (``VmHWM``, reset
just before the steps) over two steps, measured in a *fresh subprocess per configuration*. On CPU torch allocates tensors with malloc,
so ``ru_maxrss`` sees every temporary — which tracemalloc (Python allocations only) does not.
It includes the first step's one-time allocations (``.grad`` buffers, optimizer state).

On CUDA (``--device cuda``) the model and the batch live on the GPU, every timed step ends with
``torch.cuda.synchronize()``, and ``peak MiB`` is the growth of ``torch.cuda.max_memory_allocated``
over the two steps (reset just before them), in the same fresh subprocess per configuration.
With ``per_sample_mode="auto"`` our methods take the fused Triton kernels there where they apply
(flat clipping and the patent's AdaCliP on float32 parameters).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings

import torch
import torch.nn.functional as F
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling _memory.py
from _memory import peak_growth_mib  # noqa: E402

METHODS = [
    "nonprivate",
    "flat",
    "flat_ghost",
    "adaclip",
    "adaclip_ghost",
    "factored_ghost",
    "patent_ghost",
    "opacus_hooks",
    "opacus_ghost",
]
#: methods that compile something at their first steps (warmed up past it, no memory probe)
COMPILING = ("nonprivate_compiled", "flat_compiled", "flat_capture_compiled", "adaclip_capture_compiled")
#: suffix of a method of ours run with ``compile_release=True`` (e.g. ``adaclip_ghost+compile``)
COMPILED = "+compile"
#: suffix of a method of ours run with ``use_kernel=False`` (e.g. ``flat_ghost+nokernel``)
NO_KERNEL = "+nokernel"
#: suffix of a method of ours run with ``seed=None`` (e.g. ``flat_ghost+osnoise``)
OS_NOISE = "+osnoise"
#: AdaClip keywords of the ``factored_ghost`` method
FACTORED = dict(scale="separated", max_grad_norm=1.0, pooling="factored", centre="none")
VOCAB, HIDDEN, SEQ = 1000, 128, 20
#: where models, batches and steps run (``--device``)
DEVICE = torch.device("cpu")


def _sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


# --------------------------------------------------------------------------- models


def build_model(name: str, method: str) -> nn.Module:
    if name == "mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(784, 1000), nn.ReLU(), nn.Linear(1000, 10))
    if name == "cnn":
        return nn.Sequential(
            nn.Conv2d(1, 16, 8, stride=2, padding=3),
            nn.ReLU(),
            nn.MaxPool2d(2, 1),
            nn.Conv2d(16, 32, 4, stride=2),
            nn.ReLU(),
            nn.MaxPool2d(2, 1),
            nn.Flatten(),
            nn.Linear(32 * 4 * 4, 32),
            nn.ReLU(),
            nn.Linear(32, 10),
        )
    if name == "lstm":
        if method == "nonprivate":
            lstm: nn.Module = nn.LSTM(HIDDEN, HIDDEN, batch_first=True)
        elif method.startswith("opacus"):
            from opacus.layers import DPLSTM as OpacusDPLSTM

            lstm = OpacusDPLSTM(HIDDEN, HIDDEN, batch_first=True)
        else:
            from adaclip_torch.layers import DPLSTM

            lstm = DPLSTM(HIDDEN, HIDDEN, batch_first=True)
        return LanguageModel(lstm)
    raise ValueError(name)


class LanguageModel(nn.Module):
    def __init__(self, lstm: nn.Module):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.lstm = lstm
        self.out = nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h, _ = self.lstm(self.emb(ids))
        return self.out(h)  # (n, T, V)


def make_data(name: str, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if name == "lstm":
        return torch.randint(0, VOCAB, (n, SEQ), generator=g), torch.randint(0, VOCAB, (n, SEQ), generator=g)
    return torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g)


def loss_fn(name: str, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if name == "lstm":
        return F.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1))
    return F.cross_entropy(out, y)


# --------------------------------------------------------------------------- one step per method


def build_step(model_name: str, method: str, n: int):
    """A closure running one training step of ``method`` on a fixed batch of size ``n``."""
    torch.manual_seed(0)
    model = build_model(model_name, method).to(DEVICE)
    x, y = (t.to(DEVICE) for t in make_data(model_name, n))
    sgd = torch.optim.SGD(model.parameters(), lr=0.01)
    if method in ("nonprivate", "nonprivate_compiled"):
        forward = torch.compile(model) if method == "nonprivate_compiled" else model

        def step() -> None:
            loss_fn(model_name, forward(x), y).backward()
            sgd.step()
            sgd.zero_grad()

        return step
    if method in ("flat_region", "flat_compiled"):
        from adaclip_torch import FlatClip
        from adaclip_torch.compiled import CompiledPerExampleGradients

        opt = FlatClip(sgd, model, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=n, seed=0,
                       attach_hooks=False)  # fmt: skip
        region = CompiledPerExampleGradients(
            opt, lambda out, target: loss_fn(model_name, out, target), compile=method == "flat_compiled"
        )

        def step() -> None:
            region(x, y)
            opt.step()
            opt.zero_grad()

        return step
    if method in ("flat_capture", "flat_capture_compiled", "adaclip_capture_compiled"):
        from adaclip_torch import AdaClip, FlatClip
        from adaclip_torch.compiled import CompiledPerExampleGradients

        common = dict(noise_multiplier=1.0, expected_batch_size=n, seed=0, per_sample_mode="auto")
        if method.startswith("adaclip"):
            opt = AdaClip(sgd, model, compile_release=True, **common)
        else:
            opt = FlatClip(sgd, model, max_grad_norm=1.0, **common)
        region = CompiledPerExampleGradients(
            opt, lambda out, target: loss_fn(model_name, out, target), method="capture",
            compile=method.endswith("compiled"),
        )  # fmt: skip

        def step() -> None:
            region(x, y)
            opt.step()
            opt.zero_grad()

        return step
    os_noise = method.endswith(OS_NOISE)
    if os_noise:
        method = method[: -len(OS_NOISE)]
    no_kernel = method.endswith(NO_KERNEL)
    if no_kernel:
        method = method[: -len(NO_KERNEL)]
    compiled = method.endswith(COMPILED)
    if compiled:
        method = method[: -len(COMPILED)]
    if method in ("flat", "flat_ghost", "adaclip", "adaclip_ghost", "factored_ghost", "patent_ghost"):
        from adaclip_torch import AdaClip, FlatClip

        mode = "auto" if method.endswith("ghost") else "materialise"
        common = dict(
            noise_multiplier=1.0,
            expected_batch_size=n,
            seed=None if os_noise else 0,
            per_sample_mode=mode,
            compile_release=compiled,
            use_kernel=False if no_kernel else None,
        )
        if method.startswith("flat"):
            opt = FlatClip(sgd, model, max_grad_norm=1.0, **common)
        elif method.startswith("patent"):
            opt = AdaClip(sgd, model, preset="patent", **common)
        elif method.startswith("factored"):
            opt = AdaClip(sgd, model, **FACTORED, **common)
        else:
            opt = AdaClip(sgd, model, **common)

        def step() -> None:
            loss_fn(model_name, model(x), y).backward()
            opt.step()
            opt.zero_grad()

        return step
    if method in ("opacus_hooks", "opacus_ghost"):
        from opacus import PrivacyEngine
        from torch.utils.data import DataLoader, TensorDataset

        warnings.filterwarnings("ignore")
        engine = PrivacyEngine()
        loader = DataLoader(TensorDataset(x, y), batch_size=n)
        if method == "opacus_hooks":
            gsm, opt, _ = engine.make_private(
                module=model,
                optimizer=sgd,
                data_loader=loader,
                noise_multiplier=1.0,
                max_grad_norm=1.0,
                poisson_sampling=False,
                grad_sample_mode="hooks",
            )

            def step() -> None:
                loss_fn(model_name, gsm(x), y).backward()
                opt.step()
                opt.zero_grad()

            return step
        criterion = nn.CrossEntropyLoss()
        gsm, opt, dp_criterion, _ = engine.make_private(
            module=model,
            optimizer=sgd,
            criterion=criterion,
            data_loader=loader,
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            poisson_sampling=False,
            grad_sample_mode="ghost",
        )

        def step() -> None:
            out = gsm(x)
            if model_name == "lstm":
                loss = dp_criterion(out.reshape(-1, VOCAB), y.reshape(-1), shape=(n, SEQ))
            else:
                loss = dp_criterion(out, y)
            loss.backward()
            opt.step()
            opt.zero_grad()

        return step
    raise ValueError(method)


# --------------------------------------------------------------------------- measurements


def time_config(model_name: str, n: int, methods: list[str], rounds: int, warmup: int) -> dict[str, float]:
    steps = {}
    for m in methods:
        try:
            steps[m] = build_step(model_name, m, n)
            # a compiled release compiles at its first steps (and once more when the step
            # counter in the state turns dynamic): warm it up past that
            for _ in range(max(warmup, 4) if m.endswith(COMPILED) or m in COMPILING else warmup):
                steps[m]()
            _sync()
        except Exception as exc:  # report, keep going
            print(f"  [{model_name} n={n}] {m} failed: {type(exc).__name__}: {exc}", flush=True)
    times: dict[str, list[float]] = {m: [] for m in steps}
    for _ in range(rounds):
        for m, step in steps.items():
            _sync()
            t0 = time.perf_counter()
            step()
            _sync()
            times[m].append(time.perf_counter() - t0)
    return {m: statistics.median(v) for m, v in times.items()}


def memory_probe(model_name: str, n: int, method: str) -> None:
    """Run in a fresh process: print the peak memory growth (MiB) over two steps
    (:func:`_memory.peak_growth_mib`: ``VmHWM`` on CPU, CUDA's peak allocation on a GPU)."""
    step = build_step(model_name, method, n)
    print(json.dumps({"peak_mib": peak_growth_mib(step, DEVICE)}))


def memory_config(model_name: str, n: int, method: str) -> float | None:
    if method.endswith(COMPILED) or method in COMPILING:  # the probe's two steps would measure the compiler
        return None
    proc = subprocess.run(
        [
            sys.executable,
            os.path.abspath(__file__),
            "--memory-probe",
            model_name,
            str(n),
            method,
            "--threads",
            str(torch.get_num_threads()),
            "--device",
            DEVICE.type,
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    if proc.returncode != 0:
        print(f"  memory probe {model_name} n={n} {method} failed: {proc.stderr.strip().splitlines()[-1:]}")
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])["peak_mib"]


def profile_steps(model_name: str, n: int, method: str) -> None:
    """Where one method's step spends its time: torch.profiler over 5 steps, self CPU time, by
    operator and by operator and input shapes."""
    from torch.profiler import profile

    warnings.filterwarnings("ignore")
    step = build_step(model_name, method, n)
    for _ in range(5):
        step()
    with profile(record_shapes=True) as prof:
        for _ in range(5):
            step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    print("By input shapes (which tensors the time goes to):")
    print(prof.key_averages(group_by_input_shape=True).table(
        sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=24, max_shapes_column_width=60))


def time_release(rounds: int) -> None:
    """The release alone (noise added, rescale, state update; the core's ``release``) on the
    MLP's parameter shapes, eager and under ``torch.compile``, for the patent's AdaCliP, the
    factored configuration and flat clipping: how much of a step is elementwise passes over d,
    and whether compiling them (fusion on CPU) pays. Each timed call continues from the state
    the previous one returned, as training does."""
    from adaclip import strategies as S
    from adaclip_torch import AdaClip, FlatClip

    warnings.filterwarnings("ignore")
    print("| configuration | eager ms | compiled ms (after a first call) | first compiled call s |")
    print("|---|---|---|---|")
    for label in ("adaclip", "factored", "flat"):
        torch.manual_seed(0)
        model = build_model("mlp", "nonprivate")
        sgd = torch.optim.SGD(model.parameters(), lr=0.01)
        common = dict(noise_multiplier=1.0, expected_batch_size=256, seed=0)
        if label == "flat":
            opt = FlatClip(sgd, model, max_grad_norm=1.0, **common)
        else:
            opt = AdaClip(sgd, model, **(FACTORED if label == "factored" else {}), **common)
        strategy, params = opt.strategy, opt.params
        summed = [torch.randn_like(p) for p in params]
        noise = [torch.randn_like(p) for p in params]

        def release(state, strategy=strategy, summed=summed, noise=noise):
            transformed = strategy.transform(state, len(summed))
            return S.release(
                strategy,
                state,
                summed,
                noise,
                noise_multiplier=1.0,
                expected_batch_size=256.0,
                transformed=transformed,
            )

        compiled = torch.compile(release)
        out = {}
        for name, fn in (("eager", release), ("compiled", compiled)):
            state = opt.clip_state
            t0 = time.perf_counter()
            _, state = fn(state)
            first = time.perf_counter() - t0
            times = []
            for _ in range(rounds):
                t0 = time.perf_counter()
                _, state = fn(state)
                times.append(time.perf_counter() - t0)
            out[name] = (statistics.median(times), first)
        print(
            f"| {label} | {1e3 * out['eager'][0]:.1f} | {1e3 * out['compiled'][0]:.1f} | {out['compiled'][1]:.1f} |",
            flush=True,
        )


def _ratio_cell(values: list[float]) -> str:
    """Median of per-repeat ratios, with their range when there are several repeats."""
    if not values:
        return "-"
    med = statistics.median(values)
    if len(values) == 1:
        return f"{med:.2f}"
    return f"{med:.2f} ({min(values):.2f}–{max(values):.2f})"


#: the baselines every method is compared with (when they are among the methods)
BASELINES = ("flat", "flat_ghost", "opacus_ghost", "nonprivate")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--quick",
        action="store_true",
        help="3 rounds after 1 warm-up step, no LSTM at 1024, memory at batch 256 only",
    )
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds per method (default 7, quick 3)")
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="repeat each (model, batch) timing this often, each with freshly built methods; "
        "ratios are reported as the median over repeats with their range",
    )
    ap.add_argument("--models", default="mlp,cnn,lstm")
    ap.add_argument("--batches", default="64,256,1024")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--json", default=None, help="also write every per-repeat median here")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (default 1: stable ratios on a shared machine)",
    )
    ap.add_argument(
        "--release",
        action="store_true",
        help="only time the release (noise, rescale, state update), eager and torch.compile",
    )
    ap.add_argument(
        "--profile",
        nargs=3,
        metavar=("MODEL", "BATCH", "METHOD"),
        help="print torch.profiler's self-CPU table of 5 steps (after 5 warm-up steps)",
    )
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where to run (default cpu)")
    ap.add_argument("--memory-probe", nargs=3, metavar=("MODEL", "BATCH", "METHOD"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    global DEVICE
    DEVICE = torch.device(args.device)
    if args.memory_probe:
        memory_probe(args.memory_probe[0], int(args.memory_probe[1]), args.memory_probe[2])
        return
    rounds = args.rounds or (3 if args.quick else 7)
    if args.profile:
        profile_steps(args.profile[0], int(args.profile[1]), args.profile[2])
        return
    if args.release:
        time_release(rounds)
        return
    models = args.models.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    methods = args.methods.split(",")
    import opacus

    versions = (
        f"python {platform.python_version()}, torch {torch.__version__}, opacus {opacus.__version__}, "
        f"threads {torch.get_num_threads()}, cpus {os.cpu_count()}, {platform.processor() or platform.machine()}"
    )
    if DEVICE.type == "cuda":
        versions += f", device {torch.cuda.get_device_name()}, CUDA {torch.version.cuda}"
    print(versions)
    print(f"rounds {rounds}, repeats {args.repeats}, quick={args.quick}\n")
    bases = [b for b in BASELINES if b in methods]
    header = (
        "| model | batch | method | step ms (median) | "
        + " | ".join(f"× {b}" for b in bases)
        + " | peak MiB |"
    )
    rows = [header, "|" + "---|" * (5 + len(bases))]
    record: dict[str, object] = {"versions": versions, "rounds": rounds, "repeats": args.repeats, "cells": []}
    for model_name in models:
        for n in batches:
            if args.quick and model_name == "lstm" and n >= 1024:
                continue
            runs = [
                time_config(model_name, n, methods, rounds, 1 if args.quick else 2)
                for _ in range(args.repeats)
            ]
            mem: dict[str, float | None] = {}
            if not args.no_memory and (not args.quick or n == 256):
                mem = {m: memory_config(model_name, n, m) for m in runs[0]}
            record["cells"].append({"model": model_name, "batch": n, "medians_s": runs, "peak_mib": mem})
            for m in methods:
                times = [r[m] for r in runs if m in r]
                if not times:
                    rows.append(f"| {model_name} | {n} | {m} | failed |" + " |" * len(bases) + " |")
                    continue
                cells = []
                for b in bases:
                    cells.append(_ratio_cell([r[m] / r[b] for r in runs if m in r and r.get(b)]))
                pm = mem.get(m)
                rows.append(
                    f"| {model_name} | {n} | {m} | {1e3 * statistics.median(times):.1f} | "
                    + " | ".join(cells)
                    + f" | {'-' if pm is None else f'{pm:.0f}'} |"
                )
            print("\n".join(rows[-len(methods) :]), flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(record, f, indent=1)
    print("\n" + "\n".join(rows))


if __name__ == "__main__":
    main()
