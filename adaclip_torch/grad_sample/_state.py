"""Thread-local switches that mute the hooks while the engine re-runs part of the model.

- :func:`mute_hooks`: the :mod:`torch.func` fallback calls a module's ``forward`` again (per
  example); the hooked children inside it must not capture those calls as if they were part of
  the model's pass.
- :func:`mute_backward`: routing the per-example gradient of a batch-free call
  (:mod:`adaclip_torch.grad_sample.batch_free`) runs a nested, batched backward pass over a
  part of the graph from inside a gradient hook; the gradient hooks it meets there (each
  carrying one example's gradient under vmap) must not store anything.
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


def backward_muted() -> bool:
    """Whether gradient hooks should ignore the current backward pass (a nested one)."""
    return getattr(_local, "backward_muted", 0) > 0


@contextmanager
def mute_backward() -> Iterator[None]:
    """Mute the gradient hooks of every :class:`GradSampleHooks` on this thread (re-entrant)."""
    _local.backward_muted = getattr(_local, "backward_muted", 0) + 1
    try:
        yield
    finally:
        _local.backward_muted -= 1
