"""One registry of layer rules: a layer type's per-sample rule and its ghost form (norms and
weighted sums) are registered together and live in one file; a new layer type takes the ghost
path by registering both, with nothing in the ghost engine edited."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from adaclip_torch import AdaClip, FlatClip
from adaclip_torch.ghost import GhostLayer, ghost_kind, ghost_modules
from adaclip_torch.grad_sample import GRAD_SAMPLERS, register_grad_sampler
from adaclip_torch.grad_sample.linear import LinearGhost

DT = torch.float64


class Affine(nn.Module):
    """A user's own layer type (not an ``nn.Linear`` subclass): ``y = x Wᵀ + b``."""

    def __init__(self, fin: int, fout: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(fout, fin) / fin**0.5)
        self.bias = nn.Parameter(torch.zeros(fout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def affine_grad_sample(module, activations, backprops):
    x, d = activations[0], backprops
    return {"weight": torch.einsum("nto,nti->noi", d, x), "bias": d.sum(1)}


class AffineGhost(LinearGhost):
    """The user's ghost form: ``Affine`` is a Linear layer, so the Linear forms apply as they are."""

    kind = "test_affine"

    @classmethod
    def applies(cls, module: nn.Module) -> bool:
        return isinstance(module, Affine)

    def _features(self) -> tuple[int, int]:
        fout, fin = self.module.weight.shape
        return fin, fout


@pytest.fixture
def registered_affine():
    register_grad_sampler(Affine, ghost=AffineGhost)(affine_grad_sample)
    yield
    GRAD_SAMPLERS.pop(Affine, None)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Affine(5, 7)
        self.head = nn.Linear(7, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (n, T, 5)
        return self.head(torch.tanh(self.inner(x)).mean(1))


def _run(cls, mode, *, model_fn=None, poison=False, **options):
    """Three steps of ``cls`` over ``model_fn()`` (default :class:`Net`); ``poison``: one unit of the
    second batch has a NaN input (dropped on every path)."""
    torch.manual_seed(0)
    model = (Net if model_fn is None else model_fn)().to(DT)
    opt = cls(torch.optim.SGD(model.parameters(), lr=0.3), model, noise_multiplier=0.7, expected_batch_size=6.0,
              seed=3, per_sample_mode=mode, **options)  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    captured = set()
    for n in (6, 4, 7):
        x, y = torch.randn(n, 3, 5, generator=gen, dtype=DT), torch.randn(n, 2, generator=gen, dtype=DT)
        if poison and n == 4:
            x[0, 0, 0] = float("nan")
        ((model(x) - y) ** 2).sum(1).mean().backward()
        if opt.grad_sample_hooks is not None:
            captured |= set(opt.grad_sample_hooks.captures)
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()], captured, model


def test_every_built_in_ghost_form_lives_with_its_per_sample_rule():
    built_in = {nn.Linear: "linear", nn.Embedding: "embedding", nn.Conv1d: "conv", nn.Conv2d: "conv"}
    for layer_type, kind in built_in.items():
        rule = GRAD_SAMPLERS[layer_type]
        assert rule.ghost is not None and rule.ghost.kind == kind
        assert rule.ghost.__module__ == rule.fn.__module__  # one file per layer type
    for rule in GRAD_SAMPLERS.values():  # also any other ghost form registered so far
        assert rule.ghost is None or rule.ghost.__module__ == rule.fn.__module__ or rule.ghost is AffineGhost


def test_transformers_conv1d_ghost_form_lives_with_its_rule():
    pytest.importorskip("transformers")
    from transformers.pytorch_utils import Conv1D

    from adaclip_torch.grad_sample.hf import register_transformers_rules

    register_transformers_rules()
    rule = GRAD_SAMPLERS[Conv1D]
    assert rule.ghost is not None and rule.ghost.kind == "linear_t" and rule.ghost.__module__ == rule.fn.__module__
    assert ghost_kind(Conv1D(4, 3)) == "linear_t"


@pytest.mark.parametrize("cls, options", [(FlatClip, dict(max_grad_norm=0.4)), (AdaClip, dict(std_min=1e-3, std_max=1.0))])
def test_a_registered_layer_type_takes_the_ghost_path_and_matches_materialised(registered_affine, cls, options):
    model = Net()
    assert ghost_modules(model, list(model.parameters())) == {model.inner: "test_affine", model.head: "linear"}
    want, _, _ = _run(cls, "materialise", **options)
    got, captured, ghost_model = _run(cls, "ghost", **options)
    assert {type(m) for m in captured} == {Affine, nn.Linear}  # captured, no per-example gradients formed
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_a_layer_type_registered_without_a_ghost_form_is_materialised(registered_affine):
    register_grad_sampler(Affine)(affine_grad_sample)  # a rule alone: the materialised path
    model = Net()
    assert ghost_modules(model, list(model.parameters())) == {model.head: "linear"}
    _, captured, _ = _run(FlatClip, "ghost", max_grad_norm=0.4)
    assert {type(m) for m in captured} == {nn.Linear}


def test_a_bad_ghost_form_is_refused_and_the_registry_is_unchanged():
    before = dict(GRAD_SAMPLERS)
    for bad in (object, LinearGhost.norm, GhostLayer):  # not a class / a method / the base with no kind
        with pytest.raises(TypeError, match="GhostLayer subclass"):
            register_grad_sampler(Affine, ghost=bad)
    assert GRAD_SAMPLERS == before


def test_ghost_layer_builds_the_registered_kind_and_refuses_unknown_ones():
    x, e = torch.randn(3, 1, 4, dtype=DT), torch.randn(3, 1, 2, dtype=DT)
    layer = GhostLayer(nn.Linear(4, 2).to(DT), "linear", [(x, e)], DT, "auto")
    assert type(layer) is LinearGhost
    with pytest.raises(ValueError, match="no ghost layer is registered for kind 'nope'"):
        GhostLayer(nn.Linear(4, 2), "nope", [(x, e)], DT, "auto")
    with pytest.raises(ValueError, match="serves kind 'linear'"):
        LinearGhost(nn.Linear(4, 2), "embedding", [(x, e)], DT, "auto")


class Gain(nn.Module):
    """A user's elementwise layer ``y = x ⊙ w + b``: both parameters are small (``(d,)``)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(1.0 + 0.1 * torch.randn(dim))
        self.bias = nn.Parameter(0.1 * torch.randn(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight + self.bias


def gain_grad_sample(module, activations, backprops):
    x, d = activations[0], backprops
    return {"weight": (d * x).sum(1), "bias": d.sum(1)}  # x, d: (n, T, dim)


class GainGhost(GhostLayer):
    """A ghost form with only small parameters: it forms their per-example gradients and the
    shared contract norms, sums and materialises them (no ``_terms``, ``_weighted_sum`` or
    ``_materialise`` of its own)."""

    kind = "test_gain"
    small_names = frozenset({"weight", "bias"})

    @classmethod
    def applies(cls, module: nn.Module) -> bool:
        return isinstance(module, Gain)

    def _capture(self, captures):
        self.x = torch.cat([x.to(self.dtype) for x, _ in captures], dim=1)
        self.e = torch.cat([e.to(self.dtype) for _, e in captures], dim=1)

    def _small_samples(self, name):
        g = (self.e * self.x).sum(1) if name == "weight" else self.e.sum(1)
        return g if self.loss_scale == 1.0 else g * self.loss_scale


class GainNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(5, 7)
        self.gain = Gain(7)
        self.head = nn.Linear(7, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.gain(self.inner(x))).mean(1))


@pytest.fixture
def registered_gain():
    register_grad_sampler(Gain, ghost=GainGhost)(gain_grad_sample)
    yield
    GRAD_SAMPLERS.pop(Gain, None)


@pytest.mark.parametrize("cls, options", [(FlatClip, dict(max_grad_norm=0.4)), (AdaClip, dict(std_min=1e-3, std_max=1.0))])
def test_small_parameters_are_normed_summed_and_materialised_by_the_shared_contract(registered_gain, cls, options):
    model = GainNet()
    assert ghost_modules(model, list(model.parameters()))[model.gain] == "test_gain"
    want = _run(cls, "materialise", model_fn=GainNet, poison=True, **options)[0]
    got = _run(cls, "ghost", model_fn=GainNet, poison=True, **options)[0]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    # the per-example gradients the contract materialises (user-level paths read them)
    layer = GainGhost(Gain(3).to(DT), "test_gain", [(torch.ones(2, 4, 3, dtype=DT), torch.ones(2, 4, 3, dtype=DT), 2.0)],
                      DT, "ghost")  # fmt: skip
    torch.testing.assert_close(layer.materialise("weight"), torch.full((2, 3), 8.0, dtype=DT))
    torch.testing.assert_close(layer.materialise("bias", torch.tensor([1])), torch.full((1, 3), 8.0, dtype=DT))


def test_the_engine_asks_each_ghost_source_once_per_step(registered_affine, monkeypatch):
    from adaclip_torch.grad_sample.ghost_layer import GhostSource

    asked = {"norms": [], "sums": []}
    norms, sums = GhostSource.norms_within_guard, GhostSource.weighted_sums_within_guard

    def count_norms(self, names, centres, scales):
        asked["norms"].append((type(self).__name__, tuple(names)))
        return norms(self, names, centres, scales)

    def count_sums(self, names, factors):
        asked["sums"].append((type(self).__name__, tuple(names)))
        return sums(self, names, factors)

    monkeypatch.setattr(GhostSource, "norms_within_guard", count_norms)
    monkeypatch.setattr(GhostSource, "weighted_sums_within_guard", count_sums)
    want, _, _ = _run(FlatClip, "materialise", max_grad_norm=0.4)
    got, _, _ = _run(FlatClip, "ghost", max_grad_norm=0.4)
    per_step = [("AffineGhost", ("weight", "bias")), ("LinearGhost", ("weight", "bias"))]
    assert asked["norms"] == per_step * 3 and asked["sums"] == per_step * 3  # 3 steps, 2 layers
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
