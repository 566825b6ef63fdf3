"""Noise-decay and retune schedules, eDP-SGD layer scales, and the user-level estimators."""

from __future__ import annotations

import math

import numpy as np
import pytest

from adaclip import estimators as E
from adaclip import layer_scales as L
from adaclip import schedules as Sch
from adaclip.errors import InvalidGradientError, InvalidHyperparameterError
from adaclip.strategies import AdaptiveClipping, FlatClipping, PerLayerClipping, ScaledClipping


def test_constant_schedule():
    s = Sch.ConstantSchedule(noise_multiplier=1.1)
    assert s.at(0) == (1.1, None) and s.at(10_000) == (1.1, None)


def test_linear_and_exponential_decay_follow_the_epoch():
    lin = Sch.LinearNoiseDecay(initial_noise_multiplier=2.0, decay_rate=0.5, steps_per_epoch=10)
    exp = Sch.ExponentialNoiseDecay(initial_noise_multiplier=2.0, decay_rate=0.5, steps_per_epoch=10)
    for step in [0, 9, 10, 19, 20, 95]:
        e = step // 10
        assert lin.at(step).noise_multiplier == pytest.approx(2.0 / (1 + 0.5 * e))
        assert exp.at(step).noise_multiplier == pytest.approx(2.0 * math.exp(-0.5 * e))
    assert lin.at(9) == lin.at(0)  # constant within an epoch


def test_retune_switches_clip_and_noise_together_and_chains():
    base = Sch.ConstantSchedule(noise_multiplier=1.0, max_grad_norm=1.0)
    r = Sch.Retune(base, at_step=100, noise_multiplier=2.0, max_grad_norm=0.5)
    assert r.at(99) == (1.0, 1.0)
    assert r.at(100) == (2.0, 0.5)
    rr = Sch.Retune(r, at_step=200, after=Sch.ConstantSchedule(noise_multiplier=3.0))
    assert rr.at(150) == (2.0, 0.5) and rr.at(200) == (3.0, None)
    decayed = Sch.Retune(
        Sch.LinearNoiseDecay(initial_noise_multiplier=2.0, decay_rate=1.0, steps_per_epoch=1), at_step=3,
        max_grad_norm=0.1,
    )
    assert decayed.at(5) == (2.0 / 6, 0.1)


def test_apply_to_strategy():
    flat = FlatClipping(max_grad_norm=1.0)
    hp = Sch.StepHyperparameters(noise_multiplier=1.0, max_grad_norm=0.25)
    assert Sch.apply_to_strategy(flat, hp) == FlatClipping(max_grad_norm=0.25)
    assert Sch.apply_to_strategy(flat, Sch.StepHyperparameters(1.0)) is flat
    assert Sch.apply_to_strategy(PerLayerClipping(max_grad_norm=1.0), hp).max_grad_norm == 0.25
    assert Sch.apply_to_strategy(ScaledClipping(max_grad_norm=1.0, layer_scales=(1.0,)), hp).max_grad_norm == 0.25
    with pytest.raises(InvalidHyperparameterError, match="AdaptiveClipping has no single clip norm"):
        Sch.apply_to_strategy(AdaptiveClipping(), hp)


@pytest.mark.parametrize(
    "make, name",
    [
        (lambda: Sch.ConstantSchedule(noise_multiplier=-1), "noise_multiplier"),
        (lambda: Sch.ConstantSchedule(noise_multiplier=1, max_grad_norm=0), "max_grad_norm"),
        (lambda: Sch.LinearNoiseDecay(initial_noise_multiplier=1, decay_rate=-1, steps_per_epoch=5), "decay_rate"),
        (lambda: Sch.ExponentialNoiseDecay(initial_noise_multiplier=1, decay_rate=1, steps_per_epoch=0), "steps_per_epoch"),
        (lambda: Sch.Retune(Sch.ConstantSchedule(noise_multiplier=1), at_step=0, noise_multiplier=1), "at_step"),
        (lambda: Sch.Retune(Sch.ConstantSchedule(noise_multiplier=1), at_step=5), "Retune needs"),
        (lambda: Sch.Retune("nope", at_step=5, noise_multiplier=1), "before must be a schedule"),
        (lambda: Sch.ConstantSchedule(noise_multiplier=1).at(-1), "step"),
    ],
)
def test_schedule_validation(make, name):
    with pytest.raises(InvalidHyperparameterError, match=name):
        make()


