"""PyTorch auditing: ``DPOptimizer.add_unit_gradients`` / ``centre_and_scale`` and the one-run
white-box ``GradientCanaryAuditor`` on the real optimizers (materialised and ghost paths)."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import adaclip_torch  # noqa: E402
from adaclip import strategies as S  # noqa: E402
from adaclip.accounting import Accountant  # noqa: E402
from adaclip.errors import InvalidGradientError  # noqa: E402
from adaclip_torch.audit import GradientCanaryAuditor, per_example_losses  # noqa: E402

pytestmark = pytest.mark.torch
DELTA = 1e-5


def linear_opt(seed=0, **kw):
    torch.manual_seed(seed)
    model = nn.Linear(6, 1, bias=False)
    opt = adaclip_torch.FlatClip(torch.optim.SGD(model.parameters(), lr=0.0), model, max_grad_norm=1.0,
                                 noise_multiplier=1.0, expected_batch_size=2, loss_reduction="sum", seed=seed, **kw)  # fmt: skip
    return model, opt


def test_added_units_release_like_the_same_units_in_the_batch():
    x = torch.randn(3, 6) * 2
    model_a, a = linear_opt()
    model_a(x).sum().backward()  # per-example gradient of the weight is the row itself
    a.step()
    model_b, b = linear_opt()
    b.add_unit_gradients([x.reshape(3, 1, 6)])
    b.step()  # no backward needed
    torch.testing.assert_close(model_a.weight.grad, model_b.weight.grad, rtol=0, atol=1e-6)


def test_added_units_join_the_batch():
    x, extra = torch.randn(2, 6), torch.randn(2, 6) * 3
    model_a, a = linear_opt(seed=1)
    model_a(torch.cat([x, extra])).sum().backward()
    a.step()
    model_b, b = linear_opt(seed=1)
    b.add_unit_gradients([extra.reshape(2, 1, 6)])
    model_b(x).sum().backward()
    b.step()
    torch.testing.assert_close(model_a.weight.grad, model_b.weight.grad, rtol=0, atol=1e-6)


def test_add_unit_gradients_refuses_bad_input_and_changes_nothing():
    _, opt = linear_opt()
    sd = opt.state_dict()
    for bad, match in [
        (torch.zeros(2, 1, 6), "list"),
        ([torch.zeros(2, 6)], "shape|dimension|axis"),
        ([torch.zeros(0, 1, 6)], "empty"),
        ([np.zeros((2, 1, 6))], "not a tensor"),
        ([torch.zeros(1, 1, 6), torch.zeros(1, 1, 6)], "tensors"),
    ]:
        with pytest.raises(InvalidGradientError, match=match):
            opt.add_unit_gradients(bad)
    assert opt._accumulated is None and opt.steps == 0
    assert str(opt.state_dict()) == str(sd)


def test_centre_and_scale_of_adaclip_is_the_strategy_transform():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    opt = adaclip_torch.AdaClip(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=1.0,
                                expected_batch_size=4, initial_max_grad_norm=1.0, seed=0)  # fmt: skip
    model(torch.randn(4, 4)).sum().backward()
    opt.step()
    centre, scale = opt.centre_and_scale()
    want_c, want_s = opt.strategy.transform(opt.clip_state, len(opt.params))
    for got, want in zip(centre + scale, list(want_c) + list(want_s)):
        torch.testing.assert_close(got, torch.as_tensor(want, dtype=got.dtype))
    _, flat = linear_opt()
    c, s = flat.centre_and_scale()
    assert c is None and float(s[0]) == 1.0


# --------------------------------------------------------------------------- one-run audits


def mlp_run(make_opt, *, sigma, steps=4, num_canaries=200, seed=0, mode="materialise"):
    """``steps`` full-batch (q = 1) steps of a small MLP on random data, with the auditor."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(20, 24), nn.Tanh(), nn.Linear(24, 3))
    acc = Accountant("pld")
    opt = make_opt(model, sigma=sigma, acc=acc, mode=mode, seed=seed)
    auditor = GradientCanaryAuditor(opt, num_canaries=num_canaries, seed=seed)
    x, y = torch.randn(16, 20), torch.randint(0, 3, (16,))
    for _ in range(steps):
        nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
        auditor.step()
        opt.zero_grad()
    return auditor


