"""One-run white-box audit of banded correlated noise (amplified BandMF) in the PyTorch optimizer.

The audited runs have learning rate 0 (the mechanism, not the model: see ``docs/auditing.md``),
``b = 4`` bands, ``q = 1/8`` (each group sampled at ``p = b·q = ½``) and ``T = 80`` steps, so the
accountant records 20 compositions of the Poisson-subsampled Gaussian at rate ½. An included
canary joins each of the 20 steps of its group with probability ½; the whitened matched filter
sees it with GDP ``μ ≈ p·√(T/b)/σ``.

The contract, as for independent noise: a correct run's ``ε_emp`` (and the GDP fit's lower end)
stay at or below the accountant's ε; the same run with half the noise released while the full
noise is accounted is detected; canaries that ignore the cyclic rule are refused (and would
audit another mechanism: forced through, they exceed the accountant on a correct run); one band
is today's independent-noise audit, bit for bit.

The same contract for the quantile rule (QuantileClip), whose clip norm ``C_t`` adapts from the
released count: the auditor takes each step's ``C_t`` (public) from ``centre_and_scale()``, and
the canaries see the gradient's release at ``σ_g > σ`` (the count takes part of the budget), so
``μ ≈ p·√(T/b)/σ_g`` and the excluded canaries' spread is ``σ_g``'s.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from _canary_log import assert_half_noise_detected, log_canaries  # noqa: E402
from torch import nn  # noqa: E402

import adaclip_torch  # noqa: E402
from adaclip.accounting import Accountant  # noqa: E402
from adaclip.audit.gradient_canaries import GradientCanaries  # noqa: E402
from adaclip.correlated import BandedNoise  # noqa: E402
from adaclip.correlated.coefficients import sqrt_toeplitz_coefficients  # noqa: E402
from adaclip.errors import InvalidHyperparameterError  # noqa: E402
from adaclip_torch.audit import GradientCanaryAuditor  # noqa: E402
from adaclip_torch.data import CyclicPoissonBatchSampler, PoissonBatchSampler  # noqa: E402

pytestmark = pytest.mark.torch
DELTA = 1e-5
BANDS, Q, STEPS, SIGMA, M = 4, 0.125, 80, 4.0, 1000
N, IN, OUT = 64, 50, 40  # d = 2000 coordinates (2040 with AdaClip's bias)
# FlatClip(C = 1), or AdaClip's default preset started at the same C: each unit centred on the
# running mean of the releases, one scale per tensor learned from them (with AdaClip the model
# has a bias, so that there are two tensors and the scales move apart: with one tensor the
# per-tensor scale C·s^½/mean(s^½) is C whatever s is); or the quantile rule (QuantileClip), whose
# clip norm C_t follows the released count of unclipped units (see quantile_options)
STRATEGIES = {"flat": adaclip_torch.FlatClip, "adaclip": adaclip_torch.AdaClip, "quantile": adaclip_torch.QuantileClip}


def toeplitz(coefficients, steps: int) -> np.ndarray:
    """The banded lower-triangular Toeplitz ``C`` (``steps × steps``)."""
    c = np.asarray(coefficients, dtype=np.float64)
    return sum(np.diag(np.full(steps - k, c[k]), -k) for k in range(min(len(c), steps)))


def quantile_options(*, q: float, num_canaries: int) -> tuple[float, dict]:
    """``(B̄, options)`` of the audited QuantileClip (``C_0 = 1`` as the others).

    The count ``Σ_i (1[‖g_i‖ ≤ C_t] − ½)`` runs over every unit of the step, the canaries
    included, and each sampled canary (norm ``L·C_t``: clipped) adds ``−½`` to it — about
    ``m·q/2`` of them per step against ``N·q`` data units. So ``B̄`` counts them too (the
    expected number of units per step of the audited data set, ``N·q + m·q/2``) and ``σ_b`` is
    the default ``B̄/20``. At most the data's share of the units can be unclipped, so the target
    quantile is half that share, ``γ = N·q/(2B̄)`` (the data's median; a γ out of reach would
    make ``C_t`` grow every step), and ``η = 1``: ``C_t`` climbs from 1 to the data's gradient
    norms (about 7) in some 30 steps, then follows the noisy count up and down."""
    bbar = N * q + num_canaries * q / 2
    return bbar, {"target_quantile": N * q / (2 * bbar), "clip_learning_rate": 1.0}


def audited_run(*, noise_scale=1.0, bands=BANDS, q=Q, steps=STEPS, sigma=SIGMA, num_canaries=M, seed=0,
                canary_sampler=None, data_sampler=None, restore_at=None, strategy="flat", clip_norms=None):  # fmt: skip
    """A banded FlatClip run (``strategy="adaclip"``: AdaClip, ``"quantile"``: QuantileClip, see
    STRATEGIES) at learning rate 0 under the auditor.

    ``noise_scale``: the stream's correlated noise is multiplied by it (0.5: half the noise is
    released while the accountant records σ). ``canary_sampler(canaries, step)``: replaces the
    canaries' sampling (test-only, to force a wrong rule past the refusal). ``restore_at``: the
    optimizer (unseeded noise then) reloads its own state_dict before that step, which restarts
    its noise stream (no buffers saved). ``clip_norms``: a list, appended with each step's clip
    norm (``optimizer.max_grad_norm`` before the step; not for AdaClip). Returns the auditor, the accountant, and per step the
    canaries' read-backs and the sampled canaries."""
    torch.manual_seed(seed)
    model = nn.Linear(IN, OUT, bias=strategy == "adaclip")
    x, y = torch.randn(N, IN), torch.randint(0, OUT, (N,))
    gen = torch.Generator().manual_seed(seed)
    sampler = data_sampler(gen) if data_sampler else CyclicPoissonBatchSampler(N, q, bands, num_steps=steps,
                                                                                 generator=gen)  # fmt: skip
    extra = {} if isinstance(sampler, PoissonBatchSampler) else {
        "noise_mechanism": "banded", "bands": bands, "sampler": sampler}
    bbar, options = (N * q, {}) if strategy != "quantile" else quantile_options(q=q, num_canaries=num_canaries)
    accountant = Accountant("pld")
    opt = STRATEGIES[strategy](torch.optim.SGD(model.parameters(), lr=0.0), model, max_grad_norm=1.0,
                               noise_multiplier=sigma, expected_batch_size=bbar, loss_reduction="sum",
                               accountant=accountant, sample_rate=q, seed=None if restore_at else seed,
                               **extra, **options)  # fmt: skip
    if noise_scale != 1.0:
        correlate = opt._stream.correlate
        opt._stream.correlate = lambda z: [noise_scale * v for v in correlate(z)]
    auditor = GradientCanaryAuditor(opt, num_canaries=num_canaries, seed=seed)
    canaries = auditor.canaries
    if canary_sampler is not None:
        canaries.check_sampled = lambda *_: None  # forced past the refusal: the wrong rule is the point
    reads, sampled_log = log_canaries(canaries, sampler=canary_sampler)
    for t, idx in enumerate(sampler):
        if t == restore_at:
            opt.load_state_dict(opt.state_dict())
        nn.functional.cross_entropy(model(x[idx]), y[idx], reduction="sum").backward()
        if clip_norms is not None:
            clip_norms.append(opt.max_grad_norm)
        auditor.step()
        opt.zero_grad()
    auditor.remove()
    return auditor, accountant, np.array(reads), sampled_log


