"""Per-layer per-sample-gradient rules and the torch.func fallback, each checked against a
micro-batch reference: one forward+backward per example on that example alone."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch import nn

from adaclip.errors import InvalidGradientError, InvalidHyperparameterError
from adaclip_torch.grad_sample import (
    GRAD_SAMPLERS,
    GradSampleHooks,
    get_grad_sampler,
    register_grad_sampler,
)

pytestmark = pytest.mark.torch

DT = torch.float64
TOL = dict(rtol=1e-9, atol=1e-10)

LossFn = Callable[[nn.Module, slice], torch.Tensor]


def micro_batch_reference(model: nn.Module, loss_fn: LossFn, n: int) -> dict[str, torch.Tensor]:
    """Per-example gradients by brute force: ``loss_fn(model, slice(i, i + 1))`` is example i's
    loss alone; its gradient is row i. Unused parameters get zeros."""
    rows: dict[str, list[torch.Tensor]] = {k: [] for k, p in model.named_parameters() if p.requires_grad}
    for i in range(n):
        model.zero_grad(set_to_none=True)
        loss_fn(model, slice(i, i + 1)).backward()
        for k, p in model.named_parameters():
            if p.requires_grad:
                rows[k].append(torch.zeros_like(p) if p.grad is None else p.grad.clone())
    model.zero_grad(set_to_none=True)
    return {k: torch.stack(v) if v else torch.zeros(0) for k, v in rows.items()}


def hooked_grad_samples(
    model: nn.Module, loss_fn: LossFn, n: int, reduction: str = "sum", batch_first: bool = True
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``grad_sample`` of every trainable parameter after one batched backward (and ``.grad``)."""
    hooks = GradSampleHooks(model, loss_reduction=reduction, batch_first=batch_first)
    try:
        model.zero_grad(set_to_none=True)
        loss = loss_fn(model, slice(None))
        if reduction == "mean":
            loss = loss / n
        loss.backward()
        assert hooks.batch_size == n
        samples = {k: p.grad_sample.clone() for k, p in model.named_parameters() if p.requires_grad}
        grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    finally:
        hooks.remove()
    return samples, grads


def assert_matches_reference(
    model: nn.Module, loss_fn: LossFn, n: int, reduction: str = "sum", batch_first: bool = True
) -> None:
    ref = micro_batch_reference(model, loss_fn, n)
    got, grads = hooked_grad_samples(model, loss_fn, n, reduction, batch_first)
    assert set(got) == set(ref)
    for k in ref:
        assert got[k].shape == (n, *dict(model.named_parameters())[k].shape), k
        torch.testing.assert_close(got[k], ref[k], **TOL, msg=lambda m, k=k: f"{k}: {m}")
        # the hooks do not disturb ordinary gradients: sum of per-example grads = (n ×) .grad
        if k in grads:
            scale = n if reduction == "mean" else 1
            torch.testing.assert_close(got[k].sum(0), scale * grads[k], **TOL)


def cotangent_loss(x: torch.Tensor, cot: torch.Tensor, forward: Callable[[nn.Module, torch.Tensor], torch.Tensor]) -> LossFn:
    """Loss Σ ⟨forward(x_i), c_i⟩ (a generic linear functional of the output; sum reduction)."""

    def loss_fn(model: nn.Module, sl: slice) -> torch.Tensor:
        return (forward(model, x[sl]) * cot[sl]).sum()

    return loss_fn


def out_cot(model: nn.Module, x: torch.Tensor, seed: int) -> torch.Tensor:
    with torch.no_grad():
        shape = model(x).shape
    return torch.randn(shape, dtype=DT, generator=torch.Generator().manual_seed(seed))


call = lambda m, x: m(x)  # noqa: E731

batch = st.integers(1, 6)
feat = st.integers(1, 8)
reductions = st.sampled_from(["sum", "mean"])


# ---------------------------------------------------------------------------- nn.Linear
@settings(max_examples=25)
@given(n=batch, fin=feat, fout=feat, seq=st.lists(st.integers(1, 3), max_size=2), bias=st.booleans(),
       reduction=reductions, seed=st.integers(0, 2**16))
