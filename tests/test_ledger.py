"""adaclip.ledger.PrivacyLedger and Accountant(ledger=...): a crash-safe, write-ahead record of
every release — durable before the call returns, torn tails counted as spent, corruption and
foreign checkpoints refused, never lowered."""

from __future__ import annotations

import copy
import json
import os
import pickle
import random
import re
import signal
import stat
import subprocess
import sys
import time
import warnings

import pytest

import adaclip
from adaclip.accounting import Accountant
from adaclip.errors import BudgetExceededError, InvalidHyperparameterError
from adaclip.ledger import LedgerRepairWarning, PrivacyLedger

DELTA = 1e-5
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A short history with changing σ, changing counts and a q = 0 step.
EVENTS = [(0.01, 1.1, 1), (0.01, 1.1, 1), (0.01, 0.9, 3), (0.02, 0.9, 1), (0.0, 0.5, 2), (0.01, 1.1, 1)]


def _step_all(acc, events=EVENTS):
    for q, s, c in events:
        acc.step(noise_multiplier=s, sample_rate=q, num_steps=c)


def _memory(events=EVENTS, mechanism="rdp", **options):
    acc = Accountant(mechanism, **options)
    _step_all(acc, events)
    return acc


def _lines(path):
    with open(path, "rb") as f:
        return f.read().split(b"\n")


