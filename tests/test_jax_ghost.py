"""adaclip_jax.ghost_clipped_sum_grads (ghost norms from the jaxpr) against the materialised path.

The reference is :func:`adaclip_jax.clipped_sum_grads` (``vmap(grad)`` and the core's
``clip_and_sum``) on the same inputs and state; the full step is compared through ``tx.update``
with the same key (the same noise). The comparisons run with full-precision float32 products
(:func:`_true_float32`): on a GPU XLA's default is TF32, and the two paths' own products then
differ by about ``10^-3``, which says nothing about the ghost maths. The ghost path's norm and
sum products run at full precision whatever the user's setting
(:func:`test_norm_and_sum_products_run_at_full_precision`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import adaclip_jax
from adaclip import transform as adaclip_transform
from adaclip.errors import InvalidHyperparameterError
from adaclip_jax import ghost as ghost_mod

pytestmark = pytest.mark.jax


@pytest.fixture(autouse=True)
def _true_float32():
    """Both paths' products in true float32 (a no-op on a CPU, TF32 off on a GPU)."""
    with jax.default_matmul_precision("highest"):
        yield


# ------------------------------------------------------------------ models (per-example losses)
def mlp_loss(p, x, y):
    h = jax.nn.relu(x @ p["w1"] + p["b1"])
    logits = h @ p["w2"] + p["b2"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y)


def tied_loss(p, x, y):
    """The same matrix encodes and decodes (tied weights): two uses of one leaf."""
    h = jnp.tanh(x @ p["w"] + p["b"])
    return jnp.sum((h @ p["w"].T - x) ** 2) + 0.1 * y


def seq_loss(p, x, y):
    """Dense over T positions (x: (T, in)), then a head on the mean; W2 applied as ``W2ᵀ h``."""
    h = jnp.tanh(x @ p["w1"] + p["b1"])  # (T, hidden)
    z = p["w2"].T @ h.mean(0)  # parameter on the left of the dot_general, through a transpose
    return (jnp.sum(z) - y) ** 2


def long_seq_loss(p, x, y):
    """Many positions, few features: T(K + F) > K·F, so the layer's gradients are formed."""
    h = x @ p["w"] + p["b"]  # x: (T, 3), w: (3, 2)
    return jnp.sum(jnp.sin(h)) * y


def conv_loss(p, x, y):
    """A convolution (not a Dense layer: falls back to vmap(grad)) before a Dense head."""
    img = x.reshape(1, 1, 6, 6)
    c = jax.lax.conv_general_dilated(img, p["c"], (1, 1), "SAME", dimension_numbers=("NCHW", "OIHW", "NCHW"))
    logits = jax.nn.relu(c).reshape(-1) @ p["d"] + p["b"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y)


def jitted_layer_loss(p, x, y):
    """The Dense layer inside a jitted helper (a ``jit`` sub-jaxpr, inlined by the tap)."""
    dense = jax.jit(lambda w, b, v: jnp.tanh(v @ w + b))
    return (jnp.sum(dense(p["w"], p["b"], x)) - y) ** 2


def _normal(rng, shape, dtype, scale=1.0):
    return jnp.asarray(scale * rng.standard_normal(shape), dtype)


