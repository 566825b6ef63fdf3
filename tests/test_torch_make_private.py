"""make_private with Opacus's arguments, make_private_with_epsilon, and the up-front checks."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
    TensorDataset,
    WeightedRandomSampler,
)

import adaclip.accounting as accounting
from adaclip.errors import BudgetExceededError, InvalidGradientError, InvalidHyperparameterError
from adaclip_torch import (
    AdaClip,
    FlatClip,
    PerLayerClip,
    PoissonBatchSampler,
    ScaledClip,
    poisson_data_loader,
)
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
                                              max_grad_norm=0.5, strategy="flat", accountant="pld",
                                              noise_mechanism="independent")  # DP-SGD, as in Opacus
    assert isinstance(private, FlatClip) and private.strategy.max_grad_norm == 0.5
    assert fake_calibration == [
        {"target_epsilon": 2.0, "delta": DELTA, "sample_rate": pytest.approx(0.1), "steps": 30, "accountant": "pld",
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
    # ε(σ = 1.0, q = 0.1, 10 steps) ≈ 2.85 at δ = 1e-5 (PLD, the default): a budget of 2.5 fits fewer than 10 steps
    model, opt, loader = make_private(model, opt, loader, noise_multiplier=1.0, target_epsilon=2.5, delta=DELTA,
                                      strategy="flat", max_grad_norm=1.0, seed=0)
    assert opt.hyperparameters().noise_multiplier == 1.0
    assert (opt.accountant.target_epsilon, opt.accountant.delta) == (2.5, DELTA)
    with pytest.raises(BudgetExceededError):
        _train(model, opt, loader)
    assert 0 < opt.accountant.steps < 10 and opt.accountant.epsilon() <= 2.5


def test_noise_multiplier_with_a_budget_and_epochs_checks_the_plan(no_calibration):
    model, opt, loader = _parts()
    with pytest.raises(InvalidHyperparameterError, match=r"noise_multiplier=1.0 does not fit epochs=1.*2\.85"):
        make_private(model, opt, loader, noise_multiplier=1.0, target_epsilon=2.5, delta=DELTA, epochs=1)
    with pytest.raises(InvalidHyperparameterError, match=r"noise_multiplier=1.0 does not fit epochs=1.*3\.4"):
        make_private(model, opt, loader, noise_multiplier=1.0, target_epsilon=3.0, delta=DELTA, epochs=1, accountant="rdp")
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
    no_batch_size = DataLoader(ds, batch_sampler=[list(range(B)), list(range(B, 2 * B))])  # not a BatchSampler
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


# ----------------------------------------------------------------------------- the user's own sampler


class _Indexed(torch.utils.data.Dataset):
    """N examples; each returns its own index as its label, so a test sees which were trained on."""

    def __init__(self, n: int = N) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 6, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], torch.tensor(i)


HELD_OUT = range(100, N)  # examples 100..199 are kept out of training
SUBSET = list(range(100))  # q = B/100 = 0.2: 5 Poisson steps an epoch


def _seen(model, opt, loader, epochs: int) -> list[int]:
    """Train ``epochs`` passes; every dataset index a batch held, in order (with repeats)."""
    seen: list[int] = []
    for _ in range(epochs):
        for x, idx in loader:
            seen += idx.tolist()
            nn.functional.cross_entropy(model(x), idx % 3).backward()
            opt.step()
            opt.zero_grad()
    return seen


_SUBSET_LOADERS = {
    "SubsetRandomSampler": lambda ds: DataLoader(ds, batch_size=B, sampler=SubsetRandomSampler(SUBSET)),
    "shuffled indices": lambda ds: DataLoader(ds, batch_size=B, sampler=SubsetRandomSampler(SUBSET[::-1])),
    "a list as sampler": lambda ds: DataLoader(ds, batch_size=B, sampler=SUBSET),
    "BatchSampler(SubsetRandomSampler)": lambda ds: DataLoader(
        ds, batch_sampler=BatchSampler(SubsetRandomSampler(SUBSET), B, drop_last=True)
    ),
    "BatchSampler(RandomSampler(range(100)))": lambda ds: DataLoader(
        ds, batch_sampler=BatchSampler(RandomSampler(range(100)), B, drop_last=False)
    ),
    "SequentialSampler(range(100))": lambda ds: DataLoader(ds, batch_size=B, sampler=SequentialSampler(range(100))),
}


_SUBSET_CASES = [
    *[pytest.param(name, "independent", id=f"independent-{name}") for name in _SUBSET_LOADERS],
    *[pytest.param(name, noise, id=f"{noise}-{name}") for noise in ("banded", "blt")
      for name in ("SubsetRandomSampler", "BatchSampler(SubsetRandomSampler)")],
]


@pytest.mark.parametrize("loader_name, noise", _SUBSET_CASES)
def test_the_users_sampler_keeps_its_examples_and_n_is_the_subsets(loader_name, noise):
    """Issue 41 (7): a loader that samples examples 0..99 of 200 trains on those only, with
    N = 100, q = B/100 and B̄ = B (make_private used to Poisson-sample all 200)."""
    ds = _Indexed()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    extra = {
        "independent": {"noise_multiplier": 1.0, "noise_mechanism": "independent"},
        "banded": {"noise_multiplier": 1.0, "noise_mechanism": "banded", "bands": 2},
        "blt": {"target_epsilon": 8.0, "delta": DELTA, "epochs": 6, "noise_mechanism": "blt"},
    }[noise]
    model, private, loader = make_private(model, opt, _SUBSET_LOADERS[loader_name](ds), seed=0, **extra)
    seen = _seen(model, private, loader, epochs=6)
    assert not set(seen) & set(HELD_OUT), f"trained on {len(set(seen) & set(HELD_OUT))} held-out examples"
    assert set(seen) <= set(SUBSET)
    if noise == "blt":  # fixed order: every example of the subset once an epoch, none other
        assert sorted(seen) == sorted(SUBSET * 6)
    else:  # 6 epochs at q = 0.2: each example joins ~6 times (missed by all: 0.8^30 ≈ 1e-3)
        assert len(set(seen)) > 90
    assert private.sample_rate == pytest.approx(B / 100)
    assert private.expected_batch_size == pytest.approx(B)
    assert len(loader) == 5  # round(1/q) Poisson steps, or ⌈N/B⌉ fixed-order batches, of the subset
    assert loader.dataset is ds  # the original data set: dataset[i] is the example it was
    sampler = loader.batch_sampler
    assert sampler.num_samples == 100 and torch.equal(sampler.indices, torch.arange(100))
    assert sampler.expected_batch_size == pytest.approx(B)


class _Guarded(_Indexed):
    """Reading one of the held-out examples 0..99 raises."""

    def __getitem__(self, i: int):
        if i < 100:
            raise AssertionError(f"held-out example {i} was read")
        return super().__getitem__(i)


@pytest.mark.parametrize("noise", ["independent", "banded"])
def test_no_held_out_example_is_ever_read(no_calibration, noise):
    """Not even for the shapes of an empty Poisson batch (they come from a training example)."""
    ds = _Guarded()
    model = _model()
    loader = DataLoader(ds, batch_size=1, sampler=SubsetRandomSampler(range(100, N)))  # q = 0.01: empty batches
    model, private, loader = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), loader,
                                          noise_multiplier=1.0, seed=0, noise_mechanism=noise,
                                          **({"bands": 2} if noise == "banded" else {}))
    sizes = []
    for x, idx in loader:
        sizes.append(len(idx))
        nn.functional.cross_entropy(model(x), idx % 3).backward()
        private.step()
        private.zero_grad()
    assert len(sizes) == 100 and 0 in sizes


def test_the_users_subset_sets_the_calibration_and_the_delta_check(fake_calibration):
    """σ is calibrated for q = B/N_subset over epochs·round(1/q) steps; δ is checked against 1/N_subset."""
    ds = _Indexed()
    loader = DataLoader(ds, batch_size=B, sampler=SubsetRandomSampler(SUBSET))
    model = _model()
    make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), loader, target_epsilon=2.0, delta=DELTA,
                 epochs=3, noise_mechanism="independent")
    assert fake_calibration[0]["sample_rate"] == pytest.approx(0.2) and fake_calibration[0]["steps"] == 15
    model = _model()
    with pytest.raises(InvalidHyperparameterError, match=r"1/N = 1/100 "):
        make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), loader, target_epsilon=2.0, delta=0.02,
                     epochs=3)


@pytest.mark.parametrize("make_loader", [
    lambda ds: DataLoader(ds, batch_size=B),
    lambda ds: DataLoader(ds, batch_size=B, shuffle=True),
    lambda ds: DataLoader(ds, batch_size=B, sampler=SubsetRandomSampler(range(N))),
    lambda ds: DataLoader(ds, batch_sampler=BatchSampler(SequentialSampler(ds), B, drop_last=False)),
    lambda ds: DataLoader(ds, batch_size=B, sampler=RandomSampler(ds, num_samples=N)),
], ids=["sequential", "shuffle", "subset of all", "BatchSampler(SequentialSampler)", "num_samples=N"])
def test_a_sampler_over_the_whole_data_set_samples_all_of_it(no_calibration, make_loader):
    ds = _Indexed()
    model = _model()
    _, private, loader = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), make_loader(ds),
                                      noise_multiplier=1.0, seed=0)
    assert loader.batch_sampler.indices is None and loader.batch_sampler.num_samples == N
    assert private.sample_rate == pytest.approx(B / N) and len(loader) == 10
    assert "indices" not in loader.batch_sampler.state_dict()


def test_a_subset_of_a_subset_dataset_keeps_the_subsets_positions(no_calibration):
    """torch.utils.data.Subset as the dataset (the way the errors name) needs nothing else."""
    ds = _Indexed()
    loader = DataLoader(torch.utils.data.Subset(ds, list(range(50, 150))), batch_size=B, shuffle=True)
    model = _model()
    model, private, loader = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), loader,
                                          noise_multiplier=1.0, seed=0)
    assert private.sample_rate == pytest.approx(0.2)
    assert set(_seen(model, private, loader, epochs=3)) <= set(range(50, 150))


class _OwnSampler(torch.utils.data.Sampler):
    """A user's sampler: make_private must not iterate it (that would consume its randomness)."""

    def __init__(self) -> None:
        self.iterated = 0

    def __len__(self) -> int:
        return 50

    def __iter__(self):
        self.iterated += 1
        return iter(torch.randperm(N)[:50].tolist())


