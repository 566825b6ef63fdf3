"""Whole models through GradSampleHooks (MLP, CNN, LSTM language model with tied weights,
LayerNorm models) against the micro-batch reference, and the hook lifecycle: frozen
parameters, clear(), remove(), accumulation, empty batches, argument validation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from test_torch_grad_sample import DT, TOL, assert_matches_reference, micro_batch_reference
from torch import nn

from adaclip.errors import InvalidGradientError, InvalidHyperparameterError
from adaclip_torch.grad_sample import GradSampleHooks

pytestmark = pytest.mark.torch


def ce_loss(x: torch.Tensor, y: torch.Tensor):
    """Cross-entropy summed over the examples in the slice (and over their tokens)."""

    def loss_fn(model: nn.Module, sl: slice) -> torch.Tensor:
        out = model(x[sl])
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y[sl].reshape(-1), reduction="sum")

    return loss_fn


def mlp(fin: int = 5, hidden: int = 7, classes: int = 3) -> nn.Module:
    return nn.Sequential(
        nn.Linear(fin, hidden), nn.ReLU(inplace=True), nn.LayerNorm(hidden), nn.Linear(hidden, classes)
    ).to(DT)


def cnn(classes: int = 3) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, stride=2, padding=1),
        nn.GroupNorm(2, 4),
        nn.ReLU(),
        nn.Conv2d(4, 6, 3, groups=2, dilation=2, padding=2),
        nn.AdaptiveAvgPool2d(2),
        nn.Flatten(),
        nn.Linear(24, classes),
    ).to(DT)


class LSTMLanguageModel(nn.Module):
    """Embedding → LSTM → LayerNorm → softmax Linear whose weight *is* the embedding weight."""

    def __init__(self, vocab: int = 11, hidden: int = 6, layers: int = 2, rnn: type[nn.Module] = nn.LSTM) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden, padding_idx=0)
        self.rnn = rnn(hidden, hidden, num_layers=layers, batch_first=True)
        self.norm = nn.LayerNorm(hidden)
        self.out = nn.Linear(hidden, vocab)
        self.out.weight = self.emb.weight  # tied

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(self.emb(ids))
        return self.out(self.norm(h))


@settings(max_examples=10)
@given(n=st.integers(1, 6), reduction=st.sampled_from(["sum", "mean"]), seed=st.integers(0, 2**16))
def test_mlp_with_layer_norm(n, reduction, seed):
    torch.manual_seed(seed)
    x, y = torch.randn(n, 5, dtype=DT), torch.randint(0, 3, (n,))
    assert_matches_reference(mlp(), ce_loss(x, y), n, reduction)


@settings(max_examples=8)
@given(n=st.integers(1, 5), reduction=st.sampled_from(["sum", "mean"]), seed=st.integers(0, 2**16))
def test_cnn_conv_groupnorm_linear(n, reduction, seed):
    torch.manual_seed(seed)
    x, y = torch.randn(n, 3, 9, 9, dtype=DT), torch.randint(0, 3, (n,))
    assert_matches_reference(cnn(), ce_loss(x, y), n, reduction)


@settings(max_examples=6)
@given(n=st.integers(1, 5), seq=st.integers(1, 5), rnn=st.sampled_from([nn.LSTM, nn.GRU]), seed=st.integers(0, 2**16))
def test_lstm_language_model_with_tied_embedding(n, seq, rnn, seed):
    torch.manual_seed(seed)
    model = LSTMLanguageModel(rnn=rnn).to(DT)
    assert model.out.weight is model.emb.weight
    ids, targets = torch.randint(0, 11, (n, seq)), torch.randint(0, 11, (n, seq))
    assert_matches_reference(model, ce_loss(ids, targets), n, "mean")


def test_tied_weight_gets_sum_of_both_contributions():
    """The tied weight's grad_sample is (embedding part + softmax part) per example: compare
    with an untied copy holding the same values, whose two weights get one part each."""
    torch.manual_seed(3)
    vocab, hidden, n = 7, 4, 3
    emb = nn.Embedding(vocab, hidden).to(DT)
    out = nn.Linear(hidden, vocab, bias=False).to(DT)
    out.weight = emb.weight
    tied = nn.Sequential(emb, nn.Tanh(), out)
    untied = nn.Sequential(nn.Embedding(vocab, hidden), nn.Tanh(), nn.Linear(hidden, vocab, bias=False)).to(DT)
    with torch.no_grad():
        untied[0].weight.copy_(emb.weight)
        untied[2].weight.copy_(emb.weight)
    ids, y = torch.randint(0, vocab, (n, 5)), torch.randint(0, vocab, (n, 5))
    with GradSampleHooks(untied, loss_reduction="sum"):
        ce_loss(ids, y)(untied, slice(None)).backward()
        part_emb = untied[0].weight.grad_sample.clone()
        part_out = untied[2].weight.grad_sample.clone()
    with GradSampleHooks(tied, loss_reduction="sum"):
        ce_loss(ids, y)(tied, slice(None)).backward()
        got = emb.weight.grad_sample.clone()
    assert len(list(tied.parameters())) == 1
    torch.testing.assert_close(got, part_emb + part_out, **TOL)
    torch.testing.assert_close(got, micro_batch_reference(tied, ce_loss(ids, y), n)["0.weight"], **TOL)
    assert (part_emb.abs().amax() > 1e-3) and (part_out.abs().amax() > 1e-3)


def test_shared_module_called_twice():
    torch.manual_seed(0)
    lin = nn.Linear(4, 4).to(DT)

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = lin

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(torch.tanh(self.lin(x)))

    x, cot = torch.randn(3, 4, dtype=DT), torch.randn(3, 4, dtype=DT)
    assert_matches_reference(Twice(), lambda m, sl: (m(x[sl]) * cot[sl]).sum(), 3, "mean")


def test_frozen_parameters_get_no_grad_sample():
    torch.manual_seed(0)
    model = mlp()
    model[0].weight.requires_grad_(False)
    model[2].requires_grad_(False)
    x, y = torch.randn(4, 5, dtype=DT), torch.randint(0, 3, (4,))
    assert_matches_reference(model, ce_loss(x, y), 4, "mean")
    hooks = GradSampleHooks(model)
    F.cross_entropy(model(x), y).backward()
    assert getattr(model[0].weight, "grad_sample", None) is None
    assert getattr(model[2].weight, "grad_sample", None) is None
    assert getattr(model[2].bias, "grad_sample", None) is None
    assert model[0].bias.grad_sample.shape == (4, 7)
    assert model[3].weight.grad_sample.shape == (4, 3, 7)
    hooks.remove()


def test_clear_deletes_grad_samples():
    model = mlp()
    hooks = GradSampleHooks(model)
    x, y = torch.randn(4, 5, dtype=DT), torch.randint(0, 3, (4,))
    F.cross_entropy(model(x), y).backward()
    assert all(p.grad_sample.shape[0] == 4 for p in model.parameters())
    hooks.clear()
    assert not any(hasattr(p, "grad_sample") for p in model.parameters())
    assert hooks.batch_size == 4
    # a new batch of another size is fine after clear()
    F.cross_entropy(model(x[:2]), y[:2]).backward()
    assert all(p.grad_sample.shape[0] == 2 for p in model.parameters())
    assert hooks.batch_size == 2
    hooks.remove()


def test_remove_leaves_no_hooks_and_keeps_user_hooks():
    model = cnn()
    user_calls = []
    model[0].register_forward_hook(lambda *a: user_calls.append(1))
    before = {name: len(m._forward_hooks) for name, m in model.named_modules()}
    attrs_before = set(vars(model))
    hooks = GradSampleHooks(model)
    assert sum(len(m._forward_hooks) for m in model.modules()) > sum(before.values())
    x, y = torch.randn(2, 3, 9, 9, dtype=DT), torch.randint(0, 3, (2,))
    out = model(x)  # graph built while hooked...
    hooks.remove()
    assert {name: len(m._forward_hooks) for name, m in model.named_modules()} == before
    assert set(vars(model)) == attrs_before  # nothing left on the model object
    F.cross_entropy(out, y).backward()  # ...backpropagated after remove(): ignored
    F.cross_entropy(model(x), y).backward()
    assert not any(hasattr(p, "grad_sample") for p in model.parameters())
    assert len(user_calls) == 2
    # and hooks can be attached again
    GradSampleHooks(model).remove()


def test_context_manager_removes():
    model = mlp()
    with GradSampleHooks(model) as hooks:
        F.cross_entropy(model(torch.randn(3, 5, dtype=DT)), torch.randint(0, 3, (3,))).backward()
        assert hooks.batch_size == 3
    assert not any(m._forward_hooks for m in model.modules())


def test_accumulation_over_two_backwards():
    torch.manual_seed(1)
    model = mlp()
    x1, x2 = torch.randn(4, 5, dtype=DT), torch.randn(4, 5, dtype=DT)
    y1, y2 = torch.randint(0, 3, (4,)), torch.randint(0, 3, (4,))
    ref1 = micro_batch_reference(model, ce_loss(x1, y1), 4)
    ref2 = micro_batch_reference(model, ce_loss(x2, y2), 4)
    hooks = GradSampleHooks(model, loss_reduction="mean", allow_multiple_backward=True)
    F.cross_entropy(model(x1), y1).backward()
    F.cross_entropy(model(x2), y2).backward()
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad_sample, ref1[k] + ref2[k], **TOL)
    with pytest.raises(InvalidGradientError, match="batch size 3"):
        F.cross_entropy(model(x1[:3]), y1[:3]).backward()
    hooks.clear()
    F.cross_entropy(model(x1[:3]), y1[:3]).backward()
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad_sample, ref1[k][:3], **TOL)
    hooks.remove()


def test_retain_graph_backward_twice_accumulates():
    torch.manual_seed(2)
    model = mlp()
    x, y = torch.randn(3, 5, dtype=DT), torch.randint(0, 3, (3,))
    ref = micro_batch_reference(model, ce_loss(x, y), 3)
    hooks = GradSampleHooks(model, loss_reduction="sum", allow_multiple_backward=True)
    loss = ce_loss(x, y)(model, slice(None))
    loss.backward(retain_graph=True)
    loss.backward()
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad_sample, 2 * ref[k], **TOL)
    hooks.remove()


def test_second_backward_is_refused_by_default_and_stores_nothing():
    """Without allow_multiple_backward a second backward pass before clear() raises before any
    of its gradients is stored; after clear() a new pass is taken."""
    torch.manual_seed(1)
    model = mlp()
    x1, x2 = torch.randn(4, 5, dtype=DT), torch.randn(4, 5, dtype=DT)
    y1, y2 = torch.randint(0, 3, (4,)), torch.randint(0, 3, (4,))
    ref1 = micro_batch_reference(model, ce_loss(x1, y1), 4)
    ref2 = micro_batch_reference(model, ce_loss(x2, y2), 4)
    hooks = GradSampleHooks(model, loss_reduction="mean")
    F.cross_entropy(model(x1), y1).backward()
    for xb, yb in ((x2, y2), (x2[:3], y2[:3])):  # same size and different size alike
        with pytest.raises(InvalidGradientError, match="second backward pass"):
            F.cross_entropy(model(xb), yb).backward()
        for k, p in model.named_parameters():
            torch.testing.assert_close(p.grad_sample, ref1[k], **TOL)
    hooks.clear()
    F.cross_entropy(model(x2), y2).backward()
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad_sample, ref2[k], **TOL)
    with pytest.raises(InvalidHyperparameterError, match="allow_multiple_backward"):
        GradSampleHooks(mlp(), allow_multiple_backward=1)
    hooks.remove()


def test_paired_forward_in_one_graph_makes_the_pair_the_unit():
    """A siamese forward over two batches in one graph, one backward: row i holds the gradient of
    pair i's loss (both calls' contributions), which is the documented pair-as-unit semantics."""
    torch.manual_seed(3)
    model = mlp()
    a, b = torch.randn(4, 5, dtype=DT), torch.randn(4, 5, dtype=DT)

    def pair_loss(m, sl):
        return ((m(a[sl]) - m(b[sl])) ** 2).sum()

    ref = micro_batch_reference(model, pair_loss, 4)
    hooks = GradSampleHooks(model, loss_reduction="sum")
    pair_loss(model, slice(None)).backward()
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad_sample, ref[k], **TOL)
    hooks.remove()


def test_no_grad_forward_captures_nothing():
    model = mlp()
    hooks = GradSampleHooks(model)
    with torch.no_grad():
        model(torch.randn(3, 5, dtype=DT))
    F.cross_entropy(model(torch.randn(2, 5, dtype=DT)), torch.randint(0, 3, (2,))).backward()
    assert hooks.batch_size == 2
    hooks.remove()


@pytest.mark.parametrize("make, shape", [(mlp, (0, 5)), (cnn, (0, 3, 9, 9))])
def test_empty_batch_gives_empty_grad_samples(make, shape):
    model = make()
    hooks = GradSampleHooks(model, loss_reduction="sum")
    out = model(torch.randn(*shape, dtype=DT))
    F.cross_entropy(out, torch.zeros(0, dtype=torch.long), reduction="sum").backward()
    for p in model.parameters():
        assert p.grad_sample.shape == (0, *p.shape)
    assert hooks.batch_size == 0
    hooks.remove()


def test_empty_batch_in_embedding_model():
    model = nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 5), nn.LayerNorm(5)).to(DT)
    hooks = GradSampleHooks(model)
    model(torch.zeros(0, 4, dtype=torch.long)).sum().backward()
    assert [tuple(p.grad_sample.shape) for p in model.parameters()] == [(0, 5, 3), (0, 5, 3), (0, 5), (0, 5), (0, 5)]
    hooks.remove()


def test_argument_validation():
    with pytest.raises(InvalidHyperparameterError, match="loss_reduction"):
        GradSampleHooks(mlp(), loss_reduction="none")
    with pytest.raises(InvalidHyperparameterError, match="batch_first"):
        GradSampleHooks(mlp(), batch_first=1)
    with pytest.raises(InvalidHyperparameterError, match="Module"):
        GradSampleHooks(lambda x: x)
    model = mlp()
    hooks = GradSampleHooks(model)
    with pytest.raises(InvalidHyperparameterError, match="already"):
        GradSampleHooks(model)
    hooks.remove()


def test_mean_is_n_times_sum_capture():
    """With loss_reduction="mean" the captured gradient (of the mean loss) is multiplied by n:
    the result equals the "sum" result on the same data."""
    torch.manual_seed(5)
    model = mlp()
    x, y = torch.randn(5, 5, dtype=DT), torch.randint(0, 3, (5,))
    with GradSampleHooks(model, loss_reduction="mean"):
        F.cross_entropy(model(x), y, reduction="mean").backward()
        mean_gs = [p.grad_sample.clone() for p in model.parameters()]
    with GradSampleHooks(model, loss_reduction="sum"):
        F.cross_entropy(model(x), y, reduction="sum").backward()
        sum_gs = [p.grad_sample.clone() for p in model.parameters()]
    for a, b in zip(mean_gs, sum_gs):
        torch.testing.assert_close(a, b, **TOL)
