"""Canary audit of the sharded release: banded and BLT noise with ``distributed=True`` on two gloo ranks.

Under sharded noise state each rank draws and correlates the noise of its own half of the
coordinates (:func:`adaclip_torch.distributed.sharded_noisy_all_reduce`), so the 1,000 canaries
(one coordinate each, spread over both halves) are seen through two independent streams. The
auditor runs on rank 0: the canaries are units of rank 0's data (added through the mechanism,
clipped and noised like the rest), rank 1 steps its own data; both ranks sample their units by
cyclic Poisson sampling at the global rate. The setting is the single-process banded audit's
(``tests/test_torch_audit_banded.py``): ``b = 4``, ``q = 1/8``, ``T = 80``, ``σ = 4``, learning
rate 0 (the mechanism, not the model).

The contract: the correct run's ``ε_emp`` (and the GDP fit's lower end) stay at or below the
accountant's ε, and the canaries are seen with the ``μ`` of the whitened matched filter; the same
run with half the noise released by both ranks while σ is accounted is detected — the GDP fit's
lower end exceeds the accountant's ε. BLT (the memory-light mechanism) is audited the same way,
with each rank's 32 units in 4 fixed batches of 8 (min separation 4), the factor fitted for the
run and σ calibrated for ε = 4, as ``tests/test_torch_audit_blt.py`` on one process. Had a rank added its slice twice, or drawn another rank's
stream, the audit would see the noise it assumed; what it checks is that the noise reaching the
canaries' coordinates is the noise the accountant records, whichever rank owns them.
"""

from __future__ import annotations

import math

import pytest
import torch
from _gloo import gloo_group, spawn_ranks
from torch import nn

pytestmark = pytest.mark.torch
WORLD, BANDS, Q, STEPS, SIGMA, M, DELTA = 2, 4, 0.125, 80, 4.0, 1000, 1e-5
N, IN, OUT = 64, 50, 40  # d = 2,000 coordinates; 32 data units on each rank
BLT_SEPARATION, BLT_EPSILON = 4, 4.0  # BLT: each rank's 32 units in 4 fixed batches of 8


def _blt_plan() -> tuple:
    """BLT as make_private plans it for the run: the factor fitted for T = 80 steps with min
    separation 4 (each rank's 32 units in 4 fixed batches of 8) and σ calibrated (RDP) for ε = 4."""
    from adaclip import accounting
    from adaclip.correlated.blt import fit_blt

    noise = fit_blt(STEPS, buffers=2, min_separation=BLT_SEPARATION)
    prefix = accounting.MinSeparationParticipation(BLT_SEPARATION).prefix_sensitivities_squared(noise.column(STEPS))
    sigma = accounting.calibrate_block_noise_multiplier(target_epsilon=BLT_EPSILON, delta=DELTA, prefix=prefix,
                                                        block=BLT_SEPARATION, accountant="rdp")  # fmt: skip
    return noise, sigma


