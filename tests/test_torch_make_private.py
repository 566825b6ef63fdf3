"""make_private with Opacus's arguments, make_private_with_epsilon, and the up-front checks."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler, TensorDataset

import adaclip.accounting as accounting
from adaclip.errors import BudgetExceededError, InvalidGradientError, InvalidHyperparameterError
from adaclip_torch import AdaClip, FlatClip, PerLayerClip, PoissonBatchSampler, ScaledClip
from adaclip_torch.privacy import make_private, make_private_with_epsilon

DELTA = 1e-5
N, B = 200, 20  # q = 0.1, 10 steps per epoch


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _dataset(n: int = N) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))


def _parts(batch_size: int = B, model: nn.Module | None = None):
    model = _model() if model is None else model
    return model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(_dataset(), batch_size=batch_size)


def _num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _initial_clip(strategy) -> float:
    """AdaCliP's clip norm at step 0: s0·sqrt(d) with s0 = sqrt(std_min·std_max)."""
    return math.sqrt(strategy.std_min * strategy.std_max)


@pytest.fixture
def no_calibration(monkeypatch):
    """Fail the test if σ is calibrated (make_private looks it up in adaclip.accounting)."""

    def refuse(**kwargs):
        raise AssertionError(f"calibrate_noise_multiplier was called with {kwargs}")

    monkeypatch.setattr(accounting, "calibrate_noise_multiplier", refuse)


@pytest.fixture
def fake_calibration(monkeypatch):
    """A fast stand-in for the calibration that records its arguments and returns 1.25."""
    calls = []

    def fake(**kwargs):
        calls.append(kwargs)
        return 1.25

    monkeypatch.setattr(accounting, "calibrate_noise_multiplier", fake)
    return calls


def _train(model, opt, loader, epochs=1):
    for _ in range(epochs):
        for x, y in loader:
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()


# ----------------------------------------------------------------------------- Opacus's make_private


@pytest.mark.parametrize("strategy, extra, cls", [
    ("adaclip", {}, AdaClip),
    ("flat", {}, FlatClip),
    ("per_layer", {}, PerLayerClip),
    ("scaled", {"layer_scales": [1.0, 0.5, 2.0, 1.0]}, ScaledClip),
])
def test_noise_multiplier_and_max_grad_norm_as_in_opacus(no_calibration, strategy, extra, cls):
    model, opt, loader = _parts()
    model, opt, loader = make_private(model, opt, loader, noise_multiplier=1.3, max_grad_norm=0.7,
                                      strategy=strategy, seed=0, **extra)
    assert isinstance(opt, cls)
    assert opt.hyperparameters().noise_multiplier == 1.3  # used as given, not calibrated
    assert opt.accountant.target_epsilon is None and opt.accountant.delta is None  # no budget
    assert isinstance(loader.batch_sampler, PoissonBatchSampler)
    assert loader.batch_sampler.sample_rate == pytest.approx(B / N)
    assert opt.expected_batch_size == pytest.approx(B)
    s = opt.strategy
    d = _num_params(model)
    if strategy == "adaclip":  # max_grad_norm is AdaCliP's initial clip norm
        assert _initial_clip(s) * math.sqrt(d) == pytest.approx(0.7)
    elif strategy == "per_layer":  # the total clip norm
        assert s.total_norm(4) == pytest.approx(0.7)
    else:
        assert s.max_grad_norm == 0.7
    _train(model, opt, loader)
    acct = opt.accountant
    assert acct.steps == 10 and acct.history == ((pytest.approx(0.1), 1.3, 10),)
    assert 0 < acct.epsilon(DELTA) < math.inf


def test_adaclip_initial_clip_matches_adaclip_initial_max_grad_norm(no_calibration):
    model, opt, loader = _parts()
    _, private, _ = make_private(model, opt, loader, noise_multiplier=1.0, max_grad_norm=0.3, seed=0,
                                 strategy="adaclip")
    other = _model()
    direct = AdaClip(torch.optim.SGD(other.parameters(), lr=0.1), other, initial_max_grad_norm=0.3,
                     noise_multiplier=1.0, expected_batch_size=B, seed=0)
    assert private.strategy == direct.strategy


def test_the_default_strategy_is_flat_clipping_at_c_1():
    """The round-two benchmark's best configuration without tuning: DP-SGD with C = 1."""
    model, opt, loader = _parts()
    _, private, _ = make_private(model, opt, loader, noise_multiplier=1.0, seed=0)
    assert type(private) is FlatClip and private.strategy.max_grad_norm == 1.0


