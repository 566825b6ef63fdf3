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
import torch.distributed as dist
from _gloo import gloo_group, spawn_ranks
from torch import nn

from adaclip.errors import InvalidHyperparameterError
from adaclip_torch import AdaClip, FlatClip
from adaclip_torch.data import CyclicPoissonBatchSampler, FixedOrderBatchSampler

pytestmark = pytest.mark.torch
WORLD, BANDS, STEPS, Q = 2, 3, 5, 0.25
BLT_BUFFERS = 2


def _build(kind: str, seed: int, distributed: bool, sharding: str = "rank0", noise: str = "banded"):
    torch.manual_seed(0)
    model = nn.Linear(6, 4)
    if noise == "blt":  # 4 fixed batches of 4 units an epoch, 2 buffers
        sampler = FixedOrderBatchSampler(16, 4, generator=torch.Generator().manual_seed(1), total_steps=STEPS)
        mechanism = dict(noise_mechanism="blt", buffers=BLT_BUFFERS)
    else:
        sampler = CyclicPoissonBatchSampler(16, Q, BANDS, num_steps=STEPS, generator=torch.Generator().manual_seed(1))
        mechanism = dict(noise_mechanism="banded", bands=BANDS)
    common = dict(noise_multiplier=1.5, expected_batch_size=8.0, sample_rate=Q, seed=seed, attach_hooks=False,
                  sampler=sampler, distributed=distributed, **mechanism)
    if distributed:
        common["noise_sharding"] = sharding
    inner = torch.optim.SGD(model.parameters(), lr=0.0)
    if kind == "flat":
        opt = FlatClip(inner, model, max_grad_norm=1.0, **common)
    else:
        opt = AdaClip(inner, model, std_min=1e-3, std_max=2.0, preset="patent", **common)
    return model, opt, sampler


def releases(kind: str, seed: int, distributed: bool, rank: int = 0, sharding: str = "rank0", keep=None,
             noise: str = "banded"):  # fmt: skip
    """STEPS noise-only releases (every rank's clipped sum is 0) and the final AdaCliP std;
    ``keep`` (a dict) receives the optimizer."""
    model, opt, sampler = _build(kind, seed, distributed, sharding, noise)
    if keep is not None:
        keep["opt"] = opt
    out, it = [], iter(sampler)
    for _ in range(STEPS):
        if next(it, None) is None:  # fixed order: the next epoch's pass
            it = iter(sampler)
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
        kept: dict = {}
        result["sharded"] = releases("flat", seed=7, distributed=True, rank=rank, sharding="auto", keep=kept)
        opt = kept["opt"]
        result["shard"] = tuple(opt._stream.shard)
        result["buffers"] = [[tuple(t.shape) for t in x] for x in opt._stream._state.history]
        result["state"] = opt.state_dict()
        result["mode"] = opt.noise_sharding
        result["coefficients"] = opt._stream.mechanism.coefficients
        result["summary"] = opt.summary()
        kept = {}
        result["blt"] = releases("flat", seed=7, distributed=True, rank=rank, sharding="auto", keep=kept, noise="blt")
        result["blt_buffers"] = [[tuple(t.shape) for t in x] for x in kept["opt"]._stream._state.history]
        result["blt_mechanism"] = (kept["opt"]._stream.mechanism.theta, kept["opt"]._stream.mechanism.omega)
        result["blt_mode"] = kept["opt"].noise_sharding
        result["blt_uneven"] = _uneven_blt_schedule(rank)
        # a rank's own seeded checkpoint loads back; another rank's is refused (its generator and
        # buffers would draw that rank's noise a second time), and nothing changes
        _, fresh, _ = _build("flat", 7, True, "auto")
        fresh.load_state_dict(result["state"])
        torch.save(result["state"], f"{out_dir}/state{rank}.pt")
        dist.barrier()
        other = torch.load(f"{out_dir}/state{1 - rank}.pt", weights_only=False)
        _, target, _ = _build("flat", 7, True, "auto")
        try:
            target.load_state_dict(other)
            result["other_rank_state"] = "loaded"
        except InvalidHyperparameterError as err:
            result["other_rank_state"] = str(err)
        result["after_refusal_steps"] = target.steps
        result["resumed"] = _resumed_at(2, rank)
        result["audit"] = _noise_audit(rank)
        torch.save(result, f"{out_dir}/rank{rank}.pt")


