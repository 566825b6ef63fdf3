"""Ghost norms (adaclip_torch.ghost, DPOptimizer(per_sample_mode=...)) against the plain path.

Every check compares the ghost path with the materialised per-example gradients on the same
inputs (and, for optimizer steps, the same seeded noise): norms and clipped sums to 1e-10 in
float64, whole training runs step by step (parameters and AdaCliP state).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from adaclip import transform
from adaclip.errors import InvalidGradientError, InvalidHyperparameterError
from adaclip_torch import AdaClip, FlatClip, PerLayerClip, ScaledClip
from adaclip_torch.ghost import GhostLayer, ghost_modules
from adaclip_torch.grad_sample import ghost_layer
from adaclip_torch.layers import DPLSTM

DT = torch.float64
SETTINGS = settings(max_examples=25, deadline=None, derandomize=True)


def _centre_scale(shape, kind, gen):
    """(centre, scale) as the strategies give them: AdaCliP tensors or a flat float."""
    if kind == "flat":
        return None, 0.7
    centre = torch.randn(shape, generator=gen, dtype=DT) * 0.3
    scale = torch.rand(shape, generator=gen, dtype=DT) + 0.2
    return centre, scale


def _check_layer(layer: GhostLayer, name: str, reference: torch.Tensor, kind: str, gen) -> None:
    centre, scale = _centre_scale(reference.shape[1:], kind, gen)
    want = transform.transformed_sq_norms([reference], None if centre is None else [centre], [scale])[0]
    got = layer.norm(name, centre, scale)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    c = torch.rand(reference.shape[0], generator=gen, dtype=DT)
    torch.testing.assert_close(layer.weighted_sum(name, c), torch.tensordot(c, reference, dims=1), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(layer.materialise(name), reference, rtol=1e-12, atol=1e-12)


@SETTINGS
@given(
    n=st.integers(0, 8),
    fin=st.integers(1, 16),
    fout=st.integers(1, 16),
    seq=st.one_of(st.none(), st.integers(1, 6)),
    calls=st.integers(1, 2),
    mode=st.sampled_from(["ghost", "auto"]),
    kind=st.sampled_from(["flat", "adaclip"]),
    seed=st.integers(0, 2**16),
)
def test_linear_norms_and_sums_match_materialised(n, fin, fout, seq, calls, mode, kind, seed):
    gen = torch.Generator().manual_seed(seed)
    lin = nn.Linear(fin, fout).to(DT)
    shape = (n, fin) if seq is None else (n, seq, fin)
    caps = [
        (torch.randn(shape, generator=gen, dtype=DT), torch.randn((*shape[:-1], fout), generator=gen, dtype=DT))
        for _ in range(calls)
    ]
    layer = GhostLayer(lin, "linear", caps, DT, mode)
    ref_w = sum(torch.einsum("n...o,n...k->nok", e, x) for x, e in caps)
    ref_b = sum(e.reshape(n, -1 if n else 1, fout).sum(1) for _, e in caps)
    _check_layer(layer, "weight", ref_w, kind, gen)
    _check_layer(layer, "bias", ref_b, kind, gen)


def test_linear_transient_chunks(monkeypatch):
    """AdaCliP on a sequence layer forms per-example gradients a chunk at a time."""
    monkeypatch.setattr(ghost_layer, "CHUNK_ELEMENTS", 12)
    gen = torch.Generator().manual_seed(0)
    lin = nn.Linear(3, 4).to(DT)
    x, e = torch.randn(5, 6, 3, generator=gen, dtype=DT), torch.randn(5, 6, 4, generator=gen, dtype=DT)
    layer = GhostLayer(lin, "linear", [(x, e)], DT, "auto")
    _check_layer(layer, "weight", torch.einsum("nto,ntk->nok", e, x), "adaclip", gen)


@SETTINGS
@given(
    n=st.integers(0, 8),
    vocab=st.integers(1, 16),
    dim=st.integers(1, 8),
    seq=st.one_of(st.none(), st.integers(1, 6)),
    padding=st.booleans(),
    kind=st.sampled_from(["flat", "adaclip"]),
    seed=st.integers(0, 2**16),
)
def test_embedding_norms_and_sums_match_materialised(n, vocab, dim, seq, padding, kind, seed):
    gen = torch.Generator().manual_seed(seed)
    emb = nn.Embedding(vocab, dim, padding_idx=0 if padding else None).to(DT)
    shape = (n,) if seq is None else (n, seq)
    ids = torch.randint(0, vocab, shape, generator=gen)
    e = torch.randn((*shape, dim), generator=gen, dtype=DT)
    layer = GhostLayer(emb, "embedding", [(ids, e)], DT, "ghost")
    ref = torch.zeros(n, vocab, dim, dtype=DT)
    flat_ids, flat_e = ids.reshape(n, ids[0].numel() if n else 1), e.reshape(n, ids[0].numel() if n else 1, dim)
    for i in range(n):
        for t in range(flat_ids.shape[1]):
            if not padding or flat_ids[i, t] != 0:
                ref[i, flat_ids[i, t]] += flat_e[i, t]
    _check_layer(layer, "weight", ref, kind, gen)


@SETTINGS
@given(
    n=st.integers(0, 6),
    spatial=st.sampled_from([1, 2]),
    cin=st.integers(1, 3),
    cout=st.integers(1, 4),
    kernel=st.integers(1, 3),
    stride=st.integers(1, 2),
    dilation=st.integers(1, 2),
    padding=st.integers(0, 2),
    padding_mode=st.sampled_from(["zeros", "reflect", "circular"]),
    calls=st.integers(1, 2),
    mode=st.sampled_from(["ghost", "auto"]),
    kind=st.sampled_from(["flat", "adaclip"]),
    seed=st.integers(0, 2**16),
)
def test_conv_norms_and_sums_match_materialised(n, spatial, cin, cout, kernel, stride, dilation, padding,
                                                padding_mode, calls, mode, kind, seed):
    """Conv1d/Conv2d on unfolded patches (any padding mode, stride, dilation, several calls)
    against the per-sample rule's gradients."""
    from adaclip_torch.grad_sample.conv import conv1d_grad_sample, conv2d_grad_sample

    gen = torch.Generator().manual_seed(seed)
    size = 7
    if padding_mode != "zeros" and padding >= size:
        padding = 0
    cls, rule = (nn.Conv1d, conv1d_grad_sample) if spatial == 1 else (nn.Conv2d, conv2d_grad_sample)
    conv = cls(cin, cout, kernel, stride=stride, dilation=dilation, padding=padding, padding_mode=padding_mode).to(DT)
    caps = []
    for _ in range(calls):
        x = torch.randn((n, cin) + (size,) * spatial, generator=gen, dtype=DT)
        out_shape = conv(x).shape if n else conv(torch.zeros((1, cin) + (size,) * spatial, dtype=DT)).shape[1:]
        e = torch.randn(((n,) + tuple(out_shape[1:])) if n else (0, *out_shape), generator=gen, dtype=DT)
        caps.append((x, e))
    assert ghost_modules(nn.Sequential(conv), list(conv.parameters()), convolutions=True) == {conv: "conv"}
    assert ghost_modules(nn.Sequential(conv), list(conv.parameters())) == {}  # "auto" materialises convs
    layer = GhostLayer(conv, "conv", caps, DT, mode)
    ref = [rule(conv, (x,), e) for x, e in caps]
    _check_layer(layer, "weight", sum(r["weight"] for r in ref), kind, gen)
    _check_layer(layer, "bias", sum(r["bias"] for r in ref), kind, gen)


