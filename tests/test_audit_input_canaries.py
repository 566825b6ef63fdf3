"""Black-box input canaries: their labels, the inclusion coins, and insertion into the data."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from scipy import stats

from adaclip.audit.input_canaries import (
    InputCanaries,
    canary_scores_from_losses,
    draw_inclusion,
    mislabelled_canaries,
    out_of_distribution_canaries,
)


def _pool(n=500, d=4, classes=5, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, d)), rng.integers(0, classes, size=n)


# --------------------------------------------------------------------------- inclusion coins


@pytest.mark.parametrize("p", [0.5, 0.2])
def test_inclusion_rate_is_the_probability(p):
    included = draw_inclusion(20_000, seed=1, probability=p)
    assert included.dtype == np.bool_ and included.shape == (20_000,)
    k = int(included.sum())
    assert stats.binomtest(k, 20_000, p).pvalue > 1e-3
    # negative control: the same count is inconsistent with a rate 0.02 away
    assert stats.binomtest(k, 20_000, p + 0.02).pvalue < 1e-3


def test_inclusion_coins_are_independent_across_canaries():
    included = draw_inclusion(20_000, seed=2).astype(int)
    # consecutive pairs: a 2×2 table with no association
    table = np.zeros((2, 2))
    np.add.at(table, (included[:-1], included[1:]), 1)
    assert stats.chi2_contingency(table).pvalue > 1e-3


def test_inclusion_is_deterministic_by_seed():
    a = draw_inclusion(1000, seed=3)
    np.testing.assert_array_equal(a, draw_inclusion(1000, seed=3))
    assert not np.array_equal(a, draw_inclusion(1000, seed=4))
    assert draw_inclusion(0, seed=3).shape == (0,)
    assert not draw_inclusion(50, seed=3, probability=0.0).any()
    assert draw_inclusion(50, seed=3, probability=1.0).all()


# --------------------------------------------------------------------------- mislabelled canaries


def test_mislabelled_canaries_come_from_the_pool_with_a_wrong_label():
    x, y = _pool()
    canaries = mislabelled_canaries(x, y, num_canaries=200, num_classes=5, seed=5)
    assert canaries.kind == "mislabelled" and canaries.num_canaries == 200
    assert canaries.x.shape == (200, 4) and canaries.y.shape == (200,) and canaries.y.dtype == y.dtype
    # each canary is a distinct pool row, and its label is never the row's true label
    match = np.all(canaries.x[:, None, :] == x[None, :, :], axis=-1)
    assert np.all(match.sum(axis=1) == 1)
    rows = match.argmax(axis=1)
    assert np.unique(rows).size == 200
    assert np.all(canaries.y != y[rows])
    assert np.all((canaries.y >= 0) & (canaries.y < 5))


def test_mislabelled_labels_are_uniform_over_the_other_classes():
    x = np.zeros((6000, 1))
    y = np.zeros(6000, dtype=np.int64)  # every true label 0: the new one is uniform on {1, 2, 3}
    canaries = mislabelled_canaries(x, y, num_canaries=6000, num_classes=4, seed=6)
    counts = np.bincount(canaries.y, minlength=4)
    assert counts[0] == 0
    assert stats.chisquare(counts[1:]).pvalue > 1e-3
    # negative control: the counts are not consistent with a skewed distribution
    assert stats.chisquare(counts[1:], f_exp=np.array([0.4, 0.3, 0.3]) * 6000).pvalue < 1e-3
    assert stats.binomtest(canaries.num_included, 6000, 0.5).pvalue > 1e-3


def test_mislabelled_canaries_are_deterministic_by_seed():
    x, y = _pool()
    a = mislabelled_canaries(x, y, num_canaries=50, num_classes=5, seed=7)
    b = mislabelled_canaries(x, y, num_canaries=50, num_classes=5, seed=7)
    c = mislabelled_canaries(x, y, num_canaries=50, num_classes=5, seed=8)
    for field in ("x", "y", "included"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
    assert not np.array_equal(a.x, c.x)


def test_two_classes_flip_every_label():
    x, y = _pool(classes=2)
    canaries = mislabelled_canaries(x, y, num_canaries=100, num_classes=2, seed=9)
    match = np.all(canaries.x[:, None, :] == x[None, :, :], axis=-1).argmax(axis=1)
    np.testing.assert_array_equal(canaries.y, 1 - y[match])


# --------------------------------------------------------------------------- out-of-distribution canaries


def test_out_of_distribution_canaries_shapes_scale_and_labels():
    canaries = out_of_distribution_canaries(
        (3, 8), num_canaries=4000, num_classes=10, seed=10, scale=2.0, dtype=np.float32
    )
    assert canaries.kind == "out_of_distribution"
    assert canaries.x.shape == (4000, 3, 8) and canaries.x.dtype == np.float32
    assert np.std(canaries.x) == pytest.approx(2.0, rel=0.02)
    assert abs(float(np.mean(canaries.x))) < 0.02
    counts = np.bincount(canaries.y, minlength=10)
    assert counts.size == 10 and stats.chisquare(counts).pvalue > 1e-3
    assert stats.binomtest(canaries.num_included, 4000, 0.5).pvalue > 1e-3
    assert out_of_distribution_canaries(5, num_canaries=3, num_classes=2, seed=0).x.shape == (3, 5)
    again = out_of_distribution_canaries(
        (3, 8), num_canaries=4000, num_classes=10, seed=10, scale=2.0, dtype=np.float32
    )
    np.testing.assert_array_equal(again.x, canaries.x)


# --------------------------------------------------------------------------- InputCanaries


def _small_canaries() -> InputCanaries:
    return InputCanaries(
        x=np.arange(10.0).reshape(5, 2),
        y=np.array([0, 1, 2, 0, 1]),
        included=np.array([True, False, True, True, False]),
        kind="test",
    )


def test_members_and_insert_append_exactly_the_included():
    canaries = _small_canaries()
    x_train, y_train = np.full((3, 2), -1.0), np.array([9, 9, 9])
    cx, cy = canaries.members()
    np.testing.assert_array_equal(cx, [[0.0, 1.0], [4.0, 5.0], [6.0, 7.0]])
    np.testing.assert_array_equal(cy, [0, 2, 0])
    x_new, y_new = canaries.insert(x_train, y_train)
    assert x_new.shape == (3 + canaries.num_included, 2) and canaries.num_included == 3
    np.testing.assert_array_equal(x_new[:3], x_train)
    np.testing.assert_array_equal(x_new[3:], cx)
    np.testing.assert_array_equal(y_new, [9, 9, 9, 0, 2, 0])
    # new arrays: the inputs are untouched
    x_new[0] = 100.0
    assert np.all(x_train == -1.0)


def test_insert_shuffled_keeps_the_rows_and_pairs():
    canaries = _small_canaries()
    x_train, y_train = np.full((3, 2), -1.0), np.array([9, 9, 9])
    x_a, y_a = canaries.insert(x_train, y_train, seed=11)
    x_b, y_b = canaries.insert(x_train, y_train, seed=11)
    np.testing.assert_array_equal(x_a, x_b)
    np.testing.assert_array_equal(y_a, y_b)
    plain_x, plain_y = canaries.insert(x_train, y_train)
    assert not np.array_equal(x_a, plain_x)
    # the same (x, y) pairs as the unshuffled set, in another order
    as_rows = lambda x, y: sorted(map(tuple, np.column_stack([x, y]).tolist()))  # noqa: E731
    assert as_rows(x_a, y_a) == as_rows(plain_x, plain_y)


def test_input_canaries_are_immutable():
    canaries = _small_canaries()
    with pytest.raises(dataclasses.FrozenInstanceError):
        canaries.kind = "other"  # type: ignore[misc]
    with pytest.raises(ValueError, match="read-only"):
        canaries.included[0] = False
    source = np.array([True, False, True, True, False])
    copy = InputCanaries(x=np.zeros((5, 1)), y=np.zeros(5, dtype=int), included=source, kind="t")
    source[0] = False
    assert copy.included[0]  # stored as a copy


def test_scores_from_losses_are_minus_losses():
    losses = np.array([0.1, 2.0, np.nan, np.inf])
    scores = canary_scores_from_losses(losses)
    np.testing.assert_array_equal(scores[:2], [-0.1, -2.0])
    assert np.isnan(scores[2]) and scores[3] == -np.inf
    # the convention: a lower loss (a fitted, likely included canary) scores higher
    assert scores[0] > scores[1]


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: draw_inclusion(-1, seed=0), "num_canaries must be an integer >= 0"),
        (lambda: draw_inclusion(2.5, seed=0), "num_canaries must be an integer"),
        (lambda: draw_inclusion(5, seed=0, probability=1.5), "probability must be in"),
        (lambda: mislabelled_canaries(*_pool(), num_canaries=0, num_classes=5, seed=0), "num_canaries"),
        (lambda: mislabelled_canaries(*_pool(), num_canaries=501, num_classes=5, seed=0), "exceeds the pool"),
        (lambda: mislabelled_canaries(*_pool(), num_canaries=5, num_classes=1, seed=0), "num_classes"),
        (lambda: mislabelled_canaries(*_pool(), num_canaries=5, num_classes=3, seed=0), "num_classes=3"),
        (
            lambda: mislabelled_canaries(
                np.zeros((3, 2)), np.zeros(4, int), num_canaries=1, num_classes=2, seed=0
            ),
            "one label per row",
        ),
        (
            lambda: mislabelled_canaries(
                np.zeros((3, 2)), np.zeros(3), num_canaries=1, num_classes=2, seed=0
            ),
            "integer class labels",
        ),
        (
            lambda: mislabelled_canaries(
                *_pool(), num_canaries=5, num_classes=5, seed=0, inclusion_probability=-0.1
            ),
            "inclusion_probability",
        ),
        (lambda: out_of_distribution_canaries((0,), num_canaries=2, num_classes=2, seed=0), "shape"),
        (lambda: out_of_distribution_canaries(3, num_canaries=2, num_classes=2, seed=0, scale=0), "scale"),
        (lambda: canary_scores_from_losses(np.zeros((2, 2))), "losses must be a 1-D"),
        (
            lambda: InputCanaries(x=np.zeros((3, 2)), y=np.zeros(2), included=np.ones(3, bool), kind="k"),
            "y must have shape",
        ),
        (
            lambda: InputCanaries(x=np.zeros((3, 2)), y=np.zeros(3), included=np.ones(3), kind="k"),
            "included must be a bool array",
        ),
        (lambda: _small_canaries().insert(np.zeros((4, 3)), np.zeros(4)), "shape"),
        (lambda: _small_canaries().insert(np.zeros((4, 2)), np.zeros(3)), "one label per row"),
    ],
)
def test_validation_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()
