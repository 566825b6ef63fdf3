"""Regression tests for the privacy holes an independent audit found in ``adaclip_torch``.

Each test reproduces one hole (a raw gradient stepped, examples mixed, a corrupt state, a
ghost norm under-clipped, a noise draw reused, a checkpoint that replays or predicts noise, a
NaN unit that decides the release, a sampling-dependent counter, a DDP habit) and checks that
it is closed: a clear error that changes nothing, or a release that leaks nothing.
"""

from __future__ import annotations

import copy
import os
import tempfile
import warnings

import numpy as np
import pytest
import torch
from test_torch_opt_support import FakeAccountant, batch, mlp  # noqa: I001
from torch import nn

from adaclip.errors import InvalidGradientError, InvalidHyperparameterError, NoiseReplayWarning
from adaclip.strategies import FlatClipping
from adaclip_torch import AdaClip, DPOptimizer, FlatClip
from adaclip_torch.ghost import GhostLayer
from adaclip_torch.grad_sample import GradSampleHooks
from adaclip_torch.noise import NoiseSource

F32 = torch.float32


def _loss(model, x, y):
    return nn.functional.cross_entropy(model(x), y)


def _step(model, opt, x, y):
    _loss(model, x, y).backward()
    opt.step()
    opt.zero_grad()


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


# --------------------------------------------------------------------------- 1. parameters


def test_parameter_unfrozen_after_wrapping_is_refused_before_anything_moves():
    model = mlp(0)
    model[0].requires_grad_(False)
    opt = FlatClip(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=1.0,
                   max_grad_norm=1e-3, expected_batch_size=8, seed=0)
    model[0].requires_grad_(True)  # gradual unfreezing
    before = _params(model)
    _loss(model, *batch(1)).backward()
    with pytest.raises(InvalidHyperparameterError, match=r"'0.weight' would be stepped .* raw, un-noised"):
        opt.step()
    assert _same(before, _params(model)) and opt.steps == 0


def test_parameter_added_to_the_wrapped_optimizer_is_refused():
    model = mlp(0)
    extra = nn.Parameter(torch.zeros(3, dtype=torch.float64))
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = FlatClip(inner, model, noise_multiplier=1.0, expected_batch_size=8, seed=0)
    inner.add_param_group({"params": [extra]})
    _loss(model, *batch(1)).backward()
    with pytest.raises(InvalidHyperparameterError, match="add_param_group"):
        opt.step()
    with pytest.raises(InvalidHyperparameterError, match="add_param_group"):
        opt.add_param_group({"params": [extra]})


def test_parameter_frozen_after_wrapping_is_named_as_such():
    model = mlp(0)
    opt = FlatClip(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=1.0,
                   expected_batch_size=8, seed=0)
    model[2].bias.requires_grad_(False)
    _loss(model, *batch(1)).backward()
    with pytest.raises(InvalidHyperparameterError, match=r"'2.bias' was frozen after wrapping"):
        opt.step()


def test_model_double_after_wrapping_is_refused_before_the_inner_optimizer_steps():
    model = mlp(0, dtype=F32)
    opt = AdaClip(torch.optim.Adam(model.parameters(), lr=0.1), model, noise_multiplier=1.0,
                  expected_batch_size=8, seed=0, preset="patent")
    _step(model, opt, *batch(1, dtype=F32))
    model.double()
    _loss(model, *batch(2)).backward()
    with pytest.raises(InvalidHyperparameterError, match="changed from torch.float32 .* to torch.float64"):
        opt.step()
    inner_steps = {int(s["step"]) for s in opt.original_optimizer.state.values()}
    assert inner_steps == {opt.steps} == {1}


# --------------------------------------------------------------------------- 2. modules


