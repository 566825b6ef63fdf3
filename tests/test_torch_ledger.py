"""The crash-safe privacy ledger on the PyTorch path: write-ahead before any release, restarts
that never lower ε, and SIGKILL fault injection of a training process."""

from __future__ import annotations

import copy
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from adaclip.accounting import Accountant
from adaclip.errors import InvalidHyperparameterError
from adaclip.ledger import PrivacyLedger
from adaclip_torch.privacy import make_private

pytestmark = pytest.mark.torch

N, B = 200, 20


def _parts(seed: int = 0, momentum: float = 0.0):
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(N, 6, generator=g), torch.randint(0, 3, (N,), generator=g))
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum), DataLoader(ds, batch_size=B)


def _ledger_steps(path: Path) -> int:
    with PrivacyLedger(path) as ledger:
        return ledger.steps


def test_each_step_is_in_the_ledger_before_the_wrapped_optimizer_sees_the_noisy_gradient(tmp_path):
    path = tmp_path / "run.ledger"
    model, opt, loader = _parts()
    seen = []

    def before_inner_step(optimizer, args, kwargs):
        # the noisy gradient is about to be used: the ledger file must already count this step
        seen.append((private.steps, _steps_on_disk(path)))

    model, private, loader = make_private(model, opt, loader, noise_multiplier=1.0, ledger=path)
    opt.register_step_pre_hook(before_inner_step)
    for x, y in loader:
        nn.functional.cross_entropy(model(x), y).backward()
        private.step()
        private.zero_grad()
    assert seen and all(on_disk >= step + 1 for step, on_disk in seen)
    assert private.accountant.steps == len(seen)


def _steps_on_disk(path: Path) -> int:
    """Release steps in the file, read without opening a second writer (the optimizer holds it)."""
    import json

    total = 0
    for line in Path(path).read_text().splitlines():
        record = json.loads(line)
        if record.get("kind") in ("release", "torn"):
            total += int(record.get("count", 1))
    return total


def test_a_restart_from_an_older_checkpoint_keeps_the_ledgers_count(tmp_path):
    path = tmp_path / "run.ledger"
    model, opt, loader = _parts()
    model, private, loader = make_private(model, opt, loader, noise_multiplier=1.0, ledger=path, seed=1)
    batches = iter(loader)
    for i in range(6):
        x, y = next(batches)
        nn.functional.cross_entropy(model(x), y).backward()
        private.step()
        private.zero_grad()
        if i == 1:
            early = private.state_dict()
    eps_before = private.accountant.epsilon(1e-5)
    private.accountant.close()  # the "crash": the process is gone, the file stays
    model2, opt2, loader2 = _parts()
    _, private2, _ = make_private(model2, opt2, loader2, noise_multiplier=1.0, ledger=path, seed=1)
    assert private2.accountant.steps == 6  # opened on the ledger: everything it recorded
    with pytest.warns(Warning):
        private2.load_state_dict(early)  # a checkpoint of step 2
    assert private2.accountant.steps == 6
    assert private2.accountant.epsilon(1e-5) == pytest.approx(eps_before)


def test_a_checkpoint_of_another_run_is_refused(tmp_path):
    model, opt, loader = _parts()
    model, private, loader = make_private(model, opt, loader, noise_multiplier=1.0, ledger=tmp_path / "a.ledger")
    x, y = next(iter(loader))
    nn.functional.cross_entropy(model(x), y).backward()
    private.step()
    other_model, other_opt, other_loader = _parts()
    _, other, other_loader = make_private(other_model, other_opt, other_loader, noise_multiplier=1.0,
                                          ledger=tmp_path / "b.ledger")
    x, y = next(iter(other_loader))  # make_private's loader (the optimizer refuses batches of another)
    nn.functional.cross_entropy(other_model(x), y).backward()
    other.step()
    before = [p.detach().clone() for p in other_model.parameters()]
    with pytest.raises(InvalidHyperparameterError, match="run"):
        other.load_state_dict(private.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(before, other_model.parameters(), strict=True))
    assert other.accountant.steps == 1


def _train(model, private, batches, steps: int) -> None:
    for _ in range(steps):
        x, y = next(batches)
        nn.functional.cross_entropy(model(x), y).backward()
        private.step()
        private.zero_grad()


def _crashed_ledger_run(tmp_path: Path):
    """A make_private run with a ledger that saved a checkpoint at step 2 and died after step 6
    (the 4 steps after the checkpoint are on the ledger only): (the checkpoint, the ledger)."""
    path = tmp_path / "run.ledger"
    model, opt, loader = _parts(momentum=0.9)
    model, private, loader = make_private(model, opt, loader, noise_multiplier=1.0, ledger=path)
    batches = iter(loader)
    _train(model, private, batches, 2)
    early = copy.deepcopy(private.state_dict())
    _train(model, private, batches, 4)
    private.accountant.close()  # the "crash"
    return early, path


def _restarted(ledger=None, steps: int = 1):
    """A restarted optimizer (with a ledger or without) that has taken ``steps`` steps of its own
    on its loader, so that every piece of its state (momentum, clip state, accountant, generator)
    is set."""
    model, opt, loader = _parts(seed=1, momentum=0.9)
    model, private, loader = make_private(model, opt, loader, noise_multiplier=1.0, ledger=ledger)
    _train(model, private, iter(loader), steps)
    return model, private