# ----------------------------------------------------------------------------- layer scales


def test_public_layer_scales_are_proportional_to_mean_norms_with_unit_rms():
    rng = np.random.default_rng(0)
    grads = [rng.normal(scale=3.0, size=(50, 4, 4)), rng.normal(scale=0.1, size=(50, 8))]
    alphas = np.asarray(L.layer_scales_from_public(grads))
    norms = L.per_tensor_norms(grads).mean(axis=0)
    np.testing.assert_allclose(alphas / alphas[0], norms / norms[0], rtol=1e-12)
    assert np.sqrt(np.mean(alphas**2)) == pytest.approx(1.0)
    assert L.layer_scales_from_public([np.ones((3, 2)), np.ones((3, 2))]) == pytest.approx((1.0, 1.0))


def test_private_layer_scales_are_a_clipped_gaussian_release():
    rng = np.random.default_rng(1)
    grads = [rng.normal(scale=5.0, size=(20, 3)), rng.normal(scale=0.5, size=(20, 2))]
    z = rng.normal(size=2)
    got = L.private_layer_scales(grads, z, noise_multiplier=2.0, expected_batch_size=20.0, clip_norm=1.5)
    u = L.per_tensor_norms(grads)
    u = u * np.minimum(1, 1.5 / np.linalg.norm(u, axis=1))[:, None]
    want = L.normalise_scales((u.sum(axis=0) + 2.0 * 1.5 * z) / 20.0)
    np.testing.assert_allclose(got, want, rtol=1e-12)


def test_private_layer_scales_noise_has_the_stated_scale():
    """With zero gradients the clipped sum is 0 and the release is exactly σ·c·z/B̄."""
    sigma, c, B = 1.7, 0.8, 10.0
    zero = [np.zeros((4, 3)), np.zeros((4, 2))]
    z = np.array([0.3, 1.2])
    got = L.private_layer_scales(zero, z, noise_multiplier=sigma, expected_batch_size=B, clip_norm=c)
    np.testing.assert_allclose(got, L.normalise_scales(sigma * c * z / B))


def test_private_layer_scales_records_the_release_with_the_accountant():
    class Recorder:
        def __init__(self):
            self.calls = []

        def step(self, **kw):
            self.calls.append(kw)

    acc = Recorder()
    L.private_layer_scales(
        [np.ones((3, 2))], np.zeros(1), noise_multiplier=1.0, expected_batch_size=3, accountant=acc, sample_rate=0.01
    )
    assert acc.calls == [dict(noise_multiplier=1.0, sample_rate=0.01)]


def test_private_layer_scales_refuse_unsafe_input_before_accounting():
    class Recorder:
        calls = 0

        def step(self, **kw):
            Recorder.calls += 1

    with pytest.raises(InvalidHyperparameterError, match="noise_multiplier must be > 0"):
        L.private_layer_scales([np.ones((3, 2))], noise_multiplier=0.0, expected_batch_size=3)
    with pytest.raises(InvalidGradientError, match="NaN"):
        L.private_layer_scales(
            [np.full((3, 2), np.nan)], noise_multiplier=1.0, expected_batch_size=3, accountant=Recorder(), sample_rate=0.1
        )
    with pytest.raises(InvalidHyperparameterError, match="together"):
        L.private_layer_scales([np.ones((3, 2))], noise_multiplier=1.0, expected_batch_size=3, accountant=Recorder())
    assert Recorder.calls == 0


# ----------------------------------------------------------------------------- estimators


def test_estimators_match_their_formulas():
    w = E.capped_user_weights([0, 5, 10, 40], weight_cap=10)
    np.testing.assert_allclose(w, [0, 0.5, 1, 1])
    total = np.array([2.0, -4.0])
    np.testing.assert_allclose(E.fixed_denominator_estimate(total, sample_rate=0.1, total_weight=50), total / 5)
    assert E.fixed_denominator_sensitivity(clip_norm=2.0, sample_rate=0.1, total_weight=50) == pytest.approx(0.4)
    np.testing.assert_allclose(
        E.clipped_denominator_estimate(total, 3.0, sample_rate=0.1, min_total_weight=50), total / 5
    )
    np.testing.assert_allclose(
        E.clipped_denominator_estimate(total, 8.0, sample_rate=0.1, min_total_weight=50), total / 8
    )
    assert E.clipped_denominator_sensitivity(clip_norm=2.0, sample_rate=0.1, min_total_weight=50) == pytest.approx(0.8)


