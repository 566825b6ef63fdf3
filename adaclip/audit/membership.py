"""Membership inference: how well an attacker tells a model's training examples from others.

An attack gives every candidate example a *score*; a higher score means "more likely a member
of the training set". The candidates are ``n₁`` members (scores ``X_i``) and ``n₀``
non-members (scores ``Y_j``). Every threshold ``t`` gives the test "member iff score ≥ t",
with true-positive rate ``TPR(t) = #{X_i ≥ t}/n₁`` and false-positive rate
``FPR(t) = #{Y_j ≥ t}/n₀``; the ROC curve is the set of these points.

**Summaries.**

- ``AUC = (1/(n₁n₀)) Σ_i Σ_j ψ(X_i, Y_j)``, ``ψ(x, y) = 1[x > y] + ½·1[x = y]``: the
  Mann–Whitney statistic ``U/(n₁n₀)``, the probability that a random member outscores a
  random non-member (ties count ½). It equals the area under the ROC curve drawn with straight
  segments between the thresholds (a tie randomised between its two sides).
- ``TPR at FPR f``: the largest TPR of any test, randomised tests included, whose FPR is
  at most ``f``. Mixing two threshold tests traces the segment between their ROC points, so
  by Neyman–Pearson this is the upper concave hull of the empirical ROC points evaluated at
  ``f``. For a DP-trained model it is the telling number: ``(ε, δ)``-DP forces
  ``TPR ≤ e^ε·FPR + δ`` for every test, and the AUC averages over FPRs no attacker cares
  about (Carlini et al., *Membership inference attacks from first principles*, 2022).
- A confidence interval for the AUC from DeLong's variance (DeLong, DeLong & Clarke-Pearson,
  1988; see :func:`auc_interval`).

These are *empirical* quantities on the given sample, not privacy guarantees: an AUC of 0.5
shows that this attack fails, not that every attack does. For a certified lower bound on ε
use the estimators in :mod:`adaclip.audit.estimators` on canary scores.

**Attacks.**

- :func:`loss_threshold_attack` (Yeom et al., *Privacy risk in machine learning: analyzing the
  connection to overfitting*, 2018): the score is minus the example's loss; a model fits its
  training examples better than fresh ones.
- :func:`shadow_model_attack` (Shokri et al., *Membership inference attacks against machine
  learning models*, 2017): the attacker trains *shadow* models like the target on data of
  its own, whose membership it knows, and learns to tell members from non-members from the
  shadows' outputs; the learnt rule is then applied to the target's outputs. Features: the
  output probability vector sorted in decreasing order (top ``k``), optionally with the loss.

Non-finite scores: NaN counts as +inf (above every threshold: a NaN output is taken as a
perfect tell), −inf is below every finite threshold.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from statistics import NormalDist
from typing import Any

import numpy as np

__all__ = [
    "FEATURES",
    "roc_curve",
    "auc",
    "auc_interval",
    "tpr_at_fpr",
    "MembershipResult",
    "evaluate_attack",
    "loss_threshold_attack",
    "LogisticModel",
    "fit_logistic",
    "attack_features",
    "ShadowAttack",
    "fit_shadow_attack",
    "shadow_model_attack",
]

#: Feature sets of the shadow-model attack (see :func:`attack_features`).
FEATURES = ("sorted", "sorted_loss")

DEFAULT_FPRS = (0.001, 0.01, 0.1)

#: Smallest probability used in a log (a zero probability gives a large, finite loss).
_TINY = 1e-30


# --------------------------------------------------------------------------- validation


def _vector(name: str, values: Any) -> np.ndarray:
    """A non-empty 1-D float64 copy of ``values``."""
    arr = np.array(values, dtype=np.float64)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a 1-D array, got shape {arr.shape}")
    if arr.size == 0:
        raise ValueError(f"{name} must not be empty")
    return arr


def _scores(name: str, values: Any) -> np.ndarray:
    """A non-empty 1-D float64 copy of ``values`` with NaN replaced by +inf."""
    arr = _vector(name, values)
    arr[np.isnan(arr)] = np.inf
    return arr


def _confidence(confidence: Any) -> float:
    c = float(confidence)
    if not 0.0 < c < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")
    return c


def _fprs(fprs: Any) -> tuple[float, ...]:
    values = tuple(float(f) for f in np.atleast_1d(np.asarray(fprs, dtype=np.float64)))
    if not values:
        raise ValueError("fprs must not be empty")
    for f in values:
        if not 0.0 <= f <= 1.0:
            raise ValueError(f"fprs must all be in [0, 1], got {f!r}")
    return values


# --------------------------------------------------------------------------- ROC and AUC


def roc_curve(member_scores: Any, nonmember_scores: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The empirical ROC curve of the test "member iff score ≥ t".

    Returns ``(fpr, tpr, thresholds)``, three arrays of the same length, FPR and TPR
    non-decreasing. Point ``j ≥ 1`` is the test with threshold ``thresholds[j]``, the
    distinct scores in decreasing order; point 0 is ``(0, 0)``, the test that never says
    "member", with ``thresholds[0] = +inf`` (read as "above every score"; an infinite score,
    or a NaN, which counts as +inf, then also gives a threshold +inf at point 1). The last
    point is ``(1, 1)``.

    Tied scores give one point, not a staircase: joining consecutive points with straight
    segments is exactly what randomising at the tie achieves, and the area under that
    polyline is :func:`auc`.
    """
    s1 = _scores("member_scores", member_scores)
    s0 = _scores("nonmember_scores", nonmember_scores)
    thresholds = np.unique(np.concatenate([s1, s0]))[::-1]
    tp = s1.size - np.searchsorted(np.sort(s1), thresholds, side="left")
    fp = s0.size - np.searchsorted(np.sort(s0), thresholds, side="left")
    fpr = np.concatenate([[0.0], fp / s0.size])
    tpr = np.concatenate([[0.0], tp / s1.size])
    return fpr, tpr, np.concatenate([[np.inf], thresholds])


