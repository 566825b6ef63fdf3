"""The plan of a banded-noise run (adaclip.correlated.planning): one rule for every framework.

The plan must be what make_private builds for the same run (b, σ_b, coefficients, ρ), its
accounting must meet the target, its arguments are checked before any calibration, and a JAX
run on the plan trains within its budget.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from adaclip import accounting
from adaclip.correlated import BandedNoise, BandedNoisePlan, plan_banded_noise
from adaclip.correlated.coefficients import adaptive_lr_scale, sqrt_toeplitz_coefficients
from adaclip.correlated.planning import ADAPTIVE_OPTIMIZER_MAX_BANDS, candidate_bands
from adaclip.errors import InvalidHyperparameterError

RUN = {"target_epsilon": 3.0, "delta": 1e-5, "sample_rate": 0.01, "steps": 200}
_REAL_CALIBRATION = accounting.calibrate_noise_multiplier
_CALIBRATED: dict[tuple, float] = {}


@pytest.fixture(autouse=True)
def _shared_calibrations(monkeypatch):
    """The same calibrations recur across these tests (a second each): computed once, by the
    real function, and shared. make_private and the plan both look the function up here."""

    def cached(**kwargs):
        key = tuple(sorted(kwargs.items()))
        if key not in _CALIBRATED:
            _CALIBRATED[key] = _REAL_CALIBRATION(**kwargs)
        return _CALIBRATED[key]

    monkeypatch.setattr(accounting, "calibrate_noise_multiplier", cached)


def test_candidates_respect_the_sampling_rate_the_steps_the_cap_and_the_memory_budget():
    assert candidate_bands(sample_rate=0.01, steps=200) == [1, 2, 4, 8, 16, 32, 64]
    assert candidate_bands(sample_rate=0.1, steps=200) == [1, 2, 4, 8]  # b·q ≤ 1
    assert candidate_bands(sample_rate=0.01, steps=60) == [1, 2, 4, 8, 16, 32]  # b ≤ T
    # a run shorter than MIN_STEPS_FOR_BANDS (50) steps gets DP-SGD: on 16-step runs the
    # expected-error choice was behind DP-SGD in 7 of 10 cells (results/utility_short_runs.md)
    assert candidate_bands(sample_rate=0.01, steps=20) == candidate_bands(sample_rate=0.01, steps=49) == [1]
    assert candidate_bands(sample_rate=0.01, steps=50) == [1, 2, 4, 8, 16, 32]
    capped = candidate_bands(sample_rate=0.01, steps=200, adaptive_optimizer=True)
    assert max(capped) == ADAPTIVE_OPTIMIZER_MAX_BANDS
    assert candidate_bands(sample_rate=0.01, steps=200, adaptive_optimizer=True, lr_scaled=True)[-1] == 64
    assert candidate_bands(sample_rate=0.01, steps=200, bytes_per_band=100, buffer_budget_bytes=300) == [1, 2, 4]


def test_plan_for_momentum_sgd_chooses_by_expected_error_and_calibrates_for_the_cycles():
    plan = plan_banded_noise(**RUN, workload="momentum", momentum=0.9)
    assert isinstance(plan, BandedNoisePlan) and plan.bands > 1 and plan.lr_scale == 1.0
    assert plan.coefficients == tuple(sqrt_toeplitz_coefficients(plan.bands))
    assert plan.noise == BandedNoise(plan.coefficients) and plan.noise_mechanism == "banded"
    assert plan.accounted_sample_rate == pytest.approx(0.01 * plan.bands)
    assert plan.compositions == math.ceil(200 / plan.bands)
    expected = _REAL_CALIBRATION(
        target_epsilon=3.0, delta=1e-5, sample_rate=plan.accounted_sample_rate, steps=plan.compositions
    )
    assert plan.noise_multiplier == expected
    assert plan.independent_noise_multiplier == _REAL_CALIBRATION(
        target_epsilon=3.0, delta=1e-5, sample_rate=0.01, steps=200
    )
    # the run the plan describes spends at most the target
    spent = accounting.Accountant()
    spent.step(noise_multiplier=plan.noise_multiplier, sample_rate=plan.accounted_sample_rate,
               num_steps=plan.compositions)  # fmt: skip
    assert 2.9 < spent.epsilon(1e-5) <= 3.0
    assert plan.buffer_numbers(1000) == (plan.bands - 1) * 1000


def test_adaptive_optimizers_get_the_lr_factor_and_the_rules_own_b_or_the_cap_without_it():
    sgd = plan_banded_noise(**RUN, workload="momentum")
    adam = plan_banded_noise(**RUN, workload="momentum", adaptive_optimizer=True)
    assert adam.bands == sgd.bands > ADAPTIVE_OPTIMIZER_MAX_BANDS
    assert adam.lr_scale == adaptive_lr_scale(
        adam.coefficients, 200, sigma=adam.noise_multiplier, sigma_independent=adam.independent_noise_multiplier
    ) > 1.0
    left_alone = plan_banded_noise(**RUN, workload="momentum", adaptive_optimizer=True, scale_adaptive_lr=False)
    assert left_alone.bands <= ADAPTIVE_OPTIMIZER_MAX_BANDS and left_alone.lr_scale == 1.0


def test_one_band_is_dp_sgd_with_no_factor():
    plan = plan_banded_noise(**RUN, bands=1, adaptive_optimizer=True)
    assert plan.noise_mechanism == "independent" and plan.coefficients == (1.0,) and plan.lr_scale == 1.0
    assert plan.noise_multiplier == plan.independent_noise_multiplier
    assert plan.compositions == 200 and plan.accounted_sample_rate == 0.01


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "adam-unscaled", "plain-sgd"])
def test_plan_is_what_make_private_builds_for_the_same_run(optimizer):
    """One rule: make_private's b, σ, coefficients and lr factor equal the plan's."""
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader, TensorDataset

    from adaclip_torch.privacy import make_private

    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(2000, 6, generator=g), torch.randint(0, 3, (2000,), generator=g))
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    inner = (torch.optim.Adam(model.parameters(), lr=1e-3) if optimizer.startswith("adam") else
             torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.0 if optimizer == "plain-sgd" else 0.9))  # fmt: skip
    scale = False if optimizer == "adam-unscaled" else None
    _, private, _ = make_private(model, inner, DataLoader(ds, batch_size=20), target_epsilon=3.0, delta=1e-5,
                                 epochs=2, noise_mechanism="banded", scale_adaptive_lr=scale)  # fmt: skip
    plan = plan_banded_noise(
        **RUN, workload="prefix" if optimizer == "plain-sgd" else "momentum", momentum=0.9,
        adaptive_optimizer=optimizer.startswith("adam"), scale_adaptive_lr=scale,
        bytes_per_band=4 * sum(p.numel() for p in model.parameters()),
    )  # fmt: skip
    built_bands = 1 if private._stream is None else private._stream.bands
    assert built_bands == plan.bands
    if plan.bands > 1:
        assert tuple(private.correlated_noise.coefficients) == plan.coefficients
    assert private.noise_multiplier == plan.noise_multiplier
    assert private.lr_scale == plan.lr_scale


@pytest.mark.parametrize(
    "change, match",
    [
        ({"bands": 200}, "b·q"),
        ({"sample_rate": 0.001, "bands": 300}, "exceeds the run's steps"),
        ({"workload": "adam"}, "workload"),
        ({"momentum": 1.0}, "momentum"),
        ({"scale_adaptive_lr": True}, "adaptive optimizers"),
        ({"band_coefficients": "best"}, "band_coefficients"),
        ({"accountant": "gdp"}, "gdp"),
        ({"target_epsilon": 0.0}, "target_epsilon"),
        ({"delta": 1.0}, "delta"),
        ({"sample_rate": 1.5}, "sample_rate"),
        ({"steps": 0}, "steps"),
        ({"adaptive_optimizer": 1}, "adaptive_optimizer"),
        ({"bytes_per_band": -1}, "bytes_per_band"),
    ],
)
def test_bad_arguments_are_refused_before_any_calibration(monkeypatch, change, match):
    def refuse(**kwargs):
        raise AssertionError("calibrated before the arguments were checked")

    monkeypatch.setattr(accounting, "calibrate_noise_multiplier", refuse)
    with pytest.raises(InvalidHyperparameterError, match=match):
        plan_banded_noise(**{**RUN, **change})


def test_optimised_coefficients_are_the_workloads():
    from adaclip.correlated.coefficients import optimise_banded_coefficients

    plan = plan_banded_noise(**RUN, bands=4, workload="momentum", band_coefficients="optimised")
    assert np.allclose(plan.coefficients, optimise_banded_coefficients(4, 200, workload="momentum", momentum=0.9))


def test_a_jax_run_on_the_plan_trains_within_its_budget():
    """The JAX path has no make_private: the plan gives it b, σ, the mask's rate and Adam's factor."""
    jax = pytest.importorskip("jax")
    optax = pytest.importorskip("optax")
    import jax.numpy as jnp

    import adaclip_jax

    n, q, steps = 400, 0.05, 60  # at least MIN_STEPS_FOR_BANDS: shorter runs get b = 1
    plan = plan_banded_noise(target_epsilon=4.0, delta=1e-5, sample_rate=q, steps=steps, workload="momentum",
                             adaptive_optimizer=True)  # fmt: skip
    assert plan.bands > 1 and plan.lr_scale > 1.0
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((n, 5)), jnp.float32)
    y = jnp.asarray(rng.integers(0, 2, n))
    params = {"w": jnp.zeros((5, 2))}

    def loss(p, xb, yb):
        return optax.softmax_cross_entropy_with_integer_labels(xb @ p["w"], yb)

    private = adaclip_jax.adaclip(noise_multiplier=plan.noise_multiplier, expected_batch_size=q * n,
                                  key=jax.random.key(0), noise_mechanism=plan.noise)  # fmt: skip
    tx = adaclip_jax.private_chain(private, optax.adam(1e-2 * plan.lr_scale))
    state = tx.init(params)
    assert len(state[0].noise_buffers) == plan.bands - 1
    grads_fn = adaclip_jax.per_example_grads(loss, batch_argnums=(1, 2))
    sampling_key = jax.random.key(1)
    groups = adaclip_jax.assign_groups(sampling_key, n, plan.bands)

    @jax.jit
    def train_step(params, state, *, noise_multiplier):
        mask = adaclip_jax.cyclic_poisson_mask(sampling_key, state[0].step, groups, plan.accounted_sample_rate,
                                               bands=plan.bands)  # fmt: skip
        updates, state = tx.update(grads_fn(params, x, y), state, params, noise_multiplier=noise_multiplier,
                                   unit_mask=mask)  # fmt: skip
        return optax.apply_updates(params, updates), state

    tracker = adaclip_jax.PrivacyTracker(accounting.Accountant(target_epsilon=4.0, delta=1e-5),
                                         sample_rate=q, noise_multiplier=plan.noise_multiplier, bands=plan.bands)  # fmt: skip
    for _ in range(steps):
        params, state = tracker.step(train_step, params, state)
    assert tracker.accountant.steps == plan.compositions
    assert tracker.epsilon(1e-5) <= 4.0
