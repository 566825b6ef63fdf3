"""The Triton kernels of adaclip_torch.kernels against adaclip.reference.

With CUDA the tests run the compiled kernels on the GPU. Without it they run in Triton's
interpreter, which ``@triton.jit`` selects when it decorates, i.e. when triton itself (its
``tl.sum``, ``tl.randn``) and ``adaclip_torch.kernels.triton_adaclip`` are first imported.
So this module sets ``TRITON_INTERPRET=1`` around those two imports and while its own tests
run (Triton reads it again then), and restores the environment afterwards: no other test
module, nor a subprocess they start, sees it. If triton
was already imported in this process without the interpreter (another module got there
first), the tests cannot run here; then ``test_kernel_tests_in_subprocess`` runs this whole
file in a fresh interpreter with ``TRITON_INTERPRET=1`` and fails if any test there fails.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from scipy import stats
from torch import nn

from adaclip.errors import InvalidGradientError, InvalidHyperparameterError

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _import_kernels():
    """Import triton and the kernels, in the interpreter when there is no CUDA device."""
    fresh = "triton" not in sys.modules
    previous = os.environ.get("TRITON_INTERPRET")
    if DEVICE == "cpu" and fresh:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        if os.environ.get("ADACLIP_REQUIRE_KERNELS"):
            import triton  # noqa: F401  (scripts/test.sh installs it: a missing triton must fail)
        else:
            pytest.importorskip("triton")
        from adaclip_torch.kernels import triton_adaclip
    finally:
        if previous is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = previous
    return triton_adaclip


K = _import_kernels()
IN_PROCESS = DEVICE == "cuda" or K.INTERPRETED
needs_kernels = pytest.mark.skipif(
    not IN_PROCESS,
    reason="triton was imported without the interpreter: run by test_kernel_tests_in_subprocess",
)

from test_torch_kernel_reference import (  # noqa: E402
    STD_MAX,
    STD_MIN,
    assert_matches_reference,
    assert_sq_norms_bound,
    check_empty_batch_every_entry_point,
    check_factor_zero_or_nan_drops_the_row,
    check_near_sphere_never_under_clipped,
    check_nonfinite_units_contribute_nothing,
    make_case,
    released_scale,
)

from adaclip import reference as npref  # noqa: E402
from adaclip_torch import kernels  # noqa: E402
from adaclip_torch.kernels import reference as torch_reference  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _interpreter_env():
    """Triton also reads TRITON_INTERPRET while an interpreted kernel runs (lazy imports):
    keep it set during this module's tests on CPU, and restore it afterwards."""
    if DEVICE == "cuda" or not K.INTERPRETED:
        yield
        return
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = previous


@pytest.mark.skipif(IN_PROCESS, reason="the kernel tests ran in this process")
def test_kernel_tests_in_subprocess():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
        env=env, capture_output=True, text=True, timeout=900, cwd=os.path.dirname(os.path.dirname(__file__)),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "test_kernel_tests_in_subprocess" not in proc.stdout


def tensors(*arrays):
    return [torch.tensor(a, dtype=torch.float32, device=DEVICE) for a in arrays]


# --------------------------------------------------------------------------- exact (injected noise)

# P up to 300 stays inside one block (BLOCK_RELEASE = 1024, BLOCK_NORMS = 2048); the
# parametrised case below crosses block boundaries with P not a multiple of either.
assert 300 < K.BLOCK_RELEASE <= K.BLOCK_NORMS


@needs_kernels
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(0, 6),
    P=st.integers(1, 300),
    sigma=st.sampled_from([0.0, 0.3, 1.1, 4.0]),
    bbar=st.floats(0.5, 64.0),
    beta_mean=st.sampled_from([0.0, 0.5, 0.99]),
    beta_std=st.sampled_from([0.0, 0.9]),
)
def test_kernel_step_matches_reference(seed, n, P, sigma, bbar, beta_mean, beta_std):
    g, mean, std, z = make_case(seed, n, P)
    kw = dict(noise_multiplier=sigma, expected_batch_size=bbar, beta_mean=beta_mean, beta_std=beta_std,
              std_min=STD_MIN, std_max=STD_MAX)  # fmt: skip
    ref = npref.adaclip_step(g, mean, std, z, allow_empty=True, **kw)
    tg, tm, ts, tz = tensors(g, mean, std, z)
    out = kernels.fused_adaclip_step(tg, tm, ts, noise=tz, use_kernel=True, **kw)
    assert_matches_reference(out, ref, mean, std, std_min=STD_MIN, beta_std=beta_std, sigma=sigma, bbar=bbar)


