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


def test_adam_and_adaptive_twins_at_flat_winner(tmp_path):
    """--optimizer adam (own lr grid, recorded) and a twin method: it is not tuned, runs at flat
    clipping's validation winner with the same seeds, σ and steps, and records the scale
    diagnostic; report.py pairs it with flat seed by seed."""
    run = _load_run()
    out = run.main([
        "--task", "digits-logreg", "--epsilons", "3", "--seeds", "2", "--tune-seeds", "1", "--epochs", "1",
        "--optimizer", "adam", "--clips", "0.3", "1", "--methods", "flat", "ada-tensor", "quantile",
        "--out", str(tmp_path), "--no-progress", "--no-plots", "--tag", "_twins",
    ])  # fmt: skip
    saved = json.loads((tmp_path / "utility_digits-logreg_torch_adam_twins.json").read_text())
    from utility_train import ADAM_LRS

    assert saved["optimizer_name"] == "adam" and saved["optimizer"].startswith("Adam")
    assert saved["lr_grid"] == ADAM_LRS and len(saved["tuning"]["flat@3.0"]) == len(ADAM_LRS) * 2
    flat = saved["final"]["flat@3.0"]
    for m in ("ada-tensor", "quantile"):
        twin = saved["final"][f"{m}@3.0"]
        assert saved["tuning"][f"{m}@3.0"] == []  # not tuned
        assert twin["hp"] == flat["hp"] and saved["winners"][f"{m}@3.0"]["twin_of"] == "flat@3.0"
        assert [r["seed"] for r in twin["runs"]] == [0, 1] and twin["steps"] == flat["steps"]
        assert twin["sigma"] == flat["sigma"] and twin["epsilon_spent"] <= 3.0 + 1e-6
        diag = twin["runs"][0]["diagnostic"]
        assert diag["moved"] >= 0 and diag["q90_q10"] >= 1 and diag["q90_q10_start"] == 1
    assert saved["final"]["quantile@3.0"]["runs"][0]["diagnostic"]["q90_q10"] == 1  # flat shape, C_t moves
    from report import adaptive_twins_block, adaptive_twins_headline, paired

    p = paired(out, "ada-tensor", 3.0)
    assert p["n"] == 2 and math.isfinite(p["mean"])
    head = adaptive_twins_headline([out]).splitlines()
    assert head[0] == "| method | digits-logreg adam ε=3 |" and head[2].startswith("| ada-tensor | ")
    assert "| quantile |" in adaptive_twins_block(out)
    with pytest.raises(SystemExit):  # a twin needs flat's winner
        run.main(["--task", "digits-logreg", "--methods", "ada-tensor", "--epochs", "1", "--no-progress"])


def test_twin_path_is_make_private_for_flat(monkeypatch):
    """The twins' wrapper (DPOptimizer with a strategy object) reproduces make_private's flat
    clipping exactly: same batches, noise and result, so twin and flat are paired."""
    _load_run()
    import numpy as np
    import utility_train
    from utility_tasks import load_task

    task = load_task("digits-logreg")
    idx = np.arange(len(task.y_train))
    kw = dict(epsilon=3.0, delta=1e-5, seed=0, train_idx=idx, eval_x=task.x_test, eval_y=task.y_test, epochs=1)
    hp = {"lr": 0.5, "max_grad_norm": 0.3}
    ref = utility_train.train_torch(task, "flat", hp, **kw)
    monkeypatch.setattr(utility_train, "TWIN_METHODS", utility_train.TWIN_METHODS + ("flat",))
    twin = utility_train.train_torch(task, "flat", hp, **kw)
    assert twin["metric"] == ref["metric"] and twin["sigma"] == ref["sigma"] and twin["steps"] == ref["steps"]
    assert twin["diagnostic"]["moved"] == 0 and twin["diagnostic"]["q90_q10"] == 1


@pytest.mark.parametrize("s0", ["fixed", "clip"])
def test_every_twin_starts_as_flat_clipping_at_c(s0):
    """Each twin's clip region at step 0 is flat clipping's ball of radius C: b = C on every
    coordinate and a zero centre."""
    _load_run()
    import numpy as np
    from utility_train import TWIN_METHODS, twin_strategy

    params = [np.zeros((32, 64), np.float32), np.zeros(32, np.float32), np.zeros((10, 32), np.float32)]
    d = sum(p.size for p in params)
    for method in TWIN_METHODS:
        strategy = twin_strategy(method, 0.3, d, s0=s0)
        centre, scale = strategy.transform(strategy.init(params), len(params))
        for p, b in zip(params, scale):
            assert np.allclose(np.broadcast_to(np.asarray(b, np.float64), p.shape), 0.3, rtol=1e-5), method
        assert centre is None or all(not np.asarray(a).any() for a in centre), method
