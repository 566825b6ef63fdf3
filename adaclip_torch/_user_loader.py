"""What :func:`adaclip_torch.make_private` reads from the user's loader: which examples it
trains on and its batch size.

make_private replaces the loader's sampling (Poisson, cyclic Poisson for banded noise, fixed
order for BLT), but not the user's choice of examples: the new loader draws from exactly the
examples the user's sampler ranges over, with ``N`` (and so ``q = B/N``, the steps of an epoch
and the ``δ < 1/N`` check) computed on that set, and yields their indices in the original data
set. The privacy unit is one example of that training set: adjacency is adding or removing one
of its examples; examples outside it never join a batch.

The rule for each sampler (the loader's ``sampler``, or with ``batch_sampler=`` the sampler
inside a :class:`torch.utils.data.BatchSampler`, whose ``batch_size`` is then ``B``); only the
exact types below are read (a subclass may iterate differently, so it is refused like any
other sampler):

* :class:`~torch.utils.data.SequentialSampler` and :class:`~torch.utils.data.RandomSampler`
  (``shuffle=False``/``True``): indices ``0 .. n-1`` of their ``data_source`` — the whole data
  set when ``n = len(dataset)`` (as always), its first ``n`` examples when smaller;
* ``RandomSampler(replacement=True)`` or with a ``num_samples`` other than ``n``: refused
  (draws with replacement or a changing part of the data each epoch: not a set of examples;
  the run's length is ``epochs=``);
* :class:`~torch.utils.data.SubsetRandomSampler` (``indices``) and a plain sequence of indices
  (``list``, ``tuple``, ``range``, 1-d integer tensor or array): those examples; a repeated or
  negative index or one past the data set is refused;
* :class:`~torch.utils.data.WeightedRandomSampler`: refused (unequal inclusion probabilities,
  with replacement: not the sampling the accountant assumes);
* :class:`~torch.utils.data.distributed.DistributedSampler`: with ``make_private(...,
  distributed=True)`` the whole data set (its shards together cover it; make_private shards it
  again, into fixed shards, see :func:`shard`); otherwise refused (its shard changes every
  epoch and is padded with other ranks' examples);
* any other sampler or batch sampler (a user's ``Sampler`` subclass, a bucketing batch
  sampler, a loader make_private or :func:`~adaclip_torch.poisson_data_loader` already built):
  refused — its set of examples cannot be read without iterating it, which would consume its
  randomness, and it may change from epoch to epoch. The way out, named in the error: a
  :class:`torch.utils.data.Subset` of the data set with ``shuffle=True``, or
  ``sampler=SubsetRandomSampler(indices)``.

The user's sampler is only read, never iterated; its generator, a loader's ``drop_last`` and
``shuffle`` do not carry over (make_private's ``seed`` seeds the new sampler).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)
from torch.utils.data.distributed import DistributedSampler

from adaclip.errors import InvalidHyperparameterError
from adaclip_torch.data import (
    CyclicPoissonBatchSampler,
    FixedOrderBatchSampler,
    PoissonBatchSampler,
    PoissonUserBatchSampler,
    _check_indices,
)

__all__ = ["TrainingSet", "read_training_set", "shard"]

_WAY_OUT = (
    "to train on part of the data set give DataLoader(dataset, batch_size=B, sampler=SubsetRandomSampler(indices)) "
    "or DataLoader(torch.utils.data.Subset(dataset, indices), batch_size=B, shuffle=True); for all of it, "
    "DataLoader(dataset, batch_size=B, shuffle=True)"
)


class TrainingSet(NamedTuple):
    """The examples the user's loader ranges over and its batch size.

    ``indices``: their indices in the loader's data set, sorted and distinct (``None``: all of
    ``0 .. len(dataset)-1``); ``num_samples``: ``N``, how many there are; ``batch_size``: ``B``.
    """

    indices: torch.Tensor | None
    num_samples: int
    batch_size: int


def read_training_set(data_loader: DataLoader, *, world: tuple[int, int] | None = None) -> TrainingSet:
    """The training set and batch size of ``data_loader``, by the rules of this module's
    docstring; reads the sampler's attributes only (nothing is drawn or changed). ``world``:
    ``(rank, number of ranks)`` of a data-parallel run (``make_private(..., distributed=True)``),
    where a ``DistributedSampler`` of that process group stands for the whole data set and the
    batch size is each rank's.

    Raises:
      InvalidHyperparameterError: a data set without a length, no fixed batch size, or a
        sampler whose set of examples is not (or cannot safely be read as) a fixed set; the
        message names what to pass instead.
    """
    dataset = data_loader.dataset
    if isinstance(dataset, IterableDataset):
        raise InvalidHyperparameterError(
            "data_loader's dataset is an IterableDataset: it cannot be Poisson-sampled (each example must be "
            "reachable by its index); give a map-style Dataset"
        )
    try:
        size = len(dataset)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidHyperparameterError("data_loader's dataset must have a length (an iterable dataset cannot be "
                                         "Poisson-sampled)") from None
    if data_loader.batch_size is not None:
        batch_size, sampler, where = data_loader.batch_size, data_loader.sampler, "the loader's sampler"
    else:
        batch_sampler = data_loader.batch_sampler
        if isinstance(
            batch_sampler, (PoissonBatchSampler, CyclicPoissonBatchSampler, FixedOrderBatchSampler, PoissonUserBatchSampler)
        ):
            raise InvalidHyperparameterError(
                f"data_loader already samples with a {type(batch_sampler).__name__} (make_private's or "
                "poisson_data_loader's loader): pass the loader you built, with a fixed batch_size, and make_private "
                "builds the private one; or wrap the optimizer yourself with this loader's sample_rate"
            )
        if type(batch_sampler) is not BatchSampler:
            what = "no batch_sampler (batch_size=None)" if batch_sampler is None else (
                f"batch_sampler={type(batch_sampler).__name__}"
            )
            raise InvalidHyperparameterError(
                f"data_loader must have a fixed batch_size (it sets q = batch_size/N), or a "
                f"torch.utils.data.BatchSampler(sampler, batch_size, drop_last) as its batch_sampler; it has {what}, "
                f"whose batch size and examples make_private cannot read without drawing batches. Give a fixed "
                f"batch_size instead: {_WAY_OUT}"
            )
        batch_size, sampler, where = batch_sampler.batch_size, batch_sampler.sampler, "the batch_sampler's sampler"
    if world is not None and isinstance(sampler, DistributedSampler):
        _check_distributed_sampler(sampler, size, world, where)
        indices = None
    else:
        indices = _indices_of(sampler, size, where)
    num_samples = size if indices is None else int(indices.numel())
    return TrainingSet(indices, num_samples, batch_size)


def _check_distributed_sampler(sampler: DistributedSampler, size: int, world: tuple[int, int], where: str) -> None:
    """A ``DistributedSampler`` read as the whole data set: it must be this process group's."""
    rank, ranks = world
    if len(sampler.dataset) != size or sampler.num_replicas != ranks or sampler.rank != rank:  # type: ignore[arg-type]
        raise InvalidHyperparameterError(
            f"{where} is a DistributedSampler over {sampler.num_replicas} replicas (rank {sampler.rank}) of "
            f"{len(sampler.dataset)} examples, but this process is rank {rank} of {ranks} over a data set of "  # type: ignore[arg-type]
            f"{size}: build it for this process group, or give each rank DataLoader(dataset, batch_size=B, "
            "shuffle=True) (make_private shards the data itself)"
        )


