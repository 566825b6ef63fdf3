"""FSDP2 (``torch.distributed.fsdp.fully_shard``) with ``distributed=True``: two CPU processes on gloo.

Each rank holds the shards of the parameters (uneven dim-0 shards, and an empty one: the last
layer has one output) and clips its own half of the batch; the per-example norms are those of the
full parameters, the clipped sums are all-reduced with rank 0's noise, and each rank writes its
shard of the one release into ``p.grad``. So with σ = 0 training equals a single process on the
union of the ranks' batches (flat clipping and ``AdaClip()``, ghost/auto and materialised paths, a
small transformer block), with σ > 0 it equals a single process seeded like rank 0 (the noise is
added once: rank 1's seed plays no part), and every rank's accountant records one step per step.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _gloo import gloo_group, spawn_ranks
from torch import nn

from adaclip.accounting import Accountant
from adaclip.errors import InvalidHyperparameterError
from adaclip_torch import AdaClip, FlatClip
from adaclip_torch.data import CyclicPoissonBatchSampler, FixedOrderBatchSampler

pytestmark = pytest.mark.torch
WORLD, STEPS, BATCH, Q, SEED = 2, 3, 8, 0.25, 7
TOL = dict(rtol=1e-11, atol=1e-12)  # float64: only the order of the sums differs

# name -> (model, strategy, per_sample_mode, σ, accumulate). The wrapped optimizer is plain SGD:
# with a stateful one (momentum, Adam) over DTensors, torch 2.13's DTensor caches (redistribute
# planner, mesh topology) keep the device mesh, hence the process group, alive for good, and the
# worker's check that destroy_process_group() freed it could not pass.
CASES = {
    "flat-auto": ("mlp", "flat", "auto", 0.0, False),
    "flat-materialise": ("mlp", "flat", "materialise", 0.0, False),
    "flat-ghost": ("mlp", "flat", "ghost", 0.0, False),
    "adaclip-auto": ("mlp", "adaclip", "auto", 0.0, False),
    "adaclip-materialise": ("mlp", "adaclip", "materialise", 0.0, False),
    "block-adaclip-auto": ("block", "adaclip", "auto", 0.0, False),
    "flat-accumulate": ("mlp", "flat", "materialise", 0.0, True),
    "flat-noise": ("mlp", "flat", "auto", 1.0, False),
    "adaclip-noise": ("mlp", "adaclip", "materialise", 1.0, False),
}


class Block(nn.Module):
    """Embedding, one transformer encoder layer (attention on the torch.func fallback), a head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(self.emb(ids)).mean(1))


def _model(kind: str, fsdp: bool) -> nn.Module:
    torch.manual_seed(0)
    if kind == "block":
        model = Block().double()
        blocks = [model.layer]
    else:  # dim-0 sizes 5, 3, 1: uneven shards, and rank 1 holds nothing of the last layer
        model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3), nn.Tanh(), nn.Linear(3, 1)).double()
        blocks = [m for m in model if isinstance(m, nn.Linear)]
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        for block in blocks:
            fully_shard(block, mesh=_cpu_mesh())
        fully_shard(model, mesh=_cpu_mesh())
    return model


