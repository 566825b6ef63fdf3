"""Activation (gradient) checkpointing on every per-sample path.

``torch.utils.checkpoint`` re-runs a segment's forward during the backward pass. Non-reentrant
checkpointing (Hugging Face's default) recomputes inside the same backward pass; reentrant
checkpointing (``use_reentrant=True``) recomputes and then runs a *nested* backward pass, whose
autograd graph task has another id. The one-pass check (which refuses a second ``backward()``
before the per-example gradients of the first are used) counts a contribution from a call
recomputed inside pass P as P's (:func:`adaclip_torch.grad_sample._watchers._pass_of`), so both
kinds give each example's own gradient — checked here against one example at a time on tiny
GPT-2, Llama and BERT (materialise, ghost and auto), on a plain ``checkpoint``-ed MLP, and
through a whole private step — while a real second backward is still refused."""

from __future__ import annotations

import pytest
import test_torch_hf_models as hf
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from adaclip.errors import InvalidGradientError
from adaclip_torch import FlatClip

pytestmark = pytest.mark.torch


def _checkpointed(name: str, reentrant: bool) -> nn.Module:
    model = hf.build(name)
    kwargs = {"use_reentrant": reentrant}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5's name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.train()
    return model


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
def test_hugging_face_gradient_checkpointing_is_exact_on_every_path(name, reentrant):
    kind = name
    gen = torch.Generator().manual_seed(4)
    batch = hf.make_batch(kind, 4, gen)
    plain = hf.build(name)  # the reference: one example at a time, without checkpointing
    ref = hf.reference(kind, plain, batch, [p for p in plain.parameters() if p.requires_grad])
    model = _checkpointed(name, reentrant)
    params = [p for p in model.parameters() if p.requires_grad]
    norms = torch.sqrt(sum((g.flatten(1) ** 2).sum(1) for g in ref))
    clip = float(norms.median())
    expected = hf.clipped_reference(ref, clip)
    scale = max(float(g.abs().max()) for g in ref)
    for mode in hf.MODES:
        opt = FlatClip(torch.optim.SGD(params, lr=0.0), model, noise_multiplier=1.0, expected_batch_size=4.0,
                       max_grad_norm=clip, per_sample_mode=mode, loss_reduction=hf.reduction_of(kind))  # fmt: skip
        try:
            sums, per_example = hf.engine_step(opt, hf.loss_of(kind, model, batch))
        finally:
            opt.remove_hooks()
        for k, (got, want) in enumerate(zip(per_example, ref, strict=True)):
            torch.testing.assert_close(got / scale, want / scale, **hf.TOL, msg=lambda m, k=k, mode=mode: f"{mode} {k}: {m}")
        for got, want in zip(sums, expected, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-7, atol=1e-9)


class _Checkpointed(nn.Module):
    """An MLP whose two hidden blocks run under ``torch.utils.checkpoint``."""

    def __init__(self, reentrant: bool, checkpointing: bool = True):
        super().__init__()
        self.reentrant, self.checkpointing = reentrant, checkpointing
        self.block1 = nn.Sequential(nn.Linear(6, 8), nn.Tanh())
        self.block2 = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Tanh())
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        if not self.checkpointing:  # the same maths, nothing recomputed
            return self.head(self.block2(self.block1(x)))
        h = checkpoint(self.block1, x, use_reentrant=self.reentrant)
        h = checkpoint(self.block2, h, use_reentrant=self.reentrant)
        return self.head(h)


def _per_example_reference(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    params = dict(model.named_parameters())

    def loss(p, xi, yi):
        out = torch.func.functional_call(model, p, (xi[None],))
        return nn.functional.cross_entropy(out, yi[None], reduction="sum")

    grads = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(params, x, y)
    return [grads[name] for name in params]


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("mode", ["materialise", "ghost", "auto"])
def test_torch_checkpoint_gives_each_example_its_own_gradient(reentrant, mode):
    torch.manual_seed(0)
    model = _Checkpointed(reentrant).double()
    x, y = torch.randn(5, 6, dtype=torch.float64), torch.randint(0, 3, (5,))
    x.requires_grad_(reentrant)  # reentrant checkpointing needs an input that requires grad
    plain = _Checkpointed(reentrant, checkpointing=False).double()
    plain.load_state_dict(model.state_dict())  # torch.func does not run checkpointed code
    ref = _per_example_reference(plain, x.detach(), y)
    opt = FlatClip(torch.optim.SGD(model.parameters(), lr=0.0), model, noise_multiplier=0.0, expected_batch_size=5.0,
                   max_grad_norm=0.05, per_sample_mode=mode, loss_reduction="sum")  # fmt: skip
    try:
        sums, per_example = hf.engine_step(opt, nn.functional.cross_entropy(model(x), y, reduction="sum"))
    finally:
        opt.remove_hooks()
    for got, want in zip(per_example, ref, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    for got, want in zip(sums, hf.clipped_reference(ref, 0.05), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    # each example moves the clipped sum by at most C: the sensitivity the accountant assumes
    clipped = torch.sqrt(sum((g.flatten(1) ** 2).sum(1) for g in ref)).clamp(max=0.05)
    assert bool((clipped <= 0.05 * (1 + 1e-12)).all())


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_a_private_step_with_checkpointing_equals_the_step_without(reentrant):
    def run(use_checkpointing: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = _Checkpointed(reentrant, checkpointing=use_checkpointing).double()
        opt = FlatClip(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model, noise_multiplier=0.7,
                       expected_batch_size=4.0, max_grad_norm=0.5, seed=11)  # fmt: skip
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):
            x = torch.randn(4, 6, generator=gen, dtype=torch.float64).requires_grad_(reentrant)
            y = torch.randint(0, 3, (4,), generator=gen)
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        opt.remove_hooks()
        return [p.detach().clone() for p in model.parameters()]

    for a, b in zip(run(True), run(False), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_a_second_backward_is_still_refused_under_checkpointing(reentrant):
    torch.manual_seed(0)
    model = _Checkpointed(reentrant).double()
    opt = FlatClip(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=1.0, expected_batch_size=4.0,
                   max_grad_norm=1.0, per_sample_mode="materialise")  # fmt: skip
    x1, x2 = (torch.randn(4, 6, dtype=torch.float64).requires_grad_(reentrant) for _ in range(2))
    y = torch.zeros(4, dtype=torch.long)
    nn.functional.cross_entropy(model(x1), y).backward()
    with pytest.raises(InvalidGradientError, match="second backward pass"):
        nn.functional.cross_entropy(model(x2), y).backward()
    opt.remove_hooks()
