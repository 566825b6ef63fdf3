"""Smoke test of the federated benchmark (benchmarks/federated/run.py --quick) on one task:
the whole pipeline (pretraining, tuning on validation users, final seeds, Flower simulation,
server-side DP aggregation, accounting, JSON and plot) runs, and every private run stays
within the target ε."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

pytest.importorskip("flwr")
pytest.importorskip("ray")
pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parent.parent
RUN = ROOT / "benchmarks" / "federated" / "run.py"


def _load_run():
    spec = importlib.util.spec_from_file_location("federated_bench_run", RUN)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_quick_federated_benchmark(tmp_path):
    run = _load_run()
    written = run.main(["--quick", "--tasks", "lm-users", "--seeds", "0", "1", "--epsilon", "3",
                        "--out", str(tmp_path)])
    assert [p.name for p in written] == ["federated_lm-users_quick.json"]
    assert (tmp_path / "federated_lm-users_quick.png").stat().st_size > 0
    res = json.loads(written[0].read_text())

    for key in ("task", "metric", "seeds", "methods", "config", "target_epsilon", "delta", "noise_multiplier",
                "tuning", "chosen", "pretrained", "runs", "summary", "versions", "machine", "command", "wall_s"):
        assert key in res, key
    assert res["task"] == "lm-users" and res["quick"] is True and res["target_epsilon"] == 3.0
    assert res["noise_multiplier"] > 0 and 0 < res["delta"] < 1
    methods = res["methods"]
    assert set(methods) == set(run.METHODS)
    assert {"flwr", "torch", "numpy", "python"} <= set(res["versions"])

    # Equal tuning budget; the chosen configuration is one of the tuned ones.
    for m in methods:
        assert len(res["tuning"][m]) == 2
        assert res["chosen"][m] in [t["config"] for t in res["tuning"][m]]

    # One final run per method and seed, each with both test sets and the privacy spent.
    runs = res["runs"]
    assert len(runs) == len(methods) * len(res["seeds"])
    assert {(r["method"], r["seed"]) for r in runs} == {(m, s) for m in methods for s in res["seeds"]}
    for r in runs:
        for k in ("val_user", "test_user", "test_public"):
            assert 0.0 <= r[k] <= 1.0, (r["method"], k, r[k])
        if r["method"] == "nonprivate":
            assert r["epsilon_spent"] is None
        else:
            assert r["epsilon_spent"] is not None
            assert 0 < r["epsilon_spent"] <= res["target_epsilon"] + 1e-9, (r["method"], r["epsilon_spent"])

    for name in ["pretrained", *methods]:
        for k in ("test_user", "test_public"):
            cell = res["summary"][name][k]
            assert cell["n"] == len(res["seeds"]) and math.isfinite(cell["mean"]) and math.isfinite(cell["se"])
