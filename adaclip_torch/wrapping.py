"""What wrapping an optimizer fixes, and the guard that it still holds at every step.

At construction :class:`~adaclip_torch.optimizer.DPOptimizer` checks its arguments
(:func:`check_arguments`, :func:`make_schedule`, ...) and records which parameters it
privatises, with their names, shapes, dtypes and devices. The privacy argument covers exactly
that set: a parameter the wrapped optimizer could step on its raw gradient, or one whose layout
changed, would break it silently. :func:`check_unchanged` (the drift guard) refuses such a
step before anything changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from adaclip import schedules as _schedules
from adaclip import strategies as _strategies
from adaclip.errors import InvalidHyperparameterError
from adaclip_torch import distributed as _distributed
from adaclip_torch import validation as _validation
from adaclip_torch.correlated import NoiseStream, check_poisson_sampler, make_noise_mechanism
from adaclip_torch.ghost import PER_SAMPLE_MODES

__all__ = [
    "NONFINITE_MODES",
    "check_arguments",
    "check_loss_reduction",
    "check_nonfinite",
    "check_per_sample_mode",
    "check_poisson_sampler",
    "check_unchanged",
    "make_schedule",
    "make_stream",
    "parameter_names",
    "statistics_dtype",
    "trainable_params",
]

Tensor = torch.Tensor

#: What a unit with a NaN/inf per-unit gradient does: ``"zero"`` (the default) drops it — it
#: contributes 0, which stays within the sensitivity and does not reveal it —, ``"raise"``
#: raises :class:`InvalidGradientError` before anything changes (a debugging aid: the error
#: itself depends on one unit's data, so do not use it where the errors are observable).
NONFINITE_MODES = ("zero", "raise")


def trainable_params(optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
    """The ``requires_grad`` parameters of the optimizer's groups, in group order, deduplicated."""
    seen: set[int] = set()
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def parameter_names(model: nn.Module, params: Sequence[Tensor]) -> list[str]:
    """Names of ``params`` in ``model``; raises if one of them is not a model parameter."""
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=True)}
    out = []
    for k, p in enumerate(params):
        if id(p) not in names:
            raise InvalidHyperparameterError(
                f"optimizer parameter #{k} (shape {tuple(p.shape)}) is not a parameter of model: "
                "the per-example gradients come from the model, so every trainable parameter of "
                "the optimizer must belong to it"
            )
        out.append(names[id(p)])
    return out


def ddp_wrapped(model: nn.Module) -> bool:
    return isinstance(model, nn.parallel.DistributedDataParallel)


def statistics_dtype(params: Sequence[Tensor]) -> torch.dtype:
    """float64 if any parameter is float64, else float32 (never lower precision)."""
    return torch.float64 if any(p.dtype == torch.float64 for p in params) else torch.float32


def check_sample_rate(sample_rate: Any) -> float | None:
    return None if sample_rate is None else _strategies.validate_sample_rate(sample_rate)


