"""The round-two utility benchmark (benchmarks/utility/round2.py): tasks, the equal budget, the
twin start of every adaptive method, the paired statistics of the report, and a tiny run."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
UTILITY = ROOT / "benchmarks" / "utility"
sys.path.insert(0, str(UTILITY))

import sklearn  # noqa: E402,F401  (the bench extra)

round2 = pytest.importorskip("round2")
report_round2 = pytest.importorskip("report_round2")
tasks_round2 = pytest.importorskip("tasks_round2")


def test_every_method_gets_the_same_grid_and_it_holds_the_default_clip():
    for task in ("raw-digits-mlp", "mnist1d-finetune", "transformer-users", "digits-mlp"):
        for opt in ("sgd", "adam"):
            configs = round2.grid(task, opt)
            assert len(configs) == len(round2.CLIPS) * 2
            assert sum(c["max_grad_norm"] == round2.DEFAULT_CLIP for c in configs) == 2  # the tuning-free subset


@pytest.mark.parametrize("method", ["flat", "quantile", "automatic", "ada-patent", "ada-centred", "ada-tensor"])
def test_every_method_starts_as_flat_clippings_ball(method):
    """At step 0 the clip region is flat clipping's ball of radius C around 0: centre 0 and
    ‖g/b‖ = ‖g‖/C for every g (checked on a spread-out g and on one coordinate)."""
    shapes = [(3, 4), (4,), (2, 3)]
    d = sum(int(np.prod(s)) for s in shapes)
    c = 0.7
    strategy = round2.strategy_for(method, c, d)
    state = strategy.init([torch.zeros(s) for s in shapes])
    centre, scale = strategy.transform(state, len(shapes))
    if centre is not None:
        assert all(float(torch.as_tensor(a).abs().max()) == 0.0 for a in centre)
    gen = torch.Generator().manual_seed(0)
    for g in ([torch.randn(s, generator=gen) for s in shapes], [torch.zeros(s) for s in shapes]):
        g[1][2] = 3.0
        norm_sq = sum(float(((x / torch.as_tensor(b, dtype=x.dtype)) ** 2).sum()) for x, b in zip(g, scale))
        flat_sq = sum(float((x**2).sum()) for x in g) / c**2
        assert norm_sq == pytest.approx(flat_sq, rel=1e-5)


def test_patent_defaults_are_the_patents():
    s = round2.strategy_for(round2.PATENT_DEFAULTS, 123.0, 10)
    assert (s.std_min, s.std_max, s.beta_std, s.scale) == (1e-5, 1.0, 0.9, "coupled")


def test_raw_digits_scales_span_three_decades_and_are_data_independent():
    scales = tasks_round2.raw_pixel_scales()
    assert scales.shape == (64,)
    assert np.array_equal(scales, tasks_round2.raw_pixel_scales())
    assert 300 < scales.max() / scales.min() <= 1000


def test_tiny_transformer_trains_under_per_sample_hooks():
    task = tasks_round2.load_round2_task("transformer-lm")
    model = task.make_model(0)
    from adaclip.strategies import FlatClipping
    from adaclip_torch import DPOptimizer

    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, strategy=FlatClipping(1.0),
                      noise_multiplier=0.0, expected_batch_size=4.0, seed=0)  # fmt: skip
    x = torch.as_tensor(task.x_train[:4])
    logits = model(x)
    assert logits.shape == (4, 12, 200)
    torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 200), x[:, 1:].reshape(-1)).backward()
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    opt.remove_hooks()


def test_a_diverged_language_model_scores_infinite_perplexity_not_an_error():
    # A learning rate of the grid can make a run diverge; its evaluation must still return (the
    # validation pick then ranks it last) instead of ending the whole benchmark.
    import utility_train

    task = tasks_round2.load_round2_task("transformer-lm")

    class Diverged(torch.nn.Module):  # confidently wrong: the next token always gets logit -1e6
        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            logits = torch.zeros(*tokens.shape, 200)
            nxt = torch.cat([tokens[:, 1:], tokens[:, :1]], dim=1)
            return logits.scatter(-1, nxt.unsqueeze(-1), -1e6)

    scores = utility_train.evaluate(task, Diverged(), task.x_train[:8], task.y_train[:8])
    assert scores["metric"] == 0.0
    assert scores["perplexity"] == math.inf


def test_runs_at_other_epsilons_join_into_one_result():
    def run(eps, epochs=5, wall=10.0):
        return {"task": "t", "framework": "torch", "optimizer_name": "sgd", "command": f"eps {eps}",
                "wall_seconds": wall, "epochs": epochs, "epsilons": [eps],
                "cells": {str(eps): {"final": {}}}}  # fmt: skip

    (joined,) = report_round2.merge_runs([run(3.0, wall=30.0), run(1.0), run(8.0)])
    assert list(joined["cells"]) == ["1.0", "3.0", "8.0"]
    assert joined["epsilons"] == [1.0, 3.0, 8.0]
    assert joined["commands"] == ["eps 3.0", "eps 1.0", "eps 8.0"]
    assert joined["cells"]["3.0"]["wall_seconds"] == 30.0 and joined["cells"]["1.0"]["wall_seconds"] == 10.0
    with pytest.raises(ValueError, match="measured in two runs"):
        report_round2.merge_runs([run(3.0), run(3.0)])
    with pytest.raises(ValueError, match="different settings"):
        report_round2.merge_runs([run(3.0), run(1.0, epochs=3)])
    other = {**run(1.0), "optimizer_name": "adam"}
    assert len(report_round2.merge_runs([run(3.0), other])) == 2


def test_paired_statistics_and_verdicts():
    a = {"runs": [{"seed": 1, "metric": 0.52}, {"seed": 0, "metric": 0.50}, {"seed": 2, "metric": 0.55}]}
    b = {"runs": [{"seed": 0, "metric": 0.49}, {"seed": 1, "metric": 0.50}, {"seed": 2, "metric": 0.52}]}
    d, se, wins = report_round2.paired(a, b)
    diffs = np.array([1.0, 2.0, 3.0])  # points, paired by seed (not by list order)
    assert d == pytest.approx(diffs.mean())
    assert se == pytest.approx(diffs.std(ddof=1) / math.sqrt(3))
    assert wins == 3
    assert report_round2.verdict_beats(2.0, 1.0) == "ahead"
    assert report_round2.verdict_beats(1.9, 1.0) == "≈"
    assert report_round2.verdict_beats(-1.0, 1.0) == "≈"
    assert report_round2.verdict_beats(-1.1, 1.0) == "behind"


def test_tiny_run_pairs_seeds_tunes_on_validation_and_reports(tmp_path):
    out = round2.main(["--task", "digits-mlp", "--optimizer", "adam", "--epsilons", "3", "--seeds", "2",
                       "--epochs", "1", "--methods", "flat", "ada-centred", "--out", str(tmp_path), "--quiet"])  # fmt: skip
    cell = out["cells"]["3.0"]
    assert set(cell["winners"]) == {"flat", "ada-centred"}
    assert len(cell["tuning"]["flat"]) == len(cell["tuning"]["ada-centred"]) == 4
    for key in ("flat|tuned", "ada-centred|tuned", "flat|free", "ada-patent-defaults|free"):
        runs = cell["final"][key]["runs"]
        assert [r["seed"] for r in runs] == [0, 1]
        assert all(r["epsilon"] <= 3.0 + 1e-9 for r in runs)
    winner = cell["winners"]["flat"]
    assert winner["val_mean"] == max(r["val_mean"] for r in cell["tuning"]["flat"])
    saved = json.loads((tmp_path / "round2_digits-mlp_torch_adam.json").read_text())
    text = report_round2.report([saved])
    assert "Target 1" in text and "tuning-free" in text


def test_more_seeds_for_the_tuned_winners_extend_the_tuned_run(tmp_path):
    common = ["--task", "digits-mlp", "--optimizer", "sgd", "--epsilons", "3", "--epochs", "1",
              "--methods", "flat", "ada-tensor", "--quiet"]  # fmt: skip
    tuned = round2.main([*common, "--seeds", "2", "--out", str(tmp_path)])
    first = tmp_path / "round2_digits-mlp_torch_sgd.json"
    more = round2.main([*common, "--seeds", "3", "--winners-from", str(first), "--out", str(tmp_path), "--tag", "_s3"])
    assert report_round2._is_reseeding(more) and not report_round2._is_reseeding(tuned)

    tuned, more = json.loads(first.read_text()), json.loads((tmp_path / "round2_digits-mlp_torch_sgd_s3.json").read_text())
    (joined,) = report_round2.merge_runs([more, tuned])  # in either order
    final = joined["cells"]["3.0"]["final"]
    assert [r["seed"] for r in final["flat|tuned"]["runs"]] == [0, 1, 2]
    assert [r["seed"] for r in final["ada-tensor|free"]["runs"]] == [0, 1]  # the tuning-free runs stay
    assert joined["reseeded"] == {"3.0": 3} and len(joined["commands"]) == 2
    # seeds 0 and 1 were repeated, not drawn anew: the earlier runs are reproduced exactly
    for key in ("flat|tuned", "ada-tensor|tuned"):
        assert [r["metric"] for r in final[key]["runs"][:2]] == [r["metric"] for r in tuned["cells"]["3.0"]["final"][key]["runs"]]
    # the tuning-free comparison pairs on the seeds both have
    d, se, _ = report_round2.paired(final["ada-tensor|free"], final["flat|tuned"])
    assert not math.isnan(se)
    text = report_round2.report([tuned, more])
    assert "digits-mlp | sgd at ε = 3 (3 seeds)" in text

    changed = json.loads(json.dumps(more))
    changed["cells"]["3.0"]["final"]["flat|tuned"]["runs"][0]["metric"] += 0.01
    with pytest.raises(ValueError, match="does not reproduce seed"):
        report_round2.merge_runs([tuned, changed])
    other = json.loads(json.dumps(more))
    other["cells"]["3.0"]["final"]["flat|tuned"]["hp"] = {"lr": 123.0, "max_grad_norm": 1.0}
    with pytest.raises(ValueError, match="other hyperparameters"):
        report_round2.merge_runs([tuned, other])
    with pytest.raises(ValueError, match="must add seeds"):
        same_seeds = json.loads(json.dumps(tuned))
        for cell in same_seeds["cells"].values():
            cell["tuning"], cell["final"] = {}, {k: f for k, f in cell["final"].items() if k.endswith("|tuned")}
        report_round2.merge_runs([tuned, same_seeds])