def _placements(s1: np.ndarray, s0: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """DeLong's structural components: ``V₁₀(X_i) = (1/n₀) Σ_j ψ(X_i, Y_j)`` per member and
    ``V₀₁(Y_j) = (1/n₁) Σ_i ψ(X_i, Y_j)`` per non-member (``O((n₁ + n₀) log n)`` by sorting)."""
    s0_sorted = np.sort(s0)
    below = np.searchsorted(s0_sorted, s1, side="left")
    tied = np.searchsorted(s0_sorted, s1, side="right") - below
    v10 = (below + 0.5 * tied) / s0.size
    s1_sorted = np.sort(s1)
    at_most = np.searchsorted(s1_sorted, s0, side="right")
    tied = at_most - np.searchsorted(s1_sorted, s0, side="left")
    v01 = (s1.size - at_most + 0.5 * tied) / s1.size
    return v10, v01


def auc(member_scores: Any, nonmember_scores: Any) -> float:
    """Area under the ROC curve: ``U/(n₁n₀) = (1/(n₁n₀)) Σ_i Σ_j ψ(X_i, Y_j)`` with
    ``ψ(x, y) = 1[x > y] + ½·1[x = y]`` (the Mann–Whitney statistic; ties count ½).

    0.5 is chance, 1 a perfect attack, below 0.5 an attack whose score points the wrong way.
    """
    s1 = _scores("member_scores", member_scores)
    s0 = _scores("nonmember_scores", nonmember_scores)
    v10, _ = _placements(s1, s0)
    return float(np.mean(v10))


def auc_interval(
    member_scores: Any, nonmember_scores: Any, *, confidence: float = 0.95
) -> tuple[float, float]:
    """Two-sided confidence interval for the AUC, with DeLong's variance, clipped to [0, 1].

    The AUC is a two-sample U-statistic, ``Â = mean_i V₁₀(X_i) = mean_j V₀₁(Y_j)`` with the
    placements ``V₁₀(X_i) = (1/n₀) Σ_j ψ(X_i, Y_j)`` and ``V₀₁(Y_j) = (1/n₁) Σ_i ψ(X_i, Y_j)``.
    Its variance is estimated without any model of the scores by
    ``Var(Â) ≈ S₁₀/n₁ + S₀₁/n₀``, ``S₁₀`` and ``S₀₁`` the sample variances of the
    placements (DeLong et al., 1988; Hanley & McNeil's formula instead assumes exponential
    score distributions), and the interval is ``Â ± z·√Var`` with ``z = Φ⁻¹(1 − (1−c)/2)``
    (asymptotic normality of U-statistics).

    Limits: the interval is asymptotic and somewhat narrow for small samples; when the two
    samples are perfectly separated the placements are constant, the variance estimate is 0
    and the interval collapses to the point. With a single member or non-member the variance
    cannot be estimated and the interval is ``(0, 1)``.
    """
    c = _confidence(confidence)
    s1 = _scores("member_scores", member_scores)
    s0 = _scores("nonmember_scores", nonmember_scores)
    v10, v01 = _placements(s1, s0)
    a = float(np.mean(v10))
    if s1.size < 2 or s0.size < 2:
        return 0.0, 1.0
    var = float(np.var(v10, ddof=1)) / s1.size + float(np.var(v01, ddof=1)) / s0.size
    half = NormalDist().inv_cdf(1.0 - (1.0 - c) / 2.0) * math.sqrt(max(var, 0.0))
    return max(0.0, a - half), min(1.0, a + half)


def _upper_hull(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The upper concave hull of points with non-decreasing ``x`` (the highest ``y`` kept at
    each ``x``), as vertices with strictly increasing ``x``."""
    xs, first = np.unique(x, return_index=True)
    ys = np.maximum.reduceat(y, first)
    hx: list[float] = []
    hy: list[float] = []
    for px, py in zip(xs.tolist(), ys.tolist()):
        # Drop the last vertex while it lies on or below the chord from its predecessor to p.
        while len(hx) >= 2 and (hx[-1] - hx[-2]) * (py - hy[-2]) - (hy[-1] - hy[-2]) * (px - hx[-2]) >= 0:
            hx.pop()
            hy.pop()
        hx.append(px)
        hy.append(py)
    return np.asarray(hx), np.asarray(hy)


def tpr_at_fpr(member_scores: Any, nonmember_scores: Any, fpr: Any) -> float | np.ndarray:
    """The largest TPR of any (possibly randomised) threshold test with FPR ≤ ``fpr``.

    Mixing the tests of two ROC points with weights ``(1−λ, λ)`` gives the point on the
    segment between them, so the attainable (FPR, TPR) pairs are the convex hull of the ROC
    points, and the best TPR at FPR at most ``f`` is the upper concave hull evaluated at ``f``
    (linear interpolation between hull vertices; it is non-decreasing in ``f``). At ``f = 0``
    it is the TPR of the strictest threshold that no non-member reaches.

    This is the plug-in value on the sample, not a confidence bound: below ``FPR = 1/n₀`` it
    rests on the single highest-scoring non-member, so report low-FPR values only with
    enough non-members (``n₀ ≫ 1/f``).

    ``fpr``: a number or an array of numbers in ``[0, 1]``; the result has the same shape (a
    float for a scalar).
    """
    f = np.asarray(fpr, dtype=np.float64)
    if np.any(~((f >= 0.0) & (f <= 1.0))):
        raise ValueError(f"fpr must be in [0, 1], got {fpr!r}")
    fpr_points, tpr_points, _ = roc_curve(member_scores, nonmember_scores)
    hx, hy = _upper_hull(fpr_points, tpr_points)
    out = np.interp(f, hx, hy)
    return float(out) if out.ndim == 0 else out


# --------------------------------------------------------------------------- results


@dataclasses.dataclass(frozen=True)
class MembershipResult:
    """What a membership-inference attack achieved on a sample of members and non-members."""

    attack: str  #: the attack's name
    auc: float  #: area under the ROC curve (:func:`auc`)
    auc_interval: tuple[float, float]  #: DeLong confidence interval (:func:`auc_interval`)
    tpr_at_fpr: dict[float, float]  #: FPR → best TPR at that FPR (:func:`tpr_at_fpr`)
    num_members: int
    num_nonmembers: int
    confidence: float = 0.95  #: level of ``auc_interval``

    def __str__(self) -> str:
        lo, hi = self.auc_interval
        rates = ", ".join(f"TPR {t:.1%} @ FPR {f:.1%}" for f, t in self.tpr_at_fpr.items())
        return (
            f"{self.attack}: AUC {self.auc:.3f} [{lo:.3f}, {hi:.3f}] ({self.confidence:.0%}); {rates} "
            f"({self.num_members} members, {self.num_nonmembers} non-members)"
        )


def evaluate_attack(
    member_scores: Any,
    nonmember_scores: Any,
    *,
    attack: str = "scores",
    fprs: Sequence[float] = DEFAULT_FPRS,
    confidence: float = 0.95,
) -> MembershipResult:
    """Summarise any attack's scores (higher = member) as a :class:`MembershipResult`."""
    c = _confidence(confidence)
    targets = _fprs(fprs)
    s1 = _scores("member_scores", member_scores)
    s0 = _scores("nonmember_scores", nonmember_scores)
    tprs = np.atleast_1d(tpr_at_fpr(s1, s0, np.asarray(targets)))
    return MembershipResult(
        attack=str(attack),
        auc=auc(s1, s0),
        auc_interval=auc_interval(s1, s0, confidence=c),
        tpr_at_fpr={f: float(t) for f, t in zip(targets, tprs)},
        num_members=int(s1.size),
        num_nonmembers=int(s0.size),
        confidence=c,
    )


def loss_threshold_attack(
    member_losses: Any,
    nonmember_losses: Any,
    *,
    fprs: Sequence[float] = DEFAULT_FPRS,
    confidence: float = 0.95,
) -> MembershipResult:
    """The loss-threshold attack of Yeom et al. (2018): "member iff loss ≤ τ".

    The score is ``−loss``, so the threshold tests of the ROC are exactly the tests
    ``loss ≤ τ`` for every ``τ``. A model that generalises perfectly gives members and
    non-members the same loss distribution (AUC 0.5); the gap the attack exploits is the
    generalisation gap, which DP training bounds. A NaN loss counts as a perfect tell of
    membership (score +inf), an infinite loss as a certain non-member.
    """
    l1 = _vector("member_losses", member_losses)
    l0 = _vector("nonmember_losses", nonmember_losses)
    s1 = np.where(np.isnan(l1), np.inf, -l1)
    s0 = np.where(np.isnan(l0), np.inf, -l0)
    return evaluate_attack(s1, s0, attack="loss-threshold", fprs=fprs, confidence=confidence)


# --------------------------------------------------------------------------- logistic regression


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * z))


