"""Fused transform–clip–noise–rescale for flat buffers, with a dispatcher.

The caller flattens all parameters into one contiguous vector of ``P`` coordinates and the
per-unit gradients into an ``(n, P)`` matrix. One step is two passes over the gradients:

.. code-block:: python

    from adaclip_torch.kernels import fused_adaclip_step
    noisy_grad, new_mean, new_std = fused_adaclip_step(
        g, mean, std, noise_multiplier=1.1, expected_batch_size=256,
        std_min=1e-5, std_max=1e-2, seed=secret_seed, offset=step * P)

- :mod:`adaclip_torch.kernels.triton_adaclip` — the Triton kernels (CUDA; on CPU only in
  Triton's interpreter, ``TRITON_INTERPRET=1`` set before that module is imported);
- :mod:`adaclip_torch.kernels.reference` — the pure-torch path with identical signatures.

``use_kernel``: ``None`` (auto) takes the Triton kernels for float32 CUDA tensors when triton
imports, else the torch path; ``True`` forces the kernels (raising if they cannot run);
``False`` forces the torch path. Importing this package does not import triton.

Numerical safety: the squared norms are upper bounds (rounding can only over-clip, never
under-clip; :func:`adaclip_torch.kernels.reference.sq_norms_margin`), clip factors come from
:func:`adaclip.transform.clip_factors` (0 for a non-finite norm), and a unit with factor 0
contributes exactly 0 to the release even if its row holds NaN/inf.

Noise: exactly one of ``seed`` (noise drawn inside the step; advance ``offset`` by at least
``P`` every step and keep the seed secret) or ``noise`` (an injected standard-normal ``(P,)``
draw). The two paths draw different streams from the same ``(seed, offset)``.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import torch

from adaclip.errors import InvalidHyperparameterError
from adaclip.transform import clip_factors
from adaclip_torch.kernels import reference

__all__ = [
    "fused_adaclip_step",
    "fused_flat_step",
    "kernel_available",
    "resolve_use_kernel",
    "reference",
]


def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def kernel_available(device: torch.device | str) -> bool:
    """Whether the Triton kernels can run on ``device``: CUDA with triton installed, or CPU
    with triton installed and ``TRITON_INTERPRET=1`` (Triton's interpreter)."""
    device = torch.device(device)
    if not _triton_installed():
        return False
    if device.type == "cuda":
        return torch.cuda.is_available()
    if device.type == "cpu":
        # ``@triton.jit`` picks the interpreter when it decorates: when triton (its tl.sum,
        # tl.randn) and triton_adaclip are first imported. Once imported, their state decides.
        mod = sys.modules.get("adaclip_torch.kernels.triton_adaclip")
        if mod is not None:
            return bool(mod.INTERPRETED)
        if os.environ.get("TRITON_INTERPRET") != "1":
            return False
        tl = sys.modules.get("triton.language")
        return tl is None or type(tl.sum).__name__ == "InterpretedFunction"
    return False


def resolve_use_kernel(use_kernel: bool | None, g: torch.Tensor) -> bool:
    """The dispatcher's choice for per-unit gradients ``g``.

    ``None``: the kernels for float32 CUDA tensors when triton is installed, else the torch
    path (auto never picks the slow interpreter). ``True``: the kernels, or a
    :class:`RuntimeError` saying why they cannot run. ``False``: the torch path.
    """
    if use_kernel is None:
        return g.device.type == "cuda" and g.dtype == torch.float32 and kernel_available(g.device)
    if use_kernel is False:
        return False
    if use_kernel is not True:
        raise TypeError(f"use_kernel must be True, False or None, got {use_kernel!r}")
    if not _triton_installed():
        raise RuntimeError("use_kernel=True but triton is not installed (pip install 'adaclip[triton]')")
    if not kernel_available(g.device):
        raise RuntimeError(
            f"use_kernel=True but the Triton kernels cannot run on {g.device}: they need a CUDA "
            "device, or TRITON_INTERPRET=1 set before triton is first imported (CPU interpreter)"
        )
    if g.dtype != torch.float32:
        raise RuntimeError(
            f"use_kernel=True but the Triton kernels take float32 gradients, got {g.dtype}: pass "
            "g.float() (and float32 mean, std and noise), or use_kernel=None (or False) for the torch "
            "path, which computes narrower dtypes in float32 and rounds the results back"
        )
    return True


def _backend(use_kernel: bool | None, g: torch.Tensor):
    if resolve_use_kernel(use_kernel, g):
        # lazy: triton is optional and heavy; importing adaclip_torch must not import it
        from adaclip_torch.kernels import triton_adaclip

        return triton_adaclip
    return reference


def fused_adaclip_step(
    g: torch.Tensor,
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
    use_kernel: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One AdaCliP step on flat buffers: ``(noisy_grad, new_mean, new_std)``.

    Same maths and argument meaning as :func:`adaclip.reference.adaclip_step` (``g`` is
    ``(n, P)``, ``n = 0`` is an empty Poisson batch), with the noise given by ``seed``/``offset``
    or injected as ``noise``. A unit with a NaN/inf entry contributes nothing (as in the
    reference, which drops it) instead of turning the release into NaN.
    """
    backend = _backend(use_kernel, g)
    sq = backend.transformed_sq_norms(g, mean, std)
    c = clip_factors(sq)
    return backend.fused_release(
        g,
        c,
        mean,
        std,
        noise_multiplier=noise_multiplier,
        expected_batch_size=expected_batch_size,
        beta_mean=beta_mean,
        beta_std=beta_std,
        std_min=std_min,
        std_max=std_max,
        seed=seed,
        offset=offset,
        noise=noise,
    )


def fused_flat_step(
    g: torch.Tensor,
    *,
    max_grad_norm: float,
    noise_multiplier: float,
    expected_batch_size: float,
    seed: int | None = None,
    offset: int = 0,
    noise: torch.Tensor | None = None,
    use_kernel: bool | None = None,
) -> torch.Tensor:
    """Flat clipping (DP-SGD) on flat buffers, as :func:`adaclip.reference.flat_clip_step`."""
    backend = _backend(use_kernel, g)
    C = float(max_grad_norm)
    if not C > 0:
        raise InvalidHyperparameterError(f"max_grad_norm must be finite and > 0, got {max_grad_norm!r}")
    sq = backend.transformed_sq_norms(g, None, inv_b=1.0 / C)
    c = clip_factors(sq)
    return backend.fused_flat_release(
        g,
        c,
        max_grad_norm=C,
        noise_multiplier=noise_multiplier,
        expected_batch_size=expected_batch_size,
        seed=seed,
        offset=offset,
        noise=noise,
    )
