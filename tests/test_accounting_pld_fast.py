"""PLD as the default accountant: the vectorised one-step PLD, the fast calibration, and the
default's hand-over to runs begun with RDP.

The maths is dp-accounting's; these tests check that what the library computes faster is the
same quantity (the one-step PLD bit for bit, the calibrated σ within its tolerance of
dp-accounting's own search), that the coarser calibration grid never gives a smaller ε than the
accountant's finer one, and that a resumed ``"rdp"`` run keeps ``"rdp"``.
"""

from __future__ import annotations

import json
import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting.pld import privacy_loss_distribution as P
from dp_accounting.pld.pld_privacy_accountant import PLDAccountant

from adaclip import accounting
from adaclip.accounting import Accountant, calibrate_noise_multiplier
from adaclip.accounting._events import _RELATION, _run_event
from adaclip.accounting._gaussian_pld import FAST_PATH_AVAILABLE, _VectorisedGaussianPrivacyLoss, gaussian_pld
from adaclip.errors import InvalidHyperparameterError
from adaclip.ledger import PrivacyLedger

DELTA = 1e-5


def _reference_pld(sigma, q, interval):
    return P.from_gaussian_mechanism(
        standard_deviation=sigma, value_discretization_interval=interval, sampling_prob=q, neighboring_relation=_RELATION
    )


def _dense(pmf):
    return pmf.to_dense_pmf() if hasattr(pmf, "to_dense_pmf") else pmf


def _same_pmf(a, b):
    da, db = _dense(a), _dense(b)
    if da._lower_loss != db._lower_loss or len(da._probs) != len(db._probs):
        return False
    ok_probs = np.allclose(da._probs, db._probs, rtol=1e-12, atol=0)
    ok_inf = math.isclose(da._infinity_mass, db._infinity_mass, rel_tol=1e-12, abs_tol=1e-300)
    return bool(ok_probs and ok_inf)


def _dp_accounting_epsilon(q, sigma, steps, interval=1e-4):
    """ε straight from dp-accounting's PLDAccountant (the reference the accountant must match)."""
    acc = PLDAccountant(neighboring_relation=_RELATION, value_discretization_interval=interval)
    return acc.compose(_run_event(q, sigma, steps)).get_epsilon(DELTA)


# ----------------------------------------------------------------------------- the one-step PLD


def test_the_vectorised_path_is_available_with_the_installed_dp_accounting():
    assert FAST_PATH_AVAILABLE


@pytest.mark.parametrize("sigma", [0.4, 0.8, 1.0, 2.5, 9.0])
@pytest.mark.parametrize("q", [1e-4, 0.00512, 0.1, 0.6, 1.0])
@pytest.mark.parametrize("interval", [1e-2, 1e-3])
def test_gaussian_pld_is_dp_accountings_pld(sigma, q, interval):
    ours, ref = gaussian_pld(sigma, q, interval), _reference_pld(sigma, q, interval)
    assert _same_pmf(ours._pmf_remove, ref._pmf_remove)
    assert _same_pmf(ours._pmf_add, ref._pmf_add)
    for steps in (1, 50):
        e_ours = ours.self_compose(steps).get_epsilon_for_delta(DELTA)
        e_ref = ref.self_compose(steps).get_epsilon_for_delta(DELTA)
        assert e_ours == pytest.approx(e_ref, rel=1e-9, abs=1e-12)


def test_gaussian_pld_on_the_accountants_grid():
    ours, ref = gaussian_pld(1.1, 256 / 60000, 1e-4), _reference_pld(1.1, 256 / 60000, 1e-4)
    assert _same_pmf(ours._pmf_remove, ref._pmf_remove) and _same_pmf(ours._pmf_add, ref._pmf_add)


def test_the_comparison_sees_a_different_pld():
    """Negative control: the comparison above fails for a PLD one part in a million off."""
    ours = gaussian_pld(1.0, 0.01, 1e-3)
    assert not _same_pmf(ours._pmf_remove, _reference_pld(1.0 + 1e-6, 0.01, 1e-3)._pmf_remove)
    assert not _same_pmf(ours._pmf_add, _reference_pld(1.0, 0.01 * (1 + 1e-6), 1e-3)._pmf_add)


