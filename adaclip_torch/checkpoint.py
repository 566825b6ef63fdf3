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
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from adaclip import strategies as _strategies
from adaclip.accounting._adoption import warn_if_mechanism_adopted
from adaclip.errors import InvalidGradientError, InvalidHyperparameterError
from adaclip.strategies import ClipState

if TYPE_CHECKING:
    from adaclip_torch.optimizer import DPOptimizer

__all__ = ["STATE_KEYS", "RANK_LOCAL_KEYS", "Restored", "Snapshot", "dump", "validate", "load_delegated", "own_rank_parts"]

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
    return _keyed_by_rank(opt, {
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
        **({} if stream is None else {"noise_stream": stream.state_dict(
            with_buffers=opt._noise.mode == "seeded",
            padded_to=(opt._shapes, torch.empty(0, dtype=opt._dtype, device=opt.params[0].device)) if opt.distributed
            else None,
        )}),  # fmt: skip
        **({} if opt.average is None else {"averaging": opt.average.state_dict()}),
    })


# --------------------------------------------------------------------------- rank-local parts

#: The parts of a data-parallel optimizer's checkpoint that differ from rank to rank: the noise
#: generator (each rank's own under sharded noise state; under rank 0's noise only rank 0's has
#: moved), the correlated-noise stream (each rank's slice of the buffers) and, under FSDP2, the
#: parameter average (each rank's shards).
RANK_LOCAL_KEYS = ("noise", "noise_stream", "averaging")


def _rank_key(rank: int) -> str:
    return f"rank{rank}"


def _rank_local_keys(opt: DPOptimizer) -> tuple[str, ...]:
    return tuple(k for k in RANK_LOCAL_KEYS if k != "averaging" or opt.fsdp)


def _keyed_by_rank(opt: DPOptimizer, state: dict[str, Any]) -> dict[str, Any]:
    """With ``distributed=True``, each rank-local part is saved as ``{"rank<r>": part}``.

    Why: a checkpoint library that saves one state dict from every rank
    (``torch.distributed.checkpoint``) treats entries with the same key on every rank as
    replicated and writes one rank's copy — not necessarily rank 0's. Unkeyed, a restored rank
    could then get another rank's generator: under rank 0's independent noise, rank 1's
    generator never moved, so rank 0 would draw its first noise again (the same noise in two
    releases: their difference reveals the clipped sums). Keyed by rank, every rank writes and
    reads its own, and :func:`own_rank_parts` refuses another rank's."""
    if not opt.distributed:
        return state
    import torch.distributed as dist

    key = _rank_key(dist.get_rank())
    return {k: ({key: v} if k in _rank_local_keys(opt) else v) for k, v in state.items()}


def own_rank_parts(opt: DPOptimizer, state_dict: Any) -> Any:
    """``state_dict`` with this rank's parts taken out of their ``{"rank<r>": part}`` wrappers
    (a shallow copy; anything not a dict is returned for :func:`validate` to refuse). A part
    that holds other ranks' entries but not this rank's is refused: each rank restores its own
    (one file per rank, or ``torch.distributed.checkpoint`` on the same number of ranks). A
    checkpoint saved before the parts were keyed (no ``rank<r>`` key) is read as it is."""
    if not opt.distributed or not isinstance(state_dict, dict):
        return state_dict
    import torch.distributed as dist

    rank = dist.get_rank()
    out = dict(state_dict)
    for k in _rank_local_keys(opt):
        part = out.get(k)
        ranks = sorted(x for x in part if isinstance(x, str) and x.startswith("rank")) if isinstance(part, dict) else []
        if not ranks:
            continue  # absent, or an unkeyed checkpoint of an earlier version
        if _rank_key(rank) not in part:
            raise InvalidHyperparameterError(
                f"state_dict's {k!r} holds the state of {', '.join(ranks)}, not of rank {rank}: with "
                "distributed=True (sharded noise state, or rank 0's noise) every rank saves and loads its own "
                "state_dict (one file per rank, or torch.distributed.checkpoint on the same number of ranks); "
                "another rank's generator or buffers would draw noise that was already used"
            )
        out[k] = part[_rank_key(rank)]
    return out


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


def validate(opt: DPOptimizer, state_dict: Any, *, ignore_ledger: bool = False) -> Restored:
    """Check every part of ``state_dict`` against ``opt`` without changing anything (the
    accountant's part as :meth:`adaclip.accounting.Accountant.load_state_dict` checks it, with
    ``ignore_ledger``: a checkpoint of a run that kept a crash-safe ledger needs that ledger)."""
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
    keep = accountant_is_ahead_of(opt.accountant, state_dict["accountant"], ignore_ledger=ignore_ledger)
    return Restored(clip_state, steps, stream, keep)


