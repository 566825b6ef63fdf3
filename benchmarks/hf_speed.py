"""Step time and peak memory of private fine-tuning of Hugging Face models on CPU: adaclip_torch vs Opacus.

Usage::

    python benchmarks/hf_speed.py --rounds 5 --rounds-large 3 --check   # the recorded run (~21 min on 2 cores)
    python benchmarks/hf_speed.py --quick            # tiny models, batch 4, 1 round: a smoke test
    python benchmarks/hf_speed.py --profile gpt2 full 32 flat_ghost   # torch.profiler, top ops

Models (random init from a config, no download, dropout 0 so that every method computes the same
step; float32):

  gpt2   ``GPT2LMHeadModel``: 4 layers, hidden 256, 4 heads, vocab 2,000, 64 positions; the LM
         head is tied to the input embedding. Loss: the per-example causal-LM loss
         (``adaclip_torch.losses.per_example_lm_loss``: each sequence's token mean), averaged
         over the examples.
  bert   ``BertForSequenceClassification``: 4 layers, hidden 256, 4 heads, intermediate 1,024,
         vocab 2,000, 2 labels. Loss: the cross-entropy of each example, averaged over the
         examples.

Modes:

  full   every parameter trained.
  lora   ``peft`` LoRA, r = 8, alpha 16, on every attention projection (GPT-2: ``attn.c_attn`` and
         ``attn.c_proj``; BERT: ``query``, ``key``, ``value`` and ``attention.output.dense``);
         BERT's classifier head is trained too (it is random), GPT-2's tied head is frozen.

Sequences of 64 tokens, no padding. One *step* is forward + backward + optimizer step
(+ zero_grad) on a fixed random batch, with plain SGD; every private method uses σ = 1, C = 1.

The loss is reduced the same way for every library, so that each clips the same per-example
gradients: ``loss = (1/n) Σ_i ℓ_i`` where ``ℓ_i`` is example i's loss (for GPT-2 the mean over
its own tokens), with ``loss_reduction="mean"`` everywhere (ours, Opacus's GradSampleModule and
optimizer). Opacus's ghost clipping needs its criterion wrapper (``DPLossFastGradientClipping``,
returned by ``make_private(criterion=...)``): it is given ``nn.CrossEntropyLoss()`` on the
flattened (shifted) logits with ``shape=(n, L - 1)``, from which it forms each sequence's token
mean -- the same ``ℓ_i``. ``--check`` verifies the equivalence: with σ = 0 and lr = 1, every
method that works must make the same update as our materialised flat clipping.

Methods:

  nonprivate            the model and torch.optim.SGD alone
  flat_<path>           ``adaclip_torch.FlatClip(max_grad_norm=1)``, ``per_sample_mode=<path>``
  adaclip_<path>        ``adaclip_torch.AdaClip()`` (the default configuration), ``<path>``
                        (path: materialise, ghost, auto); seed=0, so the noise is drawn on
                        the CPU and copied to the device
  <ours>+osnoise        the same, OS-seeded (``seed=None``, what users get by default): on a GPU
                        the noise is drawn there
  opacus_hooks          Opacus ``PrivacyEngine.make_private(grad_sample_mode="hooks")``
  opacus_ghost          Opacus ``grad_sample_mode="ghost"`` with its criterion wrapper
  opacus_<...>+ids      the same, with the position ids (and BERT's token type ids) passed as
                        contiguous ``(n, L)`` tensors: the workaround that lets Opacus run where
                        the models' own ``(1, L)`` ids make it fail (full fine-tuning only)

Time: all the methods of one (model, mode, batch) cell are built in one process and timed in
interleaved rounds (round r times one step of every method, starting at a different method each
round), after one warm-up step. A ratio is the median over the rounds of the per-round ratio of
two methods' step times, with the range over the rounds in brackets. torch runs on one thread
(``--threads``). Each step is timed twice: wall clock, and the process's CPU time
(``time.process_time``). With one thread the two agree on an idle machine; on a shared one the
CPU time leaves out the time other jobs held the core (it still sees their cache and memory
traffic), so the first table is of CPU time and the second of wall-clock time.

Memory: ``peak MiB`` is the growth of the process's peak resident set size (``VmHWM``, reset
just before the steps) over two steps, in a fresh subprocess per (cell, method), as in
``speed_torch.py``: on CPU torch allocates with malloc, so this sees every temporary. It includes
the first step's one-time allocations (``.grad`` buffers).

Failures: a method that raises while it is built, in its warm-up step or in a round is dropped
from the cell; the table of what works gives the stage (build, forward, backward, step) and the
error.
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
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling _memory.py
from _memory import peak_growth_mib  # noqa: E402

PATHS = ("materialise", "ghost", "auto")
METHODS = (
    ["nonprivate"]
    + [f"flat_{p}" for p in PATHS]
    + [f"adaclip_{p}" for p in PATHS]
    + ["opacus_hooks", "opacus_ghost", "opacus_hooks+ids", "opacus_ghost+ids"]
)
#: the baselines every ratio is taken against; "opacus_ghost" stands for "opacus_ghost+ids" in
#: a cell where Opacus's ghost clipping only runs with the batched ids
BASELINES = ("nonprivate", "opacus_ghost")
#: methods only run in full fine-tuning (with LoRA the position embeddings are frozen: nothing to work around)
FULL_ONLY = ("opacus_hooks+ids", "opacus_ghost+ids")

FULL_SIZES = dict(layers=4, hidden=256, heads=4, vocab=2000, seq=64)
QUICK_SIZES = dict(layers=1, hidden=32, heads=2, vocab=100, seq=16)
#: where models, batches and steps run (``--device``; on CUDA every timed step is synchronised
#: and ``peak MiB`` is the growth of ``torch.cuda.max_memory_allocated`` over two steps)
DEVICE = torch.device("cpu")


def _sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


# --------------------------------------------------------------------------- models


def build_model(model_name: str, mode: str, sizes: dict) -> nn.Module:
    import transformers as T

    T.logging.set_verbosity_error()
    torch.manual_seed(0)
    h, layers, heads, vocab, seq = (sizes[k] for k in ("hidden", "layers", "heads", "vocab", "seq"))
    if model_name == "gpt2":
        model = T.GPT2LMHeadModel(
            T.GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=h, n_layer=layers, n_head=heads,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        )  # fmt: skip
        targets = r".*\.attn\.(c_attn|c_proj)$"
    elif model_name == "bert":
        model = T.BertForSequenceClassification(
            T.BertConfig(vocab_size=vocab, hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads,
                         intermediate_size=4 * h, max_position_embeddings=seq, num_labels=2,
                         hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout=0.0)
        )  # fmt: skip
        targets = r".*\.attention\.(self\.(query|key|value)|output\.dense)$"
    else:
        raise ValueError(model_name)
    if mode == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(
            model,
            LoraConfig(r=8, lora_alpha=16, target_modules=targets, lora_dropout=0.0,
                       fan_in_fan_out=model_name == "gpt2"),
        )  # fmt: skip
        if model_name == "bert":
            model.base_model.model.classifier.requires_grad_(True)
        with torch.no_grad():  # B starts at 0, which makes A's gradients 0: move it (the cost is the same)
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0.0, 0.02)
    elif mode != "full":
        raise ValueError(mode)
    model.train()
    return model


def make_batch(model_name: str, n: int, sizes: dict) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, sizes["vocab"], (n, sizes["seq"]), generator=g)
    if model_name == "gpt2":
        return ids, ids  # the labels are the ids (shifted inside the loss)
    return ids, torch.randint(0, 2, (n,), generator=g)


def batched_ids(model_name: str, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The position ids (and BERT's token type ids) as contiguous ``(n, L)`` tensors.

    Left out, GPT-2 and BERT make position ids of shape ``(1, L)`` (and BERT expands a ``(1, L)``
    buffer of token type ids to ``(n, L)`` without copying): Opacus then fails on full
    fine-tuning (see the table of what works). The ``+ids`` Opacus methods pass these instead."""
    n, length = ids.shape
    out = {"position_ids": torch.arange(length, device=ids.device).expand(n, length).contiguous()}
    if model_name == "bert":
        out["token_type_ids"] = torch.zeros(n, length, dtype=torch.long, device=ids.device)
    return out


