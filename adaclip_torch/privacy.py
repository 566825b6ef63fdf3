"""``make_private``: calibrate σ for a target (ε, δ), Poisson-sample the data, wrap the optimizer.

Given ``N`` training units, a loader with batch size ``B`` and ``E`` epochs:

* ``q = B/N`` (each unit joins a step with probability ``q``; ``B̄ = qN = B``);
* ``T = E · round(1/q)`` steps;
* ``σ`` = the smallest noise multiplier for which ``T`` sampled Gaussian steps of rate ``q``
  stay within ``(target_epsilon, delta)`` (:func:`adaclip.accounting.calibrate_noise_multiplier`);
* an :class:`adaclip.accounting.Accountant` with that budget is attached: every step records
  ``(q, σ_t)``, and a step beyond the budget raises before it changes anything.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from adaclip.errors import InvalidHyperparameterError
from adaclip_torch.data import poisson_data_loader, sample_rate_for, steps_per_epoch
from adaclip_torch.optimizer import AdaClip, DPOptimizer, FlatClip, PerLayerClip, ScaledClip

__all__ = ["make_private", "STRATEGIES"]

STRATEGIES: dict[str, type[DPOptimizer]] = {
    "adaclip": AdaClip,
    "flat": FlatClip,
    "per_layer": PerLayerClip,
    "scaled": ScaledClip,
}

_LOADER_KEYS = ("num_workers", "pin_memory", "persistent_workers", "prefetch_factor", "worker_init_fn", "timeout")


def _loader_kwargs(data_loader: DataLoader) -> dict[str, Any]:
    out = {k: getattr(data_loader, k) for k in _LOADER_KEYS if hasattr(data_loader, k)}
    if out.get("num_workers", 0) == 0:
        out.pop("prefetch_factor", None)
        out.pop("persistent_workers", None)
    return out


def make_private(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    data_loader: DataLoader,
    *,
    target_epsilon: float,
    delta: float,
    epochs: int,
    strategy: str = "adaclip",
    mechanism: str = "rdp",
    seed: int | None = None,
    secure_mode: bool = False,
    loss_reduction: str = "mean",
    **strategy_kwargs: Any,
) -> tuple[nn.Module, DPOptimizer, DataLoader]:
    """Return ``(model, private optimizer, Poisson loader)`` spending at most ``(ε, δ)``.

    Args:
      model: the model to train.
      optimizer: its (plain) optimizer.
      data_loader: a loader with a fixed ``batch_size``; its dataset and ``collate_fn`` are
        reused, its sampling is replaced by Poisson sampling with ``q = batch_size/len(dataset)``.
      target_epsilon: ε of the privacy budget of the whole run.
      delta: δ of that budget.
      epochs: ``E``; the run has ``E·round(1/q)`` steps.
      strategy: ``"adaclip"``, ``"flat"``, ``"per_layer"`` or ``"scaled"``.
      mechanism: the accountant, ``"rdp"`` or ``"pld"``.
      seed: seeds the noise and the sampler (experiments only; ``None``: OS randomness).
      secure_mode: OS CSPRNG noise with the floating-point mitigation.
      strategy_kwargs: the strategy's own keywords (``max_grad_norm``, ``std_min``, ...).
    """
    from adaclip.accounting import Accountant, calibrate_noise_multiplier

    if strategy not in STRATEGIES:
        raise InvalidHyperparameterError(f"strategy must be one of {sorted(STRATEGIES)}, got {strategy!r}")
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs <= 0:
        raise InvalidHyperparameterError(f"epochs must be a positive int, got {epochs!r}")
    batch_size = data_loader.batch_size
    if batch_size is None:
        raise InvalidHyperparameterError("data_loader must have a fixed batch_size (it sets q = batch_size/N)")
    dataset = data_loader.dataset
    num_samples = len(dataset)  # type: ignore[arg-type]
    q = sample_rate_for(batch_size, num_samples)
    num_steps = steps_per_epoch(q)
    sigma = calibrate_noise_multiplier(
        target_epsilon=target_epsilon, delta=delta, sample_rate=q, steps=epochs * num_steps, mechanism=mechanism
    )
    accountant = Accountant(mechanism, target_epsilon=target_epsilon, delta=delta)
    generator = torch.Generator()
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed + 1)
    loader = poisson_data_loader(
        dataset,
        q,
        num_steps=num_steps,
        generator=generator,
        collate_fn=data_loader.collate_fn,
        **_loader_kwargs(data_loader),
    )
    private_optimizer = STRATEGIES[strategy](
        optimizer,
        model,
        noise_multiplier=sigma,
        expected_batch_size=q * num_samples,
        accountant=accountant,
        sample_rate=q,
        seed=seed,
        secure_mode=secure_mode,
        loss_reduction=loss_reduction,
        **strategy_kwargs,
    )
    return model, private_optimizer, loader