@needs_kernels
@pytest.mark.parametrize("n,P", [(3, 1023), (2, 1025), (4, 2049), (1, 4100)])
def test_kernel_step_matches_reference_across_blocks(n, P):
    g, mean, std, z = make_case(P, n, P)
    kw = dict(noise_multiplier=0.9, expected_batch_size=5.0, std_min=STD_MIN, std_max=STD_MAX)
    ref = npref.adaclip_step(g, mean, std, z, **kw)
    tg, tm, ts, tz = tensors(g, mean, std, z)
    sq = K.transformed_sq_norms(tg, tm, ts)
    w = (g - mean) / npref.auxiliary_transform(std)
    # The norms are upper bounds enlarged by the documented margin (up to ~1.2e-4 here), not
    # rtol-close values; rtol=1e-5 admits the float32 rounding of the float64 inputs.
    assert_sq_norms_bound(sq, np.sum(w * w, axis=1), _margin(P), rtol=1e-5)
    out = kernels.fused_adaclip_step(tg, tm, ts, noise=tz, use_kernel=True, **kw)
    assert_matches_reference(out, ref, mean, std, std_min=STD_MIN, beta_std=0.9, sigma=0.9, bbar=5.0)


@needs_kernels
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(0, 6),
    P=st.integers(1, 300),
    sigma=st.sampled_from([0.0, 1.1]),
    bbar=st.floats(0.5, 64.0),
    C=st.floats(0.01, 10.0),
)
def test_kernel_flat_step_matches_reference(seed, n, P, sigma, bbar, C):
    g, _, _, z = make_case(seed, n, P, spread=C * np.sqrt(P))
    ref = npref.flat_clip_step(g, z, max_grad_norm=C, noise_multiplier=sigma, expected_batch_size=bbar,
                               allow_empty=True)  # fmt: skip
    tg, tz = tensors(g, z)
    out = kernels.fused_flat_step(tg, noise=tz, max_grad_norm=C, noise_multiplier=sigma,
                                  expected_batch_size=bbar, use_kernel=True)  # fmt: skip
    scale = float(np.max(np.abs(ref))) + 1.0
    np.testing.assert_allclose(out.cpu().numpy(), ref, rtol=1e-4, atol=1e-5 * scale)


def _margin(P: int) -> float:
    return torch_reference.sq_norms_margin(torch.float32, P, block=K.BLOCK_NORMS)


@needs_kernels
def test_kernel_sq_norms_with_inverse_scale_and_no_centre():
    # Upper bounds within the documented margin (see assert_sq_norms_bound); rtol=1e-5 admits
    # the float32 rounding of the float64 inputs the expected values are computed from.
    g, mean, std, _ = make_case(3, 4, 257)
    inv_b = 1.0 / npref.auxiliary_transform(std)
    tg, tm, tinv = tensors(g, mean, inv_b)
    assert_sq_norms_bound(K.transformed_sq_norms(tg, tm, inv_b=tinv), np.sum(((g - mean) * inv_b) ** 2, axis=1),
                          _margin(257), rtol=1e-5)  # fmt: skip
    assert_sq_norms_bound(K.transformed_sq_norms(tg, None, inv_b=0.25), np.sum((g * 0.25) ** 2, axis=1),
                          _margin(257), rtol=1e-5)  # fmt: skip
    assert K.transformed_sq_norms(tg[:0], tm, ts := tensors(std)[0]).shape == (0,)
    assert_sq_norms_bound(K.transformed_sq_norms(tg, tm, ts), np.sum(((g - mean) * inv_b) ** 2, axis=1),
                          _margin(257), rtol=1e-5)  # fmt: skip