def forward_loss(
    model_name: str, model: nn.Module, ids: torch.Tensor, y: torch.Tensor, extra=None
) -> torch.Tensor:
    """(1/n) Σ_i ℓ_i: the loss every method but Opacus's ghost clipping backpropagates."""
    logits = model(input_ids=ids, **(extra or {})).logits
    if model_name == "gpt2":
        from adaclip_torch.losses import per_example_lm_loss

        return per_example_lm_loss(logits, y, batch_reduction="mean")
    return F.cross_entropy(logits, y)


def trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


# --------------------------------------------------------------------------- one step per method


class Step:
    """One training step of a method; ``stage`` says where it was when it raised."""

    def __init__(self, fwd, opt):
        self.fwd, self.opt, self.stage = fwd, opt, "build"

    def __call__(self) -> None:
        self.stage = "forward"
        loss = self.fwd()
        self.stage = "backward"
        loss.backward()
        self.stage = "step"
        self.opt.step()
        self.opt.zero_grad()
        self.stage = "done"


def build_step(
    model_name: str,
    mode: str,
    method: str,
    n: int,
    sizes: dict,
    *,
    noise: float = 1.0,
    lr: float = 0.01,
    clip: float = 1.0,
):
    torch.manual_seed(0)
    model = build_model(model_name, mode, sizes).to(DEVICE)
    ids, y = (t.to(DEVICE) for t in make_batch(model_name, n, sizes))
    sgd = torch.optim.SGD(trainable(model), lr=lr)
    if method == "nonprivate":
        return Step(lambda: forward_loss(model_name, model, ids, y), sgd), model
    kind, _, path = method.partition("_")
    path, _, suffix = path.partition("+")
    extra = batched_ids(model_name, ids) if suffix == "ids" else {}
    if kind in ("flat", "adaclip"):
        from adaclip_torch import AdaClip, FlatClip

        # "+osnoise": OS-seeded (the default for users), so the noise is drawn on the device;
        # otherwise seed=0, drawn on the CPU and copied (the same noise on every device)
        seed = None if suffix == "osnoise" else 0
        common = dict(noise_multiplier=noise, expected_batch_size=n, seed=seed, per_sample_mode=path,
                      loss_reduction="mean")  # fmt: skip
        opt = (
            FlatClip(sgd, model, max_grad_norm=clip, **common)
            if kind == "flat"
            else AdaClip(sgd, model, **common)
        )
        return Step(lambda: forward_loss(model_name, model, ids, y), opt), model
    if kind == "opacus":
        from opacus import PrivacyEngine
        from torch.utils.data import DataLoader, TensorDataset

        warnings.filterwarnings("ignore")
        engine = PrivacyEngine()
        loader = DataLoader(TensorDataset(ids, y), batch_size=n)
        common = dict(optimizer=sgd, data_loader=loader, noise_multiplier=noise, max_grad_norm=clip,
                      poisson_sampling=False, grad_sample_mode=path, loss_reduction="mean")  # fmt: skip
        if path == "hooks":
            gsm, opt, _ = engine.make_private(module=model, **common)
            return Step(lambda: forward_loss(model_name, gsm, ids, y, extra), opt), model
        gsm, opt, dp_criterion, _ = engine.make_private(
            module=model, criterion=nn.CrossEntropyLoss(), **common
        )

        def fwd():
            logits = gsm(input_ids=ids, **extra).logits
            if model_name == "gpt2":  # each sequence's token mean, as per_example_lm_loss
                logits, labels = logits[:, :-1], y[:, 1:]
                return dp_criterion(
                    logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), shape=labels.shape
                )
            return dp_criterion(logits, y)

        return Step(fwd, opt), model
    raise ValueError(method)


