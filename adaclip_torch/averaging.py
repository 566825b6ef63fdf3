"""Parameter averaging for PyTorch: an EMA or tail average of a model's trainable parameters.

.. code-block:: python

    from adaclip_torch import ParameterAverage
    avg = ParameterAverage(model, kind="ema", total_steps=steps)   # H = 10 % of the run
    avg.attach(optimizer)              # updates after every optimizer.step()
    ...train...
    with avg.averaged():               # the averaged values in the model, live ones restored after
        evaluate(model); torch.save(model.state_dict(), "averaged.pt")

The maths (EMA with warm-up, tail average, default horizon) and the privacy argument are in
:mod:`adaclip.averaging`: the average is post-processing of the released iterates, free in
privacy, as long as it is updated only from the parameters after a private step —
:meth:`ParameterAverage.attach` hooks exactly that moment.

**What is averaged: the trainable parameters only** (``requires_grad=True`` when the average is
made, named as in ``model.named_parameters()``). Frozen parameters do not change, so their
average is themselves. Buffers are not averaged: a private model has no batch-norm running
statistics (:mod:`adaclip_torch.validation` refuses batch norm), and the buffers it may hold
(positional tables, masks, step counters) are not trained by the optimizer, so
:meth:`~ParameterAverage.averaged` leaves them as they are.

**Attaching to a DPOptimizer.** :class:`adaclip_torch.DPOptimizer` subclasses
``torch.optim.Optimizer`` but deliberately does not call its ``__init__`` (its parameter groups
and state are the wrapped optimizer's), so it has no hook registry and its ``step`` is not
the hook-calling wrapper: ``register_step_post_hook`` on it raises ``AttributeError``.
:meth:`ParameterAverage.attach` therefore registers the hook on the wrapped optimizer
(``optimizer.original_optimizer``), whose ``step()`` the private step calls exactly once, on the
noisy gradient, after the release. Virtual steps (``accumulate()``) do not step it, so they do
not update the average; every logical step does, once.

**FSDP2-sharded parameters** (``fully_shard``): each rank averages its own shards
(``p.to_local()``), so the average is sharded like the parameters and costs ``d/R`` numbers per
rank; :meth:`~ParameterAverage.averaged` swaps the averaged shards in on every rank, and
:meth:`~ParameterAverage.state_dict` holds this rank's shards (save one per rank). Every rank
applies the same release to its shard, so the shards average exactly as the full parameters
would.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from adaclip.averaging import AveragingConfig, averaging_weight, config_from_spec, default_horizon
from adaclip.errors import InvalidHyperparameterError

__all__ = ["ParameterAverage"]

_STATE_KEYS = ("config", "count", "average")


def _local(p: Tensor) -> Tensor:
    """The tensor the average is kept for: a DTensor's local shard (FSDP2), else ``p``."""
    to_local = getattr(p, "to_local", None)
    return to_local() if to_local is not None and hasattr(p, "device_mesh") else p


