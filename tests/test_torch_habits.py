"""What an Opacus user types on day one: it works as they expect, or fails naming our equivalent.

One section per habit: make_private's Opacus keywords; the optimizer's Opacus attributes and
``get_epsilon``; ``accountant="prv"``/``"gdp"`` (checked live against Opacus's own PRV
accountant); ``BatchMemoryManager``; ``ModuleValidator.fix``/``validate``; the default
``per_sample_mode``; progress output of long accounting work; and the Opacus migration page's
claims (every default it states against the signatures, the checkpoint paragraph).
"""

from __future__ import annotations

import ast
import inspect
import math
import pathlib
import re
import sys
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Sampler, TensorDataset

import adaclip.accounting as accounting
import adaclip_torch
from adaclip.errors import InvalidGradientError, InvalidHyperparameterError
from adaclip_torch import (
    AdaClip,
    BatchMemoryManager,
    DPOptimizer,
    FlatClip,
    PerLayerClip,
    PoissonUserBatchSampler,
    QuantileClip,
    make_private,
    make_private_with_epsilon,
)
from adaclip_torch.data import empty_batch_collate, poisson_data_loader
from adaclip_torch.engines import GhostEngine, MaterialisedEngine
from adaclip_torch.validation import fix, group_norm_groups, validate

ROOT = pathlib.Path(__file__).resolve().parents[1]
OPACUS_PAGE = ROOT / "docs" / "migration" / "opacus.md"
DELTA = 1e-5
N, B = 256, 64  # q = 0.25: 4 logical batches per pass


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _dataset(n: int = N) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))


def _parts(seed: int = 0, batch_size: int = B):
    model = _model(seed)
    return model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(_dataset(), batch_size=batch_size)


def _train_one_pass(model: nn.Module, optimizer: DPOptimizer, loader) -> list[int]:
    """Opacus's loop; returns the size of every batch it saw."""
    criterion = nn.CrossEntropyLoss()
    sizes = []
    for x, y in loader:
        optimizer.zero_grad()
        criterion(model(x), y).backward()
        optimizer.step()
        sizes.append(len(x))
    return sizes


# --------------------------------------------------------------------------- make_private's keywords


@pytest.mark.parametrize("how", ["keywords", "model_positional", "two_positional", "all_positional"])
def test_make_private_takes_opacus_keywords_and_positional_mixes(how):
    model, opt, loader = _parts()
    kwargs = dict(noise_multiplier=1.1, max_grad_norm=1.0)
    if how == "keywords":  # Opacus's PrivacyEngine.make_private takes only keywords
        out = make_private(module=model, optimizer=opt, data_loader=loader, **kwargs)
    elif how == "model_positional":
        out = make_private(model, optimizer=opt, data_loader=loader, **kwargs)
    elif how == "two_positional":
        out = make_private(model, opt, data_loader=loader, **kwargs)
    else:
        out = make_private(model, opt, loader, **kwargs)
    private_model, private, private_loader = out
    assert private_model is model and type(private) is FlatClip
    assert private.noise_multiplier == 1.1 and private.max_grad_norm == 1.0
    assert _train_one_pass(private_model, private, private_loader)


def test_make_private_with_epsilon_takes_opacus_keywords(monkeypatch):
    monkeypatch.setattr(accounting, "calibrate_noise_multiplier", lambda **kw: 1.3)
    model, opt, loader = _parts()
    _, private, _ = make_private_with_epsilon(
        module=model, optimizer=opt, data_loader=loader, target_epsilon=3.0, target_delta=DELTA, epochs=2,
        max_grad_norm=0.5,
    )
    assert type(private) is FlatClip and private.noise_multiplier == 1.3 and private.max_grad_norm == 0.5


def test_make_private_refuses_module_and_model_together():
    model, opt, loader = _parts()
    with pytest.raises(InvalidHyperparameterError, match="module="):
        make_private(model, opt, loader, module=model, noise_multiplier=1.0)


# --------------------------------------------------------------------------- the optimizer's attributes


def test_opacus_attributes_are_readable():
    model, opt, loader = _parts()
    model, private, loader = make_private(module=model, optimizer=opt, data_loader=loader,
                                          noise_multiplier=1.1, max_grad_norm=0.7)  # fmt: skip
    assert private.noise_multiplier == 1.1
    assert private.max_grad_norm == 0.7
    assert private.expected_batch_size == pytest.approx(B)
    assert private.sample_rate == pytest.approx(B / N)
    assert private.get_epsilon(DELTA) == 0.0
    _train_one_pass(model, private, loader)
    eps = private.get_epsilon(DELTA)
    assert eps > 0 and eps == private.accountant.epsilon(DELTA)


