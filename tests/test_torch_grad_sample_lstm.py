"""DPLSTM (adaclip_torch.layers): same function as nn.LSTM, per-sample gradients from the
Linear rule, checked against the micro-batch reference; an LSTM language model with tied
embedding/softmax weights built on it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from test_torch_grad_sample import DT, TOL, assert_matches_reference
from torch import nn

from adaclip.errors import InvalidHyperparameterError
from adaclip_torch.grad_sample import GradSampleHooks
from adaclip_torch.layers import DPLSTM

pytestmark = pytest.mark.torch


@settings(max_examples=15)
@given(n=st.integers(1, 5), fin=st.integers(1, 5), hidden=st.integers(1, 5), layers=st.integers(1, 3),
       seq=st.integers(0, 4), bf=st.booleans(), bias=st.booleans(), with_state=st.booleans(),
       seed=st.integers(0, 2**16))
def test_dplstm_computes_what_nn_lstm_computes(n, fin, hidden, layers, seq, bf, bias, with_state, seed):
    torch.manual_seed(seed)
    ref = nn.LSTM(fin, hidden, num_layers=layers, bias=bias, batch_first=bf).to(DT)
    dp = DPLSTM.from_lstm(ref)
    x = torch.randn(n, seq, fin, dtype=DT) if bf else torch.randn(seq, n, fin, dtype=DT)
    hx = (torch.randn(layers, n, hidden, dtype=DT), torch.randn(layers, n, hidden, dtype=DT)) if with_state else None
    if seq == 0:  # nn.LSTM rejects empty sequences; DPLSTM returns the initial state
        out, (h, c) = dp(x, hx)
        assert out.shape == x.shape[:2] + (hidden,)
        return
    a, (ha, ca) = ref(x, hx)
    b, (hb, cb) = dp(x, hx)
    torch.testing.assert_close(b, a, **TOL)
    torch.testing.assert_close(hb, ha, **TOL)
    torch.testing.assert_close(cb, ca, **TOL)


@settings(max_examples=12)
@given(n=st.integers(1, 5), fin=st.integers(1, 4), hidden=st.integers(1, 4), layers=st.integers(1, 2),
       seq=st.integers(1, 4), module_bf=st.booleans(), engine_bf=st.booleans(), seed=st.integers(0, 2**16))
def test_dplstm_per_sample_gradients(n, fin, hidden, layers, seq, module_bf, engine_bf, seed):
    """The projections always see batch-first tensors, so the engine's batch_first flag does
    not matter for DPLSTM itself."""
    torch.manual_seed(seed)
    m = DPLSTM(fin, hidden, num_layers=layers, batch_first=module_bf).to(DT)
    x = torch.randn(n, seq, fin, dtype=DT) if module_bf else torch.randn(seq, n, fin, dtype=DT)
    co = torch.randn(*x.shape[:2], hidden, dtype=DT)
    ch = torch.randn(layers, n, hidden, dtype=DT)
    bsl = (lambda sl: (sl,)) if module_bf else (lambda sl: (slice(None), sl))

    def loss_fn(mod: nn.Module, sl: slice) -> torch.Tensor:
        out, (h, c) = mod(x[bsl(sl)])
        return (out * co[bsl(sl)]).sum() + (c * ch[:, sl]).sum()

    assert_matches_reference(m, loss_fn, n, "mean", batch_first=engine_bf)


class DPLanguageModel(nn.Module):
    def __init__(self, vocab: int = 13, hidden: int = 6, dropout: float = 0.0) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.rnn = DPLSTM(hidden, hidden, num_layers=2, batch_first=True, dropout=dropout)
        self.drop = nn.Dropout(dropout)
        self.out = nn.Linear(hidden, vocab)
        self.out.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(self.drop(self.emb(ids)))
        return self.out(self.drop(h))


@settings(max_examples=6)
@given(n=st.integers(1, 5), seq=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_dplstm_language_model_with_tied_weights(n, seq, seed):
    torch.manual_seed(seed)
    model = DPLanguageModel().to(DT)
    ids, y = torch.randint(0, 13, (n, seq)), torch.randint(0, 13, (n, seq))

    def loss_fn(mod: nn.Module, sl: slice) -> torch.Tensor:
        out = mod(ids[sl])
        return F.cross_entropy(out.reshape(-1, 13), y[sl].reshape(-1), reduction="sum")

    assert_matches_reference(model, loss_fn, n, "mean")


def test_dplstm_with_dropout_trains_and_is_consistent():
    """With dropout (random, so no micro-batch reference) the per-sample gradients still sum
    to n × the mean-loss gradient, and every example's row is used."""
    torch.manual_seed(0)
    model = DPLanguageModel(dropout=0.3).to(DT).train()
    ids = torch.randint(0, 13, (4, 6))
    with GradSampleHooks(model, loss_reduction="mean"):
        out = model(ids)
        F.cross_entropy(out.reshape(-1, 13), ids.reshape(-1)).backward()
        for p in model.parameters():
            assert p.grad_sample.shape == (4, *p.shape)
            torch.testing.assert_close(p.grad_sample.sum(0), 4 * p.grad, **TOL)
            assert torch.all(p.grad_sample.flatten(1).abs().amax(1) > 0)


def test_dplstm_validation():
    with pytest.raises(InvalidHyperparameterError, match="hidden_size"):
        DPLSTM(3, 0)
    with pytest.raises(InvalidHyperparameterError, match="dropout"):
        DPLSTM(3, 2, dropout=1.0)
    with pytest.raises(InvalidHyperparameterError, match="bidirectional"):
        DPLSTM.from_lstm(nn.LSTM(3, 2, bidirectional=True))
    with pytest.raises(InvalidHyperparameterError, match="3-D"):
        DPLSTM(3, 2)(torch.randn(4, 3))


@pytest.mark.parametrize("rnn", [nn.LSTM, DPLSTM])
def test_empty_batch_recurrent(rnn):
    m = rnn(3, 4, num_layers=2, batch_first=True).to(DT)
    with GradSampleHooks(m, loss_reduction="mean"):
        out, (h, c) = m(torch.randn(0, 5, 3, dtype=DT))
        out.sum().backward()
        for p in m.parameters():
            assert p.grad_sample.shape == (0, *p.shape)
