"""The round-three utility benchmark (benchmarks/utility/round3.py): correlated noise and
parameter averaging against tuned DP-SGD, end to end on a tiny configuration."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
UTILITY = ROOT / "benchmarks" / "utility"
sys.path.insert(0, str(UTILITY))

import sklearn  # noqa: E402,F401  (the bench extra)

round3 = pytest.importorskip("round3")


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_the_band_rule_is_make_privates(optimizer):
    """The harness's b and σ are those make_private(noise_mechanism="banded", bands=None) picks
    (Adam: at most ADAPTIVE_OPTIMIZER_MAX_BANDS bands); mnist1d-long's sizes at ε = 3."""
    import torch

    import adaclip.accounting as accounting
    from adaclip_torch.privacy import _banded_mechanism

    task = round3.load("digits-mlp")
    task.batch_size = 256.0 * len(task.y_train) / 50_000  # q = 256/50,000 as on mnist1d-long
    plan = round3.plan_noise(task, len(task.y_train), 10, 3.0, optimizer, None)
    params = torch.nn.Linear(2, 2).parameters()
    inner = torch.optim.SGD(params, lr=0.1, momentum=0.9) if optimizer == "sgd" else torch.optim.Adam(params)
    mech = _banded_mechanism(inner, None, q=plan["q"], total_steps=plan["steps"], target_epsilon=3.0,
                             delta=round3.DELTA, mechanism="rdp", optimise=False)  # fmt: skip
    assert plan["bands"] == mech.bands > 1
    assert plan["coefficients"] == pytest.approx(list(mech.coefficients))
    planned = accounting.Accountant("rdp")
    planned.step(
        noise_multiplier=plan["sigma"], sample_rate=plan["rate"], num_steps=-(-plan["steps"] // plan["bands"])
    )
    assert planned.epsilon(round3.DELTA) <= 3.0 + 1e-6
    assert round3.plan_noise(task, len(task.y_train), 3, 1.0, optimizer, 1)["bands"] == 1


def test_verdicts_and_pairing():
    a = {"runs": [{"seed": 1, "metric": 0.52}, {"seed": 0, "metric": 0.50}, {"seed": 2, "metric": 0.55}]}
    b = {"runs": [{"seed": 0, "metric": 0.49}, {"seed": 1, "metric": 0.50}, {"seed": 2, "metric": 0.52}]}
    d, se = round3.paired(a, b)
    assert d == pytest.approx(2.0) and se == pytest.approx(1.0 / math.sqrt(3))
    assert round3.verdict(2.0, 1.0) == "ahead"
    assert round3.verdict(1.9, 1.0) == "≈"
    assert round3.verdict(-1.0, 1.0) == "≈"
    assert round3.verdict(-1.1, 1.0) == "behind"


def test_tiny_run_tunes_on_validation_shares_runs_and_reports(tmp_path):
    out = round3.main(["--task", "digits-mlp", "--optimizer", "sgd", "--epsilons", "1", "--seeds", "2", "--epochs", "1",
                       "--lrs", "0.5", "--clips", "0.1", "1", "--out", str(tmp_path), "--quiet"])  # fmt: skip
    cell = out["cells"]["1.0"]
    assert set(cell["final"]) == set(round3.DEFAULT_METHODS)
    assert len(cell["tuning"]["flat"]) == len(cell["tuning"]["banded"]) == 2  # the same grid for every method
    for method, f in cell["final"].items():
        assert [r["seed"] for r in f["runs"]] == [0, 1]
        assert f["epsilon_spent"] <= 1.0 + 1e-9
        assert (f["mu"] in round3.DECAYS) == method.endswith("+ema")
    assert (
        cell["final"]["flat"]["bands"] == 1
        and cell["final"]["banded"]["bands"] == cell["plans"]["banded|None"]["bands"]
    )
    # X and X+ema read the same training runs when their winners share (lr, C)
    if cell["final"]["flat+ema"]["hp"] == cell["final"]["flat"]["hp"]:
        mu = cell["final"]["flat+ema"]["mu"]
        assert [r[f"ema{mu}"] for r in cell["final"]["flat"]["raw"]] == [
            r["metric"] for r in cell["final"]["flat+ema"]["runs"]
        ]
    winner = cell["winners"]["flat"]
    assert winner["val_mean"] == max(r["runs"][0]["metric"] for r in cell["tuning"]["flat"])
    saved = json.loads((tmp_path / "round3_digits-mlp_torch_sgd_eps1.json").read_text())
    text = round3.report([saved])
    assert "| banded+ema |" in text and "baseline" in text


def test_baselines_and_the_recommended_rule(tmp_path):
    """quantile and per-layer train with their own strategies on the same grid; ``recommended``
    reads the banded runs and may pick no averaging on validation; the report gives U1."""
    out = round3.main(["--task", "digits-mlp", "--optimizer", "sgd", "--epsilons", "1", "--seeds", "2", "--epochs", "1",
                       "--lrs", "0.5", "--clips", "0.1", "--out", str(tmp_path), "--quiet",
                       "--methods", "flat", "quantile", "per-layer", "banded", "recommended"])  # fmt: skip
    cell = out["cells"]["1.0"]
    assert set(cell["tuning"]) == {"flat", "quantile", "per-layer", "banded"}
    flat_runs = [r["metric"] for r in cell["final"]["flat"]["runs"]]
    assert [r["metric"] for r in cell["final"]["quantile"]["runs"]] != flat_runs  # another strategy trained
    assert [r["metric"] for r in cell["final"]["per-layer"]["runs"]] != flat_runs
    rec = cell["final"]["recommended"]
    assert rec["mu"] in (None, *round3.DECAYS)
    winner = cell["winners"]["recommended"]
    row = cell["tuning"]["banded"][0]["runs"][0]
    assert winner["val_mean"] == max([row["metric"]] + [row[f"ema{m}"] for m in round3.DECAYS])
    u1 = round3.u1_reading(cell)
    assert u1["baseline"] in round3.BASELINES and u1["reading"] in ("ahead", "≈", "behind")
    assert "U1: recommended vs the best baseline" in round3.report([out])


@pytest.mark.jax
def test_jax_framework_runs_the_same_protocol_with_adaclip_jax(tmp_path):
    pytest.importorskip("jax")
    out = round3.main(["--framework", "jax", "--task", "digits-mlp", "--optimizer", "sgd", "--epsilons", "1",
                       "--seeds", "1", "--epochs", "1", "--lrs", "0.5", "--clips", "1",
                       "--methods", "flat", "banded+ema", "--out", str(tmp_path), "--quiet"])  # fmt: skip
    assert out["framework"] == "jax"
    cell = out["cells"]["1.0"]
    plan = cell["plans"]["banded|None"]
    for method, f in cell["final"].items():
        raw = f["raw"][0]
        assert raw["steps"] == plan["per_epoch"] and 0.0 < raw["epsilon"] <= 1.0 + 1e-9
        assert f["bands"] == (1 if method == "flat" else plan["bands"])
        assert 0.0 <= f["runs"][0]["metric"] <= 1.0
    assert (tmp_path / "round3_digits-mlp_jax_sgd_eps1.json").exists()


def test_jax_padding_keeps_every_sampled_unit():
    """The padded batch is never smaller than the sample (no unit is dropped), one shape usually."""
    round3_jax = pytest.importorskip("round3_jax")
    usual = round3_jax.padded_size(0, 256.0)
    assert usual >= 256 + 6 * 16 and usual % round3_jax.BUCKET == 0
    for n in (0, 1, 255, usual - 1, usual):
        assert round3_jax.padded_size(n, 256.0) == usual
    for n in (usual + 1, 3 * usual + 5):
        size = round3_jax.padded_size(n, 256.0)
        assert n <= size < n + round3_jax.BUCKET and size % round3_jax.BUCKET == 0


def test_blt_runs_fixed_order_epochs_within_budget_with_make_privates_sigma(tmp_path):
    """``blt``/``blt+ema`` train epochs × ⌈N/B⌉ fixed-order steps (no empty batch), spend at
    most ε, and their plan is make_private(noise_mechanism="blt")'s: the same fitted factor
    and the same calibrated σ for (N, B, epochs, ε, δ)."""
    import torch

    from adaclip_torch import make_private

    out = round3.main(["--task", "digits-mlp", "--optimizer", "sgd", "--epsilons", "1", "--seeds", "1", "--epochs", "1",
                       "--lrs", "0.5", "--clips", "1", "--methods", "flat", "blt", "blt+ema", "--out", str(tmp_path),
                       "--quiet"])  # fmt: skip
    cell = out["cells"]["1.0"]
    plan = cell["plans"]["blt|None"]
    task = round3.load("digits-mlp")
    n = len(task.y_train)
    batch_size = round(task.batch_size)
    assert plan["batch_size"] == batch_size and plan["per_epoch"] == math.ceil(n / batch_size) > 1
    for method in ("blt", "blt+ema"):
        f = cell["final"][method]
        assert f["steps"] == f["raw"][0]["steps"] == 1 * math.ceil(n / batch_size) == plan["steps"]
        assert f["raw"][0]["examples"] == 1 * n  # one pass: every example once, no batch dropped or empty
        assert 0.0 < f["epsilon_spent"] <= 1.0 + 1e-9
        assert f["sigma"] == plan["sigma"] and f["bands"] == plan["per_epoch"]
    assert cell["final"]["flat"]["epsilon_spent"] <= 1.0 + 1e-9
    assert cell["final"]["blt+ema"]["mu"] in round3.DECAYS and cell["final"]["blt"]["mu"] is None
    # make_private on the same (N, B, epochs, ε, δ)
    data = torch.utils.data.TensorDataset(torch.zeros(n, 2), torch.zeros(n, dtype=torch.long))
    model = torch.nn.Linear(2, 2)
    _, opt, loader = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                  torch.utils.data.DataLoader(data, batch_size=batch_size), noise_mechanism="blt",
                                  target_epsilon=1.0, delta=round3.DELTA, epochs=1, max_grad_norm=1.0, seed=0,
                                  accountant=plan["accountant"])  # the harness's accountant (--accountant)  # fmt: skip
    assert opt.noise_multiplier == plan["sigma"]
    assert opt.noise_mechanism == "blt"
    mech = opt.correlated_noise  # BLT's θ, ω: public hyperparameters
    assert (list(mech.theta), list(mech.omega)) == (plan["theta"], plan["omega"])
    assert loader.batch_sampler.num_batches == plan["per_epoch"]
    assert "| blt+ema |" in round3.report([json.loads((tmp_path / "round3_digits-mlp_torch_sgd_eps1.json").read_text())])