class _OwnRandomSampler(RandomSampler):
    pass


class _OwnBatchSampler(BatchSampler):
    pass


SUBSET_WAY = "torch.utils.data.Subset(dataset, indices)"
_REFUSED = {  # loader, what the error says, the way out it names
    "WeightedRandomSampler": (
        lambda ds: DataLoader(ds, batch_size=B, sampler=WeightedRandomSampler(torch.ones(N), N)),
        "WeightedRandomSampler.*unequal probabilities", SUBSET_WAY,
    ),
    "replacement=True": (
        lambda ds: DataLoader(ds, batch_size=B, sampler=RandomSampler(ds, replacement=True)), "replacement=True",
        "shuffle=True",
    ),
    "num_samples": (
        lambda ds: DataLoader(ds, batch_size=B, sampler=RandomSampler(ds, num_samples=50)), "num_samples=50",
        "Leave num_samples out",
    ),
    "repeated indices": (
        lambda ds: DataLoader(ds, batch_size=B, sampler=SubsetRandomSampler([*range(100), 7])), "repeated.*7",
        "sorted(set(indices))",
    ),
    "negative index": (
        lambda ds: DataLoader(ds, batch_size=B, sampler=SubsetRandomSampler([*range(99), -1])), ">= 0",
        "give dataset indices as they are",
    ),
    "index past the data set": (
        lambda ds: DataLoader(ds, batch_size=B, sampler=SubsetRandomSampler([*range(99), N])), "go up to 200",
        "(0 .. 199)",
    ),
    "no indices": (lambda ds: DataLoader(ds, batch_size=B, sampler=SubsetRandomSampler([])), "empty", "nothing"),
    "float indices": (
        lambda ds: DataLoader(ds, batch_size=B, sampler=SubsetRandomSampler([0.0, 1.0])), "sequence of ints",
        "ints",
    ),
    "own Sampler": (
        lambda ds: DataLoader(ds, batch_size=B, sampler=_OwnSampler()), "_OwnSampler.*cannot read", SUBSET_WAY
    ),
    "subclass": (
        lambda ds: DataLoader(ds, batch_size=B, sampler=_OwnRandomSampler(ds)), "subclass of RandomSampler",
        SUBSET_WAY,
    ),
    "DistributedSampler": (
        lambda ds: DataLoader(ds, batch_size=B, sampler=torch.utils.data.distributed.DistributedSampler(
            ds, num_replicas=2, rank=0)),
        "DistributedSampler.*not a fixed set", "distributed=True",
    ),
    "own batch sampler": (
        lambda ds: DataLoader(ds, batch_sampler=_OwnBatchSampler(SequentialSampler(ds), B, False)),
        "batch_sampler=_OwnBatchSampler", SUBSET_WAY,
    ),
    "BatchSampler(own Sampler)": (
        lambda ds: DataLoader(ds, batch_sampler=BatchSampler(_OwnSampler(), B, False)),
        "batch_sampler's sampler is a _OwnSampler", SUBSET_WAY,
    ),
    "no batches": (lambda ds: DataLoader(ds, batch_size=None), "fixed batch_size", SUBSET_WAY),
    "already private": (
        lambda ds: poisson_data_loader(ds, 0.1), "already samples with a PoissonBatchSampler", "the loader you built"
    ),
}


