"""The digits example runs end to end (slow: trains two small models)."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

pytestmark = [pytest.mark.jax, pytest.mark.slow]

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "jax_digits.py"


def test_digits_example_runs(capsys):
    spec = importlib.util.spec_from_file_location("jax_digits", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--epochs", "2", "--epsilon", "3", "--seed", "0"])
    out = capsys.readouterr().out
    assert "adaclip: test accuracy" in out and "flat_clip: test accuracy" in out
    for line in out.splitlines()[1:]:
        eps = float(line.split("ε = ")[1].split()[0])
        assert eps <= 3.0 + 1e-9
        acc = float(line.split("test accuracy ")[1].split()[0])
        assert acc > 0.5  # far above the 0.1 of chance
