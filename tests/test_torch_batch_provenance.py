"""A module called on a tensor that does not descend from the batch is never taken for batched.

nanoGPT's ``wpe(torch.arange(t))``, a relative-position bias indexed by an ``(L, L)`` matrix, a
``Linear`` applied to a buffer and a custom module (the ``torch.func`` fallback) indexing its own
table: each input is built inside ``forward``, and when its dim 0 equals the batch size n
(L = n) its shape looks batched. Before provenance tracking the hooks took such a call for a
batched one, and "example i's" gradient was the sum over all examples at position i: one
example moved the clipped sum by 4.00·C at n = L = 16. Now the call is routed as batch-free
whatever its shape (:mod:`adaclip_torch.grad_sample._provenance`): per-example gradients equal
``torch.func``'s, one example moves the noiseless clipped sum by at most C, and the batches may
come from a fixed-size loader, Poisson sampling or BLT's fixed-order sampler.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.utils.data import DataLoader, TensorDataset

from adaclip_torch import FlatClip
from adaclip_torch.data import FixedOrderBatchSampler, poisson_data_loader
from adaclip_torch.grad_sample import GradSampleHooks
from adaclip_torch.grad_sample._provenance import BatchProvenance

V, D, L = 11, 4, 6
DT = torch.float64


class NanoGPT(nn.Module):
    """``wte(idx) + wpe(torch.arange(t))``: the position ids are an ``(L,)`` tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(V, D)
        self.wpe = nn.Embedding(L, D)
        self.head = nn.Linear(D, 2)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        return self.head(torch.tanh(x)).sum(1)


class RelativeBias(nn.Module):
    """Attention scores plus a bias indexed by an ``(L, L)`` relative-position matrix."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(V, D)
        self.bias = nn.Embedding(2 * L - 1, 1)
        self.head = nn.Linear(D, 2)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        rel = torch.arange(t)[None, :] - torch.arange(t)[:, None] + t - 1  # (L, L)
        h = self.wte(idx)
        scores = h @ h.transpose(1, 2) + self.bias(rel).squeeze(-1)
        return self.head(scores.softmax(-1) @ h).sum(1)


class LinearOnBuffer(nn.Module):
    """A ``Linear`` applied to a buffer of ``L`` rows (learned-query style), added to the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(V, D)
        self.register_buffer("queries", torch.randn(L, D))
        self.proj = nn.Linear(D, D)
        self.head = nn.Linear(D, 2)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.proj(self.queries[: idx.shape[1]])
        return self.head(torch.tanh(x)).sum(1)


class Table(nn.Module):
    """A custom module without a registered rule (the ``torch.func`` fallback): rows of its own
    table, picked by an index."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(rows, D) / 2)

    def forward(self, index: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.weight[index]) * 2


class CustomOnPositions(nn.Module):
    """The custom module called on ``(L,)`` positions and on an ``(L, L)`` relative index."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(V, D)
        self.pos = Table(L)
        self.rel = Table(2 * L - 1)
        self.head = nn.Linear(D, 2)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        rel = torch.arange(t)[None, :] - torch.arange(t)[:, None] + t - 1
        h = self.wte(idx) + self.pos(torch.arange(t))  # (n, L, D) + (L, D)
        scores = h @ h.transpose(1, 2) + self.rel(rel).sum(-1)  # + (L, L)
        return self.head(scores.softmax(-1) @ h).sum(1)


MODELS = {"nanogpt": NanoGPT, "relative_bias": RelativeBias, "linear_on_buffer": LinearOnBuffer,
          "custom_module": CustomOnPositions}  # fmt: skip


def build(name: str) -> nn.Module:
    torch.manual_seed(1)
    return MODELS[name]().to(DT)


def batch(n: int, seed: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (n, L), generator=g), torch.randn(n, 2, generator=g, dtype=DT)


