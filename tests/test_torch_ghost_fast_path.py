"""The ghost path's fast cases: rank-one weights without positions, and no discarded weight gradients.

* A Linear layer without positions whose ``D = 1/b²`` is of rank one (the factored pooling while
  no clamp bites, a per-tensor scale) takes its transformed norms from two matrix–vector
  products, with no ``(n × out)·(out × in)`` product, and they stay upper bounds.
* In ghost mode autograd does not compute the weight gradients of ghost layers (the ghost path
  forms the clipped sum from the captures): ``weight.grad`` stays untouched, the release is
  bit-identical to the one with the weight gradients computed, and the weight is always put
  back, also when the forward raises.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from adaclip_torch import AdaClip, FlatClip
from adaclip_torch.ghost import GhostLayer
from adaclip_torch.grad_sample.linear import rank_one as _rank_one


class _MatmulShapes(TorchFunctionMode):
    """Records the operand shapes of every matrix product."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[tuple[int, ...], ...]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.matmul, torch.Tensor.__matmul__, torch.mm, torch.bmm, torch.Tensor.matmul):
            self.shapes.append(tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor)))
        return func(*args, **(kwargs or {}))


def _layer(
    n: int = 32, fan_in: int = 40, fan_out: int = 30, seed: int = 0
) -> tuple[GhostLayer, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    module = nn.Linear(fan_in, fan_out)
    x, e = torch.randn(n, fan_in, generator=g), torch.randn(n, fan_out, generator=g)
    per_example = torch.einsum("no,ni->noi", e, x)
    return GhostLayer(module, "linear", [(x, e)], torch.float32, "auto"), per_example


def _rank_one_scale(fan_in: int = 40, fan_out: int = 30, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    r, c = torch.rand(fan_out, generator=g) + 0.1, torch.rand(fan_in, generator=g) + 0.1
    return (r[:, None] * c[None, :]) ** 0.25  # the factored pooling's shape


@pytest.mark.parametrize("centre", [False, True])
def test_rank_one_norm_is_a_tight_upper_bound(centre):
    layer, g = _layer()
    scale = _rank_one_scale()
    a = 0.01 * torch.randn(30, 40, generator=torch.Generator().manual_seed(2)) if centre else None
    exact = (((g.double() - (0 if a is None else a.double())) / scale.double()) ** 2).sum(dim=(1, 2))
    bound = layer.norm("weight", a, scale).double()
    assert bool((bound >= exact).all())
    torch.testing.assert_close(bound, exact, rtol=1e-4, atol=0)


def test_rank_one_norm_without_centre_runs_no_layer_sized_product():
    layer, _ = _layer()
    scale = _rank_one_scale()
    with _MatmulShapes() as rec:
        layer.norm("weight", None, scale)
    layer_sized = [s for s in rec.shapes if (30, 40) in s]
    assert rec.shapes, "the norm ran no matrix product at all"
    assert not layer_sized, f"a (out × in) product ran: {layer_sized}"


def test_general_scale_still_takes_the_product_and_is_exact():
    layer, g = _layer()
    scale = torch.rand(30, 40, generator=torch.Generator().manual_seed(3)) + 0.5  # not rank one
    assert _rank_one(1.0 / scale**2) is None
    with _MatmulShapes() as rec:
        bound = layer.norm("weight", None, scale).double()
    assert any((30, 40) in s for s in rec.shapes)
    exact = ((g.double() / scale.double()) ** 2).sum(dim=(1, 2))
    assert bool((bound >= exact).all())
    torch.testing.assert_close(bound, exact, rtol=1e-4, atol=0)


def test_rank_one_rejects_non_finite_and_non_positive_entries():
    d = 1.0 / _rank_one_scale() ** 2
    assert _rank_one(d) is not None
    for bad in (float("nan"), float("inf"), 0.0, -1.0):
        broken = d.clone()
        broken[7, 11] = bad
        assert _rank_one(broken) is None, bad


# --------------------------------------------------------------------------- weight gradients


def _mlp(first_bias: bool = False) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 16, bias=first_bias), nn.Tanh(), nn.Linear(16, 5))


def _train(skip: bool, cls=AdaClip, steps: int = 3) -> tuple[list[torch.Tensor], list[bool]]:
    model = _mlp()
    x, y = torch.randn(24, 12, generator=torch.Generator().manual_seed(4)), torch.arange(24) % 5
    opt = cls(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=0.5,
              expected_batch_size=24.0, seed=3, per_sample_mode="auto")  # fmt: skip
    if not skip:
        opt.grad_sample_hooks.capture_only(opt.grad_sample_hooks._capture, skip_weight_grads=False)
    untouched = []
    for _ in range(steps):
        nn.functional.cross_entropy(model(x), y).backward()
        untouched = [model[0].weight.grad is None, model[2].weight.grad is None]
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()], untouched


@pytest.mark.parametrize("cls", [AdaClip, FlatClip])
def test_skipped_weight_gradients_release_the_same_step(cls):
    skipped, untouched = _train(True, cls)
    computed, untouched_computed = _train(False, cls)
    for a, b in zip(skipped, computed, strict=True):
        assert torch.equal(a, b)
    # the second layer has a bias: its weight gradient is skipped; the first (no bias, an input
    # that needs no gradient) keeps its weight attached so that its output gradient exists
    assert untouched == [False, True]
    assert untouched_computed == [False, False]


def test_weight_is_put_back_when_the_forward_raises():
    model = _mlp(first_bias=True)
    weights = [model[0].weight, model[2].weight]
    FlatClip(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=0.5, max_grad_norm=1.0,
             expected_batch_size=4.0, per_sample_mode="ghost")  # fmt: skip
    with pytest.raises(RuntimeError):
        model(torch.randn(4, 13))  # wrong width: the first layer raises inside its forward
    assert model[0].weight is weights[0] and isinstance(model[0].weight, nn.Parameter)
    model(torch.randn(4, 12)).sum().backward()
    assert [m.weight is w for m, w in zip((model[0], model[2]), weights, strict=True)] == [True, True]
    assert dict(model.named_parameters())["0.weight"] is weights[0]


def test_no_swap_without_gradients_and_after_remove_hooks():
    model = _mlp(first_bias=True)
    opt = FlatClip(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=0.5,
                   max_grad_norm=1.0, expected_batch_size=4.0, per_sample_mode="auto")  # fmt: skip
    seen = []
    model[2].register_forward_pre_hook(lambda m, a: seen.append(m.weight.requires_grad))
    with torch.no_grad():
        model(torch.randn(4, 12))
    model(torch.randn(4, 12))
    opt.remove_hooks()
    model(torch.randn(4, 12)).sum().backward()
    # hooks run in registration order: ours swapped before this probe in the second call only
    assert seen == [True, False, True]
    assert model[2].weight.grad is not None
