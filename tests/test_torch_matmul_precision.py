"""The library's norm and clipped-sum products run in full float32 whatever the user's matmul precision.

``torch.set_float32_matmul_precision("medium")`` (bfloat16 products; on this kind of CPU oneDNN
really uses them) or TF32 on a GPU would round the inputs of the ghost norms' Gram products and
of the clipped sum ``Σ_i c_i g_i``, so a unit's contribution could exceed the norm bound it was
clipped with (:mod:`adaclip_torch._precision`). Checked here on float32 models, under the
user's ``"medium"``: every matrix product inside ``opt.step()`` sees full precision; the user's
settings are back after ``backward()``, ``step()`` and an exception; and a step is bit for bit
the one taken at ``"highest"``.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from adaclip_torch import FlatClip, _precision
from adaclip_torch.ghost import GhostLayer
from adaclip_torch.kernels import fused_adaclip_step, fused_flat_step

pytestmark = pytest.mark.torch

#: torch functions that are matrix products (by name: functions, Tensor methods and operators)
PRODUCTS = {
    "bmm",
    "baddbmm",
    "matmul",
    "__matmul__",
    "__rmatmul__",
    "mm",
    "addmm",
    "mv",
    "tensordot",
    "einsum",
    "dot",
}
#: where torch ≥ 2.9 keeps the float32 precision of matrix products (cuBLAS, oneDNN)
HOLDERS = {
    "cuda.matmul": lambda: torch.backends.cuda.matmul,
    "mkldnn.matmul": lambda: torch.backends.mkldnn.matmul,
}
NEW_API = bool(_precision._HOLDERS)


def _read(f):
    try:
        return f()
    except RuntimeError:  # torch ≥ 2.9: a legacy flag that the per-backend values do not map onto
        return "unreadable"


def _snapshot() -> dict:
    """Every precision setting the user can observe: the legacy flags and, where they exist, the
    per-backend ones (convolutions' included: the guard must leave them alone)."""
    out = {
        "precision": _read(torch.get_float32_matmul_precision),
        "cuda.allow_tf32": _read(lambda: torch.backends.cuda.matmul.allow_tf32),
        "cudnn.allow_tf32": _read(lambda: torch.backends.cudnn.allow_tf32),
    }
    if NEW_API:
        out.update({name: holder().fp32_precision for name, holder in HOLDERS.items()})
        out["cudnn.conv"] = torch.backends.cudnn.conv.fp32_precision
        out["mkldnn.conv"] = torch.backends.mkldnn.conv.fp32_precision
    return out


def _is_full(s: dict) -> bool:
    """Full IEEE float32 matrix products, with the legacy string agreeing."""
    return (
        s["precision"] == "highest"
        and s["cuda.allow_tf32"] is False
        and all(s[name] in ("ieee", "none") for name in HOLDERS if name in s)
    )


@pytest.fixture
def restore_settings():
    """Put every precision setting back as it was, whatever the test did."""
    legacy = (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32)
    per_backend = {name: holder().fp32_precision for name, holder in HOLDERS.items()} if NEW_API else {}
    generic = torch.backends.fp32_precision if NEW_API else None
    yield
    if NEW_API:
        torch.backends.fp32_precision = generic
    torch.set_float32_matmul_precision(legacy[0])
    torch.backends.cudnn.allow_tf32 = legacy[1]
    for name, value in per_backend.items():
        HOLDERS[name]().fp32_precision = value


@pytest.fixture
def medium(restore_settings):
    torch.set_float32_matmul_precision("medium")
    return _snapshot()


class _RecordProducts(TorchFunctionMode):
    """Records, for every matrix product called while active, its name and the settings in effect."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, dict]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in PRODUCTS or "conv" in name:
            self.seen.append((name, _snapshot()))
        return func(*args, **(kwargs or {}))


# --------------------------------------------------------------------------- models (float32)


class SeqMLP(nn.Module):
    """An MLP applied at 4 positions per example: Gram-form ghost norms, and the ``Eᵀ diag(c) X`` sum."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x))).mean(1)


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 8, 3)
        self.fc = nn.Linear(8 * 6 * 6, 4)

    def forward(self, x):
        return self.fc(torch.tanh(self.conv(x)).flatten(1))