def loss_of(model: nn.Module, idx: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return 0.5 * ((model(idx) - y) ** 2).sum()


def true_per_example(model: nn.Module, idx: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = {k: v for k, v in model.named_buffers()}

    def one(p, i, t):
        return loss_of(lambda a: functional_call(model, (p, buffers), (a,)), i[None], t[None])

    return vmap(grad(one), in_dims=(None, 0, 0))(params, idx, y)


def hooked_per_example(model: nn.Module, idx: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    with GradSampleHooks(model, loss_reduction="sum"):
        loss_of(model, idx, y).backward()
        got = {k: p.grad_sample.detach().clone() for k, p in model.named_parameters()}
    model.zero_grad()
    return got


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("n", [L - 1, L, L + 1])
def test_grad_sample_is_each_examples_own_gradient(name, n):
    """Whatever n, also n = L (where the index's dim 0 equals the batch size)."""
    model = build(name)
    idx, y = batch(n)
    got, want = hooked_per_example(model, idx, y), true_per_example(model, idx, y)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-9, atol=1e-11, msg=k)


def clipped_sum(model: nn.Module, idx: torch.Tensor, y: torch.Tensor, clip: float, mode: str) -> torch.Tensor:
    """Σ_i clip(g_i): σ = 0, SGD at lr 1, B̄ = 1, so the parameters move by exactly minus it."""
    opt = FlatClip(torch.optim.SGD(model.parameters(), lr=1.0), model, max_grad_norm=clip, noise_multiplier=0.0,
                   expected_batch_size=1.0, loss_reduction="sum", per_sample_mode=mode)  # fmt: skip
    before = [p.detach().clone() for p in model.parameters()]
    try:
        loss_of(model, idx, y).backward()
        opt.step()
    finally:
        opt.remove_hooks()
    return torch.cat([(b - p.detach()).reshape(-1) for b, p in zip(before, model.parameters(), strict=True)])


def sensitivity(name: str, n: int, mode: str, clip: float = 1e-3) -> float:
    """‖S(D) − S(D')‖ where D' zeroes example 0's gradient (its residual is 0 there: removing it),
    every other example's residual 0 in both: a correct mechanism gives at most C."""
    idx, _ = batch(n)
    with torch.no_grad():
        target = build(name)(idx)
    y = target.clone()
    y[0] += 3.0
    return float((clipped_sum(build(name), idx, y, clip, mode) - clipped_sum(build(name), idx, target, clip, mode)).norm()) / clip


@pytest.mark.parametrize("mode", ["auto", "materialise"])
@pytest.mark.parametrize("name", list(MODELS))
def test_one_example_moves_the_clipped_sum_by_at_most_the_clip_norm(name, mode):
    assert sensitivity(name, L, mode) <= 1 + 1e-6


def test_the_sensitivity_check_can_fail(monkeypatch):
    """Negative control: with every tensor taken for batched (shape alone, as before), the same
    measure sees one example move the clipped sum by far more than C at n = L."""
    monkeypatch.setattr(BatchProvenance, "descends", lambda self, t: True)
    assert sensitivity("nanogpt", L, "materialise") > 2.0


def _loaders(n_data: int) -> dict[str, DataLoader]:
    g = torch.Generator().manual_seed(4)
    data = TensorDataset(torch.randint(0, V, (n_data, L), generator=g), torch.randn(n_data, 2, generator=g, dtype=DT))
    return {
        "fixed_size": DataLoader(data, batch_size=L, shuffle=True, generator=torch.Generator().manual_seed(5)),
        "poisson": poisson_data_loader(data, L / n_data, generator=torch.Generator().manual_seed(6)),
        "fixed_order": DataLoader(data, batch_sampler=FixedOrderBatchSampler(n_data, L, torch.Generator().manual_seed(7))),
    }


@pytest.mark.parametrize("sampler", ["fixed_size", "poisson", "fixed_order"])
def test_every_sampler_gives_each_examples_own_gradient(sampler):
    """The batches a fixed-size loader, Poisson sampling and BLT's fixed-order sampler make, with
    n = L in some or every step: each step's per-example gradients are torch.func's."""
    model = build("nanogpt")
    sizes = []
    loader = _loaders(4 * L)[sampler]
    batches = [b for _ in range(3) for b in loader]  # three epochs
    for step, (idx, y) in enumerate(batches):
        if len(idx) == 0:
            continue
        sizes.append(len(idx))
        got, want = hooked_per_example(model, idx, y), true_per_example(model, idx, y)
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-9, atol=1e-11, msg=f"step {step}, {k}")
    assert L in sizes  # the case that looked batched by its shape was among them


def test_a_tensor_expanded_to_the_batch_is_batched():
    """An explicit ``expand`` of a non-batch tensor to the batch (BERT's token-type buffer) gives
    one copy per example: the call stays batched, each row its example's own."""

    class TypeIds(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte = nn.Embedding(V, D)
            self.types = nn.Embedding(2, D)
            self.register_buffer("type_ids", torch.zeros(1, L, dtype=torch.long))
            self.head = nn.Linear(D, 2)

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            x = self.wte(idx) + self.types(self.type_ids.expand(idx.shape[0], -1))
            return self.head(x).sum(1)

    torch.manual_seed(1)
    model = TypeIds().to(DT)
    for n in (L, L + 2):
        idx, y = batch(n)
        got, want = hooked_per_example(model, idx, y), true_per_example(model, idx, y)
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-9, atol=1e-11, msg=k)
