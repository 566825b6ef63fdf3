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

Which batches were released: an optimizer given the sampler (``sampler=``; ``make_private``
always gives it) checks at every step that it releases the next batch the training loop
received from the sampler — exactly one step per batch, none skipped, none stepped twice, none
from another loader; with banded or BLT noise, step ``t`` on draw ``t``
(:meth:`DrawCounter.check_step`, :meth:`DrawCounter.check_next`). Each sampler keeps a
:class:`DrawCounter`: the draws it made (``position``) and, when a :class:`CountingDataLoader`
drives it (what :func:`poisson_data_loader` and ``make_private`` return), the draws that loader
handed to the loop (``delivered``). DataLoader workers draw batches ahead of the loop; only the
delivered count says which batch is in the loop's hands, so with workers the loader must be a
:class:`CountingDataLoader`.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data._utils.collate import default_collate

from adaclip.correlated.mechanism import accounted_sample_rate
from adaclip.errors import InvalidGradientError, InvalidHyperparameterError
from adaclip.strategies import validate_sample_rate

__all__ = [
    "CountingDataLoader",
    "CyclicPoissonBatchSampler",
    "DrawCounter",
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


class DrawCounter:
    """What a sampler drew and what its loader handed to the training loop, for the optimizer's
    check that every step releases the next batch the loop received, exactly once (one counter
    per sampler, shared by its loaders).

    The privacy argument the check serves: cyclic Poisson sampling (banded noise) makes draw ``t``
    sample group ``t mod b`` and fixed-order batches (BLT) make draw ``t`` batch ``t mod b``; the
    accounting holds only if release ``t`` is made on draw ``t`` — a skipped batch or a batch
    stepped twice shifts the draws against the steps, and a unit can then be released twice less
    than ``b`` steps apart (:meth:`check_step`). With plain Poisson sampling (DP-SGD) a skipped
    batch is a selection of the draws the accountant does not know of (skipping the batches that
    lack someone makes their inclusion certain), a repeated batch is two releases on one draw and
    a batch from another loader is not Poisson sampling at all; the draws carry no schedule, so
    there each step must come with exactly one new batch since the previous one
    (:meth:`check_next`).

    Attributes:
      position: the draws made so far, the index of the next draw (it chooses the group or
        batch). DataLoader workers draw ahead of the loop, so ``position`` runs ahead by what
        they prefetch.
      delivered: ``None`` until a :class:`CountingDataLoader` (or
        :class:`adaclip_torch.BatchMemoryManager`) drives the sampler; then the draws it handed
        to the loop in the main process, in order. With in-order delivery the ``k``-th batch a
        pass hands out is draw ``start + k``, where ``start`` is ``delivered`` when the pass
        began (:meth:`begin_pass` rewinds ``position`` there: draws prefetched and never handed
        out are discarded — their randomness was never used by a release, and the next draw
        takes their index, group and batch). Restored by ``load_state_dict``.
      handed: the batches handed to the loop since the sampler was built (delivered ones, or
        without a counting loader the draws), never rewound or restored: what
        :meth:`check_next` counts.
    """

    def __init__(self) -> None:
        self.position = 0
        self.delivered: int | None = None
        self.handed = 0
        self._pass = 0  # the current counted pass; a newer one supersedes it
        self._loader_drawing = 0  # > 0 while a counted pass's loader draws

    @property
    def counted(self) -> bool:
        """Whether a counting loader drives the sampler (``delivered`` is kept)."""
        return self.delivered is not None

    @property
    def consumed(self) -> int:
        """The draws the training loop has received: ``delivered`` when counted, else
        ``position`` (a loader that does not count: exact only without workers)."""
        return self.position if self.delivered is None else self.delivered

    def attach(self) -> None:
        """A counting loader drives the sampler from now on: draws count when handed out."""
        if self.delivered is None:
            self.delivered = self.position

    def take(self) -> int:
        """The index of the draw the sampler is making (``position``, then advanced). Refused
        for a counted sampler drawn outside its counting loader: those batches would reach the
        loop uncounted, and the optimizer could not tell which draw a step releases."""
        if self.delivered is not None and not self._loader_drawing:
            raise InvalidHyperparameterError(
                "this sampler is driven by a loader that counts the batches it hands to the training loop "
                "(poisson_data_loader, make_private's loader, CountingDataLoader or "
                "adaclip_torch.BatchMemoryManager): iterate that loader, not the sampler itself or another "
                "loader over it (Opacus's BatchMemoryManager is one: use adaclip_torch.BatchMemoryManager), so "
                "that every step can be checked against the batch it releases"
            )
        index = self.position
        self.position += 1
        if self.delivered is None:
            self.handed += 1  # no counting loader: a draw is all that is known of a hand-out
        return index

    @contextmanager
    def drawing(self) -> Iterator[None]:
        """Inside: the counted pass's loader draws (its DataLoader iterator runs)."""
        self._loader_drawing += 1
        try:
            yield
        finally:
            self._loader_drawing -= 1

    def begin_pass(self) -> int:
        """A counted pass begins: ``position`` goes back to ``delivered`` (draws prefetched by an
        earlier pass and never handed out are discarded) and earlier passes are superseded.
        Returns the pass's token."""
        self.attach()
        assert self.delivered is not None
        self.position = self.delivered
        self._pass += 1
        return self._pass

    def ensure_current(self, token: int) -> None:
        """Refuse a batch from a superseded pass (its draws' indices are no longer ``start + k``)."""
        if token != self._pass:
            raise InvalidHyperparameterError(
                "this pass over the loader was superseded: a newer pass began (iter(loader) again, or "
                "BatchMemoryManager over the same sampler) or the sampler's state was loaded since; "
                "iterate one pass at a time"
            )

    def deliver(self, token: int) -> None:
        """The pass ``token`` hands its next draw to the loop."""
        self.ensure_current(token)
        assert self.delivered is not None and self.delivered < self.position
        self.delivered += 1
        self.handed += 1

    def move_to(self, position: Any) -> None:
        """Set ``position`` by hand (drawing a batch yourself: ``sampler.batch(sampler.position)``,
        then ``sampler.position += 1``): draws made outside any loader, so refused for a counted
        sampler, as :meth:`take` is."""
        if isinstance(position, bool) or not isinstance(position, int) or position < 0:
            raise InvalidHyperparameterError(f"a sampler position must be an int >= 0, got {position!r}")
        if self.delivered is not None:
            raise InvalidHyperparameterError(
                "this sampler is driven by a loader that counts the batches it hands to the training loop: "
                "its position moves with that loader (load_state_dict restores a saved one)"
            )
        self.handed += max(0, position - self.position)
        self.position = position

    def restore(self, position: int) -> None:
        """A saved state is loaded: the loop has received ``position`` draws; live passes end.
        ``handed`` is not restored (it counts hand-outs in this process)."""
        self.position = position
        if self.delivered is not None:
            self.delivered = position
        self._pass += 1

    def check_step(self, step: int, *, what: str) -> None:
        """Banded and BLT noise: refuse step ``step`` unless the batch it releases is draw
        ``step``, i.e. the loop has received exactly ``step + 1`` draws. Changes nothing.

        Raises :class:`InvalidGradientError` for a step without a new batch (a batch stepped
        twice, batches from another loader, or a sampler whose state was not restored with the
        optimizer's) and for a batch not stepped (skipped; without a counting loader, also
        batches that DataLoader workers drew ahead)."""
        got = self.consumed
        if got < step + 1:
            raise InvalidGradientError(
                f"step {step} with {what}, but the training loop has received only {got} batch(es) from the "
                "sampler: each batch of the loader the optimizer was built with is stepped exactly once, in "
                "order, and step t releases draw t. Causes: a batch stepped twice; batches from another loader "
                "(iterate the loader that make_private or poisson_data_loader returned: 'model, optimizer, "
                "loader = make_private(...)'); after restoring the optimizer from a checkpoint, a sampler whose "
                "state was not restored with it (loader.batch_sampler.load_state_dict(...)). Nothing was changed"
            )
        if got > step + 1:
            self._refuse_skip(f"step {step} with {what}", got - step - 1)

    def check_next(self, handed_before: int, *, what: str) -> None:
        """Independent noise (no schedule): refuse a step unless exactly one batch was handed to
        the loop since the previous step (``handed_before``: :attr:`handed` then). Changes
        nothing; raises :class:`InvalidGradientError` as :meth:`check_step` does."""
        new = self.handed - handed_before
        if new < 1:
            raise InvalidGradientError(
                f"a step with {what}, but the training loop has received no new batch from the sampler since "
                "the previous step: each batch of the loader the optimizer was built with is stepped exactly "
                "once. Causes: a batch stepped twice; batches from another loader (iterate the loader that "
                "make_private or poisson_data_loader returned: 'model, optimizer, loader = make_private(...)', "
                "not your own). Nothing was changed"
            )
        if new > 1:
            self._refuse_skip(f"a step with {what}", new - 1)

    def _refuse_skip(self, where: str, skipped: int) -> None:
        if self.counted:
            raise InvalidGradientError(
                f"{where}, but the loader has handed {skipped} batch(es) more to the training loop than were "
                "stepped: a batch was skipped (call step() for every batch, with empty_batch=True for an empty "
                "one). The releases would no longer follow the sampler's draws. Nothing was changed"
            )
        raise InvalidGradientError(
            f"{where}, but the sampler has drawn {skipped} batch(es) more than were stepped: a batch was "
            "skipped (call step() for every batch, with empty_batch=True for an empty one), or a DataLoader "
            "with workers (num_workers > 0) drew batches ahead of the loop. With workers build the loader with "
            "poisson_data_loader(...) or CountingDataLoader(dataset, batch_sampler=sampler, ...), which count "
            "the batches handed to the loop. Nothing was changed"
        )


def draw_counter(sampler: Any) -> DrawCounter | None:
    """The :class:`DrawCounter` of one of this module's samplers (``None`` for any other)."""
    counter = getattr(sampler, "draws", None)
    return counter if isinstance(counter, DrawCounter) else None


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

    :attr:`draws` counts the batches drawn and, through a :class:`CountingDataLoader`, those the
    loop received: an optimizer given this sampler (``sampler=``) checks every step against it.
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
        self.draws = DrawCounter()

    @property
    def position(self) -> int:
        """The batches drawn so far (carried over from pass to pass)."""
        return self.draws.position

    @property
    def expected_batch_size(self) -> float:
        """``B̄ = q·N``."""
        return self.sample_rate * self.num_samples

    def __len__(self) -> int:
        return self.num_steps

    def state_dict(self) -> dict[str, Any]:
        """The generator state, the batches the loop received and the indices of a subset: save it
        with the optimizer to resume the same batches (:meth:`DrawCounter.consumed`; draws
        prefetched by workers and not handed out are not resumed)."""
        return {
            "generator_state": self.generator.get_state().clone(),
            "position": self.draws.consumed,
            **_indices_state(self.indices),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        position = _saved_position(state, required=False)
        _check_indices_state(state, self.indices)
        self.generator.set_state(state["generator_state"])
        self.draws.restore(position)

    def __iter__(self) -> Iterator[list[int]]:
        for _ in range(self.num_steps):
            self.draws.take()
            mask = torch.rand(self.num_samples, generator=self.generator) < self.sample_rate
            yield _dataset_indices(mask.nonzero(as_tuple=True)[0], self.indices)


def _saved_position(state: Any, *, required: bool = True) -> int:
    """The ``position`` of a saved sampler state, checked (``0`` when absent and not required:
    a :class:`PoissonBatchSampler` state saved before it was kept)."""
    if not isinstance(state, dict):
        raise InvalidHyperparameterError(f"a sampler state must be a dict, got {type(state).__name__}")
    position = state.get("position", None if required else 0)
    if isinstance(position, bool) or not isinstance(position, int) or position < 0:
        raise InvalidHyperparameterError(f"the saved sampler position must be an int >= 0, got {position!r}")
    return position


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
    cycling across epochs; every batch it yields must be stepped exactly once
    (``optimizer.step()``, also for an empty batch) — the optimizer checks that step ``t``
    releases draw ``t`` (:meth:`DrawCounter.check_step`). With DataLoader workers iterate it
    through a :class:`CountingDataLoader` (:func:`poisson_data_loader` returns one), which
    counts the batches handed to the loop.

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
        self._inner = PoissonBatchSampler(num_samples, sample_rate, num_steps, generator, indices=indices)
        self.group_rate = accounted_sample_rate(self._inner.sample_rate, bands)
        self.bands = int(bands)
        self.draws = DrawCounter()
        # b = 1: no assignment is drawn, so the draws are PoissonBatchSampler's
        self.groups = (
            None if self.bands == 1
            else torch.randint(0, self.bands, (num_samples,), generator=self._inner.generator)
        )

    @property
    def position(self) -> int:
        """``t``: the batches drawn so far; the next one samples group ``t mod b``."""
        return self.draws.position

    @position.setter
    def position(self, value: int) -> None:
        self.draws.move_to(value)

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
        """Generator state, group assignment and position (the batches the loop received,
        :meth:`DrawCounter.consumed`): save it with the optimizer to resume the same batches (as
        secret as the data's sampling)."""
        return {
            "generator_state": self.generator.get_state().clone(),
            "groups": None if self.groups is None else self.groups.clone(),
            "position": self.draws.consumed,
            **_indices_state(self.indices),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_indices_state(state, self.indices)
        groups = state.get("groups")
        if (groups is None) != (self.groups is None) or (
            groups is not None and tuple(groups.shape) != tuple(self.groups.shape)  # type: ignore[union-attr]
        ):
            raise InvalidHyperparameterError("the saved sampler state is for another number of bands or units")
        position = _saved_position(state)
        self.generator.set_state(state["generator_state"])
        self.groups = None if groups is None else groups.clone()
        self.draws.restore(position)

    def __iter__(self) -> Iterator[list[int]]:
        for _ in range(self.num_steps):
            t = self.draws.take()
            mask = torch.rand(self.num_samples, generator=self.generator) < self.group_rate
            if self.groups is not None:
                mask &= self.groups == t % self.bands
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
    next; every batch it yields must be stepped exactly once (``optimizer.step()``), which the
    optimizer checks as it does for :class:`CyclicPoissonBatchSampler` (with DataLoader workers
    through a :class:`CountingDataLoader`).

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
        self.draws = DrawCounter()

    @property
    def position(self) -> int:
        """``t``: the batches drawn so far; the next one is batch ``t mod b``."""
        return self.draws.position

    @position.setter
    def position(self, value: int) -> None:
        self.draws.move_to(value)

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
        """Order and position (the batches the loop received) and the indices of a subset: save it
        with the optimizer to resume the same batches."""
        return {"order": self.order.clone(), "position": self.draws.consumed, **_indices_state(self.indices)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        position = _saved_position(state)
        _check_indices_state(state, self.indices)
        order = state.get("order")
        if not isinstance(order, torch.Tensor) or tuple(order.shape) != (self.num_samples,) or not torch.equal(
            torch.sort(order).values, torch.arange(self.num_samples)
        ):
            raise InvalidHyperparameterError("the saved order is not a permutation of this sampler's units")
        self.order = order.clone()
        self.draws.restore(position)

    def __iter__(self) -> Iterator[list[int]]:
        for _ in range(self.num_batches):
            yield self.batch(self.draws.take())


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
    :attr:`expected_batch_size` ``= q·U`` (users, not examples). Give the optimizer this sampler
    (``sampler=``) and it knows the run is user level: a step or accumulation without
    ``user_ids`` (each example clipped on its own, so a user with ``k`` examples would move the
    release by ``k·C`` while the accountant counts users) is refused before anything changes,
    and each step is checked to release the next batch (:class:`DrawCounter`; with DataLoader
    workers iterate it through a :class:`CountingDataLoader`).

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
    def draws(self) -> DrawCounter:
        """The users' sampler's :class:`DrawCounter` (one draw per step)."""
        return self._user_sampler.draws

    @property
    def position(self) -> int:
        """The batches drawn so far."""
        return self._user_sampler.position

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
    ``dataset[index]`` (give the index of a training example when training on a subset).

    A ``collate_fn`` with the attribute ``handles_empty_batch = True`` is returned as it is and
    called on empty lists too: for examples whose zero-length form cannot be read off one
    example (variable-length token lists padded by the collator, as Hugging Face's are), the
    collator decides what an empty batch is (the ``PrivateTrainer``'s collates it to ``{}``)."""
    if getattr(collate_fn, "handles_empty_batch", False):
        return collate_fn
    empty = _empty_like(dataset[index])

    def collate(batch: list[Any]) -> Any:
        return empty if len(batch) == 0 else collate_fn(batch)

    return collate


class _CountedPass:
    """One pass over a counting loader: the DataLoader iterator that ``start`` returns, run with
    the sampler's draws allowed, and each batch it hands out counted as delivered (when
    ``delivers()`` says it begins a new draw: :class:`adaclip_torch.BatchMemoryManager` hands
    out several physical batches per draw). The pass begins eagerly, as a DataLoader's does."""

    def __init__(
        self, draws: DrawCounter, start: Callable[[], Any], delivers: Callable[[], bool] | None = None
    ) -> None:
        self._draws = draws
        self._delivers = delivers
        self._token = draws.begin_pass()
        self._broken = False
        with draws.drawing():
            self._base = iter(start())

    def __iter__(self) -> _CountedPass:
        return self

    def __len__(self) -> int:
        return len(self._base)  # type: ignore[arg-type]

    def __next__(self) -> Any:
        self._draws.ensure_current(self._token)
        if self._broken:
            raise InvalidHyperparameterError(
                "this pass over the loader stopped at an error: the batch it was fetching was never "
                "handed out, so the next one would be miscounted; start a new pass (iter(loader))"
            )
        try:
            with self._draws.drawing():
                batch = next(self._base)
        except StopIteration:
            raise
        except BaseException:
            self._broken = True
            raise
        if self._delivers is None or self._delivers():
            self._draws.deliver(self._token)
        return batch


class CountingDataLoader(DataLoader):
    """A :class:`DataLoader` over one of this module's samplers that counts the batches it hands
    to the training loop, so that the optimizer can check each step against them exactly,
    DataLoader workers or not.

    The sampler (``batch_sampler``) advances its :attr:`DrawCounter.position` as it draws — with
    workers, in the main process, ahead of the loop by what the workers prefetch. This loader
    adds one to :attr:`DrawCounter.delivered` as it hands each batch to the loop, and a
    DataLoader hands out batches in the order they were drawn (``in_order=True``, the default;
    ``False`` is refused with workers), so the batch in the loop's hands is draw
    ``delivered − 1``, and the optimizer requires exactly one delivered batch per step (banded
    and BLT noise: step ``t`` with ``delivered = t + 1``): no batch skipped, none stepped twice,
    including the last ones of a run. A new pass
    (``iter(loader)``) begins where the loop stopped: draws the workers fetched and never handed
    out are discarded (nothing computed from them was released, so drawing afresh in their place
    keeps the sampling exactly that of the sampler; the next draw takes their index, group and
    batch), and an older pass still in progress is refused from then on.

    Once a counting loader drives a sampler, drawing from the sampler another way (iterating it,
    or another DataLoader over it) is refused. :func:`poisson_data_loader` and
    :func:`adaclip_torch.make_private` return one; build one yourself for a sampler of your own
    making (e.g. :class:`PoissonUserBatchSampler`, :class:`FixedOrderBatchSampler`):
    ``CountingDataLoader(dataset, batch_sampler=sampler, num_workers=2,
    collate_fn=empty_batch_collate(dataset))``.
    """

    def __init__(self, dataset: Dataset, batch_sampler: Any, **loader_kwargs: Any) -> None:
        draws = draw_counter(batch_sampler)
        if draws is None:
            raise InvalidHyperparameterError(
                "CountingDataLoader counts the draws of this module's samplers (PoissonBatchSampler, "
                "CyclicPoissonBatchSampler, FixedOrderBatchSampler, PoissonUserBatchSampler), got "
                f"{type(batch_sampler).__name__}"
            )
        for key in ("batch_size", "shuffle", "sampler", "drop_last"):
            if key in loader_kwargs:
                raise InvalidHyperparameterError(f"the sampler chooses the batches; do not pass {key}")
        if int(loader_kwargs.get("num_workers") or 0) > 0 and loader_kwargs.get("in_order", True) is False:
            raise InvalidHyperparameterError(
                "in_order=False with workers hands batches out in the order the workers finish them, not the "
                "order they were drawn: the batch in the loop's hands could not be told apart, and a cyclic or "
                "fixed-order schedule would be broken. Keep in_order=True (the default)"
            )
        super().__init__(dataset, batch_sampler=batch_sampler, **loader_kwargs)
        draws.attach()
        self._draws = draws

    def __iter__(self) -> _CountedPass:  # type: ignore[override]
        return _CountedPass(self._draws, super().__iter__)


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
) -> CountingDataLoader:
    """A :class:`DataLoader` over ``dataset`` with Poisson batches of rate ``sample_rate``.

    ``loader_kwargs`` go to :class:`DataLoader` (``num_workers``, ``pin_memory``, ...);
    ``batch_size``, ``shuffle``, ``sampler`` and ``drop_last`` are not allowed (the sampler
    decides). Empty batches come out as zero-length tensors. ``bands > 1``: cyclic Poisson
    sampling (:class:`CyclicPoissonBatchSampler`), for banded correlated noise.

    ``indices``: train on these examples of ``dataset`` only (distinct dataset indices): the
    ``N`` units are them, the expected batch is ``q·len(indices)``, and the batches are their
    dataset indices (``None``: the whole data set, ``N = len(dataset)``).

    The loader is a :class:`CountingDataLoader`: it counts the batches it hands to the loop, so
    an optimizer given its sampler (``sampler=loader.batch_sampler``) checks every step against
    them exactly, with workers too (``in_order=False`` is refused with workers).
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
        sampler = CyclicPoissonBatchSampler(
            num_samples, sample_rate, bands, num_steps=num_steps, generator=generator, indices=ids
        )
    # the empty batch's shapes come from a training example (none outside the training set is read)
    collate = empty_batch_collate(dataset, collate_fn or default_collate, index=0 if ids is None else int(ids[0]))
    return CountingDataLoader(dataset, batch_sampler=sampler, collate_fn=collate, **loader_kwargs)


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