# --------------------------------------------------------------------------- numerical safety


@needs_kernels
@pytest.mark.parametrize("P", [256, 4096])
def test_kernel_never_under_clips(P):
    """A unit within float32 rounding just outside the unit sphere comes out with an exact
    norm ≤ 1 (4096 spans two blocks of the norms kernel)."""
    check_near_sphere_never_under_clipped(K, DEVICE, P=P, block=K.BLOCK_NORMS)


@needs_kernels
def test_kernel_release_b_is_the_norms_b():
    """The release kernel builds b = sqrt(s)·sqrt(Σ s) bit for bit as the norms' wrapper does
    for their 1/b (correctly rounded square roots), so the bound refers to the released scale."""
    _, _, std, _ = make_case(6, 0, 3000)
    (ts,) = tensors(std)
    b = released_scale(K, ts)
    assert torch.equal(b, K._release_scale(ts))
    s32 = ts.cpu().numpy()
    exact = np.sqrt(s32) * np.sqrt(np.float32(ts.sum().item()))  # float32 ops, correctly rounded
    np.testing.assert_array_equal(b.cpu().numpy(), exact)


@needs_kernels
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's 0·inf
@pytest.mark.parametrize("P", [300, 2100])
def test_kernel_nonfinite_units_contribute_nothing(P):
    check_nonfinite_units_contribute_nothing(True, DEVICE, P=P)


@needs_kernels
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's 0·inf
def test_kernel_factor_zero_or_nan_drops_the_row():
    check_factor_zero_or_nan_drops_the_row(K, DEVICE, P=1500)


@needs_kernels
@pytest.mark.parametrize("P", [300, 2100])
def test_kernel_empty_batch_every_entry_point(P):
    check_empty_batch_every_entry_point(K, True, DEVICE, P=P)