def make(model, n=8, dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    if model == "mlp":
        p = {"w1": _normal(rng, (5, 7), dtype), "b1": _normal(rng, (7,), dtype),
             "w2": _normal(rng, (7, 3), dtype), "b2": _normal(rng, (3,), dtype)}  # fmt: skip
        return mlp_loss, p, _normal(rng, (n, 5), dtype), jnp.asarray(rng.integers(0, 3, n))
    if model == "tied":
        p = {"w": _normal(rng, (4, 6), dtype, 0.5), "b": _normal(rng, (6,), dtype)}
        return tied_loss, p, _normal(rng, (n, 4), dtype), _normal(rng, (n,), dtype)
    if model == "seq":
        p = {"w1": _normal(rng, (6, 8), dtype, 0.5), "b1": _normal(rng, (8,), dtype),
             "w2": _normal(rng, (8, 3), dtype)}  # fmt: skip
        return seq_loss, p, _normal(rng, (n, 3, 6), dtype), _normal(rng, (n,), dtype)
    if model == "long_seq":
        p = {"w": _normal(rng, (3, 2), dtype), "b": _normal(rng, (2,), dtype)}
        return long_seq_loss, p, _normal(rng, (n, 20, 3), dtype), _normal(rng, (n,), dtype)
    if model == "conv":
        p = {"c": _normal(rng, (2, 1, 3, 3), dtype, 0.5), "d": _normal(rng, (72, 4), dtype, 0.2),
             "b": _normal(rng, (4,), dtype)}  # fmt: skip
        return conv_loss, p, _normal(rng, (n, 36), dtype), jnp.asarray(rng.integers(0, 4, n))
    if model == "jitted_layer":
        p = {"w": _normal(rng, (5, 4), dtype), "b": _normal(rng, (4,), dtype)}
        return jitted_layer_loss, p, _normal(rng, (n, 5), dtype), _normal(rng, (n,), dtype)
    raise AssertionError(model)


def private(kind, n, **kw):
    common = dict(noise_multiplier=0.7, expected_batch_size=float(n), key=7, **kw)
    if kind == "flat":
        return adaclip_jax.flat_clip(max_grad_norm=0.7, **common)
    if kind == "per_layer":
        return adaclip_jax.per_layer_clip(max_grad_norm=0.9, **common)
    if kind == "quantile":
        return adaclip_jax.quantile_clip(max_grad_norm=0.8, **common)
    if kind == "automatic":
        return adaclip_jax.automatic_clip(max_grad_norm=0.5, **common)
    if kind == "scaled":
        return adaclip_jax.scaled_clip(max_grad_norm=0.6, layer_scales=(1.0, 0.5, 2.0, 1.5), **common)
    raise AssertionError(kind)


def assert_sums_close(a, b, **kw):
    assert jax.tree_util.tree_structure(a.summed) == jax.tree_util.tree_structure(b.summed)
    for u, v in zip(jax.tree_util.tree_leaves(a.summed), jax.tree_util.tree_leaves(b.summed), strict=True):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), **kw)
    assert len(a.auxiliary) == len(b.auxiliary)
    for u, v in zip(a.auxiliary, b.auxiliary, strict=True):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), **kw)


def both(model, tx_kind="flat", *, n=8, dtype=jnp.float32, unit_mask=None, seed=0):
    loss, p, x, y = make(model, n=n, dtype=dtype, seed=seed)
    tx = private(tx_kind, n)
    state = tx.init(p)
    ghost = jax.jit(adaclip_jax.ghost_clipped_sum_grads(loss, tx, batch_argnums=(1, 2)))
    ref = jax.jit(adaclip_jax.clipped_sum_grads(loss, tx, batch_argnums=(1, 2)))
    return ghost(state, p, x, y, unit_mask=unit_mask), ref(state, p, x, y, unit_mask=unit_mask)


# ------------------------------------------------------------------ coverage
@pytest.mark.parametrize(
    ("model", "expected"),
    [
        ("mlp", {"w1": "dense", "b1": "bias", "w2": "dense", "b2": "bias"}),
        ("tied", {"w": "fallback", "b": "bias"}),
        ("seq", {"w1": "dense", "b1": "bias", "w2": "dense"}),
        ("long_seq", {"w": "dense", "b": "bias"}),
        ("conv", {"c": "fallback", "d": "dense", "b": "bias"}),
        ("jitted_layer", {"w": "dense", "b": "bias"}),
    ],
)
def test_coverage_finds_dense_layers(model, expected):
    """The tap recognises every Dense weight and bias (a regression to the fallback shows here)."""
    loss, p, x, y = make(model)
    assert adaclip_jax.ghost_coverage(loss, p, x, y, batch_argnums=(1, 2)) == expected


def test_batch_axis_is_not_guessed_from_sizes():
    """An activation that has ``n`` rows but no batch axis (a product of parameters) is not
    taken for a per-example input: the axis must change size with the batch."""

    def loss(p, x):
        m = p["a"] @ p["b"]  # (4, 4): no batch, although n = 4
        return jnp.sum(x @ m @ p["c"])

    rng = np.random.default_rng(3)
    p = {"a": _normal(rng, (4, 3), jnp.float32), "b": _normal(rng, (3, 4), jnp.float32),
         "c": _normal(rng, (4, 2), jnp.float32)}  # fmt: skip
    x = _normal(rng, (4, 4), jnp.float32)
    cov = adaclip_jax.ghost_coverage(loss, p, x)
    assert cov == {"a": "fallback", "b": "fallback", "c": "dense"}
    tx = private("flat", 4)
    got = adaclip_jax.ghost_clipped_sum_grads(loss, tx)(tx.init(p), p, x)
    want = adaclip_jax.clipped_sum_grads(loss, tx)(tx.init(p), p, x)
    assert_sums_close(got, want, rtol=1e-5, atol=1e-6)


