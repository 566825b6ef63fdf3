"""The optimizer's correlated-noise stream: banded or BLT noise on top of :class:`NoiseSource`.

**BLT** (:class:`adaclip.correlated.BltNoise`): the stream holds the ``m`` buffers ``s_j``
(``m·d`` numbers) and computes ``x_t = z_t − Σ_j ω_j s_j``, ``s_j ← θ_j s_j + x_t``. The
sampler must be :class:`adaclip_torch.data.FixedOrderBatchSampler` (min separation ``b`` = its
batches per epoch); there is no amplification: at the first step of each block of ``b`` steps
the accountant records one Gaussian event at rate 1 with noise multiplier
``σ/√(S(t_end) − S(t_start))`` (:mod:`adaclip.accounting._min_separation`: the events compose to
the Gaussian mechanism ``σ/Δ_t`` of every prefix). Buffers and checkpoints follow banded noise's
rules below; a restore without buffers restarts the factor and its accounting at that step.

Banded noise:

:class:`NoiseStream` turns the generator's fresh standard normals ``z_t`` into the banded noise
``x_t`` of :class:`adaclip.correlated.mechanism.BandedNoise` (the core's maths; this module only
holds its state for one optimizer), and says at which steps the accountant records a
composition. The privacy argument is the core's: with cyclic Poisson sampling
(:class:`adaclip_torch.data.CyclicPoissonBatchSampler`, same ``b``) the run is ``⌈T/b⌉``
compositions of the Poisson-subsampled Gaussian at rate ``p = b·q``. The stream records one at
the first step of each cycle of ``b`` steps — before that cycle's first release, so the
accountant is never behind what was released.

The buffers (the last ``b − 1`` noise vectors) are as secret as the generator's state: from
them and the releases, past clipped sums follow exactly. They are saved in a checkpoint only
when the generator's state is (an explicit ``seed``: experiments, bit-for-bit resumption).
Otherwise a restored optimizer starts a new stream — empty buffers, and a new accounting cycle
at its next step, so the steps after the restore are accounted on their own (conservative: at
most one composition more than an uninterrupted run).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from adaclip.accounting.keeper import Cycle
from adaclip.correlated.contract import NoiseAccounting, NoiseFamily, NoiseStreamState
from adaclip.correlated.mechanism import resolve_noise_mechanism
from adaclip.errors import InvalidHyperparameterError
from adaclip_torch.data import (
    CyclicPoissonBatchSampler,
    FixedOrderBatchSampler,
    PoissonBatchSampler,
    PoissonUserBatchSampler,
)

__all__ = ["NoiseStream", "check_poisson_sampler", "make_noise_mechanism", "MATRIX_MIN_BANDS"]

#: Banded noise with at least this many bands keeps its buffers as one matrix and correlates with
#: one matrix-vector product (:meth:`NoiseStream.correlate`); fewer bands use the per-band loop.
MATRIX_MIN_BANDS = 16


def make_noise_mechanism(
    noise_mechanism: Any, bands: Any, *, buffers: Any = None, sampler: Any = None
) -> NoiseFamily | None:
    """``None`` for independent noise (DP-SGD), else the :class:`~adaclip.correlated.BandedNoise`,
    :class:`~adaclip.correlated.BltNoise` or other noise family asked for (the core's
    :func:`adaclip.correlated.resolve_noise_mechanism`;
    one band stays banded here, with the cyclic sampler's draws equal to Poisson sampling's).
    ``"blt"`` is fitted for the sampler's ``total_steps`` and batches per epoch."""
    if isinstance(noise_mechanism, str) and noise_mechanism == "blt":
        _check_blt_sampler(sampler)
        return resolve_noise_mechanism(
            "blt", bands, buffers=buffers, steps=sampler.total_steps, min_separation=sampler.num_batches
        )
    return resolve_noise_mechanism(noise_mechanism, bands, buffers=buffers)


