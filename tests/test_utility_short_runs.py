"""The short-runs benchmark (benchmarks/utility/short_runs.py): its --quick cell (digits MLP,
16 steps = 2 epochs of 8, ε = 3, one seed) end to end — the JSON and markdown it writes, and that
the b it records for the library's choice is the one make_private reports for that run."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "utility"))

pytest.importorskip("torch")
pytest.importorskip("sklearn")
short_runs = pytest.importorskip("short_runs")

pytestmark = pytest.mark.torch


def test_quick_cell_structure_and_recorded_b_is_make_privates(tmp_path):
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from adaclip_torch import make_private

    out_path = tmp_path / "short.json"
    out = short_runs.main(["--quick", "--seeds", "1", "--out", str(out_path)])
    saved = json.loads(out_path.read_text())
    md = out_path.with_suffix(".md").read_text()
    assert saved["cells"] and saved["meta"]["command"].startswith("python benchmarks/utility/short_runs.py")
    assert set(saved["meta"]["versions"]) >= {"python", "torch"} and saved["meta"]["date"]
    assert "## The rule's choice against DP-SGD" in md and "digits-mlp" in md

    (cell,) = saved["cells"]
    assert (cell["task"], cell["horizon"], cell["epsilon"]) == ("digits-mlp", "T60-E3", 3.0)
    epochs, spe = short_runs.HORIZONS["T60-E3"]
    assert cell["rule"]["steps"] == epochs * spe == 60
    auto = cell["runs"]["auto"][0]
    dpsgd = cell["runs"]["dpsgd"][0]
    assert auto["steps"] == dpsgd["steps"] == 60
    assert dpsgd["bands"] == 1 and dpsgd["noise_mechanism"] == "independent"
    # the fixed-b arms are exactly the candidates between 2 and the rule's b
    fixed = sorted(int(a[1:]) for a in cell["runs"] if a.startswith("b"))
    assert fixed == ([k for k in cell["rule"]["candidates"] if 2 <= k < auto["bands"]] if auto["bands"] > 2 else [])
    for arm, runs in cell["runs"].items():
        assert 0.0 <= runs[0]["acc"] <= 1.0
        assert runs[0]["epsilon_spent"] <= cell["epsilon"] * (1 + 1e-6)  # within the budget
        summary = cell["summary"][arm]
        assert summary["n"] == 1 and math.isclose(summary["mean"], 100 * runs[0]["acc"])
    assert cell["verdict"] in ("same run (b = 1)", "n/a (one seed)")
    # the harness's own rule table agrees with make_private's choice, and so does its replay of the rule
    assert cell["rule_matches_make_private"] and cell["rule"]["bands"] == auto["bands"]
    replay = short_runs.evaluate_rules(saved)["current: least expected error"]["cells"][0]
    assert (replay["bands"], replay["arm"]) == (auto["bands"], "auto")
    assert "## Other rules replayed on these runs" in md

    # make_private, called here on the same run, reports the b (and rate, σ) the benchmark recorded
    data = short_runs.load_digits_data()
    model = data.make_model(0)
    inner = torch.optim.SGD(model.parameters(), lr=cell["lr"], momentum=short_runs.MOMENTUM)
    loader = DataLoader(TensorDataset(data.x_train, data.y_train),
                        batch_size=short_runs.batch_size_for(len(data.y_train), spe))  # fmt: skip
    _, opt, _ = make_private(model, inner, loader, target_epsilon=3.0, delta=short_runs.DELTA, epochs=epochs,
                             max_grad_norm=short_runs.CLIP, progress=False)  # fmt: skip
    assert opt.bands == auto["bands"] > 1
    assert opt.accounted_sample_rate == pytest.approx(auto["accounted_sample_rate"])
    assert opt.noise_multiplier == pytest.approx(auto["sigma"])
    assert out["cells"][0]["rule"]["bands"] == opt.bands
