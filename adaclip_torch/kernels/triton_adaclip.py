"""Triton kernels for the elementwise AdaCliP path on flat float32 buffers.

The step is the one of :func:`adaclip.reference.adaclip_step`: ``b = sqrt(s)·sqrt(Σ s)``,
``w_i = (g_i − m)/b``, clip each ``w_i`` to norm 1, ``w̃ = (Σ_i w̄_i + σz)/B̄``,
``g̃ = b ⊙ w̃ + m``, then the moments ``m, s`` from ``g̃`` only. Two kernels cover it; the
per-unit gradients ``g`` of shape ``(n, P)`` are read exactly twice (once for the norms, once
for the clipped sum), nothing of size ``(n, P)`` is written:

1. :func:`transformed_sq_norms` — an *upper bound* of ``‖(g_i − m)/b‖²`` for every row. Each
   program reduces one ``BLOCK`` of one row; the per-block partial sums are added by torch
   (deterministic, no atomics) and the result is enlarged by the documented rounding margin,
   so clip factors taken from it can only over-clip, never under-clip.
2. :func:`fused_release` — for each block of coordinates: ``Σ_i c_i (g_ij − m_j)/b_j``, the
   noise ``σ z_j`` added *once* to that sum, division by the *expected* batch size ``B̄``,
   rescaling ``g̃ = b ⊙ w̃ + m``, and the moment update from ``g̃`` only. A unit whose clip
   factor is 0 (a NaN/inf gradient: see :func:`adaclip.transform.clip_factors`) adds exactly
   0 whatever its entries. ``z`` is drawn in-kernel with Philox (``tl.randn(seed, offset +
   j)``) or read from an injected ``noise`` vector (tests compare with
   :mod:`adaclip.reference`). :func:`fused_flat_release` is the same pass for flat clipping
   (centre 0, scale ``C``, no state). ``n = 0`` (an empty Poisson batch) releases noise only.

The clip factors ``c = min(1, 1/‖w_i‖)`` (an ``(n,)`` vector) are computed in torch between
the two kernels, by :func:`adaclip.transform.clip_factors`.

Importing this module imports triton. With ``TRITON_INTERPRET=1`` set *when triton and this
module are first imported* (``@triton.jit`` picks the mode when it decorates) the kernels run
in Triton's interpreter on CPU tensors (slow: tests only); :data:`INTERPRETED` records which
mode they were built in.

Noise and privacy: Philox is a counter-based PRNG, not a CSPRNG. The guarantee holds only if
the seed stays secret; callers must never reuse a ``(seed, offset)`` pair across steps
(advance ``offset`` by at least ``P`` each step, or draw a fresh seed).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from adaclip.errors import InvalidGradientError, InvalidHyperparameterError
from adaclip.strategies import validate_mechanism
from adaclip_torch.kernels import reference as _reference

__all__ = [
    "INTERPRETED",
    "BLOCK_NORMS",
    "BLOCK_RELEASE",
    "transformed_sq_norms",
    "fused_release",
    "fused_flat_release",
]

#: Coordinates per program. Powers of two (``tl.arange``); P need not be a multiple.
BLOCK_NORMS = 2048
BLOCK_RELEASE = 1024
# CUDA limits grid axis 1 to 65535 programs: rows beyond are launched in chunks.
_MAX_ROWS_PER_LAUNCH = 65535
_MAX_SEED = 2**63 - 1


# --------------------------------------------------------------------------- kernels


@triton.jit
def _sq_norms_kernel(
    g_ptr,
    mean_ptr,
    inv_b_ptr,
    inv_b_scalar,
    partial_ptr,
    P,
    stride_g,
    n_blocks,
    HAS_MEAN: tl.constexpr,
    SCALAR_SCALE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # axis 0: coordinate block, axis 1: row. One partial sum per (row, block).
    pid = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < P
    x = tl.load(g_ptr + row * stride_g + offs, mask=mask, other=0.0)
    if HAS_MEAN:
        x = x - tl.load(mean_ptr + offs, mask=mask, other=0.0)
    if SCALAR_SCALE:
        w = x * inv_b_scalar
    else:
        w = x * tl.load(inv_b_ptr + offs, mask=mask, other=0.0)
    # float32 squares summed in an order the compiler picks: the wrapper's margin holds for any.
    tl.store(partial_ptr + row * n_blocks + pid, tl.sum(w * w, axis=0))


# seed, offset and n change every step: no per-value specialisation (no recompiles).
@triton.jit(do_not_specialize=["n", "seed", "offset"])
def _release_kernel(
    g_ptr,
    c_ptr,
    mean_ptr,
    std_ptr,
    sqrt_total_ptr,
    noise_ptr,
    out_grad_ptr,
    out_mean_ptr,
    out_std_ptr,
    n,
    P,
    stride_g,
    scale_scalar,
    sigma,
    inv_bbar,
    seed,
    offset,
    beta_mean,
    beta_std,
    var_min,
    var_max,
    ADAPTIVE: tl.constexpr,
    INJECTED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < P

    if ADAPTIVE:
        m = tl.load(mean_ptr + offs, mask=mask, other=0.0)
        s = tl.load(std_ptr + offs, mask=mask, other=1.0)
        # Step 1: b = sqrt(s) · sqrt(Σ s); the total is reduced beforehand (one scalar). The
        # correctly rounded square root (tl.sqrt is approximate on GPUs) makes b the same
        # float32 value the wrapper of the norms computes (_release_scale) for their 1/b.
        b = tl.sqrt_rn(s) * tl.load(sqrt_total_ptr)
    else:
        m = tl.zeros([BLOCK], dtype=tl.float32)
        b = tl.zeros([BLOCK], dtype=tl.float32) + scale_scalar

    # Steps 2–3 summed over the batch: Σ_i c_i (g_ij − m_j). The row pointer advances by the
    # row stride (pointer arithmetic is 64-bit, so n·P beyond 2^31 is fine). A unit with
    # c_i = 0 adds exactly 0: its row may hold NaN/inf, and 0·NaN is NaN.
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    row_ptr = g_ptr + offs
    for i in range(0, n):
        ci = tl.load(c_ptr + i)
        gi = tl.load(row_ptr, mask=mask, other=0.0)
        acc += tl.where(ci > 0, ci * (gi - m), 0.0)
        row_ptr += stride_g

    # Step 4: z ~ N(0, 1), injected or Philox keyed by (seed, offset + coordinate).
    if INJECTED:
        z = tl.load(noise_ptr + offs, mask=mask, other=0.0)
    else:
        z = tl.randn(seed, offset + offs)

    # Step 5: noise once on the sum, divided by the EXPECTED batch size B̄.
    w = (acc / b + sigma * z) * inv_bbar
    # Step 6: rescale to gradient space.
    dev = b * w  # = g̃ − m exactly, without the cancellation of forming g̃ − m
    g_tilde = dev + m
    tl.store(out_grad_ptr + offs, g_tilde, mask=mask)

    if ADAPTIVE:
        # Step 7: squared deviation of the RELEASED gradient minus the noise variance b²σ²/B̄².
        noise_sd = sigma * inv_bbar
        v = dev * dev - (b * b) * (noise_sd * noise_sd)
        v = tl.minimum(tl.maximum(v, var_min), var_max)
        # Step 8 and 9, both from the pre-update m and s.
        new_s = tl.sqrt(beta_std * s * s + (1.0 - beta_std) * v)
        new_m = beta_mean * m + (1.0 - beta_mean) * g_tilde
        tl.store(out_std_ptr + offs, new_s, mask=mask)
        tl.store(out_mean_ptr + offs, new_m, mask=mask)


def _interpreted() -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    # triton's own helpers (tl.sum, tl.randn) are decorated when triton is imported, ours when
    # this module is: the interpreter works only if both happened with TRITON_INTERPRET=1.
    return all(
        isinstance(f, InterpretedFunction) for f in (_sq_norms_kernel, _release_kernel, tl.sum, tl.randn)
    )


#: Whether the kernels run in Triton's interpreter (CPU tensors) rather than compiled (CUDA).
INTERPRETED: bool = _interpreted()


# --------------------------------------------------------------------------- checks


def _check_interpreter(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t is not None and t.device.type != "cuda" and not INTERPRETED:
            raise RuntimeError(
                "the Triton kernels need CUDA tensors; CPU tensors run only in Triton's "
                "interpreter, which needs TRITON_INTERPRET=1 set before triton and "
                "adaclip_torch.kernels.triton_adaclip are first imported"
            )


def _as_f32_vector(name: str, x: torch.Tensor, P: int, device: torch.device) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.shape != (P,):
        raise InvalidGradientError(f"{name} must be a tensor of shape ({P},), got {getattr(x, 'shape', x)!r}")
    if x.dtype != torch.float32:
        raise InvalidGradientError(
            f"{name} must be float32 for the Triton kernels, got {x.dtype}: pass {name}.float()"
        )
    if x.device != device:
        raise InvalidGradientError(f"{name} is on {x.device}, the gradients on {device}")
    return x.contiguous()


def _check_grads(g: torch.Tensor) -> torch.Tensor:
    g = _reference._check_grads(g)
    if g.dtype != torch.float32:
        raise InvalidGradientError(
            f"per-unit gradients must be float32 for the Triton kernels, got {g.dtype}: pass g.float(), "
            "or use adaclip_torch.kernels.reference (or the dispatcher with use_kernel=None), which "
            "computes narrower dtypes in float32 itself"
        )
    return g if g.stride(1) == 1 else g.contiguous()


_check_scalars = validate_mechanism


def _check_noise_source(seed, offset, noise, P: int, device: torch.device):
    if (seed is None) == (noise is None):
        raise InvalidHyperparameterError(
            "pass exactly one of seed (in-kernel Philox noise) or noise (injected)"
        )
    if noise is not None:
        return 0, 0, _as_f32_vector("noise", noise, P, device)
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= _MAX_SEED:
        raise InvalidHyperparameterError(f"seed must be an int in [0, 2^63), got {seed!r}")
    if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset <= _MAX_SEED - P:
        raise InvalidHyperparameterError(f"offset must be an int in [0, 2^63 - P), got {offset!r}")
    return seed, offset, None


def _check_factors(c: torch.Tensor, n: int, device: torch.device) -> torch.Tensor:
    if not isinstance(c, torch.Tensor) or c.shape != (n,):
        raise InvalidGradientError(f"clip factors must have shape ({n},), got {getattr(c, 'shape', c)!r}")
    if c.device != device:
        raise InvalidGradientError(f"clip factors are on {c.device}, the gradients on {device}")
    return _reference.factors_at_most(c, torch.float32).contiguous()


def _sqrt_rn(x: torch.Tensor) -> torch.Tensor:
    """The correctly rounded float32 square root (``tl.sqrt_rn``) on any device: torch's
    vectorised float32 ``sqrt`` on CPU is not always correctly rounded; a float64 square root
    rounded to float32 is (53 ≥ 2·24 + 2 bits, so the double rounding is exact)."""
    return torch.sqrt(x.to(torch.float64)).to(torch.float32)


def _release_scale(std: torch.Tensor, std_sum: torch.Tensor | float | None = None) -> torch.Tensor:
    """``b = sqrt(s)·sqrt(Σ s)`` in float32, bit for bit as :func:`fused_release` builds it in
    the kernel, so the norms' ``1/b`` refers to the scale the release uses."""
    return _sqrt_rn(std) * _sqrt_rn(_reference.std_total(std, std_sum))