@needs_kernels
def test_kernel_moments_come_from_released_gradient_only():
    g, mean, std, z = make_case(5, 6, 211)
    kw = dict(noise_multiplier=1.3, expected_batch_size=9.0, std_min=STD_MIN, std_max=STD_MAX)
    tg, tm, ts, tz = tensors(g, mean, std, z)
    grad, new_mean, new_std = kernels.fused_adaclip_step(tg, tm, ts, noise=tz, use_kernel=True, **kw)
    rmean, rstd = npref.update_moments(grad.cpu().double().numpy(), mean.astype(np.float32).astype(np.float64),
                                       std.astype(np.float32).astype(np.float64), **kw)  # fmt: skip
    np.testing.assert_allclose(new_mean.cpu().numpy(), rmean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(new_std.cpu().numpy(), rstd, rtol=1e-4, atol=1e-6)
    assert bool(torch.all((new_std >= STD_MIN * (1 - 1e-6)) & (new_std <= STD_MAX * (1 + 1e-6))))


@needs_kernels
def test_kernel_strided_rows_are_read_correctly():
    # a (n, P) view whose rows are not adjacent: the row stride is honoured
    g, mean, std, z = make_case(8, 3, 150)
    big = np.zeros((3, 400))
    big[:, 50:200] = g
    tbig, tm, ts, tz = tensors(big, mean, std, z)
    view = tbig[:, 50:200]
    assert view.stride(0) == 400
    kw = dict(noise_multiplier=0.5, expected_batch_size=2.0, std_min=STD_MIN, std_max=STD_MAX)
    out = kernels.fused_adaclip_step(view, tm, ts, noise=tz, use_kernel=True, **kw)
    ref = npref.adaclip_step(g, mean, std, z, **kw)
    assert_matches_reference(out, ref, mean, std, std_min=STD_MIN, beta_std=0.9, sigma=0.5, bbar=2.0)


# --------------------------------------------------------------------------- in-kernel Philox noise


def _released_noise(seed, offset, P=6000, sigma=1.7, bbar=12.0):
    """z recovered from g̃ with zero clip factors: (g̃ − m) / (b σ / B̄)."""
    rng = np.random.default_rng(0)
    g = rng.normal(size=(2, P))  # non-zero gradients whose clip factors are zero
    mean = np.linspace(-1.0, 1.0, P)
    std = np.linspace(0.1, 2.0, P)
    tg, tm, ts = tensors(g, mean, std)
    c = torch.zeros(2, device=DEVICE)
    grad, _, _ = K.fused_release(tg, c, tm, ts, noise_multiplier=sigma, expected_batch_size=bbar,
                                 std_min=0.1, std_max=2.0, seed=seed, offset=offset)  # fmt: skip
    b = torch.sqrt(ts) * torch.sqrt(ts.sum())
    return ((grad - tm) / (b * sigma / bbar)).cpu().double().numpy()


@needs_kernels
def test_philox_noise_is_standard_normal():
    z = _released_noise(seed=1234, offset=0)
    assert stats.kstest(z, "norm").pvalue > 1e-3
    # neighbouring coordinates uncorrelated (|r| well inside 5/sqrt(P))
    assert abs(np.corrcoef(z[:-1], z[1:])[0, 1]) < 5 / np.sqrt(z.size)


@needs_kernels
def test_philox_noise_is_keyed_by_seed_and_offset():
    P = 3000
    base = _released_noise(seed=7, offset=0, P=P)
    np.testing.assert_array_equal(base, _released_noise(seed=7, offset=0, P=P))  # reproducible
    for seed, offset in [(8, 0), (7, P), (7 + 2**40, 0), (7, 2**40)]:
        other = _released_noise(seed=seed, offset=offset, P=P)
        assert np.mean(np.isclose(other, base, atol=1e-4)) < 0.01, (seed, offset)
    # the stream is z_j = randn(seed, offset + j): shifting the offset shifts the stream,
    # which is why callers advance the offset by at least P per step.
    shifted = _released_noise(seed=7, offset=1000, P=P)
    np.testing.assert_allclose(shifted[: P - 1000], base[1000:], rtol=1e-4, atol=1e-4)


@needs_kernels
def test_philox_noise_in_empty_batch_through_dispatcher():
    P = 4000
    mean = torch.zeros(P, device=DEVICE)
    std = torch.full((P,), 0.5, device=DEVICE)
    g = torch.zeros((0, P), device=DEVICE)
    grad, _, _ = kernels.fused_adaclip_step(g, mean, std, noise_multiplier=2.0, expected_batch_size=10.0,
                                            std_min=0.1, std_max=1.0, seed=99, offset=5, use_kernel=True)  # fmt: skip
    b = float(np.sqrt(0.5) * np.sqrt(0.5 * P))
    z = (grad / (b * 2.0 / 10.0)).cpu().double().numpy()
    assert stats.kstest(z, "norm").pvalue > 1e-3


# --------------------------------------------------------------------------- dispatcher and checks


@needs_kernels
def test_dispatcher_true_runs_the_kernels(monkeypatch):
    calls = []
    real = K.fused_release

    def spy(*args, **kw):
        calls.append(1)
        return real(*args, **kw)

    monkeypatch.setattr(K, "fused_release", spy)
    g, mean, std, z = tensors(*make_case(2, 2, 40))
    kw = dict(noise_multiplier=1.0, expected_batch_size=2.0, std_min=STD_MIN, std_max=STD_MAX, noise=z)
    kernels.fused_adaclip_step(g, mean, std, use_kernel=True, **kw)
    assert calls == [1]
    kernels.fused_adaclip_step(g, mean, std, use_kernel=False, **kw)
    assert calls == [1]
    assert kernels.resolve_use_kernel(True, g) is True
    with pytest.raises(RuntimeError, match="float32"):
        kernels.resolve_use_kernel(True, g.double())


@needs_kernels
@pytest.mark.skipif(DEVICE == "cuda", reason="checks the CPU refusal without the interpreter")
def test_dispatcher_true_on_cpu_without_interpreter_raises():
    code = (
        "import torch, pytest\n"
        "from adaclip_torch.kernels import fused_adaclip_step, resolve_use_kernel\n"
        "g = torch.zeros((2, 3))\n"
        "assert resolve_use_kernel(None, g) is False\n"
        "try:\n"
        "    fused_adaclip_step(g, torch.zeros(3), torch.ones(3), noise_multiplier=1.0,\n"
        "        expected_batch_size=2.0, std_min=0.5, std_max=2.0, seed=1, use_kernel=True)\n"
        "except RuntimeError as e:\n"
        "    assert 'TRITON_INTERPRET' in str(e), e\n"
        "else:\n"
        "    raise SystemExit('no error')\n"
        "from adaclip_torch.kernels import triton_adaclip\n"
        "assert not triton_adaclip.INTERPRETED\n"
        "try:\n"
        "    triton_adaclip.transformed_sq_norms(g, None, inv_b=1.0)\n"
        "except RuntimeError as e:\n"
        "    assert 'TRITON_INTERPRET' in str(e), e\n"
        "else:\n"
        "    raise SystemExit('no error from the module')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


@needs_kernels
def test_kernel_rejects_bad_inputs():
    g, mean, std, z = tensors(*make_case(4, 3, 20))
    c = torch.ones(3, device=DEVICE)
    kw = dict(noise_multiplier=1.0, expected_batch_size=2.0, std_min=STD_MIN, std_max=STD_MAX)
    from adaclip.errors import InvalidGradientError, InvalidHyperparameterError

    with pytest.raises(InvalidGradientError):
        K.fused_release(g.double(), c, mean, std, noise=z, **kw)
    with pytest.raises(InvalidGradientError):
        K.fused_release(g, c[:2], mean, std, noise=z, **kw)
    with pytest.raises(InvalidHyperparameterError):
        K.fused_release(g, c, mean, std, seed=-1, **kw)
    with pytest.raises(InvalidHyperparameterError):
        K.fused_release(g, c, mean, std, seed=1, noise=z, **kw)
    with pytest.raises(InvalidHyperparameterError):
        K.fused_release(g, c, mean, std, noise=z, **{**kw, "std_min": 3.0, "std_max": 1.0})
    with pytest.raises(InvalidHyperparameterError):
        K.transformed_sq_norms(g, mean)  # neither std nor inv_b


# --------------------------------------------------------------------------- compiled (no GPU needed)

_AOT_CHECK = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from adaclip_torch.kernels import triton_adaclip as K
assert not K.INTERPRETED
target = GPUTarget("cuda", 90, 32)
norms = dict(g_ptr="*fp32", mean_ptr="*fp32", inv_b_ptr="*fp32", inv_b_scalar="fp32", partial_ptr="*fp32",
             P="i32", stride_g="i32", n_blocks="i32", HAS_MEAN="constexpr", SCALAR_SCALE="constexpr", BLOCK="constexpr")
for has_mean, scalar in [(True, False), (False, True)]:
    src = ASTSource(K._sq_norms_kernel, norms,
                    constexprs=dict(HAS_MEAN=has_mean, SCALAR_SCALE=scalar, BLOCK=K.BLOCK_NORMS))
    assert "cubin" in triton.compile(src, target=target, options=dict(num_warps=8)).asm
release = dict(g_ptr="*fp32", c_ptr="*fp32", mean_ptr="*fp32", std_ptr="*fp32", sqrt_total_ptr="*fp32",
               noise_ptr="*fp32", out_grad_ptr="*fp32", out_mean_ptr="*fp32", out_std_ptr="*fp32", n="i32",
               P="i32", stride_g="i64", scale_scalar="fp32", sigma="fp32", inv_bbar="fp32", seed="i64",
               offset="i64", beta_mean="fp32", beta_std="fp32", var_min="fp32", var_max="fp32",
               ADAPTIVE="constexpr", INJECTED="constexpr", BLOCK="constexpr")
for adaptive in (True, False):
    for injected in (True, False):
        src = ASTSource(K._release_kernel, release,
                        constexprs=dict(ADAPTIVE=adaptive, INJECTED=injected, BLOCK=K.BLOCK_RELEASE))
        assert "cubin" in triton.compile(src, target=target, options=dict(num_warps=4)).asm
print("compiled")
"""


@pytest.mark.skipif(DEVICE == "cuda", reason="on CUDA the other tests run the compiled kernels")
def test_kernels_compile_for_cuda_ahead_of_time():
    """The interpreter accepts code the compiler may reject: compile every kernel variant for
    sm_90 down to a cubin (Triton's bundled ptxas; no GPU needed)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _AOT_CHECK], env=env, capture_output=True, text=True,
                          timeout=300, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # fmt: skip
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-3000:]


# --------------------------------------------------------------------------- DPOptimizer(use_kernel=)


def _train(use_kernel, *, strategy="adaclip", steps=3, user_level=False, conv=False, sigma=1.3, **kw):
    """A few private steps of a small model; returns (parameters, optimizer)."""
    from adaclip_torch import AdaClip, FlatClip

    torch.manual_seed(0)
    if conv:
        model = nn.Sequential(nn.Conv1d(2, 3, 3), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 6, 4)).to(DEVICE)
        x = torch.randn(10, 2, 8, device=DEVICE)
    else:
        model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 4)).to(DEVICE)
        x = torch.randn(10, 5, device=DEVICE)
    y = torch.randint(0, 4, (10,), device=DEVICE)
    common = dict(noise_multiplier=sigma, expected_batch_size=6.0, seed=11, use_kernel=use_kernel, **kw)
    if strategy == "adaclip":
        opt = AdaClip(torch.optim.SGD(model.parameters(), lr=0.2), model, std_min=1e-3, std_max=0.3,
                      beta_std=0.5, **common, preset="patent")  # fmt: skip
    else:
        opt = FlatClip(torch.optim.SGD(model.parameters(), lr=0.2), model, max_grad_norm=0.5, **common)
    users = torch.tensor([0, 0, 1, 2, 2, 2, 3, 4, 4, 5], device=DEVICE)
    for _ in range(steps):
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step(user_ids=users if user_level else None)
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()], opt