def check_arguments(
    optimizer: Any,
    model: Any,
    *,
    already_wrapped: bool,
    per_sample_mode: Any,
    loss_reduction: Any,
    nonfinite: Any,
    distributed: bool,
) -> None:
    """The constructor's first checks, in order: the optimizer (wrapped once), the model (no
    DDP wrapper, no module that mixes the examples of a batch, no FSDP1), the modes."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise InvalidHyperparameterError(f"optimizer must be a torch.optim.Optimizer, got {optimizer!r}")
    if already_wrapped:
        raise InvalidHyperparameterError("optimizer is already a DPOptimizer: wrap the plain optimizer once")
    if not isinstance(model, nn.Module):
        raise InvalidHyperparameterError(f"model must be a torch.nn.Module, got {model!r}")
    check_per_sample_mode(per_sample_mode)
    check_loss_reduction(loss_reduction)
    check_nonfinite(nonfinite)
    if ddp_wrapped(model):
        why = (
            "" if distributed else ", and without distributed=True every rank would release its own "
            "noisy gradient, so the ranks would silently drift apart"
        )
        raise InvalidHyperparameterError(
            "model is wrapped in torch.nn.parallel.DistributedDataParallel, whose all-reduce of raw "
            f"gradients the private step does not use{why}. Pass the unwrapped module (model.module) "
            "with distributed=True: each rank clips its own units, the clipped sums are all-reduced "
            "and rank 0 alone adds the noise (expected_batch_size is then the global B̄)"
        )
    _validation.check_model(model)
    _distributed.refuse_fsdp1(model)


def check_per_sample_mode(per_sample_mode: Any) -> None:
    """``per_sample_mode`` is one of :data:`~adaclip_torch.ghost.PER_SAMPLE_MODES`."""
    if per_sample_mode not in PER_SAMPLE_MODES:
        raise InvalidHyperparameterError(
            f"per_sample_mode must be one of {PER_SAMPLE_MODES}, got {per_sample_mode!r}"
        )


def check_loss_reduction(loss_reduction: Any) -> None:
    """``loss_reduction`` is ``"mean"`` or ``"sum"``."""
    if loss_reduction not in ("mean", "sum"):
        raise InvalidHyperparameterError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")


def check_nonfinite(nonfinite: Any) -> None:
    """``nonfinite`` is one of :data:`NONFINITE_MODES`."""
    if nonfinite not in NONFINITE_MODES:
        raise InvalidHyperparameterError(f"nonfinite must be one of {NONFINITE_MODES}, got {nonfinite!r}")


def make_schedule(noise_multiplier: Any, noise_schedule: Any) -> Any:
    """The noise schedule from ``noise_multiplier`` (constant) or ``noise_schedule`` (exactly one)."""
    if noise_schedule is None:
        if noise_multiplier is None:
            raise InvalidHyperparameterError("give noise_multiplier or noise_schedule")
        sigma, _ = _strategies.validate_mechanism(noise_multiplier, 1.0)
        return _schedules.ConstantSchedule(sigma)
    if noise_multiplier is not None:
        raise InvalidHyperparameterError("give noise_multiplier or noise_schedule, not both")
    if not isinstance(noise_schedule, _schedules.Schedule):
        raise InvalidHyperparameterError(f"noise_schedule must have .at(step), got {noise_schedule!r}")
    return noise_schedule


def check_unchanged(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    params: Sequence[Tensor],
    names: Sequence[str],
    layouts: Sequence[tuple[torch.dtype, torch.device]],
) -> None:
    """Refuse a step that would not be private, before anything changes: a parameter the
    wrapped optimizer could step on its raw gradient (unfrozen after wrapping, or added to
    it with ``add_param_group``), a privatised parameter frozen, re-typed or moved since
    wrapping, or a module that mixes examples (also one added after wrapping)."""
    _validation.check_model(model, when="the model cannot be trained privately: ")
    ours = {id(p) for p in params}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) in ours or not (p.requires_grad or p.grad is not None):
                continue
            known = {id(q): n for n, q in model.named_parameters()}
            name = known.get(id(p), f"<not in the model, shape {tuple(p.shape)}>")
            raise InvalidHyperparameterError(
                f"parameter {name!r} would be stepped by the wrapped optimizer on its raw, un-noised "
                "gradient: it was frozen when the optimizer was wrapped and has been unfrozen since, "
                "or it was added to the wrapped optimizer afterwards (add_param_group). The privacy "
                "transform covers the parameters trainable at wrapping time: after unfreezing, wrap "
                "the optimizer again (a new DPOptimizer over the new set of parameters)"
            )
    for name, p, (dtype, device) in zip(names, params, layouts, strict=True):
        if not p.requires_grad:
            raise InvalidHyperparameterError(
                f"parameter {name!r} was frozen after wrapping (requires_grad=False): the wrapped "
                "optimizer would step it on noise alone. Wrap the optimizer again over the "
                "parameters that are still trainable"
            )
        if p.dtype != dtype or p.device != device:
            raise InvalidHyperparameterError(
                f"parameter {name!r} changed from {dtype} on {device} to {p.dtype} on {p.device} "
                "after wrapping (model.double(), model.to(...)?): the privacy statistics and the "
                "wrapped optimizer's state still have the old layout. Convert the model first, then "
                "build and wrap the optimizer"
            )


def make_stream(
    noise_mechanism: Any,
    bands: Any,
    sampler: Any,
    *,
    noise_schedule: Any,
    compile_release: bool,
    sample_rate: Any,
    buffers: Any = None,
    distributed: bool = False,
) -> NoiseStream | None:
    """The correlated-noise stream (``None``: independent noise), with its constraints; with
    independent noise a given ``sampler`` must be a Poisson sampler (:func:`check_poisson_sampler`)."""
    mechanism = make_noise_mechanism(noise_mechanism, bands, buffers=buffers, sampler=sampler)
    if mechanism is None:
        if sampler is not None:
            check_poisson_sampler(sampler, sample_rate)
        return None
    name = mechanism.family
    why = (
        "a noise_schedule (the factorisation needs one σ for every step)" if noise_schedule is not None else
        "compile_release=True" if compile_release else None
    )
    if why is not None:
        raise InvalidHyperparameterError(f"noise_mechanism={name!r} does not support {why} yet")
    return NoiseStream(mechanism, sample_rate=sample_rate, sampler=sampler)