def _check_blt_sampler(sampler: Any) -> None:
    if not isinstance(sampler, FixedOrderBatchSampler):
        what = type(sampler).__name__ if sampler is not None else "no sampler"
        raise InvalidHyperparameterError(
            f"BLT noise needs fixed-order batches, got {what}: its accounting (no amplification, "
            "min-separation participation) holds only when every unit is in one fixed batch visited once "
            "per epoch; a shuffling loader or Poisson sampling can put a unit in two steps closer than an "
            "epoch. Pass sampler=FixedOrderBatchSampler(N, batch_size, generator=..., total_steps=T) "
            "(the loader's batch_sampler)"
        )


def _cyclic_poisson(sampler: Any, mechanism: NoiseFamily, sample_rate: float | None) -> Any:
    """The cyclic Poisson sampler over the family's groups (user level: the users' sampler)."""
    groups = mechanism.sampler_requirement.groups
    sampler = getattr(sampler, "cyclic_sampler", None) or sampler  # user level: the users' sampler
    if not isinstance(sampler, CyclicPoissonBatchSampler):
        what = type(sampler).__name__ if sampler is not None else "no sampler"
        raise InvalidHyperparameterError(
            f"{mechanism.family} noise needs cyclic Poisson sampling, got {what}: a shuffling loader or plain "
            "Poisson sampling lets a unit join two steps less than b apart, which the banded "
            f"accounting does not cover. Pass sampler=CyclicPoissonBatchSampler(N, q, bands={groups}) "
            "(the loader's batch_sampler; poisson_data_loader(..., bands=b) builds it), or use "
            "make_private(..., noise_mechanism='banded')"
        )
    if sampler.bands != groups:
        raise InvalidHyperparameterError(
            f"the sampler cycles over {sampler.bands} groups but the noise has {groups} bands: they must agree"
        )
    _same_rate(sampler.sample_rate, sample_rate, "sampler's sample_rate")
    return sampler


def _fixed_order(sampler: Any, mechanism: NoiseFamily, sample_rate: float | None) -> Any:
    """The fixed-order sampler (its batches per epoch are the separation the accounting assumes)."""
    _check_blt_sampler(sampler)
    _same_rate(sampler.sample_rate, sample_rate, "sampler's batch fraction", " (batch_size/N)")
    return sampler


def _poisson(sampler: Any, mechanism: NoiseFamily, sample_rate: float | None) -> Any:
    """A Poisson sampler at the optimizer's rate (:func:`check_poisson_sampler`)."""
    check_poisson_sampler(sampler, sample_rate)
    return sampler


def _same_rate(rate: float, sample_rate: float | None, what: str, note: str = "") -> None:
    if sample_rate is not None and abs(rate - sample_rate) > 1e-12 * max(1.0, sample_rate):
        optimizer = "optimizer's sample_rate" if note else "optimizer's"
        raise InvalidHyperparameterError(f"the {what} {rate!r}{note} differs from the {optimizer} {sample_rate!r}")


#: The PyTorch samplers for each participation pattern a noise family may require
#: (:attr:`adaclip.correlated.contract.NoiseFamily.sampler_requirement`): each check returns the
#: sampler the stream follows, or raises naming the sampler to use.
_SAMPLER_CHECKS = {"poisson": _poisson, "cyclic_poisson": _cyclic_poisson, "fixed_order": _fixed_order}