def _cpu_mesh():
    """The ranks' mesh on the CPU: without it fully_shard picks CUDA where a GPU is visible,
    and moves the parameters there while these tests' batches stay on the CPU (gloo)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),))


def _loss(kind: str, model: nn.Module, t: int, rank: int, world: int, part: slice = slice(None)) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + t)
    if kind == "block":
        x, y = torch.randint(0, 11, (BATCH, 5), generator=g), torch.randint(0, 3, (BATCH,), generator=g)
        return nn.functional.cross_entropy(model(x[rank::world][part]), y[rank::world][part])
    x, y = torch.randn(BATCH, 6, generator=g, dtype=torch.float64), torch.randn(BATCH, 1, generator=g, dtype=torch.float64)
    return nn.functional.mse_loss(model(x[rank::world][part]), y[rank::world][part])


def run(name: str, *, rank: int = 0, world: int = 1, fsdp: bool = False, seed: int = SEED) -> dict:
    """STEPS private steps of case ``name`` on this rank's share of each batch; the full
    parameters, the next step's scale, the accountant's record and the layout of ``p.grad``."""
    kind, strategy, mode, sigma, accumulate = CASES[name]
    model = _model(kind, fsdp)
    inner = torch.optim.SGD(model.parameters(), lr=0.5)
    accountant = Accountant()
    common = dict(noise_multiplier=sigma, expected_batch_size=float(BATCH), per_sample_mode=mode, seed=seed,
                  distributed=fsdp, accountant=accountant, sample_rate=Q)  # fmt: skip
    opt = (FlatClip(inner, model, max_grad_norm=0.05, **common) if strategy == "flat"
           else AdaClip(inner, model, max_grad_norm=0.05, **common))  # fmt: skip
    assert opt.fsdp is fsdp
    layout = None
    for t in range(STEPS):
        if accumulate:  # two physical batches per logical one, and no zero_grad: FSDP accumulates
            _loss(kind, model, t, rank, world, slice(0, 2)).backward()  # its raw gradients into p.grad
            opt.accumulate()
            _loss(kind, model, t, rank, world, slice(2, None)).backward()
            opt.step()
        else:
            _loss(kind, model, t, rank, world).backward()
            opt.step()
        if fsdp:
            layout = [(type(p.grad).__name__, tuple(p.grad.to_local().shape), tuple(p.to_local().shape))
                      for p in opt.params]  # fmt: skip
        if not accumulate:
            opt.zero_grad()
    # with FSDP2 this rank's shards (unpadded, dim 0), put together by _full across the ranks
    params = [(p.to_local() if fsdp else p).detach().clone() for p in model.parameters()]
    _, scale = opt.centre_and_scale()
    return {"params": params, "scale": scale, "steps": accountant.steps,
            "history": [tuple(r) for r in accountant.history], "layout": layout}  # fmt: skip


def _refusals() -> dict[str, str]:
    """The messages of what FSDP2 refuses (collectives-free: raised before any hook or step)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    def message(build) -> str:
        try:
            build()
        except InvalidHyperparameterError as e:
            return str(e)
        return "<accepted>"

    def wrap(model, **kwargs):
        kwargs.setdefault("distributed", True)
        return FlatClip(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=1.0,
                        expected_batch_size=4.0, **kwargs)  # fmt: skip

    sharded = _model("mlp", fsdp=True)
    sampler = CyclicPoissonBatchSampler(16, Q, 2, num_steps=4, generator=torch.Generator().manual_seed(1))
    mixed = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3))
    fully_shard(mixed[0], mesh=_cpu_mesh())  # the root is not sharded: mixed[1] stays a plain tensor
    placed = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3))
    fully_shard(placed, mesh=_cpu_mesh(), shard_placement_fn=lambda p: Shard(1) if p.ndim == 2 else Shard(0))
    del sampler
    out = {
        "not_distributed": message(lambda: wrap(sharded, distributed=False)),
        "mixed": message(lambda: wrap(mixed)),
        "placement": message(lambda: wrap(placed)),
    }
    wrap(sharded)  # none of the refusals left hooks attached to the model
    return out


BANDS = 2


