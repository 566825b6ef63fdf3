"""Cyclic Poisson sampling as jittable masks, the sampling banded correlated noise needs.

Every unit is assigned once, independently and uniformly at random, to one of ``b`` groups
(:func:`assign_groups`); step ``t`` samples only group ``t mod b``, each of its units
independently with probability ``p = b·q`` (:func:`cyclic_poisson_mask`). The expected batch
stays ``q·N``, and a unit joins at most one step in any ``b`` consecutive ones, which is what
lets banded noise be accounted as ``⌈T/b⌉`` compositions of the Poisson-subsampled Gaussian
at rate ``p`` (:mod:`adaclip.correlated.mechanism`; :class:`adaclip_jax.PrivacyTracker` with
``bands=b``). The assignment must be independent per unit (not an equal split) for add/remove
adjacency, and the same assignment must serve the whole run.

The mask is a boolean ``(N,)`` array over all units: pass it as ``unit_mask=`` to the private
transformation's ``update`` (the per-unit gradients of all ``N`` units: a static shape), or
use it to gather the batch in the data pipeline. ``step`` must be the step the release is
made at (the private state's ``step``): a skipped or repeated step shifts the groups against
the noise's bands.

The sampling key and the assignment are as secret as the data sampling of plain Poisson
sampling, and independent of the noise key (use a separate key).

**Fixed shapes without the whole data set** (:func:`padded_batch`, :func:`batch_buckets`).
Computing every unit's gradient and masking all but the batch costs ``N`` gradients a step.
Instead, the sampled units' indices are gathered into an array of a fixed size ``M`` (a
*bucket*) with a mask marking the real rows: the jitted step then runs on ``M`` rows, ``M`` a
little above ``q·N``, and compiles once per bucket. Padding is free in privacy: the padded rows
are masked out of the clipped sum (``unit_mask=``), so the release is that of the Poisson batch
exactly. No unit is ever dropped. The bucket is the smallest one that holds the batch, and the
last bucket is ``N`` (never truncated): truncating a Poisson batch would change the mechanism,
which the accountant does not record. A few buckets a few standard deviations above ``q·N``
(:func:`batch_buckets`) keep the compilations few; larger batches fall through to the next
bucket, and to ``N`` with a probability below ``10⁻⁹`` by default.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp

from adaclip.errors import InvalidHyperparameterError

__all__ = ["assign_groups", "batch_buckets", "cyclic_poisson_mask", "padded_batch"]


def _static_positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise InvalidHyperparameterError(f"{name} must be a positive int (static), got {value!r}")
    return int(value)


def assign_groups(key: Any, num_units: int, bands: int) -> jax.Array:
    """The group of each of ``num_units`` units: an int32 ``(num_units,)`` array of
    independent uniform draws in ``[0, bands)`` from ``key`` (all zeros for ``bands = 1``,
    drawing nothing). ``num_units`` and ``bands`` are static Python ints; jittable. Draw it
    once per run and keep it (secret, like the sampling key)."""
    n = _static_positive_int("num_units", num_units)
    b = _static_positive_int("bands", bands)
    if b == 1:
        return jnp.zeros((n,), jnp.int32)
    return jax.random.randint(key, (n,), 0, b, dtype=jnp.int32)


def cyclic_poisson_mask(key: Any, step: Any, groups: Any, group_rate: Any, *, bands: int) -> jax.Array:
    """The boolean ``(N,)`` mask of the units sampled at step ``step``.

    Unit ``i`` is in when ``groups[i] == step mod bands`` and an independent uniform draw is
    below ``group_rate``. The draws of step ``t`` use ``jax.random.fold_in(key, t)``, so one
    sampling key serves the whole run (the mask of a step is a function of ``key``, ``step``
    and ``groups`` only).

    Args:
      key: the sampling key (secret; not the noise key).
      step: the step index (an int or an int array, traced under ``jit``): the private state's
        ``step`` of the release that uses the mask.
      groups: the ``(N,)`` group assignment from :func:`assign_groups` (same ``bands``).
      group_rate: ``p = b·q`` in ``(0, 1]``, the rate within the step's group
        (:attr:`adaclip_jax.PrivacyTracker.accounted_sample_rate`); the expected batch is
        ``q·N``, what the transformation's ``expected_batch_size`` must be.
      bands: ``b`` (static), the noise's number of bands.

    With ``bands = 1`` this is plain Poisson sampling at rate ``q = group_rate``:
    ``jax.random.uniform(fold_in(key, step), (N,)) < q`` (``groups`` is then ignored apart from
    its shape). Jittable.
    """
    b = _static_positive_int("bands", bands)
    groups = jnp.asarray(groups)
    if groups.ndim != 1 or not jnp.issubdtype(groups.dtype, jnp.integer):
        raise InvalidHyperparameterError(
            f"groups must be an int (N,) array from assign_groups, got shape {groups.shape} and dtype {groups.dtype}"
        )
    if isinstance(group_rate, (int, float)) and not isinstance(group_rate, bool):
        if not (math.isfinite(group_rate) and 0 < group_rate <= 1):
            raise InvalidHyperparameterError(f"group_rate must be in (0, 1], got {group_rate!r}")
    if isinstance(step, (int, numbers.Integral)) and not isinstance(step, bool) and step < 0:
        raise InvalidHyperparameterError(f"step must be >= 0, got {step!r}")
    step = jnp.asarray(step)
    mask = jax.random.uniform(jax.random.fold_in(key, step), groups.shape) < group_rate
    if b > 1:
        mask = mask & (groups == (step % b).astype(groups.dtype))
    return mask


def batch_buckets(expected_batch_size: float, num_units: int, *, spread: int = 6) -> tuple[int, ...]:
    """The fixed batch sizes :func:`padded_batch` pads to: ``B̄ + k·s`` for ``k = 1 … spread``,
    with ``s = ⌈√B̄⌉`` rounded up to a multiple of 8 (a Poisson batch's standard deviation is at
    most ``√B̄``), capped at ``num_units``, then ``num_units`` itself. With the default
    ``spread = 6`` a batch exceeds the largest bucket below ``N`` with probability under about
    ``10⁻⁹``. Public quantities only."""
    if not (isinstance(expected_batch_size, (int, float)) and math.isfinite(expected_batch_size)
            and expected_batch_size > 0):  # fmt: skip
        raise InvalidHyperparameterError(f"expected_batch_size must be > 0, got {expected_batch_size!r}")
    n = _static_positive_int("num_units", num_units)
    k = _static_positive_int("spread", spread)
    step = 8 * math.ceil(math.ceil(math.sqrt(expected_batch_size)) / 8)
    base = math.ceil(expected_batch_size)
    sizes = sorted({min(n, base + i * step) for i in range(1, k + 1)} | {n})
    return tuple(sizes)


@jax.jit
def _sampled_count(mask: jax.Array) -> jax.Array:
    return jnp.sum(mask, dtype=jnp.int32)


def _gather(mask: jax.Array, size: int) -> tuple[jax.Array, jax.Array]:
    (indices,) = jnp.nonzero(mask, size=size, fill_value=0)
    valid = jnp.arange(size) < jnp.sum(mask)
    return indices.astype(jnp.int32), valid


_gather_jit = jax.jit(_gather, static_argnums=1)


def padded_batch(
    key: Any, step: Any, groups: Any, group_rate: Any, *, bands: int, buckets: tuple[int, ...]
) -> tuple[jax.Array, jax.Array]:
    """The units sampled at ``step`` as ``(indices, unit_mask)`` of a fixed size from ``buckets``.

    The same units as :func:`cyclic_poisson_mask` (same ``key``, ``step``, ``groups``,
    ``group_rate``, ``bands``; with ``bands = 1`` plain Poisson sampling), in increasing index
    order, padded with index 0 to the smallest bucket that holds them; ``unit_mask`` is ``True``
    on the real rows. Gather the batch with the indices (``x[indices]``) and pass the mask as
    ``unit_mask=`` to the private transformation's ``update``: the padded rows then contribute
    nothing, and the release is that of the Poisson batch. Called on the host (it reads the
    batch's size to choose the bucket: one small device-to-host transfer per step); the
    jitted training step compiles once per bucket used.

    Args:
      key, step, groups, group_rate, bands: as for :func:`cyclic_poisson_mask`.
      buckets: the sizes to pad to, increasing, the last one ``N`` (:func:`batch_buckets`).

    Raises:
      InvalidHyperparameterError: ``buckets`` not increasing positive ints ending at ``N`` (a
        batch larger than every bucket would have to be truncated, which is not accounted).
    """
    groups = jnp.asarray(groups)
    sizes = tuple(buckets) if isinstance(buckets, (tuple, list)) else None
    if (not sizes or any(isinstance(m, bool) or not isinstance(m, numbers.Integral) or m < 1 for m in sizes)
            or list(sizes) != sorted(set(sizes)) or sizes[-1] != groups.shape[0]):  # fmt: skip
        raise InvalidHyperparameterError(
            f"buckets must be increasing positive ints ending at N = {groups.shape[0]} (no batch is ever "
            f"truncated: that would change the mechanism), got {buckets!r}; use batch_buckets(q * N, N)"
        )
    mask = cyclic_poisson_mask(key, step, groups, group_rate, bands=bands)
    count = int(_sampled_count(mask))
    size = next(m for m in sizes if m >= count)
    return _gather_jit(mask, int(size))