def _everything(model, private):
    """Every piece of state a restore may change."""
    return {
        "parameters": [p.detach().clone() for p in model.parameters()],
        "optimizer": copy.deepcopy(private.original_optimizer.state_dict()),
        "clip_state": copy.deepcopy(private._clip_state),
        "steps": private.steps,
        "accountant": private.accountant.state_dict(),
        "generator": private._noise._generator.get_state().clone(),
    }


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_a_restart_without_the_ledger_refuses_the_runs_checkpoint_and_changes_nothing(tmp_path):
    """Issue 41.6: restarting without ledger= and loading a ledger run's checkpoint counted
    only its 2 steps of 6, silently. It is refused, naming ledger= and the run's ledger, and
    nothing changes: parameters, wrapped optimizer, clip state, steps, accountant, generator."""
    early, path = _crashed_ledger_run(tmp_path)
    model, private = _restarted()  # forgot ledger=
    before = _everything(model, private)
    with pytest.raises(InvalidHyperparameterError, match=rf"has no ledger.*ledger={re.escape(repr(str(path)))}"):
        private.load_state_dict(early)
    assert _same(_everything(model, private), before)
    # with the run's ledger (make_private(..., ledger=)) it is restored and counts all 6 steps
    model2, private2 = _restarted(ledger=path)
    assert private2.accountant.steps == 7  # the run's 6 and this restart's first step
    with pytest.warns(UserWarning, match="kept the accountant's history"):
        private2.load_state_dict(early)
    assert private2.steps == 2 and private2.accountant.steps == 7
    private2.accountant.close()


def test_ignore_ledger_restores_the_runs_checkpoint_knowingly(tmp_path):
    """The explicit way out (the ledger is lost for good, or only the model matters):
    ``ignore_ledger=True`` restores the checkpoint and warns that ε under-counts."""
    early, _ = _crashed_ledger_run(tmp_path)
    model, private = _restarted()
    with pytest.warns(UserWarning, match=r"ignore_ledger=True.*under-counts"):
        private.load_state_dict(early, ignore_ledger=True)
    assert private.steps == 2 and private.accountant.steps == 2 and private.accountant.run_id is None


def test_a_larger_ledger_of_another_run_refuses_the_checkpoint_and_changes_nothing(tmp_path):
    """An accountant on another run's ledger that records more steps than the checkpoint was
    kept as it was (an in-process rewind) while the rest of the checkpoint loaded: now the
    accountant checks the checkpoint against its ledger first, and refuses it."""
    early, _ = _crashed_ledger_run(tmp_path)
    model, private = _restarted(ledger=tmp_path / "other.ledger", steps=4)  # more steps than the checkpoint's 2
    before = _everything(model, private)
    with pytest.raises(InvalidHyperparameterError, match="does not match the run"):
        private.load_state_dict(early)
    assert _same(_everything(model, private), before)
    private.accountant.close()


def test_make_private_ledger_is_checked_up_front():
    model, opt, loader = _parts()
    with pytest.raises(InvalidHyperparameterError, match="ledger"):
        make_private(model, opt, loader, noise_multiplier=1.0, ledger=3)


WORKER = textwrap.dedent(
    """
    import os, sys, torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset
    from adaclip_torch.privacy import make_private

    ckpt, ledger, total = sys.argv[1], sys.argv[2], int(sys.argv[3])
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(200, 6, generator=g), torch.randint(0, 3, (200,), generator=g))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, loader = make_private(model, inner, DataLoader(ds, batch_size=20), noise_multiplier=1.0,
                                      ledger=ledger)
    if os.path.exists(ckpt):
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"])
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt.load_state_dict(state["optimizer"])

    def released(optimizer, args, kwargs):  # a noisy gradient is now in the wrapped optimizer
        print("R", flush=True)

    inner.register_step_pre_hook(released)
    print("START", opt.steps, flush=True)
    while opt.steps < total:
        for x, y in loader:
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            if opt.steps % 3 == 0:
                tmp = ckpt + ".tmp"
                torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp)
                os.replace(tmp, ckpt)
            if opt.steps >= total:
                break
    print("DONE", flush=True)
    """
)


def _kill_and_restart(tmp_path: Path, kills: int, total: int, seed: int) -> None:
    rng = random.Random(seed)
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    ckpt, ledger = tmp_path / "ckpt.pt", tmp_path / "run.ledger"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")])}
    released = 0
    for attempt in range(kills + 1):
        out_path = tmp_path / f"out{attempt}.txt"
        with open(out_path, "w") as out:
            proc = subprocess.Popen([sys.executable, str(script), str(ckpt), str(ledger), str(total)], stdout=out,
                                    stderr=subprocess.STDOUT, env=env)
            if attempt < kills:
                # wait for the training loop to start, then kill at a random point of it
                deadline = time.time() + 120
                while "START" not in out_path.read_text() and proc.poll() is None and time.time() < deadline:
                    time.sleep(0.02)
                time.sleep(rng.uniform(0.0, 0.6))
                proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=300)
        text = out_path.read_text()
        released += text.count("R\n")
        with PrivacyLedger(ledger) as book:  # reopening counts (and repairs) a torn tail
            assert book.steps >= released, (attempt, book.steps, released, text[-2000:])
        if attempt == kills:
            assert "DONE" in text, text[-2000:]
    # the finished run: every release ever made is in the ledger, and the parameters are sound
    state = torch.load(ckpt, weights_only=False)
    assert all(torch.isfinite(v).all() for v in state["model"].values())
    accountant = Accountant(ledger=ledger)  # the run's own mechanism
    assert accountant.steps >= released >= total
    accountant.close()


def test_sigkill_during_training_never_under_counts(tmp_path):
    _kill_and_restart(tmp_path, kills=3, total=30, seed=0)


@pytest.mark.slow
def test_sigkill_many_times_never_under_counts(tmp_path):
    _kill_and_restart(tmp_path, kills=25, total=120, seed=1)