def _inner_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The optimizer whose ``step()`` fires hooks: the innermost ``original_optimizer``."""
    target = optimizer
    seen = set()
    while hasattr(target, "original_optimizer") and id(target) not in seen:
        seen.add(id(target))
        target = target.original_optimizer
    if not isinstance(target, torch.optim.Optimizer):
        raise InvalidHyperparameterError(f"optimizer must be a torch.optim.Optimizer, got {optimizer!r}")
    return target


class ParameterAverage:
    """Averaged copies of a model's trainable parameters (EMA with warm-up, or tail average).

    Args:
      model: the model whose trainable parameters (``requires_grad`` now) are averaged; the
        average starts at their current values (``θ̄_0 = θ_0``).
      kind: ``"ema"`` or ``"tail"`` (see :class:`adaclip.averaging.AveragingConfig`).
      decay: the EMA decay ``μ`` in ``[0, 1)``.
      horizon: the EMA horizon ``H`` in steps (``μ = 1 − 1/H``).
      start: the first averaged step (tail: the start of the window; EMA: the warm-up counts
        from it); before it the average follows the parameters. For ``kind="tail"`` without
        ``start`` but with ``total_steps``, the window is the last
        :func:`~adaclip.averaging.default_horizon` steps.
      warmup: the EMA warm-up ``μ_t = min(μ, (1 + t)/(10 + t))``.
      total_steps: the planned number of optimizer steps; an EMA without ``decay`` or
        ``horizon`` spans :func:`~adaclip.averaging.default_horizon` of it (10 % of the run).

    The copies keep each parameter's dtype and device. Updates run under ``torch.no_grad()``
    with ``torch._foreach_lerp_`` (one fused pass over all tensors).

    Raises:
      InvalidHyperparameterError: an invalid configuration (an EMA with neither ``decay``,
        ``horizon`` nor ``total_steps``, say), or a model without trainable parameters.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        kind: str = "ema",
        decay: float | None = None,
        horizon: float | None = None,
        start: int | None = None,
        warmup: bool = True,
        total_steps: int | None = None,
    ) -> None:
        if kind == "ema" and decay is None and horizon is None:
            if total_steps is None:
                raise InvalidHyperparameterError(
                    "an EMA needs decay, horizon or total_steps (for the default horizon, 10 % of the run)"
                )
            horizon = default_horizon(total_steps)
        if kind == "tail" and start is None:
            start = 0 if total_steps is None else int(total_steps) - default_horizon(total_steps)
        config = AveragingConfig(
            kind=kind, decay=decay, horizon=horizon, start=0 if start is None else start, warmup=warmup
        )
        self._setup(model, config)

    def _setup(self, model: nn.Module, config: AveragingConfig) -> None:
        if not isinstance(model, nn.Module):
            raise InvalidHyperparameterError(f"model must be a torch.nn.Module, got {model!r}")
        if not isinstance(config, AveragingConfig):
            raise InvalidHyperparameterError(f"config must be an AveragingConfig, got {config!r}")
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise InvalidHyperparameterError("the model has no trainable parameters to average")
        self.config = config
        self.model = model
        self.names: tuple[str, ...] = tuple(n for n, _ in named)
        self._params: list[nn.Parameter] = [p for _, p in named]
        with torch.no_grad():
            self._average: list[Tensor] = [_local(p).detach().clone() for p in self._params]
        self._count = 0
        self._swapped = 0
        self._handle: RemovableHandle | None = None

    @classmethod
    def from_config(cls, model: nn.Module, config: AveragingConfig) -> ParameterAverage:
        """A :class:`ParameterAverage` of ``model`` with an :class:`~adaclip.averaging.AveragingConfig`."""
        self = cls.__new__(cls)
        self._setup(model, config)
        return self

    @classmethod
    def from_spec(cls, model: nn.Module, spec: Any, total_steps: int | None = None) -> ParameterAverage | None:
        """``None`` for ``spec=None``, else a :class:`ParameterAverage` of ``model``.

        ``spec`` is what :func:`adaclip.averaging.config_from_spec` takes: ``None``, ``"ema"``
        or ``"tail"`` (spanning the last 10 % of ``total_steps``), a decay in ``[0, 1)``, a
        mapping of :class:`~adaclip.averaging.AveragingConfig` keywords, or a config.
        """
        config = config_from_spec(spec, total_steps)
        return None if config is None else cls.from_config(model, config)

    # ------------------------------------------------------------------ the running average

    @property
    def count(self) -> int:
        """The number of updates averaged so far (0 when made)."""
        return self._count

    def _check_layout(self) -> None:
        for name, p, a in zip(self.names, self._params, self._average, strict=True):
            p = _local(p)
            if p.shape != a.shape or p.dtype != a.dtype or p.device != a.device:
                raise InvalidHyperparameterError(
                    f"parameter {name!r} changed from {a.dtype}{list(a.shape)} on {a.device} to "
                    f"{p.dtype}{list(p.shape)} on {p.device} since the average was made "
                    "(model.double(), model.to(...)?): make the average after moving the model"
                )

    def update(self) -> None:
        """Blend the model's current parameters into the average (call after each private step).

        Raises:
          InvalidHyperparameterError: inside :meth:`averaged` (the model holds the averaged
            values, and a step there is undone on exit), or a parameter changed dtype, device or
            shape since the average was made. Nothing changes then.
        """
        if self._swapped:
            raise InvalidHyperparameterError(
                "update() inside averaged(): the model holds the averaged parameters, and they are "
                "replaced by the live ones on exit. Step and update outside the averaged() block"
            )
        self._check_layout()
        w = averaging_weight(self.config, self._count)
        with torch.no_grad():
            live = [_local(p).detach() for p in self._params]
            if w == 1.0:
                torch._foreach_copy_(self._average, live)
            else:
                torch._foreach_lerp_(self._average, live, w)
        self._count += 1

    def attach(self, optimizer: torch.optim.Optimizer) -> RemovableHandle:
        """Call :meth:`update` after every ``optimizer.step()``; returns the hook's handle.

        Registered with ``register_step_post_hook`` on ``optimizer`` — or, for a
        :class:`~adaclip_torch.DPOptimizer` (anything with ``original_optimizer``), on the
        optimizer it wraps, which the private step steps once per released step (the wrapper
        itself has no hook registry). Attaching again moves the hook (one update per step).
        """
        target = _inner_optimizer(optimizer)
        self.detach()
        self._handle = target.register_step_post_hook(lambda _opt, _args, _kwargs: self.update())
        return self._handle

    def detach(self) -> None:
        """Remove the hook of :meth:`attach`, if any."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    # ------------------------------------------------------------------ using the average

    @contextlib.contextmanager
    def averaged(self) -> Iterator[nn.Module]:
        """Swap the averaged values into the model; restore the live ones on exit.

        For evaluation and saving: ``with avg.averaged(): evaluate(model)``. The live values are
        restored bit for bit, also when the body raises; anything the body writes into the
        parameters is discarded. Yields the model.
        """
        self._check_layout()
        with torch.no_grad():
            live = [_local(p).detach().clone() for p in self._params]
            torch._foreach_copy_([_local(p).detach() for p in self._params], self._average)
        self._swapped += 1
        try:
            yield self.model
        finally:
            self._swapped -= 1
            with torch.no_grad():
                torch._foreach_copy_([_local(p).detach() for p in self._params], live)

    def averaged_parameters(self) -> dict[str, Tensor]:
        """Copies of the averaged parameters, by name (``model.named_parameters()`` names)."""
        return {n: a.clone() for n, a in zip(self.names, self._average, strict=True)}

    def copy_to(self, model: nn.Module | None = None) -> None:
        """Write the averaged values into ``model``'s parameters of the same names (default: the
        averaged model itself, for good — e.g. at the end of training).

        Every name must be a parameter of ``model`` with the same shape; checked before
        anything is written. Values are cast to each target parameter's dtype and device.

        Raises:
          InvalidHyperparameterError: a missing name or a shape mismatch (nothing written).
        """
        model = self.model if model is None else model
        if not isinstance(model, nn.Module):
            raise InvalidHyperparameterError(f"model must be a torch.nn.Module, got {model!r}")
        targets = dict(model.named_parameters())
        out = []
        for name, a in zip(self.names, self._average, strict=True):
            p = targets.get(name)
            if p is None:
                raise InvalidHyperparameterError(f"the model has no parameter {name!r}")
            p = _local(p)
            if p.shape != a.shape:
                raise InvalidHyperparameterError(
                    f"parameter {name!r} has shape {list(p.shape)}, the average {list(a.shape)}"
                )
            out.append(p)
        with torch.no_grad():
            for p, a in zip(out, self._average, strict=True):
                p.copy_(a)

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """``{"config": dict, "count": int, "average": {name: tensor}}`` (copies)."""
        return {"config": self.config.as_dict(), "count": self._count, "average": self.averaged_parameters()}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved; all of it is checked before anything changes.

        Refused (:class:`~adaclip.errors.InvalidHyperparameterError`): missing or extra keys, a
        configuration different from this average's, a count that is not an integer ``>= 0``,
        names different from this model's trainable parameters, wrong shapes, non-tensors,
        non-finite values. Values are cast to each parameter's dtype and device.
        """
        if not isinstance(state_dict, Mapping):
            raise InvalidHyperparameterError(f"state_dict must be a dict, got {type(state_dict).__name__}")
        if sorted(state_dict) != sorted(_STATE_KEYS):
            raise InvalidHyperparameterError(
                f"state_dict must have exactly the keys {list(_STATE_KEYS)}, got {sorted(state_dict)}: "
                "it was not made by ParameterAverage.state_dict()"
            )
        config = state_dict["config"]
        if config != self.config.as_dict():
            raise InvalidHyperparameterError(
                f"state_dict was saved with averaging {config!r}, this average is {self.config.as_dict()!r}"
            )
        count = state_dict["count"]
        if isinstance(count, bool) or not hasattr(count, "__index__") or int(count) < 0:
            raise InvalidHyperparameterError(f"state_dict['count'] must be an integer >= 0, got {count!r}")
        average = state_dict["average"]
        if not isinstance(average, Mapping) or list(average) != list(self.names):
            got = list(average) if isinstance(average, Mapping) else type(average).__name__
            raise InvalidHyperparameterError(
                f"state_dict['average'] must hold the parameters {list(self.names)}, in that order, got {got}"
            )
        new = []
        for name, a in zip(self.names, self._average, strict=True):
            v = average[name]
            if not isinstance(v, Tensor):
                raise InvalidHyperparameterError(f"state_dict['average'][{name!r}] is not a tensor: {v!r}")
            if v.shape != a.shape:
                raise InvalidHyperparameterError(
                    f"state_dict['average'][{name!r}] has shape {list(v.shape)}, expected {list(a.shape)}"
                )
            if v.is_floating_point() or v.is_complex():
                if not bool(torch.isfinite(v).all()):
                    raise InvalidHyperparameterError(f"state_dict['average'][{name!r}] is not finite")
            new.append(v.detach().to(dtype=a.dtype, device=a.device, copy=True))
        self._average = new
        self._count = int(count)

    def __repr__(self) -> str:
        cfg = self.config
        what = (
            f"ema μ={cfg.effective_decay:.6g}{'' if cfg.warmup else ', no warm-up'}"
            if cfg.kind == "ema"
            else "tail"
        )
        if cfg.start:
            what += f", start={cfg.start}"
        return f"ParameterAverage({what}, {len(self.names)} tensors, count={self._count})"

