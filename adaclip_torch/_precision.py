"""Full float32 precision for the library's own norm and clipped-sum products.

Why it matters for privacy. Every unit's contribution to the clipped sum must have norm at most
its clip radius: the per-unit norm the engine computes is an *upper bound* of the exact one (the
computed value plus a bound on its rounding, :func:`adaclip.transform.rounding_margin` and the
ghost error terms of :mod:`adaclip_torch.ghost`), so rounding can only over-clip. Those bounds
assume IEEE float32 products, unit roundoff ``u = 2⁻²⁴``. PyTorch lets a program trade that
precision for speed, process-wide:

- ``torch.set_float32_matmul_precision("high")`` (TF32 on NVIDIA GPUs: the inputs of a product
  rounded to 10 mantissa bits, ``u = 2⁻¹¹``) or ``"medium"`` (also bfloat16, ``u = 2⁻⁸``, where a
  fast kernel exists: oneDNN on CPUs with AVX512-BF16/AMX runs float32 matrix products in
  bfloat16), and ``torch.backends.cuda.matmul.allow_tf32 = True``, the same switch;
- from torch 2.9 the per-backend settings ``torch.backends.cuda.matmul.fp32_precision``
  (``"tf32"``) and ``torch.backends.mkldnn.matmul.fp32_precision`` (``"tf32"``, ``"bf16"``), and
  their parents ``torch.backends.cudnn.fp32_precision`` / ``torch.backends.fp32_precision``.

Under them a matrix product's inputs are rounded to the reduced format before they are
multiplied. The ghost engine's norms are matrix products (Gram matrices ``X Xᵀ``, ``E Eᵀ``,
``(e²)ᵀD(x²)``, the tied-weight cross terms) and so is every clipped sum (``Eᵀ diag(c) X`` on
the ghost path, ``Σ_i c_i g_i`` as a ``tensordot`` on materialised gradients): the sum then adds,
in effect, ``round(c_i)·round(g_i)``, whose norm can exceed ``c_i‖g_i‖`` by about ``2u``
relative: 1e-3 with TF32, 1e-2 with bfloat16, far above the float32 margin (about 1e-4 for 10⁶
entries), and the ghost norms' own error bounds no longer hold. A unit would be under-clipped by
that much: its sensitivity would exceed the one the noise was calibrated to.

Autocast does the same where it is active: under ``torch.autocast(device_type, dtype=torch.bfloat16)``
(or float16) a matrix product of float32 tensors runs in the lower precision, whatever the
float32 settings. A program that calls ``opt.step()`` inside the autocast block of its forward
(or its backward) would then have the ghost norms and the clipped sums computed in bfloat16:
measured on a tiny GPT-2 before this guard also disabled autocast, ghost-clipped contributions
reached 1.00005·C and the materialised clipped sums were 2e-3 off (relative)
(``tests/test_torch_mixed_precision_hf.py``).

What is guarded. :class:`full_float32_precision` sets float32 matrix products to full IEEE
precision and disables autocast (every device type where it is enabled, in the calling thread:
autocast is thread-local) for the duration of the library's norm and clipped-sum computations,
and puts the user's settings back on exit, also when the computation raises:
:meth:`~adaclip_torch.engines.materialise.MaterialisedEngine.clipped_sum` (every engine's core
path: ghost norms and weighted sums, tied-weight cross terms, the materialised ``tensordot``),
:meth:`~adaclip_torch.ghost.GhostLayer.norm` / ``weighted_sum`` and the same of
:class:`~adaclip_torch.ghost.TiedGhost` when called directly, and the torch reference release of
:mod:`adaclip_torch.kernels.reference` (``c @ g``). Not guarded, because it is no privacy issue:
the user's forward and backward, and the products that *form* per-example gradients (the
grad-sample rules' ``einsum``/``bmm``, a ghost layer's :meth:`~adaclip_torch.ghost.GhostLayer.materialise`
for per-user sums): a unit's norm and its contribution to the sum are then both computed from
that one tensor, so a less precise ``g_i`` is still clipped to its own norm. Convolution
settings (``torch.backends.cudnn.allow_tf32``, ``cudnn.conv.fp32_precision``) are left alone:
no convolution runs in the guarded computations (the ghost path treats a convolution as a
``Linear`` layer on unfolded patches: ``unfold`` and matrix products), and
``tests/test_torch_matmul_precision.py`` checks that. The Triton kernels use no matrix products.

Cost. On a GPU where the user's program runs float32 products in TF32, the library's own
products run at full float32 speed instead (several times slower per product on tensor-core
GPUs); the user's model keeps the precision the user chose. With torch's default settings
nothing is written (the products are IEEE already), so results are the same bit for bit with or
without the guard; otherwise entering and leaving cost a few setting reads and writes, once per
step (nested uses only count a depth). Autocast costs one flag read per use where it is off,
and an autocast context entered and left per device type where it is on (by the outermost use
of the thread only).

Threads. The settings are process-wide: while a library computation runs, other threads' float32
products also run at full precision, and a setting another thread changes meanwhile is
overwritten on exit. Overlapping uses from several threads share one saved state (a depth count
under a lock), so the user's values come back when the last one leaves. Autocast is
thread-local: each thread's guard disables and restores its own.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, NamedTuple

import torch

__all__ = ["full_float32_precision"]

#: Values of torch ≥ 2.9's ``fp32_precision`` that mean full IEEE float32 (``"none"``: nothing
#: set at any level, i.e. torch's default, which is IEEE for matrix products).
_FULL = ("ieee", "none")


def _matmul_holders() -> tuple[Any, ...]:
    """The objects carrying torch ≥ 2.9's per-backend ``fp32_precision`` of float32 matrix
    products: cuBLAS's and oneDNN's. Empty on older torch, which has the legacy switch only."""
    try:
        holders = (torch.backends.cuda.matmul, torch.backends.mkldnn.matmul)
        for h in holders:
            h.fp32_precision  # noqa: B018 -- raises AttributeError where the setting does not exist
    except AttributeError:
        return ()
    return holders


_HOLDERS = _matmul_holders()


class _Saved(NamedTuple):
    """The user's settings: the legacy precision string (``None`` where torch cannot state it,
    see :func:`_legacy_precision`) and, on torch ≥ 2.9, each holder's ``fp32_precision`` as read."""

    precision: str | None
    per_backend: tuple[str, ...]


