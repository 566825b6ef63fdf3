"""The compiled region's capture method (``CompiledPerExampleGradients(method="capture")``):
the hooks' ghost and materialised engines fed from a ``torch.fx``-rewritten forward and one
backward to probes. The same steps as an eager ``backward()`` through the hooks (bit for bit
with a summed loss, eagerly), each example still clipped, the padding's rows never delivered,
and refusals — for calls whose rows are not examples above all — that change nothing."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from adaclip.errors import InvalidGradientError, InvalidHyperparameterError  # noqa: E402
from adaclip_torch import AdaClip, FlatClip  # noqa: E402
from adaclip_torch.compiled import CompiledPerExampleGradients  # noqa: E402

N = 13  # not a multiple of the padding: the compiled region pads to 32


class Bag(nn.Module):
    """Embedding → mean over positions → LayerNorm → Linear: ghost (embedding, linear) and
    materialised (LayerNorm) layers in one model."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(30, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 3)

    def forward(self, ids):
        return self.head(self.norm(self.embed(ids).mean(1)))


class Positions(nn.Module):
    """nanoGPT's position embedding: ``wpe`` is called on ``arange(L)``, whose rows are positions."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(30, 8)
        self.wpe = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, ids):
        pos = torch.arange(ids.size(1), device=ids.device)
        return self.head((self.wte(ids) + self.wpe(pos)).mean(1))


def _mlp():
    return nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.LayerNorm(16), nn.Linear(16, 4))


def _data(kind, n=N):
    g = torch.Generator().manual_seed(0)
    if kind == "bag":
        return torch.randint(0, 30, (n, 5), generator=g), torch.randint(0, 3, (n,), generator=g)
    return 3 * torch.randn(n, 12, generator=g), torch.randint(0, 4, (n,), generator=g)


def _optimizer(model, strategy, mode, reduction):
    common = dict(noise_multiplier=0.7, seed=5, expected_batch_size=N, per_sample_mode=mode, loss_reduction=reduction)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    if strategy == "flat":
        return FlatClip(sgd, model, max_grad_norm=0.5, **common)
    return AdaClip(sgd, model, **common)


def _train(kind, *, region, strategy="adaclip", mode="auto", reduction="sum", compile=False, steps=3):
    torch.manual_seed(1)
    model = Bag() if kind == "bag" else _mlp()
    opt = _optimizer(model, strategy, mode, reduction)
    grads = CompiledPerExampleGradients(opt, nn.functional.cross_entropy, method="capture", compile=compile) if region else None
    x, y = _data(kind)
    for _ in range(steps):
        opt.zero_grad()
        if region:
            grads(x, y)
        else:
            nn.functional.cross_entropy(model(x), y, reduction=reduction).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()], grads


@pytest.mark.parametrize("kind", ["mlp", "bag"])
@pytest.mark.parametrize("mode", ["auto", "ghost", "materialise"])
@pytest.mark.parametrize("strategy", ["flat", "adaclip"])
def test_the_eager_capture_takes_the_hooks_steps_bit_for_bit(kind, mode, strategy):
    # with a summed loss the hooks capture ∂L/∂y exactly as the probes' gradient gives it
    hooks, _ = _train(kind, region=False, strategy=strategy, mode=mode)
    region, grads = _train(kind, region=True, strategy=strategy, mode=mode)
    assert grads.method == "capture"
    assert all(torch.equal(a, b) for a, b in zip(hooks, region))


def test_the_capture_matches_a_mean_loss_within_rounding():
    # the hooks undo a mean's 1/n on the captured gradient (n·(δ/n)); the region never divides
    hooks, _ = _train("mlp", region=False, reduction="mean")
    region, _ = _train("mlp", region=True, reduction="mean")
    assert all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(hooks, region))


def test_the_compiled_capture_takes_the_same_steps_in_one_graph_and_drops_the_padding():
    hooks, _ = _train("bag", region=False)
    compiled, grads = _train("bag", region=True, compile=True)
    assert grads.pad_to_multiple == 32
    assert grads.sizes_seen == {32}  # 13 rows padded to 32: one compiled size for all three steps
    assert all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(hooks, compiled))
    assert grads.graph_breaks(*_data("bag")) == []


def test_what_the_hooks_receive_has_one_row_per_real_example():
    torch.manual_seed(2)
    model = Bag()
    opt = _optimizer(model, "flat", "auto", "sum")
    grads = CompiledPerExampleGradients(opt, nn.functional.cross_entropy, method="capture", compile=False,
                                        pad_to_multiple=8)  # fmt: skip
    grads.pad_to_multiple = 8  # the eager region does not pad; force it to test the slicing
    x, y = _data("bag")
    grads(x, y)
    captured = opt.grad_sample_hooks.captures
    assert {m for m in captured} == {model.embed, model.head}  # the ghost layers
    assert all(int(c[1].shape[0]) == N and int(c[0].shape[0]) == N for calls in captured.values() for c in calls)
    assert model.norm.weight.grad_sample.shape == (N, 8)  # the materialised layer, by its rule


def test_each_example_is_still_clipped():
    torch.manual_seed(2)
    model = _mlp()
    before = torch.cat([p.detach().flatten() for p in model.parameters()])
    opt = FlatClip(torch.optim.SGD(model.parameters(), lr=1.0), model, noise_multiplier=0.0, max_grad_norm=0.5,
                   expected_batch_size=4.0, loss_reduction="sum")  # fmt: skip
    grads = CompiledPerExampleGradients(opt, lambda out, y: 1e4 * nn.functional.cross_entropy(out, y),
                                        method="capture", compile=False)  # fmt: skip
    x, y = _data("mlp")
    grads(x[:1], y[:1])
    opt.step()
    after = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert float((after - before).norm()) <= 0.5 / 4.0 * (1 + 1e-5)


def test_a_call_whose_rows_are_not_examples_is_refused():
    # wpe(arange(L)): its rows are positions; with L = n taking them for examples would let one
    # example move the sum by more than C, so the region refuses it when it is built
    model = Positions()
    opt = _optimizer(model, "flat", "auto", "sum")
    with pytest.raises(InvalidHyperparameterError, match="wpe.*not computed from the batch"):
        CompiledPerExampleGradients(opt, nn.functional.cross_entropy, method="capture")


class _Untraceable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(12, 4)

    def forward(self, x):
        return self.lin(x) if float(x.sum()) > 0 else -self.lin(x)  # data-dependent branch


class _BareParameter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(12, 4)
        self.shift = nn.Parameter(torch.zeros(4))

    def forward(self, x):
        return self.lin(x) + self.shift


class _Across(nn.Module):
    """Subtracts the batch mean before its layer: each row then depends on every example."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(12, 4)

    def forward(self, x):
        return self.lin(x.mean(0, keepdim=True)).expand(x.shape[0], 4)


