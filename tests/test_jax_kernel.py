"""Fused Pallas kernels of adaclip_jax (interpret mode on CPU, compiled through Triton on a GPU)
against the jnp reference path, the core path and the NumPy reference, with injected noise."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import adaclip_jax
from adaclip import reference
from adaclip.errors import InvalidHyperparameterError
from adaclip_jax import _kernel

pytestmark = pytest.mark.jax

MOMENT_KW = dict(beta_mean=0.9, beta_std=0.8, std_min=1e-3, std_max=2.0)
#: the kernels run compiled on a GPU, in Pallas's interpreter elsewhere
INTERPRET = jax.default_backend() != "gpu"


def _inputs(n, p, seed, dtype):
    rng = np.random.default_rng(seed)
    g = jnp.asarray(rng.standard_normal((n, p)) * 3.0, dtype)
    a = jnp.asarray(rng.standard_normal(p), dtype)
    b = jnp.asarray(rng.uniform(0.5, 4.0, p), dtype)
    std = jnp.asarray(rng.uniform(1e-3, 2.0, p), dtype)
    z = jnp.asarray(rng.standard_normal(p), dtype)
    c = jnp.asarray(rng.uniform(0.0, 1.0, n), dtype)
    return g, a, b, std, z, c


@settings(max_examples=6)
@given(n=st.integers(1, 12), p=st.integers(1, 70), block=st.sampled_from([8, 16, 512]), seed=st.integers(0, 999))
def test_sq_norms_kernel_matches_reference_and_numpy(n, p, block, seed):
    with jax.enable_x64(True):
        g, a, b, _, _, _ = _inputs(n, p, seed, jnp.float64)
        u = 1.0 / b
        got = _kernel.sq_norms(g, a, u, interpret=INTERPRET, block_cols=block)
        ref = _kernel.sq_norms_reference(g, a, u)
        numpy = np.sum(((np.asarray(g) - np.asarray(a)) / np.asarray(b)) ** 2, axis=1)
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-12)
        np.testing.assert_allclose(np.asarray(got), numpy, rtol=1e-12)


@pytest.mark.parametrize("dtype,rtol", [(jnp.float64, 1e-12), (jnp.float32, 2e-5)])
@pytest.mark.parametrize("n,p,block", [(5, 37, 8), (3, 100, 512), (16, 64, 16), (13, 37, 8), (40, 20, 16)])
@pytest.mark.parametrize("sigma", [0.0, 1.7])
def test_clip_noise_update_kernel_matches_reference(dtype, rtol, n, p, block, sigma):
    with jax.enable_x64(True):
        g, a, b, std, z, c = _inputs(n, p, n * p, dtype)
        u = 1.0 / b
        kw = dict(noise_multiplier=sigma, expected_batch_size=6.5, **MOMENT_KW)
        zz = None if sigma == 0.0 else z
        got = _kernel.clip_noise_update(g, c, a, b, u, zz, std, interpret=INTERPRET, block_cols=block, **kw)
        ref = _kernel.clip_noise_update_reference(g, c, a, b, u, zz, std, **kw)
        # Independent NumPy formula (AdaCliP steps 5-9: sum, noise, rescale, moments), float64.
        g64, a64, b64, s64, c64 = (np.asarray(x, np.float64) for x in (g, a, b, std, c))
        w = np.sum(c64[:, None] * (g64 - a64) / b64, axis=0) + sigma * np.asarray(z, np.float64) * (sigma > 0)
        noisy = b64 * w / 6.5 + a64
        v = np.clip((noisy - a64) ** 2 - b64**2 * sigma**2 / 6.5**2, 1e-6, 4.0)
        want = (noisy, 0.9 * a64 + 0.1 * noisy, np.sqrt(0.8 * s64**2 + 0.2 * v))
        for x, y, w_ in zip(got, ref, want, strict=True):
            assert x.dtype == dtype and x.shape == (p,)
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=rtol * 1e-2)
            np.testing.assert_allclose(np.asarray(x, np.float64), w_, rtol=max(rtol, 1e-10), atol=rtol * 1e-1)


@pytest.mark.parametrize("n", [1, 3, 8])
def test_clip_noise_update_kernel_long_rows(n):
    """Many column tiles of the default width (5,000 columns, tiles of 512, the last one part
    overhanging): the shapes that failed on a GPU before the kernel padded its (P,) operands to
    whole tiles (its last tile stored past the outputs' end); the small tests above did not
    reach them."""
    g, a, b, std, z, c = _inputs(n, 5000, 11, jnp.float32)
    kw = dict(noise_multiplier=1.0, expected_batch_size=64.0, **MOMENT_KW)
    got = _kernel.clip_noise_update(g, c, a, b, 1.0 / b, z, std, interpret=INTERPRET, **kw)
    ref = _kernel.clip_noise_update_reference(g, c, a, b, 1.0 / b, z, std, **kw)
    for x, y in zip(got, ref, strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("n,p", [(1, 5), (13, 1000), (256, 4096), (1024, 70)])
def test_kernels_lower_to_triton_for_cuda_on_a_cpu_machine(n, p):
    """The GPU path: both kernels lower through Pallas's Triton backend for CUDA (jax.export
    lowers for a platform this machine does not have). This checks the Pallas→Triton lowering
    (block shapes, masks, the row loop); it does not check the Triton→PTX compile or a run."""
    from jax import export

    g = jax.ShapeDtypeStruct((n, p), jnp.float32)
    v = jax.ShapeDtypeStruct((p,), jnp.float32)
    c = jax.ShapeDtypeStruct((n,), jnp.float32)
    triton_call = export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")

    def release(g, c, a, b, u, z, s):
        return _kernel.clip_noise_update(g, c, a, b, u, z, s, noise_multiplier=1.1, expected_batch_size=64.0,
                                         **MOMENT_KW)  # fmt: skip

    for fn, args in [(lambda g, a, u: _kernel.sq_norms(g, a, u), (g, v, v)), (release, (g, c, v, v, v, v, v))]:
        lowered = export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=[triton_call])(*args)
        text = lowered.mlir_module()
        assert "__gpu$xla.gpu.triton" in text  # a Triton kernel, not Mosaic GPU or a fallback
        assert lowered.platforms == ("cuda",)


def _params(dtype):
    return {"w": jnp.zeros((3, 40), dtype), "b": jnp.zeros((40,), dtype), "h": jnp.zeros((2, 5, 3), dtype)}


def _per_example(params, n, seed, scale):
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map(
        lambda p: jnp.asarray(scale * rng.standard_normal((n,) + p.shape), p.dtype), params
    )


def _rows(tree):
    leaves = jax.tree_util.tree_leaves(tree)
    return np.concatenate([np.asarray(x, np.float64).reshape(leaves[0].shape[0], -1) for x in leaves], axis=1)


def _flat(tree):
    return np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree_util.tree_leaves(tree)])


def _noise(key, params):
    leaves = jax.tree_util.tree_leaves(params)
    _, noise_key = jax.random.split(key)
    keys = jax.random.split(noise_key, len(leaves))
    dt = jnp.promote_types(leaves[0].dtype, jnp.float32)
    return np.concatenate([np.asarray(jax.random.normal(k, p.shape, dt), np.float64).ravel() for k, p in zip(keys, leaves)])


@pytest.mark.parametrize("sigma", [0.0, 1.3])
def test_fused_adaclip_matches_numpy_reference_with_injected_noise(sigma):
    with jax.enable_x64(True):
        params = _params(jnp.float64)
        tx = adaclip_jax.adaclip(noise_multiplier=sigma, expected_batch_size=6.5, key=jax.random.key(3),
                                 use_kernel=True, **MOMENT_KW, preset="patent")
        state = tx.init(params)
        d = _rows(_per_example(params, 1, 0, 1.0)).shape[1]
        mean, std = np.zeros(d), np.full(d, np.sqrt(1e-3 * 2.0))
        step = jax.jit(tx.update)
        for t in range(4):
            g = _per_example(params, 5, t, 0.3 + t)
            z = _noise(state.key, params)
            update, state = step(g, state, params)
            ref, mean, std = reference.adaclip_step(_rows(g), mean, std, z, noise_multiplier=sigma,
                                                    expected_batch_size=6.5, **MOMENT_KW)
            np.testing.assert_allclose(_flat(update), ref, rtol=1e-10, atol=1e-12)
            np.testing.assert_allclose(_flat(state.mean), mean, rtol=1e-10, atol=1e-14)
            np.testing.assert_allclose(_flat(state.std), std, rtol=1e-10, atol=1e-14)
            assert int(state.step) == t + 1


@pytest.mark.parametrize("masked", [False, True])
def test_fused_float32_matches_jnp_path_same_key(masked):
    params = _params(jnp.float32)
    mask = jnp.array([True, False, True, True, False, True]) if masked else None
    outs = []
    for use_kernel in (False, True):
        tx = adaclip_jax.adaclip(noise_multiplier=0.9, expected_batch_size=5.0, key=7, use_kernel=use_kernel, preset="patent")
        state = tx.init(params)
        step = jax.jit(lambda g, s, tx=tx: tx.update(g, s, params, unit_mask=mask))
        res = []
        for t in range(2):
            upd, state = step(_per_example(params, 6, 10 + t, 0.05), state)
            res.append((upd, state.mean, state.std))
        outs.append(res)
    for x, y in zip(jax.tree_util.tree_leaves(outs[0]), jax.tree_util.tree_leaves(outs[1]), strict=True):
        assert x.dtype == y.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-6)


def test_masked_rows_contribute_nothing_in_fused_path():
    params = _params(jnp.float32)
    g = _per_example(params, 4, 1, 1.0)
    poisoned = jax.tree_util.tree_map(lambda x: x.at[3].set(1e6), g)
    mask = jnp.array([True, True, True, False])
    tx = adaclip_jax.adaclip(noise_multiplier=1.0, expected_batch_size=4.0, key=0, use_kernel=True, preset="patent")
    state = tx.init(params)
    step = jax.jit(lambda g: tx.update(g, state, params, unit_mask=mask)[0])
    a, b = step(g), step(poisoned)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_auto_takes_the_kernels_on_gpu_only_and_true_everywhere(monkeypatch):
    """``"auto"``: the compiled kernels on a GPU, the jnp path elsewhere (the interpreter is a
    correctness tool) and with ``axis_name``; ``True``: the kernels; ``False``: never."""
    params = _params(jnp.float32)
    g = _per_example(params, 3, 0, 1.0)
    on_gpu = jax.default_backend() == "gpu"

    def traced(use_kernel, **kw):
        tx = adaclip_jax.adaclip(noise_multiplier=1.0, expected_batch_size=3.0, key=0, use_kernel=use_kernel,
                                 preset="patent", **kw)  # fmt: skip
        return str(jax.make_jaxpr(lambda g, s: tx.update(g, s, params))(g, tx.init(params)))

    for use_kernel, expect in (("auto", on_gpu), (True, True), (False, False)):
        assert ("pallas_call" in traced(use_kernel)) == expect, use_kernel
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert "pallas_call" in traced("auto")
    assert "pallas_call" not in traced(False)
    # a non-patent option: the jnp path whatever the backend
    tx = adaclip_jax.adaclip(noise_multiplier=1.0, expected_batch_size=3.0, key=0, use_kernel="auto")
    assert "pallas_call" not in str(jax.make_jaxpr(lambda g, s: tx.update(g, s, params))(g, tx.init(params)))


def test_use_kernel_validation():
    with pytest.raises(InvalidHyperparameterError, match="use_kernel"):
        adaclip_jax.adaclip(noise_multiplier=1.0, expected_batch_size=3.0, key=0, use_kernel="yes", preset="patent")
    with pytest.raises(InvalidHyperparameterError, match="AdaptiveClipping"):
        from adaclip import FlatClipping

        adaclip_jax.private_aggregate(FlatClipping(1.0), noise_multiplier=1.0, expected_batch_size=3.0,
                                      key=0, use_kernel=True)
    with pytest.raises(InvalidHyperparameterError, match="axis_name"):
        adaclip_jax.adaclip(noise_multiplier=1.0, expected_batch_size=3.0, key=0, use_kernel=True, axis_name="b", preset="patent")


def test_fused_empty_batch_and_clipped_sum_fall_back_to_jnp_path():
    params = _params(jnp.float32)
    kw = dict(noise_multiplier=1.0, expected_batch_size=3.0, key=5)
    fused, plain = adaclip_jax.adaclip(use_kernel=True, **kw, preset="patent"), adaclip_jax.adaclip(use_kernel=False, **kw, preset="patent")
    empty = _per_example(params, 0, 0, 1.0)
    a, sa = fused.update(empty, fused.init(params), params)
    b, sb = plain.update(empty, plain.init(params), params)
    for x, y in zip(jax.tree_util.tree_leaves((a, sa.std)), jax.tree_util.tree_leaves((b, sb.std))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