def _spy(monkeypatch, names=("fused_release", "fused_flat_release")) -> list[str]:
    """Record every call of these kernels (one per parameter tensor and step)."""
    calls: list[str] = []
    for name in names:
        real = getattr(K, name)

        def spy(*args, _real=real, _name=name, **kw):
            calls.append(_name)
            return _real(*args, **kw)

        monkeypatch.setattr(K, name, spy)
    return calls


@needs_kernels
@pytest.mark.parametrize("strategy", ["adaclip", "flat"])
@pytest.mark.parametrize("user_level,conv", [(False, False), (True, False), (False, True)])
def test_optimizer_kernel_path_equals_core_path(strategy, user_level, conv, monkeypatch):
    """Same model, data and noise generator: the fused kernel path and the core path release
    the same gradients and keep the same AdaCliP state (to float32 rounding)."""
    calls = _spy(monkeypatch)
    core, opt_core = _train(False, strategy=strategy, user_level=user_level, conv=conv)
    assert calls == [] and not opt_core.fused_kernels
    fused, opt_fused = _train(True, strategy=strategy, user_level=user_level, conv=conv)
    assert opt_fused.fused_kernels and len(calls) == 3 * 4  # 3 steps, 4 parameter tensors
    for a, b in zip(core, fused, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    if strategy == "adaclip":
        for name in ("mean", "std"):
            for a, b in zip(
                getattr(opt_core.clip_state, name), getattr(opt_fused.clip_state, name), strict=True
            ):
                torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
    assert opt_fused.clip_state.step == opt_core.clip_state.step == 3


@needs_kernels
def test_optimizer_kernel_path_runs_the_kernels(monkeypatch):
    calls = _spy(monkeypatch, ("transformed_sq_norms", "fused_release"))
    _train(True, steps=1)
    # one launch of each kernel per parameter tensor (2 Linear layers: 4 tensors)
    assert calls.count("transformed_sq_norms") == 4 and calls.count("fused_release") == 4


@needs_kernels
def test_optimizer_kernel_noise_is_gaussian():
    """Zero per-example gradients: the released flat-clipping gradient is C·σ·z/B̄ exactly."""
    from adaclip_torch import FlatClip

    torch.manual_seed(0)
    model = nn.Linear(50, 40).to(DEVICE)
    opt = FlatClip(torch.optim.SGD(model.parameters(), lr=1.0), model, max_grad_norm=2.0, noise_multiplier=1.5,
                   expected_batch_size=3.0, seed=5, use_kernel=True)  # fmt: skip
    (0.0 * model(torch.randn(4, 50, device=DEVICE)).sum()).backward()
    opt.step()
    assert opt.fused_kernels
    released = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double().cpu().numpy()
    assert released.size == 2040
    # a frozen distribution's cdf: the SciPy of the GPU image fails on "norm" with args=
    assert stats.kstest(released, stats.norm(0.0, 2.0 * 1.5 / 3.0).cdf).pvalue > 1e-3
    assert stats.kstest(released, stats.norm(0.0, 2.0 * 1.5 / 3.0 * 1.2).cdf).pvalue < 1e-3  # negative control


def _linear_adaclip_on_kernels(use_kernel=True, **kw):
    from adaclip_torch import AdaClip

    torch.manual_seed(0)
    model = nn.Linear(4, 2).to(DEVICE)
    opt = AdaClip(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=1.0, expected_batch_size=4.0,
                  seed=1, use_kernel=use_kernel, **kw, preset="patent")  # fmt: skip
    return model, opt


@needs_kernels
def test_optimizer_kernel_path_nonfinite_raise_leaves_state_unchanged():
    model, opt = _linear_adaclip_on_kernels(nonfinite="raise")
    x = torch.randn(4, 4, device=DEVICE)
    x[2, 1] = float("nan")
    model(x).sum().backward()
    before = [p.detach().clone() for p in model.parameters()], [s.clone() for s in opt.clip_state.std]
    rng = opt.noise_source.get_state()
    with pytest.raises(InvalidGradientError):
        opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before[0], model.parameters(), strict=True))
    assert all(torch.equal(a, s) for a, s in zip(before[1], opt.clip_state.std, strict=True))
    assert torch.equal(rng, opt.noise_source.get_state())
    assert opt.steps == 0


