"""The noise contract (:mod:`adaclip.correlated.contract`): every family implements it, its parts
(sampler, accounting, checkpoint rule) say what the front ends used to decide themselves, and a
family the library has never seen runs through the PyTorch optimizer with no change to it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from adaclip.accounting import Accountant, MinSeparationParticipation, block_noise_multipliers
from adaclip.correlated import BandedNoise, BltNoise, fit_blt, independent, resolve_noise_mechanism
from adaclip.correlated.contract import (
    NoiseAccounting,
    NoiseFamily,
    NoiseStreamState,
    SamplerRequirement,
    is_noise_family,
)
from adaclip.correlated.mechanism import CycleAccounting
from adaclip.errors import InvalidHyperparameterError
from adaclip_torch import FlatClip
from adaclip_torch.data import CyclicPoissonBatchSampler, FixedOrderBatchSampler, PoissonBatchSampler

N, BATCH = 40, 8


# ------------------------------------------------------------------ a family the library does not know


class SignFlipNoise:
    """``x_t = (−1)^t z_t``: independent noise with a public, data-independent sign per step.

    Privacy: each release ``y_t = G_t + σ(−1)^t z_t`` is ``(−1)^t`` times the Gaussian mechanism
    ``(−1)^t G_t + σ z_t`` on a sum of sensitivity 1 (post-processing by a public bijection), so
    the run is DP-SGD's: one Poisson-subsampled Gaussian at rate ``q`` per step."""

    family = "signflip"
    size = 1
    size_label = "signs"
    state_size = 0
    sampler_requirement = SamplerRequirement("poisson")

    def init(self) -> NoiseStreamState:
        return NoiseStreamState(history=(), step=0)

    def correlate(self, state: NoiseStreamState, z: Sequence[Any]) -> tuple[list[Any], NoiseStreamState]:
        sign = -1.0 if state.step % 2 else 1.0
        return [sign * zk for zk in z], NoiseStreamState(history=(), step=state.step + 1)

    def variance(self, step: int) -> float:
        return 1.0

    def accounting(self, sample_rate: float, *, separation: int | None = None) -> CycleAccounting:
        return CycleAccounting(rate=float(sample_rate), cycle=1)

    def saved_buffers(self, stream_step: int) -> int:
        return 0

    def checkpoint_tag(self) -> dict[str, Any]:
        return {"mechanism": "signflip", "signs": 1}


# ------------------------------------------------------------------ the built-in families


def test_every_built_in_family_implements_the_contract():
    blt = fit_blt(20, buffers=2, min_separation=4)
    for noise in (independent(), BandedNoise([0.8, 0.6]), blt, SignFlipNoise()):
        assert isinstance(noise, NoiseFamily) and is_noise_family(noise)
    assert not is_noise_family("banded") and not is_noise_family(BandedNoise) and not is_noise_family(None)
    assert isinstance(BandedNoise([1.0]).accounting(0.1), NoiseAccounting)
    assert isinstance(blt.accounting(1.0, separation=4), NoiseAccounting)


def test_banded_contract_sampler_accounting_and_checkpoint_rule():
    noise = BandedNoise([0.8, 0.6, 0.0])
    assert noise.sampler_requirement == SamplerRequirement("cyclic_poisson", 3)
    acc = noise.accounting(0.1)
    assert (acc.rate, acc.cycle) == (pytest.approx(0.3), 3)
    assert acc.noise_multiplier(1.7, 6) == 1.7
    with pytest.raises(InvalidHyperparameterError, match="Use at most 2 bands"):
        noise.accounting(0.4)  # b·q > 1
    assert [noise.saved_buffers(t) for t in range(5)] == [0, 1, 2, 2, 2] and noise.state_size == 2
    assert noise.checkpoint_tag() == {"bands": 3} and (noise.family, noise.size) == ("banded", 3)
    one = independent()
    assert one.accounting(0.25) == (0.25, 1) and one.saved_buffers(9) == 0 and one.family == "banded"


def test_blt_contract_records_the_block_noise_multipliers_of_its_min_separation():
    noise = BltNoise((0.9, 0.4), (0.3, 0.2))
    assert noise.sampler_requirement == SamplerRequirement("fixed_order")
    acc = noise.accounting(0.2, separation=5)
    assert (acc.rate, acc.cycle) == (1.0, 5)
    sigma, n = 1.3, 40
    prefix = MinSeparationParticipation(5).prefix_sensitivities_squared(noise.column(n))
    expected = block_noise_multipliers(sigma, prefix, 5)
    got = [acc.noise_multiplier(sigma, start) for start in range(0, n, 5)]
    assert got == pytest.approx(expected, rel=1e-12)
    assert got[1] == pytest.approx(sigma / math.sqrt(prefix[10] - prefix[5]), rel=1e-12)
    assert acc.noise_multiplier(0.0, 5) == 0.0
    with pytest.raises(InvalidHyperparameterError, match="separation"):
        noise.accounting(0.2)
    assert [noise.saved_buffers(t) for t in range(3)] == [0, 2, 2] and noise.state_size == 2
    assert noise.checkpoint_tag() == {"mechanism": "blt", "blt_buffers": 2}


def test_resolve_passes_a_new_family_through_and_refuses_bands_for_it():
    flip = SignFlipNoise()
    assert resolve_noise_mechanism(flip) is flip
    with pytest.raises(InvalidHyperparameterError, match="bands= is for noise_mechanism='banded'"):
        resolve_noise_mechanism(flip, 2)
    with pytest.raises(InvalidHyperparameterError, match="NoiseFamily"):
        resolve_noise_mechanism(object())


