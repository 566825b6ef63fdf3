"""adaclip_jax.averaging: a jitted EMA / tail average of a parameter pytree, and its optax form."""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import adaclip_jax
from adaclip.averaging import AveragingConfig, init_average, update_average
from adaclip.errors import InvalidHyperparameterError

pytestmark = pytest.mark.jax

CONFIGS = [
    AveragingConfig(kind="ema", decay=0.9),
    AveragingConfig(kind="ema", horizon=6, warmup=False, start=3),
    AveragingConfig(kind="tail", start=0),
    AveragingConfig(kind="tail", start=7),
]


def sequence(n: int, seed: int = 0, dtype=np.float32) -> list[dict[str, np.ndarray]]:
    """θ_0 … θ_n as dicts of arrays (a random walk)."""
    rng = np.random.default_rng(seed)
    theta = {"w": rng.normal(size=(3, 4)), "b": rng.normal(size=(4,))}
    out = [{k: v.astype(dtype) for k, v in theta.items()}]
    for _ in range(n):
        theta = {k: v + rng.normal(size=v.shape) for k, v in theta.items()}
        out.append({k: v.astype(dtype) for k, v in theta.items()})
    return out


def core_average(config, seq):
    avg, count = init_average({k: v.astype(np.float64) for k, v in seq[0].items()})
    for theta in seq[1:]:
        avg, count = update_average(config, avg, {k: v.astype(np.float64) for k, v in theta.items()}, count)
    return avg


@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_jitted_update_matches_core(config):
    seq = sequence(20)
    avg = adaclip_jax.parameter_averaging(config)
    traces = []

    @jax.jit
    def update(state, params):
        traces.append(1)  # a Python side effect: runs once per trace
        return avg.update(state, params)

    state = avg.init(seq[0])
    assert int(state.count) == 0 and state.count.dtype == jnp.int32
    for theta in seq[1:]:
        state = update(state, theta)
    assert len(traces) == 1  # one compiled step serves every count
    assert int(state.count) == 20
    expected = core_average(config, seq)
    for k in expected:
        assert state.average[k].dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(state.average[k]), expected[k], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_float64_matches_core_to_1e12(config):
    seq = sequence(30, seed=1, dtype=np.float64)
    with jax.enable_x64(True):
        avg = adaclip_jax.parameter_averaging(config)
        state = avg.init(seq[0])
        update = jax.jit(avg.update)
        for theta in seq[1:]:
            state = update(state, theta)
        out = {k: np.asarray(v) for k, v in state.average.items()}
    expected = core_average(config, seq)
    for k in expected:
        assert out[k].dtype == np.float64
        np.testing.assert_allclose(out[k], expected[k], rtol=0, atol=1e-12)


def test_ema_warmup_values_under_jit():
    avg = adaclip_jax.parameter_averaging("ema", decay=0.99)
    state = avg.init({"x": jnp.zeros(())})
    update = jax.jit(avg.update)
    got = []
    for _ in range(4):
        state = update(state, {"x": jnp.ones(())})
        got.append(float(state.average["x"]))
    # θ̄ = 1 − Π μ_t with μ_t = (1 + t)/(10 + t)
    mus = [1 / 10, 2 / 11, 3 / 12, 4 / 13]
    expected = [1 - np.prod(mus[: i + 1]) for i in range(4)]
    np.testing.assert_allclose(got, expected, rtol=1e-6)


@pytest.mark.torch
@pytest.mark.parametrize("kwargs", [{"kind": "ema", "horizon": 5}, {"kind": "tail", "start": 4}])
def test_torch_and_jax_give_the_same_average(kwargs):
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed")
    import torch

    from adaclip_torch import ParameterAverage

    seq = sequence(15, seed=2)
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.from_numpy(seq[0]["w"].copy()))
    model.b = torch.nn.Parameter(torch.from_numpy(seq[0]["b"].copy()))
    tavg = ParameterAverage(model, **kwargs)
    javg = adaclip_jax.parameter_averaging(kwargs["kind"], **{k: v for k, v in kwargs.items() if k != "kind"})
    assert tavg.config == javg.config
    state = javg.init(seq[0])
    update = jax.jit(javg.update)
    for theta in seq[1:]:
        with torch.no_grad():
            model.w.copy_(torch.from_numpy(theta["w"]))
            model.b.copy_(torch.from_numpy(theta["b"]))
        tavg.update()
        state = update(state, theta)
    got = tavg.averaged_parameters()
    for k in ("w", "b"):
        np.testing.assert_allclose(got[k].numpy(), np.asarray(state.average[k]), rtol=1e-6, atol=1e-6)