def test_fixed_denominator_is_unbiased_under_poisson_sampling():
    rng = np.random.default_rng(3)
    deltas = rng.normal(size=(200, 3))
    weights = E.capped_user_weights(rng.integers(1, 30, size=200), weight_cap=15)
    W, q = weights.sum(), 0.2
    target = (weights[:, None] * deltas).sum(axis=0) / W
    ests = []
    for _ in range(3000):
        mask = rng.random(200) < q
        ests.append(E.fixed_denominator_estimate((weights[mask, None] * deltas[mask]).sum(axis=0), sample_rate=q, total_weight=W))
    ests = np.asarray(ests)
    se = ests.std(axis=0) / np.sqrt(len(ests))
    assert np.all(np.abs(ests.mean(axis=0) - target) < 5 * se)


def test_estimator_release_is_the_estimate_through_the_core_release():
    # (D, κ) of each estimator, and the clipped one's shrink: sum·shrink/D is the clipped
    # denominator's estimate and κσS/D its noise, for every sampled weight.
    fixed = E.estimator_release("fixed", sample_rate=0.1, total_weight=50)
    assert fixed == (0.1 * 50, 1.0)
    clipped = E.estimator_release("clipped", sample_rate=0.1, total_weight=50, min_total_weight=20)
    assert clipped == (0.1 * 20, 2.0)
    assert E.estimator_release("clipped", sample_rate=0.1, total_weight=50).denominator == 0.1 * 50
    total = np.array([2.0, -4.0])
    for sampled in (0.5, 2.0, 7.5):
        shrink = E.clipped_denominator_shrink(sampled, denominator=clipped.denominator)
        assert 0 < shrink <= 1
        np.testing.assert_allclose(
            total * shrink / clipped.denominator,
            E.clipped_denominator_estimate(total, sampled, sample_rate=0.1, min_total_weight=20), rtol=1e-15,
        )
    assert clipped.sensitivity_factor / clipped.denominator == pytest.approx(
        E.clipped_denominator_sensitivity(clip_norm=1.0, sample_rate=0.1, min_total_weight=20), rel=1e-15
    )
    assert fixed.sensitivity_factor / fixed.denominator == pytest.approx(
        E.fixed_denominator_sensitivity(clip_norm=1.0, sample_rate=0.1, total_weight=50), rel=1e-15
    )


def test_capped_user_weights_can_zero_what_clients_report_wrongly():
    reported = [2, 8, -1, float("nan"), float("inf"), None, "a", True]
    np.testing.assert_array_equal(E.capped_user_weights(reported, weight_cap=4.0, invalid="zero"), [0.5, 1, 0, 0, 0, 0, 0, 0])
    with pytest.raises(InvalidHyperparameterError, match=">= 0"):
        E.capped_user_weights([2, -1], weight_cap=4.0)


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda: E.estimator_release("median", sample_rate=0.1, total_weight=1), "estimator"),
        (lambda: E.estimator_release("clipped", sample_rate=0.1, total_weight=1, min_total_weight=2), "must not exceed"),
        (lambda: E.estimator_release("fixed", sample_rate=1.5, total_weight=1), "sample_rate"),
        (lambda: E.clipped_denominator_shrink(1.0, denominator=0), "denominator"),
        (lambda: E.capped_user_weights([1], weight_cap=1, invalid="drop"), "invalid"),
        (lambda: E.capped_user_weights([1], weight_cap=0), "weight_cap"),
        (lambda: E.fixed_denominator_estimate(1.0, sample_rate=0, total_weight=1), "sample_rate"),
        (lambda: E.fixed_denominator_estimate(1.0, sample_rate=0.5, total_weight=-1), "total_weight"),
        (lambda: E.clipped_denominator_sensitivity(clip_norm=1, sample_rate=2, min_total_weight=1), "sample_rate"),
    ],
)
def test_estimator_validation(call, name):
    with pytest.raises(InvalidHyperparameterError, match=name):
        call()