# ------------------------------------------------------------------ a new family through the optimizer


def _zero_model() -> nn.Module:
    m = nn.Linear(6, 5, bias=False)
    nn.init.zeros_(m.weight)
    return m


def _released(mechanism: Any, steps: int, *, accountant: Any = None) -> tuple[list[np.ndarray], Any]:
    """``σ·x_t/B̄`` read off the gradient of a zero model (the clipped sum is 0)."""
    model = _zero_model()
    sampler = PoissonBatchSampler(N, BATCH / N, num_steps=steps, generator=torch.Generator().manual_seed(2))
    opt = FlatClip(torch.optim.SGD(model.parameters(), lr=1.0), model, noise_multiplier=1.5, max_grad_norm=1.0,
                   expected_batch_size=BATCH, sample_rate=BATCH / N, seed=11, accountant=accountant,
                   noise_mechanism=mechanism, sampler=sampler)  # fmt: skip
    out, it = [], iter(sampler)
    for _ in range(steps):
        (0.0 * model(torch.randn(len(next(it)), 6))).sum().backward()
        opt.step()
        out.append(model.weight.grad.detach().numpy().copy())
        opt.zero_grad()
    return out, opt


def test_a_new_family_runs_through_the_torch_optimizer_unchanged():
    flipped, opt = _released(SignFlipNoise(), 6, accountant=Accountant("rdp"))
    plain, _ = _released("independent", 6)
    for t, (a, b) in enumerate(zip(flipped, plain, strict=True)):
        np.testing.assert_array_equal(a, (-1.0) ** t * b)  # the family's noise on the same draws, exactly
    assert opt.noise_mechanism == "signflip" and opt.bands is None and opt.noise_coefficients is None
    assert isinstance(opt.correlated_noise, SignFlipNoise) and opt.correlated_noise is not opt._stream.mechanism
    # its accounting: one Poisson-subsampled Gaussian at (q, σ) per step, recorded by the optimizer
    assert list(opt.accountant.history) == [(BATCH / N, 1.5, 6)]
    assert opt.accounted_sample_rate == BATCH / N
    # its checkpoint rule: the tag is saved, and a stream saved by another family is refused
    saved = opt.state_dict()
    stream = next(v for v in _walk(saved) if isinstance(v, dict) and v.get("mechanism") == "signflip")
    assert stream["signs"] == 1 and stream["buffers"] in (None, [])
    assert "signflip" in opt.summary()


def _walk(value: Any):
    yield value
    if isinstance(value, dict):
        for v in value.values():
            yield from _walk(v)


def test_a_new_family_gets_the_sampler_its_contract_names():
    model = _zero_model()
    cyclic = CyclicPoissonBatchSampler(N, BATCH / N, 2, generator=torch.Generator().manual_seed(2))
    with pytest.raises(InvalidHyperparameterError, match="accounted as Poisson sampling"):
        FlatClip(torch.optim.SGD(model.parameters(), lr=1.0), model, noise_multiplier=1.0, max_grad_norm=1.0,
                 expected_batch_size=BATCH, sample_rate=BATCH / N, noise_mechanism=SignFlipNoise(),
                 sampler=cyclic)  # fmt: skip
    fixed = FixedOrderBatchSampler(N, BATCH, generator=torch.Generator().manual_seed(2))
    with pytest.raises(InvalidHyperparameterError, match="accounted as Poisson sampling"):
        FlatClip(torch.optim.SGD(model.parameters(), lr=1.0), model, noise_multiplier=1.0, max_grad_norm=1.0,
                 expected_batch_size=BATCH, sample_rate=BATCH / N, noise_mechanism=SignFlipNoise(),
                 sampler=fixed)  # fmt: skip

    class Unheard(SignFlipNoise):
        sampler_requirement = SamplerRequirement("shuffled")  # type: ignore[arg-type]

    with pytest.raises(InvalidHyperparameterError, match="no PyTorch sampler provides"):
        FlatClip(torch.optim.SGD(model.parameters(), lr=1.0), model, noise_multiplier=1.0, max_grad_norm=1.0,
                 expected_batch_size=BATCH, sample_rate=BATCH / N, noise_mechanism=Unheard(),
                 sampler=PoissonBatchSampler(N, BATCH / N))  # fmt: skip


def test_summary_of_a_sharded_blt_stream_counts_its_buffers():
    """The summary's sharded-state line counted ``b − 1`` buffers from :attr:`bands`, which is
    ``None`` for BLT noise (a TypeError); it now asks the family (``m`` buffers)."""
    from adaclip_torch.distributed import noise_shard

    model = _zero_model()
    sampler = FixedOrderBatchSampler(N, BATCH, generator=torch.Generator().manual_seed(2))
    opt = FlatClip(torch.optim.SGD(model.parameters(), lr=1.0), model, noise_multiplier=1.0, max_grad_norm=1.0,
                   expected_batch_size=BATCH, sample_rate=BATCH / N, noise_mechanism=BltNoise((0.9, 0.4), (0.3, 0.2)),
                   sampler=sampler)  # fmt: skip
    opt._stream.shard = noise_shard(30, 0, 2)
    assert f"{2 * opt._stream.shard.size} buffer numbers" in opt.summary()


@pytest.mark.jax
def test_the_jax_transformations_refuse_a_family_they_cannot_run():
    pytest.importorskip("jax")
    from adaclip_jax import flat_clip

    with pytest.raises(InvalidHyperparameterError, match="'signflip' noise .* PyTorch"):
        flat_clip(max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=8, noise_mechanism=SignFlipNoise())