def short_error(exc: BaseException) -> str:
    msg = " ".join(str(exc).split())
    if len(msg) > 220:
        msg = msg[:217] + "..."
    return f"{type(exc).__name__}: {msg}"


# --------------------------------------------------------------------------- measurements


def time_cell(model_name, mode, n, methods, rounds, sizes, warmup=1):
    """Build every method, warm up, then ``rounds`` interleaved rounds. Returns the per-round
    wall-clock and CPU times (``time.process_time``) of the methods that ran, and the errors of
    those that did not."""
    steps, errors = {}, {}
    for m in methods:
        if mode != "full" and m in FULL_ONLY:
            continue
        step = None
        try:
            step, _ = build_step(model_name, mode, m, n, sizes)
            for _ in range(warmup):
                step()
            _sync()
            steps[m] = step
        except Exception as exc:  # report, keep going
            errors[m] = {"stage": step.stage if step else "build", "error": short_error(exc)}
            print(
                f"  [{model_name}/{mode} n={n}] {m} failed ({errors[m]['stage']}): {errors[m]['error']}",
                flush=True,
            )
    times: dict[str, list[float]] = {m: [] for m in steps}
    cpu: dict[str, list[float]] = {m: [] for m in steps}
    order = list(steps)
    for r in range(rounds):
        for m in order[r % len(order) :] + order[: r % len(order)] if order else []:
            if m in errors:
                continue
            _sync()
            c0, t0 = time.process_time(), time.perf_counter()
            try:
                steps[m]()
                _sync()
            except Exception as exc:
                errors[m] = {"stage": steps[m].stage, "error": short_error(exc)}
                continue
            times[m].append(time.perf_counter() - t0)
            cpu[m].append(time.process_time() - c0)
    return (
        {m: t for m, t in times.items() if m not in errors},
        {m: t for m, t in cpu.items() if m not in errors},
        errors,
    )