@needs_kernels
@pytest.mark.parametrize("use_kernel", [False, True])
def test_optimizer_kernel_path_drops_a_nan_unit_like_the_core_path(use_kernel, monkeypatch):
    """By default a unit with a NaN gradient contributes nothing: the kernel path releases what
    the core path releases on the same batch (and the same noise), and stays finite."""
    calls = _spy(monkeypatch)
    x = torch.randn(4, 4, device=DEVICE)
    x[2, 1] = float("nan")
    results = []
    for kernel in (False, use_kernel):
        model, opt = _linear_adaclip_on_kernels(use_kernel=kernel)
        model(x).sum().backward()
        opt.step()
        results.append(([p.detach().clone() for p in model.parameters()], opt.clip_state))
    assert len(calls) == (2 if use_kernel else 0)
    (p_core, s_core), (p_fused, s_fused) = results
    for a, b in zip(p_core, p_fused, strict=True):
        assert bool(torch.all(torch.isfinite(b)))
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    for a, b in zip(s_core.std + s_core.mean, s_fused.std + s_fused.mean, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)


@needs_kernels
@pytest.mark.parametrize("strategy", ["adaclip", "flat"])
def test_optimizer_kernel_path_zero_length_batch(strategy, monkeypatch):
    """A Poisson batch with no units that still runs forward/backward (a zero-length batch)
    goes through the kernels with (0, P) rows and releases what the core path releases."""
    from adaclip_torch import AdaClip, FlatClip

    calls = _spy(monkeypatch)
    results = []
    for use_kernel in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 3), nn.Tanh(), nn.Linear(3, 2)).to(DEVICE)
        common = dict(noise_multiplier=1.2, expected_batch_size=4.0, seed=3, use_kernel=use_kernel)
        sgd = torch.optim.SGD(model.parameters(), lr=0.5)
        if strategy == "adaclip":
            opt = AdaClip(sgd, model, std_min=1e-3, std_max=0.3, **common, preset="patent")
        else:
            opt = FlatClip(sgd, model, max_grad_norm=0.5, **common)
        for batch in (4, 0, 3):
            model(torch.randn(batch, 5, device=DEVICE)).sum().backward()
            opt.step()
            opt.zero_grad()
        results.append(([p.detach().clone() for p in model.parameters()], opt.clip_state))
    assert len(calls) == 3 * 4  # every step, the empty one included, took the kernels
    (p_core, s_core), (p_fused, s_fused) = results
    for a, b in zip(p_core, p_fused, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    if strategy == "adaclip":
        for a, b in zip(s_core.std + s_core.mean, s_fused.std + s_fused.mean, strict=True):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)


