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


def test_batch_size_and_flat_grid_overrides_and_paired_report(tmp_path):
    """--batch-size changes B̄ (so q and σ), --lrs/--clips set one grid for flat clipping and
    AdaCliP's twins (C0 = C), and report.py pairs every flat (lr, C) with its twin and gives κ."""
    run = _load_run()
    common = ["--task", "digits-logreg", "--epsilons", "3", "--seeds", "2", "--tune-seeds", "1",
              "--epochs", "1", "--out", str(tmp_path), "--no-progress", "--no-plots"]  # fmt: skip
    base = run.main([*common, "--methods", "flat", "adaclip", "--ada-grid", "flat-clips", "--tag", "_b64"])
    big = run.main([*common, "--methods", "flat", "adaclip", "--ada-grid", "flat-clips", "--batch-size", "256",
                    "--lrs", "0.5", "--clips", "0.3", "3", "--tag", "_b256"])  # fmt: skip
    assert base["expected_batch_size"] == 64 and big["expected_batch_size"] == 256
    assert big["final"]["flat@3.0"]["sigma"] > base["final"]["flat@3.0"]["sigma"]  # larger q: more noise
    assert big["final"]["flat@3.0"]["steps"] < base["final"]["flat@3.0"]["steps"]
    assert [g["max_grad_norm"] for g in big["grids"]["flat"]] == [0.3, 3.0]
    assert [g["lr"] for g in big["grids"]["adaclip"]] == [0.5, 0.5]
    d = big["num_params"]
    assert d == 650
    for g, c in zip(big["grids"]["adaclip"], (0.3, 3.0)):  # sqrt(std_min·std_max)·√d = C0 = C
        assert math.sqrt(g["std_min"] * g["std_max"] * d) == pytest.approx(c, rel=2e-3)
    with pytest.raises(SystemExit):
        run.main([*common, "--clips", "0.3", "1", "3"])  # --clips without flat-clips AdaCliP
    from report import summary, twins

    from adaclip.strategies import noise_drift_number

    rows = twins([(big, None)]).splitlines()
    assert len(rows) == 3  # header, rule, ε = 3
    kappa = noise_drift_number(d, big["final"]["flat@3.0"]["sigma"], 256.0)
    assert f"| digits-logreg | 256 | 3 | {kappa:.2f} | " in rows[2] and " of 2 |" in rows[2]
    line = summary([(base, big)]).splitlines()[2]
    assert line.startswith("| digits-logreg | 3 | ") and "SE)" in line
