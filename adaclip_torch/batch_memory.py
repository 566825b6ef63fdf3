"""``BatchMemoryManager``: Opacus's physical-batch loop over :meth:`DPOptimizer.accumulate`.

A Poisson logical batch can be much larger than what fits in memory (its size is random, with
mean ``B̄ = q·N``). The manager splits each logical batch drawn by the loader into *physical*
batches of at most ``max_physical_batch_size`` units and drives the optimizer so that the loop
is Opacus's, unchanged:

.. code-block:: python

    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=64, optimizer=optimizer) as physical:
        for x, y in physical:
            optimizer.zero_grad()
            criterion(model(x), y).backward()
            optimizer.step()

On every physical batch but the last of its logical batch, ``optimizer.step()`` is
:meth:`~adaclip_torch.optimizer.DPOptimizer.accumulate`: the batch's units are clipped and added
to a pending sum, nothing is released, the wrapped optimizer does not step, the step counter and
the accountant do not move. ``optimizer.zero_grad()`` keeps that pending sum. On the last
physical batch ``step()`` adds it and releases the whole logical batch with one noise draw,
divided by the logical ``B̄``, and the accountant records one step at the logical rate ``q``:
ε is exactly that of training without the manager.

The privacy of the split: how many physical batches a logical batch has depends on its
(secret) size, but nothing computed from a physical batch leaves the optimizer — only the one
release per logical batch does, so the number of steps, the releases and the accounting are
those of the logical batches. A *unit* is never split: with
:class:`~adaclip_torch.data.PoissonUserBatchSampler` (user-level privacy) the split is at user
boundaries (a user with more than ``max_physical_batch_size`` examples is a physical batch of
its own), and the optimizer refuses a user id met in two physical batches of one logical batch
whatever the loader. An empty logical batch (Poisson batches can be empty) is one empty
physical batch, which releases.

A logical batch left unreleased — the loop broke out of it, an exception, or ``step()`` was not
called on its last physical batch — is dropped, never released with the next one (its units
would be counted twice in one release): at the start of the next logical batch, and when the
``with`` block exits, the pending sum is discarded (a ``UserWarning`` says so unless an
exception is propagating).

Which logical batches reached the loop: over one of :mod:`adaclip_torch.data`'s samplers the
manager counts a logical batch as handed to the loop when its first physical batch is
(:class:`~adaclip_torch.data.DrawCounter`, as :class:`~adaclip_torch.data.CountingDataLoader`
does, workers or not), so an optimizer that holds the sampler (``make_private``'s) checks each
release against the logical batches exactly: a logical batch dropped unreleased is a skipped
batch, and the next release is refused. With :class:`~adaclip_torch.data.PoissonUserBatchSampler`
the run is user level: the optimizer refuses a step or accumulation without ``user_ids=``.
"""

from __future__ import annotations

import collections
import math
import numbers
import warnings
from collections.abc import Iterator
from types import TracebackType
from typing import Any

import torch
from torch.utils.data import DataLoader, Sampler

from adaclip.errors import InvalidGradientError, InvalidHyperparameterError
from adaclip_torch.data import PoissonUserBatchSampler, _CountedPass, draw_counter
from adaclip_torch.optimizer import DPOptimizer

__all__ = ["BatchMemoryManager", "PhysicalBatchLoader"]

# DataLoader settings the physical loader copies from the logical one (when set there)
_LOADER_SETTINGS = (
    "num_workers",
    "pin_memory",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "generator",
    "prefetch_factor",
    "persistent_workers",
    "pin_memory_device",
)


class _Driving:
    """What the manager tells the optimizer about the physical batch in hand (the optimizer
    reads ``releases`` in ``step()``)."""

    def __init__(self, *, user_level: bool = False) -> None:
        self.releases = True  # outside a logical batch (before the loop, after it) step() releases
        self.user_level = user_level  # the logical sampler samples users: every step needs user_ids
        self.steps_at_start: int | None = None  # optimizer.steps when the current logical batch began
        self.logical_batches = 0
        self.dropped = 0  # logical batches dropped unreleased when a loop was left early


