"""Soak (slow): many short trainings and a long one in one process keep memory and step time flat.

The figures of the full run (200 trainings, 20,000 steps per path) are in benchmarks/RESULTS.md;
this test runs the same code, smaller, on every path.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import soak  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.mark.torch
@pytest.mark.parametrize("path", ["materialise", "ghost", "user"])
def test_torch_paths_do_not_grow(path):
    result = soak.soak(path, trainings=60, steps_per_training=10, long_steps=3000, block=500)
    verdict = soak.verdicts(result, warmup=15, rss_tolerance=0.10, time_tolerance=0.5)
    assert verdict["rss_ok"], (verdict, result["rss_mib"][::10])
    assert verdict["time_ok"], (verdict, result["block_median_step_s"])


@pytest.mark.jax
@pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="jax is not installed")
def test_jax_path_does_not_grow():
    result = soak.soak("jax", trainings=25, steps_per_training=10, long_steps=2000, block=400)
    verdict = soak.verdicts(result, warmup=10, rss_tolerance=0.10, time_tolerance=0.5)
    assert verdict["rss_ok"], (verdict, result["rss_mib"][::5])
    assert verdict["time_ok"], (verdict, result["block_median_step_s"])
