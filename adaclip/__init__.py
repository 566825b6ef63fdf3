"""adaclip: differentially private training with coordinate-wise adaptive clipping (AdaCliP).

The core is framework-agnostic (NumPy, PyTorch and JAX arrays through the array API):

- :mod:`adaclip.reference` — the NumPy reference that decides correctness;
- :mod:`adaclip.strategies` — the affine clipping family and the one private step;
- :mod:`adaclip.adaptive` — the parts of the adaptive options (centre, statistics, scale, quantile rule);
- :mod:`adaclip.diagnostics` — is the scale adapting? per-tensor read-outs from the state;
- :mod:`adaclip.transform` — the array-API primitives of that step;
- :mod:`adaclip.schedules` — noise decay and (C, σ) retuning;
- :mod:`adaclip.accounting` — the privacy accountant (on ``dp-accounting``);
- :mod:`adaclip.ledger` — the crash-safe privacy ledger the accountant can write ahead to;
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
from adaclip.ledger import PrivacyLedger
from adaclip.strategies import (
    AdaptiveClipping,
    AutomaticClipping,
    ClipState,
    FlatClipping,
    PerLayerClipping,
    QuantileClipping,
    QuantileRule,
    ScaledClipping,
    clip_and_sum,
    private_step,
    release,
)

__version__ = "0.1.0"

__all__ = [
    "AdaClipError",
    "AdaptiveClipping",
    "AutomaticClipping",
    "BudgetExceededError",
    "ClipState",
    "FlatClipping",
    "InvalidGradientError",
    "InvalidHyperparameterError",
    "NoiseDominatedWarning",
    "PerLayerClipping",
    "PrivacyLedger",
    "QuantileClipping",
    "QuantileRule",
    "ScaledClipping",
    "__version__",
    "clip_and_sum",
    "private_step",
    "release",
]
