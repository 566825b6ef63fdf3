"""Pure-torch path with the signatures of :mod:`adaclip_torch.kernels.triton_adaclip`.

It runs on any device and any floating dtype and is what the dispatcher uses when the Triton
kernels are unavailable (no CUDA, no triton). It is written step by step against SPEC §2 and
is tested, like the kernels, against :func:`adaclip.reference.adaclip_step`.

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

__all__ = [
    "clip_factors",
    "auxiliary_scale",
    "std_total",
    "transformed_sq_norms",
    "fused_release",
    "fused_flat_release",
    "seeded_normal",
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


def clip_factors(sq_norms: torch.Tensor) -> torch.Tensor:
    """Step 3: ``min(1, 1/‖w_i‖)`` from squared norms, safe at ``‖w_i‖ = 0``."""
    norms = torch.sqrt(sq_norms)
    tiny = torch.finfo(norms.dtype).tiny
    return torch.clamp(1.0 / torch.clamp(norms, min=tiny), max=1.0)


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
    P = g.shape[1]
    if not isinstance(x, torch.Tensor) or x.shape != (P,):
        raise InvalidGradientError(f"{name} must be a tensor of shape ({P},), got {getattr(x, 'shape', x)!r}")
    if x.device != g.device:
        raise InvalidGradientError(f"{name} is on {x.device}, the gradients on {g.device}")
    return x.to(g.dtype)


def _scalars(noise_multiplier: float, expected_batch_size: float) -> tuple[float, float]:
    return validate_mechanism(noise_multiplier, expected_batch_size)


def _noise(seed, offset, noise, g: torch.Tensor) -> torch.Tensor:
    if (seed is None) == (noise is None):
        raise InvalidHyperparameterError("pass exactly one of seed (seeded noise) or noise (injected)")
    if noise is not None:
        return _vector("noise", noise, g)
    return seeded_normal(g.shape[1], seed, offset, dtype=g.dtype, device=g.device)


def _factors(c: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    if not isinstance(c, torch.Tensor) or c.shape != (g.shape[0],):
        raise InvalidGradientError(
            f"clip factors must have shape ({g.shape[0]},), got {getattr(c, 'shape', c)!r}"
        )
    return c.to(device=g.device, dtype=g.dtype)


def transformed_sq_norms(
    g: torch.Tensor,
    mean: torch.Tensor | None,
    std: torch.Tensor | None = None,
    *,
    inv_b: torch.Tensor | float | None = None,
    std_sum: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """``Σ_j ((g_ij − m_j) / b_j)²`` per row; see the kernel version for the arguments."""
    g = _check_grads(g)
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
    x = g if mean is None else g - _vector("mean", mean, g)
    w = x * inv_b
    return torch.sum(w * w, dim=1)


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
    """SPEC §2 steps 1–9 given the clip factors ``c``; returns ``(noisy_grad, new_mean, new_std)``.

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
    summed = (c @ (g - m)) / b  # steps 2–3 summed: Σ_i c_i (g_i − m)/b
    w = (summed + sigma * z) / bbar  # steps 4–5: noise once, divide by the EXPECTED B̄
    dev = b * w
    noisy_grad = dev + m  # step 6
    v = torch.clamp(dev * dev - b * b * (sigma / bbar) ** 2, std_min**2, std_max**2)  # step 7
    new_std = torch.sqrt(beta_std * s * s + (1.0 - beta_std) * v)  # step 8
    new_mean = beta_mean * m + (1.0 - beta_mean) * noisy_grad  # step 9
    return noisy_grad, new_mean, new_std


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
    """Flat clipping: ``C·(Σ_i c_i g_i/C + σ z)/B̄``."""
    g = _check_grads(g)
    c = _factors(c, g)
    C = float(max_grad_norm)
    if not math.isfinite(C) or C <= 0:
        raise InvalidHyperparameterError(f"max_grad_norm must be finite and > 0, got {max_grad_norm!r}")
    sigma, bbar = _scalars(noise_multiplier, expected_batch_size)
    z = _noise(seed, offset, noise, g)
    return C * ((c @ g) / C + sigma * z) / bbar
