"""The new user's path, as a test: README → install → quick start → a trained private model
with its ε (issue 45). The README and the home page lead with the quick start, which is
``examples/quickstart.py`` verbatim; the quick start trains on real data and prints accuracy
and ε; every page that shows a ``make_private`` call says what the default builds and how to
get Opacus's DP-SGD exactly; ``help(make_private)`` documents the keywords in signature order."""

from __future__ import annotations

import inspect
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
QUICKSTART = ROOT / "examples" / "quickstart.py"
HOME = ROOT / "docs" / "index.md"

_FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.S | re.M)
_INCLUDE = re.compile(r'--8<-- "([^"]+)"')


def _python_blocks(text: str) -> list[str]:
    """The fenced Python code of a page, with snippet includes (``--8<-- "path"``) read in."""
    blocks = []
    for lang, body in _FENCE.findall(text):
        if lang != "python":
            continue
        blocks.append(_INCLUDE.sub(lambda m: (ROOT / m.group(1).split(":")[0]).read_text(), body))  # "path:section": all of it
    return blocks


def _sections(text: str) -> list[str]:
    return [line[3:].strip() for line in text.splitlines() if line.startswith("## ")]


def test_readme_leads_with_install_and_the_quick_start():
    sections = _sections(README.read_text())
    assert sections[:2] == ["Install", "Quick start"], sections
    head = README.read_text().split("## Quick start", 1)[0]
    assert len(head.splitlines()) <= 25  # two commands, one paragraph, install: the first screen
    assert "| method |" not in head  # results come after the quick start


def test_readme_quick_start_is_the_example_verbatim():
    first = _python_blocks(README.read_text())[0]
    assert first == QUICKSTART.read_text()


def test_home_page_leads_with_the_quick_start_and_the_default():
    text = HOME.read_text()
    sections = _sections(text)
    assert sections.index("Install") < sections.index("Quick start: a private model in twenty lines")
    assert sections.index("Quick start: a private model in twenty lines") < sections.index("What `make_private` builds")
    assert f'--8<-- "{QUICKSTART.relative_to(ROOT).as_posix()}"' in text
    assert "AdaCliP" not in text.split("## What `make_private` builds")[0].split("**", 2)[-1]


def _pages_showing_make_private() -> list[pathlib.Path]:
    pages = [README, *sorted((ROOT / "docs").rglob("*.md"))]
    return [p for p in pages if any("make_private(" in block for block in _python_blocks(p.read_text()))]


def test_pages_showing_make_private_are_found():
    shown = {p.relative_to(ROOT).as_posix() for p in _pages_showing_make_private()}
    assert {"README.md", "docs/index.md", "docs/getting-started/torch.md", "docs/migration/opacus.md"} <= shown


@pytest.mark.parametrize("page", _pages_showing_make_private(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_a_page_that_shows_make_private_says_what_it_builds(page):
    text = page.read_text()
    assert "banded" in text, "the page shows make_private but not that it may build banded noise"
    assert 'noise_mechanism="independent"' in text, "the page does not say how to get Opacus's DP-SGD"


def test_quick_start_trains_a_private_model_and_prints_accuracy_and_epsilon(tmp_path):
    done = subprocess.run(
        [sys.executable, str(QUICKSTART)], cwd=tmp_path, capture_output=True, text=True, timeout=600, check=True
    )
    match = re.search(r"test accuracy ([0-9.]+) at epsilon ([0-9.]+) \(delta 1e-5\)", done.stdout)
    assert match, done.stdout + done.stderr
    accuracy, epsilon = float(match.group(1)), float(match.group(2))
    assert accuracy >= 0.80  # five recorded runs: 0.911-0.933; chance is 0.1
    assert 2.9 <= epsilon <= 3.0 + 1e-9


def _documented_args(func) -> list[str]:
    doc = inspect.getdoc(func)
    body = doc.split("\nArgs:\n", 1)[1].split("\nRaises:\n", 1)[0]
    return re.findall(r"^  (\w+): ", body, re.M)


def test_make_private_help_documents_every_keyword_in_signature_order():
    from adaclip_torch import make_private

    params = [
        name
        for name, p in inspect.signature(make_private).parameters.items()
        if p.kind is not inspect.Parameter.VAR_KEYWORD
    ]
    documented = _documented_args(make_private)
    assert documented[:-1] == params, (documented, params)
    assert documented[-1] == "strategy_kwargs"
