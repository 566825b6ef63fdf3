"""AdaCliP with ``pooling="tensor"`` (``AdaClip()``'s default) keeps one number per tensor.

The statistics ``s`` and the variance accumulator of a tensor-pooled strategy are uniform within
each tensor, so the core reads them at one coordinate, pools the released signal with one dot
product, runs the EMA on the numbers and builds the scale ``b`` as one 0-d array per tensor,
which the clipping and the release broadcast like flat clipping's ``C``. The maths is unchanged:
the per-coordinate forms (the NumPy reference, ``test_core_adaptive_options.py``) agree within
float rounding. Here: the scale's shape, the number of passes over a tensor a release makes
(the speed this buys), the per-tensor formulas against the per-coordinate ones, and restored
states that break the invariant refused.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from adaclip import adaptive, mechanism, transform
from adaclip import strategies as S
from adaclip.errors import InvalidHyperparameterError

SHAPES = [(30, 20), (30,), ()]
D = sum(math.prod(s) for s in SHAPES)


def _trained(strategy, steps=3, *, xp=np, seed=0):
    rng = np.random.default_rng(seed)
    as_array = (lambda a: torch.as_tensor(a)) if xp is torch else np.asarray
    params = [as_array(rng.normal(size=s)) for s in SHAPES]
    state = strategy.init(params)
    for _ in range(steps):
        grads = [as_array(0.3 + rng.normal(size=(5, *s))) for s in SHAPES]
        noise = [as_array(rng.normal(size=s)) for s in SHAPES]
        _, state = S.private_step(strategy, state, grads, noise, noise_multiplier=0.8, expected_batch_size=5.0)
    return state


@pytest.mark.parametrize("xp", [np, torch], ids=["numpy", "torch"])
@pytest.mark.parametrize(
    "options",
    [dict(), dict(scale="coupled", preset="patent", pooling="tensor")],
    ids=["default preset", "coupled+tensor"],
)
def test_the_scale_is_one_number_per_tensor(xp, options):
    strategy = S.adaptive_clipping(D, **options)
    state = _trained(strategy, xp=xp)
    _, scale = strategy.transform(state, len(SHAPES))
    assert [tuple(b.shape) for b in scale] == [(), (), ()]
    # the stored statistics stay one number across each tensor
    for s in state.std + list((state.extra or {}).get("variance", [])):
        assert bool((s == s.reshape(-1)[0]).all())
    # negative control: per-coordinate statistics keep a per-coordinate scale
    coordinate = S.adaptive_clipping(D, pooling="coordinate")
    _, scale = coordinate.transform(_trained(coordinate, xp=xp), len(SHAPES))
    assert [tuple(b.shape) for b in scale] == SHAPES


def test_per_tensor_scale_equals_the_per_coordinate_forms():
    rng = np.random.default_rng(1)
    values = [np.float64(v) for v in rng.uniform(0.01, 2.0, size=len(SHAPES))]
    full = [np.full(s, v) for s, v in zip(SHAPES, values, strict=True)]
    sizes = [math.prod(s) for s in SHAPES]
    for power in (0.5, 1.0, 0.7):
        got = adaptive.per_tensor_scale(values, sizes, scale="separated", clip_norm=1.7, power=power)
        want = adaptive.separated_scale(full, 1.7, power)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(np.broadcast_to(g, w.shape), w, rtol=1e-13)
    got = adaptive.per_tensor_scale(values, sizes, scale="coupled")
    for g, w in zip(got, transform.auxiliary_scale(full), strict=True):
        np.testing.assert_allclose(np.broadcast_to(g, w.shape), w, rtol=1e-13)
    assert float(adaptive.mean_square(np.arange(6.0).reshape(2, 3))) == pytest.approx(55 / 6, rel=1e-15)


class _Passes(TorchDispatchMode):
    """Counts the operations that write an array of at least ``size`` elements (views excluded:
    they move no data)."""

    VIEWS = {"view", "_unsafe_view", "permute", "unsqueeze", "expand", "reshape", "t", "transpose", "alias", "squeeze"}

    def __init__(self, size):
        super().__init__()
        self.size, self.ops = size, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if isinstance(out, torch.Tensor) and out.numel() >= self.size and name not in self.VIEWS:
            self.ops.append(name)
        return out


def _release_passes(strategy):
    shapes = [(300, 200), (300,)]
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=gen) for s in shapes]
    state = strategy.init(params)
    grads = [torch.randn(8, *s, generator=gen) for s in shapes]
    summed = mechanism.clip_and_sum(strategy, state, grads)
    noise = [torch.randn(s, generator=gen) for s in shapes]
    with _Passes(300 * 200) as passes:
        mechanism.release(strategy, state, summed, noise, noise_multiplier=1.0, expected_batch_size=8.0)
    return passes.ops


def test_the_default_release_makes_few_passes_over_a_tensor():
    """The release of ``AdaClip()``'s default preset (noise, rescale, centre, statistics, centre
    EMA) writes the largest tensor 11 times: flat clipping's 4 (noise, add, ÷B̄, ×C), the centre's
    add, the deviation ``g̃ − a``, the two stored statistics, and the centre's EMA (3). Before the
    statistics were kept as one number per tensor it was 22 (full-size scale, noise variance,
    squares, pooled mean broadcast, EMA and clamp)."""
    flat = _release_passes(S.FlatClipping(max_grad_norm=1.0))
    default = _release_passes(S.adaptive_clipping(300 * 200 + 300))
    assert len(flat) == 4, flat
    assert len(default) <= 11, default
    # negative control: the per-coordinate statistics do pass over the tensor for each operation
    coordinate = _release_passes(S.adaptive_clipping(300 * 200 + 300, pooling="coordinate"))
    assert len(coordinate) >= 18, coordinate


def test_restored_statistics_that_are_not_one_number_per_tensor_are_refused():
    strategy = S.adaptive_clipping(D)
    like = strategy.init([np.zeros(s) for s in SHAPES])
    state = _trained(strategy)
    assert strategy.check_state(state, like).step == 3  # what the strategy wrote passes
    std = [s.copy() for s in state.std]
    std[0][1, 2] *= 1.01
    with pytest.raises(InvalidHyperparameterError, match=r"clip_state\['std'\] for tensor 0 is not one number"):
        strategy.check_state(state._replace(std=std), like)
    variance = [v.copy() for v in state.extra["variance"]]
    variance[1][3] += 0.5
    extra = dict(state.extra, variance=variance)
    with pytest.raises(InvalidHyperparameterError, match=r"\['variance'\] for tensor 1 is not one number"):
        mechanism.check_state(strategy, state._replace(extra=extra), like, source="checkpoint")
    # per-coordinate pooling accepts the same non-uniform statistics
    coordinate = S.adaptive_clipping(D, pooling="coordinate")
    c_like = coordinate.init([np.zeros(s) for s in SHAPES])
    c_state = _trained(coordinate)
    c_std = [s.copy() for s in c_state.std]
    c_std[0][1, 2] *= 1.01
    assert coordinate.check_state(c_state._replace(std=c_std), c_like).step == 3


def test_the_torch_wrapper_refuses_such_a_checkpoint_and_changes_nothing():
    import copy

    from adaclip_torch import AdaClip

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    opt = AdaClip(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=1.0,
                  expected_batch_size=4, seed=3)  # fmt: skip
    x, y = torch.randn(4, 6), torch.randint(0, 2, (4,))
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    saved = copy.deepcopy(opt.state_dict())
    assert all(tuple(s.shape) == tuple(p.shape) for s, p in zip(saved["clip_state"]["std"], model.parameters()))
    bad = copy.deepcopy(saved)
    bad["clip_state"]["std"][0][0, 0] *= 1.5
    before = copy.deepcopy(opt.state_dict()["clip_state"])
    with pytest.raises(InvalidHyperparameterError, match=r"clip_state\['std'\] for '0.weight' is not one number"):
        opt.load_state_dict(bad)
    after = opt.state_dict()["clip_state"]
    assert all(torch.equal(a, b) for a, b in zip(after["std"], before["std"], strict=True)) and opt.steps == 1
    opt.load_state_dict(saved)  # what it wrote loads (a checkpoint of the previous version has the same form)
    assert opt.steps == 1


# --------------------------------------------------------------------------- ghost norms with one number b


@pytest.mark.parametrize("seq", [1, 4])
def test_ghost_norms_with_a_centre_and_one_number_scale_take_the_cheap_forms(seq, monkeypatch):
    """``AdaClip()``'s default gives each tensor one number ``b`` and a centre: sequence layers
    take the Gram form (not the transient per-example gradients), the centre's terms need no
    pass over the weight, and the result is an upper bound within rounding of the direct norm,
    also in float32 with a large centre (never under-clips)."""
    from adaclip_torch import ghost

    calls = []
    exact = ghost.GhostLayer._exact
    monkeypatch.setattr(ghost.GhostLayer, "_exact", lambda self, *a: calls.append(1) or exact(self, *a))
    gen = torch.Generator().manual_seed(seq)
    n, in_f, out_f, dt = 6, 12, 10, torch.float64  # T·(in + out) ≤ in·out: the cheap forms apply
    x = torch.randn(n, seq, in_f, generator=gen, dtype=dt)
    e = torch.randn(n, seq, out_f, generator=gen, dtype=dt)
    ref = torch.einsum("nto,ntk->nok", e, x)
    scale = torch.tensor(0.37, dtype=dt)
    centre = torch.randn(out_f, in_f, generator=gen, dtype=dt) * 0.3
    module = torch.nn.Linear(in_f, out_f).to(dt)
    layer = ghost.GhostLayer(module, "linear", [(x, e)], dt, "auto")
    got = layer.norm("weight", centre, scale)
    want = transform.transformed_sq_norms([ref], [centre], [scale])[0]
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    assert bool((got >= want * (1 - 1e-15)).all()) and not calls
    # float32, centre far from the units: the bound stays above the float64 norm
    f32 = torch.float32
    far = ref.mean(0) + 1e3 * float(scale) * torch.randn(out_f, in_f, generator=gen, dtype=dt) / math.sqrt(in_f * out_f)
    want = transform.transformed_sq_norms([ref], [far], [scale])[0]
    layer = ghost.GhostLayer(torch.nn.Linear(in_f, out_f), "linear", [(x.to(f32), e.to(f32))], f32, "auto")
    got = layer.norm("weight", far.to(f32), scale.to(f32)).to(dt)
    assert bool((got >= want).all()), float((want - got).max())


def test_embedding_ghost_norms_with_a_centre_and_one_number_scale():
    from adaclip_torch import ghost

    gen = torch.Generator().manual_seed(5)
    num, dim, n, length, dt = 40, 6, 5, 7, torch.float64
    module = torch.nn.Embedding(num, dim).to(dt)
    ids = torch.randint(0, num, (n, length), generator=gen)
    e = torch.randn(n, length, dim, generator=gen, dtype=dt)
    ref = torch.zeros(n, num, dim, dtype=dt)
    for i in range(n):
        ref[i].index_add_(0, ids[i], e[i])
    centre = torch.randn(num, dim, generator=gen, dtype=dt) * 0.2
    scale = torch.tensor(0.8, dtype=dt)
    layer = ghost.GhostLayer(module, "embedding", [(ids, e)], dt, "auto")
    got = layer.norm("weight", centre, scale)
    want = transform.transformed_sq_norms([ref], [centre], [scale])[0]
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    assert bool((got >= want * (1 - 1e-15)).all())


def test_an_update_given_a_per_coordinate_scale_still_stores_one_number_per_tensor():
    """``update`` with a scale shaped like the parameters (a caller's, not ``transform``'s) takes
    the per-coordinate path, which pools: the stored statistics stay one number per tensor, so
    the strategy's own state passes ``check_state``."""
    strategy = S.adaptive_clipping(D)
    like = strategy.init([np.zeros(s) for s in SHAPES])
    state = _trained(strategy)
    rng = np.random.default_rng(7)
    scale = [np.full(s, 0.3) * rng.uniform(0.5, 2.0, size=s) for s in SHAPES]
    grads = [rng.normal(size=s) for s in SHAPES]
    new = strategy.update(state, grads, scale, noise_multiplier=0.8, expected_batch_size=5.0)
    for s in new.std + new.extra["variance"]:
        assert bool((np.asarray(s) == np.asarray(s).reshape(-1)[0]).all())
    assert strategy.check_state(new, like).step == 4