@pytest.mark.parametrize("adjacency", ["ADD", "REMOVE"])
def test_vectorised_deltas_equal_the_scalar_ones_point_by_point(adjacency):
    from dp_accounting.pld import privacy_loss_mechanism as M

    kind = getattr(M.AdjacencyType, adjacency)
    fast = _VectorisedGaussianPrivacyLoss(0.9, sampling_prob=0.03, adjacency_type=kind)
    slow = M.GaussianPrivacyLoss(0.9, sampling_prob=0.03, adjacency_type=kind)
    # the whole range, the boundary ±log(1 − q) and ε = 0 included
    eps = np.concatenate([np.linspace(-0.2, 0.2, 801), [0.0, math.log(1 - 0.03), -math.log(1 - 0.03)]])
    got, want = fast.get_delta_for_epsilon(eps), slow.get_delta_for_epsilon(eps)
    assert np.allclose(got, want, rtol=1e-12, atol=1e-300)
    assert fast.get_delta_for_epsilon(0.05) == pytest.approx(slow.get_delta_for_epsilon(0.05), rel=1e-12)


def test_the_accountant_reports_dp_accountings_epsilon():
    acc = Accountant(target_epsilon=3.0, delta=DELTA)
    assert acc.mechanism == "pld"
    acc.step(noise_multiplier=0.8, sample_rate=0.01, num_steps=300)
    acc.step(noise_multiplier=1.2, sample_rate=0.02, num_steps=100)
    ref = PLDAccountant(neighboring_relation=_RELATION, value_discretization_interval=1e-4)
    ref.compose(dp_accounting.ComposedDpEvent([_run_event(0.01, 0.8, 300), _run_event(0.02, 1.2, 100)]))
    assert acc.epsilon() == pytest.approx(ref.get_epsilon(DELTA), rel=1e-9)


# ----------------------------------------------------------------------------- coarse >= fine

RUNS = [  # (q, σ, steps): the main job's plans (b = 1, 8, 32), MNIST's reference run, short runs
    (256 / 50000, 0.715, 1950),
    (8 * 256 / 50000, 1.2, 244),
    (32 * 256 / 50000, 2.05, 61),
    (256 / 60000, 1.1, 14062),
    (0.05, 0.9, 100),
    (0.3, 3.0, 20),
    (1.0, 5.0, 4),
]


@pytest.mark.parametrize("q, sigma, steps", RUNS)
def test_the_calibration_grid_never_reports_less_than_the_accountants(q, sigma, steps):
    fine = _dp_accounting_epsilon(q, sigma, steps, 1e-4)
    calibration = gaussian_pld(sigma, q, accounting.CALIBRATION_PLD_VALUE_DISCRETIZATION_INTERVAL)
    middle = calibration.self_compose(steps).get_epsilon_for_delta(DELTA)
    coarse = (
        gaussian_pld(sigma, q, accounting.COARSE_PLD_VALUE_DISCRETIZATION_INTERVAL)
        .self_compose(steps)
        .get_epsilon_for_delta(DELTA)
    )
    assert fine <= middle <= coarse
    assert middle <= fine * 1.005  # and only a hair more pessimistic


# ----------------------------------------------------------------------------- calibration


def _brent_pld_sigma(target, q, steps, interval):
    """dp-accounting's own calibration on the same grid (what the library did before)."""

    def fresh():
        return PLDAccountant(neighboring_relation=_RELATION, value_discretization_interval=interval)

    return dp_accounting.calibrate_dp_mechanism(
        fresh, lambda s: _run_event(q, s, steps), target, DELTA,
        bracket_interval=dp_accounting.ExplicitBracketInterval(0.05, 50.0), tol=1e-6,
    )  # fmt: skip


@pytest.mark.parametrize(
    "target, q, steps",
    [(3.0, 32 * 256 / 50000, 61), (1.0, 0.02, 400), (8.0, 0.1, 50), (0.5, 1.0, 3)],
)
def test_pld_calibration_is_tight_and_agrees_with_dp_accountings_search(target, q, steps):
    interval = accounting.CALIBRATION_PLD_VALUE_DISCRETIZATION_INTERVAL
    sigma = calibrate_noise_multiplier(target_epsilon=target, delta=DELTA, sample_rate=q, steps=steps)
    eps_at = lambda s: gaussian_pld(s, q, interval).self_compose(steps).get_epsilon_for_delta(DELTA)  # noqa: E731
    assert eps_at(sigma) <= target < eps_at(sigma / (1 + 1e-4))
    assert sigma == pytest.approx(_brent_pld_sigma(target, q, steps, interval), rel=1.5e-4)
    # and the run meets its budget as the accountant (grid 1e-4) reports it
    assert _dp_accounting_epsilon(q, sigma, steps) <= target