@pytest.mark.parametrize(
    "module",
    [nn.BatchNorm1d(5, affine=False), nn.BatchNorm1d(5), nn.InstanceNorm1d(5, track_running_stats=True)],
    ids=["bn-no-affine", "bn", "instancenorm-running-stats"],
)
def test_modules_that_mix_examples_are_refused_at_wrap_time(module):
    model = nn.Sequential(nn.Linear(6, 5), module, nn.Linear(5, 3))
    with pytest.raises(InvalidHyperparameterError, match="module '1' is"):
        FlatClip(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=1.0, expected_batch_size=8)
    with pytest.raises(InvalidHyperparameterError, match="module '1' is"):
        GradSampleHooks(model)


def test_batchnorm_added_after_wrapping_is_refused_at_step_time():
    model = nn.Sequential(nn.Linear(6, 5), nn.Identity(), nn.Linear(5, 3)).double()
    opt = FlatClip(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=1.0,
                   expected_batch_size=8, seed=0)
    model[1] = nn.BatchNorm1d(5, affine=False).double()
    before = _params(model)
    _loss(model, *batch(1)).backward()
    with pytest.raises(InvalidHyperparameterError, match="module '1' is BatchNorm1d"):
        opt.step()
    assert _same(before, _params(model)) and opt.steps == 0


def test_second_wrapper_error_names_remove_hooks():
    model = mlp(0)
    FlatClip(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=1.0, expected_batch_size=8)
    with pytest.raises(InvalidHyperparameterError, match=r"remove_hooks\(\)"):
        FlatClip(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=1.0, expected_batch_size=8)


# --------------------------------------------------------------------------- 3. corrupt state loads


def _adaclip_with_state():
    model = nn.Linear(8, 3)
    opt = AdaClip(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=1.0,
                  expected_batch_size=16, seed=0, std_min=1e-3, std_max=1e-1, preset="patent")
    _step(model, opt, torch.randn(16, 8), torch.randint(0, 3, (16,)))
    return model, opt


def _corrupt(key, value):
    def edit(sd):
        if key == "steps":
            sd["steps"] = value
        elif key == "step":
            sd["clip_state"]["step"] = value
        else:
            sd["clip_state"][key][0].fill_(value)
    return edit


@pytest.mark.parametrize(
    "edit, words",
    [
        (_corrupt("std", float("nan")), "NaN or inf"),
        (_corrupt("std", -0.01), "outside"),
        (_corrupt("std", 0.0), "outside"),
        (_corrupt("std", 1.0), "outside"),  # above std_max = 0.1
        (_corrupt("mean", float("inf")), "NaN or inf"),
        (_corrupt("step", -1), "int >= 0"),
        (_corrupt("steps", -3), "int >= 0"),
        (_corrupt("steps", 2.5), "int >= 0"),
        (lambda sd: sd.pop("clip_state"), r"missing \['clip_state'\]"),
        (lambda sd: sd.pop("noise"), r"missing \['noise'\]"),
        (lambda sd: sd.__setitem__("accumulated", [torch.zeros(3, 8), torch.zeros(3)]), "un-noised"),
    ],
)
def test_corrupt_state_loads_are_refused_and_change_nothing(edit, words):
    model, opt = _adaclip_with_state()
    sd = copy.deepcopy(opt.state_dict())
    edit(sd)
    before = copy.deepcopy(opt.state_dict())
    rng = opt.noise_source.get_state().clone()
    with pytest.raises(InvalidHyperparameterError, match=words):
        opt.load_state_dict(sd)
    after = opt.state_dict()
    assert after["steps"] == before["steps"] and torch.equal(opt.noise_source.get_state(), rng)
    for key in ("mean", "std"):
        assert _same(after["clip_state"][key], before["clip_state"][key])
    _step(model, opt, torch.randn(16, 8), torch.randint(0, 3, (16,)))
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


# --------------------------------------------------------------------------- 4. ghost cancellation


