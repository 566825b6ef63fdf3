"""The budget keeper (:mod:`adaclip.accounting.keeper`): refuse before release, write ahead, record
once per cycle, no rollback of a written record — and every front end spends through it."""

from __future__ import annotations

import pytest

from adaclip.accounting import Accountant, keeper
from adaclip.errors import BudgetExceededError

DELTA = 1e-5


class StepOnly:
    """An accountant-like object of the user's: only ``would_exceed`` and ``step``."""

    def __init__(self) -> None:
        self.calls: list[tuple[float, float]] = []

    def would_exceed(self, *, noise_multiplier, sample_rate, num_steps=1):
        return False

    def step(self, *, noise_multiplier, sample_rate, num_steps=1):
        self.calls.append((noise_multiplier, sample_rate))


def test_cycle_records_the_first_step_of_each_cycle_and_restarts():
    cycle = keeper.Cycle(3)
    assert [cycle.records_at(t) for t in range(7)] == [True, False, False, True, False, False, True]
    cycle.restart(4)
    assert [t for t in range(4, 12) if cycle.records_at(t)] == [4, 7, 10] and cycle.start == 4
    assert all(keeper.Cycle().records_at(t) for t in range(5))


def test_refuse_raises_before_anything_changes_and_names_the_unit():
    acc = Accountant("rdp", target_epsilon=1.0, delta=DELTA)
    acc.record_released(noise_multiplier=0.8, sample_rate=0.3, num_steps=3)  # already past the budget
    before = (acc.history, acc.steps)
    with pytest.raises(BudgetExceededError, match=r"^round 7 .*budget is epsilon=1 .*; released 3; nothing was changed$"):
        keeper.refuse(acc, 0.8, 0.3, step=7, records=True, explain=lambda: "; released 3", unit="round")
    assert (acc.history, acc.steps) == before
    keeper.refuse(acc, 0.8, 0.3, step=7, records=False)  # inside a cycle: covered by its record
    keeper.refuse(None, 0.8, 0.3, step=7, records=True)  # no accountant: nothing to keep
    keeper.refuse(Accountant("rdp", target_epsilon=1.0, delta=DELTA), 50.0, 0.3, step=7, records=True)  # within


def test_write_ahead_is_on_the_ledger_before_the_release_and_recorded_once(tmp_path):
    acc = Accountant("rdp", ledger=tmp_path / "run.ledger")
    assert keeper.write_ahead(acc, 1.1, 0.2, records=False) is False and acc.ledger.steps == 0
    assert keeper.write_ahead(acc, 1.1, 0.2, records=True) is True
    assert acc.ledger.steps == 1 and acc.steps == 0  # on disk, not yet in memory
    keeper.record(acc, 1.1, 0.2, records=True, logged=True)
    assert acc.ledger.steps == 1 and acc.steps == 1  # recorded, not written again
    # a release that fails after its write-ahead is not rolled back: the ledger stays one ahead
    keeper.write_ahead(acc, 1.1, 0.2, records=True)
    assert (acc.ledger.steps, acc.steps) == (2, 1)
    plain = Accountant("rdp")
    assert keeper.write_ahead(plain, 1.1, 0.2, records=True) is False  # no ledger: nothing to write


def test_record_counts_a_released_step_even_past_the_budget():
    acc = Accountant("rdp", target_epsilon=0.5, delta=DELTA)
    keeper.record(acc, 0.3, 0.5, records=True)  # the release has left: it is counted whatever the budget says
    assert acc.steps == 1 and acc.epsilon(DELTA) > 0.5
    keeper.record(acc, 0.3, 0.5, records=False)
    assert acc.steps == 1
    user = StepOnly()
    keeper.record(user, 0.9, 0.1, records=True)  # an accountant without record_released: its step
    assert user.calls == [(0.9, 0.1)]


@pytest.fixture
def spent(monkeypatch):
    """Every call of the keeper's three functions, in order: ``(name, records)``."""
    calls: list[tuple[str, bool]] = []
    for name in ("refuse", "write_ahead", "record"):
        original = getattr(keeper, name)

        def spy(*args, _name=name, _original=original, **kwargs):
            calls.append((_name, kwargs["records"]))
            return _original(*args, **kwargs)

        monkeypatch.setattr(keeper, name, spy)
    return calls


@pytest.mark.torch
def test_the_torch_optimizer_spends_through_the_keeper(spent):
    import torch
    from torch import nn

    from adaclip_torch import FlatClip

    model = nn.Linear(3, 2)
    opt = FlatClip(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=1.0, max_grad_norm=1.0,
                   expected_batch_size=4, sample_rate=0.1, accountant=Accountant("rdp"), seed=0)  # fmt: skip
    for _ in range(2):
        model(torch.randn(4, 3)).sum().backward()
        opt.step()
        opt.zero_grad()
    assert spent == [("refuse", True), ("write_ahead", True), ("record", True)] * 2
    assert opt.accountant.steps == 2


@pytest.mark.jax
def test_the_jax_tracker_spends_through_the_keeper(spent):
    pytest.importorskip("jax")
    from adaclip_jax import PrivacyTracker

    tracker = PrivacyTracker(Accountant("rdp"), sample_rate=0.1, noise_multiplier=1.0, bands=2)
    tracker.check_budget()
    tracker._record(1.0)
    tracker.check_budget()
    tracker._record(1.0)
    # the second step is inside the cycle of b = 2: checked and recorded as covered
    assert spent == [("refuse", True), ("record", True), ("refuse", False), ("record", False)]
    assert tracker.accountant.history == ((0.2, 1.0, 1),)