@dataclasses.dataclass(frozen=True, eq=False)
class LogisticModel:
    """A fitted L2-penalised logistic regression on standardised features.

    ``P[member | x] = σ(b + Σ_d w_d (x_d − m_d)/s_d)``, ``m`` and ``s`` the training features'
    means and standard deviations (``s = 1`` for a constant feature).
    """

    mean: np.ndarray  #: feature means ``m``
    scale: np.ndarray  #: feature standard deviations ``s``
    coef: np.ndarray  #: ``w``, on the standardised features
    intercept: float  #: ``b``
    l2: float  #: the penalty it was fitted with
    iterations: int  #: Newton steps taken

    def decision_function(self, features: Any) -> np.ndarray:
        """The log-odds ``b + wᵀ(x − m)/s`` per row: the attack score (higher = member)."""
        x = np.asarray(features, dtype=np.float64)
        if x.ndim != 2 or x.shape[1] != self.coef.size:
            raise ValueError(f"features must have shape (n, {self.coef.size}), got {x.shape}")
        return ((x - self.mean) / self.scale) @ self.coef + self.intercept

    def predict_proba(self, features: Any) -> np.ndarray:
        """``P[member | x]`` per row."""
        return _sigmoid(self.decision_function(features))


def fit_logistic(
    features: Any, labels: Any, *, l2: float = 1e-3, max_iter: int = 100, tol: float = 1e-10
) -> LogisticModel:
    """L2-penalised logistic regression by Newton's method (IRLS) with a backtracking line search.

    With ``z_i = b + wᵀx̃_i`` on the standardised features ``x̃`` it minimises the convex

        J(w, b) = (1/n) Σ_i [log(1 + e^{z_i}) − y_i z_i] + (λ/2)‖w‖²      (λ = ``l2``),

    gradient ``(1/n) X̃ᵀ(p − y) + λ(w, 0)`` and Hessian ``(1/n) X̃ᵀ diag(p(1−p)) X̃ + λ·diag(1…1, 0)``
    (``X̃`` with a column of ones, the intercept unpenalised, ``p = σ(z)``). ``λ > 0`` makes ``J``
    strictly convex in ``w``, so the minimum exists and is unique even when the classes are
    separable. (The same minimiser as scikit-learn's ``LogisticRegression(C=1/(nλ))`` on the
    standardised features.)

    ``labels``: 0/1 (or bool), both classes present. Stops when ``max |∇J| ≤ tol`` or after
    ``max_iter`` Newton steps.
    """
    x = np.asarray(features, dtype=np.float64)
    y = np.asarray(labels)
    if x.ndim != 2 or x.shape[0] == 0:
        raise ValueError(f"features must be a non-empty 2-D array (n, d), got shape {x.shape}")
    if y.shape != (x.shape[0],):
        raise ValueError(f"labels must have shape ({x.shape[0]},), got {y.shape}")
    if not np.all((y == 0) | (y == 1)):
        raise ValueError("labels must be 0/1 (or bool)")
    y = y.astype(np.float64)
    if y.min() == y.max():
        raise ValueError("labels must contain both classes")
    if not np.all(np.isfinite(x)):
        raise ValueError("features must be finite")
    lam = float(l2)
    if not (math.isfinite(lam) and lam > 0):
        raise ValueError(f"l2 must be finite and > 0, got {l2!r}")
    if int(max_iter) < 1:
        raise ValueError(f"max_iter must be >= 1, got {max_iter!r}")

    n, d = x.shape
    mean = x.mean(axis=0)
    scale = x.std(axis=0)
    scale = np.where(scale > 0, scale, 1.0)
    design = np.hstack([(x - mean) / scale, np.ones((n, 1))])
    penalty = np.full(d + 1, lam)
    penalty[-1] = 0.0

    def objective(theta: np.ndarray) -> float:
        z = design @ theta
        return float(np.mean(np.logaddexp(0.0, z) - y * z) + 0.5 * np.sum(penalty * theta * theta))

    theta = np.zeros(d + 1)
    value = objective(theta)
    iterations = 0
    for _ in range(int(max_iter)):
        p = _sigmoid(design @ theta)
        grad = design.T @ (p - y) / n + penalty * theta
        if np.max(np.abs(grad)) <= tol:
            break
        hess = (design * (p * (1.0 - p))[:, None]).T @ design / n + np.diag(penalty)
        hess[-1, -1] += 1e-12  # the intercept's curvature vanishes only on saturated fits
        step = np.linalg.solve(hess, grad)
        t = 1.0
        while True:  # Armijo backtracking: Newton's full step can overshoot far from the optimum
            candidate = theta - t * step
            new_value = objective(candidate)
            if new_value <= value - 1e-4 * t * float(grad @ step) or t < 1e-10:
                break
            t *= 0.5
        theta, value = candidate, new_value
        iterations += 1
    return LogisticModel(
        mean=mean,
        scale=scale,
        coef=theta[:-1].copy(),
        intercept=float(theta[-1]),
        l2=lam,
        iterations=iterations,
    )


