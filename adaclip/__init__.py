"""adaclip: differentially private training with coordinate-wise adaptive clipping (AdaCliP).

The core is framework-agnostic (NumPy, PyTorch and JAX arrays through the array API):

- :mod:`adaclip.reference` — the NumPy reference that decides correctness;
- :mod:`adaclip.strategies` — the affine clipping family and the one private step;
- :mod:`adaclip.transform` — the array-API primitives of that step;
- :mod:`adaclip.schedules` — noise decay and (C, σ) retuning;
- :mod:`adaclip.accounting` — the privacy accountant (on ``dp-accounting``);
- :mod:`adaclip.layer_scales` — eDP-SGD layer scales from public data or a private release;
- :mod:`adaclip.estimators` — fixed- and clipped-denominator estimators for weighted averages.
"""

from adaclip.errors import (
    AdaClipError,
    BudgetExceededError,
    InvalidGradientError,
    InvalidHyperparameterError,
    NoiseDominatedWarning,
)
from adaclip.strategies import (
    AdaptiveClipping,
    ClipState,
    FlatClipping,
    PerLayerClipping,
    ScaledClipping,
    clip_and_sum,
    private_step,
    release,
)

__version__ = "0.1.0"

__all__ = [
    "AdaClipError",
    "AdaptiveClipping",
    "BudgetExceededError",
    "ClipState",
    "FlatClipping",
    "InvalidGradientError",
    "InvalidHyperparameterError",
    "NoiseDominatedWarning",
    "PerLayerClipping",
    "ScaledClipping",
    "__version__",
    "clip_and_sum",
    "private_step",
    "release",
]