class TiedLM(nn.Module):
    """Tied input/output embeddings: the ghost cross terms between the two uses are products too."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(40, 24)
        self.mid = nn.Linear(24, 24)
        self.out = nn.Linear(24, 40, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, ids):
        return self.out(torch.tanh(self.mid(self.emb(ids)))).mean(1)


def _batch(name, gen):
    n = 64  # large enough products for oneDNN to take its bfloat16 path under "medium"
    if name == "mlp":
        return torch.randn(n, 4, 16, generator=gen), torch.randn(n, 4, generator=gen)
    if name == "conv":
        return torch.randn(n, 2, 8, 8, generator=gen), torch.randn(n, 4, generator=gen)
    return torch.randint(0, 40, (n, 8), generator=gen), torch.randn(n, 40, generator=gen)


MODELS = {"mlp": SeqMLP, "conv": ConvNet, "tied": TiedLM}
# (model, per_sample_mode): the ghost engine on each kind of layer, and the materialised engine's sum
CASES = [("mlp", "ghost"), ("conv", "ghost"), ("tied", "ghost"), ("mlp", "materialise")]


def _setup(name, mode):
    torch.manual_seed(0)
    model = MODELS[name]()
    # a small clip norm: every unit is clipped, so the factors depend on the computed norms
    opt = FlatClip(torch.optim.SGD(model.parameters(), lr=0.5), model, noise_multiplier=0.7, max_grad_norm=0.05,
                   expected_batch_size=64, seed=3, per_sample_mode=mode)  # fmt: skip
    return model, opt


def _backward(model, name):
    x, y = _batch(name, torch.Generator().manual_seed(1))
    ((model(x) - y) ** 2).sum(1).mean().backward()


# --------------------------------------------------------------------------- (a) what the products see


@pytest.mark.parametrize(("name", "mode"), CASES)
def test_library_products_run_in_full_precision(medium, name, mode):
    model, opt = _setup(name, mode)
    _backward(model, name)
    if mode == "ghost":
        assert opt.grad_sample_hooks.captures, "the ghost path was not taken"
    with _RecordProducts() as rec:
        opt.step()
    names = {n for n, _ in rec.seen}
    # the ghost norms' Gram / cross-term products and the clipped sums were seen; no convolution
    # runs in there (the guard leaves the convolution settings alone)
    assert ("bmm" in names) == (mode == "ghost") and names - {"bmm"}, names
    assert not any("conv" in n for n in names), names
    bad = [(n, s) for n, s in rec.seen if not _is_full(s)]
    assert not bad, f"products run at the user's reduced precision: {bad[:3]}"
    assert _snapshot() == medium


@pytest.mark.parametrize(("positions", "width"), [(4, 32), (2, 64)])
def test_clipped_contribution_stays_within_the_radius(medium, positions, width):
    """The privacy property itself, under "medium": each unit, clipped with the factor its ghost
    norm bound gives (radius C), adds to the weighted sum a contribution of norm at most C.
    With the products in bfloat16 (before the guard) contributions reached 1.00058·C (4 positions,
    width 32) and 1.00035·C (2, 64) here."""
    radius = 0.05
    worst = 0.0
    for seed in range(2):
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(16, positions, width, generator=gen)
        e = torch.randn(16, positions, width, generator=gen)
        layer = GhostLayer(nn.Linear(width, width), "linear", [(x, e)], torch.float32, "ghost")
        c = torch.clamp(layer.norm("weight", None, radius).rsqrt(), max=1.0)
        for i in range(16):
            alone = torch.zeros_like(c)
            alone[i] = c[i]
            worst = max(worst, float(layer.weighted_sum("weight", alone).double().norm()) / radius)
    # float32 rounding of the sum itself: far below 1e-5 at this size
    assert worst <= 1.0 + 1e-5, worst


def test_direct_ghost_layer_calls_are_guarded(medium):
    """GhostLayer.norm / weighted_sum called by themselves (not through an engine)."""
    gen = torch.Generator().manual_seed(2)
    x, e = torch.randn(4, 3, 5, generator=gen), torch.randn(4, 3, 6, generator=gen)
    layer = GhostLayer(nn.Linear(5, 6), "linear", [(x, e)], torch.float32, "ghost")
    with _RecordProducts() as rec:
        layer.norm("weight", None, 0.5)
        layer.weighted_sum("weight", torch.rand(4, generator=gen))
    assert {n for n, _ in rec.seen} >= {"bmm"} and all(_is_full(s) for _, s in rec.seen), rec.seen
    assert _snapshot() == medium


# --------------------------------------------------------------------------- (b) the user's settings come back


def test_settings_restored_after_backward_and_step(medium):
    model, opt = _setup("conv", "ghost")
    _backward(model, "conv")
    assert _snapshot() == medium
    opt.step()
    assert _snapshot() == medium


def test_settings_restored_after_an_exception(medium, monkeypatch):
    seen = []

    def failing(self, name, c):
        seen.append(_snapshot())
        raise RuntimeError("boom inside the guarded sum")

    monkeypatch.setattr(GhostLayer, "weighted_sum_within_guard", failing)  # what the engine calls
    model, opt = _setup("mlp", "ghost")
    _backward(model, "mlp")
    with pytest.raises(RuntimeError, match="boom"):
        opt.step()
    assert seen and _is_full(seen[0])
    assert _snapshot() == medium


@pytest.mark.skipif(not NEW_API, reason="per-backend fp32_precision settings appeared in torch 2.9")
def test_per_backend_settings_restored(restore_settings):
    """Set through the per-backend API, in a mix the legacy getters cannot express (they raise):
    the guard must neither read them nor lose the mix."""
    torch.backends.fp32_precision = "tf32"  # the generic parent: every backend inherits it
    torch.backends.cuda.matmul.fp32_precision = "ieee"
    torch.backends.mkldnn.matmul.fp32_precision = "bf16"
    user = _snapshot()
    assert user["precision"] == "unreadable"
    model, opt = _setup("mlp", "ghost")
    _backward(model, "mlp")
    with _RecordProducts() as rec:
        opt.step()
    assert rec.seen and all(_is_full(s) for _, s in rec.seen), rec.seen[:3]
    assert _snapshot() == user


@pytest.mark.skipif(not NEW_API, reason="per-backend fp32_precision settings appeared in torch 2.9")
def test_inherited_settings_still_inherit(restore_settings):
    """A holder that inherited its precision from the generic setting before the step inherits it
    after: the user's later change of the generic setting still reaches it."""
    torch.backends.fp32_precision = "tf32"
    assert all(holder().fp32_precision == "tf32" for holder in HOLDERS.values())
    with _precision.full_float32_precision():
        assert all(holder().fp32_precision == "ieee" for holder in HOLDERS.values())
    torch.backends.fp32_precision = "ieee"
    assert all(holder().fp32_precision == "ieee" for holder in HOLDERS.values())