def _reopen(path, mechanism="rdp", **options):
    """A fresh accountant on ``path``, with any repair warning caught; returns (acc, warnings)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        acc = Accountant(mechanism, ledger=path, **options)
    return acc, [w for w in caught if issubclass(w.category, LedgerRepairWarning)]


# ------------------------------------------------------------------------------ basics


@pytest.mark.parametrize("mechanism", ["rdp", "pld"])
def test_append_and_reopen_restore_history_and_epsilon_exactly(tmp_path, mechanism):
    path = tmp_path / "run.ledger"
    # PLD at a coarse interval, to keep it quick (the comparison is exact either way)
    options = {"pld_value_discretization_interval": 1e-2} if mechanism == "pld" else {}
    acc = Accountant(mechanism, ledger=path, **options)
    assert acc.steps == 0 and acc.ledger is not None and acc.run_id == acc.ledger.run_id
    _step_all(acc)
    ref = _memory(mechanism=mechanism, **options)
    assert acc.history == ref.history and acc.epsilon(DELTA) == ref.epsilon(DELTA)
    run_id = acc.run_id
    acc.close()

    again, repaired = _reopen(path, mechanism, **options)
    assert not repaired
    assert again.run_id == run_id and again.history == ref.history and again.steps == ref.steps
    assert again.epsilon(DELTA) == ref.epsilon(DELTA)  # bit for bit: same runs, same composition
    # It goes on from there; a third open sees both sessions.
    again.step(noise_multiplier=1.1, sample_rate=0.01)
    ref.step(noise_multiplier=1.1, sample_rate=0.01)
    again.close()
    third, _ = _reopen(path, mechanism, **options)
    assert third.history == ref.history and third.epsilon(DELTA) == ref.epsilon(DELTA)
    third.close()


def test_file_format_header_records_and_checksums(tmp_path):
    path = tmp_path / "run.ledger"
    with PrivacyLedger(path, accountant="pld") as led:
        led.append(sample_rate=0.25, noise_multiplier=2.0, count=3)
        assert led.history == ((0.25, 2.0, 3),) and led.steps == 3 and led.bound == (0.25, 2.0, 3)
    raw = _lines(path)
    assert raw[-1] == b""  # every record ends with a newline
    records = [json.loads(line) for line in raw[:-1]]
    header = records[0]
    assert header["kind"] == "header" and header["format"] == "adaclip.privacy-ledger"
    assert header["version"] == 1 and header["mechanism"] == "pld" and header["n"] == 0
    assert len(header["run_id"]) == 32 and int(header["run_id"], 16) >= 0
    assert [r["kind"] for r in records[1:]] == ["bound", "release"]
    assert records[2]["q"] == 0.25 and records[2]["sigma"] == 2.0 and records[2]["count"] == 3
    assert [r["n"] for r in records] == [0, 1, 2]
    assert all(len(r["crc"]) == 8 for r in records)
    # Opening without a mechanism takes the header's.
    with PrivacyLedger(path) as led:
        assert led.mechanism == "pld" and led.steps == 3


def test_append_fsyncs_before_it_returns_and_before_memory_changes(tmp_path, monkeypatch):
    path = tmp_path / "run.ledger"
    calls = []
    real_fsync = os.fsync
    acc = None

    def spy(fd):
        st = os.fstat(fd)
        calls.append((stat.S_ISDIR(st.st_mode), st.st_size, None if acc is None else acc.steps))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    acc = Accountant("rdp", ledger=path)
    assert any(is_dir for is_dir, _, _ in calls), "the directory is fsynced when the ledger is created"
    assert any(not is_dir and size == os.path.getsize(path) for is_dir, size, _ in calls), "header fsynced"
    for k in range(3):
        calls.clear()
        acc.step(noise_multiplier=1.0, sample_rate=0.1)
        size = os.path.getsize(path)
        files = [(size_at, steps_at) for is_dir, size_at, steps_at in calls if not is_dir]
        # the last fsync saw the whole record, while memory still had the old count
        assert files and files[-1] == (size, k), calls
    calls.clear()
    acc.write_ahead(noise_multiplier=1.0, sample_rate=0.1)
    assert [c[1] for c in calls if not c[0]][-1] == os.path.getsize(path)
    calls.clear()
    acc.step(noise_multiplier=1.0, sample_rate=0.1, logged=True)
    assert calls == []  # logged: written ahead already, nothing appended again
    calls.clear()
    acc.record_released(noise_multiplier=0.5, sample_rate=0.1)
    assert [c[1:] for c in calls if not c[0]][-1] == (os.path.getsize(path), 4)
    acc.close()


def test_no_api_removes_records_and_a_ledger_cannot_be_copied(tmp_path):
    public = {name for name in dir(PrivacyLedger) if not name.startswith("_")}
    assert public == {"append", "bound", "close", "closed", "created", "history", "mechanism", "path", "run_id", "steps"}
    with PrivacyLedger(tmp_path / "l", accountant="rdp") as led:
        with pytest.raises(TypeError, match="cannot be pickled or copied"):
            pickle.dumps(led)
        with pytest.raises(TypeError):
            copy.deepcopy(led)
    assert adaclip.PrivacyLedger is PrivacyLedger and "PrivacyLedger" in adaclip.__all__


def test_a_copy_of_the_accountant_is_detached_from_the_ledger(tmp_path):
    path = tmp_path / "run.ledger"
    acc = Accountant("rdp", ledger=path)
    acc.step(noise_multiplier=1.0, sample_rate=0.1)
    probe = copy.deepcopy(acc)
    assert probe.ledger is None and probe.run_id == acc.run_id and probe.history == acc.history
    probe.step(noise_multiplier=1.0, sample_rate=0.1)  # memory only
    assert acc.ledger.steps == 1 and probe.steps == 2
    restored = pickle.loads(pickle.dumps(acc))
    assert restored.ledger is None and restored.epsilon(DELTA) == acc.epsilon(DELTA)
    acc.close()


# ------------------------------------------------------------------------------ torn records


def test_torn_last_record_is_counted_as_spent_at_every_cut(tmp_path):
    src = tmp_path / "full.ledger"
    acc = Accountant("rdp", ledger=src)
    _step_all(acc)
    full_eps, full_steps = acc.epsilon(DELTA), acc.steps
    acc.close()
    data = src.read_bytes()
    last_start = data.rstrip(b"\n").rfind(b"\n") + 1
    cuts = range(last_start + 1, len(data) + 1)  # every prefix that cuts into the last record
    probe = Accountant("rdp")  # one accountant to compute ε with (it caches the Rényi divergences)
    for cut in cuts:
        path = tmp_path / f"cut{cut}.ledger"
        path.write_bytes(data[:cut])
        reopened, repaired = _reopen(path)
        assert reopened.steps >= full_steps, cut
        probe.load_state_dict({"mechanism": "rdp", "history": [list(r) for r in reopened.history]})
        assert probe.epsilon(DELTA) >= full_eps, cut
        if cut == len(data):
            assert not repaired and reopened.steps == full_steps
        elif cut == len(data) - 1:  # only the newline is missing: the record is complete
            assert not repaired and reopened.history == _memory().history
        else:
            assert repaired and "counted as spent" in str(repaired[0].message)
        # repaired: the next append does not glue onto the torn bytes, and everything parses
        reopened.step(noise_multiplier=1.1, sample_rate=0.01)
        counted = reopened.steps
        reopened.close()
        again, repaired_again = _reopen(path)
        assert not repaired_again and again.steps == counted
        again.close()


def test_torn_bulk_record_counts_its_whole_count_and_a_garbled_tail_counts(tmp_path):
    path = tmp_path / "run.ledger"
    acc = Accountant("rdp", ledger=path)
    acc.step(noise_multiplier=1.0, sample_rate=0.1)
    acc.record_released(noise_multiplier=0.7, sample_rate=0.2, num_steps=50)
    acc.close()
    data = path.read_bytes()
    path.write_bytes(data[:-20])  # tear the 50-step record
    reopened, repaired = _reopen(path)
    assert repaired and reopened.steps == 51 and reopened.history[-1] == (0.2, 0.7, 50)
    reopened.close()

    # A last line with all its bytes but a flipped digit: bad checksum, counted as spent.
    acc = Accountant("rdp", ledger=tmp_path / "flip.ledger")
    acc.step(noise_multiplier=1.0, sample_rate=0.1, num_steps=2)
    acc.step(noise_multiplier=2.0, sample_rate=0.1, num_steps=2)
    eps = acc.epsilon(DELTA)
    acc.close()
    data = (tmp_path / "flip.ledger").read_bytes()
    flipped = data[: -len(b'"sigma":2.0}\n')] + b'"sigma":9.0}\n'
    assert len(flipped) == len(data)
    (tmp_path / "flip.ledger").write_bytes(flipped)
    reopened, repaired = _reopen(tmp_path / "flip.ledger")
    assert repaired and reopened.steps == 4 and reopened.epsilon(DELTA) >= eps
    reopened.close()


def test_torn_first_bound_before_any_release_counts_nothing(tmp_path):
    path = tmp_path / "run.ledger"
    PrivacyLedger(path, accountant="rdp").close()
    header = path.read_bytes()
    with PrivacyLedger(path) as led:
        led.append(sample_rate=0.1, noise_multiplier=1.0)
    data = path.read_bytes()
    bound_line = data[len(header):].split(b"\n")[0]
    path.write_bytes(header + bound_line[:10])  # the first bound record, torn
    acc, repaired = _reopen(path)
    assert repaired and "before any release" in str(repaired[0].message) and acc.steps == 0
    assert path.read_bytes() == header
    acc.step(noise_multiplier=1.0, sample_rate=0.1)
    acc.close()
    assert Accountant("rdp", ledger=path).steps == 1


def test_empty_or_header_only_files_are_refused_with_instructions(tmp_path):
    empty = tmp_path / "empty.ledger"
    empty.write_bytes(b"")
    with pytest.raises(InvalidHyperparameterError, match="empty.*Remove the empty file"):
        Accountant("rdp", ledger=empty)
    torn = tmp_path / "torn.ledger"
    torn.write_bytes(b'{"crc":"2d395f96","created":"2026')
    with pytest.raises(InvalidHyperparameterError, match="incomplete header.*Remove the file"):
        Accountant("rdp", ledger=torn)
    assert torn.read_bytes() == b'{"crc":"2d395f96","created":"2026'
    other = tmp_path / "other.json"
    other.write_text('{"not": "a ledger"}\n')
    with pytest.raises(InvalidHyperparameterError, match="line 1"):
        Accountant("rdp", ledger=other)


# ------------------------------------------------------------------------------ refusals


def _ledger_with_steps(path, events=EVENTS):
    acc = Accountant("rdp", ledger=path)
    _step_all(acc, events)
    state = acc.state_dict()
    acc.close()
    return state


def test_corrupted_middle_record_is_refused_and_left_untouched(tmp_path):
    path = tmp_path / "run.ledger"
    _ledger_with_steps(path)
    lines = _lines(path)
    bad = lines[:]
    bad[3] = bad[3].replace(b'"count":1', b'"count":0')  # line 4, checksum no longer matches
    path.write_bytes(b"\n".join(bad))
    before = path.read_bytes()
    with pytest.raises(InvalidHyperparameterError, match=r"line 4 \(of \d+\) is corrupted.*cannot be trusted"):
        Accountant("rdp", ledger=path)
    assert path.read_bytes() == before
    # a deleted middle line is detected by the record numbers
    path.write_bytes(b"\n".join(lines[:3] + lines[4:]))
    with pytest.raises(InvalidHyperparameterError, match="line 4 has record number 4, expected 3"):
        PrivacyLedger(path)
    # the refused opens released their lock: the intact ledger opens
    path.write_bytes(b"\n".join(lines))
    PrivacyLedger(path).close()


def test_mechanism_mismatch_is_refused(tmp_path):
    path = tmp_path / "run.ledger"
    _ledger_with_steps(path)
    before = path.read_bytes()
    with pytest.raises(InvalidHyperparameterError, match="records a 'rdp' run, not 'pld'"):
        Accountant("pld", ledger=path)
    with PrivacyLedger(path) as led, pytest.raises(InvalidHyperparameterError, match="mechanism mismatch"):
        Accountant("pld", ledger=led)
    assert path.read_bytes() == before
    with pytest.raises(InvalidHyperparameterError, match="does not exist; pass accountant"):
        PrivacyLedger(tmp_path / "missing.ledger")
    with pytest.raises(InvalidHyperparameterError, match="ledger must be a path"):
        Accountant("rdp", ledger=42)


def test_checkpoint_of_another_run_is_refused(tmp_path):
    state_a = _ledger_with_steps(tmp_path / "a.ledger")
    _ledger_with_steps(tmp_path / "b.ledger", EVENTS[:2])
    acc = Accountant("rdp", ledger=tmp_path / "b.ledger")
    before = acc.state_dict()
    with pytest.raises(InvalidHyperparameterError, match="a ledger that does not match the run is refused"):
        acc.load_state_dict(state_a)
    # a checkpoint without a run_id cannot go into a ledger that already records steps
    no_run = dict(state_a, run_id=None)
    with pytest.raises(InvalidHyperparameterError, match="names no ledger run.*does not match the run is refused"):
        acc.load_state_dict(no_run)
    assert acc.state_dict() == before and acc.ledger.steps == 2
    acc.close()


def test_checkpoint_without_run_id_is_written_into_a_new_ledger(tmp_path):
    mem = _memory()
    state = mem.state_dict()
    assert state["run_id"] is None
    acc = Accountant("rdp", ledger=tmp_path / "new.ledger")
    acc.load_state_dict(state)
    assert acc.history == mem.history and acc.ledger.history == mem.history
    assert acc.state_dict()["run_id"] == acc.ledger.run_id
    acc.close()
    again, _ = _reopen(tmp_path / "new.ledger")
    assert again.epsilon(DELTA) == mem.epsilon(DELTA)
    again.close()


def test_older_checkpoint_keeps_the_ledgers_higher_epsilon(tmp_path):
    path = tmp_path / "run.ledger"
    acc = Accountant("rdp", ledger=path)
    _step_all(acc, EVENTS[:3])
    old = json.loads(json.dumps(acc.state_dict()))
    _step_all(acc, EVENTS[3:])  # releases after the checkpoint; then the process dies
    spent = acc.epsilon(DELTA)
    acc.close()

    resumed = Accountant("rdp", ledger=path)
    resumed.load_state_dict(old)
    assert resumed.history == _memory().history and resumed.epsilon(DELTA) == spent
    assert spent > _memory(EVENTS[:3]).epsilon(DELTA)
    resumed.close()
    # the same through Accountant.save / Accountant.load(path, ledger=)
    ckpt = tmp_path / "ckpt.json"
    ckpt.write_text(json.dumps(old))
    loaded = Accountant.load(ckpt, ledger=path)
    assert loaded.epsilon(DELTA) == spent
    loaded.close()
    with pytest.raises(InvalidHyperparameterError, match="does not exist"):
        Accountant.load(ckpt, ledger=tmp_path / "missing.ledger")
    assert not (tmp_path / "missing.ledger").exists()
    with pytest.raises(InvalidHyperparameterError, match="has no ledger"):  # without ledger=: refused
        Accountant.load(ckpt)


def test_checkpoint_ahead_of_the_ledger_is_refused(tmp_path):
    """A ledger older than the checkpoint (restored from a backup) is detected and refused."""
    path = tmp_path / "run.ledger"
    acc = Accountant("rdp", ledger=path)
    _step_all(acc, EVENTS[:2])
    acc.close()
    backup = path.read_bytes()
    acc = Accountant("rdp", ledger=path)
    _step_all(acc, EVENTS[2:])
    state = acc.state_dict()
    acc.close()
    path.write_bytes(backup)  # never do this
    acc = Accountant("rdp", ledger=path)
    with pytest.raises(InvalidHyperparameterError, match=r"not a prefix.*records 9 steps, the ledger only 2"):
        acc.load_state_dict(state)
    diverged = dict(state, history=[[0.01, 1.1, 1], [0.5, 1.1, 1]])
    with pytest.raises(InvalidHyperparameterError, match=r"step 2 has \(sample_rate, noise_multiplier\)"):
        acc.load_state_dict(diverged)
    assert acc.steps == 2
    acc.close()


def _crashed_run(tmp_path, saved_after=2):
    """A ledger run that saved a checkpoint after ``saved_after`` of EVENTS, then recorded the
    rest and died: (the checkpoint, the ledger's path, the checkpoint's file)."""
    path = tmp_path / "run.ledger"
    acc = Accountant("rdp", ledger=path)
    _step_all(acc, EVENTS[:saved_after])
    state = json.loads(json.dumps(acc.state_dict()))
    _step_all(acc, EVENTS[saved_after:])  # released after the checkpoint: on the ledger only
    acc.close()
    ckpt = tmp_path / "ckpt.json"
    ckpt.write_text(json.dumps(state))
    return state, path, ckpt


def _names_the_ledger(path):
    """The refusal of a ledger run's checkpoint without its ledger, naming ledger=PATH."""
    return rf"has no ledger.*ledger={re.escape(repr(str(path)))}"


