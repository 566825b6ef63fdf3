"""What the optimizer built, at a glance: repr, summary() and the public attributes behind them."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import adaclip_torch  # noqa: E402


def _private(inner=torch.optim.SGD, **kwargs):
    torch.manual_seed(0)
    model = nn.Linear(5, 2)
    loader = DataLoader(TensorDataset(torch.randn(400, 5), torch.randint(0, 2, (400,))), batch_size=20)
    opt = inner(model.parameters(), lr=1e-3)
    return adaclip_torch.make_private(model, opt, loader, seed=0, **kwargs)


def test_banded_run_says_what_it_built():
    _, opt, _ = _private(torch.optim.Adam, target_epsilon=3.0, delta=1e-5, epochs=5, averaging="ema")
    assert opt.noise_mechanism == "banded" and opt.bands == len(opt.noise_coefficients) > 1
    text = repr(opt)
    assert f"σ={opt.noise_multiplier:.6g}" in text and f"noise=banded(b={opt.bands})" in text
    assert "accountant=pld(ε≤3, δ=1e-05)" in text and "averaging=ParameterAverage(ema" in text
    summary = opt.summary()
    assert f"b = {opt.bands}" in summary and f"{opt.noise_multiplier:.6g}" in summary
    assert f"accounted rate: {opt.accounted_sample_rate:.6g}" in summary
    assert f"multiplied by {opt.lr_scale:.6g}" in summary and opt.lr_scale > 1.0  # the user's Adam lr changed
    assert "accountant: pld, budget epsilon=3 at delta=1e-05; 0 accounted step(s)" in summary


def test_independent_run_and_a_wrapper_without_accountant():
    _, opt, _ = _private(noise_multiplier=1.0)
    assert opt.noise_mechanism == "independent" and opt.bands == 1
    assert "noise=independent" in repr(opt) and "accounted rate" not in opt.summary()
    assert "learning rate" not in opt.summary() and "averaging: none" in opt.summary()
    model = nn.Linear(3, 1)
    bare = adaclip_torch.FlatClip(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=1.0,
                                  expected_batch_size=4.0)  # fmt: skip
    assert "accountant: none" in bare.summary() and "accountant=" not in repr(bare)


def test_make_private_says_what_it_chose_once_and_warns_when_it_chose_for_you(caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="adaclip_torch"):
        _, opt, _ = _private(torch.optim.Adam, target_epsilon=3.0, delta=1e-5, epochs=5)
    records = [r for r in caplog.records if r.name == "adaclip_torch.make_private"]
    assert len(records) == 1 and records[0].levelno == logging.WARNING
    message = records[0].getMessage()
    for fact in (f"banded noise, b = {opt.bands} (noise_mechanism='auto')", f"sigma = {opt.noise_multiplier:.4g}",
                 "calibrated with pld for epsilon = 3", "100 planned steps", f"{-(-100 // opt.bands)} compositions",
                 "CyclicPoissonBatchSampler", f"multiplied by {opt.lr_scale:.4g}", "scale_adaptive_lr=False",
                 "noise_mechanism='independent'"):  # fmt: skip
        assert fact in message, fact
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="adaclip_torch"):
        _private(noise_mechanism="independent", target_epsilon=3.0, delta=1e-5, epochs=5)
    (record,) = [r for r in caplog.records if r.name == "adaclip_torch.make_private"]
    assert record.levelno == logging.INFO and "independent noise (DP-SGD)" in record.getMessage()
    assert "learning rate" not in record.getMessage()
    caplog.clear()
    logging.getLogger("adaclip_torch").setLevel(logging.ERROR)  # the user silences it
    try:
        _private(torch.optim.Adam, target_epsilon=3.0, delta=1e-5, epochs=5)
    finally:
        logging.getLogger("adaclip_torch").setLevel(logging.NOTSET)
    assert not [r for r in caplog.records if r.name == "adaclip_torch.make_private"]


def test_the_budget_error_names_the_users_q_the_accounted_rate_and_the_planned_run():
    from adaclip.errors import BudgetExceededError

    model, opt, loader = _private(target_epsilon=3.0, delta=1e-5, epochs=1, bands=4, noise_mechanism="banded")
    with pytest.raises(BudgetExceededError) as refused:
        for _ in range(3):  # three epochs on a budget planned for one
            for xb, yb in loader:
                opt.zero_grad()
                nn.functional.cross_entropy(model(xb), yb).backward()
                opt.step()
    message = str(refused.value)
    assert "the budget is epsilon=3 at delta=1e-05" in message and "have spent epsilon=" in message
    assert "banded noise (b = 4)" in message and "rate b*q = 0.2 (your q = 0.05)" in message
    assert "make_private planned 1 epoch(s) = 20 steps" in message
    assert opt.accountant.epsilon() <= 3.0