def tiny_user_task():
    """lstm-users-long cut to its first 400 users (3,200 sentences), B̄ = 20 users: q = 1/20."""
    import dataclasses

    import numpy as np

    task = round3.load_round3_task("lstm-users-long")
    rows = np.flatnonzero(task.user_train < 400)
    return dataclasses.replace(task, x_train=task.x_train[rows], y_train=task.y_train[rows],
                               user_train=task.user_train[rows], batch_size=20.0)  # fmt: skip


def test_user_level_runs_sample_users_and_plan_per_user(monkeypatch):
    """User-level tasks: the plan counts users (q = B̄/U, not rows), the sampler draws whole
    users (cyclic over the users when b > 1), each step clips one unit per user, and the run
    spends at most ε."""
    import numpy as np
    import torch

    from adaclip_torch import PoissonUserBatchSampler

    task = tiny_user_task()
    rows = np.arange(len(task.y_train))
    assert round3.units_of(task, rows) == 400 < len(rows)
    plan = round3.plan_noise(task, 400, 3, 3.0, "sgd", None)  # 60 steps: shorter runs get b = 1
    assert plan["q"] == pytest.approx(20 / 400) and plan["per_epoch"] == 20 and plan["bands"] > 1
    model = task.make_model(0)
    inner = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    users = torch.as_tensor(task.user_train)
    opt, sampler = round3.build_private("banded", model, inner, 1.0, plan, epsilon=3.0, seed=0, n_units=400,
                                        user_ids=users)  # fmt: skip
    assert isinstance(sampler, PoissonUserBatchSampler) and sampler.cyclic_sampler.bands == plan["bands"]
    for idx in sampler:  # whole users: every sampled user brings all 8 of its sentences
        counts = torch.bincount(users[torch.as_tensor(idx, dtype=torch.long)])
        assert set(counts[counts > 0].tolist()) <= {8}
    opt.remove_hooks()
    seen = []  # the user ids each non-empty step was given
    build = round3.build_private

    def spying_build(*args, **kwargs):
        built, sampler = build(*args, **kwargs)
        step = built.step

        def recording_step(*a, **k):
            if not k.get("empty_batch"):
                seen.append(k.get("user_ids"))
            return step(*a, **k)

        built.step = recording_step
        return built, sampler

    monkeypatch.setattr(round3, "build_private", spying_build)
    run = round3.train(task, "banded", {"lr": 0.5, "max_grad_norm": 1.0}, plan, optimizer="sgd", epsilon=3.0,
                       seed=0, train_idx=rows, eval_idx=rows[:200], epochs=1)  # fmt: skip
    assert run["steps"] == plan["per_epoch"] and 0.0 < run["epsilon"] <= 3.0 + 1e-9
    assert run["bands"] == plan["bands"] and seen
    assert all(ids is not None and len(ids) % 8 == 0 for ids in seen)  # clipped per user: ids passed