def test_unused_leaf_costs_nothing():
    """A leaf the loss never reads has gradient 0 (no fallback pass for it)."""
    loss, p, x, y = make("mlp")
    p = dict(p, spare=jnp.ones((3, 2), jnp.float32))
    cov = adaclip_jax.ghost_coverage(loss, p, x, y, batch_argnums=(1, 2))
    assert cov["spare"] == "unused" and cov["w1"] == "dense"
    tx = private("flat", 8)
    got = adaclip_jax.ghost_clipped_sum_grads(loss, tx, batch_argnums=(1, 2))(tx.init(p), p, x, y)
    want = adaclip_jax.clipped_sum_grads(loss, tx, batch_argnums=(1, 2))(tx.init(p), p, x, y)
    assert_sums_close(got, want, rtol=1e-5, atol=1e-6)
    assert not np.asarray(got.summed["spare"]).any()


# ------------------------------------------------------------------ precision of the norm and sum products
def _dot_precisions(jaxpr) -> list[tuple[tuple[int, ...], object]]:
    """``(output shape, precision)`` of every ``dot_general`` in ``jaxpr`` and its sub-jaxprs."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.append((tuple(eqn.outvars[0].aval.shape), eqn.params["precision"]))
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", None)
                if inner is not None:
                    found.extend(_dot_precisions(getattr(inner, "jaxpr", inner)))
    return found


HIGHEST = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)


def highest_mlp_loss(p, x, y):
    """``mlp_loss`` with its own products written at full precision."""
    h = jax.nn.relu(jnp.matmul(x, p["w1"], precision="highest") + p["b1"])
    logits = jnp.matmul(h, p["w2"], precision="highest") + p["b2"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y)


@pytest.mark.parametrize("tx_kind", ["flat", "adaclip"])
def test_norm_and_sum_products_run_at_full_precision(tx_kind):
    """The rounding margins of the ghost norms assume true float32 products; TF32 or bfloat16
    products (a GPU's default, or the user's ``jax_default_matmul_precision``) could make a norm
    bound fall below the norm of the contribution summed: under-clipping. With the user's
    products at full precision, every product in the ghost function must be too; with the user's
    default set to bfloat16, the weight-sum products (output shaped like a weight) still are."""
    _, p, x, y = make("mlp")
    tx = (private("flat", 8) if tx_kind == "flat"
          else adaclip_jax.adaclip(noise_multiplier=0.5, expected_batch_size=8.0, key=3, preset="patent"))  # fmt: skip
    state = tx.init(p)
    ghost = adaclip_jax.ghost_clipped_sum_grads(highest_mlp_loss, tx, batch_argnums=(1, 2))
    with jax.default_matmul_precision("bfloat16"):  # the user's default (overrides the module's fixture)
        found = _dot_precisions(jax.make_jaxpr(ghost)(state, p, x, y).jaxpr)
    assert len(found) >= 6 and all(prec == HIGHEST for _, prec in found), found
    ghost = adaclip_jax.ghost_clipped_sum_grads(mlp_loss, tx, batch_argnums=(1, 2))
    with jax.default_matmul_precision("bfloat16"):
        found = _dot_precisions(jax.make_jaxpr(ghost)(state, p, x, y).jaxpr)
    sums = [prec for shape, prec in found if shape in ((5, 7), (7, 5), (7, 3), (3, 7))]  # either layout
    assert len(sums) >= 2 and all(prec == HIGHEST for prec in sums), found
    assert any(prec != HIGHEST for _, prec in found)  # the user's own pass keeps the user's precision


# ------------------------------------------------------------------ equality with the materialised path
@pytest.mark.parametrize("model", ["mlp", "tied", "seq", "long_seq", "conv", "jitted_layer"])
def test_equals_materialised_float32(model):
    got, want = both(model)
    assert_sums_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("model", ["mlp", "tied", "seq", "long_seq", "conv"])
@pytest.mark.parametrize("tx_kind", ["flat", "per_layer", "quantile", "automatic"])
def test_equals_materialised_float64(model, tx_kind):
    with jax.enable_x64(True):
        got, want = both(model, tx_kind, dtype=jnp.float64)
        assert_sums_close(got, want, rtol=1e-12, atol=1e-13)


def test_scaled_clipping_and_quantile_count():
    got, want = both("mlp", "scaled")
    assert_sums_close(got, want, rtol=1e-5, atol=1e-6)
    got, want = both("mlp", "quantile")
    assert len(got.auxiliary) == 1
    assert_sums_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("model", ["mlp", "seq", "conv"])
def test_unit_mask(model):
    mask = jnp.array([True, False, True, True, False, True, True, False])
    got, want = both(model, "quantile", unit_mask=mask)
    assert_sums_close(got, want, rtol=1e-5, atol=1e-6)
    unmasked, _ = both(model, "quantile")
    assert not np.allclose(np.asarray(got.auxiliary[0]), np.asarray(unmasked.auxiliary[0]))


@pytest.mark.parametrize("model", ["mlp", "seq", "tied"])
def test_batch_of_one(model):
    got, want = both(model, n=1)
    assert_sums_close(got, want, rtol=1e-5, atol=1e-6)


def test_clipping_is_active():
    """The comparison is not trivial: some units are clipped, others not."""
    loss, p, x, y = make("mlp")
    per = adaclip_jax.per_example_grads(loss, batch_argnums=(1, 2))(p, x, y)
    norms = np.sqrt(sum(np.sum(np.asarray(g).reshape(8, -1) ** 2, 1) for g in jax.tree_util.tree_leaves(per)))
    assert (norms > 0.7).any() and (norms < 0.7).any()


def test_nonfinite_unit_is_dropped():
    """A unit whose gradient is NaN gets the factor 0, as on the materialised path, and cannot
    reach the sum."""
    loss, p, x, y = make("mlp")
    x = x.at[3, 0].set(jnp.nan)
    tx = private("flat", 8)
    got = adaclip_jax.ghost_clipped_sum_grads(loss, tx, batch_argnums=(1, 2))(tx.init(p), p, x, y)
    want = adaclip_jax.clipped_sum_grads(loss, tx, batch_argnums=(1, 2))(tx.init(p), p, x, y)
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree_util.tree_leaves(got.summed))
    assert_sums_close(got, want, rtol=1e-5, atol=1e-6)


def test_full_update_same_noise():
    """The released update through tx.update (same key, σ > 0) equals the materialised one."""
    loss, p, x, y = make("mlp")
    inner = private("quantile", 8)
    tx = optax.chain(inner, optax.sgd(0.1))
    ghost = adaclip_jax.ghost_clipped_sum_grads(loss, inner, batch_argnums=(1, 2))
    per_ex = adaclip_jax.per_example_grads(loss, batch_argnums=(1, 2))

    @jax.jit
    def step_ghost(params, state):
        u, state = tx.update(ghost(state[0], params, x, y), state, params)
        return optax.apply_updates(params, u), state

    @jax.jit
    def step_ref(params, state):
        u, state = tx.update(per_ex(params, x, y), state, params)
        return optax.apply_updates(params, u), state

    pa, sa = p, tx.init(p)
    pb, sb = p, tx.init(p)
    for _ in range(3):  # the quantile rule's C_t moves with the released counts
        pa, sa = step_ghost(pa, sa)
        pb, sb = step_ref(pb, sb)
        for u, v in zip(jax.tree_util.tree_leaves(pa), jax.tree_util.tree_leaves(pb), strict=True):
            np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(sa[0].extra["clip_norm"]), np.asarray(sb[0].extra["clip_norm"]), rtol=1e-6)


# ------------------------------------------------------------------ rounding: upper bounds only
def test_gram_norm_is_an_upper_bound_under_cancellation():
    """Positions that cancel (x_s ≈ −x_t with δ_s ≈ δ_t) make the Gram sum a small difference of
    large terms; the float32 bound must still be ≥ the exact norm (over-clip, never under-clip)."""
    rng = np.random.default_rng(11)
    n, t, k, f = 64, 4, 16, 16
    base_x = rng.standard_normal((n, 1, k)) * 1e3
    base_d = rng.standard_normal((n, 1, f))
    x = np.concatenate([base_x, -base_x + 1e-3 * rng.standard_normal((n, 1, k)), rng.standard_normal((n, t - 2, k))], 1)
    d = np.concatenate([base_d, base_d + 1e-3 * rng.standard_normal((n, 1, f)), rng.standard_normal((n, t - 2, f))], 1)
    exact = np.sum(np.einsum("ntk,ntf->nkf", x, d) ** 2, axis=(1, 2))  # float64
    bound = np.asarray(
        ghost_mod._dense_sq_norm(jnp.asarray(x, jnp.float32), jnp.asarray(d, jnp.float32), jnp.float32(1.0)),
        np.float64,
    )
    # The float32 inputs are themselves rounded; compare against the exact norm of those inputs.
    x32, d32 = np.asarray(jnp.asarray(x, jnp.float32), np.float64), np.asarray(jnp.asarray(d, jnp.float32), np.float64)
    exact = np.sum(np.einsum("ntk,ntf->nkf", x32, d32) ** 2, axis=(1, 2))
    assert (bound >= exact).all()
    # Negative control: the plain float32 Gram estimate without the error term does fall below.
    gx = np.einsum("ntk,nsk->nts", x.astype(np.float32), x.astype(np.float32))
    gd = np.einsum("ntf,nsf->nts", d.astype(np.float32), d.astype(np.float32))
    plain = np.sum((gx * gd).astype(np.float32), axis=(1, 2), dtype=np.float32).astype(np.float64)
    assert (plain < exact).any()


def test_single_position_norm_is_an_upper_bound():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((128, 1, 300)).astype(np.float32)
    d = rng.standard_normal((128, 1, 200)).astype(np.float32)
    exact = np.sum(np.einsum("ntk,ntf->nkf", x.astype(np.float64), d.astype(np.float64)) ** 2, axis=(1, 2))
    bound = np.asarray(ghost_mod._dense_sq_norm(jnp.asarray(x), jnp.asarray(d), jnp.float32(1.0)), np.float64)
    assert (bound >= exact).all()
    assert (bound <= exact * (1 + 1e-4)).all()


# ------------------------------------------------------------------ AdaCliP (centre and per-coordinate scale)
@pytest.mark.parametrize("model", ["mlp", "seq", "tied", "conv"])
@pytest.mark.parametrize("preset", ["patent", None])
def test_adaclip_steps_equal_materialised_float64(model, preset):
    """Three AdaCliP steps (the later ones clip around a non-zero centre with a per-coordinate
    scale) through tx.update, with the same noise, equal the materialised path."""
    mask = jnp.array([True, True, False, True, True, True, False, True])
    with jax.enable_x64(True):
        loss, p, x, y = make(model, dtype=jnp.float64)
        kw = {"preset": preset} if preset else {}
        tx = adaclip_jax.adaclip(noise_multiplier=0.5, expected_batch_size=6.0, key=3, std_min=1e-3, **kw)
        ghost = adaclip_jax.ghost_clipped_sum_grads(loss, tx, batch_argnums=(1, 2))
        per_ex = adaclip_jax.per_example_grads(loss, batch_argnums=(1, 2))

        @jax.jit
        def step_ghost(state):
            return tx.update(ghost(state, p, x, y, unit_mask=mask), state, p)

        @jax.jit
        def step_ref(state):
            return tx.update(per_ex(p, x, y), state, p, unit_mask=mask)

        sa = sb = tx.init(p)
        for _ in range(3):
            ua, sa = step_ghost(sa)
            ub, sb = step_ref(sb)
            for u, v in zip(jax.tree_util.tree_leaves(ua), jax.tree_util.tree_leaves(ub), strict=True):
                np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=1e-9, atol=1e-12)
        if sa.mean is not None:
            assert any(np.abs(np.asarray(m)).max() > 0 for m in jax.tree_util.tree_leaves(sa.mean))


def test_adaclip_float32_clipped_sum_close():
    loss, p, x, y = make("mlp")
    tx = adaclip_jax.adaclip(noise_multiplier=0.5, expected_batch_size=8.0, key=3, std_min=1e-3, preset="patent")
    state = tx.init(p)
    ghost = jax.jit(adaclip_jax.ghost_clipped_sum_grads(loss, tx, batch_argnums=(1, 2)))
    ref = jax.jit(adaclip_jax.clipped_sum_grads(loss, tx, batch_argnums=(1, 2)))
    for _ in range(2):
        got, want = ghost(state, p, x, y), ref(state, p, x, y)
        assert_sums_close(got, want, rtol=1e-4, atol=1e-5)
        _, state = jax.jit(tx.update)(want, state, p)


def test_coordinatewise_bound_under_cancellation():
    """A centre far from every unit (‖a/b‖ ≫ ‖(g − a)/b‖) makes A − 2B + C cancel in float32;
    the bound (error term, then the exact norm where it is loose) stays ≥ the exact norm."""
    rng = np.random.default_rng(2)
    n, k, f = 32, 12, 9
    x = rng.standard_normal((n, 1, k))
    d = rng.standard_normal((n, 1, f))
    g = np.einsum("ntk,ntf->nkf", x, d)
    centre = g.mean(0) + 300.0 * rng.standard_normal((k, f))
    scale = np.exp(rng.standard_normal((k, f)))
    x32, d32 = (jnp.asarray(v, jnp.float32) for v in (x, d))
    c32, s32 = jnp.asarray(centre, jnp.float32), jnp.asarray(scale, jnp.float32)
    bound = np.asarray(ghost_mod._dense_sq_norm_coordinatewise(x32, d32, c32, s32), np.float64)
    xs, ds, cs, ss = (np.asarray(v, np.float64) for v in (x32, d32, c32, s32))
    exact = np.sum(((np.einsum("ntk,ntf->nkf", xs, ds) - cs) / ss) ** 2, axis=(1, 2))
    assert (bound >= exact).all()
    # Every unit here is loose, so each took the core's direct bound of its formed gradient.
    direct = adaclip_transform.transformed_sq_norms([jnp.einsum("ntk,ntf->nkf", x32, d32)], [c32], [s32])[0]
    np.testing.assert_allclose(bound, np.asarray(direct, np.float64), rtol=1e-6)
    # Negative control: the expansion alone in float32 misses it for some unit.
    dm = (1.0 / s32) ** 2
    x1, d1 = x32[:, 0], d32[:, 0]
    plain = np.asarray(
        jnp.sum(((x1 * x1) @ dm) * (d1 * d1), 1) - 2 * jnp.sum((x1 @ (dm * c32)) * d1, 1) + jnp.sum(dm * c32 * c32),
        np.float64,
    )
    assert (plain < exact).any()


def test_parameters_not_first():
    """argnums=1 (the batch first): the taps find the parameters among the flattened inputs."""
    loss, p, x, y = make("mlp")

    def swapped(batch_x, params, batch_y):
        return loss(params, batch_x, batch_y)

    assert adaclip_jax.ghost_coverage(swapped, x, p, y, argnums=1, batch_argnums=(0, 2))["w1"] == "dense"
    tx = private("flat", 8)
    got = adaclip_jax.ghost_clipped_sum_grads(swapped, tx, argnums=1, batch_argnums=(0, 2))(tx.init(p), x, p, y)
    want = adaclip_jax.clipped_sum_grads(loss, tx, batch_argnums=(1, 2))(tx.init(p), p, x, y)
    assert_sums_close(got, want, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ refusals
def test_unsupported_scale_shape_is_refused():
    """A strategy whose scale is neither per tensor nor per coordinate is refused, not guessed."""
    import dataclasses

    from adaclip.strategies import FlatClipping

    @dataclasses.dataclass(frozen=True)
    class OddScale(FlatClipping):
        def transform(self, state, num_tensors):
            return None, [jnp.ones((2,))] * num_tensors

    class Holder:
        strategy = OddScale(max_grad_norm=1.0)

    loss, p, x, y = make("mlp")
    tx = private("flat", 8)
    fn = adaclip_jax.ghost_clipped_sum_grads(loss, Holder(), batch_argnums=(1, 2))
    with pytest.raises(InvalidHyperparameterError, match="neither per tensor nor per coordinate"):
        fn(tx.init(p), p, x, y)


def test_bad_arguments():
    loss, p, x, y = make("mlp")
    tx = private("flat", 8)
    with pytest.raises(InvalidHyperparameterError, match="not a chain"):
        adaclip_jax.ghost_clipped_sum_grads(loss, optax.chain(tx, optax.sgd(0.1)))
    with pytest.raises(InvalidHyperparameterError, match="argnums"):
        adaclip_jax.ghost_clipped_sum_grads(loss, tx, argnums=1, batch_argnums=1)
    with pytest.raises(InvalidHyperparameterError, match="argnums"):
        adaclip_jax.ghost_clipped_sum_grads(loss, tx, argnums=True)