def _run(rank: int, *, noise_scale: float, seed: int, noise: str = "banded") -> dict:
    """One audited run on this rank (the auditor on rank 0); rank 0 returns the report."""
    import adaclip_torch
    from adaclip.accounting import Accountant
    from adaclip_torch.audit import GradientCanaryAuditor
    from adaclip_torch.data import CyclicPoissonBatchSampler, FixedOrderBatchSampler

    torch.manual_seed(seed)  # the same model on both ranks
    model = nn.Linear(IN, OUT, bias=False)
    data = torch.Generator().manual_seed(seed * 10 + rank)
    x, y = torch.randn(N // WORLD, IN, generator=data), torch.randint(0, OUT, (N // WORLD,), generator=data)
    order = torch.Generator().manual_seed(seed * 10 + rank + 5)
    if noise == "blt":
        mechanism, sigma = _blt_plan()
        batch = N // WORLD // BLT_SEPARATION
        sampler = FixedOrderBatchSampler(N // WORLD, batch, generator=order, total_steps=STEPS)
        options = dict(noise_mechanism=mechanism, expected_batch_size=WORLD * batch, sample_rate=sampler.sample_rate)
    else:
        sigma = SIGMA
        sampler = CyclicPoissonBatchSampler(N // WORLD, Q, BANDS, num_steps=STEPS, generator=order)
        options = dict(noise_mechanism="banded", bands=BANDS, expected_batch_size=N * Q, sample_rate=Q)
    accountant = Accountant("pld")
    opt = adaclip_torch.FlatClip(torch.optim.SGD(model.parameters(), lr=0.0), model, max_grad_norm=1.0,
                                 noise_multiplier=sigma, loss_reduction="sum", accountant=accountant,
                                 sampler=sampler, distributed=True, seed=100 + seed, **options)  # fmt: skip
    assert opt.noise_sharding == "sharded"
    if noise_scale != 1.0:  # both ranks release scale·x on their slices while σ is accounted
        correlate = opt._stream.correlate
        opt._stream.correlate = lambda z: [noise_scale * v for v in correlate(z)]
    auditor = GradientCanaryAuditor(opt, num_canaries=M, seed=seed) if rank == 0 else None
    batches = iter(sampler)
    for _ in range(STEPS):
        if noise == "blt":  # fixed order: the position carries over the epochs
            idx = sampler.batch(sampler.position)
            sampler.position += 1
        else:
            idx = next(batches)
        nn.functional.cross_entropy(model(x[idx]), y[idx], reduction="sum").backward()
        if auditor is not None:
            auditor.step()
        else:
            opt.step()
        opt.zero_grad()
    if auditor is None:
        return {}
    shard = opt._stream.shard
    coordinates = auditor.canaries.coordinates
    return {
        # 99.5 %: BLT's audit is tight (no amplification), so at 95 % one correct run in twenty
        # would sit above the accountant by chance; half the noise stays far above it
        "report": auditor.report(delta=DELTA, confidence=0.995),
        "accountant_epsilon": accountant.epsilon(DELTA),
        "canaries_in_each_slice": [int(((coordinates >= s) & (coordinates < e)).sum())
                                   for s, e in ((0, shard.end), (shard.end, shard.total))],  # fmt: skip
    }


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    with gloo_group(rank, WORLD, init_file):
        result = {"correct": _run(rank, noise_scale=1.0, seed=0), "half": _run(rank, noise_scale=0.5, seed=1),
                  "blt-correct": _run(rank, noise_scale=1.0, seed=0, noise="blt"),
                  "blt-half": _run(rank, noise_scale=0.5, seed=1, noise="blt")}  # fmt: skip
    torch.save(result, f"{out_dir}/rank{rank}.pt")


@pytest.fixture(scope="module")
def audited(tmp_path_factory):
    return spawn_ranks(_worker, tmp_path_factory.mktemp("audit_sharded"), WORLD)[0]


def test_the_canaries_lie_in_both_ranks_slices(audited):
    assert min(audited["correct"]["canaries_in_each_slice"]) > M // 4


def test_the_sharded_release_audits_within_the_accountant(audited):
    run = audited["correct"]
    rep = run["report"]
    assert not rep.exceeds_accountant and rep.epsilon_lower <= run["accountant_epsilon"], str(rep)
    assert rep.gdp.epsilon_lower <= run["accountant_epsilon"], str(rep)
    expected_mu = BANDS * Q * math.sqrt(STEPS / BANDS) / SIGMA  # the whitened matched filter's μ: 0.56
    assert abs(rep.gdp.mu - expected_mu) < 4 * rep.gdp.se, str(rep)


def test_the_sharded_blt_release_audits_within_the_accountant(audited):
    """BLT (no amplification, so the audit is tight) with its state sharded over the two ranks."""
    run = audited["blt-correct"]
    rep = run["report"]
    assert not rep.exceeds_accountant and rep.epsilon_lower <= run["accountant_epsilon"], str(rep)
    assert rep.gdp.epsilon_lower <= run["accountant_epsilon"], str(rep)


@pytest.mark.parametrize("noise", ["banded", "blt"])
def test_the_sharded_audit_detects_half_the_noise(audited, noise):
    """Negative control: both ranks release σ/2·x on their slices while σ is accounted."""
    prefix = "" if noise == "banded" else "blt-"
    correct, half = audited[prefix + "correct"], audited[prefix + "half"]
    assert half["accountant_epsilon"] == correct["accountant_epsilon"]  # the accountant saw σ
    rep = half["report"]
    assert rep.gdp.epsilon_lower > correct["accountant_epsilon"], str(rep)
    assert rep.epsilon_lower > correct["report"].epsilon_lower, str(rep)