def shard(training: TrainingSet, world: tuple[int, int]) -> torch.Tensor:
    """This rank's fixed shard of the training set: positions ``rank, rank + R, rank + 2R, ...``
    of its sorted indices. The shards are disjoint and together are the training set, the same
    on every rank whatever its loader's order (nothing is drawn)."""
    rank, ranks = world
    ids = torch.arange(training.num_samples) if training.indices is None else training.indices
    return ids[rank::ranks].clone()


def _indices_of(sampler: Any, size: int, where: str) -> torch.Tensor | None:
    """The sorted dataset indices ``sampler`` ranges over (``None``: ``0 .. size-1``)."""
    kind = type(sampler)
    name = kind.__name__
    if kind is WeightedRandomSampler:
        raise InvalidHyperparameterError(
            f"{where} is a WeightedRandomSampler: make_private cannot keep it. It draws examples with unequal "
            "probabilities (and with replacement), while the accountant assumes that every example of the "
            "training set joins each step independently with the same probability q = B/N; an example with a "
            "larger weight would be more exposed than the epsilon says. Sample uniformly (shuffle=True) and, to "
            "rebalance classes, weight the loss with weights that do not come from the private data; "
            + _WAY_OUT
        )
    if isinstance(sampler, DistributedSampler):
        raise InvalidHyperparameterError(
            f"{where} is a DistributedSampler: its shard changes every epoch (set_epoch) and is padded with "
            "other ranks' examples, so it is not a fixed set of examples. For data parallel pass "
            "distributed=True to make_private (in every rank, after init_process_group): it then reads the "
            "DistributedSampler as the whole data set and gives each rank a fixed shard of it"
        )
    if kind is RandomSampler:
        if sampler.replacement:
            raise InvalidHyperparameterError(
                f"{where} is a RandomSampler(replacement=True): it draws examples with replacement, so an "
                "example can come several times in a pass, which is not the sampling the accountant assumes "
                "(each example joins a step independently with probability q). " + _WAY_OUT
            )
        n = len(sampler.data_source)
        if sampler._num_samples is not None and sampler._num_samples != n:
            raise InvalidHyperparameterError(
                f"{where} is a RandomSampler with num_samples={sampler._num_samples} of {n} examples: it draws a "
                "different part of the data (or repeats examples) every pass, which is not a set of examples to "
                "sample from. Leave num_samples out (make_private's epoch is round(1/q) Poisson steps; the run's "
                "length is epochs=); " + _WAY_OUT
            )
        return _first(n, size, where, name)
    if kind is SequentialSampler:
        return _first(len(sampler.data_source), size, where, name)
    if kind is SubsetRandomSampler:
        return _given(sampler.indices, size, where, f"{name}'s indices")
    if isinstance(sampler, (Sequence, torch.Tensor)) or (
        type(sampler).__module__ == "numpy" and hasattr(sampler, "__array__")
    ):
        return _given(sampler, size, where, "the indices")
    known = (RandomSampler, SequentialSampler, SubsetRandomSampler, WeightedRandomSampler, BatchSampler)
    subclass = next((k.__name__ for k in known if isinstance(sampler, k)), None)
    what = f"{name}, a subclass of {subclass}," if subclass else name
    raise InvalidHyperparameterError(
        f"{where} is a {what} whose set of examples make_private cannot read: only torch's own "
        "SequentialSampler, RandomSampler and SubsetRandomSampler (and plain sequences of indices) are read. "
        "Iterating it to find out would consume its randomness, and the examples it yields may change from "
        "epoch to epoch, while the new loader must sample from one fixed set of N examples. " + _WAY_OUT
    )


