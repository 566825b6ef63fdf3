"""Round three on the Hugging Face fine-tuning task (``benchmarks/utility/round3_hf.py``).

- The validation split holds out whole documents of the private training records.
- The validation pick: the best mean validation accuracy over the averaging choices each method
  may make (``recommended`` may keep the live parameters), ties to the first grid point.
- One quick cell end to end (the example's ``--quick`` setting, 1 seed, 1 lr, 1 clip): every
  method tuned on the same grid, on the tuning records, scored on validation; winners retrained on
  all the training records; every run within the target ε; ``banded`` at the library's b (> 1
  here, AdamW's cap of 4) with its own, larger σ; ``recommended`` reads the banded runs.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "utility"))

import round3_hf  # noqa: E402


def test_validation_split_holds_out_whole_documents():
    counts = [3, 2, 4, 1, 2, 5, 2]  # records per document
    mask = round3_hf.validation_mask(counts, 15, every=5)  # the first 15 records: documents 0..5 (the 6th cut)
    assert mask.tolist() == [True] * 3 + [False] * 9 + [True] * 3
    with pytest.raises(ValueError):
        round3_hf.validation_mask(counts, 20)


def _run(lr, live, emas):
    return {"lr": lr, "bands": 1, "metric": live, **{f"ema{mu}": v for mu, v in zip(round3_hf.DECAYS, emas)}}


def test_pick_reads_validation_with_the_methods_averaging_choices():
    rows = [
        {"hp": {"lr": 1.0}, "runs": [_run(1.0, 0.50, (0.40, 0.41, 0.41))]},
        {"hp": {"lr": 2.0}, "runs": [_run(2.0, 0.45, (0.48, 0.52, 0.52))]},
        {"hp": {"lr": 3.0}, "runs": [_run(3.0, 0.50, (0.30, 0.30, 0.30))]},
    ]
    flat = round3_hf.pick_winner(rows, "flat")
    assert (flat["hp"], flat["mu"], flat["val_mean"]) == ({"lr": 1.0}, None, 0.50)  # tie: the first grid point
    ema = round3_hf.pick_winner(rows, "flat+ema")
    assert (ema["hp"], ema["mu"], ema["val_mean"]) == ({"lr": 2.0}, 0.99, 0.52)  # tie 0.99/0.999: the smaller μ
    assert round3_hf.pick_winner(rows, "recommended")["mu"] == 0.99
    rows[1]["runs"][0]["ema0.99"] = rows[1]["runs"][0]["ema0.999"] = 0.49
    rec = round3_hf.pick_winner(rows, "recommended")  # no averaging wins: the live parameters
    assert (rec["hp"], rec["mu"], rec["val_mean"]) == ({"lr": 1.0}, None, 0.50)


@pytest.mark.parametrize("kind, expected", [("flat", False), ("banded", False), ("banded-lr", True)])
def test_each_run_kind_asks_make_private_for_its_learning_rate_rule(monkeypatch, kind, expected):
    """``banded`` keeps AdamW's learning rate (as recorded before the option existed);
    ``banded-lr`` asks make_private for the factor ρ (``scale_adaptive_lr=True``)."""
    seen = {}

    class Stop(Exception):
        pass

    def fake_finetune(*args, **kwargs):
        seen.update(kwargs)
        raise Stop

    monkeypatch.setattr(round3_hf.hf, "private_finetune", fake_finetune)
    with pytest.raises(Stop):
        round3_hf.train(None, None, None, kind=kind, lr=1e-3, clip=1.0, seed=0, epsilon=8.0, delta=1e-5,
                        setting=None)  # fmt: skip
    assert seen["scale_adaptive_lr"] is expected
    assert seen["noise_mechanism"] == ("independent" if kind == "flat" else "banded")


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("round3_hf")
    res = round3_hf.main(["--quick", "--seeds", "1", "--lrs", "3e-3", "--clips", "1", "--out", str(out), "--quiet"])
    return res, out


def test_quick_cell_follows_the_protocol(quick):
    res, out = quick
    assert (out / "round3_hf_finetune_torch_adamw_eps8.json").is_file()
    cell = res["cells"]["8.0"]
    counts = res["records"]
    assert counts["tune"] + counts["validation"] == counts["train"] and counts["validation"] > 0
    # the same grid for every method's training runs, trained on the tuning records
    assert set(cell["tuning"]) == {"flat", "banded"}
    for rows in cell["tuning"].values():
        assert [row["hp"] for row in rows] == cell["grid"] == [{"lr": 3e-3, "max_grad_norm": 1.0}]
        assert all(r["records"] == counts["tune"] and r["seed"] == round3_hf.TUNE_SEED for row in rows
                   for r in row["runs"])  # fmt: skip
    # the winners are the best validation scores among each method's own choices
    flat_runs = [r for row in cell["tuning"]["flat"] for r in row["runs"]]
    banded_runs = [r for row in cell["tuning"]["banded"] for r in row["runs"]]
    emas = [f"ema{mu}" for mu in round3_hf.DECAYS]
    expected = {
        "flat": max(r["metric"] for r in flat_runs),
        "flat+ema": max(r[k] for r in flat_runs for k in emas),
        "banded": max(r["metric"] for r in banded_runs),
        "banded+ema": max(r[k] for r in banded_runs for k in emas),
        "recommended": max(r[k] for r in banded_runs for k in ["metric", *emas]),
    }
    for method, value in expected.items():
        assert cell["winners"][method]["val_mean"] == value, method
    assert cell["winners"]["flat"]["mu"] is None and cell["winners"]["flat+ema"]["mu"] in round3_hf.DECAYS
    # every run (tuning and final) within the target ε; final runs on all the training records
    every = flat_runs + banded_runs + [r for f in cell["final"].values() for r in f["raw"]]
    assert all(0 < r["epsilon"] <= 8.0 for r in every)
    for method, f in cell["final"].items():
        assert f["epsilon_spent"] <= 8.0
        assert [r["seed"] for r in f["runs"]] == [0]
        assert all(r["records"] == counts["train"] for r in f["raw"]), method
    # flat is DP-SGD; banded is the library's choice, which on the quick cell's 32 steps (fewer
    # than MIN_STEPS_FOR_BANDS) is DP-SGD too: b = 1, independent noise, the same σ
    from adaclip.correlated.planning import MIN_STEPS_FOR_BANDS

    final = cell["final"]
    assert final["flat"]["bands"] == 1 and final["flat"]["noise_mechanism"] == "independent"
    assert 1024 // 32 < MIN_STEPS_FOR_BANDS  # the quick setting: 1,024 records, batch 32, one epoch
    assert final["banded"]["bands"] == 1 and final["banded"]["noise_mechanism"] == "independent"
    assert final["banded"]["sigma"] == final["flat"]["sigma"]
    # recommended reads the banded runs (the same training runs, live or on their EMA)
    rec = final["recommended"]
    assert rec["raw"] == final["banded"]["raw"] and rec["bands"] == 1
    key = "metric" if rec["mu"] is None else f"ema{rec['mu']}"
    assert [r["metric"] for r in rec["runs"]] == [r[key] for r in rec["raw"]]
    assert "| recommended |" in round3_hf.table(res)