@pytest.mark.parametrize("name, hint", [
    ("noise_multiplier", "noise_schedule"),
    ("max_grad_norm", "noise_schedule"),
    ("expected_batch_size", "BatchMemoryManager"),
    ("sample_rate", "new wrapper"),
])  # fmt: skip
def test_assigning_an_opacus_attribute_is_refused_and_names_the_way(name, hint):
    model, opt, loader = _parts()
    _, private, _ = make_private(model, opt, loader, noise_multiplier=1.1, max_grad_norm=0.7)
    before = getattr(private, name)
    with pytest.raises(InvalidHyperparameterError, match=hint) as info:
        setattr(private, name, 2 * before)
    assert isinstance(info.value, AttributeError)  # as Python's read-only attributes
    assert getattr(private, name) == before


def test_max_grad_norm_for_each_strategy():
    def build(cls, **kw):
        model = _model()
        return cls(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=1.0,
                   expected_batch_size=64.0, **kw)  # fmt: skip

    assert build(PerLayerClip, max_grad_norm=2.0).max_grad_norm == 2.0  # the total C
    assert build(QuantileClip, max_grad_norm=0.3).max_grad_norm == pytest.approx(0.3)  # C_t of the next step
    grouped = build(PerLayerClip, group_max_grad_norms=[1.0, 0.5, 1.0, 0.5])
    with pytest.raises(AttributeError, match="group_max_grad_norms"):
        grouped.max_grad_norm  # noqa: B018
    for preset in ("centred", "patent"):
        ada = build(AdaClip, preset=preset)
        with pytest.raises(InvalidHyperparameterError, match="centre_and_scale") as info:
            ada.max_grad_norm  # noqa: B018
        assert isinstance(info.value, AttributeError)
        assert getattr(ada, "max_grad_norm", None) is None  # generic code sees a missing attribute
        assert ada.noise_multiplier == 1.0 and ada.expected_batch_size == 64.0


def test_noise_multiplier_follows_a_schedule():
    from adaclip.schedules import ConstantSchedule, Retune

    model = _model()
    sched = Retune(ConstantSchedule(2.0), at_step=1, noise_multiplier=1.0)
    opt = FlatClip(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_schedule=sched, expected_batch_size=4.0)
    assert opt.noise_multiplier == 2.0
    opt.step(empty_batch=True)
    assert opt.noise_multiplier == 1.0


def test_get_epsilon_without_an_accountant_names_how_to_attach_one():
    model = _model()
    opt = FlatClip(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=1.0, expected_batch_size=4.0)
    with pytest.raises(InvalidHyperparameterError, match="accountant="):
        opt.get_epsilon(DELTA)


# --------------------------------------------------------------------------- accountant="prv" / "gdp"

PRV_CASES = [  # (q, σ, T, δ)
    (256 / 60000, 1.1, 14062, 1e-5),
    (0.01, 1.0, 1000, 1e-5),
    (0.1, 2.0, 100, 1e-6),
    (0.04, 1.5, 500, 1e-5),
]
#: |ε_ours − ε_Opacus|: Opacus's PRV accountant returns its estimate plus its error control
#: (eps_error = 0.01 by default), dp-accounting's PLD the pessimistic discretisation (1e-4); twice
#: Opacus's eps_error covers both.
PRV_TOLERANCE = 0.02


@pytest.mark.parametrize("q, sigma, steps, delta", PRV_CASES)
def test_prv_epsilon_matches_opacus_prv_accountant(q, sigma, steps, delta):
    opacus_accountants = pytest.importorskip("opacus.accountants")
    theirs = opacus_accountants.PRVAccountant()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # Opacus's PRV logs log(0) at q = 1 edges
        for _ in range(3):  # as Opacus records them: one step at a time (one run of `steps` in all)
            theirs.step(noise_multiplier=sigma, sample_rate=q)
        theirs.history = [(sigma, q, steps)]
        eps_opacus = theirs.get_epsilon(delta)
    ours = accounting.Accountant(accountant="prv")
    ours.step(noise_multiplier=sigma, sample_rate=q, num_steps=steps)
    eps_ours = ours.epsilon(delta)
    assert ours.mechanism == "pld"
    assert abs(eps_ours - eps_opacus) <= PRV_TOLERANCE, (eps_ours, eps_opacus)


def test_accountant_keyword_in_make_private_and_accountant():
    model, opt, loader = _parts()
    _, private, _ = make_private(model, opt, loader, noise_multiplier=1.0, accountant="prv")
    assert private.accountant.mechanism == "pld"
    model, opt, loader = _parts()
    _, private, _ = make_private(model, opt, loader, noise_multiplier=1.0, mechanism="prv")
    assert private.accountant.mechanism == "pld"
    assert accounting.Accountant("prv").mechanism == accounting.Accountant(accountant="prv").mechanism == "pld"
    assert accounting.Accountant(accountant="rdp").mechanism == "rdp"


def test_make_private_with_epsilon_calibrates_with_prv(monkeypatch):
    calls = []

    def fake(**kwargs):
        calls.append(kwargs)
        return 1.2

    monkeypatch.setattr(accounting, "calibrate_noise_multiplier", fake)
    model, opt, loader = _parts()
    _, private, _ = make_private_with_epsilon(model, opt, loader, target_epsilon=3.0, target_delta=DELTA, epochs=1,
                                              accountant="prv")  # fmt: skip
    assert calls[0]["accountant"] == "pld" and private.accountant.mechanism == "pld"