def test_user_level_tasks_refuse_blt_and_jax(tmp_path, capsys):
    for extra in (["--methods", "flat", "blt"], ["--framework", "jax", "--methods", "flat"]):
        with pytest.raises(SystemExit):
            round3.main(["--task", "lstm-users-long", "--epsilons", "1", "--out", str(tmp_path), "--quiet", *extra])
    assert "example-level" in capsys.readouterr().err


def test_banded_lr_trains_adam_at_rho_times_the_grids_lr(monkeypatch):
    """``banded-lr``: the plan carries ρ = adaptive_lr_scale(c, T, σ_b, σ_1) for Adam (1 for SGD and
    for ``banded``), and the run's inner optimizer is built with ρ·lr."""
    import numpy as np

    from adaclip.correlated.coefficients import adaptive_lr_scale

    task = round3.load("digits-mlp")
    task.batch_size = 256.0 * len(task.y_train) / 50_000  # q = 256/50,000: b > 1 at ε = 3
    n = len(task.y_train)
    plan = round3.plan_noise(task, n, 2, 3.0, "adam", None, run_kind="banded-lr")
    sigma_1 = round3.plan_noise(task, n, 2, 3.0, "adam", 1)["sigma"]
    rho = adaptive_lr_scale(plan["coefficients"], plan["steps"], sigma=plan["sigma"], sigma_independent=sigma_1)
    assert plan["bands"] > 1 and plan["lr_scale"] == pytest.approx(rho) and rho > 1.2
    assert round3.plan_noise(task, n, 2, 3.0, "sgd", None, run_kind="banded-lr")["lr_scale"] == 1.0
    assert round3.plan_noise(task, n, 2, 3.0, "adam", None)["lr_scale"] == 1.0
    # -nocap: b by the expected-error rule without Adam's cap (SGD's b), ρ for that b
    from adaclip_torch.privacy import ADAPTIVE_OPTIMIZER_MAX_BANDS

    uncapped = round3.plan_noise(task, n, 2, 3.0, "adam", None, run_kind="banded-lr-nocap")
    assert uncapped["bands"] == round3.plan_noise(task, n, 2, 3.0, "sgd", None)["bands"] > ADAPTIVE_OPTIMIZER_MAX_BANDS
    assert uncapped["lr_scale"] > plan["lr_scale"]
    built = []
    real = round3.make_optimizer
    monkeypatch.setattr(round3, "make_optimizer", lambda name, params, lr: built.append(lr) or real(name, params, lr))
    rows = np.arange(n)
    round3.train(task, "banded-lr", {"lr": 0.01, "max_grad_norm": 1.0}, plan, optimizer="adam", epsilon=3.0, seed=0,
                 train_idx=rows, eval_idx=rows[:50], epochs=1)  # fmt: skip
    assert built == [pytest.approx(0.01 * rho)]


