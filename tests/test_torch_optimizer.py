"""The DPOptimizer wrapper against adaclip.reference, and its failure atomicity.

Per-example gradients come from the one-backward-per-example test double (attach_hooks=False),
so these tests exercise the wrapper alone; tests/test_torch_opt_engine.py runs the real hooks.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_torch_opt_support import FakeAccountant, batch, flat, flat_vec, mlp, set_microbatch_grad_sample
from torch import nn

from adaclip import reference
from adaclip.errors import (
    BudgetExceededError,
    InvalidGradientError,
    InvalidHyperparameterError,
    NoiseReplayWarning,
)
from adaclip.schedules import LinearNoiseDecay
from adaclip_torch import AdaClip, DPOptimizer, FlatClip, NoiseSource, PerLayerClip, ScaledClip

LOSS = nn.CrossEntropyLoss()
STD_MIN, STD_MAX = 1e-3, 2.0


def params_of(opt: DPOptimizer) -> list[torch.Tensor]:
    return opt.params


def backward(model, opt, x, y):
    return set_microbatch_grad_sample(model, opt.params, LOSS, x, y)


def adaclip(model, *, inner=None, **kw) -> AdaClip:
    inner = inner or torch.optim.SGD(model.parameters(), lr=0.1)
    kw.setdefault("noise_multiplier", 0.0)
    kw.setdefault("expected_batch_size", 8)
    return AdaClip(inner, model, std_min=STD_MIN, std_max=STD_MAX, attach_hooks=False, **kw, preset="patent")


# --------------------------------------------------------------------------- equality with the reference


@pytest.mark.parametrize("sigma", [0.0, 1.3])
def test_adaclip_steps_match_reference(sigma):
    model = mlp(0)
    opt = adaclip(model, noise_multiplier=sigma, expected_batch_size=6.5, seed=11)
    twin_noise = NoiseSource(seed=11)
    d = sum(p.numel() for p in opt.params)
    mean = np.zeros(d)
    std = np.full(d, np.sqrt(STD_MIN * STD_MAX))
    for t in range(3):
        x, y = batch(t, n=5 + t)
        per_example = backward(model, opt, x, y)
        z = flat_vec(twin_noise.standard_normal(opt.params))
        expected, mean, std = reference.adaclip_step(
            flat(per_example), mean, std, z, noise_multiplier=sigma, expected_batch_size=6.5,
            std_min=STD_MIN, std_max=STD_MAX,
        )
        opt.step()
        np.testing.assert_allclose(flat_vec(p.grad for p in opt.params), expected, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(flat_vec(opt.clip_state.mean), mean, rtol=1e-10, atol=1e-14)
        np.testing.assert_allclose(flat_vec(opt.clip_state.std), std, rtol=1e-10, atol=1e-14)
        opt.zero_grad()
    assert opt.steps == 3


def test_adaclip_float32_matches_reference_loosely():
    model = mlp(1, dtype=torch.float32)
    opt = adaclip(model)
    assert opt.clip_state.std[0].dtype == torch.float32
    x, y = batch(3, dtype=torch.float32)
    per_example = backward(model, opt, x, y)
    d = sum(p.numel() for p in opt.params)
    expected, _, _ = reference.adaclip_step(
        flat(per_example), np.zeros(d), np.full(d, np.sqrt(STD_MIN * STD_MAX)), np.zeros(d),
        noise_multiplier=0.0, expected_batch_size=8, std_min=STD_MIN, std_max=STD_MAX,
    )
    opt.step()
    np.testing.assert_allclose(flat_vec(p.grad for p in opt.params), expected, rtol=2e-4, atol=1e-6)


def test_float64_params_keep_float64_statistics():
    opt = adaclip(mlp(0))
    assert all(s.dtype == torch.float64 for s in opt.clip_state.std)


@pytest.mark.parametrize("sigma", [0.0, 0.7])
def test_flat_clip_matches_reference(sigma):
    model = mlp(2)
    opt = FlatClip(torch.optim.SGD(model.parameters(), lr=0.1), model, max_grad_norm=0.3,
                   noise_multiplier=sigma, expected_batch_size=10, seed=5, attach_hooks=False)
    z = flat_vec(NoiseSource(seed=5).standard_normal(opt.params))
    x, y = batch(4, n=9)
    per_example = backward(model, opt, x, y)
    expected = reference.flat_clip_step(flat(per_example), z, max_grad_norm=0.3, noise_multiplier=sigma,
                                        expected_batch_size=10)
    opt.step()
    np.testing.assert_allclose(flat_vec(p.grad for p in opt.params), expected, rtol=1e-10, atol=1e-13)


def test_per_layer_and_scaled_clip_match_reference():
    model = mlp(3)
    x, y = batch(5)
    sizes = [p.numel() for p in model.parameters()]
    pl = PerLayerClip(torch.optim.SGD(model.parameters(), lr=0.0), model, max_grad_norm=0.5,
                      noise_multiplier=0.9, expected_batch_size=8, seed=1, attach_hooks=False)
    z = flat_vec(NoiseSource(seed=1).standard_normal(pl.params))
    per_example = backward(model, pl, x, y)
    expected = reference.per_layer_clip_step(flat(per_example), z, groups=sizes, max_grad_norm=0.5,
                                             noise_multiplier=0.9, expected_batch_size=8)
    pl.step()
    np.testing.assert_allclose(flat_vec(p.grad for p in pl.params), expected, rtol=1e-10, atol=1e-13)

    scales = [1.0, 0.5, 2.0, 0.25]
    sc = ScaledClip(torch.optim.SGD(model.parameters(), lr=0.0), model, max_grad_norm=0.5, layer_scales=scales,
                    noise_multiplier=0.9, expected_batch_size=8, seed=1, attach_hooks=False)
    backward(model, sc, x, y)
    expected = reference.scaled_clip_step(flat(per_example), z, groups=sizes, layer_scales=scales,
                                          max_grad_norm=0.5, noise_multiplier=0.9, expected_batch_size=8)
    sc.step()
    np.testing.assert_allclose(flat_vec(p.grad for p in sc.params), expected, rtol=1e-10, atol=1e-13)


def test_scaled_clip_wrong_number_of_scales_rejected():
    model = mlp(0)
    with pytest.raises(InvalidHyperparameterError, match="layer_scales"):
        ScaledClip(torch.optim.SGD(model.parameters(), lr=0.1), model, max_grad_norm=1.0, layer_scales=[1.0],
                   noise_multiplier=1.0, expected_batch_size=4, attach_hooks=False)


def test_noise_schedule_sigma_used_per_step():
    model = mlp(0)
    schedule = LinearNoiseDecay(initial_noise_multiplier=2.0, decay_rate=1.0, steps_per_epoch=1)
    acct = FakeAccountant(max_steps=10)
    opt = FlatClip(torch.optim.SGD(model.parameters(), lr=0.1), model, max_grad_norm=1.0, noise_schedule=schedule,
                   expected_batch_size=8, accountant=acct, sample_rate=0.1, seed=0, attach_hooks=False)
    for t in range(3):
        backward(model, opt, *batch(t))
        opt.step()
    assert [h[0] for h in acct.history] == [2.0, 1.0, 2.0 / 3.0]
    assert all(h[1] == 0.1 for h in acct.history)


def test_user_level_units_sum_before_clipping():
    model = mlp(4)
    opt = adaclip(model, expected_batch_size=3)
    x, y = batch(6, n=7)
    per_example = backward(model, opt, x, y)
    user_ids = torch.tensor([5, 2, 5, 9, 2, 2, 9])
    g = flat(per_example)
    users = np.stack([g[user_ids.numpy() == u].sum(0) for u in (2, 5, 9)])
    d = g.shape[1]
    expected, _, _ = reference.adaclip_step(users, np.zeros(d), np.full(d, np.sqrt(STD_MIN * STD_MAX)),
                                            np.zeros(d), noise_multiplier=0.0, expected_batch_size=3,
                                            std_min=STD_MIN, std_max=STD_MAX)
    opt.step(user_ids=user_ids)
    np.testing.assert_allclose(flat_vec(p.grad for p in opt.params), expected, rtol=1e-10, atol=1e-13)


def test_user_ids_of_wrong_length_rejected_without_change():
    model = mlp(4)
    opt = adaclip(model)
    backward(model, opt, *batch(1))
    snap = Snapshot(model, opt)
    with pytest.raises(InvalidGradientError, match="user_ids"):
        opt.step(user_ids=torch.arange(3))
    snap.assert_unchanged(model, opt)


# --------------------------------------------------------------------------- virtual steps


@pytest.mark.parametrize("sigma", [0.0, 1.0])
def test_virtual_steps_equal_one_big_step(sigma):
    x, y = batch(7, n=12)
    big_model = mlp(5)
    big = adaclip(big_model, noise_multiplier=sigma, expected_batch_size=12, seed=3)
    backward(big_model, big, x, y)
    big.step()

    model = mlp(5)
    opt = adaclip(model, noise_multiplier=sigma, expected_batch_size=12, seed=3)
    for sl in (slice(0, 5), slice(5, 9)):
        backward(model, opt, x[sl], y[sl])
        opt.accumulate()
        assert all(getattr(p, "grad_sample", None) is None for p in model.parameters())
        assert opt.steps == 0
    backward(model, opt, x[9:], y[9:])
    opt.step()
    for a, b in zip(big_model.parameters(), model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    for a, b in zip(big.clip_state.std, opt.clip_state.std):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_step_after_accumulate_without_new_backward_releases_buffer():
    x, y = batch(7, n=6)
    ref_model = mlp(5)
    ref = adaclip(ref_model)
    backward(ref_model, ref, x, y)
    ref.step()
    model = mlp(5)
    opt = adaclip(model)
    backward(model, opt, x, y)
    opt.accumulate()
    opt.step()
    for a, b in zip(ref_model.parameters(), model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------- optimizers, schedulers


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    lambda ps: torch.optim.Adam(ps, lr=1e-2),
    lambda ps: torch.optim.Adagrad(ps, lr=0.1),
])
def test_wrapped_optimizer_steps_on_noisy_grad(make):
    model = mlp(6)
    twin = copy.deepcopy(model)
    twin_inner = make(twin.parameters())
    opt = adaclip(model, inner=make(model.parameters()), noise_multiplier=0.8, seed=2)
    for t in range(3):
        backward(model, opt, *batch(t))
        opt.step()
        # The same optimizer stepped on the released gradients gives the same parameters.
        for p, q in zip(opt.params, twin.parameters()):
            q.grad = p.grad.clone()
        twin_inner.step()
        opt.zero_grad()
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert len(opt.state) == 4  # forwarded: the wrapped optimizer's per-parameter state


def test_lr_scheduler_drives_wrapped_optimizer():
    model = mlp(0)
    opt = adaclip(model, inner=torch.optim.SGD(model.parameters(), lr=1.0))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for t in range(2):
        backward(model, opt, *batch(t))
        opt.step()
        sched.step()
    assert opt.original_optimizer.param_groups[0]["lr"] == pytest.approx(0.25)
    assert opt.param_groups is opt.original_optimizer.param_groups
    assert opt.defaults is opt.original_optimizer.defaults


def test_closure_is_called_and_its_loss_returned():
    model = mlp(0)
    opt = adaclip(model)
    x, y = batch(0)

    def closure():
        backward(model, opt, x, y)
        return torch.tensor(1.5)

    assert opt.step(closure) == 1.5
    assert opt.steps == 1


def test_zero_grad_clears_grad_and_grad_sample():
    model = mlp(0)
    opt = adaclip(model)
    backward(model, opt, *batch(0))
    opt.zero_grad()
    assert all(p.grad is None and getattr(p, "grad_sample", None) is None for p in model.parameters())


def test_add_param_group_unsupported():
    model = mlp(0)
    opt = adaclip(model)
    with pytest.raises(InvalidHyperparameterError, match="add_param_group"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})


def test_frozen_parameters_left_alone():
    model = mlp(0)
    model[0].weight.requires_grad_(False)
    opt = adaclip(model, inner=torch.optim.SGD(model.parameters(), lr=0.1))
    assert len(opt.params) == 3 and all(p is not model[0].weight for p in opt.params)
    before = model[0].weight.clone()
    backward(model, opt, *batch(0))
    opt.step()
    assert torch.equal(model[0].weight, before)


def test_param_not_in_model_rejected():
    model = mlp(0)
    stray = nn.Parameter(torch.zeros(3, dtype=torch.float64))
    with pytest.raises(InvalidHyperparameterError, match="not a parameter of model"):
        adaclip(model, inner=torch.optim.SGD([*model.parameters(), stray], lr=0.1))


@pytest.mark.parametrize("kwargs, match", [
    ({"noise_multiplier": -1.0}, "noise_multiplier"),
    ({"expected_batch_size": 0}, "expected_batch_size"),
    ({"accountant": FakeAccountant(3)}, "sample_rate"),
    ({"sample_rate": 1.5}, "sample_rate"),
    ({"loss_reduction": "max"}, "loss_reduction"),
])
def test_bad_hyperparameters_rejected(kwargs, match):
    with pytest.raises(InvalidHyperparameterError, match=match):
        adaclip(mlp(0), **kwargs)


# --------------------------------------------------------------------------- failure atomicity


class Snapshot:
    """Everything a failed step must leave untouched."""

    def __init__(self, model, opt):
        self.params = [p.detach().clone() for p in model.parameters()]
        self.grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
        self.grad_samples = [getattr(p, "grad_sample", None) for p in model.parameters()]
        self.grad_samples = [None if g is None else g.clone() for g in self.grad_samples]
        self.opt_state = copy.deepcopy(opt.original_optimizer.state_dict())
        self.clip = copy.deepcopy(opt.state_dict()["clip_state"])
        self.steps = opt.steps
        self.rng = opt.noise_source.get_state().clone()
        self.acct = None if opt.accountant is None else copy.deepcopy(opt.accountant.state_dict())

    def assert_unchanged(self, model, opt):
        for p, q in zip(model.parameters(), self.params):
            assert torch.equal(p, q)
        for p, g in zip(model.parameters(), self.grads):
            assert (p.grad is None and g is None) or torch.equal(p.grad, g)
        for p, g in zip(model.parameters(), self.grad_samples):
            gs = getattr(p, "grad_sample", None)
            assert (gs is None and g is None) or torch.equal(torch.nan_to_num(gs), torch.nan_to_num(g))
        assert str(opt.original_optimizer.state_dict()) == str(self.opt_state)
        clip = opt.state_dict()["clip_state"]
        assert clip["step"] == self.clip["step"]
        for key in ("mean", "std"):
            if self.clip[key] is not None:
                assert all(torch.equal(a, b) for a, b in zip(clip[key], self.clip[key]))
        assert opt.steps == self.steps
        assert torch.equal(opt.noise_source.get_state(), self.rng)
        if self.acct is not None:
            assert opt.accountant.state_dict() == self.acct


def _adam_adaclip_after_one_step(**kw):
    model = mlp(8)
    opt = adaclip(model, inner=torch.optim.Adam(model.parameters(), lr=1e-2), noise_multiplier=1.0, seed=4, **kw)
    backward(model, opt, *batch(0))
    opt.step()
    opt.zero_grad()
    return model, opt


def test_nan_per_example_grads_in_debug_mode_raise_and_change_nothing():
    model, opt = _adam_adaclip_after_one_step()
    opt.nonfinite = "raise"
    backward(model, opt, *batch(1))
    model[0].weight.grad_sample[2, 1, 1] = float("nan")
    snap = Snapshot(model, opt)
    with pytest.raises(InvalidGradientError, match="'0.weight' contain NaN"):
        opt.step()
    snap.assert_unchanged(model, opt)


def test_step_without_backward_changes_nothing():
    model, opt = _adam_adaclip_after_one_step()
    snap = Snapshot(model, opt)
    with pytest.raises(InvalidGradientError, match="without backward"):
        opt.step()
    snap.assert_unchanged(model, opt)


def test_wrong_shapes_change_nothing():
    model, opt = _adam_adaclip_after_one_step()
    backward(model, opt, *batch(1))
    model[2].bias.grad_sample = model[2].bias.grad_sample[:3]
    snap = Snapshot(model, opt)
    with pytest.raises(InvalidGradientError):
        opt.step()
    snap.assert_unchanged(model, opt)


def test_partially_missing_grad_sample_names_the_parameter():
    model, opt = _adam_adaclip_after_one_step()
    backward(model, opt, *batch(1))
    model[2].bias.grad_sample = None
    snap = Snapshot(model, opt)
    with pytest.raises(InvalidGradientError, match="2.bias"):
        opt.step()
    snap.assert_unchanged(model, opt)


def test_budget_stop_raises_before_the_step():
    model, opt = _adam_adaclip_after_one_step(accountant=FakeAccountant(max_steps=1), sample_rate=0.05)
    backward(model, opt, *batch(1))
    snap = Snapshot(model, opt)
    with pytest.raises(BudgetExceededError):
        opt.step()
    snap.assert_unchanged(model, opt)
    assert len(opt.accountant.history) == 1


def test_failing_wrapped_optimizer_still_counts_the_step_as_released():
    """The wrapped optimizer (or a hook on it) saw the noisy gradient before it raised: the
    step is accounted, the state moves on and the generator is not rewound, so a retry draws
    fresh noise (reusing the draw would let two releases' difference cancel it)."""
    model, opt = _adam_adaclip_after_one_step(accountant=FakeAccountant(max_steps=10), sample_rate=0.05)
    backward(model, opt, *batch(1))
    snap = Snapshot(model, opt)

    def boom(*args, **kwargs):
        raise RuntimeError("inner optimizer failed")

    opt.original_optimizer.step = boom
    with pytest.raises(RuntimeError, match="inner optimizer failed"):
        opt.step()
    assert opt.steps == snap.steps + 1 and len(opt.accountant.history) == len(snap.acct["history"]) + 1
    assert not torch.equal(opt.noise_source.get_state(), snap.rng)
    assert opt.state_dict()["clip_state"]["step"] == snap.clip["step"] + 1
    assert all(getattr(p, "grad_sample", None) is None for p in model.parameters())


# --------------------------------------------------------------------------- checkpoints


def _train(model, opt, sched, steps):
    for t in steps:
        backward(model, opt, *batch(100 + t))
        opt.step()
        sched.step()
        opt.zero_grad()


def _fresh(seed_model=9):
    model = mlp(seed_model)
    acct = FakeAccountant(max_steps=100)
    opt = adaclip(model, inner=torch.optim.Adam(model.parameters(), lr=1e-2), noise_multiplier=1.1, seed=123,
                  accountant=acct, sample_rate=0.1)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)
    return model, opt, sched


