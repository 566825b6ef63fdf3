"""Membership inference: ROC/AUC against closed forms and references, the attacks on models
that do and do not leak membership."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from scipy import stats

from adaclip.audit.membership import (
    MembershipResult,
    attack_features,
    auc,
    auc_interval,
    evaluate_attack,
    fit_logistic,
    fit_shadow_attack,
    loss_threshold_attack,
    roc_curve,
    shadow_model_attack,
    tpr_at_fpr,
)

# --------------------------------------------------------------------------- ROC and AUC


def _brute_force_auc(s1: np.ndarray, s0: np.ndarray) -> float:
    diff = s1[:, None] - s0[None, :]
    return float(np.mean((diff > 0) + 0.5 * (diff == 0)))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_auc_matches_pair_count_and_sklearn_with_ties(seed):
    from sklearn.metrics import roc_auc_score

    rng = np.random.default_rng(seed)
    s1 = rng.integers(0, 6, size=57).astype(float) + (seed == 2) * 0.7  # many ties
    s0 = rng.integers(0, 5, size=43).astype(float)
    expected = _brute_force_auc(s1, s0)
    assert auc(s1, s0) == pytest.approx(expected, abs=1e-12)
    labels = np.r_[np.ones(s1.size), np.zeros(s0.size)]
    assert auc(s1, s0) == pytest.approx(roc_auc_score(labels, np.r_[s1, s0]), abs=1e-12)
    # swapping the roles reflects the AUC: the statistic is not symmetric by accident
    assert auc(s0, s1) == pytest.approx(1.0 - expected, abs=1e-12)


def test_roc_curve_matches_sklearn_and_its_area_is_the_auc():
    from sklearn.metrics import roc_curve as sk_roc_curve

    rng = np.random.default_rng(3)
    s1 = np.round(rng.normal(0.8, 1.0, size=80), 1)  # rounding makes ties
    s0 = np.round(rng.normal(0.0, 1.0, size=120), 1)
    fpr, tpr, thresholds = roc_curve(s1, s0)
    labels = np.r_[np.ones(s1.size), np.zeros(s0.size)]
    sk_fpr, sk_tpr, sk_thr = sk_roc_curve(labels, np.r_[s1, s0], drop_intermediate=False)
    np.testing.assert_allclose(fpr, sk_fpr)
    np.testing.assert_allclose(tpr, sk_tpr)
    np.testing.assert_allclose(thresholds[1:], sk_thr[1:])
    assert thresholds[0] == np.inf and (fpr[0], tpr[0]) == (0.0, 0.0) and (fpr[-1], tpr[-1]) == (1.0, 1.0)
    assert np.all(np.diff(fpr) >= 0) and np.all(np.diff(tpr) >= 0)
    # straight segments between the thresholds (ties randomised) enclose exactly the U-statistic
    area = float(np.sum(np.diff(fpr) * (tpr[1:] + tpr[:-1]) / 2))
    assert area == pytest.approx(auc(s1, s0), abs=1e-12)


def test_closed_forms_separated_reversed_and_tied():
    assert auc([3.0, 4.0], [1.0, 2.0]) == 1.0
    assert auc([1.0, 2.0], [3.0, 4.0]) == 0.0
    assert auc([1.0, 1.0, 1.0], [1.0, 1.0]) == 0.5
    fpr, tpr, _ = roc_curve([1.0, 1.0, 1.0], [1.0, 1.0])
    np.testing.assert_array_equal(fpr, [0.0, 1.0])  # all tied: the diagonal
    np.testing.assert_array_equal(tpr, [0.0, 1.0])
    assert tpr_at_fpr([3.0, 4.0], [1.0, 2.0], 0.0) == 1.0


def test_tpr_at_fpr_uses_the_roc_hull():
    # ROC points (0,0), (0,½), (½,½), (½,1), (1,1): the randomised test that mixes the
    # thresholds 3 and 1 beats every deterministic one at FPR ¼.
    members, nonmembers = [3.0, 1.0], [2.0, 0.0]
    assert tpr_at_fpr(members, nonmembers, 0.0) == 0.5
    assert tpr_at_fpr(members, nonmembers, 0.25) == pytest.approx(0.75)
    assert tpr_at_fpr(members, nonmembers, 0.5) == 1.0
    fpr, tpr, _ = roc_curve(members, nonmembers)
    assert np.interp(0.25, fpr, tpr) < 0.75  # the plain polyline is below the hull here
    out = tpr_at_fpr(members, nonmembers, np.array([0.0, 0.25, 1.0]))
    assert isinstance(out, np.ndarray)
    np.testing.assert_allclose(out, [0.5, 0.75, 1.0])


def test_tpr_at_fpr_is_concave_nondecreasing_and_above_the_roc():
    rng = np.random.default_rng(4)
    s1, s0 = rng.normal(1.0, 1.0, 300), rng.normal(0.0, 1.0, 400)
    grid = np.linspace(0.0, 1.0, 201)
    curve = tpr_at_fpr(s1, s0, grid)
    assert np.all(np.diff(curve) >= -1e-12)
    assert np.all(np.diff(curve, 2) <= 1e-12)
    fpr, tpr, _ = roc_curve(s1, s0)
    assert np.all(tpr_at_fpr(s1, s0, fpr) >= tpr - 1e-12)


def test_gaussian_scores_give_the_binormal_closed_forms():
    # member scores N(μ, 1), non-member scores N(0, 1): AUC = Φ(μ/√2), TPR(f) = Φ(μ − Φ⁻¹(1 − f))
    mu, n = 1.5, 20_000
    rng = np.random.default_rng(5)
    s1, s0 = rng.normal(mu, 1.0, n), rng.normal(0.0, 1.0, n)
    lo, hi = auc_interval(s1, s0, confidence=0.999)
    true_auc = stats.norm.cdf(mu / math.sqrt(2))
    assert lo <= true_auc <= hi
    assert hi - lo < 0.02
    for f in (0.01, 0.1):
        expected = stats.norm.cdf(mu - stats.norm.ppf(1 - f))
        assert tpr_at_fpr(s1, s0, f) == pytest.approx(expected, abs=0.03)
    # a wrong shift is told apart: the check can fail
    assert not lo <= stats.norm.cdf(1.4 / math.sqrt(2)) <= hi


def test_identical_distributions_negative_control():
    rng = np.random.default_rng(6)
    s1, s0 = rng.normal(0.0, 1.0, 2000), rng.normal(0.0, 1.0, 2000)
    lo, hi = auc_interval(s1, s0)
    assert abs(auc(s1, s0) - 0.5) < 0.03
    assert lo <= 0.5 <= hi
    assert tpr_at_fpr(s1, s0, 0.1) == pytest.approx(0.1, abs=0.04)
    # the same sample size with a small shift is detected
    lo, _ = auc_interval(s1 + 0.3, s0)
    assert lo > 0.5


def test_delong_interval_coverage_by_simulation():
    rng = np.random.default_rng(7)
    mu, n1, n0, reps = 0.8, 150, 150, 800
    true_auc = stats.norm.cdf(mu / math.sqrt(2))
    covered = {0.95: 0, 0.5: 0}
    for _ in range(reps):
        s1, s0 = rng.normal(mu, 1.0, n1), rng.normal(0.0, 1.0, n0)
        for c in covered:
            lo, hi = auc_interval(s1, s0, confidence=c)
            covered[c] += lo <= true_auc <= hi
    # binomial sd of the coverage at 800 reps: about 0.008 at 0.95 and 0.018 at 0.5 (DeLong's
    # interval is asymptotic: at a few dozen per class it covers about 0.93)
    assert 0.925 <= covered[0.95] / reps <= 0.975
    assert 0.44 <= covered[0.5] / reps <= 0.56  # the level is honoured, not just "wide"


def test_interval_degenerate_cases():
    assert auc_interval([1.0], [0.0, 2.0]) == (0.0, 1.0)  # one member: no variance estimate
    assert auc_interval([5.0, 6.0], [0.0, 1.0]) == (1.0, 1.0)  # perfect separation collapses


def test_non_finite_scores():
    # NaN counts as +inf: above every finite score, tied with +inf
    assert auc([np.nan], [1e300]) == 1.0
    assert auc([np.nan], [np.inf]) == 0.5
    assert auc([-np.inf], [-1e300]) == 0.0
    fpr, tpr, _ = roc_curve([np.nan, 0.0], [1.0, 2.0])
    assert tpr[1] == 0.5 and fpr[1] == 0.0


# --------------------------------------------------------------------------- results and the loss attack


def test_loss_threshold_attack_scores_minus_loss():
    rng = np.random.default_rng(8)
    member_losses = rng.exponential(0.5, 500)  # a model that fits its training data better
    nonmember_losses = rng.exponential(1.0, 500)
    result = loss_threshold_attack(member_losses, nonmember_losses, fprs=(0.01, 0.1))
    assert isinstance(result, MembershipResult)
    assert result.attack == "loss-threshold"
    assert result.auc == pytest.approx(auc(-member_losses, -nonmember_losses))
    # closed form for exponential losses: P[L₁ < L₀] = λ₁/(λ₁ + λ₀) = 2/3
    assert result.auc_interval[0] <= 2 / 3 <= result.auc_interval[1]
    assert result.auc > 0.6
    assert set(result.tpr_at_fpr) == {0.01, 0.1}
    assert result.tpr_at_fpr[0.1] == pytest.approx(tpr_at_fpr(-member_losses, -nonmember_losses, 0.1))
    assert (result.num_members, result.num_nonmembers) == (500, 500)
    text = str(result)
    assert "\n" not in text and "loss-threshold" in text and "AUC" in text
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.auc = 0.5  # type: ignore[misc]
    # the reverse gap (members fitted worse) gives AUC below ½: the sign is not arbitrary
    assert loss_threshold_attack(nonmember_losses, member_losses).auc < 0.4


def test_loss_threshold_attack_nan_loss_counts_as_member():
    result = loss_threshold_attack([np.nan, 0.1], [0.0, 0.2])
    assert result.auc == pytest.approx(auc([np.inf, -0.1], [0.0, -0.2]))


def test_evaluate_attack_result_fields():
    result = evaluate_attack([2.0, 3.0, 1.0], [0.0, 1.5], attack="custom", fprs=[0.5], confidence=0.9)
    assert result.attack == "custom" and result.confidence == 0.9
    assert result.tpr_at_fpr == {0.5: pytest.approx(tpr_at_fpr([2.0, 3.0, 1.0], [0.0, 1.5], 0.5))}


# --------------------------------------------------------------------------- logistic regression


def test_fit_logistic_matches_sklearn():
    from sklearn.linear_model import LogisticRegression

    rng = np.random.default_rng(9)
    n, l2 = 300, 0.01
    x = rng.normal(size=(n, 3)) * [1.0, 5.0, 0.1] + [0.0, 2.0, -1.0]
    z = x @ np.array([1.0, -0.3, 4.0]) + 0.5
    y = rng.random(n) < 1 / (1 + np.exp(-z))
    model = fit_logistic(x, y, l2=l2)
    xs = (x - x.mean(axis=0)) / x.std(axis=0)
    ref = LogisticRegression(C=1 / (n * l2), tol=1e-12, max_iter=10_000).fit(xs, y)
    np.testing.assert_allclose(model.coef, ref.coef_[0], atol=1e-6)
    assert model.intercept == pytest.approx(ref.intercept_[0], abs=1e-6)
    np.testing.assert_allclose(model.decision_function(x), ref.decision_function(xs), atol=1e-5)
    np.testing.assert_allclose(model.predict_proba(x), ref.predict_proba(xs)[:, 1], atol=1e-6)


def test_fit_logistic_separable_data_converges():
    x = np.r_[np.linspace(-3, -1, 20), np.linspace(1, 3, 20)][:, None]
    y = np.r_[np.zeros(20), np.ones(20)]
    model = fit_logistic(x, y, l2=1e-4)
    assert model.iterations < 100 and np.all(np.isfinite(model.coef))
    scores = model.decision_function(x)
    assert auc(scores[y == 1], scores[y == 0]) == 1.0
    # a larger penalty shrinks the weight: the penalty is applied
    assert abs(fit_logistic(x, y, l2=1.0).coef[0]) < abs(model.coef[0])


# --------------------------------------------------------------------------- shadow models

_D, _CLASSES = 10, 3
_W = np.random.default_rng(100).normal(size=(_D, _CLASSES))


def _population(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Inputs N(0, I) and noisy labels (a softmax draw from a fixed linear model)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, _D))
    logits = x @ _W
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    y = (rng.random((n, 1)) > np.cumsum(p, axis=1)).sum(axis=1)
    return x, y


def _kernel_model(x_train, y_train, seed):
    """A memorising "model": Gaussian-kernel class votes with a narrow bandwidth. A training
    point votes for its own label with weight 1; a fresh point is far from all of them in
    10 dimensions and gets a nearly uniform output."""

    def predict_proba(x):
        d2 = ((x[:, None, :] - x_train[None, :, :]) ** 2).sum(axis=-1)
        k = np.exp(-d2 / 2.0)
        votes = np.stack([k[:, y_train == c].sum(axis=1) for c in range(_CLASSES)], axis=1) + 0.1
        return votes / votes.sum(axis=1, keepdims=True)

    return predict_proba


def _blind_model(x_train, y_train, seed):
    """A "model" whose outputs do not depend on its training set at all."""

    def predict_proba(x):
        logits = x @ _W
        p = np.exp(logits - logits.max(axis=1, keepdims=True))
        return p / p.sum(axis=1, keepdims=True)

    return predict_proba


def _target(train_model, n=150):
    x_in, y_in = _population(n, seed=1)
    x_out, y_out = _population(n, seed=2)
    predict = train_model(x_in, y_in, 0)
    return predict(x_in), predict(x_out), y_in, y_out


def test_shadow_attack_detects_a_memorising_model():
    members, nonmembers, _, _ = _target(_kernel_model)
    result = shadow_model_attack(
        train_shadow=_kernel_model,
        shadow_data=_population(2 * 4 * 150, seed=3),
        target_outputs_members=members,
        target_outputs_nonmembers=nonmembers,
        num_shadows=4,
        seed=0,
    )
    assert result.attack == "shadow-model"
    assert result.auc > 0.9 and result.auc_interval[0] > 0.8
    assert result.tpr_at_fpr[0.1] > 0.5
    assert (result.num_members, result.num_nonmembers) == (150, 150)


def test_shadow_attack_on_a_blind_model_is_chance_negative_control():
    members, nonmembers, _, _ = _target(_blind_model)
    result = shadow_model_attack(
        train_shadow=_blind_model,
        shadow_data=_population(2 * 4 * 150, seed=3),
        target_outputs_members=members,
        target_outputs_nonmembers=nonmembers,
        seed=0,
    )
    assert abs(result.auc - 0.5) < 0.1
    assert result.auc_interval[0] <= 0.5 <= result.auc_interval[1]


def test_shadow_attack_with_the_loss_feature():
    members, nonmembers, y_in, y_out = _target(_kernel_model)
    result = shadow_model_attack(
        train_shadow=_kernel_model,
        shadow_data=_population(2 * 2 * 150, seed=4),
        target_outputs_members=members,
        target_outputs_nonmembers=nonmembers,
        target_labels_members=y_in,
        target_labels_nonmembers=y_out,
        num_shadows=2,
        features="sorted_loss",
    )
    assert result.auc > 0.9
    with pytest.raises(ValueError, match="labels"):
        shadow_model_attack(
            train_shadow=_kernel_model,
            shadow_data=_population(2 * 2 * 150, seed=4),
            target_outputs_members=members,
            target_outputs_nonmembers=nonmembers,
            num_shadows=2,
            features="sorted_loss",
        )


def test_fit_shadow_attack_trains_each_shadow_on_a_disjoint_part():
    calls = []

    def recording(x, y, seed):
        calls.append((x.copy(), seed))
        return _kernel_model(x, y, seed)

    x, y = _population(2 * 3 * 40 + 5, seed=5)
    attack = fit_shadow_attack(train_shadow=recording, shadow_data=(x, y), num_shadows=3, seed=1)
    assert len(calls) == 3 and attack.num_shadows == 3 and attack.num_classes == _CLASSES
    assert all(c[0].shape == (40, _D) for c in calls)
    rows = np.vstack([c[0] for c in calls])
    assert np.unique(rows, axis=0).shape[0] == rows.shape[0]  # no example in two shadows
    assert attack.shadow_auc > 0.9
    # deterministic for a seed, different for another
    again = fit_shadow_attack(train_shadow=_kernel_model, shadow_data=(x, y), num_shadows=3, seed=1)
    np.testing.assert_allclose(again.classifier.coef, attack.classifier.coef)
    other = fit_shadow_attack(train_shadow=_kernel_model, shadow_data=(x, y), num_shadows=3, seed=2)
    assert not np.allclose(other.classifier.coef, attack.classifier.coef)


def test_attack_features_sorted_top_k_and_loss():
    p = np.array([[0.2, 0.5, 0.3], [0.0, 0.0, 1.0]])
    np.testing.assert_allclose(attack_features(p), [[0.5, 0.3, 0.2], [1.0, 0.0, 0.0]])
    np.testing.assert_allclose(attack_features(p, top_k=2), [[0.5, 0.3], [1.0, 0.0]])
    with_loss = attack_features(p, np.array([0, 2]), features="sorted_loss", top_k=1)
    np.testing.assert_allclose(with_loss, [[0.5, -math.log(0.2)], [1.0, 0.0]], atol=1e-12)


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: auc([], [1.0]), "member_scores must not be empty"),
        (lambda: auc([1.0], np.zeros((2, 2))), "nonmember_scores must be a 1-D array"),
        (lambda: auc_interval([1.0], [0.0], confidence=1.0), "confidence must be in"),
        (lambda: tpr_at_fpr([1.0], [0.0], 1.5), "fpr must be in"),
        (lambda: tpr_at_fpr([1.0], [0.0], np.nan), "fpr must be in"),
        (lambda: loss_threshold_attack([1.0], [0.0], fprs=(-0.1,)), "fprs must all be in"),
        (lambda: loss_threshold_attack([1.0], [0.0], fprs=()), "fprs must not be empty"),
        (lambda: fit_logistic(np.ones((3, 1)), [1, 1, 1]), "both classes"),
        (lambda: fit_logistic(np.ones((3, 1)), [0, 1, 2]), "0/1"),
        (lambda: fit_logistic(np.ones((2, 1)), [0, 1], l2=0.0), "l2 must be"),
        (lambda: attack_features(np.ones((2, 2)) / 2, features="raw"), "features must be one of"),
        (lambda: attack_features(np.full((2, 2), 2.0)), "probabilities"),
        (lambda: attack_features(np.ones((2, 1))), "classes"),
        (lambda: attack_features(np.ones((2, 2)) / 2, top_k=0), "top_k must be"),
    ],
)
def test_validation_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_shadow_validation_errors():
    data = _population(80, seed=6)
    members, nonmembers, _, _ = _target(_kernel_model, n=20)
    base = dict(train_shadow=_kernel_model, shadow_data=data)
    with pytest.raises(ValueError, match="num_shadows must be"):
        fit_shadow_attack(**base, num_shadows=0)
    with pytest.raises(ValueError, match="too few"):
        fit_shadow_attack(train_shadow=_kernel_model, shadow_data=_population(7, seed=6), num_shadows=2)
    with pytest.raises(ValueError, match="pair"):
        fit_shadow_attack(train_shadow=_kernel_model, shadow_data=data[0])
    with pytest.raises(ValueError, match="callable"):
        fit_shadow_attack(train_shadow=None, shadow_data=data)
    with pytest.raises(ValueError, match="rows"):
        fit_shadow_attack(train_shadow=lambda x, y, s: lambda q: np.full((1, 3), 1 / 3), shadow_data=data)
    with pytest.raises(ValueError, match="target_outputs_nonmembers must have 3 classes"):
        shadow_model_attack(
            **base, target_outputs_members=members, target_outputs_nonmembers=np.full((5, 2), 0.5)
        )
    with pytest.raises(ValueError, match="confidence"):
        shadow_model_attack(
            **base, target_outputs_members=members, target_outputs_nonmembers=nonmembers, confidence=0
        )