@pytest.mark.parametrize(
    "model, match",
    [(_Untraceable(), "torch.fx"), (_BareParameter(), "shift.*outside a module call")],
)
def test_models_the_trace_cannot_follow_are_refused(model, match):
    opt = _optimizer(model, "flat", "auto", "sum")
    with pytest.raises(InvalidHyperparameterError, match=match):
        CompiledPerExampleGradients(opt, nn.functional.cross_entropy, method="capture")


def test_a_captured_tensor_without_the_batch_on_dim_0_is_refused_and_nothing_is_stored():
    torch.manual_seed(3)
    model = _Across()
    opt = _optimizer(model, "flat", "auto", "sum")
    grads = CompiledPerExampleGradients(opt, nn.functional.cross_entropy, method="capture", compile=False)
    x, y = _data("mlp")
    with pytest.raises(InvalidGradientError, match="batch"):
        grads(x, y)
    assert opt.grad_sample_hooks.captures == {}
    assert all(getattr(p, "grad_sample", None) is None for p in model.parameters())


def test_the_method_must_fit_the_optimizer():
    model = _mlp()
    hooked = _optimizer(model, "flat", "auto", "sum")
    with pytest.raises(InvalidHyperparameterError, match="method must be one of"):
        CompiledPerExampleGradients(hooked, nn.functional.cross_entropy, method="ghost")
    with pytest.raises(InvalidHyperparameterError, match="method='capture'"):
        CompiledPerExampleGradients(hooked, nn.functional.cross_entropy)  # vmap with hooks: names the other
    model = _mlp()
    bare = FlatClip(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=1.0, expected_batch_size=N,
                    attach_hooks=False)  # fmt: skip
    with pytest.raises(InvalidHyperparameterError, match="has none"):
        CompiledPerExampleGradients(bare, nn.functional.cross_entropy, method="capture")