def check_poisson_sampler(sampler: Any, sample_rate: Any) -> None:
    """With independent noise (DP-SGD) the accountant records Poisson sampling at rate ``q`` at
    every step: the sampler given (``sampler=``) must be that sampling —
    :class:`~adaclip_torch.data.PoissonBatchSampler`, a
    :class:`~adaclip_torch.data.PoissonUserBatchSampler` without bands, or a
    :class:`~adaclip_torch.data.CyclicPoissonBatchSampler` with one band (the same draws) — at
    the optimizer's ``sample_rate``. Cyclic sampling with ``b > 1`` and fixed-order batches are
    other events (refused: use their noise mechanisms)."""
    poisson = (
        isinstance(sampler, PoissonBatchSampler)
        or (isinstance(sampler, PoissonUserBatchSampler) and sampler.cyclic_sampler is None)
        or (isinstance(sampler, CyclicPoissonBatchSampler) and sampler.bands == 1)
    )
    if not poisson:
        raise InvalidHyperparameterError(
            f"independent noise is accounted as Poisson sampling at every step, got sampler "
            f"{type(sampler).__name__}{f' with bands={sampler.bands}' if hasattr(sampler, 'bands') else ''}: "
            "pass a PoissonBatchSampler or PoissonUserBatchSampler (the loader's batch_sampler), or the "
            "noise mechanism this sampler is for (noise_mechanism='banded' with a cyclic sampler, 'blt' "
            "with fixed-order batches)"
        )
    _same_rate(sampler.sample_rate, sample_rate, "sampler's sample_rate")


def _coordinates(shard: Any) -> str:
    """What a saved or live stream's buffers cover, for the error messages."""
    if shard is None:
        return "every coordinate (noise state on one rank)"
    rank, world, start, end = tuple(shard)[:4]
    return f"coordinates {start}..{end} (rank {rank} of {world}, sharded noise state)"


