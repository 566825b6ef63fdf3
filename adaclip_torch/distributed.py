"""Data-parallel private steps over ``torch.distributed``: noise added exactly once.

With ``R`` ranks, rank ``r`` clips its own units and forms its clipped sum ``S_r`` (in
w-space, :func:`adaclip.strategies.clip_and_sum`). The released sum must be

.. math::  \\sum_r S_r + σ z,\\qquad z \\sim N(0, I_d)\\ \\text{drawn once}.

Choice: **rank 0 adds σz to its own sum before a single SUM all-reduce**; the other ranks add
nothing. Then every rank holds the same ``Σ_r S_r + σz`` and calls
:func:`adaclip.strategies.release` with ``noise=None`` (so no second draw) and the same σ (so
the AdaCliP variance correction ``b²σ²/B̄²`` is still subtracted). Why this rather than every
rank drawing the same ``z`` from a shared seed:

* the noise variance is exactly σ² (one draw), not ``R·σ²`` and not split;
* one collective instead of two, and no seed to keep in sync across ranks;
* ranks other than 0 never learn ``z``, so none of them can subtract it from the release to
  recover the other ranks' exact clipped sum (with a shared seed every rank could);
* secure mode works unchanged: only rank 0's OS randomness is used.

**Sharded noise state** (banded or BLT correlated noise, the default there: ``noise_sharding``):
rank ``r`` owns a contiguous slice of the flattened gradient's coordinates
(:func:`noise_shard`), draws that slice's standard normals from its own generator
(:func:`rank_seed` of the seed and the rank, or the OS), correlates them with its own buffers
and adds ``σ·x`` to its sum there before the same single all-reduce
(:func:`sharded_noisy_all_reduce`). Each coordinate still gets exactly one draw, by one owner,
and the banded recursion (like BLT's) acts coordinate by coordinate, so the release is the same
mechanism; each rank holds ``(b − 1)·d/R`` buffer numbers (BLT: ``m·d/R``) instead of rank 0
holding all of them. Checkpoints keep each rank's generator and buffers under its own key
(:mod:`adaclip_torch.checkpoint`), so one file per rank and ``torch.distributed.checkpoint``
both restore them on the same number of ranks. The
price: each rank knows its slice's noise, and so the other ranks' clipped sums there (the
ranks of one job are one trust domain; rank 0 alone knew everything before).

A strategy that releases auxiliary sums with the gradient (the quantile rule's count) appends
them to ``S_r`` as 0-d entries: they are all-reduced with the rest and rank 0 adds
``σ_aux·z`` to them while the tensors get ``σ_g·z``, both from
``strategy.noise_multipliers(σ, B̄)``; :func:`adaclip.strategies.release` then adds nothing
(``noise=None``) and is told the accounted ``σ`` (it derives ``σ_g`` for the variance
correction itself).

All ranks then apply identical updates, provided they started from identical parameters and
optimizer states (as with DDP). ``expected_batch_size`` is the *global* B̄ (all ranks); the
sample rate ``q`` is the global one as well. Every rank must call ``step()`` the same number
of times (the all-reduce is a collective), also on steps where its local batch is empty
(``step(empty_batch=True)``), and an error raised on one rank before the all-reduce (e.g. NaN
gradients) leaves the others waiting in it: fail all ranks together.

Usage: initialise the process group, build the same model on every rank (same seed), and wrap
its optimizer with ``distributed=True``; do *not* also wrap the model in
``DistributedDataParallel`` (its gradient all-reduce would be wasted: ``p.grad`` is replaced
by the released gradient)::

    import torch._dynamo                     # before init_process_group: see Teardown
    dist.init_process_group("gloo")          # or "nccl"
    opt = AdaClip(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=1.0,
                  expected_batch_size=global_expected_batch, distributed=True)
    loss_fn(model(x_local), y_local).backward(); opt.step(); opt.zero_grad()
    ...
    dist.destroy_process_group()

Teardown: ``destroy_process_group()`` must actually free the group, so that its backend's
threads are joined while the interpreter is still alive. In torch 2.13 it does not if the process
imports ``torch._dynamo`` only after ``init_process_group`` — which building the first
``torch.optim`` optimizer does: dynamo imports ``torch.distributed.nn.functional``, whose
functions keep ``group.WORLD`` as a default argument evaluated at import. The gloo threads then
run into interpreter shutdown, and one that releases a collective's tensor there (which needs the
GIL) is ended by Python with ``pthread_exit`` inside a C++ destructor: the process aborts
(SIGABRT, "terminate called without an active exception") after its work is done, at random and
mostly on a loaded machine. Importing ``torch._dynamo`` before ``init_process_group`` (as above)
avoids it; ``weakref.ref(dist.group.WORLD)`` taken after init is dead once the group is freed.

FSDP2 (``torch.distributed.fsdp.fully_shard``), for models whose parameters, gradients and
optimizer state outgrow one device: shard the model with ``fully_shard`` (each block, then the
root), build the wrapped optimizer over ``model.parameters()`` (the sharded DTensors) and wrap it
with ``distributed=True``; the wrapper detects the sharded parameters (:attr:`DPOptimizer.fsdp
<adaclip_torch.optimizer.DPOptimizer.fsdp>`)::

    for block in model.blocks: fully_shard(block)
    fully_shard(model)
    opt = FlatClip(torch.optim.AdamW(model.parameters(), lr=1e-3), model, max_grad_norm=1.0,
                   noise_multiplier=1.0, expected_batch_size=global_expected_batch, distributed=True)

What happens in a step, and why it is the same mechanism as above:

* **Per-example norms of the full parameter.** During forward and backward FSDP2 registers the
  *unsharded* parameters on the modules; the grad-sample hooks see this rank's examples, the
  layer's full input and full output gradient, so what they form — the per-example gradients
  ``(n_r, *p.shape)`` of a materialised layer, or the ghost norms and ``Σ_i c_i g_i`` of a ghost
  layer (:mod:`adaclip_torch.ghost`) — is that of the *full* parameter, independent of how it is
  sharded, and is stored on the sharded parameter the optimizer holds
  (``p.grad_sample``; ``p.shape`` of a DTensor is the full shape). Each unit's norm therefore
  spans every coordinate of every privatised tensor, exactly as without sharding: the rank that
  holds example ``i`` clips all of ``g_i`` to sensitivity 1, and no other rank sees it.
* **Noise once.** Rank ``r``'s clipped sum ``S_r`` has full size; ``Σ_r S_r + σz`` is formed by
  :func:`noisy_all_reduce` exactly as for data parallelism — rank 0 alone draws ``z`` (one
  standard normal per coordinate of the full vector, the same draws as a single process), one
  SUM all-reduce over the world — so every coordinate gets exactly one draw of scale ``σ``. Every
  rank then computes the same full release (and the same strategy state) from it, and writes
  only its own shard into the DTensor's ``.grad`` (:func:`shard_of`): the shards are disjoint
  sub-vectors of one release, i.e. post-processing of it, and together they are the release.
* **No raw gradient.** FSDP2's backward still reduce-scatters (and averages) the ordinary
  gradient into ``p.grad``; the step *replaces* ``p.grad`` of every privatised parameter by its
  shard of the release (never adds to it), so nothing of the raw gradient reaches the wrapped
  optimizer. (On the ghost path the weights' raw gradients are not even formed.)
* **Accounting** is unchanged: each rank's accountant records the global ``(q, σ)`` once per
  step; ``expected_batch_size`` and ``sample_rate`` are the global ones.

FSDP's all-gathers are collectives too: every rank runs forward and backward at every step, also
on an empty local batch (``step(empty_batch=True)`` without a forward pass would leave the other
ranks waiting in FSDP's all-gather).

Memory per rank: the parameters, FSDP's raw gradients and the wrapped optimizer's state stay
sharded. The mechanism itself holds, transiently during ``step()``, a full-size clipped sum of
every privatised tensor (``d`` coordinates in the statistics dtype), the flat all-reduce
buffer (another ``d``) and the full release (``d``) before its shard is copied out; the
strategy's state is full size on every rank (AdaCliP's per-coordinate mean and scale: ``2d``
persistent; flat, per-layer, quantile and automatic clipping: none). Materialised layers also
hold ``n_r`` full-size per-example gradients (as without FSDP); the ghost path
(``per_sample_mode="auto"``/``"ghost"``) avoids them for linear and embedding layers. So FSDP2
here pays when parameters, Adam moments and activations are what outgrow a device, and a few
``d``-sized vectors still fit.

Refused, with the way out: FSDP1 (``FullyShardedDataParallel``: use ``fully_shard``); FSDP2
without ``distributed=True``; a model whose privatised parameters are partly sharded and partly
plain tensors (apply ``fully_shard`` to the root too), or sharded other than FSDP2's default
``Shard(0)`` on a one-dimensional mesh spanning the whole world (HSDP meshes,
``shard_placement_fn``, tensor parallelism). Banded and BLT correlated noise work with FSDP2
with their state sharded over the ranks (:func:`sharded_noisy_all_reduce`), and ``averaging=`` averages
each rank's parameter shards (:mod:`adaclip_torch.averaging`). The fused kernels are off with
``distributed=True`` anyway.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from adaclip.errors import AdaClipError, InvalidHyperparameterError
from adaclip_torch.noise import NoiseSource

__all__ = [
    "NoiseShard",
    "noise_shard",
    "noisy_all_reduce",
    "rank_seed",
    "sharded_noisy_all_reduce",
    "require_process_group",
    "flatten",
    "unflatten",
    "is_sharded",
    "check_fsdp",
    "refuse_fsdp1",
    "full_template",
    "shard_of",
]


def require_process_group() -> None:
    """Raise :class:`AdaClipError` unless ``torch.distributed`` is initialised (checked before a
    step changes anything: once the noisy all-reduce starts, the step counts as released)."""
    if not (dist.is_available() and dist.is_initialized()):
        raise AdaClipError("distributed=True needs torch.distributed to be initialised (init_process_group)")


def flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One contiguous 1-d tensor of all entries (for one all-reduce instead of one per tensor)."""
    return torch.cat([t.reshape(-1) for t in tensors])