def test_nested_and_concurrent_uses_restore_once(medium):
    guard = _precision.full_float32_precision
    with guard():
        with guard():
            assert _is_full(_snapshot())
        assert _is_full(_snapshot())  # the inner exit leaves the outer's precision in place
        with pytest.raises(ValueError):
            with guard():
                raise ValueError
        assert _is_full(_snapshot())
    assert _snapshot() == medium
    # two threads whose guarded regions overlap: the user's values come back after the last one
    inside, release = threading.Barrier(2), threading.Event()
    seen = []

    def worker():
        with guard():
            inside.wait()
            release.wait()
            seen.append(_snapshot())

    t = threading.Thread(target=worker)
    t.start()
    with guard():
        inside.wait()
    seen.append(_snapshot())  # the other thread is still inside
    release.set()
    t.join()
    assert len(seen) == 2 and all(_is_full(x) for x in seen)
    assert _snapshot() == medium


# --------------------------------------------------------------------------- (c) the same step, bit for bit


def test_default_settings_are_not_written(restore_settings, monkeypatch):
    """Under torch's defaults the products are IEEE already: a step writes no setting at all, so
    its results are those of the code without the guard, bit for bit."""
    writes = []
    monkeypatch.setattr(torch, "set_float32_matmul_precision", lambda *a: writes.append(("legacy", a)))
    if NEW_API:
        monkeypatch.setattr(
            torch._C, "_set_fp32_precision_setter", lambda *a: writes.append(("per-backend", a))
        )
    model, opt = _setup("tied", "ghost")
    _backward(model, "tied")
    opt.step()
    assert writes == []


def _step_result(name, mode, precision):
    model, opt = _setup(name, mode)
    _backward(model, name)  # the user's forward and backward at "highest" in both runs
    torch.set_float32_matmul_precision(precision)
    try:
        opt.step()
    finally:
        torch.set_float32_matmul_precision("highest")
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize(("name", "mode"), CASES)
def test_step_under_medium_equals_highest(restore_settings, name, mode):
    want = _step_result(name, mode, "highest")
    got = _step_result(name, mode, "medium")
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_reference_release_under_medium_equals_highest(restore_settings):
    """The torch reference of the fused steps (``use_kernel=False``) sums with ``c @ g``."""
    gen = torch.Generator().manual_seed(5)
    g = torch.randn(16, 300, generator=gen)
    z = torch.randn(300, generator=gen)
    mean, std = torch.randn(300, generator=gen) * 0.1, torch.rand(300, generator=gen) + 0.5
    out = {}
    for precision in ("highest", "medium"):
        torch.set_float32_matmul_precision(precision)
        out[precision] = [
            fused_flat_step(g, max_grad_norm=0.1, noise_multiplier=0.5, expected_batch_size=16, noise=z,
                            use_kernel=False),
            *fused_adaclip_step(g, mean, std, noise_multiplier=0.5, expected_batch_size=16, std_min=1e-3,
                                std_max=2.0, noise=z, use_kernel=False),
        ]  # fmt: skip
    assert all(torch.equal(a, b) for a, b in zip(out["medium"], out["highest"], strict=True))