def _uneven_blt_schedule(rank: int) -> str:
    """BLT with a different fixed-order schedule on each rank (rank 1: 2 batches an epoch, not
    4): every rank refuses it at construction (one all-gather), so no rank is left waiting."""
    torch.manual_seed(0)
    model = nn.Linear(6, 4)
    sampler = FixedOrderBatchSampler(16, 4 * (1 + rank), generator=torch.Generator().manual_seed(1),
                                     total_steps=STEPS)  # fmt: skip
    try:
        FlatClip(torch.optim.SGD(model.parameters(), lr=0.0), model, max_grad_norm=1.0, noise_multiplier=1.5,
                 expected_batch_size=8.0, sample_rate=sampler.sample_rate, attach_hooks=False, sampler=sampler,
                 noise_mechanism="blt", buffers=BLT_BUFFERS, distributed=True)  # fmt: skip
    except InvalidHyperparameterError as err:
        return str(err)
    return "built"


def _noise_audit(rank: int, steps: int = 48) -> dict:
    """A wide model (d = 2,050) with zero clipped sums for ``steps`` sharded releases: the
    released noise ``B̄·grad/σ`` and each step's per-coordinate variance ``v_t``."""
    torch.manual_seed(0)
    model = nn.Linear(40, 50)
    sampler = CyclicPoissonBatchSampler(64, Q, BANDS, num_steps=steps, generator=torch.Generator().manual_seed(1))
    opt = FlatClip(torch.optim.SGD(model.parameters(), lr=0.0), model, max_grad_norm=1.0, noise_multiplier=1.5,
                   expected_batch_size=8.0, sample_rate=Q, seed=None, attach_hooks=False, noise_mechanism="banded",
                   bands=BANDS, sampler=sampler, distributed=True)  # fmt: skip
    out, variances, it = [], [], iter(sampler)
    for _ in range(steps):
        next(it)
        for p in opt.params:
            p.grad_sample = torch.zeros((1, *p.shape))
        variances.append(opt._stream.variance())
        opt.step()
        out.append(torch.cat([p.grad.reshape(-1) for p in opt.params]) * 8.0 / 1.5)
        opt.zero_grad()
    return {"noise": torch.stack(out), "variances": torch.tensor(variances)}


def _resumed_at(cut: int, rank: int) -> torch.Tensor:
    """Sharded, seeded: run ``cut`` steps, save every rank's own optimizer and sampler state,
    build everything anew (another seed), load them and run the rest: the releases."""
    import warnings

    model, opt, sampler = _build("flat", 7, True, "auto")
    out, it = [], iter(sampler)
    for t in range(STEPS):
        if t == cut:
            saved, sampler_state = opt.state_dict(), sampler.state_dict()
            model, opt, sampler = _build("flat", 123, True, "auto")
            sampler.load_state_dict(sampler_state)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the seeded generator's replay warning: expected here
                opt.load_state_dict(saved)
            it = iter(sampler)
        next(it)
        for p in opt.params:
            p.grad_sample = torch.zeros((2, *p.shape))
        opt.step()
        out.append(torch.cat([p.grad.reshape(-1) for p in opt.params]).clone())
        opt.zero_grad()
    return torch.stack(out)


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


def test_sharded_noise_state_each_rank_draws_and_correlates_its_own_slice(ranks):
    """The default with banded noise: rank r owns coordinates [start_r, end_r) and its buffers
    hold only them. The release equals, slice by slice, the core's banded recursion
    (:meth:`adaclip.correlated.BandedNoise.correlate`) run on rank r's own stream (seeded with
    rank_seed(7, r)): every coordinate got one draw, from one owner, correlated with that
    owner's buffers. Both ranks release the same values."""
    from adaclip.correlated.mechanism import BandedNoise
    from adaclip_torch.distributed import noise_shard, rank_seed
    from adaclip_torch.noise import NoiseSource

    total = 6 * 4 + 4
    released = ranks[0]["sharded"][0]
    np.testing.assert_array_equal(ranks[1]["sharded"][0].numpy(), released.numpy())
    core = BandedNoise(ranks[0]["coefficients"])
    for rank in range(WORLD):
        out = ranks[rank]
        assert out["mode"] == "sharded" and "noise state sharded over 2 ranks" in out["summary"]
        shard = noise_shard(total, rank, WORLD)
        assert out["shard"] == tuple(shard) and shard.size == total // WORLD
        assert out["buffers"] == [[(shard.size,)]] * (BANDS - 1)  # (b − 1)·d/R numbers on this rank
        source, state = NoiseSource(seed=rank_seed(7, rank)), core.init()
        for t in range(STEPS):
            (x,), state = core.correlate(state, source.standard_normal([torch.zeros(shard.size)]))
            expected = 1.5 * x / 8.0  # σ·x/B̄ (flat clipping, zero clipped sums)
            np.testing.assert_allclose(released[t, shard.start : shard.end].numpy(), expected.numpy(), rtol=1e-5,
                                       atol=1e-7)  # fmt: skip
    # negative control: with one seed on both ranks the two slices would carry the same noise
    half = total // WORLD
    assert not np.allclose(released[:, :half].numpy(), released[:, half:].numpy())