def _legacy_precision() -> str | None:
    """``torch.get_float32_matmul_precision()``, or ``None`` where torch ≥ 2.9 refuses it (the
    per-backend settings were set to a mix the legacy string cannot express)."""
    try:
        return torch.get_float32_matmul_precision()
    except RuntimeError:
        return None


def _set_full() -> _Saved:
    """Full IEEE float32 matrix products; returns the settings found.

    Where the legacy string is readable and not ``"highest"`` (the user set ``"high"``,
    ``"medium"`` or ``allow_tf32``), it is set to ``"highest"`` through the legacy call, which also
    sets both per-backend values to ``"ieee"``: torch ≥ 2.9 keeps the legacy string as a separate
    variable and checks it against the per-backend values when anything queries it (the profiler,
    ``allow_tf32``), so the two must agree inside the guarded code as they did outside. Then any
    per-backend value still reduced is set to ``"ieee"``."""
    saved = _Saved(_legacy_precision(), tuple(h.fp32_precision for h in _HOLDERS))
    if saved.precision not in (None, "highest"):
        torch.set_float32_matmul_precision("highest")
    try:
        for h in _HOLDERS:
            if h.fp32_precision not in _FULL:
                h.fp32_precision = "ieee"
    except BaseException:
        _restore(saved)
        raise
    return saved