@pytest.fixture(scope="module")
def correct_run():
    return audited_run()


# --------------------------------------------------------------------------- the core: exact maths


def test_whitened_score_is_the_matched_filter_in_the_whitened_domain():
    """score = ⟨C r, C s_g⟩ column by column, for arbitrary read-backs (reference: dense C)."""
    c = np.asarray(sqrt_toeplitz_coefficients(4))
    steps, m, d = 13, 6, 10
    canaries = GradientCanaries(d, num_canaries=m, seed=3, sample_rate=0.25, noise_coefficients=c)
    rng = np.random.default_rng(0)
    reads = rng.standard_normal((steps, m))
    for t in range(steps):
        released = np.zeros(d)
        released[canaries.coordinates] = reads[t]
        canaries.observe(released, np.zeros(d), np.ones(d), expected_batch_size=1.0, step=t)
    big_c = toeplitz(c, steps)
    slots = np.array([[t % 4 == g for g in canaries.groups] for t in range(steps)], dtype=float)
    np.testing.assert_allclose(canaries.scores, ((big_c @ reads) * (big_c @ slots)).sum(0), rtol=1e-12)


def test_one_participation_scores_one_and_pure_noise_is_white():
    """A canary sampled once (away from the end) adds ‖c‖² = 1 to its score and nothing to the
    others'; the score of the released noise σC⁻¹z is N(0, σ²‖C s_g‖²): whitened."""
    from scipy import stats

    c = np.asarray(sqrt_toeplitz_coefficients(4))
    steps, m, sigma = 40, 4000, 2.0
    canaries = GradientCanaries(m, num_canaries=m, seed=1, sample_rate=0.25, noise_coefficients=c)
    one = GradientCanaries(12, num_canaries=12, seed=1, sample_rate=0.25, noise_coefficients=c)
    assert 0 < np.sum(one.groups == 1) < 12
    mech = BandedNoise(c)
    state = mech.init()
    rng = np.random.default_rng(2)
    for t in range(steps):
        x, state = mech.correlate(state, [rng.standard_normal(m)])
        canaries.observe(sigma * x[0], np.zeros(m), np.ones(m), expected_batch_size=1.0, step=t)  # j_i = i
        signal = np.zeros(12)
        if t == 9:  # group 1's slot
            signal[one.coordinates[one.groups == 1]] = 1.0
        one.observe(signal, np.zeros(12), np.ones(12), expected_batch_size=1.0, step=t)
    np.testing.assert_allclose(one.scores, np.where(one.groups == 1, 1.0, 0.0), atol=1e-12)
    big_c = toeplitz(c, steps)
    norms = np.array([np.linalg.norm(big_c @ (np.arange(steps) % 4 == g)) for g in range(4)])
    z = canaries.scores / (sigma * norms[canaries.groups])
    assert np.var(z) == pytest.approx(1.0, abs=0.1) and stats.kstest(z, "norm").pvalue > 1e-3


