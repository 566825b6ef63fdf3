"""Standard-normal noise for the private release: from the OS, seeded, or secure.

The core multiplies the draws by σ; this module only produces ``z ~ N(0, I)`` shaped like
each parameter tensor. A noise draw is used for exactly one release: the generator never
rewinds once a draw may have left the optimizer, and how a checkpoint restores it depends on
the mode.

* **OS-seeded** (the default, ``seed=None``): one :class:`torch.Generator` per device, each
  seeded with 63 bits from the OS CSPRNG; noise for a parameter on a GPU is drawn there, on
  that device's generator, so a step neither waits for a host-side draw nor copies it over.
  No state is saved in :meth:`NoiseSource.state_dict`, and
  :meth:`NoiseSource.load_state_dict` re-seeds every generator from the OS: a run resumed
  from a checkpoint draws fresh noise, so replaying steps after a restore cannot cancel the
  noise of the first attempt.
* **Seeded** (``seed=`` an int, for experiments): the generator's state is saved, so a
  resumed run draws exactly the noise an uninterrupted run would have (bit-for-bit
  resumption). The checkpoint then predicts the next step's noise and must be kept as secret
  as the seed, and restoring it warns (:class:`adaclip.errors.NoiseReplayWarning`): if
  anything released after the checkpoint was kept, a replay on other data cancels the noise.
  Seeded draws are made on the CPU generator and then moved, so one seed gives the same noise
  on every device (at the cost of a host-side draw and a copy per step on a GPU).
* **Secure** (``secure_mode=True``, for deployment): every draw comes from a fresh generator
  seeded with 63 bits from :func:`secrets.randbits`, and each coordinate is the sum of ``k``
  independent normal draws divided by ``sqrt(k)``:

  .. math::  z = \\frac{1}{\\sqrt{k}} \\sum_{j=1}^{k} x_j,\\qquad x_j \\sim N(0, 1)
             \\;\\Rightarrow\\; \\operatorname{Var} z = \\frac{k}{k} = 1,

  which keeps ``z`` exactly standard normal in distribution while smoothing the gaps in
  the floating-point grid of any single sampler output, the weakness Mironov's
  floating-point attack exploits (a single draw reveals which lattice point it came from).
  ``k = 4`` by default (Opacus sums draws similarly). Nothing is saved; nothing replays.
  Secure draws are made on the CPU, in float64, and then moved.

Which generator draws changes nothing in the privacy argument: each coordinate is an
independent ``N(0, 1)`` draw used for one release, and nothing about the draw depends on the
data. A failed step that released nothing rewinds every generator it drew from
(:meth:`NoiseSource.snapshot` / :meth:`NoiseSource.restore`).
"""

from __future__ import annotations

import math
import secrets
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from adaclip.errors import InvalidHyperparameterError, NoiseReplayWarning

__all__ = ["NoiseSource"]


def _os_seed() -> int:
    return secrets.randbits(63)


