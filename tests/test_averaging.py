"""Parameter averaging: the core maths (adaclip.averaging) and the PyTorch ParameterAverage."""

from __future__ import annotations

import copy
import importlib.util

import numpy as np
import pytest

from adaclip.averaging import (
    AveragingConfig,
    averaging_weight,
    config_from_spec,
    default_horizon,
    ema_decay_at,
    ema_decay_for_horizon,
    ema_horizon_for_decay,
    init_average,
    update_average,
)
from adaclip.errors import InvalidHyperparameterError

HAS_TORCH = importlib.util.find_spec("torch") is not None


def iterates(n: int, shape=(7,), seed: int = 0) -> list[np.ndarray]:
    """θ_0, …, θ_n: a random walk in float64."""
    rng = np.random.default_rng(seed)
    steps = rng.normal(size=(n, *shape))
    return [np.zeros(shape)] + list(np.cumsum(steps, axis=0))


def hand_rolled_ema(thetas, mu, warmup=True, start=0):
    """θ̄_0 = θ_0; before `start` follow θ; then θ̄ = μ_t θ̄ + (1 − μ_t) θ, t from 0 at `start`."""
    avg = thetas[0].copy()
    t = 0
    for s, theta in enumerate(thetas[1:], start=1):
        if s <= start:
            avg = theta.copy()
            continue
        mu_t = min(mu, (1 + t) / (10 + t)) if warmup else mu
        avg = mu_t * avg + (1 - mu_t) * theta
        t += 1
    return avg


def run_core(config, thetas):
    avg, count = init_average(thetas[0])
    for theta in thetas[1:]:
        avg, count = update_average(config, avg, theta, count)
    return avg, count


# ---------------------------------------------------------------------------------- core maths


@pytest.mark.parametrize("warmup", [True, False])
@pytest.mark.parametrize("start", [0, 1, 6])
def test_ema_matches_hand_rolled_loop_float64(warmup, start):
    thetas = iterates(60)
    config = AveragingConfig(kind="ema", decay=0.95, start=start, warmup=warmup)
    avg, count = run_core(config, thetas)
    assert count == 60
    expected = hand_rolled_ema(thetas, 0.95, warmup=warmup, start=start)
    np.testing.assert_allclose(avg, expected, rtol=0, atol=1e-12)
    assert avg.dtype == np.float64


def test_ema_warmup_decay_values():
    assert [ema_decay_at(0.99, t) for t in range(4)] == [0.1, 2 / 11, 3 / 12, 4 / 13]
    assert ema_decay_at(0.5, 100) == 0.5  # capped at μ
    assert ema_decay_at(0.99, 5, warmup=False) == 0.99
    # (1 + t)/(10 + t) crosses μ = 0.9 at t = 80
    assert ema_decay_at(0.9, 79) < 0.9 and ema_decay_at(0.9, 80) == 0.9
    config = AveragingConfig(kind="ema", decay=0.99)
    assert [averaging_weight(config, t) for t in range(3)] == [1 - 0.1, 1 - 2 / 11, 1 - 3 / 12]
    # the first update keeps only 10 % of θ_0
    avg, _ = update_average(config, np.zeros(1), np.ones(1), 0)
    assert avg[0] == pytest.approx(0.9, abs=1e-15)


def test_weights_before_start_follow_the_parameters_exactly():
    thetas = iterates(10)
    for config in (AveragingConfig(kind="ema", decay=0.9, start=5), AveragingConfig(kind="tail", start=5)):
        avg, count = init_average(thetas[0])
        for s in range(1, 6):
            assert averaging_weight(config, count) == 1.0
            avg, count = update_average(config, avg, thetas[s], count)
            np.testing.assert_array_equal(avg, thetas[s])  # bit for bit
        assert averaging_weight(config, count) < 1.0


