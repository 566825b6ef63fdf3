"""Smoke test of the auditing benchmark (benchmarks/audit/run.py) on a tiny configuration."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
AUDIT = ROOT / "benchmarks" / "audit"

import sklearn  # noqa: E402,F401  (scripts/test.sh installs the bench extra)


def _load_audit():
    if "audit_bench_run" in sys.modules:
        return sys.modules["audit_bench_run"]
    spec = importlib.util.spec_from_file_location("audit_bench_run", AUDIT / "run.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["audit_bench_run"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_carve_pool_is_a_fixed_partition():
    run = _load_audit()
    a = run.carve_pool(100, 20)
    b = run.carve_pool(100, 20)
    assert np.array_equal(a.pool, b.pool) and np.array_equal(a.real, b.real)
    assert len(a.pool) == 20 and len(a.real) == 80
    assert np.array_equal(np.sort(np.concatenate([a.pool, a.real])), np.arange(100))
    with pytest.raises(ValueError, match="num_canaries"):
        run.carve_pool(100, 100)


def test_max_certifiable_epsilon_grows_with_m_and_is_finite():
    """The ceiling of a one-run black-box audit: perfectly separated scores; more canaries
    certify more, and even m = 400 certifies only a few units of ε."""
    run = _load_audit()
    small = run.max_certifiable_epsilon(np.arange(50) % 2 == 0)
    large = run.max_certifiable_epsilon(np.arange(400) % 2 == 0)
    assert 0 < small < large < 10


def test_tiny_audit_run_writes_json_and_plot(tmp_path):
    pytest.importorskip("matplotlib")
    run = _load_audit()
    (out,) = run.main([
        "--tasks", "digits-mlp", "--methods", "nonprivate", "flat", "--epsilons", "8", "--seeds", "2",
        "--epochs", "1", "--canaries", "40", "--shadows", "1", "--out", str(tmp_path), "--tag", "_smoke",
    ])  # fmt: skip
    saved = json.loads((tmp_path / "audit_digits-mlp_torch_smoke.json").read_text())
    assert (tmp_path / "audit_digits-mlp_torch_smoke_vs_epsilon.png").stat().st_size > 0
    assert saved["task"] == "digits-mlp" and saved["delta"] == 1e-5 and saved["confidence"] == 0.95
    for field in ("versions", "machine", "date", "command", "wall_seconds", "data", "winners_from"):
        assert field in saved, field
    assert saved["data"]["num_canaries"] == 40 and saved["data"]["real_train_size"] == 1437 - 40
    utility = json.loads((ROOT / "benchmarks/results/utility_digits-mlp_torch.json").read_text())
    for key in ("nonprivate", "flat@8.0"):
        cell = saved["cells"][key]
        assert cell["hp"] == utility["winners"][key]["hp"]  # the recorded winner, not re-tuned
        assert [r["seed"] for r in cell["runs"]] == [0, 1]
        s = cell["summary"]
        for name in ("test_accuracy", "epsilon_lower", "loss_auc", "loss_tpr_at_1pct", "shadow_auc",
                     "max_certifiable_epsilon", "control_auc"):  # fmt: skip
            assert s[name]["n"] == 2 and len(s[name]["values"]) == 2, name
            assert math.isfinite(s[name]["mean"]) and s[name]["se"] >= 0, name
        for r in cell["runs"]:
            assert len(r["canary_scores"]) == len(r["included"]) == 40
            assert (
                r["train_size"] == 1437 - 40 + sum(r["included"]) == r["real_train_size"] + r["num_included"]
            )
            assert 0 <= r["epsilon_lower"] <= r["max_certifiable_epsilon"]
            assert 0 <= r["loss_attack"]["auc"] <= 1 and 0 <= r["shadow_attack"]["auc"] <= 1
            assert r["members_evaluated"] == r["nonmembers_evaluated"] == 360
    flat = saved["cells"]["flat@8.0"]
    for r in flat["runs"]:
        # q = B̄/N with the canaries counted, and the accountant's ε is the stated ε
        assert r["sample_rate"] == pytest.approx(64.0 / r["train_size"])
        assert r["accountant_epsilon_rdp"] <= 8.0 + 1e-6
        assert r["accountant_epsilon_pld"] <= r["accountant_epsilon_rdp"] + 1e-6
        assert r["epsilon_lower"] <= r["accountant_epsilon_pld"] and not r["exceeds_accountant"]
    assert math.isinf(saved["cells"]["nonprivate"]["runs"][0]["accountant_epsilon_pld"])
    assert "| flat | 8 |" in run.table(out)
    assert run.main(["--report", str(tmp_path / "audit_digits-mlp_torch_smoke.json")]) == []
