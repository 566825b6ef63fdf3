"""Checkpoints of a :class:`~adaclip_torch.optimizer.DPOptimizer`: what is saved, and how a
saved dict is checked before any of it is restored.

:func:`dump` builds the dict that :meth:`DPOptimizer.state_dict` returns. Restoring is split
in the three phases :meth:`DPOptimizer.load_state_dict` chains:

- :func:`validate` reads the whole checkpoint and returns a :class:`Restored` (the clip state,
  the step count, the correlated-noise stream's state, whether the accountant is kept); it
  changes nothing and raises :class:`~adaclip.errors.InvalidHyperparameterError` for anything
  malformed or of another configuration;
- :class:`Snapshot` holds the parts that validate themselves only while loading (the wrapped
  optimizer, the accountant, the parameter average); :func:`load_delegated` loads them, and
  the snapshot puts all three back if one refuses;
- the optimizer then commits the rest (noise generator, clip state, step count), which can no
  longer fail.

So a refused checkpoint leaves every piece of the optimizer's state as it was.

What is secret: nothing saved is un-noised — the clipping statistics (and every ``extra`` entry)
are functions of released values and the accountant holds hyperparameters; a seeded noise
generator's state (and the banded noise's buffers, saved with it) predicts the next noise, so
such a checkpoint is as secret as the seed.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from adaclip import transform as _transform
from adaclip.errors import InvalidGradientError, InvalidHyperparameterError
from adaclip.strategies import ClipState

if TYPE_CHECKING:
    from adaclip_torch.optimizer import DPOptimizer

__all__ = ["STATE_KEYS", "Restored", "Snapshot", "dump", "validate", "load_delegated"]

Tensor = torch.Tensor

#: The keys every checkpoint has (``noise_stream`` and ``averaging`` come with those options).
STATE_KEYS = ("optimizer", "clip_state", "steps", "noise", "accountant")


# --------------------------------------------------------------------------- dump


def dump(opt: DPOptimizer) -> dict[str, Any]:
    """The checkpoint of ``opt`` (see :meth:`DPOptimizer.state_dict`); refused between
    :meth:`~DPOptimizer.accumulate` and :meth:`~DPOptimizer.step`."""
    if opt._accumulated is not None:
        raise InvalidGradientError(
            "state_dict() after accumulate() and before step(): the accumulated clipped sum is "
            "not noised yet and must not be saved; call step() first (or discard_pending() to "
            "drop it)"
        )
    state = opt._clip_state
    stream = opt._stream
    return {
        "optimizer": opt.original_optimizer.state_dict(),
        "clip_state": {
            "step": int(state.step),
            "mean": None if state.mean is None else [m.detach().clone() for m in state.mean],
            "std": None if state.std is None else [s.detach().clone() for s in state.std],
            "extra": copy_extra(state.extra),
        },
        "steps": opt._steps,
        "noise": opt._noise.state_dict(),
        "accountant": None if opt.accountant is None else opt.accountant.state_dict(),
        **({} if stream is None else {"noise_stream": stream.state_dict(with_buffers=opt._noise.mode == "seeded")}),
        **({} if opt.average is None else {"averaging": opt.average.state_dict()}),
    }


def copy_extra(extra: dict[str, Any] | None) -> dict[str, Any] | None:
    """A detached copy of ``ClipState.extra`` (lists of tensors or ``None``, and 0-d tensors)."""
    if extra is None:
        return None
    return {
        key: [None if t is None else t.detach().clone() for t in value]
        if isinstance(value, (list, tuple))
        else value.detach().clone()
        for key, value in extra.items()
    }


# --------------------------------------------------------------------------- validate


class Restored(NamedTuple):
    """What :func:`validate` read from a checkpoint, ready to be committed."""

    clip_state: ClipState
    steps: int
    #: the correlated-noise stream's parsed state (``None`` with independent noise)
    stream: Any
    #: keep the attached accountant's history (it is ahead of the checkpoint's)
    keep_accountant: bool


def validate(opt: DPOptimizer, state_dict: Any) -> Restored:
    """Check every part of ``state_dict`` against ``opt`` without changing anything."""
    if not isinstance(state_dict, dict):
        raise InvalidHyperparameterError(f"state_dict must be a dict, got {type(state_dict).__name__}")
    missing = [k for k in STATE_KEYS if k not in state_dict]
    if missing:
        raise InvalidHyperparameterError(
            f"state_dict is missing {missing}: it was not made by DPOptimizer.state_dict()"
        )
    if state_dict.get("accumulated") is not None:
        raise InvalidHyperparameterError(
            "state_dict holds an accumulated clipped sum: un-noised sums are never restored"
        )
    clip_state = clip_state_from(opt, state_dict["clip_state"])
    if ("averaging" in state_dict) != (opt.average is not None):
        raise InvalidHyperparameterError(
            "state_dict and this optimizer disagree on whether a parameter average is kept"
        )
    if "noise_stream" in state_dict and opt._stream is None:
        raise InvalidHyperparameterError(
            "state_dict has a correlated-noise stream but this optimizer uses independent noise"
        )
    if (state_dict["accountant"] is None) != (opt.accountant is None):
        raise InvalidHyperparameterError(
            "state_dict and this optimizer disagree on whether an accountant is attached"
        )
    steps = count("state_dict['steps']", state_dict["steps"])
    opt._noise.check_state_dict(state_dict["noise"])
    # correlated noise: the buffers come back only with the generator (seeded mode);
    # otherwise the stream restarts with a new accounting cycle
    stream = None if opt._stream is None else opt._stream.parse_state(
        state_dict.get("noise_stream") if opt._noise.mode == "seeded" else None, steps=steps, shapes=opt._shapes
    )
    keep = accountant_is_ahead_of(opt.accountant, state_dict["accountant"])
    return Restored(clip_state, steps, stream, keep)


def accountant_is_ahead_of(accountant: Any, saved: Any) -> bool:
    """Whether the attached accountant has recorded more steps than the checkpoint's (an
    in-process rewind): it is then kept, as an accountant never forgets a release."""
    if accountant is None or not hasattr(accountant, "steps"):
        return False
    probe = copy.deepcopy(accountant)
    probe.load_state_dict(saved)  # validates it (raises before anything changes)
    return int(accountant.steps) > int(probe.steps)


def count(what: str, value: Any) -> int:
    """A step count from a checkpoint: an integer ``>= 0`` (a 0-d integer tensor is accepted)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.dtype.is_floating_point:
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidHyperparameterError(f"{what} must be an int >= 0, got {value!r}")
    return value


