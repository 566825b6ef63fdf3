"""A DP-compatible LSTM built from ``nn.Linear`` projections.

``nn.LSTM`` trains under :class:`adaclip_torch.grad_sample.GradSampleHooks` through the
:mod:`torch.func` fallback, which loops over the examples of a batch (fused RNN kernels do not
run under vmap) and refuses internal dropout between layers. :class:`DPLSTM` computes the same
function with one input projection per layer (applied to the whole sequence at once) and one
hidden projection per layer (applied at every time step), both linear layers whose
per-example gradients come from the batched Linear rule:

    [i, f, g, o] = x_t W_ihᵀ + b_ih + h_{t-1} W_hhᵀ + b_hh
    c_t = σ(f) ⊙ c_{t-1} + σ(i) ⊙ tanh(g),        h_t = σ(o) ⊙ tanh(c_t)

(PyTorch's gate order and parameterisation, so :meth:`DPLSTM.from_lstm` copies an ``nn.LSTM``'s
weights exactly). Dropout between layers is an ordinary ``nn.Dropout`` outside the projections,
so it is allowed. The projections always see batch-first tensors (``(n, T, ·)`` and ``(n, H)``)
whatever ``batch_first`` says, and their rule ignores the engine's ``batch_first`` flag.

Supported subset of ``nn.LSTM``'s signature: ``input_size, hidden_size, num_layers, bias,
batch_first, dropout``; unidirectional, no ``proj_size``, padded (not packed) sequences.
"""

from __future__ import annotations

import torch
from torch import nn

from adaclip.errors import InvalidHyperparameterError
from adaclip_torch.grad_sample.linear import linear_grad_sample
from adaclip_torch.grad_sample.registry import register_grad_sampler

__all__ = ["DPLSTM", "BatchFirstLinear"]


class BatchFirstLinear(nn.Linear):
    """An ``nn.Linear`` whose inputs always carry the batch on dim 0 (used inside DPLSTM)."""


register_grad_sampler(BatchFirstLinear, batch_first_sensitive=False)(linear_grad_sample)


class DPLSTM(nn.Module):
    """Multi-layer LSTM equivalent to ``nn.LSTM`` (unidirectional), made of linear layers.

    ``forward(input, hx=None) -> (output, (h_n, c_n))`` with the shapes of ``nn.LSTM``:
    input ``(n, T, input_size)`` if ``batch_first`` else ``(T, n, input_size)``; ``hx`` and the
    returned states ``(num_layers, n, hidden_size)``.
    """

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        num_layers: int = 1,
        bias: bool = True,
        batch_first: bool = False,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        for name, v in (("input_size", input_size), ("hidden_size", hidden_size), ("num_layers", num_layers)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise InvalidHyperparameterError(f"DPLSTM {name} must be a positive int, got {v!r}")
        if not 0.0 <= float(dropout) < 1.0:
            raise InvalidHyperparameterError(f"DPLSTM dropout must be in [0, 1), got {dropout!r}")
        self.input_size, self.hidden_size, self.num_layers = input_size, hidden_size, num_layers
        self.bias, self.batch_first, self.dropout = bias, batch_first, float(dropout)
        self.ih = nn.ModuleList(
            BatchFirstLinear(input_size if k == 0 else hidden_size, 4 * hidden_size, bias=bias)
            for k in range(num_layers)
        )
        self.hh = nn.ModuleList(BatchFirstLinear(hidden_size, 4 * hidden_size, bias=bias) for _ in range(num_layers))
        self.drop = nn.Dropout(self.dropout)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.LSTM``'s initialisation: every weight and bias U(−1/√H, 1/√H)."""
        bound = self.hidden_size**-0.5
        for p in self.parameters():
            nn.init.uniform_(p, -bound, bound)

    @classmethod
    def from_lstm(cls, lstm: nn.LSTM) -> DPLSTM:
        """A DPLSTM computing exactly what ``lstm`` computes (weights copied)."""
        if lstm.bidirectional or lstm.proj_size:
            raise InvalidHyperparameterError("DPLSTM.from_lstm: bidirectional / proj_size LSTMs are not supported")
        new = cls(lstm.input_size, lstm.hidden_size, lstm.num_layers, lstm.bias, lstm.batch_first, lstm.dropout)
        new = new.to(device=lstm.weight_ih_l0.device, dtype=lstm.weight_ih_l0.dtype)
        with torch.no_grad():
            for k in range(lstm.num_layers):
                new.ih[k].weight.copy_(getattr(lstm, f"weight_ih_l{k}"))
                new.hh[k].weight.copy_(getattr(lstm, f"weight_hh_l{k}"))
                if lstm.bias:
                    new.ih[k].bias.copy_(getattr(lstm, f"bias_ih_l{k}"))
                    new.hh[k].bias.copy_(getattr(lstm, f"bias_hh_l{k}"))
        return new

    def forward(
        self, input: torch.Tensor, hx: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        if input.dim() != 3:
            raise InvalidHyperparameterError(
                f"DPLSTM expects a batched 3-D input, got shape {tuple(input.shape)}"
            )
        x = input if self.batch_first else input.transpose(0, 1)  # (n, T, in)
        n, steps = x.shape[0], x.shape[1]
        if hx is None:
            zeros = x.new_zeros(self.num_layers, n, self.hidden_size)
            h0, c0 = zeros, zeros
        else:
            h0, c0 = hx
        h_n, c_n = [], []
        for k in range(self.num_layers):
            if k > 0:
                x = self.drop(x)
            gates_x = self.ih[k](x)  # one projection of the whole sequence
            h, c = h0[k], c0[k]
            outs = []
            for t in range(steps):
                i, f, g, o = (gates_x[:, t] + self.hh[k](h)).chunk(4, dim=1)
                c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
                h = torch.sigmoid(o) * torch.tanh(c)
                outs.append(h)
            x = torch.stack(outs, dim=1) if outs else x.new_zeros(n, 0, self.hidden_size)
            h_n.append(h)
            c_n.append(c)
        output = x if self.batch_first else x.transpose(0, 1)
        return output, (torch.stack(h_n), torch.stack(c_n))

    def extra_repr(self) -> str:
        return (
            f"{self.input_size}, {self.hidden_size}, num_layers={self.num_layers}, bias={self.bias}, "
            f"batch_first={self.batch_first}, dropout={self.dropout}"
        )
