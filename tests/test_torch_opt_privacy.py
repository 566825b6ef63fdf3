"""make_private and the real accountant hook."""

from __future__ import annotations

import pytest
import torch
from test_torch_opt_support import mlp
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from adaclip.accounting import Accountant, calibrate_noise_multiplier
from adaclip.errors import BudgetExceededError, InvalidHyperparameterError, NoiseReplayWarning
from adaclip_torch import AdaClip, FlatClip, PoissonBatchSampler, make_private

DELTA = 1e-5


def _loader(n=200, batch_size=20):
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(n, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g))
    return DataLoader(ds, batch_size=batch_size)


def _run(model, opt, loader, epochs):
    for _ in range(epochs):
        for x, y in loader:
            if len(x):
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
            else:
                opt.step(empty_batch=True)
            opt.zero_grad()


@pytest.mark.parametrize("strategy, kwargs, cls", [
    ("adaclip", {"std_min": 1e-4, "std_max": 1.0}, AdaClip),
    ("flat", {"max_grad_norm": 1.0}, FlatClip),
])
def test_make_private_calibrates_samples_and_accounts(strategy, kwargs, cls):
    model = mlp(0)
    model, opt, loader = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), _loader(),
                                      target_epsilon=2.0, delta=DELTA, epochs=2, strategy=strategy, seed=0,
                                      noise_mechanism="independent", **kwargs)  # DP-SGD's calibration
    assert isinstance(opt, cls)
    assert isinstance(loader.batch_sampler, PoissonBatchSampler)
    q = 20 / 200
    assert loader.batch_sampler.sample_rate == pytest.approx(q)
    assert opt.expected_batch_size == pytest.approx(20)
    assert len(loader) == 10
    sigma = calibrate_noise_multiplier(target_epsilon=2.0, delta=DELTA, sample_rate=q, steps=20)
    assert opt.hyperparameters().noise_multiplier == pytest.approx(sigma)
    _run(model, opt, loader, epochs=2)
    acct = opt.accountant
    assert acct.steps == 20 == opt.steps
    assert acct.epsilon(DELTA) <= 2.0
    assert acct.epsilon(DELTA) > 1.9  # calibrated: the budget is (almost) used up
    # one more step is beyond the budget: refused before it changes anything
    x, y = next(iter(loader))
    nn.functional.cross_entropy(model(x), y).backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(BudgetExceededError):
        opt.step()
    assert opt.steps == 20 and acct.steps == 20
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_each_step_records_q_and_sigma():
    model = mlp(0)
    acct = Accountant("rdp")
    opt = FlatClip(torch.optim.SGD(model.parameters(), lr=0.1), model, max_grad_norm=1.0, noise_multiplier=1.1,
                   expected_batch_size=5, accountant=acct, sample_rate=0.05, seed=0)
    for _ in range(3):
        opt.step(empty_batch=True)
    assert acct.steps == 3
    reference = Accountant("rdp")
    reference.step(noise_multiplier=1.1, sample_rate=0.05, num_steps=3)
    assert acct.epsilon(DELTA) == pytest.approx(reference.epsilon(DELTA), rel=1e-12)


def test_make_private_rejects_unknown_strategy_and_bad_epochs():
    model = mlp(0)
    with pytest.raises(InvalidHyperparameterError, match="strategy"):
        make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), _loader(), target_epsilon=1.0,
                     delta=DELTA, epochs=1, strategy="nope")
    with pytest.raises(InvalidHyperparameterError, match="epochs"):
        make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), _loader(), target_epsilon=1.0,
                     delta=DELTA, epochs=0)


def test_accountant_state_is_checkpointed():
    model = mlp(0)
    opt = FlatClip(torch.optim.SGD(model.parameters(), lr=0.1), model, max_grad_norm=1.0, noise_multiplier=1.1,
                   expected_batch_size=5, accountant=Accountant("rdp"), sample_rate=0.05, seed=0)
    opt.step(empty_batch=True)
    opt.step(empty_batch=True)
    saved = opt.state_dict()
    other = mlp(1)
    fresh = FlatClip(torch.optim.SGD(other.parameters(), lr=0.1), other, max_grad_norm=1.0, noise_multiplier=1.1,
                     expected_batch_size=5, accountant=Accountant("rdp"), sample_rate=0.05, seed=1)
    with pytest.warns(NoiseReplayWarning):
        fresh.load_state_dict(saved)
    assert fresh.accountant.steps == 2
    assert fresh.accountant.epsilon(DELTA) == opt.accountant.epsilon(DELTA)
