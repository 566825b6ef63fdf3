"""One-run white-box audit of banded correlated noise in the JAX transformation.

As the PyTorch audit of banded noise (``tests/test_torch_audit_banded.py``): learning rate 0 (the
mechanism, not a model), b = 4 bands, q = 1/8 (each group at p = b·q = ½), T = 80 steps, so the
accountant records 20 compositions at rate ½. The canaries follow the cyclic rule (group
``state.step mod b``) and are scored by the whitened matched filter ``⟨C r, C s_g⟩``.

Contract: a correct run stays at or below the accountant's ε (GDP fit's lower end included) and
is seen with the μ the matched filter predicts; a run that releases σ/2 while σ is accounted is
detected; one band is the independent-noise audit, bit for bit.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import adaclip_jax  # noqa: E402
from adaclip.accounting import Accountant  # noqa: E402
from adaclip_jax.audit import GradientCanaryAuditor  # noqa: E402

pytestmark = pytest.mark.jax
DELTA = 1e-5
BANDS, Q, STEPS, SIGMA, M, N = 4, 0.125, 80, 4.0, 1000, 64


def audited_run(*, released_sigma=SIGMA, bands=BANDS, steps=STEPS, num_canaries=M, seed=0, independent=False,
                adaptive=False):
    """A banded flat-clipping run (AdaCliP's default with ``adaptive=True``) of random per-unit gradients
    under the auditor; the data are sampled with the cyclic masks of ``adaclip_jax``. The
    transformation releases ``released_sigma`` while the accountant records SIGMA."""
    params = {"w": jnp.zeros((50, 40))}  # d = 2000
    extra = {} if independent else {"noise_mechanism": "banded", "bands": bands}
    if adaptive:  # AdaClip()'s default (centred, per-tensor scale), started at C = 1
        tx = adaclip_jax.adaclip(noise_multiplier=released_sigma, expected_batch_size=N * Q, key=jax.random.key(seed),
                                 initial_max_grad_norm=1.0, **extra)  # fmt: skip
    else:
        tx = adaclip_jax.flat_clip(max_grad_norm=1.0, noise_multiplier=released_sigma, expected_batch_size=N * Q,
                                   key=jax.random.key(seed), **extra)  # fmt: skip
    state = tx.init(params)
    auditor = GradientCanaryAuditor(tx, params, num_canaries=num_canaries, seed=seed, sample_rate=Q)
    update = jax.jit(lambda g, s, m: tx.update(g, s, params, unit_mask=m))
    sample_key, group_key = jax.random.split(jax.random.key(1000 + seed))
    groups = adaclip_jax.assign_groups(group_key, N, bands)
    rate = min(1.0, bands * Q)
    rng = np.random.default_rng(seed)
    accountant = Accountant("pld")
    sampled_log = []
    for t in range(steps):
        mask = adaclip_jax.cyclic_poisson_mask(sample_key, t, groups, rate, bands=bands)
        grads = {"w": jnp.asarray(0.05 + 0.1 * rng.standard_normal((N, 50, 40)), jnp.float32)}
        grads, full_mask = auditor.insert(grads, state, unit_mask=mask)
        sampled_log.append(auditor._pending[0].copy())
        noisy, state = update(grads, state, full_mask)
        auditor.observe(noisy)
        if t % bands == 0:  # ⌈T/b⌉ compositions at p = b·q (the tracker's rule)
            accountant.step(noise_multiplier=SIGMA, sample_rate=rate)
    return auditor, accountant, sampled_log


@pytest.fixture(scope="module")
def correct_run():
    return audited_run()


def test_banded_audit_stays_within_the_accountant(correct_run):
    auditor, accountant, sampled = correct_run
    assert auditor.bands == BANDS
    groups = auditor.canaries.groups
    for t, s in enumerate(sampled):
        assert np.all(groups[s] == t % BANDS) and np.all(auditor.canaries.included[s])
    rep = auditor.report(delta=DELTA, accountant=accountant)
    assert not rep.exceeds_accountant and rep.epsilon_lower <= rep.accountant_epsilon, str(rep)
    assert rep.gdp.epsilon_lower <= rep.accountant_epsilon, str(rep)
    expected_mu = BANDS * Q * math.sqrt(STEPS / BANDS) / SIGMA  # 0.56
    assert abs(rep.gdp.mu - expected_mu) < 4 * rep.gdp.se, str(rep)


def test_banded_audit_detects_half_the_noise(correct_run):
    auditor, accountant, _ = audited_run(released_sigma=SIGMA / 2, seed=1)
    claimed = correct_run[1].epsilon(DELTA)
    assert accountant.epsilon(DELTA) == claimed  # the accountant saw σ, not σ/2
    rep = auditor.report(delta=DELTA, accountant=accountant)
    assert rep.gdp.epsilon_lower > claimed, str(rep)


def test_one_band_is_the_independent_audit_bit_for_bit():
    a, _, sa = audited_run(bands=1, steps=20, num_canaries=300, seed=5)
    b, _, sb = audited_run(bands=1, steps=20, num_canaries=300, seed=5, independent=True)
    assert a.bands == b.bands == 1
    for x, y in zip(sa, sb, strict=True):
        np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(a.canaries.scores, b.canaries.scores)


def test_banded_audit_of_adaclip_stays_within_the_accountant():
    """AdaCliP's default with banded noise: its centre and scale come from released values only,
    and the canaries are set from them, so the same contract holds."""
    auditor, accountant, _ = audited_run(adaptive=True, seed=3)
    rep = auditor.report(delta=DELTA, accountant=accountant)
    assert not rep.exceeds_accountant and rep.gdp.epsilon_lower <= rep.accountant_epsilon, str(rep)