@needs_kernels
def test_optimizer_kernel_accumulate_and_empty_batch_take_the_core_path(monkeypatch):
    calls = _spy(monkeypatch)
    model, opt = _linear_adaclip_on_kernels()
    model(torch.randn(3, 4, device=DEVICE)).sum().backward()
    opt.accumulate()
    model(torch.randn(2, 4, device=DEVICE)).sum().backward()
    opt.step()
    opt.step(empty_batch=True)
    assert calls == []
    model(torch.randn(3, 4, device=DEVICE)).sum().backward()
    opt.step()
    assert opt.steps == 3 and calls == ["fused_release"] * 2  # weight and bias


@needs_kernels
def test_optimizer_use_kernel_true_says_what_prevents_it():
    from adaclip_torch import AdaClip, FlatClip, PerLayerClip

    model = nn.Linear(4, 2).to(DEVICE)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    common = dict(noise_multiplier=1.0, expected_batch_size=4.0, use_kernel=True)
    with pytest.raises(InvalidHyperparameterError, match="PerLayerClipping"):
        PerLayerClip(sgd, model, max_grad_norm=1.0, **common)
    with pytest.raises(InvalidHyperparameterError, match="per_sample_mode"):
        AdaClip(sgd, model, per_sample_mode="ghost", **common, preset="patent")
    # the refusals came before any hook was attached: the model can still be wrapped
    opt = AdaClip(sgd, model, noise_multiplier=1.0, expected_batch_size=4.0, use_kernel=False, preset="patent",
                  per_sample_mode="materialise")
    model(torch.randn(3, 4, device=DEVICE)).sum().backward()
    assert model.weight.grad_sample.shape == (3, 2, 4)
    opt.step()
    double = nn.Linear(4, 2).to(DEVICE).double()
    with pytest.raises(InvalidHyperparameterError, match="float32"):
        FlatClip(torch.optim.SGD(double.parameters(), lr=0.1), double, max_grad_norm=1.0, **common)
    with pytest.raises(InvalidHyperparameterError, match="use_kernel must be"):
        fresh = nn.Linear(4, 2)
        AdaClip(torch.optim.SGD(fresh.parameters(), lr=0.1), fresh, noise_multiplier=1.0, expected_batch_size=4.0,
                use_kernel="yes", preset="patent")  # fmt: skip


@needs_kernels
def test_optimizer_use_kernel_auto_picks_the_kernels_only_on_cuda_when_materialising():
    _, opt = _train(None, steps=1, per_sample_mode="materialise")
    assert opt.fused_kernels == (DEVICE == "cuda")
    _, opt = _train(False, steps=1, per_sample_mode="materialise")
    assert not opt.fused_kernels
    # under the default per_sample_mode="auto" the ghost engine keeps memory low ...
    _, opt = _train(None, steps=1)
    assert not opt.fused_kernels and opt.per_sample_mode == "auto"
    # ... and use_kernel=True materialises for the kernels
    _, opt = _train(True, steps=1)
    assert opt.fused_kernels and opt.per_sample_mode == "materialise"
