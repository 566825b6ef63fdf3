"""Edge cases of the adaptive parts found while wiring the plugins."""

from __future__ import annotations

import numpy as np
import pytest

from adaclip import adaptive
from adaclip import strategies as S
from adaclip.errors import InvalidHyperparameterError
from adaclip.schedules import ConstantSchedule, apply_to_strategy


@pytest.mark.parametrize("sigma", [-1.0, float("nan"), float("inf")])
def test_split_refuses_a_negative_or_non_finite_sigma(sigma):
    with pytest.raises(InvalidHyperparameterError):
        adaptive.split_noise_multiplier(sigma, 5.0)


def test_split_of_an_array_sigma_is_nan_where_invalid():
    sigma = np.array([-1.0, 0.0, 1.0, 20.0])
    out = adaptive.split_noise_multiplier(sigma, 5.0)
    assert np.isnan(out[0]) and out[1] == 0.0 and np.isnan(out[3])
    assert out[2] == pytest.approx((1.0 - 0.01) ** -0.5)


@pytest.mark.parametrize(
    "strategy",
    [S.QuantileClipping(1.0), S.AdaptiveClipping(update_every=2), S.AdaptiveClipping(scale="separated", max_grad_norm=1.0, quantile=S.QuantileRule())],
)
def test_init_accepts_a_zero_size_first_tensor(strategy):
    state = strategy.init([np.zeros((0, 3)), np.zeros(2)])
    for key in ("clip_norm", "window_count"):
        if state.extra and key in state.extra:
            assert np.ndim(state.extra[key]) == 0


def test_a_schedule_cannot_set_a_quantile_adapted_clip_norm():
    hp = ConstantSchedule(1.0, 0.3).at(0)
    for strategy in (S.QuantileClipping(1.0), S.AdaptiveClipping(scale="separated", max_grad_norm=1.0, quantile=S.QuantileRule())):
        with pytest.raises(InvalidHyperparameterError, match="quantile rule"):
            apply_to_strategy(strategy, hp)
    assert apply_to_strategy(S.AdaptiveClipping(scale="separated", max_grad_norm=1.0), hp).max_grad_norm == 0.3


def test_initial_variance_zero_starts_a_flat_shape_that_the_releases_lift():
    strategy = S.AdaptiveClipping.scale_then_privatize(1.0, beta=0.9)
    params = [np.zeros((3, 2)), np.zeros(2)]
    state = strategy.init(params)
    assert all(np.all(s == strategy.std_min) for s in state.std)
    rng = np.random.default_rng(0)
    for _ in range(5):
        grads = [rng.normal(size=(8, *p.shape)) * 1e-2 * np.arange(1, p.size + 1).reshape(p.shape) for p in params]
        noise = [np.zeros(p.shape) for p in params]
        _, state = S.private_step(strategy, state, grads, noise, noise_multiplier=0.0, expected_batch_size=8)
    scale = strategy.transform(state, 2)[1]
    assert scale[0].max() / scale[0].min() > 2.0  # the shape formed from the releases


def test_initial_variance_default_keeps_the_patent():
    assert S.AdaptiveClipping().is_patent and not S.AdaptiveClipping(initial_variance=1e-6).is_patent
    with pytest.raises(InvalidHyperparameterError):
        S.AdaptiveClipping(initial_variance=-1.0)