def make_adaclip(model, *, sigma, acc, mode, seed):
    return adaclip_torch.AdaClip(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model,
                                 noise_multiplier=sigma, expected_batch_size=16, initial_max_grad_norm=1.0,
                                 loss_reduction="sum", accountant=acc, sample_rate=1.0, seed=seed,
                                 per_sample_mode=mode)  # fmt: skip


def make_flat(model, *, sigma, acc, mode, seed):
    return adaclip_torch.FlatClip(torch.optim.Adam(model.parameters(), lr=0.01), model, max_grad_norm=1.0,
                                  noise_multiplier=sigma, expected_batch_size=16, loss_reduction="sum",
                                  accountant=acc, sample_rate=1.0, seed=seed, per_sample_mode=mode)  # fmt: skip


def make_quantile(model, *, sigma, acc, mode, seed):
    strategy = S.QuantileClipping(max_grad_norm=1.0, quantile=S.QuantileRule(count_noise_multiplier=5.0))
    return adaclip_torch.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model, strategy=strategy,
                                     noise_multiplier=sigma, expected_batch_size=16, loss_reduction="sum",
                                     accountant=acc, sample_rate=1.0, seed=seed, per_sample_mode=mode)  # fmt: skip


@pytest.mark.parametrize("mode", ["materialise", "ghost"])
@pytest.mark.parametrize(
    "make", [make_adaclip, make_flat, make_quantile], ids=["adaclip", "flat", "quantile"]
)
def test_audit_stays_within_the_accountant(make, mode):
    auditor = mlp_run(make, sigma=2.0, mode=mode)  # √T/σ = 1
    rep = auditor.report(delta=DELTA)
    assert rep.accountant_epsilon is not None and not rep.exceeds_accountant, str(rep)
    assert rep.gdp.epsilon_lower <= rep.accountant_epsilon, str(rep)
    assert rep.gdp.mu > 0.5, str(rep)  # the canaries are seen (μ = 1 in expectation, less with data nuisance)


def test_audit_detects_half_the_noise():
    claimed = (
        mlp_run(make_adaclip, sigma=4.0, steps=4, num_canaries=10).report(delta=DELTA).accountant_epsilon
    )
    rep = mlp_run(make_adaclip, sigma=2.0, steps=4, num_canaries=300, seed=1).report(delta=DELTA)
    assert rep.gdp.epsilon_lower > claimed, (str(rep), claimed)


def test_audit_detects_no_noise():
    claimed = mlp_run(make_flat, sigma=4.0, num_canaries=10).report(delta=DELTA).accountant_epsilon
    rep = mlp_run(make_flat, sigma=0.0, num_canaries=300, seed=2).report(delta=DELTA)
    assert rep.epsilon_lower > claimed, (str(rep), claimed)


def test_auditor_needs_a_sample_rate():
    model = nn.Linear(3, 1)
    opt = adaclip_torch.FlatClip(torch.optim.SGD(model.parameters(), lr=0.1), model, max_grad_norm=1.0,
                                 noise_multiplier=1.0, expected_batch_size=2)  # fmt: skip
    with pytest.raises(Exception, match="sample_rate"):
        GradientCanaryAuditor(opt, num_canaries=2, seed=0)
    GradientCanaryAuditor(opt, num_canaries=2, seed=0, sample_rate=0.1).remove()


def test_per_example_losses():
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    x, y = torch.randn(10, 4), torch.randint(0, 3, (10,))
    got = per_example_losses(model, x, y, batch_size=3)
    want = nn.functional.cross_entropy(model(x), y, reduction="none").detach().double().numpy()
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert model.training
    with pytest.raises(ValueError, match="lengths"):
        per_example_losses(model, x, y[:3])
    assert math.isfinite(float(got.sum()))
