"""make_private(averaging=...) and DPOptimizer.averaged(): the average follows every private
step, swaps in for evaluation, and is part of the optimizer's checkpoint."""

from __future__ import annotations

import pytest
import torch

from adaclip.errors import InvalidHyperparameterError

pytestmark = pytest.mark.torch


# ------------------------------------------------------------- make_private(averaging=...)


def _private_run(averaging, *, steps=None, seed=0, **kw):
    from torch.utils.data import DataLoader, TensorDataset

    from adaclip_torch.privacy import make_private

    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(200, 6, generator=g), torch.randint(0, 3, (200,), generator=g))
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    model, private, loader = make_private(model, inner, DataLoader(ds, batch_size=20), averaging=averaging,
                                          seed=seed, **kw)
    return model, private, loader


def test_make_private_averaging_follows_every_private_step_and_swaps_in_for_evaluation():
    from adaclip.averaging import default_horizon

    model, private, loader = _private_run("ema", target_epsilon=3.0, delta=1e-5, epochs=2)
    assert private.average.config.horizon == default_horizon(20)
    mu = 1 - 1 / default_horizon(20)
    expected = [p.detach().clone().double() for p in model.parameters()]
    t = 0
    for _ in range(2):
        for x, y in loader:
            torch.nn.functional.cross_entropy(model(x), y).backward()
            private.step()
            private.zero_grad()
            m = min(mu, (1 + t) / (10 + t))
            expected = [m * e + (1 - m) * p.detach().double() for e, p in zip(expected, model.parameters())]
            t += 1
    live = [p.detach().clone() for p in model.parameters()]
    with private.averaged():
        for p, e in zip(model.parameters(), expected, strict=True):
            torch.testing.assert_close(p.detach().double(), e, rtol=1e-5, atol=1e-6)
        assert not all(torch.equal(p, q) for p, q in zip(model.parameters(), live, strict=True))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), live, strict=True))


def test_make_private_averaging_is_checkpointed_and_checked():
    model, private, loader = _private_run(0.9, noise_multiplier=1.0)
    x, y = next(iter(loader))
    torch.nn.functional.cross_entropy(model(x), y).backward()
    private.step()
    state = private.state_dict()
    assert state["averaging"]["count"] == 1
    model2, private2, _ = _private_run(0.9, noise_multiplier=1.0, seed=1)
    with pytest.warns(Warning, match="seeded"):
        private2.load_state_dict(state)
    with private.averaged(), private2.averaged():
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters(), strict=True))
    model3, plain, _ = _private_run(None, noise_multiplier=1.0)
    with pytest.raises(InvalidHyperparameterError, match="parameter average"):
        plain.load_state_dict(state)
    with pytest.raises(InvalidHyperparameterError, match="averaging="):
        plain.averaged()
    with pytest.raises(InvalidHyperparameterError, match="epochs"):
        _private_run("ema", noise_multiplier=1.0)
