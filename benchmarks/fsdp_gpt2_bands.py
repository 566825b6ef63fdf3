"""FSDP2 + private optimizer on a GPT-2-small-sized model over R CPU processes: banded noise with
its state sharded over the ranks against independent noise (DP-SGD), per-rank memory and step time.

The model is ``transformers.GPT2LMHeadModel(GPT2Config())`` (the defaults: 12 layers, hidden 768,
12 heads, vocab 50,257, 1,024 positions, dropout 0.1; 124.4 M parameters, the LM head tied to the
token embedding), random init, float32, sharded with FSDP2 (``fully_shard`` on each transformer
block, then on the root) on a CPU device mesh over R processes (gloo, ``torch.multiprocessing``
spawn, one torch thread each). The optimizer is ``FlatClip(torch.optim.SGD(...), distributed=True,
per_sample_mode="ghost")`` (σ = 1, C = 1, ``loss_reduction="sum"``, ``seed=0``, ``expected_batch_size``
the global ``R·batch``), with, in one spawn of R processes each:

``independent``  ``noise_mechanism="independent"`` (the default: DP-SGD; rank 0 draws the noise of
                 every coordinate, no buffers);
``banded``       ``noise_mechanism="banded", bands=b`` with the default ``noise_sharding="auto"``
                 (sharded: rank r draws and correlates the noise of its slice of ⌈d/R⌉ coordinates
                 and holds its ``b − 1`` buffers, ``(b − 1)·d/R`` numbers);
``banded-rank0`` (only with ``--configs``) the same with ``noise_sharding="rank0"``: rank 0 holds all
                 ``(b − 1)·d`` buffer numbers, as before the state was sharded.

Data: each rank steps on one fixed synthetic batch of ``--batch`` random token sequences of
``--seq`` tokens (the same batch every step; fixed shapes, so the timing is not Poisson noise).
Banded noise needs a ``CyclicPoissonBatchSampler(N_r = 64·batch, q = 1/64, bands=b)`` per rank: its
draws are consumed one per step (the optimizer checks that step t releases draw t) but their
indices are not used. This is a systems benchmark: nothing is learnt.

Per configuration and rank: ``b − 1`` warm-up steps for banded noise (so that the timed steps run
with the full ``b − 1`` buffers; one for independent noise), then ``--steps`` timed steps, each
after a barrier; a step is forward + ``per_example_lm_loss`` + ``backward()`` + ``opt.step()`` +
``opt.zero_grad()``, timed on the rank's wall clock (the forward/backward and the optimizer step
separately too). Memory is the process's resident set: ``VmHWM`` from ``/proc/self/status``, reset
to the current resident set (``echo 5 > /proc/self/clear_refs``, as ``benchmarks/_memory.py``)
just before the timed steps, so the peak is that of the steady-state steps, and the resident set
before them; torch allocates CPU tensors with malloc, so the resident set sees every temporary.
The noise-buffer bytes are those of the tensors the optimizer's noise stream holds
(``opt._stream._state.history``) after the timed steps.

    # the recorded run (benchmarks/results/fsdp_gpt2_bands.{md,json}); ~5-10 min on 2 CPU cores
    python benchmarks/fsdp_gpt2_bands.py --ranks 4 --bands 8 --steps 3 --seq 32 --batch 2
    python benchmarks/fsdp_gpt2_bands.py --quick --ranks 2 --out /tmp/fsdp_quick   # tiny model, < 60 s

``--out STEM`` writes ``STEM.md`` and ``STEM.json`` (default ``benchmarks/results/fsdp_gpt2_bands``;
``--quick`` writes only with ``--out``).
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import gc
import importlib
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

MIB = 2**20
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "fsdp_gpt2_bands"
CONFIGS = ("independent", "banded", "banded-rank0")
#: the sampler's data per rank, in batches: q = 1/SAMPLES_PER_BATCH (b·q <= 1 up to b = 64)
SAMPLES_PER_BATCH = 64


# ---------------------------------------------------------------------------------------------
# the machine


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _reset_peak() -> None:
    """``VmHWM`` := the current resident set (see ``benchmarks/_memory.py``)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    ram = None
    try:
        with open("/proc/meminfo") as f:
            ram = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    except (OSError, StopIteration):
        pass
    import torch
    import transformers

    return {"host": platform.node(), "cpu": cpu, "cores": os.cpu_count(), "ram_bytes": ram,
            "python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__}  # fmt: skip


# ---------------------------------------------------------------------------------------------
# one rank of one configuration


def _model_config(quick: bool, seq: int) -> Any:
    import transformers as T

    if quick:  # tiny: 2 layers, hidden 64, vocab 1,000
        return T.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=1000, n_positions=max(64, seq))
    return T.GPT2Config()  # GPT-2 small's defaults (124 M parameters)


