"""The compiled per-example gradient region (``adaclip_torch.compiled``): the same private steps
as the grad-sample hooks (bit for bit eagerly, within float rounding compiled), one graph, each
example's contribution still clipped, and clear refusals that change nothing."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from adaclip.errors import InvalidHyperparameterError  # noqa: E402
from adaclip_torch import AdaClip, FlatClip  # noqa: E402
from adaclip_torch.compiled import CompiledPerExampleGradients  # noqa: E402

N = 24


def _mlp():
    return nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 4))


def _cnn():
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.GroupNorm(2, 4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 4))


def _data(kind):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 12, generator=g) if kind == "mlp" else torch.randn(N, 1, 8, 8, generator=g)
    return 3 * x, torch.randint(0, 4, (N,), generator=g)


def _train(kind, *, region, compile=False, steps=3):
    torch.manual_seed(1)
    model = _mlp() if kind == "mlp" else _cnn()
    # the hooks' loss is summed: a mean's 1/n, undone on the per-example gradients, would round
    opt = AdaClip(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=0.7, seed=5,
                  expected_batch_size=N, attach_hooks=not region, per_sample_mode="materialise",
                  loss_reduction="sum")  # fmt: skip
    grads = CompiledPerExampleGradients(opt, nn.functional.cross_entropy, compile=compile) if region else None
    x, y = _data(kind)
    for _ in range(steps):
        opt.zero_grad()
        if region:
            grads(x, y)
        else:
            nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()], grads


def test_the_eager_region_takes_the_hooks_steps_bit_for_bit_on_an_mlp():
    hooks, _ = _train("mlp", region=False)
    region, _ = _train("mlp", region=True)
    assert all(torch.equal(a, b) for a, b in zip(hooks, region))


def test_the_eager_region_takes_the_hooks_steps_within_rounding_on_a_cnn():
    # the hooks unfold the convolution's patches, torch.func runs its backward: other sum orders
    hooks, _ = _train("cnn", region=False)
    region, _ = _train("cnn", region=True)
    assert all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(hooks, region))
    assert not all(torch.equal(a, b) for a, b in zip(hooks, region))  # (so the tolerance is needed)


def test_the_compiled_region_takes_the_same_steps_within_rounding_in_one_graph():
    hooks, _ = _train("mlp", region=False)
    compiled, grads = _train("mlp", region=True, compile=True)
    assert all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(hooks, compiled))
    assert grads.graph_breaks(*_data("mlp")) == []


def test_each_example_is_still_clipped():
    # σ = 0, plain SGD at lr = 1: the step is −(clipped sum)/B̄, so one example of a huge loss
    # moves the parameters by at most C/B̄ in norm, however large its gradient
    torch.manual_seed(2)
    model = _mlp()
    before = torch.cat([p.detach().flatten() for p in model.parameters()])
    opt = FlatClip(torch.optim.SGD(model.parameters(), lr=1.0), model, noise_multiplier=0.0, max_grad_norm=0.5,
                   expected_batch_size=4.0, attach_hooks=False)  # fmt: skip
    grads = CompiledPerExampleGradients(opt, lambda out, y: 1e4 * nn.functional.cross_entropy(out, y), compile=False)
    x, y = _data("mlp")
    grads(x[:1], y[:1])
    assert grads.optimizer.params[0].grad_sample.flatten(1).norm() > 100  # a huge gradient ...
    opt.step()
    after = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert float((after - before).norm()) <= 0.5 / 4.0 * (1 + 1e-5)  # ... moves it by at most C/B̄


def test_dropout_draws_a_mask_per_example():
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(12, 16), nn.Dropout(0.5), nn.Linear(16, 4))
    opt = FlatClip(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=0.0,
                   expected_batch_size=N, attach_hooks=False)  # fmt: skip
    grads = CompiledPerExampleGradients(opt, nn.functional.cross_entropy, compile=False)
    x, _ = _data("mlp")
    x = x[:1].expand(N, 12)  # the same example N times: only the masks differ
    grads(x, torch.zeros(N, dtype=torch.long))
    first = opt.params[0].grad_sample
    assert not torch.equal(first[0], first[1])


def test_refusals_name_the_fix_and_change_nothing():
    torch.manual_seed(4)
    model = _mlp()
    hooked = FlatClip(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=1.0, expected_batch_size=N)
    with pytest.raises(InvalidHyperparameterError, match="attach_hooks=False"):
        CompiledPerExampleGradients(hooked, nn.functional.cross_entropy)
    with pytest.raises(InvalidHyperparameterError, match="DPOptimizer"):
        CompiledPerExampleGradients(torch.optim.SGD(model.parameters(), lr=0.1), nn.functional.cross_entropy)
    model = _mlp()
    opt = FlatClip(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=1.0, expected_batch_size=N,
                   attach_hooks=False)  # fmt: skip
    with pytest.raises(InvalidHyperparameterError, match="callable"):
        CompiledPerExampleGradients(opt, "cross_entropy")
    with pytest.raises(InvalidHyperparameterError, match="pad_to_multiple"):
        CompiledPerExampleGradients(opt, nn.functional.cross_entropy, pad_to_multiple=0)
    grads = CompiledPerExampleGradients(opt, nn.functional.cross_entropy, compile=False)
    x, y = _data("mlp")
    with pytest.raises(InvalidHyperparameterError, match="empty_batch=True"):
        grads(x[:0], y[:0])
    assert all(getattr(p, "grad_sample", None) is None for p in model.parameters())
