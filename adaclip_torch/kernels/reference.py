"""Pure-torch path with the signatures of :mod:`adaclip_torch.kernels.triton_adaclip`.

It runs on any device and any floating dtype and is what the dispatcher uses when the Triton
kernels are unavailable (no CUDA, no triton). It follows the numbered steps of
:func:`adaclip.reference.adaclip_step` one by one and is tested, like the kernels, against
that function. Dtypes narrower than float32 (float16, bfloat16) are computed in float32 and
the results rounded back to the input dtype at the end.

Numerical safety, shared with the kernels: :func:`transformed_sq_norms` returns an *upper
bound* of every squared transformed norm (:func:`sq_norms_margin`), so clip factors taken
from it (:func:`adaclip.transform.clip_factors`) can only over-clip, never under-clip; and a
unit whose clip factor is 0 (a NaN/inf gradient, or a norm that overflows) contributes
exactly 0 to the release, whatever its entries (``0·NaN`` would be NaN).

Noise: with ``noise`` given, the same injected draw as the kernels (results agree to
rounding). With ``seed``/``offset`` the draw comes from a :class:`torch.Generator` seeded
from the pair; it is standard normal but *not* the kernels' Philox stream, so the two paths
give different noise for the same ``(seed, offset)``. The same rule holds for both: never
reuse a ``(seed, offset)`` pair, and keep the seed secret.
"""

from __future__ import annotations

import math

import torch

from adaclip.errors import InvalidGradientError, InvalidHyperparameterError
from adaclip.strategies import validate_mechanism
from adaclip.transform import drop_units, rounding_margin, unit_roundoff
from adaclip_torch._precision import full_float32_precision

__all__ = [
    "auxiliary_scale",
    "std_total",
    "transformed_sq_norms",
    "fused_release",
    "fused_flat_release",
    "seeded_normal",
    "sq_norms_margin",
    "factors_at_most",
]