def test_pld_is_about_seven_percent_below_rdp_on_the_main_job():
    q, steps = 256 / 50000, 1950
    pld = calibrate_noise_multiplier(target_epsilon=3.0, delta=DELTA, sample_rate=q, steps=steps)
    rdp = calibrate_noise_multiplier(target_epsilon=3.0, delta=DELTA, sample_rate=q, steps=steps, accountant="rdp")
    assert pld == pytest.approx(0.7150, abs=2e-4)  # the 1e-4 grid's σ* is 0.7150
    assert rdp == pytest.approx(0.7637, abs=2e-4)
    assert 0.05 < 1 - pld / rdp < 0.08


def test_the_start_changes_the_search_not_the_answer():
    kwargs = dict(target_epsilon=2.0, delta=DELTA, sample_rate=0.03, steps=120)
    base = calibrate_noise_multiplier(**kwargs, tol=1e-5)
    accounting._calibration._cache.clear()
    for start in (0.05, 0.9, 40.0):
        got = calibrate_noise_multiplier(**kwargs, tol=1e-5, initial_sigma=start)
        accounting._calibration._cache.clear()
        assert got == pytest.approx(base, rel=2e-5)


@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf, math.nan, "1"])
def test_a_bad_start_is_refused(bad):
    with pytest.raises(InvalidHyperparameterError, match="initial_sigma"):
        calibrate_noise_multiplier(target_epsilon=2.0, delta=DELTA, sample_rate=0.03, steps=120, initial_sigma=bad)


def test_calibrations_are_cached_for_the_process(monkeypatch):
    kwargs = dict(target_epsilon=2.5, delta=DELTA, sample_rate=0.011, steps=77)
    first = calibrate_noise_multiplier(**kwargs)
    monkeypatch.setattr(accounting._calibration, "gaussian_pld", None)  # any evaluation would fail
    assert calibrate_noise_multiplier(**kwargs) == first
    with pytest.raises(TypeError):
        calibrate_noise_multiplier(**{**kwargs, "steps": 78})


# ----------------------------------------------------------------------------- the default's hand-over


def test_the_default_accountant_is_pld_and_a_named_one_is_kept():
    assert Accountant().mechanism == "pld"
    assert Accountant("rdp").mechanism == "rdp"
    assert Accountant(accountant="prv").mechanism == "pld"
    assert accounting.DEFAULT_MECHANISM == "pld"


def _rdp_state(steps=5):
    old = Accountant("rdp", target_epsilon=4.0, delta=DELTA)
    old.step(noise_multiplier=1.0, sample_rate=0.02, num_steps=steps)
    return old, json.loads(json.dumps(old.state_dict()))


def test_a_default_accountant_resumes_an_rdp_checkpoint_with_rdp():
    old, state = _rdp_state()
    new = Accountant()
    new.load_state_dict(state)
    assert new.mechanism == "rdp" and new.steps == 5
    assert new.epsilon(DELTA) == old.epsilon(DELTA)
    assert new.state_dict()["mechanism"] == "rdp"


def test_a_named_mechanism_or_a_ledger_refuses_another_mechanisms_checkpoint(tmp_path):
    _, state = _rdp_state()
    named = Accountant("pld")
    with pytest.raises(InvalidHyperparameterError, match="mechanism mismatch"):
        named.load_state_dict(state)
    assert named.mechanism == "pld" and named.steps == 0
    on_ledger = Accountant(ledger=str(tmp_path / "pld.ledger"))  # a ledger fixes the mechanism
    with pytest.raises(InvalidHyperparameterError, match="mechanism mismatch"):
        on_ledger.load_state_dict(state)
    assert on_ledger.mechanism == "pld" and on_ledger.steps == 0
    on_ledger.close()


def test_a_default_accountant_switches_back_and_forth_with_the_checkpoints_it_loads():
    old, state = _rdp_state()
    acc = Accountant()
    acc.step(noise_multiplier=1.0, sample_rate=0.02)
    pld_state = acc.state_dict()
    acc.load_state_dict(state)  # without a ledger the loaded history replaces the whole history
    assert acc.mechanism == "rdp" and acc.history == old.history
    acc.load_state_dict(pld_state)  # (e.g. a snapshot put back after another part refused)
    assert acc.mechanism == "pld" and acc.history == ((0.02, 1.0, 1),)


def test_a_refused_checkpoint_leaves_a_default_accountant_unchanged():
    _, state = _rdp_state()
    state["history"] = [[0.02, 1.0, -3]]  # invalid
    acc = Accountant()
    with pytest.raises(InvalidHyperparameterError):
        acc.load_state_dict(state)
    assert acc.mechanism == "pld" and acc.steps == 0


