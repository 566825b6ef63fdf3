"""The methods and optimizer grids of the utility benchmark's first round (:mod:`run`).

The names a round-one result JSON is keyed by (``"<method>@<ε>"``), the inner optimizers and
the constants every twin of flat clipping is built with (:func:`utility_train.twin_strategy`).
They live apart from :mod:`utility_train` (which trains, with PyTorch or JAX) so that the report
(:mod:`report`) can read result files without importing a framework.
"""

from __future__ import annotations

MOMENTUM = 0.9
OPTIMIZERS = {"sgd": "SGD(momentum=0.9)", "adam": "Adam(betas=(0.9, 0.999), eps=1e-8)"}
ADAM_LRS = [1e-3, 3e-3, 1e-2]  # Adam's own learning-rate grid (every task): its step is ~lr per coordinate
ADAM_QUICK_LR = 3e-3

# Twins of flat clipping at (lr, C): each starts clipping like flat clipping with C.
TWIN_METHODS = (
    "ada-patent", "ada-unbiased", "ada-tensor", "ada-factored", "ada-delayed", "ada-public", "stp",
    "centre-debiased", "centre-kalman", "centre-quantile", "quantile", "automatic",
)  # fmt: skip
AUX_METHODS = ("centre-quantile", "quantile")  # release a clip count with the gradient
TWIN_BETA_STD = 0.999  # β2 per step of every twin's statistics (the c0grid runs' value)
DELAY = 10  # update_every of ada-delayed (its β2 is TWIN_BETA_STD**DELAY: the same horizon in steps)
SEPARATED_STD = {"std_min": 1e-8, "std_max": 1e2}  # separated scale: s only shapes b; a wide range
TWIN_S0 = ("fixed", "clip")  # where the separated statistics (and stp's) start: see twin_strategy

PRIVATE_METHODS = ("flat", "per_layer", "scaled", "adaclip") + TWIN_METHODS
METHODS = ("nonprivate",) + PRIVATE_METHODS