def test_reuse_copies_an_earlier_cells_runs_and_refuses_another_cell(tmp_path):
    common = ["--task", "digits-mlp", "--optimizer", "sgd", "--epsilons", "1", "--seeds", "2", "--epochs", "1",
              "--lrs", "0.5", "--clips", "1", "--out", str(tmp_path), "--quiet"]  # fmt: skip
    first = round3.main([*common, "--methods", "flat", "banded"])["cells"]["1.0"]
    earlier = tmp_path / "round3_digits-mlp_torch_sgd_eps1.json"
    second = round3.main([*common, "--methods", "flat", "flat+ema", "--reuse", str(earlier), "--tag", "_b"])
    cell = second["cells"]["1.0"]
    assert cell["reused"] == {"file": earlier.name, "methods": ["flat"]}
    assert cell["final"]["flat"] == first["final"]["flat"] and "flat" in cell["tuning"]
    assert "flat+ema" in cell["final"]  # not in the earlier file: run (on its own flat runs)
    assert "copied from" in round3.report([second])
    # several files: each method from the last file that has it
    third = round3.main([*common, "--methods", "flat", "flat+ema", "banded", "--reuse", str(earlier),
                         str(tmp_path / "round3_digits-mlp_torch_sgd_eps1_b.json"), "--tag", "_d"])["cells"]["1.0"]  # fmt: skip
    assert third["reused"] == {"file": f"{earlier.name}, round3_digits-mlp_torch_sgd_eps1_b.json",
                               "methods": ["banded", "flat", "flat+ema"]}  # fmt: skip
    assert third["final"]["banded"] == first["final"]["banded"]
    assert third["final"]["flat+ema"] == cell["final"]["flat+ema"]
    other = [a if a != "0.5" else "0.2" for a in common]  # another grid: not the same cell
    with pytest.raises(ValueError, match="grid"):
        round3.main([*other, "--methods", "flat", "--reuse", str(earlier), "--tag", "_c"])