def _released_w_norm(mode, ratio, true_norm, seed):
    """σ = 0, lr = 0, B̄ = 1: the release is b·w̄ + m; read back ‖w̄‖ (the repro of the audit)."""
    d = 64
    rng = np.random.default_rng(seed)
    model = nn.Linear(d, 1, bias=False)
    opt = AdaClip(torch.optim.SGD(model.parameters(), lr=0.0), model, noise_multiplier=0.0,
                  expected_batch_size=1.0, initial_max_grad_norm=1.0, loss_reduction="sum",
                  per_sample_mode=mode, use_kernel=False, preset="patent")
    s_val = opt.strategy.std_min
    b = s_val * np.sqrt(d)
    v, u = rng.standard_normal(d), rng.standard_normal(d)
    v, u = v / np.linalg.norm(v), u / np.linalg.norm(u)
    mean = ratio * b * v
    sd = copy.deepcopy(opt.state_dict())
    sd["clip_state"]["mean"] = [torch.tensor(mean, dtype=F32).reshape(1, d)]
    sd["clip_state"]["std"] = [torch.full((1, d), s_val, dtype=F32)]
    opt.load_state_dict(sd)
    model(torch.tensor(mean + true_norm * b * u, dtype=F32).reshape(1, d)).sum().backward()
    opt.step()
    g = model.weight.grad.detach().double().reshape(-1).numpy()
    return float(np.linalg.norm((g - mean) / b))


@pytest.mark.parametrize("mode", ["materialise", "ghost"])
@pytest.mark.parametrize("ratio", [1e3, 1e4])
def test_ghost_norms_never_under_clip_in_float32(mode, ratio):
    """A unit of transformed norm 3 at ‖m/b‖ = 1e4 was released with norm 3.00 on the ghost path
    (the expansion cancelled). Now it comes out at norm 1, up to the float32 rounding of reading
    ``g̃ − m`` back (about 1e-4 at this ‖m/b‖)."""
    worst = max(_released_w_norm(mode, ratio, 3.0, seed) for seed in range(5))
    assert 0.99 < worst <= 1.0 + 1e-3


def test_ghost_norm_bound_is_an_upper_bound_and_tight_when_nothing_cancels():
    gen = torch.Generator().manual_seed(0)
    n, fin, fout = 16, 24, 10
    x = torch.randn(n, fin, generator=gen, dtype=F32)
    e = torch.randn(n, fout, generator=gen, dtype=F32)
    g64 = torch.einsum("no,nk->nok", e.double(), x.double())
    scale = torch.rand(fout, fin, generator=gen, dtype=F32) + 0.5
    for ratio in (0.0, 1.0, 1e2, 1e4, 1e6):
        centre = (g64.mean(0) + ratio * scale.double() * torch.randn(fout, fin, generator=gen, dtype=torch.float64)).to(F32)
        exact = (((g64 - centre.double()) / scale.double()) ** 2).sum(dim=(1, 2))
        got = GhostLayer(nn.Linear(fin, fout), "linear", [(x, e)], F32, "ghost").norm("weight", centre, scale).double()
        assert bool((got >= exact).all()), ratio
        assert bool((got <= exact * (1 + 2e-2)).all()), ratio  # loose bounds are recomputed exactly


# --------------------------------------------------------------------------- 5./6. noise reuse, checkpoints

D, SIGMA, BBAR = 8, 4.0, 8.0


