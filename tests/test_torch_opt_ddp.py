"""Two CPU processes on the gloo backend: clipped sums all-reduced, noise added exactly once."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from _gloo import gloo_group, spawn_ranks
from scipy import stats
from test_torch_opt_support import batch, flat_vec, mlp
from torch import nn

from adaclip.errors import AdaClipError
from adaclip_torch import AdaClip

WORLD = 2
STD_MIN, STD_MAX = 1e-3, 2.0
SIGMA, BBAR = 1.0, 4.0


def _adaclip(model, *, sigma, distributed, attach_hooks=True):
    return AdaClip(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=sigma,
                   expected_batch_size=10, std_min=STD_MIN, std_max=STD_MAX, seed=0,
                   distributed=distributed, attach_hooks=attach_hooks, preset="patent")


def _train_shard(rank: int, world: int, *, distributed: bool) -> nn.Module:
    """Two AdaClip steps (σ = 0) on this rank's share of two batches of 10."""
    model = mlp(0)
    opt = _adaclip(model, sigma=0.0, distributed=distributed)
    for t in range(2):
        x, y = batch(t, n=10)
        nn.functional.cross_entropy(model(x[rank::world]), y[rank::world]).backward()
        opt.step()
        opt.zero_grad()
    return model


def _noise_only_step(rank: int) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Linear(60, 40)
    opt = AdaClip(torch.optim.SGD(model.parameters(), lr=0.0), model, noise_multiplier=SIGMA,
                  expected_batch_size=BBAR, std_min=STD_MIN, std_max=STD_MAX, seed=10 + rank,
                  distributed=True, attach_hooks=False, preset="patent")
    for p in opt.params:
        p.grad_sample = torch.zeros((3, *p.shape))
    opt.step()
    return [p.grad.clone() for p in opt.params]


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    with gloo_group(rank, world, init_file):  # the import order it needs: tests/_gloo.py
        model = _train_shard(rank, world, distributed=True)
        noise = _noise_only_step(rank)
        torch.save({"params": [p.detach() for p in model.parameters()], "noise": noise}, f"{out_dir}/rank{rank}.pt")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return spawn_ranks(_worker, tmp_path_factory.mktemp("ddp"), WORLD, WORLD)


def test_two_ranks_with_sigma_zero_equal_one_process_on_the_union(ranks):
    single = _train_shard(0, 1, distributed=False)
    for r in ranks:
        for p, q in zip(r["params"], single.parameters()):
            torch.testing.assert_close(p, q.detach(), rtol=1e-12, atol=1e-13)


def test_all_ranks_apply_the_same_update(ranks):
    for a, b in zip(ranks[0]["noise"], ranks[1]["noise"]):
        assert torch.equal(a, b)
    for a, b in zip(ranks[0]["params"], ranks[1]["params"]):
        assert torch.equal(a, b)


def test_noise_variance_is_sigma_squared_not_world_times(ranks):
    noise = flat_vec(ranks[0]["noise"])
    d = noise.size
    s0 = math.sqrt(STD_MIN * STD_MAX)
    b = math.sqrt(s0) * math.sqrt(d * s0)
    scale = b * SIGMA / BBAR
    assert stats.kstest(noise / scale, "norm").pvalue > 1e-3
    assert stats.kstest(noise / (math.sqrt(WORLD) * scale), "norm").pvalue < 1e-3
    assert np.var(noise / scale) == pytest.approx(1.0, abs=0.1)


def test_distributed_without_process_group_is_an_error():
    model = mlp(0)
    opt = _adaclip(model, sigma=1.0, distributed=True, attach_hooks=False)
    for p in opt.params:
        p.grad_sample = torch.zeros((2, *p.shape), dtype=p.dtype)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(AdaClipError, match="init_process_group"):
        opt.step()
    assert opt.steps == 0 and all(torch.equal(a, p) for a, p in zip(before, model.parameters()))

