"""``make_private``: Poisson-sample the data, wrap the optimizer, attach an accountant.

Two ways to choose the noise, as in Opacus:

* **a target (ε, δ)**: ``make_private(..., target_epsilon=, delta=, epochs=)`` or
  :func:`make_private_with_epsilon` (Opacus's ``make_private_with_epsilon``, ``target_delta=``
  accepted). σ is the smallest noise multiplier for which the planned run stays within
  ``(target_epsilon, delta)`` (:func:`adaclip.accounting.calibrate_noise_multiplier`), and the
  accountant gets that budget;
* **a noise multiplier**: ``make_private(..., noise_multiplier=, max_grad_norm=)`` (Opacus's
  ``make_private``). σ is used as given and the accountant only records the steps: ask it
  ``optimizer.accountant.epsilon(delta)``. Adding ``target_epsilon=`` and ``delta=`` gives
  that accountant a budget (a step beyond it raises), and with ``epochs=`` the planned run is
  checked against the budget up front.

Given ``N`` training units, a loader with batch size ``B`` (``0 < B <= N``) and ``E`` epochs:

* ``q = B/N`` (each unit joins a step with probability ``q``; ``B̄ = qN = B``);
* one pass over the returned loader is ``round(1/q)`` steps, and the planned run is
  ``T = E · round(1/q)`` steps;
* every step records ``(q, σ)`` in an :class:`adaclip.accounting.Accountant`, and with a budget
  a step beyond it raises before it changes anything.

The training units are the examples the loader's sampler ranges over, not necessarily the whole
data set: ``sampler=SubsetRandomSampler(indices)`` (or a ``Subset`` as the data set) keeps the
other examples out of training, and ``N`` is the number of training examples. The privacy
unit is one of them (adjacency: adding or removing one training example). Samplers that are
not a fixed set of equally likely examples are refused (:mod:`adaclip_torch._user_loader`
has the rule for each).

``max_grad_norm`` means the clip norm ``C`` of each strategy: flat clipping's ``C``; per-layer
clipping's total ``C`` (``C/√K`` per tensor); scaled clipping's ``C``; and for AdaCliP, which
has no fixed clip norm, the norm it starts from (``AdaClip(initial_max_grad_norm=C)``: the
first step clips like flat clipping at ``C``, then the clip region adapts). See the Opacus
migration page (``docs/migration/opacus.md``) and the Accounting page (``docs/accounting.md``).

The arguments are checked before σ is calibrated (which takes a fraction of a second to
seconds) and before anything is built — the strategy's name, keywords (against those its
wrapper takes: AdaCliP's :class:`adaclip.options.AdaptiveOptions`, the other wrappers' signatures,
and :class:`~adaclip_torch.optimizer.DPOptimizer`'s) and values (with the strategy the wrapper
builds), ε, δ, σ, ``epochs``, ``max_grad_norm``, the loader's batch size, the model's layers
and the combinations of these; a bad one raises
:class:`adaclip.errors.InvalidHyperparameterError` naming it, and the model, optimizer and
loader are left as they were. Only the wrapper options that depend on the hardware or the
process group (``use_kernel``, ``distributed``) are checked later, by the wrapper itself.
"""

from __future__ import annotations

import inspect
import logging
import math
import numbers
import os
from collections.abc import Set as AbstractSet
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils.data import DataLoader

import adaclip.accounting as _accounting
import adaclip.averaging as _averaging
import adaclip.correlated as _correlated
import adaclip.correlated.planning as _planning
from adaclip.correlated.blt import DEFAULT_BLT_BUFFERS, fit_blt
from adaclip.correlated.coefficients import adaptive_lr_scale
from adaclip.errors import InvalidHyperparameterError
from adaclip.ledger import PrivacyLedger
from adaclip.options import ADAPTIVE_OPTION_NAMES, finite_positive, positive_int, warn_mechanism_keyword
from adaclip_torch import wrapping as _wrapping
from adaclip_torch._user_loader import read_training_set, shard
from adaclip_torch.data import (
    CountingDataLoader,
    FixedOrderBatchSampler,
    poisson_data_loader,
    sample_rate_for,
    steps_per_epoch,
)
from adaclip_torch.optimizer import (
    AdaClip,
    AutomaticClip,
    DPOptimizer,
    FlatClip,
    PerLayerClip,
    QuantileClip,
    ScaledClip,
)
from adaclip_torch.validation import check_model

__all__ = ["make_private", "make_private_with_epsilon", "STRATEGIES"]

#: ``make_private(strategy=name)``: the wrapper each name builds; the wrapper's own keywords
#: (for ``"adaclip"`` every option of :class:`adaclip.strategies.AdaptiveClipping`: ``scale``,
#: ``pooling``, ``centre``, ``quantile``, ...) are make_private's strategy keywords.
#: :func:`make_private`'s strategy when none is named: flat clipping, the best configuration
#: without tuning (learning rate tuned, ``C = 1``) in the round-two utility benchmark.
DEFAULT_STRATEGY = "flat"

STRATEGIES: dict[str, type[DPOptimizer]] = {
    "adaclip": AdaClip,
    "flat": FlatClip,
    "per_layer": PerLayerClip,
    "scaled": ScaledClip,
    "quantile": QuantileClip,
    "automatic": AutomaticClip,
}

_LOADER_KEYS = ("num_workers", "pin_memory", "persistent_workers", "prefetch_factor", "worker_init_fn", "timeout")

# Keywords of the wrappers that make_private sets itself (or builds: the sampler, the average).
_SET_HERE = frozenset({
    "noise_multiplier", "expected_batch_size", "accountant", "sample_rate", "seed", "secure_mode",
    "loss_reduction", "noise_mechanism", "bands", "sampler", "averaging", "buffers",
})  # fmt: skip

# Wrapper keywords that make_private does not take as strategy keywords, with what to do instead.
_RESERVED: dict[str, str] = {
    "noise_multiplier": "pass it to make_private itself",
    "noise_schedule": (
        "make_private uses one constant noise multiplier; for a schedule build the wrapper and "
        "the accountant yourself (see the Accounting page, 'Schedules and heterogeneous σ')"
    ),
    "expected_batch_size": "make_private sets it to the loader's batch_size",
    "sample_rate": "make_private sets it to batch_size/N (N: the examples the loader's sampler ranges over)",
    "strategy": "pass the strategy's name to make_private's strategy=",
    "sampler": (
        "make_private builds the sampler (cyclic Poisson with noise_mechanism='banded', fixed order with "
        "'blt') and the loader"
    ),
}

# Opacus keywords that have another name (or no counterpart) here.
_OPACUS_HINTS: dict[str, str] = {
    "clipping": (
        "Opacus's clipping= is strategy= here ('flat', 'per_layer', 'adaclip', 'scaled', 'quantile', 'automatic')"
    ),
    "poisson_sampling": "make_private always samples with Poisson sampling (the accounting assumes it)",
    "noise_generator": "use seed= (experiments) or secure_mode=True (deployment) instead",
    "grad_sample_mode": "Opacus's grad_sample_mode= is per_sample_mode= here ('auto', the default, 'materialise', 'ghost')",
    "max_physical_batch_size": (
        "physical batches are BatchMemoryManager's, as in Opacus: keep make_private's logical loader and "
        "write 'with adaclip_torch.BatchMemoryManager(data_loader=loader, max_physical_batch_size=..., "
        "optimizer=optimizer) as physical_loader:' around the training loop (one release per logical batch)"
    ),
    "criterion": (
        "no criterion is needed for ghost clipping here: per_sample_mode='auto' (the default) or 'ghost' "
        "works with the usual loss.backward()"
    ),
}


def _loader_kwargs(data_loader: DataLoader) -> dict[str, Any]:
    out = {k: getattr(data_loader, k) for k in _LOADER_KEYS if hasattr(data_loader, k)}
    if out.get("num_workers", 0) == 0:
        out.pop("prefetch_factor", None)
        out.pop("persistent_workers", None)
    return out


#: The default of an AdaCliP option in :func:`_strategy_keywords`: resolved by the core
#: (:func:`adaclip.strategies.adaptive_clipping`), not filled in here.
_RESOLVED_BY_THE_CORE = object()


def _declared_keywords(cls: type[DPOptimizer]) -> dict[str, Any]:
    """The keywords ``cls.__init__`` declares after ``(self, optimizer, model)``, each mapped to
    its default (``inspect.Parameter.empty`` when it has none)."""
    params = list(inspect.signature(cls.__init__).parameters.values())[3:]  # self, optimizer, model
    return {p.name: p.default for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}


