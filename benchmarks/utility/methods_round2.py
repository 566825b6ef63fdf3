"""The methods of the utility benchmark's round two (:mod:`round2`) and their grids.

What a round-two result JSON names: the baselines a practitioner already has, the adaptive
methods, the patent's AdaCliP at its own defaults (tuning-free only), each method's strategy at
an (initial) clip norm (:func:`strategy_for`), and the lr × C grid of each task and inner
optimizer (:func:`grid`). Kept apart from the training harness (:mod:`round2`, PyTorch and JAX)
so that the report (:mod:`report_round2`) imports no framework; :mod:`round2` re-exports them.
"""

from __future__ import annotations

import math
from typing import Any

CLIPS = (0.1, 1.0)
DEFAULT_CLIP = 1.0
BETA_STD = 0.999  # per step, every adaptive method's variance average
BASELINES = ("flat", "per_layer", "quantile")  # what a practitioner already has
ADAPTIVE = ("automatic", "ada-patent", "ada-centred", "ada-tensor")
METHODS = BASELINES + ADAPTIVE
PATENT_DEFAULTS = "ada-patent-defaults"  # tuning-free only: AdaptiveClipping() as the patent sets it

# The two learning rates of every task, per inner optimizer.
SGD_LRS = {
    "digits-mlp": (0.1, 0.5), "raw-digits-mlp": (0.1, 0.5), "mnist1d-mlp": (0.05, 0.2),
    "mnist1d-finetune": (0.02, 0.1), "mnist1d-finetune-head": (0.02, 0.1), "mnist1d-long": (0.05, 0.2),
    "transformer-lm": (0.5, 2.0), "transformer-users": (0.5, 2.0), "lstm-users-many": (0.5, 2.0),
}  # fmt: skip
ADAM_LRS = (1e-3, 1e-2)


def strategy_for(method: str, clip: float, num_params: int) -> Any:
    """The strategy of ``method`` at (initial) clip norm ``clip``; every one starts clipping
    to flat clipping's ball of radius ``clip`` (the patent's defaults excepted).

    - ``flat``, ``per_layer`` (``C_k = C/√K``), ``quantile`` (Andrew et al.: ``C_0 = C``,
      γ = 0.5, η = 0.2, σ_b = B̄/20), ``automatic`` (Bu et al., ``w = C·g/(‖g‖ + 0.01)``);
    - ``ada-patent``: the patent's AdaCliP started at ``C`` (``from_initial_clip``, s may move
      30× either way), β2 = 0.999;
    - ``ada-centred``: flat clipping around the patent's centre ``a = EMA_0.99(g̃)``: a flat
      shape (frozen uniform statistics) at level ``C``, only the centre adapts;
    - ``ada-tensor``: centre as ``ada-centred`` plus a per-tensor shape learned from the
      releases (unbiased noise correction, β2 = 0.999, s from ``C/√d`` within 30× either way),
      level fixed at ``C``;
    - ``ada-patent-defaults``: ``AdaptiveClipping()`` (``std_min = 1e-5``, ``std_max = 1``,
      β2 = 0.9), ``clip`` ignored.
    """
    from adaclip.strategies import (
        AdaptiveClipping,
        AutomaticClipping,
        FlatClipping,
        PerLayerClipping,
        QuantileClipping,
        QuantileRule,
    )

    c = float(clip)
    s0 = c / math.sqrt(num_params)
    separated = {"scale": "separated", "max_grad_norm": c, "std_min": s0 / 30.0, "std_max": s0 * 30.0}
    if method == "flat":
        return FlatClipping(c)
    if method == "per_layer":
        return PerLayerClipping(max_grad_norm=c)
    if method == "quantile":
        return QuantileClipping(c, QuantileRule())
    if method == "automatic":
        return AutomaticClipping(max_grad_norm=c)
    if method == "ada-patent":
        return AdaptiveClipping.from_initial_clip(c, num_params, beta_std=BETA_STD)
    if method == "ada-centred":
        return AdaptiveClipping(**separated, freeze_statistics=True)
    if method == "ada-tensor":
        return AdaptiveClipping(**separated, beta_std=BETA_STD, pooling="tensor", correction="unbiased")
    if method == PATENT_DEFAULTS:
        return AdaptiveClipping()
    raise ValueError(f"unknown method {method!r}")


def grid(task: str, optimizer: str) -> list[dict[str, float]]:
    lrs = SGD_LRS[task] if optimizer == "sgd" else ADAM_LRS
    return [{"lr": lr, "max_grad_norm": c} for lr in lrs for c in CLIPS]