def run_banded(sigma: float, sharding: str, *, rank: int = 0, world: int = 1, fsdp: bool = False,
               seed: int = SEED, noise: str = "banded") -> dict:  # fmt: skip
    """STEPS steps of flat clipping with banded noise (b = 2; ``noise="blt"``: BLT noise with 2
    buffers over fixed-order batches) and an EMA of the parameters (decay 0.5): this rank's
    parameter shards and averaged shards, and the noise buffers it holds."""
    model = _model("mlp", fsdp)
    if noise == "blt":
        sampler = FixedOrderBatchSampler(16, 4, generator=torch.Generator().manual_seed(1), total_steps=STEPS)
        mechanism = {"noise_mechanism": "blt", "buffers": 2}
    else:
        sampler = CyclicPoissonBatchSampler(16, Q, BANDS, num_steps=STEPS, generator=torch.Generator().manual_seed(1))
        mechanism = {"noise_mechanism": "banded", "bands": BANDS}
    opt = FlatClip(torch.optim.SGD(model.parameters(), lr=0.5), model, max_grad_norm=0.05, noise_multiplier=sigma,
                   expected_batch_size=float(BATCH), seed=seed, distributed=fsdp, sample_rate=Q,
                   sampler=sampler, averaging=0.5, **mechanism,
                   **({"noise_sharding": sharding} if fsdp else {}))  # fmt: skip
    draws = iter(sampler)
    for t in range(STEPS):
        next(draws)
        _loss("mlp", model, t, rank, world).backward()
        opt.step()
        opt.zero_grad()
    params = [(p.to_local() if fsdp else p).detach().clone() for p in model.parameters()]
    averaged = list(opt.average.averaged_parameters().values())
    with opt.averaged():
        swapped = [(p.to_local() if fsdp else p).detach().clone() for p in model.parameters()]
    buffers = [[tuple(t.shape) for t in x] for x in opt._stream._state.history]
    return {"params": params, "averaged": averaged, "swapped": swapped, "buffers": buffers,
            "mode": getattr(opt, "noise_sharding", None)}  # fmt: skip


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    with gloo_group(rank, WORLD, init_file, dtensor=True):
        seed = SEED if rank == 0 else 1000 + rank  # only rank 0's generator may matter
        result = {name: run(name, rank=rank, world=WORLD, fsdp=True, seed=seed) for name in CASES}
        result["banded"] = {
            (sigma, sharding): run_banded(sigma, sharding, rank=rank, world=WORLD, fsdp=True, seed=seed)
            for sigma, sharding in ((0.0, "auto"), (1.0, "rank0"), (1.0, "auto"))
        }
        result["blt"] = {
            (sigma, sharding): run_banded(sigma, sharding, rank=rank, world=WORLD, fsdp=True, seed=seed, noise="blt")
            for sigma, sharding in ((0.0, "auto"), (1.0, "rank0"), (1.0, "auto"))
        }
        result["refusals"] = _refusals()
        torch.save(result, f"{out_dir}/rank{rank}.pt")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return spawn_ranks(_worker, tmp_path_factory.mktemp("fsdp"), WORLD)


def _full(ranks: list[dict], name: str) -> list[torch.Tensor]:
    """The full parameters of case ``name``: the ranks' dim-0 shards, concatenated."""
    return [torch.cat(shards) for shards in zip(*(r[name]["params"] for r in ranks), strict=True)]


def _assert_same_training(ranks: list[dict], name: str, want: dict) -> None:
    for a, b in zip(_full(ranks, name), want["params"], strict=True):
        torch.testing.assert_close(a, b, **TOL)
    for r in ranks:  # the next step's scale: full size, the same on every rank
        for a, b in zip(r[name]["scale"], want["scale"], strict=True):
            torch.testing.assert_close(a, b, **TOL)
    for a, b in zip(ranks[0][name]["scale"], ranks[1][name]["scale"], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c[3] == 0.0])
def test_sigma_zero_equals_one_process_on_the_union(ranks, name):
    single = run(name)
    moved = max(float((p - q).abs().max()) for p, q in zip(single["params"], _initial(name), strict=True))
    assert moved > 1e-3  # the steps did something
    _assert_same_training(ranks, name, single)


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c[3] > 0.0])
def test_noise_is_added_once_by_rank_zero(ranks, name):
    single = run(name, seed=SEED)
    # one draw, rank 0's: rank 1's generator (another seed) played no part
    _assert_same_training(ranks, name, single)
    other = run(name, seed=SEED + 1)  # negative control: the noise is visible in the parameters
    assert max(float((p - q).abs().max()) for p, q in zip(single["params"], other["params"], strict=True)) > 1e-3


def _initial(name: str) -> list[torch.Tensor]:
    return [p.detach().clone() for p in _model(CASES[name][0], fsdp=False).parameters()]


@pytest.mark.parametrize("name", ["flat-noise", "adaclip-noise", "flat-auto"])
def test_each_rank_accounts_one_step_per_step(ranks, name):
    single = run(name)
    for r in ranks:
        assert r[name]["steps"] == STEPS
        assert r[name]["history"] == single["history"] == [(Q, CASES[name][3], STEPS)]