def _linear_adaclip(**kw):
    model = nn.Linear(D, 1, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    opt = AdaClip(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=SIGMA,
                  expected_batch_size=BBAR, initial_max_grad_norm=1.0, loss_reduction="sum",
                  accountant=FakeAccountant(100), sample_rate=0.1, use_kernel=False, **kw, preset="patent")
    return model, opt


def _release(model, opt, x):
    model(x).sum().backward()
    opt.step()
    g = model.weight.grad.detach().reshape(-1).clone()
    opt.zero_grad()
    return g


def _w_space(opt):
    m, s = opt.clip_state.mean[0].reshape(-1), opt.clip_state.std[0].reshape(-1)
    return m, torch.sqrt(s) * torch.sqrt(s.sum())


A = torch.randn(6, D, generator=torch.Generator().manual_seed(0)) * 0.3
CANARY = torch.zeros(D)
CANARY[0] = 50.0


def test_restore_and_step_again_draws_fresh_noise_by_default():
    model, opt = _linear_adaclip()
    _release(model, opt, A)
    ckpt, w0 = copy.deepcopy(opt.state_dict()), model.weight.detach().clone()
    assert "generator_state" not in ckpt["noise"]  # nothing in the checkpoint predicts the noise
    _, b = _w_space(opt)
    g1 = _release(model, opt, A)
    with torch.no_grad():
        model.weight.copy_(w0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NoiseReplayWarning)
        opt.load_state_dict(ckpt)
    g2 = _release(model, opt, torch.cat([A, CANARY[None]]))
    difference = (g2 - g1) * BBAR / b  # the canary's clipped vector if the noise replayed
    assert float(difference.norm()) > 5.0


def test_restoring_an_earlier_checkpoint_in_process_never_rolls_the_accountant_back():
    from adaclip.accounting import Accountant

    model = nn.Linear(D, 1, bias=False)
    opt = AdaClip(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=SIGMA,
                  expected_batch_size=BBAR, loss_reduction="sum", accountant=Accountant("rdp"), sample_rate=0.1, preset="patent")
    _release(model, opt, A)
    ckpt = copy.deepcopy(opt.state_dict())
    _release(model, opt, A)
    eps = opt.accountant.epsilon(1e-5)
    with pytest.warns(UserWarning, match="kept the accountant's history"):
        opt.load_state_dict(ckpt)
    assert opt.accountant.steps == 2 and opt.accountant.epsilon(1e-5) == eps and opt.steps == 1
    model2 = nn.Linear(D, 1, bias=False)  # a fresh process: the checkpoint's accountant is loaded
    opt2 = AdaClip(torch.optim.SGD(model2.parameters(), lr=0.1), model2, noise_multiplier=SIGMA,
                   expected_batch_size=BBAR, loss_reduction="sum", accountant=Accountant("rdp"), sample_rate=0.1, preset="patent")
    opt2.load_state_dict(ckpt)
    assert opt2.accountant.steps == 1


def test_seeded_restore_replays_bit_for_bit_and_warns():
    model, opt = _linear_adaclip(seed=3)
    _release(model, opt, A)
    ckpt = copy.deepcopy(opt.state_dict())
    assert "generator_state" in ckpt["noise"]
    g1 = _release(model, opt, A)
    with pytest.warns(NoiseReplayWarning, match="same noise"):
        opt.load_state_dict(ckpt)
    with torch.no_grad():
        model.weight.zero_()
    torch.testing.assert_close(_release(model, opt, A), g1)


def test_secure_mode_saves_no_generator_state():
    model, opt = _linear_adaclip(secure_mode=True)
    _release(model, opt, A)
    sd = opt.state_dict()
    assert "generator_state" not in sd["noise"] and sd["noise"]["mode"] == "secure"
    opt.load_state_dict(copy.deepcopy(sd))


def test_os_seeded_source_reseeds_on_restore():
    source = NoiseSource()
    saved = source.state_dict()
    assert saved == {"secure_mode": False, "secure_num_draws": 4, "mode": "os"}
    state = source.get_state().clone()
    source.load_state_dict(saved)
    assert not torch.equal(source.get_state(), state)


def test_accumulated_clipped_sum_is_never_saved():
    model, opt = _linear_adaclip()
    model(torch.cat([A, CANARY[None]])).sum().backward()
    opt.accumulate()
    with pytest.raises(InvalidGradientError, match="not noised yet"):
        opt.state_dict()
    opt.step()
    assert "accumulated" not in opt.state_dict()


def test_failed_wrapped_step_does_not_let_a_retry_reuse_the_noise():
    """The audit's case (d): a post-step hook raises after the parameters moved; the retry on
    another batch must not reuse the noise (the difference would be the canary's vector)."""
    model, opt = _linear_adaclip(seed=5)
    _release(model, opt, A)
    _, b = _w_space(opt)
    w_before = model.weight.detach().clone().reshape(-1)
    calls = {"n": 0}

    def flaky(*_):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("logging hook failed")

    handle = opt.original_optimizer.register_step_post_hook(flaky)
    model(torch.cat([A, CANARY[None]])).sum().backward()
    with pytest.raises(RuntimeError, match="logging hook failed"):
        opt.step()
    g1 = (w_before - model.weight.detach().reshape(-1)) / 0.1
    assert opt.steps == 2 and len(opt.accountant.history) == 2
    opt.zero_grad()
    g2 = _release(model, opt, A)
    handle.remove()
    assert float(((g1 - g2) * BBAR / b).norm()) > 5.0


# --------------------------------------------------------------------------- 7. non-finite units


def _nan_batch(bad):
    x, y = batch(4, n=6)
    x_bad = torch.cat([x, x[:1]])
    x_bad[-1, 1] = bad
    return (x, y), (x_bad, torch.cat([y, y[:1]]))


@pytest.mark.parametrize("mode", ["materialise", "ghost"])
@pytest.mark.parametrize("cls", [AdaClip, FlatClip])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_unit_contributes_nothing(mode, cls, bad):
    (x, y), (x_bad, y_bad) = _nan_batch(bad)
    releases = []
    for xb, yb in ((x, y), (x_bad, y_bad)):
        model = mlp(1)
        opt = cls(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=1.0,
                  expected_batch_size=6, seed=7, per_sample_mode=mode, loss_reduction="sum")
        nn.functional.cross_entropy(model(xb), yb, reduction="none").sum().backward()
        opt.step()
        releases.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*releases):
        assert bool(torch.isfinite(b).all())
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)


