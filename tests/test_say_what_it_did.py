"""The library says what it built and why it refuses, the same way in every front end (issue 45):
the JAX plan announces itself once and has a summary; the JAX tracker's budget refusal names
the budget, the ε spent and the accounted rate next to the user's q; a JAX tracker that adopts
an RDP checkpoint says so, as the PyTorch optimizer does."""

from __future__ import annotations

import logging

import jax.numpy as jnp
import pytest

from adaclip.accounting import Accountant
from adaclip.correlated import plan_banded_noise
from adaclip.errors import BudgetExceededError

_PLAN = dict(target_epsilon=3.0, delta=1e-5, sample_rate=0.01, steps=400, workload="momentum")


def test_plan_announces_itself_once_with_public_quantities(caplog):
    caplog.set_level(logging.INFO, logger="adaclip.correlated.planning")
    plan = plan_banded_noise(**_PLAN, adaptive_optimizer=True)
    records = [r for r in caplog.records if r.name == "adaclip.correlated.planning"]
    assert len(records) == 1 and records[0].levelno == logging.INFO
    text = records[0].getMessage()
    assert f"b = {plan.bands}" in text and "chosen by the expected-error rule" in text
    assert f"{plan.noise_multiplier:.6g}" in text and "epsilon = 3, delta = 1e-05" in text
    assert f"accounted as {plan.compositions} composition(s)" in text
    assert "lr_scale" in text


def test_plan_records_its_budget_and_accountant_and_whether_b_was_chosen():
    plan = plan_banded_noise(**_PLAN, bands=4, accountant="rdp")
    assert (plan.accountant, plan.target_epsilon, plan.delta, plan.bands_chosen) == ("rdp", 3.0, 1e-5, False)
    summary = plan.summary()
    assert "banded noise, b = 4" in summary and "chosen" not in summary
    assert "calibrated with rdp for epsilon = 3" in summary
    assert "cyclic Poisson sampling" in summary
    assert plan_banded_noise(**_PLAN, bands=1).summary().count("independent noise (DP-SGD)") == 1


def test_plan_is_silent_when_the_logger_is_silenced(caplog):
    logging.getLogger("adaclip.correlated.planning").setLevel(logging.WARNING)
    try:
        caplog.set_level(logging.INFO)
        plan_banded_noise(**_PLAN, bands=2)
    finally:
        logging.getLogger("adaclip.correlated.planning").setLevel(logging.NOTSET)
    assert not [r for r in caplog.records if r.name == "adaclip.correlated.planning"]


def _used_state(sigma):
    """The AdaClipState a transformation returns after an update that used ``sigma``."""
    import jax

    import adaclip_jax

    return adaclip_jax.AdaClipState(
        step=jnp.ones([], jnp.int32), key=jax.random.key(0), mean=None, std=None,
        nonfinite_steps=jnp.zeros([], jnp.int32), last_noise_multiplier=jnp.asarray(sigma, jnp.float32),
        seeded=jnp.asarray(True),
    )  # fmt: skip


@pytest.mark.jax
def test_jax_budget_refusal_says_the_budget_the_spend_and_the_rates():
    import adaclip_jax

    acc = Accountant("rdp", target_epsilon=1.0, delta=1e-5)
    tracker = adaclip_jax.PrivacyTracker(acc, sample_rate=0.5, noise_multiplier=0.8)
    with pytest.raises(BudgetExceededError) as refused:
        for _ in range(1000):
            tracker.step(lambda *, noise_multiplier: _used_state(noise_multiplier))
    text = str(refused.value)
    assert "the budget is epsilon=1 at delta=1e-05" in text
    assert f"{acc.steps} accounted step(s) have spent epsilon=" in text
    assert "q = 0.5, independent noise" in text and f"has run {tracker.steps} step(s)" in text
    assert "nothing was changed" in text


@pytest.mark.jax
def test_jax_tracker_warns_when_it_adopts_an_rdp_checkpoint():
    import adaclip_jax

    old = adaclip_jax.PrivacyTracker(Accountant("rdp"), sample_rate=0.1, noise_multiplier=1.0)
    old.step(lambda *, noise_multiplier: _used_state(noise_multiplier))
    new = adaclip_jax.PrivacyTracker(Accountant(), sample_rate=0.1, noise_multiplier=1.0)
    with pytest.warns(UserWarning, match="mechanism='rdp'"):
        new.load_state_dict(old.state_dict())
    assert new.accountant.mechanism == "rdp" and new.steps == 1