def run_rank(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Build the sharded model and the private optimizer of ``spec["config"]`` and step it."""
    import torch
    import torch.distributed as dist
    import transformers as T
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from adaclip_torch import FlatClip
    from adaclip_torch.data import CyclicPoissonBatchSampler
    from adaclip_torch.losses import per_example_lm_loss

    config, bands, batch, seq = spec["config"], spec["bands"], spec["batch"], spec["seq"]
    out: dict[str, Any] = {"rank": rank, "rss_start_mib": _status_kib("VmRSS") / 1024}
    torch.manual_seed(0)  # the same initial parameters on every rank
    cfg = _model_config(spec["quick"], seq)
    model = T.GPT2LMHeadModel(cfg)
    model.train()
    out["num_parameters"] = sum(p.numel() for p in model.parameters())
    mesh = init_device_mesh("cpu", (world,))  # the CPU mesh: gloo, the batches stay on the CPU
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    gc.collect()
    out["param_shard_bytes"] = sum(p.to_local().numel() * p.element_size() for p in model.parameters())

    sgd = torch.optim.SGD(model.parameters(), lr=1e-4)  # stateless (see tests/test_torch_fsdp.py)
    q = 1.0 / SAMPLES_PER_BATCH
    common: dict[str, Any] = dict(max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=float(world * batch),
                                  loss_reduction="sum", per_sample_mode=spec["mode"], seed=0, distributed=True,
                                  sample_rate=q)  # fmt: skip
    sampler = None
    if config.startswith("banded"):
        sampler = CyclicPoissonBatchSampler(SAMPLES_PER_BATCH * batch, q, bands,
                                            generator=torch.Generator().manual_seed(1 + rank))  # fmt: skip
        common.update(noise_mechanism="banded", bands=bands, sampler=sampler,
                      noise_sharding="rank0" if config == "banded-rank0" else "auto")  # fmt: skip
    opt = FlatClip(sgd, model, **common)
    assert opt.fsdp, "the parameters should be FSDP2-sharded DTensors"
    out["noise_sharding"] = getattr(opt, "noise_sharding", None)
    out["per_sample_mode"] = opt.per_sample_mode
    out["d"] = sum(p.numel() for p in opt.params)
    stream = getattr(opt, "_stream", None)
    out["noise_shard"] = None if stream is None or stream.shard is None else list(stream.shard)
    draws = iter(sampler) if sampler is not None else None
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(100 + rank))

    def cpu() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)  # every thread of the process, gloo's too
        return r.ru_utime + r.ru_stime

    def step() -> tuple[float, float, float, float]:
        """Wall and CPU seconds of the forward/backward and of the optimizer step."""
        if draws is not None:
            next(draws)  # the draw this step releases (its indices are not used: fixed batch)
        t0, c0 = time.perf_counter(), cpu()
        loss = per_example_lm_loss(model(input_ids=ids).logits, ids)
        loss.backward()
        t1, c1 = time.perf_counter(), cpu()
        opt.step()
        opt.zero_grad()
        return t1 - t0, time.perf_counter() - t1, c1 - c0, cpu() - c1

    gc.collect()
    out["rss_built_mib"] = _status_kib("VmRSS") / 1024
    warmup = (
        spec["warmup"]
        if spec["warmup"] is not None
        else (max(1, bands - 1) if config.startswith("banded") else 1)
    )
    out["warmup_steps"] = warmup
    t0 = time.perf_counter()
    for i in range(warmup):
        step()
        if i == 0:
            out["first_step_s"] = time.perf_counter() - t0
    out["warmup_s"] = time.perf_counter() - t0
    gc.collect()
    out["peak_before_timed_mib"] = _status_kib("VmHWM") / 1024  # since the process started
    dist.barrier()
    _reset_peak()
    out["rss_before_timed_mib"] = _status_kib("VmRSS") / 1024
    times, fb, st, user, system, faults, cfb, cst = [], [], [], [], [], [], [], []
    for _ in range(spec["steps"]):
        dist.barrier()
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        a, b, ca, cb = step()
        times.append(time.perf_counter() - t0)
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        fb.append(a)
        st.append(b)
        user.append(r1.ru_utime - r0.ru_utime)
        system.append(r1.ru_stime - r0.ru_stime)
        faults.append(r1.ru_minflt - r0.ru_minflt)
        cfb.append(ca)
        cst.append(cb)
    out["peak_timed_mib"] = _status_kib("VmHWM") / 1024
    out["rss_after_timed_mib"] = _status_kib("VmRSS") / 1024
    out["step_times_s"] = times
    out["step_s"] = statistics.median(times)
    out["fwd_bwd_s"] = statistics.median(fb)
    out["opt_step_s"] = statistics.median(st)
    # the process's CPU time in a step (all its threads): the work, apart from waiting for the other
    # ranks or for a core (4 processes on 2 cores); and the minor page faults (fresh pages touched)
    out["cpu_user_s"] = statistics.median(user)
    out["cpu_sys_s"] = statistics.median(system)
    out["minor_faults"] = statistics.median(faults)
    out["cpu_fwd_bwd_s"] = statistics.median(cfb)
    out["cpu_opt_step_s"] = statistics.median(cst)
    history = [] if stream is None else stream._state.history
    out["noise_buffers"] = len(history)
    out["noise_buffer_bytes"] = sum(t.numel() * t.element_size() for x in history for t in x)
    out["noise_buffer_dtype"] = str(history[0][0].dtype) if history else None
    out["steps_taken"] = opt.steps
    return out


def _worker(rank: int, world: int, init_file: str, spec: dict[str, Any], out_dir: str) -> None:
    """One rank: the gloo group set up and torn down as tests/_gloo.py does."""
    faulthandler.enable(all_threads=True)
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    # before init_process_group: else torch.distributed.nn.functional, imported by the first
    # torch.optim optimizer, keeps the group alive past destroy_process_group (tests/_gloo.py)
    importlib.import_module("torch._dynamo")
    import transformers

    transformers.logging.set_verbosity_error()
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        result = run_rank(rank, world, spec)
    finally:
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache

        _clear_sharding_prop_cache()  # DTensor's caches keep the mesh, hence the group
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


def run_config(spec: dict[str, Any], world: int) -> dict[str, Any]:
    """Spawn ``world`` fresh processes for one configuration; their per-rank results."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="fsdp_gpt2_bands_") as tmp:
        t0 = time.perf_counter()
        mp.spawn(_worker, args=(world, str(Path(tmp, "init")), spec, tmp), nprocs=world, join=True)
        wall = time.perf_counter() - t0
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]
    return {"config": spec["config"], "spec": spec, "wall_s": wall, "ranks": ranks}