def test_resume_from_checkpoint_is_bit_for_bit(tmp_path):
    """With an explicit seed (experiments) the generator is checkpointed: bit-for-bit resume,
    and the restore warns that the noise replays."""
    model_a, opt_a, sched_a = _fresh()
    _train(model_a, opt_a, sched_a, range(6))

    model_b, opt_b, sched_b = _fresh()
    _train(model_b, opt_b, sched_b, range(3))
    path = tmp_path / "ckpt.pt"
    torch.save({"model": model_b.state_dict(), "opt": opt_b.state_dict(), "sched": sched_b.state_dict()}, path)

    model_c, opt_c, sched_c = _fresh(seed_model=77)  # different init: everything must come from the file
    ckpt = torch.load(path, weights_only=False)
    model_c.load_state_dict(ckpt["model"])
    with pytest.warns(NoiseReplayWarning):
        opt_c.load_state_dict(ckpt["opt"])
    sched_c.load_state_dict(ckpt["sched"])
    assert opt_c.steps == 3 and len(opt_c.accountant.history) == 3
    _train(model_c, opt_c, sched_c, range(3, 6))

    for a, c in zip(model_a.parameters(), model_c.parameters()):
        assert torch.equal(a, c)
    for a, c in zip(opt_a.clip_state.std, opt_c.clip_state.std):
        assert torch.equal(a, c)
    assert opt_a.accountant.history == opt_c.accountant.history