def _first(n: int, size: int, where: str, name: str) -> torch.Tensor | None:
    """``0 .. n-1``: ``None`` for the whole data set."""
    if n > size:
        raise InvalidHyperparameterError(
            f"{where} ({name}) ranges over {n} indices but the data set has {size} examples"
        )
    if n <= 0:
        raise InvalidHyperparameterError(f"{where} ({name}) ranges over no examples")
    return None if n == size else torch.arange(n)


def _given(indices: Any, size: int, where: str, what: str) -> torch.Tensor | None:
    """Explicit indices, checked (distinct, ``0 <= i < size``, at least one); ``None`` when
    they are the whole data set."""
    try:
        count = len(indices)
    except TypeError:
        raise InvalidHyperparameterError(f"{where}: {what} must be a sequence of ints") from None
    if count == 0:
        raise InvalidHyperparameterError(f"{where}: {what} are empty: there is nothing to train on")
    try:
        ids = _check_indices(indices, count)
    except InvalidHyperparameterError as err:
        raise InvalidHyperparameterError(f"{where}: {what}: {err}") from None
    assert ids is not None
    if int(ids[-1]) >= size:
        raise InvalidHyperparameterError(
            f"{where}: {what} go up to {int(ids[-1])} but the data set has {size} examples (0 .. {size - 1})"
        )
    return None if ids.numel() == size else ids
