"""The pure-torch path of adaclip_torch.kernels and the dispatcher, against adaclip.reference.

This module never imports triton: it runs with or without it. The Triton kernels themselves
are tested in tests/test_torch_kernel.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from scipy import stats

from adaclip import reference as npref
from adaclip.errors import InvalidGradientError, InvalidHyperparameterError
from adaclip_torch.kernels import fused_adaclip_step, fused_flat_step, reference, resolve_use_kernel

STD_MIN, STD_MAX = 0.05, 3.0


def make_case(seed: int, n: int, P: int, *, spread: float = 1.0):
    """Gradients whose rows straddle the clip radius (some clipped, some not), a mean, a std
    inside [STD_MIN, STD_MAX], and an injected standard-normal draw; all float64."""
    rng = np.random.default_rng(seed)
    mean = 0.3 * rng.normal(size=P)
    std = rng.uniform(STD_MIN, STD_MAX, size=P)
    b = npref.auxiliary_transform(std)
    row_scales = spread * np.exp(rng.uniform(-2.0, 2.0, size=(n, 1))) / np.sqrt(P)
    g = mean + b * rng.normal(size=(n, P)) * row_scales
    z = rng.normal(size=P)
    return g, mean, std, z


def assert_matches_reference(out, ref, mean, std, *, std_min, beta_std, sigma, bbar, tol=1e-5):
    """float32 results against the float64 reference, with tolerances from the magnitudes."""
    grad, new_mean, new_std = (np.asarray(o.detach().cpu(), dtype=np.float64) for o in out)
    rgrad, rmean, rstd = ref
    scale = float(np.max(np.abs(rgrad))) + 1.0
    np.testing.assert_allclose(grad, rgrad, rtol=10 * tol, atol=tol * scale)
    np.testing.assert_allclose(new_mean, rmean, rtol=10 * tol, atol=tol * scale)
    # s'² = β2 s² + (1−β2) v, and v = (g̃ − m)² − b²σ²/B̄² carries rounding of the size of its
    # two terms; an error e in s'² moves s' by at most e / (2·std_min).
    dev2 = float(np.max((rgrad - mean) ** 2))
    noise2 = float(np.max(npref.auxiliary_transform(std) ** 2)) * (sigma / bbar) ** 2
    atol_std = tol * ((1 - beta_std) * (dev2 + noise2) / std_min + 1.0)
    np.testing.assert_allclose(new_std, rstd, rtol=10 * tol, atol=atol_std)


# --------------------------------------------------------------------------- torch path vs NumPy


@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(0, 6),
    P=st.integers(1, 300),
    sigma=st.sampled_from([0.0, 0.3, 1.1, 4.0]),
    bbar=st.floats(0.5, 64.0),
    beta_mean=st.sampled_from([0.0, 0.5, 0.99]),
    beta_std=st.sampled_from([0.0, 0.9]),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_torch_path_matches_reference(seed, n, P, sigma, bbar, beta_mean, beta_std, dtype):
    g, mean, std, z = make_case(seed, n, P)
    kw = dict(noise_multiplier=sigma, expected_batch_size=bbar, beta_mean=beta_mean, beta_std=beta_std,
              std_min=STD_MIN, std_max=STD_MAX)  # fmt: skip
    ref = npref.adaclip_step(g, mean, std, z, allow_empty=True, **kw)
    t = [torch.tensor(x, dtype=dtype) for x in (g, mean, std, z)]
    out = fused_adaclip_step(t[0], t[1], t[2], noise=t[3], use_kernel=False, **kw)
    tol = 1e-5 if dtype == torch.float32 else 1e-11
    assert_matches_reference(
        out, ref, mean, std, std_min=STD_MIN, beta_std=beta_std, sigma=sigma, bbar=bbar, tol=tol
    )


@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(0, 6),
    P=st.integers(1, 300),
    sigma=st.sampled_from([0.0, 1.1]),
    bbar=st.floats(0.5, 64.0),
    C=st.floats(0.01, 10.0),
)
def test_torch_flat_path_matches_reference(seed, n, P, sigma, bbar, C):
    g, _, _, z = make_case(seed, n, P, spread=C * np.sqrt(P))
    ref = npref.flat_clip_step(g, z, max_grad_norm=C, noise_multiplier=sigma, expected_batch_size=bbar,
                               allow_empty=True)  # fmt: skip
    out = fused_flat_step(torch.tensor(g, dtype=torch.float32), noise=torch.tensor(z, dtype=torch.float32),
                          max_grad_norm=C, noise_multiplier=sigma, expected_batch_size=bbar, use_kernel=False)  # fmt: skip
    scale = float(np.max(np.abs(ref))) + 1.0
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-4, atol=1e-5 * scale)


def test_torch_path_moments_come_from_released_gradient_only():
    g, mean, std, z = make_case(1, 5, 77)
    kw = dict(noise_multiplier=1.3, expected_batch_size=9.0, std_min=STD_MIN, std_max=STD_MAX)
    t = [torch.tensor(x) for x in (g, mean, std, z)]
    grad, new_mean, new_std = fused_adaclip_step(t[0], t[1], t[2], noise=t[3], use_kernel=False, **kw)
    rmean, rstd = npref.update_moments(grad.numpy(), mean, std, **kw)
    np.testing.assert_allclose(new_mean.numpy(), rmean, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(new_std.numpy(), rstd, rtol=1e-12, atol=1e-12)
    # The denominator is B̄, never the realised n = 5: doubling B̄ halves w̃ exactly.
    grad2, _, _ = fused_adaclip_step(t[0], t[1], t[2], noise=t[3], use_kernel=False,
                                     **{**kw, "expected_batch_size": 18.0})  # fmt: skip
    np.testing.assert_allclose((grad2 - t[1]).numpy(), 0.5 * (grad - t[1]).numpy(), rtol=1e-12, atol=1e-14)


# --------------------------------------------------------------------------- seeded noise


def test_torch_path_seeded_noise_is_standard_normal_and_keyed():
    P = 20000
    g = torch.zeros((0, P))
    mean = torch.linspace(-1.0, 1.0, P)
    std = torch.linspace(0.1, 2.0, P)
    sigma, bbar = 1.7, 12.0
    kw = dict(noise_multiplier=sigma, expected_batch_size=bbar, std_min=0.1, std_max=2.0)
    grad, _, _ = fused_adaclip_step(g, mean, std, seed=11, offset=0, use_kernel=False, **kw)
    z = ((grad - mean) / (reference.auxiliary_scale(std) * sigma / bbar)).numpy()
    assert stats.kstest(z, "norm").pvalue > 1e-3
    again, _, _ = fused_adaclip_step(g, mean, std, seed=11, offset=0, use_kernel=False, **kw)
    assert torch.equal(grad, again)
    for other in ({"seed": 12, "offset": 0}, {"seed": 11, "offset": P}):
        diff, _, _ = fused_adaclip_step(g, mean, std, use_kernel=False, **other, **kw)
        assert not torch.allclose(diff, grad)


# --------------------------------------------------------------------------- dispatcher


def test_dispatcher_false_and_auto_on_cpu_take_the_torch_path():
    g = torch.zeros((2, 5))
    assert resolve_use_kernel(False, g) is False
    # auto never picks Triton's (slow) interpreter, nor float64, nor non-CUDA devices
    assert resolve_use_kernel(None, g) is False
    assert resolve_use_kernel(None, g.double()) is False
    assert resolve_use_kernel(None, torch.zeros((2, 5), device="meta")) is False
    with pytest.raises(TypeError):
        resolve_use_kernel("yes", g)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the auto choice of the kernels needs CUDA")
def test_dispatcher_auto_on_cuda_takes_the_kernels():
    pytest.importorskip("triton")
    g = torch.zeros((2, 5), device="cuda")
    assert resolve_use_kernel(None, g) is True
    assert resolve_use_kernel(None, g.double()) is False


def test_invalid_inputs_raise_before_computing():
    g, mean, std, z = (torch.tensor(x, dtype=torch.float32) for x in make_case(0, 3, 10))
    kw = dict(
        noise_multiplier=1.0, expected_batch_size=4.0, std_min=STD_MIN, std_max=STD_MAX, use_kernel=False
    )
    with pytest.raises(InvalidHyperparameterError):
        fused_adaclip_step(g, mean, std, **kw)  # neither seed nor noise
    with pytest.raises(InvalidHyperparameterError):
        fused_adaclip_step(g, mean, std, seed=1, noise=z, **kw)  # both
    with pytest.raises(InvalidHyperparameterError):
        fused_adaclip_step(g, mean, std, noise=z, **{**kw, "expected_batch_size": 0.0})
    with pytest.raises(InvalidHyperparameterError):
        fused_adaclip_step(g, mean, std, noise=z, **{**kw, "noise_multiplier": -1.0})
    with pytest.raises(InvalidGradientError):
        fused_adaclip_step(g, mean[:-1], std, noise=z, **kw)
    with pytest.raises(InvalidHyperparameterError):
        fused_flat_step(g, noise=z, max_grad_norm=0.0, noise_multiplier=1.0, expected_batch_size=4.0,
                        use_kernel=False)  # fmt: skip
