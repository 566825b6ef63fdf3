"""Banded correlated noise in the JAX transformations (``noise_mechanism="banded"``).

The maths and the privacy argument are :mod:`adaclip.correlated.mechanism`; this module adapts
them to a jitted optax update. The gradient's independent draws ``z_t`` (:mod:`adaclip_jax._keys`)
become ``x_t = (z_t − Σ_{j=1}^{b−1} c_j x_{t−j})/c_0`` with the last ``b − 1`` noise vectors kept
in ``AdaClipState.noise_buffers`` (:func:`_correlate`, fixed shapes under ``jit``); AdaCliP's
statistics subtract the noise variance ``σ_g²·v_t`` from a table computed once at construction
(:func:`_variance_table`). Also the checks banded noise needs: what it does not support
(:func:`_check_banded`), buffers that fit the parameters (:func:`_check_buffers`) and one σ for
the whole run (:func:`_same_sigma`, :func:`_refuse_other_sigma`, :func:`_other_sigma_guard`).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from adaclip.correlated.blt import refuse_blt
from adaclip.correlated.mechanism import BandedNoise, NoiseStreamState, resolve_noise_mechanism
from adaclip.errors import InvalidGradientError, InvalidHyperparameterError

#: Bounds on the length of the per-step noise-variance table of banded noise (see
#: :func:`_variance_table`): 1 024 entries at least, 65 536 at most (256 KB in float32).
_VARIANCE_TABLE_MIN = 1 << 10
_VARIANCE_TABLE_MAX = 1 << 16
#: The table is long enough when ``v_t`` four times further on exceeds its last entry by at most
#: this (relative to ``max(1, v)``).
_VARIANCE_TABLE_TOL = 1e-7


def _noise_mechanism(noise_mechanism: Any, bands: Any) -> BandedNoise | None:
    """``None`` for independent noise, else the :class:`adaclip.correlated.BandedNoise` asked
    for (:func:`adaclip.correlated.resolve_noise_mechanism`). One band is DP-SGD: ``None`` too,
    so the transformation is today's, draw for draw and state for state."""
    refuse_blt(noise_mechanism, where="the JAX transformations")
    mechanism = resolve_noise_mechanism(noise_mechanism, bands)
    if mechanism is not None and not isinstance(mechanism, BandedNoise):
        raise InvalidHyperparameterError(
            f"the JAX transformations add independent or banded noise; {mechanism.family!r} noise "
            f"({type(mechanism).__name__}) is available in PyTorch (adaclip_torch) only"
        )
    return None if mechanism is None or mechanism.bands == 1 else mechanism


def _check_banded(mechanism: BandedNoise | None, sigma_default: Any, axis_name: Any, use_kernel: Any) -> None:
    """What banded noise does not support (yet), refused before anything is built.

    Data parallelism (``axis_name``) is supported: the key and the buffers are replicated
    state, so every device draws the same ``z_t`` and computes the same ``x_t`` from the same
    buffers, and the noise (like the independent noise) is added once to the ``psum``-ed sum."""
    if mechanism is None:
        return
    why = (
        "a noise schedule (a callable noise_multiplier: the factorisation needs one σ for every step)"
        if callable(sigma_default) else
        "use_kernel=True (the fused kernels add independent noise)" if use_kernel is True else None
    )  # fmt: skip
    if why is not None:
        raise InvalidHyperparameterError(f"noise_mechanism='banded' does not support {why} yet")


def _variance_table(mechanism: BandedNoise) -> np.ndarray:
    """``v_0 … v_{L−1}`` (float64) of :meth:`adaclip.correlated.BandedNoise.variance`; the
    update uses ``v_{min(t, L−1)}``.

    ``v_t = Σ_{k≤t} r_k²`` is non-decreasing and converges when ``c(z)`` has no zero in the
    closed unit disc (the square-root coefficients; ``r`` then decays geometrically). ``L`` is
    the smallest power of two ``≥ max(1024, 16·b)`` with ``v_{4L−1} − v_{L−1} ≤ 1e-7·max(1, v)``,
    at most 65 536: for the square-root coefficients ``L = 1024`` up to ``b = 64`` (``v`` is
    within 1e-7 of its limit after 3 to 5·b steps, and equal to it in float64 well before step
    1024), so holding ``v_{L−1}`` beyond the table is exact to far below float32 resolution.
    Coefficients whose ``v`` does not settle by 65 536 steps warn (the statistics then subtract
    slightly too little noise variance late in the run; the noise itself, and so privacy, is
    unaffected); a ``v`` that overflows (``c(z)`` with a zero inside the unit disc: the noise
    grows without bound) is refused."""
    length = _VARIANCE_TABLE_MIN
    while length < 16 * mechanism.bands:
        length *= 2
    length = min(length, _VARIANCE_TABLE_MAX)
    while True:
        r = mechanism.inverse_coefficients(4 * length)
        with np.errstate(over="ignore", invalid="ignore"):
            v = np.cumsum(r * r)
        if not np.all(np.isfinite(v)):
            raise InvalidHyperparameterError(
                "the noise variance of these coefficients grows without bound (c(z) has a zero inside "
                "the unit disc): the noise would explode; use other coefficients"
            )
        settled = v[-1] - v[length - 1] <= _VARIANCE_TABLE_TOL * max(1.0, float(v[length - 1]))
        if settled or length >= _VARIANCE_TABLE_MAX:
            break
        length *= 2
    if not settled:
        warnings.warn(
            f"the per-step noise variance of these coefficients is still moving after {length} steps "
            f"({v[length - 1]:.6g} there, {v[-1]:.6g} at step {v.size - 1}); the statistics use "
            f"v_{length - 1} from then on (the noise itself is exact)",
            stacklevel=4,
        )
    return v[:length].copy()


