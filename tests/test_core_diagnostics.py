"""The scale diagnostic reads the state only and reports what the transform does."""

from __future__ import annotations

import numpy as np
import pytest

from adaclip import strategies as S
from adaclip.diagnostics import format_scale_report, scale_report

PARAMS = [np.zeros((4, 3)), np.zeros(3)]


def _steps(strategy, steps=5, seed=0):
    rng = np.random.default_rng(seed)
    state = strategy.init(PARAMS)
    for _ in range(steps):
        grads = [rng.normal(size=(16, *p.shape)) * np.linspace(0.1, 3, p.size).reshape(p.shape) for p in PARAMS]
        noise = [rng.normal(size=p.shape) for p in PARAMS] + [rng.normal(size=()) for _ in range(strategy.num_auxiliary)]
        _, state = S.private_step(strategy, state, grads, noise, noise_multiplier=0.5, expected_batch_size=16)
    return state


def test_flat_start_reports_no_spread_and_no_movement():
    strategy = S.AdaptiveClipping(scale="separated", max_grad_norm=2.0)
    reports = scale_report(strategy, strategy.init(PARAMS), names=["w", "b"])
    assert [r.name for r in reports] == ["w", "b"]
    for r in reports:
        assert r.max_over_min == pytest.approx(1.0) and r.q90_over_q10 == pytest.approx(1.0)
        assert r.moved == 0.0 and r.scale_ratio == pytest.approx(1.0) and r.centre_norm == 0.0


def test_a_learned_per_coordinate_shape_shows_spread_and_movement():
    strategy = S.AdaptiveClipping(scale="separated", max_grad_norm=1.0, beta_std=0.5, std_min=1e-6, std_max=1e3)
    reports = scale_report(strategy, _steps(strategy))
    assert reports[0].max_over_min > 1.5 and reports[0].moved > 0.05
    assert reports[0].centre_norm > 0
    assert "max/min" in format_scale_report(reports)


def test_quantile_clipping_reports_its_clip_level():
    strategy = S.QuantileClipping(1.0, S.QuantileRule(count_noise_multiplier=2.0, learning_rate=1.0))
    state = _steps(strategy)
    reports = scale_report(strategy, state, params=PARAMS)
    ratio = float(state.extra["clip_norm"]) / 1.0
    assert all(r.scale_ratio == pytest.approx(ratio) for r in reports)
    assert all(r.max_over_min == pytest.approx(1.0) for r in reports)


def test_stateless_strategy_needs_shapes():
    with pytest.raises(ValueError, match="params="):
        scale_report(S.FlatClipping(1.0), S.ClipState(step=0))
