"""The ghost path under ``loss_reduction="mean"``: the hooks keep the output gradients autograd
delivered (no pass rescaling them by n) with the loss scale ``s = n`` beside them, and the ghost
forms apply ``s`` to their results. Norms stay upper bounds of the exact per-example norms (also
in float32), the weighted sum never applies more than ``c_i·s``, and a step equals the one on
pre-scaled captures and the materialised path."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from adaclip import transform
from adaclip_torch import AdaClip, FlatClip
from adaclip_torch.ghost import GhostLayer, TiedGhost

DT = torch.float64


def _linear_case(gen, n=6, seq=3, fin=5, fout=4, dtype=DT):
    x = torch.randn(n, seq, fin, generator=gen, dtype=DT)
    e = torch.randn(n, seq, fout, generator=gen, dtype=DT) / n  # a mean loss's output gradient
    return x.to(dtype), e.to(dtype), torch.einsum("nto,nti->noi", e * n, x)  # exact per-example


@pytest.mark.parametrize("centred", [False, True])
@pytest.mark.parametrize("seq", [1, 3])
@pytest.mark.parametrize("scale_kind", ["flat", "tensor", "coordinate"])
def test_linear_forms_with_a_loss_scale_equal_pre_scaled_captures(centred, seq, scale_kind):
    gen = torch.Generator().manual_seed(seq + 10 * centred)
    n = 6
    x, e, ref = _linear_case(gen, n=n, seq=seq)
    module = nn.Linear(5, 4).to(DT)
    centre = torch.randn(4, 5, generator=gen, dtype=DT) * 0.3 if centred else None
    scale = {"flat": 0.7, "tensor": torch.tensor(0.6, dtype=DT),
             "coordinate": torch.rand(4, 5, generator=gen, dtype=DT) + 0.5}[scale_kind]  # fmt: skip
    folded = GhostLayer(module, "linear", [(x, e, float(n))], DT, "auto")
    assert folded.loss_scale == n
    pre = GhostLayer(module, "linear", [(x, e * n)], DT, "auto")
    want = transform.transformed_sq_norms([ref], None if centre is None else [centre], [scale])[0]
    for name in ("weight", "bias"):
        torch.testing.assert_close(folded.norm(name, centre if name == "weight" else None, scale if name == "weight" else 0.5),
                                   pre.norm(name, centre if name == "weight" else None, scale if name == "weight" else 0.5),
                                   rtol=1e-12, atol=1e-12)  # fmt: skip
        torch.testing.assert_close(folded.materialise(name), pre.materialise(name), rtol=1e-12, atol=1e-12)
    got = folded.norm("weight", centre, scale)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    assert bool((got >= want * (1 - 1e-15)).all())
    c = torch.rand(n, generator=gen, dtype=DT)
    c[1] = 0.0
    for name in ("weight", "bias"):
        torch.testing.assert_close(folded.weighted_sum(name, c), pre.weighted_sum(name, c), rtol=1e-12, atol=1e-12)


def test_embedding_forms_with_a_loss_scale_equal_pre_scaled_captures():
    gen = torch.Generator().manual_seed(2)
    num, dim, n, length = 30, 4, 5, 6
    module = nn.Embedding(num, dim, padding_idx=0).to(DT)
    ids = torch.randint(0, num, (n, length), generator=gen)
    e = torch.randn(n, length, dim, generator=gen, dtype=DT) / n
    folded = GhostLayer(module, "embedding", [(ids, e, float(n))], DT, "auto")
    pre = GhostLayer(module, "embedding", [(ids, e * n)], DT, "auto")
    centre = torch.randn(num, dim, generator=gen, dtype=DT) * 0.2
    for a, b in ((None, 0.8), (centre, torch.tensor(0.8, dtype=DT)), (centre, torch.rand(num, dim, generator=gen, dtype=DT) + 0.5)):
        torch.testing.assert_close(folded.norm("weight", a, b), pre.norm("weight", a, b), rtol=1e-12, atol=1e-12)
    rows = torch.tensor([0, 3])
    torch.testing.assert_close(folded._exact("weight", centre, 0.8, rows), pre._exact("weight", centre, 0.8, rows),
                               rtol=1e-12, atol=1e-12)  # fmt: skip
    torch.testing.assert_close(folded.materialise("weight"), pre.materialise("weight"), rtol=1e-12, atol=1e-12)
    c = torch.rand(n, generator=gen, dtype=DT)
    torch.testing.assert_close(folded.weighted_sum("weight", c), pre.weighted_sum("weight", c), rtol=1e-12, atol=1e-12)


def test_tied_cross_terms_with_a_loss_scale_equal_pre_scaled_captures():
    gen = torch.Generator().manual_seed(3)
    vocab, dim, n, length = 12, 5, 4, 3
    emb, head = nn.Embedding(vocab, dim).to(DT), nn.Linear(dim, vocab, bias=False).to(DT)
    ids = torch.randint(0, vocab, (n, length), generator=gen)
    de = torch.randn(n, length, dim, generator=gen, dtype=DT) / n
    x = torch.randn(n, length, dim, generator=gen, dtype=DT)
    dh = torch.randn(n, length, vocab, generator=gen, dtype=DT) / n

    def tied(scaled):
        if scaled:
            parts = [GhostLayer(emb, "embedding", [(ids, de, float(n))], DT, "auto"),
                     GhostLayer(head, "linear", [(x, dh, float(n))], DT, "auto")]  # fmt: skip
        else:
            parts = [GhostLayer(emb, "embedding", [(ids, de * n)], DT, "auto"),
                     GhostLayer(head, "linear", [(x, dh * n)], DT, "auto")]  # fmt: skip
        return TiedGhost([(p, "weight") for p in parts])

    torch.testing.assert_close(tied(True).norm("weight", None, 0.9), tied(False).norm("weight", None, 0.9),
                               rtol=1e-12, atol=1e-12)  # fmt: skip


@pytest.mark.parametrize("n", [7, 96, 1000])
def test_float32_norms_with_a_loss_scale_stay_upper_bounds(n):
    """n not a power of two: the products with s and s² round; the bound must still hold."""
    gen = torch.Generator().manual_seed(n)
    f32 = torch.float32
    for seq, centred in ((1, False), (1, True), (4, False), (4, True)):
        x, e, ref = _linear_case(gen, n=n, seq=seq, fin=16, fout=8, dtype=f32)
        ref = torch.einsum("nto,nti->noi", e.to(DT) * n, x.to(DT))  # exact s·(captured) in float64
        centre = ref.mean(0) + 0.01 * torch.randn(8, 16, generator=gen, dtype=DT) if centred else None
        layer = GhostLayer(nn.Linear(16, 8), "linear", [(x, e, float(n))], f32, "ghost")
        for scale in (0.37, torch.tensor(0.37, dtype=f32)):
            got = layer.norm("weight", None if centre is None else centre.to(f32), scale).to(DT)
            want = transform.transformed_sq_norms([ref], None if centre is None else [centre], [float(scale)])[0]
            assert bool((got >= want).all()), float((want - got).max())


def test_folded_clip_factors_never_exceed_the_exact_product():
    gen = torch.Generator().manual_seed(0)
    c = torch.rand(10_000, generator=gen, dtype=torch.float32)
    c[:3] = torch.tensor([0.0, 1.0, 0.5])
    for n in (3, 7, 96, 1000, 4097):
        layer = GhostLayer(nn.Linear(2, 2), "linear", [(torch.zeros(1, 2), torch.zeros(1, 2), float(n))], torch.float32, "auto")
        folded = layer._fold_scale(c).to(DT)
        assert bool((folded <= c.to(DT) * n).all()) and float(folded[0]) == 0.0
        assert bool((folded >= c.to(DT) * n * (1 - 4e-7)).all())  # within two roundings


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.fc = nn.Linear(6, 5)
        self.out = nn.Linear(5, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.fc(self.emb(ids))).mean(1))


def test_hooks_keep_the_mean_loss_gradient_and_its_scale():
    torch.manual_seed(0)
    model = _Net().to(DT)
    opt = FlatClip(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=1.0, max_grad_norm=1.0,
                   expected_batch_size=5, seed=0, per_sample_mode="ghost")  # fmt: skip
    ids = torch.randint(0, 11, (5, 4), generator=torch.Generator().manual_seed(1))
    captured = {}

    def keep(grad):
        captured["out"] = grad

    y = model.out(torch.tanh(model.fc(model.emb(ids))).mean(1))
    y.register_hook(keep)
    (y**2).sum(1).mean().backward()
    x, g, s = opt.grad_sample_hooks.captures[model.out][0]
    assert s == 5.0
    assert g.data_ptr() == captured["out"].data_ptr()  # the gradient autograd delivered, not a copy
    opt.zero_grad()
    opt.grad_sample_hooks.clear()


@pytest.mark.parametrize("cls, options", [(FlatClip, dict(max_grad_norm=0.3)), (AdaClip, dict(std_min=1e-3, std_max=1.0))])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_mean_and_sum_losses_step_like_the_materialised_path(cls, options, reduction):
    def run(mode):
        torch.manual_seed(0)
        model = _Net().to(DT)
        opt = cls(torch.optim.SGD(model.parameters(), lr=0.4), model, noise_multiplier=0.6, expected_batch_size=5.0,
                  seed=2, per_sample_mode=mode, loss_reduction=reduction, **options)  # fmt: skip
        gen = torch.Generator().manual_seed(4)
        for n in (5, 3, 7):
            ids = torch.randint(0, 11, (n, 4), generator=gen)
            target = torch.randn(n, 2, generator=gen, dtype=DT)
            per = ((model(ids) - target) ** 2).sum(1)
            (per.mean() if reduction == "mean" else per.sum()).backward()
            opt.step()
            opt.zero_grad()
        return [p.detach().clone() for p in model.parameters()]

    for a, b in zip(run("ghost"), run("materialise"), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
