"""Poisson sampling: each unit joins a step independently with probability ``q``.

The accountant's sampled Gaussian mechanism (see the Accounting page, ``docs/accounting.md``)
assumes exactly this sampling, so batches have
random size ``n ~ Binomial(N, q)`` (mean ``B̄ = qN``) and may be empty. The optimizer divides
by ``B̄``, never by ``n``.

Empty batches: :func:`poisson_data_loader` turns an empty index list into tensors with a
zero-length batch axis (shapes and dtypes taken from ``dataset[0]``), so ``model(x)`` and
``loss.backward()`` still run and the optimizer releases noise only.

Subsets: every sampler here takes ``indices=``, the dataset indices of its ``N`` units (distinct,
``>= 0``; stored sorted). It draws over the ``N`` units exactly as without them and yields the
units' dataset indices, so the loader's ``dataset[i]`` is the original data set's while ``N``
(and so ``q``, ``B̄ = qN``) is the subset's. The privacy unit is an example of the subset:
adjacency is adding or removing one example of the training set, and an example outside it
never joins a batch. The indices are part of :meth:`state_dict`; a state saved over another
set of examples is refused on load.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data._utils.collate import default_collate

from adaclip.errors import InvalidHyperparameterError
from adaclip.strategies import validate_sample_rate

__all__ = [
    "CyclicPoissonBatchSampler",
    "FixedOrderBatchSampler",
    "PoissonBatchSampler",
    "PoissonUserBatchSampler",
    "empty_batch_collate",
    "poisson_data_loader",
]


_check_rate = validate_sample_rate


def _check_indices(indices: Any, num_samples: int) -> torch.Tensor | None:
    """``indices`` as a sorted 1-d int64 tensor of ``num_samples`` distinct dataset indices
    ``>= 0`` (``None`` stays ``None``: the units are ``0 .. num_samples - 1``).

    Raises:
      InvalidHyperparameterError: not 1-d integers, a negative or repeated index (an example
        listed twice would be two units of one example: its inclusion probability and its
        contribution to a batch would both be doubled, which the accountant does not assume),
        or not ``num_samples`` of them.
    """
    if indices is None:
        return None
    if isinstance(indices, torch.Tensor):
        ids = indices.detach().to("cpu")
    else:
        try:
            ids = torch.as_tensor(indices if hasattr(indices, "__array__") else list(indices))
        except (TypeError, ValueError, RuntimeError):
            raise InvalidHyperparameterError(
                f"indices must be a 1-d sequence of ints, got {type(indices).__name__}"
            ) from None
    if ids.ndim != 1 or ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise InvalidHyperparameterError(f"indices must be a 1-d sequence of ints, got shape {tuple(ids.shape)} "
                                         f"of {ids.dtype}")
    ids = torch.sort(ids.to(torch.int64)).values
    if ids.numel() != num_samples:
        raise InvalidHyperparameterError(f"{ids.numel()} indices for num_samples={num_samples}: give one per unit")
    if ids.numel() and int(ids[0]) < 0:
        raise InvalidHyperparameterError(
            f"indices must be >= 0, got {int(ids[0])} (a negative index is another example's under Python's "
            "indexing: give dataset indices as they are)"
        )
    repeated = ids[1:][ids[1:] == ids[:-1]]
    if repeated.numel():
        raise InvalidHyperparameterError(
            f"indices must be distinct, but {int(repeated.unique().numel())} of them are repeated (e.g. "
            f"{int(repeated[0])}): an example listed twice would be two units of one example, with twice the "
            "inclusion probability and up to twice the contribution to a batch, which the accountant does not "
            "assume. Pass each example once (sorted(set(indices)))"
        )
    return ids


def _indices_state(indices: torch.Tensor | None) -> dict[str, Any]:
    """The indices' entry of a sampler's state (none for the whole data set: old states stay valid)."""
    return {} if indices is None else {"indices": indices.clone()}


def _check_indices_state(state: dict[str, Any], indices: torch.Tensor | None) -> None:
    """Refuse a saved sampler state drawn over another set of examples than this sampler's."""
    saved = state.get("indices")
    same = (saved is None and indices is None) or (
        isinstance(saved, torch.Tensor) and indices is not None and saved.shape == indices.shape
        and torch.equal(saved.to(indices.dtype), indices)
    )
    if not same:
        raise InvalidHyperparameterError(
            "the saved sampler state is for another set of examples (its indices differ from this sampler's): "
            "resuming it would mix two training sets in one run; build the sampler over the same examples"
        )