def _split_even(indices: list[int], max_size: int) -> list[list[int]]:
    """``indices`` in ``ceil(n/max_size)`` consecutive chunks whose sizes differ by at most one
    (one empty chunk for an empty list)."""
    n = len(indices)
    if n == 0:
        return [[]]
    k = -(-n // max_size)
    base, extra = divmod(n, k)
    out, start = [], 0
    for j in range(k):
        size = base + (1 if j < extra else 0)
        out.append(indices[start : start + size])
        start += size
    return out


def _split_by_user(indices: list[int], example_users: torch.Tensor, max_size: int) -> list[list[int]]:
    """``indices`` in chunks of whole users (each user's examples in one chunk), packed greedily
    in order up to ``max_size`` examples; a user with more examples is a chunk of its own."""
    if not indices:
        return [[]]
    groups: dict[int, list[int]] = {}
    users = example_users[torch.as_tensor(indices, dtype=torch.long)].tolist()
    for i, u in zip(indices, users, strict=True):
        groups.setdefault(u, []).append(i)
    out: list[list[int]] = []
    current: list[int] = []
    for examples in groups.values():
        if current and len(current) + len(examples) > max_size:
            out.append(current)
            current = []
        current = current + examples
    out.append(current)
    return out


class _SplittingBatchSampler(Sampler[list[int]]):
    """Each logical batch of ``sampler`` as physical batches; records for each physical batch,
    in order, whether it starts and whether it ends its logical batch (read by the loader in the
    same order: a DataLoader yields batches in its sampler's order, also with workers)."""

    def __init__(self, sampler: Any, max_size: int, plan: collections.deque[tuple[bool, bool]]) -> None:
        self.sampler = sampler
        self.max_size = max_size
        self.plan = plan
        self._users = sampler.example_users if isinstance(sampler, PoissonUserBatchSampler) else None

    def __iter__(self) -> Iterator[list[int]]:
        for logical in self.sampler:
            indices = [int(i) for i in logical]
            if self._users is None:
                chunks = _split_even(indices, self.max_size)
            else:
                chunks = _split_by_user(indices, self._users, self.max_size)
            for j, chunk in enumerate(chunks):
                self.plan.append((j == 0, j == len(chunks) - 1))
                yield chunk

    def __len__(self) -> int:
        return len(self.sampler)  # logical batches; PhysicalBatchLoader.__len__ estimates physical ones


class PhysicalBatchLoader:
    """The loader :class:`BatchMemoryManager` yields: iterate it like the logical loader; each
    item is one physical batch (collated as the logical loader collates). Other attributes
    (``dataset``, ``collate_fn``, ...) are the logical loader's."""

    def __init__(self, manager: BatchMemoryManager) -> None:
        self._manager = manager
        logical = manager.data_loader
        self._plan: collections.deque[tuple[bool, bool]] = collections.deque()
        self._sampler = _SplittingBatchSampler(logical.batch_sampler, manager.max_physical_batch_size, self._plan)
        settings = {k: getattr(logical, k) for k in _LOADER_SETTINGS if hasattr(logical, k)}
        if not settings.get("num_workers"):
            settings.pop("prefetch_factor", None)
            settings.pop("persistent_workers", None)
        self._loader = DataLoader(
            logical.dataset, batch_sampler=self._sampler, collate_fn=logical.collate_fn, **settings
        )
        # the logical sampler's draws, counted as each logical batch's first physical batch is
        # handed out (None: a sampler of another kind, not counted)
        self._draws = draw_counter(logical.batch_sampler)
        if self._draws is not None:
            self._draws.attach()

    def __iter__(self) -> Iterator[Any]:
        manager = self._manager
        driving = manager._driving
        if driving is None:
            raise InvalidHyperparameterError(
                "iterate the loader inside its 'with BatchMemoryManager(...) as loader:' block"
            )
        self._plan.clear()
        batches: Iterator[Any] = (
            iter(self._loader) if self._draws is None
            else _CountedPass(self._draws, self._loader.__iter__, delivers=lambda: self._plan[0][0])
        )  # fmt: skip
        try:
            for batch in batches:
                starts, ends = self._plan.popleft()
                if starts:
                    manager._start_logical_batch()
                driving.releases = ends
                yield batch
        finally:
            # the loop ended or was left (break, an exception): a logical batch left half-way is
            # dropped now, so that no later step() can release part of it
            driving.releases = True
            if manager._unreleased() and manager.optimizer.discard_pending():
                driving.dropped += 1
            driving.steps_at_start = None

    def __len__(self) -> int:
        """An estimate of the physical batches of one pass (the count itself depends on the
        random batch sizes): the logical batches times ``ceil(expected units / max size)``."""
        sampler = self._manager.data_loader.batch_sampler
        size: Any = None
        rate = getattr(sampler, "sample_rate", None)
        if isinstance(rate, numbers.Real):
            size = float(rate) * len(self._manager.data_loader.dataset)  # type: ignore[arg-type]
        elif isinstance(getattr(sampler, "batch_size", None), numbers.Integral):
            size = sampler.batch_size
        per_logical = 1 if size is None else max(1, math.ceil(size / self._manager.max_physical_batch_size))
        return len(sampler) * per_logical

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._manager.data_loader, name)