# --------------------------------------------------------------------------- shadow models


def _probabilities(name: str, outputs: Any, num_classes: int | None = None) -> np.ndarray:
    p = np.asarray(outputs, dtype=np.float64)
    if p.ndim != 2 or p.shape[0] == 0 or p.shape[1] < 2:
        raise ValueError(
            f"{name} must be a non-empty (n, classes) array with >= 2 classes, got shape {p.shape}"
        )
    if num_classes is not None and p.shape[1] != num_classes:
        raise ValueError(f"{name} must have {num_classes} classes (columns), got {p.shape[1]}")
    if not np.all(np.isfinite(p)) or np.any(p < 0) or np.any(p > 1 + 1e-6):
        raise ValueError(f"{name} must hold probabilities in [0, 1]")
    return p


def attack_features(
    outputs: Any, labels: Any = None, *, features: str = "sorted", top_k: int = 10
) -> np.ndarray:
    """The attack model's input per example, from a model's output probabilities.

    - ``"sorted"``: the ``k = min(top_k, classes)`` largest probabilities in decreasing order.
      Sorting makes the features label-free and class-agnostic: what betrays a member is how
      confident the model is, not in which class.
    - ``"sorted_loss"``: the same plus the cross-entropy loss ``−log p_y`` of the true label
      ``y`` (``labels`` required), which also sees confident *wrong* answers.

    ``outputs``: ``(n, classes)`` probabilities; ``labels``: ``(n,)`` integer classes.
    """
    if features not in FEATURES:
        raise ValueError(f"features must be one of {FEATURES}, got {features!r}")
    if int(top_k) < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k!r}")
    p = _probabilities("outputs", outputs)
    k = min(int(top_k), p.shape[1])
    top = -np.sort(-p, axis=1)[:, :k]
    if features == "sorted":
        return top
    if labels is None:
        raise ValueError('features="sorted_loss" needs the labels of the examples')
    y = np.asarray(labels)
    if y.shape != (p.shape[0],):
        raise ValueError(f"labels must have shape ({p.shape[0]},), got {y.shape}")
    if not np.issubdtype(y.dtype, np.integer) or np.any((y < 0) | (y >= p.shape[1])):
        raise ValueError(f"labels must be integers in [0, {p.shape[1]})")
    loss = -np.log(np.maximum(p[np.arange(p.shape[0]), y], _TINY))
    return np.hstack([top, loss[:, None]])