def _dataset_indices(units: torch.Tensor, indices: torch.Tensor | None) -> list[int]:
    """The dataset indices of the chosen units (positions ``0 .. N-1``)."""
    return (units if indices is None else indices[units]).tolist()


class PoissonBatchSampler(Sampler[list[int]]):
    """Yields ``num_steps`` index lists; index ``i`` is in each with probability ``q``.

    Args:
      num_samples: ``N``, the number of units in the dataset (in ``indices`` when given).
      sample_rate: ``q`` in ``(0, 1]``.
      num_steps: batches per pass (default ``round(1/q)``: one epoch in expectation).
      generator: a :class:`torch.Generator` for the Bernoulli draws (default: a fresh one
        seeded from the OS). Seed it only for experiments.
      indices: the dataset indices of the ``N`` units, distinct and ``>= 0`` (``None``, the
        default: ``0 .. N-1``, the whole data set). The batches are dataset indices of these
        examples only, drawn as without ``indices``; the privacy unit is one of them.
    """

    def __init__(
        self,
        num_samples: int,
        sample_rate: float,
        num_steps: int | None = None,
        generator: torch.Generator | None = None,
        *,
        indices: Sequence[int] | torch.Tensor | None = None,
    ) -> None:
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples <= 0:
            raise InvalidHyperparameterError(f"num_samples must be a positive int, got {num_samples!r}")
        self.num_samples = num_samples
        #: the dataset indices of the units, sorted (``None``: ``0 .. N-1``)
        self.indices = _check_indices(indices, num_samples)
        self.sample_rate = _check_rate(sample_rate)
        if num_steps is None:
            num_steps = max(1, round(1.0 / self.sample_rate))
        if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps <= 0:
            raise InvalidHyperparameterError(f"num_steps must be a positive int, got {num_steps!r}")
        self.num_steps = num_steps
        if generator is None:
            generator = torch.Generator()
            generator.seed()
        self.generator = generator

    @property
    def expected_batch_size(self) -> float:
        """``B̄ = q·N``."""
        return self.sample_rate * self.num_samples

    def __len__(self) -> int:
        return self.num_steps

    def state_dict(self) -> dict[str, Any]:
        """The generator state (and the indices of a subset): save it with the optimizer to
        resume the same batches."""
        return {"generator_state": self.generator.get_state().clone(), **_indices_state(self.indices)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_indices_state(state, self.indices)
        self.generator.set_state(state["generator_state"])

    def __iter__(self) -> Iterator[list[int]]:
        for _ in range(self.num_steps):
            mask = torch.rand(self.num_samples, generator=self.generator) < self.sample_rate
            yield _dataset_indices(mask.nonzero(as_tuple=True)[0], self.indices)


class CyclicPoissonBatchSampler(Sampler[list[int]]):
    """Cyclic Poisson sampling, the sampler banded correlated noise needs.

    Every unit is assigned once, independently and uniformly at random, to one of ``b`` groups
    (``bands``); step ``t`` samples only group ``t mod b``, each of its units independently with
    probability ``p = b·q``. The expected batch is still ``q·N``; a unit joins at most one step in
    any ``b`` consecutive ones, which is what lets banded noise be accounted as ``⌈T/b⌉``
    compositions of the Poisson-subsampled Gaussian at rate ``p``
    (:mod:`adaclip.correlated.mechanism`). The assignment must be independent per unit (not an
    equal split) for add/remove adjacency. With ``bands=1`` it is :class:`PoissonBatchSampler`,
    draw for draw.

    The position ``t`` carries over from one pass (epoch) to the next, so the groups keep
    cycling across epochs; every batch it yields must be stepped (``optimizer.step()``, also for
    an empty batch) — the optimizer checks that it never steps more often than batches were
    drawn, and never falls behind by more than :attr:`max_lookahead` (batches a loader's workers
    prefetch).

    Args:
      num_samples: ``N``.
      sample_rate: ``q``, the overall rate (the expected batch is ``q·N``); ``b·q <= 1``.
      bands: ``b``, the number of groups (the noise's bands).
      num_steps: batches per pass (default ``round(1/q)``).
      generator: a :class:`torch.Generator` for the assignment and the draws (default: seeded
        from the OS). The assignment and the generator are as secret as the sampler state of
        plain Poisson sampling.
      indices: the dataset indices of the ``N`` units (as :class:`PoissonBatchSampler`'s; the
        groups are assigned to these units only).
    """

    def __init__(
        self,
        num_samples: int,
        sample_rate: float,
        bands: int,
        num_steps: int | None = None,
        generator: torch.Generator | None = None,
        *,
        indices: Sequence[int] | torch.Tensor | None = None,
    ) -> None:
        from adaclip.correlated.mechanism import accounted_sample_rate

        self._inner = PoissonBatchSampler(num_samples, sample_rate, num_steps, generator, indices=indices)
        self.group_rate = accounted_sample_rate(self._inner.sample_rate, bands)
        self.bands = int(bands)
        self.position = 0
        self.max_lookahead = 0
        # b = 1: no assignment is drawn, so the draws are PoissonBatchSampler's
        self.groups = (
            None if self.bands == 1
            else torch.randint(0, self.bands, (num_samples,), generator=self._inner.generator)
        )

    @property
    def num_samples(self) -> int:
        return self._inner.num_samples

    @property
    def indices(self) -> torch.Tensor | None:
        """The dataset indices of the units, sorted (``None``: ``0 .. N-1``)."""
        return self._inner.indices

    @property
    def sample_rate(self) -> float:
        """``q``: the overall rate (``B̄ = q·N``); the accountant records ``p = b·q``."""
        return self._inner.sample_rate

    @property
    def num_steps(self) -> int:
        return self._inner.num_steps

    @property
    def generator(self) -> torch.Generator:
        return self._inner.generator

    @property
    def expected_batch_size(self) -> float:
        """``B̄ = q·N``."""
        return self._inner.expected_batch_size

    def __len__(self) -> int:
        return self._inner.num_steps

    def state_dict(self) -> dict[str, Any]:
        """Generator state, group assignment and position: save it with the optimizer to resume
        the same batches (as secret as the data's sampling)."""
        return {
            "generator_state": self.generator.get_state().clone(),
            "groups": None if self.groups is None else self.groups.clone(),
            "position": self.position,
            **_indices_state(self.indices),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_indices_state(state, self.indices)
        groups = state.get("groups")
        if (groups is None) != (self.groups is None) or (
            groups is not None and tuple(groups.shape) != tuple(self.groups.shape)  # type: ignore[union-attr]
        ):
            raise InvalidHyperparameterError("the saved sampler state is for another number of bands or units")
        position = state.get("position")
        if isinstance(position, bool) or not isinstance(position, int) or position < 0:
            raise InvalidHyperparameterError(f"the saved sampler position must be an int >= 0, got {position!r}")
        self.generator.set_state(state["generator_state"])
        self.groups = None if groups is None else groups.clone()
        self.position = position

    def __iter__(self) -> Iterator[list[int]]:
        for _ in range(self.num_steps):
            mask = torch.rand(self.num_samples, generator=self.generator) < self.group_rate
            if self.groups is not None:
                mask &= self.groups == self.position % self.bands
            self.position += 1
            yield _dataset_indices(mask.nonzero(as_tuple=True)[0], self.indices)


class FixedOrderBatchSampler(Sampler[list[int]]):
    """Fixed-order batches, the sampler BLT correlated noise needs (no amplification).

    The ``N`` units are shuffled once with ``generator`` and cut into ``b = ⌈N/B⌉`` disjoint
    batches of ``B = batch_size`` (the last one smaller when ``B`` does not divide ``N``); every
    epoch visits the same batches in the same order, so step ``t`` is batch ``t mod b`` and
    each unit takes part in at most ``⌈T/b⌉`` of ``T`` steps, any two exactly ``b`` apart — the
    min-separation participation that :class:`adaclip.accounting.MinSeparationParticipation`
    accounts (min separation :attr:`num_batches`). Nothing about who participates is random
    after the shuffle, so the accounting assumes no amplification by sampling, and the order
    need not be secret.

    The position carries over from one pass (one epoch of :attr:`num_batches` batches) to the
    next; every batch it yields must be stepped (``optimizer.step()``), which the optimizer
    checks as it does for :class:`CyclicPoissonBatchSampler`.

    Args:
      num_samples: ``N``.
      batch_size: ``B`` (``1 ≤ B ≤ N``).
      generator: a :class:`torch.Generator` for the one shuffle (default: seeded from the OS).
      total_steps: the planned length of the run in steps (public), for which
        ``noise_mechanism="blt"`` fits its factor; ``None``: give the optimizer a fitted
        :class:`adaclip.correlated.BltNoise` instead.
      indices: the dataset indices of the ``N`` units (as :class:`PoissonBatchSampler`'s: the
        batches cut these examples only).
    """

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        generator: torch.Generator | None = None,
        *,
        total_steps: int | None = None,
        indices: Sequence[int] | torch.Tensor | None = None,
    ) -> None:
        for name, value in (("num_samples", num_samples), ("batch_size", batch_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise InvalidHyperparameterError(f"{name} must be a positive int, got {value!r}")
        if batch_size > num_samples:
            raise InvalidHyperparameterError(f"batch_size={batch_size} exceeds num_samples={num_samples}")
        if total_steps is not None and (
            isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps <= 0
        ):
            raise InvalidHyperparameterError(f"total_steps must be a positive int or None, got {total_steps!r}")
        #: the dataset indices of the units, sorted (``None``: ``0 .. N-1``)
        self.indices = _check_indices(indices, num_samples)
        if generator is None:
            generator = torch.Generator()
            generator.seed()
        self.generator = generator
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.total_steps = total_steps
        self.order = torch.randperm(num_samples, generator=generator)
        self.position = 0
        self.max_lookahead = 0

    @property
    def num_batches(self) -> int:
        """``b = ⌈N/B⌉``: batches per epoch, the min separation between a unit's steps."""
        return -(-self.num_samples // self.batch_size)

    @property
    def sample_rate(self) -> float:
        """``B/N``: the nominal fraction of the data per step (not a sampling probability: the
        accountant records BLT's releases with no amplification)."""
        return self.batch_size / self.num_samples

    @property
    def expected_batch_size(self) -> float:
        return float(self.batch_size)

    def batch(self, index: int) -> list[int]:
        """The dataset indices of the units of batch ``index mod b``."""
        k = index % self.num_batches
        return _dataset_indices(self.order[k * self.batch_size : (k + 1) * self.batch_size], self.indices)

    def __len__(self) -> int:
        return self.num_batches

    def state_dict(self) -> dict[str, Any]:
        """Order and position (and the indices of a subset): save it with the optimizer to
        resume the same batches."""
        return {"order": self.order.clone(), "position": self.position, **_indices_state(self.indices)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_indices_state(state, self.indices)
        order, position = state.get("order"), state.get("position")
        if not isinstance(order, torch.Tensor) or tuple(order.shape) != (self.num_samples,) or not torch.equal(
            torch.sort(order).values, torch.arange(self.num_samples)
        ):
            raise InvalidHyperparameterError("the saved order is not a permutation of this sampler's units")
        if isinstance(position, bool) or not isinstance(position, int) or position < 0:
            raise InvalidHyperparameterError(f"the saved sampler position must be an int >= 0, got {position!r}")
        self.order = order.clone()
        self.position = position

    def __iter__(self) -> Iterator[list[int]]:
        for _ in range(self.num_batches):
            batch = self.batch(self.position)
            self.position += 1
            yield batch


class PoissonUserBatchSampler(Sampler[list[int]]):
    """User-level Poisson sampling: each *user* joins a step with probability ``q`` and brings
    all of their examples (see the User-level page, ``docs/user-level.md``).

    Args:
      user_ids: the user of each example (``len(dataset)`` integers).
      sample_rate: ``q``, the per-user inclusion probability (what the accountant records).
      num_steps: batches per pass (default ``round(1/q)``).
      generator: :class:`torch.Generator` for the draws (default: seeded from the OS).

    Pass the batch's user ids to ``optimizer.step(user_ids=...)`` so each user's examples are
    summed into one unit before clipping, and set ``expected_batch_size`` to
    :attr:`expected_batch_size` ``= q·U`` (users, not examples).

    ``bands=b > 1``: cyclic Poisson sampling of the users (:class:`CyclicPoissonBatchSampler`
    over users, :attr:`cyclic_sampler`), for banded correlated noise at user level.
    """

    def __init__(
        self,
        user_ids: Any,
        sample_rate: float,
        num_steps: int | None = None,
        generator: torch.Generator | None = None,
        bands: int = 1,
    ) -> None:
        ids = torch.as_tensor(user_ids)
        if ids.ndim != 1 or ids.numel() == 0 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise InvalidHyperparameterError("user_ids must be a non-empty 1-d sequence of integers")
        self.users, inverse = torch.unique(ids, return_inverse=True)
        self._example_users = inverse
        order = torch.argsort(inverse, stable=True)
        counts = torch.bincount(inverse, minlength=len(self.users))
        self._examples = torch.split(order, counts.tolist())
        self._user_sampler: PoissonBatchSampler | CyclicPoissonBatchSampler
        if bands == 1:
            self._user_sampler = PoissonBatchSampler(len(self.users), sample_rate, num_steps, generator)
        else:
            self._user_sampler = CyclicPoissonBatchSampler(len(self.users), sample_rate, bands, num_steps, generator)

    @property
    def cyclic_sampler(self) -> CyclicPoissonBatchSampler | None:
        """The cyclic Poisson sampler of the users (``bands > 1``), else ``None``."""
        sampler = self._user_sampler
        return sampler if isinstance(sampler, CyclicPoissonBatchSampler) else None

    @property
    def sample_rate(self) -> float:
        return self._user_sampler.sample_rate

    @property
    def example_users(self) -> torch.Tensor:
        """The user of each example, as a position in :attr:`users` (a copy)."""
        return self._example_users.clone()

    @property
    def num_users(self) -> int:
        return len(self.users)

    @property
    def expected_batch_size(self) -> float:
        """``B̄ = q·U``, the expected number of users per step."""
        return self._user_sampler.expected_batch_size

    def __len__(self) -> int:
        return len(self._user_sampler)

    def state_dict(self) -> dict[str, Any]:
        return self._user_sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._user_sampler.load_state_dict(state)

    def __iter__(self) -> Iterator[list[int]]:
        for chosen in self._user_sampler:
            yield [i for u in chosen for i in self._examples[u].tolist()]


def _empty_like(example: Any) -> Any:
    """A zero-length batch with ``example``'s structure, shapes and dtypes."""
    if isinstance(example, torch.Tensor):
        return torch.zeros((0, *example.shape), dtype=example.dtype)
    if isinstance(example, (int, float, bool)):
        dtype = torch.int64 if isinstance(example, int) and not isinstance(example, bool) else (
            torch.bool if isinstance(example, bool) else torch.get_default_dtype()
        )
        return torch.zeros((0,), dtype=dtype)
    if isinstance(example, tuple) and hasattr(example, "_fields"):
        return type(example)(*(_empty_like(e) for e in example))
    if isinstance(example, (list, tuple)):
        return type(example)(_empty_like(e) for e in example)
    if isinstance(example, dict):
        return {k: _empty_like(v) for k, v in example.items()}
    try:
        return torch.as_tensor(example)[None][:0]
    except (TypeError, ValueError, RuntimeError):
        raise InvalidHyperparameterError(
            f"cannot build an empty batch for examples of type {type(example).__name__}; pass collate_fn"
        ) from None


def empty_batch_collate(
    dataset: Dataset, collate_fn: Callable[[list[Any]], Any] = default_collate, *, index: int = 0
) -> Callable:
    """``collate_fn`` that maps an empty list to a zero-length batch shaped like
    ``dataset[index]`` (give the index of a training example when training on a subset)."""
    empty = _empty_like(dataset[index])

    def collate(batch: list[Any]) -> Any:
        return empty if len(batch) == 0 else collate_fn(batch)

    return collate


def poisson_data_loader(
    dataset: Dataset,
    sample_rate: float,
    *,
    num_steps: int | None = None,
    generator: torch.Generator | None = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    bands: int = 1,
    indices: Sequence[int] | torch.Tensor | None = None,
    **loader_kwargs: Any,
) -> DataLoader:
    """A :class:`DataLoader` over ``dataset`` with Poisson batches of rate ``sample_rate``.

    ``loader_kwargs`` go to :class:`DataLoader` (``num_workers``, ``pin_memory``, ...);
    ``batch_size``, ``shuffle``, ``sampler`` and ``drop_last`` are not allowed (the sampler
    decides). Empty batches come out as zero-length tensors. ``bands > 1``: cyclic Poisson
    sampling (:class:`CyclicPoissonBatchSampler`), for banded correlated noise.

    ``indices``: train on these examples of ``dataset`` only (distinct dataset indices): the
    ``N`` units are them, the expected batch is ``q·len(indices)``, and the batches are their
    dataset indices (``None``: the whole data set, ``N = len(dataset)``).
    """
    for key in ("batch_size", "shuffle", "sampler", "batch_sampler", "drop_last"):
        if key in loader_kwargs:
            raise InvalidHyperparameterError(
                f"poisson_data_loader chooses the batches itself; do not pass {key}"
                + (" (to train on part of the data set pass indices=, or a torch.utils.data.Subset as the dataset)"
                   if key in ("sampler", "batch_sampler") else "")
            )
    size = len(dataset)  # type: ignore[arg-type]
    ids = None if indices is None else _check_indices(indices, len(indices))  # type: ignore[arg-type]
    if ids is not None and ids.numel() and int(ids[-1]) >= size:
        raise InvalidHyperparameterError(f"indices go up to {int(ids[-1])} but the data set has {size} examples")
    num_samples = size if ids is None else ids.numel()
    sampler: Sampler[list[int]]
    if bands == 1:
        sampler = PoissonBatchSampler(num_samples, sample_rate, num_steps=num_steps, generator=generator, indices=ids)
    else:
        cyclic = CyclicPoissonBatchSampler(
            num_samples, sample_rate, bands, num_steps=num_steps, generator=generator, indices=ids
        )
        workers = int(loader_kwargs.get("num_workers", 0) or 0)
        cyclic.max_lookahead = workers * int(loader_kwargs.get("prefetch_factor") or 2) if workers else 0
        sampler = cyclic
    # the empty batch's shapes come from a training example (none outside the training set is read)
    collate = empty_batch_collate(dataset, collate_fn or default_collate, index=0 if ids is None else int(ids[0]))
    return DataLoader(dataset, batch_sampler=sampler, collate_fn=collate, **loader_kwargs)


def steps_per_epoch(sample_rate: float) -> int:
    """``round(1/q)``: the number of Poisson steps that visit each unit once in expectation."""
    return max(1, round(1.0 / _check_rate(sample_rate)))


def sample_rate_for(batch_size: float, num_samples: int) -> float:
    """``q = B / N``: the Poisson rate whose expected batch size is ``B``.

    Args:
      batch_size: ``B``, the expected batch size, ``0 < B <= N``.
      num_samples: ``N``, the number of units in the data set (a positive int).

    Raises:
      InvalidHyperparameterError: ``B`` is not a finite number in ``(0, N]`` or ``N`` is not a
        positive int. In particular ``B > N`` is refused rather than capped at ``q = 1``: a
        Poisson batch averages ``qN <= N`` units, so a larger ``B`` means the sampling was
        misunderstood (and the accounting would be for another rate than the one asked for).
    """
    if isinstance(num_samples, bool) or not isinstance(num_samples, numbers.Integral) or num_samples <= 0:
        raise InvalidHyperparameterError(f"num_samples must be a positive int, got {num_samples!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Real):
        raise InvalidHyperparameterError(f"batch_size must be a positive number, got {batch_size!r}")
    if not math.isfinite(batch_size) or batch_size <= 0:
        raise InvalidHyperparameterError(f"batch_size must be finite and > 0, got {batch_size!r}")
    if batch_size > num_samples:
        raise InvalidHyperparameterError(
            f"batch_size={batch_size!r} is larger than the data set ({num_samples} units): with "
            f"Poisson sampling each unit joins a step with probability q = batch_size/N, so the "
            f"expected batch size is at most N. Use batch_size <= {num_samples}"
        )
    return float(batch_size) / int(num_samples)