@pytest.mark.parametrize("make_loader, match, way", _REFUSED.values(), ids=_REFUSED.keys())
def test_samplers_that_are_not_a_set_of_examples_are_refused_before_anything(no_calibration, make_loader, match,
                                                                              way):
    """Refused with the reason and the way out, before anything is built; the user's sampler
    is not iterated (that would consume its randomness)."""
    ds = _Indexed()
    loader = make_loader(ds)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    groups = [dict(g) for g in opt.param_groups]
    with pytest.raises(InvalidHyperparameterError, match=match) as err:
        make_private(model, opt, loader, noise_multiplier=1.0, seed=0)
    assert way in str(err.value)
    assert not _hooked(model) and [dict(g) for g in opt.param_groups] == groups
    own = loader.sampler if loader.batch_size is not None else getattr(loader.batch_sampler, "sampler", None)
    assert getattr(own, "iterated", 0) == 0


def test_a_subset_loaders_sampler_state_resumes_only_over_the_same_examples(no_calibration):
    """The sampler's state carries the subset: a resume over the same examples repeats the
    batches, over other examples it is refused (it would mix two training sets in one run)."""
    ds = _Indexed()

    def build(indices, seed=0):
        model = _model()
        loader = DataLoader(ds, batch_size=B, sampler=SubsetRandomSampler(indices))
        return make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), loader, noise_multiplier=1.0,
                            seed=seed, noise_mechanism="banded", bands=2)[2]

    first = build(SUBSET)
    state = first.batch_sampler.state_dict()
    assert torch.equal(state["indices"], torch.arange(100))
    again = build(SUBSET[::-1], seed=5)
    again.batch_sampler.load_state_dict(state)
    # the loaders count what they hand out, so compare what they yield (each example's label is its index)
    assert [y.tolist() for _, y in again] == [y.tolist() for _, y in first]
    for other in (list(range(1, 101)), list(range(N))):
        with pytest.raises(InvalidHyperparameterError, match="another set of examples"):
            build(other).batch_sampler.load_state_dict(state)


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