def test_cyclic_canary_sampling():
    c = sqrt_toeplitz_coefficients(4)
    canaries = GradientCanaries(4000, num_canaries=4000, seed=0, sample_rate=0.125, noise_coefficients=c)
    assert canaries.group_rate == 0.5 and np.bincount(canaries.groups, minlength=4).min() > 900
    last = np.full(4000, -100)
    counts = np.zeros(4000)
    for t in range(40):
        s = canaries.sample(t)
        assert np.all(canaries.included[s]) and np.all(canaries.groups[s] == t % 4)
        assert np.all(t - last[s] >= 4)  # at most once in any 4 consecutive steps
        last[s] = t
        counts[s] += 1
    rate = counts[canaries.included].sum() / (10 * canaries.included.sum())  # 10 slots per group
    assert rate == pytest.approx(0.5, abs=0.02)
    with pytest.raises(InvalidHyperparameterError, match="at most 2 bands"):
        GradientCanaries(10, num_canaries=2, seed=0, sample_rate=0.4, noise_coefficients=c)
    with pytest.raises(InvalidHyperparameterError, match="unit norm"):
        GradientCanaries(10, num_canaries=2, seed=0, sample_rate=0.1, noise_coefficients=[1.0, 0.5])


def test_canaries_outside_their_group_are_refused_and_nothing_changes():
    """(c) The decision: a canary sampling that ignores the cyclic rule is refused."""
    c = sqrt_toeplitz_coefficients(4)
    canaries = GradientCanaries(50, num_canaries=20, seed=0, sample_rate=0.25, noise_coefficients=c)
    wrong = np.flatnonzero(canaries.groups != 2)[:1]
    args = (np.ones(50), np.zeros(50), np.ones(50))
    with pytest.raises(ValueError, match="cyclic Poisson"):
        canaries.observe(*args, expected_batch_size=1.0, sampled=wrong, step=2)
    canaries.observe(*args, expected_batch_size=1.0, sampled=np.flatnonzero(canaries.groups == 2), step=2)
    with pytest.raises(ValueError, match="must increase"):
        canaries.observe(*args, expected_batch_size=1.0, step=2)
    with pytest.raises(ValueError, match="stream_start"):
        canaries.observe(*args, expected_batch_size=1.0, step=3, stream_start=4)
    assert canaries.steps == 1