def test_each_rank_writes_its_own_unpadded_shard_into_grad(ranks):
    # dim-0 sizes 5, 3, 1 split as torch.chunk does: 3/2, 2/1, 1/0
    want = {0: [3, 3, 2, 2, 1, 1], 1: [2, 2, 1, 1, 0, 0]}
    for rank, r in enumerate(ranks):
        for name in ("flat-auto", "flat-materialise", "adaclip-noise"):
            layout = r[name]["layout"]
            assert [kind for kind, _, _ in layout] == ["DTensor"] * 6
            assert all(grad == local for _, grad, local in layout)
            assert [grad[0] for _, grad, _ in layout] == want[rank]


def test_refusals_name_the_way_out(ranks):
    for r in ranks:
        msg = r["refusals"]
        assert "pass distributed=True" in msg["not_distributed"]
        assert "mixed sharding" in msg["mixed"] and "fully_shard to the root" in msg["mixed"]
        assert "Shard(dim=1)" in msg["placement"] and "Shard(0) on a one-dimensional mesh" in msg["placement"]


def test_fsdp1_is_refused_naming_fully_shard(monkeypatch):
    # FSDP1 cannot be built on a CPU-only machine; stand in a module class for it
    import torch.distributed.fsdp as fsdp

    class FakeFSDP1(nn.Linear):
        pass

    monkeypatch.setattr(fsdp, "FullyShardedDataParallel", FakeFSDP1)
    model = nn.Sequential(FakeFSDP1(3, 2))
    with pytest.raises(InvalidHyperparameterError, match="FullyShardedDataParallel.*fully_shard"):
        FlatClip(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=1.0, expected_batch_size=4.0)
    monkeypatch.undo()  # the refusal attached nothing: the same model can be wrapped
    FlatClip(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=1.0, expected_batch_size=4.0)


@pytest.mark.parametrize("noise", ["banded", "blt"])
def test_banded_noise_and_averaging_with_fsdp2(ranks, noise):
    """Banded noise and an EMA with sharded parameters. σ = 0: one process on the union of the
    batches, parameters and average alike (each rank averages its own shards). σ = 1 with
    noise_sharding="rank0": one process seeded like rank 0. σ = 1 by default: the noise state is
    sharded too, each rank holding (b − 1)·d/R buffer numbers, and the run differs from rank 0's
    stream (the negative control: the default does not quietly draw everything on rank 0)."""
    d = 6 * 5 + 5 + 5 * 3 + 3 + 3 * 1 + 1
    for (sigma, sharding), shards in ((key, [r[noise][key] for r in ranks]) for key in ranks[0][noise]):
        want = run_banded(sigma, sharding, noise=noise)
        full = [torch.cat(parts) for parts in zip(*(r["params"] for r in shards), strict=True)]
        averaged = [torch.cat(parts) for parts in zip(*(r["averaged"] for r in shards), strict=True)]
        swapped = [torch.cat(parts) for parts in zip(*(r["swapped"] for r in shards), strict=True)]
        for a, b in zip(averaged, swapped, strict=True):
            assert torch.equal(a, b)  # averaged() swaps each rank's averaged shards in
        if sharding == "auto" and sigma > 0:
            assert all(r["mode"] == "sharded" for r in shards)
            count = BANDS - 1 if noise == "banded" else 2  # b − 1 buffers, or BLT's m
            assert [r["buffers"] for r in shards] == [[[(-(-d // WORLD),)]] * count, [[(d - -(-d // WORLD),)]] * count]
            assert not all(torch.allclose(a, b) for a, b in zip(full, want["params"], strict=True))
            continue
        for a, b in zip(full, want["params"], strict=True):
            torch.testing.assert_close(a, b, **TOL)
        for a, b in zip(averaged, want["averaged"], strict=True):
            torch.testing.assert_close(a, b, **TOL)
        assert not all(torch.equal(a, b) for a, b in zip(full, averaged, strict=True))