def test_a_restart_without_the_ledger_refuses_the_runs_checkpoint(tmp_path):
    """Issue 41.6: an accountant without a ledger (a restart that forgot ledger=) would count
    only the checkpoint's steps, not the releases after it: refused, naming the ledger, and
    the accountant is unchanged."""
    state, path, ckpt = _crashed_run(tmp_path)
    fresh = _memory(EVENTS[:1])  # restarted without a ledger, with a step of its own
    before, eps = fresh.state_dict(), fresh.epsilon(DELTA)
    with pytest.raises(InvalidHyperparameterError, match=_names_the_ledger(path)):
        fresh.load_state_dict(state)
    assert fresh.state_dict() == before and fresh.epsilon(DELTA) == eps
    with pytest.raises(InvalidHyperparameterError, match=_names_the_ledger(path)):
        Accountant.load(ckpt)
    with pytest.raises(InvalidHyperparameterError, match=_names_the_ledger(path)):
        fresh.check_state_dict(state)
    assert state["ledger_path"] == str(path)  # the checkpoint knows where the ledger was
    # a checkpoint that does not know the path (only a run_id) says how to pass it
    hintless = {k: v for k, v in state.items() if k != "ledger_path"}
    with pytest.raises(InvalidHyperparameterError, match=r"has no ledger.*ledger=PATH.*PATH the ledger file"):
        fresh.load_state_dict(hintless)
    with pytest.raises(InvalidHyperparameterError, match="ledger_path"):
        fresh.load_state_dict(dict(state, ledger_path=3))
    assert fresh.state_dict() == before
    # with the run's ledger it is restored, counting every step the run took
    resumed = Accountant.load(ckpt, ledger=path)
    assert resumed.history == _memory().history and resumed.check_state_dict(state) == 2
    resumed.close()