class NoiseSource:
    """Draws ``N(0, I)`` tensors shaped like the parameters.

    Args:
      seed: seed of the generator (seeded mode: its state is checkpointed, and restoring it
        replays noise); ``None`` (default) takes one from the OS and never saves its state.
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
        #: Whether the generator's state is saved and restored (an explicit ``seed``).
        self.seeded = seed is not None
        self._generator = torch.Generator(device="cpu")
        self._generator.manual_seed(_os_seed() if seed is None else seed)
        #: OS-seeded mode: one generator per non-CPU device, made on first use.
        self._device_generators: dict[torch.device, torch.Generator] = {}

    # ------------------------------------------------------------------ drawing

    def standard_normal(self, like: Sequence[torch.Tensor], *, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
        """One ``N(0, I)`` tensor per entry of ``like`` (its shape, device, and ``dtype``
        or its own dtype). OS-seeded: drawn on the tensor's device. Seeded and secure: drawn
        on the CPU, then moved (a seeded stream does not depend on the device, so CPU and GPU
        runs with one seed see the same noise)."""
        return [self._draw_like(t, dtype or t.dtype) for t in like]

    def _draw_like(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        gen = self._device_generator(t.device) if self.mode == "os" and t.device.type != "cpu" else None
        if gen is not None:
            draw_dtype = torch.float64 if dtype == torch.float64 else torch.float32
            return torch.randn(t.shape, generator=gen, device=t.device, dtype=draw_dtype).to(dtype)
        return self._draw(t.shape, dtype).to(t.device)

    def _device_generator(self, device: torch.device) -> torch.Generator | None:
        """The OS-seeded generator of ``device``; ``None`` where the device has no generator
        of its own (its noise is then drawn on the CPU and moved)."""
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        gen = self._device_generators.get(device)
        if gen is None:
            try:
                gen = torch.Generator(device=device)
            except RuntimeError:
                return None
            gen.manual_seed(_os_seed())
            self._device_generators[device] = gen
        return gen

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

    @property
    def mode(self) -> str:
        """``"secure"``, ``"seeded"`` or ``"os"`` (see the module documentation)."""
        return "secure" if self.secure_mode else ("seeded" if self.seeded else "os")

    def get_state(self) -> torch.Tensor:
        """The generator's state (a byte tensor), to restore with :meth:`set_state` — used to
        undo a draw that was never released (a step that failed before anything left)."""
        return self._generator.get_state()

    def set_state(self, state: torch.Tensor) -> None:
        self._generator.set_state(state)

    def snapshot(self) -> tuple[torch.Tensor, dict[torch.device, torch.Tensor]]:
        """The state of every generator (the CPU one and the per-device ones), for
        :meth:`restore` to undo draws that were never released."""
        return self._generator.get_state(), {d: g.get_state() for d, g in self._device_generators.items()}

    def restore(self, snapshot: tuple[torch.Tensor, dict[torch.device, torch.Tensor]]) -> None:
        """Rewind to a :meth:`snapshot` (a device generator made after it is dropped: the
        next draw re-seeds a new one from the OS)."""
        cpu_state, device_states = snapshot
        self._generator.set_state(cpu_state)
        for device in list(self._device_generators):
            if device in device_states:
                self._device_generators[device].set_state(device_states[device])
            else:
                del self._device_generators[device]

    def state_dict(self) -> dict[str, Any]:
        """The mode; in seeded mode also the generator state (secret: it predicts the next
        draw). OS-seeded and secure sources save nothing that predicts or replays noise."""
        out: dict[str, Any] = {
            "secure_mode": self.secure_mode,
            "secure_num_draws": self.secure_num_draws,
            "mode": self.mode,
        }
        if self.mode == "seeded":
            out["generator_state"] = self._generator.get_state().clone()
        return out

    def check_state_dict(self, state: Any) -> None:
        """Raise :class:`InvalidHyperparameterError` if ``state`` cannot be loaded (nothing changes)."""
        if not isinstance(state, dict):
            raise InvalidHyperparameterError(f"noise state must be a dict, got {type(state).__name__}")
        if bool(state.get("secure_mode", False)) != self.secure_mode:
            raise InvalidHyperparameterError(
                f"noise state_dict has secure_mode={state.get('secure_mode')!r}, this source has "
                f"secure_mode={self.secure_mode!r}"
            )
        gen = state.get("generator_state")
        if self.mode == "seeded" and gen is not None and not (
            isinstance(gen, torch.Tensor) and gen.dtype == torch.uint8 and gen.shape == self._generator.get_state().shape
        ):
            raise InvalidHyperparameterError("noise state_dict['generator_state'] is not a CPU generator state")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Seeded: restore the generator (warns :class:`NoiseReplayWarning`, unless the state
        is the one the generator is in: no draw has followed it, so none can repeat); OS-seeded:
        re-seed from the OS; secure: nothing to restore."""
        self.check_state_dict(state)
        if self.mode == "os":
            self._generator.manual_seed(_os_seed())
            self._device_generators.clear()  # re-seeded from the OS on the next draw
        elif self.mode == "seeded" and state.get("generator_state") is not None:
            if torch.equal(state["generator_state"], self._generator.get_state()):
                return  # the state it is in (e.g. Accelerate's device-placement round trip): nothing replays
            self._generator.set_state(state["generator_state"])
            warnings.warn(
                NoiseReplayWarning(
                    "restored a seeded noise generator: the next steps draw the same noise as the "
                    "steps that followed this checkpoint before. Discard everything released after "
                    "the checkpoint, or build the optimizer without seed= (re-seeded from the OS on "
                    "restore) or with secure_mode=True."
                ),
                stacklevel=3,
            )
