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
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from adaclip.errors import AdaClipError
from adaclip_torch.noise import NoiseSource

__all__ = ["noisy_all_reduce", "require_process_group", "flatten", "unflatten"]


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
        flat = flat + flatten([m * z for m, z in zip(multipliers, draws, strict=True)])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    return unflatten(flat, summed)