def test_target_epsilon_with_max_grad_norm_and_adaclip():
    """Used to raise TypeError (AdaClip has no max_grad_norm) after calibrating σ."""
    model, opt, loader = _parts()
    model, opt, loader = make_private(model, opt, loader, target_epsilon=3, delta=DELTA, epochs=1,
                                      max_grad_norm=1.0, seed=0, strategy="adaclip", preset="patent",
                                      noise_mechanism="independent")
    assert isinstance(opt, AdaClip)
    assert _initial_clip(opt.strategy) * math.sqrt(_num_params(model)) == pytest.approx(1.0)
    sigma = accounting.calibrate_noise_multiplier(target_epsilon=3, delta=DELTA, sample_rate=0.1, steps=10)
    assert opt.hyperparameters().noise_multiplier == pytest.approx(sigma)
    assert opt.accountant.target_epsilon == 3 and opt.accountant.delta == DELTA
    _train(model, opt, loader)
    assert opt.accountant.epsilon() <= 3


def test_make_private_with_epsilon_takes_opacus_names(fake_calibration):
    model, opt, loader = _parts()
    _, private, _ = make_private_with_epsilon(model, opt, loader, target_epsilon=2.0, target_delta=DELTA, epochs=3,
                                              max_grad_norm=0.5, strategy="flat", mechanism="pld",
                                              noise_mechanism="independent")  # DP-SGD, as in Opacus
    assert isinstance(private, FlatClip) and private.strategy.max_grad_norm == 0.5
    assert fake_calibration == [
        {"target_epsilon": 2.0, "delta": DELTA, "sample_rate": pytest.approx(0.1), "steps": 30, "mechanism": "pld",
         "progress": None}
    ]
    assert private.hyperparameters().noise_multiplier == 1.25
    assert private.accountant.mechanism == "pld"
    assert (private.accountant.target_epsilon, private.accountant.delta) == (2.0, DELTA)
    # delta= is accepted too, and make_private takes target_delta=
    model, opt, loader = _parts()
    make_private_with_epsilon(model, opt, loader, target_epsilon=2.0, delta=DELTA, epochs=1)
    model, opt, loader = _parts()
    _, private, _ = make_private(model, opt, loader, target_epsilon=2.0, target_delta=DELTA, epochs=1)
    assert private.accountant.delta == DELTA


def test_noise_multiplier_with_a_budget_is_not_calibrated_and_caps_the_run(no_calibration):
    model, opt, loader = _parts()
    # ε(σ = 1.0, q = 0.1, 10 steps) ≈ 3.44 at δ = 1e-5: a budget of 3.0 fits fewer than 10 steps
    model, opt, loader = make_private(model, opt, loader, noise_multiplier=1.0, target_epsilon=3.0, delta=DELTA,
                                      strategy="flat", max_grad_norm=1.0, seed=0)
    assert opt.hyperparameters().noise_multiplier == 1.0
    assert (opt.accountant.target_epsilon, opt.accountant.delta) == (3.0, DELTA)
    with pytest.raises(BudgetExceededError):
        _train(model, opt, loader)
    assert 0 < opt.accountant.steps < 10 and opt.accountant.epsilon() <= 3.0


def test_noise_multiplier_with_a_budget_and_epochs_checks_the_plan(no_calibration):
    model, opt, loader = _parts()
    with pytest.raises(InvalidHyperparameterError, match=r"noise_multiplier=1.0 does not fit epochs=1.*3\.4"):
        make_private(model, opt, loader, noise_multiplier=1.0, target_epsilon=3.0, delta=DELTA, epochs=1)
    assert not _hooked(model)
    _, private, _ = make_private(model, opt, loader, noise_multiplier=1.0, target_epsilon=4.0, delta=DELTA, epochs=1)
    assert private.accountant.target_epsilon == 4.0


def test_batch_size_larger_than_the_data_set_is_refused(no_calibration):
    model, opt, loader = _parts(batch_size=N + 1)
    with pytest.raises(InvalidHyperparameterError, match="batch_size=201 is larger than the data set"):
        make_private(model, opt, loader, noise_multiplier=1.0)
    model, opt, loader = _parts(batch_size=N)  # q = 1 is fine
    _, private, loader = make_private(model, opt, loader, noise_multiplier=1.0)
    assert private.sample_rate == 1.0 and len(loader) == 1


# ----------------------------------------------------------------------------- checked before anything


def _hooked(model: nn.Module) -> bool:
    return any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks for m in model.modules())


E = {"target_epsilon": 2.0, "delta": DELTA, "epochs": 1}  # a valid ε-targeted call
S = {"noise_multiplier": 1.0}  # a valid σ call