def test_a_default_accountant_opens_an_rdp_ledger_with_rdp_and_creates_pld_ones(tmp_path):
    path = tmp_path / "run.ledger"
    old = Accountant("rdp", ledger=path)
    old.step(noise_multiplier=1.0, sample_rate=0.02, num_steps=3)
    old.close()
    resumed = Accountant(ledger=path)
    assert resumed.mechanism == "rdp" and resumed.steps == 3
    resumed.close()
    with pytest.raises(InvalidHyperparameterError, match="mechanism"):
        Accountant("pld", ledger=path)
    with PrivacyLedger(path) as ledger:
        assert Accountant(ledger=ledger).mechanism == "rdp"
    fresh = Accountant(ledger=tmp_path / "new.ledger")
    assert fresh.mechanism == "pld" and fresh.ledger.mechanism == "pld"
    fresh.close()


# ----------------------------------------------------------------------------- the budget's screening


def _steps_until_refused(acc, q, sigma, limit=5000):
    for k in range(limit):
        if acc.would_exceed(noise_multiplier=sigma, sample_rate=q):
            return k
        acc.step(noise_multiplier=sigma, sample_rate=q)
    return limit


@pytest.mark.parametrize("q, sigma, target", [(0.02, 1.0, 1.0), (0.1, 2.0, 2.0)])
def test_the_screened_budget_refuses_exactly_where_the_fine_search_does(monkeypatch, q, sigma, target):
    screened = Accountant(target_epsilon=target, delta=DELTA)
    with_screen = _steps_until_refused(screened, q, sigma)
    monkeypatch.setattr(Accountant, "_screen", lambda self, q, sigma, limit: None)
    fine = Accountant(target_epsilon=target, delta=DELTA)
    assert _steps_until_refused(fine, q, sigma) == with_screen
    assert 0 < with_screen < 5000
    assert screened.epsilon() <= target < _dp_accounting_epsilon(q, sigma, with_screen + 1)


def test_a_screen_the_fine_grid_does_not_confirm_is_dropped(monkeypatch):
    """Negative control: a screening grid that under-reports ε would admit too many steps; the
    confirmation on the accountant's grid drops its answer and the fine search decides."""
    from adaclip.accounting import _pld

    q, sigma, target = 0.02, 1.0, 1.0
    honest = Accountant(target_epsilon=target, delta=DELTA)
    expected = honest.remaining_steps(noise_multiplier=sigma, sample_rate=q)
    real = _pld.PldComposer.candidate_epsilon

    def optimistic(self, runs, tail, *, replaces_last, delta):
        eps = real(self, runs, tail, replaces_last=replaces_last, delta=delta)
        return eps * 0.5 if self._interval == accounting.CALIBRATION_PLD_VALUE_DISCRETIZATION_INTERVAL else eps

    monkeypatch.setattr(_pld.PldComposer, "candidate_epsilon", optimistic)
    lied_to = Accountant(target_epsilon=target, delta=DELTA)
    assert lied_to._screen(q, sigma, 2**16) is None  # the fine grid refutes the screen's count
    assert lied_to.remaining_steps(noise_multiplier=sigma, sample_rate=q) == expected


def test_a_non_finite_divergence_falls_back_to_dp_accountings_own_path(monkeypatch):
    """If the vectorised evaluation ever produced a NaN, the scalar path builds the PLD."""
    from adaclip.accounting import _gaussian_pld

    real = _VectorisedGaussianPrivacyLoss.mu_upper_cdf
    monkeypatch.setattr(_VectorisedGaussianPrivacyLoss, "mu_upper_cdf", lambda self, x: real(self, x) * np.nan)
    got = _gaussian_pld.gaussian_pld(1.0, 0.01, 1e-3)
    ref = _reference_pld(1.0, 0.01, 1e-3)
    assert _same_pmf(got._pmf_remove, ref._pmf_remove) and _same_pmf(got._pmf_add, ref._pmf_add)


def test_an_accountant_pickled_before_the_default_yielded_keeps_its_mechanism():
    import pickle

    acc = Accountant("rdp")
    state = acc.__dict__.copy()
    del state["_mechanism_given"]  # as pickled by an earlier version
    old = Accountant.__new__(Accountant)
    old.__setstate__(pickle.loads(pickle.dumps(state)))
    _, pld_state = Accountant(), Accountant("pld").state_dict()
    with pytest.raises(InvalidHyperparameterError, match="mechanism mismatch"):
        old.load_state_dict(pld_state)