def test_a_non_finite_user_contributes_nothing_at_user_level():
    (x, y), (x_bad, y_bad) = _nan_batch(float("nan"))
    users = torch.tensor([0, 0, 1, 1, 2, 2])
    releases = []
    for xb, yb, ids in ((x, y, users), (x_bad, y_bad, torch.cat([users, torch.tensor([3])]))):
        model = mlp(1)
        opt = AdaClip(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=1.0,
                      expected_batch_size=3, seed=7, loss_reduction="sum", preset="patent")
        nn.functional.cross_entropy(model(xb), yb, reduction="none").sum().backward()
        opt.step(user_ids=ids)
        releases.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*releases):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)


def test_nonfinite_mode_is_validated():
    model = mlp(0)
    with pytest.raises(InvalidHyperparameterError, match="nonfinite"):
        FlatClip(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=1.0,
                 expected_batch_size=8, nonfinite="ignore")


# --------------------------------------------------------------------------- 8. counters


def _public_state(opt):
    skip = {"params", "model", "original_optimizer", "grad_sample_hooks", "accountant", "strategy"}
    out = {}
    for name, value in vars(opt).items():
        if name.startswith("_") or name in skip:
            continue
        out[name] = value if isinstance(value, (int, float, str, bool, type(None))) else repr(value)
    return out


def test_no_public_attribute_depends_on_which_units_were_sampled():
    """Same seed, same number of steps; one run sees an empty Poisson batch where the other sees
    units: nothing public may differ but the released values (the former ``kernel_steps`` did)."""
    states = []
    for empty in (False, True):
        model = mlp(2)
        opt = AdaClip(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=1.0,
                      expected_batch_size=4, seed=1, preset="patent")
        _step(model, opt, *batch(1))
        if empty:
            opt.step(empty_batch=True)
        else:
            _step(model, opt, *batch(2))
        states.append((_public_state(opt), opt.steps, opt.fused_kernels))
    assert states[0] == states[1]
    assert not hasattr(opt, "kernel_steps")