def test_a_detached_copy_of_the_runs_accountant_restores_that_runs_checkpoints_only(tmp_path):
    """A copy or pickle of a ledger run's accountant is detached by design and belongs to that
    run: it restores the run's checkpoints (its own state) and refuses another run's."""
    path = tmp_path / "run.ledger"
    acc = Accountant("rdp", ledger=path)
    _step_all(acc, EVENTS[:2])
    state = acc.state_dict()
    for detached in (copy.deepcopy(acc), pickle.loads(pickle.dumps(acc))):
        detached.step(noise_multiplier=1.0, sample_rate=0.1)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            detached.load_state_dict(state)
        assert detached.history == acc.history and detached.run_id == acc.run_id
    acc.close()
    (tmp_path / "other").mkdir()
    other, _, _ = _crashed_run(tmp_path / "other")
    with pytest.raises(InvalidHyperparameterError, match="has no ledger"):
        detached.load_state_dict(other)
    assert detached.history == acc.history


def test_ignore_ledger_restores_a_ledger_runs_checkpoint_knowingly_and_warns(tmp_path):
    """The explicit way out, for a ledger lost for good: the checkpoint is restored as if saved
    without a ledger, with a warning that ε under-counts."""
    state, path, ckpt = _crashed_run(tmp_path)
    fresh = Accountant("rdp")
    with pytest.warns(UserWarning, match=r"ignore_ledger=True.*under-counts"):
        fresh.load_state_dict(state, ignore_ledger=True)
    assert fresh.history == _memory(EVENTS[:2]).history  # the checkpoint's steps only
    assert fresh.run_id is None and fresh.state_dict()["ledger_path"] is None  # as if saved without one
    with pytest.warns(UserWarning, match="under-counts"):
        assert Accountant.load(ckpt, ignore_ledger=True).history == fresh.history
    with pytest.raises(InvalidHyperparameterError, match="ignore_ledger must be True or False"):
        Accountant("rdp").load_state_dict(state, ignore_ledger="yes")
    # the ledger is lost: a new, empty one starts from the checkpoint (the lost tail stays lost)
    new_path = tmp_path / "new.ledger"
    with pytest.warns(UserWarning, match="under-counts"):
        new = Accountant.load(ckpt, ledger=new_path, ignore_ledger=True)
    assert new.ledger.history == fresh.history and new.run_id != state["run_id"]
    new.close()
    # another run's ledger that records steps still refuses it
    other = Accountant("rdp", ledger=new_path)
    before = other.state_dict()
    with pytest.raises(InvalidHyperparameterError, match="does not match the run"):
        other.load_state_dict(state, ignore_ledger=True)
    assert other.state_dict() == before and other.ledger.steps == 2
    other.close()
    # with the run's own ledger the keyword changes nothing: the ledger's history wins, no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        own = Accountant.load(ckpt, ledger=path, ignore_ledger=True)
    assert own.history == _memory().history
    own.close()