def unflatten(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    out, start = [], 0
    for t in like:
        out.append(flat[start : start + t.numel()].view_as(t))
        start += t.numel()
    return out


def noisy_all_reduce(
    summed: list[torch.Tensor],
    noise: NoiseSource,
    noise_multiplier: float | Sequence[float],
    *,
    correlate: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None = None,
) -> list[torch.Tensor]:
    """``Σ_r S_r + σ ⊙ z`` on every rank, with ``z`` drawn by rank 0 only.

    ``summed`` is this rank's clipped sum: the K per-tensor sums, then any auxiliary 0-d sums
    (the quantile rule's count); it is not modified. ``noise_multiplier`` is one multiplier
    for every entry, or one per entry: ``σ_g`` for the K tensors and ``σ_aux`` for the
    auxiliary entries (``strategy.noise_multipliers(σ, B̄)``), so the released pair is
    ``(Σ_r S_r + σ_g z_g, Σ_r A_r + σ_aux z_a)`` — what
    :func:`adaclip.strategies.release` would add locally. Rank 0 draws one standard normal per
    entry (the same draws, in the same order, as a single process), only if some multiplier
    is positive. ``correlate`` (banded correlated noise): rank 0 passes its standard-normal
    draws through it (``z_t ↦ x_t`` with its noise buffers) before scaling them, so the banded
    noise, like the independent one, is drawn and added once, by one rank.
    """
    require_process_group()
    if isinstance(noise_multiplier, (int, float)):
        multipliers = [float(noise_multiplier)] * len(summed)
    else:
        multipliers = [float(m) for m in noise_multiplier]
        if len(multipliers) != len(summed):
            raise ValueError(f"{len(multipliers)} noise multipliers for {len(summed)} summed entries")
    flat = flatten(summed).clone()
    if dist.get_rank() == 0 and any(m > 0 for m in multipliers):
        draws = noise.standard_normal(summed)
        if correlate is not None:
            draws = correlate(draws)
        # in place, one tensor at a time: no d-sized copies of σz on rank 0 (the same sums,
        # element by element, as adding the flattened σz)
        for piece, m, z in zip(unflatten(flat, summed), multipliers, draws, strict=True):
            piece.add_((m * z).reshape(piece.shape))
        del draws
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    return unflatten(flat, summed)


# --------------------------------------------------------------------------- sharded noise state


class NoiseShard(NamedTuple):
    """The coordinates whose noise this rank draws and correlates: ``[start, end)`` of the
    flattened gradient (the privatised tensors in order), out of ``total``."""

    rank: int
    world: int
    start: int
    end: int
    total: int

    @property
    def size(self) -> int:
        return self.end - self.start


def noise_shard(total: int, rank: int, world: int) -> NoiseShard:
    """Rank ``rank``'s contiguous slice of ``total`` coordinates: ``⌈total/world⌉`` each, the
    last ones shorter (``torch.chunk``'s split), an empty slice past the end. The slices of the
    ranks are disjoint and cover every coordinate once."""
    per = -(-total // world)
    start = min(rank * per, total)
    return NoiseShard(rank, world, start, min(start + per, total), total)


def rank_seed(seed: int, rank: int) -> int:
    """The noise seed of rank ``rank`` under sharded noise state: one 63-bit integer derived from
    ``(seed, rank)`` (NumPy's ``SeedSequence``), so that no two ranks draw from the same stream
    (the same stream on two slices would put the same noise on two coordinates, and their
    difference would reveal the clipped sums without noise)."""
    import numpy as np

    return int(np.random.SeedSequence(entropy=int(seed), spawn_key=(int(rank),)).generate_state(1, np.uint64)[0] >> 1)


def sharded_noisy_all_reduce(
    summed: list[torch.Tensor],
    noise: NoiseSource,
    *,
    num_tensors: int,
    sigma_grad: float,
    sigma_aux: float,
    shard: NoiseShard,
    correlate: Callable[[list[torch.Tensor]], list[torch.Tensor]],
    advance: Callable[[], None],
) -> list[torch.Tensor]:
    """``Σ_r S_r + σ_g·x`` on every rank, each coordinate's correlated noise ``x`` drawn and
    correlated by the one rank that owns it (sharded noise state).

    Rank ``r`` draws fresh standard normals for its slice ``[start, end)`` of the flattened
    gradient (:func:`noise_shard`) from its own generator (:func:`rank_seed`, or the OS),
    passes them through ``correlate`` — its stream, whose buffers hold only that slice, so the
    ``(b − 1)·d`` buffer numbers are split over the ranks — and adds ``σ_g·x`` to its own sum
    at those coordinates before one SUM all-reduce. Every coordinate then gets exactly one
    draw, from one stream, and the release is the banded mechanism's: the recursion
    ``x_t = (z_t − Σ_j c_j x_{t−j})/c_0`` acts coordinate by coordinate, so running it on
    disjoint slices with independent ``z`` is running it on the whole vector. Rank 0 adds the
    auxiliary sums' fresh noise (``σ_aux``; the quantile rule's count). A rank with an empty
    slice only moves its stream's position (``advance``), as does every rank when ``σ_g = 0``.

    What a rank can learn: the noise of its own slice, hence the other ranks' clipped sums on
    those coordinates (with the noise on rank 0, rank 0 could learn all of them). The ranks
    of one job are one trust domain; what leaves the job is the release, as before."""
    require_process_group()
    flat = flatten(summed).clone()
    if sigma_grad > 0 and shard.size > 0:
        (z,) = noise.standard_normal([flat.new_empty((shard.size,))])
        (x,) = correlate([z])
        flat[shard.start : shard.end] += sigma_grad * x.to(flat.dtype)
    else:
        advance()
    if shard.rank == 0 and sigma_aux > 0 and len(summed) > num_tensors:
        aux = noise.standard_normal(summed[num_tensors:])
        flat[shard.total :] += sigma_aux * flatten(aux).to(flat.dtype)
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    return unflatten(flat, summed)


# --------------------------------------------------------------------------- FSDP2


def _dtensor_type() -> type | None:
    """``torch.distributed.tensor.DTensor`` if that module was imported (no parameter can be a
    DTensor otherwise), else ``None``: nothing is imported here."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def is_sharded(p: torch.Tensor) -> bool:
    """Whether ``p`` is a DTensor (an FSDP2-sharded parameter)."""
    dtensor = _dtensor_type()
    return dtensor is not None and isinstance(p, dtensor)


def refuse_fsdp1(model: nn.Module) -> None:
    """Raise :class:`InvalidHyperparameterError` if ``model`` contains an FSDP1
    ``FullyShardedDataParallel`` module: it flattens the parameters of a whole wrapped module into
    one sharded buffer, so neither the per-example hooks nor the sharded gradient can be mapped
    to the model's parameters."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    fsdp1 = getattr(fsdp, "FullyShardedDataParallel", None)
    if fsdp1 is None:
        return
    wrapped = [name or "<root>" for name, m in model.named_modules() if isinstance(m, fsdp1)]
    if wrapped:
        raise InvalidHyperparameterError(
            f"model contains FSDP1 FullyShardedDataParallel module(s) ({', '.join(wrapped[:3])}), which "
            "flatten the parameters into sharded buffers that the private step cannot map back: shard the "
            "model with FSDP2 instead (torch.distributed.fsdp.fully_shard on each block, then on the root) "
            "and wrap its optimizer with distributed=True"
        )


def _local_chunk(full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s piece of ``full`` split on dim 0 the way FSDP2 shards: ``torch.chunk``
    into ``world`` pieces (``⌈d_0/world⌉`` rows each, the last ones shorter), and an empty piece
    for a rank past the last chunk. FSDP2 pads the shards internally to equal size, but the
    DTensor's local tensor and its ``.grad`` are the unpadded pieces."""
    chunks = torch.chunk(full, world, dim=0)
    if rank < len(chunks):
        return chunks[rank]
    return full.new_empty((0, *full.shape[1:]))


def check_fsdp(params: Sequence[torch.Tensor], names: Sequence[str], *, distributed: bool) -> bool:
    """Whether the privatised ``params`` are FSDP2-sharded (then every one must be), checked
    before any hook is attached; raises :class:`InvalidHyperparameterError` naming the way out:

    * sharded parameters without ``distributed=True`` (each rank would release its own noise);
    * sharded and plain parameters mixed (a module outside every ``fully_shard``);
    * a placement other than FSDP2's default ``(Shard(0),)`` on a one-dimensional device mesh
      that spans the world (HSDP, ``shard_placement_fn``, tensor parallelism), or a local shard
      that is not the ``torch.chunk`` piece :func:`shard_of` writes.
    """
    sharded = [is_sharded(p) for p in params]
    if not any(sharded):
        return False
    if not distributed:
        raise InvalidHyperparameterError(
            "the model's parameters are FSDP2-sharded DTensors (torch.distributed.fsdp.fully_shard): pass "
            "distributed=True, so that each rank clips its own examples, the clipped sums are all-reduced, "
            "rank 0 alone adds the noise and every rank writes its shard of the one release "
            "(expected_batch_size and sample_rate are then the global ones)"
        )
    if not all(sharded):
        plain = [n for n, s in zip(names, sharded, strict=True) if not s]
        raise InvalidHyperparameterError(
            f"mixed sharding: parameter(s) {', '.join(map(repr, plain[:3]))} are plain tensors while others are "
            "FSDP2-sharded DTensors; apply fully_shard to the root module too (after its blocks), so that every "
            "trainable parameter is sharded the same way"
        )
    require_process_group()
    from torch.distributed.tensor import Shard

    world = dist.get_world_size()
    for name, p in zip(names, params, strict=True):
        mesh, placements = p.device_mesh, tuple(p.placements)  # type: ignore[attr-defined]
        if mesh.ndim != 1 or mesh.size() != world or placements != (Shard(0),):
            raise InvalidHyperparameterError(
                f"parameter {name!r} is sharded as {placements} on a {mesh.ndim}-d device mesh of {mesh.size()} "
                f"rank(s) (world size {world}); FSDP2 with the private step supports only fully_shard's "
                "default: Shard(0) on a one-dimensional mesh spanning every rank (no HSDP mesh, "
                "shard_placement_fn or tensor parallelism)"
            )
        local = p.to_local()  # type: ignore[attr-defined]
        expected = _local_chunk(torch.empty(p.shape, device="meta"), mesh.get_local_rank(), world)
        if tuple(local.shape) != tuple(expected.shape):
            raise InvalidHyperparameterError(
                f"parameter {name!r}: the local shard has shape {tuple(local.shape)}, not the torch.chunk piece "
                f"{tuple(expected.shape)} of {tuple(p.shape)} that FSDP2 shards with; its layout is not supported"
            )
    return True


def full_template(p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A plain zero tensor of ``p``'s full shape on its device (for a DTensor, the full shape
    and the local device): what the strategy state of a sharded parameter is shaped like (the
    state is full size on every rank, see the module doc)."""
    return torch.zeros(tuple(p.shape), dtype=dtype, device=p.device)


def shard_of(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """This rank's shard of the full released gradient ``full``, as a DTensor laid out like
    the sharded ``param`` (its mesh, ``Shard(0)``, full shape and stride), in ``param``'s dtype.
    No communication: every rank holds the same ``full``. The shard is a copy, so the full-size
    release is freed once the step is over."""
    from torch.distributed.tensor import DTensor

    mesh = param.device_mesh  # type: ignore[attr-defined]
    local = param.to_local()  # type: ignore[attr-defined]
    piece = _local_chunk(full, mesh.get_local_rank(), mesh.size())
    piece = piece.to(dtype=local.dtype, device=local.device, copy=True).contiguous()
    return DTensor.from_local(
        piece, mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()  # type: ignore[attr-defined]
    )