def test_calibration_accepts_prv():
    rdp = accounting.calibrate_noise_multiplier(target_epsilon=2.0, delta=DELTA, sample_rate=0.5, steps=3)
    prv = accounting.calibrate_noise_multiplier(
        target_epsilon=2.0, delta=DELTA, sample_rate=0.5, steps=3, accountant="prv", tol=1e-2
    )
    assert 0 < prv <= rdp * 1.01  # PLD is the tighter bound


@pytest.mark.parametrize("call", [
    lambda: accounting.Accountant("gdp"),
    lambda: accounting.Accountant(accountant="gdp"),
    lambda: accounting.calibrate_noise_multiplier(target_epsilon=1.0, delta=DELTA, sample_rate=0.1, steps=10,
                                                  accountant="gdp"),
    lambda: make_private(*_parts(), noise_multiplier=1.0, accountant="gdp"),
    lambda: make_private(*_parts(), noise_multiplier=1.0, mechanism="gdp"),
])  # fmt: skip
def test_gdp_is_refused_with_the_reason_and_the_alternatives(call):
    with pytest.raises(InvalidHyperparameterError) as info:
        call()
    message = str(info.value)
    assert "not an upper bound" in message and "'pld'" in message and "'prv'" in message


def test_mechanism_and_accountant_must_agree():
    with pytest.raises(InvalidHyperparameterError, match="different accounting methods"):
        accounting.Accountant("pld", accountant="rdp")
    model, opt, loader = _parts()
    groups = [dict(g) for g in opt.param_groups]
    with pytest.raises(InvalidHyperparameterError, match="different accounting methods"):
        make_private(model, opt, loader, noise_multiplier=1.0, mechanism="pld", accountant="rdp")
    assert [dict(g) for g in opt.param_groups] == groups and not hasattr(model[0].weight, "grad_sample")
    with pytest.raises(InvalidHyperparameterError, match="wrapper"):
        make_private(model, opt, loader, noise_multiplier=1.0, accountant=accounting.Accountant())


# --------------------------------------------------------------------------- BatchMemoryManager


def test_opacus_batch_memory_manager_is_refused_naming_ours():
    opacus_bmm = pytest.importorskip("opacus.utils.batch_memory_manager")
    model, opt, loader = _parts()
    model, private, loader = make_private(model, opt, loader, noise_multiplier=1.0)
    with opacus_bmm.BatchMemoryManager(data_loader=loader, max_physical_batch_size=16, optimizer=private) as dl:
        with pytest.raises(InvalidHyperparameterError, match="adaclip_torch.BatchMemoryManager"):
            next(iter(dl))
    assert private.steps == 0


def test_batch_memory_manager_releases_once_per_logical_batch_at_the_logical_rate():
    model, opt, loader = _parts()
    model, private, loader = make_private(module=model, optimizer=opt, data_loader=loader,
                                          noise_multiplier=1.0, max_grad_norm=1.0, seed=0)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # zero_grad() between physical batches must not warn
        with BatchMemoryManager(data_loader=loader, max_physical_batch_size=16, optimizer=private) as physical:
            sizes = _train_one_pass(model, private, physical)
    assert max(sizes) <= 16 and len(sizes) > 4  # Poisson batches of 64 on average, split
    assert private.steps == private.accountant.steps == 4  # one per logical batch
    assert private.accountant.history == ((B / N, 1.0, 4),)  # the logical q, one run


def test_batch_memory_manager_with_banded_noise_accounts_as_without_it():
    accounted = []
    for physical_size in (None, 10):
        model, opt, loader = _parts(batch_size=32)
        model, private, loader = make_private(model, opt, loader, noise_multiplier=1.0, seed=0,
                                              noise_mechanism="banded", bands=2)  # fmt: skip
        if physical_size is None:
            _train_one_pass(model, private, loader)
        else:
            with BatchMemoryManager(data_loader=loader, max_physical_batch_size=physical_size,
                                    optimizer=private) as physical:  # fmt: skip
                assert max(_train_one_pass(model, private, physical)) <= physical_size
        accounted.append((private.steps, private.accountant.history))
    assert accounted[0] == accounted[1] == (8, ((0.25, 1.0, 4),))  # 8 steps, 4 cycles at rate b·q


def test_batch_memory_manager_with_workers_counts_the_logical_batches_it_hands_out():
    """With DataLoader workers the manager's physical loader draws logical batches ahead; it counts a
    logical batch as handed to the loop with its first physical batch, so the optimizer's check
    stays exact: a loop that leaves after a release and starts again goes on (the prefetched draws
    are discarded), with every release on its cyclic group."""
    model, opt, loader = _parts(batch_size=32)
    loader = DataLoader(loader.dataset, batch_size=32, num_workers=2)
    model, private, loader = make_private(model, opt, loader, noise_multiplier=1.0, seed=0,
                                          noise_mechanism="banded", bands=2)  # fmt: skip
    sampler = loader.batch_sampler
    criterion = nn.CrossEntropyLoss()
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=10, optimizer=private) as physical:
        for stop in (2, None):
            for x, y in physical:
                private.zero_grad()
                criterion(model(x), y).backward()
                private.step()
                if private._physical_batches.releases and private.steps == stop:
                    break
            assert sampler.draws.delivered == private.steps <= sampler.position
    assert private.steps == 2 + 8 and private.accountant.history == ((0.25, 1.0, 5),)


