"""Two or more CPU processes on gloo for the data-parallel tests: the group's setup and teardown.

:func:`gloo_group` is the body of every worker: one torch thread, ``torch._dynamo`` imported
*before* ``init_process_group`` (see below), the group torn down afterwards, and a check that
``destroy_process_group()`` really freed it. :func:`spawn_ranks` starts the workers and loads
what each saved as ``rank{r}.pt``.

Why the import order matters: the first ``torch.optim`` optimizer built in a process imports
``torch._dynamo``, which imports ``torch.distributed.nn.functional``, whose collectives take
``group=group.WORLD`` as a default argument, evaluated at import. Imported after
``init_process_group``, ten functions hold the process group for good; ``destroy_process_group()``
then frees nothing, the gloo worker threads run on into interpreter shutdown, and one that drops
the last reference to a collective's input tensor (a Python object, so it needs the GIL) is
ended by Python's ``take_gil`` with ``pthread_exit``, whose unwinding through a noexcept
destructor calls ``std::terminate``: SIGABRT, "terminate called without an active exception".
It needs that thread to be late (a loaded machine), hence only inside the full suite.
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import importlib
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


@contextlib.contextmanager
def gloo_group(rank: int, world: int, init_file: str, *, dtensor: bool = False) -> Iterator[None]:
    """Join the gloo group as ``rank`` of ``world`` for the ``with`` block, then leave it.

    ``dtensor=True`` (FSDP2): DTensor's sharding-propagation caches keep the device mesh, which
    keeps the process group; they are cleared before the group is destroyed."""
    faulthandler.enable(all_threads=True)  # a fatal signal in a worker prints every thread's stack
    torch.set_num_threads(1)
    importlib.import_module("torch._dynamo")  # before init_process_group: see the module docstring
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    group = weakref.ref(dist.group.WORLD)
    try:
        yield
    finally:
        if dtensor:
            from torch.distributed.tensor.debug import _clear_sharding_prop_cache

            _clear_sharding_prop_cache()
        dist.destroy_process_group()
    gc.collect()
    if group() is not None:
        raise RuntimeError(
            "the gloo process group is still referenced after destroy_process_group(): its threads "
            "would run into interpreter shutdown and may abort this worker (see tests/_gloo.py)"
        )


def spawn_ranks(worker: Callable[..., None], out: Path, world: int, *extra: Any) -> list[Any]:
    """Run ``worker(rank, *extra, init_file, out_dir)`` in ``world`` processes; each saves
    ``out_dir/rank{r}.pt``, returned in rank order."""
    mp.spawn(worker, args=(*extra, str(out / "init"), str(out)), nprocs=world, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]
