"""A crash-safe privacy ledger: an append-only, fsynced file of the releases of a training run.

Why
---
An :class:`~adaclip.accounting.Accountant` lives in memory and is saved with the checkpoints.
When the process dies, the releases made since the last checkpoint (parameters that were
logged, pushed to a hub, sent to other nodes) have happened, but a restart from that
checkpoint has never heard of them: the ε it reports is too low. A :class:`PrivacyLedger` is a
file that records every release *durably* as it is made, so that whatever the crash, the
spent privacy can be counted again from the file.

The privacy argument
--------------------
**Write-ahead.** :meth:`PrivacyLedger.append` writes the record and ``os.fsync``\\ s the file
before it returns (and the directory when the file is created). A caller appends *before*
anything computed from the release leaves the process. Then at every instant each release
that anyone can have seen has a record on stable storage: a crash can lose the in-memory
accountant, never the record. (A crash between the append and the release loses nothing
either: the ledger then counts a step that was never released — one step too many, which is
the safe direction.) :meth:`~adaclip.accounting.Accountant.step` and
:meth:`~adaclip.accounting.Accountant.record_released` append before they update memory;
:meth:`~adaclip.accounting.Accountant.write_ahead` appends only, for callers that must log
before the release and record in memory after it.

**A torn last record is spent.** A crash during an append can leave the last line
incomplete or garbled (no trailing newline, unparseable, bad checksum). Its release may
already be out — a caller may not have waited for the append to return, a disk may reorder
the writes of one line — so it is counted, conservatively, as one event with the costliest
parameters the file justifies (see *Bounds* below), never as nothing. Only the *last* line can
be torn: each append is fsynced before the next starts, so every earlier line was complete
on disk before a later one was written. A damaged line that is *not* the last is therefore
not an interrupted append but corruption, and the ledger is refused (the count could be
anything).

**Never restore a ledger from a backup.** The ledger is the lower bound of what the run has
spent; an older copy lacks the releases made since it was taken, and restoring it lowers ε
exactly as restoring an old checkpoint would. Back it up by copying it *forward* only, and
keep the copy apart from the live file. For the same reason there is no API that removes a
record, and a ledger whose file is removed or replaced while open refuses to append.

**Checkpoints.** ``Accountant.state_dict()`` carries the ledger's :attr:`run_id`; loading a
checkpoint into an accountant with a ledger checks that it is the same run and that its
history is a prefix of the ledger's, and then keeps the ledger's history: restoring an older
checkpoint never lowers the spent ε.

File format
-----------
UTF-8 (ASCII) JSON lines, one record per line. Every record is a JSON object written with sorted
keys and compact separators (``allow_nan=False``), with ``"crc"``: the CRC-32, as 8 hex digits,
of the record's canonical JSON *without* the ``"crc"`` key. A line is valid only if it is exactly
that canonical text (so any changed byte is detected), and ``"n"`` is its 0-based line number
(so a deleted, duplicated or reordered line in the middle is detected). Records:

- line 0, the header: ``{"created": ISO-8601 UTC, "format": "adaclip.privacy-ledger",
  "kind": "header", "mechanism": "rdp"|"pld", "n": 0, "run_id": uuid4 hex, "version": 1}``;
- ``{"count": c, "kind": "release", "n": i, "q": q, "sigma": σ}``: ``c`` steps of the sampled
  Gaussian mechanism with sample rate ``q`` and noise multiplier ``σ`` (one append);
- ``{"count_max": c, "kind": "bound", "n": i, "q_max": q, "sigma_min": σ}``: see below;
- ``{"count": c, "kind": "torn", "n": i, "q": q, "sigma": σ, "torn_bytes": b}``: the conservative
  replacement of a torn line of ``b`` bytes, counted like a release.

**Bounds.** Before an append whose ``(q, σ, count)`` is not covered by the last bound
(``q ≤ q_max``, ``σ ≥ σ_min``, ``count ≤ count_max``), or whose ``count`` is below
``count_max``, a new ``bound`` record is appended and fsynced: ``q_max`` and ``σ_min`` widened
to cover the append, ``count_max`` set to its count. So every release record is covered by the
last complete bound before it, which makes the torn-record rule safe:

- a torn last line after a complete bound is counted as ``count_max`` steps with ``q_max``
  and ``σ_min`` of the last complete bound — an upper bound of whatever the torn line was (ε
  grows with ``q`` and the count, and falls with ``σ``, for the sampled Gaussian mechanism);
- a torn last line with *no* complete bound before it can only be the first bound record,
  written before any release: nothing was released, and it is dropped.

Bounds cost one extra fsync only when the parameters leave the bound: once at the start, and
once per change with a decaying σ or a changing ``count``; with constant ``(q, σ)`` and one step
per append, none after the first.

On open, a torn tail is repaired so that the next append does not glue onto the torn bytes:
the file is rewritten atomically (a temporary file with the complete lines and the ``torn``
record, fsynced, renamed over the ledger, directory fsynced); a crash during the repair leaves
either the old file (whose torn line is counted again on the next open) or the repaired one.
A :class:`LedgerRepairWarning` says what was counted.

Single writer
-------------
One :class:`PrivacyLedger` object appends to a file at a time. On POSIX it holds an advisory
``fcntl.flock`` lock from open to :meth:`~PrivacyLedger.close`, so a second ledger on the
same file, in this or another process, is refused (on file systems without ``flock`` that
is up to you). A forked child cannot append through its parent's ledger, and a ledger cannot
be pickled or copied. The object itself is not thread-safe: append from one thread, or lock.
"""