def test_batch_memory_manager_gives_the_release_of_the_logical_batch():
    """Same seed (same Poisson batches, same noise): training through physical batches of 16
    gives the parameters of training on the logical batches."""
    results = []
    for physical_size in (None, 16, 5):
        model, opt, loader = _parts()
        model, private, loader = make_private(model, opt, loader, noise_multiplier=1.0, seed=3)
        if physical_size is None:
            _train_one_pass(model, private, loader)
        else:
            with BatchMemoryManager(data_loader=loader, max_physical_batch_size=physical_size,
                                    optimizer=private) as physical:  # fmt: skip
                _train_one_pass(model, private, physical)
        results.append([p.detach().clone() for p in model.parameters()])
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_only_the_release_leaves_the_optimizer():
    """On a physical batch that is not the last, step() changes no parameter, leaves no p.grad,
    does not count a step and does not touch the accountant."""
    model, opt, loader = _parts()
    model, private, loader = make_private(model, opt, loader, noise_multiplier=1.0, seed=0)
    criterion = nn.CrossEntropyLoss()
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=8, optimizer=private) as physical:
        for x, y in physical:
            released = private._physical_batches.releases
            before = [p.detach().clone() for p in model.parameters()]
            steps, accounted = private.steps, private.accountant.steps
            private.zero_grad()
            criterion(model(x), y).backward()
            private.step()
            changed = any(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
            if released:
                assert changed and private.steps == steps + 1 and private.accountant.steps == accounted + 1
            else:
                assert not changed and private.steps == steps and private.accountant.steps == accounted
                assert all(p.grad is None for p in model.parameters())


class _FixedBatches(Sampler[list[int]]):
    def __init__(self, batches: list[list[int]]) -> None:
        self.batches = batches

    def __iter__(self):
        return iter([list(b) for b in self.batches])

    def __len__(self) -> int:
        return len(self.batches)


def test_batch_memory_manager_handles_empty_poisson_batches():
    ds = _dataset(16)
    loader = DataLoader(ds, batch_sampler=_FixedBatches([[0, 1, 2, 3, 4], [], [5, 6]]),
                        collate_fn=empty_batch_collate(ds))  # fmt: skip
    model = _model()
    opt = FlatClip(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=1.0, expected_batch_size=4.0,
                   accountant=accounting.Accountant(), sample_rate=0.25)  # fmt: skip
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=2, optimizer=opt) as physical:
        sizes = _train_one_pass(model, opt, physical)
    assert sizes == [2, 2, 1, 0, 2]  # 5 → 2+2+1 (as even as possible), the empty one, then 2
    assert opt.steps == opt.accountant.steps == 3


def test_batch_memory_manager_never_splits_a_user():
    g = torch.Generator().manual_seed(1)
    users = torch.repeat_interleave(torch.arange(12), torch.randint(1, 6, (12,), generator=g))
    n = len(users)
    ds = TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g), users)
    sampler = PoissonUserBatchSampler(users, sample_rate=0.5, num_steps=3, generator=g)
    loader = DataLoader(ds, batch_sampler=sampler, collate_fn=empty_batch_collate(ds))
    model = _model()
    opt = FlatClip(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=1.0,
                   expected_batch_size=sampler.expected_batch_size, accountant=accounting.Accountant(),
                   sample_rate=0.5)  # fmt: skip
    criterion = nn.CrossEntropyLoss()
    seen: list[set[int]] = []
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=4, optimizer=opt) as physical:
        for x, y, u in physical:
            batch_users = set(u.tolist())
            assert len(u) <= 4 or len(batch_users) == 1  # only a user with more examples exceeds it
            for other in seen:
                assert not (other & batch_users)
            seen.append(batch_users)
            if opt._physical_batches.releases:
                seen = []
            opt.zero_grad()
            criterion(model(x), y).backward()
            opt.step(user_ids=u)
    assert opt.steps == opt.accountant.steps == 3