def _restore(saved: _Saved) -> None:
    """Put the user's settings back: the legacy string through the legacy call, then each
    per-backend value that differs from the one read on entry.

    torch's getters report the *effective* per-backend value (a holder at ``"none"`` inherits its
    parent's), so a value is first restored as ``"none"`` and only written explicitly where
    inheriting does not give it back: a later change of the parent setting by the user then still
    reaches a holder that inherited it before."""
    if saved.precision not in (None, "highest"):
        torch.set_float32_matmul_precision(saved.precision)
    for h, value in zip(_HOLDERS, saved.per_backend):
        if h.fp32_precision != value:
            h.fp32_precision = "none"
            if h.fp32_precision != value:
                h.fp32_precision = value


_lock = threading.Lock()
_depth = 0
_saved: _Saved | None = None


class full_float32_precision(contextlib.ContextDecorator):  # lower case: used like torch.no_grad
    """Run the enclosed code (or the decorated function) with float32 matrix products in full IEEE
    precision and autocast disabled (in the calling thread), restoring the user's settings on
    exit, also on an exception. Reentrant, and cheap when nested: only the outermost use (per
    process) reads and writes the precision settings, and only the outermost use of a thread
    enters ``torch.autocast(device_type, enabled=False)``, for the device types where autocast is
    on. The privacy argument, what is guarded and the cost: the module doc
    (:mod:`adaclip_torch._precision`)."""

    def __enter__(self) -> full_float32_precision:
        global _depth, _saved
        with _lock:
            if _depth == 0:
                _saved = _set_full()
            _depth += 1
        try:
            _autocast_off()
        except BaseException:
            self._leave_settings()
            raise
        return self

    def __exit__(self, *exc: object) -> bool:
        try:
            _autocast_restore()
        finally:
            self._leave_settings()
        return False

    @staticmethod
    def _leave_settings() -> None:
        global _depth, _saved
        with _lock:
            _depth -= 1
            if _depth == 0:
                saved, _saved = _saved, None
                assert saved is not None
                _restore(saved)


#: Device types whose autocast state is checked (those ``torch.autocast`` knows; one this torch
#: does not know reads as disabled).
_AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu", "mtia", "maia", "xla", "ipu")

#: Per thread (autocast is thread-local), a stack of the autocast-disabling contexts entered by
#: the guards in progress, innermost last (an empty list where autocast was off already).
_autocast_local = threading.local()


def _autocast_enabled(device_type: str) -> bool:
    try:
        return bool(torch.is_autocast_enabled(device_type))
    except TypeError:  # torch < 2.4: no device argument
        if device_type == "cpu":
            return bool(torch.is_autocast_cpu_enabled())
        return device_type == "cuda" and bool(torch.is_autocast_enabled())
    except RuntimeError:  # a device type this torch does not know
        return False


#: torch's one-call check of every device type's autocast flag (private; absent on some
#: versions: then each device type is read).
_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", None)


def _autocast_off() -> None:
    """Disable autocast in this thread for every device type where it is enabled. Where it is
    off, or a guard of this thread is open already (nested uses: the outer one disabled it),
    nothing is entered and the cost is a flag read."""
    stack = _autocast_local.__dict__.setdefault("stack", [])
    entered: list[Any] = []
    if stack or (_any_autocast is not None and not _any_autocast()):
        stack.append(entered)
        return
    try:
        for device_type in _AUTOCAST_DEVICES:
            if _autocast_enabled(device_type):
                cm = torch.autocast(device_type, enabled=False)
                cm.__enter__()
                entered.append(cm)
    except BaseException:
        for cm in reversed(entered):
            cm.__exit__(None, None, None)
        raise
    stack.append(entered)


def _autocast_restore() -> None:
    """Leave the autocast-disabling contexts of the innermost guard of this thread."""
    for cm in reversed(_autocast_local.stack.pop()):
        cm.__exit__(None, None, None)