@pytest.mark.parametrize("kwargs, name", [
    ({**E, "strategy": "nope"}, "strategy"),
    ({**E, "strategy": None}, "strategy"),
    ({**E, "mechanism": "gdp"}, "mechanism"),  # "prv" is accepted (computed as "pld"), "gdp" refused
    ({**E, "epochs": 0}, "epochs"),
    ({**E, "epochs": 1.5}, "epochs"),
    ({**E, "epochs": True}, "epochs"),
    ({"target_epsilon": 2.0, "delta": DELTA}, "epochs"),
    ({**E, "delta": 0.0}, "delta"),
    ({**E, "delta": 1.0}, "delta"),
    ({**E, "delta": math.nan}, "delta"),
    ({"target_epsilon": 2.0, "epochs": 1}, "delta"),
    ({**E, "delta": None, "target_delta": 2.0}, "target_delta"),
    ({**E, "target_delta": DELTA}, "target_delta"),
    ({**E, "target_epsilon": 0.0}, "target_epsilon"),
    ({**E, "target_epsilon": -1.0}, "target_epsilon"),
    ({**E, "target_epsilon": math.inf}, "target_epsilon"),
    ({**E, "target_epsilon": "3"}, "target_epsilon"),
    ({}, "target_epsilon"),
    ({"noise_multiplier": -1.0}, "noise_multiplier"),
    ({"noise_multiplier": math.nan}, "noise_multiplier"),
    ({"noise_multiplier": "1"}, "noise_multiplier"),
    ({**E, "noise_multiplier": 0.0}, "noise_multiplier"),
    ({**S, "delta": DELTA}, "delta"),
    ({**S, "target_delta": DELTA}, "target_delta"),
    ({**S, "epochs": 2}, "epochs"),
    ({**E, "max_grad_norm": 0.0}, "max_grad_norm"),
    ({**E, "max_grad_norm": -1.0}, "max_grad_norm"),
    ({**E, "max_grad_norm": math.inf}, "max_grad_norm"),
    ({**E, "strategy": "flat", "std_min": 1e-3}, "std_min"),
    ({**E, "strategy": "adaclip", "layer_scales": [1.0]}, "layer_scales"),
    ({**E, "strategy": "flat", "typo_keyword": 1}, "typo_keyword"),
    ({**E, "clipping": "flat"}, "clipping"),
    ({**E, "poisson_sampling": False}, "poisson_sampling"),
    ({**E, "noise_schedule": None}, "noise_schedule"),
    ({**E, "expected_batch_size": 5}, "expected_batch_size"),
    ({**E, "accountant": 3}, "accountant"),  # a name, as Opacus's accountant=
    ({**E, "sample_rate": 0.1}, "sample_rate"),
    ({**E, "strategy": "scaled", "max_grad_norm": 1.0}, "layer_scales"),
    ({**E, "strategy": "scaled", "layer_scales": [1.0] * 4}, "max_grad_norm"),
    ({**E, "strategy": "scaled", "max_grad_norm": 1.0, "layer_scales": [1.0, -1.0, 1.0, 1.0]}, "layer_scales"),
    ({**E, "strategy": "scaled", "max_grad_norm": 1.0, "layer_scales": 3}, "layer_scales"),
    ({**E, "strategy": "per_layer"}, "max_grad_norm"),
    ({**E, "strategy": "per_layer", "max_grad_norm": 1.0, "group_max_grad_norms": [1.0] * 4}, "group_max_grad_norms"),
    ({**E, "strategy": "per_layer", "group_max_grad_norms": [1.0, 0.0, 1.0, 1.0]}, "group_max_grad_norms"),
    ({**E, "max_grad_norm": 1.0, "std_min": 1e-3}, "std_min"),
    ({**E, "max_grad_norm": 1.0, "initial_max_grad_norm": 1.0}, "initial_max_grad_norm"),
    ({**E, "initial_max_grad_norm": 1.0, "std_max": 1.0}, "initial_max_grad_norm"),
    ({**E, "strategy": "adaclip", "initial_max_grad_norm": 1.0, "std_spread": 0.5}, "spread"),
    ({**E, "std_min": 2.0, "std_max": 1.0}, "std_min"),
    ({**E, "beta_std": 1.0}, "beta_std"),
    ({**E, "per_sample_mode": "fast"}, "per_sample_mode"),
    ({**E, "nonfinite": "ignore"}, "nonfinite"),
    ({**E, "loss_reduction": "avg"}, "loss_reduction"),
    ({**E, "seed": -1}, "seed"),
    ({**E, "seed": 1, "secure_mode": True}, "seed"),
    ({**E, "delta": 0.5}, "1/N"),  # δ ≥ 1/N (N = 200) protects no one
    ({**E, "delta": 1 / N}, "1/N"),
    ({**E, "target_delta": 0.01, "delta": None}, "target_delta=0.01 is at least 1/N"),
    ({**E, "allow_large_delta": 1}, "allow_large_delta"),
])
def test_bad_arguments_are_refused_before_calibration_and_before_building(no_calibration, kwargs, name):
    model, opt, loader = _parts()
    groups = [dict(g) for g in opt.param_groups]
    with pytest.raises(InvalidHyperparameterError, match=name):
        make_private(model, opt, loader, **kwargs)
    assert not _hooked(model)
    assert [dict(g) for g in opt.param_groups] == groups
    assert not hasattr(next(model.parameters()), "grad_sample")