def test_grouped_and_subclassed_convs_are_not_ghost():
    grouped = nn.Conv2d(4, 4, 3, groups=2)

    class Custom(nn.Conv1d):
        def forward(self, x):
            return super().forward(x) * 2

    custom = Custom(2, 3, 3)
    model = nn.ModuleList([grouped, custom])
    assert ghost_modules(model, list(model.parameters()), convolutions=True) == {}


def test_float32_precision_with_realistic_magnitudes():
    """The expansion subtracts nearly equal terms: float32 ghost norms stay within 1e-4 (relative)
    of float64 when the centre is close to the gradients (AdaCliP's mean after training)."""
    gen = torch.Generator().manual_seed(1)
    n, fin, fout = 64, 100, 50
    x = torch.randn(n, fin, generator=gen, dtype=DT)
    e = torch.randn(n, fout, generator=gen, dtype=DT) * 1e-2
    g = torch.einsum("no,nk->nok", e, x)
    centre = g.mean(0) + 1e-4 * torch.randn(fout, fin, generator=gen, dtype=DT)
    scale = (torch.rand(fout, fin, generator=gen, dtype=DT) * 0.05 + 0.01) * 30.0
    want = transform.transformed_sq_norms([g], [centre], [scale])[0]
    f32 = torch.float32
    layer = GhostLayer(nn.Linear(fin, fout), "linear", [(x.to(f32), e.to(f32))], f32, "ghost")
    got = layer.norm("weight", centre.to(f32), scale.to(f32)).to(DT)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6 * float(want.max()))
    plain32 = transform.transformed_sq_norms([g.to(f32)], [centre.to(f32)], [scale.to(f32)])[0].to(DT)
    # no worse than a few times the plain float32 path's own error
    assert float((got - want).abs().max()) <= 20 * float((plain32 - want).abs().max()) + 1e-6 * float(want.max())


