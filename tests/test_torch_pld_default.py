"""make_private accounts with PLD by default, and resumes a run begun with RDP with RDP."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import adaclip_torch  # noqa: E402
from adaclip.accounting import calibrate_noise_multiplier  # noqa: E402
from adaclip.errors import InvalidHyperparameterError  # noqa: E402
from adaclip_torch.data import sample_rate_for, steps_per_epoch  # noqa: E402

N, B, EPOCHS = 400, 20, 2


def _build(**kwargs):
    torch.manual_seed(0)
    x, y = torch.randn(N, 5), torch.randint(0, 2, (N,))
    model = nn.Linear(5, 2)
    loader = DataLoader(TensorDataset(x, y), batch_size=B)
    return adaclip_torch.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1), loader, target_epsilon=3.0, delta=1e-5, epochs=EPOCHS,
        noise_mechanism="independent", seed=0, **kwargs,
    )  # fmt: skip


def _train(model, optimizer, loader, steps):
    batches = iter(loader)
    for _ in range(steps):
        xb, yb = next(batches)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(xb), yb).backward()
        optimizer.step()


def _planned_sigma(mechanism):
    q = sample_rate_for(B, N)
    return calibrate_noise_multiplier(
        target_epsilon=3.0, delta=1e-5, sample_rate=q, steps=EPOCHS * steps_per_epoch(q), accountant=mechanism
    )


def test_make_private_calibrates_and_accounts_with_pld_by_default():
    _, optimizer, _ = _build()
    assert optimizer.accountant.mechanism == "pld"
    assert optimizer.noise_multiplier == _planned_sigma("pld")
    _, rdp, _ = _build(mechanism="rdp")
    assert rdp.accountant.mechanism == "rdp" and rdp.noise_multiplier == _planned_sigma("rdp")
    assert 0.05 < 1 - optimizer.noise_multiplier / rdp.noise_multiplier < 0.1
    _, prv, _ = _build(accountant="prv")  # Opacus's name: the same numbers as the default
    assert prv.accountant.mechanism == "pld" and prv.noise_multiplier == optimizer.noise_multiplier


def test_a_default_optimizer_resumes_an_rdp_run_with_rdp_and_says_so():
    model, old, loader = _build(mechanism="rdp")
    _train(model, old, loader, 3)
    saved = old.state_dict()
    _, resumed, _ = _build()
    with pytest.warns(UserWarning, match="mechanism='rdp'"):
        resumed.load_state_dict(saved)
    assert resumed.accountant.mechanism == "rdp" and resumed.accountant.steps == 3
    assert resumed.accountant.epsilon(1e-5) == old.accountant.epsilon(1e-5)


def test_an_optimizer_that_names_pld_refuses_an_rdp_run():
    model, old, loader = _build(mechanism="rdp")
    _train(model, old, loader, 2)
    _, named, _ = _build(mechanism="pld")
    with pytest.raises(InvalidHyperparameterError, match="mechanism"):
        named.load_state_dict(old.state_dict())
    assert named.accountant.mechanism == "pld" and named.accountant.steps == 0
