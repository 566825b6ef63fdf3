"""Smoke test of the utility benchmark harness (benchmarks/utility/run.py) on a tiny config."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
UTILITY = ROOT / "benchmarks" / "utility"

import sklearn  # noqa: E402,F401  (scripts/test.sh installs the bench extra)
import tqdm  # noqa: E402,F401


def _load_run():
    sys.path.insert(0, str(UTILITY))
    spec = importlib.util.spec_from_file_location("utility_run", UTILITY / "run.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_grids_have_equal_size_for_every_private_method():
    _load_run()
    from utility_tasks import load_task

    for name in ("digits-logreg", "digits-mlp"):
        task = load_task(name)
        for grids in (task.grids, task.quick_grids):
            sizes = {m: len(grids[m]) for m in ("flat", "per_layer", "scaled", "adaclip")}
            assert len(set(sizes.values())) == 1, sizes


def test_make_users_is_deterministic_and_documented():
    _load_run()
    from utility_tasks import make_users

    a, ua = make_users(5, seed=0)
    b, ub = make_users(7, seed=0)
    assert a.shape == (40, 12) and (a[:, 0] == 0).all() and (a < 200).all()
    assert (a == b[:40]).all() and (ua == ub[:40]).all()  # held-out users extend the same stream
    assert "Zipf" in make_users.__doc__


def test_harness_tiny_run_writes_results(tmp_path):
    pytest.importorskip("matplotlib")
    run = _load_run()
    out = run.main([
        "--task", "digits-logreg", "--epsilons", "3", "--seeds", "2", "--tune-seeds", "1",
        "--epochs", "1", "--max-configs", "1", "--out", str(tmp_path), "--no-progress", "--tag", "_smoke",
    ])
    path = tmp_path / "utility_digits-logreg_torch_smoke.json"
    saved = json.loads(path.read_text())
    assert saved["task"] == "digits-logreg" and saved["delta"] == 1e-5
    for key in ("nonprivate", "flat@3.0", "per_layer@3.0", "scaled@3.0", "adaclip@3.0"):
        final = saved["final"][key]
        assert len(final["runs"]) == 2
        assert 0.0 <= final["test"]["mean"] <= 1.0
        assert key in saved["winners"] and len(saved["tuning"][key]) == 1
        assert len(final["runs"][0]["curve"]) == 2  # epoch 0 and epoch 1
    sigmas = {saved["final"][f"{m}@3.0"]["sigma"] for m in ("flat", "per_layer", "scaled", "adaclip")}
    steps = {saved["final"][f"{m}@3.0"]["steps"] for m in ("flat", "per_layer", "scaled", "adaclip")}
    assert len(sigmas) == 1 and len(steps) == 1  # equal σ and steps: equal (ε, δ)
    for m in ("flat", "per_layer", "scaled", "adaclip"):
        assert saved["final"][f"{m}@3.0"]["epsilon_spent"] <= 3.0 + 1e-6
    assert math.isinf(out["final"]["nonprivate"]["runs"][0]["epsilon"])
    trace = saved["final"]["adaclip@3.0"]["runs"][0]["trace"]
    assert len(trace) == 2 and len(trace[0]["b"]) == len(trace[0]["std"]) > 0
    assert len(saved["final"]["scaled@3.0"]["runs"][0]["layer_scales"]) == 2
    for suffix in ("vs_epsilon", "curves", "adaclip_state"):
        assert (tmp_path / f"utility_digits-logreg_torch_smoke_{suffix}.png").stat().st_size > 0