from __future__ import annotations

import datetime
import errno
import json
import math
import os
import tempfile
import uuid
import warnings
import zlib
from typing import Any

from adaclip.errors import InvalidHyperparameterError
from adaclip.options import integer_at_least, warn_mechanism_keyword

try:  # POSIX only: advisory locking
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None  # type: ignore[assignment]

__all__ = ["PrivacyLedger", "LedgerRepairWarning", "LEDGER_FORMAT", "LEDGER_VERSION"]

#: The ``"format"`` of a ledger's header.
LEDGER_FORMAT: str = "adaclip.privacy-ledger"
#: The ledger file format version this module writes and reads.
LEDGER_VERSION: int = 1

# The accounting mechanisms (adaclip.accounting.MECHANISMS; repeated here to avoid an import cycle).
_MECHANISMS = ("rdp", "pld")

Run = tuple[float, float, int]
Bound = tuple[float, float, int]

_HEADER_KEYS = {"created", "format", "kind", "mechanism", "n", "run_id", "version"}
_RECORD_KEYS = {
    "release": {"count", "kind", "n", "q", "sigma"},
    "torn": {"count", "kind", "n", "q", "sigma", "torn_bytes"},
    "bound": {"count_max", "kind", "n", "q_max", "sigma_min"},
}


class LedgerRepairWarning(UserWarning):
    """A ledger was opened with a torn last record (an append interrupted by a crash).

    The message says how it was counted (see :mod:`adaclip.ledger`) and that the file was
    repaired.
    """


# --------------------------------------------------------------------------------------
# records
# --------------------------------------------------------------------------------------


def _canonical(body: dict[str, Any]) -> str:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False, ensure_ascii=True)


def _crc(payload: str) -> str:
    return f"{zlib.crc32(payload.encode('ascii')) & 0xFFFFFFFF:08x}"


def _encode(body: dict[str, Any]) -> bytes:
    """One line: the record's canonical JSON with its checksum, and a newline."""
    return (_canonical({**body, "crc": _crc(_canonical(body))}) + "\n").encode("ascii")


def _decode(raw: bytes) -> dict[str, Any] | None:
    """The record of one line (without its newline), or ``None`` if it is not byte for byte a
    record this module writes with a matching checksum."""
    try:
        text = raw.decode("ascii")
        obj = json.loads(text)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    if not isinstance(obj, dict):
        return None
    crc = obj.pop("crc", None)
    if not isinstance(crc, str):
        return None
    try:
        if _crc(_canonical(obj)) != crc or _canonical({**obj, "crc": crc}) != text:
            return None
    except (TypeError, ValueError):  # NaN / infinity
        return None
    return obj


