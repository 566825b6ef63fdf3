"""PyTorch plugin of adaclip: wrap any ``torch.optim`` optimizer in one line.

.. code-block:: python

    from adaclip_torch import AdaClip
    optimizer = AdaClip(torch.optim.Adam(model.parameters(), lr=1e-3), model,
                        noise_multiplier=1.1, expected_batch_size=256)
    loss = criterion(model(x), y); loss.backward(); optimizer.step(); optimizer.zero_grad()

- :mod:`adaclip_torch.optimizer` — :class:`DPOptimizer` and its strategies
  (:class:`AdaClip` with every adaptive option, :class:`FlatClip`, :class:`PerLayerClip`,
  :class:`ScaledClip`, :class:`QuantileClip`, :class:`AutomaticClip`);
- :mod:`adaclip_torch.noise` — seeded and secure-mode Gaussian noise;
- :mod:`adaclip_torch.data` — Poisson sampling with empty batches;
- :mod:`adaclip_torch.batch_memory` — :class:`BatchMemoryManager`, Opacus's physical-batch loop
  (logical batches split into physical ones, one release per logical batch);
- :mod:`adaclip_torch.privacy` — :func:`make_private` (σ given, or calibrated for a target ε)
  and :func:`make_private_with_epsilon`;
- :mod:`adaclip_torch.validation` — the module types a private model may not contain
  (``validate(model)`` lists them, ``fix(model)`` replaces BatchNorm by GroupNorm);
- :mod:`adaclip_torch.distributed` — data parallel with noise added exactly once;
- :mod:`adaclip_torch.grad_sample` — per-example gradient hooks;
- :mod:`adaclip_torch.averaging` — :class:`ParameterAverage`, an EMA or tail average of the
  parameters (free post-processing; ``attach(optimizer)``, ``with avg.averaged(): ...``);
- :mod:`adaclip_torch.losses` — per-example loss reductions (``per_example_lm_loss``) for
  Hugging Face models, whose own LM loss couples the examples of a batch;
- :mod:`adaclip_torch.ghost` — ghost norms for ``nn.Linear``/``nn.Embedding``
  (``per_sample_mode="auto"``, the default: no per-example gradients stored for them).
"""

from adaclip_torch.averaging import ParameterAverage
from adaclip_torch.batch_memory import BatchMemoryManager
from adaclip_torch.data import (
    CountingDataLoader,
    PoissonBatchSampler,
    PoissonUserBatchSampler,
    poisson_data_loader,
)
from adaclip_torch.noise import NoiseSource
from adaclip_torch.optimizer import (
    AdaClip,
    AutomaticClip,
    DPOptimizer,
    FlatClip,
    PerLayerClip,
    QuantileClip,
    ScaledClip,
)
from adaclip_torch.privacy import make_private, make_private_with_epsilon

__all__ = [
    "AdaClip",
    "AutomaticClip",
    "BatchMemoryManager",
    "CountingDataLoader",
    "DPOptimizer",
    "FlatClip",
    "NoiseSource",
    "ParameterAverage",
    "PerLayerClip",
    "PoissonBatchSampler",
    "PoissonUserBatchSampler",
    "QuantileClip",
    "ScaledClip",
    "make_private",
    "make_private_with_epsilon",
    "poisson_data_loader",
]