def _same_sigma(sigma: Any, sigma_default: float) -> Any:
    """Whether a per-call σ is the constructor's σ up to float32 rounding (the tracker passes it
    rounded up): banded noise needs one σ for the whole run. A bool for a static σ, a traced
    bool otherwise."""
    if isinstance(sigma, (int, float)) or not isinstance(sigma, jax.core.Tracer):
        value = float(sigma) if isinstance(sigma, (int, float)) else float(np.asarray(sigma).reshape(()))
        return abs(value - sigma_default) <= 2.0**-20 * sigma_default
    s = jnp.asarray(sigma).reshape(())
    return jnp.abs(s - sigma_default) <= 2.0**-20 * sigma_default


def _check_buffers(buffers: Any, mechanism: BandedNoise | None, shapes: Sequence[tuple[int, ...]]) -> None:
    """The state's ``noise_buffers`` fit the transformation (trace-time: shapes only)."""
    if mechanism is None:
        if buffers is not None:
            raise InvalidGradientError(
                "the state carries banded-noise buffers but this transformation adds independent "
                "noise: was the state initialised by this transformation?"
            )
        return
    if buffers is None:
        raise InvalidGradientError(
            f"this transformation adds banded noise ({mechanism.bands} bands) but the state has no "
            "noise buffers: initialise the state with its init (a state of another transformation, "
            "or one saved before the buffers existed, cannot continue the stream)"
        )
    if (
        not isinstance(buffers, (tuple, list))
        or len(buffers) != mechanism.bands - 1
        or any(
            not isinstance(buf, (tuple, list)) or [tuple(jnp.shape(x)) for x in buf] != list(shapes)
            for buf in buffers
        )
    ):
        raise InvalidGradientError(
            f"the state's noise buffers do not match: expected {mechanism.bands - 1} buffers, each "
            f"with arrays of shapes {list(shapes)}: was the state initialised with these parameters?"
        )


def _refuse_other_sigma(sigma: Any, sigma_default: float) -> None:
    """Raise when a static per-call σ is not the run's σ (banded noise needs one σ throughout;
    a traced one cannot raise: :func:`_other_sigma_guard`)."""
    if _same_sigma(sigma, sigma_default) is False:
        raise InvalidHyperparameterError(
            f"banded noise needs one σ for the whole run: this call's noise_multiplier={float(sigma)!r} "
            f"is not the transformation's {sigma_default!r}"
        )


def _other_sigma_guard(noisy: list[Any], sigma: Any, sigma_default: float) -> list[Any]:
    """The release, NaN where a *traced* σ is not the run's σ: the banded argument does not
    cover it (a static one was refused already)."""
    if not isinstance(sigma, jax.core.Tracer):
        return noisy
    same = _same_sigma(sigma, sigma_default)
    return [jnp.where(same, g, jnp.full_like(g, jnp.nan)) for g in noisy]


def _correlate(
    mechanism: BandedNoise,
    variances: np.ndarray,
    step: jax.Array,
    buffers: Sequence[Sequence[Any]],
    noise: list[Any],
    num_leaves: int,
) -> tuple[list[Any], tuple[list[Any], ...], dict[str, Any]]:
    """``(noise, new buffers, extra arguments of the core's release)`` of banded noise.

    The first ``num_leaves`` draws (the gradient's) become ``x_t`` from ``z_t`` and the
    ``b − 1`` buffers (zeros before the stream's start make the first steps exact); the
    auxiliary sums keep their independent draws. The buffers are shifted (most recent first)
    and kept in their own dtypes; the release gets ``noise_variance = v_{min(t, L−1)}``.
    """
    history = tuple(
        tuple(x.astype(z.dtype) for x, z in zip(buf, noise[:num_leaves], strict=True)) for buf in buffers
    )
    x, stream = mechanism.correlate(NoiseStreamState(history=history, step=0), noise[:num_leaves])
    correlated = list(x) + noise[num_leaves:]
    new_buffers = tuple(
        [h.astype(o.dtype) for h, o in zip(hist, old, strict=True)]
        for hist, old in zip(stream.history, buffers, strict=True)
    )
    table = jnp.asarray(variances, jnp.result_type(*[z.dtype for z in noise[:num_leaves]]))
    return correlated, new_buffers, {"noise_variance": table[jnp.minimum(step, variances.size - 1)]}


