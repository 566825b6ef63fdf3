"""Black-box canaries: training examples planted to measure what a trained model reveals.

The auditor makes ``m`` canary examples and flips an independent fair coin for each: heads,
the canary is added to the training set (*included*), tails it is left out. After training,
each canary gets a score from the model alone (black box), e.g. ``−loss``
(:func:`canary_scores_from_losses`), and the scores with the coin flips go to the ε
estimators (:func:`adaclip.audit.estimators.one_run_epsilon`). The coins must be drawn
independently of everything else (:func:`draw_inclusion`): that independence is what makes
"guessing which canaries were included" a test of the mechanism's privacy — under (ε, δ)-DP
no guess can beat ``e^ε/(1 + e^ε)`` accuracy by much, whatever the canaries are.

A canary audits well when the model *must* memorise it to fit it: a typical example is fitted
by generalisation whether or not it was seen, so its loss says little about its inclusion.
Two kinds of hard-to-generalise examples:

- :func:`mislabelled_canaries`: real inputs with a wrong label (uniform over the other
  classes). Only memorisation fits them, and the inputs are in-distribution, so the model
  cannot ignore them as it might far-away points.
- :func:`out_of_distribution_canaries`: Gaussian noise inputs with random labels, far from the
  data, where the model's output depends on little else than the canaries themselves.

The canaries that are left out must come from outside the training data too: draw mislabelled
canaries from held-out examples, never from the training set (a training example with a
changed label would be a modified member, not an independent coin).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from adaclip.options import integer_at_least

__all__ = [
    "InputCanaries",
    "draw_inclusion",
    "mislabelled_canaries",
    "out_of_distribution_canaries",
    "canary_scores_from_losses",
]

Seed = int | np.random.Generator | np.random.SeedSequence | None


def _probability(name: str, value: Any) -> float:
    try:
        p = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}") from None
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value!r}")
    return p


def _frozen(array: np.ndarray) -> np.ndarray:
    out = np.array(array, copy=True)
    out.setflags(write=False)
    return out


def draw_inclusion(num_canaries: int, *, seed: Seed, probability: float = 0.5) -> np.ndarray:
    """Independent coin flips: ``included[i] ~ Bernoulli(probability)``, a bool array.

    The one-run estimator (Steinke, Nasr & Jagielski, 2023) assumes ``probability = ½``: its
    null distribution is that of a guesser facing fair coins, which DP can bias by at most
    ``e^ε/(1 + e^ε)``. Draw the coins with a seed of their own (not one that also shapes the
    training run), and record them: they are the ground truth of the audit.
    """
    m = integer_at_least("num_canaries", num_canaries, 0)
    p = _probability("probability", probability)
    rng = np.random.default_rng(seed)
    return rng.random(m) < p


@dataclasses.dataclass(frozen=True, eq=False)
class InputCanaries:
    """A set of canary examples and their inclusion coins (arrays stored read-only).

    ``x``: ``(m, ...)`` inputs; ``y``: ``(m,)`` labels; ``included``: ``(m,)`` bool;
    ``kind``: how they were made (``"mislabelled"``, ``"out_of_distribution"``, …).
    """

    x: np.ndarray
    y: np.ndarray
    included: np.ndarray
    kind: str

    def __post_init__(self) -> None:
        x, y, included = np.asarray(self.x), np.asarray(self.y), np.asarray(self.included)
        if x.ndim < 1:
            raise ValueError(f"x must have one row per canary, got shape {x.shape}")
        m = x.shape[0]
        if y.shape != (m,):
            raise ValueError(f"y must have shape ({m},) (one label per canary), got {y.shape}")
        if included.shape != (m,) or included.dtype != np.bool_:
            raise ValueError(
                f"included must be a bool array of shape ({m},), got {included.dtype} {included.shape}"
            )
        object.__setattr__(self, "x", _frozen(x))
        object.__setattr__(self, "y", _frozen(y))
        object.__setattr__(self, "included", _frozen(included))
        object.__setattr__(self, "kind", str(self.kind))

    @property
    def num_canaries(self) -> int:
        """``m``, included or not."""
        return int(self.x.shape[0])

    @property
    def num_included(self) -> int:
        """How many canaries are in the training set."""
        return int(np.count_nonzero(self.included))

    def members(self) -> tuple[np.ndarray, np.ndarray]:
        """``(x, y)`` of the included canaries (copies, in canary order)."""
        return self.x[self.included].copy(), self.y[self.included].copy()

    def insert(
        self, x_train: Any, y_train: Any, *, seed: int | np.random.Generator | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """The training set with the included canaries appended: new arrays, inputs untouched.

        Without ``seed`` the canaries follow the training data in order (rows
        ``len(x_train):``); with a seed the rows are shuffled by one permutation, the same for
        ``x`` and ``y``. The canaries' inputs must have the training inputs' per-example shape;
        the result has NumPy's common dtype of the two.
        """
        xt, yt = np.asarray(x_train), np.asarray(y_train)
        if xt.ndim < 1 or yt.shape != (xt.shape[0],):
            raise ValueError(
                f"x_train and y_train must have one label per row, got shapes {xt.shape} and {yt.shape}"
            )
        if xt.shape[1:] != self.x.shape[1:]:
            raise ValueError(
                f"x_train rows have shape {xt.shape[1:]} but the canaries have shape {self.x.shape[1:]}"
            )
        cx, cy = self.members()
        x_out = np.concatenate([xt, cx], axis=0)
        y_out = np.concatenate([yt, cy], axis=0)
        if seed is not None:
            order = np.random.default_rng(seed).permutation(x_out.shape[0])
            x_out, y_out = x_out[order], y_out[order]
        return x_out, y_out


def _labels(name: str, y: np.ndarray, num_classes: int) -> np.ndarray:
    if not np.issubdtype(y.dtype, np.integer):
        raise ValueError(f"{name} must hold integer class labels, got dtype {y.dtype}")
    if np.any((y < 0) | (y >= num_classes)):
        raise ValueError(f"{name} must be in [0, num_classes={num_classes})")
    return y


def mislabelled_canaries(
    x: Any,
    y: Any,
    *,
    num_canaries: int,
    num_classes: int,
    seed: int | np.random.Generator,
    inclusion_probability: float = 0.5,
) -> InputCanaries:
    """``num_canaries`` examples of the pool ``(x, y)``, each with a wrong label.

    The pool should be held-out data (NOT the training set). Examples are picked uniformly
    without replacement; canary ``i`` gets the label ``(y_i + 1 + U_i) mod C`` with
    ``U_i`` uniform on ``{0, …, C−2}``, i.e. uniform over the ``C − 1`` other classes. The
    inclusion coins come from :func:`draw_inclusion` (``inclusion_probability``), after the
    picks and labels, from the same generator.
    """
    m = integer_at_least("num_canaries", num_canaries, 1)
    c = integer_at_least("num_classes", num_classes, 2)
    p = _probability("inclusion_probability", inclusion_probability)
    xp, yp = np.asarray(x), np.asarray(y)
    if xp.ndim < 1 or yp.shape != (xp.shape[0],):
        raise ValueError(f"x and y must have one label per row, got shapes {xp.shape} and {yp.shape}")
    _labels("y", yp, c)
    if m > xp.shape[0]:
        raise ValueError(f"num_canaries={m} exceeds the pool of {xp.shape[0]} examples")
    rng = np.random.default_rng(seed)
    picks = rng.choice(xp.shape[0], size=m, replace=False)
    wrong = (yp[picks] + 1 + rng.integers(0, c - 1, size=m)) % c
    included = draw_inclusion(m, seed=rng, probability=p)
    return InputCanaries(x=xp[picks], y=wrong.astype(yp.dtype), included=included, kind="mislabelled")


def out_of_distribution_canaries(
    shape: Sequence[int] | int,
    *,
    num_canaries: int,
    num_classes: int,
    seed: int | np.random.Generator,
    scale: float = 1.0,
    inclusion_probability: float = 0.5,
    dtype: Any = np.float64,
) -> InputCanaries:
    """``num_canaries`` inputs ``x_i ~ N(0, scale²·I)`` of per-example ``shape``, labels uniform
    on ``{0, …, num_classes − 1}``, and inclusion coins from :func:`draw_inclusion` (drawn
    after the inputs and labels, from the same generator).

    Choose ``scale`` from the data: inputs on the data's scale (e.g. 1 for standardised
    features) but in random directions are far from every real example in high dimension.
    """
    m = integer_at_least("num_canaries", num_canaries, 1)
    c = integer_at_least("num_classes", num_classes, 2)
    p = _probability("inclusion_probability", inclusion_probability)
    dims = (shape,) if isinstance(shape, int | np.integer) else tuple(shape)
    if any(isinstance(d, bool) or not isinstance(d, int | np.integer) or d < 1 for d in dims):
        raise ValueError(f"shape must be positive integers, got {shape!r}")
    s = float(scale)
    if not (np.isfinite(s) and s > 0):
        raise ValueError(f"scale must be finite and > 0, got {scale!r}")
    rng = np.random.default_rng(seed)
    x = (s * rng.standard_normal((m, *(int(d) for d in dims)))).astype(dtype)
    labels = rng.integers(0, c, size=m)
    included = draw_inclusion(m, seed=rng, probability=p)
    return InputCanaries(x=x, y=labels, included=included, kind="out_of_distribution")


def canary_scores_from_losses(losses: Any) -> np.ndarray:
    """Scores for the ε estimators from the trained model's loss on each canary: ``−loss``.

    A model fits what it trained on, so an included canary tends to have a lower loss; the
    sign flip follows the convention "higher score = more likely included". NaN stays NaN
    (the estimators count it as above every threshold); ``+inf`` loss gives ``−inf``.
    """
    arr = np.asarray(losses, dtype=np.float64)
    if arr.ndim != 1:
        raise ValueError(f"losses must be a 1-D array (one loss per canary), got shape {arr.shape}")
    return -arr