def memory_probe(model_name: str, mode: str, n: int, method: str, sizes: dict) -> None:
    """In a fresh process: print the peak memory growth (MiB) over two steps
    (:func:`_memory.peak_growth_mib`: ``VmHWM`` on CPU, CUDA's peak allocation on a GPU)."""
    step, _ = build_step(model_name, mode, method, n, sizes)
    print(json.dumps({"peak_mib": peak_growth_mib(step, DEVICE)}))


def memory_config(model_name, mode, n, method, sizes, threads) -> float | None:
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--memory-probe", model_name, mode, str(n), method,
         "--sizes", json.dumps(sizes), "--threads", str(threads), "--device", DEVICE.type],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    if proc.returncode != 0:
        print(
            f"  memory probe {model_name}/{mode} n={n} {method} failed: {proc.stderr.strip().splitlines()[-1:]}"
        )
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])["peak_mib"]


def check_equivalence(model_name: str, mode: str, n: int, methods: list[str], sizes: dict) -> dict:
    """σ = 0, lr = 1, one step: the relative difference of each method's update (Δθ over the
    trainable parameters) to our materialised flat clipping's, with C the median of the
    per-example gradient norms (computed one example at a time), so that about half the examples
    are clipped. Every library clips the same per-example gradients at C and divides by n, so
    the updates must agree (Opacus divides by ‖g_i‖ + 1e-6, a relative 1e-6 at most)."""
    model = build_model(model_name, mode, sizes)
    ids, y = make_batch(model_name, n, sizes)
    norms = []
    for i in range(n):
        model.zero_grad(set_to_none=True)
        forward_loss(model_name, model, ids[i : i + 1], y[i : i + 1]).backward()
        norms.append(torch.sqrt(sum((p.grad**2).sum() for p in trainable(model) if p.grad is not None)))
    clip = float(torch.stack(norms).median())
    updates: dict[str, torch.Tensor] = {}
    out: dict = {"clip": clip}
    for m in ["flat_materialise"] + [m for m in methods if m != "flat_materialise"]:
        if m.startswith("adaclip") or m == "nonprivate" or (mode != "full" and m in FULL_ONLY):
            continue  # another clipping rule / no clipping: not comparable
        try:
            step, model = build_step(model_name, mode, m, n, sizes, noise=0.0, lr=1.0, clip=clip)
            before = torch.cat([p.detach().flatten().clone() for p in trainable(model)])
            step()
            updates[m] = torch.cat([p.detach().flatten() for p in trainable(model)]) - before
        except Exception as exc:
            out[m] = short_error(exc)
    ref = updates.get("flat_materialise")
    for m, u in updates.items():
        if ref is not None:
            out[m] = float((u - ref).norm() / ref.norm().clamp_min(1e-30))
    return out