# --------------------------------------------------------------------------- 10. DDP


def test_ddp_wrapped_model_is_refused_with_the_way_out():
    import torch.distributed as dist

    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'init')}", rank=0, world_size=1)
        try:
            model = nn.parallel.DistributedDataParallel(mlp(0))
            for distributed in (False, True):
                with pytest.raises(InvalidHyperparameterError, match=r"DistributedDataParallel.*model\.module"):
                    AdaClip(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=1.0,
                            expected_batch_size=8, distributed=distributed, preset="patent")
        finally:
            dist.destroy_process_group()


# --------------------------------------------------------------------------- also found


def test_flat_clip_has_a_default_clip_norm_and_reports_it():
    model = mlp(0)
    opt = FlatClip(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=1.0, expected_batch_size=8)
    assert opt.strategy.max_grad_norm == 1.0
    assert opt.hyperparameters().max_grad_norm == 1.0
    opt2 = FlatClip(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=1.0,
                    expected_batch_size=8, max_grad_norm=0.3, attach_hooks=False)
    assert opt2.hyperparameters() == (1.0, 0.3)


def test_shape_errors_name_the_parameter():
    model = mlp(0)
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, strategy=FlatClipping(1.0),
                      noise_multiplier=1.0, expected_batch_size=8, attach_hooks=False)
    for p in model.parameters():
        p.grad_sample = torch.zeros((4, *p.shape), dtype=p.dtype)
    model[2].bias.grad_sample = torch.zeros((4, 7), dtype=torch.float64)
    with pytest.raises(InvalidGradientError, match=r"parameter '2.bias' has shape \(4, 7\)"):
        opt.step()


# ----------------------------------------------------------------- round two: accumulation edges


def _zero_linear_flat(sigma: float = 0.0, max_grad_norm: float = 1.0, batch: float = 8.0, **kw):
    m = nn.Linear(5, 2, bias=False)
    nn.init.zeros_(m.weight)
    opt = FlatClip(torch.optim.SGD(m.parameters(), lr=1.0), m, max_grad_norm=max_grad_norm,
                   noise_multiplier=sigma, expected_batch_size=batch, **kw)
    return m, opt


def test_zero_grad_discards_the_pending_accumulated_sum():
    """accumulate() then zero_grad(): the abandoned physical batch must not reach the next release
    (with σ = 0 the next update equals a clean one), and zero_grad() says what it dropped."""
    torch.manual_seed(1)
    xa, xb, y = torch.randn(8, 5), torch.randn(8, 5), torch.randint(0, 2, (8,))
    clean_model, clean = _zero_linear_flat()
    _loss(clean_model, xb, y).backward()
    clean.step()
    model, opt = _zero_linear_flat()
    _loss(model, xa, y).backward()
    opt.accumulate()
    with pytest.warns(UserWarning, match="discarded the clipped sum"):
        opt.zero_grad()
    opt.state_dict()  # no longer blocked: nothing un-noised is pending
    _loss(model, xb, y).backward()
    opt.step()
    torch.testing.assert_close(model.weight, clean_model.weight, rtol=0, atol=0)
    assert opt.steps == 1


def test_discard_pending_drops_the_sum_and_the_per_example_grads_silently():
    torch.manual_seed(2)
    x, y = torch.randn(8, 5), torch.randint(0, 2, (8,))
    model, opt = _zero_linear_flat()
    assert opt.discard_pending() is False
    _loss(model, x, y).backward()
    opt.accumulate()
    _loss(model, x, y).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert opt.discard_pending() is True
    assert getattr(model.weight, "grad_sample", None) is None
    opt.state_dict()
    with pytest.raises(InvalidGradientError, match="without backward"):
        opt.step()  # nothing pending, nothing to release
    assert opt.steps == 0