class NoiseStream:
    """Correlated noise for one optimizer: buffers, accounting cycle, the sampler it needs.

    Everything that depends on the noise family comes from the family
    (:class:`adaclip.correlated.contract.NoiseFamily`): the sampler it needs, its accounting
    (:attr:`accounting`: the cycle, the rate and the noise multiplier of each record) and its
    checkpoint rule. This class holds the stream's state for one optimizer and computes the
    banded and BLT recursions with fused kernels (held to the family's own method by the tests);
    another family runs through its :meth:`~adaclip.correlated.contract.NoiseFamily.correlate`.

    Args:
      mechanism: the noise family: the core's :class:`BandedNoise`, :class:`BltNoise` or another
        :class:`~adaclip.correlated.contract.NoiseFamily` (:attr:`kind` is its ``family``).
      sample_rate: ``q`` (the overall rate); the accountant records the family's rate (banded:
        ``p = b·q``; BLT: 1, no amplification, and ``q`` must then be the sampler's ``batch_size/N``).
      sampler: the sampler the family's :attr:`~adaclip.correlated.contract.NoiseFamily.sampler_requirement`
        names: banded: the :class:`~adaclip_torch.data.CyclicPoissonBatchSampler` that draws the
        batches (same ``b``, same ``q``); BLT: the
        :class:`~adaclip_torch.data.FixedOrderBatchSampler`; Poisson: a Poisson sampler
        (:func:`check_poisson_sampler`). The optimizer checks every step against its draws
        (:meth:`adaclip_torch.data.DrawCounter.check_step`).
    """

    def __init__(self, mechanism: NoiseFamily, *, sample_rate: float | None, sampler: Any) -> None:
        self.mechanism = mechanism
        #: the family's name: ``"banded"``, ``"blt"``, …
        self.kind: str = mechanism.family
        self._size = int(mechanism.size)  # read on every correlate: kept, not recomputed
        #: sharded noise state (data parallel): the slice of coordinates this rank's stream
        #: correlates (:class:`adaclip_torch.distributed.NoiseShard`); ``None``: all of them
        self.shard: Any = None
        self._state: NoiseStreamState = mechanism.init()
        self._pending: NoiseStreamState | None = None
        # banded buffers as one matrix (see _correlate_ring): the matrix, the history whose
        # entries are its rows' views (and the step it is for), each row's views, the step
        # awaiting commit
        self._ring: Tensor | None = None
        self._ring_history: Any = None
        self._ring_step = -1
        self._row_views: list[tuple[Tensor, ...]] = []
        self._ring_pending: tuple[Tensor, int] | None = None
        requirement = mechanism.sampler_requirement
        check = _SAMPLER_CHECKS.get(requirement.participation)
        if check is None:
            raise InvalidHyperparameterError(
                f"{self.kind} noise needs {requirement.participation!r} participation, which no PyTorch "
                f"sampler provides (known: {', '.join(sorted(_SAMPLER_CHECKS))})"
            )
        self.sampler = check(sampler, mechanism, sample_rate)
        #: whether step ``t`` must release draw ``t`` (cyclic groups, fixed batches); with Poisson
        #: sampling there is no schedule, only one new batch per step
        self.indexed = requirement.participation != "poisson"
        separation = int(self.sampler.num_batches) if requirement.participation == "fixed_order" else None
        #: the family's accounting for this sampler (:class:`adaclip.correlated.contract.NoiseAccounting`)
        self.accounting: NoiseAccounting = mechanism.accounting(self.sampler.sample_rate, separation=separation)
        self.accounted_rate = self.accounting.rate
        #: which steps the accountant records: the first of each of the family's cycles, counted
        #: from the step at which the current stream began (``cycle_start``)
        self.cycles = Cycle(self.accounting.cycle)

    @property
    def bands(self) -> int:
        """The family's order (:attr:`~adaclip.correlated.contract.NoiseFamily.size`): banded
        ``b``, BLT the number of buffers ``m``."""
        return self._size

    @property
    def cycle(self) -> int:
        """The steps per accounting cycle (banded ``b``; BLT the min separation)."""
        return self.cycles.length

    @property
    def cycle_start(self) -> int:
        """The optimizer step at which the current stream (and its accounting cycle) began."""
        return self.cycles.start

    def accounted_noise_multiplier(self, noise_multiplier: float, step: int) -> float:
        """The noise multiplier the accountant records at a step that opens a cycle (``cycles.records_at``): the
        family's (:meth:`~adaclip.correlated.contract.NoiseAccounting.noise_multiplier`) for
        the cycle that ``step`` opens, counted from the stream's start — banded ``σ``; BLT
        ``σ/√(S(t_1) − S(t_0))`` for the block ``[t_0, t_1)``, so the events compose to the
        Gaussian mechanism ``σ/Δ_{t_1}`` of everything released up to ``t_1``."""
        return self.accounting.noise_multiplier(noise_multiplier, step - self.cycle_start)

    def correlate(self, z: Sequence[Tensor]) -> list[Tensor]:
        """``x_t`` from this step's fresh draws; the new buffers are pending until :meth:`commit`.

        The core's recursion (:meth:`adaclip.correlated.BandedNoise.correlate`, which the tests
        hold this to on the same draws), computed in place: one fused multiply-add per band over
        all tensors (``torch._foreach_add_``), no temporaries, so the cost is the ``(b − 1)·d``
        reads of the buffers."""
        if self.kind == "blt":
            return self._correlate_blt(z)
        if self.kind != "banded" or self.bands == 1:  # the family's own recursion
            x, self._pending = self.mechanism.correlate(self._state, z)
            return x
        if self._ring_applies(z):
            return self._correlate_ring(z)
        c = self.mechanism.coefficients
        x = [zk.clone() for zk in z]
        for j, past in enumerate(self._state.history, start=1):
            torch._foreach_add_(x, list(past), alpha=-c[j])
        torch._foreach_div_(x, c[0])
        history = ((*x,), *self._state.history)[: self.bands - 1]
        self._pending = NoiseStreamState(history=tuple(history), step=self._state.step + 1)
        return x

    # ---------------------------------------------------------------- banded buffers as one matrix
    #
    # The b − 1 buffers live as the rows of one (b − 1, D) matrix (D: every coordinate of the
    # step's draws, concatenated), x_u in row u mod (b − 1). The correlation is then one
    # matrix-vector product, x_t = z_t/c_0 − (Σ_j c_j x_{t−j})/c_0 = addmv(z, Xᵀ, w), which reads
    # each buffer once; the per-band loop reads the running sum and a buffer and writes the sum
    # back for every band (three times the memory traffic). The row of each buffer is fixed by
    # its step, so a stream restored from a checkpoint sums in the same order as the run that
    # saved it (bit-for-bit resumption). The history the rest of the stream sees (checkpoints,
    # shards) holds views of the rows. A released step's x_t is copied into its row at commit,
    # so a discarded step leaves every buffer as it was.

    def _ring_applies(self, z: Sequence[Tensor]) -> bool:
        """One matrix for the buffers: banded noise with ``b ≥`` :data:`MATRIX_MIN_BANDS`, every
        draw of one floating dtype and device. Below that the per-band loop is as fast: its
        running sum stays in cache, so it too reads each buffer from memory about once, and the
        matrix's bookkeeping (concatenating the draws, copying the release into its row) costs
        about what it saves (``benchmarks/correlated_cost.py --loop``)."""
        if self.bands < MATRIX_MIN_BANDS or not z:
            return False
        first = z[0]
        return all(t.dtype == first.dtype and t.device == first.device for t in z)

    def _ring_for(self, z: Sequence[Tensor]) -> Tensor:
        """The buffer matrix holding this stream's history (built from the history when the
        history is not already its rows: the first step, or after a restore)."""
        ring = getattr(self, "_ring", None)
        size = sum(t.numel() for t in z)
        if (
            ring is not None
            and self._ring_history is self._state.history
            and self._ring_step == self._state.step
            and ring.shape[1] == size
            and ring.dtype == z[0].dtype
            and ring.device == z[0].device
        ):
            return ring
        rows = self.bands - 1
        ring = z[0].new_zeros((rows, size))
        step = self._state.step
        for j, past in enumerate(self._state.history):  # history[j] is x_{step-1-j}
            torch.cat([t.reshape(-1) for t in past], out=ring[(step - 1 - j) % rows])
        self._ring, self._row_views = ring, []
        for row in ring:
            views, start = [], 0
            for t in z:
                views.append(row[start : start + t.numel()].view(t.shape))
                start += t.numel()
            self._row_views.append(tuple(views))
        self._state = NoiseStreamState(history=self._ring_views(step), step=step)
        self._ring_history, self._ring_step = self._state.history, step
        return ring

    def _ring_views(self, step: int) -> tuple[tuple[Tensor, ...], ...]:
        """The history of a stream at ``step`` as views of the buffer matrix's rows (most recent
        first; each row's views are made once, with the matrix)."""
        rows = self.bands - 1
        return tuple(self._row_views[(step - 1 - j) % rows] for j in range(min(step, rows)))

    def _correlate_ring(self, z: Sequence[Tensor]) -> list[Tensor]:
        ring = self._ring_for(z)
        c, rows, step = self.mechanism.coefficients, self.bands - 1, self._state.step
        flat_z = torch.cat([t.reshape(-1) for t in z]) if len(z) > 1 else z[0].reshape(-1)
        used = min(step, rows)
        if used:
            weights = [0.0] * rows
            for j in range(1, used + 1):  # x_{step-j} sits in row (step - j) mod rows
                weights[(step - j) % rows] = c[j]
            w = torch.tensor(weights, dtype=ring.dtype).to(ring.device, non_blocking=True)
            flat = torch.addmv(flat_z, ring.t(), w, beta=1.0 / c[0], alpha=-1.0 / c[0])
        else:
            flat = flat_z / c[0]
        x, start = [], 0
        for t in z:
            x.append(flat[start : start + t.numel()].view(t.shape))
            start += t.numel()
        history = ((*x,), *self._state.history)[:rows]
        self._pending = NoiseStreamState(history=tuple(history), step=step + 1)
        self._ring_pending = (flat, step)
        return x

    def _commit_ring(self) -> None:
        """Copy the released ``x_t`` into its row; the history becomes views of the rows."""
        flat, step = self._ring_pending
        self._ring_pending = None
        self._ring[step % (self.bands - 1)].copy_(flat)
        self._state = NoiseStreamState(history=self._ring_views(step + 1), step=step + 1)
        self._ring_history, self._ring_step = self._state.history, step + 1

    def _correlate_blt(self, z: Sequence[Tensor]) -> list[Tensor]:
        """The core's BLT recursion (:meth:`adaclip.correlated.BltNoise.correlate`) with fused
        multiply-adds over all tensors: ``x = z − Σ_j ω_j s_j``; the new buffers ``θ_j s_j + x``
        are new tensors (pending until :meth:`commit`; the old ones are left as they are)."""
        mech = self.mechanism
        x = [zk.clone() for zk in z]
        for w, buf in zip(mech.omega, self._state.history, strict=False):
            torch._foreach_add_(x, list(buf), alpha=-w)
        if self._state.history:
            history = []
            for th, buf in zip(mech.theta, self._state.history, strict=True):
                new = torch._foreach_mul(list(buf), th)
                torch._foreach_add_(new, x)
                history.append(tuple(new))
        else:
            history = [tuple(t.clone() for t in x) for _ in mech.theta]
        self._pending = NoiseStreamState(history=tuple(history), step=self._state.step + 1)
        return x

    def advance(self) -> None:
        """The step is released with noise another process drew and correlated (data parallel:
        rank 0 holds the buffers that matter): move the stream's position like :meth:`correlate`
        does, so :meth:`variance` and the cycle agree on every rank; the buffers stay as they are
        (pending until :meth:`commit`)."""
        self._pending = NoiseStreamState(history=self._state.history, step=self._state.step + 1)

    def variance(self) -> float:
        """``v_t`` of the step being released (per coordinate)."""
        return self.mechanism.variance(self._state.step)

    def commit(self) -> None:
        """The step was released: its noise joins the buffers."""
        if self._pending is not None:
            if self._ring_pending is not None and self._ring_history is self._state.history:
                self._pending = None
                self._commit_ring()
                return
            self._state, self._pending = self._pending, None

    def discard(self) -> None:
        """The step was not released: forget its noise (the generator rewinds or moves on)."""
        self._pending = None
        self._ring_pending = None

    # ---------------------------------------------------------------- checkpoints

    def state_dict(
        self, *, with_buffers: bool, padded_to: tuple[Sequence[tuple[int, ...]], Tensor] | None = None
    ) -> dict[str, Any]:
        """Bands, cycle start and stream position; the buffers only with ``with_buffers`` (when
        the generator's state is saved too).

        ``padded_to`` (data parallel: the privatised tensors' shapes, and a tensor of the
        buffers' dtype and device): the buffer list always has its full length (``b − 1``, BLT:
        ``m``), the slots the stream has not filled yet zero tensors of the buffers' shapes, and ``"buffers_used"`` says how many are real. So a
        fresh optimizer's state dict has the layout of any later one — what
        ``torch.distributed.checkpoint`` loads into (it fills the tensors a template holds)."""
        buffers = [[t.detach().clone() for t in x] for x in self._state.history] if with_buffers else None
        padding = {}
        if buffers is not None and padded_to is not None:
            shapes, like = padded_to
            shapes = [(self.shard.size,)] if self.shard is not None else [tuple(sh) for sh in shapes]
            full = self.mechanism.state_size
            padding = {"buffers_used": len(buffers)}
            buffers += [[like.new_zeros(sh) for sh in shapes] for _ in range(full - len(buffers))]
        return {
            **self.mechanism.checkpoint_tag(),
            "cycle_start": self.cycle_start,
            "stream_step": self._state.step,
            "buffers": buffers,
            **padding,
            **({} if self.shard is None else {"shard": tuple(self.shard)}),
        }

    def load_state_dict(self, state: Any, *, steps: int, shapes: Sequence[tuple[int, ...]]) -> None:
        """Restore a :meth:`state_dict` saved at optimizer step ``steps``. Without buffers the
        stream restarts: empty buffers and a new cycle at step ``steps``. All checked first
        (:meth:`parse_state`), nothing changes on a refusal."""
        self.apply_state(self.parse_state(state, steps=steps, shapes=shapes))

    def parse_state(
        self, state: Any, *, steps: int, shapes: Sequence[tuple[int, ...]]
    ) -> tuple[NoiseStreamState, int]:
        """Validate a saved stream (``None``: restart at ``steps``); returns what
        :meth:`apply_state` installs."""
        if state is None:
            return self.mechanism.init(), steps
        tag = self.mechanism.checkpoint_tag()
        if not isinstance(state, dict) or any(state.get(k) != v for k, v in tag.items()):
            key = list(tag)[-1]  # the tag's last entry is the family's order
            raise InvalidHyperparameterError(
                f"state_dict's noise stream is for {state.get(key) if isinstance(state, dict) else state!r} "
                f"{self.mechanism.size_label}, this optimizer has {self.kind} noise with {self.bands}"
            )
        buffers = state.get("buffers")
        if buffers is None:
            return self.mechanism.init(), steps
        saved_shard = state.get("shard")
        here = None if self.shard is None else tuple(self.shard)
        if (None if saved_shard is None else tuple(saved_shard)) != here:
            raise InvalidHyperparameterError(
                f"state_dict's noise buffers hold {_coordinates(saved_shard)}, this optimizer's stream holds "
                f"{_coordinates(here)}: "
                "with sharded noise state every rank saves and loads its own state_dict (one file per rank), on the "
                "same number of ranks; its seeded generator and buffers belong to that rank alone (loading another "
                "rank's would draw that rank's noise a second time). To restart the stream instead, load a "
                "checkpoint made without seed= (no buffers: a new cycle, accounted from its first step)"
            )
        if self.shard is not None:
            shapes = [(self.shard.size,)]
        cycle_start, stream_step = state.get("cycle_start"), state.get("stream_step")
        for name, v in (("cycle_start", cycle_start), ("stream_step", stream_step)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise InvalidHyperparameterError(f"state_dict's noise stream {name} must be an int >= 0, got {v!r}")
        if "buffers_used" in state:  # padded to the full length (data parallel, see state_dict)
            used, full = state["buffers_used"], self.mechanism.state_size
            if isinstance(used, bool) or not isinstance(used, int) or not isinstance(buffers, list) or not (
                0 <= used <= len(buffers) == full
            ):
                raise InvalidHyperparameterError("state_dict's noise stream does not match its step count")
            buffers = buffers[:used]
        if (
            cycle_start > steps
            or not isinstance(buffers, list)
            or len(buffers) != self.mechanism.saved_buffers(stream_step)
        ):
            raise InvalidHyperparameterError("state_dict's noise stream does not match its step count")
        history = []
        for x in buffers:
            if (
                not isinstance(x, (list, tuple))
                or len(x) != len(shapes)
                or any(not isinstance(t, Tensor) or tuple(t.shape) != tuple(sh) for t, sh in zip(x, shapes, strict=True))
            ):
                raise InvalidHyperparameterError("state_dict's noise buffers have the wrong shapes")
            if not all(bool(torch.isfinite(t).all()) for t in x):
                raise InvalidHyperparameterError("state_dict's noise buffers are not finite")
            history.append(tuple(t.clone() for t in x))
        return NoiseStreamState(history=tuple(history), step=stream_step), cycle_start

    def apply_state(self, parsed: tuple[NoiseStreamState, int]) -> None:
        self._state, start = parsed
        self.cycles.restart(start)
        self._pending = None
        self._ring_pending = None  # the buffer matrix is rebuilt from the restored history