def test_a_refused_step_writes_nothing(tmp_path):
    path = tmp_path / "run.ledger"
    acc = Accountant("rdp", target_epsilon=1.0, delta=DELTA, ledger=path)
    with pytest.raises(BudgetExceededError):
        for _ in range(10_000):
            acc.step(noise_multiplier=0.8, sample_rate=0.3)
    before = path.read_bytes()
    for call in (acc.step, acc.write_ahead):
        with pytest.raises(BudgetExceededError):
            call(noise_multiplier=0.8, sample_rate=0.3)
    with pytest.raises(InvalidHyperparameterError):
        acc.step(noise_multiplier=-1.0, sample_rate=0.3)
    with pytest.raises(InvalidHyperparameterError, match="logged"):
        acc.step(noise_multiplier=1.0, sample_rate=0.3, logged="yes")
    assert path.read_bytes() == before
    assert acc.ledger.steps == acc.steps and acc.epsilon() <= 1.0
    acc.close()


def test_write_ahead_then_a_failed_release_leaves_the_ledger_one_ahead(tmp_path):
    path = tmp_path / "run.ledger"
    acc = Accountant("rdp", ledger=path)
    acc.step(noise_multiplier=1.0, sample_rate=0.1)
    acc.write_ahead(noise_multiplier=1.0, sample_rate=0.1)  # ... then the release fails
    assert acc.steps == 1 and acc.ledger.steps == 2
    # a successful write-ahead + release + logged step keeps them one apart
    acc.write_ahead(noise_multiplier=1.0, sample_rate=0.1)
    acc.step(noise_multiplier=1.0, sample_rate=0.1, logged=True)
    assert acc.steps == 2 and acc.ledger.steps == 3
    # logged=True without a matching write-ahead appends: the ledger never holds less than memory
    acc.record_released(noise_multiplier=0.5, sample_rate=0.1, logged=True)
    assert acc.steps == 3 and acc.ledger.steps == 4
    acc.close()
    fresh = Accountant("rdp", ledger=path)
    assert fresh.steps == 4
    fresh.close()


