"""``torch.distributed.checkpoint`` (DCP) of data-parallel private optimizers: two gloo ranks.

DCP saves one state dict from every rank and writes an entry that has the same key on every
rank once, as if it were replicated — from whichever rank its planner picks. The noise
generator and the correlated-noise buffers are not replicated: under sharded noise state each
rank has its own, and under rank 0's independent noise only rank 0's generator has moved. So the
optimizer keys them by rank (``{"rank<r>": ...}``) when ``distributed=True``, and pads the
buffer list to its full length so that a fresh optimizer's state dict is a template DCP can
load into. Checked here: a seeded run saved with DCP after 2 steps and loaded into fresh
optimizers built with another seed resumes bit for bit (banded noise with its state sharded,
and independent noise drawn by rank 0); the checkpoint holds each rank's own generator state;
a state dict holding only another rank's parts is refused, changing nothing.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from _gloo import gloo_group, spawn_ranks
from torch import nn

from adaclip.errors import InvalidHyperparameterError

pytestmark = pytest.mark.torch
WORLD, BANDS, STEPS, CUT, Q = 2, 3, 5, 2, 0.25


def _build(noise: str, seed: int):
    from adaclip.accounting import Accountant
    from adaclip_torch import FlatClip
    from adaclip_torch.data import CyclicPoissonBatchSampler

    torch.manual_seed(0)
    model = nn.Linear(6, 4)
    bands = BANDS if noise == "banded" else 1
    sampler = CyclicPoissonBatchSampler(16, Q, bands, num_steps=STEPS, generator=torch.Generator().manual_seed(1))
    extra = dict(noise_mechanism="banded", bands=BANDS) if noise == "banded" else {}
    opt = FlatClip(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model, max_grad_norm=1.0,
                   noise_multiplier=1.5, expected_batch_size=8.0, sample_rate=Q, seed=seed, attach_hooks=False,
                   sampler=sampler, distributed=True, accountant=Accountant("rdp"), **extra)  # fmt: skip
    return model, opt, sampler


def _step(opt, it) -> torch.Tensor:
    next(it)
    for p in opt.params:
        p.grad_sample = torch.ones((2, *p.shape))
    opt.step()
    out = torch.cat([p.grad.reshape(-1) for p in opt.params]).clone()
    opt.zero_grad()
    return out


def _run(noise: str, out_dir: str, rank: int) -> dict:
    import torch.distributed.checkpoint as dcp

    model, opt, sampler = _build(noise, seed=7)
    it = iter(sampler)
    uninterrupted = [_step(opt, it) for _ in range(CUT)]
    saved = {"model": model.state_dict(), "optim": opt.state_dict(), "sampler": sampler.state_dict()}
    own_generator = saved["optim"]["noise"][f"rank{rank}"]["generator_state"].clone()
    dcp.save(saved, checkpoint_id=f"{out_dir}/{noise}")
    uninterrupted += [_step(opt, it) for _ in range(STEPS - CUT)]

    model, opt, sampler = _build(noise, seed=123)  # fresh: another seed, no steps, no buffers yet
    template = {"model": model.state_dict(), "optim": opt.state_dict(), "sampler": sampler.state_dict()}
    # the wrapped optimizer's momentum is created lazily: give the template its buffers
    template["optim"]["optimizer"]["state"] = {
        i: {"momentum_buffer": torch.zeros_like(p)} for i, p in enumerate(opt.params)
    }
    dcp.load(template, checkpoint_id=f"{out_dir}/{noise}")
    model.load_state_dict(template["model"])
    sampler.load_state_dict(template["sampler"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the seeded generator's replay warning: expected here
        opt.load_state_dict(template["optim"])
    it = iter(sampler)
    resumed = [_step(opt, it) for _ in range(STEPS - CUT)]
    loaded_generator = template["optim"]["noise"][f"rank{rank}"]["generator_state"]
    return {
        "uninterrupted": torch.stack(uninterrupted[CUT:]),
        "resumed": torch.stack(resumed),
        "own_generator_loaded": torch.equal(loaded_generator, own_generator),
        "steps": opt.steps,
        "accounted": opt.accountant.epsilon(1e-5),
        "state": opt.state_dict(),
    }


def _another_ranks(rank: int, state: dict) -> str:
    """Rank r loads a state dict whose rank-local parts hold only the other rank's entry."""
    _, opt, _ = _build("banded", seed=123)
    other = {k: ({f"rank{1 - rank}": next(iter(v.values()))} if k in ("noise", "noise_stream") else v)
             for k, v in state.items()}  # fmt: skip
    try:
        opt.load_state_dict(other)
    except InvalidHyperparameterError as err:
        return f"{err} | steps after: {opt.steps}"
    return "loaded"


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    with gloo_group(rank, WORLD, init_file):
        result = {noise: _run(noise, out_dir, rank) for noise in ("banded", "independent")}
        result["another_ranks"] = _another_ranks(rank, result["banded"]["state"])
    torch.save(result, f"{out_dir}/rank{rank}.pt")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return spawn_ranks(_worker, tmp_path_factory.mktemp("dcp"), WORLD)


@pytest.mark.parametrize("noise", ["banded", "independent"])
def test_a_dcp_checkpoint_resumes_bit_for_bit(ranks, noise):
    for rank in range(WORLD):
        got = ranks[rank][noise]
        assert got["own_generator_loaded"]  # each rank's own generator, not a "replicated" copy
        torch.testing.assert_close(got["resumed"], got["uninterrupted"], rtol=0, atol=0)
        assert got["steps"] == STEPS
    # negative control: the releases after the cut are not the first ones again (no replay)
    assert not torch.equal(ranks[0][noise]["resumed"][0], ranks[0][noise]["uninterrupted"][-1])


def test_the_rank_local_parts_are_keyed_by_rank(ranks):
    for rank in range(WORLD):
        state = ranks[rank]["banded"]["state"]
        assert list(state["noise"]) == [f"rank{rank}"] and list(state["noise_stream"]) == [f"rank{rank}"]
        stream = state["noise_stream"][f"rank{rank}"]
        assert stream["buffers_used"] == BANDS - 1 and len(stream["buffers"]) == BANDS - 1


def test_another_ranks_parts_are_refused_and_nothing_changes(ranks):
    for rank in range(WORLD):
        message = ranks[rank]["another_ranks"]
        assert f"rank{1 - rank}, not of rank {rank}" in message and message.endswith("steps after: 0")
