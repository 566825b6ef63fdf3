"""Banded correlated noise in the PyTorch optimizer, checked against the core's maths.

The release with a zero clipped sum is ``σ·x_t/B̄``: the tests read ``x_t`` off ``p.grad`` and
compare it with the NumPy reference (:class:`adaclip.correlated.BandedNoise` on the same
standard normals), check the accounting (one composition per cycle of ``b`` steps, at rate
``b·q``), the sampler rules, and checkpoints.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats
from torch import nn

from adaclip.accounting import Accountant
from adaclip.correlated import BandedNoise
from adaclip.errors import InvalidGradientError, InvalidHyperparameterError
from adaclip_torch import AdaClip, FlatClip
from adaclip_torch.data import CyclicPoissonBatchSampler, PoissonBatchSampler
from adaclip_torch.noise import NoiseSource

pytestmark = pytest.mark.torch

N, Q = 40, 0.1


def sqrt_coefficients(b: int) -> np.ndarray:
    c = np.array([math.comb(2 * k, k) / 4**k for k in range(b)])
    return c / np.linalg.norm(c)


def _zero_model() -> nn.Module:
    m = nn.Linear(6, 5, bias=False)
    nn.init.zeros_(m.weight)
    return m


def _optimizer(model, *, bands=4, sigma=1.0, seed=7, sampler=None, accountant=None, cls=FlatClip, **kw):
    sampler = sampler if sampler is not None else CyclicPoissonBatchSampler(
        N, Q, bands, generator=torch.Generator().manual_seed(2))
    kw.setdefault("max_grad_norm", 1.0)
    return cls(torch.optim.SGD(model.parameters(), lr=1.0), model, noise_multiplier=sigma, expected_batch_size=N * Q,
               sample_rate=Q, seed=seed, accountant=accountant, noise_mechanism=BandedNoise(sqrt_coefficients(bands)),
               sampler=sampler, **kw), sampler


def _forever(sampler):
    """The sampler's batches pass after pass (its position carries over)."""
    while True:
        yield from sampler


def _released(opt, model, sampler, steps: int) -> list[np.ndarray]:
    """Step ``steps`` times on zero gradients; return each release's gradient ``σ·x_t/B̄``."""
    out = []
    it = _forever(sampler)
    for _ in range(steps):
        idx = next(it)
        (0.0 * model(torch.randn(len(idx), 6))).sum().backward()
        opt.step()
        out.append(model.weight.grad.detach().numpy().copy())
        opt.zero_grad()
    return out


def _standard_normals(seed: int, steps: int) -> list[np.ndarray]:
    """The draws the optimizer's seeded generator makes, one per step (statistics dtype)."""
    source = NoiseSource(seed=seed)
    like = [torch.zeros(5, 6)]
    return [source.standard_normal(like)[0].numpy().copy() for _ in range(steps)]


def test_the_release_is_the_reference_banded_noise_on_the_same_draws():
    model = _zero_model()
    opt, sampler = _optimizer(model, bands=4, sigma=1.3, seed=7)
    got = _released(opt, model, sampler, 12)
    mech = BandedNoise(sqrt_coefficients(4))
    state = mech.init()
    for t, z in enumerate(_standard_normals(7, 12)):
        x, state = mech.correlate(state, [z])
        np.testing.assert_allclose(got[t], 1.3 * x[0] / (N * Q), rtol=1e-6, atol=1e-7)


def test_one_band_is_dp_sgd_bit_for_bit():
    """bands=1: the same draws, the same batches, the same parameters and the same accounting."""
    torch.manual_seed(0)
    xs, ys = torch.randn(N, 6), torch.randint(0, 5, (N,))
    runs = []
    for banded in (False, True):
        model = nn.Linear(6, 5)
        torch.nn.init.constant_(model.weight, 0.1)
        torch.nn.init.zeros_(model.bias)
        accountant = Accountant("rdp")
        gen = torch.Generator().manual_seed(3)
        if banded:
            sampler = CyclicPoissonBatchSampler(N, Q, 1, generator=gen)
            extra = {"noise_mechanism": "banded", "bands": 1, "sampler": sampler}
        else:
            sampler = PoissonBatchSampler(N, Q, generator=gen)
            extra = {}
        opt = FlatClip(torch.optim.SGD(model.parameters(), lr=0.5), model, noise_multiplier=0.9, max_grad_norm=0.5,
                       expected_batch_size=N * Q, sample_rate=Q, seed=11, accountant=accountant, **extra)
        for idx in sampler:
            nn.functional.cross_entropy(model(xs[idx]), ys[idx]).backward()
            opt.step()
            opt.zero_grad()
        runs.append(([p.detach().clone() for p in model.parameters()], accountant.history))
    for a, b in zip(runs[0][0], runs[1][0], strict=True):
        assert torch.equal(a, b)
    assert runs[0][1] == runs[1][1]