def test_steps_written_ahead_count_against_the_budget(tmp_path):
    kw = {"noise_multiplier": 2.0, "sample_rate": 0.05}
    acc = Accountant("rdp", target_epsilon=1.0, delta=DELTA, ledger=tmp_path / "run.ledger")
    k = acc.remaining_steps(**kw)
    assert 2 < k < 10_000
    acc.step(**kw, num_steps=k - 1)
    acc.write_ahead(**kw)  # the last step that fits; its release fails
    assert acc.remaining_steps(**kw) == 0 and acc.would_exceed(**kw)
    with pytest.raises(BudgetExceededError, match="written ahead"):
        acc.write_ahead(**kw)
    assert acc.steps == k - 1 and acc.ledger.steps == k
    acc.close()
    # without a ledger the checks are the same
    mem = Accountant("rdp", target_epsilon=1.0, delta=DELTA)
    mem.step(**kw, num_steps=k - 1)
    mem.write_ahead(**kw)
    assert mem.would_exceed(**kw)
    mem.step(**kw, logged=True)  # the release succeeded after all
    assert mem.steps == k and mem.remaining_steps(**kw) == 0


def test_a_second_writer_is_refused(tmp_path):
    path = tmp_path / "run.ledger"
    acc = Accountant("rdp", ledger=path)
    acc.step(noise_multiplier=1.0, sample_rate=0.1)
    with pytest.raises(InvalidHyperparameterError, match="single writer"):
        Accountant("rdp", ledger=path)
    code = (
        "import sys\nfrom adaclip.ledger import PrivacyLedger\n"
        "try:\n    PrivacyLedger(sys.argv[1])\nexcept Exception as e:\n    print(type(e).__name__, e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=60,
                         cwd=ROOT, env=_env())
    assert "InvalidHyperparameterError" in out.stdout and "single writer" in out.stdout, out
    acc.close()
    with pytest.raises(InvalidHyperparameterError, match="closed"):
        acc.step(noise_multiplier=1.0, sample_rate=0.1)
    assert acc.steps == 1
    Accountant("rdp", ledger=path).close()  # free again