class BatchMemoryManager:
    """Split each logical batch into physical batches of at most ``max_physical_batch_size``
    units; ``optimizer.step()`` accumulates on all but the last and releases once per logical
    batch (Opacus's ``BatchMemoryManager``, same keywords; the module docstring has the loop
    and the privacy argument).

    Args:
      data_loader: the logical loader, e.g. the one :func:`adaclip_torch.make_private` returns
        or :func:`adaclip_torch.poisson_data_loader` (any DataLoader with a batch sampler). Its
        dataset, ``collate_fn`` and worker settings are reused.
      max_physical_batch_size: the most units (examples; at user level, examples of whole
        users) a physical batch holds, a positive int.
      optimizer: the :class:`~adaclip_torch.optimizer.DPOptimizer` the loop steps, built for the
        *logical* batch (``expected_batch_size = q·N``, ``sample_rate = q``).

    Raises:
      InvalidHyperparameterError: a bad argument; an optimizer whose ``expected_batch_size`` or
        ``sample_rate`` is not the loader's logical one (when the loader's sampler states them,
        as the Poisson samplers do); a manager entered while another drives the optimizer.
      InvalidGradientError: on entering, when the optimizer holds a pending sum (call
        ``step()`` or ``discard_pending()`` first).
    """

    def __init__(self, *, data_loader: DataLoader, max_physical_batch_size: int, optimizer: DPOptimizer) -> None:
        if not isinstance(optimizer, DPOptimizer):
            raise InvalidHyperparameterError(
                f"optimizer must be an adaclip_torch DPOptimizer (FlatClip, AdaClip, ... or make_private's), "
                f"got {type(optimizer).__name__}"
            )
        if not isinstance(data_loader, DataLoader):
            raise InvalidHyperparameterError(
                f"data_loader must be a torch DataLoader (the logical loader), got {type(data_loader).__name__}"
            )
        if data_loader.batch_sampler is None:
            raise InvalidHyperparameterError(
                "data_loader has no batch sampler (batch_size=None): there are no logical batches to split"
            )
        if (
            isinstance(max_physical_batch_size, bool)
            or not isinstance(max_physical_batch_size, numbers.Integral)
            or max_physical_batch_size <= 0
        ):
            raise InvalidHyperparameterError(
                f"max_physical_batch_size must be a positive int, got {max_physical_batch_size!r}"
            )
        self._check_logical(data_loader.batch_sampler, optimizer)
        self.data_loader = data_loader
        self.max_physical_batch_size = int(max_physical_batch_size)
        self.optimizer = optimizer
        self._driving: _Driving | None = None

    @staticmethod
    def _check_logical(sampler: Any, optimizer: DPOptimizer) -> None:
        """The optimizer divides by the logical ``B̄`` and accounts the logical ``q``: refuse
        one built for anything else (e.g. the physical batch size), when the sampler says."""
        if optimizer.distributed:
            return  # each rank's loader holds its share of the global B̄
        expected = getattr(sampler, "expected_batch_size", None)
        if isinstance(expected, numbers.Real) and not math.isclose(
            float(expected), optimizer.expected_batch_size, rel_tol=1e-9
        ):
            raise InvalidHyperparameterError(
                f"the optimizer's expected_batch_size is {optimizer.expected_batch_size:g} but the loader's "
                f"logical batches have {float(expected):g} units on average: build the optimizer for the "
                "logical batch (B̄ = q·N, which every release divides by); BatchMemoryManager only changes "
                "the physical batches"
            )
        rate = getattr(sampler, "sample_rate", None)
        if optimizer.sample_rate is not None and isinstance(rate, numbers.Real) and not math.isclose(
            float(rate), optimizer.sample_rate, rel_tol=1e-12
        ):
            raise InvalidHyperparameterError(
                f"the optimizer's sample_rate is {optimizer.sample_rate:g} but the loader samples at "
                f"{float(rate):g}: the accountant must record the logical batch's rate"
            )

    def __enter__(self) -> PhysicalBatchLoader:
        optimizer = self.optimizer
        if optimizer._physical_batches is not None:
            raise InvalidHyperparameterError("another BatchMemoryManager is already driving this optimizer")
        if optimizer._accumulated is not None:
            raise InvalidGradientError(
                "the optimizer holds a pending clipped sum (accumulate() or add_unit_gradients() without "
                "step()): call step() or discard_pending() before entering BatchMemoryManager"
            )
        self._driving = _Driving(user_level=isinstance(self.data_loader.batch_sampler, PoissonUserBatchSampler))
        optimizer._physical_batches = self._driving
        return PhysicalBatchLoader(self)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        optimizer = self.optimizer
        driving = self._driving
        dropped = 0 if driving is None else driving.dropped
        if self._unreleased() and optimizer.discard_pending():
            dropped += 1
        optimizer._physical_batches = None
        self._driving = None
        if dropped and exc_type is None:
            warnings.warn(
                f"{dropped} logical batch(es) were left before their last physical batch was stepped (the "
                "loop was left early): their pending clipped sums were discarded, unreleased and unaccounted",
                UserWarning,
                stacklevel=2,
            )

    def _unreleased(self) -> bool:
        """Whether a logical batch has begun and not been released since."""
        driving = self._driving
        return driving is not None and driving.steps_at_start is not None and (
            self.optimizer.steps == driving.steps_at_start
        )

    def _start_logical_batch(self) -> None:
        """Before the first physical batch of a logical batch: drop the previous logical batch if
        it was never released (its units must not join this release)."""
        driving = self._driving
        assert driving is not None
        if self._unreleased():
            self._drop_unreleased("at the start of the next logical batch", warn=True)
        driving.steps_at_start = self.optimizer.steps
        driving.logical_batches += 1

    def _drop_unreleased(self, when: str, *, warn: bool) -> None:
        if self.optimizer.discard_pending() and warn:
            warnings.warn(
                f"a logical batch was not released (optimizer.step() was not called on its last physical "
                f"batch, or the loop left it early): its pending clipped sum was discarded {when}, "
                "unreleased and unaccounted",
                UserWarning,
                stacklevel=3,
            )