def profile_steps(model_name, mode, n, method, sizes, steps=3) -> None:
    """Where one method's step spends its time: torch.profiler, self CPU time, top ops."""
    from torch.profiler import profile

    warnings.filterwarnings("ignore")
    step, _ = build_step(model_name, mode, method, n, sizes)
    step()
    with profile() as prof:
        for _ in range(steps):
            step()
    print(f"{model_name}/{mode} n={n} {method}: {steps} steps")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    if DEVICE.type == "cuda":
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15))


# --------------------------------------------------------------------------- report


def ratio_cell(a: list[float], b: list[float]) -> str:
    """Median of per-round ratios a_r / b_r, with their range."""
    rs = [x / y for x, y in zip(a, b)]
    if not rs:
        return "-"
    med = statistics.median(rs)
    return f"{med:.2f}" if len(rs) == 1 else f"{med:.2f} ({min(rs):.2f}–{max(rs):.2f})"


def loadavg() -> str:
    try:
        return " ".join(open("/proc/loadavg").read().split()[:3])
    except OSError:
        return "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny models (1 layer, hidden 32, vocab 100, 16 tokens), "
                    "batch 4, 1 round, the equivalence check, no memory probes unless --memory")  # fmt: skip
    ap.add_argument("--models", default="gpt2,bert")
    ap.add_argument("--modes", default="lora,full")
    ap.add_argument("--batches", default=None, help="default 32,128 (quick: 4)")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument(
        "--rounds", type=int, default=None, help="interleaved rounds per cell (default 5; quick 1)"
    )
    ap.add_argument("--rounds-large", type=int, default=None,
                    help="rounds for cells with batch >= 128 (default: --rounds)")  # fmt: skip
    ap.add_argument("--memory", action="store_true", help="memory probes with --quick")
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument(
        "--memory-jobs", type=int, default=2, help="memory probes run in parallel after the timing"
    )
    ap.add_argument(
        "--check", action="store_true", help="the σ = 0 equivalence check (on by default with --quick)"
    )
    ap.add_argument("--json", default=None, help="write every per-round time, error and peak here")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where to run (default cpu)")
    ap.add_argument("--profile", nargs=4, metavar=("MODEL", "MODE", "BATCH", "METHOD"))
    ap.add_argument("--sizes", default=None, help=argparse.SUPPRESS)
    ap.add_argument(
        "--memory-probe", nargs=4, metavar=("MODEL", "MODE", "BATCH", "METHOD"), help=argparse.SUPPRESS
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    global DEVICE
    DEVICE = torch.device(args.device)
    sizes = json.loads(args.sizes) if args.sizes else dict(QUICK_SIZES if args.quick else FULL_SIZES)
    if args.memory_probe:
        mn, md, b, m = args.memory_probe
        memory_probe(mn, md, int(b), m, sizes)
        return
    if args.profile:
        mn, md, b, m = args.profile
        profile_steps(mn, md, int(b), m, sizes)
        return
    rounds = args.rounds or (1 if args.quick else 5)
    rounds_large = args.rounds_large or rounds
    batches = [int(b) for b in (args.batches or ("4" if args.quick else "32,128")).split(",")]
    models, modes, methods = args.models.split(","), args.modes.split(","), args.methods.split(",")
    do_memory = not args.no_memory and (args.memory or not args.quick)

    import opacus
    import peft
    import transformers

    versions = (
        f"python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}, "
        f"peft {peft.__version__}, opacus {opacus.__version__}, threads {torch.get_num_threads()}, "
        f"cpus {os.cpu_count()}, {platform.processor() or platform.machine()}"
    )
    if DEVICE.type == "cuda":
        versions += f", device {torch.cuda.get_device_name()}, CUDA {torch.version.cuda}"
    print(versions)
    print(f"sizes {sizes}; rounds {rounds} (batch >= 128: {rounds_large}); quick={args.quick}; load {loadavg()}\n",
          flush=True)  # fmt: skip
    record: dict = {"versions": versions, "sizes": sizes, "rounds": rounds, "rounds_large": rounds_large,
                    "argv": sys.argv[1:], "load_start": loadavg(), "cells": []}  # fmt: skip
    t_start = time.time()

    def save() -> None:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(record, f, indent=1)

    for model_name in models:
        for mode in modes:
            for n in batches:
                t0 = time.time()
                r = rounds_large if n >= 128 else rounds
                times, cpu, errors = time_cell(model_name, mode, n, methods, r, sizes)
                cell = {"model": model_name, "mode": mode, "batch": n, "rounds": r, "times_s": times,
                        "cpu_s": cpu, "errors": errors, "load": loadavg(), "wall_s": time.time() - t0}  # fmt: skip
                if (args.check or args.quick) and n == batches[0]:  # once per (model, mode)
                    cell["check_n"] = min(n, 8)
                    cell["check"] = check_equivalence(model_name, mode, cell["check_n"], methods, sizes)
                record["cells"].append(cell)
                print(f"[{model_name}/{mode} n={n}] {r} rounds, {cell['wall_s']:.0f} s, load {cell['load']}: "
                      + ", ".join(f"{m} {1e3 * statistics.median(t):.0f} ms (cpu {1e3 * statistics.median(cpu[m]):.0f})"
                                  for m, t in times.items()),
                      flush=True)  # fmt: skip
                save()
    record["timing_wall_s"] = time.time() - t_start
    if do_memory:
        jobs = [(c, m) for c in record["cells"] for m in methods if m not in c["errors"]]
        with ThreadPoolExecutor(max(1, args.memory_jobs)) as pool:
            peaks = list(pool.map(
                lambda cm: memory_config(cm[0]["model"], cm[0]["mode"], cm[0]["batch"], cm[1], sizes, args.threads),
                jobs))  # fmt: skip
        for (c, m), pk in zip(jobs, peaks):
            c.setdefault("peak_mib", {})[m] = pk
    record["wall_s"] = time.time() - t_start
    record["load_end"] = loadavg()
    save()
    print("\n" + report(record, methods, "cpu_s"))
    print("\n" + report(record, methods, "times_s", details=False))


def report(record: dict, methods: list[str], clock: str = "cpu_s", details: bool = True) -> str:
    """The tables. ``clock``: ``"cpu_s"`` (the process's CPU time per step: with one torch thread,
    the step's own compute, not the time other jobs on a shared machine took its core from it) or
    ``"times_s"`` (wall clock)."""
    bases = [b for b in BASELINES if b in methods]
    label = "CPU time" if clock == "cpu_s" else "wall-clock time"
    lines = [
        f"Step {label}:",
        "",
        "| model | mode | batch | method | step ms (median) | "
        + " | ".join(f"× {b}" for b in bases)
        + " | peak MiB | × peak "
        + " | × peak ".join(bases)
        + " |",
        "|" + "---|" * (6 + 2 * len(bases)),
    ]
    for c in record["cells"]:
        times, peaks = dict(c[clock]), dict(c.get("peak_mib", {}))
        if "opacus_ghost" not in times and "opacus_ghost+ids" in times:  # the workaround as the baseline
            times["opacus_ghost"] = times["opacus_ghost+ids"]
            if "opacus_ghost+ids" in peaks:
                peaks["opacus_ghost"] = peaks["opacus_ghost+ids"]
            c["baseline_note"] = "× opacus_ghost: of opacus_ghost+ids"
        for m in methods:
            if c["mode"] != "full" and m in FULL_ONLY:
                continue
            head = f"| {c['model']} | {c['mode']} | {c['batch']} | {m} |"
            if m not in c["times_s"]:
                lines.append(head + " fails |" + " |" * (1 + 2 * len(bases)))
                continue
            pk = peaks.get(m)
            cells = [ratio_cell(times[m], times[b]) if b in times else "-" for b in bases]
            pcells = [f"{pk / peaks[b]:.2f}" if pk is not None and peaks.get(b) else "-" for b in bases]
            lines.append(
                head + f" {1e3 * statistics.median(times[m]):.1f} | " + " | ".join(cells)
                + f" | {'-' if pk is None else f'{pk:.0f}'} | " + " | ".join(pcells) + " |"
            )  # fmt: skip
    if not details:
        return "\n".join(lines)
    lines += ["", "What works (✓ runs; otherwise the stage and the error):", "",
              "| model | mode | " + " | ".join(methods) + " |", "|---|---|" + "---|" * len(methods)]  # fmt: skip
    seen = {}
    for c in record["cells"]:
        key = (c["model"], c["mode"])
        row = seen.setdefault(key, {})
        for m in methods:
            if m in c["errors"]:
                row[m] = f"✗ {c['errors'][m]['stage']}"
            elif m in c["times_s"]:
                row.setdefault(m, "✓")
            elif c["mode"] != "full" and m in FULL_ONLY:
                row.setdefault(m, "n/a")
    for (mn, md), row in seen.items():
        lines.append(f"| {mn} | {md} | " + " | ".join(row.get(m, "-") for m in methods) + " |")
    errs = {}
    for c in record["cells"]:
        for m, e in c["errors"].items():
            errs.setdefault((c["model"], c["mode"], m, e["stage"], e["error"]), []).append(c["batch"])
    if errs:
        lines += ["", "Errors:", ""]
        for (mn, md, m, st, e), bs in errs.items():
            lines.append(f"- {mn}/{md} {m} (batch {', '.join(map(str, bs))}), {st}: `{e}`")
    checks = [c for c in record["cells"] if "check" in c]
    if checks:
        lines += [
            "",
            "Equivalence (σ = 0, lr = 1, one step): ‖Δθ − Δθ_flat_materialise‖ / ‖Δθ_flat_materialise‖:",
            "",
        ]
        for c in checks:
            lines.append(f"- {c['model']}/{c['mode']} (n = {c['check_n']}, C = {c['check']['clip']:.3g}): " + ", ".join(
                f"{m} {v:.1e}" if isinstance(v, float) else f"{m} fails"
                for m, v in c["check"].items() if m != "clip"))  # fmt: skip
    notes = [c for c in record["cells"] if c.get("baseline_note")]
    if notes:
        lines += [
            "",
            "In the cells "
            + ", ".join(f"{c['model']}/{c['mode']}/{c['batch']}" for c in notes)
            + ", the × opacus_ghost columns are against opacus_ghost+ids (opacus_ghost fails there).",
        ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
