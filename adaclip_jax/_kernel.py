"""Fused Pallas kernels for AdaCliP's elementwise path, with a pure-``jnp`` reference beside them.

Two kernels, each on one parameter leaf flattened to ``(n, P)`` (a reshape, no copy):

- :func:`sq_norms`: ``‖(g_i − a)·u‖²`` per unit (``u = 1/b``), partial sums per column tile
  (every program writes its own output block, so programs are independent), summed in ``jnp``;
  :func:`sq_norms_margin` bounds its relative rounding error, so that clip factors can be taken
  from an upper bound of the norm (rounding may over-clip, never under-clip);
- :func:`clip_noise_update`: given the clip factors ``c`` (``(n,)``), one pass over column
  tiles computes ``s = (Σ_i c_i g_i − (Σ_i c_i)·a)·u`` (the core's
  :func:`adaclip.transform.clipped_sum`), adds ``σ·z`` once, divides by ``B̄``, rescales by
  ``b``, adds ``a`` (:func:`adaclip.transform.noise_and_rescale`) and updates the moments
  (:func:`adaclip.transform.update_moments`) — the released gradient and the new ``m``/``s``
  without materialising ``(g_i − a)/b``. Rows whose clip factor is 0 are skipped (their
  entries may be NaN or inf, and ``0·NaN`` is NaN), as :func:`adaclip.transform.drop_units`
  does on the ``jnp`` path.

The ``*_reference`` functions are the same maths in plain ``jnp`` (used when ``use_kernel`` is
off). Correctness is decided against the NumPy reference (:mod:`adaclip.reference`) and the
core path in the tests; on CPU the kernels run with ``interpret=True`` (a correctness tool,
slow). Block shapes are powers of two; rows and columns that overhang the array are masked
inside the kernel (Pallas pads such loads with NaN in interpret mode, undefined on GPU).

On GPU the kernels are compiled through Pallas's **Triton** backend (``compiler_params`` below):
Pallas's default GPU backend in jax 0.10 (Mosaic GPU) rejects these block shapes at lowering.
``tests/test_jax_kernel.py`` lowers both kernels for CUDA on a CPU-only machine
(``jax.export``), which checks the Pallas→Triton lowering for several shapes. Run compiled on
an H200 (jax 0.11.2), :func:`sq_norms` agreed with its reference everywhere, but the first
version of :func:`clip_noise_update` did not for some shapes (1 or 3 rows of 5,000 columns; 64
rows of 784,000: wrong updates, NaN moments) that agreed in interpret mode: its last column
tile stored past the end of the ``(P,)`` outputs. The kernel now pads its ``(P,)`` operands and
outputs to whole tiles; rerun on the H200 it agreed with the reference on every checked shape
(``tests/test_jax_kernel.py`` compiled, ``benchmarks/kernel_bench_jax.py``), so ``"auto"``
takes the kernels on a GPU.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from adaclip import transform as _core_transform

__all__ = [
    "sq_norms",
    "sq_norms_margin",
    "sq_norms_reference",
    "clip_noise_update",
    "clip_noise_update_reference",
    "DEFAULT_BLOCK_COLS",
]

DEFAULT_BLOCK_COLS = 512
_BLOCK_ROWS = 8
# Pallas's Triton backend on GPU (ignored in interpret mode). 4 warps for tiles of 8×512.
_COMPILER_PARAMS = pltriton.CompilerParams(num_warps=4, num_stages=1)


def _row_block(n: int) -> int:
    return math.gcd(n, _BLOCK_ROWS) or 1


def _pow2_at_least(x: int) -> int:
    """Block shapes are powers of two (a Triton requirement on GPU); overhangs are masked."""
    return 1 << max(0, int(x) - 1).bit_length()


def _col_mask(j: Any, block_cols: int, num_cols: int) -> jax.Array:
    cols = j * block_cols + jax.lax.broadcasted_iota(jnp.int32, (1, block_cols), 1)
    return cols < num_cols


# --------------------------------------------------------------------------- (a) norms


def sq_norms_reference(g: jax.Array, a: jax.Array, u: jax.Array) -> jax.Array:
    """``Σ_p ((g[i,p] − a[p])·u[p])²`` for ``g`` of shape ``(n, P)``: an ``(n,)`` array."""
    w = (g - a[None, :]) * u[None, :]
    return jnp.sum(w * w, axis=1)


def sq_norms(
    g: jax.Array,
    a: jax.Array,
    u: jax.Array,
    *,
    interpret: bool = False,
    block_cols: int = DEFAULT_BLOCK_COLS,
) -> jax.Array:
    """Pallas version of :func:`sq_norms_reference` (same shapes, same dtype)."""
    n, num_cols = g.shape
    bn = _row_block(n)
    bp = min(_pow2_at_least(block_cols), _pow2_at_least(num_cols))
    n_tiles = pl.cdiv(num_cols, bp)

    def kernel(g_ref, a_ref, u_ref, o_ref):
        mask = _col_mask(pl.program_id(1), bp, num_cols)
        w = (g_ref[...] - a_ref[...]) * u_ref[...]
        w = jnp.where(mask, w, jnp.zeros_like(w))
        o_ref[...] = jnp.sum(w * w, axis=1, keepdims=True)

    partial = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((n, n_tiles), g.dtype),
        grid=(n // bn, n_tiles),
        in_specs=[
            pl.BlockSpec((bn, bp), lambda i, j: (i, j)),
            pl.BlockSpec((1, bp), lambda i, j: (0, j)),
            pl.BlockSpec((1, bp), lambda i, j: (0, j)),
        ],
        out_specs=pl.BlockSpec((bn, 1), lambda i, j: (i, j)),
        interpret=interpret,
        compiler_params=_COMPILER_PARAMS,
    )(g, a.reshape(1, num_cols), u.reshape(1, num_cols))
    return jnp.sum(partial, axis=1)


def sq_norms_margin(dtype: Any, num_cols: int, *, block_cols: int = DEFAULT_BLOCK_COLS) -> float:
    """``η`` such that the exact ``S_i = ‖(g_i − a)/b‖²`` satisfies ``S_i ≤ Ŝ_i·(1 + η)`` for
    the value ``Ŝ_i`` that :func:`sq_norms` computes in ``dtype`` with these block columns.

    :func:`sq_norms` adds the ``P`` non-negative terms of a row in ``T = ⌈P/b_p⌉`` column
    tiles of ``b_p`` terms each (inside a program: any order, relative error at most
    ``γ_{b_p} = b_p·u/(1 − b_p·u)``, with ``u`` the unit roundoff), then adds the ``T`` tile
    sums in ``jnp``, a blocked reduction whose error :func:`adaclip.transform.rounding_margin`
    bounds (that margin also covers the rounding of ``(g − a)·(1/b)``, the squares and the
    clip factor's square root and division). Relative errors of non-negative partial sums
    compound, so

    .. math::
        1 + η = (1 + γ_{b_p})·(1 + η_\\text{jnp}(T)).
    """
    bp = min(_pow2_at_least(block_cols), _pow2_at_least(num_cols))
    tiles = -(-max(1, int(num_cols)) // bp)
    x = bp * _core_transform.unit_roundoff(dtype)
    if x >= 0.5:
        raise ValueError(f"a tile of {bp} terms in {dtype} has no useful rounding bound")
    in_tile = x / (1.0 - x)
    return (1.0 + in_tile) * (1.0 + _core_transform.rounding_margin(dtype, tiles)) - 1.0


# --------------------------------------------------------------------------- (b) sum, noise, rescale, moments


def clip_noise_update_reference(
    g: jax.Array,
    c: jax.Array,
    a: jax.Array,
    b: jax.Array,
    u: jax.Array,
    z: jax.Array | None,
    std: jax.Array,
    *,
    noise_multiplier: Any,
    expected_batch_size: float,
    beta_mean: float,
    beta_std: float,
    std_min: float,
    std_max: float,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(g̃, m', s')`` for one flattened leaf (``g`` ``(n, P)``, everything else ``(P,)``).

    ``s = (Σ_i c_i g_i − (Σ c)·a)·u``; ``g̃ = b·(s + σz)/B̄ + a``;
    ``v = clamp((g̃ − a)² − b²σ²/B̄², s_min², s_max²)``; ``s' = sqrt(β2 std² + (1−β2) v)``;
    ``m' = β1 a + (1−β1) g̃`` (``a`` is the mean ``m`` of this step). Rows with ``c_i = 0``
    contribute exactly 0 whatever their entries (:func:`adaclip.transform.drop_units`).
    """
    summed = (jnp.tensordot(c, _core_transform.drop_units(g, c), axes=1) - jnp.sum(c) * a) * u
    return _release_moments(
        summed, a, b, z, std, noise_multiplier, expected_batch_size, beta_mean, beta_std, std_min, std_max
    )


def _release_moments(summed, a, b, z, std, sigma, batch, beta_mean, beta_std, std_min, std_max):
    w = summed if z is None else summed + sigma * z
    noisy = b * (w / batch) + a
    noise_var = sigma * sigma / (batch * batch)
    dev = noisy - a
    v = jnp.clip(dev * dev - b * b * noise_var, std_min * std_min, std_max * std_max)
    new_std = jnp.sqrt(beta_std * std * std + (1.0 - beta_std) * v)
    new_mean = beta_mean * a + (1.0 - beta_mean) * noisy
    return noisy, new_mean, new_std


def clip_noise_update(
    g: jax.Array,
    c: jax.Array,
    a: jax.Array,
    b: jax.Array,
    u: jax.Array,
    z: jax.Array | None,
    std: jax.Array,
    *,
    noise_multiplier: Any,
    expected_batch_size: float,
    beta_mean: float,
    beta_std: float,
    std_min: float,
    std_max: float,
    interpret: bool = False,
    block_cols: int = DEFAULT_BLOCK_COLS,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Pallas version of :func:`clip_noise_update_reference` (one program per column tile).

    Each program walks its column tile's rows in chunks of ``_BLOCK_ROWS`` (a loop, so the
    registers a program needs do not grow with the batch), then releases the tile. A row whose
    clip factor is 0 is read as zeros (one more condition in the mask that already hides the
    rows and columns past the array), so a NaN/inf row with factor 0 contributes exactly 0.
    """
    n, num_cols = g.shape
    dt = g.dtype
    bp = min(_pow2_at_least(block_cols), _pow2_at_least(num_cols))
    bn = _pow2_at_least(n)
    chunk = min(bn, _BLOCK_ROWS)  # both powers of two: chunk divides bn
    if z is None:
        z = jnp.zeros((num_cols,), dt)
        sigma = jnp.zeros((), dt)
    else:
        sigma = jnp.asarray(noise_multiplier, dt)
    scalars = jnp.stack([sigma, jnp.sum(c).astype(dt)]).reshape(1, 2)
    # The (P,) operands and the outputs are padded to whole tiles, so that no program loads or
    # stores past the end of a buffer. Compiled for a GPU, the unpadded version gave wrong
    # entries at the start of an output (as many as the last tile overhangs past the buffer's
    # aligned end), which fits stores past the end landing in a neighbouring buffer; the
    # interpreter pads loads itself and drops such stores, so it never showed. (Not yet rerun
    # on a GPU: the transformations keep refusing the kernels there until it is.)
    padded = pl.cdiv(num_cols, bp) * bp
    row = lambda x: jnp.pad(x, (0, padded - num_cols)).reshape(1, padded)  # noqa: E731

    def kernel(s_ref, g_ref, c_ref, a_ref, b_ref, u_ref, z_ref, std_ref, out_ref, mean_ref, newstd_ref):
        cols = _col_mask(pl.program_id(0), bp, num_cols)

        def add_chunk(k, acc):
            start = pl.multiple_of(k * chunk, chunk)
            rows = start + jax.lax.broadcasted_iota(jnp.int32, (chunk, 1), 0) < n
            cb = jnp.where(rows, c_ref[pl.ds(start, chunk), :], jnp.zeros((chunk, 1), dt))
            kept = rows & (cb != 0)  # factor 0: dropped unit (its entries may be NaN/inf)
            gb = jnp.where(cols & kept, g_ref[pl.ds(start, chunk), :], jnp.zeros((chunk, bp), dt))
            return acc + jnp.sum(cb * gb, axis=0, keepdims=True)

        # Σ_i c_i g_i over the rows that exist and are kept (chunks wholly past n add nothing)
        weighted = jax.lax.fori_loop(0, pl.cdiv(n, chunk), add_chunk, jnp.zeros((1, bp), dt))
        sig = s_ref[0, 0]
        csum = s_ref[0, 1]
        a_ = a_ref[...]
        summed = (weighted - csum * a_) * u_ref[...]
        noisy, new_mean, new_std = _release_moments(
            summed, a_, b_ref[...], z_ref[...], std_ref[...], sig, expected_batch_size,
            beta_mean, beta_std, std_min, std_max,
        )
        out_ref[...] = noisy
        mean_ref[...] = new_mean
        newstd_ref[...] = new_std

    vec = pl.BlockSpec((1, bp), lambda j: (0, j))
    outs = pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct((1, padded), dt)] * 3,
        grid=(pl.cdiv(num_cols, bp),),
        in_specs=[
            pl.BlockSpec((1, 2), lambda j: (0, 0)),
            pl.BlockSpec((bn, bp), lambda j: (0, j)),
            pl.BlockSpec((bn, 1), lambda j: (0, 0)),
            vec, vec, vec, vec, vec,
        ],
        out_specs=[vec, vec, vec],
        interpret=interpret,
        compiler_params=_COMPILER_PARAMS,
    )(scalars, g, c.astype(dt).reshape(n, 1), row(a), row(b), row(u), row(z), row(std))
    return tuple(o.reshape(padded)[:num_cols] for o in outs)
