"""Mixed precision on the per-sample paths: bfloat16/float16 parameters and ``torch.autocast``.

Under ``torch.autocast`` a ``Linear`` with float32 inputs computes in bfloat16, so its output
gradient arrives in bfloat16 while the captured input is float32; the materialise rule used to
fail on the mixed dtypes ("expected scalar type Float but found BFloat16"). The rule now works
in the wider dtype. Per-example gradients are held in float32 whatever the parameters' dtype,
and the clip factors are computed on exactly the gradients that are summed, so each clipped
contribution has norm ≤ C. Checked against one example at a time (in the same precision,
within a tolerance for bfloat16's 8-bit mantissa)."""

from __future__ import annotations

import pytest
import test_torch_hf_models as hf
import torch
from torch import nn

import adaclip.strategies as strategies
from adaclip_torch import FlatClip

pytestmark = pytest.mark.torch

MODES = ("materialise", "ghost", "auto")


def _mlp(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.LayerNorm(32), nn.Linear(32, 4)).to(dtype)


def _loss(model, x, y, autocast):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(x)
    return nn.functional.cross_entropy(out.float(), y, reduction="sum")


def _one_at_a_time(model, x, y, autocast):
    rows = []
    for i in range(x.shape[0]):
        model.zero_grad(set_to_none=True)
        _loss(model, x[i : i + 1], y[i : i + 1], autocast).backward()
        rows.append([p.grad.detach().float().clone() for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    return [torch.stack([r[k] for r in rows]) for k in range(len(rows[0]))]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "dtype, autocast", [(torch.bfloat16, False), (torch.float16, False), (torch.float32, True)],
    ids=["bf16-params", "fp16-params", "autocast-bf16"],
)  # fmt: skip
def test_per_example_gradients_and_clipping_in_low_precision(dtype, autocast, mode, monkeypatch):
    seen = []  # the clip factors the engine computes (and applies)
    real = strategies.group_clip_factors
    monkeypatch.setattr(strategies, "group_clip_factors", lambda s, sq: seen.append(real(s, sq)) or seen[-1])
    model = _mlp(dtype)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(8, 16, generator=gen).to(dtype)
    y = torch.randint(0, 4, (8,), generator=gen)
    ref = _one_at_a_time(model, x, y, autocast)
    clip = float(torch.sqrt(sum((g.flatten(1) ** 2).sum(1) for g in ref)).median())
    opt = FlatClip(torch.optim.SGD(model.parameters(), lr=0.0), model, noise_multiplier=0.0, expected_batch_size=8.0,
                   max_grad_norm=clip, per_sample_mode=mode, loss_reduction="sum")  # fmt: skip
    try:
        sums, per_example = hf.engine_step(opt, _loss(model, x, y, autocast))
    finally:
        opt.remove_hooks()
    scale = max(float(g.abs().max()) for g in ref)
    for got, want in zip(per_example, ref, strict=True):
        assert got.dtype == torch.float32  # held in float32 whatever the parameters' dtype
        torch.testing.assert_close(got / scale, want / scale, rtol=0, atol=2e-2)
    # each contribution ≤ C, no slack: the engine's clip factors times the exact (float64) norms
    # of the float32 gradients it summed
    norms = torch.sqrt(sum((g.double().flatten(1) ** 2).sum(1) for g in per_example))
    factors = seen[-1][0].double()
    assert bool((factors < 1).any()) and bool((norms * factors <= clip).all())
    expected = hf.clipped_reference([g.double() for g in per_example], clip)
    for got, want in zip(sums, expected, strict=True):
        torch.testing.assert_close(got.double(), want, rtol=1e-3, atol=1e-5)  # float32 sums


def test_autocast_step_matches_float32_within_bfloat16_tolerance():
    """A private step under autocast equals the float32 step (same seed, σ > 0) within
    bfloat16's precision: the noise is drawn and added in float32 either way."""

    def run(autocast: bool) -> list[torch.Tensor]:
        model = _mlp(torch.float32)
        opt = FlatClip(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=0.5,
                       expected_batch_size=8.0, max_grad_norm=1.0, seed=5)  # fmt: skip
        gen = torch.Generator().manual_seed(2)
        x, y = torch.randn(8, 16, generator=gen), torch.randint(0, 4, (8,), generator=gen)
        _loss(model, x, y, autocast).backward()
        opt.step()
        opt.remove_hooks()
        return [p.detach().clone() for p in model.parameters()]

    for a, b in zip(run(True), run(False), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=5e-3)
