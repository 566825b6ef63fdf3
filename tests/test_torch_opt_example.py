"""The digits example runs end to end and reports an ε within the target."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "torch_digits.py"


def test_digits_example_trains_both_strategies_within_budget():
    out = subprocess.run(
        [sys.executable, str(EXAMPLE), "--epochs", "2", "--epsilon", "2", "--seed", "0"],
        capture_output=True, text=True, check=True, timeout=600,
    ).stdout
    rows = re.findall(r"(adaclip|flat): test accuracy ([0-9.]+)\s+ε=([0-9.]+)", out)
    assert [r[0] for r in rows] == ["adaclip", "flat"], out
    for _, acc, eps in rows:
        assert float(eps) <= 2.0 + 1e-9
        assert float(acc) > 0.2  # far above chance (0.1) even after two private epochs