# ---------------------------------------------------------------------------------------------
# the report


def expected_buffer_bytes(d: int, world: int, rank: int, bands: int, steps: int, itemsize: int = 4) -> int:
    """``min(steps, b − 1)`` buffers of rank ``rank``'s slice of ``d`` coordinates (⌈d/R⌉, the last
    ones shorter: :func:`adaclip_torch.distributed.noise_shard`), in bytes: ``(b − 1)·⌈d/R⌉·4`` once
    ``b − 1`` steps have run."""
    per = -(-d // world)
    start = min(rank * per, d)
    return min(steps, bands - 1) * (min(start + per, d) - start) * itemsize


def table(results: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| config | rank | noise sharding | noise buffers (MiB) | param shard (MiB) | RSS before timed steps (MiB) "
        "| peak RSS, timed steps (MiB) | peak − RSS before (MiB) | step (s, median) | fwd+bwd (s) | opt.step (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for res in results:
        for r in res["ranks"]:
            lines.append(
                f"| {res['config']} | {r['rank']} | {r['noise_sharding']} | {r['noise_buffer_bytes'] / MIB:.1f} | "
                f"{r['param_shard_bytes'] / MIB:.1f} | {r['rss_before_timed_mib']:.0f} | {r['peak_timed_mib']:.0f} | "
                f"{r['peak_timed_mib'] - r['rss_before_timed_mib']:.0f} | {r['step_s']:.2f} | {r['fwd_bwd_s']:.2f} | "
                f"{r['opt_step_s']:.2f} |"
            )
    return lines


def process_table(results: list[dict[str, Any]]) -> list[str]:
    """The resident set through each rank's life: where the memory goes besides the step."""
    lines = [
        "| config | rank | RSS at start (MiB) | after build + shard (MiB) | peak through build and warm-up (MiB) "
        "| before timed steps (MiB) | peak, timed steps (MiB) | after timed steps (MiB) | first step (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for res in results:
        for r in res["ranks"]:
            lines.append(
                f"| {res['config']} | {r['rank']} | {r['rss_start_mib']:.0f} | {r['rss_built_mib']:.0f} | "
                f"{r['peak_before_timed_mib']:.0f} | {r['rss_before_timed_mib']:.0f} | {r['peak_timed_mib']:.0f} | "
                f"{r['rss_after_timed_mib']:.0f} | {r['first_step_s']:.1f} |"
            )
    return lines


def cpu_table(results: list[dict[str, Any]]) -> list[str]:
    """CPU time and page faults of a timed step (medians), per rank."""
    lines = [
        "| config | rank | wall (s) | CPU user (s) | CPU system (s) | CPU fwd+bwd (s) | CPU opt.step (s) "
        "| minor page faults (M) | faulted (GiB, 4 KiB pages) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for res in results:
        for r in res["ranks"]:
            lines.append(
                f"| {res['config']} | {r['rank']} | {r['step_s']:.2f} | {r['cpu_user_s']:.2f} | {r['cpu_sys_s']:.2f} | "
                f"{r['cpu_fwd_bwd_s']:.2f} | {r['cpu_opt_step_s']:.2f} | "
                f"{r['minor_faults'] / 1e6:.2f} | {r['minor_faults'] * 4096 / 2**30:.1f} |"
            )
    return lines


def comparison(results: list[dict[str, Any]]) -> list[str]:
    """Each non-baseline configuration against independent noise, rank by rank."""
    by = {res["config"]: res for res in results}
    base = by.get("independent")
    if base is None:
        return []
    lines = [
        "| config | rank | noise buffers (MiB) | Δ RSS before timed steps (MiB) | Δ peak RSS (MiB) | step / independent |",
        "|---|---|---|---|---|---|",
    ]
    for res in results:
        if res is base:
            continue
        for r, b0 in zip(res["ranks"], base["ranks"], strict=True):
            lines.append(
                f"| {res['config']} | {r['rank']} | {r['noise_buffer_bytes'] / MIB:.1f} | "
                f"{r['rss_before_timed_mib'] - b0['rss_before_timed_mib']:+.0f} | "
                f"{r['peak_timed_mib'] - b0['peak_timed_mib']:+.0f} | {r['step_s'] / b0['step_s']:.2f} |"
            )
    return lines


def _load(avg: Any) -> str:
    return "/".join(f"{x:.1f}" for x in avg)


def markdown(report: dict[str, Any]) -> str:
    a, m, res = report["args"], report["machine"], report["results"]
    r0 = res[0]["ranks"][0]
    d, n = r0["d"], r0["num_parameters"]
    ram = f"{m['ram_bytes'] / 2**30:.1f} GiB" if m["ram_bytes"] else "?"
    model = ("tiny GPT-2 (`--quick`: 2 layers, hidden 64, 2 heads, vocab 1,000)" if a["quick"]
             else "GPT-2 small (`GPT2Config()` defaults: 12 layers, hidden 768, 12 heads, vocab 50,257, dropout 0.1)")  # fmt: skip
    world, bands = a["ranks"], a["bands"]
    lines = [
        f"# FSDP2 over {world} CPU processes: sharded banded noise (b = {bands}) vs independent noise, "
        f"{'tiny model' if a['quick'] else 'GPT-2 small (124M)'}",
        "",
        f"    {report['command']}",
        "",
        f"**Machine.** {m['cores']} CPU cores ({m['cpu']}), {ram} of memory, no GPU; Python {m['python']}, "
        f"torch {m['torch']}, transformers {m['transformers']}; {report['date']}. Total wall time "
        f"{report['wall_s']:.0f} s; load average (1, 5, 15 min) {_load(report['loadavg_start'])} at the start "
        f"and {_load(report['loadavg_end'])} at the end (other jobs on the machine skew the wall times).",
        "",
        f"**Model and step.** {model}, random init, float32: {n:,} parameters, d = {d:,} privatised "
        f"coordinates ({4 * d / MIB:.1f} MiB in float32). FSDP2: `fully_shard` on each of the "
        f"{'2' if a['quick'] else '12'} transformer blocks, then on the root, CPU mesh of {world} ranks (gloo, "
        "one torch thread per process, `torch.multiprocessing` spawn, one fresh set of processes per "
        f"configuration). Each rank steps on a fixed synthetic batch of {a['batch']} random sequences of "
        f"{a['seq']} tokens (global batch {world * a['batch']}); `per_example_lm_loss` summed, "
        f"`FlatClip(torch.optim.SGD(lr=1e-4), per_sample_mode={a['mode']!r}, max_grad_norm=1, "
        f"noise_multiplier=1, expected_batch_size={float(world * a['batch'])}, loss_reduction='sum', seed=0, "
        "distributed=True)`. *independent*: `noise_mechanism='independent'` (DP-SGD; rank 0 draws all the "
        f"noise). *banded*: `noise_mechanism='banded', bands={bands}` with the default "
        f"`noise_sharding='auto'` (sharded: each rank holds `(b − 1)·⌈d/R⌉` buffer numbers), and a "
        f"`CyclicPoissonBatchSampler(N_r={SAMPLES_PER_BATCH * a['batch']}, q=1/{SAMPLES_PER_BATCH}, "
        f"bands={bands})` per rank whose draws are consumed one per step (their indices unused). "
        "*banded-rank0*, where run: the same with `noise_sharding='rank0'`.",
        "",
        f"**Method.** Warm-up steps first: b − 1 = {bands - 1} for banded noise (the timed steps then "
        "run with all b − 1 buffers), 1 for independent noise; then "
        f"{a['steps']} timed steps, each after a barrier; the step time is the median on the rank's wall "
        "clock. Memory: the resident set (`/proc/self/status`); `VmHWM` reset to the current resident "
        "set (`/proc/self/clear_refs` ← 5) after the warm-up, so *peak RSS* is the high-water mark of the "
        "timed steps, absolute (it includes the interpreter, torch, transformers and the model's "
        "shards). *Noise buffers*: the bytes of the tensors the optimizer's noise stream holds after the "
        "timed steps.",
        "",
        "## Per rank",
        "",
        *table(res),
        "",
        "## The resident set through each rank's run",
        "",
        "*At start*: the spawned process with torch, transformers and adaclip imported; *after build + "
        "shard*: the full model built on every rank (same seed), then `fully_shard` (what malloc "
        "kept of the freed full parameters stays resident); the first step is a warm-up step.",
        "",
        *process_table(res),
        "",
        "## CPU time of a timed step",
        "",
        "`getrusage(RUSAGE_SELF)` around each timed step, medians: user and system CPU time of the rank's "
        "process and its minor page faults (each a fresh 4 KiB page touched, so × 4 KiB is the memory "
        "newly mapped in the step).",
        "",
        *cpu_table(res),
        "",
        "## Against independent noise (same rank)",
        "",
        *comparison(res),
        "",
    ]
    checks = report.get("checks", [])
    if checks:
        lines += ["## Buffer sizes against min(steps, b − 1)·(the rank's slice of d)·4 bytes", "",
                  *[f"- {c}" for c in checks], ""]  # fmt: skip
    return "\n".join(lines)


def buffer_checks(results: list[dict[str, Any]], world: int, bands: int) -> list[str]:
    out = []
    for res in results:
        for r in res["ranks"]:
            if res["config"] == "banded":
                want = expected_buffer_bytes(r["d"], world, r["rank"], bands, r["steps_taken"])
            elif res["config"] == "banded-rank0":
                want = min(r["steps_taken"], bands - 1) * r["d"] * 4 if r["rank"] == 0 else 0
            else:
                want = 0
            ok = "ok" if r["noise_buffer_bytes"] == want else "MISMATCH"
            out.append(f"{res['config']}, rank {r['rank']}: {r['noise_buffer_bytes']:,} bytes, "
                       f"expected {want:,}: {ok}")  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4, help="processes (FSDP2 ranks)")
    parser.add_argument("--bands", type=int, default=8, help="b of banded noise")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per configuration")
    parser.add_argument(
        "--warmup", type=int, default=None, help="warm-up steps (default: b − 1 banded, 1 independent)"
    )
    parser.add_argument("--seq", type=int, default=32, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank per step")
    parser.add_argument(
        "--mode", default="ghost", choices=("ghost", "auto", "materialise"), help="per_sample_mode"
    )
    parser.add_argument(
        "--configs", default="independent,banded", help=f"comma-separated, of {', '.join(CONFIGS)}"
    )
    parser.add_argument(
        "--quick", action="store_true", help="tiny GPT2Config (2 layers, hidden 64): a smoke run"
    )
    parser.add_argument("--out", type=Path, default=None,
                        help="write OUT.md and OUT.json (default benchmarks/results/fsdp_gpt2_bands; --quick: only "
                             "when given)")  # fmt: skip
    args = parser.parse_args(argv)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        parser.error(f"unknown config(s) {unknown}; choose from {CONFIGS}")
    if args.bands < 2 and any(c.startswith("banded") for c in configs):
        parser.error("--bands must be at least 2 for the banded configurations")
    if args.warmup is not None and args.warmup < 1:
        parser.error("--warmup must be at least 1 (the first step is not timed)")
    out = args.out if args.out is not None else (None if args.quick else DEFAULT_OUT)

    load_start = os.getloadavg()  # other jobs on the machine skew the wall times (not the memory)
    t0 = time.perf_counter()
    results = []
    for config in configs:
        spec = {"config": config, "bands": args.bands, "batch": args.batch, "seq": args.seq, "steps": args.steps,
                "warmup": args.warmup, "mode": args.mode, "quick": args.quick}  # fmt: skip
        res = run_config(spec, args.ranks)
        print(f"{config}: {res['wall_s']:.0f} s", file=sys.stderr, flush=True)
        results.append(res)
    wall = time.perf_counter() - t0
    report = {
        "command": "python benchmarks/fsdp_gpt2_bands.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "wall_s": wall,
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(),
        "results": results,
    }
    report["checks"] = buffer_checks(results, args.ranks, args.bands)
    text = markdown(report)
    print(text)
    if out is not None:
        md, js = Path(f"{out}.md"), Path(f"{out}.json")
        md.parent.mkdir(parents=True, exist_ok=True)
        md.write_text(text)
        js.write_text(json.dumps(report, indent=1))
        print(f"wrote {md} and {js}", file=sys.stderr)
    return 0 if all(c.endswith(": ok") for c in report["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