def test_quantile_banded_is_the_quantile_rule_on_the_recommended_noise_plan(monkeypatch):
    """``quantile-banded``: the plan of ``banded-lr-nocap`` (the rule's uncapped b, Adam's ρ), and
    the run clips with the quantile rule under banded noise (its clip norm adapts)."""
    import numpy as np

    task = round3.load("digits-mlp")
    task.batch_size = 64.0  # the count's noise B̄/20 must exceed σ/2
    n = len(task.y_train)
    plan = round3.plan_noise(task, n, 4, 3.0, "adam", None, run_kind="quantile-banded")
    assert plan == round3.plan_noise(task, n, 4, 3.0, "adam", None, run_kind="banded-lr-nocap")
    assert plan["bands"] > 1 and plan["lr_scale"] > 1.0
    built = []
    real = round3.build_private

    def spy(*args, **kw):
        opt, sampler = real(*args, **kw)
        built.append(opt)
        return opt, sampler

    monkeypatch.setattr(round3, "build_private", spy)
    rows = np.arange(n)
    round3.train(task, "quantile-banded", {"lr": 0.01, "max_grad_norm": 1.0}, plan, optimizer="adam", epsilon=3.0,
                 seed=0, train_idx=rows, eval_idx=rows[:50], epochs=1)  # fmt: skip
    (opt,) = built
    assert type(opt.strategy).__name__ == "QuantileClipping" and opt.noise_mechanism == "banded"
    assert len(opt.noise_coefficients) == plan["bands"] and opt.max_grad_norm != 1.0  # C_t adapted


