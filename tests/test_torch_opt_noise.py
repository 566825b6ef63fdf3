"""The noise the wrapper adds is N(0, (b·σ/B̄)²) per coordinate, seeded or secure (KS tests)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats
from test_torch_opt_support import flat_vec
from torch import nn

from adaclip.errors import InvalidHyperparameterError, NoiseReplayWarning
from adaclip_torch import AdaClip, FlatClip, NoiseSource

KS_ALPHA = 1e-3  # deterministic seeds; a correct sampler fails with probability 1e-3 per fresh seed


def wide_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(60, 40)  # d = 2440 coordinates


def zero_grad_sample(params, n: int = 5) -> None:
    for p in params:
        p.grad_sample = torch.zeros((n, *p.shape), dtype=p.dtype)


@pytest.mark.parametrize("secure_mode", [False, True])
def test_adaclip_noise_is_gaussian_with_scale_b_sigma_over_B(secure_mode):
    model = wide_model()
    sigma, bbar, std_min, std_max = 1.3, 8.0, 1e-4, 0.5
    seed = None if secure_mode else 21
    opt = AdaClip(torch.optim.SGD(model.parameters(), lr=0.0), model, noise_multiplier=sigma,
                  expected_batch_size=bbar, std_min=std_min, std_max=std_max, seed=seed,
                  secure_mode=secure_mode, attach_hooks=False, preset="patent")
    d = sum(p.numel() for p in opt.params)
    s0 = math.sqrt(std_min * std_max)
    b = math.sqrt(s0) * math.sqrt(d * s0)  # b = sqrt(s)·sqrt(Σ s) with s = s0 everywhere
    zero_grad_sample(opt.params)
    opt.step()
    noise = flat_vec(p.grad for p in opt.params)  # m_0 = 0 and zero gradients: noise only
    result = stats.kstest(noise / (b * sigma / bbar), "norm")
    assert result.pvalue > KS_ALPHA, result
    # A wrong scale (e.g. 2σ², or dividing by n = 5 instead of B̄) is rejected by the same test.
    assert stats.kstest(noise / (b * sigma / 5.0), "norm").pvalue < KS_ALPHA


@pytest.mark.parametrize("secure_mode", [False, True])
def test_flat_noise_is_difference_to_the_noiseless_step(secure_mode):
    sigma, bbar, clip = 0.9, 6.0, 0.7
    released = []
    for s in (0.0, sigma):
        model = wide_model()
        opt = FlatClip(torch.optim.SGD(model.parameters(), lr=0.0), model, max_grad_norm=clip,
                       noise_multiplier=s, expected_batch_size=bbar, seed=None if secure_mode else 8,
                       secure_mode=secure_mode, attach_hooks=False)
        g = torch.Generator().manual_seed(3)
        for p in opt.params:
            p.grad_sample = torch.randn((4, *p.shape), generator=g)
        opt.step()
        released.append(flat_vec(p.grad for p in opt.params))
    noise = released[1] - released[0]
    result = stats.kstest(noise / (clip * sigma / bbar), "norm")
    assert result.pvalue > KS_ALPHA, result


def test_secure_sum_of_draws_is_standard_normal():
    src = NoiseSource(secure_mode=True, secure_num_draws=4)
    z = src.standard_normal([torch.empty(20000, dtype=torch.float64)])[0].numpy()
    assert stats.kstest(z, "norm").pvalue > KS_ALPHA


def test_seeded_source_is_reproducible_and_secure_is_not():
    like = [torch.empty(3, 2), torch.empty(5)]
    a, b = NoiseSource(seed=4), NoiseSource(seed=4)
    assert all(torch.equal(x, y) for x, y in zip(a.standard_normal(like), b.standard_normal(like)))
    s1, s2 = NoiseSource(secure_mode=True), NoiseSource(secure_mode=True)
    assert not torch.equal(s1.standard_normal(like)[1], s2.standard_normal(like)[1])
    assert "generator_state" not in s1.state_dict()


def test_noise_state_dict_round_trip():
    like = [torch.empty(7)]
    a = NoiseSource(seed=1)
    a.standard_normal(like)
    saved = a.state_dict()
    first = a.standard_normal(like)[0]
    b = NoiseSource(seed=999)
    with pytest.warns(NoiseReplayWarning):
        b.load_state_dict(saved)
    assert torch.equal(b.standard_normal(like)[0], first)


@pytest.mark.parametrize("kwargs", [{"seed": -1}, {"seed": 1.5}, {"secure_num_draws": 0},
                                    {"secure_mode": True, "seed": 3}])
def test_bad_noise_arguments(kwargs):
    with pytest.raises(InvalidHyperparameterError):
        NoiseSource(**kwargs)


def test_noise_dtype_follows_float64_params():
    z = NoiseSource(seed=0).standard_normal([torch.empty(4, dtype=torch.float64)])[0]
    assert z.dtype == torch.float64 and np.isfinite(z.numpy()).all()