# --------------------------------------------------------------------------- optimizer steps


class Mixed(nn.Module):
    """Linear + Conv2d + LayerNorm (+ GroupNorm): ghost and materialised layers together."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 3, 3)
        self.norm = nn.LayerNorm(12)
        self.fc1 = nn.Linear(12, 6)
        self.fc2 = nn.Linear(6, 2, bias=False)

    def forward(self, x):
        h = torch.tanh(self.conv(x)).flatten(2).mean(2)  # (n, 3)
        h = self.norm(h.repeat(1, 4))
        return self.fc2(torch.relu(self.fc1(h)))


class CNN(nn.Module):
    """Two Conv1d layers (stride, reflect padding, dilation) → Linear: the conv ghost rule in a run."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv1d(2, 4, 3, stride=2, padding=1, padding_mode="reflect")
        self.c2 = nn.Conv1d(4, 3, 3, dilation=2, padding=2)
        self.fc = nn.Linear(3 * 5, 2)

    def forward(self, x):
        return self.fc(torch.tanh(self.c2(torch.relu(self.c1(x)))).flatten(1))


class SeqModel(nn.Module):
    """Embedding (with padding) → Linear over a sequence → Linear on the mean."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(13, 5, padding_idx=1)
        self.fc1 = nn.Linear(5, 4)
        self.fc2 = nn.Linear(4, 3)

    def forward(self, ids):
        return self.fc2(torch.tanh(self.fc1(self.emb(ids))).mean(1))


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(9, 4)
        self.mid = nn.Linear(4, 4)
        self.out = nn.Linear(4, 9, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, ids):
        return self.out(torch.tanh(self.mid(self.emb(ids)))).mean(1)


class LSTMModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.lstm = DPLSTM(4, 5, batch_first=True)
        self.fc = nn.Linear(5, 10)

    def forward(self, ids):
        h, _ = self.lstm(self.emb(ids))
        return self.fc(h[:, -1])


def _data(name, n, gen):
    if name == "mixed":
        return torch.randn(n, 1, 6, 6, generator=gen, dtype=DT), torch.randn(n, 2, generator=gen, dtype=DT)
    if name == "cnn":
        return torch.randn(n, 2, 10, generator=gen, dtype=DT), torch.randn(n, 2, generator=gen, dtype=DT)
    if name == "seq":
        return torch.randint(0, 13, (n, 4), generator=gen), torch.randn(n, 3, generator=gen, dtype=DT)
    if name == "tied":
        return torch.randint(0, 9, (n, 3), generator=gen), torch.randn(n, 9, generator=gen, dtype=DT)
    return torch.randint(0, 10, (n, 3), generator=gen), torch.randn(n, 10, generator=gen, dtype=DT)


MODELS = {"mixed": Mixed, "cnn": CNN, "seq": SeqModel, "tied": Tied, "lstm": LSTMModel}


def _strategy(name, model):
    k = sum(1 for p in model.parameters() if p.requires_grad)
    return {
        "adaclip": (AdaClip, dict(std_min=1e-3, std_max=1.0)),
        "flat": (FlatClip, dict(max_grad_norm=0.3)),
        "per_layer": (PerLayerClip, dict(max_grad_norm=0.3)),
        "scaled": (ScaledClip, dict(max_grad_norm=0.3, layer_scales=[1.0 + 0.25 * j for j in range(k)])),
    }[name]


def _train(model_name, strategy, mode, batches, *, steps=3, seed=0, **extra):
    torch.manual_seed(seed)
    model = MODELS[model_name]().to(DT)
    cls, kw = _strategy(strategy, model)
    opt = cls(
        torch.optim.SGD(model.parameters(), lr=0.5),
        model,
        noise_multiplier=0.8,
        expected_batch_size=5.0,
        seed=7,
        per_sample_mode=mode,
        **kw,
        **extra,
    )
    history = []
    for x, y in batches[:steps]:
        loss = ((model(x) - y) ** 2).sum(1).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        state = opt.clip_state
        history.append(
            [p.detach().clone() for p in model.parameters()]
            + ([] if state.mean is None else [t.clone() for t in state.mean + state.std])
        )
    return model, opt, history


def _assert_same(h1, h2, tol=1e-10):
    assert len(h1) == len(h2)
    for a, b in zip(h1, h2):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, rtol=tol, atol=tol)


@pytest.mark.parametrize("model_name", ["mixed", "cnn", "seq", "tied", "lstm"])
@pytest.mark.parametrize("strategy", ["adaclip", "flat", "per_layer", "scaled"])
@pytest.mark.parametrize("mode", ["ghost", "auto"])
def test_optimizer_steps_match_materialised(model_name, strategy, mode):
    gen = torch.Generator().manual_seed(3)
    batches = [_data(model_name, n, gen) for n in (5, 3, 6)]
    _, _, want = _train(model_name, strategy, "materialise", batches)
    _, _, got = _train(model_name, strategy, mode, batches)
    _assert_same(got, want)


def test_ghost_layers_store_no_per_example_gradients():
    torch.manual_seed(0)
    model = Mixed().to(DT)
    opt = AdaClip(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=1.0,
                  expected_batch_size=4, seed=0, per_sample_mode="ghost", preset="patent")
    x, y = _data("mixed", 4, torch.Generator().manual_seed(0))
    ((model(x) - y) ** 2).sum().backward()
    for p in (model.fc1.weight, model.fc1.bias, model.fc2.weight, model.conv.weight, model.conv.bias):
        assert getattr(p, "grad_sample", None) is None
    assert model.norm.weight.grad_sample.shape == (4, *model.norm.weight.shape)
    assert set(opt.grad_sample_hooks.captures) == {model.fc1, model.fc2, model.conv}
    opt.step()
    assert opt.grad_sample_hooks.captures == {}


def test_auto_mode_keeps_convolutions_materialised():
    torch.manual_seed(0)
    model = Mixed().to(DT)
    opt = FlatClip(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=1.0, max_grad_norm=1.0,
                   expected_batch_size=4, seed=0, per_sample_mode="auto")
    x, y = _data("mixed", 4, torch.Generator().manual_seed(0))
    ((model(x) - y) ** 2).sum().backward()
    assert model.conv.weight.grad_sample.shape == (4, *model.conv.weight.shape)
    assert set(opt.grad_sample_hooks.captures) == {model.fc1, model.fc2}


def test_tied_weights_are_not_ghost():
    model = Tied()
    found = ghost_modules(model, list(model.parameters()))
    assert set(found) == {model.mid}


def test_frozen_or_foreign_parameters_are_not_ghost():
    model = SeqModel()
    model.fc1.bias.requires_grad_(False)
    params = [p for n, p in model.named_parameters() if not n.startswith("fc2")]
    found = ghost_modules(model, params)
    assert set(found) == {model.emb, model.fc1}  # fc2's parameters are not in the optimizer


def test_empty_batch_matches_materialised():
    gen = torch.Generator().manual_seed(4)
    batches = [_data("seq", n, gen) for n in (0, 4, 0)]
    for strategy in ("adaclip", "flat"):
        _, _, want = _train("seq", strategy, "materialise", batches)
        _, _, got = _train("seq", strategy, "ghost", batches)
        _assert_same(got, want)


def test_user_ids_and_virtual_steps_match_materialised():
    gen = torch.Generator().manual_seed(5)
    batches = [_data("seq", 6, gen) for _ in range(4)]
    users = torch.tensor([3, 1, 3, 2, 1, 0])
    results = {}
    for mode in ("materialise", "ghost"):
        torch.manual_seed(0)
        model = SeqModel().to(DT)
        opt = AdaClip(torch.optim.SGD(model.parameters(), lr=0.5), model, noise_multiplier=0.8,
                      expected_batch_size=5, seed=1, per_sample_mode=mode, std_min=1e-3, preset="patent")
        out = []
        for j, (x, y) in enumerate(batches):
            ((model(x) - y) ** 2).sum(1).mean().backward()
            if j == 0:
                opt.step(user_ids=users)
            elif j == 1:
                opt.accumulate()  # accumulate() clears what the next backward needs cleared
            else:
                opt.step()
            if j != 1:
                opt.zero_grad()  # never between accumulate() and step(): it drops the pending sum
            out.append([p.detach().clone() for p in model.parameters()] + list(opt.clip_state.mean))
        results[mode] = out
    _assert_same(results["ghost"], results["materialise"])


@pytest.mark.parametrize("mode", ["materialise", "ghost"])
def test_second_backward_pass_before_step_is_refused(mode):
    """Two backward passes before step() would add example i of each pass into one unit: refused
    from the second backward, on the ghost path as on the materialised one, and the first pass's
    release is unchanged by the refused attempt."""
    gen = torch.Generator().manual_seed(6)
    x, y = _data("seq", 4, gen)
    released = []
    for second in (False, True):
        torch.manual_seed(0)
        model = SeqModel().to(DT)
        opt = FlatClip(torch.optim.SGD(model.parameters(), lr=0.5), model, noise_multiplier=0.5,
                       expected_batch_size=4, seed=1, per_sample_mode=mode, max_grad_norm=0.2)
        ((model(x) - y) ** 2).sum(1).mean().backward()
        if second:
            with pytest.raises(InvalidGradientError, match="second backward pass"):
                (model(x) ** 2).sum(1).mean().backward()
        opt.step()
        released.append([p.detach().clone() for p in model.parameters()])
    _assert_same(released[1], released[0])


def test_non_finite_backprop_raises_in_debug_mode_and_changes_nothing():
    torch.manual_seed(0)
    model = SeqModel().to(DT)
    opt = AdaClip(torch.optim.SGD(model.parameters(), lr=0.5), model, noise_multiplier=0.8,
                  expected_batch_size=4, seed=1, per_sample_mode="ghost", nonfinite="raise", preset="patent")
    before = [p.detach().clone() for p in model.parameters()]
    x, _ = _data("seq", 4, torch.Generator().manual_seed(0))
    (model(x).sum() * float("inf")).backward()
    with pytest.raises(InvalidGradientError, match="nonfinite='raise'"):
        opt.step()
    assert opt.steps == 0
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p.detach(), b)


def test_bad_mode_rejected():
    model = SeqModel()
    with pytest.raises(InvalidHyperparameterError, match="per_sample_mode"):
        FlatClip(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=1.0,
                 expected_batch_size=4, max_grad_norm=1.0, per_sample_mode="fast")


def test_float32_training_matches_materialised_float32():
    """A float32 model: ghost and materialised runs stay within float32 rounding of each other
    (the noise is drawn in the statistics dtype, so both use float32 here)."""
    gen = torch.Generator().manual_seed(8)
    batches = [tuple(t.float() if t.is_floating_point() else t for t in _data("mixed", 8, gen)) for _ in range(3)]
    runs = {}
    for mode in ("materialise", "ghost"):
        torch.manual_seed(0)
        model = Mixed()
        opt = AdaClip(torch.optim.SGD(model.parameters(), lr=0.5), model, noise_multiplier=0.8,
                      expected_batch_size=5.0, seed=7, per_sample_mode=mode, std_min=1e-3, preset="patent")
        out = []
        for x, y in batches:
            ((model(x) - y) ** 2).sum(1).mean().backward()
            opt.step()
            opt.zero_grad()
            out.append([p.detach().clone() for p in model.parameters()] + list(opt.clip_state.std))
        runs[mode] = out
    for a, b in zip(runs["ghost"], runs["materialise"]):
        for x, y in zip(a, b):
            assert x.dtype == torch.float32
            torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)


@SETTINGS
@given(
    n=st.integers(0, 9),
    shape=st.lists(st.integers(1, 5), min_size=0, max_size=3),
    centred=st.booleans(),
    chunk=st.integers(1, 40),
    seed=st.integers(0, 2**16),
)
def test_chunked_plain_norms_equal_core(n, shape, centred, chunk, seed):
    """The plain path's chunked, in-place norms are the core's transformed_sq_norms."""
    import adaclip_torch.engines.materialise as opt_mod

    gen = torch.Generator().manual_seed(seed)
    g = torch.randn((n, *shape), generator=gen, dtype=DT)
    centre = torch.randn(shape, generator=gen, dtype=DT) if centred else None
    scale = torch.rand(shape, generator=gen, dtype=DT) + 0.1 if centred else 0.3
    old = opt_mod._NORM_CHUNK_ELEMENTS
    opt_mod._NORM_CHUNK_ELEMENTS = chunk
    try:
        got = opt_mod._chunked_sq_norms(g, centre, scale)
    finally:
        opt_mod._NORM_CHUNK_ELEMENTS = old
    want = transform.transformed_sq_norms([g], None if centre is None else [centre], [scale])[0]
    torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-13)


def test_plain_step_equals_private_step_on_materialised_grads():
    """materialise mode: one DPOptimizer step == adaclip.strategies.private_step on p.grad_sample
    with the same noise draws."""
    from adaclip import strategies
    from adaclip_torch.noise import NoiseSource

    torch.manual_seed(0)
    model = Mixed().to(DT)
    opt = AdaClip(torch.optim.SGD(model.parameters(), lr=1.0), model, noise_multiplier=0.8,
                  expected_batch_size=5.0, seed=11, std_min=1e-3, preset="patent", per_sample_mode="materialise")
    x, y = _data("mixed", 6, torch.Generator().manual_seed(2))
    ((model(x) - y) ** 2).sum(1).mean().backward()
    grads = [p.grad_sample.clone() for p in model.parameters()]
    before = [p.detach().clone() for p in model.parameters()]
    noise = NoiseSource(seed=11).standard_normal(before)
    want, _ = strategies.private_step(opt.strategy, opt.clip_state, grads, noise, noise_multiplier=0.8,
                                      expected_batch_size=5.0)
    opt.step()
    for p, b, g in zip(model.parameters(), before, want):
        torch.testing.assert_close(b - p.detach(), g, rtol=1e-12, atol=1e-12)
