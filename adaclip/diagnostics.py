"""Is the adaptive transform adapting at all? Per-tensor read-outs of the learned scale.

Everything here reads the strategy's *state* only (a function of released values), so it may
be logged, printed or plotted freely: it reveals nothing beyond the releases.

For tensor ``k`` with scale ``b_k`` (the per-coordinate ``b`` of the step's transform
``w = (g − a)/b``) and its value ``b⁰_k`` at initialisation:

- ``max_over_min = max b_k / min b_k`` and ``q90_over_q10``: the spread of the shape inside the
  tensor (1 for flat clipping and for any per-tensor scale);
- ``scale_ratio = mean b_k / mean b⁰_k``: how far the clip level of the tensor moved;
- ``moved = ‖b_k − b⁰_k‖ / ‖b⁰_k‖``: how far the whole scale moved from its start;
- ``centre_norm = ‖a_k‖`` (0 without a centre) and ``centre_over_scale = ‖a_k/b_k‖``, the
  centre measured in clip units.

With the patent's β2 = 0.999 a few hundred steps typically leave ``moved`` at a few per cent
and both spreads near 1: that is flat clipping around a running mean.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

__all__ = ["ScaleReport", "scale_report", "format_scale_report"]


class ScaleReport(NamedTuple):
    """The read-out of one parameter tensor (see the module doc)."""

    name: str
    max_over_min: float
    q90_over_q10: float
    scale_ratio: float
    moved: float
    centre_norm: float
    centre_over_scale: float


def _numpy(x: Any, shape: tuple[int, ...] | None = None) -> np.ndarray:
    if hasattr(x, "detach"):
        x = x.detach().cpu()
    arr = np.asarray(x, dtype=np.float64)
    return np.broadcast_to(arr, shape) if shape is not None and arr.shape != shape else arr


def _templates(state: Any) -> list[Any] | None:
    for field in ("std", "mean"):
        values = getattr(state, field, None)
        if values is not None:
            return list(values)
    return None


def scale_report(
    strategy: Any,
    state: Any,
    *,
    initial_state: Any = None,
    params: Sequence[Any] | None = None,
    names: Sequence[str] | None = None,
) -> list[ScaleReport]:
    """One :class:`ScaleReport` per parameter tensor, from ``strategy.transform(state)``.

    Args:
      strategy: any strategy of :mod:`adaclip.strategies`.
      state: its current :class:`~adaclip.strategies.ClipState`.
      initial_state: the state to measure movement from; default ``strategy.init`` of arrays
        shaped like the state's statistics (or like ``params``). Pass the state you started
        from when it was not the default (e.g. public statistics).
      params: arrays shaped like the parameters; needed only for strategies whose state holds
        no per-tensor arrays (flat, quantile, automatic clipping), to know the shapes.
      names: a name per tensor (default ``"0"``, ``"1"``, ...).
    """
    templates = _templates(state) if params is None else list(params)
    if templates is None:
        raise ValueError(f"{type(strategy).__name__}'s state has no per-tensor arrays: pass params= for the shapes")
    num = len(templates)
    if initial_state is None:
        initial_state = strategy.init(templates)
    centre, scale = strategy.transform(state, num)
    _, scale0 = strategy.transform(initial_state, num)
    names = [str(k) for k in range(num)] if names is None else list(names)
    if len(names) != num:
        raise ValueError(f"{len(names)} names for {num} tensors")
    out = []
    for k in range(num):
        shape = tuple(templates[k].shape)
        b = _numpy(scale[k], shape).ravel()
        b0 = _numpy(scale0[k], shape).ravel()
        q10, q90 = np.quantile(b, [0.1, 0.9])
        a = np.zeros_like(b) if centre is None else _numpy(centre[k], shape).ravel()
        norm0 = float(np.linalg.norm(b0))
        out.append(
            ScaleReport(
                name=names[k],
                max_over_min=float(b.max() / b.min()) if b.size and b.min() > 0 else float("inf"),
                q90_over_q10=float(q90 / q10) if q10 > 0 else float("inf"),
                scale_ratio=float(b.mean() / b0.mean()) if b0.size else 1.0,
                moved=float(np.linalg.norm(b - b0) / norm0) if norm0 > 0 else 0.0,
                centre_norm=float(np.linalg.norm(a)),
                centre_over_scale=float(np.linalg.norm(a / b)) if b.size else 0.0,
            )
        )
    return out


def format_scale_report(reports: Sequence[ScaleReport]) -> str:
    """A plain-text table of :func:`scale_report`'s rows."""
    head = f"{'tensor':<24} {'max/min':>8} {'q90/q10':>8} {'level':>7} {'moved':>7} {'‖a/b‖':>8}"
    rows = [
        f"{r.name[:24]:<24} {r.max_over_min:8.3g} {r.q90_over_q10:8.3g} {r.scale_ratio:7.3g} "
        f"{r.moved:7.3g} {r.centre_over_scale:8.3g}"
        for r in reports
    ]
    return "\n".join([head, *rows])