@pytest.mark.parametrize("start", [0, 1, 13, 40])
def test_tail_average_is_the_mean_of_the_tail_iterates(start):
    thetas = iterates(40)
    avg, count = run_core(AveragingConfig(kind="tail", start=start), thetas)
    assert count == 40
    np.testing.assert_allclose(avg, np.mean(thetas[start:], axis=0), rtol=0, atol=1e-12)


def test_tail_running_mean_at_every_step():
    thetas = iterates(12)
    config = AveragingConfig(kind="tail", start=3)
    avg, count = init_average(thetas[0])
    for s in range(1, 13):
        avg, count = update_average(config, avg, thetas[s], count)
        np.testing.assert_allclose(avg, np.mean(thetas[min(s, 3) : s + 1], axis=0), atol=1e-12)


def test_horizon_to_decay_mapping():
    assert ema_decay_for_horizon(100) == pytest.approx(0.99, abs=1e-15)
    assert ema_decay_for_horizon(1) == 0.0  # H = 1: the last iterate
    assert ema_horizon_for_decay(0.99) == pytest.approx(100)
    assert ema_horizon_for_decay(ema_decay_for_horizon(37.5)) == pytest.approx(37.5)
    by_h = AveragingConfig(kind="ema", horizon=20)
    by_mu = AveragingConfig(kind="ema", decay=0.95)
    assert by_h.effective_decay == pytest.approx(by_mu.effective_decay, abs=1e-15)
    thetas = iterates(30)
    np.testing.assert_allclose(run_core(by_h, thetas)[0], run_core(by_mu, thetas)[0], atol=1e-12)
    for bad in (0.5, 0, -3, float("inf"), float("nan"), "10", True):
        with pytest.raises(InvalidHyperparameterError):
            ema_decay_for_horizon(bad)
    for bad in (1.0, -0.1, 1.5, float("nan"), None):
        with pytest.raises(InvalidHyperparameterError):
            ema_horizon_for_decay(bad)


def test_default_horizon():
    assert [default_horizon(t) for t in (1, 5, 10, 50, 100, 101, 1000, 10**6)] == [
        1,
        5,
        10,
        10,
        10,
        11,
        100,
        10**5,
    ]
    for bad in (0, -1, 2.5, "100", None, True):
        with pytest.raises(InvalidHyperparameterError):
            default_horizon(bad)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"kind": "swa"},
        {"kind": "ema"},  # neither decay nor horizon
        {"kind": "ema", "decay": 0.9, "horizon": 10},
        {"kind": "ema", "decay": 1.0},
        {"kind": "ema", "decay": -0.1},
        {"kind": "ema", "decay": True},
        {"kind": "ema", "horizon": 0.5},
        {"kind": "ema", "horizon": float("inf")},
        {"kind": "tail", "decay": 0.9},
        {"kind": "tail", "horizon": 10},
        {"kind": "tail", "start": -1},
        {"kind": "tail", "start": 2.5},
        {"kind": "ema", "decay": 0.9, "warmup": 1},
    ],
)
def test_config_validation(kwargs):
    with pytest.raises(InvalidHyperparameterError):
        AveragingConfig(**kwargs)


def test_config_is_frozen_and_normalised():
    config = AveragingConfig(kind="ema", horizon=10, start=np.int64(3))
    assert config.horizon == 10.0 and config.start == 3 and type(config.start) is int
    with pytest.raises(AttributeError):
        config.start = 4  # type: ignore[misc]