def test_noise_statistics_covariance_with_a_negative_control():
    """Many coordinates: applying C to the released noise gives back iid N(0, 1) (KS test), and
    the released noise itself is not standard (its variance is v_t > 1) — the negative control."""
    bands, steps = 4, 8
    model = nn.Linear(500, 8, bias=False)
    nn.init.zeros_(model.weight)
    sampler = CyclicPoissonBatchSampler(N, Q, bands, generator=torch.Generator().manual_seed(2))
    opt = FlatClip(torch.optim.SGD(model.parameters(), lr=1.0), model, noise_multiplier=1.0, max_grad_norm=1.0,
                   expected_batch_size=1.0, sample_rate=Q, seed=5,
                   noise_mechanism=BandedNoise(sqrt_coefficients(bands)), sampler=sampler)
    xs = []
    it = _forever(sampler)
    for _ in range(steps):
        idx = next(it)
        (0.0 * model(torch.randn(len(idx), 500))).sum().backward()
        opt.step()
        xs.append(model.weight.grad.detach().double().flatten().numpy().copy())
        opt.zero_grad()
    x = np.stack(xs)  # (T, d)
    c = sqrt_coefficients(bands)
    big_c = sum(np.diag(np.full(steps - j, c[j]), -j) for j in range(bands))
    z = big_c @ x
    assert stats.kstest(z.ravel(), "norm").pvalue > 1e-3
    assert stats.kstest(x[3:].ravel(), "norm").pvalue < 1e-6  # correlated noise is not N(0, 1) per step
    mech = BandedNoise(c)
    for t in range(steps):
        assert np.var(x[t]) == pytest.approx(mech.variance(t), rel=0.1)
    # consecutive releases are correlated as C⁻¹C⁻ᵀ says
    inv = np.linalg.inv(big_c)
    cov = inv @ inv.T
    assert np.mean(x[5] * x[4]) == pytest.approx(cov[5, 4], abs=0.08)
    assert abs(cov[5, 4]) > 0.2


def test_the_accountant_records_one_composition_per_cycle_at_rate_bq():
    model = _zero_model()
    accountant = Accountant("rdp")
    opt, sampler = _optimizer(model, bands=4, accountant=accountant)
    _released(opt, model, sampler, 9)
    assert accountant.history == ((4 * Q, 1.0, 3),)  # steps 0, 4, 8 open a cycle
    assert opt.accounted_sample_rate == pytest.approx(0.4)
    assert opt.noise_mechanism == "banded"


def test_the_budget_is_checked_at_each_cycle_start_before_anything_changes():
    from adaclip.errors import BudgetExceededError

    model = _zero_model()
    one = Accountant("rdp")
    one.step(noise_multiplier=1.0, sample_rate=0.4, num_steps=2)
    budget = one.epsilon(1e-5) * 1.0001  # room for exactly two compositions
    accountant = Accountant("rdp", target_epsilon=budget, delta=1e-5)
    opt, sampler = _optimizer(model, bands=4, accountant=accountant)
    _released(opt, model, sampler, 8)  # two cycles
    before = model.weight.detach().clone()
    idx = next(iter(sampler))
    (0.0 * model(torch.randn(len(idx), 6))).sum().backward()
    with pytest.raises(BudgetExceededError):
        opt.step()
    assert torch.equal(model.weight, before) and opt.steps == 8


def test_banded_noise_refuses_the_wrong_sampler_and_options():
    model = _zero_model()
    base = dict(noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=4.0, sample_rate=Q)
    inner = torch.optim.SGD(model.parameters(), lr=1.0)
    with pytest.raises(InvalidHyperparameterError, match="CyclicPoissonBatchSampler"):
        FlatClip(inner, model, **base, noise_mechanism="banded", bands=4)
    with pytest.raises(InvalidHyperparameterError, match="cyclic Poisson"):
        FlatClip(inner, model, **base, noise_mechanism="banded", bands=4, sampler=PoissonBatchSampler(N, Q))
    with pytest.raises(InvalidHyperparameterError, match="must agree"):
        FlatClip(inner, model, **base, noise_mechanism="banded", bands=4, sampler=CyclicPoissonBatchSampler(N, Q, 2))
    with pytest.raises(InvalidHyperparameterError, match="bands"):
        FlatClip(inner, model, **base, noise_mechanism="banded", sampler=CyclicPoissonBatchSampler(N, Q, 2))
    with pytest.raises(InvalidHyperparameterError, match="at most 10 bands"):
        CyclicPoissonBatchSampler(N, Q, 16)
    with pytest.raises(InvalidHyperparameterError, match="unit norm"):
        BandedNoise([1.0, 0.5])
    assert not any(m._forward_hooks for m in model.modules())  # nothing was attached


def test_a_batch_stepped_twice_or_skipped_is_refused():
    model = _zero_model()
    opt, sampler = _optimizer(model, bands=2)
    it = iter(sampler)
    idx = next(it)
    (0.0 * model(torch.randn(len(idx), 6))).sum().backward()
    opt.step()
    opt.zero_grad()
    (0.0 * model(torch.randn(3, 6))).sum().backward()
    with pytest.raises(InvalidGradientError, match="stepped exactly once"):
        opt.step()  # no new batch drawn
    opt.zero_grad()
    next(it), next(it)  # two batches drawn, the first skipped
    (0.0 * model(torch.randn(3, 6))).sum().backward()
    with pytest.raises(InvalidGradientError, match="skipped"):
        opt.step()
    assert opt.steps == 1


def test_cyclic_sampler_groups_and_rates():
    sampler = CyclicPoissonBatchSampler(2000, 0.05, 4, num_steps=40, generator=torch.Generator().manual_seed(0))
    assert sampler.group_rate == pytest.approx(0.2)
    counts = torch.bincount(sampler.groups, minlength=4)
    assert counts.min() > 400  # independent uniform assignment
    last: dict[int, int] = {}
    sizes = []
    for t, idx in enumerate(sampler):
        sizes.append(len(idx))
        for i in idx:
            assert int(sampler.groups[i]) == t % 4
            assert t - last.get(i, -4) >= 4  # at most once in any 4 consecutive steps
            last[i] = t
    assert np.mean(sizes) == pytest.approx(100, rel=0.1)  # q·N
    assert sampler.position == 40
    # the position carries over to the next pass
    next(iter(sampler))
    assert sampler.position == 41