def test_a_user_level_batch_memory_manager_refuses_a_step_without_user_ids():
    """Issue 41, item 2: over a PoissonUserBatchSampler the run is user level (the manager splits
    at user boundaries for it): a physical batch stepped or accumulated without user_ids would
    clip each example on its own, so a user with k examples could move the release by k·C.
    Refused, nothing changed; with user_ids the loop goes on."""
    g = torch.Generator().manual_seed(1)
    users = torch.repeat_interleave(torch.arange(12), torch.randint(1, 6, (12,), generator=g))
    n = len(users)
    ds = TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g), users)
    sampler = PoissonUserBatchSampler(users, sample_rate=0.5, num_steps=3, generator=g)
    loader = DataLoader(ds, batch_sampler=sampler, collate_fn=empty_batch_collate(ds))
    model = _model()
    opt = FlatClip(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=1.0,
                   expected_batch_size=sampler.expected_batch_size, accountant=accounting.Accountant(),
                   sample_rate=0.5)  # fmt: skip
    criterion = nn.CrossEntropyLoss()
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=4, optimizer=opt) as physical:
        for x, y, u in physical:
            opt.zero_grad()
            criterion(model(x), y).backward()
            before = [p.detach().clone() for p in model.parameters()]
            pending = None if opt._accumulated is None else [t.clone() for t in opt._accumulated]
            with pytest.raises(InvalidGradientError, match="user_ids"):
                opt.step()
            assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
            assert (pending is None) == (opt._accumulated is None)
            if pending is not None:
                assert all(torch.equal(a, b) for a, b in zip(pending, opt._accumulated, strict=True))
            opt.step(user_ids=u)
            assert opt.user_level
    assert not opt.user_level  # outside the manager the optimizer does not know
    assert opt.steps == opt.accountant.steps == 3


def test_a_user_split_between_physical_batches_is_refused():
    model = _model()
    opt = FlatClip(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=1.0, expected_batch_size=2.0)
    x = torch.randn(4, 6)
    model(x[:2]).sum().backward()
    opt.accumulate(user_ids=torch.tensor([7, 8]))
    pending = [t.clone() for t in opt._accumulated]
    model(x[2:]).sum().backward()
    with pytest.raises(InvalidGradientError, match="already contributed"):
        opt.step(user_ids=torch.tensor([8, 9]))
    assert opt.steps == 0 and all(torch.equal(a, b) for a, b in zip(pending, opt._accumulated, strict=True))
    with pytest.raises(InvalidGradientError, match="one kind of unit"):
        opt.accumulate()  # example-level after user-level
    opt.step(user_ids=torch.tensor([9, 10]))  # other users: fine
    assert opt.steps == 1


def test_a_logical_batch_left_half_way_is_dropped_not_released():
    model, opt, loader = _parts()
    model, private, loader = make_private(model, opt, loader, noise_multiplier=1.0, seed=0)
    criterion = nn.CrossEntropyLoss()
    with pytest.warns(UserWarning, match="discarded"):
        with BatchMemoryManager(data_loader=loader, max_physical_batch_size=8, optimizer=private) as physical:
            for x, y in physical:
                private.zero_grad()
                criterion(model(x), y).backward()
                private.step()
                break  # the first logical batch has more than one physical batch: left half-way
            assert private._accumulated is None  # dropped as the loop was left
            private.step(empty_batch=True)  # a later step cannot release part of it
    assert private.steps == private.accountant.steps == 1


def test_a_logical_batch_whose_last_step_is_missing_is_not_released_with_the_next():
    """The pending sum of a logical batch left unreleased is dropped, never released with the next
    one. An optimizer that holds the sampler (make_private's) knows more: the logical batch was
    handed to the loop and skipped, so the next release is refused (the releases would no longer
    follow the draws: a selection the accountant does not know of); without a sampler the loop goes
    on."""
    criterion = nn.CrossEntropyLoss()
    for holds_sampler in (False, True):
        model, opt, loader = _parts()
        if holds_sampler:
            model, private, loader = make_private(model, opt, loader, noise_multiplier=1.0, seed=0)
        else:
            loader = poisson_data_loader(_dataset(), B / N, generator=torch.Generator().manual_seed(1))
            private = FlatClip(opt, model, noise_multiplier=1.0, expected_batch_size=B,
                               accountant=accounting.Accountant(), sample_rate=B / N)  # fmt: skip
        logical, refused = 0, None
        with pytest.warns(UserWarning, match="not released"):
            with BatchMemoryManager(data_loader=loader, max_physical_batch_size=8, optimizer=private) as physical:
                for x, y in physical:
                    private.zero_grad()
                    criterion(model(x), y).backward()
                    if private._physical_batches.releases:
                        logical += 1
                        if logical == 1:
                            continue  # the user forgot step() on the last physical batch
                    try:
                        private.step()
                    except InvalidGradientError as err:
                        refused = err
                        private.discard_pending()
                        break
        if holds_sampler:
            assert refused is not None and "skipped" in str(refused)
            assert private.steps == private.accountant.steps == 0
        else:
            assert refused is None and private.steps == private.accountant.steps == 3


def test_batch_memory_manager_refuses_an_optimizer_built_for_the_physical_batch():
    model, opt, loader = _parts()
    _, private, loader = make_private(model, opt, loader, noise_multiplier=1.0)
    other = _model()
    physical_sized = FlatClip(torch.optim.SGD(other.parameters(), lr=0.1), other, noise_multiplier=1.0,
                              expected_batch_size=16.0)  # fmt: skip
    with pytest.raises(InvalidHyperparameterError, match="logical batch"):
        BatchMemoryManager(data_loader=loader, max_physical_batch_size=16, optimizer=physical_sized)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(InvalidHyperparameterError, match="max_physical_batch_size"):
            BatchMemoryManager(data_loader=loader, max_physical_batch_size=bad, optimizer=private)