# --------------------------------------------------------------------------- one-run audits


def gradient_noise_multiplier(optimizer) -> float:
    """``σ_g``, the multiplier of the gradient's noise: ``σ``, or with the quantile rule
    ``(σ⁻² − (2σ_b)⁻²)^{-1/2}`` (the count's release takes the rest of the budget)."""
    return optimizer.strategy.noise_multipliers(SIGMA, optimizer.expected_batch_size)[0]


def relative_spread(auditor) -> float:
    """The excluded canaries' spread over the predicted ``σ_g·‖C s_g‖`` (``‖C s_g‖² ≈ T/b``, the
    group's slots; a little less for the groups whose last slot is cut off by the end)."""
    return auditor.report(delta=DELTA).gdp.sd0 / (gradient_noise_multiplier(auditor.optimizer) * math.sqrt(STEPS / BANDS))


def assert_within_the_accountant(auditor, accountant, sampled) -> None:
    """A correct run's contract: the accountant recorded ⌈T/b⌉ compositions at b·q, the canaries
    followed the cyclic rule, ε_emp and the GDP fit's lower end stay at or below the accountant's
    ε, and μ̂ is the μ the whitened matched filter predicts for the gradient's release,
    ``b·q·√(T/b)/σ_g`` (within 4 SE)."""
    assert accountant.history == ((BANDS * Q, SIGMA, STEPS // BANDS),)
    groups = auditor.canaries.groups
    for t, s in enumerate(sampled):
        assert np.all(groups[s] == t % BANDS) and np.all(auditor.canaries.included[s])
    rep = auditor.report(delta=DELTA)
    assert not rep.exceeds_accountant and rep.epsilon_lower <= rep.accountant_epsilon, str(rep)
    assert rep.gdp.epsilon_lower <= rep.accountant_epsilon, str(rep)
    expected_mu = BANDS * Q * math.sqrt(STEPS / BANDS) / gradient_noise_multiplier(auditor.optimizer)  # σ_g = σ: 0.56
    assert abs(rep.gdp.mu - expected_mu) < 4 * rep.gdp.se, str(rep)


def test_banded_audit_stays_within_the_accountant(correct_run):
    """(a) ε_emp ≤ the accountant's ε (and the GDP fit's lower end too); the canaries are seen
    with the μ the whitened matched filter predicts."""
    auditor, accountant, _, sampled = correct_run
    assert_within_the_accountant(auditor, accountant, sampled)


def test_banded_audit_detects_half_the_noise(correct_run):
    """(b) Negative control: the stream releases σ/2·x while σ is accounted. The GDP fit's lower
    end (the certified one-run bound cannot reach an accountant's ε of 2.4 at m = 1000 with a
    doubled μ ≈ 1.1: it is capped near logit of the guesses' confidence) exceeds the claim."""
    auditor, accountant, _, _ = audited_run(noise_scale=0.5, seed=1)
    assert_half_noise_detected(auditor, accountant, correct_run, delta=DELTA)


@pytest.mark.parametrize("strategy", ["flat", "quantile"])
def test_banded_audit_certifies_missing_noise(strategy):
    """No noise released on the gradient, σ accounted (the quantile rule's count keeps its
    noise): the assumption-free one-run bound itself exceeds ε."""
    auditor, _, _, _ = audited_run(noise_scale=0.0, seed=2, steps=40, strategy=strategy)
    rep = auditor.report(delta=DELTA)
    assert rep.exceeds_accountant, str(rep)


def assert_adaptive(optimizer) -> None:
    """The run was AdaCliP's, not flat clipping in disguise: the centre it clips around has moved
    off 0 and the two tensors' scales (one value per tensor) apart; both follow the releases."""
    centre, scale = optimizer.centre_and_scale()
    assert centre is not None and max(float(a.abs().max()) for a in centre) > 0.01, centre
    assert all(float(b.max()) == float(b.min()) for b in scale)
    weight, bias = (float(b.max()) for b in scale)
    assert abs(weight / bias - 1) > 0.05, (weight, bias)


@pytest.fixture(scope="module")
def adaclip_run():
    return audited_run(strategy="adaclip")


def test_banded_audit_of_adaclip_stays_within_the_accountant(adaclip_run):
    """(a) AdaClip's default preset under banded noise: each canary is set from the step's
    ``(a, b)`` (``optimizer.centre_and_scale()``, functions of earlier releases only), so it is
    clipped to exactly ``e_j`` in the clipping space and its read-back ``(g̃_j − a_j)·B̄/b_j`` is
    ``Σ w̄ + σ(C⁻¹z)_j`` as with flat clipping; the same contract and the same μ hold. The data
    deviate from a centre that follows the releases, which damps the noise's slow part and a
    canary's signal alike (the excluded canaries' spread is a little under σ‖C s_g‖; the ratio,
    μ, is unchanged) — a function of earlier releases, so the bound stays valid."""
    auditor, accountant, _, sampled = adaclip_run
    assert isinstance(auditor.optimizer, adaclip_torch.AdaClip)
    assert_adaptive(auditor.optimizer)
    assert_within_the_accountant(auditor, accountant, sampled)


def test_banded_audit_of_adaclip_detects_half_the_noise(adaclip_run):
    """(b) Negative control: the AdaClip run's stream releases σ/2·x while σ is accounted; the
    GDP fit's lower end exceeds the accountant's ε and the one-run bound rises above the
    correct run's."""
    auditor, accountant, _, _ = audited_run(strategy="adaclip", noise_scale=0.5, seed=1)
    assert isinstance(auditor.optimizer, adaclip_torch.AdaClip)
    assert_half_noise_detected(auditor, accountant, adaclip_run, delta=DELTA)


@pytest.fixture(scope="module")
def quantile_run():
    clip_norms: list[float] = []
    return (*audited_run(strategy="quantile", clip_norms=clip_norms), clip_norms)


def test_banded_audit_of_quantile_stays_within_the_accountant(quantile_run):
    """(a) The quantile rule under banded noise. A step releases the gradient
    ``C_t·(Σ w̄ + σ_g x_t)/B̄`` (``x``: the stream's correlated noise) and the count of unclipped
    units with an independent ``N(0, σ_b²)``; ``C_{t+1}`` is a function of the released count,
    so each step's ``C_t`` is public, and the auditor takes it from
    ``optimizer.centre_and_scale()`` before the step (``a = 0``, ``b = C_t``): each canary is
    ``L·C_t·e_j``, clipped to ``C_t·e_j``, and its read-back ``g̃_j·B̄/C_t = Σ w̄ + σ_g x_{t,j}``
    is the banded series of flat clipping at multiplier ``σ_g``, however ``C_t`` moved — the
    same whitened matched filter applies. The accountant records σ for the pair; the count
    takes its share, ``σ_g = (σ⁻² − (2σ_b)⁻²)^{-1/2} > σ``, so the gradient's canaries are seen
    with ``μ_g = b·q·√(T/b)/σ_g ≈ 0.46`` (σ_b = B̄/20 = 3.5), below the ``0.56`` flat clipping
    shows at the same σ; the score ignores the count (a sum over all units, of no use for
    telling canaries apart), so it audits the gradient's part of the release only."""
    auditor, accountant, _, sampled, clip_norms = quantile_run
    opt = auditor.optimizer
    assert isinstance(opt, adaclip_torch.QuantileClip)
    # the clip norm adapted, up and down: C_0 = 1, then towards the data's norms (≈ 7)
    assert clip_norms[0] == 1.0 and max(clip_norms) > 4 and min(np.diff(clip_norms)) < 0, clip_norms
    assert float(opt.centre_and_scale()[1][0]) == opt.max_grad_norm != clip_norms[0]  # what the auditor reads
    sigma_b = opt.expected_batch_size / 20
    assert gradient_noise_multiplier(opt) == pytest.approx((SIGMA**-2 - (2 * sigma_b) ** -2) ** -0.5, rel=1e-12)
    assert gradient_noise_multiplier(opt) > 1.2 * SIGMA
    assert_within_the_accountant(auditor, accountant, sampled)
    assert 0.9 < relative_spread(auditor) < 1.1, relative_spread(auditor)  # released at σ_g, not σ


def test_banded_audit_of_quantile_sees_a_gradient_left_at_sigma(quantile_run):
    """Negative control of the spread check: the gradient's noise released at σ instead of σ_g
    (``noise_scale = σ/σ_g``) while the count is released with σ_b too — the count's share not
    taken from the gradient, a leak of ``μ² = (2σ_b)⁻²`` per participation that μ̂ and the GDP
    fit's lower end do not resolve at this m — shows as a spread near σ/σ_g = 0.82 of the
    predicted one, outside the correct run's band."""
    sigma_g = gradient_noise_multiplier(quantile_run[0].optimizer)
    auditor, _, _, _ = audited_run(strategy="quantile", noise_scale=SIGMA / sigma_g)
    assert relative_spread(auditor) < 0.9 < relative_spread(quantile_run[0]), relative_spread(auditor)


def test_banded_audit_of_quantile_detects_half_the_noise(quantile_run):
    """(b) Negative control: the quantile run's stream releases σ_g/2·x (the count keeps its
    noise) while σ is accounted; the GDP fit's lower end exceeds the accountant's ε and the
    one-run bound rises above the correct run's."""
    auditor, accountant, _, _ = audited_run(strategy="quantile", noise_scale=0.5, seed=1)
    assert isinstance(auditor.optimizer, adaclip_torch.QuantileClip)
    assert_half_noise_detected(auditor, accountant, quantile_run, delta=DELTA)


def test_canaries_ignoring_the_cyclic_rule_audit_another_mechanism(correct_run):
    """(c) Why the rule is enforced: Poisson canaries at the accounted rate b·q in every step
    (forced past the refusal) join ~b times as often as the accounting allows, and their audit
    of the same correct mechanism exceeds the accountant's ε — a false alarm about a mechanism
    that was never run. The auditor itself refuses them (the core checks every sampled set)."""

    def plain_poisson(canaries, step):
        hit = canaries._sampling.random(canaries.num_canaries) < canaries.group_rate
        return np.flatnonzero(hit & canaries.included)

    auditor, _, _, sampled = audited_run(canary_sampler=plain_poisson)
    assert any(np.any(auditor.canaries.groups[s] != t % BANDS) for t, s in enumerate(sampled))
    rep = auditor.report(delta=DELTA)
    right = correct_run[0].report(delta=DELTA)
    assert rep.epsilon_lower > right.epsilon_lower and rep.gdp.mu > 2 * right.gdp.mu, (str(rep), str(right))
    assert rep.gdp.epsilon_lower > rep.accountant_epsilon, str(rep)


def test_the_auditor_refuses_canaries_outside_their_group_before_inserting_them():
    torch.manual_seed(0)
    model = nn.Linear(IN, OUT, bias=False)
    sampler = CyclicPoissonBatchSampler(N, Q, BANDS, generator=torch.Generator().manual_seed(0))
    opt = adaclip_torch.FlatClip(torch.optim.SGD(model.parameters(), lr=0.0), model, max_grad_norm=1.0,
                                 noise_multiplier=1.0, expected_batch_size=N * Q, sample_rate=Q, seed=0,
                                 noise_mechanism="banded", bands=BANDS, sampler=sampler)  # fmt: skip
    auditor = GradientCanaryAuditor(opt, num_canaries=100, seed=0)
    outside = np.flatnonzero(auditor.canaries.included & (auditor.canaries.groups != 0))[:3]
    auditor.canaries.sample = lambda step=None: outside
    next(iter(sampler))
    with pytest.raises(ValueError, match="cyclic Poisson"):
        auditor.step()
    assert opt.steps == 0 and opt._accumulated is None and auditor.canaries.steps == 0


def test_a_score_that_uses_the_sampling_draws_would_flag_a_correct_run():
    """Why the score matches the canary's *group* and not its participations: the sampling draws
    are the randomness the accountant's amplification rests on. The matched filter on each
    canary's drawn steps (``hit`` before the inclusion mask, so it does not even see the coins)
    pushes the GDP fit of the same correct mechanism above the accountant's ε."""
    hits = []

    def drawn(c, step):
        hit = (c._sampling.random(c.num_canaries) < c.group_rate) & (c.groups == step % c.bands)
        hits.append(hit.astype(float))
        return np.flatnonzero(hit & c.included)  # the correct cyclic sampling, draws recorded

    auditor, accountant, reads, _ = audited_run(canary_sampler=drawn)
    big_c = toeplitz(auditor.optimizer._stream.mechanism.coefficients, STEPS)
    from adaclip.audit.report import audit_scores

    leaky = audit_scores(((big_c @ reads) * (big_c @ np.array(hits))).sum(0), auditor.canaries.included,
                         delta=DELTA, accountant_epsilon=accountant.epsilon(DELTA))  # fmt: skip
    fair = auditor.report(delta=DELTA)
    assert fair.gdp.epsilon_lower <= fair.accountant_epsilon < leaky.gdp.epsilon_lower, (str(fair), str(leaky))


def test_one_band_is_todays_audit_bit_for_bit():
    """(d) bands=1 'banded' noise and independent noise give the same canaries, the same
    sampling and the same scores, exactly — and those are today's: Σ_t of the read-backs."""
    runs = [
        audited_run(bands=1, q=Q, steps=30, num_canaries=300, seed=5),
        audited_run(bands=1, q=Q, steps=30, num_canaries=300, seed=5,
                    data_sampler=lambda g: PoissonBatchSampler(N, Q, num_steps=30, generator=g)),
    ]  # fmt: skip
    (banded, _, reads_b, sampled_b), (independent, _, reads_i, sampled_i) = runs
    assert banded.optimizer.noise_mechanism == "banded" and independent.optimizer.noise_mechanism == "independent"
    assert banded.canaries.groups is None and banded.canaries.bands == 1
    np.testing.assert_array_equal(banded.canaries.scores, independent.canaries.scores)
    np.testing.assert_array_equal(banded.canaries.included, independent.canaries.included)
    np.testing.assert_array_equal(banded.canaries.coordinates, independent.canaries.coordinates)
    for a, b in zip(sampled_b, sampled_i, strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(reads_b, reads_i)
    # today's score: the running sum of the read-backs, in step order
    want = np.zeros(300)
    for r in reads_i:
        want += r
    np.testing.assert_array_equal(independent.canaries.scores, want)


@pytest.mark.parametrize("restore_at", [None, 6])
def test_auditor_whitening_follows_the_stream(restore_at):
    """The auditor passes the optimizer's step and the stream's start to the core; its scores
    equal the reference ⟨C r, C s_g⟩ on the recorded read-backs — with ``C`` block diagonal when
    the stream restarted (an unseeded checkpoint restored at step 6: new buffers, new cycle)."""
    steps = 12
    auditor, accountant, reads, _ = audited_run(steps=steps, num_canaries=50, seed=7, restore_at=restore_at)
    c = auditor.optimizer._stream.mechanism.coefficients
    if restore_at is None:
        big_c = toeplitz(c, steps)
    else:
        assert auditor.optimizer._stream.cycle_start == restore_at
        big_c = np.zeros((steps, steps))
        big_c[:restore_at, :restore_at] = toeplitz(c, restore_at)
        big_c[restore_at:, restore_at:] = toeplitz(c, steps - restore_at)
    slots = np.array([[t % BANDS == g for g in auditor.canaries.groups] for t in range(steps)], dtype=float)
    np.testing.assert_allclose(auditor.canaries.scores, ((big_c @ reads) * (big_c @ slots)).sum(0),
                               rtol=1e-9, atol=1e-9)  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["flat", "adaclip", "quantile"])
@pytest.mark.parametrize("seed", [10, 11, 12])
def test_banded_audit_larger(seed, strategy):
    """Longer runs, more canaries, b = 8, FlatClip, AdaClip and the quantile rule: within the
    accountant when correct, detected at half the noise."""
    kw = dict(bands=8, q=1 / 16, steps=320, sigma=4.0, num_canaries=2000, seed=seed, strategy=strategy)
    auditor, accountant, _, _ = audited_run(**kw)
    rep = auditor.report(delta=DELTA)
    assert not rep.exceeds_accountant and rep.gdp.epsilon_lower <= rep.accountant_epsilon, str(rep)
    half, _, _, _ = audited_run(noise_scale=0.5, **kw | {"seed": seed + 100})
    rep_half = half.report(delta=DELTA)
    assert rep_half.gdp.epsilon_lower > accountant.epsilon(DELTA), str(rep_half)
