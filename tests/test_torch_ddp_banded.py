"""Banded correlated noise with ``distributed=True``: two CPU processes on gloo.

Rank 0 alone draws and correlates the noise (its buffers), the clipped sums of both ranks are
all-reduced with it, so the banded noise is added exactly once: the release sequence equals a
single process's with rank 0's seed, over several steps (the buffers matter from step 2 on), and
every rank's optimizer holds the same statistics (AdaCliP subtracts the same v_t on every rank).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _gloo import gloo_group, spawn_ranks
from torch import nn

from adaclip_torch import AdaClip, FlatClip
from adaclip_torch.data import CyclicPoissonBatchSampler

pytestmark = pytest.mark.torch
WORLD, BANDS, STEPS, Q = 2, 3, 5, 0.25


def _build(kind: str, seed: int, distributed: bool):
    torch.manual_seed(0)
    model = nn.Linear(6, 4)
    sampler = CyclicPoissonBatchSampler(16, Q, BANDS, num_steps=STEPS, generator=torch.Generator().manual_seed(1))
    common = dict(noise_multiplier=1.5, expected_batch_size=8.0, sample_rate=Q, seed=seed, attach_hooks=False,
                  noise_mechanism="banded", bands=BANDS, sampler=sampler, distributed=distributed)
    inner = torch.optim.SGD(model.parameters(), lr=0.0)
    if kind == "flat":
        opt = FlatClip(inner, model, max_grad_norm=1.0, **common)
    else:
        opt = AdaClip(inner, model, std_min=1e-3, std_max=2.0, preset="patent", **common)
    return model, opt, sampler


def releases(kind: str, seed: int, distributed: bool, rank: int = 0):
    """STEPS noise-only releases (every rank's clipped sum is 0) and the final AdaCliP std."""
    model, opt, sampler = _build(kind, seed, distributed)
    out, it = [], iter(sampler)
    for _ in range(STEPS):
        next(it)
        for p in opt.params:
            p.grad_sample = torch.zeros((2, *p.shape))
        opt.step()
        out.append(torch.cat([p.grad.reshape(-1) for p in opt.params]).clone())
        opt.zero_grad()
    std = opt.hyperparameters() if kind == "flat" else [s.clone() for s in opt._clip_state.std]
    return torch.stack(out), std


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    with gloo_group(rank, WORLD, init_file):
        result = {kind: releases(kind, seed=7 if rank == 0 else 100 + rank, distributed=True, rank=rank)
                  for kind in ("flat", "adaclip")}
        torch.save(result, f"{out_dir}/rank{rank}.pt")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return spawn_ranks(_worker, tmp_path_factory.mktemp("ddp_banded"), WORLD)


@pytest.mark.parametrize("kind", ["flat", "adaclip"])
def test_banded_noise_is_added_once_by_rank_zero(ranks, kind):
    single, _ = releases(kind, seed=7, distributed=False)
    first, first_std = ranks[0][kind]
    for rank in range(1, WORLD):  # every rank released the same values and holds the same state
        got, std = ranks[rank][kind]
        np.testing.assert_array_equal(got.numpy(), first.numpy())
        if kind == "adaclip":  # the statistics subtracted the same v_t on every rank
            for a, b in zip(std, first_std, strict=True):
                np.testing.assert_array_equal(a.numpy(), b.numpy())
    # Flat clipping: the single process's releases, to float32 rounding. AdaCliP's statistics on
    # zero gradients cancel the noise's variance against the released squares, which amplifies
    # the rounding of the all-reduce (the same happens with independent noise and
    # distributed=True): close, not equal, from the second step on.
    tol = dict(rtol=1e-6, atol=1e-7) if kind == "flat" else dict(rtol=0.0, atol=2e-3)
    np.testing.assert_allclose(first.numpy(), single.numpy(), **tol)
    np.testing.assert_array_equal(first[0].numpy(), single[0].numpy())  # step 0: no statistics yet
    # negative control: the releases are correlated noise, not the independent noise of the seed
    assert not np.allclose(single[2:].numpy(), releases_independent(kind)[2:].numpy())


def releases_independent(kind: str):
    model = nn.Linear(6, 4)
    inner = torch.optim.SGD(model.parameters(), lr=0.0)
    common = dict(noise_multiplier=1.5, expected_batch_size=8.0, sample_rate=Q, seed=7, attach_hooks=False)
    opt = (FlatClip(inner, model, max_grad_norm=1.0, **common) if kind == "flat"
           else AdaClip(inner, model, std_min=1e-3, std_max=2.0, preset="patent", **common))
    out = []
    for _ in range(STEPS):
        for p in opt.params:
            p.grad_sample = torch.zeros((2, *p.shape))
        opt.step()
        out.append(torch.cat([p.grad.reshape(-1) for p in opt.params]).clone())
        opt.zero_grad()
    return torch.stack(out)