def test_make_private_max_physical_batch_size_points_to_batch_memory_manager():
    model, opt, loader = _parts()
    with pytest.raises(InvalidHyperparameterError, match="BatchMemoryManager"):
        make_private(model, opt, loader, noise_multiplier=1.0, max_physical_batch_size=16)


# --------------------------------------------------------------------------- ModuleValidator.fix


class _ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 40, 3)
        self.bn = nn.BatchNorm2d(40)
        self.inorm = nn.InstanceNorm2d(40, affine=True, track_running_stats=True)
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(40 * 4 * 4, 3), nn.BatchNorm1d(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.inorm(self.bn(self.conv(x))))


def test_group_norm_groups_follow_opacus_then_the_largest_divisor():
    assert [group_norm_groups(c) for c in (64, 32, 30, 48, 40, 7, 1)] == [32, 32, 30, 24, 20, 7, 1]


def test_fix_replaces_batchnorm_leaves_the_original_and_the_result_trains():
    model = _ConvNet()
    with pytest.raises(InvalidHyperparameterError, match=r"validation\.fix\(model\)"):
        make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     DataLoader(TensorDataset(torch.randn(8, 3, 6, 6), torch.randint(0, 3, (8,))), batch_size=4),
                     noise_multiplier=1.0)  # fmt: skip
    problems = validate(model)
    assert len(problems) == 3 and all("fix(model)" in p for p in problems)
    fixed = fix(model)
    assert fixed is not model and isinstance(model.bn, nn.BatchNorm2d) and model.inorm.track_running_stats
    assert isinstance(fixed.bn, nn.GroupNorm) and (fixed.bn.num_groups, fixed.bn.num_channels) == (20, 40)
    assert isinstance(fixed.head[2], nn.GroupNorm) and fixed.head[2].num_groups == 3
    assert not fixed.inorm.track_running_stats and torch.equal(fixed.inorm.weight, model.inorm.weight)
    assert validate(fixed) == []
    data = DataLoader(TensorDataset(torch.randn(8, 3, 6, 6), torch.randint(0, 3, (8,))), batch_size=4)
    fixed, private, loader = make_private(fixed, torch.optim.SGD(fixed.parameters(), lr=0.1), data,
                                          noise_multiplier=1.0, seed=0)  # fmt: skip
    _train_one_pass(fixed, private, loader)
    assert private.steps == 2


def test_fix_keeps_sharing_dtype_and_refuses_what_it_cannot_fix():
    shared = nn.BatchNorm1d(6).double()
    model = nn.Sequential(nn.Linear(6, 6).double(), shared, nn.Linear(6, 6).double(), shared)
    fixed = fix(model)
    assert fixed[1] is fixed[3] and fixed[1].weight.dtype == torch.float64
    assert isinstance(fix(nn.BatchNorm1d(5)), nn.GroupNorm)  # a BatchNorm at the root
    embedding = fix(nn.Embedding(10, 4, scale_grad_by_freq=True))
    assert not embedding.scale_grad_by_freq
    with pytest.raises(InvalidHyperparameterError, match="forward pass"):
        fix(nn.Sequential(nn.LazyBatchNorm1d()))
    with pytest.raises(InvalidHyperparameterError, match="torch.nn.Module"):
        fix("not a model")
    from adaclip_torch.validation import MODULE_RULES, register_module_rule

    register_module_rule(lambda m: isinstance(m, nn.Softsign), "a rule fix() knows no replacement for")
    try:
        with pytest.raises(InvalidHyperparameterError, match="cannot replace every refused module"):
            fix(nn.Sequential(nn.BatchNorm1d(4), nn.Softsign()))
    finally:
        MODULE_RULES.pop()


# --------------------------------------------------------------------------- per_sample_mode


def test_per_sample_mode_defaults_to_auto_everywhere():
    assert inspect.signature(DPOptimizer.__init__).parameters["per_sample_mode"].default == "auto"
    model, opt, loader = _parts()
    _, private, _ = make_private(model, opt, loader, noise_multiplier=1.0)
    assert private.per_sample_mode == "auto" and isinstance(private.engine, GhostEngine)
    model = _model()
    explicit = FlatClip(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=1.0,
                        expected_batch_size=4.0, per_sample_mode="materialise")  # fmt: skip
    assert type(explicit.engine) is MaterialisedEngine