def like(x: Any, shape: tuple[int, ...], device: torch.device, what: str, dtype: torch.dtype) -> Tensor:
    """``x`` as a finite ``dtype`` tensor of ``shape`` on ``device`` (a copy)."""
    try:
        t = torch.as_tensor(x)
    except (TypeError, ValueError, RuntimeError):
        raise InvalidHyperparameterError(f"state_dict {what} is not a tensor: {type(x).__name__}") from None
    if tuple(t.shape) != tuple(shape):
        raise InvalidHyperparameterError(f"state_dict {what} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    if not (t.dtype.is_floating_point or t.dtype in (torch.int32, torch.int64)):
        raise InvalidHyperparameterError(f"state_dict {what} has dtype {t.dtype}, expected a real dtype")
    t = t.to(dtype=dtype, device=device).clone()
    if not bool(torch.isfinite(t).all()):
        raise InvalidHyperparameterError(f"state_dict {what} contains NaN or inf")
    return t


def like_param(opt: DPOptimizer, x: Any, k: int, what: str) -> Tensor:
    """:func:`like` for an entry that has the shape of privatised parameter ``k``."""
    label = f"{what} for {opt.param_names[k]!r}"
    return like(x, opt._shapes[k], opt.params[k].device, label, opt._dtype)


def clip_state_from(opt: DPOptimizer, saved: Any) -> ClipState:
    """The :class:`~adaclip.strategies.ClipState` of a checkpoint, checked against ``opt``'s
    strategy (``None``-ness, count and shapes of ``mean``/``std``, ``std`` within
    ``[std_min, std_max]`` up to rounding, the option state) and copied."""
    if not isinstance(saved, dict) or "step" not in saved:
        raise InvalidHyperparameterError("state_dict['clip_state'] must be a dict with 'step', 'mean' and 'std'")

    def tensors(key: str) -> list[Tensor] | None:
        values = saved.get(key)
        if (values is None) != (getattr(opt._clip_state, key) is None):
            raise InvalidHyperparameterError(f"state_dict clip_state[{key!r}] does not match the strategy")
        if values is None:
            return None
        if len(values) != len(opt.params):
            raise InvalidHyperparameterError(
                f"state_dict clip_state[{key!r}] has {len(values)} tensors, expected {len(opt.params)}"
            )
        return [like_param(opt, v, k, f"clip_state[{key!r}]") for k, v in enumerate(values)]

    std = tensors("std")
    if std is not None:
        # s always stays in [std_min, std_max]; allow the rounding of the statistics dtype
        slack = 16 * _transform.unit_roundoff(opt._dtype)
        low, high = opt.strategy.std_min * (1 - slack), opt.strategy.std_max * (1 + slack)
        for k, v in enumerate(std):
            if float(v.min()) < low or float(v.max()) > high:
                raise InvalidHyperparameterError(
                    f"state_dict clip_state['std'] for {opt.param_names[k]!r} is outside "
                    f"[std_min, std_max] = [{opt.strategy.std_min}, {opt.strategy.std_max}] "
                    f"(min {float(v.min())}, max {float(v.max())})"
                )
    step = count("state_dict clip_state['step']", saved["step"])
    extra = extra_from(opt, saved.get("extra"))
    return ClipState(step=step, mean=tensors("mean"), std=std, extra=extra)


def extra_from(opt: DPOptimizer, saved: Any) -> dict[str, Any] | None:
    """The option state ``clip_state["extra"]`` of a checkpoint, checked against ``opt``'s
    strategy (the keys, and per entry ``None``-ness, shape and range) and copied."""
    template = opt._clip_state.extra
    strategy_name = type(opt.strategy).__name__
    if template is None:
        if saved:
            raise InvalidHyperparameterError(
                f"state_dict clip_state['extra'] has option state {sorted(saved) if isinstance(saved, dict) else saved!r}, "
                f"but {strategy_name} keeps none: the checkpoint is of another strategy"
            )
        return None
    if not isinstance(saved, dict):
        raise InvalidHyperparameterError(
            f"state_dict clip_state['extra'] must be a dict with {sorted(template)} (the option state of "
            f"{strategy_name}), got {type(saved).__name__}: the checkpoint is of another "
            "strategy or options"
        )
    if set(saved) != set(template):
        missing, unexpected = sorted(set(template) - set(saved)), sorted(set(saved) - set(template))
        raise InvalidHyperparameterError(
            f"state_dict clip_state['extra'] does not match the strategy's options: missing {missing}, "
            f"unexpected {unexpected}"
        )
    out: dict[str, Any] = {}
    for key, ref in template.items():
        what = f"clip_state['extra'][{key!r}]"
        if isinstance(ref, list):
            out[key] = _extra_list(opt, saved[key], ref, what)
            checked = [e for e in out[key] if e is not None]
        else:
            out[key] = like(saved[key], tuple(ref.shape), ref.device, what, opt._dtype)
            checked = [out[key]]
        check_extra_values(key, checked, what, getattr(opt.strategy, "update_every", None))
    return out


def _extra_list(opt: DPOptimizer, value: Any, template: list[Any], what: str) -> list[Tensor | None]:
    """A per-tensor ``extra`` entry (one tensor or ``None`` per parameter), like ``template``."""
    if not isinstance(value, (list, tuple)) or len(value) != len(template):
        raise InvalidHyperparameterError(
            f"state_dict {what} must be a list of {len(template)} entries (one per tensor), got {value!r}"[:300]
        )
    entries: list[Tensor | None] = []
    for k, (v, ref) in enumerate(zip(value, template, strict=True)):
        label = f"{what} for {opt.param_names[k]!r}"
        if (v is None) != (ref is None):
            raise InvalidHyperparameterError(
                f"state_dict {label} is {'None' if v is None else 'a tensor'}, expected "
                f"{'None (the entry does not apply to this tensor)' if ref is None else 'a tensor'}"
            )
        entries.append(None if v is None else like(v, tuple(ref.shape), ref.device, label, opt._dtype))
    return entries


def check_extra_values(key: str, tensors: Sequence[Tensor], what: str, update_every: Any) -> None:
    """The ranges of the documented ``extra`` entries (already finite): ``clip_norm > 0``;
    ``window_count`` a whole number in ``[0, update_every)``; ``window_noise >= 0`` (a sum of
    noise variances); ``centre_var >= 0`` or ``-1`` (no observation yet). The variance
    accumulators may be negative (the unbiased correction) and are only required finite."""
    for t in tensors:
        if key == "clip_norm" and not bool((t > 0).all()):
            raise InvalidHyperparameterError(f"state_dict {what} must be > 0, got {t.tolist()!r}")
        if key == "window_count":
            ok = bool(((t >= 0) & (t == torch.round(t))).all())
            if ok and isinstance(update_every, int):
                ok = bool((t < update_every).all())
            if not ok:
                raise InvalidHyperparameterError(
                    f"state_dict {what} must be a whole number in [0, update_every={update_every}), got {t.tolist()!r}"
                )
        if key == "window_noise" and not bool((t >= 0).all()):
            raise InvalidHyperparameterError(f"state_dict {what} must be >= 0 (a sum of noise variances)")
        if key == "centre_var" and not bool(((t >= 0) | (t == -1)).all()):
            raise InvalidHyperparameterError(
                f"state_dict {what} must be >= 0, or -1 where no release has been observed yet"
            )


# --------------------------------------------------------------------------- snapshot and delegated loads


class Snapshot(NamedTuple):
    """The parts of the optimizer that validate themselves only while loading — the wrapped
    optimizer, the accountant, the parameter average — as they were before a restore."""

    optimizer: dict[str, Any]
    accountant: Any
    average: Any

    @classmethod
    def take(cls, opt: DPOptimizer) -> Snapshot:
        return cls(
            copy.deepcopy(opt.original_optimizer.state_dict()),
            None if opt.accountant is None else opt.accountant.state_dict(),
            None if opt.average is None else opt.average.state_dict(),
        )

    def restore(self, opt: DPOptimizer) -> None:
        """Put the three parts back (after one of them refused its part of a checkpoint)."""
        opt.original_optimizer.load_state_dict(self.optimizer)
        if opt.accountant is not None:
            opt.accountant.load_state_dict(self.accountant)
        if opt.average is not None:
            opt.average.load_state_dict(self.average)


def load_delegated(opt: DPOptimizer, state_dict: dict[str, Any], *, keep_accountant: bool) -> None:
    """Load the parts that check themselves: the wrapped optimizer, the accountant (unless it is
    kept) and the parameter average. Take a :class:`Snapshot` first: one of them may refuse
    after another has loaded."""
    opt.original_optimizer.load_state_dict(state_dict["optimizer"])
    if opt.accountant is not None and not keep_accountant:
        opt.accountant.load_state_dict(state_dict["accountant"])
    if opt.average is not None:
        opt.average.load_state_dict(state_dict["averaging"])