def test_seeded_checkpoint_resumes_the_stream_bit_for_bit():
    model_a = _zero_model()
    opt_a, sampler_a = _optimizer(model_a, bands=4, seed=9)
    full = _released(opt_a, model_a, sampler_a, 10)

    model_b = _zero_model()
    opt_b, sampler_b = _optimizer(model_b, bands=4, seed=9)
    it = _forever(sampler_b)
    for _ in range(6):  # mid-cycle
        idx = next(it)
        (0.0 * model_b(torch.randn(len(idx), 6))).sum().backward()
        opt_b.step()
        opt_b.zero_grad()
    saved, sampler_state = opt_b.state_dict(), sampler_b.state_dict()
    assert len(saved["noise_stream"]["buffers"]) == 3
    model_c = _zero_model()
    opt_c, sampler_c = _optimizer(model_c, bands=4, seed=123)
    sampler_c.load_state_dict(sampler_state)
    with pytest.warns(Warning):
        opt_c.load_state_dict(saved)
    got = _released(opt_c, model_c, sampler_c, 4)
    for a, b in zip(got, full[6:], strict=True):
        np.testing.assert_array_equal(a, b)


def test_an_unseeded_checkpoint_saves_no_buffer_and_restarts_the_cycle():
    model = _zero_model()
    accountant = Accountant("rdp")
    opt, sampler = _optimizer(model, bands=4, seed=None, accountant=accountant)
    _released(opt, model, sampler, 6)
    saved = opt.state_dict()
    assert saved["noise_stream"]["buffers"] is None
    model2 = _zero_model()
    acc2 = Accountant("rdp")
    opt2, sampler2 = _optimizer(model2, bands=4, seed=None, accountant=acc2)
    sampler2.load_state_dict(sampler.state_dict())
    opt2.load_state_dict(saved)
    assert acc2.history == ((0.4, 1.0, 2),)
    _released(opt2, model2, sampler2, 1)  # step 6 opens a new cycle: accounted at once
    assert acc2.history == ((0.4, 1.0, 3),)


def test_adaclip_statistics_subtract_the_correlated_noise_variance():
    """AdaCliP learns its statistics from the release minus the noise's known variance: with
    banded noise that is σ²·v_t (v_t > 1), passed to the strategy as σ·√v_t."""
    from adaclip import strategies

    strat = strategies.adaptive_clipping(6)  # the default (centred) configuration
    params = [torch.zeros(3, 2, dtype=torch.float64)]
    state = strat.init(params)
    summed = [torch.ones(3, 2, dtype=torch.float64)]
    noise = [torch.full((3, 2), 0.5, dtype=torch.float64)]
    _, with_v = strategies.release(strat, state, summed, noise, noise_multiplier=1.0, expected_batch_size=4.0,
                                   noise_variance=4.0)
    noisy, _ = strategies.release(strat, state, summed, noise, noise_multiplier=1.0, expected_batch_size=4.0)
    _, scale = strat.transform(state, 1)
    expected = strat.update(state, noisy, scale, noise_multiplier=2.0, expected_batch_size=4.0)
    def flat(st):
        return [t for t in (st.std or [])] + [t for v in (st.extra or {}).values() if isinstance(v, list) for t in v]

    for a, b in zip(flat(with_v), flat(expected), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    plain = strat.update(state, noisy, scale, noise_multiplier=1.0, expected_batch_size=4.0)
    assert any(not torch.equal(a, b) for a, b in zip(flat(with_v), flat(plain), strict=True))


def test_adaclip_runs_with_banded_noise():
    torch.manual_seed(1)
    model = nn.Linear(6, 5)
    opt, sampler = _optimizer(model, bands=2, cls=AdaClip, max_grad_norm=None)
    xs, ys = torch.randn(N, 6), torch.randint(0, 5, (N,))
    for idx in sampler:
        nn.functional.cross_entropy(model(xs[idx]), ys[idx]).backward()
        opt.step()
        opt.zero_grad()
    assert all(torch.isfinite(p).all() for p in model.parameters())


# ----------------------------------------------------------------------------- make_private


def _private_parts(n: int = 200, batch: int = 20, momentum: float = 0.9):
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum), DataLoader(ds, batch_size=batch)


