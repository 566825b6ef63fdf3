"""Paths that need a GPU: correlated noise with its buffers on CUDA, and FSDP2 on NCCL.

Skipped without CUDA (the CPU versions are in test_torch_correlated_noise.py, test_torch_blt.py and
test_torch_fsdp.py). On a GPU: the banded and BLT releases on CUDA are the reference noise on the
draws the optimizer's generator makes there, with the stream's buffers on the device (with the
quantile rule's count too, whose draw stays independent); ``make_private`` with Adam and banded
noise scales the learning rate and trains on the device; and one
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
from adaclip.correlated import BandedNoise, BltNoise
from adaclip.strategies import QuantileClipping, QuantileRule
from adaclip_torch import AdaClip, DPOptimizer, FlatClip
from adaclip_torch.data import CyclicPoissonBatchSampler, FixedOrderBatchSampler
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


def _zero_steps(opt, model, sampler, steps: int) -> tuple[list[np.ndarray], list[int], list[float]]:
    """Step ``steps`` times on zero gradients (the sampler's batches, pass after pass): each
    release's gradient (then the noise alone, ``C_t·σ_g·x_t/B̄``), each batch's size, and the
    clip norm after each step."""
    got, sizes, norms, batches = [], [], [], iter(sampler)
    for _ in range(steps):
        try:
            idx = next(batches)
        except StopIteration:
            batches = iter(sampler)
            idx = next(batches)
        sizes.append(len(idx))
        (0.0 * model(torch.randn(len(idx), 6, device="cuda"))).sum().backward()
        opt.step()
        assert model.weight.grad.is_cuda
        got.append(model.weight.grad.detach().cpu().numpy().copy())
        norms.append(float(opt.max_grad_norm))
        opt.zero_grad()
    return got, sizes, norms


def test_banded_release_on_cuda_is_the_reference_on_the_same_draws():
    model = nn.Linear(6, 5, bias=False).cuda()
    nn.init.zeros_(model.weight)
    sampler = CyclicPoissonBatchSampler(N, Q, BANDS, generator=torch.Generator().manual_seed(2))
    opt = FlatClip(torch.optim.SGD(model.parameters(), lr=1.0), model, noise_multiplier=1.3, max_grad_norm=1.0,
                   expected_batch_size=N * Q, sample_rate=Q, seed=7, sampler=sampler,
                   noise_mechanism=BandedNoise(_sqrt_coefficients(BANDS)))  # fmt: skip
    got, _, _ = _zero_steps(opt, model, sampler, 10)
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


def test_blt_release_on_cuda_is_the_reference_on_the_same_draws():
    theta, omega = (0.9, 0.4), (0.3, 0.2)
    model = nn.Linear(6, 5, bias=False).cuda()
    nn.init.zeros_(model.weight)
    sampler = FixedOrderBatchSampler(N, 8, generator=torch.Generator().manual_seed(2))
    opt = FlatClip(torch.optim.SGD(model.parameters(), lr=1.0), model, noise_multiplier=1.3, max_grad_norm=1.0,
                   expected_batch_size=8, sample_rate=8 / N, seed=7, sampler=sampler,
                   noise_mechanism=BltNoise(theta, omega))  # fmt: skip
    got, _, _ = _zero_steps(opt, model, sampler, 12)
    source, like = NoiseSource(seed=7), [torch.zeros(5, 6, device="cuda")]
    mech = BltNoise(theta, omega)
    state = mech.init()
    for t in range(12):
        z = source.standard_normal(like)[0].cpu().numpy().astype(np.float64)
        x, state = mech.correlate(state, [z])
        np.testing.assert_allclose(got[t], 1.3 * x[0] / 8, rtol=1e-5, atol=1e-6)
    assert all(t.is_cuda for past in opt._stream._state.history for t in past)


def test_quantile_rule_with_banded_noise_on_cuda_correlates_the_gradient_only():
    """The gradient's draws are correlated (reference banded noise on the same draws, σ_g of the
    rule's split, scaled by the step's clip norm C_t), the count's draw is independent: C_t
    follows the rule on ``count + σ_b·z``."""
    rule = QuantileRule(target_quantile=0.6, learning_rate=0.3, count_noise_multiplier=2.0)
    model = nn.Linear(6, 5, bias=False).cuda()
    nn.init.zeros_(model.weight)
    sampler = CyclicPoissonBatchSampler(N, Q, BANDS, generator=torch.Generator().manual_seed(2))
    batch = N * Q
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), model, strategy=QuantileClipping(1.0, rule),
                      noise_multiplier=1.3, expected_batch_size=batch, sample_rate=Q, seed=7, sampler=sampler,
                      noise_mechanism=BandedNoise(_sqrt_coefficients(BANDS)), use_kernel=False)  # fmt: skip
    sigma_g, sigma_b = rule.noise_multipliers(1.3, batch)
    got, sizes, norms = _zero_steps(opt, model, sampler, 10)
    source, like = NoiseSource(seed=7), [torch.zeros(5, 6, device="cuda"), torch.zeros((), device="cuda")]
    mech = BandedNoise(_sqrt_coefficients(BANDS))
    state, clip = mech.init(), 1.0
    for t in range(10):
        z, z_count = (d.cpu().numpy().astype(np.float64) for d in source.standard_normal(like))
        x, state = mech.correlate(state, [z])
        np.testing.assert_allclose(got[t], clip * sigma_g * x[0] / batch, rtol=1e-5, atol=1e-6)
        clip = rule.next_clip_norm(clip, 0.5 * sizes[t] + sigma_b * float(z_count), batch)  # zero gradients: all unclipped
        assert norms[t] == pytest.approx(float(clip), rel=1e-5)


def test_make_private_adam_with_banded_noise_scales_the_lr_and_trains_on_cuda():
    from torch.utils.data import DataLoader, TensorDataset

    from adaclip_torch import make_private

    torch.manual_seed(0)
    xs, ys = torch.randn(512, 6), torch.randint(0, 3, (512,))
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3)).cuda()
    inner = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, opt, loader = make_private(model, inner, DataLoader(TensorDataset(xs, ys), batch_size=32),
                                      target_epsilon=3.0, delta=1e-5, epochs=4, max_grad_norm=1.0,
                                      noise_mechanism="banded")  # fmt: skip
    assert len(opt.noise_coefficients) > 1 and opt.lr_scale > 1.0
    assert inner.param_groups[0]["lr"] == pytest.approx(1e-3 * opt.lr_scale)
    for _ in range(4):
        for x, y in loader:
            x, y = x.cuda(), y.cuda()
            if len(x) == 0:
                opt.step(empty_batch=True)
            else:
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
            opt.zero_grad()
    assert all(t.is_cuda for past in opt._stream._state.history for t in past)
    assert opt.accountant.epsilon(1e-5) <= 3.0 + 1e-6
    assert all(torch.isfinite(p).all() for p in model.parameters())


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