def test_loader_model_and_optimizer_are_checked_before_calibration(no_calibration):
    model, opt, _ = _parts()
    ds = _dataset()
    no_batch_size = DataLoader(ds, batch_sampler=BatchSampler(SequentialSampler(ds), B, drop_last=False))
    with pytest.raises(InvalidHyperparameterError, match="batch_size"):
        make_private(model, opt, no_batch_size, **E)
    with pytest.raises(InvalidHyperparameterError, match="data_loader"):
        make_private(model, opt, list(ds), **E)
    bn = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))
    with pytest.raises(InvalidHyperparameterError, match="BatchNorm"):
        make_private(bn, torch.optim.SGD(bn.parameters(), lr=0.1), DataLoader(ds, batch_size=B), **E)
    private = FlatClip(opt, model, noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=B)
    with pytest.raises(InvalidHyperparameterError, match="optimizer"):
        make_private(model, private, DataLoader(ds, batch_size=B), **E)


def test_make_private_with_epsilon_refuses_a_noise_multiplier_and_needs_delta(no_calibration):
    model, opt, loader = _parts()
    with pytest.raises(InvalidHyperparameterError, match="noise_multiplier"):
        make_private_with_epsilon(model, opt, loader, target_epsilon=2.0, target_delta=DELTA, epochs=1,
                                  noise_multiplier=1.0)
    with pytest.raises(InvalidHyperparameterError, match="target_delta"):
        make_private_with_epsilon(model, opt, loader, target_epsilon=2.0, epochs=1)
    assert not _hooked(model)


def test_a_large_delta_is_taken_only_when_asked_for():
    model, opt, loader = _parts()
    _, private, _ = make_private(model, opt, loader, **{**E, "delta": 0.5}, allow_large_delta=True)
    assert private.accountant.delta == 0.5


def test_opacus_module_keyword_is_the_model():
    """make_private(module=..., optimizer=..., data_loader=...): Opacus's keywords work."""
    model, opt, loader = _parts()
    got, private, _ = make_private(module=model, optimizer=opt, data_loader=loader, noise_multiplier=1.0,
                                   max_grad_norm=1.0)
    assert got is model and private.model is model
    other, opt2, loader2 = _parts(model=_model(1))
    with pytest.raises(InvalidHyperparameterError, match="not both"):
        make_private(other, opt2, loader2, module=other, noise_multiplier=1.0)
    with pytest.raises(InvalidHyperparameterError, match="missing: optimizer"):
        make_private(module=other, data_loader=loader2, noise_multiplier=1.0)
    assert not _hooked(other)
    got, private, _ = make_private_with_epsilon(module=other, optimizer=opt2, data_loader=loader2,
                                                target_epsilon=2.0, target_delta=DELTA, epochs=1)
    assert got is other and private.model is other


# ----------------------------------------------------------------------------- the loader the steps release


def _frozen(opt, model, sampler) -> tuple:
    """What a refused step must leave as it was (parameters, steps, noise generator, accountant,
    the sampler's counters)."""
    return (
        [p.detach().clone() for p in model.parameters()],
        opt.steps,
        opt._noise.get_state().clone(),
        (opt.accountant.steps, opt.accountant.history),
        getattr(sampler, "position", None),
        getattr(getattr(sampler, "draws", None), "delivered", None),
    )


def _assert_same(a: tuple, b: tuple) -> None:
    for x, y in zip(a[0], b[0], strict=True):
        assert torch.equal(x, y)
    assert torch.equal(a[2], b[2])
    assert a[1] == b[1] and a[3:] == b[3:]