def test_make_private_banded_chooses_b_calibrates_for_the_cycles_and_spends_the_budget():
    from adaclip.accounting import calibrate_noise_multiplier
    from adaclip_torch.privacy import make_private

    model, opt, loader = _private_parts()
    model, private, loader = make_private(model, opt, loader, target_epsilon=3.0, delta=1e-5, epochs=5,
                                          noise_mechanism="banded", seed=0)  # 50 steps: shorter runs get b = 1
    b = private._stream.bands
    assert isinstance(loader.batch_sampler, CyclicPoissonBatchSampler) and loader.batch_sampler.bands == b
    assert b in (1, 2, 4, 8)  # b·q <= 1 with q = 0.1
    sigma = private.noise_schedule.at(0).noise_multiplier
    assert sigma == pytest.approx(calibrate_noise_multiplier(
        target_epsilon=3.0, delta=1e-5, sample_rate=min(1.0, b * 0.1), steps=-(-50 // b)))
    for _ in range(5):
        for x, y in loader:
            nn.functional.cross_entropy(model(x), y).backward()
            private.step()
            private.zero_grad()
    assert private.steps == 50
    assert private.accountant.history == ((b * 0.1, sigma, -(-50 // b)),)
    assert 2.9 < private.accountant.epsilon(1e-5) <= 3.0


def test_make_private_gives_a_short_run_dp_sgd():
    """A run of fewer than MIN_STEPS_FOR_BANDS steps (here 40) gets b = 1 from the rule: DP-SGD
    with independent noise and plain Poisson sampling (on 16-step runs the rule's b > 1 was behind
    DP-SGD in 7 of 10 cells). A b given by the user is kept."""
    from adaclip.correlated.planning import MIN_STEPS_FOR_BANDS
    from adaclip_torch.privacy import make_private

    assert MIN_STEPS_FOR_BANDS == 50
    model, opt, loader = _private_parts()
    _, private, loader = make_private(model, opt, loader, target_epsilon=3.0, delta=1e-5, epochs=4, seed=0)
    assert private.noise_mechanism == "independent" and not isinstance(loader.batch_sampler, CyclicPoissonBatchSampler)
    model, opt, loader = _private_parts()
    _, private, _ = make_private(model, opt, loader, target_epsilon=3.0, delta=1e-5, epochs=4, seed=0,
                                 noise_mechanism="banded", bands=4)  # fmt: skip
    assert private.noise_mechanism == "banded" and private.bands == 4


def test_make_private_says_why_a_short_run_gets_dp_sgd(caplog):
    """The log line gives the reason for b = 1 on a short run (and only there)."""
    import logging

    from adaclip_torch.privacy import make_private

    model, opt, loader = _private_parts()
    with caplog.at_level(logging.INFO, logger="adaclip_torch.make_private"):
        make_private(model, opt, loader, target_epsilon=3.0, delta=1e-5, epochs=4, seed=0)
    line = caplog.records[-1].getMessage()
    assert "independent noise (DP-SGD) (noise_mechanism='auto')" in line
    assert "b = 1 because the run has 40 steps, fewer than 50" in line, line
    caplog.clear()
    model, opt, loader = _private_parts()
    with caplog.at_level(logging.INFO, logger="adaclip_torch.make_private"):
        make_private(model, opt, loader, noise_multiplier=1.0, noise_mechanism="independent")
    assert "fewer than" not in caplog.records[-1].getMessage()


def test_make_private_banded_with_given_bands_and_the_refusals():
    from adaclip_torch.privacy import make_private

    model, opt, loader = _private_parts()
    _, private, loader = make_private(model, opt, loader, noise_multiplier=1.0, noise_mechanism="banded", bands=4)
    assert private._stream.bands == 4 and loader.batch_sampler.bands == 4
    assert private._stream.mechanism.coefficients == pytest.approx(tuple(sqrt_coefficients(4)))  # no T: sqrt
    # the default, noise_mechanism="auto", takes given bands as banded noise
    model, opt, loader = _private_parts()
    _, private, loader = make_private(model, opt, loader, noise_multiplier=1.0, bands=4)
    assert private.noise_mechanism == "banded" and loader.batch_sampler.bands == 4
    for kwargs, words in [
        ({"noise_multiplier": 1.0, "noise_mechanism": "independent", "bands": 4}, "needs noise_mechanism='banded'"),
        ({"noise_multiplier": 1.0, "noise_mechanism": "banded"}, "give bands= too"),
        ({"noise_multiplier": 1.0, "noise_mechanism": "banded", "bands": 16}, "at most 10 bands"),
        ({"noise_multiplier": 1.0, "noise_mechanism": "bandmf", "bands": 4}, "noise_mechanism must be"),
        ({"noise_multiplier": 1.0, "noise_mechanism": "banded", "bands": 4, "sampler": None}, "sampler"),
    ]:
        model, opt, loader = _private_parts()
        with pytest.raises(InvalidHyperparameterError, match=words):
            make_private(model, opt, loader, **kwargs)
        assert not any(m._forward_hooks for m in model.modules())


def test_make_private_banded_with_one_band_is_make_private():
    from adaclip_torch.privacy import make_private

    out = []
    for extra in ({"noise_mechanism": "independent"}, {"noise_mechanism": "banded", "bands": 1}):
        model, opt, loader = _private_parts(momentum=0.0)
        model, private, loader = make_private(model, opt, loader, target_epsilon=2.0, delta=1e-5, epochs=1, seed=4,
                                              **extra)
        for x, y in loader:
            nn.functional.cross_entropy(model(x), y).backward()
            private.step()
            private.zero_grad()
        out.append(([p.detach().clone() for p in model.parameters()], private.accountant.history))
    for a, b in zip(out[0][0], out[1][0], strict=True):
        assert torch.equal(a, b)
    assert out[0][1] == out[1][1]


def test_user_level_banded_noise_with_the_cyclic_user_sampler():
    """User level: users are the units; the cyclic sampler assigns users to groups and a user
    joins at most one step in any b consecutive ones, with all of their examples."""
    from adaclip_torch.data import PoissonUserBatchSampler

    torch.manual_seed(0)
    users = torch.arange(N) // 2  # 20 users, 2 examples each
    sampler = PoissonUserBatchSampler(users, 0.25, bands=2, generator=torch.Generator().manual_seed(1))
    assert sampler.cyclic_sampler is not None and sampler.cyclic_sampler.bands == 2
    model = nn.Linear(6, 5)
    accountant = Accountant("rdp")
    opt = FlatClip(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=1.0, max_grad_norm=1.0,
                   expected_batch_size=sampler.expected_batch_size, sample_rate=0.25, accountant=accountant,
                   noise_mechanism="banded", bands=2, sampler=sampler)
    xs, ys = torch.randn(N, 6), torch.randint(0, 5, (N,))
    last: dict[int, int] = {}
    for t, idx in enumerate(sampler):
        batch_users = users[idx]
        for u in set(batch_users.tolist()):
            assert int(sampler.cyclic_sampler.groups[u]) == t % 2
            assert t - last.get(u, -2) >= 2
            last[u] = t
        nn.functional.cross_entropy(model(xs[idx]), ys[idx]).backward()
        opt.step(user_ids=batch_users)
        opt.zero_grad()
    assert accountant.history == ((0.5, 1.0, 2),)  # 4 steps, b = 2
    with pytest.raises(InvalidHyperparameterError, match="cyclic Poisson"):
        other = nn.Linear(6, 5)
        FlatClip(torch.optim.SGD(other.parameters(), lr=0.1), other, noise_multiplier=1.0,
                 expected_batch_size=5.0, sample_rate=0.25, noise_mechanism="banded", bands=2,
                 sampler=PoissonUserBatchSampler(users, 0.25))


def test_make_private_caps_the_bands_of_adaptive_optimizers_only_without_the_lr_factor():
    """Adam with its learning rate left alone gets at most ADAPTIVE_OPTIMIZER_MAX_BANDS bands;
    with the factor ρ (the default) the expected-error rule's own b, SGD-momentum's."""
    from adaclip_torch.privacy import ADAPTIVE_OPTIMIZER_MAX_BANDS, make_private

    chosen = {}
    for name, scale in (("sgd", None), ("adam", False), ("adam", None)):
        model, _, loader = _private_parts(n=2000, batch=20)  # q = 0.01: up to 64 bands allowed
        inner = (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if name == "sgd"
                 else torch.optim.Adam(model.parameters(), lr=1e-3))
        _, private, _ = make_private(model, inner, loader, target_epsilon=3.0, delta=1e-5, epochs=2,
                                     noise_mechanism="banded", scale_adaptive_lr=scale)
        chosen[name, scale] = (1 if private._stream is None else private._stream.bands, private.lr_scale)
    assert chosen["adam", False][0] <= ADAPTIVE_OPTIMIZER_MAX_BANDS < chosen["sgd", None][0]
    assert chosen["adam", False][1] == 1.0
    assert chosen["adam", None][0] == chosen["sgd", None][0] and chosen["adam", None][1] > 1.0


def _adam_parts(lr: float = 1e-3, n: int = 2000, batch: int = 20):
    model, _, loader = _private_parts(n=n, batch=batch)
    return model, torch.optim.Adam(model.parameters(), lr=lr), loader


def test_make_private_scales_an_adaptive_optimizers_lr_for_banded_noise():
    """Adam with banded noise: every learning rate times ρ = σ_b·√v̄/σ_1, with σ_1 DP-SGD's σ
    calibrated for the same run (computed here independently) and v̄ the stream's mean variance;
    SGD's learning rate is left alone."""
    from adaclip.accounting import calibrate_noise_multiplier
    from adaclip.correlated.coefficients import noise_variances
    from adaclip_torch.privacy import make_private

    model, adam, loader = _adam_parts(lr=1e-3)
    _, private, _ = make_private(model, adam, loader, target_epsilon=3.0, delta=1e-5, epochs=2)
    assert private.noise_mechanism == "banded"
    steps = 2 * 100  # q = 0.01
    sigma_1 = calibrate_noise_multiplier(target_epsilon=3.0, delta=1e-5, sample_rate=0.01, steps=steps)
    v = noise_variances(private.correlated_noise.coefficients, steps)
    expected = private.noise_multiplier * math.sqrt(v.mean()) / sigma_1
    assert expected > 1.2
    assert private.lr_scale == pytest.approx(expected, rel=1e-12)
    assert adam.param_groups[0]["lr"] == pytest.approx(1e-3 * expected, rel=1e-12)

    model, sgd, loader = _private_parts(n=2000)
    _, private, _ = make_private(model, sgd, loader, target_epsilon=3.0, delta=1e-5, epochs=2)
    assert private.noise_mechanism == "banded" and private.lr_scale == 1.0 and sgd.param_groups[0]["lr"] == 0.1


def test_make_private_calibrates_each_bands_sigma_once(monkeypatch):
    """Choosing b calibrates σ_b for every candidate; the chosen b's σ and DP-SGD's σ_1 (for the
    learning-rate factor) are those same calibrations, not repeated (a PLD one takes seconds),
    and the result is the one an uncached calibration gives."""
    import adaclip.accounting as accounting
    from adaclip_torch.privacy import make_private

    real = accounting.calibrate_noise_multiplier
    calls = []

    def counting(**kw):
        calls.append((kw["sample_rate"], kw["steps"]))
        return real(**kw)

    monkeypatch.setattr(accounting, "calibrate_noise_multiplier", counting)
    model, adam, loader = _adam_parts(lr=1e-3)
    _, private, _ = make_private(model, adam, loader, target_epsilon=3.0, delta=1e-5, epochs=2)
    assert private.noise_mechanism == "banded" and private.lr_scale > 1.0
    assert len(calls) == len(set(calls)) and (0.01, 200) in calls  # σ_1: one call, shared
    b = len(private.correlated_noise.coefficients)
    assert private.noise_multiplier == real(target_epsilon=3.0, delta=1e-5, sample_rate=0.01 * b, steps=-(-200 // b))


def test_make_private_leaves_the_lr_alone_when_scaling_is_off_or_cannot_follow():
    from adaclip_torch.privacy import make_private

    model, adam, loader = _adam_parts()
    _, private, _ = make_private(model, adam, loader, target_epsilon=3.0, delta=1e-5, epochs=2,
                                 scale_adaptive_lr=False)
    assert private.noise_mechanism == "banded" and private.lr_scale == 1.0 and adam.param_groups[0]["lr"] == 1e-3
    # independent noise, or sigma given: nothing to scale
    for kw in ({"noise_mechanism": "independent"}, {"noise_multiplier": 1.0, "bands": 4}):
        model, adam, loader = _adam_parts()
        budget = {} if "noise_multiplier" in kw else {"target_epsilon": 3.0, "delta": 1e-5, "epochs": 2}
        _, private, _ = make_private(model, adam, loader, **budget, **kw)
        assert private.lr_scale == 1.0 and adam.param_groups[0]["lr"] == 1e-3
    # a scheduler attached before make_private keeps its own base rates: not scaled by default
    model, adam, loader = _adam_parts()
    scheduler = torch.optim.lr_scheduler.StepLR(adam, step_size=10)
    _, private, _ = make_private(model, adam, loader, target_epsilon=3.0, delta=1e-5, epochs=2)
    assert private.lr_scale == 1.0 and adam.param_groups[0]["lr"] == 1e-3 and scheduler.base_lrs == [1e-3]


@pytest.mark.parametrize(
    "build, kwargs, match",
    [
        ("sgd", {"target_epsilon": 3.0, "delta": 1e-5, "epochs": 2}, "not adaptive"),
        ("adam", {"target_epsilon": 3.0, "delta": 1e-5, "epochs": 2, "noise_mechanism": "independent"}, "not banded"),
        ("adam", {"noise_multiplier": 1.0, "bands": 4}, "not calibrated"),
        ("scheduled", {"target_epsilon": 3.0, "delta": 1e-5, "epochs": 2}, "scheduler"),
    ],
)
def test_make_private_refuses_scale_adaptive_lr_true_where_it_cannot_apply(build, kwargs, match):
    from adaclip_torch.privacy import make_private

    model, inner, loader = _private_parts(n=2000) if build == "sgd" else _adam_parts()
    if build == "scheduled":
        torch.optim.lr_scheduler.StepLR(inner, step_size=10)
    before = [dict(g) for g in inner.param_groups]
    with pytest.raises(InvalidHyperparameterError, match=match):
        make_private(model, inner, loader, scale_adaptive_lr=True, **kwargs)
    assert [dict(g) for g in inner.param_groups] == before
    with pytest.raises(InvalidHyperparameterError, match="scale_adaptive_lr"):
        make_private(model, inner, loader, delta=1e-5, target_epsilon=3.0, epochs=2, scale_adaptive_lr="yes")


def test_adams_second_moment_under_banded_noise_is_rho_squared_times_dp_sgds():
    """The premise of the scaling, checked on torch's Adam: fed pure noise releases (the
    noise-dominated regime), its √v̂ under banded noise at σ_b is ρ times its √v̂ under
    independent noise at σ_1. Negative control: σ_b/σ_1 alone misses it."""
    from adaclip.correlated.coefficients import adaptive_lr_scale, sqrt_toeplitz_coefficients

    d, steps, sigma_b, sigma_1 = 4000, 400, 1.45, 0.94
    c = sqrt_toeplitz_coefficients(4)
    rms = {}
    for name, mechanism, sigma in (("banded", BandedNoise(c), sigma_b), ("independent", BandedNoise([1.0]), sigma_1)):
        p = torch.zeros(d, requires_grad=True)
        adam = torch.optim.Adam([p], lr=1e-3, betas=(0.9, 0.99))
        state, gen = mechanism.init(), torch.Generator().manual_seed(7)
        for _ in range(steps):
            (x,), state = mechanism.correlate(state, [torch.randn(d, generator=gen, dtype=torch.float64)])
            p.grad = (sigma * x).float()
            adam.step()
        rms[name] = float(adam.state[p]["exp_avg_sq"].mean().sqrt())
    rho = adaptive_lr_scale(c, steps, sigma=sigma_b, sigma_independent=sigma_1)
    assert rms["banded"] / rms["independent"] == pytest.approx(rho, rel=0.03)
    assert abs(rms["banded"] / rms["independent"] - sigma_b / sigma_1) > 0.2 * rho


def test_make_private_keeps_the_chosen_bands_buffers_within_the_budget(monkeypatch):
    """The library's b leaves out candidates whose buffers, (b − 1)·d numbers, exceed
    BANDED_BUFFER_BUDGET_BYTES; a given bands= is the user's choice and is kept."""
    from adaclip_torch import privacy
    from adaclip_torch.privacy import make_private

    model, sgd, loader = _private_parts(n=2000)
    _, private, _ = make_private(model, sgd, loader, target_epsilon=3.0, delta=1e-5, epochs=2)
    unbounded = private._stream.bands
    per_band = sum(p.numel() * p.element_size() for p in model.parameters())
    assert unbounded > 4
    monkeypatch.setattr(privacy, "BANDED_BUFFER_BUDGET_BYTES", 3 * per_band)  # room for b − 1 = 3
    model, sgd, loader = _private_parts(n=2000)
    _, private, _ = make_private(model, sgd, loader, target_epsilon=3.0, delta=1e-5, epochs=2)
    assert private._stream.bands == 4
    model, sgd, loader = _private_parts(n=2000)
    _, private, _ = make_private(model, sgd, loader, target_epsilon=3.0, delta=1e-5, epochs=2, bands=8)
    assert private._stream.bands == 8


def test_accumulate_with_banded_noise_releases_the_logical_batch_once():
    """A drawn batch split into physical batches with accumulate(): the same release as one step
    on the whole batch (same noise stream, same accounting)."""
    torch.manual_seed(2)
    xs, ys = torch.randn(N, 6), torch.randint(0, 5, (N,))
    released = []
    for split in (False, True):
        model = nn.Linear(6, 5)
        nn.init.constant_(model.weight, 0.05)
        nn.init.zeros_(model.bias)
        accountant = Accountant("rdp")
        opt, sampler = _optimizer(model, bands=2, seed=3, accountant=accountant, max_grad_norm=5.0,
                                  loss_reduction="sum")
        it = _forever(sampler)
        for _ in range(4):
            idx = next(it)
            parts = [idx[: len(idx) // 2], idx[len(idx) // 2:]] if split else [idx]
            for part in parts[:-1]:
                nn.functional.cross_entropy(model(xs[part]), ys[part], reduction="sum").backward()
                opt.accumulate()
            nn.functional.cross_entropy(model(xs[parts[-1]]), ys[parts[-1]], reduction="sum").backward()
            opt.step()
            opt.zero_grad()
        released.append(([p.detach().clone() for p in model.parameters()], accountant.history))
    for a, b in zip(released[0][0], released[1][0], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)  # float32: the sums' order differs
    assert released[0][1] == released[1][1] == ((0.2, 1.0, 2),)


def test_make_private_default_is_the_library_choice_of_bands_when_it_knows_the_run():
    """noise_mechanism="auto" (the default): with target_epsilon and epochs it is
    noise_mechanism="banded", bands=None (the same b, σ and trajectory); with a given noise
    multiplier, or compile_release=True, it is DP-SGD."""
    from adaclip_torch.privacy import make_private

    runs = []
    for extra in ({}, {"noise_mechanism": "banded"}):
        model, opt, loader = _private_parts()
        model, private, loader = make_private(model, opt, loader, target_epsilon=3.0, delta=1e-5, epochs=5, seed=2,
                                              **extra)  # fmt: skip  (50 steps: shorter runs get b = 1)
        for x, y in loader:
            nn.functional.cross_entropy(model(x), y).backward()
            private.step()
            private.zero_grad()
        runs.append((private, [p.detach().clone() for p in model.parameters()], loader.batch_sampler))
    (auto, auto_params, auto_sampler), (banded, banded_params, _) = runs
    assert auto.noise_mechanism == "banded" and auto_sampler.bands == banded._stream.bands > 1
    assert auto.hyperparameters().noise_multiplier == banded.hyperparameters().noise_multiplier
    assert auto.accountant.history == banded.accountant.history
    for a, b in zip(auto_params, banded_params, strict=True):
        assert torch.equal(a, b)
    model, opt, loader = _private_parts()
    _, private, loader = make_private(model, opt, loader, noise_multiplier=1.0, max_grad_norm=1.0)
    assert private.noise_mechanism == "independent" and not hasattr(loader.batch_sampler, "bands")


# --------------------------------------------------------------------------- which batch a step releases


def _frozen(opt, model, sampler) -> tuple:
    """What a refused step must leave as it was: parameters, step count, noise generator,
    accountant, the sampler's counters."""
    draws = getattr(sampler, "draws", None)
    return (
        [p.detach().clone() for p in model.parameters()],
        opt.steps,
        opt._noise.get_state().clone(),
        None if opt.accountant is None else (opt.accountant.steps, opt.accountant.history),
        getattr(sampler, "position", None),
        getattr(draws, "delivered", None),
    )


def _assert_same(a: tuple, b: tuple) -> None:
    for x, y in zip(a[0], b[0], strict=True):
        assert torch.equal(x, y)
    assert torch.equal(a[2], b[2])
    assert a[1] == b[1] and a[3:] == b[3:]


@pytest.mark.parametrize("bands", [2, 1])
def test_a_user_level_step_without_user_ids_is_refused_before_anything_changes(bands):
    """Hole (issue 41, item 2): given a PoissonUserBatchSampler the optimizer accounts users (q and
    B̄ count users), but step() without user_ids clipped each example on its own: one user with 8
    examples moved the release by 8·C. The optimizer knows the run is user level, so it refuses;
    an empty batch needs no ids. bands=1: the same with independent noise (sampler= given)."""
    from adaclip_torch.data import PoissonUserBatchSampler

    users = torch.tensor([0] * 8 + [1] * 2 + [2] * 3)
    sampler = PoissonUserBatchSampler(users, 0.25, bands=bands, generator=torch.Generator().manual_seed(5))
    model = nn.Linear(4, 1)
    mechanism = {"noise_mechanism": "banded", "bands": 2} if bands == 2 else {}
    opt = FlatClip(torch.optim.SGD(model.parameters(), lr=1.0), model, max_grad_norm=0.01, noise_multiplier=1.0,
                   expected_batch_size=sampler.expected_batch_size, sample_rate=0.25, accountant=Accountant("rdp"),
                   seed=0, sampler=sampler, loss_reduction="sum", **mechanism)  # fmt: skip
    it = iter(sampler)
    next(it)  # the step's draw
    x, y = torch.randn(len(users), 4), torch.randn(len(users), 1)
    (0.5 * ((model(x) - y) ** 2).sum()).backward()
    before = _frozen(opt, model, sampler)
    with pytest.raises(InvalidGradientError, match=r"user_ids="):
        opt.step()
    _assert_same(before, _frozen(opt, model, sampler))
    with pytest.raises(InvalidGradientError, match=r"user_ids="):
        opt.accumulate()
    _assert_same(before, _frozen(opt, model, sampler))
    opt.step(user_ids=users)  # the same batch, per user: released
    opt.zero_grad()
    next(it)
    opt.step(empty_batch=True)  # no user sampled: nothing to name
    assert opt.steps == 2 and opt.accountant.steps == (1 if bands == 2 else 2)  # banded: one per cycle
    assert opt.user_level


def _workers_run(workers: int, *, skip=None, twice=None, stop_after=None, epochs=2, persistent=False, bands=4):
    """Train on poisson_data_loader(bands=b, num_workers=workers) (N = 64, q = 1/8: 8 steps per
    pass); the batch at draw ``skip`` is skipped, the one at ``twice`` stepped twice, and the loop
    stops after ``stop_after`` releases. Every refused step is checked to change nothing. Returns
    the units of each release in order, the refusal (or None) and the loader."""
    from torch.utils.data import TensorDataset

    from adaclip_torch.data import poisson_data_loader

    n, q = 64, 1 / 8
    ds = TensorDataset(torch.arange(n), torch.randn(n, 6))
    loader = poisson_data_loader(ds, q, bands=bands, num_workers=workers, persistent_workers=persistent,
                                 generator=torch.Generator().manual_seed(3))  # fmt: skip
    model = _zero_model()
    opt = FlatClip(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=1.0, max_grad_norm=1.0,
                   expected_batch_size=q * n, sample_rate=q, accountant=Accountant("rdp"), seed=0,
                   noise_mechanism="banded", bands=bands, sampler=loader.batch_sampler)  # fmt: skip
    released: list[set[int]] = []
    seen = 0
    for _ in range(epochs):
        for idx, x in loader:
            pos, seen = seen, seen + 1
            if pos == skip:
                continue
            for _ in range(2 if pos == twice else 1):
                model(x).sum().backward()
                before = _frozen(opt, model, loader.batch_sampler)
                try:
                    opt.step()
                except InvalidGradientError as err:
                    _assert_same(before, _frozen(opt, model, loader.batch_sampler))
                    return released, err, loader
                opt.zero_grad()
                released.append(set(idx.tolist()))
                if len(released) == stop_after:
                    return released, None, loader
    return released, None, loader


def _too_close(released: list[set[int]], b: int) -> list[tuple[int, int, int]]:
    """Units released twice less than ``b`` steps apart: (unit, first step, second step)."""
    last: dict[int, int] = {}
    close = []
    for t, units in enumerate(released):
        for u in units:
            if u in last and t - last[u] < b:
                close.append((u, last[u], t))
            last[u] = t
    return close


@pytest.mark.parametrize(
    ("scenario", "kwargs"),
    [
        ("skip among the last batches of the final pass", {"skip": 8 + 6}),
        ("a batch stepped twice, the loop ending before the pass", {"twice": 2, "stop_after": 7, "epochs": 1}),
        ("skip mid-pass", {"skip": 8 + 1}),
        ("skip the last batch of a pass, then a new pass", {"skip": 7}),
        ("the very last batch of the run stepped twice", {"twice": 15}),
    ],
)
def test_with_workers_a_skipped_or_repeated_batch_is_refused_before_any_misaligned_release(scenario, kwargs):
    """Hole (issue 41, item 3): the look-ahead allowance for DataLoader workers let a batch skipped
    among the last ones of the final pass, or a batch stepped twice before the loop ended, release
    units less than b steps apart without an error. The loader now counts the batches it hands to
    the loop and step t must release draw t exactly: refused at the first misaligned step, before
    its release, whatever the workers prefetched."""
    released, err, _ = _workers_run(2, **kwargs)
    assert err is not None, scenario
    assert not _too_close(released, 4), scenario


def test_with_workers_breaking_out_and_starting_again_keeps_every_release_on_its_group():
    """The draws the workers prefetched and never handed out are discarded when the next pass
    begins, so a loop that breaks out early (and one with persistent workers) goes on with step t
    on draw t, group t mod b; the sampler's state restores consistently."""
    from torch.utils.data import TensorDataset

    from adaclip_torch.data import poisson_data_loader

    n, q, b = 64, 1 / 8, 4
    ds = TensorDataset(torch.arange(n), torch.randn(n, 6))
    for persistent in (False, True):
        loader = poisson_data_loader(ds, q, bands=b, num_workers=2, persistent_workers=persistent,
                                     generator=torch.Generator().manual_seed(3))  # fmt: skip
        sampler = loader.batch_sampler
        model = _zero_model()
        opt = FlatClip(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=1.0, max_grad_norm=1.0,
                       expected_batch_size=q * n, sample_rate=q, seed=0, noise_mechanism="banded", bands=b,
                       sampler=sampler)  # fmt: skip
        groups = []
        for stop in (3, 5, None, 2):  # break out after `stop` batches, then start a new pass
            for k, (idx, x) in enumerate(loader):
                model(x).sum().backward()
                opt.step()
                opt.zero_grad()
                groups.append({int(sampler.groups[i]) for i in idx.tolist()})
                if k + 1 == stop:
                    break
            assert sampler.position >= sampler.draws.delivered == opt.steps  # prefetched draws, if any, ahead
        assert all(g <= {t % b} for t, g in enumerate(groups))
        state = sampler.state_dict()
        assert state["position"] == opt.steps  # what the loop received, not what the workers prefetched
        sampler.load_state_dict(state)
        idx, x = next(iter(loader))
        assert {int(sampler.groups[i]) for i in idx.tolist()} <= {opt.steps % b}
        model(x).sum().backward()
        opt.step()
        del loader  # its workers


def test_a_loader_of_ones_own_over_the_cyclic_sampler_is_checked_exactly():
    """Without the counting loader the check is on the sampler's draws, with no allowance: exact
    with num_workers=0; with workers the draws run ahead and the step is refused, naming
    poisson_data_loader. in_order=False with workers is refused; so are draws from a sampler that
    a counting loader drives, and a superseded pass."""
    from torch.utils.data import DataLoader, TensorDataset

    from adaclip_torch.data import poisson_data_loader

    n, q, b = 64, 1 / 8, 4
    ds = TensorDataset(torch.arange(n), torch.randn(n, 6))
    for workers in (0, 2):
        sampler = CyclicPoissonBatchSampler(n, q, b, generator=torch.Generator().manual_seed(3))
        loader = DataLoader(ds, batch_sampler=sampler, num_workers=workers)
        model = _zero_model()
        opt = FlatClip(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=1.0, max_grad_norm=1.0,
                       expected_batch_size=q * n, sample_rate=q, seed=0, noise_mechanism="banded", bands=b,
                       sampler=sampler)  # fmt: skip
        for _idx, x in loader:
            model(x).sum().backward()
            if workers == 0:
                opt.step()
                opt.zero_grad()
                continue
            before = _frozen(opt, model, sampler)
            with pytest.raises(InvalidGradientError, match="poisson_data_loader"):
                opt.step()
            _assert_same(before, _frozen(opt, model, sampler))
            break
        assert opt.steps == (8 if workers == 0 else 0)
    with pytest.raises(InvalidHyperparameterError, match="in_order"):
        poisson_data_loader(ds, q, bands=b, num_workers=2, in_order=False)
    loader = poisson_data_loader(ds, q, bands=b, generator=torch.Generator().manual_seed(3))
    with pytest.raises(InvalidHyperparameterError, match="iterate that loader"):
        next(iter(loader.batch_sampler))
    first = iter(loader)
    next(first)
    second = iter(loader)
    with pytest.raises(InvalidHyperparameterError, match="superseded"):
        next(first)
    next(second)
    assert loader.batch_sampler.draws.delivered == 2