# --------------------------------------------------------------------------- wrappers


def transformed_sq_norms(
    g: torch.Tensor,
    mean: torch.Tensor | None,
    std: torch.Tensor | None = None,
    *,
    inv_b: torch.Tensor | float | None = None,
    std_sum: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """An upper bound of ``Σ_j ((g_ij − m_j) / b_j)²`` for every row of ``g`` (float32,
    ``(n, P)``) → float32 ``(n,)``.

    ``mean`` is the centre (``None``: 0). Give exactly one of ``std`` (AdaCliP: ``b`` is
    built from it, ``b = sqrt(s)·sqrt(Σ s)``, the sum being ``std_sum`` when ``g`` is one
    slice of the parameter vector; :func:`fused_release` builds the same float32 ``b`` from
    the same ``std`` and ``std_sum``) or ``inv_b`` (``1/b``: a ``(P,)`` tensor, or a float
    such as ``1/C`` for flat clipping; the bound is then relative to the ``b`` whose rounded
    reciprocal ``inv_b`` is).

    The bound: each program sums the float32 squares of one block of ``BLOCK_NORMS``
    coordinates (``tl.sum``, in an order the compiler picks), torch adds the ``⌈P/BLOCK⌉``
    block sums in float64, and the result is multiplied by ``1 + η`` with
    ``η = sq_norms_margin(float32, P, block=BLOCK_NORMS)``
    (:func:`adaclip_torch.kernels.reference.sq_norms_margin`), in essence
    ``1 + η = (1 + γ_{min(BLOCK, P)})·(1 + γ_20)`` with ``γ_k = k·u/(1 − k·u)``,
    ``u = 2^-24`` (the float64 sum of the blocks adds less than 1e-10): ``η ≈ 1.2e-4`` once
    ``P ≥ BLOCK``, whatever ``P``. ``γ_k`` bounds the relative error of *any* order of summing
    ``k`` non-negative terms, and ``γ_20`` the roundings of the transform, the square, the
    clip factor and the final conversion, so the exact squared norm is at most the returned
    value and clip factors taken from it can only over-clip (by a relative ``η`` in norm at
    most), never under-clip. A row with a NaN/inf
    entry, or whose sum overflows, gets a non-finite value, and
    :func:`adaclip.transform.clip_factors` gives it the factor 0. ``n = 0`` returns ``(0,)``.
    """
    g = _check_grads(g)
    n, P = g.shape
    if (std is None) == (inv_b is None):
        raise InvalidHyperparameterError("pass exactly one of std or inv_b")
    if mean is not None:
        mean = _as_f32_vector("mean", mean, P, g.device)
    scalar_scale = False
    inv_b_scalar = 1.0
    if std is not None:
        std = _as_f32_vector("std", std, P, g.device)
        inv_b = 1.0 / _release_scale(std, std_sum)
    elif isinstance(inv_b, torch.Tensor):
        inv_b = _as_f32_vector("inv_b", inv_b, P, g.device)
    else:
        inv_b_scalar = float(inv_b)
        if not math.isfinite(inv_b_scalar) or inv_b_scalar <= 0:
            raise InvalidHyperparameterError(f"inv_b must be finite and > 0, got {inv_b!r}")
        scalar_scale = True
        inv_b = None
    _check_interpreter(g)
    if n == 0:
        return torch.zeros(0, dtype=torch.float32, device=g.device)

    n_blocks = triton.cdiv(P, BLOCK_NORMS)
    partial = torch.empty((n, n_blocks), dtype=torch.float32, device=g.device)
    dummy = g  # placeholder pointer for disabled operands (never loaded)
    for r0 in range(0, n, _MAX_ROWS_PER_LAUNCH):
        r1 = min(n, r0 + _MAX_ROWS_PER_LAUNCH)
        _sq_norms_kernel[(n_blocks, r1 - r0)](
            g[r0:r1],
            mean if mean is not None else dummy,
            inv_b if inv_b is not None else dummy,
            inv_b_scalar,
            partial[r0:r1],
            P,
            g.stride(0),
            n_blocks,
            HAS_MEAN=mean is not None,
            SCALAR_SCALE=scalar_scale,
            BLOCK=BLOCK_NORMS,
            num_warps=8,
        )
    margin = _reference.sq_norms_margin(torch.float32, P, block=BLOCK_NORMS)
    # Block sums added in float64: their error does not depend on torch's reduction order.
    return (partial.sum(dim=1, dtype=torch.float64) * (1.0 + margin)).to(torch.float32)


def fused_release(
    g: torch.Tensor,
    c: torch.Tensor,
    mean: torch.Tensor,
    std: torch.Tensor,
    *,
    noise_multiplier: float,
    expected_batch_size: float,
    beta_mean: float = 0.99,
    beta_std: float = 0.9,
    std_min: float,
    std_max: float,
    seed: int | None = None,
    offset: int = 0,
    noise: torch.Tensor | None = None,
    std_sum: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AdaCliP's steps after the clip factors (:func:`adaclip.reference.adaclip_step`: sum,
    noise, rescale, moment update), in one pass over ``g``.

    Args:
      g: ``(n, P)`` float32 per-unit gradients (``n = 0``: an empty Poisson batch, which
        releases noise only, ``b ⊙ σz/B̄ + m``, and updates the moments).
      c: ``(n,)`` clip factors ``min(1, 1/‖(g_i − m)/b‖)`` taken from
        :func:`transformed_sq_norms` (:func:`adaclip.transform.clip_factors`). A unit whose
        factor is not ``> 0`` (0 for a non-finite norm, or NaN) contributes exactly 0, whatever
        its row holds. Factors of another dtype are converted to float32 rounding toward 0.
      mean, std: ``(P,)`` float32 state ``m_t``, ``s_t``.
      seed, offset: in-kernel Philox noise ``z_j = randn(seed, offset + j)``; or
      noise: an injected ``(P,)`` standard-normal draw (exactly one of ``seed``/``noise``).
      std_sum: ``Σ s`` over the whole parameter vector when ``g``, ``mean`` and ``std`` are
        one slice of it (one launch per parameter tensor); ``None``: ``std.sum()``.

    Returns:
      ``(noisy_grad, new_mean, new_std)`` as in :func:`adaclip.reference.adaclip_step`.
    """
    g = _check_grads(g)
    n, P = g.shape
    dev = g.device
    c = _check_factors(c, n, dev)
    mean = _as_f32_vector("mean", mean, P, dev)
    std = _as_f32_vector("std", std, P, dev)
    sigma, bbar = _check_scalars(noise_multiplier, expected_batch_size)
    beta_mean, beta_std = float(beta_mean), float(beta_std)
    for name, beta in (("beta_mean", beta_mean), ("beta_std", beta_std)):
        if not 0.0 <= beta < 1.0:
            raise InvalidHyperparameterError(f"{name} must be in [0, 1), got {beta!r}")
    std_min, std_max = float(std_min), float(std_max)
    if not (0 < std_min <= std_max and math.isfinite(std_max)):
        raise InvalidHyperparameterError(f"need 0 < std_min <= std_max, got {std_min!r}, {std_max!r}")
    seed, offset, noise = _check_noise_source(seed, offset, noise, P, dev)
    _check_interpreter(g)

    sqrt_total = _sqrt_rn(_reference.std_total(std, std_sum)).reshape(1)
    out_grad = torch.empty(P, dtype=torch.float32, device=dev)
    out_mean = torch.empty_like(out_grad)
    out_std = torch.empty_like(out_grad)
    if n == 0:  # empty Poisson batch: noise only; never hand the kernel an empty buffer
        g, c = out_grad.view(1, P), out_grad
    _release_kernel[(triton.cdiv(P, BLOCK_RELEASE),)](
        g, c, mean, std, sqrt_total, noise if noise is not None else out_grad,
        out_grad, out_mean, out_std,
        n, P, g.stride(0), 1.0, sigma, 1.0 / bbar, seed, offset,
        beta_mean, beta_std, std_min * std_min, std_max * std_max,
        ADAPTIVE=True, INJECTED=noise is not None, BLOCK=BLOCK_RELEASE, num_warps=4,
    )  # fmt: skip
    return out_grad, out_mean, out_std


def fused_flat_release(
    g: torch.Tensor,
    c: torch.Tensor,
    *,
    max_grad_norm: float,
    noise_multiplier: float,
    expected_batch_size: float,
    seed: int | None = None,
    offset: int = 0,
    noise: torch.Tensor | None = None,
) -> torch.Tensor:
    """Flat clipping (DP-SGD) in the same pass: ``C·(Σ_i c_i g_i/C + σ z)/B̄`` with
    ``c_i = min(1, C/‖g_i‖)`` (from :func:`transformed_sq_norms` with ``inv_b = 1/C``); no
    state. Matches :func:`adaclip.reference.flat_clip_step`. Units whose factor is not ``> 0``
    contribute exactly 0 whatever their rows hold; ``n = 0`` releases ``C·σz/B̄``."""
    g = _check_grads(g)
    n, P = g.shape
    dev = g.device
    c = _check_factors(c, n, dev)
    C = float(max_grad_norm)
    if not math.isfinite(C) or C <= 0:
        raise InvalidHyperparameterError(f"max_grad_norm must be finite and > 0, got {max_grad_norm!r}")
    sigma, bbar = _check_scalars(noise_multiplier, expected_batch_size)
    seed, offset, noise = _check_noise_source(seed, offset, noise, P, dev)
    _check_interpreter(g)

    out_grad = torch.empty(P, dtype=torch.float32, device=dev)
    if n == 0:  # empty Poisson batch: noise only; never hand the kernel an empty buffer
        g, c = out_grad.view(1, P), out_grad
    _release_kernel[(triton.cdiv(P, BLOCK_RELEASE),)](
        g, c, out_grad, out_grad, out_grad, noise if noise is not None else out_grad,
        out_grad, out_grad, out_grad,
        n, P, g.stride(0), C, sigma, 1.0 / bbar, seed, offset,
        0.0, 0.0, 0.0, 0.0,
        ADAPTIVE=False, INJECTED=noise is not None, BLOCK=BLOCK_RELEASE, num_warps=4,
    )  # fmt: skip
    return out_grad