def test_blt_noise_state_is_sharded_like_banded_noise(ranks):
    """BLT noise with distributed=True (the memory-light mechanism: m buffers whatever the
    horizon): rank r correlates its own slice with its own m buffers of ⌈d/R⌉ numbers, and the
    release equals, slice by slice, the core's BLT recursion
    (:meth:`adaclip.correlated.BltNoise.correlate`) on rank r's own stream."""
    from adaclip.correlated.blt import BltNoise
    from adaclip_torch.distributed import noise_shard, rank_seed
    from adaclip_torch.noise import NoiseSource

    total = 6 * 4 + 4
    released = ranks[0]["blt"][0]
    np.testing.assert_array_equal(ranks[1]["blt"][0].numpy(), released.numpy())
    for rank in range(WORLD):
        out = ranks[rank]
        assert out["blt_mode"] == "sharded"
        shard = noise_shard(total, rank, WORLD)
        assert out["blt_buffers"] == [[(shard.size,)]] * BLT_BUFFERS  # m·d/R numbers on this rank
        core = BltNoise(*out["blt_mechanism"])
        source, state = NoiseSource(seed=rank_seed(7, rank)), core.init()
        for t in range(STEPS):
            (x,), state = core.correlate(state, source.standard_normal([torch.zeros(shard.size)]))
            np.testing.assert_allclose(released[t, shard.start : shard.end].numpy(), (1.5 * x / 8.0).numpy(),
                                       rtol=1e-5, atol=1e-7)  # fmt: skip
    # negative control: the BLT's x_t is not its fresh draws from the second step on
    source = NoiseSource(seed=rank_seed(7, 0))
    fresh = torch.stack([source.standard_normal([torch.zeros(total // WORLD)])[0] for _ in range(STEPS)])
    assert np.allclose(released[0, : total // WORLD].numpy(), (1.5 * fresh[0] / 8.0).numpy(), rtol=1e-5)
    assert not np.allclose(released[1:, : total // WORLD].numpy(), (1.5 * fresh[1:] / 8.0).numpy(), rtol=1e-3)


def test_blt_with_different_schedules_on_the_ranks_is_refused_on_every_rank(ranks):
    for rank in range(WORLD):
        assert "same fixed-order schedule on every rank" in ranks[rank]["blt_uneven"]


def test_another_ranks_noise_state_is_refused(ranks):
    for rank in range(WORLD):
        message = ranks[rank]["other_rank_state"]
        assert "sharded noise state" in message and "its own state_dict" in message
        assert ranks[rank]["after_refusal_steps"] == 0


def test_the_buffer_budget_is_per_rank_under_sharded_noise_state():
    """make_private's choice of b keeps (b − 1)·d/R numbers per rank within the budget: a model
    whose buffers allow b = 2 (of the candidates 1, 2, 4, 8, …) on one rank allows b = 4 on four."""
    from adaclip.correlated.planning import BAND_CANDIDATES, candidate_bands
    from adaclip_torch.privacy import _buffer_bytes_per_band

    model = nn.Linear(100, 100)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    one, four = _buffer_bytes_per_band(opt), _buffer_bytes_per_band(opt, 4)
    assert one == 4 * (100 * 100 + 100) and four == -(-one // 4)
    budget = int(1.5 * one)
    pick = dict(sample_rate=0.01, steps=1000, buffer_budget_bytes=budget, candidates=BAND_CANDIDATES)
    assert max(candidate_bands(bytes_per_band=one, **pick)) == 2
    assert max(candidate_bands(bytes_per_band=four, **pick)) == 4  # (b − 1)·one/4 ≤ 1.5·one: b ≤ 7


def test_a_sharded_seeded_checkpoint_resumes_bit_for_bit(ranks):
    """Every rank restores its own state (generator and buffer slice) mid-cycle, into an
    optimizer built with another seed: the releases after the cut equal the uninterrupted run's."""
    for rank in range(WORLD):
        np.testing.assert_array_equal(ranks[rank]["resumed"].numpy(), ranks[rank]["sharded"][0].numpy())


def test_the_sharded_release_has_the_noise_the_accountant_assumes(ranks):
    """OS-seeded (the default), every coordinate's released noise, divided by σ·√v_t, is N(0, 1):
    a KS test over 48 steps × 2,050 coordinates, and their sample variance within 3 % of 1. The
    negative control: the same data as if σ/2 had been added (halved) is rejected by both."""
    from scipy import stats

    audit = ranks[0]["audit"]
    np.testing.assert_array_equal(audit["noise"].numpy(), ranks[1]["audit"]["noise"].numpy())
    z = (audit["noise"] / audit["variances"].sqrt()[:, None]).numpy().ravel()
    assert stats.kstest(z, "norm").pvalue > 1e-3 and abs(z.var() - 1.0) < 0.03
    half = z / 2
    assert stats.kstest(half, "norm").pvalue < 1e-6 and abs(half.var() - 1.0) > 0.5