def test_linear_matches_reference(n, fin, fout, seq, bias, reduction, seed):
    torch.manual_seed(seed)
    m = nn.Linear(fin, fout, bias=bias).to(DT)
    x = torch.randn(n, *seq, fin, dtype=DT)
    assert_matches_reference(m, cotangent_loss(x, out_cot(m, x, seed), call), n, reduction)


# ---------------------------------------------------------------------------- nn.Embedding
@settings(max_examples=25)
@given(n=batch, vocab=st.integers(1, 8), dim=feat, seq=st.lists(st.integers(1, 4), max_size=2),
       pad=st.booleans(), reduction=reductions, seed=st.integers(0, 2**16))
def test_embedding_matches_reference(n, vocab, dim, seq, pad, reduction, seed):
    torch.manual_seed(seed)
    m = nn.Embedding(vocab, dim, padding_idx=(seed % vocab) if pad else None).to(DT)
    ids = torch.randint(0, vocab, (n, *seq))  # repeated tokens within an example are likely
    assert_matches_reference(m, cotangent_loss(ids, out_cot(m, ids, seed), call), n, reduction)


def test_embedding_padding_row_is_zero_and_repeats_add_up():
    m = nn.Embedding(5, 3, padding_idx=0).to(DT)
    ids = torch.tensor([[0, 2, 2], [4, 0, 1]])
    hooks = GradSampleHooks(m, loss_reduction="sum")
    m(ids).sum().backward()
    gs = m.weight.grad_sample
    assert torch.all(gs[:, 0] == 0)
    torch.testing.assert_close(gs[0, 2], torch.full((3,), 2.0, dtype=DT))
    torch.testing.assert_close(gs[1, 1], torch.ones(3, dtype=DT))
    assert torch.all(gs[0, 4] == 0) and torch.all(gs[1, 2] == 0)
    hooks.remove()


def test_embedding_scale_grad_by_freq_rejected():
    with pytest.raises(InvalidHyperparameterError, match="scale_grad_by_freq"):
        GradSampleHooks(nn.Sequential(nn.Embedding(4, 2, scale_grad_by_freq=True)))


# ---------------------------------------------------------------------------- convolutions
@st.composite
def conv_config(draw, spatial: int):
    groups = draw(st.integers(1, 3))
    cin = groups * draw(st.integers(1, 2))
    cout = groups * draw(st.integers(1, 2))
    kernel = tuple(draw(st.integers(1, 3)) for _ in range(spatial))
    dilation = tuple(draw(st.integers(1, 2)) for _ in range(spatial))
    mode = draw(st.sampled_from(["zeros", "zeros", "reflect", "replicate", "circular"]))
    same = draw(st.booleans()) and mode == "zeros"
    if same:
        stride: tuple[int, ...] = (1,) * spatial
        padding: object = "same"
    else:
        stride = tuple(draw(st.integers(1, 3)) for _ in range(spatial))
        padding = tuple(draw(st.integers(0, 2)) for _ in range(spatial))
    extent = tuple(d * (k - 1) + 1 for k, d in zip(kernel, dilation))
    size = tuple(e + draw(st.integers(2, 4)) for e in extent)  # > padding, so reflect is valid
    return dict(in_channels=cin, out_channels=cout, kernel_size=kernel, stride=stride, padding=padding,
                dilation=dilation, groups=groups, padding_mode=mode, bias=draw(st.booleans())), size


@settings(max_examples=25)
@given(n=batch, cfg=conv_config(2), reduction=reductions, seed=st.integers(0, 2**16))
def test_conv2d_matches_reference(n, cfg, reduction, seed):
    kwargs, size = cfg
    torch.manual_seed(seed)
    m = nn.Conv2d(**kwargs).to(DT)
    x = torch.randn(n, kwargs["in_channels"], *size, dtype=DT)
    assert_matches_reference(m, cotangent_loss(x, out_cot(m, x, seed), call), n, reduction)


@settings(max_examples=25)
@given(n=batch, cfg=conv_config(1), reduction=reductions, seed=st.integers(0, 2**16))
def test_conv1d_matches_reference(n, cfg, reduction, seed):
    kwargs, size = cfg
    torch.manual_seed(seed)
    m = nn.Conv1d(**kwargs).to(DT)
    x = torch.randn(n, kwargs["in_channels"], *size, dtype=DT)
    assert_matches_reference(m, cotangent_loss(x, out_cot(m, x, seed), call), n, reduction)