def test_pick_clipping_reads_validation_only():
    """The recommended configuration with its clipping picked on validation: the flat one the
    current defaults give (first of FLAT_RECOMMENDED present) or recommended-quantile, by the
    winners' validation means; the test scores never enter."""
    from methods_round3 import pick_clipping

    def cell(vals: dict[str, float], tests: dict[str, float]) -> dict:
        return {"winners": {m: {"val_mean": v} for m, v in vals.items()},
                "final": {m: {"runs": [{"seed": 0, "metric": t}]} for m, t in tests.items()}}  # fmt: skip

    both = {"recommended": 0.9, "recommended-lr-nocap": 0.1, "recommended-quantile": 0.5}
    assert pick_clipping(cell({"recommended": 0.2, "recommended-lr-nocap": 0.3, "recommended-quantile": 0.4}, both)) \
        == "recommended-quantile"  # fmt: skip
    assert pick_clipping(cell({"recommended": 0.9, "recommended-lr-nocap": 0.5, "recommended-quantile": 0.4}, both)) \
        == "recommended-lr-nocap"  # fmt: skip
    sgd = {"recommended": 0.1, "recommended-quantile": 0.9}
    assert pick_clipping(cell({"recommended": 0.4, "recommended-quantile": 0.4}, sgd)) == "recommended"  # ties: flat
    assert pick_clipping(cell({"recommended": 0.4}, {"recommended": 0.4})) is None


def test_summary_merges_a_cells_files_and_tallies_the_readings():
    """The summary reads each cell once: methods merged over the files of the same setup (a
    one-point grid of a special run left out), the defaults and the validation pick against the
    best baseline present, with the tallies."""
    import report_round3

    def result(methods: dict[str, list[float]], grid: list, vals: dict[str, float] | None = None) -> dict:
        final = {m: {"runs": [{"seed": s, "metric": v} for s, v in enumerate(xs)], "bands": 4} for m, xs in methods.items()}
        winners = {m: {"val_mean": (vals or {}).get(m, 0.0)} for m in methods}
        return {"task": "t", "framework": "torch", "optimizer_name": "sgd", "grid": grid, "seeds": [0, 1, 2],
                "tune_seeds": [0], "epochs": 2, "cells": {"3.0": {"final": final, "winners": winners}}}  # fmt: skip

    grid = [{"lr": 0.1, "max_grad_norm": 1.0}, {"lr": 0.2, "max_grad_norm": 1.0}]
    first = result({"flat": [0.50, 0.51, 0.52], "recommended": [0.50, 0.51, 0.52]}, grid)
    second = result({"flat": [0.50, 0.51, 0.52], "quantile": [0.60, 0.60, 0.61],
                     "recommended-quantile": [0.62, 0.63, 0.64]}, grid,
                    vals={"recommended": 0.5, "recommended-quantile": 0.7})  # fmt: skip
    special = result({"flat": [0.9, 0.9, 0.9], "adaclip+banded+ema": [0.99, 0.99, 0.99]}, grid[:1])
    text = report_round3.summary([first, second, special])
    row = next(line for line in text.splitlines() if line.startswith("| t, sgd"))
    assert "| flat, quantile | quantile |" in row  # the special run's flat (0.9) is not the cell's
    assert "-9.3 ± 0.3 behind" in row  # the defaults (flat clipping) vs quantile
    assert "quantile: +2.7 ± 0.3 ahead" in row  # picked on validation: the quantile rule
    assert row.endswith("not run | not run |")  # adaclip+banded+ema only in the special run
    assert "defaults: ahead 0, ≈ 0, behind 1 (1 cells)" in text and "picked: ahead 1, ≈ 0, behind 0" in text
