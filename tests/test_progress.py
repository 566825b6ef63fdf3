"""Progress on long accounting work is visible when stderr is a pipe or a file (issue 45,
finding 4): one line per second of work, through the ``adaclip._progress`` logger, or on stderr
directly when the program has not configured logging. Silenced by the logger's level or
``progress=False``."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap

import pytest

from adaclip import _progress

_SCRIPT = """
import logging, sys, time
from adaclip import _progress
_progress.DELAY_SECONDS = 0.0
_progress.PIPED_INTERVAL_SECONDS = 0.0
{setup}
with _progress.progress({enabled}, "calibrating sigma", unit="evaluation") as report:
    for _ in range(3):
        report.update(sigma=1.5)
"""


def _run(setup: str = "", enabled: str = "None") -> str:
    code = textwrap.dedent(_SCRIPT.format(setup=setup, enabled=enabled))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return done.stderr


def test_piped_stderr_gets_lines_when_logging_is_not_configured():
    err = _run()  # stderr is a pipe here: before, nothing at all was shown
    lines = [line for line in err.splitlines() if line.startswith("calibrating sigma")]
    assert len(lines) >= 3, err
    assert "evaluations" in lines[0] and "sigma=1.5" in lines[0]


def test_piped_lines_go_through_logging_when_the_program_configured_it():
    err = _run(setup="logging.basicConfig(level=logging.INFO, format='LOG %(name)s %(message)s')")
    assert "LOG adaclip._progress calibrating sigma" in err, err


@pytest.mark.parametrize(
    "setup, enabled",
    [
        ("logging.getLogger('adaclip._progress').setLevel(logging.WARNING)", "None"),
        ("logging.getLogger('adaclip').setLevel(logging.ERROR)", "None"),
        ("logging.disable(logging.INFO)", "None"),
        ("", "False"),
    ],
)
def test_silenced_when_the_user_silences_it(setup, enabled):
    assert "calibrating sigma" not in _run(setup=setup, enabled=enabled)


def test_one_line_per_interval_not_per_update(monkeypatch, caplog):
    monkeypatch.setattr(_progress, "DELAY_SECONDS", 0.0)
    monkeypatch.setattr(_progress, "_stderr_is_terminal", lambda: False)
    caplog.set_level(logging.INFO, logger="adaclip._progress")
    with _progress.progress(None, "composing", unit="run") as report:  # interval 1 s: a fast loop
        for _ in range(200):
            report.update()
    records = [r for r in caplog.records if r.name == "adaclip._progress"]
    assert 1 <= len(records) <= 4  # the first update, maybe one per elapsed second, the close
    assert records[-1].getMessage().startswith("composing: 200 runs")


def test_quick_work_prints_nothing_when_piped(monkeypatch, caplog):
    monkeypatch.setattr(_progress, "_stderr_is_terminal", lambda: False)
    monkeypatch.setattr(_progress, "DELAY_SECONDS", 3600.0)  # the work never runs this long
    caplog.set_level(logging.INFO, logger="adaclip._progress")
    with _progress.progress(None, "composing", unit="run") as report:
        report.update()
    assert not [r for r in caplog.records if r.name == "adaclip._progress"]