def test_conv_unbatched_input_rejected():
    m = nn.Conv1d(2, 3, 2).to(DT)
    hooks = GradSampleHooks(m)
    with pytest.raises(InvalidGradientError, match="not batched"):
        m(torch.randn(2, 5, dtype=DT)).sum().backward()
    hooks.remove()


# ---------------------------------------------------------------------------- norms
@settings(max_examples=20)
@given(n=batch, norm=st.lists(st.integers(1, 4), min_size=1, max_size=2),
       extra=st.lists(st.integers(1, 3), max_size=2), affine=st.booleans(), bias=st.booleans(),
       reduction=reductions, seed=st.integers(0, 2**16))
def test_layer_norm_matches_reference(n, norm, extra, affine, bias, reduction, seed):
    torch.manual_seed(seed)
    # a trainable Linear in front so the model always has parameters
    m = nn.Sequential(nn.Linear(norm[-1], norm[-1]), nn.LayerNorm(norm, elementwise_affine=affine, bias=bias)).to(DT)
    if affine:
        with torch.no_grad():
            m[1].weight.normal_()
            if m[1].bias is not None:
                m[1].bias.normal_()
    x = torch.randn(n, *extra, *norm, dtype=DT)
    assert_matches_reference(m, cotangent_loss(x, out_cot(m, x, seed), call), n, reduction)


@settings(max_examples=20)
@given(n=batch, groups=st.integers(1, 3), per=st.integers(1, 3), spatial=st.lists(st.integers(1, 4), max_size=2),
       affine=st.booleans(), reduction=reductions, seed=st.integers(0, 2**16))
def test_group_norm_matches_reference(n, groups, per, spatial, affine, reduction, seed):
    c = groups * per
    assume(per * math.prod(spatial) > 1)  # torch's group_norm needs > 1 value per group
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Conv1d(c, c, 1) if spatial else nn.Linear(c, c), nn.GroupNorm(groups, c, affine=affine)).to(DT)
    if len(spatial) == 2:
        m[0] = nn.Conv2d(c, c, 1).to(DT)
    if affine:
        with torch.no_grad():
            m[1].weight.normal_()
            m[1].bias.normal_()
    x = torch.randn(n, c, *spatial, dtype=DT)
    assert_matches_reference(m, cotangent_loss(x, out_cot(m, x, seed), call), n, reduction)


def test_batch_norm_rejected():
    with pytest.raises(InvalidHyperparameterError, match="BatchNorm1d"):
        GradSampleHooks(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)))


