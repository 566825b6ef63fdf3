"""Standard-normal noise for the private release, seeded or from the OS (secure mode).

The core multiplies the draws by σ; this module only produces ``z ~ N(0, I)`` shaped like
each parameter tensor.

Seeded mode (the default) keeps one :class:`torch.Generator`, seeded by ``seed`` (or by 64
bits from the OS when ``seed`` is ``None``). Its state is part of the optimizer's
``state_dict`` so a resumed run draws exactly the noise an uninterrupted run would have.
Use it for experiments; the seed must stay secret for the guarantee to mean anything.

Secure mode (``secure_mode=True``) is for deployment:

* every draw comes from a fresh generator seeded with 64 bits from :func:`secrets.randbits`
  (the OS CSPRNG), so nothing an attacker can recover (a seed, a checkpoint) predicts it;
* each coordinate is the sum of ``k`` independent normal draws divided by ``sqrt(k)``:

  .. math::  z = \\frac{1}{\\sqrt{k}} \\sum_{j=1}^{k} x_j,\\qquad x_j \\sim N(0, 1)
             \\;\\Rightarrow\\; \\operatorname{Var} z = \\frac{k}{k} = 1,

  which keeps ``z`` exactly standard normal in distribution while smoothing the gaps in
  the floating-point grid of any single sampler output, the weakness Mironov's
  floating-point attack exploits (a single draw reveals which lattice point it came from).
  ``k = 4`` by default (Opacus sums draws similarly).

A secure-mode source has no reproducible state: its ``state_dict`` only records the mode,
and a resumed run draws fresh noise (bit-for-bit resumption needs seeded mode).
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from typing import Any

import torch

from adaclip.errors import InvalidHyperparameterError

__all__ = ["NoiseSource"]


def _os_seed() -> int:
    return secrets.randbits(63)


class NoiseSource:
    """Draws ``N(0, I)`` tensors shaped like the parameters.

    Args:
      seed: seed of the generator (seeded mode); ``None`` takes one from the OS.
      secure_mode: draw from the OS's randomness and sum ``secure_num_draws`` normals.
      secure_num_draws: ``k``, the number of draws summed per coordinate in secure mode.
    """

    def __init__(self, *, seed: int | None = None, secure_mode: bool = False, secure_num_draws: int = 4):
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise InvalidHyperparameterError(f"seed must be a non-negative int or None, got {seed!r}")
        if isinstance(secure_num_draws, bool) or not isinstance(secure_num_draws, int) or secure_num_draws < 1:
            raise InvalidHyperparameterError(
                f"secure_num_draws must be a positive int, got {secure_num_draws!r}"
            )
        if secure_mode and seed is not None:
            raise InvalidHyperparameterError("secure_mode=True draws from the OS: do not pass a seed")
        self.secure_mode = bool(secure_mode)
        self.secure_num_draws = secure_num_draws
        self._generator = torch.Generator(device="cpu")
        self._generator.manual_seed(_os_seed() if seed is None else seed)

    # ------------------------------------------------------------------ drawing

    def standard_normal(self, like: Sequence[torch.Tensor], *, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
        """One ``N(0, I)`` tensor per entry of ``like`` (its shape, device, and ``dtype``
        or its own dtype). Draws on the CPU generator, then moves: the stream does not
        depend on the device, so CPU and GPU runs with one seed see the same noise."""
        return [self._draw(t.shape, dtype or t.dtype).to(t.device) for t in like]

    def _draw(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        draw_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        if not self.secure_mode:
            return torch.randn(shape, generator=self._generator, dtype=draw_dtype).to(dtype)
        gen = torch.Generator(device="cpu")
        gen.manual_seed(_os_seed())
        k = self.secure_num_draws
        total = torch.zeros(shape, dtype=torch.float64)
        for _ in range(k):
            total += torch.randn(shape, generator=gen, dtype=torch.float64)
        return (total / math.sqrt(k)).to(dtype)

    # ------------------------------------------------------------------ state

    def get_state(self) -> torch.Tensor:
        """The generator's state (a byte tensor), to restore with :meth:`set_state`."""
        return self._generator.get_state()

    def set_state(self, state: torch.Tensor) -> None:
        self._generator.set_state(state)

    def state_dict(self) -> dict[str, Any]:
        """Seeded mode: the generator state; secure mode: only the mode (nothing to replay)."""
        out: dict[str, Any] = {"secure_mode": self.secure_mode, "secure_num_draws": self.secure_num_draws}
        if not self.secure_mode:
            out["generator_state"] = self._generator.get_state().clone()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if bool(state.get("secure_mode", False)) != self.secure_mode:
            raise InvalidHyperparameterError(
                f"noise state_dict has secure_mode={state.get('secure_mode')!r}, this source has "
                f"secure_mode={self.secure_mode!r}"
            )
        if not self.secure_mode:
            self._generator.set_state(state["generator_state"])