def test_a_replaced_ledger_file_refuses_appends(tmp_path):
    path = tmp_path / "run.ledger"
    acc = Accountant("rdp", ledger=path)
    acc.step(noise_multiplier=1.0, sample_rate=0.1)
    copy_path = tmp_path / "copy"
    copy_path.write_bytes(path.read_bytes())
    os.replace(copy_path, path)  # e.g. restored from a backup while the run goes on
    with pytest.raises(InvalidHyperparameterError, match="removed or replaced"):
        acc.step(noise_multiplier=1.0, sample_rate=0.1)
    assert acc.steps == 1
    acc.close()


# ------------------------------------------------------------------------------ plugins


def _jax_step():
    """A step function for adaclip_jax.PrivacyTracker.step that returns the state of a
    transformation which used the σ it was given."""
    jnp = pytest.importorskip("jax.numpy")
    jax = pytest.importorskip("jax")
    import adaclip_jax

    def used_state(sigma):
        return adaclip_jax.AdaClipState(
            step=jnp.ones([], jnp.int32), key=jax.random.key(0), mean=None, std=None,
            nonfinite_steps=jnp.zeros([], jnp.int32), last_noise_multiplier=jnp.asarray(sigma, jnp.float32),
            seeded=jnp.asarray(False),
        )

    return lambda x, *, noise_multiplier: (x + 1, used_state(noise_multiplier))


def test_jax_tracker_with_a_ledger_records_before_it_returns(tmp_path):
    step = _jax_step()
    import adaclip_jax

    path = tmp_path / "run.ledger"
    acc = Accountant("rdp", ledger=path)
    tracker = adaclip_jax.PrivacyTracker(acc, sample_rate=0.05, noise_multiplier=1.25)
    x = 0
    for k in range(1, 4):
        x, _ = tracker.step(step, x)
        assert acc.ledger.steps == k  # on disk when the result is handed back
    acc.close()
    assert Accountant("rdp", ledger=path).history == ((0.05, 1.25, 3),)


def test_jax_tracker_restart_without_the_ledger_refuses_the_runs_checkpoint(tmp_path):
    """Issue 41.6 through adaclip_jax.PrivacyTracker.load_state_dict: refused without the
    run's ledger (tracker and accountant unchanged), restored with it, or knowingly with
    ignore_ledger=True."""
    step = _jax_step()
    import adaclip_jax

    path = tmp_path / "run.ledger"
    acc = Accountant("rdp", ledger=path)
    tracker = adaclip_jax.PrivacyTracker(acc, sample_rate=0.05, noise_multiplier=1.25)
    x = 0
    for k in range(5):
        x, _ = tracker.step(step, x)
        if k == 1:
            saved = json.loads(json.dumps(tracker.state_dict()))
    acc.close()  # the crash: 3 steps after the checkpoint are on the ledger only

    restarted = adaclip_jax.PrivacyTracker(Accountant("rdp"), sample_rate=0.05, noise_multiplier=1.25)
    restarted.step(step, 0)
    before = (restarted.steps, restarted.records_now(), restarted.accountant.state_dict())
    with pytest.raises(InvalidHyperparameterError, match=_names_the_ledger(path)):
        restarted.load_state_dict(saved)
    assert (restarted.steps, restarted.records_now(), restarted.accountant.state_dict()) == before

    resumed = adaclip_jax.PrivacyTracker(Accountant("rdp", ledger=path), sample_rate=0.05, noise_multiplier=1.25)
    resumed.load_state_dict(saved)
    assert resumed.steps == 2 and resumed.accountant.steps == 5  # every release counted
    resumed.accountant.close()

    with pytest.warns(UserWarning, match="under-counts"):
        restarted.load_state_dict(saved, ignore_ledger=True)
    assert restarted.steps == 2 and restarted.accountant.steps == 2