def _looks_like_torn_header(raw: bytes) -> bool:
    """Whether a lone unreadable first line can be an interrupted header write (a prefix of
    one, possibly with zero bytes where the rest did not reach the disk)."""
    start = b'{"crc":"'
    text = raw.rstrip(b"\0")
    return text[: len(start)] == start[: len(text)]


def _real(value: Any, what: str) -> float:
    if isinstance(value, (bool, str, bytes)) or value is None:
        raise InvalidHyperparameterError(f"{what} must be a real number, got {value!r}")
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise InvalidHyperparameterError(f"{what} must be a real number, got {value!r}") from None
    if not math.isfinite(x):
        raise InvalidHyperparameterError(f"{what} must be finite, got {value!r}")
    return x


def _sample_rate(value: Any, what: str = "sample_rate") -> float:
    q = _real(value, what)
    if not 0 <= q <= 1:
        raise InvalidHyperparameterError(f"{what} must be in [0, 1], got {value!r}")
    return q


def _noise_multiplier(value: Any, what: str = "noise_multiplier") -> float:
    s = _real(value, what)
    if s < 0:
        raise InvalidHyperparameterError(f"{what} must be finite and >= 0, got {value!r}")
    return s


def _covers(bound: Bound | None, q: float, sigma: float, count: int) -> bool:
    return bound is not None and q <= bound[0] and sigma >= bound[1] and count <= bound[2]


def _merge(runs: list[Run], q: float, sigma: float, count: int) -> None:
    if runs and runs[-1][0] == q and runs[-1][1] == sigma:
        runs[-1] = (q, sigma, runs[-1][2] + count)
    else:
        runs.append((q, sigma, count))


# --------------------------------------------------------------------------------------
# file helpers
# --------------------------------------------------------------------------------------


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _fsync_dir(directory: str) -> None:
    """fsync a directory, so that a file created or renamed in it survives a crash."""
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # pragma: no cover - e.g. Windows, where directories cannot be opened
        return
    try:
        os.fsync(fd)
    except OSError as err:  # pragma: no cover - file systems that cannot sync a directory
        if err.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def _same_file(fd: int, path: str) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


class _Parsed:
    """What a ledger file holds (see :func:`_parse`)."""

    def __init__(self) -> None:
        self.header: dict[str, Any] = {}
        self.runs: list[Run] = []
        self.bound: Bound | None = None
        self.lines = 0  # complete lines (the next record number)
        self.torn_at: int | None = None  # byte offset of a torn last line
        self.needs_newline = False  # the last line is complete but lacks its newline


def _parse(data: bytes, name: str) -> _Parsed:
    """Read a ledger file's bytes; raise InvalidHyperparameterError if it cannot be trusted."""
    out = _Parsed()
    if not data:
        raise InvalidHyperparameterError(
            f"privacy ledger {name} is empty: its creation was interrupted before its header was "
            "written, so no release can have been recorded in it. Remove the empty file (or pass "
            "another path) to start a new ledger"
        )
    pieces = data.split(b"\n")
    lines = [(raw, True) for raw in pieces[:-1]]
    if pieces[-1]:
        lines.append((pieces[-1], False))
    records: list[dict[str, Any]] = []
    offset = 0
    for i, (raw, terminated) in enumerate(lines):
        rec = _decode(raw)
        if rec is None:
            if i < len(lines) - 1:
                raise InvalidHyperparameterError(
                    f"privacy ledger {name}: line {i + 1} (of {len(lines)}) is corrupted (unparseable or "
                    "its checksum does not match) and is not the last line, so it is not an interrupted "
                    "append: this ledger cannot be trusted and is refused. Keep the file as it is (editing "
                    "or deleting lines can only lower the privacy counted) and account the run from a "
                    "trusted copy, or treat its privacy as spent"
                )
            if i == 0:
                if not _looks_like_torn_header(raw):
                    raise InvalidHyperparameterError(
                        f"{name} is not a privacy ledger (line 1 is not a ledger header); check the path"
                    )
                raise InvalidHyperparameterError(
                    f"privacy ledger {name} holds only an incomplete header: its creation was interrupted, "
                    "so no release can have been recorded in it. Remove the file (or pass another path) "
                    "to start a new ledger"
                )
            out.torn_at = offset
            break
        records.append(rec)
        out.needs_newline = not terminated
        offset += len(raw) + 1
    out.lines = len(records)
    _check_header(records[0], name)
    out.header = records[0]
    for i, rec in enumerate(records[1:], start=1):
        _apply(out, rec, i, name)
    return out


