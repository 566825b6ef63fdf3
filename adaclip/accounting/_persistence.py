"""The accountant's saved state: its versioned format, its validation, and its file.

:meth:`Accountant.state_dict <adaclip.accounting.Accountant.state_dict>` is a JSON-serialisable
mapping tagged with :data:`_STATE_FORMAT` and :data:`_STATE_VERSION` (version 1: ``mechanism``,
``target_epsilon``, ``delta``, ``options`` {``pld_value_discretization_interval``,
``rdp_orders``}, ``history`` [[q, σ, count], ...], the ledger's ``run_id`` and, as a hint for
error messages, the absolute ``ledger_path`` it had when the state was saved; both ``None``
without a ledger, and a state without ``ledger_path`` is read as ``None``). This module
validates such a state before anything is changed (:func:`parse_state`), decides how it may be
restored (:func:`plan_restore`: a checkpoint of a run that kept a crash-safe ledger is restored
only with that ledger, onto its own run, and never lowers ε), and reads and writes the JSON file
(atomically).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from adaclip.accounting._checks import (
    _check_budget,
    _check_count,
    _check_discretization,
    _check_noise_multiplier,
    _check_orders,
    _check_sample_rate,
)
from adaclip.accounting._events import Run
from adaclip.accounting._pld import DEFAULT_PLD_VALUE_DISCRETIZATION_INTERVAL
from adaclip.errors import InvalidHyperparameterError
from adaclip.ledger import PrivacyLedger

_STATE_FORMAT = "adaclip.accounting.Accountant"
_STATE_VERSION = 1


class LoadedState(NamedTuple):
    """A validated :meth:`~adaclip.accounting.Accountant.state_dict`."""

    target_epsilon: float | None
    delta: float | None
    pld_value_discretization_interval: float
    rdp_orders: tuple[float, ...] | None
    runs: list[Run]
    run_id: str | None
    #: where the run's ledger was when the state was saved (only ever shown in messages)
    ledger_path: str | None = None

    @property
    def steps(self) -> int:
        """The number of steps the state records."""
        return sum(count for _, _, count in self.runs)


def parse_state(state: Any, mechanism: str) -> LoadedState:
    """Validate a state for an accountant of ``mechanism``; raises
    :class:`~adaclip.errors.InvalidHyperparameterError` on the first problem found."""
    if not isinstance(state, Mapping):
        raise InvalidHyperparameterError(f"state must be a mapping, got {type(state).__name__}")
    fmt = state.get("format", _STATE_FORMAT)
    if fmt != _STATE_FORMAT:
        raise InvalidHyperparameterError(f"state format must be {_STATE_FORMAT!r}, got {fmt!r}")
    version = state.get("version", _STATE_VERSION)
    if version != _STATE_VERSION:
        raise InvalidHyperparameterError(f"state version {version!r} is not supported")
    if "mechanism" not in state:
        raise InvalidHyperparameterError("state has no 'mechanism'")
    if state["mechanism"] != mechanism:
        raise InvalidHyperparameterError(
            f"mechanism mismatch: the state is for {state['mechanism']!r}, this accountant uses {mechanism!r}"
        )
    target_epsilon, delta = _check_budget(state.get("target_epsilon"), state.get("delta"))
    options = state.get("options", {})
    if not isinstance(options, Mapping):
        raise InvalidHyperparameterError(f"state 'options' must be a mapping, got {options!r}")
    unknown = set(options) - {"pld_value_discretization_interval", "rdp_orders"}
    if unknown:
        raise InvalidHyperparameterError(f"state 'options' has unknown keys {sorted(unknown)}")
    interval = _check_discretization(
        options.get("pld_value_discretization_interval", DEFAULT_PLD_VALUE_DISCRETIZATION_INTERVAL)
    )
    orders = _check_orders(options.get("rdp_orders"))
    runs = _parse_history(state.get("history"))
    run_id = state.get("run_id")
    if run_id is not None and (not isinstance(run_id, str) or not run_id):
        raise InvalidHyperparameterError(f"state 'run_id' must be a non-empty string or None, got {run_id!r}")
    ledger_path = state.get("ledger_path")
    if ledger_path is not None and (not isinstance(ledger_path, str) or not ledger_path):
        raise InvalidHyperparameterError(
            f"state 'ledger_path' must be a non-empty string or None, got {ledger_path!r}"
        )
    return LoadedState(target_epsilon, delta, interval, orders, runs, run_id, ledger_path)


def _parse_history(history: Any) -> list[Run]:
    if history is None or isinstance(history, (str, bytes, Mapping)) or not isinstance(history, Iterable):
        raise InvalidHyperparameterError(f"state 'history' must be a list of [q, sigma, count], got {history!r}")
    runs: list[Run] = []
    for i, run in enumerate(history):
        if isinstance(run, (str, bytes, Mapping)) or not isinstance(run, Sequence) or len(run) != 3:
            raise InvalidHyperparameterError(
                f"state 'history' entry {i} must be [sample_rate, noise_multiplier, count], got {run!r}"
            )
        q = _check_sample_rate(run[0], f"history[{i}] sample_rate")
        s = _check_noise_multiplier(run[1], f"history[{i}] noise_multiplier")
        c = _check_count(run[2], f"history[{i}] count")
        if runs and runs[-1][0] == q and runs[-1][1] == s:
            runs[-1] = (q, s, runs[-1][2] + c)
        else:
            runs.append((q, s, c))
    return runs


class Restore(NamedTuple):
    """How a checkpoint is restored into an accountant (see :func:`plan_restore`)."""

    #: the runs to append to the accountant's ledger before memory changes
    to_append: list[Run]
    #: the ledger run the accountant belongs to afterwards, when it has no ledger
    run_id: str | None
    #: the checkpoint's ledger run is ignored (``ignore_ledger=True``): ε may under-count
    ignored: bool


def plan_restore(
    loaded: LoadedState, *, ledger: PrivacyLedger | None, run_id: str | None, ignore_ledger: bool = False
) -> Restore:
    """Decide how the checkpoint ``loaded`` is restored into an accountant with ``ledger``
    (``None``: it keeps none) that belongs to ledger run ``run_id``; raise
    :class:`~adaclip.errors.InvalidHyperparameterError` if it must not be. Changes nothing.

    This is the one rule of every restore of an accountant's history (``Accountant.load_state_dict``
    and ``Accountant.load``, and through them ``DPOptimizer.load_state_dict``,
    ``adaclip_jax.PrivacyTracker.load_state_dict`` and an accountant given to a Flower strategy):

    - A checkpoint that names a ledger run was saved by a run that keeps a crash-safe ledger.
      The ledger, not the checkpoint, holds that run's releases: every release made after the
      checkpoint was saved is in the ledger only. So such a checkpoint is restored only *with
      the ledger*: onto an accountant with that run's ledger (:func:`runs_to_append` checks the
      run and that the checkpoint is a prefix of the ledger; the ledger's history then wins).
      An accountant **without a ledger refuses it** — a restart that forgot ``ledger=`` would
      otherwise count only the checkpoint's steps and forget releases that may have been seen.
      The one exception is an accountant without a ledger that already belongs to that run (a
      copy or pickle of the run's accountant, which is detached from the ledger by design, or
      one restored earlier from that run's checkpoint): it is restoring its own run.
    - A checkpoint that names no run (saved without a ledger) is restored as it is without a
      ledger, and starts an empty ledger (its history is appended to it).
    - ``ignore_ledger=True`` is the deliberate way out when the run's ledger is lost for good:
      the checkpoint is then restored as if it had been saved without a ledger (into an
      accountant without one, or as the start of a new, empty ledger). It **under-counts ε**
      by every release the run made after the checkpoint; ``ignored`` says it happened, so
      that the caller warns. It changes nothing when the ledger is the checkpoint's own run's.
    """
    saved_run = loaded.run_id
    own_run = ledger.run_id if ledger is not None else run_id
    ignored = ignore_ledger and saved_run is not None and saved_run != own_run
    if ignored:
        if ledger is not None and ledger.steps:
            runs_to_append(ledger, loaded.runs, saved_run)  # refuses: another run's ledger, not a new one
        saved_run = None
    if ledger is not None:
        return Restore(runs_to_append(ledger, loaded.runs, saved_run), ledger.run_id, ignored)
    if saved_run is not None and saved_run != run_id:
        raise InvalidHyperparameterError(_ledger_required_message(loaded))
    return Restore([], saved_run, ignored)


def _ledger_required_message(loaded: LoadedState) -> str:
    """The refusal of a ledger run's checkpoint by an accountant without a ledger: it names
    ``ledger=`` with the run's ledger path when the checkpoint knows it."""
    if loaded.ledger_path is not None:
        where, arg = f" at {loaded.ledger_path!r}", repr(loaded.ledger_path)
    else:
        where, arg = "", "PATH"
    how = (
        f"Pass the run's ledger: Accountant(..., ledger={arg}), make_private(..., ledger={arg}) or "
        f"Accountant.load(checkpoint, ledger={arg})"
    )
    if loaded.ledger_path is None:
        how += ", with PATH the ledger file the run was started with"
    return (
        f"this checkpoint was saved by a run that keeps a crash-safe privacy ledger (run {loaded.run_id}"
        f"{where}), but this accountant has no ledger: restoring it would count only the "
        f"{loaded.steps} steps the checkpoint records and forget every release the run made after "
        f"it (they are in the ledger only). {how}. Nothing was changed. (Only if that ledger is lost "
        "for good: ignore_ledger=True restores the checkpoint anyway, and epsilon then under-counts.)"
    )


def runs_to_append(ledger: PrivacyLedger, runs: list[Run], run_id: str | None) -> list[Run]:
    """The runs of a checkpoint (``runs``, ``run_id``) that ``ledger`` must append before the
    checkpoint is restored onto it: all of them onto an empty ledger when the checkpoint names no
    run, none when it is a prefix of the ledger's own run. Anything else is refused."""
    if ledger.closed:
        raise InvalidHyperparameterError(f"ledger {ledger.path!r} is closed; the state was not loaded")
    if run_id is None:
        if ledger.steps:
            raise InvalidHyperparameterError(
                f"the checkpoint names no ledger run (it was saved without a ledger) and ledger "
                f"{ledger.path!r} already records {ledger.steps} steps of run {ledger.run_id}: a ledger "
                "that does not match the run is refused. Load the checkpoint with the ledger it was "
                "saved with, or into an accountant with a new ledger"
            )
        return runs
    if run_id != ledger.run_id:
        raise InvalidHyperparameterError(
            f"the checkpoint belongs to ledger run {run_id}, but ledger {ledger.path!r} records run "
            f"{ledger.run_id}: a ledger that does not match the run is refused. Use that run's ledger"
        )
    problem = _prefix_problem(runs, list(ledger.history))
    if problem is not None:
        raise InvalidHyperparameterError(
            f"the checkpoint's history is not a prefix of the history in ledger {ledger.path!r} "
            f"({problem}): the checkpoint and the ledger disagree (a ledger restored from an "
            "older copy, or edited?); refused"
        )
    return []


def _prefix_problem(prefix: Sequence[Run], runs: Sequence[Run]) -> str | None:
    """``None`` if the steps of ``prefix`` (its runs expanded to one ``(q, σ)`` per step) are
    the first steps of ``runs``; otherwise where they part."""
    i = j = 0
    left_a = left_b = 0
    pa = pb = (0.0, 0.0)
    step = 0
    while True:
        if left_a == 0:
            if i == len(prefix):
                return None
            pa, left_a = (prefix[i][0], prefix[i][1]), prefix[i][2]
            i += 1
        if left_b == 0:
            if j == len(runs):
                total = sum(r[2] for r in prefix)
                return f"the checkpoint records {total} steps, the ledger only {step}"
            pb, left_b = (runs[j][0], runs[j][1]), runs[j][2]
            j += 1
        if pa != pb:
            return (
                f"step {step + 1} has (sample_rate, noise_multiplier) = {pa} in the checkpoint and {pb} "
                "in the ledger"
            )
        k = min(left_a, left_b)
        left_a -= k
        left_b -= k
        step += k


def open_ledger(ledger: str | os.PathLike[str] | PrivacyLedger, mechanism: str, *, adopt: bool = False) -> PrivacyLedger:
    """The ledger an accountant of ``mechanism`` is to append to: ``ledger`` itself if it is an
    open :class:`~adaclip.ledger.PrivacyLedger` of that mechanism, else the ledger at that path
    (created with ``mechanism`` if missing; one of another mechanism is refused). With
    ``adopt`` (an accountant made with the default mechanism) an existing ledger of another
    mechanism is accepted: the accountant then accounts with the ledger's."""
    if isinstance(ledger, PrivacyLedger):
        if ledger.closed:
            raise InvalidHyperparameterError(f"ledger {ledger.path!r} is closed")
        if ledger.mechanism != mechanism and not adopt:
            raise InvalidHyperparameterError(
                f"mechanism mismatch: ledger {ledger.path!r} records a {ledger.mechanism!r} run, this "
                f"accountant uses {mechanism!r}; a ledger is accounted with the mechanism it was created with"
            )
        return ledger
    if isinstance(ledger, (str, os.PathLike)) and not isinstance(ledger, bytes):
        if adopt and os.path.exists(ledger):
            return PrivacyLedger(ledger)  # the mechanism its header records
        return PrivacyLedger(ledger, accountant=mechanism)  # refuses another method
    raise InvalidHyperparameterError(f"ledger must be a path, a PrivacyLedger or None, got {ledger!r}")


# ------------------------------------------------------------------------------ the file


def write_state(path: str | os.PathLike[str], state: Mapping[str, Any]) -> None:
    """Write ``state`` as JSON to ``path`` atomically (a temporary file, then a rename)."""
    text = json.dumps(state, indent=2, allow_nan=False)
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".accountant-", suffix=".json", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text + "\n")
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def read_state(path: str | os.PathLike[str]) -> Mapping[str, Any]:
    """The state that :func:`write_state` wrote to ``path`` (checked to name a mechanism)."""
    with open(path, encoding="utf-8") as f:
        try:
            state = json.load(f)
        except json.JSONDecodeError as err:
            raise InvalidHyperparameterError(f"{os.fspath(path)!r} is not valid JSON: {err}") from None
    if not isinstance(state, Mapping) or "mechanism" not in state:
        raise InvalidHyperparameterError(f"{os.fspath(path)!r} does not hold an accountant state")
    return state


def refuse_missing_ledger(
    path: str | os.PathLike[str], state: Mapping[str, Any], ledger: str | os.PathLike[str] | PrivacyLedger | None
) -> None:
    """Refuse to restore a checkpoint that names a ledger run onto a ledger path that does not
    exist (a new ledger would not count the releases made after the checkpoint)."""
    if (
        isinstance(ledger, (str, os.PathLike))
        and state.get("run_id") is not None
        and not os.path.exists(ledger)
    ):
        raise InvalidHyperparameterError(
            f"{os.fspath(path)!r} belongs to ledger run {state['run_id']!r}, but the ledger "
            f"{os.fspath(ledger)!r} does not exist: pass that run's ledger (a new ledger would not "
            "count the releases made after the checkpoint)"
        )