def test_load_state_dict_with_wrong_shapes_changes_nothing():
    model, opt = _adam_adaclip_after_one_step()
    sd = opt.state_dict()
    sd["clip_state"]["std"][0] = torch.ones(2, 2)
    snap = Snapshot(model, opt)
    with pytest.raises(InvalidHyperparameterError, match="shape"):
        opt.load_state_dict(sd)
    snap.assert_unchanged(model, opt)


def test_load_state_dict_with_a_bad_accountant_state_rolls_everything_back():
    """The accountant validates its part last: its refusal must undo the optimizer and noise
    states already loaded (a checkpoint restores all or nothing)."""
    from adaclip.accounting import Accountant

    model = mlp(0)
    opt = adaclip(model, inner=torch.optim.Adam(model.parameters(), lr=1e-2), noise_multiplier=1.1, seed=5,
                  accountant=Accountant("rdp"), sample_rate=0.1)
    backward(model, opt, *batch(0))
    opt.step()
    opt.zero_grad()
    saved = copy.deepcopy(opt.state_dict())
    for t in (1, 2):
        backward(model, opt, *batch(t))
        opt.step()
        opt.zero_grad()
    before = copy.deepcopy(opt.state_dict())
    saved["accountant"]["mechanism"] = "pld"  # this accountant is named RDP: refused
    with pytest.raises(InvalidHyperparameterError):
        opt.load_state_dict(saved)
    after = opt.state_dict()
    assert after["steps"] == before["steps"] == 3
    assert after["accountant"] == before["accountant"]
    assert torch.equal(after["noise"]["generator_state"], before["noise"]["generator_state"])
    for k, v in before["optimizer"]["state"].items():
        for name, x in v.items():
            assert torch.equal(torch.as_tensor(after["optimizer"]["state"][k][name]), torch.as_tensor(x))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_parameters_match_cpu_run():
    released = []
    for device in ("cpu", "cuda"):
        model = mlp(0).to(device)
        opt = adaclip(model, noise_multiplier=0.9, seed=3)
        x, y = batch(0)
        ref = mlp(0)
        for p, g in zip(opt.params, set_microbatch_grad_sample(ref, list(ref.parameters()), LOSS, x, y)):
            p.grad_sample = g.to(device)
        opt.step()
        assert all(s.device.type == device for s in opt.clip_state.std)
        released.append(flat_vec(p.grad.cpu() for p in opt.params))
    np.testing.assert_allclose(released[0], released[1], rtol=1e-10, atol=1e-13)