class _Mixed(nn.Module):
    """Linear and Embedding (ghost in "auto"), a convolution and a LayerNorm (materialised)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.conv = nn.Conv1d(4, 4, 3, padding=1)
        self.norm = nn.LayerNorm(4)
        self.out = nn.Linear(4, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.conv(self.emb(tokens).transpose(1, 2)).transpose(1, 2)
        return self.out(self.norm(h)).mean(1)


@pytest.mark.parametrize("cls, kwargs", [(FlatClip, {"max_grad_norm": 0.5}), (AdaClip, {"preset": "patent"})])
def test_default_auto_gives_the_materialised_step(cls, kwargs):
    tokens = torch.randint(0, 10, (6, 5), generator=torch.Generator().manual_seed(0))
    target = torch.randn(6, 3, generator=torch.Generator().manual_seed(1))
    params = {}
    for mode in ("auto", "materialise"):
        torch.manual_seed(0)
        model = _Mixed().double()
        opt = cls(torch.optim.SGD(model.parameters(), lr=0.5), model, noise_multiplier=0.7, expected_batch_size=6.0,
                  seed=5, per_sample_mode=mode, **kwargs)  # fmt: skip
        for _ in range(2):
            ((model(tokens) - target) ** 2).sum(1).mean().backward()
            opt.step()
            opt.zero_grad()
        params[mode] = [p.detach().clone() for p in model.parameters()]
    for a, b in zip(params["auto"], params["materialise"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_the_default_mode_does_not_block_the_fused_kernels():
    """use_kernel=True with the default per_sample_mode: whatever refuses it here (no CUDA), it is
    not the per-sample mode ("auto" takes the kernels where they run)."""
    model = _model()
    try:
        opt = FlatClip(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=1.0,
                       expected_batch_size=4.0, use_kernel=True)  # fmt: skip
    except InvalidHyperparameterError as err:
        assert "per_sample_mode" not in str(err)
    else:
        assert opt.fused_kernels and opt.per_sample_mode == "materialise"


# --------------------------------------------------------------------------- progress


def test_calibration_progress_on_off_and_a_bar_only_on_a_terminal_by_default(capsys):
    args = dict(target_epsilon=2.0, delta=DELTA, sample_rate=0.1, steps=50)
    accounting.calibrate_noise_multiplier(**args, progress=True)
    assert "calibrating sigma" in capsys.readouterr().err
    accounting.calibrate_noise_multiplier(**args, progress=False)
    # stderr is captured (not a terminal) and pytest configured logging: piped progress goes to the
    # adaclip._progress logger at INFO, not to stderr (tests/test_progress.py)
    accounting.calibrate_noise_multiplier(**args)
    assert capsys.readouterr().err == ""
    with pytest.raises(InvalidHyperparameterError, match="progress"):
        accounting.calibrate_noise_multiplier(**args, progress="yes")


def test_progress_without_tqdm_prints_lines(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm fails
    # the benchmark harnesses (run in-process by their tests) memoise the calibration globally:
    # call the library function itself, not a cached result
    calibrate = getattr(accounting.calibrate_noise_multiplier, "__wrapped__", accounting.calibrate_noise_multiplier)
    calibrate(target_epsilon=2.0, delta=DELTA, sample_rate=0.1, steps=50, progress=True)
    err = capsys.readouterr().err
    assert "calibrating sigma" in err and "evaluations" in err


def test_accountant_and_make_private_progress(capsys, monkeypatch):
    acc = accounting.Accountant("rdp", target_epsilon=5.0, delta=DELTA, progress=True)
    acc.step(noise_multiplier=1.0, sample_rate=0.1)  # the budget search
    assert "privacy budget" in capsys.readouterr().err
    model, opt, loader = _parts()
    make_private(model, opt, loader, target_epsilon=3.0, delta=DELTA, epochs=1, progress=True)
    assert "calibrating sigma" in capsys.readouterr().err
    model, opt, loader = _parts()
    with pytest.raises(InvalidHyperparameterError, match="progress"):
        make_private(model, opt, loader, noise_multiplier=1.0, progress=1)


# --------------------------------------------------------------------------- the migration page

#: `Func(kw=value)`: one keyword, a literal value
_CLAIM = re.compile(r"`([A-Za-z_][\w.]*)\((\w+)=([^`(),]+)\)`")


def _adaclip_signature_default(func: str, keyword: str):
    from adaclip_torch.privacy import DEFAULT_STRATEGY, STRATEGIES

    targets = {
        "make_private": [make_private, STRATEGIES[DEFAULT_STRATEGY].__init__, DPOptimizer.__init__],
        "make_private_with_epsilon": [make_private_with_epsilon, make_private],
        "DPOptimizer": [DPOptimizer.__init__],
        "FlatClip": [FlatClip.__init__, DPOptimizer.__init__],
        "AdaClip": [AdaClip.__init__, DPOptimizer.__init__],
        "Accountant": [accounting.Accountant.__init__],
        "calibrate_noise_multiplier": [accounting.calibrate_noise_multiplier],
        "BatchMemoryManager": [BatchMemoryManager.__init__],
    }
    assert func in targets, f"the page states a default of {func}, which this test does not know"
    for target in targets[func]:  # make_private passes the wrapper's keywords on
        params = inspect.signature(target).parameters
        if keyword in params and params[keyword].default is not inspect.Parameter.empty:
            return params[keyword].default
    raise AssertionError(f"{func} has no keyword {keyword} with a default")


def _opacus_signature_default(func: str, keyword: str):
    opacus = pytest.importorskip("opacus")
    targets = {"PrivacyEngine": opacus.PrivacyEngine.__init__, "make_private": opacus.PrivacyEngine.make_private,
               "make_private_with_epsilon": opacus.PrivacyEngine.make_private_with_epsilon}  # fmt: skip
    assert func in targets, f"the page states an Opacus default of {func}, which this test does not know"
    return inspect.signature(targets[func]).parameters[keyword].default


def _table_rows(text: str) -> list[list[str]]:
    rows = []
    for line in text.splitlines():
        if line.startswith("|") and not re.match(r"^\|[-| ]+\|$", line):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def test_every_default_the_opacus_page_states_matches_the_signature():
    """Every table cell of docs/migration/opacus.md that says "default" states it as
    `Func(keyword=value)`, and value is the default of that keyword in the signature (adaclip's
    in the adaclip_torch column, Opacus's in the Opacus column)."""
    text = OPACUS_PAGE.read_text(encoding="utf-8")
    checked = 0
    for row in _table_rows(text):
        if row[0] in ("Opacus", "Setting"):
            continue  # a header
        opacus_cell, adaclip_cell = row[-2], row[-1]
        for cell, default_of in ((opacus_cell, _opacus_signature_default), (adaclip_cell, _adaclip_signature_default)):
            if "default" not in cell:
                continue
            claims = _CLAIM.findall(cell)
            assert claims, f"a default stated without `Func(keyword=value)`: {cell!r}"
            for func, keyword, value in claims:
                expected = ast.literal_eval(value)
                actual = default_of(func.split(".")[-1], keyword)
                assert actual == expected, f"the page says {func}({keyword}={value}), the signature has {actual!r}"
                checked += 1
    assert checked >= 10


def test_the_opacus_page_names_every_habit_and_the_checkpoint_claim_is_right():
    text = OPACUS_PAGE.read_text(encoding="utf-8")
    for name in ("BatchMemoryManager", "validation.fix", "validation.validate", "get_epsilon", '"prv"', '"gdp"',
                 "optimizer.noise_multiplier", "optimizer.max_grad_norm", "optimizer.expected_batch_size",
                 'per_sample_mode="auto"', "max_physical_batch_size"):  # fmt: skip
        assert name in text, name
    checkpoints = text[text.index("**Checkpoints.**"):].split("\n\n")[0]
    assert "seed=" in checkpoints and "no generator state is saved" in checkpoints
    # and the code agrees: the generator's state is saved with a seed only
    for seed, saved in ((None, False), (0, True)):
        model = _model()
        opt = FlatClip(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=1.0,
                       expected_batch_size=4.0, seed=seed)  # fmt: skip
        assert ("generator_state" in opt.state_dict()["noise"]) is saved
    snippet = (ROOT / "docs" / "snippets" / "migrate_opacus.py").read_text(encoding="utf-8")
    assert "leave it out for AdaCliP" not in snippet


def test_make_private_default_strategy_is_what_the_docs_say():
    from adaclip_torch.privacy import DEFAULT_STRATEGY

    assert inspect.signature(make_private).parameters["strategy"].default == DEFAULT_STRATEGY == "flat"
    assert math.isclose(inspect.signature(FlatClip.__init__).parameters["max_grad_norm"].default, 1.0)
    assert adaclip_torch.BatchMemoryManager is BatchMemoryManager


def test_make_private_mechanism_keyword_is_deprecated_for_accountant():
    # make_private names the accounting method accountant= (Opacus's keyword); mechanism= is its old
    # name: it still works, with a FutureWarning pointing at the caller's line
    model, opt, loader = _parts()
    with pytest.warns(FutureWarning, match=r"make_private\(mechanism=\.\.\.\) is deprecated.*accountant=") as caught:
        _, private, _ = make_private(model, opt, loader, noise_multiplier=1.0, mechanism="rdp")
    assert private.accountant.mechanism == "rdp"
    assert [w.filename for w in caught if w.category is FutureWarning] == [__file__]
    model, opt, loader = _parts()
    with pytest.warns(FutureWarning) as caught:
        _, private, _ = make_private_with_epsilon(model, opt, loader, target_epsilon=3.0, target_delta=DELTA, epochs=1,
                                                  mechanism="rdp", progress=False)  # fmt: skip
    assert private.accountant.mechanism == "rdp"
    assert [w.filename for w in caught if w.category is FutureWarning] == [__file__]
    with pytest.raises(InvalidHyperparameterError, match="different accounting methods"), pytest.warns(FutureWarning):
        make_private_with_epsilon(*_parts(), target_epsilon=3.0, target_delta=DELTA, epochs=1,
                                  mechanism="pld", accountant="rdp")  # fmt: skip
    model, opt, loader = _parts()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the keyword of today warns nothing
        _, private, _ = make_private(model, opt, loader, noise_multiplier=1.0, accountant="rdp")
    assert private.accountant.mechanism == "rdp"