def test_config_from_spec():
    assert config_from_spec(None) is None
    assert config_from_spec("ema", 1000) == AveragingConfig(kind="ema", horizon=100)
    assert config_from_spec("tail", 1000) == AveragingConfig(kind="tail", start=900)
    assert config_from_spec(0.999) == AveragingConfig(kind="ema", decay=0.999)
    config = AveragingConfig(kind="tail", start=7)
    assert config_from_spec(config, 10) is config
    assert config_from_spec({"kind": "ema", "warmup": False}, 200) == AveragingConfig(
        kind="ema", horizon=20, warmup=False
    )
    assert config_from_spec({"kind": "tail", "start": 4}) == AveragingConfig(kind="tail", start=4)
    for bad in ("ema", "tail", {"kind": "ema"}):  # need total_steps
        with pytest.raises(InvalidHyperparameterError):
            config_from_spec(bad)
    for bad in ("swa", 1.5, 3, True, [0.9], {"kind": "ema", "decay": 0.9, "bogus": 1}):
        with pytest.raises(InvalidHyperparameterError):
            config_from_spec(bad, 100)


def test_update_is_pure_and_takes_structures():
    config = AveragingConfig(kind="ema", decay=0.5, warmup=False)
    params = {"w": np.ones((2, 2)), "b": [np.zeros(3), np.full(1, 4.0)]}
    avg, count = init_average(params)
    assert avg["w"] is not params["w"]
    params["w"][:] = 100.0  # the average is a copy
    assert avg["w"][0, 0] == 1.0
    new = {"w": np.full((2, 2), 3.0), "b": [np.full(3, 2.0), np.zeros(1)]}
    before = copy.deepcopy(avg)
    out, count = update_average(config, avg, new, count)
    assert count == 1
    np.testing.assert_array_equal(avg["w"], before["w"])  # nothing modified in place
    np.testing.assert_allclose(out["w"], 2.0)
    np.testing.assert_allclose(out["b"][0], 1.0)
    np.testing.assert_allclose(out["b"][1], 2.0)
    with pytest.raises(InvalidHyperparameterError):
        update_average(config, avg, {"w": np.ones((2, 2))}, count)
    with pytest.raises(InvalidHyperparameterError):
        update_average({"kind": "ema"}, avg, new, count)


@pytest.mark.parametrize(
    "config",
    [
        AveragingConfig(kind="ema", decay=0.97),
        AveragingConfig(kind="ema", decay=0.97, warmup=False, start=4),
        AveragingConfig(kind="tail", start=5),
    ],
)
def test_array_weight_equals_scalar_weight(config):
    counts = np.arange(0, 200)
    w = averaging_weight(config, counts, dtype=np.float64)
    np.testing.assert_allclose(w, [averaging_weight(config, int(c)) for c in counts], rtol=1e-15)


# ---------------------------------------------------------------------------------- PyTorch


def _torch():
    return pytest.importorskip("torch")


def _model(torch, dtype=None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    model.register_buffer("scale", torch.tensor([2.0]))
    model[0].bias.requires_grad_(False)  # frozen: not averaged
    return model.to(dtype) if dtype is not None else model


def _perturb(torch, model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype))


def _snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()} | {
        n: b.detach().clone() for n, b in model.named_buffers()
    }


