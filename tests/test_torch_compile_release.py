"""``compile_release=True``: the release under ``torch.compile`` computes the eager release.

Same seed, same batches: the parameters, the clipping state and the step counter after a few
steps agree with the eager path up to float rounding, and the option is validated."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from adaclip.errors import InvalidHyperparameterError
from adaclip_torch import AdaClip, FlatClip, QuantileClip


def _run(cls, compile_release: bool, steps: int = 3, **kw):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = cls(torch.optim.SGD(model.parameters(), lr=0.5), model, noise_multiplier=0.7, expected_batch_size=16.0,
              seed=5, compile_release=compile_release, **kw)  # fmt: skip
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach() for p in model.parameters()], opt.clip_state, opt.steps


def _agree(cls, **kw):
    eager_params, eager_state, eager_steps = _run(cls, False, **kw)
    params, state, steps = _run(cls, True, **kw)
    assert steps == eager_steps == 3
    for a, b in zip(params, eager_params, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for name in ("mean", "std"):
        got, want = getattr(state, name), getattr(eager_state, name)
        assert (got is None) == (want is None)
        for a, b in zip(got or [], want or [], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    return params, eager_params


def test_compiled_flat_release_matches_eager():
    params, eager = _agree(FlatClip, max_grad_norm=1.0)
    # the comparison can fail: another clip norm moves the parameters
    other, _, _ = _run(FlatClip, False, max_grad_norm=0.5)
    assert not all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(other, eager, strict=True))


@pytest.mark.slow
def test_compiled_adaclip_release_matches_eager():
    _agree(AdaClip, initial_max_grad_norm=1.0)
    _agree(
        AdaClip,
        scale="separated",
        max_grad_norm=1.0,
        pooling="factored",
        centre="none",
        correction="unbiased",
    )


@pytest.mark.slow
def test_compiled_release_with_an_auxiliary_count_matches_eager():
    _agree(QuantileClip, max_grad_norm=1.0)


@pytest.mark.parametrize("bad", [1, "yes", None])
def test_compile_release_must_be_a_bool(bad):
    model = nn.Linear(2, 2)
    with pytest.raises(InvalidHyperparameterError, match="compile_release"):
        FlatClip(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=1.0, max_grad_norm=1.0,
                 expected_batch_size=4.0, compile_release=bad)  # fmt: skip