def test_zero_grad_after_step_warns_about_nothing():
    torch.manual_seed(3)
    model, opt = _zero_linear_flat()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _step(model, opt, torch.randn(8, 5), torch.randint(0, 2, (8,)))
        opt.zero_grad()


@pytest.mark.parametrize("second_size", [8, 5])
@pytest.mark.parametrize("mode", ["materialise", "ghost"])
def test_second_backward_before_step_is_refused_and_the_first_batch_released_alone(mode, second_size):
    """Two backward passes before step() would merge example i of both batches into one unit
    (same size) or fail obscurely (different sizes): both are refused from the second backward,
    naming accumulate(); the release is then the first batch's, exactly."""
    torch.manual_seed(4)
    x1, y1 = torch.randn(8, 5), torch.randint(0, 2, (8,))
    x2, y2 = torch.randn(second_size, 5), torch.randint(0, 2, (second_size,))
    clean_model, clean = _zero_linear_flat(max_grad_norm=0.05, per_sample_mode=mode)
    _loss(clean_model, x1, y1).backward()
    clean.step()
    model, opt = _zero_linear_flat(max_grad_norm=0.05, per_sample_mode=mode)
    _loss(model, x1, y1).backward()
    with pytest.raises(InvalidGradientError, match=r"second backward pass.*accumulate\(\)"):
        _loss(model, x2, y2).backward()
    opt.step()
    torch.testing.assert_close(model.weight, clean_model.weight, rtol=0, atol=0)


def test_accumulate_between_backwards_makes_separate_units():
    """The way out the refusal names: accumulate() after each backward gives 2n separate units."""
    torch.manual_seed(5)
    C = 0.05
    x1, x2, y = torch.randn(8, 5), torch.randn(8, 5), torch.randint(0, 2, (8,))
    model, opt = _zero_linear_flat(max_grad_norm=C, batch=1.0, loss_reduction="sum")
    per_example = []
    for x in (x1, x2):
        for i in range(8):
            m = nn.Linear(5, 2, bias=False)
            nn.init.zeros_(m.weight)
            nn.functional.cross_entropy(m(x[i:i + 1]), y[i:i + 1], reduction="sum").backward()
            per_example.append(m.weight.grad)
    g = torch.stack(per_example)
    separate = (g * (C / g.flatten(1).norm(dim=1)).clamp(max=1.0)[:, None, None]).sum(0)
    nn.functional.cross_entropy(model(x1), y, reduction="sum").backward()
    opt.accumulate()
    nn.functional.cross_entropy(model(x2), y, reduction="sum").backward()
    opt.step()
    torch.testing.assert_close(-model.weight.detach(), separate, rtol=1e-6, atol=1e-7)


def test_noise_snapshot_restores_every_generator_and_drops_newer_ones():
    """A failed step rewinds each generator it drew from; one made after the snapshot is
    dropped (re-seeded from the OS next time). Device generators stand in as CPU ones here."""
    source = NoiseSource()
    source._device_generators[torch.device("cuda", 0)] = torch.Generator().manual_seed(1)
    snap = source.snapshot()
    source._device_generators[torch.device("cuda", 1)] = torch.Generator().manual_seed(2)
    cpu_before = source.standard_normal([torch.zeros(8)])[0]
    dev_before = torch.randn(8, generator=source._device_generators[torch.device("cuda", 0)])
    source.restore(snap)
    assert list(source._device_generators) == [torch.device("cuda", 0)]
    torch.testing.assert_close(source.standard_normal([torch.zeros(8)])[0], cpu_before, rtol=0, atol=0)
    dev_after = torch.randn(8, generator=source._device_generators[torch.device("cuda", 0)])
    torch.testing.assert_close(dev_after, dev_before, rtol=0, atol=0)
    source.load_state_dict(source.state_dict())
    assert source._device_generators == {}
