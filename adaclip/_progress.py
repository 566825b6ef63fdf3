"""Progress output for long accounting work (PLD calibration, PLD budget searches).

:func:`progress` returns a small reporter with ``update(n=1, **status)`` and ``close()``
(also a context manager). It writes to ``sys.stderr``: a ``tqdm`` bar when tqdm is installed,
otherwise one plain line every few seconds. Whether it is shown:

* ``enabled=None`` (the default everywhere): once the work has run for :data:`DELAY_SECONDS`
  (quick calls print nothing). On a terminal, a bar (or plain lines); when ``sys.stderr`` is a
  file or a pipe (a batch job, a notebook's log, ``2> run.log``), one line per second of work
  (:data:`PIPED_INTERVAL_SECONDS`) through the logger ``adaclip._progress`` at INFO. If the
  program has not configured :mod:`logging` at all (no handler, no level set on ``adaclip`` or
  ``adaclip._progress``), those lines are written to ``sys.stderr`` directly, so that long work is
  never silent; silence them with ``logging.getLogger("adaclip._progress").setLevel(logging.WARNING)``
  or ``progress=False``;
* ``enabled=True``: always, from the first update (also into a file or a pipe);
* ``enabled=False``: never.

It reports counts and public hyperparameters only (σ candidates, step counts), never data.
"""

from __future__ import annotations

import logging
import sys
import time
from types import TracebackType
from typing import Any

from adaclip.errors import InvalidHyperparameterError

__all__ = ["DELAY_SECONDS", "PIPED_INTERVAL_SECONDS", "check_progress", "progress"]

#: With ``progress=None`` on a terminal, nothing is shown before the work has run this long.
DELAY_SECONDS: float = 1.0
#: Without tqdm, at most one plain line per this many seconds.
_LINE_INTERVAL_SECONDS: float = 2.0
#: With ``progress=None`` and ``sys.stderr`` not a terminal: one line per this many seconds.
PIPED_INTERVAL_SECONDS: float = 1.0

_LOGGER = logging.getLogger(__name__)  # "adaclip._progress"


def check_progress(value: Any, name: str = "progress") -> bool | None:
    """``value`` if it is ``True``, ``False`` or ``None``; else InvalidHyperparameterError."""
    if value is not None and not isinstance(value, bool):
        raise InvalidHyperparameterError(f"{name} must be True, False or None (after a second), got {value!r}")
    return value


def _stderr_is_terminal() -> bool:
    stream = sys.stderr
    try:
        return stream is not None and bool(stream.isatty())
    except (AttributeError, ValueError, OSError):  # closed or replaced by an object without isatty
        return False


def _logging_configured() -> bool:
    """Whether the program has configured logging for our progress lines: a handler anywhere on
    the logger's chain, a level set on ``adaclip._progress`` or ``adaclip``, or ``logging.disable``."""
    if _LOGGER.hasHandlers() or logging.root.manager.disable:
        return True
    return _LOGGER.level != logging.NOTSET or logging.getLogger("adaclip").level != logging.NOTSET


def _log_line(line: str) -> None:
    """One progress line through ``adaclip._progress`` (INFO), or on stderr if logging is unset."""
    if _logging_configured():
        _LOGGER.info(line)
    else:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()


class _Off:
    """The reporter when progress is off: does nothing."""

    def update(self, n: int = 1, **status: Any) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> _Off:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class _Lines:
    """Plain lines (``desc: n done, 12.3 s, key=value``), rate-limited: on stderr (no tqdm), or
    through the ``adaclip._progress`` logger when ``piped`` (see :func:`_log_line`)."""

    def __init__(self, desc: str, total: int | None, delay: float, unit: str, *, piped: bool = False) -> None:
        self.desc, self.total, self.delay, self.unit = desc, total, delay, unit
        self.piped = piped
        self.interval = PIPED_INTERVAL_SECONDS if piped else _LINE_INTERVAL_SECONDS
        self.count = 0
        self.start = time.monotonic()
        self.last = -float("inf")
        self.status: dict[str, Any] = {}

    def _line(self) -> str:
        done = f"{self.count}/{self.total}" if self.total is not None else f"{self.count}"
        extra = "".join(f", {k}={v}" for k, v in self.status.items())
        return f"{self.desc}: {done} {self.unit}s, {time.monotonic() - self.start:.1f} s{extra}"

    def _write(self) -> None:
        if self.piped:
            _log_line(self._line())
        else:
            sys.stderr.write(self._line() + "\n")
            sys.stderr.flush()

    def update(self, n: int = 1, **status: Any) -> None:
        self.count += n
        self.status.update(status)
        now = time.monotonic()
        if now - self.start >= self.delay and now - self.last >= self.interval:
            self.last = now
            self._write()

    def close(self) -> None:
        if self.last > -float("inf"):  # something was shown: say that it finished
            self._write()

    def __enter__(self) -> _Lines:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Bar:
    """A tqdm bar on stderr."""

    def __init__(self, tqdm: Any, desc: str, total: int | None, delay: float, unit: str) -> None:
        self.bar = tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, delay=delay, leave=False,
                        dynamic_ncols=True)  # fmt: skip

    def update(self, n: int = 1, **status: Any) -> None:
        if status:
            self.bar.set_postfix(status, refresh=False)
        self.bar.update(n)

    def close(self) -> None:
        self.bar.close()

    def __enter__(self) -> _Bar:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def progress(enabled: bool | None, desc: str, *, total: int | None = None, unit: str = "it") -> _Off | _Lines | _Bar:
    """A progress reporter for ``desc`` (``total`` updates of one ``unit`` expected; ``None``:
    unknown)."""
    if enabled is None:
        if not _stderr_is_terminal():
            return _Lines(desc, total, DELAY_SECONDS, unit, piped=True)
        delay = DELAY_SECONDS
    elif enabled:
        delay = 0.0
    else:
        return _Off()
    try:
        from tqdm import tqdm
    except ImportError:
        return _Lines(desc, total, delay, unit)
    return _Bar(tqdm, desc, total, delay, unit)