def accountant_is_ahead_of(accountant: Any, saved: Any, *, ignore_ledger: bool = False) -> bool:
    """Whether the attached accountant has recorded more steps than the checkpoint's (an
    in-process rewind): it is then kept, as an accountant never forgets a release.

    The checkpoint is checked first, changing nothing, by the accountant itself
    (:meth:`~adaclip.accounting.Accountant.check_state_dict`): with its crash-safe ledger if it
    has one (the checkpoint must be of the ledger's run), and a checkpoint of a ledger run is
    refused by an accountant without a ledger — also when the accountant would be kept, so that
    no part of a ledger run's checkpoint is restored without its ledger. An accountant-like
    object without ``check_state_dict`` is probed on a copy."""
    if accountant is None or not hasattr(accountant, "steps"):
        return False
    check = getattr(accountant, "check_state_dict", None)
    if check is not None:
        saved_steps = check(saved, ignore_ledger=ignore_ledger)  # raises before anything changes
    else:
        probe = copy.deepcopy(accountant)
        _load_accountant(probe, saved, ignore_ledger=ignore_ledger)  # validates it
        saved_steps = probe.steps
    return int(accountant.steps) > int(saved_steps)


def _load_accountant(accountant: Any, saved: Any, *, ignore_ledger: bool) -> None:
    """``accountant.load_state_dict(saved)``, passing ``ignore_ledger`` only when it is set (an
    accountant-like object need not know the keyword)."""
    if ignore_ledger:
        accountant.load_state_dict(saved, ignore_ledger=True)
    else:
        accountant.load_state_dict(saved)


def count(what: str, value: Any) -> int:
    """A step count from a checkpoint: an integer ``>= 0`` (a 0-d integer tensor is accepted)."""
    value = _read_count(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidHyperparameterError(f"{what} must be an int >= 0, got {value!r}")
    return value


def _read_count(value: Any) -> Any:
    """A one-element non-floating tensor as the Python int it holds; anything else as it is."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.dtype.is_floating_point:
        return int(value)
    return value


def clip_state_from(opt: DPOptimizer, saved: Any) -> ClipState:
    """The :class:`~adaclip.strategies.ClipState` of a checkpoint, checked against ``opt``'s
    strategy by the core (:func:`adaclip.strategies.check_state`: ``None``-ness, count, shapes
    and dtypes of ``mean``/``std``, ``std`` within ``[std_min, std_max]`` up to rounding, the
    step count, the option state and its ranges, in the statistics dtype), copied, and put on
    the devices of the current state (``mean``/``std`` on their parameter's)."""
    if not isinstance(saved, dict) or "step" not in saved:
        raise InvalidHyperparameterError("state_dict['clip_state'] must be a dict with 'step', 'mean' and 'std'")
    step = _step_as_saved(saved["step"])
    restored = ClipState(step=step, mean=saved.get("mean"), std=saved.get("std"), extra=saved.get("extra"))
    checked = _strategies.check_state(
        opt.strategy, restored, opt._clip_state, names=opt.param_names, asarray=torch.as_tensor
    )
    return _placed(opt, checked)


class _ForeignCount:
    """A saved step count that is an array of another library (e.g. a NumPy integer). This
    loader has always refused it (a count is an int or a one-element integer tensor), while the
    core's check accepts any one-element integer array: it is handed to the core as this opaque
    value, which the core refuses in its place in the order of checks, showing the saved value."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __repr__(self) -> str:
        return repr(self.value)


def _step_as_saved(value: Any) -> Any:
    """``clip_state['step']`` for the core's check, read as :func:`count` reads it (so that the
    core refuses it exactly where :func:`count` would)."""
    value = _read_count(value)
    if not isinstance(value, (int, torch.Tensor)) and hasattr(value, "shape") and hasattr(value, "dtype"):
        return _ForeignCount(value)
    return value


def _placed(opt: DPOptimizer, state: ClipState) -> ClipState:
    """``state`` (checked, in the statistics dtype) with ``mean``/``std`` on their parameters'
    devices and every ``extra`` entry on the device of the current state's entry."""

    def on_params(values: list[Tensor] | None) -> list[Tensor] | None:
        if values is None:
            return None
        return [v.to(device=p.device) for v, p in zip(values, opt.params, strict=True)]

    def on_template(value: Any, ref: Any) -> Any:
        if isinstance(ref, list):
            return [None if v is None else v.to(device=r.device) for v, r in zip(value, ref, strict=True)]
        return value.to(device=ref.device)

    template = opt._clip_state.extra
    extra = None if state.extra is None else {k: on_template(v, template[k]) for k, v in state.extra.items()}
    return ClipState(step=state.step, mean=on_params(state.mean), std=on_params(state.std), extra=extra)


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


def load_delegated(
    opt: DPOptimizer, state_dict: dict[str, Any], *, keep_accountant: bool, ignore_ledger: bool = False
) -> None:
    """Load the parts that check themselves: the wrapped optimizer, the accountant (unless it is
    kept; with ``ignore_ledger``) and the parameter average. Take a :class:`Snapshot` first: one
    of them may refuse after another has loaded."""
    opt.original_optimizer.load_state_dict(state_dict["optimizer"])
    if opt.accountant is not None and not keep_accountant:
        before = getattr(opt.accountant, "mechanism", None)
        _load_accountant(opt.accountant, state_dict["accountant"], ignore_ledger=ignore_ledger)
        warn_if_mechanism_adopted(before, getattr(opt.accountant, "mechanism", None), stacklevel=4)
    if opt.average is not None:
        opt.average.load_state_dict(state_dict["averaging"])