def test_flower_server_writes_ahead_before_the_release(tmp_path):
    pytest.importorskip("flwr")
    import numpy as np
    from flwr.app import Array, ArrayRecord, ConfigRecord
    from flwr.serverapp.strategy import FedAvg
    from flwr.supercore.task_identity import TaskIdentity

    from adaclip import FlatClipping
    from adaclip_flower import ServerSideClipping

    class Grid:
        def get_node_ids(self):
            return [101, 102, 103]

    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    try:
        acc = Accountant("rdp", ledger=tmp_path / "run.ledger")
        st = ServerSideClipping(FedAvg(), clipping=FlatClipping(max_grad_norm=1.0), noise_multiplier=1.0,
                                sample_rate=0.01, num_users=3, accountant=acc, delta=DELTA, seed=0)
        seen = []
        release = st._release

        def spy(*args):
            seen.append((acc.ledger.steps, acc.steps))
            return release(*args)

        st._release = spy
        arrays = ArrayRecord({"w": Array(np.zeros(3, np.float32))})
        for rnd in (1, 2):
            list(st.configure_train(rnd, arrays, ConfigRecord(), Grid()))
            arrays, _ = st.aggregate_train(rnd, [])
        assert seen == [(1, 0), (2, 1)]  # on the ledger before the release, in memory after
        assert acc.steps == acc.ledger.steps == 2
        acc.close()
    finally:
        TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved


# ------------------------------------------------------------------------------ fault injection

_CHILD = r"""
import sys, time
from adaclip.accounting import Accountant
acc = Accountant("rdp", ledger=sys.argv[1])
print("ready", acc.steps, flush=True)
plan = [(0.01, 1.1, 1), (0.01, 1.1, 1), (0.02, 0.9, 3), (0.01, 1.3, 1), (0.01, 1.1, 2)]
for i in range(int(sys.argv[2])):
    q, s, c = plan[i % len(plan)]
    if i % 7 == 3:
        acc.write_ahead(noise_multiplier=s, sample_rate=q, num_steps=c)
        acc.step(noise_multiplier=s, sample_rate=q, num_steps=c, logged=True)
    else:
        acc.step(noise_multiplier=s, sample_rate=q, num_steps=c)
    print(acc.steps, flush=True)  # reported only after the record returned
    time.sleep(0.003)  # a gap in which a kill finds the reported step and nothing in flight
time.sleep(60)
"""


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PYTHONWARNINGS"] = "ignore"
    return env


def _kill_loop(tmp_path, kills, seed, max_steps):
    rng = random.Random(seed)
    path = tmp_path / "run.ledger"
    counted = 0
    for _ in range(kills):
        proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(path), str(max_steps)], cwd=ROOT, env=_env(),
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            first = proc.stdout.readline()
            assert first.startswith("ready"), first
            assert int(first.split()[1]) >= counted  # the ledger is never lowered
            time.sleep(rng.uniform(0.0, 0.15))
        finally:
            proc.send_signal(signal.SIGKILL)
        out, _ = proc.communicate(timeout=30)
        reported = [int(line) for line in out.split()]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", LedgerRepairWarning)
            with PrivacyLedger(path) as led:
                steps = led.steps
        assert steps >= max(reported, default=counted), (steps, reported[-3:])
        assert steps >= counted
        counted = steps
    return counted


def test_sigkill_never_loses_a_reported_step_fast(tmp_path):
    assert _kill_loop(tmp_path, kills=3, seed=0, max_steps=400) > 0


@pytest.mark.slow
def test_sigkill_never_loses_a_reported_step_many_times(tmp_path):
    assert _kill_loop(tmp_path, kills=40, seed=1, max_steps=1500) > 0