def _check_header(rec: dict[str, Any], name: str) -> None:
    def bad(why: str) -> InvalidHyperparameterError:
        return InvalidHyperparameterError(f"privacy ledger {name}: line 1 is not a valid ledger header ({why})")

    if rec.get("kind") != "header" or rec.get("format") != LEDGER_FORMAT:
        raise bad(f"expected kind 'header' and format {LEDGER_FORMAT!r}; is this a privacy ledger?")
    version = rec.get("version")
    if isinstance(version, int) and not isinstance(version, bool) and version > LEDGER_VERSION:
        raise InvalidHyperparameterError(
            f"privacy ledger {name} has format version {version}, newer than this adaclip reads "
            f"({LEDGER_VERSION}); upgrade adaclip"
        )
    if version != LEDGER_VERSION:
        raise bad(f"version {version!r}")
    if set(rec) != _HEADER_KEYS:
        raise bad(f"keys {sorted(rec)}")
    if rec["n"] != 0:
        raise bad(f"record number {rec['n']!r}")
    if rec["mechanism"] not in _MECHANISMS:
        raise bad(f"mechanism {rec['mechanism']!r}")
    run_id = rec["run_id"]
    if not (isinstance(run_id, str) and len(run_id) == 32 and all(c in "0123456789abcdef" for c in run_id)):
        raise bad(f"run_id {run_id!r}")
    if not isinstance(rec["created"], str):
        raise bad(f"created {rec['created']!r}")


def _apply(out: _Parsed, rec: dict[str, Any], i: int, name: str) -> None:
    """Validate record ``i`` (a complete line) and add it to ``out``."""
    where = f"privacy ledger {name}: line {i + 1}"
    kind = rec.get("kind")
    if kind not in _RECORD_KEYS or set(rec) != _RECORD_KEYS[kind]:
        raise InvalidHyperparameterError(f"{where} is not a ledger record (kind {kind!r}, keys {sorted(rec)})")
    if rec["n"] != i or isinstance(rec["n"], bool):
        raise InvalidHyperparameterError(
            f"{where} has record number {rec['n']!r}, expected {i}: a line was removed, duplicated or "
            "moved; this ledger cannot be trusted and is refused"
        )
    try:
        if kind == "bound":
            out.bound = (
                _sample_rate(rec["q_max"], "q_max"),
                _noise_multiplier(rec["sigma_min"], "sigma_min"),
                integer_at_least("count_max", rec["count_max"], 1),
            )
            return
        q, sigma = _sample_rate(rec["q"], "q"), _noise_multiplier(rec["sigma"], "sigma")
        count = integer_at_least("count", rec["count"], 1)
        if kind == "torn":
            integer_at_least("torn_bytes", rec["torn_bytes"], 0)
    except InvalidHyperparameterError as err:
        raise InvalidHyperparameterError(f"{where}: {err}; this ledger cannot be trusted and is refused") from None
    if not _covers(out.bound, q, sigma, count):
        raise InvalidHyperparameterError(
            f"{where} records (q={q!r}, sigma={sigma!r}, count={count}) outside the preceding bound "
            f"{out.bound}: the file was not written by PrivacyLedger; it cannot be trusted and is refused"
        )
    _merge(out.runs, q, sigma, count)


# --------------------------------------------------------------------------------------
# the ledger
# --------------------------------------------------------------------------------------


