"""The defaults decided by the round-two utility benchmark: AdaCliP's presets (core, PyTorch,
JAX) and make_private's default strategy."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import adaclip.strategies as S
from adaclip.errors import InvalidHyperparameterError

ROOT = Path(__file__).resolve().parents[1]


def test_default_preset_is_the_benchmarked_ada_tensor_configuration():
    """The default is exactly the configuration the benchmark ran as ``ada-tensor`` at C = 1."""
    sys.path.insert(0, str(ROOT / "benchmarks" / "utility"))
    round2 = pytest.importorskip("round2")
    for d in (31, 2_410, 15_210):
        assert S.adaptive_clipping(d) == round2.strategy_for("ada-tensor", 1.0, d)
        assert S.adaptive_clipping(d, max_grad_norm=0.3) == round2.strategy_for("ada-tensor", 0.3, d)
        assert S.adaptive_clipping(d, initial_max_grad_norm=0.3) == round2.strategy_for("ada-tensor", 0.3, d)


def test_patent_preset_is_the_patent_one_keyword_away():
    assert S.adaptive_clipping(100, preset="patent") == S.AdaptiveClipping()
    assert S.adaptive_clipping(100, preset="patent", initial_max_grad_norm=0.5) == S.AdaptiveClipping.from_initial_clip(
        0.5, 100
    )
    # the patent preset with options is the class with those options (as before the presets)
    assert S.adaptive_clipping(100, preset="patent", scale="separated", max_grad_norm=0.5) == S.AdaptiveClipping(
        scale="separated", max_grad_norm=0.5
    )


def test_explicit_keywords_override_the_preset():
    s = S.adaptive_clipping(100, pooling="factored", beta_std=0.99, freeze_statistics=True)
    assert (s.pooling, s.beta_std, s.freeze_statistics, s.scale, s.max_grad_norm) == ("factored", 0.99, True, "separated", 1.0)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(preset="bogus"), "preset must be one of"),
        (dict(preset=None), "preset must be one of"),
        (dict(scale="coupled"), "preset='patent'"),
        (dict(preset="patent", max_grad_norm=1.0), "initial_max_grad_norm=C0"),
        (dict(initial_max_grad_norm=1.0, max_grad_norm=1.0), "not both"),
        (dict(max_grad_norm=-1.0), "max_grad_norm"),
    ],
)
def test_bad_presets_and_combinations_are_refused(kwargs, words):
    with pytest.raises(InvalidHyperparameterError, match=words):
        S.adaptive_clipping(10, **kwargs)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))


def _steps(opt, model, n_steps=2):
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n_steps):
        x = torch.randn(8, 5, generator=gen)
        y = torch.randint(0, 3, (8,), generator=gen)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        out.append([p.detach().clone() for p in model.parameters()])
    return out


def test_adaclip_default_first_step_is_flat_clipping_then_the_centre_moves():
    from adaclip_torch import AdaClip, FlatClip

    results = {}
    for name, cls, kw in (("adaclip", AdaClip, {}), ("flat", FlatClip, {"max_grad_norm": 1.0})):
        model = _model()
        opt = cls(torch.optim.SGD(model.parameters(), lr=0.5), model, noise_multiplier=1.0, expected_batch_size=8.0,
                  seed=3, **kw)  # fmt: skip
        if name == "adaclip":
            assert opt.strategy == S.adaptive_clipping(sum(p.numel() for p in model.parameters()))
        results[name] = _steps(opt, model)
        opt.remove_hooks()
    for a, b in zip(results["adaclip"][0], results["flat"][0]):
        torch.testing.assert_close(a, b)  # same noise, b = C, centre 0: the same release
    assert any(not torch.allclose(a, b) for a, b in zip(results["adaclip"][1], results["flat"][1]))


def test_adaclip_bad_preset_leaves_the_optimizer_alone():
    from adaclip_torch import AdaClip

    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.5)
    with pytest.raises(InvalidHyperparameterError, match="preset"):
        AdaClip(inner, model, noise_multiplier=1.0, expected_batch_size=8.0, preset="paper")
    assert not any(hasattr(p, "grad_sample") for p in model.parameters())
    assert inner.state == {} and len(inner.param_groups) == 1


def test_jax_adaclip_default_builds_the_same_strategy():
    pytest.importorskip("jax")
    import jax.numpy as jnp

    import adaclip_jax

    params = {"w": jnp.zeros((4, 5)), "b": jnp.zeros(4)}
    tx = adaclip_jax.adaclip(noise_multiplier=1.0, expected_batch_size=8.0, key=0)
    tx.init(params)
    assert tx.strategy == S.adaptive_clipping(24)
    patent = adaclip_jax.adaclip(noise_multiplier=1.0, expected_batch_size=8.0, key=0, preset="patent")
    patent.init(params)
    assert patent.strategy == S.AdaptiveClipping()
