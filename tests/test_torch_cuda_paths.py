"""Paths that need a GPU: banded correlated noise with its buffers on CUDA, and FSDP2 on NCCL.

Skipped without CUDA (the CPU versions are in test_torch_correlated_noise.py and
test_torch_fsdp.py). On a GPU: the banded release on CUDA is the reference banded noise on the
draws the optimizer's generator makes there, with the stream's buffers on the device; and one
NCCL process with ``fully_shard`` and ``distributed=True`` trains as the same optimizer without
FSDP (σ = 0), and adds noise (σ > 0) accounted once per step.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from adaclip.accounting import Accountant
from adaclip.correlated import BandedNoise
from adaclip_torch import AdaClip, FlatClip
from adaclip_torch.data import CyclicPoissonBatchSampler
from adaclip_torch.noise import NoiseSource

pytestmark = [
    pytest.mark.torch,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
N, Q, BANDS = 40, 0.1, 4


def _sqrt_coefficients(b: int) -> np.ndarray:
    import math

    c = np.array([math.comb(2 * k, k) / 4**k for k in range(b)])
    return c / np.linalg.norm(c)


def test_banded_release_on_cuda_is_the_reference_on_the_same_draws():
    model = nn.Linear(6, 5, bias=False).cuda()
    nn.init.zeros_(model.weight)
    sampler = CyclicPoissonBatchSampler(N, Q, BANDS, generator=torch.Generator().manual_seed(2))
    opt = FlatClip(torch.optim.SGD(model.parameters(), lr=1.0), model, noise_multiplier=1.3, max_grad_norm=1.0,
                   expected_batch_size=N * Q, sample_rate=Q, seed=7, sampler=sampler,
                   noise_mechanism=BandedNoise(_sqrt_coefficients(BANDS)))  # fmt: skip
    got = []
    batches = iter(sampler)
    for _ in range(10):
        try:
            idx = next(batches)
        except StopIteration:
            batches = iter(sampler)
            idx = next(batches)
        (0.0 * model(torch.randn(len(idx), 6, device="cuda"))).sum().backward()
        opt.step()
        assert model.weight.grad.is_cuda
        got.append(model.weight.grad.detach().cpu().numpy().copy())
        opt.zero_grad()
    history = [t for past in opt._stream._state.history for t in past]  # the secret buffers
    source = NoiseSource(seed=7)
    like = [torch.zeros(5, 6, device="cuda")]
    mech = BandedNoise(_sqrt_coefficients(BANDS))
    state = mech.init()
    for t in range(10):
        z = source.standard_normal(like)[0].cpu().numpy().astype(np.float64)
        x, state = mech.correlate(state, [z])
        np.testing.assert_allclose(got[t], 1.3 * x[0] / (N * Q), rtol=1e-5, atol=1e-6)
    assert len(history) == BANDS - 1 and all(t.is_cuda for t in history)


def _fsdp_worker(rank: int, init_file: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=0, world_size=1)
    torch.cuda.set_device(0)
    results = {}
    try:
        for name, sigma, fsdp, cls in [("flat", 0.0, True, FlatClip), ("flat", 0.0, False, FlatClip),
                                       ("adaclip", 0.0, True, AdaClip), ("adaclip", 0.0, False, AdaClip),
                                       ("noise", 1.0, True, FlatClip)]:  # fmt: skip
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 1)).cuda()
            if fsdp:
                fully_shard(model[0])
                fully_shard(model)
            accountant = Accountant()
            opt = cls(torch.optim.SGD(model.parameters(), lr=0.5), model, noise_multiplier=sigma,
                      max_grad_norm=0.05, expected_batch_size=8.0, seed=3, distributed=fsdp,
                      accountant=accountant, sample_rate=0.25)  # fmt: skip
            assert opt.fsdp is fsdp
            g = torch.Generator().manual_seed(1)
            for _ in range(3):
                x, y = torch.randn(8, 6, generator=g).cuda(), torch.randn(8, 1, generator=g).cuda()
                nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad()
            params = [(p.full_tensor() if fsdp else p).detach().cpu() for p in model.parameters()]
            results[(name, sigma, fsdp)] = (params, accountant.steps)
    finally:
        dist.destroy_process_group()
    torch.save(results, out)


def test_fsdp2_on_nccl_trains_as_without_fsdp(tmp_path):
    out = str(tmp_path / "out.pt")
    mp.spawn(_fsdp_worker, args=(str(tmp_path / "init"), out), nprocs=1, join=True)
    results = torch.load(out, weights_only=False)
    for name in ("flat", "adaclip"):
        sharded, plain = results[(name, 0.0, True)], results[(name, 0.0, False)]
        for a, b in zip(sharded[0], plain[0], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert sharded[1] == plain[1] == 3
    noisy, plain = results[("noise", 1.0, True)], results[("flat", 0.0, True)]
    assert noisy[1] == 3
    assert any(not torch.allclose(a, b) for a, b in zip(noisy[0], plain[0], strict=True))


def test_os_seeded_noise_is_drawn_on_the_device_and_is_standard_normal():
    from scipy import stats

    source = NoiseSource()  # OS-seeded: the device's own generator
    like = [torch.zeros(200_000, device="cuda")]
    (z,) = source.standard_normal(like)
    assert z.is_cuda and list(source._device_generators) == [torch.device("cuda", torch.cuda.current_device())]
    x = z.double().cpu().numpy()
    assert stats.kstest(x, stats.norm.cdf).pvalue > 1e-3
    # negative control: the same test sees σ = 1.02
    assert stats.kstest(1.02 * x, stats.norm.cdf).pvalue < 1e-3
    (z2,) = source.standard_normal(like)
    assert not torch.equal(z, z2)  # a draw is never reused


def test_os_seeded_device_generator_rewinds_on_a_failed_step_and_reseeds_on_restore():
    source = NoiseSource()
    like = [torch.zeros(1000, device="cuda")]
    source.standard_normal(like)
    snap = source.snapshot()
    (a,) = source.standard_normal(like)
    source.restore(snap)
    (b,) = source.standard_normal(like)
    assert torch.equal(a, b)  # the undone draw was never released: the same draw is made again
    state = source.state_dict()
    assert "generator_state" not in state
    source.load_state_dict(state)  # OS mode: fresh generators, no replay
    (c,) = source.standard_normal(like)
    assert not torch.equal(b, c)


def test_seeded_noise_on_cuda_is_the_cpu_stream():
    like_gpu, like_cpu = [torch.zeros(3, 4, device="cuda")], [torch.zeros(3, 4)]
    (g,) = NoiseSource(seed=5).standard_normal(like_gpu)
    (c,) = NoiseSource(seed=5).standard_normal(like_cpu)
    assert g.is_cuda and torch.equal(g.cpu(), c)
