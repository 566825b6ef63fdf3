"""make_private with distributed=True, two CPU processes on gloo: each rank samples its own fixed
shard of the training set at q = R·B/N, so every example joins a step at most once (before, every
rank Poisson-sampled the whole data set at B/N: an example could join both ranks' batches of one
step, a sensitivity of up to R·C, while the accountant assumed C at B/N)."""

from __future__ import annotations

import pytest
import torch
from _gloo import gloo_group, spawn_ranks
from torch import nn
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from adaclip.errors import InvalidHyperparameterError
from adaclip_torch.privacy import make_private

WORLD, N, B = 2, 64, 4  # per-rank batch 4: q = 2·4/64 = 1/8


class _Indexed(Dataset):
    def __init__(self, size: int = N) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int):
        return torch.full((3,), float(i)), torch.tensor(i)


def _run(loader: DataLoader, **kw) -> dict:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    model, opt, private_loader = make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.01), loader, max_grad_norm=1.0, seed=0,
        distributed=True, **kw,
    )  # fmt: skip
    steps = []
    for _ in range(3):
        for x, idx in private_loader:
            nn.functional.cross_entropy(model(x), idx % 2).backward() if len(x) else None
            opt.step(empty_batch=len(x) == 0)
            opt.zero_grad()
            steps.append(idx.tolist())
    return {
        "steps": steps, "q": opt.sample_rate, "expected_batch_size": opt.expected_batch_size,
        "shard": private_loader.batch_sampler.indices.tolist(), "accounted": opt.accountant.steps,
        "params": [p.detach().clone() for p in model.parameters()], "epsilon": opt.accountant.epsilon(1e-3),
        "sharding": opt.noise_sharding, "buffers": [[tuple(t.shape) for t in x] for x in opt._stream._state.history]
        if opt._stream is not None else None,
    }  # fmt: skip


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    with gloo_group(rank, WORLD, init_file):
        out = {
            "independent": _run(DataLoader(_Indexed(), batch_size=B, shuffle=True), noise_multiplier=1.0),
            "banded": _run(DataLoader(_Indexed(), batch_size=B, shuffle=True), target_epsilon=3.0, delta=1e-3,
                           epochs=3, noise_mechanism="banded", bands=2),
            "distributed_sampler": _run(
                DataLoader(_Indexed(), batch_size=B, sampler=DistributedSampler(_Indexed(), WORLD, rank)),
                noise_multiplier=1.0,
            ),
        }
        # BLT: N = 63 (not divisible by 2): each rank keeps ⌊63/2⌋ = 31 units in 8 fixed batches
        out["blt"] = _run(DataLoader(_Indexed(N - 1), batch_size=B, shuffle=True), target_epsilon=8.0, delta=1e-3,
                          epochs=3, noise_mechanism="blt")  # fmt: skip
        for name, kw in {"too_large_batch": dict(noise_multiplier=1.0)}.items():
            try:
                _run(DataLoader(_Indexed(), batch_size=40, shuffle=True), **kw)
                out[name] = None
            except InvalidHyperparameterError as err:
                out[name] = str(err)
        torch.save(out, f"{out_dir}/rank{rank}.pt")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return spawn_ranks(_worker, tmp_path_factory.mktemp("make_private_ddp"), WORLD)


@pytest.mark.parametrize("case", ["independent", "banded", "distributed_sampler"])
def test_each_rank_samples_its_own_fixed_shard(ranks, case):
    shards = [set(r[case]["shard"]) for r in ranks]
    assert not shards[0] & shards[1] and shards[0] | shards[1] == set(range(N))
    for r, shard in zip(ranks, shards, strict=True):
        seen = {i for step in r[case]["steps"] for i in step}
        assert seen and seen <= shard  # nothing outside the rank's shard, ever


@pytest.mark.parametrize("case", ["independent", "banded", "distributed_sampler"])
def test_no_example_joins_two_ranks_batches_in_one_step(ranks, case):
    a, b = (r[case]["steps"] for r in ranks)
    assert len(a) == len(b)  # the ranks step together (the release is a collective)
    assert all(not set(x) & set(y) for x, y in zip(a, b, strict=True))
    assert sum(len(x) + len(y) for x, y in zip(a, b, strict=True)) > 0


