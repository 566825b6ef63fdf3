"""The route of one private PyTorch optimizer step: which library files it enters, how often.

Definitions:

* A *room* is one source file of the library packages ``adaclip/`` and ``adaclip_torch/`` of this
  repository (not torch, not the standard library, not ``tests/``, not ``benchmarks/``).
* ``sys.setprofile`` (Python-level ``'call'`` and ``'return'`` events only; the ``c_*`` events
  are ignored) is set around exactly one ``optimizer.step()``, after a warm-up step, so lazy
  imports and caches filled by the first step do not count. The forward and backward of the
  traced step run before the traced region: only ``step()`` is traced.
* An *entry* is a ``'call'`` event whose callee's file is a room and whose caller's frame
  (``f_back``) is in a different file: a room, or outside (this script, torch calling back into
  the library). A *return* is a ``'return'`` event from a frame in a room whose caller's file is
  a different file. Calls and returns within one file do not count. A generator resumed from
  another file counts as an entry at each resumption, and each yield to it as a return. A
  function wrapped by a decorator defined elsewhere (``contextlib``'s ``ContextDecorator``,
  ``torch.no_grad()``) is called from the wrapper's frame, so it counts as an entry even when
  its caller is in its own file; so do the ``__enter__``/``__exit__`` of a library context
  manager used as such a decorator.

Reported per configuration: the rooms entered (distinct files), total entries, total returns,
the entries into ``adaclip_torch/optimizer.py`` and the returns into it (returns whose caller is
in it: how often control comes back to it from another room), and a per-room table sorted by
entries.

    python benchmarks/step_trace.py --configs flat,default --out benchmarks/results/step_trace.md
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import platform
import shlex
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from logging.handlers import BufferingHandler
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the library of this checkout, whatever is installed
    sys.path.insert(0, str(ROOT))

PACKAGES = ("adaclip", "adaclip_torch")
OPTIMIZER_ROOM = "adaclip_torch/optimizer.py"
BATCH, EXAMPLES = 16, 512


@dataclass
class Trace:
    """Entries and returns per room, counted by :meth:`profile` (a ``sys.setprofile`` function)."""

    entries: Counter[str] = field(default_factory=Counter)
    returns: Counter[str] = field(default_factory=Counter)
    returns_into: Counter[str] = field(default_factory=Counter)  # returns counted by the caller's room
    _rooms: dict[str, str | None] = field(default_factory=dict)

    def room(self, filename: str) -> str | None:
        """The room of ``filename`` (its path under the repository), or ``None`` outside the packages."""
        if filename not in self._rooms:
            try:
                rel = Path(filename).resolve().relative_to(ROOT)
            except ValueError:
                rel = None
            ok = rel is not None and len(rel.parts) > 1 and rel.parts[0] in PACKAGES and rel.suffix == ".py"
            self._rooms[filename] = rel.as_posix() if ok else None
        return self._rooms[filename]

    def profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if event not in ("call", "return"):
            return
        here = frame.f_code.co_filename
        room, back = self.room(here), frame.f_back
        if room is None or (back is not None and back.f_code.co_filename == here):
            return
        (self.entries if event == "call" else self.returns)[room] += 1
        if event == "return" and back is not None:
            self.returns_into[self.room(back.f_code.co_filename) or "outside"] += 1


def traced(fn: Callable[[], Any]) -> Trace:
    """Run ``fn()`` under the profiler and return what it counted."""
    trace = Trace()
    sys.setprofile(trace.profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return trace


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 4))


def _backward(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    nn.functional.cross_entropy(model(x), y).backward()


def trace_flat() -> tuple[Trace, str]:
    """``FlatClip`` over SGD on a fixed batch of 16 (no accountant, no sampler): warm up, trace a step."""
    from adaclip_torch import FlatClip

    model = _model()
    opt = FlatClip(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=1.0, max_grad_norm=1.0,
                   expected_batch_size=float(BATCH))  # fmt: skip
    x, y = torch.randn(BATCH, 20), torch.randint(0, 4, (BATCH,))
    _backward(model, x, y)
    opt.step()
    opt.zero_grad()
    _backward(model, x, y)
    return traced(opt.step), opt.summary()


def trace_default(averaging: str | None = None) -> tuple[Trace, str]:
    """``make_private`` with its defaults for a known run (ε = 3, δ = 1e-5, 5 epochs of 32 steps;
    ``seed=0`` for the sampler) and ``averaging``: its loader's first batch warms up, its second
    is traced."""
    from adaclip_torch import make_private

    model = _model()
    data = torch.utils.data.TensorDataset(torch.randn(EXAMPLES, 20), torch.randint(0, 4, (EXAMPLES,)))
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH)
    log, keep = logging.getLogger("adaclip_torch.make_private"), BufferingHandler(100)
    log.addHandler(keep)
    log.setLevel(logging.INFO)
    try:
        sgd = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt, loader = make_private(model, sgd, loader, target_epsilon=3.0, delta=1e-5, epochs=5, seed=0,
                                          averaging=averaging, progress=False)  # fmt: skip
    finally:
        log.removeHandler(keep)
    batches = iter(loader)
    _backward(model, *next(batches))
    opt.step()
    opt.zero_grad()
    _backward(model, *next(batches))
    call = (f"make_private(model, SGD(lr=0.1), loader(batch_size={BATCH}, N={EXAMPLES}), target_epsilon=3, "
            f"delta=1e-5, epochs=5, seed=0, averaging={averaging!r})")  # fmt: skip
    trace, logged = traced(opt.step), [f"{r.levelname}: {r.getMessage()}" for r in keep.buffer]
    return trace, "\n".join([call, *logged, opt.summary()])


CONFIGS: dict[str, Callable[[], tuple[Trace, str]]] = {
    "flat": trace_flat,
    "default": trace_default,
    "default_ema": lambda: trace_default("ema"),  # averaging is off by default (averaging=None)
}


def _commit() -> str:
    def git(*args: str) -> str:
        env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0"}  # read only: never refresh the shared index
        run = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True, env=env)
        return run.stdout.strip()

    try:
        dirty = git("status", "--porcelain", "--untracked-files=no", "--", *PACKAGES)
        return git("rev-parse", "--short", "HEAD") + (" (library files modified)" * bool(dirty))
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _summary_row(name: str, t: Trace) -> str:
    entries, returns = sum(t.entries.values()), sum(t.returns.values())
    optimizer = f"{t.entries[OPTIMIZER_ROOM]} | {t.returns_into[OPTIMIZER_ROOM]}"
    return f"| {name} | {len(t.entries)} | {entries} | {returns} | {optimizer} |"


def _room_table(t: Trace) -> list[str]:
    rooms = sorted(set(t.entries) | set(t.returns), key=lambda r: (-t.entries[r], r))
    return ["| room | entries | returns |", "|---|---:|---:|"] + [
        f"| `{r}` | {t.entries[r]} | {t.returns[r]} |" for r in rooms
    ]


def markdown(command: str, results: dict[str, tuple[Trace, str]]) -> str:
    """The report: header, summary table, then each configuration's build and per-room table."""
    lines = [
        "# Route of one private optimizer step (`sys.setprofile` trace)", "",
        f"Command: `{command}`", "",
        f"Date: {datetime.date.today().isoformat()}; Python {platform.python_version()}, torch {torch.__version__}; "
        f"commit {_commit()}", "",
        "A room is a source file of `adaclip/` or `adaclip_torch/`; an entry is a Python call into a room from another "
        "file, a return a return from a room to another file (definitions: the module docstring).", "",
        "| config | rooms | entries | returns | optimizer.py entries | returns into optimizer.py |",
        "|---|---:|---:|---:|---:|---:|",
    ]  # fmt: skip
    lines += [_summary_row(name, trace) for name, (trace, _) in results.items()]
    for name, (trace, built) in results.items():
        lines += ["", f"## {name}", "", "```text", built, "```", "", *_room_table(trace)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="flat,default", help=f"comma-separated, of {sorted(CONFIGS)}")
    parser.add_argument("--out", type=Path, default=None, help="write the markdown here (default: stdout)")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        parser.error(f"unknown configs {unknown}; known: {sorted(CONFIGS)}")
    command = shlex.join(["python", "benchmarks/step_trace.py", *(sys.argv[1:] if argv is None else argv)])
    text = markdown(command, {name: CONFIGS[name]() for name in names})
    if args.out is None:
        sys.stdout.write(text)
    else:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
