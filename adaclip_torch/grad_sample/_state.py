"""Thread-local switch that mutes the forward hooks while the fallback re-runs a module.

The :mod:`torch.func` fallback calls a module's ``forward`` again (per example); the hooked
children inside it must not capture those calls as if they were part of the model's pass.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

_local = threading.local()


def hooks_muted() -> bool:
    """Whether forward hooks should ignore the current call."""
    return getattr(_local, "muted", 0) > 0


@contextmanager
def mute_hooks() -> Iterator[None]:
    """Mute the forward hooks of every :class:`GradSampleHooks` on this thread (re-entrant)."""
    _local.muted = getattr(_local, "muted", 0) + 1
    try:
        yield
    finally:
        _local.muted -= 1
