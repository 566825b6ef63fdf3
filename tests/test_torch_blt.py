"""BLT correlated noise in the PyTorch optimizer, checked against the core's maths.

The release with a zero clipped sum is ``σ·x_t/B̄``: the tests read ``x_t`` off ``p.grad`` and
compare it with the NumPy reference (:class:`adaclip.correlated.BltNoise` on the same standard
normals), check the accounting (one Gaussian event per block of ``b`` steps at rate 1, composing
to ``σ/Δ_t``), the sampler rules and checkpoints.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats
from torch import nn

from adaclip.accounting import Accountant, MinSeparationGaussian, MinSeparationParticipation
from adaclip.correlated import BltNoise
from adaclip.errors import InvalidGradientError, InvalidHyperparameterError
from adaclip_torch import AdaClip, FlatClip
from adaclip_torch.data import CyclicPoissonBatchSampler, FixedOrderBatchSampler, PoissonBatchSampler
from adaclip_torch.noise import NoiseSource

pytestmark = pytest.mark.torch

N, BATCH = 40, 8  # 5 batches per epoch: min separation 5
THETA, OMEGA = (0.9, 0.4), (0.3, 0.2)


def _zero_model() -> nn.Module:
    m = nn.Linear(6, 5, bias=False)
    nn.init.zeros_(m.weight)
    return m


def _optimizer(model, *, sigma=1.0, seed=7, sampler=None, accountant=None, cls=FlatClip, mech=None, **kw):
    sampler = sampler if sampler is not None else FixedOrderBatchSampler(
        N, BATCH, generator=torch.Generator().manual_seed(2))
    kw.setdefault("max_grad_norm", 1.0)
    mech = BltNoise(THETA, OMEGA) if mech is None else mech
    return cls(torch.optim.SGD(model.parameters(), lr=1.0), model, noise_multiplier=sigma, expected_batch_size=BATCH,
               sample_rate=BATCH / N, seed=seed, accountant=accountant, noise_mechanism=mech, sampler=sampler,
               **kw), sampler


def _forever(sampler):
    while True:
        yield from sampler


def _released(opt, model, sampler, steps: int, it=None) -> list[np.ndarray]:
    out = []
    it = _forever(sampler) if it is None else it
    for _ in range(steps):
        idx = next(it)
        (0.0 * model(torch.randn(len(idx), 6))).sum().backward()
        opt.step()
        out.append(model.weight.grad.detach().numpy().copy())
        opt.zero_grad()
    return out


def _standard_normals(seed: int, steps: int) -> list[np.ndarray]:
    source = NoiseSource(seed=seed)
    like = [torch.zeros(5, 6)]
    return [source.standard_normal(like)[0].numpy().copy() for _ in range(steps)]


def _reference(steps: int, seed: int, sigma: float) -> list[np.ndarray]:
    mech = BltNoise(THETA, OMEGA)
    state, out = mech.init(), []
    for z in _standard_normals(seed, steps):
        x, state = mech.correlate(state, [z.astype(np.float64)])
        out.append(sigma * x[0] / BATCH)
    return out


def test_fixed_order_sampler_cycles_the_same_disjoint_batches():
    sampler = FixedOrderBatchSampler(23, 5, generator=torch.Generator().manual_seed(0))
    assert sampler.num_batches == 5 and len(sampler) == 5 and sampler.sample_rate == 5 / 23
    first = list(sampler)
    assert sorted(i for b in first for i in b) == list(range(23))  # disjoint, covering
    assert [len(b) for b in first] == [5, 5, 5, 5, 3]
    assert list(sampler) == first and sampler.position == 10  # same order every epoch
    shuffled = FixedOrderBatchSampler(23, 5, generator=torch.Generator().manual_seed(1))
    assert list(shuffled) != first  # the order comes from the generator
    saved = sampler.state_dict()
    other = FixedOrderBatchSampler(23, 5, generator=torch.Generator().manual_seed(5))
    other.load_state_dict(saved)
    assert list(other) == first
    with pytest.raises(InvalidHyperparameterError):
        other.load_state_dict({"order": torch.zeros(23, dtype=torch.long), "position": 0})
    for args in ((0, 1), (5, 6), (5, 0)):
        with pytest.raises(InvalidHyperparameterError):
            FixedOrderBatchSampler(*args)


def test_the_release_is_the_reference_blt_noise_on_the_same_draws():
    model = _zero_model()
    opt, sampler = _optimizer(model, sigma=1.3, seed=7)
    got = _released(opt, model, sampler, 12)
    for a, b in zip(got, _reference(12, 7, 1.3), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    assert opt.noise_mechanism == "blt" and opt.accounted_sample_rate == 1.0 and opt.noise_coefficients is None


def test_the_accountant_records_per_block_and_composes_to_the_gaussian_mechanism():
    model = _zero_model()
    accountant = Accountant("rdp")
    sigma, b = 3.0, N // BATCH
    opt, sampler = _optimizer(model, sigma=sigma, accountant=accountant)
    _released(opt, model, sampler, 11)  # steps 0, 5, 10 open a block: 3 events covering 15 steps
    assert [(q, c) for q, _, c in accountant.history] == [(1.0, 1)] * 3
    column = BltNoise(THETA, OMEGA).column(15)
    part = MinSeparationParticipation(b)
    whole = MinSeparationGaussian(noise_multiplier=sigma, sensitivity=part.sensitivity(column))
    assert accountant.epsilon(1e-5) == pytest.approx(whole.epsilon(1e-5, accountant="rdp"), rel=1e-9)
    s = part.prefix_sensitivities_squared(column)
    assert accountant.history[1][1] == pytest.approx(sigma / math.sqrt(s[10] - s[5]), rel=1e-12)


def test_the_budget_is_checked_at_each_block_start_before_anything_changes():
    from adaclip.errors import BudgetExceededError

    sigma, b = 3.0, N // BATCH
    s = MinSeparationParticipation(b).prefix_sensitivities_squared(BltNoise(THETA, OMEGA).column(10))
    budget = MinSeparationGaussian(noise_multiplier=sigma, sensitivity=math.sqrt(s[10])).epsilon(
        1e-5, accountant="rdp") * 1.0001  # room for exactly two blocks
    model = _zero_model()
    accountant = Accountant("rdp", target_epsilon=budget, delta=1e-5)
    opt, sampler = _optimizer(model, sigma=sigma, accountant=accountant)
    it = _forever(sampler)
    _released(opt, model, sampler, 10, it)
    before = model.weight.detach().clone()
    (0.0 * model(torch.randn(len(next(it)), 6))).sum().backward()
    with pytest.raises(BudgetExceededError):
        opt.step()
    assert torch.equal(model.weight, before) and opt.steps == 10


def test_blt_refuses_the_wrong_sampler_and_options():
    model = _zero_model()
    base = dict(noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=8.0, sample_rate=BATCH / N)
    inner = torch.optim.SGD(model.parameters(), lr=1.0)
    mech = BltNoise(THETA, OMEGA)
    for sampler in (None, PoissonBatchSampler(N, BATCH / N), CyclicPoissonBatchSampler(N, BATCH / N, 5)):
        with pytest.raises(InvalidHyperparameterError, match="FixedOrderBatchSampler"):
            FlatClip(inner, model, **base, noise_mechanism=mech, sampler=sampler)
        with pytest.raises(InvalidHyperparameterError, match="FixedOrderBatchSampler"):
            FlatClip(inner, model, **base, noise_mechanism="blt", sampler=sampler)
    fixed = FixedOrderBatchSampler(N, BATCH)
    with pytest.raises(InvalidHyperparameterError, match="cyclic Poisson"):
        FlatClip(inner, model, **base, noise_mechanism="banded", bands=5, sampler=fixed)
    with pytest.raises(InvalidHyperparameterError, match="total_steps|number of steps"):
        FlatClip(inner, model, **base, noise_mechanism="blt", sampler=fixed)  # nothing to fit for
    with pytest.raises(InvalidHyperparameterError, match="batch fraction"):
        FlatClip(inner, model, **{**base, "sample_rate": 0.5}, noise_mechanism=mech, sampler=fixed)
    with pytest.raises(InvalidHyperparameterError, match="noise_schedule"):
        FlatClip(inner, model, max_grad_norm=1.0, expected_batch_size=8.0, noise_schedule=[1.0, 0.5],
                 noise_mechanism=mech, sampler=fixed)
    with pytest.raises(InvalidHyperparameterError, match="buffers"):
        FlatClip(inner, model, **base, noise_mechanism="banded", bands=5, buffers=2,
                 sampler=CyclicPoissonBatchSampler(N, BATCH / N, 5))
    assert not any(m._forward_hooks for m in model.modules())  # nothing was attached


def test_blt_string_fits_for_the_sampler_run():
    model = _zero_model()
    sampler = FixedOrderBatchSampler(N, BATCH, generator=torch.Generator().manual_seed(2), total_steps=30)
    opt = FlatClip(torch.optim.SGD(model.parameters(), lr=1.0), model, noise_multiplier=1.0, max_grad_norm=1.0,
                   expected_batch_size=BATCH, noise_mechanism="blt", buffers=2, sampler=sampler, seed=0)
    from adaclip.correlated.blt import fit_blt

    fitted = fit_blt(30, buffers=2, min_separation=5)
    assert opt._stream.mechanism == fitted
    assert opt.correlated_noise == fitted and opt.noise_mechanism == "blt" and opt.noise_coefficients is None
    opt.correlated_noise.theta = (0.0, 0.0)  # a copy: changing it changes nothing in the optimizer
    assert opt.correlated_noise == fitted
    _released(opt, model, sampler, 3)


def test_correlated_noise_view_of_banded_and_independent_noise():
    from adaclip.correlated import BandedNoise

    model = _zero_model()
    sampler = CyclicPoissonBatchSampler(N, BATCH / N, 4, generator=torch.Generator().manual_seed(2))
    banded = BandedNoise([0.8, 0.6])
    opt = FlatClip(torch.optim.SGD(model.parameters(), lr=1.0), model, noise_multiplier=1.0, max_grad_norm=1.0,
                   expected_batch_size=BATCH, noise_mechanism=BandedNoise([0.8, 0.6, 0.0, 0.0]), sampler=sampler,
                   seed=0)  # fmt: skip
    assert opt.correlated_noise == BandedNoise([0.8, 0.6, 0.0, 0.0]) != banded
    assert opt.correlated_noise.coefficients == opt.noise_coefficients
    opt.remove_hooks()
    plain = FlatClip(torch.optim.SGD(model.parameters(), lr=1.0), model, noise_multiplier=1.0, max_grad_norm=1.0,
                     expected_batch_size=BATCH, seed=0)  # fmt: skip
    assert plain.correlated_noise is None and plain.noise_mechanism == "independent"


def test_a_batch_stepped_twice_or_skipped_is_refused():
    model = _zero_model()
    opt, sampler = _optimizer(model)
    it = iter(sampler)
    (0.0 * model(torch.randn(len(next(it)), 6))).sum().backward()
    opt.step()
    opt.zero_grad()
    (0.0 * model(torch.randn(3, 6))).sum().backward()
    with pytest.raises(InvalidGradientError, match="stepped exactly once"):
        opt.step()
    opt.zero_grad()
    next(it), next(it)
    (0.0 * model(torch.randn(3, 6))).sum().backward()
    with pytest.raises(InvalidGradientError, match="skipped"):
        opt.step()
    assert opt.steps == 1


def test_seeded_checkpoint_saves_the_buffers_and_resumes_bit_for_bit():
    model_a = _zero_model()
    opt_a, sampler_a = _optimizer(model_a, seed=9)
    full = _released(opt_a, model_a, sampler_a, 10)
    model_b = _zero_model()
    opt_b, sampler_b = _optimizer(model_b, seed=9)
    _released(opt_b, model_b, sampler_b, 7)  # mid-block
    saved, sampler_state = opt_b.state_dict(), sampler_b.state_dict()
    assert saved["noise_stream"]["mechanism"] == "blt" and len(saved["noise_stream"]["buffers"]) == 2
    model_c = _zero_model()
    opt_c, sampler_c = _optimizer(model_c, seed=123)
    sampler_c.load_state_dict(sampler_state)
    with pytest.warns(Warning):
        opt_c.load_state_dict(saved)
    got = _released(opt_c, model_c, sampler_c, 3)
    for a, b in zip(got, full[7:], strict=True):
        np.testing.assert_array_equal(a, b)


def test_an_unseeded_checkpoint_saves_no_buffer_and_restarts_the_factor_and_its_accounting():
    model = _zero_model()
    accountant = Accountant("rdp")
    opt, sampler = _optimizer(model, seed=None, accountant=accountant)
    _released(opt, model, sampler, 7)
    saved = opt.state_dict()
    assert saved["noise_stream"]["buffers"] is None
    model2 = _zero_model()
    acc2 = Accountant("rdp")
    opt2, sampler2 = _optimizer(model2, seed=None, accountant=acc2)
    sampler2.load_state_dict(sampler.state_dict())
    opt2.load_state_dict(saved)
    assert len(acc2.history) == 2 and opt2.noise_stream_start == 7
    _released(opt2, model2, sampler2, 1)  # step 7 starts a new factor: its first block is accounted at once
    assert acc2.history[-1][1] == pytest.approx(acc2.history[0][1], rel=1e-12)
    # a banded checkpoint does not load into a BLT optimizer
    with pytest.raises(InvalidHyperparameterError, match="BLT"):
        opt2._stream.parse_state({"bands": 2, "buffers": None}, steps=7, shapes=opt2._shapes)


def test_released_noise_covariance_with_a_negative_control():
    """Many coordinates: C applied to the released noise is iid N(0, 1) (KS per step), and the
    released noise itself is not (its variance v_t > 1 for t ≥ 1): the negative control."""
    steps, d = 6, 20000
    model = nn.Linear(d, 1, bias=False)
    nn.init.zeros_(model.weight)
    sampler = FixedOrderBatchSampler(N, BATCH, generator=torch.Generator().manual_seed(2))
    opt = FlatClip(torch.optim.SGD(model.parameters(), lr=1.0), model, noise_multiplier=1.0, max_grad_norm=1.0,
                   expected_batch_size=1.0, noise_mechanism=BltNoise(THETA, OMEGA), sampler=sampler, seed=3)
    it, xs = _forever(sampler), []
    for _ in range(steps):
        idx = next(it)
        (0.0 * model(torch.randn(len(idx), d))).sum().backward()
        opt.step()
        xs.append(model.weight.grad.detach().double().numpy().ravel().copy())
        opt.zero_grad()
    x = np.stack(xs)
    import scipy.linalg

    C = scipy.linalg.toeplitz(BltNoise(THETA, OMEGA).column(steps), np.zeros(steps))
    white = C @ x
    assert min(stats.kstest(white[t], "norm").pvalue for t in range(steps)) > 1e-4
    cov = white @ white.T / d
    assert np.max(np.abs(cov - np.eye(steps))) < 5 * math.sqrt(2 / d)
    assert stats.kstest(x[steps - 1], "norm").pvalue < 1e-6  # negative control
    assert np.max(np.abs(x @ x.T / d - np.eye(steps))) > 10 * math.sqrt(2 / d)


def test_adaclip_runs_with_blt_noise_and_subtracts_its_variance():
    torch.manual_seed(1)
    model = nn.Linear(6, 5)
    opt, sampler = _optimizer(model, cls=AdaClip, max_grad_norm=None)
    xs, ys = torch.randn(N, 6), torch.randint(0, 5, (N,))
    for _ in range(2):
        for idx in sampler:
            nn.functional.cross_entropy(model(xs[idx]), ys[idx]).backward()
            opt.step()
            opt.zero_grad()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert opt._stream.variance() == pytest.approx(BltNoise(THETA, OMEGA).variance(10))


# ----------------------------------------------------------------------------- make_private


def _private_parts(n: int = 60, batch: int = 12):
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), DataLoader(ds, batch_size=batch)


def test_make_private_blt_fits_calibrates_and_spends_the_budget_without_amplification():
    from adaclip.correlated.blt import fit_blt
    from adaclip.errors import BudgetExceededError
    from adaclip_torch.privacy import make_private

    model, optimizer, loader = _private_parts()
    target, delta, epochs = 8.0, 1e-3, 3
    model, opt, loader = make_private(model, optimizer, loader, target_epsilon=target, delta=delta, epochs=epochs,
                                      noise_mechanism="blt", buffers=2, seed=0)
    assert opt.noise_mechanism == "blt" and isinstance(loader.batch_sampler, FixedOrderBatchSampler)
    b = 5  # 60 / 12
    assert opt.bands is None and opt.min_separation == b and f"blt, min separation {b}" in opt.summary()
    assert opt._stream.mechanism == fit_blt(epochs * b, buffers=2, min_separation=b)
    # σ is calibrated for the Gaussian mechanism with the min-separation sensitivity (PLD, the default accountant)
    part = MinSeparationParticipation(b)
    sens = part.sensitivity(opt._stream.mechanism.column(epochs * b))
    whole = MinSeparationGaussian(noise_multiplier=opt.noise_multiplier, sensitivity=sens)
    assert whole.epsilon(delta, accountant="pld") == pytest.approx(target, rel=1e-3)
    for _ in range(epochs):
        for xb, yb in loader:
            nn.functional.cross_entropy(model(xb), yb).backward()
            opt.step()
            opt.zero_grad()
    assert opt.steps == epochs * b
    assert opt.accountant.epsilon(delta) == pytest.approx(target, rel=1e-3)
    assert opt.accountant.epsilon(delta) <= target
    xb, yb = next(iter(loader))
    nn.functional.cross_entropy(model(xb), yb).backward()
    with pytest.raises(BudgetExceededError):
        opt.step()  # the next epoch's block does not fit


def test_make_private_blt_refusals():
    from adaclip_torch.privacy import make_private

    base = dict(target_epsilon=8.0, delta=1e-3, epochs=2)
    for kwargs, match in (
        ({"noise_mechanism": "blt", "noise_multiplier": 1.0}, "give target_epsilon, delta and epochs"),
        ({**base, "noise_mechanism": "blt", "bands": 2}, "bands= and band_coefficients="),
        ({**base, "noise_mechanism": "banded", "bands": 2, "buffers": 2}, "needs noise_mechanism='blt'"),
        ({**base, "noise_mechanism": "blt", "buffers": 7}, "buffers must be one of"),
        ({**base, "noise_mechanism": "blt", "noise_multiplier": 0.05}, "no amplification"),
    ):
        model, optimizer, loader = _private_parts()
        with pytest.raises(InvalidHyperparameterError, match=match):
            make_private(model, optimizer, loader, **kwargs)
        assert not any(m._forward_hooks for m in model.modules())


def test_make_private_blt_plans_fixed_order_epochs_for_the_average():
    """N = 50, B = 12: ⌈N/B⌉ = 5 batches an epoch (Poisson sampling would plan round(1/q) = 4)."""
    from adaclip.averaging import config_from_spec
    from adaclip_torch.privacy import make_private

    model, optimizer, loader = _private_parts(n=50, batch=12)
    _, opt, loader = make_private(model, optimizer, loader, target_epsilon=8.0, delta=1e-3, epochs=4,
                                  noise_mechanism="blt", averaging="tail", seed=0)
    assert loader.batch_sampler.num_batches == 5 and len(loader) == 5
    assert opt.average.config == config_from_spec("tail", 20)
    assert opt.average.config != config_from_spec("tail", 16)


@pytest.mark.parametrize(("skip", "twice"), [(5 + 2, None), (None, 5 + 1)])
def test_make_private_blt_with_workers_refuses_a_skipped_or_repeated_batch_before_it_is_misreleased(skip, twice):
    """Hole (issue 41, item 3, BLT): make_private's fixed-order loader allowed its workers'
    prefetch as look-ahead, so a batch skipped among the last ones of the final epoch put the
    next releases on other batches' slots (a unit released less than an epoch apart), and so did
    a batch stepped twice while the workers were ahead. Now the loader counts the batches it hands
    to the loop and step t must release draw t: refused before the misaligned release."""
    from torch.utils.data import DataLoader

    from adaclip_torch.privacy import make_private

    model, optimizer, loader = _private_parts()  # 5 batches an epoch
    loader = DataLoader(loader.dataset, batch_size=12, num_workers=2)
    model, opt, loader = make_private(model, optimizer, loader, target_epsilon=8.0, delta=1e-3, epochs=2,
                                      noise_mechanism="blt", buffers=2, seed=0)  # fmt: skip
    released, seen, err = [], 0, None  # the fixed batch (draw mod 5) of each release
    for _ in range(2):
        for xb, yb in loader:
            pos, seen = seen, seen + 1
            if pos == skip:
                continue
            for _ in range(2 if pos == twice else 1):
                nn.functional.cross_entropy(model(xb), yb).backward()
                before = ([p.detach().clone() for p in model.parameters()], opt.steps, opt.accountant.steps)
                try:
                    opt.step()
                except InvalidGradientError as e:
                    err = e
                    assert all(torch.equal(a, p) for a, p in zip(before[0], model.parameters(), strict=True))
                    assert (opt.steps, opt.accountant.steps) == before[1:]
                    break
                opt.zero_grad()
                released.append(pos % 5)
            if err is not None:
                break
        if err is not None:
            break
    assert err is not None
    last: dict[int, int] = {}
    for t, batch in enumerate(released):  # every batch's releases exactly an epoch apart
        assert t - last.get(batch, -5) >= 5
        last[batch] = t