def _assert_same(torch, a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


@pytest.mark.parametrize(
    "kwargs",
    [
        {"kind": "ema", "decay": 0.9},
        {"kind": "ema", "horizon": 8, "warmup": False, "start": 3},
        {"kind": "tail", "start": 4},
        {"kind": "tail"},
    ],
)
@pytest.mark.torch
@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")
def test_torch_update_matches_core_float64(kwargs):
    torch = _torch()
    from adaclip_torch import ParameterAverage

    model = _model(torch, torch.float64)
    avg = ParameterAverage(model, **kwargs)
    assert avg.names == ("0.weight", "2.weight", "2.bias")
    seq = [[p.detach().numpy().copy() for p in avg._params]]
    for s in range(25):
        _perturb(torch, model, s)
        avg.update()
        seq.append([p.detach().numpy().copy() for p in avg._params])
    core, count = init_average(seq[0])
    for theta in seq[1:]:
        core, count = update_average(avg.config, core, theta, count)
    assert avg.count == count == 25
    for name, expected in zip(avg.names, core, strict=True):
        got = avg.averaged_parameters()[name]
        assert got.dtype == torch.float64
        np.testing.assert_allclose(got.numpy(), expected, rtol=0, atol=1e-12)
    if kwargs["kind"] == "ema" and "decay" in kwargs:
        hand = [hand_rolled_ema([t[i] for t in seq], 0.9) for i in range(3)]
        for name, expected in zip(avg.names, hand, strict=True):
            np.testing.assert_allclose(avg.averaged_parameters()[name].numpy(), expected, atol=1e-12)


@pytest.mark.torch
@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")
def test_torch_averaged_swaps_and_restores_bit_for_bit():
    torch = _torch()
    from adaclip_torch import ParameterAverage

    model = _model(torch)
    avg = ParameterAverage(model, decay=0.8)
    for s in range(5):
        _perturb(torch, model, s)
        avg.update()
    live = _snapshot(model)
    averaged = avg.averaged_parameters()
    ids = [id(p) for p in model.parameters()]
    ptrs = [p.data_ptr() for p in model.parameters()]
    with avg.averaged() as m:
        assert m is model
        inside = dict(model.named_parameters())
        for name, value in averaged.items():
            assert torch.equal(inside[name], value)
        assert not torch.equal(inside["2.bias"], live["2.bias"])
        assert torch.equal(inside["0.bias"], live["0.bias"])  # frozen: untouched
        assert torch.equal(model.scale, live["scale"])  # buffers: untouched
        with torch.no_grad():
            model[2].bias.add_(1.0)  # discarded on exit
        with pytest.raises(InvalidHyperparameterError, match="inside averaged"):
            avg.update()
    _assert_same(torch, _snapshot(model), live)
    assert [id(p) for p in model.parameters()] == ids
    assert [p.data_ptr() for p in model.parameters()] == ptrs
    assert avg.count == 5

    with pytest.raises(RuntimeError, match="boom"):
        with avg.averaged():
            raise RuntimeError("boom")
    _assert_same(torch, _snapshot(model), live)
    avg.update()  # usable again after the exception
    assert avg.count == 6


@pytest.mark.torch
@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")
def test_torch_state_dict_round_trip():
    torch = _torch()
    from adaclip_torch import ParameterAverage

    model = _model(torch)
    avg = ParameterAverage(model, kind="ema", horizon=10)
    for s in range(7):
        _perturb(torch, model, s)
        avg.update()
    state = avg.state_dict()
    assert state["count"] == 7 and set(state["average"]) == set(avg.names)
    # the state is a copy
    state["average"]["2.bias"].add_(0.0)
    assert state["average"]["2.bias"] is not avg._average[2]

    other_model = copy.deepcopy(model)
    other = ParameterAverage(other_model, kind="ema", horizon=10)
    other.load_state_dict(state)
    assert other.count == 7
    _assert_same(torch, other.averaged_parameters(), avg.averaged_parameters())
    # both continue identically
    for s in range(7, 10):
        _perturb(torch, model, s)
        _perturb(torch, other_model, s)
        avg.update()
        other.update()
    _assert_same(torch, other.averaged_parameters(), avg.averaged_parameters())
    # it survives torch.save/torch.load
    import io

    buf = io.BytesIO()
    torch.save(avg.state_dict(), buf)
    buf.seek(0)
    other.load_state_dict(torch.load(buf))
    _assert_same(torch, other.averaged_parameters(), avg.averaged_parameters())


def _bad_states(torch, state):
    def edit(fn):
        s = copy.deepcopy(state)
        fn(s)
        return s

    yield "not a dict", [state]
    yield "missing key", edit(lambda s: s.pop("count"))
    yield "extra key", edit(lambda s: s.update(accumulated=None))
    yield "other config", edit(lambda s: s["config"].update(horizon=11.0))
    yield "other kind", edit(lambda s: s.update(config={**s["config"], "kind": "tail"}))
    yield "negative count", edit(lambda s: s.update(count=-1))
    yield "float count", edit(lambda s: s.update(count=2.5))
    yield "bool count", edit(lambda s: s.update(count=True))
    yield "missing name", edit(lambda s: s["average"].pop("2.bias"))
    yield "extra name", edit(lambda s: s["average"].update({"0.bias": torch.zeros(5)}))
    yield "wrong shape", edit(lambda s: s["average"].update({"2.bias": torch.zeros(4)}))
    yield "not a tensor", edit(lambda s: s["average"].update({"2.bias": [0.0, 0.0, 0.0]}))
    yield "nan", edit(lambda s: s["average"]["2.weight"].__setitem__((0, 0), float("nan")))
    yield "inf last", edit(lambda s: s["average"]["2.bias"].fill_(float("inf")))


@pytest.mark.torch
@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")
def test_torch_bad_state_refused_with_nothing_changed():
    torch = _torch()
    from adaclip_torch import ParameterAverage

    model = _model(torch)
    avg = ParameterAverage(model, kind="ema", horizon=10)
    for s in range(4):
        _perturb(torch, model, s)
        avg.update()
    good = avg.state_dict()
    # a different, valid state to load into: every refusal must leave it as it is
    for s in range(4, 6):
        _perturb(torch, model, s)
        avg.update()
    before, count = avg.averaged_parameters(), avg.count
    for why, bad in _bad_states(torch, good):
        with pytest.raises(InvalidHyperparameterError):
            avg.load_state_dict(bad)
        assert avg.count == count, why
        _assert_same(torch, avg.averaged_parameters(), before)
    avg.load_state_dict(good)  # the good one still loads
    assert avg.count == 4


@pytest.mark.torch
@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")
def test_torch_attach_plain_sgd_updates_once_per_step():
    torch = _torch()
    from adaclip_torch import ParameterAverage

    model = _model(torch, torch.float64)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    avg = ParameterAverage(model, kind="tail")
    avg.attach(opt)
    avg.attach(opt)  # attaching again moves the hook: still one update per step
    seq = [[p.detach().clone() for p in avg._params]]
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randint(0, 3, (8,))
    for step in range(1, 6):
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        assert avg.count == step
        seq.append([p.detach().clone() for p in avg._params])
    for i, name in enumerate(avg.names):
        expected = torch.stack([s[i] for s in seq]).mean(0)
        torch.testing.assert_close(avg.averaged_parameters()[name], expected, rtol=0, atol=1e-12)
    avg.detach()
    opt.step()
    assert avg.count == 5


@pytest.mark.torch
@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")
def test_torch_attach_dp_optimizer_updates_once_per_private_step():
    torch = _torch()
    from adaclip_torch import FlatClip, ParameterAverage

    model = _model(torch)
    inner = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    opt = FlatClip(inner, model, noise_multiplier=0.0, max_grad_norm=1.0, expected_batch_size=8)
    # The wrapper has no hook registry of its own (it does not run Optimizer.__init__) ...
    with pytest.raises(AttributeError):
        opt.register_step_post_hook(lambda *a: None)
    avg = ParameterAverage(model, kind="ema", decay=0.5)
    handle = avg.attach(opt)  # ... so attach() hooks the wrapped optimizer
    assert handle.hooks_dict_ref() is inner._optimizer_step_post_hooks
    torch.manual_seed(1)
    expected = [p.detach().clone() for p in avg._params]
    for step in range(1, 5):
        x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
        torch.nn.functional.cross_entropy(model(x), y).backward()
        before = [p.detach().clone() for p in avg._params]
        opt.step()
        opt.zero_grad()
        assert avg.count == step
        assert any(not torch.equal(b, p) for b, p in zip(before, avg._params, strict=True))
        w = averaging_weight(avg.config, step - 1)
        expected = [(1 - w) * e + w * p.detach() for e, p in zip(expected, avg._params, strict=True)]
    for name, e in zip(avg.names, expected, strict=True):
        torch.testing.assert_close(avg.averaged_parameters()[name], e)
    # a virtual step (accumulate) releases nothing and does not update the average
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.accumulate()
    assert avg.count == 4
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    assert avg.count == 5


@pytest.mark.torch
@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")
def test_torch_copy_to_and_layout_checks():
    torch = _torch()
    from adaclip_torch import ParameterAverage

    model = _model(torch)
    avg = ParameterAverage(model, decay=0.5, warmup=False)
    _perturb(torch, model, 0)
    avg.update()
    target = _model(torch)
    avg.copy_to(target)
    for name, value in avg.averaged_parameters().items():
        assert torch.equal(dict(target.named_parameters())[name], value)
    wrong = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    before = _snapshot(wrong)
    with pytest.raises(InvalidHyperparameterError, match="shape"):
        avg.copy_to(wrong)
    _assert_same(torch, _snapshot(wrong), before)  # nothing written
    live = _snapshot(model)
    avg.copy_to()  # into the averaged model itself
    assert torch.equal(model[2].bias, avg.averaged_parameters()["2.bias"])
    assert not torch.equal(model[2].bias, live["2.bias"])
    model.double()
    with pytest.raises(InvalidHyperparameterError, match="changed"):
        avg.update()
    assert avg.count == 1


@pytest.mark.torch
@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")
def test_torch_keeps_dtype_and_constructors():
    torch = _torch()
    from adaclip_torch import ParameterAverage

    model = _model(torch, torch.bfloat16)
    avg = ParameterAverage(model, horizon=4)
    _perturb(torch, model, 0)
    avg.update()
    assert all(a.dtype == torch.bfloat16 for a in avg.averaged_parameters().values())

    assert ParameterAverage.from_spec(model, None, 100) is None
    assert ParameterAverage.from_spec(model, "ema", 1000).config == AveragingConfig(kind="ema", horizon=100)
    assert ParameterAverage.from_spec(model, "tail", 1000).config == AveragingConfig(kind="tail", start=900)
    assert ParameterAverage.from_spec(model, 0.9).config.decay == 0.9
    config = AveragingConfig(kind="tail", start=3)
    assert ParameterAverage.from_spec(model, config).config is config
    assert ParameterAverage(model, total_steps=500).config == AveragingConfig(kind="ema", horizon=50)
    assert ParameterAverage(model, kind="tail", total_steps=500).config.start == 450
    assert "ema" in repr(ParameterAverage(model, decay=0.9))
    with pytest.raises(InvalidHyperparameterError):
        ParameterAverage(model)  # an EMA without decay, horizon or total_steps
    with pytest.raises(InvalidHyperparameterError):
        ParameterAverage.from_spec(model, "ema")
    with pytest.raises(InvalidHyperparameterError):
        ParameterAverage(torch.nn.ReLU(), decay=0.9)  # nothing to average
    with pytest.raises(InvalidHyperparameterError):
        ParameterAverage("model", decay=0.9)


@pytest.mark.torch
@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")
def test_core_update_on_torch_tensors():
    torch = _torch()
    config = AveragingConfig(kind="ema", decay=0.9)
    params = [torch.ones(3, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)]
    avg, count = init_average(params)
    params[0].add_(1.0)  # a copy: unaffected
    out, count = update_average(config, avg, [torch.full((3,), 3.0, dtype=torch.float64), params[1]], count)
    torch.testing.assert_close(out[0], torch.full((3,), 0.1 * 1.0 + 0.9 * 3.0, dtype=torch.float64))
    assert count == 1


@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")
def test_example_runs():
    import os
    import pathlib
    import subprocess
    import sys

    pytest.importorskip("sklearn")
    root = pathlib.Path(__file__).resolve().parents[1]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.run(
        [sys.executable, str(root / "examples" / "averaging_torch.py"), "--epochs", "2"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "last iterate" in proc.stdout and "averaged" in proc.stdout