@settings(max_examples=25)
@given(
    n=st.integers(0, 6),
    bbar=st.floats(0.5, 20.0),
    sigma=st.floats(0.0, 3.0),
    beta_mean=st.floats(0.0, 0.999),
    beta_std=st.floats(0.0, 0.999),
    grad_scale=st.floats(1e-3, 1e3),
    seed=st.integers(0, 2**16),
)
def test_adaclip_matches_reference_on_arbitrary_per_example_grads(n, bbar, sigma, beta_mean, beta_std, grad_scale, seed):
    model = mlp(0)
    opt = AdaClip(torch.optim.SGD(model.parameters(), lr=0.0), model, noise_multiplier=sigma, expected_batch_size=bbar,
                  std_min=STD_MIN, std_max=STD_MAX, beta_mean=beta_mean, beta_std=beta_std, seed=seed,
                  attach_hooks=False, preset="patent")
    gen = torch.Generator().manual_seed(seed)
    d = sum(p.numel() for p in opt.params)
    mean, std = np.zeros(d), np.full(d, np.sqrt(STD_MIN * STD_MAX))
    twin = NoiseSource(seed=seed)
    for _ in range(2):
        per_example = [grad_scale * torch.randn((n, *p.shape), generator=gen, dtype=p.dtype) for p in opt.params]
        for p, g in zip(opt.params, per_example):
            p.grad_sample = g
        z = flat_vec(twin.standard_normal(opt.params)) if sigma > 0 else np.zeros(d)
        expected, mean, std = reference.adaclip_step(
            flat(per_example) if n else np.zeros((0, d)), mean, std, z, noise_multiplier=sigma,
            expected_batch_size=bbar, beta_mean=beta_mean, beta_std=beta_std, std_min=STD_MIN, std_max=STD_MAX,
            allow_empty=True,
        )
        opt.step()
        np.testing.assert_allclose(flat_vec(p.grad for p in opt.params), expected, rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(flat_vec(opt.clip_state.std), std, rtol=1e-9, atol=1e-14)


def test_adaclip_initial_max_grad_norm_starts_as_flat_clipping():
    """``AdaClip(initial_max_grad_norm=C0, preset="patent")``: the first step, noise included (same seed), is
    ``FlatClip(max_grad_norm=C0)``'s; later steps adapt."""
    from adaclip_torch import AdaClip, FlatClip

    def first_step(cls, **kw):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
        opt = cls(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=1.1,
                  expected_batch_size=8.0, seed=4, **kw)  # fmt: skip
        x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        return [p.grad.clone() for p in model.parameters()], opt

    ada, opt = first_step(AdaClip, initial_max_grad_norm=0.2, beta_std=0.99)
    flat, _ = first_step(FlatClip, max_grad_norm=0.2)
    for a, b in zip(ada, flat, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    d = sum(p.numel() for p in opt.params)
    assert opt.strategy.std_min == pytest.approx(0.2 / d**0.5 / 30)
    assert opt.strategy.std_max == pytest.approx(0.2 / d**0.5 * 30)
    model = nn.Linear(2, 2)
    with pytest.raises(InvalidHyperparameterError, match="not both"):
        AdaClip(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=1.0, expected_batch_size=2.0,
                initial_max_grad_norm=1.0, std_max=0.5, preset="patent")  # fmt: skip


def test_adaclip_warns_when_its_estimates_would_follow_the_noise():
    """κ = 2φ(1)·d·σ²/B̄² > 1 at construction: NoiseDominatedWarning (pointing at the user's
    line); at κ < 1, and for flat clipping whatever κ, no warning; the optimizer works either way."""
    import warnings

    from adaclip.errors import NoiseDominatedWarning

    torch.manual_seed(0)
    model = mlp()
    d = sum(p.numel() for p in model.parameters())
    loud_bbar = 0.5 * (0.484 * d) ** 0.5  # κ ≈ 4 at σ = 1
    with pytest.warns(NoiseDominatedWarning, match=f"d = {d}, σ = 1") as record:
        loud = AdaClip(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=1.0,
                       expected_batch_size=loud_bbar, preset="patent")  # fmt: skip
    assert record[0].filename == __file__
    x, y = batch(0)
    nn.functional.cross_entropy(model(x), y).backward()
    loud.step()  # a warning, not an error: the step runs
    loud.remove_hooks()
    with warnings.catch_warnings():
        warnings.simplefilter("error", NoiseDominatedWarning)
        quiet = AdaClip(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=1.0,
                        expected_batch_size=4 * loud_bbar, preset="patent")  # fmt: skip
        quiet.remove_hooks()
        FlatClip(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=1.0,
                 expected_batch_size=1.0, max_grad_norm=1.0).remove_hooks()  # fmt: skip
