"""Peak memory of two training steps, the probe both speed benchmarks run in a fresh process.

On CPU the peak is ``VmHWM`` from ``/proc/self/status``, reset to the current resident set just
before the steps (``echo 5 > /proc/self/clear_refs``): torch allocates tensors with malloc, so the
resident set sees every temporary. ``getrusage``'s ``ru_maxrss`` is not used: it survives
``fork``/``exec``, so a child would start at its parent's high-water mark. On CUDA it is the growth
of ``torch.cuda.max_memory_allocated`` over the steps (the peak statistics reset just before).
"""

from __future__ import annotations

import gc
from collections.abc import Callable

import torch


def status_kib(field: str) -> int:
    """One field of ``/proc/self/status`` in KiB (``VmRSS``, ``VmHWM``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def peak_growth_mib(step: Callable[[], None], device: torch.device) -> float:
    """The peak memory growth (MiB) over two calls of ``step`` on ``device``."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        step()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - before) / 2**20
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status_kib("VmRSS")
    step()
    step()
    return (status_kib("VmHWM") - before) / 1024.0