@dataclasses.dataclass(frozen=True, eq=False)
class ShadowAttack:
    """A shadow-model attack, fitted: :meth:`scores` maps a target model's outputs to scores."""

    classifier: LogisticModel  #: the attack model (member = 1)
    features: str  #: the feature set (:data:`FEATURES`)
    top_k: int
    num_classes: int
    num_shadows: int
    shadow_auc: float  #: the attack model's AUC on the shadow data it was fitted on (optimistic)

    def scores(self, outputs: Any, labels: Any = None) -> np.ndarray:
        """Attack scores (the attack model's log-odds of "member"; higher = member)."""
        p = _probabilities("outputs", outputs, self.num_classes)
        return self.classifier.decision_function(
            attack_features(p, labels, features=self.features, top_k=self.top_k)
        )


def fit_shadow_attack(
    *,
    train_shadow: Callable[[np.ndarray, np.ndarray, int], Callable[[np.ndarray], Any]],
    shadow_data: tuple[Any, Any],
    num_shadows: int = 4,
    seed: int = 0,
    features: str = "sorted",
    top_k: int = 10,
    l2: float = 1e-3,
) -> ShadowAttack:
    """Train shadow models and the attack model on their outputs (Shokri et al., 2017).

    ``shadow_data = (x, y)``: examples drawn from the target's data distribution but not in
    its training set. They are shuffled (with ``seed``) and cut into ``2·num_shadows`` equal,
    disjoint parts; shadow ``i`` is ``train_shadow(x_in, y_in, seed_i)`` on part ``2i`` (its
    members), and its outputs on parts ``2i`` and ``2i+1`` (its non-members) become attack
    training rows labelled 1 and 0. The attack model is :func:`fit_logistic` on
    :func:`attack_features`. For the shadows to behave like the target, give each the target's
    training-set size: ``len(x) ≈ 2·num_shadows·n_target``, and train them the same way.

    ``train_shadow(x, y, seed) -> predict_proba`` trains one model (any framework);
    ``predict_proba(x)`` returns ``(n, classes)`` probabilities.
    """
    if not callable(train_shadow):
        raise ValueError(f"train_shadow must be callable, got {train_shadow!r}")
    shadows = int(num_shadows)
    if shadows < 1 or shadows != num_shadows:
        raise ValueError(f"num_shadows must be a positive integer, got {num_shadows!r}")
    if features not in FEATURES:
        raise ValueError(f"features must be one of {FEATURES}, got {features!r}")
    try:
        x, y = shadow_data
    except (TypeError, ValueError):
        raise ValueError("shadow_data must be a pair (x, y)") from None
    x = np.asarray(x)
    y = np.asarray(y)
    if x.ndim < 1 or y.shape != (x.shape[0],):
        raise ValueError(f"shadow_data: x must have one row per label, got shapes {x.shape} and {y.shape}")
    part = x.shape[0] // (2 * shadows)
    if part < 2:
        raise ValueError(
            f"shadow_data has {x.shape[0]} examples: too few for {shadows} shadows (need >= 2 per in/out part)"
        )
    rng = np.random.default_rng(seed)
    order = rng.permutation(x.shape[0])
    shadow_seeds = rng.integers(0, 2**31 - 1, size=shadows)
    rows, member = [], []
    num_classes: int | None = None
    for i in range(shadows):
        idx_in = order[2 * i * part : (2 * i + 1) * part]
        idx_out = order[(2 * i + 1) * part : (2 * i + 2) * part]
        predict = train_shadow(x[idx_in], y[idx_in], int(shadow_seeds[i]))
        for idx, is_member in ((idx_in, 1.0), (idx_out, 0.0)):
            p = _probabilities(f"shadow {i}'s predict_proba output", predict(x[idx]), num_classes)
            if p.shape[0] != idx.size:
                raise ValueError(
                    f"shadow {i}'s predict_proba returned {p.shape[0]} rows for {idx.size} inputs"
                )
            num_classes = p.shape[1]
            rows.append(attack_features(p, y[idx], features=features, top_k=top_k))
            member.append(np.full(idx.size, is_member))
    feats = np.vstack(rows)
    labels = np.concatenate(member)
    classifier = fit_logistic(feats, labels, l2=l2)
    logits = classifier.decision_function(feats)
    assert num_classes is not None
    return ShadowAttack(
        classifier=classifier,
        features=features,
        top_k=int(top_k),
        num_classes=num_classes,
        num_shadows=shadows,
        shadow_auc=auc(logits[labels == 1], logits[labels == 0]),
    )