# ---------------------------------------------------------------------------- torch.func fallback
class Gated(nn.Module):
    """A custom module owning parameters directly (no rule): y = tanh(x W) ⊙ g + x·v."""

    def __init__(self, fin: int, fout: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(fin, fout))
        self.g = nn.Parameter(torch.randn(fout))
        self.v = nn.Parameter(torch.randn(fin, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.w) * self.g + x @ self.v


@settings(max_examples=15)
@given(n=batch, fin=feat, fout=feat, seq=st.lists(st.integers(1, 3), max_size=1), reduction=reductions,
       seed=st.integers(0, 2**16))
def test_fallback_custom_module_matches_reference(n, fin, fout, seq, reduction, seed):
    torch.manual_seed(seed)
    m = Gated(fin, fout).to(DT)
    assert get_grad_sampler(m) is None
    x = torch.randn(n, *seq, fin, dtype=DT)
    assert_matches_reference(m, cotangent_loss(x, out_cot(m, x, seed), call), n, reduction)


@settings(max_examples=10)
@given(n=batch, f1=feat, f2=feat, fout=feat, seed=st.integers(0, 2**16))
def test_fallback_two_input_module_bilinear(n, f1, f2, fout, seed):
    torch.manual_seed(seed)
    m = nn.Bilinear(f1, f2, fout).to(DT)
    a, b = torch.randn(n, f1, dtype=DT), torch.randn(n, f2, dtype=DT)
    cot = torch.randn(n, fout, dtype=DT)
    assert_matches_reference(m, lambda mod, sl: (mod(a[sl], b[sl]) * cot[sl]).sum(), n, "mean")


def test_fallback_subclass_of_ruled_type_uses_fallback():
    class ScaledLinear(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2.0 * super().forward(x) ** 2

    torch.manual_seed(0)
    m = ScaledLinear(3, 2).to(DT)
    assert get_grad_sampler(m) is None
    x = torch.randn(4, 3, dtype=DT)
    assert_matches_reference(m, cotangent_loss(x, out_cot(m, x, 1), call), 4, "sum")


@settings(max_examples=12)
@given(n=batch, fin=st.integers(1, 4), hidden=st.integers(1, 4), layers=st.integers(1, 2),
       bidir=st.booleans(), module_bf=st.booleans(), kind=st.sampled_from([nn.LSTM, nn.GRU, nn.RNN]),
       seq=st.integers(1, 4), use_state=st.booleans(), seed=st.integers(0, 2**16))
def test_fallback_recurrent_modules(n, fin, hidden, layers, bidir, module_bf, kind, seq, use_state, seed):
    """nn.LSTM / nn.GRU / nn.RNN through the fallback: the module's own batch_first is honoured,
    the final hidden state's gradient is used too (tuple outputs), and an initial state passed
    as an argument (batch on dim 1) is sliced per example."""
    torch.manual_seed(seed)
    m = kind(fin, hidden, num_layers=layers, bidirectional=bidir, batch_first=module_bf).to(DT)
    x = torch.randn(n, seq, fin, dtype=DT) if module_bf else torch.randn(seq, n, fin, dtype=DT)
    dirs = 2 if bidir else 1
    h0 = torch.randn(layers * dirs, n, hidden, dtype=DT)
    c0 = torch.randn(layers * dirs, n, hidden, dtype=DT)
    co = torch.randn(*x.shape[:2], dirs * hidden, dtype=DT)
    ch = torch.randn(layers * dirs, n, hidden, dtype=DT)
    bsl = (lambda sl: (sl,)) if module_bf else (lambda sl: (slice(None), sl))

    def loss_fn(mod: nn.Module, sl: slice) -> torch.Tensor:
        state = None
        if use_state:
            state = (h0[:, sl], c0[:, sl]) if kind is nn.LSTM else h0[:, sl]
        out, hn = mod(x[bsl(sl)], state)
        h_last = hn[0] if kind is nn.LSTM else hn
        return (out * co[bsl(sl)]).sum() + (h_last * ch[:, sl]).sum()

    assert_matches_reference(m, loss_fn, n, "mean")


def test_lstm_internal_dropout_rejected_in_training():
    m = nn.LSTM(2, 3, num_layers=2, dropout=0.5, batch_first=True).to(DT)
    hooks = GradSampleHooks(m)
    with pytest.raises(InvalidHyperparameterError, match="dropout"):
        m(torch.randn(2, 3, 2, dtype=DT))
    m.eval()  # eval mode: dropout inactive, allowed
    out, _ = m(torch.randn(2, 3, 2, dtype=DT))
    out.sum().backward()
    assert m.weight_ih_l0.grad_sample.shape == (2, *m.weight_ih_l0.shape)
    hooks.remove()


# ---------------------------------------------------------------------------- batch_first=False
@settings(max_examples=10)
@given(n=batch, seq=st.integers(1, 4), vocab=st.integers(2, 6), dim=feat, seed=st.integers(0, 2**16))
def test_sequence_first_layout(n, seq, vocab, dim, seed):
    """batch_first=False: the batch is dim 1 of Embedding/Linear/LayerNorm/fallback inputs."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Embedding(vocab, dim), nn.Linear(dim, dim), nn.LayerNorm(dim), Gated(dim, 3)).to(DT)
    ids = torch.randint(0, vocab, (seq, n))
    cot = torch.randn(seq, n, 3, dtype=DT)
    loss_fn = lambda mod, sl: (mod(ids[:, sl]) * cot[:, sl]).sum()  # noqa: E731
    assert_matches_reference(model, loss_fn, n, "mean", batch_first=False)


# ---------------------------------------------------------------------------- registry
def test_register_custom_rule_is_used():
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.s = nn.Parameter(torch.ones(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.s

    calls = []

    @register_grad_sampler(Scale)
    def scale_rule(module, activations, backprops):
        calls.append(1)
        return {"s": (activations[0] * backprops).reshape(backprops.shape[0], -1, 3).sum(1)}

    try:
        torch.manual_seed(0)
        m = Scale().to(DT)
        assert get_grad_sampler(m).fn is scale_rule
        x = torch.randn(4, 2, 3, dtype=DT)
        assert_matches_reference(m, cotangent_loss(x, out_cot(m, x, 0), call), 4, "sum")
        assert calls
    finally:
        del GRAD_SAMPLERS[Scale]


def test_register_rejects_non_modules():
    with pytest.raises(TypeError):
        register_grad_sampler(int)
    with pytest.raises(TypeError):
        register_grad_sampler()


# ---------------------------------------------------------------------------- fallback: subtrees, attention, loop path
def test_fallback_vmap_path_used_for_plain_modules():
    from adaclip_torch.grad_sample.functorch_fallback import _VMAP_UNSUPPORTED

    torch.manual_seed(0)
    m = Gated(3, 2).to(DT)
    x = torch.randn(4, 3, dtype=DT)
    assert_matches_reference(m, cotangent_loss(x, out_cot(m, x, 0), call), 4, "sum")
    assert m not in _VMAP_UNSUPPORTED


class InPlaceIntoFresh(nn.Module):
    """A forward vmap cannot run (an in-place write of per-example values into a freshly
    allocated, unbatched tensor — what torch's fused LSTM does): the fallback loops."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(*x.shape[:-1], 3, dtype=x.dtype)
        out += torch.sin(x @ self.w)
        return out


def test_fallback_loops_when_vmap_fails():
    from adaclip_torch.grad_sample.functorch_fallback import _VMAP_UNSUPPORTED

    torch.manual_seed(0)
    m = InPlaceIntoFresh().to(DT)
    x = torch.randn(5, 3, dtype=DT)
    assert_matches_reference(m, cotangent_loss(x, out_cot(m, x, 0), call), 5, "mean")
    assert m in _VMAP_UNSUPPORTED


class ParentUsingChildWeights(nn.Module):
    """Owns a parameter and reads its child's weight directly (as nn.MultiheadAttention does
    with out_proj) while also calling the child: the fallback must cover the whole subtree."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(4))
        self.child = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.child(x * self.scale)
        return y + torch.tanh(x @ self.child.weight.t())


def test_fallback_covers_subtree_of_parent_with_own_parameters():
    torch.manual_seed(0)
    m = nn.Sequential(ParentUsingChildWeights(), nn.Linear(4, 2)).to(DT)
    x = torch.randn(4, 3, 4, dtype=DT)
    hooks = GradSampleHooks(m)
    assert len(m[0].child._forward_hooks) == 0  # covered by the parent's fallback
    hooks.remove()
    assert_matches_reference(m, cotangent_loss(x, out_cot(m, x, 0), call), 4, "mean")


@settings(max_examples=6)
@given(n=st.integers(1, 4), length=st.integers(1, 4), bf=st.booleans(), causal=st.booleans(),
       seed=st.integers(0, 2**16))
def test_fallback_multihead_attention(n, length, bf, causal, seed):
    """nn.MultiheadAttention (own in_proj weights + out_proj read directly): batch dims per the
    module's batch_first, key_padding_mask per example, shared 2-D attn_mask, and the
    gradient reaching the attention weights output too."""
    torch.manual_seed(seed)
    m = nn.MultiheadAttention(6, 2, batch_first=bf).to(DT)
    x = torch.randn(n, length, 6, dtype=DT) if bf else torch.randn(length, n, 6, dtype=DT)
    bsl = (lambda sl: (sl,)) if bf else (lambda sl: (slice(None), sl))
    kpm = torch.zeros(n, length, dtype=torch.bool)
    kpm[:, 1:] = torch.rand(n, length - 1) < 0.3
    mask = torch.triu(torch.ones(length, length, dtype=torch.bool), 1) if causal else None
    co, cw = torch.randn_like(x), torch.randn(n, length, length, dtype=DT)

    def loss_fn(mod: nn.Module, sl: slice) -> torch.Tensor:
        q = x[bsl(sl)]
        out, w = mod(q, q, q, key_padding_mask=kpm[sl], attn_mask=mask)
        return (out * co[bsl(sl)]).sum() + (w * cw[sl]).sum()

    assert_matches_reference(m, loss_fn, n, "mean", batch_first=bf)


def test_transformer_encoder_layer():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True).to(DT)
    x = torch.randn(3, 5, 8, dtype=DT)
    assert_matches_reference(layer, cotangent_loss(x, out_cot(layer, x, 0), call), 3, "mean")


def test_attention_dropout_rejected_in_training():
    m = nn.MultiheadAttention(4, 2, dropout=0.1, batch_first=True)
    hooks = GradSampleHooks(m)
    x = torch.randn(2, 3, 4)
    with pytest.raises(InvalidHyperparameterError, match="dropout"):
        m(x, x, x)
    hooks.remove()


@pytest.mark.parametrize(
    "make, shape",
    [
        (lambda: nn.Conv3d(2, 3, 2, stride=(1, 2, 1), padding=1), (3, 2, 3, 4, 3)),
        (lambda: nn.ConvTranspose2d(2, 3, 3, stride=2, groups=1), (3, 2, 3, 4)),
        (lambda: nn.PReLU(4), (3, 4, 5)),
        (lambda: nn.InstanceNorm1d(4, affine=True), (3, 4, 6)),
    ],
    ids=["conv3d", "conv_transpose2d", "prelu", "instancenorm"],
)
def test_other_torch_layers_through_fallback(make, shape):
    torch.manual_seed(0)
    m = make().to(DT)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_()
    assert get_grad_sampler(m) is None
    x = torch.randn(*shape, dtype=DT)
    assert_matches_reference(m, cotangent_loss(x, out_cot(m, x, 0), call), shape[0], "mean")


@pytest.mark.parametrize("shape, normalized", [((3, 2, 5), 5), ((4, 5), 5), ((2, 3, 2, 4), (2, 4))])
def test_rms_norm_rule(shape, normalized):
    """nn.RMSNorm has its own rule (∂L_i/∂γ = Σ δ_i ⊙ x̂_i, as LayerNorm's weight)."""
    torch.manual_seed(0)
    m = nn.RMSNorm(normalized, eps=1e-5).to(DT)
    with torch.no_grad():
        m.weight.normal_()
    assert get_grad_sampler(m) is not None
    x = torch.randn(*shape, dtype=DT)
    assert_matches_reference(m, cotangent_loss(x, out_cot(m, x, 0), call), shape[0], "mean")


def test_embedding_bag_through_fallback():
    torch.manual_seed(0)
    m = nn.EmbeddingBag(7, 3, mode="mean").to(DT)
    ids = torch.randint(0, 7, (4, 5))
    assert_matches_reference(m, cotangent_loss(ids, out_cot(m, ids, 0), call), 4, "sum")


class NoisyBlock(nn.Module):
    """Own parameter + a dropout child: the fallback (over the subtree) cannot re-run it."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 3))
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(x @ self.w)


def test_dropout_inside_fallback_module_rejected_in_training_only():
    m = NoisyBlock().to(DT)
    hooks = GradSampleHooks(m)
    with pytest.raises(InvalidHyperparameterError, match="Dropout"):
        m(torch.randn(2, 3, dtype=DT))
    m.eval()
    m(torch.randn(2, 3, dtype=DT)).sum().backward()
    assert m.w.grad_sample.shape == (2, 3, 3)
    hooks.remove()


@pytest.mark.parametrize("shape", [(3, 2, 5, 7), (2, 1, 8, 1), (4, 3, 6, 6)])
@pytest.mark.parametrize("kernel,stride,dilation", [
    ((1, 1), (1, 1), (1, 1)), ((3, 1), (2, 1), (1, 1)), ((2, 1), (1, 1), (2, 1)),
    ((3, 1), (1, 1), (2, 1)), ((1, 1), (3, 1), (1, 1)),
])  # fmt: skip
def test_strided_unfold_is_f_unfold_exactly(shape, kernel, stride, dilation):
    """The view-based unfold of the convolution rules gives F.unfold's values in F.unfold's
    places (the same per-example gradients, bit for bit), for strides and dilations."""
    from adaclip_torch.grad_sample.conv import strided_unfold

    x = torch.randn(*shape, generator=torch.Generator().manual_seed(3))
    for k, s, d in ((kernel, stride, dilation), (kernel[::-1], stride[::-1], dilation[::-1])):
        if (k[0] - 1) * d[0] + 1 > shape[2] or (k[1] - 1) * d[1] + 1 > shape[3]:
            continue
        want = torch.nn.functional.unfold(x, k, dilation=d, stride=s)
        got = strided_unfold(x, k, s, d)
        assert got.shape == want.shape and torch.equal(got, want)