class PrivacyLedger:
    """An append-only, fsynced file of the releases (``(q, σ, count)`` events) of one run.

    Args:
        path: the ledger file. If it exists it is read (all records; a torn last record is
            counted as spent and repaired, see :mod:`adaclip.ledger`); otherwise it is created
            with a new header — which needs ``accountant``.
        accountant: ``"rdp"`` or ``"pld"``, the accounting method of the run (the header
            records it as ``"mechanism"``, readable as :attr:`mechanism`). For an existing
            ledger it must match the header's (``None``: accept the header's).
        mechanism: the old name of ``accountant=``: deprecated, it still works and warns
            :class:`FutureWarning`.

    Raises:
        InvalidHyperparameterError: the file is not a ledger, is corrupted anywhere but in its
            last line, records another method, does not exist and ``accountant`` is ``None``,
            or another :class:`PrivacyLedger` holds it open. The file is then left untouched.
        OSError: the file or its directory cannot be read, written or synced.

    The ledger is open (and locked, on POSIX) from construction to :meth:`close`; it is also a
    context manager. :meth:`append` is the only way to change it: records are never removed.
    """

    def __init__(
        self, path: str | os.PathLike[str], *, accountant: str | None = None, mechanism: str | None = None
    ) -> None:
        if mechanism is not None:
            warn_mechanism_keyword("PrivacyLedger", stacklevel=2)
            if accountant is not None and accountant != mechanism:
                raise InvalidHyperparameterError(
                    f"{mechanism!r} (mechanism=, accountant='s old name) and accountant={accountant!r} name "
                    "different accounting methods; give one of them"
                )
            accountant = mechanism
        if accountant is not None and (not isinstance(accountant, str) or accountant not in _MECHANISMS):
            raise InvalidHyperparameterError(f"accountant must be one of {_MECHANISMS} or None, got {accountant!r}")
        mechanism = accountant  # the header's name for it
        if isinstance(path, bytes) or not isinstance(path, (str, os.PathLike)):
            raise InvalidHyperparameterError(f"path must be a str or os.PathLike, got {path!r}")
        self._path = os.fspath(path)
        self._real = os.path.realpath(self._path)
        self._file: Any = None
        self._pid = os.getpid()
        self._broken: str | None = None
        self._runs: list[Run] = []
        self._steps = 0
        self._bound: Bound | None = None
        self._next = 0
        self._header: dict[str, Any] = {}
        for _ in range(8):
            try:
                f = open(self._real, "r+b", buffering=0)  # noqa: SIM115 - held open until close()
            except FileNotFoundError:
                f = None
            if f is None:
                if mechanism is None:
                    raise InvalidHyperparameterError(
                        f"privacy ledger {self._path!r} does not exist; pass accountant='rdp' or 'pld' to create it"
                    )
                try:
                    self._create(mechanism)
                except FileExistsError:
                    continue  # created by someone else meanwhile: open theirs
                return
            try:
                self._lock(f)
            except BaseException:
                f.close()
                raise
            if _same_file(f.fileno(), self._real):
                break
            f.close()  # replaced (repaired) between our open and our lock: open the new file
        else:  # pragma: no cover - the file kept being replaced
            raise InvalidHyperparameterError(f"privacy ledger {self._path!r} kept changing while being opened")
        try:
            self._open_existing(f, mechanism)
        except BaseException:
            f.close()
            self.close()
            raise

    # ---------------------------------------------------------------- opening

    def _lock(self, f: Any) -> None:
        if fcntl is None:  # pragma: no cover - not POSIX
            return
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise InvalidHyperparameterError(
                f"privacy ledger {self._path!r} is open for writing by another PrivacyLedger (an "
                "Accountant in this or another process): a ledger has a single writer. Close the other "
                "one (Accountant.close() / PrivacyLedger.close()) or let its process end, then open it again"
            ) from None
        except OSError as err:  # pragma: no cover - file systems without flock: single writer is up to the user
            if err.errno not in (errno.ENOLCK, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS):
                raise

    def _create(self, mechanism: str) -> None:
        """Create the file with a header, fsynced, atomically (it never exists half-written)."""
        header = {
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "format": LEDGER_FORMAT,
            "kind": "header",
            "mechanism": mechanism,
            "n": 0,
            "run_id": uuid.uuid4().hex,
            "version": LEDGER_VERSION,
        }
        line = _encode(header)
        directory = os.path.dirname(self._real)
        fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(self._real) + ".", suffix=".new", dir=directory)
        f = os.fdopen(fd, "r+b", buffering=0)
        linked = False
        try:
            self._lock(f)
            _write_all(f.fileno(), line)
            os.fsync(f.fileno())
            try:
                os.link(tmp, self._real)  # FileExistsError if it exists: never overwrite a ledger
                linked = True
            except FileExistsError:
                raise
            except OSError:  # pragma: no cover - no hard links on this file system
                pass
        except BaseException:
            f.close()
            os.unlink(tmp)
            raise
        os.unlink(tmp)
        if not linked:  # pragma: no cover - fallback: exclusive create in place
            f.close()
            fd = os.open(self._real, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            f = os.fdopen(fd, "r+b", buffering=0)
            try:
                self._lock(f)
                _write_all(f.fileno(), line)
                os.fsync(f.fileno())
            except BaseException:
                f.close()
                raise
        _fsync_dir(directory)
        os.lseek(f.fileno(), 0, os.SEEK_END)
        self._file = f
        self._header = header
        self._next = 1

    def _open_existing(self, f: Any, mechanism: str | None) -> None:
        data = f.read()
        parsed = _parse(data, repr(self._path))
        header = parsed.header
        if mechanism is not None and header["mechanism"] != mechanism:
            raise InvalidHyperparameterError(
                f"privacy ledger {self._path!r} records a {header['mechanism']!r} run, not {mechanism!r}: "
                "a ledger is accounted with the mechanism it was created with; use "
                f"Accountant({header['mechanism']!r}, ...) or another ledger"
            )
        self._file = f
        self._header = header
        self._runs = parsed.runs
        self._bound = parsed.bound
        self._next = parsed.lines
        if parsed.torn_at is not None:
            self._repair(data, parsed.torn_at)
        elif parsed.needs_newline:
            os.lseek(f.fileno(), 0, os.SEEK_END)
            _write_all(f.fileno(), b"\n")
            os.fsync(f.fileno())
        self._steps = sum(r[2] for r in self._runs)
        os.lseek(self._file.fileno(), 0, os.SEEK_END)

    def _repair(self, data: bytes, offset: int) -> None:
        """Count the torn tail ``data[offset:]`` as spent and make the file parseable again."""
        torn = len(data) - offset
        f = self._file
        if self._bound is None:
            # No complete bound: the torn line is the first bound record, written before any
            # release. Nothing was released; drop it (either state of a crash here is safe).
            os.ftruncate(f.fileno(), offset)
            os.fsync(f.fileno())
            warnings.warn(
                LedgerRepairWarning(
                    f"privacy ledger {self._path!r}: its last line ({torn} bytes) was torn by an "
                    "interrupted append before any release was recorded (no bound record precedes it), "
                    "so it was not a release; it was removed and nothing was counted"
                ),
                stacklevel=4,
            )
            return
        q, sigma, count = self._bound
        record = _encode(
            {"count": count, "kind": "torn", "n": self._next, "q": q, "sigma": sigma, "torn_bytes": torn}
        )
        directory = os.path.dirname(self._real)
        fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(self._real) + ".", suffix=".repair", dir=directory)
        new = os.fdopen(fd, "r+b", buffering=0)
        try:
            self._lock(new)  # locked before it takes the ledger's name
            _write_all(new.fileno(), data[:offset] + record)
            os.fsync(new.fileno())
            os.fchmod(new.fileno(), os.fstat(f.fileno()).st_mode & 0o7777)
            os.replace(tmp, self._real)
        except BaseException:
            new.close()
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        _fsync_dir(directory)
        f.close()
        self._file = new
        self._next += 1
        _merge(self._runs, q, sigma, count)
        warnings.warn(
            LedgerRepairWarning(
                f"privacy ledger {self._path!r}: its last line ({torn} bytes) was torn by an interrupted "
                f"append; it was counted as spent, as {count} step(s) with the costliest parameters the "
                f"ledger allows (q={q!r}, sigma={sigma!r}), and the file was repaired"
            ),
            stacklevel=4,
        )

    # ---------------------------------------------------------------- properties

    @property
    def path(self) -> str:
        """The path the ledger was opened with."""
        return self._path

    @property
    def run_id(self) -> str:
        """The run's random id (uuid4 hex), written in the header when the ledger was created."""
        return self._header["run_id"]

    @property
    def mechanism(self) -> str:
        """The accounting mechanism of the run: ``"rdp"`` or ``"pld"``."""
        return self._header["mechanism"]

    @property
    def created(self) -> str:
        """When the ledger was created (ISO 8601, UTC)."""
        return self._header["created"]

    @property
    def history(self) -> tuple[Run, ...]:
        """The recorded steps as runs ``(sample_rate, noise_multiplier, count)`` (adjacent
        records with the same ``(q, σ)`` merged), torn records included."""
        return tuple(self._runs)

    @property
    def steps(self) -> int:
        """The number of steps recorded."""
        return self._steps

    @property
    def bound(self) -> Bound | None:
        """The last bound ``(q_max, σ_min, count_max)`` (``None`` before the first append)."""
        return self._bound

    @property
    def closed(self) -> bool:
        return self._file is None

    def __repr__(self) -> str:
        state = "closed" if self._file is None else f"steps={self._steps}"
        return f"PrivacyLedger({self._path!r}, accountant={self._header.get('mechanism')!r}, {state})"

    # ---------------------------------------------------------------- appending

    def append(self, *, sample_rate: float, noise_multiplier: float, count: int = 1) -> None:
        """Record ``count`` releases with sample rate ``q`` and noise multiplier ``σ``, durably.

        Returns after the record (and, if the parameters leave the current bound, a new
        bound record before it) has been written and ``os.fsync``\\ ed: from then on a crash
        cannot lose it. Call it *before* anything computed from the release leaves.

        Raises:
            InvalidHyperparameterError: an argument is invalid, the ledger is closed, an earlier
                append failed (reopen the ledger: the interrupted record is counted and repaired),
                this is a forked child of the process that opened it, or the file was removed or
                replaced since it was opened. Nothing is written.
            OSError: writing or syncing failed; the record may or may not be on disk (it is
                counted if it is, as a torn record if incomplete), and the ledger refuses further
                appends until it is reopened.
        """
        q = _sample_rate(sample_rate)
        sigma = _noise_multiplier(noise_multiplier)
        n = integer_at_least("count", count, 1)
        self._check_writable()
        bound = self._bound
        if bound is None or not _covers(bound, q, sigma, n) or bound[2] > n:
            new = (q, sigma, n) if bound is None else (max(bound[0], q), min(bound[1], sigma), n)
            self._write({"count_max": new[2], "kind": "bound", "n": self._next, "q_max": new[0], "sigma_min": new[1]})
            self._bound = new
        self._write({"count": n, "kind": "release", "n": self._next, "q": q, "sigma": sigma})
        _merge(self._runs, q, sigma, n)
        self._steps += n

    def _write(self, body: dict[str, Any]) -> None:
        line = _encode(body)
        fd = self._file.fileno()
        try:
            os.lseek(fd, 0, os.SEEK_END)
            _write_all(fd, line)
            os.fsync(fd)
        except BaseException as err:
            self._broken = f"{type(err).__name__}: {err}"
            raise
        self._next += 1

    def _check_writable(self) -> None:
        if self._file is None:
            raise InvalidHyperparameterError(f"privacy ledger {self._path!r} is closed; nothing was recorded")
        if self._broken is not None:
            raise InvalidHyperparameterError(
                f"privacy ledger {self._path!r}: an earlier append failed ({self._broken}), so the end of "
                "the file is unknown; nothing was recorded. Close it and open it again: an interrupted "
                "record is then counted as spent and the file repaired"
            )
        if os.getpid() != self._pid:
            raise InvalidHyperparameterError(
                f"privacy ledger {self._path!r} was opened by process {self._pid}; this forked child "
                f"(process {os.getpid()}) cannot append to it (a ledger has a single writer)"
            )
        if not _same_file(self._file.fileno(), self._real):
            raise InvalidHyperparameterError(
                f"privacy ledger {self._path!r} was removed or replaced since it was opened (restored "
                "from a backup?); nothing was recorded. A ledger must never be replaced: a copy lacks "
                "the releases made since it was taken"
            )

    # ---------------------------------------------------------------- closing

    def close(self) -> None:
        """Close the file (releasing the lock). Idempotent; appends then raise."""
        f, self._file = self._file, None
        if f is not None:
            f.close()

    def __enter__(self) -> PrivacyLedger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __reduce__(self) -> Any:
        raise TypeError(
            "a PrivacyLedger cannot be pickled or copied: it is the single writer of its file "
            "(a copy of an Accountant is detached from its ledger)"
        )
