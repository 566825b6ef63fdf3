"""The pure-torch path of adaclip_torch.kernels and the dispatcher, against adaclip.reference.

This module never imports triton: it runs with or without it. The Triton kernels themselves
are tested in tests/test_torch_kernel.py, which reuses the ``check_*`` helpers below with the
kernel module as the backend.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from scipy import stats

from adaclip import reference as npref
from adaclip.errors import InvalidGradientError, InvalidHyperparameterError
from adaclip.transform import clip_factors, rounding_margin
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


def exact_sq_norms(g, mean, b) -> np.ndarray:
    """``‖(g_i − m)/b‖²`` of the given (float32) values, to about 1e-15: float64 arithmetic
    on float32 inputs and a correctly rounded sum (math.fsum)."""
    g = (
        np.asarray(g.detach().cpu(), dtype=np.float64)
        if isinstance(g, torch.Tensor)
        else np.asarray(g, np.float64)
    )
    m = 0.0 if mean is None else np.asarray(torch.as_tensor(mean).cpu(), dtype=np.float64)
    b = np.asarray(torch.as_tensor(b).cpu(), dtype=np.float64)
    w = (g - m) / b
    return np.array([math.fsum(row) for row in w * w], dtype=np.float64)


def assert_sq_norms_bound(sq, exact, margin, *, rtol=0.0):
    """``sq`` is an upper bound of ``exact`` within the documented ``margin``: the squared norms
    are deliberately enlarged by ``1 + η``, so a plain ``rtol`` comparison does not apply.
    The computed sum itself may be high by up to ``η`` as well, hence ``(1 + η)²`` above.
    ``rtol`` admits inputs that are rounded versions of those ``exact`` was computed from."""
    sq = np.asarray(sq.detach().cpu(), dtype=np.float64)
    assert sq.shape == exact.shape
    assert np.all(sq >= exact * (1.0 - rtol)), np.min(sq / exact)
    assert np.all(sq <= exact * (1.0 + margin) ** 2 * (1.0 + rtol) + 1e-30), np.max(sq / exact)


def released_scale(backend, std: torch.Tensor) -> torch.Tensor:
    """The ``b`` a backend's release scales by, read off the release itself: with no units,
    ``m = 0``, ``z = 1``, ``σ = 1`` and ``B̄ = 1`` it releases ``g̃ = b·(0 + 1) + 0 = b``."""
    P = std.shape[0]
    zeros = torch.zeros(P, device=std.device)
    grad, _, _ = backend.fused_release(torch.zeros((0, P), device=std.device), torch.zeros(0, device=std.device),
                                       zeros, std, noise=torch.ones(P, device=std.device), noise_multiplier=1.0,
                                       expected_batch_size=1.0, std_min=STD_MIN, std_max=STD_MAX)  # fmt: skip
    return grad


def check_near_sphere_never_under_clipped(backend, device, *, P: int, block: int | None):
    """Units within float32 rounding of the unit sphere: after clipping, every exact
    transformed norm is ≤ 1 (rounding may over-clip, never under-clip), and the over-clip is
    within the documented margin."""
    # A deterministic case for any summation order: w = (1, ±2^-13, 0, …). In float32
    # 1 + 2^-26 rounds to 1, so a plain sum gives the factor 1 and an exact norm
    # sqrt(1 + 2^-26) > 1. With P = 4^k and s = 4^-(k//2) everywhere, b = s·sqrt(P) is 1 or 2
    # exactly, and with a centre of 0.5 the entries m + b·w are exact in float32.
    k = (P.bit_length() - 1) // 2
    assert P == 4**k
    std = torch.full((P,), 4.0 ** -(k // 2), device=device)
    mean = torch.full((P,), 0.5, device=device)
    b = released_scale(backend, std)
    b0 = 2.0 ** (k - 2 * (k // 2))
    assert torch.all(b == b0)
    g = mean.repeat(3, 1)
    g[0, :2] += b0 * torch.tensor([1.0, 2.0**-13], device=device)
    g[1, :2] += b0 * torch.tensor([-1.0, -(2.0**-13)], device=device)
    g[2] += b0 * 2.0 ** -(k + 1)  # norm 1/2: not clipped
    margin = reference.sq_norms_margin(torch.float32, P, block=block)
    for sq, exact in (
        (backend.transformed_sq_norms(g, mean, std), exact_sq_norms(g, mean, b)),
        (backend.transformed_sq_norms(g, mean, inv_b=1.0 / b), exact_sq_norms(g, mean, b)),
        (backend.transformed_sq_norms(g - mean, None, inv_b=1.0 / b0), exact_sq_norms(g - mean, None, b0)),
    ):
        assert exact[0] > 1.0 and exact[1] > 1.0 and exact[2] == 0.25
        assert_sq_norms_bound(sq, exact, margin)
        c = clip_factors(sq).cpu().double().numpy()
        assert c[2] == 1.0 and np.all(c[:2] < 1.0)
        assert np.all(c * np.sqrt(exact) <= 1.0), c * np.sqrt(exact) - 1.0

    # Many random directions with exact norms spread over 1 ± 16u (u = 2^-24).
    rng = np.random.default_rng(P)
    n = 96
    std64 = rng.uniform(0.1, 2.0, size=P)
    std = torch.tensor(std64, dtype=torch.float32, device=device)
    mean = torch.tensor(rng.normal(size=P), dtype=torch.float32, device=device)
    b = released_scale(backend, std)
    d = rng.normal(size=(n, P))
    target = 1.0 + np.linspace(-16.0, 16.0, n)[:, None] * 2.0**-24
    w = d / np.linalg.norm(d, axis=1, keepdims=True) * target
    g = torch.tensor(
        mean.cpu().double().numpy() + b.cpu().double().numpy() * w, dtype=torch.float32, device=device
    )
    exact = exact_sq_norms(g, mean, b)
    assert np.sum(exact > 1.0) > n // 4 and np.sum(exact < 1.0) > n // 4
    sq = backend.transformed_sq_norms(g, mean, std)
    assert_sq_norms_bound(sq, exact, margin)
    c = clip_factors(sq).cpu().double().numpy()
    clipped = c * np.sqrt(exact)
    assert np.all(clipped <= 1.0), np.max(clipped) - 1.0
    # over-clipping is bounded by the margin (and the factor's own rounding, 2u)
    assert np.all(clipped >= np.minimum(1.0, np.sqrt(exact)) / (1.0 + margin) * (1 - 2.0**-22))


def _finite_and_bad_rows(seed: int, P: int, device):
    g, mean, std, z = make_case(seed, 4, P)
    g = torch.tensor(g, dtype=torch.float32, device=device)
    bad = g.clone()
    bad[1, P // 2] = float("nan")
    bad[3, 0] = float("inf")
    bad = torch.cat([bad, torch.full((1, P), -float("inf"), device=device)])
    good = bad[[0, 2]]
    t = [torch.tensor(x, dtype=torch.float32, device=device) for x in (mean, std, z)]
    return good, bad, t[0], t[1], t[2]


def check_nonfinite_units_contribute_nothing(use_kernel, device, *, P: int):
    """A batch with NaN/inf rows releases what the batch without them releases (same injected
    noise), for AdaCliP and flat clipping; the NumPy reference drops such rows too."""
    good, bad, mean, std, z = _finite_and_bad_rows(P, P, device)
    kw = dict(noise_multiplier=0.7, expected_batch_size=3.0, std_min=STD_MIN, std_max=STD_MAX, noise=z)
    want = fused_adaclip_step(good, mean, std, use_kernel=use_kernel, **kw)
    got = fused_adaclip_step(bad, mean, std, use_kernel=use_kernel, **kw)
    for a, b in zip(got, want, strict=True):
        assert bool(torch.all(torch.isfinite(a)))
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    as64 = [x.cpu().double().numpy() for x in (bad, mean, std, z)]
    ref = npref.adaclip_step(*as64, **{k: v for k, v in kw.items() if k != "noise"})
    assert_matches_reference(got, ref, as64[1], as64[2], std_min=STD_MIN, beta_std=0.9, sigma=0.7, bbar=3.0)
    fkw = dict(
        noise=z, max_grad_norm=0.3, noise_multiplier=0.7, expected_batch_size=3.0, use_kernel=use_kernel
    )
    flat_bad = fused_flat_step(bad, **fkw)
    assert bool(torch.all(torch.isfinite(flat_bad)))
    torch.testing.assert_close(flat_bad, fused_flat_step(good, **fkw), rtol=0, atol=0)


def check_factor_zero_or_nan_drops_the_row(backend, device, *, P: int):
    """The releases take any factor that is not > 0 (0, NaN, negative) as 0, whatever the row."""
    good, bad, mean, std, z = _finite_and_bad_rows(P + 1, P, device)
    kw = dict(noise_multiplier=1.1, expected_batch_size=2.0, std_min=STD_MIN, std_max=STD_MAX, noise=z)
    c_good = torch.tensor([0.25, 0.5], device=device)
    c_bad = torch.tensor([0.25, 0.0, 0.5, float("nan"), -1.0], device=device)
    want = backend.fused_release(good, c_good, mean, std, **kw)
    got = backend.fused_release(bad, c_bad, mean, std, **kw)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    fkw = dict(noise=z, max_grad_norm=2.0, noise_multiplier=1.1, expected_batch_size=2.0)
    torch.testing.assert_close(backend.fused_flat_release(bad, c_bad, **fkw),
                               backend.fused_flat_release(good, c_good, **fkw), rtol=0, atol=0)  # fmt: skip


def _empty_batches(P: int, device):
    """``(0, P)`` per-unit gradients as callers build them: a reshape of ``(0, *shape)``, a
    plain empty matrix, and a transposed (non-contiguous) one."""
    return [
        torch.zeros((0, 3, P // 3), device=device).reshape(0, P),
        torch.empty((0, P), device=device),
        torch.zeros((P, 0), device=device).t(),
    ]


def check_empty_batch_every_entry_point(backend, use_kernel, device, *, P: int):
    """``n = 0`` on every entry point: norms of shape (0,), and a release of noise only (plus
    the AdaCliP moment update), equal to the NumPy reference with ``allow_empty=True``."""
    _, mean, std, z = make_case(P, 0, P)
    tm, ts, tz = (torch.tensor(x, dtype=torch.float32, device=device) for x in (mean, std, z))
    kw = dict(noise_multiplier=1.3, expected_batch_size=7.0, std_min=STD_MIN, std_max=STD_MAX)
    ref = npref.adaclip_step(np.zeros((0, P)), mean, std, z, allow_empty=True, **kw)
    flat_ref = npref.flat_clip_step(np.zeros((0, P)), z, max_grad_norm=0.4, noise_multiplier=1.3,
                                    expected_batch_size=7.0, allow_empty=True)  # fmt: skip
    c = torch.zeros(0, device=device)
    for g in _empty_batches(P, device):
        assert g.shape == (0, P)
        for sq in (
            backend.transformed_sq_norms(g, tm, ts),
            backend.transformed_sq_norms(g, tm, inv_b=1.0 / ts),
            backend.transformed_sq_norms(g, None, inv_b=2.5),
        ):
            assert sq.shape == (0,) and sq.dtype == torch.float32
            assert clip_factors(sq).shape == (0,)
        outs = [
            backend.fused_release(g, c, tm, ts, noise=tz, **kw),
            fused_adaclip_step(g, tm, ts, noise=tz, use_kernel=use_kernel, **kw),
        ]
        for out in outs:
            assert_matches_reference(out, ref, mean, std, std_min=STD_MIN, beta_std=0.9, sigma=1.3, bbar=7.0)
        fkw = dict(max_grad_norm=0.4, noise_multiplier=1.3, expected_batch_size=7.0, noise=tz)
        for out in (
            backend.fused_flat_release(g, c, **fkw),
            fused_flat_step(g, use_kernel=use_kernel, **fkw),
        ):
            np.testing.assert_allclose(out.cpu().numpy(), flat_ref, rtol=1e-5, atol=1e-6)
        # seeded noise: a finite draw of the right shape
        seeded = backend.fused_release(g, c, tm, ts, seed=3, offset=0, **kw)
        assert all(o.shape == (P,) and bool(torch.all(torch.isfinite(o))) for o in seeded)


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


# --------------------------------------------------------------------------- numerical safety


@pytest.mark.parametrize("P", [256, 4096])
def test_torch_path_never_under_clips(P):
    check_near_sphere_never_under_clipped(reference, "cpu", P=P, block=None)


def test_torch_path_sq_norms_are_upper_bounds_float64():
    g, mean, std, _ = make_case(9, 5, 300)
    t = [torch.tensor(x) for x in (g, mean, std)]
    sq = reference.transformed_sq_norms(t[0], t[1], t[2])
    exact = np.sum(((g - mean) / npref.auxiliary_transform(std)) ** 2, axis=1)
    assert_sq_norms_bound(sq, exact, reference.sq_norms_margin(torch.float64, 300), rtol=1e-14)


def test_torch_path_nonfinite_units_contribute_nothing():
    check_nonfinite_units_contribute_nothing(False, "cpu", P=300)


def test_torch_path_factor_zero_or_nan_drops_the_row():
    check_factor_zero_or_nan_drops_the_row(reference, "cpu", P=50)


def test_torch_path_empty_batch_every_entry_point():
    check_empty_batch_every_entry_point(reference, False, "cpu", P=300)


def test_sq_norms_margin():
    u, u64 = 2.0**-24, 2.0**-53

    def gamma(k, unit):
        return k * unit / (1 - k * unit)

    for P in (1, 300, 2048, 10**6, 10**9):
        # the kernel's structure: any order within a block of B in float32, the block sums in
        # float64, and 20 more roundings
        blocked = reference.sq_norms_margin(torch.float32, P, block=2048)
        expected = (1 + gamma(min(P, 2048), u)) * (1 + gamma(-(-P // 2048), u64)) * (1 + gamma(20, u)) - 1
        assert blocked == pytest.approx(expected, rel=1e-12)
        assert blocked < 1.3e-4
        # the torch path: the core's blocked-sum margin and 8 more roundings
        plain = reference.sq_norms_margin(torch.float32, P)
        assert plain == pytest.approx((1 + rounding_margin(torch.float32, P)) * (1 + gamma(8, u)) - 1)
        assert reference.sq_norms_margin(torch.float64, P) < 1e-9
    with pytest.raises(ValueError):
        reference.sq_norms_margin(torch.float32, 2**24, block=2**24)


def test_factors_at_most_never_rounds_up():
    c = torch.tensor([1.0 - 1e-9, 0.3, 1.0, 0.0, float("nan"), 1e-50], dtype=torch.float64)
    out = reference.factors_at_most(c, torch.float32)
    assert out.dtype == torch.float32
    assert bool(torch.all(out[:4].double() <= c[:4]))
    assert out[0] < 1.0 and out[2] == 1.0 and out[3] == 0.0 and torch.isnan(out[4]) and out[5] == 0.0
    same = torch.tensor([0.5, 0.25])
    assert torch.equal(reference.factors_at_most(same, torch.float32), same)


def test_core_clip_factors_replace_the_duplicate():
    # one clip-factor rule for every path: the core's (0 for a non-finite norm)
    assert not hasattr(reference, "clip_factors")
    c = clip_factors(torch.tensor([0.25, 4.0, float("nan"), float("inf"), 0.0]))
    assert c.tolist() == [1.0, 0.5, 0.0, 0.0, 1.0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_torch_path_low_precision_computes_in_float32(dtype):
    """Narrow dtypes are widened to float32 for the arithmetic (the bound of the norms holds)
    and the results rounded back: the same as the float32 path on the same values."""
    g, mean, std, z = make_case(4, 3, 64)
    t = [torch.tensor(x).to(dtype) for x in (g, mean, std, z)]
    kw = dict(noise_multiplier=0.8, expected_batch_size=3.0, std_min=STD_MIN, std_max=STD_MAX)
    out = fused_adaclip_step(t[0], t[1], t[2], noise=t[3], use_kernel=False, **kw)
    wide = fused_adaclip_step(*(x.float() for x in t[:3]), noise=t[3].float(), use_kernel=False, **kw)
    for a, b in zip(out, wide, strict=True):
        assert a.dtype == dtype
        assert torch.equal(a, b.to(dtype))
    sq = reference.transformed_sq_norms(t[0], t[1], t[2])
    assert sq.dtype == torch.float32
    exact = exact_sq_norms(t[0].float(), t[1].float(), reference.auxiliary_scale(t[2].float()))
    assert_sq_norms_bound(sq, exact, reference.sq_norms_margin(torch.float32, 64))