@pytest.mark.parametrize("case", ["independent", "banded", "distributed_sampler"])
def test_the_accounting_is_the_whole_runs(ranks, case):
    for r in ranks:
        assert r[case]["q"] == pytest.approx(WORLD * B / N)
        assert r[case]["expected_batch_size"] == pytest.approx(WORLD * B)
    assert ranks[0][case]["accounted"] == ranks[1][case]["accounted"] > 0
    for p, q in zip(ranks[0][case]["params"], ranks[1][case]["params"], strict=True):
        assert torch.equal(p, q)  # one release, applied by every rank


def test_banded_groups_are_drawn_per_rank_and_steps_follow_the_cycle(ranks):
    """With b = 2 each rank's cyclic sampler draws its own group assignment: a unit's two
    participations in the run are at least 2 steps apart on its rank."""
    for r in ranks:
        last: dict[int, int] = {}
        for t, step in enumerate(r["banded"]["steps"]):
            for i in step:
                assert t - last.get(i, -10) >= 2
                last[i] = t


def test_what_make_private_cannot_shard_is_refused(ranks):
    for r in ranks:
        assert "lower the per-rank batch size" in r["too_large_batch"]


def test_blt_noise_across_ranks_cuts_equal_shards_into_the_same_fixed_batches(ranks):
    """BLT with distributed=True: N = 63 on two ranks, per-rank batch 4. Each rank keeps
    ⌊63/2⌋ = 31 units of its shard (the 63rd is left out) in ⌈31/4⌉ = 8 fixed batches; over 3
    epochs (24 steps) every kept unit joins exactly one batch an epoch, at steps exactly 8 apart,
    on its own rank; the ranks' batches are disjoint; the global batch is 8 and the accountants
    agree and stay within ε = 8; the noise state is sharded (m buffers of ⌈d/2⌉ = 4 numbers)."""
    shards = [set(r["blt"]["shard"]) for r in ranks]
    assert not shards[0] & shards[1] and len(shards[0]) == len(shards[1]) == 31
    for r, shard in zip(ranks, shards, strict=True):
        steps = r["blt"]["steps"]
        assert len(steps) == 24 and r["blt"]["accounted"] == 3  # one Gaussian event per block of 8 steps
        for unit in shard:
            where = [t for t, step in enumerate(steps) if unit in step]
            assert len(where) == 3 and where[1] - where[0] == where[2] - where[1] == 8
        assert {i for step in steps for i in step} == shard
        assert r["blt"]["expected_batch_size"] == WORLD * B
        assert r["blt"]["sharding"] == "sharded" and r["blt"]["buffers"] and all(
            x == [(4,)] for x in r["blt"]["buffers"]
        )
    a, b = (r["blt"]["steps"] for r in ranks)
    assert all(not set(x) & set(y) for x, y in zip(a, b, strict=True))
    assert ranks[0]["blt"]["epsilon"] == ranks[1]["blt"]["epsilon"] <= 8.0 + 1e-9
    for p, q in zip(ranks[0]["blt"]["params"], ranks[1]["blt"]["params"], strict=True):
        assert torch.equal(p, q)  # one release, applied by every rank


def test_distributed_without_a_process_group_is_refused():
    model = nn.Linear(3, 2)
    with pytest.raises(InvalidHyperparameterError, match="init_process_group"):
        make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(_Indexed(), batch_size=B),
                     noise_multiplier=1.0, distributed=True)  # fmt: skip


def test_a_distributed_sampler_without_distributed_true_is_refused():
    model = nn.Linear(3, 2)
    loader = DataLoader(_Indexed(), batch_size=B, sampler=DistributedSampler(_Indexed(), 2, 0))
    with pytest.raises(InvalidHyperparameterError, match="distributed=True to make_private"):
        make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), loader, noise_multiplier=1.0)