def test_transformation_last_in_a_private_chain():
    seq_params = []
    params = {"w": jnp.ones((3,)), "b": jnp.zeros((2,))}
    tx = adaclip_jax.private_chain(
        adaclip_jax.flat_clip(max_grad_norm=1.0, noise_multiplier=0.5, expected_batch_size=4, key=jax.random.key(0)),
        optax.sgd(0.1),
        adaclip_jax.averaging_transformation("ema", horizon=4),
    )
    opt_state = tx.init(params)
    per_example = {"w": jnp.ones((4, 3)), "b": -jnp.ones((4, 2))}

    @jax.jit
    def step(params, opt_state):
        updates, opt_state = tx.update(per_example, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    seq_params.append(params)
    for _ in range(6):
        params, opt_state = step(params, opt_state)
        seq_params.append(params)
    # the same as averaging the parameter sequence directly
    avg = adaclip_jax.parameter_averaging("ema", horizon=4)
    state = avg.init(seq_params[0])
    for p in seq_params[1:]:
        state = avg.update(state, p)
    got = adaclip_jax.averaged_params(opt_state)
    for k in params:
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(state.average[k]), rtol=1e-6)
    assert not np.allclose(np.asarray(got["w"]), np.asarray(params["w"]))  # it is an average
    assert int(opt_state[-1].count) == 6
    # the updates pass through unchanged
    grads = {"w": jnp.arange(3.0), "b": jnp.ones(2)}
    plain = optax.sgd(0.1)
    last = optax.chain(plain, adaclip_jax.averaging_transformation("tail"))
    updates_with, _ = last.update(grads, last.init(params), params)
    updates_without, _ = plain.update(grads, plain.init(params), params)
    for k in params:
        np.testing.assert_array_equal(np.asarray(updates_with[k]), np.asarray(updates_without[k]))
    with pytest.raises(InvalidHyperparameterError, match="needs params"):
        adaclip_jax.averaging_transformation("tail").update(params, adaclip_jax.parameter_averaging("tail").init(params))


def test_averaged_params_lookup():
    avg = adaclip_jax.parameter_averaging("tail")
    state = avg.init({"x": jnp.ones(2)})
    assert adaclip_jax.averaged_params(state) is state.average
    assert adaclip_jax.averaged_params((optax.EmptyState(), {"avg": state})) is state.average
    with pytest.raises(InvalidHyperparameterError, match="0 AveragingState"):
        adaclip_jax.averaged_params((optax.EmptyState(),))
    with pytest.raises(InvalidHyperparameterError, match="2 AveragingState"):
        adaclip_jax.averaged_params((state, state))


def test_dtypes_and_non_float_leaves():
    avg = adaclip_jax.parameter_averaging("tail")
    params = {"w": jnp.ones(3, jnp.bfloat16), "n": jnp.zeros((), jnp.int32)}
    state = avg.init(params)
    update = jax.jit(avg.update)
    for i in range(1, 4):
        state = update(state, {"w": jnp.full(3, float(i), jnp.bfloat16), "n": jnp.asarray(i, jnp.int32)})
    assert state.average["w"].dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(state.average["w"], np.float32), 1.75)  # mean of 1, 1, 2, 3
    assert state.average["n"].dtype == jnp.int32 and int(state.average["n"]) == 3  # follows


def test_configuration_errors():
    with pytest.raises(InvalidHyperparameterError):
        adaclip_jax.parameter_averaging("ema")  # no decay, horizon or total_steps
    with pytest.raises(InvalidHyperparameterError):
        adaclip_jax.parameter_averaging("swa", decay=0.9)
    with pytest.raises(InvalidHyperparameterError):
        adaclip_jax.parameter_averaging(AveragingConfig(kind="tail"), decay=0.9)
    with pytest.raises(InvalidHyperparameterError):
        adaclip_jax.parameter_averaging(None)
    assert adaclip_jax.parameter_averaging("ema", total_steps=300).config == AveragingConfig(kind="ema", horizon=30)
    assert adaclip_jax.parameter_averaging("tail", total_steps=300).config == AveragingConfig(kind="tail", start=270)
    assert adaclip_jax.parameter_averaging(0.95).config == AveragingConfig(kind="ema", decay=0.95)