def shadow_model_attack(
    *,
    train_shadow: Callable[[np.ndarray, np.ndarray, int], Callable[[np.ndarray], Any]],
    shadow_data: tuple[Any, Any],
    target_outputs_members: Any,
    target_outputs_nonmembers: Any,
    target_labels_members: Any = None,
    target_labels_nonmembers: Any = None,
    num_shadows: int = 4,
    seed: int = 0,
    fprs: Sequence[float] = DEFAULT_FPRS,
    confidence: float = 0.95,
    features: str = "sorted",
    top_k: int = 10,
    l2: float = 1e-3,
) -> MembershipResult:
    """The shadow-model attack of Shokri et al. (2017) against a target model.

    Fits the attack on shadow models (:func:`fit_shadow_attack`) and scores the target's
    output probabilities on its members (``target_outputs_members``, ``(n₁, classes)``) and
    on non-members (``target_outputs_nonmembers``, ``(n₀, classes)``, e.g. its test set).
    The labels are needed only for ``features="sorted_loss"``.

    The attacker here knows the target's training recipe and has data from its distribution:
    a strong, black-box threat model. The result is only as good as the shadows' likeness to
    the target; a target trained with DP should leave the AUC near 0.5.
    """
    _confidence(confidence)
    _fprs(fprs)
    p1 = _probabilities("target_outputs_members", target_outputs_members)
    p0 = _probabilities("target_outputs_nonmembers", target_outputs_nonmembers, p1.shape[1])
    attack = fit_shadow_attack(
        train_shadow=train_shadow,
        shadow_data=shadow_data,
        num_shadows=num_shadows,
        seed=seed,
        features=features,
        top_k=top_k,
        l2=l2,
    )
    if attack.num_classes != p1.shape[1]:
        raise ValueError(
            f"the target outputs have {p1.shape[1]} classes but the shadow models {attack.num_classes}"
        )
    s1 = attack.scores(p1, target_labels_members)
    s0 = attack.scores(p0, target_labels_nonmembers)
    return evaluate_attack(s1, s0, attack="shadow-model", fprs=fprs, confidence=confidence)