def _passes_keywords_on(cls: type[DPOptimizer]) -> bool:
    """Whether ``cls.__init__`` passes the keywords it does not declare on (``**kwargs``)."""
    return any(p.kind is p.VAR_KEYWORD for p in inspect.signature(cls.__init__).parameters.values())


def _strategy_keywords(cls: type[DPOptimizer]) -> dict[str, Any]:
    """The keywords with which the wrapper ``cls`` chooses its strategy, each mapped to its
    default: :class:`~adaclip_torch.AdaClip`'s are :class:`adaclip.options.AdaptiveOptions`
    (all optional, resolved by the core), every other wrapper's are those its constructor
    declares (``inspect.Parameter.empty``: required)."""
    if issubclass(cls, AdaClip):
        return dict.fromkeys(ADAPTIVE_OPTION_NAMES, _RESOLVED_BY_THE_CORE)
    return _declared_keywords(cls)


def _keyword_names(cls: type[DPOptimizer]) -> tuple[set[str], set[str]]:
    """(all keywords ``cls(optimizer, model, ...)`` takes, those without a default)."""
    declared = [_strategy_keywords(cls)]
    if _passes_keywords_on(cls) and cls is not DPOptimizer:
        declared.append(_declared_keywords(DPOptimizer))
    accepted = {name for keywords in declared for name in keywords}
    required = {name for keywords in declared for name, default in keywords.items() if default is inspect.Parameter.empty}
    accepted.discard("strategy")
    required.discard("strategy")  # the subclass passes it
    return accepted, required


def _strategy_kwargs(
    strategy: str, max_grad_norm: float | None, strategy_kwargs: dict[str, Any], supplied: AbstractSet[str]
) -> dict[str, Any]:
    """The keywords for ``STRATEGIES[strategy]``, checked against its signature and values."""
    cls = STRATEGIES[strategy]
    accepted, required = _keyword_names(cls)
    for key in strategy_kwargs:
        if key in _RESERVED:
            raise InvalidHyperparameterError(f"make_private does not take {key}= as a strategy keyword: {_RESERVED[key]}")
        if key in _OPACUS_HINTS:
            raise InvalidHyperparameterError(f"make_private has no keyword {key!r}: {_OPACUS_HINTS[key]}")
        if key not in accepted:
            raise InvalidHyperparameterError(
                f"strategy {strategy!r} ({cls.__name__}) takes no keyword {key!r}; it takes "
                f"{sorted(accepted - set(_RESERVED) - supplied)}"
            )
    kwargs = dict(strategy_kwargs)
    if max_grad_norm is not None:
        if strategy == "adaclip":
            clash = sorted({"initial_max_grad_norm", "std_min", "std_max"} & set(kwargs))
            if clash:
                raise InvalidHyperparameterError(
                    f"max_grad_norm (AdaCliP's initial clip norm, initial_max_grad_norm) cannot be combined "
                    f"with {', '.join(clash)}: give max_grad_norm, or std_min and std_max"
                )
            kwargs["initial_max_grad_norm"] = max_grad_norm
        else:
            if strategy == "per_layer" and "group_max_grad_norms" in kwargs:
                raise InvalidHyperparameterError(
                    "give max_grad_norm (the total clip norm) or group_max_grad_norms (one per tensor), not both"
                )
            kwargs["max_grad_norm"] = max_grad_norm
    for key in ("group_max_grad_norms", "layer_scales"):
        if kwargs.get(key) is not None:  # a tuple, so that checking it here does not consume it
            try:
                kwargs[key] = tuple(kwargs[key])
            except TypeError:
                raise InvalidHyperparameterError(f"{key} must be a sequence of numbers, got {kwargs[key]!r}") from None
    missing = sorted(required - supplied - set(kwargs))
    if missing:
        raise InvalidHyperparameterError(f"strategy {strategy!r} ({cls.__name__}) needs {', '.join(missing)}")
    if "per_sample_mode" in kwargs:  # the wrapper's own checks, early
        _wrapping.check_per_sample_mode(kwargs["per_sample_mode"])
    if "nonfinite" in kwargs:
        _wrapping.check_nonfinite(kwargs["nonfinite"])
    return kwargs


def _check_strategy_values(strategy: str, kwargs: dict[str, Any]) -> Any:
    """Build the (cheap, pure) clipping rule the wrapper will build, with the wrapper's own
    builder and defaults, to check the values early; return it (its :meth:`noise_multipliers`
    checks σ once σ is known). AdaCliP's std bounds scale with ``1/√d``: ``d = 1`` checks the
    values (``C0 > 0``, ``spread >= 1``)."""
    cls = STRATEGIES[strategy]
    keywords = _strategy_keywords(cls)
    options = {k: d for k, d in keywords.items() if d is not inspect.Parameter.empty and d is not _RESOLVED_BY_THE_CORE}
    options.update((k, v) for k, v in kwargs.items() if k in keywords)
    return cls._strategy_of(1, **options)  # type: ignore[attr-defined]


# When make_private chooses b (adaclip.correlated.planning, the same rule for every framework): the
# candidates (1, DP-SGD, always one), the cap of an adaptive optimizer whose learning rate is not
# scaled by ρ, and the buffers' memory budget ((b − 1)·d numbers; a larger b is left out of the
# candidates: give bands= to go above it). Read at each call, so they can be changed here.
BAND_CANDIDATES = _planning.BAND_CANDIDATES
ADAPTIVE_OPTIMIZER_MAX_BANDS = _planning.ADAPTIVE_OPTIMIZER_MAX_BANDS
BANDED_BUFFER_BUDGET_BYTES = _planning.BANDED_BUFFER_BUDGET_BYTES