@pytest.mark.parametrize("noise_mechanism", ["auto", "independent"])
def test_steps_on_the_users_own_loader_are_refused_with_one_band(noise_mechanism):
    """Hole (issue 41, item 4): with b = 1 (auto on a short run, or independent noise) the
    optimizer held no sampler, so training on one's own shuffling, fixed-size loader
    ('model, optimizer, _ = make_private(...)') was accounted as Poisson sampling without an
    error (with b > 1 it was refused at step 0). The optimizer now holds the Poisson sampler it
    is accounted for and every step must release the next batch of the returned loader."""
    model, opt, loader = _parts()
    own = DataLoader(_dataset(), batch_size=B, shuffle=True)
    model, private, returned = make_private(model, opt, own, target_epsilon=0.5, delta=DELTA, epochs=1,
                                            noise_mechanism=noise_mechanism, seed=0)  # fmt: skip
    assert private.noise_mechanism == "independent" and isinstance(returned.batch_sampler, PoissonBatchSampler)
    x, y = next(iter(own))
    nn.functional.cross_entropy(model(x), y).backward()
    before = _frozen(private, model, returned.batch_sampler)
    with pytest.raises(InvalidGradientError, match="make_private"):
        private.step()
    _assert_same(before, _frozen(private, model, returned.batch_sampler))
    private.zero_grad()
    _train(model, private, returned)  # the returned loader: every step on its next batch
    assert private.steps == private.accountant.steps == N // B
    assert private._sampler is returned.batch_sampler


def test_a_skipped_or_repeated_batch_of_the_returned_loader_is_refused_with_one_band():
    """The same exact check as banded noise: with plain Poisson sampling a skipped batch is a
    selection of draws the accountant does not know of, a repeated one two releases on one draw.
    With workers too (the loader counts what it hands out)."""
    model, opt, loader = _parts()
    loader = DataLoader(_dataset(), batch_size=B, num_workers=2)
    model, private, loader = make_private(model, opt, loader, noise_multiplier=1.0, seed=0)
    seen = 0
    with pytest.raises(InvalidGradientError, match="skipped"):
        for x, y in loader:
            seen += 1
            if seen == 4:
                continue  # skipped
            nn.functional.cross_entropy(model(x), y).backward()
            before = _frozen(private, model, loader.batch_sampler)
            try:
                private.step()
            except InvalidGradientError:
                _assert_same(before, _frozen(private, model, loader.batch_sampler))
                raise
            private.zero_grad()
    assert private.steps == 3
    model, opt, loader = _parts()
    model, private, loader = make_private(model, opt, loader, noise_multiplier=1.0, seed=0)
    x, y = next(iter(loader))
    nn.functional.cross_entropy(model(x), y).backward()
    private.step()
    nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(InvalidGradientError, match="stepped exactly once"):
        private.step()
    assert private.steps == 1


@pytest.mark.parametrize("banded", [False, True])
def test_checkpoints_restore_the_sampler_counters_with_the_optimizer(banded):
    """Saving the optimizer and the sampler and restoring both resumes the check where it was
    (the sampler saves the batches the loop received, not what workers prefetched). With banded
    noise step t must release draw t, so restoring the optimizer alone (a fresh sampler at 0)
    is refused at the next step, naming the fix; independent noise has no schedule, so a fresh
    sampler's batches are as good (a run restarted after a crash from the optimizer's checkpoint
    goes on), each step still on exactly one new batch of the loader."""
    mechanism = {"noise_mechanism": "banded", "bands": 2} if banded else {"noise_mechanism": "independent"}
    model, opt, loader = _parts()
    model, private, loader = make_private(model, opt, loader, noise_multiplier=1.0, seed=0, **mechanism)
    for k, (x, y) in enumerate(loader):
        nn.functional.cross_entropy(model(x), y).backward()
        private.step()
        private.zero_grad()
        if k == 3:
            break
    saved, sampler_state = private.state_dict(), loader.batch_sampler.state_dict()
    assert sampler_state["position"] == private.steps == 4
    for restore_sampler in (True, False):
        model2, opt2, loader2 = _parts()
        model2, private2, loader2 = make_private(model2, opt2, loader2, noise_multiplier=1.0, **mechanism)
        private2.load_state_dict(saved)
        if restore_sampler:
            loader2.batch_sampler.load_state_dict(sampler_state)
        if restore_sampler or not banded:
            _train(model2, private2, loader2)
            assert private2.steps == 4 + N // B
            continue
        x, y = next(iter(loader2))
        nn.functional.cross_entropy(model2(x), y).backward()
        with pytest.raises(InvalidGradientError, match="load_state_dict"):
            private2.step()