_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """SplitMix64 finaliser: spreads (seed, offset) over the generator's 64-bit seed space."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def seeded_normal(
    P: int, seed: int, offset: int, *, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A ``(P,)`` standard-normal draw determined by ``(seed, offset)``, drawn by a generator on
    ``device`` (so it stays on the GPU there; CPU and CUDA give different streams)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise InvalidHyperparameterError(f"seed must be an int in [0, 2^63), got {seed!r}")
    if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset < 2**63:
        raise InvalidHyperparameterError(f"offset must be an int in [0, 2^63), got {offset!r}")
    gen = torch.Generator(device=device)
    gen.manual_seed(_mix64(seed ^ _mix64(offset)) & (2**63 - 1))
    draw_dtype = dtype if dtype in (torch.float32, torch.float64) else torch.float32
    return torch.randn(P, generator=gen, dtype=draw_dtype, device=device).to(dtype)


#: Roundings besides the summation that :func:`sq_norms_margin` adds to
#: :func:`adaclip.transform.rounding_margin` for the torch path (see there).
EXTRA_ROUNDINGS = 8

#: Roundings besides the summation that :func:`sq_norms_margin` counts for the Triton kernel
#: (see there).
KERNEL_ROUNDINGS = 20


def _gamma(num_roundings: int, u: float, what: str) -> float:
    """``γ_k = k·u/(1 − k·u)``: ``∏(1 + δ_j)^{±1} ≥ 1/(1 + γ_k)`` for ``k`` factors ``|δ_j| ≤ u``."""
    x = num_roundings * u
    if x >= 0.5:
        raise ValueError(f"{what}: no useful rounding bound ({num_roundings} roundings of {u:.3g})")
    return x / (1.0 - x)


def sq_norms_margin(dtype: torch.dtype, num_terms: int, *, block: int | None = None) -> float:
    """``η`` such that the exact squared norm ``S`` of a row of ``num_terms`` coordinates and the
    value ``Ŝ`` that :func:`transformed_sq_norms` computes in ``dtype`` satisfy ``S ≤ Ŝ·(1 + η)``.

    Both bounds rest on one fact: any order of summing ``k`` non-negative terms has a relative
    error of at most ``γ_k = k·u/(1 − k·u)`` (``u`` the unit roundoff of the dtype), and the
    relative errors of non-negative partial sums compound.

    ``block=None`` (this module): one ``torch.sum`` over the row, a blocked reduction whose
    error :func:`adaclip.transform.rounding_margin` bounds (it also covers the rounding of
    ``(g − m)·(1/b)``, the squares, and the clip factor's square root and division), times
    ``1 + γ_8`` (:data:`EXTRA_ROUNDINGS`) for what it does not: up to two more roundings of
    ``1/b`` (a flat ``1/C`` formed in float64 and rounded to ``dtype``; 4 ``u`` in the square),
    the rounding of ``Ŝ·(1 + η)`` (1 ``u``), squares that underflow (1 ``u``: they lose at most
    ``P·2^-126`` in float32, below ``u·Ŝ`` whenever the bound decides a clip, ``Ŝ ≳ 1``), and
    2 ``u`` to spare.

    ``block=B`` (the Triton kernel): each program sums ``min(B, P)`` float32 squares in an
    order the compiler picks (``γ_{min(B, P)}``), the ``⌈P/B⌉`` block sums are added in
    float64 (``γ`` with the float64 ``u``, whatever order torch uses), and ``γ_20``
    (:data:`KERNEL_ROUNDINGS`) covers the rest: ``g − m`` and ``·(1/b)`` (2 ``u`` each in the
    square), ``1/b`` against the ``b`` the release uses (up to three roundings, 6 ``u``), the
    square (1 ``u``), the clip factor's square root and division (4 ``u``), the final rounding
    to float32 (1 ``u``), underflow (1 ``u``, as above), and 3 ``u`` to spare:

    .. math::
        1 + η = (1 + γ_{\\min(B, P)})·(1 + γ^{(64)}_{⌈P/B⌉})·(1 + γ_{20}).
    """
    k = max(1, int(num_terms))
    u = unit_roundoff(dtype)
    if block is None:
        extra = _gamma(EXTRA_ROUNDINGS, u, f"{dtype}")
        return (1.0 + rounding_margin(dtype, k)) * (1.0 + extra) - 1.0
    per_block = min(int(block), k)
    in_block = _gamma(per_block, u, f"a block of {per_block} terms in {dtype}")
    blocks = _gamma(-(-k // int(block)), unit_roundoff(torch.float64), "the block sums in float64")
    rest = _gamma(KERNEL_ROUNDINGS, u, f"{dtype}")
    return (1.0 + in_block) * (1.0 + blocks) * (1.0 + rest) - 1.0


def factors_at_most(c: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Clip factors ``c`` converted to ``dtype``, rounded toward zero where the conversion
    rounded up (a rounded-up factor would under-clip). NaN stays NaN; the releases treat any
    factor that is not ``> 0`` as 0. No host synchronisation."""
    out = c.to(dtype)
    if c.dtype == dtype or not c.is_floating_point():
        return out
    up = out.to(torch.float64) > c.to(torch.float64)
    return torch.where(up, torch.nextafter(out, torch.zeros_like(out)), out)


def _work_dtype(g: torch.Tensor) -> torch.dtype:
    """float32 or float64: the dtype the arithmetic runs in (narrower inputs are widened)."""
    return torch.promote_types(g.dtype, torch.float32)


def std_total(std: torch.Tensor, std_sum: torch.Tensor | float | None = None) -> torch.Tensor:
    """``Σ_j s_j`` as a 0-d tensor: over ``std`` itself, or ``std_sum`` when ``std`` is one
    slice (e.g. one parameter tensor) of the whole vector the transform is defined on."""
    if std_sum is None:
        return torch.sum(std)
    if isinstance(std_sum, torch.Tensor):
        if std_sum.numel() != 1:
            raise InvalidGradientError(f"std_sum must be a scalar, got shape {tuple(std_sum.shape)}")
        return std_sum.reshape(()).to(device=std.device, dtype=std.dtype)
    total = float(std_sum)
    if not math.isfinite(total) or total <= 0:
        raise InvalidHyperparameterError(f"std_sum must be finite and > 0, got {std_sum!r}")
    return torch.tensor(total, dtype=std.dtype, device=std.device)


def auxiliary_scale(std: torch.Tensor, std_sum: torch.Tensor | float | None = None) -> torch.Tensor:
    """Step 1: ``b = sqrt(s)·sqrt(Σ_j s_j)`` (the sum over the whole vector: see :func:`std_total`)."""
    return torch.sqrt(std) * torch.sqrt(std_total(std, std_sum))


def _check_grads(g: torch.Tensor) -> torch.Tensor:
    if not isinstance(g, torch.Tensor) or g.ndim != 2:
        raise InvalidGradientError(
            f"per-unit gradients must be a (n, P) tensor, got {getattr(g, 'shape', g)!r}"
        )
    if not g.is_floating_point():
        raise InvalidGradientError(f"per-unit gradients must be floating point, got {g.dtype}")
    if g.shape[1] == 0:
        raise InvalidGradientError("per-unit gradients have no coordinates (P = 0)")
    return g


def _vector(name: str, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``x`` checked as a ``(P,)`` vector on ``g``'s device, in the working dtype."""
    P = g.shape[1]
    if not isinstance(x, torch.Tensor) or x.shape != (P,):
        raise InvalidGradientError(f"{name} must be a tensor of shape ({P},), got {getattr(x, 'shape', x)!r}")
    if x.device != g.device:
        raise InvalidGradientError(f"{name} is on {x.device}, the gradients on {g.device}")
    return x.to(_work_dtype(g))


def _scalars(noise_multiplier: float, expected_batch_size: float) -> tuple[float, float]:
    return validate_mechanism(noise_multiplier, expected_batch_size)


def _noise(seed, offset, noise, g: torch.Tensor) -> torch.Tensor:
    if (seed is None) == (noise is None):
        raise InvalidHyperparameterError("pass exactly one of seed (seeded noise) or noise (injected)")
    if noise is not None:
        return _vector("noise", noise, g)
    return seeded_normal(g.shape[1], seed, offset, dtype=_work_dtype(g), device=g.device)


def _factors(c: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The clip factors in the working dtype, never rounded up, with every factor that is not
    ``> 0`` (NaN included) set to 0."""
    if not isinstance(c, torch.Tensor) or c.shape != (g.shape[0],):
        raise InvalidGradientError(
            f"clip factors must have shape ({g.shape[0]},), got {getattr(c, 'shape', c)!r}"
        )
    c = factors_at_most(c.to(device=g.device), _work_dtype(g))
    return torch.where(c > 0, c, torch.zeros_like(c))


def transformed_sq_norms(
    g: torch.Tensor,
    mean: torch.Tensor | None,
    std: torch.Tensor | None = None,
    *,
    inv_b: torch.Tensor | float | None = None,
    std_sum: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """An upper bound of ``Σ_j ((g_ij − m_j) / b_j)²`` for every row of ``g`` (``(n, P)``) → ``(n,)``.

    ``mean`` is the centre (``None``: 0). Give exactly one of ``std`` (AdaCliP: ``b`` is built
    from it, ``b = sqrt(s)·sqrt(Σ s)``, the sum being ``std_sum`` when ``g`` is one slice of
    the parameter vector; :func:`fused_release` builds the same ``b``) or ``inv_b`` (``1/b``:
    a ``(P,)`` tensor, or a float such as ``1/C`` for flat clipping).

    The bound: the sum of squares computed in the working dtype (float32 for narrower
    inputs), times ``1 + η`` with ``η = sq_norms_margin(dtype, P)`` (:func:`sq_norms_margin`),
    so rounding can only make a unit look larger. A row with a NaN/inf entry, or whose sum
    overflows, gets a non-finite value, and :func:`adaclip.transform.clip_factors` gives it the
    factor 0. ``n = 0`` gives an empty ``(0,)`` result.
    """
    g = _check_grads(g)
    work = _work_dtype(g)
    if (std is None) == (inv_b is None):
        raise InvalidHyperparameterError("pass exactly one of std or inv_b")
    if std is not None:
        inv_b = 1.0 / auxiliary_scale(_vector("std", std, g), std_sum)
    elif isinstance(inv_b, torch.Tensor):
        inv_b = _vector("inv_b", inv_b, g)
    else:
        inv_b = float(inv_b)
        if not math.isfinite(inv_b) or inv_b <= 0:
            raise InvalidHyperparameterError(f"inv_b must be finite and > 0, got {inv_b!r}")
    x = g.to(work)
    if mean is not None:
        x = x - _vector("mean", mean, g)
    w = x * inv_b
    return torch.sum(w * w, dim=1) * (1.0 + sq_norms_margin(work, g.shape[1]))


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
    """AdaCliP's steps 1–9 (:func:`adaclip.reference.adaclip_step`) given the clip factors
    ``c``; returns ``(noisy_grad, new_mean, new_std)`` in ``g``'s dtype.

    Units whose factor is not ``> 0`` contribute exactly 0, whatever their entries. ``n = 0``
    (an empty Poisson batch) releases noise only, ``b ⊙ σz/B̄ + m``, and updates the moments.
    ``std_sum``: ``Σ s`` over the whole parameter vector when ``g``/``mean``/``std`` are one
    slice of it (one launch per parameter tensor); ``None``: the slice is the whole vector."""
    g = _check_grads(g)
    c = _factors(c, g)
    m = _vector("mean", mean, g)
    s = _vector("std", std, g)
    sigma, bbar = _scalars(noise_multiplier, expected_batch_size)
    beta_mean, beta_std = float(beta_mean), float(beta_std)
    for name, beta in (("beta_mean", beta_mean), ("beta_std", beta_std)):
        if not 0.0 <= beta < 1.0:
            raise InvalidHyperparameterError(f"{name} must be in [0, 1), got {beta!r}")
    std_min, std_max = float(std_min), float(std_max)
    if not (0 < std_min <= std_max and math.isfinite(std_max)):
        raise InvalidHyperparameterError(f"need 0 < std_min <= std_max, got {std_min!r}, {std_max!r}")
    z = _noise(seed, offset, noise, g)

    b = auxiliary_scale(s, std_sum)  # step 1
    # Steps 2–3 summed: Σ_i c_i (g_i − m)/b; rows with c_i = 0 are zeroed first (NaN/inf). The
    # product in full float32 whatever the user's matmul precision: TF32/bfloat16 inputs could
    # let a unit's contribution exceed its clipped norm (adaclip_torch._precision).
    with full_float32_precision():
        summed = (c @ (drop_units(g, c).to(m.dtype) - m)) / b
    w = (summed + sigma * z) / bbar  # steps 4–5: noise once, divide by the EXPECTED B̄
    dev = b * w
    noisy_grad = dev + m  # step 6
    v = torch.clamp(dev * dev - b * b * (sigma / bbar) ** 2, std_min**2, std_max**2)  # step 7
    new_std = torch.sqrt(beta_std * s * s + (1.0 - beta_std) * v)  # step 8
    new_mean = beta_mean * m + (1.0 - beta_mean) * noisy_grad  # step 9
    return noisy_grad.to(g.dtype), new_mean.to(g.dtype), new_std.to(g.dtype)


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
    """Flat clipping: ``C·(Σ_i c_i g_i/C + σ z)/B̄`` in ``g``'s dtype; units whose factor is not
    ``> 0`` contribute exactly 0, and ``n = 0`` releases ``C·σz/B̄``."""
    g = _check_grads(g)
    c = _factors(c, g)
    C = float(max_grad_norm)
    if not math.isfinite(C) or C <= 0:
        raise InvalidHyperparameterError(f"max_grad_norm must be finite and > 0, got {max_grad_norm!r}")
    sigma, bbar = _scalars(noise_multiplier, expected_batch_size)
    z = _noise(seed, offset, noise, g)
    with full_float32_precision():  # full float32 product whatever the user's matmul precision
        summed = c @ drop_units(g, c).to(z.dtype)  # rows with c_i = 0 zeroed first (NaN/inf)
    return (C * (summed / C + sigma * z) / bbar).to(g.dtype)