def _buffer_bytes_per_band(optimizer: torch.optim.Optimizer, ranks: int = 1) -> int:
    """Bytes of one band's buffer on one rank: the trainable parameters' elements times their
    element size, divided over ``ranks`` under sharded noise state (each rank holds its slice)."""
    total = sum(
        p.numel() * p.element_size() for group in optimizer.param_groups for p in group["params"] if p.requires_grad
    )
    return -(-total // ranks)


def _is_adaptive(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` divides by a running second moment (Adam and kin: ``betas``)."""
    return isinstance(optimizer.param_groups[0].get("betas"), (tuple, list))


def _workload_of(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What training integrates of the releases, for the coefficients: momentum SGD's momentum
    sums, Adam's first moment (an EMA with β1: momentum-like), plain prefix sums otherwise."""
    group = optimizer.param_groups[0]
    momentum = group.get("momentum")
    if momentum is None and _is_adaptive(optimizer):
        momentum = group["betas"][0]
    if isinstance(momentum, numbers.Real) and 0 < float(momentum) < 1:
        return {"workload": "momentum", "momentum": float(momentum)}
    return {"workload": "prefix"}


def _banded_mechanism(
    optimizer: torch.optim.Optimizer,
    bands: int | None,
    *,
    q: float,
    total_steps: int | None,
    target_epsilon: float | None,
    delta: float | None,
    mechanism: str,
    optimise: bool,
    progress: bool | None = None,
    lr_scaled: bool = False,
    calibrated: dict[int, float] | None = None,
    ranks: int = 1,
) -> _correlated.BandedNoise:
    """The banded noise make_private builds: ``b`` given or chosen (before training, from
    public quantities only), coefficients optimised for the optimizer's workload over the run.
    An adaptive optimizer's choice stops at :data:`ADAPTIVE_OPTIMIZER_MAX_BANDS` unless its
    learning rate will be scaled by ρ (``lr_scaled``), and every choice keeps the buffers within
    :data:`BANDED_BUFFER_BUDGET_BYTES` — per rank under sharded noise state (``ranks``: each
    holds ``1/R`` of the buffers). ``calibrated`` (b ↦ σ_b) keeps the σ calibrated for each
    candidate, for :func:`_noise_multiplier` to reuse (a PLD calibration takes seconds)."""
    sigma_for, candidates = None, ()
    if bands is None:
        assert total_steps is not None and target_epsilon is not None and delta is not None
        candidates = _planning.candidate_bands(
            sample_rate=q, steps=total_steps, adaptive_optimizer=_is_adaptive(optimizer), lr_scaled=lr_scaled,
            bytes_per_band=_buffer_bytes_per_band(optimizer, ranks), buffer_budget_bytes=BANDED_BUFFER_BUDGET_BYTES,
            candidates=BAND_CANDIDATES,
        )  # fmt: skip
        sigma_for = _planning.banded_sigma_calibrator(
            target_epsilon=target_epsilon, delta=delta, sample_rate=q, steps=total_steps, accountant=mechanism,
            progress=progress, cache=calibrated,
        )  # fmt: skip
    return _planning.choose_banded_noise(
        bands=bands, steps=total_steps, sigma_for_bands=sigma_for, candidates=candidates, optimise=optimise,
        **_workload_of(optimizer),
    )  # fmt: skip


# --------------------------------------------------------------------------- make_private's phases


def _check_parts(
    model: Any,
    module: Any,
    optimizer: Any,
    data_loader: Any,
    *,
    strategy: Any,
    mechanism: Any,
    accountant: Any,
    progress: Any,
    loss_reduction: Any,
    seed: Any,
    secure_mode: Any,
) -> tuple[nn.Module, str]:
    """``(model, mechanism)``: the three parts, the strategy's name, the accountant, and the
    noise source's settings checked (``module=`` taken for ``model``)."""
    if module is not None:
        if model is not None:
            raise InvalidHyperparameterError(
                "give model (first argument) or module= (Opacus's name for it), not both"
            )
        model = module
    if model is None or optimizer is None or data_loader is None:
        missing = [k for k, v in (("model", model), ("optimizer", optimizer), ("data_loader", data_loader)) if v is None]
        raise InvalidHyperparameterError(
            f"make_private needs model (or module=), optimizer and data_loader; missing: {', '.join(missing)}"
        )
    if not isinstance(strategy, str) or strategy not in STRATEGIES:
        raise InvalidHyperparameterError(f"strategy must be one of {sorted(STRATEGIES)}, got {strategy!r}")
    mechanism = _accounting.resolve_mechanism(mechanism, accountant)
    if progress is not None and not isinstance(progress, bool):
        raise InvalidHyperparameterError(f"progress must be True, False or None (after a second), got {progress!r}")
    if not isinstance(model, nn.Module):
        raise InvalidHyperparameterError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer) or isinstance(optimizer, DPOptimizer):
        raise InvalidHyperparameterError(
            f"optimizer must be a plain torch.optim.Optimizer (not yet private), got {type(optimizer).__name__}"
        )
    if not isinstance(data_loader, DataLoader):
        raise InvalidHyperparameterError(f"data_loader must be a torch DataLoader, got {type(data_loader).__name__}")
    _wrapping.check_loss_reduction(loss_reduction)
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0):
        raise InvalidHyperparameterError(f"seed must be a non-negative int or None, got {seed!r}")
    if not isinstance(secure_mode, bool):
        raise InvalidHyperparameterError(f"secure_mode must be a bool, got {secure_mode!r}")
    if secure_mode and seed is not None:
        raise InvalidHyperparameterError("secure_mode=True draws from the OS: do not pass a seed")
    return model, mechanism


def _check_budget(
    noise_multiplier: Any,
    target_epsilon: Any,
    delta: Any,
    target_delta: Any,
    *,
    allow_large_delta: Any,
    ledger: Any,
) -> tuple[float | None, float | None, str]:
    """``(noise_multiplier, delta, delta_name)``: σ or a target ε (with its δ, given as
    ``delta`` or ``target_delta``, whose name the messages use), and the ledger."""
    if delta is not None and target_delta is not None:
        raise InvalidHyperparameterError(
            f"give delta or target_delta (Opacus's name for it), not both: got delta={delta!r}, "
            f"target_delta={target_delta!r}"
        )
    delta_name = "delta" if target_delta is None else "target_delta"
    if target_delta is not None:
        delta = target_delta
    if noise_multiplier is None and target_epsilon is None:
        raise InvalidHyperparameterError(
            "give target_epsilon (with delta and epochs: the noise multiplier is calibrated) or "
            "noise_multiplier (used as is, as in Opacus's make_private)"
        )
    if noise_multiplier is not None:
        noise_multiplier = finite_positive("noise_multiplier", noise_multiplier, allow_zero=True)
    if target_epsilon is not None:
        if isinstance(target_epsilon, bool) or not isinstance(target_epsilon, numbers.Real):
            raise InvalidHyperparameterError(f"target_epsilon must be a real number, got {target_epsilon!r}")
        if not (math.isfinite(target_epsilon) and target_epsilon > 0):
            raise InvalidHyperparameterError(f"target_epsilon must be finite and > 0, got {target_epsilon!r}")
        if delta is None:
            raise InvalidHyperparameterError(
                f"target_epsilon={target_epsilon!r} needs delta (or target_delta), the δ of the budget"
            )
    elif delta is not None:
        raise InvalidHyperparameterError(
            f"{delta_name}={delta!r} without target_epsilon: with a noise multiplier and no budget the "
            "accountant only records the steps; ask optimizer.accountant.epsilon(delta) instead, or add "
            "target_epsilon to give it a budget"
        )
    if delta is not None:
        if isinstance(delta, bool) or not isinstance(delta, numbers.Real) or not (0 < delta < 1):
            raise InvalidHyperparameterError(f"{delta_name} must be in (0, 1), got {delta!r}")
    if not isinstance(allow_large_delta, bool):
        raise InvalidHyperparameterError(f"allow_large_delta must be a bool, got {allow_large_delta!r}")
    if ledger is not None and not isinstance(ledger, (str, os.PathLike, PrivacyLedger)):
        raise InvalidHyperparameterError(f"ledger must be a path or an adaclip PrivacyLedger, got {type(ledger).__name__}")
    return noise_multiplier, delta, delta_name


def _check_noise_mechanism(
    noise_mechanism: Any,
    bands: Any,
    band_coefficients: Any,
    *,
    target_epsilon: Any,
    noise_multiplier: Any,
    epochs: Any,
    compile_release: Any,
) -> tuple[str, int | None]:
    """``(noise_mechanism, bands)``: ``"auto"`` resolved to ``"banded"`` or ``"independent"``
    (see :func:`make_private`), and the combinations with ``bands`` and ``band_coefficients``."""
    if noise_mechanism not in ("auto", "independent", "banded", "blt"):
        raise InvalidHyperparameterError(
            f"noise_mechanism must be 'auto', 'independent', 'banded' or 'blt', got {noise_mechanism!r}"
        )
    if noise_mechanism == "blt":
        if bands is not None or band_coefficients != "sqrt":
            raise InvalidHyperparameterError("bands= and band_coefficients= are for noise_mechanism='banded'")
        if target_epsilon is None or epochs is None:
            raise InvalidHyperparameterError(
                "noise_mechanism='blt' fits its factor for the planned run and calibrates sigma for it: give "
                "target_epsilon, delta and epochs"
            )
        if compile_release:
            raise InvalidHyperparameterError("noise_mechanism='blt' does not support compile_release=True yet")
        return noise_mechanism, None
    if noise_mechanism == "auto":
        knows_the_run = target_epsilon is not None and noise_multiplier is None and epochs is not None
        wants_banded = bands is not None or knows_the_run
        noise_mechanism = "banded" if wants_banded and not compile_release else "independent"
    if bands is not None:
        bands = positive_int("bands", bands)
        if noise_mechanism != "banded" and bands != 1:
            raise InvalidHyperparameterError(f"bands={bands} needs noise_mechanism='banded'")
    if band_coefficients not in ("sqrt", "optimised"):
        raise InvalidHyperparameterError(f"band_coefficients must be 'sqrt' or 'optimised', got {band_coefficients!r}")
    if band_coefficients == "optimised" and (noise_mechanism != "banded" or epochs is None):
        raise InvalidHyperparameterError("band_coefficients='optimised' needs noise_mechanism='banded' and epochs")
    if noise_mechanism == "banded" and bands is None and (target_epsilon is None or noise_multiplier is not None):
        raise InvalidHyperparameterError(
            "noise_mechanism='banded' with bands=None chooses b for a target (target_epsilon, delta, epochs) "
            "with a calibrated noise multiplier; with noise_multiplier= give bands= too"
        )
    return noise_mechanism, bands


def _check_scale_adaptive_lr(
    scale: Any,
    optimizer: torch.optim.Optimizer,
    *,
    noise_mechanism: str,
    bands: int | None,
    target_epsilon: Any,
    noise_multiplier: Any,
) -> bool:
    """Whether make_private will scale the adaptive optimizer's learning rates for banded noise
    (``scale_adaptive_lr``; the factor itself needs σ and is computed later)."""
    if scale not in (None, True, False):
        raise InvalidHyperparameterError(f"scale_adaptive_lr must be None, True or False, got {scale!r}")
    if scale is False:
        return False
    reasons = []
    if not _is_adaptive(optimizer):
        reasons.append("the optimizer is not adaptive (no 'betas' in its parameter groups)")
    if noise_mechanism != "banded" or bands == 1:
        reasons.append("the noise is not banded with b > 1")
    if target_epsilon is None or noise_multiplier is not None:
        reasons.append("sigma is not calibrated for a target_epsilon (DP-SGD's sigma is needed)")
    scheduled = any("initial_lr" in group for group in optimizer.param_groups)
    if scale is True:
        if scheduled:
            reasons.append("an LR scheduler is already attached (create it after make_private)")
        if reasons:
            raise InvalidHyperparameterError("scale_adaptive_lr=True cannot apply: " + "; ".join(reasons))
        return True
    return not reasons and not scheduled


def _check_epochs(epochs: Any, *, target_epsilon: Any, noise_multiplier: float | None) -> int | None:
    """``epochs``: needed with ``target_epsilon`` alone, refused without ``target_epsilon``;
    and σ = 0 is refused with a target ε."""
    if epochs is not None:
        epochs = positive_int("epochs", epochs)
        if target_epsilon is None:
            raise InvalidHyperparameterError(
                f"epochs={epochs!r} without target_epsilon has no effect: it only sets how many steps the "
                "noise multiplier is calibrated for (or checked against the budget). One pass over the "
                "returned loader is one epoch; loop over it as often as you like"
            )
    elif noise_multiplier is None:
        raise InvalidHyperparameterError(
            "epochs is needed with target_epsilon: the noise multiplier is calibrated for epochs · round(1/q) steps"
        )
    if target_epsilon is not None and noise_multiplier == 0:
        raise InvalidHyperparameterError(
            f"noise_multiplier=0 is no privacy: no step fits in target_epsilon={target_epsilon!r}"
        )
    return epochs


class _Sampling(NamedTuple):
    """What the loader gives make_private: the data set, ``N``, ``q = B/N``, the steps of one
    pass (``round(1/q)``) and of the planned run (``None`` without ``epochs``), the
    parameter average's configuration, and the dataset indices of the ``N`` training examples
    (``None``: the whole data set; :mod:`adaclip_torch._user_loader`)."""

    dataset: Any
    num_samples: int
    q: float
    num_steps: int
    total_steps: int | None
    averaging: Any
    indices: torch.Tensor | None = None
    #: ``(rank, number of ranks)`` of a data-parallel run (``distributed=True``), else ``None``;
    #: then ``N`` and ``q`` are the whole run's and ``indices`` this rank's shard
    world: tuple[int, int] | None = None


def _data_parallel(kwargs: dict[str, Any], noise_mechanism: str) -> tuple[int, int] | None:
    """``(rank, number of ranks)`` when the wrapper is asked for ``distributed=True`` (checked:
    an initialised process group), else ``None``.

    Data parallel with make_private: every rank calls it with the same arguments and its own
    copy of the same loader (the data set, the per-rank batch size ``B``); the training set is
    split into ``R`` fixed, disjoint shards (:func:`adaclip_torch._user_loader.shard`) and each
    rank Poisson-samples its shard at ``q = R·B/N`` with its own generator. Every unit of the
    training set is then in exactly one shard and joins each step independently with
    probability ``q`` — Poisson sampling of the whole training set at ``q``, what the
    accountant records — and the wrapper's noisy all-reduce adds the noise once
    (``expected_batch_size = q·N``, the global one). With banded noise each rank's cyclic sampler
    assigns its units to groups independently, so the union is cyclic Poisson sampling at
    ``(b, q)``. With BLT noise each rank keeps ``⌊N/R⌋`` units of its shard (the ``N mod R``
    others join no batch) and cuts them into the same ``⌈⌊N/R⌋/B⌉`` fixed batches, so every
    unit is in one fixed global batch, visited once an epoch: the min separation the accountants
    record. Without this, every rank sampled the whole data set at ``B/N``: an example could
    join several ranks' batches in one step (sensitivity up to ``R·C``) while the accountant
    assumed one."""
    if not kwargs.get("distributed"):
        return None
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise InvalidHyperparameterError(
            "distributed=True needs an initialised process group: call torch.distributed.init_process_group "
            "in every rank before make_private"
        )
    return dist.get_rank(), dist.get_world_size()


def _sampling(
    data_loader: DataLoader,
    *,
    delta: float | None,
    delta_name: str,
    allow_large_delta: bool,
    epochs: int | None,
    averaging: Any,
    bands: int | None,
    noise_mechanism: str,
    world: tuple[int, int] | None = None,
) -> _Sampling:
    """The Poisson sampling the loader's batch size and training set give (``N``: the examples
    its sampler ranges over, :func:`adaclip_torch._user_loader.read_training_set`), checked (δ
    against ``1/N``, the averaging's horizon, ``b·q <= 1``). Data parallel (``world``): ``B``
    is each rank's, ``q = R·B/N`` and the indices are this rank's shard (:func:`_data_parallel`)."""
    training = read_training_set(data_loader, world=world)
    dataset, num_samples, batch_size = data_loader.dataset, training.num_samples, training.batch_size
    indices = training.indices
    if world is not None:
        ranks = world[1]
        if ranks * batch_size > num_samples:
            raise InvalidHyperparameterError(
                f"{ranks} ranks with batch_size={batch_size} each expect {ranks * batch_size} examples a step, more "
                f"than the {num_samples} of the training set: lower the per-rank batch size"
            )
        batch_size, indices = ranks * batch_size, shard(training, world)
        if noise_mechanism == "blt":
            # fixed order: every rank cuts the same number of units into the same number of
            # batches (the min separation the accountants record); the N mod R units beyond
            # R·⌊N/R⌋ are left out of every batch (a public, data-independent choice)
            indices = indices[: num_samples // ranks]
    if delta is not None and not allow_large_delta and delta * num_samples >= 1:
        raise InvalidHyperparameterError(
            f"{delta_name}={delta!r} is at least 1/N = 1/{num_samples} for this data set: an (epsilon, delta) "
            "guarantee with delta >= 1/N allows publishing an example in the clear, so it protects no one. "
            f"Choose delta well below 1/N (e.g. 1e-5, or 1/(10 N) = {1 / (10 * num_samples):.3g}); "
            "allow_large_delta=True accepts it anyway (experiments only)"
        )
    q = sample_rate_for(batch_size, num_samples)
    # fixed-order batches (BLT): ⌈N/B⌉ batches an epoch (data parallel: ⌈⌊N/R⌋/B_r⌉ on every
    # rank, B_r = B/R the rank's batch); Poisson sampling: round(1/q) steps
    if noise_mechanism == "blt":
        per_rank = num_samples if world is None else num_samples // world[1]
        num_steps = -(-per_rank // (batch_size if world is None else batch_size // world[1]))
    else:
        num_steps = steps_per_epoch(q)
    total_steps = None if epochs is None else epochs * num_steps
    if isinstance(averaging, str) and total_steps is None:
        raise InvalidHyperparameterError(
            f"averaging={averaging!r} spans the last 10 % of the run, whose length make_private knows from "
            "epochs (with target_epsilon); otherwise give an EMA decay (e.g. averaging=0.999) or an "
            "adaclip.averaging.AveragingConfig(horizon=...)"
        )
    averaging_config = _averaging.config_from_spec(averaging, total_steps)
    if bands is not None and noise_mechanism == "banded":
        _correlated.accounted_sample_rate(q, bands)  # b·q <= 1, refused with the largest b allowed
    return _Sampling(dataset, num_samples, q, num_steps, total_steps, averaging_config, indices, world)


def _noise_multiplier(
    sampling: _Sampling,
    bands: int,
    *,
    noise_multiplier: float | None,
    target_epsilon: float | None,
    delta: float | None,
    delta_name: str,
    epochs: int | None,
    mechanism: str,
    progress: bool | None,
    calibrated: dict[int, float] | None = None,
) -> float:
    """σ: calibrated for the planned run, or the given one checked against it (with ``b``
    bands the run is ``⌈T/b⌉`` compositions at rate ``b·q``). ``calibrated`` (b ↦ σ_b, the same
    calibration for the same run) is read first and filled."""
    q, total_steps = sampling.q, sampling.total_steps
    rate, accounted = _correlated.accounted_sample_rate(q, bands), None if total_steps is None else -(-total_steps // bands)
    if noise_multiplier is None:
        assert target_epsilon is not None and delta is not None and total_steps is not None
        return _planning.banded_sigma_calibrator(
            target_epsilon=target_epsilon, delta=delta, sample_rate=q, steps=total_steps, accountant=mechanism,
            progress=progress, cache=calibrated,
        )(bands)  # fmt: skip
    sigma = noise_multiplier
    if target_epsilon is not None and accounted is not None:
        planned = _accounting.Accountant(mechanism, progress=progress)
        planned.step(noise_multiplier=sigma, sample_rate=rate, num_steps=accounted)
        spent = planned.epsilon(delta)
        if spent > target_epsilon:
            raise InvalidHyperparameterError(
                f"noise_multiplier={sigma!r} does not fit epochs={epochs} ({epochs * sampling.num_steps} steps at "
                f"q={q:.6g}) in target_epsilon={target_epsilon!r} at {delta_name}={delta!r}: the run "
                f"would spend epsilon={spent:.4g}. Raise noise_multiplier, lower epochs, or leave "
                "noise_multiplier out to calibrate it"
            )
    return sigma


class _Blt(NamedTuple):
    """What make_private builds for BLT noise: the fixed-order sampler, the fitted factor."""

    sampler: Any
    mechanism: Any


def _blt_mechanism(
    sampling: _Sampling,
    buffers: Any,
    *,
    epochs: int,
    noise_multiplier: float | None,
    target_epsilon: float,
    delta: float,
    delta_name: str,
    mechanism: str,
    seed: int | None,
) -> tuple[_Blt, float]:
    """BLT noise for ``epochs`` epochs of fixed-order batches (``b = ⌈N/B⌉`` per epoch,
    ``T = epochs·b`` steps): the factor fitted for ``(T, b)`` with ``buffers`` buffers, and σ
    calibrated (or the given one checked) for the block-by-block record the optimizer makes —
    no amplification (:mod:`adaclip.accounting._min_separation`)."""
    generator = torch.Generator()
    if seed is None:
        generator.seed()
    else:
        # data parallel: each rank's own stream (the same generator on two ranks would include the
        # i-th units of their shards together, and the union would not be Poisson sampling)
        rank = 0 if sampling.world is None else sampling.world[0]
        generator.manual_seed(int(seed) + 1 + 1_000_003 * rank)
    ranks = 1 if sampling.world is None else sampling.world[1]
    batch_size = round(sampling.q * sampling.num_samples) // ranks  # this rank's B
    b = sampling.num_steps  # ⌈N/B⌉, data parallel ⌈⌊N/R⌋/B_r⌉ (see _sampling)
    total = epochs * b
    units = sampling.num_samples if sampling.world is None else len(sampling.indices)
    sampler = FixedOrderBatchSampler(units, batch_size, generator=generator, total_steps=total, indices=sampling.indices)
    noise = fit_blt(total, buffers=DEFAULT_BLT_BUFFERS if buffers is None else buffers, min_separation=b)
    prefix = _accounting.MinSeparationParticipation(b).prefix_sensitivities_squared(noise.column(total))
    if noise_multiplier is None:
        sigma = _accounting.calibrate_block_noise_multiplier(
            target_epsilon=target_epsilon, delta=delta, prefix=prefix, block=b, accountant=mechanism
        )
    else:
        sigma = noise_multiplier
        planned = _accounting.Accountant(mechanism)
        for s in _accounting.block_noise_multipliers(sigma, prefix, b):
            planned.step(noise_multiplier=s, sample_rate=1.0)
        spent = planned.epsilon(delta)
        if spent > target_epsilon:
            raise InvalidHyperparameterError(
                f"noise_multiplier={sigma!r} does not fit epochs={epochs} ({total} steps of BLT noise, no "
                f"amplification) in target_epsilon={target_epsilon!r} at {delta_name}={delta!r}: the run would "
                f"spend epsilon={spent:.4g}. Raise noise_multiplier or leave it out to calibrate it"
            )
    return _Blt(sampler, noise), sigma


def _check_sigma_suits(probe: Any, sigma: float, expected_batch_size: float, *, given: bool, strategy: str) -> None:
    """``(σ_g, σ_aux)`` exist for the strategy: the quantile rule's count needs ``σ < 2σ_b``
    (with ``σ_b = B̄/20`` by default)."""
    try:
        probe.noise_multipliers(sigma, expected_batch_size)
    except InvalidHyperparameterError as err:
        how = "given" if given else "calibrated for the budget"
        raise InvalidHyperparameterError(f"the noise multiplier {sigma:.6g} ({how}) does not suit strategy "
                                         f"{strategy!r}: {err}") from None


def _accountant(
    mechanism: str | None, *, target_epsilon: float | None, delta: float | None, ledger: Any, progress: bool | None
) -> _accounting.Accountant:
    """The accountant the optimizer records in: with the budget ``(target_epsilon, delta)``
    when there is one, else recording only; keeping ``ledger`` when given."""
    if target_epsilon is None:
        return _accounting.Accountant(mechanism, ledger=ledger, progress=progress)
    return _accounting.Accountant(mechanism, target_epsilon=target_epsilon, delta=delta, ledger=ledger, progress=progress)


def _build(
    strategy: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    data_loader: DataLoader,
    sampling: _Sampling,
    kwargs: dict[str, Any],
    *,
    banded: _correlated.BandedNoise | None,
    blt: _Blt | None = None,
    sigma: float,
    accountant: _accounting.Accountant,
    seed: int | None,
    secure_mode: bool,
    loss_reduction: str,
) -> tuple[DPOptimizer, DataLoader]:
    """The Poisson loader (cyclic with banded noise; its generator seeded with ``seed + 1``),
    a :class:`~adaclip_torch.data.CountingDataLoader`, and the wrapper ``STRATEGIES[strategy]``
    around ``optimizer`` holding its sampler (``sampler=``: every step is checked against the
    batches the loader handed to the loop, with independent noise too)."""
    generator = torch.Generator()
    if seed is None:
        generator.seed()
    else:
        # data parallel: each rank's own stream (the same generator on two ranks would include the
        # i-th units of their shards together, and the union would not be Poisson sampling)
        rank = 0 if sampling.world is None else sampling.world[0]
        generator.manual_seed(int(seed) + 1 + 1_000_003 * rank)
    if blt is not None:
        # counts the batches it hands to the loop (workers draw ahead): each step is checked exactly
        loader: DataLoader = CountingDataLoader(
            sampling.dataset, batch_sampler=blt.sampler, collate_fn=data_loader.collate_fn,
            **_loader_kwargs(data_loader),
        )  # fmt: skip
        kwargs["noise_mechanism"], kwargs["sampler"] = blt.mechanism, blt.sampler
    else:
        loader = poisson_data_loader(
            sampling.dataset,
            sampling.q,
            num_steps=sampling.num_steps,
            generator=generator,
            collate_fn=data_loader.collate_fn,
            bands=1 if banded is None else banded.bands,
            indices=sampling.indices,
            **_loader_kwargs(data_loader),
        )
    if banded is not None:
        kwargs["noise_mechanism"] = banded
    if blt is None:
        # the optimizer holds the sampler it is accounted for, whatever the noise (b = 1 too): each
        # step must release the next batch this loader hands to the loop (not the user's own loader's)
        kwargs["sampler"] = loader.batch_sampler
    if sampling.averaging is not None:
        kwargs["averaging"] = sampling.averaging
    private_optimizer = STRATEGIES[strategy](
        optimizer,
        model,
        noise_multiplier=sigma,
        expected_batch_size=(  # data parallel: the global batch, every rank's B
            blt.sampler.expected_batch_size * (1 if sampling.world is None else sampling.world[1])
            if blt is not None else sampling.q * sampling.num_samples
        ),
        accountant=accountant,
        sample_rate=blt.sampler.sample_rate if blt is not None else sampling.q,
        seed=None if seed is None else int(seed),
        secure_mode=secure_mode,
        loss_reduction=loss_reduction,
        **kwargs,
    )
    return private_optimizer, loader


def make_private(
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    data_loader: DataLoader | None = None,
    *,
    module: nn.Module | None = None,
    target_epsilon: float | None = None,
    delta: float | None = None,
    target_delta: float | None = None,
    epochs: int | None = None,
    noise_multiplier: float | None = None,
    allow_large_delta: bool = False,
    accountant: str | None = None,
    mechanism: str | None = None,
    ledger: Any = None,
    strategy: str = DEFAULT_STRATEGY,
    max_grad_norm: float | None = None,
    loss_reduction: str = "mean",
    noise_mechanism: str = "auto",
    bands: int | None = None,
    band_coefficients: str = "sqrt",
    buffers: int | None = None,
    seed: int | None = None,
    secure_mode: bool = False,
    averaging: Any = None,
    scale_adaptive_lr: bool | None = None,
    progress: bool | None = None,
    **strategy_kwargs: Any,
) -> tuple[nn.Module, DPOptimizer, DataLoader]:
    """Return ``(model, private optimizer, Poisson loader)``.

    Give either ``noise_multiplier`` (used as is, like Opacus's ``make_private``) or
    ``target_epsilon`` with ``delta`` and ``epochs`` (σ calibrated, like Opacus's
    ``make_private_with_epsilon``; see also :func:`make_private_with_epsilon`).

    The keywords come in five groups, in this order in the signature and under Args below:

    * **what to train**: ``model``, ``optimizer``, ``data_loader`` (``module``: Opacus's name for
      ``model``);
    * **the privacy budget**: ``target_epsilon``, ``delta`` (or Opacus's ``target_delta``) and
      ``epochs`` (σ calibrated), or ``noise_multiplier`` (σ as given); then
      ``allow_large_delta``, the accountant (``mechanism``, or Opacus's ``accountant``) and a
      crash-safe ``ledger``;
    * **clipping**: ``strategy`` (flat clipping, DP-SGD's, by default), ``max_grad_norm``,
      ``loss_reduction``, and the strategy's own keywords (``**strategy_kwargs``, last);
    * **the noise**: ``noise_mechanism`` (``"auto"``: banded correlated noise when the run is
      known and the library's rule expects it to pay, else DP-SGD's independent noise),
      ``bands``, ``band_coefficients``, ``buffers``, ``seed``, ``secure_mode``;
    * **around the optimizer**: ``averaging``, ``scale_adaptive_lr``, ``progress``.

    What was built is logged once (logger ``adaclip_torch.make_private``) and shown by
    ``optimizer.summary()``. For Opacus's behaviour exactly (DP-SGD, Poisson sampling, σ
    calibrated for ``target_epsilon``): ``noise_mechanism="independent"``.

    Args:
      model: the model to train; returned as is (per-example hooks are attached to it, it is
        not wrapped).
      optimizer: its (plain) optimizer.
      data_loader: a loader with a fixed ``batch_size`` ``B <= N`` (or a
        ``batch_sampler=torch.utils.data.BatchSampler(sampler, B, drop_last)``); its dataset,
        ``collate_fn`` and worker settings are reused, its sampling is replaced by Poisson
        sampling with ``q = B/N`` (cyclic Poisson for banded noise, fixed order for BLT) over
        exactly the ``N`` examples its sampler ranges over: the whole data set for
        ``shuffle=True``/``False`` (``RandomSampler``/``SequentialSampler``), the given indices
        for ``SubsetRandomSampler(indices)`` or a list of indices. The new loader yields
        indices of the same data set (``loader.batch_sampler.indices``: the training
        examples' indices, ``None`` for all), ``N``, ``q``, the steps of an epoch and the
        ``δ < 1/N`` check are the training set's, and no other example is ever read. The
        privacy unit is one training example: the guarantee is for adding or removing one
        example of that set; the examples outside it are never read by the loader, and what
        else is done with them (validation, model selection) is outside this accounting.
        Refused, with the way out in the error: a
        ``WeightedRandomSampler`` (unequal inclusion probabilities, which the accountant does
        not assume), a ``RandomSampler`` with ``replacement=True`` or ``num_samples``, repeated
        or negative indices, a ``DistributedSampler``, any other sampler or batch sampler
        (its examples cannot be read without iterating it, which would consume its
        randomness), and subclasses of torch's samplers. The user's sampler, generator,
        ``shuffle`` and ``drop_last`` do not carry over; ``seed`` seeds the new sampler.
        Train on the *returned* loader (a :class:`~adaclip_torch.data.CountingDataLoader`):
        the optimizer holds its sampler and refuses, before anything changes, a step that does
        not release the next batch that loader handed to the loop — a batch skipped or stepped
        twice, or batches from another loader (``model, optimizer, _ = make_private(...)`` and
        then iterating ``data_loader``) — whatever the noise mechanism and the number of
        workers.
      module: Opacus's name for ``model``; give one of the two.
      target_epsilon: ε of the privacy budget of the whole run.
      delta: δ of that budget, in (0, 1).
      target_delta: Opacus's name for ``delta`` (give one of the two).
      epochs: ``E``: σ is calibrated for ``E · round(1/q)`` steps. Needed with
        ``target_epsilon`` alone; meaningless (and refused) with ``noise_multiplier`` alone.
      noise_multiplier: σ, the noise multiplier of every step (``>= 0``). Without
        ``target_epsilon`` the accountant has no budget (ask ``optimizer.accountant.epsilon(δ)``);
        with ``target_epsilon`` and ``delta`` it refuses any step beyond that budget, and with
        ``epochs`` too the planned ``epochs · round(1/q)`` steps must fit in it.
      allow_large_delta: accept ``δ ≥ 1/N`` (``N``: the training examples). Refused by default: an
        (ε, δ) guarantee with ``δ ≥ 1/N`` allows a mechanism that publishes one example of the
        data set in the clear, so it protects nobody in particular; the usual choice is
        ``δ ≪ 1/N`` (e.g. ``1e-5`` for ``N ≤ 10⁵``). For experiments only.
      accountant: the accounting method, for calibrating σ and for recording the run (Opacus's
        keyword, ``PrivacyEngine(accountant="prv")``): ``"pld"`` (privacy loss distributions,
        the tightest valid upper bound) or ``"rdp"`` (Rényi DP: looser, so σ is about 7 %
        larger for the same ε); ``"prv"`` (Opacus's default) is accepted and computed as
        ``"pld"`` (the same quantity; see the Accounting page), ``"gdp"`` is refused (a
        central-limit approximation, not an upper bound on ε). ``None`` (default): ``"pld"``;
        an optimizer resuming a run from a ``ledger=`` or a checkpoint made with ``"rdp"`` goes
        on accounting it with ``"rdp"``.
      mechanism: deprecated, the old name of ``accountant`` (same values): it still works and
        warns :class:`FutureWarning`; given with ``accountant``, the two must agree.
      ledger: a path: the accountant keeps a crash-safe ledger there
        (:class:`adaclip.ledger.PrivacyLedger`): each step's record is appended and fsynced
        before anything computed from the step leaves the optimizer, and a run restarted on the
        same ledger (after a crash, from any checkpoint) starts from everything it recorded, so
        the reported ε never under-counts. Keep one ledger per run and never restore it from a
        backup.
      strategy: ``"flat"`` (default: DP-SGD, ``C = max_grad_norm``, 1 when not given; the best
        configuration without tuning in our utility benchmark, round two), ``"adaclip"``
        (:class:`~adaclip_torch.AdaClip`'s centred default; add ``preset="patent"`` for the
        patent's algorithm), ``"per_layer"``, ``"scaled"``,
        ``"quantile"`` (:class:`~adaclip_torch.QuantileClip`) or ``"automatic"``
        (:class:`~adaclip_torch.AutomaticClip`).
      max_grad_norm: the clip norm ``C``: flat clipping's ``C``; per-layer clipping's total
        ``C``; scaled clipping's ``C``; the quantile rule's initial ``C_0``; automatic
        clipping's ``C`` (the release's scale); AdaCliP's initial clip norm
        (``initial_max_grad_norm``; with ``scale="separated"`` also the separated scale's
        ``C``). ``None``: the strategy's own keywords or defaults.
      loss_reduction: ``"mean"`` or ``"sum"``, how the loss is reduced over the batch.
      noise_mechanism: ``"auto"`` (the default), ``"independent"`` (DP-SGD) or ``"banded"``:
        correlated noise (amplified banded matrix factorisation, :mod:`adaclip.correlated`; it
        pays on long runs). The loader then samples with cyclic Poisson sampling
        (:class:`~adaclip_torch.data.CyclicPoissonBatchSampler`) and σ is calibrated for
        ``⌈T/b⌉`` compositions at rate ``b·q``. ``b = 1`` is DP-SGD (the returned optimizer then
        uses independent noise and plain Poisson sampling). ``"auto"``: ``"banded"`` with the
        library's choice of ``b`` (see ``bands``) when make_private knows the run — a
        ``target_epsilon`` with ``epochs`` and no ``noise_multiplier`` — or when ``bands`` is
        given, and unless ``compile_release=True``; otherwise ``"independent"``. Runs shorter
        than :data:`adaclip.correlated.planning.MIN_STEPS_FOR_BANDS` (50) steps get ``b = 1``,
        DP-SGD exactly: on 16-step runs the expected-error choice (b = 2 … 16) was behind DP-SGD
        by 0.5–1.3 points in 7 of 10 cells (MNIST and digits MLPs, 10 seeds), while at 60 steps
        it was never behind (level or ahead by up to 1.1 points). In our round-three benchmark
        the choice was ahead of tuned DP-SGD by 1.3–4.2 points on 1,950-step runs; on the
        440-step digits run it was ``b = 1``; at 66 steps it was ahead (+1.2 ± 0.1 points,
        ε = 3). What was chosen is logged once (a ``WARNING`` of
        the ``adaclip_torch.make_private`` logger when ``"auto"`` chose banded noise or an
        adaptive optimizer's learning rate was scaled, else ``INFO``), and
        ``optimizer.summary()``, ``optimizer.noise_mechanism`` and ``optimizer.bands`` say it.
        ``"blt"``: buffered linear Toeplitz noise (:mod:`adaclip.correlated.blt`) over
        fixed-order batches (:class:`~adaclip_torch.data.FixedOrderBatchSampler`: the data
        shuffled once with the seed, cut into ``b = ⌈N/B⌉`` batches visited in the same order
        every epoch); no amplification by sampling: σ is calibrated for the Gaussian mechanism
        with the min-separation sensitivity of the factor fitted for ``epochs·b`` steps. Needs
        ``target_epsilon``, ``delta`` and ``epochs``; never chosen by ``"auto"``. With
        ``distributed=True`` each rank cuts ``⌊N/R⌋`` examples of its shard into the same
        number of fixed batches (``N mod R`` examples are left out) and holds ``m·d/R`` of the
        noise state.
      bands: ``b`` for ``"banded"``; ``None`` (with ``target_epsilon`` and ``epochs``): chosen
        before training, from public quantities only, as the candidate ``b ∈ {1, 2, 4, …, 64}``
        (``b ≤ 1/q``) whose calibrated σ_b gives the smallest expected error of the workload
        over the ``T = epochs · round(1/q)`` steps — momentum SGD's momentum sums, Adam's first
        moment, prefix sums otherwise (``b = 1``, DP-SGD, is always a candidate). With an
        adaptive optimizer (Adam, AdamW, ...: ``betas`` in its parameter groups) whose learning
        rate is not scaled (``scale_adaptive_lr``) the candidates stop at
        :data:`ADAPTIVE_OPTIMIZER_MAX_BANDS` (4), an empirical rule from our benchmark. The
        buffers, ``(b − 1)·d`` numbers, must fit in :data:`BANDED_BUFFER_BUDGET_BYTES` (1 GiB;
        a 124M-parameter model in float32 gets at most b = 2): larger b are left out of the choice. The
        budget is per rank: with ``distributed=True`` each of the R ranks holds ``1/R`` of the
        buffers (sharded noise state, DPOptimizer's ``noise_sharding``).
      band_coefficients: ``"sqrt"`` (default: the truncated square root of the prefix-sum
        matrix, the coefficients our accuracy evidence is for) or ``"optimised"`` (minimise the
        workload's expected error over the run; lower error in theory, but a per-step noise
        variance several times larger, which adaptive strategies see; needs ``epochs``).
      buffers: ``m`` (1 to 4) for ``"blt"`` (default 3): ``m·d`` numbers of noise state.
      seed: seeds the noise and the sampler (experiments only; ``None``: OS randomness).
      secure_mode: OS CSPRNG noise with the floating-point mitigation (no ``seed``).
      averaging: keep an average of the parameters (post-processing of the releases, free in
        privacy; it pays on long runs): ``"ema"`` (an EMA with warm-up over the last 10 % of the
        ``epochs · round(1/q)`` steps), ``"tail"`` (the uniform average of that last 10 %), an EMA
        decay in ``[0, 1)``, or an :class:`adaclip.averaging.AveragingConfig`. Evaluate and save
        it with ``with optimizer.averaged(): ...``; ``None`` (default): none.
      scale_adaptive_lr: with banded noise and an adaptive optimizer (Adam, AdamW, ...:
        ``betas`` in its parameter groups), multiply its learning rates by
        ``ρ = σ_b·√v̄/σ_1`` (:func:`adaclip.correlated.coefficients.adaptive_lr_scale`; ``σ_1``
        is DP-SGD's calibrated σ for the same run, ``v̄`` the banded noise's mean per-step
        variance). Adam divides by a running second moment that the noise dominates, and banded
        noise makes that moment ``ρ²`` times DP-SGD's, so a learning rate tuned for DP-SGD is
        ``ρ`` times too small for it. ``ρ`` comes from public quantities only and is
        ``optimizer.lr_scale``. ``None`` (default): scale when the optimizer is adaptive,
        the noise is banded with ``b > 1`` and σ was calibrated for a ``target_epsilon`` (no
        ``noise_multiplier``) — unless an LR scheduler is already attached to the optimizer
        (its ``initial_lr`` is set: its base rates could not follow; create it after
        make_private); ``True``: the same, refused where it cannot apply; ``False``: never.
        With the factor, ``bands=None`` chooses b without the adaptive optimizers' cap (see
        ``bands``); in our round-three benchmark the factor with that b took the user-level
        LSTM with Adam from 7.6 points behind the best baseline to 0.3 behind (ε = 3) and from
        4.3 behind to 0.9 ahead (ε = 8), and cost 2.1 points on the transformer at ε = 3.
      progress: show the calibration of σ (and slow budget searches) on stderr: ``None``
        (default) once the work has taken a second (a bar on a terminal, a line per second
        through the ``adaclip._progress`` logger when stderr is a file or a pipe), ``True``
        always, ``False`` never. A PLD calibration takes a fraction of a second per σ (about
        2 s for the seven candidate numbers of bands of a long run).
      strategy_kwargs: the strategy's own keywords (``std_min``, ``std_max``, ``beta_std``,
        AdaCliP's options ``scale``, ``pooling``, ``correction``, ``centre``, ``update_every``,
        ``quantile``, ...; ``target_quantile``, ``clip_learning_rate``,
        ``count_noise_multiplier``; ``stability``; ``group_max_grad_norms``, ``layer_scales``,
        ...) and the wrapper's (``per_sample_mode`` — ``"auto"`` by default, see
        :class:`~adaclip_torch.optimizer.DPOptimizer` —, ``batch_first``, ...); names the chosen
        strategy does not take are refused, Opacus's with the name to use here (e.g.
        ``max_physical_batch_size``: :class:`adaclip_torch.BatchMemoryManager`).

    Raises:
      InvalidHyperparameterError: an argument is missing, out of range, unknown to the
        strategy, or inconsistent with another; raised before σ is calibrated and before
        anything is built or changed.
    """
    # --- the arguments, all of them, before anything slow or stateful
    if mechanism is not None:
        warn_mechanism_keyword("make_private", stacklevel=2)
    mechanism_named = mechanism is not None or accountant is not None  # else a resumed run keeps its own
    model, mechanism = _check_parts(
        model, module, optimizer, data_loader, strategy=strategy, mechanism=mechanism, accountant=accountant,
        progress=progress, loss_reduction=loss_reduction, seed=seed, secure_mode=secure_mode,
    )  # fmt: skip
    noise_multiplier, delta, delta_name = _check_budget(
        noise_multiplier, target_epsilon, delta, target_delta, allow_large_delta=allow_large_delta, ledger=ledger
    )
    requested_noise = noise_mechanism
    noise_mechanism, bands = _check_noise_mechanism(
        noise_mechanism, bands, band_coefficients, target_epsilon=target_epsilon, noise_multiplier=noise_multiplier,
        epochs=epochs, compile_release=strategy_kwargs.get("compile_release"),
    )  # fmt: skip
    scale_adaptive_lr = _check_scale_adaptive_lr(
        scale_adaptive_lr, optimizer, noise_mechanism=noise_mechanism, bands=bands, target_epsilon=target_epsilon,
        noise_multiplier=noise_multiplier,
    )  # fmt: skip
    epochs = _check_epochs(epochs, target_epsilon=target_epsilon, noise_multiplier=noise_multiplier)
    if max_grad_norm is not None:
        max_grad_norm = finite_positive("max_grad_norm", max_grad_norm)
    if buffers is not None and noise_mechanism != "blt":
        raise InvalidHyperparameterError(f"buffers={buffers!r} needs noise_mechanism='blt'")
    kwargs = _strategy_kwargs(strategy, max_grad_norm, strategy_kwargs, _SET_HERE)
    probe = _check_strategy_values(strategy, kwargs)
    world = _data_parallel(kwargs, noise_mechanism)
    sampling = _sampling(
        data_loader, delta=delta, delta_name=delta_name, allow_large_delta=allow_large_delta, epochs=epochs,
        averaging=averaging, bands=bands, noise_mechanism=noise_mechanism, world=world,
    )  # fmt: skip
    check_model(model)

    # --- the noise mechanism (b, coefficients), the noise multiplier and the accountant
    banded = None
    calibrated: dict[int, float] = {}  # b ↦ σ_b for this run: each b is calibrated once
    if noise_mechanism == "banded":
        sharded_over = world[1] if world is not None and strategy_kwargs.get("noise_sharding", "auto") != "rank0" else 1
        banded = _banded_mechanism(
            optimizer, bands, q=sampling.q, total_steps=sampling.total_steps, target_epsilon=target_epsilon,
            delta=delta, mechanism=mechanism, optimise=band_coefficients == "optimised", progress=progress,
            lr_scaled=scale_adaptive_lr, calibrated=calibrated, ranks=sharded_over,
        )  # fmt: skip
        if banded.bands == 1:
            banded = None  # one band is DP-SGD: independent noise and plain Poisson sampling
    blt = None
    if noise_mechanism == "blt":
        assert epochs is not None and target_epsilon is not None and delta is not None
        blt, sigma = _blt_mechanism(
            sampling, buffers, epochs=epochs, noise_multiplier=noise_multiplier, target_epsilon=target_epsilon,
            delta=delta, delta_name=delta_name, mechanism=mechanism, seed=seed,
        )  # fmt: skip
    else:
        sigma = _noise_multiplier(
            sampling, 1 if banded is None else banded.bands, noise_multiplier=noise_multiplier,
            target_epsilon=target_epsilon, delta=delta, delta_name=delta_name, epochs=epochs, mechanism=mechanism,
            progress=progress, calibrated=calibrated,
        )  # fmt: skip
    _check_sigma_suits(
        probe, sigma, sampling.q * sampling.num_samples, given=noise_multiplier is not None, strategy=strategy
    )
    built = _accountant(mechanism if mechanism_named else None, target_epsilon=target_epsilon, delta=delta, ledger=ledger, progress=progress)
    lr_scale = 1.0
    if scale_adaptive_lr and banded is not None:
        assert target_epsilon is not None and delta is not None and sampling.total_steps is not None
        sigma_independent = _noise_multiplier(
            sampling, 1, noise_multiplier=None, target_epsilon=target_epsilon, delta=delta, delta_name=delta_name,
            epochs=epochs, mechanism=mechanism, progress=progress, calibrated=calibrated,
        )  # fmt: skip
        lr_scale = adaptive_lr_scale(
            banded.coefficients, sampling.total_steps, sigma=sigma, sigma_independent=sigma_independent
        )

    # --- build
    private_optimizer, loader = _build(
        strategy, model, optimizer, data_loader, sampling, kwargs, banded=banded, blt=blt, sigma=sigma,
        accountant=built,
        seed=seed, secure_mode=secure_mode, loss_reduction=loss_reduction,
    )  # fmt: skip
    if lr_scale != 1.0:  # last: nothing is changed in the user's optimizer unless everything was built
        for group in optimizer.param_groups:
            group["lr"] = group["lr"] * lr_scale
        private_optimizer._lr_scale = lr_scale
    if epochs is not None and sampling.total_steps is not None:
        private_optimizer._planned_run = (epochs, sampling.total_steps)  # for the budget error's message
    _announce(private_optimizer, loader, requested_noise=requested_noise, calibrated=noise_multiplier is None,
              total_steps=sampling.total_steps, inner=optimizer)  # fmt: skip
    return model, private_optimizer, loader


#: make_private says what it built through this logger, once per call (see :func:`_announce`).
logger = logging.getLogger("adaclip_torch.make_private")


def _announce(
    opt: DPOptimizer, loader: Any, *, requested_noise: str, calibrated: bool, total_steps: int | None, inner: Any
) -> None:
    """Log what :func:`make_private` built, in one record: the noise (mechanism, b), σ and how
    it was obtained, the accountant and its budget, the planned steps and the accounted
    compositions and rate, the sampler, and any change made to the user's optimizer. A
    ``WARNING`` when something was chosen or changed on the user's behalf that Opacus would not
    do (``noise_mechanism="auto"`` choosing banded noise, a learning rate multiplied), else
    ``INFO``. Public hyperparameters only. Silence it with
    ``logging.getLogger("adaclip_torch").setLevel(logging.ERROR)``."""
    noise = opt.noise_mechanism
    chose_banded = requested_noise == "auto" and noise == "banded"
    level = logging.WARNING if chose_banded or opt.lr_scale != 1.0 else logging.INFO
    if not logger.isEnabledFor(level):
        return
    what = {"banded": f"banded noise, b = {opt.bands}", "blt": f"BLT noise, min separation {opt.min_separation}"}
    parts = [what.get(noise, "independent noise (DP-SGD)") + (" (noise_mechanism='auto')" if requested_noise == "auto" else "")]
    if getattr(opt, "noise_sharding", "rank0") == "sharded":
        parts.append("noise state sharded over the ranks (noise_sharding='rank0' keeps it on rank 0)")
    acc = opt.accountant
    sigma = f"sigma = {opt.noise_multiplier:.4g}"
    if calibrated and acc is not None and acc.target_epsilon is not None:
        sigma += f" calibrated with {acc.mechanism} for epsilon = {acc.target_epsilon:g}, delta = {acc.delta:g}"
    parts.append(sigma)
    if total_steps is not None:
        b = opt.bands or 1
        parts.append(f"{total_steps} planned steps, accounted as {-(-total_steps // b)} compositions at rate "
                     f"{opt.accounted_sample_rate:.4g} (q = {opt.sample_rate:.4g})")  # fmt: skip
    sampler = getattr(loader, "batch_sampler", None)
    if sampler is not None:
        parts.append(f"sampler {type(getattr(sampler, 'sampler', sampler)).__name__}")
    if noise == "blt" and opt.distributed and sampler is not None:
        parts.append(f"each rank cuts {sampler.num_samples} examples (floor(N/ranks); the N mod ranks others are "
                     f"left out) into {sampler.num_batches} fixed batches")  # fmt: skip
    if opt.lr_scale != 1.0:
        parts.append(f"the learning rate of your {type(inner).__name__} was multiplied by {opt.lr_scale:.4g} "
                     "(scale_adaptive_lr; pass scale_adaptive_lr=False to keep it)")  # fmt: skip
    if chose_banded:
        parts.append("noise_mechanism='independent' gives Opacus's DP-SGD")
    if requested_noise == "auto" and noise == "independent" and total_steps is not None:
        if total_steps < _planning.MIN_STEPS_FOR_BANDS:
            parts.append(f"b = 1 because the run has {total_steps} steps, fewer than "
                         f"{_planning.MIN_STEPS_FOR_BANDS} (on short runs banded noise was behind DP-SGD; "
                         "bands= overrides)")  # fmt: skip
    logger.log(level, "make_private built %s", "; ".join(parts))


def make_private_with_epsilon(
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    data_loader: DataLoader | None = None,
    *,
    target_epsilon: float,
    target_delta: float | None = None,
    epochs: int,
    max_grad_norm: float | None = None,
    delta: float | None = None,
    **kwargs: Any,
) -> tuple[nn.Module, DPOptimizer, DataLoader]:
    """:func:`make_private` with σ calibrated for ``(target_epsilon, target_delta)`` over ``epochs``.

    The counterpart of Opacus's ``PrivacyEngine.make_private_with_epsilon(module, optimizer,
    data_loader, target_epsilon=, target_delta=, epochs=, max_grad_norm=)``; ``delta=`` is
    accepted in place of ``target_delta=`` and ``module=`` in place of ``model``. ``noise_multiplier`` is not taken (it is what is
    calibrated). The other keywords (``strategy``, ``accountant``,
    ``seed``, ``secure_mode``, ``loss_reduction``, ``progress``, strategy keywords) are
    :func:`make_private`'s; the default strategy is
    flat clipping (Opacus's DP-SGD) with ``max_grad_norm`` its clip norm (1 when not given);
    ``strategy="adaclip"`` for AdaCliP, where ``max_grad_norm`` is the initial clip norm.

    Raises:
      InvalidHyperparameterError: as :func:`make_private`, and for a ``noise_multiplier``.
    """
    if "noise_multiplier" in kwargs:
        raise InvalidHyperparameterError(
            "make_private_with_epsilon calibrates the noise multiplier: do not pass noise_multiplier "
            "(use make_private(noise_multiplier=...) to choose it)"
        )
    if target_delta is None and delta is None:
        raise InvalidHyperparameterError("make_private_with_epsilon needs target_delta (or delta), the δ of the budget")
    if kwargs.get("mechanism") is not None:  # the old name: warned here, at the caller's line
        warn_mechanism_keyword("make_private_with_epsilon", stacklevel=2)
        kwargs["accountant"] = _accounting.resolve_mechanism(kwargs.pop("mechanism"), kwargs.get("accountant"))
    return make_private(
        model,
        optimizer,
        data_loader,
        target_epsilon=target_epsilon,
        target_delta=target_delta,
        delta=delta,
        epochs=epochs,
        max_grad_norm=max_grad_norm,
        **kwargs,
    )
